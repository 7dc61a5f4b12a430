"""The subcommands of ``sdpipe`` (all but ``train -m``, see :mod:`sdpipe_cli.cli.sweeping`), each
thin: compose the config from the overrides, place it by the job scheduler's environment and
validate it (bad input: one line, nothing started), prepare the run config for this machine, then
hand it to the run loop (``train``, ``resume``), the launcher (``profile``), the simulator
(``simulate``), and show the outcome with :mod:`~sdpipe_cli.cli.display`. ``report`` and
``prepare text`` compose no config: they check their own arguments and call the plotting
(:mod:`~sdpipe_cli.cli.report`) or the tokenizer (:mod:`sdpipe_cli.data.prepare`).

Kept apart from argument parsing (:mod:`~sdpipe_cli.cli.parsing` calls these) so that a command
can be called with its arguments alone (tests, a sweep's job), and apart from the run loop
(:mod:`~sdpipe_cli.cli.run_loop`) that ``train``, ``resume`` and a sweep's jobs share.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from omegaconf import OmegaConf
from rich.console import Console

from sdpipe_cli.cli import display, resuming, run_loop
from sdpipe_cli.config import job_env
from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.config.validation import validate
from sdpipe_cli.runtime import network, run_lock
from sdpipe_cli.runtime.errors import DataError


def train(overrides: Sequence[str], show_config: bool = False, console: Console | None = None) -> int:
    console = console or display.stderr_console()
    cfg = composed(overrides, show_config)
    if cfg is None:
        return 0
    return run_loop.run_with_restarts(run_config(cfg, console), console)


def resume(path: str, overrides: Sequence[str], console: Console, trusted: bool = False) -> int:
    with run_lock.Holder(lambda line: console.print(line, markup=False, highlight=False,
                                                     soft_wrap=True)) as holder:
        leg = resuming.prepare(path, overrides, console, holder, trusted=trusted)
        return run_loop.run_with_restarts(leg.cfg, console, from_checkpoint=leg.checkpoint,
                                          elapsed=leg.elapsed, done=leg.done, fresh=leg.fresh)


def profile(overrides: Sequence[str], show_config: bool = False,
            console: Console | None = None) -> int:
    from sdpipe_cli.cli import launcher
    from sdpipe_cli.config import measurements as document

    console = console or display.stderr_console()
    run_cfg = _composed_run_config(overrides, show_config, console)
    if run_cfg is None:
        return 0
    phases = display.ProfilePhases(console)
    result = launcher.launch(run_cfg, on_progress=phases.update, job=launcher.PROFILE,
                             on_folder=lambda d: console.print(f"run folder: {d}", highlight=False))
    # profile's report is the last thing sdpipe does: nothing to put back
    run_loop.while_reporting(result)
    display.run_folder(console, result)
    if result.failure:
        console.print(f"sdpipe: error: {result.failure}", markup=False, highlight=False,
                      soft_wrap=True)
        return result.returncode
    try:
        doc = document.load(cast(Path, result.run_dir) / "profile.json")  # no failure: it was made
    except document.ProfileError as bad:  # every worker ended well, so this is a bug: say so
        console.print(f"sdpipe: error: the profile was not written: {bad}", markup=False,
                      highlight=False, soft_wrap=True)
        return run_loop.EXIT_FAILED
    display.profile_tables(console, doc, result.wall_s)
    console.print(f"profile: {doc['_path']}", highlight=False, soft_wrap=True)
    console.print(f"use it: sdpipe train pipeline.partition=auto profile={doc['_path']}",
                  highlight=False, soft_wrap=True)
    return 0


def simulate(overrides: Sequence[str], compare: str, show_config: bool = False,
             console: Console | None = None) -> int:
    from sdpipe_cli.cli import launcher
    from sdpipe_cli.hetero import simulated_run

    console = console or display.stderr_console()
    run_cfg = _composed_run_config(overrides, show_config, console)
    if run_cfg is None:
        return 0
    modes = [m for m in compare.split(",") if m]
    doc = simulated_run.run(run_cfg, modes)  # bad input raises before the run folder exists
    path = simulated_run.write(doc, launcher.make_run_dir(run_cfg.run.dir))
    display.simulation_table(doc, run_cfg.train.steps)
    console.print(f"simulation: {path}", highlight=False)
    return 0


def report(paths: Sequence[str], out: str | None, console: Console) -> int:
    from sdpipe_cli.cli import report as figures

    runs = figures.load_all(paths)  # bad input: one line before anything is written
    try:
        import matplotlib  # noqa: F401 - an optional extra
    except ImportError:
        raise ConfigError("report", "needs matplotlib: pip install matplotlib (or, in a "
                          "checkout, pip install -e '.[report]')") from None
    for path in figures.report(runs, figures.default_out(runs, out)):
        print(path)
    return 0


def prepare_text(args: argparse.Namespace, console: Console) -> int:
    """``sdpipe prepare text``: see :mod:`sdpipe_cli.data.prepare`.

    While it runs, Ctrl-C or SIGTERM removes what was being written (the temporary folder beside
    ``--out``) and ends the process at once with one line and exit 130, like an interrupt before
    any command starts (:mod:`~sdpipe_cli.cli.interrupts`). The tokenizer calls that cannot be
    interrupted run off the main thread, so this takes well under a second.
    """
    import signal

    from sdpipe_cli.cli.interrupts import EXIT_INTERRUPTED
    from sdpipe_cli.data import prepare as preparing  # imports torch: under parsing's handler

    if not 0.0 < args.val_fraction < 1.0:
        raise DataError("--val-fraction", f"must be between 0 and 1 (exclusive), got {args.val_fraction}")
    if args.shard_tokens < 1:
        raise DataError("--shard-tokens", f"must be at least 1, got {args.shard_tokens}")
    if args.max_bytes is not None and args.max_bytes < 1:
        raise DataError("--max-bytes", f"must be at least 1, got {args.max_bytes}")

    def interrupted(signum, frame) -> None:
        complete = preparing.abandon()
        what = (f"{args.out} was already complete" if complete
                else f"removed its temporary folder; nothing was written to {args.out}")
        os.write(2, f"sdpipe: error: prepare interrupted ({signal.Signals(signum).name}); "
                 f"{what}\n".encode())  # not the console: the interrupted code may hold its lock
        os._exit(EXIT_INTERRUPTED)

    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        manifest = preparing.prepare_text(
            args.sources, args.out, args.tokenizer, text_key=args.text_key,
            val_fraction=args.val_fraction, shard_tokens=args.shard_tokens, dtype=args.dtype,
            max_bytes=args.max_bytes, dataset_format=args.dataset,
            log=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    tokens = {split: sum(s["tokens"] for s in shards) for split, shards in manifest["splits"].items()}
    console.print(f"wrote {args.out}: {tokens['train']:,} training and {tokens['val']:,} validation "
                  f"tokens, vocabulary {manifest['tokenizer']['vocab_size']:,}; train with "
                  f"data=tokens data.path={args.out}", markup=False, highlight=False, soft_wrap=True)
    return 0


def composed(overrides: Sequence[str], show_config: bool):
    """The validated config, or None once ``--cfg`` printed it."""
    cfg = validated(compose(list(overrides)))
    if show_config:
        print(OmegaConf.to_yaml(cfg), end="")
        return None
    network.check_hosts(cfg)  # before the heavy imports: a mistyped host fails at once
    return cfg


def validated(cfg):
    """``cfg`` placed by the job scheduler's environment (if any) and validated."""
    _place_by_job(cfg)
    validate(cfg)
    return cfg


