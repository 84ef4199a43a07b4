"""Hydra configs and recipes: composition, overrides, strict keys, the mesh check, the LR schedule."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from omegaconf import OmegaConf

from dropless.config import ConfigError, ModelArgs
from dropless.layout import aligned_capacity
from dropless.train.config import compose, config_dir, list_recipes, model_args
from dropless.train.dist import default_num_threads, mesh_shape, resolve_ep_size
from dropless.train.optim import lr_at
from dropless.train.schema import DispatcherConfig
from dropless.train.startup import alignment_note, check_train_config, chunk_rows

V3_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
             "first_k_dense_replace", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
             "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
             "n_group", "topk_group", "routed_scaling_factor", "scoring_func", "norm_topk_prob", "topk_method",
             "max_position_embeddings")


def test_default_config_and_cpu_recipe_agree():
    cfg = compose()
    rec = compose(["recipe=cpu_default"])
    assert rec.recipe == "cpu_default" and cfg.recipe is None
    a, b = OmegaConf.to_container(cfg, resolve=True), OmegaConf.to_container(rec, resolve=True)
    a.pop("recipe"), b.pop("recipe")
    assert a == b
    args = model_args(cfg)
    assert args.num_moe_layers >= 1 and args.n_routed_experts == 8 and args.num_experts_per_tok == 2
    assert args.vocab_size == 256 and cfg.data.kind == "text" and cfg.dispatcher.name == "local"
    assert cfg.logging.mode == "offline" and cfg.run_dir is None and cfg.resume is False


def test_every_model_field_is_in_every_model_config():
    names = {f.name for f in dataclasses.fields(ModelArgs)}
    for m in ("tiny", "h200_single", "deepseek_v3_671b"):
        cfg = compose([f"model={m}"])
        assert set(cfg.model.keys()) == names, m
        model_args(cfg)  # validates


def test_overrides_reach_the_model_and_groups():
    cfg = compose(["model.hidden_size=96", "train.steps=7", "dispatcher=a2a", "gemm=loop", "seed=5",
                   "optim.lr=0.01", "data=bin", "data.path=/x.bin", "data.vocab_size=300"])
    args = model_args(cfg)
    assert args.hidden_size == 96 and args.gemm == "loop" and args.seed == 5
    assert cfg.train.steps == 7 and cfg.dispatcher.name == "a2a" and cfg.dispatcher.ep_size is None
    assert cfg.optim.lr == 0.01 and cfg.data.kind == "bin"


def test_recipes():
    assert {"cpu_default", "h200_single", "deepseek_v3_671b"} <= set(list_recipes())
    v3 = compose(["recipe=deepseek_v3_671b"])
    args = model_args(v3)
    ref = ModelArgs.deepseek_v3_671b()
    for f in V3_FIELDS:
        assert getattr(args, f) == getattr(ref, f), f
    assert v3.dispatcher.name == "a2a" and v3.dispatcher.ep_size == 64 and v3.data.kind == "bin"
    assert v3.train.dtype == "bf16" and v3.train.activation_checkpointing is True
    h = compose(["recipe=h200_single", "train.steps=50"])      # the command line wins over the recipe
    assert h.train.steps == 50 and h.recipe == "h200_single" and h.train.dtype == "bf16"
    from dropless.plan import param_counts
    pc = param_counts(model_args(h))
    assert 1e9 <= pc.total <= 3e9, pc.total
    ha = model_args(h)
    assert ha.n_routed_experts == 64 and ha.num_experts_per_tok == 6 and ha.first_k_dense_replace >= 1


@pytest.mark.parametrize("override, match", [
    ("foo=1", "Could not override 'foo'"),
    ("train.stepz=3", "train.stepz"),
    ("model.hidden_sise=3", "model.hidden_sise"),
    ("+model.foo=1", "add new keys"),
    ("+foo=1", "add new keys"),
    ("model.hidden_size=abc", "could not be converted to Integer"),
    ("dispatcher=nope", "dispatcher/nope"),
    ("recipe=nope", r"Available options in 'recipes':\n\tcpu_default\n(\t\w+\n)*\(the options are the .yaml files "
                    r"in .*recipes/\)$"),
])
def test_unknown_keys_and_bad_values_are_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        compose([override])


def test_model_args_is_strict():
    cfg = OmegaConf.create({"model": {**dataclasses.asdict(ModelArgs()), "hiden_size": 3}})
    with pytest.raises(ConfigError, match="hiden_size"):
        model_args(cfg)
    with pytest.raises(ConfigError, match="n_group"):
        model_args(compose(["model.n_group=3"]))          # 8 experts in 3 groups


def test_cli_reports_config_errors(capsys):
    from dropless.train.__main__ import main

    assert main(["foo=1"]) == 2
    assert "Could not override 'foo'" in capsys.readouterr().err
    assert main(["--cfg", "train.steps=3"]) == 0
    assert "steps: 3" in capsys.readouterr().out
    assert main(["--cfg", "job", "train.steps=4"]) == 0  # Hydra's spelling
    assert "steps: 4" in capsys.readouterr().out
    assert main(["--cfg=job", "train.steps=5"]) == 0  # argparse's spelling of the same
    assert "steps: 5" in capsys.readouterr().out
    assert main(["--cfg=jobs", "train.steps=5"]) == 2  # a typo is named, not a Hydra grammar error
    assert capsys.readouterr().err.startswith("dropless-train: --cfg jobs: ")
    assert main(["--cfg", "hydra"]) == 2 and "no hydra: section" in capsys.readouterr().err
    # --cfg runs the config-alone checks before it prints
    assert main(["--cfg", "optim.eps=-1"]) == 2
    out, err = capsys.readouterr()
    assert "optim.eps" in err and "steps:" not in out


def test_train_config_checks():
    for ov in ("train.steps=0", "optim.min_lr_ratio=2", "train.dtype=fp16", "logging.mode=loud", "data.vocab_size=300"):
        field = ov.split("=")[0]
        with pytest.raises(ConfigError, match=rf"^{re.escape(field)}="):  # the error names the field first
            check_train_config(compose([ov]))


def test_a_value_left_missing_is_a_config_error_naming_it(capsys):
    """A ``???`` left in the composed config (a group's required field, or one set so on the command
    line) is a ConfigError naming the field, and dropless-train exits 2 (not omegaconf's traceback)."""
    from dropless.train.__main__ import main
    for ov in ("train.steps=???", "optim.lr=???"):
        field = ov.split("=")[0]
        with pytest.raises(ConfigError, match=rf"^{re.escape(field)}: required"):
            check_train_config(compose([ov]))
    assert main(["--cfg", "train.seq_len=???"]) == 2 and "train.seq_len" in capsys.readouterr().err


def test_cuda_graph_config_errors(tmp_path):
    """train.cuda_graph refuses what a captured forward/backward cannot hold, before any step."""
    from dropless.train.trainer import Trainer
    for ov, other in ((["dispatcher=a2a"], "dispatcher=a2a"), (["dispatcher=fsdp"], "dispatcher=fsdp"),
                      (["train.shard_dense=true"], "train.shard_dense"), (["gemm=loop"], "model.gemm=loop"),
                      (["gemm=fp8"], "model.gemm=fp8"), (["model.gemm=loop"], "model.gemm=loop")):
        # (train.loss_impl=liger: refused by resolve_loss_impl, tests/test_loss.py)
        # the field, then the one it conflicts with
        with pytest.raises(ConfigError, match=rf"^train\.cuda_graph=true: .*{re.escape(other)}"):
            check_train_config(compose(["train.cuda_graph=true", *ov]))
    check_train_config(compose(["train.cuda_graph=true"]))  # local dispatcher: accepted from the config alone
    with pytest.raises(ConfigError, match=r"^train\.cuda_graph=true: ") as err:  # every setting at fault, at once
        check_train_config(compose(["train.cuda_graph=true", "dispatcher=a2a", "gemm=loop", "train.shard_dense=true"]))
    assert all(f in str(err.value) for f in ("dispatcher=a2a", "model.gemm=loop", "train.shard_dense"))
    with pytest.raises(ConfigError, match=r"^train\.cuda_graph=true: .*device"):
        Trainer(compose(["train.cuda_graph=true", "device=cpu", f"run_dir={tmp_path / 'run'}",
                         "logging.mode=disabled"]))
    assert not (tmp_path / "run").exists()  # refused before the run dir is made


def _alignment_note(args, tokens, ep_size=1):
    """The alignment note as start_up composes it: the chunk's rows, the layout's capacity, the judgement."""
    rows, local = chunk_rows(args, tokens, ep_size)
    return alignment_note(args.expert_alignment, local, rows, aligned_capacity(rows, local, args.expert_alignment))


def test_alignment_note_warns_when_padding_outgrows_the_routed_rows():
    """A huge model.expert_alignment is valid but pads each expert's segment far beyond its rows (a user saw
    the CPU recipe run 4x slower at A = 100000): the note names the alignment and both row counts; the
    recipes' own settings give none."""
    for recipe in list_recipes():
        cfg = compose([f"recipe={recipe}"])
        ep = cfg.dispatcher.get("ep_size") or 1
        assert _alignment_note(model_args(cfg), cfg.train.micro_batch_size * cfg.train.seq_len, ep) is None, recipe
    args = model_args(compose(["model.expert_alignment=100000"]))
    cfg = compose([])
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len
    note = _alignment_note(args, tokens)
    rows = tokens * args.num_experts_per_tok
    assert chunk_rows(args, tokens) == (rows, args.n_routed_experts)
    pad = (args.n_routed_experts - 1) * 99999  # the layout's capacity bound: the last segment is not padded
    assert note is not None and "model.expert_alignment=100000" in note and f"{pad:,}" in note and f"{rows:,}" in note
    # the bound is per chunk and per rank's local experts
    a = dataclasses.replace(args, expert_alignment=rows // args.n_routed_experts + 1)
    assert _alignment_note(a, tokens) is None
    assert _alignment_note(dataclasses.replace(a, num_token_chunks=2), tokens) is not None
    assert _alignment_note(dataclasses.replace(a, num_token_chunks=2), tokens, ep_size=2) is None
    assert chunk_rows(dataclasses.replace(a, num_token_chunks=2), tokens, ep_size=2) == (rows // 2,
                                                                                          args.n_routed_experts // 2)


def test_mesh_checks(monkeypatch):
    assert resolve_ep_size(DispatcherConfig("a2a", None), 4) == 4
    assert resolve_ep_size(DispatcherConfig("local", None), 4) == 1
    assert resolve_ep_size(DispatcherConfig("a2a", 2), 4) == 2
    for name, ep in (("fsdp", 2), ("local", 4)):  # they keep every expert on every rank
        with pytest.raises(ConfigError, match=rf"^dispatcher={name} .*dispatcher\.ep_size=1"):
            check_train_config(compose([f"dispatcher={name}", f"dispatcher.ep_size={ep}"]))
    for bad in ("0", "-2"):
        with pytest.raises(ConfigError, match=rf"^dispatcher\.ep_size={bad}:"):
            check_train_config(compose(["dispatcher=a2a", f"dispatcher.ep_size={bad}"]))
    with pytest.raises(ConfigError, match=r"^dispatcher\.name='nope': .*a2a"):  # lists the known names
        check_train_config(compose(["dispatcher.name=nope"]))
    cfg = DispatcherConfig("a2a", 2)
    assert mesh_shape(cfg, 8, 8) == (2, 4)
    with pytest.raises(ConfigError, match="world size 6 does not fit the mesh"):
        mesh_shape(DispatcherConfig("a2a", 4), 6, 8)
    with pytest.raises(ConfigError, match="does not divide model.n_routed_experts=8"):
        mesh_shape(DispatcherConfig("a2a", 3), 6, 8)
    # under torchrun with 3 processes and ep_size=2: a clear error from the config alone, before any process group
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    import torch.distributed as dist
    with pytest.raises(ConfigError, match="world size 3 does not fit"):
        check_train_config(compose(["dispatcher=a2a", "dispatcher.ep_size=2", "model.n_routed_experts=8"]))
    # ep_size left null: EP is the world size, which the message says (the user never wrote ep_size=3),
    # with the sizes that fit (dividing 3 and 8) and the process counts that would
    with pytest.raises(ConfigError, match=r"^dispatcher\.ep_size is null, .*EP = 3") as e:
        check_train_config(compose(["dispatcher=a2a", "model.n_routed_experts=8"]))
    assert "model.n_routed_experts=8" in str(e.value) and "[1]" in str(e.value) and "[1, 2, 4, 8]" in str(e.value)
    assert not dist.is_initialized()


def test_lr_schedule_values():
    o = OmegaConf.create({"lr": 1e-3, "warmup_steps": 10, "min_lr_ratio": 0.1})
    total = 110
    assert lr_at(0, o, total) == pytest.approx(1e-4)            # (0+1)/10 of lr
    assert lr_at(4, o, total) == pytest.approx(5e-4)
    assert lr_at(9, o, total) == pytest.approx(1e-3)            # warmup ends at the peak
    assert lr_at(10, o, total) == pytest.approx(1e-3)           # cosine starts at the peak
    # halfway through the cosine (step 10 + 99/2): the mean of peak and floor
    assert lr_at(10 + 99 / 2, o, total) == pytest.approx((1e-3 + 1e-4) / 2)
    p = (60 - 10) / 99
    assert lr_at(60, o, total) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * p)))
    assert lr_at(109, o, total) == pytest.approx(1e-4)          # the last step sits on the floor
    lrs = [lr_at(s, o, total) for s in range(10, total)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))           # monotone decay
    no_warm = OmegaConf.create({"lr": 2.0, "warmup_steps": 0, "min_lr_ratio": 0.0})
    assert lr_at(0, no_warm, 5) == pytest.approx(2.0) and lr_at(4, no_warm, 5) == pytest.approx(0.0)


