"""The planner: what one rank computes, holds and sends per MoE layer, before a job is launched.

* :mod:`dropless.plan.cost`: the cost model, one function per formula of the seed
  (rows, FLOPs, capacity factors, activation and saved bytes, bytes moved, tiles, decode).
* :mod:`dropless.plan.report`: :class:`RankShape`, :func:`plan` (the figures as a dict) and
  :func:`format_plan` (as text tables).
* :mod:`dropless.plan.cli`: ``dropless-plan`` (:func:`main`).

The model totals it reports (parameters, training FLOPs per token) are
:mod:`dropless.model.params`'s, re-exported here.
"""

from dropless.model.params import (
    ParamCounts,
    model_flops_per_token,
    moe_flops_per_token,
    param_counts,
)
from dropless.plan.cli import main
from dropless.plan.cost import (
    FP8_GEMMS,
    MEMORY_SETTINGS,
    ActivationBytes,
    CapacityRow,
    CommBytes,
    DecodeCost,
    GiB,
    MiB,
    TileBound,
    TileCost,
    a2a_agrs_crossover_ep,
    a2a_bytes,
    activation_bytes,
    agrs_bytes,
    align_up,
    aligned_rows,
    alignment_bound_rows,
    capacity_per_expert,
    capacity_table,
    check_counts,
    decode_alignment_cost,
    expert_flops,
    expert_weight_bytes,
    flops_per_row_per_expert,
    fp8_scale_bytes_per_row,
    fsdp_a2a_breakeven_tokens,
    fsdp_bytes,
    local_experts,
    mean_rows_per_expert,
    routed_rows,
    saved_bytes,
    tile_overhead_bound,
    tile_visits,
)
from dropless.plan.report import RankShape, format_plan, plan

__all__ = [
    "MiB", "GiB",
    "align_up", "local_experts", "check_counts", "routed_rows", "mean_rows_per_expert",
    "aligned_rows", "alignment_bound_rows", "flops_per_row_per_expert", "expert_flops",
    "capacity_per_expert", "CapacityRow", "capacity_table", "ActivationBytes", "activation_bytes",
    "MEMORY_SETTINGS", "saved_bytes",
    "FP8_GEMMS", "fp8_scale_bytes_per_row", "CommBytes", "a2a_bytes", "agrs_bytes", "fsdp_bytes", "expert_weight_bytes",
    "a2a_agrs_crossover_ep", "fsdp_a2a_breakeven_tokens", "DecodeCost", "decode_alignment_cost",
    "TileCost", "tile_visits", "TileBound", "tile_overhead_bound",
    "ParamCounts", "param_counts", "moe_flops_per_token", "model_flops_per_token",
    "RankShape", "plan", "format_plan", "main",
]
