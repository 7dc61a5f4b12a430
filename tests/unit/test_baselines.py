"""The comparison baselines: gossip (adpsgd) and parameter server (ps), and the slow-down hook."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from sdpipe_cli.core.schedule import Action
from sdpipe_cli.hetero.emulation import EmulatedSlowdown
from sdpipe_cli.sync.strategies import GossipSync

FAST = ("model=mlp", "data=synthetic", "train.batch_size=8", "cluster.pipelines=3",
        "train.eval_every=0")


def _peers(pipelines: int, stage: int, step: int, seed: int = 0) -> list:
    return [GossipSync(None, p, pipelines, stage, 2, seed, None).peer(step) for p in range(pipelines)]


@given(st.integers(1, 9), st.integers(0, 3), st.integers(0, 10_000), st.integers(0, 5))
def test_gossip_pairs_agree_on_both_sides(pipelines, stage, step, seed):
    """Each replica derives its peer alone; the pairing must be a matching both sides agree on."""
    peers = _peers(pipelines, stage, step, seed)
    for p, q in enumerate(peers):
        if q is not None:
            assert q != p and peers[q] == p
    assert sum(q is None for q in peers) == pipelines % 2


def test_gossip_pairs_change_between_rounds():
    assert len({tuple(_peers(4, 0, k)) for k in range(20)}) > 1


@pytest.mark.parametrize("factor, measured, expected", [(3.0, 0.01, 0.02), (1.0, 0.01, 0.0)])
def test_measured_slowdown_sleeps_the_missing_time(factor, measured, expected):
    slept = []
    EmulatedSlowdown(factor, sleep=slept.append)(Action("F", 0), measured)
    assert sum(slept) == pytest.approx(expected)


def test_modelled_slowdown_charges_a_fixed_budget_and_counts_overruns():
    slept = []
    hook = EmulatedSlowdown(2.0, compute_ms=10, sleep=slept.append)
    hook(Action("F", 0), 0.004)  # forward: 10 ms x 2 = 20 ms budget
    hook(Action("B", 0), 0.010)  # backward: twice the forward
    hook(Action("F", 1), 0.050)  # real compute over budget: no sleep, counted
    assert slept == pytest.approx([0.016, 0.030])
    assert hook.overruns == 1
