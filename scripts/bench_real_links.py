"""The sync modes on real shaped links: four machines as network namespaces, TCP through tbf.

Needs root (it makes network namespaces) and iproute2's ``ip`` and ``tc`` with the ``tbf`` qdisc;
where it cannot run it says why in one line and exits 2. Run it from the repository root::

    sudo python scripts/bench_real_links.py --seeds 0 --out docs/results/real_links.md
    python scripts/bench_real_links.py --modes allreduce sdpipe --variant \\
        "sdpipe_h14=sync=sdpipe,sync.every=14,sync.precision=bf16" --change-at 40 --change-to 5

**The test bed** (``scripts/_netns.py``): N machines (default 4), each a network namespace with
its own loopback and one port, ``10.213.0.N/24``, joined by a bridge in a switch namespace; every
port is shaped by the kernel's token bucket at ``--rate`` Mbit/s (``tc ... tbf rate R burst 64kb
latency 500ms``) on the machine's side and on the switch's, so each direction of each link runs
at R. Nothing is emulated on the wire: the cluster file the script writes gives each node its
``host`` and has no ``links`` section. The link is measured first (one TCP stream between two
machines for 2 s) and the table says what it carried. ``--change-at T --change-to R2`` changes
every port's rate T seconds into each run (on the run's clock, which starts when the first
launcher writes ``config.yaml``), ``--recover-at T2`` back to ``--rate``.

**The runs**: per seed, per mode (``--modes``: each a ``sync=`` value at its defaults) and per
variant (``--variant NAME=OVERRIDE,OVERRIDE``; default ``sdpipe_h14``, sdpipe meeting every 14
steps in bfloat16), one ``sdpipe train`` of the default model (gpt_tiny on the stdlib corpus),
one pipeline of S = 2 stages per machine, 10 ms of modelled compute per micro-batch forward
(``cluster.compute_ms``), ``cluster.slowdown=[1,1,1,3]``: one launcher per machine inside its
namespace (``ip netns exec``; the first machine's first, it hosts the store and the scheduler),
all with the same overrides, ``run.node`` and a fresh ``run.port``.

**The figures** are ``sdpipe_cli.analysis``'s: ``samples/s`` (all pipelines; for ``none``, the
limit: the sum of its pipelines' own rates, its window figure is in the JSON), ``of the limit``
(the ``none`` run of the same seed on the same links), ``final val`` (at equal samples: every run
trains the same budget), ``vs all-reduce`` (that over the all-reduce run of the same seed; the
means table: the mean of those ratios), ``sent per sample`` (bytes every worker sent in sync
collectives, over the samples trained) and ``time in collectives`` (the workers' seconds in sync
collectives over their seconds alive); ``H`` and ``precision`` are what the run used (its
``config.yaml``: sdpipe's meeting period as resolved, diloco's local steps); ``link estimates``
the run's own ``wire`` lines or ``summary.json`` key, where it records them; ``overruns`` the
share of forward and backward actions whose real compute did not fit the modelled time, and
``load`` the machine's 1-minute load average at the run's end: a run with many overruns was
slowed by the CPU (other work on a shared machine), not by its links. With
``--change-at``, samples/s before and after the change (and after ``--recover-at``), and sdpipe's
H over time where its group lines show it change.

Writes the table, stamped (``scripts/_report.py``), to ``--out`` and every row with its raw
figures to the same path with ``.json``; run folders and one log per machine go to ``--runs``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import _netns  # noqa: E402
from _report import command_line, kilobytes, loss, num, percent, rate, rows_table, write_markdown  # noqa: E402

NAME = "bench_real_links"
DEFAULT_MODES = ("none", "allreduce", "diloco", "sdpipe")
DEFAULT_VARIANTS = ("sdpipe_h14=sync=sdpipe,sync.every=14,sync.precision=bf16",)
STAGES = 2  # one pipeline per machine: its two stages on the machine's two devices
CLUSTER = "real_links"  # the cluster file this script writes
BASE_PORT = 29600  # the store's port of the i-th run: a fresh one, so no socket of the last lingers
JOIN_DELAY_S = 1.0  # the first machine's launcher first (the others wait for its store anyway)
POLL_S = 0.2
FAILED_GRACE_S = 30.0  # after one launcher failed, before the others are stopped (a node that
#                        is still waiting for a store that never came would wait run.timeout)
LEFTOVER_GRACE_S = 5.0  # for the last processes of a run to end after its launchers


# -- the command line ------------------------------------------------------------------------
def split_overrides(text: str) -> list[str]:
    """``a=1,b=[1,2],c={x: 1}`` as its overrides: commas inside brackets or braces stay."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "[{("
        depth -= char in "]})"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def variant(text: str) -> tuple[str, list[str]]:
    """``NAME=OVERRIDE,OVERRIDE`` (argparse's type of ``--variant``)."""
    name, eq, rest = text.partition("=")
    overrides = split_overrides(rest)
    if not eq or not name.isidentifier() or not overrides or any("=" not in o for o in overrides):
        raise argparse.ArgumentTypeError(
            f"'{text}' is not NAME=KEY=VALUE[,KEY=VALUE...] (e.g. sdpipe_h14=sync=sdpipe,sync.every=14)")
    return name, overrides


def factors(text: str) -> list[float]:
    """``1,1,1,3``: each machine's slowdown (argparse's type of ``--slowdown``)."""
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or any(not f >= 1 for f in out):
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of factors >= 1 like 1,1,1,3")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from sdpipe_cli.core.modes import MODES

    p = argparse.ArgumentParser(prog=NAME, description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=15.0, metavar="MBIT",
                   help="every port's rate in Mbit/s (0: unshaped)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=list(MODES),
                   metavar="MODE", help=f"sync modes at their defaults ({', '.join(MODES)})")
    p.add_argument("--variant", type=variant, nargs="*", default=None, metavar="NAME=OVERRIDES",
                   help="named runs with their own overrides (default: "
                   f"{DEFAULT_VARIANTS[0]}); a bare --variant: none")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--compute-ms", type=float, default=10.0)
    p.add_argument("--slowdown", type=factors, default=[1.0, 1.0, 1.0, 3.0],
                   help="each machine's slowdown; as many machines as factors (default 1,1,1,3)")
    p.add_argument("--change-at", type=float, default=None, metavar="SECONDS",
                   help="change every port's rate this many seconds into each run")
    p.add_argument("--change-to", type=float, default=None, metavar="MBIT")
    p.add_argument("--recover-at", type=float, default=None, metavar="SECONDS",
                   help="back to --rate this many seconds into each run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for every run (repeatable)")
    p.add_argument("--out", "--markdown", type=Path, default=None, metavar="PATH",
                   help="the table (Markdown; default RUNS/real_links.md), and PATH.json beside it")
    p.add_argument("--runs", type=Path, default=None, metavar="DIR",
                   help="run folders and logs (default runs/real_links/<UTC time>)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    args = p.parse_args(argv)
    if (args.change_at is None) != (args.change_to is None):
        p.error("--change-at and --change-to go together")
    if args.recover_at is not None and (args.change_at is None or args.recover_at <= args.change_at):
        p.error("--recover-at needs --change-at, and comes after it")
    if args.rate < 0 or (args.change_to is not None and args.change_to < 0):
        p.error("a rate is 0 (unshaped) or a positive Mbit/s")
    if any("=" not in s for s in args.set):
        p.error("--set takes KEY=VALUE")
    if len(args.slowdown) > 250:
        p.error("--slowdown: at most 250 machines (10.213.0.1 to .250)")
    args.variant = [variant(v) for v in DEFAULT_VARIANTS] if args.variant is None else args.variant
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    args.runs = args.runs or Path("runs/real_links") / stamp
    if args.runs.is_dir() and any(args.runs.iterdir()):
        # a launcher refuses a run folder that holds files, and the rows would read the old run's
        p.error(f"--runs: {args.runs} already holds files; choose a new folder")
    args.out = args.out or args.runs / "real_links.md"
    return args


def plan(args) -> list[tuple[str, list[str]]]:
    """(name, its overrides) of each run of a seed: the modes, then the variants; ``none``
    first (every other run's limit) and ``allreduce`` second (every run's reference)."""
    order = {"none": 0, "allreduce": 1}
    modes = sorted(args.modes, key=lambda m: order.get(m, 2))
    named = [(m, [f"sync={m}"]) for m in dict.fromkeys(modes)] + list(args.variant)
    if len({n for n, _ in named}) != len(named):
        raise SystemExit(f"{NAME}: error: --variant: a name is used twice in {[n for n, _ in named]}")
    return named


def schedule(args) -> list[tuple[float, float]]:
    """(second on the run's clock, rate) of each change of the links during a run."""
    if args.change_at is None:
        return []
    out = [(args.change_at, args.change_to)]
    return out + ([(args.recover_at, args.rate)] if args.recover_at is not None else [])


# -- one run ---------------------------------------------------------------------------------
def cluster_file(machines: int, compute_ms: float) -> str:
    """The cluster: N machines of S devices, each with its ``host``; no ``links`` section."""
    nodes = "\n".join(f"  - {{name: m{m}, host: {_netns.address(m)}, devices: [{{}}, {{}}]}}"
                      for m in range(1, machines + 1))
    return (f"# {machines} machines, one pipeline of {STAGES} stages each, joined by real links\n"
            f"# (network namespaces, TCP through tbf); nothing emulated on the wire.\n"
            f"name: {CLUSTER}\npipelines: {machines}\ndevice: cpu\nemulation: modelled\n"
            f"compute_ms: {compute_ms:g}\nnodes:\n{nodes}\n")


def overrides(args, run_overrides: list[str], seed: int, run_dir: Path, machine: int,
              port: int) -> list[str]:
    from _scenarios import slowdown

    return ["-cd", str((args.runs / "config").resolve()), f"cluster={CLUSTER}",
            f"pipeline.stages={STAGES}", f"run.node=m{machine}", f"run.port={port}",
            f"run.dir={run_dir.resolve()}", slowdown(args.slowdown), f"train.steps={args.steps}",
            f"train.eval_every={args.eval_every}", f"train.seed={seed}", *run_overrides,
            *args.set]


def run_clock_start(run_dir: Path) -> float | None:
    """When the run's clock started (epoch s): the first launcher starts it right after it
    writes ``config.yaml`` (within milliseconds); None before."""
    try:
        return (run_dir / "config.yaml").stat().st_mtime
    except OSError:
        return None


def launch(machines: _netns.Machines, args, name: str, run_overrides: list[str], seed: int,
           port: int) -> dict[str, Any]:
    """One run: a launcher per machine, waited for within ``--timeout``, the links changed on
    schedule; stopped in order whatever happens. Its status, per-machine exit codes and the
    moments (run clock) the links changed."""
    from _runner import SDPIPE, classify, start_command, stop

    run_dir = args.runs / f"{name}_seed{seed}"
    logs = [args.runs / f"{name}_seed{seed}.m{m}.log" for m in range(1, machines.count + 1)]
    changes, pending = [], schedule(args)
    procs, files = [], []
    started = time.monotonic()
    try:
        for m, log in enumerate(logs, start=1):
            files.append(log.open("w"))
            procs.append(start_command(
                "train", overrides(args, run_overrides, seed, run_dir, m, port), files[-1],
                entry=[*machines.exec_prefix(m), *SDPIPE], new_session=True))
            if m == 1:
                time.sleep(JOIN_DELAY_S)
        deadline, failed = started + args.timeout, None
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if failed is None and any(p.poll() not in (None, 0) for p in procs):
                failed = time.monotonic()
            if failed is not None and time.monotonic() - failed > FAILED_GRACE_S:
                break
            t0 = run_clock_start(run_dir)
            if pending and t0 is not None and time.time() - t0 >= pending[0][0]:
                machines.shape(pending[0][1])
                changes.append({"at_s": round(time.time() - t0, 2), "rate_mbit": pending[0][1]})
                pending.pop(0)
            time.sleep(POLL_S)
    finally:  # one SIGTERM each (a second stops a launcher at once), the store's host first
        for p in procs:
            stop(p)
        for f in files:
            f.close()
        if machines.rate != args.rate:
            machines.shape(args.rate)
    timed_out = time.monotonic() - started >= args.timeout  # not a run stopped for a failure
    codes = [None if timed_out and p.returncode != 0 else p.returncode for p in procs]
    statuses = [classify(c, log, args.timeout) for c, log in zip(codes, logs)]
    bad = [(m, s) for m, s in enumerate(statuses, start=1) if s[0] != "ok"]
    return {"run": name, "seed": seed, "overrides": run_overrides, "run_dir": str(run_dir),
            "exit": [p.returncode for p in procs],
            "status": "ok" if not bad else f"m{bad[0][0]}: {bad[0][1][0]}",
            "error": bad[0][1][1] if bad else "", "wall_s": round(time.monotonic() - started, 1),
            "changes": changes, "load_1min": os.getloadavg()[0]}


# -- what a run says -------------------------------------------------------------------------
def settings(run_dir: Path) -> dict[str, Any]:
    """The sync mode of a run, its meeting period H and what its rounds send, as resolved in
    its ``config.yaml`` (read as the workers read it: ``core.meetings``); diloco's H is its
    local steps; a mode whose replicas never meet has neither."""
    import yaml
    from omegaconf import OmegaConf

    from sdpipe_cli.core import meetings, modes

    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        sync = OmegaConf.create(cfg["sync"])
        mode = modes.mode(sync.name)
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return {}
    out = {"mode": mode.name, "microbatches": int(cfg["pipeline"]["microbatches"])}
    if mode.exchange == "local":
        return {**out, "every": None, "precision": None}
    every = int(sync.local_steps) if mode.exchange == "outer" else meetings.meetings_of(sync).every
    return {**out, "every": every, "precision": meetings.precision_of(sync)}


def every_over_time(lines: list[dict]) -> list[list[float]]:
    """[time, H] at the start and at each change of the meeting period the group lines show
    (a line without ``every`` meets every step)."""
    from sdpipe_cli import analysis

    out: list[list[float]] = []
    for m in analysis.by_time(analysis.of_kind(lines, "group")):
        every = m.get("every", 1)
        if not out or out[-1][1] != every:
            out.append([m["time"], every])
    return out


def link_estimates(lines: list[dict], run_dir: Path) -> dict | None:
    """What the run itself estimated of its links, if it records it: its last ``wire`` line,
    else ``summary.json``'s ``wire``; None where it records neither."""
    from sdpipe_cli import analysis

    wire = analysis.by_time([m for m in analysis.of_kind(lines, "wire") if "time" in m])
    if wire:
        return {k: v for k, v in wire[-1].items() if k != "kind"}
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("wire")
    except (OSError, ValueError, AttributeError):
        return None


def windows(lines: list[dict], changes: list[dict]) -> list[float | None]:
    """samples/s (``analysis.samples_per_s``) between the links' changes: before the first,
    between each, after the last."""
    from sdpipe_cli import analysis

    edges = [-float("inf"), *(c["at_s"] for c in changes), float("inf")]
    train = analysis.of_kind(lines, "train")
    return [analysis.samples_per_s([m for m in train if a <= m["time"] < b])
            for a, b in zip(edges, edges[1:])]


def read_run(record: dict[str, Any], pipelines: int) -> dict[str, Any]:
    """The run's figures (``sdpipe_cli.analysis``), added to its record."""
    from sdpipe_cli import analysis
    from sdpipe_cli.config.schema import ConfigError

    run_dir = Path(record["run_dir"])
    record.update(settings(run_dir))
    try:
        lines = analysis.read_metrics(run_dir)
    except ConfigError as err:
        record["error"] = record["error"] or str(err)
        return record
    record.update(analysis.analyse(lines, record.get("mode"), pipelines, record.get("microbatches")))
    record["solo_rates"] = analysis.solo_rates(lines)
    record["every_over_time"] = every_over_time(lines)
    record["wire"] = link_estimates(lines, run_dir)
    chosen = record["wire"] if isinstance(record["wire"], dict) else {}
    for key in ("every", "precision"):  # the run's own choice, where it made one from its links
        if chosen.get(key) is not None and record.get(key) is not None:
            record[key] = chosen[key]
    if record["changes"]:
        record["windows"] = windows(lines, record["changes"])
    return record


# -- the table (pure) ------------------------------------------------------------------------
def judge(records: list[dict]) -> list[dict]:
    """Each record against the ``none`` (``limit``, ``of_limit``) and ``allreduce``
    (``vs_allreduce``) runs of its seed; ``none``'s own row shows the limit as its samples/s."""
    from sdpipe_cli import analysis

    for r in records:
        same = {o["run"]: o for o in records if o["seed"] == r["seed"]}
        none, ref = same.get("none", {}), same.get("allreduce", {})
        r["limit"] = analysis.limit(none.get("solo_rates") or {})
        r["shown_rate"] = r["limit"] if r["run"] == "none" else r.get("samples_per_s")
        r["of_limit"] = analysis.fraction_of_limit(r["shown_rate"], r["limit"])
        own, theirs = r.get("final_val_loss"), ref.get("final_val_loss")
        r["vs_allreduce"] = own / theirs if own is not None and theirs else None
    return records


def means(records: list[dict]) -> list[dict]:
    """Per run name, over its seeds: the mean of each figure (a seed without it left out) and
    how many seeds it had."""
    keys = ("shown_rate", "of_limit", "final_val_loss", "vs_allreduce", "sync_bytes_per_sample",
            "comm_share", "overrun_fraction")
    out = []
    for name in dict.fromkeys(r["run"] for r in records):
        rows = [r for r in records if r["run"] == name]
        row: dict[str, Any] = {"run": name, "seeds": len(rows)}
        for key in keys:
            values = [r[key] for r in rows if r.get(key) is not None]
            row[key] = statistics.mean(values) if values else None
        out.append(row)
    return out


def _label(name: str) -> str:
    return "none (the limit)" if name == "none" else name


def _every(r: dict) -> str:
    if r.get("every") is None:
        return "-"
    periods = [int(e) for _, e in r.get("every_over_time") or []]
    if len(periods) > 1:  # it changed during the run: the whole series is in the JSON
        return (f"{periods[0]} -> {periods[-1]} ({min(periods)} to {max(periods)}, "
                f"{len(periods) - 1} changes)")
    return str(r["every"])


def _wire(r: dict) -> str:
    wire = r.get("wire")
    if not isinstance(wire, dict):
        return "-"
    parts = [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
             for k, v in wire.items() if k != "time" and not isinstance(v, (dict, list))]
    for stage in wire.get("stages") or []:  # what each stage's replicas measured of their links
        if isinstance(stage, dict) and isinstance(stage.get("mbit_s"), (int, float)):
            parts.append(f"stage {stage.get('stage', '?')}: {stage['mbit_s']:.1f} Mbit/s"
                         + (f" {stage['latency_ms']:.1f} ms"
                            if isinstance(stage.get("latency_ms"), (int, float)) else ""))
    return " ".join(parts)


def figure_cells(r: dict) -> dict[str, str]:
    """The figures one row shows (a run's or a mean's)."""
    return {"samples/s": rate(r.get("shown_rate")), "of the limit": num(r.get("of_limit"), ".2f"),
            "final val": num(r.get("final_val_loss"), ".3f"),
            "vs all-reduce": num(r.get("vs_allreduce"), ".3f"),
            "sent per sample": (kilobytes(r.get("sync_bytes_per_sample")) + " kB"
                                if r.get("sync_bytes_per_sample") else
                                "0" if r.get("sync_bytes_per_sample") == 0 else "-"),
            "time in collectives": percent(r.get("comm_share"), 0, space=True),
            "overruns": percent(r.get("overrun_fraction"), 0, space=True)}


def run_rows(records: list[dict], changes: int = 0) -> list[dict]:
    """A row per run: its figures, what it used (H, precision), its link estimates, and with
    ``changes`` of the links (1 or 2) its samples/s between them."""
    spans = {0: [], 1: ["before", "after"], 2: ["before", "during", "after"]}[changes]
    rows = []
    for r in records:
        row = {"run": _label(r["run"]), "seed": r["seed"], **figure_cells(r), "H": _every(r),
               "precision": r.get("precision") or "-", "link estimates": _wire(r),
               "load": num(r.get("load_1min"), ".1f"), "status": r["status"]}
        if spans:
            got = r.get("windows") or []
            row["samples/s " + " / ".join(spans)] = " / ".join(rate(w) for w in got) or "-"
            row["changed at"] = ", ".join(f"{c['at_s']:.1f} s to {c['rate_mbit']:g}"
                                          for c in r.get("changes", [])) or "-"
        rows.append(row)
    return rows


def body(records: list[dict], header: str, args) -> str:
    text = header + "\n\n" + rows_table(run_rows(records, len(schedule(args))))
    if len(args.seeds) > 1:
        text += ("\n\nMeans over seeds (vs all-reduce: the mean of each seed's ratio):\n\n"
                 + rows_table([{"run": _label(m["run"]), "seeds": m["seeds"], **figure_cells(m)}
                               for m in means(records)]))
    return text


def header_line(args, measured: dict[float, float]) -> str:
    shaped = (f"tbf at {args.rate:g} Mbit/s on every port, both directions" if args.rate
              else "unshaped")
    line = (f"measured {measured[args.rate]:.1f} Mbit/s between machines ({shaped}); "
            f"{len(args.slowdown)} machines, one pipeline of {STAGES} stages each, slowdown "
            f"[{','.join(f'{f:g}' for f in args.slowdown)}], {args.steps} steps, "
            f"{args.compute_ms:g} ms modelled compute per micro-batch forward")
    for at, to in schedule(args):
        line += f"; at {at:g} s every port to {to:g} Mbit/s (measured {measured[to]:.1f})"
    return line


# -- main --------------------------------------------------------------------------------------
def refuse(why: str) -> int:
    print(f"{NAME}: cannot run here: {why}", file=sys.stderr)
    return 2


def _interrupted(signum, frame) -> None:
    """Ctrl-C or SIGTERM: the runs are stopped and the machines taken down on the way out."""
    raise KeyboardInterrupt


def measure_links(machines: _netns.Machines, args) -> dict[float, float]:
    """Mbit/s one TCP stream gets at each rate a run uses (the base rate last, left in place)."""
    out = {}
    for r in [r for _, r in schedule(args) if r != args.rate] + [args.rate]:
        machines.shape(r)
        out[r] = _netns.measure(machines)
        print(f"links at {r:g} Mbit/s: measured {out[r]:.1f} Mbit/s between machines", flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    why = _netns.refusal()  # before anything is made or read
    if why:
        return refuse(why)
    args = parse_args(argv)
    runs = plan(args)
    for signum in (signal.SIGINT, signal.SIGTERM):  # even where started with SIGINT ignored (&)
        signal.signal(signum, _interrupted)
    args.runs.mkdir(parents=True, exist_ok=True)
    (args.runs / "config" / "cluster").mkdir(parents=True, exist_ok=True)
    (args.runs / "config" / "cluster" / f"{CLUSTER}.yaml").write_text(
        cluster_file(len(args.slowdown), args.compute_ms))
    records: list[dict] = []
    try:
        with _netns.Machines(len(args.slowdown), args.rate) as machines:
            measured = measure_links(machines, args)
            port = BASE_PORT
            for seed in args.seeds:  # seeds outermost: a passing load on the machine hits every mode
                for name, run_overrides in runs:
                    print(f"{name} seed {seed} ...", flush=True)
                    record = launch(machines, args, name, run_overrides, seed, port)
                    port += 1
                    record["orphans"] = machines.leftovers(LEFTOVER_GRACE_S)
                    records.append(read_run(record, len(args.slowdown)))
                    judge(records)
                    print(f"  {record['status']} in {record['wall_s']:.0f} s: "
                          f"{rate(record.get('samples_per_s'))} samples/s, final val "
                          f"{loss(record.get('final_val_loss'))}", flush=True)
                    (args.runs / "results.json").write_text(json.dumps(records, indent=1))
                    if record["orphans"]:  # never into the next run
                        machines.close()
                        raise SystemExit(f"{NAME}: error: processes left in the machines after "
                                         f"{name} seed {seed}: {record['orphans']}")
    except _netns.Unavailable as err:
        return refuse(str(err))
    except KeyboardInterrupt:
        print(f"{NAME}: interrupted; the runs so far: {args.runs / 'results.json'}", file=sys.stderr)
        return 130
    text = body(records, header_line(args, measured), args)
    print(text)
    write_markdown(args.out, text, command_line())
    args.out.with_suffix(".json").write_text(json.dumps(
        {"command": command_line(), "measured_mbit": measured, "rate_mbit": args.rate,
         "changes": schedule(args), "runs": records, "means": means(records)}, indent=1))
    print(f"table: {args.out}; every figure: {args.out.with_suffix('.json')}")
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
