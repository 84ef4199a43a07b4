"""The planner's cost model: rows, FLOPs, bytes and tiles of one MoE layer on one rank.

Plain Python arithmetic on ints and floats, one function per formula.
The reference rank of docs/design.md#a-worked-rank (the formulas of its byte counts:
docs/design.md#dispatchers): DeepSeek-V3, H = 7168, I = 2048, E = 256,
k = 8, EP = 64 (4 local experts), 8,192 tokens per rank, alignment A = 128,
counts ``[21733, 15004, 17982, 10817]``. Figures reproduced (tests/test_plan.py):

==========================================  ==============================
65,536 routed rows per rank (mean)           :func:`routed_rows`
65,792 aligned rows, +0.39 % (bound 0.78 %)  :func:`aligned_rows`
88.08 MFLOP per row per expert               :func:`flops_per_row_per_expert`
5.772 / 5.795 / 8.659 / 23.180 TFLOP         :func:`expert_flops`
cf 1.0 drops 6,947 and pads 6,947 rows       :func:`capacity_table`
448 MiB + 896 MiB = 1.31 GiB (a2a)           :func:`a2a_bytes` (FP8 dispatch: + 0.25 MiB scales,
                                             :func:`fp8_scale_bytes_per_row`)
6.89 GiB each way, 13.8 GiB (agrs)           :func:`agrs_bytes`
21.0 GiB (fsdp)                              :func:`fsdp_bytes`
EP ≈ 7, ≈ 131,000 tokens per rank            :func:`a2a_agrs_crossover_ep`,
                                             :func:`fsdp_a2a_breakeven_tokens`
515 tiles of 128, +0.59 %                    :func:`tile_visits`
+199 %, +37 % (mean ≈ +19 %)                 :func:`tile_overhead_bound`
32 rows per expert, 4× at A = 128            :func:`decode_alignment_cost`
3.00 / 2.25 / 0.375 GiB (295B config)        :func:`activation_bytes`
saved-for-backward by memory option          :func:`saved_bytes` (not a reference-rank figure)
671B total, 37B activated                    :func:`dropless.model.params.param_counts`
==========================================  ==============================

Units: rows and tokens are counts; FLOPs are plain floating-point operations
(a multiply-add is 2); bytes are bytes (MiB = 2**20, GiB = 2**30, as docs/design.md#a-worked-rank
uses them); "TFLOP" in the printed table is 1e12 FLOPs.

Errors: bad input raises :class:`ValueError` naming the argument and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from dropless.dispatch.mesh import local_expert_count

MiB = 2**20
GiB = 2**30

__all__ = [
    "MiB", "GiB", "positive_int", "cf_key",
    "align_up", "local_experts", "check_counts", "routed_rows", "mean_rows_per_expert",
    "aligned_rows", "alignment_bound_rows", "flops_per_row_per_expert", "expert_flops",
    "capacity_per_expert", "CapacityRow", "capacity_table", "ActivationBytes", "activation_bytes",
    "MEMORY_SETTINGS", "saved_bytes",
    "FP8_GEMMS", "fp8_scale_bytes_per_row", "CommBytes", "a2a_bytes", "agrs_bytes", "fsdp_bytes", "expert_weight_bytes",
    "a2a_agrs_crossover_ep", "fsdp_a2a_breakeven_tokens", "DecodeCost", "decode_alignment_cost",
    "TileCost", "tile_visits", "TileBound", "tile_overhead_bound",
]


# --------------------------------------------------------------------------- checks
def positive_int(name: str, value: Any, fix: str = "") -> int:
    """``value`` if it is a positive int (not a bool); else ValueError naming ``name`` and ``fix``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer" + (f"; {fix}" if fix else ""))
    return value


def cf_key(cf: float) -> str:
    """``1.0`` -> ``"1.0"``, ``1.25`` -> ``"1.25"`` (as cf = 1.0, 1.5 are written)."""
    return repr(float(cf))


