"""Training metrics: one record per step to ``<run_dir>/metrics.jsonl`` and to wandb.

Every record is a flat JSON object with ``step`` (optimizer steps done) and these keys
(units in the name or below):

==============================  ==============================================================
``loss``                        training cross-entropy, nats per token, mean over the step's
                                micro-batches and all ranks (without the aux loss)
``val_loss``                    validation cross-entropy (nats per token), on validation steps
``aux_loss``                    sequence-wise aux loss summed over MoE layers, mean over the
                                step's micro-batches and all ranks
``lr``                          learning rate of the step
``grad_norm``                   global L2 norm of the gradients before clipping
``skipped_steps``               optimizer steps skipped so far for a non-finite loss or gradient
                                norm (``train.nonfinite=skip``)
``tokens_per_s``                training tokens per second over all ranks (wall time between
                                two steps' metric reads; the first step after start, a
                                validation or a checkpoint from its own start)
``tflops``                      achieved model TFLOP/s per device (FLOPs/token × tokens/s/device)
``mfu``                         tflops / the device's peak (see :func:`peak_flops`)
``peak_mem_gib``                CUDA max allocated, or the process's peak RSS on CPU (GiB)
``expert_load/layer{i}/max_over_mean``, ``.../min_over_mean``, ``.../empty_experts``
                                routed rows per expert over the whole step (all micro-batches,
                                all ranks) divided by their mean; experts that got no row
``rows_dropped``                routed rows dropped by a capacity factor, summed over layers
                                and ranks (0 when dropless)
``dispatch_bytes_sent``, ``dispatch_bytes_received``
                                bytes this rank's dispatchers sent/received (all MoE layers,
                                forward and backward); 0 for ``local``
==============================  ==============================================================

Every ``logging.histogram_every`` steps the per-expert counts of each layer go to wandb as
``expert_load_hist/layer{i}`` (:class:`wandb.Histogram`) and to the jsonl record as
``expert_load/layer{i}/counts`` (a list). wandb writes under ``<run_dir>/wandb`` (offline
by default: ``wandb sync <run_dir>/wandb/offline-run-*`` uploads it later). Only rank 0
writes.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any, Mapping

import torch

from dropless.config import ConfigError
from dropless.train.schema import LoggingConfig

__all__ = ["MetricsLogger", "peak_flops", "peak_memory_gib", "counts_metrics", "wandb_problem", "PEAK_FLOPS_BF16",
           "REQUIRED_KEYS"]

#: Dense bf16 peak FLOP/s per device (vendor data sheets, without sparsity).
PEAK_FLOPS_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
}

#: Keys every training record carries (``val_loss`` on validation steps only).
REQUIRED_KEYS = ("loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "peak_mem_gib",
                 "rows_dropped", "dispatch_bytes_sent", "dispatch_bytes_received", "skipped_steps")


def peak_flops(device: torch.device, logging_cfg: LoggingConfig) -> float | None:
    """Peak FLOP/s of one device for MFU.

    ``logging.peak_flops`` wins when set; else the table :data:`PEAK_FLOPS_BF16` by CUDA
    device name; on CPU ``logging.cpu_peak_flops``. None for an unknown GPU without a
    configured value (MFU is then logged as null).
    """
    if logging_cfg.peak_flops:
        return logging_cfg.peak_flops
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_FLOPS_BF16.items():
            if key in name:
                return value
        return None
    return logging_cfg.cpu_peak_flops


def peak_memory_gib(device: torch.device) -> float:
    """CUDA max allocated bytes on ``device``, else this process's peak RSS, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def counts_metrics(counts: Mapping[str, list[float]]) -> dict[str, float]:
    """Per-layer load statistics from host per-expert counts.

    ``{"layer{i}": [rows per expert, E floats]}`` (the step's, all micro-batches and ranks) ->
    ``expert_load/layer{i}/max_over_mean`` and ``min_over_mean`` (max / min count over the mean;
    0 when no row was routed) and ``expert_load/layer{i}/empty_experts`` (experts with 0 rows).
    """
    out: dict[str, float] = {}
    for layer, c in counts.items():
        mean = sum(c) / max(len(c), 1)
        out[f"expert_load/{layer}/max_over_mean"] = max(c) / mean if mean > 0 else 0.0
        out[f"expert_load/{layer}/min_over_mean"] = min(c) / mean if mean > 0 else 0.0
        out[f"expert_load/{layer}/empty_experts"] = float(sum(1 for v in c if v == 0))
    return out


