"""MLA's per-head keys and values from the up-projection and the shared rope key, and their gradient.

For ``kv_BSNX`` (``wkv_b``'s output per head, X = Dn + Dv) and the rotated shared rope key
``k_pe_BS1r`` (r = Dr), :func:`keys_values` returns::

    k = [kv[..., :Dn] | k_pe broadcast over the N heads]     new, contiguous [B, S, N, Dn + Dr]
    v = kv[..., Dn:]                                          a view of kv, [B, S, N, Dv]

``k`` in ``promote_types(kv.dtype, k_pe.dtype)``, as ``cat``. Its backward, given ``gk`` and ``gv``
(either may be None: that output reached no loss)::

    gkv   = [gk[..., :Dn] | gv]                               new, contiguous [B, S, N, Dn + Dv]; a None part is 0
    g_kpe = Σ_n gk[..., Dn:]                                  [B, S, 1, Dr], summed in fp32, rounded once

Two implementations, picked here and nowhere else (:func:`dropless.ops.select.use_triton`):

* **Triton** (CUDA, ``kv`` and ``k_pe`` of one dtype among bf16, fp16 and fp32, no autograd graph
  being recorded, not compiling): one kernel each way. A program takes a block of token rows
  ``(b, s)`` with all N heads of each: the forward reads the row's rope key once and stores it into
  every head; the backward writes ``gkv`` and sums the rope part of ``gk`` over the heads in fp32
  registers in the same pass (no atomics, no host sync). Inputs may have any strides over
  (B, S, N) (SDPA's backward returns ``[B, N, S, D]`` in memory) with a contiguous last dim.
* **The torch reference** (CPU, float64, mixed dtypes, and a backward with ``create_graph=True``):
  one ``copy_`` per part into a new buffer, the backward's head sum by ``sum`` (torch's reduction
  over 16-bit floats accumulates in fp32 too); with grad mode on, ``cat`` (differentiable).

Copies are exact: ``k`` and ``gkv`` equal the reference bit for bit. ``g_kpe`` may differ in the last
bit of the compute dtype (another order of the head sum), in 16-bit dtypes by one rounding step.

:func:`keys_values` is an autograd Function eagerly; compiling (or under ``torch.func``), the plain
``split`` + ``expand`` + ``cat``, which the compiler fuses with its neighbours.

Shape letters: B batch, S positions, N heads, X = Dn + Dv, K = Dn + Dr, r = Dr, v = Dv.
"""

from __future__ import annotations

import torch

from dropless.ops import select

