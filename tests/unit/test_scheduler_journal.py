"""The scheduler's journal: a scheduler started again replays it and is the dead one, state and
answers alike; and the journal file itself (header, torn last line, appending after a kill).

The runs are real :class:`~sdpipe_cli.sync.scheduler.handling.Scheduler` objects on real TCPStores, fed
seeded random arrivals of ready signals through :func:`~sdpipe_cli.sync.scheduler.process.act` (what
the scheduler process does per batch) at moments the test chooses.
"""

from __future__ import annotations

import json
import random
from datetime import timedelta

import pytest
import torch.distributed as dist

from sdpipe_cli.config.composition import compose
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.runtime import protocol, store
from sdpipe_cli.sync import journal
from sdpipe_cli.sync.scheduler.handling import Scheduler
from sdpipe_cli.sync.scheduler.process import BatchClock, act, next_batch, replay, take_over

P, S = 3, 2


def new_store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    return master, store.namespace(master)


def config(tmp_path, *overrides):
    cfg = compose(["model=mlp", "data=synthetic", f"cluster.pipelines={P}",
                   f"pipeline.stages={S}", "train.steps=12", "sync.global_every=4", *overrides])
    cfg.run.dir = str(tmp_path)
    cfg.plan = RunPlan.resolve(cfg).section()  # what preparing the run writes
    return cfg


def ready(pipeline: int, stage: int, iteration: int) -> str:
    return json.dumps({"type": "ready", "rank": pipeline * S + stage, "pipeline": pipeline,
                       "stage": stage, "iteration": iteration, "incarnation": 0})


def arrivals(seed: int, iterations: int):
    """Batches of ready signals in a random interleaving that respects each replica's order,
    with a tick now and then; and each batch's moment."""
    rng = random.Random(seed)
    next_it = {(p, s): 0 for p in range(P) for s in range(S)}
    now, batches = 0.0, []
    while any(k < iterations for k in next_it.values()):
        raw = []
        for _ in range(rng.randint(1, 4)):
            open_ = [r for r, k in next_it.items() if k < iterations]
            if not open_:
                break
            p, s = rng.choice(open_)
            raw.append(ready(p, s, next_it[(p, s)]))
            next_it[(p, s)] += 1
        if rng.random() < 0.3:
            raw.append(json.dumps({"type": "tick"}))
        now += rng.uniform(0.001, 0.05)
        batches.append((raw, now))
    return batches


def decisions(events, limit: int) -> dict:
    """Every decision in the store, by key (none is taken: no worker reads them here)."""
    found = {}
    for s in range(S):
        for p in range(P):
            for it in range(limit):
                key = store.decision_key(s, p, it)
                if events.check([key]):
                    found[key] = events.get(key)
    return found


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_replayed_scheduler_is_the_dead_one(tmp_path, seed):
    """Half the batches acted on by the first scheduler, which then dies; the one started again
    replays its journal. Both then get the same second half: they publish the same decisions,
    the same progress and counts."""
    cfg = config(tmp_path)
    batches = arrivals(seed, 8)
    half = len(batches) // 2
    _, first_events = new_store()
    first = Scheduler(cfg, tmp_path, first_events, clock=BatchClock(0.0))
    writer = journal.Journal.create(journal.journal_path(tmp_path), 0.0)
    for raw, now in batches[:half]:
        act(first, writer, raw, now)
    writer.close()
    # the journal goes to a second run folder's store: the replayed scheduler's own answers
    _, second_events = new_store()
    second = replay(cfg, tmp_path, second_events, now=lambda: batches[half - 1][1])
    assert second.rounds == first.rounds and second.group_sizes == first.group_sizes
    assert second.policy.global_history == first.policy.global_history
    assert second.tracker.snapshot() == first.tracker.snapshot()
    go_on = journal.Journal.resume(journal.journal_path(tmp_path))
    rest = journal.Journal.create(tmp_path / "first-rest.journal", 0.0)  # the first's own
    for raw, now in batches[half:]:
        act(first, rest, raw, now)
        act(second, go_on, raw, now)
    go_on.close()
    rest.close()
    assert second.rounds == first.rounds and second.group_sizes == first.group_sizes
    assert second.tracker.snapshot() == first.tracker.snapshot()
    # every decision the restarted one wrote is the first one's, byte for byte
    theirs, ours = decisions(first_events, 8), decisions(second_events, 8)
    assert len(ours) > len(theirs) // 3
    assert all(theirs.get(key) == value for key, value in ours.items())


def test_replay_writes_nothing_but_the_last_batchs_answers(tmp_path):
    """While replaying, the restarted scheduler writes no metrics line and none of the answers
    of the batches before the last (their replicas have them); the last batch's it writes again
    (the dead one may have died before it did), and one ``scheduler_restart`` line."""
    cfg = config(tmp_path)
    batches = arrivals(5, 4)
    batches.append(([json.dumps({"type": "tick"})], batches[-1][1] + 1.0))  # closes what is open
    _, events = new_store()
    first = Scheduler(cfg, tmp_path, events, clock=BatchClock(0.0))
    writer = journal.Journal.create(journal.journal_path(tmp_path), 0.0)
    for raw, now in batches[:-1]:
        act(first, writer, raw, now)
    before = decisions(events, 4)
    act(first, writer, *batches[-1])
    last = {k: v for k, v in decisions(events, 4).items() if k not in before}
    writer.close()
    first.metrics.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    _, fresh = new_store()
    replay(cfg, tmp_path, fresh, now=lambda: 99.0).metrics.close()
    after = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert after[:len(lines)] == lines
    added = [json.loads(x) for x in after[len(lines):]]
    assert [a["kind"] for a in added] == ["scheduler_restart"]
    assert added[0]["replayed_batches"] == len(batches)
    assert added[0]["silent_s"] == pytest.approx(99.0 - batches[-1][1])
    assert last and decisions(fresh, 4) == last


