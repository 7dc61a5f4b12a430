"""Tolerance across the range of heterogeneity, in real runs: samples/s against the limit, the loss
at equal samples and the time to all-reduce's loss, one pipeline 1.1x to 3x slower, and two.

Run it from the repository root after ``pip install -e .``::

    python scripts/bench_tolerance.py --out runs/tolerance                       # ~1 hour
    python scripts/bench_tolerance.py --out /tmp/t --ratios 1.3 --seeds 0 --pairs ""   # a smoke test
    python scripts/bench_tolerance.py --variants none,allreduce,sdpipe,sdpipe-before \\
        --before ../sdpipe-before      # also an older checkout's sdpipe, in the same session

Each pattern is a ``cluster.slowdown``: ``--ratios`` r gives ``[1,1,1,r]`` (one slow pipeline),
``--pairs`` ``a:b`` gives ``[1,1,a,b]``, and ``equal`` (``[1,1,1,1]``) is always run. Each runs
every variant and seed as :mod:`bench_convergence` runs one (gpt_tiny on the stdlib corpus, P=4,
S=2, 10 ms of modelled compute, 200 steps, the default learning rate), and is judged as it judges
one: per seed against that seed's all-reduce and the limit (``sync=none``: the pipelines' solo
rates summed). The table gives, per pattern and variant, the mean over seeds of:

* ``of limit``: samples/s over the limit (with the 95 % t-interval's half-width);
* ``val vs all-reduce``: final validation loss over all-reduce's (equal samples);
* ``vs ideal``: the time to all-reduce's final loss over all-reduce's, as a multiple of the
  ideal, all-reduce's samples/s over the limit (1.0: nothing lost per sample, no device idle);
* ``slow pace``: the slowest pipeline's iterations over the fastest's, times its slowdown
  against the fastest (1.00: it ran at its own speed; lower: it waited);
* ``group``: mean group size.

Writes ``OUT/results.md`` (stamped) and ``OUT/results.json``, and ``sdpipe report`` of every run
into ``OUT/report/``, whose ``tolerance.png`` is the fraction of the limit against the slowest
pipeline's slowdown, per variant.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402  (sibling modules, not a package)
import bench_convergence as convergence  # noqa: E402


def patterns(ratios: str, pairs: str) -> list[list[float]]:
    out = [[1.0, 1.0, 1.0, 1.0]]
    out += [[1.0, 1.0, 1.0, float(r)] for r in ratios.split(",") if r]
    for pair in (p for p in pairs.split(",") if p):
        a, b = (float(x) for x in pair.split(":"))
        out.append([1.0, 1.0, a, b])
    return out


def name_of(factors: list[float]) -> str:
    return "[" + ",".join(f"{f:g}" for f in factors) + "]"


def slow_pace(record: dict, factors: list[float]) -> float | None:
    """The slowest pipeline's iterations over the fastest's, times their speed ratio."""
    last = record.get("iterations") or {}
    done = [last.get(p, last.get(str(p))) for p in range(len(factors))]
    if None in done:
        return None
    slow = max(range(len(factors)), key=lambda p: (factors[p], p))
    fast = min(range(len(factors)), key=lambda p: (factors[p], p))
    return done[slow] / max(done[fast], 1) * factors[slow] / factors[fast]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ratios", default="1.1,1.3,1.6,2,3")
    p.add_argument("--pairs", default="1.3:1.6", help="two slow pipelines, a:b[,a:b...]")
    p.add_argument("--variants", default="none,allreduce,sdpipe")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--before", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("runs/bench_tolerance"))
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--reuse", default="", help="variants whose runs already in OUT (ended well) "
                   "are read rather than run again, e.g. none,allreduce after a change to sdpipe")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    console = Console(stderr=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, doc = [], {"patterns": []}
    for factors in patterns(args.ratios, args.pairs):
        name = name_of(factors)
        out = args.out / name.strip("[]").replace(",", "-")
        out.mkdir(parents=True, exist_ok=True)
        run_args = SimpleNamespace(
            pipelines=4, stages=2, steps=args.steps, compute_ms=10.0, slow=1.0, eval_every=20,
            extra=[f"cluster.slowdown={name}"], out=out, seeds=seeds, before=args.before,
            timeout=args.timeout, reuse=[v for v in args.reuse.split(",") if v])
        summaries = []
        for seed in seeds:
            records = [convergence.run(run_args, "equal", v, args.lr, console, seed)
                       for v in variants]
            for r in records:
                r["slow_pace"] = slow_pace(r, factors) if r["status"] == "ok" else None
            summaries.append(convergence.summarize("equal", records))
        stats = convergence.across_seeds(summaries)
        paces = {v: [r["slow_pace"] for s in summaries for r in s["runs"]
                     if r["variant"] == v and r.get("slow_pace") is not None] for v in variants}
        doc["patterns"].append({"slowdown": factors, "summaries": summaries, "stats": stats})
        for v in variants:
            got = stats.get(v, {})
            pace = paces.get(v) or []
            groups = [r["mean_group_size"] for s in summaries for r in s["runs"]
                      if r["variant"] == v and r.get("mean_group_size")]
            rows.append({"slowdown": name, "sync": v, "of limit": spread(got.get("of limit")),
                         "val vs all-reduce": spread(got.get("val vs allreduce"), ".3f"),
                         "vs ideal": spread(got.get("vs ideal")),
                         "slow pace": f"{sum(pace) / len(pace):.2f}" if pace else "-",
                         "group": f"{sum(groups) / len(groups):.2f}" if groups else "-"})
            console.print(" | ".join(rows[-1].values()), highlight=False)
    table = _report.rows_table(rows)
    (args.out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    (args.out / "results.md").write_text(_report.stamp() + "\n\n" + table + "\n")
    figure([Path(r["run_dir"]) for pattern in doc["patterns"] for summary in pattern["summaries"]
            for r in summary["runs"] if r["status"] == "ok"], args.out / "report")
    print(table)
    return 0


def spread(stat, digits: str = ".2f") -> str:
    """A mean over seeds and its 95 % interval's half-width (``across_seeds``' tuples)."""
    if not stat:
        return "-"
    mean, _, half, n = stat
    return f"{mean:{digits}}" + (f" +- {half:{digits}}" if n > 1 else "")


def figure(runs: list[Path], out: Path) -> None:
    """``sdpipe report`` of every run: its ``tolerance.png`` is the fraction of the limit against
    the slowest pipeline's slowdown, per sync mode (the mean over seeds)."""
    from _runner import run_command

    run_command("report", [*map(str, runs), "--out", str(out)], out.parent / "report.log",
                600).check()


if __name__ == "__main__":
    raise SystemExit(main())
