"""Gradients of a training step: fp32 main-gradient buckets, their all-reduce, the norm and clipping.

:class:`GradBuckets` holds one fp32 *main gradient* per plain (non-FSDP2) trainable parameter,
as views into flat buckets of at most ``bucket_elems`` elements. Each parameter's
``register_post_accumulate_grad_hook`` moves its gradient there as soon as autograd has
accumulated it, between :meth:`GradBuckets.start` and :meth:`GradBuckets.finish` (a backward
outside a step, e.g. ``torch.autograd.grad`` or a user's own ``loss.backward()`` on the model, leaves
``.grad`` as autograd makes it; :meth:`GradBuckets.zero_` clears the compute parameters' ``.grad``
at the next step). One GradBuckets per parameter: a second on the same parameters is refused
until the first's :meth:`~GradBuckets.remove`. By kind of parameter:

* bf16 compute parameters: ``main += p.grad`` (fp32), then ``p.grad = None`` at once, so the
  micro-batches accumulate in fp32 and no second full-size bf16 gradient lives on. The step's
  first gradient of a parameter is copied (``main = p.grad``) rather than added to zeros, so
  the buckets are not zero-filled before a step; a parameter that got no gradient by
  :meth:`GradBuckets.finish` has its main gradient zeroed there;
* fp32 parameters: ``p.grad`` *is* the main-gradient view (autograd accumulates into it in
  place), the hook only counts;
* bf16 parameters whose gradient a kernel can write in fp32 itself (the routed experts'
  weights: :class:`~dropless.ops.grouped_gemm.GradSink`, found by
  :meth:`~dropless.experts.GroupedExperts.weights` as the parameter's ``main_grad_sink``): the
  weight-gradient kernel writes (first micro-batch) or adds (later ones) the main gradient in
  fp32, autograd gets a placeholder, and the hook drops it and only counts (between
  :meth:`GradBuckets.start` and :meth:`GradBuckets.finish`; outside, autograd gets the gradient
  as usual). No bf16 gradient
  of the weight is made, rounded or copied.

On the step's last micro-batch (:meth:`GradBuckets.start` with ``sync=True``) a bucket whose
parameters all got their gradient is all-reduced asynchronously (SUM) while backward goes
on, in bucket order on every rank (DDP's scheme: buckets hold the parameters in reverse
registration order, roughly the order backward produces them); :meth:`GradBuckets.finish`
launches what is left, waits and divides by the world size. Groups:

* replicated parameters: all ranks (a dedicated process group, so these collectives never
  interleave with others on the default group);
* routed experts with EP > 1: the dp group (the ranks holding the same experts), since an
  EP dispatcher already summed the EP group's contributions on the owner
  (``dropless/dispatch/mesh.py``); no collective when dp = 1;
* both then ``/ world``: every rank's loss is a mean over its own tokens.

FSDP2 DTensor parameters (``dispatcher=fsdp`` experts, ``train.shard_dense``, the experts of
``train.shard_experts``) keep FSDP2's own reduce-scatter and are left out; so are their
gradient sinks (FSDP2 hands the kernels its gathered weights, which carry none: their
gradients come through autograd to FSDP2's reduce-scatter).

:func:`grad_norm` is the global L2 norm of every gradient (device tensor, no host sync):
replicated buckets once, EP-sharded buckets summed over the EP group, FSDP2 shards over their
own mesh, and the FSDP2 shards of ``train.shard_experts`` (each a piece of this EP rank's experts)
over their dp mesh and then the EP group: every expert shard counted once. :func:`clip_` scales
every gradient by ``max_norm / (norm + 1e-6)`` where ``norm > max_norm``,
on the device. :func:`clipped_step` is the optimizer step on clipped gradients: where every
param group runs the fused AdamW (CUDA, :func:`folds_clip`) the clip rides inside the optimizer's
own kernel as ``optimizer.grad_scale = (norm + 1e-6) / max_norm`` (the kernel divides each
gradient by it and writes the quotient back, as it does for ``torch.amp.GradScaler``), so no
separate pass over the gradients runs; otherwise :func:`clip_` then ``optimizer.step()``. Both
give the same update and leave the same clipped gradients, up to the rounding of
``g · (max/(n + ε))`` against ``g / ((n + ε)/max)``. :func:`guarded_step` is the fused path with
the decisions on the device: the clip always folded (a divisor of exactly 1 within the threshold)
and a non-finite step skipped by the kernel's ``found_inf``, so the host need not read the norm first.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dropless.ops.grouped_gemm import GradSink
from dropless.train.optim import is_dtensor

__all__ = ["GradBuckets", "grad_norm", "clip_", "clip_scale", "clip_note", "folds_clip", "clipped_step", "guarded_step",
           "BUCKET_ELEMS"]

#: default elements per bucket (25 MiB of fp32, DDP's default bucket size)
BUCKET_ELEMS = 25 * 2**20 // 4


@dataclass
class _Bucket:
    flat: torch.Tensor                  # fp32 [n]
    params: list[torch.Tensor]
    sharded: bool                       # routed experts with EP > 1 (reduced over dp)
    ready: int = 0
    work: Any = None
    launched: bool = False
    views: list[torch.Tensor] = field(default_factory=list)


def _dead() -> None:
    """A dead weak reference's call (the default of ``getattr(p, "_grad_buckets", _dead)()``)."""
    return None


