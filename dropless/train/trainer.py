"""A training run: the parts built from the config, and the loop over the optimizer steps.

:class:`Trainer` builds the run from a composed config (every check and load that can fail comes
before the first step); :meth:`Trainer.train` runs the steps (one step and their pipeline:
:mod:`dropless.train.step`), with the validation and the checkpoint when due. The terminal and the
stop signals are :mod:`dropless.train.console`; the parts a checkpoint holds, each ``Stateful``,
:mod:`dropless.train.state` and :mod:`dropless.train.progress`; the saves and when they are due
:mod:`dropless.train.checkpoint`.

Precision (``train.dtype``; auto = bf16 on CUDA, fp32 on CPU): bf16 parameters (the compute copy)
with fp32 masters, moments and main gradients (:class:`dropless.train.optim.MasterWeights`); fp32
trains the parameters themselves. Learning rate: :func:`dropless.train.optim.lr_at` (``LambdaLR``).

Checkpoints: every ``train.ckpt_every`` steps, at the end, and on SIGINT/SIGTERM (the current step
finishes, all ranks agree through the step's metrics all-reduce, a checkpoint is written, the run
stops: :attr:`Trainer.interrupted`). ``resume=true`` continues from the newest checkpoint in
``run_dir`` with the same masters, optimizer, schedule, step, data position and RNG, so the losses
continue as if never stopped (bitwise on CPU, same thread count). With ``train.ckpt_async`` the
periodic saves are written in the background; the next save, the last one, the one on a signal and
an error that every rank raises (NonFiniteError) first complete the save in flight.
"""

from __future__ import annotations

import datetime
import math
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from dropless.convert import init_from
from dropless.train import checkpoint as ckpt
from dropless.train.compile import compile_blocks
from dropless.train.console import Console, StopSignals, divergence
from dropless.train.data import ShardedLoader, load_tokens, run_val_windows, val_windows
from dropless.train.dist import init_distributed, launch_rank
from dropless.train.grads import GradBuckets, clip_note, folds_clip
from dropless.train.graph import MicroBatchGraphs
from dropless.train.metrics import MetricsLogger, peak_flops
from dropless.train.optim import MasterWeights, RouterBiasUpdate, build_optimizer, build_scheduler, is_dtensor, lr_at
from dropless.train.progress import Progress
from dropless.train.run_dir import claim_run_dir, resolve_run_dir, save_config
from dropless.train.startup import build_model, check_train_config, set_deterministic, start_up
from dropless.train.state import ModelState, OptimizerState, RngState
from dropless.train.step import NonFiniteError, StepLoop
from dropless.train.validation import validation_loss

__all__ = ["Trainer", "lr_at", "NonFiniteError"]

GRAPH_WARMUP = 3  # train.cuda_graph: eager micro-batches of each kind before its capture (compile happens here)


