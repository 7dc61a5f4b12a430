"""``sdpipe report RUN [RUN ...] [--out DIR]``: pictures of runs, several overlaid.

A run folder holds ``config.yaml`` and ``metrics.jsonl``; that is all a report reads, so it works
on a run that is still going, failed or was interrupted (a torn last line is skipped). Runs are
labelled by the settings in which they differ (``sync.name=sdpipe``, ``train.lr=0.003``), so a
comparison of sync modes names itself. Each figure is a PNG in ``--out`` (default: the first
run's folder, ``report/``):

- ``loss.png``: training loss (at each moment, the mean of every pipeline's latest) and
  validation loss, against wall time and against the samples all pipelines have seen; every
  run's clock starts when its first iteration began, so start-up does not skew a comparison;
- ``accuracy.png``: validation accuracy of classifiers, against time and samples;
- ``throughput.png``: samples/s of each pipeline over time;
- ``groups.png``: sdpipe's group size per stage over time, and its histogram (the paper's view);
- ``waits.png``: the distribution of the wait for a group and of the group all-reduce (or, for
  the other modes, of the time spent syncing), a panel each, every run an outline;
- ``consensus.png``: the consensus distance at global syncs, where the run has it;
- ``tolerance.png``: where the runs hold ``sync=none`` runs of two or more ``cluster.slowdown``
  patterns (a sweep over heterogeneity), each sync mode's samples/s as a fraction of the limit
  (the ``none`` run's pipelines' solo rates summed, of the same slowdowns and seed) against the
  slowest pipeline's slowdown, the mean over seeds (:func:`tolerance`).

A run resumed from an older checkpoint is drawn as two timelines (:func:`timelines`).

A figure with nothing to show (``groups.png`` for all-reduce runs only) is not written.
matplotlib is an optional extra (``pip install -e '.[report]'``); the data part here is plain
Python and is unit-tested without it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from sdpipe_cli import analysis
from sdpipe_cli.config import yaml_bounds
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.core import modes
from sdpipe_cli.core.grouping.rounds import JOINED, LEFT_OUT, REASONS

__all__ = ["Run", "load", "load_all", "labels", "report"]


@dataclass
class Run:
    path: Path
    config: dict[str, Any]  # flattened: "train.lr" -> 0.003
    lines: list[dict[str, Any]]
    label: str = ""

    def kind(self, kind: str) -> list[dict[str, Any]]:
        return analysis.of_kind(self.lines, kind)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: json.dumps(tree) if isinstance(tree, list) else tree}


def load(path: str | Path) -> Run:
    """A run folder's config and metrics; ConfigError naming the path if it is not one."""
    folder = Path(path)
    config, metrics = folder / "config.yaml", folder / "metrics.jsonl"
    if not folder.is_dir():
        raise ConfigError(str(path), "is not a folder; give run folders (runs/<timestamp>)")
    if not config.is_file() or not metrics.is_file():
        raise ConfigError(str(path), "is not a run folder (no config.yaml and metrics.jsonl)")
    try:
        tree = OmegaConf.to_container(yaml_bounds.load(config, "sdpipe report"), resolve=False)
    except ConfigError:
        raise
    except Exception as err:  # OmegaConf raises several types for a broken file
        raise ConfigError(str(config), f"cannot be read: {str(err).splitlines()[0]}") from None
    return Run(folder, _flatten(tree), from_first_iteration(read_lines(metrics)))


def timelines(run: Run) -> list[Run]:
    """``run`` as the timelines it holds (:func:`analysis.timelines`): resuming a checkpoint
    older than the run's progress branches it. Labels say where each began."""
    out = []
    for branch, lines in analysis.timelines(run.lines):
        label = run.label if branch is None else (
            f"{run.label} (resumed from {branch.get('checkpoint', 'a checkpoint')})")
        out.append(Run(run.path, run.config, lines, label))
    return out


# the reader, the clock and the figures: one definition each, in analysis/
read_lines = analysis.read_metrics
from_first_iteration = analysis.from_first_iteration
TIME_AXIS = "seconds since the first iteration began"


