"""Supervision policy: what the launcher does about its children. Pure: observations in, actions out.

The launcher (``cli.launcher``) is the mechanism: it polls its children and the store, hands
this module an :class:`Observation` and carries out the :class:`Action` that comes back (a signal,
a store key, a message). Everything that is a *decision* lives here, so that each rule can be
tested without a process, a store or a clock (torchelastic's agent is split the same way:
``_monitor_workers`` observes, the agent's loop decides). The rules:

* **Success.** The run is finished when every child has exited with 0; a worker of a dropped
  pipeline counts as done however it ended. Helpers (the scheduler, parameter servers) exiting 0
  early are no event: the run goes on until everyone has exited.
* **Failure.** A child exiting non-zero or killed by a signal fails the run (lock-step sync has no
  way around a missing replica). The launcher waits :data:`SETTLE_S` before naming the culprit,
  because one crash makes its peers fail a moment later (a broken gloo connection) and the first
  cause, not the loudest echo, is what the user needs: a child killed by a signal (nobody else
  kills our children), else the earliest error file, else the first one in launch order.
* **Pipeline loss** (``fault.on_pipeline_loss=continue``, sdpipe sync only). A failed *worker* costs
  only its pipeline: its other workers are stopped and the scheduler drops it, while the rest go
  on. Not when it would leave no pipeline, and never for a helper: without the scheduler or a
  parameter server nobody can go on.
* **Restart** (``fault.on_pipeline_loss=restart``). As pipeline loss, and the lost pipeline's
  workers are started again after a back-off, while the run's :class:`Restarts` budget lasts;
  past it, the pipeline is dropped as with ``continue``. The new workers rejoin and heal from live
  replicas (the scheduler's part).
* **Scheduler restart** (``restart``). A scheduler killed by a signal (SIGKILL, the OOM killer) is
  started again at once, drawing on the same budget; it rebuilds its state from its journal while
  the workers wait. One that exits non-zero by its own verdict (a hung run, a malformed message)
  fails the run: started again, it would reach the same verdict.
* **Re-split in place** (``fault.replan_in_place``). When the scheduler's snapshot asks for a
  re-split it has not asked for before (``resplit``, a new version), those pipelines' workers are
  stopped and started again at once, on their new splits, whatever ``fault.on_pipeline_loss``
  says and without drawing on the restart budget; the others go on.
* **Hung workers** (``continue`` and ``restart``). A worker the scheduler names hung (silent past
  ``run.heartbeat_timeout``, e.g. stopped by SIGSTOP) is killed; its exit then counts as a loss.
* **Malformed coordination.** A value in the store that no process of the run could have written
  (the scheduler's list of hung workers or its progress snapshot, malformed) fails the run with the
  reader's message naming the key: acting on it could kill the wrong process or show wrong figures.
* **Stranded workers.** The scheduler exits 0 once every worker reported done, and each worker's
  report is its last act; workers still running :data:`STRANDED_S` later wait for a scheduler that
  is gone (a forged report ended it early), so the run fails then instead of at their timeout.
* **Another node.** A failure published in the store by another node's launcher ends this one
  too; our own children's state is looked at first, because a failure here is closer to the cause.
* **Interrupts** (Ctrl-C, SIGTERM). The first one after every worker has started asks the workers
  to stop at their next consistent point (they may checkpoint and end normally); a second one
  stops everything at once, and so does the first one during start-up (no consistent point yet,
  nothing to lose) or in a job with no consistent point (``graceful=False``: profiling). Two that
  were counted between polls count as two: the user pressed twice. (Two sent at the same instant
  may reach the handler as one: the kernel and Python both merge a pending signal.) A failure
  already seen wins over an interrupt that comes while the launcher settles on its culprit.

Every action that ends supervision (:class:`StopNow`, :class:`Finished`, :class:`Failed`,
:class:`FailedElsewhere`) is final: :meth:`Supervision.decide` returns it again for any later
observation, so a mechanism that polls once more cannot undo a decision.

Out of scope here, because other processes own them: noticing hung workers (the scheduler's
heartbeat check; without a tolerated loss it fails the scheduler, which this policy sees as a
helper failure) and time limits (the scheduler ends the run with a global sync; the workers then
exit 0).
"""