def test_a_torn_last_line_is_left_out_and_cut_before_appending(tmp_path):
    path = journal.journal_path(tmp_path)
    writer = journal.Journal.create(path, 1.5)
    writer.record(2.0, False, [ready(0, 0, 0)])
    writer.record(2.5, True, [json.dumps({"type": "tick"})])
    writer.close()
    with path.open("a") as f:
        f.write('{"t": 3.0, "stop": false, "events": ["{\\"ty')  # killed mid-line
    started, batches, unacted = journal.read(path)
    assert started == 1.5 and [b.t for b in batches] == [2.0, 2.5] and batches[1].stop
    assert unacted == ()
    again = journal.Journal.resume(path)
    again.record(4.0, False, [])
    again.close()
    assert [b.t for b in journal.read(path)[1]] == [2.0, 2.5, 4.0]


@pytest.mark.parametrize("text", ["", "not json\n", '{"started": 1}\n{"t": "x"}\n'])
def test_a_file_that_is_not_a_journal_is_refused(tmp_path, text):
    path = tmp_path / "scheduler.journal"
    path.write_text(text)
    with pytest.raises(ValueError, match="journal"):
        journal.read(path)


def test_the_decoded_batch_is_what_the_store_gave(tmp_path):
    """A batch's events are journaled as popped, and acted on urgent first, as before."""
    cfg = config(tmp_path)
    _, events = new_store()
    sched = Scheduler(cfg, tmp_path, events, clock=BatchClock(0.0))
    writer = journal.Journal.create(journal.journal_path(tmp_path), 0.0)
    raw = [json.dumps({"type": "tick"}), ready(0, 0, 0)]
    batch = act(sched, writer, raw, 0.1)
    writer.close()
    assert [type(e) for e in batch] == [protocol.Ready, protocol.Tick]
    assert list(journal.read(journal.journal_path(tmp_path))[1][0].events) == raw


def test_each_event_is_journaled_as_it_is_popped_and_its_batch_closes_them(tmp_path):
    """next_batch writes every event the moment it pops it: a scheduler killed before it acts
    leaves them in the journal, unacted; acting writes the line that closes them."""
    cfg = config(tmp_path)
    _, events = new_store()
    sched = Scheduler(cfg, tmp_path, events, clock=BatchClock(0.0))
    path = journal.journal_path(tmp_path)
    writer = journal.Journal.create(path, 0.0)
    sent = [ready(p, 0, 0) for p in range(P)]
    for raw in sent:
        events.queue_push(store.EVENTS, raw)
    raw = next_batch(events, writer)
    assert raw == sent and journal.read(path) == (0.0, [], tuple(sent))  # killed here: kept
    act(sched, writer, raw, 0.5)
    _, batches, unacted = journal.read(path)
    assert [(b.t, b.events) for b in batches] == [(0.5, tuple(sent))] and unacted == ()
    writer.close()


def test_events_a_dead_scheduler_popped_and_never_acted_on_are_acted_on_by_the_next(tmp_path):
    """The first scheduler acts on some batches, then pops a stage's last ready signals and is
    killed before acting: the round they complete was never decided, and its replicas wait for
    it. The scheduler started again replays the journal and then acts on those events first:
    it publishes that round, as the first one would have."""
    cfg = config(tmp_path)
    _, first_events = new_store()
    first = Scheduler(cfg, tmp_path, first_events, clock=BatchClock(0.0))
    path = journal.journal_path(tmp_path)
    writer = journal.Journal.create(path, 0.0)
    act(first, writer, [ready(0, 0, 0)], 0.1)
    for raw in (ready(1, 0, 0), ready(2, 0, 0)):  # popped, then the kill
        writer.popped(raw)
    writer.close()
    assert decisions(first_events, 1) == {}  # the round of iteration 0 waits for them
    _, second_events = new_store()
    second, go_on = take_over(cfg, tmp_path, second_events, path, now=lambda: 0.11)
    go_on.close()
    decided = decisions(second_events, 1)
    assert {key for key in decided if key.startswith("group/0/")} == {
        f"group/0/{p}.0/0" for p in range(P)}
    assert second.group_sizes == [P]
    _, batches, unacted = journal.read(path)
    assert batches[-1].events == (ready(1, 0, 0), ready(2, 0, 0)) and unacted == ()


def test_a_batch_line_that_closes_other_events_than_were_popped_is_refused(tmp_path):
    writer = journal.Journal.create(tmp_path / "j.journal", 0.0)
    writer.popped(ready(0, 0, 0))
    with pytest.raises(ValueError, match="closes 1 journaled"):
        writer.record(1.0, False, [ready(0, 0, 0), ready(1, 0, 0)])
    writer.close()