def test_default_threads_share_the_cores():
    import os
    cores = len(os.sched_getaffinity(0))
    assert default_num_threads(1) == cores
    assert default_num_threads(2) == max(1, cores // 2)
    assert default_num_threads(cores * 4) == 1


# --------------------------------------------------------------------------- typed schemas (issue 11 items 12-13)
@pytest.mark.parametrize("override,field", [
    ("train.steps=abc", "train.steps"), ("train.shard_dense=maybe", "train.shard_dense"),
    ("train.dist_timeout_s=soon", "train.dist_timeout_s"), ("optim.lr=abc", "optim.lr"),
    ("optim.betas=0.9", "optim.betas"), ("optim.grad_clip=big", "optim.grad_clip"), ("seed=abc", "seed"),
    ("num_threads=abc", "num_threads"), ("resume=perhaps", "resume"), ("data.vocab_size=many", "data.vocab_size"),
    ("logging.log_every=often", "logging.log_every"), ("dispatcher.ep_size=two", "dispatcher.ep_size"),
])
def test_wrong_type_is_a_composition_error_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=f"full_key: {field}\\b"):
        compose([override])


@pytest.mark.parametrize("override,field", [("train.steps=abc", "train.steps"), ("optim.betas=0.9", "optim.betas"),
                                            ("seed=abc", "seed"), ("num_threads=-1", "num_threads=-1"),
                                            ("num_threads=0", "num_threads=0"),
                                            ("optim.eps=-1", "optim.eps"),
                                            ("optim.weight_decay=-5", "optim.weight_decay"),
                                            ("logging.cpu_peak_flops=0", "logging.cpu_peak_flops"),
                                            ("train.dist_timeout_s=-5", "train.dist_timeout_s"),
                                            ("train.ckpt_threads=0", "train.ckpt_threads=0: must lie in [1, 64]"),
                                            ("train.ckpt_threads=1000", "train.ckpt_threads=1000: must lie in [1, 64]"),
                                            # inf/nan pass a range check: lr=inf trained NaN, eps=inf nothing
                                            ("optim.lr=inf", "optim.lr=inf: must be a finite"),
                                            ("optim.lr=nan", "optim.lr=nan: must be a finite"),
                                            ("optim.eps=inf", "optim.eps=inf: must be a finite"),
                                            ("optim.weight_decay=inf", "optim.weight_decay=inf: must be a finite"),
                                            # finite in fp64 but inf in the optimizer's fp32 arithmetic
                                            ("optim.lr=1e39", "optim.lr=1e+39: must be a finite number within "
                                             "float32's range"),
                                            ("train.dist_timeout_s=inf", "train.dist_timeout_s=inf"),
                                            # numpy's generator (the data order) refused it mid-start-up
                                            ("seed=-1", "seed=-1: must be an integer in [0, 2^63)"),
                                            # the model's own checks and seq_len, from the config alone
                                            ("model.n_routed_experts=7", "model.n_group=4"),
                                            ("model.hidden_size=-8", "model.hidden_size"),
                                            ("train.seq_len=100000", "model.max_position_embeddings")])
