"""The ``fp8`` grouped GEMM backend: e4m3 operands, rowwise scales, ``torch._scaled_grouped_mm``.

Forward and data-gradient GEMMs (``gmm``) run in FP8: the left operand ``x [M, K]`` is
quantised per row over the live rows (:func:`dropless.ops.fp8_quant.quant_rows`), the
weight per output channel (:func:`dropless.ops.fp8_quant.quant_weight`), and
``torch._scaled_grouped_mm`` (CUTLASS, sm89+/sm90) multiplies them with fp32
accumulation and writes bf16. The groups are the layout's unaligned ends, as for the
``torch`` backend: group ``i`` spans ``[end[i-1], end[i])``, so a gap row (whose FP8 row and
scale were never written) gives garbage in that gap row of the output only; any group size
works (torch 2.11 takes unaligned ``M`` offsets for the 2-D × 3-D case). The weight
gradient (``gmm_wgrad``) runs in bf16 through the ``torch`` backend by default (the live-row
rules and the accumulating Triton kernel are that backend's); ``wgrad="fp8"`` /
``"fp8_expert"`` runs it in FP8 instead: both operands quantised along the rows (the
contracted dimension) with scales per 128-row block or per expert, then
:func:`dropless.ops.triton_wgrad.fp8_grouped_wgrad_` (needs an expert alignment that is a
multiple of 128). Not the default: at DeepSeek-V3's per-rank shape it is no faster than bf16 yet (the
separate quantisation passes cost what the FP8 GEMM saves; docs/performance.md#fp8-experts).

Weight copies are cached: :meth:`Fp8Backend.weight` keys on the tensor that owns the
weight's storage (a view's ``_base``; or the parameter registered with :meth:`Fp8Backend.alias`
for a cast copy) and its ``_version``, so the FP8 copy and scales of a weight are made once
per optimizer step (the optimizer's in-place update moves ``_version``) and reused by every
micro-batch, chunk and backward pass. Forward (``x @ w``) and data gradient (``dy @ wᵀ``)
need the scales along different axes: two cached copies per weight (1 byte per element each).

Limits (torch 2.11-2.13): CUDA with compute capability >= 8.9; operands bf16; the left
operand e4m3 (the kernel rejects e5m2); output bf16; ``K`` a multiple of 16 (16-byte FP8
rows). Blockwise (1×128 / 128×128) scales are not implemented for the grouped GEMM on sm90
in torch 2.11 ("No gemm implementation was found"), hence rowwise / per-channel scales.

``Fp8Backend(emulate=True)`` replaces the CUDA kernel by its emulation (the same FP8
operands dequantised, one fp32 matmul per expert, reading the layout on the host): what
the CPU tests use to check the quantisation, layout, cache and backward logic.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dropless.config import ConfigError
from dropless.layout import ExpertLayout
from dropless.ops import select
from dropless.ops.fp8_quant import (
    TOKEN_BLOCK,
    dequant_rows,
    dequant_weight,
    quant_expert_columns,
    quant_rows,
    quant_token_blocks,
    quant_weight,
    swiglu_quant_rows,
)
from dropless.ops.torch_backend import TorchBackend

if select.HAS_TRITON:
    from dropless.ops import triton_wgrad

MIN_CAPABILITY = (8, 9)
#: ``wgrad`` of :class:`Fp8Backend`: the weight gradient in bf16 (the ``torch`` backend's), or in FP8 with
#: one scale per column per 128-row block (``fp8``, DeepSeek-V3's tiles) or per column per expert (``fp8_expert``).
WGRAD_MODES = ("bf16", "fp8", "fp8_expert")


def fp8_unavailable_reason(device: torch.device | str | None) -> str | None:
    """Why the real FP8 grouped GEMM cannot run on ``device`` (None: it can)."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return (f"gemm=fp8 needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper or "
                f"newer); this run is on {device.type if device is not None else 'no device'}. Use gemm=torch")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return (f"gemm=fp8 needs FP8 tensor cores (compute capability >= 8.9); {torch.cuda.get_device_name(device)} "
                f"has {cap[0]}.{cap[1]}. Use gemm=torch")
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"gemm=fp8 needs torch._scaled_grouped_mm (torch >= 2.9); this is torch {torch.__version__}"
    return None


