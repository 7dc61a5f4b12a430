"""p2p: the control message's wire form and the link's rules for waiting on sends (no process
group, fake handles); tests/integration/test_p2p_processes.py passes it between processes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from sdpipe_cli.core.schedule import Action, Kind
from sdpipe_cli.pipeline import p2p
from sdpipe_cli.pipeline.p2p import Control, ControlSend, Link, Pending

CPU = torch.device("cpu")


# -- the control message ---------------------------------------------------------------------------

@given(st.booleans(), st.integers(0, 2**62), st.booleans(), st.booleans())
def test_control_round_trips_through_its_tensor(go, step, save, last):
    control = Control(go, step, save, last)
    flag = control.tensor(CPU)
    assert flag.dtype == torch.int64 and flag.shape == (4,)
    back = Control.of(flag)
    assert back == control and type(back.go) is bool and type(back.last) is bool


def test_control_wire_form_is_go_step_save_last():
    assert Control(True, 12, False, True).tensor(CPU).tolist() == [1, 12, 0, 1]
    assert Control(False, 3, True).tensor(CPU).tolist() == [0, 3, 1, 0]  # flushed: last False
    assert Control(True, 5, False) == Control(go=True, step=5, save=False, last=False)


def test_control_of_a_wrong_size_fails():
    with pytest.raises(ValueError, match="4 ints"):
        Control.of(torch.tensor([1, 0, 0], dtype=torch.int64))  # the old flushed 3-int form


def test_tags_are_distinct():
    assert len({p2p.TENSOR_TAG, p2p.CONTROL_TAG, p2p.DRAINED_TAG}) == 3


# -- waiting on sends ------------------------------------------------------------------------------

class FakeWork:
    def __init__(self):
        self.waits = 0

    def wait(self):
        self.waits += 1


def link_with(*entries):
    """A middle stage's link (previous rank 0, next rank 2) holding ``(what, dst)`` sends."""
    link = Link(0, 2, (4, 4), CPU, stage=1)
    for what, dst in entries:
        end = p2p.PREV if dst == 0 else p2p.NEXT
        link._sends.append(Pending(what, end, [FakeWork()], torch.zeros(1)))
    return link


def pending(link):
    return [str(entry.what) for entry in link._sends]


def waited(entries):
    return sorted(str(e.what) for e in entries if e.works[0].waits)


def test_a_gradient_back_releases_every_forward_send_up_to_its_activation():
    F, B = Kind.F, Kind.B
    link = link_with((ControlSend(0), 2), (Action(F, 0), 2), (Action(B, 5), 0),
                     (Action(F, 1), 2), (ControlSend(1), 2), (Action(F, 2), 2))
    entries = list(link._sends)
    link.wait_delivered(1)
    assert waited(entries) == ["C0", "F0", "F1"]  # not the gradient, not what came after F1
    assert pending(link) == ["B5", "C1", "F2"]
    link.wait_delivered(2)
    assert waited(entries) == ["C0", "C1", "F0", "F1", "F2"] and pending(link) == ["B5"]
    link.wait_delivered(7)  # nothing of it pending: nothing to wait on
    assert pending(link) == ["B5"]
    assert all(e.works[0].waits <= 1 for e in entries)  # each handle waited on at most once


def test_gradient_sends_kept_up_to_the_bound_oldest_first():
    B = Kind.B
    link = link_with((Action(B, 0), 0), (ControlSend(3), 2), (Action(B, 1), 0),
                     (Action(Kind.F, 4), 2), (Action(B, 2), 0))
    entries = list(link._sends)
    link.wait_gradients(keep=2)
    assert waited(entries) == ["B0"] and pending(link) == ["C3", "B1", "F4", "B2"]
    link.wait_gradients(keep=2)
    assert waited(entries) == ["B0"]
    link.wait_sends()
    assert link.idle and all(e.works[0].waits == 1 for e in entries)


def test_link_directions():
    link = Link(0, 2, (4, 4), CPU)
    assert link.source(Action("F", 0)) == p2p.PREV and link.source(Action("B", 0)) == p2p.NEXT
    assert link.destination(Action("F", 0)) == p2p.NEXT
    assert link.destination(Action("B", 0)) == p2p.PREV
    assert link.ranks == {p2p.PREV: 0, p2p.NEXT: 2}
    assert link.source(None) is None and link.idle


def test_with_two_stages_both_ends_may_be_one_process_in_two_groups():
    """An interleaved chunk of the first of two stages: its previous and next virtual stages are
    both on stage 1, the previous one across the wrap channel's group."""
    pipeline, wrap = object(), object()
    link = Link(1, 1, (4, 4), CPU, group=(wrap, pipeline))  # type: ignore[arg-type]
    assert link.groups == {p2p.PREV: wrap, p2p.NEXT: pipeline}
    assert Link(0, 2, (4, 4), CPU, group=pipeline).groups == {  # type: ignore[arg-type]
        p2p.PREV: pipeline, p2p.NEXT: pipeline}
