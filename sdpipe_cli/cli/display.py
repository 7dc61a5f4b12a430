"""What sdpipe shows: the console it writes to, the live progress of a run, and the tables of
``profile``, ``simulate``, ``pipeline.partition=auto`` and a run's summary.

The bottom of the CLI's one-way flow (parsing -> commands -> run loop -> display): these
functions only render what they are given (a launch's result, a profile or simulation document,
a partition plan) and import nothing of sdpipe's, so any command can show anything without an
import cycle. rich stays in the CLI (here, and the sweep's table): workers and the scheduler log
plain text.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


def stderr_console() -> Console:
    """Where sdpipe writes: stderr. Off a terminal (a log file, a CI job, a pipe) rich would
    assume 80 columns and cut table cells mid-word; there the width is ``COLUMNS``, else 160."""
    if sys.stderr.isatty():
        return Console(stderr=True)
    return Console(stderr=True, width=int(os.environ.get("COLUMNS", "0") or 0) or 160)


def run_folder(console: Console, result) -> None:
    """Where a launch's run folder (and its trace, if one was recorded) is."""
    if result.run_dir is not None:  # None: stopped before the folder was made
        console.print(f"run folder: {result.run_dir}", highlight=False)
    if result.trace is not None:
        console.print(f"trace: {result.trace} (open in ui.perfetto.dev or chrome://tracing)",
                      markup=False, highlight=False, soft_wrap=True)


class ProgressDisplay:
    """A live bar on a terminal; a plain line every 10% elsewhere (CI logs, pipes)."""

    def __init__(self, console: Console, total: int, done: int = 0):
        self.console, self.total = console, total
        self.live = console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]{task.fields[status]}"), BarColumn(),
            TextColumn("{task.completed}/{task.total} it"),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False)
        self.task = self.progress.add_task("train", total=total, completed=done, loss="-",
                                           rate="-", status="starting")
        self.next_report = 0.1
        self.told = 0  # the scheduler's straggler lines printed so far

    def __enter__(self):
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.progress.stop()

    def folder(self, run_dir: Path) -> None:
        """Said as soon as the run folder exists: where the logs are while the run goes on."""
        self.console.print(f"run folder: {run_dir} (logs: {run_dir / 'logs'})", highlight=False)

    def phase(self, what: str) -> None:
        """A step of the start-up, shown where the bar's label is until training reports."""
        self.progress.update(self.task, status=what)

    def update(self, snap: dict) -> None:
        if snap.get("iterations"):
            self.progress.update(self.task, status="train")
        loss = "-" if snap.get("loss") is None else f"{snap['loss']:.3f}"
        rate = f"{snap.get('samples_per_s', 0.0):.0f}"
        done = min(snap.get("iterations", 0), self.total)
        self.progress.update(self.task, completed=done, loss=loss, rate=rate)
        self._stragglers(snap.get("straggler_news") or {})
        if not self.live and done >= self.next_report * self.total:
            self.console.print(f"train {done}/{self.total} it  loss {loss}  {rate} samples/s",
                               highlight=False)
            while self.next_report * self.total <= done:
                self.next_report += 0.1


    def _stragglers(self, news: dict) -> None:
        """A line for each change of a device's state the scheduler decided since the last
        snapshot (its :class:`~sdpipe_cli.runtime.stragglers.StragglerWatch` owns them: the
        console only words them)."""
        count, recent = int(news.get("count", 0)), news.get("recent") or []
        fresh = recent[max(0, len(recent) - (count - self.told)):] if count > self.told else []
        self.told = max(self.told, count)
        for d in fresh:
            where = f"{d['device']} (pipeline {d['pipeline']}, stage {d['stage']})"
            if d["kind"] == "still_slow":  # found before the last re-plan, and slow still
                line = f"still slow: {where}, {d['carried']:.1f}x, as before the re-plan"
            elif d["kind"] == "recovered":
                line = f"recovered: {where} computes at its usual speed again"
            else:
                slower = "" if d.get("slower") is None else f" computes {d['slower']:.1f}x " \
                    "slower than at its start (against its peers),"
                line = (f"slow device: {d['device']} (node {d['node']}, pipeline "
                        f"{d['pipeline']}, stage {d['stage']}, rank {d['rank']}){slower} and its "
                        "pipeline with it")
            self.console.print(line, highlight=False, soft_wrap=True)


