"""Checkpoints and ``sdpipe resume`` end to end: exact continuation, group sync, refusals, and the
checkpoint an interrupted or killed run leaves to resume from.

Each run here serves several checks: the shared all-reduce run (``allreduce_2x2_run``) is the
source of every refusal, and of the one exact resume; a SIGTERM run is also the supervisor's test
of a clean interrupt. What a resume decides before anything starts (which checkpoint, what is
refused) is checked in this process. A SIGKILLed worker, and the checkpoint its run goes on from:
test_restart_run.py.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import time

import psutil
import pytest
from omegaconf import OmegaConf
from rich.console import Console

from sdpipe_cli import checkpoint
from sdpipe_cli.cli import report, resuming
from sdpipe_cli.cli.parsing import main
from sdpipe_cli.runtime import run_lock
from tests.helpers import (
    digests,
    finish,
    interrupt_command,
    listening_only_on_loopback,
    losses,
    metrics,
    run_processes,
    sdpipe,
    sdpipe_beside,
    sdpipe_popen,
    training_lines,
    wait_for,
)

pytestmark = pytest.mark.multiprocess

# runs that go on until they are stopped: modelled compute (sleeps), not two cores spinning
LONG = ("model=mlp", "data=synthetic", "train.steps=100000", "train.batch_size=8", "cluster.compute_ms=10")


def test_checkpoints_are_complete_and_pruned(allreduce_2x2_run):
    ckpts = sorted(p.name for p in (allreduce_2x2_run / "checkpoints").iterdir())
    assert ckpts == ["step_10", "step_20"]
    files = {p.name for p in (allreduce_2x2_run / "checkpoints" / "step_10").iterdir()}
    assert files == {"0.pt", "1.pt", "2.pt", "3.pt", "scheduler.pt", "manifest.json"}
    assert [m["step"] for m in metrics(allreduce_2x2_run, "checkpoint")] == [10, 20]


@pytest.mark.parametrize("overrides", [(), ("train.steps=15",), ("cluster.pipelines=1", "train.steps=20")],
                         ids=["finished", "fewer-steps", "resharded"])
def test_a_resume_that_leaves_nothing_to_train_is_refused_and_the_run_kept(allreduce_2x2_run,
                                                                           tmp_path, overrides):
    """A finished run resumed as it is, with fewer steps than it did, or resharded to a budget
    its checkpoint already passed (1 pipeline x 20 steps of the 2 x 20 done) would train
    nothing and write a summary of no steps over the run's own: one line naming train.steps,
    exit 2, and the folder as it was."""
    run = tmp_path / "run"
    shutil.copytree(allreduce_2x2_run, run)
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    out = sdpipe("resume", str(run), *overrides)
    assert out.returncode == 2, out.stderr[-2000:]
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("sdpipe: error: train.steps: leaves nothing to train: ")
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_resuming_an_older_checkpoint_reproduces_the_losses_exactly_and_keeps_the_newer_one(
        allreduce_2x2_run, tmp_path):
    """Resume step_10 of a finished run: it gives the same losses as the run never stopped, bit
    for bit (all-reduce on CPU), and the same final weights; the new timeline writes its own
    step_20, and the first timeline's step_20 is kept as step_20.superseded-1, byte for byte."""
    copy = tmp_path / "copy"
    shutil.copytree(allreduce_2x2_run, copy)
    first = {p.name: p.read_bytes() for p in (copy / "checkpoints" / "step_20").iterdir()}
    before = len(metrics(copy))
    out = sdpipe("resume", str(copy / "checkpoints" / "step_10"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step_10" in out.stderr
    reference = losses(metrics(allreduce_2x2_run))
    continued = losses(metrics(copy)[before:])
    assert sorted(continued) == [(p, k) for p in (0, 1) for k in range(11, 21)]
    assert all(continued[key] == reference[key] for key in continued)  # bit-exact
    assert digests(copy) == digests(allreduce_2x2_run)
    assert (copy / "config.yaml").read_text() == (allreduce_2x2_run / "config.yaml").read_text()
    assert list(copy.glob("config.resume-step_10*.yaml"))
    assert not run_processes(copy)
    names = sorted(p.name for p in (copy / "checkpoints").iterdir())
    assert names == ["step_10", "step_20", "step_20.superseded-1"]  # no staging folder left
    kept = copy / "checkpoints" / "step_20.superseded-1"
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == first
    run = report.load(copy)  # and `sdpipe report` draws the two timelines apart
    run.label = "copy"
    assert [t.label for t in report.timelines(run)] == ["copy", "copy (resumed from step_10)"]


def test_a_checkpoint_of_one_flushed_schedule_resumes_under_another_bit_for_bit(
        allreduce_2x2_run, tmp_path):
    """ZB-H1 makes 1F1B's update from the same weights and optimizer state, so a 1F1B run's
    checkpoint resumes under it: the same losses and final weights as the run never stopped."""
    copy = tmp_path / "copy"
    shutil.copytree(allreduce_2x2_run, copy)
    before = len(metrics(copy))
    out = sdpipe("resume", str(copy / "checkpoints" / "step_10"), "pipeline.schedule=zb_h1")
    assert out.returncode == 0, out.stderr[-2000:]
    [leg] = copy.glob("config.resume-step_10*.yaml")
    assert OmegaConf.load(leg).pipeline.schedule == "zb_h1"
    assert OmegaConf.load(copy / "config.yaml").pipeline.schedule == "1f1b"
    reference = losses(metrics(allreduce_2x2_run))
    continued = losses(metrics(copy)[before:])
    assert sorted(continued) == [(p, k) for p in (0, 1) for k in range(11, 21)]
    assert all(continued[key] == reference[key] for key in continued)  # bit-exact
    assert digests(copy) == digests(allreduce_2x2_run)


def test_a_damaged_newest_checkpoint_is_passed_over_and_kept(allreduce_2x2_run, tmp_path):
    """The newest checkpoint's manifest is garbage: resuming the run warns and goes on from the
    one before, leaving the damaged folder as it is. (Which checkpoint a resume starts from is
    settled before anything starts: checked here in this process. That writing the leg's own
    step_20 keeps a damaged step_20 beside it: tests/unit/test_checkpoint.py::
    test_an_existing_final_dir_is_kept_aside_never_replaced; that a resumed leg trains as the
    run never stopped: the test above.)"""
    copy = tmp_path / "copy"
    shutil.copytree(allreduce_2x2_run, copy)
    (copy / "checkpoints" / "step_20" / "manifest.json").write_text("garbage")
    said = io.StringIO()
    holder = run_lock.Holder()
    try:
        leg = resuming.prepare(str(copy), [], Console(file=said, width=200), holder)
    finally:
        holder.release_all()
    assert leg.checkpoint == copy / "checkpoints" / "step_10" and not leg.fresh
    assert leg.done == 2 * 10
    assert "step_20 has no readable manifest" in said.getvalue()
    assert "passed over, and kept" in said.getvalue() and "step_10" in said.getvalue()
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["step_10", "step_20"]
    assert (copy / "checkpoints" / "step_20" / "manifest.json").read_text() == "garbage"
    assert (copy / "metrics.jsonl").read_bytes() == (allreduce_2x2_run / "metrics.jsonl").read_bytes()


# -- refusals: the command's own checks, run in-process (nothing may start, so no process is
# needed to see it); exit code and stderr are what ``sdpipe resume`` prints and returns.
def resume_in_process(capsys, *argv: str) -> tuple[int, list[str]]:
    rc = main(["resume", *argv])
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("case, args, key", [
    ("missing path", ("{missing}",), "does not exist"),
    ("unsafe override", ("{run}", "model.n_layers=2"), "model.n_layers: cannot change"),
    ("unsafe override (sync)", ("{run}", "sync.name=none"), "sync.name: cannot change"),
    ("to the asynchronous schedule", ("{run}", "pipeline.schedule=async_1f1b"),
     "pipeline.schedule: cannot change"),
    ("not key=value", ("{run}", "train.steps"), "train.steps"),
    ("wrong type", ("{run}", "train.steps=many"), "train.steps"),
])
def test_bad_resume_input_is_one_line_and_starts_nothing(allreduce_2x2_run, tmp_path, capsys, case, args,
                                                         key):
    before = (allreduce_2x2_run / "metrics.jsonl").read_bytes()
    rc, lines = resume_in_process(capsys, *[a.format(run=allreduce_2x2_run, missing=tmp_path / "nope")
                                            for a in args])
    assert rc == 2, (case, lines)
    assert len(lines) == 1 and lines[0].startswith("sdpipe: error: ") and key in lines[0], lines
    assert (allreduce_2x2_run / "metrics.jsonl").read_bytes() == before  # nothing written
    assert not run_processes(allreduce_2x2_run)


def test_corrupted_or_truncated_checkpoint_is_refused(allreduce_2x2_run, tmp_path, capsys):
    """A shard truncated (the checkpoint named) or with bytes flipped (the run named: a checkpoint
    whose manifest reads is not passed over, its checksums fail the resume): one line naming the
    shard, before anything starts; nothing of the run changes."""
    for damage, named in (("truncate", "checkpoints/step_20"), ("flip", "")):
        copy = tmp_path / damage
        shutil.copytree(allreduce_2x2_run, copy)
        shard = copy / "checkpoints" / "step_20" / "1.pt"
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2] if damage == "truncate"
                          else data[:-10] + bytes(b ^ 0xFF for b in data[-10:]))
        before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
        rc, lines = resume_in_process(capsys, str(copy / named))
        assert rc == 2, lines
        assert len(lines) == 1 and "1.pt" in lines[0] and "Traceback" not in lines[0], lines
        assert "checksum mismatch" in lines[0], lines
        assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before
        assert (copy / "metrics.jsonl").read_bytes() == (allreduce_2x2_run / "metrics.jsonl").read_bytes()


