"""FP8 dispatch: token rows travel as e4m3 codes and their scales, quantised once at the source.

With an FP8 grouped GEMM (``gemm=fp8`` / ``gemm=deep_gemm``) FC1 multiplies the e4m3 codes of
its input rows, never the rows themselves. A row's codes and scales depend on that row alone
(one scale per row, or per row per 128 columns: :func:`~dropless.ops.fp8_quant.quant_rows`),
so quantising the ``T`` tokens before the dispatch gives exactly the codes FC1 would make from
the landed rows afterwards: an EP dispatcher (``a2a``, ``agrs``) sends the codes (1 byte per
element) and the scales (4 bytes per row, or per row per 128 columns) instead of the
compute-dtype rows, and FC1 skips its own quantisation pass (docs/design.md#fp8-dispatch).

* :class:`RowQuantiser` — FC1's quantisation of a row (the backend's ``quant_act``), applied to
  the ``[T, H]`` tokens once; the codes come back viewed as ``uint8`` (a collective moves bytes:
  gloo has no float8 type).
* :func:`land_fp8` — the landed :class:`Fp8Rows` ``[M, H]`` (codes) and scales from received
  ``[N, H]`` codes, by the same indices that land compute-dtype rows.
* :func:`permute_fp8` — the local gather's landing (``local``: the tokens are on this rank):
  the codes and scales written by the kernel that lands the rows
  (:func:`~dropless.ops.fp8_fused_rows.scatter_quant_rows`), with the compute-dtype rows too
  for FC1's weight gradient (:attr:`Fp8Rows.rows_kept`); no separate quantisation pass.
* :func:`grad_port` — the tensor that stands for the landed rows in autograd: a zero-stride
  ``[M, H]`` view of one zero (no memory). FC1 takes it as its input and returns the landed
  rows' gradient for it; the port's backward hands that gradient to the dispatcher's reverse
  path (``reverse``), which brings it back to the tokens in the compute dtype exactly as the
  backward of a compute-dtype dispatch does (issued in one node, waited on in the next). The
  quantisation is a straight-through op for the input gradient, as in FC1 without FP8 dispatch
  (its data gradient ``dX = q(dY) @ q(Wᵀ)`` never reads the input).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dropless.ops.backward import first_order_only
from dropless.ops.fp8_fused_rows import scatter_quant_rows
from dropless.ops.fp8_quant import FP8_DTYPE
from dropless.ops.rows import gather_sum, land_rows


@dataclass
class Fp8Rows:
    """Landed rows in FC1's FP8 operand form.

    Attributes:
        codes_MH: ``[M, H]`` float8_e4m3fn; padding rows unspecified.
        scales: fp32 ``[M]`` (one scale per row) or ``[M, H/128]`` (1×128), as the backend's
            ``quant_act`` makes them: ``row[r] ≈ codes[r] · scales[r]``.
        rows_kept: the ``rows_MH`` that comes with them holds the compute-dtype rows themselves
            (:func:`permute_fp8`), which FC1's weight gradient reads; False: it is a
            :func:`grad_port` and the weight gradient reads the dequantised codes.
    """

    codes_MH: torch.Tensor | None
    scales: torch.Tensor | None
    rows_kept: bool = False

    def release(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``(codes_MH, scales, rows_kept)``, handed over once: this object lets go of the codes, so that
        they are freed as soon as FC1 is done with them (it saves them only without ``rows_kept``).

        Raises:
            ValueError: the codes were released already.
        """
        if self.codes_MH is None:
            raise ValueError("Fp8Rows: the codes were handed to FC1 already; dispatch the rows again")
        out = (self.codes_MH, self.scales, self.rows_kept)
        self.codes_MH = self.scales = None
        return out


