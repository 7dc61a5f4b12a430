"""A run's config as typed sections: what a process reads, as the schema's own dataclasses.

A process of a run holds its config in two forms, each for its own use:

- the **record**: the ``DictConfig`` read from ``config.yaml`` (read-only), which a checkpoint's
  manifest and ``final/`` store, and from which :mod:`.derived` makes the config of what comes
  next (a re-split, a resumed leg);
- the **settings**: the same values as a :class:`~sdpipe_cli.config.schema.Config`, each
  section (``settings.train``, ``settings.fault``, ...) an instance of its dataclass, the sync
  section the dataclass of its mode. A part that only reads takes the sections it reads, so its
  signature says what it depends on and the type checker knows every key (``settings.train.stepz``
  is an error before the code runs; ``cfg.train.stepz`` was one only when it ran).

Made from the config a part is built from (:func:`settings_of`; a worker's process makes them
once and hands them to its :class:`~sdpipe_cli.training.worker.Worker`), field by field from
the values (:mod:`.values`): under a millisecond for a run's config here. A child's record is
built from the same values (:func:`~sdpipe_cli.config.run_file.load_child_config`). They are
copies, so a part that holds them sees nothing another does to its own.

The sync strategies take their mode's own section (``settings.sync``: a group sync reads
``SdpipeSyncConfig.overlap``, not a key it may lack); the scheduler's pacing and its settling of
the measured wire, and the emulation of a worker's device (``make_slowdown``), read settings;
the metrics sinks take their section, and the record, which MLflow and W&B log; replay's check
of a recorded run against this one reads settings. The builders of the model and the data
take either (a worker gives them its settings, the launcher its config: :func:`plain` reads a
free-form value of either, ``model.kwargs`` or ``model.hf``); so does the group policy: the
scheduler builds it from its settings, the simulator from a config.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from sdpipe_cli.config.run_file import typed
from sdpipe_cli.config.schema import Config
from sdpipe_cli.config.values import settings_from

__all__ = ["plain", "settings_of"]


def settings_of(cfg: DictConfig) -> Config:
    """``cfg``'s values as the schema's dataclasses: a typed config's as they are; a schema-free
    one's (a prepared config, a child's record) built from its values (:mod:`.values`), or,
    where they are not all of their fields' types, typed by its sync mode's schema, which
    converts them or says what is wrong."""
    if OmegaConf.get_type(cfg) is Config:
        return cast(Config, OmegaConf.to_object(cfg))
    try:
        return settings_from(cast("dict[str, Any]", OmegaConf.to_container(cfg, resolve=True)))
    except (TypeError, KeyError):  # not values of their types: typing converts them, or says why
        return cast(Config, OmegaConf.to_object(typed(cfg, str(cfg.sync.name))))


def plain(value: Any) -> Any:
    """A value of the record or of the settings as plain data: a config node's container
    (resolved), a section's dict, or a copy of a dict or list of the settings."""
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return copy.deepcopy(value)