def test_run_without_checkpoints_is_refused(tmp_path, capsys):
    (tmp_path / "empty-run").mkdir()
    rc, lines = resume_in_process(capsys, str(tmp_path / "empty-run"))
    assert rc == 2 and len(lines) == 1 and "no complete checkpoint" in lines[0], lines


# -- interrupts and kills: what the run leaves, and that it resumes ---------------------------------
def test_sigterm_to_the_process_group_stops_everything_at_a_consistent_point(run_dir):
    """All-reduce, SIGTERM to the launcher's whole process group (what ``timeout``, ``kill --
    -PGID`` and job systems send): while it runs only 127.0.0.1 listens; the signal stops every
    child at a consistent point (rc 130, as Ctrl-C does), a final checkpoint and the summary are
    written, and the run resumes from it. (Ctrl-C: the sdpipe test below.)"""
    proc = sdpipe_popen("train", f"run.dir={run_dir}", "sync=allreduce", *LONG,
                        "checkpoint.on_exit=true")
    wait_for(training_lines(run_dir, 6), proc, what="six train lines")
    # while it runs: the store (in the launcher) and gloo listen on 127.0.0.1 only
    children = listening_only_on_loopback(proc, run_dir)
    assert len(children) == 5  # scheduler + 4 workers
    os.killpg(proc.pid, signal.SIGTERM)  # the launcher, its fork server, anything in its group
    rc, err, _ = finish(proc, timeout=90)
    assert rc == 130, err
    assert "interrupted" in err and "stopped at a consistent point" in err
    assert (run_dir / "summary.json").is_file()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in children)
    done = metrics(run_dir, "done")
    assert len(done) == 4
    for stage in (0, 1):  # every replica of a stage ends identical
        assert len({d["param_digest"] for d in done if d["stage"] == stage}) == 1
    (saved,) = metrics(run_dir, "checkpoint")
    assert {int(p): k for p, k in saved["steps"].items()} == {d["pipeline"]: d["steps"] for d in done}
    out = sdpipe("resume", str(run_dir), f"train.steps={saved['step'] + 3}")
    assert out.returncode == 0, out.stderr
    assert {d["steps"] for d in metrics(run_dir, "done")[len(done):]} == {saved["step"] + 3}


