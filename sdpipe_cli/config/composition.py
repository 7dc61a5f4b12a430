"""Composing a config: Hydra's Compose API over ``configs/``, typed by the schema, one line per error.

The schema (:mod:`sdpipe_cli.config.schema`) is registered with Hydra's ConfigStore as the primary
config's base, and the YAML files under ``configs/`` only set values; so composition rejects
unknown keys (with the closest known one as a hint) and wrong types, and turns Hydra's and
OmegaConf's exceptions into one :class:`~sdpipe_cli.config.schema.ConfigError` that names the key,
or ``FILE:LINE:COLUMN`` for a YAML syntax error. Every subcommand composes once.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from sdpipe_cli.config.run_file import frozen_schema
from sdpipe_cli.config.schema import SYNC_CONFIGS, Config, ConfigError, DataConfig, ModelConfig

# an override's length: Hydra's parser takes about 0.3 ms a character (a list of 8,000 values took
# 5 s, one of 60,000 over a minute); a config file's lists are read within bounds (yaml_bounds)
MAX_OVERRIDE_CHARS = 10_000


def config_dir() -> Path:
    """The YAML tree: packaged beside the code when installed, ``configs/`` in a source checkout."""
    package = Path(__file__).resolve().parents[1]
    packaged = package / "configs"
    if packaged.is_dir():
        return packaged
    return package.parent / "configs"


def group_options() -> dict[str, list[str]]:
    """Config groups and their options, read from the YAML tree (for ``--help``)."""
    root = config_dir()
    return {
        group.name: sorted(p.stem for p in group.glob("*.yaml"))
        for group in sorted(root.iterdir())
        if group.is_dir() and not group.name.startswith("_")
    }


@functools.cache
def register_schema() -> None:
    """Put the schema in Hydra's ConfigStore, where ``configs/config.yaml`` finds it
    (``base_config``; ``configs/sync/<name>.yaml`` extends ``sync/schema_<name>``). Once a process:
    the store outlives every composition, and storing costs a fifth of one."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    for name, node in SYNC_CONFIGS.items():
        store.store(group="sync", name=f"schema_{name}", node=node)


def compose(overrides: list[str]) -> DictConfig:
    """Compose the config tree with Hydra overrides (``key=value``, ``group=option``, ``+key=value``).

    Raises :class:`ConfigError` with one line naming the offending key for every Hydra or
    OmegaConf error (unknown key, wrong type, unknown group option, bad override syntax).
    """
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    check_lengths(overrides)
    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=[_adding(o) for o in overrides])
    except Exception as err:  # Hydra raises many types; all become one line
        raise _as_config_error(err) from None
    finally:
        GlobalHydra.instance().clear()
    _gather_kwargs(cfg)
    # Hydra lets ``+key=value`` add keys the schema does not have; the schema is the contract.
    _reject_unknown_keys(cfg, frozen_schema(cfg.sync.name), sync=cfg.sync.name)
    searched = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.searchpath=")]
    if searched:
        cfg.run.config_dirs = [d.removeprefix("file://") for d in searched[-1].strip("[]").split(",")
                               if d.startswith("file://")]
    return cfg


def check_lengths(overrides: Iterable[str]) -> None:
    """ConfigError naming the first override longer than :data:`MAX_OVERRIDE_CHARS`, before
    Hydra's parser spends minutes on it."""
    for override in overrides:
        if len(override) > MAX_OVERRIDE_CHARS:
            raise ConfigError(override.partition("=")[0][:100], f"the override is {len(override):,} "
                              f"characters; one has at most {MAX_OVERRIDE_CHARS:,} (put long lists in a "
                              "config file: --config-dir)")


def _adding(override: str) -> str:
    """``KEY={...}`` for a mapping setting (``pipeline.partitions``, ``fault.slowed``) as
    ``++KEY={...}``: Hydra merges a mapping into the default, and under the schema's struct flag
    refuses the new keys a mapping setting is for. The keys are checked after composition."""
    key, sep, value = override.partition("=")
    if sep and value.lstrip().startswith("{") and key in mapping_settings():
        return f"++{override}"
    return override


