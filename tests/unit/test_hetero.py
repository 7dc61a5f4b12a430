"""Heterogeneity emulation: speeds, stragglers, links, memory limits, and whether they are honest."""

from __future__ import annotations

import json
import time

import pytest
import torch

from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.settings import settings_of
from sdpipe_cli.config.validation import validate
from sdpipe_cli.core.cluster import Cluster, Device, SpeedChange
from sdpipe_cli.core.schedule import Action, one_f_one_b
from sdpipe_cli.hetero.emulation import (
    EmulatedSlowdown,
    EmulatedStragglers,
    MemoryLimit,
    MemoryLimitExceeded,
    link_delay,
    make_slowdown,
)


@pytest.mark.parametrize("q", [0.0, 0.1, 0.3, 1.0])
def test_stragglers_appear_at_the_configured_rate(q):
    gen = EmulatedStragglers(q, 3.0, seed="0/local:1")
    draws = [gen.draw() for _ in range(20_000)]
    assert set(draws) <= {1.0, 3.0}
    assert draws.count(3.0) / len(draws) == pytest.approx(q, abs=0.01)


def test_stragglers_are_reproducible_and_differ_per_seed():
    a, b, c = (EmulatedStragglers(0.2, 2.0, seed=s) for s in ("0/x:0", "0/x:0", "0/x:1"))
    seq = [[g.draw() for _ in range(200)] for g in (a, b, c)]
    assert seq[0] == seq[1] and seq[0] != seq[2]


def test_speed_straggler_and_static_factor_multiply():
    slept = []
    hook = EmulatedSlowdown(2.0, compute_ms=10, sleep=slept.append, speed=lambda: 0.5,
                    stragglers=EmulatedStragglers(1.0, 3.0))
    hook(Action("F", 0), 0.001)
    assert slept == [pytest.approx(0.010 * 2.0 / 0.5 * 3.0 - 0.001)]
    assert hook.straggled == 1 and hook.actions == 1


def test_per_iteration_stragglers_slow_every_action_of_the_iteration():
    slept = []
    hook = EmulatedSlowdown(compute_ms=10, sleep=slept.append, stragglers=EmulatedStragglers(0.5, 4.0, seed=1),
                    per_iteration=True)
    factors = []
    for _ in range(50):
        hook.new_iteration()
        before = len(slept)
        actions = one_f_one_b(2, 2, 0)
        for a in actions:
            hook(a, 0.0)
        # every action of one iteration got the same factor (forward 10 ms, backward 20 ms)
        ratios = {round(x / (0.02 if a.kind == "B" else 0.01), 6)
                  for a, x in zip(actions, slept[before:])}
        factors.append(ratios)
    assert all(len(r) == 1 for r in factors)
    assert {next(iter(r)) for r in factors} == {1.0, 4.0}


def test_speed_is_read_at_every_action():
    now = [0.0]
    cluster = Cluster([Device("n:0", "n", 0)], [["n:0"]],
                      changes=[SpeedChange("n:0", 0.25, 10.0, 20.0)])
    hook = EmulatedSlowdown(compute_ms=10, sleep=lambda s: None,
                    speed=lambda: cluster.speed(cluster.device(0, 0), now[0]))
    assert hook.target(Action("F", 0), 0.0) == pytest.approx(0.010)
    now[0] = 15.0
    assert hook.target(Action("F", 0), 0.0) == pytest.approx(0.040)
    now[0] = 25.0
    assert hook.target(Action("B", 0), 0.0) == pytest.approx(0.020)


def test_inactive_hook_is_not_installed():
    assert not EmulatedSlowdown().active
    assert EmulatedSlowdown(speed=lambda: 0.5).active and EmulatedSlowdown(compute_ms=1).active
    assert EmulatedSlowdown(dynamic=True).active


def test_link_delay_sleeps_the_links_transfer_time():
    cfg = compose(["cluster.pipelines=2", "pipeline.stages=2",
                   "cluster.nodes=[{name: a, devices: [{}, {}]}, {name: b, devices: [{}, {}]}]",
                   "cluster.links.same_node.latency_ms=30", "cluster.links.cross_node.latency_ms=80"])
    validate(cfg)
    cluster = Cluster.from_config(cfg.cluster, 2)
    hook = link_delay(cluster, 0)
    for dst, at_least in ((1, 0.030), (2, 0.080)):
        start = time.perf_counter()
        hook(dst, torch.zeros(4))
        assert time.perf_counter() - start >= at_least
    assert link_delay(Cluster.from_config(compose([]).cluster, 2), 0) is None


def test_make_slowdown_reads_the_cluster_and_the_profile(tmp_path):
    blocks = 6  # gpt_tiny: embedding, 4 layers, head
    doc = {"format": "sdpipe-profile/1", "model": {"name": "gpt_tiny", "blocks": blocks,
                                                   "microbatch_size": 4},
           "cluster": {}, "p2p": [], "allreduce": [],
           "devices": [{"name": "x:0", "node": "x", "speed": 0.5, "rank": 0, "pipeline": 0,
                        "stage": 0, "forward_ms": [2.0] * blocks, "backward_ms": [4.0] * blocks,
                        "peak_memory_mb": 1.0, "memory_source": "rss"}]}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    cfg = compose(["cluster.emulation=modelled", f"profile={path}", "pipeline.partition=[2]",
                   "cluster.nodes=[{name: n, devices: [{}, {speed: 0.5}, {}, {}]}]",
                   "cluster.stragglers.probability=0.5", "cluster.stragglers.devices=[n:1]"])
    validate(cfg)
    cluster = Cluster.from_config(cfg.cluster, 2)
    s0 = make_slowdown(settings_of(cfg), cluster, 0, 0, clock=lambda: 0.0)
    s1 = make_slowdown(settings_of(cfg), cluster, 0, 1, clock=lambda: 0.0)
    # an unmeasured device: the profile's median at speed 1.0 (2 ms x 0.5) per block
    assert s0.forward_s == pytest.approx(2 * 0.001) and s0.backward_s == pytest.approx(2 * 0.002)
    assert s1.forward_s == pytest.approx(4 * 0.001) and s1.speed() == 0.5
    assert s0.stragglers is None and s1.stragglers is not None


def test_cpu_memory_limit_names_the_device():
    ok = MemoryLimit(Device("n:0", "n", 0, memory_gib=64.0), torch.device("cpu"))
    ok.check()
    assert ok.peak_mb() > 1
    tight = MemoryLimit(Device("n:1", "n", 1, memory_gib=0.001), torch.device("cpu"))
    with pytest.raises(MemoryLimitExceeded, match="device n:1 is limited to 0.001 GiB"):
        tight.check()
    MemoryLimit(Device("n:2", "n", 2), torch.device("cpu")).check()  # no limit: never raises
