"""A run's resolved config on disk: written once by the launcher, read by every child process.

Children never read the YAML tree: they read the file the launcher wrote into the run folder
(``config.yaml``, or a resumed leg's ``config.resume-<checkpoint>.yaml``), each value as the
schema of its sync mode holds it, so that every process of a run sees the same settings and the
same plan.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, NamedTuple, cast

import yaml
from omegaconf import DictConfig, OmegaConf

from sdpipe_cli.config.schema import Config, schema_for
from sdpipe_cli.config.values import settings_from


@functools.cache
def frozen_schema(sync: str) -> DictConfig:
    """:func:`schema_for`, built once per sync mode and process, read-only: building it walks
    every dataclass (a third of what typing a run's config costs)."""
    schema = schema_for(sync)
    OmegaConf.set_readonly(schema, True)
    return schema


def typed(config: Any, sync: str) -> DictConfig:
    """``config`` (a mapping or a config) merged into the schema of ``sync``: a new config of
    its own, writable (merging copies the shared schema first)."""
    merged = cast(DictConfig, OmegaConf.merge(frozen_schema(sync), config))
    OmegaConf.set_readonly(merged, None)
    return merged


def save_run_config(cfg: DictConfig, path: Path) -> None:
    """Write the resolved config; child processes read this file, never the YAML tree."""
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))


class ChildConfig(NamedTuple):
    """A child's run folder, and its config as the read-only record and as settings."""

    run_dir: Path
    cfg: DictConfig
    settings: Config


def load_child_config() -> ChildConfig:
    """For a child process: its run folder and the resolved config the launcher wrote for it,
    read-only: a child reads its config, and what it derives is a new config
    (:mod:`sdpipe_cli.config.derived`).

    Built from the file's values through the schema's dataclasses
    (:func:`~sdpipe_cli.config.values.settings_from`), not typed by merging into the schema:
    the same values (``tests/unit/test_settings.py``) for about half the CPU each child spent
    here (typing, 20-25 ms of a small worker's 170 to start and end; the settings, under 1 ms,
    and the record made from them, about 12 ms in a forked child). A file whose values are not
    all of their fields' types (the launcher writes none) is typed, as before; a config from
    anywhere else is typed too (:mod:`~sdpipe_cli.config.saved`). The settings it built come
    with the record, so that the child does not build them again."""
    run_dir = Path(os.environ["SDPIPE_RUN_DIR"])
    values = read_run_file(Path(os.environ.get("SDPIPE_CONFIG", run_dir / "config.yaml")))
    try:
        settings = settings_from(values)
        cfg = OmegaConf.create(dataclasses.asdict(settings))
    except (TypeError, KeyError):  # not values of their types: typing converts them, or says why
        cfg = _typed(values)
        settings = cast(Config, OmegaConf.to_object(cfg))
    OmegaConf.set_readonly(cfg, True)
    return ChildConfig(run_dir, cfg, settings)


def read_run_file(path: Path) -> dict[str, Any]:
    """A run file's values as plain data: the launcher's own YAML (:func:`save_run_config`),
    parsed by libyaml's safe loader where PyYAML has it (a tenth of the pure-Python parser's
    time, paid by every process of a run; the same values, as PyYAML wrote them); else by
    OmegaConf's."""
    if getattr(yaml, "CSafeLoader", None) is None:
        return cast("dict[str, Any]", OmegaConf.to_container(OmegaConf.load(path)))
    return cast("dict[str, Any]", yaml.load(path.read_text(), Loader=yaml.CSafeLoader))


def load_run_config(path: Path) -> DictConfig:
    """Read a run's resolved config back, typed by the schema (:func:`read_run_file`)."""
    return _typed(read_run_file(path))


def _typed(saved: Any) -> DictConfig:
    sync = saved.get("sync") if isinstance(saved, dict) else None
    return typed(saved, sync.get("name", "") if isinstance(sync, dict) else "")
