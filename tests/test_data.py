"""Training data: byte-level text and .bin token files, rank sharding, validation split, bad input."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import dropless.train.startup as startup
from dropless.config import ConfigError
from dropless.train.__main__ import main
from dropless.train.config import compose
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
from dropless.train.schema import BinDataConfig, TextDataConfig
from dropless.train.startup import check_train_config


def _cfg(**kw) -> TextDataConfig:
    return TextDataConfig(**{"kind": "text", "path": None, "glob": "*.py", "vocab_size": 256, "val_fraction": 0.01,
                             **kw})


def _bin_cfg(path, **kw) -> BinDataConfig:
    return BinDataConfig(**{"kind": "bin", "path": str(path), "dtype": "uint16", "vocab_size": 1000, "val_path": None,
                            "val_fraction": 0.1, **kw})


def _names(field: str):
    """``pytest.raises`` of a ConfigError whose message starts with ``field`` (``field=value: ...``)."""
    return pytest.raises(ConfigError, match=rf"^{re.escape(field)}(?![\w.])")


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


def test_text_paths_that_hold_no_text(tmp_path):
    """A stat shows a missing path and a directory with no match (check_data_config, which
    ``--cfg`` runs too); reading shows files that are all empty (load_tokens)."""
    with _names("data.path"):
        check_data_config(_cfg(path=str(tmp_path / "nope")))
    with _names("data.path") as e:
        check_data_config(_cfg(path=str(tmp_path)))
    assert "data.glob='*.py'" in str(e.value)
    with _names("data.path") as e:                          # the standard library, with a glob matching nothing
        check_data_config(_cfg(glob="*.no-such-suffix"))
    assert "data.glob='*.no-such-suffix'" in str(e.value)
    check_data_config(_cfg())                               # the standard library's *.py
    (tmp_path / "e.py").write_bytes(b"")
    check_data_config(_cfg(path=str(tmp_path)))             # a match: the stat passes it
    with _names("data.path") as e:
        load_tokens(_cfg(path=str(tmp_path)))
    assert "the 1 files" in str(e.value)


def test_text_single_file_and_a_file_of_token_ids(tmp_path):
    f = tmp_path / "input.txt"
    f.write_bytes(b"to be or not to be\n" * 20)
    d = load_tokens(_cfg(path=str(f), val_fraction=0.1))
    assert np.concatenate([d.train, d.val]).tobytes() == f.read_bytes()
    assert d.source == f"the file {f} ({len(f.read_bytes()):,} bytes)"
    ids = tmp_path / "train.bin"
    np.arange(1, 1000, dtype=np.uint16).tofile(ids)       # ids < 256 have a zero high byte
    with pytest.raises(ConfigError, match=r"^data\.path: '.*train\.bin'.* offset 1\b.*data=bin"):
        load_tokens(_cfg(path=str(ids)))
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "a.py").write_bytes(b"x = 1\n")
    (tmp_path / "tok" / "b.py").write_bytes(b"x\0y")
    with pytest.raises(ConfigError, match=r"^data\.path: '.*b\.py'.* offset 1\b"):
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
    with pytest.raises(ConfigError, match=r"^data\.path='.*t\.bin': token id 1000 at position 7777 .*"
                                          r"data\.vocab_size=1000"):
        load_tokens(_bin_cfg(tmp_path / "t.bin"))
    mm = np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r")
    for chunk in (1, 3, 1000, 7_777, 7_778, 1 << 20):       # the chunk boundary does not matter
        with pytest.raises(ConfigError, match="position 7777"):
            check_token_ids(mm, 1000, chunk=chunk)
    check_token_ids(mm, 1001, chunk=3)                      # all ids < 1001: passes


def test_bin_files_a_stat_refuses(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")    # 3 bytes: not whole uint16 ids
    np.zeros(10, np.uint16).tofile(tmp_path / "ok.bin")
    for name in ("missing.bin", "empty.bin", "odd.bin", "."):  # "." : a directory
        with _names(f"data.path='{tmp_path / name}'"):
            check_data_config(_bin_cfg(tmp_path / name))
    check_data_config(_bin_cfg(tmp_path / "ok.bin", dtype="uint32"))  # 20 bytes: 5 uint32 ids
    np.zeros(3, np.uint16).tofile(tmp_path / "six.bin")                # 6 bytes: whole uint16 ids only
    check_data_config(_bin_cfg(tmp_path / "six.bin"))
    with _names(f"data.path='{tmp_path / 'six.bin'}'") as e:
        check_data_config(_bin_cfg(tmp_path / "six.bin", dtype="uint32"))
    assert "data.dtype=uint32" in str(e.value)
    # both files of a run in one error, path first
    with _names(f"data.path='{tmp_path}'") as e:
        check_data_config(_bin_cfg(tmp_path, val_path=str(tmp_path / "val.bin")))
    assert f"; data.val_path='{tmp_path / 'val.bin'}'" in str(e.value)
    with _names(f"data.val_path='{tmp_path / 'empty.bin'}'"):
        check_data_config(_bin_cfg(tmp_path / "ok.bin", val_path=str(tmp_path / "empty.bin")))


# ------------------------------------------------------------------ the rules, before any work
@pytest.mark.parametrize("cfg, field", [
    (_cfg(kind="bin"), "data.kind"), (_cfg(vocab_size=300), "data.vocab_size"),
    (_cfg(val_fraction=1.0), "data.val_fraction"), (_cfg(val_fraction=-0.1), "data.val_fraction"),
    (_bin_cfg("t.bin", kind="text"), "data.kind"), (_bin_cfg("t.bin", dtype="int8"), "data.dtype"),
    (_bin_cfg("t.bin", vocab_size=0), "data.vocab_size"), (_bin_cfg("t.bin", vocab_size=65537), "data.vocab_size"),
    (_bin_cfg("t.bin", val_fraction=1.5), "data.val_fraction"), (_bin_cfg(""), "data.path"),
])
def test_each_data_group_validates_its_own_fields(cfg, field):
    with _names(field):
        cfg.validate()


def test_data_group_rules_pass_what_they_should():
    _cfg(val_fraction=0.0).validate()                        # 0: a rule between groups (train.val_every)
    _bin_cfg("t.bin", dtype="uint32", vocab_size=70001).validate()
    _bin_cfg("t.bin", vocab_size=65536).validate()           # every uint16 id
    _bin_cfg("t.bin", val_path="v.bin", val_fraction=2.0).validate()  # not used beside val_path


@pytest.fixture
def bin_file(tmp_path):
    np.arange(200, dtype=np.uint16).tofile(tmp_path / "t.bin")
    return tmp_path / "t.bin"


BIN = ["data=bin", "data.path={bin}", "data.vocab_size=256"]


@pytest.mark.parametrize("overrides, field", [
    (["data.kind=bin"], "data.kind"), (["data.vocab_size=300"], "data.vocab_size"),
    (["data.val_fraction=1"], "data.val_fraction"),
    (["data.val_fraction=0"], "data.val_fraction"),           # validation every 50 steps, nothing held out
    (["data.path={tmp}/nope"], "data.path"), (["data.path={tmp}"], "data.path"),    # no *.py in it
    (BIN + ["data.dtype=int8"], "data.dtype"), (BIN + ["data.vocab_size=0"], "data.vocab_size"),
    (BIN + ["data.vocab_size=1000"], "data.vocab_size"),      # more than model.vocab_size=256
    (BIN + ["data.val_fraction=-1"], "data.val_fraction"), (BIN + ["data.kind=text"], "data.kind"),
    (BIN + ["data.path={tmp}/nope.bin"], "data.path"), (BIN + ["data.val_path={tmp}"], "data.val_path"),
    (["data=bin", "data.path={bin}"], "data.vocab_size"),      # left '???' by configs/data/bin.yaml
    (["data=bin"], "data.path, data.vocab_size"), (BIN + ["data.path="], "data.path"),
])
def test_a_bad_data_config_exits_2_naming_the_field_before_any_work(tmp_path, bin_file, capsys, overrides, field):
    run_dir = tmp_path / "run"
    ov = [o.format(tmp=tmp_path, bin=bin_file) for o in overrides] + [f"run_dir={run_dir}", "logging.mode=disabled"]
    assert main(["--cfg", *ov]) == 2
    out, err = capsys.readouterr()
    assert re.search(rf"^dropless-train: error: {re.escape(field)}", err, re.M) and "kind: " not in out, err
    assert not run_dir.exists()


def test_a_run_refuses_a_bad_data_config_before_its_run_dir(tmp_path, bin_file, capsys):
    run_dir = tmp_path / "run"
    assert main(["data=bin", f"data.path={bin_file}", "data.vocab_size=1000", f"run_dir={run_dir}",
                 "logging.mode=disabled"]) == 2
    assert "\ndropless-train: error: data.vocab_size=1000" in "\n" + capsys.readouterr().err
    assert not run_dir.exists()
    assert main(["data=bin", f"data.path={bin_file}", "data.vocab_size=100", f"run_dir={run_dir}",
                 "logging.mode=disabled", "train.steps=1"]) == 2   # id 199 >= 100: found reading the file
    assert f"\ndropless-train: error: data.path='{bin_file}': token id 100" in "\n" + capsys.readouterr().err


def test_the_data_paths_are_checked_once(tmp_path, bin_file, monkeypatch):
    """check_train_config stats the data's paths once, after the fields' rules (a field left ``???`` is
    named with the others, without a stat); load_tokens trusts it."""
    calls = []
    monkeypatch.setattr(startup, "check_data_config", lambda data: calls.append(data))
    with _names("data.path, data.vocab_size"):
        check_train_config(compose(["data=bin"]))
    assert calls == []
    run = check_train_config(compose(["data=bin", f"data.path={bin_file}", "data.vocab_size=256"]))
    assert calls == [run.data] and isinstance(run.data, BinDataConfig)


def test_data_vocab_larger_than_model_is_an_error(bin_file):
    ov = ["data=bin", f"data.path={bin_file}", "data.vocab_size=1000"]
    with _names("data.vocab_size=1000") as e:
        check_train_config(compose(ov))
    assert "model.vocab_size=256" in str(e.value)
    assert check_train_config(compose(ov + ["model.vocab_size=1000"])).data.vocab_size == 1000


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
    ov = ["data.path=" + str(tmp_path), "data.glob=*.txt", "data.val_fraction=0"]
    with _names("data.val_fraction=0.0"):
        check_train_config(compose(ov))
    run = check_train_config(compose(ov + ["train.val_every=0"]))
    d = load_tokens(run.data)
    assert d.train.tobytes() == b"abcdefghij" * 10 and len(d.val) == 0
    bins = np.arange(50, dtype=np.uint16)
    bins.tofile(tmp_path / "t.bin")
    bin_ov = ["data=bin", f"data.path={tmp_path / 't.bin'}", "data.vocab_size=256", "data.val_fraction=0"]
    with _names("data.val_fraction=0.0"):
        check_train_config(compose(bin_ov))
    check_train_config(compose(bin_ov + [f"data.val_path={tmp_path / 't.bin'}"]))  # validates on val_path
    d = load_tokens(check_train_config(compose(bin_ov + ["train.val_every=0"])).data)
    assert np.array_equal(d.train, bins) and len(d.val) == 0
    d = load_tokens(_bin_cfg(tmp_path / "t.bin", val_fraction=0.1))
    assert np.array_equal(d.train, bins[:45]) and np.array_equal(d.val, bins[45:])  # (0, 1) as before


def test_a_run_that_never_validates_trains_beside_a_split_too_small_to_validate(tmp_path):
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
            with pytest.raises(ConfigError, match="validation split") as e:  # made when asked: val_windows' error
                tr.validate()
            assert "data.val_fraction" in str(e.value)
        finally:
            tr.close()
