"""The parts of ``sdpipe export`` / ``eval`` / ``sample`` that need no run: merging replicas,
the formats a model takes, the overrides eval accepts, sampling's choice of the next token."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st
from omegaconf import OmegaConf

from sdpipe_cli import checkpoint
from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.export import evaluation, formats, generation, weights
from sdpipe_cli.model import models
from sdpipe_cli.runtime.errors import CheckpointError


def _run_with_final(tmp_path, replicas):
    """A run folder of an mlp on P=len(replicas) pipelines and 2 stages whose final/ holds the
    given replicas (each a list of per-block state dicts)."""
    cfg = compose(["model=mlp", "data=synthetic", f"cluster.pipelines={len(replicas)}",
                   "pipeline.stages=2"])
    n = models.count_blocks(cfg.model)
    cfg.pipeline.partition = [n // 2]
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    OmegaConf.save(cfg, run / "config.yaml")
    for p, blocks in enumerate(replicas):
        for s, (lo, hi) in enumerate([(0, n // 2), (n // 2, n)]):
            stage = {f"{b - lo}.{k}": v for b in range(lo, hi) for k, v in blocks[b].items()}
            torch.save(stage, run / "final" / f"p{p}-s{s}.pt")
    steps = {str(p): 10 for p in range(len(replicas))}
    assert checkpoint.seal_final(run, {"config": OmegaConf.to_container(cfg), "steps": steps},
                                 len(replicas), 2) is not None
    return run, cfg


def _replica(cfg, seed):
    torch.manual_seed(seed)
    blocks, _ = models.build(cfg.model)
    return [b.state_dict() for b in blocks]


def test_equal_replicas_are_taken_as_they_are(tmp_path):
    cfg = compose(["model=mlp", "data=synthetic"])
    one = _replica(cfg, 0)
    run, _ = _run_with_final(tmp_path, [one, one, one])
    merged = weights.merge(weights.find(run))
    assert merged.how == "equal" and merged.distance == 0.0 and merged.pipelines == [0, 1, 2]
    assert all(torch.equal(merged.state[(b, k)], v) for b, block in enumerate(one)
               for k, v in block.items())


def test_replicas_that_differ_give_their_mean_and_the_consensus_distance(tmp_path):
    cfg = compose(["model=mlp", "data=synthetic"])
    a, b = _replica(cfg, 0), _replica(cfg, 1)
    run, _ = _run_with_final(tmp_path, [a, b])
    merged = weights.merge(weights.find(run))
    assert merged.how == "mean"
    squares = norm = 0.0
    for i, block in enumerate(a):
        for k, v in block.items():
            mean = (v.double() + b[i][k].double()) / 2
            assert torch.allclose(merged.state[(i, k)].double(), mean, atol=1e-7)
            squares += float(((v - mean) ** 2).sum() + ((b[i][k] - mean) ** 2).sum()) / 2
            norm += float((mean ** 2).sum())
    assert merged.distance == pytest.approx(math.sqrt(squares / norm), rel=1e-9)
    one = weights.merge(weights.find(run), pipeline=1)
    assert one.how == "pipeline" and one.distance == merged.distance
    assert all(torch.equal(one.state[(i, k)], v) for i, block in enumerate(b) for k, v in block.items())


def test_final_weights_are_sealed_only_when_every_replica_wrote_them(tmp_path):
    cfg = compose(["model=mlp", "data=synthetic"])
    run, cfg = _run_with_final(tmp_path, [_replica(cfg, 0)] * 2)
    (run / "final" / "p1-s0.pt").unlink()
    meta = {"config": OmegaConf.to_container(cfg), "steps": {"0": 1, "1": 1}}
    assert checkpoint.seal_final(run, meta, 2, 2) is None  # and the older manifest is gone
    with pytest.raises(CheckpointError, match="final/manifest.json: missing"):
        weights.find(run, "final")


def test_final_files_changed_after_the_seal_are_refused(tmp_path):
    cfg = compose(["model=mlp", "data=synthetic"])
    run, _ = _run_with_final(tmp_path, [_replica(cfg, 0)] * 2)
    torch.save({"0.weight": torch.zeros(1)}, run / "final" / "p1-s0.pt")  # a later leg's, cut short
    with pytest.raises(CheckpointError, match="p1-s0.pt: checksum mismatch"):
        weights.merge(weights.find(run))


def test_final_weights_of_another_run_are_not_this_runs(tmp_path):
    """final/ copied in from another run (its manifest carries another run id than config.yaml):
    refused, as a checkpoint of another run is; with the run's own id it is the run's."""
    cfg = compose(["model=mlp", "data=synthetic"])
    run, _ = _run_with_final(tmp_path, [_replica(cfg, 0)] * 2)
    manifest = json.loads((run / "final" / "manifest.json").read_text())
    saved = OmegaConf.load(run / "config.yaml")
    saved.run.id = "this-run"
    OmegaConf.save(saved, run / "config.yaml")
    for run_id, refused in (("another-run", True), ("this-run", False)):
        manifest["config"]["run"]["id"] = run_id
        (run / "final" / "manifest.json").write_text(json.dumps(manifest))
        if refused:
            with pytest.raises(CheckpointError, match="final: lies in .* another run's id"):
                weights.find(run, "final")
        else:
            assert weights.find(run, "final").run == run


def test_the_newest_of_final_and_the_latest_checkpoint_is_taken(tmp_path):
    cfg = compose(["model=mlp", "data=synthetic"])
    run, cfg = _run_with_final(tmp_path, [_replica(cfg, 0)] * 2)  # 10 iterations per pipeline
    assert weights.find(run).kind == "final"
    for steps, kind in ((12, "checkpoint"), (8, "final")):
        ckpt = run / "checkpoints" / f"step_{steps}"
        ckpt.mkdir(parents=True)
        (ckpt / "manifest.json").write_text(json.dumps(
            {"step": steps, "files": {}, "config": OmegaConf.to_container(cfg),
             "steps": {"0": steps, "1": steps}, "elapsed": 1.0}))
        assert weights.find(run).kind == kind
        shutil.rmtree(ckpt)


def test_a_saved_config_that_is_not_a_runs_is_one_error(tmp_path):
    cfg = compose(["model=mlp", "data=synthetic"])
    run, _ = _run_with_final(tmp_path, [_replica(cfg, 0)] * 2)
    manifest = json.loads((run / "final" / "manifest.json").read_text())
    for broken in ({"model": "x"}, {"cluster": {"pipelines": 0}}, {"nested": _deep(100)}):
        (run / "final" / "manifest.json").write_text(json.dumps(
            {**manifest, "config": {**manifest["config"], **broken}}))
        with pytest.raises((ConfigError, CheckpointError), match="manifest.json"):
            weights.find(run)


def _deep(n):
    node = {}
    for _ in range(n):
        node = {"a": node}
    return node


@pytest.mark.parametrize("fmt,arch,ok", [
    ("transformers", "gpt2", True), ("transformers", "bert", True), ("state_dict", "gpt2", True),
    ("torchvision", "resnet_cifar", True), ("state_dict", "resnet18", True),
    ("state_dict", "custom", True), ("transformers", "resnet18", False),
    ("torchvision", "gpt", False), ("onnx", "gpt", False)])
def test_formats_a_model_can_take(fmt, arch, ok):
    model = OmegaConf.create({"arch": arch})
    if ok:
        formats.check_format(fmt, model)
    else:
        with pytest.raises(ConfigError, match="--format"):
            formats.check_format(fmt, model)


def test_the_default_format_follows_the_model():
    assert [formats.default_format(OmegaConf.create({"arch": a}))
            for a in ("gpt2", "bert", "resnet50", "gpt", "custom")] == [
        "transformers", "transformers", "torchvision", "state_dict", "state_dict"]


def test_out_must_be_new_or_empty(tmp_path):
    formats.check_out(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    formats.check_out(tmp_path / "empty")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "file").write_text("x")
    os.symlink(tmp_path / "empty", tmp_path / "link")
    for name in ("full", "file", "link"):
        with pytest.raises(ConfigError, match="--out"):
            formats.check_out(tmp_path / name)


def test_eval_changes_only_the_data_and_the_batch():
    evaluation.check_keys(["data=digits", "data.eval_batches=3", "train.batch_size=16",
                           "pipeline.microbatches=2", "+data.path=/x"])
    for bad, key in (("train.lr=1", "train.lr"), ("model.d_model=8", "model.d_model"),
                     ("data", "data")):
        with pytest.raises(ConfigError, match=key):
            evaluation.check_keys([bad])


@pytest.mark.parametrize("field,value", [("max_new_tokens", 0), ("max_new_tokens", 10**9), ("top_k", -1),
                                         ("temperature", 0.0), ("temperature", float("nan")),
                                         ("temperature", 1e-300), ("temperature", float("inf")),
                                         ("seed", 2**64), ("seed", -2**63 - 1)])
def test_sampling_settings_are_checked(field, value):
    with pytest.raises(ConfigError, match=field.replace("_", "-")):
        generation.Settings(**{field: value}).check()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-20, 20), min_size=2, max_size=40), st.integers(1, 5),
       st.floats(*generation.TEMPERATURES))
def test_top_k_picks_only_among_the_k_likeliest(values, k, temperature):
    torch.manual_seed(0)  # the draw, the same every time hypothesis replays an example
    logits = torch.tensor([values])
    picked = int(generation._pick(logits, generation.Settings(top_k=k, temperature=temperature)))
    kth = torch.topk(logits, min(k, len(values))).values[0, -1]
    assert logits[0, picked] >= kth
    assert int(generation._pick(logits, generation.Settings())) == int(logits.argmax())


def test_bytes_round_trip_text():
    tok = generation._Bytes()
    assert tok.decode(tok.encode("déf ✓")) == "déf ✓"
    assert tok.decode([104, 105, 300]) == "hi"  # ids past the bytes (a mask token) are dropped
