"""What the tests share that is not a fixture: run the CLI (in this process, or as its own), read
a run folder, find leftover processes, wait with a bound.

Every wait on another process here has a timeout, so a hang fails the test instead of blocking
the suite (pytest-timeout is not a dependency).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from sdpipe_cli.analysis import CHOICES, SCHEMA, conforms
from sdpipe_cli.config import measurements
from sdpipe_cli.runtime.metrics import read_metrics
from sdpipe_cli.runtime.processes import read_pid

REPO = Path(__file__).resolve().parent.parent
RUN_TIMEOUT = 240  # seconds: any end-to-end run must finish well within this, or the test fails


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}


def sdpipe_process(*args: str, timeout: float = RUN_TIMEOUT, cwd: Path | None = None,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m sdpipe_cli ARGS`` in a process of its own, as a user would run it (``env`` adds
    to the environment); a hang fails the test. For what only a process shows: exit codes from
    ``__main__``, signals, imports, the environment."""
    return subprocess.run([sys.executable, "-m", "sdpipe_cli", *args], cwd=cwd or REPO,
                          env={**_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


class _Overdue(Exception):
    pass


def _overdue(signum, frame):
    raise _Overdue


def sdpipe(*args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    """``sdpipe ARGS`` run by its ``main()`` in this process, stdout and stderr captured.

    The command is the same code as in its own process, and its children are real processes;
    they are forked from this session's fork server, which imported torch once, so a run costs
    its training rather than two interpreters' imports. A run past ``timeout`` seconds is
    interrupted (the launcher then stops its children) and fails the test.
    """
    from sdpipe_cli.cli.parsing import main

    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _overdue)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    saved_columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "200"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(args))
            except SystemExit as exit_:  # argparse's usage errors
                rc = exit_.code if isinstance(exit_.code, int) else 2
    except _Overdue:
        raise AssertionError(f"sdpipe {' '.join(args)} took more than {timeout} s: "
                             f"{err.getvalue()[-2000:]}") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if saved_columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved_columns
    return subprocess.CompletedProcess(["sdpipe", *args], rc, out.getvalue(), err.getvalue())


class Beside:
    """What a thread acting beside an in-process command (:func:`sdpipe_beside`) sees of it:
    ``poll()`` as a Popen's, None until the command has returned, then its exit code."""

    def __init__(self) -> None:
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait_for(self, condition, timeout: float = 120, what: str = "condition") -> None:
        """Poll ``condition()`` until it holds; fail if the command ends first or ``timeout``
        passes (the caller's :func:`sdpipe_beside` then stops the run)."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.poll() is not None:
                raise AssertionError(f"the command ended ({self.poll()}) before {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} did not happen within {timeout} s")
            time.sleep(0.1)


def sdpipe_beside(act, run_dir: Path, *args: str, timeout: float = RUN_TIMEOUT):
    """``sdpipe ARGS`` run by :func:`sdpipe` in this process while ``act(command)`` runs in a
    thread beside it: for a test that acts on a run's children or files (kills a worker, fills
    its disk) but not on the launcher, which then costs no interpreter and fork server of its own.
    ``command`` is a :class:`Beside`. Returns (the command's CompletedProcess, what ``act``
    returned). If ``act`` fails, the run's processes (of ``run_dir``) are killed until the command
    ends, which it then does at once, and ``act``'s exception is raised."""
    import threading

    command, outcome = Beside(), {}

    def acting() -> None:
        try:
            outcome["value"] = act(command)
        except BaseException as error:  # raised in the test's thread below
            outcome["error"] = error
            while command.poll() is None:  # children started later and restarted ones too
                kill_leftovers(run_dir)
                time.sleep(0.5)

    thread = threading.Thread(target=acting, daemon=True)
    thread.start()
    try:
        out = sdpipe(*args, timeout=timeout)
        command.returncode = out.returncode
    finally:
        if command.returncode is None:
            command.returncode = -1
        thread.join(60)
    assert not thread.is_alive(), "the action beside the command did not end with it"
    if "error" in outcome:
        raise outcome["error"]
    return out, outcome.get("value")


def interrupt_command(sig: int = signal.SIGINT) -> float:
    """Send ``sig`` to this process, where :func:`sdpipe_beside` runs the command: what a Ctrl-C
    (or a ``kill``) does to a launcher of its own, to a launcher in this process. Call it once the
    run trains (the launcher's own handlers are in place); returns when it was sent."""
    os.kill(os.getpid(), sig)
    return time.monotonic()


