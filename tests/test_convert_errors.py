"""A Hugging Face checkpoint that does not fit the model: a clear error naming the field or the
tensor with both shapes, raised before any weight is written (the model is left unchanged)."""

from __future__ import annotations

import json
import re
import shlex

import pytest
import torch

from dropless.config import ConfigError, ModelArgs, Yarn
from dropless.convert import args_from_hf_config, load_hf, read_hf_config
from dropless.convert.hf_config import check_same_model, hf_config_from_args
from dropless.convert.start import init_from
from dropless.model import Transformer
from dropless.train.config import compose, model_args
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


# ----------------------------------------------------------------- YaRN however transformers spells it
def _yarn_spellings(settings: dict, theta: float) -> dict[str, dict]:
    """The same YaRN settings as config.json keys, spelt as each writer spells them."""
    floats = {k: float(v) for k, v in settings.items()}
    return {
        "type": {"rope_scaling": {"type": "yarn", **settings}},  # DeepSeek-V3's released file
        "rope_type": {"rope_scaling": {"rope_type": "yarn", **settings}},
        "both": {"rope_scaling": {"type": "yarn", "rope_type": "yarn", **floats}},  # transformers 4 re-saved
        "rope_parameters": {"rope_parameters": {"rope_type": "yarn", "rope_theta": theta, **floats}},  # 5
    }


V3_YARN_SETTINGS = dict(factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
                        mscale_all_dim=1.0)


def _respelt(cfg: dict, keys: dict) -> dict:
    out = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_parameters")}
    return {**out, **keys}


@pytest.mark.parametrize("spelling", list(_yarn_spellings(V3_YARN_SETTINGS, 1e4)))
def test_deepseek_v3_config_resaved_by_transformers_matches_model_deepseek_v3_671b(spelling):
    """DeepSeek-V3's config.json with its rope_scaling spelt as transformers 4 or 5 re-save it is the
    model of ``model=deepseek_v3_671b`` (the settings are compared, not the blocks)."""
    model = model_args(compose(["model=deepseek_v3_671b"]))
    cfg = _respelt(hf_config_from_args(ModelArgs.deepseek_v3_671b()),
                   _yarn_spellings(V3_YARN_SETTINGS, 10000.0)[spelling])
    ckpt, _ = args_from_hf_config(cfg)
    assert ckpt.yarn() == model.yarn() == Yarn(40.0, 4096, 32.0, 1.0, 1.0)
    check_same_model(model, ckpt, "config.json")
    # and on export the block is written as given: it reads back to the same settings
    assert args_from_hf_config(hf_config_from_args(ckpt))[0].yarn() == model.yarn()


@pytest.mark.parametrize("spelling", ["rope_type", "both", "rope_parameters"])
def test_load_hf_takes_a_yarn_checkpoint_spelt_another_way(hf_dir, tmp_path, spelling):
    """A checkpoint whose YaRN block is spelt otherwise than the model's loads (weights and all)."""
    settings = dict(factor=4, original_max_position_embeddings=32, beta_fast=32, beta_slow=1, mscale=0.707,
                    mscale_all_dim=0.707)
    ckpt_dir = _copy(hf_dir, tmp_path / spelling)
    cfg = read_hf_config(ckpt_dir)
    theta = args_from_hf_config(cfg)[0].rope_theta
    (ckpt_dir / "config.json").write_text(json.dumps(_respelt(cfg, _yarn_spellings(settings, theta)[spelling])))
    model = _model(hf_dir, rope_scaling={"type": "yarn", **settings})
    report = load_hf(model, ckpt_dir)
    assert report is not None and model.args.yarn() == args_from_hf_config(read_hf_config(ckpt_dir))[0].yarn()
    plain = _model(hf_dir)  # and a model without YaRN is refused, naming rope_scaling
    with pytest.raises(ConfigError, match="rope_scaling: model None, checkpoint Yarn"):
        load_hf(plain, ckpt_dir)


@pytest.mark.parametrize("spelling", list(_yarn_spellings(V3_YARN_SETTINGS, 1e4)))
@pytest.mark.parametrize("base", ["model=deepseek_v3_671b", "model=tiny"])
def test_the_suggested_overrides_build_the_checkpoints_model(hf_dir, spelling, base):
    """The overrides the mismatch message suggests, split as a shell splits them and composed on top of
    the model option the run used, give a model that matches the checkpoint: on a model with a YaRN
    block (merged into it) and on one without (assigned)."""
    cfg = read_hf_config(hf_dir)
    settings = dict(factor=8, original_max_position_embeddings=32, beta_fast=16, beta_slow=2, mscale=0.5,
                    mscale_all_dim=0.5)
    theta = args_from_hf_config(cfg)[0].rope_theta
    ckpt, _ = args_from_hf_config(_respelt(cfg, _yarn_spellings(settings, theta)[spelling]))
    model = model_args(compose([base]))
    with pytest.raises(ConfigError) as e:
        check_same_model(model, ckpt, "ckpt")
    msg = str(e.value)
    assert "rope_scaling: model" in msg
    fix = shlex.split(re.search(r"dropless-train overrides: (.*)\)$", msg).group(1))
    fixed = model_args(compose([base, *fix]))
    check_same_model(fixed, ckpt, "ckpt")
    assert fixed.yarn() == Yarn(8.0, 32, 16.0, 2.0, 0.5)


def test_the_suggested_override_removes_yarn_for_a_plain_checkpoint(hf_dir):
    """``model=deepseek_v3_671b`` (YaRN) against a checkpoint without YaRN: the suggested overrides
    (``model.rope_scaling=null`` among them) build the checkpoint's model."""
    plain = args_from_hf_config(read_hf_config(hf_dir))[0]
    with pytest.raises(ConfigError) as e:
        check_same_model(model_args(compose(["model=deepseek_v3_671b"])), plain, "ckpt")
    assert "model.rope_scaling=null" in str(e.value)
    fix = shlex.split(re.search(r"dropless-train overrides: (.*)\)$", str(e.value)).group(1))
    check_same_model(model_args(compose(["model=deepseek_v3_671b", *fix])), plain, "ckpt")


def test_yarn_kind_spelt_two_ways_must_agree():
    with pytest.raises(ConfigError, match="rope_scaling.*type='yarn' and rope_type='linear' differ"):
        ModelArgs.deepseek_v3_671b(rope_scaling={"type": "yarn", "rope_type": "linear", **V3_YARN_SETTINGS}).validate()
    assert ModelArgs(rope_scaling={"rope_type": "default"}).yarn() is None
    v3 = ModelArgs.deepseek_v3_671b().yarn()
    for keys in _yarn_spellings(V3_YARN_SETTINGS, 1e4).values():
        block = keys.get("rope_scaling") or {k: v for k, v in keys["rope_parameters"].items() if k != "rope_theta"}
        assert ModelArgs.deepseek_v3_671b(rope_scaling=block).yarn() == v3
