"""Gradient clipping folded into the fused AdamW (dropless.train.grads.clipped_step), on CPU.

torch's fused AdamW runs on CPU too, so the fold (``optimizer.grad_scale = (norm + 1e-6)/max``,
divided out inside the optimizer kernel) is checked here against today's path (``clip_``: one
``_foreach_mul_`` by ``max/(norm + 1e-6)``, then ``step``): parameters, moments and the clipped
gradients agree to rounding over several steps with the clip active and inactive; a foreach or
mixed optimizer is never folded; the trainer's losses and logged (pre-clip) grad norms agree,
and a folded run resumes bitwise (``grad_scale`` never reaches the checkpoint).
"""

from __future__ import annotations

import shutil

import pytest
import torch

import dropless.train.grads as grads_mod
from dropless.train.grads import clip_, clip_scale, clipped_step, folds_clip
from tests.test_train import records, run

TIGHT = dict(rtol=2e-6, atol=1e-7)


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in ((37, 5), (5,), (16, 8), (129,))]


def _grads(step: int, scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [scale * torch.randn(*s, generator=g) for s in ((37, 5), (5,), (16, 8), (129,))]


def _opt(ps: list[torch.nn.Parameter], fused: bool | list[bool]) -> torch.optim.AdamW:
    fl = fused if isinstance(fused, list) else [fused, fused]
    groups = [{"params": [ps[0], ps[2]], "weight_decay": 0.1, "fused": fl[0], "foreach": not fl[0]},
              {"params": [ps[1], ps[3]], "weight_decay": 0.0, "fused": fl[1], "foreach": not fl[1]}]
    return torch.optim.AdamW(groups, lr=3e-2, betas=(0.9, 0.95), eps=1e-8)


def _steps(fold: bool, scales: list[float], max_norm: float, fused=True):
    """Run len(scales) clipped steps; returns (params, last grads, optimizer, folded flags, norms)."""
    ps = [torch.nn.Parameter(p.clone()) for p in _params()]
    opt = _opt(ps, fused)
    folded, norms = [], []
    for i, s in enumerate(scales):
        for p, g in zip(ps, _grads(i, s)):
            p.grad = g
        gs = [p.grad for p in ps]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs]))
        norms.append(float(norm))
        if fold:
            folded.append(clipped_step(opt, gs, norm, max_norm))
        else:
            clip_(gs, norm, max_norm)
            opt.step()
    return ps, [p.grad for p in ps], opt, folded, norms


@pytest.mark.parametrize("scales", [[1.0, 0.05, 2.0, 0.5, 3.0],      # norms ~12, 0.6, 24, 6, 36
                                    [0.02, 0.03, 0.01]])               # never above max_norm
def test_folded_clip_equals_clip_then_step(scales):
    max_norm = 1.0
    a, ga, oa, folded, norms = _steps(True, scales, max_norm)
    b, gb, ob, _, norms_b = _steps(False, scales, max_norm)
    assert folded == [True] * len(scales) and norms == norms_b
    active = [n > max_norm for n in norms]
    for x, y in zip(a + ga, b + gb):          # parameters and the (clipped) gradients left in place
        torch.testing.assert_close(x, y, **TIGHT)
    for p, q in zip(a, b):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(oa.state[p][k], ob.state[q][k], **TIGHT)
    if any(active):                                 # the clip mattered: unclipped steps land elsewhere
        c, *_ = _steps(False, scales, max_norm=1e9)
        assert max((x - y).abs().max().item() for x, y in zip(a, c)) > 1e-3
        if active[-1]:
            assert torch.linalg.vector_norm(torch.cat([g.flatten() for g in ga])).item() == \
                pytest.approx(max_norm, rel=1e-5)   # the kernel wrote the clipped gradients back
    else:                                           # inactive: grad / 1 is exact, so bitwise
        for x, y in zip(a + ga, b + gb):
            assert torch.equal(x, y)
    assert not hasattr(oa, "grad_scale")            # nothing left on the optimizer, nor in its state
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"] and sorted(sa["state"]) == sorted(sb["state"])
    assert all(sorted(sa["state"][k]) == ["exp_avg", "exp_avg_sq", "step"] for k in sa["state"])


def test_clip_scale_is_the_reciprocal_of_the_clip_coefficient():
    n = torch.tensor([0.5, 1.0, 1.0 + 1e-6, 7.25, 1e4])
    s = torch.stack([clip_scale(x, 1.0) for x in n])
    assert s[0] == 1 and s[1] == 1                  # norm <= max_norm: divide by exactly 1
    torch.testing.assert_close(s[2:].double(), (n[2:].double() + 1e-6) / 1.0, rtol=1e-7, atol=0)


@pytest.mark.parametrize("fused", [False, [True, False]])
def test_foreach_or_mixed_optimizers_clip_first(fused):
    """foreach (CPU) or a group that is not fused (FSDP2 DTensors): never folded; the same
    arithmetic as clip_ then step, bitwise."""
    scales = [1.0, 2.0]
    ps = [torch.nn.Parameter(p.clone()) for p in _params()]
    assert not folds_clip(_opt(ps, fused))
    a, ga, oa, folded, _ = _steps(True, scales, 1.0, fused=fused)
    b, gb, _, _, _ = _steps(False, scales, 1.0, fused=fused)
    assert folded == [False, False]
    for x, y in zip(a + ga, b + gb):
        assert torch.equal(x, y)


def test_folds_clip_needs_adam_with_every_group_fused():
    ps = [torch.nn.Parameter(p.clone()) for p in _params()]
    assert folds_clip(_opt(ps, True))
    assert folds_clip(torch.optim.Adam(ps, fused=True))
    assert not folds_clip(torch.optim.SGD(ps, lr=0.1, fused=True))   # takes grad_scale, but not ours to fold


