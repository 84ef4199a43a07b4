"""The per-rank plan of one MoE layer: :func:`plan` gathers the cost model's figures into a dict,
:func:`format_plan` renders it as plain-text tables.

Units in the dict: rows and tokens are counts, FLOPs are FLOPs, bytes are bytes, fractions are
fractions. In the text: FLOPs as TFLOP (1e12), bytes as MiB / GiB (2**20, 2**30), parameter
counts with the unit that shows them (K = 1e3, M = 1e6, B = 1e9).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from dropless.config import ModelArgs
from dropless.model.params import model_flops_per_token, param_counts
from dropless.plan.cost import (
    FP8_GEMMS,
    MEMORY_SETTINGS,
    GiB,
    MiB,
    a2a_agrs_crossover_ep,
    a2a_bytes,
    activation_bytes,
    agrs_bytes,
    aligned_rows,
    alignment_bound_rows,
    capacity_per_expert,
    capacity_table,
    cf_key,
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
    positive_int,
    routed_rows,
    saved_bytes,
    tile_overhead_bound,
    tile_visits,
)
from dropless.plan.state import RankState, rank_state

__all__ = ["RankShape", "format_plan", "plan"]


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
        positive_int("tokens_per_rank", self.tokens_per_rank,
                      "set train.micro_batch_size and train.seq_len, or --tokens-per-rank N")
        positive_int("hidden_size", self.hidden_size)
        positive_int("moe_intermediate_size", self.moe_intermediate_size)
        positive_int("num_experts_per_tok", self.num_experts_per_tok)
        positive_int("alignment", self.alignment, "use 1 (no alignment) or e.g. 128")
        local_experts(self.n_routed_experts, self.ep_size)

    @property
    def n_local(self) -> int:
        """``e = E / EP``."""
        return self.n_routed_experts // self.ep_size

    @classmethod
    def from_args(cls, args: ModelArgs, tokens_per_rank: int, ep_size: int = 1,
                  alignment: int | None = None) -> "RankShape":
        """The rank shape of ``args`` (H, I, E, k; A = ``args.expert_alignment`` unless given)."""
        return cls(tokens_per_rank, args.hidden_size, args.moe_intermediate_size,
                   args.n_routed_experts, args.num_experts_per_tok, ep_size,
                   args.expert_alignment if alignment is None else alignment)


def plan(shape: RankShape, counts: Sequence[int] | None = None,
         capacity_factors: Sequence[float] = (1.0, 1.5), tile: int = 128,
         fp8_dispatch: bool | None = None, decode_sequences: Sequence[int] = (4, 16, 64, 512),
         args: ModelArgs | None = None, seq_len: int | None = None, world: int | None = None,
         shard_experts: bool = False, shard_dense: bool = False, compute_bytes: int = 2,
         device_bytes: int | None = None) -> dict[str, Any]:
    """The whole per-rank, per-MoE-layer plan as a JSON-ready dict.

    Args:
        shape: the rank (T, H, I, E, k, EP, A).
        counts: rows landed per local expert (length ``E/EP``) for the tables
            that need a real distribution; None = use the mean ``T·k``.
        capacity_factors: factors for the capacity table / FLOPs.
        tile: tile height for the unpadded-tile overhead and the decode granularity.
        fp8_dispatch: the a2a dispatch and agrs all-gather move FP8 rows (1 B codes + the fp32
            scales of ``args.gemm``, or one rowwise scale when it is no FP8 backend) rather than bf16
            (2 B); None: as dropless does, FP8 exactly when ``args.gemm`` is in
            :data:`~dropless.plan.cost.FP8_GEMMS` (docs/design.md#fp8-dispatch). The combine is bf16.
        decode_sequences: decode batch sizes for the decode table.
        args: the full model, for the totals (parameters, FLOPs per token).
        seq_len: sequence length for FLOPs per token (needs ``args``).
        world: ranks of the job; with ``args``, the training state per rank (``"state"``:
            :func:`dropless.plan.state.rank_state`) for the layout of ``shard_experts``
            (``train.shard_experts``) and ``shard_dense`` (``train.shard_dense``), in the compute dtype of
            ``compute_bytes`` (2: bf16 with fp32 masters; 4: fp32), against ``device_bytes`` if given.
    Returns: nested dict; bytes in bytes, FLOPs in FLOPs, fractions as fractions.
    Raises:
        ValueError: bad EP, counts, capacity factor or tile (the message names the fix).
    """
    s = shape
    e, H, I, k, T = s.n_local, s.hidden_size, s.moe_intermediate_size, s.num_experts_per_tok, \
        s.tokens_per_rank
    positive_int("tile", tile, "use e.g. 128")
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
    gemm = args.gemm if args is not None else "torch"
    if fp8_dispatch is None:
        fp8_dispatch = gemm in FP8_GEMMS
    d_bytes = 1 if fp8_dispatch else 2
    scale_bytes = fp8_scale_bytes_per_row(H, gemm) if fp8_dispatch else 0
    a2a = a2a_bytes(T, k, H, d_bytes, 2, scale_bytes)
    agrs = agrs_bytes(T, H, s.ep_size, 2, d_bytes, scale_bytes)
    fsdp = fsdp_bytes(s.n_routed_experts, H, I)
    tiles = tile_visits(counts, tile) if counts is not None else None
    bound_t = tile_overhead_bound(live if live else 1, e, tile)

    out: dict[str, Any] = {
        "rank": {"tokens_per_rank": T, "hidden_size": H, "moe_intermediate_size": I,
                 "n_routed_experts": s.n_routed_experts, "num_experts_per_tok": k,
                 "ep_size": s.ep_size, "local_experts": e, "alignment": s.alignment, "tile": tile,
                 "dispatch_dtype": "fp8" if fp8_dispatch else "bf16", "gemm": gemm,
                 "dispatch_scale_bytes_per_row": scale_bytes},
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
            "capacity_factor": {cf_key(r.capacity_factor): expert_flops(r.computed_rows, H, I)
                                for r in cap_rows if r.capacity_factor is not None},
            "ungrouped": expert_flops(aligned, H, I, experts_per_row=e),
            "note": "forward FLOPs of the routed experts per MoE layer; training is 3x",
        },
        "capacity": [asdict(r) for r in cap_rows],
        "activation_bytes": asdict(activation_bytes(T, aligned, H, I)),
        "saved_bytes": {m: saved_bytes(aligned, H, I, m) for m in MEMORY_SETTINGS
                        if s.ep_size == 1 or not m.endswith("gather")},
        "comm_bytes": {
            c.dispatcher: {"out": c.out_bytes, "back": c.back_bytes, "total": c.total,
                           "out_scales": c.out_scale_bytes}
            for c in (a2a, agrs, fsdp)
        },
        "crossover": {
            "a2a_agrs_ep": a2a_agrs_crossover_ep(k, d_bytes, 2, 2, d_bytes),
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
        if world is not None:
            out["state"] = _state_dict(rank_state(pc.routed_experts, pc.total - pc.routed_experts, world, s.ep_size,
                                                  e, H, I, shard_experts=shard_experts, shard_dense=shard_dense,
                                                  compute_bytes=compute_bytes), device_bytes)
        if seq_len is not None:
            out["model"]["seq_len"] = seq_len
            out["model"]["flops_per_token"] = model_flops_per_token(args, seq_len)
    return out


def _state_dict(st: RankState, device_bytes: int | None) -> dict[str, Any]:
    """:class:`RankState` as plain dicts (each StateBytes with its ``total``)."""
    def sb(x):
        return {**asdict(x), "total": x.total}
    total = st.total.total + st.transient
    return {"world": st.world, "ep_size": st.ep_size, "dp_size": st.dp_size, "shard_experts": st.shard_experts,
            "shard_dense": st.shard_dense,
            "experts": {"replicated": sb(st.experts_replicated), "sharded": sb(st.experts_sharded)},
            "dense": {"replicated": sb(st.dense_replicated), "sharded": sb(st.dense_sharded)},
            "layout": sb(st.total), "transient": st.transient, "layout_with_transient": total,
            "comm_per_layer": {**asdict(st.comm), "total": st.comm.total},
            "device_bytes": device_bytes, "fits": None if device_bytes is None else total <= device_bytes}


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


def _fmt_count(n: int) -> str:
    """A count in the largest unit it fills: ``671.03 B``, ``1.48 M``, ``512.00 K``; below 1,000 as is."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n):,}"


def _fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f} %"


