"""Kernel-level breakdown of the MoE layer's forward+backward (torch.profiler), for tuning.

Usage: ``python benchmarks/profile_moe.py [--gemm torch] [--what experts|layer]``. Needs CUDA.
Prints the top kernels by CUDA time and one JSON line per kernel group.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gemm", default="torch")
    p.add_argument("--what", default="layer", choices=["experts", "layer"])
    p.add_argument("--rows", type=int, default=20)
    a = p.parse_args(argv)
    from benchmarks.moe_layer import build_experts, build_layer

    fn = build_experts(a.gemm)[1] if a.what == "experts" else build_layer(a.gemm)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=90))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
