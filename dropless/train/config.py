"""Hydra configuration of a training run: compose ``configs/`` (+ ``recipes/``) into one DictConfig.

Layout (the repository root holds both directories)::

    configs/config.yaml      the primary config: the defaults list and the ``train:`` block
    configs/<group>/*.yaml   groups: model, dispatcher, gemm, optim, data, logging
    recipes/*.yaml           complete experiments (``# @package _global_``), selected with ``recipe=NAME``

Recipes are a Hydra config group. Their directory is ``recipes/`` at the repository
root, which is on the Hydra search path (``hydra.searchpath`` in config.yaml), so the
group's Hydra name is ``recipes``; :func:`compose` also accepts the singular
``recipe=NAME`` (the spelling the README uses) and rewrites it to ``recipes=NAME``.
A recipe is applied after ``config.yaml``'s own values, and command-line overrides are
applied after the recipe, so ``recipe=h200_single train.steps=50`` does what it reads.

``cfg.model`` is typed by the :class:`~dropless.config.ModelArgs` dataclass (a Hydra
structured-config schema, ``model/schema``): every ModelArgs field exists in every model
config and can be overridden (``model.hidden_size=128``); a key that is not a field, or
a value of the wrong type, is a composition error. Hydra's struct mode rejects any other
unknown key (``foo=1``); :func:`compose` turns Hydra's errors into :class:`ConfigError`.

Errors: :class:`ConfigError` (a ``ValueError``) naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Any, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from dropless.config import ConfigError, ModelArgs
from dropless.train.schema import SCHEMAS, validate_model

__all__ = ["compose", "model_args", "repo_root", "config_dir", "recipe_dir", "list_recipes",
           "ConfigError"]

_RESOLVER = "dropless_root"
#: why an override cannot add a key, and where to look instead (both errors of an unknown key say it)
_KEYS_EXIST = ("Every key dropless reads already exists in configs/ (a '+key' would be read by nobody); check the "
               "spelling (`dropless-train --cfg` prints the resolved config).")


def repo_root() -> Path:
    """The repository root: ``dropless/train/config.py`` -> parents[2]."""
    return Path(__file__).resolve().parents[2]


def config_dir() -> Path:
    """``<repo>/configs``; raises ConfigError if it is missing (e.g. a non-editable install)."""
    d = repo_root() / "configs"
    if not (d / "config.yaml").is_file():
        raise ConfigError(
            f"config directory not found: {d}/config.yaml. dropless reads its Hydra configs from the "
            "repository checkout; install it editable from the repository root "
            "(`pip install -e .`) and run from that checkout.")
    return d


def recipe_dir() -> Path:
    """``<repo>/recipes`` (complete experiments)."""
    return repo_root() / "recipes"


def list_recipes() -> list[str]:
    """Names of the recipes in ``recipes/`` (sorted)."""
    return sorted(p.stem for p in recipe_dir().glob("*.yaml"))


def _register() -> None:
    """Register the ``${dropless_root:}`` resolver and the typed schemas (idempotent).

    ``model/schema`` is :class:`ModelArgs`; the others are :data:`dropless.train.schema.SCHEMAS`.
    """
    if not OmegaConf.has_resolver(_RESOLVER):
        OmegaConf.register_new_resolver(_RESOLVER, lambda: str(repo_root()))
    store = ConfigStore.instance()
    try:  # typed schema: wrong types and unknown keys are caught at composition
        node = OmegaConf.structured(ModelArgs)
    except Exception:  # a field type OmegaConf cannot express: fall back to untyped defaults
        node = OmegaConf.create(dataclasses.asdict(ModelArgs()))
    store.store(group="model", name="schema", node=node)
    for group, name, schema in SCHEMAS:
        store.store(group=group, name=name, node=schema)


def _rewrite(overrides: Sequence[str]) -> list[str]:
    out = []
    for o in overrides:
        o = str(o)
        for pre in ("recipe=", "+recipe=", "++recipe="):
            if o.startswith(pre):
                o = "recipes=" + o[len(pre):]
        out.append(o)
    return out


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """Compose the run config from ``configs/`` (and ``recipes/``) with Hydra overrides.

    Args:
        overrides: Hydra override strings, e.g. ``["recipe=h200_single", "train.steps=50",
            "dispatcher=a2a", "model.hidden_size=128"]``. ``recipe=NAME`` selects
            ``recipes/NAME.yaml``.
        config_name: the primary config in ``configs/`` (default ``config``).
    Returns:
        The composed DictConfig in struct mode (unknown keys raise on access/assignment),
        interpolations left in place (resolve with ``OmegaConf.resolve`` / ``to_container``).
    Raises:
        ConfigError: the config directory is missing, an override names a key or group
            option that does not exist (the message keeps Hydra's explanation), or a value
            has the wrong type.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    cdir = config_dir()
    _register()
    ov = _rewrite(overrides)
    _check_overrides(ov, cdir)
    gh = GlobalHydra.instance()
    was = gh.is_initialized()
    if was:  # compose inside someone else's Hydra context: use our own, then give it back
        saved = gh.hydra
        gh.clear()
    failure = None
    try:
        with initialize_config_dir(config_dir=str(cdir), version_base=None, job_name="dropless"):
            cfg, assign = _compose_with_null_dicts(hydra_compose, config_name, ov)
    except (HydraException, OmegaConfBaseException) as e:
        failure = e
    except (AttributeError, AssertionError) as e:  # OmegaConf inside Hydra, on a key below a null field
        raise ConfigError(
            f"config composition failed for overrides {list(overrides)}: {type(e).__name__}: {str(e).splitlines()[0]}. "
            "A key below a field that is null in this config (e.g. model.rope_scaling.factor=4 where "
            "model.rope_scaling is null) cannot be set alone: set the whole field, e.g. "
            "'model.rope_scaling={type:yarn,factor:4,original_max_position_embeddings:4096}'") from e
    finally:
        if was:
            gh.clear()
            gh.initialize(saved)
    if failure is not None:
        raise ConfigError(_composition_message(failure, overrides)) from failure
    for key, value in assign:
        OmegaConf.update(cfg, key, value, merge=False)
    OmegaConf.set_struct(cfg, True)
    return cfg


def _check_overrides(ov: list[str], cdir: Path) -> None:
    """ConfigError for an override that adds a key (``+key=value``; every key dropless reads exists in
    ``configs/``) or picks a group's typed schema as an option (``optim=schema``)."""
    added = [o for o in ov if o.startswith("+") and not o.lstrip("+").startswith("recipes=")]
    if added:
        raise ConfigError(f"overrides {added} add new keys: drop the '+'. {_KEYS_EXIST}")
    for o in ov:  # each group's typed schema is registered beside its options, so Hydra lists it as one
        key, _, value = o.partition("=")
        if key in _GROUPS and value == "schema":
            options = sorted(f.stem for f in (cdir / key).glob("*.yaml"))
            raise ConfigError(f"{key}=schema: 'schema' is the typed schema of the {key} group, not an option; "
                              f"pick one of {options} ({key}=NAME)")


def _compose_with_null_dicts(hydra_compose: Any, config_name: str, ov: list[str]) -> tuple[DictConfig, list]:
    """Hydra's compose, except for ``key={...}`` overrides of a field that is null in the composed
    config (``model.rope_scaling`` in most model options): Hydra merges a dict override into the
    field, and OmegaConf cannot merge into a null node (``AttributeError: 'NoneType' object has no
    attribute 'get'``), so those are returned as ``(key, dict)`` to assign after composition."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    dict_ov = [o for o in ov if not o.startswith(("+", "~")) and o.partition("=")[2].lstrip().startswith("{")]
    if not dict_ov:
        return hydra_compose(config_name=config_name, overrides=ov), []
    rest = [o for o in ov if o not in dict_ov]
    base = hydra_compose(config_name=config_name, overrides=rest)
    assign, keep = [], []
    for o, parsed in zip(dict_ov, OverridesParser.create().parse_overrides(dict_ov)):
        key = parsed.key_or_group
        if OmegaConf.select(base, key, default="missing") is None:  # null here: assign, not merge
            assign.append((key, parsed.value()))
        else:
            keep.append(o)
    if not assign:
        return hydra_compose(config_name=config_name, overrides=ov), []
    cfg = hydra_compose(config_name=config_name, overrides=rest + keep) if keep else base
    return cfg, assign


_GROUPS = ("model", "dispatcher", "gemm", "optim", "data", "logging")


def _config_keys(overrides: Sequence[str] = ()) -> list[str]:
    """Every dotted key of the default config, or of the config ``overrides`` compose (``train.steps``,
    ``optim``, ``model.hidden_size``, …)."""
    def walk(node: dict, prefix: str) -> list[str]:
        out = []
        for k, v in node.items():
            key = f"{prefix}{k}"
            out.append(key)
            if isinstance(v, dict):
                out += walk(v, key + ".")
        return out

    # a container: a mandatory value still missing (data=bin's path) is no error here
    return walk(OmegaConf.to_container(compose(list(overrides)), resolve=False, throw_on_missing=False), "")


def _options_holding(key: str) -> list[str]:
    """The group options (``data=bin``) whose config holds ``key`` (``data.dtype``): a key of one option
    of a group that another option lacks."""
    group = key.split(".", 1)[0]
    if group not in _GROUPS:
        return []
    out = []
    for option in sorted(f.stem for f in (config_dir() / group).glob("*.yaml") if f.stem != "schema"):
        try:
            if key in _config_keys([f"{group}={option}"]):
                out.append(f"{group}={option}")
        except ConfigError:
            continue
    return out


def _composition_message(err: Exception, overrides: Sequence[str]) -> str:
    """Hydra's explanation (and the OmegaConf error it wraps) with dropless's one hint for unknown keys.

    Hydra suggests ``+key=value`` for a key that does not exist; dropless refuses ``+`` (every key it
    reads exists already), so that line is replaced by the closest existing key. Hydra's list of a
    group's options leaves out ``schema``, the typed base the options extend (not one to pick), and
    its search path (Hydra's own package, the schema store) gives way to where the options are.
    """
    lines = [str(err).strip()]
    cause = err.__cause__
    while cause is not None:  # Hydra wraps the OmegaConf error that names the type problem
        lines.append(str(cause).strip())
        cause = cause.__cause__
    kept, in_options, in_path = [], False, False
    for line in "\n".join(lines).splitlines():
        if line.startswith("To append to your config"):
            continue
        if in_options and line.strip() == "schema":  # the typed base every option of a group extends
            continue
        # Hydra's search path (its own package, the schema store): where configs/ is, said once below
        in_path = line.startswith("Config search path:") or (in_path and line.startswith("\t"))
        if in_path:
            continue
        in_options = line.startswith("Available options in") or (in_options and line.startswith("\t"))
        kept.append(line)
    group = re.search(r"Available options in '([^']+)'", "\n".join(kept))
    if group:
        where = recipe_dir() if group.group(1) == "recipes" else config_dir() / group.group(1)
        kept.append(f"(the options are the .yaml files in {where}/)")
    msg = "\n".join(kept)
    hint = ""
    unknown = re.search(r"Could not override '([^']+)'", msg)
    if unknown or "not in struct" in msg.lower():
        hint = "\n" + _KEYS_EXIST
        if unknown:
            key = unknown.group(1)
            value = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == key), "...")
            holders = _options_holding(key)
            close = [k for k in difflib.get_close_matches(key, _config_keys(), n=2, cutoff=0.6) if k != key]
            if holders:  # e.g. data.dtype, a key of data=bin, with the default data=stdlib
                group = key.split(".", 1)[0]
                hint = (f"\n'{key}' is a key of {' and '.join(holders)} only, not of this run's {group} option: "
                        f"choose {holders[0]} (or drop {key}=...).") + hint
            elif close:
                hint = f"\n'{key}' is not a config key: did you mean {close[0]}={value}?" + hint
    if "recipes" in msg and "Available options in 'recipes'" not in msg:
        hint += f"\nAvailable recipes (recipe=NAME): {', '.join(list_recipes())}"
    return f"config composition failed for overrides {list(overrides)}:\n{msg}{hint}"


def model_args(cfg: DictConfig) -> ModelArgs:
    """Build and validate :class:`ModelArgs` from ``cfg.model`` (strict).

    Args:
        cfg: a composed config (or any mapping with a ``model`` entry).
    Returns: validated ModelArgs.
    Raises:
        ConfigError: ``cfg.model`` holds a key that is not a ModelArgs field, or
            :meth:`ModelArgs.validate` rejects a value (:func:`~dropless.train.schema.validate_model`: the
            message names the field).
    """
    node = cfg["model"] if not isinstance(cfg, DictConfig) else cfg.model
    d = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    try:
        args = ModelArgs.from_dict(d, strict=True)
    except TypeError as e:
        raise ConfigError(f"model config: {e}") from e
    return validate_model(args)
