"""``sync=diloco`` in real runs: with one local step, plain SGD, an outer learning rate of 1 and
no outer momentum it is gradient all-reduce (the same losses); with more local steps it trains,
its replicas leave every outer step identical, and a resume goes on bit for bit (the anchor and
the outer momentum are in the checkpoint)."""

from __future__ import annotations

import pytest

from tests.helpers import digests, losses, metrics, resumed_losses, sdpipe

pytestmark = pytest.mark.multiprocess

BASE = ("model=mlp", "data=synthetic", "train.batch_size=8", "cluster.pipelines=2",
        "pipeline.stages=2", "train.eval_every=0", "train.optimizer=sgd", "train.momentum=0",
        "train.grad_clip=0", "train.lr=0.05", "train.warmup=0")


def test_one_local_step_without_outer_momentum_is_gradient_allreduce(tmp_path):
    ours = sdpipe("train", f"run.dir={tmp_path / 'diloco'}", *BASE, "train.steps=12", "sync=diloco",
                  "sync.local_steps=1", "sync.outer_lr=1", "sync.outer_momentum=0")
    assert ours.returncode == 0, ours.stderr
    theirs = sdpipe("train", f"run.dir={tmp_path / 'allreduce'}", *BASE, "train.steps=12",
                    "sync=allreduce")
    assert theirs.returncode == 0, theirs.stderr
    a, b = losses(metrics(tmp_path / "diloco")), losses(metrics(tmp_path / "allreduce"))
    assert a.keys() == b.keys() and len(a) == 24
    for key in a:  # float32 sums in another order: equal to rounding
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_local_steps_train_meet_identical_and_resume_exactly(tmp_path, precision):
    """bf16: the outer gradient in bfloat16 with error feedback; the residual is in the
    checkpoint, so the resume is still exact. The resume is launched once, in bf16: its
    checkpoint holds all that fp32's does (the anchor, the outer momentum, the count of
    updates) and the residual besides."""
    run = tmp_path / "run"
    out = sdpipe("train", f"run.dir={run}", *BASE, "train.steps=16", "sync=diloco",
                 "sync.local_steps=4", "checkpoint.every=8", f"sync.precision={precision}")
    assert out.returncode == 0, out.stderr
    lines = metrics(run)
    trained = losses(lines)
    assert trained[(0, 16)] < trained[(0, 1)] - 0.1  # it learns
    sync = [m for m in lines if m["kind"] == "sync" or (m["kind"] == "train" and "group_size" in m)]
    assert {m["group_size"] for m in sync if m["step"] % 4 == 0} == {2}  # outer steps
    assert {m["group_size"] for m in sync if m["step"] % 4} == {1}  # local steps
    final = digests(run)
    assert final[(0, 0)] == final[(1, 0)] and final[(0, 1)] == final[(1, 1)]  # 16: an outer step
    assert [m["step"] for m in metrics(run, "checkpoint")] == [8, 16]
    if precision == "bf16":
        again = resumed_losses(run, tmp_path / "copy", "step_16")
        assert again and all(again[k] == trained[k] for k in again), (again, trained)
        assert digests(tmp_path / "copy") == final


def test_a_time_limit_ends_the_run_at_an_outer_step(tmp_path):
    """Replicas meet only at outer steps, so that is where they agree to stop: every pipeline
    ends at the same multiple of local_steps, with identical weights."""
    run = tmp_path / "run"
    out = sdpipe("train", f"run.dir={run}", *BASE, "train.steps=100000", "train.time_limit=3", "cluster.compute_ms=5",
                 "sync=diloco", "sync.local_steps=4")
    assert out.returncode == 0, out.stderr
    done = {m["pipeline"]: m["steps"] for m in metrics(run) if m["kind"] == "done"}
    assert len(set(done.values())) == 1 and next(iter(done.values())) % 4 == 0, done
    final = digests(run)
    assert final[(0, 0)] == final[(1, 0)] and final[(0, 1)] == final[(1, 1)]
