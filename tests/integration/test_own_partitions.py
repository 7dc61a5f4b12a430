"""Pipelines split their own way (``pipeline.partitions``): replicas average per segment of blocks.

Real runs: with a full group every round (``sync.connect_every=1``) sdpipe takes all-reduce's
steps, so a run whose pipelines are split differently must train exactly as one whose pipelines
share a split, up to the order in which the all-reduces add (segments are averaged over other
communicators than stages); and it checkpoints and resumes bit for bit.
"""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import digests, losses, metrics, sdpipe

pytestmark = pytest.mark.multiprocess

BASE = ("model=gpt_tiny", "data=synthetic", "sync=sdpipe", "cluster.pipelines=3",
        "pipeline.stages=2", "sync.connect_every=1", "sync.global_every=4", "train.steps=8",
        "checkpoint.every=4")
OWN = "pipeline.partitions={1:[1],2:[5]}"  # gpt_tiny has 6 blocks; the shared split is [3]


@pytest.fixture(scope="module")
def own_split_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("own") / "run"
    out = sdpipe("train", *BASE, OWN, f"run.dir={run}")
    assert out.returncode == 0, out.stderr[-2000:]
    return run, out


@pytest.fixture(scope="module")
def shared_split_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("shared") / "run"
    out = sdpipe("train", *BASE, f"run.dir={run}")
    assert out.returncode == 0, out.stderr[-2000:]
    return run


def test_pipelines_split_differently_train_as_one_split_does(own_split_run, shared_split_run):
    run, out = own_split_run
    own, same = losses(metrics(run)), losses(metrics(shared_split_run))
    assert sorted(own) == sorted(same) == [(p, k) for p in range(3) for k in range(1, 9)]
    assert max(abs(own[key] - same[key]) for key in own) < 1e-5
    # four segments: [0,1) [1,3) [3,5) [5,6); pipeline 1's stage 0 holds one, its stage 1 three
    assert "segment 0-3: [8, 8, 8]" in out.stderr and "segment 4" not in out.stderr
    groups = metrics(run, "group")
    assert {m["stage"] for m in groups} == {0, 1, 2, 3}
    assert all(m["members"] == [0, 1, 2] for m in groups)


def test_a_run_split_its_own_way_resumes_bit_for_bit(own_split_run, tmp_path):
    run, _ = own_split_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    before = len(metrics(copy))
    [first] = [m for m in metrics(run, "checkpoint") if m["step"] < 8]
    out = sdpipe("resume", str(copy / "checkpoints" / f"step_{first['step']}"))
    assert out.returncode == 0, out.stderr[-2000:]
    continued, reference = losses(metrics(copy)[before:]), losses(metrics(run))
    assert sorted(continued) == [(p, k) for p in range(3) for k in range(first["step"] + 1, 9)]
    assert all(continued[key] == reference[key] for key in continued)  # bit-exact
    assert digests(copy) == digests(run)


def test_a_checkpoint_of_one_split_resumes_resharded_to_pipelines_split_apart(
        own_split_run, shared_split_run, tmp_path):
    """The shared split's first checkpoint, resumed with pipelines 1 and 2 split their own way:
    each new stage gathers its blocks (and their optimizer state) from the old stages by its own
    ranges, and the run goes on as the run split apart from the start did."""
    copy = tmp_path / "copy"
    shutil.copytree(shared_split_run, copy)
    [first] = [m for m in metrics(copy, "checkpoint") if m["step"] < 8]
    before = len(metrics(copy))
    out = sdpipe("resume", str(copy / "checkpoints" / f"step_{first['step']}"), OWN)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pipeline 1: [1], pipeline 2: [5]" in out.stderr
    [resharded] = (copy / "resharded").iterdir()
    assert resharded.name.endswith("-P3xS2-3-p1_1-p2_5")
    continued, reference = losses(metrics(copy)[before:]), losses(metrics(own_split_run[0]))
    assert sorted(continued) == [(p, k) for p in range(3) for k in range(first["step"] + 1, 9)]
    assert max(abs(continued[key] - reference[key]) for key in continued) < 1e-5
