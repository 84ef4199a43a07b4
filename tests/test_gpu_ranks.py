"""Several ranks on one GPU through gloo (``train.dist_backend=gloo``): the distributed CUDA path, checked.

Skipped without CUDA. Every rank is a process on CUDA device ``rank % device_count`` (one GPU: all
on device 0) in a gloo process group, which takes CUDA tensors for all-to-all, all-gather,
reduce-scatter and all-reduce (through pinned host memory).

* gloo itself: each collective the dispatchers and the trainer use, on CUDA tensors (fp32, bf16,
  int64, uneven all-to-all splits), gives the right values.
* The MoE layer on 2 and 4 ranks, bf16 and fp32 (fp32 with ``gemm=loop``: ``grouped_mm`` on CUDA
  takes bf16 only), dispatchers ``a2a``, ``agrs``, ``fsdp`` and ``local`` (data parallel), against one
  ``local`` layer on the whole global batch on the same GPU, dtype and GEMM backend: the output and
  ``dx`` of every rank's slice, and every gradient (router, shared expert, ``w13``, ``w2``; EP shards
  all-gathered, data-parallel parts summed, FSDP2's averages times the world size) within
  ‖got − ref‖ ≤ tol·‖ref‖, tol 1e-5 (fp32) and 2e-2 (bf16: device/METHOD.md's range for bf16
  operands with fp32 accumulation). Scenarios: ``num_token_chunks`` 1 and 4; the memory options
  (``recompute_fc1`` with folded routing weights, ``recompute_gather`` for the dispatchers that gather
  locally, ``recompute_swiglu``); alignment 1 and 8; two experts that no token picks (empty experts)
  and, for a2a and agrs, a router biased so that every token picks rank 0's experts (the other ranks
  receive no row); and a2a/agrs with every collective staged through the host by dropless itself
  (the path for a gloo that refuses CUDA tensors). The expert weights are bit-equal to the reference's.
* Between the ranks (2 ranks, bf16, 4 chunks): the host synchronisations of a forward + backward are
  exactly one per chunk for ``a2a`` (its split sizes, ``dropless/dispatch/a2a.py``) and none for
  ``agrs``, ``fsdp`` and ``local``; and under ``torch.profiler`` the host issues chunk c+1's dispatch
  collectives before chunk c's grouped GEMMs (:func:`benchmarks.gloo_one_gpu.expected_order`).
* Training under torchrun (``device=cuda train.dist_backend=gloo``): 20 steps of the tiny V3-shaped
  model (fp32, ``gemm=loop``) on a text of exactly one global batch (8 windows: every step trains
  on all of them, whatever the rank count), at 2 ranks with each dispatcher and with
  ``train.shard_dense=true``: each step's loss equals one process's within a relative 2e-4; a
  checkpoint written at step 10 by 2 ranks (a2a) resumes at 1 and at 4 ranks to the same losses.
  With NCCL (``train.dist_backend=auto``) two ranks on one GPU stop at start-up with an error naming
  ``train.dist_backend``, before any metric is written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gloo_one_gpu import expected_order
from tests import dist_harness as H
from tests import gpu_rank_workers as W

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {"fp32": 1e-5, "bf16": 2e-2}
#: FP8 dispatch against ``local`` with ``gemm=fp8``: FC1's weight gradient reads the dequantised codes
#: instead of the bf16 rows (the rows never reach the expert's rank), so it differs by e4m3's rounding
#: of the input, at most 2⁻⁴ of each value (tests/test_fp8_dispatch.py); everything else as bf16.
W13_FP8_TOL = 2.0 ** -3
HAS_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
CHUNKS = 4


def _scenarios(world: int) -> list[dict]:
    out = []
    for dt in ("fp32", "bf16"):
        for d in ("a2a", "agrs", "fsdp", "local"):
            gathers = d in ("fsdp", "local")
            out += [
                dict(name=f"{d}-{dt}-A1-c1", dispatcher=d, dtype=dt, alignment=1),
                dict(name=f"{d}-{dt}-A8-c{CHUNKS}-fc1-fold{'-regather' if gathers else ''}", dispatcher=d, dtype=dt,
                     alignment=8, chunks=CHUNKS, opts=dict(recompute_fc1=True, fold_routing_weights=True,
                                                           recompute_gather=gathers),
                     sync_check=world == 2 and dt == "bf16"),
                dict(name=f"{d}-{dt}-A8-c{CHUNKS}-swiglu", dispatcher=d, dtype=dt, alignment=8, chunks=CHUNKS,
                     opts=dict(recompute_swiglu=True), profile=world == 2 and dt == "bf16" and not gathers),
            ]
            if not gathers:
                out += [dict(name=f"{d}-{dt}-A8-c1-rank0only", dispatcher=d, dtype=dt, alignment=8, biased=True),
                        dict(name=f"{d}-{dt}-A1-c{CHUNKS}-hoststaged", dispatcher=d, dtype=dt, alignment=1,
                             chunks=CHUNKS, staged=True)]
    if HAS_FP8:  # FP8 dispatch: a2a / agrs move e4m3 codes + scales (docs/design.md#fp8-dispatch)
        for d in ("a2a", "agrs"):
            out += [dict(name=f"{d}-fp8-A1-c1", dispatcher=d, dtype="bf16", gemm="fp8", alignment=1),
                    dict(name=f"{d}-fp8-A8-c{CHUNKS}", dispatcher=d, dtype="bf16", gemm="fp8", alignment=8,
                         chunks=CHUNKS),
                    dict(name=f"{d}-fp8-A8-c1-rank0only", dispatcher=d, dtype="bf16", gemm="fp8", alignment=8,
                         biased=True)]
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
    assert torch.isfinite(got).all(), "non-finite values"
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def test_gloo_takes_cuda_tensors_for_every_collective_used():
    """all-to-all (uneven splits), all-gather, reduce-scatter and all-reduce on CUDA tensors, 2 gloo ranks."""
    res = H.run_world("tests.gpu_rank_workers:probe_worker", 2, deadline_s=120)
    for rank, got in enumerate(res):
        errors = {k: v for k, v in got.items() if isinstance(v, str)}
        assert not errors, f"rank {rank}: {errors}"
        for dt in ("torch.float32", "torch.bfloat16", "torch.int64"):
            base = [float(i) for i in range(6)]
            assert got[f"all_gather_into_tensor/{dt}"] == base + [v + 100 for v in base]
            assert got[f"all_reduce_sum/{dt}"] == [2 * v + 100 for v in base]
            assert got[f"reduce_scatter_tensor_sum/{dt}"] == [2 * v + 100 for v in base[3 * rank:3 * rank + 3]]
            # rank j sends (j + t) % 3 rows to rank t, its rows in rank order: rank r receives from
            # rank j the (j + r) % 3 rows that start after those j sends to the ranks before r
            want = []
            for j in range(2):
                start = sum((j + t) % 3 for t in range(rank))
                want += [float(start + i + 100 * j) for i in range((j + rank) % 3)]
            assert got[f"all_to_all_single/{dt}"] == want


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def world_results(request):
    world = request.param
    return world, H.run_world("tests.gpu_rank_workers:layer_worker", world, _scenarios(world), pg_timeout_s=120,
                              deadline_s=420)


@pytest.mark.parametrize("sc", _scenarios(4), ids=[s["name"] for s in _scenarios(4)])
def test_layer_on_ranks_sharing_one_gpu_equals_local(world_results, sc):
    world, res = world_results
    ref = res[0][sc["name"]]["ref"]
    tol = TOL[sc["dtype"]]
    for r in range(world):
        got = res[r][sc["name"]]
        sl = slice(r * W.SEQS_PER_RANK, (r + 1) * W.SEQS_PER_RANK)
        where = f"{sc['name']} world={world} rank={r}"
        t = W.SEQS_PER_RANK * W.SEQ_LEN
        assert torch.equal(got["topk"], ref["topk"][r * t:(r + 1) * t]), f"{where}: routing differs"
        assert torch.equal(got["w13"], ref["w13"]) and torch.equal(got["w2"], ref["w2"]), f"{where}: weights"
        errs = {"y": _rel(got["y"], ref["y"][sl]), "dx": _rel(got["x_grad"], ref["x_grad"][sl]),
                "d router": _rel(got["router_grad"], ref["router_grad"]),
                "d w13": _rel(got["w13_grad"], ref["w13_grad"]), "d w2": _rel(got["w2_grad"], ref["w2_grad"])}
        for name, a, b in zip(("w1", "w3", "w2"), got["shared_grads"], ref["shared_grads"]):
            errs[f"d shared.{name}"] = _rel(a, b)
        bad = {k: f"{v:.2e}" for k, v in errs.items()
               if not v <= (W13_FP8_TOL if k == "d w13" and sc.get("gemm") == "fp8" else tol)}
        assert not bad, f"{where}: relative errors above {tol:g}: {bad}"
        for e in ([] if sc.get("biased") else W.EMPTY):  # an expert no token picked: exact zero gradient
            assert (got["w13_grad"][e] == 0).all() and (got["w2_grad"][e] == 0).all(), f"{where}: expert {e}"


@pytest.mark.skipif(not HAS_FP8, reason="FP8 needs compute capability 8.9 or more")
@pytest.mark.parametrize("name", ["a2a", "agrs"])
def test_fp8_dispatch_moves_codes_and_scales_not_rows(world_results, name):
    """Against the same layer in bf16 (same routing): each dispatched row that crosses ranks carries ``H``
    code bytes and a 4-byte fp32 scale instead of ``2·H`` bf16 bytes, and nothing else changes."""
    world, res = world_results
    h, e, t = W.BASE["hidden_size"], W.BASE["n_routed_experts"] // world, W.SEQS_PER_RANK * W.SEQ_LEN
    saved = 2 * h - (h + 4)
    for r in range(world):
        fp8, bf16 = res[r][f"{name}-fp8-A1-c1"], res[r][f"{name}-bf16-A1-c1"]
        assert torch.equal(fp8["topk"], bf16["topk"]), r
        if name == "a2a":  # the rows this rank sends away / receives
            owner = [res[s][f"{name}-fp8-A1-c1"]["topk"] // e for s in range(world)]
            rows_out = int((owner[r] != r).sum())
            rows_in = sum(int((owner[s] == r).sum()) for s in range(world) if s != r)
        else:  # agrs all-gathers every other rank's tokens once
            rows_out, rows_in = t * (world - 1), t * (world - 1)
        want = {"bytes_sent": bf16["fwd_bytes"]["bytes_sent"] - rows_out * saved,
                "bytes_received": bf16["fwd_bytes"]["bytes_received"] - rows_in * saved}
        assert fp8["fwd_bytes"] == want, (name, r, fp8["fwd_bytes"], bf16["fwd_bytes"], want)


@pytest.mark.parametrize("name", ["a2a", "agrs"])
@pytest.mark.parametrize("dt", ["fp32", "bf16"])
def test_ranks_that_receive_no_rows_finish(world_results, name, dt):
    world, res = world_results
    key = f"{name}-{dt}-A8-c1-rank0only"
    t_k = W.SEQS_PER_RANK * W.SEQ_LEN * 2
    assert res[0][key]["rows_live"] == world * t_k
    for r in range(1, world):
        assert res[r][key]["rows_live"] == 0, r


def test_no_host_sync_in_the_layer_but_a2a_split_sizes(world_results):
    world, res = world_results
    if world != 2:
        pytest.skip("checked at 2 ranks")
    for d in ("a2a", "agrs", "fsdp", "local"):
        key = next(k for k in res[0] if k.startswith(f"{d}-bf16-A8-c{CHUNKS}-fc1"))
        for r in range(world):
            syncs = res[r][key]["syncs"]
            want = CHUNKS if d == "a2a" else 0  # a2a: one .tolist() of the split sizes per chunk's dispatch
            assert len(syncs) == want, f"{key} rank {r}: {len(syncs)} host syncs, want {want}: {syncs}"


def test_next_chunk_dispatch_is_issued_before_this_chunk_experts(world_results):
    world, res = world_results
    if world != 2:
        pytest.skip("checked at 2 ranks")
    letters = {"a2a": ("aa", "a"), "agrs": ("ggg", "r")}
    for d, (disp, comb) in letters.items():
        for r in range(world):
            got = res[r][f"{d}-bf16-A8-c{CHUNKS}-swiglu"]["launches"]["order"]
            assert got == expected_order(disp, comb, CHUNKS), (d, r, got)
            # the property itself: before chunk c's first GEMM, chunk c+1's dispatch was issued
            gemm_at = [i for i, ch in enumerate(got) if ch == "M"][::2]
            for c in range(CHUNKS - 1):
                issued = got[:gemm_at[c]].count(disp[0])
                assert issued >= (c + 2) * len(disp), (d, r, c, got)


def test_no_collective_was_staged_by_dropless_on_this_torch(world_results):
    """This torch's gloo takes CUDA tensors for every collective the dispatchers use: nothing fell back."""
    world, res = world_results
    for r in range(world):
        for name, got in res[r].items():
            want = ["a2a", "ag", "rs"] if name.endswith("hoststaged") else []  # those forced by the test
            assert got["host_staged"] == want, (name, r, got["host_staged"])


