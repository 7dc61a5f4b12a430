"""Experiment trackers beside ``metrics.jsonl``.

The scheduler's :class:`~sdpipe_cli.runtime.metrics.MetricsLog` hands each metrics line's scalars
(:func:`~sdpipe_cli.runtime.metrics.scalars` says which: one owner of the tags and their steps) to
every sink that :func:`open_sinks` opened for the run. A sink has two methods: ``log(items)``, the
scalars of one line as (tag, value, step, run-clock seconds), and ``close(failed)``. Each writes
only under the run's folder and never reaches the network:

- :class:`TensorBoard` (``metrics.tensorboard=true``): ``<run>/tb``, through
  ``torch.utils.tensorboard``; its wall times are the run clock's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Protocol

from omegaconf import DictConfig

__all__ = ["Sink", "TensorBoard", "open_sinks", "close_all"]

Scalar = tuple[str, float, int, Optional[float]]  # tag, value, step, run-clock seconds


class Sink(Protocol):
    def log(self, items: list[Scalar]) -> None:
        """The scalars of one metrics line."""

    def close(self, failed: bool = False) -> None:
        """Flush and end; ``failed``: the scheduler is ending on an error."""


class TensorBoard:
    """Scalars as TensorBoard events under ``folder``."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(folder), flush_secs=5)

    def log(self, items: list[Scalar]) -> None:
        for tag, value, step, seconds in items:
            self._writer.add_scalar(tag, value, step, walltime=seconds)

    def close(self, failed: bool = False) -> None:
        self._writer.close()


def open_sinks(cfg: DictConfig, run_dir: Path) -> list[Sink]:
    """The trackers ``cfg.metrics`` asks for, opened for the run in ``run_dir``; if one cannot
    be opened, those opened before it are closed and the error raised."""
    metrics = cfg.metrics
    wanted: list[tuple[bool, Any]] = [
        (metrics.tensorboard, lambda: TensorBoard(run_dir / "tb")),
    ]

    sinks: list[Sink] = []
    try:
        for on, make in wanted:
            if on:
                sinks.append(make())
    except BaseException:
        close_all(sinks, failed=True)
        raise
    return sinks


def close_all(sinks: list[Sink], failed: bool = False) -> None:
    """Close every sink, even where one raises (the first error is raised after)."""
    error: Optional[BaseException] = None
    for sink in sinks:
        try:
            sink.close(failed)
        except BaseException as e:  # the others are closed first
            error = error or e
    if error is not None:
        raise error
