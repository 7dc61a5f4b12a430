"""scripts/bench_schedule_memory.py counts what a stage keeps alive, and frees it when it goes."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch
from torch import nn

from sdpipe_cli.core.schedule import gpipe, one_f_one_b, zero_bubble_h1

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
bench = importlib.import_module("bench_schedule_memory")


def _stage():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)).train()


def _peak(schedule, stages: int, m: int, stage: int) -> int:
    x = torch.randn(8, 16)
    return bench.run_stage([(_stage(), x, False)], None, None, schedule(stages, m, stage))


def test_the_peak_grows_with_the_micro_batches_held_not_with_those_run():
    """GPipe holds all m; 1F1B's stage s holds S - s whatever m is: the counter frees what the
    backward releases (were nothing freed, 1F1B's peak would grow with m too)."""
    one = _peak(gpipe, 4, 1, 0)
    assert _peak(gpipe, 4, 6, 0) == 6 * one
    assert _peak(one_f_one_b, 4, 6, 2) == _peak(one_f_one_b, 4, 12, 2) == 2 * one


def test_a_micro_batch_awaiting_its_weight_gradient_holds_more_than_its_forward_saved():
    """ZB-H1's middle stage holds S micro-batches between their forward and their W, each more
    than a forward's tensors: torch's split keeps the graph and the gradients reaching the
    weights."""
    one = _peak(gpipe, 4, 1, 0)
    held = _peak(zero_bubble_h1, 4, 8, 1)
    assert held > 4 * one


def test_an_interleaved_stage_holds_chunk_micro_batches_each_a_chunk_s_worth():
    """Two chunks, each a stage's module here: stage 0 of S = 2 holds S + (v - 1) S = 4
    chunk-micro-batches at once (1F1B's first stage: 2 of the stage's two-chunk worth)."""
    from sdpipe_cli.core.interleaved import interleaved_1f1b

    x = torch.randn(8, 16)
    one = _peak(gpipe, 4, 1, 0)
    chunks = [(_stage(), x, False), (_stage(), x, False)]
    assert bench.run_stage(chunks, None, None, interleaved_1f1b(2)(2, 4, 0)) == 4 * one


def test_an_interleaved_zero_bubble_stage_frees_each_chunk_s_micro_batch_at_its_w():
    """Interleaved zero bubble: each chunk's micro-batch held from its F to its W (the W of
    each chunk through its own weights), up to ``v S`` = 4 on every stage, each more than a
    forward's tensors."""
    from sdpipe_cli.core.interleaved import interleaved_zero_bubble

    x = torch.randn(8, 16)
    one = _peak(gpipe, 4, 1, 0)
    chunks = [(_stage(), x, False), (_stage(), x, False)]
    actions = interleaved_zero_bubble(2)(2, 4, 1)
    assert 4 * one < bench.run_stage(chunks, None, None, actions) < 8 * one


def test_the_estimate_bounds_every_schedule_s_measured_peak_on_every_stage(tmp_path):
    """``run.memory_check``'s estimate against what each stage measurably holds, gpt_tiny in
    four stages (of two chunks for the interleaved schedules): the estimate is the upper bound
    the check refuses runs by, also where a split backward holds more between its B and W than
    its forward saved (it was under ZB-H1's last stage's peak when it counted a micro-batch's
    forward only)."""
    out = tmp_path / "memory.json"
    assert bench.main(["--schedules", "1f1b,zb_h1,interleaved_1f1b,interleaved_zb", "--layers", "6",
                       "--microbatch", "2", "--seq-len", "32", "--json", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 16
    for row in rows:
        assert row["peak_mb"] <= row["estimate_mb"], row
