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

Errors (:class:`~dropless.config.ConfigError`, raised before training): a missing path,
a directory with no matching file or no bytes, a ``.bin`` whose size is not a multiple of
the dtype, an id ``>= vocab_size``, a data vocabulary larger than the model's, too few
tokens for one batch per rank. What the config and a look at the files show
(:func:`check_data_config`: missing or invalid fields, paths that are no file, sizes) comes
as one error listing every problem, not one per run.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from dropless.config import ConfigError

__all__ = ["TokenData", "ShardedLoader", "load_tokens", "check_data_config", "stdlib_dir", "text_files",
           "check_token_ids", "val_windows", "run_val_windows", "CHECK_CHUNK"]

#: ids per chunk of the ``id < vocab_size`` check of a ``.bin`` (64 Mi ids: 128 MiB of uint16).
CHECK_CHUNK = 1 << 26
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
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


def text_files(root: Path, glob: str) -> list[Path]:
    """Files matching ``glob`` under ``root`` (recursive), sorted by relative posix path.

    ``site-packages``, ``dist-packages`` and ``__pycache__`` directories are skipped, so
    the standard library's text does not depend on what is installed.
    """
    files = [p for p in root.rglob(glob)
             if p.is_file() and not any(d in _EXCLUDED_DIRS for d in p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def check_token_ids(ids: np.ndarray, vocab_size: int, name: str = "data", chunk: int = CHECK_CHUNK) -> None:
    """Raise ConfigError if any id is ``>= vocab_size``; reads ``ids`` in chunks (memmap-friendly).

    The message gives the first offending position and value.
    """
    n = len(ids)
    for lo in range(0, n, chunk):
        part = np.asarray(ids[lo:lo + chunk])
        if part.size and int(part.max()) >= vocab_size:
            pos = lo + int(np.argmax(part >= vocab_size))
            raise ConfigError(
                f"{name}: token id {int(ids[pos])} at position {pos} is >= data.vocab_size={vocab_size}. "
                "Set data.vocab_size to the tokenizer's vocabulary size (larger than every id), or check "
                "data.dtype (uint16 vs uint32) matches how the file was written.")


def _missing(data_cfg: Any, key: str) -> bool:
    """The field is absent, null, empty or Hydra's ``???`` (required, not given)."""
    if key not in data_cfg or OmegaConf.is_missing(data_cfg, key):
        return True
    return data_cfg.get(key) in (None, "", "???")


def _bin_file_problem(path: Path, what: str, dtype: str | None) -> str | None:
    """Why the ``.bin`` at ``path`` (the field ``what``) cannot be read as token ids, from its stat alone."""
    if not path.exists():
        return f"{what}={str(path)!r}: no such file. Point it at a flat .bin of token ids."
    if path.is_dir():
        return (f"{what}={str(path)!r} is a directory; data=bin needs a .bin file "
                "(for a directory of text files use data=stdlib data.path=DIR)")
    size = path.stat().st_size
    if size == 0:
        return f"{what}={str(path)!r} is empty (0 bytes)"
    item = np.dtype(_DTYPES[dtype]).itemsize if dtype in _DTYPES else 1
    if size % item:
        return (f"{what}={str(path)!r}: {size} bytes is not a multiple of {item} (data.dtype={dtype}); "
                "is the dtype right?")
    return None


def _no_match(root: Path, glob: str) -> str:
    return (f"data.path={str(root)!r}: no file matches data.glob={glob!r} (searched recursively). "
            "Put text files there or change data.glob.")


def _data_problems(data_cfg: Any, model_vocab_size: int | None, validates: bool = True) -> list[str]:
    """Every problem of ``cfg.data`` that the config and a stat of its paths show (see :func:`check_data_config`)."""
    kind = str(data_cfg.kind)
    if kind not in ("text", "bin"):
        return [f"data.kind={kind!r}: must be 'text' (data=stdlib) or 'bin' (data=bin)"]
    out: list[str] = []
    vocab: int | None = None
    has_val_path = kind == "bin" and not _missing(data_cfg, "val_path")
    if kind == "text":
        if not _missing(data_cfg, "path"):
            root = Path(str(data_cfg.path)).expanduser()
            glob = str(data_cfg.get("glob", "*.py"))
            if not root.exists():
                out.append(f"data.path={str(root)!r}: no such file or directory. Pass a directory of text files "
                           "(data.path=DIR data.glob='*.txt'), or leave data.path null for the Python standard "
                           "library.")
            elif root.is_dir() and not text_files(root, glob):
                out.append(_no_match(root, glob))
        vocab = 256 if _missing(data_cfg, "vocab_size") else int(data_cfg.vocab_size)
        if vocab != 256:
            out.append(f"data.vocab_size={vocab}: byte-level text has 256 token ids; set it to 256")
    else:  # in the order of configs/data/bin.yaml
        dtype = str(data_cfg.get("dtype", "uint16"))
        if _missing(data_cfg, "path"):
            out.append("data.path is required for data=bin: data.path=/path/train.bin")
        else:
            problem = _bin_file_problem(Path(str(data_cfg.path)).expanduser(), "data.path", dtype)
            if problem:
                out.append(problem)
        if dtype not in _DTYPES:
            out.append(f"data.dtype={dtype!r}: must be one of {sorted(_DTYPES)}")
        if _missing(data_cfg, "vocab_size"):
            out.append("data.vocab_size is required for data=bin (the tokenizer's vocabulary size)")
        else:
            vocab = int(data_cfg.vocab_size)
            top = np.iinfo(_DTYPES[dtype]).max + 1 if dtype in _DTYPES else None
            if vocab <= 0 or (top is not None and vocab > top):
                out.append(f"data.vocab_size={vocab}: must lie in [1, {top}] for data.dtype={dtype}" if top else
                           f"data.vocab_size={vocab}: must be >= 1")
        if has_val_path:
            problem = _bin_file_problem(Path(str(data_cfg.val_path)).expanduser(), "data.val_path", dtype)
            if problem:
                out.append(problem)
    if not has_val_path:
        frac = float(data_cfg.get("val_fraction", 0.01))
        if not (0.0 < frac < 1.0 or (frac == 0.0 and not validates)):
            out.append(f"data.val_fraction={frac}: must lie in (0, 1)"
                       + (" (0, training on every token, only with train.val_every=0)" if frac == 0.0 else ""))
    if vocab is not None and model_vocab_size is not None and vocab > int(model_vocab_size):
        out.append(f"data.vocab_size={vocab} > model.vocab_size={model_vocab_size}: the model's embedding cannot "
                   f"hold every token id. Set model.vocab_size to at least {vocab}.")
    return out


def check_data_config(data_cfg: Any, model_vocab_size: int | None = None, validates: bool = True) -> None:
    """Raise one ConfigError naming every problem of ``cfg.data`` that shows without reading the data.

    The fields (``data.kind``; ``vocab_size``: 256 for text, required for bin and within its
    ``dtype``'s range; ``dtype``; ``val_fraction`` in (0, 1) unless a ``val_path`` is given (0 too, no
    validation split, when ``validates`` is False: a run with ``train.val_every=0``); a data
    vocabulary not above ``model_vocab_size``) and a stat of the paths (a text ``path`` that does
    not exist; a ``.bin`` ``path`` / ``val_path`` that is missing, a directory, empty, or not a
    whole number of ``dtype`` ids). One problem gives its message alone; several give
    ``"N problems in the data config: "`` and each message, ``;``-separated, so one run names
    every field to fix. :func:`load_tokens` calls it first; ``check_train_config`` calls it
    before any work.
    """
    problems = _data_problems(data_cfg, model_vocab_size, validates)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems in the data config: " + "; ".join(m.rstrip(".") for m in problems))


def _load_bin(path: Path, dtype: str, vocab_size: int, what: str) -> np.ndarray:
    """The checked file (:func:`check_data_config`) memory-mapped, every id checked ``< vocab_size``."""
    ids = np.memmap(path, dtype=_DTYPES[dtype], mode="r")
    check_token_ids(ids, vocab_size, name=f"{what}={str(path)!r}")
    return ids


def _text_bytes(path: Path) -> bytes:
    """The bytes of one file of a text corpus; ConfigError if it holds a NUL byte (not text: a file of
    token ids, say, which byte-level text would silently train on as bytes)."""
    b = path.read_bytes()
    at = b.find(b"\0")
    if at >= 0:
        raise ConfigError(f"data.path: {str(path)!r} holds a NUL byte at offset {at:,}: it is not ASCII or "
                          "UTF-8 text, and data=stdlib (data.kind=text) trains on the bytes of text files. For a "
                          "file of token ids use data=bin data.path=FILE data.vocab_size=N "
                          "(data.dtype=uint16|uint32); otherwise narrow data.glob to text files.")
    return b


def load_tokens(data_cfg: Any, model_vocab_size: int | None = None, validates: bool = True) -> TokenData:
    """Load and check the token streams described by ``cfg.data``.

    Args:
        data_cfg: the ``data`` config node (``kind``, ``path``, ``vocab_size``,
            ``val_fraction``; ``glob`` for text; ``dtype``, ``val_path`` for bin).
        model_vocab_size: the model's ``vocab_size``; the data's must not exceed it.
        validates: False for a run that never validates (``train.val_every=0``): then
            ``val_fraction=0`` is allowed and gives an empty ``val`` (every token trains).
    Returns: :class:`TokenData`.
    Raises:
        ConfigError: see the module docstring; first :func:`check_data_config`'s, all in one.
    """
    check_data_config(data_cfg, model_vocab_size, validates)
    kind = str(data_cfg.kind)
    frac = float(data_cfg.get("val_fraction", 0.01))
    if kind == "text":
        vocab = 256
        root = stdlib_dir() if _missing(data_cfg, "path") else Path(str(data_cfg.path)).expanduser()
        glob = str(data_cfg.get("glob", "*.py"))
        files = [root] if root.is_file() else text_files(root, glob)
        if not files:
            raise ConfigError(_no_match(root, glob))
        blob = b"".join(_text_bytes(f) for f in files)
        if not blob:
            raise ConfigError(f"data.path={str(root)!r}: the {len(files)} files matching "
                              f"{glob!r} are all empty")
        ids = np.frombuffer(blob, dtype=np.uint8)
        n_val = max(1, int(len(ids) * frac)) if frac > 0 else 0
        train, val = ids[:len(ids) - n_val], ids[len(ids) - n_val:]
        source = (f"the file {root} ({len(ids):,} bytes)" if root.is_file()
                  else f"{len(files)} files matching {glob!r} under {root} ({len(ids):,} bytes)")
    else:
        dtype = str(data_cfg.get("dtype", "uint16"))
        vocab = int(data_cfg.vocab_size)
        path = Path(str(data_cfg.path)).expanduser()
        ids = _load_bin(path, dtype, vocab, "data.path")
        if not _missing(data_cfg, "val_path"):
            train = ids
            val = _load_bin(Path(str(data_cfg.val_path)).expanduser(), dtype, vocab, "data.val_path")
        else:
            n_val = max(1, int(len(ids) * frac)) if frac > 0 else 0
            train, val = ids[:len(ids) - n_val], ids[len(ids) - n_val:]
        source = f"{path} ({len(ids):,} {dtype} tokens, vocab {vocab})"
    return TokenData(train=train, val=val, vocab_size=vocab, source=source)


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
            raise ConfigError(
                f"data: {len(ids):,} training tokens make {n} windows of train.seq_len+1={self.seq_len + 1}, "
                f"{self.per_rank} per rank over {self.world_size} ranks, fewer than "
                f"train.micro_batch_size={self.batch_size}. Use more data or a smaller seq_len/batch.")
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
        raise ConfigError(
            f"data: the validation split ({len(ids):,} tokens) has {per_rank} windows of "
            f"train.seq_len+1={seq_len + 1} per rank, fewer than train.micro_batch_size={batch_size}. "
            "Lower train.micro_batch_size or train.seq_len, or hold out more validation tokens (a larger "
            "data.val_fraction, or with data=bin a longer data.val_path file).")
    take = min(want, per_rank - per_rank % batch_size)
    pos = np.linspace(0, per_rank - 1, take).round().astype(np.int64)
    idx = rank + world_size * pos
    w = _windows(ids, idx, seq_len)
    return [(w[i:i + batch_size, :-1], w[i:i + batch_size, 1:]) for i in range(0, take, batch_size)]


def run_val_windows(ids: np.ndarray, seq_len: int, batch_size: int, num_batches: int, rank: int, world_size: int,
                    validates: bool) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str | None]:
    """A run's validation micro-batches (:func:`val_windows`) and a warning when there are fewer than
    ``num_batches`` (``train.val_batches``), else None. A run that never validates (``validates`` false:
    ``train.val_every=0``) gets none instead of the error for a split too small for one micro-batch."""
    try:
        batches = val_windows(ids, seq_len, batch_size, num_batches, rank, world_size)
    except ConfigError:
        if validates:
            raise
        return [], None
    if len(batches) >= num_batches or not validates:
        return batches, None
    return batches, (f"train.val_batches={num_batches}: the validation split holds {len(batches)} micro-batch(es) "
                     "per rank; validating on those (for more, a larger data.val_fraction, or with data=bin a "
                     "longer data.val_path file)")
