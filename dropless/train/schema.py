"""Typed schemas of the run config: one structured-config dataclass per group, and the top level.

Registered by :func:`dropless.train.config.compose` in Hydra's ConfigStore (as ``model/schema``
is for :class:`~dropless.config.ModelArgs`), so a value of the wrong type (``train.steps=abc``,
``optim.betas=0.9``, ``seed=abc``) is a composition error naming the field, before anything is
printed or run. The values themselves live in ``configs/`` (every field here is ``MISSING``:
the YAML gives it). Each group's ``validate()`` owns the rules of its own fields (ranges, choices,
rules between two fields of the group) and raises :class:`~dropless.config.ConfigError` naming the
field; the rules between groups are :func:`dropless.train.startup.check_train_config`, which calls
them.

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

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING

from dropless.config import ConfigError
from dropless.model.loss import LOSS_IMPLS

__all__ = ["BinDataConfig", "DispatcherConfig", "GemmConfig", "LoggingConfig", "OptimConfig", "RunConfig",
           "SCHEMAS", "TextDataConfig", "TrainConfig"]

# OmegaConf reads these annotations at runtime: keep typing.List / Optional (not PEP 604) for Python 3.10.

_F32_MAX = 3.4028234663852886e38  # float32's largest finite value: the fused AdamW takes the hyperparameters as fp32


def need(ok: bool, field: str, value: Any, why: str) -> None:
    """Raise ConfigError ``"field=value: why"`` (the value as YAML spells it) unless ``ok``."""
    if not ok:
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        raise ConfigError(f"{field}={shown}: {why}")


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
    loss_impl: str = MISSING                  # auto | torch | liger: the head + cross-entropy
    nonfinite: str = MISSING                  # error | skip: a NaN/Inf loss or gradient norm
    compile: bool = MISSING                   # torch.compile each decoder block
    compile_backend: str = MISSING            # inductor | aot_eager | eager
    compile_moe: bool = MISSING               # with compile: the MoE router and routed part too (local dispatcher)
    cuda_graph: bool = MISSING                # each micro-batch's forward + backward as one CUDA graph (CUDA, local)

    def validate(self) -> None:
        for name in ("steps", "micro_batch_size", "seq_len", "grad_accum", "val_batches"):
            need(getattr(self, name) > 0, f"train.{name}", getattr(self, name), "must be a positive integer")
        for name in ("val_every", "ckpt_every"):
            need(getattr(self, name) >= 0, f"train.{name}", getattr(self, name),
                 "must be >= 0 (0: never / only at the end)")
        need(self.ckpt_keep >= 0, "train.ckpt_keep", self.ckpt_keep,
             "must be >= 0 (the newest N checkpoints kept; 0: all)")
        need(1 <= self.ckpt_threads <= 64, "train.ckpt_threads", self.ckpt_threads,
             "must lie in [1, 64] (threads writing each rank's checkpoint files, one file each)")
        need(self.dtype in ("auto", "bf16", "fp32"), "train.dtype", self.dtype, "must be auto, bf16 or fp32")
        need(self.nonfinite in ("error", "skip"), "train.nonfinite", self.nonfinite,
             "must be error (stop, naming the step) or skip (skip the optimizer step)")
        need(self.compile_backend in ("inductor", "aot_eager", "eager"), "train.compile_backend",
             self.compile_backend, "must be inductor, aot_eager or eager")
        need(not self.compile_moe or self.compile, "train.compile_moe", self.compile_moe,
             "compiles the MoE part of each block compiled by train.compile; set train.compile=true as well")
        need(self.loss_impl in LOSS_IMPLS, "train.loss_impl", self.loss_impl, f"must be one of {LOSS_IMPLS}")
        need(math.isfinite(self.dist_timeout_s), "train.dist_timeout_s", self.dist_timeout_s,
             "must be a finite number of seconds")
        need(self.dist_timeout_s > 0, "train.dist_timeout_s", self.dist_timeout_s,
             "must be > 0 (seconds a collective may wait for the other ranks)")
        if self.cuda_graph:
            need(self.loss_impl != "liger", "train.cuda_graph", True,
                 "with train.loss_impl=liger: Liger-Kernel's fused loss reads a value on the host inside forward, "
                 "which a capture forbids; set train.loss_impl=torch")
            need(not self.shard_dense, "train.cuda_graph", True,
                 "train.shard_dense=true all-gathers parameters inside forward and backward (FSDP2), which a "
                 "captured graph cannot hold; set one of them to false")


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

    def validate(self) -> None:
        # inf passes a range check and trains NaN or nothing; beyond float32's range they are inf there
        for name in ("lr", "eps", "weight_decay", "min_lr_ratio"):
            v = getattr(self, name)
            need(math.isfinite(v) and abs(v) <= _F32_MAX, f"optim.{name}", v,
                 f"must be a finite number within float32's range (|x| <= {_F32_MAX:.4g})")
        need(self.lr > 0, "optim.lr", self.lr, "must be > 0")
        need(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")
        need(0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio", self.min_lr_ratio, "must lie in [0, 1]")
        need(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), "optim.betas", list(self.betas),
             "must be two numbers in [0, 1)")
        need(self.grad_clip is None or self.grad_clip >= 0, "optim.grad_clip", self.grad_clip, "must be >= 0 or null")
        need(self.eps > 0, "optim.eps", self.eps, "must be > 0 (AdamW's denominator term)")
        need(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must be >= 0")
        need(self.name == "adamw", "optim.name", self.name,
             "dropless trains with AdamW only (torch.optim.AdamW; configs/optim/adamw.yaml); set optim.name=adamw")


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

    def validate(self) -> None:
        need(self.peak_flops is None or self.peak_flops > 0, "logging.peak_flops", self.peak_flops,
             "must be > 0 (FLOP/s per device, for MFU), or null (the device's figure from dropless's table)")
        need(self.cpu_peak_flops > 0, "logging.cpu_peak_flops", self.cpu_peak_flops,
             "must be > 0 (the CPU's assumed FLOP/s per process, for MFU)")
        need(self.log_every > 0, "logging.log_every", self.log_every, "must be >= 1")
        need(self.histogram_every >= 0, "logging.histogram_every", self.histogram_every, "must be >= 0 (0: never)")
        need(self.mode in ("offline", "online", "disabled"), "logging.mode", self.mode,
             "must be offline, online or disabled")


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

    def validate(self) -> None:
        """Every group's own rules (``validate()`` of each), then the top level's own fields."""
        for group in (self.train, self.optim, self.logging):
            group.validate()
        need(0 <= self.seed < 2**63, "seed", self.seed, "must be an integer in [0, 2^63) (it seeds torch and numpy)")
        need(self.num_threads is None or self.num_threads >= 1, "num_threads", self.num_threads,
             "must be >= 1 (CPU threads per process), or null for the cores divided by the local processes")


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
