"""Probe: what one MoE decoder block saves for backward, eager vs train.compile vs train.compile_moe.

    python benchmarks/compile_saved.py VARIANT          # VARIANT: eager | compile | compile_moe

Builds block 1 of a 2-layer model (env ``REAL=1``: recipes/h200_single's model config; else a small
one set by env ``H I E K G TG A``), tokens ``B x S`` (env), compiles it as the trainer does
(:func:`dropless.train.compile.compile_blocks`, inductor), runs forward and backward twice and
prints for the second: each inductor partition's saved values with the dropless source line that
made them (``MINB``: the smallest printed, bytes), the tensors ``saved_tensors_hooks`` sees,
the saved tensors still alive after backward, and on CUDA the memory before / after forward and
backward and the peaks. Env ``DT=bf16|fp32``, ``RG=0|1`` (recompute_gather), ``FOLD=0|1``.

CPU: ``TRITON_INTERPRET=1`` takes the CUDA code path (the Triton kernels as the same opaque ops,
interpreted; the router's bf16 GEMM with fp32 output as an opaque op, ``probe::mm_f32``);
``ABORT=1`` stops after the first partition (e.g. h200_single's shape traced, not run).
A probe: it wraps inductor's partition function to print its result.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import os
import sys
import weakref

import torch
import torch._inductor.compile_fx as compile_fx
import torch.nn.functional as F

import dropless.routing as routing
from dropless import ModelArgs
from dropless.model.rope import rope_cos_sin
from dropless.model.transformer import Transformer
from dropless.ops import select
from dropless.train.compile import compile_blocks
from dropless.train.config import compose, model_args

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = {"bf16": torch.bfloat16, "fp32": torch.float32}[os.environ.get("DT", "bf16")]
GPUPATH = os.environ.get("TRITON_INTERPRET") == "1" and DEV == "cpu"
B, S = int(os.environ.get("B", 2)), int(os.environ.get("S", 64))
MINB = int(os.environ.get("MINB", 0))


def _env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def model_config() -> ModelArgs:
    """The 2-layer model (layer 1 is the MoE block probed)."""
    flags = dict(recompute_gather=os.environ.get("RG", "1") == "1",
                 fold_routing_weights=os.environ.get("FOLD", "0") == "1")
    if os.environ.get("REAL") == "1":
        return dataclasses.replace(model_args(compose(["recipe=h200_single"])), num_hidden_layers=2,
                                   vocab_size=256, **flags)
    return ModelArgs(vocab_size=256, hidden_size=_env("H", 96), intermediate_size=160,
                     moe_intermediate_size=_env("I", 40), num_hidden_layers=2, first_k_dense_replace=1,
                     num_attention_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                     qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=_env("E", 8), n_shared_experts=2,
                     num_experts_per_tok=_env("K", 2), n_group=_env("G", 4), topk_group=_env("TG", 2),
                     routed_scaling_factor=2.5, aux_loss_alpha=1e-4, expert_alignment=_env("A", 8), **flags)


@torch.library.custom_op("probe::mm_f32", mutates_args=())
def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Stands for CUDA's ``torch.mm(a, b, out_dtype=torch.float32)`` on the CPU (an opaque GEMM)."""
    return a.float() @ b.float()


_mm_f32.register_fake(lambda a, b: a.new_empty(a.shape[0], b.shape[1], dtype=torch.float32))


def _cuda_logits(ctx, x_TH, weight_EH):
    """``_Fp32Logits.forward`` as on CUDA (16-bit operands: a GEMM with fp32 output, no upcast of x)."""
    ctx.save_for_backward(x_TH, weight_EH)
    if x_TH.dtype == weight_EH.dtype and x_TH.dtype in (torch.bfloat16, torch.float16):
        return _mm_f32(x_TH, weight_EH.t())
    return F.linear(x_TH.float(), weight_EH.float())


class _Abort(Exception):
    pass


def _where(node) -> str:
    """The last dropless frame of a node's stack trace, with its source line."""
    st = (node.meta.get("stack_trace") or "").strip().splitlines()
    for i in range(len(st) - 1, -1, -1):
        if "dropless" in st[i] and "File" in st[i]:
            return st[i].split("dropless/")[-1].strip() + " | " + (st[i + 1].strip() if i + 1 < len(st) else "")
    return ""


_partition = compile_fx.min_cut_rematerialization_partition