def test_group_sync_checkpoints_at_global_syncs_and_resumes_within_the_budget(run_dir):
    """sdpipe on three pipelines: periodic checkpoints and the one a Ctrl-C leaves are taken at a
    global sync (replicas identical); resuming goes on from each pipeline's own iteration, keeps
    the run's budget (P x train.steps iterations in all) and again ends on a global sync."""
    def interrupt_after_a_checkpoint(command):
        command.wait_for(lambda: (run_dir / "metrics.jsonl").exists()
                         and metrics(run_dir, "checkpoint"), what="a periodic checkpoint")
        interrupt_command()

    # the launcher in this process: what is tested is the run's stop and resume, not its process
    out, _ = sdpipe_beside(interrupt_after_a_checkpoint, run_dir, "train", f"run.dir={run_dir}",
                           "sync=sdpipe", "sync.global_every=10", "cluster.pipelines=3",
                           "train.eval_every=0", "checkpoint.every=10", "checkpoint.on_exit=true",
                           *LONG, timeout=120)
    rc, err = out.returncode, out.stderr
    assert rc == 130, err
    assert "stopped at a consistent point" in err
    done = metrics(run_dir, "done")
    assert len(done) == 6
    for stage in (0, 1):  # the last global sync left every replica of a stage identical
        assert len({d["param_digest"] for d in done if d["stage"] == stage}) == 1
    saved = metrics(run_dir, "checkpoint")
    assert len(saved) >= 2  # at least one periodic, then the one at the interrupt
    last = saved[-1]
    assert {int(p): k for p, k in last["steps"].items()} == {d["pipeline"]: d["steps"] for d in done}
    steps = last["step"] + 3
    before = len(metrics(run_dir))
    out = sdpipe("resume", str(run_dir), f"train.steps={steps}")
    assert out.returncode == 0, out.stderr
    done = [d for d in metrics(run_dir)[before:] if d["kind"] == "done"]
    assert sum(d["steps"] for d in done if d["stage"] == 0) == 3 * steps  # the budget still holds
    assert all(d["steps"] >= last["steps"][str(d["pipeline"])] for d in done)
    for stage in (0, 1):  # and the run still ends on a global sync
        assert len({d["param_digest"] for d in done if d["stage"] == stage}) == 1


