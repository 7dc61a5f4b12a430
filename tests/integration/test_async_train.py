"""``sdpipe train pipeline.schedule=async_1f1b`` end to end: per-update sync with every strategy,
drained stop points, stash bounds in the metrics, checkpoint and exact resume."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers import metrics, run_processes, sdpipe

pytestmark = pytest.mark.multiprocess

M = 4
ASYNC = ("pipeline.schedule=async_1f1b", "model=mlp", "data=synthetic", "train.batch_size=8",
         f"pipeline.microbatches={M}")


def digests(run_dir) -> dict[tuple[int, int], str]:
    return {(d["pipeline"], d["stage"]): d["param_digest"] for d in metrics(run_dir, "done")}


def check_stash(run_dir, stages=2) -> None:
    """Stage s never held more than S - s weight versions, and the first stage needed them all."""
    for d in metrics(run_dir, "done"):
        bound = stages - d["stage"]
        assert d["stash_bound"] == bound and d["stash_peak_versions"] == bound, d
        assert (d["stash_peak_bytes"] > 0) == (bound > 1), d  # the last stage copies nothing
    for line in metrics(run_dir, "train"):  # the last stage's train lines carry its stash
        assert line["stash_versions"] == 1 and line["stash_bytes"] == 0


@pytest.mark.parametrize("versions", [None, 2])
def test_async_sdpipe_syncs_every_update_and_ends_on_a_drained_global(run_dir, versions):
    """PipeDream: a round per micro-batch; 2BW (weight_versions=2): a round per iteration."""
    extra = [] if versions is None else [f"pipeline.weight_versions={versions}"]
    out = sdpipe("train", f"run.dir={run_dir}", "sync=sdpipe", "train.steps=12",
                 "train.eval_every=6", "sync.global_every=4", *ASYNC, *extra)
    assert out.returncode == 0, out.stderr
    done = metrics(run_dir, "done")
    steps = {d["pipeline"]: d["steps"] for d in done if d["stage"] == 0}
    assert sum(steps.values()) == 2 * 12  # exactly P x steps iterations, shared as they came
    assert all(d["steps"] == steps[d["pipeline"]] for d in done)  # a pipeline's stages agree
    for stage in (0, 1):  # the last round is a global sync: replicas identical
        assert len({d["param_digest"] for d in done if d["stage"] == stage}) == 1
    # A round per update: each replica of each stage took part in m (2BW: 1) per iteration.
    per_iteration = M if versions is None else 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == [[steps[0] * per_iteration, steps[1] * per_iteration]] * 2
    groups = metrics(run_dir, "group")
    globals_ = [g for g in groups if g["group"] == "global"]
    assert len(globals_) >= 4 and globals_[-1]["stop"] and globals_[-2]["stop"]  # 2 stages
    for g in globals_:  # at the last update of an iteration: a drained point
        assert g["members"] == [0, 1], g
        assert all((j + 1) % per_iteration == 0 for j in g["iterations"]), g
    assert {g["stage"] for g in globals_ if g["stop"]} == {0, 1}
    train = metrics(run_dir, "train")
    for p in (0, 1):
        assert sorted(m["step"] for m in train if m["pipeline"] == p) == list(range(1, steps[p] + 1))
    first = min(m["loss"] for m in train if m["step"] == 1)
    drop = 1.0 if versions is None else 0.4  # 2BW makes 12 updates here, PipeDream 48
    assert max(m["loss"] for m in train if m["step"] >= 10) < first - drop
    evals = metrics(run_dir, "eval")
    for p in (0, 1):
        assert {e["step"] for e in evals if e["pipeline"] == p} == {*range(6, steps[p] + 1, 6), steps[p]}
    check_stash(run_dir)


@pytest.fixture(scope="module")
def async_allreduce_run(tmp_path_factory):
    """Async 1F1B with a gradient all-reduce per update, 6 steps, checkpoints at 3 and 6: each
    iteration fills both stages' stashes, and 3 steps resumed are as exact a check as 6."""
    run_dir = tmp_path_factory.mktemp("async") / "run"
    out = sdpipe("train", f"run.dir={run_dir}", "sync=allreduce", "train.steps=6",
                 "checkpoint.every=3", "train.eval_every=0", *ASYNC)
    assert out.returncode == 0, out.stderr
    assert not run_processes(run_dir)
    return run_dir


def test_async_allreduce_keeps_replicas_identical(async_allreduce_run):
    d = digests(async_allreduce_run)
    assert len(d) == 4 and d[(0, 0)] == d[(1, 0)] and d[(0, 1)] == d[(1, 1)]
    assert {x["steps"] for x in metrics(async_allreduce_run, "done")} == {6}
    assert [c["step"] for c in metrics(async_allreduce_run, "checkpoint")] == [3, 6]
    check_stash(async_allreduce_run)


def test_async_resume_reproduces_the_losses_exactly(async_allreduce_run, tmp_path):
    """Checkpoints are taken at drained points, so they hold no stashed weights; resuming starts a
    new segment there and gives the losses of the run that never stopped, bit for bit."""
    copy = tmp_path / "copy"
    shutil.copytree(async_allreduce_run, copy)
    shutil.rmtree(copy / "checkpoints" / "step_6")
    before = len(metrics(copy))
    out = sdpipe("resume", str(copy))
    assert out.returncode == 0, out.stderr
    losses = {(m["pipeline"], m["step"]): m["loss"] for m in metrics(async_allreduce_run, "train")}
    resumed = {(m["pipeline"], m["step"]): m["loss"] for m in metrics(copy)[before:]
               if m["kind"] == "train"}
    assert sorted(resumed) == [(p, k) for p in (0, 1) for k in range(4, 7)]
    assert all(resumed[key] == losses[key] for key in resumed)
    assert digests(copy) == digests(async_allreduce_run)


@pytest.mark.parametrize("sync", ["adpsgd", "ps"])
def test_async_with_gossip_and_parameter_server(run_dir, sync):
    out = sdpipe("train", f"run.dir={run_dir}", f"sync={sync}", "train.steps=8",
                 "train.eval_every=0", *ASYNC)
    assert out.returncode == 0, out.stderr
    done = [d for d in metrics(run_dir, "done") if d["stage"] == 0]
    total = sum(d["steps"] for d in done)
    if sync == "adpsgd":
        assert total == 2 * 8  # lock-step: every pipeline stops at the same iteration
    else:
        # The first server counts m x P x steps pushes, then answers "stop"; a first stage hears
        # it in the reply to a push made while its forwards are already in the next iteration,
        # and drains after the iteration it starts next: up to two more per pipeline.
        assert 2 * 8 <= total <= 2 * 8 + 2 * 2
    train = metrics(run_dir, "train")
    first = min(m["loss"] for m in train if m["step"] == 1)
    assert max(m["loss"] for m in train if m["step"] == 8) < first - 1.0
    check_stash(run_dir)