def load_all(paths: Sequence[str | Path]) -> list[Run]:
    """Runs from run folders and sweep folders (``sdpipe train -m``: every run in it, in the
    sweep's order)."""
    runs: list[Run] = []
    for path in paths:
        folder = Path(path)
        inner = []
        if folder.is_dir() and not (folder / "config.yaml").exists():
            inner = sorted((p for p in folder.iterdir() if (p / "config.yaml").is_file()),
                           key=_sweep_order)
        if inner:
            runs.extend(load(p) for p in inner)
        else:
            runs.append(load(path))
    return runs


def _sweep_order(path: Path) -> tuple[int, str]:
    head = path.name.split("-", 1)[0]
    return (int(head) if head.isdigit() else 1 << 30, path.name)


IGNORED = ("run.dir", "run.port", "run.node", "profile")  # differ between runs, say nothing
DERIVED = ("plan.layout.",)  # follow from settings that are shown under their own names


def labels(runs: Sequence[Run], most: int = 4) -> list[str]:
    """Each run's label: the settings whose values differ among ``runs`` (or its folder name).

    A setting that some of the runs do not have (``sync.window_ms`` beside an all-reduce run) is
    a consequence of one that differs (``sync.name``), and is left out, unless runs would
    otherwise share a label: two sdpipe runs beside an all-reduce one that differ only in
    ``sync.stale`` are told apart by it (and the all-reduce run's label does not mention it)."""
    keys = sorted(k for k in {k for r in runs for k in r.config} - set(IGNORED) if not k.startswith(DERIVED))
    differing = [k for k in keys if len({json.dumps(r.config.get(k)) for r in runs}) > 1]
    shown = [k for k in differing if all(r.config.get(k) is not None for r in runs)][:most]

    def render(chosen: list[str]) -> list[str]:
        return [" ".join(f"{k}={run.config.get(k)}" for k in chosen
                         if run.config.get(k) is not None) for run in runs]

    rest = [k for k in differing if k not in shown]
    while rest and len(shown) < most and len(set(render(shown))) < len(runs):
        # the setting that tells most runs apart (the first in name order on a tie)
        best = max(rest, key=lambda k: len(set(render(shown + [k]))))
        if len(set(render(shown + [best]))) == len(set(render(shown))):
            break
        shown.append(best)
        rest.remove(best)
    if len(runs) < 2 or not shown:
        return [run.path.name for run in runs]
    return [label or run.path.name for label, run in zip(render(shown), runs)]


def _pipelines(run: Run) -> list[int]:
    return analysis.pipelines(run.lines) or [0]


def mean_loss(run: Run) -> tuple[list[float], list[float], list[float]]:
    """(times, samples, loss): :func:`analysis.mean_loss` of the run."""
    return analysis.mean_loss(run.lines)


def validation(run: Run) -> tuple[list[float], list[float], list[float]]:
    """(times, samples, val_loss): :func:`analysis.validation` of the run."""
    return analysis.validation(run.lines)


def sync_times(run: Run) -> dict[str, list[float]]:
    """Seconds per update waiting and syncing: :func:`analysis.sync_times` of the run."""
    return analysis.sync_times(run.lines)


def consensus(run: Run) -> dict[int, tuple[list[float], list[float]]]:
    """Per stage: (times, consensus distances): :func:`analysis.consensus` of the run."""
    return analysis.consensus(run.lines)


def report(runs: Sequence[Run], out: Path) -> list[Path]:
    """Write the figures for ``runs`` into ``out``; the paths written.

    Each figure is drawn and saved before the next is drawn, so that only one is open at a time
    and a folder that cannot take a file fails at the first one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _make_folder(out)
    for run, name in zip(runs, labels(runs)):
        run.label = name
    # loss and accuracy per timeline; the other figures count each update once, per run
    branches = [part for run in runs for part in timelines(run)]
    drawings = ((_loss_figure, branches, "loss.png"), (_accuracy_figure, branches, "accuracy.png"),
                (_throughput_figure, runs, "throughput.png"), (_groups_figure, runs, "groups.png"),
                (_waits_figure, runs, "waits.png"), (_stragglers_figure, runs, "stragglers.png"),
                (_consensus_figure, runs, "consensus.png"),
                (_tolerance_figure, runs, "tolerance.png"))
    written = []
    for draw, which, name in drawings:
        fig = draw(plt, which)
        if fig is not None:  # nothing to show: no file
            written.append(_save(plt, fig, out / name))
    return written


def _make_folder(out: Path) -> None:
    """``out`` made (with the folders above it); ConfigError naming it if it cannot be, so that
    the user sees one line instead of a traceback."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(str(out), f"cannot be made a folder for the figures: {err.strerror or err}") from None


