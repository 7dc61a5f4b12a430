"""The scheduler process: its loop over the store's event queue, its journal, its start.

The loop blocks on the event queue (no polling) and takes what is queued in batches, urgent
events first; a small :class:`Ticker` thread pushes a ``tick`` event when the policy's next
deadline passes, and at least every :data:`TICK_S` seconds for heartbeats. Each batch is
journaled, at one moment of the scheduler's clock, before it is acted on (:func:`act`), so a
scheduler started again after the first died replays the journal to the same state
(:func:`replay`) and goes on live. :func:`main` is what the launcher starts; at the end it
writes ``summary.json`` and seals ``final/``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from sdpipe_cli import checkpoint
from sdpipe_cli.config.schema import Config
from sdpipe_cli.runtime import protocol, store
from sdpipe_cli.runtime.bootstrap import child, connect_store
from sdpipe_cli.runtime.metrics import write_summary
from sdpipe_cli.runtime.trace import trace_path
from sdpipe_cli.sync import journal, wire_probe
from sdpipe_cli.sync.journal import journal_path
from sdpipe_cli.sync.scheduler.handling import Scheduler

__all__ = ["Ticker", "next_batch", "in_order", "BatchClock", "act", "replay", "take_over", "serve",
           "main"]

log = logging.getLogger("sdpipe.scheduler")

TICK_S = 0.5  # longest sleep between ticks (heartbeats, time limit, progress)


class Ticker(threading.Thread):
    """Pushes ``tick`` events into the queue at the policy's deadlines (own store connection)."""

    def __init__(self, connect: Callable[[], object]):
        super().__init__(daemon=True, name="ticker")
        self.events = store.namespace(connect())
        self.cond = threading.Condition()
        self.deadline: float | None = None
        self.stopped = False

    def wake_at(self, deadline: float | None) -> None:
        with self.cond:
            # Only a sooner deadline needs the thread now: a later one (or none) is seen when it
            # wakes for the one it sleeps towards, and it goes back to sleep without a tick. Waking
            # it on every event costs a context switch per event under load.
            sooner = deadline is not None and (self.deadline is None or deadline < self.deadline)
            self.deadline = deadline
            if sooner:
                self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()

    def run(self) -> None:
        next_beat = time.monotonic() + TICK_S
        while True:
            with self.cond:
                while not self.stopped:
                    now = time.monotonic()
                    due = next_beat if self.deadline is None else min(self.deadline, next_beat)
                    if due <= now:
                        break
                    self.cond.wait(due - now)
                if self.stopped:
                    return
                self.deadline = None
            next_beat = time.monotonic() + TICK_S
            store.push(self.events, store.EVENTS, protocol.Tick())


# events a worker blocks on, that unblock its peers, or that say which incarnation is live (the
# restart comes before the events of the processes it announces)
URGENT = ("ready", "begin", "lost", "restart", "rejoin")
BATCH = 512  # most events taken from the queue at once


def next_batch(events, writer: journal.Journal | None = None) -> list[str]:
    """The next events, as popped: all that are queued (up to :data:`BATCH`), else the next
    one to come (blocking); each journaled (``writer``) the moment it is popped, so that a
    scheduler killed before it acts on them leaves them to the next (see the journal's note)."""
    raw: list[str] = []

    def popped(event: bytes | str) -> None:
        # bytes that are not UTF-8 become a message that fails to decode, naming the queue
        text = event.decode("utf-8", errors="replace") if isinstance(event, bytes) else event
        if writer is not None:
            writer.popped(text)
        raw.append(text)

    while len(raw) < BATCH:
        try:
            popped(events.queue_pop(store.EVENTS, block=False))
        except dist.QueueEmptyError:
            break
    if not raw:
        popped(events.queue_pop(store.EVENTS))
    return raw


def in_order(raw: list[str]) -> list[protocol.Event]:
    """A batch decoded, urgent events first (the launcher's lost and restart events must not
    wait behind P x S arrivals, and a round of P x S arrivals is not decided behind P x S
    metrics writes); the order is kept within each kind. Before them, the reports a pipeline
    sent before the launcher's word of its loss: its last train line counts in the iterations
    the loss leaves it (``Scheduler._lost``) rather than being read after it."""
    batch = [protocol.decode_event(r, store.PREFIX + store.EVENTS) for r in raw]
    lost: dict[int, int] = {}  # pipeline -> where the batch first says it was lost
    for i, e in enumerate(batch):
        if isinstance(e, protocol.Lost):
            lost.setdefault(e.pipeline, i)

    def rank(i: int, e: protocol.Event) -> int:
        if isinstance(e, protocol.Report) and i < lost.get(e.pipeline, -1):
            return 0
        return 1 if e.type in URGENT else 2
    return [e for i, e in sorted(enumerate(batch), key=lambda ie: rank(*ie))]


