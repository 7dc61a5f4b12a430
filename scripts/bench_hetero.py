"""Benchmark: does emulated heterogeneity show in the metrics, and does auto partitioning pay?

Two experiments, each a few real ``sdpipe`` runs on this machine:

* **speeds** -- ``cluster=hetero_static`` (three pipelines, one on devices three times slower,
  modelled compute): each pipeline's samples/s with ``sync=none`` (each pipeline alone: the
  emulation by itself) and with ``sync=sdpipe`` (the default). Expect the slow one at about a
  third of the others without sync.
* **partition** -- a cluster whose second stage runs on half-speed devices (P=2, S=2, measured
  emulation). ``sdpipe profile`` measures it; then the same training runs with the uniform and
  with the automatic partition (``pipeline.partition=auto profile=...``), each pipeline alone
  (``sync=none``: the partition's effect, not the sync's). Reported: the partitioner's predicted
  bottleneck gain and the measured gain of the median per-iteration samples/s.

Usage::

    python scripts/bench_hetero.py --steps 40 --out runs/bench_hetero [--only speeds|partition]
        [--markdown PATH]   # the tables, stamped with date, commit, machine and command

Samples/s per pipeline is its solo rate: its samples over its own first-to-last train line span
(counted from the end of the pipeline's first iteration; ``solo_rates`` of
``sdpipe_cli.analysis``, which also defines the median rate, ``steady_rates``); a run's
total is the sum over its pipelines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402  (sibling modules, not a package)
import _scenarios  # noqa: E402
from _runner import run_command, run_sdpipe  # noqa: E402

from sdpipe_cli import analysis  # noqa: E402

HALF_SPEED_STAGE_1 = "cluster.nodes=[{name: n, devices: [{}, {speed: 0.5}, {}, {speed: 0.5}]}]"
PARTITION_RUN = ("cluster.pipelines=2", "pipeline.stages=2", "cluster.device=cpu",
                 "cluster.emulation=measured", HALF_SPEED_STAGE_1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="train.steps of every run")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_hetero"),
                        help="folder for the runs (must not exist yet)")
    parser.add_argument("--only", choices=("speeds", "partition"), help="run one experiment")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    _report.add_markdown_option(parser)
    return parser.parse_args(argv)


def train(out: Path, name: str, overrides: list[str], timeout: float,
          steady: bool = False) -> dict[int, float]:
    """One ``sdpipe train`` run; each pipeline's samples/s (its solo rate), or with ``steady`` its
    median per-iteration rate (batch / step_s: robust to a passing load on a shared machine)."""
    run_dir = out / name
    rc, wall = run_sdpipe([*overrides, f"run.dir={run_dir}"], out / f"{name}.log", timeout)
    if rc != 0:
        raise SystemExit(f"{name}: sdpipe train exited {rc}; see {out / f'{name}.log'}")
    lines = analysis.read_metrics(run_dir / "metrics.jsonl")
    rates = analysis.steady_rates(lines) if steady else analysis.solo_rates(lines)
    print(f"  {name}: {wall:.1f} s, samples/s per pipeline "
          + ", ".join(f"{p}: {_report.rate(r)}" for p, r in rates.items()), flush=True)
    return rates


def speeds(args: argparse.Namespace) -> list[str]:
    common = [_scenarios.HETERO_STATIC, f"train.steps={args.steps}", "train.eval_every=0"]
    rows = ["| sync | pipeline 0 | pipeline 1 | pipeline 2 (slow) | slow / fast |",
            "|---|---|---|---|---|"]
    for sync in ("none", "sdpipe"):
        r = train(args.out, f"static-{sync}", [*common, f"sync={sync}"], args.timeout)
        ratio = r[2] / ((r[0] + r[1]) / 2)
        rows.append(f"| {sync} | {_report.rate(r[0])} | {_report.rate(r[1])} | {_report.rate(r[2])} | "
                    f"{_report.num(ratio, '.2f')} |")
    return rows


def partition(args: argparse.Namespace) -> list[str]:
    from sdpipe_cli.config import measurements as prof
    from sdpipe_cli.config.composition import compose
    from sdpipe_cli.config.schema import n_blocks
    from sdpipe_cli.core import partition as part
    from sdpipe_cli.core.plan import RunPlan

    prof_dir = args.out / "profile"
    run_command("profile", [*PARTITION_RUN, f"run.dir={prof_dir}"], args.out / "profile.log",
                args.timeout).check("sdpipe profile")
    path = prof_dir / "profile.json"
    cfg = compose([*PARTITION_RUN, f"profile={path}"])
    cost = part.device_cost(prof.worker_block_ms(prof.load(path), RunPlan.resolve(cfg).cluster, []))
    plan = part.plan(cost, n_blocks(cfg.model), 2)
    print(f"  plan: uniform {plan.uniform_bounds} {[round(t, 2) for t in plan.uniform_times]} ms, "
          f"auto {plan.bounds} {[round(t, 2) for t in plan.times]} ms", flush=True)
    common = [*PARTITION_RUN, f"train.steps={args.steps}", "train.eval_every=0", "sync=none"]
    uniform = train(args.out, "partition-uniform", [*common, "pipeline.partition=uniform"],
                    args.timeout, steady=True)
    auto = train(args.out, "partition-auto", [*common, "pipeline.partition=auto", f"profile={path}"],
                 args.timeout, steady=True)
    total_u, total_a = sum(uniform.values()), sum(auto.values())
    return ["| partition | boundaries | predicted stage ms (fwd+bwd, slowest replica) | "
            "samples/s (sum of medians) |",
            "|---|---|---|---|",
            f"| uniform | {plan.uniform_bounds} | {', '.join(map(_report.ms, plan.uniform_times))} "
            f"| {_report.rate(total_u)} |",
            f"| auto | {plan.bounds} | {', '.join(map(_report.ms, plan.times))} | "
            f"{_report.rate(total_a)} |",
            "",
            f"predicted gain {_report.ratio(plan.speedup)}, measured {_report.ratio(total_a / total_u)}"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=False)
    report = []
    if args.only in (None, "speeds"):
        print("speeds: cluster=hetero_static", flush=True)
        report += ["**speeds** (`cluster=hetero_static`, "
                   f"{args.steps} steps)", "", *speeds(args), ""]
    if args.only in (None, "partition"):
        print("partition: stage 1 on half-speed devices", flush=True)
        report += ["**partition** (P=2, S=2, gpt_tiny, stage 1 at speed 0.5, measured emulation, "
                   f"sync=none, {args.steps} steps)", "", *partition(args)]
    text = "\n".join(report)
    (args.out / "report.md").write_text(text + "\n")
    print(text)
    if args.markdown is not None:
        print(f"markdown: {_report.write_markdown(args.markdown, text)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