def align_up(n: int, a: int) -> int:
    """Round the row count ``n`` up to a multiple of ``a`` (``a >= 1``)."""
    positive_int("alignment", a, "use 1 (no alignment) or a tile height such as 128")
    return -(-n // a) * a


def local_experts(n_routed_experts: int, ep_size: int) -> int:
    """``e = E / EP``, the routed experts that live on one rank (reference rank: 256 / 64 = 4).

    The rule is :func:`dropless.dispatch.mesh.local_expert_count`'s, named as the planner's
    arguments are.

    Raises:
        ValueError (a ConfigError): ``ep_size`` is not a positive divisor of ``n_routed_experts``.
    """
    positive_int("n_routed_experts", n_routed_experts)
    return local_expert_count(n_routed_experts, ep_size, ep_name="ep_size", experts_name="n_routed_experts",
                              fix="--ep N or dispatcher.ep_size=N")


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


# --------------------------------------------------------------------------- rows
def routed_rows(tokens_per_rank: int, k: int) -> int:
    """Mean routed rows landed per rank per MoE layer, ``T·k``.

    The rows a rank *sends* are exactly ``T·k``; the rows it *receives* are data
    (they depend on every rank's routing) and equal ``T·k`` only on average
    (reference rank: 8,192 × 8 = 65,536). Shared experts are not counted: they read
    ``x_TH`` directly.
    """
    positive_int("tokens_per_rank", tokens_per_rank)
    positive_int("num_experts_per_tok", k)
    return tokens_per_rank * k


def mean_rows_per_expert(tokens_per_rank: int, k: int, n_local: int) -> float:
    """Mean rows per local expert, ``T·k / e`` (= ``T·EP·k / E``). Reference rank: 16,384."""
    positive_int("n_local", n_local)
    return routed_rows(tokens_per_rank, k) / n_local


def aligned_rows(counts: Sequence[int], alignment: int) -> int:
    """Rows computed when each expert's segment is padded to a multiple of ``A``: ``Σ align_up(c, A)``.

    Reference rank: ``[21733, 15004, 17982, 10817]`` at A = 128 → 65,792 (+256 rows, +0.39 %).
    Like docs/design.md#a-worked-rank, this pads every segment, the last one included (the
    ExpertLayout's ``end[e-1]`` leaves the last segment unpadded, so it can be
    up to ``A - 1`` rows smaller).
    """
    return sum(align_up(int(c), alignment) for c in counts)


def alignment_bound_rows(n_local: int, alignment: int) -> int:
    """Most padding rows alignment can add on one rank, ``e·(A - 1)``. Reference rank: 4 × 127 = 508 (0.78 %)."""
    positive_int("n_local", n_local)
    positive_int("alignment", alignment)
    return n_local * (alignment - 1)


# --------------------------------------------------------------------------- FLOPs
def flops_per_row_per_expert(hidden_size: int, moe_intermediate_size: int) -> int:
    """Forward FLOPs of one row through one SwiGLU expert, ``2·3·H·I``.

    Three matmuls (gate, up: H→I; down: I→H), 2 FLOPs per multiply-add; the
    SwiGLU's elementwise work is not counted (as in docs/design.md#a-worked-rank).
    DeepSeek-V3: 2 × 7,168 × 2,048 × 3 = 88,080,384 ≈ 88.08 MFLOP.
    """
    positive_int("hidden_size", hidden_size)
    positive_int("moe_intermediate_size", moe_intermediate_size)
    return 2 * 3 * hidden_size * moe_intermediate_size


def expert_flops(rows: float, hidden_size: int, moe_intermediate_size: int,
                 experts_per_row: int = 1) -> float:
    """Forward FLOPs of the routed experts of one MoE layer on one rank.

    ``rows · experts_per_row · 2·3·H·I``. The four ways of counting
    (DeepSeek-V3 rank): live rows 65,536 → 5.772 TFLOP; aligned rows 65,792 →
    5.795; capacity factor 1.5, 98,304 rows → 8.659; ungrouped (every aligned
    row against all ``e`` = 4 local experts, ``experts_per_row = 4``) → 23.180.
    Training (forward + backward) is 3× these.
    """
    if rows < 0:
        raise ValueError(f"rows={rows!r} must be >= 0")
    return rows * experts_per_row * flops_per_row_per_expert(hidden_size, moe_intermediate_size)


# --------------------------------------------------------------------------- capacity factor
def capacity_per_expert(tokens_per_rank: int, k: int, n_local: int, capacity_factor: float) -> int:
    """Rows of the per-expert box of the old token-dropping scheme, ``ceil(cf · T·k / e)``.

    The box is a multiple of the *mean* rows per expert (reference rank: cf 1.0 → 16,384,
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
    """One line of the capacity-factor trade-off table (per rank, per MoE layer).

    Attributes:
        scheme: ``"cf=1.0"``, ``"cf=1.5"``, ... or ``"dropless A=128"``.
        capacity_factor: the factor, or None for dropless.
        capacity_per_expert: rows of each expert's box (None for dropless).
        computed_rows: rows the GEMMs run over (``e·capacity`` or the aligned rows).
        dropped_rows: live rows that do not fit their box (None without counts).
        padded_rows: zero/padding rows computed (None without counts).
        extra_compute: ``computed_rows / live_rows - 1`` (None without counts).
        padded_fraction: ``padded_rows / live_rows``, the share of the rows computed for nothing
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
    """The capacity-factor rows beside the dropless one, for one count vector.

    For capacity factor ``cf`` the box is :func:`capacity_per_expert`; a rank
    computes ``e·box`` rows, drops ``Σ max(c - box, 0)`` and pads
    ``Σ max(box - c, 0)``. Dropless (last row) drops nothing and pads
    ``Σ align_up(c, A) - Σ c``. For the reference rank: cf 1.0 computes
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
        rows.append(CapacityRow(f"cf={cf_key(cf)}", float(cf), box, computed, dropped, padded, extra,
                                padded / live if counts is not None and live else None))
    if counts is None:
        rows.append(CapacityRow(f"dropless A={alignment}", None, None,
                                routed_rows(tokens_per_rank, k), 0, None, None))
    else:
        al = aligned_rows(counts, alignment)
        rows.append(CapacityRow(f"dropless A={alignment}", None, None, al, 0, al - live,
                                al / live - 1 if live else None, (al - live) / live if live else None))
    return rows


# --------------------------------------------------------------------------- activations
@dataclass(frozen=True)
class ActivationBytes:
    """Bytes of the large per-layer activations of one rank.

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

    Reference rank, bf16 (2 B): DeepSeek-V3 rank, T = 8,192, R = 65,792: x 0.11 GiB,
    landed 0.88 GiB, gate‖up 0.50 GiB, SwiGLU 0.25 GiB, FC2 0.88 GiB.
    The 295B config (H 4,096, I 1,536, T = 49,152, R = 393,216, no alignment):
    x 0.375 GiB, sort buffer 3.00 GiB, gate‖up 2.25 GiB.
    These are one layer's transient buffers (with recompute, the peak is one layer's).
    """
    positive_int("tokens", tokens)
    if rows < 0:
        raise ValueError(f"rows={rows!r} must be >= 0")
    b = positive_int("bytes_per_element", bytes_per_element)
    H, I = hidden_size, moe_intermediate_size
    return ActivationBytes(x=tokens * H * b, landed_rows=rows * H * b, gate_up=rows * 2 * I * b,
                           swiglu=rows * I * b, fc2_out=rows * H * b)


#: The MoE memory settings of :func:`saved_bytes`, in order of what they drop.
MEMORY_SETTINGS = ("default", "recompute_swiglu", "recompute_fc1", "recompute_fc1+fold",
                   "recompute_fc1+fold+gather")


def saved_bytes(rows: int, hidden_size: int, moe_intermediate_size: int, setting: str,
                bytes_per_element: int = 2) -> int:
    """Bytes the routed experts keep for backward per layer, without indices (the ``model.*`` memory options).

    ``rows`` = ``M``, the landed buffer's rows. By setting (``b`` bytes per element):

    * ``default``: ``b·M·(2H + 3I)`` — landed rows, gate‖up, SwiGLU output, FC2 output
      (the combine keeps the FC2 output for the routing weights' gradient);
    * ``recompute_swiglu``: ``b·M·(2H + 2I)`` — no SwiGLU output;
    * ``recompute_fc1``: ``b·M·2H`` — no gate‖up either;
    * ``recompute_fc1+fold``: ``b·M·H`` — weights folded before FC2, so the FC2 output is
      not kept: one copy of the landed rows (the bound of docs/design.md#memory);
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
    b = positive_int("bytes_per_element", bytes_per_element)
    H, I = hidden_size, moe_intermediate_size
    per_row = {"default": 2 * H + 3 * I, "recompute_swiglu": 2 * H + 2 * I, "recompute_fc1": 2 * H,
               "recompute_fc1+fold": H, "recompute_fc1+fold+gather": 0}[setting]
    return b * rows * per_row


# --------------------------------------------------------------------------- communication
@dataclass(frozen=True)
class CommBytes:
    """Bytes one rank sends for one MoE layer's forward pass.

    Attributes:
        dispatcher: ``a2a``, ``agrs`` or ``fsdp``.
        out_bytes: the first leg (a2a dispatch, agrs all-gather, fsdp weight all-gather).
        back_bytes: the return leg (a2a combine, agrs reduce-scatter; 0 for fsdp).
        out_scale_bytes: the FP8 scales' share of ``out_bytes`` (0 unless the dispatch is FP8).
    """

    dispatcher: str
    out_bytes: int
    back_bytes: int
    out_scale_bytes: int = 0

    @property
    def total(self) -> int:
        """``out_bytes + back_bytes``."""
        return self.out_bytes + self.back_bytes


#: the grouped-GEMM backends whose FC1 reads e4m3 codes, so that ``a2a`` and ``agrs`` dispatch FP8 rows
#: (docs/design.md#fp8-dispatch).
FP8_GEMMS = ("fp8", "deep_gemm")


def fp8_scale_bytes_per_row(hidden_size: int, gemm: str = "fp8") -> int:
    """Bytes of the fp32 scales that travel with one FP8-dispatched row of ``H`` codes.

    ``gemm=fp8`` (``torch._scaled_grouped_mm``'s rowwise operand): one scale, 4 B.
    ``gemm=deep_gemm`` (1×128 blocks): ``4·⌈H/128⌉`` B, 224 B at H = 7168.
    """
    positive_int("hidden_size", hidden_size)
    return 4 * -(-hidden_size // 128) if gemm == "deep_gemm" else 4


def a2a_bytes(tokens_per_rank: int, k: int, hidden_size: int, dispatch_bytes: int = 1,
              combine_bytes: int = 2, scale_bytes_per_row: int = 0) -> CommBytes:
    """All-to-all: ``T·k·(H·dispatch_bytes + scale_bytes_per_row)`` out, ``T·k·H·combine_bytes`` back.

    As docs/design.md#dispatchers counts it: every one of the ``T·k`` rows crosses the network
    once each way (no discount for rows whose expert is local, no node-level
    de-duplication). Independent of EP. DeepSeek-V3 rank: dispatch (fp8)
    448 MiB of codes (+ 0.25 MiB of rowwise scales with ``gemm=fp8``, + 14 MiB of 1×128 scales
    with ``gemm=deep_gemm``), combine (bf16) 896 MiB, 1.3125 GiB ≈ 1.31 GiB (1.33 GiB with 1×128
    scales). bf16 dispatch: 896 MiB out, 1.75 GiB.
    """
    rows = routed_rows(tokens_per_rank, k)
    scales = rows * scale_bytes_per_row
    return CommBytes("a2a", rows * hidden_size * dispatch_bytes + scales, rows * hidden_size * combine_bytes,
                     scales)


def agrs_bytes(tokens_per_rank: int, hidden_size: int, ep_size: int,
               bytes_per_element: int = 2, gather_bytes: int | None = None,
               scale_bytes_per_row: int = 0) -> CommBytes:
    """All-gather + reduce-scatter: ``(EP - 1)·T·H·2 B`` each way in bf16.

    Every token goes to every other EP rank, partial outputs come back by reduce-scatter
    (``bytes_per_element``, bf16). With FP8 dispatch the all-gather moves ``gather_bytes`` (1)
    per element plus ``scale_bytes_per_row`` per token. Grows with EP. DeepSeek-V3 rank,
    EP = 64, bf16: 6.89 GiB each way, ≈ 13.8 GiB.
    """
    positive_int("tokens_per_rank", tokens_per_rank)
    positive_int("ep_size", ep_size)
    tokens = (ep_size - 1) * tokens_per_rank
    g = bytes_per_element if gather_bytes is None else gather_bytes
    scales = tokens * scale_bytes_per_row
    return CommBytes("agrs", tokens * hidden_size * g + scales, tokens * hidden_size * bytes_per_element, scales)


def expert_weight_bytes(n_experts: int, hidden_size: int, moe_intermediate_size: int,
                        bytes_per_element: int = 2) -> int:
    """Bytes of ``n_experts`` SwiGLU experts, ``n·3·H·I·bytes``.

    DeepSeek-V3: 256 experts = 11,274,289,152 params ("112.7 亿") = 21.0 GiB bf16;
    the 4 experts an EP = 64 rank keeps = 336 MiB.
    """
    if n_experts < 0:
        raise ValueError(f"n_experts={n_experts!r} must be >= 0")
    return n_experts * 3 * hidden_size * moe_intermediate_size * bytes_per_element


def fsdp_bytes(n_routed_experts: int, hidden_size: int, moe_intermediate_size: int,
               bytes_per_element: int = 2) -> CommBytes:
    """EP = 1 + FSDP: all of the layer's expert weights are all-gathered.

    As docs/design.md#dispatchers counts it: the full layer's expert weights in bf16 (not the
    ``(W-1)/W`` share a ring all-gather moves), forward only (backward adds a
    re-gather and a gradient reduce-scatter). Independent of T.
    DeepSeek-V3: 21.0 GiB per layer per rank.
    """
    return CommBytes("fsdp", expert_weight_bytes(n_routed_experts, hidden_size,
                                                 moe_intermediate_size, bytes_per_element), 0)


def a2a_agrs_crossover_ep(k: int, dispatch_bytes: int = 1, combine_bytes: int = 2,
                          agrs_bytes_per_element: int = 2, agrs_gather_bytes: int | None = None) -> float:
    """EP at which a2a and agrs send the same bytes (FP8 scales neglected).

    ``T·k·H·(d + c) = (EP - 1)·T·H·(g + b)`` ⇒ ``EP = 1 + k·(d + c) / (g + b)``, with ``g`` the
    all-gather's bytes per element (default ``b``). fp8 a2a dispatch against bf16 agrs, k = 8:
    8 × 3 = 4 × (EP − 1) ⇒ EP = 7. Both in bf16, or both dispatching FP8 (``gemm=fp8``:
    8 × 3 = 3 × (EP − 1)): EP = 9. Above it a2a sends fewer bytes.
    """
    positive_int("num_experts_per_tok", k)
    g = agrs_bytes_per_element if agrs_gather_bytes is None else agrs_gather_bytes
    return 1 + k * (dispatch_bytes + combine_bytes) / (g + agrs_bytes_per_element)


def fsdp_a2a_breakeven_tokens(n_routed_experts: int, hidden_size: int, moe_intermediate_size: int,
                              k: int, dispatch_bytes: int = 1, combine_bytes: int = 2,
                              weight_bytes: int = 2) -> float:
    """Tokens per rank at which fsdp's weight all-gather equals a2a's bytes.

    ``T·k·H·(d + c) = P·w`` with ``P = E·3·H·I`` ⇒ ``T = P·w / (k·H·(d + c))``.
    DeepSeek-V3: 2 × 11,274,289,152 / (3 × 8 × 7,168) = 131,072 ≈ 131,000
    tokens per rank (more tokens favour fsdp, fewer favour a2a).
    """
    P = n_routed_experts * 3 * hidden_size * moe_intermediate_size
    positive_int("num_experts_per_tok", k)
    return P * weight_bytes / (k * hidden_size * (dispatch_bytes + combine_bytes))


# --------------------------------------------------------------------------- decode
@dataclass(frozen=True)
class DecodeCost:
    """Cost of a per-expert granularity at decode batch sizes.

    Attributes:
        sequences_per_rank: B, decode sequences per rank (one token each per step).
        rows_per_expert: mean rows per expert, ``B·k/e`` (= ``B·EP·k/E``).
        granularity: the alignment / tile height each expert's rows round up to.
        computed_rows_per_expert: ``ceil(rows / granularity)·granularity``.
        work_factor: computed / live rows (reference: 4× at B = 16, A = 128).
    """

    sequences_per_rank: int
    rows_per_expert: float
    granularity: int
    computed_rows_per_expert: int
    work_factor: float


def decode_alignment_cost(sequences_per_rank: int, ep_size: int, k: int, n_routed_experts: int,
                          granularity: int = 128) -> DecodeCost:
    """Work of padding each expert to ``granularity`` rows at decode.

    DeepSeek-V3, EP = 64: rows per expert = B × 64 × 8 / 256 = 2B; B = 16 → 32
    rows, padded to 128 → 4× the work; B = 4 → 16×; B = 64 and 512 → 1×.
    """
    n_local = local_experts(n_routed_experts, ep_size)
    rows = mean_rows_per_expert(positive_int("sequences_per_rank", sequences_per_rank), k, n_local)
    positive_int("granularity", granularity)
    computed = math.ceil(rows / granularity - 1e-12) * granularity
    return DecodeCost(sequences_per_rank, rows, granularity, computed, computed / rows)


# --------------------------------------------------------------------------- tiles
@dataclass(frozen=True)
class TileCost:
    """Tile visits of an unpadded (megablox-style) grouped GEMM.

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
        """``tiles · tile``: the rows the tiles cover."""
        return self.tiles * self.tile


def tile_visits(counts: Sequence[int], tile: int) -> TileCost:
    """Tiles a megablox-style kernel executes for unpadded segments.

    Segments lie back to back (``offsets = prefix sums of counts``); a non-empty
    segment ``[s, t)`` visits ``ceil(t / tile) - floor(s / tile)`` tiles, an
    empty one none. ``tiles_min ≤ tiles ≤ tiles_min + (segments − 1)``.
    Reference rank: ``[21733, 15004, 17982, 10817]``, tile 128 → 515 tiles (512 + 3),
    equivalent to 65,920 rows, +0.59 %.
    """
    positive_int("tile", tile)
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
    """Bound on the tile-boundary overhead for ``segments`` segments.

    Attributes:
        tiles_min: ``ceil(rows / tile)``.
        worst: ``(segments − 1) / tiles_min``: every boundary splits a tile.
        mean: the typical estimate, half the worst case (see :func:`tile_overhead_bound`).
    """

    tiles_min: int
    worst: float
    mean: float


def tile_overhead_bound(rows: int, segments: int, tile: int) -> TileBound:
    """Worst and typical boundary overhead of unpadded tiles over ``segments`` experts.

    Worst: ``(segments − 1) / (rows / tile)``. Reference rank: 65,536 rows (8,192 tokens,
    top-8), 256 experts, tile 512 → 255 / 128 = +199 %; 262,144 rows (32,768
    tokens), 192 experts → 191 / 512 = +37 %.

    Mean: the typical estimate is about +19 % for the second case without a
    derivation; it is half the worst case, ``(segments − 1)·½ / tiles_min``
    (= 18.65 %), i.e. each boundary costing half a tile on average, which is
    what padding each segment to the tile costs in expectation. This function
    reproduces that figure. (Counted as tile *visits* with boundaries at
    uniformly random rows, a boundary costs a whole extra visit with
    probability ``1 − 1/tile``, so the expected visits sit near the worst case;
    use :func:`tile_visits` on a real count vector for the exact figure.)
    """
    positive_int("rows", rows)
    positive_int("segments", segments)
    positive_int("tile", tile)
    tiles_min = -(-rows // tile)
    worst = (segments - 1) / tiles_min
    return TileBound(tiles_min, worst, worst / 2)
