"""Samples/s of one pipeline under each flushed schedule, beside what its own timeline predicts.

Run it from the repository root after ``pip install -e .``::

    python scripts/bench_schedules.py                        # S = 4, m = 8, 20 ms a forward, 3 repeats
    python scripts/bench_schedules.py --repeats 1 --steps 6  # a smoke test
    python scripts/bench_schedules.py --slow 1:0.5           # stage 1's device 2x slower, partition=auto

The claim it checks: ZB-H1's split backward (``pipeline.schedule=zb_h1``) and interleaving
(``--schedules 1f1b,interleaved_1f1b,interleaved_zb``: ``pipeline.chunks=--chunks``) make a pipeline's
iteration shorter than 1F1B's by what its timeline says, no more, no less.

**What runs.** ``sdpipe train`` of one pipeline (``sync=allreduce cluster.pipelines=1``) of S
equal stages of the MLP (``model=mlp model.n_layers`` chosen so that each stage holds the same
number of blocks) on modelled compute: every forward of a stage sleeps ``--forward-ms`` and every
backward twice that (``cluster.compute_ms``), so that the run's time is the schedule's and not
this machine's; ZB-H1's (and interleaved zero bubble's) ``B`` and ``W`` take half a backward each; an interleaved
stage's chunk ``1 / chunks`` of a stage's forward or backward (the model then has a block per
piece, ``chunks x S``, for every schedule compared). Each run is ``--warmup +
--steps`` iterations; the schedules alternate ``--repeats`` times (their order flipped every
other round), so that a change in the machine's load hits both alike.

**What is measured.** The steady-state samples/s of the pipeline: the batch over each
iteration's ``step_s`` (the last stage's clock, from its control message to its update), the
median over the iterations after ``--warmup`` (``sdpipe_cli.analysis.steady_rates``'s rule).

**What is predicted.** ``core.schedule.tick_order`` runs the same action lists on a clock of
one tick per forward: 1F1B's backward two ticks, ZB-H1's ``B`` and ``W`` one each. An iteration
then takes ``ticks x forward`` and the pipeline does ``batch / (ticks x forward)`` samples/s. The
update, the flush's control messages and the p2p transfers are not in it: the measured rate is
below the predicted one by their share, for both schedules alike. ``sdpipe simulate`` of the same
overrides runs the same action lists on the same modelled compute, with those costs in: its
samples/s is the second prediction (``simulated``), against which each schedule's measured rate
should fall within a few per cent.

**A slower device** (``--slow STAGE:SPEED``). The pipeline's devices are given in the cluster
(``cluster.nodes``, the one at ``STAGE`` at ``SPEED``), the model has four blocks a stage
(``--blocks-per-stage``), and compute is modelled from a profile (every block ``--forward-ms``
/ 4 forward, twice that
backward; ``cluster.emulation=modelled``) so that ``pipeline.partition=auto`` can balance the
blocks over the devices' speeds, as a user's profiled run does. The stages are then uneven, so
the tick model (one length per kind) predicts nothing and only ``sdpipe simulate``'s prediction,
which times each stage's own actions, is given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _report  # noqa: E402
import _runner  # noqa: E402
import _scenarios  # noqa: E402

from sdpipe_cli.analysis import read_metrics  # noqa: E402
from sdpipe_cli.core.interleaved import CHUNKED_SCHEDULES, schedule_of  # noqa: E402
from sdpipe_cli.core.schedule import Kind, tick_order  # noqa: E402

BACKWARD_TICKS = {"1f1b": {Kind.B: 2}, "gpipe": {Kind.B: 2}, "zb_h1": {}, "interleaved_1f1b": {Kind.B: 2},
                  "interleaved_zb": {}}


def chunks_of(schedule: str, chunks: int) -> int:
    return chunks if schedule in CHUNKED_SCHEDULES else 1


def predicted_ticks(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """An iteration's length in stage-forwards: its ticks, a forward one tick and a backward two
    (split: one and one), a tick being a chunk's share of a stage's forward (1 / chunks)."""
    v = chunks_of(schedule, chunks)
    rows = tick_order(schedule_of(schedule, v), stages, microbatches, BACKWARD_TICKS[schedule],
                      chunks=v)
    return len(rows[0]) / v


def simulated_rate(overrides: list[str], run_dir: Path, log: Path, timeout: float) -> float:
    """``sdpipe simulate OVERRIDES``'s samples/s (the same run, its timeline from the same lists)."""
    run = _runner.run_command("simulate", [*overrides, f"run.dir={run_dir}"], log, timeout)
    run.check("sdpipe simulate")
    return float(json.loads((run_dir / "simulation.json").read_text())["samples_per_s"])


