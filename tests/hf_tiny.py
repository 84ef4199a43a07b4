"""Tiny Hugging Face DeepSeek-V3 checkpoints built by transformers, for the conversion tests.

:func:`make_hf_dir` builds a ``DeepseekV3ForCausalLM`` with random weights (std 0.1, norm
weights around 1, a non-zero ``e_score_correction_bias``; 8 experts top-2 in 4 groups
keeping 2, so group-limited routing matters), saves it with ``save_pretrained`` and, for
``mtp > 0``, adds the multi-token-prediction layers the way the released files store them
(layer ``num_hidden_layers + k``: ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``, a
decoder layer of transformers' own ``DeepseekV3DecoderLayer``, ``shared_head.norm`` and
``shared_head.head``), in a shard of their own listed in the index.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm  # noqa: E402

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8,
             routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=8,
             qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
             max_position_embeddings=128, initializer_range=0.1)


def hf_config(mtp: int = 0, **over) -> DeepseekV3Config:
    d = dict(SHAPE, num_nextn_predict_layers=mtp)
    d.update(over)
    cfg = DeepseekV3Config(**d)
    cfg._attn_implementation = "eager"
    return cfg


def _randomise(module: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dtype.is_floating_point and "inv_freq" not in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def _per_expert(sd: dict[str, torch.Tensor], I: int) -> dict[str, torch.Tensor]:
    """transformers 5 keeps a layer's experts fused (``gate_up_proj`` [E, 2I, H], gate first;
    ``down_proj`` [E, H, I]); the files store them per expert."""
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            for j in range(v.shape[0]):
                out[f"{base}{j}.gate_proj.weight"] = v[j, :I].clone()
                out[f"{base}{j}.up_proj.weight"] = v[j, I:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for j in range(v.shape[0]):
                out[f"{base}{j}.down_proj.weight"] = v[j].clone()
        else:
            out[k] = v.clone()
    return out


def build_mtp_layers(cfg: DeepseekV3Config, model: DeepseekV3ForCausalLM, gen: torch.Generator) -> list[dict]:
    """The MTP modules as transformers modules: ``{"layer", "enorm", "hnorm", "eh_proj", "norm"}``
    per depth (the embedding and head are the main model's)."""
    H = cfg.hidden_size
    mods = []
    for k in range(cfg.num_nextn_predict_layers):
        m = dict(layer=DeepseekV3DecoderLayer(cfg, cfg.num_hidden_layers + k),
                 enorm=DeepseekV3RMSNorm(H, cfg.rms_norm_eps), hnorm=DeepseekV3RMSNorm(H, cfg.rms_norm_eps),
                 eh_proj=torch.nn.Linear(2 * H, H, bias=False), norm=DeepseekV3RMSNorm(H, cfg.rms_norm_eps))
        for mod in m.values():
            _randomise(mod, gen)
            mod.eval()
        mods.append(m)
    return mods


def make_hf_dir(path: Path, *, mtp: int = 0, seed: int = 0, max_shard_size: str | None = None, **over):
    """Save a random tiny model at ``path``; returns ``(hf_model, mtp_modules)``."""
    cfg = hf_config(mtp=mtp, **over)
    gen = torch.Generator().manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).eval()
    _randomise(model, gen)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(path), **kw)
    mods = build_mtp_layers(cfg, model, gen) if mtp else []
    if mods:
        extra = {}
        for k, m in enumerate(mods):
            p = f"model.layers.{cfg.num_hidden_layers + k}."
            layer_sd = _per_expert(m["layer"].state_dict(), cfg.moe_intermediate_size)
            extra.update({p + n: v for n, v in layer_sd.items()})
            extra[p + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
            extra[p + "enorm.weight"] = m["enorm"].weight.detach().clone()
            extra[p + "hnorm.weight"] = m["hnorm"].weight.detach().clone()
            extra[p + "eh_proj.weight"] = m["eh_proj"].weight.detach().clone()
            extra[p + "shared_head.norm.weight"] = m["norm"].weight.detach().clone()
            extra[p + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
        _add_shard(Path(path), "model-mtp.safetensors", extra)
    return model, mods


def _add_shard(path: Path, fname: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` as one more shard and list it in the index (made if absent)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        idx = json.loads(index.read_text())
    else:
        with safetensors_torch.safe_open(str(path / "model.safetensors"), "pt") as f:
            idx = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in f.keys()}}
    safetensors_torch.save_file(tensors, str(path / fname), metadata={"format": "pt"})
    idx["weight_map"].update({n: fname for n in tensors})
    index.write_text(json.dumps(idx, indent=2))


def read_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory, by name."""
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(safetensors_torch.load_file(str(f)))
    return out


def hf_mtp_reference(model, mods, tokens: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """Per-depth MTP cross-entropies computed with transformers' modules (report §2.2,
    vLLM's order ``eh_proj([enorm(emb); hnorm(h)])``, h⁰ = the main model's final normed states)."""
    with torch.no_grad():
        h = model.model(tokens).last_hidden_state
        S = tokens.shape[1]
        out = []
        for k, m in enumerate(mods, start=1):
            n = S - k
            emb = model.model.embed_tokens(tokens[:, k:])
            x = m["eh_proj"](torch.cat([m["enorm"](emb), m["hnorm"](h[:, :n])], dim=-1))
            pos = torch.arange(n).unsqueeze(0)
            pe = model.model.rotary_emb(x, pos)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            h = m["layer"](x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
            if isinstance(h, tuple):
                h = h[0]
            logits = model.lm_head(m["norm"](h)).float()
            out.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, k:].reshape(-1)))
        return out
