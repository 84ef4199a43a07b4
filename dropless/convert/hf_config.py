"""Hugging Face DeepSeek-V3 ``config.json`` <-> :class:`~dropless.config.ModelArgs`.

The model fields keep DeepSeek-V3's names (docs/design.md#shapes-and-names), so most keys pass through. What the
translation adds:

* ``q_lora_rank``: ``null`` in the file is 0 here (no query compression).
* RoPE: ``rope_theta`` (and ``rope_scaling``) at the top level, as the released files and
  transformers 4 write them, or inside ``rope_parameters`` (transformers 5). A scaled RoPE
  (``rope_scaling`` / a ``type`` or ``rope_type`` other than ``default``) is passed on when
  :class:`ModelArgs` has a ``rope_scaling`` field; otherwise it is not applied and a
  warning says so (the logits then differ from the reference model's). However the block
  is spelt (``type``, ``rope_type`` or both, integers or floats), it is read by the one
  parser, :func:`dropless.config.parse_rope_scaling`, and checkpoints are compared on the
  YaRN settings it gives (:func:`check_same_model`).
* ``rope_interleave`` (transformers 5; absent means true, the released weights' layout):
  returned in :class:`HFFormat`; false means the checkpoint's rope rows pair feature ``j``
  with ``j + Dr/2`` and must be permuted (:mod:`dropless.convert.names`).
* ``quantization_config`` of the released FP8 files (``fmt: e4m3``, ``weight_block_size``):
  returned in :class:`HFFormat` for the dequantisation.
* dropless's own fields (alignment, recompute, gemm, ...) are written under one
  ``"dropless"`` key on export and read back from it, so
  ``args_from_hf_config(hf_config_from_args(a))[0] == a`` for every ``a``.

Errors: :class:`~dropless.config.ConfigError` naming the key, for a file that is not a
DeepSeek-V3 model dropless can compute (another ``model_type``, an activation other than
SiLU, grouped KV heads, attention biases).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from dropless.config import ConfigError, ModelArgs, rope_scaling_kind, yarn_override

__all__ = ["HFFormat", "MODEL_FIELDS", "args_from_hf_config", "hf_config_from_args", "read_hf_config",
           "check_same_model"]

#: ModelArgs fields that appear in DeepSeek-V3's config.json under the same name.
MODEL_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "first_k_dense_replace", "moe_layer_freq", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor", "scoring_func",
    "norm_topk_prob", "topk_method", "aux_loss_alpha", "seq_aux", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "tie_word_embeddings", "initializer_range", "num_nextn_predict_layers",
)

#: Fields that change the function the weights compute: a checkpoint must agree on them.
ARCH_FIELDS = tuple(f for f in MODEL_FIELDS if f not in (
    "aux_loss_alpha", "seq_aux", "max_position_embeddings", "initializer_range"))

_MODEL_TYPES = ("deepseek_v3",)


@dataclass(frozen=True)
class HFFormat:
    """How a checkpoint stores what :class:`ModelArgs` does not say.

    Attributes:
        rope_interleave: rope features stored as interleaved pairs ``(2j, 2j+1)`` (true: the
            released layout, the same as dropless's) or as halves ``(j, j + Dr/2)``.
        fp8_block: ``(rows, cols)`` of the FP8 weights' scale blocks, or None (no FP8).
    """

    rope_interleave: bool = True
    fp8_block: tuple[int, int] | None = None


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of a Hugging Face directory (or the file itself) as a dict.

    Raises:
        FileNotFoundError: no config.json there.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no config.json; a Hugging Face model directory holds config.json "
                                "and model*.safetensors")
    with open(p) as f:
        return json.load(f)


def _rope(cfg: Mapping[str, Any]) -> tuple[float, dict | None]:
    """``(rope_theta, scaling)`` from legacy or transformers-5 keys; scaling None for plain RoPE."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = None if rope_scaling_kind(params) == "default" else {k: v for k, v in params.items()
                                                                        if k != "rope_theta"}
        return float(theta), scaling
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, Mapping) and rope_scaling_kind(scaling) == "default":
        scaling = None
    return float(cfg.get("rope_theta", 10000.0)), (dict(scaling) if scaling else None)