def _place_by_job(cfg) -> None:
    """Under srun or torchrun, fill in this node's ``run.node``, the job's ``run.port`` and the
    hosts of nodes named by hostname, where the user left them unset; says so in one line."""
    job = job_env.detect(os.environ)
    placed = job_env.infer(list(cfg.cluster.nodes), cfg.run.node, cfg.run.port, job)
    for key, value in placed.items():
        OmegaConf.update(cfg, key, value, merge=False)
    if placed:
        shown = " ".join(f"{k}={v}" for k, v in placed.items() if k.startswith("run."))
        job = cast(job_env.JobEnvironment, job)  # placed: infer() places nothing outside a job
        print(f"sdpipe: {job.describe()} of the job: {shown or 'hosts from the node names'}",
              file=sys.stderr, flush=True)


def run_config(cfg, console: Console):
    """The run config for this machine; shows the automatic partition's plan and the meetings
    chosen from slow links, if there are."""
    from sdpipe_cli.cli import preparing  # imports torch: after the checks of composed()

    run_cfg, plan, choice = preparing.prepare(cfg)
    if plan is not None:
        display.plan_table(console, plan)
    if choice is not None:
        console.print(f"slow links: {choice.describe()}", highlight=False, soft_wrap=True)
    if run_cfg.pipeline.balance != "equal":
        from sdpipe_cli.core.plan import RunPlan

        shares = list(RunPlan.of(run_cfg).microbatches)
        console.print(f"pipeline.balance={run_cfg.pipeline.balance}: micro-batches per pipeline "
                      f"{shares}" + ("" if len(set(shares)) > 1 else
                                     " (no smaller share keeps the others' pace at these speeds)"),
                      highlight=False, soft_wrap=True)
    from sdpipe_cli.sync.wire_probe import unresolved

    if unresolved(run_cfg.sync):
        console.print("links: a stage's replicas span nodes and cluster.links describes none: "
                      "the run measures them before its first meeting and chooses sync.every "
                      "and sync.precision from that (set them to pin them)", highlight=False,
                      soft_wrap=True)
    return run_cfg


def _composed_run_config(overrides: Sequence[str], show_config: bool, console: Console):
    """The prepared run config of a command's overrides, or None once ``--cfg`` printed it."""
    cfg = composed(overrides, show_config)
    return None if cfg is None else run_config(cfg, console)
