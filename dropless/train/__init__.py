"""Training: Hydra configs, data, the trainer, metrics and checkpoints.

``dropless-train`` / ``python -m dropless.train`` (:func:`dropless.train.__main__.main`);
:func:`dropless.train.config.compose` composes ``configs/`` + ``recipes/``;
:class:`dropless.train.trainer.Trainer` runs a composed config.

``compose`` and ``model_args`` load on first use, so that ``dropless-train`` starts before torch
and OmegaConf are imported (see ``dropless/__init__.py``).
"""

from typing import TYPE_CHECKING

__all__ = ["compose", "model_args"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'dropless.train' has no attribute {name!r}")
    from dropless.train import config

    value = getattr(config, name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from dropless.train.config import compose, model_args