@dataclass(frozen=True)
class RowQuantiser:
    """FC1's row quantisation, applied to the tokens before they are dispatched.

    Attributes:
        quant: ``x_MK -> (codes e4m3 [M, K], scales fp32 [M] or [M, K/128])`` over every row
            (the backend's ``quant_act`` with no layout).
        dtype: the experts' compute dtype: the tokens are cast to it before quantising (as the
            landed rows are before FC1), and the gradient port is made in it.
        group: ``quant``'s scale form as :func:`~dropless.ops.fp8_quant.quant_rows` takes it (0: per
            row, 128: per row per 128 columns), for a kernel that quantises while it lands the rows
            (:func:`permute_fp8`); None: not known there (such a dispatcher lands compute-dtype rows).
        ue8m0: ``quant``'s power-of-two scales.
    """

    quant: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    dtype: torch.dtype
    group: int | None = None
    ue8m0: bool = False

    def __call__(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``(codes uint8 [T, H], scales fp32 [T, G], rowwise)`` of ``x_TH``, no autograd: ``G`` = 1 and
        ``rowwise`` True for one scale per row (``quant`` gave ``[T]``), else ``G = H/128``."""
        q, s = self.quant(x_TH.detach().to(self.dtype))
        return q.view(torch.uint8), s.reshape(q.shape[0], -1), s.dim() == 1


def land_fp8(codes_NH: torch.Tensor, scales_NG: torch.Tensor, src_M: torch.Tensor, dest_Nk: torch.Tensor,
             rowwise: bool) -> Fp8Rows:
    """Land received ``uint8`` codes ``[N, H]`` and scales ``[N, G]`` as :func:`~dropless.ops.rows.land_rows`
    lands rows (``rows[m] = x[src_M[m]]``); ``rowwise`` (from :class:`RowQuantiser`): the scales become ``[M]``."""
    codes = land_rows(codes_NH, src_M, dest_Nk).view(FP8_DTYPE)
    scales = land_rows(scales_NG, src_M, dest_Nk)
    return Fp8Rows(codes, scales.squeeze(1) if rowwise else scales)


class _PermuteQuantRows(torch.autograd.Function):
    """:class:`~dropless.permute.permute_rows` that also returns the landed rows' codes and scales (no gradient)."""

    @staticmethod
    def forward(ctx, x_NH, src_M, dest_Nk, group, ue8m0):
        ctx.save_for_backward(dest_Nk)
        rows, codes, scales = scatter_quant_rows(x_NH, src_M, dest_Nk, group, ue8m0, keep_rows=True)
        ctx.mark_non_differentiable(codes, scales)
        return rows, codes, scales

    @staticmethod
    @first_order_only
    def backward(ctx, grad_MH, _gc, _gs):
        (dest_Nk,) = ctx.saved_tensors
        return gather_sum(grad_MH, dest_Nk, None), None, None, None, None


def permute_fp8(x_NH: torch.Tensor, src_M: torch.Tensor, dest_Nk: torch.Tensor,
                quant: RowQuantiser) -> tuple[torch.Tensor, Fp8Rows]:
    """Land the tokens ``x_NH`` as rows and as FC1's e4m3 codes + scales, in one pass over them.

    Args:
        x_NH: ``[N, H]`` tokens (any float dtype; cast to ``quant.dtype`` first, differentiably).
        src_M, dest_Nk: as :func:`~dropless.permute.permute_rows`.
        quant: FC1's row quantisation, with its form known (``quant.group`` not None).
    Returns:
        ``(rows_MH, fp8)``: with autograd on, ``rows_MH`` the landed rows in ``quant.dtype``
        (``permute_rows``' values and backward) and ``fp8.rows_kept``; without, nothing reads the
        rows: ``rows_MH`` a zero-stride ``[M, H]`` placeholder and ``rows_kept`` False. The codes and
        scales equal ``quant.quant`` of the landed rows on every live row, bit for bit.
    Raises:
        ValueError: ``quant.group`` None.
    """
    if quant.group is None:
        raise ValueError("permute_fp8: the RowQuantiser's scale form (group) is not known; land the rows and "
                         "quantise them with quant.quant")
    x = x_NH.to(quant.dtype)
    m = src_M.shape[0]
    if torch.is_grad_enabled():
        rows, codes, scales = _PermuteQuantRows.apply(x, src_M, dest_Nk, quant.group, quant.ue8m0)
        return rows, Fp8Rows(codes, scales, rows_kept=True)
    _, codes, scales = scatter_quant_rows(x, src_M, dest_Nk, quant.group, quant.ue8m0, keep_rows=False)
    return x.new_zeros(()).expand(m, x.shape[1]), Fp8Rows(codes, scales)


class _PortState:
    """What the two backward nodes of a gradient port share: the dispatcher's ``reverse`` and, between
    the two, the ``finish`` it returned."""

    def __init__(self, reverse: Callable[[torch.Tensor], Callable[[], torch.Tensor]]):
        self.reverse = reverse
        self.finish: Callable[[], torch.Tensor] | None = None


class _PortWait(torch.autograd.Function):
    """Nearest the tokens: its backward waits on the reverse transfer and returns the tokens' gradient."""

    @staticmethod
    def forward(ctx, x_TH, state):
        ctx.state, ctx.x_dtype = state, x_TH.dtype
        return x_TH.new_zeros((), dtype=torch.float32)

    @staticmethod
    @first_order_only
    def backward(ctx, _grad):
        finish, ctx.state.finish = ctx.state.finish, None
        return finish().to(ctx.x_dtype), None


class _PortIssue(torch.autograd.Function):
    """Nearest FC1: its backward issues the reverse transfer of the landed rows' gradient."""

    @staticmethod
    def forward(ctx, link, num_rows, hidden, dtype, state):
        ctx.state = state
        return link.new_zeros((), dtype=dtype).expand(num_rows, hidden)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_MH):
        ctx.state.finish = ctx.state.reverse(grad_MH.contiguous())
        return grad_MH.new_zeros((), dtype=torch.float32), None, None, None, None


def grad_port(x_TH: torch.Tensor, num_rows: int, dtype: torch.dtype,
              reverse: Callable[[torch.Tensor], Callable[[], torch.Tensor]]) -> torch.Tensor:
    """The ``[num_rows, H]`` stand-in for FP8-landed rows (values 0, one element of memory).

    Two autograd nodes, as a collective's start/wait pair (:mod:`dropless.dispatch.collectives`):
    the one next to FC1 calls ``reverse(grad_MH)``, which issues the reverse transfer and returns
    ``finish``; the one next to the tokens calls ``finish()`` for their gradient, so that the
    autograd nodes run in between overlap the transfer.

    Args:
        x_TH: the dispatched tokens (the port's autograd input).
        num_rows: ``M``, the landed buffer's rows. dtype: the compute dtype.
        reverse: ``grad_MH -> finish``, ``finish() -> grad_TH``: the dispatcher's backward of landing
            the rows (live rows only; run with autograd off).
    Returns:
        ``[M, H]`` in ``dtype``, never read for its values: FC1 reads :class:`Fp8Rows`, and its
        backward returns the landed rows' gradient for this tensor.
    """
    state = _PortState(reverse)
    return _PortIssue.apply(_PortWait.apply(x_TH, state), num_rows, x_TH.shape[1], dtype, state)
