"""The output head fused with the cross-entropy, without the whole batch's logits.

``loss = CE(h_TH @ weight_VHᵀ, targets_T)`` is computed ``rows`` tokens at a time, so at
most one chunk's logits ``[rows, V]`` exist at once, in the compute dtype (the head GEMM's
output); :func:`dropless.ops.softmax_ce.softmax_ce_grad_` computes the chunk's loss and
gradient from them in fp32 (float64 for float64 inputs) and writes the gradient over the
logits (one Triton kernel on CUDA: the chunk read twice, written once). The full ``[T, V]``
fp32 logits of ``recipe=h200_single`` would be 17 GB (32,768 × 129,280 × 4 B). docs/design.md
"Precision": the loss never materialises fp32 logits for the whole batch.

Gradients are computed in the forward, chunk by chunk (the approach of Liger-Kernel's fused
linear cross-entropy, Hsu et al. 2024, arXiv:2410.10989 §3.3): for each chunk the softmax
minus the one-hot target, scaled by 1/n for the mean, gives ``dh`` for the chunk's rows and
is accumulated into an fp32 ``dW`` (on CUDA each chunk's bf16/fp16 product is summed in fp32 inside
the GEMM, ``torch.addmm(..., out_dtype=float32)``; on CPU it is rounded to the compute dtype
first); backward only multiplies the saved ``dh``/``dW`` by the
incoming gradient (a scalar), so any factor on the loss scales them. This trades a
``[T, H]`` + ``[V, H]`` gradient held from forward to backward for not recomputing the
logits in backward (the other choice: 4 head GEMMs instead of 3). Without grad
(``torch.no_grad()``, or inputs that do not require it) only the loss is computed.

Shape letters: T tokens, H hidden size, V vocabulary.

Implementations (:func:`resolve_loss_impl`, ``train.loss_impl``): ``torch`` (this module's,
any device and dtype) and ``liger`` (Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``,
CUDA, an optional dependency: ``pip install liger-kernel``).
"""

from __future__ import annotations

import functools
import importlib

import torch

from dropless.config import ConfigError
from dropless.ops.softmax_ce import softmax_ce_grad_

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "LOSS_IMPLS", "check_loss_impl", "chunk_rows", "linear_cross_entropy",
           "resolve_loss_impl"]

# Logits per chunk: 512 Mi elements = 2 GiB in fp32 (4,152 tokens at V = 129,280). A chunk must
# be large enough that its head GEMMs run at full rate and that dW (fp32 [V, H]) is read and
# written only a few times per step; 32 Mi (259 tokens) made recipe=h200_single 20 % slower.
DEFAULT_CHUNK_ELEMENTS = 1 << 29
LOSS_IMPLS = ("auto", "torch", "liger")


def chunk_rows(vocab_size: int, max_elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Tokens per chunk: ``max(1, max_elements // vocab_size)`` (a chunk's logits ≤ ``max_elements``
    unless one row alone is larger)."""
    if vocab_size < 1 or max_elements < 1:
        raise ValueError(f"chunk_rows: vocab_size={vocab_size} and max_elements={max_elements} must be >= 1")
    return max(1, int(max_elements) // int(vocab_size))


class _ChunkedLinearCE(torch.autograd.Function):
    """Loss (0-dim, dtype ``acc``) and, if asked, the gradients, chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, h_TH, w_VH, targets_T, ignore_index, rows, mean, compute_dtype, need_dh, need_dw):
        T, _ = h_TH.shape
        V = w_VH.shape[0]
        acc = torch.promote_types(compute_dtype, torch.float32)  # logits, softmax, loss
        valid_T = targets_T != ignore_index
        torch._assert_async(((targets_T >= 0) & (targets_T < V) | ~valid_T).all(),
                            f"linear_cross_entropy: a target id is outside [0, vocab_size={V}) and is not "
                            f"ignore_index={ignore_index}")
        tgt_T = torch.where(valid_T, targets_T, torch.zeros_like(targets_T))
        n_valid = valid_T.sum()
        scale = 1.0 / n_valid.clamp_min(1).to(acc) if mean else torch.ones((), dtype=acc, device=h_TH.device)
        w_T = valid_T.to(acc) * scale  # 1/n on counted rows (mean), 0 on ignored rows
        h_cd = h_TH.to(compute_dtype)
        w_cd = w_VH.to(compute_dtype)
        loss = torch.zeros((), dtype=acc, device=h_TH.device)
        # dh: each chunk's GEMM writes its rows in place; dW: the first chunk's product is dW
        # (no zero-filled [V, H] buffer), the later chunks add to it
        dh_TH = torch.empty(h_TH.shape, dtype=h_TH.dtype, device=h_TH.device) if need_dh else None
        dw_VH = None
        for lo in range(0, T, rows):
            hi = min(T, lo + rows)
            h_c = h_cd[lo:hi]
            # logits in the compute dtype (the GEMM's output); the loss and gradient in fp32 from them,
            # the gradient written over the logits (one chunk's [rows, V] alive at a time)
            z_CV = h_c @ w_cd.t()
            w_C = w_T[lo:hi]
            loss_C = softmax_ce_grad_(z_CV, tgt_T[lo:hi], w_C, grad=need_dh or need_dw)
            loss = loss + (loss_C.to(acc) * w_C).sum()
            if need_dh:
                if dh_TH.dtype == z_CV.dtype:
                    torch.mm(z_CV, w_cd, out=dh_TH[lo:hi])
                else:  # autocast over higher-precision h: rounded from the compute dtype
                    dh_TH[lo:hi] = z_CV @ w_cd
            if need_dw:
                dw_VH = _accumulate_dw(dw_VH, z_CV, h_c, acc)
            del z_CV
        if need_dw and dw_VH is None:  # T = 0
            dw_VH = torch.zeros(w_VH.shape, dtype=acc, device=w_VH.device)
        ctx.save_for_backward(dh_TH, dw_VH)
        ctx.w_dtype = w_VH.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh_TH, dw_VH = ctx.saved_tensors
        dh = dw = None
        if dh_TH is not None:
            dh = dh_TH * grad_loss.to(dh_TH.dtype)
        if dw_VH is not None:  # scale and round to the weight's dtype in one pass (fp32 product, then cast)
            dw = torch.empty(dw_VH.shape, dtype=ctx.w_dtype, device=dw_VH.device)
            torch.mul(dw_VH, grad_loss.to(dw_VH.dtype), out=dw)
        return dh, dw, None, None, None, None, None, None, None


