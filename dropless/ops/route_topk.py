"""The router's expert choice: biased, group-limited top-k of each token's scores (DeepSeek-V3).

One op, :func:`group_limited_topk`, which picks its Triton kernel or its torch reference in one
place (:func:`dropless.ops.select.use_triton`). For each token ``t`` (row of ``scores_TE``) and
``biased = scores + bias``:

* ``method = "noaux_tc"`` (DeepSeek-V3): the E experts form ``n_group`` groups of ``E / n_group``
  consecutive experts; a group's score is the sum of its two highest biased scores;
* ``method = "group_limited_greedy"`` (DeepSeek-V2): a group's score is its highest biased score;
* then the ``topk_group`` best groups are kept, the experts of the other groups count as -inf,
  and the ``k`` experts of highest (masked) biased score are chosen;
* ``method = "greedy"``, or ``n_group = 1``: the plain top-k of the biased scores.

The chosen ids come in descending order of biased score, as ``torch.topk(..., sorted=True)``
gives them: :class:`~dropless.routing.RouterOutput` promises that order, and the fp32 sums over the
``k`` choices (the weights' normalisation, the combine) run in it, so their rounding depends on it.
(The dispatch sort, the counts, the aux loss and the capacity-factor baseline do not: a token meets
an expert at most once.)

Ties: the Triton kernel breaks every tie (between experts and between groups) for the lowest
index, and orders equal scores by ascending index; ``-0.0`` equals ``0.0``; NaN ranks above
``+inf`` (as in ``torch.topk``; the router refuses non-finite logits unless told not to). The torch
reference uses ``torch.topk``, whose order among equal values is unspecified (it may differ between
devices and versions), so the two paths agree exactly where no tie decides a choice; where one
does, each path's choice is a valid selection by the rule above.

The kernel: each program takes ``BLOCK_T`` rows and holds them as ``[BLOCK_T, G, E / G]`` (each
extent padded to a power of two, padding below every real value). Every score becomes one int64
key, ``(order-preserving int32 of the fp32 value) << 32 | (2^31 - 1 - expert id)``, so one max
reduction finds the highest score and, among equal ones, the lowest id; a chosen entry is then
set below every key. The group score is the sum (``noaux_tc``: of the top-2 values, the same fp32
addition as the reference) or the top-1; ``topk_group`` rounds of argmax keep groups, ``k`` rounds
pick experts. One launch, no host sync; reads ``T·E`` fp32 and writes ``T·k`` int64.
"""

from __future__ import annotations

import torch

from dropless.ops import select

__all__ = ["group_limited_topk", "group_limited_topk_torch", "kernel_shape", "METHODS"]

METHODS = ("noaux_tc", "group_limited_greedy", "greedy")
_METHOD_ID = {"noaux_tc": 0, "group_limited_greedy": 1, "greedy": 2}
#: rows × (padded) experts held by one program; rows per program = ELEMS_PER_PROGRAM / padded E
ELEMS_PER_PROGRAM, NUM_WARPS = 2048, 4
#: padded E above this runs the torch reference (one row per program would no longer fit in registers)
MAX_KERNEL_EXPERTS = 4096