@functools.cache
def mapping_settings() -> frozenset[str]:
    """The schema's settings whose value is a mapping of the user's keys (typed ``Dict``)."""
    found: set[str] = set()

    def walk(node: DictConfig, prefix: str) -> None:
        for key in cast("Iterable[str]", node.keys()):  # a dataclass node: its keys are fields
            child = node._get_node(key)
            if OmegaConf.get_type(node, key) is dict:
                found.add(f"{prefix}{key}")
            elif isinstance(child, DictConfig):
                walk(child, f"{prefix}{key}.")

    walk(OmegaConf.structured(Config), "")
    return frozenset(found)


def _gather_kwargs(cfg: DictConfig) -> None:
    """``model=custom``, ``data=custom``: keys of the node that the schema does not know
    (``+model.width=64``) are the callable's keyword arguments: move them into ``kwargs``."""
    from omegaconf import open_dict

    for key, schema in (("model", ModelConfig), ("data", DataConfig)):
        node_cfg = cfg[key]
        if node_cfg.get("arch" if key == "model" else "name") != "custom":
            continue
        known = set(OmegaConf.structured(schema).keys())
        node = cast("dict[str, Any]", OmegaConf.to_container(node_cfg))  # a dataclass node
        extra = {k: node.pop(k) for k in list(node) if k not in known}
        if extra:
            node["kwargs"] = {**node.get("kwargs", {}), **extra}
            with open_dict(cfg):
                # a structured node cannot drop keys; it can be replaced
                cfg[key] = OmegaConf.merge(OmegaConf.structured(schema), node)


def _reject_unknown_keys(cfg: DictConfig, schema: DictConfig, prefix: str = "",
                         sync: str = "") -> None:
    # keys are str: the schema's dataclass fields and Hydra's overrides (free-form dicts not walked)
    for key in cast("Iterable[str]", cfg.keys()):
        if key in schema and OmegaConf.is_missing(schema, key):
            continue
        name = f"{prefix}{key}"
        if key not in schema:
            other = _of_other_modes(name, sync)
            if other:
                raise ConfigError(name, other)
            close = _closest(str(key), schema.keys())
            hint = f"did you mean '{prefix}{close}'? " if close else ""
            raise ConfigError(name, f"is not a setting of sdpipe ({hint}known here: "
                                    f"{', '.join(cast('Iterable[str]', schema.keys()))})")
        free_form = OmegaConf.get_type(schema, key) is dict  # Dict[str, Any]: model.hf, model.kwargs
        if isinstance(schema[key], DictConfig) and isinstance(cfg[key], DictConfig) and not free_form:
            _reject_unknown_keys(cfg[key], schema[key], f"{name}.", sync)


