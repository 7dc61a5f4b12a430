"""The figures derived from a run's metrics lines, each defined once (see the package's docstring).

Part of :mod:`sdpipe_cli.analysis` (import from there)."""

from __future__ import annotations

import statistics
from bisect import bisect_right
from collections.abc import Iterable
from typing import Any

from sdpipe_cli.analysis.reading import Line, by_time, first_iteration_began, first_train_time, of_kind, pipelines
from sdpipe_cli.core import modes


# -- throughput ------------------------------------------------------------------------------
def last_by_pipeline(lines: Iterable[Line], key: str) -> dict[int, Any]:
    """Each pipeline's value of ``key`` in its latest line (by time)."""
    out: dict[int, Any] = {}
    for m in by_time(lines):
        out[int(m["pipeline"])] = m[key]
    return dict(sorted(out.items()))


def iterations(lines: Iterable[Line]) -> dict[int, int]:
    """Each pipeline's last iteration (its latest train line's ``step``)."""
    return last_by_pipeline(of_kind(lines, "train"), "step")


def samples_per_s(lines: Iterable[Line]) -> float | None:
    """A run's samples/s, all pipelines: each pipeline's samples after its own first train line,
    summed, over the seconds from the earliest train line to the latest (module docstring)."""
    train = by_time(of_kind(lines, "train"))
    if not train:
        return None
    first: dict[int, Line] = {}
    for m in train:
        first.setdefault(int(m["pipeline"]), m)
    last = last_by_pipeline(train, "samples")
    window = train[-1]["time"] - train[0]["time"]
    return sum(last[p] - first[p]["samples"] for p in last) / window if window > 0 else None


def solo_rates(lines: Iterable[Line], steps: tuple[int, int] | None = None
               ) -> dict[int, float]:
    """Each pipeline's own samples/s: its samples over its own first-to-last train line span
    (from the end of its first iteration), or with ``steps=(a, b)`` between the ends of its
    iterations a and b. A pipeline with less than a positive span is left out."""
    spans: dict[int, list[Line]] = {}
    for m in by_time(of_kind(lines, "train")):
        if steps is None or steps[0] <= m["step"] <= steps[1]:
            spans.setdefault(int(m["pipeline"]), []).append(m)
    rates = {}
    for p, rows in sorted(spans.items()):
        dt = rows[-1]["time"] - rows[0]["time"]
        if dt > 0:
            rates[p] = (rows[-1]["samples"] - rows[0]["samples"]) / dt
    return rates


def limit(rates: dict[int, float]) -> float | None:
    """The heterogeneity limit: the :func:`solo_rates` of a ``sync=none`` run, summed (every
    pipeline at its own pace, nobody waiting)."""
    return sum(rates.values()) if rates else None


def fraction_of_limit(rate: float | None, limit_: float | None) -> float | None:
    """``rate`` (:func:`samples_per_s`) as a share of the limit (:func:`limit`)."""
    return rate / limit_ if rate and limit_ else None


