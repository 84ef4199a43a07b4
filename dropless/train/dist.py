"""Process group, device and the dp × ep mesh of a training run.

One process (no ``torchrun`` environment): world size 1, no process group. Under
``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` set):
``init_process_group`` from the environment with the backend of ``train.dist_backend``
(:func:`resolve_dist_backend`: ``auto`` is ``nccl`` on CUDA, one GPU per local rank, and
``gloo`` on CPU; ``gloo`` with ``device=cuda`` runs several ranks on one GPU, local rank
``r`` on GPU ``r % device_count``), with ``train.dist_timeout_s`` so a dead rank makes the
others fail instead of hang. The ranks' device types and backends are compared before the
group is made (:func:`dropless.dispatch.mesh.check_same_device`).

The process group is started by :func:`dropless.dispatch.mesh.start_process_group` (the one
starter). Mesh: ``ep = dispatcher.ep_size`` (null: the world size for ``a2a``/``agrs``/``deepep``,
1 for ``local``/``fsdp``), ``dp = world / ep``; built by
:func:`dropless.dispatch.mesh.build_mesh` with dims ``("dp", "ep")``. Every rank reads
different data (the EP ranks too), so data is sharded over all ``world`` ranks.

Errors (:class:`~dropless.config.ConfigError`, before the model is built): the world size
is not a multiple of ``ep_size``, or ``n_routed_experts`` is not (:func:`mesh_shape`, from the config);
``device=cuda`` without CUDA; ``nccl`` with more local ranks than GPUs, or on the CPU; ranks on
different device types.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dropless.config import ConfigError
from dropless.dispatch.collectives import CollectiveError
from dropless.dispatch.mesh import build_mesh, check_ep_size, start_process_group
from dropless.train.schema import DispatcherConfig, RunConfig

__all__ = ["resolve_dist_backend", "DistEnv", "resolve_ep_size", "mesh_shape", "init_distributed",
           "default_num_threads", "usable_cores", "launch_rank", "collective_failure", "elastic_restart"]


def resolve_dist_backend(want: Any, device: torch.device, local_world_size: int, gpus: int | None = None) -> str:
    """The process-group backend of ``train.dist_backend`` on ``device``: ``"nccl"`` or ``"gloo"``.

    ``auto``: ``nccl`` on CUDA, ``gloo`` on the CPU. ``gloo`` on CUDA is the several-ranks-per-GPU
    mode (testing and debugging the distributed CUDA path on a workstation; slow: gloo copies every
    CUDA tensor of a collective through host memory).

    Args:
        want: ``train.dist_backend`` (one of :data:`~dropless.train.schema.DIST_BACKENDS`: the schema checks it).
        device: this rank's device.
        local_world_size: processes on this node (torchrun's ``LOCAL_WORLD_SIZE``).
        gpus: CUDA devices this process sees (None: ``torch.cuda.device_count()``).
    Raises:
        ConfigError: ``nccl`` on the CPU; ``nccl`` with more local processes
            than GPUs (NCCL takes one GPU per rank; the message names ``train.dist_backend=gloo``).
    """
    name = str(want)
    if name == "auto":
        name = "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl":
        if device.type != "cuda":
            raise ConfigError(f"train.dist_backend=nccl runs on CUDA devices only, but this run's device is "
                              f"{device.type}: use train.dist_backend=auto (gloo on the CPU), or device=cuda")
        gpus = torch.cuda.device_count() if gpus is None else int(gpus)
        if local_world_size > gpus:
            raise ConfigError(
                f"{local_world_size} processes on this node but {gpus} GPU(s): NCCL needs one GPU per rank (it "
                f"refuses two ranks on one GPU). Launch at most {gpus} per node (torchrun --nproc_per_node "
                f"{gpus}), or set train.dist_backend=gloo to run several ranks per GPU (for testing and "
                "debugging: gloo moves every collective through host memory, so it is slow)")
    return name


@dataclass
class DistEnv:
    """Where this process stands.

    Attributes:
        rank, world_size, local_rank, local_world_size: from torchrun (0, 1, 0, 1 alone).
        device: this process's device.
        ep_size, dp_size: the mesh shape (ep_size · dp_size = world_size).
        mesh: the ``("dp", "ep")`` DeviceMesh, or None in one process.
        ep_group: process group of this rank's EP peers (None when ep_size == 1).
        dp_group: process group of the ranks holding the same experts (None alone).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    ep_size: int
    dp_size: int
    mesh: Any = None
    ep_group: Any = None
    dp_group: Any = None

    @property
    def distributed(self) -> bool:
        """More than one process (a process group exists)."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, logs and renames checkpoints."""
        return self.rank == 0

    @property
    def ep_rank(self) -> int:
        """This rank's place in its EP group (``ep`` innermost in the mesh)."""
        return self.rank % self.ep_size

    def barrier(self) -> None:
        """Wait for every rank (a no-op in one process); fails after ``train.dist_timeout_s``."""
        if self.distributed:
            dist.barrier()


def resolve_ep_size(dispatcher: DispatcherConfig, world_size: int) -> int:
    """``dispatcher.ep_size`` (validated: :meth:`DispatcherConfig.validate`), with null meaning the world
    size (a2a/agrs/deepep) or 1 (local/fsdp): :meth:`~dropless.dispatch.base.Dispatcher.default_ep_size`."""
    if dispatcher.ep_size is None:
        return dispatcher.kind.default_ep_size(world_size)
    return int(dispatcher.ep_size)


def mesh_shape(dispatcher: DispatcherConfig, world_size: int, n_routed_experts: int) -> tuple[int, int]:
    """``(ep_size, dp_size)`` of the dp × ep mesh (:func:`resolve_ep_size`; ``dp = world / ep``): THE check of
    the mesh shape, from the config and torchrun's ``WORLD_SIZE`` (:func:`~dropless.train.startup.check_train_config`
    calls it, so :func:`init_distributed` trusts it).

    Raises:
        ConfigError: ``world_size % ep`` or ``n_routed_experts % ep`` is not 0
            (:func:`~dropless.dispatch.mesh.check_ep_size`); with ``dispatcher.ep_size`` null, the message says
            where the EP came from and which sizes fit.
    """
    ep = resolve_ep_size(dispatcher, world_size)
    try:
        check_ep_size(world_size, ep, n_routed_experts)
    except ConfigError as e:
        if dispatcher.ep_size is None and ep > 1:  # the user never wrote that EP: say where it came from
            world, n = world_size, n_routed_experts
            fits = [d for d in range(1, world + 1) if world % d == 0 and n % d == 0]
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            raise ConfigError(f"dispatcher.ep_size is null, so dispatcher={dispatcher.name} spreads the experts "
                              f"over all {world} processes (EP = {ep}), and {ep} does not divide "
                              f"model.n_routed_experts={n}: set dispatcher.ep_size to one of {fits} "
                              f"(dividing both {world} and {n}), or launch a number of processes "
                              f"from {divisors}") from e
        raise
    return ep, world_size // ep


def default_num_threads(local_world_size: int) -> int:
    """CPU threads per process: the cores this process may use, shared by the local ranks.

    Deterministic (no dependence on the machine's load), so that a resumed run uses the same
    thread count, hence the same arithmetic, as the run it continues. On a machine that other
    processes keep busy, set ``num_threads=1``: intra-op threads that wait for each other stall
    when the cores are taken (docs/usage.md, "The CPU default run").

    Args:
        local_world_size: processes on this node.
    """
    return max(1, usable_cores() // max(1, local_world_size))


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _device(device_cfg: str, local_rank: int, recipe: str | None = None) -> torch.device:
    want = str(device_cfg)  # one of schema.DEVICES (RunConfig.validate)
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():  # a recipe that asks for CUDA (cpu_default leaves device=auto) is sized
            # for GPUs: device=cpu alone would meet the memory check with its model
            fix = (f"recipe={recipe} is sized for GPUs: on a CPU use the default recipe (cpu_default), or device=cpu "
                   "with a smaller model (e.g. model=tiny)" if recipe else "set device=cpu (or auto)")
            asked = f"device=cuda (recipe={recipe})" if recipe else "device=cuda"
            raise ConfigError(f"{asked} but torch sees no CUDA device; {fix}")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def launch_rank() -> int:
    """This process's rank from torchrun's environment (``RANK``; 0 alone): known before the process group."""
    return int(os.environ.get("RANK", "0"))


def init_distributed(cfg: RunConfig) -> DistEnv:
    """Set up the process group (under torchrun), the device and the mesh, for the checked config
    (:func:`~dropless.train.startup.check_train_config`'s typed :class:`RunConfig`, whose mesh shape
    :func:`mesh_shape` checked before any collective)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = launch_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    device = _device(cfg.device, local_rank, cfg.recipe)
    threads = cfg.num_threads  # >= 1 or null (dropless.train.schema.RunConfig.validate)
    torch.set_num_threads(int(threads) if threads is not None else default_num_threads(local_world))
    backend = resolve_dist_backend(cfg.train.dist_backend, device, local_world) if world > 1 else None
    ep = resolve_ep_size(cfg.dispatcher, world)
    dp = world // ep
    env = DistEnv(rank, world, local_rank, local_world, device, ep, dp)
    if world == 1:
        return env
    timeout_s = float(cfg.train.dist_timeout_s)
    start_process_group(device, timeout_s, backend=backend)
    env.mesh = build_mesh(world, ep, device.type, timeout_s=timeout_s)  # its dp/ep groups carry it too
    env.ep_group = env.mesh.get_group("ep") if ep > 1 else None
    env.dp_group = env.mesh.get_group("dp")
    return env


_PEER_FAILURE_MARKS = ("gloo", "NCCL", "Timed out", "timed out", "Connection closed by peer",
                       "Connection reset by peer")


def collective_failure(err: BaseException, timeout_s: float, rank: int, world_size: int) -> str | None:
    """The message for an error that a failed or timed-out collective raised; None for any other error.

    A rank that dies or stops taking part leaves its peers' next collective to fail: at once
    when its connection closes, else after the process group's timeout
    (``train.dist_timeout_s``). gloo reports both as a plain RuntimeError naming gloo's
    transport; NCCL as :class:`torch.distributed.DistError`; the dispatchers as
    :class:`~dropless.dispatch.collectives.CollectiveError`.

    Args:
        err: the exception the run raised.
        timeout_s: ``train.dist_timeout_s``.
        rank, world_size: this process's place, for the message.
    """
    dist_error = getattr(dist, "DistError", None)
    ours = isinstance(err, CollectiveError) or (dist_error is not None and isinstance(err, dist_error))
    if not ours and not (isinstance(err, RuntimeError) and any(m in str(err) for m in _PEER_FAILURE_MARKS)):
        return None
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (f"rank {rank} of {world_size}: a collective failed or did not complete within "
            f"train.dist_timeout_s={timeout_s:g} s: a peer rank died or stopped taking part (see its log). "
            "If a step legitimately takes longer than that, raise train.dist_timeout_s. "
            f"Underlying error: {first[:500]}")


def elastic_restart(cfg: Any) -> int:
    """Make a torchrun restart continue the run: ``resume=true`` when torchrun restarted the workers.

    torchrun (``--max-restarts N``) restarts every worker when one fails and counts the restarts
    in ``TORCHELASTIC_RESTART_COUNT``; with a count > 0 this sets ``cfg.resume = True``, so the
    run continues from the newest complete checkpoint in ``run_dir`` (or starts at step 0 if
    none was written yet).

    Args:
        cfg: the composed config (modified in place).
    Returns:
        the restart count (0: the first start, or no torchrun).
    Raises:
        ConfigError: torchrun may restart the job (``TORCHELASTIC_MAX_RESTARTS`` > 0) but
            ``run_dir`` is null, so a restart would not find the run's checkpoints.
    """
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if (restarts > 0 or max_restarts > 0) and not cfg.run_dir:
        raise ConfigError(f"torchrun may restart this job (--max-restarts {max_restarts}) but run_dir is null: a "
                          "restart would start a new dated run directory instead of continuing; set run_dir=PATH")
    if restarts > 0 and not cfg.resume:
        cfg.resume = True
    return restarts
