"""The DeepSeek-V3-shaped decoder (dropless.model): MLA maths, causality, the
published 671B config, training, activation checkpointing, deterministic init."""

from __future__ import annotations

import cmath
import copy
import dataclasses
import math
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dropless.config import ConfigError, ModelArgs
from dropless.model import MLA, RMSNorm, Transformer, apply_rope, count_parameters, rope_cos_sin

DATA = Path(__file__).parent / "data"


def tiny_args(**overrides) -> ModelArgs:
    """4 layers (1 dense + 3 MoE), 8 experts top-2 in 4 groups: CPU-sized V3."""
    d = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
             num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=24,
             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
             topk_group=2, max_position_embeddings=64, seed=3)
    d.update(overrides)
    return ModelArgs(**d)


# --------------------------------------------------------------------------- MLA
def _rms_ref(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope_ref(vec, pos, theta):
    """Rotate interleaved pairs (2i, 2i+1) of a 1-D float64 vector with complex numbers."""
    d = vec.numel()
    out = vec.clone()
    for i in range(d // 2):
        z = complex(vec[2 * i].item(), vec[2 * i + 1].item())
        z = z * cmath.exp(1j * pos * theta ** (-(2 * i) / d))
        out[2 * i], out[2 * i + 1] = z.real, z.imag
    return out


def mla_reference(attn: MLA, x_BSH: torch.Tensor, theta: float, eps: float) -> torch.Tensor:
    """Straightforward float64 MLA: explicit heads, explicit causal mask, complex RoPE."""
    W = {n: p.detach().double() for n, p in attn.named_parameters()}
    x = x_BSH.double()
    B, S, _ = x.shape
    N, Dn, Dr, Dv, C = (attn.n_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim,
                        attn.v_head_dim, attn.kv_lora_rank)
    Dq = Dn + Dr
    out = torch.zeros(B, S, attn.dim, dtype=torch.float64)
    for b in range(B):
        if attn.q_lora_rank:
            q = _rms_ref(x[b] @ W["wq_a.weight"].T, W["q_norm.weight"], eps) @ W["wq_b.weight"].T
        else:
            q = x[b] @ W["wq.weight"].T
        q = q.view(S, N, Dq)
        kv = x[b] @ W["wkv_a.weight"].T
        c, k_pe = kv[:, :C], kv[:, C:]
        kvb = (_rms_ref(c, W["kv_norm.weight"], eps) @ W["wkv_b.weight"].T).view(S, N, Dn + Dv)
        k_rot = torch.stack([_rope_ref(k_pe[s], s, theta) for s in range(S)])      # [S, Dr]
        heads = []
        for n in range(N):
            q_n = torch.stack([torch.cat([q[s, n, :Dn], _rope_ref(q[s, n, Dn:], s, theta)])
                               for s in range(S)])                                     # [S, Dq]
            k_n = torch.cat([kvb[:, n, :Dn], k_rot], dim=1)                            # [S, Dq]
            v_n = kvb[:, n, Dn:]                                                        # [S, Dv]
            scores = (q_n @ k_n.T) / math.sqrt(Dq)
            mask = torch.zeros(S, S, dtype=torch.float64)
            for i in range(S):
                for j in range(S):
                    if j > i:
                        mask[i, j] = float("-inf")
            p = torch.softmax(scores + mask, dim=-1)
            heads.append(p @ v_n)
        out[b] = torch.cat(heads, dim=1) @ W["wo.weight"].T
    return out


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_mla_matches_float64_reference(q_lora_rank):
    args = tiny_args(q_lora_rank=q_lora_rank, rope_theta=50.0)  # small theta: every pair rotates a lot
    torch.manual_seed(0)
    attn = MLA(args).double()
    gen = torch.Generator().manual_seed(1)
    attn.init_weights(std=0.3, generator=gen)
    for norm in attn.norms():  # non-trivial norm scales
        norm.weight.data.uniform_(0.5, 1.5, generator=gen)
    assert (q_lora_rank == 0) == hasattr(attn, "wq")
    x = torch.randn(2, 7, args.hidden_size, dtype=torch.float64, generator=gen)
    cos, sin = rope_cos_sin(7, args.qk_rope_head_dim, args.rope_theta, dtype=torch.float64)
    got = attn(x, cos, sin)
    want = mla_reference(attn, x, args.rope_theta, args.rms_norm_eps)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)

    # The float32 module (fp32 RoPE tables) agrees with the float64 reference to fp32 accuracy.
    attn32 = copy.deepcopy(attn).float()
    cos32, sin32 = rope_cos_sin(7, args.qk_rope_head_dim, args.rope_theta)
    got32 = attn32(x.float(), cos32, sin32)
    torch.testing.assert_close(got32.double(), want, rtol=1e-4, atol=1e-5)


def test_rope_is_relative():
    """<RoPE(q, m), RoPE(k, n)> depends only on m - n, and rotation keeps norms."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64, generator=gen)
    k = torch.randn(1, 1, 1, 8, dtype=torch.float64, generator=gen)
    cos, sin = rope_cos_sin(40, 8, 10000.0, dtype=torch.float64)

    def at(v, pos):
        return apply_rope(v.expand(1, 40, 1, 8).contiguous(), cos, sin)[0, pos, 0]

    d1 = at(q, 9) @ at(k, 4)
    d2 = at(q, 35) @ at(k, 30)
    assert abs(d1 - d2) < 1e-12
    assert abs(d1 - q.flatten() @ k.flatten()) > 1e-3        # the rotation did something
    assert abs(at(q, 17).norm() - q.norm()) < 1e-12


def test_rmsnorm_computes_in_fp32_and_casts_back():
    norm = RMSNorm(16, eps=1e-6)
    norm.weight.data = torch.linspace(0.5, 2.0, 16)
    x = (torch.randn(3, 16) * 100).bfloat16()
    y = norm(x)
    assert y.dtype == torch.bfloat16
    want = _rms_ref(x.double(), norm.weight.double(), 1e-6)
    torch.testing.assert_close(y.double(), want, rtol=8e-3, atol=0)  # one bf16 rounding


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rmsnorm_bf16_weight_equals_fp32_compute_and_saves_no_fp32_copy(device):
    """bf16 input and bf16 weight (train.dtype=bf16): F.rms_norm is called on bf16 directly; the
    output and gradients equal the cast-up-first computation; on CUDA (the fused kernel)
    autograd saves no fp32 tensor of the input's size."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(3)
    w = torch.linspace(0.5, 2.0, 64).bfloat16().to(device)
    x = (torch.randn(5, 64, generator=gen) * 10).bfloat16().to(device).requires_grad_()
    g = torch.randn(5, 64, generator=gen).bfloat16().to(device)
    norm = RMSNorm(64, eps=1e-6).bfloat16().to(device)
    norm.weight.data = w.clone()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t):
        y = norm(x)
    y.backward(g)
    assert y.dtype == torch.bfloat16
    if device == "cuda":
        assert not [s for s in saved if s[0] == torch.float32 and s[1] == x.numel()]
    x2 = x.detach().clone().requires_grad_()
    w2 = w.clone().requires_grad_()
    y2 = torch.nn.functional.rms_norm(x2.float(), (64,), w2.float(), 1e-6).bfloat16()
    y2.backward(g)
    assert torch.equal(y, y2)
    torch.testing.assert_close(x.grad.double(), x2.grad.double(), rtol=8e-3, atol=1e-3)
    torch.testing.assert_close(norm.weight.grad.double(), w2.grad.double(), rtol=8e-3, atol=1e-2)
    want = _rms_ref(x.detach().double(), w.double(), 1e-6)
    torch.testing.assert_close(y.double(), want, rtol=8e-3, atol=0)


