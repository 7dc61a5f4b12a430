"""The discrete-event simulator (``sdpipe_cli/core/simulation.py``) and its config builder
(``sdpipe_cli/hetero/simulated_run.py``): exact timings where the model has a closed form, the sync
modes' known bounds, determinism, and the real policy's behaviour at a scale no test could run."""

from __future__ import annotations

import pytest

from sdpipe_cli.cli.preparing import prepare
from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.config.validation import validate
from sdpipe_cli.core.grouping import make_policy
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.core.simulation import simulate
from sdpipe_cli.hetero import simulated_run

BASE = ["model=mlp", "data=synthetic", "cluster.compute_ms=10", "simulate.jitter=0",
        "simulate.p2p_ms=0", "simulate.rtt_ms=0", "simulate.collective_ms=0", "simulate.event_ms=0"]


def config(*overrides: str):
    cfg = compose([*BASE, *overrides])
    validate(cfg)
    return prepare(cfg)[0]


def run(cfg, sync: str | None = None):
    sync = sync or cfg.sync.name
    return simulate(simulated_run.workload(simulated_run._with_sync(cfg, sync)), sync,
                    lambda clock: make_policy(cfg, RunPlan.of(cfg), clock, evaluations=False))


@pytest.mark.parametrize("stages, schedule", [(1, "1f1b"), (2, "1f1b"), (4, "1f1b"), (2, "gpipe")])
def test_a_solo_pipeline_takes_the_flushed_schedules_time(stages, schedule):
    """Without sync, jitter or transport an iteration of S stages and m micro-batches takes
    (m + S - 1) x (forward + backward): the flushed schedules' known makespan."""
    cfg = config("cluster.pipelines=2", f"pipeline.stages={stages}",
                 f"pipeline.schedule={schedule}", "train.steps=5", "sync=none")
    r = run(cfg)
    m = cfg.pipeline.microbatches
    iteration = (m + stages - 1) * 0.030
    assert r.iterations == [5, 5]
    assert r.finished_at == pytest.approx([5 * iteration] * 2)
    assert r.solo_rates() == pytest.approx([cfg.train.batch_size / iteration] * 2)


@pytest.mark.parametrize("stages, m", [(2, 4), (4, 8), (4, 3)])
def test_a_solo_zero_bubble_pipeline_takes_its_timelines_time(stages, m):
    """ZB-H1 (a backward as B and W, half each): an iteration takes its own tick order's
    length, a forward a tick, fewer than 1F1B's 3 (m + S - 1) (tests/unit/test_schedule.py)."""
    from sdpipe_cli.core.schedule import tick_order, zero_bubble_h1

    cfg = config("cluster.pipelines=1", f"pipeline.stages={stages}", "pipeline.schedule=zb_h1",
                 f"pipeline.microbatches={m}", "train.batch_size=24", "train.steps=5", "sync=none")
    iteration = len(tick_order(zero_bubble_h1, stages, m)[0]) * 0.010
    assert iteration < 3 * (m + stages - 1) * 0.010
    assert run(cfg).finished_at == pytest.approx([5 * iteration])


@pytest.mark.parametrize("stages, chunks, m", [(2, 2, 4), (4, 2, 8), (4, 3, 4)])
def test_a_solo_interleaved_pipeline_takes_its_timelines_time(stages, chunks, m):
    """Interleaved 1F1B: each chunk's action 1 / v of the stage's, its input from the virtual
    stage before (the first stage's later chunks from the last stage): an iteration takes its
    own tick order's length, a chunk's forward a tick and its backward two, shorter than
    1F1B's 3 (m + S - 1) stage-forwards."""
    from sdpipe_cli.core.interleaved import interleaved_1f1b
    from sdpipe_cli.core.schedule import Kind, tick_order

    cfg = config("cluster.pipelines=1", f"pipeline.stages={stages}", f"model.n_layers={stages * chunks}",
                 "pipeline.schedule=interleaved_1f1b", f"pipeline.chunks={chunks}",
                 f"pipeline.microbatches={m}", "train.batch_size=24", "train.steps=5", "sync=none")
    ticks = len(tick_order(interleaved_1f1b(chunks), stages, m, {Kind.B: 2}, chunks=chunks)[0])
    iteration = ticks * 0.010 / chunks
    assert iteration < 3 * (m + stages - 1) * 0.010
    assert run(cfg).finished_at == pytest.approx([5 * iteration])


