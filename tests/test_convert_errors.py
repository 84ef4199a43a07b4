"""A Hugging Face checkpoint that does not fit the model: a clear error naming the field or the
tensor with both shapes, raised before any weight is written (the model is left unchanged)."""

from __future__ import annotations

import json

import pytest
import torch

from dropless.config import ConfigError
from dropless.convert import args_from_hf_config, load_hf, read_hf_config
from dropless.convert.start import init_from
from dropless.model import Transformer
from tests.hf_tiny import _add_shard, make_hf_dir, read_all


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    make_hf_dir(path, max_shard_size="40KB")
    return path


def _model(path, **over):
    args, _ = args_from_hf_config(read_hf_config(path), **over)
    m = Transformer(args)
    m.init_weights(seed=7)
    return m


def _unchanged(model, before):
    return all(torch.equal(t, before[k]) for k, t in model.state_dict().items())


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_mismatched_config_names_fields_and_fix(hf_dir):
    model = _model(hf_dir)
    args = model.args
    wrong = Transformer(type(args)(**{**args.to_dict(), "hidden_size": 64, "n_routed_experts": 16, "n_group": 4}))
    wrong.init_weights(seed=1)
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with pytest.raises(ConfigError) as e:
        load_hf(wrong, hf_dir)
    msg = str(e.value)
    assert "hidden_size: model 64, checkpoint 32" in msg and "n_routed_experts: model 16, checkpoint 8" in msg
    assert "model.hidden_size=32" in msg and "model.n_routed_experts=8" in msg
    assert _unchanged(wrong, before)


def test_missing_unexpected_and_wrong_shape_tensors(hf_dir, tmp_path):
    base = read_all(hf_dir)
    model = _model(hf_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    # missing: drop one expert's up_proj from the index
    miss = _copy(hf_dir, tmp_path / "missing")
    idx = json.loads((miss / "model.safetensors.index.json").read_text())
    del idx["weight_map"]["model.layers.2.mlp.experts.5.up_proj.weight"]
    (miss / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(ConfigError, match=r"missing tensors: model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight "
                                          r"\(expected shape \[16, 32\]\)"):
        load_hf(model, miss)
    assert _unchanged(model, before)

    # unexpected: one tensor more
    extra = _copy(hf_dir, tmp_path / "extra")
    _add_shard(extra, "model-extra.safetensors", {"model.layers.1.mlp.experts.8.up_proj.weight": torch.zeros(16, 32)})
    with pytest.raises(ConfigError, match=r"unexpected tensors: model\.layers\.1\.mlp\.experts\.8\.up_proj\.weight "
                                          r"\(shape \[16, 32\]\)"):
        load_hf(model, extra)
    assert _unchanged(model, before)

    # wrong shape: o_proj of layer 0 replaced in a shard of its own
    bad = _copy(hf_dir, tmp_path / "shape")
    _add_shard(bad, "model-bad.safetensors", {"model.layers.0.self_attn.o_proj.weight": torch.zeros(32, 8)})
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight: checkpoint \[32, 8\], "
                                          r"model expects \[32, 16\]"):
        load_hf(model, bad)
    assert _unchanged(model, before)
    assert base  # the fixture's files are intact


def test_not_a_deepseek_v3_and_bad_paths(hf_dir, tmp_path):
    cfg = read_hf_config(hf_dir)
    for key, value, words in (("model_type", "llama", "model_type='llama'"),
                              ("hidden_act", "gelu", "hidden_act='gelu'"),
                              ("num_key_value_heads", 1, "num_key_value_heads=1")):
        with pytest.raises(ConfigError, match=words):
            args_from_hf_config({**cfg, key: value})
    with pytest.raises(ConfigError, match="not a Hugging Face model directory"):
        init_from(_model(hf_dir), tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_hf_config(tmp_path)


def test_rope_scaling_is_carried_into_model_args(hf_dir):
    """transformers-5 ``rope_parameters`` (YaRN) become ``ModelArgs.rope_scaling`` (applied: tests/test_yarn.py)."""
    cfg = read_hf_config(hf_dir)
    cfg = {**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                      "original_max_position_embeddings": cfg["max_position_embeddings"] // 4}}
    args, _ = args_from_hf_config(cfg)
    assert args.rope_scaling["factor"] == 4.0 and args.yarn() is not None


def test_a_model_parameter_the_format_does_not_map_is_an_error(hf_dir):
    model = _model(hf_dir)
    model.layers["0"].extra_scale = torch.nn.Parameter(torch.ones(3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"no tensor for the model's layers\.0\.extra_scale"):
        load_hf(model, hf_dir)
    assert _unchanged(model, before)
