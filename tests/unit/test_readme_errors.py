"""Every error the README's troubleshooting quotes is one sdpipe still gives, word for word
(``...`` standing for what differs from run to run): each quote has a command here that makes it."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, sdpipe

# a quote's first words -> the command that gives it (an error before anything starts)
COMMANDS = {
    "sdpipe: error: train.stepz:": lambda tmp: ["train", "train.stepz=5"],
    "train.batch_size:": lambda tmp: ["train", "train.batch_size=16", "pipeline.microbatches=3"],
    "run.dir:": lambda tmp: ["train", f"run.dir={tmp / 'full'}"],
    "cluster.host:": lambda tmp: ["train", "cluster.host=192.0.2.254"],
    "run.port:": None,  # needs a port held: the test holds one
    "cluster.device: is cuda": lambda tmp: ["train", "cluster.device=cuda"],
}


def quotes() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Troubleshooting", 1)[1].split("\n## ", 1)[0]
    return [" ".join(q.split()) for q in re.findall(r"\*\*`([^`]+)`\*\*", section)]


def matches(quote: str, line: str) -> bool:
    pattern = re.escape(quote).replace(r"\.\.\.", ".*").replace("PORT", r"\d+")
    return re.search(pattern, line) is not None


def test_every_quoted_error_has_a_command_here():
    quoted = [q for q in quotes() if ":" in q]  # error lines (KEY: reason), not fragments
    assert quoted and all(any(q.startswith(k) for k in COMMANDS) for q in quoted), quoted


@pytest.mark.parametrize("first", sorted(COMMANDS))
def test_the_readme_quotes_the_error_sdpipe_gives(first, tmp_path):
    if first == "cluster.device: is cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: cluster.device=cuda is no error here")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    [quote] = [q for q in quotes() if q.startswith(first)]
    held = None
    if first == "run.port:":
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen()
        args = ["train", f"run.port={held.getsockname()[1]}", f"run.dir={tmp_path / 'run'}"]
    else:
        args = COMMANDS[first](tmp_path)
    try:
        out = sdpipe(*args)
    finally:
        if held is not None:
            held.close()
    assert out.returncode == 2, out.stderr
    assert matches(quote, out.stderr.strip().splitlines()[-1]), (quote, out.stderr)
    assert not Path(tmp_path / "run").exists()
