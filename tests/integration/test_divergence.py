"""A diverging run stops before its bad state spreads or is saved; or skips the bad steps."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import metrics, sdpipe, user_module

pytestmark = pytest.mark.multiprocess

SPIKE = '''
    """A model whose first block turns its output into NaN at its 10th forward (iteration 3 of
    4 micro-batches): one bad step, in every pipeline, then normal training."""
    import torch
    from torch import nn

    class Spike(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 16)
            self.calls = 0

        def forward(self, ids):
            self.calls += 1
            h = self.emb(ids)
            return h * float("nan") if self.calls == 10 and spikes() else h

    def spikes():
        """Every replica, or with SPIKE_RANK only that worker's first incarnation."""
        import os
        rank = os.environ.get("SPIKE_RANK")
        return rank is None or (os.environ["RANK"] == rank and os.environ.get("SDPIPE_INCARNATION", "0") == "0")

    def build():
        return nn.Sequential(Spike(), nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 256))
'''
RUN = ("model=custom", "model._target_=spike.build", "data=synthetic", "model.seq_len=16",
       "train.steps=8", "train.eval_every=0", "train.batch_size=8", "pipeline.microbatches=4",
       "checkpoint.every=2", "sync=allreduce")


@pytest.fixture
def spike(tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch, "spike", SPIKE)


def finite_checkpoints(run) -> list[str]:
    names = []
    for ckpt in sorted((run / "checkpoints").iterdir()):
        for shard in ckpt.glob("[0-9]*.pt"):
            model = torch.load(shard, weights_only=True)["model"]
            assert all(torch.isfinite(t).all() for t in model.values() if t.is_floating_point()), shard
        names.append(ckpt.name)
    return names


def test_a_nonfinite_gradient_stops_the_run_before_anything_bad_is_kept(spike, tmp_path):
    run = tmp_path / "run"
    out = sdpipe("train", f"run.dir={run}", *RUN)
    assert out.returncode == 1, out.stderr[-2000:]
    line = [ln for ln in out.stderr.splitlines() if ln.startswith("sdpipe: error:")]
    assert len(line) == 1 and "training diverged: the gradient norm is nan at step 3" in line[0]
    assert f"sdpipe resume {run} train.lr=" in line[0]
    assert finite_checkpoints(run) == ["step_2"]
    assert all(m["step"] <= 2 for m in metrics(run, "train"))


def test_skip_steps_over_a_nonfinite_gradient_and_goes_on(spike, tmp_path):
    run = tmp_path / "run"
    out = sdpipe("train", f"run.dir={run}", *RUN, "train.on_nonfinite=skip")
    assert out.returncode == 0, out.stderr[-2000:]
    train = sorted(metrics(run, "train"), key=lambda m: (m["pipeline"], m["step"]))
    assert [m.get("skipped_steps", 0) for m in train if m["pipeline"] == 0] == [0, 0, 1, 1, 1, 1, 1, 1]
    assert [m["loss"] for m in train if m["step"] == 3] == [None, None]  # NaN, written as JSON null
    assert all(m["loss"] is not None for m in train if m["step"] != 3)
    assert finite_checkpoints(run) == ["step_4", "step_6", "step_8"]  # the newest three kept
    json.loads((run / "summary.json").read_text())  # strict JSON


def test_a_replica_that_alone_diverges_is_healed_from_a_healthy_one(spike, tmp_path, monkeypatch):
    monkeypatch.setenv("SPIKE_RANK", "0")  # pipeline 0's first stage, before its restart
    run = tmp_path / "run"
    out = sdpipe("train", f"run.dir={run}", *RUN[:-2], "train.steps=30", "sync=sdpipe", "cluster.compute_ms=10",
                 "fault.on_pipeline_loss=restart", "fault.restart_backoff=0.1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "training diverged" in out.stderr and "pipeline 0 restarted" in out.stderr
    heals = metrics(run, "heal")
    assert sorted(h["stage"] for h in heals) == [0, 1] and all(h["source"] == 1 for h in heals)
    done = metrics(run, "done")
    for stage in (0, 1):  # the final global sync: every replica equal, none ever averaged a NaN
        assert len({d["param_digest"] for d in done if d["stage"] == stage}) == 1
    assert all(m["loss"] is not None for m in metrics(run, "train") if m["pipeline"] == 1)