class Fp8Backend:
    """FP8 forward / data-gradient GEMMs; bf16 or FP8 weight gradient (see the module docstring).

    Args:
        emulate: run the GEMM as its fp32 emulation (tests; any device, a host sync per call).
        fast_accum: ``use_fast_accum`` of the CUTLASS kernel (Hopper's FP8 tensor-core
            accumulation without periodic promotion to fp32). On by default: at K = 7168 its
            output is within 2.5e-3 (relative) of the fp64 product of the same FP8 operands
            (1.7e-3 without; the bf16 output rounding alone is about 2e-3) while the operands'
            own FP8 error is about 4e-2 (tests/test_fp8_gpu.py).
        ue8m0: power-of-two scales.
        fused_quant: quantise FC1's rows in the local gather that lands them and FC2's output
            gradient in the combine's backward that writes it (:mod:`dropless.ops.fp8_fused_rows`;
            the same codes and scales). On by default: on an H100 it makes the seed shape's experts and
            whole layer faster than a separate quantisation pass over each (``quant_act``)
            (docs/performance.md#fp8-experts; benchmarks/fp8_fused.py measures both).
        plan_gemms: let the MoE layer run in bf16 each GEMM that the measured crossover says FP8 does
            not pay for at the layer's shape (:mod:`dropless.ops.fp8_policy`; said once). None (the
            default): on, unless ``emulate`` (an emulation has no speed to plan for: every GEMM in FP8).
            False: every GEMM in FP8.
        wgrad: one of :data:`WGRAD_MODES`. The FP8 modes quantise both operands of each weight
            gradient along the rows (:func:`~dropless.ops.fp8_quant.quant_token_blocks` /
            :func:`~dropless.ops.fp8_quant.quant_expert_columns`) and run
            :func:`~dropless.ops.triton_wgrad.fp8_grouped_wgrad_`; they need an expert alignment
            that is a multiple of 128 (:meth:`check_alignment`).
    Raises:
        ValueError: an unknown ``wgrad``.
    """

    name = "fp8"
    #: the left operand's scales (:meth:`quant_act`): 0 one per row (``torch._scaled_grouped_mm``'s
    #: rowwise operand), 128 one per row per 128 columns (DeepGEMM's 1x128)
    act_group = 0

    def __init__(self, emulate: bool = False, fast_accum: bool = True, ue8m0: bool = False, wgrad: str = "bf16",
                 fused_quant: bool = True, plan_gemms: bool | None = None):
        if wgrad not in WGRAD_MODES:
            raise ValueError(f"Fp8Backend: wgrad={wgrad!r}; choose one of {WGRAD_MODES}")
        self.emulate, self.fast_accum, self.ue8m0, self.wgrad = emulate, fast_accum, ue8m0, wgrad
        self.fused_quant = fused_quant
        self.plan_gemms = not emulate if plan_gemms is None else plan_gemms
        self._wgrad = TorchBackend()
        # owner tensor -> {operand geometry: ((owner's _version, data_ptr), fp8 operand, scales)}
        self._cache: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._alias: WeakIdKeyDictionary = WeakIdKeyDictionary()  # cast copy -> parameter
        self.quantisations = 0  # weight copies made (tests)

    @property
    def bf16(self) -> TorchBackend:
        """The ``torch`` backend this one runs its bf16 GEMMs on (the weight gradient by default; a GEMM
        that :mod:`dropless.ops.fp8_policy` keeps in bf16)."""
        return self._wgrad

    # ------------------------------------------------------------------ checks
    def check_device(self, device: torch.device | str | None) -> None:
        """Raise ConfigError when this backend cannot run on ``device`` (not with ``emulate``)."""
        if self.emulate:
            return
        why = fp8_unavailable_reason(device)
        if why is not None:
            raise ConfigError(why)

    def check(self, x_MK: torch.Tensor, w_eKN: torch.Tensor) -> None:
        self.check_device(x_MK.device)
        ok = (torch.bfloat16,) if not self.emulate else (torch.bfloat16, torch.float32)
        if x_MK.dtype not in ok:
            raise ValueError(f"gemm=fp8: the FP8 grouped GEMM takes {[str(d) for d in ok]} operands (quantised "
                             f"inside), got {x_MK.dtype}; run the model in bf16, or use gemm=loop for references")
        for name, n in (("K (input width)", x_MK.shape[1]), ("N (output width)", w_eKN.shape[2])):
            if n % 16:
                raise ValueError(f"gemm=fp8: {name}={n}: FP8 rows need a multiple of 16 elements (16 bytes); "
                                 "hidden_size and moe_intermediate_size must be multiples of 16, or use gemm=torch")

    def check_alignment(self, expert_alignment: int) -> None:
        """Raise ConfigError when the FP8 weight gradient cannot take this alignment (bf16 wgrad: any)."""
        if self.wgrad != "bf16" and int(expert_alignment) % TOKEN_BLOCK:
            raise ConfigError(f"gemm={self.name} with an FP8 weight gradient (wgrad={self.wgrad}) needs "
                              f"model.expert_alignment to be a multiple of {TOKEN_BLOCK} (its scales cover "
                              f"{TOKEN_BLOCK}-row blocks of one expert), got {expert_alignment}")

    def check_layout(self, layout: ExpertLayout) -> None:
        """Raise ValueError when the GEMM cannot read this layout (any layout here)."""

    # ------------------------------------------------------------------ weights
    def alias(self, copy: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """Record that ``copy`` (e.g. ``param.to(bf16)``) holds ``param``'s values, so the cache keys on ``param``."""
        if copy is not param:
            self._alias[copy] = param
        return copy

    def _owner(self, w: torch.Tensor) -> torch.Tensor:
        t = w
        for _ in range(4):  # a view's base, a cast copy's parameter (and their bases)
            nxt = t._base if t._base is not None else self._alias.get(t)
            if nxt is None:
                break
            t = nxt
        return t

    def weight(self, w_eKN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached FP8 operand and ``[e, N]`` scales of the GEMM's right operand ``w_eKN``.

        ``w_eKN`` may be a weight ``[e, K, N]`` or a transposed view of one (the data
        gradient's ``wᵀ``). Requantised when the owning tensor's ``_version`` moved (any
        in-place update: the optimizer's, ``copy_``, ``torch._foreach_copy_``) or its storage
        changed (``p.data = …``). An in-place write through ``p.data`` bypasses the version
        counter and is not seen: call :meth:`clear_cache` after one.
        """
        owner = self._owner(w_eKN)
        geo = (tuple(w_eKN.shape), tuple(w_eKN.stride()), w_eKN.storage_offset())
        entry = self._cache.get(owner)
        if entry is None:
            entry = self._cache[owner] = {}
        hit = entry.get(geo)
        version = (owner._version, owner.data_ptr())
        if hit is not None and hit[0] == version:
            return hit[1], hit[2]
        b, s = self.quant_weight(w_eKN)
        entry[geo] = (version, b, s)
        self.quantisations += 1
        return b, s

    # ------------------------------------------------------------------ operands (a subclass may change the scales)
    def quant_weight(self, w_eKN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The right operand of ``x @ w_eKN`` and its scales: per output channel (``[e, N]``)."""
        return quant_weight(w_eKN, contract_dim=1, ue8m0=self.ue8m0)

    def quant_act(self, x_MK: torch.Tensor, layout: ExpertLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """The left operand (live rows) and its scales: ``quant_rows`` with :attr:`act_group` and ``ue8m0``
        (the rule the fused row kernels of :mod:`dropless.ops.fp8_fused_rows` apply too)."""
        return quant_rows(x_MK, layout, self.ue8m0, group=self.act_group)

    def swiglu_quant_act(self, h13_MI2: torch.Tensor, layout: ExpertLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """``silu(gate) · up`` of ``h13`` as the left operand of FC2, quantised in the same pass."""
        return swiglu_quant_rows(h13_MI2, layout, self.ue8m0, group=self.act_group)

    @staticmethod
    def fold_row_weight(scale: torch.Tensor, row_w_M: torch.Tensor) -> torch.Tensor:
        """Scales of ``q(a) · row_w``: every scale of row ``r`` times ``row_w[r]`` (exact, no requantisation)."""
        w = row_w_M.float()
        return scale * (w if scale.dim() == 1 else w.unsqueeze(1))

    def clear_cache(self) -> None:
        """Drop every cached FP8 weight copy (the next use requantises)."""
        self._cache = WeakIdKeyDictionary()

    # ------------------------------------------------------------------ GEMMs
    def scaled_gmm(self, xq_MK: torch.Tensor, xs_M: torch.Tensor, b_eKN: torch.Tensor, bs_eN: torch.Tensor,
                   layout: ExpertLayout, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``out[live_i] = (xq · xs)[live_i] @ (b · bs)[i]``: ``[M, N]`` in ``out_dtype`` (bf16 on CUDA)."""
        if not self.emulate:
            return torch._scaled_grouped_mm(xq_MK, b_eKN, xs_M, bs_eN, offs=layout.end, out_dtype=torch.bfloat16,
                                            use_fast_accum=self.fast_accum)
        out = torch.empty(xq_MK.shape[0], b_eKN.shape[2], dtype=out_dtype, device=xq_MK.device)
        for i, (s, t) in enumerate(zip(layout.start.tolist(), layout.end.tolist())):
            if t > s:
                a = dequant_rows(xq_MK[s:t], xs_M[s:t])
                out[s:t] = (a @ dequant_weight(b_eKN[i:i + 1], bs_eN[i:i + 1])[0]).to(out_dtype)
        return out

    @torch.compiler.disable  # the weight cache is host logic: eager inside a compiled graph (a graph break)
    def gmm(self, x_MK: torch.Tensor, w_eKN: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
        self.check_layout(layout)
        xq, xs = self.quant_act(x_MK, layout)
        b, bs = self.weight(w_eKN)
        return self.scaled_gmm(xq, xs, b, bs, layout, x_MK.dtype)

    def gmm_wgrad(self, x_MK: torch.Tensor, dy_MN: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
        """``dW[i] = x[live_i]ᵀ @ dy[live_i]`` (``[e, K, N]``), exact 0 for an empty expert: bf16 through the
        ``torch`` backend, or FP8 (``wgrad``), written in ``x``'s dtype."""
        if self.wgrad == "bf16":
            return self._wgrad.gmm_wgrad(x_MK, dy_MN, layout)
        dw = torch.empty(layout.num_experts, x_MK.shape[1], dy_MN.shape[1], dtype=x_MK.dtype, device=x_MK.device)
        self._fp8_wgrad(dw, x_MK, dy_MN, layout, accumulate=False)
        return dw

    def gmm_wgrad_into_(self, dw_eKN: torch.Tensor, x_MK: torch.Tensor, dy_MN: torch.Tensor,
                        layout: ExpertLayout) -> None:
        """``dw[i] = x[live_i]ᵀ @ dy[live_i]`` written in place in ``dw``'s dtype: bf16 through the ``torch``
        backend's writer (fp32 main gradients summed in fp32, never rounded to bf16 first); FP8 (``wgrad``)
        computed in ``x``'s dtype and copied."""
        if self.wgrad == "bf16":
            self._wgrad.gmm_wgrad_into_(dw_eKN, x_MK, dy_MN, layout)
        else:
            dw_eKN.copy_(self.gmm_wgrad(x_MK, dy_MN, layout))

    def gmm_wgrad_acc_(self, dw_eKN: torch.Tensor, x_MK: torch.Tensor, dy_MN: torch.Tensor,
                       layout: ExpertLayout) -> None:
        """``dw[i] += x[live_i]ᵀ @ dy[live_i]`` in place (bf16: the ``torch`` backend's; FP8: ``wgrad``)."""
        if self.wgrad == "bf16":
            self._wgrad.gmm_wgrad_acc_(dw_eKN, x_MK, dy_MN, layout)
        else:
            self._fp8_wgrad(dw_eKN, x_MK, dy_MN, layout, accumulate=True)

    def _fp8_wgrad(self, dw_eKN: torch.Tensor, x_MK: torch.Tensor, dy_MN: torch.Tensor, layout: ExpertLayout,
                   accumulate: bool) -> None:
        if layout.alignment % TOKEN_BLOCK:
            raise ValueError(f"gemm={self.name}: the FP8 weight gradient (wgrad={self.wgrad}) needs an expert "
                             f"alignment that is a multiple of {TOKEN_BLOCK}, the layout has {layout.alignment}; "
                             f"set model.expert_alignment={TOKEN_BLOCK}")
        quant = {"fp8": quant_token_blocks, "fp8_expert": quant_expert_columns}.get(self.wgrad)
        if quant is None:
            raise ValueError(f"gemm={self.name}: wgrad={self.wgrad!r}; choose one of {WGRAD_MODES}")
        aq, a_s = quant(x_MK, layout, self.ue8m0)
        bq, b_s = quant(dy_MN, layout, self.ue8m0)
        if not self.emulate:
            triton_wgrad.fp8_grouped_wgrad_(dw_eKN, aq, a_s, bq, b_s, layout, accumulate,
                                            promote=self.wgrad == "fp8")
            return
        # emulation: the same codes and scales dequantised, one fp32 matmul per expert (host loop)
        a, b = self._dequant_cols(aq, a_s, layout), self._dequant_cols(bq, b_s, layout)
        for i, (s, t) in enumerate(zip(layout.start.tolist(), layout.end.tolist())):
            d = a[s:t].t() @ b[s:t] if t > s else torch.zeros(dw_eKN.shape[1:], device=dw_eKN.device)
            if accumulate:
                dw_eKN[i] = (dw_eKN[i].float() + d).to(dw_eKN.dtype)
            else:
                dw_eKN[i] = d.to(dw_eKN.dtype)

    def _dequant_cols(self, qT: torch.Tensor, scale: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
        """fp32 ``[M', K]`` of a row-contracted operand (block or per-expert column scales)."""
        q = qT.t().float()
        if self.wgrad == "fp8":
            return (q.view(scale.shape[0], TOKEN_BLOCK, -1) * scale.unsqueeze(1)).view(q.shape)
        rex = torch.cat([layout.row_expert(), torch.full((q.shape[0] - layout.capacity,), -1, device=q.device)])
        return q * scale[rex.clamp_min(0)]
