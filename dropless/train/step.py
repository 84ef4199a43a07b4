"""One optimizer step, and the steps pipelined: the base of :class:`dropless.train.trainer.Trainer`.

One optimizer step (:meth:`StepLoop.train_step`)::

    for each of grad_accum micro-batches:   window copied from pinned memory (non_blocking)
        loss = (model.loss(x, y).loss) / grad_accum; backward  (mean CE + Σ MoE layers'
            sequence-wise aux losses [+ MTP]: 1/grad_accum scales them all)
            post-accumulate hooks move each gradient into its fp32 main-gradient bucket;
            on the last micro-batch each full bucket's all-reduce starts at once
            (dropless.train.grads: groups, buckets, the / world scaling)
    finish the all-reduces; grad_norm (device); router counts summed over ranks (device)
    the metrics (loss, aux loss, grad norm, dropped rows, per-expert counts, stop flag): one
        all-reduce, one fp64 vector
    the skip-or-clip decision (:meth:`StepLoop._apply`): fused AdamW in every param group
        (CUDA) decides on the device (dropless.train.grads.guarded_step: a non-finite loss or
        grad norm sets the kernel's found_inf, optim.grad_clip is its grad_scale); otherwise
        (foreach AdamW on CPU) the host reads the metrics first, skips a non-finite step and
        clips in a separate pass only above the threshold (dropless.train.grads.clipped_step)
    optimizer.step (fp32 masters) + step post-hook: router biases += γ·sign(mean − load)
        (dropless.train.optim; a found_inf step moves no bias)
    refresh the bf16 compute weights from the masters; lr scheduler step
    the record: the metrics' ONE host sync; a non-finite step: train.nonfinite=error raises
        NonFiniteError naming it (the weights are those of the step before), skip counts it

:meth:`StepLoop.iter_steps` pipelines the steps where the update is decided on the device: step
N's record is read after step N+1's forward and backward are launched, and N+1's update after
N's read, so an error or a stop at N applies nothing of N+1.

The class is a base: the trainer builds the parts it reads (``model``, ``loader``, ``grads``,
``graphs``, ``masters``, ``optimizer``, ``scheduler``, ``balancer``, ``env``, ``cfg``, ``args``,
``run`` (the typed config), ``console``, ``signals`` and the counters set by :meth:`StepLoop._init_steps`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.profiler import record_function

from dropless.model.params import moe_flops_per_token
from dropless.train.grads import clipped_step, grad_norm, guarded_step
from dropless.train.metrics import counts_metrics, peak_memory_gib
from dropless.train.optim import schedule_step

__all__ = ["NonFiniteError", "StepLoop"]


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


class StepLoop:
    """The optimizer step and its pipeline (see the module docstring)."""

    def _init_steps(self) -> None:
        """The step counters, before the first step (a resume then sets :attr:`step` and :attr:`skipped_steps`)."""
        self.step = 0
        self.skipped_steps = 0
        self.stopping = False  # iter_steps: a stop request was seen; the last record yielded is the last step
        self._launched: _Launched | None = None  # iter_steps: launched, not yet applied
        self._stop_agreed = False
        self._t_mark: float | None = None
        self._router_counts: dict[str, list[int]] = {}
        self._graph_written: dict[str, frozenset[int]] = {}

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
        """Grad norm, the metrics all-reduce and the optimizer step of a launched step; :attr:`step` += 1."""
        env, dev = self.env, self.env.device
        with record_function("dropless.grad_sync"):
            held = [p for p in self.fsdp_params if p.grad is not None]
            fsdp_grads = [p.grad for p in held]
            ep_ids = getattr(self, "ep_fsdp_ids", frozenset())  # train.shard_experts: shards of EP shards
            gnorm = grad_norm(self.grads, [p.grad for p in held if id(p) not in ep_ids], env,
                              [p.grad for p in held if id(p) in ep_ids])
            counts = self.balancer.counts()            # int64 [L, E], summed over ranks
            stop = 1.0 if self.signals.requested else 0.0
            red = torch.stack([fb.loss_sum / self.accum, fb.aux_sum / self.accum,  # means over micro-batches
                               fb.dropped, torch.full((), stop, device=dev)])
            if env.distributed:
                dist.all_reduce(red)
                red[:2] /= env.world_size
            parts = [red, gnorm.reshape(1)] + ([counts.reshape(-1)] if counts is not None else [])
            values = torch.cat([v.double() for v in parts])  # fp64: exact counts
        pending = _Pending(self.step + 1, fb.lr, fb.t0, fb.sent, fb.recv, counts is not None, values=values)
        self._apply(pending, red[0], gnorm, fsdp_grads)
        for p in self.fsdp_params:
            p.grad = None
        schedule_step(self.scheduler)  # a skipped step (train.nonfinite=skip) still counts in the schedule
        self.step = pending.step
        return pending

    def _apply(self, p: _Pending, loss: torch.Tensor, gnorm: torch.Tensor, fsdp_grads: list[torch.Tensor]) -> None:
        """The step's one skip-or-clip decision, and the optimizer step it allows (+ the router biases,
        the optimizer's step post-hook; then the compute weights from the masters).

        :attr:`device_guarded`: decided on the device (the fused AdamW's ``found_inf`` skips a non-finite
        step, its ``grad_scale`` clips) and the metrics go to pinned host memory without a sync.
        Otherwise the metrics are read here (the step's one host sync) and the host decides: a
        non-finite step moves nothing (as on the device; :meth:`_finish` raises or counts it), a norm above
        ``optim.grad_clip`` is clipped in a separate pass.
        """
        clip = self.run.optim.grad_clip or None
        if self.device_guarded:
            with record_function("dropless.optimizer"):
                guarded_step(self.optimizer, gnorm, clip, torch.isfinite(loss) & torch.isfinite(gnorm))
                self.masters.refresh()
            if self.env.device.type == "cuda":
                values, p.values = p.values, torch.empty(p.values.shape, dtype=p.values.dtype, pin_memory=True)
                p.values.copy_(values, non_blocking=True)
                p.event = torch.cuda.Event()
                p.event.record()
            return
        with record_function("dropless.metrics_read"):
            p.host = self._read_metrics(p)
        loss_v, gnorm_v = p.host[0], p.host[4]
        if not (math.isfinite(loss_v) and math.isfinite(gnorm_v)):  # moves nothing; _finish raises or counts it
            self.balancer.discard()
            return
        with record_function("dropless.optimizer"):
            if clip is not None and gnorm_v > clip:  # the host norm is read already: no pass at 1.0
                clipped_step(self.optimizer, self.grads.flats + fsdp_grads, gnorm, clip)
            else:
                self.optimizer.step()
            self.masters.refresh()

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
            what = f"step {p.step}: non-finite training loss ({loss_v}) or gradient norm ({gnorm_v})"
            if self.run.train.nonfinite == "error":
                raise NonFiniteError(f"{what}; the weights are those after step {p.step - 1}. Lower optim.lr, "
                                     "check the data, or set train.nonfinite=skip to skip such steps")
            self.skipped_steps += 1
            self.console.print(f"[dropless] {what}; optimizer step skipped (train.nonfinite=skip; "
                               f"{self.skipped_steps} skipped so far)")
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

    def _comms(self) -> list[Any]:
        """The dispatchers' byte counters (EP dispatchers only)."""
        return [c for c in (getattr(getattr(m, "dispatcher", None), "comm", None) for m in self.moe_layers)
                if c is not None]

    def _stop_requested(self) -> bool:
        """Whether to stop now: alone, a signal since the last check; with several ranks, any rank's
        signal seen at the last step's metrics all-reduce (so that all ranks stop together)."""
        if not self.env.distributed:
            return self.signals.requested
        return self._stop_agreed

