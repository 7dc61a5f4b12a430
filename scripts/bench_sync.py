"""Benchmark the sync modes of ``sdpipe train`` with equal and straggling pipelines.

Run it from the repository root after ``pip install -e .``::

    python scripts/bench_sync.py                          # the full benchmark: all modes, scenarios
    python scripts/bench_sync.py --markdown               # the same, tables printed as Markdown
    python scripts/bench_sync.py --markdown runs/bench.md # also written there, stamped (_report.py)
    python scripts/bench_sync.py --steps 6 --modes none,allreduce --scenarios straggler \\
        --pipelines 2 --out /tmp/benchtest                # a smoke test of the script itself

Usage::

    python scripts/bench_sync.py [--modes sdpipe,allreduce,ps,adpsgd,diloco,none] [--pipelines 4]
        [--stages 2] [--steps 60] [--compute-ms 10] [--slow 3] [--scenarios equal,straggler]
        [--target-loss auto|FLOAT] [--out runs/bench] [--timeout 600] [--markdown [PATH]]
        [--extra OVERRIDE ...]

**What it runs.** For each scenario and each sync mode, one ``sdpipe train`` subprocess::

    python -m sdpipe_cli train model=mlp data=synthetic cluster.pipelines=P pipeline.stages=S
        sync=MODE train.steps=N cluster.compute_ms=X cluster.slowdown=[...] cluster.device=cpu
        train.eval_every=K run.dir=OUT/SCENARIO-MODE [--extra overrides]

``equal``: every pipeline at speed 1. ``straggler``: the last pipeline ``--slow`` times slower
(``cluster.slowdown=[1,1,1,3]``). ``K = max(1, N // 8)``, which gives 8-9 evaluations per
pipeline. The launcher's output goes to ``OUT/SCENARIO-MODE.log``. A run that fails or passes
``--timeout`` is recorded as such and the benchmark goes on; a mode that the installed ``sdpipe``
does not know (exit 2 with an error on ``sync``) is reported as ``unavailable``.

**Why modelled compute.** With ``cluster.compute_ms`` set, every micro-batch forward takes
``compute_ms x slowdown`` ms and every backward twice that: the real compute (a 34k-parameter MLP)
runs inside that budget and the worker sleeps for the rest (``sdpipe_cli/hetero/emulation.py``). The cores
stay mostly idle, so the figures measure scheduling and synchronization (who waits for whom), not
how P x S processes fight over a few CPU cores, and they do not depend on the machine's core count.
Two checks of that assumption are reported: the system-wide CPU utilization sampled with
``psutil`` during each run (mean over the run; it includes anything else running on the machine),
and ``overruns``, the share of forward/backward actions whose real compute did not fit in the
modelled budget (from the ``done`` lines). Both should stay low; if not, the figures are skewed
by CPU contention.

**What it measures**, from each run's ``metrics.jsonl``, each figure as
``sdpipe_cli.analysis`` defines it (``analyse``):

- ``samples/s``: training throughput of all pipelines together (``analysis.samples_per_s``). The
  window runs from the earliest ``train`` line of any pipeline to the latest one, and counts each
  pipeline's samples after its own first ``train`` line (``samples`` is cumulative per pipeline).
  The first iteration of every pipeline is therefore left out, which excludes process start-up,
  connection set-up and warm-up from both the numerator and (mostly) the denominator. It slightly
  undercounts (the other pipelines' first iterations end inside the window), the same way for
  every mode.
- ``final val loss``: the mean over pipelines of each pipeline's last ``eval`` line. Every mode
  trains the same total samples (P x steps x batch), so this is the loss at equal samples.
- ``to target``: the first ``eval`` time at which the mean over pipelines of their latest
  ``val_loss`` so far is at or below the target (within a millionth: float32 rounding), in
  seconds from the run's first ``train`` line (so that process start-up, which does not depend
  on the mode, is left out);
  every pipeline must have evaluated at least once. ``--target-loss auto`` sets the target per
  scenario, after all its modes ran, to the largest final loss of the modes that finished, times
  1.02, so that every finished mode reaches it. ``-`` when never reached. ``results.json``
  keeps each run's ``first_train_s`` (earliest train line) and its loss ``curve``.
- ``mean group``: the mean ``size`` of the scheduler's ``group`` lines (``sync=sdpipe``, global
  averaging rounds included); P for ``allreduce`` and 1 for ``none`` by definition; ``-`` otherwise.
- ``iterations``: each pipeline's last iteration (``sync=sdpipe`` lets fast pipelines run more).
- ``CPU %`` and ``overruns``: see above; ``wall (s)``: the whole ``sdpipe train`` subprocess.

Per scenario it also prints the ratios sdpipe/allreduce of samples/s and of time to target, next to
the targets the project aims for (straggler: samples/s >= 1.6x and time to target < 1x; equal:
samples/s >= 0.95x). They are shown, not judged. Everything goes to ``OUT/results.json`` and
``OUT/results.md`` (the Markdown tables, headed by the exact command line, ready for the README).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402  (sibling modules, not a package)
import _scenarios  # noqa: E402
from _runner import CpuSampler, classify, microbatches, run_sdpipe  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from sdpipe_cli import analysis  # noqa: E402

MODES = ("sdpipe", "allreduce", "ps", "adpsgd", "diloco", "none")
SCENARIOS = ("equal", "straggler")  # of _scenarios.py's
AUTO_MARGIN = 1.02  # --target-loss auto: the worst final loss of a scenario, plus 2 %
EVALS_PER_RUN = 8
# Targets the project aims for, per scenario: (metric, comparison, value) for sdpipe/allreduce.
TARGETS = {
    "straggler": {"samples_per_s": (">=", 1.6), "time_to_target": ("<", 1.0)},
    "equal": {"samples_per_s": (">=", 0.95)},
}
COLUMNS = ("mode", "status", "samples/s", "final val loss", "to target (s)", "mean group",
           "iterations", "CPU %", "overruns", "wall (s)")


# -- arguments --------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark sdpipe's sync modes (modelled compute, CPU) with equal pipelines "
        "and with one straggler.")
    parser.add_argument("--modes", type=_csv(None), default=list(MODES),
                        help=f"sync modes, comma-separated (default: {','.join(MODES)})")
    parser.add_argument("--pipelines", type=int, default=4, help="P (default: 4)")
    parser.add_argument("--stages", type=int, default=2, help="S (default: 2)")
    parser.add_argument("--steps", type=int, default=60, help="train.steps (default: 60)")
    parser.add_argument("--compute-ms", type=float, default=10.0,
                        help="cluster.compute_ms: modelled forward of a micro-batch (default: 10)")
    parser.add_argument("--slow", type=float, default=3.0,
                        help="slowdown of the straggler, the last pipeline (default: 3)")
    parser.add_argument("--scenarios", type=_csv(SCENARIOS), default=list(SCENARIOS),
                        help="equal, straggler or both (default: equal,straggler)")
    parser.add_argument("--target-loss", default="auto", type=_target,
                        help="validation loss for time to target: auto or a number (default: auto)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"),
                        help="output folder (default: runs/bench)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds allowed per run (default: 600)")
    _report.add_markdown_option(parser, stdout_flag=True)
    parser.add_argument("--extra", nargs="+", default=[], metavar="OVERRIDE",
                        help="more sdpipe overrides for every run, e.g. --extra train.lr=1e-3")
    args = parser.parse_args(argv)
    if args.pipelines < 1 or args.stages < 1 or args.steps < 1:
        parser.error("--pipelines, --stages and --steps must be at least 1")
    if args.slow < 1.0:
        parser.error("--slow must be >= 1 (3 = three times slower)")
    return args


def _csv(allowed: tuple[str, ...] | None):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("give at least one name")
        bad = [t for t in items if allowed is not None and t not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(allowed)}")
        return list(dict.fromkeys(items))
    return parse


def _target(text: str):
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be auto or a number") from None


# -- one run ----------------------------------------------------------------------------------
def overrides_for(args: argparse.Namespace, scenario: str, mode: str, run_dir: Path) -> list[str]:
    factors = _scenarios.slowdowns(scenario, args.pipelines, args.slow)
    return [
        "model=mlp", "data=synthetic", f"cluster.pipelines={args.pipelines}",
        f"pipeline.stages={args.stages}", f"sync={mode}", f"train.steps={args.steps}",
        f"cluster.compute_ms={args.compute_ms:g}", _scenarios.slowdown(factors),
        "cluster.device=cpu", f"train.eval_every={max(1, args.steps // EVALS_PER_RUN)}",
        f"run.dir={run_dir}", *args.extra,
    ]


def run_one(args: argparse.Namespace, scenario: str, mode: str, console: Console) -> dict[str, Any]:
    """Run one (scenario, mode) and return its record: status, wall time, CPU and metrics."""
    run_dir = args.out / f"{scenario}-{mode}"
    log_path = args.out / f"{scenario}-{mode}.log"
    overrides = overrides_for(args, scenario, mode, run_dir)
    console.print(f"{scenario} / {mode}: running (log: {log_path})", markup=False,
                  highlight=False)
    with CpuSampler() as cpu:
        returncode, wall = run_sdpipe(overrides, log_path, args.timeout)
    record: dict[str, Any] = {
        "scenario": scenario, "mode": mode, "returncode": returncode, "wall_s": round(wall, 2),
        "cpu_percent": None if cpu.mean is None else round(cpu.mean, 1),
        "run_dir": str(run_dir), "log": str(log_path), "overrides": overrides,
    }
    record["status"], record["error"] = classify(returncode, log_path, args.timeout)
    metrics_path = run_dir / "metrics.jsonl"
    if record["status"] == "ok" and metrics_path.is_file():
        record.update(analysis.analyse(analysis.read_metrics(metrics_path), mode, args.pipelines,
                                       microbatches(run_dir)))
    console.print(f"  {record['status']} in {wall:.1f} s"
                  + (f": {record['error']}" if record["error"] else ""),
                  markup=False, highlight=False, soft_wrap=True)
    return record


# -- a scenario -------------------------------------------------------------------------------
def scenario_target(records: list[dict[str, Any]], target_loss) -> float | None:
    if target_loss != "auto":
        return float(target_loss)
    finals = [r["final_val_loss"] for r in records if r.get("final_val_loss") is not None]
    return max(finals) * AUTO_MARGIN if finals else None


def finish_scenario(scenario: str, records: list[dict[str, Any]], target_loss) -> dict[str, Any]:
    target = scenario_target(records, target_loss)
    for r in records:
        if r["status"] == "ok":
            r["time_to_target_s"] = analysis.time_to_loss(r.get("curve", []), target,
                                                          r.get("first_train_s"))
    return {"scenario": scenario, "target_loss": target, "runs": records,
            "ratios": ratios(scenario, records)}


def ratios(scenario: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """sdpipe / allreduce for samples/s and time to target, with the project's targets."""
    by_mode = {r["mode"]: r for r in records}
    sd, ar = by_mode.get("sdpipe", {}), by_mode.get("allreduce", {})
    out = {}
    for key in ("samples_per_s", "time_to_target"):
        field = "time_to_target_s" if key == "time_to_target" else key
        a, b = sd.get(field), ar.get(field)
        out[key] = {"value": a / b if a is not None and b else None,
                    "target": TARGETS.get(scenario, {}).get(key)}
    return out


