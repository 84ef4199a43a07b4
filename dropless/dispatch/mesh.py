"""The ``dp × ep`` device mesh, the one process-group starter, and the rule that EP divides ``E``.

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
from torch.distributed.device_mesh import DeviceMesh

from dropless.config import ConfigError

__all__ = ["build_mesh", "check_ep_size", "check_same_device", "ep_group", "local_expert_count",
           "start_process_group"]


def start_process_group(device: str | torch.device | None = None, timeout_s: float | None = None, *,
                        single_rank: bool = False, backend: str | None = None) -> bool:
    """Start the default process group: THE place dropless calls ``init_process_group``.

    Under torchrun (``RANK`` and ``WORLD_SIZE`` set) the group comes from its environment;
    without it, ``single_rank=True`` makes a one-rank group on an in-memory store (no ports).

    Args:
        device: the rank's device (or its type): ``gloo`` on CPU, ``nccl`` on CUDA (bound to
            that device). None: CUDA's current device when CUDA is available, else the CPU.
        timeout_s: collective timeout in seconds (``train.dist_timeout_s``): a rank that dies or
            stops taking part makes the others raise after at most about this long instead of
            hanging (gloo honours it directly; NCCL needs ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` left
            at its default, which tears the job down on timeout). None: torch's default
            (10 min for NCCL, 30 for gloo).
        single_rank: without torchrun's environment, make a one-rank group instead of none.
        backend: ``"nccl"`` or ``"gloo"``; None: ``nccl`` on CUDA, ``gloo`` on the CPU. ``gloo`` on CUDA
            runs several ranks on one GPU (gloo moves CUDA tensors through host memory; NCCL refuses
            two ranks on one GPU): :func:`dropless.train.dist.resolve_dist_backend` decides.
    Returns:
        True if this call started the group; False if one already existed, or there is no
        torchrun environment and ``single_rank`` is False (a single process needs no group).
    """
    if dist.is_initialized():
        return False
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    kw: dict[str, Any] = {"backend": backend}
    if timeout_s is not None:
        kw["timeout"] = datetime.timedelta(seconds=float(timeout_s))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl" and device.type == "cuda" and device.index is not None:
            kw["device_id"] = device
        store, rank, world = next(dist.rendezvous("env://", **({"timeout": kw["timeout"]} if "timeout" in kw else {})))
        # torchrun keeps its store across the restarts of --max-restarts: without a prefix of the
        # start, a restarted rank can read a dead rank's address from the previous start and fail
        # to connect ("Gloo connectFullMesh failed ... Connection refused")
        start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"dropless/start{start}/", store)
        check_same_device(store, rank, world, device, backend)
        dist.init_process_group(store=store, rank=rank, world_size=world, **kw)
        return True
    if single_rank:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kw)
        return True
    return False


def check_same_device(store: Any, rank: int, world_size: int, device: torch.device, backend: str) -> None:
    """Every rank's device type and backend, exchanged through the rendezvous store, must agree.

    Runs before ``init_process_group``: ranks that would make their groups with different
    backends (one on the CPU with gloo, one on CUDA with NCCL, e.g. ``device=auto`` where one
    rank sees no GPU) would otherwise wait for each other until the timeout. Each rank writes
    ``device/<rank>`` and reads every rank's (a read waits for the key, up to the store's
    timeout), so every rank raises the same error, and only once every rank has read them all.

    Args:
        store: the job's (prefixed) rendezvous store.
        rank, world_size: this rank and the number of ranks.
        device: this rank's device; backend: the backend it would start.
    Raises:
        ConfigError: the ranks disagree; the message lists each rank's device type and backend.
    """
    store.set(f"device/{rank}", f"{device.type}/{backend}")
    seen = [store.get(f"device/{r}").decode() for r in range(world_size)]
    if len(set(seen)) > 1:
        # no rank raises before every rank has read: the store may live in one of these processes
        # (rank 0's, without torchrun), and its exit would turn another rank's pending read into a
        # connection error instead of this message
        store.set(f"device_read/{rank}", "1")
        store.wait([f"device_read/{r}" for r in range(world_size)])
        listing = ", ".join(f"rank {r}: {s.replace('/', ' with ')}" for r, s in enumerate(seen))
        raise ConfigError(f"the ranks disagree on their device or process-group backend ({listing}): every rank "
                          "must run on the same kind of device with the same backend. Set device=cuda or "
                          "device=cpu explicitly (device=auto follows what each process sees), and the same "
                          "train.dist_backend, on every rank")


def local_expert_count(n_routed_experts: int, ep_size: int, *, ep_name: str = "dispatcher.ep_size",
                       experts_name: str = "model.n_routed_experts", fix: str = "") -> int:
    """``e = E / EP``, the routed experts on each EP rank: THE check that EP divides ``E``.

    Args:
        n_routed_experts: ``E``; ep_size: ``EP``.
        ep_name, experts_name: how the caller's user spells the two (config keys by default;
            the planner's ``ep_size`` / ``n_routed_experts``), for the message.
        fix: appended to the message (e.g. the caller's option that sets EP).
    Returns:
        ``E // EP``.
    Raises:
        ConfigError (a ValueError): ``EP`` is not a positive integer, or does not divide ``E``.
    """
    tail = f" ({fix})" if fix else ""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ConfigError(f"{ep_name}={ep_size!r}: must be a positive integer (1 = no expert parallelism){tail}")
    if isinstance(n_routed_experts, bool) or not isinstance(n_routed_experts, int) or n_routed_experts < 1:
        raise ConfigError(f"{experts_name}={n_routed_experts!r}: must be a positive integer")
    if n_routed_experts % ep_size:
        divisors = [d for d in range(1, n_routed_experts + 1) if n_routed_experts % d == 0]
        raise ConfigError(
            f"{ep_name}={ep_size} does not divide {experts_name}={n_routed_experts}: every EP rank holds the "
            f"same number of experts ({experts_name} / {ep_name}); pick an EP size from the divisors of "
            f"{n_routed_experts}: {divisors}{tail}")
    return n_routed_experts // ep_size


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
    if n_routed_experts is not None:
        local_expert_count(n_routed_experts, ep_size)


def build_mesh(world_size: int, ep_size: int, device_type: str = "cpu", *,
               n_routed_experts: int | None = None, timeout_s: float | None = None):
    """A 2-D :class:`~torch.distributed.device_mesh.DeviceMesh` with dims ``("dp", "ep")``.

    Args:
        world_size: number of ranks (must equal the process group's size when it exists).
        ep_size: expert-parallel size ``EP``; ``dp = world_size // ep_size``.
        device_type: ``"cpu"`` or ``"cuda"``.
        n_routed_experts: if given, checked to be divisible by ``ep_size``.
        timeout_s: collective timeout in seconds (``train.dist_timeout_s``) of the process group
            when this call has to start it, and of the mesh's dp and ep groups. None: torch's
            default for new groups (30 min gloo, 10 min NCCL).
    Returns:
        the mesh, shape ``(world_size // ep_size, ep_size)``.
    Raises:
        ConfigError: ``ep_size`` does not divide ``world_size`` or ``n_routed_experts``, or
            ``world_size`` differs from the initialised group's size, or ``world_size > 1``
            without a process group and without torchrun's environment.
    Notes:
        New process groups do not inherit the default group's timeout, and ``init_device_mesh``
        gives its groups none, so the groups are made here with ``dist.new_group(ranks,
        timeout=...)`` (every rank makes every slice, in the same order) and the mesh is built
        on them with ``DeviceMesh.from_group``. A dimension spanning every rank reuses the
        default group, as ``init_device_mesh`` does (its timeout is the one it was started with).
        With ``world_size == 1`` and no process group, a one-rank group is created on an
        in-memory store (no torchrun, no ports), so single-process runs need no set-up.
    """
    check_ep_size(world_size, ep_size, n_routed_experts)
    if not dist.is_initialized():
        if not start_process_group(None if device_type == "cuda" else "cpu", timeout_s, single_rank=world_size == 1):
            raise ConfigError(f"build_mesh: world_size={world_size} but torch.distributed is not initialised and "
                              "no torchrun environment (RANK, WORLD_SIZE) is set; launch with torchrun or call "
                              "dropless.dispatch.mesh.start_process_group() first")
    actual = dist.get_world_size()
    if actual != world_size:
        raise ConfigError(f"build_mesh: world_size={world_size} but the process group has {actual} ranks; "
                          "pass world_size=torch.distributed.get_world_size()")
    ranks = torch.arange(world_size, dtype=torch.int).reshape(world_size // ep_size, ep_size)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=float(timeout_s))
    me = dist.get_rank()
    groups = []
    for slices in (ranks.t(), ranks):  # dp slices are the columns, ep slices the rows
        mine = None
        for sl in slices.tolist():
            g = (dist.group.WORLD if len(sl) == world_size
                 else dist.new_group(sl, timeout=timeout) if timeout is not None else dist.new_group(sl))
            if me in sl:
                mine = g
        groups.append(mine)
    return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=("dp", "ep"))


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
