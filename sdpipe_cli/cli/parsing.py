"""The ``sdpipe`` command line: parse the arguments, pick the command, map its outcome to an exit code.

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
    sdpipe export runs/20261129-120000 --out model/   # one model: transformers, torchvision or state dict
    sdpipe eval model/                            # its loss (accuracy) on the run's validation set
    sdpipe sample model/ --prompt "def "          # text from an exported language model
    sdpipe simulate cluster.pipelines=1024 pipeline.stages=1 cluster.compute_ms=10 \
        'cluster.slowdown=[...]' --compare allreduce,none   # the policy at any scale, no processes

Exit codes: 0 done, 1 a process failed (named on stderr), 2 bad input (one line, nothing
started), 130 interrupted. rich lives in the CLI only: workers and the scheduler log plain text.

The top of the CLI's one-way flow (parsing -> commands and the sweep -> run loop -> display):
argparse, the Hydra overrides (``--config-dir``, ``--cfg job``), the interrupt handling until a
launch starts processes, and the one place where bad input and interrupts become exit codes, so
that the commands below stay callable with their arguments alone.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from sdpipe_cli import __version__
from sdpipe_cli.cli import commands, display, resuming, sweeping
from sdpipe_cli.cli.interrupts import exit_on_interrupt
from sdpipe_cli.cli.run_loop import EXIT_FAILED, InterruptedAfterRun
from sdpipe_cli.config import yaml_bounds
from sdpipe_cli.config.composition import group_options
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.core.errors import BadInput
from sdpipe_cli.runtime.errors import WriteFailed, failed_write

EXIT_USAGE = 2  # bad input; the run loop's EXIT_FAILED and EXIT_INTERRUPTED are the others

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

EXPORT_HELP = """Assemble a run's stages into one model and write it where its users load it: a
transformers folder (save_pretrained, with the tokenizer of data=tokens) for gpt2 and bert,
torchvision's state dict for the ResNets, the model's own state dict for the others
(model.safetensors and model.pt). Replicas that differ are averaged (or --pipeline P); the
consensus distance is reported. export.json records the source and every file's SHA-256. DIR
must not exist or be empty; nothing is written there unless the export completes."""

EVAL_HELP = """The loss (and a classifier's accuracy) of a run's weights or of an export on the
run's validation batches (the same ones the run's eval records use), or on another data set
(data=NAME, data.*), in one process."""

SAMPLE_HELP = """Continue a prompt with an exported causal language model: greedy, or top-k
sampling with a temperature (transformers' generate for gpt2)."""

TRUST_HELP = ("run the code the saved config names (model, loss or data _target_) even though "
              "no run of yours sealed it (docs/SECURITY.md)")

PREPARE_HELP = """Tokenize text into memory-mapped shards for data=tokens data.path=DIR: text files,
JSON lines (--text-key), parquet, folders of them, or `stdlib` (the Python standard library's
sources). The tokenizer is bytes, a BPE or WordPiece vocabulary trained here (bpe:VOCAB,
wordpiece:VOCAB, Hugging Face tokenizers), or an existing tokenizer.json. DIR gets the shards, the
tokenizer and manifest.json (token counts and a SHA-256 per shard); it must not exist yet."""


def _parser() -> argparse.ArgumentParser:
    """The whole command line; each subcommand's arguments live in a function of their own, added
    here in the order ``sdpipe --help`` lists them."""
    parser = argparse.ArgumentParser(
        prog="sdpipe", description="Semi-decentralized pipeline-parallel training for "
        "heterogeneous clusters.")
    parser.add_argument("--version", action="version", version=f"sdpipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups = "\n".join(f"  {g:<10} {', '.join(opts)}" for g, opts in group_options().items())
    _add_train_and_profile(sub, groups)
    _add_simulate(sub, groups)
    _add_resume(sub)
    _add_prepare(sub)
    _add_export(sub)
    _add_eval(sub)
    _add_sample(sub)
    _add_report(sub)
    return parser


def _add_train_and_profile(sub, groups: str) -> None:
    """``train`` and ``profile`` compose the same config from the same overrides, so they share
    their options; only ``train`` sweeps (``-m``)."""
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


def _add_simulate(sub, groups: str) -> None:
    """``simulate`` composes a training config too (hence the config groups and overrides), plus
    the sync modes to compare against."""
    sim = sub.add_parser("simulate", help="simulate a run's timing under sync policies",
                         description=SIMULATE_HELP,
                         epilog=f"config groups (group=option):\n{groups}",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    sim.add_argument("--compare", default="allreduce,none", metavar="MODES",
                     help="comma-separated sync modes to simulate too (default: allreduce,none)")
    sim.add_argument("--cfg", action="store_true", help="print the composed config and exit")
    _config_dir_option(sim)
    sim.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra overrides")


def _add_resume(sub) -> None:
    """``resume`` takes the saved config, so its overrides are limited to the settings the saved
    state does not depend on, which its help lists."""
    resume = sub.add_parser(
        "resume", help="continue a run from a checkpoint", description=RESUME_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    resume.add_argument("path", metavar="PATH", type=_user_path, help="a run folder (its latest "
                        "complete checkpoint) or one checkpoint folder")
    resume.add_argument("--trust-code", action="store_true",
                        help="run the code the checkpoint's config names (model, loss or data "
                        "_target_) even though no run of yours sealed it (docs/SECURITY.md)")
    resume.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help=f"safe changes only: {', '.join(resuming.RESUMABLE)}; the layout: "
                        f"{', '.join(resuming.LAYOUT)} (the checkpoint is resharded); run.dir=NEW: "
                        "go on in a new run folder")


def _add_prepare(sub) -> None:
    """``prepare KIND``: a level of its own so that other kinds of data can join ``text``."""
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


def _add_export(sub) -> None:
    """``export`` reads a run (or one of its checkpoints) and writes one model to a new folder."""
    exp = sub.add_parser("export", help="one model out of a run's stages and replicas",
                         description=EXPORT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    exp.add_argument("run", metavar="RUN", type=_user_path, help="a run folder, or a checkpoint folder")
    exp.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT", type=_user_path,
                     help="step_N, a checkpoint folder, or final (default: the newest of the "
                     "latest complete checkpoint and final/)")
    exp.add_argument("--out", required=True, metavar="DIR", type=_user_path,
                     help="the new folder of the export")
    exp.add_argument("--format", metavar="FORMAT",
                     help="transformers, torchvision or state_dict (default: transformers for gpt2 "
                     "and bert, torchvision for the ResNets, "
                     "else state_dict)")
    _replica_options(exp)


def _add_eval(sub) -> None:
    """``eval`` takes a run or an export, and overrides only for the data it is measured on."""
    ev = sub.add_parser("eval", help="a run's or an export's loss on a validation set",
                        description=EVAL_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("path", metavar="RUN|DIR", type=_user_path,
                    help="a run folder, a checkpoint, or an export")
    ev.add_argument("--checkpoint", metavar="CHECKPOINT", type=_user_path,
                    help="of a run: step_N, a folder, or final")
    ev.add_argument("--out", metavar="FILE", type=_user_path,
                    help="also write the result as JSON (a new file)")
    _replica_options(ev)
    ev.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="another data set or batch: data=NAME, data.*, train.batch_size, "
                    "pipeline.microbatches; run.memory_check=false")


def _add_sample(sub) -> None:
    """``sample`` reads an export only: the prompt and the decoding settings."""
    sam = sub.add_parser("sample", help="text from an exported language model",
                         description=SAMPLE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    sam.add_argument("path", metavar="DIR", type=_user_path, help="an export (sdpipe export --out DIR)")
    sam.add_argument("--prompt", required=True, metavar="TEXT")
    sam.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="at most 1,000,000 (default: 64)")
    sam.add_argument("--top-k", type=int, default=0, metavar="K",
                     help="sample among the K likeliest tokens; 0: greedy (default)")
    sam.add_argument("--temperature", type=float, default=1.0, metavar="T",
                     help="what the logits are divided by, 1e-4 to 1e4 (default: 1.0)")
    sam.add_argument("--seed", type=int, default=0, metavar="N", help="(default: 0)")
    sam.add_argument("--trust-code", action="store_true", help=TRUST_HELP)


def _add_report(sub) -> None:
    """``report`` reads run folders only: no config to compose, no overrides."""
    rep = sub.add_parser("report", help="plot runs: loss, throughput, groups, waits",
                         description=REPORT_HELP,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    rep.add_argument("runs", nargs="+", metavar="RUN", type=_user_path,
                     help="run folders (running, failed or done)")
    rep.add_argument("--out", metavar="DIR", type=_user_path,
                     help="where the PNGs go (default: RUN/report)")


def _replica_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--pipeline", type=int, metavar="P",
                         help="take pipeline P's replica (default: the replicas' mean, or any one "
                         "when they are equal)")
    command.add_argument("--trust-code", action="store_true", help=TRUST_HELP)


def _user_path(text: str) -> str:
    """A path as typed: ``~`` and ``~user`` are home folders, as a shell makes them of a word
    it does not quote (and as ``run.dir`` takes them), never a folder named ``~``."""
    return os.path.expanduser(text)


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
        yaml_bounds.check_folder(path)  # before Hydra expands an alias bomb
        paths.append(f"file://{path}")
    return [f"hydra.searchpath=[{','.join(paths)}]"]


def _hydra_cfg(argv: Sequence[str] | None) -> list[str]:
    """``--cfg job`` and ``--cfg all`` (Hydra's spellings) mean ``--cfg``: sdpipe prints the one
    config a run reads."""
    args = list(sys.argv[1:] if argv is None else argv)
    out: list[str] = []
    for arg in args:
        if arg in ("job", "all") and out and out[-1] == "--cfg":
            continue
        out.append("--cfg" if arg in ("--cfg=job", "--cfg=all") else arg)
    return out


def _after_training(args: argparse.Namespace, err) -> int:
    from sdpipe_cli.cli import exporting

    if args.command == "export":
        return exporting.export(args.run, args.checkpoint, args.out, args.pipeline, args.format,
                                err, trusted=args.trust_code)
    if args.command == "eval":
        return exporting.evaluate(args.path, args.overrides, args.checkpoint, args.pipeline,
                                  args.out, err, trusted=args.trust_code)
    from sdpipe_cli.export.generation import Settings

    return exporting.sample(args.path, args.prompt, Settings(args.max_new_tokens, args.top_k,
                                                             args.temperature, args.seed),
                            err, trusted=args.trust_code)


def main(argv: Sequence[str] | None = None) -> int:
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
    err = display.stderr_console()
    # Until a launch starts processes, an interrupt ends sdpipe at once (imports of C extensions
    # must not be interrupted by an exception); the launch then handles its own interrupts.
    previous = exit_on_interrupt("preparing the run", args.command)
    try:
        if getattr(args, "config_dir", None):
            args.overrides = [*_searchpath(args.config_dir), *args.overrides]
        if args.command == "train" and args.multirun:
            return sweeping.sweep_train(args.overrides, console=err)
        if args.command == "train":
            return commands.train(args.overrides, show_config=args.cfg, console=err)
        if args.command == "resume":
            return commands.resume(args.path, args.overrides, console=err,
                                   trusted=args.trust_code)
        if args.command == "profile":
            return commands.profile(args.overrides, show_config=args.cfg, console=err)
        if args.command == "simulate":
            return commands.simulate(args.overrides, args.compare, show_config=args.cfg, console=err)
        if args.command == "report":
            return commands.report(args.runs, args.out, console=err)
        if args.command in ("export", "eval", "sample"):
            return _after_training(args, err)
        if args.command == "prepare":
            return commands.prepare_text(args, console=err)
    except BadInput as bad:
        err.print(f"sdpipe: error: {bad}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_USAGE
    except WriteFailed as failed:  # a file of a run (a restart's metrics line on a full disk)
        from sdpipe_cli import checkpoint  # torch: never before a launch has loaded it

        err.print(f"sdpipe: error: {failed}; {checkpoint.go_on_from(failed.run_dir)}", markup=False,
                  highlight=False, soft_wrap=True)
        return EXIT_FAILED
    except OSError as failed:  # the machine refused (a full disk, a lost mount)
        err.print(f"sdpipe: error: {failed_write(failed)}", markup=False, highlight=False,
                  soft_wrap=True)
        return EXIT_FAILED
    except InterruptedAfterRun as ended:
        result = ended.result
        outcome = "ended" if result.returncode == 0 else f"failed (exit {result.returncode})"
        err.print(f"sdpipe: interrupted after the run {outcome}; nothing is running, its folder is "
                  f"{result.run_dir}", markup=False, highlight=False, soft_wrap=True)
        return result.returncode
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
