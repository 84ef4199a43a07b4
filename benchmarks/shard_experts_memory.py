"""Per-rank expert state with and without ``train.shard_experts``, on CPU gloo ranks, against the planner.

For each layout (world = dp × ep with ep 2; replicated and sharded experts) the ranks are spawned
(``torch.multiprocessing``, gloo over TCP on localhost, one thread each) and each builds the real
:class:`~dropless.train.trainer.Trainer` (fp32, ``dispatcher=a2a``) of a model whose routed experts
outweigh the rest (6 MoE layers of 8 experts, H 256, I 512), and trains ``--steps`` steps. Measured
per rank:

* ``expert_state_bytes``: the bytes of the tensors that hold the routed experts' state at the last
  optimizer step (an optimizer step pre-hook): this rank's weights (the FSDP2 shard or the whole
  ``E/EP`` experts), their gradients and both AdamW moments, each storage counted once;
* ``expert_peak_rss_bytes``: the process's peak resident set (``VmHWM``) at the end minus its
  resident set (``VmRSS``) before the model is built, less the same difference in a run of the same
  layout whose experts are next to nothing (``model.moe_intermediate_size=4``): the routed experts'
  share of the peak, i.e. their state plus what they need transiently (the gathered buffers when
  sharded; the foreach AdamW's temporaries over all plain parameters at once when replicated).
  Run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns freed tensors to the system and
  the resident set follows the live memory (recorded as ``malloc_mmap_threshold``).

``planner_expert_state_bytes`` is :func:`dropless.plan.state.rank_state`'s count for the layout
(16 bytes a replicated fp32 parameter, 16 / dp a sharded one); ``vs_planner`` is measured / planned,
``expert_peak_rss_vs_planner`` the largest rank's share of the peak over the planned state plus
:func:`~dropless.plan.state.expert_shard_transient_bytes`.
Prints one JSON line per layout (stamp with ``benchmarks/stamp.py``)::

    MALLOC_MMAP_THRESHOLD_=65536 python -m benchmarks.shard_experts_memory | \\
        python benchmarks/stamp.py --gpu "none (CPU)" >> \\
        benchmarks/results/shard_experts_cpu_memory.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from dropless.model.params import param_counts
from dropless.plan.state import rank_state
from dropless.train.config import compose, model_args
from dropless.train.trainer import Trainer

MODEL = ["model=tiny", "model.hidden_size=256", "model.moe_intermediate_size=512", "model.intermediate_size=128",
         "model.num_hidden_layers=7", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8",
         "model.qk_rope_head_dim=8", "model.v_head_dim=8", "model.num_attention_heads=2"]
RUN = ["train.micro_batch_size=2", "train.seq_len=16", "train.val_every=0", "train.ckpt_every=0",
       "logging.mode=disabled", "logging.progress=false", "num_threads=1", "device=cpu", "train.dtype=fp32",
       "dispatcher=a2a", "dispatcher.ep_size=2", "optim.warmup_steps=1"]


def _status(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _bytes(ts: list[torch.Tensor]) -> int:
    seen, n = set(), 0
    for t in ts:
        if isinstance(t, DTensor):
            t = t.to_local()
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            n += st.nbytes()
    return n


def _rank(rank: int, world: int, port: int, steps: int, shard: bool, out_dir: str, over: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    base = _status("VmRSS")
    with tempfile.TemporaryDirectory() as rd:
        tr = Trainer(compose(MODEL + RUN + over + [f"train.steps={steps}",
                                                   f"train.shard_experts={str(shard).lower()}", f"run_dir={rd}/run"]))
        experts = [p for n, p in tr.masters.named_masters if n in tr.expert_fqns]
        held = {}

        def record(opt, args, kwargs):  # noqa: ARG001
            state = [v for p in experts for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.dim()]
            held["bytes"] = _bytes(experts) + _bytes([p.grad for p in experts if p.grad is not None]) + _bytes(state)

        tr.optimizer.register_step_pre_hook(record)
        for _ in range(steps):
            tr.train_step()
        peak = _status("VmHWM")
        tr.metrics.close()
        tr.grads.remove()
        if tr._run_dir_lock is not None:
            tr._run_dir_lock.release()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"expert_state_bytes": held["bytes"],
                                                             "peak_rss_delta_bytes": peak - base}))
    dist.barrier()
    os._exit(0)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world(world: int, shard: bool, steps: int, over: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, _port(), steps, shard, out, over), nprocs=world, start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def _text(path: Path) -> None:
    """A small byte-level corpus (1 MiB), so that the token stream adds little to each rank's memory."""
    g = torch.Generator().manual_seed(3)
    path.write_bytes(bytes((torch.randint(32, 127, (2**20,), generator=g)).tolist()))


def measure(world: int, shard: bool, steps: int) -> dict:
    """One layout's JSON record (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        _text(text)
        data = [f"data.path={text}"]
        ranks = _world(world, shard, steps, data)
        base = _world(world, shard, steps, data + ["model.moe_intermediate_size=4"])  # the experts next to nothing
    args = model_args(compose(MODEL + RUN))
    pc = param_counts(args)
    ep = 2
    plan = rank_state(pc.routed_experts, pc.total - pc.routed_experts, world, ep, args.n_routed_experts // ep,
                      args.hidden_size, args.moe_intermediate_size, shard_experts=shard, compute_bytes=4)
    planned = (plan.experts_sharded if shard and plan.dp_size > 1 else plan.experts_replicated).total
    held = max(r["expert_state_bytes"] for r in ranks)
    peak = [r["peak_rss_delta_bytes"] - b["peak_rss_delta_bytes"] for r, b in zip(ranks, base)]
    planned_peak = planned + plan.transient
    return {"bench": "shard_experts_cpu_memory", "world": world, "dp": world // ep, "ep": ep, "shard_experts": shard,
            "steps": steps, "routed_params": pc.routed_experts, "planner_expert_state_bytes": planned,
            "expert_state_bytes": held, "vs_planner": round(held / planned, 4),
            "planner_transient_bytes": plan.transient, "expert_peak_rss_bytes": peak,
            "expert_peak_rss_vs_planner": round(max(peak) / planned_peak, 4),
            "peak_rss_delta_bytes": [r["peak_rss_delta_bytes"] for r in ranks],
            "peak_rss_delta_small_experts_bytes": [b["peak_rss_delta_bytes"] for b in base],
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--worlds", default="2,4,8", help="world sizes (ep 2: dp = world / 2)")
    ns = p.parse_args()
    for world in (int(w) for w in ns.worlds.split(",")):
        for shard in ((False, True) if world > 2 else (False,)):
            print(json.dumps(measure(world, shard, ns.steps)), flush=True)


if __name__ == "__main__":
    main()
