"""Training data: byte-level text or a memory-mapped ``.bin`` of token ids, sharded over ranks.

Two sources (``cfg.data.kind``):

* ``text`` (``configs/data/stdlib.yaml``): every file matching ``data.glob`` under
  ``data.path`` (recursive, sorted by relative path, so the order is the same on every
  machine), concatenated as raw bytes: token id = byte value, vocab 256. The default
  ``data.path: null`` is the Python standard library's own source
  (``sysconfig.get_paths()["stdlib"]``, ``*.py``; ``site-packages``/``dist-packages``
  excluded), real text that is on every machine. ``data.path`` may also name one text file. A file
  holding a NUL byte is refused (not text: a ``.bin`` of token ids, say, belongs to ``bin``).
* ``bin`` (``configs/data/bin.yaml``): a flat file of ``uint16``/``uint32`` token ids
  (nanoGPT's ``train.bin`` format), memory-mapped, with its ``data.vocab_size``. Every id
  is checked ``< vocab_size`` before training, in chunks of :data:`CHECK_CHUNK` ids
  (vectorised ``max`` per chunk; the file is never loaded whole).

Split: the last ``val_fraction`` of the token stream is held out for validation (or a
separate ``data.val_path`` for ``bin``; ``val_fraction=0``, every token trained on, only in a run
with ``train.val_every=0``). Both streams are cut into windows of
``seq_len + 1`` tokens at multiples of ``seq_len`` (window ``i`` = tokens
``[i·S, i·S + S + 1)``: inputs ``[:-1]``, targets ``[1:]``).

Sharding: window ``i`` of the training stream belongs to rank ``i % world_size``; every
rank keeps the same number of windows (``n // world_size``), so no window is seen by
two ranks and all ranks turn an epoch at the same step. Each epoch visits a rank's
windows in a permutation drawn from ``(seed, epoch)``. The position (``epoch``,
``offset``) is the loader's whole state (:meth:`ShardedLoader.state_dict`).

Validation: rank ``r`` takes ``val_batches · micro_batch_size`` windows spread evenly
over its share of the validation windows, the same ones at every evaluation.

Errors (:class:`~dropless.config.ConfigError`, raised before training): the fields' own rules
are the schema's (``validate()`` of :class:`~dropless.train.schema.TextDataConfig` and
:class:`~dropless.train.schema.BinDataConfig`), the rules between groups (a data vocabulary
larger than the model's) :func:`~dropless.train.startup.check_train_config`'s; here, what the
files show: a stat (:func:`check_data_config`: a missing path, a directory with no matching
file, a ``.bin`` that is empty or not a whole number of ids), then reading them (text with no
bytes or a NUL byte, an id ``>= vocab_size``, too few tokens for one batch per rank). The
functions here take the typed, checked config and read its fields as they are.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from dropless.config import ConfigError
from dropless.train.schema import BinDataConfig, TextDataConfig

__all__ = ["TokenData", "ShardedLoader", "load_tokens", "check_data_config", "stdlib_dir", "text_files",
           "check_token_ids", "val_windows", "run_val_windows", "CHECK_CHUNK"]

#: ids per chunk of the ``id < vocab_size`` check of a ``.bin`` (64 Mi ids: 128 MiB of uint16).
CHECK_CHUNK = 1 << 26
_EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")


@dataclass
class TokenData:
    """The token streams of a run.

    Attributes:
        train: 1-D array of token ids (uint8 for text, a ``np.memmap`` for ``.bin``).
        val: 1-D array of held-out token ids.
        vocab_size: the data's vocabulary size (256 for bytes).
        source: a human-readable description (path, files, tokens).
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    source: str


