"""Model and MoE configuration, named as in DeepSeek-V3's ``config.json``.

:class:`ModelArgs` carries every field the model and the MoE layer read. The
DeepSeek-V3 fields keep their published names (``hidden_size``,
``moe_intermediate_size``, ``n_routed_experts``, ``num_experts_per_tok``,
``n_group``, ``topk_group``, ...), so a published ``config.json`` loads as it
is through :meth:`ModelArgs.from_json` (unknown keys are ignored with a
notice). The fields after the DeepSeek-V3 block are this project's own
(alignment, capacity, chunking, recompute, gemm backend); see
``docs/design.md#the-live-row-contract``.

Errors: :meth:`ModelArgs.validate` raises :class:`ConfigError` (a
``ValueError``) naming the field that is wrong and how to fix it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, Mapping, Optional


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and the fix."""


_YARN_KEYS = ("type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
              "mscale", "mscale_all_dim")


#: The field annotations ModelArgs.validate type-checks (``from __future__ import annotations``: strings).
_FIELD_KINDS = {"int": int, "int|None": int, "float": float, "float|None": float, "bool": bool, "str": str,
                "str|None": str}


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling read from ``rope_scaling`` (:meth:`ModelArgs.yarn`); see
    :func:`dropless.model.rope.rope_inv_freq` for the formulas and their sources.

    Attributes:
        factor: s, the context extension factor (40 for DeepSeek-V3).
        original_max_position_embeddings: L, the context the model was trained at (4096).
        beta_fast, beta_slow: rotation counts bounding the interpolation ramp (32, 1).
        mscale: the attention temperature's coefficient m (``mscale_all_dim``):
            the softmax scale is multiplied by ``(0.1·m·ln s + 1)²``.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float

    @property
    def softmax_mscale(self) -> float:
        """``0.1·m·ln(s) + 1``, squared into the softmax scale (1 when s = 1)."""
        return 0.1 * self.mscale * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


#: The keys naming the scaling kind: ``type`` (DeepSeek-V3's released file), ``rope_type`` (transformers).
_ROPE_KIND_KEYS = ("type", "rope_type")


def rope_scaling_kind(rs: Mapping[str, Any]) -> str:
    """The scaling kind a ``rope_scaling`` block names: its ``type`` or ``rope_type``, ``"default"`` if neither.

    transformers 4 re-saves a file with both keys, transformers 5 (``rope_parameters``) with
    ``rope_type``, DeepSeek-V3's released file has ``type``: all of them are read.

    Raises:
        ConfigError: ``type`` and ``rope_type`` both given and different.
    """
    kinds = {str(rs[k]) for k in _ROPE_KIND_KEYS if rs.get(k) is not None}
    if len(kinds) > 1:
        raise ConfigError(f"rope_scaling={dict(rs)!r}: type={rs['type']!r} and rope_type={rs['rope_type']!r} "
                          "differ; give one of them (both name the scaling kind)")
    return kinds.pop() if kinds else "default"


