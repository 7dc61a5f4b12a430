"""scripts/bench_interleaved.py runs (its figures are docs/BENCHMARKS.md's): a smoke test on two
stages, a few milliseconds of modelled compute."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.multiprocess


def test_the_benchmark_times_both_schedules_and_prints_their_table(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    sys.modules.pop("bench_interleaved", None)
    import bench_interleaved

    assert bench_interleaved.main(["--stages", "2", "--microbatches", "4", "--forward-ms", "4",
                                   "--steps", "1", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| 1f1b", "| interleaved"))]
    assert len(rows) == 2 and all("predicted" in row for row in rows)