def stdlib_dir() -> Path:
    """The Python standard library's source directory (``sysconfig`` ``stdlib``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _text_paths(root: Path, glob: str) -> Iterator[Path]:
    """Files matching ``glob`` under ``root`` (recursive), outside :data:`_EXCLUDED_DIRS`, as found."""
    return (p for p in root.rglob(glob)
            if p.is_file() and not any(d in _EXCLUDED_DIRS for d in p.relative_to(root).parts[:-1]))


def text_files(root: Path, glob: str) -> list[Path]:
    """Files matching ``glob`` under ``root`` (recursive), sorted by relative posix path.

    ``site-packages``, ``dist-packages`` and ``__pycache__`` directories are skipped, so
    the standard library's text does not depend on what is installed.
    """
    return sorted(_text_paths(root, glob), key=lambda p: p.relative_to(root).as_posix())


def check_token_ids(ids: np.ndarray, vocab_size: int, name: str = "data", chunk: int = CHECK_CHUNK) -> None:
    """Raise ConfigError if any id is ``>= vocab_size``; reads ``ids`` in chunks (memmap-friendly).

    The message gives the first offending position and value.
    """
    n = len(ids)
    for lo in range(0, n, chunk):
        part = np.asarray(ids[lo:lo + chunk])
        if part.size and int(part.max()) >= vocab_size:
            pos = lo + int(np.argmax(part >= vocab_size))
            raise ConfigError(f"{name}: token id {int(ids[pos])} at position {pos} is >= data.vocab_size={vocab_size}: "
                              "set it to the tokenizer's vocabulary size, or check data.dtype (uint16 | uint32)")


def _text_root(data: TextDataConfig) -> Path:
    """The directory (or file) of a text corpus: ``data.path``, or the standard library's source."""
    return Path(data.path).expanduser() if data.path else stdlib_dir()


def _text_problem(data: TextDataConfig) -> str | None:
    """Why ``data.path`` holds no file to read (no such path; a directory with no match of ``data.glob``)."""
    root = _text_root(data)
    if not root.exists():
        return f"data.path={str(root)!r}: no such file or directory (null: the Python standard library)"
    if root.is_dir() and next(_text_paths(root, data.glob), None) is None:
        return f"data.path={str(root)!r}: no file matches data.glob={data.glob!r} (searched recursively)"
    return None


def _bin_file_problem(path: Path, what: str, dtype: str) -> str | None:
    """Why the ``.bin`` at ``path`` (the field ``what``) cannot be read as ``dtype`` ids, from its stat alone."""
    if not path.exists():
        return f"{what}={str(path)!r}: no such file (a flat .bin of token ids)"
    if path.is_dir():
        return f"{what}={str(path)!r} is a directory, not a .bin (text files: data=stdlib data.path=DIR)"
    size, item = path.stat().st_size, np.dtype(dtype).itemsize
    if size == 0:
        return f"{what}={str(path)!r} is empty (0 bytes)"
    if size % item:
        return f"{what}={str(path)!r}: {size} bytes is not a multiple of {item}: is data.dtype={dtype} right?"
    return None


def check_data_config(data: TextDataConfig | BinDataConfig) -> None:
    """Raise one ConfigError naming every path of ``cfg.data`` that a stat shows cannot be read.

    ``data`` has passed its ``validate()`` (the fields' own rules; :func:`~dropless.train.startup.check_train_config`
    runs both, before any work). Text: ``data.path`` (or the standard library) exists and, a directory,
    holds a file matching ``data.glob``. Bin: ``data.path`` and ``data.val_path`` (when given) are files,
    not empty, of a whole number of ``data.dtype`` ids; both are named in one error (``;``-separated).
    """
    if data.kind == "text":
        problems = [_text_problem(data)]
    else:
        problems = [_bin_file_problem(Path(p).expanduser(), what, data.dtype)
                    for what, p in (("data.path", data.path), ("data.val_path", data.val_path)) if p]
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError("; ".join(problems))


def _load_bin(path: str, dtype: str, vocab_size: int, what: str) -> np.ndarray:
    """The checked file (:func:`check_data_config`) memory-mapped, every id checked ``< vocab_size``."""
    path = Path(path).expanduser()
    ids = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    check_token_ids(ids, vocab_size, name=f"{what}={str(path)!r}")
    return ids