from __future__ import annotations

import math
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SETTLE_S = 0.5  # seconds between seeing a failure and naming its root cause
STRANDED_S = 30.0  # seconds workers may still run after the scheduler ended, before the run fails
RESET_S = 60.0  # a restarted pipeline (or run) that ran this long backs off from the start again


@dataclass(frozen=True)
class ChildState:
    """One child process as the launcher last saw it."""

    name: str  # "scheduler", "ps<stage>", or the worker's rank; unique within a launch
    pipeline: int | None = None  # workers only; helpers (scheduler, parameter servers) have none
    returncode: int | None = None  # None while it runs; negative: killed by that signal
    error_time: float | None = None  # when it wrote its error file (this leg of the run), if it did

    @property
    def failed(self) -> bool:
        return self.returncode not in (None, 0)


@dataclass(frozen=True)
class Observation:
    """What the launcher saw in one poll."""

    now: float  # seconds on any monotonic clock; only differences matter
    children: tuple[ChildState, ...]
    signals: int = 0  # interrupts (Ctrl-C, SIGTERM) counted since supervision began, in total
    progress: Mapping[str, Any] | None = None  # the latest snapshot in the store, if any
    elsewhere: str | None = None  # a failure another node's launcher published, if any
    hung: tuple[str, ...] = ()  # children the scheduler named hung
    restarts_elsewhere: int = 0  # pipeline restarts other nodes' launchers made
    malformed: str | None = None  # a store value no process of the run wrote: what was wrong


# -- actions -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Wait:
    """Nothing to do: show the progress and poll again after a short sleep."""


@dataclass(frozen=True)
class RequestStop:
    """The first interrupt of a running job: ask the workers to stop at a consistent point, then
    observe again at once."""


@dataclass(frozen=True)
class DropPipelines:
    """Stop the other workers of each pipeline in ``lost`` and tell the scheduler to drop it, then
    observe again at once; the rest of the run goes on."""

    lost: tuple[tuple[int, str], ...]  # (pipeline, name of the child whose failure cost it), by pipeline
    restart: tuple[bool, ...] = ()  # per pipeline in ``lost``: whether it will be started again


@dataclass(frozen=True)
class Respawn:
    """Start the workers of ``pipeline`` again (its back-off has passed), then observe again."""

    pipeline: int
    restart: int  # restarts in the run so far, this one included
    backoff_s: float
    resplit: bool = False  # on a new split (re-split in place), not after a failure


@dataclass(frozen=True)
class Resplit:
    """Stop the workers of each pipeline in ``splits`` and tell the scheduler it is gone, to be
    started again on its new split (the next observation's :class:`Respawn`); the config they
    start from is written first. ``version``: the scheduler's count of such requests."""

    version: int
    splits: tuple[tuple[int, tuple[int, ...]], ...]  # (pipeline, its new split), by pipeline
    slowed: tuple[tuple[str, float], ...] = ()  # fault.slowed as of the re-plan
    # the pipelines of ``splits`` to stop now: not those lost meanwhile, which start on their
    # new splits whenever they are started again
    stopping: tuple[int, ...] = ()


@dataclass(frozen=True)
class RespawnScheduler:
    """Start the scheduler again (it died by a signal), then observe again; it rebuilds its
    state from its journal."""

    restart: int  # restarts in the run so far, this one included


