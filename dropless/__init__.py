"""dropless: dropless Mixture-of-Experts training for PyTorch.

The pipeline (docs/design.md#the-pipeline): router -> dispatcher -> grouped-GEMM experts -> combine,
with a live-row :class:`~dropless.layout.ExpertLayout` carried from dispatch to combine.

Public API::

    ModelArgs, ConfigError                 dropless.config   (DeepSeek-V3 config.json names)
    ExpertLayout                           dropless.layout   (counts/start/end on the device)
    Router, update_router_biases           dropless.routing  (DeepSeek-V3 router, balancing)
    permute_rows, combine_rows             dropless.permute  (index-only autograd)
    grouped_mm, list_backends              dropless.ops      (grouped GEMM backends)
    GroupedExperts                         dropless.experts
    MoE                                    dropless.moe      (the layer)
    build_dispatcher                       dropless.dispatch (local, a2a, agrs, fsdp, deepep)
    Transformer                            dropless.model    (DeepSeek-V3-shaped decoder)
"""

import importlib
from typing import TYPE_CHECKING

# The names load on first use (PEP 562), so that importing a submodule, e.g. the console
# script's ``dropless.train.__main__``, does not import torch first: a Ctrl-C during that
# import (seconds) then lands inside ``dropless-train``'s own handler.
_EXPORTS = {
    "ConfigError": "dropless.config", "ModelArgs": "dropless.config", "build_dispatcher": "dropless.dispatch",
    "GroupedExperts": "dropless.experts", "ExpertLayout": "dropless.layout", "Transformer": "dropless.model",
    "MoE": "dropless.moe", "grouped_mm": "dropless.ops", "list_backends": "dropless.ops",
    "combine_rows": "dropless.permute", "permute_rows": "dropless.permute", "Router": "dropless.routing",
    "update_router_biases": "dropless.routing",
}

__all__ = [
    "ConfigError", "ExpertLayout", "GroupedExperts", "ModelArgs", "MoE", "Router", "Transformer", "build_dispatcher",
    "combine_rows", "grouped_mm", "list_backends", "permute_rows", "update_router_biases",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dropless' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from dropless.config import ConfigError, ModelArgs
    from dropless.dispatch import build_dispatcher
    from dropless.experts import GroupedExperts
    from dropless.layout import ExpertLayout
    from dropless.model import Transformer
    from dropless.moe import MoE
    from dropless.ops import grouped_mm, list_backends
    from dropless.permute import combine_rows, permute_rows
    from dropless.routing import Router, update_router_biases

__version__ = "0.1.0"

