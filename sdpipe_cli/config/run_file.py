"""A run's resolved config on disk: written once by the launcher, read by every child process.

Children never read the YAML tree: they read the file the launcher wrote into the run folder
(``config.yaml``, or a resumed leg's ``config.resume-<checkpoint>.yaml``), typed again by the
schema of its sync mode, so that every process of a run sees the same settings and the same plan.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from sdpipe_cli.config.schema import schema_for


def save_run_config(cfg: DictConfig, path: Path) -> None:
    """Write the resolved config; child processes read this file, never the YAML tree."""
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))


def load_child_config() -> tuple[Path, DictConfig]:
    """For a child process: its run folder and the resolved config the launcher wrote for it."""
    run_dir = Path(os.environ["SDPIPE_RUN_DIR"])
    return run_dir, load_run_config(Path(os.environ.get("SDPIPE_CONFIG", run_dir / "config.yaml")))


def load_run_config(path: Path) -> DictConfig:
    """Read a run's resolved config back, typed by the schema."""
    saved = OmegaConf.load(path)
    return OmegaConf.merge(schema_for(OmegaConf.select(saved, "sync.name", default="")), saved)
