"""Typed schemas of the run config: one structured-config dataclass per group, and the top level.

Registered by :func:`dropless.train.config.compose` in Hydra's ConfigStore (as ``model/schema``
is for :class:`~dropless.config.ModelArgs`), so a value of the wrong type (``train.steps=abc``,
``optim.betas=0.9``, ``seed=abc``) is a composition error naming the field, before anything is
printed or run. The values themselves live in ``configs/`` (every field here is ``MISSING``:
the YAML gives it); ranges are checked where the values are used
(:func:`dropless.train.startup.check_train_config`, :mod:`dropless.train.dist`).

Adding a config key: one field here (name, type, ``= MISSING``), its meaning in :data:`FIELD_DOCS`
and one line in ``configs/``; then ``python -m dropless.train.docgen`` regenerates
``docs/configuration.md`` (``tests/test_config_docs.py`` fails until it does).

================  ===========================  ===================================
schema            ConfigStore                  used by
================  ===========================  ===================================
RunConfig         ``run_schema``               ``configs/config.yaml`` (top level, ``train:``)
TrainConfig       (RunConfig.train)            ``train:`` in ``configs/config.yaml``
OptimConfig       ``optim/schema``             ``configs/optim/*.yaml``
TextDataConfig    ``data/text_schema``         ``configs/data/stdlib.yaml``
BinDataConfig     ``data/bin_schema``          ``configs/data/bin.yaml``
LoggingConfig     ``logging/schema``           ``configs/logging/*.yaml``
DispatcherConfig  ``dispatcher/schema``        ``configs/dispatcher/*.yaml``
GemmConfig        ``gemm/schema``              ``configs/gemm/*.yaml``
================  ===========================  ===================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING

__all__ = ["BinDataConfig", "DispatcherConfig", "FIELD_DOCS", "GemmConfig", "LoggingConfig", "OptimConfig", "RunConfig",
           "SCHEMAS", "TextDataConfig", "TrainConfig"]

# OmegaConf reads these annotations at runtime: keep typing.List / Optional (not PEP 604) for Python 3.10.


@dataclass
class TrainConfig:
    """``train.*``: the optimizer steps and what runs around them (``configs/config.yaml``)."""

    steps: int = MISSING
    micro_batch_size: int = MISSING
    seq_len: int = MISSING
    grad_accum: int = MISSING
    val_every: int = MISSING
    val_batches: int = MISSING
    ckpt_every: int = MISSING
    ckpt_keep: int = MISSING
    ckpt_async: bool = MISSING
    ckpt_threads: int = MISSING
    activation_checkpointing: bool = MISSING
    shard_dense: bool = MISSING
    dtype: str = MISSING
    dist_timeout_s: float = MISSING
    dist_backend: str = MISSING
    loss_impl: str = MISSING
    nonfinite: str = MISSING
    compile: bool = MISSING
    compile_backend: str = MISSING
    compile_moe: bool = MISSING
    cuda_graph: bool = MISSING


@dataclass
class OptimConfig:
    """``optim.*``: AdamW with linear warmup and cosine decay (``configs/optim/``)."""

    name: str = MISSING
    lr: float = MISSING
    betas: List[float] = MISSING
    weight_decay: float = MISSING
    eps: float = MISSING
    warmup_steps: int = MISSING
    min_lr_ratio: float = MISSING
    grad_clip: Optional[float] = MISSING
    fused: Optional[bool] = None


@dataclass
class TextDataConfig:
    """``data=stdlib``: byte-level tokens from a directory of text files."""

    kind: str = MISSING
    path: Optional[str] = MISSING
    glob: str = MISSING
    vocab_size: int = MISSING
    val_fraction: float = MISSING


@dataclass
class BinDataConfig:
    """``data=bin``: a memory-mapped flat file of token ids."""

    kind: str = MISSING
    path: str = MISSING
    dtype: str = MISSING
    vocab_size: int = MISSING
    val_path: Optional[str] = MISSING
    val_fraction: float = MISSING


@dataclass
class LoggingConfig:
    """``logging.*``: metrics.jsonl, wandb and the progress bar (``configs/logging/``)."""

    mode: str = MISSING
    project: str = MISSING
    entity: Optional[str] = MISSING
    name: Optional[str] = MISSING
    log_every: int = MISSING
    histogram_every: int = MISSING
    peak_flops: Optional[float] = MISSING
    cpu_peak_flops: float = MISSING
    progress: bool = MISSING


@dataclass
class DispatcherConfig:
    """``dispatcher.*`` (``configs/dispatcher/``)."""

    name: str = MISSING
    ep_size: Optional[int] = MISSING


@dataclass
class GemmConfig:
    """``gemm.*`` (``configs/gemm/``)."""

    backend: str = MISSING


@dataclass
class RunConfig:
    """The top level of ``configs/config.yaml``; the groups are typed by their own schemas."""

    recipe: Optional[str] = MISSING
    run_dir: Optional[str] = MISSING
    resume: bool = MISSING
    init_from: Optional[str] = MISSING
    seed: int = MISSING
    deterministic: bool = MISSING
    device: str = MISSING
    num_threads: Optional[int] = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    model: Any = MISSING
    dispatcher: Any = MISSING
    gemm: Any = MISSING
    optim: Any = MISSING
    data: Any = MISSING
    logging: Any = MISSING


#: (ConfigStore group, name, schema): what :func:`dropless.train.config.compose` registers
SCHEMAS = (
    (None, "run_schema", RunConfig),
    ("optim", "schema", OptimConfig),
    ("data", "text_schema", TextDataConfig),
    ("data", "bin_schema", BinDataConfig),
    ("logging", "schema", LoggingConfig),
    ("dispatcher", "schema", DispatcherConfig),
    ("gemm", "schema", GemmConfig),
)


#: What each field means, by schema: the one source of ``docs/configuration.md``
#: (``python -m dropless.train.docgen``). Units are in the text; ranges are checked where the
#: values are used.
FIELD_DOCS: dict[type, dict[str, str]] = {
    RunConfig: {
        "recipe": "name of the applied recipe (each file in `recipes/` sets it); pick one with `recipe=NAME`",
        "run_dir": "where the run writes metrics, config and checkpoints; null: a fresh `runs/YYYYmmdd-HHMMSS` "
                   "under the current directory",
        "resume": "continue from the newest complete checkpoint in `run_dir` (none: start at step 0 and say so)",
        "init_from": "weights to start from: a Hugging Face DeepSeek-V3 directory, a DCP checkpoint or a run "
                     "directory (its newest checkpoint); optimizer, step and data position start fresh",
        "seed": "seed of the weight init and the data order",
        "deterministic": "`torch.use_deterministic_algorithms(True)`, `CUBLAS_WORKSPACE_CONFIG=:4096:8` on CUDA "
                         "and seeded RNGs",
        "device": "`auto` (cuda if available, else cpu) | `cpu` | `cuda`",
        "num_threads": "CPU intra-op threads per process (>= 1); null: the cores divided by the node's processes",
    },
    TrainConfig: {
        "steps": "optimizer steps",
        "micro_batch_size": "sequences per rank per micro-batch",
        "seq_len": "tokens per sequence",
        "grad_accum": "micro-batches per optimizer step",
        "val_every": "steps between validations (also at step 0 and the last step); 0: never",
        "val_batches": "micro-batches per rank per validation",
        "ckpt_every": "steps between checkpoints (and one at the end); 0: only at the end and on Ctrl-C",
        "ckpt_keep": "newest complete checkpoints kept; 0: all",
        "ckpt_async": "periodic checkpoints written in the background from a host copy of the state "
                      "(12 bytes a parameter of host memory; on CUDA pinned and kept for the run)",
        "ckpt_threads": "threads writing each rank's checkpoint files (DCP `FileSystemWriter(thread_count)`)",
        "activation_checkpointing": "recompute each decoder layer in backward",
        "shard_dense": "shard the non-expert parameters over all ranks with FSDP2 (no-op in one process)",
        "dtype": "`auto` (bf16 on CUDA, fp32 on CPU) | `bf16` (bf16 parameters, fp32 masters, main gradients "
                 "and AdamW moments) | `fp32`",
        "dist_timeout_s": "seconds a collective may wait for a peer before the run fails (every process group "
                          "dropless creates)",
        "dist_backend": "process-group backend under torchrun: `auto` (NCCL on CUDA, one GPU per rank; gloo on "
                        "CPU) | `nccl` | `gloo` (with `device=cuda`: several ranks per GPU, rank r on GPU "
                        "r % GPUs, for testing and debugging; slow, collectives go through host memory)",
        "loss_impl": "output head + cross-entropy: `auto` (Liger on CUDA where it imports, else torch) | `torch` "
                     "(chunked, never the whole batch's logits) | `liger`",
        "nonfinite": "a NaN/Inf loss or gradient norm: `error` (stop naming the step, exit 3) | `skip` (skip the "
                     "optimizer step; exit 3 at the end if the run diverged)",
        "compile": "`torch.compile` each decoder block (the MoE router and routed part stay eager)",
        "compile_backend": "`inductor` (CUDA needs triton, CPU a C++ compiler) | `aot_eager` | `eager`",
        "compile_moe": "with `compile`: compile the MoE router and routed part too (`dispatcher=local`, no "
                       "activation checkpointing)",
        "cuda_graph": "each micro-batch's forward + backward replayed as one CUDA graph (CUDA, `dispatcher=local`, "
                      "`gemm=torch`, torch loss, `shard_dense=false`)",
    },
    OptimConfig: {
        "name": "the optimizer: `adamw`",
        "lr": "peak learning rate",
        "betas": "AdamW's [beta1, beta2]",
        "weight_decay": "decoupled weight decay on matrices (dim >= 2); norms, biases and embeddings get none",
        "eps": "AdamW's epsilon",
        "warmup_steps": "linear warmup steps",
        "min_lr_ratio": "the cosine schedule ends at `min_lr_ratio * lr`",
        "grad_clip": "max global gradient norm; 0 or null: no clipping",
        "fused": "AdamW kernel: null = fused on CUDA, foreach on CPU; true = fused anywhere; false = foreach",
    },
    TextDataConfig: {
        "kind": "`text`: byte-level tokens (vocabulary 256) from text files",
        "path": "a directory of text files or one file; null: the Python standard library's source",
        "glob": "which files under `path`, recursively, in sorted path order",
        "vocab_size": "token vocabulary of the data (256 for bytes)",
        "val_fraction": "tail of the token stream held out for validation",
    },
    BinDataConfig: {
        "kind": "`bin`: a memory-mapped flat file of token ids",
        "path": "the `.bin` file (required)",
        "dtype": "`uint16` | `uint32`",
        "vocab_size": "every id must be below it (checked before training; required)",
        "val_path": "a separate validation `.bin`; null: hold out the tail of `path`",
        "val_fraction": "tail held out when `val_path` is null",
    },
    LoggingConfig: {
        "mode": "wandb: `offline` (no network; `wandb sync` later) | `online` (needs a login) | `disabled`",
        "project": "wandb project",
        "entity": "wandb entity; null: the login's default",
        "name": "run name; null: the run directory's name",
        "log_every": "steps between metric records",
        "histogram_every": "steps between per-layer expert-load histograms",
        "peak_flops": "peak FLOP/s per device for MFU; null: from the device table (989e12 for H100/H200 bf16)",
        "cpu_peak_flops": "the CPU's assumed peak FLOP/s per process, for MFU when `peak_flops` is null",
        "progress": "tqdm progress bar on rank 0",
    },
    DispatcherConfig: {
        "name": "how tokens meet their experts: `local` | `a2a` | `agrs` | `fsdp` | `deepep`",
        "ep_size": "expert-parallel size; null: the world size for a2a/agrs/deepep; 1 for local/fsdp",
    },
    GemmConfig: {
        "backend": "grouped-GEMM backend of the routed experts: `torch` | `loop` | `fp8` | `deep_gemm`",
    },
}
