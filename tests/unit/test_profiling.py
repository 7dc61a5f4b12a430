"""``sdpipe profile``: the measuring plan and document in-process, then one real 2x2 CPU profile.

The end-to-end run emulates a heterogeneous cluster (node b's devices at speed 0.5, 20 ms and
1 Gbit/s within a node, 10 ms across nodes), so one run shows every field of profile.json and that
each emulated quantity reaches its measurement. Ratios are taken within that run: the machine is
shared, so absolute times are not comparable between runs.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from conftest import run_processes, sdpipe, sdpipe_popen
from sdpipe_cli.runtime import launcher
from sdpipe_cli.training import models
from sdpipe_cli.hetero import measurements, profiler
from sdpipe_cli.config.schema import compose, n_blocks

HETERO = ("cluster.device=cpu",
          "cluster.nodes=[{name: a, devices: [{speed: 1.0}, {speed: 1.0}]}, "
          "{name: b, devices: [{speed: 0.5}, {speed: 0.5}]}]",
          "cluster.links.same_node.latency_ms=20", "cluster.links.same_node.bandwidth_gbps=1",
          "cluster.links.cross_node.latency_ms=10")


# -- in-process: plan, repeats, document ---------------------------------------------------------
def test_turns_cover_blocks_then_neighbours_then_replica_groups():
    plan = profiler.turns(3, 2)
    assert plan == [("blocks", [0]), ("blocks", [1]), ("blocks", [2]), ("blocks", [3]),
                    ("blocks", [4]), ("blocks", [5]),
                    ("p2p", [0, 1]), ("p2p", [2, 3]), ("p2p", [4, 5]),
                    ("allreduce", [0, 2]), ("allreduce", [0, 2, 4]),
                    ("allreduce", [1, 3]), ("allreduce", [1, 3, 5])]
    assert profiler.turns(1, 1) == [("blocks", [0])]  # nothing to send, nobody to average with


def test_repeat_keeps_the_minimum_after_warmup_and_stops_on_budget():
    values = iter([100.0, 100.0, 5.0, 3.0, 9.0, 4.0, 8.0])  # two warm-ups, then timed repeats
    assert profiler.repeat(lambda: (next(values),), repeats=5, warmup=2) == [3.0]
    ticks = iter(range(100))  # each clock() call advances one second
    calls = []
    out = profiler.repeat(lambda: calls.append(1) or (len(calls), -len(calls)), repeats=50,
                           warmup=0, min_repeats=3, budget_s=0.5, clock=lambda: next(ticks))
    assert len(calls) == 3 and out == [1, -3]


def test_stage_weights_follow_the_partition():
    cfg, _ = launcher.prepare(compose(["model=mlp", "cluster.device=cpu",
                                       "pipeline.partition=[1]"]))
    counts = models.block_param_counts(cfg.model)
    assert profiler.stage_weight_bytes(cfg, 0) == 4 * counts[0]
    assert profiler.stage_weight_bytes(cfg, 1) == 4 * sum(counts[1:])


def _results(cfg) -> list[dict]:
    """What four profiling workers would report: device 1 twice as slow as the others."""
    blocks, out = n_blocks(cfg.model), []
    for rank in range(4):
        slow = 2.0 if rank == 1 else 1.0
        out.append({"device": {"name": f"local:{rank}", "node": "local", "speed": 1 / slow,
                               "rank": rank, "pipeline": rank // 2, "stage": rank % 2,
                               "forward_ms": [slow * (b + 1) for b in range(blocks)],
                               "backward_ms": [2 * slow * (b + 1) for b in range(blocks)],
                               "peak_memory_mb": 300.0, "memory_source": "rss"},
                    "p2p": [{"src": f"local:{rank}", "dst": f"local:{rank + 1}", "src_rank": rank,
                             "dst_rank": rank + 1, "link": "same_node", "latency_ms": 0.1,
                             "bandwidth_gbps": 10.0, "bytes": 4 << 20}] if rank % 2 == 0 else [],
                    "allreduce": [{"stage": rank, "group_size": 2, "ranks": [rank, rank + 2],
                                   "bytes": 1000, "ms": 0.5}] if rank < 2 else []})
    return out[::-1]  # arrival order does not matter


def test_assembled_document_loads_and_drives_auto_partition(tmp_path):
    cfg, _ = launcher.prepare(compose(["model=mlp", "cluster.device=cpu"]))
    path = measurements.write(profiler.assemble(cfg, _results(cfg)), tmp_path)
    doc = measurements.load(path)
    assert [d["rank"] for d in doc["devices"]] == [0, 1, 2, 3]
    assert doc["model"]["block_names"] == ["embedding", "layer1", "layer2", "layer3", "layer4",
                                           "head"]
    assert doc["model"]["microbatch_size"] == 4  # train.batch_size 16 over 4 micro-batches
    assert doc["model"]["activation_bytes"] == 4 * 16 * 32 * 4  # mlp: seq_len 16, d_model 32
    # A measured device keeps its times; an unmeasured one gets the median, at its own speed.
    assert measurements.block_costs(doc, "local:1", 0.5)[0] == [2.0 * (b + 1) for b in range(6)]
    assert measurements.block_costs(doc, "elsewhere:0", 2.0)[0] == [(b + 1) / 2 for b in range(6)]
    auto, plan = launcher.prepare(compose(["model=mlp", "cluster.device=cpu",
                                           "pipeline.partition=auto", f"profile={path}"]))
    assert plan is not None and auto.pipeline.partition == plan.bounds


def test_load_names_a_missing_measurement(tmp_path):
    cfg, _ = launcher.prepare(compose(["model=mlp", "cluster.device=cpu"]))
    doc = profiler.assemble(cfg, _results(cfg))
    del doc["p2p"][1]["latency_ms"]
    (tmp_path / "profile.json").write_text(json.dumps(doc))
    with pytest.raises(measurements.ProfileError, match=r"p2p\[1\] lacks latency_ms"):
        measurements.load(tmp_path)


# -- the command -----------------------------------------------------------------------------------
@pytest.mark.multiprocess
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
        ("a:0", 0, 0, 1.0), ("a:1", 0, 1, 1.0), ("b:0", 1, 0, 0.5), ("b:1", 1, 1, 0.5)]
    for d in doc["devices"]:
        assert all(t > 0 for t in d["forward_ms"] + d["backward_ms"])
        assert d["memory_source"] == "rss" and 50 < d["peak_memory_mb"] < 4000
    # Speed 0.5 takes twice the time: compare the same blocks on both nodes, measured in one run.
    total = {n: sum(sum(d["forward_ms"]) + sum(d["backward_ms"]) for d in devices.values()
                    if d["node"] == n) for n in ("a", "b")}
    assert 1.5 < total["b"] / total["a"] < 2.7, total
    # Within a node: 20 ms latency and 1 Gbit/s, as emulated.
    assert [(e["src"], e["dst"], e["link"]) for e in doc["p2p"]] == [
        ("a:0", "a:1", "same_node"), ("b:0", "b:1", "same_node")]
    for e in doc["p2p"]:
        assert 20.0 <= e["latency_ms"] < 35.0, e
        assert 0.6 < e["bandwidth_gbps"] <= 1.0 and e["bytes"] == profiler.BANDWIDTH_BYTES, e
    # Replicas are on different nodes: a ring of two costs two 10 ms latencies on top.
    counts = doc["model"]["block_params"]
    assert [(e["stage"], e["group_size"], e["ranks"], e["bytes"]) for e in doc["allreduce"]] == [
        (0, 2, [0, 2], 4 * sum(counts[:3])), (1, 2, [1, 3], 4 * sum(counts[3:]))]
    assert all(20.0 <= e["ms"] < 40.0 for e in doc["allreduce"]), doc["allreduce"]
    # No scheduler: only the workers ran, and the CLI printed the tables and the next step.
    assert {p.name for p in (run_dir / "logs").glob("*.log")} == {f"{r}.log" for r in range(4)}
    for text in ("sdpipe profile: gpt_tiny", "per block", "p2p between pipeline neighbours",
                 "all-reduce of a stage's weights",
                 f"sdpipe train pipeline.partition=auto profile={run_dir / 'profile.json'}"):
        assert text in out.stderr, text


@pytest.mark.multiprocess
def test_ctrl_c_stops_a_profile_at_once(run_dir):
    """A profile has no consistent point to wait for: the first Ctrl-C stops every process."""
    proc = sdpipe_popen("profile", f"run.dir={run_dir}", "cluster.device=cpu", "model=mlp",
                        "cluster.links.same_node.latency_ms=300")  # p2p alone would take > 30 s
    deadline = time.monotonic() + 120
    last_blocks = run_dir / "logs" / "3.log"  # rank 3 measures its blocks last, then p2p starts
    while not (last_blocks.exists() and "blocks:" in last_blocks.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    except Exception:
        proc.kill()
        raise
    assert proc.returncode == 130 and "interrupted; all processes stopped" in err, err
    assert time.monotonic() - signalled < 20
    assert not run_processes(run_dir) and not (run_dir / "profile.json").exists()


@pytest.mark.parametrize("override, key", [
    ("model=huge", "model: no option 'huge'"),
    ("cluster.links.same_node.latency_ms=-1", "cluster.links.same_node.latency_ms: must be >= 0"),
    ("cluster.pipelines=0", "cluster.pipelines: must be at least 1"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, override, key):
    out = sdpipe("profile", f"run.dir={tmp_path / 'never'}", override, timeout=60)
    assert out.returncode == 2
    assert out.stderr.startswith(f"sdpipe: error: {key}"), out.stderr
    assert out.stderr.count("\n") == 1  # one line, no traceback
    assert not (tmp_path / "never").exists()


def test_help_names_the_document():
    out = sdpipe("profile", "--help", timeout=60)
    assert out.returncode == 0 and "profile.json" in out.stdout and "cluster" in out.stdout
