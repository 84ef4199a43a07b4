"""MoE layer benchmark on one GPU: one JSON line per result.

(a) experts only at DeepSeek-V3's per-rank shape (docs/design.md#a-worked-rank): 4 local experts with live rows
    [21733, 15004, 17982, 10817], H 7168, I 2048, bf16; forward and forward+backward TFLOP/s
    counted on live FLOPs (6·R·H·I forward, 3× that forward+backward).
(b) the whole layer: T 8192, H 7168, I 2048, E 32, k 8, n_group 8, topk_group 4, one shared
    expert, bf16; forward+backward ms, TFLOP/s on live FLOPs (routed + shared + router), peak memory.
The dense bf16 GEMM ceiling is measured in the same run (an 8192×8192×8192 matmul, and one at the
experts' shape).

With ``--gemm fp8`` every measurement runs for bf16 (``torch``), ``fp8`` (its default,
``use_fast_accum`` on) and ``fp8_exact`` (``use_fast_accum`` off) in the same process, each line
tagged ``gemm`` and ``speedup`` over bf16; ``--gemm deep_gemm --alignments 128`` runs bf16,
``fp8`` and ``deep_gemm`` (which needs the deep_gemm package and A = 128) the same way;
``--profile`` adds the experts' per-kernel CUDA time (one line per kernel, top 15). ``--gemm`` also
takes a comma-separated list of backends, each a registered name or ``fp8:wgrad=MODE`` /
``deep_gemm:wgrad=MODE`` (the FP8 backends with that weight gradient, ``Fp8Backend``'s ``wgrad``), the
first one the baseline of ``speedup``. ``--alignments`` applies to (a) and (b).

Usage: ``python benchmarks/moe_layer.py [--gemm torch|fp8|deep_gemm|LIST] [--alignments 1,128] [--quick]
[--profile]``. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def bench(fn, warmup: int = 5, iters: int = 20) -> float:
    """Median milliseconds of ``fn()`` measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def dense_ceiling(m: int, n: int, k: int) -> float:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    return 2 * m * n * k / ms / 1e9


def make_backend(gemm: str):
    """A backend name; ``fp8_exact``: the fp8 backend without ``use_fast_accum``; ``NAME:wgrad=MODE``: the
    ``fp8`` / ``deep_gemm`` backend with that weight gradient (``fp8``, ``fp8_expert``, ``bf16``)."""
    if gemm == "fp8_exact":
        from dropless.ops.fp8_backend import Fp8Backend

        return Fp8Backend(fast_accum=False)
    if ":wgrad=" in gemm:
        name, mode = gemm.split(":wgrad=")
        if name == "deep_gemm":
            from dropless.ops.deep_gemm_backend import DeepGemmBackend

            return DeepGemmBackend(wgrad=mode)
        from dropless.ops.fp8_backend import Fp8Backend

        return Fp8Backend(wgrad=mode)
    return gemm


def base_name(gemm: str) -> str:
    """The registered backend behind a :func:`make_backend` name."""
    return "fp8" if gemm == "fp8_exact" else gemm.split(":")[0]


def build_experts(gemm: str, counts=(21733, 15004, 17982, 10817), H: int = 7168, I: int = 2048, A: int = 1):
    """(forward, forward+backward) closures of the experts alone at DeepSeek-V3's per-rank shape."""
    from dropless.experts import GroupedExperts
    from dropless.layout import ExpertLayout

    layout = ExpertLayout.from_counts(torch.tensor(list(counts), device="cuda"), A, num_rows=sum(counts))
    ex = GroupedExperts(H, I, len(counts), gemm=make_backend(gemm))
    ex.init_weights(0, 0)
    ex = ex.cuda().to(torch.bfloat16)
    x = torch.randn(layout.capacity, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(layout.capacity, H, device="cuda", dtype=torch.bfloat16)
    params = [x, *ex.parameters()]

    def fwd():
        with torch.no_grad():
            ex(x, layout)

    def fwdbwd():
        for p in params:  # fresh gradients each step, as after optimizer.zero_grad(set_to_none=True)
            p.grad = None
        ex(x, layout).backward(gy)

    return fwd, fwdbwd


def build_layer(gemm: str, T: int = 8192, H: int = 7168, I: int = 2048, E: int = 32, k: int = 8, A: int = 1,
                fast_init: bool = False, **extra):
    """The whole-layer forward+backward closure at shape (b)."""
    from dropless import ModelArgs
    from dropless.moe import MoE

    args = ModelArgs(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=k,
                     n_group=8, topk_group=4, n_shared_experts=1, routed_scaling_factor=2.5,
                     aux_loss_alpha=1e-4, expert_alignment=A, gemm=base_name(gemm), **extra)
    moe = MoE(args, 0)
    if gemm != base_name(gemm):
        moe.experts.backend = make_backend(gemm)
    if fast_init:  # the same N(0, initializer_range) weights drawn on the GPU (the CPU draw is slow at this size)
        moe = moe.cuda()
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0.0, args.initializer_range)
            moe.router.e_score_correction_bias.zero_()
    else:
        moe.init_weights(0)
    moe = moe.cuda().to(torch.bfloat16).train()
    x = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16)
    params = [x, *moe.parameters()]

    def fwdbwd():
        for p in params:
            p.grad = None
        moe(x).backward(gy)

    return fwdbwd


