"""scripts/bench_interleaved.py runs (its figures are docs/BENCHMARKS.md's): a smoke test on two
stages, a few milliseconds of modelled compute, the schedules and the evaluation orders."""

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
    assert [row.split()[1] for row in rows] == ["1f1b", "interleaved", "interleaved_zb"]
    assert all("predicted" in row for row in rows)
    assert bench_interleaved.main(["--evaluation", "--stages", "2", "--microbatches", "4",
                                   "--forward-ms", "4", "--steps", "1", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split()[1] for row in rows[1:]] == ["pipelined", "one_at_a_time"]  # after the header
