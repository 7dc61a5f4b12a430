"""``sdpipe train -m``: a sweep, one training run per combination of swept overrides, then one
table comparing them.

Its own module because a sweep is a different flow from the other commands: every combination is
validated before anything runs, then Hydra's multirun (:func:`sdpipe_cli.config.sweep.multirun`)
calls :func:`_sweep_job` once per combination, and each job runs one training exactly as
``sdpipe train`` does (:mod:`~sdpipe_cli.cli.commands` to compose and prepare,
:mod:`~sdpipe_cli.cli.run_loop` to run). Named ``sweeping`` beside ``config/sweep.py``, which it
imports as ``sweep``: the combinations and the hand-over to Hydra are config work.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from sdpipe_cli.cli import commands, display, run_loop
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.runtime import network


def sweep_train(overrides: Sequence[str], console: Console) -> int:
    """``sdpipe train -m``: every combination validated first, then Hydra's multirun runs one
    job per combination (its basic launcher: one after another in this process; or the launcher
    the overrides pick, e.g. ``hydra/launcher=submitit_slurm``) into one sweep folder
    (``run.dir``, or ``runs/sweep-<timestamp>``), then one comparison table (also
    ``<sweep>/sweep.json``). A failed run is reported and the sweep goes on; Ctrl-C ends it."""
    import json
    from datetime import datetime
    from pathlib import Path

    from sdpipe_cli.cli import launcher
    from sdpipe_cli.config import sweep

    ours = [o for o in overrides if not sweep.for_hydra(o)]
    search = [o for o in overrides if o.startswith("hydra.searchpath=")]  # --config-dir
    combos = sweep.expand(ours)
    first = commands.composed([*search, *combos[0].overrides], False)
    folder = first.run.dir or f"runs/sweep-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    for combo in combos:  # bad input stops the sweep before anything is written
        commands.composed([*search, *combo.overrides, f"run.dir={Path(folder) / combo.name}"], False)
    root = launcher.make_run_dir(folder).resolve()
    console.print(f"sweep: {len(combos)} runs in {root}", markup=False, highlight=False)
    interrupted = sweep.multirun(_sweep_job, [o for o in overrides if not o.startswith("run.dir=")],
                                 root, combos)
    rows = []
    for combo in combos:  # Hydra named each job's folder <k>-<what varies>
        run_dir = next(root.glob(f"{combo.index}-*"), root / combo.name)
        status = ("done" if (run_dir / "summary.json").exists() and not _failed(run_dir) else
                  "not run" if not (run_dir / "config.yaml").exists() else "failed")
        rows.append({"run": run_dir.name, "overrides": list(combo.varied), "status": status,
                     **_outcome(run_dir)})
    if interrupted:  # the last run that started is the one Ctrl-C stopped
        started = [row for row in rows if row["status"] != "not run"]
        if started:
            started[-1]["status"] = "interrupted"
    (root / "sweep.json").write_text(json.dumps({"runs": rows}, indent=1))
    table = Table(title=f"sweep {root}")
    for column in ("run", "status", "loss", "val_loss", "best loss after (s)", "samples/s"):
        table.add_column(column, justify="left" if column in ("run", "status") else "right")
    for row in rows:
        table.add_row(row["run"], row["status"], _num(row.get("loss")), _num(row.get("val_loss")),
                      _num(row.get("best_loss_s"), 1), _num(row.get("samples_per_s"), 1))
    console.print(table)
    if interrupted:
        return run_loop.EXIT_INTERRUPTED
    return 0 if all(row["status"] == "done" for row in rows) else run_loop.EXIT_FAILED


def _sweep_job(cfg) -> int:
    """One job of a sweep, as Hydra's launcher calls it (in this process, or in one the launcher
    started, on this machine or another): the run in the job's folder, as ``sdpipe train``
    would run it."""
    from hydra.core.hydra_config import HydraConfig

    console = display.stderr_console()
    cfg.run.dir = HydraConfig.get().runtime.output_dir
    # --config-dir came as hydra.searchpath: the run folder keeps a copy, as for sdpipe train
    cfg.run.config_dirs = [d.removeprefix("file://") for d in HydraConfig.get().searchpath
                           if str(d).startswith("file://")]
    commands.validated(cfg)
    network.check_hosts(cfg)
    rc = run_loop.run_with_restarts(commands.run_config(cfg, console), console)
    if rc == run_loop.EXIT_INTERRUPTED:
        raise KeyboardInterrupt  # ends the sweep: the next jobs are not started
    return rc


def _failed(run_dir) -> bool:
    """Whether a run's ``summary.json`` is a failed run's (the launcher's, with ``failure``)."""
    import json

    try:
        return "failure" in json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return True


def _outcome(run_dir) -> dict:
    """A sweep run's figures for the table, as every table of runs defines them
    (:func:`~sdpipe_cli.analysis.outcome`): final loss and val_loss, samples/s, and how
    many seconds of training the mean training loss took to reach its lowest (whatever a failed
    run got to; nothing for one that never wrote a metrics line)."""
    from sdpipe_cli import analysis

    try:
        return analysis.outcome(analysis.read_metrics(run_dir))
    except ConfigError:
        return {}


def _num(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