class ProfilePhases:
    """One line per profiling phase as rank 0 reaches it (the phases take turns, see profiling)."""

    NAMES = {"blocks": "block forward/backward times", "p2p": "p2p latency and bandwidth",
             "link": "links between nodes", "allreduce": "all-reduce of stage weights"}

    def __init__(self, console: Console):
        self.console, self.phase = console, None

    def update(self, snap: dict) -> None:
        phase = snap.get("phase")
        if phase in self.NAMES and phase != self.phase:
            self.phase = phase
            self.console.print(f"profile: {self.NAMES[phase]} (turn {snap['turn']}/"
                               f"{snap['turns']})", highlight=False)


def profile_tables(console: Console, doc: dict, wall_s: float) -> None:
    """profile.json as tables: devices, blocks, p2p, links between nodes, all-reduce."""
    m, c, devices = doc["model"], doc["cluster"], doc["devices"]
    table = Table(title=f"sdpipe profile: {m['name']}, micro-batch {m['microbatch_size']} x "
                  f"{m['seq_len']} tokens, P={c['pipelines']} S={c['stages']} on {c['device']} "
                  f"({wall_s:.1f} s)")
    for col in ("device", "node", "speed", "pipeline", "stage", "rank", "forward ms",
                "backward ms", "peak MB"):
        table.add_column(col, justify="left" if col in ("device", "node") else "right")
    for d in devices:
        table.add_row(d["name"], d["node"], f"{d['speed']:g}", str(d["pipeline"]), str(d["stage"]),
                      str(d["rank"]), _ms(sum(d["forward_ms"])), _ms(sum(d["backward_ms"])),
                      f"{d['peak_memory_mb']:.0f}")
    console.print(table)
    console.print(f"(all blocks at one micro-batch; peak memory: "
                  f"{', '.join(sorted({d['memory_source'] for d in devices}))})", highlight=False)

    shown = devices
    if len(devices) > 4:  # the first device and the slowest keep the table readable
        slowest = max(devices, key=lambda d: sum(d["forward_ms"]) + sum(d["backward_ms"]))
        shown = [devices[0]] + ([slowest] if slowest is not devices[0] else [])
    table = Table(title="per block: forward/backward ms")
    table.add_column("block")
    table.add_column("params", justify="right")
    for d in shown:
        table.add_column(d["name"], justify="right")
    for b in range(m["blocks"]):
        table.add_row(m["block_names"][b], f"{m['block_params'][b]:,}",
                      *(f"{_ms(d['forward_ms'][b])}/{_ms(d['backward_ms'][b])}" for d in shown))
    console.print(table)
    if len(shown) < len(devices):
        console.print(f"(the first and the slowest of {len(devices)} devices; all of them in "
                      "profile.json)", highlight=False)

    for section, title, pair in (("p2p", "p2p between pipeline neighbours", ("src", "dst")),
                                 ("links", "links between nodes", ("src_node", "dst_node"))):
        if doc.get(section):  # links: absent from older profiles
            console.print(_link_table(doc[section], c["links"], title, pair))
    if doc["allreduce"]:
        table = Table(title="all-reduce of a stage's weights (float32)")
        for col in ("stage", "group size", "ranks", "MiB", "ms"):
            table.add_column(col, justify="right")
        for e in doc["allreduce"]:
            table.add_row(str(e["stage"]), str(e["group_size"]), " ".join(map(str, e["ranks"])),
                          f"{e['bytes'] / 2**20:.2f}", _ms(e["ms"]))
        console.print(table)


