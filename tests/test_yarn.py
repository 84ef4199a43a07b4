"""YaRN rope_scaling (issue 11 item 5) against a float64 reference written from the formulas.

Sources: DeepSeek-V3's reference inference code (``precompute_freqs_cis``, ``MLA.__init__``
in deepseek-ai/DeepSeek-V3 ``inference/model.py``) and the YaRN paper (arXiv:2309.00071).
The reference here is plain Python ``math`` on floats, written from those formulas.
"""

from __future__ import annotations

import cmath
import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dropless.config import ConfigError, ModelArgs, Yarn
from dropless.model import MLA, Transformer, rope_cos_sin, rope_inv_freq
from dropless.model.rope import yarn_correction_range

DATA = Path(__file__).parent / "data"
V3_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def ref_inv_freq(d, theta, factor, orig, beta_fast, beta_slow):
    """float64 YaRN frequencies, from the formulas (Python floats)."""
    def turns_dim(r):                       # the pair index that turns r times over orig positions
        return d * math.log(orig / (r * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(turns_dim(beta_fast)), 0)
    high = min(math.ceil(turns_dim(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(d // 2):
        f = theta ** (-2 * i / d)
        ramp = min(1.0, max(0.0, (i - low) / (high - low)))
        out.append(f * (1 - ramp) + f / factor * ramp)
    return out, (low, high)


def test_published_v3_correction_range_and_frequencies():
    yarn = ModelArgs.deepseek_v3_671b().yarn()
    assert yarn == Yarn(40.0, 4096, 32.0, 1.0, 1.0)
    want, (low, high) = ref_inv_freq(64, 10000.0, 40.0, 4096, 32, 1)
    assert (low, high) == (10, 23)          # pairs 0-9 keep their frequency, 23-31 are divided by 40
    assert yarn_correction_range(yarn, 64, 10000.0) == (10.0, 23.0)
    got64 = rope_inv_freq(64, 10000.0, yarn=yarn, dtype=torch.float64)
    torch.testing.assert_close(got64, torch.tensor(want, dtype=torch.float64), rtol=1e-14, atol=0)
    got32 = rope_inv_freq(64, 10000.0, yarn=yarn)
    torch.testing.assert_close(got32.double(), torch.tensor(want, dtype=torch.float64), rtol=2e-6, atol=0)
    plain = rope_inv_freq(64, 10000.0, dtype=torch.float64)
    assert torch.equal(got64[:10], plain[:10])
    torch.testing.assert_close(got64[23:], plain[23:] / 40, rtol=1e-15, atol=0)
    assert (got64[11:23] < plain[11:23]).all() and (got64[11:23] > plain[11:23] / 40).all()  # the ramp


@pytest.mark.parametrize("d, theta, factor, orig, bf, bs", [(8, 50.0, 4.0, 32, 32, 1), (16, 10000.0, 8.0, 64, 8, 2),
                                                           (64, 10000.0, 40.0, 4096, 32, 1)])
def test_cos_sin_tables_match_the_formula(d, theta, factor, orig, bf, bs):
    yarn = Yarn(factor, orig, bf, bs, 1.0)
    f, _ = ref_inv_freq(d, theta, factor, orig, bf, bs)
    S = 37
    cos, sin = rope_cos_sin(S, d, theta, yarn=yarn, dtype=torch.float64)
    want_cos = torch.tensor([[math.cos(p * fi) for fi in f] for p in range(S)], dtype=torch.float64)
    want_sin = torch.tensor([[math.sin(p * fi) for fi in f] for p in range(S)], dtype=torch.float64)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=1e-13)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=1e-13)


def test_softmax_scale_times_mscale_squared():
    args = ModelArgs.deepseek_v3_671b()
    with torch.device("meta"):
        attn = MLA(args)
    mscale = 0.1 * 1.0 * math.log(40) + 1
    assert attn.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2, rel=1e-15)
    with torch.device("meta"):
        plain = MLA(ModelArgs.deepseek_v3_671b(rope_scaling=None))
    assert plain.softmax_scale == pytest.approx(192 ** -0.5, rel=1e-15)
    half = ModelArgs.deepseek_v3_671b(rope_scaling={**V3_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}).yarn()
    assert half.softmax_mscale == pytest.approx(0.1 * 0.707 * math.log(40) + 1, rel=1e-15)


def _small_yarn_args(**kw):
    d = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
             first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8,
             qk_rope_head_dim=8, v_head_dim=8, rope_theta=50.0, max_position_embeddings=128,
             rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                           "beta_fast": 32, "beta_slow": 1, "mscale_all_dim": 0.7})
    d.update(kw)
    return ModelArgs(**d)


