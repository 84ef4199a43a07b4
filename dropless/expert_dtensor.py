"""One EP rank's routed experts as a piece of the global ``[E, ...]`` tensor, for DCP.

Under expert parallelism every rank names its ``e = E / EP`` local experts ``...experts.w13`` (and
``w2``), the same name as on every other rank. To store and load them as one global tensor (each
expert once, loadable at any dp and EP, EP 1 included), DCP is given a DTensor of the global shape:

* a plain tensor (the experts replicated over the dp ranks holding them):
  ``[Replicate(), Shard(0)]`` on the ``("dp", "ep")`` mesh;
* an FSDP2 shard of them over dp (``train.shard_experts``: a DTensor ``[Shard(d)]`` on the mesh's
  ``"dp"`` dimension, global shape ``[e, ...]``): ``[Shard(0), Shard(d)]`` on the ``("ep", "dp")``
  mesh (:func:`ep_dp_mesh`), i.e. EP block ``j`` of ``E``, then dp piece ``i`` of that block.

The DTensor wraps the local tensor itself (no copy), so DCP's in-place load writes the rank's piece.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["ep_dp_mesh", "global_experts"]


def ep_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ``("ep", "dp")`` DeviceMesh of a ``("dp", "ep")`` mesh from :func:`dropless.dispatch.mesh.build_mesh`:
    the same ranks and process groups with the dimensions swapped (no new group is made).

    Raises:
        ValueError: ``mesh`` does not have the dims ``("dp", "ep")``.
    """
    names = getattr(mesh, "mesh_dim_names", None)
    if not names or tuple(names) != ("dp", "ep"):
        raise ValueError(f"ep_dp_mesh: need the ('dp', 'ep') mesh of build_mesh, got dims {names}")
    return DeviceMesh.from_group([mesh["ep"].get_group(), mesh["dp"].get_group()], mesh.device_type,
                                 mesh=mesh.mesh.t().contiguous(), mesh_dim_names=("ep", "dp"))


def global_experts(t: torch.Tensor, mesh: DeviceMesh, swapped: DeviceMesh | None = None
                   ) -> tuple[DTensor, torch.Tensor] | None:
    """This EP rank's expert tensor ``t`` (weights or an AdamW moment) as a DTensor of the global tensor.

    Args:
        t: ``[e, ...]`` plain, or an FSDP2 DTensor over ``mesh["dp"]`` of global shape ``[e, ...]``.
        mesh: the run's ``("dp", "ep")`` mesh.
        swapped: :func:`ep_dp_mesh` of ``mesh``, if made already (one per save or load is enough).
    Returns:
        ``(global DTensor [E, ...], the local tensor it wraps)``; None for a 0-dim tensor or a DTensor
        on another mesh (left as it is).
    """
    if t.dim() == 0:
        return None
    ep = mesh["ep"].size()
    if isinstance(t, DTensor):
        if t.device_mesh.mesh_dim_names != ("dp",):
            return None
        local = t.to_local()
        shape = (t.shape[0] * ep, *t.shape[1:])
        d = DTensor.from_local(local, swapped if swapped is not None else ep_dp_mesh(mesh), [Shard(0), t.placements[0]],
                               run_check=False, shape=shape, stride=torch.empty(shape, device="meta").stride())
        return d, local
    return DTensor.from_local(t, mesh, [Replicate(), Shard(0)], run_check=False), t
