"""``sdpipe resume`` on another layout: the checkpoint is resharded for the new P, S and
partition, the run goes on from where it was, and its budget in samples stays exact.

Every case starts from a copy of the shared all-reduce run (P=2, S=2, checkpoints at 10 and 20).
"""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from rich.console import Console

from sdpipe_cli import checkpoint
from sdpipe_cli.cli import resuming
from sdpipe_cli.cli.parsing import main
from sdpipe_cli.runtime import run_lock
from tests.helpers import losses, metrics, run_processes, sdpipe

pytestmark = pytest.mark.multiprocess


def copy_at_10(allreduce_2x2_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(allreduce_2x2_run, copy)
    shutil.rmtree(copy / "checkpoints" / "step_20")  # as if the run had stopped after step 10
    return copy


def shards(folder):
    manifest = checkpoint.read_manifest(folder)
    return {name[:-3]: checkpoint.load_shard(folder, name[:-3], manifest)
            for name in manifest["files"] if name != "scheduler.pt"}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_resharding_there_and_back_gives_back_every_tensor(allreduce_2x2_run, tmp_path):
    """P=2, S=2 -> P=4, S=3 -> P=2, S=2 (the saved partition): weights, optimizer state, RNG,
    data positions and iteration counts come back exactly; the resharded checkpoints verify."""
    copy = copy_at_10(allreduce_2x2_run, tmp_path)
    source = copy / "checkpoints" / "step_10"
    partition = json.loads((source / "manifest.json").read_text())["partition"]
    quiet = Console(file=io.StringIO())
    holder = run_lock.Holder()
    wide = resuming.prepare(str(source), ["cluster.pipelines=4", "pipeline.stages=3"], quiet, holder)
    assert wide.checkpoint.parent == copy / "resharded"
    assert checkpoint.verify_run(wide.checkpoint)["steps"] == {str(q): 5 for q in range(4)}
    assert wide.cfg.train.steps == 10 and wide.done == 20  # 2 x 20 iterations = 4 x 10
    back = resuming.prepare(str(wide.checkpoint), [
        "cluster.pipelines=2", "pipeline.stages=2", f"pipeline.partition={partition}"], quiet, holder)
    holder.release_all()
    assert back.cfg.train.steps == 20 and back.done == 20
    original, returned = shards(source), shards(back.checkpoint)
    assert original.keys() == returned.keys()
    for rank in original:
        for key in ("model", "optimizer", "rng", "step", "pipeline", "stage"):
            assert same(original[rank][key], returned[rank][key]), (rank, key)
        if "data" in original[rank]:
            assert original[rank]["data"]["position"] == returned[rank]["data"]["position"]
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["step_10"]  # only read


def test_resharding_into_interleaved_stages_and_back_gives_back_every_tensor(allreduce_2x2_run,
                                                                            tmp_path):
    """P=2, S=2 (1F1B) -> S=2 of two chunks each (interleaved: stage 0 holds pieces 0 and 2
    of four) -> the saved layout: every tensor comes back exactly."""
    copy = copy_at_10(allreduce_2x2_run, tmp_path)
    source = copy / "checkpoints" / "step_10"
    partition = json.loads((source / "manifest.json").read_text())["partition"]
    quiet = Console(file=io.StringIO())
    holder = run_lock.Holder()
    chunked = resuming.prepare(str(source), ["pipeline.schedule=interleaved_1f1b", "pipeline.chunks=2"],
                               quiet, holder)
    assert list(chunked.cfg.pipeline.partition) == [2, 4, 5]  # mlp: 6 blocks in 4 pieces
    first = shards(chunked.checkpoint)["0"]["model"]
    saved = shards(source)
    assert same(first["2.mlp.fc.weight"], saved["1"]["model"]["1.mlp.fc.weight"])  # block 4, of stage 1
    back = resuming.prepare(str(chunked.checkpoint), [
        "pipeline.schedule=1f1b", "pipeline.chunks=1", f"pipeline.partition={partition}"], quiet, holder)
    holder.release_all()
    returned = shards(back.checkpoint)
    assert saved.keys() == returned.keys()
    for rank in saved:
        for key in ("model", "optimizer", "rng", "step", "pipeline", "stage"):
            assert same(saved[rank][key], returned[rank][key]), (rank, key)


def test_a_run_resumed_interleaved_repeats_the_uninterrupted_run_s_losses(allreduce_2x2_run, tmp_path):
    """Interleaving changes the order of the work, not the update: the run resumed at step 10
    on stages of two chunks repeats steps 11-20 of the run that never stopped."""
    copy = copy_at_10(allreduce_2x2_run, tmp_path)
    before = len(metrics(copy))
    out = sdpipe("resume", str(copy), "pipeline.schedule=interleaved_1f1b", "pipeline.chunks=2")
    assert out.returncode == 0, out.stderr
    continued = losses(metrics(copy)[before:])
    reference = losses(metrics(allreduce_2x2_run))
    assert sorted(continued) == [(p, k) for p in range(2) for k in range(11, 21)]
    for key, loss in continued.items():
        assert loss == pytest.approx(reference[key], rel=0, abs=1e-5), key


def test_a_run_resumed_on_another_layout_goes_on_with_an_exact_budget(allreduce_2x2_run, tmp_path):
    copy = copy_at_10(allreduce_2x2_run, tmp_path)
    before = len(metrics(copy))
    out = sdpipe("resume", str(copy), "cluster.pipelines=4", "pipeline.stages=3")
    assert out.returncode == 0, out.stderr
    assert "resharded" in out.stderr and "warning" not in out.stderr, out.stderr
    resumed = metrics(copy)[before:]
    continued = losses(resumed)
    # 2 pipelines x 10 iterations remained; 4 pipelines take 5 each: the same 160 samples
    assert sorted(continued) == [(p, k) for p in range(4) for k in range(6, 11)]
    trained = {p: max(r["samples"] for r in resumed if r.get("kind") == "train" and
                      r.get("pipeline") == p and "samples" in r) for p in range(4)}
    assert sum(trained.values()) == 2 * 20 * 8  # the whole run's budget in samples
    # the loss goes on from where it was: the first resumed steps lie within the saved run's
    # last steps' spread (a fresh model would start near ln(vocab) instead)
    reference = losses(metrics(allreduce_2x2_run))
    last = [reference[(p, k)] for p in range(2) for k in range(6, 11)]
    first = [continued[(p, 6)] for p in range(4)]
    spread = max(last) - min(last)
    assert min(last) - spread <= sum(first) / 4 <= max(last) + spread, (first, last)
    assert not run_processes(copy)


@pytest.mark.parametrize("args, where", [
    (("pipeline.stages=99",), "pipeline.stages"),
    (("pipeline.stages=3", "pipeline.partition=[1]"), "pipeline.partition"),
    (("cluster.pipelines=0",), "cluster.pipelines"),
])
def test_a_layout_that_cannot_be_is_one_line_and_writes_nothing(allreduce_2x2_run, tmp_path, capsys,
                                                                args, where):
    copy = copy_at_10(allreduce_2x2_run, tmp_path)
    rc = main(["resume", str(copy), *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and where in lines[0], lines
    assert not (copy / "resharded").exists()
    assert (copy / "metrics.jsonl").read_bytes() == (allreduce_2x2_run / "metrics.jsonl").read_bytes()


def test_a_checkpoint_of_another_model_is_refused_when_resharded(allreduce_2x2_run, tmp_path, capsys):
    """The manifest says one model, the shards hold another: named, exit 2, nothing left."""
    copy = copy_at_10(allreduce_2x2_run, tmp_path)
    manifest_path = copy / "checkpoints" / "step_10" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["config"]["model"]["d_model"] = 2 * manifest["config"]["model"]["d_model"]
    manifest_path.write_text(json.dumps(manifest))
    rc = main(["resume", str(copy), "pipeline.stages=3"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "step_10" in lines[0] and "shape" in lines[0], lines
    assert not (copy / "resharded").exists()


def test_a_replanned_split_that_does_not_fit_leaves_the_split_as_it_was(
        allreduce_2x2_run, tmp_path, monkeypatch):
    """After a stop to re-plan, a new split whose workers would not fit this machine's memory
    is not taken: the run goes on from its checkpoint with the split it had, and says why."""
    from types import SimpleNamespace

    from sdpipe_cli.cli import run_loop
    from sdpipe_cli.config.saved import typed
    from sdpipe_cli.data import sources
    from sdpipe_cli.model import memory

    copy = copy_at_10(allreduce_2x2_run, tmp_path)
    saved = checkpoint.read_manifest(copy / "checkpoints" / "step_10")
    cfg = typed(saved["config"], "manifest")
    example = sources.example(cfg, cfg.train.batch_size // cfg.pipeline.microbatches,
                              device="meta")[0]

    def need(bounds):  # the run's two pipelines under one split
        return 2 * sum(e.total for e in memory.estimate(cfg, example, bounds))

    current = list(cfg.pipeline.partition)
    larger = max(([b] for b in range(1, 6)), key=need)
    assert need(larger) > need(current)
    monkeypatch.setattr("psutil.virtual_memory", lambda: SimpleNamespace(
        available=(need(current) + need(larger)) // 2))
    out = io.StringIO()
    stopped = SimpleNamespace(run_dir=copy, returncode=0, failure=None)
    holder = run_lock.Holder()
    leg = run_loop._replanned_leg(Console(file=out, width=300), stopped,
                                  {"partition": larger, "partitions": {}, "slowed": {"p0s1": 4.0},
                                   "reason": "test"}, holder)
    holder.release_all()
    assert leg is not None and stopped.failure is None, stopped.failure
    assert list(leg.cfg.pipeline.partition) == current and leg.checkpoint.name == "step_10"
    assert dict(leg.cfg.fault.slowed) == {"p0s1": 4.0}
    assert "the new split cannot be had" in out.getvalue() and "need about" in out.getvalue()
    assert not (copy / "resharded").exists()
