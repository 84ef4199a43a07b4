"""Rank workers of tests/test_train_shard_experts.py (``train.shard_experts``), run by
:func:`tests.dist_harness.run_world` on gloo ranks: whole :class:`~dropless.train.trainer.Trainer`
runs in one process group, the replicated and the sharded run one after the other.

Every figure a worker returns is global (the same on every rank): full ``[E, ...]`` expert
tensors gathered over dp (FSDP2 shards) and EP, the router biases, the records' losses and norms.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dropless.config import ModelArgs
from dropless.convert import args_from_hf_config, load_hf, read_hf_config
from dropless.convert.start import init_from
from dropless.dispatch import build_dispatcher
from dropless.dispatch.mesh import build_mesh
from dropless.model import Transformer
from dropless.train.config import compose
from dropless.train.dist import DistEnv
from dropless.train.grads import GradBuckets, clip_, grad_norm
from dropless.train.shard import shard_experts
from dropless.train.trainer import Trainer

#: a tiny DeepSeek-V3 shape (2 MoE layers of E = 8, top-2) and a short, clipped run
TINY = ["model=tiny", "model.hidden_size=32", "model.moe_intermediate_size=16", "model.intermediate_size=64",
        "model.num_hidden_layers=3", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8",
        "model.v_head_dim=8", "model.num_attention_heads=2"]
COMMON = TINY + ["train.micro_batch_size=2", "train.seq_len=16", "train.grad_accum=2", "train.val_every=0",
                 "train.ckpt_every=0", "logging.mode=disabled", "logging.progress=false", "num_threads=1",
                 "device=cpu", "optim.warmup_steps=2", "optim.grad_clip=0.05"]


def _torchrun_env(rank: int, world: int) -> None:
    """What torchrun would set; the harness has started the process group already."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def _full(t: torch.Tensor, tr: Trainer) -> torch.Tensor:
    """This EP rank's experts ``[e, ...]`` (gathered over dp if an FSDP2 shard) gathered over EP: ``[E, ...]``."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    env = tr.env
    if env.ep_size <= 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(env.ep_size)]
    dist.all_gather(parts, t.detach().contiguous(), group=env.ep_group)
    return torch.cat(parts)


def _experts(tr: Trainer) -> list[tuple[str, torch.Tensor]]:
    """``(fqn, master)`` of the routed experts, in a fixed order."""
    return sorted((n, p) for n, p in tr.masters.named_masters if n in tr.expert_fqns)


def expert_state(tr: Trainer) -> dict:
    """The global expert weights and AdamW moments, the router biases and the step (collective)."""
    out = {"step": tr.step, "bias": [r.e_score_correction_bias.detach().clone() for r in tr.balancer.routers]}
    for n, p in _experts(tr):
        out[n] = _full(p, tr)
        st = tr.optimizer.state.get(p, {})
        for m in ("exp_avg", "exp_avg_sq"):
            out[f"{n}.{m}"] = _full(st[m], tr) if m in st else None
    return out


def _release(tr: Trainer) -> None:
    """:meth:`Trainer.close` without tearing the harness's process group down."""
    tr.checkpoints.finish()
    tr.metrics.close()
    tr.grads.remove()
    if tr._run_dir_lock is not None:
        tr._run_dir_lock.release()


def run_steps(tr: Trainer, steps: int) -> dict:
    """``steps`` optimizer steps; per step the record's loss and grad norm, the global expert gradients
    the optimizer steps with (after the clip), and the router biases after it."""
    grads: list[dict] = []

    def capture(opt, args, kwargs):  # noqa: ARG001
        grads.append({n: _full(p.grad, tr) for n, p in _experts(tr)})

    handle = tr.optimizer.register_step_pre_hook(capture)
    losses, norms, biases = [], [], []
    try:
        for _ in range(steps):
            rec = tr.train_step()
            losses.append(rec["loss"])
            norms.append(rec["grad_norm"])
            biases.append([r.e_score_correction_bias.detach().clone() for r in tr.balancer.routers])
    finally:
        handle.remove()
    return {"loss": losses, "grad_norm": norms, "grads": grads, "bias": biases}


