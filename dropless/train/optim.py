"""The optimizer side of a training run: master weights, AdamW, the lr schedule, the router-bias hook.

Mixed precision (:class:`MasterWeights`, ``train.dtype=bf16``): the model's parameters are the
bf16 *compute copy*; the optimizer owns fp32 master copies (and fp32 AdamW moments). After each
optimizer step the compute copy is refreshed from the masters once (one ``_foreach_copy_``), so
no per-use cast happens in forward. What docs/design.md#precision keeps fp32 stays fp32: the router's buffers
(the expert bias and the counts; :class:`~dropless.routing.Router` keeps them fp32), the router
logits and scores (computed in fp32 inside the router), the norms' statistics (RMSNorm computes
in fp32) and the combine's accumulation. Parameters that FSDP2 manages (``dispatcher=fsdp``
experts, ``train.shard_dense``) are left alone: they stay fp32 and FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` makes their bf16 copy per
all-gather. In fp32 the masters are the parameters themselves (nothing is copied).

Checkpoints hold the masters: :attr:`MasterWeights.state_module` mirrors the model's module
tree with the masters in place of the compute parameters (same FQNs, the model's own buffers
and FSDP2 parameters), so a checkpoint is fp32 whatever ``train.dtype`` was, and
``torch.distributed.checkpoint.state_dict.get_state_dict(state_module, optimizer)`` keys the
AdamW state by the model's FQNs.

AdamW (:func:`build_optimizer`): ``torch.optim.AdamW(fused=True)`` when every plain parameter
is on CUDA, ``foreach=True`` on CPU (``optim.fused``: true/false forces either); FSDP2 DTensor
parameters get their own param group with the per-tensor implementation (logged once: foreach
and fused kernels take one tensor kind and one mesh per call). Weight decay on matrices
(dim >= 2) except the token embedding.

Schedule (:func:`build_scheduler`): :class:`torch.optim.lr_scheduler.LambdaLR` on
:func:`lr_at` (linear warmup, then cosine to ``min_lr_ratio · lr``).

Router balancing (:class:`RouterBiasUpdate`): registered with
``optimizer.register_step_post_hook``; after each optimizer step it moves every router's
expert bias once from the step's counts, summed over micro-batches and ranks.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Callable, Iterable

import torch
from torch import nn

from dropless.routing import Router, apply_router_bias_updates, summed_router_counts

__all__ = ["lr_at", "build_optimizer", "build_scheduler", "MasterWeights", "RouterBiasUpdate", "is_dtensor",
           "adamw_impl"]

log = logging.getLogger(__name__)


def is_dtensor(t: torch.Tensor) -> bool:
    """True for a :class:`torch.distributed.tensor.DTensor` (FSDP2-managed parameters and grads)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


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


