"""sdpipe on slow links at GPT-2 scale, simulated: samples/s against the limit, bytes per sample.

Real runs of GPT-2 small on four machines of four GPUs do not fit this machine, so the simulator
(:mod:`sdpipe_cli.core.simulation`, the real group policy with modelled workers) takes them: four
machines of four GPUs, one pipeline of S=4 stages per machine, so every meeting of a stage's
replicas crosses machines; the last machine 3x slower; GPU-like transport costs; 20 ms of
modelled forward per micro-batch; the link between machines at 1, 10 and 100 Gbit/s. Each row is
one sync mode beside the limit (``sync=none``: every pipeline at its own pace, summed); sdpipe
twice, with its meetings chosen from the link (the default) and meeting every iteration in float32
(as before slow-link meetings); diloco twice, in float32 and with its outer gradient in bfloat16.
It prints a markdown table (and writes it with ``--markdown``)::

    python scripts/sim_slow_links.py --markdown /tmp/sim_slow_links.md
    python scripts/sim_slow_links.py --steps 1000    # a longer run: the end weighs less

Seconds on two cores; nothing is trained.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402  (sibling modules, not a package)
import _scenarios  # noqa: E402

from sdpipe_cli.cli import preparing  # noqa: E402
from sdpipe_cli.config.composition import compose  # noqa: E402
from sdpipe_cli.config.validation import validate  # noqa: E402
from sdpipe_cli.hetero import simulated_run  # noqa: E402

NODES = ("cluster.nodes=[" + ", ".join(
    f"{{name: m{i}, devices: [{{}}, {{}}, {{}}, {{}}]}}" for i in range(4)) + "]")
BASE = ["model=gpt_small", "data=stdlib", "cluster.pipelines=4", "pipeline.stages=4",
        "cluster.device=cpu", "cluster.compute_ms=20",
        _scenarios.slowdown(_scenarios.slowdowns("straggler", 4)),  # the last machine 3x slower
        "simulate.collective_ms=0.1", "simulate.p2p_ms=0.05", "simulate.rtt_ms=0.3",
        "simulate.jitter=0.02", NODES, "cluster.links.same_node.latency_ms=0.005",
        "cluster.links.same_node.bandwidth_gbps=400", "cluster.links.cross_node.latency_ms=0.05"]
ROWS = [("sdpipe (default)", "sdpipe", []),
        ("sdpipe, rounds merged a step late", "sdpipe", ["sync.overlap=1"]),
        ("sdpipe, every iteration in fp32", "sdpipe", ["sync.every=1", "sync.precision=fp32"]),
        ("allreduce", "allreduce", []), ("diloco (H=8)", "diloco", []),
        ("diloco (H=8), bf16", "diloco", ["sync.precision=bf16"])]


def simulate(gbps: float, sync: str, extra: list[str], steps: int) -> dict:
    cfg = compose([*BASE, f"cluster.links.cross_node.bandwidth_gbps={gbps}", f"sync={sync}",
                   f"train.steps={steps}", *extra])
    validate(cfg)
    cfg = preparing.prepare(cfg)[0]
    doc = simulated_run.run(cfg)
    doc["every"], doc["precision"] = cfg.sync.get("every"), cfg.sync.get("precision")
    return doc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gbps", default="1,10,100", help="cross-machine bandwidths, Gbit/s")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args()
    started = time.perf_counter()
    lines = ["| link | sync | meetings | samples/s | of the limit | sent/sample (kB) | comm |",
             "|---|---|---|---|---|---|---|"]
    for gbps in [float(x) for x in args.gbps.split(",")]:
        for label, sync, extra in ROWS:
            doc = simulate(gbps, sync, extra, args.steps)
            meet = (f"every {doc['every']}, {doc['precision']}" if sync == "sdpipe" else "-")
            lines.append(f"| {gbps:g} Gbit/s | {label} | {meet} | {_report.rate(doc['samples_per_s'])} | "
                         f"{_report.num(doc['fraction_of_limit'], '.2f')} | "
                         f"{_report.kilobytes(doc['sync_bytes_per_sample'])} | "
                         f"{_report.percent(doc['comm_share'], 0)} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + f"\n\n(simulated in {time.perf_counter() - started:.0f} s)\n"
    if args.markdown:
        args.markdown.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
