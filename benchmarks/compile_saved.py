"""Probe (issue 12): what one MoE decoder block saves for backward, eager vs train.compile vs train.compile_moe.

    python benchmarks/compile_saved.py VARIANT          # VARIANT: eager | compile | compile_moe

Builds block 1 of a 2-layer model (env REAL=1: recipes/h200_single's model config with
recompute_gather; else a small one set by env H, I, E, K, G, TG, A, B, S), compiles it as the trainer
does (dropless.train.compile.compile_blocks, inductor), runs forward and backward of the block and
prints: each partition's saved values (inductor's min-cut, with the dropless source line that made
them), the tensors saved_tensors_hooks sees, and on CUDA memory_allocated before / after forward,
after backward and the peaks. CPU: env TRITON_INTERPRET=1 takes the CUDA code path (the Triton
kernels as the same opaque ops, interpreted; the router's bf16 GEMM with fp32 output as an opaque
op); ABORT=1 stops after the first partition (h200_single's shape traced, not run). DT=bf16|fp32,
RG=0|1 (recompute_gather), FOLD=0|1. A probe: it patches inductor's partition function to print.
"""
import os, sys, collections
import torch
from dropless import ModelArgs
from dropless.model.transformer import Transformer
from dropless.train.compile import compile_blocks
from dropless.model.rope import rope_cos_sin

torch.set_num_threads(1)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPUPATH = os.environ.get("TRITON_INTERPRET") == "1" and DEV == "cpu"
if GPUPATH:  # the CUDA code path on CPU tensors: Triton kernels (interpreted) as the custom ops, bf16 router mm
    from dropless.ops import select
    select.FORCE_TRITON = True
    @torch.library.custom_op("probe::mm_f32", mutates_args=())
    def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # stands for torch.mm(out_dtype=fp32) on CUDA
        return a.float() @ b.float()
    mm_f32.register_fake(lambda a, b: a.new_empty(a.shape[0], b.shape[1], dtype=torch.float32))
    import dropless.routing as R
    class _T:  # pretend x is on CUDA for the _Fp32Logits check
        pass
    _orig = R._Fp32Logits.forward
    def fwd(ctx, x_TH, weight_EH):
        ctx.save_for_backward(x_TH, weight_EH)
        if x_TH.dtype == weight_EH.dtype and x_TH.dtype in (torch.bfloat16, torch.float16):
            return mm_f32(x_TH, weight_EH.t())
        return torch.nn.functional.linear(x_TH.float(), weight_EH.float())
    R._Fp32Logits.forward = staticmethod(fwd)
DT = {"bf16": torch.bfloat16, "fp32": torch.float32}[os.environ.get("DT", "bf16")]
B, S = int(os.environ.get("B", 2)), int(os.environ.get("S", 64))
E, K = int(os.environ.get("E", 8)), int(os.environ.get("K", 2))
REAL = os.environ.get("REAL") == "1"
if REAL:
    import dataclasses
    from dropless.train.config import compose, model_args
    args = model_args(compose(["recipe=h200_single"]))
    args = dataclasses.replace(args, num_hidden_layers=2, vocab_size=256,
                               recompute_gather=os.environ.get("RG", "1") == "1",
                               fold_routing_weights=os.environ.get("FOLD", "0") == "1")
    print(args)
else:
  args = ModelArgs(vocab_size=256, hidden_size=int(os.environ.get("H", 96)), intermediate_size=160,
                 moe_intermediate_size=int(os.environ.get("I", 40)), num_hidden_layers=2,
                 first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                 qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=E, n_shared_experts=2, num_experts_per_tok=K,
                 n_group=int(os.environ.get("G", 4)), topk_group=int(os.environ.get("TG", 2)), routed_scaling_factor=2.5,
                 aux_loss_alpha=1e-4, expert_alignment=int(os.environ.get("A", 8)),
                 recompute_gather=os.environ.get("RG", "1") == "1",
                 fold_routing_weights=os.environ.get("FOLD", "0") == "1")
H, T, k = args.hidden_size, B * S, args.num_experts_per_tok

import torch._inductor.compile_fx as _cfx
_orig_part = _cfx.min_cut_rematerialization_partition
def _part(gm, joint_inputs, **kw):
    fw, bw = _orig_part(gm, joint_inputs, **kw)
    n = kw["num_fwd_outputs"]
    global _NPART
    _NPART = globals().get("_NPART", 0) + 1
    if os.environ.get("DUMP"):
        open(f"{os.environ['DUMP']}_{_NPART}_fw.py", "w").write(fw.print_readable(print_output=False))
        open(f"{os.environ['DUMP']}_{_NPART}_bw.py", "w").write(bw.print_readable(print_output=False))
        open(f"{os.environ['DUMP']}_{_NPART}_joint.py", "w").write(gm.print_readable(print_output=False))
    out = next(iter(reversed(fw.graph.nodes)))
    print(f"-- partition: {len(out.args[0]) - n} saved values (fw outputs after the first {n})")
    for v in out.args[0][n:]:
        val = v.meta.get("val") if hasattr(v, "meta") else None
        if not isinstance(val, torch.Tensor):
            continue
        st = (v.meta.get("stack_trace") or "").strip().splitlines()
        where = ""
        for i in range(len(st) - 1, -1, -1):
            if "dropless" in st[i] and "File" in st[i]:
                where = st[i].split("dropless/")[-1].strip() + " | " + (st[i + 1].strip() if i + 1 < len(st) else "")
                break
        nb = val.numel() * val.element_size()
        if nb >= int(os.environ.get("MINB", 0)):
            print(f"   {str(v.target if v.op == 'call_function' else v.op):40s} {tuple(val.shape)} "
                  f"{str(val.dtype).replace('torch.', '')} {nb} B  <- {where}")
    if os.environ.get("ABORT"):
        raise _Abort()
    return fw, bw
