"""The wire a run measures (sdpipe_cli.core.wire) and how its meetings are settled from it: the
pure decision, the launcher leaving them to the run, the scheduler's side over a real TCPStore,
and a replay of a run that measured."""

from __future__ import annotations

import json
import math
import random
from datetime import timedelta

import pytest
import torch.distributed as dist
from hypothesis import given, settings, strategies as st
from omegaconf import OmegaConf

from sdpipe_cli.config.derived import with_run
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.config.settings import settings_of
from sdpipe_cli.core.blocks import closing_block, final_block
from sdpipe_cli.core.meetings import BYTES, choose
from sdpipe_cli.core.wire import (
    RECENT,
    SLUMP,
    WINDOW,
    Blocks,
    LinkFit,
    Measured,
    Probe,
    WirePace,
    decide,
    meeting_s,
    ring_bytes,
)
from sdpipe_cli.sync import wire_probe
from tests.unit.test_simulation import config

NO_LINKS = ("cluster.links.cross_node.latency_ms=0", "cluster.links.cross_node.bandwidth_gbps=null",
            "cluster.links.same_node.latency_ms=0", "cluster.links.same_node.bandwidth_gbps=null")
FOUR_NODES = ("cluster=slow_links", *NO_LINKS, "cluster.pipelines=4", "pipeline.stages=2",
              "train.steps=48")
VALUES = 120_000  # a gpt_tiny stage


def probe_of(latency_s: float, bytes_per_s: float, members: int = 4,
             values: int = VALUES) -> Probe:
    """What a replica would time on a link of that latency and bandwidth."""
    small, large = 1024, values * 4
    return Probe(members, small, latency_s + ring_bytes(members, small) / bytes_per_s,
                 large, latency_s + ring_bytes(members, large) / bytes_per_s)


@settings(max_examples=200, deadline=None)
@given(latency=st.floats(0, 0.05), mbit=st.floats(1, 100_000), members=st.integers(2, 16))
def test_two_timed_sizes_give_back_the_links_latency_and_bandwidth(latency, mbit, members):
    bw = mbit * 1e6 / 8
    fit = probe_of(latency, bw, members).fit()
    assert math.isclose(fit.bytes_per_s, bw, rel_tol=1e-6)
    assert fit.latency_s == pytest.approx(latency + ring_bytes(members, 1024) / bw, rel=1e-6)


def test_a_link_faster_than_the_clock_can_tell_is_still_fast_and_finite():
    fit = Probe(4, 1024, 0.002, 480_000, 0.0015).fit()  # the large one no slower: noise
    assert fit.latency_s == 0.002 and 1e8 < fit.bytes_per_s < math.inf


def report(pipeline, stage, step_s, latency=0.002, mbit=15.0, values=VALUES):
    return Measured(pipeline, stage, step_s, values, probe_of(latency, mbit * 1e6 / 8))


def test_on_a_fast_wire_replicas_meet_every_iteration_in_float32():
    reports = [report(p, s, 0.15, latency=1e-4, mbit=10_000) for p in range(4) for s in range(2)]
    made = decide(reports, 0.1)
    assert (made.every, made.precision) == (1, "fp32")


def test_on_15_mbit_the_wire_asks_for_int8_and_meetings_that_fit_the_share():
    reports = [report(p, s, 0.15) for p in range(4) for s in range(2)]
    made = decide(reports, 0.1, most=100)
    int8 = 0.002 + ring_bytes(4, VALUES * BYTES["int8"]) / (15e6 / 8)
    assert made.precision == "int8"
    assert made.every == math.ceil(int8 / (0.1 * 0.15))  # the fewest steps one meeting fits in
    assert decide(reports, 0.1, most=5).every == 5  # but never past a pipeline's budget
    assert decide(reports, 0.1, every=3).every == 3  # a pinned period is kept
    assert decide(reports, 0.1, precision="fp32").precision == "fp32"