# ------------------------------------------------------------------ training under torchrun
STEPS, SEQ, WINDOWS = 20, 32, 8  # the text holds exactly WINDOWS windows of SEQ + 1 tokens: one global batch
TRAIN = ["device=cuda", "train.dtype=fp32", "gemm=loop", f"train.seq_len={SEQ}", "train.val_every=0",
         "data.val_fraction=0", "optim.warmup_steps=2", "logging.mode=disabled", "logging.progress=false",
         "model.num_hidden_layers=3", "num_threads=1"]


def _env() -> dict:
    root = Path(__file__).resolve().parents[1]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(root)] + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p]), PYTHONUNBUFFERED="1")


def _text(tmp: Path) -> Path:
    g = torch.Generator().manual_seed(5)
    words = ["expert", "token", "route", "gate", "rank", "chunk", "gloo", "layer", "sum", "mean"]
    out, n = [], WINDOWS * SEQ + 1
    while sum(len(w) + 1 for w in out) < n:
        out.append(words[int(torch.randint(len(words), (1,), generator=g))])
    path = tmp / "corpus.txt"
    path.write_bytes(" ".join(out).encode()[:n])
    return path


def _launch(rd: Path, ranks: int, text: Path, *extra: str) -> subprocess.Popen:
    batch = WINDOWS // ranks
    cmd = [sys.executable, "-m", "dropless.train"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
        "-m", "dropless.train", "train.dist_backend=gloo"]
    cmd += [*TRAIN, f"data.path={text}", f"train.micro_batch_size={batch}", f"run_dir={rd}", *extra]
    rd.parent.mkdir(parents=True, exist_ok=True)
    log = open(rd.parent / f"{rd.name}.log", "w")  # noqa: SIM115 - closed by _finish
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), text=True)