# ----------------------------------------------------------------- whole model
def test_rope_tables_are_built_once_per_length_device_and_dtype():
    """The forward reuses the tables of an earlier forward with the same S (no cos/sin kernels),
    and they equal rope_cos_sin's; another S or dtype builds its own."""
    from torch.utils._python_dispatch import TorchDispatchMode

    args = tiny_args(num_hidden_layers=2)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.__name__.split(".")[0] in ("cos", "sin")
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        with Count() as first:
            out1 = model(tokens)
        with Count() as second:
            out2 = model(tokens)
    assert first.n == 2 and second.n == 0
    assert torch.equal(out1, out2)
    cos, sin = model.rope_tables(12, out1)
    want = rope_cos_sin(12, args.qk_rope_head_dim, args.rope_theta, max_position_embeddings=64)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    assert model.rope_tables(12, out1)[0] is cos
    assert model.rope_tables(8, out1)[0].shape[0] == 8
    assert model.rope_tables(12, out1.double())[0].dtype == torch.float64
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.rope_tables(65, out1)


def test_causal_later_tokens_do_not_change_earlier_logits():
    model = Transformer(tiny_args())
    model.init_weights()
    model.eval()
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 128, (2, 24), generator=gen)
    changed = tokens.clone()
    changed[:, 15:] = (changed[:, 15:] + 7) % 128
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.dtype == torch.float32 and a.shape == (2, 24, 128)
    torch.testing.assert_close(a[:, :15], b[:, :15], rtol=0, atol=1e-6)
    assert (a[:, 15:] - b[:, 15:]).abs().max() > 1e-3


