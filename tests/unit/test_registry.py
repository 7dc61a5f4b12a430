"""One registry per kind of name: every sync mode and schedule the schema accepts exists as a
config option and as code, and nothing else does."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from sdpipe_cli.config.composition import compose, group_options
from sdpipe_cli.config.schema import SCHEDULES, SYNC_CONFIGS
from sdpipe_cli.config.settings import settings_of
from sdpipe_cli.core.placement import Placement
from sdpipe_cli.sync.strategies import make_sync


def test_every_sync_mode_is_an_option_with_its_own_settings_and_a_strategy():
    assert set(group_options()["sync"]) == set(SYNC_CONFIGS)
    for name, node in SYNC_CONFIGS.items():
        cfg = compose([f"sync={name}"])
        assert OmegaConf.get_type(cfg.sync) is node and cfg.sync.name == name
        # built from the typed section, as a worker builds it (settings_of(cfg).sync)
        strategy = make_sync(settings_of(cfg).sync, events=None, groups=None, where=Placement(0, 2, 2),
                             device=torch.device("cpu"))
        assert strategy.name == name


def test_every_schedule_name_has_a_schedule():
    from sdpipe_cli.core.interleaved import CHUNKED_SCHEDULES, schedule_of

    for name in SCHEDULES:
        chunks = 2 if name in CHUNKED_SCHEDULES else 1
        actions = schedule_of(name, chunks)(2, 4, 0)
        assert sorted({a.chunk for a in actions}) == list(range(chunks)), name


def test_every_mode_is_one_entry_in_each_registry_and_they_agree():
    """core.modes (what a mode needs), the schema (its settings), the worker's strategy class and
    the simulator's transports name the same modes; the properties the worker's strategy states
    of itself match the registry's."""
    from sdpipe_cli.core import modes, simulation
    from sdpipe_cli.sync.strategies import strategy_class

    assert list(modes.MODES) == list(SYNC_CONFIGS)
    assert set(simulation.MODES) == set(modes.MODES)
    for name, mode in modes.MODES.items():
        cls = strategy_class(name)
        assert cls.name == name
        assert cls.scheduled_checkpoints == mode.group_policy, name  # the scheduler's global syncs
        assert cls.local_step == (not mode.servers), name  # a server applies the update
        assert not (mode.restart_run and not mode.checkpoints), name
    assert modes.names_with("servers") == ["ps"]
    with pytest.raises(ValueError, match="sync.name: unknown mode 'nope'; choose one of sdpipe"):
        modes.mode("nope")
