"""The ``sdpipe`` command line: parse, compose the config once, hand it to the launcher, show progress.

Usage::

    sdpipe train                                  # defaults: gpt_tiny on the stdlib corpus, P=2, S=2
    sdpipe train model=mlp train.steps=50         # Hydra overrides: key=value, group=option
    sdpipe train cluster.pipelines=4 pipeline=deep sync=none
    sdpipe train --cfg                            # print the composed config and exit
    sdpipe train --help                           # config groups and their options
    sdpipe train checkpoint.every=100             # checkpoints in <run>/checkpoints/step_<N>/
    sdpipe resume runs/20261129-120000 train.steps=800   # go on from the latest checkpoint
    sdpipe profile cluster.device=cpu             # measure blocks, memory, links -> profile.json
    sdpipe train pipeline.partition=auto profile=runs/20261129-130000/profile.json
    sdpipe simulate cluster.pipelines=1024 pipeline.stages=1 cluster.compute_ms=10 \
        'cluster.slowdown=[...]' --compare allreduce,none   # the policy at any scale, no processes

Exit codes: 0 done, 1 a process failed (named on stderr), 2 bad input (one line, nothing
started), 130 interrupted. rich lives here and only here: workers and the scheduler log plain text.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import OmegaConf
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from sdpipe_cli import __version__

from sdpipe_cli.runtime import network
from sdpipe_cli.cli import resuming
from sdpipe_cli.cli.interrupts import exit_on_interrupt
from sdpipe_cli.config import job_env
from sdpipe_cli.core.errors import BadInput
from sdpipe_cli.config.schema import ConfigError, compose, group_options, validate
from sdpipe_cli.runtime.errors import CheckpointError, DataError

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130

TRAIN_HELP = """Train a model pipeline-parallel on P pipelines of S stages.