def _link_table(entries: list[dict], emulated_links: dict, title: str,
                pair: tuple[str, str]) -> Table:
    """Measured latency and bandwidth per pair (``pair``: the fields that name its ends)."""
    table = Table(title=f"{title} (bandwidth message {entries[0]['bytes'] / 2**20:g} MiB)")
    for col in ("pair", "ranks", "link", "emulated", "latency ms", "bandwidth Gbit/s"):
        table.add_column(col, justify="right" if col.endswith(("ms", "Gbit/s")) else "left")
    for e in entries:
        link = emulated_links[e["link"]]  # what cluster.links emulated on this link class
        emulated = [f"{link['latency_ms']:g} ms"] if link["latency_ms"] else []
        if link["bandwidth_gbps"] is not None:
            emulated.append(f"{link['bandwidth_gbps']:g} Gbit/s")
        bw = "-" if e["bandwidth_gbps"] is None else f"{e['bandwidth_gbps']:.2f}"
        table.add_row(f"{e[pair[0]]} -> {e[pair[1]]}", f"{e['src_rank']} -> {e['dst_rank']}",
                      e["link"], ", ".join(emulated) or "-", _ms(e["latency_ms"]), bw)
    return table


def _ms(x: float) -> str:
    """Milliseconds to about three significant digits: 0.0762, 1.20, 12.3, 123."""
    digits = 0 if x >= 100 else 1 if x >= 10 else 2 if x >= 1 else 3
    return f"{x:.{digits}f}"


def plan_table(console: Console, plan) -> None:
    """The automatic partition next to the uniform one, with predicted per-stage times."""
    table = Table(title="pipeline.partition=auto")
    table.add_column("stage", justify="right")
    for col in (f"uniform {plan.uniform_bounds}", f"auto {plan.bounds}"):
        table.add_column(col, justify="right")
    for s, (u, a) in enumerate(zip(plan.uniform_times, plan.times)):
        table.add_row(str(s), f"{u:.2f}", f"{a:.2f}")
    table.add_row("bottleneck", f"{max(plan.uniform_times):.2f}", f"{max(plan.times):.2f}")
    console.print(table)
    console.print("(predicted ms per micro-batch, forward + backward, on the slowest replica's "
                  f"device)\nauto partition: predicted {plan.speedup:.2f}x the uniform partition's "
                  "throughput", highlight=False)


def simulation_table(doc: dict, steps: int) -> None:
    """simulation.json as one table on stdout: the config's sync mode, then each compared one."""
    table = Table(title=f"simulated: P={doc['pipelines']}, S={doc['stages']}, "
                        f"{steps} steps; limit {doc['limit_samples_per_s']:.1f} "
                        f"samples/s (simulated in {doc['simulated_in_s']:.1f} s)")
    for name in ("sync", "samples/s", "of limit", "mean group", "wall (s)", "iterations",
                 "waiting", "sent/sample", "comm"):
        table.add_column(name, justify="left" if name == "sync" else "right")
    for row in [doc, *doc["compare"]]:
        its, waits = row["iterations"], row["sync_wait_fraction"]
        table.add_row(row["sync"], f"{row['samples_per_s']:.1f}", f"{row['fraction_of_limit']:.2f}",
                      f"{row['mean_group_size']:.2f}", f"{row['wall_s']:.1f}",
                      f"{min(its)}-{max(its)}", f"{100 * sum(waits) / len(waits):.0f}%",
                      _bytes(row.get("sync_bytes_per_sample") or 0.0),
                      f"{100 * (row.get('comm_share') or 0.0):.0f}%")
    Console().print(table)  # on stdout, unlike everything else here: the result itself
    replan = doc.get("replan")
    if replan:  # fault.on_slowdown=replan: the run with its slowdown, as it goes and re-planned
        verdict = (f"re-planned {replan['partition']} -> {replan['proposed']} at "
                   f"{replan['switch_s']:.0f} s" if replan["go"] else
                   f"not re-planned ({replan['reason']})")
        Console().print(f"{replan['device']} slows to speed {replan['speed']:g} at "
                        f"{replan['at']:g} s: {verdict}; the budget takes "
                        f"{replan['with_s']:.1f} s against {replan['without_s']:.1f} s "
                        f"({replan['with_samples_per_s']:.1f} against "
                        f"{replan['without_samples_per_s']:.1f} samples/s)",
                        highlight=False, soft_wrap=True)


