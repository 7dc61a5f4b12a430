"""Expanding a sweep's overrides into its runs (pure: Hydra's parser, nothing composed)."""

from __future__ import annotations

import pytest

from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.config.sweep import expand


def test_the_product_in_hydras_order_with_the_fixed_overrides_kept():
    combos = expand(["sync=allreduce,sdpipe", "model=mlp", "train.lr=1e-3,3e-3"])
    assert [c.overrides for c in combos] == [
        ("sync=allreduce", "model=mlp", "train.lr=0.001"),
        ("sync=allreduce", "model=mlp", "train.lr=0.003"),
        ("sync=sdpipe", "model=mlp", "train.lr=0.001"),
        ("sync=sdpipe", "model=mlp", "train.lr=0.003")]
    assert [c.varied for c in combos][1] == ("sync=allreduce", "train.lr=0.003")
    assert [c.name for c in combos] == ["0-sync-allreduce_train.lr-0.001",
                                        "1-sync-allreduce_train.lr-0.003",
                                        "2-sync-sdpipe_train.lr-0.001",
                                        "3-sync-sdpipe_train.lr-0.003"]


def test_ranges_and_choices_sweep_and_a_plain_run_is_one_combination():
    assert [c.varied for c in expand(["train.steps=range(1,4)"])] == [
        ("train.steps=1",), ("train.steps=2",), ("train.steps=3",)]
    assert [c.varied for c in expand(["model=choice(mlp)"])] == [("model=mlp",)]
    (only,) = expand(["model=mlp"])
    assert only.varied == () and only.name == "0-run"


def test_a_folder_name_holds_nothing_an_override_would_read():
    (combo,) = expand(["data.path='a b/c=d'"])
    assert combo.name == "0-run"
    (combo,) = expand(["data.path=choice('x=y,z')"])
    assert "=" not in combo.name and "," not in combo.name and "'" not in combo.name


def test_an_override_hydra_cannot_read_is_named():
    with pytest.raises(ConfigError) as err:
        expand(["train.lr=1e-3,,"])
    assert err.value.key == "train.lr"


def test_an_override_too_long_for_the_parser_is_named_before_it_is_parsed():
    """60,000 values took Hydra's parser over a minute; refused by length, at once."""
    with pytest.raises(ConfigError) as err:
        expand(["train.lr=1e-3,2e-3", "cluster.slowdown=[" + ",".join(["1"] * 60000) + "]"])
    assert err.value.key == "cluster.slowdown" and "120,018 characters" in err.value.reason
