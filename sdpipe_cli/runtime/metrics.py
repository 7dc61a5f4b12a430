"""Metrics: the run's progress as the scheduler sees it, and the ``metrics.jsonl`` it writes.

Workers report what only they know (the loss lives on the last stage of each pipeline) as events;
:class:`RunTracker` folds them into per-pipeline state without doing any I/O, and
:class:`MetricsLog` appends one JSON object per line. The launcher shows the tracker's
:meth:`RunTracker.snapshot`; nothing flows back from here to the workers.

``metrics.jsonl`` lines have a ``kind``; each kind is a record class of
:mod:`sdpipe_cli.analysis.records`, the one schema, whose docstring says what its fields mean
(docs/RUNS.md's table is generated from them). Readers read the file with
:func:`sdpipe_cli.analysis.read_metrics`, which checks it, and take every derived figure
(samples/s of a run, solo rates, time to a loss ...) from that module. A line made here from a
worker's report carries the report's fields (a sync mode may add its own), which the records
declare too.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdpipe_cli.runtime.errors import WriteFailed
from sdpipe_cli.runtime.trackers import Sink, close_all


@dataclass
class PipelineState:
    steps: int = 0  # iterations finished by the pipeline's last stage
    samples: int = 0
    loss: float | None = None
    val_loss: float | None = None
    samples_per_s: float = 0.0
    val_accuracy: float | None = None  # classifiers: top-1 on the validation split


@dataclass
class RunTracker:
    """Global view of a run, built from worker events. Pure: the clock is injected."""

    pipelines: int
    stages: int
    target_iterations: int  # P x steps pipeline-iterations end the run
    clock: Callable[[], float] = time.monotonic
    heartbeat_timeout: float = 300.0
    state: dict[int, PipelineState] = field(default_factory=dict)
    last_seen: dict[int, float] = field(default_factory=dict)
    done: dict[int, dict[str, Any]] = field(default_factory=dict)
    started: set = field(default_factory=set)
    unreadable: dict[str, str] = field(default_factory=dict)  # sample -> error, over all readers
    waits: dict[int, list] = field(default_factory=dict)  # rank -> [data_s, step_s, steps] totals

    def __post_init__(self) -> None:
        self.state = {p: PipelineState() for p in range(self.pipelines)}

    @property
    def world_size(self) -> int:
        return self.pipelines * self.stages

    def update(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """Fold one event in; returns the metrics line it produces, if any."""
        rank = int(event["rank"])
        self.last_seen[rank] = self.clock()
        kind = event["type"]
        pipe_index = int(event["pipeline"])
        pipe = self.state[pipe_index]
        if kind == "start":
            self.started.add(rank)
            return None
        if kind == "step" and "data_s" in event:
            if rank in self.waits:  # the first batch waits for the loader's start: not counted
                self.waits[rank][0] += event["data_s"]
                self.waits[rank][1] += event["step_s"]
                self.waits[rank][2] += 1
            else:
                self.waits[rank] = [0.0, 0.0, 0]
        if kind == "unreadable":
            self.unreadable.setdefault(event["sample"], event["error"])
            return {"kind": "unreadable", **_without(event, "type", "rank")}
        if kind == "step" and "loss" in event:
            pipe.steps, pipe.samples = event["step"], event["samples"]
            pipe.loss, pipe.samples_per_s = event["loss"], event["samples_per_s"]
            return {"kind": "train", **_without(event, "type", "rank", "stage")}
        if kind == "step" and "group_size" in event:
            return {"kind": "sync", **_without(event, "type", "rank", "samples", "samples_per_s", "lr")}
        if kind == "step" and "data_s" in event:
            return {"kind": "data", **{k: event[k] for k in ("step", "time", "pipeline", "stage",
                                                             "step_s", "data_s")}}
        if kind == "eval":
            pipe.val_loss = event["val_loss"]
            pipe.val_accuracy = event.get("val_accuracy")
            return {"kind": "eval", **_without(event, "type", "rank", "stage")}
        if kind == "consensus":  # replicas' drift before a global sync, per stage
            return {"kind": "consensus", **_without(event, "type", "rank", "pipeline")}
        if kind == "done":
            self.done[rank] = event
            if event["steps"] > pipe.steps:  # past its last train line (train.log_every)
                pipe.steps, pipe.samples = event["steps"], event["samples"]
            return {"kind": "done", **_without(event, "type")}
        if kind == "lost":  # the launcher stopped this pipeline after one of its workers failed
            for r in range(pipe_index * self.stages, (pipe_index + 1) * self.stages):
                if event.get("restart"):  # its new processes will report, and be done, later
                    self.last_seen.pop(r, None)
                else:
                    self.done.setdefault(r, event)
            return {"kind": "lost", **_without(event, "type", "rank")}
        if kind == "restart":  # the launcher started a lost pipeline's processes again
            self.last_seen.pop(rank, None)
            return {"kind": "restart", **_without(event, "type", "rank")}
        if kind == "healed":  # a restarted replica took a live one's state
            return {"kind": "heal", **_without(event, "type", "rank")}
        return None

    def _worst_wait(self) -> dict[str, Any]:
        judged = [(w / t, w / n) for w, t, n in self.waits.values() if t > 0 and n >= 10]
        share, mean = max(judged, default=(None, None))
        return {"data_wait_share": share, "data_wait_s": mean}

    def all_done(self) -> bool:
        return len(self.done) == self.world_size

    def heard(self, ranks: Iterable[int]) -> None:
        """Count ``ranks`` as heard from now (workers known to be alive without a report)."""
        now = self.clock()
        for r in ranks:
            if r in self.last_seen:
                self.last_seen[r] = now

    def silent_workers(self) -> list[int]:
        """Ranks not heard from within the heartbeat timeout (not yet done)."""
        now = self.clock()
        return sorted(r for r, t in self.last_seen.items()
                      if r not in self.done and now - t > self.heartbeat_timeout)

    def snapshot(self) -> dict[str, Any]:
        """What the launcher displays: totals and the latest value per pipeline."""
        losses = [s.loss for s in self.state.values() if s.loss is not None]
        vals = [s.val_loss for s in self.state.values() if s.val_loss is not None]
        accs = [s.val_accuracy for s in self.state.values() if s.val_accuracy is not None]
        return {
            "iterations": sum(s.steps for s in self.state.values()),
            "target": self.target_iterations,
            "samples": sum(s.samples for s in self.state.values()),
            "samples_per_s": sum(s.samples_per_s for s in self.state.values()),
            "loss": sum(losses) / len(losses) if losses else None,
            "val_loss": sum(vals) / len(vals) if vals else None,
            "val_accuracy": sum(accs) / len(accs) if accs else None,
            "started": len(self.started),
            "done": len(self.done),
            "pipelines": {p: dict(vars(s)) for p, s in self.state.items()},
            # the reading stage that waited most for data, as a share of its iterations' time
            # (over 10 iterations at least: a shorter run says little about its loader), and
            # that stage's mean wait per iteration in seconds
            **self._worst_wait(),
            **self._traffic(),
            "unreadable": sorted(self.unreadable),
        }

    def _traffic(self) -> dict[str, Any]:
        """The sync traffic of the workers done so far (their ``done`` events carry it), as
        :func:`sdpipe_cli.analysis.sync_traffic` defines it."""
        from sdpipe_cli.analysis import sync_traffic

        return sync_traffic(self.done.values(), sum(s.samples for s in self.state.values()))


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """``<run>/summary.json``, whole or not at all: written beside it and renamed over it, so
    that a full disk leaves the one before (or none), never half of one, and says so
    (:class:`~sdpipe_cli.runtime.errors.WriteFailed`)."""
    path = Path(run_dir) / "summary.json"
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(strict_json(summary, indent=1))
        os.replace(tmp, path)
    except OSError as err:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise WriteFailed(path, err, Path(run_dir)) from err
    return path


class MetricsLog:
    """Append-only ``metrics.jsonl``; each line is flushed so a crash loses at most one line.

    Every line's scalars (:func:`scalars` says which) also go to each of ``sinks``: the
    experiment trackers the run asked for (:func:`sdpipe_cli.runtime.trackers.open_sinks`),
    which the log closes with itself.
    """

    def __init__(self, path: Path, sinks: Iterable[Sink] = ()):
        self.path = Path(path)
        self._file = self.path.open("a", encoding="utf-8")
        self._sinks = list(sinks)

    def write(self, line: dict[str, Any]) -> None:
        try:
            self._file.write(strict_json(line) + "\n")
            self._file.flush()
        except OSError as err:  # a full disk: the run stops, naming the file
            raise WriteFailed(self.path, err, self.path.parent) from err
        if self._sinks:
            items = scalars(line)
            if items:
                for sink in self._sinks:
                    sink.log(items)

    def close(self, failed: bool = False) -> None:
        """Close the file and every sink; ``failed``: the writer ends on an error (a tracker
        may mark its run so)."""
        try:
            self._file.close()
        except OSError:  # the line a failed write left in the buffer (that failure was raised)
            pass
        close_all(self._sinks, failed)


# metrics.jsonl fields shown as trackers' scalars, per kind of line.
_PIPELINE_FIELDS = ("loss", "samples_per_s", "lr", "step_s", "sync_s", "wait_s", "comm_s",
                    "group_size")


def scalars(line: dict[str, Any]) -> list[tuple[str, float, int, float | None]]:
    """The scalars of one metrics line, for every tracker: (tag, value, step, run-clock seconds).

    Pipelines' series are on their own iterations (``pipeline1/loss``, ``pipeline1/stage0/wait_s``
    for stages other than the last), validation as ``pipeline1/val_loss``; sdpipe's decisions
    and consensus on the stage's rounds (``stage0/group_size``, ``stage0/max_wait_s``,
    ``stage0/consensus``); a straggler's slowdown when it is named and when it recovers
    (``pipeline1/stage0/slower``)."""
    kind, t = line.get("kind"), line.get("time")
    out: list[tuple[str, float, int, float | None]] = []

    def add(tag: str, value: Any, step: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and step is not None:
            out.append((tag, float(value), int(step), t))

    if kind == "train":
        for name in _PIPELINE_FIELDS:
            add(f"pipeline{line['pipeline']}/{name}", line.get(name), line.get("step"))
    elif kind == "sync":
        for name in ("wait_s", "comm_s", "group_size"):
            add(f"pipeline{line['pipeline']}/stage{line['stage']}/{name}", line.get(name),
                line.get("step"))
    elif kind == "eval":
        add(f"pipeline{line['pipeline']}/val_loss", line.get("val_loss"), line.get("step"))
        add(f"pipeline{line['pipeline']}/val_accuracy", line.get("val_accuracy"), line.get("step"))
    elif kind == "group":
        add(f"stage{line['stage']}/group_size", line.get("size"), line.get("round"))
        add(f"stage{line['stage']}/max_wait_s", line.get("max_wait_s"), line.get("round"))
    elif kind == "consensus":
        add(f"stage{line['stage']}/consensus", line.get("consensus"), line.get("round"))
    elif kind in ("straggler", "recovered"):  # a device's slowdown when it was named or recovered
        add(f"pipeline{line['pipeline']}/stage{line['stage']}/slower", line.get("slower"),
            line.get("iteration"))
    return out


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def strict_json(value: Any, **kwargs: Any) -> str:
    """JSON that every parser reads: a NaN or infinite number (a diverged loss) becomes null."""
    return json.dumps(_finite(value), allow_nan=False, **kwargs)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every line of a ``metrics.jsonl``, strictly: a line that does not parse raises (for
    tests of what is written). Readers of runs use :func:`sdpipe_cli.analysis.read_metrics`,
    which leaves out a torn line and checks the schema."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _without(event: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k not in keys}
