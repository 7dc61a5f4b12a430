"""Fixtures shared by every test folder; plain helpers live in ``tests/helpers.py``."""

from __future__ import annotations

import importlib.util
import multiprocessing
from pathlib import Path

import pytest

from sdpipe_cli.runtime.processes import LAZY_TORCH
from tests.helpers import kill_leftovers

# Processes the tests start themselves (helpers.spawn_and_join, launcher.spawn) are forks of one
# fork server per session, which imports torch once, as the launcher's does.
# With transformers installed, its GPT-2 and BERT code too, as the launcher preloads it for runs
# of those models (about 5 CPU-seconds per worker that would import it itself).
HF = (["transformers.models.gpt2.modeling_gpt2", "transformers.models.bert.modeling_bert",
       "transformers.masking_utils"] if importlib.util.find_spec("transformers") else [])
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "sdpipe_cli.training.main",
                                        "sdpipe_cli.sync.scheduler", "sdpipe_cli.sync.ps",
                                        *LAZY_TORCH, *HF])


@pytest.fixture
def run_dir(tmp_path: Path):
    """A fresh run folder path; after the test, no process of that run may be left alive."""
    path = tmp_path / "run"
    yield path
    leftovers = kill_leftovers(path)
    assert not leftovers, f"orphan processes left by the run: {leftovers}"