# -- output -----------------------------------------------------------------------------------
def table_rows(result: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in result["runs"]:
        iters = r.get("iterations") or {}
        rows.append([
            r["mode"], r["status"], _report.rate(r.get("samples_per_s")),
            _report.loss(r.get("final_val_loss")), _report.num(r.get("time_to_target_s"), ".2f"),
            _report.num(r.get("mean_group_size"), ".2f"),
            "/".join(str(v) for v in iters.values()) or "-",
            _report.num(r.get("cpu_percent"), ".0f"), _report.percent(r.get("overrun_fraction")),
            _report.num(r.get("wall_s"), ".1f"),
        ])
    return rows


def ratio_lines(result: dict[str, Any]) -> list[str]:
    names = {"samples_per_s": "samples/s", "time_to_target": "time to target"}
    lines = []
    for key, got in result["ratios"].items():
        target = got["target"]
        goal = f"target {target[0]} {target[1]:g}x" if target else "no target"
        hint = " (below 1 = sdpipe faster)" if key == "time_to_target" else ""
        value = _report.ratio(got["value"])
        lines.append(f"sdpipe / allreduce {names[key]}: {value}{hint}; "
                     f"{goal}")
    return lines


def notes(result: dict[str, Any]) -> list[str]:
    """One line per run that did not finish: why, and where its log is."""
    return [f"{r['mode']}: {r['status']}: {r['error'] or '-'} (log: {r['log']})"
            for r in result["runs"] if r["status"] != "ok"]


def title(result: dict[str, Any], args: argparse.Namespace) -> str:
    factors = _scenarios.factors_text(
        _scenarios.slowdowns(result["scenario"], args.pipelines, args.slow))
    target = _report.loss(result["target_loss"])
    how = "auto: worst final loss x 1.02" if args.target_loss == "auto" else "given"
    return (f"{result['scenario']}: P={args.pipelines}, S={args.stages}, slowdown [{factors}], "
            f"{args.steps} steps, compute {args.compute_ms:g} ms; target val loss {target} ({how})")


def markdown_table(result: dict[str, Any], args: argparse.Namespace) -> str:
    out = [f"**{title(result, args)}**", "", "| " + " | ".join(COLUMNS) + " |",
           "|" + "|".join("---" if i < 2 else "---:" for i in range(len(COLUMNS))) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in table_rows(result)]
    out += [""] + [f"- {line}" for line in ratio_lines(result) + notes(result)]
    return "\n".join(out) + "\n"


def rich_table(result: dict[str, Any], args: argparse.Namespace) -> Table:
    table = Table(title=title(result, args), caption="\n".join(ratio_lines(result) + notes(result)),
                  caption_justify="left")
    for i, col in enumerate(COLUMNS):
        table.add_column(col, justify="left" if i < 2 else "right", no_wrap=i < 2)
    for row in table_rows(result):
        table.add_row(*row)
    return table


def write_results(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    env = _report.environment()
    (args.out / "results.json").write_text(json.dumps(
        {"command": _report.command_line(), "environment": env, "scenarios": results}, indent=1) + "\n")
    head = (f"```\n$ {_report.command_line()}\n```\n\nPython {env['python']}, torch {env['torch']}, "
            f"sdpipe {env['sdpipe']}, {env['cpus']} CPUs ({env['platform']}).\n")
    body = "\n".join(markdown_table(r, args) for r in results)
    (args.out / "results.md").write_text(head + "\n" + body)


def check_out(args: argparse.Namespace) -> str | None:
    """Run folders must be new or empty (sdpipe's rule); say so before running anything."""
    taken = [args.out / f"{s}-{m}" for s in args.scenarios for m in args.modes
             if (args.out / f"{s}-{m}").exists() and any((args.out / f"{s}-{m}").iterdir())]
    if taken:
        return (f"{taken[0]} is not empty (from an earlier benchmark?); "
                "choose another --out or remove it")
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    progress = Console(stderr=True)
    problem = check_out(args)
    if problem:
        progress.print(f"bench_sync: error: {problem}", markup=False, highlight=False,
                       soft_wrap=True)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for scenario in args.scenarios:
        records = [run_one(args, scenario, mode, progress) for mode in args.modes]
        results.append(finish_scenario(scenario, records, args.target_loss))
        write_results(results, args)  # after each scenario, so a long run leaves partial results
    tables = "\n".join(markdown_table(r, args) for r in results)
    if args.markdown not in (None, "-"):
        progress.print(f"markdown: {_report.write_markdown(Path(args.markdown), tables)}",
                       highlight=False)
    if args.markdown == "-":
        print(tables, end="")
    else:
        out = Console(width=None if sys.stdout.isatty() else 132)
        for r in results:
            out.print(rich_table(r, args))
    progress.print(f"results: {args.out / 'results.md'}, {args.out / 'results.json'}",
                   highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
