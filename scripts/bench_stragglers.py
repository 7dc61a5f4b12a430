"""Slowdown detection (``fault.on_slowdown=warn``): how fast a device that slows mid-run is named,
whether anything else is, and what timing every worker's compute costs.

Run it from the repository root::

    python scripts/bench_stragglers.py --out runs/bench-stragglers            # 3 seeds, ~6 min
    python scripts/bench_stragglers.py --out /tmp/s --seeds 0 --pairs 1 --steps 60   # a smoke test

P=4 pipelines of S=4 stages of a 16-block model (``model=mlp model.n_layers=14``: its real
compute is small beside the modelled ``cluster.compute_ms``, so 16 workers on a small machine
keep to the model; ``overruns`` says how often they did not). Scenarios, per seed:

* ``slowdown``: device ``local:9`` (pipeline 2, stage 1) slows to speed 0.25 at ``--at`` seconds
  of the run clock (``cluster.changes``), about a third of the way in. Its lag is the iterations
  of that device from its first slow one (compute over twice its start's) to the straggler line;
* ``equal`` and ``[1,1,1,3]`` (``cluster.slowdown``: the last pipeline 3x slower from the start,
  which is the plan, not a slowdown): every straggler line there is a false alarm.

Cost: ``--pairs`` pairs of ``equal`` runs with ``fault.on_slowdown=warn`` and ``off`` in one
invocation, each pair in the other order than the one before; the ratio of their samples/s
(median over pairs). ``--seeds ""`` measures the cost alone.

Prints markdown tables; with ``--markdown PATH`` also writes them, stamped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402  (sibling modules, not a package)
import _scenarios  # noqa: E402
from _runner import run_sdpipe  # noqa: E402

from sdpipe_cli import analysis  # noqa: E402

DEVICE, PIPELINE, STAGE = "local:9", 2, 1
MICROBATCHES = 4  # the default pipeline.microbatches
BASE = ["model=mlp", "model.n_layers=14", "data=synthetic", "cluster.pipelines=4",
        "pipeline.stages=4", "train.eval_every=0", "sync=sdpipe"]


def lines_of(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def lag(lines: list[dict], window: int = 5, warmup: int = 3):
    """(first slow iteration of the slowed device, the straggler line's iteration) or Nones."""
    busy = {m["step"]: m["busy_s"] for m in lines if m["kind"] == "sync"
            and m["pipeline"] == PIPELINE and m["stage"] == STAGE and "busy_s" in m}
    steps = sorted(busy)
    if len(steps) < warmup + window:
        return None, None
    start = statistics.median(busy[k] for k in steps[warmup:warmup + window])
    slow = next((k for k in steps if busy[k] > 2 * start), None)
    named = [m for m in lines if m["kind"] == "straggler" and m["device"] == DEVICE]
    return slow, named[0]["iteration"] if named else None


def one(out: Path, name: str, overrides: list[str], timeout: float) -> list[dict]:
    run = out / name
    code, _ = run_sdpipe([f"run.dir={run}", *BASE, *overrides], out / f"{name}.log", timeout)
    if code != 0:
        raise SystemExit(f"{name} failed (exit {code}): see {out / (name + '.log')}")
    return lines_of(run)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--compute-ms", type=float, default=10.0)
    parser.add_argument("--at", type=float, default=12.0, help="run-clock seconds of the slowdown")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    _report.add_markdown_option(parser)
    args = parser.parse_args()
    out = args.out.absolute()
    out.mkdir(parents=True, exist_ok=False)
    common = [f"train.steps={args.steps}", f"cluster.compute_ms={args.compute_ms}"]
    rows = []
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        seeded = [*common, f"train.seed={seed}"]
        for scenario, extra in (
                ("slowdown", [f"cluster.changes=[{{device: '{DEVICE}', speed: 0.25, start: {args.at}}}]"]),
                ("equal", []), ("[1,1,1,3]", [_scenarios.slowdown(_scenarios.slowdowns("straggler", 4))])):
            lines = one(out, f"{scenario.strip('[]').replace(',', '')}-seed{seed}", [*seeded, *extra],
                        args.timeout)
            named = [m for m in lines if m["kind"] == "straggler"]
            wrong = [m for m in named if scenario != "slowdown" or m["device"] != DEVICE]
            slow, at = lag(lines) if scenario == "slowdown" else (None, None)
            rows.append({"scenario": scenario, "seed": seed,
                         "samples/s": round(analysis.samples_per_s(lines), 1),
                         "first slow iteration": slow, "named at": at,
                         "lag (iterations)": None if slow is None or at is None else at - slow,
                         "false alarms": len(wrong),
                         "overruns": _report.percent(analysis.overrun_fraction(lines, MICROBATCHES))})
    cost = []
    for pair in range(args.pairs):
        rates = {}
        for setting in ("warn", "off") if pair % 2 == 0 else ("off", "warn"):  # no order bias
            lines = one(out, f"cost-{setting}-{pair}", [*common, f"fault.on_slowdown={setting}"],
                        args.timeout)
            rates[setting] = analysis.samples_per_s(lines)
        cost.append({"pair": pair, "warn samples/s": round(rates["warn"], 1),
                     "off samples/s": round(rates["off"], 1),
                     "warn / off": round(rates["warn"] / rates["off"], 4)})
    ratio = statistics.median(r["warn / off"] for r in cost) if cost else None
    text = (_report.rows_table(rows) + "\n" + _report.rows_table(cost) +
            (f"\n\nwarn / off, median of {len(cost)} pairs: {ratio:.4f}\n" if cost else "\n"))
    print(text)
    if args.markdown:
        _report.write_markdown(args.markdown, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
