"""The router's group-limited top-k on CUDA: the torch reference against the Triton kernel, one JSON line each.

The reference is three torch.topk calls, a scatter and a masked_fill; the kernel is
:mod:`dropless.ops.route_topk`'s one launch.

One JSON line per result (``bench``, ``variant`` = ``torch`` | ``triton``, ``T``, ``E``, ``k``, ``n_group``,
``topk_group``, ``method``, ``block_t``, ``num_warps``, ``us``, ``gbps`` over the bytes the op must move: the
fp32 scores and bias read, the int64 ids written; ``rows_differ``: rows whose ids differ from the reference's,
which only a tie between fp32 values can cause). Both variants include the bias add. Shapes: ``recipe=h200_single``'s
router (T 32,768 tokens, E 64, k 6, 8 groups, 4 kept) and DeepSeek-V3's (E 256, k 8, 8 groups, 4 kept) at the
same T. Times: median of ``--reps`` CUDA-event timings after 10 warm-up calls; ``--flush`` writes 256 MiB
before each call (the scores out of L2; in a training step the sigmoid that makes them has just written them).

``--sweep``: also time the kernel at other rows-per-program (``ELEMS_PER_PROGRAM`` / padded E) and warps.

Usage: ``python benchmarks/route_topk.py [--tokens T] [--reps N] [--flush] [--sweep]``. Needs CUDA and triton.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

CASES = [  # (E, k, n_group, topk_group)
    (64, 6, 8, 4),     # recipe=h200_single
    (256, 8, 8, 4),    # DeepSeek-V3
]


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def timeit(fn, reps: int, flush: bool) -> float:
    """Median microseconds of ``reps`` calls, each between two CUDA events, after 10 warm-up calls."""
    buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if flush else None
    for _ in range(10):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        if buf is not None:
            buf.zero_()
        torch.cuda._sleep(100_000)  # the host queues the call before the device reaches it
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return 1e3 * sorted(a.elapsed_time(b) for a, b in ev)[reps // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768, help="T, tokens per layer (default 32768)")
    p.add_argument("--method", default="noaux_tc", choices=("noaux_tc", "group_limited_greedy", "greedy"))
    p.add_argument("--reps", type=int, default=200, help="timed calls per result (default 200)")
    p.add_argument("--flush", action="store_true", help="flush L2 (write 256 MiB) before each timed call")
    p.add_argument("--sweep", action="store_true", help="also time other rows-per-program and warps")
    args = p.parse_args(argv)

    from dropless.ops import route_topk as rt
    from dropless.ops import select

    if not torch.cuda.is_available() or not select.HAS_TRITON:
        print("route_topk.py: needs CUDA and triton", file=sys.stderr)
        return 2
    launch = [(rt.ELEMS_PER_PROGRAM, rt.NUM_WARPS)]
    if args.sweep:
        launch += [(e, w) for e in (512, 1024, 2048, 4096, 8192) for w in (1, 2, 4, 8)
                   if (e, w) != launch[0] and e // (32 * w) <= 64]  # <= 64 keys a thread
    T = args.tokens
    for E, k, G, kg in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        scores = torch.randn(T, E, device="cuda", generator=g).sigmoid()
        bias = torch.randn(E, device="cuda", generator=g) * 0.01
        ref = rt.group_limited_topk_torch(scores, k, G, kg, args.method, bias)
        gbytes = (T * E * 4 + E * 4 + T * k * 8) / 1e9
        common = dict(bench="route_topk", T=T, E=E, k=k, n_group=G, topk_group=kg, method=args.method)
        us = timeit(lambda: rt.group_limited_topk_torch(scores, k, G, kg, args.method, bias), args.reps, args.flush)
        emit(**common, variant="torch", block_t=None, num_warps=None, us=round(us, 2), gbps=round(gbytes / us * 1e6, 1),
             rows_differ=0)
        for elems, warps in launch:
            rt.ELEMS_PER_PROGRAM, rt.NUM_WARPS = elems, warps
            try:
                block_t = rt.kernel_shape(E, G, args.method)[3]
                got = rt.group_limited_topk(scores, k, G, kg, args.method, bias)
                us = timeit(lambda: rt.group_limited_topk(scores, k, G, kg, args.method, bias), args.reps, args.flush)
            finally:
                rt.ELEMS_PER_PROGRAM, rt.NUM_WARPS = launch[0]
            emit(**common, variant="triton", block_t=block_t, num_warps=warps, us=round(us, 2),
                 gbps=round(gbytes / us * 1e6, 1), rows_differ=int((got != ref).any(dim=1).sum()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
