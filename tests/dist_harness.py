"""Multi-process (gloo, CPU) harness for the dispatcher tests.

:func:`run_world` starts ``world`` processes with ``torch.multiprocessing`` (spawn), each in a
gloo process group with a short timeout, runs a worker function of THIS module by name and
returns each rank's result (``torch.save``-able) to the test. A worker that raises fails the
test with its traceback; a world that outlives ``deadline_s`` is killed and fails the test,
so a bug never hangs the suite.

Workers build the MoE layer under test and report tensors; the tests compute the
single-process ``local`` reference themselves (:func:`reference`) on the same global batch.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing import connection as mp_connection
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dropless.config import ModelArgs

# small DeepSeek-V3-shaped MoE: H, I multiples of 4 (fp32 grouped_mm strides), E=8, k=2, 4 groups keep 2
BASE = dict(hidden_size=16, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
            topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, aux_loss_alpha=0.0, seed=3)
SEQS_PER_RANK, SEQ_LEN = 2, 6
LAYER_ID = 1


def model_args(**over) -> ModelArgs:
    d = dict(BASE)
    d.update(over)
    return ModelArgs(**d)


def global_batch(world: int, args: ModelArgs, seed: int = 11):
    """``X [W·B, S, H]`` and the cotangent ``G`` of the same shape (rank r owns rows r·B … r·B+B-1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * SEQS_PER_RANK, SEQ_LEN, args.hidden_size, generator=g)
    cot = torch.randn(world * SEQS_PER_RANK, SEQ_LEN, args.hidden_size, generator=g)
    return x, cot


def bias_to_rank0(moe, world: int) -> None:
    """Make every token pick rank 0's experts (ids 0 … E/W − 1): a large selection bias."""
    e0 = moe.args.n_routed_experts // world
    with torch.no_grad():
        moe.router.e_score_correction_bias[:e0] += 10.0


def reference(world: int, args: ModelArgs, biased: bool = False, dispatcher: str = "local",
              fp8: bool = False) -> dict:
    """Single-process MoE on the global batch (``dispatcher`` at EP = 1, default ``local``; ``fp8``: the
    emulated ``gemm=fp8`` backend): output, all gradients, routing."""
    from dropless.dispatch import build_dispatcher
    from dropless.moe import MoE
    from dropless.ops.fp8_backend import Fp8Backend

    moe = MoE(args, LAYER_ID, build_dispatcher(dispatcher, args, None))
    moe.init_weights()
    if fp8:
        moe.experts.backend = Fp8Backend(emulate=True)
    if biased:
        bias_to_rank0(moe, world)
    x, cot = global_batch(world, args)
    x = x.clone().requires_grad_()
    y = moe(x)
    (y * cot).sum().backward()
    sh = moe.shared_experts
    return dict(y=y.detach(), x_grad=x.grad, router_grad=moe.router.weight.grad,
                w13=moe.experts.w13.detach(), w2=moe.experts.w2.detach(),
                w13_grad=moe.experts.w13.grad, w2_grad=moe.experts.w2.grad,
                shared_grads=[sh.w1.weight.grad, sh.w3.weight.grad, sh.w2.weight.grad])


# ------------------------------------------------------------------------------ launching
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # atomic: the parent never reads half a file


# No rank tears its process groups down: gloo's teardown aborted a rank after its result was
# saved ("terminate called without an active exception", SIGABRT) in about 1 CI run of 15, in
# workers of every kind (FSDP2 over a DeviceMesh, the async checkpointer's own group, a plain
# broadcast of a run-dir verdict), so the harness no longer lists the workers that may leave
# without it: every rank waits for its peers in a barrier (rank 0 hosts the TCP store; leaving
# early broke a peer still making a group through it) and leaves at once. Results are saved before,
# atomically, so leaving loses nothing. A worker that breaks its group on purpose (``timeout_…``)
# skips the barrier.


def _resolve(fn_name: str):
    """A worker by name: ``"name"`` in this module, or ``"package.module:name"`` (a module of its
    own keeps a worker's imports out of the other ranks, e.g. transformers)."""
    if ":" not in fn_name:
        return globals()[fn_name]
    mod, _, name = fn_name.partition(":")
    return getattr(importlib.import_module(mod), name)


