"""The scheduler's health check: a worker silent too long, or workers that never started.

Silence is measured in time, so the check runs once per tick (:data:`.process.TICK_S`). A
worker that sends nothing for ``run.heartbeat_timeout`` seconds is hung. Where the run survives
a lost pipeline (``fault.on_pipeline_loss=continue|restart``) and another pipeline is still
alive, the hung workers are *named* (under ``sdpipe/hung``, with their incarnations, so that a
restarted process is never taken for the one it replaced) and the launcher kills them and
handles the loss; otherwise, and when every live pipeline is silent (the run's hang, not a
replica's), the run fails with :class:`WorkerHung`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sdpipe_cli.core.placement import Grid
from sdpipe_cli.runtime import protocol
from sdpipe_cli.runtime.metrics import RunTracker

__all__ = ["Health", "WorkerHung"]

log = logging.getLogger("sdpipe.scheduler")


class WorkerHung(RuntimeError):
    pass


class Health:
    """Which workers are hung, from the tracker's last reports and an injected clock."""

    def __init__(self, tracker: RunTracker, grid: Grid, heartbeat_timeout: float,
                 start_timeout: float, tolerant: bool, clock: Callable[[], float]):
        self.tracker, self.grid, self.clock = tracker, grid, clock
        self.heartbeat_timeout, self.start_timeout = heartbeat_timeout, start_timeout
        self.tolerant = tolerant  # a lost pipeline is survived: name the hung, do not fail
        self.started = clock()
        self.hung: set[int] = set()  # ranks named hung, until their pipeline is lost

    def check(self, policy: Any | None) -> bool:
        """Look once; True when more workers are named hung (to be published). Raises
        :class:`WorkerHung` when the run itself is hung or did not start in time."""
        if policy is not None:
            # a replica the policy holds (a round not closed, a global sync waiting for a hung
            # replica) waits for us: as good as a report, so its silence starts when we let it go
            self.tracker.heard(self.grid.rank(p, s) for s, p in policy.held())
        hung = self.tracker.silent_workers()
        live = set(policy.live) if policy is not None else set()
        named = False
        if hung and self.tolerant and live - {self.grid.pipeline_of(r) for r in hung}:
            if not set(hung) <= self.hung:  # the launcher kills them; their pipelines are lost
                self.hung |= set(hung)
                log.warning("no report from rank(s) %s for %g s: named hung", hung,
                            self.heartbeat_timeout)
                named = True
        elif hung:  # (every live pipeline silent is the run's hang, not a replica's)
            raise WorkerHung(f"no report from rank(s) {hung} for {self.heartbeat_timeout:g} s")
        missing = self.tracker.world_size - len(self.tracker.started)
        if missing and self.clock() - self.started > self.start_timeout:
            raise WorkerHung(f"{missing} worker(s) never started within run.timeout")
        return named

    def pipeline_lost(self, p: int) -> bool:
        """Pipeline ``p`` is lost: its ranks are no longer hung; True when any were."""
        ranks = set(self.grid.pipeline_ranks(p))
        if not self.hung & ranks:
            return False
        self.hung -= ranks
        return True

    def named(self, incarnation: list[int]) -> protocol.Hung:
        """The hung workers as the launcher reads them: (rank, incarnation)."""
        return protocol.Hung([(r, incarnation[self.grid.pipeline_of(r)])
                              for r in sorted(self.hung)])
