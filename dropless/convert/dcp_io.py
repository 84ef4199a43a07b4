"""Model weights in ``torch.distributed.checkpoint`` (DCP) directories.

The layout is the training checkpoints' (:mod:`dropless.train.checkpoint`): the model's
state dict under ``"model"`` (keys ``model.<fqn>`` in the DCP metadata), each expert weight
as one global ``[E, ...]`` tensor. :func:`save_model_dcp` writes only that entry and a
``model_args.json`` beside it (a weights-only checkpoint, what ``dropless-convert hf-to-dcp``
makes); :func:`load_model_dcp` loads the ``model`` entry of either kind into a built model
(``dropless-train init_from=``); :class:`DCPSource` reads one tensor at a time for an export.

Expert parallelism: pass the run's ``("dp", "ep")`` mesh to :func:`load_model_dcp`; each
rank's ``w13``/``w2`` (its ``E/EP`` experts, or its FSDP2 shard of them with ``train.shard_experts``)
is wrapped as a DTensor of the global tensor (:mod:`dropless.expert_dtensor`), as the trainer saves
them, so DCP reads only that rank's rows.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch import nn

from dropless.config import ConfigError, ModelArgs
from dropless.convert.hf_config import args_from_hf_config
from dropless.expert_dtensor import global_experts

_STEP = re.compile(r"^step_(\d+)$")

__all__ = ["ARGS_NAME", "DCPSource", "save_model_dcp", "load_model_dcp", "read_model_args", "is_dcp_dir",
           "newest_run_checkpoint"]

#: The ModelArgs of a weights-only checkpoint, beside its ``.metadata``.
ARGS_NAME = "model_args.json"


def is_dcp_dir(path: str | Path) -> bool:
    """True for a complete DCP checkpoint directory (it has ``.metadata``, written last)."""
    return (Path(path) / ".metadata").is_file()


def newest_run_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete DCP checkpoint ``run_dir/checkpoints/step_N`` of a training run (the largest
    N whose directory has ``.metadata``), or None when ``run_dir`` holds none."""
    ck = Path(run_dir).expanduser() / "checkpoints"
    if not ck.is_dir():
        return None
    steps = sorted((int(m.group(1)), c) for c in ck.glob("step_*") if (m := _STEP.match(c.name)) and is_dcp_dir(c))
    return steps[-1][1] if steps else None


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent.*")
        warnings.filterwarnings("ignore", message=".*no_dist.*")
        yield


def _metadata(path: Path):
    if not is_dcp_dir(path):
        raise FileNotFoundError(f"{path}: not a complete DCP checkpoint (no .metadata)")
    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def save_model_dcp(model: nn.Module, dst: str | Path) -> Path:
    """Save ``model.state_dict()`` as the ``model`` entry of a DCP checkpoint at ``dst``, with
    ``model_args.json`` (``model.args``). One process (every expert local). Returns ``dst``.

    Raises:
        ConfigError: ``dst`` already holds a checkpoint.
    """
    dst = Path(dst)
    if is_dcp_dir(dst):
        raise ConfigError(f"{dst} already holds a checkpoint; give a new directory")
    dst.mkdir(parents=True, exist_ok=True)
    with open(dst / ARGS_NAME, "w") as f:
        json.dump(dataclasses.asdict(model.args), f, indent=2)
    with _quiet():
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(dst), no_dist=_no_dist())
    return dst


def read_model_args(path: str | Path, config: str | Path | None = None) -> ModelArgs:
    """The ModelArgs of a DCP checkpoint.

    Looks in ``config`` (a ``model_args.json``, a run's ``config.yaml`` or a Hugging Face
    ``config.json``) when given, else ``path/model_args.json`` (hf-to-dcp), else the run's
    ``config.yaml`` two levels up (``run_dir/checkpoints/step_N``).

    Raises:
        FileNotFoundError: none of these exists (pass ``config``).
    """
    path = Path(path)
    cands = [Path(config)] if config is not None else [path / ARGS_NAME, path.parent.parent / "config.yaml"]
    for c in cands:
        if not c.is_file():
            continue
        if c.suffix in (".yaml", ".yml"):
            model = OmegaConf.to_container(OmegaConf.load(c).model, resolve=True)
            return ModelArgs.from_dict(model)
        with open(c) as f:
            d = json.load(f)
        if "model_type" in d:  # a Hugging Face config.json
            return args_from_hf_config(d)[0]
        return ModelArgs.from_dict(d)
    raise FileNotFoundError(f"{path}: no model config found (looked for {', '.join(map(str, cands))}); "
                            "pass the run's config.yaml or a model_args.json")


class DCPSource:
    """A :class:`~dropless.convert.hf_export.TensorSource` reading single model tensors from a
    DCP checkpoint (one process; each :meth:`get` reads only that tensor's bytes)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.meta = _metadata(self.path)

    def _md(self, key: str):
        md = self.meta.get(f"model.{key}")
        if md is None or not hasattr(md, "size"):
            raise KeyError(key)
        return md

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._md(key).size)

    def dtype(self, key: str) -> torch.dtype:
        return self._md(key).properties.dtype

    def get(self, key: str) -> torch.Tensor:
        t = torch.empty(self.shape(key), dtype=self.dtype(key))
        with _quiet():
            dcp.load({"model": {key: t}}, checkpoint_id=str(self.path), no_dist=_no_dist())
        return t


def load_model_dcp(model: nn.Module, path: str | Path, mesh=None) -> None:
    """Load the ``model`` entry of a DCP checkpoint into ``model`` in place (collective when a
    process group is up: every rank calls it).

    Args:
        model: a built :class:`~dropless.model.Transformer` (any dispatcher).
        path: a checkpoint directory (hf-to-dcp's or a training run's ``step_N``).
        mesh: the ``("dp", "ep")`` mesh of an expert-parallel run (None: no EP).
    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
        ConfigError: a tensor of the model is missing from the checkpoint or has another
            shape (named, with both shapes), before anything is loaded.
    """
    path = Path(path)
    meta = _metadata(path)
    state = model.state_dict()
    expert_names = set()
    if hasattr(model, "moe_layers"):
        names = {id(p): n for n, p in model.named_parameters()}
        expert_names = {names[id(p)] for m in model.moe_layers() for p in m.experts.parameters() if id(p) in names}
    pairs = []
    problems = []
    for key, t in list(state.items()):
        md = meta.get(f"model.{key}")
        if md is None or not hasattr(md, "size"):
            problems.append(f"{key} is missing (model shape {list(t.shape)})")
            continue
        want = tuple(md.size)
        if key in expert_names and tuple(t.shape) != want and mesh is not None and tuple(t.shape[1:]) == want[1:]:
            got = global_experts(t, mesh)  # this EP rank's experts (or its FSDP2 shard of them) in [E, ...]
            if got is not None and tuple(got[0].shape) == want:
                state[key] = got[0]
                pairs.append(got)
                continue
        if tuple(t.shape) != want:
            problems.append(f"{key}: checkpoint {list(want)}, model {list(t.shape)}")
    if problems:
        raise ConfigError(f"{path}: the checkpoint does not fit the model (" + "; ".join(problems[:5])
                          + (f" and {len(problems) - 5} more" if len(problems) > 5 else "")
                          + "); build the model with the config it was saved with; nothing was loaded")
    with _quiet():
        dcp.load({"model": state}, checkpoint_id=str(path), no_dist=_no_dist())
    with torch.no_grad():  # DCP loads in place; make sure the expert shards reached the originals
        for d, t in pairs:
            local = d.to_local()
            if local.data_ptr() != t.data_ptr():
                t.copy_(local)
