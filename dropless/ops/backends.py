"""Registry of grouped GEMM backends (see :mod:`dropless.ops`)."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from dropless.layout import ExpertLayout


class GemmBackend(Protocol):
    """What a grouped GEMM backend provides.

    ``name``: registry key. ``check(x, w)``: raise ValueError saying why this backend
    cannot run these operands (dtype, device, strides). ``gmm`` and ``gmm_wgrad`` as
    described in :mod:`dropless.ops`. Optional: ``gmm_wgrad_acc_(dw, x, dy, layout)`` adds
    ``gmm_wgrad(x, dy, layout)`` into ``dw`` in place (used by
    :class:`~dropless.ops.grouped_gemm.WgradAccumulator`; without it, ``dw += gmm_wgrad(...)``).
    """

    name: str

    def check(self, x_MK: torch.Tensor, w_eKN: torch.Tensor) -> None: ...

    def gmm(self, x_MK: torch.Tensor, w_eKN: torch.Tensor, layout: ExpertLayout) -> torch.Tensor: ...

    def gmm_wgrad(self, x_MK: torch.Tensor, dy_MN: torch.Tensor, layout: ExpertLayout) -> torch.Tensor: ...


_REGISTRY: dict[str, Callable[[], GemmBackend]] = {}
_INSTANCES: dict[str, GemmBackend] = {}


def register_backend(name: str, factory: Callable[[], GemmBackend]) -> None:
    """Register a backend factory under ``name`` (called lazily on first use)."""
    _REGISTRY[name] = factory
    _INSTANCES.pop(name, None)


def list_backends() -> list[str]:
    _ensure_builtin()
    return sorted(_REGISTRY)


def get_backend(name: str) -> GemmBackend:
    """Return the backend registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones), or the backend
            cannot run on this machine (the message says why).
    """
    _ensure_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"gemm={name!r}: unknown grouped GEMM backend; choose one of {list_backends()}")
    if name not in _INSTANCES:
        _INSTANCES[name] = _REGISTRY[name]()
    return _INSTANCES[name]


def _ensure_builtin() -> None:
    if "torch" in _REGISTRY:
        return
    from dropless.ops.loop_backend import LoopBackend
    from dropless.ops.torch_backend import TorchBackend

    _REGISTRY.setdefault("torch", TorchBackend)
    _REGISTRY.setdefault("loop", LoopBackend)
