"""Running ``sdpipe`` from the scripts: one subprocess per command, logged, bounded, stopped in order.

Every script under ``scripts/`` that starts sdpipe does it here (a sibling module, not a package:
each script puts this folder on ``sys.path``), whatever the command: ``train``, ``resume``,
``profile``, ``prepare``, ``export``, ``eval``, ``simulate``, ``report`` ... :

* :func:`run_command` runs ``python -m sdpipe_cli COMMAND ARGS...`` to its end: with a log path,
  its output goes there, headed by the command line (``$ python -m sdpipe_cli train ...``); without
  one, its stdout and stderr are captured apart (:class:`Run`'s ``stdout`` and ``stderr``). Past
  ``timeout`` seconds, or on Ctrl-C, it is stopped in order (:func:`stop`: SIGTERM, which makes the
  launcher stop its workers, then SIGKILL) and its exit code is None;
* :func:`start_command` starts one and returns it, for a script that acts on the run while it goes
  (``chaos.py``, ``chaos_launcher.py``);
* :func:`run_sdpipe` is ``sdpipe train`` through :func:`run_command`, as the benchmarks call it.

What a run's ``metrics.jsonl`` says is read and computed by ``sdpipe_cli.analysis``; the
stamp of a result table and the format of its figures are ``scripts/_report.py``'s.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil
import yaml

CPU_SAMPLE_S = 0.5
SDPIPE = (sys.executable, "-m", "sdpipe_cli")  # how a command is started, unless told otherwise
STOP_GRACE_S = 30.0  # after SIGTERM, before SIGKILL (the launcher takes up to 10 s to stop)


@dataclass
class Run:
    """One finished (or stopped) sdpipe command."""

    command: list[str]  # the whole command line
    args: list[str]  # what followed the entry point: the sdpipe command and its arguments
    returncode: int | None  # None: stopped at its timeout
    wall_s: float
    timeout: float
    log: Path | None = None  # where its output went, if to a file
    stdout: str = ""  # its captured output, without a log
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    @property
    def status(self) -> str:
        """``exit N`` or ``timed out after T s``."""
        return (f"timed out after {self.timeout:g} s" if self.timed_out
                else f"exit {self.returncode}")

    def check(self, what: str | None = None, chars: int = 3000) -> Run:
        """This run if it exited 0; otherwise SystemExit: ``WHAT failed (STATUS):`` and the end of
        its error output, or where its log is. ``what``: ``sdpipe ARGS`` unless given."""
        if self.ok:
            return self
        what = what or "sdpipe " + shlex.join(self.args)
        detail = f"see {self.log}" if self.log is not None else self.stderr[-chars:]
        raise SystemExit(f"{what} failed ({self.status}):\n{detail}")


def start_command(command: str, args: Sequence[str], log: IO | None = None, *,
                  cwd: Path | None = None, env: Mapping[str, str] | None = None,
                  entry: Sequence[str] = SDPIPE, new_session: bool = False) -> subprocess.Popen:
    """Start ``sdpipe COMMAND ARGS`` (``entry``: how, ``python -m sdpipe_cli`` by default) in
    ``cwd`` (another checkout's sdpipe, say), with ``env`` added to this process's environment.
    With ``log`` (an open text file) its stdout and stderr go there, after a line with the
    command; without, both are pipes (text). ``new_session``: its own session (a process group
    that a signal to this one's does not reach)."""
    cmd = [*entry, command, *args]
    if log is not None:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        output: dict = {"stdout": log, "stderr": subprocess.STDOUT}
    else:
        output = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, cwd=cwd,
                            env=None if env is None else {**os.environ, **env},
                            start_new_session=new_session, **output)


def run_command(command: str, args: Sequence[str], log_path: Path | None, timeout: float, *,
                cwd: Path | None = None, env: Mapping[str, str] | None = None,
                entry: Sequence[str] = SDPIPE) -> Run:
    """Run ``sdpipe COMMAND ARGS`` to its end (see :func:`start_command`): output to ``log_path``
    (headed by the command line), or captured without one; past ``timeout`` seconds, or on an
    exception here (Ctrl-C), stopped in order (:func:`stop`). Never raises for the command's own
    failure: see :attr:`Run.returncode` and :meth:`Run.check`."""
    started = time.monotonic()
    opened = Path(log_path).open("w") if log_path is not None else contextlib.nullcontext()
    with opened as log:
        proc = start_command(command, args, log, cwd=cwd, env=env, entry=entry)
        try:
            out, err = proc.communicate(timeout=timeout)
            returncode: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            out, err = stop(proc)
            returncode = None
        except BaseException:  # Ctrl-C: let the launcher stop its workers first
            stop(proc)
            raise
    return Run(command=list(proc.args), args=[command, *args], returncode=returncode,
               wall_s=time.monotonic() - started, timeout=timeout,
               log=None if log_path is None else Path(log_path), stdout=out or "", stderr=err or "")


def run_sdpipe(overrides: list[str], log_path: Path, timeout: float,
               cwd: Path | None = None) -> tuple[int | None, float]:
    """``sdpipe train OVERRIDES`` through :func:`run_command` (in ``cwd``: another checkout's),
    output to ``log_path``; (exit code, None on timeout; wall s)."""
    run = run_command("train", overrides, log_path, timeout, cwd=cwd)
    return run.returncode, run.wall_s


def stop(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> tuple[str | None, str | None]:
    """SIGTERM makes the launcher stop its children in order (up to 10 s); SIGKILL if it is still
    there ``grace`` s later. Returns the rest of its captured (stdout, stderr), if captured (not
    if a process it left behind still holds its pipes ``grace`` s after the SIGKILL)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
    try:
        return proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.wait()
        return None, None


def free_port() -> int:
    """A TCP port free on this machine now, for a script's own process group (the kernel's pick:
    a port drawn from the clock collided with another run's on a busy machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def error_line(log_path: Path) -> str:
    """The launcher's one-line ``sdpipe: error: ...`` message, if it printed one."""
    lines = [ln.strip() for ln in Path(log_path).read_text(errors="replace").splitlines()]
    errors = [ln for ln in lines if ln.startswith("sdpipe: error:")]
    return errors[-1] if errors else (lines[-1] if lines else "")


def classify(returncode: int | None, log_path: Path, timeout: float) -> tuple[str, str]:
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


def microbatches(run_dir: Path) -> int | None:
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

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None
