"""scripts/bench_real_links.py's pure parts: its variants, its table's arithmetic, and its one-line
refusal where it cannot make network namespaces (a real process without root; nothing is made)."""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
bench = importlib.import_module("bench_real_links")


def test_a_variant_keeps_the_commas_of_a_list():
    assert bench.variant("slow=sync=sdpipe,cluster.slowdown=[1,1,3],sync.every=4") == (
        "slow", ["sync=sdpipe", "cluster.slowdown=[1,1,3]", "sync.every=4"])
    for bad in ("sdpipe_h14", "sdpipe_h14=", "x y=sync=sdpipe", "h=sync"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.variant(bad)


def test_the_default_runs_none_first_and_the_h14_variant_last():
    args = bench.parse_args(["--modes", "sdpipe", "allreduce", "none"])
    assert [name for name, _ in bench.plan(args)] == ["none", "allreduce", "sdpipe", "sdpipe_h14"]
    assert bench.plan(bench.parse_args(["--modes", "sdpipe", "--variant"])) == [
        ("sdpipe", ["sync=sdpipe"])]


def _run(name, seed, rate=None, val=None, solo=None, sent=None, comm=None):
    return {"run": name, "seed": seed, "status": "ok", "samples_per_s": rate,
            "final_val_loss": val, "solo_rates": solo, "sync_bytes_per_sample": sent,
            "comm_share": comm}


def test_each_run_is_judged_against_the_none_and_allreduce_runs_of_its_seed():
    records = bench.judge([
        _run("none", 0, rate=100.0, val=3.0, solo={0: 90.0, 1: 30.0}, sent=0, comm=0.0),
        _run("allreduce", 0, rate=30.0, val=2.5, sent=9e4, comm=0.7),
        _run("sdpipe", 0, rate=60.0, val=2.75),
        _run("none", 1, rate=100.0, val=3.0, solo={0: 150.0, 1: 50.0}),
        _run("allreduce", 1, rate=40.0, val=2.0),
        _run("sdpipe", 1, rate=100.0, val=2.5),
    ])
    by = {(r["run"], r["seed"]): r for r in records}
    assert by["none", 0]["shown_rate"] == 120.0 and by["none", 0]["of_limit"] == 1.0  # the limit
    assert by["sdpipe", 0]["of_limit"] == 0.5 and by["sdpipe", 1]["of_limit"] == 0.5
    assert by["allreduce", 0]["of_limit"] == 0.25
    assert by["sdpipe", 0]["vs_allreduce"] == pytest.approx(1.1)
    assert by["sdpipe", 1]["vs_allreduce"] == pytest.approx(1.25)
    mean = {m["run"]: m for m in bench.means(records)}["sdpipe"]
    assert mean["seeds"] == 2 and mean["of_limit"] == 0.5
    assert mean["vs_allreduce"] == pytest.approx(1.175)  # the mean of the ratios
    assert mean["shown_rate"] == 80.0 and mean["comm_share"] is None
    cells = {r["run"]: r for r in bench.run_rows(records[:3])}
    assert cells["none (the limit)"]["sent per sample"] == "0"
    assert cells["allreduce"]["sent per sample"] == "90.0 kB"
    assert cells["allreduce"]["time in collectives"] == "70 %"


def test_without_a_none_or_allreduce_run_those_figures_are_missing():
    (r,) = bench.judge([_run("sdpipe", 0, rate=60.0, val=2.75)])
    assert r["of_limit"] is None and r["vs_allreduce"] is None
    row = bench.run_rows([r])[0]
    assert row["of the limit"] == "-" and row["vs all-reduce"] == "-"


def test_every_row_has_the_same_columns_whatever_its_windows():
    records = bench.judge([dict(_run("none", 0), windows=[100.0, None]),
                           dict(_run("sdpipe", 0), windows=[10.0, 5.0, 9.0],
                                changes=[{"at_s": 20.0, "rate_mbit": 5}])])
    rows = bench.run_rows(records, changes=2)
    assert [list(r) for r in rows][0] == list(rows[1])
    assert rows[1]["samples/s before / during / after"] == "10.0 / 5.0 / 9.0"
    assert rows[0]["samples/s before / during / after"] == "100.0 / -"


def test_samples_per_s_between_the_changes_of_the_links():
    lines = [{"kind": "train", "time": t, "pipeline": 0, "samples": 16 * i, "step": i}
             for i, t in enumerate([1.0, 2.0, 3.0, 5.0, 7.0, 9.0], start=1)]
    # 16 samples a second before 3.5 s, 8 after
    assert bench.windows(lines, [{"at_s": 3.5, "rate_mbit": 5}]) == [16.0, 8.0]


def test_the_meeting_period_over_time_from_group_lines():
    lines = [{"kind": "group", "time": t, "stage": 0, "round": i, "size": 2, **extra}
             for i, (t, extra) in enumerate([(1.0, {}), (2.0, {}), (3.0, {"every": 4}),
                                             (4.0, {"every": 4}), (5.0, {"every": 2})])]
    assert bench.every_over_time(lines) == [[1.0, 1], [3.0, 4], [5.0, 2]]
    row = bench.run_rows([dict(_run("sdpipe", 0), every=2,
                               every_over_time=bench.every_over_time(lines))])[0]
    assert row["H"] == "1 -> 2 (1 to 4, 2 changes)"


def test_link_estimates_are_the_runs_own_where_it_records_them():
    wire = {"time": 8.2, "every": 12, "precision": "bf16", "share": 0.1,
            "stages": [{"stage": 0, "mbit_s": 14.225, "latency_ms": 3.118}, {"stage": 1}]}
    row = bench.run_rows([dict(_run("sdpipe", 0), wire=wire)])[0]
    assert row["link estimates"] == ("every=12 precision=bf16 share=0.1 "
                                     "stage 0: 14.2 Mbit/s 3.1 ms")
    assert bench.run_rows([_run("sdpipe", 0)])[0]["link estimates"] == "-"


def test_without_root_it_says_so_in_one_line_and_makes_nothing(tmp_path):
    """A real process without root: as this user where it is not root, else as nobody."""
    command = [sys.executable, str(SCRIPTS / "bench_real_links.py"), "--runs", str(tmp_path / "r")]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root, and no setpriv to run the script without root")
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "bench_real_links: cannot run here: needs root to create network namespaces "
        f"(running as uid {65534 if os.geteuid() == 0 else os.geteuid()})"]
    assert not (tmp_path / "r").exists()


def test_a_runs_folder_that_holds_files_is_refused_before_anything_runs(tmp_path, capsys):
    """A launcher refuses a run folder that holds files, and the table would read that old
    run's metrics as this one's: the script refuses the folder first."""
    bench.parse_args(["--runs", str(tmp_path / "fresh")])
    (tmp_path / "used" / "sdpipe_seed0").mkdir(parents=True)
    with pytest.raises(SystemExit) as refused:
        bench.parse_args(["--runs", str(tmp_path / "used")])
    assert refused.value.code == 2
    assert "--runs:" in capsys.readouterr().err