def test_the_fastest_pipeline_and_the_slowest_replicas_link_decide():
    """A pipeline's iteration is its slowest stage's; the fastest pipeline sets the pace the
    wire is measured against; the slowest link of any replica bounds its stage's ring."""
    fast = [report(p, s, 0.15) for p in range(3) for s in range(2)]
    slow = [report(3, 0, 0.45), report(3, 1, 0.45, mbit=5.0)]
    one_slow_stage = [report(0, 0, 0.05), report(0, 1, 0.15)]
    made = decide(fast + slow, 0.1)
    assert made.iteration_s == pytest.approx(0.15)
    assert decide(fast + slow, 0.1).every > decide(fast + [report(3, 0, 0.45),
                                                           report(3, 1, 0.45)], 0.1).every
    assert decide(one_slow_stage, 0.1).iteration_s == pytest.approx(0.15)
    with pytest.raises(ValueError):
        decide([], 0.1)


@settings(max_examples=100, deadline=None)
@given(step_s=st.floats(0.001, 5), mbit=st.floats(0.5, 50_000), share=st.floats(0.01, 1))
def test_the_chosen_period_is_the_shortest_whose_meeting_fits_the_share(step_s, mbit, share):
    reports = [report(p, s, step_s, mbit=mbit) for p in range(2) for s in range(2)]
    made = decide(reports, share)
    fit = reports[0].probe.fit()
    round_s = fit.seconds(ring_bytes(4, VALUES * BYTES[made.precision]))
    assert round_s <= share * step_s * made.every * (1 + 1e-9)
    if made.every > 1:
        assert round_s > share * step_s * (made.every - 1)


def test_the_launcher_leaves_meetings_to_the_run_where_replicas_span_nodes_and_no_link_is_described():
    left = config(*FOUR_NODES)
    assert (left.sync.every, left.sync.precision) == (0, "auto")
    assert wire_probe.unresolved(left.sync)
    one_node = config("cluster.pipelines=4", "pipeline.stages=2", "train.steps=48")
    assert (one_node.sync.every, one_node.sync.precision) == (1, "fp32")
    pinned = config(*FOUR_NODES, "sync.every=3")
    assert (pinned.sync.every, pinned.sync.precision) == (3, "auto")  # the payload still measured
    healing = config(*FOUR_NODES, "fault.on_pipeline_loss=restart", "checkpoint.every=10")
    assert (healing.sync.every, healing.sync.precision) == (0, "fp32")
    other = config(*FOUR_NODES, "pipeline.schedule=async_1f1b")
    assert not wire_probe.unresolved(other.sync)


@pytest.fixture
def events():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    yield dist.PrefixStore("sdpipe/", server)


