"""What a worker's sync sends and receives, by link class (sdpipe_cli.sync.traffic), and the
run's totals the scheduler's tracker folds from the workers' done events."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from sdpipe_cli.runtime.metrics import RunTracker
from sdpipe_cli.sync.traffic import Traffic


def by_node(ranks) -> str:
    """Ranks 0-1 on one node, 2-3 on another."""
    return "cross_node" if len({r // 2 for r in ranks}) > 1 else "same_node"


def test_a_ring_all_reduce_moves_2_k_minus_1_over_k_of_the_payload_each_way():
    t = Traffic(by_node)
    t.all_reduce([0, 2, 3], 3000, 0.5)  # spans two nodes
    t.all_reduce([0, 1], 1000, 0.1)
    t.all_reduce([0], 1000, 0.0)  # a group of one sends nothing
    assert t.take() == {"sent_bytes": 5000, "recv_bytes": 5000, "links": ["cross_node", "same_node"]}
    assert t.take() == {}  # since the last take: nothing
    assert t.summary() == {"cross_node": {"sent_bytes": 4000, "recv_bytes": 4000, "seconds": 0.5, "calls": 1},
                           "same_node": {"sent_bytes": 1000, "recv_bytes": 1000, "seconds": 0.1, "calls": 1}}


def test_an_all_to_all_or_all_gather_moves_k_minus_1_over_k_of_the_payload_each_way():
    """int8 changes' two phases: together, what one ring all-reduce of their bytes would move."""
    t = Traffic(by_node)
    t.exchange([0, 2, 3], 3000, 0.2)  # an all-to-all over two nodes
    t.exchange([0, 2, 3], 3000, 0.3)  # and its all-gather
    t.exchange([1], 3000, 0.0)  # a group of one sends nothing
    assert t.summary() == {"cross_node": {"sent_bytes": 4000, "recv_bytes": 4000, "seconds": 0.5,
                                          "calls": 2}}
    ring = Traffic(by_node)
    ring.all_reduce([0, 2, 3], 3000, 0.5)
    assert ring.take() == t.take()


def test_a_broadcast_sends_from_the_root_and_a_point_to_point_as_given():
    root, last = Traffic(), Traffic()
    root.broadcast([0, 1], 800, root=True, last=False, seconds=0.1)
    last.broadcast([0, 1], 800, root=False, last=True, seconds=0.1)
    assert root.take()["sent_bytes"] == 800 and root.summary()["same_node"]["recv_bytes"] == 0
    assert last.take()["recv_bytes"] == 800 and last.summary()["same_node"]["sent_bytes"] == 0
    ps = Traffic(by_node)
    ps.point("server", 400, 400, 0.2)
    assert ps.summary()["server"] == {"sent_bytes": 400, "recv_bytes": 400, "seconds": 0.2, "calls": 1}


@settings(max_examples=50, deadline=None)
@given(k=st.integers(2, 16), nbytes=st.integers(0, 10**9))
def test_over_a_group_what_members_send_is_what_they_receive(k, nbytes):
    members = [Traffic() for _ in range(k)]
    for t in members:
        t.all_reduce(list(range(k)), nbytes, 0.0)
    sent = sum(t.summary()["same_node"]["sent_bytes"] for t in members)
    received = sum(t.summary()["same_node"]["recv_bytes"] for t in members)
    assert sent == received == pytest.approx(2 * (k - 1) * nbytes, abs=k)


def test_the_run_reports_bytes_per_sample_and_the_share_of_time_communicating():
    tracker = RunTracker(pipelines=2, stages=1, target_iterations=20, clock=lambda: 0.0)
    for p in (0, 1):
        tracker.update({"type": "step", "rank": p, "pipeline": p, "stage": 0, "step": 10,
                        "time": 1.0, "samples": 80, "samples_per_s": 8.0, "loss": 1.0})
    for p in (0, 1):
        tracker.update({"type": "done", "rank": p, "pipeline": p, "stage": 0, "time": 2.0,
                        "steps": 10, "wall_s": 10.0,
                        "traffic": {"cross_node": {"sent_bytes": 1600, "recv_bytes": 1600,
                                                   "seconds": 2.5, "calls": 10}}})
    snap = tracker.snapshot()
    assert snap["sync_bytes_per_sample"] == 3200 / 160
    assert snap["comm_share"] == 5.0 / 20.0
    assert snap["traffic"]["cross_node"]["sent_bytes"] == 3200