def _over(x: float, base: float) -> float | None:
    """``x / base - 1``, or None (printed ``-``) when ``base`` is 0: every expert empty has no live rows to
    compare with."""
    return x / base - 1 if base else None


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
             ["aligned rows", f"{fl['aligned'] / 1e12:.3f}", _fmt_pct(_over(fl["aligned"], live))]]
    frows += [[f"capacity factor {cf}", f"{v / 1e12:.3f}", _fmt_pct(_over(v, live))]
              for cf, v in fl["capacity_factor"].items()]
    frows.append([f"ungrouped (x{r['local_experts']} experts)", f"{fl['ungrouped'] / 1e12:.3f}",
                  f"{fl['ungrouped'] / fl['aligned']:.2f}x aligned" if fl["aligned"] else "-"])
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
    scales = (f" codes + {r['dispatch_scale_bytes_per_row']} B of scales per row (gemm={r['gemm']})"
              if r["dispatch_dtype"] == "fp8" else "")
    parts += ["", f"Bytes sent per rank per layer, forward (a2a dispatch / agrs all-gather "
                  f"{r['dispatch_dtype']}{scales}, combine bf16)", _table(["dispatcher", "out", "of which scales",
                                                                           "back", "total"], [
        [name, _fmt_bytes(v["out"]), _fmt_bytes(v["out_scales"]), _fmt_bytes(v["back"]), _fmt_bytes(v["total"])]
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
    if "state" in p:
        parts += ["", *_format_state(p["state"])]
    if "model" in p:
        m = p["model"]
        pc = m["params"]
        mrows = [["parameters, total", _fmt_count(pc["total"])],
                 ["parameters, activated per token", _fmt_count(pc["activated"])]]
        if "flops_per_token" in m:
            mrows.append([f"training FLOPs per token (S={m['seq_len']})",
                          f"{m['flops_per_token']:.4g}"])
        parts += ["", f"Model ({m['num_hidden_layers']} layers, {m['num_moe_layers']} MoE)",
                  _table(["", "value"], mrows)]
    return "\n".join(parts)


def _format_state(st: dict[str, Any]) -> list[str]:
    """The training-state section of :func:`format_plan`."""
    def row(name, x):
        return [name, _fmt_count(x["params"]), _fmt_bytes(x["weights"]), _fmt_bytes(x["grads"]),
                _fmt_bytes(x["optimizer"]), _fmt_bytes(x["total"])]
    mark = {True: " <- this layout", False: ""}
    rows = [row(f"routed experts, replicated over dp {st['dp_size']}{mark[not st['shard_experts']]}",
                st["experts"]["replicated"]),
            row(f"routed experts, sharded over dp {st['dp_size']} (train.shard_experts){mark[st['shard_experts']]}",
                st["experts"]["sharded"]),
            row(f"other parameters, replicated{mark[not st['shard_dense']]}", st["dense"]["replicated"]),
            row(f"other parameters, sharded over {st['world']} (train.shard_dense){mark[st['shard_dense']]}",
                st["dense"]["sharded"]),
            row("this layout", st["layout"])]
    c = st["comm_per_layer"]
    lines = [f"Training state per rank (world {st['world']} = dp {st['dp_size']} x ep {st['ep_size']}; "
             "weights incl. fp32 masters, fp32 gradients, AdamW moments; no activations)",
             _table(["", "params", "weights", "grads", "AdamW", "total"], rows)]
    if st["shard_experts"] and st["dp_size"] > 1:
        lines.append(f"train.shard_experts per MoE layer and rank: all-gather {_fmt_bytes(c['all_gather_forward'])} "
                     f"forward + {_fmt_bytes(c['all_gather_backward'])} backward, reduce-scatter "
                     f"{_fmt_bytes(c['reduce_scatter'])} (the gathers once per token chunk); gathered buffers at "
                     f"the peak {_fmt_bytes(st['transient'])}")
    if st["device_bytes"] is not None:
        verdict = "fits" if st["fits"] else "does NOT fit"
        lines.append(f"state + gathered buffers {_fmt_bytes(st['layout_with_transient'])} per rank {verdict} in "
                     f"{_fmt_bytes(st['device_bytes'])} (--device-gib), before activations")
    return lines
