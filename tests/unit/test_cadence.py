"""The pure decisions both training loops and the scheduler share: Cadence, checkpoints at global
syncs, throughput, placement, and clipping by the norm over a pipeline."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sdpipe_cli.config.schema import CheckpointConfig, TrainConfig
from sdpipe_cli.core.cadence import Cadence, GlobalSyncCheckpoints, Throughput, time_left
from sdpipe_cli.core.placement import Placement
from sdpipe_cli.model.optim import clip_gradients


def test_stop_evaluate_log_and_checkpoint_follow_the_config():
    c = Cadence(steps=10, eval_every=4, log_every=2, checkpoint_every=3, time_limit=5.0)
    assert [k for k in range(12) if c.local_go(k, timed_out=False)] == list(range(10))
    assert not c.local_go(0, timed_out=True)
    assert c.timed_out(5.0) and not c.timed_out(4.9) and c.timed_out(0.0, stop_requested=True)
    assert [k for k in range(1, 11) if c.evaluate_after(k)] == [4, 8]
    assert [k for k in range(1, 11) if c.final_evaluation(k)] == [1, 2, 3, 5, 6, 7, 9, 10]
    assert [k for k in range(1, 11) if c.log_after(k)] == [2, 4, 6, 8, 10]
    assert [k for k in range(11) if c.checkpoint_after(k)] == [3, 6, 9]


def test_zero_means_never_and_no_limit_means_none():
    c = Cadence(steps=3)
    assert not any(c.evaluate_after(k) or c.checkpoint_after(k) for k in range(10))
    assert all(c.final_evaluation(k) for k in range(10))
    assert not c.timed_out(1e9)
    assert not c.checkpoint_time(1e9)
    assert Cadence(steps=3, checkpoint_minutes=0.5).checkpoint_time(30.0)
    assert not Cadence(steps=3, checkpoint_minutes=0.5).checkpoint_time(29.9)


@given(st.one_of(st.none(), st.floats(0.01, 1e6)), st.floats(0.0, 2e6))
def test_a_later_leg_has_what_earlier_legs_left_of_the_time_limit(limit, spent):
    left = time_left(limit, spent)
    if limit is None:
        assert left is None
        return
    assert 0 < left <= limit  # never 0: that would mean no limit at all
    assert left == (limit - spent if spent < limit - 1e-3 else 1e-3)
    cadence = Cadence.of(TrainConfig(steps=5, eval_every=0, time_limit=limit), CheckpointConfig(),
                         spent)
    assert cadence.timed_out(left) and (left < 1e-2 or not cadence.timed_out(left * 0.99))


def test_global_sync_checkpoints_take_the_first_sync_past_each_multiple():
    ckpt = GlobalSyncCheckpoints(Cadence(steps=100, checkpoint_every=10), now=0.0)
    got = [ckpt.at_global_sync(at, final=False, now=0.0) for at in (4, 9, 12, 15, 21, 29, 30, 55)]
    assert got == [None, None, 12, None, 21, None, 30, 55]


def test_global_sync_checkpoints_on_exit_by_time_and_after_a_resume():
    c = Cadence(steps=100, checkpoint_every=0, checkpoint_minutes=1.0, checkpoint_on_exit=True)
    ckpt = GlobalSyncCheckpoints(c, now=0.0)
    assert ckpt.at_global_sync(5, final=False, now=59.0) is None
    assert ckpt.at_global_sync(6, final=False, now=60.0) == 6
    ckpt.saved(now=60.0)
    assert ckpt.at_global_sync(7, final=False, now=100.0) is None
    assert ckpt.at_global_sync(8, final=True, now=100.0) == 8
    resumed = GlobalSyncCheckpoints(Cadence(steps=100, checkpoint_every=10), now=0.0)
    resumed.resume(20)
    assert resumed.at_global_sync(25, final=False, now=0.0) is None
    assert resumed.at_global_sync(30, final=False, now=0.0) == 30


@given(st.lists(st.integers(0, 7), min_size=1, max_size=40), st.integers(1, 12))
@settings(max_examples=100, deadline=None)
def test_one_checkpoint_per_multiple_crossed(gaps, every):
    """Whatever the iterations between global syncs, each multiple of ``every`` that the run
    crosses gets exactly one checkpoint, at the first sync at or after it."""
    ckpt = GlobalSyncCheckpoints(Cadence(steps=10**6, checkpoint_every=every), now=0.0)
    at, taken = 0, []
    for gap in gaps:
        at += gap
        got = ckpt.at_global_sync(at, final=False, now=0.0)
        if got is not None:
            taken.append(got)
    crossed = {m // every for m in taken}
    assert len(crossed) == len(taken)  # never two for one multiple
    assert len(taken) == len({(a // every) for a in _sums(gaps) if a >= every})


def _sums(gaps):
    out, at = [], 0
    for gap in gaps:
        at += gap
        out.append(at)
    return out


def test_throughput_counts_from_the_end_of_the_first_iteration():
    rate = Throughput(batch_size=8)
    assert rate.iteration_done(now=10.0, done=1, iteration_s=2.0) == 4.0  # its own rate
    assert rate.iteration_done(now=11.0, done=2, iteration_s=1.0) == 8.0
    assert rate.iteration_done(now=13.0, done=4, iteration_s=1.0) == 3 * 8 / 3.0


def test_placement_is_pipeline_major():
    w = Placement.of(pipeline=2, stage=1, pipelines=3, stages=4)
    assert (w.rank, w.pipeline, w.stage, w.workers) == (9, 2, 1, 12)
    assert (w.prev_rank, w.next_rank) == (8, 10)
    assert w.replicas() == [1, 5, 9] and w.replicas([0, 2]) == [1, 9]
    assert w.pipeline_ranks() == [8, 9, 10, 11]
    assert w.server_rank() == 13
    first, last = Placement(0, 1, 2), Placement(1, 1, 2)
    assert first.first and first.prev_rank is None and last.last and last.next_rank is None


def _grads(seed: int, sizes) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.zeros(n))
        p.grad = torch.randn(n, generator=g)
        params.append(p)
    return params


@pytest.mark.parametrize("max_norm", [0.1, 1.0, 100.0])
def test_clipping_by_the_pipeline_norm_equals_clipping_the_whole_model(max_norm):
    """Two stages that sum their squared norms clip exactly as one process holding both."""
    whole = _grads(0, [5, 7, 3])
    reference = [p.grad.clone() for p in whole]
    torch.nn.utils.clip_grad_norm_(whole, max_norm)
    stages = [_grads(0, [5, 7, 3])[:2], _grads(0, [5, 7, 3])[2:]]
    squares = [sum(float(p.grad.pow(2).sum()) for p in s) for s in stages]

    def summed(other):
        def reduce(t: torch.Tensor) -> None:
            t += other
        return reduce

    norms = [clip_gradients(stages[0], max_norm, summed(squares[1])),
             clip_gradients(stages[1], max_norm, summed(squares[0]))]
    expected = math.sqrt(sum(float(g.pow(2).sum()) for g in reference))
    assert norms == pytest.approx([expected, expected], rel=1e-6)
    for got, want in zip([p.grad for s in stages for p in s], [p.grad for p in whole]):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    if max_norm < expected:
        assert math.sqrt(sum(float(p.grad.pow(2).sum()) for s in stages for p in s)) == \
            pytest.approx(max_norm, rel=1e-4)
