"""Where FP8 pays: per GEMM of a layer's experts, FP8 or bf16 at its shape, from a measured crossover table.

An FP8 grouped GEMM saves tensor-core time in proportion to ``M·K·N`` but adds work in
proportion to ``M·K`` (quantising its left operand) and a fixed cost per call (the weight copies
are cached per optimizer step); with few rows per expert the GEMM is short and bf16 is faster.
The experts' five GEMMs (``[e]`` experts, ``m`` rows each, ``H`` hidden, ``I`` intermediate):

=============  =========================  ===========
GEMM           ``[M, K] @ [K, N]``        name
=============  =========================  ===========
FC1            ``[m, H] @ [H, 2I]``       ``fc1``
FC2            ``[m, I] @ [I, H]``        ``fc2``
FC2's dX       ``[m, H] @ [H, I]``        ``fc2_dgrad``
FC1's dX       ``[m, 2I] @ [2I, H]``      ``fc1_dgrad``
weight grads   ``[K, m] @ [m, N]``        ``wgrad`` (only with ``Fp8Backend(wgrad="fp8"/"fp8_expert")``)
=============  =========================  ===========

:func:`plan_fp8` runs a GEMM in FP8 when the expected rows per local expert reach its entry of
:data:`MIN_ROWS_PER_EXPERT`, else in bf16 (the ``torch`` backend's grouped GEMM), and
:func:`describe` says which GEMMs of a layer run in bf16 and why: the MoE layer says it once, at
its first forward (dropless/moe.py), never silently.

The thresholds are measured by ``benchmarks/fp8_fused.py --only crossover`` (the smallest rows per
expert from which the FP8 GEMM, quantisation included, is at least as fast as bf16 at every
larger size tried; DeepSeek-V3's H 7,168 / I 2,048) and apply to any ``H``, ``I`` until measured
for others. An entry of 0 has not been measured on the GPU this runs on: that GEMM stays FP8.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

#: Smallest expected rows per local expert at which each GEMM runs in FP8 (0: always; see the module
#: docstring). Measured by ``benchmarks/fp8_fused.py --only crossover``
#: (benchmarks/results/fp8_fused.jsonl, ``bench: crossover``).
FC1_MIN_ROWS = 0
FC2_MIN_ROWS = 0
FC1_DGRAD_MIN_ROWS = 0
FC2_DGRAD_MIN_ROWS = 0
WGRAD_MIN_ROWS = 0
MIN_ROWS_PER_EXPERT = {"fc1": FC1_MIN_ROWS, "fc2": FC2_MIN_ROWS, "fc1_dgrad": FC1_DGRAD_MIN_ROWS,
                       "fc2_dgrad": FC2_DGRAD_MIN_ROWS, "wgrad": WGRAD_MIN_ROWS}
GEMMS = tuple(MIN_ROWS_PER_EXPERT)


@dataclass(frozen=True)
class Fp8Plan:
    """Which of a layer's expert GEMMs run in FP8 (True) or bf16 (False); the default: all FP8.

    ``wgrad`` True keeps the backend's configured weight gradient (bf16 by default); False
    runs it in bf16 whatever the backend's ``wgrad``.
    """

    fc1: bool = True
    fc2: bool = True
    fc1_dgrad: bool = True
    fc2_dgrad: bool = True
    wgrad: bool = True

    def bf16_gemms(self) -> list[str]:
        """Names of the GEMMs this plan runs in bf16, in :data:`GEMMS` order."""
        return [f.name for f in fields(self) if not getattr(self, f.name)]


ALL_FP8 = Fp8Plan()


def expected_rows_per_expert(tokens: int, top_k: int, n_experts: int, ep_size: int = 1) -> float:
    """Rows per local expert under balanced routing: each of the ``ep_size·tokens`` tokens of the EP group
    sends ``top_k`` rows, spread over ``n_experts`` experts (``tokens`` per rank, per chunk)."""
    return tokens * ep_size * top_k / max(n_experts, 1)


def plan_fp8(rows_per_expert: float, table: dict[str, int] | None = None) -> Fp8Plan:
    """The plan for a layer whose experts expect ``rows_per_expert`` rows each.

    Args:
        rows_per_expert: :func:`expected_rows_per_expert` of the layer's call.
        table: GEMM name -> smallest rows per expert for FP8 (default :data:`MIN_ROWS_PER_EXPERT`).
    Returns:
        :class:`Fp8Plan`: a GEMM is FP8 when ``rows_per_expert >= table[name]``.
    Raises:
        ValueError: a table without an entry for every GEMM of :data:`GEMMS`.
    """
    table = MIN_ROWS_PER_EXPERT if table is None else table
    missing = [g for g in GEMMS if g not in table]
    if missing:
        raise ValueError(f"plan_fp8: the crossover table has no entry for {missing}; give one per GEMM of {GEMMS}")
    return Fp8Plan(**{g: rows_per_expert >= table[g] for g in GEMMS})


def describe(plan: Fp8Plan, layer: str, rows_per_expert: float, hidden: int, inter: int,
             table: dict[str, int] | None = None) -> str | None:
    """One sentence naming the GEMMs of ``layer`` that run in bf16 and why, or None when all run in FP8."""
    table = MIN_ROWS_PER_EXPERT if table is None else table
    slow = plan.bf16_gemms()
    if not slow:
        return None
    why = ", ".join(f"{g} (FP8 from {table[g]} rows)" for g in slow)
    return (f"gemm=fp8, {layer}: {rows_per_expert:.0f} expected rows per expert (H {hidden}, I {inter}) is below "
            f"the measured FP8/bf16 crossover of {why}, so these run in bf16 (dropless/ops/fp8_policy.py; "
            "docs/performance.md#fp8-experts)")