Overrides use Hydra's grammar: key=value (train.steps=50), group=option (model=mlp),
+key=value to add; -m with comma-separated values runs a sweep. Every key, its type, default and
meaning: docs/CONFIG.md; the composed config: `sdpipe train --cfg`. Your own config files:
--config-dir DIR (docs/CLUSTERS.md, "Describe your cluster")."""


PROFILE_HELP = """Measure the cluster a training run would use, with the same overrides: per
device, each model block's forward and backward time at the micro-batch size and the peak memory;
per pair of pipeline neighbours, p2p latency and bandwidth; per stage, the all-reduce time of its
weights for group sizes 2..P. Emulated speeds and links (cluster.nodes, cluster.links) are in the
numbers. Writes <run>/profile.json (schema: sdpipe_cli/config/measurements.py) for
`sdpipe train pipeline.partition=auto profile=PATH`."""


SIMULATE_HELP = """Simulate a training run's timing without starting any process: the real group
policy of sync=sdpipe (the scheduler's own classes) driven by modelled workers (compute_ms or the
profile's block times, slow-downs, stragglers, speed changes, links; the simulate.* costs). Reports
samples/s against the limit (each pipeline's solo rate, summed) for the config's sync mode and each
mode in --compare, and writes <run>/simulation.json. See docs/SIMULATOR.md."""


REPORT_HELP = """Plot one or more runs, overlaid and labelled by the settings in which they differ:
loss against time and samples, samples/s per pipeline, sdpipe's group sizes per stage (over time
and as a histogram), the distribution of waits and all-reduce times, and the consensus distance.
Reads only config.yaml and metrics.jsonl, so a run still going, failed or interrupted works too.
Needs matplotlib: pip install matplotlib."""


RESUME_HELP = """Continue a run from its latest complete checkpoint (or a given one), with the saved
config, in the same run folder; metrics are appended. Only settings that the saved state does not
depend on may change (KEY=VALUE)."""

PREPARE_HELP = """Tokenize text into memory-mapped shards for data=tokens data.path=DIR: text files,
JSON lines (--text-key), parquet, folders of them, or `stdlib` (the Python standard library's
sources). The tokenizer is bytes, a BPE or WordPiece vocabulary trained here (bpe:VOCAB,
wordpiece:VOCAB, Hugging Face tokenizers), or an existing tokenizer.json. DIR gets the shards, the
tokenizer and manifest.json (token counts and a SHA-256 per shard); it must not exist yet."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdpipe", description="Semi-decentralized pipeline-parallel training for "
        "heterogeneous clusters.")
    parser.add_argument("--version", action="version", version=f"sdpipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups = "\n".join(f"  {g:<10} {', '.join(opts)}" for g, opts in group_options().items())
    for name, summary, text in (
            ("train", "train a model", TRAIN_HELP),
            ("profile", "measure the cluster: block times, memory, links", PROFILE_HELP)):
        command = sub.add_parser(name, help=summary, description=text,
                                 epilog=f"config groups (group=option):\n{groups}",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        command.add_argument("--cfg", action="store_true", help="print the composed config and exit")
        _config_dir_option(command)
        if name == "train":
            command.add_argument("-m", "--multirun", action="store_true",
                                 help="a sweep: one run per combination of swept values "
                                 "(sync=allreduce,sdpipe train.lr=1e-3,3e-3), then a comparison")
        command.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra overrides")
    sim = sub.add_parser("simulate", help="simulate a run's timing under sync policies",
                         description=SIMULATE_HELP,
                         epilog=f"config groups (group=option):\n{groups}",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    sim.add_argument("--compare", default="allreduce,none", metavar="MODES",
                     help="comma-separated sync modes to simulate too (default: allreduce,none)")
    sim.add_argument("--cfg", action="store_true", help="print the composed config and exit")
    _config_dir_option(sim)
    sim.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra overrides")
    resume = sub.add_parser(
        "resume", help="continue a run from a checkpoint", description=RESUME_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    resume.add_argument("path", metavar="PATH", help="a run folder (its latest complete "
                        "checkpoint) or one checkpoint folder")
    resume.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help=f"safe changes only: {', '.join(resuming.RESUMABLE)}; the layout: "
                        f"{', '.join(resuming.LAYOUT)} (the checkpoint is resharded)")
    prep = sub.add_parser("prepare", help="tokenize text into shards for data=tokens",
                          description=PREPARE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = prep.add_subparsers(dest="kind", metavar="KIND", required=True)
    text = kinds.add_parser("text", help="text, JSON lines or parquet -> token shards",
                            description=PREPARE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    text.add_argument("sources", nargs="+", metavar="SRC", help="files, folders, or stdlib")
    text.add_argument("--out", required=True, metavar="DIR", help="the new folder of shards")
    text.add_argument("--tokenizer", default="bytes", metavar="SPEC",
                      help="bytes | bpe:VOCAB | wordpiece:VOCAB | PATH/tokenizer.json (default: bytes)")
    text.add_argument("--text-key", default="text", metavar="KEY",
                      help="the text field of JSON lines and parquet rows (default: text)")
    text.add_argument("--val-fraction", type=float, default=0.01, metavar="F",
                      help="the tail of the token stream held out for validation (default: 0.01)")
    text.add_argument("--shard-tokens", type=int, default=2**27, metavar="N",
                      help="tokens per shard file at most (default: 2**27)")
    text.add_argument("--dtype", choices=("uint16", "uint32"),
                      help="token type on disk (default: the smallest that holds the vocabulary)")
    text.add_argument("--max-bytes", type=int, metavar="N", help="read at most N bytes of text")
    text.add_argument("--dataset", metavar="FORMAT", help="read SRC with datasets.load_dataset(FORMAT, "
                      "data_files=SRC) (needs: pip install datasets)")
    rep = sub.add_parser("report", help="plot runs: loss, throughput, groups, waits",
                         description=REPORT_HELP,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    rep.add_argument("runs", nargs="+", metavar="RUN", help="run folders (running, failed or done)")
    rep.add_argument("--out", metavar="DIR", help="where the PNGs go (default: RUN/report)")
    return parser


def _console() -> Console:
    """Where sdpipe writes: stderr. Off a terminal (a log file, a CI job, a pipe) rich would
    assume 80 columns and cut table cells mid-word; there the width is ``COLUMNS``, else 160."""
    if sys.stderr.isatty():
        return Console(stderr=True)
    return Console(stderr=True, width=int(os.environ.get("COLUMNS", "0") or 0) or 160)


def _config_dir_option(command: argparse.ArgumentParser) -> None:
    command.add_argument("-cd", "--config-dir", action="append", default=[], metavar="DIR",
                         help="a folder of your own config files, searched before sdpipe's: "
                         "DIR/cluster/mine.yaml is cluster=mine (repeatable; docs/CLUSTERS.md)")


def _searchpath(dirs: Sequence[str]) -> list[str]:
    """``--config-dir`` as the Hydra override that adds the folders to the config search path
    (so sweeps, ``--cfg`` and every command composing the config see them). A folder that is not
    there is bad input."""
    if not dirs:
        return []
    paths = []
    for d in dirs:
        path = Path(d).expanduser().resolve()
        if not path.is_dir():
            raise ConfigError("--config-dir", f"{d} is not a folder")
        paths.append(f"file://{path}")
    return [f"hydra.searchpath=[{','.join(paths)}]"]


def _hydra_cfg(argv: Optional[Sequence[str]]) -> list[str]:
    """``--cfg job`` and ``--cfg all`` (Hydra's spellings) mean ``--cfg``: sdpipe prints the one
    config a run reads."""
    args = list(sys.argv[1:] if argv is None else argv)
    out: list[str] = []
    for arg in args:
        if arg in ("job", "all") and out and out[-1] == "--cfg":
            continue
        out.append("--cfg" if arg in ("--cfg=job", "--cfg=all") else arg)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    # overrides may come after an option (`simulate --compare allreduce train.steps=50`): argparse
    # leaves those out of the positional list, so they are taken back here, in order
    args, extra = parser.parse_known_args(_hydra_cfg(argv))
    stray = [a for a in extra if a.startswith("-") or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.command is None:
        _parser().print_help()
        return EXIT_USAGE
    err = _console()
    # Until a launch starts processes, an interrupt ends sdpipe at once (imports of C extensions
    # must not be interrupted by an exception); the launch then handles its own interrupts.
    previous = exit_on_interrupt("preparing the run")
    try:
        if getattr(args, "config_dir", None):
            args.overrides = [*_searchpath(args.config_dir), *args.overrides]
        if args.command == "train" and args.multirun:
            return sweep_train(args.overrides, console=err)
        if args.command == "train":
            return train(args.overrides, show_config=args.cfg, console=err)
        if args.command == "resume":
            return resume(args.path, args.overrides, console=err)
        if args.command == "profile":
            return profile(args.overrides, show_config=args.cfg, console=err)
        if args.command == "simulate":
            return simulate(args.overrides, args.compare, show_config=args.cfg, console=err)
        if args.command == "report":
            return report(args.runs, args.out, console=err)
        if args.command == "prepare":
            return prepare_text(args, console=err)
    except BadInput as bad:
        err.print(f"sdpipe: error: {bad}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_USAGE
    except _Ended as ended:
        result = ended.result
        outcome = "ended" if result.returncode == 0 else f"failed (exit {result.returncode})"
        err.print(f"sdpipe: interrupted after the run {outcome}; nothing is running, its folder is "
                  f"{result.run_dir}", markup=False, highlight=False, soft_wrap=True)
        return result.returncode
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return EXIT_USAGE


class _Ended(BaseException):
    """An interrupt after a launch returned: only what sdpipe prints about the run is cut short.
    Not an ``Exception``: a sweep's job runner (Hydra) must not take it for a failed job."""

    def __init__(self, result):
        super().__init__("interrupted after the run")
        self.result = result


def _reporting(result) -> dict:
    """From here on no process of the launch is left and the run's files are written: an
    interrupt only cuts the summary short, so sdpipe then exits with the run's own code (a
    finished run stays 0) instead of the "preparing" handler's 130. Returns the handlers it
    replaced, for the caller to put back once the report is printed (a sweep's next job, a
    restarted run's next leg, is preparing again)."""
    def handler(signum, frame) -> None:
        raise _Ended(result)

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def train(overrides: Sequence[str], show_config: bool = False, console: Console | None = None) -> int:
    console = console or _console()
    cfg = _composed(overrides, show_config)
    if cfg is None:
        return 0
    return _run(_prepared(cfg, console), console)


def prepare_text(args: argparse.Namespace, console: Console) -> int:
    """``sdpipe prepare text``: see :mod:`sdpipe_cli.data.prepare`."""
    from sdpipe_cli.data.prepare import prepare_text as prepare

    if not 0.0 < args.val_fraction < 1.0:
        raise DataError("--val-fraction", f"must be between 0 and 1 (exclusive), got {args.val_fraction}")
    if args.shard_tokens < 1:
        raise DataError("--shard-tokens", f"must be at least 1, got {args.shard_tokens}")
    if args.max_bytes is not None and args.max_bytes < 1:
        raise DataError("--max-bytes", f"must be at least 1, got {args.max_bytes}")
    manifest = prepare(args.sources, args.out, args.tokenizer, text_key=args.text_key,
                       val_fraction=args.val_fraction, shard_tokens=args.shard_tokens, dtype=args.dtype,
                       max_bytes=args.max_bytes, dataset_format=args.dataset,
                       log=lambda line: console.print(line, markup=False, highlight=False))
    tokens = {split: sum(s["tokens"] for s in shards) for split, shards in manifest["splits"].items()}
    console.print(f"wrote {args.out}: {tokens['train']:,} training and {tokens['val']:,} validation "
                  f"tokens, vocabulary {manifest['tokenizer']['vocab_size']:,}; train with "
                  f"data=tokens data.path={args.out}", markup=False, highlight=False, soft_wrap=True)
    return 0


def sweep_train(overrides: Sequence[str], console: Console) -> int:
    """``sdpipe train -m``: every combination validated first, then Hydra's multirun runs one
    job per combination (its basic launcher: one after another in this process; or the launcher
    the overrides pick, e.g. ``hydra/launcher=submitit_slurm``) into one sweep folder
    (``run.dir``, or ``runs/sweep-<timestamp>``), then one comparison table (also
    ``<sweep>/sweep.json``). A failed run is reported and the sweep goes on; Ctrl-C ends it."""
    import json
    from datetime import datetime
    from pathlib import Path

    from sdpipe_cli.cli import launcher, report as figures
    from sdpipe_cli.config import sweep

    ours = [o for o in overrides if not sweep.for_hydra(o)]
    search = [o for o in overrides if o.startswith("hydra.searchpath=")]  # --config-dir
    combos = sweep.expand(ours)
    first = _composed([*search, *combos[0].overrides], False)
    folder = first.run.dir or f"runs/sweep-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    for combo in combos:  # bad input stops the sweep before anything is written
        _composed([*search, *combo.overrides, f"run.dir={Path(folder) / combo.name}"], False)
    root = launcher.make_run_dir(folder).resolve()
    console.print(f"sweep: {len(combos)} runs in {root}", markup=False, highlight=False)
    interrupted = sweep.multirun(_sweep_job, [o for o in overrides if not o.startswith("run.dir=")],
                                 root, combos)
    rows = []
    for combo in combos:  # Hydra named each job's folder <k>-<what varies>
        run_dir = next(root.glob(f"{combo.index}-*"), root / combo.name)
        status = ("done" if (run_dir / "summary.json").exists() else
                  "not run" if not (run_dir / "config.yaml").exists() else "failed")
        rows.append({"run": run_dir.name, "overrides": list(combo.varied), "status": status,
                     **_outcome(figures, run_dir)})
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
        return EXIT_INTERRUPTED
    return 0 if all(row["status"] == "done" for row in rows) else EXIT_FAILED


def _sweep_job(cfg) -> int:
    """One job of a sweep, as Hydra's launcher calls it (in this process, or in one the launcher
    started, on this machine or another): the run in the job's folder, as ``sdpipe train``
    would run it."""
    from hydra.core.hydra_config import HydraConfig

    console = _console()
    cfg.run.dir = HydraConfig.get().runtime.output_dir
    # --config-dir came as hydra.searchpath: the run folder keeps a copy, as for sdpipe train
    cfg.run.config_dirs = [d.removeprefix("file://") for d in HydraConfig.get().searchpath
                           if str(d).startswith("file://")]
    _validated(cfg)
    network.check_hosts(cfg)
    rc = _run(_prepared(cfg, console), console)
    if rc == EXIT_INTERRUPTED:
        raise KeyboardInterrupt  # ends the sweep: the next jobs are not started
    return rc


def _outcome(figures, run_dir) -> dict:
    """A sweep run's figures for the table: final loss and val_loss, samples/s, and how many
    seconds of training the mean training loss took to reach its lowest (whatever a failed run
    got to)."""
    import json

    out: dict = {}
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        out.update(loss=summary.get("loss"), val_loss=summary.get("val_loss"),
                   samples_per_s=summary.get("samples_per_s"))
    except (OSError, ValueError):
        pass
    try:
        run = figures.load(run_dir)
    except ConfigError:
        return out
    times, _, loss = figures.mean_loss(run)
    if loss:
        # from the first iteration's start: a sweep's first run also started the fork server
        began = min(m["time"] - m.get("step_s", 0.0) for m in run.kind("train"))
        best = min(range(len(loss)), key=loss.__getitem__)
        out.update(best_loss=loss[best], best_loss_s=times[best] - began)
        out.setdefault("loss", loss[-1])
    return out


def _num(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _composed(overrides: Sequence[str], show_config: bool):
    """The validated config, or None once ``--cfg`` printed it."""
    cfg = _validated(compose(list(overrides)))
    if show_config:
        print(OmegaConf.to_yaml(cfg), end="")
        return None
    network.check_hosts(cfg)  # before the heavy imports: a mistyped host fails at once
    return cfg


def _validated(cfg):
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
        print(f"sdpipe: {job.describe()} of the job: {shown or 'hosts from the node names'}",
              file=sys.stderr, flush=True)


def _prepared(cfg, console: Console):
    """The run config for this machine; shows the automatic partition's plan if there is one."""
    from sdpipe_cli.cli import launcher

    run_cfg, plan = launcher.prepare(cfg)
    if plan is not None:
        _plan_table(console, plan)
    return run_cfg


def _run_config(overrides: Sequence[str], show_config: bool, console: Console):
    """The prepared run config of a command's overrides, or None once ``--cfg`` printed it."""
    cfg = _composed(overrides, show_config)
    return None if cfg is None else _prepared(cfg, console)


def resume(path: str, overrides: Sequence[str], console: Console) -> int:
    leg = resuming.prepare(path, overrides, console)
    return _run(leg.cfg, console, resume=leg.checkpoint, elapsed=leg.elapsed, done=leg.done)


def profile(overrides: Sequence[str], show_config: bool = False,
            console: Console | None = None) -> int:
    from sdpipe_cli.cli import launcher
    from sdpipe_cli.config import measurements as document

    console = console or _console()
    run_cfg = _run_config(overrides, show_config, console)
    if run_cfg is None:
        return 0
    phases = _Phases(console)
    result = launcher.launch(run_cfg, on_progress=phases.update, job=launcher.PROFILE,
                             on_folder=lambda d: console.print(f"run folder: {d}", highlight=False))
    _reporting(result)  # profile's report is the last thing sdpipe does: nothing to put back
    _run_folder(console, result)
    if result.failure:
        console.print(f"sdpipe: error: {result.failure}", markup=False, highlight=False,
                      soft_wrap=True)
        return result.returncode
    try:
        doc = document.load(result.run_dir / "profile.json")
    except document.ProfileError as bad:  # every worker ended well, so this is a bug: say so
        console.print(f"sdpipe: error: the profile was not written: {bad}", markup=False,
                      highlight=False, soft_wrap=True)
        return EXIT_FAILED
    _profile_tables(console, doc, result.wall_s)
    console.print(f"profile: {doc['_path']}", highlight=False, soft_wrap=True)
    console.print(f"use it: sdpipe train pipeline.partition=auto profile={doc['_path']}",
                  highlight=False, soft_wrap=True)
    return 0


def simulate(overrides: Sequence[str], compare: str, show_config: bool = False,
             console: Console | None = None) -> int:
    from sdpipe_cli.cli import launcher
    from sdpipe_cli.hetero import simulator

    console = console or _console()
    run_cfg = _run_config(overrides, show_config, console)
    if run_cfg is None:
        return 0
    modes = [m for m in compare.split(",") if m]
    doc = simulator.run(run_cfg, modes)  # bad input raises before the run folder exists
    path = simulator.write(doc, launcher.make_run_dir(run_cfg.run.dir))
    table = Table(title=f"simulated: P={doc['pipelines']}, S={doc['stages']}, "
                        f"{run_cfg.train.steps} steps; limit {doc['limit_samples_per_s']:.1f} "
                        f"samples/s (simulated in {doc['simulated_in_s']:.1f} s)")
    for name in ("sync", "samples/s", "of limit", "mean group", "wall (s)", "iterations",
                 "waiting"):
        table.add_column(name, justify="left" if name == "sync" else "right")
    for row in [doc, *doc["compare"]]:
        its, waits = row["iterations"], row["sync_wait_fraction"]
        table.add_row(row["sync"], f"{row['samples_per_s']:.1f}", f"{row['fraction_of_limit']:.2f}",
                      f"{row['mean_group_size']:.2f}", f"{row['wall_s']:.1f}",
                      f"{min(its)}-{max(its)}", f"{100 * sum(waits) / len(waits):.0f}%")
    Console().print(table)
    console.print(f"simulation: {path}", highlight=False)
    return 0


def report(paths: Sequence[str], out: Optional[str], console: Console) -> int:
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


def _run(run_cfg, console: Console, done: int = 0, resume=None, elapsed: float = 0.0) -> int:
    """Launch the run and show it: from ``resume`` (a verified checkpoint) at run-clock ``elapsed``
    seconds if given (``sdpipe resume``). With ``fault.on_failure=restart`` a failed launch is
    followed by another from the run's latest checkpoint while the budget lasts (:func:`_restart`)."""
    import time

    from sdpipe_cli.cli import launcher
    from sdpipe_cli.core.supervision import Restarts

    launcher.check_memory(run_cfg)  # bad input: before anything is written
    restarts = (Restarts(run_cfg.fault.max_restarts, run_cfg.fault.restart_backoff)
                if run_cfg.fault.on_failure == "restart" else None)
    began, origin = time.monotonic(), time.time() - elapsed  # origin: the run clock's zero
    run_dir = None  # the first launch makes the run folder (or resumes in its own)
    started_from = resume
    preparing: Optional[dict] = None  # the handlers before the first launch's report
    while True:
        display = _ProgressDisplay(console, run_cfg.cluster.pipelines * run_cfg.train.steps, done)
        with display:  # the launcher handles interrupts from here on
            result = launcher.launch(run_cfg, on_progress=display.update, run_dir=run_dir,
                                     resume=resume, elapsed=elapsed,
                                     on_folder=display.folder if run_dir is None else _nothing,
                                     on_phase=display.phase)
        replaced = _reporting(result)
        preparing = replaced if preparing is None else preparing
        if (restarts is None or result.returncode != EXIT_FAILED or result.interrupted
                or result.run_dir is None):
            break  # an interrupt is never restarted, nor a run stopped before its folder existed
        leg = _restart(console, result, restarts, origin, run_cfg, started_from)
        if leg is None:
            break
        run_dir, (resume, done) = result.run_dir, leg
        elapsed = time.time() - origin
    try:
        _run_folder(console, result)
        if result.failure:
            console.print(f"sdpipe: error: {result.failure}", markup=False, highlight=False,
                          soft_wrap=True)
            return result.returncode
        _summary(console, result, time.monotonic() - began, restarts.used if restarts else 0)
        return 0
    finally:  # reported: what comes next (a sweep's next job) is preparing again
        for sig, handler in (preparing or {}).items():
            signal.signal(sig, handler)


def _restart(console: Console, failed, restarts, origin: float, run_cfg, started_from):
    """What follows the ``failed`` launch of a run with ``fault.on_failure=restart``: (the
    checkpoint to resume from, or None to start again from scratch, and the iterations it holds),
    once the back-off has passed; None when the run ends instead, with ``failed`` saying why (the
    budget is used up, or an interrupt came during the back-off).

    The checkpoint is the run's newest complete one of this layout whose files check out (or the
    one the run was resumed from); without one the run starts again in its folder. Says so on
    stderr and in ``metrics.jsonl`` (a ``restart`` line, with the iterations each pipeline will
    do again: the last it reached minus the checkpoint's).
    """
    import time

    from sdpipe_cli.cli import launcher
    from sdpipe_cli.model import checkpoint
    from sdpipe_cli.runtime.metrics import MetricsLog

    wait = restarts.take("run", time.monotonic())
    if wait is None:
        failed.failure += f" (restarts used up: fault.max_restarts={restarts.limit})"
        return None
    ckpt, manifest = None, {"steps": {}}
    for candidate in resuming.restart_points(failed.run_dir, run_cfg, started_from):
        try:
            manifest = checkpoint.verify(candidate)
        except CheckpointError:
            continue
        ckpt = candidate
        break
    steps = manifest["steps"]
    reached = {str(p): s["steps"] for p, s in failed.progress.get("pipelines", {}).items()}
    redone = {p: max(0, k - int(steps.get(p, 0))) for p, k in sorted(reached.items())}
    where = (f"{ckpt.relative_to(failed.run_dir)}" if ckpt is not None
             else "the start (no checkpoint yet)")
    console.print(f"sdpipe: warning: {failed.failure}; restarting from {where} (restart "
                  f"{restarts.used} of {restarts.limit}, in {wait:.1f} s)", markup=False,
                  highlight=False, soft_wrap=True)
    log = MetricsLog(failed.run_dir / "metrics.jsonl")
    try:
        log.write({"kind": "restart", "restart": restarts.used,
                   "time": round(time.time() - origin, 4), "reason": failed.failure,
                   "from_checkpoint": None if ckpt is None else manifest["step"],
                   "redone": redone, "backoff_s": wait})
    finally:
        log.close()
    phase = launcher.Phase("waiting to restart")  # counts Ctrl-C and SIGTERM while nothing runs
    previous = phase.install()
    try:
        deadline = time.monotonic() + wait
        while not phase.signals and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    finally:
        phase.restore(previous)
    if phase.signals:
        failed.returncode = EXIT_INTERRUPTED
        failed.failure = "interrupted while waiting to restart; no process of the run was running"
        return None
    return ckpt, sum(int(k) for k in steps.values())


def _nothing(*_) -> None:
    pass


def _run_folder(console: Console, result) -> None:
    if result.run_dir is not None:  # None: stopped before the folder was made
        console.print(f"run folder: {result.run_dir}", highlight=False)
    if result.trace is not None:
        console.print(f"trace: {result.trace} (open in ui.perfetto.dev or chrome://tracing)",
                      markup=False, highlight=False, soft_wrap=True)


class _ProgressDisplay:
    """A live bar on a terminal; a plain line every 10% elsewhere (CI logs, pipes)."""

    def __init__(self, console: Console, total: int, done: int = 0):
        self.console, self.total = console, total
        self.live = console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]{task.fields[status]}"), BarColumn(),
            TextColumn("{task.completed}/{task.total} it"),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False)
        self.task = self.progress.add_task("train", total=total, completed=done, loss="-",
                                           rate="-", status="starting")
        self.next_report = 0.1

    def __enter__(self):
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.progress.stop()

    def folder(self, run_dir: Path) -> None:
        """Said as soon as the run folder exists: where the logs are while the run goes on."""
        self.console.print(f"run folder: {run_dir} (logs: {run_dir / 'logs'})", highlight=False)

    def phase(self, what: str) -> None:
        """A step of the start-up, shown where the bar's label is until training reports."""
        self.progress.update(self.task, status=what)

    def update(self, snap: dict) -> None:
        if snap.get("iterations"):
            self.progress.update(self.task, status="train")
        loss = "-" if snap.get("loss") is None else f"{snap['loss']:.3f}"
        rate = f"{snap.get('samples_per_s', 0.0):.0f}"
        done = min(snap.get("iterations", 0), self.total)
        self.progress.update(self.task, completed=done, loss=loss, rate=rate)
        if not self.live and done >= self.next_report * self.total:
            self.console.print(f"train {done}/{self.total} it  loss {loss}  {rate} samples/s",
                               highlight=False)
            while self.next_report * self.total <= done:
                self.next_report += 0.1


class _Phases:
    """One line per profiling phase as rank 0 reaches it (the phases take turns, see profiling)."""

    NAMES = {"blocks": "block forward/backward times", "p2p": "p2p latency and bandwidth",
             "allreduce": "all-reduce of stage weights"}

    def __init__(self, console: Console):
        self.console, self.phase = console, None

    def update(self, snap: dict) -> None:
        phase = snap.get("phase")
        if phase in self.NAMES and phase != self.phase:
            self.phase = phase
            self.console.print(f"profile: {self.NAMES[phase]} (turn {snap['turn']}/"
                               f"{snap['turns']})", highlight=False)


def _profile_tables(console: Console, doc: dict, wall_s: float) -> None:
    """profile.json as tables: devices, blocks, p2p, all-reduce."""
    m, c, devices = doc["model"], doc["cluster"], doc["devices"]
    table = Table(title=f"sdpipe profile: {m['name']}, micro-batch {m['microbatch_size']} x "
                  f"{m['seq_len']} tokens, P={c['pipelines']} S={c['stages']} on {c['device']} "
                  f"({wall_s:.1f} s)")
    for col in ("device", "node", "speed", "pipeline", "stage", "rank", "forward ms",
                "backward ms", "peak MB"):
        table.add_column(col, justify="left" if col in ("device", "node") else "right")
    for d in devices:
        table.add_row(d["name"], d["node"], f"{d['speed']:g}", str(d["pipeline"]), str(d["stage"]),
                      str(d["rank"]), _ms(sum(d["forward_ms"])), _ms(sum(d["backward_ms"])),
                      f"{d['peak_memory_mb']:.0f}")
    console.print(table)
    console.print(f"(all blocks at one micro-batch; peak memory: "
                  f"{', '.join(sorted({d['memory_source'] for d in devices}))})", highlight=False)

    shown = devices
    if len(devices) > 4:  # the first device and the slowest keep the table readable
        slowest = max(devices, key=lambda d: sum(d["forward_ms"]) + sum(d["backward_ms"]))
        shown = [devices[0]] + ([slowest] if slowest is not devices[0] else [])
    table = Table(title="per block: forward/backward ms")
    table.add_column("block")
    table.add_column("params", justify="right")
    for d in shown:
        table.add_column(d["name"], justify="right")
    for b in range(m["blocks"]):
        table.add_row(m["block_names"][b], f"{m['block_params'][b]:,}",
                      *(f"{_ms(d['forward_ms'][b])}/{_ms(d['backward_ms'][b])}" for d in shown))
    console.print(table)
    if len(shown) < len(devices):
        console.print(f"(the first and the slowest of {len(devices)} devices; all of them in "
                      "profile.json)", highlight=False)

    if doc["p2p"]:
        table = Table(title=f"p2p between pipeline neighbours (bandwidth message "
                      f"{doc['p2p'][0]['bytes'] / 2**20:g} MiB)")
        for col in ("pair", "ranks", "link", "emulated", "latency ms", "bandwidth Gbit/s"):
            table.add_column(col, justify="right" if col.endswith(("ms", "Gbit/s")) else "left")
        for e in doc["p2p"]:
            link = c["links"][e["link"]]  # what cluster.links emulated on this link class
            emulated = [f"{link['latency_ms']:g} ms"] if link["latency_ms"] else []
            if link["bandwidth_gbps"] is not None:
                emulated.append(f"{link['bandwidth_gbps']:g} Gbit/s")
            bw = "-" if e["bandwidth_gbps"] is None else f"{e['bandwidth_gbps']:.2f}"
            table.add_row(f"{e['src']} -> {e['dst']}", f"{e['src_rank']} -> {e['dst_rank']}",
                          e["link"], ", ".join(emulated) or "-", _ms(e["latency_ms"]), bw)
        console.print(table)
    if doc["allreduce"]:
        table = Table(title="all-reduce of a stage's weights (float32)")
        for col in ("stage", "group size", "ranks", "MiB", "ms"):
            table.add_column(col, justify="right")
        for e in doc["allreduce"]:
            table.add_row(str(e["stage"]), str(e["group_size"]), " ".join(map(str, e["ranks"])),
                          f"{e['bytes'] / 2**20:.2f}", _ms(e["ms"]))
        console.print(table)


def _ms(x: float) -> str:
    """Milliseconds to about three significant digits: 0.0762, 1.20, 12.3, 123."""
    digits = 0 if x >= 100 else 1 if x >= 10 else 2 if x >= 1 else 3
    return f"{x:.{digits}f}"


def _plan_table(console: Console, plan) -> None:
    """The automatic partition next to the uniform one, with predicted per-stage times."""
    table = Table(title="pipeline.partition=auto")
    table.add_column("stage", justify="right")
    for col in (f"uniform {plan.uniform_bounds}", f"auto {plan.bounds}"):
        table.add_column(col, justify="right")
    for s, (u, a) in enumerate(zip(plan.uniform_times, plan.times)):
        table.add_row(str(s), f"{u:.2f}", f"{a:.2f}")
    table.add_row("bottleneck", f"{max(plan.uniform_times):.2f}", f"{max(plan.times):.2f}")
    console.print(table)
    console.print("(predicted ms per micro-batch, forward + backward, on the slowest replica's "
                  f"device)\nauto partition: predicted {plan.speedup:.2f}x the uniform partition's "
                  "throughput", highlight=False)


def _summary(console: Console, result, wall_s: float, restarts: int = 0) -> None:
    again = f" after {restarts} restart{'s' if restarts > 1 else ''}" if restarts else ""
    table = Table(title=f"sdpipe train: done in {wall_s:.1f} s{again}")
    pipelines = sorted(result.progress.get("pipelines", {}).items(), key=lambda kv: int(kv[0]))
    accuracy = any(s.get("val_accuracy") is not None for _, s in pipelines)
    for col in ("pipeline", "iterations", "samples", "loss", "val_loss",
                *(("val_acc",) if accuracy else ()), "samples/s"):
        table.add_column(col, justify="right")
    for p, s in pipelines:
        fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        acc = ("-" if s.get("val_accuracy") is None else f"{100 * s['val_accuracy']:.1f}%",)
        table.add_row(str(p), str(s["steps"]), str(s["samples"]), fmt(s["loss"]),
                      fmt(s["val_loss"]), *(acc if accuracy else ()), f"{s['samples_per_s']:.1f}")
    console.print(table)
    if result.progress.get("mean_group_size") is not None:
        rounds = "; ".join(f"stage {s}: {r}" for s, r in enumerate(result.progress["rounds"]))
        console.print(f"group sync: mean group size {result.progress['mean_group_size']:.2f}; "
                      f"rounds per replica: {rounds}", highlight=False)
    if result.progress.get("unreadable"):
        bad = result.progress["unreadable"]
        console.print(f"data: {len(bad)} unreadable sample(s) replaced by the next, e.g. {bad[0]} "
                      "(all in metrics.jsonl, kind unreadable)", markup=False, highlight=False, soft_wrap=True)
    share, wait = result.progress.get("data_wait_share"), result.progress.get("data_wait_s")
    if share is not None and share > 0.05 and wait is not None and wait > 0.005:  # not a toy's 1 ms
        console.print(f"data: a reading stage waited for its batches {share:.0%} of the time; raise "
                      "data.num_workers", markup=False, highlight=False)
    if result.progress.get("restarts"):
        console.print(f"recovered: {result.progress['restarts']} pipeline restart(s), "
                      f"{result.progress['heals']} replica(s) healed from live ones "
                      "(restart and heal lines in metrics.jsonl)", highlight=False)
    if result.progress.get("scheduler_restarts"):
        console.print(f"recovered: the scheduler was started again "
                      f"{result.progress['scheduler_restarts']} time(s) and replayed its journal "
                      "(scheduler_restart lines in metrics.jsonl)", highlight=False)


if __name__ == "__main__":
    sys.exit(main())
