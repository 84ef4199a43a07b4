"""Mixed precision, AdamW and the schedule of the trainer (dropless.train.optim / grads), on CPU.

bf16 (``train.dtype=bf16``): the compute parameters are bf16, the optimizer steps fp32 masters
with fp32 moments, gradients accumulate over micro-batches in fp32 main-gradient buckets
(exactly ``g1.float() + g2.float()`` of the micro-batches' bf16 gradients), the router's buffers
stay fp32, the MoE layer's input is bf16 while the router logits are fp32, and after a step the
compute copy is the masters rounded to bf16. Checkpoints hold the fp32 masters and a bf16 run
resumes bitwise. The lr of every step is ``lr_at`` through ``LambdaLR``.
"""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dropless.config import ConfigError
from dropless.train.config import compose
from dropless.train.optim import MasterWeights, lr_at
from dropless.train.trainer import Trainer
from tests.test_train import QUICK, records, run

BF16 = ["train.dtype=bf16", "logging.mode=disabled", "train.val_every=0"]


def _trainer(tmp_path, *extra) -> Trainer:
    return Trainer(compose(QUICK + BF16 + [f"run_dir={tmp_path}", *extra]))


def test_bf16_compute_params_fp32_masters_moments_and_buffers(tmp_path):
    tr = _trainer(tmp_path, "train.steps=1")
    try:
        m = tr.masters
        assert m.compute and all(p.dtype == torch.bfloat16 for p in m.compute)
        assert all(q.dtype == torch.float32 for q in m.masters)
        assert len(m.compute) == sum(1 for p in tr.model.parameters() if p.requires_grad)
        for name, b in tr.model.named_buffers():   # expert bias fp32, counts exact int64
            assert b.dtype == (torch.int64 if name.endswith("tokens_per_expert") else torch.float32), name
        seen = {}
        moe = tr.moe_layers[0]
        h1 = moe.register_forward_pre_hook(lambda mod, a: seen.update(moe_in=a[0].dtype))
        h2 = moe.router.register_forward_hook(lambda mod, a, out: seen.update(scores=out.scores_TE.dtype))
        tr.train_step()
        h1.remove(), h2.remove()
        assert seen == {"moe_in": torch.bfloat16, "scores": torch.float32}
        for p, q in zip(m.compute, m.masters):     # refreshed once from the masters
            assert torch.equal(p, q.to(torch.bfloat16))
        for st in tr.optimizer.state.values():
            assert st["exp_avg"].dtype == torch.float32 and st["exp_avg_sq"].dtype == torch.float32
        assert all(p.grad is None for p in m.compute)          # bf16 grads freed by the hooks
        assert all(g.dtype == torch.float32 for g in tr.grads.flats)
        assert all(g["foreach"] and not g["fused"] for g in tr.optimizer.param_groups)   # CPU: foreach
    finally:
        tr.close()


def test_micro_batches_accumulate_in_fp32(tmp_path):
    """main grad = g1.float() + g2.float() exactly, for the bf16 gradients g1, g2 of two micro-batches."""
    tr = _trainer(tmp_path, "train.steps=1", "train.grad_accum=2")
    try:
        ws = [tr.loader.next_window() for _ in range(2)]
        per = []
        for w in ws:  # each micro-batch's bf16 gradients on their own (no hooks: autograd.grad)
            loss = tr._loss(w[:, :-1], w[:, 1:]).loss / 2
            per.append(torch.autograd.grad(loss, tr.masters.compute, allow_unused=True))
            tr.balancer.discard()
        tr.grads.zero_()
        for i, w in enumerate(ws):
            tr.grads.start(sync=i == 1)
            (tr._loss(w[:, :-1], w[:, 1:]).loss / 2).backward()
        tr.grads.finish()
        bad = 0
        for main, g1, g2 in zip(tr.grads.main, *per):
            want = (g1.float() if g1 is not None else 0) + (g2.float() if g2 is not None else 0)
            bad += not torch.equal(main, torch.as_tensor(want).expand_as(main))
        assert bad == 0
        assert any(not torch.equal(main, (g1 + g2).float()) for main, g1, g2 in zip(tr.grads.main, *per)
                   if g1 is not None)   # a bf16 sum would differ: the test can tell them apart
    finally:
        tr.close()


