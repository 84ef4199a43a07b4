"""``fsdp``: EP = 1, every expert on every rank, the expert weights sharded with FSDP2.

No token moves: dispatch and combine are ``local``'s. What moves is the experts' weights:
:func:`dropless.train.shard.apply_fsdp` (which wraps a built model, from the training side)
shards each MoE layer's ``experts`` module with FSDP2
(:func:`torch.distributed.fsdp.fully_shard`) over the data-parallel mesh dimension, so each
rank stores ``1/dp`` of them; FSDP2 all-gathers a layer's experts just before it runs and
frees them after (``reshard_after_forward``), all-gathers again in backward, and
reduce-scatters the weight gradients (averaged over the dp ranks, FSDP2's default). The next
layer's experts are prefetched while this one computes (forward: explicit
``set_modules_to_forward_prefetch``; backward: ``set_modules_to_backward_prefetch``).

Needs torch >= 2.6 (FSDP2); runs on CPU with gloo and on GPU with NCCL.

Bytes (docs/design.md#dispatchers: every expert weight of the layer, independent of T): counted
analytically from the sharded parameters, since FSDP2 issues the collectives itself. Per
layer call, with ``P`` the bytes of one rank's shard of the layer's expert weights (in the
all-gather dtype: ``mp_policy.param_dtype`` or the parameter's) and ``G`` of its gradient
shard (``reduce_dtype`` or the parameter's): forward all-gather ``(dp-1)·P`` sent and received;
backward: ``(dp-1)·P`` again when resharded after forward, plus the gradient reduce-scatter
``(dp-1)·G`` each way.
"""

from __future__ import annotations

import torch

from dropless.dispatch.local import LocalDispatcher


class _CountBackward(torch.autograd.Function):
    """Identity; its backward adds the FSDP2 backward traffic of one layer to ``comm``."""

    @staticmethod
    def forward(ctx, x_TH, disp):
        ctx.disp = disp
        return x_TH.view_as(x_TH)

    @staticmethod
    def backward(ctx, g):
        d = ctx.disp
        d.comm.add(d._bwd_bytes, d._bwd_bytes)
        return g, None


class FSDPDispatcher(LocalDispatcher):
    """``local`` dispatch; the experts are FSDP2-sharded by :func:`dropless.train.shard.apply_fsdp`.

    Args:
        num_experts: ``E`` (all local: EP = 1).
    Attributes:
        fsdp_attached: set by :func:`~dropless.train.shard.apply_fsdp` (the byte counts are known
            from then on).
    """

    name = "fsdp"
    collectives = "FSDP2 all-gathers the expert weights in hooks around the experts"
    shards_experts = True

    def __init__(self, num_experts: int):
        super().__init__(num_experts)
        self.fsdp_attached = False
        self._fwd_bytes = self._bwd_bytes = 0

    def attach(self, shard_param_bytes: int, shard_grad_bytes: int, dp_size: int,
               reshard_after_forward: bool) -> None:
        """Record the per-call traffic of the layer's sharded experts (called by ``apply_fsdp``).

        Args:
            shard_param_bytes, shard_grad_bytes: bytes of one rank's shard of the layer's expert
                weights / gradients, in the all-gather / reduce-scatter dtype.
            dp_size: ranks the experts are sharded over.
            reshard_after_forward: backward re-gathers the weights (adds ``(dp-1)·P``).
        """
        self.fsdp_attached = True
        self._fwd_bytes = (dp_size - 1) * shard_param_bytes
        self._bwd_bytes = (dp_size - 1) * (shard_grad_bytes + (shard_param_bytes if reshard_after_forward else 0))

    def _land(self, x_TH, topk_idx_Tk, topk_weight_Tk, alignment, capacity, fold_weights, gather, quant=None):
        if self.fsdp_attached:
            self.comm.add(self._fwd_bytes, self._fwd_bytes)
            if torch.is_grad_enabled() and x_TH.requires_grad:
                x_TH = _CountBackward.apply(x_TH, self)
        return super()._land(x_TH, topk_idx_Tk, topk_weight_Tk, alignment, capacity, fold_weights, gather, quant)


__all__ = ["FSDPDispatcher"]
