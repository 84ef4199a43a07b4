"""Selective-recompute expert MLP: (gather) -> FC1 -> SwiGLU (× row weight) -> FC2 as two autograd nodes.

The nodes drive the grouped GEMMs (:mod:`dropless.ops.grouped_gemm`), the SwiGLU kernels
(:mod:`dropless.ops.swiglu`) and the row kernels (:mod:`dropless.ops.rows`) directly, so
that what backward needs is rebuilt rather than saved (MegaBlocks' memory-optimised MLP
idea): :class:`_FC1SwiGLU` never saves the SwiGLU output, :class:`_FC2Recompute` rebuilds it
(and with ``recompute_fc1`` FC1's output too). :class:`RecomputeAhead` moves that rebuild to
just before the combine's backward. Entry point: :func:`expert_mlp_recompute`. Under
``torch.compile`` the same computation runs as one node (:class:`_ExpertMLPOneNode`): the two
nodes share Python state that Dynamo cannot trace.
"""

from __future__ import annotations

import torch

from dropless.ops.backends import ExpertGemms
from dropless.ops.backward import first_order_only, grad_wanted
from dropless.ops.grouped_gemm import WgradAccumulator, weight_grad
from dropless.ops.rows import RowSource, gather_rows, gather_sum, land_rows, regather_rows
from dropless.ops.swiglu import swiglu_bwd, swiglu_fwd


class _RecomputeBox:
    """Hands the rebuilt FC1 output (and the landed rows, when they were saved) on to the next backward node.

    :class:`RecomputeAhead`'s hook (or else FC2's backward) fills it; FC2's backward reads it
    and FC1's backward, which runs right after, takes it.
    """

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.h13: torch.Tensor | None = None
        self.fc2_saved: tuple | None = None  # FC2's saved tensors, unpacked once by the ahead hook


def _rebuild_h13(box: _RecomputeBox, x_in, w13, src_M, layout, gemms: ExpertGemms) -> torch.Tensor:
    """``box.h13`` = FC1 of the landed rows (re-gathered when ``src_M`` is given), unless already there."""
    if box.h13 is None:
        rows = _landed(x_in, src_M)  # eager only (the two-node path); compiled, _ExpertMLPOneNode runs
        box.h13 = gemms.fc1.gmm(rows, w13, layout)
        # re-gathered rows are not kept for FC1's backward (it gathers again, a cheap copy):
        # they would sit beside FC2's [M, H] gradient, the backward's largest buffers
        box.rows = None if src_M is not None else rows
    return box.h13