def test_bf16_checkpoint_holds_fp32_masters_and_resumes_bitwise(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    common = BF16 + ["train.steps=4", "train.ckpt_every=2", "train.ckpt_keep=0", "train.grad_accum=2"]
    _, tr = run([f"run_dir={a}"] + common)
    meta = dcp.FileSystemReader(str(a / "checkpoints" / "step_00000002")).read_metadata().state_dict_metadata
    w = [v for k, v in meta.items() if k.startswith("model.") and k.endswith(".weight")]
    assert w and all(v.properties.dtype == torch.float32 for v in w)
    assert "trainer.lr_step" in meta
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "step_00000002", b / "checkpoints" / "step_00000002")
    _, tr2 = run([f"run_dir={b}", "resume=true"] + common)
    ra = {r["step"]: r for r in records(a)}
    rb = {r["step"]: r for r in records(b)}
    assert sorted(rb) == [3, 4]
    for s in (3, 4):
        for k in ("loss", "grad_norm", "lr", "aux_loss"):
            assert rb[s][k] == ra[s][k], (s, k)
    assert tr2.scheduler.last_epoch == 4
    for p, q in zip(tr.masters.masters, tr2.masters.masters):
        assert torch.equal(p, q)


def test_lambda_lr_follows_lr_at(tmp_path):
    _, tr = run([f"run_dir={tmp_path}", "train.steps=7", "optim.warmup_steps=3", "logging.mode=disabled",
                 "train.val_every=0"])
    lrs = [r["lr"] for r in records(tmp_path)]
    want = [lr_at(s, tr.cfg.optim, 7) for s in range(7)]
    assert lrs == pytest.approx(want, rel=1e-12, abs=0)
    assert lrs[0] < lrs[2] and lrs[-1] == pytest.approx(tr.cfg.optim.min_lr_ratio * tr.cfg.optim.lr, rel=1e-12)


def test_a_per_tensor_adamw_group_is_a_rank_0_start_up_warning(tmp_path, monkeypatch, capsys):
    # under torchrun the FSDP2 groups' note went to the logging module on every rank, unprefixed
    import dropless.train.optim as O

    impl = O.adamw_impl
    why = "FSDP2 DTensor parameters use the per-tensor AdamW (as for a DTensor group)"
    monkeypatch.setattr(O, "adamw_impl", lambda ps, fused=None: (
        ({"foreach": False, "fused": False}, why) if any(p.dim() == 1 for p in ps) else impl(ps, fused)))
    tr = _trainer(tmp_path)
    try:
        g = next(g for g in tr.optimizer.param_groups if any(p.dim() == 1 for p in g["params"]))
        assert (g["foreach"], g["fused"]) == (False, False)
        note = f"AdamW: {len(g['params'])} parameters: {why}"
        assert note in tr.warnings
        assert f"[dropless] warning: {note}" in capsys.readouterr().out
    finally:
        tr.close()


