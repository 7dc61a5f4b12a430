"""The profile.json document: reading it, its block costs, and what a bad one gets."""

from __future__ import annotations

import pytest

from sdpipe_cli.cli.parsing import main
from sdpipe_cli.config import measurements
from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.validation import validate
from sdpipe_cli.core.cluster import Cluster
from tests.helpers import make_doc, write_profile as write


def test_measured_device_keeps_its_times_rescaled_to_the_configured_speed(tmp_path):
    doc = measurements.load(write(tmp_path, make_doc({"a:0": (1.0, [1, 2]), "b:0": (0.5, [4, 8])})))
    assert measurements.block_costs(doc, "a:0", 1.0) == ([1, 2], [2, 4])
    assert measurements.block_costs(doc, "b:0", 0.5) == ([4, 8], [8, 16])
    assert measurements.block_costs(doc, "b:0", 1.0) == ([2, 4], [4, 8])  # now configured at full speed


def test_unmeasured_device_gets_the_median_at_its_speed(tmp_path):
    doc = measurements.load(write(tmp_path, make_doc(
        {"a:0": (1.0, [1, 2]), "b:0": (0.5, [4, 8]), "c:0": (1.0, [3, 3])})))
    # normalized to speed 1: [1, 2], [2, 4], [3, 3] -> medians [2, 3]
    assert measurements.block_costs(doc, "z:9", 1.0) == ([2, 3], [4, 6])
    assert measurements.block_costs(doc, None, 0.25) == ([8, 12], [16, 24])


def test_load_accepts_a_run_folder(tmp_path):
    write(tmp_path, make_doc({"a:0": (1.0, [1])}))
    assert measurements.load(tmp_path)["_path"].endswith("profile.json")


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d.pop("devices"), "lacks devices"),
    (lambda d: d.update(format="other/9"), "has format 'other/9'"),
    (lambda d: d["devices"][0].pop("forward_ms"), "device a:0 lacks forward_ms"),
    (lambda d: d["devices"][0].update(backward_ms=[1.0]), "block times for"),
    (lambda d: d.update(devices=[]), "measured no device"),
])
def test_bad_profiles_name_the_file_and_the_problem(tmp_path, mutate, words):
    doc = make_doc({"a:0": (1.0, [1, 2])})
    mutate(doc)
    path = write(tmp_path, doc)
    with pytest.raises(measurements.ProfileError) as err:
        measurements.load(path)
    assert path in str(err.value) and words in str(err.value)


def test_missing_or_garbled_profile(tmp_path):
    with pytest.raises(measurements.ProfileError, match="does not exist"):
        measurements.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(measurements.ProfileError, match="not a readable profile"):
        measurements.load(tmp_path / "bad.json")


@pytest.mark.parametrize("doc_kwargs, words", [
    ({"model": "mlp"}, "profiled model mlp"),
    ({"microbatch": 2}, "micro-batch size 2"),
])
def test_profile_of_another_model_is_refused_on_the_command_line(tmp_path, capsys, doc_kwargs, words):
    path = write(tmp_path, make_doc({"a:0": (1.0, [1.0] * 6)}, **doc_kwargs))
    rc = main(["train", "pipeline.partition=auto", f"profile={path}", f"run.dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("sdpipe: error: profile: ")
    assert words in err[0]
    assert not (tmp_path / "r").exists()


def test_worker_block_ms_follows_placement_speed_and_slowdown(tmp_path):
    path = write(tmp_path, make_doc({"fast:0": (1.0, [1.0] * 6)}))
    cfg = compose(["cluster.pipelines=2", f"profile={path}", "cluster.slowdown=[1, 3]",
                   "cluster.nodes=[{name: fast, devices: [{}, {}, {}]},"
                   " {name: slow, devices: [{speed: 0.5}]}]"])
    validate(cfg)
    ms = measurements.worker_block_ms(measurements.load(path), Cluster.from_config(cfg.cluster, 2),
                                 list(cfg.cluster.slowdown))
    assert ms[0][0] == [3.0] * 6  # forward 1 + backward 2
    assert ms[0][1] == [3.0] * 6
    assert ms[1][0] == [9.0] * 6  # slowdown 3
    assert ms[1][1] == [18.0] * 6  # slowdown 3 on a device at half speed
