"""Shared fixtures of the MoE tests: a batched float64 reference and a scaled comparison.

``ref_moe_batched`` is ``tests/moe_reference.reference_moe`` (the per-token loop)
vectorised over tokens, so the 2048- and 4096-token cases stay fast; it also
takes a keep mask for the capacity-factor baseline. ``test_cases.py`` checks
that it equals ``reference_moe``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

# The tests not marked ``gpu`` check the CPU path, as CI runs them. On a machine with CUDA, ``device=auto``
# would put their trainers on the GPU (CPU reference values and CPU batches then no longer match), so
# there, outside ``gpu`` tests, device=auto resolves to the CPU in this process. The runs a test starts in
# other processes (torchrun, dropless-train) say device=cpu themselves (tests/test_train.py's QUICK). The
# kernel tests that choose their own device (``DEV = "cuda" if ...``) do not go through device=auto.
_HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _device_auto_is_the_cpu_outside_gpu_tests(request, monkeypatch):
    if _HAS_CUDA and request.node.get_closest_marker("gpu") is None:
        from dropless.train import dist as train_dist

        real = train_dist._device
        monkeypatch.setattr(train_dist, "_device",
                            lambda want, *a, **k: real("cpu" if str(want) == "auto" else want, *a, **k))
    yield


def ref_moe_batched(x_TH, router_w_EH, topk_idx_Tk, w13_EHI2, w2_EIH, shared, *, scaling=1.0,
                    norm_topk_prob=True, keep_Tk=None, topk_weight_Tk=None):
    """float64 ``y[t] = Σ_j keep[t,j]·w[t,j]·expert_{idx[t,j]}(x[t]) + shared(x[t])``.

    Combine weights: ``topk_weight_Tk`` if given, else the unbiased sigmoid scores of the
    chosen experts (from ``router_w_EH``), normalised over all k choices (before any drop)
    when ``norm_topk_prob``, times ``scaling``. Expert: ``(silu(x W_g) * (x W_u)) W_2`` with
    ``W_g‖W_u = w13[e]``. ``shared``: None or (w1 [F,H], w3 [F,H], w2 [H,F]).
    """
    x = x_TH.double()
    t_count, k = topk_idx_Tk.shape
    if topk_weight_Tk is None:
        scores = torch.sigmoid(x @ router_w_EH.double().t())
        w = scores.gather(1, topk_idx_Tk.clamp(min=0))
        if norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        w = w * scaling
    else:
        w = topk_weight_Tk.double()
    if keep_Tk is None:
        keep_Tk = torch.ones(t_count, k, dtype=torch.bool)
    y = torch.zeros_like(x)
    for j in range(k):
        e = topk_idx_Tk[:, j].clamp(min=0)
        h = torch.bmm(x.unsqueeze(1), w13_EHI2.double()[e]).squeeze(1)       # [T, 2I]
        gate, up = h.chunk(2, dim=-1)
        o = torch.bmm((F.silu(gate) * up).unsqueeze(1), w2_EIH.double()[e]).squeeze(1)
        y = y + torch.where(keep_Tk[:, j:j + 1], w[:, j:j + 1] * o, torch.zeros((), dtype=torch.float64))
    if shared is not None:
        w1, w3, w2 = (p.double() for p in shared)
        y = y + (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()
    return y


def rerun_under_interpreter(test_file: str) -> None:
    """Run ``test_file``'s non-GPU tests again in a subprocess with ``TRITON_INTERPRET=1`` (set before triton is
    imported there), so that a CPU-only run checks its Triton kernels too; fails with the subprocess's tail."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not gpu",
                           str(Path(test_file).resolve())], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "failed" not in proc.stdout, tail


def py_layout(counts: list[int], a: int) -> tuple[list[int], list[int]]:
    """docs/design.md#the-live-row-contract's recurrence, one expert at a time (the plain-Python reference):
    ``start[0] = 0``, ``start[i] = align_up(end[i-1], a)``, ``end[i] = start[i] + counts[i]``."""
    start, end = [], []
    prev_end = 0
    for c in counts:
        s = 0 if not start else -(-prev_end // a) * a
        start.append(s)
        end.append(s + c)
        prev_end = s + c
    return start, end


def assert_scaled(got, want, tol, what=""):
    """``max |got − want| ≤ tol · max |want|`` and ``got`` finite (NaN/Inf anywhere fails)."""
    got = got.detach().double()
    want = want.detach().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    scale = want.abs().max().clamp_min(1e-30)
    err = ((got - want).abs().max() / scale).item()
    assert err <= tol, f"{what}: max error {err:.3e} of max |ref| > {tol:.0e}"


@pytest.fixture
def ref_moe():
    return ref_moe_batched


@pytest.fixture
def close():
    return assert_scaled