def build_scheduler(optimizer: torch.optim.Optimizer, optim_cfg: Any, total_steps: int
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` whose factor at step ``s`` is ``lr_at(s) / lr`` (every group's base lr is ``lr``).

    Call ``scheduler.step()`` after each ``optimizer.step()``; its ``last_epoch`` is the
    number of optimizer steps done (checkpointed by the trainer).
    """
    lr = float(optim_cfg.lr)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, optim_cfg, total_steps) / lr)


def schedule_step(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """``scheduler.step()`` where the optimizer may not have stepped (a skipped step still counts in the
    schedule; a resume sets the step's rate), without torch's warning about that order."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        scheduler.step()


# ----------------------------------------------------------------------------- AdamW
def adamw_impl(params: Iterable[torch.Tensor], fused: bool | None = None) -> tuple[dict[str, bool], str]:
    """The AdamW implementation for one param group: ``({"fused"|"foreach": ...}, why)``.

    ``fused`` (``optim.fused``): None = fused on CUDA (all plain tensors on CUDA), foreach
    elsewhere; True = fused on any device (torch has a fused CPU kernel too); False = foreach.
    DTensors (FSDP2) always get the per-tensor implementation, with the reason.
    """
    ps = list(params)
    if any(is_dtensor(p) for p in ps):
        why = "FSDP2 DTensor parameters use the per-tensor AdamW (foreach/fused take one tensor kind and mesh)"
        return {"foreach": False, "fused": False}, why
    if fused or (fused is None and ps and all(p.device.type == "cuda" for p in ps)):
        return {"foreach": False, "fused": True}, "fused" + (" (CUDA)" if fused is None else " (optim.fused=true)")
    return {"foreach": True, "fused": False}, "foreach"


def build_optimizer(named_params: Iterable[tuple[str, torch.Tensor]], optim_cfg: Any,
                    warn: Callable[[str], None] | None = None) -> torch.optim.AdamW:
    """AdamW over ``named_params`` (``(fqn, fp32 tensor)``: the masters and FSDP2 parameters).

    Weight decay ``optim.weight_decay`` on matrices (dim >= 2) except ``tok_embeddings``;
    none on vectors. Plain tensors and DTensors go to separate param groups
    (:func:`adamw_impl` picks each group's implementation; a per-tensor fallback is said through
    ``warn``: the trainer's rank-0 warning, or this module's logger when None).
    """
    groups: dict[tuple[bool, bool], list[torch.Tensor]] = {}
    for name, p in named_params:
        if not p.requires_grad:
            continue
        decay = p.dim() >= 2 and "tok_embeddings" not in name
        groups.setdefault((decay, is_dtensor(p)), []).append(p)
    wd = float(optim_cfg.weight_decay)
    param_groups = []
    fused = getattr(optim_cfg, "fused", None)
    for (decay, _), ps in sorted(groups.items(), key=lambda kv: (kv[0][1], not kv[0][0])):
        impl, why = adamw_impl(ps, fused)
        if not impl["fused"] and not impl["foreach"]:
            (warn or log.warning)(f"AdamW: {len(ps)} parameters: {why}")
        param_groups.append({"params": ps, "weight_decay": wd if decay else 0.0, **impl})
    return torch.optim.AdamW(param_groups, lr=float(optim_cfg.lr), betas=tuple(float(b) for b in optim_cfg.betas),
                             eps=float(optim_cfg.eps))


# ----------------------------------------------------------------------------- master weights
class MasterWeights:
    """fp32 master weights of a model whose compute parameters are ``dtype``.

    Args:
        model: the built, initialised model (fp32 parameters).
        dtype: the compute dtype (``torch.bfloat16``, or ``torch.float32``: no copies).
        skip: ids of parameters to leave as they are (FSDP2-managed ones).

    Attributes:
        compute: the model parameters this object manages (their ``.data`` becomes ``dtype``).
        masters: fp32 tensors, one per ``compute`` entry (the same objects in fp32).
        named_masters: ``(fqn, master)`` for the optimizer, plus the skipped (FSDP2)
            parameters under their own names.
        state_module: the module whose state dict is checkpointed (the model in fp32; a
            mirror holding the masters, the model's buffers and the skipped parameters in bf16).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype, skip: set[int] = frozenset()):
        self.dtype = dtype
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.compute = [p for n, p in named if id(p) not in skip]
        if dtype == torch.float32:
            self.masters = self.compute
            self.state_module = model
            self.named_masters = named
            return
        if dtype != torch.bfloat16:
            raise ValueError(f"MasterWeights: compute dtype must be float32 or bfloat16, got {dtype}")
        to_master: dict[int, nn.Parameter] = {}
        with torch.no_grad():
            for p in self.compute:
                to_master[id(p)] = nn.Parameter(p.detach().to(torch.float32).clone())
                p.data = p.data.to(dtype)
        self.masters = [to_master[id(p)] for p in self.compute]
        self.named_masters = [(n, to_master.get(id(p), p)) for n, p in named]
        self.state_module = _mirror(model, to_master)

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the masters into the compute parameters (rounded to ``dtype``); no-op in fp32."""
        if self.masters is not self.compute and self.compute:
            torch._foreach_copy_(self.compute, self.masters)

    @property
    def grads_are_params(self) -> bool:
        """True in fp32: the masters are the parameters, so the main grads are their ``.grad``."""
        return self.masters is self.compute


def _mirror(model: nn.Module, replace: dict[int, nn.Parameter]) -> nn.Module:
    """A module tree with ``model``'s FQNs: parameters swapped by ``replace``, buffers shared."""
    root = nn.Module()
    made = {"": root}
    for name, mod in model.named_modules():
        if name:
            parent, _, leaf = name.rpartition(".")
            made[name] = nn.Module()
            made[parent].add_module(leaf, made[name])
        dst = made[name]
        for pn, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            dst.register_parameter(pn, replace.get(id(p), p))
        for bn, b in mod.named_buffers(recurse=False, remove_duplicate=False):
            # whether a buffer is saved: no public accessor (state_dict() would run the modules' hooks)
            dst.register_buffer(bn, b, persistent=bn not in mod._non_persistent_buffers_set)
    return root


# ----------------------------------------------------------------------------- router balancing
class RouterBiasUpdate:
    """The aux-loss-free balancing update as an optimizer step post-hook.

    :meth:`counts` sums every router's ``tokens_per_expert`` over ``group`` in one
    collective (:func:`dropless.routing.summed_router_counts`, no host sync) and keeps the
    result for the hook; the hook (registered by :meth:`register`) then applies
    :func:`dropless.routing.apply_router_bias_updates` with those counts (bias
    ``+= γ·sign(mean − load)``, the counters reset): the same two calls as
    :func:`dropless.routing.update_router_biases`, which adds the host-side stats. :meth:`discard`
    resets the counters of a step whose optimizer step was skipped. Where the optimizer carries a
    ``found_inf`` tensor (the fused AdamW's device-side skip, as ``torch.amp.GradScaler`` sets it), a
    step it skips moves no bias either: the hook multiplies the update by ``1 − found_inf`` on the device.

    Args:
        model: the model holding the routers.
        group: the process group whose ranks see different tokens (None: all ranks).
    """

    def __init__(self, model: nn.Module, group: Any = None):
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.group = group
        self._summed: torch.Tensor | None = None

    @torch.no_grad()
    def counts(self) -> torch.Tensor | None:
        """int64 ``[L, E]``: this step's counts per router, summed over micro-batches and ranks (exact)."""
        if not self.routers:
            return None
        if self._summed is None:
            self._summed = summed_router_counts(self.routers, self.group).view(len(self.routers), -1)
        return self._summed

    @torch.no_grad()
    def __call__(self, optimizer: Any = None, args: Any = None, kwargs: Any = None) -> None:  # noqa: ARG002
        summed = self.counts()
        if summed is None:
            return
        found_inf = getattr(optimizer, "found_inf", None)
        apply_router_bias_updates(self.routers, summed.reshape(-1), None if found_inf is None else 1 - found_inf)
        self._summed = None

    def discard(self) -> None:
        """Reset the counters without moving the biases (a skipped step)."""
        for r in self.routers:
            r.tokens_per_expert.zero_()
        self._summed = None

    def register(self, optimizer: torch.optim.Optimizer):
        """``optimizer.register_step_post_hook(self)``; returns the handle."""
        return optimizer.register_step_post_hook(self)