def parse_rope_scaling(rs: Mapping[str, Any] | None, max_position_embeddings: int) -> Yarn | None:
    """The YaRN settings of a ``rope_scaling`` block, whichever way it is spelt: a :class:`Yarn`, or None.

    Every spelling of the same settings gives the same :class:`Yarn` (compare those, not the
    blocks): the kind as ``type``, ``rope_type`` or both (:func:`rope_scaling_kind`), integers or
    floats, defaults written out or left out. None or kind ``"default"`` (and no other key):
    plain RoPE.

    Keys (DeepSeek-V3 ``config.json``): ``type`` / ``rope_type`` ``"yarn"``, ``factor`` (>= 1),
    ``original_max_position_embeddings``, ``beta_fast`` (default 32), ``beta_slow`` (default 1;
    ``0 < beta_slow < beta_fast``), ``mscale`` and ``mscale_all_dim`` (the attention
    temperature's m; if both are given they must be equal, the case DeepSeek-V3's reference code
    implements; neither: m = 1, its default).

    Args:
        rs: the block (``ModelArgs.rope_scaling``; transformers 5's ``rope_parameters`` less
            ``rope_theta``), or None.
        max_position_embeddings: the model's context, which YaRN must extend.
    Raises:
        ConfigError: another scaling kind, ``type`` and ``rope_type`` that differ, an unknown
            key, a bad value, or ``max_position_embeddings <= original_max_position_embeddings``
            (the reference code applies YaRN only when the context is extended, so the block
            would have no effect).
    """
    if rs is None:
        return None

    def bad(why: str) -> None:
        raise ConfigError(f"rope_scaling={dict(rs)!r}: {why}")

    if not isinstance(rs, Mapping):
        raise ConfigError(f"rope_scaling={rs!r}: must be a mapping (the rope_scaling block of config.json) or null")
    unknown = sorted(set(rs) - set(_YARN_KEYS))
    if unknown:
        bad(f"unknown key(s) {unknown}; known: {list(_YARN_KEYS)}")
    kind = rope_scaling_kind(rs)
    if kind == "default" and set(rs) <= set(_ROPE_KIND_KEYS):
        return None
    if kind != "yarn":
        bad(f"type={kind!r}: dropless implements only 'yarn' (DeepSeek-V3's); remove rope_scaling for plain RoPE")
    try:
        factor = float(rs["factor"])
        orig = int(rs["original_max_position_embeddings"])
        beta_fast, beta_slow = float(rs.get("beta_fast", 32)), float(rs.get("beta_slow", 1))
        ms = {k: float(rs[k]) for k in ("mscale", "mscale_all_dim") if rs.get(k) is not None}
    except KeyError as e:
        bad(f"missing key {e.args[0]!r}")
    except (TypeError, ValueError) as e:
        bad(f"a value is not a number ({e})")
    if not factor >= 1.0:
        bad("factor must be >= 1 (the context extension factor s)")
    if orig <= 0:
        bad("original_max_position_embeddings must be a positive integer")
    if not 0 < beta_slow < beta_fast:
        bad("need 0 < beta_slow < beta_fast (rotation counts of the ramp's ends, 1 and 32 in DeepSeek-V3)")
    if len(set(ms.values())) > 1:
        bad("mscale and mscale_all_dim differ; DeepSeek-V3's reference code has one attention "
            "temperature coefficient: give them the same value")
    if max_position_embeddings <= orig:
        bad(f"max_position_embeddings={max_position_embeddings} must exceed "
            f"original_max_position_embeddings={orig}: YaRN applies only to an extended context")
    return Yarn(factor, orig, beta_fast, beta_slow, next(iter(ms.values()), 1.0))


def yarn_override(yarn: Yarn | None) -> str:
    """The ``dropless-train`` override that sets ``model.rope_scaling`` to ``yarn``, quoted for a shell.

    A full block (every key, ``type: yarn``), so that it gives these settings whether Hydra assigns
    it (the field null) or merges it into a block spelt another way; ``model.rope_scaling=null`` for None.
    """
    if yarn is None:
        return "model.rope_scaling=null"
    return ("'model.rope_scaling={type:yarn,factor:%r,original_max_position_embeddings:%d,beta_fast:%r,"
            "beta_slow:%r,mscale:%r,mscale_all_dim:%r}'" % (yarn.factor, yarn.original_max_position_embeddings,
                                                            yarn.beta_fast, yarn.beta_slow, yarn.mscale,
                                                            yarn.mscale))


