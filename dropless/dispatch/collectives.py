"""Differentiable, asynchronous collectives for the dispatchers, with byte counting and clear errors.

Each collective is split in two autograd Functions, a *start* and a *wait*::

    out = start(x, op)      # issues the collective with async_op=True, returns the (unfilled) output
    ...                     # independent work overlaps the transfer
    out = wait(out, op)     # blocks on it; ``out`` is now valid

Backward runs the pair in reverse: ``wait``'s backward issues the reverse collective
(all-to-all with the splits swapped, all-gather <-> reduce-scatter) asynchronously and
``start``'s backward waits on it, so autograd nodes that the engine runs in between overlap
the backward transfer too. The output of ``start`` must go to ``wait`` and nowhere else.

Reverse collectives (the VJPs):

* ``all_to_all_single(out, x, out_splits, in_splits)`` -> ``all_to_all_single(gx, gout, in_splits, out_splits)``;
* ``all_gather_into_tensor`` -> ``reduce_scatter_tensor`` (SUM): every rank gets the gradient of
  its own chunk summed over all ranks that used it;
* ``reduce_scatter_tensor`` (SUM) -> ``all_gather_into_tensor``.

Why not ``torch.distributed.nn.functional.all_to_all_single``: it is differentiable and works
with gloo and uneven splits (checked: correct gradients on 2 ranks), but it waits inside the
call, so nothing can overlap the transfer; this pair is the asynchronous equivalent.

Bytes (:class:`CommStats`), counted from the shapes handed to each
collective, only for data that leaves / enters the rank (the chunk a rank keeps for itself
is not counted): all-to-all: rows sent to / received from other ranks × row bytes;
all-gather of an ``[n, ...]`` chunk over ``W`` ranks: ``(W-1)·chunk`` each way; reduce-scatter
of ``[W·n, ...]``: ``(W-1)·n``-row chunks each way.

Errors: a collective that fails or outlives the process group's timeout (a peer died or
stopped taking part; gloo and NCCL honour ``init_process_group(timeout=...)``) raises
:class:`CollectiveError` naming the dispatcher and the collective.

CUDA tensors on a gloo group (several ranks on one GPU, ``train.dist_backend=gloo``): gloo
takes them for all three collectives used here (torch's ``ProcessGroupGloo``: ``alltoall_base``,
``_allgather_base`` and ``_reduce_scatter_base``, the last an all-reduce of a copy; each copies
the tensors to pinned host memory on a side stream, runs on the host and copies back, so the
order on the caller's stream is kept). A collective that gloo refuses for CUDA tensors when it is
issued (an older torch) is then staged through the host by this module instead, for the rest of
the process (a warning says which): the input copied to the host (a host sync), the collective on
host tensors, the output copied back to the device buffer on :func:`wait`. :data:`HOST_STAGED`
holds the kinds staged so.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CollectiveError", "CollOp", "CommStats", "HOST_STAGED", "start", "wait", "group_size", "group_rank",
           "checked"]

#: collective kinds (``"a2a"``, ``"ag"``, ``"rs"``) that CUDA tensors on a gloo group go through as
#: host copies (filled when gloo refuses one for CUDA tensors; see the module docstring)
HOST_STAGED: set[str] = set()


@dataclass
class CommStats:
    """Bytes this rank sent and received in collectives since the last :meth:`reset` (host ints).

    Counted from the shapes handed to the collectives (payload bytes, as docs/design.md#dispatchers's cost
    table counts them), forward and backward together.
    """

    bytes_sent: int = 0
    bytes_received: int = 0

    def add(self, sent: int, received: int) -> None:
        """Count ``sent`` and ``received`` bytes (host ints)."""
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)

    def reset(self) -> dict[str, int]:
        """``{"bytes_sent", "bytes_received"}`` since the last reset; both back to 0."""
        out = {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received}
        self.bytes_sent = self.bytes_received = 0
        return out


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer rank died or stopped taking part."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_size(group: Any) -> int:
    """Size of ``group``; ``None`` means no group (EP = 1, nothing is communicated): 1."""
    return dist.get_world_size(group) if group is not None and _distributed() else 1


def group_rank(group: Any) -> int:
    """This rank's index in ``group`` (0 for ``None``)."""
    return dist.get_rank(group) if group is not None and _distributed() else 0