def _entry(rank, world, port, fn_name, out_dir, args, pg_timeout_s):
    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.pt"
    # the parent sends SIGUSR1 to a rank still alive when another one failed: its Python stack
    # tells where it was (a rank that never reached the collective its peer timed out in)
    stack = open(Path(out_dir) / f"rank{rank}.stack", "w")  # noqa: SIM115 - open until the process ends
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    faulthandler.enable(file=stack, all_threads=True)  # a crash (SIGSEGV, SIGABRT, ...) writes its stack too
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        res = _resolve(fn_name)(rank, world, *args)
        _save(res, out)
    except BaseException:
        _save({"error": traceback.format_exc()}, out)
        raise
    try:
        if not fn_name.startswith("timeout_"):
            dist.barrier()
    finally:  # a peer that failed ends the barrier with an error: its own exit code reports it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _failure_report(tmp: Path, world: int, alive: list[int]) -> str:
    """Every rank's saved error and, for the ranks that were still running, their stacks."""
    parts = []
    for r in range(world):
        f = tmp / f"rank{r}.pt"
        res = torch.load(f, weights_only=False) if f.exists() else None
        if isinstance(res, dict) and "error" in res:
            parts.append(f"--- rank {r} raised:\n{res['error']}")
        elif r in alive:
            st = tmp / f"rank{r}.stack"
            parts.append(f"--- rank {r} was still running; its stack:\n"
                         + (st.read_text() if st.exists() else "(none written)"))
        else:
            st = tmp / f"rank{r}.stack"
            crash = st.read_text() if res is None and st.exists() else ""
            parts.append(f"--- rank {r}: " + ("finished" if res is not None else "exited without a result")
                         + (f"; the stack of its crash:\n{crash}" if crash.strip() else ""))
    return "\n".join(parts)


def _stop(ctx, tmp: Path) -> list[int]:
    """Dump the stacks of the ranks still alive, then kill them; return their ranks."""
    alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
    for r in alive:
        os.kill(ctx.processes[r].pid, signal.SIGUSR1)
    if alive:
        time.sleep(1.0)
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
        p.join(10)
    return alive


def run_world(fn_name: str, world: int, *args, pg_timeout_s: float = 60.0, deadline_s: float = 120.0,
              allow_fail: bool = False, until_rank0: bool = False) -> list:
    """Run ``fn_name(rank, world, *args)`` on ``world`` gloo ranks; return the per-rank results.

    ``fn_name``: a worker of this module, or ``"package.module:function"``.
    ``pg_timeout_s``: the gloo group's collective timeout: long enough that a 2-core CI machine
    under load does not trip it (a 30 s send timed out there once), short enough that a real
    hang fails well inside ``deadline_s``.
    ``until_rank0``: return (killing the others) as soon as rank 0 has written its result.
    A failing world raises AssertionError with every rank's error and the stacks of the ranks
    still running (a rank waiting in a collective its peers never entered shows where).
    """
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        ctx = mp.start_processes(_entry, args=(world, _free_port(), fn_name, tmp_name, args, pg_timeout_s),
                                 nprocs=world, join=False, start_method="spawn")
        t0 = time.monotonic()
        failure = None
        try:
            while True:
                codes = [p.exitcode for p in ctx.processes]
                if all(c == 0 for c in codes):
                    break
                bad = {r: c for r, c in enumerate(codes) if c not in (None, 0)}
                if bad:  # the others are still up: _stop dumps their stacks
                    if not allow_fail:
                        failure = f"{fn_name} on {world} ranks failed: exit codes {bad}"
                    break
                if until_rank0 and (tmp / "rank0.pt").exists():
                    break
                if time.monotonic() - t0 > deadline_s:
                    failure = f"{fn_name} on {world} ranks did not finish in {deadline_s} s"
                    break
                mp_connection.wait([p.sentinel for p in ctx.processes if p.exitcode is None], timeout=0.2)
        finally:
            alive = _stop(ctx, tmp)
        if failure is not None:
            raise AssertionError(failure + "\n" + _failure_report(tmp, world, alive))
        results = []
        for r in range(world):
            f = tmp / f"rank{r}.pt"
            results.append(torch.load(f, weights_only=False) if f.exists() else None)
        return results


