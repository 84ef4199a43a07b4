"""Multi-token prediction (DeepSeek-V3 §2.2): which tokens each depth sees and scores, its
loss against a float64 evaluation of the report's formulas, gradients, training, and the MTP
block's place among the MoE layers. (Its agreement with transformers' decoder layer on
imported weights: tests/test_convert_hf.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dropless.config import ConfigError, ModelArgs
from dropless.model import Transformer
from dropless.model.rope import rope_cos_sin
from dropless.routing import update_router_biases


def _args(**over) -> ModelArgs:
    d = dict(vocab_size=48, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
             n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, aux_loss_alpha=0.0,
             num_nextn_predict_layers=2, mtp_loss_weight=0.3, initializer_range=0.1, seed=2)
    d.update(over)
    return ModelArgs(**d)


def _model(**over) -> Transformer:
    m = Transformer(_args(**over))
    m.init_weights()
    return m


def _final_hidden(model, tokens):
    box = {}
    handle = model.norm.register_forward_hook(lambda mod, i, o: box.__setitem__("h", o))
    logits = model(tokens)
    handle.remove()
    return logits, box["h"]


def _batch(seed=0, B=2, S=10, V=48):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, V, (B, S + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def _rms(v, w):
    return v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-6) * w


def test_loss_is_the_reports_formula_in_float64():
    model = _model(gemm="loop").double().eval()
    x, y = _batch()
    with torch.no_grad():
        _, h = _final_hidden(model, x)
        got = model.mtp_loss(h, x, y)
        # report eq. 21-25 written out: h'_i = M [enorm(Emb(t_{i+k})); hnorm(h_i^{k-1})], h^k = TRM_k(h'),
        # CE on t_{i+k+1} = y[i+k]; L = λ/D Σ_k CE_k
        S = x.shape[1]
        cos, sin = rope_cos_sin(S, 8, model.args.rope_theta, dtype=torch.float64)
        prev, ces = h, []
        for k, mod in enumerate(model.mtp.layers, start=1):
            n = S - k
            e = model.tok_embeddings.weight[x[:, k:]]
            hp = torch.cat([_rms(e, mod.enorm.weight), _rms(prev[:, :n], mod.hnorm.weight)], -1) @ mod.eh_proj.weight.T
            prev, _ = mod.block(hp, cos[:n], sin[:n])  # a Block returns (h, aux)
            logits = _rms(prev, mod.head_norm.weight) @ model.output.weight.T
            ces.append(F.cross_entropy(logits.flatten(0, 1), y[:, k:].reshape(-1)))
        want = 0.3 / 2 * (ces[0] + ces[1])
    assert got.dtype == torch.float64 and want > 1.0
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    # fp32 gives the same loss to fp32 accuracy
    m32 = _model(gemm="loop").eval()
    with torch.no_grad():
        _, h32 = _final_hidden(m32, x)
        torch.testing.assert_close(m32.mtp_loss(h32, x, y).double(), want, rtol=2e-5, atol=0)


def test_depth_k_sees_tokens_up_to_i_plus_k_and_scores_i_plus_k_plus_1():
    model = _model(num_nextn_predict_layers=1).eval()
    x, y = _batch(S=12)

    def ce(hn, lab):
        return F.cross_entropy(model.output(hn).flatten(0, 1), lab.reshape(-1), reduction="none")

    cos, sin = rope_cos_sin(12, 8, model.args.rope_theta)
    with torch.no_grad():
        _, h = _final_hidden(model, x)
        _, (per_pos,) = model.mtp(h, x, y, model.tok_embeddings, ce, cos, sin)
        assert per_pos.shape == (2 * 11,)
        # label y[:, 0] (= t_1) is not scored by depth 1; y[:, 1] (= t_2, predicted at i = 0) is
        y0 = y.clone()
        y0[:, 0] = (y0[:, 0] + 1) % 48
        assert torch.equal(model.mtp(h, x, y0, model.tok_embeddings, ce, cos, sin)[1][0], per_pos)
        y1 = y.clone()
        y1[:, 1] = (y1[:, 1] + 1) % 48
        diff = (model.mtp(h, x, y1, model.tok_embeddings, ce, cos, sin)[1][0] - per_pos).view(2, 11)
        assert (diff[:, 0] != 0).all() and (diff[:, 1:] == 0).all()
        # causal: changing token t_7 leaves depth 1's predictions at i < 6 (inputs t_{<=i+1}) unchanged, up
        # to fp32 rounding: the changed tokens route elsewhere, which changes the experts' row counts and
        # with them the GEMM kernels' summation order for every row (seen: 2.4e-7 on a 2-core CPU)
        x2 = x.clone()
        x2[:, 7] = (x2[:, 7] + 5) % 48
        _, h2 = _final_hidden(model, x2)
        d = (model.mtp(h2, x2, y, model.tok_embeddings, ce, cos, sin)[1][0] - per_pos).view(2, 11)
        assert d[:, :6].abs().max() < 1e-5 and d[:, 6:].abs().max() > 1e-3, d


def test_gradients_reach_the_module_and_the_shared_embedding_and_head():
    model = _model()
    x, y = _batch()
    _, h = _final_hidden(model, x)
    model.mtp_loss(h.detach(), x, y).backward()  # only the MTP path
    mtp = model.mtp.layers[0]
    for p in (mtp.eh_proj.weight, mtp.enorm.weight, mtp.hnorm.weight, mtp.head_norm.weight,
              mtp.block.attention.wkv_a.weight, mtp.block.moe.experts.w13, mtp.block.moe.router.weight,
              model.tok_embeddings.weight, model.output.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert model.layers["0"].attention.wkv_a.weight.grad is None       # h was detached: the trunk got nothing


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    x, y = _batch()
    out = []
    for ac in (False, True):
        model = _model()
        model.activation_checkpointing = ac
        logits, h = _final_hidden(model, x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.reshape(-1)) + model.mtp_loss(h, x, y)
        loss.backward()
        out.append((loss.detach(), model.mtp.layers[1].eh_proj.weight.grad.clone()))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=0, atol=1e-6)


def test_training_lowers_the_mtp_loss():
    torch.manual_seed(0)
    model = _model(aux_loss_alpha=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = _batch(seed=4, B=4, S=16)
    first = last = None
    for _ in range(25):
        logits, h = _final_hidden(model, x)
        mtp = model.mtp_loss(h, x, y)
        (F.cross_entropy(logits.flatten(0, 1), y.reshape(-1)) + mtp).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_router_biases(model)
        first = float(mtp.detach()) if first is None else first
        last = float(mtp.detach())
    assert last < 0.7 * first


def test_mtp_blocks_are_moe_layers_of_their_own():
    model = _model()
    assert [b.layer_id for b in model.mtp.blocks()] == [2, 3]
    moes = model.moe_layers()
    assert len(moes) == 1 + 2 and moes[-1] is model.mtp.layers[1].block.moe
    experts = {id(p) for p in model.expert_parameters()}
    assert id(model.mtp.layers[0].block.moe.experts.w13) in experts
    assert id(model.mtp.layers[0].eh_proj.weight) not in experts
    stats = update_router_biases(model)
    assert set(stats) == {"layer1", "layer2", "layer3"}
    # the block is dense where its layer index says so (layer 3 off the moe_layer_freq = 2 grid)
    dense = _model(num_hidden_layers=3, moe_layer_freq=2, num_nextn_predict_layers=1)
    assert not dense.mtp.layers[0].block.moe_enabled and len(dense.moe_layers()) == 1


def test_bad_uses_raise():
    x, y = _batch(S=2)
    model = _model()
    _, h = _final_hidden(model, x)
    with pytest.raises(ValueError, match="sequence length 2 leaves no position for depth 2"):
        model.mtp_loss(h, x, y)
    plain = _model(num_nextn_predict_layers=0)
    assert plain.mtp is None
    with pytest.raises(ValueError, match="no MTP module"):
        plain.mtp_loss(h, x, y)
    for field, value in (("num_nextn_predict_layers", -1), ("mtp_loss_weight", -0.1)):
        with pytest.raises(ConfigError, match=field):
            _args(**{field: value}).validate()


def test_a_block_that_returns_its_aux_loss_has_it_added():
    """Blocks that return ``(h, aux)`` (the aux loss joining the caller's loss) get it summed in."""
    model = _model()
    x, y = _batch()
    _, h = _final_hidden(model, x)
    base = model.mtp_loss(h.detach(), x, y)

    class WithAux(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, *a):
            h, aux = self.block(*a)
            return h, (0.0 if aux is None else aux) + torch.tensor(0.25)

    for mod in model.mtp.layers:
        mod.block = WithAux(mod.block)
    torch.testing.assert_close(model.mtp_loss(h.detach(), x, y), base + 0.5, rtol=0, atol=1e-6)


def test_training_loss_adds_the_weighted_mtp_loss():
    """``Transformer.loss`` = CE + Σ aux + the MTP loss (its weight included), through the chunked head."""
    model = _model(aux_loss_alpha=1e-2, gemm="loop").double()
    x, y = _batch()
    out = model.loss(x, y)
    _, h = _final_hidden(model, x)
    assert out.mtp is not None and float(out.mtp) > 0
    torch.testing.assert_close(out.mtp, model.mtp_loss(h, x, y), rtol=1e-10, atol=0)
    torch.testing.assert_close(out.loss, out.ce + out.aux + out.mtp, rtol=0, atol=0)
    g_mtp = torch.autograd.grad(out.loss, model.mtp.layers[0].eh_proj.weight)[0]
    assert g_mtp.abs().sum() > 0
    off = _model(aux_loss_alpha=1e-2, mtp_loss_weight=0.0, gemm="loop").double().loss(x, y)
    assert off.mtp is None
    torch.testing.assert_close(off.loss, off.ce + off.aux, rtol=0, atol=0)
