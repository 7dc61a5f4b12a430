"""Fixtures shared by every test folder; plain helpers live in ``tests/helpers.py``."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import tempfile
from pathlib import Path

import pytest
import torch

from sdpipe_cli.data import sources
from sdpipe_cli.model import models
from sdpipe_cli.runtime.processes import LAZY_TORCH, WARM_UP
from tests.helpers import kill_leftovers

# One intra-op thread in each test process, as the launcher gives its workers: the suite's three
# test processes share two cores, and torch's threads (two in each) spin while they wait for work.
# The unit tier (-m "not multiprocess") took 208 and 258 CPU-s so against 238 and 291 without,
# alternately.
torch.set_num_threads(1)

# Processes the tests start (the runs of launchers in the test's process, helpers.spawn_and_join,
# launcher.spawn) are forks of one fork server per session, which imports torch once, as a
# launcher's does, and what the workers of the suite's data sets and models import: scikit-learn
# for the digits (3.7 s of CPU each), transformers' GPT-2 and BERT code (seconds each). Holding
# them slows no other run's workers: a subset of mlp and BERT runs took 42-44 CPU-s with
# transformers here against 53-56 without, alternately, twice.
HF = sorted({name for names in models.IMPORTS.values() for name in names})
SHARED_PRELOAD = ["torch", "torch.distributed", "sdpipe_cli.training.main",
                  "sdpipe_cli.sync.scheduler.process", "sdpipe_cli.sync.ps",
                  *sources.IMPORTS["digits"],
                  *(HF if importlib.util.find_spec("transformers") is not None else []),
                  *LAZY_TORCH, *WARM_UP]
multiprocessing.set_forkserver_preload(SHARED_PRELOAD)


@pytest.fixture(scope="session")
def shared_fork_server():
    """Started before the session's first run: a launcher finds it running and keeps it (one
    that started it would give it only its own run's imports)."""
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(SHARED_PRELOAD)
    forkserver.ensure_running()


@pytest.fixture(autouse=True)
def _fork_server_for_runs(request):
    if request.node.get_closest_marker("multiprocess"):
        request.getfixturevalue("shared_fork_server")


# The key that seals the code a run's config names (sdpipe_cli.config.trust): one per test
# process, inherited by the runs it starts, never the user's own ~/.config/sdpipe/trust.key.
os.environ["SDPIPE_TRUST_KEY"] = os.path.join(tempfile.mkdtemp(prefix="sdpipe-key-"), "trust.key")


# The test files that take longest, longest first (their summed durations in a whole-suite run).
# pytest-xdist hands out whole files in collection order (pyproject.toml: --dist loadfile
# --no-loadscope-reorder), so these start first and the short files fill in around them: the suite
# does not end with one worker alone on a long file. A file missing here only runs later.
SLOWEST_FIRST = ("integration/test_supervision.py", "integration/test_export.py",
                 "integration/test_multinode.py", "integration/test_chaos.py",
                 "integration/test_stragglers.py", "integration/test_resume.py",
                 "integration/test_train.py", "integration/test_hetero_runs.py",
                 "integration/test_hostile.py", "integration/test_sweep.py",
                 "integration/test_group_sync.py", "integration/test_models_exact.py")


def pytest_collection_modifyitems(items):
    """The slowest files first (:data:`SLOWEST_FIRST`); the others after them, in their order."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))


@pytest.fixture
def run_dir(tmp_path: Path):
    """A fresh run folder path; after the test, no process of that run may be left alive."""
    path = tmp_path / "run"
    yield path
    leftovers = kill_leftovers(path)
    assert not leftovers, f"orphan processes left by the run: {leftovers}"
