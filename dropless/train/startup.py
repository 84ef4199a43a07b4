"""What a run does before its first step: the config checks, the machine checks, determinism, the model.

:func:`check_train_config` raises every error that the config alone can show, before any work
(``dropless-train`` calls it before printing the resolved config); :func:`set_deterministic` applies
``deterministic=true``; :func:`start_up`, once the process group stands, checks what the config asks of
this machine (:func:`check_logging` refuses a ``logging.mode`` that wandb cannot start, no login for
``online``; :func:`check_state_fits` the training state in memory) and gathers the start-up warnings
(:func:`alignment_note` warns about a padding-heavy ``model.expert_alignment``); :func:`build_model`
makes the initialised model with its dispatcher and FSDP2 sharding.
:class:`dropless.train.trainer.Trainer` calls them in this order (the run directory, picked and locked,
is :mod:`dropless.train.run_dir`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.fsdp import MixedPrecisionPolicy

from dropless.config import ConfigError, ModelArgs
from dropless.convert.start import resolve_source
from dropless.dispatch import build_dispatcher
from dropless.dispatch.base import Dispatcher
from dropless.layout import aligned_capacity
from dropless.model import Transformer
from dropless.model.loss import resolve_loss_impl
from dropless.model.params import ParamCounts, param_counts
from dropless.model.rope import check_positions
from dropless.ops.backends import check_backend_device, check_backend_name, check_backend_shapes
from dropless.train.compile import check_compile, check_compile_moe
from dropless.train.data import check_data_config
from dropless.train.dist import DistEnv, mesh_shape, usable_cores
from dropless.train.graph import check_capturable, check_graph_device
from dropless.train.metrics import wandb_problem
from dropless.train.schema import RunConfig, need
from dropless.train.shard import apply_fsdp, expert_shard_dim, shard_dense_params, shard_experts


def check_train_config(cfg: DictConfig) -> RunConfig:
    """Raise ConfigError for config values that cannot work, from the config alone (before any work);
    returns the config as typed objects (:class:`~dropless.train.schema.RunConfig`).

    Each group checks its own fields, the model's included (the schema's ``validate()``: :meth:`RunConfig.validate`
    calls them); the rules between groups are here, the trainer's own first: the mesh
    (:func:`~dropless.train.dist.mesh_shape`: ``dispatcher.ep_size`` against torchrun's ``WORLD_SIZE`` and
    ``model.n_routed_experts``), ``train.shard_experts`` against the dispatcher and the dp size
    (:func:`~dropless.train.shard.expert_shard_dim`), the data's vocabulary within the model's, ``data.val_fraction=0``
    only with ``train.val_every=0``, the data's paths (:func:`~dropless.train.data.check_data_config`),
    ``train.compile_moe`` and CUDA graphs (:func:`~dropless.train.graph.check_capturable`) against the dispatcher
    and the GEMM backend; then the library's own guards, asked early: ``init_from``
    (:func:`~dropless.convert.start.resolve_source`), ``train.seq_len`` against ``model.max_position_embeddings``
    (:func:`~dropless.model.rope.check_positions`), ``model.recompute_gather`` against the dispatcher
    (:meth:`~dropless.dispatch.base.Dispatcher.check_regather`), the GEMM backend's name
    (:func:`~dropless.ops.backends.check_backend_name`). ``dropless-train`` calls it before it prints the resolved
    config, so the error is the last thing on the terminal.
    """
    missing = sorted(OmegaConf.missing_keys(cfg))  # '???' left by a group (data=bin's path, vocab_size)
    if missing:
        raise ConfigError(f"{', '.join(missing)}: required, and has no default; set it on the command line "
                          f"({missing[0]}=VALUE)")
    run: RunConfig = OmegaConf.to_object(cfg)
    run.validate()  # every group's own rules, the model's included
    t, kind, args = run.train, run.dispatcher.kind, run.model
    ep, dp = mesh_shape(run.dispatcher, int(os.environ.get("WORLD_SIZE", "1")), args.n_routed_experts)
    if t.shard_experts:
        expert_shard_dim(kind, dp, ep, args.n_routed_experts, args.hidden_size, args.moe_intermediate_size)
    data = run.data
    need(data.vocab_size <= args.vocab_size, "data.vocab_size", data.vocab_size,
         f"exceeds model.vocab_size={args.vocab_size}, the embedding's rows: raise model.vocab_size")
    need(data.val_fraction > 0 or t.val_every == 0 or data.kind == "bin" and data.val_path, "data.val_fraction",
         data.val_fraction, "0 holds out nothing to validate on: only with train.val_every=0 (or data.val_path)")
    check_data_config(data)  # the paths, from a stat
    if t.compile and t.compile_moe:
        check_compile_moe(kind)
    if t.cuda_graph:
        check_capturable(kind, args.gemm, t.shard_dense)
    # the library's own guards, asked before any work
    if run.init_from and not run.resume:  # (a resumed run may never read it)
        resolve_source(run.init_from)
    check_positions(t.seq_len, args.max_position_embeddings, "train.seq_len", "model.max_position_embeddings")
    if args.recompute_gather:
        kind.check_regather("model.recompute_gather")
    check_backend_name(args.gemm, "gemm.backend (model.gemm)")
    return run


@dataclass
class StartUp:
    """What :func:`start_up` resolved for this machine, and what it has to say.

    Attributes:
        dtype: the compute dtype (:func:`compute_dtype`).
        param_counts: the model's parameter counts (:func:`~dropless.model.params.param_counts`).
        loss_impl, loss_note: ``train.loss_impl`` resolved, and the line that says what was picked and why
            (:func:`~dropless.model.loss.resolve_loss_impl`).
        warnings: the start-up warnings, in the order they are printed.
    """

    dtype: torch.dtype
    param_counts: ParamCounts
    loss_impl: str
    loss_note: str
    warnings: list[str]


def start_up(cfg: RunConfig, env: DistEnv) -> StartUp:
    """What the config asks of this machine, resolved and checked, and the start-up warnings: the step
    between the process group (:func:`~dropless.train.dist.init_distributed`) and the data.

    ConfigError for what the machine cannot give, before the data is read and the run directory made:
    the trainer's own parts first (``torch.compile``'s backend, CUDA graphs on a CUDA device, the wandb
    login: :func:`check_logging`, a collective that every rank reaches), then the library's, from the
    model down (``train.loss_impl``, e.g. liger off CUDA; the dispatcher's package, e.g. deepep's; the
    GEMM backend on this device, e.g. gemm=fp8 without FP8 tensor cores, and its row sizes; the
    experts' row layout), then the training state in memory (:func:`check_state_fits`; else an OOM
    kill while building).

    Warnings (valid settings, rarely meant): :func:`alignment_note`, :func:`schedule_note`,
    :func:`threads_note`, :func:`dispatcher_note`, :func:`shard_experts_note`.
    """
    t, args = cfg.train, cfg.model
    dtype = compute_dtype(t, env.device)
    rows, local = chunk_rows(args, t.micro_batch_size * t.seq_len, env.ep_size)
    # the trainer's own parts
    if t.compile:
        check_compile(env.device, t.compile_backend)
    if t.cuda_graph:  # (loss_impl=liger: resolve_loss_impl refuses it)
        check_graph_device(env.device)
    check_logging(cfg, env)  # (a collective: every rank reaches it)
    # the library's, from the model down to the experts' row layout
    counts = param_counts(args)
    loss_impl, loss_note = resolve_loss_impl(t.loss_impl, env.device, t.cuda_graph)
    cfg.dispatcher.kind.check_available()
    check_backend_device(args.gemm, env.device)
    check_backend_shapes(args.gemm, env.device, dtype, args.hidden_size, args.moe_intermediate_size)
    capacity = aligned_capacity(rows, local, args.expert_alignment)
    # what they add up to: the training state in memory, and the warnings
    check_state_fits(counts.total, dtype, env, async_staging=t.ckpt_async)
    notes = (alignment_note(args.expert_alignment, local, rows, capacity), schedule_note(cfg),
             threads_note(cfg, env), dispatcher_note(cfg.dispatcher.kind, env), shard_experts_note(cfg, args, env))
    return StartUp(dtype, counts, loss_impl, loss_note, [n for n in notes if n])


def chunk_rows(args: ModelArgs, tokens: int, ep_size: int = 1) -> tuple[int, int]:
    """``(R, e)``: the routed rows of one token chunk on a rank, ``R = T·k / chunks`` (``tokens`` = ``T``, a
    rank's tokens per micro-batch), and the rank's local experts, ``e = E / ep_size`` (``ep_size``
    dividing ``E`` as :func:`~dropless.train.dist.mesh_shape` checked): what one chunk's landed buffer
    holds before alignment."""
    return tokens * args.num_experts_per_tok // max(1, args.num_token_chunks), args.n_routed_experts // ep_size


def alignment_note(alignment: int, local: int, rows: int, capacity: int) -> str | None:
    """A warning when ``model.expert_alignment`` (``alignment`` = ``A``) lets padding outgrow the routed rows,
    else None.

    Each of the ``local`` experts' segments of the landed buffer starts on a multiple of ``A``, so a
    chunk's buffer of ``rows`` routed rows (:func:`chunk_rows`) holds ``capacity`` rows
    (:func:`dropless.layout.aligned_capacity`: room for ``(e − 1)·(A − 1)`` padding rows beside them).
    Padding is never computed on the Triton paths but costs memory everywhere, and compute on the
    torch (CPU) path: a valid but almost surely unintended setting when it exceeds ``rows``.
    """
    pad = capacity - rows
    if pad <= rows:
        return None
    return (f"model.expert_alignment={alignment}: each of the {local} local experts' row segments starts on a "
            f"multiple of {alignment}, so a chunk's landed buffer can hold {pad:,} padding rows beside its "
            f"{rows:,} routed rows (memory on every path, compute on the torch/CPU path); lower it: 1 (the "
            "default) unless a backend needs more, e.g. 128 for gemm=deep_gemm; 8 or 16 are common")


#: Bytes of training state per parameter, by compute dtype: bf16 weights + fp32 masters + two fp32 AdamW
#: moments + fp32 main gradients; fp32: the weights are the masters.
STATE_BYTES_PER_PARAM = {torch.bfloat16: 2 + 4 + 8 + 4, torch.float32: 4 + 8 + 4}
#: Bytes per parameter a checkpoint holds, in either dtype: the fp32 masters and two fp32 AdamW moments
#: (:mod:`dropless.train.optim`: checkpoints hold the masters, not the compute copy): what
#: ``train.ckpt_async`` stages in host memory at every save.
SAVED_BYTES_PER_PARAM = 4 + 8


def process_memory_bytes(env: DistEnv) -> int | None:
    """Memory one process may fill: the GPU's total on CUDA; on a CPU the host's physical memory (or its
    cgroup v2 limit, if lower) over the processes on this node. None where neither can be read."""
    if env.device.type == "cuda":
        return int(torch.cuda.get_device_properties(env.device).total_memory)
    return host_memory_bytes(env)


def host_memory_bytes(env: DistEnv) -> int | None:
    """The host's physical memory (or its cgroup v2 limit, if lower) over the processes on this node;
    None where it cannot be read."""
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        host = min(host, int(limit)) if limit.isdigit() else host
    except OSError:
        pass
    return host // max(1, env.local_world_size)


def check_state_fits(total_params: int, dtype: torch.dtype, env: DistEnv, have: int | None = None, *,
                     async_staging: bool = False, host_have: int | None = None) -> None:
    """ConfigError when the weights, main gradients and AdamW state alone outgrow this process's memory.

    The bound is ``total_params / world_size · STATE_BYTES_PER_PARAM[dtype]``: no layout shards the
    state over more than all ranks, and activations come on top, so a run this refuses cannot fit,
    and one it lets through may still run out of memory. ``have``: bytes available (default
    :func:`process_memory_bytes`; nothing is checked where that is None). Run before the model
    is built, so an oversized model fails with this message instead of the kernel's OOM kill.

    ``async_staging`` (``train.ckpt_async``): every save also copies the saved state
    (``SAVED_BYTES_PER_PARAM``: masters and moments) into host memory, so on a GPU the host's share per
    process (``host_have``, default the host's physical memory or cgroup limit over the node's
    processes) must hold it, and on a CPU the same memory holds both: checked here, not at the
    first save ``train.ckpt_every`` steps later.
    """
    have = process_memory_bytes(env) if have is None else have
    share = -(-total_params // max(1, env.world_size))
    saved, per_param = share * SAVED_BYTES_PER_PARAM, STATE_BYTES_PER_PARAM[dtype]
    if async_staging:
        cpu = env.device.type == "cpu"
        host = have if cpu else (host_have if host_have is not None else host_memory_bytes(env))
        host_need = saved + (share * per_param if cpu else 0)
        if host is not None and host_need > host:
            raise ConfigError(
                f"train.ckpt_async=true copies each checkpoint's {saved / 2**30:.1f} GiB per process into host "
                f"memory{' beside the training state' if cpu else ''}: {host_need / 2**30:.1f} GiB per process, "
                f"more than the {host / 2**30:.1f} GiB of host memory per process ({env.local_world_size} on this "
                "node); use train.ckpt_async=false (saves pause training instead), more nodes, or a smaller model")
    if have is None:
        return
    need = share * per_param
    if need > have:
        where = f"the GPU's {have / 2**30:.1f} GiB" if env.device.type == "cuda" else \
            f"{have / 2**30:.1f} GiB of host memory per process ({env.local_world_size} on this node)"
        raise ConfigError(
            f"the model's {total_params / 1e9:.2f} B parameters need at least {need / 2**30:.1f} GiB per process "
            f"for weights, main gradients and AdamW state alone ({per_param} bytes a "
            f"parameter at {str(dtype).replace('torch.', '')}, over {env.world_size} rank(s)), more than {where}; "
            "use a smaller model (e.g. model=tiny, or the default recipe on a CPU), more ranks, or a larger device")


def threads_note(cfg: RunConfig | DictConfig, env: DistEnv, cores: int | None = None) -> str | None:
    """A warning when ``num_threads`` times the processes on this node exceeds the cores they may use
    (``cores``, default :func:`~dropless.train.dist.usable_cores`): intra-op threads then wait for
    each other and run much slower (valid, rarely meant). None for ``num_threads=null`` (the cores
    shared out) or a count that fits."""
    threads = cfg.num_threads
    cores = usable_cores() if cores is None else cores
    if threads is None or int(threads) * env.local_world_size <= cores:
        return None
    return (f"num_threads={int(threads)} x {env.local_world_size} process(es) on this node is more threads than "
            f"the {cores} core(s) they may use: intra-op threads will wait for each other and run much slower; "
            f"set num_threads=null (the cores shared out: {max(1, cores // env.local_world_size)} each) or fewer")


def dispatcher_note(kind: type[Dispatcher], env: DistEnv) -> str | None:
    """A warning when an expert-parallel dispatcher (a2a, agrs, deepep) runs at EP = 1: every expert
    stays on this process and no row is sent, so the MoE layers train as ``dispatcher=local`` would
    (valid, rarely meant: one process started without torchrun, or ``dispatcher.ep_size=1``). Else None."""
    name = kind.name
    if env.ep_size > 1 or not kind.expert_parallel:
        return None
    if env.world_size == 1:
        how = (f"one process runs EP = 1; for expert parallelism start several: torchrun --nproc_per_node N "
               f"-m dropless.train dispatcher={name}")
    else:
        how = (f"dispatcher.ep_size=1 over {env.world_size} processes; for expert parallelism set "
               "dispatcher.ep_size to more than 1 (or null: all processes)")
    return (f"dispatcher={name}: {how}. At EP = 1 every expert is on every process and no row is sent: "
            "the MoE layers train as dispatcher=local")


def shard_experts_note(cfg: RunConfig, args: ModelArgs, env: DistEnv) -> str | None:
    """A warning where ``train.shard_experts`` does nothing (dp = 1: no rank holds this rank's experts
    besides it) or gathers each layer's experts once per token chunk (``model.num_token_chunks`` > 1:
    the experts' forward, where FSDP2 gathers them, runs once per chunk; valid, costs bytes). Else None."""
    if not cfg.train.shard_experts or env.world_size == 1:
        return None
    if env.dp_size == 1:
        return (f"train.shard_experts=true with dp 1 (world {env.world_size} = dispatcher.ep_size): no other rank "
                "holds this rank's experts, so nothing is sharded; it shards over dp = world / dispatcher.ep_size")
    n = int(args.num_token_chunks)
    if n > 1:
        return (f"train.shard_experts=true with model.num_token_chunks={n}: each MoE layer's experts are all-gathered "
                f"{n} times per forward (once per chunk) and {n} times again in backward (their gradients are "
                "reduce-scattered once; dropless-plan shows the bytes per gather); use num_token_chunks=1 unless "
                "memory needs it")
    return None


def schedule_note(cfg: RunConfig | DictConfig) -> str | None:
    """A warning when ``optim.warmup_steps`` reaches ``train.steps``: the run ends inside the warm-up, so
    the learning rate never reaches ``optim.lr`` and never decays (valid, rarely meant). Else None."""
    warmup, steps = int(cfg.optim.warmup_steps), int(cfg.train.steps)
    if warmup < steps:
        return None
    return (f"optim.warmup_steps={warmup} >= train.steps={steps}: the run ends inside the warm-up, the learning "
            f"rate climbs to {min(1.0, steps / max(1, warmup)):.0%} of optim.lr={cfg.optim.lr} and never decays; "
            f"lower optim.warmup_steps (e.g. {max(0, steps // 10)}) or raise train.steps")


def check_logging(cfg: RunConfig | DictConfig, env: DistEnv) -> None:
    """ConfigError when ``logging.mode`` cannot start the wandb run (:func:`~dropless.train.metrics.wandb_problem`:
    wandb not importable; ``online`` without credentials), before the run directory and the model.

    Rank 0, the only rank that logs, looks in its own environment and broadcasts the answer, so every
    rank raises the same error (a node without ``~/.netrc`` does not fail where rank 0 would log).
    ``logging.mode=disabled`` is decided from the config alone, with no collective.
    """
    mode = str(cfg.logging.mode)
    if mode == "disabled":
        return
    problem = wandb_problem(mode) if env.is_main else None
    if env.distributed:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise ConfigError(problem)


_ABSENT = object()  # a key one of the two configs lacks (config_changes)


def config_changes(old: DictConfig, new: DictConfig) -> list[str]:
    """``key: old -> new`` for every leaf that differs between two configs (resolved; ``resume`` ignored)."""
    a = OmegaConf.to_container(old, resolve=True)
    b = OmegaConf.to_container(new, resolve=True)

    def leaves(d: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(d, dict):
            return {prefix[:-1]: d}
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(leaves(v, f"{prefix}{k}."))
        return out

    def yaml(v: Any) -> str:  # as the command line and config.yaml spell values: null, true, [0.9, 0.95]
        if v is _ABSENT:
            return "(none)"
        if v is None or isinstance(v, bool):
            return {None: "null", True: "true", False: "false"}[v]
        if isinstance(v, list):
            return "[" + ", ".join(yaml(x) for x in v) + "]"
        return str(v)

    la, lb = leaves(a), leaves(b)
    return [f"{k}: {yaml(la.get(k, _ABSENT))} -> {yaml(lb.get(k, _ABSENT))}" for k in sorted(set(la) | set(lb))
            if k != "resume" and la.get(k, _ABSENT) != lb.get(k, _ABSENT)]


def set_deterministic(seed: int) -> None:
    """``deterministic=true``: deterministic kernels only, and seeded RNGs.

    ``torch.use_deterministic_algorithms(True)`` (an op without a deterministic
    implementation then raises, naming itself); ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless set
    (cuBLAS reads it when its first handle is made, so it must be set before the process's
    first CUDA matmul; the trainer sets it before building the model); ``torch.manual_seed``
    (CPU and CUDA). The weight init and the data order are seeded by ``seed`` either way.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)


def compute_dtype(train_cfg: Any, device: torch.device) -> torch.dtype:
    """``train.dtype`` as a torch dtype: auto = bf16 on CUDA, fp32 elsewhere."""
    want = str(train_cfg.dtype)
    if want == "auto":
        want = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if want == "bf16" else torch.float32


def build_model(args: ModelArgs, cfg: RunConfig, env: DistEnv, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The Transformer with the configured dispatcher in every MoE layer, initialised (fp32).

    Each MoE layer gets a dispatcher of the configured class (``dropless.dispatch.build_dispatcher``)
    with this rank's EP group; one that :attr:`~dropless.dispatch.base.Dispatcher.shards_experts`
    (``fsdp``) has the experts FSDP2-sharded (``dropless.train.shard.apply_fsdp``) over the dp
    mesh dimension, and so does ``train.shard_experts`` with an EP dispatcher (each rank's local
    experts over the dp ranks holding the same ones: :func:`dropless.train.shard.shard_experts`). With
    ``train.shard_dense`` the non-expert parameters are FSDP2-sharded over all ranks
    (:func:`dropless.train.shard.shard_dense_params`). With ``dtype`` bf16 those FSDP2
    calls get ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (inputs not
    cast: the activations are bf16 already, the RoPE tables and routing weights stay fp32);
    the other parameters are cast later by :class:`~dropless.train.optim.MasterWeights`.
    """
    kind = cfg.dispatcher.kind

    def factory(layer_id: int):
        return build_dispatcher(kind, args, ep_group=env.ep_group)

    with torch.device(env.device):
        model = Transformer(args, dispatcher_factory=factory,
                            activation_checkpointing=cfg.train.activation_checkpointing)
    model.init_weights(cfg.seed)
    shard_dense = cfg.train.shard_dense and env.world_size > 1
    experts_sharded = cfg.train.shard_experts and env.dp_size > 1
    fsdp_experts = kind.shards_experts and env.world_size > 1
    mp_policy = None
    if dtype != torch.float32 and (shard_dense or experts_sharded or fsdp_experts):
        mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    if fsdp_experts:
        apply_fsdp(model, env.mesh, root=not shard_dense, mp_policy=mp_policy)  # shard_dense makes the root
    if experts_sharded:
        shard_experts(model, env.mesh, root=not shard_dense, mp_policy=mp_policy)
    if shard_dense:
        shard_dense_params(model, env.world_size, env.device.type, mp_policy=mp_policy)
    return model
