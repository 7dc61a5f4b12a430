"""p2p between two real gloo processes: the control message passes, and one for the wrong
iteration fails at once."""

from __future__ import annotations

import datetime
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sdpipe_cli.pipeline import p2p
from sdpipe_cli.pipeline.p2p import Control, ControlSend

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