def checked(fn, what: str):
    """Run ``fn()``; turn a RuntimeError from the collective layer into a :class:`CollectiveError`."""
    try:
        return fn()
    except CollectiveError:
        raise
    except RuntimeError as err:
        raise CollectiveError(
            f"dropless: {what} did not complete: a peer rank died or stopped taking part, or it did not "
            f"finish within the process group's timeout (train.dist_timeout_s; "
            f"dropless.dispatch.mesh.start_process_group(timeout_s=...)). Every rank of the group must run the same "
            f"layers with the same shapes. Underlying error: {err}") from err


@dataclass
class CollOp:
    """One collective of a dispatcher call, and the state its start/wait pair shares.

    Attributes:
        kind: ``"a2a"`` (all_to_all_single), ``"ag"`` (all_gather_into_tensor) or
            ``"rs"`` (reduce_scatter_tensor, SUM).
        group: the process group (None: no communication; start/wait are the identity).
        what: name for error messages, e.g. ``"a2a dispatcher: rows all-to-all"``.
        out_splits, in_splits: host split sizes (rows) for ``a2a``; None otherwise.
        comm: the dispatcher's :class:`CommStats` (forward and backward bytes are added to it).
    """

    kind: str
    group: Any
    what: str
    out_splits: list[int] | None = None
    in_splits: list[int] | None = None
    comm: CommStats | None = None
    work: Any = None
    keep: list = field(default_factory=list)
    bwork: Any = None
    bout: torch.Tensor | None = None
    bkeep: list = field(default_factory=list)

    def reversed_kind(self) -> str:
        return {"a2a": "a2a", "ag": "rs", "rs": "ag"}[self.kind]


# torch 2.13 renames these two (the old names warn FutureWarning); torch < 2.13 has only the old ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _issue(kind: str, out: torch.Tensor, x: torch.Tensor, group: Any, out_splits, in_splits):
    """``out <- collective(x)`` issued with ``async_op=True``; returns its work."""
    if kind == "a2a":
        return dist.all_to_all_single(out, x, list(out_splits), list(in_splits), group=group, async_op=True)
    if kind == "ag":
        return _all_gather(out, x, group=group, async_op=True)
    return _reduce_scatter(out, x, op=dist.ReduceOp.SUM, group=group, async_op=True)


class _HostStagedWork:
    """The work of a collective run on host copies; ``wait()`` copies the host output into the device one."""

    def __init__(self, work: Any, out_host: torch.Tensor, out: torch.Tensor):
        self.work, self.out_host, self.out = work, out_host, out

    def wait(self) -> bool:
        self.work.wait()
        # pinned source: the copy is ordered on the current stream; the host allocator keeps the
        # buffer until it is done
        self.out.copy_(self.out_host, non_blocking=True)
        return True


def _issue_host_staged(kind: str, out: torch.Tensor, x: torch.Tensor, group: Any, out_splits, in_splits):
    x_host = x.cpu()  # a host sync: the host needs the values
    out_host = torch.empty(out.shape, dtype=out.dtype, pin_memory=out.is_cuda)
    return _HostStagedWork(_issue(kind, out_host, x_host, group, out_splits, in_splits), out_host, out)


def _gloo_cuda(x: torch.Tensor, group: Any) -> bool:
    return x.is_cuda and dist.get_backend(group) == "gloo"


