"""``train.compile=true``: ``torch.compile`` each decoder block, applied from the training side.

Each block of a :class:`~dropless.model.Transformer` is compiled in place
(:meth:`torch.nn.Module.compile`, so parameter names and checkpoints do not change):
attention (MLA, RoPE), the norms, the dense MLP, and in MoE blocks the shared experts and the
residual adds. By default the MoE layer's routed part stays eager: the router and
:meth:`dropless.moe.MoE._routed` (dispatch, the grouped-GEMM autograd Functions, the combine)
are wrapped with :func:`torch.compiler.disable`, so each MoE block compiles as the graphs before
and after them. The wrapping is per instance (the model's class is untouched).

With ``moe=True`` (``train.compile_moe=true``) the whole MoE block compiles too: router,
dispatch, the grouped GEMMs and SwiGLU (custom ops with fake implementations), the combine. That
needs the ``local`` dispatcher (the collectives of the others take host sizes) and no activation
checkpointing: a compiled router cannot tell a checkpoint's recompute from the forward
(:func:`dropless.routing.in_backward_recompute` is False under compile), so it would count the
recomputed tokens into the balancing load twice. :func:`check_compile_moe` (the dispatcher) and
:meth:`~dropless.train.schema.TrainConfig.validate` (activation checkpointing) say so before any step.

:func:`check_compile` raises :class:`~dropless.config.ConfigError` where compile cannot run
(no Triton for the inductor backend on CUDA, no C++ compiler for inductor on CPU, a Python or
platform Dynamo does not support), before any step.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from dropless.config import ConfigError
from dropless.dispatch.base import Dispatcher
from dropless.model import Transformer

__all__ = ["compile_blocks", "check_compile", "check_compile_moe", "eager_regions"]


def eager_regions(model: nn.Module) -> list[str]:
    """Qualified names of the callables :func:`compile_blocks` kept eager (for the README and tests)."""
    out = []
    for name, block in model.layers.items():
        if getattr(block, "moe_enabled", False) and getattr(block.moe, "_kept_eager", False):
            out += [f"layers.{name}.moe.router", f"layers.{name}.moe._routed"]
    return out


def check_compile_moe(kind: type[Dispatcher]) -> None:
    """Check that ``train.compile_moe=true`` can be honoured with the dispatcher class ``kind`` (see the
    module docstring): only one without :attr:`~dropless.dispatch.base.Dispatcher.collectives`
    (``local``) compiles with the block. (Its rule with ``train.activation_checkpointing`` is
    :meth:`dropless.train.schema.TrainConfig.validate`'s.)

    Raises:
        ConfigError: naming the option that conflicts and how to fix it.
    """
    if kind.collectives:
        raise ConfigError(f"train.compile_moe=true needs dispatcher=local (got dispatcher={kind.name}: "
                          f"{kind.collectives}); set train.compile_moe=false to keep the routed part eager")


def check_compile(device: torch.device, backend: str) -> None:
    """Raise ConfigError if ``torch.compile(backend=backend)`` cannot run on ``device``: what is missing,
    its fix, and ``train.compile=false``."""
    why = _compile_problem(device, backend)
    if why:
        raise ConfigError(f"train.compile=true{why}, or set train.compile=false")


def _compile_problem(device: torch.device, backend: str) -> str | None:
    """Why ``torch.compile(backend=backend)`` cannot run on ``device`` (the message's middle), or None."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return ": torch.compile (Dynamo) is not supported on this Python/platform"
    if backend != "inductor":
        return None
    inductor = " with train.compile_backend=inductor"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return f"{inductor} needs triton on CUDA (pip install triton)"
        return None
    cxx = os.environ.get("CXX")  # inductor compiles with $CXX when it is set
    if cxx and not shutil.which(cxx):
        return (f"{inductor} on CPU compiles with CXX={cxx!r}, which is not an executable; fix or unset CXX, use "
                "train.compile_backend=aot_eager")
    if not cxx and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return (f"{inductor} on CPU needs a C++ compiler (g++/clang++, or CXX=...); install one, use "
                "train.compile_backend=aot_eager")
    return None


def compile_blocks(model: Transformer, backend: str = "inductor", moe: bool = False) -> Transformer:
    """Compile every decoder block of ``model`` in place.

    Args:
        model: the Transformer (its ``layers``).
        backend: the ``torch.compile`` backend (``inductor``; ``aot_eager`` for CPU tests).
        moe: also compile the MoE router and routed part (``local`` dispatcher, no activation
            checkpointing: :func:`check_compile_moe`); False keeps them eager.
    Returns: ``model``.
    """
    for block in model.layers.values():
        if getattr(block, "moe_enabled", False) and not moe:
            layer = block.moe
            layer.router.forward = torch.compiler.disable(layer.router.forward)
            layer.router.account = torch.compiler.disable(layer.router.account)
            layer._routed = torch.compiler.disable(layer._routed)
            layer._kept_eager = True
        block.compile(backend=backend)
    return model