def _accumulate_dw(dw_VH: torch.Tensor | None, z_CV: torch.Tensor, h_CH: torch.Tensor,
                   acc: torch.dtype) -> torch.Tensor:
    """``dW += z_CVᵀ h_CH`` in ``acc`` (``dw_VH`` None: the first chunk, whose product is dW)."""
    if z_CV.dtype == acc:
        if dw_VH is None:
            return torch.mm(z_CV.t(), h_CH)
        return dw_VH.addmm_(z_CV.t(), h_CH)
    if z_CV.is_cuda:  # bf16/fp16 operands, the fp32 product summed inside the GEMM
        if dw_VH is None:
            return torch.mm(z_CV.t(), h_CH, out_dtype=acc)
        return torch.addmm(dw_VH, z_CV.t(), h_CH, out_dtype=acc, out=dw_VH)
    # CPU: mm/addmm's out_dtype is CUDA-only; the product is rounded to the compute dtype
    if dw_VH is None:
        return (z_CV.t() @ h_CH).to(acc)
    return dw_VH.add_(z_CV.t() @ h_CH)


def linear_cross_entropy(h_TH: torch.Tensor, weight_VH: torch.Tensor, targets_T: torch.Tensor, *,
                         ignore_index: int = -100, reduction: str = "mean",
                         max_chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, impl: str = "torch") -> torch.Tensor:
    """``F.cross_entropy(h_TH @ weight_VHᵀ, targets_T)`` without the ``[T, V]`` logits.

    Args:
        h_TH: [T, H] floating hidden states (any leading shape is flattened into T).
        weight_VH: [V, H] output-head weight (``nn.Linear(H, V).weight``).
        targets_T: int64 target ids in ``[0, V)``, or ``ignore_index`` (no loss, zero gradient);
            same number of elements as T.
        reduction: ``"mean"`` over the non-ignored targets (0 when every target is ignored;
            ``F.cross_entropy`` gives NaN there) or ``"sum"``.
        max_chunk_elements: logits per chunk (``torch`` impl): ``chunk_rows(V, max_chunk_elements)``
            tokens at a time.
        impl: ``"torch"`` (this module) or ``"liger"`` (Liger-Kernel, CUDA; see
            :func:`resolve_loss_impl`).

    Returns:
        0-dim loss, fp32 (float64 for float64 inputs). Matmuls run in the autocast dtype under
        autocast, else in ``promote_types(h, weight)``; the logits, log-sum-exp and the loss
        in at least fp32; ``dW`` accumulates in fp32 over the chunks. Gradients flow to
        ``h_TH`` and ``weight_VH``.

    Raises:
        ValueError: bad shapes, dtype or ``reduction``.
        ConfigError: ``impl`` unknown, or ``"liger"`` where Liger-Kernel cannot run.
        RuntimeError: a target outside ``[0, V)`` other than ``ignore_index``
            (``torch._assert_async``: at once on CPU, a device-side assert on CUDA).
    """
    H = h_TH.shape[-1]
    h_TH = h_TH.reshape(-1, H)
    targets_T = targets_T.reshape(-1)
    if weight_VH.dim() != 2 or weight_VH.shape[1] != H:
        raise ValueError(f"linear_cross_entropy: weight {tuple(weight_VH.shape)} must be [V, H={H}]")
    if targets_T.shape[0] != h_TH.shape[0] or targets_T.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"linear_cross_entropy: targets ({targets_T.dtype}, {targets_T.numel()} elements) must be "
                         f"int64 with one id per token (T={h_TH.shape[0]})")
    if not h_TH.is_floating_point() or not weight_VH.is_floating_point():
        raise ValueError(f"linear_cross_entropy: h ({h_TH.dtype}) and weight ({weight_VH.dtype}) must be floating")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r} must be 'mean' or 'sum'")
    dev = h_TH.device.type
    if torch.is_autocast_enabled(dev):
        compute_dtype = torch.get_autocast_dtype(dev)
    else:
        compute_dtype = torch.promote_types(h_TH.dtype, weight_VH.dtype)
    if impl == "liger":
        return _liger_loss(h_TH.to(compute_dtype), weight_VH.to(compute_dtype), targets_T.long(),
                           ignore_index, reduction)
    if impl != "torch":
        raise ConfigError(f"loss_impl={impl!r}: must be 'torch' or 'liger' (resolve 'auto' with resolve_loss_impl)")
    grad = torch.is_grad_enabled()
    with torch.autocast(dev, enabled=False):
        return _ChunkedLinearCE.apply(h_TH, weight_VH, targets_T.long(), int(ignore_index),
                                      chunk_rows(weight_VH.shape[0], max_chunk_elements), reduction == "mean",
                                      compute_dtype, grad and h_TH.requires_grad, grad and weight_VH.requires_grad)


