"""dropless weights -> a Hugging Face DeepSeek-V3 directory (sharded safetensors + index + config).

:func:`export_hf` writes ``model-00001-of-0000N.safetensors`` shards of at most
``max_shard_bytes`` each (a tensor larger than that gets a shard of its own),
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``) and
``config.json`` (:func:`~dropless.convert.hf_config.hf_config_from_args`) into a temporary
directory beside ``dst`` and renames it to ``dst`` at the end, so an interrupted export
never looks complete. The tensors come from a :class:`TensorSource` one at a time (the
state dict of a model in memory, or a DCP checkpoint read tensor by tensor:
:class:`dropless.convert.dcp_io.DCPSource`); only the current shard's tensors and the
current layer's source tensors are held.

Layouts (:mod:`dropless.convert.names`): ``w13[j]`` [H, 2I] is split into ``gate_proj``
``w13[j, :, :I]ᵀ`` and ``up_proj`` ``w13[j, :, I:]ᵀ``; ``down_proj`` is ``w2[j]ᵀ``; the
MTP layers' ``embed_tokens`` and ``shared_head.head`` are the shared embedding and head
written again (the format stores them per MTP layer). The router's
``e_score_correction_bias`` stays fp32 whatever ``dtype`` is (as in the released files).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Mapping, Protocol

import torch

from dropless.config import ConfigError, ModelArgs
from dropless.convert.hf_config import hf_config_from_args
from dropless.convert.names import HFTensor, hf_tensors
from dropless.convert.safetensors_io import INDEX_NAME, require_safetensors

try:
    from safetensors.torch import save_file
except ImportError:  # optional dependency: require_safetensors() raises the clear error
    save_file = None

__all__ = ["TensorSource", "StateDictSource", "export_hf", "hf_tensor_from"]

#: Files of a Hugging Face directory that are not weights, copied by ``copy_files_from``.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "chat_template.jinja")

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64"}


class TensorSource(Protocol):
    """Where exported tensors come from: full (global) tensors by dropless state-dict key."""

    def shape(self, key: str) -> tuple[int, ...]: ...

    def dtype(self, key: str) -> torch.dtype: ...

    def get(self, key: str) -> torch.Tensor: ...


class StateDictSource:
    """A :class:`TensorSource` over an in-memory state dict (``model.state_dict()``).

    Raises (``get``): KeyError for a missing key.
    """

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = state

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.state[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self.state[key].dtype

    def get(self, key: str) -> torch.Tensor:
        return self.state[key].detach().cpu()


def hf_tensor_from(t: HFTensor, ours: torch.Tensor, I: int) -> torch.Tensor:
    """The Hugging Face tensor ``t`` cut from the full dropless tensor ``ours`` (contiguous)."""
    if t.kind == "copy":
        return ours.contiguous()
    if t.kind == "shared":  # a second copy in the files: its own storage (safetensors refuses shared memory)
        return ours.clone(memory_format=torch.contiguous_format)
    if t.kind == "gate":
        return ours[t.expert, :, :I].t().contiguous()
    if t.kind == "up":
        return ours[t.expert, :, I:].t().contiguous()
    if t.kind == "down":
        return ours[t.expert].t().contiguous()
    raise ValueError(f"{t.name}: unknown kind {t.kind!r}")  # pragma: no cover


def _check_source(source: TensorSource, tensors: list[HFTensor], args: ModelArgs) -> None:
    """Every dropless tensor the export needs exists with the shape ``args`` implies."""
    I, E = args.moe_intermediate_size, args.n_routed_experts
    expect: dict[str, tuple[int, ...]] = {}
    for t in tensors:
        if t.kind in ("copy", "shared"):
            expect[t.ours] = t.shape
        elif t.kind in ("gate", "up"):
            expect[t.ours] = (E, t.shape[1], 2 * I)
        else:
            expect[t.ours] = (E, t.shape[1], t.shape[0])
    problems = []
    for key, shape in expect.items():
        try:
            got = tuple(source.shape(key))
        except KeyError:
            problems.append(f"{key} is missing (expected shape {list(shape)})")
            continue
        if got != shape:
            problems.append(f"{key}: source {list(got)}, config expects {list(shape)}"
                            + (" (an expert-parallel rank's slice? export from a checkpoint, which holds "
                               "every expert)" if got[:1] != shape[:1] and len(shape) == 3 else ""))
    if problems:
        raise ConfigError("export: the weights do not match the config (" + "; ".join(problems[:5])
                          + (f" and {len(problems) - 5} more" if len(problems) > 5 else "") + "); nothing was written")


def export_hf(source: TensorSource | Mapping[str, torch.Tensor], args: ModelArgs, dst: str | Path, *,
              dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30,
              copy_files_from: str | Path | None = None) -> Path:
    """Write a Hugging Face DeepSeek-V3 directory at ``dst``.

    Args:
        source: a :class:`TensorSource`, or a state dict (all experts: an EP = 1 model's
            ``state_dict()``).
        args: the model config (written as config.json).
        dst: the directory to create; must not exist, or be empty.
        dtype: dtype of the written weights (None: the source's; ``torch.bfloat16`` for
            serving). The routing bias stays fp32.
        max_shard_bytes: the shard size limit (bytes).
        copy_files_from: a Hugging Face directory whose tokenizer and generation files
            (:data:`TOKENIZER_FILES`, those present) are copied along.
    Returns: ``dst``.
    Raises:
        ConfigError: ``dst`` exists and is not empty, ``args`` cannot be expressed in the
            format (``moe_layer_freq`` != 1), or the source lacks a tensor / has the wrong
            shape (named, with both shapes) — before anything is written.
        ImportError: safetensors is not installed.
    """
    require_safetensors()
    if isinstance(source, Mapping):
        source = StateDictSource(source)
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConfigError(f"export: {dst} already exists and is not empty; give a new directory")
    config = hf_config_from_args(args, _DTYPE_NAMES.get(dtype or source.dtype("output.weight"), "float32"))
    tensors = hf_tensors(args)
    _check_source(source, tensors, args)

    def out_dtype(t: HFTensor) -> torch.dtype:
        if dtype is None or t.name.endswith("e_score_correction_bias"):
            return source.dtype(t.ours)
        return dtype

    sizes = [torch.Size(t.shape).numel() * torch.empty((), dtype=out_dtype(t)).element_size() for t in tensors]
    shards: list[list[int]] = [[]]
    used = 0
    for i, nbytes in enumerate(sizes):
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += nbytes
    n = len(shards)
    names = [f"model-{s + 1:05d}-of-{n:05d}.safetensors" for s in range(n)]

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    I = args.moe_intermediate_size
    try:
        cache: dict[str, torch.Tensor] = {}
        cache_layer: object = object()
        weight_map: dict[str, str] = {}
        umask = os.umask(0)
        os.umask(umask)
        file_mode = 0o666 & ~umask
        for s, members in enumerate(shards):
            out: dict[str, torch.Tensor] = {}
            for i in members:
                t = tensors[i]
                if t.layer != cache_layer:  # hold one layer's source tensors at a time
                    cache.clear()
                    cache_layer = t.layer
                if t.ours not in cache:
                    cache[t.ours] = source.get(t.ours)
                out[t.name] = hf_tensor_from(t, cache[t.ours], I).to(out_dtype(t))
                weight_map[t.name] = names[s]
            save_file(out, str(tmp / names[s]), metadata={"format": "pt"})
            os.chmod(tmp / names[s], file_mode)  # safetensors writes 0600; the other files get the umask's mode
            del out
        cache.clear()
        with open(tmp / INDEX_NAME, "w") as f:
            json.dump({"metadata": {"total_size": int(sum(sizes))}, "weight_map": weight_map}, f, indent=2)
        with open(tmp / "config.json", "w") as f:
            json.dump(config, f, indent=2)
        if copy_files_from is not None:
            for fname in TOKENIZER_FILES:
                src = Path(copy_files_from) / fname
                if src.is_file():
                    shutil.copy2(src, tmp / fname)
        if dst.exists():
            dst.rmdir()  # empty (checked above)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
