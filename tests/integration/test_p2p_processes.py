"""p2p between two real gloo processes: the control message passes, and one for the wrong
iteration fails at once."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from sdpipe_cli.pipeline import p2p
from sdpipe_cli.pipeline.p2p import Control, ControlSend
from tests.helpers import free_port, spawn_and_join

CPU = torch.device("cpu")

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



@pytest.mark.multiprocess
def test_control_passes_between_processes_and_a_wrong_step_fails():
    spawn_and_join(_pass_controls, (free_port(),), 2, JOIN_TIMEOUT_S, "control exchange")
