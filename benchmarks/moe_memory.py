"""MoE memory benchmark on one GPU (issue 6): one JSON line per result.

For the whole-layer shape of issue 2 (T 8192, H 7168, I 2048, E 32, k 8, one shared expert,
bf16) and every N in ``--chunks`` (default 1 2 4 8), with and without selective recompute:

* ``activation_peak_gib``: ``torch.cuda.max_memory_allocated`` over forward+backward minus
  the weights, the input and the gradients that backward leaves (gradients start as None,
  as after ``zero_grad(set_to_none=True)``, so a weight gradient is never a transient copy);
* ``saved_gib``: bytes of the tensors autograd saved for backward in this layer
  (``torch.autograd.graph.saved_tensors_hooks``, each storage once; parameters and the layer
  input excluded),
  against one copy of the landed rows ``R·H·2`` bytes;
* ``fwdbwd_ms``: median time of forward+backward.

Usage: ``python benchmarks/moe_memory.py [--chunks 1 2 4 8] [--quick]``. Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.moe_layer import bench, emit


def measure(T, H, I, E, k, chunks: int, recompute: str, fold: bool) -> None:
    from dropless import ModelArgs
    from dropless.moe import MoE

    args = ModelArgs(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=k,
                     n_group=8, topk_group=4, n_shared_experts=1, routed_scaling_factor=2.5,
                     aux_loss_alpha=1e-4, num_token_chunks=chunks, fold_routing_weights=fold,
                     recompute_swiglu=recompute in ("swiglu", "fc1"), recompute_fc1=recompute == "fc1")
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
    skip = {p.untyped_storage().data_ptr() for p in params} | {x.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip and t.device.type == "cuda":
            seen[st.data_ptr()] = st.nbytes()
        return t

    for p in params:
        p.grad = None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = moe(x)
    y.backward(gy)
    del y
    saved = [sum(seen.values())]
    for p in params:
        p.grad = None
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()  # weights and the input, no gradients
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params) + x.grad.numel() * x.grad.element_size()
    peak = torch.cuda.max_memory_allocated() - base - grads  # above weights and their gradients
    ms = bench(step, warmup=2, iters=7)
    rows = T * k
    emit(bench="moe_memory", T=T, H=H, I=I, E=E, k=k, chunks=chunks, recompute=recompute, fold_weights=fold,
         activation_peak_gib=round(peak / 2**30, 3), saved_gib=round(saved[0] / 2**30, 3),
         landed_rows_gib=round(rows * H * 2 / 2**30, 3), fwdbwd_ms=round(ms, 3))
    del moe, x, gy


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/moe_memory.py needs a CUDA device", file=sys.stderr)
        return 2
    T, H, I = (2048, 1024, 512) if a.quick else (8192, 7168, 2048)
    for recompute, fold in (("none", False), ("swiglu", True), ("fc1", True)):
        for n in a.chunks:
            measure(T, H, I, 32, 8, n, recompute, fold)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