def test_cli_bad_value_exits_2_before_the_config_is_printed(capsys, override, field):
    from dropless.train.__main__ import main

    assert main([override, "train.steps=1"] if "steps" not in override else [override]) == 2
    out, err = capsys.readouterr()
    assert "resolved config" not in out and field in err and "Traceback" not in err, (out, err)


def test_every_group_option_and_recipe_fits_its_schema():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    for group in ("model", "dispatcher", "gemm", "optim", "data", "logging"):
        for f in sorted((root / group).glob("*.yaml")):
            cfg = compose([f"{group}={f.stem}"])
            assert OmegaConf.is_config(cfg[group]), (group, f.stem)
    for name in list_recipes():
        compose([f"recipe={name}"])
    cfg = compose(["data=bin", "data.path=/data/train.bin", "data.vocab_size=50257", "optim.betas=[0.8,0.9]"])
    assert cfg.data.vocab_size == 50257 and list(cfg.optim.betas) == [0.8, 0.9]
    assert isinstance(compose(["train.dist_timeout_s=5"]).train.dist_timeout_s, float)


def test_misspelled_key_gets_one_hint_the_closest_key(capsys):
    from dropless.train.__main__ import main

    assert main(["train.step=5"]) == 2
    err = capsys.readouterr().err
    assert "did you mean train.steps=5?" in err and "+train.step" not in err, err
    assert main(["optim.weight_decy=0"]) == 2
    err = capsys.readouterr().err
    assert "did you mean optim.weight_decay=0?" in err and "To append" not in err, err


