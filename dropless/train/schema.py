"""Typed schemas of the run config: one structured-config dataclass per group, and the top level.

Registered by :func:`dropless.train.config.compose` in Hydra's ConfigStore (as ``model/schema``
is for :class:`~dropless.config.ModelArgs`), so a value of the wrong type (``train.steps=abc``,
``optim.betas=0.9``, ``seed=abc``) is a composition error naming the field, before anything is
printed or run. The values themselves live in ``configs/`` (every field here is ``MISSING``:
the YAML gives it). Each group's ``validate()`` owns the rules of its own fields (ranges, choices,
rules between two fields of the group) and raises :class:`~dropless.config.ConfigError` naming the
field; the rules between groups are :func:`dropless.train.startup.check_train_config`, which calls
them.

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

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, List, Optional

from omegaconf import MISSING

from dropless.config import ConfigError, ModelArgs
from dropless.dispatch.base import Dispatcher
from dropless.dispatch.registry import dispatcher_class
from dropless.model.loss import check_loss_impl

__all__ = ["BIN_ID_BITS", "BinDataConfig", "DispatcherConfig", "FIELD_DOCS", "GemmConfig", "LoggingConfig",
           "OptimConfig", "RunConfig", "SCHEMAS", "TextDataConfig", "TrainConfig", "need", "need_one_of",
           "need_val_fraction", "validate_model"]

# OmegaConf reads these annotations at runtime: keep typing.List / Optional (not PEP 604) for Python 3.10.

#: the values ``device`` takes (``auto``: CUDA where torch sees a GPU, else the CPU)
DEVICES = ("auto", "cpu", "cuda")
#: the values ``train.dist_backend`` takes (``auto``: ``nccl`` on CUDA, ``gloo`` on the CPU)
DIST_BACKENDS = ("auto", "nccl", "gloo")
#: the values ``train.dtype`` takes (``auto``: bf16 on CUDA, fp32 on the CPU)
DTYPES = ("auto", "bf16", "fp32")
#: the values ``train.compile_backend`` takes
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
#: the values ``logging.mode`` takes (wandb's modes)
LOGGING_MODES = ("offline", "online", "disabled")
#: ``data.dtype`` of a ``.bin`` -> bits of one token id (``data.vocab_size`` is at most 2**bits)
BIN_ID_BITS = {"uint16": 16, "uint32": 32}
_F32_MAX = 3.4028234663852886e38  # float32's largest finite value: the fused AdamW takes the hyperparameters as fp32


def need(ok: bool, field: str, value: Any, why: str) -> None:
    """Raise ConfigError ``"field=value: why"`` (the value as YAML spells it) unless ``ok``."""
    if not ok:
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        raise ConfigError(f"{field}={shown}: {why}")


def need_one_of(field: str, value: Any, choices: tuple[str, ...]) -> None:
    """:func:`need` for a field that takes one of ``choices``: ``"field=value: must be a, b or c"``."""
    need(value in choices, field, value, f"must be {', '.join(choices[:-1])} or {choices[-1]}")


def need_val_fraction(value: float) -> None:
    """``data.val_fraction`` (either data group) in [0, 1); 0 only in a run that never validates is a rule
    between groups (:func:`dropless.train.startup.check_train_config`)."""
    need(0.0 <= value < 1.0, "data.val_fraction", value, "must lie in [0, 1) (the tail held out for validation)")


def validate_model(args: ModelArgs) -> ModelArgs:
    """:meth:`ModelArgs.validate <dropless.config.ModelArgs.validate>` with its error named as the run config
    spells it (``model.hidden_size=-8: ...``, and how to override it); returns ``args``."""
    try:
        return args.validate()
    except ConfigError as e:
        raise ConfigError(f"model.{e} (override it on the command line: model.<field>=<value>)") from e


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
    shard_experts: bool = False
    dtype: str = MISSING
    dist_timeout_s: float = MISSING
    dist_backend: str = MISSING
    loss_impl: str = MISSING
    nonfinite: str = MISSING
    compile: bool = MISSING
    compile_backend: str = MISSING
    compile_moe: bool = MISSING
    cuda_graph: bool = MISSING

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
        need_one_of("train.dtype", self.dtype, DTYPES)
        need(self.nonfinite in ("error", "skip"), "train.nonfinite", self.nonfinite,
             "must be error (stop, naming the step) or skip (skip the optimizer step)")
        need_one_of("train.compile_backend", self.compile_backend, COMPILE_BACKENDS)
        need(not self.compile_moe or self.compile, "train.compile_moe", self.compile_moe,
             "compiles the MoE part of each block compiled by train.compile; set train.compile=true as well")
        need(not (self.compile_moe and self.activation_checkpointing), "train.compile_moe", True,
             "with train.activation_checkpointing=true would count each checkpoint recompute's tokens into the "
             "router's balancing load again; set one of them to false")
        check_loss_impl(self.loss_impl)
        need_one_of("train.dist_backend", self.dist_backend, DIST_BACKENDS)
        need(0 < self.dist_timeout_s < math.inf, "train.dist_timeout_s", self.dist_timeout_s,
             "must be a finite number > 0 (seconds a collective may wait for the other ranks)")


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
    path: Optional[str] = MISSING
    glob: str = MISSING
    vocab_size: int = MISSING
    val_fraction: float = MISSING

    def validate(self) -> None:
        """``kind`` text, ``vocab_size`` 256 (one id a byte), ``val_fraction`` in [0, 1); the files are
        :func:`~dropless.train.data.check_data_config`'s."""
        need(self.kind == "text", "data.kind", self.kind, "is text with data=stdlib (data=bin: a .bin of token ids)")
        need(self.vocab_size == 256, "data.vocab_size", self.vocab_size, "must be 256 (byte-level text: id = byte)")
        need_val_fraction(self.val_fraction)


