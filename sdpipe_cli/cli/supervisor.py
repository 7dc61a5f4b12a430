"""Supervising a launch's children: the mechanism that carries out the supervision policy.

Supervision follows torchrun: every child is a process of its own with its own log file, pid
file and error file; the launcher polls them, and as soon as one exits non-zero (or is killed)
it stops the others (SIGTERM, a grace period, then SIGKILL) and reports the first failure in one
line: which worker (pipeline, stage, rank), how it ended, and the last lines of its error.

This module is the *mechanism*: it polls the children and the store into an observation, counts
interrupts (:class:`Phase`), sends signals, writes store keys and prints. The *decisions* (when
a run has finished or failed, which failure is the root cause, when a lost pipeline may be
dropped or restarted, what an interrupt means at this point, when another node's failure ends
this one) are the pure policy's, :class:`sdpipe_cli.core.supervision.Supervision`, to which
:class:`Supervisor` hands one observation per poll and whose action it carries out; the rules
are listed and unit-tested there (``tests/unit/test_supervision_policy.py``), the end-to-end
behaviour in ``tests/integration/test_supervision.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from sdpipe_cli.core import supervision
from sdpipe_cli.runtime import processes, protocol, store
from sdpipe_cli.runtime.errors import read_error

GRACE_S = 10.0  # SIGTERM -> SIGKILL
RUNNING = "running"  # the launch phase after start-up
POLL_S = 0.1

#: What :meth:`Supervisor.run` returns: the first failure's description (None: none), whether
#: interrupted, whether that failure was bad input a child found (a damaged checkpoint shard).
Outcome = tuple[str | None, bool, bool]


@dataclass
class Child:
    name: str  # "scheduler" or the worker's rank
    role: str  # human description, e.g. "worker rank 3 (pipeline 1, stage 1)"
    proc: processes.ChildProcess
    log_path: Path
    rank: int | None = None  # workers only
    pipeline: int | None = None  # workers only
    since: float = 0.0  # when it was started (time.time()): older error files are not its own
    incarnation: int = 0  # workers: restarts of its pipeline before it
    log_start: int = 0  # where its output begins in the log (a restarted worker appends)


class Interrupted(Exception):
    """Raised by the launcher itself, at a point it chose, to stop at once."""


class Phase:
    """Where a launch is (for the line an interrupt prints) and the interrupts that came.

    Ctrl-C and SIGTERM are only counted by the signal handler; the launcher acts on them at points
    it chooses. An exception raised from a handler lands anywhere, and one raised inside a fork
    handler (logging's, while a child is being spawned) is swallowed, which loses the interrupt.
    Start-up phases stop at the first interrupt; from :data:`RUNNING` (every worker started) the
    first asks for a graceful stop and the second stops at once (during supervision that decision
    is :class:`~sdpipe_cli.core.supervision.Supervision`'s, which also says when start-up is over).
    """

    def __init__(self, now: str, on_change: Callable[[str], None] = lambda _: None):
        self.now, self.signals, self.on_change = now, 0, on_change
        on_change(now)

    def __call__(self, signum, frame) -> None:
        self.signals += 1

    def install(self) -> dict:
        """Count SIGINT and SIGTERM (main thread only); returns the handlers to restore."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore(self, previous: dict) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def check(self) -> None:
        """During start-up: stop if an interrupt came."""
        if self.signals:
            raise Interrupted

    def advance(self, now: str) -> None:
        self.check()
        self.now = now
        self.on_change(now)


class Supervisor:
    """One launch's children, what was seen of them and the policy that decides; :meth:`run`
    waits for every child.

    A stop at once raises :class:`Interrupted` and the caller stops everything. The policy's
    view of start-up (all ``workers`` started) is copied to ``phase``, whose name the caller's
    message uses. ``restart(pipeline, announce)`` starts a lost pipeline's workers again
    (``restarts``: the budget, which the nodes' launchers share through the store's
    :data:`~sdpipe_cli.runtime.store.RESTARTS` count), ``restart_scheduler(n)`` the scheduler;
    ``pipelines``: how many the run has, on every node; ``stranded_s``: see
    :data:`~sdpipe_cli.core.supervision.STRANDED_S`.
    """

    def __init__(self, children: list[Child], run_dir: Path, events, on_progress,
                 since: float = 0.0, tolerate: bool = False, graceful: bool = True,
                 workers: int = 0, phase: Phase | None = None,
                 restarts: supervision.Restarts | None = None,
                 restart: Callable[[int, Callable[[int, int], None]], list[Child]] = lambda p, a: [],
                 pipelines: int = 0, stranded_s: float = supervision.STRANDED_S,
                 restart_scheduler: Callable[[int], Child] | None = None,
                 on_resplit: Callable[[dict[int, list[int]], dict[str, float]], None]
                 = lambda splits, slowed: None):
        self.children, self.run_dir, self.events = children, run_dir, events
        self.on_progress, self.since, self.tolerate = on_progress, since, tolerate
        self.phase = phase or Phase(RUNNING)
        self.restarts, self.restart, self.restart_scheduler = restarts, restart, restart_scheduler
        self.on_resplit = on_resplit
        self.policy = supervision.Supervision(
            workers=workers, tolerate=tolerate, graceful=graceful,
            started=self.phase.now == RUNNING, restarts=restarts, pipelines=pipelines,
            stranded_s=stranded_s)
        self.by_name = {c.name: c for c in children}
        self.error_times: dict[str, float | None] = {}
        self.scheduler_restarts = 0
        self.pauses = Pauses()
        self._act: dict[type, Callable[[Any, supervision.Observation], Outcome | None]] = {
            supervision.Wait: self._wait, supervision.RequestStop: self._request_stop,
            supervision.DropPipelines: self._drop, supervision.Respawn: self._respawn,
            supervision.Resplit: self._resplit,
            supervision.RespawnScheduler: self._respawn_scheduler, supervision.Kill: self._kill,
            supervision.StopNow: self._stop_now, supervision.Finished: self._finished,
            supervision.Failed: self._failed, supervision.Broken: self._broken,
            supervision.FailedElsewhere: self._failed_elsewhere}

    def run(self) -> Outcome:
        while True:
            self.pauses.tick()
            seen = _observe(self.children, self.run_dir, self.events, self.phase, self.since,
                            self.error_times, self.tolerate,
                            self.restarts.used if self.restarts else None)
            action = self.policy.decide(seen)
            if self.policy.started:
                self.phase.now = RUNNING
            outcome = self._act[type(action)](action, seen)
            if outcome is not None:
                return outcome

    # -- the actions ----------------------------------------------------------------------------
    def _wait(self, action: supervision.Wait, seen: supervision.Observation) -> None:
        if seen.progress:
            self.on_progress(seen.progress)
        time.sleep(POLL_S)

    def _request_stop(self, action: supervision.RequestStop, seen) -> None:
        self.events.set(store.STOP_REQUESTED, "1")

    def _drop(self, action: supervision.DropPipelines, seen) -> None:
        again = action.restart or (False,) * len(action.lost)
        for (pipeline, name), restart in zip(action.lost, again):
            _lose_pipeline(self.by_name[name], pipeline, self.children, self.run_dir,
                           self.events, self.since, restart)
            if restart:
                quietly(lambda: self.events.add(store.RESTARTS, 1))

    def _resplit(self, action: supervision.Resplit, seen) -> None:
        """Pipelines re-split in place: the config their new workers start from (the caller's
        ``on_resplit``), then each one's workers stopped and the scheduler told it is gone."""
        self.on_resplit({p: list(bounds) for p, bounds in action.splits}, dict(action.slowed))
        for p, bounds in action.splits:
            mates = [c for c in self.children if c.pipeline == p]  # workers: each has a rank
            if p not in action.stopping or not mates:  # lost meanwhile, or on another node
                continue
            stop_all(mates)
            store.push(self.events, store.EVENTS, protocol.Lost(
                min(cast(int, c.rank) for c in mates), p, f"re-split to {list(bounds)}", True,
                round(time.time() - self.since, 4)))
            print(f"sdpipe: re-planning pipeline {p} in place: its workers restart on the split "
                  f"{list(bounds)} and heal from the other pipelines, which go on",
                  file=sys.stderr, flush=True)

    def _respawn(self, action: supervision.Respawn, seen) -> None:
        limit = self.restarts.limit if self.restarts else 0
        fresh = self.restart(action.pipeline, lambda rank, incarnation: _announce_restart(
            action, rank, incarnation, self.events, self.since, limit))
        self.children[:] = [c for c in self.children if c.pipeline != action.pipeline] + fresh
        self.by_name.update((c.name, c) for c in fresh)
        for c in fresh:
            self.error_times.pop(c.name, None)  # a new process: its own error file, when it fails

    def _respawn_scheduler(self, action: supervision.RespawnScheduler, seen) -> None:
        assert self.restart_scheduler is not None, action
        dead = self.by_name["scheduler"]  # the policy saw it exit: its returncode is set
        print("sdpipe: warning: the scheduler "
              f"{supervision.ending(cast(int, dead.proc.returncode))}; "
              f"starting it again (restart {action.restart} of "
              f"{self.restarts.limit if self.restarts else 0}); it replays its journal",
              file=sys.stderr, flush=True)
        self.scheduler_restarts += 1
        fresh = self.restart_scheduler(self.scheduler_restarts)
        self.children[:] = [c if c is not dead else fresh for c in self.children]
        self.by_name["scheduler"] = fresh
        self.error_times.pop("scheduler", None)

    def _kill(self, action: supervision.Kill, seen) -> None:
        for name in action.names:
            print(f"sdpipe: warning: {self.by_name[name].role} is hung (silent past "
                  "run.heartbeat_timeout); killing it", file=sys.stderr, flush=True)
            _signal(self.by_name[name], signal.SIGKILL)

    def _stop_now(self, action: supervision.StopNow, seen) -> None:
        raise Interrupted

    def _finished(self, action: supervision.Finished, seen) -> Outcome:
        return None, action.interrupted, False

    def _failed(self, action: supervision.Failed, seen) -> Outcome:
        failed = self.by_name[action.child]
        reason = self.pauses.explain(describe_failure(failed, self.run_dir, self.since))
        err = _error_since(self.run_dir, action.child, max(self.since, failed.since))
        quietly(lambda: self.events.compare_set(store.FAILED, "", reason))  # tell other nodes
        return reason, action.interrupted, bool(err and err.get("bad_input"))

    def _broken(self, action: supervision.Broken, seen) -> Outcome:
        quietly(lambda: self.events.compare_set(store.FAILED, "", action.reason))
        return action.reason, action.interrupted, False

    def _failed_elsewhere(self, action: supervision.FailedElsewhere, seen) -> Outcome:
        return f"another node failed: {action.reason}", action.interrupted, False


class Pauses:
    """The launcher's own stops (Ctrl-Z, SIGSTOP, a suspended machine), seen as gaps between its
    polls. The store lives in the launcher: while it is stopped no rendezvous or collective is
    answered, the workers give up after ``run.timeout``, and the first failure then names a
    worker's gloo error. A failure after a long pause says that the pause came first."""

    LONG_S = 10.0  # a gap between polls this long is no slow poll
    last: float | None  # the clock at the last poll (None before the first)

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock, self.last, self.longest = clock, None, 0.0

    def tick(self) -> None:
        now = self.clock()
        if self.last is not None:
            self.longest = max(self.longest, now - self.last)
        self.last = now

    def explain(self, reason: str) -> str:
        if self.longest < self.LONG_S:
            return reason
        return (f"the launcher itself was stopped for {self.longest:.0f} s (Ctrl-Z, SIGSTOP, a "
                "suspended machine?), and with it the store every process waits on; then: " + reason)


def _observe(children: list[Child], run_dir: Path, events, phase: Phase, since: float,
             error_times: dict[str, float | None], tolerate: bool = False,
             restarted: int | None = None) -> supervision.Observation:
    """One poll. The interrupts are counted first, so that what is read after them is at least as
    recent (a Ctrl-C right after the last worker started finds it started); then the children,
    then the store. A failed child's error file is read once, when its exit is first seen: the
    child writes it before it exits. Hung workers are read only where a loss is tolerated
    (``tolerate``), the restart count only with a restart budget (``restarted``: the pipeline
    restarts this launcher made; the rest of the store's count are other nodes')."""
    signals = phase.signals
    states = []
    for c in children:
        rc = c.proc.poll()
        if rc not in (None, 0) and c.name not in error_times:
            err = _error_since(run_dir, c.name, max(since, c.since))
            error_times[c.name] = err["time"] if err else None
        states.append(supervision.ChildState(c.name, c.pipeline, rc, error_times.get(c.name)))
    elsewhere = quietly(lambda: events.check([store.FAILED]) and events.get(store.FAILED))
    malformed = None
    try:
        hung = set((quietly(lambda: store.read(events, store.HUNG, protocol.Hung))
                    or protocol.Hung([])).ranks if tolerate else [])
        progress = quietly(lambda: store.read_progress(events))
    except protocol.ProtocolError as err:
        malformed, hung, progress = str(err), set(), None
    elsewhere_restarts = 0
    if restarted is not None:
        elsewhere_restarts = max(0, (quietly(lambda: events.add(store.RESTARTS, 0)) or 0) - restarted)
    return supervision.Observation(
        now=time.monotonic(), children=tuple(states), signals=signals, progress=progress,
        elsewhere=elsewhere.decode(errors="replace") if elsewhere else None,
        hung=tuple(c.name for c in children if (c.rank, c.incarnation) in hung),
        restarts_elsewhere=elsewhere_restarts, malformed=malformed)


def quietly(read: Callable[[], Any]) -> Any:
    """A store access that may fail once the first node's launcher (the store) is gone. A value
    that is there but malformed is not such a failure: its
    :class:`~sdpipe_cli.runtime.protocol.ProtocolError` goes through."""
    try:
        return read()
    except protocol.ProtocolError:
        raise
    except Exception:  # noqa: BLE001 - c10d raises several types for a closed store
        return None


def _lose_pipeline(failed: Child, pipeline: int, children: list[Child], run_dir: Path, events,
                   since: float, restart: bool = False) -> None:
    """Stop every worker of ``pipeline``, which ``failed`` cost, and tell the scheduler to drop it
    (``restart``: until its new workers rejoin)."""
    mates = [c for c in children if c.pipeline == pipeline]  # workers, ``failed`` too: ranked
    stop_all(mates)
    reason = describe_failure(failed, run_dir, since)
    store.push(events, store.EVENTS, protocol.Lost(cast(int, failed.rank), pipeline, reason,
                                                   restart, round(time.time() - since, 4)))
    then = "it will be restarted" if restart else "the others go on"
    print(f"sdpipe: warning: pipeline {pipeline} lost, {then}: {reason}",
          file=sys.stderr, flush=True)


def _announce_restart(action: supervision.Respawn, rank: int, incarnation: int, events,
                      since: float, limit: int) -> None:
    """Tell the scheduler (and the user) that a lost pipeline's workers are started again."""
    store.push(events, store.EVENTS, protocol.Restart(
        rank, action.pipeline, incarnation, action.restart, action.backoff_s,
        round(time.time() - since, 4), action.resplit))
    how = ("on its new split" if action.resplit
           else f"(restart {action.restart} of {limit})")
    print(f"sdpipe: pipeline {action.pipeline} restarted {how}", file=sys.stderr, flush=True)


def _error_since(run_dir: Path, name: str, since: float) -> dict | None:
    """The child's error file, unless it is left over from an earlier leg of a resumed run."""
    err = read_error(run_dir, name)
    return err if err and err.get("time", 0) >= since else None


def describe_failure(child: Child, run_dir: Path, since: float = 0.0) -> str:
    """One line for the user: who (role), how it ended, its error message (else its log's last
    lines), and where its log is."""
    from sdpipe_cli.checkpoint.reading import go_on_from  # torch: loaded once a run has failed

    err = _error_since(run_dir, child.name, max(since, child.since))
    detail = err["message"] if err else _tail(child.log_path, 5, child.log_start)
    if err and err["message"].startswith(WRITES_FAILED):  # the checkpoint a failed write spared
        detail = f"{detail}; {go_on_from(run_dir)}"
    full = _disk_full(run_dir)
    if full and not err:  # it could write neither its error file nor its log: say why
        detail = f"{full} ({detail})"
    ended = supervision.ending(cast(int, child.proc.returncode))  # it failed: it has exited
    return f"{child.role} {ended}: {detail} (log: {child.log_path})"


WRITES_FAILED = ("WriteFailed:", "SaveFailed:")  # errors of a file the run could not write
FULL_BYTES = 1 << 20  # a disk with less free than this cannot take a log line or a metrics record


def _disk_full(run_dir: Path) -> str:
    """What to say when the run folder's file system is full ('' when it is not): a child that
    fails there usually fails writing, and can record nothing."""
    from sdpipe_cli.checkpoint.reading import go_on_from
    try:
        usage = shutil.disk_usage(run_dir)
    except OSError:
        return ""
    return (f"the disk holding {run_dir} is full ({usage.free:,} bytes free): free space; "
            f"{go_on_from(run_dir)}") if usage.free < FULL_BYTES else ""


def _tail(path: Path, lines: int, start: int = 0) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(text[-lines:]) if text else "no output"


def stop_all(children: list[Child], grace: float = GRACE_S) -> None:
    """SIGTERM every live child, wait up to ``grace`` seconds, then SIGKILL the rest."""
    live = [c for c in children if c.proc.poll() is None]
    for c in live:
        _signal(c, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in live:
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(c, signal.SIGKILL)
            c.proc.wait()


def _signal(child: Child, sig: int) -> None:
    try:
        os.killpg(child.proc.pid, sig)  # the child's whole session, helpers included
    except ProcessLookupError:
        try:  # a forked child a moment old may not have its own session yet
            os.kill(child.proc.pid, sig)
        except ProcessLookupError:
            pass