def _issue_or_stage(kind: str, out: torch.Tensor, x: torch.Tensor, group: Any, out_splits, in_splits, what: str):
    """:func:`_issue`, or its host-staged form for CUDA tensors on a gloo group that gloo refuses."""
    if kind in HOST_STAGED and _gloo_cuda(x, group):
        return _issue_host_staged(kind, out, x, group, out_splits, in_splits)
    try:
        return _issue(kind, out, x, group, out_splits, in_splits)
    except (RuntimeError, NotImplementedError) as err:  # refused when issued: nothing was sent
        if not _gloo_cuda(x, group):
            raise
        HOST_STAGED.add(kind)
        warnings.warn(f"dropless: {what}: this torch's gloo backend does not take CUDA tensors for this "
                      f"collective ({str(err).splitlines()[0][:200]}); it is staged through host memory from now "
                      "on", stacklevel=2)
        return _issue_host_staged(kind, out, x, group, out_splits, in_splits)


def _launch(kind: str, x: torch.Tensor, group: Any, out_splits, in_splits, what: str, comm: CommStats | None):
    """Issue one collective asynchronously. Returns ``(out, work)``; counts its bytes."""
    x = x.contiguous()
    w = group_size(group)
    me = group_rank(group)
    row_bytes = torch.Size(x.shape[1:]).numel() * x.element_size()
    if kind == "a2a":
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        sent = (sum(in_splits) - in_splits[me]) * row_bytes
        recv = (sum(out_splits) - out_splits[me]) * row_bytes
    elif kind == "ag":
        out = x.new_empty((w * x.shape[0], *x.shape[1:]))
        sent = recv = (w - 1) * x.shape[0] * row_bytes
    elif kind == "rs":
        if x.shape[0] % w:
            raise ValueError(f"dropless: {what}: reduce-scatter of {x.shape[0]} rows over {w} ranks: the rows "
                             f"must be a multiple of the group size; every EP rank must pass the same number "
                             f"of tokens T to the agrs dispatcher")
        out = x.new_empty((x.shape[0] // w, *x.shape[1:]))
        sent = recv = (w - 1) * out.shape[0] * row_bytes
    else:  # pragma: no cover - internal
        raise ValueError(kind)
    work = checked(lambda: _issue_or_stage(kind, out, x, group, out_splits, in_splits, what), what)
    if comm is not None:
        comm.add(sent, recv)
    return out, work, x


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op: CollOp):
        ctx.op = op
        out, op.work, xc = _launch(op.kind, x, op.group, op.out_splits, op.in_splits, op.what, op.comm)
        op.keep = [xc, out]  # alive until the transfer completes
        return out

    @staticmethod
    def backward(ctx, _g_out):
        # _g_out is the gradient of the output buffer that wait's backward passed through; the
        # reverse collective it started on it delivers the gradient of x into op.bout
        op = ctx.op
        checked(op.bwork.wait, op.what + " (backward)")
        out, op.bout, op.bwork, op.bkeep = op.bout, None, None, []
        return out, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, op: CollOp):
        ctx.op = op
        checked(op.work.wait, op.what)
        op.work, op.keep = None, []
        return out

    @staticmethod
    def backward(ctx, g_out):
        op = ctx.op
        kind = op.reversed_kind()
        bout, op.bwork, gc = _launch(kind, g_out, op.group, op.in_splits, op.out_splits,
                                     op.what + " (backward)", op.comm)
        op.bout, op.bkeep = bout, [gc]
        # pass g_out through to start's backward, which waits on op.bwork and returns op.bout
        return g_out, None


def _needs_grad(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def start(x: torch.Tensor, op: CollOp) -> torch.Tensor:
    """Issue ``op`` on ``x`` asynchronously; returns its output buffer (valid after :func:`wait`).

    On a group of one rank (or without torch.distributed) nothing is issued and ``x`` is returned.
    """
    if group_size(op.group) == 1:
        return x
    if _needs_grad(x):
        return _Start.apply(x, op)
    out, op.work, xc = _launch(op.kind, x, op.group, op.out_splits, op.in_splits, op.what, op.comm)
    op.keep = [xc, out]
    return out


def wait(out: torch.Tensor, op: CollOp) -> torch.Tensor:
    """Wait for ``op`` (started by :func:`start`); returns ``out``, now filled. Differentiable."""
    if group_size(op.group) == 1:
        return out
    if _needs_grad(out):
        return _Wait.apply(out, op)
    checked(op.work.wait, op.what)
    op.work, op.keep = None, []
    return out