def test_ctrl_c_inside_a_long_meeting_block_stops_within_a_step(run_dir):
    """sdpipe with meetings far apart (``sync.every`` as long as the run): a Ctrl-C is acted on
    at the next step boundary, not at the block's end. Every replica meets at once in the run's
    last global sync, and the on-exit checkpoint there holds the steps each pipeline did."""
    def interrupt_in_the_block(command):
        command.wait_for(training_lines(run_dir, 2), what="two train lines")
        return interrupt_command()

    out, sent = sdpipe_beside(interrupt_in_the_block, run_dir, "train", f"run.dir={run_dir}",
                              "sync=sdpipe", "sync.every=100000", "train.eval_every=0",
                              "checkpoint.on_exit=true", *LONG, timeout=120)
    rc, err = out.returncode, out.stderr
    assert rc == 130 and "stopped at a consistent point" in err, err
    # the block alone would take several minutes: a stop only at its end fails here
    assert time.monotonic() - sent < 45
    done = metrics(run_dir, "done")
    for stage in (0, 1):  # the last global sync left every replica of a stage identical
        assert len({d["param_digest"] for d in done if d["stage"] == stage}) == 1
    (saved,) = metrics(run_dir, "checkpoint")
    steps = {int(p): k for p, k in saved["steps"].items()}
    assert steps == {d["pipeline"]: d["steps"] for d in done} and max(steps.values()) < 100000
    assert saved["step"] == round(sum(steps.values()) / len(steps))  # named by the steps done
    assert checkpoint.verify(checkpoint.latest(run_dir))["steps"] == saved["steps"]


@pytest.mark.parametrize("sync", [("sync=allreduce",), ("sync=sdpipe", "sync.global_every=5")],
                         ids=["allreduce", "sdpipe"])
def test_time_based_checkpoints(run_dir, sync):
    out = sdpipe("train", f"run.dir={run_dir}", *sync, "model=mlp", "data=synthetic",
                 "train.steps=40", "train.batch_size=8", "train.eval_every=0",
                 "checkpoint.every_minutes=0.01", "checkpoint.keep=0", "checkpoint.on_exit=true")
    assert out.returncode == 0, out.stderr
    saved = metrics(run_dir, "checkpoint")
    assert len(saved) >= 2  # 0.6 s apart on a run of several seconds, plus the one at the end
    steps = [c["step"] for c in saved]
    assert steps == sorted(set(steps))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == sorted(
        f"step_{k}" for k in steps)