@pytest.mark.parametrize("overrides,hint", [
    (["data.dtype=uint16"], "'data.dtype' is a key of data=bin only, not of this run's data option: choose data=bin"),
    (["data=bin", "data.glob=*.txt"], "'data.glob' is a key of data=stdlib only, not of this run's data option: "
                                      "choose data=stdlib"),
])
def test_a_key_of_another_option_of_its_group_names_that_option(capsys, overrides, hint):
    # the closest key of the default config was train.dtype for data.dtype, and data.glob itself for data.glob
    from dropless.train.__main__ import main

    assert main(overrides) == 2
    err = capsys.readouterr().err
    assert hint in err and "did you mean" not in err, err


@pytest.mark.parametrize("override,field", [("model.hidden_size=255", "K (input width)=255"),
                                            ("model.moe_intermediate_size=30", "K (input width)=30")])
def test_shape_the_grouped_gemm_cannot_take_exits_2_before_the_run_dir(tmp_path, capsys, override, field):
    """gemm=torch needs 16-byte rows (fp32 on CPU: H and I multiples of 4): refused at start, naming the
    model fields, before the run directory exists (it used to die at step 0 with a traceback, exit 1)."""
    from dropless.train.__main__ import main

    rd = tmp_path / "run"
    assert main([override, "train.steps=1", f"run_dir={rd}", "logging.mode=disabled"]) == 2
    err = capsys.readouterr().err
    assert "model.hidden_size=" in err and "model.moe_intermediate_size=" in err and field in err, err
    assert "Traceback" not in err and not rd.exists(), err
    from dropless.ops.backends import check_backend_shapes

    check_backend_shapes("loop", "cpu", torch.float32, 255, 30)  # the reference loop takes any shape
    check_backend_shapes("torch", "cpu", torch.float32, 256, 32)


