"""Pipeline parallelism must not change the training math.

One pipeline, the same seed and batches: splitting the model into 1, 2 or 4 stages, under 1F1B,
GPipe, ZB-H1, interleaved 1F1B or interleaved zero bubble, must give the same loss at every step, with the default
gradient clipping (by the norm of the whole model, summed over the stages) and AdamW. Per-stage
clipping differed here by ~4e-4 after a few steps; without clipping, the runs agree to float
rounding.
"""

from __future__ import annotations

import pytest

from tests.helpers import metrics, sdpipe

pytestmark = pytest.mark.multiprocess

STEPS = 10
# lr and clip chosen so that clipping is active at every step (the norm starts near 2.5).
BASE = ("model=mlp", "data=synthetic", "sync=allreduce", "cluster.pipelines=1",
        f"train.steps={STEPS}", "train.eval_every=0", "train.batch_size=8",
        "pipeline.microbatches=4", "train.lr=3e-3")


def losses(run_dir, *overrides: str) -> list[float]:
    out = sdpipe("train", f"run.dir={run_dir}", *BASE, *overrides)
    assert out.returncode == 0, out.stderr
    lines = sorted(metrics(run_dir, "train"), key=lambda m: m["step"])
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    return [m["loss"] for m in lines]


def test_stages_and_schedules_give_the_same_losses(tmp_path):
    """And ZB-H1, which runs each backward as two (the input's gradient, then the weights'),
    does 1F1B's arithmetic: the same losses to 1e-6 (CPU: to the bit)."""
    reference = losses(tmp_path / "s1", "pipeline.stages=1")
    assert reference[-1] < reference[0]  # it trains
    for stages in (2, 4):
        got = {}
        for schedule in ("1f1b", "gpipe", "zb_h1"):
            got[schedule] = losses(tmp_path / f"s{stages}-{schedule}", f"pipeline.stages={stages}",
                                   f"pipeline.schedule={schedule}")
            assert got[schedule] == pytest.approx(reference, rel=0, abs=2e-5), (stages, schedule)
        assert got["zb_h1"] == pytest.approx(got["1f1b"], rel=0, abs=1e-6), stages
    # two stages of two chunks each: each stage both neighbours of the other (the wrap group)
    for schedule in ("interleaved_1f1b", "interleaved_zb"):
        interleaved = losses(tmp_path / f"s2-{schedule}", "pipeline.stages=2", "pipeline.chunks=2",
                             f"pipeline.schedule={schedule}")
        assert interleaved == pytest.approx(got["1f1b"], rel=0, abs=1e-6), schedule
