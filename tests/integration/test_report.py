"""`sdpipe report` on real runs: a two-run comparison's PNGs, and the missing extra."""

from __future__ import annotations

import pytest

from tests.helpers import one_error_line, sdpipe, sdpipe_process

pytestmark = pytest.mark.multiprocess

PNG = b"\x89PNG\r\n\x1a\n"


def test_two_runs_compared(allreduce_2x2_run, tmp_path):
    """The shared all-reduce run against an sdpipe run of the same shape."""
    sd = tmp_path / "sdpipe"
    out = sdpipe("train", f"run.dir={sd}", "sync=sdpipe", "model=mlp", "data=synthetic",
                 "train.steps=20", "train.batch_size=8", "train.eval_every=10", "sync.global_every=5")
    assert out.returncode == 0, out.stderr
    figures = tmp_path / "figures"
    out = sdpipe("report", str(sd), str(allreduce_2x2_run), "--out", str(figures))
    assert out.returncode == 0, out.stderr
    written = out.stdout.split()
    names = sorted(p.rsplit("/", 1)[1] for p in written)
    # stragglers.png too where a busy host slowed a worker enough to be named (real compute)
    assert set(names) - {"stragglers.png"} == {"consensus.png", "groups.png", "loss.png",
                                               "throughput.png", "waits.png"}
    for path in written:
        assert (figures / path.rsplit("/", 1)[1]).read_bytes()[:8] == PNG
    out = sdpipe("report", str(allreduce_2x2_run), "--out", str(tmp_path / "one"))  # no groups: none drawn
    assert out.returncode == 0 and "groups.png" not in out.stdout and "loss.png" in out.stdout


def test_without_matplotlib_one_line_says_how_to_install_it(allreduce_2x2_run, tmp_path):
    blocker = tmp_path / "blocked" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('not installed')\n")
    out = sdpipe_process("report", str(allreduce_2x2_run), "--out", str(tmp_path / "never"), timeout=60,
                         env={"PYTHONPATH": str(blocker.parent)})
    assert out.returncode == 2
    assert "pip install matplotlib" in one_error_line(out.stderr, "report")
    assert not (tmp_path / "never").exists()


def test_a_folder_that_is_not_a_run_is_one_line(tmp_path):
    """By ``main()`` in this process: the test above shows ``report``'s exit 2 in a process of
    its own."""
    out = sdpipe("report", str(tmp_path), timeout=60)
    assert out.returncode == 2
    one_error_line(out.stderr, str(tmp_path))