class GradBuckets:
    """fp32 main gradients in flat buckets, filled by post-accumulate hooks (see the module doc).

    Args:
        params: the plain trainable parameters (compute copies), in registration order.
        sharded_ids: ids of the parameters sharded over EP (> 1): reduced over ``dp_group``.
        grads_are_params: fp32 training: ``p.grad`` is the main-gradient view itself.
        owners: the tensors whose ``.grad`` are the main-gradient views (the fp32 masters the
            optimizer steps, one per parameter); default: ``params`` (fp32 training).
        world_size: ranks (the divisor); 1: no collectives.
        world_group, dp_group, dp_size: the groups of the two kinds (see the module doc).
        bucket_elems: at most this many elements per bucket (a larger parameter gets its own).
        overlap: launch each bucket's all-reduce from the hooks (else all in :meth:`finish`).
        sinks: put a :class:`~dropless.ops.grouped_gemm.GradSink` on each bf16 parameter
            (``p.main_grad_sink``), so that kernels that can write its fp32 main gradient do;
            False: every gradient comes through autograd and the hooks.

    Attributes:
        main: fp32 views, one per parameter (``main[i]`` is ``params[i]``'s gradient).
        sharded: per parameter, whether it is EP-sharded (reduced over dp).
        flats: the flat fp32 buckets.
    """

    def __init__(self, params: list[torch.Tensor], sharded_ids: set[int], grads_are_params: bool,
                 world_size: int = 1, world_group: Any = None, dp_group: Any = None, dp_size: int = 1,
                 bucket_elems: int = BUCKET_ELEMS, overlap: bool = True,
                 owners: list[torch.Tensor] | None = None, sinks: bool = True):
        self.params = list(params)
        self.owners = self.params if owners is None else list(owners)
        self.world_size, self.world_group, self.dp_group, self.dp_size = world_size, world_group, dp_group, dp_size
        self.grads_are_params, self.overlap = grads_are_params, overlap
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}   # id(p) -> (bucket, index in bucket)
        for sharded in (False, True):
            chosen = [p for p in reversed(self.params) if (id(p) in sharded_ids) == sharded]
            i = 0
            while i < len(chosen):
                j, n = i, 0
                while j < len(chosen) and (n == 0 or n + chosen[j].numel() <= bucket_elems):
                    n += chosen[j].numel()
                    j += 1
                ps = chosen[i:j]
                flat = torch.zeros(n, dtype=torch.float32, device=ps[0].device)
                b = _Bucket(flat, ps, sharded)
                off = 0
                for k, p in enumerate(ps):
                    b.views.append(flat[off:off + p.numel()].view(p.shape))
                    self._where[id(p)] = (len(self.buckets), k)
                    off += p.numel()
                self.buckets.append(b)
                i = j
        self.main = [self.buckets[self._where[id(p)][0]].views[self._where[id(p)][1]] for p in self.params]
        self.sharded = [id(p) in sharded_ids for p in self.params]
        self.flats = [b.flat for b in self.buckets]
        self._sync = False
        self._next = 0
        self._written: set[int] = set()     # ids of parameters whose main grad holds this step's value
        self._in_step = False               # between start() and finish(): the hooks act only then
        if any(getattr(p, "_grad_buckets", _dead)() is not None for p in self.params):
            raise ValueError("GradBuckets: a parameter already has another GradBuckets' hooks (two sets would "
                             "each take its gradient); call that one's remove() first")
        for p in self.params:
            p._grad_buckets = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        #: bf16 parameters: a GradSink on each (id(p) -> sink), for the kernels that write fp32 themselves
        self._sinks: dict[int, GradSink] = {}
        if sinks and not grads_are_params:
            for p, g in zip(self.params, self.main):
                self._sinks[id(p)] = p.main_grad_sink = GradSink(g)
        for b in self.buckets:
            b.flat.zero_()
        self.zero_()

    # ------------------------------------------------------------------ step protocol
    def zero_(self) -> None:
        """Start a step: every main gradient counts as zero from here (before a step's first
        micro-batch); (re)attach the views as the owners' ``.grad``. fp32 training zero-fills
        the buckets (autograd accumulates into them); bf16 training defers it: each
        parameter's first gradient is copied in, and :meth:`finish` zeroes the rest."""
        self._written = set()
        for sink in self._sinks.values():
            sink.fresh, sink.wrote = True, False
        for b in self.buckets:
            if self.grads_are_params:
                b.flat.zero_()
            b.ready, b.work, b.launched = 0, None, False
        self._next = 0
        for o, g in zip(self.owners, self.main):
            o.grad = g
        if not self.grads_are_params:
            for p in self.params:
                p.grad = None

    def written(self) -> frozenset[int]:
        """Ids of the parameters whose main gradient holds this step's value so far."""
        return frozenset(self._written)

    def mark_written(self, ids: frozenset[int] | set[int]) -> None:
        """Record gradients written without the hooks' host code running (a CUDA graph replay of a
        captured backward: ``dropless/train/graph.py``), so :meth:`finish` does not zero them."""
        self._written |= set(ids)
        for i in ids:
            if i in self._sinks:
                self._sinks[i].fresh = False

    def detach_(self) -> None:
        """Set every owner's and parameter's ``.grad`` to None (until the next :meth:`zero_`)."""
        for t in self.owners + self.params:
            t.grad = None

    def start(self, sync: bool) -> None:
        """Before a micro-batch's backward: ``sync`` = it is the step's last (reduce during it)."""
        self._sync = sync and self.world_size > 1
        self._in_step = True
        for b in self.buckets:
            b.ready = 0
        for sink in self._sinks.values():
            sink.active = True

    def _hook(self, p: torch.Tensor) -> None:
        if not self._in_step:  # a backward outside a step: .grad stays as autograd made it
            return
        bi, k = self._where[id(p)]
        b = self.buckets[bi]
        if not self.grads_are_params:
            sink = self._sinks.get(id(p))
            if sink is not None and sink.wrote:  # a kernel wrote the main gradient itself; p.grad is a placeholder
                sink.wrote = False
                self._written.add(id(p))
            elif p.grad is not None:
                if id(p) in self._written:
                    b.views[k].add_(p.grad)
                else:
                    # the multi-tensor copy: a bf16 -> fp32 copy_ runs torch's unrolled (not
                    # vectorised) cast kernel, _foreach_copy_ the vectorised one
                    torch._foreach_copy_([b.views[k]], [p.grad])
                    self._written.add(id(p))
                if sink is not None:
                    sink.fresh = False
            p.grad = None
        if self._sync and self.overlap:
            b.ready += 1
            buckets = self.buckets
            while self._next < len(buckets) and buckets[self._next].ready >= len(buckets[self._next].params):
                self._launch(self.buckets[self._next])
                self._next += 1

    def _launch(self, b: _Bucket) -> None:
        if b.launched:
            return
        b.launched = True
        if b.sharded:
            if self.dp_size > 1:
                b.work = dist.all_reduce(b.flat, op=dist.ReduceOp.SUM, group=self.dp_group, async_op=True)
        else:
            b.work = dist.all_reduce(b.flat, op=dist.ReduceOp.SUM, group=self.world_group, async_op=True)

    def _zero_unwritten(self) -> None:
        if self.grads_are_params or len(self._written) == len(self.params):
            return
        for p, g in zip(self.params, self.main):
            if id(p) not in self._written:
                g.zero_()
                self._written.add(id(p))

    def finish(self) -> None:
        """After the last micro-batch's backward: zero the main gradients no parameter wrote
        this step, launch the rest, wait, ``/ world``."""
        self._in_step = False
        for sink in self._sinks.values():
            sink.active = False
        self._zero_unwritten()
        if self.world_size <= 1:
            return
        for b in self.buckets[self._next:]:
            self._launch(b)
        self._next = len(self.buckets)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            b.flat.div_(self.world_size)
        self._sync = False

    def remove(self) -> None:
        """Drop the hooks and the parameters' gradient sinks (another GradBuckets may then take them)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for p in self.params:
            if id(p) in self._sinks and getattr(p, "main_grad_sink", None) is self._sinks[id(p)]:
                del p.main_grad_sink
            if getattr(p, "_grad_buckets", _dead)() is self:
                del p._grad_buckets
        self._sinks = {}


# ----------------------------------------------------------------------------- norm and clip
def _sq(ts: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    if not ts:
        return torch.zeros((), device=dev, dtype=torch.float32)
    return torch.stack([n.float() for n in torch._foreach_norm(ts)]).pow(2).sum()


def grad_norm(buckets: GradBuckets | None, dtensor_grads: list[torch.Tensor], env: Any,
              ep_dtensor_grads: list[torch.Tensor] = ()) -> torch.Tensor:
    """Global L2 norm of the main gradients and the FSDP2 gradients: fp32 0-dim device tensor.

    Replicated buckets count once; EP-sharded buckets are summed over ``env.ep_group``;
    FSDP2 shards (``dtensor_grads``) over their own mesh's group; ``ep_dtensor_grads``, the FSDP2
    shards of this EP rank's experts (``train.shard_experts``: DTensors over the dp mesh), over
    their mesh's group and then ``env.ep_group``. No host sync.
    """
    # per-parameter norms (in parameter order), as a per-tensor reduction: fp32 norms of whole
    # flat buckets lose precision on CPU (2e-5 relative at 1.5 M elements)
    pairs = list(zip(buckets.main, buckets.sharded)) if buckets else []
    return _global_norm([g for g, sh in pairs if not sh], [g for g, sh in pairs if sh], dtensor_grads, env,
                        list(ep_dtensor_grads))


def _global_norm(replicated: list[torch.Tensor], ep_sharded: list[torch.Tensor],
                 dtensor_grads: list[torch.Tensor], env: Any,
                 ep_dtensor_grads: list[torch.Tensor] = ()) -> torch.Tensor:
    """L2 norm over replicated tensors (counted once), EP shards (squares summed over
    ``env.ep_group``), FSDP2 DTensor shards (over their mesh's group) and FSDP2 shards of EP shards
    (over their mesh's group, then ``env.ep_group``): fp32 0-dim, no host sync."""
    dev = env.device
    total = _sq(replicated, dev)
    ep_part = _sq(ep_sharded, dev) if ep_sharded else None
    for g_ep, grads in ((False, dtensor_grads), (True, ep_dtensor_grads)):
        by_group: dict[Any, list[torch.Tensor]] = {}
        for g in grads:
            by_group.setdefault(g.device_mesh.get_group(), []).append(g.to_local())
        for group, shards in by_group.items():
            s = _sq(shards, dev)
            if env.distributed:
                dist.all_reduce(s, group=group)
            if g_ep:  # summed over dp: this EP rank's experts; the EP group adds the others'
                ep_part = s if ep_part is None else ep_part + s
            else:
                total = total + s
    if ep_part is not None:
        if env.distributed and env.ep_size > 1:
            dist.all_reduce(ep_part, group=env.ep_group)
        total = total + ep_part
    return total.sqrt()


@torch.no_grad()
def clip_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float | None) -> None:
    """Where ``norm > max_norm``: scale ``grads`` in place by ``max_norm / (norm + 1e-6)`` (device-side).

    No-op without ``max_norm``; otherwise one multiply (by exactly 1.0 when not clipping).
    """
    if not max_norm or not grads:
        return
    coef = torch.where(norm > max_norm, max_norm / (norm + 1e-6), torch.ones_like(norm))
    plain = [g for g in grads if not is_dtensor(g)]
    if plain:
        torch._foreach_mul_(plain, coef)
    for g in grads:
        if is_dtensor(g):
            g.mul_(coef)


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The divisor of every gradient that clips to ``max_norm``: fp32 0-dim device tensor.

    ``(norm + 1e-6) / max_norm`` where ``norm > max_norm``, else 1: the reciprocal of
    :func:`clip_`'s coefficient (``norm``: fp32 0-dim, the pre-clip global L2 norm).
    """
    norm = norm.float()
    return torch.where(norm > max_norm, (norm + 1e-6) / max_norm, torch.ones_like(norm))


def folds_clip(optimizer: torch.optim.Optimizer) -> bool:
    """True when the clip can ride inside ``optimizer.step()`` as ``optimizer.grad_scale``.

    Only the fused Adam/AdamW kernels take ``grad_scale`` (the foreach and per-tensor ones
    refuse it) and torch passes the one attribute to every param group, so: every param
    group is ``fused`` and ``optimizer`` is a :class:`torch.optim.Adam` / ``AdamW``.
    """
    return (isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and bool(optimizer.param_groups)
            and all(g.get("fused") for g in optimizer.param_groups))


def clip_note(folded: bool) -> str:
    """Where ``optim.grad_clip`` scales the gradients: inside the fused AdamW kernel (``folded``:
    :func:`folds_clip` of the optimizer) or in a separate pass (:func:`clipped_step`)."""
    return ("inside the fused AdamW kernel (optimizer.grad_scale)" if folded else
            "scaled in a separate pass over the gradients (only the fused AdamW, the default on CUDA or with "
            "optim.fused=true, folds it in)")


@torch.no_grad()
def clipped_step(optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], norm: torch.Tensor,
                 max_norm: float) -> bool:
    """``optimizer.step()`` on the gradients clipped to ``max_norm`` (device-side, no host sync).

    Args:
        optimizer: the optimizer whose params' ``.grad`` are (views into) ``grads``.
        grads: every gradient the step reads (main-gradient buckets, FSDP2 DTensor grads).
        norm: fp32 0-dim, their global L2 norm before clipping.
        max_norm: the clip threshold (> 0).
    Returns:
        True where the clip was folded into the fused kernel (:func:`folds_clip`), False
        where :func:`clip_` ran first. Either way ``grads`` hold the clipped gradients after
        the step and ``optimizer`` keeps no ``grad_scale`` attribute (nothing of it reaches
        ``optimizer.state_dict()``).
    Raises:
        ValueError: ``max_norm`` is not a positive number (for no clipping, call ``optimizer.step()``).
        RuntimeError: ``optimizer`` already has a ``grad_scale`` (a GradScaler step in flight).
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"clipped_step: max_norm must be a positive number, got {max_norm!r}; "
                         "without clipping call optimizer.step() instead")
    if not folds_clip(optimizer):
        clip_(grads, norm, max_norm)
        optimizer.step()
        return False
    if getattr(optimizer, "grad_scale", None) is not None:
        raise RuntimeError("clipped_step: optimizer.grad_scale is set already (a GradScaler step?); "
                           "clip and scale cannot both be folded")
    optimizer.grad_scale = clip_scale(norm, max_norm)
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale
    return True