def test_published_deepseek_v3_config_loads_and_counts_671b_37b():
    with pytest.warns(UserWarning) as record:
        args = ModelArgs.from_json(DATA / "deepseek_v3_config.json")
    message = " ".join(str(w.message) for w in record)
    for key in ("architectures", "quantization_config"):
        assert key in message
    assert "rope_scaling" not in message and args.rope_scaling["type"] == "yarn"  # kept and applied (test_yarn.py)
    assert "num_nextn_predict_layers" not in message     # read: the released model has one MTP module
    assert args == ModelArgs.deepseek_v3_671b(num_nextn_predict_layers=1)
    with_mtp = args
    args = dataclasses.replace(args, num_nextn_predict_layers=0)   # the main model: 671B / 37B

    t0 = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(args)
    assert time.perf_counter() - t0 < 30
    assert all(p.is_meta for p in model.parameters())
    assert len(model.moe_layers()) == 58 and len(model.layers) == 61

    total, activated = count_parameters(model)

    # Independent count from the published shapes (no MTP module).
    H, V, L, dense, N = 7168, 129280, 61, 3, 128
    Q, C, Dn, Dr, Dv = 1536, 512, 128, 64, 128
    I_dense, I, E, k = 18432, 2048, 256, 8
    attn = H * Q + Q + Q * N * (Dn + Dr) + H * (C + Dr) + C + C * N * (Dn + Dv) + N * Dv * H
    norms = 2 * H
    expert = 3 * H * I
    routed = (L - dense) * E * expert
    embedding = V * H
    rest = (V * H + H + L * (attn + norms) + dense * 3 * H * I_dense      # head, final norm, layers
            + (L - dense) * (E * H + expert))          # router weight + one shared expert
    assert total == embedding + rest + routed
    assert activated == rest + (L - dense) * k * expert          # the embedding lookup is not counted

    assert abs(total - 671e9) / 671e9 < 0.005                    # "671B total"
    # "37B activated": 36.63B here; DeepSeek rounds (and leaves the 0.93B input embedding out,
    # see the V2-Lite check below), so 37B is matched to 1.1 %, not 0.5 %.
    assert abs(activated - 37e9) / 37e9 < 0.011

    # The MTP module (layer 61 of the released files): enorm, hnorm, eh_proj [H, 2H], one MoE
    # layer, head norm; it shares the embedding and the head, which the Hugging Face files store
    # again in layer 61: "685B ... includes 671B of the Main Model weights and 14B of the MTP
    # Module weights" (the model card).
    with torch.device("meta"):
        model = Transformer(with_mtp)
    assert len(model.moe_layers()) == 59 and model.mtp.layers[0].block.layer_id == 61
    mtp = sum(p.numel() for p in model.mtp.parameters())
    assert mtp == 2 * H * H + 3 * H + attn + norms + E * H + expert + E * expert
    assert count_parameters(model)[0] == total + mtp
    assert abs(total + mtp + 2 * V * H - 685e9) / 685e9 < 0.005
    assert abs(mtp + 2 * V * H - 14e9) / 14e9 < 0.05


