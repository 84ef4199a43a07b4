"""Training: Hydra configs, data, the trainer, metrics and checkpoints.

``dropless-train`` / ``python -m dropless.train`` (:func:`dropless.train.__main__.main`);
:func:`dropless.train.config.compose` composes ``configs/`` + ``recipes/``;
:class:`dropless.train.trainer.Trainer` runs a composed config.
"""

from dropless.train.config import compose, model_args

__all__ = ["compose", "model_args"]