def _save(plt, fig, path: Path) -> Path:
    """Write ``fig`` to ``path`` and close it (also when writing fails, so that figures do not
    pile up in pyplot); ConfigError naming the file if it cannot be written."""
    try:
        fig.savefig(path, dpi=110)
    except OSError as err:
        raise ConfigError(str(path), f"cannot be written: {err.strerror or err}") from None
    finally:
        plt.close(fig)
    return path


def _loss_figure(plt, branches: Sequence[Run]):
    """Training and validation loss against time and against samples: time shows which sync mode
    is faster, samples whether it learns as much per sample."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    for run in branches:
        t, n, loss = mean_loss(run)
        vt, vn, val = validation(run)
        line, = axes[0].plot(t, loss, alpha=0.6, label=f"{run.label} train")
        axes[1].plot(n, loss, alpha=0.6, color=line.get_color(), label=f"{run.label} train")
        if val:
            axes[0].plot(vt, val, "o-", color=line.get_color(), label=f"{run.label} val")
            axes[1].plot(vn, val, "o-", color=line.get_color(), label=f"{run.label} val")
    for ax, x in zip(axes, (TIME_AXIS, "samples (all pipelines)")):
        ax.set_xlabel(x)
        ax.set_ylabel("loss (nats)")
        ax.legend(fontsize=7, loc="upper right")
    axes[0].set_title("loss against time")
    axes[1].set_title("loss against samples")
    return fig


def _accuracy_figure(plt, branches: Sequence[Run]):
    """Validation accuracy against time and samples, of the classifiers among ``branches`` (the
    runs whose evals report it); None if there are none."""
    classified = [run for run in branches if any("val_accuracy" in m for m in run.kind("eval"))]
    if not classified:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    for run in classified:
        vt, vn, _ = validation(run)
        acc = [100 * m["val_accuracy"] if m.get("val_accuracy") is not None else float("nan")
               for m in sorted(run.kind("eval"), key=lambda m: m["time"])]
        axes[0].plot(vt, acc, "o-", label=run.label)
        axes[1].plot(vn, acc, "o-", label=run.label)
    for ax, x in zip(axes, (TIME_AXIS, "samples (all pipelines)")):
        ax.set(xlabel=x, ylabel="validation accuracy (%, top-1)")
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_title("accuracy against time")
    axes[1].set_title("accuracy against samples")
    return fig


def _throughput_figure(plt, runs: Sequence[Run]):
    """Samples/s of each pipeline over time: a slow device shows as its pipeline's dip."""
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for run in runs:
        for p in _pipelines(run):
            ms = [m for m in run.kind("train") if m["pipeline"] == p and "samples_per_s" in m]
            ax.plot([m["time"] for m in ms], [m["samples_per_s"] for m in ms],
                    label=f"{run.label} p{p}")
    ax.set_xlabel(TIME_AXIS)
    ax.set_ylabel("samples/s")
    ax.set_title("throughput per pipeline")
    ax.legend(fontsize=7)
    return fig


