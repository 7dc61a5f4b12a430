"""``sdpipe export`` and ``sdpipe eval`` of a run whose pipelines are split their own way
(``pipeline.partitions``): stage s of pipeline p holds the blocks of p's own partition, under the
stage's own names, and the one model is made block by block from each pipeline's own shards.

The run is a real ``sdpipe train`` of P=3 pipelines of gpt_tiny (6 blocks) in S=2 stages, split
at [3] (pipeline 0, the shared split), [1] and [5], with a global sync every round: the replicas
are equal at the end, so every pipeline's replica is the export, tensor for tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import metrics, sdpipe

pytestmark = pytest.mark.multiprocess

SPLITS = {0: [3], 1: [1], 2: [5]}  # pipeline 0 keeps the shared split; gpt_tiny has 6 blocks
RUN = ("model=gpt_tiny", "data=synthetic", "sync=sdpipe", "cluster.pipelines=3",
       "pipeline.stages=2", "sync.global_every=1", "train.steps=4",
       "pipeline.partitions={1:[1],2:[5]}", "run.save_final=true")


@pytest.fixture(scope="module")
def own_split_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("own_export") / "run"
    out = sdpipe("train", *RUN, f"run.dir={run}")
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def _export(run: Path, out: Path, *args: str) -> str:
    done = sdpipe("export", str(run), "--out", str(out), *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _eval(path: Path, *args: str) -> float:
    out = sdpipe("eval", str(path), *args)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stderr.splitlines() if x.startswith("eval: "))
    return float(line.split("val_loss ")[1].split()[0].rstrip(","))


def test_a_run_split_its_own_way_exports_every_pipelines_replica_as_one_model(own_split_run,
                                                                               tmp_path):
    from sdpipe_cli.export import formats

    run = own_split_run
    said = _export(run, tmp_path / "merged")
    assert "replicas are equal" in said
    manifest = json.loads((tmp_path / "merged" / "export.json").read_text())
    assert manifest["source"]["kind"] == "final"
    assert manifest["replicas"] == {"how": "equal", "pipelines": [0, 1, 2],
                                    "consensus_distance": 0.0}
    merged = formats.load(tmp_path / "merged").blocks
    assert len(merged) == 6

    # each pipeline's shards, read here by its own split, are the exported blocks
    for p, bounds in SPLITS.items():
        edges = [0, *bounds, 6]
        for s in range(2):
            shard = torch.load(run / "final" / f"p{p}-s{s}.pt", weights_only=True)
            held = {int(key.partition(".")[0]) for key in shard}
            assert held == set(range(edges[s + 1] - edges[s])), (p, s, sorted(held))
            for key, value in shard.items():
                index, _, name = key.partition(".")
                want = merged[edges[s] + int(index)].state_dict()[name]
                assert torch.equal(value, want), (p, s, key)

    # --pipeline P: that pipeline's replica, the same model tensor for tensor
    whole = torch.load(tmp_path / "merged" / "model.pt", weights_only=True)
    for p in (1, 2):
        _export(run, tmp_path / f"p{p}", "--pipeline", str(p))
        one = torch.load(tmp_path / f"p{p}" / "model.pt", weights_only=True)
        assert list(one) == list(whole)
        assert all(torch.equal(one[k], whole[k]) for k in whole), p

    # the export, the run's weights merged in memory and one pipeline's replica all evaluate to
    # the loss the run recorded at its end
    recorded = {p: [m["val_loss"] for m in metrics(run, "eval") if m["pipeline"] == p][-1]
                for p in SPLITS}
    assert abs(_eval(tmp_path / "merged") - recorded[0]) < 1e-4, recorded
    assert abs(_eval(run, "--pipeline", "2") - recorded[2]) < 1e-4, recorded


def test_replicas_that_differ_and_are_split_differently_average_block_by_block(tmp_path):
    """No training: final/ holds three different replicas, each cut by its own partition."""
    from sdpipe_cli import checkpoint
    from sdpipe_cli.config.composition import compose
    from sdpipe_cli.export import weights
    from sdpipe_cli.model import models

    cfg = compose(["model=mlp", "data=synthetic", "cluster.pipelines=3", "pipeline.stages=2"])
    n = models.count_blocks(cfg.model)
    assert n >= 3
    splits = {0: [n // 2], 1: [1], 2: [n - 1]}
    cfg.pipeline.partition = splits[0]
    cfg.pipeline.partitions = {1: splits[1], 2: splits[2]}
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    OmegaConf.save(cfg, run / "config.yaml")
    replicas = []
    for p, bounds in splits.items():
        torch.manual_seed(p)
        blocks = [b.state_dict() for b in models.build(cfg.model)[0]]
        replicas.append(blocks)
        edges = [0, *bounds, n]
        for s in range(2):
            stage = {f"{b - edges[s]}.{k}": v for b in range(edges[s], edges[s + 1])
                     for k, v in blocks[b].items()}
            torch.save(stage, run / "final" / f"p{p}-s{s}.pt")
    steps = {str(p): 10 for p in splits}
    assert checkpoint.seal_final(run, {"config": OmegaConf.to_container(cfg), "steps": steps},
                                 3, 2) is not None

    source = weights.find(run)
    mean = weights.merge(source)
    assert mean.how == "mean" and mean.distance > 0
    for b in range(n):
        for k, v in replicas[0][b].items():
            if v.is_floating_point():
                want = torch.stack([r[b][k].double() for r in replicas]).mean(0).to(v.dtype)
                assert torch.equal(mean.state[(b, k)], want), (b, k)
    for p in splits:
        one = weights.merge(source, pipeline=p)
        assert all(torch.equal(one.state[(b, k)], v) for b in range(n)
                   for k, v in replicas[p][b].items()), p
