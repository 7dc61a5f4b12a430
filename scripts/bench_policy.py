"""Policy efficiency: real runs and the simulator side by side, against the heterogeneity limit.

Run it from the repository root after ``pip install -e .``::

    python scripts/bench_policy.py --markdown runs/policy.md
    python scripts/bench_policy.py --patterns 1113 --variants none,cost_aware --steps 10  # smoke

**What it runs.** For each cluster pattern and each variant, one real ``sdpipe train`` of the small
MLP (``model=mlp data=synthetic``, P=4, S=2, modelled compute of ``--compute-ms`` per forward) and
the same config in ``sdpipe simulate`` (in this process, :mod:`sdpipe_cli.hetero.simulated_run`).
Patterns: ``1113`` and ``1124`` (``cluster.slowdown``), ``random`` (``cluster=hetero_random``: each
iteration a worker is 3x slower with probability 0.1), ``mixed`` (``cluster=hetero_mixed``: two
device generations on two nodes, a speed change, slow cross-node links), ``equal``, ``slowlinks``
(``cluster=slow_links``: four machines over a slow link, one 3x slower). Variants: ``none``
(gives the limit), ``allreduce``, ``classic`` (``sync.policy=classic``, the previous rule),
``cost_aware`` (``sync.policy=cost_aware``, the default) and ``every1`` (sdpipe meeting every
iteration in float32, whatever the links).

**What it reports**, per pattern: samples/s of the real run (all pipelines, first to last train
line) and its fraction of the real limit (the sum of each pipeline's solo rate in the real
``none`` run), as ``sdpipe_cli.analysis`` defines them; the simulator's samples/s and
fraction of its own limit; the error of the simulated fraction against the real one; the final validation loss (equal
samples: every run trains P x steps pipeline-iterations) and the mean group size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402  (sibling modules, not a package)
import _scenarios  # noqa: E402
from _runner import classify, microbatches, run_sdpipe  # noqa: E402

from sdpipe_cli import analysis  # noqa: E402

STRAGGLER = _scenarios.slowdown(_scenarios.slowdowns("straggler", 4))  # cluster.slowdown=[1,1,1,3]
PATTERNS = {
    "1113": [STRAGGLER],
    "1124": [_scenarios.slowdown(_scenarios.slowdowns("mixed", 4))],  # [1,1,2,4]
    "random": [_scenarios.HETERO_RANDOM],
    "mixed": [_scenarios.HETERO_MIXED],
    "equal": [],
    # four machines over a slow link (docs/CLUSTERS.md), one 3x slower; with
    # --extra model=gpt_tiny data=stdlib, the slow-link benchmark's workload (docs/SYNC.md)
    "slowlinks": [_scenarios.SLOW_LINKS, STRAGGLER],
}
VARIANTS = {
    "none": ["sync=none"],
    "allreduce": ["sync=allreduce"],
    "classic": ["sync=sdpipe", "sync.policy=classic"],
    "cost_aware": ["sync=sdpipe", "sync.policy=cost_aware"],
    "every1": ["sync=sdpipe", "sync.every=1", "sync.precision=fp32"],  # meetings every iteration
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--patterns", default=",".join(PATTERNS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--compute-ms", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=Path("runs/bench-policy"))
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--extra", nargs="*", default=[], metavar="OVERRIDE")
    _report.add_markdown_option(p)
    args = p.parse_args(argv)
    args.patterns = [x for x in args.patterns.split(",") if x]
    args.variants = [x for x in args.variants.split(",") if x]
    bad = [x for x in args.patterns if x not in PATTERNS] + [x for x in args.variants if x not in VARIANTS]
    if bad:
        p.error(f"unknown pattern or variant: {', '.join(bad)}")
    return args


def overrides(args, pattern: str, variant: str) -> list[str]:
    base = ["model=mlp", "data=synthetic", f"train.steps={args.steps}",
            f"cluster.compute_ms={args.compute_ms:g}", "cluster.device=cpu",
            f"train.eval_every={max(1, args.steps // 4)}"]
    if pattern not in ("random", "mixed"):
        base.append("cluster.pipelines=4")
    return [*PATTERNS[pattern], *base, *VARIANTS[variant], *args.extra]


def simulated(ovr: list[str]) -> dict[str, Any]:
    from sdpipe_cli.cli.preparing import prepare
    from sdpipe_cli.config.composition import compose
    from sdpipe_cli.config.validation import validate
    from sdpipe_cli.hetero import simulated_run

    cfg = compose(ovr)
    validate(cfg)
    doc = simulated_run.run(prepare(cfg)[0])
    return {"samples_per_s": doc["samples_per_s"], "fraction": doc["fraction_of_limit"],
            "limit": doc["limit_samples_per_s"], "mean_group": doc["mean_group_size"]}


def measure(args, pattern: str, console: Console) -> list[dict[str, Any]]:
    rows = []
    for variant in args.variants:
        ovr = overrides(args, pattern, variant)
        name = f"{pattern}-{variant}"
        run_dir, log = (args.out / name).resolve(), args.out / f"{name}.log"
        console.print(f"{name}: running", highlight=False)
        code, wall = run_sdpipe([*ovr, f"run.dir={run_dir}"], log, args.timeout)
        row: dict[str, Any] = {"pattern": pattern, "variant": variant, "wall_s": wall}
        row["status"], row["error"] = classify(code, log, args.timeout)
        if row["status"] == "ok":
            lines = analysis.read_metrics(run_dir / "metrics.jsonl")
            mode = "sdpipe" if variant in ("classic", "cost_aware", "every1") else variant
            row.update(analysis.analyse(lines, mode, 4, microbatches(run_dir)))
            row["solo_rates"] = analysis.solo_rates(lines)
        row["sim"] = simulated(ovr)
        rows.append(row)
    limit = next((analysis.limit(r["solo_rates"]) for r in rows
                  if r["variant"] == "none" and r.get("solo_rates")), None)
    for r in rows:
        r["fraction"] = analysis.fraction_of_limit(r.get("samples_per_s"), limit)
        r["limit"] = limit
    return rows


HEADER = ("variant", "real samples/s", "real of limit", "sim samples/s", "sim of limit",
          "sim error", "final val", "mean group")


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in rows:
        sim = r["sim"]
        err = (sim["fraction"] / r["fraction"] - 1) if r.get("fraction") else None
        out.append([r["variant"] if r["status"] == "ok" else f"{r['variant']} ({r['status']})",
                    _report.rate(r.get("samples_per_s")), _report.num(r.get("fraction"), ".2f"),
                    _report.rate(sim["samples_per_s"]), _report.num(sim["fraction"], ".2f"),
                    _report.percent(err, 0, sign=True),
                    _report.loss(r.get("final_val_loss")), _report.num(r.get("mean_group_size"), ".2f")])
    return out


def title(pattern: str, rows: list[dict[str, Any]], args) -> str:
    limit = rows[0].get("limit")
    sim_limit = rows[0]["sim"]["limit"]
    return (f"{pattern}: {' '.join(PATTERNS[pattern]) or 'equal pipelines'}, {args.steps} steps, "
            f"compute {args.compute_ms:g} ms; limit: real {_report.rate(limit)}, "
            f"simulated {_report.rate(sim_limit)} samples/s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    args.out.mkdir(parents=True, exist_ok=True)
    parts = []
    for pattern in args.patterns:
        rows = measure(args, pattern, console)
        table = Table(title=title(pattern, rows, args))
        for h in HEADER:
            table.add_column(h, justify="left" if h == "variant" else "right")
        body = table_rows(rows)
        for line in body:
            table.add_row(*line)
        console.print(table)
        parts.append(f"**{title(pattern, rows, args)}**\n\n| {' | '.join(HEADER)} |\n"
                     f"|{'---|' * len(HEADER)}\n" + "\n".join(f"| {' | '.join(x)} |" for x in body))
    if args.markdown:
        path = _report.write_markdown(Path(args.markdown), "\n\n".join(parts))
        console.print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
