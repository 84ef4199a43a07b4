"""Training data: byte-level text and .bin token files, rank sharding, validation split, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from dropless.config import ConfigError
from dropless.train.data import (
    ShardedLoader,
    check_data_config,
    check_token_ids,
    load_tokens,
    num_windows,
    stdlib_dir,
    text_files,
    val_windows,
)


def _cfg(**kw):
    base = {"kind": "text", "path": None, "glob": "*.py", "vocab_size": 256, "val_fraction": 0.01}
    base.update(kw)
    return OmegaConf.create(base)


def _bin_cfg(path, **kw):
    base = {"kind": "bin", "path": str(path), "dtype": "uint16", "vocab_size": 1000, "val_path": None,
            "val_fraction": 0.1}
    base.update(kw)
    return OmegaConf.create(base)


# ------------------------------------------------------------------ text
def test_text_dir_bytes_in_sorted_order_and_tail_held_out(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"ZZZZ")
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / "b" / "a.txt").write_bytes(b"world\n" * 30)
    (tmp_path / "skip.md").write_bytes(b"not me")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "x.txt").write_bytes(b"installed")
    d = load_tokens(_cfg(path=str(tmp_path), glob="*.txt", val_fraction=0.1))
    blob = b"hello " + b"world\n" * 30 + b"ZZZZ"          # a.txt, b/a.txt, b/z.txt
    assert d.vocab_size == 256
    whole = np.concatenate([d.train, d.val])
    assert whole.tobytes() == blob
    assert len(d.val) == int(len(blob) * 0.1)               # the tail, no overlap with train
    assert d.val.tobytes() == blob[-len(d.val):]


def test_stdlib_default_is_python_source():
    files = text_files(stdlib_dir(), "*.py")
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    rel = [f.relative_to(stdlib_dir()).as_posix() for f in files]
    assert rel == sorted(rel)
    d = load_tokens(_cfg())
    assert d.train.dtype == np.uint8 and len(d.train) > 5_000_000
    assert d.train[:len(files[0].read_bytes())].tobytes() == files[0].read_bytes()


def test_missing_path_and_empty_dir(tmp_path):
    with pytest.raises(ConfigError, match="data.path=.*no such file"):
        load_tokens(_cfg(path=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="no file matches"):
        load_tokens(_cfg(path=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"no file matches data.glob='\*.py'"):  # what --cfg runs, before any work
        check_data_config(_cfg(path=str(tmp_path)), 256)
    (tmp_path / "e.py").write_bytes(b"")
    with pytest.raises(ConfigError, match="all empty"):
        load_tokens(_cfg(path=str(tmp_path)))
    with pytest.raises(ConfigError, match="256"):
        load_tokens(_cfg(path=str(tmp_path), vocab_size=300))


def test_text_single_file_and_a_file_of_token_ids(tmp_path, capsys):
    f = tmp_path / "input.txt"
    f.write_bytes(b"to be or not to be\n" * 20)
    d = load_tokens(_cfg(path=str(f), val_fraction=0.1))
    assert np.concatenate([d.train, d.val]).tobytes() == f.read_bytes()
    assert d.source == f"the file {f} ({len(f.read_bytes()):,} bytes)"
    ids = tmp_path / "train.bin"
    np.arange(1, 1000, dtype=np.uint16).tofile(ids)       # ids < 256 have a zero high byte
    with pytest.raises(ConfigError, match=r"train.bin.* NUL byte at offset 1:.*data=bin"):
        load_tokens(_cfg(path=str(ids)))
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "a.py").write_bytes(b"x = 1\n")
    (tmp_path / "tok" / "b.py").write_bytes(b"x\0y")
    with pytest.raises(ConfigError, match=r"b.py.* NUL byte at offset 1\b"):
        load_tokens(_cfg(path=str(tmp_path / "tok")))


# ------------------------------------------------------------------ bin
def test_bin_memmap_and_val_split(tmp_path):
    ids = (np.arange(5000) * 7 % 1000).astype(np.uint16)
    ids.tofile(tmp_path / "t.bin")
    d = load_tokens(_bin_cfg(tmp_path / "t.bin"))
    assert isinstance(d.train, np.memmap) and d.vocab_size == 1000
    assert len(d.val) == 500
    assert np.array_equal(np.concatenate([d.train, d.val]), ids)
    ids32 = np.array([0, 70000, 5], dtype=np.uint32)
    ids32.tofile(tmp_path / "u.bin")
    v = np.arange(100, dtype=np.uint32)
    v.tofile(tmp_path / "v.bin")
    d = load_tokens(_bin_cfg(tmp_path / "u.bin", dtype="uint32", vocab_size=70001, val_path=str(tmp_path / "v.bin")))
    assert list(d.train) == [0, 70000, 5] and np.array_equal(d.val, v)


def test_bin_id_out_of_vocab_is_found_in_any_chunk(tmp_path):
    ids = np.zeros(10_000, dtype=np.uint16)
    ids[7_777] = 1000                                       # == vocab_size: out of range
    ids.tofile(tmp_path / "t.bin")
    with pytest.raises(ConfigError, match=r"token id 1000 at position 7777 is >= data.vocab_size=1000"):
        load_tokens(_bin_cfg(tmp_path / "t.bin"))
    mm = np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r")
    for chunk in (1, 3, 1000, 7_777, 7_778, 1 << 20):       # the chunk boundary does not matter
        with pytest.raises(ConfigError, match="position 7777"):
            check_token_ids(mm, 1000, chunk=chunk)
    check_token_ids(mm, 1001, chunk=3)                      # all ids < 1001: passes


def test_bin_bad_input(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_tokens(_bin_cfg(tmp_path / "missing.bin"))
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="empty"):
        load_tokens(_bin_cfg(tmp_path / "empty.bin"))
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ConfigError, match="not a multiple of 2"):
        load_tokens(_bin_cfg(tmp_path / "odd.bin"))
    np.zeros(10, np.uint16).tofile(tmp_path / "ok.bin")
    with pytest.raises(ConfigError, match="data.dtype"):
        load_tokens(_bin_cfg(tmp_path / "ok.bin", dtype="int8"))
    with pytest.raises(ConfigError, match="data.path is required"):
        load_tokens(_bin_cfg("???"))


def test_bin_reports_every_missing_or_invalid_field_at_once(tmp_path, capsys):
    """data=bin as the config group leaves it (path and vocab_size ``???``): one error names both
    fields, and with a bad dtype, a directory for the path and a missing val_path every one of them
    (it used to stop at the first, one run per field); dropless-train exits 2 before the run dir."""
    from dropless.train.__main__ import main
    from dropless.train.config import compose
    from dropless.train.data import check_data_config

    with pytest.raises(ConfigError) as e:
        load_tokens(compose(["data=bin"]).data)
    msg = str(e.value)
    assert msg.startswith("2 problems") and "data.path" in msg and "data.vocab_size" in msg
    cfg = _bin_cfg(tmp_path, dtype="int8", vocab_size=0, val_path=str(tmp_path / "val.bin"), val_fraction=2.0)
    with pytest.raises(ConfigError) as e:
        check_data_config(cfg, model_vocab_size=256)
    msg = str(e.value)
    assert msg.startswith("4 problems")
    for named in (f"data.path={str(tmp_path)!r}", "data.dtype='int8'", "['uint16', 'uint32']", "data.vocab_size=0",
                  f"data.val_path={str(tmp_path / 'val.bin')!r}"):
        assert named in msg
    assert "val_fraction" not in msg  # not used beside val_path
    run_dir = tmp_path / "run"
    assert main(["data=bin", "data.path=/no/such/train.bin", "logging.mode=disabled", f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err and "data.path='/no/such/train.bin'" in err
    assert "data.vocab_size" in err and not run_dir.exists()


def test_data_vocab_larger_than_model_is_an_error(tmp_path):
    np.zeros(100, np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(ConfigError, match=r"data.vocab_size=1000 > model.vocab_size=256"):
        load_tokens(_bin_cfg(tmp_path / "t.bin"), model_vocab_size=256)
    assert load_tokens(_bin_cfg(tmp_path / "t.bin"), model_vocab_size=1000).vocab_size == 1000


# ------------------------------------------------------------------ sharding
def test_shards_are_disjoint_equal_and_cover_the_windows():
    ids = np.arange(10 * 103 + 1, dtype=np.int64)          # 103 windows of 10 (+1) tokens
    S, W = 10, 3
    assert num_windows(len(ids), S) == 103
    shards = [ShardedLoader(ids, S, 2, rank=r, world_size=W, seed=0).shard_indices() for r in range(W)]
    assert all(len(s) == 103 // W for s in shards)
    allw = np.concatenate(shards)
    assert len(set(allw.tolist())) == len(allw)             # no window on two ranks
    assert set(allw.tolist()) == set(range(W * (103 // W)))


def test_loader_batches_epochs_and_state():
    S, B, W = 8, 4, 2
    ids = np.arange(S * 40 + 1) % 251                       # 40 windows, 20 per rank
    loaders = [ShardedLoader(ids, S, B, rank=r, world_size=W, seed=3) for r in range(W)]
    seen = [[], []]
    for r, ld in enumerate(loaders):
        for _ in range(5):                                  # one epoch: 20 windows / 4
            idx = ld.next_indices()
            seen[r].extend(idx.tolist())
    for r in range(W):                                      # an epoch visits each own window once
        assert sorted(seen[r]) == sorted(loaders[r].shard_indices().tolist())
    assert not set(seen[0]) & set(seen[1])
    x, y = loaders[0].next_batch()                          # epoch 1 starts, new order
    assert loaders[0].epoch == 1 and x.shape == (B, S) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])                 # targets are inputs shifted by one
    st = loaders[0].state_dict()
    a = [loaders[0].next_indices().tolist() for _ in range(7)]
    fresh = ShardedLoader(ids, S, B, rank=0, world_size=W, seed=3)
    fresh.load_state_dict(st)
    assert [fresh.next_indices().tolist() for _ in range(7)] == a
    other = ShardedLoader(ids, S, B, rank=0, world_size=W, seed=4)
    order4 = [i for _ in range(5) for i in other.next_indices().tolist()]
    assert sorted(order4) == sorted(seen[0]) and order4 != seen[0]   # another seed: same set, other order


def test_window_content():
    ids = np.arange(1000, dtype=np.int64)
    ld = ShardedLoader(ids, 10, 3, rank=1, world_size=2, seed=0)
    x, y = ld.next_batch()
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        start = row_x[0]
        assert start % 10 == 0 and (start // 10) % 2 == 1  # rank 1 holds the odd windows
        assert row_x == list(range(start, start + 10)) and row_y == list(range(start + 1, start + 11))


def test_val_windows_fixed_disjoint_per_rank():
    ids = np.arange(16 * 50 + 1)
    per = [val_windows(ids, 16, 4, 3, rank=r, world_size=2) for r in range(2)]
    starts = [set(int(x[i, 0]) // 16 for x, _ in p for i in range(x.shape[0])) for p in per]
    assert all(len(p) == 3 and len(s) == 12 for p, s in zip(per, starts))
    assert not starts[0] & starts[1]
    again = val_windows(ids, 16, 4, 3, rank=0, world_size=2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(per[0], again))
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size=4") as e:
        val_windows(np.arange(20), 16, 4, 1)
    assert "validation" in str(e.value) and "train.seq_len" in str(e.value)  # the split, and what to lower


def test_too_little_data_for_a_batch():
    with pytest.raises(ConfigError, match="micro_batch_size=8"):
        ShardedLoader(np.arange(100), 16, 8, rank=0, world_size=2)


# ------------------------------------------------------------------ no validation
def test_val_fraction_zero_trains_on_every_token_only_in_a_run_that_never_validates(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"abcdefghij" * 10)
    cfg = _cfg(path=str(tmp_path), glob="*.txt", val_fraction=0.0)
    with pytest.raises(ConfigError, match=r"^data\.val_fraction=0\.0: .*train\.val_every=0"):
        load_tokens(cfg)
    d = load_tokens(cfg, validates=False)
    assert d.train.tobytes() == b"abcdefghij" * 10 and len(d.val) == 0
    bins = np.arange(50, dtype=np.uint16)
    bins.tofile(tmp_path / "t.bin")
    d = load_tokens(_bin_cfg(tmp_path / "t.bin", val_fraction=0.0), validates=False)
    assert np.array_equal(d.train, bins) and len(d.val) == 0
    d = load_tokens(_bin_cfg(tmp_path / "t.bin", val_fraction=0.1), validates=False)
    assert np.array_equal(d.train, bins[:45]) and np.array_equal(d.val, bins[45:])  # (0, 1) as before


def test_a_run_that_never_validates_trains_beside_a_split_too_small_to_validate(tmp_path):
    from dropless.train.config import compose
    from dropless.train.trainer import Trainer

    (tmp_path / "a.txt").write_bytes(bytes(range(1, 256)) * 40)  # 10,200 bytes: 1 % is 102, under one window
    common = ["data.path=" + str(tmp_path), "data.glob=*.txt", "train.micro_batch_size=2", "train.seq_len=64",
              "train.steps=2", "optim.warmup_steps=1", "train.ckpt_every=0", "logging.mode=disabled",
              "logging.progress=false", "num_threads=2"]
    with pytest.raises(ConfigError, match="validation split"):
        Trainer(compose(common + [f"run_dir={tmp_path / 'r0'}", "train.val_every=1"]))
    for frac in ("0.01", "0"):
        tr = Trainer(compose(common + [f"run_dir={tmp_path / ('r' + frac)}", "train.val_every=0",
                                       f"data.val_fraction={frac}"]))
        try:
            assert tr.train()["steps"] == 2
            with pytest.raises(ConfigError, match="no validation micro-batches"):
                tr.validate()
        finally:
            tr.close()
