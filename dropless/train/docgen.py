"""Generate ``docs/configuration.md`` from the typed config schemas and ``configs/``.

One source for the reference: each field's type comes from its dataclass annotation
(:mod:`dropless.train.schema`, :class:`dropless.config.ModelArgs`), its meaning from
:data:`dropless.train.schema.FIELD_DOCS` / :data:`dropless.config.MODEL_FIELD_DOCS`, its default
from the composed default config, and each group option's summary and values from its YAML file.

Usage::

    python -m dropless.train.docgen            # rewrite docs/configuration.md
    python -m dropless.train.docgen --check    # exit 1 if the file differs from the schemas

``tests/test_config_docs.py`` runs the check.

Raises:
    KeyError: a schema field has no entry in its docs dict (add one).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dropless.config import MODEL_FIELD_DOCS, ModelArgs
from dropless.train import schema
from dropless.train.config import compose, config_dir, list_recipes, recipe_dir, repo_root

__all__ = ["OUTPUT", "main", "render"]

#: the generated file, relative to the repository root
OUTPUT = Path("docs") / "configuration.md"

#: (group, schema) in the order the reference lists them; data has one schema per option
_GROUPS = (
    ("train", schema.TrainConfig),
    ("model", ModelArgs),
    ("dispatcher", schema.DispatcherConfig),
    ("gemm", schema.GemmConfig),
    ("optim", schema.OptimConfig),
    ("data", None),
    ("logging", schema.LoggingConfig),
)
_DATA_SCHEMAS = {"text": schema.TextDataConfig, "bin": schema.BinDataConfig}


def _value(v: Any) -> str:
    """A config value as it is written on the command line (YAML spelling)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    if v == "???":
        return "required"
    return str(v)


def _type(f: dataclasses.Field) -> str:
    """The annotation as written (``from __future__ import annotations``), ``Optional`` spelt "or null"."""
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if t.startswith("Optional[") and t.endswith("]"):
        return t[len("Optional["):-1] + " or null"
    return t.replace(" | None", " or null")


def _docs(cls: type) -> dict[str, str]:
    return MODEL_FIELD_DOCS if cls is ModelArgs else schema.FIELD_DOCS[cls]


def _fields(cls: type) -> list[dataclasses.Field]:
    """The fields of a schema; the top level's group fields have sections of their own."""
    skip = {g for g, _ in _GROUPS} if cls is schema.RunConfig else set()
    return [f for f in dataclasses.fields(cls) if f.name not in skip]


def _table(cls: type, values: dict, prefix: str) -> list[str]:
    docs = _docs(cls)
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in _fields(cls):
        if f.name not in docs:
            raise KeyError(f"{cls.__name__}.{f.name} has no description: add it to "
                           f"{'MODEL_FIELD_DOCS' if cls is ModelArgs else 'FIELD_DOCS'}")
        key = f"{prefix}{f.name}"
        meaning = docs[f.name].replace("|", "\\|")  # a bare | would end the table cell
        out.append(f"| `{key}` | {_type(f)} | `{_value(values.get(f.name))}` | {meaning} |")
    return out


def _summary(path: Path) -> str:
    """The leading comment block of a YAML file, joined into one line."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text.startswith("@package") or text.startswith("dropless-train ") or text.startswith("sbatch "):
            continue
        lines.append(text)
    return " ".join(x for x in lines if x)


def _option_values(path: Path) -> dict:
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    cfg.pop("defaults", None)
    return cfg


def _options(group: str, default: str, default_values: dict) -> list[str]:
    out = []
    for path in sorted((config_dir() / group).glob("*.yaml")):
        name = path.stem
        mark = " (default)" if name == default else ""
        out.append(f"- `{group}={name}`{mark}: {_summary(path)}")
        if name == default:
            continue
        diff = {k: v for k, v in _option_values(path).items() if default_values.get(k) != v}
        if diff and len(diff) <= 40:
            out.append("  Sets " + ", ".join(f"`{group}.{k}={_value(v)}`" for k, v in diff.items()) + ".")
    return out


def render() -> str:
    """The text of ``docs/configuration.md`` for the schemas and ``configs/`` as they are now."""
    cfg = OmegaConf.to_container(compose([]), resolve=True)
    defaults = {}  # group -> its default option, from the defaults list of configs/config.yaml
    for d in OmegaConf.to_container(OmegaConf.load(config_dir() / "config.yaml"))["defaults"]:
        if isinstance(d, dict):
            defaults.update({k: v for k, v in d.items() if v is not None})
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m dropless.train.docgen` from dropless/train/schema.py, "
        "ModelArgs in dropless/config.py and configs/; do not edit by hand. -->",
        "",
        "Every key below is set on the command line as `key=value` (`dropless-train train.steps=50 "
        "model.hidden_size=256`); a group option is picked as `group=option` (`dispatcher=a2a`) and a "
        "whole experiment as `recipe=NAME`. A key that does not exist, or a value of the wrong type, is an "
        "error naming the field (exit status 2) before anything runs; `dropless-train --cfg` prints the "
        "resolved config and exits. Defaults are those of `dropless-train` with no overrides.",
        "",
        "## Top level",
        "",
    ]
    lines += _table(schema.RunConfig, cfg, "")
    lines += ["", "## Recipes", ""]
    for name in list_recipes():
        lines.append(f"- `recipe={name}`: {_summary(recipe_dir() / f'{name}.yaml')}")
    for group, cls in _GROUPS:
        lines += ["", f"## {group}", ""]
        values = cfg[group]
        if group == "train":
            lines += _table(cls, values, "train.")
            continue
        default = defaults.get(group)
        if group == "data":
            for kind, data_cls in _DATA_SCHEMAS.items():
                opt = "stdlib" if kind == "text" else "bin"
                vals = values if values.get("kind") == kind else _option_values(config_dir() / "data" / f"{opt}.yaml")
                lines += [f"With `data={opt}`:", ""] + _table(data_cls, vals, "data.") + [""]
            lines += ["Options:", ""] + _options(group, default, {})
            continue
        lines += _table(cls, values, f"{group}.")
        lines += ["", "Options:", ""] + _options(group, default, values)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) ``docs/configuration.md``; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m dropless.train.docgen", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is out of date")
    args = p.parse_args(argv)
    path = repo_root() / OUTPUT
    text = render()
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"{OUTPUT} is out of date: run `python -m dropless.train.docgen`", file=sys.stderr)
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
