"""FSDP2 over a built model, applied from the training side: the experts (``dispatcher=fsdp``,
or ``train.shard_experts`` under an expert-parallel dispatcher) and the non-expert parameters
(``train.shard_dense``).

:func:`apply_fsdp` shards every MoE layer's ``experts`` over the dp ranks (the ``fsdp``
dispatcher, EP = 1; the bytes it moves are described in :mod:`dropless.dispatch.fsdp`).

:func:`shard_experts` shards every MoE layer's ``experts`` (its ``E/EP`` local experts) over the
dp ranks that hold the same experts (the mesh's ``dp`` dimension: the ranks with this rank's EP
coordinate), EP × FSDP as torchtitan's ``dp_shard_in_ep`` and Megatron-Core's expert-data-parallel
optimizer do: each rank stores ``1/dp`` of its experts' fp32 weights, gradients and AdamW moments;
FSDP2 all-gathers a layer's local experts just before they run (the next layer's gather is
prefetched), again in backward, and reduce-scatters their gradients (summed over dp and divided by
the world size: what the replicated path's dp all-reduce and ``/ world`` do, see
``dropless/dispatch/mesh.py``). :func:`expert_shard_dim` picks the sharded dimension and refuses
sizes that cannot be sharded; checkpoints store the pieces as the global ``[E, ...]`` tensor
(:mod:`dropless.expert_dtensor`, whose :func:`~dropless.expert_dtensor.ep_dp_mesh` is re-exported here).

:func:`shard_dense_params` shards the non-expert parameters over all ranks.
Without it every rank holds every non-expert parameter (attention, dense layers, shared
experts, router, embeddings, head) with its AdamW state, and the trainer all-reduces their
gradients: at the DeepSeek-V3 shape that is ≈ 17 B parameters per rank
(``dropless-plan recipe=deepseek_v3_671b``), which no GPU holds. With it, each decoder block
and then the model root are wrapped with :func:`torch.distributed.fsdp.fully_shard` over a
1-D mesh of all ranks (ZeRO-3 style: each rank stores ``1/world`` of each tensor; a block's
parameters are all-gathered just before it runs and freed after, again in backward, and
the gradients are reduce-scattered, averaged over the world — what the trainer's own
all-reduce did). The routed experts are left out (``ignored_params``): they stay as the
dispatcher placed them (EP shards, or the ``fsdp`` dispatcher's own FSDP2 over dp).

Needs torch >= 2.6 (FSDP2 ``fully_shard`` with ``ignored_params``); works on CPU with gloo,
on GPU with NCCL, and on GPU with gloo (several ranks on one GPU, ``train.dist_backend=gloo``),
where every FSDP2 module reduces with SUM and divides apart
(``set_force_sum_reduction_for_comms``): FSDP2 would ask for AVG, which gloo's CUDA path is not
sure to take. One process: a no-op.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import Shard

from dropless.config import ConfigError
from dropless.dispatch.base import Dispatcher
from dropless.dispatch.fsdp import FSDPDispatcher
from dropless.expert_dtensor import ep_dp_mesh
from dropless.model import Transformer
from dropless.moe import MoE

__all__ = ["apply_fsdp", "ep_dp_mesh", "expert_shard_dim", "shard_dense_params", "shard_experts", "world_mesh"]


def world_mesh(device_type: str) -> DeviceMesh:
    """The 1-D ``("world",)`` DeviceMesh over the default process group itself, so its collectives
    time out after the default group's timeout (``train.dist_timeout_s``). ``init_device_mesh``
    reuses the default group only on some builds (a CPU build of torch did; a CUDA build made a new
    group with torch's 30-minute default: a stalled rank held its peers that long under
    ``train.shard_dense``)."""
    return DeviceMesh.from_group(dist.group.WORLD, device_type, mesh_dim_names=("world",))


def shard_dense_params(model: Transformer, world_size: int, device_type: str,
                       reshard_after_forward: bool = True, mp_policy: Any = None) -> Any:
    """FSDP2-shard every non-expert parameter of ``model`` over all ``world_size`` ranks.

    Args:
        model: the Transformer (its ``layers`` are the blocks; its ``expert_parameters()`` the
            routed experts, which are not sharded here).
        world_size: ranks in the default process group.
        device_type: ``"cuda"`` or ``"cpu"``.
        reshard_after_forward: free each block's gathered parameters after its forward
            (gather again in backward): less memory, one more all-gather per block.
        mp_policy: an optional FSDP2 ``MixedPrecisionPolicy`` for every ``fully_shard`` call
            (the trainer's bf16: ``param_dtype=bf16, reduce_dtype=fp32``).
    Returns:
        the 1-D ``("world",)`` DeviceMesh used, or None in one process.
    """
    if world_size <= 1:
        return None
    mesh = world_mesh(device_type)
    # experts that FSDP2 already manages (the fsdp dispatcher) are skipped by fully_shard as
    # nested FSDP modules; the others (EP shards) must be named as ignored
    nested = {id(p) for m in model.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
    experts = [p for p in model.expert_parameters() if id(p) not in nested]
    expert_ids = {id(p) for p in experts}
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    for block in model.layers.values():
        mine = {p for p in block.parameters() if id(p) in expert_ids}
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=mine, **kw)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=set(experts), **kw)
    _sum_reductions_on_gloo_cuda([*model.layers.values(), model], mesh)
    return mesh


def _sum_reductions_on_gloo_cuda(modules: list[nn.Module], mesh: DeviceMesh) -> None:
    """Make FSDP2 reduce with SUM (and divide apart) on a gloo mesh of CUDA tensors."""
    if mesh.device_type != "cuda" or dist.get_backend(mesh.get_group()) != "gloo":
        return
    for m in modules:
        if isinstance(m, FSDPModule) and hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)


def _moe_layers(module: nn.Module, caller: str) -> list[MoE]:
    """The MoE layers in ``module``; ValueError naming ``caller`` where there is none to shard."""
    layers = [m for m in module.modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError(f"{caller}: no dropless.moe.MoE layer in the module; pass the model (or MoE layer) "
                         "whose experts are to be sharded")
    return layers


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
        ValueError: no MoE layer found; the mesh has neither a ``"dp"`` dimension nor one dimension.
        ConfigError (a ValueError): the mesh has an ep dimension > 1, or an MoE layer's
            dispatcher has EP > 1 (fsdp needs EP = 1).
    Notes:
        The experts' gradients are averaged over the dp ranks (FSDP2's default), which is what
        a trainer averaging the other parameters' gradients over the world expects. Call it
        before building the optimizer (the parameters become DTensors).
    """
    dp_mesh = _dp_mesh(mesh)
    layers = _moe_layers(module, "apply_fsdp")
    dp = dp_mesh.size()
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    sharded = []
    for moe in layers:
        FSDPDispatcher.check_ep(moe.dispatcher.ep_size)
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
    _sum_reductions_on_gloo_cuda([*sharded, module], dp_mesh)
    if prefetch:
        _chain_prefetch(sharded)
    return sharded


def _dp_mesh(mesh: Any) -> Any:
    """The dp dimension of ``mesh`` (whose ep dimension, if any, must be 1), or a 1-D mesh itself."""
    names = getattr(mesh, "mesh_dim_names", None)
    if names and "dp" in names:
        if "ep" in names:
            FSDPDispatcher.check_ep(mesh["ep"].size())
        return mesh["dp"]
    if mesh.ndim != 1:
        raise ValueError(f"apply_fsdp: need a mesh with a 'dp' dimension or a 1-D mesh, got dims {names}")
    return mesh


def _chain_prefetch(sharded: list[nn.Module]) -> None:
    """Each experts module prefetches the next one's gather in forward and the previous one's in backward."""
    for i, ex in enumerate(sharded):
        if i + 1 < len(sharded):
            ex.set_modules_to_forward_prefetch([sharded[i + 1]])
        if i > 0:
            ex.set_modules_to_backward_prefetch([sharded[i - 1]])


def _dtype_bytes(dtype: torch.dtype | None, p: torch.Tensor) -> int:
    return (torch.empty((), dtype=dtype).element_size() if dtype is not None else p.element_size())


def expert_shard_dim(kind: type[Dispatcher], dp_size: int, ep_size: int, n_routed_experts: int, hidden_size: int,
                     moe_intermediate_size: int) -> int:
    """The dimension ``train.shard_experts`` shards the local expert weights on: THE check of its sizes.

    ``w13 [e, H, 2I]`` and ``w2 [e, I, H]`` (``e = E / EP``) are split over the ``dp`` ranks on dim 0
    (whole experts per rank) when ``dp`` divides ``e``, else on dim 1 (``H`` of ``w13``, ``I`` of
    ``w2``; FSDP2 needs an even split on a dimension other than 0) when ``dp`` divides both, as
    torchtitan does where there are fewer local experts than dp ranks.

    Args:
        kind: the dispatcher class (``dispatcher.kind``); must be expert-parallel (``a2a``, ``agrs``,
            ``deepep``).
        dp_size, ep_size: the mesh (``dp = world / EP``).
        n_routed_experts, hidden_size, moe_intermediate_size: ``E``, ``H``, ``I``.
    Returns:
        0 or 1.
    Raises:
        ConfigError: ``kind`` is not expert-parallel (``local``: nothing to shard over, every rank holds
            every expert and trains it on its own tokens) or shards the experts itself (``fsdp``), or
            ``dp`` divides neither ``e`` nor both ``H`` and ``I``; the message names
            ``train.shard_experts`` and the sizes.
    """
    if kind.shards_experts or not kind.expert_parallel:
        why = "shards the experts over the dp ranks itself" if kind.shards_experts else "holds all experts on all ranks"
        raise ConfigError(f"train.shard_experts=true: dispatcher={kind.name} {why} (EP = 1); set train.shard_experts"
                          "=false, or use an expert-parallel dispatcher (a2a, agrs, deepep) to shard the experts over "
                          "EP and dp")
    e = n_routed_experts // ep_size
    if dp_size <= 1 or e % dp_size == 0:
        return 0
    if hidden_size % dp_size == 0 and moe_intermediate_size % dp_size == 0:
        return 1
    raise ConfigError(
        f"train.shard_experts=true: the dp size {dp_size} (world / dispatcher.ep_size={ep_size}) divides neither "
        f"the {e} local experts (model.n_routed_experts={n_routed_experts} / {ep_size}) nor both "
        f"model.hidden_size={hidden_size} and model.moe_intermediate_size={moe_intermediate_size}, so FSDP2 cannot "
        "split the expert weights evenly over dp; choose a world size whose dp divides one of them, another "
        "dispatcher.ep_size, or train.shard_experts=false")


def shard_experts(module: nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool = True,
                  mp_policy: Any = None, prefetch: bool = True, root: bool = True) -> list[nn.Module]:
    """``train.shard_experts``: FSDP2-shard every MoE layer's local experts over the mesh's dp ranks.

    Args:
        module: a model (or an :class:`~dropless.moe.MoE`) whose MoE layers have an expert-parallel
            dispatcher (``a2a``, ``agrs``, ``deepep``), in forward order as ``module.modules()`` lists them.
        mesh: the ``("dp", "ep")`` mesh of :func:`dropless.dispatch.mesh.build_mesh`; each rank's experts
            are sharded over ``mesh["dp"]`` (the ranks that hold the same experts).
        reshard_after_forward: free the gathered weights after forward (gather again in backward).
        mp_policy: an optional FSDP2 ``MixedPrecisionPolicy`` (the trainer's bf16:
            ``param_dtype=bf16, reduce_dtype=fp32``: bf16 all-gathers, fp32 reduce-scatters).
        prefetch: each layer's experts launch the next layer's gather in forward (the previous
            layer's in backward).
        root: also apply ``fully_shard`` to ``module`` with every other parameter ignored (one FSDP2
            root for the prefetch); False where the caller shards ``module`` itself afterwards
            (``train.shard_dense``).
    Returns:
        the sharded ``experts`` modules, in order; empty where dp = 1 (nothing to shard over).
    Raises:
        ConfigError: a layer's dispatcher is not expert-parallel, or the sizes cannot be sharded
            (:func:`expert_shard_dim`).
    Notes:
        Gradients: the EP dispatcher leaves on each rank the sum of its EP group's contributions to its
        experts; FSDP2 reduce-scatters them over dp with a SUM and divides by ``dp · EP`` (the world),
        as the replicated path's dp all-reduce and ``/ world`` do. Call before the optimizer is built
        (the parameters become DTensors ``[Shard(d)]`` over dp holding ``1/dp`` of the local experts).
    """
    dp_mesh, ep_size = mesh["dp"], mesh["ep"].size()
    dp = dp_mesh.size()
    layers = _moe_layers(module, "shard_experts")
    dims = [expert_shard_dim(type(moe.dispatcher), dp, ep_size, moe.args.n_routed_experts, moe.args.hidden_size,
                             moe.args.moe_intermediate_size) for moe in layers]  # every layer checked first
    if dp <= 1:
        return []
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    sharded = []
    for moe, dim in zip(layers, dims):
        placement = Shard(dim)
        fully_shard(moe.experts, shard_placement_fn=lambda p, placement=placement: placement, **kwargs)
        # a SUM over dp, then / world (the replicated path's order); SUM also suits gloo, which has no AVG
        moe.experts.set_gradient_divide_factor(float(dp * ep_size))
        moe.experts.set_force_sum_reduction_for_comms(True)
        sharded.append(moe.experts)
    if root:
        expert_ids = {id(p) for ex in sharded for p in ex.parameters()}
        others = {p for p in module.parameters() if id(p) not in expert_ids}
        fully_shard(module, mesh=dp_mesh, ignored_params=others)
        _sum_reductions_on_gloo_cuda([module], dp_mesh)
    if prefetch:
        _chain_prefetch(sharded)
    return sharded
