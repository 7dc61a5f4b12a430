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
    from sdpipe_cli.config.composition import compose
    from sdpipe_cli.config.validation import validate

    bench = importlib.import_module("bench_convergence")
    args = bench.parse_args(["--scenarios", "random"])
    cfg = compose(bench.overrides(args, "random", 3e-3, Path("r")))
    validate(cfg)
    st = cfg.cluster.stragglers
    assert (st.probability, st.factor, st.per) == (0.1, 3.0, "iteration")
    assert list(cfg.cluster.slowdown) == [1.0] * 4


@pytest.mark.parametrize("pipelines,slowdown", [(4, [1, 1, 2, 4]), (3, [1, 2, 4]), (2, [2, 4]),
                                               (1, [4])])
def test_bench_convergence_mixed_scenario_slows_the_last_pipelines_2x_and_4x(pipelines, slowdown):
    from sdpipe_cli.config.composition import compose
    from sdpipe_cli.config.validation import validate

    bench = importlib.import_module("bench_convergence")
    args = bench.parse_args(["--scenarios", "mixed", "--pipelines", str(pipelines)])
    cfg = compose(bench.overrides(args, "mixed", 3e-3, Path("r")))
    validate(cfg)
    assert list(cfg.cluster.slowdown) == slowdown
    assert cfg.cluster.stragglers.probability == 0


def test_bench_convergence_intervals_over_seeds():
    bench = importlib.import_module("bench_convergence")
    mean, sd, half = bench.interval([1.0, 2.0, 3.0])
    assert (mean, sd) == (2.0, 1.0) and half == pytest.approx(4.303 / 3 ** 0.5)
    assert bench.interval([5.0])[:2] == (5.0, 0.0) and bench.interval([]) is None

    def seed(ar_val, sd_val, ar_t, sd_t):
        best = {"allreduce": {"final_val_loss": ar_val, "time_to_target_s": ar_t,
                              "samples_per_s": 100.0, "fraction_of_limit": 0.4},
                "sdpipe": {"final_val_loss": sd_val, "time_to_target_s": sd_t,
                           "samples_per_s": 200.0, "fraction_of_limit": 0.8}}
        return {"best": best, "limit_samples_per_s": 250.0}

    got = bench.across_seeds([seed(2.0, 2.02, 20.0, 10.0), seed(2.2, 2.2, 10.0, 6.0)])
    ratio = got["sdpipe"]["time vs allreduce"]
    assert ratio[0] == pytest.approx(0.55) and ratio[3] == 2  # each seed against its own
    assert got["sdpipe"]["val vs allreduce"][0] == pytest.approx((1.01 + 1.0) / 2)
    # the ideal is all-reduce's samples/s over the limit (0.4): 0.55 / 0.4
    assert got["sdpipe"]["vs ideal"][0] == pytest.approx(0.55 / 0.4)
    assert got["allreduce"]["time vs allreduce"][:2] == (1.0, 0.0)
    row = bench.seed_rows(got)[1]
    assert row[0] == "sdpipe" and row[2].startswith("1.005 (sd 0.007")


def test_the_scheduler_bench_times_a_signal_from_the_batch_it_came_in(tmp_path):
    """The policy's clock reads one moment per batch of events. A ready signal handled last in
    its batch and answered first in a later one: the ``sched`` part (taken to published, less the
    policy's wait between the two batches) must not come out below 0, as it did when "taken" was
    the signal's own stamp (CI, -0.037 ms)."""
    import json

    bench = importlib.import_module("bench_scheduler")
    us = 1e6
    events = [  # batch A at 1.000 s, its last event the ready of (stage 0, pipeline 2, iteration 5)
        {"cat": "scheduler", "ts": 1.000 * us, "dur": 0.004 * us, "tid": 0, "args": {}},
        {"cat": "ready", "ts": 1.0039 * us, "tid": 1, "args": {"pipeline": 2, "iteration": 5}},
        # batch B at 1.010 s answers it first thing
        {"cat": "scheduler", "ts": 1.010 * us, "dur": 0.002 * us, "tid": 0, "args": {}},
        {"cat": "round", "ts": 1.000 * us, "dur": 0.0101 * us, "tid": 1,
         "args": {"members": [2], "iterations": [5]}},
    ]
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "8.trace.json").write_text(json.dumps({"dropped": 0, "events": events}))
    taken, published = bench.timeline(tmp_path, 8)
    assert taken[(0, 2, 5)] == pytest.approx(1.000)  # batch A's moment, not the signal's 1.0039
    held = 1.010 - 1.000  # the policy's wait: batch B's moment less batch A's
    assert published[(0, 2, 5)] - taken[(0, 2, 5)] - held == pytest.approx(0.0001)
