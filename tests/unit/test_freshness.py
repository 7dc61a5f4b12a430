"""What stale members count in a round (``sync.stale``): the pure rule, and the policy using it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from sdpipe_cli.core.grouping import Freshness, GroupScheduler
from tests.policy_sim import Sim


def test_members_at_one_pace_count_alike_and_a_straggler_pulls():
    f = Freshness(pipelines=4, stages=1, rule="pull")
    for done in (3, 6, 9):  # three fast pipelines meet every 3 pipeline-iterations
        assert f.shares(0, [0, 1, 2], done) == ((), ())
        f.note(0, [0, 1, 2], done)
    # pipeline 3 last met at 0: 12 iterations of the run ago, against 3 for the others
    assert f.staleness(0, [0, 1, 3], 12) == (3, 3, 12)
    weights, grads = f.shares(0, [0, 1, 3], 12)
    assert weights == (0.5, 0.5, 0.0) and grads == weights
    f.note(0, [0, 1, 3], 12)
    assert f.shares(0, [0, 1, 3], 15) == ((), ())  # it took the group's state: fresh again


def test_pull_weights_counts_the_stale_gradient_and_average_counts_everyone():
    for rule, grads in (("pull_weights", (1 / 3, 1 / 3, 1 / 3)), ("average", None)):
        f = Freshness(pipelines=4, stages=2, rule=rule)
        f.note(1, [0, 1], 10)  # another stage's rounds do not make stage 0 fresh
        f.note(0, [0, 1], 10)
        weights, got = f.shares(0, [0, 1, 2], 15)
        if grads is None:
            assert (weights, got) == ((), ())
        else:
            assert weights == (0.5, 0.5, 0.0) and got == pytest.approx(grads)


def test_a_healed_replica_is_as_fresh_as_its_source_and_a_resume_makes_all_fresh():
    f = Freshness(pipelines=3, stages=1, rule="pull")
    f.note(0, [0, 1], 20)
    f.healed(0, 2, source=0)
    assert f.shares(0, [0, 2], 22) == ((), ())
    f.reset(100)
    assert f.staleness(0, [0, 1, 2], 101) == (1, 1, 1)


def test_an_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="rule"):
        Freshness(2, 1, "mean")


@settings(max_examples=200, deadline=None)
@given(P=st.integers(2, 8), last=st.lists(st.integers(0, 60), min_size=2, max_size=8),
       ahead=st.integers(0, 40), rule=st.sampled_from(["pull", "pull_weights"]))
def test_shares_sum_to_one_and_the_freshest_always_counts(P, last, ahead, rule):
    members = list(range(min(len(last), P)))
    f = Freshness(P, 1, rule)
    for p in members:
        f.note(0, [p], last[p])
    done = max(last) + ahead
    weights, grads = f.shares(0, members, done)
    ages = [done - last[p] for p in members]
    if max(ages) - min(ages) <= P or len(members) < 2:
        assert (weights, grads) == ((), ())
        return
    assert sum(weights) == pytest.approx(1) and sum(grads) == pytest.approx(1)
    assert all(weights[i] > 0 for i, a in enumerate(ages) if a == min(ages))
    assert all((weights[i] == 0) == (a > min(ages) + P) for i, a in enumerate(ages))
    if rule == "pull_weights":
        assert grads == pytest.approx([1 / len(members)] * len(members))


def _straggler_run(stale: str):
    durations = [[0.010], [0.0105], [0.0095], [0.030]]  # pipeline 3 three times slower
    return Sim(4, 2, durations, [0.001] * 4, dict(
        stale=stale, patience=0.5, policy="cost_aware", global_every=20, total_iterations=400,
        twins=True)).run()


def test_the_policy_lets_only_the_straggler_pull():
    pulled = _straggler_run("pull")
    weighted = [d for _, d in pulled.decisions if d.weight_shares]
    assert weighted, "the 3x straggler never counted as stale"
    for d in weighted:
        zero = [p for p, w in zip(d.members, d.weight_shares) if w == 0]
        assert zero == [3], d
        assert not d.twins and sum(d.weight_shares) == pytest.approx(1)
    # the rule changes what a round counts, never who meets when
    plain = _straggler_run("average")
    assert not any(d.weight_shares for _, d in plain.decisions)
    assert [(d.stage, d.members, d.iterations) for _, d in plain.decisions] == \
        [(d.stage, d.members, d.iterations) for _, d in pulled.decisions]


def test_equal_pipelines_never_pull():
    r = Sim(4, 2, [[0.010, 0.012], [0.011, 0.009], [0.010], [0.0125, 0.010]], [0.001] * 4,
            dict(stale="pull", patience=0.5, policy="cost_aware", total_iterations=400)).run()
    assert not any(d.weight_shares for _, d in r.decisions)


def test_the_scheduler_refuses_an_unknown_rule():
    with pytest.raises(ValueError, match="rule"):
        GroupScheduler(2, 1, stale="bogus")
