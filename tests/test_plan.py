"""The planner reproduces per-rank figures of docs/design.md#a-worked-rank, to the precision given there.

Reference rank (docs/design.md#a-worked-rank): DeepSeek-V3, H = 7168, I = 2048, E = 256, k = 8,
EP = 64 (4 local experts), 8,192 tokens per rank, counts
[21733, 15004, 17982, 10817], alignment 128.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest

from dropless import plan as P
from dropless.config import ModelArgs

H, I, E, K, EP, T = 7168, 2048, 256, 8, 64, 8192
COUNTS = [21733, 15004, 17982, 10817]
MiB, GiB = 2**20, 2**30


def pct(x: float, nd: int = 2) -> float:
    return round(100 * x, nd)


# --------------------------------------------------------------------------- rows
def test_routed_rows_per_rank():
    e = P.local_experts(E, EP)
    assert e == 4
    assert P.routed_rows(T, K) == 65_536
    assert P.mean_rows_per_expert(T, K, e) == 16_384
    assert sum(COUNTS) == 65_536                              # the reference counts sum to the mean


def test_alignment_rows_and_bound():
    al = P.aligned_rows(COUNTS, 128)
    assert al == 65_792
    assert [P.align_up(c, 128) - c for c in COUNTS] == [27, 100, 66, 63]
    assert pct((al - 65_536) / 65_536) == 0.39                # +0.39 %
    bound = P.alignment_bound_rows(4, 128)
    assert bound == 508                                       # "最多 508 行"
    assert pct(bound / 65_536) == 0.78                        # bound 0.78 %
    assert P.aligned_rows(COUNTS, 1) == 65_536                # A = 1: no padding


# --------------------------------------------------------------------------- FLOPs
def test_flops_per_row_per_expert():
    f = P.flops_per_row_per_expert(H, I)
    assert f == 2 * 3 * 7168 * 2048
    assert round(f / 1e6, 2) == 88.08                         # 88.08 MFLOP


def test_layer_flops_four_ways():
    e = 4
    live = P.expert_flops(65_536, H, I)
    aligned = P.expert_flops(P.aligned_rows(COUNTS, 128), H, I)
    cf15 = P.expert_flops(e * P.capacity_per_expert(T, K, e, 1.5), H, I)
    ungrouped = P.expert_flops(P.aligned_rows(COUNTS, 128), H, I, experts_per_row=e)
    assert round(live / 1e12, 3) == 5.772
    assert round(aligned / 1e12, 3) == 5.795
    assert round(cf15 / 1e12, 3) == 8.659
    assert round(ungrouped / 1e12, 3) == 23.180
    assert round(aligned / live - 1, 4) == 0.0039               # +0.39 %
    assert round(cf15 / live - 1, 3) == 0.500                   # +50.0 %
    assert round(ungrouped / aligned, 2) == 4.00                # 4.00x


# --------------------------------------------------------------------------- capacity factor
def test_capacity_factor_table():
    rows = P.capacity_table(COUNTS, T, K, 4, [1.0, 1.5], alignment=128)
    cf1, cf15, dropless = rows
    assert cf1.capacity_per_expert == 16_384
    assert cf1.computed_rows == 65_536
    assert cf1.dropped_rows == 5_349 + 1_598 == 6_947
    assert cf1.padded_rows == 1_380 + 5_567 == 6_947
    assert round(100 * cf1.padded_fraction, 1) == 10.6
    assert cf15.capacity_per_expert == 24_576
    assert cf15.computed_rows == 98_304
    assert cf15.dropped_rows == 0
    assert cf15.padded_rows == 32_768
    assert cf15.extra_compute == pytest.approx(0.5)
    assert dropless.capacity_factor is None
    assert dropless.computed_rows == 65_792 and dropless.dropped_rows == 0
    assert dropless.padded_rows == 256


def test_capacity_without_counts_knows_only_computed_rows():
    cf1, cf15, dropless = P.capacity_table(None, T, K, 4, [1.0, 1.5])
    assert (cf1.computed_rows, cf15.computed_rows, dropless.computed_rows) == (65_536, 98_304, 65_536)
    assert cf1.dropped_rows is None and cf1.padded_rows is None


# --------------------------------------------------------------------------- activations
def test_activation_bytes_deepseek_v3_rank():
    ab = P.activation_bytes(T, 65_792, H, I)
    assert round(ab.x / GiB, 2) == 0.11
    assert round(ab.landed_rows / GiB, 2) == 0.88
    assert round(ab.gate_up / GiB, 2) == 0.50
    assert round(ab.swiglu / GiB, 2) == 0.25
    assert round(ab.fc2_out / GiB, 2) == 0.88
    assert ab.landed_rows == 65_792 * 7168 * 2


def test_activation_bytes_295b_config():
    tokens = 4096 * 12
    assert tokens == 49_152
    rows = P.routed_rows(tokens, 8)
    assert rows == 393_216
    ab = P.activation_bytes(tokens, rows, 4096, 1536)
    assert ab.landed_rows / GiB == 3.00                         # sort buffer, "正好三个 G"
    assert ab.gate_up / GiB == 2.25
    assert ab.x / GiB == 0.375
    # a common slip: the V3 hidden size instead of 4,096 gives 1.75x the bytes
    assert P.activation_bytes(tokens, 131_072, 7168, 1536).landed_rows / GiB == 1.75


# --------------------------------------------------------------------------- communication
def test_a2a_bytes():
    c = P.a2a_bytes(T, K, H, dispatch_bytes=1, combine_bytes=2)
    assert c.out_bytes == 448 * MiB                             # dispatch, fp8
    assert c.back_bytes == 896 * MiB                            # combine, bf16
    assert round(c.total / GiB, 2) == 1.31
    # independent of EP: nothing in it depends on EP; bf16 dispatch doubles the first leg
    assert P.a2a_bytes(T, K, H, 2, 2).out_bytes == 896 * MiB


def test_agrs_bytes():
    c = P.agrs_bytes(T, H, EP)
    assert round(c.out_bytes / GiB, 2) == 6.89                  # all-gather
    assert round(c.back_bytes / GiB, 2) == 6.89                 # reduce-scatter
    assert round(c.total / GiB, 1) == 13.8
    assert P.agrs_bytes(T, H, 1).total == 0                     # nothing to send alone
    assert P.agrs_bytes(T, H, 8).total * 63 == c.total * 7      # proportional to EP - 1


def test_fsdp_bytes_and_weights_held():
    c = P.fsdp_bytes(E, H, I)
    assert E * 3 * H * I == 11_274_289_152                      # "112.7 亿参数"
    assert round(c.total / GiB, 1) == 21.0
    assert P.expert_weight_bytes(4, H, I) == 336 * MiB          # EP keeps 4 experts
    assert round(2 * P.expert_weight_bytes(E, H, I) / GiB) == 42  # FSDP with prefetch


def test_crossovers():
    assert P.a2a_agrs_crossover_ep(K, 1, 2) == 7                # 8 × 3 = 4 × (EP − 1)
    ep = P.a2a_agrs_crossover_ep(K, 1, 2)
    a2a = P.a2a_bytes(T, K, H).total
    assert P.agrs_bytes(T, H, int(ep)).total == a2a             # equal bytes at the crossover
    tok = P.fsdp_a2a_breakeven_tokens(E, H, I, K, 1, 2)
    assert round(tok, -3) == 131_000                            # "≈ 131,000 token / 卡"
    assert P.a2a_bytes(int(tok), K, H).total == P.fsdp_bytes(E, H, I).total
    # the TPU recipe's 32,768 tokens: fsdp still sends ~4x the bytes of a2a
    assert round(P.fsdp_bytes(E, H, I).total / P.a2a_bytes(32_768, K, H).total) == 4


# --------------------------------------------------------------------------- decode
def test_decode_alignment_cost():
    d = P.decode_alignment_cost(16, EP, K, E, 128)
    assert d.rows_per_expert == 32                              # 2B at B = 16
    assert d.work_factor == 4.0                                 # "算 4 倍的量"
    assert P.decode_alignment_cost(4, EP, K, E, 128).work_factor == 16.0
    assert P.decode_alignment_cost(64, EP, K, E, 128).work_factor == 1.0
    big = P.decode_alignment_cost(512, EP, K, E, 128)
    assert (big.rows_per_expert, big.work_factor) == (1024, 1.0)
    assert P.decode_alignment_cost(8192, EP, K, E, 128).rows_per_expert == 16_384


# --------------------------------------------------------------------------- tiles
def test_unpadded_tiles_megablox():
    t = P.tile_visits(COUNTS, 128)
    assert t.tiles_min == 512
    assert t.tiles == 515
    assert t.equivalent_rows == 65_920
    assert pct(t.overhead) == 0.59
    # bounds of the source comment: tiles_m <= tiles <= tiles_m + segments - 1
    assert t.tiles_min <= t.tiles <= t.tiles_min + len(COUNTS) - 1
    # boundaries on tile multiples cost nothing; empty experts cost nothing
    assert P.tile_visits([128, 0, 256, 128], 128).tiles == 4


def test_ep1_tile_overhead_bounds():
    gpu = P.tile_overhead_bound(8192 * 8, 256, 512)
    assert gpu.tiles_min == 128
    assert round(100 * gpu.worst) == 199                        # +199 %
    tpu = P.tile_overhead_bound(32_768 * 8, 192, 512)
    assert tpu.tiles_min == 512
    assert round(100 * tpu.worst) == 37                         # +37 %
    assert round(100 * tpu.mean) == 19                          # mean ≈ +19 %
    # the bound is attained by a count vector whose every boundary splits a tile
    counts = [1] * 191 + [262_144 - 191]
    assert P.tile_visits(counts, 512).tiles == 512 + 191


# --------------------------------------------------------------------------- model totals
def test_param_counts_deepseek_v3():
    pc = P.param_counts(ModelArgs.deepseek_v3_671b())
    # paper: "671B total parameters with 37B activated for each token"
    assert round(pc.total / 1e9) == 671
    assert abs(pc.total / 671e9 - 1) < 0.005
    assert round(pc.activated / 1e9) == 37
    assert abs(pc.activated / 37e9 - 1) < 0.015
    # pieces checked against independent hand arithmetic
    assert pc.routed_experts == 58 * 11_274_289_152
    assert pc.embedding == pc.head == 129_280 * 7168
    assert pc.router == 58 * 256 * 7168
    assert pc.shared_experts == 58 * 3 * 7168 * 2048
    assert pc.dense_mlp == 3 * 3 * 7168 * 18432
    assert pc.total == (pc.embedding + pc.attention + pc.dense_mlp + pc.routed_experts
                        + pc.shared_experts + pc.router + pc.norms + pc.head)


def test_param_counts_deepseek_v2_cross_check():
    # DeepSeek-V2 paper: 236B total, 21B activated; V2-Lite: 15.7B total
    v2 = ModelArgs.deepseek_v3_671b(
        vocab_size=102400, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=60, first_k_dense_replace=1, n_routed_experts=160, n_shared_experts=2,
        num_experts_per_tok=6, n_group=8, topk_group=3)
    pc = P.param_counts(v2)
    assert round(pc.total / 1e9) == 236
    assert round(pc.activated / 1e9) == 21
    lite = ModelArgs.deepseek_v3_671b(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, first_k_dense_replace=1, num_attention_heads=16, q_lora_rank=0,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1)
    assert round(P.param_counts(lite).total / 1e8) == 157


def test_param_counts_tiny_model_by_hand():
    a = ModelArgs()  # V=256 H=64 L=4 dense=1 I=32 E=8 S=1 k=2 N=4 q_lora=0 C=32 Dn=16 Dr=8 Dv=16
    attn = 64 * 4 * 24 + 64 * (32 + 8) + 32 + 32 * 4 * (16 + 16) + 4 * 16 * 64
    total = (256 * 64 + 4 * (attn + 2 * 64) + 3 * 64 * 192
             + 3 * (8 * 64 + 8 * 3 * 64 * 32 + 3 * 64 * 32) + 64 + 256 * 64)
    pc = P.param_counts(a)
    assert pc.total == total
    assert pc.activated == total - 256 * 64 - 3 * 6 * 3 * 64 * 32
    tied = P.param_counts(ModelArgs(tie_word_embeddings=True))
    assert tied.total == total - 256 * 64 and tied.head == 0


@pytest.mark.skipif(importlib.util.find_spec("dropless.model.transformer") is None,
                    reason="dropless.model.transformer not written yet")
@pytest.mark.parametrize("args", [
    ModelArgs(),
    ModelArgs(q_lora_rank=16, n_shared_experts=2, moe_layer_freq=2, num_hidden_layers=5),
    ModelArgs.deepseek_v3_671b(),
], ids=["tiny", "q_lora+2shared+freq2", "671b"])
def test_param_counts_match_the_built_model(args):
    torch = pytest.importorskip("torch")
    from dropless.model.params import count_parameters
    from dropless.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    pc = P.param_counts(args)
    assert count_parameters(model) == (pc.total, pc.activated)


def test_model_flops_per_token():
    a = ModelArgs.deepseek_v3_671b()
    S = 4096
    pc = P.param_counts(a)
    # activated params minus the norms = the matmul params
    matmul = pc.activated - pc.norms - 61 * (1536 + 512)
    attn = 6 * 61 * 128 * (192 + 128) * S / 2
    assert P.model_flops_per_token(a, S) == pytest.approx(6 * matmul + attn, rel=1e-12)
    assert P.model_flops_per_token(a, S, causal=False) == pytest.approx(6 * matmul + 2 * attn)
    # dropless counts exactly k live rows per token
    assert P.moe_flops_per_token(a, S, 8) == P.model_flops_per_token(a, S)
    # each routed row per token adds 6 × 3·H·I × 58 layers
    delta = P.moe_flops_per_token(a, S, 8) - P.moe_flops_per_token(a, S, 7)
    assert delta == pytest.approx(6 * 3 * 7168 * 2048 * 58)


# --------------------------------------------------------------------------- bad input
def test_bad_ep():
    with pytest.raises(ValueError, match=r"ep_size=3 does not divide n_routed_experts=256"):
        P.local_experts(256, 3)
    with pytest.raises(ValueError, match="ep_size"):
        P.RankShape(T, H, I, E, K, ep_size=0)
    with pytest.raises(ValueError, match="ep_size=512"):
        P.RankShape(T, H, I, E, K, ep_size=512)


def test_bad_counts():
    shape = P.RankShape(T, H, I, E, K, EP, 128)
    with pytest.raises(ValueError, match=r"counts has 3 entries .* 4 local experts"):
        P.plan(shape, counts=[1, 2, 3])
    with pytest.raises(ValueError, match=r"counts\[1\]=-5"):
        P.plan(shape, counts=[1, -5, 3, 4])
    with pytest.raises(ValueError, match="counts"):
        P.tile_visits([4, -1], 128)


@pytest.mark.parametrize("cf", [0, -1.0, float("nan")])
def test_bad_capacity_factor(cf):
    with pytest.raises(ValueError, match="capacity_factor.*must be a number > 0"):
        P.capacity_per_expert(T, K, 4, cf)
    with pytest.raises(ValueError, match="capacity_factor"):
        P.plan(P.RankShape(T, H, I, E, K, EP), capacity_factors=[1.0, cf])


def test_bad_sizes():
    with pytest.raises(ValueError, match="tokens_per_rank"):
        P.RankShape(0, H, I, E, K, EP)
    with pytest.raises(ValueError, match="alignment"):
        P.aligned_rows(COUNTS, 0)
    with pytest.raises(ValueError, match="tile"):
        P.tile_visits(COUNTS, 0)


# --------------------------------------------------------------------------- CLI
def _run_json(capsys, argv):
    assert P.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_holds_the_reference_rank_figures(capsys):
    d = _run_json(capsys, ["--model", "deepseek_v3_671b", "--json", "--counts",
                           "21733,15004,17982,10817", "--alignment", "128",
                           "--capacity-factor", "1.0,1.5", "--tile", "128", "--fp8-dispatch"])
    assert d["rank"]["ep_size"] == 64 and d["rank"]["tokens_per_rank"] == 8192
    r = d["rows"]
    assert (r["routed_rows_mean"], r["live_rows"], r["aligned_rows"]) == (65_536, 65_536, 65_792)
    assert pct(r["alignment_overhead"]) == 0.39 and pct(r["alignment_bound"]) == 0.78
    f = d["flops"]
    assert round(f["per_row_per_expert"] / 1e6, 2) == 88.08
    assert round(f["live"] / 1e12, 3) == 5.772
    assert round(f["aligned"] / 1e12, 3) == 5.795
    assert round(f["capacity_factor"]["1.5"] / 1e12, 3) == 8.659
    assert round(f["ungrouped"] / 1e12, 3) == 23.180
    cap = {c["scheme"]: c for c in d["capacity"]}
    assert cap["cf=1.0"]["dropped_rows"] == cap["cf=1.0"]["padded_rows"] == 6_947
    assert cap["cf=1.5"]["computed_rows"] == 98_304
    cb = d["comm_bytes"]
    # --fp8-dispatch on a bf16 model: FP8 codes + one rowwise fp32 scale per row (gemm=fp8's), a2a and agrs
    assert cb["a2a"]["out"] - cb["a2a"]["out_scales"] == 448 * MiB and cb["a2a"]["back"] == 896 * MiB
    assert cb["a2a"]["out_scales"] == 65_536 * 4
    assert round(cb["a2a"]["total"] / GiB, 2) == 1.31
    assert cb["agrs"]["out"] == 63 * 8192 * (7168 + 4) and round(cb["agrs"]["back"] / GiB, 2) == 6.89
    assert round(cb["fsdp"]["total"] / GiB, 1) == 21.0
    assert d["crossover"]["a2a_agrs_ep"] == 9   # both dispatch FP8: 1 + 8·3/(1 + 2)
    assert round(d["crossover"]["fsdp_a2a_tokens_per_rank"], -3) == 131_000
    t = d["tiles"]
    assert (t["tiles"], t["tiles_min"]) == (515, 512) and pct(t["overhead"]) == 0.59
    dec = {x["sequences_per_rank"]: x for x in d["decode"]}
    assert dec[16]["rows_per_expert"] == 32 and dec[16]["work_factor"] == 4.0
    ab = d["activation_bytes"]
    assert round(ab["x"] / GiB, 2) == 0.11 and round(ab["landed_rows"] / GiB, 2) == 0.88
    pc = d["model"]["params"]
    assert round(pc["total"] / 1e9) == 671 and round(pc["activated"] / 1e9) == 37


def test_cli_bf16_dispatch_and_ep_override(capsys):
    d = _run_json(capsys, ["--model", "deepseek_v3_671b", "--json", "--bf16-dispatch",
                           "--ep", "8", "--tokens-per-rank", "4096"])
    assert d["rank"]["local_experts"] == 32
    assert d["comm_bytes"]["a2a"]["out"] == 4096 * 8 * 7168 * 2
    assert d["crossover"]["a2a_agrs_ep"] == 9                   # 1 + 8·4/4
    assert d["comm_bytes"]["agrs"]["out"] == 7 * 4096 * 7168 * 2


def test_plan_dispatch_bytes_follow_gemm():
    """DeepSeek-V3's rank: gemm=fp8 dispatches FP8 (448 MiB of codes + 0.25 MiB of rowwise scales, 1.31 GiB
    a2a per rank per layer); deep_gemm adds 1×128 scales (56 per row, 14 MiB); gemm=torch stays bf16."""
    v3 = ModelArgs.deepseek_v3_671b()
    shape = P.RankShape.from_args(v3, 8192, 64, 128)
    got = {g: P.plan(shape, args=dataclasses.replace(v3, gemm=g)) for g in ("fp8", "deep_gemm", "torch")}
    fp8 = got["fp8"]
    assert fp8["rank"]["dispatch_dtype"] == "fp8" and fp8["rank"]["dispatch_scale_bytes_per_row"] == 4
    a2a = fp8["comm_bytes"]["a2a"]
    assert (a2a["out"], a2a["out_scales"], a2a["back"]) == (448 * MiB + 65_536 * 4, 65_536 * 4, 896 * MiB)
    assert round(a2a["total"] / GiB, 2) == 1.31 and a2a["total"] == 1.3125 * GiB + 65_536 * 4
    dg = got["deep_gemm"]["comm_bytes"]["a2a"]
    assert got["deep_gemm"]["rank"]["dispatch_scale_bytes_per_row"] == 4 * 7168 // 128
    assert (dg["out"], dg["out_scales"]) == (448 * MiB + 14 * MiB, 14 * MiB)
    bf = got["torch"]
    assert bf["rank"]["dispatch_dtype"] == "bf16" and bf["comm_bytes"]["a2a"]["out"] == 896 * MiB
    assert bf["comm_bytes"]["a2a"]["out_scales"] == 0 and round(bf["comm_bytes"]["agrs"]["out"] / GiB, 2) == 6.89
    # agrs with FP8 dispatch: the all-gather in codes + scales, the reduce-scatter in bf16
    ag = fp8["comm_bytes"]["agrs"]
    assert (ag["out"], ag["back"]) == (63 * 8192 * (7168 + 4), 63 * 8192 * 7168 * 2)
    assert "4 B of scales per row (gemm=fp8)" in P.format_plan(fp8)


def test_cli_dispatch_follows_the_gemm_override(capsys):
    """Hydra path: gemm=fp8 plans FP8 dispatch, the default gemm bf16; --bf16-dispatch overrides."""
    d8 = _run_json(capsys, ["gemm=fp8", "--json", "--ep", "2", "--tokens-per-rank", "64"])
    d16 = _run_json(capsys, ["--json", "--ep", "2", "--tokens-per-rank", "64"])
    h, k = d8["rank"]["hidden_size"], d8["rank"]["num_experts_per_tok"]
    assert (d8["rank"]["dispatch_dtype"], d16["rank"]["dispatch_dtype"]) == ("fp8", "bf16")
    assert d8["comm_bytes"]["a2a"]["out"] == 64 * k * (h + 4)
    assert d16["comm_bytes"]["a2a"]["out"] == 64 * k * h * 2
    forced = _run_json(capsys, ["gemm=fp8", "--json", "--ep", "2", "--tokens-per-rank", "64", "--bf16-dispatch"])
    assert forced["comm_bytes"]["a2a"] == d16["comm_bytes"]["a2a"]


def test_cli_text_table(capsys):
    assert P.main(["--model", "deepseek_v3_671b", "--counts", "21733,15004,17982,10817",
                   "--alignment", "128"]) == 0
    out = capsys.readouterr().out
    assert "88.08 MFLOP" in out
    line = next(l for l in out.splitlines() if l.startswith("aligned rows"))
    assert "65,792" in line and "+0.39 %" in line
    line = next(l for l in out.splitlines() if l.startswith("cf=1.0"))
    assert line.split()[1:6] == ["16,384", "65,536", "6,947", "6,947", "+10.60"]
    assert "515" in next(l for l in out.splitlines() if l.startswith("these counts"))


def test_cli_text_table_with_every_expert_empty(capsys):
    # no live rows: the ratios against them print "-" (this divided by zero once)
    assert P.main(["--counts", "0,0,0,0,0,0,0,0", "--alignment", "128"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert next(l for l in lines if l.startswith("live rows ")).split()[2] == "0"
    flops = lines[next(i for i, l in enumerate(lines) if l.startswith("Routed-expert FLOPs")):]
    assert next(l for l in flops if l.startswith("aligned rows ")).split()[-2:] == ["0.000", "-"]
    assert next(l for l in lines if l.startswith("ungrouped")).split()[-1] == "-"
    assert next(l for l in lines if l.startswith("capacity factor 1.0")).split()[-1] == "-"


def test_cli_bad_input_exits_with_the_fix(capsys):
    for argv, msg in [
        (["--model", "deepseek_v3_671b", "--ep", "3"], "pick an EP size from"),
        (["--model", "deepseek_v3_671b", "--counts", "1,2,3"], "one count per local expert"),
        (["--model", "deepseek_v3_671b", "--capacity-factor", "0"], "capacity_factor=0.0"),
        (["--model", "no_such_model"], "--model='no_such_model' is no model name: give one of"),
        (["--model", "/no/such/config.json"], "--model='/no/such/config.json' is no model name and no such file"),
        (["--model", "/tmp"], "--model='/tmp' is a directory, not a config.json"),
        (["--model", "deepseek_v3_671b", "--counts", "a,b"], "comma-separated integers"),
    ]:
        with pytest.raises(SystemExit) as exc:
            P.main(argv)
        assert exc.value.code == 2
        assert msg in capsys.readouterr().err


def test_cli_model_from_config_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(ModelArgs.deepseek_v3_671b().to_dict()))
    d = _run_json(capsys, ["--model", str(path), "--json", "--ep", "64", "--tokens-per-rank",
                           "8192", "--alignment", "128", "--counts", "21733,15004,17982,10817"])
    assert d["rows"]["aligned_rows"] == 65_792


def test_cli_model_file_that_is_no_config_json_names_the_file(tmp_path, capsys):
    # a binary file was a bare UnicodeDecodeError, a JSON list a TypeError traceback
    for name, data, why in [("bin.json", b"\x7fELF\x02\xd0\x00", "is not a JSON config.json (UnicodeDecodeError"),
                            ("bad.json", b"{bad", "is not a JSON config.json (JSONDecodeError"),
                            ("list.json", b"[1, 2]", "holds one JSON object of model fields, this one holds a list")]:
        f = tmp_path / name
        f.write_bytes(data)
        with pytest.raises(SystemExit) as exc:
            P.main(["--model", str(f)])
        err = capsys.readouterr().err
        assert exc.value.code == 2
        assert f"'{f}'" in err and why in err and "Traceback" not in err, err


@pytest.mark.skipif(importlib.util.find_spec("dropless.train.config") is None,
                    reason="dropless.train.config (Hydra compose) not written yet")
def test_cli_hydra_overrides(capsys):
    from dropless.train.config import compose, model_args

    cfg = compose([])
    args = model_args(cfg)
    E0 = args.n_routed_experts
    d = _run_json(capsys, ["--json", "--ep", "1", "--tokens-per-rank", "64"])
    assert d["rank"]["n_routed_experts"] == E0
    assert d["rank"]["hidden_size"] == args.hidden_size
    assert d["rows"]["routed_rows_mean"] == 64 * args.num_experts_per_tok
    d = _run_json(capsys, ["--json", "--ep", "1", "--tokens-per-rank", "64",
                           f"model.hidden_size={2 * args.hidden_size}"])
    assert d["rank"]["hidden_size"] == 2 * args.hidden_size


def test_saved_bytes_by_setting_at_the_reference_rank():
    """The reference rank (R = 65,792 aligned rows, H 7168, I 2048, bf16): the default keeps the
    landed rows, gate||up, SwiGLU and FC2 output (0.88 + 0.50 + 0.25 + 0.88 GiB); recompute_fc1
    with folded weights one copy of the rows; with recompute_gather nothing."""
    from dropless.plan import MEMORY_SETTINGS, saved_bytes

    R, H, I = 65_792, 7168, 2048
    got = {m: saved_bytes(R, H, I, m) for m in MEMORY_SETTINGS}
    assert got["default"] == R * (2 * H + 3 * I) * 2
    assert round(got["default"] / 2**30, 2) == 2.51  # = 0.88 + 0.50 + 0.25 + 0.88, the four large buffers
    assert got["recompute_fc1+fold"] == R * H * 2  # the landed rows, 0.88 GiB
    assert got["recompute_fc1+fold+gather"] == 0
    assert list(got.values()) == sorted(got.values(), reverse=True)
    with pytest.raises(ValueError, match="choose one of"):
        saved_bytes(R, H, I, "recompute_everything")


def test_cli_small_model_counts_in_a_unit_that_shows_them(capsys):
    # the CPU default (configs/model/tiny.yaml): 1.48 M parameters, not "0.00 B"
    from dropless.train.config import compose, model_args

    pc = P.param_counts(model_args(compose([])))
    assert P.main(["--ep", "1"]) == 0
    out = capsys.readouterr().out
    total = next(l for l in out.splitlines() if l.startswith("parameters, total"))
    active = next(l for l in out.splitlines() if l.startswith("parameters, activated"))
    assert total.split()[-2:] == [f"{pc.total / 1e6:.2f}", "M"] and "0.00" not in total, total
    assert active.split()[-2:] == [f"{pc.activated / 1e3:.2f}", "K"], active
    assert P.main(["--model", "deepseek_v3_671b"]) == 0
    total = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("parameters, total"))
    assert total.split()[-2:] == ["671.03", "B"], total


def test_cli_help_is_plain_text(capsys):
    with pytest.raises(SystemExit) as ei:
        P.main(["--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dropless-plan") and "--counts" in out
    for markup in ("``", ":func:", ":class:", ":mod:"):
        assert markup not in out, markup
