"""CUDA graphs over the live-row path (issue 13 item 4; docs/design.md#the-live-row-contract, rule 1). GPU only.

Captured once at a fixed capacity ``M``, replayed with other device-side counts:

* the live-row kernels (SwiGLU forward, backward, fused FP8 quant, the permutation's scatter)
  with NaN in every padding input row and a byte sentinel in every padding output row before
  each replay: live rows bitwise equal to eager, padding rows of the outputs untouched;
* the experts' forward AND backward (outputs, input and weight gradients) with NaN in the
  padding input rows: live rows and weight gradients bitwise equal to eager (the grouped GEMMs
  write the alignment gaps of their outputs, so only the live-row kernels are held to
  "padding untouched");
* the whole MoE layer's forward and backward (local dispatcher; default, memory options,
  chunks), replayed with new inputs and router biases that move every row: output and every
  gradient bitwise equal to eager;
* one whole decoder block (MLA + MoE) forward and backward, the same way.

Counts replayed: the captured ones reversed, every expert empty, one expert holding every row,
random.
"""

from __future__ import annotations

import pytest
import torch

from dropless.layout import ExpertLayout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SENT = -12345.0


def _count_sets(e: int, m: int, a: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    base = [300, 0, 129, 700] + [17] * (e - 4)
    rnd = torch.randint(0, (m - e * a) // e, (e,), generator=g).tolist()
    return [list(reversed(base)), [0] * e, [m] + [0] * (e - 1), rnd]


def _set_layout(static: ExpertLayout, counts: list[int]) -> ExpertLayout:
    new = ExpertLayout.from_counts(torch.tensor(counts, device="cuda"), static.alignment, capacity=static.capacity)
    static.counts.copy_(new.counts)
    static.start.copy_(new.start)
    static.end.copy_(new.end)
    return new


def _capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_live_row_kernels_replay_with_other_counts():
    from dropless.ops import rows as rw
    from dropless.ops import swiglu as sw

    torch.manual_seed(0)
    e, I, A, M, H = 6, 256, 128, 2048, 128
    static = ExpertLayout.from_counts(torch.tensor([300, 0, 129, 700, 17, 17], device="cuda"), A, capacity=M)
    h13 = torch.randn(M, 2 * I, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(M, I, device="cuda", dtype=torch.bfloat16)
    N, k = 256, 8
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    dest = torch.full((N, k), -1, dtype=torch.int64, device="cuda")
    out = torch.empty(M, I, device="cuda", dtype=torch.bfloat16)
    dh = torch.empty(M, 2 * I, device="cuda", dtype=torch.bfloat16)
    q = torch.empty(M, I, device="cuda", dtype=torch.float8_e4m3fn)
    sc = torch.empty(I // 128, M, device="cuda").t()
    rows = [None]

    def step():
        sw.swiglu_fwd(h13, static, out=out)
        sw.swiglu_bwd(h13, dout, static, out=dh)
        sw.swiglu_quant(h13, static, out=(q, sc))
        rows[0] = rw.scatter_rows(x, dest, M)
        return rows[0]

    graph, rows_static = _capture(step)
    for counts in _count_sets(e, M - 5 * (A - 1), A):
        lay = _set_layout(static, counts)
        live = lay.live_mask()
        r = int(lay.counts.sum())
        perm = torch.nonzero(live).squeeze(1)[torch.randperm(r, device="cuda")]
        dest.fill_(-1)
        dest.view(-1)[: min(r, N * k)] = perm[: N * k]
        h13.normal_()
        h13[~live] = float("nan")
        dout.normal_()
        dout[~live] = float("nan")
        for t in (out, dh, sc, rows_static):
            t.fill_(SENT)
        q.view(torch.uint8).fill_(0x7E)
        graph.replay()
        eager = (sw.swiglu_fwd(h13, lay), sw.swiglu_bwd(h13, dout, lay), sw.swiglu_quant(h13, lay),
                 rw.scatter_rows(x, dest, M))
        assert torch.equal(out[live], eager[0][live]) and torch.equal(dh[live], eager[1][live])
        assert torch.equal(q.view(torch.uint8)[live], eager[2][0].view(torch.uint8)[live])
        assert torch.equal(sc[live], eager[2][1][live])
        assert (out[~live] == SENT).all() and (dh[~live] == SENT).all() and (sc[~live] == SENT).all()
        assert (q.view(torch.uint8)[~live] == 0x7E).all()
        landed = torch.zeros(M, dtype=torch.bool, device="cuda")
        landed[dest[dest >= 0]] = True
        assert torch.equal(rows_static[landed], eager[3][landed]) and (rows_static[~landed] == SENT).all()


@pytest.mark.parametrize("kw", [{}, dict(recompute_fc1=True), dict(recompute_swiglu=True)])
def test_experts_forward_and_backward_replay_with_other_counts(kw):
    from dropless.experts import GroupedExperts

    torch.manual_seed(1)
    e, H, I, A, M = 4, 256, 128, 128, 2048
    ex = GroupedExperts(H, I, e, **kw).cuda().to(torch.bfloat16)
    ex.init_weights(0, 0)
    static = ExpertLayout.from_counts(torch.tensor([300, 0, 129, 700], device="cuda"), A, capacity=M)
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)

    def step(layout=static):
        y = ex(x, layout)
        return (y, *torch.autograd.grad(y, [x, ex.w13, ex.w2], gy))

    graph, outs = _capture(step)
    for counts in _count_sets(e, M - 3 * (A - 1), A, seed=1):
        lay = _set_layout(static, counts)
        live = lay.live_mask()
        with torch.no_grad():
            x.normal_()
            x[~live] = float("nan")
            gy.normal_()
            gy[~live] = float("nan")
        graph.replay()
        eager = step(lay)
        assert torch.equal(outs[0][live], eager[0][live]) and torch.equal(outs[1][live], eager[1][live])
        assert torch.equal(outs[2], eager[2]) and torch.equal(outs[3], eager[3])
        assert torch.isfinite(outs[2]).all() and torch.isfinite(outs[3]).all()
        for i, c in enumerate(counts):
            if c == 0:
                assert (outs[2][i] == 0).all() and (outs[3][i] == 0).all()


@pytest.mark.parametrize("kw", [{}, dict(num_token_chunks=3),
                                dict(recompute_fc1=True, fold_routing_weights=True, recompute_gather=True),
                                dict(num_token_chunks=2, recompute_fc1=True, fold_routing_weights=True,
                                     recompute_gather=True)])
def test_whole_moe_layer_forward_and_backward_replay(kw):
    from dropless import ModelArgs
    from dropless.moe import MoE

    torch.manual_seed(2)
    E, H = 16, 256
    args = ModelArgs(hidden_size=H, moe_intermediate_size=128, n_routed_experts=E, num_experts_per_tok=4, n_group=4,
                     topk_group=2, routed_scaling_factor=2.5, aux_loss_alpha=1e-3, expert_alignment=128, **kw)
    m = MoE(args, 0)
    m.init_weights(3)
    m = m.cuda().to(torch.bfloat16).train()
    bias = m.router.e_score_correction_bias
    x = torch.randn(2, 128, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(2, 128, H, device="cuda", dtype=torch.bfloat16)
    params = [x] + [p for p in m.parameters() if p.requires_grad]

    def step():
        y = m(x)
        return (y, *torch.autograd.grad(y, params, gy))

    graph, outs = _capture(step)
    biases = [torch.zeros(E), torch.arange(E, dtype=torch.float32).flip(0), torch.full((E,), -100.0),
              torch.randn(E)]
    biases[2][:4] = 100.0  # every token to the same 4 experts: 12 empty, 4 holding every row
    for b in biases:
        with torch.no_grad():
            bias.copy_(b)
            x.normal_()
            gy.normal_()
        graph.replay()
        eager = step()
        for a, r in zip(outs, eager):
            assert torch.equal(a, r)


def test_whole_decoder_block_forward_and_backward_replay():
    """One decoder layer (RMSNorm + MLA + RMSNorm + MoE, local dispatcher, bf16) forward and backward
    captured once, replayed with new inputs and router biases that move every row (reversed,
    all tokens on four experts, random): the block's output, its aux loss and every gradient
    bitwise equal to eager. Capture itself checks that nothing in the block syncs with the host.
    S = 64 keeps the attention to a single key block, where SDPA's backward gave the same bits
    run after run on the H200."""
    from dropless import ModelArgs
    from dropless.model.rope import rope_cos_sin
    from dropless.model.transformer import Block

    torch.manual_seed(4)
    E, H, S = 16, 256, 64
    args = ModelArgs(hidden_size=H, moe_intermediate_size=128, n_routed_experts=E, num_experts_per_tok=4, n_group=4,
                     topk_group=2, routed_scaling_factor=2.5, aux_loss_alpha=1e-3, expert_alignment=128,
                     num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                     v_head_dim=32)
    block = Block(args, 1, moe=True)
    block.attention.init_weights(0.02, torch.Generator().manual_seed(0))
    block.moe.init_weights(3)
    block = block.cuda().to(torch.bfloat16).train()
    cos, sin = rope_cos_sin(S, args.qk_rope_head_dim, args.rope_theta, device="cuda")
    bias = block.moe.router.e_score_correction_bias
    x = torch.randn(2, S, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(2, S, H, device="cuda", dtype=torch.bfloat16)
    params = [x] + [p for p in block.parameters() if p.requires_grad]

    def step():
        y, aux = block(x, cos, sin)
        return (y, aux, *torch.autograd.grad([y, aux], params, [gy, torch.ones_like(aux)]))

    graph, outs = _capture(step)
    biases = [torch.arange(E, dtype=torch.float32).flip(0), torch.full((E,), -100.0), torch.randn(E)]
    biases[1][:4] = 100.0  # every token to the same 4 experts: 12 empty, 4 holding every row
    for b in biases:
        with torch.no_grad():
            bias.copy_(b)
            x.normal_()
            gy.normal_()
        graph.replay()
        eager = step()
        assert len(outs) == len(eager) == 2 + len(params)
        for a, r in zip(outs, eager):
            assert torch.isfinite(a).all() and torch.equal(a, r)
