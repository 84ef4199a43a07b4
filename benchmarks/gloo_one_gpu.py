"""The MoE layer on 2 ranks that share ONE GPU through gloo (``train.dist_backend=gloo``): one JSON line each.

These are one-GPU gloo figures, never NCCL figures: gloo copies every CUDA tensor of a collective
to host memory, moves it over local TCP and copies it back, and both ranks share one GPU's
compute. They say what the several-ranks-per-GPU mode costs (testing, debugging), not what
expert parallelism costs on a real interconnect.

For each dispatcher (``local`` data-parallel, ``a2a``, ``agrs``, ``fsdp``): forward + backward of
one bf16 layer (T tokens per rank, H, I, E, k below; ``gemm=torch``), median wall milliseconds of
``--iters`` steps after ``--warmup`` (a barrier, then CUDA synchronised before and after each step,
timed on the host clock: with gloo the host takes part in every collective, so CUDA events alone
would miss it), and ``collective_share``: the host time spent issuing and waiting on the
collectives (every ``torch.distributed`` collective call and ``Work.wait``, timed by wrappers)
over the step's wall time — the part of the step the collectives hold the host. Rank 0 prints.

``--trace PATH`` also writes the launch order of one forward's collectives and grouped GEMMs
under ``torch.profiler`` (``num_token_chunks=4``, a2a and agrs): :func:`launch_order`.

``--device cpu`` runs the same on CPU ranks (gloo on the CPU; ``gemm=torch`` in fp32 there): a check of
the launch order and of this script without a GPU; its timings are CPU figures.

Usage: ``python -m benchmarks.gloo_one_gpu [--tokens 4096] [--iters 10] [--trace FILE] [--commit SHA]
[--device cuda|cpu]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.stamp import detect_commit, detect_gpu

#: c10d operators of the collectives and the letter each gets in :func:`launch_order`'s string
COLLECTIVE_LETTERS = (("alltoall", "a"), ("allgather", "g"), ("reduce_scatter", "r"), ("allreduce", "s"))
GEMM_OPS = ("aten::_grouped_mm",)


def launch_order(events: Any) -> dict:
    """The order in which the host issued collectives and grouped GEMMs, from profiler events.

    Args:
        events: ``torch.profiler.profile(...).events()`` (FunctionEvents: ``name``, ``time_range``).
    Returns:
        ``{"order": str, "events": [(µs from the first, name), ...]}``: one letter per launch in
        host order: ``a`` all-to-all, ``g`` all-gather, ``r`` reduce-scatter, ``s`` all-reduce
        (``c10d::`` operators), ``M`` a grouped GEMM (``aten::_grouped_mm``). An operator nested
        inside one already taken (same letter, inside its time range) is not counted again.
    """
    picked = []
    for ev in events:
        name = ev.name
        letter = None
        if name.startswith("c10d::"):
            letter = next((lt for key, lt in COLLECTIVE_LETTERS if key in name), None)
        elif name in GEMM_OPS:
            letter = "M"
        if letter is not None:
            picked.append((ev.time_range.start, ev.time_range.end, letter, name))
    picked.sort()
    kept: list[tuple] = []
    for ev in picked:
        if kept and ev[2] == kept[-1][2] and ev[1] <= kept[-1][1]:
            continue  # nested in the previous one
        kept.append(ev)
    t0 = kept[0][0] if kept else 0.0
    return {"order": "".join(e[2] for e in kept), "events": [(round(e[0] - t0, 1), e[3]) for e in kept]}


def expected_order(dispatch: str, combine: str, chunks: int) -> str:
    """The order :meth:`dropless.moe.MoE._routed` issues: chunk c+1's dispatch before chunk c's GEMMs.

    ``dispatch``/``combine``: the letters of one chunk's dispatch and combine collectives
    (``"aa"``/``"a"`` for a2a, ``"ggg"``/``"r"`` for agrs); each chunk runs two grouped GEMMs (FC1, FC2).
    """
    out = dispatch
    for c in range(chunks):
        out += (dispatch if c + 1 < chunks else "") + "MM" + combine
    return out


# ------------------------------------------------------------------ timing the collectives
class _Clock:
    """Host seconds inside collective calls and waits (one thread's nesting counted once)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = threading.local()

    def timed(self, fn):
        def run(*a, **k):
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._depth.n = depth
                if depth == 0:
                    self.seconds += time.perf_counter() - t
        return run


def _time_collectives(clock: _Clock) -> bool:
    """Time every collective call of ``torch.distributed`` (and the dispatchers' bound ones) and
    every ``Work.wait`` from Python (FSDP2's too). Returns whether ``Work.wait`` could be wrapped."""
    from dropless.dispatch import collectives as C

    for name in ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
                 "reduce_scatter_single", "all_reduce"):
        if hasattr(dist, name):
            setattr(dist, name, clock.timed(getattr(dist, name)))
    C._all_gather, C._reduce_scatter = clock.timed(C._all_gather), clock.timed(C._reduce_scatter)
    work_cls = dist.distributed_c10d.Work
    try:
        work_cls.wait = clock.timed(work_cls.wait)
    except (TypeError, AttributeError):
        return False
    return True


# ------------------------------------------------------------------ the ranks
def _layer(name: str, args, mesh_ep, mesh_dp, device, dtype):
    from dropless.dispatch import build_dispatcher
    from dropless.moe import MoE
    from dropless.train.shard import apply_fsdp

    disp = build_dispatcher(name, args, None if name in ("local", "fsdp") else mesh_ep)
    moe = MoE(args, 1, disp)
    moe.init_weights()
    moe = moe.to(device=device, dtype=dtype)
    if name == "fsdp":
        apply_fsdp(moe, mesh_dp)
    return moe


