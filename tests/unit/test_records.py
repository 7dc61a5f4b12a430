"""The records of metrics.jsonl (sdpipe_cli/analysis/records.py): one class per kind, from which
the reader's schema, the writers' lines, docs/RUNS.md's table and the suite's check of every line
come."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sdpipe_cli.analysis import (
    BY_KIND,
    CHECKED,
    CHOICES,
    RECORDS,
    REQUIRED,
    SCHEMA,
    read_metrics,
    records,
    records_reference as reference,
)
from sdpipe_cli.config.schema import ConfigError
from tests.helpers import REPO, metrics

RUNS = REPO / "docs" / "RUNS.md"


def test_runs_md_holds_the_generated_table():
    page = RUNS.read_text()
    assert page.count(reference.BEGIN) == 1 and page.count(reference.END) == 1
    assert reference.replaced(page) == page, (
        "docs/RUNS.md is out of date: python -m sdpipe_cli.analysis.records_reference "
        "--write docs/RUNS.md")


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.kind)
def test_every_field_is_said_in_its_kind_s_doc(record):
    named = set(re.findall(r"`([a-z_]+)`", record.__doc__ or ""))
    assert set(record.fields()) <= named, sorted(set(record.fields()) - named)


@pytest.mark.parametrize("record", [r for r in RECORDS if r.kind in CHOICES], ids=lambda r: r.kind)
def test_every_word_a_field_may_hold_is_said_in_its_kind_s_doc(record):
    named = set(re.findall(r"`([a-z_]+)`", record.__doc__ or ""))
    for words in CHOICES[record.kind].values():
        assert words <= named, sorted(words - named)


def test_the_words_of_a_decision_are_the_policy_s():
    """A group line's reason and each member's and left-out pipeline's why are typed by the
    policy's own words (core/grouping/state.py), so a word the policy adds is one the suite's
    runs may write."""
    from sdpipe_cli.core.grouping.state import JOINED, LEFT_OUT, REASONS

    assert CHOICES["group"] == {"reason": frozenset(REASONS), "outside": frozenset(LEFT_OUT),
                                "inside": frozenset(JOINED)}


def test_kinds_are_one_each_and_the_schema_is_theirs():
    assert len(BY_KIND) == len(RECORDS)
    assert SCHEMA == {r.kind: r.fields() for r in RECORDS}
    for table in (CHECKED, REQUIRED):
        for kind, names in table.items():
            assert set(names) <= set(SCHEMA[kind]), kind


def test_types_come_from_the_annotations():
    train = SCHEMA["train"]
    assert train["loss"] == "number?" and train["step"] == "int" and train["links"] == "list"
    assert SCHEMA["group"]["reason"] == "str" and SCHEMA["group"]["outside"] == "dict"
    assert SCHEMA["done"]["peak_memory_mb"] == "number?"
    assert SCHEMA["recovered"] == SCHEMA["straggler"]  # the same fields


def test_a_line_holds_only_declared_fields():
    assert records.CheckpointLine.line(step=4, time=1.5, steps={"0": 4}, path="x") == {
        "kind": "checkpoint", "step": 4, "time": 1.5, "steps": {"0": 4}, "path": "x"}
    with pytest.raises(TypeError, match="'checkpoint' line has no field stepz"):
        records.CheckpointLine.line(stepz=4, time=1.5)


def _run_with(tmp_path: Path, *lines: dict) -> Path:
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    return run


GOOD = {"kind": "train", "pipeline": 0, "step": 1, "time": 0.5, "samples": 8, "loss": 5.5}


def test_the_suite_s_check_fails_on_a_field_no_record_declares(tmp_path):
    """tests/helpers.metrics checks every line the suite's runs write: a field, a kind or a type
    the records do not declare fails the test that reads it (the reader lets them through)."""
    assert metrics(_run_with(tmp_path, GOOD)) == [GOOD]
    stray = {**GOOD, "surprise": 1}
    assert read_metrics(_run_with(tmp_path / "a", stray)) == [stray]
    with pytest.raises(AssertionError, match="'surprise' is not in its record"):
        metrics(_run_with(tmp_path / "b", stray))
    with pytest.raises(AssertionError, match="kind 'novel' has no record"):
        metrics(_run_with(tmp_path / "c", {"kind": "novel", "time": 1.0}))
    with pytest.raises(AssertionError, match="'lr' = 'fast' is not a number"):
        metrics(_run_with(tmp_path / "d", {**GOOD, "lr": "fast"}))
    group = {"kind": "group", "time": 1.0, "stage": 0, "round": 1, "size": 2, "reason": "all",
             "outside": {"2": "late"}}
    assert metrics(_run_with(tmp_path / "e", group)) == [group]
    with pytest.raises(AssertionError, match="'reason' = 'hunch' is not one of"):
        metrics(_run_with(tmp_path / "f", {**group, "reason": "hunch"}))
    with pytest.raises(AssertionError, match="'reason' = None is not a str"):
        metrics(_run_with(tmp_path / "g", {**group, "reason": None}))
    with pytest.raises(AssertionError, match="'outside' = .* is not one of"):
        metrics(_run_with(tmp_path / "h", {**group, "outside": {"2": "asleep"}}))


def test_the_reader_still_refuses_a_checked_field_of_the_wrong_type(tmp_path):
    with pytest.raises(ConfigError, match="'samples' of a 'train' line should be a number"):
        read_metrics(_run_with(tmp_path, {**GOOD, "samples": "many"}))


def test_a_polled_file_s_new_lines_are_checked_too(tmp_path):
    """A test polling a growing run's lines checks each once: what was appended since is checked."""
    run = _run_with(tmp_path, GOOD)
    assert len(metrics(run)) == 1
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({**GOOD, "step": 2, "surprise": 1}) + "\n")
    with pytest.raises(AssertionError, match="line 2: a 'train' line's 'surprise'"):
        metrics(run)
