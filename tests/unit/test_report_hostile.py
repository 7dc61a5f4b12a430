"""`sdpipe report` and `sdpipe resume` on hostile input: one line naming the file (and line) or the
option, exit 2, no traceback, nothing written or overwritten."""

from __future__ import annotations

import json
import re

import pytest

from sdpipe_cli import analysis, checkpoint
from sdpipe_cli.cli import parsing, report
from sdpipe_cli.runtime.errors import CheckpointError

CONFIG = "model:\n  arch: mlp\nsync:\n  name: sdpipe\ntrain:\n  lr: 0.001\nrun:\n  dir: /a\n"
GOOD = [
    {"kind": "group", "time": 0.5, "stage": 0, "round": 1, "group": "group", "members": [0, 1],
     "iterations": [0, 0], "size": 2, "stop": False, "twins": True, "max_wait_s": 0.01,
     "waits": [0.01, 0.0]},
    {"kind": "train", "pipeline": 0, "step": 1, "time": 1.0, "samples": 8, "samples_per_s": 80.0,
     "loss": 2.0, "sync_s": 0.01, "step_s": 0.1, "wait_s": 0.01, "comm_s": 0.01},
    {"kind": "eval", "pipeline": 0, "step": 1, "time": 1.5, "samples": 8, "val_loss": 2.1},
]


