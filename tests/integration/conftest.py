"""Runs that several integration modules check: each configuration is trained once per session.

A run costs mostly the start-up of its processes, so tests that only read a finished run's
metrics, summary or checkpoints share one; tests that change a run's folder work on a copy.
"""

from __future__ import annotations

import pytest

from tests.helpers import kill_leftovers, run_processes, sdpipe

# 1F1B with a gradient all-reduce, P = S = 2, 20 steps, checkpoints at steps 10 and 20.
ALLREDUCE = ("sync=allreduce", "model=mlp", "data=synthetic", "train.steps=20", "train.batch_size=8",
             "checkpoint.every=10", "train.eval_every=0")


@pytest.fixture(scope="session")
def allreduce_2x2_run(tmp_path_factory):
    """The finished all-reduce run: 1F1B, P = S = 2, 20 steps, checkpoints at 10 and 20
    (read-only: copy it before changing anything)."""
    run_dir = tmp_path_factory.mktemp("allreduce") / "run"
    out = sdpipe("train", f"run.dir={run_dir}", *ALLREDUCE)
    leftovers = kill_leftovers(run_dir)
    assert out.returncode == 0, out.stderr
    assert not leftovers and not run_processes(run_dir)
    return run_dir