@pytest.mark.parametrize("stages, schedule", [(1, "1f1b"), (2, "1f1b"), (3, "1f1b"), (4, "gpipe"),
                                              (4, "zb_h1"), (4, "interleaved_1f1b")])
def test_fused_actions_time_an_iteration_as_the_actions_one_by_one(stages, schedule):
    """With one scale per stage and iteration the simulator times the fused plan (runs of a
    stage's actions that no other stage waits for, summed). Stragglers that never straggle
    force the action-by-action path, with the same durations: the runs must agree, with
    slow-downs, jitter, links and sdpipe's rounds in play."""
    chunks = ("pipeline.chunks=2", "model.n_layers=6") if schedule == "interleaved_1f1b" else ()
    common = ("cluster.pipelines=3", f"pipeline.stages={stages}", f"pipeline.schedule={schedule}",
              *chunks, "pipeline.microbatches=4", "train.steps=12", "cluster.slowdown=[1,1.7,3]",
              "simulate.jitter=0.1", "simulate.p2p_ms=1", "simulate.rtt_ms=2",
              "simulate.collective_ms=3")
    fused = run(config(*common))
    one_by_one = run(config(*common, "cluster.stragglers.probability=1e-12",
                            "cluster.stragglers.factor=3", "cluster.stragglers.per=microbatch"))
    assert one_by_one.iterations == fused.iterations
    assert one_by_one.finished_at == pytest.approx(fused.finished_at, rel=1e-9)
    assert one_by_one.busy_s == pytest.approx(fused.busy_s, rel=1e-9)
    assert one_by_one.group_sizes == fused.group_sizes


def test_allreduce_runs_at_the_slowest_pipelines_pace():
    cfg = config("cluster.pipelines=4", "cluster.slowdown=[1,1,1,3]", "train.steps=20",
                 "sync=allreduce")
    r = run(cfg)
    slow = (cfg.pipeline.microbatches + 1) * 0.030 * 3
    assert r.wall_s == pytest.approx(20 * slow)
    assert r.mean_group_size == 4


