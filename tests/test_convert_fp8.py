"""FP8 block-scaled weights (the released DeepSeek-V3 format): dequantisation against a
float64 reference, and an FP8 checkpoint imported to the dequantised weights."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dropless.convert import dequantize_fp8_blocks

FP8 = getattr(torch, "float8_e4m3fn", None)
pytestmark = pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")


def quantize_blocks(w: torch.Tensor, block=(128, 128)):
    """A test quantiser: per block, scale = amax / 448, ``q = fp8(w / scale)``; returns (q, scale)."""
    out, inn = w.shape
    bo, bi = block
    so, si = math.ceil(out / bo), math.ceil(inn / bi)
    scale = torch.empty(so, si, dtype=torch.float32)
    q = torch.empty(out, inn, dtype=FP8)
    for r in range(so):
        for c in range(si):
            blk = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]
            s = blk.abs().amax().clamp(min=1e-12) / 448.0
            scale[r, c] = s
            q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = (blk / s).to(FP8)
    return q, scale


def reference_dequant(q: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """Element by element in float64: ``q[r, c] · scale[r // bo, c // bi]``."""
    qd = q.to(torch.float64)
    out = torch.empty_like(qd)
    bo, bi = block
    for r in range(qd.shape[0]):
        out[r] = qd[r] * scale.to(torch.float64)[r // bo].repeat_interleave(bi)[: qd.shape[1]]
    return out


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (7, 300)], ids=["whole_blocks", "partial", "thin"])
def test_dequant_matches_float64_reference(shape):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[1])  # scales differ per block
    q, s = quantize_blocks(w)
    ref = reference_dequant(q, s)
    got64 = dequantize_fp8_blocks(q, s, dtype=torch.float64)
    assert torch.equal(got64, ref)                                  # exact in float64
    got = dequantize_fp8_blocks(q, s)
    assert got.dtype == torch.float32
    assert torch.equal(got, ref.to(torch.float32))                   # one rounding of the exact product
    assert (got - w).abs().max() <= 0.07 * w.abs().max()              # and it is a quantisation of w


def test_scale_grid_mismatch_is_named():
    q = torch.zeros(256, 256, dtype=FP8)
    with pytest.raises(ValueError, match=r"layers\.0\.w_scale_inv: shape \(2, 3\) does not match weight shape "
                                         r"\(256, 256\) in 128x128 blocks \(expected \(2, 2\)\)"):
        dequantize_fp8_blocks(q, torch.ones(2, 3), name="layers.0.w")


def test_fp8_checkpoint_imports_dequantised(tmp_path):
    from safetensors.torch import load_file, save_file

    from dropless.convert import args_from_hf_config, load_hf, read_hf_config
    from dropless.model import Transformer
    from tests.hf_tiny import make_hf_dir

    make_hf_dir(tmp_path)
    cfg = read_hf_config(tmp_path)
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [16, 16]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    expected = {}
    for name in list(tensors):  # quantise the 2-D projections, as the released files do (not norms, router)
        w = tensors[name]
        if w.dim() == 2 and ("proj" in name):
            q, s = quantize_blocks(w, (16, 16))
            tensors[name], tensors[name + "_scale_inv"] = q, s
            expected[name] = reference_dequant(q, s, (16, 16)).to(torch.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    args, fmt = args_from_hf_config(read_hf_config(tmp_path))
    assert fmt.fp8_block == (16, 16)
    model = Transformer(args)
    rep = load_hf(model, tmp_path)
    assert not any(n.endswith("_scale_inv") for n in rep.names_read)
    sd = model.state_dict()
    torch.testing.assert_close(sd["layers.0.attention.wq_a.weight"],
                               expected["model.layers.0.self_attn.q_a_proj.weight"],
                               rtol=0, atol=0)
    torch.testing.assert_close(sd["layers.1.moe.experts.w13"][3, :, 16:],
                               expected["model.layers.1.mlp.experts.3.up_proj.weight"].t(), rtol=0, atol=0)
    torch.testing.assert_close(sd["layers.2.moe.experts.w2"][7],
                               expected["model.layers.2.mlp.experts.7.down_proj.weight"].t(), rtol=0, atol=0)