def _login_hint(mode: str, why: str) -> str:
    """The ConfigError text for a wandb run that cannot start under ``logging.mode=mode``."""
    return (f"logging.mode={mode}: {why}. Log in first (`wandb login`, or set WANDB_API_KEY), or use "
            "logging.mode=offline (sync later with `wandb sync`) or logging.mode=disabled")


def _wandb_has_credentials() -> bool | None:
    """Whether wandb would find credentials without asking: wandb's own lookup for its configured host
    (``WANDB_API_KEY`` or ``WANDB_IDENTITY_TOKEN_FILE``, ``~/.netrc`` / ``$NETRC``, wandb's settings
    file), told not to prompt. No network; a well-formed key is not verified with the server. A wandb
    without that lookup (before its ``wbauth`` module): True when one of the two variables is set,
    else None (unknown: the late error of :class:`MetricsLogger` remains).

    Raises:
        wandb.errors.AuthenticationError: credentials that wandb finds malformed (e.g. a short key).
    """
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib.wbauth import authenticate_session
    except ImportError:
        if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
            return True
        return None
    host = wandb_setup.singleton().settings.base_url
    return authenticate_session(host=host, source="dropless", prompt=False, update_session=False) is not None


def wandb_problem(mode: str) -> str | None:
    """Why ``logging.mode=mode`` cannot start a wandb run in this process, else None; no network.

    ``disabled`` needs nothing. ``offline`` and ``online`` need the wandb package; ``online`` also
    credentials that wandb finds without a prompt (:func:`_wandb_has_credentials`). The trainer
    asks this before it makes the run directory or builds the model; :class:`MetricsLogger` still
    turns a refused ``wandb.init`` (e.g. a key the server rejects) into the same kind of ConfigError.
    """
    if mode == "disabled":
        return None
    try:
        import wandb
    except ImportError as e:
        return (f"logging.mode={mode} logs to wandb, which does not import ({e}); install it "
                "(`pip install wandb`) or set logging.mode=disabled (metrics.jsonl is written either way)")
    if mode != "online":
        return None
    try:
        found = _wandb_has_credentials()
    except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:
        return _login_hint(mode, f"wandb cannot read its credentials ({e})")
    if found is False:
        return _login_hint(mode, "wandb has no credentials (no WANDB_API_KEY, no ~/.netrc entry for its host, "
                                 "no key in its settings), so it cannot start an online run")
    return None


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLogger:
    """Writes records to ``metrics.jsonl`` and wandb (rank 0 only; other ranks no-op).

    Args:
        run_dir: the run directory (exists).
        logging_cfg: the typed ``logging`` group, checked by :meth:`~dropless.train.schema.LoggingConfig.validate`
            (``mode``: offline | online | disabled, ``project``, ``entity``, ``name``: null for the run
            directory's name); read as it is.
        config: the resolved config, stored with the wandb run.
        enabled: False on ranks other than 0.
        resume: reuse the wandb run id stored in ``<run_dir>/wandb_run_id``.
        start_step: the step training continues from (the resumed checkpoint's; 0 for a new
            run). An existing ``metrics.jsonl`` keeps its records up to that step and loses
            the later ones, whose steps are trained again (a run killed after its last
            checkpoint, a torchrun restart); a new run (0) moves an old file aside to
            ``metrics.jsonl.old`` (``.old2``, ... when that exists). :attr:`note` says what was done (None: nothing).
    :attr:`note` also says when a resumed wandb run already holds steps past ``start_step``
    (W&B drops the logs of those steps when they are trained again).
    Raises:
        ConfigError: wandb cannot start the run (``online`` without a login; the trainer has asked
            :func:`wandb_problem` before the run dir, so this is the fallback).
    """

    def __init__(self, run_dir: Path, logging_cfg: LoggingConfig, config: Mapping[str, Any] | None = None,
                 enabled: bool = True, resume: bool = False, start_step: int = 0):
        self.enabled = enabled
        self.note: str | None = None
        self.wandb_run = None
        self._wandb = None
        self.mode = mode = logging_cfg.mode
        if not enabled:
            self._f = None
            return
        run_dir = Path(run_dir)
        self.path = run_dir / "metrics.jsonl"
        self._trim(int(start_step))
        self._f = open(self.path, "a", buffering=1)
        if mode == "disabled":
            return
        import wandb

        self._wandb = wandb
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume and id_file.exists() else None
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            self.wandb_run = wandb.init(
                project=logging_cfg.project, entity=logging_cfg.entity,
                name=logging_cfg.name or run_dir.name, dir=str(run_dir), mode=mode,
                config=dict(config) if config is not None else None, id=run_id,
                resume="allow" if run_id else None,
                # each logger its own run: wandb's default in a script returns the run still open in
                # this process (a trainer not closed), whose records would land in the other run_dir
                reinit="create_new",
                settings=wandb.Settings(console="off", silent=True),
            )
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:
            self._f.close()
            raise ConfigError(_login_hint(mode, f"wandb could not start a run ({e})")) from e
        id_file.write_text(self.wandb_run.id)
        held = int(getattr(self.wandb_run, "step", 0) or 0)  # a resumed run: its next step (history's last + 1)
        if run_id and held > int(start_step) + 1:
            # W&B refuses a step below the run's counter: the steps trained again are dropped there
            msg = (f"wandb: run {run_id} already holds steps up to {held - 1}; W&B drops logs of a step below "
                   f"that, so steps {int(start_step) + 1}-{held - 1}, trained again from the checkpoint, keep their "
                   "earlier values there (metrics.jsonl has the new ones)")
            self.note = msg if self.note is None else f"{self.note}; {msg}"

    def _trim(self, start_step: int) -> None:
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        if start_step == 0:
            old, i = self.path.with_name("metrics.jsonl.old"), 1
            while old.exists():  # never overwrite an earlier one
                i += 1
                old = self.path.with_name(f"metrics.jsonl.old{i}")
            os.replace(self.path, old)
            self.note = f"metrics.jsonl of an earlier start (no checkpoint) moved to {old.name}"
            return
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines():
            try:
                step = int(json.loads(line).get("step", 0))
            except (ValueError, AttributeError):  # a line cut short by a kill
                dropped += 1
                continue
            if step <= start_step:
                kept.append(line)
            else:
                dropped += 1
        if dropped:
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
            self.note = (f"metrics.jsonl: dropped {dropped} record(s) after step {start_step} (the checkpoint "
                         "resumed from); those steps are trained again")

    def log(self, step: int, record: Mapping[str, Any], hist_counts: Mapping[str, Any] | None = None) -> None:
        """Append ``{"step": step, **record}`` to metrics.jsonl and log ``record`` to wandb.

        ``hist_counts`` (``{"layer{i}": [rows per expert]}``, optional): the per-layer expert
        loads, added to the jsonl record as ``expert_load/layer{i}/counts`` and logged to
        wandb as ``expert_load_hist/layer{i}``, a histogram with one bin per expert (bin
        height = the expert's routed rows in the step).
        """
        if not self.enabled:
            return
        rec: dict[str, Any] = {"step": int(step)}
        rec.update({k: _clean(v) for k, v in record.items()})
        wb = {k: v for k, v in record.items() if v is not None}
        for layer, c_E in (hist_counts or {}).items():
            c = [float(v) for v in c_E]
            rec[f"expert_load/{layer}/counts"] = c
            if self._wandb is not None:
                wb[f"expert_load_hist/{layer}"] = self._wandb.Histogram(np_histogram=(c, list(range(len(c) + 1))))
        self._f.write(json.dumps(rec) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(wb, step=int(step))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
