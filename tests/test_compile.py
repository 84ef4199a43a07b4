"""The MoE layer (local dispatcher) under ``torch.compile(fullgraph=True)``, forward and backward (issue 12 item 4).

CPU: ``backend="aot_eager"`` on the torch paths: output and every gradient bitwise equal to
eager (the Triton kernels' path, where the kernels are opaque ``torch.library.custom_op`` ops
with fake implementations, is tested the same way in tests/test_triton_kernels.py). GPU: inductor, bf16,
against eager within bf16 tolerance. The memory options (recompute, chunks) keep Python state
across forward and backward and do not compile as one graph.
"""

from __future__ import annotations

import pytest
import torch

from dropless import ModelArgs
from dropless.moe import MoE


def _layer(**kw) -> MoE:
    args = dict(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                topk_group=2, aux_loss_alpha=1e-3, expert_alignment=8, routed_scaling_factor=2.5)
    args.update(kw)
    m = MoE(ModelArgs(**args), 0)
    m.init_weights(1)
    return m.train()


def _fwd_bwd(fn, m, x, g):
    ps = [x] + [p for p in m.parameters() if p.requires_grad]
    y = fn(x)
    return (y, *torch.autograd.grad(y, ps, g))


def _check_equal(m, x, g, backend="aot_eager"):
    torch._dynamo.reset()
    eager = _fwd_bwd(m, m, x, g)
    compiled = _fwd_bwd(torch.compile(m, backend=backend, fullgraph=True), m, x, g)
    return eager, compiled


@pytest.mark.parametrize("kw", [{}, dict(fold_routing_weights=True)])
def test_moe_layer_compiles_as_one_graph_and_equals_eager(kw):
    torch.manual_seed(0)
    m = _layer(**kw)
    x = torch.randn(2, 12, 32, requires_grad=True)
    g = torch.randn(2, 12, 32)
    eager, compiled = _check_equal(m, x, g)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_layer_compiles_with_inductor_on_gpu():
    torch.manual_seed(2)
    m = _layer(hidden_size=256, moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4,
               expert_alignment=128).cuda().to(torch.bfloat16)
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    eager, compiled = _check_equal(m, x, g, backend="inductor")
    for a, b in zip(eager, compiled):
        assert torch.isfinite(b).all()
        assert ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item() < 2e-2