def test_mla_with_yarn_matches_float64_reference():
    """Whole MLA (q_lora_rank 0) in float64 against explicit complex rotation by the YaRN
    frequencies and softmax(q·k · Dq^-0.5 · mscale²)."""
    args = _small_yarn_args()
    attn = MLA(args).double()
    g = torch.Generator().manual_seed(0)
    attn.init_weights(std=0.3, generator=g)
    B, S = 2, 9
    x = torch.randn(B, S, 32, dtype=torch.float64, generator=g)
    yarn = args.yarn()
    cos, sin = rope_cos_sin(S, 8, 50.0, yarn=yarn, dtype=torch.float64)
    got = attn(x, cos, sin)

    f, _ = ref_inv_freq(8, 50.0, 4.0, 32, 32, 1)
    scale = (16 ** -0.5) * (0.1 * 0.7 * math.log(4.0) + 1) ** 2
    W = {n: p.detach() for n, p in attn.named_parameters()}

    def rot(v, pos):
        out = v.clone()
        for i in range(len(f)):
            z = complex(v[2 * i].item(), v[2 * i + 1].item()) * cmath.exp(1j * pos * f[i])
            out[2 * i], out[2 * i + 1] = z.real, z.imag
        return out

    want = torch.zeros(B, S, 32, dtype=torch.float64)
    for b in range(B):
        q = (x[b] @ W["wq.weight"].T).view(S, 2, 16)
        kv = x[b] @ W["wkv_a.weight"].T
        c, k_pe = kv[:, :16], kv[:, 16:]
        cn = c / torch.sqrt((c * c).mean(-1, keepdim=True) + args.rms_norm_eps) * W["kv_norm.weight"]
        kvb = (cn @ W["wkv_b.weight"].T).view(S, 2, 16)
        k_rot = torch.stack([rot(k_pe[s], s) for s in range(S)])
        heads = []
        for n in range(2):
            qn = torch.stack([torch.cat([q[s, n, :8], rot(q[s, n, 8:], s)]) for s in range(S)])
            kn = torch.cat([kvb[:, n, :8], k_rot], dim=1)
            scores = qn @ kn.T * scale + torch.full((S, S), float("-inf"), dtype=torch.float64).triu(1)
            heads.append(torch.softmax(scores, -1) @ kvb[:, n, 8:])
        want[b] = torch.cat(heads, 1) @ W["wo.weight"].T
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_published_config_loads_with_yarn_applied():
    with pytest.warns(UserWarning) as record:
        args = ModelArgs.from_json(DATA / "deepseek_v3_config.json")
    assert "rope_scaling" not in " ".join(str(w.message) for w in record)
    assert args.rope_scaling == V3_YARN and args.yarn() == Yarn(40.0, 4096, 32.0, 1.0, 1.0)
    with torch.device("meta"):
        model = Transformer(args)
    assert model.yarn == args.yarn()
    attn = model.layers["0"].attention
    assert attn.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-15)


def test_small_model_runs_with_yarn_and_it_changes_the_logits():
    a = Transformer(_small_yarn_args())
    a.init_weights()
    b = Transformer(_small_yarn_args(rope_scaling=None))
    b.init_weights()
    tokens = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        la, lb = a(tokens), b(tokens)
    assert torch.isfinite(la).all() and (la - lb).abs().max() > 1e-4


@pytest.mark.parametrize("rs, match", [
    ({**V3_YARN, "type": "linear"}, "only 'yarn'"),
    ({k: v for k, v in V3_YARN.items() if k != "factor"}, "missing key 'factor'"),
    ({**V3_YARN, "alpha": 1}, "unknown key"),
    ({**V3_YARN, "mscale": 0.5}, "mscale and mscale_all_dim differ"),
    ({**V3_YARN, "factor": 0.5}, "factor must be >= 1"),
    ({**V3_YARN, "beta_fast": 1, "beta_slow": 32}, "beta_slow < beta_fast"),
    ({**V3_YARN, "original_max_position_embeddings": 200000}, "must exceed"),
])
def test_bad_rope_scaling_is_a_config_error(rs, match):
    with pytest.raises(ConfigError, match=match):
        ModelArgs.deepseek_v3_671b(rope_scaling=rs).validate()


def test_rope_tables_copy_no_host_value_to_the_device():
    """Issue 12 item 5: the tables are built by device ops from Python numbers. Every tensor an
    op reads must come from an earlier op; before, every forward made a host tensor of
    rope_theta (``torch.tensor(theta, device=...)``, a host-to-device copy) and read it."""
    from torch.utils._pytree import tree_flatten

    for yarn in (None, ModelArgs.deepseek_v3_671b().yarn()):
        made, foreign, names = set(), [], []

        class Spy(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                names.append(func.__name__)
                for a in tree_flatten((args, kwargs or {}))[0]:
                    if isinstance(a, torch.Tensor) and id(a) not in made:
                        foreign.append(func.__name__)
                out = func(*args, **(kwargs or {}))
                made.update(id(o) for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor))
                return out

        with Spy():
            cos, sin = rope_cos_sin(128, 64, 10000.0, yarn=yarn, device="meta")
        assert not foreign, foreign
        assert not [n for n in names if n.startswith(("_local_scalar_dense", "item", "_to_copy", "copy_"))], names
        assert cos.shape == (128, 32)
