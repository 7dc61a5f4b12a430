"""Error files: what a failed child leaves for the launcher to name the root cause."""

from __future__ import annotations

import pytest

from sdpipe_cli.runtime.errors import read_error, record


def test_an_escaping_exception_is_recorded_and_re_raised(tmp_path):
    with pytest.raises(ValueError, match="boom"):
        with record(tmp_path, "3", rank=3, pipeline=1, stage=1):
            raise ValueError("boom")
    err = read_error(tmp_path, "3")
    assert err["message"] == "ValueError: boom" and err["rank"] == 3 and "Traceback" in err["traceback"]


def test_nested_blocks_keep_the_innermost_record_and_its_time(tmp_path):
    """A worker records inside its process group; the outer block, reached after the group's
    teardown, must not overwrite that record with a later time."""
    with pytest.raises(RuntimeError):
        with record(tmp_path, "1", where="outer"):
            with record(tmp_path, "1", where="inner"):
                raise RuntimeError("memory limit")
    assert read_error(tmp_path, "1")["where"] == "inner"


def test_an_exit_is_not_an_error(tmp_path):
    with pytest.raises(SystemExit):
        with record(tmp_path, "0"):
            raise SystemExit(0)
    assert read_error(tmp_path, "0") is None
