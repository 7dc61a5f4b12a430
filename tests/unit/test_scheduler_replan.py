"""``fault.on_slowdown=replan`` in the scheduler, on a real TCPStore with an injected clock: a
device named slow leads to a ``replan`` line either way, and only where moving pays to a stop
request and the next leg's split in the progress snapshot."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from sdpipe_cli.cli.run_loop import carry_slowdowns
from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.validation import validate
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.data import sources
from sdpipe_cli.model import memory
from sdpipe_cli.runtime import protocol, store
from sdpipe_cli.sync.scheduler.handling import Scheduler
from tests.helpers import event, make_doc, metrics

P, S, BLOCKS = 2, 2, 6


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def scheduler(tmp_path, sync: str, *overrides: str, forward_ms=(3.0,) * BLOCKS, blocks: int = 0):
    """A scheduler of the run; ``blocks``: the model's, as a prepared plan knows them (a re-plan
    in place needs them)."""
    doc = make_doc({"n:0": (1.0, list(forward_ms))}, model="mlp")
    doc["model"]["block_params"] = [1000] * BLOCKS
    (tmp_path / "profile.json").write_text(json.dumps(doc))
    cfg = compose(["model=mlp", "data=synthetic", f"sync={sync}", f"cluster.pipelines={P}",
                   f"pipeline.stages={S}", "train.steps=1000", "pipeline.partition=[3]",
                   "cluster.emulation=modelled", f"profile={tmp_path / 'profile.json'}",
                   "cluster.nodes=[{name: n, devices: [{}, {}, {}, {}]}]",
                   "fault.on_slowdown=replan", *overrides])
    validate(cfg)
    cfg.run.dir = str(tmp_path)
    cfg.plan = RunPlan.resolve(cfg, blocks=blocks).section()
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    clock = Clock()
    events = store.namespace(master)
    return Scheduler(cfg, tmp_path, events, clock=clock), events, clock, master


def steps(sched, clock, first: int, last: int, slow: dict[int, float]):
    """Iterations first..last of every worker; rank r's compute is 0.1 s times ``slow[r]``."""
    for k in range(first, last + 1):
        clock.t += 1.0
        for r in range(P * S):
            sched.handle(event(type="step", rank=r, pipeline=r // S, stage=r % S, step=k,
                               samples=16 * k, samples_per_s=10.0, step_s=0.6, loss=2.0,
                               time=clock.t, busy_s=0.1 * slow.get(r, 1.0)))


