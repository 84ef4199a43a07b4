"""Rank workers of tests/test_train_shard_experts.py (``train.shard_experts``), run by
:func:`tests.dist_harness.run_world` on gloo ranks: whole :class:`~dropless.train.trainer.Trainer`
runs in one process group, the replicated and the sharded run one after the other.

Every figure a worker returns is global (the same on every rank): full ``[E, ...]`` expert
tensors gathered over dp (FSDP2 shards) and EP, the router biases, the records' losses and norms.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dropless.train.config import compose
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


def equivalence_worker(rank: int, world: int, ep: int, steps: int, root: str, extra: list[str],
                       save: bool = False, resume_from: str | None = None) -> dict:
    """The replicated and the sharded run of the same config, ``steps`` steps each; with ``save`` the
    sharded run saves a checkpoint at its end (its state returned as ``saved``); with ``resume_from``
    (a run directory holding one) a sharded run of this world resumes from it (``resumed``)."""
    _torchrun_env(rank, world)
    base = COMMON + ["dispatcher=a2a", f"dispatcher.ep_size={ep}", f"train.steps={steps}", *extra]
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
    if resume_from is not None:
        out["resumed"] = resume_worker(rank, world, ep, resume_from, ["train.shard_experts=true", *extra])
    return out


def resume_worker(rank: int, world: int, ep: int, run_dir: str, extra: list[str]) -> dict:
    """A Trainer of this world resumed from the checkpoint in ``run_dir``: its loaded state."""
    _torchrun_env(rank, world)
    disp = ["dispatcher=a2a", f"dispatcher.ep_size={ep}"] if ep > 1 else ["dispatcher=local"]
    tr = Trainer(compose(COMMON + disp + ["train.steps=40", "resume=true", f"run_dir={run_dir}", *extra]))
    try:
        return expert_state(tr)
    finally:
        _release(tr)


def copy_checkpoint(src_run: Path, dst_run: Path) -> None:
    """The newest checkpoint of ``src_run`` into a fresh run directory ``dst_run`` (rank 0 of the test)."""
    ck = sorted((Path(src_run) / "checkpoints").glob("step_*"))[-1]
    (Path(dst_run) / "checkpoints").mkdir(parents=True, exist_ok=True)
    shutil.copytree(ck, Path(dst_run) / "checkpoints" / ck.name)