def test_deepseek_v2_lite_counts_fix_the_activated_convention():
    """DeepSeek-V2-Lite ("15.7B total, 2.4B activated", its model card) pins down what
    "activated" counts: 2.45B without the input embedding, 2.66B with it."""
    args = ModelArgs(vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                     moe_intermediate_size=1408, num_hidden_layers=27, first_k_dense_replace=1,
                     num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
                     qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                     n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1,
                     topk_group=1, scoring_func="softmax", topk_method="greedy")
    with torch.device("meta"):
        model = Transformer(args)
    total, activated = count_parameters(model)
    assert abs(total - 15.7e9) / 15.7e9 < 0.005
    assert abs(activated - 2.4e9) / 2.4e9 < 0.025
    assert abs(activated + 102400 * 2048 - 2.4e9) / 2.4e9 > 0.1


def test_count_matches_planner():
    plan = pytest.importorskip("dropless.plan")
    for args in (ModelArgs.deepseek_v3_671b(), tiny_args(), tiny_args(q_lora_rank=0)):
        with torch.device("meta"):
            model = Transformer(args)
        counts = plan.param_counts(args)
        assert (counts.total, counts.activated) == count_parameters(model)


def test_expert_and_non_expert_parameters_partition_the_model():
    args = tiny_args()
    model = Transformer(args)
    experts, rest = model.expert_parameters(), model.non_expert_parameters()
    ids_e, ids_r = {id(p) for p in experts}, {id(p) for p in rest}
    assert not ids_e & ids_r
    assert ids_e | ids_r == {id(p) for p in model.parameters()}
    H, I, E = args.hidden_size, args.moe_intermediate_size, args.n_routed_experts
    assert sum(p.numel() for p in experts) == args.num_moe_layers * E * 3 * H * I
    total, activated = count_parameters(model)
    assert total == sum(p.numel() for p in model.parameters())
    unused_experts = args.num_moe_layers * (E - args.num_experts_per_tok) * 3 * H * I
    assert total - activated == unused_experts + args.vocab_size * H     # + the embedding table


def test_tiny_model_overfits_a_batch():
    """30 AdamW steps on one fixed batch (about 2 s on an idle 2-core CPU)."""
    torch.manual_seed(0)
    model = Transformer(tiny_args())
    model.init_weights()
    model.train()
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 128, (2, 33), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(30):
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(128)) < 0.2          # starts near uniform
    assert losses[-1] < 0.3 * losses[0], losses


def test_activation_checkpointing_gives_identical_loss_and_grads():
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 128, (2, 17), generator=gen)

    def run(ckpt: bool):
        model = Transformer(tiny_args(), activation_checkpointing=ckpt)
        model.init_weights()
        model.train()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss0, grads0 = run(False)
    loss1, grads1 = run(True)
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        assert grads0[name] is not None, name
        torch.testing.assert_close(grads1[name], grads0[name], rtol=0, atol=0, msg=name)


def test_same_seed_gives_bitwise_identical_weights():
    def weights(seed=None, **kw):
        m = Transformer(tiny_args(**kw))
        m.init_weights(seed)
        return m.state_dict()

    a, b = weights(), weights()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    c = weights(seed=4)
    assert not torch.equal(a["layers.0.attention.wkv_a.weight"], c["layers.0.attention.wkv_a.weight"])
    assert not torch.equal(a["layers.1.moe.experts.w13"], c["layers.1.moe.experts.w13"])
    d = weights(seed=3)                     # args.seed (3) is the default
    for name in a:
        assert torch.equal(a[name], d[name]), name
    # Norms start at one; linears and embedding at std initializer_range.
    assert torch.equal(a["norm.weight"], torch.ones(32))
    for name in ("tok_embeddings.weight", "output.weight", "layers.0.feed_forward.w1.weight"):
        assert abs(a[name].std().item() - 0.02) < 0.002, name
    # Different tensors get different draws.
    assert not torch.equal(a["layers.0.feed_forward.w1.weight"], a["layers.0.feed_forward.w3.weight"])