# ------------------------------------------------------------------------------ workers
def _full_expert(t_local: torch.Tensor) -> torch.Tensor:
    """All-gather the EP ranks' local expert tensors ``[e, ...]`` into ``[E, ...]``."""
    parts = [torch.empty_like(t_local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t_local.contiguous())
    return torch.cat(parts)


def _sum_ranks(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


def _mutate_all_gather_backward():
    """Break the token all-gather's backward the way the known bug did: each rank keeps only
    its own slice of the gathered gradient (no sum over the other ranks). Returns an undo."""
    import dropless.dispatch.collectives as C

    orig = C._launch

    class _Done:
        def wait(self):
            return True

    def launch(kind, x, group, out_splits, in_splits, what, comm):
        if kind == "rs" and "token all-gather (backward)" in what:
            w, r = C.group_size(group), C.group_rank(group)
            n = x.shape[0] // w
            return x[r * n:(r + 1) * n].clone(), _Done(), x
        return orig(kind, x, group, out_splits, in_splits, what, comm)

    C._launch = launch

    def undo():
        C._launch = orig
    return undo


def layer_worker(rank, world, scenarios):
    """For each scenario dict(name, dispatcher, alignment, fold, biased): MoE on this rank's slice."""
    from dropless.dispatch import build_dispatcher
    from dropless.dispatch.mesh import build_mesh
    from dropless.moe import MoE
    from dropless.ops.fp8_backend import Fp8Backend
    from dropless.train.shard import apply_fsdp

    mesh_ep = build_mesh(world, world, "cpu")
    mesh_dp = build_mesh(world, 1, "cpu")
    out = {}
    for sc in scenarios:
        args = model_args(expert_alignment=sc["alignment"], fold_routing_weights=sc["fold"],
                          num_token_chunks=sc.get("chunks", 1), **sc.get("opts", {}))
        name = sc["dispatcher"]
        disp = build_dispatcher(name, args, None if name == "fsdp" else mesh_ep)
        moe = MoE(args, LAYER_ID, disp)
        moe.init_weights()
        if sc.get("fp8"):  # gemm=fp8, emulated: a2a / agrs then dispatch FP8 codes + scales
            moe.experts.backend = Fp8Backend(emulate=True)
        if sc.get("biased"):
            bias_to_rank0(moe, world)
        w13_init, w2_init = moe.experts.w13.detach().clone(), moe.experts.w2.detach().clone()
        if name == "fsdp":
            apply_fsdp(moe, mesh_dp)
        x_all, cot_all = global_batch(world, args)
        sl = slice(rank * SEQS_PER_RANK, (rank + 1) * SEQS_PER_RANK)
        x = x_all[sl].clone().requires_grad_()
        with torch.no_grad():
            topk = moe.router(x.detach().reshape(-1, args.hidden_size)).topk_idx_Tk
        moe.router.tokens_per_expert.zero_()
        undo = _mutate_all_gather_backward() if sc.get("mutate_ag_backward") else None
        try:
            y = moe(x)
            rows_live = int(moe.last_stats["rows_live"])
            fwd_bytes = disp.comm_stats(reset=False)
            (y * cot_all[sl]).sum().backward()
        finally:
            if undo is not None:
                undo()
        step_bytes = disp.comm_stats()
        sh = moe.shared_experts
        r = dict(y=y.detach(), x_grad=x.grad, topk=topk, rows_live=rows_live, fwd_bytes=fwd_bytes,
                 step_bytes=step_bytes, router_grad=_sum_ranks(moe.router.weight.grad),
                 shared_grads=[_sum_ranks(p.grad) for p in (sh.w1.weight, sh.w3.weight, sh.w2.weight)])
        if name == "fsdp":
            r["w13"], r["w2"] = w13_init, w2_init
            r["w13_local_rows"] = moe.experts.w13.to_local().shape[0]
            r["w13_grad"] = moe.experts.w13.grad.full_tensor()
            r["w2_grad"] = moe.experts.w2.grad.full_tensor()
        else:
            r["w13"], r["w2"] = _full_expert(w13_init), _full_expert(w2_init)
            r["w13_grad"], r["w2_grad"] = _full_expert(moe.experts.w13.grad), _full_expert(moe.experts.w2.grad)
        out[sc["name"]] = r
    return out


def overlap_worker(rank, world, name, alignment):
    """Two chunks in flight at once through dispatch_async/combine_async, vs one-phase calls."""
    from dropless.dispatch import build_dispatcher
    from dropless.moe import MoE

    args = model_args(expert_alignment=alignment)
    disp = build_dispatcher(name, args, dist.group.WORLD)
    moe = MoE(args, LAYER_ID, disp)
    moe.init_weights()
    x_all, cot_all = global_batch(world, args)
    sl = slice(rank * SEQS_PER_RANK, (rank + 1) * SEQS_PER_RANK)
    res = {}
    for mode in ("two_phase", "one_phase"):
        moe.zero_grad()
        x = x_all[sl].reshape(-1, args.hidden_size).clone().requires_grad_()
        r = moe.router(x)
        chunks = [slice(0, SEQ_LEN), slice(SEQ_LEN, 2 * SEQ_LEN)]
        if mode == "two_phase":
            pend = [disp.dispatch_async(x[c], r.topk_idx_Tk[c], r.topk_weight_Tk[c], alignment=alignment)
                    for c in chunks]                       # chunk 1 issued before chunk 0 landed
            ds = [p.wait() for p in pend]
            ys = [moe.experts(d.rows_MH, d.layout) for d in ds]
            pc = [disp.combine_async(yy, d.handle) for yy, d in zip(ys, ds)]
            outs = [p.wait() for p in pc]
        else:
            outs = []
            for c in chunks:
                d = disp.dispatch(x[c], r.topk_idx_Tk[c], r.topk_weight_Tk[c], alignment=alignment)
                outs.append(disp.combine(moe.experts(d.rows_MH, d.layout), d.handle))
        y = torch.cat(outs)
        (y * cot_all[sl].reshape(-1, args.hidden_size)).sum().backward()
        res[mode] = dict(y=y.detach(), x_grad=x.grad, router_grad=moe.router.weight.grad.clone(),
                         w13_grad=moe.experts.w13.grad.clone())
    return res


def timeout_worker(rank, world, name, how):
    """Rank 1 leaves (``exit``) or stops taking part (``hang``); rank 0 runs the layer and must raise."""
    from dropless.dispatch import build_dispatcher
    from dropless.moe import MoE

    args = model_args()
    if rank == 1:
        if how == "hang":
            time.sleep(60)  # alive but not taking part; the test stops it once rank 0 has reported
        return {"left": True}
    disp = build_dispatcher(name, args, dist.group.WORLD)
    moe = MoE(args, LAYER_ID, disp)
    moe.init_weights()
    x = global_batch(world, args)[0][:SEQS_PER_RANK]
    if how == "exit":
        time.sleep(1.0)  # let rank 1 be gone
    t0 = time.monotonic()
    try:
        moe(x).sum().backward()
    except Exception as err:  # noqa: BLE001 - the test checks the type and message
        return {"raised": type(err).__name__, "message": str(err), "elapsed": time.monotonic() - t0,
                "is_collective_error": type(err).__name__ == "CollectiveError"}
    return {"raised": None, "elapsed": time.monotonic() - t0}


ONE_EXPERT_TOKENS = 4096  # global tokens, split evenly over the ranks


def one_expert_args() -> ModelArgs:
    return model_args(num_experts_per_tok=1, n_group=1, topk_group=1)


def one_expert_batch():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(ONE_EXPERT_TOKENS, BASE["hidden_size"], generator=g)
    return x, torch.randn(ONE_EXPERT_TOKENS, BASE["hidden_size"], generator=g)


def one_expert_prepare(moe) -> None:
    """Everything to one expert: every token prefers expert 0 (which lives on rank 0)."""
    with torch.no_grad():
        moe.router.e_score_correction_bias[0] += 100.0


def one_expert_worker(rank, world, name):
    """Everything routed to one expert, scaled up: 4096 tokens, all routed to expert 0 on rank 0 of the EP group."""
    from dropless.dispatch import build_dispatcher
    from dropless.dispatch.mesh import build_mesh
    from dropless.moe import MoE

    args = one_expert_args()
    moe = MoE(args, LAYER_ID, build_dispatcher(name, args, build_mesh(world, world, "cpu")))
    moe.init_weights()
    one_expert_prepare(moe)
    x_all, cot_all = one_expert_batch()
    sl = slice(rank * ONE_EXPERT_TOKENS // world, (rank + 1) * ONE_EXPERT_TOKENS // world)
    x = x_all[sl].clone().requires_grad_()
    y = moe(x)
    rows_live = int(moe.last_stats["rows_live"])
    rows_dropped = int(moe.last_stats["rows_dropped"])
    (y * cot_all[sl]).sum().backward()
    return dict(y=y.detach(), x_grad=x.grad, rows_live=rows_live, rows_dropped=rows_dropped,
                w13_grad=_full_expert(moe.experts.w13.grad))


def shard_dense_worker(rank, world):
    """train.shard_dense's placement and one forward/backward against the replicated model."""
    import copy

    from torch.distributed.tensor import DTensor, Shard

    from dropless.model import Transformer
    from dropless.train.shard import shard_dense_params

    args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                     num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=16,
                     kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                     n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                     max_position_embeddings=64)
    torch.manual_seed(0)
    ref = Transformer(args)
    ref.init_weights(0)
    model = copy.deepcopy(ref)
    shard_dense_params(model, world, "cpu")
    expert_ids = {id(p) for p in model.expert_parameters()}
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    total = sum(p.numel() for p in dense)
    local = sum(p.to_local().numel() for p in dense if isinstance(p, DTensor))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(100 + rank))
    target = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(200 + rank))

    def loss_of(m):
        logits = m(tokens)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 64).float(), target.reshape(-1))

    loss, loss_ref = loss_of(model), loss_of(ref)
    loss.backward()
    loss_ref.backward()
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if id(p) in expert_ids:
            continue
        want = q.grad.clone()
        dist.all_reduce(want)
        want /= world  # FSDP2 averages over the ranks
        got = p.grad.full_tensor()
        worst = max(worst, ((got - want).norm() / want.norm().clamp_min(1e-30)).item())
    return dict(dense_all_sharded=all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in dense),
                experts_plain=not any(isinstance(p, DTensor) for p in model.expert_parameters()),
                local_fraction=local / total, loss_rel=abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()),
                grad_rel=worst)