class Trainer(StepLoop):
    """A training run from a composed config (see :func:`dropless.train.config.compose`).

    Construction does every check and load that can fail (config, world size vs mesh, data,
    vocab, run dir, resume) before the first step; :meth:`train` runs the steps.

    Args:
        cfg: the composed config.
    Attributes:
        run_dir, step (optimizer steps done), model, optimizer, scheduler, masters
        (:class:`~dropless.train.optim.MasterWeights`), grads
        (:class:`~dropless.train.grads.GradBuckets`), env, console, warnings (the start-up
        warnings, as printed), interrupted, skipped_steps, history (list of the records logged, rank 0).
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
        self._check(cfg)
        self._load_data(cfg)
        self._build(cfg)
        self._init_steps()
        self.nonfinite_val_steps: list[int] = []  # train.nonfinite=skip: steps whose validation loss was NaN/Inf
        self.interrupted = False
        self.history: list[dict] = []
        self._resume(cfg)
        if self.main:  # only once the run is sure to start (a refused resume leaves the run's own config.yaml)
            note = save_config(self.run_dir, cfg, idle=bool(cfg.resume) and self.step >= self.steps)
            if note:
                self.print(note)
        self.metrics = MetricsLogger(self.run_dir, self.run.logging, OmegaConf.to_container(cfg, resolve=True),
                                     enabled=self.main, resume=bool(cfg.resume), start_step=self.step)
        if self.metrics.note:
            self.print(f"[dropless] {self.metrics.note}")

    def _check(self, cfg: DictConfig) -> None:
        """The config, the world and the machine: every check before the data is read and the run dir made."""
        #: the config as composed (Hydra's DictConfig), and as checked typed objects (the schema's dataclasses)
        self.cfg, self.run = cfg, check_train_config(cfg)
        t = self.run.train
        if self.run.deterministic:
            set_deterministic(self.run.seed)
        self.args = self.run.model  # the validated ModelArgs
        self.seq_len, self.batch, self.accum, self.steps = t.seq_len, t.micro_batch_size, t.grad_accum, t.steps
        self.main = launch_rank() == 0  # rank 0 prints and logs (torchrun's RANK: known before the process group)
        self.console = Console(self.main, self.run.logging.progress)
        self.warnings = self.console.warnings
        self.signals = StopSignals(self.console)
        self.env = env = init_distributed(self.run)
        # what the config asks of this machine, resolved and checked (ConfigError for what it cannot get)
        start = start_up(self.run, env)
        self.dtype, self.param_counts, self.loss_impl = start.dtype, start.param_counts, start.loss_impl
        for note in start.warnings:
            self.console.warn(note)
        self.print(f"[dropless] loss: {start.loss_note}")

    def _load_data(self, cfg: DictConfig) -> None:
        """The tokens, the training loader and the validation batches; then the run directory, claimed."""
        t, env = self.run.train, self.env
        self.run_dir = resolve_run_dir(cfg, env)
        validates = t.val_every > 0
        self.tokens = load_tokens(self.run.data)
        self.loader = ShardedLoader(self.tokens.train, self.seq_len, self.batch, env.rank, env.world_size,
                                    self.run.seed, pin_memory=env.device.type == "cuda")
        self.val_batches, note = run_val_windows(self.tokens.val, self.seq_len, self.batch, t.val_batches,
                                                 env.rank, env.world_size, validates)
        self.console.warn(note)
        #: rank 0's lock on the run directory (one run at a time in it), released by close()
        self.run_dir, self._run_dir_lock = claim_run_dir(self.run_dir, env, fresh=not cfg.run_dir)
        if self._run_dir_lock is not None and self._run_dir_lock.note:
            self.console.warn(self._run_dir_lock.note)

    def _build(self, cfg: DictConfig) -> None:
        """The model (and init_from's weights), its masters, gradient buckets, optimizer and schedule."""
        t, env = self.run.train, self.env
        self.model = build_model(self.args, self.run, env, self.dtype)
        if cfg.init_from and not (cfg.resume and ckpt.latest_checkpoint(self.run_dir)):  # weights only
            where = init_from(self.model, cfg.init_from, mesh=env.mesh if env.ep_size > 1 else None)
            self.print(f"[dropless] init_from: model weights loaded from {where} (the optimizer, step and data "
                       "position start fresh)")
        self.model.train()
        expert = self.model.expert_parameters()
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.expert_fqns = {names[id(p)] for p in expert if id(p) in names}
        self.moe_layers = self.model.moe_layers()
        self.fsdp_params = [p for p in self.model.parameters() if p.requires_grad and is_dtensor(p)]
        #: train.shard_experts: the FSDP2 shards of this EP rank's experts (their norm adds over dp, then EP)
        self.ep_fsdp_ids = {id(p) for p in expert if is_dtensor(p)} if env.ep_size > 1 else set()
        self.masters = MasterWeights(self.model, self.dtype, skip={id(p) for p in self.fsdp_params})
        if t.compile:
            compile_blocks(self.model, t.compile_backend, moe=t.compile_moe)
        # the buckets' own group (its async all-reduces run beside backward), with train.dist_timeout_s
        # (a new group does not inherit the world group's timeout)
        self._grad_group = (dist.new_group(list(range(env.world_size)),
                                           timeout=datetime.timedelta(seconds=t.dist_timeout_s))
                            if env.distributed else None)
        self.grads = GradBuckets(self.masters.compute, {id(p) for p in expert} if env.ep_size > 1 else set(),
                                 self.masters.grads_are_params, env.world_size, self._grad_group, env.dp_group,
                                 env.dp_size, owners=self.masters.masters)
        #: train.cuda_graph: each kind of micro-batch (the step's first, the later ones) runs eagerly for
        #: GRAPH_WARMUP calls, then is captured and replayed as one CUDA graph (dropless/train/graph.py)
        self.graphs = MicroBatchGraphs(self._micro, env.device, GRAPH_WARMUP) if t.cuda_graph else None
        if self.graphs is not None:
            self.grads.overlap = False  # no collective inside a captured backward: all-reduce after the last one
        self.optimizer = build_optimizer(self.masters.named_masters, cfg.optim, warn=self.console.warn)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.steps)
        self.balancer = RouterBiasUpdate(self.model)
        self.balancer.register(self.optimizer)
        for r in self.balancer.routers:  # skip: a non-finite step is skipped by the loss check, not raised
            r.check_finite = t.nonfinite != "skip"
        #: the clip and the non-finite skip are decided on the device (the fused AdamW's grad_scale and
        #: found_inf), so a step's metrics can be read after the next step is launched (iter_steps)
        self.device_guarded = folds_clip(self.optimizer)
        if self.run.optim.grad_clip:
            self.print(f"[dropless] grad clip: {clip_note(self.device_guarded)}")
        self.peak_flops = peak_flops(env.device, self.run.logging)
        self.tokens_per_step = env.world_size * self.accum * self.batch * self.seq_len

    def _resume(self, cfg: DictConfig) -> None:
        """The checkpointer and the parts it saves; with ``resume=true`` and a checkpoint in the run
        directory, their state."""
        t, env = self.run.train, self.env
        #: the step counters, the data position and the LR schedule: the checkpoint's ``trainer`` entry
        self.progress = Progress(self, self.loader, self.scheduler)
        mesh = env.mesh if env.ep_size > 1 else None  # the experts saved as one global tensor each
        #: what a checkpoint holds, by its names there: each part saves and restores itself
        self.app_state = {"model": ModelState(self.masters.state_module, self.expert_fqns, mesh),
                          "optim": OptimizerState(self.masters.state_module, self.optimizer, self.expert_fqns, mesh),
                          "trainer": self.progress, "rng": RngState(env.rank, env.device)}
        #: the saves and when; with train.ckpt_async (and several ranks) it makes the writes' gloo group here
        self.checkpoints = ckpt.Checkpointer(self.run_dir, env, self.app_state, keep=t.ckpt_keep, every=t.ckpt_every,
                                             asynchronous=t.ckpt_async, threads=t.ckpt_threads,
                                             timeout_s=t.dist_timeout_s)
        self.resumed_from: int | None = None
        found = ckpt.latest_checkpoint(self.run_dir) if cfg.resume else None
        if found is None:
            return
        self.grads.detach_()  # get_optimizer_state_dict creates the AdamW state only where no grad is set
        self.checkpoints.load(found[1])
        self.masters.refresh()
        self.resumed_from = self.step
        if self.step < self.steps:
            self.console.warn(ckpt.world_size_note(found[1], env.world_size))

    def print(self, *a: Any) -> None:
        """Print on rank 0 (:meth:`dropless.train.console.Console.print`)."""
        self.console.print(*a)

    # ------------------------------------------------------------------ loop
    def train(self) -> dict[str, Any]:
        """Run the steps from :attr:`step` to ``train.steps``; returns a summary dict.

        Summary: ``steps``, ``wall_s``, ``first_val_loss``, ``val_loss``, ``run_dir``, ``interrupted`` and
        ``diverged``: with ``train.nonfinite=skip``, why the run did not end sound
        (:func:`~dropless.train.console.divergence`), else None; ``dropless-train`` then exits with status 3.

        Raises:
            NonFiniteError: ``train.nonfinite=error`` and a non-finite training loss, gradient norm or
                validation loss (named with its step).
        """
        con, val_every = self.console, self.run.train.val_every
        con.opening(self)
        start, first_val, last_val = time.perf_counter(), None, None
        step0, skipped0, last_skipped = self.step, self.skipped_steps, False
        with self.signals, con.progress(self.steps, self.step) as bar:
            try:
                if self.step == 0 and val_every > 0:
                    first_val = last_val = self._validation()
                    self.metrics.log(0, {"val_loss": first_val})
                    con.print(f"[dropless] step 0 val_loss {first_val:.4f}")
                for rec in self.iter_steps(self.steps, self._due):
                    last = self.step == self.steps
                    last_skipped = not (math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"]))
                    if val_every and (self.step % val_every == 0 or last):
                        rec["val_loss"] = last_val = self._validation()
                        con.print(f"[dropless] step {self.step} loss {rec['loss']:.4f} val_loss {last_val:.4f}")
                    self._log(rec, last)
                    # the postfix first: update() redraws the bar, so it then shows this step's loss
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}", refresh=False)
                    bar.update(1)
                    if self._checkpoint_or_stop(last):
                        break
            except BaseException as e:
                # the save in flight completes only where every rank is sure to take part in it
                every_rank = isinstance(e, Exception) and (not self.env.distributed or isinstance(e, NonFiniteError))
                note = self.checkpoints.after_error(every_rank)
                if note:
                    self.print(note)
                raise
            finally:
                self.metrics.close()
        wall = time.perf_counter() - start
        diverged = None if self.interrupted or self.run.train.nonfinite != "skip" else divergence(
            self.step, self.step - step0, self.skipped_steps - skipped0, last_skipped,
            self.run.train.val_every > 0, self.nonfinite_val_steps)
        con.done(self, wall, step0, first_val, last_val)
        return {"steps": self.step, "wall_s": wall, "first_val_loss": first_val, "val_loss": last_val,
                "run_dir": str(self.run_dir), "interrupted": self.interrupted, "diverged": diverged}

    def _due(self, step: int) -> bool:
        """Whether a validation or a checkpoint follows ``step`` (its record is read before the next starts)."""
        val_every = self.run.train.val_every
        return bool(val_every and step % val_every == 0) or self.checkpoints.due(step)

    def _log(self, rec: dict[str, Any], last: bool) -> None:
        """A step's record to metrics.jsonl/wandb (every ``logging.log_every`` steps, the last, and with a
        validation; the router histograms every ``logging.histogram_every``) and :attr:`history`."""
        lg = self.run.logging
        hist_every = lg.histogram_every
        hist = self._router_counts if hist_every and (self.step % hist_every == 0 or last) else None
        if self.step % lg.log_every == 0 or last or "val_loss" in rec:
            self.metrics.log(self.step, rec, hist_counts=hist)
        if self.main:
            self.history.append({"step": self.step, **rec})

    def _checkpoint_or_stop(self, last: bool) -> bool:
        """After a step: the checkpointer saves where a save is due
        (:meth:`~dropless.train.checkpoint.Checkpointer.step_end`); a stop request ends the run after its
        save (returns True)."""
        stop = self.stopping and not last
        if self.stopping and last:  # the interrupt came during the last step: the run is complete
            self.print(f"[dropless] interrupted during the last step: the run completes "
                       f"(train.steps={self.steps}) and saves as usual")
        self._saved(self.checkpoints.step_end(self.step, last=last, stop=stop))
        if stop:
            self.interrupted = True
            self.print(f"[dropless] stopped at step {self.step}; checkpoint {self.checkpoints.last.path}; continue "
                       f"with resume=true run_dir={self.run_dir}")
        return stop

    def save_checkpoint(self, wait: bool = True) -> Path:
        """Save this step's checkpoint (collective); returns its path. The save in flight, if any,
        completes first (its :class:`~dropless.train.checkpoint.SaveError` is raised here).
        ``wait=False`` with ``train.ckpt_async``: returns once the state is staged in host memory
        and the write goes on in the background; otherwise the checkpoint is complete on return."""
        path = self.checkpoints.save(self.step, wait=wait)
        self._saved(self.checkpoints.last)
        return path

    def _saved(self, note: ckpt.SaveNote | None) -> None:
        """A save's console line (none where ``note`` is None: nothing was saved)."""
        if note is None:
            return
        self.console.saved(note.path, note.paused_s, note.waited, in_background=note.in_background,
                           periodic=note.periodic, ckpt_every=self.checkpoints.every)
        self._t_mark = None

    # ------------------------------------------------------------------ eval
    def validate(self) -> float:
        """Mean validation cross-entropy (nats per token) over every rank's fixed batches
        (:func:`~dropless.train.validation.validation_loss`: a NaN/Inf is returned, :meth:`_validation`
        judges it).

        Raises:
            ConfigError: the validation split holds less than one micro-batch per rank
                (:func:`~dropless.train.data.val_windows`; a run with ``train.val_every=0`` makes its
                micro-batches here, at the first call, so ``data.val_fraction=0`` says so here too)."""
        if not self.val_batches:  # train.val_every=0: none made at the start
            self.val_batches = val_windows(self.tokens.val, self.seq_len, self.batch, self.run.train.val_batches,
                                           self.env.rank, self.env.world_size)
        v = validation_loss(self.model, self.val_batches, self.balancer.routers, self.env, self._loss)
        self._t_mark = None
        return v

    def _validation(self) -> float:
        """:meth:`validate` under ``train.nonfinite``: a non-finite loss raises NonFiniteError naming the step
        (``error``), or is warned about and kept in :attr:`nonfinite_val_steps` for the end of :meth:`train`
        (``skip``: the run then exits with status 3)."""
        v = self.validate()
        if math.isfinite(v):
            return v
        weights = (f"the weights after step {self.step}" if self.step else
                   "the starting weights (initialised, or loaded by init_from)")
        what = f"step {self.step}: non-finite validation loss ({v}): {weights} give NaN/Inf on the validation data"
        if self.run.train.nonfinite == "error":
            raise NonFiniteError(f"{what}. Lower optim.lr or check the data")
        self.nonfinite_val_steps.append(self.step)
        self.print(f"[dropless] WARNING: {what}; train.nonfinite=skip trains on, but the run will end with exit "
                   "status 3")
        return v

    def close(self) -> None:
        """Release the run: close the metrics file and the wandb run (a trainer closed before or
        without :meth:`train`; :meth:`train` closes them itself), drop the gradient hooks on the
        parameters, tear down the process group (if this run made it). A checkpoint still being
        written (``save_checkpoint(wait=False)`` outside :meth:`train`) is completed first. The
        gradient hooks hold the parameters from their C++ side, where the garbage collector cannot
        see the cycle: removed here, or a closed trainer's parameters and fp32 gradient buckets stay
        allocated for the life of the process (as does ``train.ckpt_async``'s pinned host copy).
        """
        try:
            self.checkpoints.finish()  # a save_checkpoint(wait=False) outside train(): complete it
        finally:
            self._release()

    def _release(self) -> None:
        self.metrics.close()
        self.grads.remove()
        if self.graphs is not None:
            self.graphs.reset()  # the graphs' memory pool goes with them
        self.checkpoints.stager = None  # train.ckpt_async on CUDA: its pinned host copy of the state
        if self._run_dir_lock is not None:
            self._run_dir_lock.release()  # another run may now use the directory
        self._closed = True
        if self.env.distributed and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
