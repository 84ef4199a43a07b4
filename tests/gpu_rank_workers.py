"""Workers of ``tests/test_gpu_ranks.py``: the MoE layer on several ranks that share one GPU (gloo).

Run by :func:`tests.dist_harness.run_world` (``"tests.gpu_rank_workers:layer_worker"``), which
starts a gloo process group per rank; every rank works on CUDA device ``rank % device_count``
(one GPU: all on device 0), as ``train.dist_backend=gloo`` places them.

Each scenario builds the layer with its dispatcher on this rank's slice of one global batch,
runs forward and backward of ``Σ y·G``, and returns CPU copies of the output, ``dx`` and every
gradient (expert shards all-gathered; data-parallel partial gradients summed over the ranks;
FSDP2 gradients, averaged over dp, times the world size). Rank 0 also runs the reference: one
``local`` layer on the whole global batch, on the same GPU, dtype and grouped-GEMM backend.
Optional per scenario: host-synchronisation count of a second forward + backward
(``sync_check``) and the launch order of the collectives and grouped GEMMs of a forward
under ``torch.profiler`` (``profile``).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from benchmarks.gloo_one_gpu import launch_order
from dropless.config import ModelArgs
from dropless.dispatch import build_dispatcher
from dropless.dispatch import collectives as C
from dropless.dispatch.mesh import build_mesh
from dropless.moe import MoE
from dropless.ops.fp8_backend import Fp8Backend
from dropless.train.shard import apply_fsdp

# a small DeepSeek-V3-shaped MoE: E=8, k=2, 4 groups keep 2, one shared expert; H, I multiples of 16
BASE = dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
            topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, aux_loss_alpha=0.0, seed=3)
SEQS_PER_RANK, SEQ_LEN = 2, 24
LAYER_ID = 1
EMPTY = (3, 6)  # experts pushed out of every top-k (empty experts)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GEMM = {"fp32": "loop", "bf16": "torch"}  # grouped_mm on CUDA takes bf16 only
SYNC_WARNING = "synchronizing CUDA operation"


def model_args(dtype: str, **over) -> ModelArgs:
    d = dict(BASE, gemm=GEMM[dtype])
    d.update(over)
    return ModelArgs(**d)


def global_batch(world: int, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 CPU ``X [W·B, S, H]`` and cotangent ``G`` (rank r owns sequences r·B … r·B+B-1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * SEQS_PER_RANK, SEQ_LEN, BASE["hidden_size"], generator=g)
    return x, torch.randn(x.shape, generator=g)


def _prepare(moe: MoE, world: int, sc: dict) -> None:
    with torch.no_grad():
        bias = moe.router.e_score_correction_bias
        if sc.get("biased"):  # every token picks rank 0's experts: the other ranks receive no row
            bias[:moe.args.n_routed_experts // world] += 10.0
        else:
            for e in EMPTY:
                bias[e] = -100.0


def _layer(args: ModelArgs, disp, world: int, sc: dict, device: torch.device, dtype: torch.dtype) -> MoE:
    moe = MoE(args, LAYER_ID, disp)
    moe.init_weights()
    if args.gemm == "fp8":  # every GEMM in FP8: at this tiny shape the crossover table would pick bf16
        moe.experts.backend = Fp8Backend(plan_gemms=False)
    _prepare(moe, world, sc)
    return moe.to(device=device, dtype=dtype)


def _gemm(sc: dict) -> dict:
    """The scenario's ``gemm`` (e.g. ``fp8``: a2a / agrs then dispatch e4m3 codes + scales), or the dtype's."""
    return {"gemm": sc["gemm"]} if "gemm" in sc else {}


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().cpu()


def _sum_ranks(t: torch.Tensor) -> torch.Tensor:
    t = _cpu(t).clone()
    dist.all_reduce(t)
    return t


def _gather_ranks(t: torch.Tensor) -> torch.Tensor:
    t = _cpu(t).contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return torch.cat(parts)


def _grads(moe: MoE, name: str, world: int, w13, w2) -> dict:
    sh = moe.shared_experts
    out = dict(router_grad=_sum_ranks(moe.router.weight.grad),
               shared_grads=[_sum_ranks(p.grad) for p in (sh.w1.weight, sh.w3.weight, sh.w2.weight)])
    ex = moe.experts
    if name == "fsdp":  # FSDP2 averages over dp: times the world size is the sum
        # the dim-0 shards gathered on the host (DTensor.full_tensor's functional all-gather of CUDA
        # tensors crashes gloo in torch 2.11)
        out["w13_grad"], out["w2_grad"] = (_gather_ranks(ex.w13.grad.to_local()) * world,
                                           _gather_ranks(ex.w2.grad.to_local()) * world)
        out["w13"], out["w2"] = w13, w2
    elif name == "local":  # data parallel: each rank's gradient is its slice's part
        out["w13_grad"], out["w2_grad"] = _sum_ranks(ex.w13.grad), _sum_ranks(ex.w2.grad)
        out["w13"], out["w2"] = w13, w2
    else:  # EP: each rank holds the whole gradient of its experts
        out["w13_grad"], out["w2_grad"] = _gather_ranks(ex.w13.grad), _gather_ranks(ex.w2.grad)
        out["w13"], out["w2"] = _gather_ranks(w13), _gather_ranks(w2)
    return out


def _reference(world: int, sc: dict, device: torch.device) -> dict:
    """One ``local`` layer on the whole global batch (1 chunk, no memory option), same GPU and dtype."""
    dtype = DTYPES[sc["dtype"]]
    moe = _layer(model_args(sc["dtype"], **_gemm(sc)), None, world, sc, device, dtype)
    x_all, cot_all = global_batch(world)
    x = x_all.to(device, dtype).requires_grad_()
    with torch.no_grad():
        topk = moe.router(x.detach().reshape(-1, BASE["hidden_size"])).topk_idx_Tk
    moe.router.tokens_per_expert.zero_()
    y = moe(x)
    (y * cot_all.to(device, dtype)).sum().backward()
    sh = moe.shared_experts
    return dict(y=_cpu(y), x_grad=_cpu(x.grad), topk=topk.cpu(), router_grad=_cpu(moe.router.weight.grad),
                w13=_cpu(moe.experts.w13), w2=_cpu(moe.experts.w2), w13_grad=_cpu(moe.experts.w13.grad),
                w2_grad=_cpu(moe.experts.w2.grad),
                shared_grads=[_cpu(p.grad) for p in (sh.w1.weight, sh.w3.weight, sh.w2.weight)])


def _count_syncs(moe: MoE, x: torch.Tensor, cot: torch.Tensor) -> list[str]:
    """The host synchronisations that a forward + backward makes in this process's Python-facing threads.

    ``torch.cuda.set_sync_debug_mode`` is process-wide; gloo's own worker thread synchronises its
    staging stream for every collective on CUDA tensors (that is how gloo moves them), so ``"error"``
    would fail gloo itself. ``"warn"`` reports each synchronisation made by the caller's thread (and
    by autograd's, whose warnings reach the caller) as a Python warning, recorded here; gloo's
    thread logs its own to stderr instead.
    """
    torch.cuda.synchronize()
    x = x.detach().clone().requires_grad_()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            y = moe(x)
            (y * cot).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [str(w.message)[:200] for w in rec if SYNC_WARNING in str(w.message)]


def _profile_forward(moe: MoE, x: torch.Tensor) -> dict:
    """The launch order of one forward's collectives and grouped GEMMs (``launch_order``)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    x = x.detach().clone().requires_grad_()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        moe(x)
        torch.cuda.synchronize()
    return launch_order(prof.events())