def equivalence_worker(rank: int, world: int, disp: str, ep: int, steps: int, root: str, extra: list[str],
                       save: bool = False) -> dict:
    """The replicated and the sharded run of the same config (dispatcher ``disp`` at EP ``ep``), ``steps``
    steps each; with ``save`` the sharded run saves a checkpoint at its end (its state returned as
    ``saved``) in ``<root>/sharded_<world>``."""
    _torchrun_env(rank, world)
    base = COMMON + [f"dispatcher={disp}", f"dispatcher.ep_size={ep}", f"train.steps={steps}", *extra]
    out: dict = {}
    for name, flag in (("replicated", "false"), ("sharded", "true")):
        tr = Trainer(compose(base + [f"train.shard_experts={flag}", f"run_dir={root}/{name}_{world}"]))
        try:
            out[name] = run_steps(tr, steps)
            out[name]["sharded_params"] = [type(p).__name__ for _, p in _experts(tr)]
            out[name]["local_numel"] = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                                           for _, p in _experts(tr))
            out[name]["final"] = expert_state(tr)
            if save and flag == "true":
                tr.save_checkpoint()
                out["saved"] = out[name]["final"]
        finally:
            _release(tr)
    return out


def resume_worker(rank: int, world: int, disp: str, ep: int, run_dir: str, extra: list[str]) -> dict:
    """A Trainer of this world (dispatcher ``disp`` at EP ``ep``) resumed from the checkpoint in ``run_dir``:
    its loaded state (:func:`expert_state`)."""
    _torchrun_env(rank, world)
    tr = Trainer(compose(COMMON + [f"dispatcher={disp}", f"dispatcher.ep_size={ep}", "train.steps=40", "resume=true",
                                   f"run_dir={run_dir}", *extra]))
    try:
        return expert_state(tr)
    finally:
        _release(tr)


def copy_checkpoint(src_run: Path, dst_run: Path) -> None:
    """The newest checkpoint of ``src_run`` into a fresh run directory ``dst_run`` (rank 0 of the test)."""
    ck = sorted((Path(src_run) / "checkpoints").glob("step_*"))[-1]
    (Path(dst_run) / "checkpoints").mkdir(parents=True, exist_ok=True)
    shutil.copytree(ck, Path(dst_run) / "checkpoints" / ck.name)


# ----------------------------------------------------------------------------- one forward/backward
SEQS, SEQ = 2, 8


def tiny_args(n_experts: int = 8) -> ModelArgs:
    """A tiny DeepSeek-V3 shape (``n_experts`` routed experts, top-2 of one group, 2 MoE layers)."""
    return ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                     num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=0,
                     kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                     n_routed_experts=n_experts, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                     max_position_embeddings=64, aux_loss_alpha=1e-2)


