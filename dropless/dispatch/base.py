"""The dispatcher interface shared by every way tokens reach their experts.

A dispatcher takes the rank's tokens and their routing and lands the rows
for this rank's ``e`` local experts in one expert-sorted, aligned buffer with
an :class:`~dropless.layout.ExpertLayout` (docs/design.md#the-pipeline); after
the experts ran, ``combine`` brings their outputs back to the original token
order as the weighted sum over ``k``.

Every dispatcher gives the same outputs and gradients as ``local`` on the
same global batch. A routed expert index ``< 0`` means "dropped" (the
``capacity_factor`` baseline) and is never dispatched.

FP8 dispatch (:attr:`Dispatcher.lands_fp8`; docs/design.md#fp8-dispatch): given a
:class:`~dropless.ops.fp8_rows.RowQuantiser` (FC1's row quantisation), the dispatcher
quantises the ``T`` tokens once, moves their e4m3 codes and scales instead of the rows, and
lands them as :class:`~dropless.ops.fp8_rows.Fp8Rows` (``Dispatched.fp8``); ``rows_MH`` is then
the :func:`~dropless.ops.fp8_rows.grad_port` through which the landed rows' gradient returns to
the tokens in the compute dtype. The combine is unchanged. ``local`` (and ``fsdp``) move nothing:
their gather writes the codes and scales as it lands the rows, with the rows themselves
(``Fp8Rows.rows_kept``; docs/design.md#fp8-quantisation-in-the-row-kernels).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from dropless.config import ConfigError
from dropless.dispatch.collectives import CommStats, group_rank, group_size
from dropless.dispatch.mesh import local_expert_count
from dropless.layout import ExpertLayout
from dropless.ops.fp8_rows import Fp8Rows, RowQuantiser
from dropless.permute import RowSource


@dataclass
class Dispatched:
    """What :meth:`Dispatcher.dispatch` returns.

    Attributes:
        rows_MH: ``[M, H]`` landed rows, expert-sorted and aligned (padding unspecified).
        layout: their :class:`ExpertLayout` over the ``e`` local experts.
        row_weight_M: ``[M]`` routing weight of each landed row when the weights are
            folded into the activation (``fold_routing_weights``), else None.
        handle: dispatcher-specific state that :meth:`Dispatcher.combine` needs
            (integer indices, split sizes, the weights when not folded).
        source: where the rows come from, when they are a local gather (``local``, ``fsdp``);
            ``rows_MH`` is None after :meth:`Dispatcher.dispatch_source`, whose caller gathers.
        fp8: the landed rows as e4m3 codes + scales (FP8 dispatch), ``rows_MH`` then being their
            gradient port (zero-stride, values unused); None: ``rows_MH`` holds the rows.
    """

    rows_MH: torch.Tensor | None
    layout: ExpertLayout
    row_weight_M: torch.Tensor | None
    handle: Any
    source: RowSource | None = None
    fp8: Fp8Rows | None = None


class Pending:
    """The second half of a two-phase call: :meth:`wait` returns the result.

    :meth:`Dispatcher.dispatch_async` / :meth:`Dispatcher.combine_async` return one. A
    dispatcher whose collectives run asynchronously returns after issuing them, and
    ``wait()`` blocks on them and finishes the work; one with nothing to wait for (``local``)
    returns an already-finished ``Pending``. ``wait()`` may be called once.
    """

    def __init__(self, finish: Any = None, *, value: Any = None):
        self._finish, self._value, self._done = finish, value, finish is None

    @property
    def done(self) -> bool:
        """True when there is nothing left to wait for (``wait()`` returns at once)."""
        return self._done

    def wait(self) -> Any:
        """The result: finishes the call on the first use (blocking on its collectives), then returns it."""
        if not self._done:
            self._value, self._finish, self._done = self._finish(), None, True
        return self._value


class Dispatcher(ABC):
    """Base class: see the module docstring.

    Subclasses implement :meth:`dispatch_async` and :meth:`combine_async` (the two-phase
    calls); :meth:`dispatch` and :meth:`combine` are those calls waited on at once.

    Args:
        num_experts: ``E`` (``n_routed_experts``).
        group: the EP process group (e.g. ``mesh["ep"].get_group()``, or ``dist.group.WORLD``);
            None: EP = 1, nothing moves.
    Attributes:
        name: the config flag (``dispatcher=…``).
        expert_parallel: False for a dispatcher that keeps every expert on every rank
            (``local``, ``fsdp``: EP = 1 always).
        group: the EP process group (None: EP = 1).
        ep_size, ep_rank: the EP group's size and this rank's place in it.
        comm: :class:`CommStats` of this dispatcher.
    Raises:
        ConfigError (a ValueError): ``E`` not a positive multiple of the EP group's size.
    """

    name: str = "base"
    expert_parallel: bool = True
    #: True when the landed rows are a local gather of the rank's tokens (EP = 1), so the
    #: experts can re-gather them in backward (``recompute_gather``; :meth:`dispatch_source`).
    gathers_locally: bool = False
    #: True when :meth:`dispatch_async` takes ``quant`` and lands the rows as FP8 codes + scales: moved as
    #: such (``a2a``, ``agrs``), or written by the gather that lands the rows (``local``, ``fsdp``).
    lands_fp8: bool = False
    #: What the dispatcher runs between ranks inside forward and backward ("" for nothing), which a
    #: CUDA graph capture or a compiled MoE block cannot hold (``train.cuda_graph``, ``train.compile_moe``).
    collectives: str = "it moves the tokens between the EP ranks in collectives sized on the host"
    #: Constructor keywords beyond ``(num_experts, group)`` (:func:`~dropless.dispatch.registry.build_dispatcher`).
    options: tuple[str, ...] = ()
    #: True when FSDP2 shards the experts' weights and all-gathers them in each forward (the model
    #: then needs :func:`dropless.train.shard.apply_fsdp`).
    shards_experts: bool = False

    @classmethod
    def check_ep(cls, ep_size: int) -> None:
        """Raise :class:`ConfigError` when a dispatcher that keeps every expert on every rank
        (:attr:`expert_parallel` false) is given an EP size other than 1."""
        if not cls.expert_parallel and ep_size != 1:
            raise ConfigError(f"dispatcher={cls.name} with EP = {ep_size}: {cls.name} keeps every expert on every "
                              "rank (EP = 1); set dispatcher.ep_size=1, or use dispatcher=a2a or agrs for expert "
                              "parallelism")

    @classmethod
    def default_ep_size(cls, world_size: int) -> int:
        """What ``dispatcher.ep_size: null`` means: the world size where :attr:`expert_parallel`, else 1."""
        return world_size if cls.expert_parallel else 1

    @classmethod
    def check_regather(cls, field: str = "recompute_gather") -> None:
        """Raise :class:`ConfigError` when this dispatcher cannot serve ``recompute_gather`` (named ``field``
        in the message): its landed rows come through a collective, not from this rank's tokens, so
        backward cannot re-gather them (:attr:`gathers_locally` false)."""
        if not cls.gathers_locally:
            raise ConfigError(f"{field}=true: re-gathers the landed rows from this rank's tokens in backward, but "
                              f"dispatcher={cls.name} lands them through a collective; use dispatcher=local or fsdp, "
                              f"or set {field}=false")

    @classmethod
    def check_available(cls) -> None:
        """Raise :class:`ConfigError` saying what to install when this dispatcher's optional dependency
        is missing (a run calls it before its config is printed and its run dir made); nothing here."""

    def __init__(self, num_experts: int, group: Any = None):
        self.group = group
        self.ep_size, self.ep_rank = group_size(group), group_rank(group)
        local_expert_count(num_experts, self.ep_size, experts_name="n_routed_experts",
                           fix=f"dispatcher={self.name}")
        self.num_experts = num_experts
        self.comm = CommStats()

    @property
    def num_local_experts(self) -> int:
        """``e = E / EP``."""
        return self.num_experts // self.ep_size

    @property
    def expert_offset(self) -> int:
        """Global id of local expert 0."""
        return self.ep_rank * self.num_local_experts

    def _what(self, collective: str) -> str:
        """``"a2a dispatcher (EP rank 1/4): row all-to-all"``: names a collective in error messages."""
        return f"{self.name} dispatcher (EP rank {self.ep_rank}/{self.ep_size}): {collective}"

    @abstractmethod
    def dispatch_async(self, x_TH: torch.Tensor, topk_idx_Tk: torch.Tensor, topk_weight_Tk: torch.Tensor, *,
                       alignment: int = 1, capacity: int | None = None, fold_weights: bool = False) -> Pending:
        """Issue the dispatch of this rank's rows to their local experts; ``.wait()`` lands them.

        Work placed between the two (e.g. the previous chunk's experts) overlaps the
        dispatcher's collectives; a dispatcher with nothing to wait for returns a finished
        :class:`Pending`.

        Args:
            x_TH: ``[T, H]`` the rank's tokens.
            topk_idx_Tk: int64 ``[T, k]`` global expert ids (``< 0``: dropped choice).
            topk_weight_Tk: fp32 ``[T, k]`` combine weights.
            alignment: ``A``. capacity: static ``M`` (None: the dispatcher's exact bound).
            fold_weights: return ``row_weight_M`` and combine as a plain sum.
            quant: (only where :attr:`lands_fp8`) FC1's row quantisation: move and land the rows
                in FP8 (``Dispatched.fp8``); None: move them in ``x_TH``'s dtype.
        Returns:
            :class:`Pending` of a :class:`Dispatched`: ``rows_MH`` in ``x_TH``'s dtype with its
            :class:`ExpertLayout` (with ``quant``: ``fp8`` and the gradient port).
        Raises:
            CollectiveError: (EP dispatchers, at ``wait()`` or before) a collective failed or
                timed out.
        """

    @abstractmethod
    def combine_async(self, y_MH: torch.Tensor, handle: Any, addend_TH: torch.Tensor | None = None) -> Pending:
        """Issue the combine of ``[M, H]`` expert outputs; ``.wait()`` gives ``[T, H]`` in the
        original token order (weighted sum over k, fp32 accumulation).

        ``addend_TH``: ``[T, H]`` (the shared experts' output) added to the fp32 sum before its
        rounding to ``y_MH``'s dtype, so that the layer's output is rounded once where the
        dispatcher's own combine is (every dispatcher's docstring says where that is); its
        gradient is the output's. None: the routed sum alone."""

    def dispatch(self, x_TH: torch.Tensor, topk_idx_Tk: torch.Tensor, topk_weight_Tk: torch.Tensor, *,
                 alignment: int = 1, capacity: int | None = None, fold_weights: bool = False,
                 quant: RowQuantiser | None = None) -> Dispatched:
        """:meth:`dispatch_async` waited on at once: the :class:`Dispatched`."""
        kw = {} if quant is None else {"quant": quant}
        return self.dispatch_async(x_TH, topk_idx_Tk, topk_weight_Tk, alignment=alignment, capacity=capacity,
                                   fold_weights=fold_weights, **kw).wait()

    def combine(self, y_MH: torch.Tensor, handle: Any, addend_TH: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`combine_async` waited on at once: ``y_TH``."""
        return self.combine_async(y_MH, handle, addend_TH).wait()

    def dispatch_source(self, x_TH: torch.Tensor, topk_idx_Tk: torch.Tensor, topk_weight_Tk: torch.Tensor, *,
                        alignment: int = 1, capacity: int | None = None, fold_weights: bool = False) -> Dispatched:
        """:meth:`dispatch` that leaves ``rows_MH`` None and gives its :class:`RowSource`.

        Only for dispatchers with :attr:`gathers_locally`; the others land rows received
        from other ranks, which cannot be re-gathered locally.

        Raises:
            NotImplementedError: this dispatcher does not gather locally.
        """
        raise NotImplementedError(
            f"dispatcher={self.name!r} lands rows received from other ranks; recompute_gather needs a "
            "dispatcher that gathers locally (local or fsdp): set recompute_gather=false or change the dispatcher")

    def comm_stats(self, reset: bool = True) -> dict[str, int]:
        """Bytes sent/received since the last reset (forward and backward); reset them if asked.

        Call once per optimizer step, after backward, for the step's traffic.
        """
        if reset:
            return self.comm.reset()
        return {"bytes_sent": self.comm.bytes_sent, "bytes_received": self.comm.bytes_received}