def _as_config_error(err: Exception) -> ConfigError:
    """Turn a Hydra/OmegaConf exception into a one-line :class:`ConfigError` that points at the
    place: ``FILE:LINE:COLUMN`` for a YAML syntax error, else the key's full path with the whole
    reason (the config file it came from, the nearest valid key for a misspelled one, the fix
    for two common override mistakes)."""
    import yaml
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    chain = _causes(err)
    text = " ".join(str(err).split("\n")[0].split())
    syntax = next((e for e in chain if isinstance(e, yaml.MarkedYAMLError)), None)
    if syntax is not None:
        mark = syntax.problem_mark or syntax.context_mark
        where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}" if mark else "a config file"
        what = " ".join(p for p in (syntax.context, syntax.problem) if p)
        return ConfigError(where, f"YAML syntax: {what}")
    source = re.search(r"In '([\w./-]+)'", str(err))
    within = f" (in config file {source.group(1)}.yaml)" if source else ""
    keyed = next((e for e in chain if isinstance(e, OmegaConfBaseException)
                  and getattr(e, "full_key", None)), None)
    if keyed is not None:
        key = cast(str, keyed.full_key)  # picked for a full_key, which OmegaConf sets to a str
        reason = " ".join(str(getattr(keyed, "msg", None) or keyed).split("\n")[0].split())
        if isinstance(keyed, (ConfigKeyError, AttributeError)) or "not in" in reason:
            modes: dict[type | None, str] = {c: n for n, c in SYNC_CONFIGS.items()}
            sync = modes.get(getattr(keyed, "object_type", None))
            reason = _of_other_modes(key, sync or "") or f"is not a setting of sdpipe{_nearest(key)}"
        return ConfigError(key, reason + within)
    if "Ambiguous value for argument" in text:
        arg = re.search(r"argument '([^']*)'", text)
        key = arg.group(1).split("=", 1)[0] if arg else "overrides"
        return ConfigError(key, "a comma-separated value is a sweep: run it with -m (sdpipe train "
                                f"-m {arg.group(1) if arg else '...'}), or quote a list: "
                                f"'{key}=[a,b]'")
    if "Error parsing override" in text or "LexerNoViableAlt" in text:
        arg = re.search(r"override '([^']*)'", text) or re.search(r"Exception: (\S+)", text)
        key = (arg.group(1).split("=", 1)[0] if arg else "overrides").strip()
        bad = _unquotable(str(err))
        if bad is not None:
            char, value = bad
            return ConfigError(key, f"Hydra's override grammar does not take {char!r} in a value "
                                    f"unquoted: quote the value, '{key}=\"{value}\"'")
        return ConfigError(key, f"an override is KEY=VALUE in one word: write {key}=VALUE "
                                f"(not '{key} VALUE'), and quote a value with spaces")
    missing = re.search(r"Could not find '(\w+)/([^']*)'", str(err))
    if missing:
        group, option = missing.groups()
        choices = ", ".join(group_options().get(group, []))
        return ConfigError(group, f"no option '{option}' in config group '{group}' (choices: {choices})")
    match = re.search(r"'([A-Za-z_][\w.]*)'", str(err))
    return ConfigError(match.group(1) if match else "overrides", text)


def _unquotable(message: str) -> tuple[str, str] | None:
    """The character of an override's value that Hydra's lexer stopped at (its message shows the
    override, then a caret under that character) and the value, or None if it stopped in the key."""
    lines = message.split("\n")
    head = re.match(r"(.*?Exception: )(\S+)", lines[0])
    if head is None or len(lines) < 2 or "^" not in lines[1]:
        return None
    override, at = head.group(2), lines[1].index("^") - len(head.group(1))
    if "=" not in override or not override.index("=") < at < len(override):
        return None
    return override[at], override.split("=", 1)[1]


def _causes(err: BaseException | None) -> list[BaseException]:
    chain, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


def _of_other_modes(key: str, sync: str) -> str:
    """Why ``sync.KEY`` is refused where it is a setting of other sync modes than the run's
    ``sync`` (each mode's settings are its own schema): which modes take it; else ``''``."""
    parent, _, leaf = key.rpartition(".")
    if parent != "sync" or not sync:
        return ""
    modes = [n for n, c in SYNC_CONFIGS.items() if leaf in {f.name for f in dataclasses.fields(c)}]
    if not modes or sync in modes:
        return ""
    return f"is a setting of {' or '.join(f'sync={m}' for m in modes)}, not of sync={sync}"


def _nearest(key: str) -> str:
    """``; did you mean 'train.steps'?`` for a misspelled ``train.stepz``, else ``''``."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.structured(Config)
    try:
        node = OmegaConf.select(node, parent) if parent else node
    except Exception:  # noqa: BLE001 - a parent that is not a node: no suggestion
        return ""
    if not isinstance(node, DictConfig):
        return ""
    close = _closest(leaf, node.keys())
    return f"; did you mean '{parent + '.' if parent else ''}{close}'?" if close else ""


def _closest(word: str, known) -> str | None:
    """The known key nearest to a misspelled ``word`` (difflib's ratio 0.6 or more), if any."""

    close = difflib.get_close_matches(word, [str(k) for k in known], n=1, cutoff=0.6)
    return close[0] if close else None
