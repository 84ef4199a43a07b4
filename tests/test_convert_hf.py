"""Hugging Face DeepSeek-V3 import/export against transformers' own model (fp32, CPU).

A tiny ``DeepseekV3ForCausalLM`` with random weights (router bias non-zero, group-limited
routing: 8 experts in 4 groups keeping 2, top-2) is the reference: importing it gives the
same logits; exporting a dropless model gives a directory transformers loads with the same
logits; import -> export returns the files' tensors bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dropless.config import ModelArgs
from dropless.convert import (
    StateDictSource,
    args_from_hf_config,
    export_hf,
    hf_config_from_args,
    hf_import,
    load_hf,
    read_hf_config,
)
from dropless.model import Transformer
from tests.hf_tiny import DeepseekV3ForCausalLM, hf_mtp_reference, make_hf_dir, read_all

TOL = dict(rtol=0, atol=2e-5)


def _tokens(seed=1, shape=(2, 12), vocab=64):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _imported(path: Path) -> Transformer:
    args, _ = args_from_hf_config(read_hf_config(path))
    model = Transformer(args)
    model.init_weights(seed=123)  # replaced by the import
    load_hf(model, path)
    return model.eval()


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "no_q_lora"])
def test_import_gives_transformers_logits(tmp_path, q_lora_rank):
    hf, _ = make_hf_dir(tmp_path, q_lora_rank=q_lora_rank, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()          # several shards
    model = _imported(tmp_path)
    assert model.args.q_lora_rank == (q_lora_rank or 0)
    bias = model.layers["1"].moe.router.e_score_correction_bias
    assert bias.abs().min() > 0                                          # the bias came along, non-zero
    tokens = _tokens()
    with torch.no_grad():
        ref, ours = hf(tokens).logits, model(tokens)
    assert ref.abs().max() > 0.5
    torch.testing.assert_close(ours, ref, **TOL)
    # group-limited routing is active: some token's top-k would change without the group mask
    with torch.no_grad():
        h = hf.model.embed_tokens(tokens).flatten(0, 1)
        gate = hf.model.layers[1].mlp.gate
        s = torch.sigmoid(h @ gate.weight.T) + gate.e_score_correction_bias
        free = s.topk(2, dim=-1).indices
        _, _, grouped = gate(h)
    assert (free.sort(-1).values != grouped.sort(-1).values).any()


def test_rope_interleave_false_rows_are_permuted(tmp_path, monkeypatch):
    """transformers with rope_interleave=false pairs rope features (j, j + Dr/2); the import
    permutes those rows into dropless's interleaved pairs. Without the permutation the logits
    differ, so the check is not vacuous."""
    hf, _ = make_hf_dir(tmp_path, rope_interleave=False)
    tokens = _tokens()
    with torch.no_grad():
        ref = hf(tokens).logits
        torch.testing.assert_close(_imported(tmp_path)(tokens), ref, **TOL)
        monkeypatch.setattr(hf_import, "rope_row_permutation", lambda t, args: None)
        assert (_imported(tmp_path)(tokens) - ref).abs().max() > 1e-3


def _dropless_model(**over) -> Transformer:
    args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                     num_hidden_layers=3, num_attention_heads=2, q_lora_rank=24, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8,
                     num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                     max_position_embeddings=128, initializer_range=0.1, expert_alignment=8, seed=5, **over)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(9)
        for moe in model.moe_layers():
            moe.router.e_score_correction_bias.copy_(0.05 * torch.randn(8, generator=gen))
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def test_export_loads_in_transformers_with_our_logits(tmp_path):
    model = _dropless_model()
    dst = export_hf(model.state_dict(), model.args, tmp_path / "hf", max_shard_bytes=60_000)
    files = sorted(p.name for p in dst.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert "model.safetensors.index.json" in files and "config.json" in files
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]                 # no temporary directory left
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in read_all(dst).values())

    hf = DeepseekV3ForCausalLM.from_pretrained(str(dst)).eval()
    tokens = _tokens(seed=3)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), **TOL)
    # config.json round trip is exact, dropless's own fields included
    assert args_from_hf_config(json.loads((dst / "config.json").read_text()))[0] == model.args


def test_config_round_trip_exact():
    for args in (ModelArgs(), ModelArgs.deepseek_v3_671b(num_nextn_predict_layers=1),
                 ModelArgs(q_lora_rank=16, recompute_fc1=True, capacity_factor=1.25, mtp_loss_weight=0.1)):
        cfg = json.loads(json.dumps(hf_config_from_args(args)))
        assert args_from_hf_config(cfg)[0] == args
        assert cfg["q_lora_rank"] == (args.q_lora_rank or None) and cfg["model_type"] == "deepseek_v3"


def test_round_trip_is_bitwise(tmp_path):
    src = tmp_path / "src"
    make_hf_dir(src, mtp=1)
    model = _imported(src)
    out = export_hf(model.state_dict(), model.args, tmp_path / "out")
    a, b = read_all(src), read_all(out)
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    # and dropless -> Hugging Face -> dropless keeps every tensor (MTP included)
    ours = _dropless_model(num_nextn_predict_layers=2)
    back = _imported(export_hf(ours.state_dict(), ours.args, tmp_path / "again"))
    sd = back.state_dict()
    for name, t in ours.state_dict().items():
        if name.endswith("tokens_per_expert"):
            continue
        assert torch.equal(sd[name], t), name


def test_mtp_layers_import_and_match_transformers_modules(tmp_path):
    hf, mods = make_hf_dir(tmp_path, mtp=2)
    model = _imported(tmp_path)
    assert model.args.num_nextn_predict_layers == 2 and len(model.mtp.layers) == 2
    assert [b.layer_id for b in model.mtp.blocks()] == [3, 4] and all(b.moe_enabled for b in model.mtp.blocks())
    tokens = _tokens(seed=4, shape=(2, 10))
    labels = _tokens(seed=5, shape=(2, 10))
    ref = hf_mtp_reference(hf, mods, tokens, labels)
    captured = {}
    model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("h", o))
    with torch.no_grad():
        model(tokens)
        cos, sin = _rope(model, 10)
        _, per_depth = model.mtp(captured["h"], tokens, labels, model.tok_embeddings,
                                    lambda hn, y: torch.nn.functional.cross_entropy(
                                        model.output(hn).flatten(0, 1), y.reshape(-1)), cos, sin)
        total = model.mtp_loss(captured["h"], tokens, labels)
    assert len(per_depth) == len(ref) == 2
    for got, want in zip(per_depth, ref):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert ref[0] > 1.0
    torch.testing.assert_close(total, model.args.mtp_loss_weight / 2 * (ref[0] + ref[1]), rtol=0, atol=1e-5)


def _rope(model, S):
    from dropless.model.rope import rope_cos_sin

    return rope_cos_sin(S, model.args.qk_rope_head_dim, model.args.rope_theta)


def test_interrupted_export_leaves_nothing(tmp_path):
    model = _dropless_model()

    class Failing(StateDictSource):
        n = 0

        def get(self, key):
            self.n += 1
            if self.n == 20:
                raise RuntimeError("disk full")
            return super().get(key)

    with pytest.raises(RuntimeError, match="disk full"):
        export_hf(Failing(model.state_dict()), model.args, tmp_path / "hf", max_shard_bytes=30_000)
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_an_ep_slice_and_a_nonempty_target(tmp_path):
    model = _dropless_model()
    sd = dict(model.state_dict())
    sd["layers.1.moe.experts.w13"] = sd["layers.1.moe.experts.w13"][:4]
    from dropless.config import ConfigError

    with pytest.raises(ConfigError, match=r"layers\.1\.moe\.experts\.w13: source \[4, 32, 32\], config expects "
                                          r"\[8, 32, 32\]"):
        export_hf(sd, model.args, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConfigError, match="not empty"):
        export_hf(model.state_dict(), model.args, tmp_path / "full")
    bad = dataclasses.replace(model.args, moe_layer_freq=2)
    with pytest.raises(ConfigError, match="moe_layer_freq"):
        export_hf(model.state_dict(), bad, tmp_path / "hf2")


def test_published_config_and_its_tensor_list():
    """The released DeepSeek-V3 config.json: the 671B shape with its MTP layer, FP8 128×128
    blocks, the interleaved rope layout, and 46,183 weight tensors (no scales) in the format."""
    from dropless.convert import hf_tensors

    cfg = read_hf_config(Path(__file__).parent / "data" / "deepseek_v3_config.json")
    import warnings

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        args, fmt = args_from_hf_config(cfg)
    want = ModelArgs.deepseek_v3_671b(num_nextn_predict_layers=1)
    for f in dataclasses.fields(ModelArgs):
        if f.name != "rope_scaling":
            assert getattr(args, f.name) == getattr(want, f.name), f.name
    assert fmt.fp8_block == (128, 128) and fmt.rope_interleave
    names = hf_tensors(args)
    moe_layer, dense_layer = 2 + 7 + 2 + 3 + 3 * 256, 2 + 7 + 3
    assert len(names) == 3 * dense_layer + 58 * moe_layer + 3 + (moe_layer + 6)
    assert len({t.name for t in names}) == len(names)
    assert names[-3].name == "model.layers.61.shared_head.head.weight" and names[-3].kind == "shared"
