"""``sdpipe profile`` in-process: the measuring plan, repeats, and the document it assembles
(the real command runs in tests/integration/test_profile_command.py)."""

from __future__ import annotations

import json

import pytest

from sdpipe_cli.cli import preparing
from sdpipe_cli.config import measurements
from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.schema import n_blocks
from sdpipe_cli.core.placement import Grid
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.hetero import profiler
from sdpipe_cli.model import models


def test_turns_cover_blocks_then_neighbours_then_replica_groups():
    plan = profiler.turns(Grid(3, 2))
    assert plan == [("blocks", [0]), ("blocks", [1]), ("blocks", [2]), ("blocks", [3]),
                    ("blocks", [4]), ("blocks", [5]),
                    ("p2p", [0, 1]), ("p2p", [2, 3]), ("p2p", [4, 5]),
                    ("allreduce", [0, 2]), ("allreduce", [0, 2, 4]),
                    ("allreduce", [1, 3]), ("allreduce", [1, 3, 5])]
    assert profiler.turns(Grid(1, 1)) == [("blocks", [0])]  # nothing to send, nobody to average with


def test_links_between_nodes_are_measured_once_per_pair_between_replicas_of_a_stage():
    grid = Grid(4, 2)  # ranks p * 2 + s
    one_node = profiler.node_pairs(grid, lambda r: "a")
    assert one_node == [] and profiler.turns(Grid(3, 2), one_node) == profiler.turns(Grid(3, 2))
    # a pipeline per node: each pair of nodes through stage 0's replicas, as group rounds cross
    per_pipeline = profiler.node_pairs(grid, lambda r: "abcd"[r // 2])
    assert per_pipeline == [(0, 2), (0, 4), (0, 6), (2, 4), (2, 6), (4, 6)]
    # stages on nodes of their own: no stage has replicas on both, so their lowest ranks
    assert profiler.node_pairs(grid, lambda r: "xy"[r % 2]) == [(0, 1)]
    assert ("link", [0, 2]) in profiler.turns(grid, per_pipeline)
    # past MAX_NODES_PAIRED nodes, each node with the first: N - 1 links, not N (N - 1) / 2
    many = Grid(profiler.MAX_NODES_PAIRED + 2, 1)
    star = profiler.node_pairs(many, lambda r: f"n{r}")
    assert star == [(0, r) for r in range(1, many.pipelines)]


def test_repeat_keeps_the_minimum_after_warmup_and_stops_on_budget():
    values = iter([100.0, 100.0, 5.0, 3.0, 9.0, 4.0, 8.0])  # two warm-ups, then timed repeats
    assert profiler.repeat(lambda: (next(values),), repeats=5, warmup=2) == [3.0]
    ticks = iter(range(100))  # each clock() call advances one second
    calls = []
    out = profiler.repeat(lambda: calls.append(1) or (len(calls), -len(calls)), repeats=50,
                           warmup=0, min_repeats=3, budget_s=0.5, clock=lambda: next(ticks))
    assert len(calls) == 3 and out == [1, -3]


def test_stage_weights_follow_the_partition():
    cfg, _, _ = preparing.prepare(compose(["model=mlp", "cluster.device=cpu",
                                       "pipeline.partition=[1]"]))
    counts, plan = models.block_param_counts(cfg.model), RunPlan.of(cfg)
    assert profiler.stage_weight_bytes(cfg.model, plan, 0, 0) == 4 * counts[0]
    assert profiler.stage_weight_bytes(cfg.model, plan, 1, 1) == 4 * sum(counts[1:])


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
                    "links": [],  # one node
                    "allreduce": [{"stage": rank, "group_size": 2, "ranks": [rank, rank + 2],
                                   "bytes": 1000, "ms": 0.5}] if rank < 2 else []})
    return out[::-1]  # arrival order does not matter


def test_assembled_document_loads_and_drives_auto_partition(tmp_path):
    cfg, _, _ = preparing.prepare(compose(["model=mlp", "cluster.device=cpu"]))
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
    auto, plan, _ = preparing.prepare(compose(["model=mlp", "cluster.device=cpu",
                                           "pipeline.partition=auto", f"profile={path}"]))
    assert plan is not None and auto.pipeline.partition == plan.bounds