def _rank(rank: int, world: int, port: int, opts: dict, out_path: str) -> None:
    from dropless.config import ModelArgs
    from dropless.dispatch.mesh import build_mesh

    cuda = opts["device"] == "cuda"
    torch.set_num_threads(4 if cuda else 1)
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # grouped_mm on CUDA takes bf16
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    clock = _Clock()
    waits_timed = _time_collectives(clock)
    mesh_ep, mesh_dp = build_mesh(world, world, device.type), build_mesh(world, 1, device.type)
    shape = dict(hidden_size=opts["hidden"], moe_intermediate_size=opts["inter"], n_routed_experts=opts["experts"],
                 num_experts_per_tok=opts["k"], n_group=4, topk_group=2, n_shared_experts=1, aux_loss_alpha=0.0,
                 gemm="torch")
    lines = []
    g = torch.Generator().manual_seed(100 + rank)
    x0 = torch.randn(opts["tokens"], opts["hidden"], generator=g).to(device, dtype)
    dy = torch.randn(opts["tokens"], opts["hidden"], generator=g).to(device, dtype)
    for name in ("local", "a2a", "agrs", "fsdp"):
        try:
            moe = _layer(name, ModelArgs(**shape), mesh_ep, mesh_dp, device, dtype)
            wall, coll = [], []
            for i in range(opts["warmup"] + opts["iters"]):
                x = x0.clone().requires_grad_()
                dist.barrier()
                sync()
                c0, t0 = clock.seconds, time.perf_counter()
                moe(x).backward(dy)
                sync()
                t1 = time.perf_counter()
                if i >= opts["warmup"]:
                    wall.append(t1 - t0)
                    coll.append(clock.seconds - c0)
            ms = statistics.median(wall) * 1e3
            share = statistics.median(c / w for c, w in zip(coll, wall))
            lines.append(dict(dispatcher=name, fwd_bwd_ms=round(ms, 3), collective_share=round(share, 3),
                              collective_ms=round(statistics.median(coll) * 1e3, 3), waits_timed=waits_timed))
        except Exception as err:  # noqa: BLE001 - one dispatcher's failure is a line, not the end
            lines.append(dict(dispatcher=name, error=str(err).splitlines()[0][:300]))
        dist.barrier()
    trace = []
    if opts["trace"]:
        for name, disp_letters, comb in (("a2a", "aa", "a"), ("agrs", "ggg", "r")):
            from torch.profiler import ProfilerActivity, profile

            moe = _layer(name, ModelArgs(**shape, num_token_chunks=4), mesh_ep, mesh_dp, device, dtype)
            moe(x0.clone().requires_grad_()).backward(dy)  # warm-up
            sync()
            dist.barrier()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                moe(x0.clone().requires_grad_())
                sync()
            got = launch_order(prof.events())
            trace.append(dict(dispatcher=name, chunks=4, order=got["order"],
                              expected=expected_order(disp_letters, comb, 4), events=got["events"]))
            dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(dict(lines=lines, trace=trace), f)
    dist.barrier()
    os._exit(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--trace", default=None, help="write the chunk launch order here (text)")
    p.add_argument("--commit", default=None)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gloo_one_gpu.py needs CUDA (or --device cpu)")
    opts = dict(tokens=a.tokens, hidden=a.hidden, inter=a.inter, experts=a.experts, k=a.k, warmup=a.warmup,
                iters=a.iters, trace=bool(a.trace), device=a.device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.json")
        mp.start_processes(_rank, args=(2, port, opts, out_path), nprocs=2, start_method="spawn")
        with open(out_path) as f:
            res = json.load(f)
    cuda = a.device == "cuda"
    head = dict(bench="moe_layer_gloo_one_gpu" if cuda else "moe_layer_gloo_cpu",
                note=("one-GPU gloo figures (2 ranks share one GPU), not NCCL" if cuda else
                      "CPU gloo ranks (a check of the script and the launch order), not GPU figures"),
                date=datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
                commit=a.commit or detect_commit(),
                gpu=detect_gpu() if cuda else "CPU", torch=torch.__version__, ranks=2,
                dtype="bf16" if cuda else "fp32",
                tokens_per_rank=a.tokens, hidden=a.hidden, moe_inter=a.inter, experts=a.experts, k=a.k)
    for line in res["lines"]:
        print(json.dumps({**head, **line}), flush=True)
    if a.trace:
        with open(a.trace, "w") as f:
            where = f"2 gloo ranks on one GPU ({head['gpu']}" if cuda else "2 gloo ranks on the CPU (no GPU"
            cmd = " ".join(sys.argv[1:] if argv is None else argv)
            f.write(f"# launch order of one MoE forward, num_token_chunks=4, {where}, torch {head['torch']}, "
                    f"commit {head['commit']}, {head['date']}; python -m benchmarks.gloo_one_gpu {cmd}); "
                    "letters: a all-to-all, g all-gather, r reduce-scatter, M grouped GEMM (host launch order, "
                    "torch.profiler)\n")
            for t in res["trace"]:
                f.write(f"{t['dispatcher']}: order    {t['order']}\n{t['dispatcher']}: expected {t['expected']}\n")
                for us, name in t["events"]:
                    f.write(f"  {us:>10.1f} us  {name}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
