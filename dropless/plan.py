"""The planner: what one rank computes, holds and sends per MoE layer.

``dropless-plan`` answers before a job is launched what each rank of a recipe
will compute, hold in activations and send over the network for one MoE layer,
and gives the model totals (parameters, training FLOPs per token) that the
trainer's MFU divides by. Everything here is plain Python arithmetic on ints
and floats (no torch).

The formulas and the reference figures come from the seed
``seeds/003_…`` ("Dropless 与分组矩阵乘"); each function names its section.
The seed's reference rank (§1): DeepSeek-V3, H = 7168, I = 2048, E = 256,
k = 8, EP = 64 (4 local experts), 8,192 tokens per rank, alignment A = 128,
counts ``[21733, 15004, 17982, 10817]``. Figures reproduced (tests/test_plan.py):

==========================================  ==============================
65,536 routed rows per rank (mean)           :func:`routed_rows`
65,792 aligned rows, +0.39 % (bound 0.78 %)  :func:`aligned_rows`
88.08 MFLOP per row per expert               :func:`flops_per_row_per_expert`
5.772 / 5.795 / 8.659 / 23.180 TFLOP         :func:`expert_flops`
cf 1.0 drops 6,947 and pads 6,947 rows       :func:`capacity_table`
448 MiB + 896 MiB = 1.31 GiB (a2a)           :func:`a2a_bytes`
6.89 GiB each way, 13.8 GiB (agrs)           :func:`agrs_bytes`
21.0 GiB (fsdp)                              :func:`fsdp_bytes`
EP ≈ 7, ≈ 131,000 tokens per rank            :func:`a2a_agrs_crossover_ep`,
                                             :func:`fsdp_a2a_breakeven_tokens`
515 tiles of 128, +0.59 %                    :func:`tile_visits`
+199 %, +37 % (mean ≈ +19 %)                 :func:`tile_overhead_bound`
32 rows per expert, 4× at A = 128            :func:`decode_alignment_cost`
3.00 / 2.25 / 0.375 GiB (295B config)        :func:`activation_bytes`
saved-for-backward by memory option          :func:`saved_bytes` (issue 6, not a seed figure)
671B total, 37B activated                    :func:`param_counts`
==========================================  ==============================

Units: rows and tokens are counts; FLOPs are plain floating-point operations
(a multiply-add is 2); bytes are bytes (MiB = 2**20, GiB = 2**30, as the seed
uses them); "TFLOP" in the printed table is 1e12 FLOPs.

Errors: bad input raises :class:`ValueError` naming the argument and the fix.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from dropless.config import ModelArgs
from dropless.model.params import ParamCounts, model_flops_per_token, moe_flops_per_token, param_counts

MiB = 2**20
GiB = 2**30

__all__ = [
    "MiB", "GiB",
    "align_up", "local_experts", "check_counts", "routed_rows", "mean_rows_per_expert",
    "aligned_rows", "alignment_bound_rows", "flops_per_row_per_expert", "expert_flops",
    "capacity_per_expert", "CapacityRow", "capacity_table", "ActivationBytes", "activation_bytes",
    "MEMORY_SETTINGS", "saved_bytes",
    "CommBytes", "a2a_bytes", "agrs_bytes", "fsdp_bytes", "expert_weight_bytes",
    "a2a_agrs_crossover_ep", "fsdp_a2a_breakeven_tokens", "DecodeCost", "decode_alignment_cost",
    "TileCost", "tile_visits", "TileBound", "tile_overhead_bound",
    "ParamCounts", "param_counts", "moe_flops_per_token", "model_flops_per_token",
    "RankShape", "plan", "format_plan", "main",
]


# --------------------------------------------------------------------------- checks
def _positive_int(name: str, value: Any, fix: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer" + (f"; {fix}" if fix else ""))
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def align_up(n: int, a: int) -> int:
    """Round the row count ``n`` up to a multiple of ``a`` (``a >= 1``). Seed §3."""
    _positive_int("alignment", a, "use 1 (no alignment) or a tile height such as 128")
    return -(-n // a) * a


def local_experts(n_routed_experts: int, ep_size: int) -> int:
    """``e = E / EP``, the routed experts that live on one rank (seed §1: 256 / 64 = 4).

    Raises:
        ValueError: ``ep_size`` is not a positive divisor of ``n_routed_experts``.
    """
    _positive_int("n_routed_experts", n_routed_experts)
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size <= 0 \
            or n_routed_experts % ep_size:
        raise ValueError(
            f"ep_size={ep_size!r} does not divide n_routed_experts={n_routed_experts}: every rank "
            f"must hold the same number of experts; pick an EP size from "
            f"{_divisors(n_routed_experts)} (--ep N or dispatcher.ep_size=N)")
    return n_routed_experts // ep_size


def check_counts(counts: Iterable[int], n_local: int) -> list[int]:
    """Validate a per-local-expert row-count vector and return it as a list of ints.

    Args:
        counts: rows landed on this rank for each of its ``n_local`` experts.
        n_local: ``e = E / EP``.
    Raises:
        ValueError: wrong length, a negative or non-integer entry.
    """
    out = list(counts)
    if len(out) != n_local:
        raise ValueError(
            f"counts has {len(out)} entries but a rank holds e = E/EP = {n_local} local experts: "
            f"give one count per local expert (--counts c0,...,c{n_local - 1}) or change the EP size")
    for i, c in enumerate(out):
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(f"counts[{i}]={c!r}: counts are rows landed per local expert and "
                             f"must be integers >= 0")
    return out


# --------------------------------------------------------------------------- rows (§1, §3)
def routed_rows(tokens_per_rank: int, k: int) -> int:
    """Mean routed rows landed per rank per MoE layer, ``T·k``. Seed §1.

    The rows a rank *sends* are exactly ``T·k``; the rows it *receives* are data
    (they depend on every rank's routing) and equal ``T·k`` only on average
    (seed §1: 8,192 × 8 = 65,536). Shared experts are not counted: they read
    ``x_TH`` directly (seed §1, "第 9 个").
    """
    _positive_int("tokens_per_rank", tokens_per_rank)
    _positive_int("num_experts_per_tok", k)
    return tokens_per_rank * k


def mean_rows_per_expert(tokens_per_rank: int, k: int, n_local: int) -> float:
    """Mean rows per local expert, ``T·k / e`` (= ``T·EP·k / E``). Seed §1: 16,384."""
    _positive_int("n_local", n_local)
    return routed_rows(tokens_per_rank, k) / n_local


def aligned_rows(counts: Sequence[int], alignment: int) -> int:
    """Rows computed when each expert's segment is padded to a multiple of ``A``: ``Σ align_up(c, A)``.

    Seed §3: ``[21733, 15004, 17982, 10817]`` at A = 128 → 65,792 (+256 rows, +0.39 %).
    Like the seed, this pads every segment, the last one included (the
    ExpertLayout's ``end[e-1]`` leaves the last segment unpadded, so it can be
    up to ``A - 1`` rows smaller).
    """
    return sum(align_up(int(c), alignment) for c in counts)


def alignment_bound_rows(n_local: int, alignment: int) -> int:
    """Most padding rows alignment can add on one rank, ``e·(A - 1)``. Seed §3: 4 × 127 = 508 (0.78 %)."""
    _positive_int("n_local", n_local)
    _positive_int("alignment", alignment)
    return n_local * (alignment - 1)


# --------------------------------------------------------------------------- FLOPs (§4)
def flops_per_row_per_expert(hidden_size: int, moe_intermediate_size: int) -> int:
    """Forward FLOPs of one row through one SwiGLU expert, ``2·3·H·I``. Seed §4.

    Three matmuls (gate, up: H→I; down: I→H), 2 FLOPs per multiply-add; the
    SwiGLU's elementwise work is not counted (as in the seed).
    DeepSeek-V3: 2 × 7,168 × 2,048 × 3 = 88,080,384 ≈ 88.08 MFLOP.
    """
    _positive_int("hidden_size", hidden_size)
    _positive_int("moe_intermediate_size", moe_intermediate_size)
    return 2 * 3 * hidden_size * moe_intermediate_size


def expert_flops(rows: float, hidden_size: int, moe_intermediate_size: int,
                 experts_per_row: int = 1) -> float:
    """Forward FLOPs of the routed experts of one MoE layer on one rank. Seed §4.

    ``rows · experts_per_row · 2·3·H·I``. The seed's four ways of counting
    (DeepSeek-V3 rank): live rows 65,536 → 5.772 TFLOP; aligned rows 65,792 →
    5.795; capacity factor 1.5, 98,304 rows → 8.659; ungrouped (every aligned
    row against all ``e`` = 4 local experts, ``experts_per_row = 4``) → 23.180.
    Training (forward + backward) is 3× these.
    """
    if rows < 0:
        raise ValueError(f"rows={rows!r} must be >= 0")
    return rows * experts_per_row * flops_per_row_per_expert(hidden_size, moe_intermediate_size)


# --------------------------------------------------------------------------- capacity factor (§2, §6)
def capacity_per_expert(tokens_per_rank: int, k: int, n_local: int, capacity_factor: float) -> int:
    """Rows of the per-expert box of the old token-dropping scheme, ``ceil(cf · T·k / e)``. Seed §2.

    The box is a multiple of the *mean* rows per expert (seed §2: cf 1.0 → 16,384,
    cf 1.5 → 24,576). Rounded up to a whole row.

    Raises:
        ValueError: ``capacity_factor <= 0``.
    """
    if not isinstance(capacity_factor, (int, float)) or isinstance(capacity_factor, bool) \
            or not math.isfinite(capacity_factor) or capacity_factor <= 0:
        raise ValueError(
            f"capacity_factor={capacity_factor!r} must be a number > 0 (1.0 = a box of exactly "
            f"the mean rows per expert, 1.5 = 50 % headroom); leave it out for dropless")
    return math.ceil(capacity_factor * mean_rows_per_expert(tokens_per_rank, k, n_local) - 1e-9)


@dataclass(frozen=True)
class CapacityRow:
    """One line of the seed's §6 trade-off table (per rank, per MoE layer).

    Attributes:
        scheme: ``"cf=1.0"``, ``"cf=1.5"``, ... or ``"dropless A=128"``.
        capacity_factor: the factor, or None for dropless.
        capacity_per_expert: rows of each expert's box (None for dropless).
        computed_rows: rows the GEMMs run over (``e·capacity`` or the aligned rows).
        dropped_rows: live rows that do not fit their box (None without counts).
        padded_rows: zero/padding rows computed (None without counts).
        extra_compute: ``computed_rows / live_rows - 1`` (None without counts).
        padded_fraction: ``padded_rows / live_rows``, the seed's "白算" column
            (cf 1.0: 10.6 %, cf 1.5: 50 %, dropless: 0.39 %; None without counts).
    """

    scheme: str
    capacity_factor: float | None
    capacity_per_expert: int | None
    computed_rows: int
    dropped_rows: int | None
    padded_rows: int | None
    extra_compute: float | None
    padded_fraction: float | None = None


def capacity_table(counts: Sequence[int] | None, tokens_per_rank: int, k: int, n_local: int,
                   capacity_factors: Sequence[float], alignment: int = 128) -> list[CapacityRow]:
    """The capacity-factor rows beside the dropless one, for one count vector. Seed §2, §3, §6.

    For capacity factor ``cf`` the box is :func:`capacity_per_expert`; a rank
    computes ``e·box`` rows, drops ``Σ max(c - box, 0)`` and pads
    ``Σ max(box - c, 0)``. Dropless (last row) drops nothing and pads
    ``Σ align_up(c, A) - Σ c``. Seed §6 for the reference rank: cf 1.0 computes
    65,536, drops 6,947, pads 6,947 (10.6 %); cf 1.5 computes 98,304, drops 0,
    pads 32,768 (+50 %); dropless A = 128 computes 65,792, pads 256 (+0.39 %).

    ``extra_compute`` is relative to the live rows ``Σ c``. Without counts only
    ``computed_rows`` is known (dropless then shows the mean ``T·k``).
    """
    rows: list[CapacityRow] = []
    live = sum(counts) if counts is not None else None
    for cf in capacity_factors:
        box = capacity_per_expert(tokens_per_rank, k, n_local, cf)
        computed = n_local * box
        if counts is None:
            dropped = padded = None
            extra = None
        else:
            dropped = sum(max(c - box, 0) for c in counts)
            padded = sum(max(box - c, 0) for c in counts)
            extra = computed / live - 1 if live else None
        rows.append(CapacityRow(f"cf={_cf_key(cf)}", float(cf), box, computed, dropped, padded, extra,
                                padded / live if counts is not None and live else None))
    if counts is None:
        rows.append(CapacityRow(f"dropless A={alignment}", None, None,
                                routed_rows(tokens_per_rank, k), 0, None, None))
    else:
        al = aligned_rows(counts, alignment)
        rows.append(CapacityRow(f"dropless A={alignment}", None, None, al, 0, al - live,
                                al / live - 1 if live else None, (al - live) / live if live else None))
    return rows


# --------------------------------------------------------------------------- activations (§4)
@dataclass(frozen=True)
class ActivationBytes:
    """Bytes of the large per-layer activations of one rank. Seed §4 ("那这一步占多少显存").

    Attributes:
        x: the layer input ``[T, H]``.
        landed_rows: the dispatched / sorted rows ``[R, H]`` (step 6).
        gate_up: the FC1 output, gate‖up ``[R, 2I]`` (step 7).
        swiglu: the SwiGLU output ``[R, I]`` (step 8).
        fc2_out: the FC2 output ``[R, H]`` (step 9).
    """

    x: int
    landed_rows: int
    gate_up: int
    swiglu: int
    fc2_out: int


def activation_bytes(tokens: int, rows: int, hidden_size: int, moe_intermediate_size: int,
                     bytes_per_element: int = 2) -> ActivationBytes:
    """Per-layer activation bytes of one rank; ``rows`` are the landed rows (aligned where the layout pads).

    Seed §4, bf16 (2 B): DeepSeek-V3 rank, T = 8,192, R = 65,792: x 0.11 GiB,
    landed 0.88 GiB, gate‖up 0.50 GiB, SwiGLU 0.25 GiB, FC2 0.88 GiB.
    The 295B config (H 4,096, I 1,536, T = 49,152, R = 393,216, no alignment):
    x 0.375 GiB, sort buffer 3.00 GiB, gate‖up 2.25 GiB.
    These are one layer's transient buffers (with recompute, the peak is one layer's).
    """
    _positive_int("tokens", tokens)
    if rows < 0:
        raise ValueError(f"rows={rows!r} must be >= 0")
    b = _positive_int("bytes_per_element", bytes_per_element)
    H, I = hidden_size, moe_intermediate_size
    return ActivationBytes(x=tokens * H * b, landed_rows=rows * H * b, gate_up=rows * 2 * I * b,
                           swiglu=rows * I * b, fc2_out=rows * H * b)


#: The MoE memory settings of :func:`saved_bytes`, in order of what they drop.
MEMORY_SETTINGS = ("default", "recompute_swiglu", "recompute_fc1", "recompute_fc1+fold",
                   "recompute_fc1+fold+gather")


def saved_bytes(rows: int, hidden_size: int, moe_intermediate_size: int, setting: str,
                bytes_per_element: int = 2) -> int:
    """Bytes the routed experts keep for backward per layer, without indices (issue 6).

    ``rows`` = ``M``, the landed buffer's rows. By setting (``b`` bytes per element):

    * ``default``: ``b·M·(2H + 3I)`` — landed rows, gate‖up, SwiGLU output, FC2 output
      (the combine keeps the FC2 output for the routing weights' gradient);
    * ``recompute_swiglu``: ``b·M·(2H + 2I)`` — no SwiGLU output;
    * ``recompute_fc1``: ``b·M·2H`` — no gate‖up either;
    * ``recompute_fc1+fold``: ``b·M·H`` — weights folded before FC2, so the FC2 output is
      not kept: one copy of the landed rows (DESIGN.md's bound);
    * ``recompute_fc1+fold+gather``: ``0`` — the rows are re-gathered from ``x`` (EP = 1).

    On top come the int64 indices (``16·T·k`` bytes and ``8·M`` with ``recompute_gather``) and
    the folded row weights (``b·M``); ``tests/test_moe_memory.py`` measures all of it with
    ``saved_tensors_hooks``. Without activation checkpointing every MoE layer keeps this
    until its backward.

    Raises:
        ValueError: an unknown setting (the message lists them).
    """
    if setting not in MEMORY_SETTINGS:
        raise ValueError(f"saved_bytes: setting={setting!r}; choose one of {MEMORY_SETTINGS}")
    if rows < 0:
        raise ValueError(f"rows={rows!r} must be >= 0")
    b = _positive_int("bytes_per_element", bytes_per_element)
    H, I = hidden_size, moe_intermediate_size
    per_row = {"default": 2 * H + 3 * I, "recompute_swiglu": 2 * H + 2 * I, "recompute_fc1": 2 * H,
               "recompute_fc1+fold": H, "recompute_fc1+fold+gather": 0}[setting]
    return b * rows * per_row


# --------------------------------------------------------------------------- communication (§14)
@dataclass(frozen=True)
class CommBytes:
    """Bytes one rank sends for one MoE layer's forward pass. Seed §14.

    Attributes:
        dispatcher: ``a2a``, ``agrs`` or ``fsdp``.
        out_bytes: the first leg (a2a dispatch, agrs all-gather, fsdp weight all-gather).
        back_bytes: the return leg (a2a combine, agrs reduce-scatter; 0 for fsdp).
    """

    dispatcher: str
    out_bytes: int
    back_bytes: int

    @property
    def total(self) -> int:
        return self.out_bytes + self.back_bytes


def a2a_bytes(tokens_per_rank: int, k: int, hidden_size: int, dispatch_bytes: int = 1,
              combine_bytes: int = 2) -> CommBytes:
    """All-to-all: ``T·k·H·dispatch_bytes`` out, ``T·k·H·combine_bytes`` back. Seed §14 ①.

    As the seed counts it: every one of the ``T·k`` rows crosses the network
    once each way (no discount for rows whose expert is local, no node-level
    de-duplication). Independent of EP. DeepSeek-V3 rank: dispatch (fp8)
    448 MiB, combine (bf16) 896 MiB, 1.3125 GiB ≈ 1.31 GiB.
    """
    rows = routed_rows(tokens_per_rank, k)
    return CommBytes("a2a", rows * hidden_size * dispatch_bytes, rows * hidden_size * combine_bytes)


def agrs_bytes(tokens_per_rank: int, hidden_size: int, ep_size: int,
               bytes_per_element: int = 2) -> CommBytes:
    """All-gather + reduce-scatter: ``(EP - 1)·T·H·2 B`` each way. Seed §14 ②.

    Every token goes to every other EP rank (bf16), partial outputs come back by
    reduce-scatter (bf16). Grows with EP. DeepSeek-V3 rank, EP = 64:
    6.89 GiB each way, ≈ 13.8 GiB.
    """
    _positive_int("tokens_per_rank", tokens_per_rank)
    _positive_int("ep_size", ep_size)
    one_way = (ep_size - 1) * tokens_per_rank * hidden_size * bytes_per_element
    return CommBytes("agrs", one_way, one_way)


def expert_weight_bytes(n_experts: int, hidden_size: int, moe_intermediate_size: int,
                        bytes_per_element: int = 2) -> int:
    """Bytes of ``n_experts`` SwiGLU experts, ``n·3·H·I·bytes``. Seed §14.

    DeepSeek-V3: 256 experts = 11,274,289,152 params ("112.7 亿") = 21.0 GiB bf16;
    the 4 experts an EP = 64 rank keeps = 336 MiB.
    """
    if n_experts < 0:
        raise ValueError(f"n_experts={n_experts!r} must be >= 0")
    return n_experts * 3 * hidden_size * moe_intermediate_size * bytes_per_element


def fsdp_bytes(n_routed_experts: int, hidden_size: int, moe_intermediate_size: int,
               bytes_per_element: int = 2) -> CommBytes:
    """EP = 1 + FSDP: all of the layer's expert weights are all-gathered. Seed §14 ③.

    As the seed counts it: the full layer's expert weights in bf16 (not the
    ``(W-1)/W`` share a ring all-gather moves), forward only (backward adds a
    re-gather and a gradient reduce-scatter). Independent of T.
    DeepSeek-V3: 21.0 GiB per layer per rank.
    """
    return CommBytes("fsdp", expert_weight_bytes(n_routed_experts, hidden_size,
                                                 moe_intermediate_size, bytes_per_element), 0)


def a2a_agrs_crossover_ep(k: int, dispatch_bytes: int = 1, combine_bytes: int = 2,
                          agrs_bytes_per_element: int = 2) -> float:
    """EP at which a2a and agrs send the same bytes. Seed §14.

    ``T·k·H·(d + c) = 2·(EP - 1)·T·H·b`` ⇒ ``EP = 1 + k·(d + c) / (2·b)``.
    fp8 dispatch, bf16 combine, k = 8: 8 × 3 = 4 × (EP − 1) ⇒ EP = 7.
    Above it a2a sends fewer bytes; with bf16 dispatch it is 9.
    """
    _positive_int("num_experts_per_tok", k)
    return 1 + k * (dispatch_bytes + combine_bytes) / (2 * agrs_bytes_per_element)


def fsdp_a2a_breakeven_tokens(n_routed_experts: int, hidden_size: int, moe_intermediate_size: int,
                              k: int, dispatch_bytes: int = 1, combine_bytes: int = 2,
                              weight_bytes: int = 2) -> float:
    """Tokens per rank at which fsdp's weight all-gather equals a2a's bytes. Seed §14.

    ``T·k·H·(d + c) = P·w`` with ``P = E·3·H·I`` ⇒ ``T = P·w / (k·H·(d + c))``.
    DeepSeek-V3: 2 × 11,274,289,152 / (3 × 8 × 7,168) = 131,072 ≈ 131,000
    tokens per rank (more tokens favour fsdp, fewer favour a2a).
    """
    P = n_routed_experts * 3 * hidden_size * moe_intermediate_size
    _positive_int("num_experts_per_tok", k)
    return P * weight_bytes / (k * hidden_size * (dispatch_bytes + combine_bytes))


# --------------------------------------------------------------------------- decode (§10)
@dataclass(frozen=True)
class DecodeCost:
    """Cost of a per-expert granularity at decode batch sizes. Seed §10.

    Attributes:
        sequences_per_rank: B, decode sequences per rank (one token each per step).
        rows_per_expert: mean rows per expert, ``B·k/e`` (= ``B·EP·k/E``).
        granularity: the alignment / tile height each expert's rows round up to.
        computed_rows_per_expert: ``ceil(rows / granularity)·granularity``.
        work_factor: computed / live rows (seed: 4× at B = 16, A = 128).
    """

    sequences_per_rank: int
    rows_per_expert: float
    granularity: int
    computed_rows_per_expert: int
    work_factor: float


def decode_alignment_cost(sequences_per_rank: int, ep_size: int, k: int, n_routed_experts: int,
                          granularity: int = 128) -> DecodeCost:
    """Work of padding each expert to ``granularity`` rows at decode. Seed §10.

    DeepSeek-V3, EP = 64: rows per expert = B × 64 × 8 / 256 = 2B; B = 16 → 32
    rows, padded to 128 → 4× the work; B = 4 → 16×; B = 64 and 512 → 1×.
    """
    n_local = local_experts(n_routed_experts, ep_size)
    rows = mean_rows_per_expert(_positive_int("sequences_per_rank", sequences_per_rank), k, n_local)
    _positive_int("granularity", granularity)
    computed = math.ceil(rows / granularity - 1e-12) * granularity
    return DecodeCost(sequences_per_rank, rows, granularity, computed, computed / rows)


# --------------------------------------------------------------------------- tiles (§11, §14)
@dataclass(frozen=True)
class TileCost:
    """Tile visits of an unpadded (megablox-style) grouped GEMM. Seed §11.

    Attributes:
        tile: tile height (rows).
        tiles: tiles executed; a tile that straddles an expert boundary runs
            once per expert in it.
        tiles_min: ``ceil(Σ counts / tile)``, the tiles of a dense matmul on the same rows.
        overhead: ``tiles / tiles_min - 1``.
    """

    tile: int
    tiles: int
    tiles_min: int
    overhead: float

    @property
    def equivalent_rows(self) -> int:
        return self.tiles * self.tile


def tile_visits(counts: Sequence[int], tile: int) -> TileCost:
    """Tiles a megablox-style kernel executes for unpadded segments. Seed §11.

    Segments lie back to back (``offsets = prefix sums of counts``); a non-empty
    segment ``[s, t)`` visits ``ceil(t / tile) - floor(s / tile)`` tiles, an
    empty one none. ``tiles_min ≤ tiles ≤ tiles_min + (segments − 1)``.
    Seed: ``[21733, 15004, 17982, 10817]``, tile 128 → 515 tiles (512 + 3),
    equivalent to 65,920 rows, +0.59 %.
    """
    _positive_int("tile", tile)
    start = 0
    tiles = 0
    for c in counts:
        if c < 0:
            raise ValueError(f"counts contains {c}: counts must be >= 0")
        if c:
            end = start + c
            tiles += -(-end // tile) - start // tile
            start = end
    total = start
    tiles_min = -(-total // tile)
    return TileCost(tile, tiles, tiles_min, tiles / tiles_min - 1 if tiles_min else 0.0)


@dataclass(frozen=True)
class TileBound:
    """Bound on the tile-boundary overhead for ``segments`` segments. Seed §14 ("EP ＝ 1 会把段数顶上去").

    Attributes:
        tiles_min: ``ceil(rows / tile)``.
        worst: ``(segments − 1) / tiles_min``: every boundary splits a tile.
        mean: the seed's "均值", half the worst case (see :func:`tile_overhead_bound`).
    """

    tiles_min: int
    worst: float
    mean: float


def tile_overhead_bound(rows: int, segments: int, tile: int) -> TileBound:
    """Worst and typical boundary overhead of unpadded tiles over ``segments`` experts. Seed §14.

    Worst: ``(segments − 1) / (rows / tile)``. Seed: 65,536 rows (8,192 tokens,
    top-8), 256 experts, tile 512 → 255 / 128 = +199 %; 262,144 rows (32,768
    tokens), 192 experts → 191 / 512 = +37 %.

    Mean: the seed states "均值约 +19 %" for the second case without a
    derivation; it is half the worst case, ``(segments − 1)·½ / tiles_min``
    (= 18.65 %), i.e. each boundary costing half a tile on average, which is
    what padding each segment to the tile costs in expectation. This function
    reproduces that figure. (Counted as tile *visits* with boundaries at
    uniformly random rows, a boundary costs a whole extra visit with
    probability ``1 − 1/tile``, so the expected visits sit near the worst case;
    use :func:`tile_visits` on a real count vector for the exact figure.)
    """
    _positive_int("rows", rows)
    _positive_int("segments", segments)
    _positive_int("tile", tile)
    tiles_min = -(-rows // tile)
    worst = (segments - 1) / tiles_min
    return TileBound(tiles_min, worst, worst / 2)


# --------------------------------------------------------------------------- the rank plan
@dataclass(frozen=True)
class RankShape:
    """What the per-layer plan of one rank needs.

    Attributes:
        tokens_per_rank: T (micro-batch × sequence length).
        hidden_size: H.
        moe_intermediate_size: I.
        n_routed_experts: E.
        num_experts_per_tok: k.
        ep_size: EP (must divide E).
        alignment: A, each expert's segment rounds up to a multiple of it.
    """

    tokens_per_rank: int
    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    ep_size: int = 1
    alignment: int = 1

    def __post_init__(self) -> None:
        _positive_int("tokens_per_rank", self.tokens_per_rank,
                      "set train.micro_batch_size and train.seq_len, or --tokens-per-rank N")
        _positive_int("hidden_size", self.hidden_size)
        _positive_int("moe_intermediate_size", self.moe_intermediate_size)
        _positive_int("num_experts_per_tok", self.num_experts_per_tok)
        _positive_int("alignment", self.alignment, "use 1 (no alignment) or e.g. 128")
        local_experts(self.n_routed_experts, self.ep_size)

    @property
    def n_local(self) -> int:
        return self.n_routed_experts // self.ep_size

    @classmethod
    def from_args(cls, args: ModelArgs, tokens_per_rank: int, ep_size: int = 1,
                  alignment: int | None = None) -> "RankShape":
        return cls(tokens_per_rank, args.hidden_size, args.moe_intermediate_size,
                   args.n_routed_experts, args.num_experts_per_tok, ep_size,
                   args.expert_alignment if alignment is None else alignment)


def plan(shape: RankShape, counts: Sequence[int] | None = None,
         capacity_factors: Sequence[float] = (1.0, 1.5), tile: int = 128,
         fp8_dispatch: bool = True, decode_sequences: Sequence[int] = (4, 16, 64, 512),
         args: ModelArgs | None = None, seq_len: int | None = None) -> dict[str, Any]:
    """The whole per-rank, per-MoE-layer plan as a JSON-ready dict.

    Args:
        shape: the rank (T, H, I, E, k, EP, A).
        counts: rows landed per local expert (length ``E/EP``) for the tables
            that need a real distribution; None = use the mean ``T·k``.
        capacity_factors: factors for the capacity table / FLOPs.
        tile: tile height for the unpadded-tile overhead and the decode granularity.
        fp8_dispatch: a2a dispatch in fp8 (1 B) rather than bf16 (2 B); combine is bf16.
        decode_sequences: decode batch sizes for the §10 table.
        args: the full model, for the totals (parameters, FLOPs per token).
        seq_len: sequence length for FLOPs per token (needs ``args``).
    Returns: nested dict; bytes in bytes, FLOPs in FLOPs, fractions as fractions.
    Raises:
        ValueError: bad EP, counts, capacity factor or tile (the message names the fix).
    """
    s = shape
    e, H, I, k, T = s.n_local, s.hidden_size, s.moe_intermediate_size, s.num_experts_per_tok, \
        s.tokens_per_rank
    _positive_int("tile", tile, "use e.g. 128")
    if counts is not None:
        counts = check_counts(counts, e)
    for cf in capacity_factors:
        capacity_per_expert(T, k, e, cf)  # validates before any work
    mean_rows = routed_rows(T, k)
    live = sum(counts) if counts is not None else mean_rows
    if counts is not None:
        aligned = aligned_rows(counts, s.alignment)
        aligned_is_bound = False
    else:
        aligned = mean_rows + alignment_bound_rows(e, s.alignment)
        aligned_is_bound = True
    bound = alignment_bound_rows(e, s.alignment)

    cap_rows = capacity_table(counts, T, k, e, capacity_factors, s.alignment)
    d_bytes = 1 if fp8_dispatch else 2
    a2a = a2a_bytes(T, k, H, d_bytes, 2)
    agrs = agrs_bytes(T, H, s.ep_size)
    fsdp = fsdp_bytes(s.n_routed_experts, H, I)
    tiles = tile_visits(counts, tile) if counts is not None else None
    bound_t = tile_overhead_bound(live if live else 1, e, tile)

    out: dict[str, Any] = {
        "rank": {"tokens_per_rank": T, "hidden_size": H, "moe_intermediate_size": I,
                 "n_routed_experts": s.n_routed_experts, "num_experts_per_tok": k,
                 "ep_size": s.ep_size, "local_experts": e, "alignment": s.alignment, "tile": tile,
                 "dispatch_dtype": "fp8" if fp8_dispatch else "bf16"},
        "rows": {
            "routed_rows_mean": mean_rows,
            "rows_per_expert_mean": mean_rows_per_expert(T, k, e),
            "counts": counts,
            "live_rows": live,
            "aligned_rows": aligned,
            "aligned_rows_is_bound": aligned_is_bound,
            "alignment_padding_rows": aligned - live,
            "alignment_overhead": (aligned - live) / live if live else 0.0,
            "alignment_bound_rows": bound,
            "alignment_bound": bound / mean_rows,
        },
        "flops": {
            "per_row_per_expert": flops_per_row_per_expert(H, I),
            "live": expert_flops(live, H, I),
            "aligned": expert_flops(aligned, H, I),
            "capacity_factor": {_cf_key(r.capacity_factor): expert_flops(r.computed_rows, H, I)
                                for r in cap_rows if r.capacity_factor is not None},
            "ungrouped": expert_flops(aligned, H, I, experts_per_row=e),
            "note": "forward FLOPs of the routed experts per MoE layer; training is 3x",
        },
        "capacity": [asdict(r) for r in cap_rows],
        "activation_bytes": asdict(activation_bytes(T, aligned, H, I)),
        "saved_bytes": {m: saved_bytes(aligned, H, I, m) for m in MEMORY_SETTINGS
                        if s.ep_size == 1 or not m.endswith("gather")},
        "comm_bytes": {
            c.dispatcher: {"out": c.out_bytes, "back": c.back_bytes, "total": c.total}
            for c in (a2a, agrs, fsdp)
        },
        "crossover": {
            "a2a_agrs_ep": a2a_agrs_crossover_ep(k, d_bytes, 2),
            "fsdp_a2a_tokens_per_rank": fsdp_a2a_breakeven_tokens(s.n_routed_experts, H, I, k,
                                                                   d_bytes, 2),
        },
        "expert_weight_bytes": {
            "ep_local": expert_weight_bytes(e, H, I),
            "fsdp_layer": expert_weight_bytes(s.n_routed_experts, H, I),
            "fsdp_layer_prefetch": 2 * expert_weight_bytes(s.n_routed_experts, H, I),
        },
        "tiles": {
            "tile": tile,
            "tiles": tiles.tiles if tiles else None,
            "tiles_min": tiles.tiles_min if tiles else bound_t.tiles_min,
            "overhead": tiles.overhead if tiles else None,
            "equivalent_rows": tiles.equivalent_rows if tiles else None,
            "worst": bound_t.worst,
            "mean_seed": bound_t.mean,
        },
        "decode": [asdict(decode_alignment_cost(b, s.ep_size, k, s.n_routed_experts, tile))
                   for b in decode_sequences],
    }
    if args is not None:
        pc = param_counts(args)
        out["model"] = {"params": asdict(pc), "num_hidden_layers": args.num_hidden_layers,
                        "num_moe_layers": args.num_moe_layers}
        if seq_len is not None:
            out["model"]["seq_len"] = seq_len
            out["model"]["flops_per_token"] = model_flops_per_token(args, seq_len)
    return out


# --------------------------------------------------------------------------- text output
def _fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    if b == 0:
        return "0"
    if b >= GiB:
        return f"{b / GiB:.3f} GiB"
    if b >= 64 * MiB:
        return f"{b / MiB:.1f} MiB = {b / GiB:.3f} GiB"
    return f"{b / MiB:.3f} MiB"


def _cf_key(cf: float) -> str:
    """``1.0`` -> ``"1.0"``, ``1.25`` -> ``"1.25"`` (the seed writes cf = 1.0, 1.5)."""
    return repr(float(cf))


def _fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f} %"


def _fmt_int(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not x.is_integer():
        return f"{x:,.2f}"
    return f"{int(x):,}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return "\n".join([line(cells[0]), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]])


def format_plan(p: dict[str, Any]) -> str:
    """Render :func:`plan`'s dict as plain-text tables with aligned columns."""
    r, rows, fl = p["rank"], p["rows"], p["flops"]
    parts = [
        f"dropless-plan: one rank, one MoE layer  (T={r['tokens_per_rank']:,}  H={r['hidden_size']}  "
        f"I={r['moe_intermediate_size']}  E={r['n_routed_experts']}  k={r['num_experts_per_tok']}  "
        f"EP={r['ep_size']}  e={r['local_experts']}  A={r['alignment']}  tile={r['tile']})",
        "",
        "Rows",
        _table(["", "rows", "vs live"], [
            ["routed rows (mean T*k)", _fmt_int(rows["routed_rows_mean"]), ""],
            ["rows per local expert (mean)", _fmt_int(rows["rows_per_expert_mean"]), ""],
            ["live rows", _fmt_int(rows["live_rows"]), ""],
            [f"aligned rows{' (bound)' if rows['aligned_rows_is_bound'] else ''}",
             _fmt_int(rows["aligned_rows"]), _fmt_pct(rows["alignment_overhead"])],
            ["alignment bound e*(A-1)", _fmt_int(rows["alignment_bound_rows"]),
             _fmt_pct(rows["alignment_bound"])],
        ]),
    ]
    if rows["counts"] is not None:
        parts.append(f"counts per local expert: {rows['counts']}")
    live = fl["live"]
    frows = [["live rows", f"{fl['live'] / 1e12:.3f}", ""],
             ["aligned rows", f"{fl['aligned'] / 1e12:.3f}", _fmt_pct(fl["aligned"] / live - 1)]]
    frows += [[f"capacity factor {cf}", f"{v / 1e12:.3f}", _fmt_pct(v / live - 1)]
              for cf, v in fl["capacity_factor"].items()]
    frows.append([f"ungrouped (x{r['local_experts']} experts)", f"{fl['ungrouped'] / 1e12:.3f}",
                  f"{fl['ungrouped'] / fl['aligned']:.2f}x aligned"])
    parts += ["", f"Routed-expert FLOPs, forward ({fl['per_row_per_expert'] / 1e6:.2f} MFLOP "
                  "per row per expert)", _table(["counted over", "TFLOP", "vs live"], frows)]
    parts += ["", "Capacity factor vs dropless", _table(
        ["scheme", "box/expert", "computed", "dropped", "padded", "padded/live", "extra compute"],
        [[c["scheme"], _fmt_int(c["capacity_per_expert"]), _fmt_int(c["computed_rows"]),
          _fmt_int(c["dropped_rows"]), _fmt_int(c["padded_rows"]), _fmt_pct(c["padded_fraction"]),
          _fmt_pct(c["extra_compute"])]
         for c in p["capacity"]])]
    ab = p["activation_bytes"]
    parts += ["", "Activations (bf16, one layer)", _table(["tensor", "bytes"], [
        ["input x [T,H]", _fmt_bytes(ab["x"])],
        ["landed rows [R,H]", _fmt_bytes(ab["landed_rows"])],
        ["gate||up [R,2I]", _fmt_bytes(ab["gate_up"])],
        ["SwiGLU [R,I]", _fmt_bytes(ab["swiglu"])],
        ["FC2 out [R,H]", _fmt_bytes(ab["fc2_out"])],
    ])]
    sv = p["saved_bytes"]
    parts += ["", "Kept for backward by the routed experts (bf16, one layer, without indices; "
                  "model.* memory options)", _table(["setting", "bytes"], [
        [m, _fmt_bytes(v)] for m, v in sv.items()])]
    cb = p["comm_bytes"]
    parts += ["", f"Bytes sent per rank per layer, forward (a2a dispatch {r['dispatch_dtype']}, "
                  "combine bf16)", _table(["dispatcher", "out", "back", "total"], [
        [name, _fmt_bytes(v["out"]), _fmt_bytes(v["back"]), _fmt_bytes(v["total"])]
        for name, v in cb.items()])]
    cr, ew = p["crossover"], p["expert_weight_bytes"]
    parts += [f"bytes break even: a2a = agrs at EP = {cr['a2a_agrs_ep']:.2f};  fsdp = a2a at "
              f"{cr['fsdp_a2a_tokens_per_rank']:,.0f} tokens per rank",
              f"expert weights held: EP {_fmt_bytes(ew['ep_local'])};  fsdp "
              f"{_fmt_bytes(ew['fsdp_layer'])} (x2 with prefetch: {_fmt_bytes(ew['fsdp_layer_prefetch'])})"]
    t = p["tiles"]
    trows = []
    if t["tiles"] is not None:
        trows.append(["these counts", _fmt_int(t["tiles"]), _fmt_int(t["tiles_min"]),
                      _fmt_pct(t["overhead"])])
    trows += [["worst case", "", _fmt_int(t["tiles_min"]), _fmt_pct(t["worst"])],
              ["mean (seed's estimate)", "", _fmt_int(t["tiles_min"]), _fmt_pct(t["mean_seed"])]]
    note = "" if t["tiles"] is not None else "; the tiles of real counts need --counts"
    parts += ["", f"Unpadded tiles of {t['tile']} rows (megablox style{note})",
              _table(["", "tiles", "min", "overhead"], trows)]
    parts += ["", f"Decode: each expert rounds up to {t['tile']} rows", _table(
        ["sequences/rank", "rows/expert", "computed", "work"],
        [[_fmt_int(d["sequences_per_rank"]), _fmt_int(d["rows_per_expert"]),
          _fmt_int(d["computed_rows_per_expert"]), f"{d['work_factor']:.2f}x"] for d in p["decode"]])]
    if "model" in p:
        m = p["model"]
        pc = m["params"]
        mrows = [["parameters, total", f"{pc['total'] / 1e9:.2f} B"],
                 ["parameters, activated per token", f"{pc['activated'] / 1e9:.2f} B"]]
        if "flops_per_token" in m:
            mrows.append([f"training FLOPs per token (S={m['seq_len']})",
                          f"{m['flops_per_token']:.4g}"])
        parts += ["", f"Model ({m['num_hidden_layers']} layers, {m['num_moe_layers']} MoE)",
                  _table(["", "value"], mrows)]
    return "\n".join(parts)


# --------------------------------------------------------------------------- CLI
_MODELS = {"deepseek_v3_671b": ModelArgs.deepseek_v3_671b}
# The seed's reference rank (§1): 64-way EP (V3 paper), 8,192 tokens per rank (DeepEP's setting).
_MODEL_DEFAULTS = {"deepseek_v3_671b": {"ep": 64, "tokens_per_rank": 8192, "seq_len": 4096}}


def _int_list(name: str, s: str) -> list[int]:
    try:
        return [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ValueError(f"{name}={s!r}: give comma-separated integers, e.g. 21733,15004,17982,10817")


def _float_list(name: str, s: str) -> list[float]:
    try:
        return [float(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ValueError(f"{name}={s!r}: give comma-separated numbers, e.g. 1.0,1.5")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dropless-plan",
        description="Per-rank compute, memory and communication of one MoE layer of a recipe "
                    "before a job is launched. Takes the training's Hydra overrides.")
    p.add_argument("overrides", nargs="*", help="Hydra overrides as for training, key=value")
    p.add_argument("--model", default=None,
                   help="'deepseek_v3_671b' or a path to a DeepSeek-V3 config.json, instead of "
                        "composing the Hydra config (defaults: EP 64, 8,192 tokens per rank)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--counts", default=None, help="rows per local expert of one rank, e.g. "
                   "21733,15004,17982,10817 (length E/EP)")
    p.add_argument("--capacity-factor", default="1.0,1.5", help="capacity factors to compare")
    p.add_argument("--tile", type=int, default=128, help="tile height (rows), default 128")
    p.add_argument("--alignment", type=int, default=None,
                   help="expert alignment A (default: the model's expert_alignment)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--fp8-dispatch", dest="fp8_dispatch", action="store_true", default=True,
                   help="a2a dispatch in fp8, 1 B per element (default)")
    g.add_argument("--bf16-dispatch", dest="fp8_dispatch", action="store_false",
                   help="a2a dispatch in bf16, 2 B per element")
    p.add_argument("--ep", type=int, default=None, help="EP size (overrides dispatcher.ep_size)")
    p.add_argument("--tokens-per-rank", type=int, default=None,
                   help="T (default: train.micro_batch_size x train.seq_len)")
    p.add_argument("--seq-len", type=int, default=None, help="S for FLOPs per token")
    return p


def _from_hydra(overrides: Sequence[str]) -> tuple[ModelArgs, int | None, int | None, int | None]:
    """(args, ep, tokens_per_rank, seq_len) from the training config."""
    from dropless.train.config import compose, model_args

    cfg = compose(list(overrides))
    args = model_args(cfg)
    ep = None
    disp = cfg.get("dispatcher") if hasattr(cfg, "get") else None
    if disp is not None:
        ep = disp.get("ep_size")
        if ep is None and disp.get("name") in ("local", "fsdp"):
            ep = 1
    tokens = seq_len = None
    train = cfg.get("train") if hasattr(cfg, "get") else None
    if train is not None and train.get("seq_len") is not None:
        seq_len = int(train.get("seq_len"))
        if train.get("micro_batch_size") is not None:
            tokens = int(train.get("micro_batch_size")) * seq_len
    return args, (int(ep) if ep is not None else None), tokens, seq_len


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``dropless-plan``. Returns 0; bad input exits with status 2 and the message."""
    parser = _parser()
    ns = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    try:
        for o in ns.overrides:
            if "=" not in o:
                raise ValueError(f"override {o!r} is not key=value (e.g. dispatcher=a2a "
                                 "model.hidden_size=1024)")
        defaults: dict[str, int] = {}
        if ns.model is not None:
            if ns.overrides:
                raise ValueError("--model and Hydra overrides do not mix: drop --model to compose "
                                 "the training config, or drop the overrides")
            if ns.model in _MODELS:
                args = _MODELS[ns.model]()
                defaults = _MODEL_DEFAULTS.get(ns.model, {})
            elif os.path.isfile(ns.model):
                args = ModelArgs.from_json(ns.model)
            else:
                raise ValueError(f"--model={ns.model!r}: give one of {sorted(_MODELS)} or the path "
                                 "of a config.json")
            ep, tokens, seq_len = defaults.get("ep"), defaults.get("tokens_per_rank"), \
                defaults.get("seq_len")
        else:
            args, ep, tokens, seq_len = _from_hydra(ns.overrides)
        if ns.ep is not None:
            ep = ns.ep
        if ep is None:
            env = os.environ.get("WORLD_SIZE")
            if env is None:
                raise ValueError("the EP size is not set (dispatcher.ep_size is null = world size): "
                                 "pass --ep N or dispatcher.ep_size=N")
            ep = int(env)
        if ns.tokens_per_rank is not None:
            tokens = ns.tokens_per_rank
        if tokens is None:
            raise ValueError("tokens per rank unknown: pass --tokens-per-rank N or set "
                             "train.micro_batch_size and train.seq_len")
        if ns.seq_len is not None:
            seq_len = ns.seq_len
        shape = RankShape.from_args(args, tokens, ep, ns.alignment)
        counts = _int_list("--counts", ns.counts) if ns.counts else None
        cfs = _float_list("--capacity-factor", ns.capacity_factor) if ns.capacity_factor else []
        result = plan(shape, counts, cfs, ns.tile, ns.fp8_dispatch, args=args, seq_len=seq_len)
    except ValueError as exc:
        parser.exit(2, f"dropless-plan: error: {exc}\n")
    text = json.dumps(result, indent=2) if ns.json else format_plan(result)
    try:
        print(text)
    except BrokenPipeError:  # `dropless-plan | head`: the reader left; not an error
        sys.stdout = open(os.devnull, "w")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
