"""Experiment trackers beside ``metrics.jsonl``: TensorBoard, MLflow and Weights & Biases.

The scheduler's :class:`~sdpipe_cli.runtime.metrics.MetricsLog` hands each metrics line's scalars
(:func:`~sdpipe_cli.runtime.metrics.scalars` says which: one owner of the tags and their steps) to
every sink that :func:`open_sinks` opened for the run. A sink has two methods: ``log(items)``, the
scalars of one line as (tag, value, step, run-clock seconds), and ``close(failed)``. Each writes
only under the run's folder and never reaches the network:

- :class:`TensorBoard` (``metrics.tensorboard=true``): ``<run>/tb``, through
  ``torch.utils.tensorboard``; its wall times are the run clock's;
- :class:`MLflow` (``metrics.mlflow=true``): a file store, ``<run>/mlruns``, experiment
  :data:`PROJECT`, one run named after the run folder (a resumed or restarted leg of the run goes
  on in the same MLflow run); the composed config as params (dotted keys, values as JSON,
  truncated to MLflow's length limit); the run ends FINISHED, or FAILED where the scheduler failed;
- :class:`WandB` (``metrics.wandb=offline``): an offline W&B run under ``<run>/wandb``
  (``offline-run-*``; each leg of the run adds one), project :data:`PROJECT`, named and grouped
  after the run folder, the composed config as its config. W&B wants one increasing step per
  run, so each series is drawn against its own step metric instead (:func:`step_axis`:
  ``pipeline<p>/iteration``, ``stage<s>/round``). Its ``wandb-core`` service process ends on
  close.

mlflow and wandb are optional extras, imported only here and only when enabled.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig, OmegaConf

from sdpipe_cli.config.schema import MetricsConfig

__all__ = ["Sink", "TensorBoard", "MLflow", "WandB", "open_sinks", "close_all", "flat_params",
           "step_axis", "PROJECT"]

PROJECT = "sdpipe"  # the MLflow experiment and the W&B project of every run

Scalar = tuple[str, float, int, float | None]  # tag, value, step, run-clock seconds


class Sink(Protocol):
    def log(self, items: list[Scalar]) -> None:
        """The scalars of one metrics line."""

    def close(self, failed: bool = False) -> None:
        """Flush and end; ``failed``: the scheduler is ending on an error."""


def step_axis(tag: str) -> str:
    """What the step of a :func:`~sdpipe_cli.runtime.metrics.scalars` tag counts, as a series
    name: a pipeline's iterations (``pipeline1/iteration``: its tags begin ``pipeline<p>/``) or
    a stage's rounds (``stage0/round``: ``stage<s>/``)."""
    head = tag.split("/", 1)[0]
    return f"{head}/iteration" if head.startswith("pipeline") else f"{head}/round"


def wandb_on(value: Any) -> bool:
    """Whether ``metrics.wandb`` asks for a W&B run."""
    return str(value).lower() == "offline"


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


def flat_params(config: dict[str, Any], limit: int) -> dict[str, str]:
    """A nested config as MLflow params: dotted keys (characters other than letters, digits,
    ``_``, ``-``, ``.`` and spaces become ``_``), values as JSON (strings as they are), each cut
    to ``limit`` characters."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
            return
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > limit:
            text = text[:limit - 3] + "..."
        flat[re.sub(r"[^\w.\- ]", "_", prefix)[:250]] = text

    walk("", config)
    return flat


class MLflow:
    """One MLflow run in a file store under ``folder`` (see the module's note)."""

    def __init__(self, folder: Path, name: str, config: dict[str, Any]):
        # MLflow 3 keeps the file store only for those who ask for it (a database otherwise),
        # and sends usage telemetry unless told not to: this process asks for the one and not
        # for the other
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils import validation

        self._metric = Metric
        self.client = MlflowClient(tracking_uri=folder.resolve().as_uri())
        experiment = self.client.get_experiment_by_name(PROJECT)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(PROJECT))
        earlier = [r for r in self.client.search_runs([experiment_id], max_results=1000)
                   if r.info.run_name == name]
        if earlier:  # an earlier leg of this run: go on in its MLflow run
            run = earlier[0]
            self.run_id = run.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            logged = set(run.data.params)
        else:
            run = self.client.create_run(experiment_id, run_name=name,
                                         tags={"sdpipe.run_dir": str(folder.parent.resolve())})
            self.run_id = run.info.run_id
            logged = set()
        limit = getattr(validation, "MAX_PARAM_VAL_LENGTH", 500)
        per_batch = getattr(validation, "MAX_PARAMS_TAGS_PER_BATCH", 100)
        params = [Param(k, v) for k, v in flat_params(config, limit).items() if k not in logged]
        for i in range(0, len(params), per_batch):
            self.client.log_batch(self.run_id, params=params[i:i + per_batch])

    def log(self, items: list[Scalar]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(tag, value, now, step)
                                                    for tag, value, step, _ in items])

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


# W&B settings (0.19 and later): no console output, no system metrics, host, git or code
QUIET = dict(silent=True, console="off", x_disable_stats=True, x_disable_meta=True,
             x_disable_machine_info=True, disable_git=True, save_code=False, disable_code=True,
             disable_job_creation=True)


class WandB:
    """An offline W&B run under ``folder``/wandb (see the module's note)."""

    def __init__(self, folder: Path, name: str, config: dict[str, Any]):
        os.environ["WANDB_MODE"] = "offline"  # for anything that reads W&B's settings anew
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        known = getattr(wandb.Settings, "model_fields", QUIET)  # a later wandb may rename one
        self._wandb = wandb
        wandb.setup(settings=wandb.Settings(silent=True))
        folder.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(mode="offline", dir=str(folder), project=PROJECT, name=name,
                                  group=name, config=config, settings=wandb.Settings(
                                      **{k: v for k, v in QUIET.items() if k in known}))
        except BaseException:
            wandb.teardown()
            raise
        self._defined: set[str] = set()

    def log(self, items: list[Scalar]) -> None:
        rows: dict[tuple[str, int], dict[str, float]] = {}
        for tag, value, step, _ in items:
            axis = step_axis(tag)
            if tag not in self._defined:
                if axis not in self._defined:
                    self.run.define_metric(axis, hidden=True)
                    self._defined.add(axis)
                self.run.define_metric(tag, step_metric=axis)
                self._defined.add(tag)
            rows.setdefault((axis, step), {axis: step})[tag] = value
        for row in rows.values():
            self.run.log(row)

    def close(self, failed: bool = False) -> None:
        try:
            self.run.finish(exit_code=1 if failed else 0)
        finally:
            self._wandb.teardown()  # ends the wandb-core service process


def open_sinks(metrics: MetricsConfig, run_dir: Path, record: DictConfig) -> list[Sink]:
    """The trackers ``metrics`` asks for, opened for the run in ``run_dir``; MLflow and W&B log
    ``record``, the run's config, as the run's parameters. If one cannot be opened, those
    opened before it are closed and the error raised."""
    wanted: list[tuple[bool, Any]] = [
        (metrics.tensorboard, lambda: TensorBoard(run_dir / "tb")),
        (metrics.mlflow, lambda: MLflow(run_dir / "mlruns", run_dir.name, config())),
        (wandb_on(metrics.wandb), lambda: WandB(run_dir, run_dir.name, config())),
    ]

    def config() -> dict[str, Any]:
        return OmegaConf.to_container(record, resolve=True)  # type: ignore[return-value]

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
    error: BaseException | None = None
    for sink in sinks:
        try:
            sink.close(failed)
        except BaseException as e:  # the others are closed first
            error = error or e
    if error is not None:
        raise error