def sdpipe_popen(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """The CLI in its own session (so signals the test sends reach only it); ``env`` adds to
    this process's environment."""
    return subprocess.Popen([sys.executable, "-m", "sdpipe_cli", *args], cwd=cwd or REPO,
                            env={**_env(), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT) -> tuple[int, str, float]:
    """Wait for a CLI started by :func:`sdpipe_popen`: (exit code, stderr, seconds waited). On a
    timeout its whole session is killed, so nothing outlives the test."""
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=timeout)
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise
    return proc.returncode, err, time.monotonic() - start


def run_processes(run_dir: Path) -> list[psutil.Process]:
    """Live scheduler/worker processes that belong to the run in ``run_dir``: the launcher records
    each child's pid in ``logs/<name>.pid`` (a forked child's command line and environment are
    its fork server's, so they cannot tell). A pid reused by a later process does not count."""
    found = []
    for pid_file in sorted((Path(run_dir) / "logs").glob("*.pid")):
        try:
            proc = psutil.Process(int(pid_file.read_text().split()[0]))
            if (proc.create_time() <= pid_file.stat().st_mtime + 1
                    and proc.status() != psutil.STATUS_ZOMBIE):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, OSError, ValueError, IndexError):
            continue
    return found


def worker_process(run_dir: Path, rank: int) -> psutil.Process | None:
    """Worker ``rank`` of the run in ``run_dir``, if it is alive."""
    return next((p for p in run_processes(run_dir)
                 if p.pid == read_pid(Path(run_dir) / "logs" / f"{rank}.log")), None)


def worker_processes(run_dir: Path) -> list[psutil.Process]:
    """The run's live workers (not the scheduler or parameter servers)."""
    logs = Path(run_dir) / "logs"
    pids = {read_pid(f.with_suffix(".log")) for f in logs.glob("*.pid") if f.stem.isdigit()}
    return [p for p in run_processes(run_dir) if p.pid in pids]


def kill_leftovers(run_dir: Path) -> list[int]:
    """Kill what is left of the run in ``run_dir``; the pids, for the caller to fail on."""
    leftovers = run_processes(run_dir)
    for proc in leftovers:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in leftovers]


_CHECKED: dict[Path, int] = {}  # metrics.jsonl -> how many of its lines were checked


def metrics(run_dir: Path, kind: str | None = None) -> list[dict]:
    """The run's metrics lines (of ``kind``), each checked against its record
    (:mod:`sdpipe_cli.analysis.records`): every test that reads a run's lines fails on a kind or a
    field the schema does not declare, a value of another type, or a word its type does not name
    (a ``group`` line's ``reason``)."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = read_metrics(path)
    # the file only grows: a test polling it checks each line once
    seen = _CHECKED.get(path, 0) if len(lines) >= _CHECKED.get(path, 0) else 0
    for number, line in enumerate(lines[seen:], seen + 1):
        declared = SCHEMA.get(line["kind"])
        assert declared is not None, f"{path}: line {number}: kind {line['kind']!r} has no record"
        for name, value in line.items():
            assert name == "kind" or name in declared, (
                f"{path}: line {number}: a {line['kind']!r} line's {name!r} is not in its record")
            assert name == "kind" or conforms(line["kind"], name, value), (
                f"{path}: line {number}: {name!r} = {value!r} is not a {declared[name]}")
            words = CHOICES.get(line["kind"], {}).get(name)
            if words is not None and value is not None:
                said = value.values() if isinstance(value, dict) else [value]
                assert set(said) <= words, (
                    f"{path}: line {number}: {name!r} = {value!r} is not one of {sorted(words)}")
    _CHECKED[path] = len(lines)
    return [m for m in lines if kind is None or m["kind"] == kind]


def digests(run_dir: Path) -> dict[tuple[int, int], str]:
    """Each worker's final parameter digest, by (pipeline, stage)."""
    return {(d["pipeline"], d["stage"]): d["param_digest"] for d in metrics(run_dir, "done")}


def losses(lines: list[dict]) -> dict[tuple[int, int], float]:
    """The training loss of each (pipeline, step) among metrics lines."""
    return {(m["pipeline"], m["step"]): m["loss"] for m in lines if m["kind"] == "train"}


