"""The scheduler's heartbeat check, on a real TCPStore with an injected clock: where a run
tolerates a lost pipeline, silent workers are named under sdpipe/hung (rank, incarnation) for the
launcher to kill; when every live pipeline is silent, the run itself is hung and fails."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from sdpipe_cli.config.composition import compose
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.runtime import store
from sdpipe_cli.sync.scheduler.handling import Scheduler, WorkerHung
from tests.helpers import event as as_event

P, S = 3, 2


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def scheduler(tmp_path, loss: str, *overrides: str):
    cfg = compose(["model=mlp", "data=synthetic", f"cluster.pipelines={P}", f"pipeline.stages={S}",
                   f"fault.on_pipeline_loss={loss}", "run.heartbeat_timeout=40", *overrides])
    cfg.run.dir = str(tmp_path)
    cfg.plan = RunPlan.resolve(cfg).section()  # what preparing the run writes
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    clock = Clock()
    events = store.namespace(master)
    return Scheduler(cfg, tmp_path, events, clock=clock), events, clock, master


def heard(sched, ranks, kind="start"):
    for r in ranks:
        sched.handle(as_event(type=kind, rank=r, pipeline=r // S, stage=r % S, step=1,
                              samples=8, samples_per_s=1.0, step_s=0.1, loss=5.0, time=0.0,
                              pid=1))


def test_silent_workers_are_named_hung_for_the_launcher(tmp_path):
    sched, events, clock, _ = scheduler(tmp_path, "restart")
    heard(sched, range(P * S))
    clock.t = 50.0
    heard(sched, [0, 1, 2, 3], kind="step")  # pipeline 2 went silent
    sched.handle(as_event(type="tick"))
    assert store.get_json(events, store.HUNG) == [[4, 0], [5, 0]]
    sched.handle(as_event(type="lost", rank=4, pipeline=2, restart=True, reason="hung"))
    assert store.get_json(events, store.HUNG) == []  # its restart is not taken for hung
    sched.handle(as_event(type="restart", rank=4, pipeline=2, incarnation=1))
    clock.t = 100.0
    heard(sched, [0, 1, 2, 3], kind="step")
    sched.handle(as_event(type="tick"))  # the restarted pipeline has not reported yet: not silent
    assert store.get_json(events, store.HUNG) == []


@pytest.mark.parametrize("loss", ["restart", "stop"])
def test_every_live_pipeline_silent_is_a_hung_run(tmp_path, loss):
    sched, events, clock, _ = scheduler(tmp_path, loss)
    heard(sched, range(P * S))
    clock.t = 50.0
    with pytest.raises(WorkerHung, match=r"no report from rank\(s\) \[0, 1, 2, 3, 4, 5\]"):
        sched.handle(as_event(type="tick"))
    assert not events.check([store.HUNG])


def test_replicas_held_by_a_global_sync_are_not_taken_for_hung(tmp_path):
    """train.steps=1: iteration 0 ends the run on a global sync, which waits for every live
    replica. Pipelines 0 and 1 are there, held by the scheduler; pipeline 2 never comes. Past the
    heartbeat only pipeline 2 is named hung: the others are silent because they wait for it."""
    sched, events, clock, _ = scheduler(tmp_path, "restart", "train.steps=1")
    heard(sched, range(P * S))
    for p in (0, 1):
        for s in range(S):
            sched.handle(as_event(type="ready", rank=p * S + s, pipeline=p, stage=s,
                          iteration=0))
    assert sorted(sched.policy.held()) == [(s, p) for s in range(S) for p in (0, 1)]
    clock.t = 50.0
    sched.handle(as_event(type="tick"))
    assert store.get_json(events, store.HUNG) == [[4, 0], [5, 0]]
    # the launcher kills it; the global sync closes without it and lets the others go, whose
    # silence only starts now: they are not named at the next tick
    sched.handle(as_event(type="lost", rank=4, pipeline=2, restart=True, reason="hung"))
    assert (0, 0) not in sched.policy.held() and events.check([store.decision_key(0, 0, 0)])
    clock.t = 50.5
    sched.handle(as_event(type="tick"))
    assert store.get_json(events, store.HUNG) == []
