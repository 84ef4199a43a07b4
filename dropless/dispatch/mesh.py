"""The ``dp × ep`` device mesh, and process-group start-up with a timeout.

Ranks are laid out with ``ep`` innermost: EP group ``i`` holds ranks ``[i·EP, (i+1)·EP)``
(consecutive ranks, i.e. GPUs of one node for NVLink all-to-alls), and the dp groups
stride over them. For the ``a2a``/``agrs``/``deepep`` dispatchers the EP group is
``mesh["ep"].get_group()``; for ``fsdp`` (EP = 1) the experts are sharded over ``mesh["dp"]``.

Gradient scale (for the trainer): with a per-rank mean loss and the non-expert gradients
averaged over the world, the expert gradients that an EP dispatcher leaves on their owner
are a SUM over the EP group's ranks; averaging them over ``mesh["dp"]`` then gives ``EP×``
the world average, so divide them by ``EP`` (equivalently: sum over dp and divide by the
world size). ``fsdp`` needs no correction (FSDP2 averages over dp = world).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dropless.config import ConfigError

__all__ = ["build_mesh", "init_distributed", "check_ep_size", "ep_group"]


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> bool:
    """Initialise the default process group from torchrun's environment, with a timeout.

    Args:
        backend: None = ``"nccl"`` when CUDA is available, else ``"gloo"``.
        timeout_s: collective timeout in seconds: a rank that dies or stops taking part makes
            the others raise after at most about this long instead of hanging (gloo honours it
            directly; NCCL needs ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` left at its default, which
            tears the job down on timeout). None = torch's default (10 min for NCCL, 30 for gloo).
    Returns:
        True if this call initialised the group, False if it was already initialised or the
        environment holds no torchrun variables (a single process then needs no group).
    """
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    kw: dict[str, Any] = {"backend": backend}
    if timeout_s is not None:
        kw["timeout"] = datetime.timedelta(seconds=float(timeout_s))
    dist.init_process_group(**kw)
    return True


def check_ep_size(world_size: int, ep_size: int, n_routed_experts: int | None = None) -> None:
    """Raise :class:`ConfigError` unless ``ep_size`` divides ``world_size`` (and ``n_routed_experts``)."""
    if world_size < 1:
        raise ConfigError(f"world_size={world_size}: must be >= 1")
    if ep_size < 1:
        raise ConfigError(f"dispatcher.ep_size={ep_size}: must be >= 1 (1 = no expert parallelism)")
    if world_size % ep_size:
        raise ConfigError(
            f"world size {world_size} does not fit the mesh: dispatcher.ep_size={ep_size} must divide "
            f"the number of processes (dp = world / ep). Launch a multiple of {ep_size} processes "
            f"(torchrun --nproc_per_node ...) or set dispatcher.ep_size to a divisor of {world_size}.")
    if n_routed_experts is not None and n_routed_experts % ep_size:
        raise ConfigError(
            f"dispatcher.ep_size={ep_size} does not divide model.n_routed_experts={n_routed_experts}: "
            "each EP rank holds n_routed_experts / ep_size experts. Pick ep_size from its divisors.")


def build_mesh(world_size: int, ep_size: int, device_type: str = "cpu", *,
               n_routed_experts: int | None = None, timeout_s: float | None = None):
    """A 2-D :class:`~torch.distributed.device_mesh.DeviceMesh` with dims ``("dp", "ep")``.

    Args:
        world_size: number of ranks (must equal the process group's size when it exists).
        ep_size: expert-parallel size ``EP``; ``dp = world_size // ep_size``.
        device_type: ``"cpu"`` or ``"cuda"``.
        n_routed_experts: if given, checked to be divisible by ``ep_size``.
        timeout_s: collective timeout when this call has to initialise the process group.
    Returns:
        the mesh, shape ``(world_size // ep_size, ep_size)``.
    Raises:
        ConfigError: ``ep_size`` does not divide ``world_size`` or ``n_routed_experts``, or
            ``world_size`` differs from the initialised group's size, or ``world_size > 1``
            without a process group and without torchrun's environment.
    Notes:
        With ``world_size == 1`` and no process group, a one-rank group is created on an
        in-memory store (no torchrun, no ports), so single-process runs need no set-up.
    """
    check_ep_size(world_size, ep_size, n_routed_experts)
    if not dist.is_initialized():
        if world_size == 1 and "WORLD_SIZE" not in os.environ:
            backend = "gloo" if device_type == "cpu" else "nccl"
            kw: dict[str, Any] = {}
            if timeout_s is not None:
                kw["timeout"] = datetime.timedelta(seconds=float(timeout_s))
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
        elif not init_distributed("gloo" if device_type == "cpu" else None, timeout_s):
            raise ConfigError(f"build_mesh: world_size={world_size} but torch.distributed is not initialised and "
                              "no torchrun environment (RANK, WORLD_SIZE) is set; launch with torchrun or call "
                              "dropless.dispatch.mesh.init_distributed() first")
    actual = dist.get_world_size()
    if actual != world_size:
        raise ConfigError(f"build_mesh: world_size={world_size} but the process group has {actual} ranks; "
                          "pass world_size=torch.distributed.get_world_size()")
    return init_device_mesh(device_type, (world_size // ep_size, ep_size), mesh_dim_names=("dp", "ep"))


def ep_group(mesh_or_group: Any) -> Any:
    """The EP process group: ``mesh["ep"].get_group()`` for a mesh, the argument itself otherwise."""
    if mesh_or_group is None:
        return None
    names = getattr(mesh_or_group, "mesh_dim_names", None)
    if names is not None:
        if "ep" not in names:
            raise ValueError(f"ep_group: the mesh has dims {names}, no 'ep'; build it with build_mesh (dims "
                             "('dp', 'ep')) or pass the EP process group itself")
        return mesh_or_group["ep"].get_group()
    return mesh_or_group
