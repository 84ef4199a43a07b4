"""``dropless-convert``: Hugging Face DeepSeek-V3 directories <-> dropless DCP checkpoints.

```
dropless-convert hf-to-dcp SRC DST [--set FIELD=VALUE ...]
dropless-convert dcp-to-hf SRC DST [--config PATH] [--dtype bfloat16] [--max-shard-size 5GB]
                                   [--copy-tokenizer HF_DIR]
```

``hf-to-dcp`` builds the model from SRC's config.json (``--set`` changes dropless's own
fields, e.g. ``--set expert_alignment=128``), loads the weights (FP8 dequantised) and writes
a weights-only DCP checkpoint with ``model_args.json``; ``dropless-train init_from=DST``
starts from it. It holds the model once in memory in fp32, in one process; for models that
do not fit, give the Hugging Face directory to ``init_from`` directly under torchrun, where
each rank reads only its own experts.

``dcp-to-hf`` reads SRC (hf-to-dcp's output, a training run's ``checkpoints/step_N``, or the run
directory itself for its newest complete checkpoint; the
model config from ``--config``, ``SRC/model_args.json`` or the run's ``config.yaml``) tensor
by tensor and writes a Hugging Face directory (:func:`dropless.convert.hf_export.export_hf`).

Exit status 2 with a one-line message for bad input (ConfigError, missing files).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch
import yaml

from dropless.config import ConfigError
from dropless.convert.dcp_io import DCPSource, is_dcp_dir, newest_run_checkpoint, read_model_args, save_model_dcp
from dropless.convert.hf_config import args_from_hf_config, read_hf_config
from dropless.convert.hf_export import export_hf
from dropless.convert.hf_import import load_hf
from dropless.model.transformer import Transformer

__all__ = ["main", "parse_size"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"1.5GiB"``, ``"1000"`` -> bytes (GB = 10⁹, GiB = 2³⁰, as HF's
    ``max_shard_size``). Raises ConfigError for anything else."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise ConfigError(f"--max-shard-size={text!r}: give bytes or a size like 5GB, 500MB, 2GiB")
    unit = m.group(2).upper().rstrip("B")
    mult = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
            "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(float(m.group(1)) * mult)


def _overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: write FIELD=VALUE (a ModelArgs field)")
        k, v = item.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out


def hf_to_dcp(src: str | Path, dst: str | Path, overrides: dict | None = None) -> Path:
    """The ``hf-to-dcp`` command as a function. Returns ``dst``."""
    args, _ = args_from_hf_config(read_hf_config(src), **(overrides or {}))
    model = Transformer(args)
    load_hf(model, src, check_config=False)  # the model was built from this very config
    return save_model_dcp(model, dst)


def dcp_to_hf(src: str | Path, dst: str | Path, config: str | Path | None = None,
              dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 10**9,
              copy_files_from: str | Path | None = None) -> Path:
    """The ``dcp-to-hf`` command as a function. ``src`` may also be a training run's directory: its
    newest complete checkpoint is read (and said). Returns ``dst``."""
    if not is_dcp_dir(src) and (newest := newest_run_checkpoint(src)) is not None:
        print(f"[dropless-convert] {src} is a run directory: reading its newest complete checkpoint, {newest.name}")
        src = newest
    source = DCPSource(src)  # first: a directory that is no checkpoint is the error to report
    args = read_model_args(src, config)
    return export_hf(source, args, dst, dtype=dtype, max_shard_bytes=max_shard_bytes,
                     copy_files_from=copy_files_from)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless-convert", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-dcp", help="Hugging Face DeepSeek-V3 directory -> weights-only DCP checkpoint")
    a.add_argument("src")
    a.add_argument("dst")
    a.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="a dropless ModelArgs field to set (repeatable)")
    b = sub.add_parser("dcp-to-hf", help="DCP checkpoint -> Hugging Face directory (sharded safetensors)")
    b.add_argument("src")
    b.add_argument("dst")
    b.add_argument("--config", default=None, help="model_args.json, a run's config.yaml or a config.json")
    b.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="dtype of the written weights "
                   "(default: the checkpoint's)")
    b.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (bytes, or 5GB, 500MB, 2GiB; "
                   "default 5GB)")
    b.add_argument("--copy-tokenizer", default=None, metavar="HF_DIR",
                   help="copy tokenizer and generation files from this Hugging Face directory")
    ns = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        if ns.cmd == "hf-to-dcp":
            out = hf_to_dcp(ns.src, ns.dst, _overrides(ns.overrides))
        else:
            out = dcp_to_hf(ns.src, ns.dst, ns.config, _DTYPES[ns.dtype] if ns.dtype else None,
                            parse_size(ns.max_shard_size), ns.copy_tokenizer)
    except (ConfigError, FileNotFoundError, ImportError) as e:
        print(f"dropless-convert: {e}", file=sys.stderr)
        return 2
    print(f"[dropless-convert] wrote {out} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