def test_load_names_a_missing_measurement(tmp_path):
    cfg, _, _ = preparing.prepare(compose(["model=mlp", "cluster.device=cpu"]))
    doc = profiler.assemble(cfg, _results(cfg))
    doc["links"] = [dict(doc["p2p"][0], link="cross_node")]
    del doc["links"][0]["bandwidth_gbps"]
    (tmp_path / "profile.json").write_text(json.dumps(doc))
    with pytest.raises(measurements.ProfileError, match=r"links\[0\] lacks bandwidth_gbps"):
        measurements.load(tmp_path)
    del doc["links"]  # a profile written before links were measured still loads
    del doc["p2p"][1]["latency_ms"]
    (tmp_path / "profile.json").write_text(json.dumps(doc))
    with pytest.raises(measurements.ProfileError, match=r"p2p\[1\] lacks latency_ms"):
        measurements.load(tmp_path)


def test_auto_partition_of_interleaved_stages_balances_the_v_times_s_pieces(tmp_path):
    """With two chunks a stage the measured blocks are cut into four pieces, each timed on its
    stage's devices (here all alike): the slowest stage (its two pieces) costs less than
    uniform's."""
    cfg, _, _ = preparing.prepare(compose(["model=mlp", "cluster.device=cpu"]))
    path = measurements.write(profiler.assemble(cfg, _results(cfg)), tmp_path)
    auto, plan, _ = preparing.prepare(compose([
        "model=mlp", "cluster.device=cpu", "pipeline.schedule=interleaved_1f1b",
        "pipeline.chunks=2", "pipeline.partition=auto", f"profile={path}"]))
    assert plan is not None and list(auto.pipeline.partition) == plan.bounds
    assert len(plan.bounds) == 3 and len(plan.times) == 2  # four pieces; two stages' times
    costs = [3 * (b + 1) for b in range(6)]  # a block's forward and backward ms at speed 1
    edges = [0, *plan.bounds, 6]
    pieces = [sum(costs[a:b]) for a, b in zip(edges, edges[1:])]
    assert plan.times == pytest.approx([pieces[0] + pieces[2], pieces[1] + pieces[3]])
    assert max(plan.times) < max(plan.uniform_times)


def test_auto_partition_of_interleaved_stages_is_judged_as_a_replan_judges_it(tmp_path):
    """``partition=auto`` of interleaved stages on uneven devices (14 blocks, two stages at
    half and a quarter speed): the split the re-planner would call for at these speeds
    (``replan.called_for``: pieces judged by the iteration's timeline), here 1.11x quicker an
    iteration than the split that balances the stages' sums only (``[7, 8, 12]``)."""
    from sdpipe_cli.core import partition, replan
    from sdpipe_cli.core.plan import RunPlan

    model = ["model=mlp", "model.n_layers=12", "cluster.device=cpu"]
    cfg, _, _ = preparing.prepare(compose(model))
    path = measurements.write(profiler.assemble(cfg, _results(cfg)), tmp_path)
    auto, plan, _ = preparing.prepare(compose([
        *model, "pipeline.schedule=interleaved_zb", "pipeline.chunks=2", "pipeline.partition=auto",
        f"profile={path}", "cluster.pipelines=1",
        "cluster.nodes=[{name: n, devices: [{speed: 0.5}, {speed: 0.25}]}]"]))
    block_ms = measurements.worker_block_ms(measurements.load(path), RunPlan.of(auto).cluster,
                                            list(auto.cluster.slowdown))
    m = int(auto.pipeline.microbatches)
    wanted = replan.called_for(block_ms, own=False, chunks=2, microbatches=m, schedule="interleaved_zb")
    assert plan is not None and list(auto.pipeline.partition) == plan.bounds == wanted[0]
    sums = partition.plan_chunks(partition.device_cost(block_ms), 14, 2, 2).bounds  # unjudged
    judge = replan.slowest_iteration(block_ms, m, "interleaved_zb")
    assert judge(sums) > 1.1 * judge(plan.bounds)
