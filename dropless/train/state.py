"""The parts of a run that a checkpoint holds, each a :class:`~torch.distributed.checkpoint.stateful.Stateful`.

``torch.distributed.checkpoint`` (DCP) calls each part's ``state_dict()`` when it saves, and when it
loads it fills that same dict in place and hands it to the part's ``load_state_dict``:

* :class:`ModelState`: the weights and buffers of the checkpointed module (the router biases
  ``e_score_correction_bias`` and their ``tokens_per_expert`` counts are persistent buffers, so
  they are part of it), through :func:`~torch.distributed.checkpoint.state_dict.get_model_state_dict`
  and ``set_model_state_dict`` (FQN-keyed; FSDP2 DTensors stay DTensors);
* :class:`OptimizerState`: the optimizer's state (AdamW's moments and steps) through
  ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``; its param groups are this run's;
* :class:`RngState`: this process's random number generators.

The run's position (steps, data, LR schedule) is :class:`dropless.train.progress.Progress`.

Experts under expert parallelism (``mesh`` given): a rank holds ``E/EP`` experts under the same
names as every other rank, so the model and optimizer parts hand DCP each expert tensor as a
DTensor of the global ``[E, ...]`` tensor (:func:`dropless.expert_dtensor.global_experts`:
``[Replicate() over dp, Shard(0) over ep]``, or for an FSDP2 shard over dp, ``train.shard_experts``,
``[Shard(0) over ep, Shard(d) over dp]``): DCP stores every expert once, weights and moments, and the
checkpoint loads at another dp or EP size, at EP 1, sharded or not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh

from dropless.expert_dtensor import ep_dp_mesh, global_experts

__all__ = ["ModelState", "OptimizerState", "RngState"]


class _Experts:
    """The expert tensors of one ``state_dict()`` wrapped as global DTensors, to copy back after a load."""

    def __init__(self, fqns: set[str], mesh: DeviceMesh | None):
        self.fqns, self.mesh = set(fqns), mesh
        self.pairs: list[tuple[Any, torch.Tensor]] = []  # (global DTensor, the local tensor it wraps)
        self._swapped: DeviceMesh | None = None

    def start(self) -> None:
        """Forget the pairs of an earlier ``state_dict()`` (each call hands DCP new wrappers)."""
        self.pairs = []

    def wrap(self, fqn: str, t: Any) -> Any:
        """``t`` as a global DTensor where ``fqn`` is an expert tensor and there is a mesh; else ``t``."""
        if self.mesh is None or fqn not in self.fqns or not isinstance(t, torch.Tensor):
            return t
        if self._swapped is None:
            self._swapped = ep_dp_mesh(self.mesh)
        got = global_experts(t, self.mesh, self._swapped)
        if got is None:
            return t
        self.pairs.append(got)
        return got[0]

    @torch.no_grad()
    def copy_back(self) -> None:
        """After DCP's in-place load: make sure each local tensor holds its loaded piece."""
        for d, t in self.pairs:
            local = d.to_local()
            if local.data_ptr() != t.data_ptr():
                t.copy_(local)


class ModelState(Stateful):
    """The checkpoint's ``model`` entry: ``module``'s FQN-keyed weights and persistent buffers.

    Args:
        module: the module whose state is saved (the trainer's fp32 masters mirror,
            :attr:`dropless.train.optim.MasterWeights.state_module`).
        expert_fqns: the names of the routed experts' weights in ``module``.
        mesh: the run's ``("dp", "ep")`` mesh with expert parallelism (ep > 1); None otherwise (the
            experts are saved as they are).
    """

    def __init__(self, module: torch.nn.Module, expert_fqns: set[str] = frozenset(), mesh: DeviceMesh | None = None):
        self.module = module
        self.experts = _Experts(expert_fqns, mesh)

    def state_dict(self) -> dict[str, Any]:
        sd = get_model_state_dict(self.module)
        self.experts.start()
        return {k: self.experts.wrap(k, v) for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the loaded weights (``state_dict``: the dict of the last :meth:`state_dict`, filled by DCP)."""
        self.experts.copy_back()
        # set_model_state_dict takes the local tensors: with experts wrapped, those now hold the loaded values
        set_model_state_dict(self.module, get_model_state_dict(self.module) if self.experts.pairs else state_dict)


class OptimizerState(Stateful):
    """The checkpoint's ``optim`` entry: ``optimizer``'s state keyed by ``module``'s parameter FQNs.

    Loading keeps this run's param groups, not the saved ones: their hyperparameters come from the
    config (the learning rate from the schedule, :class:`~dropless.train.progress.Progress`), and
    their split into groups depends on the dispatcher (FSDP2's DTensor parameters get groups of their
    own), so a run saved under one dispatcher resumes under another.

    Args:
        module, expert_fqns, mesh: as :class:`ModelState`'s (the module the optimizer's parameters
            belong to).
        optimizer: the optimizer over ``module``'s parameters. ``get_optimizer_state_dict`` creates
            its state where it has none yet, which needs every ``.grad`` to be None.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, expert_fqns: set[str] = frozenset(),
                 mesh: DeviceMesh | None = None):
        self.module, self.optimizer = module, optimizer
        self.experts = _Experts(expert_fqns, mesh)

    def state_dict(self) -> dict[str, Any]:
        sd = get_optimizer_state_dict(self.module, self.optimizer)
        self.experts.start()
        state = sd.get("state", {})
        for fqn in list(state):  # a new dict per parameter: the old one may be the optimizer's own
            state[fqn] = {name: self.experts.wrap(fqn, v) for name, v in state[fqn].items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the loaded state (``state_dict``: the dict of the last :meth:`state_dict`, filled by DCP),
        with this run's param groups."""
        self.experts.copy_back()
        now = get_optimizer_state_dict(self.module, self.optimizer)  # this run's groups, the optimizer's own tensors
        loaded = now if self.experts.pairs else state_dict
        set_optimizer_state_dict(self.module, self.optimizer, {**loaded, "param_groups": now["param_groups"]})


class RngState(Stateful):
    """The checkpoint's ``rng`` entry: ``rank{rank}`` -> this process's torch CPU generator state
    (``cpu``, uint8) and on a CUDA ``device`` its generator's (``cuda``). Each rank saves its own key;
    loading sets this rank's, where the checkpoint has it (a checkpoint saved by fewer ranks leaves
    the generators of the ranks it lacks as they are)."""

    def __init__(self, rank: int, device: torch.device):
        self.key, self.device = f"rank{int(rank)}", torch.device(device)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        st = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            st["cuda"] = torch.cuda.get_rng_state(self.device)
        return {self.key: st}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        st = state_dict.get(self.key)
        if st is None:
            return
        torch.set_rng_state(st["cpu"].cpu())
        if self.device.type == "cuda" and "cuda" in st:
            torch.cuda.set_rng_state(st["cuda"].cpu(), self.device)