def test_meta_build_then_to_empty_and_init_equals_eager_init():
    eager = Transformer(tiny_args())
    eager.init_weights()
    with torch.device("meta"):
        lazy = Transformer(tiny_args())
    lazy.to_empty(device="cpu")
    lazy.init_weights()
    want, got = eager.state_dict(), lazy.state_dict()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_float64_model_and_bf16_model_return_float_logits():
    tokens = torch.randint(0, 128, (1, 9))
    m = Transformer(tiny_args(first_k_dense_replace=4))
    m.init_weights()
    ref = m(tokens)
    m64 = copy.deepcopy(m).double()
    assert m64(tokens).dtype == torch.float64
    torch.testing.assert_close(m64(tokens).float(), ref, rtol=1e-4, atol=1e-5)
    mbf = copy.deepcopy(m).bfloat16()
    out = mbf(tokens)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() < 0.05


def test_bad_inputs_raise_clear_errors():
    model = Transformer(tiny_args(first_k_dense_replace=4))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        model(torch.zeros(8, dtype=torch.long))
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        Transformer(tiny_args(tie_word_embeddings=True))
    with pytest.raises(ConfigError, match="n_group"):
        Transformer(tiny_args(n_group=3))


@pytest.mark.parametrize("field, value", [("moe_layer_freq", 0), ("max_position_embeddings", 0),
                                          ("q_lora_rank", -1), ("seq_aux", False)])
def test_model_args_rejects_values_that_would_be_ignored_or_fail_late(field, value):
    """moe_layer_freq=0 used to be read as 1 and seq_aux=False (batch-wise aux loss) was ignored."""
    with pytest.raises(ConfigError, match=f"{field}={value!r}"):
        Transformer(tiny_args(**{field: value}))
    tiny_args(seq_aux=False, aux_loss_alpha=0.0).validate()  # no aux loss at all: seq_aux does not matter


