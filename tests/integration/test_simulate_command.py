"""``sdpipe simulate`` as a user runs it: one process, no workers, a table and simulation.json;
bad input gets one line and exit 2, and an existing run folder is never written into."""

from __future__ import annotations

import json

import pytest

from sdpipe_cli.cli.parsing import main
from tests.helpers import sdpipe

ARGS = ("simulate", "model=mlp", "data=synthetic", "cluster.pipelines=4", "cluster.compute_ms=10",
        "cluster.slowdown=[1,1,1,3]", "train.steps=20")


def test_simulate_writes_the_table_and_the_document(tmp_path):
    out = tmp_path / "sim"
    r = sdpipe(*ARGS, f"run.dir={out}", "--compare", "allreduce,none,ps,adpsgd", timeout=120)
    assert r.returncode == 0, r.stderr
    for mode in ("sdpipe", "allreduce", "none", "ps", "adpsgd"):
        assert mode in r.stdout
    assert "of limit" in r.stdout and f"simulation: {out}" in r.stderr
    doc = json.loads((out / "simulation.json").read_text())
    for key in ("sync", "samples_per_s", "limit_samples_per_s", "fraction_of_limit",
                "mean_group_size", "wall_s", "iterations"):
        assert key in doc, key
    assert doc["sync"] == "sdpipe" and len(doc["iterations"]) == 4
    assert sum(doc["iterations"]) == 4 * 20
    assert 0 < doc["fraction_of_limit"] <= 1
    assert [row["sync"] for row in doc["compare"]] == ["allreduce", "none", "ps", "adpsgd"]
    allreduce = doc["compare"][0]
    assert allreduce["samples_per_s"] < doc["samples_per_s"]  # a 3x straggler holds it back


@pytest.mark.parametrize("args, key", [
    (["simulate", "--compare", "gossip", *ARGS[1:]], "--compare"),
    (["simulate", "model=mlp", "data=synthetic"], "cluster.compute_ms"),  # nothing modelled
    ([*ARGS, "sync.max_group=1"], "sync.max_group"),
    ([*ARGS, "simulate.jitter=-1"], "simulate.jitter"),
])
def test_simulate_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, key):
    """In-process (the same main() the command runs): one line naming the key, exit 2."""
    out = tmp_path / "never"
    assert main([*args, f"run.dir={out}"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and key in lines[0], lines
    assert not out.exists()


def test_simulate_never_writes_into_an_existing_run_folder(tmp_path, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert main([*ARGS, f"run.dir={busy}"]) == 2
    assert "run.dir" in capsys.readouterr().err
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]


def test_overrides_may_follow_an_option(tmp_path, capsys):
    """`sdpipe simulate A=1 --compare none B=2`: B=2 is an override too, applied after A=1."""
    out = tmp_path / "sim"
    assert main(["simulate", *ARGS[1:], "train.steps=5", "--compare", "none",
                 "train.steps=7", f"run.dir={out}"]) == 0
    doc = json.loads((out / "simulation.json").read_text())
    assert sum(doc["iterations"]) == 4 * 7
    assert [row["sync"] for row in doc["compare"]] == ["none"]
    with pytest.raises(SystemExit) as stopped:  # an unknown option is still an error
        main(["simulate", *ARGS[1:], "--bogus"])
    assert stopped.value.code == 2 and "--bogus" in capsys.readouterr().err
