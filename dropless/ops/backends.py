"""Registry of grouped GEMM backends (see :mod:`dropless.ops`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from dropless.config import ConfigError
from dropless.layout import ExpertLayout


class GemmBackend(Protocol):
    """What a grouped GEMM backend provides.

    ``name``: registry key. ``check(x, w)``: raise ValueError saying why this backend
    cannot run these operands (dtype, device, strides). ``gmm`` and ``gmm_wgrad`` as
    described in :mod:`dropless.ops`. Optional: ``gmm_wgrad_acc_(dw, x, dy, layout)`` adds
    ``gmm_wgrad(x, dy, layout)`` into ``dw`` in place (used by
    :class:`~dropless.ops.grouped_gemm.WgradAccumulator`; without it, ``dw += gmm_wgrad(...)``);
    ``gmm_wgrad_into_(dw, x, dy, layout)`` writes it into ``dw`` in ``dw``'s dtype (used by
    :class:`~dropless.ops.grouped_gemm.GradSink`; without it, ``dw.copy_(gmm_wgrad(...))``).
    """

    name: str

    def check(self, x_MK: torch.Tensor, w_eKN: torch.Tensor) -> None: ...

    def gmm(self, x_MK: torch.Tensor, w_eKN: torch.Tensor, layout: ExpertLayout) -> torch.Tensor: ...

    def gmm_wgrad(self, x_MK: torch.Tensor, dy_MN: torch.Tensor, layout: ExpertLayout) -> torch.Tensor: ...


@dataclass(frozen=True)
class ExpertGemms:
    """The backend of each of the experts' GEMMs (the names of :mod:`dropless.ops.fp8_policy`).

    ``fc1``: ``x @ W13``; ``fc2``: ``h @ W2``; ``fc1_dgrad``: ``dh13 @ W13ᵀ``; ``fc2_dgrad``:
    ``dy @ W2ᵀ``; ``wgrad``: both weight gradients. :meth:`of` gives one backend every role.
    """

    fc1: GemmBackend
    fc2: GemmBackend
    fc1_dgrad: GemmBackend
    fc2_dgrad: GemmBackend
    wgrad: GemmBackend

    @classmethod
    def of(cls, backend: "GemmBackend | ExpertGemms") -> ExpertGemms:
        """``backend`` if it already is an :class:`ExpertGemms`, else ``backend`` in every role."""
        return backend if isinstance(backend, cls) else cls(backend, backend, backend, backend, backend)


_REGISTRY: dict[str, Callable[[], GemmBackend]] = {}
_INSTANCES: dict[str, GemmBackend] = {}


def register_backend(name: str, factory: Callable[[], GemmBackend]) -> None:
    """Register a backend factory under ``name`` (called lazily on first use)."""
    _REGISTRY[name] = factory
    _INSTANCES.pop(name, None)


def list_backends() -> list[str]:
    _ensure_builtin()
    return sorted(_REGISTRY)


def check_backend_name(name: str, field: str = "gemm") -> None:
    """Raise ConfigError (a ValueError) ``"field='name': unknown grouped GEMM backend; choose one of [...]"``
    unless ``name`` is registered (:func:`list_backends`); ``field`` names the setting that gave it."""
    if name not in list_backends():
        raise ConfigError(f"{field}={name!r}: unknown grouped GEMM backend; choose one of {list_backends()}")


def get_backend(name: str) -> GemmBackend:
    """Return the backend registered as ``name``.

    Raises:
        ValueError: unknown name (:func:`check_backend_name`: the message lists the known ones), or the
            backend cannot run on this machine (the message says why).
    """
    check_backend_name(name)
    if name not in _INSTANCES:
        _INSTANCES[name] = _REGISTRY[name]()
    return _INSTANCES[name]


def check_backend_device(name: str, device: torch.device | str) -> None:
    """Raise ConfigError when backend ``name`` cannot run on ``device`` (call before training starts).

    Backends without a device requirement (``torch``, ``loop``) pass; ``fp8`` needs CUDA with
    compute capability >= 8.9; ``deep_gemm`` needs its package (raised by :func:`get_backend`) and
    compute capability >= 9.0.
    """
    be = get_backend(name)
    check = getattr(be, "check_device", None)
    if check is not None:
        check(device)


def check_backend_shapes(name: str, device: torch.device | str, dtype: torch.dtype, hidden_size: int,
                         moe_intermediate_size: int) -> None:
    """Raise ConfigError when backend ``name`` cannot take the experts' GEMM operands of this model.

    Runs the backend's own operand check (:meth:`GemmBackend.check`) on empty operands of
    FC1 (``[0, H] @ [1, H, 2I]``) and FC2 (``[0, I] @ [1, I, H]``) in ``dtype`` on
    ``device``, so a shape the kernel cannot take (e.g. ``gemm=torch`` needs 16-byte rows)
    fails when the run starts, naming the model fields, instead of at the first step.
    """
    be = get_backend(name)
    h, i = int(hidden_size), int(moe_intermediate_size)
    try:
        for k, n in ((h, 2 * i), (i, h)):
            be.check(torch.empty(0, k, dtype=dtype, device=device), torch.empty(1, k, n, dtype=dtype, device=device))
    except ValueError as e:
        raise ConfigError(f"model.hidden_size={h}, model.moe_intermediate_size={i} with gemm={name} in "
                          f"{str(dtype).removeprefix('torch.')}: {e}") from e


def _deep_gemm() -> GemmBackend:
    from dropless.ops.deep_gemm_backend import DeepGemmBackend

    return DeepGemmBackend()  # ConfigError naming the package when it does not import


def _ensure_builtin() -> None:
    if "torch" in _REGISTRY:
        return
    from dropless.ops.fp8_backend import Fp8Backend
    from dropless.ops.loop_backend import LoopBackend
    from dropless.ops.torch_backend import TorchBackend

    _REGISTRY.setdefault("torch", TorchBackend)
    _REGISTRY.setdefault("loop", LoopBackend)
    _REGISTRY.setdefault("fp8", Fp8Backend)
    _REGISTRY.setdefault("deep_gemm", _deep_gemm)
