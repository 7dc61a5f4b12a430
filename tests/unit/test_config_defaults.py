"""One home per default: the schema (``sdpipe_cli/config/schema.py``) holds every setting's
default, and the group options that stand for "the defaults" (``train/default.yaml``,
``sync/<mode>.yaml``, ...) only set what differs from it, so that changing a default is one edit
and ``docs/CONFIG.md`` (written from the schema) is the whole truth.

Named presets (``model/gpt_tiny.yaml``, ``train/resnet_paper.yaml``, ...) may pin a value equal
to today's default: they describe a recipe that must not move when a default does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from sdpipe_cli.config import schema

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_OPTIONS = {  # the option file -> the schema class it stands for
    "train/default.yaml": schema.TrainConfig, "pipeline/default.yaml": schema.PipelineConfig,
    "cluster/local.yaml": schema.ClusterConfig, "data/stdlib.yaml": schema.DataConfig,
    **{f"sync/{name}.yaml": cls for name, cls in schema.SYNC_CONFIGS.items()},
}


def repeated_defaults(text: str, cls: type) -> list[str]:
    defaults = OmegaConf.structured(cls)
    doc = yaml.safe_load(text) or {}
    return [key for key, value in doc.items()
            if key != "defaults" and key in defaults and not isinstance(value, dict)
            and type(value) is type(defaults[key]) and value == defaults[key]]


@pytest.mark.parametrize("option", sorted(DEFAULT_OPTIONS))
def test_a_default_option_repeats_no_default_of_the_schema(option):
    path = CONFIGS / option
    assert path.exists(), f"{option}: the default option is gone; update DEFAULT_OPTIONS"
    assert repeated_defaults(path.read_text(), DEFAULT_OPTIONS[option]) == []


def test_the_check_catches_a_repeated_default():
    assert repeated_defaults("lr: 3.0e-3\nsteps: 10\n", schema.TrainConfig) == ["lr"]
    assert repeated_defaults("name: sdpipe\nwindow_ms: 5.0\n", schema.SdpipeSyncConfig) == [
        "name", "window_ms"]
