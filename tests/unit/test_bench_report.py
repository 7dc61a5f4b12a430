"""The benchmark scripts' --markdown PATH: a result table under one stamp line (scripts/_report.py)."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
_report = importlib.import_module("_report")

STAMP = re.compile(r"measured \d{4}-\d\d-\d\d UTC at commit ([0-9a-f]{4,}(-dirty)?|unknown), "
                   r"machine: \d+ cores, torch \S+, Python \S+, command: `.+`")


def test_write_markdown_stamps_the_table(tmp_path):
    path = _report.write_markdown(tmp_path / "sub" / "t.md", "| a |\n|---|\n| 1 |\n",
                                  command="python scripts/bench_x.py --steps 2")
    first, blank, *table = path.read_text().splitlines()
    assert STAMP.fullmatch(first), first
    assert first.endswith("command: `python scripts/bench_x.py --steps 2`")
    assert blank == "" and table == ["| a |", "|---|", "| 1 |"]


@pytest.mark.parametrize("name", ["bench_async", "bench_convergence", "bench_hetero", "bench_scheduler"])
def test_markdown_takes_a_path(name):
    args = importlib.import_module(name).parse_args(["--markdown", "out/table.md"])
    assert args.markdown == Path("out/table.md")
    assert importlib.import_module(name).parse_args([]).markdown is None


def test_bench_sync_keeps_its_bare_flag():
    bench_sync = importlib.import_module("bench_sync")
    assert bench_sync.parse_args(["--markdown"]).markdown == "-"  # print Markdown, as before
    assert bench_sync.parse_args(["--markdown", "t.md"]).markdown == "t.md"
    assert bench_sync.parse_args([]).markdown is None


def test_bench_convergence_takes_a_variant_with_its_own_budget():
    bench = importlib.import_module("bench_convergence")
    args = bench.parse_args(["--variants", "allreduce,sdpipe@400"])
    assert [bench.split(v) for v in args.variants] == [("allreduce", None), ("sdpipe", 400)]
    assert "train.steps=400" in bench.overrides(args, "straggler", 3e-3, Path("r"), 400)
    assert "train.steps=200" in bench.overrides(args, "straggler", 3e-3, Path("r"))
    for bad in ("sdpipe@0", "sdpipe@x", "nope@10", "nope"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--variants", bad])


def test_bench_convergence_times_a_given_target():
    bench = importlib.import_module("bench_convergence")
    run = {"status": "ok", "variant": "sdpipe@400", "lr": 3e-3, "final_val_loss": 2.1,
           "curve": [[10.0, 2.5], [20.0, 2.2], [30.0, 2.1]], "first_train_s": 5.0,
           "samples_per_s": 1.0}
    assert bench.summarize("straggler", [dict(run)], 2.25)["runs"][0]["time_to_target_s"] == 15.0
    assert bench.summarize("straggler", [dict(run)])["runs"][0]["time_to_target_s"] is None
    assert bench.parse_args(["--target", "2.2392"]).target == 2.2392


def test_bench_convergence_random_scenario_is_a_valid_run_with_random_straggles():
    from sdpipe_cli.config.schema import compose, validate

    bench = importlib.import_module("bench_convergence")
    args = bench.parse_args(["--scenarios", "random"])
    cfg = compose(bench.overrides(args, "random", 3e-3, Path("r")))
    validate(cfg)
    st = cfg.cluster.stragglers
    assert (st.probability, st.factor, st.per) == (0.1, 3.0, "iteration")
    assert list(cfg.cluster.slowdown) == [1.0] * 4