class BatchClock:
    """The scheduler's clock: one moment per batch (set by :func:`serve`), so that the journal
    can replay every decision at the moment it was made."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def act(scheduler: Scheduler, writer: journal.Journal, raw: list[str], now: float
        ) -> list[protocol.Event]:
    """Journal one batch at moment ``now``, then act on it (the scheduler's clock must be a
    :class:`BatchClock`); returns the batch, decoded."""
    scheduler.clock.now = now
    batch = in_order(raw)
    # the flag matters only to a tick (read there, once per batch at most)
    stop = (any(isinstance(e, protocol.Tick) for e in batch)
            and scheduler.events.check([store.STOP_REQUESTED]))
    writer.record(now, stop, raw)  # before acting on it: see the journal's note
    scheduler.stop_seen = stop
    for event in batch:
        scheduler.handle(event)
    return batch


def replay(cfg: DictConfig, run_dir: Path, events, resume: Path | None = None,
           now: Callable[[], float] = time.monotonic, path: Path | None = None,
           restart: int = 1, wire: protocol.MeetingChoice | None = None,
           settings: Config | None = None) -> Scheduler:
    """A scheduler started again after the run's first died: the dead one's journal (``path``,
    default the first leg's) replayed, then live from moment ``now()`` on
    (:mod:`~sdpipe_cli.sync.journal`)."""
    started, batches, _ = journal.read(path or journal_path(run_dir))  # the unacted: take_over
    clock = BatchClock(started)
    scheduler = Scheduler(cfg, run_dir, events, clock=clock, resume=resume, live=False,
                          wire=wire, settings=settings)
    for batch in batches:
        clock.now, scheduler.stop_seen = batch.t, batch.stop
        scheduler.new_batch()
        for event in in_order(list(batch.events)):
            scheduler.handle(event)
    log.info("replayed %d batches of the journal", len(batches))
    clock.now = now()
    scheduler.go_live(len(batches), batches[-1].t if batches else None, restart)
    return scheduler


def take_over(cfg: DictConfig, run_dir: Path, events, path: Path, resume: Path | None = None,
              restart: int = 1, wire: protocol.MeetingChoice | None = None,
              now: Callable[[], float] = time.monotonic,
              settings: Config | None = None) -> tuple[Scheduler, journal.Journal]:
    """The scheduler started again, live: its predecessor's journal at ``path`` replayed
    (:func:`replay`), then the events that one popped and never acted on acted on, first."""
    scheduler = replay(cfg, run_dir, events, resume, now=now, path=path, restart=restart,
                       wire=wire, settings=settings)
    writer = journal.Journal.resume(path)
    if writer.unacted:
        act(scheduler, writer, list(writer.unacted), now())
    return scheduler, writer


def serve(cfg: DictConfig, run_dir: Path, events, connect: Callable[[], object],
          resume: Path | None = None, restarted: int = 0,
          config: str = "config.yaml", wire: protocol.MeetingChoice | None = None,
          settings: Config | None = None) -> Scheduler:
    """Run until every worker reported done; ``restarted``: how many times this leg's scheduler
    was started again after it died (it then replays its journal first: the leg's, named after
    ``config``); ``wire``: the meetings this leg settled from its measured wire (a
    :class:`~sdpipe_cli.runtime.protocol.MeetingChoice`), for the metrics and the summary;
    ``settings``: ``cfg`` typed, as the process read it from its run file."""
    path = journal_path(run_dir, config)
    if restarted:
        scheduler, writer = take_over(cfg, run_dir, events, path, resume, restarted, wire,
                                      settings=settings)
    else:
        clock = BatchClock(time.monotonic())
        writer = journal.Journal.create(path, clock.now)
        scheduler = Scheduler(cfg, run_dir, events, clock=clock, resume=resume, wire=wire,
                              settings=settings)
        if wire is not None:
            scheduler.metrics.write(wire_probe.line(wire, round(time.time() - scheduler.t0, 4)))
    ticker = Ticker(connect)
    ticker.start()
    tracer = scheduler.tracer
    failed = True  # until every worker reported done
    try:
        while not scheduler.tracker.all_done():
            raw = next_batch(events, writer)
            popped = tracer.clock() if tracer is not None else 0.0
            batch = act(scheduler, writer, raw, time.monotonic())
            if scheduler.policy is not None:
                ticker.wake_at(scheduler.policy.next_deadline())
            if tracer is not None:
                tracer.span(f"{len(batch)} events", "scheduler", popped, tracer.clock(),
                            "events", len(batch))
        failed = False
    finally:
        ticker.stop()
        writer.close()
        scheduler.metrics.close(failed)
        if tracer is not None:
            tracer.write(trace_path(run_dir, tracer.rank))
    scheduler.publish_progress()
    return scheduler


def main() -> int:
    resume = os.environ.get("SDPIPE_RESUME")
    with child("scheduler", role="scheduler") as started:
        run_dir, cfg, settings = started.run_dir, started.cfg, started.settings

        def connect():
            return connect_store(settings.run.timeout)

        events = store.namespace(connect())
        # meetings left to the measured wire: settled before the policy, which counts them
        workers = settings.cluster.pipelines * settings.pipeline.stages
        wire = wire_probe.settle(settings, events, workers, settings.run.timeout)
        scheduler = serve(cfg, run_dir, events, connect, Path(resume) if resume else None,
                          restarted=int(os.environ.get("SDPIPE_SCHEDULER_RESTART", "0")),
                          config=os.environ.get("SDPIPE_CONFIG", "config.yaml"), wire=wire,
                          settings=settings)
        summary = scheduler.summary()
        write_summary(run_dir, summary)
        if settings.run.save_final:  # every worker wrote its weights there before it was done
            steps = {str(p): state["steps"] for p, state in summary["pipelines"].items()}
            config = OmegaConf.to_container(cfg, resolve=True)
            if checkpoint.seal_final(run_dir, {"config": config, "steps": steps},
                                     scheduler.grid.pipelines, scheduler.grid.stages) is None:
                log.warning("final/ is not one model's (a replica did not write its weights "
                            "there): it has no manifest")
        for p, state in summary["pipelines"].items():
            log.info("pipeline %s: %d iterations, loss %s", p, state["steps"], state["loss"])
        if "rounds" in summary:
            for s, per_pipeline in enumerate(summary["rounds"]):
                log.info("%s %d: rounds per replica %s", summary.get("rounds_of", "stage"), s,
                         per_pipeline)
            log.info("mean group size %.2f", summary["mean_group_size"] or 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
