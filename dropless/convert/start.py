"""Start a model from existing weights: ``dropless-train init_from=PATH``.

:func:`init_from` tells the three kinds of ``PATH`` apart and loads the weights into a
built model in place (the optimizer, step and data position start fresh):

* a Hugging Face DeepSeek-V3 directory (``config.json`` + ``*.safetensors``):
  :func:`dropless.convert.hf_import.load_hf` (each EP rank reads only its experts);
* a DCP checkpoint directory (``.metadata``: ``dropless-convert hf-to-dcp``'s output, or a
  training run's ``checkpoints/step_N``): :func:`dropless.convert.dcp_io.load_model_dcp`;
* a training run directory (``checkpoints/step_*``): its newest complete checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from dropless.config import ConfigError
from dropless.convert.dcp_io import is_dcp_dir, load_model_dcp, newest_run_checkpoint
from dropless.convert.hf_import import load_hf

__all__ = ["init_from", "resolve_source"]


def resolve_source(path: str | Path) -> tuple[str, Path]:
    """``("hf" | "dcp", directory)`` for ``path``.

    Raises:
        ConfigError: ``path`` is none of the three kinds (the message lists them).
    """
    p = Path(path).expanduser()
    has_weights = any(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").is_file()
    if (p / "config.json").is_file() and has_weights:
        return "hf", p
    if is_dcp_dir(p):
        return "dcp", p
    newest = newest_run_checkpoint(p)
    if newest is not None:
        return "dcp", newest
    raise ConfigError(f"init_from={str(path)!r}: not a Hugging Face model directory (config.json + *.safetensors), "
                      "a DCP checkpoint (.metadata) or a run directory with checkpoints/step_*")


def init_from(model: nn.Module, path: str | Path, mesh=None) -> Path:
    """Load the weights at ``path`` into ``model`` (every rank calls it).

    Args:
        model: a built, initialised :class:`~dropless.model.Transformer`.
        path: see the module docstring.
        mesh: the run's ``("dp", "ep")`` mesh under expert parallelism (DCP sources), or None.
    Returns: the directory the weights came from.
    Raises:
        ConfigError: an unrecognised path, or weights that do not fit the model (named).
    """
    kind, where = resolve_source(path)
    if kind == "hf":
        load_hf(model, where)
    else:
        load_model_dcp(model, where, mesh=mesh)
    return where
