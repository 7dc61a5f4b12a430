"""p2p: the control message's wire form, the link's rules for waiting on sends (no process group,
fake handles), and the control passed between two real gloo processes."""

from __future__ import annotations

import datetime
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st

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
    link = Link(0, 2, (1,), torch.float32, CPU, stage=1)
    for what, dst in entries:
        link._sends.append(Pending(what, dst, [FakeWork()], torch.zeros(1)))
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
    link = Link(0, 2, (1,), torch.float32, CPU)
    assert link.source(Action("F", 0)) == 0 and link.source(Action("B", 0)) == 2
    assert link.destination(Action("F", 0)) == 2 and link.destination(Action("B", 0)) == 0
    assert link.source(None) is None and link.idle


# -- between processes -------------------------------------------------------------------------------

JOIN_TIMEOUT_S = 60


def _pass_controls(rank, port):
    """Rank 0 sends two controls; rank 1 receives the first and fails on the second's step."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=30))
    try:
        if rank == 0:
            sent = [p2p.send_control(Control(True, 4, True, False), 1, CPU),
                    p2p.send_control(Control(False, 9, False, True), 1, CPU)]
            for entry in sent:
                entry.wait()
            assert [e.what for e in sent] == [ControlSend(4), ControlSend(9)]
        else:
            assert p2p.receive_control(0, 4, CPU, stage=1) == Control(True, 4, True, False)
            with pytest.raises(RuntimeError, match="stage 1 expected the control of iteration 5, got 9"):
                p2p.receive_control(0, 5, CPU, stage=1)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_control_passes_between_processes_and_a_wrong_step_fails():
    ctx = mp.start_processes(_pass_controls, args=(_free_port(),), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"control exchange hung for {JOIN_TIMEOUT_S}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