@pytest.mark.parametrize("sync", ["allreduce", "sdpipe"])
def test_a_slow_device_is_replanned_where_it_pays(tmp_path, sync):
    sched, events, clock, _ = scheduler(tmp_path, sync)
    for r in range(P * S):
        sched.handle(event(type="start", rank=r, pipeline=r // S, stage=r % S, pid=1, time=0.0))
    steps(sched, clock, 1, 12, {})
    steps(sched, clock, 13, 30, {1: 4.0})  # pipeline 0's stage 1 (device n:1) at a quarter
    sched.metrics.close()
    named = metrics(tmp_path, "straggler")
    assert [(m["device"], m["pipeline"], m["stage"]) for m in named] == [("n:1", 0, 1)]
    [line] = metrics(tmp_path, "replan")
    assert line["device"] == "n:1" and line["partition"] == [3] and line["go"] is True
    assert events.check([store.STOP_REQUESTED])
    summary = sched.summary()
    assert summary["replan"]["slowed"] == {"p0s1": pytest.approx(4.0, rel=0.01)}
    # 3 blocks at 4x on the slow stage: it keeps 1 block and the other stage takes 5
    # 9 ms a block a micro-batch, m=4: the slow pipeline's iteration 27 + 108 + 3 x 108 = 459 ms
    # -> 45 + 36 + 3 x 45 = 216 ms, the other's 135 -> 189 ms
    if sync == "allreduce":  # lock-step: one split for all; the slowest is everyone's pace
        assert line["proposed"] == [5]
        assert line["rate_new"] == pytest.approx(line["rate_now"] * 459 / 216, rel=1e-3)
        assert summary["replan"]["partition"] == [5] and summary["replan"]["partitions"] == {}
    else:  # sdpipe: only the slowed pipeline is split anew, the other keeps its 135 ms
        assert line["proposed"] == [[5], [3]]
        gain = (1 / 135 + 1 / 216) / (1 / 135 + 1 / 459)
        assert line["rate_new"] == pytest.approx(line["rate_now"] * gain, rel=1e-3)
        assert summary["replan"]["partition"] == [3]
        assert summary["replan"]["partitions"] == {0: [5]}


def test_sdpipe_re_splits_the_slowed_pipeline_in_place_while_the_other_goes_on(tmp_path):
    """With the blocks known (per-block segments), the re-plan of pipeline 0 does not stop the
    run: the snapshot asks the launcher to restart it on [5]. Its old workers' events follow the
    old split until it is back; then its split is in the store for its new incarnation, block 4
    lies on its stage 0, the run's config and checkpoints say [5], and once it is live again the
    next re-plan may go."""
    sched, events, clock, _ = scheduler(tmp_path, "sdpipe", blocks=BLOCKS)
    assert sched.segments.count == BLOCKS
    for r in range(P * S):
        sched.handle(event(type="start", rank=r, pipeline=r // S, stage=r % S, pid=1, time=0.0))
    steps(sched, clock, 1, 12, {})
    steps(sched, clock, 13, 30, {1: 4.0})
    [line] = metrics(tmp_path, "replan")
    assert line["go"] is True and line["proposed"] == [[5], [3]] and line["in_place"] == [0]
    assert not events.check([store.STOP_REQUESTED])
    snapshot = sched.summary()
    assert "replan" not in snapshot  # the run does not stop for it
    assert snapshot["resplit"]["version"] == 1 and snapshot["resplit"]["partitions"] == {"0": [5]}
    assert snapshot["resplit"]["slowed"] == {"p0s1": pytest.approx(4.0, rel=0.01)}
    assert store.read(events, store.split_key(0), protocol.Split) is None  # not back yet
    with pytest.raises(protocol.ProtocolError):  # block 4 is still on stage 1 (rank 1)
        sched.handle(protocol.Rejoin(rank=0, pipeline=0, stage=4, incarnation=0))
    sched.handle(protocol.Lost(rank=0, pipeline=0, reason="re-split to [5]", restart=True))
    sched.handle(protocol.Restart(rank=0, pipeline=0, incarnation=1, restart=0, resplit=True))
    assert store.read(events, store.split_key(0), protocol.Split) == protocol.Split(0, 1, [5])
    sched.handle(protocol.Rejoin(rank=1, pipeline=0, stage=4, incarnation=0))  # stale: dropped
    sched.handle(protocol.Rejoin(rank=0, pipeline=0, stage=4, incarnation=1))
    assert (4, 0) in sched.rejoining and sched.restarts == 0  # a re-split is no restart
    manifest_cfg = sched.checkpoints.cfg  # what the checkpoints' manifests record from now on
    assert dict(manifest_cfg.pipeline.partitions) == {0: [5]} and manifest_cfg.fault.slowed["p0s1"] > 3
    assert dict(sched.cfg.pipeline.partitions) == {}  # the run's config itself is left as it was
    assert sched.checkpoints.plan.partition_of(0) == [5]
    assert sched.replanning.partitions == [[5], [3]]
    sched.replanning.release(frozenset({1}))  # not healed yet: no other re-plan
    assert sched.replanning.chosen is not None
    sched.replanning.release(frozenset({0, 1}))
    assert sched.replanning.chosen is None
    sched.metrics.close()


@pytest.mark.parametrize("sync", ["allreduce", "sdpipe"])
def test_a_split_that_would_not_fit_a_device_is_declined_before_the_stop(tmp_path, sync):
    """Device n:0 declares memory between what its stage needs with 3 blocks and with 5: the
    re-plan that pays is declined, naming it, and the run is not stopped."""
    (tmp_path / "probe").mkdir()
    probe, *_ = scheduler(tmp_path / "probe", sync)
    cfg, plan = probe.replanning.memory_of
    example = sources.example(cfg, plan.microbatch_size, device="meta")[0]
    now, then = (memory.estimate(cfg, example, bounds)[0].total for bounds in ([3], [5]))
    assert now < then
    limit = (now + then) / 2 / memory.GIB
    devices = f"[{{memory: {limit}}}, {{}}, {{}}, {{}}]"
    sched, events, clock, _ = scheduler(tmp_path, sync, f"cluster.nodes=[{{name: n, devices: {devices}}}]")
    for r in range(P * S):
        sched.handle(event(type="start", rank=r, pipeline=r // S, stage=r % S, pid=1, time=0.0))
    steps(sched, clock, 1, 12, {})
    steps(sched, clock, 13, 30, {1: 4.0})
    sched.metrics.close()
    lines = metrics(tmp_path, "replan")
    assert lines and all(not line["go"] for line in lines)
    assert lines[0]["proposed"] in ([5], [[5], [3]])
    assert lines[0]["reason"].startswith("the new split does not fit: stage 0 of pipeline 0 needs about")
    assert f"its device n:0 has {limit:g} GiB" in lines[0]["reason"]
    assert not events.check([store.STOP_REQUESTED])
    assert sched.summary().get("replan") is None


def test_a_second_leg_starts_from_the_slowdowns_measured_before(tmp_path):
    """The leg after a re-plan knows device n:1 at a quarter (``fault.slowed``): its split is
    the one those speeds call for, so nothing more is proposed when another device slows a
    little."""
    sched, events, clock, _ = scheduler(tmp_path, "allreduce", "pipeline.partition=[5]",
                                        "+fault.slowed.p0s1=4.0")
    steps(sched, clock, 1, 12, {})
    steps(sched, clock, 13, 30, {3: 2.0})  # pipeline 1's stage 1 at half speed
    sched.metrics.close()
    [line] = metrics(tmp_path, "replan")
    assert line["partition"] == [5] and line["go"] is False
    assert not events.check([store.STOP_REQUESTED])


def test_a_given_split_is_not_taken_back_for_a_slowdown_that_does_not_change_the_advice(tmp_path):
    """``pipeline.partition=[3]`` against a profile whose last block is 10x the others, which
    advises [5]: pipeline 1's first stage slows by 1.6, and the split those speeds call for is
    still [5] (it would be worth 10 % in lock-step): the run's own split stays, and the line
    says why."""
    sched, events, clock, _ = scheduler(tmp_path, "allreduce",
                                        forward_ms=(3.0, 3.0, 3.0, 3.0, 3.0, 30.0))
    steps(sched, clock, 1, 12, {})
    steps(sched, clock, 13, 30, {2: 1.6})
    sched.metrics.close()
    [line] = metrics(tmp_path, "replan")
    assert line["partition"] == [3] and line["proposed"] == [3]
    assert line["go"] is False and "[5] is what the profile advised" in line["reason"]
    assert not events.check([store.STOP_REQUESTED])
    # a restart after a failure would carry the slowdown on (fault.slowed)
    snapshot = sched.summary()
    assert snapshot["slowed"] == {"p1s0": pytest.approx(1.6, rel=0.01)}
    cfg = compose(["fault.on_slowdown=replan", "+fault.slowed.p0s1=4.0"])
    carried = carry_slowdowns(cfg, snapshot)
    assert dict(carried.fault.slowed) == snapshot["slowed"]  # measured from the devices' own start
    assert dict(cfg.fault.slowed) == {"p0s1": 4.0}  # a new config: the leg's own is left as it was
    warned = compose(["fault.on_slowdown=warn"])
    assert dict(carry_slowdowns(warned, snapshot).fault.slowed) == {}


@pytest.mark.parametrize("sync, leg", [("allreduce", "pipeline.partition=[5]"),
                                       ("sdpipe", "pipeline.partitions={0: [5]}")])
def test_a_device_that_recovers_is_replanned_back(tmp_path, sync, leg):
    """The leg after a re-plan starts with device n:1 still at a quarter (``fault.slowed``);
    when it is back to its speed it recovers, and the split goes back to the one for equal
    devices: [3] for every pipeline, ``pipeline.partitions`` emptied, nothing slowed."""
    sched, events, clock, _ = scheduler(tmp_path, sync, leg, "+fault.slowed.p0s1=4.0")
    steps(sched, clock, 1, 12, {1: 4.0})
    steps(sched, clock, 13, 30, {})
    sched.metrics.close()
    assert metrics(tmp_path, "straggler") == []
    assert [(m["device"], m["pipeline"], m["stage"]) for m in metrics(tmp_path, "recovered")] == [
        ("n:1", 0, 1)]
    [line] = metrics(tmp_path, "replan")
    assert line["go"] is True and line["proposed"] == [3]  # one split for all again
    assert events.check([store.STOP_REQUESTED])
    replan = sched.summary()["replan"]
    assert (replan["partition"], replan["partitions"], replan["slowed"]) == ([3], {}, {})