@pytest.mark.parametrize("local_steps", [1, 4, 20])
def test_diloco_meets_every_local_steps_and_is_lock_step_there(local_steps):
    """One outer step (a barrier and an all-reduce of the stage) every ``local_steps``
    iterations; with 1 it is all-reduce's timing, and whatever the count the straggler, met
    at each outer step, still ends the run."""
    cfg = config("cluster.pipelines=4", "cluster.slowdown=[1,1,1,3]", "train.steps=20",
                 "sync=diloco", f"sync.local_steps={local_steps}")
    r = run(cfg)
    stages = cfg.pipeline.stages
    assert len(r.group_sizes) == stages * (20 // local_steps)  # a group of 4 per stage, outer step
    assert set(r.group_sizes) == {4}
    slow = (cfg.pipeline.microbatches + 1) * 0.030 * 3
    assert r.wall_s == pytest.approx(20 * slow)
    if local_steps == 1:
        assert r.wall_s == pytest.approx(run(cfg, "allreduce").wall_s)


def test_sdpipe_reaches_the_limit_on_a_straggler_pattern():
    """[1, 1, 1, 3] at zero transport cost and without jitter: the cost-aware policy reaches
    >= 0.95 of the limit (each pipeline's solo rate, summed), all-reduce 4 x the slowest rate
    (0.4 of it). (With 10 % jitter per iteration the equal replicas wait for each other to form
    full groups, as all-reduce's would: 0.90; docs/SIMULATOR.md.)"""
    cfg = config("cluster.pipelines=4", "cluster.slowdown=[1,1,1,3]", "train.steps=60")
    doc = simulated_run.run(cfg, ["allreduce", "none"])
    assert doc["sync"] == "sdpipe"
    assert doc["fraction_of_limit"] >= 0.95, doc["fraction_of_limit"]
    allreduce = next(r for r in doc["compare"] if r["sync"] == "allreduce")
    assert allreduce["fraction_of_limit"] == pytest.approx(0.4, abs=0.05)
    assert sum(doc["iterations"]) == 4 * 60  # the budget is exact
    assert doc["iterations"][3] < doc["iterations"][0]  # fast pipelines do more


@pytest.mark.parametrize("slowdown", ["[1,1,1,1.1]", "[1.06,1.06,1.06,1]"])
def test_replicas_a_little_apart_in_speed_meet_in_full_rounds(slowdown):
    """With the default jitter, a replica 1.1x slower than the others, or 1.06x faster, is
    waited for and stays in their phase: rounds of all four, the replicas as close as
    all-reduce's (its drift here: 0.58). A pipeline's measured speed lies further from its
    peers' than its device's ratio, and with the policy's bound at 1.1 these replicas fell on
    either side of it from round to round (mean groups 2.92 and 3.41, drift 0.66 and 0.70)."""
    cfg = compose(["model=mlp", "data=synthetic", "cluster.pipelines=4", "pipeline.stages=2",
                   "cluster.compute_ms=10", "sync=sdpipe", f"cluster.slowdown={slowdown}",
                   "train.steps=200"])
    validate(cfg)
    doc = simulated_run.run(prepare(cfg)[0], [])
    assert doc["mean_group_size"] >= 3.8, doc["mean_group_size"]
    assert doc["consensus"] <= 0.6, doc["consensus"]


def test_the_same_config_simulates_the_same_run():
    cfg = config("cluster=hetero_random", "train.steps=30", "simulate.jitter=0.1")
    a, b = run(cfg), run(cfg)
    assert (a.iterations, a.finished_at, a.group_sizes) == (b.iterations, b.finished_at, b.group_sizes)


def test_the_policy_setting_reaches_the_simulated_policy():
    """sync.policy and sync.max_group change what the simulation does: it runs the real policy."""
    sizes = {}
    for cap in (0, 2):
        r = run(config("cluster.pipelines=8", "train.steps=20", f"sync.max_group={cap}"))
        sizes[cap] = max(r.group_sizes)
        assert r.global_sizes and set(r.global_sizes) == {8}  # global syncs are never capped
    assert sizes[2] == 2 and sizes[0] > 2


def test_the_scheduler_expects_the_evaluations_the_simulator_does_not_model():
    """train.eval_every reaches the policy of a real run; the simulator's workers never evaluate,
    so its policy expects no pause."""
    cfg = config("train.eval_every=7")
    assert make_policy(cfg, RunPlan.of(cfg)).evaluate_every == 7
    assert make_policy(cfg, RunPlan.of(cfg), evaluations=False).evaluate_every == 0


def test_speed_changes_and_links_are_in_the_timing():
    """hetero_mixed: two generations, a slow cross-node link, a device slowed mid-run."""
    cfg = config("cluster=hetero_mixed", "train.steps=40")
    doc = simulated_run.run(cfg, ["none"])
    solo = doc["solo_samples_per_s"]
    assert solo[2] < 0.6 * solo[0]  # the old node's pipeline runs at half speed or less
    assert 0 < doc["fraction_of_limit"] <= 1.0 + 1e-9


def test_what_cannot_be_simulated_is_named():
    with pytest.raises(ConfigError, match="cluster.compute_ms"):
        simulated_run.workload(prepare(compose(["model=mlp", "data=synthetic"]))[0])
    with pytest.raises(ConfigError, match="pipeline.schedule"):
        simulated_run.workload(config("pipeline.schedule=async_1f1b"))
    with pytest.raises(ConfigError, match="--compare"):
        simulated_run.run(config("train.steps=2"), ["gossip"])


def test_the_simulated_traffic_is_what_the_workers_count():
    """All-reduce: every pipeline-iteration each stage's P members send 2(P-1)/P of its weights'
    bytes (the ring), so 2(P-1)/P x the model's bytes per pipeline-iteration; between nodes when
    the replicas are on different nodes. sdpipe's full rounds send weights and gradients: twice."""
    nodes = "cluster.nodes=[{name: a, devices: [{}, {}]}, {name: b, devices: [{}, {}]}]"
    cfg = config("cluster.pipelines=2", "pipeline.stages=2", "train.steps=10", nodes,
                 "cluster.links.cross_node.latency_ms=1")
    work = simulated_run.workload(cfg)
    model_bytes, batch = sum(work.stage_bytes), cfg.train.batch_size
    allreduce = run(cfg, "allreduce")
    assert allreduce.sync_bytes_per_sample == pytest.approx(2 * 1 / 2 * model_bytes / batch)
    assert set(allreduce.sent_bytes) == {"cross_node"}
    assert 0 < allreduce.comm_share < 1
    assert run(cfg, "none").sync_bytes_per_sample == 0 and run(cfg, "none").comm_share == 0
    sdpipe = run(cfg, "sdpipe")
    assert sdpipe.sync_bytes_per_sample <= 2 * allreduce.sync_bytes_per_sample * 1.0001


SLOW = ("cluster.pipelines=4", "pipeline.stages=2", "train.steps=48", "cluster=slow_links",
        "cluster.compute_ms=10", "cluster.slowdown=[1,1,1,3]")


def test_meetings_every_h_divide_the_rounds_and_bf16_halves_their_bytes():
    """sync.every=4: a replica meets after every 4th iteration, so a quarter of the group rounds;
    sync.precision=bf16: each group round sends half the bytes (global syncs stay float32). The
    budget is still exact, and fast pipelines still do more."""
    every1 = run(config(*SLOW, "sync.every=1", "sync.precision=fp32", "sync.average=weights",
                        "sync.global_every=0"))
    every4 = run(config(*SLOW, "sync.every=4", "sync.precision=bf16", "sync.global_every=0"))
    for r in (every1, every4):
        assert sum(r.iterations) == 4 * 48 and r.iterations[3] < r.iterations[0]
    assert len(every4.group_sizes) < len(every1.group_sizes) / 3
    # bytes per sample: group rounds a quarter as often, at half the bytes, plus the final global
    assert every4.sync_bytes_per_sample < every1.sync_bytes_per_sample / 5
    assert every4.samples_per_s > 1.15 * every1.samples_per_s


def test_on_a_slow_link_the_launcher_chooses_meetings_that_fit_the_wire_share():
    """sync.every=0 and sync.precision=auto (the defaults) resolve from the emulated links when
    the run is prepared: every iteration in float32 where nothing is emulated, int8 and H > 1
    on slow_links, where sdpipe's simulated samples/s then rise above every iteration's (the
    mlp is small: a float32 meeting per iteration costs it a quarter of its time there)."""
    fast = config("cluster.pipelines=4", "train.steps=48")
    assert (fast.sync.every, fast.sync.precision) == (1, "fp32")
    slow = config(*SLOW)
    assert slow.sync.every > 1 and slow.sync.precision == "int8"
    given = config(*SLOW, "sync.every=3")
    assert (given.sync.every, given.sync.precision) == (3, "int8")
    doc = simulated_run.run(slow, ["allreduce"])
    every1 = run(config(*SLOW, "sync.every=1", "sync.precision=fp32"))
    assert doc["samples_per_s"] > 1.2 * every1.samples_per_s
    assert doc["fraction_of_limit"] >= 0.8, doc["fraction_of_limit"]
    allreduce = doc["compare"][0]
    assert doc["sync_bytes_per_sample"] < allreduce["sync_bytes_per_sample"] / 4


def test_an_asynchronous_schedule_on_slow_links_meets_every_update():
    """Meetings need a flushed schedule: async 1F1B on slow_links keeps one round per update in
    float32 instead of failing on a workload the simulator cannot build."""
    cfg = config(*SLOW, "pipeline.schedule=async_1f1b")
    assert (cfg.sync.every, cfg.sync.precision) == (1, "fp32")


def test_with_healing_on_slow_links_meetings_stay_in_float32():
    """A healed replica takes its anchor from its source, which a global sync in between would
    leave behind: under fault.on_pipeline_loss=restart the launcher chooses meetings apart in
    float32, never bf16."""
    cfg = config(*SLOW, "fault.on_pipeline_loss=restart")
    assert cfg.sync.every > 1 and cfg.sync.precision == "fp32"


def _replan_config(tmp_path, sync: str, *overrides: str):
    import json

    from tests.helpers import make_doc

    doc = make_doc({"local:0": (1.0, [2.0] * 16)}, model="mlp")
    doc["model"]["block_params"] = [1000] * 16
    (tmp_path / "profile.json").write_text(json.dumps(doc))
    base = [b for b in BASE if not b.startswith("cluster.compute_ms")]
    cfg = compose([*base, "model.n_layers=14", f"sync={sync}", "cluster.pipelines=4",
                   "pipeline.stages=4", "train.steps=300", "cluster.emulation=modelled",
                   f"profile={tmp_path / 'profile.json'}", "fault.on_slowdown=replan",
                   "cluster.changes=[{device: 'local:9', speed: 0.25, start: 30.0}]", *overrides])
    validate(cfg)
    return prepare(cfg)[0]


def test_a_simulated_replan_of_a_lock_step_run_finishes_the_budget_sooner(tmp_path):
    """allreduce waits for pipeline 2, whose stage 1 (device local:9) drops to a quarter at 30 s:
    re-split [4, 8, 12] -> [5, 6, 11] a few iterations later, the rest of the budget goes faster,
    restart included."""
    replan = simulated_run.run(_replan_config(tmp_path, "allreduce"))["replan"]
    assert (replan["device"], replan["pipeline"], replan["stage"]) == ("local:9", 2, 1)
    assert replan["go"] and replan["partition"] == [4, 8, 12] and replan["proposed"] == [5, 6, 11]
    assert 30.0 < replan["switch_s"] < 35.0
    assert replan["with_s"] < replan["without_s"]
    assert replan["with_samples_per_s"] > 1.15 * replan["without_samples_per_s"]


def test_a_simulated_sdpipe_run_re_splits_only_the_slow_pipeline(tmp_path):
    """sdpipe averages per segment, so only pipeline 2 is split anew. Its pipeline is then
    still slower than the others by more than the policy waits for (1.1x), so the others go on
    at their pace and the prediction says it pays (the old model had the groups wait for any
    pipeline within 1.5x, and declined). Slowed at 30 s of a 55 s run, the simulated gain and
    the moving cost about cancel."""
    replan = simulated_run.run(_replan_config(tmp_path, "sdpipe"))["replan"]
    assert replan["partition"] == [4, 8, 12]
    assert replan["proposed"] == [[4, 8, 12], [4, 8, 12], [5, 6, 11], [4, 8, 12]]
    assert replan["go"] and replan["rate_new"] > 1.1 * replan["rate_now"]
    assert replan["with_s"] == pytest.approx(replan["without_s"], rel=0.02)


def test_a_simulated_zb_h1_run_re_splits_the_slowed_pipeline_too(tmp_path):
    """Re-planning takes the same decision under ZB-H1 (splitting each backward leaves the
    blocks' times as they are): slowed at 15 s of a run of about 40, pipeline 2 is split anew and
    the run ends sooner than without (by 1 %: the zero-bubble run is about 30 % shorter than 1F1B's
    55 s, so less of it is left to gain on)."""
    replan = simulated_run.run(_replan_config(
        tmp_path, "sdpipe", "pipeline.schedule=zb_h1",
        "cluster.changes=[{device: 'local:9', speed: 0.25, start: 15.0}]"))["replan"]
    assert replan["proposed"][2] == [5, 6, 11] and replan["go"]
    assert replan["with_s"] < replan["without_s"] < 45.0


def test_a_simulated_interleaved_run_re_splits_its_pieces_around_the_slow_stage(tmp_path):
    """Two chunks a stage: the split is into eight pieces, pieces 1 and 5 on stage 1 (device
    local:9, at a quarter of its speed from 30 s). Each piece needs a block, so the slow stage
    keeps two, at four times their cost: the re-split pays less than 1F1B's [5, 6, 11], which
    gives it one (with_samples_per_s 1.05x without, against 1.15x), and is still taken. The
    split is judged by the schedule's own timeline: balancing only the stages' sums gave pieces
    of 1 and 4 blocks on one stage, whose bubbles ate the gain (the simulated run no faster)."""
    replan = simulated_run.run(_replan_config(tmp_path, "allreduce", "pipeline.schedule=interleaved_1f1b",
                                              "pipeline.chunks=2"))["replan"]
    assert replan["go"] and replan["partition"] == [2, 4, 6, 8, 10, 12, 14]
    edges = [0, *replan["proposed"], 16]
    assert [edges[k + 1] - edges[k] for k in (1, 5)] == [1, 1]  # the slow stage's pieces
    assert replan["with_s"] < 0.97 * replan["without_s"]


def test_uneven_chunks_take_their_own_share_of_their_stage_s_time(tmp_path):
    """Interleaved stages timed from a profile: each chunk's actions take its own blocks' share
    of the stage's time, as emulation sleeps them, not 1 / v each (stage 0 holds one block and
    three, so a quarter and three quarters)."""
    import json

    from sdpipe_cli.core.simulation import _Run
    from tests.helpers import make_doc

    doc = make_doc({"local:0": (1.0, [2.0] * 8)}, model="mlp")
    (tmp_path / "profile.json").write_text(json.dumps(doc))
    base = [b for b in BASE if not b.startswith("cluster.compute_ms")]
    cfg = prepare(compose([*base, "model.n_layers=6", "cluster.pipelines=1", "pipeline.stages=2",
                           "pipeline.schedule=interleaved_1f1b", "pipeline.chunks=2",
                           "pipeline.partition=[1,3,6]", "cluster.emulation=modelled",
                           f"profile={tmp_path / 'profile.json'}", "sync=none"]))[0]
    work = simulated_run.workload(cfg)
    assert work.chunk_forward[0] == [[0.25, 0.75], [0.5, 0.5]]  # blocks [0] + [3,4,5]; [1,2] + [6,7]
    assert work.chunk_backward == work.chunk_forward
    run = _Run(work, "none", None)
    costs = {}
    for (stage, backward, _), chunk, cost in zip(run.plans[0].steps, run.plans[0].chunk, run.action_s[0]):
        costs[(stage, backward, chunk)] = cost
    assert costs[(0, False, 1)] == pytest.approx(3 * costs[(0, False, 0)])
    assert costs[(0, False, 0)] + costs[(0, False, 1)] == pytest.approx(work.forward_s[0][0])
    assert costs[(1, True, 0)] == pytest.approx(costs[(1, True, 1)])


def test_no_replan_section_without_a_slowdown(tmp_path):
    assert "replan" not in simulated_run.run(_replan_config(tmp_path, "allreduce",
                                                           "cluster.changes=[]"))


def test_a_mode_without_segments_is_compared_on_one_split(tmp_path):
    """With pipeline 2 split its own way, sdpipe is simulated so; all-reduce, which cannot run
    that way, on the shared split: its row is the one of the run without ``pipeline.partitions``."""
    own = simulated_run.run(_replan_config(tmp_path, "sdpipe", "cluster.changes=[]",
                                           "pipeline.partitions={2: [5, 6, 11]}"), ["allreduce"])
    one = simulated_run.run(_replan_config(tmp_path, "sdpipe", "cluster.changes=[]"),
                            ["allreduce"])
    assert own["compare"][0]["samples_per_s"] == one["compare"][0]["samples_per_s"]
    assert own["samples_per_s"] != one["samples_per_s"]  # sdpipe's own row: its split