@dataclass(frozen=True)
class Kill:
    """SIGKILL these children (named hung), then observe again; their exits are then losses."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class StopNow:
    """Stop every child at once (final): an interrupt that leaves no graceful way out."""


@dataclass(frozen=True)
class Finished:
    """Every child is done (final); ``interrupted``: because a graceful stop was asked for."""

    interrupted: bool = False


@dataclass(frozen=True)
class Failed:
    """The run failed (final); ``child`` names the root cause, to be reported and published."""

    child: str
    interrupted: bool = False


@dataclass(frozen=True)
class FailedElsewhere:
    """Another node failed (final); ``reason`` is what it published."""

    reason: str
    interrupted: bool = False


@dataclass(frozen=True)
class Broken:
    """The run's coordination broke (final): ``reason`` says how (a malformed store value,
    workers stranded by a scheduler that ended)."""

    reason: str
    interrupted: bool = False


Action = (Wait | RequestStop | DropPipelines | Respawn | Resplit | RespawnScheduler | Kill
          | StopNow | Finished | Failed | FailedElsewhere | Broken)
FINAL = (StopNow, Finished, Failed, FailedElsewhere, Broken)
WAIT = Wait()


def first_failure(failed: Sequence[ChildState]) -> ChildState:
    """The root cause among ``failed`` (not empty): a child killed by a signal, else the one with
    the earliest error file, else the first in launch order.

    A signal comes from outside (the OOM killer, a user, a node going down), while an error file
    may be an echo of another process's death (a broken connection), so a signal wins.
    """
    killed = [c for c in failed if c.returncode is not None and c.returncode < 0]
    if killed:
        return killed[0]
    return min(failed, key=lambda c: math.inf if c.error_time is None else c.error_time)


def ending(returncode: int) -> str:
    """How a child ended, in words: ``was killed by SIGKILL`` or ``exited with code 1``."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


class Restarts:
    """How many restarts are left, and how long to back off before each (``fault.max_restarts``,
    ``fault.restart_backoff``). One budget for the run: restarts of lost pipelines and restarts of
    the whole run from a checkpoint both draw on it.

    The back-off doubles for each restart of the same thing (a pipeline, or the run) that failed
    again within :data:`RESET_S` of its last restart (torchelastic and Kubernetes back off the same
    way), and is back to ``backoff_s`` once it ran longer: a fault that comes back at once, such
    as a device that keeps failing, costs little time before the budget runs out, while
    unrelated faults hours apart are each retried soon. A caller that knows the failed attempt
    made progress since its restart (the run got further than the failure before it) says so,
    and the back-off starts over too: a crash loop fails where it failed before, while unrelated faults
    that come often (a worker lost every 20 s on a large cluster) would otherwise double the wait
    at each one, to minutes, for a run that trains well between them.
    """

    def __init__(self, limit: int, backoff_s: float, reset_s: float | None = None):
        if limit < 0 or backoff_s < 0:
            raise ValueError("limit and backoff_s must be >= 0")
        self.limit, self.backoff_s, self.used = limit, backoff_s, 0
        self.reset_s = RESET_S if reset_s is None else reset_s
        self._last: dict[Any, tuple[float, int]] = {}  # what -> (restarted at, doublings)

    @property
    def left(self) -> int:
        return self.limit - self.used

    def take(self, what: Any = "run", now: float = 0.0, elsewhere: int = 0,
             progressed: bool = False) -> float | None:
        """Use one restart of ``what`` failing at ``now`` (seconds, any monotonic clock): the
        seconds to wait before it, or None when none is left (``elsewhere``: restarts other nodes'
        launchers made, which the budget also counts; ``progressed``: the failed attempt made
        progress since its last restart, so this is no crash loop)."""
        if self.used + elsewhere >= self.limit:
            return None
        self.used += 1
        last, doublings = self._last.get(what, (None, -1))
        again = last is not None and now - last < self.reset_s and not progressed
        doublings = doublings + 1 if again else 0
        wait = self.backoff_s * 2 ** doublings
        self._last[what] = (now + wait, doublings)
        return wait


