"""``dropless-convert`` and ``dropless-train init_from=``: Hugging Face -> DCP -> training ->
Hugging Face, checked against the files and against transformers' logits."""

from __future__ import annotations

import json

import pytest
import torch

from dropless.config import ModelArgs
from dropless.convert import args_from_hf_config, read_hf_config
from dropless.convert.cli import main, parse_size
from dropless.train.config import compose
from dropless.train.trainer import Trainer
from tests.hf_tiny import DeepseekV3ForCausalLM, make_hf_dir, read_all


def test_hf_to_dcp_to_hf_is_bitwise(tmp_path, capsys):
    src, dcp_dir, out = tmp_path / "src", tmp_path / "dcp", tmp_path / "out"
    make_hf_dir(src, mtp=1)
    (src / "tokenizer.json").write_text("{}")
    assert main(["hf-to-dcp", str(src), str(dcp_dir), "--set", "expert_alignment=8"]) == 0
    saved = ModelArgs.from_dict(json.loads((dcp_dir / "model_args.json").read_text()))
    assert saved.expert_alignment == 8 and saved.num_nextn_predict_layers == 1
    assert main(["dcp-to-hf", str(dcp_dir), str(out), "--max-shard-size", "50KB", "--copy-tokenizer", str(src)]) == 0
    a, b = read_all(src), read_all(out)
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 2 and (out / "tokenizer.json").is_file()
    mode = (out / "config.json").stat().st_mode & 0o777
    assert all(f.stat().st_mode & 0o777 == mode for f in out.glob("model-*.safetensors"))  # not safetensors' 0600
    assert args_from_hf_config(read_hf_config(out))[0] == saved
    assert "wrote" in capsys.readouterr().out


def test_bad_input_exits_2_with_a_message(tmp_path, capsys):
    assert main(["hf-to-dcp", str(tmp_path / "nope"), str(tmp_path / "dst")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["dcp-to-hf", str(tmp_path), str(tmp_path / "dst")]) == 2
    assert "not a complete DCP checkpoint" in capsys.readouterr().err
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("1000") == 1000
    src = tmp_path / "src"
    make_hf_dir(src)
    for bad, field in (("hidden_size=abc", "hidden_size='abc': must be an integer"),
                       ("norm_topk_prob=3", "norm_topk_prob=3: must be true or false"),
                       ("routed_scaling_factor=fast", "routed_scaling_factor='fast': must be a number")):
        assert main(["hf-to-dcp", str(src), str(tmp_path / "dst"), "--set", bad]) == 2
        err = capsys.readouterr().err
        assert field in err and "Traceback" not in err, err


def _model_overrides(args: ModelArgs) -> list[str]:
    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "first_k_dense_replace", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
            "n_group", "topk_group", "routed_scaling_factor", "max_position_embeddings", "num_nextn_predict_layers")
    return [f"model.{k}={getattr(args, k)}" for k in keys]


def test_train_init_from_hf_then_export_the_run(tmp_path, capsys):
    src = tmp_path / "src"
    hf, _ = make_hf_dir(src, vocab_size=256)
    args, _ = args_from_hf_config(read_hf_config(src))
    base = ["train.micro_batch_size=2", "train.seq_len=16", "train.val_batches=1", "train.val_every=0",
            "logging.progress=false", "logging.mode=disabled", "num_threads=1", "optim.warmup_steps=1",
            *_model_overrides(args)]
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))

    tr = Trainer(compose(base + [f"run_dir={tmp_path / 'a'}", "train.steps=1", f"init_from={src}"]))
    try:
        assert f"[dropless] init_from: model weights loaded from {src}" in capsys.readouterr().out
        tr.model.eval()
        with torch.no_grad():                          # the run starts from the Hugging Face weights
            torch.testing.assert_close(tr.model(tokens), hf(tokens).logits, rtol=0, atol=2e-5)
        tr.model.train()
        tr.train()
        tr.model.eval()
        with torch.no_grad():
            trained = tr.model(tokens)
    finally:
        tr.close()
    assert (trained - hf(tokens).logits).abs().max() > 1e-4    # one optimizer step changed the weights

    step = tmp_path / "a" / "checkpoints" / "step_00000001"
    out = tmp_path / "exported"
    assert main(["dcp-to-hf", str(step), str(out)]) == 0       # the model config comes from the run's config.yaml
    back = DeepseekV3ForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, trained, rtol=0, atol=2e-5)
    capsys.readouterr()
    out_run = tmp_path / "exported_from_the_run"                # the run directory: its newest checkpoint
    assert main(["dcp-to-hf", str(tmp_path / "a"), str(out_run)]) == 0
    said = capsys.readouterr().out
    assert "run directory" in said and "step_00000001" in said  # which checkpoint of the run it read
    for f in sorted(out.glob("*.safetensors")):
        assert (out_run / f.name).read_bytes() == f.read_bytes()

    # resume=true with a checkpoint in run_dir continues the run: init_from is not applied again
    again = Trainer(compose(base + [f"run_dir={tmp_path / 'a'}", "resume=true", "train.steps=1", f"init_from={src}"]))
    try:
        assert "init_from: model weights loaded" not in capsys.readouterr().out  # the checkpoint wins
        again.model.eval()
        with torch.no_grad():
            torch.testing.assert_close(again.model(tokens), trained, rtol=0, atol=0)
    finally:
        again.close()

    # a mismatched model is refused before training, naming the fields and the overrides that fit
    from dropless.config import ConfigError

    with pytest.raises(ConfigError, match=r"hidden_size: model 64, checkpoint 32.*model\.hidden_size=32"):
        Trainer(compose(base + [f"run_dir={tmp_path / 'b'}", "model.hidden_size=64", f"init_from={src}"]))
