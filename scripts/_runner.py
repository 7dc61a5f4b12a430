"""Running ``sdpipe train`` from the benchmark scripts: one subprocess per run, stopped in order.

Shared by ``scripts/bench_*.py`` (a sibling module, not a package: each script puts this folder
on ``sys.path``). What a run's ``metrics.jsonl`` says is read and computed by
``sdpipe_cli.runtime.analysis``; the stamp of a result table is ``scripts/_report.py``'s.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import psutil
import yaml

CPU_SAMPLE_S = 0.5


def run_sdpipe(overrides: list[str], log_path: Path, timeout: float,
               cwd: Optional[Path] = None) -> tuple[Optional[int], float]:
    """Run ``sdpipe train`` (in ``cwd``: another checkout's), output to ``log_path``; (exit
    code, None on timeout; wall s)."""
    cmd = [sys.executable, "-m", "sdpipe_cli", "train", *overrides]
    started = time.monotonic()
    with Path(log_path).open("w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd)
        try:
            returncode: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
            stop(proc)
        except BaseException:  # Ctrl-C: let the launcher stop its workers first
            stop(proc)
            raise
    return returncode, time.monotonic() - started


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM makes the launcher stop its children in order (up to 10 s); then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def error_line(log_path: Path) -> str:
    """The launcher's one-line ``sdpipe: error: ...`` message, if it printed one."""
    lines = [ln.strip() for ln in Path(log_path).read_text(errors="replace").splitlines()]
    errors = [ln for ln in lines if ln.startswith("sdpipe: error:")]
    return errors[-1] if errors else (lines[-1] if lines else "")


def classify(returncode: Optional[int], log_path: Path, timeout: float) -> tuple[str, str]:
    """(status, error) of a run: ``ok``, ``timeout``, ``unavailable`` (the installed sdpipe does
    not know the sync mode: exit 2 with an error on ``sync``) or ``failed (CODE)``."""
    if returncode is None:
        return "timeout", f"no result within {timeout:g} s"
    if returncode == 0:
        return "ok", ""
    message = error_line(log_path)
    if returncode == 2 and message.startswith("sdpipe: error: sync"):
        return "unavailable", message
    return f"failed ({returncode})", message


def microbatches(run_dir: Path) -> Optional[int]:
    """m of a run, from the resolved ``config.yaml`` it wrote."""
    try:
        cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
        return int(cfg["pipeline"]["microbatches"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None


class CpuSampler:
    """System-wide CPU utilization, sampled in a thread while a run is going."""

    def __init__(self, interval: float = CPU_SAMPLE_S):
        self.interval, self.samples = interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        psutil.cpu_percent(interval=None)  # prime: the first call has no reference point
        while not self._stop.is_set():
            self.samples.append(psutil.cpu_percent(interval=self.interval))

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> Optional[float]:
        return sum(self.samples) / len(self.samples) if self.samples else None