@dataclass
class ModelArgs:
    """DeepSeek-V3-shaped model configuration.

    Defaults are a tiny CPU-sized model that keeps V3's structure; the
    published 671B shape is :meth:`deepseek_v3_671b`. What each field means:
    :data:`MODEL_FIELD_DOCS` (and ``docs/configuration.md``, generated from it).
    """

    # --- DeepSeek-V3 config.json names -------------------------------------
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 192
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_attention_heads: int = 4
    q_lora_rank: int | None = 0
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 4
    topk_group: int = 2
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    topk_method: str = "noaux_tc"
    aux_loss_alpha: float = 1e-4
    seq_aux: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rope_scaling: Optional[Dict[str, Any]] = None
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    num_nextn_predict_layers: int = 0

    # --- dropless's own MoE fields -----------------------------------------
    bias_update_speed: float = 1e-3
    expert_alignment: int = 1
    capacity_factor: float | None = None
    num_token_chunks: int = 1
    recompute_swiglu: bool = False
    recompute_fc1: bool = False
    recompute_gather: bool = False
    fold_routing_weights: bool = False
    gemm: str = "torch"
    poison_padding: bool = False
    seed: int = 0
    mtp_loss_weight: float = 0.3

    # ---------------------------------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        """Number of MoE layers, ``len(moe_layer_ids())``."""
        return len(self.moe_layer_ids())

    def moe_layer_ids(self) -> list[int]:
        """Indices of the decoder layers that hold an MoE (the rest are dense)."""
        return [
            i
            for i in range(self.num_hidden_layers)
            if i >= self.first_k_dense_replace and i % max(self.moe_layer_freq, 1) == 0
        ]

    @property
    def qk_head_dim(self) -> int:
        """Query/key head dim of MLA, ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def validate(self, layer: str | None = None) -> "ModelArgs":
        """Check the fields; raise :class:`ConfigError` naming the wrong one.

        Args:
            layer: optional layer name to put in the message.
        Returns: self, for chaining.
        """
        where = f" (layer {layer})" if layer is not None else ""

        def bad(name: str, why: str) -> None:
            raise ConfigError(f"{name}={getattr(self, name)!r}{where}: {why}")

        for f in fields(self):  # types first (Python callers and --set bypass the Hydra schema)
            v, kind = getattr(self, f.name), _FIELD_KINDS.get(str(f.type).replace(" ", ""))
            if v is None and str(f.type).replace(" ", "").endswith("|None"):
                continue
            if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
                bad(f.name, "must be an integer")
            if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
                bad(f.name, "must be a number")
            if kind is bool and not isinstance(v, bool):
                bad(f.name, "must be true or false")
            if kind is str and not isinstance(v, str):
                bad(f.name, "must be a string")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                     "num_hidden_layers", "num_attention_heads", "n_routed_experts",
                     "num_experts_per_tok", "n_group", "topk_group", "kv_lora_rank",
                     "qk_rope_head_dim", "v_head_dim", "expert_alignment", "num_token_chunks",
                     "moe_layer_freq", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                bad(name, "must be a positive integer")
        if self.n_shared_experts < 0:
            bad("n_shared_experts", "must be >= 0")
        if (self.q_lora_rank or 0) < 0:
            bad("q_lora_rank", "must be >= 0 (0 or null: no query compression)")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            bad("first_k_dense_replace", f"must lie in [0, num_hidden_layers={self.num_hidden_layers}]")
        if self.n_routed_experts % self.n_group:
            bad("n_group", f"must divide n_routed_experts={self.n_routed_experts}; "
                "pick n_group from its divisors")
        if self.topk_group > self.n_group:
            bad("topk_group", f"must be <= n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        if self.num_experts_per_tok > self.topk_group * per_group:
            bad("num_experts_per_tok", f"must be <= topk_group*experts_per_group = "
                f"{self.topk_group}*{per_group}: the kept groups hold only that many experts")
        if self.n_group > 1 and per_group < 2 and self.topk_method == "noaux_tc":
            bad("n_group", "each group needs >= 2 experts: the group score sums its top-2")
        if self.scoring_func not in ("sigmoid", "softmax"):
            bad("scoring_func", "must be 'sigmoid' (DeepSeek-V3) or 'softmax'")
        if self.routed_scaling_factor <= 0:
            bad("routed_scaling_factor", "must be > 0")
        if self.aux_loss_alpha < 0:
            bad("aux_loss_alpha", "must be >= 0 (0 turns the sequence-wise aux loss off)")
        if not self.seq_aux and self.aux_loss_alpha > 0:
            bad("seq_aux", "dropless computes only DeepSeek-V3's sequence-wise aux loss (there is no "
                "batch-wise variant); set seq_aux=true, or aux_loss_alpha=0 to turn the loss off")
        if self.bias_update_speed < 0:
            bad("bias_update_speed", "must be >= 0 (0 freezes the balancing bias)")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            bad("capacity_factor", "must be > 0, or null for dropless")
        if self.tie_word_embeddings:
            bad("tie_word_embeddings", "dropless builds DeepSeek-V3's untied output head; set it to false")
        if self.qk_nope_head_dim < 0:
            bad("qk_nope_head_dim", "must be >= 0")
        if self.qk_rope_head_dim % 2:
            bad("qk_rope_head_dim", "must be even (RoPE rotates pairs)")
        self.yarn()
        if self.num_nextn_predict_layers < 0:
            bad("num_nextn_predict_layers", "must be >= 0 (0: no multi-token-prediction module)")
        if self.mtp_loss_weight < 0:
            bad("mtp_loss_weight", "must be >= 0 (the MTP loss is added with this weight)")
        return self

    def yarn(self) -> Yarn | None:
        """``rope_scaling`` checked and read (:func:`parse_rope_scaling`): a :class:`Yarn`, or None
        for plain RoPE.

        Raises:
            ConfigError: as :func:`parse_rope_scaling`.
        """
        return parse_rope_scaling(self.rope_scaling, self.max_position_embeddings)

    # ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, strict: bool = False) -> "ModelArgs":
        """Build from a mapping; unknown keys raise (strict) or are ignored with a notice."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in d if k not in known)
        if unknown:
            msg = f"ModelArgs: keys not used by dropless: {', '.join(unknown)}"
            if strict:
                raise ConfigError(msg + " (check the spelling; see dropless/config.py for the fields)")
            warnings.warn(msg + " (ignored)", stacklevel=2)
        kw = {k: v for k, v in d.items() if k in known}
        if kw.get("q_lora_rank") is None and "q_lora_rank" in kw:
            kw["q_lora_rank"] = 0
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelArgs":
        """Load a published DeepSeek-V3 ``config.json`` (unknown keys ignored with a notice;
        ``rope_scaling`` is kept and applied, see :meth:`yarn`).

        Raises:
            ConfigError: the file is not UTF-8 JSON holding one object (naming the file and where it broke).
        """
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{str(path)!r} is not a JSON config.json ({type(e).__name__}: {e}); pass a model's "
                              "config.json (e.g. DeepSeek-V3's) or a model name") from e
        if not isinstance(d, dict):
            raise ConfigError(f"{str(path)!r}: a config.json holds one JSON object of model fields, this one holds a "
                              f"{type(d).__name__}")
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def deepseek_v3_671b(cls, **overrides: Any) -> "ModelArgs":
        """The published DeepSeek-V3 shape (config.json of deepseek-ai/DeepSeek-V3).

        It includes that file's YaRN ``rope_scaling`` (factor 40 over 4096 positions).
        One value differs from that file: ``aux_loss_alpha = 1e-4``, the α the technical report
        gives for training (arXiv:2412.19437 §4.2); the published config.json carries 0.001
        (which :meth:`from_json` keeps). ``overrides`` replace any field.
        """
        d = dict(
            vocab_size=129280, hidden_size=7168, intermediate_size=18432,
            moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3,
            num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
            n_group=8, topk_group=4, routed_scaling_factor=2.5, scoring_func="sigmoid",
            norm_topk_prob=True, topk_method="noaux_tc", aux_loss_alpha=1e-4,
            rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=163840,
            rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 4096, "type": "yarn"},
        )
        d.update(overrides)
        return cls(**d)