def slow_overrides(slow: str, stages: int, microbatch: int, forward_ms: float,
                   out: Path, per_stage: int = 4) -> list[str]:
    """``--slow STAGE:SPEED``: the devices, the profile and ``partition=auto`` over
    ``per_stage`` blocks a stage (room for it to move blocks)."""
    stage, speed = slow.split(":")
    speeds = [float(speed) if s == int(stage) else 1.0 for s in range(stages)]
    devices = ", ".join(f"{{speed: {v}}}" for v in speeds)
    blocks = per_stage * stages
    profile = _scenarios.write_profile(out / "profile.json", "mlp", blocks, microbatch,
                                       forward_ms / per_stage)
    return [f"model.n_layers={blocks - 2}", f"cluster.nodes=[{{name: local, devices: [{devices}]}}]",
            f"profile={profile}", "pipeline.partition=auto", "cluster.emulation=modelled"]


def measured_rate(run_dir: Path, warmup: int) -> float:
    """The median over the iterations after ``warmup`` of batch / step_s (the last stage's)."""
    train = [m for m in read_metrics(run_dir / "metrics.jsonl")
             if m.get("kind") == "train" and "loss" in m and m["step"] > warmup]
    batch = train[-1]["samples"] // train[-1]["step"]
    return statistics.median(batch / m["step_s"] for m in train)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", default="1f1b,zb_h1")
    parser.add_argument("--chunks", type=int, default=2, help="model chunks a stage (interleaved_*)")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=None, help="run folders (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--slow", default=None, metavar="STAGE:SPEED",
                        help="one device slower (speed 0.5: twice the time), partition=auto")
    parser.add_argument("--blocks-per-stage", type=int, default=4,
                        help="with --slow: the model's blocks over the stages (finer: more room to balance)")
    _report.add_markdown_option(parser)
    args = parser.parse_args(argv)
    schedules = args.schedules.split(",")
    S, m = args.stages, args.microbatches
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-schedules-"))
    out.mkdir(parents=True, exist_ok=True)
    pieces = S * max(chunks_of(name, args.chunks) for name in schedules)  # equal pieces for all
    common = ["model=mlp", f"model.n_layers={max(2 * S, pieces) - 2}", "data=synthetic", "sync=allreduce",
              "cluster.pipelines=1", f"pipeline.stages={S}", f"pipeline.microbatches={m}",
              f"train.batch_size={args.batch}", f"train.steps={args.warmup + args.steps}",
              "train.eval_every=0", "fault.on_slowdown=off", "run.memory_check=false"]
    if args.slow:
        common += slow_overrides(args.slow, S, args.batch // m, args.forward_ms, out, args.blocks_per_stage)
    else:
        common.append(f"cluster.compute_ms={args.forward_ms}")
    def own(name: str) -> list[str]:
        return [f"pipeline.schedule={name}", f"pipeline.chunks={chunks_of(name, args.chunks)}"]

    rates: dict[str, list[float]] = {name: [] for name in schedules}
    for r in range(args.repeats):
        for name in (schedules if r % 2 == 0 else schedules[::-1]):
            run_dir = out / f"{name}-{r}"
            rc, _ = _runner.run_sdpipe([*common, *own(name), f"run.dir={run_dir}"],
                                       out / f"{name}-{r}.log", args.timeout)
            if rc != 0:
                print(f"{name} repeat {r}: exit {rc}: {_runner.error_line(out / f'{name}-{r}.log')}",
                      file=sys.stderr)
                return 1
            rates[name].append(measured_rate(run_dir, args.warmup))
            print(f"{name} repeat {r}: {rates[name][-1]:.1f} samples/s", file=sys.stderr)
    rows = []
    base = schedules[0]
    for name in schedules:
        ticks = None if args.slow else predicted_ticks(name, S, m, args.chunks)
        predicted = None if ticks is None else args.batch / (ticks * args.forward_ms / 1000)
        simulated = simulated_rate([*common, *own(name)], out / f"{name}-sim",
                                   out / f"{name}-sim.log", args.timeout)
        median = statistics.median(rates[name])
        rows.append({"schedule": name, "ticks": ticks,
                     "predicted_samples_per_s": None if predicted is None else round(predicted, 1),
                     "simulated_samples_per_s": round(simulated, 1),
                     "samples_per_s": [round(x, 1) for x in rates[name]], "median": round(median, 1),
                     "of_predicted": None if predicted is None else round(median / predicted, 3),
                     "of_simulated": round(median / simulated, 3),
                     "vs_" + base: round(median / statistics.median(rates[base]), 3),
                     "predicted_vs_" + base: (None if ticks is None
                                              else round(predicted_ticks(base, S, m, args.chunks) / ticks, 3)),
                     "simulated_vs_" + base: None})
    for row in rows:
        row["simulated_vs_" + base] = round(row["simulated_samples_per_s"]
                                            / rows[0]["simulated_samples_per_s"], 3)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    header = (f"one pipeline, S={S}, m={m}, batch {args.batch}, modelled compute "
              f"({args.forward_ms:g} ms a forward, twice that a backward), {args.repeats} repeats"
              + (f"; stage:speed {args.slow}, partition=auto from a profile" if args.slow else ""))
    table = _report.rows_table([{**row, "samples_per_s": " ".join(map(str, row["samples_per_s"]))}
                                for row in rows])
    body = f"{header}\n\n{table}\n"
    _report.publish(body, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
