"""Where FP8 pays: per GEMM of a layer's experts, FP8 or bf16 at its shape, from a measured crossover table.

An FP8 grouped GEMM saves tensor-core time in proportion to ``M·K·N`` but adds work in
proportion to ``M·K`` (quantising its left operand) and a fixed cost per call (the weight copies
are cached per optimizer step); with few rows per expert, or a small ``K·N``, bf16 is faster.
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

What a GEMM's left operand costs depends on where it is quantised (its ``quant``):

* ``separate``: a pass of its own over the rows (``Fp8Backend.quant_act``), read once more;
* ``in_kernel``: written as codes by the kernel that makes the rows anyway — the SwiGLU for
  FC2 on the fused FP8 path; the landing gather for FC1 and the combine's backward for FC2's
  data gradient with ``Fp8Backend(fused_quant=True)``; FC1's rows quantised once per token
  before an FP8 dispatch (``a2a`` / ``agrs``, docs/design.md#fp8-dispatch), ``k`` times fewer
  rows than the landed buffer.

:func:`quant_of` says which applies to each GEMM of a path. :data:`CROSSOVERS` holds, per measured
shape ``(H, I, local experts)`` and ``quant``, the smallest rows per expert from which each GEMM
in FP8 (its quantisation included) is at least as fast as bf16 at every larger size measured,
or None where FP8 was slower at every size up to 16,384. :func:`crossover_table` takes the
measured shape nearest to a layer's (in ``log H``, ``log I``, ``log e``), :func:`plan_fp8` runs a
GEMM in FP8 when the layer's expected rows per local expert reach its entry, else in bf16 (the
``torch`` backend's grouped GEMM), and :func:`describe` says which GEMMs of a layer run in bf16
and why: the MoE layer says it once, at its first forward (dropless/moe.py), never silently.

The table is measured by ``benchmarks/fp8_fused.py --only crossover --crossover-shapes ...`` on
an H100 for ``gemm=fp8``'s GEMM (``torch._scaled_grouped_mm``, one scale per row;
benchmarks/results/fp8_fused.jsonl, ``bench: crossover``); not on an H200, nor for DeepGEMM (whose
backend leaves the plan off by default). Each side is timed with the kernel that makes the GEMM's
left operand: ``separate``, that kernel + the quantisation pass + the FP8 GEMM against that kernel +
the bf16 GEMM; ``in_kernel``, the fused kernel that writes the codes too (the landing gather with the
rows kept, the SwiGLU, the combine's backward with the routing weights' gradient) + the FP8 GEMM
against the plain kernel + the bf16 GEMM, so that a fused kernel slower than the plain one counts
against FP8. A shape far from every measured one takes the nearest one's entries; measure it to be sure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from dropless.ops.backends import ExpertGemms

GEMMS = ("fc1", "fc2", "fc1_dgrad", "fc2_dgrad", "wgrad")
QUANTS = ("separate", "in_kernel")

#: ``(H, I, local experts)`` -> ``quant`` -> GEMM -> smallest rows per expert for FP8 (None: never up to
#: 16,384). Measured on one H100 (torch 2.11, 2026-12-07, commit 93b64f4, 64 … 16,384 rows per expert,
#: alignment 128, k 6 at H 1024 and 8 elsewhere; benchmarks/results/fp8_fused.jsonl, ``bench: crossover``). FC1's
#: data gradient and the FP8 weight gradient are always ``separate``.
CROSSOVERS: dict[tuple[int, int, int], dict[str, dict[str, int | None]]] = {
    (1024, 512, 64): {
        "separate": dict(fc1=None, fc2=None, fc2_dgrad=None, fc1_dgrad=None, wgrad=None),
        "in_kernel": dict(fc1=2048, fc2=4096, fc2_dgrad=None)},
    (2048, 1024, 32): {
        "separate": dict(fc1=16384, fc2=4096, fc2_dgrad=None, fc1_dgrad=16384, wgrad=None),
        "in_kernel": dict(fc1=512, fc2=1024, fc2_dgrad=4096)},
    (4096, 1536, 16): {
        "separate": dict(fc1=1024, fc2=16384, fc2_dgrad=16384, fc1_dgrad=1024, wgrad=None),
        "in_kernel": dict(fc1=512, fc2=256, fc2_dgrad=2048)},
    (7168, 2048, 4): {
        "separate": dict(fc1=2048, fc2=4096, fc2_dgrad=None, fc1_dgrad=2048, wgrad=None),
        "in_kernel": dict(fc1=2048, fc2=512, fc2_dgrad=2048)},
}


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

    def gemms(self, backend) -> ExpertGemms:
        """Each GEMM's backend under this plan: ``backend`` (an FP8 backend) where FP8, its ``bf16`` where not."""
        return ExpertGemms(**{f.name: backend if getattr(self, f.name) else backend.bf16 for f in fields(self)})


