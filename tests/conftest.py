"""Shared helpers: run the real CLI in a subprocess, read a run folder, find leftover processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from sdpipe_cli.runtime.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
RUN_TIMEOUT = 240  # seconds: any end-to-end run must finish well within this, or the test fails


def sdpipe(*args: str, timeout: float = RUN_TIMEOUT, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m sdpipe_cli ARGS`` as a user would run it; a hang fails the test."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "sdpipe_cli", *args], cwd=cwd or REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def sdpipe_popen(*args: str, cwd: Path | None = None) -> subprocess.Popen:
    """The CLI in its own session (so signals the test sends reach only it)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    return subprocess.Popen([sys.executable, "-m", "sdpipe_cli", *args], cwd=cwd or REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def run_processes(run_dir: Path) -> list[psutil.Process]:
    """Live scheduler/worker processes that belong to the run in ``run_dir``."""
    found = []
    target = str(Path(run_dir).resolve())
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if "sdpipe_cli." in cmd and proc.environ().get("SDPIPE_RUN_DIR") == target:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def metrics(run_dir: Path, kind: str | None = None) -> list[dict]:
    lines = read_metrics(Path(run_dir) / "metrics.jsonl")
    return [m for m in lines if kind is None or m["kind"] == kind]


@pytest.fixture
def run_dir(tmp_path: Path):
    """A fresh run folder path; after the test, no process of that run may be left alive."""
    path = tmp_path / "run"
    yield path
    leftovers = run_processes(path)
    for proc in leftovers:
        proc.kill()
    assert not leftovers, f"orphan processes left by the run: {[p.pid for p in leftovers]}"
