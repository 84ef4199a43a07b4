"""The experts' grouped GEMMs one by one, at a training recipe's shape: one JSON line per result.

At ``recipe=h200_single``'s MoE shape (by default: 64 local experts, T·k = 32,768 × 6 = 196,608
rows spread over the experts with a seeded log-normal imbalance, A = 128; FC1 ``H 1024 -> 2I 1024``,
FC2 ``I 512 -> H 1024``) it times, with CUDA events (median), each GEMM that one MoE layer's
forward + backward runs, in the ways it can be run:

``fwd``            ``torch`` backend ``gmm(x, w)`` (what the layer runs)
``dgrad``          ``gmm(dy, w.transpose(1, 2))``: the transposed view (what the layer runs)
``dgrad_wT``       the same on a contiguous transposed copy of ``w`` (the copy not timed)
``wgrad``          ``TorchBackend.gmm_wgrad`` (what the layer runs: the Triton kernel where
                   ``torch_backend.wgrad_by_triton`` says so, else gap rows zeroed, ``grouped_mm(x^T, dy)``,
                   empty experts zeroed; ``by_triton`` says which)
``wgrad_mm``       ``grouped_mm(x^T, dy)`` alone
``zero_gaps``      the two ``zero_gap_rows_`` calls of ``wgrad`` alone (no GEMM; ``rel_err`` 0)
``zero_empty``     its ``zero_empty_experts_`` alone (no GEMM; ``rel_err`` 0)
``wgrad_T``        ``grouped_mm(dy^T, x)``: ``dW^T [e, N, K]`` (the other operand order)
``wgrad_triton``   :func:`dropless.ops.triton_wgrad.grouped_wgrad_` into a bf16 ``dW``
``wgrad_triton_f32acc``  the same, accumulating into an fp32 ``dW`` (``beta = 1``: a main gradient)

Each line: ``gemm`` (fc1/fc2), ``op``, ``ms``, ``tflops`` (live FLOPs ``2·R·K·N``), ``rel_err``
against the line's reference (the layer's own op, in fp32); ``wgrad_mm`` also ``out_contiguous``
(whether ``grouped_mm`` wrote ``dW`` contiguous, else ``wgrad`` copies it). Usage::

    python -m benchmarks.grouped_gemm [--experts 64] [--rows 196608] [--hidden 1024] [--inter 512] [--align 128]
                                      [--sigma 0.3]

``--sigma``: the spread of the experts' row counts (log-normal; 0.3 keeps the largest expert near
2.3x the mean, 1.6 gives one expert about a third of the rows, as a router does early in training).

Needs CUDA (bf16 ``grouped_mm``).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.moe_layer import bench  # median ms of CUDA-event timings


def counts_for(rows: int, experts: int, seed: int = 0, sigma: float = 0.3) -> list[int]:
    """``experts`` row counts summing to ``rows``: log-normal shares (``sigma``), seeded."""
    g = torch.Generator().manual_seed(seed)
    w = torch.exp(sigma * torch.randn(experts, generator=g, dtype=torch.float64))
    c = torch.floor(w / w.sum() * rows).long()
    c[: rows - int(c.sum())] += 1
    return c.tolist()


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.float(), ref.float()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def run(experts: int, rows: int, hidden: int, inter: int, align: int, device: str = "cuda", timed: bool = True,
        dtype: torch.dtype = torch.bfloat16, sigma: float = 0.3) -> list[dict]:
    """The records (see the module doc); ``device="cpu"``, ``timed=False``, fp32 under ``TRITON_INTERPRET=1``
    checks the arithmetic without a GPU."""
    from dropless.layout import ExpertLayout
    from dropless.ops import triton_wgrad
    from dropless.ops.torch_backend import TorchBackend, _grouped_mm, wgrad_by_triton
    from dropless.ops.zero_fill import zero_empty_experts_, zero_gap_rows_

    counts = counts_for(rows, experts, sigma=sigma)
    layout = ExpertLayout.from_counts(torch.tensor(counts, device=device), align, num_rows=rows)
    M = layout.capacity
    be = TorchBackend()
    out = []
    for gemm, K, N in (("fc1", hidden, 2 * inter), ("fc2", inter, hidden)):
        flops = 2.0 * rows * K * N
        x = torch.randn(M, K, device=device, dtype=dtype)
        dy = torch.randn(M, N, device=device, dtype=dtype)
        w = torch.randn(experts, K, N, device=device, dtype=dtype) / K ** 0.5
        wT = w.transpose(1, 2).contiguous()
        live = torch.zeros(M, dtype=torch.bool, device=device)
        for s, e in zip(layout.start.tolist(), layout.end.tolist()):
            live[s:e] = True
        y_ref = be.gmm(x, w, layout)
        dx_ref = be.gmm(dy, w.transpose(1, 2), layout)
        dw_ref = be.gmm_wgrad(x, dy, layout)
        dw16 = torch.empty_like(w)
        mm_contig = _grouped_mm(x.t(), dy, layout.end).is_contiguous()
        dw32 = torch.zeros(w.shape, device=device, dtype=torch.float32)
        ops = {
            "fwd": (lambda: be.gmm(x, w, layout), y_ref, live),
            "dgrad": (lambda: be.gmm(dy, w.transpose(1, 2), layout), dx_ref, live),
            "dgrad_wT": (lambda: be.gmm(dy, wT, layout), dx_ref, live),
            "wgrad": (lambda: be.gmm_wgrad(x, dy, layout), dw_ref, None),
            "wgrad_mm": (lambda: _grouped_mm(x.t(), dy, layout.end), dw_ref, None),
            "zero_gaps": (lambda: (zero_gap_rows_(x, layout), zero_gap_rows_(dy, layout))[1], dy, None),
            "zero_empty": (lambda: zero_empty_experts_(dw16, layout.counts), dw16, None),
            "wgrad_T": (lambda: _grouped_mm(dy.t(), x, layout.end).transpose(1, 2), dw_ref, None),
            "wgrad_triton": (lambda: triton_wgrad.grouped_wgrad_(dw16, x, dy, layout, accumulate=False), dw_ref,
                             None),
        }
        for op, (fn, ref, mask) in ops.items():
            got = fn()
            err = rel_err(got[mask], ref[mask]) if mask is not None else rel_err(got, ref)
            ms = bench(fn, iters=30) if timed else float("nan")
            out.append({"bench": "grouped_gemm", "gemm": gemm, "op": op, "experts": experts, "rows": rows,
                        "K": K, "N": N, "align": align, "sigma": sigma, "max_rows": max(counts), "ms": round(ms, 4),
                        "tflops": round(flops / ms / 1e9, 1), "rel_err": err,
                        **({"out_contiguous": mm_contig} if op == "wgrad_mm" else {}),
                        **({"by_triton": wgrad_by_triton(x, N)} if op == "wgrad" else {})})
        dw32.zero_()
        triton_wgrad.grouped_wgrad_(dw32, x, dy, layout, accumulate=True)
        err = rel_err(dw32, dw_ref)
        acc = lambda: triton_wgrad.grouped_wgrad_(dw32, x, dy, layout, accumulate=True)  # noqa: E731
        ms = bench(acc, iters=30) if timed else float("nan")
        out.append({"bench": "grouped_gemm", "gemm": gemm, "op": "wgrad_triton_f32acc", "experts": experts,
                    "rows": rows, "K": K, "N": N, "align": align, "sigma": sigma, "max_rows": max(counts),
                    "ms": round(ms, 4),
                    "tflops": round(flops / ms / 1e9, 1), "rel_err": err})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--rows", type=int, default=32768 * 6)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--align", type=int, default=128)
    p.add_argument("--sigma", type=float, nargs="+", default=[0.3],
                   help="log-normal spread of the experts' row counts (several: one run each)")
    a = p.parse_args(argv)
    bad = [x for x in a.sigma if not (0.0 <= x < float("inf"))]
    if bad:
        p.error(f"--sigma must be finite and >= 0 (the log-normal spread of the counts), got {bad}")
    if not torch.cuda.is_available():
        print("benchmarks.grouped_gemm needs CUDA", file=sys.stderr)
        return 2
    for sigma in a.sigma:
        for rec in run(a.experts, a.rows, a.hidden, a.inter, a.align, sigma=sigma):
            print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
