"""MoE memory benchmark on one GPU: one JSON line per result.

For the whole-layer shape of benchmarks/moe_layer.py (T 8192, H 7168, I 2048, E 32, k 8, one shared expert,
bf16, local dispatcher) and every N in ``--chunks`` (default 1 2 4 8), for each memory setting
(``none``; ``swiglu`` = recompute_swiglu + fold; ``fc1`` = recompute_fc1 + fold; ``fc1_gather``
= recompute_fc1 + fold + recompute_gather):

* ``activation_peak_gib``: ``torch.cuda.max_memory_allocated`` over forward+backward minus
  the weights, the input and the gradients that backward leaves (gradients start as None,
  as after ``zero_grad(set_to_none=True)``, so a weight gradient is never a transient copy);
* ``saved_gib``: bytes of the tensors autograd saved for backward in this layer and backward
  read (``torch.autograd.graph.saved_tensors_hooks``, each storage once; parameters and the
  layer input excluded),
  against one copy of the landed rows ``R·H·2`` bytes;
* ``fwdbwd_ms``: median time of forward+backward;
* ``peak_vs_n1`` / ``time_vs_n1``: against N = 1 of the same setting, and ``peak_vs_default`` /
  ``time_vs_default`` against N = 1 without any option (the target: N = 4 at ≤ 0.40 of
  the peak for ≤ 1.05 of the time).

A ``wgrad`` line per chunk count times the chunk's weight-gradient step both ways: torch's
grouped GEMM into a fresh buffer then ``add_`` (what autograd does per chunk), and the Triton
kernel adding in its epilogue (:mod:`dropless.ops.triton_wgrad`).

Usage: ``python benchmarks/moe_memory.py [--chunks 1 2 4 8] [--quick]``. Needs CUDA.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

from benchmarks.moe_layer import bench, emit
from dropless.saved_bytes import SavedBytes

SETTINGS = {"none": dict(), "swiglu": dict(recompute_swiglu=True, fold_routing_weights=True),
            "fc1": dict(recompute_fc1=True, fold_routing_weights=True),
            "fc1_gather": dict(recompute_fc1=True, fold_routing_weights=True, recompute_gather=True)}


def measure(T, H, I, E, k, chunks: int, setting: str, explain: bool = False) -> dict:
    from dropless import ModelArgs
    from dropless.moe import MoE

    args = ModelArgs(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=k,
                     n_group=8, topk_group=4, n_shared_experts=1, routed_scaling_factor=2.5,
                     aux_loss_alpha=1e-4, num_token_chunks=chunks, **SETTINGS[setting])
    moe = MoE(args, 0)
    moe.init_weights(0)
    moe = moe.cuda().to(torch.bfloat16).train()
    x = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16)

    params = list(moe.parameters())

    def step():
        for p in params:  # as after optimizer.zero_grad(set_to_none=True)
            p.grad = None
        moe(x).backward(gy)

    step()
    torch.cuda.synchronize()
    for p in params:
        p.grad = None
    with SavedBytes([*params, x]) as sb:
        y = moe(x)
    y.backward(gy)
    del y
    saved = sb.total()
    del sb  # it holds every saved tensor: free them before measuring the peak
    for p in params:
        p.grad = None
    x.grad = None
    gc.collect()  # garbage of earlier measurements freed during the step would make the peak read low
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()  # weights and the input, no gradients
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params) + x.grad.numel() * x.grad.element_size()
    peak = torch.cuda.max_memory_allocated() - base - grads  # above weights and their gradients
    ms = bench(step, warmup=2, iters=7)
    owners = explain_peak(step) if explain else None
    rows = T * k
    moe = x = gy = None  # free them (the closure above holds the names)
    return dict(**({"peak_owners_mib": owners} if owners else {}),
                bench="moe_memory", T=T, H=H, I=I, E=E, k=k, chunks=chunks, setting=setting,
                activation_peak_gib=round(peak / 2**30, 3), saved_gib=round(saved / 2**30, 3),
                landed_rows_gib=round(rows * H * 2 / 2**30, 3), fwdbwd_ms=round(ms, 3))


def explain_peak(step, top: int = 10) -> list:
    """The allocations alive at the peak of one ``step()`` (largest first): ``[MiB, where]``.

    Replays ``torch.cuda.memory``'s allocation trace of the step (allocations made before it,
    the weights, are not in it); ``where`` is the innermost frame in dropless or torch.autograd.
    """
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live, cur, peak, at_peak = {}, 0, 0, {}
    for ev in snap["device_traces"][torch.cuda.current_device()]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]

    def where(ev):
        for f in ev.get("frames", []):
            if "/dropless/" in f["filename"] or "benchmarks" in f["filename"]:
                return f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}"
        return "?"

    owners = sorted(at_peak.values(), key=lambda e: -e["size"])[:top]
    return [[round(peak / 2**20, 1), "total"]] + [[round(e["size"] / 2**20, 1), where(e)] for e in owners]


def wgrad_step(T, H, I, E, k, chunks: int) -> None:
    """One chunk's weight gradients (FC1 ``[E, H, 2I]``, FC2 ``[E, I, H]``): torch's grouped GEMM
    into a fresh buffer (+ ``add_``, as autograd accumulates) vs the accumulating Triton kernel."""
    from dropless.layout import ExpertLayout
    from dropless.ops import get_backend
    from dropless.ops.triton_wgrad import grouped_wgrad_

    rows = T * k // chunks
    counts = torch.full((E,), rows // E, device="cuda")
    lay = ExpertLayout.from_counts(counts, 1, capacity=rows)
    be = get_backend("torch")
    for K, N in ((H, 2 * I), (I, H)):
        x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(rows, N, device="cuda", dtype=torch.bfloat16)
        dw = torch.zeros(E, K, N, device="cuda", dtype=torch.bfloat16)
        t_add = bench(lambda: dw.add_(be.gmm_wgrad(x, dy, lay)), warmup=3, iters=10)
        t_fresh = bench(lambda: be.gmm_wgrad(x, dy, lay), warmup=3, iters=10)
        t_acc = bench(lambda: grouped_wgrad_(dw, x, dy, lay, accumulate=True), warmup=3, iters=10)
        ref = torch.zeros_like(dw, dtype=torch.float32)
        grouped_wgrad_(ref, x, dy, lay, accumulate=False)
        err = ((ref - be.gmm_wgrad(x, dy, lay).float()).norm() / ref.norm()).item()
        flop = 2 * rows * K * N
        emit(bench="wgrad", chunks=chunks, rows=rows, E=E, K=K, N=N,
             torch_fresh_ms=round(t_fresh, 3), torch_fresh_plus_add_ms=round(t_add, 3),
             triton_accumulate_ms=round(t_acc, 3), triton_tflops=round(flop / t_acc / 1e9, 1),
             torch_tflops=round(flop / t_fresh / 1e9, 1), rel_err_vs_torch=float(f"{err:.2e}"))
        x = dy = dw = ref = None  # free them (the lambdas above hold the names)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--explain", action="store_true", help="list the allocations alive at each peak")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/moe_memory.py needs a CUDA device", file=sys.stderr)
        return 2
    T, H, I = (2048, 1024, 512) if a.quick else (8192, 7168, 2048)
    for n in a.chunks:
        if n > 1:
            wgrad_step(T, H, I, 32, 8, n)
    base = None
    for setting in a.settings:
        first = None
        for n in a.chunks:
            r = measure(T, H, I, 32, 8, n, setting, a.explain)
            first = first or r
            base = base or r
            r.update(peak_vs_n1=round(r["activation_peak_gib"] / first["activation_peak_gib"], 3),
                     time_vs_n1=round(r["fwdbwd_ms"] / first["fwdbwd_ms"], 3),
                     peak_vs_default=round(r["activation_peak_gib"] / base["activation_peak_gib"], 3),
                     time_vs_default=round(r["fwdbwd_ms"] / base["fwdbwd_ms"], 3))
            emit(**r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