@torch.no_grad()
def guarded_step(optimizer: torch.optim.Optimizer, norm: torch.Tensor, max_norm: float | None,
                 finite: torch.Tensor) -> None:
    """``optimizer.step()`` decided on the device: skipped where ``finite`` is false, the gradients
    clipped to ``max_norm``; no host sync (the fused AdamW's ``found_inf`` and ``grad_scale``).

    Args:
        optimizer: Adam/AdamW with every param group fused (:func:`folds_clip`).
        norm: fp32 0-dim, the gradients' global L2 norm before clipping.
        max_norm: the clip threshold (> 0), or None / 0 for no clipping.
        finite: bool 0-dim device tensor: apply the step (True) or leave the parameters, the moments
            and the step count as they were (False; the kernel's ``found_inf = 1``, as
            ``torch.amp.GradScaler`` uses it). Step post-hooks run either way and see the flag as
            ``optimizer.found_inf`` (:class:`~dropless.train.optim.RouterBiasUpdate` moves no bias).
    The update equals :func:`clipped_step`'s (or a plain step within the threshold: the gradients are
    divided by exactly 1, which the fused kernel then writes back unchanged). The optimizer keeps no
    ``found_inf``/``grad_scale`` attribute afterwards.

    Raises:
        ValueError: ``optimizer`` is not fused in every param group.
        RuntimeError: ``optimizer`` already has a ``grad_scale`` or ``found_inf`` (a GradScaler step in flight).
    """
    if not folds_clip(optimizer):
        raise ValueError("guarded_step: needs Adam/AdamW fused in every param group (the device-side skip and "
                         "clip are the fused kernel's found_inf and grad_scale); use clipped_step")
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        raise RuntimeError("guarded_step: optimizer.grad_scale or found_inf is set already (a GradScaler step?)")
    optimizer.found_inf = (~finite).to(torch.float32)
    if max_norm:
        optimizer.grad_scale = clip_scale(norm, max_norm)
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
        if max_norm:
            del optimizer.grad_scale
