"""The training loop: micro-batches, one host sync for the metrics, the optimizer step, eval, DCP.

One optimizer step (:meth:`Trainer.train_step`)::

    for each of grad_accum micro-batches:   window copied from pinned memory (non_blocking)
        loss = (model.loss(x, y).loss) / grad_accum; backward  (mean CE + Σ MoE layers'
            sequence-wise aux losses [+ MTP]: 1/grad_accum scales them all)
            post-accumulate hooks move each gradient into its fp32 main-gradient bucket;
            on the last micro-batch each full bucket's all-reduce starts at once
            (dropless.train.grads: groups, buckets, the / world scaling)
    finish the all-reduces; grad_norm (device); router counts summed over ranks (device)
    the metrics (loss, aux loss, grad norm, dropped rows, per-expert counts, stop flag): one
        all-reduce, one fp64 vector
    fused AdamW in every param group (CUDA): the update is decided on the device
        (dropless.train.grads.guarded_step): a non-finite loss or grad norm sets the kernel's
        found_inf (nothing moves), optim.grad_clip is folded in as its grad_scale; the metrics
        go to pinned host memory (non_blocking, an event behind them)
    otherwise (foreach AdamW on CPU): ONE host sync reads the metrics first; non-finite skips
        the step, the clip is a separate pass only when the host norm is above the threshold
        (dropless.train.grads.clipped_step)
    optimizer.step (fp32 masters) + step post-hook: router biases += γ·sign(mean − load)
        (dropless.train.optim; a found_inf step moves no bias)
    refresh the bf16 compute weights from the masters; lr scheduler step
    the record: the fused path's ONE host sync (the event, then the pinned copy's .tolist()); a non-finite
        step: train.nonfinite=error raises NonFiniteError naming it (the weights are those of
        the step before), skip counts it (skipped_steps += 1)

:meth:`Trainer.train` runs the steps through :meth:`Trainer.iter_steps`, which pipelines them
where the update is decided on the device: step N's record is read after step N+1's forward and
backward are launched (the host queues N+1's kernels while the GPU finishes N), and N+1's update
after N's read, so an error or a stop at N applies nothing of N+1. Steps before a validation or
a checkpoint, and the last, are read before the next starts.

Precision (``train.dtype``; auto = bf16 on CUDA, fp32 on CPU): bf16 means bf16 parameters
(the compute copy) with fp32 masters, moments and main gradients
(:class:`dropless.train.optim.MasterWeights`); no autocast. fp32 trains the parameters
themselves.

Learning rate: :func:`dropless.train.optim.lr_at` through ``LambdaLR``
(:func:`dropless.train.optim.build_scheduler`).

Checkpoints (:mod:`dropless.train.checkpoint`): every ``train.ckpt_every`` steps, at the
end, and on SIGINT/SIGTERM (Ctrl-C): the signal sets a flag, the current step finishes,
all ranks agree (the flag rides in the step's metrics all-reduce), a checkpoint is written
and the run stops (:attr:`Trainer.interrupted`). A second Ctrl-C more than 3 s after the
first aborts at once (a repeat within 3 s is torchrun forwarding the same Ctrl-C to its
workers). ``resume=true`` continues from the newest checkpoint in ``run_dir``: same fp32
master weights, optimizer, scheduler, step, data position and RNG, so the losses continue
as if never stopped (bitwise on CPU, same thread count). With ``train.ckpt_async`` the periodic
saves are written in the background (:class:`dropless.train.checkpoint.Checkpointer`): training
pauses only while the state is copied to host memory; the next save, the last one, the one on a
signal and an error that every rank raises (NonFiniteError) first complete the save in flight.
"""

from __future__ import annotations

import datetime
import math
import signal
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.profiler import record_function

from dropless.config import ConfigError
from dropless.convert import init_from
from dropless.dispatch.registry import dispatcher_class
from dropless.model.loss import resolve_loss_impl
from dropless.model.params import moe_flops_per_token, param_counts
from dropless.ops.backends import check_backend_device, check_backend_shapes
from dropless.train import checkpoint as ckpt
from dropless.train.compile import check_compile, compile_blocks
from dropless.train.config import model_args
from dropless.train.data import ShardedLoader, load_tokens, val_windows
from dropless.train.dist import init_distributed
from dropless.train.grads import GradBuckets, clipped_step, folds_clip, grad_norm, guarded_step
from dropless.train.graph import MicroBatchGraphs
from dropless.train.metrics import MetricsLogger, counts_metrics, peak_flops, peak_memory_gib
from dropless.train.optim import MasterWeights, RouterBiasUpdate, build_optimizer, build_scheduler, is_dtensor, lr_at
from dropless.train.run_dir import claim_run_dir, resolve_run_dir
from dropless.train.startup import (
    alignment_note,
    build_model,
    check_logging,
    check_state_fits,
    check_train_config,
    compute_dtype,
    config_changes,
    dispatcher_note,
    schedule_note,
    set_deterministic,
    threads_note,
)

__all__ = ["Trainer", "lr_at", "NonFiniteError"]


class NonFiniteError(FloatingPointError):
    """A NaN/Inf training loss, gradient norm or validation loss with ``train.nonfinite=error`` (names the step)."""


@dataclass
class _Launched:
    """One step's micro-batches, launched: the device sums of their losses, and the host's bookkeeping."""

    loss_sum: torch.Tensor      # fp32 0-dim: Σ cross-entropy over the micro-batches
    aux_sum: torch.Tensor       # fp32 0-dim: Σ aux losses
    dropped: torch.Tensor       # fp32 0-dim: Σ rows dropped (capacity factor)
    sent: int                   # dispatcher bytes sent / received (EP dispatchers)
    recv: int
    t0: float                   # perf_counter at launch
    lr: float                   # the step's learning rate
    loader_state: dict          # the data loader before the step's windows were drawn


