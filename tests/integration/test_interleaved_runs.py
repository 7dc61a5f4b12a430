"""``sdpipe train pipeline.schedule=interleaved_1f1b pipeline.chunks=2`` (and ``interleaved_zb``): the same arithmetic
as 1F1B through the whole command, on four stages of two chunks of a transformer whose input
and output embeddings are one weight (tied across the first and the last stage): the same loss at
every step and the same validation loss, two pipelines averaging every step, and an export
of the run whose weights are 1F1B's."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import losses, metrics, sdpipe

pytestmark = pytest.mark.multiprocess

GPT = ("model=gpt_tiny", "model.n_layers=6", "model.seq_len=32", "data=stdlib", "sync=allreduce",
       "cluster.pipelines=2", "pipeline.stages=4", "pipeline.microbatches=4", "train.batch_size=8",
       "train.steps=3", "train.eval_every=3", "data.eval_batches=2", "run.save_final=true")
INTERLEAVED = ("pipeline.schedule=interleaved_1f1b", "pipeline.chunks=2")


def _run(run, *overrides: str) -> list[float]:
    out = sdpipe("train", f"run.dir={run}", *GPT, *overrides, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = sorted((m for m in metrics(run, "train") if m["pipeline"] == 0), key=lambda m: m["step"])
    return [m["loss"] for m in lines]


def _export(run, out_dir) -> dict[str, torch.Tensor]:
    out = sdpipe("export", str(run), "--out", str(out_dir), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    found = list(out_dir.glob("*.safetensors"))
    assert len(found) == 1, list(out_dir.iterdir())
    return load_file(found[0])


def test_interleaved_runs_do_1f1b_s_arithmetic_and_export_the_same_model(tmp_path):
    """Interleaved 1F1B, and interleaved zero bubble (each chunk's backward split into B and W,
    the tied embedding's W on the first and the last stage)."""
    plain = _run(tmp_path / "1f1b")
    assert len(plain) == 3 and plain[-1] < plain[0]
    theirs = _export(tmp_path / "1f1b", tmp_path / "x")
    val = metrics(tmp_path / "1f1b", "eval")[-1]["val_loss"]
    for name, schedule in (("il", "interleaved_1f1b"), ("izb", "interleaved_zb")):
        got = _run(tmp_path / name, *INTERLEAVED, f"pipeline.schedule={schedule}")
        assert got == pytest.approx(plain, rel=0, abs=1e-6), schedule
        assert metrics(tmp_path / name, "eval")[-1]["val_loss"] == pytest.approx(val, rel=0, abs=1e-6)
        ours = _export(tmp_path / name, tmp_path / f"{name}-x")
        assert ours.keys() == theirs.keys()
        for key, tensor in theirs.items():
            torch.testing.assert_close(ours[key], tensor, rtol=0, atol=1e-6, msg=f"{schedule}: {key}")


OWN_BASE = ("model=gpt_tiny", "data=synthetic", "sync=sdpipe", "cluster.pipelines=2",
            "pipeline.stages=2", "sync.connect_every=1", "sync.global_every=2", "train.steps=4",
            *INTERLEAVED)


def test_interleaved_pipelines_split_their_own_way_train_as_one_split_does(tmp_path):
    """Pipeline 1 cuts the model into its own four pieces (pieces 0 and 2 on stage 0): replicas
    average per segment of blocks, which lie in each stage's chunks, and with a full group every
    round the run trains as the one whose pipelines share a split."""
    own, shared = tmp_path / "own", tmp_path / "shared"
    out = sdpipe("train", f"run.dir={own}", *OWN_BASE, "pipeline.partitions={1:[1,2,3]}",
                 timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sdpipe("train", f"run.dir={shared}", *OWN_BASE, timeout=240).returncode == 0
    mine, theirs = losses(metrics(own)), losses(metrics(shared))
    assert sorted(mine) == sorted(theirs) == [(p, k) for p in range(2) for k in range(1, 5)]
    assert max(abs(mine[key] - theirs[key]) for key in mine) < 1e-5
    # the cuts of both splits, [2, 4, 5] and [1, 2, 3]: segments [0,1) [1,2) [2,3) [3,4) [4,5) [5,6)
    assert {m["stage"] for m in metrics(own, "group")} == set(range(6))
    assert all(m["members"] == [0, 1] for m in metrics(own, "group"))
