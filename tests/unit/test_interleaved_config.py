"""``pipeline.schedule=interleaved_1f1b`` with ``pipeline.chunks``: what a run accepts, what it
refuses in one line (exit 2, nothing written), and what preparing it resolves (the partition
into ``v x S`` pieces, the run plan's units, the memory estimate)."""

from __future__ import annotations

import pytest

from sdpipe_cli.cli import preparing
from sdpipe_cli.cli.parsing import main
from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.config.validation import validate
from sdpipe_cli.core.interleaved import interleaved_1f1b, interleaved_zero_bubble
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.data import sources
from sdpipe_cli.model import memory, models
from tests.helpers import one_error_line

IL = ["model=mlp", "cluster.device=cpu", "pipeline.schedule=interleaved_1f1b", "pipeline.chunks=2"]


@pytest.mark.parametrize("overrides, key, reason", [
    (["pipeline.chunks=0"], "pipeline.chunks", "must be at least 1"),
    (["model=mlp", "pipeline.chunks=2"], "pipeline.chunks",
     "pipeline.schedule=1f1b runs one chunk a stage; use pipeline.schedule=interleaved_1f1b"),
    (["model=mlp", "pipeline.schedule=async_1f1b", "pipeline.chunks=2"], "pipeline.chunks",
     "async_1f1b runs one chunk a stage"),
    ([*IL, "pipeline.microbatches=3", "train.batch_size=6"], "pipeline.microbatches",
     "a multiple of pipeline.stages=2"),
    ([*IL, "pipeline.stages=1"], "pipeline.chunks", "on one stage"),
    ([*IL, "pipeline.chunks=4"], "pipeline.chunks", "8 pieces, but model mlp has 6 blocks; use at most 3"),
    ([*IL, "pipeline.partition=[3]"], "pipeline.partition",
     "has 1 boundaries; 2 stages of 2 chunks need 3"),
    ([*IL, "pipeline.partitions={1: [1, 2]}"], "pipeline.partitions.1",
     "has 2 boundaries; 2 stages of 2 chunks need 3"),
    ([*IL, "pipeline.schedule=interleaved_zb", "pipeline.microbatches=3", "train.batch_size=6"],
     "pipeline.microbatches", "interleaved_zb takes micro-batches in groups of the stages"),
    ([*IL, "pipeline.schedule=interleaved_zb", "pipeline.activation_checkpointing=true"],
     "pipeline.schedule", "interleaved_zb with recomputed activations"),
])
def test_what_interleaving_refuses_is_one_line(overrides, key, reason, tmp_path, capsys):
    with pytest.raises(ConfigError, match=reason) as info:
        validate(compose(overrides))
    assert info.value.key == key
    run = tmp_path / "run"
    assert main(["train", *overrides, f"run.dir={run}"]) == 2
    assert reason in one_error_line(capsys.readouterr().err, key)
    assert not run.exists()


def test_a_prepared_run_cuts_the_model_into_v_times_s_pieces_and_syncs_by_stage():
    cfg, _, _ = preparing.prepare(compose([*IL, "cluster.pipelines=3"]))
    assert list(cfg.pipeline.partition) == [2, 4, 5]  # uniform over 4 pieces of 6 blocks
    plan = RunPlan.of(cfg)
    assert plan.chunks == 2 and plan.stages == 2
    # the units of averaging are the stages: each holds the same two chunks in every pipeline
    assert plan.segments.count == 2 and plan.segments.uniform
    assert [len(models.build_stage_module(cfg, s)) for s in (0, 1)] == [3, 3]  # 0, 1, 4 | 2, 3, 5
    assert models.chunk_slices(cfg, 0) == models.chunk_slices(cfg, 1) == [slice(0, 2), slice(2, 3)]
    one, _, _ = preparing.prepare(compose(["model=mlp", "cluster.device=cpu", "cluster.pipelines=3"]))
    assert RunPlan.of(one).chunks == 1


def test_the_memory_estimate_holds_each_stage_s_chunks():
    """A stage's weights are its chunks' blocks; its activations, the most its chunks'
    micro-batches hold at once under the interleaved schedule, each at its chunk's size."""
    cfg, _, _ = preparing.prepare(compose(IL))
    flat, _, _ = preparing.prepare(compose(["model=mlp", "cluster.device=cpu",
                                            "pipeline.partition=[2,4,5]", "pipeline.stages=4"]))
    example = sources.example(cfg, RunPlan.of(cfg).microbatch_size, device="meta")[0]
    chunked = memory.estimate(cfg, example)
    pieces = memory.estimate(flat, example)
    assert chunked is not None and pieces is not None
    assert chunked[0].weights == pieces[0].weights + pieces[2].weights
    assert chunked[1].weights == pieces[1].weights + pieces[3].weights
    assert [e.in_flight for e in chunked] == [4, 3]  # S - s + (v - 1) S
    for s in (0, 1):  # each chunk's micro-batches at their own size, at the schedule's peak
        kept = [pieces[s].activations, pieces[s + 2].activations]
        now = peak = 0
        for a in interleaved_1f1b(2)(2, 4, s):
            now += kept[a.chunk] if a.kind == "F" else -kept[a.chunk]
            peak = max(peak, now)
        assert peak <= chunked[s].activations * chunked[s].in_flight < peak + chunked[s].in_flight


def test_the_memory_estimate_of_interleaved_zero_bubble_holds_each_chunk_until_its_w():
    """Under ``interleaved_zb`` a micro-batch chunk's activations live until its ``W`` (the
    weights' gradient needs them), and from its ``B`` it holds the gradients reaching its
    weights too (counted as much again): ``v S`` chunks on every stage, the peak weighed by
    chunk."""
    cfg, _, _ = preparing.prepare(compose([*IL, "pipeline.schedule=interleaved_zb"]))
    plain, _, _ = preparing.prepare(compose(IL))
    example = sources.example(cfg, RunPlan.of(cfg).microbatch_size, device="meta")[0]
    ours, theirs = memory.estimate(cfg, example), memory.estimate(plain, example)
    assert ours is not None and theirs is not None
    assert [e.in_flight for e in ours] == [4, 4] and [e.in_flight for e in theirs] == [4, 3]
    assert [e.weights for e in ours] == [e.weights for e in theirs]
    flat, _, _ = preparing.prepare(compose(["model=mlp", "cluster.device=cpu",
                                            "pipeline.partition=[2,4,5]", "pipeline.stages=4"]))
    pieces = memory.estimate(flat, example)
    assert pieces is not None
    for s in (0, 1):
        kept = [pieces[s].activations, pieces[s + 2].activations]
        now = peak = 0
        for a in interleaved_zero_bubble(2)(2, 4, s):
            now += kept[a.chunk] if a.kind in "FB" else -2 * kept[a.chunk]
            peak = max(peak, now)
        assert peak <= ours[s].activations * ours[s].in_flight < peak + ours[s].in_flight
