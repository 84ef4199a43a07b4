"""``dropless-plan``: the planner's command line (Hydra overrides as for training, or ``--model``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from dropless.config import ModelArgs
from dropless.dispatch.registry import dispatcher_class
from dropless.plan.report import RankShape, format_plan, plan
from dropless.train.config import compose, model_args

__all__ = ["main"]


# --------------------------------------------------------------------------- CLI
_MODELS = {"deepseek_v3_671b": ModelArgs.deepseek_v3_671b}
# The reference rank of docs/design.md#a-worked-rank: 64-way EP (V3 paper), 8,192 tokens per rank (DeepEP's setting).
_MODEL_DEFAULTS = {"deepseek_v3_671b": {"ep": 64, "tokens_per_rank": 8192, "seq_len": 4096}}


def _int_list(name: str, s: str) -> list[int]:
    try:
        return [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ValueError(f"{name}={s!r}: give comma-separated integers, e.g. 21733,15004,17982,10817")


def _float_list(name: str, s: str) -> list[float]:
    try:
        return [float(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ValueError(f"{name}={s!r}: give comma-separated numbers, e.g. 1.0,1.5")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dropless-plan",
        description="Per-rank compute, memory and communication of one MoE layer of a recipe "
                    "before a job is launched. Takes the training's Hydra overrides.")
    p.add_argument("overrides", nargs="*", help="Hydra overrides as for training, key=value")
    p.add_argument("--model", default=None,
                   help="'deepseek_v3_671b' or a path to a DeepSeek-V3 config.json, instead of "
                        "composing the Hydra config (defaults: EP 64, 8,192 tokens per rank)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--counts", default=None, help="rows per local expert of one rank, e.g. "
                   "21733,15004,17982,10817 (length E/EP)")
    p.add_argument("--capacity-factor", default="1.0,1.5", help="capacity factors to compare")
    p.add_argument("--tile", type=int, default=128, help="tile height (rows), default 128")
    p.add_argument("--alignment", type=int, default=None,
                   help="expert alignment A (default: the model's expert_alignment)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--fp8-dispatch", dest="fp8_dispatch", action="store_true", default=None,
                   help="a2a / agrs dispatch in FP8: 1 B per element + the fp32 scales (default: FP8 exactly "
                        "when gemm is fp8 or deep_gemm, as dropless's a2a and agrs dispatch)")
    g.add_argument("--bf16-dispatch", dest="fp8_dispatch", action="store_false",
                   help="a2a / agrs dispatch in bf16, 2 B per element (default for gemm=torch / loop)")
    p.add_argument("--ep", type=int, default=None, help="EP size (overrides dispatcher.ep_size)")
    p.add_argument("--tokens-per-rank", type=int, default=None,
                   help="T (default: train.micro_batch_size x train.seq_len)")
    p.add_argument("--seq-len", type=int, default=None, help="S for FLOPs per token")
    p.add_argument("--world", type=int, default=None,
                   help="ranks of the job, for the training state per rank (default: $WORLD_SIZE; without "
                        "either, no state table)")
    p.add_argument("--device-gib", type=float, default=None,
                   help="GiB of one device to check the state against (e.g. 139 for an H200 as torch counts it)")
    return p


def _layout(cfg) -> dict:
    """``train.shard_experts``, ``train.shard_dense`` and the compute dtype's bytes from the training config
    (``train.dtype=auto``: bf16 on ``device=cuda``, else fp32, as the trainer resolves it on that device)."""
    train = cfg.get("train") or {}
    dtype = str(train.get("dtype", "auto"))
    if dtype == "auto":
        dtype = "bf16" if str(cfg.get("device", "auto")) == "cuda" else "fp32"
    return {"shard_experts": bool(train.get("shard_experts", False)),
            "shard_dense": bool(train.get("shard_dense", False)), "compute_bytes": 2 if dtype == "bf16" else 4}


def _from_hydra(overrides: Sequence[str]) -> tuple[ModelArgs, int | None, int | None, int | None, dict]:
    """(args, ep, tokens_per_rank, seq_len, layout) from the training config."""
    cfg = compose(list(overrides))
    args = model_args(cfg)
    ep = None
    disp = cfg.get("dispatcher") if hasattr(cfg, "get") else None
    if disp is not None:
        ep = disp.get("ep_size")
        if ep is None and not dispatcher_class(disp.get("name")).expert_parallel:
            ep = 1
        if ep is not None:
            dispatcher_class(disp.get("name")).check_ep(int(ep))
    tokens = seq_len = None
    train = cfg.get("train") if hasattr(cfg, "get") else None
    if train is not None and train.get("seq_len") is not None:
        seq_len = int(train.get("seq_len"))
        if train.get("micro_batch_size") is not None:
            tokens = int(train.get("micro_batch_size")) * seq_len
    return args, (int(ep) if ep is not None else None), tokens, seq_len, _layout(cfg)


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``dropless-plan``. Returns 0; bad input exits with status 2 and the message."""
    parser = _parser()
    ns = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    try:
        for o in ns.overrides:
            if "=" not in o:
                raise ValueError(f"override {o!r} is not key=value (e.g. dispatcher=a2a "
                                 "model.hidden_size=1024)")
        defaults: dict[str, int] = {}
        layout: dict = {"compute_bytes": 2}
        if ns.model is not None:
            if ns.overrides:
                raise ValueError("--model and Hydra overrides do not mix: drop --model to compose "
                                 "the training config, or drop the overrides")
            if ns.model in _MODELS:
                args = _MODELS[ns.model]()
                defaults = _MODEL_DEFAULTS.get(ns.model, {})
            elif os.path.isfile(ns.model):
                args = ModelArgs.from_json(ns.model)
            else:
                what = ("is a directory, not a config.json" if os.path.isdir(ns.model) else
                        "is no model name and no such file" if os.sep in ns.model or ns.model.endswith(".json")
                        else "is no model name")
                raise ValueError(f"--model={ns.model!r} {what}: give one of {sorted(_MODELS)} or the path "
                                 "of a config.json")
            ep, tokens, seq_len = defaults.get("ep"), defaults.get("tokens_per_rank"), \
                defaults.get("seq_len")
        else:
            args, ep, tokens, seq_len, layout = _from_hydra(ns.overrides)
        if ns.ep is not None:
            ep = ns.ep
        if ep is None:
            env = os.environ.get("WORLD_SIZE")
            if env is None:
                raise ValueError("the EP size is not set (dispatcher.ep_size is null = world size): "
                                 "pass --ep N or dispatcher.ep_size=N")
            ep = int(env)
        if ns.tokens_per_rank is not None:
            tokens = ns.tokens_per_rank
        if tokens is None:
            raise ValueError("tokens per rank unknown: pass --tokens-per-rank N or set "
                             "train.micro_batch_size and train.seq_len")
        if ns.seq_len is not None:
            seq_len = ns.seq_len
        shape = RankShape.from_args(args, tokens, ep, ns.alignment)
        counts = _int_list("--counts", ns.counts) if ns.counts else None
        cfs = _float_list("--capacity-factor", ns.capacity_factor) if ns.capacity_factor else []
        world = ns.world if ns.world is not None else (int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ
                                                       else None)
        device = None if ns.device_gib is None else int(ns.device_gib * 2**30)
        result = plan(shape, counts, cfs, ns.tile, ns.fp8_dispatch, args=args, seq_len=seq_len, world=world,
                      device_bytes=device, **layout)
    except ValueError as exc:
        parser.exit(2, f"dropless-plan: error: {exc}\n")
    text = json.dumps(result, indent=2) if ns.json else format_plan(result)
    try:
        print(text)
    except BrokenPipeError:  # `dropless-plan | head`: the reader left; not an error
        sys.stdout = open(os.devnull, "w")
    return 0

