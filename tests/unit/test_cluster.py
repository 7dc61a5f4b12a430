"""Cluster descriptions: devices, placement, speed changes, links, and their config errors."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from sdpipe_cli.cli.parsing import main
from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.config.validation import validate
from sdpipe_cli.core.cluster import Cluster, ClusterError

TWO_NODES = ("cluster.pipelines=2", "pipeline.stages=2",
             "cluster.nodes=[{name: a, devices: [{speed: 1.0}, {speed: 1.0}]},"
             " {name: b, devices: [{speed: 0.5}, {speed: 0.5, memory: 4}]}]")


def cluster_of(*overrides: str) -> Cluster:
    cfg = compose(list(overrides))
    validate(cfg)
    return Cluster.from_config(cfg.cluster, cfg.pipeline.stages)


def test_without_nodes_every_worker_has_its_own_local_device():
    c = cluster_of("cluster.pipelines=3", "pipeline.stages=2")
    assert [[c.device(p, s).name for s in range(2)] for p in range(3)] == [
        ["local:0", "local:1"], ["local:2", "local:3"], ["local:4", "local:5"]]
    assert {d.speed for d in c.devices.values()} == {1.0}
    assert not c.links_emulated and c.nodes == ["local"]


def test_default_placement_keeps_a_pipeline_on_one_node():
    c = cluster_of(*TWO_NODES)
    assert c.placement == [["a:0", "a:1"], ["b:0", "b:1"]]
    assert c.device(1, 1).memory_gib == 4 and c.device(1, 0).speed == 0.5
    assert c.device_of_rank(3).name == "b:1"


def test_explicit_placement_is_used():
    c = cluster_of(*TWO_NODES, "cluster.placement=[[a:0, b:0], [a:1, b:1]]")
    assert c.device(0, 1).name == "b:0" and c.device(1, 0).name == "a:1"


@pytest.mark.parametrize("extra, key, words", [
    (("cluster.placement=[[a:0, a:1]]",), "cluster.placement", "2 lists"),
    (("cluster.placement=[[a:0, a:1], [b:0, c:9]]",), "cluster.placement", "no device 'c:9'"),
    (("cluster.placement=[[a:0, a:1], [a:1, b:1]]",), "cluster.placement", "holds two workers"),
    (("cluster.pipelines=3",), "cluster.nodes", "4 devices for P x S = 6"),
    (("cluster.changes=[{device: z:0, speed: 0.5}]",), "cluster.changes[0].device", "no device"),
    (("cluster.changes=[{device: a:0, speed: 0.5, start: 5, end: 2}]",), "cluster.changes[0].end",
     "must be after start"),
    (("cluster.changes=[{device: a:0, speed: 0}]",), "cluster.changes[0].speed", "positive"),
    (("cluster.links.cross_node.bandwidth_gbps=0",), "cluster.links.cross_node.bandwidth_gbps",
     "at least 1e-06"),
    (("cluster.links.same_node.latency_ms=-1",), "cluster.links.same_node.latency_ms", "in [0, 3.6e+06]"),
    (("cluster.links.same_node.latency_ms=3600001",), "cluster.links.same_node.latency_ms", "(an hour)"),
    (("cluster.stragglers.probability=1.5",), "cluster.stragglers.probability", "[0, 1]"),
    (("cluster.stragglers.factor=0.5",), "cluster.stragglers.factor", ">= 1.0"),
    (("cluster.stragglers.per=epoch",), "cluster.stragglers.per", "microbatch or iteration"),
    (("cluster.stragglers.devices=[q:1]",), "cluster.stragglers.devices", "no device 'q:1'"),
    (("cluster.emulation=fast",), "cluster.emulation", "choose one of"),
    (("cluster.emulation=modelled",), "cluster.emulation", "compute_ms or profile"),
    (("pipeline.partition=auto",), "pipeline.partition", "profile=PATH"),
    # a start before the run is the start's fault, not the end's
    (("cluster.changes=[{device: a:0, speed: 0.5, start: -5}]",), "cluster.changes[0].start",
     "is -5.0; must be >= 0"),
    (("cluster.changes=[{device: a:0, speed: 0.5, start: -5, end: 2}]",),
     "cluster.changes[0].start", "must be >= 0"),
    # factors a worker's sleep multiplies: past them it overflows the clock, or never ends
    (("cluster.changes=[{device: a:0, speed: 1e-300}]",), "cluster.changes[0].speed",
     "must be at least 0.01"),
    (("cluster.slowdown=[1,1e300]",), "cluster.slowdown", "factors must be in [1, 100]"),
    (("cluster.stragglers.probability=0.5", "cluster.stragglers.factor=1e300"),
     "cluster.stragglers.factor", "at most 100"),
    (("cluster.emulation=modelled", "cluster.compute_ms=1e15"), "cluster.compute_ms",
     "at most 60000 ms"),
])
def test_bad_cluster_names_the_key(extra, key, words):
    cfg = compose([*TWO_NODES, *extra])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.key == key and words in err.value.reason


def test_bad_device_fields_name_the_device():
    for field, value in (("speed", 0), ("speed", 1e-300), ("memory", -1)):
        cfg = compose(["cluster.pipelines=1", "pipeline.stages=1",
                       f"cluster.nodes=[{{name: a, devices: [{{{field}: {value}}}]}}]"])
        with pytest.raises(ConfigError) as err:
            validate(cfg)
        assert err.value.key == f"cluster.nodes[0].devices[0].{field}"


def test_duplicate_or_empty_nodes_are_rejected():
    cfg = compose(["cluster.pipelines=1", "pipeline.stages=1",
                   "cluster.nodes=[{name: a, devices: [{speed: 1}]}, {name: a, devices: [{}]}]"])
    with pytest.raises(ConfigError, match="names two nodes"):
        validate(cfg)
    cfg = compose(["cluster.pipelines=1", "pipeline.stages=1", "cluster.nodes=[{name: a}]"])
    with pytest.raises(ConfigError, match="has no devices"):
        validate(cfg)


def test_faster_than_measured_needs_modelled_compute():
    fast = "cluster.nodes=[{name: a, devices: [{speed: 2.0}, {speed: 1.0}]}]"
    with pytest.raises(ConfigError) as err:
        validate(compose(["cluster.pipelines=1", fast]))
    assert err.value.key == "cluster.nodes" and "modelled" in err.value.reason
    validate(compose(["cluster.pipelines=1", fast, "cluster.compute_ms=5"]))  # auto -> modelled


def test_bad_cluster_on_the_command_line_is_one_line_exit_2(capsys):
    rc = main(["train", *TWO_NODES, "cluster.placement=[[a:0, a:1], [b:0, x:1]]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("sdpipe: error: cluster.placement: no device 'x:1'")


def test_scheduled_changes_replace_the_speed_while_active():
    c = cluster_of(*TWO_NODES, "cluster.changes=[{device: b:1, speed: 0.25, start: 10, end: 20},"
                   " {device: a:0, speed: 0.1, start: 5}]")
    b1, a0, a1 = c.devices["b:1"], c.devices["a:0"], c.devices["a:1"]
    assert [c.speed(b1, t) for t in (0, 9.99, 10, 19.99, 20, 100)] == [0.5, 0.5, 0.25, 0.25, 0.5, 0.5]
    assert [c.speed(a0, t) for t in (0, 5, 1e6)] == [1.0, 0.1, 0.1]
    assert c.speed(a1, 7) == 1.0
    assert c.change_points(b1) == [10, 20] and c.change_points(a1) == []


def test_changes_timed_in_iterations_follow_the_pipelines_step_not_the_clock():
    c = cluster_of(*TWO_NODES, "cluster.changes=[{device: b:1, speed: 0.25, start_step: 3, "
                   "end_step: 5}, {device: a:0, speed: 0.1, start_step: 0}]")
    b1, a0 = c.devices["b:1"], c.devices["a:0"]
    assert [c.speed(b1, 1e6, k) for k in (0, 2, 3, 4, 5, 9)] == [0.5, 0.5, 0.25, 0.25, 0.5, 0.5]
    assert c.speed(b1, 1e6) == 0.5  # no iteration known (the profiler, a report): as planned
    assert [c.speed(a0, 0.0, k) for k in (0, 1000)] == [0.1, 0.1]
    assert c.change_points(b1) == [3, 5]  # its speed changes during the run


@pytest.mark.parametrize("change, key, says", [
    ("{device: b:1, speed: 0.5, start: 4, start_step: 3}", "cluster.changes[0].start_step", "not both"),
    ("{device: b:1, speed: 0.5, end_step: 3}", "cluster.changes[0].end_step", "needs start_step"),
    ("{device: b:1, speed: 0.5, start_step: -1}", "cluster.changes[0].start_step", "must be >= 0"),
    ("{device: b:1, speed: 0.5, start_step: 4, end_step: 4}", "cluster.changes[0].end_step",
     "must be after start_step"),
])
def test_a_change_timed_both_ways_or_backwards_is_refused_naming_its_key(change, key, says):
    with pytest.raises(ConfigError) as err:
        validate(compose([*TWO_NODES, f"cluster.changes=[{change}]"]))
    assert err.value.key == key and says in err.value.reason


def test_links_by_node_and_ring_allreduce_time():
    c = cluster_of(*TWO_NODES, "cluster.links.same_node.latency_ms=1",
                   "cluster.links.cross_node.latency_ms=10",
                   "cluster.links.cross_node.bandwidth_gbps=8")  # 1e9 bytes/s
    assert c.links_emulated
    assert c.link(0, 1).kind == "same_node" and c.link(0, 2).kind == "cross_node"
    assert c.link(0, 1).transfer_s(10**9) == pytest.approx(0.001)  # no bandwidth limit given
    assert c.link(1, 3).transfer_s(10**6) == pytest.approx(0.010 + 0.001)
    # ring over 2 members on two nodes: 2 latencies + 2(n-1)/n x size / bandwidth
    assert c.allreduce_s([0, 2], 10**6) == pytest.approx(2 * 0.010 + 1.0 * 10**6 / 1e9)
    assert c.allreduce_s([0], 10**6) == 0.0
    assert c.allreduce_s([0, 1], 10**6) == pytest.approx(2 * 0.001)


def test_from_config_raises_cluster_error_for_direct_use():
    cfg = OmegaConf.merge(compose(list(TWO_NODES)), {"cluster": {"placement": [["a:0"]]}})
    with pytest.raises(ClusterError) as err:
        Cluster.from_config(cfg.cluster, 2)
    assert err.value.key == "cluster.placement"


@pytest.mark.parametrize("option", ["local", "hetero_static", "hetero_random", "hetero_mixed",
                                    "slow_links"])
def test_example_clusters_describe_what_they_say(option):
    c = cluster_of(f"cluster={option}")
    speeds = [[c.device(p, s).speed for s in range(c.stages)] for p in range(c.pipelines)]
    if option == "hetero_static":  # one pipeline three times slower
        assert sorted(round(1 / min(row), 2) for row in speeds) == [1.0, 1.0, 3.0]
    if option == "hetero_mixed":
        assert c.links["cross_node"].emulated and len(c.nodes) == 2 and c.changes
    if option == "slow_links":  # one pipeline per machine: a stage's replicas meet across them
        assert len(c.nodes) == 4 and c.links["cross_node"].bandwidth == 0.015e9 / 8
        assert c.slowest_link(list(range(0, 8, 2))).kind == "cross_node"
        assert [row[0].split(":")[0] for row in c.placement] == ["a", "b", "c", "d"]


def test_default_placement_spreads_pipelines_over_nodes():
    c = cluster_of("cluster=gpu_2node", "run.node=node0", "run.port=29500")
    assert c.placement == [["node0:0", "node0:1"], ["node1:0", "node1:1"]]
    assert c.real and c.ranks_on("node1") == [2, 3]
    c = cluster_of("cluster=hetero_static")  # fast: 4 devices, slow: 2
    assert c.placement == [["fast:0", "fast:1"], ["fast:2", "fast:3"], ["slow:0", "slow:1"]]
    # no node can hold a pipeline: free devices in node order
    c = cluster_of("cluster.pipelines=2", "pipeline.stages=2",
                   "cluster.nodes=[{name: a, devices: [{}]}, {name: b, devices: [{}, {}, {}]}]")
    assert c.placement == [["b:0", "b:1"], ["a:0", "b:2"]]


@pytest.mark.parametrize("extra, key", [
    (("run.port=29500",), "run.node"),
    (("run.node=node7", "run.port=29500"), "run.node"),
    (("run.node=node0",), "run.port"),
    (("run.node=node0", "run.port=29500", "fault.on_pipeline_loss=restart",  # splits pipelines
      "cluster.placement=[[node0:0, node1:0], [node0:1, node1:1]]"), "fault.on_pipeline_loss"),
    (("run.node=node0", "run.port=29500", "sync=allreduce", "checkpoint.every=5",
      "fault.on_failure=restart"), "fault.on_failure"),
    (("run.node=node0", "run.port=29500", "cluster.nodes.1.host=null"), "cluster.nodes[1].host"),
])
def test_real_nodes_need_their_launch_settings(extra, key):
    with pytest.raises(ConfigError) as err:
        validate(compose(["cluster=gpu_2node", *extra]))
    assert err.value.key == key


def test_a_lost_pipeline_across_real_nodes_is_handled_when_each_pipeline_is_on_one_node():
    for loss in ("continue", "restart"):
        validate(compose(["cluster=gpu_2node", "run.node=node0", "run.port=29500",
                          f"fault.on_pipeline_loss={loss}"]))
    assert cluster_of("cluster=gpu_2node", "run.node=node0", "run.port=29500",
                      "cluster.placement=[[node0:0, node1:0], [node0:1, node1:1]]"
                      ).split_pipelines() == [0, 1]


def test_run_node_is_only_for_real_nodes():
    with pytest.raises(ConfigError) as err:
        validate(compose(["run.node=a"]))
    assert err.value.key == "run.node"