def args_from_hf_config(cfg: Mapping[str, Any], **overrides: Any) -> tuple[ModelArgs, HFFormat]:
    """ModelArgs and storage format from a DeepSeek-V3 ``config.json`` dict.

    Args:
        cfg: the parsed file.
        overrides: ModelArgs fields to set on top (dropless's own fields, e.g.
            ``expert_alignment=128``).
    Returns: ``(args, fmt)``; ``args`` validated.
    Raises:
        ConfigError: not a DeepSeek-V3 model dropless can compute (the key is named), or a
            bad override.
    """
    model_type = cfg.get("model_type", "deepseek_v3")
    if model_type not in _MODEL_TYPES:
        raise ConfigError(f"config.json: model_type={model_type!r}; dropless imports DeepSeek-V3 checkpoints "
                          f"(model_type 'deepseek_v3')")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: hidden_act={cfg['hidden_act']!r}; dropless's experts are SwiGLU (silu)")
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != cfg.get("num_attention_heads"):
        raise ConfigError(f"config.json: num_key_value_heads={kv_heads} differs from num_attention_heads="
                          f"{cfg.get('num_attention_heads')}; MLA in dropless has one KV head per query head")
    if cfg.get("attention_bias", False):
        raise ConfigError("config.json: attention_bias=true; dropless's MLA projections have no bias")

    known = {f.name for f in dataclasses.fields(ModelArgs)}
    kw: dict[str, Any] = {k: cfg[k] for k in MODEL_FIELDS if k in cfg and k != "rope_theta"}
    if "num_mtp_layers" in cfg and "num_nextn_predict_layers" not in cfg:
        kw["num_nextn_predict_layers"] = cfg["num_mtp_layers"]
    if kw.get("q_lora_rank") is None:
        kw["q_lora_rank"] = 0
    theta, scaling = _rope(cfg)
    kw["rope_theta"] = theta
    if scaling is not None:
        if "rope_scaling" in known:
            kw["rope_scaling"] = scaling
        else:
            warnings.warn(f"config.json: RoPE scaling {scaling} is not applied (dropless computes plain RoPE); "
                          "the imported model's logits differ from the reference model's", stacklevel=2)
    own = cfg.get("dropless") or {}
    unknown = sorted(set(own) - known) + sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown ModelArgs field(s) {', '.join(unknown)} (in config.json's 'dropless' block "
                          "or the overrides); see dropless/config.py for the fields")
    kw.update(own)
    kw.update(overrides)
    args = ModelArgs(**kw).validate()

    q = cfg.get("quantization_config") or {}
    block = None
    if q:
        if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"config.json: quantization_config {q} is not supported; dropless reads the "
                              "released FP8 format (quant_method fp8, fmt e4m3, weight_block_size) or "
                              "unquantised weights")
        block = tuple(int(b) for b in q.get("weight_block_size", (128, 128)))
    interleave = cfg.get("rope_interleave", True)
    return args, HFFormat(rope_interleave=True if interleave is None else bool(interleave), fp8_block=block)


def hf_config_from_args(args: ModelArgs, dtype: str = "float32") -> dict[str, Any]:
    """A ``config.json`` dict that transformers' ``DeepseekV3ForCausalLM``, vLLM and SGLang load.

    Args:
        args: the model.
        dtype: the weights' dtype name (``"bfloat16"``, ``"float32"``), written as
            ``torch_dtype``.
    Returns: the DeepSeek-V3 keys (``q_lora_rank`` 0 written as null, ``rope_interleave``
    true: the exported weights keep dropless's interleaved rope rows), the fixed keys of the
    architecture (``model_type``, ``architectures``, ``hidden_act``, ``num_key_value_heads``,
    ``attention_bias``), and dropless's own fields under ``"dropless"``.
    Raises:
        ConfigError: ``moe_layer_freq`` != 1 (transformers' DeepSeek-V3 has an MoE in every
            layer from ``first_k_dense_replace`` on).
    """
    args.validate()
    if args.moe_layer_freq != 1:
        raise ConfigError(f"moe_layer_freq={args.moe_layer_freq}: the Hugging Face DeepSeek-V3 model puts an MoE "
                          "in every layer from first_k_dense_replace on; export needs moe_layer_freq=1")
    d = dataclasses.asdict(args)
    out: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_act": "silu",
        "num_key_value_heads": args.num_attention_heads,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_interleave": True,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    for k in MODEL_FIELDS:
        out[k] = d[k]
    out["q_lora_rank"] = args.q_lora_rank or None
    if d.get("rope_scaling"):
        out["rope_scaling"] = d["rope_scaling"]
    out["dropless"] = {k: v for k, v in d.items() if k not in MODEL_FIELDS and k != "rope_scaling"}
    return out


def check_same_model(model_args: ModelArgs, ckpt_args: ModelArgs, source: str) -> None:
    """Raise :class:`ConfigError` if the checkpoint's architecture differs from the model's.

    Compares :data:`ARCH_FIELDS` (every field that changes the weights' shapes or the
    function they compute; not the training-only ``aux_loss_alpha``, ``seq_aux``,
    ``max_position_embeddings``, ``initializer_range``) and the YaRN settings that
    ``rope_scaling`` parses to (:meth:`ModelArgs.yarn`: ``type`` or ``rope_type``, integers or
    floats, written-out defaults are the same settings). The message lists each field with
    both values and the ``dropless-train`` overrides, quoted for a shell, that match the
    checkpoint.
    """
    a, b = dataclasses.asdict(model_args), dataclasses.asdict(ckpt_args)
    diff = [f for f in ARCH_FIELDS if a[f] != b[f]]
    rows = [f"{f}: model {a[f]!r}, checkpoint {b[f]!r}" for f in diff]
    fix = [f"model.{f}={'null' if b[f] is None else b[f]}" for f in diff]
    yarn_model, yarn_ckpt = model_args.yarn(), ckpt_args.yarn()
    if yarn_model != yarn_ckpt:
        rows.append(f"rope_scaling: model {yarn_model}, checkpoint {yarn_ckpt}")
        fix.append(yarn_override(yarn_ckpt))
    if rows:
        raise ConfigError(f"{source}: the checkpoint's config does not match the model ({'; '.join(rows)}); build "
                          f"the model from the checkpoint's config (dropless-train overrides: {' '.join(fix)})")
