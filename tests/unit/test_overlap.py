"""``sync.overlap``'s delayed merge (sdpipe_cli.sync.overlap): the round's average runs on
copies while the replica trains on, and is merged as the average plus what was learned since."""

from __future__ import annotations

import threading

import pytest
import torch

from sdpipe_cli.sync.overlap import Behind


def _mean_with(other: list[torch.Tensor], gate: threading.Event):
    """An 'all-reduce' with one other member holding ``other``: the mean, once ``gate`` opens."""
    def average(copies):
        gate.wait(5)
        for c, o in zip(copies, other):
            c.add_(o).div_(2)
    return average


def test_the_late_merge_is_the_average_plus_what_the_replica_learned_since_it_sent():
    live = [torch.tensor([1.0, 2.0]), torch.tensor([[4.0]])]
    other = [torch.tensor([3.0, 6.0]), torch.tensor([[0.0]])]
    gate = threading.Event()
    behind = Behind(live, _mean_with(other, gate), due=7, group=([0, 1], [0, 0]), moved=8.0)
    live[0] += torch.tensor([0.5, -0.5])  # two local steps while the average runs
    live[1] -= 1.0
    assert not behind.done()
    gate.set()
    behind.merge(live)
    assert torch.equal(live[0], torch.tensor([2.5, 3.5]))  # mean [2, 4] + [0.5, -0.5]
    assert torch.equal(live[1], torch.tensor([[1.0]]))  # mean 2 - 1
    assert behind.error is None and behind.seconds > 0 and behind.due == 7


def test_with_no_step_in_between_the_merge_is_the_average_exactly():
    live = [torch.randn(5)]
    other = [torch.randn(5)]
    expected = (live[0] + other[0]) / 2
    gate = threading.Event()
    gate.set()
    behind = Behind(live, _mean_with(other, gate), due=0, group=([0, 1], [0, 0]), moved=0.0)
    behind.merge(live)
    assert torch.allclose(live[0], expected, atol=1e-6)


def test_a_round_that_fails_behind_leaves_the_replica_as_it_trained():
    live = [torch.tensor([1.0])]

    def lost(copies):
        copies[0].fill_(99.0)
        raise RuntimeError("connection closed by peer")

    behind = Behind(live, lost, due=1, group=([0, 1], [0, 0]), moved=4.0)
    live[0] += 1.0
    behind.merge(live)
    assert isinstance(behind.error, RuntimeError) and live[0].item() == 2.0


def test_an_error_that_is_not_a_lost_member_is_raised_in_the_replicas_thread_at_the_merge():
    """Only a lost member is a round that failed; a bug in the average is the run's failure."""
    def broken(copies):
        raise TypeError("a bug")

    behind = Behind([torch.zeros(1)], broken, due=1, group=([0, 1], [0, 0]), moved=0.0)
    with pytest.raises(TypeError, match="a bug"):
        behind.merge([torch.zeros(1)])


def test_a_workers_averages_behind_run_one_after_another_in_their_units_order():
    """Two units of one worker may average over the same ranks (one communicator): the second
    waits for the first, so every member runs them in the same order."""
    order, gate = [], threading.Event()

    def first(copies):
        gate.wait(5)
        order.append("first")

    def second(copies):
        order.append("second")

    a = Behind([torch.zeros(1)], first, due=1, group=([0, 1], [0, 0]), moved=0.0)
    b = Behind([torch.zeros(1)], second, due=1, group=([0, 1], [0, 0]), moved=0.0, after=a)
    b._thread.join(0.2)
    assert not b.done() and order == []  # held behind the first
    gate.set()
    a.merge([torch.zeros(1)])
    b.merge([torch.zeros(1)])
    assert order == ["first", "second"]


def test_on_nccl_rounds_run_in_step():
    from sdpipe_cli.sync.overlap import overlap_on

    assert overlap_on(2, "gloo") == 2 and overlap_on(2, "nccl") == 0 and overlap_on(0, "nccl") == 0