def steady_rates(lines: Iterable[Line]) -> dict[int, float]:
    """Each pipeline's median per-iteration rate, batch / ``step_s`` over its iterations after
    the first: robust to a passing load on a shared machine."""
    train = of_kind(lines, "train")
    if not train:
        return {}
    last = {m["pipeline"]: m for m in train}
    batch = {p: m["samples"] // m["step"] for p, m in last.items()}  # a pipeline's own (balance)
    return {p: statistics.median(batch[p] / m["step_s"] for m in train
                                 if m["pipeline"] == p and m["step"] > 1)
            for p in pipelines(train)}


# -- loss ------------------------------------------------------------------------------------
def final_val_loss(lines: Iterable[Line]) -> float | None:
    """The mean over pipelines of each pipeline's last ``val_loss``."""
    last = last_by_pipeline(of_kind(lines, "eval"), "val_loss")
    return sum(last.values()) / len(last) if last else None


def final_val_accuracy(lines: Iterable[Line]) -> float | None:
    """The mean over pipelines of each pipeline's last ``val_accuracy`` (classifiers); None for a
    run whose evaluations carry none."""
    evals = [m for m in of_kind(lines, "eval") if m.get("val_accuracy") is not None]
    last = last_by_pipeline(evals, "val_accuracy")
    return sum(last.values()) / len(last) if last else None


def val_loss_curve(lines: Iterable[Line], pipelines_: int | None = None) -> list[list[float]]:
    """[time, mean over pipelines of their latest val_loss] at each evaluation once all of them
    (``pipelines_``, default: those with train lines) have evaluated."""
    lines = list(lines)
    count = pipelines_ or len(pipelines(lines))
    latest: dict[int, float] = {}
    curve = []
    for m in by_time(of_kind(lines, "eval")):
        latest[int(m["pipeline"])] = m["val_loss"]
        if len(latest) == count:
            curve.append([round(m["time"], 4), sum(latest.values()) / count])
    return curve


# losses this close (relative) are the same loss: a validation loss is a mean of float32 losses, and
# the same training with its sums in another order (a group's average of weights and gradients, an
# all-reduce of gradients) lands a few float32 roundings (1.2e-7 each) away
SAME_LOSS = 1e-6


def time_to_loss(curve: list[list[float]], target: float | None,
                 start: float | None) -> float | None:
    """Seconds from ``start`` (the run's :func:`first_train_time`) to the first point of
    ``curve`` (:func:`val_loss_curve`) at or below ``target``, within :data:`SAME_LOSS`; None if
    never reached."""
    if target is None or start is None:
        return None
    reached = target + SAME_LOSS * abs(target)
    return next((t - start for t, loss in curve if loss <= reached), None)


def mean_loss(lines: Iterable[Line]) -> tuple[list[float], list[float], list[float]]:
    """(times, samples, loss): after each logged step, the samples all pipelines have seen and
    the mean of each pipeline's latest training loss. Pipelines at different speeds (sdpipe) are
    compared at equal time, not at equal step."""
    latest: dict[int, tuple[float, float]] = {}
    times, samples, loss = [], [], []
    for m in by_time(of_kind(lines, "train")):
        if m.get("loss") is None:
            continue
        latest[m["pipeline"]] = (m["samples"], m["loss"])
        times.append(m["time"])
        samples.append(sum(n for n, _ in latest.values()))
        loss.append(sum(v for _, v in latest.values()) / len(latest))
    return times, samples, loss


def lowest_loss(lines: list[Line]) -> tuple[float, float] | None:
    """(the lowest :func:`mean_loss`, seconds from the first iteration's start to it)."""
    times, _, loss = mean_loss(lines)
    if not loss:
        return None
    best = min(range(len(loss)), key=loss.__getitem__)
    return loss[best], times[best] - (first_iteration_began(lines) or 0.0)


def validation(lines: list[Line]) -> tuple[list[float], list[float], list[float]]:
    """(times, samples, val_loss): each evaluation, with the samples all pipelines had seen."""
    times, seen, _ = mean_loss(lines)
    evals = by_time(of_kind(lines, "eval"))
    at = [seen[max(bisect_right(times, m["time"]) - 1, 0)] if seen else 0 for m in evals]
    return [m["time"] for m in evals], at, [m["val_loss"] for m in evals]


# -- sync ------------------------------------------------------------------------------------
def sync_times(lines: Iterable[Line]) -> dict[str, list[float]]:
    """Seconds per update spent waiting for a group and in the group all-reduce (sdpipe), or
    syncing (the other modes), over every stage's lines."""
    lines = list(lines)
    ours = of_kind(lines, "train") + of_kind(lines, "sync")
    if any("wait_s" in m and "comm_s" in m for m in ours):
        return {"wait for the group": [m["wait_s"] for m in ours if "wait_s" in m],
                "group all-reduce": [m["comm_s"] for m in ours if "comm_s" in m]}
    return {"sync": [m["sync_s"] for m in ours if "sync_s" in m]}


def mean_group_size(lines: Iterable[Line], mode: str | None = None,
                    pipelines_: int | None = None) -> float | None:
    """The mean ``size`` of the scheduler's group lines (global rounds included); without any,
    P for a mode whose replicas all meet every iteration and 1 for one whose never meet, by
    definition, else None."""
    sizes = [m["size"] for m in of_kind(lines, "group")]
    if sizes:
        return sum(sizes) / len(sizes)
    exchange = modes.MODES[mode].exchange if mode in modes.MODES else None
    if exchange == "everyone" and pipelines_:
        return float(pipelines_)
    return 1.0 if exchange == "local" else None


def consensus(lines: list[Line]) -> dict[int, tuple[list[float], list[float]]]:
    """Per stage: (times, consensus distances) at its global syncs; a measurement without a time
    is timed by its round's group line."""
    when = {(g["stage"], g["round"]): g["time"] for g in of_kind(lines, "group")}
    out: dict[int, tuple[list[float], list[float]]] = {}
    for c in of_kind(lines, "consensus"):
        t = c.get("time", when.get((c["stage"], c.get("round"))))
        if t is not None:
            times, values = out.setdefault(c["stage"], ([], []))
            times.append(t)
            values.append(c["consensus"])
    return dict(sorted(out.items()))


def overrun_fraction(lines: Iterable[Line], microbatches: int | None) -> float | None:
    """Share of forward/backward actions whose real compute exceeded the modelled budget."""
    done = [m for m in of_kind(lines, "done") if "slowdown_overruns" in m]
    actions = sum(2 * (microbatches or 0) * m.get("steps", 0) for m in done)
    if not done or not actions:
        return None
    return sum(m["slowdown_overruns"] for m in done) / actions


def sync_traffic(done: Iterable[Line], samples: float | None) -> dict[str, Any]:
    """What the sync of a run put on the wire, from its workers' ``done`` lines (each carries its
    ``traffic``: per link class, bytes sent and received and seconds in sync collectives, and its
    ``wall_s``): ``traffic`` summed per link class, ``sync_bytes_per_sample`` (bytes every worker
    sent over the ``samples`` the run trained), ``cross_node_bytes_per_sample`` (of which on links
    between nodes) and ``comm_share`` (the workers' seconds in sync collectives over their
    seconds alive); empty where no worker reported its traffic."""
    reports = [d for d in done if isinstance(d.get("traffic"), dict)]
    if not reports:
        return {}
    links: dict[str, dict[str, float]] = {}
    for report in reports:
        for link, row in report["traffic"].items():
            total = links.setdefault(link, {"sent_bytes": 0, "recv_bytes": 0, "seconds": 0.0})
            for name in total:
                total[name] += row.get(name, 0) if isinstance(row, dict) else 0
    alive = sum(report.get("wall_s") or 0.0 for report in reports)

    def per_sample(nbytes: float) -> float | None:
        return nbytes / samples if samples else None

    return {"traffic": links,
            "sync_bytes_per_sample": per_sample(sum(r["sent_bytes"] for r in links.values())),
            "cross_node_bytes_per_sample": per_sample(links.get("cross_node", {}).get("sent_bytes", 0)),
            "comm_share": sum(r["seconds"] for r in links.values()) / alive if alive else None}


def analyse(lines: list[Line], mode: str | None = None, pipelines_: int | None = None,
            microbatches: int | None = None) -> dict[str, Any]:
    """A benchmark run's figures, all but time to a target known only later (keep ``curve`` and
    ``first_train_s`` for :func:`time_to_loss`)."""
    return {
        "samples_per_s": samples_per_s(lines),
        "first_train_s": first_train_time(lines),
        "final_val_loss": final_val_loss(lines),
        "final_val_accuracy": final_val_accuracy(lines),
        "curve": val_loss_curve(lines, pipelines_),
        "mean_group_size": mean_group_size(lines, mode, pipelines_),
        "iterations": iterations(lines),
        "overrun_fraction": overrun_fraction(lines, microbatches),
        **sync_traffic(of_kind(lines, "done"),
                       sum(last_by_pipeline(of_kind(lines, "train"), "samples").values())),
    }


def outcome(lines: list[Line]) -> dict[str, float | None]:
    """A run's headline figures, for a table of runs (the sweep's): ``loss`` (the last
    :func:`mean_loss`), ``val_loss`` (:func:`final_val_loss`), ``samples_per_s``, and
    ``best_loss``, ``best_loss_s`` (:func:`lowest_loss`); None where the run has none yet."""
    loss = mean_loss(lines)[2]
    best = lowest_loss(lines)
    return {"loss": loss[-1] if loss else None, "val_loss": final_val_loss(lines),
            "samples_per_s": samples_per_s(lines), "best_loss": best and best[0],
            "best_loss_s": best and best[1]}
