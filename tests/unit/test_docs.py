"""The README stays a short entry point, and the links and module paths in README.md and docs/ hold."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
TEST_COMMAND = "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q"  # .ci/run runs it


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def test_readme_is_short_and_keeps_the_test_command():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "README.md: keep it under 250 lines; move detail to docs/"
    assert TEST_COMMAND in text


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_module_paths_exist():
    """Paths like sdpipe_cli/sync/scheduler.py or tests/test_hetero.py, modules like
    sdpipe_cli.training.main."""
    stale = []
    for page in PAGES:
        text = page.read_text()
        for path in re.findall(r"(?:sdpipe_cli|tests|scripts)/[\w/]+\.(?:py|sh)", text):
            if not (ROOT / path).exists():
                stale.append(f"{page.name}: {path}")
        for module in re.findall(r"\bsdpipe_cli(?:\.\w+)+", text):
            parts = module.split(".")
            base = ROOT.joinpath(*parts)
            if module == "sdpipe_cli.configs":  # the YAML tree, installed under this name
                continue
            if not (base.with_suffix(".py").exists() or (base / "__init__.py").exists()
                    or base.parent.with_suffix(".py").exists()):  # a module's attribute
                stale.append(f"{page.name}: {module}")
    assert not stale, "stale module paths:\n" + "\n".join(stale)


def readme_commands(program: str) -> list[list[str]]:
    """The ``sdpipe PROGRAM ...`` lines of the README's code blocks, split as a shell would
    (``$HOME`` expanded, comments dropped), without ``sdpipe PROGRAM``."""
    import os
    import shlex

    out, fenced = [], False
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced and line.startswith(f"sdpipe {program} "):
            words = shlex.split(os.path.expandvars(line), comments=True)
            out.append(words[2:])
    return out


def test_every_training_example_in_the_readme_composes_and_validates():
    """What the README tells users to type is read by the same parser and checks as theirs
    would be (a ``data.path=~/corpus`` that Hydra's lexer refuses fails here); files and devices
    it names are not looked at."""
    from sdpipe_cli.config.composition import compose
    from sdpipe_cli.config.sweep import expand
    from sdpipe_cli.config.validation import validate

    examples = readme_commands("train") + readme_commands("simulate")
    assert len(examples) >= 20
    checked = 0
    for words in examples:
        overrides = [w for w in words if "=" in w and not w.startswith("-")]
        for combination in expand(overrides):
            cfg = compose(list(combination.overrides))
            # the user's own files and GPUs are theirs to have
            if cfg.cluster.device != "cuda" and not any(
                    w.startswith(("data.path=", "profile=", "data._target_=", "model._target_="))
                    for w in combination.overrides):
                validate(cfg)
            checked += 1
    assert checked >= len(examples)
