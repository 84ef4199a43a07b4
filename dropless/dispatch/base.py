"""The dispatcher interface shared by every way tokens reach their experts.

A dispatcher takes the rank's tokens and their routing and lands the rows
for this rank's ``e`` local experts in one expert-sorted, aligned buffer with
an :class:`~dropless.layout.ExpertLayout` (DESIGN.md "The pipeline"); after
the experts ran, ``combine`` brings their outputs back to the original token
order as the weighted sum over ``k``.

Every dispatcher gives the same outputs and gradients as ``local`` on the
same global batch. A routed expert index ``< 0`` means "dropped" (the
``capacity_factor`` baseline) and is never dispatched.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from dropless.layout import ExpertLayout
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
    """

    rows_MH: torch.Tensor | None
    layout: ExpertLayout
    row_weight_M: torch.Tensor | None
    handle: Any
    source: RowSource | None = None


@dataclass
class CommStats:
    """Bytes this rank sent and received in collectives since the last :meth:`reset` (host ints).

    Counted from the shapes handed to the collectives (payload bytes, as DESIGN.md's cost
    table counts them), forward and backward together.
    """

    bytes_sent: int = 0
    bytes_received: int = 0

    def add(self, sent: int, received: int) -> None:
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)

    def reset(self) -> dict[str, int]:
        out = {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received}
        self.bytes_sent = self.bytes_received = 0
        return out


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
        if not self._done:
            self._value, self._finish, self._done = self._finish(), None, True
        return self._value


class Dispatcher(ABC):
    """Base class: see the module docstring.

    Attributes:
        name: the config flag (``dispatcher=…``).
        ep_size, ep_rank: the expert-parallel group's size and this rank's place in it.
        comm: :class:`CommStats` of this dispatcher.
    """

    name: str = "base"
    #: True when the landed rows are a local gather of the rank's tokens (EP = 1), so the
    #: experts can re-gather them in backward (``recompute_gather``; :meth:`dispatch_source`).
    gathers_locally: bool = False

    def __init__(self, num_experts: int, ep_size: int = 1, ep_rank: int = 0):
        if num_experts <= 0:
            raise ValueError(f"n_routed_experts={num_experts}: must be positive")
        if num_experts % ep_size:
            raise ValueError(
                f"n_routed_experts={num_experts} is not divisible by the expert-parallel size "
                f"EP={ep_size}; pick an EP that divides it")
        self.num_experts, self.ep_size, self.ep_rank = num_experts, ep_size, ep_rank
        self.comm = CommStats()

    @property
    def num_local_experts(self) -> int:
        """``e = E / EP``."""
        return self.num_experts // self.ep_size

    @property
    def expert_offset(self) -> int:
        """Global id of local expert 0."""
        return self.ep_rank * self.num_local_experts

    @abstractmethod
    def dispatch(self, x_TH: torch.Tensor, topk_idx_Tk: torch.Tensor, topk_weight_Tk: torch.Tensor, *,
                 alignment: int = 1, capacity: int | None = None, fold_weights: bool = False) -> Dispatched:
        """Land this rank's rows for its local experts.

        Args:
            x_TH: ``[T, H]`` the rank's tokens.
            topk_idx_Tk: int64 ``[T, k]`` global expert ids (``< 0``: dropped choice).
            topk_weight_Tk: fp32 ``[T, k]`` combine weights.
            alignment: ``A``. capacity: static ``M`` (None: the dispatcher's exact bound).
            fold_weights: return ``row_weight_M`` and combine as a plain sum.
        Returns:
            :class:`Dispatched`: ``rows_MH`` in ``x_TH``'s dtype with its :class:`ExpertLayout`.
        Raises:
            CollectiveError: (EP dispatchers) a collective failed or timed out.
        """

    @abstractmethod
    def combine(self, y_MH: torch.Tensor, handle: Any) -> torch.Tensor:
        """``[M, H]`` expert outputs -> ``[T, H]`` in the original token order (weighted sum over k)."""

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

    # -- two-phase API (overlap); the defaults run the one-phase call eagerly -------------
    def dispatch_async(self, x_TH: torch.Tensor, topk_idx_Tk: torch.Tensor, topk_weight_Tk: torch.Tensor, *,
                       alignment: int = 1, capacity: int | None = None, fold_weights: bool = False) -> Pending:
        """Issue the dispatch; ``.wait()`` on the result gives the :class:`Dispatched`.

        Work placed between the two (e.g. the previous chunk's experts) overlaps the
        dispatcher's collectives. Same arguments as :meth:`dispatch`.
        """
        return Pending(value=self.dispatch(x_TH, topk_idx_Tk, topk_weight_Tk, alignment=alignment,
                                           capacity=capacity, fold_weights=fold_weights))

    def combine_async(self, y_MH: torch.Tensor, handle: Any) -> Pending:
        """Issue the combine; ``.wait()`` gives ``y_TH``. Same arguments as :meth:`combine`."""
        return Pending(value=self.combine(y_MH, handle))

    def comm_stats(self, reset: bool = True) -> dict[str, int]:
        """Bytes sent/received since the last reset (forward and backward); reset them if asked.

        Call once per optimizer step, after backward, for the step's traffic.
        """
        if reset:
            return self.comm.reset()
        return {"bytes_sent": self.comm.bytes_sent, "bytes_received": self.comm.bytes_received}