@pytest.mark.parametrize("group,real", [("optim", "adamw"), ("dispatcher", "a2a"), ("model", "tiny")])
def test_unknown_group_option_lists_the_options_without_schema(group, real):
    """A misspelt group option lists that group's options; ``schema`` (the typed base they all
    extend, not a choice) is not among them."""
    with pytest.raises(ConfigError) as info:
        compose([f"{group}=nonexistent"])
    msg = str(info.value)
    listed = msg.split(f"Available options in '{group}':", 1)[1].split("(the options are", 1)[0].split()
    assert real in listed and "schema" not in listed and len(listed) >= 1
    assert "Config search path" not in msg and "provider=" not in msg  # Hydra's internals, not the user's
    assert f"(the options are the .yaml files in {config_dir() / group}/)" in msg


def test_a_dict_override_sets_a_field_that_is_null_and_merges_into_one_that_is_not():
    """``model.rope_scaling={...}`` on the tiny model (rope_scaling null) used to crash inside
    OmegaConf (a dict cannot be merged into a null node); it is assigned now. Where the field holds a
    dict already (deepseek_v3_671b's YaRN), the override merges into it as Hydra does."""
    yarn = {"type": "yarn", "factor": 4, "original_max_position_embeddings": 128}
    cfg = compose(["model.rope_scaling={type:yarn,factor:4,original_max_position_embeddings:128}", "train.steps=3"])
    assert OmegaConf.to_container(cfg.model.rope_scaling) == yarn and cfg.train.steps == 3
    assert model_args(cfg).yarn() is not None
    v3 = compose(["model=deepseek_v3_671b"]).model.rope_scaling
    merged = compose(["model=deepseek_v3_671b", "model.rope_scaling={factor:8}"]).model.rope_scaling
    assert merged.factor == 8 and {k: v for k, v in merged.items() if k != "factor"} == \
        {k: v for k, v in v3.items() if k != "factor"}
    with pytest.raises(ConfigError, match=r"model\.rope_scaling\.factor=4") as e:  # the key, and the whole field
        compose(["model.rope_scaling.factor=4"])
    assert "'model.rope_scaling={" in str(e.value)