def test_clipped_step_refuses_a_grad_scale_already_set():
    ps = [torch.nn.Parameter(p.clone()) for p in _params()]
    opt = _opt(ps, True)
    for p, g in zip(ps, _grads(0, 1.0)):
        p.grad = g
    opt.grad_scale = torch.tensor(2.0)
    with pytest.raises(RuntimeError, match="grad_scale is set already"):
        clipped_step(opt, [p.grad for p in ps], torch.tensor(12.0), 1.0)


# ----------------------------------------------------------------------------- the trainer
# device=cpu: CPU's fused AdamW, whose runs repeat bitwise (CUDA's own test is below)
CLIP = ["device=cpu", "logging.mode=disabled", "train.val_every=0", "optim.grad_clip=0.05", "train.steps=4",
        "train.ckpt_every=2", "train.ckpt_keep=0", "train.grad_accum=2"]


# fp32: the fold's rounding (g / s against g · c) stays below the weights' ulp here (equal to 1e-6);
# bf16: a master that moved by an fp32 ulp can round to another bf16 compute weight, which the
# next gradients see (measured: losses within 3e-5, grad norms within 7e-4 over 6 steps)
@pytest.mark.parametrize("dtype,loss_rel,norm_rel", [("fp32", 1e-6, 1e-6), ("bf16", 1e-4, 3e-3)])
def test_trainer_folded_clip_equals_the_separate_clip(tmp_path, monkeypatch, dtype, loss_rel, norm_rel):
    """optim.fused=true (CPU's fused AdamW): the trainer decides the clip and the skip on the device
    (grads.guarded_step, the clip folded into the kernel); against the host deciding and clipping in a
    separate pass (clipped_step with folds_clip off)."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    over = CLIP + [f"train.dtype={dtype}", "optim.fused=true"]
    guarded, calls = [], []
    real_guarded, real = grads_mod.guarded_step, grads_mod.clipped_step
    monkeypatch.setattr("dropless.train.step.guarded_step", lambda *args: guarded.append(1) or real_guarded(*args))
    monkeypatch.setattr("dropless.train.step.clipped_step",
                        lambda *args: calls.append(real(*args)) or calls[-1])
    _, tr = run([f"run_dir={a}"] + over)
    assert all(g["fused"] for g in tr.optimizer.param_groups) and tr.device_guarded
    assert not hasattr(tr.optimizer, "grad_scale") and not hasattr(tr.optimizer, "found_inf")
    assert guarded == [1] * 4 and calls == []         # every step decided on the device
    with monkeypatch.context() as m:                 # the same run, the host deciding, the separate clip pass
        m.setattr("dropless.train.trainer.folds_clip", lambda opt: False)
        m.setattr(grads_mod, "folds_clip", lambda opt: False)
        guarded.clear()
        run([f"run_dir={b}"] + over)
        assert calls == [False] * 4 and guarded == []
    ra, rb = records(a), records(b)
    assert ra[0]["loss"] == rb[0]["loss"] and ra[0]["grad_norm"] == rb[0]["grad_norm"]  # before any update
    for x, y in zip(ra, rb):
        assert x["grad_norm"] > 0.05                     # logged: the norm before clipping
        assert x["loss"] == pytest.approx(y["loss"], rel=loss_rel, abs=0)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=norm_rel, abs=0)
    if dtype != "bf16":
        return
    (c / "checkpoints").mkdir(parents=True)              # resume the folded run from its step 2: bitwise
    shutil.copytree(a / "checkpoints" / "step_00000002", c / "checkpoints" / "step_00000002")
    _, tr2 = run([f"run_dir={c}", "resume=true"] + over)
    rc = {r["step"]: r for r in records(c)}
    assert sorted(rc) == [3, 4]
    for s in (3, 4):
        for k in ("loss", "grad_norm", "lr"):
            assert rc[s][k] == ra[s - 1][k], (s, k)
    for p, q in zip(tr.masters.masters, tr2.masters.masters):
        assert torch.equal(p, q)


@pytest.mark.gpu
def test_folded_clip_equals_clip_then_step_on_cuda():
    """The same comparison on CUDA's fused AdamW kernel (the trainer's path on one GPU)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    res = []
    for fold in (True, False):
        ps = [torch.nn.Parameter(p.clone().cuda()) for p in _params()]
        opt = _opt(ps, True)
        for i, s in enumerate([1.0, 0.05, 2.0, 3.0]):
            for p, g in zip(ps, _grads(i, s)):
                p.grad = g.cuda()
            gs = [p.grad for p in ps]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs]))
            if fold:
                assert clipped_step(opt, gs, norm, 1.0)
            else:
                clip_(gs, norm, 1.0)
                opt.step()
        assert not hasattr(opt, "grad_scale")
        res.append([p.detach().cpu() for p in ps] + [p.grad.cpu() for p in ps])
    for x, y in zip(*res):
        torch.testing.assert_close(x, y, **TIGHT)


@pytest.mark.parametrize("max_norm", [0.0, -1.0, None, float("nan")])
def test_clipped_step_refuses_a_threshold_that_is_not_positive(max_norm):
    """0, a negative, None or NaN as the clip threshold: a ValueError before the optimizer steps (the
    folded path would divide by zero or flip the gradients' sign)."""
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    with pytest.raises(ValueError, match="positive"):
        clipped_step(opt, [p.grad], torch.tensor(2.0), max_norm)
    assert torch.equal(p.detach(), torch.ones(4))