def test_master_weights_fp32_is_the_model_itself():
    m = torch.nn.Linear(4, 3)
    mw = MasterWeights(m, torch.float32)
    assert mw.state_module is m and mw.masters is mw.compute and mw.grads_are_params
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        MasterWeights(torch.nn.Linear(2, 2), torch.float16)


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True], ids=["moe_eager", "moe_compiled"])
def test_compile_aot_eager_equals_eager(tmp_path, moe):
    """train.compile=true (aot_eager on CPU, 1 dense + 1 MoE block), with the MoE routed part eager or
    compiled (train.compile_moe): 3 steps' losses and grad norms, the first step's gradients and the
    router's balancing load (the bias update's input) equal eager's."""
    out, grads, loads = {}, {}, {}
    for name, flag in (("eager", "false"), ("compiled", "true")):
        tr = Trainer(compose(QUICK + [f"run_dir={tmp_path / name}", "train.steps=3", "logging.mode=disabled",
                                      "model.num_hidden_layers=2", "train.micro_batch_size=2", "train.seq_len=32",
                                      "train.val_every=0", f"train.compile={flag}", "train.compile_backend=aot_eager",
                                      f"train.compile_moe={str(moe and flag == 'true').lower()}"]))
        try:
            recs = []
            for i in range(3):
                recs.append(tr.train_step())
                if i == 0:
                    grads[name] = [g.clone() for g in tr.grads.main]
            out[name] = [(r["loss"], r["grad_norm"]) for r in recs]
            loads[name] = [m.router.e_score_correction_bias.clone() for m in tr.moe_layers]
            if flag == "true":
                from dropless.train.compile import eager_regions
                want = [] if moe else [f"layers.{i}.moe.{w}" for i in tr.args.moe_layer_ids()
                                       for w in ("router", "_routed")]
                assert eager_regions(tr.model) == want
                assert all(hasattr(b, "_compiled_call_impl") and b._compiled_call_impl is not None
                           for b in tr.model.layers.values())
        finally:
            tr.close()
    for a, b in zip(loads["compiled"], loads["eager"]):
        assert torch.equal(a, b) and a.abs().sum() > 0  # three bias updates from equal integer loads
    for (la, ga), (lb, gb) in zip(out["compiled"], out["eager"]):
        assert la == pytest.approx(lb, rel=1e-5) and ga == pytest.approx(gb, rel=1e-4)
    for a, b in zip(grads["compiled"], grads["eager"]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6 * b.abs().max().item())


@pytest.mark.slow
def test_compile_moe_is_one_graph_for_every_moe_layer_and_counts_once_per_step(tmp_path):
    """train.compile_moe (aot_eager), 1 dense + 4 MoE layers, 2 micro-batches: Dynamo compiles the block
    twice at most (dense, MoE: a per-layer constant read in the traced region, such as the router's
    layer name was, would compile each layer again and past the limit raise here), and the counting rule: the
    counts behind the bias update are each layer's true routed rows of the whole step (T·k·2), once."""
    cfg = compose(QUICK + [f"run_dir={tmp_path}", "train.steps=1", "logging.mode=disabled", "train.val_every=0",
                           "model.num_hidden_layers=5", "train.micro_batch_size=2", "train.seq_len=32",
                           "train.grad_accum=2", "train.compile=true", "train.compile_backend=aot_eager",
                           "train.compile_moe=true"])
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        tr = Trainer(cfg)
        try:
            seen = []
            counts = tr.balancer.counts
            tr.balancer.counts = lambda: seen.append(counts()) or seen[-1]
            tr.train_step()
        finally:
            tr.close()
    k = tr.args.num_experts_per_tok
    assert seen[0].shape == (4, tr.args.n_routed_experts)
    assert seen[0].sum(dim=1).tolist() == [2 * 32 * k * 2] * 4


@pytest.mark.parametrize("over, match", [
    (["dispatcher=a2a"], "^train.compile_moe=true .*dispatcher=a2a"),
    (["dispatcher=fsdp"], "^train.compile_moe=true .*dispatcher=fsdp"),
    (["train.activation_checkpointing=true"], "^train.compile_moe=true: .*train.activation_checkpointing=true"),
    (["train.compile_moe=maybe"], "compile_moe"),
    (["train.compile=false"], "train.compile_moe=true: compiles the MoE part .* set train.compile=true"),
])
def test_compile_moe_where_it_cannot_be_honoured_is_a_config_error(tmp_path, over, match):
    with pytest.raises(ConfigError, match=match):
        Trainer(compose(QUICK + [f"run_dir={tmp_path}", "train.compile=true", "train.compile_moe=true",
                                 "train.compile_backend=aot_eager", *over]))


def test_compile_where_it_cannot_run_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match="train.compile=true .*C\\+\\+ compiler"):
        Trainer(compose(QUICK + [f"run_dir={tmp_path}", "train.compile=true", "device=cpu"]))


