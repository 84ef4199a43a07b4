"""Kernel-level breakdown of the MoE layer's forward+backward (torch.profiler), for tuning.

Usage: ``python -m benchmarks.profile_moe [--gemm torch] [--what experts|layer]
[--set num_token_chunks=4 recompute_fc1=true ...]`` (``--set``: ModelArgs fields for the layer).
Needs CUDA. Prints the top kernels by CUDA time over 3 forward+backward passes.
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
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="ModelArgs fields of the layer (ints, floats, true/false)")
    a = p.parse_args(argv)
    from benchmarks.moe_layer import build_experts, build_layer

    extra = {}
    for item in a.set:
        key, _, val = item.partition("=")
        low = val.lower()
        extra[key] = low == "true" if low in ("true", "false") else (float(val) if "." in val else int(val))
    fn = build_experts(a.gemm)[1] if a.what == "experts" else build_layer(a.gemm, **extra)
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
