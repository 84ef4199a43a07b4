"""The training loop: AdamW + warmup/cosine, accumulation, clipping, router bias update, eval, DCP.

One optimizer step (:meth:`Trainer.train_step`)::

    for each of grad_accum micro-batches:   (model.loss(x, y).loss / grad_accum).backward()
        (loss = mean CE + Σ MoE layers' sequence-wise aux losses: 1/grad_accum scales both)
    sync gradients          non-expert: all_reduce SUM over all ranks, / world (with
                            train.shard_dense: FSDP2's reduce-scatter, averaged, instead)
                            expert, EP > 1: all_reduce SUM over dp (the ranks holding the same
                            experts), / world — an EP dispatcher already summed the EP
                            group's contributions on the owner (dropless/dispatch/mesh.py)
                            FSDP2 DTensors (dispatcher=fsdp): reduced by FSDP2, left alone
    grad_norm               global L2 norm (expert shards summed over their ranks), clip
    optimizer.step          lr from :func:`lr_at`
    update_router_biases    counts summed over micro-batches and ranks, bias += γ·sign(...)

Learning rate (:func:`lr_at`, ``step`` = 0-based index of the optimizer step): linear warmup
``lr · (step + 1) / warmup_steps`` for ``step < warmup_steps``, then cosine from ``lr`` to
``min_lr_ratio · lr`` at the last step (``steps - 1``).

Autocast: bf16 on CUDA by default (``train.dtype=auto``), fp32 on CPU; the master weights,
the optimizer state, the logits and the loss stay fp32.

Checkpoints (:mod:`dropless.train.checkpoint`): every ``train.ckpt_every`` steps, at the
end, and on SIGINT/SIGTERM (Ctrl-C): the signal sets a flag, the current step finishes,
all ranks agree (a MAX all-reduce of the flag), a checkpoint is written and the run stops
(:attr:`Trainer.interrupted`). A second Ctrl-C more than 3 s after the first aborts at once
(a repeat within 3 s is torchrun forwarding the same Ctrl-C to its workers). ``resume=true`` continues
from the newest checkpoint in ``run_dir``: same model, optimizer, step, data position and
RNG, so the losses continue as if never stopped (bitwise on CPU, same thread count).
"""

from __future__ import annotations

import math
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from dropless.config import ConfigError, ModelArgs
from dropless.model.loss import resolve_loss_impl
from dropless.convert import init_from
from dropless.train import checkpoint as ckpt
from dropless.train.config import model_args
from dropless.train.data import ShardedLoader, load_tokens, val_windows
from dropless.train.dist import DistEnv, init_distributed
from dropless.train.metrics import MetricsLogger, load_metrics, peak_flops, peak_memory_gib

__all__ = ["Trainer", "lr_at", "check_train_config", "build_optimizer", "resolve_run_dir"]