def global_batch(world: int, args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets ``[world · SEQS, SEQ]`` (rank r's sequences are rows r·SEQS …)."""
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(0, args.vocab_size, (world * SEQS, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _full_env(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if isinstance(t, DTensor):
        t = t.full_tensor()
    parts = [torch.empty_like(t) for _ in range(env.ep_size)]
    dist.all_gather(parts, t.contiguous(), group=env.ep_group)
    return torch.cat(parts)


def grad_norm_worker(rank: int, world: int, ep: int, n_experts: int, max_norm: float) -> dict:
    """One forward/backward of a tiny Transformer on this rank's sequences with ``a2a`` at EP ``ep``, its
    experts replicated over dp (``replicated``) and FSDP2-sharded over dp (``sharded``), the other
    parameters' gradients in the trainer's :class:`~dropless.train.grads.GradBuckets` (all-reduced,
    ``/ world``): the global norm :func:`~dropless.train.grads.grad_norm` gives, and the full expert
    gradients after :func:`~dropless.train.grads.clip_` to ``max_norm``; plus the sharding placements."""
    args = tiny_args(n_experts)
    mesh = build_mesh(world, ep, "cpu")
    env = DistEnv(rank, world, rank, world, torch.device("cpu"), ep, world // ep, mesh, mesh.get_group("ep"),
                  mesh.get_group("dp"))
    tokens, targets = global_batch(world, args)
    mine = slice(rank * SEQS, (rank + 1) * SEQS)
    out = {}
    for name in ("replicated", "sharded"):
        model = Transformer(args, dispatcher_factory=lambda i: build_dispatcher("a2a", args, ep_group=env.ep_group))
        model.init_weights(5)
        if name == "sharded":
            shard_experts(model, mesh)
        experts = model.expert_parameters()  # (FSDP2 puts DTensors in place of the parameters)
        plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
        ep_ids = {id(p) for p in experts}
        buckets = GradBuckets(plain, ep_ids if name == "replicated" else set(), True, world, dist.group.WORLD,
                              env.dp_group, env.dp_size)
        buckets.zero_()
        buckets.start(sync=True)
        model.loss(tokens[mine], targets[mine]).loss.backward()
        buckets.finish()
        fsdp = [p.grad for p in model.parameters() if isinstance(p, DTensor)]
        names = {id(p): n for n, p in model.named_parameters()}
        unclipped = {names[id(p)]: _full_env(p.grad, env) for p in experts}
        norm = grad_norm(buckets, [], env, fsdp)
        clip_(buckets.flats + fsdp, norm, max_norm)
        out[name] = {"norm": norm.item(), "placements": [str(p.placements) for p in experts if isinstance(p, DTensor)],
                     "grads": {names[id(p)]: _full_env(p.grad, env) for p in experts}, "unclipped": unclipped}
        buckets.remove()
    return out


def reference_grads(world: int, n_experts: int, max_norm: float) -> dict:
    """One process, ``dispatcher=local``, on every rank's sequences (each rank's mean loss averaged, as
    the ranks' gradients are): the global norm (float64) and the clipped expert gradients."""
    args = tiny_args(n_experts)
    model = Transformer(args)
    model.init_weights(5)
    tokens, targets = global_batch(world, args)
    for r in range(world):
        (model.loss(tokens[r * SEQS:(r + 1) * SEQS], targets[r * SEQS:(r + 1) * SEQS]).loss / world).backward()
    grads = [p.grad for p in model.parameters()]
    norm = torch.stack([g.double().norm() for g in grads]).norm()
    clip_(grads, norm.float(), max_norm)
    names = {id(p): n for n, p in model.named_parameters()}
    return {"norm": norm.item(), "grads": {names[id(p)]: p.grad.clone() for p in model.expert_parameters()}}


def import_worker(rank: int, world: int, ep: int, hf_dir: str, dcp_dir: str) -> dict:
    """A model with ``a2a`` at EP ``ep`` and its experts sharded over dp, its weights imported from the
    Hugging Face files (:func:`~dropless.convert.load_hf`) and from a DCP weights checkpoint
    (:func:`~dropless.convert.start.init_from`): each one's expert weights gathered to ``[E, ...]``,
    their placements, and the names read from the files."""
    args, _ = args_from_hf_config(read_hf_config(hf_dir))
    mesh = build_mesh(world, ep, "cpu")
    env = DistEnv(rank, world, rank, world, torch.device("cpu"), ep, world // ep, mesh, mesh.get_group("ep"),
                  mesh.get_group("dp"))
    out: dict = {}
    for src in ("hf", "dcp"):
        model = Transformer(args, dispatcher_factory=lambda i: build_dispatcher("a2a", args, ep_group=env.ep_group))
        model.init_weights(seed=99)
        shard_experts(model, mesh)
        if src == "hf":
            out["names_read"] = load_hf(model, hf_dir).names_read
        else:
            init_from(model, dcp_dir, mesh=mesh)
        names = {id(p): n for n, p in model.named_parameters()}
        experts = model.expert_parameters()
        out[src] = {names[id(p)]: _full_env(p.detach(), env) for p in experts}
        out[src + "_placements"] = [str(p.placements) for p in experts if isinstance(p, DTensor)]
    return out


def collectives_worker(rank: int, world: int, ep: int) -> dict:
    """How many all-gathers and reduce-scatters one forward/backward of the tiny model issues with its
    experts sharded over dp, at ``num_token_chunks`` 1 and 2 (every such torch.distributed call counted)."""
    counts: dict[str, int] = {}

    def counted(name, f):
        def call(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return f(*a, **k)
        return call

    for name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
                 "all_gather", "reduce_scatter"):
        if hasattr(dist, name):
            setattr(dist, name, counted(name, getattr(dist, name)))
    out = {}
    mesh = build_mesh(world, ep, "cpu")
    group = mesh["ep"].get_group()
    for n in (1, 2):
        args = dataclasses.replace(tiny_args(8), num_token_chunks=n)
        model = Transformer(args, dispatcher_factory=lambda i: build_dispatcher("a2a", args, ep_group=group))
        model.init_weights(5)
        shard_experts(model, mesh)
        tokens, targets = global_batch(world, args)
        counts.clear()
        model.loss(tokens[rank * SEQS:(rank + 1) * SEQS], targets[rank * SEQS:(rank + 1) * SEQS]).loss.backward()
        out[n] = {"gathers": sum(v for k, v in counts.items() if "gather" in k),
                  "reduce_scatters": sum(v for k, v in counts.items() if "scatter" in k),
                  "moe_layers": len(model.moe_layers())}
    return out