@dataclass
class _Pending:
    """A step whose update is launched and whose metrics are on their way to the host."""

    step: int
    lr: float
    t0: float
    sent: int
    recv: int
    has_counts: bool
    values: torch.Tensor | None = None          # fp64 [5 (+ L·E)]: on the device, or its pinned host copy
    event: torch.cuda.Event | None = None       # recorded after the copy (CUDA, device-guarded steps)
    host: list[float] | None = None             # read already (steps the host decided)


# ----------------------------------------------------------------------------- checks
_ABORT_AFTER_S = 3.0  # a second SIGINT/SIGTERM later than this after the first aborts at once
GRAPH_WARMUP = 3  # train.cuda_graph: eager micro-batches of each kind before its capture (compile happens here)


# ----------------------------------------------------------------------------- trainer
class Trainer:
    """A training run from a composed config (see :func:`dropless.train.config.compose`).

    Construction does every check and load that can fail (config, world size vs mesh, data,
    vocab, run dir, resume) before the first step; :meth:`train` runs the steps.

    Args:
        cfg: the composed config.
    Attributes:
        run_dir, step (optimizer steps done), model, optimizer, scheduler, masters
        (:class:`~dropless.train.optim.MasterWeights`), grads
        (:class:`~dropless.train.grads.GradBuckets`), env, interrupted, skipped_steps,
        history (list of the records logged, rank 0).
    Raises:
        ConfigError: any bad input, with the field and the fix.
    """

    def __init__(self, cfg: DictConfig):
        try:
            self._start(cfg)
        except BaseException:
            self._failed_start()
            raise

    def _failed_start(self) -> None:
        """A start that failed (a config error found late, an OOM, Ctrl-C): drop the gradient hooks,
        unlock the run directory and remove it if this start made it and it holds nothing else."""
        grads = getattr(self, "grads", None)
        if grads is not None:
            grads.remove()
        lock = getattr(self, "_run_dir_lock", None)
        if lock is not None:
            lock.release()
            lock.remove_if_unused()

    def _start(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        check_train_config(cfg)
        if cfg.deterministic:
            set_deterministic(int(cfg.seed))
        self.args = model_args(cfg)
        t = cfg.train
        self.seq_len, self.batch, self.accum, self.steps = int(t.seq_len), int(t.micro_batch_size), \
            int(t.grad_accum), int(t.steps)
        self.env = env = init_distributed(cfg, self.args.n_routed_experts)
        check_backend_device(self.args.gemm, env.device)  # e.g. gemm=fp8 on a GPU without FP8 tensor cores
        dispatcher_class(cfg.dispatcher.name).check_available()  # e.g. deepep's package, before the run dir
        self.dtype = compute_dtype(t, env.device)
        check_backend_shapes(self.args.gemm, env.device, self.dtype, self.args.hidden_size,
                             self.args.moe_intermediate_size)  # e.g. 16-byte GEMM rows, before the run dir exists
        self.main = env.is_main
        #: the start-up warnings, as printed (``dropless-train`` repeats them below the resolved config,
        #: which would otherwise scroll them off the terminal)
        self.warnings: list[str] = []
        for note in (alignment_note(self.args, self.batch * self.seq_len, env.ep_size), schedule_note(cfg),
                     threads_note(cfg, env), dispatcher_note(cfg, env)):
            if note:
                self._warn(note)
        self.param_counts = param_counts(self.args)
        check_state_fits(self.param_counts.total, self.dtype, env,  # else an OOM kill while building
                         async_staging=bool(t.get("ckpt_async", False)))
        self.loss_impl, loss_note = resolve_loss_impl(t.get("loss_impl", "auto"), env.device,
                                                         bool(t.get("cuda_graph")))
        # what needs the device, before the data is read and the run dir is made
        if t.compile:
            check_compile(env.device, str(t.compile_backend))
        if t.get("cuda_graph") and env.device.type != "cuda":  # (loss_impl=liger: check_train_config refuses it)
            raise ConfigError(f"train.cuda_graph=true: CUDA graphs need a CUDA GPU, but the run's device is "
                              f"{env.device}; set train.cuda_graph=false (or device=cuda on a GPU machine)")
        check_logging(cfg, env)  # e.g. logging.mode=online without a wandb login
        self.print(f"[dropless] loss: {loss_note}")
        self.run_dir = resolve_run_dir(cfg, env)
        validates = int(t.val_every) > 0
        self.tokens = load_tokens(cfg.data, self.args.vocab_size, validates)
        self.loader = ShardedLoader(self.tokens.train, self.seq_len, self.batch, env.rank, env.world_size,
                                    int(cfg.seed), pin_memory=env.device.type == "cuda")
        try:
            self.val_batches = val_windows(self.tokens.val, self.seq_len, self.batch, int(t.val_batches),
                                           env.rank, env.world_size)
        except ConfigError:
            if validates:
                raise
            self.val_batches = []  # too small a split (or data.val_fraction=0) for a run that never validates
        if len(self.val_batches) < int(t.val_batches) and int(t.val_every) > 0:
            self._warn(f"train.val_batches={int(t.val_batches)}: the validation split holds "
                       f"{len(self.val_batches)} micro-batch(es) per rank; validating on those (for more, "
                       "a larger data.val_fraction, or with data=bin a longer data.val_path file)")
        #: rank 0's lock on the run directory (one run at a time in it), released by close()
        self.run_dir, self._run_dir_lock = claim_run_dir(self.run_dir, env, fresh=not cfg.run_dir)
        if self._run_dir_lock is not None and self._run_dir_lock.note:
            self._warn(self._run_dir_lock.note)

        self.model = build_model(self.args, cfg, env, self.dtype)
        if cfg.get("init_from") and not (cfg.resume and ckpt.latest_checkpoint(self.run_dir)):  # weights only
            where = init_from(self.model, cfg.init_from, mesh=env.mesh if env.ep_size > 1 else None)
            self.print(f"[dropless] init_from: model weights loaded from {where} (the optimizer, step and data "
                       "position start fresh)")
        self.model.train()
        expert = self.model.expert_parameters()
        self.expert_ids = {id(p) for p in expert}
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.expert_fqns = {names[id(p)] for p in expert if id(p) in names}
        self.moe_layers = self.model.moe_layers()
        self.fsdp_params = [p for p in self.model.parameters() if p.requires_grad and is_dtensor(p)]
        self.masters = MasterWeights(self.model, self.dtype, skip={id(p) for p in self.fsdp_params})
        if t.compile:
            compile_blocks(self.model, str(t.compile_backend), moe=bool(t.compile_moe))
        sharded = self.expert_ids if env.ep_size > 1 else set()
        # the buckets' own group (its async all-reduces run beside backward); new groups do not
        # inherit the world group's timeout, so it is given again: a stalled peer fails the step
        # within train.dist_timeout_s instead of torch's 30-minute default
        self._grad_group = (dist.new_group(list(range(env.world_size)),
                                           timeout=datetime.timedelta(seconds=float(t.dist_timeout_s)))
                            if env.distributed else None)
        self.grads = GradBuckets(self.masters.compute, sharded, self.masters.grads_are_params, env.world_size,
                                 self._grad_group, env.dp_group, env.dp_size, owners=self.masters.masters)
        #: train.cuda_graph: each kind of micro-batch (the step's first, the later ones) runs eagerly for
        #: GRAPH_WARMUP calls, then is captured and replayed as one CUDA graph (dropless/train/graph.py)
        self.graphs = MicroBatchGraphs(self._micro, env.device, GRAPH_WARMUP) if t.get("cuda_graph") else None
        self._graph_written: dict[str, frozenset[int]] = {}
        if self.graphs is not None:
            self.grads.overlap = False  # no collective inside a captured backward: all-reduce after the last one
        self.optimizer = build_optimizer(self.masters.named_masters, cfg.optim, warn=self._warn)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.steps)
        self.balancer = RouterBiasUpdate(self.model)
        self.balancer.register(self.optimizer)
        #: the clip and the non-finite skip are decided on the device (the fused AdamW's grad_scale and
        #: found_inf), so a step's metrics can be read after the next step is launched (iter_steps)
        self.device_guarded = folds_clip(self.optimizer)
        if cfg.optim.grad_clip:
            self.print("[dropless] grad clip: " + ("inside the fused AdamW kernel (optimizer.grad_scale)"
                                                   if self.device_guarded else
                                                   "scaled in a separate pass over the gradients (only the "
                                                   "fused AdamW, the default on CUDA or with optim.fused=true, "
                                                   "folds it in)"))

        self.peak_flops = peak_flops(env.device, cfg.logging)
        self.tokens_per_step = env.world_size * self.accum * self.batch * self.seq_len

        self.step = 0
        self.skipped_steps = 0
        self.nonfinite_val_steps: list[int] = []  # train.nonfinite=skip: steps whose validation loss was NaN/Inf
        self.interrupted = False
        self.stopping = False  # iter_steps: a stop request was seen; the last record yielded is the last step
        self._launched: _Launched | None = None  # iter_steps: launched, not yet applied
        self._stop_signal: int | None = None
        self._stop_time = 0.0
        self._stop_agreed = False
        self._t_mark: float | None = None
        self.history: list[dict] = []
        self.resumed_from: int | None = None
        skip = str(t.nonfinite) == "skip"
        for r in self.balancer.routers:  # skip: a non-finite step is skipped by the loss check, not raised
            r.check_finite = not skip
        #: the saves; with train.ckpt_async (and several ranks) it makes the writes' gloo group here
        self.checkpoints = ckpt.Checkpointer(self.run_dir, env, keep=int(t.get("ckpt_keep", 0) or 0),
                                             asynchronous=bool(t.get("ckpt_async", False)),
                                             threads=int(t.get("ckpt_threads", 1)),
                                             timeout_s=float(t.get("dist_timeout_s", 600)))
        if cfg.resume:
            found = ckpt.latest_checkpoint(self.run_dir)
            if found is not None:
                self.grads.detach_()  # get_state_dict creates the AdamW state only where no grad is set
                st = ckpt.load(found[1], self.masters.state_module, self.optimizer, self._trainer_state(), env,
                               self.expert_fqns)
                self.masters.refresh()
                self.step = int(st["step"])
                self.skipped_steps = int(st["skipped_steps"])
                self.loader.load_state_dict({"epoch": st["data_epoch"], "offset": st["data_offset"]})
                sd = self.scheduler.state_dict()
                sd.update(last_epoch=int(st["lr_step"]), _step_count=int(st["lr_step"]) + 1)
                self.scheduler.load_state_dict(sd)
                # the lr from the scheduler's position (with EP, ckpt.load re-reads the optimizer's
                # param groups after loading, so their saved lr does not survive it)
                for g, base, lam in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                        self.scheduler.lr_lambdas):
                    g["lr"] = base * lam(self.scheduler.last_epoch)
                self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
                self.resumed_from = self.step
                saved_world = ckpt.saved_world_size(found[1])
                if saved_world is not None and saved_world != env.world_size and self.step < self.steps:
                    self._warn(f"resume: {found[1].name} was saved by {saved_world} rank(s), this run has "
                               f"{env.world_size}: the weights and optimizer state carry over, but each rank's "
                               "shard of the training windows changes with the rank count, so the rest of this "
                               "data epoch is not the uninterrupted run's (some windows seen again, some left "
                               "to the next epoch), and the tokens per step scale with the ranks (the learning-"
                               "rate schedule counts optimizer steps)")
        if self.main:  # only once the run is sure to start (a refused resume leaves the run's own config.yaml)
            self._save_config()
        self.metrics = MetricsLogger(self.run_dir, cfg.logging, OmegaConf.to_container(cfg, resolve=True),
                                     enabled=self.main, resume=bool(cfg.resume), start_step=self.step)
        if self.metrics.note:
            self.print(f"[dropless] {self.metrics.note}")

    def _save_config(self) -> None:
        """Write ``config.yaml``; on a resume, first say which values differ from the saved one. A
        resume with nothing left to train keeps the saved file: it still describes the checkpoints."""
        cfg_file = self.run_dir / "config.yaml"
        idle = bool(self.cfg.resume) and self.step >= self.steps and cfg_file.exists()
        if self.cfg.resume and cfg_file.exists():
            changed = config_changes(OmegaConf.load(cfg_file), self.cfg)
            if changed:
                more = f" (and {len(changed) - 8} more)" if len(changed) > 8 else ""
                how = "not saved: nothing is left to train" if idle else "this one is used and saved"
                self.print(f"[dropless] resume: this config differs from the run's config.yaml ({how}): "
                           + ", ".join(changed[:8]) + more)
        if not idle:
            cfg_file.write_text(OmegaConf.to_yaml(self.cfg, resolve=True))

    # ------------------------------------------------------------------ helpers
    def _trainer_state(self) -> dict[str, int]:
        d = self.loader.state_dict()
        return {"step": self.step, "data_epoch": d["epoch"], "data_offset": d["offset"],
                "lr_step": self.scheduler.last_epoch, "skipped_steps": self.skipped_steps}

    def _loss(self, x: torch.Tensor, y: torch.Tensor):
        """:meth:`Transformer.loss` of one micro-batch, the one model call: ``(loss, ce, aux, mtp)``."""
        return self.model.loss(x, y, loss_impl=self.loss_impl)

    def _micro(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One micro-batch on the device window ``w [B, S + 1]``: forward, loss, backward (gradients into
        the main-gradient buckets by their hooks); returns 0-dim fp32 ``(ce, aux, rows dropped)``.
        What :class:`~dropless.train.graph.MicroBatchGraphs` captures with ``train.cuda_graph``."""
        with record_function("dropless.forward"):
            out = self._loss(w[:, :-1], w[:, 1:])
        with record_function("dropless.backward"):
            (out.loss / self.accum).backward()  # CE + aux losses (+ MTP): 1/accum scales them all
        ds = [d for d in (moe.last_stats.get("rows_dropped") for moe in self.moe_layers) if d is not None]
        # one stack and sum for all layers (not two small kernels per layer)
        drop = torch.stack(ds).sum().float() if ds else torch.zeros((), dtype=torch.float32, device=w.device)
        return out.ce.detach().float(), out.aux.detach().float(), drop

    @staticmethod
    def _read_metrics(p: _Pending) -> list[float]:
        """The step's one host sync: every logged scalar, read in one ``.tolist()`` (of the device
        tensor, or of its pinned host copy once the step's event has passed)."""
        if p.event is not None:
            p.event.synchronize()
        return p.values.tolist()

    def print(self, *a: Any) -> None:
        if self.main:
            from tqdm import tqdm
            tqdm.write(" ".join(str(x) for x in a), file=sys.stdout)

    def _warn(self, note: str) -> None:
        """Print a start-up warning (rank 0) and keep it in :attr:`warnings`."""
        self.warnings.append(note)
        self.print(f"[dropless] warning: {note}")

    def save_checkpoint(self, wait: bool = True) -> Path:
        """Save this step's checkpoint (collective); returns its path. The save in flight, if any,
        completes first (its :class:`~dropless.train.checkpoint.SaveError` is raised here).
        ``wait=False`` with ``train.ckpt_async``: returns once the state is staged in host memory
        and the write goes on in the background; otherwise the checkpoint is complete on return."""
        t0 = time.perf_counter()
        path = self.checkpoints.save(self.step, self.masters.state_module, self.optimizer, self._trainer_state(),
                                     self.expert_fqns, wait=wait)
        paused = time.perf_counter() - t0
        waited = self.checkpoints.waited
        if waited is not None and waited[1] >= 1.0 and not wait:  # a periodic save caught up with the write
            self.print(f"[dropless] checkpoint {path.name}: waited {waited[1]:.1f} s for {waited[0].name}'s "
                       f"background write to finish (saves {int(self.cfg.train.ckpt_every)} steps apart come "
                       "faster than one is written): raise train.ckpt_every, or set train.ckpt_async=false")
        elif waited is not None and waited[1] >= 1.0:  # the last save (or a signal's): part of its pause
            self.print(f"[dropless] checkpoint {path.name}: waited {waited[1]:.1f} s for {waited[0].name}'s "
                       "background write to finish first")
        if self.checkpoints.pending is not None:
            self.print(f"[dropless] checkpoint {path.name}: training paused {paused:.1f} s (staged in host memory "
                       "and written in the background; complete at the next save)")
        else:
            self.print(f"[dropless] checkpoint {path.name} saved: training paused {paused:.1f} s")
        self._t_mark = None
        return path

    def _finish_checkpoint_after(self, err: BaseException) -> None:
        """After ``err`` left the loop: complete the save in flight where every rank is sure to take part
        (one process, or an error that every rank raises at the same step), else leave it (never loaded):
        another error may have left a rank behind, and an abort (a second Ctrl-C) does not wait."""
        if self.checkpoints.pending is None:
            return
        if not isinstance(err, Exception) or (self.env.distributed and not isinstance(err, NonFiniteError)):
            self.print(f"[dropless] the checkpoint being written ({self.checkpoints.pending.path.name}) is left "
                       "incomplete (never loaded); resume=true uses the newest complete one")
            self.checkpoints.pending = None
            return
        try:
            path = self.checkpoints.finish()
            self.print(f"[dropless] checkpoint {path.name} complete")
        except Exception as e:  # noqa: BLE001 - err is the error to report; this one is only told
            self.print(f"[dropless] {e}")

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def validate(self) -> float:
        """Mean validation cross-entropy (nats per token) over every rank's fixed batches.

        The routers' non-finite-logit check is off here: NaN/Inf weights give a NaN loss, the same on
        every rank after the all-reduce, instead of an error raised on the ranks whose batches met it.
        :meth:`train` judges the value (:meth:`_validation`).

        Raises:
            ConfigError: the run has no validation micro-batches (``train.val_every=0`` with
                ``data.val_fraction=0`` or a split smaller than one micro-batch per rank)."""
        if not self.val_batches:
            raise ConfigError("no validation micro-batches: this run has train.val_every=0 and a validation split "
                              "too small for one micro-batch per rank (or data.val_fraction=0); raise "
                              "data.val_fraction or give data.val_path")
        self.model.eval()
        dev = self.env.device
        routers = self.balancer.routers
        checks = [r.check_finite for r in routers]
        for r in routers:
            r.check_finite = False
        try:
            total = torch.zeros(2, dtype=torch.float64, device=dev)
            for x, y in self.val_batches:
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                total[0] += self._loss(x, y).ce.double() * y.numel()  # the mean over y's tokens
                total[1] += y.numel()
            if self.env.distributed:
                dist.all_reduce(total)
        finally:
            for r, c in zip(routers, checks):
                r.check_finite = c
            self.model.train()
        self._t_mark = None
        return float(total[0] / total[1])

    def _validation(self) -> float:
        """:meth:`validate` under ``train.nonfinite``: a non-finite loss raises NonFiniteError naming the step
        (``error``), or is warned about and kept in :attr:`nonfinite_val_steps` for the end of :meth:`train`
        (``skip``: the run then exits with status 3)."""
        v = self.validate()
        if math.isfinite(v):
            return v
        weights = (f"the weights after step {self.step}" if self.step else
                   "the starting weights (initialised, or loaded by init_from)")
        if str(self.cfg.train.nonfinite) == "error":
            raise NonFiniteError(f"step {self.step}: non-finite validation loss ({v}): {weights} give NaN/Inf on the "
                                 "validation data. Lower optim.lr or check the data")
        self.nonfinite_val_steps.append(self.step)
        self.print(f"[dropless] WARNING: step {self.step}: non-finite validation loss ({v}): {weights} give NaN/Inf "
                   "on the validation data; train.nonfinite=skip trains on, but the run will end with exit status 3")
        return v

    def _divergence(self, trained: int, skipped: int, last_skipped: bool) -> str | None:
        """``train.nonfinite=skip``: why a run of ``trained`` steps (``skipped`` of them skipped) did not end
        sound, or None. Unsound: a validation loss was non-finite; every step was skipped; or the last step
        was skipped with ``train.val_every=0``, so nothing shows the final weights give a finite loss."""
        if str(self.cfg.train.nonfinite) != "skip" or trained == 0:
            return None
        why = []
        if skipped == trained:
            why.append(f"every optimizer step of the run ({trained}) was skipped for a non-finite loss or gradient "
                       "norm: nothing was trained")
        elif self.nonfinite_val_steps or (last_skipped and not int(self.cfg.train.val_every)):
            why.append(f"{skipped} of {trained} optimizer steps were skipped for a non-finite loss or gradient norm")
            if last_skipped and not int(self.cfg.train.val_every):
                why.append(f"the last step ({self.step}) among them, with no validation (train.val_every=0) to show "
                           "that the final weights give a finite loss")
        if self.nonfinite_val_steps:
            at = ", ".join(map(str, self.nonfinite_val_steps))
            why.append(f"the validation loss was non-finite at step{'s' if ',' in at else ''} {at}")
        if not why:
            return None
        return (f"training diverged (train.nonfinite=skip): {'; '.join(why)}. The checkpoint of step {self.step} "
                "holds the weights of the last step applied; lower optim.lr or check the data")

    # ------------------------------------------------------------------ step
    def train_step(self) -> dict[str, Any]:
        """One optimizer step; returns its metrics record (every rank computes the same).

        The forward and backward, the update and the metrics read of one step, in that order
        (:meth:`iter_steps` overlaps the read with the next step's forward and backward).

        Raises:
            NonFiniteError: a NaN/Inf loss or gradient norm with ``train.nonfinite=error``.
            RuntimeError: the trainer was closed (:meth:`close` removed its gradient hooks).
        """
        self._drop_launched()  # an iter_steps left early (e.g. a break) that was not closed yet
        return self._finish(self._update(self._forward_backward()))

    def iter_steps(self, until: int, finish_at: Any = None) -> Iterator[dict[str, Any]]:
        """Run optimizer steps until :attr:`step` reaches ``until``, yielding each step's record in order.

        Where the update is decided on the device (:attr:`device_guarded`: fused AdamW in every
        param group) the steps are pipelined: step ``N``'s metrics are read (the step's one host
        sync) only after step ``N+1``'s forward and backward are launched, so the host queues the
        next step's kernels while the GPU still runs this step's backward and optimizer instead of
        waiting for it; step ``N+1``'s update is launched after step ``N``'s record is read (a
        non-finite step ``N`` raises before anything of ``N+1`` is applied). A step for which
        ``finish_at(step)`` is true, and the last one, is read before the next one starts (for
        validation and checkpoints). :attr:`step` equals the record's step when it is yielded.
        A stop request (Ctrl-C, or any rank's, agreed through the metrics all-reduce) seen at a
        read drops the step launched behind it (its router counts discarded, the data loader
        rewound to its start), sets :attr:`stopping` and ends the iteration after that record.
        Leaving early (``break``, an error raised in the caller's loop or here) drops the launched
        step the same way, when the generator closes or at the next ``iter_steps``/``train_step``,
        so the data and the router counts continue where the last record left them. An error in
        step ``N+1``'s forward or backward still yields step ``N``'s record (applied already) first.
        Without :attr:`device_guarded` every step is read before its update (no overlap).

        Raises:
            NonFiniteError: as :meth:`train_step`.
        """
        self.stopping = False
        self._drop_launched()
        pending: _Pending | None = None
        try:
            while self.step < until:
                try:
                    self._launched = self._forward_backward()
                except Exception:
                    if pending is not None:  # the step before is applied: its record still comes out first
                        rec, pending = self._finish(pending), None
                        yield rec
                    raise
                if pending is not None:
                    rec, pending = self._finish(pending), None
                    if self._stop_requested():
                        self._drop_launched()
                        self.stopping = True
                        yield rec
                        return
                    yield rec
                    if self._launched is None:  # a later iter_steps/train_step dropped it: this one is stale
                        return
                launched, self._launched = self._launched, None
                pending = self._update(launched)
                if not self.device_guarded or self.step >= until or (finish_at is not None and finish_at(self.step)):
                    rec, pending = self._finish(pending), None
                    self.stopping = self._stop_requested()
                    yield rec
                    if self.stopping:
                        return
        finally:  # an error, or a caller that left early: the step launched behind the last record is dropped
            self._drop_launched()

    def _drop_launched(self) -> None:
        """Abandon the step :meth:`iter_steps` launched and did not apply, if there is one."""
        if getattr(self, "_launched", None) is not None:
            launched, self._launched = self._launched, None
            self._abandon(launched)

    def _forward_backward(self) -> _Launched:
        """Launch one step's micro-batches (forward, backward, gradient all-reduces)."""
        if getattr(self, "_closed", False):
            raise RuntimeError("Trainer.train_step: this trainer was closed (close() removed its gradient hooks, "
                               "so its steps would see no gradients); build a new Trainer to train again")
        dev = self.env.device
        for comm in self._comms():  # count this step's traffic only (not the validation's)
            comm.reset()
        t0 = time.perf_counter()
        lr = float(self.optimizer.param_groups[0]["lr"])
        loader_state = self.loader.state_dict()
        self.grads.zero_()
        loss_sum = torch.zeros((), dtype=torch.float32, device=dev)
        aux_sum = torch.zeros((), dtype=torch.float32, device=dev)
        dropped = torch.zeros((), dtype=torch.float32, device=dev)
        for i in range(self.accum):
            w = self.loader.next_window()  # pinned on CUDA
            self.grads.start(sync=i == self.accum - 1)
            if self.graphs is not None:
                kind = "first" if i == 0 else "rest"  # copies into the main gradients, or adds
                (ce, aux, drop), replayed = self.graphs(kind, w)
                if replayed:  # the hooks' host-side record of the main gradients written ran at capture only
                    self._graph_written.setdefault(kind, self.grads.written())
                    self.grads.mark_written(self._graph_written[kind])
            else:
                ce, aux, drop = self._micro(w.to(dev, non_blocking=True))
            loss_sum += ce
            aux_sum += aux
            dropped += drop
        with record_function("dropless.grad_sync"):
            self.grads.finish()
        sent = recv = 0
        for comm in self._comms():
            b = comm.reset()
            sent += int(b.get("bytes_sent", 0))
            recv += int(b.get("bytes_received", 0))
        return _Launched(loss_sum, aux_sum, dropped, sent, recv, t0, lr, loader_state)

    def _update(self, fb: _Launched) -> _Pending:
        """Grad norm, the metrics all-reduce and the optimizer step of a launched step; :attr:`step` += 1.

        :attr:`device_guarded`: the fused AdamW's own ``found_inf`` skips a non-finite step and its
        ``grad_scale`` clips, both computed on the device, and the metrics go to pinned host memory
        without a sync. Otherwise the metrics are read here (the host decides the clip and the skip).
        """
        env, dev = self.env, self.env.device
        with record_function("dropless.grad_sync"):
            fsdp_grads = [p.grad for p in self.fsdp_params if p.grad is not None]
            gnorm = grad_norm(self.grads, fsdp_grads, env)
            counts = self.balancer.counts()            # int64 [L, E], summed over ranks
            stop = 1.0 if self._stop_signal is not None else 0.0
            red = torch.stack([fb.loss_sum / self.accum, fb.aux_sum / self.accum,  # means over micro-batches
                               fb.dropped, torch.full((), stop, device=dev)])
            if env.distributed:
                dist.all_reduce(red)
                red[:2] /= env.world_size
            parts = [red, gnorm.reshape(1)] + ([counts.reshape(-1)] if counts is not None else [])
            values = torch.cat([v.double() for v in parts])  # fp64: exact counts
        step = self.step + 1
        clip = float(self.cfg.optim.grad_clip) if self.cfg.optim.grad_clip else None
        pending = _Pending(step, fb.lr, fb.t0, fb.sent, fb.recv, counts is not None)
        if self.device_guarded:
            with record_function("dropless.optimizer"):
                finite = torch.isfinite(red[0]) & torch.isfinite(gnorm)
                guarded_step(self.optimizer, gnorm, clip, finite)  # + RouterBiasUpdate (step post-hook)
                self.masters.refresh()
            if dev.type == "cuda":
                pending.values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                pending.values.copy_(values, non_blocking=True)
                pending.event = torch.cuda.Event()
                pending.event.record()
            else:
                pending.values = values
        else:
            with record_function("dropless.metrics_read"):
                pending.values = values
                pending.host = self._read_metrics(pending)  # the one host sync
            loss_v, gnorm_v = pending.host[0], pending.host[4]
            if math.isfinite(loss_v) and math.isfinite(gnorm_v):
                with record_function("dropless.optimizer"):
                    if clip is not None and gnorm_v > clip:  # the host norm is read already: no pass at 1.0
                        clipped_step(self.optimizer, self.grads.flats + fsdp_grads, gnorm, clip)  # + RouterBiasUpdate
                    else:
                        self.optimizer.step()               # + RouterBiasUpdate (step post-hook)
                    self.masters.refresh()
            elif str(self.cfg.train.nonfinite) == "error":
                raise self._nonfinite_error(step, loss_v, gnorm_v)
            else:
                self.balancer.discard()
        for p in self.fsdp_params:
            p.grad = None
        with warnings.catch_warnings():  # a skipped step (train.nonfinite=skip) still counts in the schedule
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()
        self.step = step
        return pending

    def _finish(self, p: _Pending) -> dict[str, Any]:
        """Read a step's metrics (its one host sync, unless :meth:`_update` read them) and make its record.

        Raises:
            NonFiniteError: the step's loss or gradient norm is not finite and ``train.nonfinite=error``
                (the update was skipped on the device: the weights are those after the step before).
        """
        host = p.host if p.host is not None else self._read_metrics(p)
        loss_v, aux_v, dropped_v, stop_v, gnorm_v = host[:5]
        self._stop_agreed = stop_v > 0
        if not (math.isfinite(loss_v) and math.isfinite(gnorm_v)):
            if str(self.cfg.train.nonfinite) == "error":
                raise self._nonfinite_error(p.step, loss_v, gnorm_v)
            self.skipped_steps += 1
            self.print(f"[dropless] step {p.step}: non-finite loss ({loss_v}) or gradient norm ({gnorm_v}); "
                       f"optimizer step skipped (train.nonfinite=skip; {self.skipped_steps} skipped so far)")
        now = time.perf_counter()
        dt = now - (self._t_mark if self._t_mark is not None else p.t0)
        self._t_mark = now
        tok_s = self.tokens_per_step / dt
        rows = self.args.num_experts_per_tok
        if self.moe_layers and dropped_v:
            rows -= dropped_v / (self.tokens_per_step * len(self.moe_layers))
        fpt = moe_flops_per_token(self.args, self.seq_len, rows)
        flops_dev = fpt * tok_s / self.env.world_size
        rec: dict[str, Any] = {
            "loss": loss_v, "aux_loss": aux_v, "lr": p.lr, "grad_norm": gnorm_v,
            "tokens_per_s": tok_s, "tflops": flops_dev / 1e12,
            "mfu": flops_dev / self.peak_flops if self.peak_flops else None,
            "peak_mem_gib": peak_memory_gib(self.env.device), "step_time_s": dt,
            "tokens": p.step * self.tokens_per_step,
            "rows_dropped": dropped_v, "dispatch_bytes_sent": p.sent, "dispatch_bytes_received": p.recv,
            "skipped_steps": self.skipped_steps,
        }
        self._router_counts = {}
        if p.has_counts:
            E = self.args.n_routed_experts
            flat = host[5:]
            for j, r in enumerate(self.balancer.routers):
                self._router_counts[f"layer{r.layer_id}"] = [int(v) for v in flat[j * E:(j + 1) * E]]
            rec.update(counts_metrics(self._router_counts))
        return rec

    def _abandon(self, fb: _Launched) -> None:
        """Drop a launched step that will not be applied (a stop seen at the previous step's read):
        its router counts are discarded and the data loader rewound to where the step began."""
        self.balancer.discard()
        self.loader.load_state_dict(fb.loader_state)
        for p in self.fsdp_params:
            p.grad = None

    def _nonfinite_error(self, step: int, loss_v: float, gnorm_v: float) -> NonFiniteError:
        return NonFiniteError(f"step {step}: non-finite training loss ({loss_v}) or gradient norm ({gnorm_v}); the "
                              f"weights are those after step {step - 1}. Lower optim.lr, check the data, or set "
                              "train.nonfinite=skip to skip such steps")

    def _comms(self) -> list[Any]:
        """The dispatchers' byte counters (EP dispatchers only)."""
        return [c for c in (getattr(getattr(m, "dispatcher", None), "comm", None) for m in self.moe_layers)
                if c is not None]

    # ------------------------------------------------------------------ loop
    def _on_signal(self, signum, frame):  # noqa: ARG002
        if self._stop_signal is not None:
            # torchrun forwards the terminal's Ctrl-C to its workers, which then see it twice
            # within milliseconds: only a repeat after _ABORT_AFTER_S aborts.
            if time.monotonic() - self._stop_time > _ABORT_AFTER_S:
                raise KeyboardInterrupt
            return
        self._stop_signal, self._stop_time = signum, time.monotonic()
        if self.main:
            print(f"\n[dropless] {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
                  "(again to abort)", file=sys.stderr, flush=True)

    def _stop_requested(self) -> bool:
        """Whether to stop now: alone, a signal since the last check; with several ranks, any rank's
        signal seen at the last step's metrics all-reduce (so that all ranks stop together)."""
        if not self.env.distributed:
            return self._stop_signal is not None
        return self._stop_agreed

    def train(self) -> dict[str, Any]:
        """Run the steps from :attr:`step` to ``train.steps``; returns a summary dict.

        Summary: ``steps``, ``wall_s``, ``first_val_loss``, ``val_loss``, ``run_dir``, ``interrupted`` and
        ``diverged``: with ``train.nonfinite=skip``, why the run did not end sound (a non-finite validation
        loss, every step skipped, or the last step skipped with no validation after it), else None;
        ``dropless-train`` then exits with status 3.

        Raises:
            NonFiniteError: ``train.nonfinite=error`` and a non-finite training loss, gradient norm or
                validation loss (named with its step).
        """
        from tqdm import tqdm

        cfg, t = self.cfg, self.cfg.train
        env = self.env
        if self.main:
            pc = self.param_counts
            self.print(f"[dropless] run dir {self.run_dir}")
            self.print(f"[dropless] model: {pc.total / 1e6:.2f}M parameters, {pc.activated / 1e6:.2f}M activated "
                       f"per token; {self.args.num_moe_layers} MoE layers of E={self.args.n_routed_experts} "
                       f"k={self.args.num_experts_per_tok}; dispatcher={cfg.dispatcher.name}")
            self.print(f"[dropless] world {env.world_size} = dp {env.dp_size} x ep {env.ep_size} on "
                       f"{env.device.type}, {torch.get_num_threads()} thread(s)/process; "
                       f"{self.tokens_per_step:,} tokens per step")
            self.print(f"[dropless] data: {self.tokens.source}")
            if self.resumed_from is not None and self.step >= self.steps:
                self.print(f"[dropless] the run in {self.run_dir} already finished: its newest checkpoint is at step "
                           f"{self.step} and train.steps={self.steps}; nothing to train (raise train.steps to "
                           "continue it)")
            elif self.resumed_from is not None:
                self.print(f"[dropless] resumed from step {self.resumed_from}")
            elif cfg.resume:
                self.print("[dropless] resume=true but no checkpoint in run_dir: starting at step 0")
        old = {}
        import threading
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                old[s] = signal.signal(s, self._on_signal)
        val_every, ckpt_every = int(t.val_every), int(t.ckpt_every)
        hist_every = int(cfg.logging.histogram_every)
        log_every = int(cfg.logging.log_every)
        bar = tqdm(total=self.steps, initial=self.step, disable=not (self.main and cfg.logging.progress),
                   desc="train", unit="step", dynamic_ncols=True, mininterval=1.0, file=sys.stderr)
        start, first_val, last_val = time.perf_counter(), None, None
        step0, skipped0, last_skipped = self.step, self.skipped_steps, False
        try:
            if self.step == 0 and val_every > 0:
                first_val = last_val = self._validation()
                self.metrics.log(0, {"val_loss": first_val})
                self.print(f"[dropless] step 0 val_loss {first_val:.4f}")

            def finish_at(step: int) -> bool:  # validation and checkpoints see a finished step
                return bool((val_every and step % val_every == 0) or (ckpt_every and step % ckpt_every == 0))

            for rec in self.iter_steps(self.steps, finish_at):
                last = self.step == self.steps
                last_skipped = not (math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"]))
                if val_every and (self.step % val_every == 0 or last):
                    rec["val_loss"] = last_val = self._validation()
                    self.print(f"[dropless] step {self.step} loss {rec['loss']:.4f} val_loss {last_val:.4f}")
                hist = self._router_counts if hist_every and (self.step % hist_every == 0 or last) else None
                if self.step % log_every == 0 or last or "val_loss" in rec:
                    self.metrics.log(self.step, rec, hist_counts=hist)
                if self.main:
                    self.history.append({"step": self.step, **rec})
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}", refresh=False)
                if self.stopping and last:  # the interrupt came during the last step: the run is complete
                    self.print(f"[dropless] interrupted during the last step: the run completes "
                               f"(train.steps={self.steps}) and saves as usual")
                elif self.stopping:
                    self.interrupted = True
                    path = self.save_checkpoint()
                    self.print(f"[dropless] stopped at step {self.step}; checkpoint {path}; continue with "
                               f"resume=true run_dir={self.run_dir}")
                    break
                if last or (ckpt_every and self.step % ckpt_every == 0):
                    self.save_checkpoint(wait=last)  # train.ckpt_async: the periodic ones in the background
        except BaseException as e:
            self._finish_checkpoint_after(e)
            raise
        finally:
            bar.close()
            for s, h in old.items():
                signal.signal(s, h)
            self.metrics.close()
        wall = time.perf_counter() - start
        diverged = None if self.interrupted else self._divergence(self.step - step0, self.skipped_steps - skipped0,
                                                                 last_skipped)
        summary = {"steps": self.step, "wall_s": wall, "first_val_loss": first_val, "val_loss": last_val,
                   "run_dir": str(self.run_dir), "interrupted": self.interrupted, "diverged": diverged}
        if self.main and not self.interrupted and self.step == self.resumed_from:
            self.print(f"[dropless] done: nothing to train, the run's newest checkpoint is at step {self.step} and "
                       f"train.steps={self.steps}; metrics {self.run_dir / 'metrics.jsonl'}")
        elif self.main and not self.interrupted:
            if last_val is None:
                v = "not measured (train.val_every=0)"
            elif first_val is None:
                v = f"{last_val:.4f}"
            else:
                v = f"{first_val:.4f} -> {last_val:.4f}"
            skipped = f" ({self.skipped_steps} optimizer steps skipped: non-finite)" if self.skipped_steps else ""
            done = (f"steps {self.resumed_from} -> {self.step} ({self.step - self.resumed_from} trained)"
                    if self.resumed_from else f"{self.step} steps")
            self.print(f"[dropless] done: {done} in {wall:.1f}s{skipped}{self._speed_note(step0)}; val_loss {v}; "
                       f"metrics {self.run_dir / 'metrics.jsonl'}")
        return summary

    def _speed_note(self, step0: int) -> str:
        """``"; median N tokens/s (MFU m %), peak memory p GiB"`` over the steps after ``step0`` (rank 0's
        records; the median, so the first steps' compiling and CUDA-graph capture do not count; the
        memory is :func:`~dropless.train.metrics.peak_memory_gib`'s: CUDA allocated, else the RSS)."""
        recs = [r for r in self.history if r["step"] > step0]
        if not recs:
            return ""
        note = f"; median {statistics.median(r['tokens_per_s'] for r in recs):,.0f} tokens/s"
        if recs[-1]["mfu"] is not None:
            note += f" (MFU {100 * statistics.median(r['mfu'] for r in recs):.1f} %)"
        return note + f", peak memory {max(r['peak_mem_gib'] for r in recs):.1f} GiB"

    def close(self) -> None:
        """Release the run: close the metrics file and the wandb run (a trainer closed before or
        without :meth:`train`; :meth:`train` closes them itself), drop the gradient hooks on the
        parameters, tear down the process group (if this run made it). A checkpoint still being
        written (``save_checkpoint(wait=False)`` outside :meth:`train`) is completed first.

        The hooks (:class:`~dropless.train.grads.GradBuckets`' post-accumulate-grad hooks, bound
        methods holding the buckets and every parameter) sit in the parameters' C++ side, where
        Python's garbage collector cannot see the cycle: without removing them, the parameters and
        the fp32 gradient buckets of a closed trainer stayed allocated for the life of the process
        (a second trainer in one process, e.g. ``benchmarks/train_step.py``'s next variant, then
        ran with the first one's ~17 GiB still resident at ``recipe=h200_single``). The pinned host
        copy that ``train.ckpt_async`` keeps on CUDA is dropped here too.
        """
        checkpoints = getattr(self, "checkpoints", None)
        try:
            if checkpoints is not None:
                checkpoints.finish()  # a save_checkpoint(wait=False) outside train(): complete it
        finally:
            self._release()

    def _release(self) -> None:
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
        grads = getattr(self, "grads", None)
        if grads is not None:
            grads.remove()
        if getattr(self, "graphs", None) is not None:
            self.graphs.reset()  # the graphs' memory pool goes with them
        checkpoints = getattr(self, "checkpoints", None)
        if checkpoints is not None:
            checkpoints.stager = None  # train.ckpt_async on CUDA: its pinned host copy of the state
        lock = getattr(self, "_run_dir_lock", None)
        if lock is not None:
            lock.release()  # another run may now use the directory
        self._closed = True
        if self.env.distributed and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