class _Abort(Exception):
    pass
_cfx.min_cut_rematerialization_partition = _part

def build():
    torch.manual_seed(0)
    m = Transformer(args)
    m.init_weights() if hasattr(m, "init_weights") else None
    m = m.to(device=DEV, dtype=DT).train()
    return m

def saved(block, x, cos, sin):
    out = []
    def pack(t):
        out.append((tuple(t.shape), str(t.dtype).replace("torch.", ""), t.untyped_storage().data_ptr(), t))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, aux = block(x, cos, sin)
    loss = y.float().square().sum() + aux
    return out, y, aux

def main():
    variant = sys.argv[1]
    m = build()
    if variant != "eager":
        compile_blocks(m, "inductor", moe=variant == "compile_moe")
    block = m.layers["1"]
    cos, sin = rope_cos_sin(S, args.qk_rope_head_dim, args.rope_theta, max_position_embeddings=4096, device=DEV,
                            dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, H, generator=g).to(device=DEV, dtype=DT).requires_grad_()
    cuda = DEV == "cuda"
    gib = lambda b: f"{b / 2**30:.3f} GiB"
    params = {id(p): n for n, p in m.named_parameters()}
    for it in range(2):  # the second call runs the compiled graph as in steady state
        try:
            if it == 1 and cuda:
                torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
                mem0 = torch.cuda.memory_allocated()
            out, y, aux = saved(block, x, cos, sin)
            if it == 0:
                (y.float().square().sum() + aux).backward()  # compiles the backward too
                del out, y, aux
                x.grad = None
                for p in m.parameters():
                    p.grad = None
        except Exception as e:
            if "_Abort" in repr(e) or isinstance(e, _Abort):
                print("aborted after the partition (not run)")
                return
            raise
    seen = set()
    rows = []
    total = 0
    for shape, dt, ptr, t in out:
        name = params.get(id(t)) or ("x (block input)" if t is x else "")
        key = (ptr, shape, dt)
        dup = ptr in seen
        seen.add(ptr)
        nb = t.numel() * t.element_size()
        rows.append((shape, dt, nb, name, dup))
        if not dup and not name:
            total += t.untyped_storage().nbytes()
    print(f"== {variant} gpupath={GPUPATH} dtype={DT} recompute_gather={args.recompute_gather} fold={args.fold_routing_weights} "
          f"T={T} H={H} k={k} I={args.moe_intermediate_size}")
    c = collections.Counter((s, d, nb) for s, d, nb, n, dup in rows if not n and not dup)
    for (s, d, nb), cnt in sorted(c.items(), key=lambda kv: -kv[0][2]):
        print(f"  {cnt} x {s} {d} ({nb} B)")
    print(f"  params saved: {sorted(set(n for *_, n, _ in rows if n))}")
    print(f"  distinct non-param storages: {total} bytes")
    if cuda:
        torch.cuda.synchronize()
        mem1, peak_f = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    import weakref
    pids = {id(p) for p in m.parameters()} | {id(x)}
    refs = [weakref.ref(e[3]) for e in out if id(e[3]) not in pids]
    (y.float().square().sum() + aux).backward()
    del out, y, aux, t
    if cuda:
        torch.cuda.synchronize()
        mem2, peak_b = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        print(f"  cuda: before fwd {gib(mem0)}, after fwd {gib(mem1)} (+{gib(mem1 - mem0)}, fwd peak +{gib(peak_f - mem0)}), "
              f"bwd peak +{gib(peak_b - mem0)} over before-fwd, after bwd +{gib(mem2 - mem0)} (of which parameter and "
              f"input gradients {gib(sum(t.grad.numel() * t.grad.element_size() for t in [x, *m.parameters()] if t.grad is not None))})")
    import gc
    gc.collect()
    kept = {id(r()): r() for r in refs if r() is not None}
    print(f"  saved tensors still alive after backward: {[(tuple(v.shape), str(v.dtype)) for v in kept.values()]}")
    del kept
    from torch._subclasses.fake_tensor import FakeTensor
    live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor)
            and o.device.type != "meta" and o.dim() == 2 and o.shape[0] > T]
    for t in live:
        print("   live", tuple(t.shape), [type(r).__name__ for r in gc.get_referrers(t)][:6])
    print(f"  live 2-D tensors with more than T rows after backward: {[(tuple(t.shape), t.dtype) for t in live]}")

main()