def experts_only(gemm: str, counts: list[int], H: int, I: int, A: int, base: dict | None = None) -> dict:
    """Time the experts alone; ``base``: the bf16 line of the same shape, for ``speedup``."""
    fwd, fwdbwd = build_experts(gemm, counts, H, I, A)
    R = sum(counts)
    flops_fwd = 6 * R * H * I
    ms_f = bench(fwd)
    ms_fb = bench(fwdbwd)
    line = dict(bench="experts_only", gemm=gemm, counts=counts, H=H, I=I, alignment=A, rows=R,
                fwd_ms=round(ms_f, 3), fwd_tflops=round(flops_fwd / ms_f / 1e9, 1),
                fwdbwd_ms=round(ms_fb, 3), fwdbwd_tflops=round(3 * flops_fwd / ms_fb / 1e9, 1))
    if base is not None:
        line.update(fwd_speedup=round(base["fwd_ms"] / ms_f, 3), fwdbwd_speedup=round(base["fwdbwd_ms"] / ms_fb, 3))
    emit(**line)
    return line


def profile_experts(gemm: str, counts: list[int], H: int, I: int, A: int) -> None:
    """Per-kernel CUDA time of one experts forward+backward (after warm-up), top 15 kernels."""
    from torch.profiler import ProfilerActivity, profile

    _, fwdbwd = build_experts(gemm, counts, H, I, A)
    for _ in range(3):
        fwdbwd()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwdbwd()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    for name, ms, n in rows[:15]:
        emit(bench="experts_profile", gemm=gemm, alignment=A, kernel=name[:120], calls=n, ms=round(ms, 3),
             share=round(ms / total, 3))


def whole_layer(gemm: str, T: int, H: int, I: int, E: int, k: int, A: int, label: str = "", fast_init: bool = False,
                base: dict | None = None, **extra) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fwdbwd = build_layer(gemm, T, H, I, E, k, A, fast_init=fast_init, **extra)
    fwdbwd()
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwdbwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    ms = bench(fwdbwd, warmup=3, iters=10)
    # live FLOPs: routed rows (T·k) through 3 GEMMs, shared expert (T rows), router (T·E·H)
    fwd = 6 * T * k * H * I + 6 * T * H * I + 2 * T * E * H
    line = dict(bench="whole_layer", label=label, gemm=gemm, T=T, H=H, I=I, E=E, k=k, alignment=A, **extra,
                fwdbwd_ms=round(ms, 3), fwdbwd_tflops=round(3 * fwd / ms / 1e9, 1),
                peak_gib=round(peak / 2**30, 2), resident_before_gib=round(resident / 2**30, 2),
                activation_peak_gib=round((peak - resident) / 2**30, 2))
    if base is not None:
        line.update(speedup=round(base["fwdbwd_ms"] / ms, 3))
    emit(**line)
    return line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gemm", default="torch")
    p.add_argument("--quick", action="store_true", help="smaller shapes (smoke test)")
    p.add_argument("--only", choices=["ceiling", "experts", "layer"], default=None)
    p.add_argument("--alignments", default="1,128", help="expert_alignment values, comma-separated")
    p.add_argument("--label", default="", help="a tag put in every whole_layer line (e.g. old/new)")
    p.add_argument("--fast-init", action="store_true", help="draw the weights on the GPU (not init_weights)")
    p.add_argument("--profile", action="store_true", help="per-kernel CUDA time of the experts (A = 128)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/moe_layer.py needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    H, I = (1024, 512) if a.quick else (7168, 2048)
    counts = [21733, 15004, 17982, 10817]
    if a.only in (None, "ceiling"):
        emit(bench="dense_ceiling", shape="8192x8192x8192", tflops=round(dense_ceiling(8192, 8192, 8192), 1))
        emit(bench="dense_ceiling", shape=f"{sum(counts)}x{2 * I}x{H}",
             tflops=round(dense_ceiling(sum(counts), 2 * I, H), 1))
    gemms = {"fp8": ["torch", "fp8", "fp8_exact"], "deep_gemm": ["torch", "fp8", "deep_gemm"]}.get(
        a.gemm, a.gemm.split(","))  # or a comma-separated list of make_backend names
    if a.only in (None, "experts"):
        for A in map(int, a.alignments.split(",")):
            base = None
            for g in gemms:
                if (g.startswith("deep_gemm") or ":wgrad=fp8" in g) and A != 128:
                    continue  # DeepGEMM's contiguous layout and the FP8 weight gradient need A = 128
                line = experts_only(g, counts, H, I, A, base)
                base = base or line
        if a.profile:
            for g in gemms:
                profile_experts(g, counts, H, I, 128)
    if a.only in (None, "layer"):
        for A in map(int, a.alignments.split(",")):
            base = None
            for g in gemms:
                line = whole_layer(g, 8192, H, I, 32, 8, A, label=a.label, fast_init=a.fast_init, base=base)
                base = base or line
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
