"""The scheduler's answers to a restarted pipeline, on a real TCPStore: a decision (or an
asynchronous pipeline's begin answer) published for a process that died before reading it stays
in the store, and the restarted replica, which goes on from an earlier iteration, must get its
own answer rather than that stale one."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from sdpipe_cli.config.composition import compose
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.runtime import protocol, store
from sdpipe_cli.sync.scheduler import process
from sdpipe_cli.sync.scheduler.handling import Scheduler
from tests.helpers import event as as_event

P, S = 2, 2


def scheduler(tmp_path, *overrides: str):
    """A real scheduler of a P x S run that restarts lost pipelines, on a real TCPStore, with a
    clock the test moves (``now[0]``)."""
    cfg = compose(["model=mlp", "data=synthetic", f"cluster.pipelines={P}",
                   f"pipeline.stages={S}", "fault.on_pipeline_loss=restart", *overrides])
    cfg.run.dir = str(tmp_path)
    cfg.plan = RunPlan.resolve(cfg).section()  # what preparing the run writes
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    events = store.namespace(master)
    now = [0.0]
    return Scheduler(cfg, tmp_path, events, clock=lambda: now[0]), events, now, master


def test_a_restarted_replica_never_reads_a_decision_meant_for_its_dead_incarnation(tmp_path):
    sched, events, now, _ = scheduler(tmp_path, "train.steps=20")

    def ready(stage: int, pipeline: int, iteration: int, incarnation: int = 0) -> None:
        sched.handle(as_event(type="ready", rank=pipeline * S + stage, pipeline=pipeline,
                              stage=stage, iteration=iteration, incarnation=incarnation))

    # Iteration 0: the last stage of both pipelines is decided, then pipeline 0 dies before its
    # last stage reads that decision and before its first stage reached its own round.
    ready(1, 0, 0)
    ready(1, 1, 0)
    stale = store.decision_key(1, 0, 0, incarnation=0)
    assert store.get_json(events, stale)["members"] == [0, 1]
    sched.handle(as_event(type="lost", rank=1, pipeline=0, restart=True, reason="killed"))
    sched.handle(as_event(type="restart", rank=0, pipeline=0, incarnation=1))
    for s in range(S):
        sched.handle(as_event(type="rejoin", rank=s, pipeline=0, stage=s, incarnation=1))
    ready(0, 1, 0)  # pipeline 1's rounds heal the restarted replicas, stage by stage
    ready(0, 1, 1)
    ready(1, 1, 1)
    for s in range(S):
        heal = store.get_json(events, store.heal_key(s, 0, 1))
        assert heal["source"] == 1 and heal["iteration"] == 0, heal
    # The restarted pipeline goes on from iteration 0: its last stage asks for round 0 again.
    fresh = store.decision_key(1, 0, 0, incarnation=1)
    assert not events.check([fresh])  # nothing is waiting for it there
    ready(1, 0, 0, incarnation=0)  # a last word of the dead process: dropped
    assert not events.check([fresh])
    ready(1, 0, 0, incarnation=1)
    now[0] = 60.0  # past any round's deadline
    sched.handle(as_event(type="tick"))
    decision = store.get_json(events, fresh)
    assert decision["incarnations"][decision["members"].index(0)] == 1, decision
    assert store.get_json(events, stale)["incarnations"] == [0, 0]  # the dead one's, unread



@pytest.mark.parametrize("log_every, resumes_at", [(1, 1), (2, 2)])
def test_a_pipeline_stopped_before_its_train_line_does_that_iteration_again(tmp_path, log_every,
                                                                           resumes_at):
    """Both stages of both pipelines were decided for iterations 0 and 1, but pipeline 0's last
    stage wrote only iteration 0's train line before the pipeline was stopped (a re-split or a
    failure between its round's decision and its report). It goes on from iteration 1, so that
    the run's record has a line for each iteration the budget counts. With ``train.log_every=2``
    no line was due after iteration 0, so iteration 1 counts."""
    sched, events, now, _ = scheduler(tmp_path, "train.steps=20", f"train.log_every={log_every}")

    def event(kind: str, stage: int, pipeline: int, **more) -> None:
        where = {} if kind in ("lost", "restart") else {"stage": stage}
        sched.handle(as_event(type=kind, rank=pipeline * S + stage, pipeline=pipeline,
                              **where, **more))

    for k in (0, 1):
        for s in (1, 0):
            for p in range(P):
                event("ready", s, p, iteration=k)
        for p in ((0, 1) if k == 0 else (1,)):  # pipeline 0 is stopped before its line for 1
            event("step", 1, p, step=k + 1, samples=4 * k + 4, samples_per_s=10.0, step_s=0.1,
                  loss=2.0, time=0.5)
    event("lost", 1, 0, restart=True, reason="re-split")
    event("restart", 0, 0, incarnation=1)
    for s in range(S):
        event("rejoin", s, 0, incarnation=1)
    now[0] = 1.0
    for s in (1, 0):
        event("ready", s, 1, iteration=2)
    for s in range(S):
        assert store.get_json(events, store.heal_key(s, 0, 1))["iteration"] == resumes_at

def test_a_train_line_sent_before_the_loss_counts_though_read_in_the_same_batch(tmp_path):
    """Pipeline 0's train line for iteration 1 and the launcher's word of its loss come in one
    batch of the queue, the line first. Lost events are urgent, but the pipeline's own reports
    sent before it are read before it (``process.in_order``): iteration 1 counts, and the
    restarted pipeline goes on from 2 (read after the loss, it would redo 1 and write its line
    twice)."""
    sched, events, now, _ = scheduler(tmp_path, "train.steps=20")

    def raw(kind: str, stage: int, pipeline: int, **more) -> str:
        where = {} if kind in ("lost", "restart") else {"stage": stage}
        return json.dumps({"type": kind, "rank": pipeline * S + stage, "pipeline": pipeline,
                           **where, **more})

    def step(p: int, k: int) -> str:
        return raw("step", 1, p, step=k, samples=4 * k, samples_per_s=10.0, step_s=0.1,
                   loss=2.0, time=0.5)

    def batch(*raws: str) -> None:
        for event in process.in_order(list(raws)):
            sched.handle(event)

    for k in (0, 1):
        batch(*[raw("ready", s, p, iteration=k) for s in (1, 0) for p in range(P)])
    batch(step(0, 1), step(1, 1), step(1, 2))
    batch(step(0, 2), raw("lost", 1, 0, restart=True, reason="killed"))
    batch(raw("restart", 0, 0, incarnation=1),
          *[raw("rejoin", s, 0, incarnation=1) for s in range(S)])
    now[0] = 1.0
    batch(*[raw("ready", s, 1, iteration=2) for s in (1, 0)])
    for s in range(S):
        assert store.get_json(events, store.heal_key(s, 0, 1))["iteration"] == 2


def test_async_answers_to_a_restarted_pipeline_name_its_incarnation(tmp_path):
    """Asynchronous 1F1B (two rounds per iteration): pipeline 1 finished and reported iteration 0,
    began iteration 1, and its last stage made round 2 there, when it was lost. Restarted, it
    begins iteration 1 again and that stage asks for round 2 again: both answers are new, the
    dead process's stay unread."""
    sched, events, now, _ = scheduler(tmp_path, "train.steps=10", "pipeline.schedule=async_1f1b",
                                      "pipeline.microbatches=2")
    assert sched.policy.rounds_per_iteration == 2

    def event(kind: str, stage: int, pipeline: int, **more) -> None:
        where = {} if kind in ("lost", "restart") else {"stage": stage}
        sched.handle(as_event(type=kind, rank=pipeline * S + stage, pipeline=pipeline,
                              **where, **more))

    for p in range(P):
        event("begin", 0, p, iteration=0)
        event("begin", 0, p, iteration=1)
    for r in (0, 1):
        for s in (1, 0):
            for p in range(P):
                event("ready", s, p, iteration=r)
    for p in range(P):  # iteration 0 done: the last stage's train line
        event("step", 1, p, step=1, samples=4, samples_per_s=10.0, step_s=0.1, loss=2.0, time=0.5)
    event("ready", 1, 1, iteration=2)
    event("ready", 1, 0, iteration=2)
    stale_begin, stale_round = store.begin_key(1, 1, 0), store.decision_key(1, 1, 2, 0)
    assert store.get_json(events, stale_begin) == {"last": False}
    assert store.get_json(events, stale_round)["members"] == [0, 1]
    event("lost", 1, 1, restart=True, reason="killed")
    event("restart", 0, 1, incarnation=1)
    for s in range(S):
        event("rejoin", s, 1, incarnation=1)
    now[0] = 1.0
    event("ready", 0, 0, iteration=2)
    event("ready", 1, 0, iteration=3)
    assert all(store.get_json(events, store.heal_key(s, 1, 1))["iteration"] == 1
               for s in range(S))
    fresh_begin, fresh_round = store.begin_key(1, 1, 1), store.decision_key(1, 1, 2, 1)
    assert not events.check([fresh_begin]) and not events.check([fresh_round])
    event("begin", 0, 1, iteration=1, incarnation=1)
    assert store.get_json(events, fresh_begin) == {"last": False}
    event("ready", 1, 1, iteration=2, incarnation=1)
    now[0] = 60.0
    sched.handle(as_event(type="tick"))
    decision = store.get_json(events, fresh_round)
    assert decision["incarnations"][decision["members"].index(1)] == 1, decision
    assert store.get_json(events, stale_round)["incarnations"] == [0, 0]
    assert store.get_json(events, stale_begin) == {"last": False}


def test_events_no_process_of_the_run_could_send_fail_it_by_name(tmp_path):
    """A rank outside the run, a stage that does not match the rank, an incarnation the launcher
    never announced, a group event in a run without groups: each is a ProtocolError naming the
    store key, never a decision made on it."""
    sched, events, now, _ = scheduler(tmp_path, "train.steps=20")
    bad = [dict(type="ready", rank=9, pipeline=4, stage=1, iteration=0),
           dict(type="ready", rank=1, pipeline=0, stage=0, iteration=0),
           dict(type="ready", rank=1, pipeline=0, stage=1, iteration=0, incarnation=3),
           dict(type="lost", rank=7, pipeline=0)]
    for record in bad:
        with pytest.raises(protocol.ProtocolError, match="sdpipe/events"):
            sched.handle(as_event(**record))
    assert not events.check([store.decision_key(1, 0, 0)])
    (tmp_path / "ps").mkdir()
    ps, _, _, _ = scheduler(tmp_path / "ps", "train.steps=20", "sync=ps")
    with pytest.raises(protocol.ProtocolError, match="sync=ps"):
        ps.handle(as_event(type="ready", rank=1, pipeline=0, stage=1, iteration=0))
