"""The ``profile.json`` document: what ``sdpipe profile`` measured, and the block costs read from it.

``sdpipe profile`` (:mod:`sdpipe_cli.hetero.profiler`) writes it into the run folder; ``profile=PATH``
gives it to ``pipeline.partition=auto`` and to modelled emulation. Schema (``format`` 1; times in
milliseconds, sizes in bytes unless the name says otherwise)::

    format          "sdpipe-profile/1"
    created, torch  when (ISO 8601, UTC), and with which torch version
    model           {name, arch, blocks, block_names[], block_params[], microbatch_size, seq_len,
                     activation_bytes}
    cluster         {name, emulation ("measured": the real compute's time divided by the device's
                     speed), pipelines, stages, device ("cpu" | "cuda"),
                     links {same_node, cross_node: {latency_ms, bandwidth_gbps (null: not
                     emulated)}}}
    devices[]       one per worker: {name ("node:index"), node, speed (as configured), rank,
                     pipeline, stage, forward_ms[], backward_ms[] (one per model block, at the
                     micro-batch size, emulated speed included), peak_memory_mb,
                     memory_source ("rss" | "cuda_max_allocated")}
    p2p[]           one per pair of pipeline neighbours: {src, dst (device names), src_rank,
                     dst_rank, src_node, dst_node, link ("same_node" | "cross_node"),
                     latency_ms, bandwidth_gbps, bytes (of the bandwidth message)}
    links[]         the same, one per pair of nodes (replicas of one stage where the two nodes
                     hold some; beyond 8 nodes, each node with the first); empty on one node;
                     absent from profiles written before it was measured
    allreduce[]     {stage, group_size (2..P), ranks[], bytes (the stage's weights), ms}

Every time is the minimum over repeats (other processes on a shared machine only add time; see
:mod:`sdpipe_cli.hetero.profiler`); the head's forward includes the loss. ``speed`` is the
device's speed at the start of a run (``cluster.changes`` may name a later one); the pipelines'
``cluster.slowdown`` factors and random stragglers are not in the times (they belong to a run, and
whoever reads the profile applies them). ``peak_memory_mb`` is the profiling process's peak (the
whole model's blocks at one micro-batch, plus the message buffers). ``latency_ms`` is half the
round trip of a 4-byte message; ``bandwidth_gbps`` (Gbit/s) comes from the difference
between a ``bytes`` message acknowledged by the receiver and that round trip, so latency cancels
out; it is null where that difference was lost in the noise. Emulated links
(``cluster.links``) are in both, and in the all-reduce times.

Block costs are per device; a device the profile did not measure gets the median of the measured
ones, normalized to speed 1.0 and divided by its own speed.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

FORMAT = "sdpipe-profile/1"
REQUIRED = ("format", "model", "cluster", "devices", "p2p", "allreduce")
DEVICE_FIELDS = ("name", "node", "speed", "rank", "pipeline", "stage", "forward_ms",
                 "backward_ms", "peak_memory_mb", "memory_source")
P2P_FIELDS = ("src", "dst", "src_rank", "dst_rank", "link", "latency_ms", "bandwidth_gbps", "bytes")
ALLREDUCE_FIELDS = ("stage", "group_size", "ranks", "bytes", "ms")


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and what is wrong."""


def path_of(path: str | Path) -> Path:
    """The file ``profile=PATH`` names: PATH, or ``PATH/profile.json`` for a run folder."""
    path = Path(path).expanduser()
    return path / "profile.json" if path.is_dir() else path


