"""``sync.replay``: a run given a recorded run's group decisions repeats it step for step, while
two runs with the same seed alone do not; a recording that cannot be replayed here is one line."""

from __future__ import annotations

import pytest

from sdpipe_cli.cli.parsing import main
from tests.helpers import digests, losses, metrics, sdpipe

pytestmark = pytest.mark.multiprocess

RUN = ("model=mlp", "data=synthetic", "cluster.pipelines=3", "pipeline.stages=2",
       "train.steps=20", "train.batch_size=8", "cluster.slowdown=[1,1,3]", "cluster.compute_ms=5",
       "sync.global_every=5", "train.eval_every=0", "sync.stale=pull")


def test_a_replayed_run_repeats_the_recorded_losses_bit_for_bit(tmp_path):
    recorded, replayed = tmp_path / "recorded", tmp_path / "replayed"
    out = sdpipe("train", f"run.dir={recorded}", *RUN)
    assert out.returncode == 0, out.stderr
    out = sdpipe("train", f"run.dir={replayed}", *RUN, f"sync.replay={recorded}")
    assert out.returncode == 0, out.stderr
    first, again = losses(metrics(recorded)), losses(metrics(replayed))
    assert len(first) == 3 * 20 and again == first  # every (pipeline, step): the same float
    assert digests(replayed) == digests(recorded)
    sizes = [g["size"] for g in metrics(recorded, "group")]
    assert min(sizes) < 3  # the straggler made partial groups: the decisions mattered
    # and it was stale in some rounds, which the replay weighed as recorded
    assert any(0.0 in g.get("weight_shares", ()) for g in metrics(recorded, "group"))


@pytest.mark.parametrize("what, args, message", [
    ("not a run", ("sync.replay={tmp}",), "is not a sdpipe run folder (no config.yaml)"),
    ("another P", ("sync.replay={recorded}", "cluster.pipelines=2"),
     "was recorded with cluster.pipelines=3, this run has 2"),
    ("another S", ("sync.replay={recorded}", "pipeline.stages=3"),
     "was recorded with pipeline.stages=2, this run has 3"),
    ("with fault tolerance", ("sync.replay={recorded}", "fault.on_pipeline_loss=continue"),
     "use fault.on_pipeline_loss=stop"),
    ("meetings apart", ("sync.replay={recorded}", "sync.every=4"),
     "was recorded with sync.every=1, this run has 4"),
    ("bf16 changes", ("sync.replay={recorded}", "sync.precision=bf16"),
     "was recorded with sync.precision=fp32, this run has bf16"),
    ("other shares of the batch", ("sync.replay={recorded}", "cluster.slowdown=[1,1,1.3]",
                                   "pipeline.balance=speed"),
     "was recorded with micro-batches per pipeline [4, 4, 4], this run has [4, 4, 3]"),
    ("another budget", ("sync.replay={recorded}", "train.steps=40"),
     "was recorded with train.steps=20, this run has 40"),
    ("a member past the layout", ("sync.replay={seven}",),
     "metrics.jsonl:1: not a group decision this sdpipe can replay (ValueError: stage 0 or "
     "members [7] outside the 3 x 2 layout)"),
])
def test_a_recording_that_cannot_be_replayed_is_one_line(tmp_path, capsys, what, args, message):
    recorded, seven = tmp_path / "recorded", tmp_path / "seven"
    for folder, member in ((recorded, 0), (seven, 7)):
        folder.mkdir()
        (folder / "config.yaml").write_text(
            "sync: {name: sdpipe}\ncluster: {pipelines: 3}\n"
            "pipeline: {stages: 2, schedule: 1f1b, microbatches: 4}\ntrain: {steps: 20}\n")
        (folder / "metrics.jsonl").write_text(
            '{"kind": "group", "stage": 0, "round": 1, "group": "group", "members": [MEMBER], '
            '"iterations": [0], "stop": false, "done": 3}\n'.replace("MEMBER", str(member)))
    empty = tmp_path / "empty"
    empty.mkdir()
    rc = main(["train", f"run.dir={tmp_path / 'new'}", *RUN[:5],
               *[a.format(tmp=empty, recorded=recorded, seven=seven) for a in args]])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, (what, lines)
    assert len(lines) == 1 and lines[0].startswith("sdpipe: error: sync.replay") and \
        message in lines[0], lines
    assert not (tmp_path / "new").exists()


def test_rounds_merged_late_are_repeated_bit_for_bit_and_a_replay_merges_as_recorded(tmp_path):
    """sync.overlap: a round's average runs behind the next local steps and is merged after a
    fixed count of them, so a replay repeats the run exactly; each merge says what its round
    took on the wire and how long the replica then waited for it. A replay merging otherwise
    would not repeat the run: one line, exit 2."""
    late = (*RUN, "sync.every=4", "sync.precision=bf16", "sync.overlap=2")
    recorded, replayed = tmp_path / "recorded", tmp_path / "replayed"
    for run_dir, args in ((recorded, late), (replayed, (*late, f"sync.replay={recorded}"))):
        out = sdpipe("train", f"run.dir={run_dir}", *args)
        assert out.returncode == 0, out.stderr
    assert losses(metrics(replayed)) == losses(metrics(recorded))
    assert digests(replayed) == digests(recorded)
    merged = [m for m in metrics(recorded, "train") if "behind_s" in m]
    assert merged and all(m["behind_s"] > 0 and m["behind_wait_s"] >= 0 for m in merged)
    out = sdpipe("train", f"run.dir={tmp_path / 'other'}", *late, f"sync.replay={recorded}",
                 "sync.overlap=0")
    assert out.returncode == 2 and "was recorded with sync.overlap=2, this run has 0" in out.stderr
