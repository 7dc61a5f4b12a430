"""The ``sdpipe`` command line as a user runs it: bad input is one line and exit 2 before anything
starts, ``--cfg``/``--help``/``--version`` print and start nothing. Most checks call ``main()`` in
this process (the same code, without an interpreter's start-up each); a few run a real process,
for what only a process shows (its exit code and stderr as a shell sees them, its imports)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from sdpipe_cli import __version__
from sdpipe_cli.cli.parsing import main
from tests.helpers import REPO, kill_leftovers, one_error_line, run_processes, sdpipe, sdpipe_process

FOREIGN = "203.0.113.7"  # TEST-NET-3: never an address of this machine
# A config that would train as little as possible, should a "bad input" ever get past the checks.
CHEAP = [
    "model=mlp", "data=synthetic", "train=quick", "cluster.pipelines=1", "pipeline.stages=1",
    "train.batch_size=4", "cluster.device=cpu",
]


def cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return sdpipe_process(*args, cwd=cwd, timeout=60, env=env)


@pytest.mark.parametrize("env, key", [
    ({"SLURM_JOB_ID": "5", "SLURM_NODEID": "7", "SLURM_JOB_NODELIST": "gpu[1-2]"}, "run.node"),
    ({"SLURM_JOB_ID": "5", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu[1-2"}, "SLURM_JOB_NODELIST"),
    ({"GROUP_RANK": "one", "MASTER_PORT": "29500"}, "GROUP_RANK"),
])
def test_a_job_environment_that_does_not_fit_is_one_line(tmp_path, monkeypatch, env, key):
    """srun or torchrun placing this launcher where the cluster config has no node (by
    ``main()`` in this process, its environment set as srun or torchrun would)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    proc = sdpipe("train", "cluster=gpu_2node", f"run.dir={tmp_path / 'run'}", timeout=60)
    assert proc.returncode == 2, proc.stderr
    one_error_line(proc.stderr, key)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, key", [
    (["train.steps=abc"], "train.steps"),
    (["pipeline.stages=7"], "pipeline.stages"),
])
def test_cli_bad_input_subprocess(tmp_path, overrides, key):
    proc = cli("train", *overrides, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    one_error_line(proc.stderr, key)
    assert not (tmp_path / "runs").exists()



def test_version_subprocess():
    proc = cli("--version")
    assert proc.returncode == 0
    assert __version__ in proc.stdout



def test_existing_nonempty_run_dir_is_rejected_untouched(tmp_path, monkeypatch):
    run_dir = tmp_path / "taken"
    run_dir.mkdir()
    keep = run_dir / "keep.txt"
    keep.write_text("precious results\n")
    os.utime(keep, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    before = keep.stat().st_mtime_ns

    monkeypatch.chdir(tmp_path)  # where a default run folder would go
    proc = sdpipe("train", *CHEAP, f"run.dir={run_dir}")

    assert proc.returncode == 2, proc.stderr
    one_error_line(proc.stderr, "run.dir")
    assert sorted(p.name for p in run_dir.iterdir()) == ["keep.txt"]
    assert keep.read_text() == "precious results\n"
    assert keep.stat().st_mtime_ns == before
    assert not (tmp_path / "runs").exists()


def test_busy_port_is_rejected_and_no_run_folder_created(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = sdpipe("train", *CHEAP, f"run.port={port}", f"run.dir={run_dir}")
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr, "run.port")
    assert str(port) in line
    assert not run_dir.exists()
    assert not (tmp_path / "runs").exists()


def test_run_dir_that_is_a_file_is_rejected_untouched(tmp_path, monkeypatch):
    # run.dir naming an existing regular file must be bad input (exit 2, one line), not a crash.
    target = tmp_path / "afile"
    target.write_text("not a folder\n")
    before = target.stat().st_mtime_ns
    monkeypatch.chdir(tmp_path)

    proc = sdpipe("train", *CHEAP, f"run.dir={target}")

    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, proc.stderr
    one_error_line(proc.stderr, "run.dir")
    assert target.read_text() == "not a folder\n"
    assert target.stat().st_mtime_ns == before


def test_a_run_dir_name_too_long_is_one_line(tmp_path, capsys):
    code = main(["train", *CHEAP, f"run.dir={tmp_path / ('x' * 300)}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "File name too long" in one_error_line(err, "run.dir")


def test_hydras_cfg_spellings_print_the_config(capsys):
    for spelling in (["--cfg", "job"], ["--cfg=all"]):
        assert main(["train", *spelling, "model=mlp"]) == 0
        assert "name: mlp" in capsys.readouterr().out


def test_foreign_host_is_one_line_exit_2_at_once_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    start = time.monotonic()
    result = sdpipe_process("train", f"cluster.host={FOREIGN}", f"run.dir={run}", timeout=60)
    took = time.monotonic() - start
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sdpipe: error: cluster.host:"), result.stderr
    assert "127.0.0.1" in lines[0]
    assert not run.exists()
    assert took < 20  # the check itself is instant; this bounds a loaded machine's start-up


def test_foreign_host_is_refused_before_torch_is_imported(capsys):
    code = ("import sys; from sdpipe_cli.cli.parsing import main; "
            f"rc = main(['train', 'cluster.host={FOREIGN}']); "
            "print('torch' in sys.modules, rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert out.stdout.split() == ["False", "2"], out.stderr


@pytest.mark.parametrize("override, key", [
    ("model=huge", "model: no option 'huge'"),
    ("cluster.links.same_node.latency_ms=-1", "cluster.links.same_node.latency_ms: is -1; must be in [0,"),
    ("fault.on_failure=restart sync=none checkpoint.every=5",
     "fault.on_failure: restart is for lock-step sync (allreduce, adpsgd, diloco), not sync=none"),
    ("fault.on_failure=restart sync=allreduce",
     "fault.on_failure: restart needs checkpoints to restart from"),
    ("fault.max_restarts=-1", "fault.max_restarts: is -1; must be >= 0"),
    ("fault.on_pipeline_loss=restart sync=none",
     "fault.on_pipeline_loss: restart needs sync=sdpipe and at least 2 pipelines"),
    ("fault.on_pipeline_loss=restart run.heartbeat_timeout=10",
     "run.heartbeat_timeout: must exceed sync.group_timeout (30.0 s)"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, override, key):
    """Each check by ``main()`` in this process (the same code, without an interpreter's start
    per case); the next test shows the exit code of a process of its own (with
    ``cluster.pipelines=0``, which is therefore not in this list)."""
    out = sdpipe("profile", f"run.dir={tmp_path / 'never'}", *override.split(), timeout=60)
    assert out.returncode == 2
    assert out.stderr.startswith(f"sdpipe: error: {key}"), out.stderr
    assert out.stderr.count("\n") == 1  # one line, no traceback
    assert not (tmp_path / "never").exists()


def test_bad_input_in_a_process_of_its_own_exits_2_with_one_line(tmp_path):
    out = sdpipe_process("profile", f"run.dir={tmp_path / 'never'}", "cluster.pipelines=0",
                         timeout=60)
    assert out.returncode == 2
    assert out.stderr == "sdpipe: error: cluster.pipelines: must be at least 1\n", out.stderr
    assert not (tmp_path / "never").exists()


def test_help_names_the_document():
    out = sdpipe("profile", "--help", timeout=60)
    assert out.returncode == 0 and "profile.json" in out.stdout and "cluster" in out.stdout


def test_cfg_prints_without_starting_anything(tmp_path):
    out = sdpipe("train", "--cfg", f"run.dir={tmp_path / 'never'}")
    assert out.returncode == 0
    assert yaml.safe_load(out.stdout)["cluster"]["pipelines"] == 2
    assert not (tmp_path / "never").exists()


@pytest.fixture(scope="module")
def reported_run(tmp_path_factory, shared_fork_server):
    """One 2-step run (P = S = 1) for the two tests below, each of which reads its own part of it:
    the status line's label at each step of the start-up (``phase``, recorded), and a SIGTERM
    while the summary of the finished run is printed (sent by ``summary``, after the last phase).
    Returns (the command's CompletedProcess, the labels, the run folder)."""
    import signal

    from sdpipe_cli.cli import display

    run_dir = tmp_path_factory.mktemp("reported") / "run"
    seen: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(display, "summary", lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM))
        patch.setattr(display.ProgressDisplay, "phase", lambda self, what: seen.append(what))
        out = sdpipe("train", f"run.dir={run_dir}", "model=mlp", "data=synthetic",
                     "train.steps=2", "cluster.pipelines=1", "pipeline.stages=1")
    leftovers = kill_leftovers(run_dir)
    assert not leftovers and not run_processes(run_dir), f"orphan processes: {leftovers}"
    return out, seen, run_dir


@pytest.mark.multiprocess
def test_an_interrupt_after_the_run_ended_keeps_its_exit_code(reported_run):
    """SIGTERM while sdpipe prints the summary of a finished run: the run is done and nothing is
    running, so the exit code is the run's (0), with one line saying so, not an interrupted
    start-up's 130."""
    out, _, run_dir = reported_run
    assert out.returncode == 0, out.stderr
    assert "sdpipe: interrupted after the run ended; nothing is running" in out.stderr
    assert (run_dir / "summary.json").is_file()


@pytest.mark.multiprocess
def test_the_status_line_says_each_step_of_the_start_up(reported_run):
    """Until training reports, the bar's label says what the launch waits for."""
    out, seen, run_dir = reported_run
    assert out.returncode == 0, out.stderr
    assert seen == ["starting the store", "writing the run folder", "starting the processes",
                    "waiting for the workers to join"]
    assert out.stderr.startswith(f"run folder: {run_dir} (logs: ")  # said first