__all__ = ["keys_values", "keys_forward", "keys_values_backward", "keys_forward_torch",
           "keys_values_backward_torch"]

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if select.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _keys_fwd_kernel(kv_ptr, pe_ptr, k_ptr, n_rows, S, skv_b, skv_s, skv_n, spe_b, spe_s,
                         N: tl.constexpr, DN: tl.constexpr, DR: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)        # token rows (b, s)
        live = t < n_rows
        t = tl.where(live, t, 0).to(tl.int64)
        b = t // S
        s = t % S
        n = tl.arange(0, BLOCK_N)
        heads = live[:, None] & (n[None, :] < N)                       # [BLOCK_T, BLOCK_N]
        n64 = n.to(tl.int64)
        k_head = k_ptr + t[:, None] * (N * (DN + DR)) + n64[None, :] * (DN + DR)   # k is contiguous
        if DN > 0:
            c = tl.arange(0, BLOCK_DN)
            m = heads[:, :, None] & (c < DN)[None, None, :]
            kv_head = kv_ptr + (b * skv_b + s * skv_s)[:, None] + n64[None, :] * skv_n
            x = tl.load(kv_head[:, :, None] + c[None, None, :], mask=m)
            tl.store(k_head[:, :, None] + c[None, None, :], x.to(k_ptr.dtype.element_ty), mask=m)
        if DR > 0:
            c = tl.arange(0, BLOCK_DR)
            pe = tl.load(pe_ptr + (b * spe_b + s * spe_s)[:, None] + c[None, :],
                         mask=live[:, None] & (c < DR)[None, :])          # once per token row
            pe = tl.broadcast_to(pe[:, None, :], (BLOCK_T, BLOCK_N, BLOCK_DR))
            m = heads[:, :, None] & (c < DR)[None, None, :]
            tl.store(k_head[:, :, None] + DN + c[None, None, :], pe.to(k_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _keys_values_bwd_kernel(gk_ptr, gv_ptr, gkv_ptr, gpe_ptr, n_rows, S, sgk_b, sgk_s, sgk_n,
                                sgv_b, sgv_s, sgv_n, N: tl.constexpr, DN: tl.constexpr, DR: tl.constexpr,
                                DV: tl.constexpr, HAS_GK: tl.constexpr, HAS_GV: tl.constexpr,
                                BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DN: tl.constexpr,
                                BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        live = t < n_rows
        t = tl.where(live, t, 0).to(tl.int64)
        b = t // S
        s = t % S
        n = tl.arange(0, BLOCK_N)
        heads = live[:, None] & (n[None, :] < N)
        n64 = n.to(tl.int64)
        gkv_head = gkv_ptr + t[:, None] * (N * (DN + DV)) + n64[None, :] * (DN + DV)   # gkv is contiguous
        gk_head = gk_ptr + (b * sgk_b + s * sgk_s)[:, None] + n64[None, :] * sgk_n
        if DN > 0:
            c = tl.arange(0, BLOCK_DN)
            m = heads[:, :, None] & (c < DN)[None, None, :]
            if HAS_GK:
                x = tl.load(gk_head[:, :, None] + c[None, None, :], mask=m)
            else:
                x = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_DN), dtype=gkv_ptr.dtype.element_ty)
            tl.store(gkv_head[:, :, None] + c[None, None, :], x.to(gkv_ptr.dtype.element_ty), mask=m)
        if DV > 0:
            c = tl.arange(0, BLOCK_DV)
            m = heads[:, :, None] & (c < DV)[None, None, :]
            if HAS_GV:
                gv_head = gv_ptr + (b * sgv_b + s * sgv_s)[:, None] + n64[None, :] * sgv_n
                x = tl.load(gv_head[:, :, None] + c[None, None, :], mask=m)
            else:
                x = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_DV), dtype=gkv_ptr.dtype.element_ty)
            tl.store(gkv_head[:, :, None] + DN + c[None, None, :], x.to(gkv_ptr.dtype.element_ty), mask=m)
        if HAS_GK:
            if DR > 0:  # the rope key's gradient: the head sum in fp32, rounded once
                c = tl.arange(0, BLOCK_DR)
                m = heads[:, :, None] & (c < DR)[None, None, :]
                x = tl.load(gk_head[:, :, None] + DN + c[None, None, :], mask=m, other=0.0).to(tl.float32)
                g = tl.sum(x, axis=1)                                    # [BLOCK_T, BLOCK_DR]
                tl.store(gpe_ptr + t[:, None] * DR + c[None, :], g.to(gpe_ptr.dtype.element_ty),
                         mask=live[:, None] & (c < DR)[None, :])