# ----------------------------------------------------------------------------- schedule
def lr_at(step: int, optim_cfg: Any, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine.

    ``lr·(step+1)/warmup`` for ``step < warmup``; then
    ``min + (lr − min)·½(1 + cos(π·p))``, ``p = (step − warmup)/max(1, total − 1 − warmup)``
    clamped to [0, 1], ``min = min_lr_ratio·lr`` (SGDR cosine, Loshchilov & Hutter 2017).
    """
    lr = float(optim_cfg.lr)
    warmup = int(optim_cfg.warmup_steps)
    lo = float(optim_cfg.min_lr_ratio) * lr
    if step < warmup:
        return lr * (step + 1) / warmup
    p = min(1.0, max(0.0, (step - warmup) / max(1, total_steps - 1 - warmup)))
    return lo + (lr - lo) * 0.5 * (1.0 + math.cos(math.pi * p))


# ----------------------------------------------------------------------------- checks
def check_train_config(cfg: DictConfig) -> None:
    """Raise ConfigError for train/optim/logging values that cannot work (before any work)."""
    t, o = cfg.train, cfg.optim

    def need(ok: bool, field: str, value: Any, why: str) -> None:
        if not ok:
            raise ConfigError(f"{field}={value!r}: {why}")

    for name in ("steps", "micro_batch_size", "seq_len", "grad_accum", "val_batches"):
        need(int(t[name]) > 0, f"train.{name}", t[name], "must be a positive integer")
    for name in ("val_every", "ckpt_every"):
        need(int(t[name]) >= 0, f"train.{name}", t[name], "must be >= 0 (0: never / only at the end)")
    need(str(t.dtype) in ("auto", "bf16", "fp32"), "train.dtype", t.dtype, "must be auto, bf16 or fp32")
    need(isinstance(t.get("shard_dense", False), bool), "train.shard_dense", t.get("shard_dense"),
         "must be true or false")
    need(float(o.lr) > 0, "optim.lr", o.lr, "must be > 0")
    need(int(o.warmup_steps) >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    need(0.0 <= float(o.min_lr_ratio) <= 1.0, "optim.min_lr_ratio", o.min_lr_ratio, "must lie in [0, 1]")
    need(len(o.betas) == 2 and all(0.0 <= float(b) < 1.0 for b in o.betas), "optim.betas", list(o.betas),
         "must be two numbers in [0, 1)")
    need(o.grad_clip is None or float(o.grad_clip) >= 0, "optim.grad_clip", o.grad_clip, "must be >= 0 or null")
    need(int(cfg.logging.log_every) > 0, "logging.log_every", cfg.logging.log_every, "must be >= 1")
    need(int(cfg.logging.histogram_every) >= 0, "logging.histogram_every", cfg.logging.histogram_every,
         "must be >= 0 (0: never)")
    need(str(cfg.logging.mode) in ("offline", "online", "disabled"), "logging.mode", cfg.logging.mode,
         "must be offline, online or disabled")
    need(cfg.num_threads is None or int(cfg.num_threads) >= 1, "num_threads", cfg.num_threads,
         "must be >= 1 (CPU threads per process), or null for the cores divided by the local processes")


def resolve_run_dir(cfg: DictConfig, env: DistEnv) -> Path:
    """The run directory, the same on every rank (rank 0 picks a fresh dated name by default).

    Raises:
        ConfigError: ``resume=true`` without ``run_dir``; ``resume=false`` and ``run_dir``
            already holds checkpoints (a new run would mix with the old one).
    """
    if cfg.run_dir:
        run_dir = Path(str(cfg.run_dir)).expanduser()
    else:
        if cfg.resume:
            raise ConfigError("resume=true needs run_dir=PATH: the run directory to continue")
        name = None
        if env.is_main:
            base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
            run_dir, i = base, 1
            while run_dir.exists():
                i += 1
                run_dir = Path(f"{base}-{i}")
            name = str(run_dir)
        if env.distributed:
            box = [name]
            dist.broadcast_object_list(box, src=0)
            name = box[0]
        run_dir = Path(name)
    if not cfg.resume:
        found = ckpt.latest_checkpoint(run_dir)
        if found is not None:
            raise ConfigError(f"run_dir={str(run_dir)!r} already holds a checkpoint (step {found[0]}): pass "
                              "resume=true to continue it, or give a new run_dir")
    return run_dir.resolve()


# ----------------------------------------------------------------------------- model / optim
def build_model(args: ModelArgs, cfg: DictConfig, env: DistEnv) -> torch.nn.Module:
    """The Transformer with the configured dispatcher in every MoE layer, initialised.

    ``dispatcher=local``: the MoE default. Others: ``dropless.dispatch.build_dispatcher``
    with this rank's EP group; ``fsdp`` additionally shards the experts with FSDP2
    (``dropless.train.shard.apply_fsdp``) over the dp mesh dimension. With
    ``train.shard_dense`` the non-expert parameters are FSDP2-sharded over all ranks
    (:func:`dropless.train.shard.shard_dense_params`).
    """
    from dropless.model import Transformer

    name = str(cfg.dispatcher.name)
    factory = None
    if name != "local":
        from dropless.dispatch import build_dispatcher

        def factory(layer_id: int):
            return build_dispatcher(name, args, ep_group=env.ep_group)

    with torch.device(env.device):
        model = Transformer(args, dispatcher_factory=factory,
                            activation_checkpointing=bool(cfg.train.activation_checkpointing))
    model.init_weights(int(cfg.seed))
    shard_dense = bool(cfg.train.get("shard_dense", False)) and env.world_size > 1
    if name == "fsdp" and env.world_size > 1:
        from dropless.train.shard import apply_fsdp

        apply_fsdp(model, env.mesh, root=not shard_dense)  # shard_dense makes the root itself
    if shard_dense:
        from dropless.train.shard import shard_dense_params

        shard_dense_params(model, env.world_size, env.device.type)
    return model


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def build_optimizer(model: torch.nn.Module, optim_cfg: Any) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices (dim >= 2) except the token embedding."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "tok_embeddings" not in name else no_decay).append(p)
    any_dt = any(_is_dtensor(p) for p in model.parameters())
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": float(optim_cfg.weight_decay)},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=float(optim_cfg.lr), betas=tuple(float(b) for b in optim_cfg.betas), eps=float(optim_cfg.eps),
        foreach=False if any_dt else None,
    )


# ----------------------------------------------------------------------------- gradients
_BUCKET = 1 << 25  # elements per all-reduce bucket (128 MiB of fp32)
_ABORT_AFTER_S = 3.0  # a second SIGINT/SIGTERM later than this after the first aborts at once


def _all_reduce_mean(grads: list[torch.Tensor], group: Any, world: int) -> None:
    """In place: ``g ← (Σ over group of g) / world``, in flattened buckets."""
    i = 0
    while i < len(grads):
        j, n = i, 0
        while j < len(grads) and (n == 0 or n + grads[j].numel() <= _BUCKET):
            n += grads[j].numel()
            j += 1
        chunk = grads[i:j]
        flat = torch.cat([g.reshape(-1).float() for g in chunk])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(world)
        off = 0
        for g in chunk:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
        i = j


def sync_gradients(params: list[torch.nn.Parameter], expert_ids: set[int], env: DistEnv) -> None:
    """Average gradients over the world (see the module docstring for the groups)."""
    if not env.distributed:
        return
    world_g, dp_g = [], []
    for p in params:
        if p.grad is None:  # same collective sizes on every rank
            p.grad = torch.zeros_like(p)
        if _is_dtensor(p.grad):
            continue
        (dp_g if (id(p) in expert_ids and env.ep_size > 1) else world_g).append(p.grad)
    _all_reduce_mean(world_g, None, env.world_size)
    if dp_g:
        if env.dp_size > 1:
            _all_reduce_mean(dp_g, env.dp_group, env.world_size)
        else:
            torch._foreach_div_(dp_g, float(env.world_size))


def grad_norm_and_clip(params: list[torch.nn.Parameter], expert_ids: set[int], env: DistEnv,
                       max_norm: float | None) -> float:
    """Global L2 norm of all gradients (host float); scales them to ``max_norm`` if larger.

    Replicated gradients count once; expert shards (EP > 1) are summed over the EP group;
    FSDP2 DTensor shards over their own mesh (the dp mesh of the fsdp dispatcher's experts,
    all ranks for ``train.shard_dense``).
    """
    dev = env.device
    rep, ep_sh = [], []
    dt_sh: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        if _is_dtensor(p.grad):
            dt_sh.setdefault(p.grad.device_mesh.get_group(), []).append(p.grad.to_local())
        elif id(p) in expert_ids and env.ep_size > 1:
            ep_sh.append(p.grad)
        else:
            rep.append(p.grad)

    def sq(ts: list[torch.Tensor]) -> torch.Tensor:
        if not ts:
            return torch.zeros((), device=dev, dtype=torch.float32)
        return torch.stack([n.float() for n in torch._foreach_norm(ts)]).pow(2).sum()

    total = sq(rep)
    if env.distributed and ep_sh:
        s = sq(ep_sh)
        dist.all_reduce(s, group=env.ep_group)
        total = total + s
    if env.distributed:
        for group, shards in dt_sh.items():  # each FSDP2 mesh's shards sum over that mesh's ranks
            s = sq(shards)
            dist.all_reduce(s, group=group)
            total = total + s
    norm = float(total.sqrt())
    if max_norm and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        grads = [p.grad for p in params if p.grad is not None]
        plain = [g for g in grads if not _is_dtensor(g)]
        if plain:
            torch._foreach_mul_(plain, coef)
        for g in grads:
            if _is_dtensor(g):
                g.mul_(coef)
    return norm


# ----------------------------------------------------------------------------- trainer
class Trainer:
    """A training run from a composed config (see :func:`dropless.train.config.compose`).

    Construction does every check and load that can fail (config, world size vs mesh, data,
    vocab, run dir, resume) before the first step; :meth:`train` runs the steps.

    Args:
        cfg: the composed config.
    Attributes:
        run_dir, step (optimizer steps done), model, optimizer, env, interrupted,
        history (list of the records logged, rank 0).
    Raises:
        ConfigError: any bad input, with the field and the fix.
    """

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        check_train_config(cfg)
        self.args = model_args(cfg)
        t = cfg.train
        self.seq_len, self.batch, self.accum, self.steps = int(t.seq_len), int(t.micro_batch_size), \
            int(t.grad_accum), int(t.steps)
        if self.seq_len > self.args.max_position_embeddings:
            raise ConfigError(f"train.seq_len={self.seq_len} > model.max_position_embeddings="
                              f"{self.args.max_position_embeddings}: lower train.seq_len or raise "
                              "model.max_position_embeddings")
        self.env = env = init_distributed(cfg, self.args.n_routed_experts)
        self.main = env.is_main
        self.loss_impl, loss_note = resolve_loss_impl(t.get("loss_impl", "auto"), env.device)
        self.print(f"[dropless] loss: {loss_note}")
        self.run_dir = resolve_run_dir(cfg, env)
        self.tokens = load_tokens(cfg.data, self.args.vocab_size)
        self.loader = ShardedLoader(self.tokens.train, self.seq_len, self.batch, env.rank, env.world_size,
                                    int(cfg.seed))
        self.val_batches = val_windows(self.tokens.val, self.seq_len, self.batch, int(t.val_batches),
                                       env.rank, env.world_size)
        if self.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        env.barrier()

        self.model = build_model(self.args, cfg, env)
        if cfg.get("init_from") and not (cfg.resume and ckpt.latest_checkpoint(self.run_dir)):  # weights only
            init_from(self.model, cfg.init_from, mesh=env.mesh if env.ep_size > 1 else None)
        self.model.train()
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        expert = self.model.expert_parameters()
        self.expert_ids = {id(p) for p in expert}
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.expert_fqns = {names[id(p)] for p in expert if id(p) in names}
        self.moe_layers = self.model.moe_layers()

        want = str(t.dtype)
        if want == "auto":
            want = "bf16" if env.device.type == "cuda" else "fp32"
        self.autocast_dtype = torch.bfloat16 if want == "bf16" else None

        from dropless.model.params import param_counts
        self.param_counts = param_counts(self.args)
        self.peak_flops = peak_flops(env.device, cfg.logging)
        self.tokens_per_step = env.world_size * self.accum * self.batch * self.seq_len

        self.step = 0
        self.interrupted = False
        self._stop_signal: int | None = None
        self._stop_time = 0.0
        self.history: list[dict] = []
        self.resumed_from: int | None = None
        if cfg.resume:
            found = ckpt.latest_checkpoint(self.run_dir)
            if found is not None:
                st = ckpt.load(found[1], self.model, self.optimizer, self._trainer_state(), env, self.expert_fqns)
                self.step = int(st["step"])
                self.loader.load_state_dict({"epoch": st["data_epoch"], "offset": st["data_offset"]})
                self.resumed_from = self.step
        self.metrics = MetricsLogger(self.run_dir, cfg.logging, OmegaConf.to_container(cfg, resolve=True),
                                     enabled=self.main, resume=bool(cfg.resume))

    # ------------------------------------------------------------------ helpers
    def _trainer_state(self) -> dict[str, int]:
        d = self.loader.state_dict()
        return {"step": self.step, "data_epoch": d["epoch"], "data_offset": d["offset"]}

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.env.device.type, dtype=self.autocast_dtype)

    def _loss(self, x: torch.Tensor, y: torch.Tensor):
        """:meth:`Transformer.loss` of one micro-batch: ``(loss, ce, aux)``, ``loss = ce + aux``."""
        with self._autocast():
            return self.model.loss(x, y, loss_impl=self.loss_impl)

    def print(self, *a: Any) -> None:
        if self.main:
            from tqdm import tqdm
            tqdm.write(" ".join(str(x) for x in a), file=sys.stdout)

    def save_checkpoint(self) -> Path:
        path = ckpt.checkpoint_dir(self.run_dir, self.step)
        ckpt.save(path, self.model, self.optimizer, self._trainer_state(), self.env, self.expert_fqns)
        if self.main:
            ckpt.prune(self.run_dir, int(self.cfg.train.get("ckpt_keep", 0) or 0))
        return path

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def validate(self) -> float:
        """Mean validation cross-entropy (nats per token) over every rank's fixed batches."""
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.env.device)
        for x, y in self.val_batches:
            x, y = x.to(self.env.device), y.to(self.env.device)
            total[0] += self._loss(x, y).ce.double() * y.numel()  # the mean over y's tokens
            total[1] += y.numel()
        if self.env.distributed:
            dist.all_reduce(total)
        self.model.train()
        return float(total[0] / total[1])

    # ------------------------------------------------------------------ step
    def train_step(self) -> dict[str, Any]:
        """One optimizer step; returns its metrics record (every rank computes the same)."""
        env, dev = self.env, self.env.device
        for moe in self.moe_layers:  # count this step's traffic only (not the validation's)
            comm = getattr(getattr(moe, "dispatcher", None), "comm", None)
            if comm is not None:
                comm.reset()
        t0 = time.perf_counter()
        lr = lr_at(self.step, self.cfg.optim, self.steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        loss_sum = torch.zeros((), dtype=torch.float32, device=dev)
        aux_sum = torch.zeros((), dtype=torch.float32, device=dev)
        dropped = torch.zeros((), dtype=torch.float32, device=dev)
        for _ in range(self.accum):
            x, y = self.loader.next_batch()
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            out = self._loss(x, y)
            (out.loss / self.accum).backward()  # CE + aux losses: 1/accum scales both
            loss_sum += out.ce.detach()
            aux_sum += out.aux.detach()
            for moe in self.moe_layers:
                d = moe.last_stats.get("rows_dropped")
                if d is not None:
                    dropped += d.float()
        sync_gradients(self.params, self.expert_ids, env)
        clip = self.cfg.optim.grad_clip
        gnorm = grad_norm_and_clip(self.params, self.expert_ids, env, float(clip) if clip else None)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        from dropless.routing import update_router_biases
        router = update_router_biases(self.model)  # counts summed over micro-batches and all ranks
        red = torch.stack([loss_sum / self.accum, aux_sum / self.accum, dropped])  # means over micro-batches
        if env.distributed:
            dist.all_reduce(red)
            red[:2] /= env.world_size
        loss_v, aux_v, dropped_v = (float(v) for v in red.tolist())
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0
        self.step += 1

        sent = recv = 0
        for moe in self.moe_layers:
            comm = getattr(getattr(moe, "dispatcher", None), "comm", None)
            if comm is not None:
                b = comm.reset()
                sent += int(b.get("bytes_sent", 0))
                recv += int(b.get("bytes_received", 0))
        tok_s = self.tokens_per_step / dt
        from dropless.model.params import moe_flops_per_token
        rows = self.args.num_experts_per_tok
        if self.moe_layers and dropped_v:
            rows -= dropped_v / (self.tokens_per_step * len(self.moe_layers))
        fpt = moe_flops_per_token(self.args, self.seq_len, rows)
        flops_dev = fpt * tok_s / env.world_size
        rec: dict[str, Any] = {
            "loss": loss_v, "aux_loss": aux_v, "lr": lr, "grad_norm": gnorm,
            "tokens_per_s": tok_s, "tflops": flops_dev / 1e12,
            "mfu": flops_dev / self.peak_flops if self.peak_flops else None,
            "peak_mem_gib": peak_memory_gib(dev), "step_time_s": dt,
            "tokens": self.step * self.tokens_per_step,
            "rows_dropped": dropped_v, "dispatch_bytes_sent": sent, "dispatch_bytes_received": recv,
        }
        rec.update(load_metrics(router))
        self._router_counts = {layer: st["counts"] for layer, st in router.items()}
        return rec

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
        flag = 1.0 if self._stop_signal is not None else 0.0
        if self.env.distributed:
            t = torch.tensor([flag], device=self.env.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = float(t)
        return flag > 0

    def train(self) -> dict[str, Any]:
        """Run the steps from :attr:`step` to ``train.steps``; returns a summary dict."""
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
            if self.resumed_from is not None:
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
        try:
            if self.step == 0 and val_every > 0:
                first_val = last_val = self.validate()
                self.metrics.log(0, {"val_loss": first_val})
                self.print(f"[dropless] step 0 val_loss {first_val:.4f}")
            while self.step < self.steps:
                rec = self.train_step()
                last = self.step == self.steps
                if val_every and (self.step % val_every == 0 or last):
                    rec["val_loss"] = last_val = self.validate()
                    self.print(f"[dropless] step {self.step} loss {rec['loss']:.4f} val_loss {last_val:.4f}")
                hist = self._router_counts if hist_every and (self.step % hist_every == 0 or last) else None
                if self.step % log_every == 0 or last or "val_loss" in rec:
                    self.metrics.log(self.step, rec, hist_counts=hist)
                if self.main:
                    self.history.append({"step": self.step, **rec})
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}", refresh=False)
                if self._stop_requested():
                    self.interrupted = True
                    path = self.save_checkpoint()
                    self.print(f"[dropless] stopped at step {self.step}; checkpoint {path}; continue with "
                               f"resume=true run_dir={self.run_dir}")
                    break
                if last or (ckpt_every and self.step % ckpt_every == 0):
                    self.save_checkpoint()
        finally:
            bar.close()
            for s, h in old.items():
                signal.signal(s, h)
            self.metrics.close()
        wall = time.perf_counter() - start
        summary = {"steps": self.step, "wall_s": wall, "first_val_loss": first_val, "val_loss": last_val,
                   "run_dir": str(self.run_dir), "interrupted": self.interrupted}
        if self.main and not self.interrupted:
            if last_val is None:
                v = "not measured (train.val_every=0)"
            elif first_val is None:
                v = f"{last_val:.4f}"
            else:
                v = f"{first_val:.4f} -> {last_val:.4f}"
            self.print(f"[dropless] done: {self.step} steps in {wall:.1f}s; val_loss {v}; metrics "
                       f"{self.run_dir / 'metrics.jsonl'}")
        return summary

    def close(self) -> None:
        """Tear down the process group (if this run made it)."""
        if self.env.distributed and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