def summary(console: Console, result, wall_s: float, restarts: int = 0) -> None:
    """A finished run's table per pipeline, then a line for each thing worth knowing: group
    sizes, unreadable samples, data waits, recoveries."""
    again = f" after {restarts} restart{'s' if restarts > 1 else ''}" if restarts else ""
    table = Table(title=f"sdpipe train: done in {wall_s:.1f} s{again}")
    pipelines = sorted(result.progress.get("pipelines", {}).items(), key=lambda kv: int(kv[0]))
    accuracy = any(s.get("val_accuracy") is not None for _, s in pipelines)
    for col in ("pipeline", "iterations", "samples", "loss", "val_loss",
                *(("val_acc",) if accuracy else ()), "samples/s"):
        table.add_column(col, justify="right")
    for p, s in pipelines:
        fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        acc = ("-" if s.get("val_accuracy") is None else f"{100 * s['val_accuracy']:.1f}%",)
        table.add_row(str(p), str(s["steps"]), str(s["samples"]), fmt(s["loss"]),
                      fmt(s["val_loss"]), *(acc if accuracy else ()), f"{s['samples_per_s']:.1f}")
    console.print(table)
    if result.progress.get("mean_group_size") is not None:
        unit, counts = result.progress.get("rounds_of", "stage"), result.progress["rounds"]
        rounds = "; ".join(_runs_of(unit, counts))
        console.print(f"group sync: mean group size {result.progress['mean_group_size']:.2f}; "
                      f"rounds per replica: {rounds}", highlight=False)
    per_sample, share = (result.progress.get("sync_bytes_per_sample"),
                         result.progress.get("comm_share"))
    if per_sample:
        cross = result.progress.get("cross_node_bytes_per_sample")
        console.print(f"sync traffic: {_bytes(per_sample)} sent per sample"
                      + (f" ({_bytes(cross)} between nodes)" if cross else "")
                      + (f"; {share:.0%} of the workers' time in sync collectives"
                         if share is not None else ""), highlight=False)
    wire = result.progress.get("wire")
    if wire:
        slowest = min(wire["stages"], key=lambda s: s["mbit_s"])
        console.print(f"links: measured {slowest['mbit_s']:.1f} Mbit/s and "
                      f"{slowest['latency_ms']:.1f} ms between the replicas of stage "
                      f"{slowest['stage']} (the slowest); {wire['describe']}", highlight=False,
                      soft_wrap=True)
    if result.progress.get("unreadable"):
        bad = result.progress["unreadable"]
        console.print(f"data: {len(bad)} unreadable sample(s) replaced by the next, e.g. {bad[0]} "
                      "(all in metrics.jsonl, kind unreadable)", markup=False, highlight=False, soft_wrap=True)
    share, wait = result.progress.get("data_wait_share"), result.progress.get("data_wait_s")
    if share is not None and share > 0.05 and wait is not None and wait > 0.005:  # not a toy's 1 ms
        console.print(f"data: a reading stage waited for its batches {share:.0%} of the time; raise "
                      "data.num_workers", markup=False, highlight=False)
    if result.progress.get("restarts"):
        console.print(f"recovered: {result.progress['restarts']} pipeline restart(s), "
                      f"{result.progress['heals']} replica(s) healed from live ones "
                      "(restart and heal lines in metrics.jsonl)", highlight=False)
    resplit = result.progress.get("resplit")
    if resplit:
        last = "; ".join(f"pipeline {p} -> {bounds}" for p, bounds in resplit["partitions"].items())
        console.print(f"re-planned in place {resplit['version']} time(s), the last: {last}, while "
                      "the other pipelines went on (replan, restart and heal lines in "
                      "metrics.jsonl)", markup=False, highlight=False, soft_wrap=True)
    if result.progress.get("scheduler_restarts"):
        console.print(f"recovered: the scheduler was started again "
                      f"{result.progress['scheduler_restarts']} time(s) and replayed its journal "
                      "(scheduler_restart lines in metrics.jsonl)", highlight=False)


def _runs_of(unit: str, counts: list) -> list[str]:
    """Rounds per replica of each unit, consecutive units with the same counts in one item
    (``segment 0-15: [...]``: per-block units would otherwise fill the screen)."""
    items, start = [], 0
    for k in range(1, len(counts) + 1):
        if k == len(counts) or counts[k] != counts[start]:
            span = f"{start}" if k - 1 == start else f"{start}-{k - 1}"
            items.append(f"{unit} {span}: {counts[start]}")
            start = k
    return items


def _bytes(n: float) -> str:
    """``n`` bytes in the unit that reads best (decimal: kB, MB, GB)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