def test_compile_with_a_cxx_that_is_not_an_executable_is_a_config_error(tmp_path, monkeypatch):
    """inductor compiles with $CXX when it is set: a g++ on PATH must not hide a broken CXX."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(ConfigError, match="no-such-g.*is not an executable"):
        Trainer(compose(QUICK + [f"run_dir={tmp_path}", "train.compile=true", "device=cpu"]))


def _no_wandb_login(tmp_path, monkeypatch):
    """An environment where wandb finds no credentials (no key, no ~/.netrc, no settings file)."""
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))          # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_cfg"))


def test_online_logging_without_a_wandb_login_fails_before_the_run_dir_and_the_model(tmp_path, monkeypatch):
    """logging.mode=online with no API key: a ConfigError saying how to log in, before the run directory
    is made or the model built (wandb.init used to raise it after both: an empty run dir was left)."""
    pytest.importorskip("wandb")
    from dropless.train import trainer as trainer_mod
    _no_wandb_login(tmp_path, monkeypatch)

    def no_build(*a, **kw):
        raise AssertionError("the model was built before the logging check")
    monkeypatch.setattr(trainer_mod, "build_model", no_build)
    with pytest.raises(ConfigError) as e:
        Trainer(compose(QUICK + [f"run_dir={tmp_path / 'run'}", "logging.mode=online"]))
    msg = str(e.value)
    assert msg.startswith("logging.mode=online: wandb has no credentials")
    for fix in ("`wandb login`", "WANDB_API_KEY", "logging.mode=offline", "logging.mode=disabled"):
        assert fix in msg
    assert not (tmp_path / "run").exists()


def test_wandb_problem_reads_the_credentials_without_the_network(tmp_path, monkeypatch):
    """What :func:`wandb_problem` finds: a malformed WANDB_API_KEY and a missing login are named, a
    well-formed key in the environment or in $NETRC for wandb's host passes (never checked online),
    offline and disabled need no login, and a wandb that does not import is refused unless disabled."""
    pytest.importorskip("wandb")
    from wandb.sdk import wandb_setup

    from dropless.train.metrics import wandb_problem
    _no_wandb_login(tmp_path, monkeypatch)
    assert wandb_problem("online").startswith("logging.mode=online: wandb has no credentials")
    assert wandb_problem("offline") is None and wandb_problem("disabled") is None
    monkeypatch.setenv("WANDB_API_KEY", "x")
    assert "wandb cannot read its credentials (WANDB_API_KEY invalid" in wandb_problem("online")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_problem("online") is None
    monkeypatch.delenv("WANDB_API_KEY")
    host = wandb_setup.singleton().settings.base_url.split("://")[-1]
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine {host}\n  login user\n  password {'n' * 40}\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert wandb_problem("online") is None
    monkeypatch.setitem(sys.modules, "wandb", None)    # `import wandb` raises ImportError
    for mode in ("online", "offline"):
        assert wandb_problem(mode).startswith(f"logging.mode={mode} ")
        assert "pip install wandb" in wandb_problem(mode) and "logging.mode=disabled" in wandb_problem(mode)
    assert wandb_problem("disabled") is None


def logging_check_worker(rank, world, tmp):
    """Rank 0 without a wandb login, rank 1 with a well-formed key: check_logging's verdict on each."""
    import os

    from dropless.train.dist import DistEnv
    from dropless.train.startup import check_logging
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        os.environ.pop(var, None)
    os.environ.update(HOME=tmp, NETRC=f"{tmp}/none", WANDB_CONFIG_DIR=f"{tmp}/cfg{rank}")
    if rank == 1:
        os.environ["WANDB_API_KEY"] = "k" * 40
    env = DistEnv(rank, world, rank, world, torch.device("cpu"), 1, world)
    cfg = compose(QUICK + ["logging.mode=online"])
    try:
        check_logging(cfg, env)
        return None
    except ConfigError as e:
        return str(e)