def run_folder(tmp_path, *bad: str, name: str = "run"):
    """A run folder: the good lines, then ``bad`` (raw text), then a torn last line."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.yaml").write_text(CONFIG)
    text = "".join(json.dumps(m) + "\n" for m in GOOD) + "".join(b + "\n" for b in bad)
    (folder / "metrics.jsonl").write_text(text + '{"kind": "train", "ti')
    return folder


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sdpipe: error: "), err
    return lines[0]


def test_a_torn_last_line_is_still_left_out(tmp_path):
    run = report.load(run_folder(tmp_path))
    assert [m["kind"] for m in run.lines] == ["group", "train", "eval"]


def test_a_non_finite_loss_of_an_older_run_reads_as_null_as_it_is_written_now(tmp_path):
    folder = run_folder(tmp_path, '{"kind": "train", "pipeline": 0, "step": 2, "time": 2.0, '
                                  '"samples": 16, "loss": NaN}')
    assert analysis.read_metrics(folder)[-1]["loss"] is None


HOSTILE = {
    "deep list": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "deep object": ('{"kind": "train", "x": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}",
                    "nested too deeply"),
    "object for a number": (json.dumps({**GOOD[1], "step_s": {"a": {"b": 1}}}),
                            "'step_s' of a 'train' line should be a number, not an object"),
    "object for a rate": (json.dumps({**GOOD[1], "samples_per_s": {"a": 1}}),
                          "'samples_per_s' of a 'train' line should be a number"),
    "group without size": (json.dumps({k: v for k, v in GOOD[0].items() if k != "size"}),
                           "a 'group' line lacks 'size'"),
    "group with a string size": (json.dumps({**GOOD[0], "size": "2"}),
                                 "'size' of a 'group' line should be an integer, not \"2\""),
    "infinite time": ('{"kind": "train", "pipeline": 0, "time": Infinity, "samples": 8}',
                      "'time' of a 'train' line should be a finite number, not Infinity"),
    "NaN time": ('{"kind": "eval", "time": NaN, "val_loss": 1.0}',
                 "'time' of a 'eval' line should be a finite number, not NaN"),
    "integer past a float": ('{"kind": "train", "pipeline": 0, "time": 1' + "0" * 400
                             + ', "samples": 8}', "'time' of a 'train' line should be a finite"),
    "infinite wait": ('{"kind": "sync", "pipeline": 0, "stage": 0, "time": 1.0, '
                      '"wait_s": -Infinity, "comm_s": 0.1}', "'wait_s' of a 'sync' line"),
    "string accuracy": (json.dumps({**GOOD[2], "val_accuracy": "x"}),
                        "'val_accuracy' of a 'eval' line should be a number or null"),
    "list for a kind": (json.dumps({"kind": ["train"], "time": 1.0}),
                        "'kind' of a metrics line should be a string, not a list"),
    "object for a resume's moment": (json.dumps({"kind": "resume", "time": 2.0, "at": {"x": 1},
                                                 "steps": {"0": 0}, "checkpoint": "c"}),
                                     "'at' of a 'resume' line should be a number"),
}


@pytest.mark.parametrize("line, reason", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_metrics_line_is_one_error_naming_its_file_line_and_field(tmp_path, capsys,
                                                                               line, reason):
    folder = run_folder(tmp_path, line)
    out = tmp_path / "figures"
    assert parsing.main(["report", str(folder), "--out", str(out)]) == 2
    error = one_error_line(capsys)
    assert error.startswith(f"sdpipe: error: {folder / 'metrics.jsonl'}:4: "), error
    assert reason in error
    assert not out.exists()  # refused before anything is written


@pytest.fixture
def matplotlib():
    return pytest.importorskip("matplotlib")


def test_out_that_is_a_file_is_one_error_naming_out_and_the_file_is_kept(tmp_path, capsys,
                                                                       matplotlib):
    folder = run_folder(tmp_path)
    kept = tmp_path / "notes.txt"
    kept.write_text("keep me\n")
    assert parsing.main(["report", str(folder), "--out", str(kept)]) == 2
    assert re.fullmatch(rf"sdpipe: error: --out: {re.escape(str(kept))} is not a folder; .*",
                        one_error_line(capsys))
    assert kept.read_text() == "keep me\n"
    assert parsing.main(["report", str(folder), "--out", str(kept / "sub" / "figures")]) == 2
    assert f"--out: {kept / 'sub' / 'figures'} is under {kept}, which is not a folder" in (
        one_error_line(capsys))
    assert kept.read_text() == "keep me\n"


def test_a_file_where_the_default_report_folder_goes_is_one_error_naming_it(tmp_path, capsys,
                                                                          matplotlib):
    folder = run_folder(tmp_path)
    (folder / "report").write_text("mine\n")
    assert parsing.main(["report", str(folder)]) == 2
    assert one_error_line(capsys).startswith(f"sdpipe: error: {folder / 'report'}: is not a folder")
    assert (folder / "report").read_text() == "mine\n"


def test_a_report_into_a_new_folder_still_writes_its_figures(tmp_path, capsys, matplotlib):
    folder = run_folder(tmp_path)
    out = tmp_path / "a" / "b"
    assert parsing.main(["report", str(folder), "--out", str(out)]) == 0
    assert (out / "loss.png").is_file() and (out / "groups.png").is_file()


def test_out_of_range_group_sizes_still_draw(tmp_path, matplotlib):
    """The histogram's bar per size is for sizes a cluster has: a huge one must not make a bin
    per size (10**9 of them ran out of memory; 10**5 here, which is only slow without the
    bound), a size below 1 none."""
    for size in (10**5, 0):
        folder = run_folder(tmp_path, json.dumps({**GOOD[0], "round": 2, "size": size}),
                            name=f"run{size}")
        written = report.report([report.load(folder)], tmp_path / f"out{size}")
        assert tmp_path / f"out{size}" / "groups.png" in written


def checkpoint_with(tmp_path, elapsed: str):
    ckpt = tmp_path / "run" / "checkpoints" / "step_4"
    ckpt.mkdir(parents=True)
    manifest = ckpt / "manifest.json"
    manifest.write_text(f'{{"step": 4, "steps": {{"0": 4}}, "files": {{}}, "elapsed": {elapsed}}}')
    return ckpt, manifest


@pytest.mark.parametrize("elapsed", ["Infinity", "-Infinity", "NaN", "1e400", "-1", "1" + "0" * 30])
def test_a_manifest_with_a_non_finite_elapsed_is_refused_naming_it(tmp_path, elapsed):
    ckpt, manifest = checkpoint_with(tmp_path, elapsed)
    with pytest.raises(CheckpointError) as refused:
        checkpoint.read_manifest(ckpt)
    assert str(refused.value).startswith(f"{manifest}: 'elapsed' should be a finite number of "
                                         "seconds, at least 0, not ")


def test_resume_refuses_a_non_finite_elapsed_in_one_line_and_writes_nothing(tmp_path, capsys):
    ckpt, manifest = checkpoint_with(tmp_path, "Infinity")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert parsing.main(["resume", str(ckpt)]) == 2
    assert one_error_line(capsys) == (f"sdpipe: error: {manifest}: 'elapsed' should be a finite "
                                      "number of seconds, at least 0, not Infinity")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_finite_elapsed_is_read(tmp_path):
    ckpt, _ = checkpoint_with(tmp_path, "12.5")
    assert checkpoint.read_manifest(ckpt)["elapsed"] == 12.5
