"""When a training loop stops, evaluates, checkpoints and reports: one answer for both loops.

The flushed loop asks once per iteration; the asynchronous loop asks at the start of each
iteration whether the one after it ends at a consistent point. Both ask the same questions of
one :class:`Cadence`, so that ``train.steps``, ``train.time_limit``, ``train.eval_every``,
``train.log_every``, ``checkpoint.every`` and ``checkpoint.every_minutes`` mean the same thing
under every schedule. Iterations are counted as *done*: "after step k" is after the k-th
iteration (0-based iteration k - 1) completed.

Who may stop, and when a checkpoint is consistent, depends on the sync strategy (lock-step
replicas must agree; sdpipe's scheduler decides); the strategy answers that, and the loops combine
its answer with the cadence's (see :mod:`sdpipe_cli.training.loop`). Nothing here reads a clock:
the caller passes the elapsed times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Cadence", "GlobalSyncCheckpoints", "Throughput", "time_left"]

# what is left of a time limit that earlier legs used up: stop at the first chance (0 would mean
# no limit)
NO_TIME_LEFT = 1e-3


def time_left(limit: float | None, spent: float) -> float | None:
    """``train.time_limit`` for a leg after earlier legs of the same command used ``spent``
    seconds of it (a restart's or a re-plan's leg); None: no limit."""
    return None if limit is None else max(float(limit) - spent, NO_TIME_LEFT)


@dataclass(frozen=True)
class Cadence:
    steps: int  # train.steps: iterations of this pipeline's local budget
    eval_every: int = 0  # evaluate after every multiple (0: only at the end)
    log_every: int = 1  # report a step event after every multiple
    checkpoint_every: int = 0  # checkpoint after every multiple (0: none)
    checkpoint_minutes: float | None = None  # also when this long passed since the last save
    time_limit: float | None = None  # seconds since the loop started
    checkpoint_on_exit: bool = False  # also checkpoint where the run ends

    @classmethod
    def of(cls, train: Any, checkpoint: Any, spent: float = 0.0) -> Cadence:
        """The cadence of a run's ``train`` and ``checkpoint`` sections, for a leg after earlier
        ones used ``spent`` seconds of the time limit."""
        return cls(steps=train.steps, eval_every=train.eval_every, log_every=train.log_every,
                   checkpoint_every=checkpoint.every, checkpoint_minutes=checkpoint.every_minutes,
                   time_limit=time_left(train.time_limit, spent),
                   checkpoint_on_exit=checkpoint.on_exit)

    def timed_out(self, elapsed_s: float, stop_requested: bool = False) -> bool:
        """Whether the run must end now: its time limit passed, or the user asked to stop."""
        return stop_requested or bool(self.time_limit and elapsed_s >= self.time_limit)

    def local_go(self, iteration: int, timed_out: bool) -> bool:
        """Whether this pipeline's own budget allows 0-based ``iteration``."""
        return iteration < self.steps and not timed_out

    def evaluate_after(self, done: int) -> bool:
        return bool(self.eval_every) and done % self.eval_every == 0

    def final_evaluation(self, done: int) -> bool:
        """At the end of the run, evaluate unless the cadence just did."""
        return not self.evaluate_after(done)

    def log_after(self, done: int) -> bool:
        return done % self.log_every == 0

    def checkpoint_after(self, done: int) -> bool:
        """A step-based checkpoint is due after ``done`` iterations (lock-step strategies)."""
        return bool(self.checkpoint_every) and done > 0 and done % self.checkpoint_every == 0

    def checkpoint_time(self, since_save_s: float) -> bool:
        """A time-based checkpoint is wanted (the strategy decides whether replicas agree)."""
        minutes = self.checkpoint_minutes
        return minutes is not None and minutes > 0 and since_save_s >= minutes * 60


class GlobalSyncCheckpoints:
    """``sync=sdpipe``: which global syncs get a checkpoint.

    Its replicas are one consistent model only right after a global sync, so its checkpoints are
    taken there: at the first global sync at or after each multiple of ``checkpoint.every``
    (counted in iterations of an average pipeline), at one where ``checkpoint.every_minutes``
    passed since the last checkpoint, and at the last one if ``checkpoint.on_exit``. The scheduler
    asks once per global sync; the answer is the checkpoint's id (its iteration) or None.
    """

    def __init__(self, cadence: Cadence, now: float):
        self.cadence = cadence
        self.next = cadence.checkpoint_every  # the next multiple to reach (0: none)
        self.last_saved = now

    def resume(self, at: int) -> None:
        """The run goes on from a checkpoint at ``at`` iterations."""
        every = self.cadence.checkpoint_every
        if every:
            self.next = (at // every + 1) * every

    def at_global_sync(self, at: int, final: bool, now: float) -> int | None:
        """A global sync after ``at`` iterations (``final``: the run ends with it)."""
        c = self.cadence
        due = (bool(c.checkpoint_every) and at >= self.next
               or (final and c.checkpoint_on_exit)
               or c.checkpoint_time(now - self.last_saved))
        if due and c.checkpoint_every:
            self.next = (at // c.checkpoint_every + 1) * c.checkpoint_every
        return at if due else None

    def saved(self, now: float) -> None:
        self.last_saved = now


class Throughput:
    """``samples_per_s`` of a step event: samples since this process's first iteration ended,
    over the seconds since then.

    The first iteration pays one-off set-up (connections, allocator, the first group), which a
    rate over a short run must not include; before a second iteration ends, the first
    iteration's own rate is all there is. Times come from the caller.
    """

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self._warm: tuple[float, int] | None = None  # (time, done) at the first iteration's end

    def iteration_done(self, now: float, done: int, iteration_s: float) -> float:
        """Record that ``done`` iterations are complete at ``now``; the current rate."""
        if self._warm is None:
            self._warm = (now, done)
        since, at = self._warm
        if done > at:
            return (done - at) * self.batch_size / max(now - since, 1e-9)
        return self.batch_size / max(iteration_s, 1e-9)
