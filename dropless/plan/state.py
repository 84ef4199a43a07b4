"""The planner's count of the training state one rank holds: weights, gradients, AdamW moments.

Per parameter, as the trainer keeps them (docs/design.md#memory-and-parallel-layouts):

* replicated (a plain parameter: every rank of its group holds all of it): the compute copy
  (``compute_bytes``: 2 in bf16, the fp32 master besides it; 4 in fp32, where the parameter is
  its own master) + the fp32 master, an fp32 main gradient, two fp32 AdamW moments:
  18 bytes in bf16, 16 in fp32;
* FSDP2-sharded over ``d`` ranks (``train.shard_dense`` over the world, ``train.shard_experts``
  over dp): the fp32 sharded parameter, its fp32 gradient and two moments, ``16 / d`` bytes; the
  bf16 copy exists only per layer while gathered (:func:`expert_shard_transient_bytes`).

The routed experts of a rank are ``routed / EP`` parameters (its ``E/EP`` experts of every MoE
layer), replicated over the ``dp = world / EP`` ranks holding the same experts unless
``train.shard_experts``; the other parameters are replicated over the world unless
``train.shard_dense``. Activations are not counted here (the per-layer tables of
:mod:`dropless.plan.report` give them).

Units: parameters are counts, bytes are bytes. Bad input raises ValueError naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass

from dropless.plan.cost import expert_weight_bytes, positive_int

__all__ = ["StateBytes", "param_state_bytes", "ExpertShardComm", "expert_shard_comm_bytes",
           "expert_shard_transient_bytes", "RankState", "rank_state"]


@dataclass(frozen=True)
class StateBytes:
    """Bytes of training state on one rank.

    Attributes:
        params: parameters whose state this is (this rank's share: ``/ d`` when sharded).
        weights: the parameters (compute copy and fp32 master; the fp32 shard when sharded).
        grads: the fp32 (main) gradients.
        optimizer: the two fp32 AdamW moments.
    """

    params: int
    weights: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        """``weights + grads + optimizer``."""
        return self.weights + self.grads + self.optimizer

    def __add__(self, other: "StateBytes") -> "StateBytes":
        return StateBytes(self.params + other.params, self.weights + other.weights, self.grads + other.grads,
                          self.optimizer + other.optimizer)


def param_state_bytes(params: int, compute_bytes: int = 2, sharded_over: int = 1) -> StateBytes:
    """The state of ``params`` parameters on one rank.

    Args:
        params: parameters (>= 0) one rank would hold unsharded.
        compute_bytes: bytes per element of the compute copy: 2 (bf16, fp32 masters besides) or 4
            (fp32, the parameters are the masters).
        sharded_over: FSDP2 shards them over this many ranks (1: replicated). FSDP2 pads each
            tensor to a multiple of it; this count divides the total (``ceil``), which the padding
            exceeds by less than ``sharded_over`` elements per tensor.
    Returns:
        replicated: ``params · (compute + 4 if bf16)``, ``params · 4``, ``params · 8``; sharded
        over ``d``: ``⌈params / d⌉ · 4``, ``· 4``, ``· 8``.
    Raises:
        ValueError: ``params < 0``, ``compute_bytes`` not 2 or 4, ``sharded_over < 1``.
    """
    if isinstance(params, bool) or not isinstance(params, int) or params < 0:
        raise ValueError(f"params={params!r} must be an integer >= 0")
    if compute_bytes not in (2, 4):
        raise ValueError(f"compute_bytes={compute_bytes!r}: 2 (bf16 with fp32 masters) or 4 (fp32)")
    positive_int("sharded_over", sharded_over)
    if sharded_over > 1:
        share = -(-params // sharded_over)
        return StateBytes(share, 4 * share, 4 * share, 8 * share)
    weights = params * (compute_bytes + 4 if compute_bytes == 2 else 4)
    return StateBytes(params, weights, 4 * params, 8 * params)


@dataclass(frozen=True)
class ExpertShardComm:
    """The collectives ``train.shard_experts`` adds per MoE layer and rank (bytes each rank receives
    or sends, ring algorithms: ``(d − 1)/d`` of the layer's local experts).

    Attributes:
        all_gather_forward: the bf16 weights gathered before the experts run.
        all_gather_backward: gathered again in backward (``reshard_after_forward``).
        reduce_scatter: the fp32 gradients reduce-scattered after backward.
    """

    all_gather_forward: int
    all_gather_backward: int
    reduce_scatter: int

    @property
    def total(self) -> int:
        return self.all_gather_forward + self.all_gather_backward + self.reduce_scatter


def expert_shard_comm_bytes(n_local: int, hidden_size: int, moe_intermediate_size: int, dp: int,
                            param_bytes: int = 2, grad_bytes: int = 4) -> ExpertShardComm:
    """Per-layer, per-rank bytes of ``train.shard_experts``' all-gathers and reduce-scatter.

    ``w = e·3·H·I`` elements of local experts; each collective moves ``(dp − 1)/dp · w`` elements
    per rank: the gathers at ``param_bytes`` (bf16 under the trainer's mixed precision), the
    reduce-scatter at ``grad_bytes`` (fp32). 0 at dp = 1. With ``model.num_token_chunks = N`` the
    experts' forward runs once per chunk, and so does each all-gather (N times these, forward and
    backward); the gradients are still reduce-scattered once.
    DeepSeek-V3 at EP 64, dp 2 (4 local experts): 168 MiB per gather, 336 MiB reduce-scattered.
    """
    positive_int("dp", dp)
    w = expert_weight_bytes(n_local, hidden_size, moe_intermediate_size, 1)
    share = w * (dp - 1) // dp
    return ExpertShardComm(share * param_bytes, share * param_bytes, share * grad_bytes)


def expert_shard_transient_bytes(n_local: int, hidden_size: int, moe_intermediate_size: int,
                                 param_bytes: int = 2, grad_bytes: int = 4, prefetch: bool = True) -> int:
    """Peak bytes ``train.shard_experts`` holds beyond the shards: one layer's gathered local experts
    (two with the next layer's prefetch) at ``param_bytes``, plus in backward that layer's unsharded
    gradient at ``param_bytes`` and its ``grad_bytes`` copy for the reduce-scatter.
    DeepSeek-V3 at EP 64 (4 local experts): 2 × 336 + 336 + 672 MiB = 1.64 GiB."""
    w = expert_weight_bytes(n_local, hidden_size, moe_intermediate_size, 1)
    return w * param_bytes * (2 if prefetch else 1) + w * (param_bytes + grad_bytes)


@dataclass(frozen=True)
class RankState:
    """One rank's training state for a layout (see the module docstring).

    Attributes:
        world, ep_size, dp_size: the mesh.
        experts_replicated, experts_sharded: the routed experts' state without and with
            ``train.shard_experts``.
        dense_replicated, dense_sharded: the other parameters' without and with ``train.shard_dense``.
        shard_experts, shard_dense: the layout's choice; total: its state (the chosen rows summed).
        transient: the gathered-expert buffers ``shard_experts`` adds at its peak (0 without it).
        comm: :class:`ExpertShardComm` per MoE layer (zeros without it or at dp = 1).
    """

    world: int
    ep_size: int
    dp_size: int
    experts_replicated: StateBytes
    experts_sharded: StateBytes
    dense_replicated: StateBytes
    dense_sharded: StateBytes
    shard_experts: bool
    shard_dense: bool
    transient: int
    comm: ExpertShardComm

    @property
    def total(self) -> StateBytes:
        experts = self.experts_sharded if self.shard_experts else self.experts_replicated
        return experts + (self.dense_sharded if self.shard_dense else self.dense_replicated)


def rank_state(routed_params: int, other_params: int, world: int, ep_size: int, n_local: int, hidden_size: int,
               moe_intermediate_size: int, *, shard_experts: bool = False, shard_dense: bool = False,
               compute_bytes: int = 2) -> RankState:
    """The training state per rank of a model of ``routed_params`` routed-expert and ``other_params``
    other parameters over ``world`` ranks at EP ``ep_size``.

    Raises:
        ValueError: ``ep_size`` does not divide ``world``.
    """
    positive_int("world", world, "pass --world N (the number of ranks)")
    positive_int("ep_size", ep_size)
    if world % ep_size:
        raise ValueError(f"world={world} is not a multiple of ep_size={ep_size}: dp = world / EP ranks hold the "
                         "same experts; pass --world N with N a multiple of the EP size")
    dp = world // ep_size
    per_rank = -(-routed_params // ep_size)
    sharding = shard_experts and dp > 1
    param_bytes = compute_bytes
    return RankState(
        world, ep_size, dp,
        param_state_bytes(per_rank, compute_bytes),
        param_state_bytes(per_rank, compute_bytes, dp),
        param_state_bytes(other_params, compute_bytes),
        param_state_bytes(other_params, compute_bytes, world),
        shard_experts, shard_dense,
        expert_shard_transient_bytes(n_local, hidden_size, moe_intermediate_size, param_bytes) if sharding else 0,
        expert_shard_comm_bytes(n_local, hidden_size, moe_intermediate_size, dp if sharding else 1, param_bytes))
