"""Shard the non-expert parameters over all ranks with FSDP2 (``train.shard_dense``).

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

Needs torch >= 2.6 (FSDP2 ``fully_shard`` with ``ignored_params``); works on CPU with gloo
and on GPU with NCCL. One process: a no-op.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["shard_dense_params"]


def shard_dense_params(model: nn.Module, world_size: int, device_type: str,
                       reshard_after_forward: bool = True, mp_policy: Any = None) -> Any:
    """FSDP2-shard every non-expert parameter of ``model`` over all ``world_size`` ranks.

    Args:
        model: a :class:`~dropless.model.Transformer` (its ``layers`` are the blocks; its
            ``expert_parameters()`` the routed experts, which are not sharded here).
        world_size: ranks in the default process group.
        device_type: ``"cuda"`` or ``"cpu"``.
        reshard_after_forward: free each block's gathered parameters after its forward
            (gather again in backward): less memory, one more all-gather per block.
        mp_policy: an optional FSDP2 ``MixedPrecisionPolicy`` for every ``fully_shard`` call
            (the trainer's bf16: ``param_dtype=bf16, reduce_dtype=fp32``).
    Returns:
        the 1-D ``("world",)`` DeviceMesh used, or None in one process.
    Raises:
        ValueError: ``model`` has no ``layers`` (not a dropless Transformer).
    """
    if world_size <= 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not hasattr(model, "layers") or not hasattr(model, "expert_parameters"):
        raise ValueError("shard_dense_params: expected a dropless.model.Transformer (with .layers and "
                         f".expert_parameters()), got {type(model).__name__}")
    mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("world",))
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
    return mesh
