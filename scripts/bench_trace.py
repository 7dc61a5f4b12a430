"""What ``run.trace=true`` costs: per recorded event, and in a run's samples/s.

Run it from the repository root after ``pip install -e .``::

    python scripts/bench_trace.py                 # 3 pairs of runs, 80 steps each
    python scripts/bench_trace.py --pairs 1 --steps 10 --out /tmp/bt   # a smoke test

**Per event.** The tracer's executor hooks (``before_action`` then ``on_action``, which records
a wait and a compute span) and a plain span, timed over many calls in this process.

**Per run.** ``sdpipe train`` (P = 2, S = 2, the MLP, real compute: nothing emulated, so the
tracer's cost is not hidden inside a modelled sleep), alternately without and with
``run.trace=true``, ``--pairs`` times; each run's ``samples_per_s`` from its ``summary.json``.
Runs alternate so that a change in the machine's load hits both alike; the ratio of the medians
is the figure. With ``run.trace=false`` no hook is installed: the only difference in the code
path is a ``None`` check per update.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runner import run_command  # noqa: E402  (a sibling module, not a package)


def per_event_us(calls: int = 200_000) -> dict[str, float]:
    from sdpipe_cli.core.schedule import Action
    from sdpipe_cli.runtime.trace import Tracer

    t = Tracer(0, "rank 0", time.time, capacity=50_000)
    action = Action("F", 0)
    start = time.perf_counter()
    for _ in range(calls):
        t.before_action(action)
        t.computed(action, 0.0, time.time())
    hooks = (time.perf_counter() - start) / calls * 1e6
    start = time.perf_counter()
    for _ in range(calls):
        t.span("clip", "update", 0.0, 1.0)
    span = (time.perf_counter() - start) / calls * 1e6
    return {"hooks_per_action_us": hooks, "span_us": span}


def run(out: Path, steps: int, trace: bool) -> float:
    run_dir = out / f"{'on' if trace else 'off'}-{time.monotonic_ns()}"
    run_command("train", [f"run.dir={run_dir}", "model=mlp", "data=synthetic", "cluster.pipelines=2",
                          "pipeline.stages=2", f"train.steps={steps}", "train.eval_every=0",
                          "cluster.device=cpu", f"run.trace={str(trace).lower()}"],
                None, 600).check("run", chars=2000)
    return json.loads((run_dir / "summary.json").read_text())["samples_per_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-trace"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    micro = per_event_us()
    off, on = [], []
    for _ in range(args.pairs):
        off.append(run(args.out, args.steps, trace=False))
        on.append(run(args.out, args.steps, trace=True))
    result = {**{k: round(v, 2) for k, v in micro.items()},
              "samples_per_s_off": [round(x, 1) for x in off],
              "samples_per_s_on": [round(x, 1) for x in on],
              "on_over_off": round(statistics.median(on) / statistics.median(off), 3)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