@pytest.mark.parametrize("override, field", [
    ("gemm.backend=foo", "gemm.backend (model.gemm)='foo'"),
    ("model.gemm=foo", "gemm.backend (model.gemm)='foo'"),
    ("optim.name=sgd", "optim.name='sgd'"),
    ("resume=true", "resume=true"),  # needs run_dir: refused at the run directory, after the config was printed
    # these four passed --cfg and failed only when the run started
    ("device=tpu", "device='tpu'"),
    ("train.loss_impl=foo", "train.loss_impl='foo'"),
    ("dispatcher=a2a dispatcher.ep_size=0", "dispatcher.ep_size=0"),
    ("dispatcher.ep_size=0", "dispatcher=local with EP = 0"),  # local takes EP = 1 only: the message says so
    ("dispatcher.ep_size=3", "dispatcher=local with EP = 3"),
    ("model.recompute_gather=true dispatcher=a2a", "model.recompute_gather=true"),
    # cpu_peak_flops is no Optional: its message offered null, which the schema refuses
    ("logging.cpu_peak_flops=0", "logging.cpu_peak_flops=0.0"),
])
def test_a_value_nothing_would_build_is_a_config_error_also_under_cfg(override, field, capsys):
    """An unknown GEMM backend was a ValueError traceback at the model build (exit 1; --cfg printed it),
    and optim.name=sgd trained AdamW silently. The error names the field and its value, exit status 2."""
    from dropless.train.__main__ import main

    assert main(["--cfg", *override.split()]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dropless-train: error: {field}:") and err.count("\n") == 1
