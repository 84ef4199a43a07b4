"""``fsdp``: EP = 1, every expert on every rank, the expert weights sharded with FSDP2.

No token moves: dispatch and combine are ``local``'s. What moves is the experts' weights:
:func:`apply_fsdp` shards each MoE layer's ``experts`` module with FSDP2
(:func:`torch.distributed.fsdp.fully_shard`) over the data-parallel mesh dimension, so each
rank stores ``1/dp`` of them; FSDP2 all-gathers a layer's experts just before it runs and
frees them after (``reshard_after_forward``), all-gathers again in backward, and
reduce-scatters the weight gradients (averaged over the dp ranks, FSDP2's default). The next
layer's experts are prefetched while this one computes (forward: explicit
``set_modules_to_forward_prefetch``; backward: ``set_modules_to_backward_prefetch``).

Works on CPU with gloo (torch >= 2.6 FSDP2; tested here with world sizes 2 and 4) and on GPU
with NCCL.

Bytes (DESIGN.md: "all expert weights of the layer; independent of T"): counted
analytically from the sharded parameters, since FSDP2 issues the collectives itself. Per
layer call, with ``P`` the bytes of one rank's shard of the layer's expert weights (in the
all-gather dtype: ``mp_policy.param_dtype`` or the parameter's) and ``G`` of its gradient
shard (``reduce_dtype`` or the parameter's): forward all-gather ``(dp-1)·P`` sent and received;
backward: ``(dp-1)·P`` again when resharded after forward, plus the gradient reduce-scatter
``(dp-1)·G`` each way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

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
    """``local`` dispatch; the experts are FSDP2-sharded by :func:`apply_fsdp`.

    Args:
        num_experts: ``E`` (all local: EP = 1).
    Attributes:
        fsdp_attached: set by :func:`apply_fsdp` (the byte counts are known from then on).
    """

    name = "fsdp"

    def __init__(self, num_experts: int):
        super().__init__(num_experts)
        self.fsdp_attached = False
        self._fwd_bytes = self._bwd_bytes = 0

    def attach(self, shard_param_bytes: int, shard_grad_bytes: int, dp_size: int,
               reshard_after_forward: bool) -> None:
        """Record the per-call traffic of the layer's sharded experts (called by :func:`apply_fsdp`).

        Args:
            shard_param_bytes, shard_grad_bytes: bytes of one rank's shard of the layer's expert
                weights / gradients, in the all-gather / reduce-scatter dtype.
            dp_size: ranks the experts are sharded over.
            reshard_after_forward: backward re-gathers the weights (adds ``(dp-1)·P``).
        """
        self.fsdp_attached = True
        self._fwd_bytes = (dp_size - 1) * shard_param_bytes
        self._bwd_bytes = (dp_size - 1) * (shard_grad_bytes + (shard_param_bytes if reshard_after_forward else 0))

    def _land(self, x_TH, topk_idx_Tk, topk_weight_Tk, alignment, capacity, fold_weights, gather):
        if self.fsdp_attached:
            self.comm.add(self._fwd_bytes, self._fwd_bytes)
            if torch.is_grad_enabled() and x_TH.requires_grad:
                x_TH = _CountBackward.apply(x_TH, self)
        return super()._land(x_TH, topk_idx_Tk, topk_weight_Tk, alignment, capacity, fold_weights, gather)


def _moe_layers(module: nn.Module) -> list[nn.Module]:
    from dropless.moe import MoE  # local import: moe imports dropless.dispatch
    return [m for m in module.modules() if isinstance(m, MoE)]


def apply_fsdp(module: nn.Module, mesh: Any, *, reshard_after_forward: bool = True,
               mp_policy: Any = None, prefetch: bool = True, root: bool = True) -> list[nn.Module]:
    """Shard the ``experts`` of every MoE layer in ``module`` with FSDP2 over the dp ranks.

    Args:
        module: an :class:`~dropless.moe.MoE` or a model holding MoE layers (in forward order
            as ``module.modules()`` lists them, which is the decoder's layer order).
        mesh: a :class:`DeviceMesh` from :func:`dropless.dispatch.mesh.build_mesh` (its ``"dp"``
            dimension is used; with dims ``("dp", "ep")`` the ep size must be 1) or a 1-D mesh.
        reshard_after_forward: free the gathered weights after forward (re-gather in backward).
        mp_policy: an optional FSDP2 ``MixedPrecisionPolicy``.
        prefetch: set explicit forward/backward prefetch between consecutive layers' experts.
        root: also apply ``fully_shard`` to ``module`` itself with every non-expert parameter
            ignored (they stay plain tensors), so that all experts share one FSDP root (needed
            for the prefetch). Set False if the caller shards ``module`` itself afterwards.
    Returns:
        the sharded ``experts`` modules, in order.
    Raises:
        ValueError: no MoE layer found; the mesh has an ep dimension > 1; an MoE layer whose
            dispatcher is not EP = 1 (``fsdp``/``local``).
    Notes:
        The experts' gradients are averaged over the dp ranks (FSDP2's default), which is what
        a trainer averaging the other parameters' gradients over the world expects. Call it
        before building the optimizer (the parameters become DTensors).
    """
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh
    names = getattr(mesh, "mesh_dim_names", None)
    if names and "dp" in names:
        if "ep" in names and mesh["ep"].size() != 1:
            raise ValueError(f"apply_fsdp: the mesh has ep={mesh['ep'].size()}; the fsdp dispatcher needs "
                             "EP = 1 (dispatcher.ep_size=1)")
        dp_mesh = mesh["dp"]
    elif mesh.ndim != 1:
        raise ValueError(f"apply_fsdp: need a mesh with a 'dp' dimension or a 1-D mesh, got dims {names}")
    layers = _moe_layers(module)
    if not layers:
        raise ValueError("apply_fsdp: no dropless.moe.MoE layer in the module; pass the model (or MoE layer) "
                         "whose experts are to be sharded")
    dp = dp_mesh.size()
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    sharded = []
    for moe in layers:
        if moe.dispatcher.ep_size != 1:
            raise ValueError(f"apply_fsdp: MoE layer {moe.layer_id} uses dispatcher "
                             f"{moe.dispatcher.name!r} with EP={moe.dispatcher.ep_size}; fsdp needs EP = 1: "
                             "build the layers with dispatcher=fsdp (dispatcher.ep_size=1)")
        params = list(moe.experts.parameters())
        full_param_bytes = sum(p.numel() * _dtype_bytes(getattr(mp_policy, "param_dtype", None), p) for p in params)
        full_grad_bytes = sum(p.numel() * _dtype_bytes(getattr(mp_policy, "reduce_dtype", None), p) for p in params)
        fully_shard(moe.experts, **kwargs)
        if isinstance(moe.dispatcher, FSDPDispatcher):
            moe.dispatcher.attach(full_param_bytes // dp, full_grad_bytes // dp, dp, reshard_after_forward)
        sharded.append(moe.experts)
    if root:
        # one FSDP root over the whole module, managing none of the other parameters (they stay plain
        # tensors for the trainer's data-parallel reduction): it lazily initialises every experts
        # module together, which cross-module prefetch needs, and waits for their gradient
        # reduce-scatters at the end of backward.
        expert_ids = {id(p) for ex in sharded for p in ex.parameters()}
        others = {p for p in module.parameters() if id(p) not in expert_ids}
        fully_shard(module, mesh=dp_mesh, ignored_params=others)
    if prefetch and len(sharded) > 1:
        for i, ex in enumerate(sharded):
            if i + 1 < len(sharded):
                ex.set_modules_to_forward_prefetch([sharded[i + 1]])
            if i > 0:
                ex.set_modules_to_backward_prefetch([sharded[i - 1]])
    return sharded


def _dtype_bytes(dtype: torch.dtype | None, p: torch.Tensor) -> int:
    return (torch.empty((), dtype=dtype).element_size() if dtype is not None else p.element_size())


__all__ = ["FSDPDispatcher", "apply_fsdp"]
