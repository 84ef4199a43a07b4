"""Measure the bytes autograd keeps for backward (the MoE memory options' yardstick).

Used by ``tests/test_moe_memory.py`` (asserted against each option's formula and
:func:`dropless.plan.saved_bytes`) and ``benchmarks/moe_memory.py`` (``saved_gib``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["SavedBytes"]


class SavedBytes:
    """Bytes of the distinct storages that autograd saved in a forward and its backward read.

    Usage: ``with SavedBytes([*model.parameters(), x]) as sb: y = model(x)``; then
    ``y.backward(...)``; then ``sb.total()`` (bytes, int). Each storage counts once, whatever
    its dtype or device. Counting what backward unpacks leaves out tensors saved by nodes of
    graphs dropped in forward (they never reach backward); holding every packed tensor until
    then keeps a freed storage's address from being reused by another one (so it raises the
    memory of the measured pass: a measuring tool, not for training).

    Args:
        skip: tensors not to count (parameters, the layer input): their storages are excluded.
    """

    def __init__(self, skip: Iterable[torch.Tensor]):
        self.skip = {t.untyped_storage().data_ptr() for t in skip}
        self.packed: list[torch.Tensor] = []
        self.used: dict[int, int] = {}
        self._hooks = None

    def _pack(self, t):
        self.packed.append(t)
        return len(self.packed) - 1

    def _unpack(self, i):
        t = self.packed[i]
        st = t.untyped_storage()
        if st.data_ptr() not in self.skip:
            self.used[st.data_ptr()] = st.nbytes()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        # the hooks object holds bound methods of self: dropping it breaks the reference cycle,
        # so ``del sb`` frees the packed tensors at once instead of at the next gc pass
        self._hooks = None

    def total(self) -> int:
        """Bytes counted so far (call after backward)."""
        return sum(self.used.values())