def test_q_lora_rank_null_in_json_builds_direct_query(tmp_path):
    cfg = tiny_args().to_dict()
    cfg["q_lora_rank"] = None
    path = tmp_path / "config.json"
    path.write_text(__import__("json").dumps(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error")             # all keys are known: no warning
        args = ModelArgs.from_json(path)
    model = Transformer(args)
    attn = model.layers["0"].attention
    assert hasattr(attn, "wq") and not hasattr(attn, "wq_a")
    assert attn.wq.weight.shape == (4 * 12, 32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_feed_forward_saves_x_a_b_only_and_equals_the_plain_modules(dtype):
    """FeedForward's fused autograd Function: output and every gradient bitwise equal to
    ``w2(silu(w1 x) * w3 x)`` through plain autograd, with 2 activation tensors fewer saved."""
    from dropless.mlp import FeedForward
    gen = torch.Generator().manual_seed(11)
    m = FeedForward(32, 48).to(dtype)
    with torch.no_grad():
        for lin in (m.w1, m.w3, m.w2):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.2)
    x = torch.randn(2, 5, 32, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(2, 5, 32, generator=gen).to(dtype)

    def run(fn):
        x.grad = None
        m.zero_grad()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            y = fn(x)
        y.backward(g)
        acts = [s for s in saved if s[-1] == 48 and s[:-1].numel() == 10]  # [T=10, hidden] activations
        return y.detach(), [t.grad.clone() for t in (x, m.w1.weight, m.w3.weight, m.w2.weight)], len(acts)

    y1, g1, n1 = run(m)
    y2, g2, n2 = run(lambda t: m.w2(torch.nn.functional.silu(m.w1(t)) * m.w3(t)))
    assert torch.equal(y1, y2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    assert n1 == 2 and n2 >= 4


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("n_nope", [0, 6])
def test_rope_tail_equals_split_rope_cat_and_saves_no_activation(dtype, n_nope):
    """rope_tail(x) == cat([x[..., :n], apply_rope(x[..., n:])]) up to the compute dtype's last
    bit (rope_tail's addcmul may contract a product and a sum into one fused multiply-add; bf16
    to one bf16 step), the copied part bitwise; gradients equal plain autograd through that
    expression; only the two tables are saved."""
    from dropless.model.rope import rope_tail
    gen = torch.Generator().manual_seed(4)
    B, S, N, R = 2, 7, 3, 8
    cos, sin = rope_cos_sin(S, R, 10000.0, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    x = torch.randn(B, S, N, n_nope + R, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(B, S, N, n_nope + R, generator=gen).to(dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        y = rope_tail(x, cos, sin)
    (gx,) = torch.autograd.grad(y, x, g)
    assert saved == [cos.shape, sin.shape]
    x2 = x.detach().clone().requires_grad_()
    y2 = torch.cat([x2[..., :n_nope], apply_rope(x2[..., n_nope:], cos, sin)], dim=-1)
    (gx2,) = torch.autograd.grad(y2, x2, g)
    assert y.is_contiguous() and torch.equal(y[..., :n_nope], y2[..., :n_nope])
    if dtype == torch.float64:
        torch.testing.assert_close(y, y2, rtol=1e-15, atol=1e-15)
    else:
        torch.testing.assert_close(y.double(), y2.double(), rtol=8e-3, atol=1e-5)
    if dtype == torch.float64:
        torch.testing.assert_close(gx, gx2, rtol=1e-12, atol=1e-12)
    else:
        torch.testing.assert_close(gx.double(), gx2.double(), rtol=8e-3, atol=1e-2)
    with pytest.raises(ValueError, match="rope_tail"):
        rope_tail(x, cos[:3], sin[:3])
    with pytest.raises(ValueError, match="require grad.*apply_rope"):   # it would give them no gradient
        rope_tail(x, cos.clone().requires_grad_(), sin)


def test_rope_tail_under_torch_func_transforms():
    """torch.func.grad, vmap (over x, or over the tables only), jacrev, jvp and hessian through rope_tail
    (float64) equal the same transforms of [x[..., :n] | apply_rope(x[..., n:])]: the Function has a
    setup_context, a vmap rule and a jvp."""
    from dropless.model.rope import rope_tail
    gen = torch.Generator().manual_seed(8)
    B, S, N, n, R = 2, 5, 3, 4, 8
    cos, sin = rope_cos_sin(S, R, 10000.0, dtype=torch.float64)
    x = torch.randn(B, S, N, n + R, generator=gen, dtype=torch.float64)
    w = torch.randn(B, S, N, n + R, generator=gen, dtype=torch.float64)

    def ref(t):
        return torch.cat([t[..., :n], apply_rope(t[..., n:], cos, sin)], dim=-1)

    g = torch.func.grad(lambda t: (rope_tail(t, cos, sin) * w).sum())(x)
    torch.testing.assert_close(g, torch.func.grad(lambda t: (ref(t) * w).sum())(x), rtol=1e-12, atol=1e-12)
    xs = torch.stack([x, 2 * x + 1])
    torch.testing.assert_close(torch.func.vmap(lambda t: rope_tail(t, cos, sin))(xs), torch.stack([ref(t) for t in xs]),
                               rtol=1e-12, atol=1e-12)
    x1 = x[:1, :2]
    torch.testing.assert_close(torch.func.jacrev(lambda t: rope_tail(t, cos[:2], sin[:2]))(x1),
                               torch.func.jacrev(lambda t: torch.cat([t[..., :n], apply_rope(t[..., n:], cos[:2],
                                                                                             sin[:2])], -1))(x1),
                               rtol=1e-12, atol=1e-12)
    # the tables batched, x not
    cs, ss = torch.stack([cos, cos.flip(0)]), torch.stack([sin, sin.flip(0)])
    got = torch.func.vmap(lambda c, s_: rope_tail(x, c, s_))(cs, ss)
    want = torch.stack([torch.cat([x[..., :n], apply_rope(x[..., n:], c, s_)], -1) for c, s_ in zip(cs, ss)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # forward mode: jvp (the map is linear: the tangent's own rotation) and hessian (jacfwd of jacrev)
    _, tangent = torch.func.jvp(lambda t: rope_tail(t, cos, sin), (x,), (w,))
    torch.testing.assert_close(tangent, ref(w), rtol=1e-12, atol=1e-12)
    h = torch.func.hessian(lambda t: (rope_tail(t, cos[:2], sin[:2]) ** 3).sum())(x1)
    h_ref = torch.func.hessian(lambda t: (torch.cat([t[..., :n], apply_rope(t[..., n:], cos[:2], sin[:2])], -1)
                                          ** 3).sum())(x1)
    torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_split_last_equals_torch_split_values_and_gradients(dtype):
    """MLA's split with the copy-based backward: views equal to ``torch.split``'s; the input
    gradient bitwise equal to autograd's concatenation, with strided part gradients (as
    attention returns them) and with one part unused (its slice exactly 0, not stale memory)."""
    from dropless.model.attention import split_last
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, 3, 11, generator=gen).to(dtype).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    a, b = split_last(x, [4, 7])
    a2, b2 = torch.split(x2, [4, 7], dim=-1)
    assert torch.equal(a, a2) and torch.equal(b, b2) and a.data_ptr() == x.data_ptr()
    ga = torch.randn(2, 3, 5, 4, generator=gen).to(dtype).transpose(1, 2)  # strided, as SDPA's
    gb = torch.randn(2, 5, 3, 7, generator=gen).to(dtype)
    (gx,) = torch.autograd.grad((a, b), x, (ga, gb))
    (gx2,) = torch.autograd.grad((a2, b2), x2, (ga, gb))
    assert torch.equal(gx, gx2)
    # one part unused: its gradient slice is zero
    a, b = split_last(x, [4, 7])
    (gx,) = torch.autograd.grad(b, x, gb)
    assert torch.equal(gx[..., :4], torch.zeros_like(gx[..., :4])) and torch.equal(gx[..., 4:], gb)
    with torch.no_grad():  # no graph: the plain split, no Function node
        assert split_last(x, [4, 7])[0].grad_fn is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("used", ["both", "k", "v"])
def test_keys_values_equals_split_and_cat(dtype, used):
    """MLA's k = [k_nope | k_pe over heads], v: bitwise the plain split + expand + cat, and the
    same gradients for kv and k_pe (bitwise: copies and the same sum over heads), also when only
    k or only v reaches the loss; gradients strided as attention returns them."""
    from dropless.model.attention import keys_values
    gen = torch.Generator().manual_seed(9)
    B, S, N, Dn, Dv, Dr = 2, 5, 3, 4, 6, 2
    kv = torch.randn(B, S, N, Dn + Dv, generator=gen).to(dtype).requires_grad_()
    pe = torch.randn(B, S, 1, Dr, generator=gen).to(dtype).requires_grad_()
    gk = torch.randn(B, N, S, Dn + Dr, generator=gen).to(dtype).transpose(1, 2)
    gv = torch.randn(B, N, S, Dv, generator=gen).to(dtype).transpose(1, 2)
    k, v = keys_values(kv, pe, Dn)
    kv2, pe2 = kv.detach().clone().requires_grad_(), pe.detach().clone().requires_grad_()
    k_nope2, v2 = torch.split(kv2, [Dn, Dv], dim=-1)
    k2 = torch.cat([k_nope2, pe2.expand(B, S, N, Dr)], dim=-1)
    assert k.is_contiguous() and torch.equal(k, k2) and torch.equal(v, v2)
    outs, outs2, gs = {"both": ((k, v), (k2, v2), (gk, gv)), "k": ((k,), (k2,), (gk,)),
                       "v": ((v,), (v2,), (gv,))}[used]
    got = torch.autograd.grad(outs, [kv, pe], gs, allow_unused=True)
    want = torch.autograd.grad(outs2, [kv2, pe2], gs, allow_unused=True)
    assert torch.equal(got[0], want[0])
    if used == "v":
        assert got[1] is None and want[1] is None
    else:
        assert torch.equal(got[1], want[1])


def test_mla_functions_pass_gradcheck_and_gradgradcheck():
    """rope_tail, split_last and keys_values: gradients and second-order gradients
    (``create_graph=True``, e.g. a gradient penalty) against finite differences in float64, an
    undefined incoming gradient included (gradcheck's ``check_undefined_grad``); MLA twice
    differentiable end to end."""
    from dropless.model.attention import keys_values, split_last
    from dropless.model.rope import rope_tail
    gen = torch.Generator().manual_seed(11)
    cos, sin = rope_cos_sin(3, 4, 10000.0, dtype=torch.float64)
    x = torch.randn(2, 3, 2, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(2, 3, 2, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    pe = torch.randn(2, 3, 1, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    for fn, inputs in ((lambda t: rope_tail(t, cos, sin), (x,)), (lambda t: split_last(t, [3, 4]), (x,)),
                       (lambda a, b: keys_values(a, b, 2), (kv, pe))):
        assert torch.autograd.gradcheck(fn, inputs)
        assert torch.autograd.gradgradcheck(fn, inputs)
    args = ModelArgs(vocab_size=16, hidden_size=8, intermediate_size=8, moe_intermediate_size=4,
                     num_hidden_layers=1, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=4,
                     kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=4, v_head_dim=2, n_routed_experts=4,
                     num_experts_per_tok=2, n_group=1, topk_group=1)
    mla = MLA(args).double()
    mla.init_weights(std=0.3, generator=gen)
    cos, sin = rope_cos_sin(3, 4, 10000.0, dtype=torch.float64)
    h = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: mla(t, cos, sin), (h,))


def test_feed_forward_second_order_gradients_and_torch_func_equal_the_plain_modules():
    """A gradient penalty (create_graph=True) through FeedForward's Function: d‖∂L/∂x‖²/dθ for x and every
    weight equal the plain modules' in float64 (the backward rebuilds a, b from the saved inputs so that
    its graph reaches them); torch.func.grad through the module equals plain autograd."""
    from dropless.mlp import FeedForward
    gen = torch.Generator().manual_seed(13)
    m = FeedForward(12, 16).double()
    with torch.no_grad():
        for lin in (m.w1, m.w3, m.w2):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.4)
    x0 = torch.randn(7, 12, generator=gen, dtype=torch.float64)
    v = torch.randn(7, 12, generator=gen, dtype=torch.float64)
    params = [m.w1.weight, m.w3.weight, m.w2.weight]

    def penalty_grads(fn):
        x = x0.clone().requires_grad_()
        (gx,) = torch.autograd.grad((fn(x) * v).sum(), x, create_graph=True)
        return torch.autograd.grad((gx ** 2).sum(), [x] + params)

    got = penalty_grads(m)
    want = penalty_grads(lambda t: m.w2(torch.nn.functional.silu(m.w1(t)) * m.w3(t)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    g = torch.func.grad(lambda t: (m(t) * v).sum())(x0)
    x = x0.clone().requires_grad_()
    (g_ref,) = torch.autograd.grad((m.w2(torch.nn.functional.silu(m.w1(x)) * m.w3(x)) * v).sum(), x)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mtp_depths", [0, 1, 2])
def test_flops_per_token_equal_torchs_flop_counter_over_a_training_step(mtp_depths):
    """The trainer's FLOP count (its MFU's numerator) against torch's own count of the matmuls of a
    real forward + backward: the tiny model in fp32 with the per-expert loop backend (every GEMM an
    ``aten.mm``), attention unmasked on CPU (SDPA's math path computes every score: causal=False),
    with 0, 1 and 2 multi-token-prediction depths (before, the MTP modules went uncounted)."""
    from torch.utils.flop_counter import FlopCounterMode

    from dropless.model.params import moe_flops_per_token
    from dropless.train.config import compose, model_args

    args = model_args(compose(["gemm=loop", f"model.num_nextn_predict_layers={mtp_depths}"]))
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(0)
    B, S = 2, 64
    tokens = torch.randint(0, args.vocab_size, (B, S + 1))
    with FlopCounterMode(display=False) as counter:
        model.loss(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    assert counter.get_total_flops() == pytest.approx(moe_flops_per_token(args, S, causal=False) * B * S, rel=1e-9)
