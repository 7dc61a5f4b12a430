"""A wheel holds every package of the source tree: setup.cfg lists them one by one."""

from __future__ import annotations

import configparser
from pathlib import Path

import sdpipe_cli

ROOT = Path(sdpipe_cli.__file__).resolve().parents[1]


def test_every_package_is_listed_in_setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = {line.strip() for line in cfg["options"]["packages"].splitlines() if line.strip()}
    found = {".".join(init.parent.relative_to(ROOT).parts)
             for init in (ROOT / "sdpipe_cli").rglob("__init__.py")}
    assert found - listed == set(), "add these to setup.cfg's packages"
    assert listed - found == {"sdpipe_cli.configs"}  # the YAML tree, mapped by package_dir