def _text_bytes(path: Path) -> bytes:
    """The bytes of one file of a text corpus; ConfigError if it holds a NUL byte (not text: a file of
    token ids, say, which byte-level text would silently train on as bytes)."""
    b = path.read_bytes()
    at = b.find(b"\0")
    if at >= 0:
        raise ConfigError(f"data.path: {str(path)!r} holds a NUL byte at offset {at:,}: not text; narrow data.glob, "
                          "or for token ids use data=bin data.path=FILE data.vocab_size=N")
    return b


def _split(ids: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)``: the last ``val_fraction`` of ``ids`` (at least one id; none for 0) held out."""
    n_val = max(1, int(len(ids) * val_fraction)) if val_fraction > 0 else 0
    return ids[:len(ids) - n_val], ids[len(ids) - n_val:]


def load_tokens(data: TextDataConfig | BinDataConfig) -> TokenData:
    """Load the token streams described by ``cfg.data``.

    Args:
        data: the typed ``data`` group, passed by its ``validate()`` and :func:`check_data_config`
            (:func:`~dropless.train.startup.check_train_config` runs both, and the rules between
            groups: the data's vocabulary within the model's, ``val_fraction=0`` only without validation).
    Returns: :class:`TokenData`.
    Raises:
        ConfigError: what only reading the data shows: text files that are all empty or hold a NUL
            byte; a ``.bin`` id ``>= data.vocab_size``.
    """
    if data.kind == "text":
        root = _text_root(data)
        files = [root] if root.is_file() else text_files(root, data.glob)
        blob = b"".join(_text_bytes(f) for f in files)
        if not blob:
            raise ConfigError(f"data.path={str(root)!r}: the {len(files)} files matching {data.glob!r} are empty")
        ids = np.frombuffer(blob, dtype=np.uint8)
        train, val = _split(ids, data.val_fraction)
        source = (f"the file {root} ({len(ids):,} bytes)" if root.is_file()
                  else f"{len(files)} files matching {data.glob!r} under {root} ({len(ids):,} bytes)")
    else:
        ids = _load_bin(data.path, data.dtype, data.vocab_size, "data.path")
        if data.val_path:
            train, val = ids, _load_bin(data.val_path, data.dtype, data.vocab_size, "data.val_path")
        else:
            train, val = _split(ids, data.val_fraction)
        source = f"{Path(data.path).expanduser()} ({len(ids):,} {data.dtype} tokens, vocab {data.vocab_size})"
    return TokenData(train=train, val=val, vocab_size=data.vocab_size, source=source)


def _windows(ids: np.ndarray, idx: np.ndarray, seq_len: int) -> torch.Tensor:
    """Windows ``[i·S, i·S + S + 1)`` for each ``i`` in ``idx`` -> int64 [len(idx), S + 1]."""
    out = np.empty((len(idx), seq_len + 1), dtype=np.int64)
    for j, i in enumerate(idx):
        lo = int(i) * seq_len
        out[j] = ids[lo:lo + seq_len + 1]
    return torch.from_numpy(out)


def num_windows(n_tokens: int, seq_len: int) -> int:
    """Windows of ``seq_len + 1`` tokens at multiples of ``seq_len`` in a stream of ``n_tokens``."""
    return max(0, (n_tokens - 1) // seq_len)


class ShardedLoader:
    """Micro-batches of one rank's shard of the training windows, in a seeded order per epoch.

    Args:
        ids: the training token stream (1-D array or memmap).
        seq_len: S, tokens per sequence.
        batch_size: sequences per micro-batch.
        rank, world_size: this rank's place among all ranks that read different data.
        seed: base seed of the per-epoch permutation.
        pin_memory: return page-locked windows (for ``.to("cuda", non_blocking=True)``; CUDA only).
    Yields (``next_window``): int64 CPU ``[batch_size, seq_len + 1]`` windows (inputs ``[:, :-1]``,
    targets ``[:, 1:]``); ``next_batch``: ``(inputs_BS, targets_BS)``.
    Raises:
        ConfigError: the shard holds fewer windows than one micro-batch.
    """

    def __init__(self, ids: np.ndarray, seq_len: int, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, pin_memory: bool = False):
        self.ids, self.seq_len, self.batch_size = ids, int(seq_len), int(batch_size)
        self.pin_memory = bool(pin_memory)
        self.rank, self.world_size, self.seed = int(rank), int(world_size), int(seed)
        n = num_windows(len(ids), self.seq_len)
        self.per_rank = n // self.world_size
        if self.per_rank < self.batch_size:
            raise ConfigError(f"data: {len(ids):,} training tokens make {n} windows of train.seq_len+1="
                              f"{self.seq_len + 1}, {self.per_rank} per rank over {self.world_size} ranks, fewer than "
                              f"train.micro_batch_size={self.batch_size}: use more data or a smaller seq_len/batch")
        self.epoch, self.offset = 0, 0
        self._perm = self._permutation(0)

    def shard_indices(self) -> np.ndarray:
        """This rank's window indices (before shuffling): ``rank, rank + W, ...``."""
        return self.rank + self.world_size * np.arange(self.per_rank, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch, 0x64726F70])
        return self.shard_indices()[rng.permutation(self.per_rank)]

    def next_indices(self) -> np.ndarray:
        """Window indices of the next micro-batch (advances the position)."""
        if self.offset + self.batch_size > self.per_rank:  # drop the ragged tail of the epoch
            self.epoch, self.offset = self.epoch + 1, 0
            self._perm = self._permutation(self.epoch)
        idx = self._perm[self.offset:self.offset + self.batch_size]
        self.offset += self.batch_size
        return idx

    def next_window(self) -> torch.Tensor:
        """The next micro-batch as one int64 CPU ``[batch_size, seq_len + 1]`` tensor (pinned if asked).

        Copy it to the device whole (one contiguous, asynchronous copy from pinned memory) and
        slice there: inputs ``w[:, :-1]``, targets ``w[:, 1:]``.
        """
        w = _windows(self.ids, self.next_indices(), self.seq_len)
        return w.pin_memory() if self.pin_memory else w

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs_BS, targets_BS)``, int64 CPU tensors [batch_size, seq_len]."""
        w = self.next_window()
        return w[:, :-1], w[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.offset = int(sd["epoch"]), int(sd["offset"])
        self._perm = self._permutation(self.epoch)


def val_windows(ids: np.ndarray, seq_len: int, batch_size: int, num_batches: int, rank: int = 0,
                world_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation micro-batches of one rank.

    Rank ``r``'s share is the validation windows ``r, r + W, ...``; it takes
    ``num_batches · batch_size`` of them spread evenly over the share.
    Raises ConfigError if the share holds fewer windows than one micro-batch.
    """
    n = num_windows(len(ids), seq_len)
    per_rank = n // world_size
    want = num_batches * batch_size
    if per_rank < batch_size:
        raise ConfigError(f"data: the validation split ({len(ids):,} tokens) has {per_rank} windows of train.seq_len+1="
                          f"{seq_len + 1} per rank, fewer than train.micro_batch_size={batch_size}: lower either, or "
                          "hold out more (data.val_fraction, or a longer data.val_path)")
    take = min(want, per_rank - per_rank % batch_size)
    pos = np.linspace(0, per_rank - 1, take).round().astype(np.int64)
    idx = rank + world_size * pos
    w = _windows(ids, idx, seq_len)
    return [(w[i:i + batch_size, :-1], w[i:i + batch_size, 1:]) for i in range(0, take, batch_size)]


def run_val_windows(ids: np.ndarray, seq_len: int, batch_size: int, num_batches: int, rank: int, world_size: int,
                    validates: bool) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str | None]:
    """A run's validation micro-batches (:func:`val_windows`) and a warning when there are fewer than
    ``num_batches`` (``train.val_batches``), else None. A run that never validates (``validates`` false:
    ``train.val_every=0``) gets none: :meth:`~dropless.train.trainer.Trainer.validate` makes them when
    asked (then the error for a split too small for one micro-batch comes)."""
    if not validates:
        return [], None
    batches = val_windows(ids, seq_len, batch_size, num_batches, rank, world_size)
    if len(batches) >= num_batches:
        return batches, None
    return batches, (f"train.val_batches={num_batches}: the validation split holds {len(batches)} micro-batch(es) "
                     "per rank; validating on those (more: data.val_fraction, or a longer data.val_path)")
