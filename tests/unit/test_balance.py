"""How the pipelines share a global batch (``pipeline.balance``): the pure decision, the shares a
round's members count by, the plan that carries the decision, and the config's refusals."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from sdpipe_cli.core import balance
from sdpipe_cli.core.grouping import Freshness
from sdpipe_cli.core.grouping.prediction import AWAIT_PACE_RATIO
from sdpipe_cli.core.replan import pipeline_ms

P, S, M = 4, 2, 4


def _blocks(slowdowns, blocks: int = 4) -> list[list[list[float]]]:
    """Block times of pipelines slowed by ``slowdowns`` (every block alike)."""
    return [[[float(r)] * blocks for _ in range(S)] for r in slowdowns]


def _decide(slowdowns, pace=math.inf, m=M, grain=1, schedule="1f1b"):
    return balance.decide(_blocks(slowdowns), [[2]] * len(slowdowns), m, grain, schedule, pace)


def test_equal_pipelines_keep_equal_shares():
    got = _decide([1, 1, 1, 1])
    assert got.microbatches == (M,) * P and got.why == "equal speeds" and not got.balanced


def test_a_mildly_slower_pipeline_gives_up_a_micro_batch_and_keeps_the_pace():
    got = _decide([1, 1, 1, 1.3])
    # 1F1B on two stages: (m + 1) slots; 1.3 x 4 = 5.2 against the others' 5 (within SLACK)
    assert got.microbatches == (4, 4, 4, 3) and got.why == "balanced"
    assert got.predicted > got.equal  # under all-reduce the three waited for it


def test_the_share_falls_with_the_slowdown():
    assert _decide([1, 1, 1, 1.6]).microbatches == (4, 4, 4, 2)
    assert _decide([1, 1, 1, 2]).microbatches == (4, 4, 4, 1)
    # sdpipe: only shares that do not run ahead of the others (2 of 4 at 1.6x takes 4.8 slots
    # against 5; at 1.7x, 5.1)
    assert _decide([1, 1, 1, 1.6], pace=AWAIT_PACE_RATIO).microbatches == (4, 4, 4, 4)
    assert _decide([1, 1, 1, 1.7], pace=AWAIT_PACE_RATIO).microbatches == (4, 4, 4, 2)


def test_sdpipe_keeps_a_pipeline_it_cannot_pace_on_its_own_way_and_all_reduce_balances_it():
    # 3x: even one micro-batch takes (1 + 1) x 3 = 6 slots against 5; 2x: one takes 4, running
    # ahead of the others. sdpipe lets it go at its own pace with a whole batch; all-reduce
    # waits for it either way, so less of a wait is better
    for slow in (2, 3):
        got = _decide([1, 1, 1, slow], pace=AWAIT_PACE_RATIO)
        assert got.microbatches == (4, 4, 4, 4) and got.why == "no share keeps the pace"
    assert _decide([1, 1, 1, 3]).microbatches == (4, 4, 4, 1)


def test_a_pipeline_no_share_fits_but_within_the_pace_bound_is_waited_for_and_others_still_balance():
    # 1.08x: 3 micro-batches run ahead, 4 are 8 % long (past SLACK) but within sdpipe's pace bound
    got = _decide([1, 1, 1.08, 1.3], pace=AWAIT_PACE_RATIO)
    assert got.microbatches == (4, 4, 4, 3) and got.why == "balanced"


def test_a_share_that_costs_more_than_going_alone_is_not_taken():
    # eight stages: one micro-batch of the 1.9x pipeline fits the others' iteration, but its
    # pipeline then idles 7 slots of 8, and going alone with a whole batch is predicted 13 % faster
    deep = [[[r] * 16 for _ in range(8)] for r in (1, 1, 1, 1.9)]  # 16 blocks, 2 a stage
    got = balance.decide(deep, [list(range(2, 16, 2))] * 4, 8, 1, "1f1b", AWAIT_PACE_RATIO)
    assert got.microbatches == (8, 8, 8, 8) and got.why == "stragglers left behind"
    assert got.equal > got.predicted * (1 + balance.ALONE_MARGIN) or got.predicted == got.equal


def test_interleaved_schedules_take_micro_batches_in_groups_of_the_stages():
    got = balance.decide(_blocks([1, 1, 1, 2], blocks=8), [[2, 4, 6]] * 4, 8, 2,
                         "interleaved_1f1b", math.inf)
    assert all(k % 2 == 0 for k in got.microbatches) and got.microbatches[3] < 8


@settings(max_examples=150, deadline=None)
@given(slow=st.lists(st.floats(1.0, 5.0), min_size=2, max_size=6), m=st.integers(1, 12),
       lock_step=st.booleans())
def test_a_decision_stays_within_the_batch_and_never_favours_the_slower(slow, m, lock_step):
    pace = math.inf if lock_step else AWAIT_PACE_RATIO
    got = _decide(slow, pace=pace, m=m)
    assert all(1 <= k <= m for k in got.microbatches)
    order = sorted(range(len(slow)), key=lambda p: slow[p])
    shares = [got.microbatches[p] for p in order]
    # a slower pipeline never takes more, unless it goes its own way with the whole batch
    assert all(b <= a or b == m for i, a in enumerate(shares) for b in shares[i + 1:])
    if got.balanced:
        assert got.predicted >= got.equal / (1 + balance.ALONE_MARGIN) - 1e-12
        if not lock_step:  # every smaller share keeps the fastest one's pace, never ahead of it
            fastest = pipeline_ms(_blocks(slow)[order[0]], [2], m)
            for p, k in enumerate(got.microbatches):
                if k < m:
                    t = pipeline_ms(_blocks(slow)[p], [2], k)
                    assert fastest * (1 - 1e-9) <= t <= fastest * (1 + balance.SLACK) + 1e-9


def test_shares_weigh_by_samples_and_vanish_when_equal():
    assert balance.shares([4, 4, 4]) == ()
    assert balance.shares([4, 4, 4, 3]) == pytest.approx((4 / 15, 4 / 15, 4 / 15, 3 / 15))


def test_round_members_count_by_their_samples():
    f = Freshness(pipelines=4, stages=1, rule="pull", samples=(4, 4, 4, 2))
    weights, grads = f.shares(0, [0, 3], done=2)
    assert weights == pytest.approx((4 / 6, 2 / 6)) and grads == weights
    # twins (the same weights already): only the gradients are averaged, still by samples
    assert f.shares(0, [1, 3], 2, twins=True) == ((), pytest.approx((4 / 6, 2 / 6)))
    assert f.shares(0, [0, 1], 2) == ((), ())  # equal samples: the plain mean
    # a stale member still pulls: it counts nothing, whatever its samples
    f.note(0, [0, 1, 2], 20)
    weights, grads = f.shares(0, [0, 3], done=21)
    assert weights == (1.0, 0.0) and grads == weights
    assert Freshness(4, 1, "pull_weights", (4, 4, 4, 2)).shares(0, [0, 3], 2)[1] == \
        pytest.approx((4 / 6, 2 / 6))


def test_samples_for_every_pipeline_are_required():
    with pytest.raises(ValueError, match="samples"):
        Freshness(4, 1, "pull", samples=(4, 4))


# -- the config and the plan -------------------------------------------------------------------
MLP = ["model=mlp", "data=synthetic", "cluster.device=cpu", "cluster.pipelines=4"]


@pytest.mark.parametrize("overrides, reason", [
    (["pipeline.balance=fast"], "is 'fast'; choose one of equal, speed"),
    (["pipeline.balance=speed", "sync=ps"], "sync=ps does not: use sync=sdpipe or allreduce"),
    (["pipeline.balance=speed", "pipeline.schedule=async_1f1b"], "async_1f1b does not flush"),
])
def test_what_balance_refuses_is_one_line(overrides, reason, tmp_path, capsys):
    from sdpipe_cli.cli.parsing import main
    from sdpipe_cli.config.composition import compose
    from sdpipe_cli.config.schema import ConfigError
    from sdpipe_cli.config.validation import validate
    from tests.helpers import one_error_line

    with pytest.raises(ConfigError, match=reason) as info:
        validate(compose([*MLP, *overrides]))
    assert info.value.key == "pipeline.balance"
    run = tmp_path / "run"
    assert main(["train", *MLP, *overrides, f"run.dir={run}"]) == 2
    assert reason in one_error_line(capsys.readouterr().err, "pipeline.balance")
    assert not run.exists()


def test_the_plan_carries_each_pipeline_s_share_and_checks_it():
    from omegaconf import OmegaConf

    from sdpipe_cli.cli import preparing
    from sdpipe_cli.config.composition import compose
    from sdpipe_cli.core.errors import BadInput
    from sdpipe_cli.core.plan import RunPlan

    slow = ["cluster.slowdown=[1,1,1,1.3]", "train.batch_size=8"]
    cfg, _, _ = preparing.prepare(compose([*MLP, *slow, "pipeline.balance=speed"]))
    plan = RunPlan.of(cfg)
    assert plan.microbatches == (4, 4, 4, 3) and plan.balanced
    assert [plan.batch_of(p) for p in range(4)] == [8, 8, 8, 6]
    equal, _, _ = preparing.prepare(compose([*MLP, *slow]))
    assert RunPlan.of(equal).microbatches == (4, 4, 4, 4)  # the default: equal shares
    bad = OmegaConf.to_container(cfg)
    bad["plan"]["microbatches"] = [4, 4, 9, 3]  # more than pipeline.microbatches
    with pytest.raises(BadInput, match="plan"):
        RunPlan.of(OmegaConf.create(bad))


def test_all_reduce_is_built_with_its_pipeline_s_share():
    import torch

    from sdpipe_cli.core.placement import Placement
    from sdpipe_cli.sync.allreduce import AllReduceSync
    from sdpipe_cli.sync.base import Wiring

    def share(p: int, samples: tuple[int, ...]):
        wiring = Wiring(None, None, Placement.of(p, 0, 3, 2), torch.device("cpu"), samples=samples)
        return AllReduceSync.build(None, wiring).share

    assert share(0, (4, 4, 3)) == pytest.approx(4 / 11) and share(2, (4, 4, 3)) == pytest.approx(3 / 11)
    assert share(0, (4, 4, 4)) is None  # equal shares: the plain mean


def test_the_simulator_runs_each_pipeline_on_its_own_share():
    import dataclasses

    from sdpipe_cli.cli import preparing
    from sdpipe_cli.config.composition import compose
    from sdpipe_cli.core import simulation
    from sdpipe_cli.hetero import simulated_run

    cfg, _, _ = preparing.prepare(compose([*MLP, "cluster.compute_ms=10", "cluster.slowdown=[1,1,1,1.3]",
                                           "train.batch_size=8", "train.steps=20", "sync=allreduce",
                                           "pipeline.balance=speed"]))
    work = simulated_run.workload(cfg)
    assert work.shares == [4, 4, 4, 3]
    balanced = simulation.simulate(work, "allreduce")
    equal = simulation.simulate(dataclasses.replace(work, shares=[]), "allreduce")
    assert balanced.samples() == [160, 160, 160, 120]  # 20 iterations of 4 and 3 micro-batches of 2
    assert balanced.wall_s < 0.9 * equal.wall_s  # all-reduce no longer waits 30 % for the slow one
    assert balanced.samples_per_s > equal.samples_per_s