ALL_FP8 = Fp8Plan()


def expected_rows_per_expert(tokens: int, top_k: int, n_experts: int, ep_size: int = 1) -> float:
    """Rows per local expert under balanced routing: each of the ``ep_size·tokens`` tokens of the EP group
    sends ``top_k`` rows, spread over ``n_experts`` experts (``tokens`` per rank, per chunk)."""
    return tokens * ep_size * top_k / max(n_experts, 1)


def quant_of(fused_path: bool, fused_quant: bool, fp8_dispatch: bool) -> dict[str, str]:
    """Where each GEMM's left operand is quantised (``separate`` or ``in_kernel``; module docstring).

    Args:
        fused_path: the fused FP8 node (dropless/expert_paths.py ``Fp8FusedPath``); False for the
            recompute nodes, whose every FP8 GEMM quantises its operand in a pass of its own.
        fused_quant: the backend's ``fused_quant``.
        fp8_dispatch: the dispatcher moves FC1's rows as codes quantised once per token.
    """
    if not fused_path:
        return dict.fromkeys(GEMMS, "separate")
    fc1 = "in_kernel" if fused_quant or fp8_dispatch else "separate"
    return dict(fc1=fc1, fc2="in_kernel", fc2_dgrad="in_kernel" if fused_quant else "separate",
                fc1_dgrad="separate", wgrad="separate")


def _distance(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
    return sum(abs(math.log(max(x, 1)) - math.log(max(y, 1))) for x, y in zip(a, b))


def crossover_table(hidden: int, inter: int, experts: int, quant: dict[str, str],
                    crossovers: dict | None = None) -> tuple[dict[str, int | None], tuple[int, int, int]]:
    """The crossover of each GEMM at the measured shape nearest ``(hidden, inter, experts)``.

    Args:
        quant: :func:`quant_of` of the layer's path. crossovers: default :data:`CROSSOVERS`.
    Returns:
        ``(table, shape)``: GEMM -> smallest rows per expert for FP8 (None: never), and the measured
        ``(H, I, e)`` it comes from.
    Raises:
        ValueError: an empty ``crossovers``, or a ``quant`` outside :data:`QUANTS`.
    """
    crossovers = CROSSOVERS if crossovers is None else crossovers
    if not crossovers:
        raise ValueError("crossover_table: no measured shape")
    bad = {g: q for g, q in quant.items() if q not in QUANTS}
    if bad:
        raise ValueError(f"crossover_table: quant {bad}; each is one of {QUANTS}")
    shape = min(crossovers, key=lambda s: _distance(s, (hidden, inter, experts)))
    at = crossovers[shape]
    return {g: at[quant[g]].get(g, at["separate"][g]) for g in GEMMS}, shape


def plan_fp8(rows_per_expert: float, table: dict[str, int | None]) -> Fp8Plan:
    """The plan for a layer whose experts expect ``rows_per_expert`` rows each.

    Args:
        rows_per_expert: :func:`expected_rows_per_expert` of the layer's call.
        table: GEMM name -> smallest rows per expert for FP8, None for never (:func:`crossover_table`).
    Returns:
        :class:`Fp8Plan`: a GEMM is FP8 when its entry is not None and ``rows_per_expert >= table[name]``.
    Raises:
        ValueError: a table without an entry for every GEMM of :data:`GEMMS`.
    """
    missing = [g for g in GEMMS if g not in table]
    if missing:
        raise ValueError(f"plan_fp8: the crossover table has no entry for {missing}; give one per GEMM of {GEMMS}")
    return Fp8Plan(**{g: table[g] is not None and rows_per_expert >= table[g] for g in GEMMS})


def describe(plan: Fp8Plan, layer: str, rows_per_expert: float, hidden: int, inter: int,
             table: dict[str, int | None], measured_at: tuple[int, int, int] | None = None) -> str | None:
    """One sentence naming the GEMMs of ``layer`` that run in bf16 and why, or None when all run in FP8.

    ``measured_at``: the ``(H, I, e)`` of the crossover used (:func:`crossover_table`), named when given.
    """
    slow = plan.bf16_gemms()
    if not slow:
        return None
    why = ", ".join(f"{g} (FP8 from {table[g]} rows)" if table[g] is not None else f"{g} (never faster in FP8)"
                    for g in slow)
    where = (f", crossover measured at H {measured_at[0]}, I {measured_at[1]}, {measured_at[2]} experts"
             if measured_at is not None else "")
    return (f"gemm=fp8, {layer}: {rows_per_expert:.0f} expected rows per expert (H {hidden}, I {inter}) is below "
            f"the FP8/bf16 crossover of {why}{where}, so these run in bf16 (dropless/ops/fp8_policy.py; "
            "docs/performance.md#fp8-experts)")
