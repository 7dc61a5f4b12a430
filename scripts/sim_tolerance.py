"""How smoothly sdpipe tolerates heterogeneity, simulated: one pipeline r times slower, r from 1.0
to 4.0, against the limit and all-reduce.

The real runs of ``bench_tolerance.py`` take minutes a ratio; the simulator (the real group policy
with modelled workers, :mod:`sdpipe_cli.core.simulation`) maps the whole range in about a minute
and shows where the policy waits. The workload is the one the real runs use: gpt_tiny on the
stdlib corpus, P=4 pipelines of S=2 stages, 10 ms of modelled forward per micro-batch, 200 steps,
the last pipeline r times slower (``cluster.slowdown=[1,1,1,r]``), the ``simulate`` section's
default transport costs and jitter. Per ratio:

* ``of the limit``: samples/s over the sum of the pipelines' solo rates (``sync=none``), for
  sdpipe and all-reduce;
* ``slow pace``: the slow pipeline's iterations over the fast ones' mean, times r: 1.00 when it
  runs at its own speed, below when it waits for them, above when they wait for it (r when
  they all go at its pace);
* ``fast pace``: the fast pipelines' iterations per second over their solo rate: 1.00 when
  nobody holds them;
* ``drift``: the simulator's model of how far replicas drift apart (``Result.consensus``: unit
  noise per local step, averaged as the groups average), sdpipe's beside all-reduce's;
* ``group``: sdpipe's mean group size.

Prints a markdown table; ``--markdown PATH`` also writes it::

    python scripts/sim_tolerance.py --markdown docs/results/tolerance_sim.md
    python scripts/sim_tolerance.py --ratios 1.3,2 --steps 100      # a smoke test
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402  (sibling modules, not a package)

from sdpipe_cli.cli import preparing  # noqa: E402
from sdpipe_cli.config.composition import compose  # noqa: E402
from sdpipe_cli.config.validation import validate  # noqa: E402
from sdpipe_cli.hetero import simulated_run  # noqa: E402

BASE = ["model=gpt_tiny", "data=stdlib", "cluster.pipelines=4", "pipeline.stages=2",
        "cluster.device=cpu", "cluster.compute_ms=10", "sync=sdpipe"]


def ratios(text: str) -> list[float]:
    if text != "map":
        return [float(x) for x in text.split(",")]
    return [round(1.0 + 0.1 * i, 1) for i in range(31)]


def simulate(ratio: float, steps: int, extra: list[str]) -> dict:
    cfg = compose([*BASE, f"cluster.slowdown=[1,1,1,{ratio}]", f"train.steps={steps}", *extra])
    validate(cfg)
    cfg = preparing.prepare(cfg)[0]
    return simulated_run.run(cfg, compare=["allreduce"])


def row(ratio: float, doc: dict) -> str:
    solo, its = doc["solo_samples_per_s"], doc["iterations"]
    fast = sum(its[:-1]) / (len(its) - 1)
    slow_pace = its[-1] / max(fast, 1e-9) * ratio
    # the fast pipelines' rate in the run (their iterations over the run's wall time; the
    # budget's end is shared, so each runs to about the end) against their solo rate
    batch = doc["config"]["train"]["batch_size"]
    fast_rate = sum(its[:-1]) * batch / doc["wall_s"] / sum(solo[:-1])
    allreduce = doc["compare"][0]
    return (f"| {ratio:.1f} | {_report.num(doc['fraction_of_limit'], '.2f')} | "
            f"{_report.num(allreduce['fraction_of_limit'], '.2f')} | {slow_pace:.2f} | "
            f"{fast_rate:.2f} | {_report.num(doc['consensus'], '.2f')} | "
            f"{_report.num(allreduce['consensus'], '.2f')} | "
            f"{_report.num(doc['mean_group_size'], '.2f')} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ratios", default="map", help="comma-separated, or 'map': 1.0 to 4.0 by 0.1")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--set", nargs="*", default=[], help="more overrides (e.g. sync.patience=0.2)")
    p.add_argument("--markdown", type=Path)
    args = p.parse_args()
    started = time.perf_counter()
    lines = ["| slowest | sdpipe, of the limit | all-reduce | slow pace | fast pace | "
             "drift, sdpipe | drift, all-reduce | group |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for ratio in ratios(args.ratios):
        lines.append(row(ratio, simulate(ratio, args.steps, args.set)))
        print(lines[-1], flush=True)
    text = "\n".join(lines) + (f"\n\n(P=4, S=2, gpt_tiny, 10 ms, {args.steps} steps; "
                               f"simulated in {time.perf_counter() - started:.0f} s)\n")
    if args.markdown:
        _report.write_markdown(args.markdown, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
