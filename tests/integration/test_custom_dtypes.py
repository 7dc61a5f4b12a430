"""A user's model whose blocks change dtype trains across a stage boundary: float64 activations
cross from one stage to the next. Which dtypes the pre-check lets through, and which it refuses
before any process starts, is tests/unit/test_custom_hostile.py's (whose user module this runs)."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import metrics, sdpipe, user_module
from tests.unit.test_custom_hostile import MODEL, NAME, SOURCE

pytestmark = pytest.mark.multiprocess


def test_float64_across_a_stage_trains(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, NAME, raising=False)
    user_module(tmp_path, monkeypatch, NAME, SOURCE)
    run = tmp_path / "run"
    out = sdpipe("train", f"run.dir={run}", *MODEL, "pipeline.stages=2", "pipeline.partition=[2]",
                 f"model._target_={NAME}.float64_weights_after_double")
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(metrics(run, "train")) == 2