def reasons(run: Run) -> dict[str, int]:
    """How many of the run's rounds closed for each reason (their ``group`` lines' ``reason``:
    every live replica there, the awaited ones came, one was late, ...), how many times a
    pipeline was in a round for each reason (``inside``, as ``in: expected``, ...) and left out
    of one (``outside``, as ``out: late``, ...), in the policy's order."""
    counts: dict[str, int] = {}
    for g in run.kind("group"):
        whys = [g["reason"]] if g.get("reason") else []
        whys += [f"in: {w}" for w in (g.get("inside") or {}).values()]
        whys += [f"out: {w}" for w in (g.get("outside") or {}).values()]
        for why in whys:
            counts[why] = counts.get(why, 0) + 1
    order = {r: i for i, r in enumerate((*REASONS, *(f"in: {w}" for w in JOINED),
                                         *(f"out: {w}" for w in LEFT_OUT)))}
    return dict(sorted(counts.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


def _groups_figure(plt, runs: Sequence[Run]):
    """sdpipe's group size per stage over time and as a histogram (the paper's view), and why
    its rounds closed (:func:`reasons`); None if no run formed groups (all-reduce and no-sync
    runs do not)."""
    grouped = [run for run in runs if run.kind("group")]
    if not grouped:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5), layout="constrained")
    counted = [reasons(run) for run in grouped]
    keys = list(dict.fromkeys(k for counts in counted for k in counts))  # the policy's order
    width = 0.8 / len(grouped)
    for i, (run, counts) in enumerate(zip(grouped, counted)):
        axes[2].bar([k + i * width for k in range(len(keys))], [counts.get(r, 0) for r in keys],
                    width, label=run.label)
    axes[2].set_xticks([k + 0.4 - width / 2 for k in range(len(keys))], keys)
    axes[2].set(xlabel="why the round closed; why a pipeline was left out", ylabel="rounds",
                title="rounds by reason")
    for run in grouped:
        for stage in sorted({g["stage"] for g in run.kind("group")}):
            gs = [g for g in run.kind("group") if g["stage"] == stage]
            axes[0].plot([g["time"] for g in gs], [g["size"] for g in gs], ".", alpha=0.5,
                         label=f"{run.label} stage {stage}")
        sizes = [g["size"] for g in run.kind("group")]
        # a bar per size; a size no run has (below 1, past any cluster) gets automatic bins
        bins = range(1, max(sizes) + 2) if 1 <= min(sizes) <= max(sizes) <= 4096 else "auto"
        axes[1].hist(sizes, bins=bins, alpha=0.5, align="left", label=run.label)
    axes[0].set(xlabel="seconds", ylabel="group size", title="group size per stage")
    axes[1].set(xlabel="group size", ylabel="rounds", title="group sizes")
    for ax in axes:
        ax.legend(fontsize=7)
    return fig


def _waits_figure(plt, runs: Sequence[Run]):
    """The distribution of each kind of sync time (:func:`sync_times`), a panel per kind; None if
    no run has any.

    One panel per quantity, each run an outline over shared bins: filled histograms of several
    runs stacked on one axis blend into one colour."""
    import numpy as np

    series: dict[str, list[tuple[str, list[float]]]] = {}
    for run in runs:
        for what, seconds in sync_times(run).items():
            if seconds:
                series.setdefault(what, []).append((run.label, [x * 1e3 for x in seconds]))
    if not series:
        return None
    fig, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 4.5),
                             layout="constrained", squeeze=False)
    for ax, (what, per_run) in zip(axes[0], series.items()):
        every = [x for _, xs in per_run for x in xs]
        edges = np.histogram_bin_edges(every, bins=40)
        for label, xs in per_run:
            ax.hist(xs, bins=edges, histtype="step", linewidth=1.5, label=label)
        ax.set(xlabel="milliseconds per update", ylabel="updates", title=what)
        ax.legend(fontsize=7)
    return fig


def _consensus_figure(plt, runs: Sequence[Run]):
    """The consensus distance per stage at global syncs (how far replicas drifted apart); None
    if no run measured it."""
    with_consensus = [run for run in runs if run.kind("consensus")]
    if not with_consensus:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for run in with_consensus:
        for stage, (times, values) in consensus(run).items():
            ax.plot(times, values, "o-", label=f"{run.label} stage {stage}")
    # on the runs' whole time axis: a short run's few global syncs are points in its time,
    # not spread over an axis of a few milliseconds
    ends = [m["time"] for run in with_consensus for m in run.kind("train")]
    if ends:
        ax.set_xlim(0, max(ends) * 1.02)
    ax.set_ylim(bottom=0)
    ax.set(xlabel=TIME_AXIS, ylabel="consensus distance", title="replica drift at global syncs")
    ax.legend(fontsize=7)
    return fig


