"""Reading a Hugging Face directory of safetensors shards, one shard at a time.

:class:`HFCheckpoint` finds the tensors (``model.safetensors.index.json``'s ``weight_map``,
or the headers of every ``*.safetensors`` file when there is no index), gives their shapes
from the file headers without reading data, and :meth:`HFCheckpoint.stream` reads a chosen
set of tensors shard by shard through ``safetensors.safe_open`` (memory-mapped: one tensor
in memory at a time), dequantising FP8 weights that have a ``weight_scale_inv``
(:mod:`dropless.convert.fp8`). ``tensors_read`` counts the tensors read (scales not counted).

Needs the ``safetensors`` package (``pip install safetensors``); without it the constructor
raises an ImportError that says so.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Iterator

import torch

from dropless.convert.fp8 import SCALE_SUFFIX, dequantize_fp8_blocks

try:
    from safetensors import safe_open
except ImportError:  # an optional dependency: the reader says how to get it
    safe_open = None

__all__ = ["HFCheckpoint", "INDEX_NAME", "require_safetensors"]

INDEX_NAME = "model.safetensors.index.json"

_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")


def require_safetensors() -> None:
    """Raise ImportError naming the package when ``safetensors`` is missing."""
    if safe_open is None:
        raise ImportError("reading or writing Hugging Face checkpoints needs the safetensors package: "
                          "pip install safetensors")


class HFCheckpoint:
    """The tensors of a Hugging Face model directory.

    Args:
        path: the directory (``config.json``, ``model*.safetensors``, optionally the index).
        fp8_block: the FP8 scale block ``(bo, bi)`` from the config (None: no FP8 expected;
            an FP8 tensor with a scale is then an error when read).
    Attributes:
        files: tensor name -> shard path. tensors_read: tensors read so far.
    Raises:
        FileNotFoundError: no safetensors file, or an index naming a missing shard.
    """

    def __init__(self, path: str | Path, fp8_block: tuple[int, int] | None = None) -> None:
        require_safetensors()
        self.path = Path(path)
        self.fp8_block = fp8_block
        self.tensors_read = 0
        self.names_read: list[str] = []
        index = self.path / INDEX_NAME
        if index.is_file():
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self.files = {name: self.path / fname for name, fname in weight_map.items()}
            for shard in sorted(set(self.files.values())):
                if not shard.is_file():
                    raise FileNotFoundError(f"{shard}: listed in {index} but missing; the download or export "
                                            "is incomplete")
        else:
            shards = sorted(self.path.glob("*.safetensors"))
            if not shards:
                raise FileNotFoundError(f"{self.path}: no *.safetensors files (and no {INDEX_NAME})")
            self.files = {}
            for shard in shards:
                with safe_open(str(shard), framework="pt") as f:
                    for name in f.keys():
                        self.files[name] = shard
        self._headers: dict[Path, dict] = {}

    # ------------------------------------------------------------------ headers
    def _header(self, shard: Path) -> dict:
        """``name -> (shape, dtype string)`` of one shard, from its header (no data read)."""
        if shard not in self._headers:
            with safe_open(str(shard), framework="pt") as f:
                self._headers[shard] = {n: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype())
                                        for n in f.keys()}
        return self._headers[shard]

    def names(self) -> set[str]:
        """Every tensor name in the checkpoint (scales included)."""
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._header(self.files[name])[name][0]

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype string (``BF16``, ``F32``, ``F8_E4M3``, ...)."""
        return self._header(self.files[name])[name][1]

    def scale_of(self, name: str) -> str | None:
        """The ``weight_scale_inv`` name that goes with ``name``, if the checkpoint has one."""
        s = name + SCALE_SUFFIX
        return s if s in self.files else None

    # ------------------------------------------------------------------ data
    def stream(self, names: Iterable[str], dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` for ``names``, shard by shard (each shard opened once, in
        file order), FP8 weights dequantised, every tensor converted to ``dtype``.

        Raises:
            KeyError: a name is not in the checkpoint.
            ValueError: an FP8 tensor without its scale, or with a scale but no
                ``weight_block_size`` in the config.
        """
        by_file: dict[Path, list[str]] = defaultdict(list)
        for n in names:
            if n not in self.files:
                raise KeyError(f"{n}: not in {self.path}")
            by_file[self.files[n]].append(n)
        for shard in sorted(by_file):
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for name in by_file[shard]:
                    t = f.get_tensor(name)
                    scale = self.scale_of(name)
                    if scale is not None:
                        t = self._dequantize(name, t, scale, f if self.files[scale] == shard else None, dtype)
                    elif self.dtype_name(name) in _FP8_DTYPES:
                        raise ValueError(f"{name}: stored as {self.dtype_name(name)} without {name}{SCALE_SUFFIX}; "
                                         "an FP8 weight needs its block scales")
                    self.tensors_read += 1
                    self.names_read.append(name)
                    yield name, t.to(dtype)
                    del t

    def _dequantize(self, name, t, scale_name, handle, dtype) -> torch.Tensor:
        if self.fp8_block is None:
            raise ValueError(f"{name}: has {scale_name} but config.json has no quantization_config."
                             "weight_block_size; add the released config.json")
        if handle is not None:
            s = handle.get_tensor(scale_name)
        else:  # the scale lies in another shard
            with safe_open(str(self.files[scale_name]), framework="pt", device="cpu") as g:
                s = g.get_tensor(scale_name)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        return dequantize_fp8_blocks(t, s, self.fp8_block, acc, name=name)