#: What each :class:`ModelArgs` field means: the one source of the ``model`` table of
#: ``docs/configuration.md`` (``python -m dropless.train.docgen``). Shape letters as in
#: ``docs/design.md#shapes-and-names``.
MODEL_FIELD_DOCS: dict[str, str] = {
    "vocab_size": "token vocabulary of the embedding and the output head",
    "hidden_size": "H, the model width",
    "intermediate_size": "SwiGLU width of the dense layers",
    "moe_intermediate_size": "I, SwiGLU width of each routed and shared expert",
    "num_hidden_layers": "decoder layers",
    "first_k_dense_replace": "the first k layers are dense, the rest MoE",
    "moe_layer_freq": "every n-th layer after the dense ones is an MoE layer",
    "num_attention_heads": "attention heads (MLA)",
    "q_lora_rank": "rank of MLA's query compression; 0 or null: none",
    "kv_lora_rank": "rank of MLA's key/value compression",
    "qk_nope_head_dim": "per-head query/key features without RoPE",
    "qk_rope_head_dim": "per-head query/key features with RoPE (the key part shared by all heads)",
    "v_head_dim": "per-head value features",
    "n_routed_experts": "E, routed experts per MoE layer",
    "n_shared_experts": "shared experts every token goes through",
    "num_experts_per_tok": "k, routed experts per token",
    "n_group": "expert groups of the group-limited top-k",
    "topk_group": "groups kept per token before the top-k",
    "routed_scaling_factor": "multiplies the normalised combine weights once",
    "scoring_func": "router scores: `sigmoid` (DeepSeek-V3) | `softmax`",
    "norm_topk_prob": "normalise the k combine weights to sum to 1",
    "topk_method": "`noaux_tc`: group-limited top-k with the aux-loss-free bias (selection only)",
    "aux_loss_alpha": "α of the sequence-wise auxiliary loss; 0 turns it off",
    "seq_aux": "the auxiliary loss is sequence-wise (DeepSeek-V3)",
    "rms_norm_eps": "RMSNorm's epsilon",
    "rope_theta": "RoPE base",
    "max_position_embeddings": "longest sequence the RoPE tables cover",
    "rope_scaling": "YaRN block as in DeepSeek-V3's config.json (type yarn, factor, "
                    "original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim); null: none",
    "tie_word_embeddings": "share the embedding and output head weights",
    "initializer_range": "standard deviation of the weight init",
    "num_nextn_predict_layers": "D multi-token-prediction modules (DeepSeek-V3 §2.2); 0: none",
    "bias_update_speed": "γ of the aux-loss-free bias update, applied once per optimizer step",
    "expert_alignment": "A: each expert's rows start on a multiple of A (128 for `gemm=deep_gemm`)",
    "capacity_factor": "null: dropless; a number: the token-dropping baseline with that capacity",
    "num_token_chunks": "N: router, dispatch, experts and combine in N chunks of the rank's tokens",
    "recompute_swiglu": "rebuild the SwiGLU output in backward instead of saving it",
    "recompute_fc1": "also rebuild FC1's (gate‖up) output and the shared experts in backward",
    "recompute_gather": "re-gather the landed rows from the layer input in backward (local/fsdp; implies "
                        "recompute_swiglu)",
    "fold_routing_weights": "multiply the routing weights in before FC2, so the combine is a plain sum",
    "gemm": "grouped-GEMM backend (set by the `gemm` group: `gemm.backend`)",
    "poison_padding": "debug: fill every padding row with NaN, so a read of padding shows",
    "seed": "weight-init seed, the same global weights whatever the parallel layout (set from the top-level `seed`)",
    "mtp_loss_weight": "λ of the multi-token-prediction loss (DeepSeek-V3: 0.3); used when D > 0",
}
