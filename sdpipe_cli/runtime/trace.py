"""A timeline of what every worker did, in the Chrome trace format (``run.trace=true``).

A run's metrics say how long things took on average; a timeline shows the 1F1B bubble, which
stage waited for which neighbour, and who waited for the straggler in a group round. Each worker
keeps its own events in a ring buffer (the last ``run.trace_events``), on the run clock shared by
every process, and writes them to ``logs/<rank>.trace.json`` when it finishes; the launcher then
merges them into ``<run>/trace.json``, one track per worker, for Perfetto (ui.perfetto.dev) or
chrome://tracing. The scheduler adds a track numbered after the last rank: each batch of events
it handled, and per stage each ready signal it took from the queue and each round, from its first
member's arrival to the publication of its decision.

Recorded: each forward and backward's compute (``F3``, ``B3``, including an emulated slow
device's extra time), the wait for a neighbour's input before it, sends (instants), the wait for
the scheduler's group and the group all-reduce (sdpipe), gradient clipping with its norm
all-reduce, the optimizer step, evaluation and checkpoints. The events come from the executor's
``before_action``/``on_action`` hooks and from the worker's update, so nothing in the executor
knows about tracing; with ``run.trace=false`` no hook is installed and nothing is recorded.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sdpipe_cli.core.schedule import Kind

__all__ = ["Tracer", "merge", "trace_path"]

US = 1e6


def trace_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"{rank}.trace.json"


class Tracer:
    """Worker ``rank``'s events; ``clock()`` is the run clock in seconds; ``capacity`` bounds
    the buffer (the oldest events go first).

    An event is held as a flat tuple until :meth:`write` (tuples of plain values are left alone by
    the garbage collector, which would otherwise walk tens of thousands of dicts on every full
    collection); recording one costs about 1.5 us.
    """

    def __init__(self, rank: int, label: str, clock: Callable[[], float], capacity: int):
        self.rank, self.label, self.clock = rank, label, clock
        self.events: deque[tuple] = deque(maxlen=capacity)
        self.recorded = 0
        self.rows: dict[int, str] = {}  # names of the track's rows other than the first
        self._before: float | None = None

    @property
    def dropped(self) -> int:
        return self.recorded - len(self.events)

    def span(self, name: str, cat: str, start: float, end: float, *args: Any, row: int = 0
             ) -> None:
        """A completed span from ``start`` to ``end`` (run-clock seconds); ``args``: alternating
        names and values shown with it; ``row``: the track's row (its thread, see
        :attr:`rows`)."""
        self.recorded += 1
        self.events.append(("X", name, cat, start, end, args, row))

    def instant(self, name: str, cat: str, *args: Any, row: int = 0) -> None:
        self.recorded += 1
        now = self.clock()
        self.events.append(("i", name, cat, now, now, args, row))

    @contextmanager
    def timed(self, name: str, cat: str) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.span(name, cat, start, self.clock())

    # -- the executor's hooks ----------------------------------------------------------------
    def hooks(self, on_action: Callable[[Any, float], None] | None,
              before_send: Callable[[int, Any], None] | None):
        """The executor's ``(on_action, before_send, before_action)`` hooks: these record, and
        call the given ones (an emulated device's slowdown, an emulated link's delay) inside,
        so that an emulated slow compute is traced as compute."""

        def traced_action(action: Any, seconds: float) -> None:
            called = self.clock()
            if on_action is not None:
                on_action(action, seconds)
            self.computed(action, seconds, called)

        def traced_send(dst: int, tensor: Any) -> None:
            self.sent(dst, tensor)
            if before_send is not None:
                before_send(dst, tensor)

        return traced_action, traced_send, self.before_action

    def before_action(self, action: Any) -> None:
        self._before = self.clock()

    def computed(self, action: Any, seconds: float, called: float) -> None:
        """Action ``action`` computed for ``seconds`` until ``called`` (when the executor's
        ``on_action`` hook ran), and any emulated slowdown until now."""
        start = called - seconds
        if self._before is not None and start - self._before > 1e-5:
            self.span("wait input" if action.kind is Kind.F else "wait grad", "wait",
                      self._before, start)
        self.span(str(action), "compute", start, self.clock())
        self._before = None

    def sent(self, dst: int, tensor: Any) -> None:
        self.instant("send", "p2p", "to", dst)

    # -- output -------------------------------------------------------------------------------
    def chrome_events(self) -> list[dict[str, Any]]:
        """The buffer as Chrome trace events (microseconds), on this worker's track."""
        out = []
        for ph, name, cat, start, end, args, row in self.events:
            event = {"name": name, "cat": cat, "ph": ph, "ts": round(start * US, 1),
                     "pid": self.rank, "tid": row}
            if ph == "X":
                event["dur"] = round(max(end - start, 0.0) * US, 1)
            else:
                event["s"] = "t"
            if args:
                event["args"] = dict(zip(args[::2], args[1::2]))
            out.append(event)
        return out

    def write(self, path: Path) -> None:
        """This worker's events and its track's name, atomically."""
        doc = {"rank": self.rank, "label": self.label, "dropped": self.dropped,
               "rows": self.rows, "events": self.chrome_events()}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)


def merge(run_dir: Path) -> Path | None:
    """``<run>/trace.json`` from every worker's ``logs/<rank>.trace.json`` (one track each, in
    rank order); None if no worker wrote one. A leg of a resumed run replaces the file."""
    run_dir = Path(run_dir)
    parts = []
    for path in (run_dir / "logs").glob("*.trace.json"):
        try:
            parts.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # a worker killed while writing: its track is missing, the rest stand
    if not parts:
        return None
    events: list[dict[str, Any]] = []
    for part in sorted(parts, key=lambda p: p["rank"]):
        rank = part["rank"]
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": part["label"]}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank,
                       "args": {"sort_index": rank}})
        for row, name in part.get("rows", {}).items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": int(row),
                           "args": {"name": name}})
        events.extend(part["events"])
    out = run_dir / "trace.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                               "otherData": {"dropped": {p["rank"]: p["dropped"] for p in parts}}}))
    os.replace(tmp, out)
    return out
