"""scripts/bench_scheduler.py end to end at a tiny size: the real scheduler process and simulated
replicas, the JSON and Markdown results, and no process left behind."""

from __future__ import annotations

import importlib
import json
import os
import sys

import psutil
import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.multiprocess

MARK = "SDPIPE_BENCH_SCHEDULER_TEST"  # in the environment of every process the script starts


def marked(value: str) -> list[psutil.Process]:
    """The live processes the script started (this one, which runs it, aside)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(MARK) == value \
                    and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_tiny_run_reports_latency_and_cpu(tmp_path, monkeypatch):
    """The script's ``main`` in this process (an interpreter less); the scheduler it measures and
    the process of replicas it drives are real processes of their own."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    monkeypatch.setenv(MARK, str(tmp_path))  # inherited by every process the script starts
    bench = importlib.import_module("bench_scheduler")
    results, table = tmp_path / "results.json", tmp_path / "table.md"
    args = ["--pipelines", "4", "--stages", "2", "--steps", "4", "--compute-ms", "10", "--processes",
            "1", "--timeout", "40", "--out", str(tmp_path / "out"), "--json", str(results),
            "--markdown", str(table)]
    monkeypatch.setattr(sys, "argv", ["scripts/bench_scheduler.py", *args])  # the results' stamp
    try:
        rc = bench.main(args)
    finally:
        left = marked(str(tmp_path))
        for p in left:
            p.kill()
    assert rc == 0
    assert not left, f"processes left behind: {[p.pid for p in left]}"

    [r] = json.loads(results.read_text())
    assert (r["pipelines"], r["stages"]) == (4, 2)
    assert r["decisions"] > 0 and r["rounds"] >= 4 * 2 and r["events_per_s"] > 0
    assert 1 <= r["mean_group"] <= 4
    lat = r["latency_ms"]
    assert 0 <= lat["min"] <= lat["p50"] <= lat["p99"] <= lat["max"] < 40_000
    # the split from the scheduler's timeline: queue + sched + wake is the latency, per round
    parts = r["parts_ms"]
    assert set(parts) == {"queue", "sched", "wake"}
    assert all(0 <= x["p50"] <= x["p99"] <= lat["max"] + 1 for x in parts.values()), parts
    assert r["wall_s"] > 0
    assert 0 <= r["scheduler_cpu_per_s"] <= os.cpu_count()
    assert r["scheduler_cpu_ms_per_decision"] >= 0 and r["scheduler_queued_per_s"] >= 0
    assert r["replicas_cpu_per_s"] >= 0

    lines = table.read_text().splitlines()
    assert lines[0].startswith("measured ") and "scripts/bench_scheduler.py" in lines[0]
    [header] = [line for line in lines if line.startswith("| P x S |")]
    assert all(f"| {c} |" in header for c in ("p50 ms", "p99 ms", "max ms", "sched CPU s/s",
                                              "queue p50/p99", "sched p50/p99", "wake p50/p99",
                                              "sched CPU ms/decision", "decisions", "mean group"))
    assert len([line for line in lines if line.startswith("| 4 x 2 |")]) == 1