class RecomputeAhead:
    """Handle from :func:`expert_mlp_recompute` (``recompute_fc1``): :meth:`attach` it to the combined output.

    ``y_TH = ahead.attach(y_TH)`` registers a gradient hook on the combined output of the
    same rows. Autograd runs it right before the combine's backward, which lands the
    ``[M, H]`` row gradient; the hook rebuilds FC1's output then (re-gathering the rows and
    freeing them), so that FC2's backward no longer holds the rows, ``h13`` and the row
    gradient at once (the peak of a chunk's backward). Optional: without it FC2's backward
    rebuilds ``h13`` itself. Attach it to a tensor whose backward runs just before this
    chunk's expert nodes (the output of a combine that finished at once): a hook on the
    output of a later collective would run before every chunk's experts and rebuild every
    chunk's ``h13`` up front. Not for FSDP2-managed experts (the weights are gathered again
    only when the experts' outputs get their gradient, after the hook).
    """

    def __init__(self, fc2_node):
        self._fc2 = fc2_node  # the _FC2Recompute node (it holds what the rebuild needs)

    @classmethod
    def of(cls, y_MH: torch.Tensor) -> RecomputeAhead | None:
        """The handle of ``y_MH``, an output of :func:`expert_mlp_recompute` (its FC2 node); None where
        ``y_MH`` has no such node: no autograd graph, or one node (while ``torch.compile`` traces)."""
        if torch.compiler.is_compiling():
            return None
        return cls(y_MH.grad_fn) if isinstance(y_MH.grad_fn, _FC2Recompute._backward_cls) else None

    def attach(self, y_TH: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and y_TH.requires_grad:
            fc2 = self._fc2
            y_TH.register_hook(lambda grad: _FC2Recompute.rebuild_ahead(fc2))
        return y_TH


def _landed(x_in: torch.Tensor, src_M: torch.Tensor | None, dest_Nk: torch.Tensor | None = None,
            after: torch.Tensor | None = None) -> torch.Tensor:
    """The landed rows: ``x_in`` itself, or gathered from the source tokens ``x_in[src_M]``.

    Eagerly, with ``dest_Nk``: :func:`~dropless.ops.rows.land_rows` (on the Triton path each
    token read once and written to its ``k`` rows, padding rows unwritten, instead of
    ``index_select`` reading a token for every row). While ``torch.compile`` traces: a gather,
    which inductor fuses with the norm before it. ``after``: in a backward, a tensor that backward
    computed; the compiled re-gather is then :func:`~dropless.ops.rows.regather_rows`, which
    ``torch.compile`` keeps in the backward (neither computed in the forward and saved nor merged
    with the forward's gather: either would save the ``[M, H]`` rows that ``recompute_gather``
    exists to avoid).
    """
    if src_M is None:
        return x_in
    if torch.compiler.is_compiling():
        return gather_rows(x_in, src_M) if after is None else regather_rows(x_in, src_M, after)
    if dest_Nk is not None:
        return land_rows(x_in, src_M, dest_Nk)
    return gather_rows(x_in, src_M)


class _FC1SwiGLU(torch.autograd.Function):
    """(gather) -> FC1 (gate||up) -> SwiGLU (× row weight), without saving the SwiGLU output.

    Input ``x_in``: the landed rows ``[M, H]``, or with ``src_M`` the source tokens ``[N, H]``
    (``recompute_gather``: the rows are gathered here, not saved, and re-gathered in
    backward; the gradient goes back to the tokens through ``dest_Nk``). Saves ``x_in``,
    plus ``h13`` unless ``recompute_fc1``. Returns ``(h, h13)``; ``h13`` is
    non-differentiable and only handed to :class:`_FC2Recompute` so that it can rebuild ``h``
    (the storage this node saved: no extra memory). With ``recompute_fc1`` ``h13`` is None
    and FC2's backward recomputes it. With ``wgrad`` (an accumulator) ``dW13`` is added into
    it rather than returned.
    """

    @staticmethod
    def forward(ctx, x_in, w13, row_w, src_M, dest_Nk, layout, backend, recompute_fc1, box, wgrad):
        h13 = backend.fc1.gmm(_landed(x_in, src_M, dest_Nk), w13, layout)
        h = swiglu_fwd(h13, layout, row_w=row_w)
        ctx.layout, ctx.backend, ctx.recompute_fc1, ctx.box, ctx.wgrad = layout, backend, recompute_fc1, box, wgrad
        ctx.has_w, ctx.gather = row_w is not None, src_M is not None
        # h13 is a non-differentiable output: without this, backward would get a materialised
        # all-zero [M, 2I] gradient for it (0.5 GiB at the V3 rank's shape)
        ctx.set_materialize_grads(False)
        empty = x_in.new_empty(0)
        ctx.save_for_backward(x_in, w13, row_w if row_w is not None else empty,
                              empty if recompute_fc1 else h13,
                              src_M if src_M is not None else empty, dest_Nk if dest_Nk is not None else empty)
        if recompute_fc1:
            return h, None
        ctx.mark_non_differentiable(h13)
        return h, h13

    @staticmethod
    @first_order_only
    def backward(ctx, dh_MI, _dh13):
        if dh_MI is None:  # h did not reach the loss
            return (None,) * 10
        x_in, w13, row_w, h13, src_M, dest_Nk = ctx.saved_tensors
        layout, be, box = ctx.layout, ctx.backend, ctx.box
        src = src_M if ctx.gather else None
        want_x, want_w13 = grad_wanted(ctx, 0), grad_wanted(ctx, 1)
        want_rw = ctx.has_w and grad_wanted(ctx, 2)
        if ctx.recompute_fc1:  # FC2's backward (or the ahead hook) left it in the box
            h13 = _rebuild_h13(box, x_in, w13, src, layout, be) if (want_x or want_w13 or want_rw) else None
            box.h13 = None
        own = [h13, box.rows]  # handed over: freed inside as soon as they are used
        box.rows = None
        del h13
        dx, dw13, d_row_w = _fc1_swiglu_backward(dh_MI, own, x_in, w13, row_w if ctx.has_w else None, src,
                                                 dest_Nk, layout, be, want_x, want_w13, want_rw, ctx.wgrad)
        return dx, dw13, d_row_w, None, None, None, None, None, None, None


def _fc1_swiglu_backward(dh_MI, own: list, x_in, w13, row_w, src_M, dest_Nk, layout, be, want_x: bool,
                         want_w13: bool, want_rw: bool, wgrad):
    """Backward of (gather) -> FC1 -> SwiGLU (× row weight), given FC1's output ``h13``.

    ``own``: ``[h13, x]``, which the caller hands over and holds no other reference to (the
    list is emptied here): ``h13`` is freed before the weight- and data-gradient GEMMs, and
    the landed rows ``x`` right after ``dW13`` (None: rebuilt from ``x_in`` / ``src_M``, only
    for ``dW13``, after ``h13`` is freed), so they never sit beside ``dh13`` and ``dx``.
    ``row_w``: None when not folded. Returns ``(dx, dW13, d_row_w)`` (None where not wanted;
    ``dW13`` None after adding it into ``wgrad``); ``dx`` is per source token (``[N, H]``, fp32
    sum over k) with ``src_M``.
    """
    h13, x = own
    own.clear()
    dw13 = dx = None
    # d row_w = Σ_j dh_j · swiglu_j, in fp32 in the same pass as dh13 (no [M, I] SwiGLU rebuilt for it)
    dh13 = swiglu_bwd(h13, dh_MI.contiguous(), layout, row_w, row_w_grad=want_rw)
    del h13
    d_row_w = None
    if want_rw:
        dh13, d_row_w = dh13[0], dh13[1].to(row_w.dtype)
    if not (want_x or want_w13):
        return None, None, d_row_w
    if want_w13:
        # the rows only now, after h13 is freed: they never sit beside h13, dh and dh13 at once
        if x is None:
            x = _landed(x_in, src_M, dest_Nk, after=dh13)
        dw13 = weight_grad(x, dh13, layout, be.wgrad, w13.dtype, (wgrad, "w13") if wgrad is not None else None)
    del x
    if want_x:
        dx = be.fc1_dgrad.gmm(dh13, w13.transpose(1, 2), layout)
        del dh13
        if src_M is not None:
            dx = gather_sum(dx, dest_Nk, None)  # Σ over the k landed copies of each token, fp32
    return dx, dw13, d_row_w


def _fc2_backward(dy_MH, h13, w2, row_w, layout, be, want_h: bool, want_w2: bool, wgrad):
    """Backward of FC2 with its input rebuilt from ``h13``: ``(dh, dW2)`` (None where not wanted)."""
    dw2 = dh = None
    if want_w2:
        h = swiglu_fwd(h13, layout, row_w=row_w)
        dw2 = weight_grad(h, dy_MH, layout, be.wgrad, w2.dtype, (wgrad, "w2") if wgrad is not None else None)
        del h
    if want_h:
        dh = be.fc2_dgrad.gmm(dy_MH, w2.transpose(1, 2), layout)
    return dh, dw2


class _FC2Recompute(torch.autograd.Function):
    """FC2 whose input ``h`` is not saved: backward rebuilds it from what FC1 saved.

    Saves (references to) ``x_in``, ``w13``, the row weights and ``h13`` — tensors
    :class:`_FC1SwiGLU` already keeps — plus ``w2``. With ``recompute_fc1`` it re-gathers the
    rows if needed and reruns the FC1 GEMM (+2·R·H·2I FLOPs), leaving the result (and the
    rows, when they were saved rather than re-gathered) in the box for FC1's backward.
    """

    @staticmethod
    def forward(ctx, h_MI, w2, x_in, w13, row_w, h13, src_M, layout, backend, box, wgrad):
        ctx.layout, ctx.backend, ctx.box, ctx.wgrad = layout, backend, box, wgrad
        ctx.has_w, ctx.has_h13, ctx.gather = row_w is not None, h13 is not None, src_M is not None
        empty = x_in.new_empty(0)
        ctx.save_for_backward(w2, x_in, w13, row_w if row_w is not None else empty,
                              h13 if h13 is not None else empty, src_M if src_M is not None else empty)
        return backend.fc2.gmm(h_MI, w2, layout)

    @staticmethod
    @first_order_only
    def backward(ctx, dy_MH):
        box = ctx.box
        saved, box.fc2_saved = box.fc2_saved, None  # unpacked by the ahead hook (once: checkpoint allows one)
        w2, x_in, w13, row_w, h13, src_M = saved if saved is not None else ctx.saved_tensors
        layout, be = ctx.layout, ctx.backend
        want_h, want_w2 = grad_wanted(ctx, 0), grad_wanted(ctx, 1)
        dy_MH = dy_MH.contiguous()
        if not ctx.has_h13:  # rebuilt by the ahead hook already, or here
            h13 = _rebuild_h13(box, x_in, w13, src_M if ctx.gather else None, layout, be)
        dh, dw2 = _fc2_backward(dy_MH, h13, w2, row_w if ctx.has_w else None, layout, be, want_h, want_w2, ctx.wgrad)
        del h13
        if not want_h:  # FC1's backward will not run in this pass: nothing to hand on
            box.h13 = box.rows = None
        return dh, dw2, None, None, None, None, None, None, None, None, None

    @staticmethod
    def rebuild_ahead(ctx) -> None:
        """:class:`RecomputeAhead`'s hook: rebuild ``h13`` into the box before this node's backward.

        Unpacks the saved tensors once and leaves them in the box for :meth:`backward`
        (non-reentrant activation checkpointing lets a saved tensor be unpacked only once).
        Does nothing when ``h13`` was saved or this node will not run in this pass.
        """
        if ctx.has_h13:
            return
        try:
            if not torch._C._will_engine_execute_node(ctx):
                return
        except (RuntimeError, AttributeError):
            pass
        box = ctx.box
        box.fc2_saved = ctx.saved_tensors
        _, x_in, w13, _, _, src_M = box.fc2_saved
        box.h13 = box.rows = None  # rebuilt fresh: a retained graph's weights may have changed since
        _rebuild_h13(box, x_in, w13, src_M if ctx.gather else None, ctx.layout, ctx.backend)


class _ExpertMLPOneNode(torch.autograd.Function):
    """The same computation and saved tensors as :class:`_FC1SwiGLU` + :class:`_FC2Recompute`, as one node.

    For ``torch.compile``: the two-node version hands FC1's rebuilt output from one node's
    backward to the next through a Python object (:class:`_RecomputeBox`), a side effect
    Dynamo refuses to trace. Here FC2's backward and FC1's run in one backward, so nothing
    passes between nodes; the cost is that ``dW2`` is returned with ``dW13`` at the end
    (one weight gradient alive a little longer), and there is no :class:`RecomputeAhead`
    and no chunk accumulator (autograd sums the chunks' weight gradients).
    """

    @staticmethod
    def forward(ctx, x_in, w13, w2, row_w, src_M, dest_Nk, layout, backend, recompute_fc1):
        h13 = backend.fc1.gmm(_landed(x_in, src_M, dest_Nk), w13, layout)
        h = swiglu_fwd(h13, layout, row_w=row_w)
        ctx.layout, ctx.backend, ctx.recompute_fc1 = layout, backend, recompute_fc1
        ctx.has_w, ctx.gather = row_w is not None, src_M is not None
        empty = x_in.new_empty(0)
        ctx.save_for_backward(x_in, w13, w2, row_w if row_w is not None else empty,
                              empty if recompute_fc1 else h13,
                              src_M if src_M is not None else empty, dest_Nk if dest_Nk is not None else empty)
        return backend.fc2.gmm(h, w2, layout)

    @staticmethod
    @first_order_only
    def backward(ctx, dy_MH):
        x_in, w13, w2, row_w, h13, src_M, dest_Nk = ctx.saved_tensors
        layout, be = ctx.layout, ctx.backend
        src = src_M if ctx.gather else None
        rw = row_w if ctx.has_w else None
        want_x, want_w13, want_w2 = grad_wanted(ctx, 0), grad_wanted(ctx, 1), grad_wanted(ctx, 2)
        want_rw = ctx.has_w and grad_wanted(ctx, 3)
        want_h = want_x or want_w13 or want_rw
        x = None
        if ctx.recompute_fc1:
            x = _landed(x_in, src, dest_Nk if ctx.gather else None, after=dy_MH)
            h13 = be.fc1.gmm(x, w13, layout)
            if src is not None:  # re-gathered rows are not kept (as in the two-node version)
                x = None
        dh, dw2 = _fc2_backward(dy_MH.contiguous(), h13, w2, rw, layout, be, want_h, want_w2, None)
        del dy_MH
        dx = dw13 = d_row_w = None
        own = [h13, x]  # handed over: freed inside as soon as they are used
        del h13, x
        if want_h:
            dx, dw13, d_row_w = _fc1_swiglu_backward(dh, own, x_in, w13, rw, src, dest_Nk, layout, be,
                                                     want_x, want_w13, want_rw, None)
        return dx, dw13, dw2, d_row_w, None, None, None, None, None


def expert_mlp_recompute(x_in, w13, w2, row_w, layout, backend, recompute_fc1: bool,
                         source: RowSource | None = None, wgrad: WgradAccumulator | None = None):
    """(gather) -> FC1 -> SwiGLU (× row weight) -> FC2 with selective recompute (MegaBlocks' memory-optimised MLP idea).

    Args:
        x_in: ``[M, H]`` landed rows, or None with ``source`` (re-gathered in backward).
        w13: ``[e, H, 2I]``, w2: ``[e, I, H]``, in ``x_in``'s dtype.
        row_w: ``[M]`` routing weight of each row (``fold_routing_weights``), or None.
        layout: the rows' :class:`ExpertLayout`. backend: a grouped GEMM backend instance, or an
            :class:`~dropless.ops.backends.ExpertGemms` naming one per GEMM (e.g. an FP8 plan's).
        recompute_fc1: do not save ``h13``; FC2's backward reruns the FC1 GEMM.
        source: :class:`~dropless.permute.RowSource` of the rows (``recompute_gather``).
        wgrad: accumulator for ``dW13``/``dW2`` (chunked layer calls), or None to return them.
    Returns:
        ``[M, H]`` expert outputs (padding rows unspecified), in ``x_in``'s dtype; with
        ``recompute_fc1``, :meth:`RecomputeAhead.of` them is the handle to attach to the combined output.
    Saved for backward: the landed rows ``[M, H]`` (with ``source``: nothing beyond the
    source tokens and the int64 indices ``src_M``, ``dest_Nk``), ``h13 [M, 2I]`` unless
    ``recompute_fc1``, the row weights ``[M]`` if folded; never the SwiGLU output. Two
    autograd nodes, so that FC2's gradients are released before FC1's backward runs; one
    while ``torch.compile`` traces it (no ``ahead``, ``wgrad`` must be None).
    Raises:
        ValueError: ``wgrad`` given while compiling.
    """
    backend = ExpertGemms.of(backend)
    src_M = dest_Nk = None
    if source is not None:
        x_in, src_M, dest_Nk = source.x_NH, source.src_M, source.dest_Nk
    if torch.compiler.is_compiling():  # one node: no Python state between backward nodes
        if wgrad is not None:
            raise ValueError("expert_mlp_recompute: a WgradAccumulator cannot be traced by torch.compile; "
                             "GroupedExperts.weights() makes none while compiling")
        return _ExpertMLPOneNode.apply(x_in, w13, w2, row_w, src_M, dest_Nk, layout, backend, recompute_fc1)
    box = _RecomputeBox()
    h, h13 = _FC1SwiGLU.apply(x_in, w13, row_w, src_M, dest_Nk, layout, backend, recompute_fc1, box, wgrad)
    return _FC2Recompute.apply(h, w2, x_in, w13, row_w, h13, src_M, layout, backend, box, wgrad)