def _stragglers_figure(plt, runs: Sequence[Run]):
    """Each straggler's compute per iteration over time (its ``busy_s``, where its lines carry
    it), marked where it was named and where it recovered; None if no run named one."""
    slowed = [run for run in runs if run.kind("straggler")]
    if not slowed:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for run in slowed:
        stages = int(run.config.get("pipeline.stages", 1))
        for device in sorted({(m["pipeline"], m["stage"], m["device"]) for m in run.kind("straggler")}):
            p, s, name = device
            mine = sorted((m for m in run.lines if m.get("pipeline") == p and "busy_s" in m
                           and m.get("kind") in ("train", "sync")
                           and m.get("stage", stages - 1) == s), key=lambda m: m["time"])
            line, = ax.plot([m["time"] for m in mine], [1e3 * m["busy_s"] for m in mine],
                            label=f"{run.label} {name} (p{p} s{s})")
            for m in run.kind("straggler") + run.kind("recovered"):
                if (m["pipeline"], m["stage"]) == (p, s):
                    ax.axvline(m["time"], color=line.get_color(),
                               linestyle="-" if m["kind"] == "straggler" else ":")
    ax.set(xlabel=TIME_AXIS, ylabel="compute per iteration (ms)",
           title="devices named slow (solid: named, dotted: recovered)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    return fig


def tolerance(runs: Sequence[Run]) -> dict[str, list[tuple[float, float]]]:
    """Each sync mode's fraction of the limit against the slowest pipeline's slowdown (the
    largest ``cluster.slowdown`` over the smallest), by series: the mode, and ``, N slow`` where
    more than one pipeline is slower than the fastest. The limit of a run is that of the
    ``sync=none`` run of the same slowdowns and seed among ``runs`` (without one, the run is
    left out); several seeds are averaged. Empty unless two slowdowns or more remain."""
    def alone(run: Run) -> bool:  # sync=none: every pipeline at its own pace, the limit
        name = str(run.config.get("sync.name"))
        return name in modes.MODES and modes.mode(name).exchange == "local"

    limits: dict[tuple, float] = {}
    for run in runs:
        if alone(run):
            got = analysis.limit(analysis.solo_rates(run.lines))
            if got:
                limits[_heterogeneity(run)] = got
    points: dict[tuple[str, float], list[float]] = {}
    for run in runs:
        key, mode = _heterogeneity(run), str(run.config.get("sync.name"))
        rate = analysis.samples_per_s(run.lines)
        if alone(run) or key not in limits or not rate:
            continue
        factors = json.loads(key[0]) or [1.0]
        slow = sum(f > min(factors) for f in factors)
        series = mode if slow <= 1 else f"{mode}, {slow} slow"
        points.setdefault((series, max(factors) / min(factors)), []).append(rate / limits[key])
    if len({x for _, x in points}) < 2:
        return {}
    out: dict[str, list[tuple[float, float]]] = {}
    for (series, x), fractions in sorted(points.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        out.setdefault(series, []).append((x, sum(fractions) / len(fractions)))
    return out


def _heterogeneity(run: Run) -> tuple[str, Any]:
    return str(run.config.get("cluster.slowdown", "[]")), run.config.get("train.seed")


def _tolerance_figure(plt, runs: Sequence[Run]):
    """The fraction of the limit against the slowest pipeline's slowdown, per sync mode
    (:func:`tolerance`); None without a sweep over heterogeneity."""
    series = tolerance(runs)
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for name, points in series.items():
        ax.plot([x for x, _ in points], [y for _, y in points], "o-", label=name)
    ax.set(xlabel="slowest pipeline's slowdown (x the fastest)", ylabel="fraction of the limit",
           title="throughput across heterogeneity (the limit: sync=none's solo rates summed)")
    ax.set_ylim(0, 1.05)
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.legend(fontsize=7)
    return fig


def default_out(runs: Sequence[Run], out: str | None) -> Path:
    """Where the figures go: ``--out``, or the first run's ``report/``; ConfigError (naming
    ``--out`` when given) if that or a folder above it is not a folder, before anything is written."""
    path = Path(out) if out else runs[0].path / "report"
    key = "--out" if out else str(path)
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        if folder.exists() or folder.is_symlink():
            what = "is" if folder == path else f"is under {folder}, which is"
            raise ConfigError(key, f"{f'{path} ' if out else ''}{what} not a folder; give a folder "
                                   "for the figures with --out (nothing was written)")
    return path
