"""Simulator fingerprints: a refactoring check for the scheduling policy and the run plan.

The simulator drives the real group policy (:mod:`sdpipe_cli.core.grouping`) and the real run
preparation (:func:`sdpipe_cli.cli.preparing.prepare`) with modelled time, so a change that is meant
to keep behaviour must keep, on every configuration below, each variant's iterations, group sizes,
finish times and samples/s. Run it before and after the change::

    python scripts/sim_fingerprint.py --out /tmp/fp_before.json
    ... change ...
    python scripts/sim_fingerprint.py --against /tmp/fp_before.json   # exit 1 on any difference

It takes about a minute on two cores; nothing is trained.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scenarios import HETERO_MIXED, HETERO_RANDOM, HETERO_STATIC, slowdown, slowdowns  # noqa: E402

from sdpipe_cli.cli import preparing  # noqa: E402
from sdpipe_cli.config.composition import compose  # noqa: E402
from sdpipe_cli.config.validation import validate  # noqa: E402
from sdpipe_cli.hetero import simulated_run  # noqa: E402

#: (overrides, variants compared). Every sync mode, the three schedules, static, random and mixed
#: heterogeneity (``_scenarios.py``), and a P=8 S=1 run. The overrides, joined by spaces, name a
#: configuration in a fingerprint file: keep them as they are.
CONFIGS: list[tuple[list[str], list[str]]] = [
    (["cluster.pipelines=4", "cluster.compute_ms=10", "train.steps=60"], []),
    (["cluster.pipelines=4", "cluster.compute_ms=10", slowdown(slowdowns("straggler", 4)),  # [1,1,1,3]
      "train.steps=60"], []),
    (["cluster.pipelines=8", "pipeline.stages=1", "cluster.compute_ms=5",
      slowdown(slowdowns("mixed", 4) * 2), "train.steps=40"], []),  # [1,1,2,4,1,1,2,4]
    ([HETERO_RANDOM, "train.steps=40"], []),
    ([HETERO_STATIC, "train.steps=40", "sync=ps"], ["allreduce", "sdpipe"]),
    (["cluster.pipelines=4", "cluster.compute_ms=10", "sync=diloco", "train.steps=48"], []),
    (["cluster.pipelines=6", "cluster.compute_ms=8", "pipeline.schedule=gpipe", "train.steps=30"], []),
    (["cluster.pipelines=4", "cluster.compute_ms=10", "sync=adpsgd", slowdown([1, 2, 1, 3]),
      "train.steps=40"], []),
    ([HETERO_MIXED, "train.steps=30", "sync.policy=classic"], ["allreduce", "none"]),
]
ALL = ["allreduce", "none", "ps", "adpsgd", "diloco"]
KEPT = ("sync", "iterations", "wall_s", "group_sizes", "finish_s", "samples_per_s", "mean_group_size")


def fingerprints() -> dict[str, dict]:
    out = {}
    for overrides, variants in CONFIGS:
        cfg = compose(["model=mlp", "data=synthetic", *overrides])
        validate(cfg)
        doc = simulated_run.run(preparing.prepare(cfg)[0], variants or ALL)
        rows = [doc, *doc["compare"]]
        kept = [{k: r[k] for k in KEPT if k in r} for r in rows]
        text = json.dumps(kept, sort_keys=True, default=str)
        out[" ".join(overrides)] = {"sha": hashlib.sha256(text.encode()).hexdigest()[:16], "rows": kept}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the fingerprints here")
    ap.add_argument("--against", type=Path, help="compare with fingerprints written before")
    args = ap.parse_args()
    now = fingerprints()
    for name, fp in now.items():
        print(fp["sha"], name)
    if args.out:
        args.out.write_text(json.dumps(now, indent=1, sort_keys=True))
    if args.against:
        before = json.loads(args.against.read_text())
        differ = [k for k in before.keys() | now.keys() if before.get(k, {}).get("sha") != now.get(k, {}).get("sha")]
        for k in differ:
            print(f"DIFFERS: {k}")
        print(f"{len(now) - len(differ)} of {len(now)} configurations identical")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
