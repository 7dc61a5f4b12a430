"""The one way a check refuses a setting: :func:`need`, shared by every section's checks
(:mod:`~sdpipe_cli.config.validation`, :mod:`~sdpipe_cli.config.pipeline_checks`)."""

from __future__ import annotations

from sdpipe_cli.config.schema import ConfigError

__all__ = ["need"]


def need(ok: bool, key: str, reason: str) -> None:
    """Raise :class:`~sdpipe_cli.config.schema.ConfigError` for ``key`` unless ``ok``."""
    if not ok:
        raise ConfigError(key, reason)
