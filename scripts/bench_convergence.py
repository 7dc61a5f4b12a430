"""Time to accuracy of the sync modes: loss at equal samples and time to a target loss, in one run.

Run it from the repository root after ``pip install -e .``::

    python scripts/bench_convergence.py                        # default model and corpus, P=4, S=2
    python scripts/bench_convergence.py --lrs 3e-3,6e-3 --variants sdpipe,allreduce \\
        --scenarios straggler --before ../sdpipe-before        # also an older checkout's sdpipe

**What it runs.** For each scenario (``equal``: every pipeline at speed 1; ``straggler``: the last
one ``--slow`` times slower, ``cluster.slowdown=[1,1,1,3]``; ``mixed``: the last two 2x and 4x
slower, ``cluster.slowdown=[1,1,2,4]``; ``random``: equal pipelines whose
workers are each ``--slow`` times slower in a seeded 10 % of their iterations, as in
``cluster=hetero_random``), each variant and each learning rate of
the grid, one ``sdpipe train`` of the default model (gpt_tiny on the stdlib corpus) with modelled
compute (``cluster.compute_ms``: the cores stay mostly idle, so the timing measures who waits for
whom, not CPU contention; ``overruns`` says whether that held). Variants:

- ``allreduce``: gradient all-reduce every iteration (the reference);
- ``sdpipe``: the default group sync (``sync.average=weights_grads``, ``sync.stale=pull``);
- ``sdpipe-mean``: the default, but every member of a round counts the same, stale or not
  (``sync.stale=average``);
- ``sdpipe-weights``: the paper's rule, weights averaged after the local step, every member
  counted the same;
- ``sdpipe-classic``: the group policy before who-waits-for-whom (``sync.policy=classic``);
- ``adpsgd``, ``diloco``, ``ps``, ``none``: gossip, local SGD with an outer step, parameter
  server, no sync;
- ``local-sgd``: ``sync=diloco`` with the outer step a plain average (``outer_lr=1``, no
  momentum): periodic weight averaging every ``sync.local_steps`` iterations;
- ``sdpipe-before``: with ``--before DIR``, ``sync=sdpipe`` run from another checkout (the code
  before a change), for the throughput comparison;
- ``VARIANT@N``: that variant with a budget of N steps instead of ``--steps``. Equal samples
  judge what a round is worth; time to a target judges what users wait for, and a mode that runs
  faster can spend its time on more samples: ``sdpipe@400`` against ``allreduce`` (200 steps)
  asks whether sdpipe reaches all-reduce's final loss before all-reduce does.

**What it reports**, per scenario, each variant at its best learning rate (lowest final loss):

- ``final val``: the mean over pipelines of their last validation loss; every run trains the same
  samples (P x steps x batch), so this is the loss at equal samples;
- ``to target (s)``: from the first train line to the first evaluation where the mean over
  pipelines of their latest validation loss is at or below the target (within a millionth:
  float32 rounding), all-reduce's final loss (at its best learning rate) or ``--target``;
  ``-``: never;
- ``samples/s`` and ``of limit``: throughput (all pipelines, first to last train line), and its
  share of the limit, the sum of each pipeline's solo rate in the ``none`` run (each pipeline's
  samples over its own train-line span); both as ``sdpipe_cli.analysis`` defines them;
- ``sent/sample (kB)`` and ``comm``: what the sync put on the wire, per sample trained (all
  workers' bytes, as ``sdpipe_cli.analysis.sync_traffic`` counts them), and the share of
  the workers' time spent in sync collectives (waiting for peers inside them included);
- ``consensus``: the mean and the largest consensus distance measured at global syncs
  (sqrt(mean_p ||w_p - w_mean||^2) / ||w_mean||, per stage), ``sync=sdpipe`` only;
- ``overruns``: the share of actions whose real compute did not fit the modelled time;
- ``final acc``: for classifiers (``--extra model=resnet_cifar data=digits train=digits``), the
  mean over pipelines of their last validation accuracy.

With several ``--seeds``, a table per scenario gives each figure's mean, standard deviation and
95 % t-interval over the seeds, each seed judged against its own all-reduce run. Everything goes to
``OUT/results.json`` and ``OUT/results.md``, stamped with the date, the commit and the command
line, and ``sdpipe report``'s PNGs of each scenario and seed (every variant at its best lr) to
``OUT/<scenario>-seed<N>-report/``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402  (sibling modules, not a package)
import _scenarios  # noqa: E402
from _runner import CpuSampler, classify, microbatches, run_sdpipe  # noqa: E402

from sdpipe_cli import analysis  # noqa: E402

VARIANTS = {
    "allreduce": ["sync=allreduce"],
    "sdpipe": ["sync=sdpipe"],
    "sdpipe-mean": ["sync=sdpipe", "sync.stale=average"],
    "sdpipe-weights": ["sync=sdpipe", "sync.average=weights", "sync.stale=average"],
    "sdpipe-classic": ["sync=sdpipe", "sync.policy=classic"],
    # a slower pipeline takes fewer micro-batches, to keep the others' pace (pipeline.balance)
    "sdpipe-balance": ["sync=sdpipe", "pipeline.balance=speed"],
    "allreduce-balance": ["sync=allreduce", "pipeline.balance=speed"],
    # sdpipe meeting every iteration in float32, whatever the links (the default before slow-link
    # meetings; the default still on clusters without emulated links)
    "sdpipe-every1": ["sync=sdpipe", "sync.every=1", "sync.precision=fp32"],
    "sdpipe-every4": ["sync=sdpipe", "sync.every=4", "sync.precision=bf16"],
    "sdpipe-every8": ["sync=sdpipe", "sync.every=8", "sync.precision=bf16"],
    # what a group round sends at the period the launcher chooses on cluster=slow_links (H = 14)
    "sdpipe-h14-fp32": ["sync=sdpipe", "sync.every=14", "sync.precision=fp32"],
    "sdpipe-h14-bf16": ["sync=sdpipe", "sync.every=14", "sync.precision=bf16"],
    "sdpipe-h14-int8": ["sync=sdpipe", "sync.every=14", "sync.precision=int8"],
    # int8 with the period the launcher chooses for it (an int8 meeting fits in fewer iterations)
    "sdpipe-int8": ["sync=sdpipe", "sync.precision=int8"],
    "diloco-bf16": ["sync=diloco", "sync.precision=bf16"],
    "adpsgd": ["sync=adpsgd"],
    "diloco": ["sync=diloco"],
    "local-sgd": ["sync=diloco", "sync.outer_lr=1", "sync.outer_momentum=0"],
    "ps": ["sync=ps"],
    "none": ["sync=none"],
}
BEFORE = "sdpipe-before"
SCENARIOS = _scenarios.SLOWDOWN_SCENARIOS  # equal, straggler, mixed, random


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Time to accuracy of sdpipe's sync modes.")
    p.add_argument("--variants", default="allreduce,sdpipe,sdpipe-weights,adpsgd,none",
                   help=f"comma-separated, of {', '.join(VARIANTS)} (none gives the limit)")
    p.add_argument("--lrs", default="3e-3,6e-3", help="learning-rate grid (train.lr)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--pipelines", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--compute-ms", type=float, default=10.0)
    p.add_argument("--slow", type=float, default=3.0)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--before", type=Path, default=None,
                   help="a checkout whose sync=sdpipe runs as 'sdpipe-before' (at the first lr)")
    p.add_argument("--out", type=Path, default=Path("runs/bench_convergence"))
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--extra", nargs="+", default=[], metavar="OVERRIDE")
    p.add_argument("--seeds", default="0", help="train.seed values; with more than one, a table "
                   "of mean, standard deviation and 95%% interval over them per variant")
    p.add_argument("--target", type=float, default=None,
                   help="the target loss (default: all-reduce's final loss in this run)")
    _report.add_markdown_option(p)
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if split(v) is None]
    if unknown:
        p.error(f"unknown variants: {', '.join(unknown)}")
    args.lrs = [float(x) for x in args.lrs.split(",")]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenarios: {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    args.seeds = [int(x) for x in args.seeds.split(",") if x]
    return args


def split(variant: str) -> tuple[str, int | None] | None:
    """``VARIANT`` or ``VARIANT@STEPS`` as (variant, steps or None); None if not one."""
    base, at, steps = variant.partition("@")
    if base not in VARIANTS or (at and not (steps.isdigit() and int(steps) > 0)):
        return None
    return base, int(steps) if at else None


def overrides(args, scenario: str, lr: float, run_dir: Path, steps: int | None = None
              ) -> list[str]:
    return [f"cluster.pipelines={args.pipelines}", f"pipeline.stages={args.stages}",
            f"train.steps={steps or args.steps}", f"train.lr={lr:g}", "cluster.device=cpu",
            f"cluster.compute_ms={args.compute_ms:g}",
            *_scenarios.overrides(scenario, args.pipelines, args.slow),
            f"train.eval_every={args.eval_every}", f"run.dir={run_dir}", *args.extra]


def run(args, scenario: str, variant: str, lr: float, console: Console, seed: int = 0
        ) -> dict[str, Any]:
    name = f"{scenario}-{variant}-lr{lr:g}" + (f"-seed{seed}" if len(args.seeds) > 1 else "")
    run_dir, log_path = args.out / name, args.out / f"{name}.log"
    base, steps = ("sdpipe", None) if variant == BEFORE else split(variant)
    ovr = [*VARIANTS[base], *overrides(args, scenario, lr, run_dir.resolve(), steps),
           f"train.seed={seed}"]
    cwd = args.before.resolve() if variant == BEFORE else None
    cpu_mean = None
    if variant in getattr(args, "reuse", ()) and (run_dir / "summary.json").is_file():
        console.print(f"{name}: reused (it ended well in an earlier invocation)", highlight=False)
        returncode, wall = 0, float("nan")
    else:
        console.print(f"{name}: running", highlight=False)
        with CpuSampler() as cpu:
            returncode, wall = run_sdpipe(ovr, log_path, args.timeout, cwd=cwd)
        cpu_mean = cpu.mean
    record: dict[str, Any] = {"scenario": scenario, "variant": variant, "lr": lr, "seed": seed,
                              "wall_s": round(wall, 1), "cpu_percent": cpu_mean,
                              "run_dir": str(run_dir)}
    record["status"], record["error"] = classify(returncode, log_path, args.timeout)
    if record["status"] == "ok":
        lines = analysis.read_metrics(run_dir / "metrics.jsonl")
        mode = "allreduce" if base == "allreduce" else "none" if base == "none" else "sdpipe"
        record.update(analysis.analyse(lines, mode, args.pipelines, microbatches(run_dir)))
        record["solo_rates"] = analysis.solo_rates(lines)
        consensus = [v for _, values in analysis.consensus(lines).values() for v in values]
        record["consensus_mean"] = sum(consensus) / len(consensus) if consensus else None
        record["consensus_max"] = max(consensus) if consensus else None
        record["mean_group_size"] = analysis.mean_group_size(lines)  # only where groups formed
    console.print(f"  {record['status']} in {wall:.0f} s, final val "
                  f"{record.get('final_val_loss')}", highlight=False)
    return record


def summarize(scenario: str, records: list[dict], target: float | None = None
              ) -> dict[str, Any]:
    """Best lr per variant; target = ``target`` or all-reduce's best final loss; times to it;
    the limit."""
    best: dict[str, dict] = {}
    for r in records:
        if r["status"] != "ok" or r.get("final_val_loss") is None:
            continue
        b = best.get(r["variant"])
        if b is None or r["final_val_loss"] < b["final_val_loss"]:
            best[r["variant"]] = r
    if target is None and "allreduce" in best:
        target = best["allreduce"]["final_val_loss"]
    limit = analysis.limit(best["none"]["solo_rates"]) if "none" in best else None
    for r in records:
        if r["status"] == "ok" and r.get("curve"):
            r["time_to_target_s"] = analysis.time_to_loss(r["curve"], target, r["first_train_s"])
            r["fraction_of_limit"] = analysis.fraction_of_limit(r.get("samples_per_s"), limit)
    return {"scenario": scenario, "target_loss": target, "limit_samples_per_s": limit,
            "best": {v: r for v, r in best.items()}, "runs": records}


# two-sided 95 % quantile of Student's t with n - 1 degrees of freedom, for n = 2..10 seeds
T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}


def interval(values: list[float]) -> tuple[float, float, float] | None:
    """Mean, sample standard deviation and the half-width of the 95 % t-interval of the mean."""
    if not values:
        return None
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0, float("nan")
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
    return mean, sd, T95.get(n, 1.96) * sd / n ** 0.5


def across_seeds(summaries: list[dict]) -> dict[str, dict[str, Any]]:
    """Per variant, over one scenario's per-seed summaries: the mean, sd and 95 % interval of its
    final val, that over all-reduce's of the same seed, time to that seed's target, that over
    all-reduce's, samples/s, fraction of the limit, and the time ratio as a multiple of the
    ideal (all-reduce's samples/s over the limit: nothing lost per sample, no device idle)."""
    out: dict[str, dict[str, list[float]]] = {}
    for summary in summaries:
        best = summary["best"]
        ref = best.get("allreduce", {})
        limit = summary.get("limit_samples_per_s")
        ideal = (ref["samples_per_s"] / limit if limit and ref.get("samples_per_s") else None)
        for variant, r in best.items():
            got = out.setdefault(variant, {})

            def put(key: str, value: float | None, got: dict = got) -> None:
                if value is not None:
                    got.setdefault(key, []).append(value)

            put("final val", r.get("final_val_loss"))
            put("final acc", r.get("final_val_accuracy"))
            if ref.get("final_val_loss") and r.get("final_val_loss") is not None:
                put("val vs allreduce", r["final_val_loss"] / ref["final_val_loss"])
            t, tr = r.get("time_to_target_s"), ref.get("time_to_target_s")
            put("to target (s)", t)
            if t is not None and tr:
                put("time vs allreduce", t / tr)
                if ideal:
                    put("vs ideal", t / tr / ideal)
            put("samples/s", r.get("samples_per_s"))
            put("of limit", r.get("fraction_of_limit"))
            if r.get("sync_bytes_per_sample") is not None:
                put("sent/sample (kB)", r["sync_bytes_per_sample"] / 1e3)
            put("comm", r.get("comm_share"))
    return {v: {k: interval(vals) + (len(vals),) for k, vals in keys.items()}
            for v, keys in out.items()}


SEED_COLUMNS = ("final val", "val vs allreduce", "final acc", "to target (s)", "time vs allreduce",
                "vs ideal", "samples/s", "of limit", "sent/sample (kB)", "comm")


def seed_rows(aggregate: dict[str, dict[str, Any]]) -> list[list[str]]:
    rows_ = []
    for variant, keys in aggregate.items():
        row = [variant]
        for key in SEED_COLUMNS:
            got = keys.get(key)
            if got is None:
                row.append("-")
                continue
            mean, sd, half, n = got
            digits = ".4f" if key.startswith("final") else ".3f" if "vs" in key or key in ("of limit", "comm") \
                else ".1f"
            row.append(f"{mean:{digits}} (sd {sd:{digits}}, +-{half:{digits}}, n={n})")
        rows_.append(row)
    return rows_


COLUMNS = ("variant", "best lr", "final val", "vs allreduce", "final acc", "to target (s)", "vs allreduce",
           "samples/s", "of limit", "sent/sample (kB)", "comm", "mean group", "consensus mean/max",
           "overruns")


def rows(summary: dict) -> list[list[str]]:
    best = summary["best"]
    ref = best.get("allreduce", {})
    out = []
    for v, r in best.items():
        ratio_loss = (r["final_val_loss"] / ref["final_val_loss"]
                      if ref.get("final_val_loss") else None)
        t, tr = r.get("time_to_target_s"), ref.get("time_to_target_s")
        out.append([v, f"{r['lr']:g}", _report.loss(r["final_val_loss"]),
                    _report.num(ratio_loss, ".3f"), _report.num(r.get("final_val_accuracy"), ".4f"),
                    _report.num(t, ".1f"),
                    _report.num(t / tr if t is not None and tr else None, ".2f"),
                    _report.rate(r.get("samples_per_s")),
                    _report.num(r.get("fraction_of_limit"), ".2f"),
                    _report.kilobytes(r.get("sync_bytes_per_sample")),
                    _report.percent(r.get("comm_share"), 0),
                    _report.num(r.get("mean_group_size"), ".2f"),
                    f"{_report.num(r.get('consensus_mean'), '.4f')}/"
                    f"{_report.num(r.get('consensus_max'), '.4f')}",
                    _report.percent(r.get("overrun_fraction"))])
    return out


def grid_rows(summary: dict) -> list[str]:
    """Every run: variant, lr, final val loss, samples/s."""
    return [f"{r['variant']} lr={r['lr']:g}: final val {_report.loss(r.get('final_val_loss'))}, "
            f"{_report.rate(r.get('samples_per_s'))} samples/s ({r['status']})"
            for r in summary["runs"]]


def figures(summaries: list[dict], out: Path, console: Console) -> None:
    """``sdpipe report``'s PNGs of each scenario and seed: every variant at its best lr overlaid,
    in ``OUT/<scenario>-seed<N>-report/`` (skipped, with a line, without matplotlib)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        console.print("figures: skipped, matplotlib is not installed (pip install -e '.[report]')")
        return
    from sdpipe_cli.cli import report

    for s in summaries:
        dirs = [r["run_dir"] for r in s["best"].values()]
        if dirs:
            folder = out / f"{s['scenario']}-seed{s['seed']}-report"
            written = report.report(report.load_all(dirs), folder)
            console.print(f"figures: {', '.join(str(p) for p in written)}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=200)
    if args.out.exists() and any(args.out.iterdir()):
        console.print(f"bench_convergence: {args.out} already holds files; choose --out")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    summaries, per_seed = [], {}
    for scenario in args.scenarios:
        for seed in args.seeds:
            records = [run(args, scenario, v, lr, console, seed) for v in args.variants
                       for lr in args.lrs]
            if args.before is not None:
                records.append(run(args, scenario, BEFORE, args.lrs[0], console, seed))
            summary = summarize(scenario, records, args.target)
            summary["seed"] = seed
            summaries.append(summary)
            per_seed.setdefault(scenario, []).append(summary)
    command = "python " + shlex.join(sys.argv)
    md = [f"`{command}` ({_report.short_stamp()})", ""]
    source = "--target" if args.target is not None else "all-reduce's final val"
    for s in summaries:
        seed = f", seed {s['seed']}" if len(args.seeds) > 1 else ""
        title = (f"{s['scenario']}{seed}: P={args.pipelines}, S={args.stages}, {args.steps} steps, "
                 f"compute {args.compute_ms:g} ms; target = {source} "
                 f"{_report.loss(s['target_loss'])}; limit {_report.rate(s['limit_samples_per_s'])} "
                 "samples/s")
        table = Table(title=title)
        for c in COLUMNS:
            table.add_column(c, justify="left" if c == "variant" else "right")
        body = rows(s)
        for row in body:
            table.add_row(*row)
        console.print(table)
        for line in grid_rows(s):
            console.print("  " + line, highlight=False)
        md += [f"**{title}**", "", "| " + " | ".join(COLUMNS) + " |",
               "|" + "---|" * len(COLUMNS)] + ["| " + " | ".join(r) + " |" for r in body]
        md += ["", "All runs: " + "; ".join(grid_rows(s)), ""]
    if len(args.seeds) > 1:
        for scenario, group in per_seed.items():
            aggregate = across_seeds(group)
            title = (f"{scenario}, seeds {','.join(map(str, args.seeds))}: mean (sd, 95 % "
                     "interval half-width, seeds) per variant at its best lr; each seed's target "
                     "is its own all-reduce's final val; 'vs ideal': the time ratio over "
                     "all-reduce's samples/s / the limit")
            table = Table(title=title)
            for c in ("variant", *SEED_COLUMNS):
                table.add_column(c, justify="left" if c == "variant" else "right")
            body = seed_rows(aggregate)
            for row in body:
                table.add_row(*row)
            console.print(table)
            md += [f"**{title}**", "", "| variant | " + " | ".join(SEED_COLUMNS) + " |",
                   "|" + "---|" * (len(SEED_COLUMNS) + 1)]
            md += ["| " + " | ".join(r) + " |" for r in body] + [""]
    figures(summaries, args.out, console)
    (args.out / "results.md").write_text("\n".join(md) + "\n")
    (args.out / "results.json").write_text(json.dumps(
        {"command": command, "stamp": _report.short_stamp(), "scenarios": summaries}, indent=1,
        default=str))
    console.print(f"results: {args.out / 'results.md'}")
    if args.markdown is not None:  # the tables without the command line: the stamp carries it
        console.print(f"markdown: {_report.write_markdown(args.markdown, chr(10).join(md[2:]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
