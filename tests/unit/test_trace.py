"""The tracer's buffer and the merge of workers' timelines (files, no processes)."""

from __future__ import annotations

import json

from sdpipe_cli.core.schedule import Action
from sdpipe_cli.runtime.trace import Tracer, merge, trace_path


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_buffer_keeps_the_newest_events_and_counts_the_rest():
    t = Tracer(0, "rank 0", Clock(), capacity=3)
    for k in range(5):
        t.span(f"s{k}", "update", k, k + 0.5)
    assert [e["name"] for e in t.chrome_events()] == ["s2", "s3", "s4"]
    assert t.dropped == 2


def test_compute_and_the_wait_before_it_from_the_executor_hooks():
    clock = Clock()
    t = Tracer(1, "rank 1", clock, capacity=10)
    clock.now = 1.0
    t.before_action(Action("F", 0))
    clock.now = 1.5  # on_action called: 0.2 s of compute after 0.3 s waiting for the input
    t.computed(Action("F", 0), 0.2, called=1.5)
    wait, compute = t.chrome_events()
    assert (wait["name"], wait["ts"], wait["dur"]) == ("wait input", 1.0e6, 0.3e6)
    assert (compute["name"], compute["ts"], compute["dur"]) == ("F0", 1.3e6, 0.2e6)


def test_merge_gives_one_named_track_per_worker_and_skips_a_torn_file(tmp_path):
    (tmp_path / "logs").mkdir()
    for rank in (1, 0):
        t = Tracer(rank, f"rank {rank}", Clock(), capacity=10)
        t.span("F0", "compute", 0.0, 0.1)
        t.write(trace_path(tmp_path, rank))
    (tmp_path / "logs" / "2.trace.json").write_text('{"rank": 2, "ev')  # killed while writing
    doc = json.loads(merge(tmp_path).read_text())
    tracks = [e for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert [(e["pid"], e["args"]["name"]) for e in tracks] == [(0, "rank 0"), (1, "rank 1")]
    assert sum(e["name"] == "F0" for e in doc["traceEvents"]) == 2


def test_a_track_s_rows_are_named_and_hold_their_events(tmp_path):
    (tmp_path / "logs").mkdir()
    t = Tracer(4, "scheduler", Clock(), capacity=10)
    t.rows = {0: "events", 2: "stage 1"}
    t.span("group 1", "round", 0.0, 0.1, "members", [0, 1], row=2)
    t.instant("ready 1", "ready", row=2)
    t.span("3 events", "scheduler", 0.0, 0.1)
    t.write(trace_path(tmp_path, 4))
    events = json.loads(merge(tmp_path).read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {0: "events", 2: "stage 1"}
    assert [(e["name"], e["tid"]) for e in events if e["ph"] != "M"] == [
        ("group 1", 2), ("ready 1", 2), ("3 events", 0)]


def test_no_worker_traces_no_file(tmp_path):
    (tmp_path / "logs").mkdir()
    assert merge(tmp_path) is None and not (tmp_path / "trace.json").exists()