class Supervision:
    """The launcher's decisions over a sequence of observations (see the module docstring).

    ``workers``: how many workers the whole run has, to tell from the scheduler's progress
    snapshot (``started``) when start-up is over; a snapshot without that count (a profiling job's)
    means it is. ``tolerate``: ``fault.on_pipeline_loss=continue``. ``graceful``: the job has a
    consistent point to stop at when asked. ``started``: start-up is already over (a caller that
    supervises children it knows to be running). ``settle_s``: see :data:`SETTLE_S`.
    ``restarts``: with ``tolerate``, lost pipelines are started again while it lasts.
    ``pipelines``: how many the whole run has (a node's launcher sees only its own children).

    The clock is the observations' ``now``; nothing here sleeps or reads anything.
    """

    def __init__(self, *, workers: int = 0, tolerate: bool = False, graceful: bool = True,
                 started: bool = False, settle_s: float = SETTLE_S,
                 restarts: Restarts | None = None, pipelines: int = 0,
                 stranded_s: float = STRANDED_S):
        self.workers, self.tolerate, self.graceful, self.settle_s = workers, tolerate, graceful, settle_s
        self.stranded_s = stranded_s
        self._scheduler_gone: float | None = None  # when the scheduler was first seen exited 0
        self.restarts, self.pipelines = restarts, pipelines
        self._elsewhere = 0  # restarts made by other nodes' launchers, as last observed
        self._respawn: dict[int, tuple[float, int, float]] = {}  # p -> (when, restart, back-off)
        self._killed: set[str] = set()
        self._started, self._interrupted = started, False
        self._handled = 0  # interrupts already acted on
        self._lost: set[int] = set()
        self._resplit_seen = 0  # the last re-split request acted on
        self._resplitting: set[int] = set()  # pipelines to start again on a new split
        self._failing_since: float | None = None
        self._final: Action | None = None

    @property
    def started(self) -> bool:
        """Whether every worker has started (interrupts are graceful from here on)."""
        return self._started

    @property
    def interrupted(self) -> bool:
        """Whether a graceful stop has been asked for."""
        return self._interrupted

    @property
    def lost(self) -> frozenset[int]:
        """The pipelines dropped so far."""
        return frozenset(self._lost)

    def decide(self, obs: Observation) -> Action:
        """The action for ``obs``; the order of the checks is the order of precedence."""
        if self._final is not None:
            return self._final
        self._note_start(obs.progress)
        if self._failing_since is not None:  # settling on the culprit; nothing else counts now
            if obs.now - self._failing_since < self.settle_s:
                return WAIT
            return self._end(Failed(first_failure(self._failures(obs)).name, self._interrupted))
        if obs.signals > self._handled:
            fresh, self._handled = obs.signals - self._handled, obs.signals
            if self._interrupted or fresh > 1 or not self.graceful or not self._started:
                return self._end(StopNow())
            self._interrupted = True
            return RequestStop()
        self._elsewhere = obs.restarts_elsewhere
        hung = tuple(n for n in obs.hung if n not in self._killed and self._running(obs, n))
        if hung and self.tolerate:
            self._killed.update(hung)
            return Kill(hung)
        failed = self._failures(obs)
        dead = next((c for c in failed if c.name == "scheduler" and (c.returncode or 0) < 0), None)
        if dead is not None and self.restarts is not None and not self._interrupted \
                and self.restarts.take("scheduler", obs.now, self._elsewhere) is not None:
            return RespawnScheduler(self.restarts.used)
        if failed:
            drop = self._droppable(obs, failed)
            if drop:
                self._lost.update(p for p, _ in drop)
                again = (tuple(self._plan_restart(p, obs.now) for p, _ in drop)
                         if self.restarts is not None else ())
                return DropPipelines(drop, again)
            self._failing_since = obs.now
            if self.settle_s > 0:
                return WAIT
            return self._end(Failed(first_failure(failed).name, self._interrupted))
        if obs.malformed:
            return self._end(Broken(obs.malformed, self._interrupted))
        stranded = self._stranded(obs)
        if stranded:
            return self._end(Broken(stranded, self._interrupted))
        resplit = self._resplit(obs)
        if resplit is not None:
            return resplit
        due = [p for p, (when, _, _) in self._respawn.items() if when <= obs.now]
        if due:  # even after a stop request: the new workers learn from the scheduler to stop
            p = min(due)
            _, restart, backoff = self._respawn.pop(p)
            self._lost.discard(p)
            self._killed -= {c.name for c in obs.children if c.pipeline == p}
            resplit_p = p in self._resplitting
            self._resplitting.discard(p)
            return Respawn(p, restart, backoff, resplit_p)
        if not self._respawn and all(c.returncode is not None for c in obs.children):
            return self._end(Finished(self._interrupted))  # (a pipeline to restart is not done)
        if obs.elsewhere:
            return self._end(FailedElsewhere(obs.elsewhere, self._interrupted))
        return WAIT

    def _resplit(self, obs: Observation) -> Action | None:
        """A re-split in place the scheduler asks for and that was not acted on yet (not once a
        stop was asked for: the run ends anyway); :class:`Broken` for a malformed request."""
        asked = (obs.progress or {}).get("resplit")
        if not asked or self._interrupted:
            return None
        try:
            version = int(asked["version"])
            splits = tuple(sorted((int(p), tuple(int(b) for b in bounds))
                                  for p, bounds in asked["partitions"].items()))
            slowed = tuple(sorted((str(k), float(v))
                                  for k, v in (asked.get("slowed") or {}).items()))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            return self._end(Broken(f"the scheduler's re-split request is malformed ({err!r})",
                                    self._interrupted))
        if version <= self._resplit_seen:
            return None
        self._resplit_seen = version
        stopping = tuple(p for p, _ in splits if p not in self._lost)  # not lost meanwhile
        for p in stopping:
            self._lost.add(p)
            self._respawn[p] = (obs.now, self.restarts.used if self.restarts else 0, 0.0)
        # one lost meanwhile and due to be started again starts on its new split too
        self._resplitting.update(p for p, _ in splits if p in stopping or p in self._respawn)
        return Resplit(version, splits, slowed, stopping)

    def _stranded(self, obs: Observation) -> str | None:
        """Workers still running :attr:`stranded_s` after the scheduler exited 0, in words."""
        if not any(c.name == "scheduler" and c.returncode == 0 for c in obs.children):
            return None
        running = [c.name for c in obs.children if c.pipeline is not None
                   and c.pipeline not in self._lost and c.returncode is None]
        if not running:
            return None
        if self._scheduler_gone is None:
            self._scheduler_gone = obs.now
        if obs.now - self._scheduler_gone < self.stranded_s:
            return None
        return (f"the scheduler ended (every worker had reported done) but worker(s) "
                f"{', '.join(running)} still ran {self.stranded_s:g} s later; see their logs")

    def _plan_restart(self, pipeline: int, now: float) -> bool:
        """Whether lost ``pipeline`` is started again (after its back-off), drawing on the budget."""
        if self.restarts is None:
            return False
        backoff = self.restarts.take(pipeline, now, self._elsewhere)
        if backoff is None:
            return False
        self._respawn[pipeline] = (now + backoff, self.restarts.used, backoff)
        return True

    @staticmethod
    def _running(obs: Observation, name: str) -> bool:
        return any(c.name == name and c.returncode is None for c in obs.children)

    def _failures(self, obs: Observation) -> list[ChildState]:
        """Failed children, except the workers of dropped pipelines (they were stopped on purpose)."""
        return [c for c in obs.children if c.failed and c.pipeline not in self._lost]

    def _droppable(self, obs: Observation, failed: list[ChildState]) -> tuple[tuple[int, str], ...]:
        """The pipelines to drop for ``failed``, each with its root cause; () if the run must stop."""
        if not self.tolerate or any(c.pipeline is None for c in failed):
            return ()
        pipelines = self.pipelines or len({c.pipeline for c in obs.children if c.pipeline is not None})
        hit = sorted({c.pipeline for c in failed if c.pipeline is not None})  # all of them (above)
        if len(self._lost | set(hit)) >= pipelines:
            return ()  # nobody would be left to go on
        return tuple((p, first_failure([c for c in failed if c.pipeline == p]).name) for p in hit)

    def _note_start(self, progress: Mapping[str, Any] | None) -> None:
        if progress and progress.get("started", self.workers) >= self.workers:
            self._started = True

    def _end(self, action: Action) -> Action:
        self._final = action
        return action
