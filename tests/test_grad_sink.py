"""Expert weight gradients written straight into fp32 main gradients (:class:`~dropless.ops.grouped_gemm.GradSink`).

:class:`~dropless.train.grads.GradBuckets` puts a sink on every bf16 parameter; the routed experts
(:class:`~dropless.experts.GroupedExperts`) find it and their weight-gradient kernel writes the main
gradient in fp32 between ``start`` and ``finish``. Checked against the hook path (sinks removed: bf16
gradients copied into fp32) and a float64 reference, on the torch path (CPU: the same 16-bit products,
so equal bitwise) and the Triton kernel's (CUDA, or the interpreter: fp32 sums never rounded to 16
bits, so at least as close to float64 as the hook path). bf16 on CUDA, fp16 on a CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from dropless.experts import GroupedExperts
from dropless.layout import ExpertLayout
from dropless.ops import select
from dropless.ops.fp8_backend import Fp8Backend
from dropless.ops.grouped_gemm import GradSink
from dropless.ops.torch_backend import TorchBackend
from dropless.train.grads import GradBuckets

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = select.HAS_TRITON and (DEV == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
needs_kernel = pytest.mark.skipif(not KERNEL, reason="no CUDA and Triton's interpreter is off")
PATHS = ["torch", pytest.param("triton", marks=needs_kernel)]
# bf16 on CUDA; fp16 on a CPU (Triton's interpreter computes no bf16 dot products: numpy has no bf16)
DT = torch.bfloat16 if DEV == "cuda" else torch.float16
ULP = 2.0 ** -7 if DT == torch.bfloat16 else 2.0 ** -10   # one step of DT, relative (at most)
H, I, COUNTS, A = 32, 16, [5, 0, 9, 3], 8       # an empty expert (its gradient: exact zeros)


def _force(monkeypatch, path):
    if path == "triton" and DEV == "cpu":
        monkeypatch.setattr(select, "FORCE_TRITON", True)
    if path == "torch":
        monkeypatch.setattr(select, "use_triton", lambda t: False)


def _experts(seed=0):
    torch.manual_seed(seed)
    ex = GroupedExperts(H, I, len(COUNTS)).to(DEV)
    ex.init_weights(seed, 0, std=0.2)
    return ex.to(DT)


def _batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    lay = ExpertLayout.from_counts(torch.tensor(COUNTS, device=DEV), A, num_rows=sum(COUNTS) + 3)
    live = lay.live_mask()
    out = []
    for _ in range(n):
        x = torch.randn(lay.capacity, H, generator=gen).to(DEV, DT)
        dy = torch.randn(lay.capacity, H, generator=gen).to(DEV, DT)
        x[~live] = float("nan")   # padding rows never reach a gradient
        dy[~live] = 0.0
        out.append((x, dy))
    return lay, out


def _buckets(ex, sinks=True):
    params = list(ex.parameters())
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    return GradBuckets(params, set(), grads_are_params=False, owners=masters, sinks=sinks)


def _step(ex, gb, lay, batches, chunked=False):
    """One step of len(batches) micro-batches; the main gradients (w13, w2) after finish()."""
    gb.zero_()
    for i, (x, dy) in enumerate(batches):
        gb.start(sync=i == len(batches) - 1)
        if chunked:  # two chunks of one layer call sharing one accumulator
            w = ex.weights(DT, accumulate_wgrad=True)
            loss = sum((ex(xc, lay, weights=w).float() * dy.float()).sum() for xc in (x, x.roll(1, dims=1)))
            loss.backward()
        else:
            ex(x, lay).backward(dy)
        assert all(p.grad is None for p in ex.parameters())   # no placeholder or bf16 gradient left
    gb.finish()
    return [m.clone() for m in gb.main]


def _float64(ex, lay, batches, chunked=False):
    """float64 weight gradients summed over the micro-batches (and chunks; live rows only)."""
    w13, w2 = ex.w13.detach().double(), ex.w2.detach().double()
    g13, g2 = torch.zeros_like(w13), torch.zeros_like(w2)
    s, e = lay.start.tolist(), lay.end.tolist()
    chunks = [(xc, dy) for x, dy in batches for xc in ((x, x.roll(1, dims=1)) if chunked else (x,))]
    for x, dy in chunks:
        for i in range(len(COUNTS)):
            xi, dyi = x[s[i]:e[i]].double(), dy[s[i]:e[i]].double()
            h13 = xi @ w13[i]
            gate, up = h13[:, :I], h13[:, I:]
            sg = torch.sigmoid(gate)
            h = gate * sg * up
            g2[i] += h.t() @ dyi
            dh = dyi @ w2[i].t()
            dh13 = torch.cat([dh * up * sg * (1 + gate * (1 - sg)), dh * gate * sg], 1)
            g13[i] += xi.t() @ dh13
    return [g13, g2]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("chunked,micro", [(False, 1), (False, 2), (True, 2)])
def test_sink_gradients_equal_the_hook_path_and_float64(monkeypatch, path, chunked, micro):
    """One or two micro-batches (optionally two chunks each): the sink's main gradients equal the hook
    path's bitwise on the torch path without chunks; otherwise they are fp32 sums the hook path rounds to
    16 bits (one micro-batch: within one rounding of it), on average closer to float64; within rounding
    of float64 always; an empty
    expert's gradient is exact zeros either way; the step's main gradients exist once per step."""
    _force(monkeypatch, path)
    ex = _experts()
    lay, batches = _batches(micro)
    gb = _buckets(ex)
    got = _step(ex, gb, lay, batches, chunked)
    gb.remove()
    assert not hasattr(ex.w13, "main_grad_sink")
    want = _step(ex, _buckets(ex, sinks=False), lay, batches, chunked)
    ref = _float64(ex, lay, batches, chunked)
    for g, w, r in zip(got, want, ref):
        assert g.dtype == torch.float32 and torch.equal(g[1], torch.zeros_like(g[1]))
        assert torch.isfinite(g).all()
        if path == "torch" and not chunked:   # the same 16-bit products, copied into fp32
            assert torch.equal(g, w)
        else:  # fp32 sums (the kernel's, or of the chunks) where the hook path rounds to 16 bits
            assert not torch.equal(g, w)           # the test can tell the two apart
            if micro == 1 and not chunked:         # one micro-batch: the hook path is the sink rounded once
                assert (g.to(DT).float() - w).abs().le(w.abs() * ULP).all()
            assert (g.double() - r).abs().mean() <= (w.double() - r).abs().mean() * 1.02
        torch.testing.assert_close(g.double(), r, rtol=2e-2, atol=2e-2 * float(r.abs().max()))


@pytest.mark.parametrize("path", PATHS)
def test_a_second_step_overwrites_and_autograd_grad_outside_a_step_is_untouched(monkeypatch, path):
    """The next step's first micro-batch overwrites the sink (no leftover of the last step);
    ``torch.autograd.grad`` outside start/finish gets real gradients and leaves the main gradients as
    they were; a second GradBuckets on the same parameters is refused until the first is removed."""
    _force(monkeypatch, path)
    ex = _experts()
    lay, batches = _batches(3)
    gb = _buckets(ex)
    _step(ex, gb, lay, batches[:2])
    second = _step(ex, gb, lay, batches[2:])
    x, dy = batches[0]
    g13, g2 = torch.autograd.grad(ex(x, lay), (ex.w13, ex.w2), dy)
    for a, b in zip(gb.main, second):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="remove"):   # a second set of sinks on the same parameters
        _buckets(ex)
    gb.remove()
    h13, h2 = torch.autograd.grad(ex(x, lay), (ex.w13, ex.w2), dy)
    assert torch.equal(g13, h13) and torch.equal(g2, h2)
    only = _step(ex, _buckets(ex), lay, batches[2:])
    for a, b in zip(second, only):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", PATHS)
def test_a_backward_outside_a_step_fills_grad_as_autograd_does(monkeypatch, path):
    """``loss.backward()`` on the model outside start/finish (before the first step and after a
    finished one): ``.grad`` of w13 and w2 equal a model without GradBuckets, the main gradients
    are untouched (before, the hooks moved the gradient there, adding it to the finished step's),
    and the next step's zero_() drops the stray ``.grad``: the step equals a clean one."""
    _force(monkeypatch, path)
    ex = _experts()
    lay, batches = _batches(2)
    x, dy = batches[1]
    ex(x, lay).backward(dy)                          # no GradBuckets: the reference
    want = [ex.w13.grad.clone(), ex.w2.grad.clone()]
    ex.zero_grad(set_to_none=True)
    gb = _buckets(ex)
    ex(x, lay).backward(dy)                          # before any step
    assert torch.equal(ex.w13.grad, want[0]) and torch.equal(ex.w2.grad, want[1])
    step = _step(ex, gb, lay, batches[:1])
    clean = _experts()
    gc = _buckets(clean)
    for a, b in zip(step, _step(clean, gc, lay, batches[:1])):
        assert torch.equal(a, b)
    gc.remove()
    before = [m.clone() for m in gb.main]
    ex(x, lay).backward(dy)                          # after a finished step
    assert torch.equal(ex.w13.grad, want[0]) and torch.equal(ex.w2.grad, want[1])
    for m, b in zip(gb.main, before):
        assert torch.equal(m, b)


@pytest.mark.parametrize("fp32", [False, True])
def test_any_second_grad_buckets_on_the_same_parameters_is_refused(fp32):
    """Two sets of hooks would each take the gradient (the first registered wins, the other's main
    gradients go stale): refused for every kind of GradBuckets (bf16 without sinks, fp32), not only
    those with sinks; after the first's remove() a new one is accepted."""
    ex = _experts().float() if fp32 else _experts()
    params = list(ex.parameters())

    def make():
        if fp32:
            return GradBuckets(params, set(), grads_are_params=True)
        return GradBuckets(params, set(), grads_are_params=False, sinks=False,
                           owners=[torch.nn.Parameter(p.detach().float()) for p in params])

    first = make()
    with pytest.raises(ValueError, match="remove"):
        make()
    first.remove()
    make().remove()


@pytest.mark.parametrize("path", PATHS)
def test_fp8_backends_bf16_weight_gradient_is_written_as_the_torch_backends(monkeypatch, path):
    """gemm=fp8 keeps the weight gradient in bf16: into the sink it goes through the torch backend's writer
    (the Triton kernel's fp32 sums), bit for bit, not rounded to 16 bits first and copied."""
    _force(monkeypatch, path)
    lay, [(x, dy)] = _batches(1)
    got, want = (GradSink(torch.full((len(COUNTS), H, H), 7.0, device=DEV)) for _ in range(2))
    got.write(Fp8Backend(emulate=True), x, dy, lay)
    want.write(TorchBackend(), x, dy, lay)
    assert torch.equal(got.buf, want.buf) and torch.equal(got.buf[1], torch.zeros_like(got.buf[1]))
    if path == "triton":  # the kernel's fp32 sums: rounding them to 16 bits would change them
        assert not torch.equal(want.buf, want.buf.to(DT).float())