def test_logging_check_gives_every_rank_rank_0s_verdict(tmp_path):
    """Only rank 0 logs: its environment decides, and every rank raises the same ConfigError (a rank
    with a login does not go on to wait for a rank 0 that stopped)."""
    pytest.importorskip("wandb")
    from tests import dist_harness as H
    res = H.run_world("tests.test_train_optim:logging_check_worker", 2, str(tmp_path))
    assert res[0] is not None and res[0].startswith("logging.mode=online: wandb has no credentials")
    assert res[1] == res[0]


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_router_bias_update_counts_once_per_step(mode):
    """The counting rule (docs/design.md#the-router) on :class:`RouterBiasUpdate`: under activation recompute and 4
    gradient-accumulation micro-batches, the counts it hands the bias update are the step's
    true routed rows (float64 reference selection), the hook moves the bias once by exactly
    ``γ·sign(mean − load)``, and a second optimizer step without forwards moves nothing."""
    from dropless.train.optim import RouterBiasUpdate
    from tests.test_routing import CkptBlock, logits64, ref_route, small_args

    args = small_args(bias_update_speed=0.125)
    torch.manual_seed(0)
    block = CkptBlock(args, mode)
    with torch.no_grad():
        block.router.weight.normal_(0, 0.5)
    block.train()
    g = torch.Generator().manual_seed(9)
    micro = [torch.randn(16, 32, generator=g) for _ in range(4)]
    masks = [torch.ones(16, dtype=torch.bool) for _ in range(4)]
    masks[1][10:] = False
    true = torch.zeros(16, dtype=torch.int64)
    with torch.no_grad():
        for x, m in zip(micro, masks):
            chosen, _ = ref_route(logits64(block.router, block.proj(x)), [0.0] * 16, n_group=4, topk_group=2, k=4)
            for t, s in enumerate(chosen):
                if m[t]:
                    for e in s:
                        true[e] += 1
    assert int(true.sum()) == (16 * 3 + 10) * 4

    opt = torch.optim.SGD(block.proj.parameters(), lr=0.0)
    upd = RouterBiasUpdate(block)
    upd.register(opt)
    w_out = torch.randn(16, 4, generator=g)
    for x, m in zip(micro, masks):
        w, aux = block(x, m)
        ((w * w_out).sum() + aux).backward()
    assert block.calls == 8 and block.recompute_seen == 4    # the recompute ran, and was not counted
    counts = upd.counts()
    assert counts.dtype == torch.int64 and counts.shape == (1, 16)
    assert torch.equal(counts[0], true)
    assert upd.counts() is counts                             # summed once per step
    before = block.router.e_score_correction_bias.clone()
    opt.step()                                                # the post-hook moves the bias
    delta = block.router.e_score_correction_bias - before
    assert torch.equal(delta, 0.125 * torch.sign(true.double().mean() - true.double()).float())
    assert torch.equal(block.router.tokens_per_expert, torch.zeros(16, dtype=torch.int64))
    opt.step()                                                # no forward since: no move
    assert torch.equal(block.router.e_score_correction_bias, before + delta)


def test_grad_buckets_copy_first_gradient_and_zero_the_unwritten():
    """bf16 main-gradient buckets are not zero-filled per step: the first gradient is copied in,
    later micro-batches add (exactly g1.float() + g2.float()), and a parameter that got no
    gradient this step reads 0 after finish() even though the previous step wrote it."""
    from dropless.train.grads import GradBuckets
    a = torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    masters = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]
    gb = GradBuckets([a, b], set(), grads_are_params=False, owners=masters, bucket_elems=8)
    gen = torch.Generator().manual_seed(1)
    ga = [torch.randn(3, 4, generator=gen).bfloat16() for _ in range(2)]
    gbb = torch.randn(5, generator=gen).bfloat16()
    gb.zero_()
    for i in range(2):                                  # step 1: a in both micro-batches, b once
        gb.start(sync=i == 1)
        loss = (a * ga[i]).sum() + ((b * gbb).sum() if i == 0 else 0.0)
        loss.backward()
    gb.finish()
    assert torch.equal(masters[0].grad, ga[0].float() + ga[1].float())
    assert torch.equal(masters[1].grad, gbb.float())
    gb.zero_()                                          # step 2: only a gets a gradient
    gb.start(sync=True)
    (a * ga[1]).sum().backward()
    gb.finish()
    assert torch.equal(masters[0].grad, ga[1].float())
    assert torch.equal(masters[1].grad, torch.zeros(5))
