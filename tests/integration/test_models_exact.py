"""Cutting a user's model into stages does not change its training.

With one pipeline and all-reduce, cutting a model (BatchNorm, tied embeddings) into 1 or 2
stages must not change the loss at any step; activation checkpointing recomputes the same
training; tied weights stay bit-identical between the stages that hold a copy, under lock-step
and semi-decentralized sync.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import metrics, sdpipe

pytestmark = pytest.mark.multiprocess

STEPS = 5
EXACT = ("sync=allreduce", "cluster.pipelines=1", f"train.steps={STEPS}", "train.eval_every=0",
         "train.batch_size=8", "pipeline.microbatches=4", "train.warmup=1")
MODELS = {
    "resnet_cifar": ("model=resnet_cifar", "data=digits", "data.eval_batches=1",  # no eval checked
                     "train.optimizer=sgd", "train.lr=0.05"),
    "bert_tiny": ("model=bert_tiny", "data=synthetic", "train.lr=3e-3"),
}


def losses(run_dir, *overrides: str) -> list[float]:
    out = sdpipe("train", f"run.dir={run_dir}", *overrides)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = sorted(metrics(run_dir, "train"), key=lambda m: m["step"])
    return [m["loss"] for m in lines]


def tied_copies(run_dir, pipeline: int) -> tuple[torch.Tensor, torch.Tensor]:
    first = torch.load(run_dir / "final" / f"p{pipeline}-s0.pt")
    last = torch.load(run_dir / "final" / f"p{pipeline}-s1.pt")
    (emb,) = [v for k, v in first.items() if k.endswith("word_embeddings.weight")]
    (dec,) = [v for k, v in last.items() if k.endswith("decoder.weight")]
    return emb, dec


@pytest.mark.parametrize("model", sorted(MODELS))
def test_cutting_a_model_into_stages_keeps_every_loss(tmp_path, model):
    reference = losses(tmp_path / "s1", *EXACT, *MODELS[model], "pipeline.stages=1")
    assert len(reference) == STEPS
    # ResNet-20's BatchNorm and BERT's tied embeddings cut once (more cuts of the same code:
    # tests/integration/test_pipeline_equivalence.py)
    for stages in (2,):
        # two stages with activation checkpointing: recomputing changes nothing either
        more = ("pipeline.activation_checkpointing=true", "run.save_final=true") if stages == 2 else ()
        got = losses(tmp_path / f"s{stages}", *EXACT, *MODELS[model], f"pipeline.stages={stages}", *more)
        assert got == pytest.approx(reference, rel=0, abs=1e-5), stages
    # each backward split in two (ZB-H1): BatchNorm's, and the tied embeddings' gradients
    # summed over their two stages, as 1F1B's
    zero_bubble = losses(tmp_path / "zb", *EXACT, *MODELS[model], "pipeline.stages=2",
                         "pipeline.schedule=zb_h1")
    assert zero_bubble == pytest.approx(reference, rel=0, abs=1e-5)
    if model == "bert_tiny":  # its tied embeddings: one copy on each end of the pipeline
        emb, dec = tied_copies(tmp_path / "s2", 0)
        assert torch.equal(emb, dec)


def test_tied_copies_stay_bit_identical_under_group_sync(tmp_path):
    out = sdpipe("train", f"run.dir={tmp_path}", "model=bert_tiny", "data=synthetic", "sync=sdpipe",
                 "train.steps=10", "train.eval_every=0", "train.batch_size=8",
                 "pipeline.stages=2", "run.save_final=true")
    assert out.returncode == 0, out.stderr[-3000:]
    for p in range(2):  # each stage's groups averaged its copy with other replicas; retied after
        emb, dec = tied_copies(tmp_path, p)
        assert torch.equal(emb, dec), (p, (emb - dec).abs().max())
    train = [m for m in metrics(tmp_path, "train") if "loss" in m]
    assert train[-1]["loss"] < train[0]["loss"]
