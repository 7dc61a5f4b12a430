"""Users' models end to end: a model of one's own across stages, bad input, mixed precision."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import metrics, sdpipe, user_module

pytestmark = pytest.mark.multiprocess


USER_MODEL = '''
    """A user's model: the width changes between blocks, a tuple crosses stages, BatchNorm."""
    import torch
    from torch import nn

    class Embed(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.emb = nn.Embedding(256, width)
        def forward(self, ids):
            return self.emb(ids), (ids % 2).to(torch.int64)  # hidden states and an integer side input

    class Widen(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.fc = nn.Linear(width, 2 * width)
        def forward(self, pair):
            h, parity = pair
            return torch.relu(self.fc(h)) + parity.unsqueeze(-1), parity

    class Narrow(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.fc = nn.Linear(2 * width, width)
            self.norm = nn.BatchNorm1d(width)  # running statistics, updated by every forward
        def forward(self, pair):
            return self.norm(self.fc(pair[0]).transpose(1, 2)).transpose(1, 2)

    def build(width=16):
        return nn.Sequential(Embed(width), Widen(width), Narrow(width), nn.Linear(width, 256))
'''


def test_a_model_of_ones_own_trains_on_three_stages(tmp_path, monkeypatch):
    # asynchronous 1F1B: group averages of the BatchNorm statistics land while micro-batches
    # that saved them are in flight
    user_module(tmp_path, monkeypatch, "user_nets", USER_MODEL)
    run = tmp_path / "run"
    out = sdpipe("train", f"run.dir={run}", "model=custom", "model._target_=user_nets.build",
                 "+model.width=24", "data=synthetic", "model.seq_len=16", "cluster.pipelines=2",
                 "pipeline.stages=3", "sync=sdpipe", "pipeline.schedule=async_1f1b",
                 "train.steps=30", "train.eval_every=0",
                 "train.batch_size=8", "pipeline.microbatches=2", "train.lr=1e-2")
    assert out.returncode == 0, out.stderr[-3000:]
    train = [m for m in metrics(run, "train") if "loss" in m]
    first = [m["loss"] for m in train[:4]]
    last = [m["loss"] for m in train[-4:]]
    assert sum(last) / 4 < sum(first) / 4 - 0.5, (first, last)


def test_bad_models_are_one_line_and_exit_2(tmp_path, monkeypatch):
    (tmp_path / "bad_nets.py").write_text(textwrap.dedent('''
        from torch import nn
        def empty():
            return nn.Sequential()
        def misfit():
            return [nn.Embedding(256, 8), nn.Linear(9, 256)]
        def two():
            return [nn.Embedding(256, 8), nn.Linear(8, 256)]
    '''))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    cases = {
        "model._target_=bad_nets.nothing": "model._target_: cannot import 'bad_nets.nothing'",
        "model._target_=bad_nets.empty": "model._target_: bad_nets.empty returned no blocks",
        "model._target_=bad_nets.misfit": "model: block 1 (block1) fails on block0's output (4, 64, 8)",
        "model._target_=bad_nets.two pipeline.stages=3": "pipeline.stages: is 3 but model custom has only 2 blocks",
    }
    for case, message in cases.items():
        run = tmp_path / f"run-{len(message)}"
        out = sdpipe("train", "model=custom", *case.split(), f"run.dir={run}", "cluster.pipelines=1")
        assert out.returncode == 2, (case, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("sdpipe: error: "), (case, out.stderr)
        assert message in lines[0], (case, lines[0])
        assert not run.exists()


def test_a_missing_extra_is_one_line_and_exit_2(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("transformers", "sklearn") else real(name, *a))
    for args, message in (
            (["model=gpt2"], "model.arch: gpt2 needs Hugging Face transformers: pip install -e '.[hf]'"),
            (["model=resnet_cifar", "data=digits"],
             "data.name: digits needs scikit-learn: pip install -e '.[digits]'")):
        out = sdpipe("train", *args, f"run.dir={tmp_path / 'run'}")
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0] == f"sdpipe: error: {message}"
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_and_fp16_skips_together(tmp_path, precision):
    # fp16 starts from a scale that overflows, so that it must skip steps and shrink it
    out = sdpipe("train", f"run.dir={tmp_path}", "model=mlp", "data=synthetic", "train.steps=30",
                 "train.eval_every=0", "pipeline.stages=2", f"train.precision={precision}",
                 f"train.loss_scale={2.0 ** 26}")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = metrics(tmp_path, "train")
    train = [m["loss"] for m in lines if "loss" in m]
    assert all(map(lambda v: v == v and abs(v) < 1e6, train)) and train[-1] < train[0] - 0.5
    if precision == "fp16":  # every stage of a pipeline made the same skip-or-step decisions
        by = {}
        for m in lines:
            by.setdefault((m["pipeline"], m["step"]), set()).add((m["skipped_steps"], m["loss_scale"]))
        assert by and all(len(v) == 1 for v in by.values()), by
        assert max(m["skipped_steps"] for m in lines) > 0


def test_fp16_overflowing_at_the_smallest_scale_stops_as_diverged(run_dir):
    """A gradient that is not finite even unscaled (lr 1e30 blows the weights up at the first
    step): fp16 halves its scale from 16 to 1, skipping those steps, and then stops as fp32 does
    (``train.on_nonfinite=stop``) instead of skipping every step left and ending as done."""
    out = sdpipe("train", f"run.dir={run_dir}", "model=mlp", "data=synthetic", "train.steps=40",
                 "train.eval_every=0", "cluster.pipelines=1", "pipeline.stages=2",
                 "train.precision=fp16", "train.loss_scale=16", "train.lr=1e30")
    assert out.returncode == 1, out.stderr[-3000:]
    assert "training diverged: the gradient norm is nan at loss scale 1 at step " in out.stderr
    steps = {m["step"] for m in metrics(run_dir, "train")}
    assert steps and max(steps) < 10  # 4 halvings, then the stop: far from the 40 asked for