def wait_for(condition, proc: subprocess.Popen, timeout: float = 120, what: str = "condition") -> None:
    """Poll ``condition()`` until it holds; fail (killing ``proc``'s session) if ``proc`` ends
    first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the command ended before {what}: {proc.communicate()}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.2)


def training_lines(run_dir: Path, at_least: int = 1):
    """A condition for :func:`wait_for`: ``run_dir`` has that many train lines."""
    return lambda: (Path(run_dir) / "metrics.jsonl").exists() and len(metrics(run_dir, "train")) >= at_least


def free_port(within: range | None = None) -> int:
    """A port nothing listens on now, ``within`` a range or else below the kernel's ephemeral
    ports: a client that dials a free ephemeral port before its server binds it can be given that
    very port as its own and connect to itself, and the server then fails with EADDRINUSE."""
    within = within or range(20000, max(_ephemeral_low(), 30000))
    for port in random.sample(within, min(len(within), 500)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {within}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def make_doc(devices: dict[str, tuple[float, list[float]]], model: str = "gpt_tiny",
             microbatch: int = 4) -> dict:
    """A profile whose device ``name`` ran at ``speed`` with forward times ``fwd`` (backward 2x)."""
    blocks = len(next(iter(devices.values()))[1])
    return {
        "format": measurements.FORMAT, "created": "2026-11-29T00:00:00", "torch": "2.13.0",
        "model": {"name": model, "blocks": blocks, "microbatch_size": microbatch},
        "cluster": {"name": "test"}, "p2p": [], "allreduce": [],
        "devices": [{"name": name, "node": name.split(":")[0], "speed": speed, "rank": r,
                     "pipeline": 0, "stage": 0, "forward_ms": fwd,
                     "backward_ms": [2 * x for x in fwd], "peak_memory_mb": 100.0,
                     "memory_source": "rss"}
                    for r, (name, (speed, fwd)) in enumerate(devices.items())],
    }


def write_profile(folder: Path, doc: dict) -> str:
    path = Path(folder) / "profile.json"
    path.write_text(json.dumps(doc))
    return str(path)


def one_error_line(err: str, key: str) -> str:
    """The CLI's whole report of bad input: one ``sdpipe: error: KEY: ...`` line, no traceback."""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert err.endswith("\n")
    line = lines[0]
    assert line.startswith("sdpipe: error: "), line
    assert line.startswith(f"sdpipe: error: {key}: "), line
    assert "Traceback" not in err
    return line


def listening_only_on_loopback(proc, run_dir: Path) -> list[int]:
    """Assert that a running launcher (``proc``, which hosts the store) and its run's children
    listen on 127.0.0.1 only; returns the children's pids."""
    children = [p.pid for p in run_processes(run_dir)]
    listening = {pid: [c.laddr.ip for c in psutil.Process(pid).net_connections("inet")
                       if c.status == psutil.CONN_LISTEN] for pid in [proc.pid, *children]}
    assert listening[proc.pid], "the launcher hosts the store"
    assert all(ip == "127.0.0.1" for ips in listening.values() for ip in ips), listening
    return children


def spawn_and_join(fn, args: tuple, nprocs: int, timeout: float, what: str) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes (torch.multiprocessing) and wait
    for all of them; a child's exception fails the test with its traceback, and a hang past
    ``timeout`` fails it too, with every child killed."""
    import torch.multiprocessing as mp

    # Forked from the session's fork server, which has imported torch (tests/conftest.py).
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):  # raises ProcessRaisedException with the child's traceback
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} hung for {timeout}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def user_module(tmp_path: Path, monkeypatch, name: str, source: str) -> None:
    """A user's module ``name`` (``source``, dedented) in a folder on PYTHONPATH, as a user
    would keep their model or dataset beside the run."""
    import textwrap

    (tmp_path / "lib").mkdir(exist_ok=True)
    (tmp_path / "lib" / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "lib"))


def resumed_losses(run: Path, copy: Path, drop: str) -> dict[tuple[int, int], float]:
    """``run`` copied to ``copy`` as if it had been killed before checkpoint ``drop`` (removed),
    resumed with ``sdpipe resume``: the losses of the iterations it did again."""
    import shutil

    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / drop)
    before = len(metrics(copy))
    again = sdpipe("resume", str(copy))
    assert again.returncode == 0, again.stderr[-3000:]
    return losses(metrics(copy)[before:])


def event(**record: Any):
    """The typed event a process would send as ``record``, through the protocol's own decoding
    (so a test's event is exactly what the scheduler would read from the store)."""
    from sdpipe_cli.runtime import protocol

    return protocol.decode_event(json.dumps(record))
