"""Typed schemas of the run config: one structured-config dataclass per group, and the top level.

Registered by :func:`dropless.train.config.compose` in Hydra's ConfigStore (as ``model/schema``
is for :class:`~dropless.config.ModelArgs`), so a value of the wrong type (``train.steps=abc``,
``optim.betas=0.9``, ``seed=abc``) is a composition error naming the field, before anything is
printed or run. The values themselves live in ``configs/`` (every field here is ``MISSING``:
the YAML gives it); ranges are checked where the values are used
(:func:`dropless.train.startup.check_train_config`, :mod:`dropless.train.dist`).

Adding a config key: one field here (name, type, ``= MISSING``) and one line in ``configs/``.

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

__all__ = ["BinDataConfig", "DispatcherConfig", "GemmConfig", "LoggingConfig", "OptimConfig", "RunConfig",
           "SCHEMAS", "TextDataConfig", "TrainConfig"]

# OmegaConf reads these annotations at runtime: keep typing.List / Optional (not PEP 604) for Python 3.10.


@dataclass
class TrainConfig:
    """``train.*``: the optimizer steps and what runs around them (``configs/config.yaml``)."""

    steps: int = MISSING                      # optimizer steps
    micro_batch_size: int = MISSING           # sequences per rank per micro-batch
    seq_len: int = MISSING                    # tokens per sequence
    grad_accum: int = MISSING                 # micro-batches per optimizer step
    val_every: int = MISSING                  # steps between validations; 0: never
    val_batches: int = MISSING                # micro-batches per rank per validation
    ckpt_every: int = MISSING                 # steps between checkpoints; 0: only at the end / on Ctrl-C
    ckpt_keep: int = MISSING                  # newest checkpoints kept; 0: all
    ckpt_async: bool = MISSING                # periodic checkpoints written in the background (a host copy)
    ckpt_threads: int = MISSING               # threads writing each rank's checkpoint files
    activation_checkpointing: bool = MISSING  # recompute each decoder layer in backward
    shard_dense: bool = MISSING               # FSDP2-shard the non-expert parameters over all ranks
    dtype: str = MISSING                      # auto | bf16 | fp32
    dist_timeout_s: float = MISSING           # collective timeout, seconds
    dist_backend: str = MISSING               # auto | nccl | gloo: the process group's backend
    loss_impl: str = MISSING                  # auto | torch | liger: the head + cross-entropy
    nonfinite: str = MISSING                  # error | skip: a NaN/Inf loss or gradient norm
    compile: bool = MISSING                   # torch.compile each decoder block
    compile_backend: str = MISSING            # inductor | aot_eager | eager
    compile_moe: bool = MISSING               # with compile: the MoE router and routed part too (local dispatcher)
    cuda_graph: bool = MISSING                # each micro-batch's forward + backward as one CUDA graph (CUDA, local)


@dataclass
class OptimConfig:
    """``optim.*``: AdamW with linear warmup and cosine decay (``configs/optim/``)."""

    name: str = MISSING
    lr: float = MISSING
    betas: List[float] = MISSING              # two numbers, [beta1, beta2]
    weight_decay: float = MISSING
    eps: float = MISSING
    warmup_steps: int = MISSING
    min_lr_ratio: float = MISSING
    grad_clip: Optional[float] = MISSING      # max global grad norm; 0 or null: none
    fused: Optional[bool] = None              # AdamW kernel: null = fused on CUDA, foreach on CPU; true/false


@dataclass
class TextDataConfig:
    """``data=stdlib``: byte-level tokens from a directory of text files."""

    kind: str = MISSING
    path: Optional[str] = MISSING             # null: the Python standard library
    glob: str = MISSING
    vocab_size: int = MISSING
    val_fraction: float = MISSING


@dataclass
class BinDataConfig:
    """``data=bin``: a memory-mapped flat file of token ids."""

    kind: str = MISSING
    path: str = MISSING
    dtype: str = MISSING                      # uint16 | uint32
    vocab_size: int = MISSING
    val_path: Optional[str] = MISSING
    val_fraction: float = MISSING


@dataclass
class LoggingConfig:
    """``logging.*``: metrics.jsonl, wandb and the progress bar (``configs/logging/``)."""

    mode: str = MISSING                       # offline | online | disabled
    project: str = MISSING
    entity: Optional[str] = MISSING
    name: Optional[str] = MISSING
    log_every: int = MISSING
    histogram_every: int = MISSING
    peak_flops: Optional[float] = MISSING     # FLOP/s per device; null: from the device table
    cpu_peak_flops: float = MISSING
    progress: bool = MISSING


@dataclass
class DispatcherConfig:
    """``dispatcher.*`` (``configs/dispatcher/``)."""

    name: str = MISSING
    ep_size: Optional[int] = MISSING          # null: the world size for a2a/agrs/deepep, 1 for local/fsdp


@dataclass
class GemmConfig:
    """``gemm.*`` (``configs/gemm/``)."""

    backend: str = MISSING


@dataclass
class RunConfig:
    """The top level of ``configs/config.yaml``; the groups are typed by their own schemas."""

    recipe: Optional[str] = MISSING           # the applied recipe's name
    run_dir: Optional[str] = MISSING
    resume: bool = MISSING
    init_from: Optional[str] = MISSING        # HF directory or DCP checkpoint to start from
    seed: int = MISSING
    deterministic: bool = MISSING             # torch.use_deterministic_algorithms + seeds
    device: str = MISSING                     # auto | cpu | cuda
    num_threads: Optional[int] = MISSING      # CPU threads per process; null: cores / local processes
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