# ------------------------------------------------------------------ Liger-Kernel (optional)
@functools.cache
def _liger_class():
    """Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``, or None when it does not import."""
    try:
        return importlib.import_module("liger_kernel.transformers").LigerFusedLinearCrossEntropyLoss
    except Exception:  # ImportError, or its Triton failing to load: reported by resolve_loss_impl
        return None


@functools.cache
def _liger_loss_fn(ignore_index: int, reduction: str):
    return _liger_class()(ignore_index=ignore_index, reduction=reduction)


def _liger_loss(h_TH, weight_VH, targets_T, ignore_index, reduction):
    if _liger_class() is None or h_TH.device.type != "cuda":
        resolve_loss_impl("liger", h_TH.device)  # raises the ConfigError that says why
    return _liger_loss_fn(int(ignore_index), reduction)(weight_VH, h_TH, targets_T).float()


def check_loss_impl(name: str) -> None:
    """ConfigError naming ``train.loss_impl`` unless ``name`` is one of :data:`LOSS_IMPLS`."""
    if name not in LOSS_IMPLS:
        raise ConfigError(f"train.loss_impl={name!r}: must be one of {LOSS_IMPLS}")


def resolve_loss_impl(name: str, device: torch.device | str, cuda_graph: bool = False) -> tuple[str, str]:
    """``train.loss_impl`` -> ``("torch" | "liger", a one-line note of what was picked and why)``.

    ``auto``: ``liger`` on CUDA when ``liger_kernel`` imports and the step is not captured in a
    CUDA graph (``cuda_graph``: Liger's fused loss reads a value on the host inside forward, which a
    capture forbids), else ``torch``. ``liger`` asked for without the package, or off CUDA:
    :class:`ConfigError` naming the package; with ``cuda_graph``, a :class:`ConfigError` too.
    """
    device = torch.device(device)
    name = str(name)
    check_loss_impl(name)
    have = _liger_class() is not None
    if name == "liger":
        if device.type != "cuda":
            raise ConfigError(f"train.loss_impl=liger: Liger-Kernel runs on CUDA, this run is on {device.type}; "
                              "use train.loss_impl=torch (or auto)")
        if not have:
            raise ConfigError("train.loss_impl=liger: the liger_kernel package does not import; install it "
                              "(`pip install liger-kernel`) or use train.loss_impl=torch")
        if cuda_graph:
            raise ConfigError("train.loss_impl=liger with train.cuda_graph=true: Liger-Kernel's fused loss reads a "
                              "value on the host inside forward, which a capture forbids; use train.loss_impl=torch "
                              "(or auto) or train.cuda_graph=false")
        return "liger", "Liger-Kernel fused linear cross-entropy (train.loss_impl=liger)"
    if name == "torch":
        return "torch", "chunked linear cross-entropy (train.loss_impl=torch)"
    if device.type == "cuda" and have and not cuda_graph:
        return "liger", "Liger-Kernel fused linear cross-entropy (train.loss_impl=auto, liger_kernel found)"
    why = (f"{device.type}, Liger-Kernel needs CUDA" if device.type != "cuda" else "liger_kernel not installed"
           if not have else "train.cuda_graph=true, and Liger-Kernel's loss syncs with the host")
    return "torch", f"chunked linear cross-entropy (train.loss_impl=auto: {why})"