def load(path: str | Path) -> dict:
    """Read and check a ``profile.json``; raises :class:`ProfileError` naming the file."""
    path = path_of(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"'{path}' does not exist (run `sdpipe profile` first)") from None
    except (OSError, ValueError) as err:
        raise ProfileError(f"'{path}' is not a readable profile: {err}") from None
    if not isinstance(doc, dict):
        raise ProfileError(f"'{path}' is not a profile (expected a JSON object)")
    missing = [k for k in REQUIRED if k not in doc]
    if missing:
        raise ProfileError(f"'{path}' lacks {', '.join(missing)}")
    if doc["format"] != FORMAT:
        raise ProfileError(f"'{path}' has format {doc['format']!r}; this sdpipe reads {FORMAT!r}")
    blocks = doc["model"].get("blocks")
    for d in doc["devices"]:
        lacking = [k for k in DEVICE_FIELDS if k not in d]
        if lacking:
            raise ProfileError(f"'{path}': device {d.get('name', '?')} lacks {', '.join(lacking)}")
        if len(d["forward_ms"]) != blocks or len(d["backward_ms"]) != blocks:
            raise ProfileError(f"'{path}': device {d['name']} has block times for "
                               f"{len(d['forward_ms'])} blocks, the model has {blocks}")
    if not doc["devices"]:
        raise ProfileError(f"'{path}' measured no device")
    for section, fields in (("p2p", P2P_FIELDS), ("links", P2P_FIELDS),
                            ("allreduce", ALLREDUCE_FIELDS)):
        for n, entry in enumerate(doc.get(section, [])):
            lacking = [k for k in fields if k not in entry]
            if lacking:
                raise ProfileError(f"'{path}': {section}[{n}] lacks {', '.join(lacking)}")
    doc["_path"] = str(path)
    return doc


def write(doc: dict, run_dir: str | Path) -> Path:
    """Write ``<run_dir>/profile.json`` atomically (a reader never sees half a document)."""
    path = Path(run_dir) / "profile.json"
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(doc, indent=1) + "\n")
    partial.replace(path)
    return path


def check_model(doc: dict, model_name: str, blocks: int | None, microbatch_size: int) -> None:
    """The profile must have measured the model being trained, at its micro-batch size
    (``blocks``: None for a custom model not built yet; the launcher checks its count)."""
    m = doc["model"]
    if (blocks is not None and m["blocks"] != blocks) or m.get("name") != model_name:
        raise ProfileError(f"'{doc['_path']}' profiled model {m.get('name')} ({m['blocks']} blocks), "
                           f"not {model_name} ({blocks} blocks); profile this model")
    if m.get("microbatch_size") != microbatch_size:
        raise ProfileError(f"'{doc['_path']}' was measured at micro-batch size "
                           f"{m.get('microbatch_size')}, this run uses {microbatch_size}; profile "
                           "with the same train.batch_size / pipeline.microbatches")


def block_costs(doc: dict, device: str | None = None, speed: float = 1.0) -> tuple[list[float], list[float]]:
    """(forward_ms, backward_ms) per block on ``device`` running at ``speed``.

    A device the profile measured keeps its measurements, rescaled if its speed was configured
    differently then; any other device gets the median over the measured devices at speed 1.0,
    divided by ``speed``.
    """
    measured = {d["name"]: d for d in doc["devices"]}
    if device in measured:
        d = measured[device]
        scale = float(d["speed"]) / speed
        return ([x * scale for x in d["forward_ms"]], [x * scale for x in d["backward_ms"]])
    blocks = doc["model"]["blocks"]
    fwd = [statistics.median(d["forward_ms"][b] * float(d["speed"]) for d in doc["devices"]) / speed
           for b in range(blocks)]
    bwd = [statistics.median(d["backward_ms"][b] * float(d["speed"]) for d in doc["devices"]) / speed
           for b in range(blocks)]
    return fwd, bwd


def worker_block_ms(doc: dict, cluster, slowdown: list | None = None) -> list[list[list[float]]]:
    """``[p][s][i]``: forward + backward time of block i on the device of pipeline p's stage s
    (a :class:`~sdpipe_cli.core.cluster.Cluster`), at the device's speed at the start of the run and
    with the pipeline's ``cluster.slowdown`` factor."""
    out = []
    for p in range(cluster.pipelines):
        factor = float(slowdown[p]) if slowdown else 1.0
        row = []
        for s in range(cluster.stages):
            device = cluster.device(p, s)
            fwd, bwd = block_costs(doc, device.name, cluster.speed(device, 0.0))
            row.append([(f + b) * factor for f, b in zip(fwd, bwd)])
        out.append(row)
    return out
