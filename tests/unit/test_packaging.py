"""A wheel holds every package of the source tree (setup.cfg lists them one by one), and an
install brings what they import."""

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


def test_the_install_brings_the_numpy_that_safetensors_saves_torch_tensors_with():
    """safetensors.torch's save_file imports numpy, which safetensors itself requires only with its
    ``torch`` extra: what setup.cfg's install_requires bring, followed through the installed
    packages' own requirements, must hold numpy (an install made as the README says could not
    export)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    setup = configparser.ConfigParser(inline_comment_prefixes=("#",))
    setup.read(ROOT / "setup.cfg")
    todo = [Requirement(line) for line in setup["options"]["install_requires"].splitlines()
            if line.strip()]
    brought: set[tuple[str, str]] = set()
    while todo:
        req = todo.pop()
        for extra in sorted(req.extras) or [""]:
            if (canonicalize_name(req.name), extra) in brought:
                continue
            brought.add((canonicalize_name(req.name), extra))
            for line in metadata.requires(req.name) or []:
                needed = Requirement(line)
                if needed.marker is None or needed.marker.evaluate({"extra": extra}):
                    todo.append(needed)
    assert ("numpy", "") in brought, sorted(brought)