def test_the_scheduler_settles_once_from_every_workers_report_and_a_restart_reads_it(events):
    cfg = config(*FOUR_NODES)
    for rank in range(8):
        wire_probe.report(events, rank, report(rank // 2, rank % 2, 0.15))
    chosen = wire_probe.settle(settings_of(cfg), events, 8, timeout=5)
    settled = wire_probe.settled(cfg, chosen)
    assert (settled.sync.every, settled.sync.precision) == (chosen.every, "int8")
    assert chosen.every > 1 and [s.stage for s in chosen.stages] == [0, 1]
    assert all(s.members == 4 and 9 < s.mbit_s < 21 for s in chosen.stages)
    assert (cfg.sync.every, cfg.sync.precision) == (0, "auto")  # the launcher's config is kept
    assert wire_probe.choice(events, timeout=1) == chosen
    for rank in range(8):  # what a second scheduler finds has changed: the choice stands
        wire_probe.report(events, rank, report(rank // 2, rank % 2, 0.15, mbit=10_000))
    assert wire_probe.settle(settings_of(cfg), events, 8, timeout=5) == chosen
    line = wire_probe.line(chosen, 1.0)
    from sdpipe_cli.analysis import conforms
    assert all(conforms("wire", k, v) for k, v in line.items())


def test_a_damaged_report_is_one_line_naming_its_key(events):
    """What no worker of this version writes is refused where it is read, not used."""
    from sdpipe_cli.runtime.protocol import ProtocolError

    cfg = config(*FOUR_NODES)
    for rank in range(8):
        wire_probe.report(events, rank, report(rank // 2, rank % 2, 0.15))
    events.set("wire/5", '{"pipeline": 2, "stage": 1, "step_s": "fast"}')
    with pytest.raises(ProtocolError, match="wire/5"):
        wire_probe.settle(settings_of(cfg), events, 8, timeout=5)


def test_a_missing_report_ends_the_wait_with_the_runs_failure(events):
    cfg = config(*FOUR_NODES)
    events.set("failed", "worker 3 died")
    with pytest.raises(RuntimeError, match="failed before its wire was measured"):
        wire_probe.settle(settings_of(cfg), events, 8, timeout=5)


def test_a_replay_of_a_run_that_measured_meets_as_it_did(tmp_path):
    """The recording's config leaves its meetings unresolved; its wire line says what it met
    by, and the replay takes that, not a measurement of its own."""
    from sdpipe_cli.sync import replay

    recorded = config(*FOUR_NODES)
    run = tmp_path / "recorded"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml(recorded))
    group = {"kind": "group", "time": 1.0, "stage": 0, "round": 0, "members": [0, 1],
             "iterations": [0, 0], "size": 2, "group": "group", "stop": False, "done": 2,
             "every": 6, "nexts": [6, 9], "done_steps": 12}
    wire = {"kind": "wire", "time": 0.5, "every": 6, "precision": "bf16", "iteration_s": 0.1,
            "round_s": 0.6, "share": 0.1, "stages": []}
    (run / "metrics.jsonl").write_text(json.dumps(wire) + "\n" + json.dumps(group) + "\n")
    replaying = config(*FOUR_NODES, f"sync.replay={run}", "fault.on_pipeline_loss=stop")
    assert (replaying.sync.every, replaying.sync.precision) == (6, "bf16")
    decisions = replay.load(run, settings_of(replaying))
    assert decisions[(0, 1, 0)].nexts == [6, 9] and decisions[(0, 1, 0)].done_steps == 12
    with pytest.raises(ConfigError, match="recorded with sync.every=6"):
        replay.load(run, settings_of(config(*FOUR_NODES, "sync.every=3", "sync.precision=bf16")))


# -- meetings that follow the wire during the run -------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(first=st.integers(1, 20), nexts=st.lists(st.integers(1, 20), min_size=1, max_size=30),
       start=st.integers(0, 200))
def test_a_replicas_blocks_are_as_long_as_each_decision_said(first, nexts, start):
    """From ``start`` (0, or a resume's step), the first block ends where a fixed period's would
    (the scheduler numbers a resume's first meeting ``start // every``); after that each block is
    the length its meeting's decision gave, and meetings are numbered one by one."""
    blocks = Blocks(first)
    met, step, meetings = [], start, []
    ends = [start + first - 1 - start % first]
    for n in nexts:
        ends.append(ends[-1] + n)
    for n in nexts:
        while not blocks.meets(step):
            step += 1
        met.append(step)
        meetings.append(blocks.meeting())
        blocks.went(step, n)
        step += 1
    assert met == ends[:len(nexts)]
    assert meetings == list(range(start // first, start // first + len(nexts)))


def _median_of(values):
    return sorted(values)[len(values) // 2]


def pace(every=2, mbit=200.0, step_s=0.18, members=4):
    links = {s: LinkFit(0.005, mbit * 1e6 / 8) for s in (0, 1)}
    return WirePace(0.1, "bf16", every, 300, members, links, {0: VALUES, 1: VALUES},
                    {p: step_s for p in range(members)})


def rounds(wire: WirePace, mbit: float, n: int, stage: int = 0) -> list[int]:
    """``n`` rounds of 4 members on a link of ``mbit``; the period after each."""
    moved = ring_bytes(4, VALUES * BYTES["bf16"])
    out = []
    for _ in range(n):
        wire.round_done(stage, moved, 0.005 + moved / (mbit * 1e6 / 8))
        out.append(wire.every())
    return out


def test_the_period_rises_when_the_link_slows_and_falls_back_when_it_recovers():
    """200 to 15 Mbit/s: the rule wants a period 13x longer; it is taken once most of one
    meeting's rounds (four members) are slow, and taken back once half a window of rounds
    (under two meetings) is fast again."""
    wire = pace()
    assert rounds(wire, 200, WINDOW)[-1] == 2  # the rounds calibrated against the probe
    slow = rounds(wire, 15, WINDOW)
    target = math.ceil((0.005 + ring_bytes(4, VALUES * 2) / (15e6 / 8)) / (0.1 * 0.18))
    assert slow[-1] == target and slow.index(target) < RECENT, slow
    back = rounds(wire, 200, WINDOW)
    assert back[-1] == 2 and back.index(2) <= WINDOW // 2, back


def test_a_link_that_slows_less_than_the_slump_is_followed_by_the_window():
    """1.8x slower: not a drop, so not taken from one meeting's rounds; the window's median
    takes it once half a window of rounds is slow."""
    wire = pace(every=2, mbit=45)
    before = rounds(wire, 45, WINDOW)[-1]
    slowed = rounds(wire, 45 / (0.9 * SLUMP), WINDOW)
    assert set(slowed[:RECENT]) == {before} and slowed[-1] > before, slowed


def test_a_link_calibrated_where_rounds_are_fixed_costs_is_followed_when_it_slows():
    """int8 rounds of 4 members at 200 Mbit/s take 25 ms, four fifths of it fixed (two
    collectives' latencies, quantizing): calibrated as a factor on the rate, that made a
    15 Mbit/s link met later look three times faster (H 2 to 3 where 6 fits). Calibrated as
    that fixed cost, the period after the drop is the one the rule picks for 15 Mbit/s with it."""
    links = {s: LinkFit(0.005, 200e6 / 8) for s in (0, 1)}
    wire = WirePace(0.1, "int8", 1, 300, 4, links, {0: VALUES, 1: VALUES},
                    {p: 0.18 for p in range(4)})
    moved = ring_bytes(4, VALUES * BYTES["int8"])
    fixed = 0.025 - moved / (200e6 / 8)
    for _ in range(WINDOW):
        wire.round_done(0, moved, 0.025)
    assert wire.calibration[0] == 1.0 and wire.overhead[0] == pytest.approx(fixed)
    assert wire.every() == 2  # 25 ms against 18 ms of a step's 10 %
    periods = []
    for _ in range(WINDOW):
        wire.round_done(0, moved, fixed + moved / (15e6 / 8))
        periods.append(wire.every())
    assert periods[-1] == math.ceil((fixed + moved / (15e6 / 8)) / (0.1 * 0.18)), periods
    for _ in range(WINDOW):
        wire.round_done(0, moved, 0.025)
    assert wire.every() == 2  # and back


def test_the_rounds_noise_on_a_steady_link_never_counts_as_a_drop():
    """Rounds of one steady link measured anywhere between 7.5 and 16 Mbit/s (seen on 15
    Mbit/s): the link is always the window's median, never the last few rounds'."""
    rng = random.Random(0)
    wire = pace(every=12, mbit=15)
    moved = ring_bytes(4, VALUES * BYTES["bf16"])
    for _ in range(500):
        wire.round_done(0, moved, 0.005 + moved / (rng.uniform(7.5, 16) * 1e6 / 8))
        if 0 in wire.calibration:
            window = _median_of(wire.rates(0)) * wire.calibration[0]
            assert wire.link(0).bytes_per_s == window


def test_rounds_slower_than_the_probe_from_the_start_change_nothing_but_their_changes_do():
    """On a real link the rounds run slower than the probe of one stage alone (the other
    stage shares the link, decisions queue): that level is calibrated away, and the period
    stays the start's until the rounds themselves slow."""
    wire = pace(every=12, mbit=15)
    assert set(rounds(wire, 9, 2 * WINDOW)) == {12}
    slowed = rounds(wire, 3, WINDOW)  # the link slows 3x
    assert slowed[-1] == math.ceil((0.005 + ring_bytes(4, VALUES * 2) / (5e6 / 8)) / 0.018)


def test_noise_within_the_steady_band_does_not_move_the_period():
    wire = pace(every=12, mbit=15)
    periods = set()
    for mbit in (14, 16, 15.5, 13.5, 15, 14.5, 16.5, 15):
        periods.update(rounds(wire, mbit, 1))
    assert periods == {12}


def test_the_fastest_pipeline_sets_the_period_and_slower_compute_shortens_it():
    """One period for every pipeline: a slower one is a stale member of the fast ones' groups,
    as at a fixed period; compute that slows 4x everywhere makes the wire a quarter as costly
    per step."""
    wire = pace(every=12, mbit=15)
    wire.block_done(3, 10, 18.0)  # a pipeline 10x slower does not set the pace
    assert wire.every() == 12
    for p in range(3):
        wire.block_done(p, 10, 7.2)
    assert wire.every() == 3
    noisy = pace(every=12, mbit=15)
    for p, seconds in enumerate((1.8, 2.2, 1.95)):  # one speed, noisy timing
        noisy.block_done(p, 10, seconds)
    assert noisy.every() == 12


def test_the_scheduler_gives_every_stage_of_a_pipeline_the_same_next_block(tmp_path):
    """On a real TCPStore: the period changes between the rounds of a pipeline's two stages at
    one meeting, and both stages still take the same next block; the budget is counted again
    in the new period; each decision says the run's pipeline-steps."""
    from sdpipe_cli.runtime import protocol, store
    from sdpipe_cli.sync.scheduler.handling import Scheduler
    from tests.helpers import event as as_event

    cfg = config(*FOUR_NODES[:-3], "cluster.pipelines=2", "pipeline.stages=2", "train.steps=40",
                 "sync.global_every=0", "sync.min_group=1")
    cfg = with_run(cfg, dir=str(tmp_path))
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    events = store.namespace(master)
    links = [protocol.StageLink(s, 2, VALUES, 100.0, 5.0) for s in (0, 1)]
    chosen = protocol.MeetingChoice(2, "bf16", 0.18, 0.03, 0.1, links, "", adapt=True)
    settled = OmegaConf.merge(cfg, {"sync": {"every": 2, "precision": "bf16"}})
    now = [0.0]
    sched = Scheduler(settled, tmp_path, events, clock=lambda: now[0], wire=chosen)
    total = sched.policy._run.total_iterations
    assert total == 2 * 40 // 2
    moved = ring_bytes(2, VALUES * 2)

    def ready(stage, pipeline, meeting, steps, mbit=None):
        wire = {} if mbit is None else {"wire_s": 0.005 + moved / (mbit * 1e6 / 8),
                                        "wire_bytes": moved}
        sched.handle(as_event(type="ready", rank=pipeline * 2 + stage, pipeline=pipeline,
                              stage=stage, iteration=meeting, steps=steps, block_s=0.36,
                              **wire))
        now[0] += 0.01

    for p in (0, 1):
        ready(1, p, 0, 2)
    first = store.read(events, store.decision_key(1, 0, 0), protocol.Group)
    assert first.nexts == [2, 2] and first.done_steps == 4
    for mbit in [100] * WINDOW + [15] * WINDOW:  # stage 0's rounds: calibrated, then slow
        sched.pacing.pace.round_done(0, moved, 0.005 + moved / (mbit * 1e6 / 8))
    for p in (0, 1):
        ready(0, p, 0, 2, mbit=15)
    later = store.read(events, store.decision_key(0, 0, 0), protocol.Group)
    assert later.nexts == first.nexts  # meeting 0's next block was decided at stage 1's round
    for p in (0, 1):
        ready(1, p, 1, 4)
    changed = store.read(events, store.decision_key(1, 0, 1), protocol.Group)
    assert changed.nexts[0] > 2 and changed.done_steps == 8
    every = changed.nexts[0]
    assert sched.policy._run.total_iterations == 4 + math.ceil((80 - 8) / every)
    [line] = [m for m in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
              if m["kind"] == "pace"]
    assert (line["was"], line["every"]) == (2, every) and line["mbit_s"] < 20


@settings(max_examples=300, deadline=None)
@given(every=st.integers(1, 40), paces=st.lists(st.floats(0.01, 1.0), min_size=1, max_size=8),
       left=st.floats(0, 2000), share=st.lists(st.floats(0, 1), min_size=8, max_size=8))
def test_a_closing_block_ends_by_the_runs_predicted_end_and_is_never_longer_than_the_period(
        every, paces, left, share):
    step_s = dict(enumerate(paces))
    done = 10_000.0
    progress = {q: done * share[q] for q in step_s}
    budget = sum(progress.values()) + left
    until = left / sum(1 / s for s in paces)
    for p in step_s:
        block = closing_block(every, p, step_s, progress, budget)
        assert 1 <= block <= every
        if block < every:  # cut: whole steps that fit by the predicted end, or the one step
            assert block == 1 or block * step_s[p] <= until * (1 + 1e-9)
            assert (block + 1) * step_s[p] > until * (1 - 1e-9)
        else:
            assert every * step_s[p] <= until * (1 + 1e-9) + step_s[p]


def test_a_slow_replicas_last_block_is_cut_so_that_it_arrives_with_the_fast_ones():
    """Three pipelines at 1 s a step, one at 3 s; 40 pipeline-steps left: the run ends in 12 s,
    so the slow replica's block is 4 steps, not 12, and a fast one's is 12."""
    step_s = {0: 1.0, 1: 1.0, 2: 1.0, 3: 3.0}
    progress = {0: 90.0, 1: 90.0, 2: 90.0, 3: 30.0}
    assert closing_block(12, 3, step_s, progress, 340) == 4
    assert closing_block(12, 0, step_s, progress, 340) == 12
    assert closing_block(12, 3, step_s, progress, 1000) == 12  # far from the end
    assert closing_block(12, 3, step_s, progress, None) == 12  # bounded by time alone
    assert closing_block(12, 3, {0: 1.0}, progress, 340) == 12  # a pace not known yet


def test_the_schedulers_pacing_cuts_the_last_blocks_from_its_measured_paces():
    """Pacing, fed ready signals as the scheduler feeds them, with the real policy: far from
    the end every block is the period; near it, the slow pipeline's block is cut to what fits,
    and the policy's budget is counted again in meetings."""
    from sdpipe_cli.core.grouping import GroupScheduler
    from sdpipe_cli.runtime import protocol
    from sdpipe_cli.sync.scheduler.pacing import Pacing

    links = [protocol.StageLink(0, 2, VALUES, 1.9, 5.0)]  # a meeting in 1 s: H = 10 at 1 s a step
    chosen = protocol.MeetingChoice(10, "bf16", 1.0, 0.5, 0.1, links, "", adapt=True)
    pacing = Pacing(chosen, budget=200, pipelines=2, most=100)
    now = [0.0]
    policy = GroupScheduler(2, 1, total_iterations=20, clock=lambda: now[0])

    def ready(p, steps, block_s):
        pacing.ready(protocol.Ready(p, p, 0, 0, 0, steps, block_s=block_s), now[0])

    ready(0, 10, 10.0)
    ready(1, 10, 30.0)  # 3 s a step
    assert pacing.nexts([0, 1], [0, 0], policy, 0.0, now[0]) == [10, 10]
    now[0] = 120.0  # pipeline 0 did 110 steps by now, pipeline 1 40, a block each 10 or 30 s
    for steps in range(20, 111, 10):
        ready(0, steps, 10.0)
    for steps in (20, 30, 40):
        ready(1, steps, 30.0)
    # 50 left at 4/3 steps a second: 37.5 s, 12 of pipeline 1's steps, more than its period
    assert pacing.nexts([0, 1], [10, 3], policy, 0.0, now[0]) == [10, 10]
    now[0] = 150.0
    ready(1, 50, 30.0)  # pipeline 0 is 30 s into a block of 10: its whole block, 120 steps
    # 30 left: 22.5 s, 7 of pipeline 1's steps
    assert pacing.nexts([1], [4], policy, 0.0, now[0]) == [7]
    assert policy._run.total_iterations == policy.iterations_done() + math.ceil((200 - 160) / 10)


@settings(max_examples=300, deadline=None)
@given(blocks=st.lists(st.integers(0, 5), min_size=1, max_size=6),
       paces=st.lists(st.floats(0.01, 1.0), min_size=6, max_size=6),
       done=st.lists(st.integers(0, 100), min_size=6, max_size=6),
       extra=st.integers(0, 400), order=st.randoms(use_true_random=False))
def test_the_last_blocks_share_what_is_left_and_the_run_ends_on_its_budget_exactly(
        blocks, paces, done, extra, order):
    """Whatever order the last blocks are decided in, each has a step at least, and together
    they hold exactly what was left of the budget (when it holds a step for each)."""
    undecided = {q: n for q, n in enumerate(blocks)}
    committed = {q: done[q] for q in undecided}
    budget = sum(committed.values()) + sum(blocks) + extra
    step_s = {q: paces[q] for q in undecided}
    pending = [q for q, n in undecided.items() for _ in range(n)]
    order.shuffle(pending)
    for q in pending:
        block = final_block(q, budget, committed, {k: float(v) for k, v in committed.items()},
                            undecided, step_s)
        assert block >= 1
        committed[q] += block
        undecided[q] -= 1
    assert sum(committed.values()) == budget or not pending


def test_the_last_blocks_end_together_whoever_decides_first():
    """Four equal pipelines at 36 of 50 steps each, H = 12; the last global sync falls two
    blocks ahead for pipeline 0, one for the others. Pipeline 0 decides first: every pipeline
    ends at 50, none idle while another finishes."""
    step_s = {q: 1.0 for q in range(4)}
    committed = {q: 36 for q in range(4)}
    undecided = {0: 2, 1: 1, 2: 1, 3: 1}
    now = {q: 36.0 for q in range(4)}  # where each is as the first four decide, at once
    for q in (0, 1, 2, 3, 0):
        if q == 0 and undecided[0] == 1:
            now = dict.fromkeys(range(4), 43.0)  # 7 steps later, at its next meeting
        block = final_block(q, 200, committed, now, undecided, step_s)
        committed[q] += block
        undecided[q] -= 1
    assert committed == {0: 50, 1: 50, 2: 50, 3: 50}


def test_the_last_blocks_go_to_the_fast_pipelines_in_proportion_to_their_pace():
    # 40 steps left, one block each: a 3x slower pipeline's is a third of a fast one's
    step_s = {0: 1.0, 1: 1.0, 2: 1.0, 3: 3.0}
    at = {q: 0 for q in range(4)}
    now = {q: 0.0 for q in range(4)}
    one = {0: 1, 1: 1, 2: 1, 3: 1}
    assert final_block(3, 40, at, now, one, step_s) == 4
    assert final_block(0, 40, at, now, one, step_s) == 12
    assert final_block(0, 40, at, now, {0: 2, 1: 1, 2: 1, 3: 1}, step_s) == 6  # over two blocks
    assert final_block(2, 7, at, now, {0: 0, 1: 0, 2: 1, 3: 0}, step_s) == 7  # the last: the rest


def test_a_period_between_two_integers_settles_instead_of_flipping():
    """A meeting every step costs about 11 % of a step, around the 10 % share, and the
    compute's timing is noisy (0.17 to 0.205 s a step): the rule's own period flips between 1
    and 2 with it, and the period taken settles instead of following every flip."""
    moved = ring_bytes(4, VALUES * BYTES["bf16"])
    mbit = moved * 8 / 1e6 / (0.11 * 0.185 - 0.005)
    wire = pace(every=1, mbit=mbit, step_s=0.185)
    rounds(wire, mbit, WINDOW)  # calibrated
    wanted, taken = set(), []
    for k in range(40):
        step_s = (0.17, 0.205)[k % 2]
        for p in range(4):
            wire.block_done(p, 10, 10 * step_s)
        wanted.add(choose(step_s, meeting_s((wire.link(s), 4, VALUES) for s in (0, 1)), 0.1, 0,
                          "bf16", 300).every)
        taken.append(wire.every())
    assert wanted == {1, 2}  # what the rule asks flips with the noise
    changes = sum(a != b for a, b in zip(taken, taken[1:]))
    assert changes <= 1, taken