def run_scenario(rank: int, world: int, sc: dict, mesh_ep, mesh_dp, device: torch.device) -> dict:
    dtype = DTYPES[sc["dtype"]]
    name = sc["dispatcher"]
    args = model_args(sc["dtype"], expert_alignment=sc["alignment"], num_token_chunks=sc.get("chunks", 1),
                      **_gemm(sc), **sc.get("opts", {}))
    staged_before = set(C.HOST_STAGED)
    if sc.get("staged"):  # every collective through host copies made by dropless itself
        C.HOST_STAGED.update({"a2a", "ag", "rs"})
    try:
        disp = build_dispatcher(name, args, None if name in ("fsdp", "local") else mesh_ep)
        moe = _layer(args, disp, world, sc, device, dtype)
        w13, w2 = _cpu(moe.experts.w13), _cpu(moe.experts.w2)
        if name == "fsdp":
            apply_fsdp(moe, mesh_dp)
        x_all, cot_all = global_batch(world)
        sl = slice(rank * SEQS_PER_RANK, (rank + 1) * SEQS_PER_RANK)
        x = x_all[sl].to(device, dtype).requires_grad_()
        cot = cot_all[sl].to(device, dtype)
        with torch.no_grad():
            topk = moe.router(x.detach().reshape(-1, BASE["hidden_size"])).topk_idx_Tk
        moe.router.tokens_per_expert.zero_()
        y = moe(x)
        rows_live = int(moe.last_stats["rows_live"])
        fwd_bytes = disp.comm_stats(reset=False) if name in ("a2a", "agrs") else None
        (y * cot).sum().backward()
        res = dict(y=_cpu(y), x_grad=_cpu(x.grad), topk=topk.cpu(), rows_live=rows_live, fwd_bytes=fwd_bytes,
                   **_grads(moe, name, world, w13, w2))
        if sc.get("sync_check"):
            res["syncs"] = _count_syncs(moe, x, cot)
        if sc.get("profile"):
            res["launches"] = _profile_forward(moe, x)
        res["host_staged"] = sorted(C.HOST_STAGED)  # kinds staged here (after a refusal by gloo, or forced)
    finally:
        C.HOST_STAGED.clear()
        C.HOST_STAGED.update(staged_before)
    if rank == 0:
        res["ref"] = _reference(world, sc, device)
    return res


