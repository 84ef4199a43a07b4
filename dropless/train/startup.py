"""What a run does before its first step: the config checks, determinism, the model.

:func:`check_train_config` raises every error that the config alone can show, before any work
(``dropless-train`` calls it before printing the resolved config); :func:`check_logging` refuses a
``logging.mode`` that wandb cannot start (no login for ``online``); :func:`alignment_note` warns
about a padding-heavy ``model.expert_alignment``; :func:`set_deterministic` applies ``deterministic=true``;
:func:`compute_dtype` reads ``train.dtype``; :func:`build_model` makes the initialised model
with its dispatcher and FSDP2 sharding. :class:`dropless.train.trainer.Trainer` calls them in
this order (the run directory, picked and locked, is :mod:`dropless.train.run_dir`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.fsdp import MixedPrecisionPolicy

from dropless.config import ConfigError, ModelArgs
from dropless.convert.start import resolve_source
from dropless.dispatch import build_dispatcher
from dropless.dispatch.mesh import local_expert_count
from dropless.dispatch.registry import dispatcher_class
from dropless.layout import aligned_capacity
from dropless.model import Transformer
from dropless.model.loss import LOSS_IMPLS
from dropless.ops.backends import list_backends
from dropless.train.compile import check_compile_moe
from dropless.train.config import model_args
from dropless.train.data import check_data_config
from dropless.train.dist import DistEnv, check_device, check_dist_backend, resolve_ep_size, usable_cores
from dropless.train.metrics import wandb_problem
from dropless.train.shard import apply_fsdp, shard_dense_params


def check_train_config(cfg: DictConfig) -> None:
    """Raise ConfigError for config values that cannot work, from the config alone (before any work).

    Checks the train/optim/logging ranges, ``device``, ``train.loss_impl``, ``dispatcher.ep_size``
    (against torchrun's ``WORLD_SIZE``), the model (:func:`~dropless.train.config.model_args`: every
    field and their relations, e.g. ``n_group`` dividing ``n_routed_experts``; ``model.recompute_gather``
    against the dispatcher), the data
    (:func:`~dropless.train.data.check_data_config`: all its problems in one error, paths included) and
    ``train.seq_len`` against ``model.max_position_embeddings``. ``dropless-train`` calls it
    before it prints the resolved config, so the error is the last thing on the terminal.
    """
    t, o = cfg.train, cfg.optim

    def need(ok: bool, field: str, value: Any, why: str) -> None:
        if not ok:
            shown = str(value).lower() if isinstance(value, bool) else repr(value)  # as YAML spells it
            raise ConfigError(f"{field}={shown}: {why}")

    for name in ("steps", "micro_batch_size", "seq_len", "grad_accum", "val_batches"):
        need(int(t[name]) > 0, f"train.{name}", t[name], "must be a positive integer")
    for name in ("val_every", "ckpt_every"):
        need(int(t[name]) >= 0, f"train.{name}", t[name], "must be >= 0 (0: never / only at the end)")
    need(int(t.ckpt_keep) >= 0, "train.ckpt_keep", t.ckpt_keep, "must be >= 0 (the newest N checkpoints kept; 0: all)")
    need(1 <= int(t.get("ckpt_threads", 1)) <= 64, "train.ckpt_threads", t.get("ckpt_threads"),
         "must lie in [1, 64] (threads writing each rank's checkpoint files, one file each)")
    need(str(t.dtype) in ("auto", "bf16", "fp32"), "train.dtype", t.dtype, "must be auto, bf16 or fp32")
    need(str(t.nonfinite) in ("error", "skip"), "train.nonfinite", t.nonfinite,
         "must be error (stop, naming the step) or skip (skip the optimizer step)")
    need(isinstance(t.compile, bool), "train.compile", t.compile, "must be true or false")
    need(str(t.compile_backend) in ("inductor", "aot_eager", "eager"), "train.compile_backend", t.compile_backend,
         "must be inductor, aot_eager or eager")
    need(isinstance(t.compile_moe, bool), "train.compile_moe", t.compile_moe, "must be true or false")
    need(not t.compile_moe or t.compile, "train.compile_moe", t.compile_moe,
         "compiles the MoE part of each block compiled by train.compile; set train.compile=true as well")
    if t.compile and t.compile_moe:
        check_compile_moe(str(cfg.dispatcher.name), bool(t.activation_checkpointing))
    need(isinstance(t.cuda_graph, bool), "train.cuda_graph", t.cuda_graph, "must be true or false")
    if t.cuda_graph:
        need(str(cfg.dispatcher.name) == "local", "train.cuda_graph", True,
             f"captures forward and backward without collectives, but dispatcher={cfg.dispatcher.name} runs "
             "collectives inside them (the EP dispatchers move tokens between ranks; fsdp all-gathers the "
             "experts); use dispatcher=local or train.cuda_graph=false")
        gemm = str(cfg.model.gemm)  # what the model is built with (the gemm group's, unless model.gemm is set)
        need(gemm == "torch", "train.cuda_graph", True,
             f"is supported with gemm=torch only, got model.gemm={gemm} (gemm=loop reads the expert offsets on "
             "the host, which a capture forbids; the FP8 backends keep their weight cache in host logic that a "
             "replay would skip); use gemm=torch or train.cuda_graph=false")
        need(str(t.get("loss_impl", "auto")) != "liger", "train.cuda_graph", True,
             "with train.loss_impl=liger: Liger-Kernel's fused loss reads a value on the host inside forward, "
             "which a capture forbids; set train.loss_impl=torch")
        need(not t.get("shard_dense", False), "train.cuda_graph", True,
             "train.shard_dense=true all-gathers parameters inside forward and backward (FSDP2), which a "
             "captured graph cannot hold; set one of them to false")
    need(isinstance(cfg.deterministic, bool), "deterministic", cfg.deterministic, "must be true or false")
    check_device(cfg.device)
    check_dist_backend(t.get("dist_backend", "auto"))
    need(str(t.get("loss_impl", "auto")) in LOSS_IMPLS, "train.loss_impl", t.get("loss_impl"),
         f"must be one of {LOSS_IMPLS}")
    # a positive ep_size, and 1 for the dispatchers that keep every expert on every rank (torchrun's
    # WORLD_SIZE stands in for the world size; the mesh itself is checked when the ranks start)
    resolve_ep_size(cfg.dispatcher, int(os.environ.get("WORLD_SIZE", "1")))
    need(isinstance(t.get("shard_dense", False), bool), "train.shard_dense", t.get("shard_dense"),
         "must be true or false")
    # inf passes a range check and trains NaN or nothing; beyond float32's range (the optimizer's
    # arithmetic: the fused AdamW takes them as fp32) they are inf there
    f32_max = torch.finfo(torch.float32).max
    for name in ("lr", "eps", "weight_decay", "min_lr_ratio"):
        need(math.isfinite(float(o[name])) and abs(float(o[name])) <= f32_max, f"optim.{name}", o[name],
             f"must be a finite number within float32's range (|x| <= {f32_max:.4g})")
    need(math.isfinite(float(t.get("dist_timeout_s", 600))), "train.dist_timeout_s", t.get("dist_timeout_s"),
         "must be a finite number of seconds")
    need(0 <= int(cfg.seed) < 2**63, "seed", cfg.seed, "must be an integer in [0, 2^63) (it seeds torch and numpy)")
    need(float(o.lr) > 0, "optim.lr", o.lr, "must be > 0")
    need(int(o.warmup_steps) >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    need(0.0 <= float(o.min_lr_ratio) <= 1.0, "optim.min_lr_ratio", o.min_lr_ratio, "must lie in [0, 1]")
    need(len(o.betas) == 2 and all(0.0 <= float(b) < 1.0 for b in o.betas), "optim.betas", list(o.betas),
         "must be two numbers in [0, 1)")
    need(o.grad_clip is None or float(o.grad_clip) >= 0, "optim.grad_clip", o.grad_clip, "must be >= 0 or null")
    need(float(o.eps) > 0, "optim.eps", o.eps, "must be > 0 (AdamW's denominator term)")
    need(float(o.weight_decay) >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0")
    need(float(t.get("dist_timeout_s", 600)) > 0, "train.dist_timeout_s", t.get("dist_timeout_s"),
         "must be > 0 (seconds a collective may wait for the other ranks)")
    v = cfg.logging.get("peak_flops")
    need(v is None or float(v) > 0, "logging.peak_flops", v,
         "must be > 0 (FLOP/s per device, for MFU), or null (the device's figure from dropless's table)")
    v = cfg.logging.cpu_peak_flops
    need(float(v) > 0, "logging.cpu_peak_flops", v, "must be > 0 (the CPU's assumed FLOP/s per process, for MFU)")
    need(int(cfg.logging.log_every) > 0, "logging.log_every", cfg.logging.log_every, "must be >= 1")
    need(int(cfg.logging.histogram_every) >= 0, "logging.histogram_every", cfg.logging.histogram_every,
         "must be >= 0 (0: never)")
    need(str(cfg.logging.mode) in ("offline", "online", "disabled"), "logging.mode", cfg.logging.mode,
         "must be offline, online or disabled")
    need(cfg.num_threads is None or int(cfg.num_threads) >= 1, "num_threads", cfg.num_threads,
         "must be >= 1 (CPU threads per process), or null for the cores divided by the local processes")
    need(str(o.get("name", "adamw")) == "adamw", "optim.name", o.get("name"),
         "dropless trains with AdamW only (torch.optim.AdamW; configs/optim/adamw.yaml); set optim.name=adamw")
    args = model_args(cfg)
    need(not args.recompute_gather or dispatcher_class(str(cfg.dispatcher.name)).gathers_locally,
         "model.recompute_gather", True,
         f"re-gathers the landed rows from this rank's tokens in backward, but dispatcher={cfg.dispatcher.name} "
         "lands them through a collective; use dispatcher=local or fsdp, or set model.recompute_gather=false")
    need(args.gemm in list_backends(), "gemm.backend (model.gemm)", args.gemm,
         f"not a grouped GEMM backend; choose one of {list_backends()} (gemm=NAME picks configs/gemm/NAME.yaml)")
    check_data_config(cfg.data, args.vocab_size,  # every missing/invalid data field in one error
                      validates=int(cfg.train.val_every) > 0)
    need(not args.tie_word_embeddings, "model.tie_word_embeddings", True,
         "dropless builds DeepSeek-V3's untied output head; set model.tie_word_embeddings=false")
    if cfg.get("init_from") and not cfg.resume:  # (a resumed run may never read it)
        resolve_source(cfg.init_from)
    if int(t.seq_len) > args.max_position_embeddings:
        raise ConfigError(f"train.seq_len={int(t.seq_len)} > model.max_position_embeddings="
                          f"{args.max_position_embeddings}: lower train.seq_len or raise "
                          "model.max_position_embeddings")


def alignment_note(args: ModelArgs, tokens: int, ep_size: int = 1) -> str | None:
    """A warning when ``model.expert_alignment`` lets padding outgrow the routed rows, else None.

    Each local expert's segment of the landed buffer starts on a multiple of ``A``, so a
    chunk's buffer of ``R = T·k / chunks`` routed rows (``tokens`` = ``T``, a rank's tokens per
    micro-batch) has room for ``(e − 1)·(A − 1)`` padding rows beside them (``e`` = local
    experts; :func:`dropless.layout.aligned_capacity`). Padding is never computed on the Triton
    paths but costs memory everywhere, and compute on the torch (CPU) path: a valid but almost
    surely unintended setting when it exceeds ``R``.
    """
    a = int(args.expert_alignment)
    local = local_expert_count(args.n_routed_experts, ep_size)
    rows = tokens * args.num_experts_per_tok // max(1, args.num_token_chunks)
    pad = aligned_capacity(rows, local, a) - rows
    if pad <= rows:
        return None
    return (f"model.expert_alignment={a}: each of the {local} local experts' row segments starts on a multiple "
            f"of {a}, so a chunk's landed buffer can hold {pad:,} padding rows beside its {rows:,} routed rows "
            "(memory on every path, compute on the torch/CPU path); lower it: 1 (the default) unless a "
            "backend needs more, e.g. 128 for gemm=deep_gemm; 8 or 16 are common")


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
    saved = share * SAVED_BYTES_PER_PARAM
    if async_staging:
        cpu = env.device.type == "cpu"
        host = have if cpu else (host_have if host_have is not None else host_memory_bytes(env))
        host_need = saved + (share * STATE_BYTES_PER_PARAM.get(dtype, 16) if cpu else 0)
        if host is not None and host_need > host:
            raise ConfigError(
                f"train.ckpt_async=true copies each checkpoint's {saved / 2**30:.1f} GiB per process into host "
                f"memory{' beside the training state' if cpu else ''}: {host_need / 2**30:.1f} GiB per process, "
                f"more than the {host / 2**30:.1f} GiB of host memory per process ({env.local_world_size} on this "
                "node); use train.ckpt_async=false (saves pause training instead), more nodes, or a smaller model")
    if have is None:
        return
    need = share * STATE_BYTES_PER_PARAM.get(dtype, 16)
    if need > have:
        where = f"the GPU's {have / 2**30:.1f} GiB" if env.device.type == "cuda" else \
            f"{have / 2**30:.1f} GiB of host memory per process ({env.local_world_size} on this node)"
        raise ConfigError(
            f"the model's {total_params / 1e9:.2f} B parameters need at least {need / 2**30:.1f} GiB per process "
            f"for weights, main gradients and AdamW state alone ({STATE_BYTES_PER_PARAM.get(dtype, 16)} bytes a "
            f"parameter at {str(dtype).replace('torch.', '')}, over {env.world_size} rank(s)), more than {where}; "
            "use a smaller model (e.g. model=tiny, or the default recipe on a CPU), more ranks, or a larger device")


def threads_note(cfg: DictConfig, env: DistEnv, cores: int | None = None) -> str | None:
    """A warning when ``num_threads`` times the processes on this node exceeds the cores they may use
    (``cores``, default :func:`~dropless.train.dist.usable_cores`): intra-op threads then wait for
    each other (valid, rarely meant: ``num_threads=1000`` on 2 cores ran the default recipe ≈ 60×
    slower). None for ``num_threads=null`` (the cores shared out) or a count that fits."""
    threads = cfg.get("num_threads")
    cores = usable_cores() if cores is None else cores
    if threads is None or int(threads) * env.local_world_size <= cores:
        return None
    return (f"num_threads={int(threads)} x {env.local_world_size} process(es) on this node is more threads than "
            f"the {cores} core(s) they may use: intra-op threads will wait for each other and run much slower; "
            f"set num_threads=null (the cores shared out: {max(1, cores // env.local_world_size)} each) or fewer")


def dispatcher_note(cfg: DictConfig, env: DistEnv) -> str | None:
    """A warning when an expert-parallel dispatcher (a2a, agrs, deepep) runs at EP = 1: every expert
    stays on this process and no row is sent, so the MoE layers train as ``dispatcher=local`` would
    (valid, rarely meant: one process started without torchrun, or ``dispatcher.ep_size=1``). Else None."""
    name = str(cfg.dispatcher.name)
    if env.ep_size > 1 or not dispatcher_class(name).expert_parallel:
        return None
    if env.world_size == 1:
        how = (f"one process runs EP = 1; for expert parallelism start several: torchrun --nproc_per_node N "
               f"-m dropless.train dispatcher={name}")
    else:
        how = (f"dispatcher.ep_size=1 over {env.world_size} processes; for expert parallelism set "
               "dispatcher.ep_size to more than 1 (or null: all processes)")
    return (f"dispatcher={name}: {how}. At EP = 1 every expert is on every process and no row is sent: "
            "the MoE layers train as dispatcher=local")


def schedule_note(cfg: DictConfig) -> str | None:
    """A warning when ``optim.warmup_steps`` reaches ``train.steps``: the run ends inside the warm-up, so
    the learning rate never reaches ``optim.lr`` and never decays (valid, rarely meant). Else None."""
    warmup, steps = int(cfg.optim.warmup_steps), int(cfg.train.steps)
    if warmup < steps:
        return None
    return (f"optim.warmup_steps={warmup} >= train.steps={steps}: the run ends inside the warm-up, the learning "
            f"rate climbs to {min(1.0, steps / max(1, warmup)):.0%} of optim.lr={cfg.optim.lr} and never decays; "
            f"lower optim.warmup_steps (e.g. {max(0, steps // 10)}) or raise train.steps")


def check_logging(cfg: DictConfig, env: DistEnv) -> None:
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


def build_model(args: ModelArgs, cfg: DictConfig, env: DistEnv, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The Transformer with the configured dispatcher in every MoE layer, initialised (fp32).

    ``dispatcher=local``: the MoE default. Others: ``dropless.dispatch.build_dispatcher``
    with this rank's EP group; ``fsdp`` additionally shards the experts with FSDP2
    (``dropless.train.shard.apply_fsdp``) over the dp mesh dimension. With
    ``train.shard_dense`` the non-expert parameters are FSDP2-sharded over all ranks
    (:func:`dropless.train.shard.shard_dense_params`). With ``dtype`` bf16 those FSDP2
    calls get ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (inputs not
    cast: the activations are bf16 already, the RoPE tables and routing weights stay fp32);
    the other parameters are cast later by :class:`~dropless.train.optim.MasterWeights`.
    """
    name = str(cfg.dispatcher.name)
    factory = None
    if name != "local":
        def factory(layer_id: int):
            return build_dispatcher(name, args, ep_group=env.ep_group)

    with torch.device(env.device):
        model = Transformer(args, dispatcher_factory=factory,
                            activation_checkpointing=bool(cfg.train.activation_checkpointing))
    model.init_weights(int(cfg.seed))
    shard_dense = bool(cfg.train.get("shard_dense", False)) and env.world_size > 1
    mp_policy = None
    if dtype != torch.float32 and (shard_dense or (name == "fsdp" and env.world_size > 1)):
        mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    if name == "fsdp" and env.world_size > 1:
        apply_fsdp(model, env.mesh, root=not shard_dense, mp_policy=mp_policy)  # shard_dense makes the root
    if shard_dense:
        shard_dense_params(model, env.world_size, env.device.type, mp_policy=mp_policy)
    return model
