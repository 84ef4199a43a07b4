"""Empty inputs of every shape through the router and the MoE layer, forward and backward (issue 11 item 4).

``[0, H]``, ``[0, S, H]`` and ``[B, 0, H]`` (a rank whose batch is empty, a zero-length
sequence): outputs of the input's shape, exact zero gradients of the right shapes, zero
counts and aux loss; ``[B, 0, H]`` used to raise in the router (``seq_len=0``).
"""

from __future__ import annotations

import pytest
import torch

from dropless import ModelArgs
from dropless.moe import MoE
from dropless.routing import Router

SHAPES = [(0, 16), (0, 5, 16), (3, 0, 16)]
BASE = dict(hidden_size=16, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
            topk_group=2, aux_loss_alpha=0.01, n_shared_experts=1)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("opts", [{}, dict(num_token_chunks=3), dict(expert_alignment=8, recompute_gather=True),
                                  dict(recompute_fc1=True, fold_routing_weights=True),
                                  dict(capacity_factor=1.25), dict(gemm="loop")])
def test_moe_layer_empty_input_forward_backward(shape, opts):
    m = MoE(ModelArgs(**{**BASE, **opts}), 0)
    m.init_weights(0)
    m.train()
    x = torch.randn(shape, requires_grad=True)
    y, aux = m(x, return_aux=True)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert aux.item() == 0.0 and m.aux_loss is aux
    (y.sum() + aux).backward()
    assert x.grad is not None and x.grad.shape == x.shape
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
        assert torch.equal(p.grad, torch.zeros_like(p)), name
    assert torch.equal(m.router.tokens_per_expert, torch.zeros(8, dtype=torch.int64))
    assert int(m.last_stats["rows_live"]) == 0


@pytest.mark.parametrize("seq_len", [None, 0, 5])
def test_router_empty_input(seq_len):
    r = Router(ModelArgs(**BASE), 0)
    r.train()
    x = torch.randn(0, 16, requires_grad=True)
    out = r(x, seq_len=seq_len)
    assert out.topk_idx_Tk.shape == (0, 2) and out.topk_weight_Tk.shape == (0, 2)
    assert out.scores_TE.shape == (0, 8)
    assert torch.equal(out.counts_E, torch.zeros(8, dtype=torch.int64))
    (out.topk_weight_Tk.sum() + out.aux_loss).backward()
    assert torch.equal(r.weight.grad, torch.zeros(8, 16)) and x.grad.shape == (0, 16)


def test_router_seq_len_zero_only_for_no_tokens():
    r = Router(ModelArgs(**BASE), 0)
    with pytest.raises(ValueError, match="seq_len=0"):
        r(torch.randn(4, 16), seq_len=0)
    with pytest.raises(ValueError, match="seq_len=3"):
        r(torch.randn(4, 16), seq_len=3)