def _blocks(n: int, widths: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
    """``(BLOCK_T, BLOCK_N, padded widths)``: whole token rows (all N heads) in tiles of about 8,192
    elements over the parts a program stores (``widths``)."""
    block_n = triton.next_power_of_2(max(n, 1))
    padded = tuple(triton.next_power_of_2(max(w, 1)) for w in widths)
    per_row = max(1, block_n * sum(p for p, w in zip(padded, widths) if w > 0))
    block_t = 1
    while block_t * 2 * per_row <= 8192:
        block_t *= 2
    return block_t, block_n, padded


def _num_warps(elements: int) -> int:
    """Warps for a tile of ``elements``: a power of two from 4 to 16, at least 32 elements a thread (four
    16-byte vectors in bf16)."""
    warps = 4
    while warps < 16 and warps * 2 * 32 * 32 <= elements:
        warps *= 2
    return warps


def _kernel_takes(*ts: torch.Tensor | None) -> bool:
    """The Triton path: the tensors on CUDA (or forced), of one kernel dtype, eager, no graph recorded."""
    present = [t for t in ts if t is not None]
    return (select.use_triton(present[0]) and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and present[0].dtype in _KERNEL_DTYPES and all(t.dtype == present[0].dtype for t in present))


def _last_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def keys_forward_torch(kv_BSNX: torch.Tensor, k_pe_BS1r: torch.Tensor, nope_dim: int) -> torch.Tensor:
    """The reference of :func:`keys_forward`: ``k`` by two ``copy_`` into a new buffer (differentiable)."""
    B, S, N, _ = kv_BSNX.shape
    Dr = k_pe_BS1r.shape[-1]
    k_BSNK = torch.empty(B, S, N, nope_dim + Dr, dtype=torch.promote_types(kv_BSNX.dtype, k_pe_BS1r.dtype),
                         device=kv_BSNX.device)
    k_BSNK[..., :nope_dim].copy_(kv_BSNX[..., :nope_dim])
    k_BSNK[..., nope_dim:].copy_(k_pe_BS1r.expand(B, S, N, Dr))
    return k_BSNK


def keys_forward(kv_BSNX: torch.Tensor, k_pe_BS1r: torch.Tensor, nope_dim: int, *,
                 config: tuple[int, int] | None = None) -> torch.Tensor:
    """``k = cat([kv[..., :Dn], k_pe.expand(B, S, N, Dr)], -1)`` as a new contiguous tensor.

    Args:
        kv_BSNX: [B, S, N, Dn + Dv], any strides over (B, S, N).
        k_pe_BS1r: [B, S, 1, Dr], any strides over (B, S).
        nope_dim: Dn.
        config: ``(BLOCK_T, num_warps)`` for the kernel (benchmarks); None: the default.
    Returns:
        k [B, S, N, Dn + Dr], contiguous, in ``promote_types(kv.dtype, k_pe.dtype)``; bitwise the
        reference's. Shapes are checked by :func:`keys_values`.
    """
    if not _kernel_takes(kv_BSNX, k_pe_BS1r):
        return keys_forward_torch(kv_BSNX, k_pe_BS1r, nope_dim)
    kv_BSNX, k_pe_BS1r = _last_contiguous(kv_BSNX), _last_contiguous(k_pe_BS1r)
    B, S, N, _ = kv_BSNX.shape
    Dr = k_pe_BS1r.shape[-1]
    k_BSNK = torch.empty(B, S, N, nope_dim + Dr, dtype=kv_BSNX.dtype, device=kv_BSNX.device)
    if k_BSNK.numel() == 0:
        return k_BSNK
    block_t, block_n, (block_dn, block_dr) = _blocks(N, (nope_dim, Dr))
    num_warps = _num_warps(block_t * block_n * (block_dn + block_dr))
    if config is not None:
        block_t, num_warps = config
    grid = (triton.cdiv(B * S, block_t),)
    _keys_fwd_kernel[grid](kv_BSNX, k_pe_BS1r, k_BSNK, B * S, S, kv_BSNX.stride(0), kv_BSNX.stride(1),
                           kv_BSNX.stride(2), k_pe_BS1r.stride(0), k_pe_BS1r.stride(1), N=N, DN=nope_dim, DR=Dr,
                           BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_DN=block_dn, BLOCK_DR=block_dr,
                           num_warps=num_warps)
    return k_BSNK


def keys_values_backward_torch(gk_BSNK: torch.Tensor | None, gv_BSNv: torch.Tensor | None, nope_dim: int,
                               value_dim: int, kv_dtype: torch.dtype,
                               pe_dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The reference of :func:`keys_values_backward`: one ``copy_`` per part into a new buffer (a None part
    zeroed) and ``sum`` over the heads; with grad mode on (``create_graph=True``) ``cat``, differentiable."""
    first = gk_BSNK if gk_BSNK is not None else gv_BSNv
    if first is None:
        return None, None
    g_nope = None if gk_BSNK is None else gk_BSNK[..., :nope_dim]
    g_kpe = None if gk_BSNK is None else gk_BSNK[..., nope_dim:].sum(2, keepdim=True).to(pe_dtype)
    lead = first.shape[:-1]
    if torch.is_grad_enabled():
        parts = [first.new_zeros(*lead, w, dtype=kv_dtype) if p is None else p.to(kv_dtype)
                 for p, w in ((g_nope, nope_dim), (gv_BSNv, value_dim))]
        return torch.cat(parts, dim=-1), g_kpe
    gkv = torch.empty(*lead, nope_dim + value_dim, dtype=kv_dtype, device=first.device)
    for dst, p in zip(gkv.split([nope_dim, value_dim], dim=-1), (g_nope, gv_BSNv)):
        if p is None:
            dst.zero_()
        else:
            dst.copy_(p)
    return gkv, g_kpe


def keys_values_backward(gk_BSNK: torch.Tensor | None, gv_BSNv: torch.Tensor | None, nope_dim: int,
                         value_dim: int, kv_dtype: torch.dtype, pe_dtype: torch.dtype, *,
                         config: tuple[int, int] | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(gkv, g_kpe)`` of :func:`keys_values` given the gradients of ``k`` and ``v``, in one pass.

    Args:
        gk_BSNK: [B, S, N, Dn + Dr] or None (``k`` reached no loss); any strides over (B, S, N).
        gv_BSNv: [B, S, N, Dv] or None; any strides over (B, S, N).
        nope_dim, value_dim: Dn, Dv.
        kv_dtype, pe_dtype: the dtypes of ``kv`` and ``k_pe`` (those of the gradients returned).
        config: ``(BLOCK_T, num_warps)`` for the kernel (benchmarks); None: the default.
    Returns:
        ``gkv`` [B, S, N, Dn + Dv] contiguous, ``[gk[..., :Dn] | gv]`` with zeros for a None part (None
        when both are None), and ``g_kpe`` [B, S, 1, Dr] contiguous, ``gk[..., Dn:]`` summed over the heads
        in fp32 (float64 for float64) and rounded once (None when ``gk`` is None). With grad mode on the
        differentiable reference.
    """
    if gk_BSNK is None and gv_BSNv is None:
        return None, None
    first = gk_BSNK if gk_BSNK is not None else gv_BSNv
    if not _kernel_takes(gk_BSNK, gv_BSNv) or not kv_dtype == pe_dtype == first.dtype:
        return keys_values_backward_torch(gk_BSNK, gv_BSNv, nope_dim, value_dim, kv_dtype, pe_dtype)
    gk_BSNK, gv_BSNv = _last_contiguous(gk_BSNK), _last_contiguous(gv_BSNv)
    first = gk_BSNK if gk_BSNK is not None else gv_BSNv
    B, S, N, _ = first.shape
    Dr = 0 if gk_BSNK is None else gk_BSNK.shape[-1] - nope_dim
    gkv = torch.empty(B, S, N, nope_dim + value_dim, dtype=kv_dtype, device=first.device)
    g_kpe = None if gk_BSNK is None else torch.empty(B, S, 1, Dr, dtype=pe_dtype, device=first.device)
    if B * S == 0:
        return gkv, g_kpe
    block_t, block_n, (block_dn, block_dr, block_dv) = _blocks(N, (nope_dim, Dr, value_dim))
    num_warps = _num_warps(block_t * block_n * (block_dn + block_dr + block_dv))
    if config is not None:
        block_t, num_warps = config
    gk_s = (0, 0, 0) if gk_BSNK is None else gk_BSNK.stride()[:3]
    gv_s = (0, 0, 0) if gv_BSNv is None else gv_BSNv.stride()[:3]
    _keys_values_bwd_kernel[(triton.cdiv(B * S, block_t),)](
        first if gk_BSNK is None else gk_BSNK, first if gv_BSNv is None else gv_BSNv, gkv,
        gkv if g_kpe is None else g_kpe, B * S, S, *gk_s, *gv_s, N=N, DN=nope_dim, DR=Dr, DV=value_dim,
        HAS_GK=gk_BSNK is not None, HAS_GV=gv_BSNv is not None, BLOCK_T=block_t, BLOCK_N=block_n,
        BLOCK_DN=block_dn, BLOCK_DR=block_dr, BLOCK_DV=block_dv, num_warps=num_warps)
    return gkv, g_kpe


class _KeysValuesFn(torch.autograd.Function):
    """``k`` by :func:`keys_forward`, ``v`` a view of ``kv``; backward by :func:`keys_values_backward`
    (the torch reference in a ``create_graph`` backward: grad mode on)."""

    @staticmethod
    def forward(ctx, kv_BSNX, k_pe_BS1r, nope_dim):
        ctx.dims = (nope_dim, kv_BSNX.shape[-1] - nope_dim)
        ctx.dtypes = (kv_BSNX.dtype, k_pe_BS1r.dtype)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: no zeros tensor
        return keys_forward(kv_BSNX, k_pe_BS1r, nope_dim), kv_BSNX[..., nope_dim:]

    @staticmethod
    def backward(ctx, gk_BSNK, gv_BSNv):
        gkv, g_kpe = keys_values_backward(gk_BSNK, gv_BSNv, *ctx.dims, *ctx.dtypes)
        return gkv, g_kpe, None


def keys_values(kv_BSNX: torch.Tensor, k_pe_BS1r: torch.Tensor,
                nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` = ``(cat([kv[..., :Dn], k_pe.expand(B, S, N, Dr)], -1), kv[..., Dn:])`` (module docstring).

    Args:
        kv_BSNX: [B, S, N, Dn + Dv], ``wkv_b``'s output per head.
        k_pe_BS1r: [B, S, 1, Dr], the rotated shared rope key.
        nope_dim: Dn, 0 ≤ Dn ≤ Dn + Dv.
    Returns:
        k [B, S, N, Dn + Dr] (new, contiguous; the promoted dtype of the two inputs, as ``cat``)
        and v [B, S, N, Dv] (a view of ``kv``). Differentiable twice (``create_graph=True``).
    Raises:
        ValueError: shapes that do not fit, or ``nope_dim`` not an int.

    Eagerly through an autograd Function (:func:`keys_forward`, :func:`keys_values_backward`);
    compiling or under ``torch.func`` transforms, the plain expression, which the compiler fuses with
    its neighbours.
    """
    if not isinstance(nope_dim, int) or isinstance(nope_dim, bool):
        raise ValueError(f"keys_values: nope_dim must be an int (Dn, qk_nope_head_dim), got {nope_dim!r}")
    if (kv_BSNX.dim() != 4 or k_pe_BS1r.dim() != 4 or k_pe_BS1r.shape[:3] != (*kv_BSNX.shape[:2], 1)
            or not 0 <= nope_dim <= kv_BSNX.shape[-1]):
        raise ValueError(f"keys_values: kv must be [B, S, N, Dn + Dv] with Dn = nope_dim and k_pe [B, S, 1, Dr]; "
                         f"got {tuple(kv_BSNX.shape)}, {tuple(k_pe_BS1r.shape)}, nope_dim={nope_dim}")
    if torch.compiler.is_compiling() or any(torch._C._functorch.is_functorch_wrapped_tensor(t)
                                            for t in (kv_BSNX, k_pe_BS1r)):
        B, S, N, X = kv_BSNX.shape
        k_nope, v = torch.split(kv_BSNX, [nope_dim, X - nope_dim], dim=-1)
        return torch.cat([k_nope, k_pe_BS1r.expand(B, S, N, k_pe_BS1r.shape[-1])], dim=-1), v
    return _KeysValuesFn.apply(kv_BSNX, k_pe_BS1r, nope_dim)
