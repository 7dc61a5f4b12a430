"""The scheduler's heartbeat check, on a real TCPStore with an injected clock: where a run
tolerates a lost pipeline, silent workers are named under sdpipe/hung (rank, incarnation) for the
launcher to kill; when every live pipeline is silent, the run itself is hung and fails."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from sdpipe_cli.config.schema import compose
from sdpipe_cli.runtime import store
from sdpipe_cli.sync.scheduler import Scheduler, WorkerHung

P, S = 3, 2


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def scheduler(tmp_path, loss: str):
    cfg = compose(["model=mlp", "data=synthetic", f"cluster.pipelines={P}", f"pipeline.stages={S}",
                   f"fault.on_pipeline_loss={loss}", "run.heartbeat_timeout=40"])
    cfg.run.dir = str(tmp_path)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    clock = Clock()
    events = store.namespace(master)
    return Scheduler(cfg, tmp_path, events, clock=clock), events, clock, master


def heard(sched, ranks, kind="start"):
    for r in ranks:
        sched.handle({"type": kind, "rank": r, "pipeline": r // S, "stage": r % S, "step": 1,
                      "samples": 8, "samples_per_s": 1.0, "loss": 5.0, "time": 0.0})


def test_silent_workers_are_named_hung_for_the_launcher(tmp_path):
    sched, events, clock, _ = scheduler(tmp_path, "restart")
    heard(sched, range(P * S))
    clock.t = 50.0
    heard(sched, [0, 1, 2, 3], kind="step")  # pipeline 2 went silent
    sched.handle({"type": "tick"})
    assert store.get_json(events, store.HUNG) == [[4, 0], [5, 0]]
    sched.handle({"type": "lost", "rank": 4, "pipeline": 2, "restart": True, "reason": "hung"})
    assert store.get_json(events, store.HUNG) == []  # its restart is not taken for hung
    sched.handle({"type": "restart", "rank": 4, "pipeline": 2, "incarnation": 1})
    clock.t = 100.0
    heard(sched, [0, 1, 2, 3], kind="step")
    sched.handle({"type": "tick"})  # the restarted pipeline has not reported yet: not silent
    assert store.get_json(events, store.HUNG) == []


@pytest.mark.parametrize("loss", ["restart", "stop"])
def test_every_live_pipeline_silent_is_a_hung_run(tmp_path, loss):
    sched, events, clock, _ = scheduler(tmp_path, loss)
    heard(sched, range(P * S))
    clock.t = 50.0
    with pytest.raises(WorkerHung, match=r"no report from rank\(s\) \[0, 1, 2, 3, 4, 5\]"):
        sched.handle({"type": "tick"})
    assert not events.check([store.HUNG])