def layer_worker(rank: int, world: int, scenarios: list[dict]) -> dict:
    """Every scenario on this rank (CUDA device ``rank % device_count``); returns ``{name: result}``."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    mesh_ep = build_mesh(world, world, "cuda")
    mesh_dp = build_mesh(world, 1, "cuda")
    return {sc["name"]: run_scenario(rank, world, sc, mesh_ep, mesh_dp, device) for sc in scenarios}


def probe_worker(rank: int, world: int) -> dict:
    """Which collectives gloo takes CUDA tensors for, in this torch (fp32, bf16, int64, uneven splits)."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    out = {}
    for dt in (torch.float32, torch.bfloat16, torch.int64):
        x = (torch.arange(world * 3, device=device) + 100 * rank).to(dt).view(world * 3, 1)
        cases = {
            "all_to_all_single": lambda: _a2a_uneven(x, rank, world),
            "all_gather_into_tensor": lambda: _ag(x),
            "reduce_scatter_tensor_sum": lambda: _rs(x, dist.ReduceOp.SUM),
            "all_reduce_sum": lambda: _ar(x),
        }
        for name, fn in cases.items():
            try:
                out[f"{name}/{dt}"] = fn()
            except Exception as err:  # noqa: BLE001 - recorded for the test to report
                out[f"{name}/{dt}"] = f"error: {str(err).splitlines()[0][:200]}"
    return out


def _a2a_uneven(x, rank, world):
    send = [(rank + j) % 3 for j in range(world)]       # rows to rank j
    recv = [(j + rank) % 3 for j in range(world)]       # rows from rank j (its send[rank])
    out = x.new_empty((sum(recv), 1))
    dist.all_to_all_single(out, x[:sum(send)].contiguous(), recv, send, async_op=True).wait()
    return out.float().cpu().flatten().tolist()


def _ag(x):
    out = x.new_empty((x.shape[0] * dist.get_world_size(), 1))
    dist.all_gather_into_tensor(out, x, async_op=True).wait()
    return out.float().cpu().flatten().tolist()


def _rs(x, op):
    out = x.new_empty((x.shape[0] // dist.get_world_size(), 1))
    dist.reduce_scatter_tensor(out, x, op=op, async_op=True).wait()
    return out.float().cpu().flatten().tolist()


def _ar(x):
    y = x.clone()
    dist.all_reduce(y, async_op=True).wait()
    return y.float().cpu().flatten().tolist()


def staging_cpu_worker(rank: int, world: int) -> dict:
    """The host-staging path of :mod:`dropless.dispatch.collectives` on CPU ranks.

    CPU tensors stand in for CUDA ones (``_gloo_cuda`` answers True), so the same code runs: a2a with
    every kind staged from the start, then agrs where gloo "refuses" the all-gather once when it is
    issued (a stub raising as an old gloo does) and the wrapper falls back to staging it. Returns each
    run's result as :func:`run_scenario` does, the staged kinds and the warnings.
    """
    mesh_ep, mesh_dp = build_mesh(world, world, "cpu"), build_mesh(world, 1, "cpu")
    dev = torch.device("cpu")
    real_gloo_cuda, real_issue = C._gloo_cuda, C._issue
    C._gloo_cuda = lambda x, group: True
    out = {}
    try:
        sc = dict(name="a2a-staged", dispatcher="a2a", dtype="fp32", alignment=1, chunks=CHUNKS_STAGED, staged=True)
        out["a2a"] = run_scenario(rank, world, sc, mesh_ep, mesh_dp, dev)
        refused = []

        def issue(kind, out_t, x, group, out_splits, in_splits):
            if kind == "ag" and not refused:
                refused.append(kind)
                raise RuntimeError("ProcessGroupGloo::allgather: unsupported device type cuda")
            return real_issue(kind, out_t, x, group, out_splits, in_splits)
        C._issue = issue
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            sc = dict(name="agrs-refused", dispatcher="agrs", dtype="fp32", alignment=1, chunks=CHUNKS_STAGED)
            res = run_scenario(rank, world, sc, mesh_ep, mesh_dp, dev)
        res["warnings"] = [str(w.message) for w in rec if "staged through host memory" in str(w.message)]
        out["agrs"] = res
    finally:
        C._gloo_cuda, C._issue = real_gloo_cuda, real_issue
        C.HOST_STAGED.clear()
    return out


CHUNKS_STAGED = 2
