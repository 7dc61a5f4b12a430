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