def _printing_partition(gm, joint_inputs, **kw):
    fw, bw = _partition(gm, joint_inputs, **kw)
    n = kw["num_fwd_outputs"]
    outs = next(iter(reversed(fw.graph.nodes))).args[0]
    print(f"-- partition: {len(outs) - n} saved values (forward outputs after the first {n})")
    for v in outs[n:]:
        val = v.meta.get("val") if hasattr(v, "meta") else None
        if not isinstance(val, torch.Tensor) or val.numel() * val.element_size() < MINB:
            continue
        what = str(v.target) if v.op == "call_function" else v.op
        print(f"   {what:40s} {tuple(val.shape)} {str(val.dtype).replace('torch.', '')} "
              f"{val.numel() * val.element_size()} B  <- {_where(v)}")
    if os.environ.get("ABORT"):
        raise _Abort()
    return fw, bw


def _step(block, x, cos, sin):
    """Forward under a saved-tensor hook: ``(saved tensors, y, aux)``."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, aux = block(x, cos, sin)
    return saved, y, aux


def _gib(b: float) -> str:
    return f"{b / 2**30:.3f} GiB"


def main(variant: str) -> None:
    compile_fx.min_cut_rematerialization_partition = _printing_partition
    if GPUPATH:
        select.FORCE_TRITON = True
        routing._Fp32Logits.forward = staticmethod(_cuda_logits)
    args = model_config()
    torch.manual_seed(0)
    m = Transformer(args)
    m.init_weights()
    m = m.to(device=DEV, dtype=DT).train()
    if variant != "eager":
        compile_blocks(m, "inductor", moe=variant == "compile_moe")
    block = m.layers["1"]
    cos, sin = rope_cos_sin(S, args.qk_rope_head_dim, args.rope_theta, max_position_embeddings=4096, device=DEV)
    x = torch.randn(B, S, args.hidden_size, generator=torch.Generator().manual_seed(1)).to(DEV, DT).requires_grad_()
    names = {id(p): n for n, p in m.named_parameters()} | {id(x): "x (block input)"}
    cuda = DEV == "cuda"
    try:  # the first call compiles forward and backward
        saved, y, aux = _step(block, x, cos, sin)
    except Exception as e:
        if isinstance(e, _Abort) or "_Abort" in repr(e):
            print("aborted after the partition (not run)")
            return
        raise
    (y.float().square().sum() + aux).backward()
    del saved, y, aux
    x.grad = None
    for p in m.parameters():
        p.grad = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        mem0 = torch.cuda.memory_allocated()
    saved, y, aux = _step(block, x, cos, sin)
    if cuda:
        torch.cuda.synchronize()
        mem1, peak_f = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    print(f"== {variant} gpupath={GPUPATH} device={DEV} dtype={DT} recompute_gather={args.recompute_gather} "
          f"fold={args.fold_routing_weights} T={B * S} H={args.hidden_size} k={args.num_experts_per_tok} "
          f"I={args.moe_intermediate_size}")
    seen, count, total = set(), collections.Counter(), 0
    for t in saved:
        ptr = t.untyped_storage().data_ptr()
        if id(t) in names or ptr in seen:
            continue
        seen.add(ptr)
        count[(tuple(t.shape), str(t.dtype).replace("torch.", ""), t.numel() * t.element_size())] += 1
        total += t.untyped_storage().nbytes()
    del t  # the loop's last tensor would stay alive
    for (shape, dt, nb), c in sorted(count.items(), key=lambda kv: -kv[0][2]):
        print(f"  {c} x {shape} {dt} ({nb} B)")
    print(f"  parameters and input saved: {sorted({names[id(t)] for t in saved if id(t) in names})}")
    print(f"  distinct non-parameter storages: {total} bytes")
    refs = [weakref.ref(t) for t in saved if id(t) not in names]
    (y.float().square().sum() + aux).backward()
    del saved, y, aux
    if cuda:
        torch.cuda.synchronize()
        mem2, peak_b = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        grads = sum(t.grad.numel() * t.grad.element_size() for t in [x, *m.parameters()] if t.grad is not None)
        print(f"  cuda: before fwd {_gib(mem0)}, after fwd +{_gib(mem1 - mem0)} (fwd peak +{_gib(peak_f - mem0)}), "
              f"bwd peak +{_gib(peak_b - mem0)}, after bwd +{_gib(mem2 - mem0)} (gradients {_gib(grads)})")
    gc.collect()
    kept = [r() for r in refs if r() is not None]
    print(f"  saved tensors still alive after backward: {[(tuple(t.shape), str(t.dtype)) for t in kept]}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "compile_moe")
