"""``sdpipe profile`` end to end: one real 2x2 CPU profile of an emulated heterogeneous cluster,
and a Ctrl-C that stops a profile at once.

The run emulates node b's devices at speed 0.25, 20 ms and 1 Gbit/s within a node, 10 ms across
nodes, so one run shows every field of profile.json and that each emulated quantity reaches its
measurement. Ratios are taken within that run: the machine is shared, so absolute times are not
comparable between runs.
"""

from __future__ import annotations

import statistics
import time

import pytest

from sdpipe_cli.config import measurements
from sdpipe_cli.hetero import profiler
from tests.helpers import interrupt_command, run_processes, sdpipe, sdpipe_beside

pytestmark = pytest.mark.multiprocess

HETERO = ("cluster.device=cpu",
          "cluster.nodes=[{name: a, devices: [{speed: 1.0}, {speed: 1.0}]}, "
          "{name: b, devices: [{speed: 0.25}, {speed: 0.25}]}]",
          "cluster.links.same_node.latency_ms=20", "cluster.links.same_node.bandwidth_gbps=1",
          "cluster.links.cross_node.latency_ms=10")


def test_profile_2x2_cpu_shows_emulated_speeds_and_links(run_dir):
    out = sdpipe("profile", f"run.dir={run_dir}", *HETERO, timeout=180)
    assert out.returncode == 0, out.stderr
    doc = measurements.load(run_dir / "profile.json")  # every documented field, or this raises
    assert doc["format"] == measurements.FORMAT and doc["torch"] and doc["created"]
    assert doc["model"]["name"] == "gpt_tiny" and doc["model"]["blocks"] == 6
    assert doc["cluster"] == {"name": "local", "emulation": "measured", "pipelines": 2,
                              "stages": 2, "device": "cpu",
                              "links": {"same_node": {"latency_ms": 20.0, "bandwidth_gbps": 1.0},
                                        "cross_node": {"latency_ms": 10.0,
                                                       "bandwidth_gbps": None}}}
    devices = {d["name"]: d for d in doc["devices"]}
    assert [(d["name"], d["pipeline"], d["stage"], d["speed"]) for d in doc["devices"]] == [
        ("a:0", 0, 0, 1.0), ("a:1", 0, 1, 1.0), ("b:0", 1, 0, 0.25), ("b:1", 1, 1, 0.25)]
    for d in doc["devices"]:
        assert all(t > 0 for t in d["forward_ms"] + d["backward_ms"])
        assert d["memory_source"] == "rss" and 50 < d["peak_memory_mb"] < 4000
    # Speed 0.25 takes four times as long: compare the same blocks on both nodes, measured in one
    # run. Each block's forward and backward on b over a, and the median of those ratios: a block
    # that lost its core for a whole measurement (a loaded CI host) moves one ratio, not the verdict.
    times = {n: [t for d in devices.values() if d["node"] == n
                 for t in d["forward_ms"] + d["backward_ms"]] for n in ("a", "b")}
    ratios = sorted(b / a for a, b in zip(times["a"], times["b"]))
    assert len(ratios) == 2 * 2 * 6
    # Under a busy suite the minima of the same blocks on identical devices came out up to 1.4x
    # apart (medians of these ratios of 1.50 and 2.80 at speed 0.5), so the emulated factor is 4,
    # and the bounds allow 0.6x-1.6x around it: an unslowed device (1.0, at most 1.6 under load)
    # still fails.
    assert 2.4 < statistics.median(ratios) < 6.4, ratios
    # Within a node: 20 ms latency and 1 Gbit/s, as emulated.
    assert [(e["src"], e["dst"], e["link"]) for e in doc["p2p"]] == [
        ("a:0", "a:1", "same_node"), ("b:0", "b:1", "same_node")]
    for e in doc["p2p"]:
        assert 20.0 <= e["latency_ms"] < 35.0, e
        assert 0.6 < e["bandwidth_gbps"] <= 1.0 and e["bytes"] == profiler.BANDWIDTH_BYTES, e
    # Between the nodes: once, through stage 0's replicas, at the emulated 10 ms.
    [link] = doc["links"]
    assert (link["src_node"], link["dst_node"], link["src_rank"], link["dst_rank"],
            link["link"]) == ("a", "b", 0, 2, "cross_node"), link
    assert 10.0 <= link["latency_ms"] < 25.0 and link["bytes"] == profiler.BANDWIDTH_BYTES, link
    # Replicas are on different nodes: a ring of two costs two 10 ms latencies on top.
    counts = doc["model"]["block_params"]
    assert [(e["stage"], e["group_size"], e["ranks"], e["bytes"]) for e in doc["allreduce"]] == [
        (0, 2, [0, 2], 4 * sum(counts[:3])), (1, 2, [1, 3], 4 * sum(counts[3:]))]
    assert all(20.0 <= e["ms"] < 40.0 for e in doc["allreduce"]), doc["allreduce"]
    # No scheduler: only the workers ran, and the CLI printed the tables and the next step.
    assert {p.name for p in (run_dir / "logs").glob("*.log")} == {f"{r}.log" for r in range(4)}
    for text in ("sdpipe profile: gpt_tiny", "per block", "p2p between pipeline neighbours",
                 "links between nodes", "a -> b", "all-reduce of a stage's weights",
                 f"sdpipe train pipeline.partition=auto profile={run_dir / 'profile.json'}"):
        assert text in out.stderr, text


def test_ctrl_c_stops_a_profile_at_once(run_dir):
    """A profile has no consistent point to wait for: the first Ctrl-C stops every process. (The
    command runs in this process, as a profile's launcher with its own handlers, interrupted
    from beside it.)"""
    last_blocks = run_dir / "logs" / "3.log"  # rank 3 measures its blocks last, then p2p starts

    def interrupt_after_blocks(command):
        command.wait_for(lambda: last_blocks.exists() and "blocks:" in last_blocks.read_text(),
                         timeout=120, what="rank 3's blocks")
        return interrupt_command()

    out, signalled = sdpipe_beside(interrupt_after_blocks, run_dir, "profile", f"run.dir={run_dir}",
                                   "cluster.device=cpu", "model=mlp",
                                   "cluster.links.same_node.latency_ms=300",  # p2p alone: > 30 s
                                   timeout=120)
    assert out.returncode == 130 and "interrupted; all processes stopped" in out.stderr, out.stderr
    assert time.monotonic() - signalled < 20
    assert not run_processes(run_dir) and not (run_dir / "profile.json").exists()