def _finish(procs: dict[str, subprocess.Popen], tmp: Path, timeout: float = 400) -> dict[str, dict[int, float]]:
    out = {}
    for name, p in procs.items():
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            code = "timeout"
        log = (tmp / f"{name}.log").read_text()
        assert code == 0, f"{name}: exit {code}\n{log[-4000:]}"
        recs = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
        out[name] = {r["step"]: r["loss"] for r in recs if "loss" in r}
    return out


def _close(got: dict[int, float], want: dict[int, float], steps, what: str) -> float:
    worst = 0.0
    for s in steps:
        rel = abs(got[s] - want[s]) / abs(want[s])
        worst = max(worst, rel)
        assert rel <= 2e-4, f"{what} step {s}: loss {got[s]} vs one process {want[s]} (rel {rel:.2e})"
    return worst


def test_torchrun_gloo_ranks_on_one_gpu_train_to_one_process_losses(tmp_path):
    text = _text(tmp_path)
    no_ckpt = "train.ckpt_every=0"
    runs = {"one": (1, ["dispatcher=local", no_ckpt]),
            **{f"r2_{d}": (2, [f"dispatcher={d}", no_ckpt]) for d in ("local", "agrs", "fsdp")},
            "r2_a2a": (2, ["dispatcher=a2a", "train.ckpt_every=10", "train.ckpt_keep=0"]),
            "r2_a2a_shard_dense": (2, ["dispatcher=a2a", "train.shard_dense=true", no_ckpt])}
    procs = {n: _launch(tmp_path / n, k, text, f"train.steps={STEPS}", *x) for n, (k, x) in runs.items()}
    losses = _finish(procs, tmp_path)
    ref = losses.pop("one")
    assert sorted(ref) == list(range(1, STEPS + 1)) and ref[STEPS] < ref[1]
    worst = {n: _close(got, ref, range(1, STEPS + 1), n) for n, got in losses.items()}
    # the 2-rank a2a checkpoint of step 10 resumes at 1 rank (local) and at 4 ranks (a2a, EP 4)
    ckpt = tmp_path / "r2_a2a" / "checkpoints" / "step_00000010"
    assert ckpt.is_dir()
    procs = {}
    for name, ranks, disp in (("resume1", 1, "local"), ("resume4", 4, "a2a")):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        shutil.copytree(ckpt, tmp_path / name / "checkpoints" / ckpt.name)
        procs[name] = _launch(tmp_path / name, ranks, text, f"train.steps={STEPS}", "train.ckpt_every=0",
                              f"dispatcher={disp}", "resume=true")
    resumed = _finish(procs, tmp_path)
    for name, got in resumed.items():
        assert sorted(got) == list(range(11, STEPS + 1)), (name, sorted(got))
        worst[name] = _close(got, ref, range(11, STEPS + 1), name)
    print("worst relative loss difference against one process:", {k: f"{v:.1e}" for k, v in worst.items()})


def test_nccl_with_two_ranks_on_one_gpu_is_a_clear_start_up_error(tmp_path):
    if torch.cuda.device_count() >= 2:
        pytest.skip("needs fewer GPUs than ranks")
    text = _text(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "dropless.train", *TRAIN, f"data.path={text}", "train.micro_batch_size=4", "train.steps=2",
           f"run_dir={tmp_path / 'run'}"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode != 0
    assert "train.dist_backend=gloo" in r.stderr and "one GPU per rank" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