def mesh_timeout_worker(rank, world, timeout_s):
    """The timeouts of ``build_mesh``'s groups (dp = 1 × ep = world, and dp = world × ep = 1), and
    whether each is the default group; also the FSDP2 1-D mesh's group (``shard_dense_params``)."""
    from dropless.dispatch.mesh import build_mesh
    from dropless.train.shard import world_mesh

    def info(g):
        return dict(world=g is dist.group.WORLD, ranks=dist.get_process_group_ranks(g),
                    timeout_s=g._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    out = {}
    for ep in (world, 1):
        m = build_mesh(world, ep, "cpu", timeout_s=timeout_s)
        out[ep] = dict(shape=tuple(m.shape), coord=list(m.get_coordinate()),
                       dp=info(m.get_group("dp")), ep=info(m.get_group("ep")), ep_sub=info(m["ep"].get_group()))
    out["fsdp_world"] = info(world_mesh("cpu").get_group())
    # groups of one rank (dp = world x ep = 1) are made by that rank alone, through rank 0's TCP store:
    # rank 0 keeps it open until rank 1 is done because _entry waits in a barrier before leaving
    return out


def stuck_peer_worker(rank, world):
    """Rank 0 waits in a barrier that rank 1, busy elsewhere, never enters: rank 0 times out
    (the group's timeout), rank 1 is still running (the harness's own test)."""
    if rank == 1:
        time.sleep(120)
        return {}
    dist.barrier()
    return {"passed_barrier": True}