@dataclass
class BinDataConfig:
    """``data=bin``: a memory-mapped flat file of token ids."""

    kind: str = MISSING
    path: str = MISSING
    dtype: str = MISSING
    vocab_size: int = MISSING
    val_path: Optional[str] = MISSING
    val_fraction: float = MISSING

    def validate(self) -> None:
        """``kind`` bin, a ``path``, a ``dtype`` of :data:`BIN_ID_BITS`, ``vocab_size`` that ``dtype`` can hold,
        and ``val_fraction`` in [0, 1) where it is used (``val_path`` null or empty); the files are
        :func:`~dropless.train.data.check_data_config`'s."""
        need(self.kind == "bin", "data.kind", self.kind, "is bin with data=bin (data=stdlib: text files)")
        need(self.path, "data.path", self.path, "is required: the .bin file of token ids")
        need(self.dtype in BIN_ID_BITS, "data.dtype", self.dtype, "must be uint16 or uint32 (one id's width)")
        top = 1 << BIN_ID_BITS[self.dtype]
        need(1 <= self.vocab_size <= top, "data.vocab_size", self.vocab_size, f"must lie in [1, {top}] (data.dtype)")
        if not self.val_path:
            need_val_fraction(self.val_fraction)


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

    def validate(self) -> None:
        need(self.peak_flops is None or self.peak_flops > 0, "logging.peak_flops", self.peak_flops,
             "must be > 0 (FLOP/s per device, for MFU), or null (the device's figure from dropless's table)")
        need(self.cpu_peak_flops > 0, "logging.cpu_peak_flops", self.cpu_peak_flops,
             "must be > 0 (the CPU's assumed FLOP/s per process, for MFU)")
        need(self.log_every > 0, "logging.log_every", self.log_every, "must be >= 1")
        need(self.histogram_every >= 0, "logging.histogram_every", self.histogram_every, "must be >= 0 (0: never)")
        need_one_of("logging.mode", self.mode, LOGGING_MODES)


@dataclass
class DispatcherConfig:
    """``dispatcher.*`` (``configs/dispatcher/``); :attr:`kind` is the class ``name`` names, resolved once."""

    name: str = MISSING
    ep_size: Optional[int] = MISSING

    @cached_property
    def kind(self) -> type[Dispatcher]:
        """The :class:`~dropless.dispatch.base.Dispatcher` subclass of ``name``
        (:func:`~dropless.dispatch.registry.dispatcher_class`: ConfigError for an unknown name)."""
        return dispatcher_class(self.name)

    def validate(self) -> None:
        """A known ``name``, and ``ep_size`` 1 (or null) where the dispatcher keeps every expert on every rank
        (:meth:`~dropless.dispatch.base.Dispatcher.check_ep`). That ``ep_size`` is >= 1 and fits the world and
        the experts is the library's rule (:func:`~dropless.dispatch.mesh.check_ep_size`), which
        :func:`~dropless.train.dist.mesh_shape` asks next."""
        kind = self.kind  # an unknown name raises here
        if self.ep_size is not None:
            kind.check_ep(self.ep_size)


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
    model: Any = MISSING  # a ModelArgs once converted (``model/schema`` types the group)
    dispatcher: Any = MISSING
    gemm: Any = MISSING
    optim: Any = MISSING
    data: Any = MISSING
    logging: Any = MISSING

    def validate(self) -> None:
        """Every group's own rules (``validate()`` of each; the model's: :func:`validate_model`), then the top
        level's own fields."""
        for group in (self.train, self.optim, self.data, self.logging, self.dispatcher):
            group.validate()
        validate_model(self.model)
        need(not self.resume or self.run_dir, "resume", True, "needs run_dir=PATH: the run directory to continue")
        need(0 <= self.seed < 2**63, "seed", self.seed, "must be an integer in [0, 2^63) (it seeds torch and numpy)")
        need_one_of("device", self.device, DEVICES)
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


#: What each field means, by schema: the one source of ``docs/configuration.md``
#: (``python -m dropless.train.docgen``). Units are in the text; ranges are each schema's ``validate()``.
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
        "shard_experts": "shard each rank's routed experts over the dp ranks holding the same experts with FSDP2 "
                         "(EP × FSDP; `a2a`, `agrs`, `deepep`; no-op at dp = 1): their weights, gradients and "
                         "AdamW state / dp",
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
