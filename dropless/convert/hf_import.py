"""Hugging Face DeepSeek-V3 checkpoint -> the weights of a built dropless model, in place.

:func:`load_hf` checks everything before it writes anything (the config against the model,
then every tensor's presence and shape from the file headers), then streams the tensors
this rank needs shard by shard (:class:`~dropless.convert.safetensors_io.HFCheckpoint`) and
writes each into its place (:mod:`dropless.convert.names`): per-expert ``gate_proj`` /
``up_proj`` / ``down_proj`` transposed into the rank's slice of ``w13`` / ``w2``, FP8 weights
dequantised, rope rows permuted for a ``rope_interleave = false`` checkpoint.

Expert parallelism: a rank whose MoE layers hold experts ``offset .. offset + e - 1``
(``GroupedExperts.expert_offset``) reads only those experts' tensors. Parameters that are
DTensors (FSDP2: ``dispatcher=fsdp`` experts, ``train.shard_dense``, this EP rank's experts under
``train.shard_experts``) are assembled whole on every rank that shares them and this rank keeps its
shard (``distribute_tensor`` without communication).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dropless.config import ConfigError
from dropless.convert.fp8 import SCALE_SUFFIX
from dropless.convert.hf_config import HFFormat, args_from_hf_config, check_same_model, read_hf_config
from dropless.convert.names import HFTensor, hf_tensors, local_hf_tensors, rope_row_permutation
from dropless.convert.safetensors_io import HFCheckpoint

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover - torch without distributed
    DTensor, distribute_tensor = None, None

__all__ = ["ImportReport", "load_hf", "check_hf_tensors"]

#: Checkpoint tensors that are not weights (old files store RoPE tables); skipped.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class ImportReport:
    """What :func:`load_hf` did: ``tensors_read`` (scales not counted), ``names_read`` (in
    order), ``fmt`` (the checkpoint's :class:`~dropless.convert.hf_config.HFFormat`)."""

    tensors_read: int = 0
    names_read: list[str] = field(default_factory=list)
    fmt: HFFormat | None = None


def _is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _expert_ranges(model: nn.Module) -> dict[str, range]:
    """``w13``/``w2`` FQN -> global ids of this rank's experts (all of them for ``dispatcher=fsdp``; this EP
    rank's, whether plain or an FSDP2 shard over dp with ``train.shard_experts``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, range] = {}
    for moe in model.moe_layers():
        ex = moe.experts
        for p in (ex.w13, ex.w2):
            if id(p) in names:
                out[names[id(p)]] = range(ex.expert_offset, ex.expert_offset + ex.num_local_experts)
    return out


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """State-dict key -> the parameter or buffer itself (written in place)."""
    out = {n: p for n, p in model.named_parameters()}
    out.update({n: b for n, b in model.named_buffers()})
    return out


def check_hf_tensors(ckpt: HFCheckpoint, tensors: list[HFTensor], source: str) -> None:
    """Raise :class:`ConfigError` for a missing tensor, an unexpected one, a wrong shape, or an
    FP8 scale of the wrong grid, naming the tensor and both shapes (headers only, no data)."""
    want = {t.name: t for t in tensors}
    have = ckpt.names()
    missing = [t for t in tensors if t.name not in have]
    extra = sorted(n for n in have if n not in want and not n.endswith(_IGNORED_SUFFIXES)
                   and not (n.endswith(SCALE_SUFFIX) and n[:-len(SCALE_SUFFIX)] in want))
    bad = [(t, ckpt.shape(t.name)) for t in tensors if t.name in have and ckpt.shape(t.name) != t.shape]
    problems = []
    if missing:
        problems.append("missing tensors: " + ", ".join(f"{t.name} (expected shape {list(t.shape)})"
                                                        for t in missing[:5])
                        + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    if extra:
        problems.append("unexpected tensors: " + ", ".join(f"{n} (shape {list(ckpt.shape(n))})" for n in extra[:5])
                        + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))
    if bad:
        problems.append("wrong shapes: " + ", ".join(f"{t.name}: checkpoint {list(s)}, model expects {list(t.shape)}"
                                                     for t, s in bad[:5])
                        + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))
    if problems:
        raise ConfigError(f"{source}: the checkpoint's tensors do not match the model ({'; '.join(problems)}); "
                          "nothing was loaded")


def load_hf(model: nn.Module, path: str | Path, *, check_config: bool = True) -> ImportReport:
    """Load a Hugging Face DeepSeek-V3 directory into ``model`` (a built
    :class:`~dropless.model.Transformer`, any dispatcher) in place.

    Args:
        model: the model; its ``args`` must describe the checkpoint's architecture.
        path: the directory (``config.json``, ``model*.safetensors``, optional index).
        check_config: compare the checkpoint's config.json with ``model.args`` first.
    Returns: an :class:`ImportReport` (tensors read, by name).
    Raises:
        ConfigError: the config differs (each field with both values and the overrides that
            fit), or a tensor is missing / unexpected / of the wrong shape (named, with both
            shapes) — raised before any weight is written.
        FileNotFoundError: no config.json or no safetensors in ``path``.
        ImportError: safetensors is not installed.
    """
    path = Path(path)
    ckpt_args, fmt = args_from_hf_config(read_hf_config(path))
    args = model.args
    if check_config:
        check_same_model(args, ckpt_args, str(path))
    ckpt = HFCheckpoint(path, fp8_block=fmt.fp8_block)
    all_tensors = hf_tensors(args)
    check_hf_tensors(ckpt, all_tensors, str(path))
    targets = _targets(model)
    covered = {t.ours for t in all_tensors}
    uncovered = sorted(n for n, _ in model.named_parameters() if n not in covered)
    if uncovered:  # a parameter the format has no tensor for would keep its initial values
        raise ConfigError(f"{path}: the Hugging Face DeepSeek-V3 format has no tensor for the model's "
                          f"{', '.join(uncovered[:5])}; dropless.convert.names does not map it")
    wanted = local_hf_tensors(all_tensors, _expert_ranges(model))
    missing_targets = sorted({t.ours for t in wanted if t.ours not in targets})
    if missing_targets:
        raise ConfigError(f"{path}: the model has no {', '.join(missing_targets[:5])}: it is not a dropless "
                          "Transformer built from these args")
    by_name = {t.name: t for t in wanted}
    # DTensors are assembled whole on the CPU, then this rank keeps its shard
    staged: dict[str, torch.Tensor] = {}
    pieces_left: dict[str, int] = {}
    for t in wanted:
        if _is_dtensor(targets[t.ours]):
            pieces_left[t.ours] = pieces_left.get(t.ours, 0) + 1
    I = args.moe_intermediate_size
    with torch.no_grad():
        for name, value in ckpt.stream(list(by_name)):
            t = by_name[name]
            if not fmt.rope_interleave:
                perm = rope_row_permutation(t, args)
                if perm is not None:
                    value = value[perm]
            dest = targets[t.ours]
            if _is_dtensor(dest):
                full = staged.get(t.ours)
                if full is None:  # the global shape: all experts (fsdp) or this EP rank's (shard_experts)
                    full = staged[t.ours] = torch.empty(tuple(dest.shape), dtype=dest.dtype)
                _place(full, t, value, I, _expert_offset(model, t) if t.expert is not None else 0)
                pieces_left[t.ours] -= 1
                if pieces_left[t.ours] == 0:
                    # every rank holds the same full tensor: take the local shard, no communication
                    dest.copy_(distribute_tensor(full.to(device=dest.device_mesh.device_type), dest.device_mesh,
                                                 dest.placements, src_data_rank=None))
                    del staged[t.ours]
            else:
                offset = _expert_offset(model, t) if t.expert is not None else 0
                _place(dest, t, value, I, offset)
    return ImportReport(ckpt.tensors_read, list(ckpt.names_read), fmt)


def _expert_offset(model: nn.Module, t: HFTensor) -> int:
    """Global id of local expert 0 in the MoE layer owning ``t``."""
    mod = model.get_submodule(t.ours.rsplit(".", 1)[0])
    return int(mod.expert_offset)


def _place(dest: torch.Tensor, t: HFTensor, value: torch.Tensor, I: int, offset: int) -> None:
    """Write one checkpoint tensor into its place in ``dest`` (see :mod:`dropless.convert.names`)."""
    if t.kind == "copy":
        dest.copy_(value.reshape(dest.shape))
    elif t.kind == "gate":
        dest[t.expert - offset, :, :I].copy_(value.t())
    elif t.kind == "up":
        dest[t.expert - offset, :, I:].copy_(value.t())
    elif t.kind == "down":
        dest[t.expert - offset].copy_(value.t())
    else:  # pragma: no cover - names.py defines the kinds
        raise ValueError(f"{t.name}: unknown kind {t.kind!r}")