if select.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _key(v, e):
        """int64 key of fp32 ``v`` at expert (or group) id ``e``: signed order = (value, then lowest id)."""
        v = tl.where(v == 0.0, 0.0, v)              # -0.0 -> +0.0
        v = tl.where(v != v, float("nan"), v)       # every NaN -> +NaN (above +inf)
        b = v.to(tl.int32, bitcast=True)
        o = b ^ ((b >> 31) & 0x7FFFFFFF)            # negative floats: reverse their order
        return (o.to(tl.int64) << 32) + (0x7FFFFFFF - e).to(tl.int64)

    @triton.jit
    def _value(key):
        """The fp32 value of a :func:`_key` (the canonical one: +0.0, +NaN)."""
        o = (key >> 32).to(tl.int32)
        b = o ^ ((o >> 31) & 0x7FFFFFFF)
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _id(key):
        return 0x7FFFFFFF - (key - ((key >> 32) << 32))

    @triton.jit
    def _route_topk_kernel(s_ptr, b_ptr, out_ptr, T, stride_s, HAS_BIAS: tl.constexpr, K: tl.constexpr,
                           KP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, GE: tl.constexpr,
                           GEP: tl.constexpr, KG: tl.constexpr, METHOD: tl.constexpr, GROUPED: tl.constexpr,
                           BLOCK_T: tl.constexpr):
        gone = tl.full([BLOCK_T, GP, GEP], -9223372036854775808, tl.int64)  # below every key
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        rmask = rows < T
        g = tl.arange(0, GP)
        j = tl.arange(0, GEP)
        e = g[:, None] * GE + j[None, :]                                  # [GP, GEP] expert id
        emask = (g[:, None] < G) & (j[None, :] < GE)
        m3 = rmask[:, None, None] & emask[None, :, :]
        x = tl.load(s_ptr + rows.to(tl.int64)[:, None, None] * stride_s + e[None, :, :], mask=m3, other=0.0)
        if HAS_BIAS:
            x = x + tl.load(b_ptr + e, mask=emask, other=0.0)[None, :, :]
        e3 = e[None, :, :] + tl.zeros([BLOCK_T, GP, GEP], dtype=tl.int32)
        key = tl.where(emask[None, :, :], _key(x, e3), gone)
        if GROUPED:
            k1 = tl.max(key, axis=2)                                      # [BLOCK_T, GP]
            if METHOD == 0:  # noaux_tc: sum of the top-2
                k2 = tl.max(tl.where(key == k1[:, :, None], gone, key), axis=2)
                gs = _value(k1) + _value(k2)
            else:  # group_limited_greedy: the top-1
                gs = _value(k1)
            g2 = g[None, :] + tl.zeros([BLOCK_T, GP], dtype=tl.int32)
            gone_g = tl.full([BLOCK_T, GP], -9223372036854775808, tl.int64)
            gkey = tl.where(g2 < G, _key(gs, g2), gone_g)
            keep = g2 < 0
            for _ in tl.static_range(KG):
                best = tl.max(gkey, axis=1)
                hit = gkey == best[:, None]
                keep = keep | hit
                gkey = tl.where(hit, gone_g, gkey)
            masked = _key(tl.full([BLOCK_T, GP, GEP], float("-inf"), tl.float32), e3)
            key = tl.where(emask[None, :, :], tl.where(keep[:, :, None], key, masked), gone)
        c = tl.arange(0, KP)
        out = tl.zeros([BLOCK_T, KP], dtype=tl.int64)
        for i in tl.static_range(K):  # k rounds of argmax: descending score, lowest id first
            best = tl.max(tl.max(key, axis=2), axis=1)                    # [BLOCK_T]
            out = tl.where(c[None, :] == i, _id(best)[:, None], out)
            key = tl.where(key == best[:, None, None], gone, key)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + c[None, :], out, mask=rmask[:, None] & (c[None, :] < K))


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def kernel_shape(E: int, n_group: int, method: str) -> tuple[int, int, int, int]:
    """``(groups, padded groups, padded experts per group, rows per program)`` of the kernel's launch
    (rows per program from :data:`ELEMS_PER_PROGRAM`; ``groups`` is 1 without group-limited selection)."""
    g = n_group if n_group > 1 and method != "greedy" else 1
    gp, gep = _pow2(g), _pow2(E // g)
    return g, gp, gep, max(1, min(64, ELEMS_PER_PROGRAM // (gp * gep)))


# ---------------------------------------------------------------------------- the Triton launch, as an opaque op
# (mutating its output, with a no-op fake) so that torch.compile traces around it with fullgraph=True
def _route_topk_launch(scores: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, n_group: int,
                       topk_group: int, method: str) -> None:
    t, e = scores.shape
    k = out.shape[1]
    g, gp, gep, block_t = kernel_shape(e, n_group, method)
    _route_topk_kernel[(triton.cdiv(t, block_t),)](
        scores, bias if bias is not None else scores, out, t, scores.stride(0), HAS_BIAS=bias is not None, K=k,
        KP=_pow2(k), G=g, GP=gp, GE=e // g, GEP=gep, KG=topk_group if g > 1 else 1, METHOD=_METHOD_ID[method],
        GROUPED=g > 1, BLOCK_T=block_t, num_warps=NUM_WARPS)


_route_topk_op = torch.library.custom_op("dropless::route_topk", _route_topk_launch, mutates_args=("out",))
_route_topk_op.register_fake(lambda *args: None)


# ---------------------------------------------------------------------------- torch reference
def group_limited_topk_torch(scores_TE: torch.Tensor, k: int, n_group: int, topk_group: int, method: str,
                             bias_E: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of :func:`group_limited_topk` with ``torch.topk`` (tie order unspecified); no checks."""
    biased_TE = scores_TE if bias_E is None else scores_TE + bias_E.to(scores_TE.dtype)
    if n_group > 1 and method != "greedy":
        T, E = biased_TE.shape
        biased_TGe = biased_TE.view(T, n_group, E // n_group)
        if method == "noaux_tc":
            group_score_TG = biased_TGe.topk(2, dim=-1).values.sum(dim=-1)
        else:  # DeepSeek-V2's group_limited_greedy: best expert of the group
            group_score_TG = biased_TGe.amax(dim=-1)
        keep_idx = group_score_TG.topk(topk_group, dim=-1).indices
        keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
        keep_TG.scatter_(1, keep_idx, True)
        biased_TE = biased_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, E)
    return biased_TE.topk(k, dim=-1).indices


# ---------------------------------------------------------------------------- the op
def _check(scores_TE, k, n_group, topk_group, method, bias_E) -> None:
    name = "group_limited_topk"
    if not isinstance(scores_TE, torch.Tensor) or scores_TE.dim() != 2 or scores_TE.dtype != torch.float32:
        what = f"{scores_TE.dtype} {tuple(scores_TE.shape)}" if isinstance(scores_TE, torch.Tensor) else \
            type(scores_TE).__name__
        raise ValueError(f"{name}: scores must be an fp32 [T, E] tensor, got {what}")
    E = scores_TE.shape[1]
    if bias_E is not None and (not isinstance(bias_E, torch.Tensor) or bias_E.shape != (E,)
                               or bias_E.dtype != torch.float32 or bias_E.device != scores_TE.device):
        what = f"{bias_E.dtype} {tuple(bias_E.shape)} on {bias_E.device}" if isinstance(bias_E, torch.Tensor) else \
            type(bias_E).__name__
        raise ValueError(f"{name}: bias must be fp32 [E={E}] on {scores_TE.device}, got {what}")
    if method not in METHODS:
        raise ValueError(f"{name}: method={method!r} must be one of {METHODS}")
    if n_group < 1 or E % n_group:
        raise ValueError(f"{name}: n_group={n_group} must be >= 1 and divide E={E}")
    per_group = E // n_group
    if n_group > 1 and method != "greedy":
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"{name}: topk_group={topk_group} must be in [1, n_group={n_group}]")
        if method == "noaux_tc" and per_group < 2:
            raise ValueError(f"{name}: noaux_tc sums each group's top-2, but the groups hold {per_group} expert")
        avail = topk_group * per_group
    else:
        avail = E
    if not 1 <= k <= avail:
        raise ValueError(f"{name}: k={k} must be in [1, {avail}] (the experts of the kept groups)")


def group_limited_topk(scores_TE: torch.Tensor, k: int, n_group: int = 1, topk_group: int = 1,
                       method: str = "noaux_tc", bias_E: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's ``k`` experts by biased, group-limited top-k (the module docstring gives the rule).

    Args:
        scores_TE: fp32 ``[T, E]`` scores (the router's sigmoid or softmax); not differentiated.
        k: experts per token. n_group: groups of ``E / n_group`` consecutive experts (1: no groups).
        topk_group: groups kept (ignored when ``n_group == 1`` or ``method == "greedy"``).
        method: ``"noaux_tc"`` (group score = sum of its top-2), ``"group_limited_greedy"``
            (its top-1) or ``"greedy"`` (no groups).
        bias_E: optional fp32 ``[E]`` added to the scores for the choice only (the router's
            ``e_score_correction_bias``; the kernel adds it, as the reference does, in fp32).
    Returns:
        int64 ``[T, k]`` expert ids in ``[0, E)``, distinct in each row, in descending order of
        biased score. Ties: the Triton kernel takes the lowest id (of expert and of group) first;
        the torch reference's order among equal values is ``torch.topk``'s (unspecified).
    Raises:
        ValueError: before any launch, for a ``scores_TE`` that is not fp32 2-D, a ``bias_E``
            that is not fp32 ``[E]`` on its device, an unknown method, ``E % n_group != 0``,
            ``topk_group`` outside ``[1, n_group]``, groups of one expert under ``noaux_tc``,
            ``k`` outside ``[1, experts in the kept groups]``.
    Padded E (next power of two of the group size times that of ``n_group``) above
    :data:`MAX_KERNEL_EXPERTS` takes the torch reference on every device. No host sync.
    """
    _check(scores_TE, k, n_group, topk_group, method, bias_E)
    T, E = scores_TE.shape
    _, gp, gep, _ = kernel_shape(E, n_group, method)
    kernel = select.use_triton(scores_TE) and gp * gep <= MAX_KERNEL_EXPERTS
    if not kernel:
        return group_limited_topk_torch(scores_TE, k, n_group, topk_group, method, bias_E)
    out = torch.empty(T, k, dtype=torch.int64, device=scores_TE.device)
    if T == 0:
        return out
    scores = scores_TE if scores_TE.stride(1) == 1 else scores_TE.contiguous()
    launch = _route_topk_op if torch.compiler.is_compiling() else _route_topk_launch
    launch(scores, bias_E.contiguous() if bias_E is not None else None, out, n_group, topk_group, method)
    return out
