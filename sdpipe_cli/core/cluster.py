"""The cluster a run is placed on: nodes, devices, placement, speeds over time, links.

A cluster config (``configs/cluster/*.yaml``) lists nodes and their devices; every worker
(pipeline p, stage s) is placed on one device, explicitly (``cluster.placement``) or by default
(:func:`default_placement`): each pipeline on one node when one has room, pipelines spread over
the nodes, so activations stay on fast local links and replicas (which average weights) meet
across nodes. Without nodes the cluster is one
node, ``local``, with one device of speed 1.0 per worker.

Nodes are emulated on this machine unless they give a ``host``: then they are real machines, each
running its own launcher (``run.node``), and the first one hosts the store.

Everything here is pure: :class:`Cluster` answers "which device", "how fast at run time t",
"which link between these ranks" and "how long does this transfer take on it". The emulation
(:mod:`sdpipe_cli.hetero.emulation`) and the transports ask it; nothing here sleeps or sends.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from omegaconf import DictConfig, OmegaConf

from sdpipe_cli.core.errors import BadInput
from sdpipe_cli.core.placement import Grid

LOCAL = "local"
# The most an emulation slows a worker by any one cause: a device's speed (cluster.nodes,
# cluster.changes) is at least its inverse, a pipeline's slow-down and a straggler's factor at
# most this. A worker sleeps its action's time times their product (hetero/emulation.py): bounded
# so, a sleep stays within what the clock can count (a speed of 1e-300 overflowed it) and a run
# within a human lifetime.
MAX_SLOWDOWN = 100.0
# cluster.links: an emulated message sleeps latency + bytes / bandwidth; past an hour a sleep, or
# a deadline computed from it, overflows the clock (a latency of 1e300 ms crashed the workers)
MAX_LATENCY_MS = 3_600_000.0
MIN_BANDWIDTH_GBPS = 1e-6  # 1 kbit/s


@dataclass(frozen=True)
class Device:
    name: str  # "node:index"
    node: str
    index: int  # position within its node (the CUDA device index on a real node)
    speed: float = 1.0
    memory_gib: float | None = None


@dataclass(frozen=True)
class Link:
    """An emulated link class: ``latency_s`` per message plus size over ``bandwidth`` (bytes/s)."""

    kind: str  # same_node | cross_node | same_device
    latency_s: float = 0.0
    bandwidth: float | None = None  # bytes per second; None: not emulated

    @property
    def emulated(self) -> bool:
        return self.latency_s > 0 or self.bandwidth is not None

    def transfer_s(self, nbytes: int) -> float:
        """Time one message of ``nbytes`` takes on this link (0 where nothing is emulated)."""
        return self.latency_s + (nbytes / self.bandwidth if self.bandwidth else 0.0)


@dataclass(frozen=True)
class SpeedChange:
    """A device's speed from ``start`` to ``end`` seconds of the run clock, or, where
    ``start_step`` is set, from that iteration of its pipeline to ``end_step``: a change at an
    iteration comes at the same point of the training however long the start-up took."""

    device: str
    speed: float
    start: float
    end: float | None = None
    start_step: int | None = None
    end_step: int | None = None

    def active(self, t: float, step: int | None = None) -> bool:
        if self.start_step is not None:
            return step is not None and self.start_step <= step and (
                self.end_step is None or step < self.end_step)
        return self.start <= t and (self.end is None or t < self.end)


class EmulatedStragglers:
    """Random slow-downs: each draw is ``factor`` with ``probability``, else 1.0. Seeded by
    (seed, device) where runs use it, so the emulation and the simulator draw the same ones."""

    def __init__(self, probability: float, factor: float, seed: object = 0):
        self.probability, self.factor = probability, factor
        self._rng = random.Random(str(seed))

    def draw(self) -> float:
        return self.factor if self._rng.random() < self.probability else 1.0

    @classmethod
    def of_device(cls, section, seed: int, device: str) -> EmulatedStragglers | None:
        """The draws of ``device`` under a ``cluster.stragglers`` section (None: not a straggler)."""
        if not (section.probability > 0 and section.factor != 1.0):
            return None
        if section.devices and device not in section.devices:
            return None
        return cls(section.probability, section.factor, f"{seed}/{device}")


def default_placement(devices: Sequence[Device], pipelines: int, stages: int) -> list[list[str]]:
    """Each pipeline on one node when one has room: the node with the most free devices (the
    first in config order on ties), so pipelines spread over the nodes and their activations stay
    on fast local links; what does not fit takes the free devices in node order."""
    names: dict[str, list[str]] = {}
    for d in devices:
        names.setdefault(d.node, []).append(d.name)
    taken = {n: 0 for n in names}  # a node's devices are taken in order: the first ``taken[n]``
    placement = []
    for _ in range(pipelines):
        left = {n: len(names[n]) - taken[n] for n in names}
        roomy = [n for n in names if left[n] >= stages]
        if roomy:
            node = max(roomy, key=lambda n: left[n])  # max keeps the first on ties
            row = names[node][taken[node]:taken[node] + stages]
            taken[node] += stages
        else:
            row = []
            for n in names:
                take = min(stages - len(row), left[n])
                row += names[n][taken[n]:taken[n] + take]
                taken[n] += take
        placement.append(row)
    return placement


class ClusterError(BadInput):
    """A cluster description that cannot be placed; ``key`` names the setting."""


def _check_speed(speed: float, key: str) -> None:
    if not speed > 0:
        raise ClusterError(key, "must be positive (1.0 = as measured)")
    if speed < 1 / MAX_SLOWDOWN:
        raise ClusterError(key, f"is {speed:g}; must be at least {1 / MAX_SLOWDOWN:g} (a device "
                           f"at most {MAX_SLOWDOWN:g} times slower than measured)")


def _change(ch: dict, key: str, names: list[str]) -> SpeedChange:
    """One entry of ``cluster.changes`` (``key``), on one of the devices ``names``."""
    if str(ch["device"]) not in names:
        raise ClusterError(f"{key}.device", f"no device '{ch['device']}' (devices: "
                           f"{', '.join(names)})")
    _check_speed(ch["speed"], f"{key}.speed")
    start, end = ch["start"], ch["end"]
    first, last = ch.get("start_step"), ch.get("end_step")
    if start < 0:
        raise ClusterError(f"{key}.start", f"is {start}; must be >= 0 (seconds of the run)")
    if end is not None and end <= start:
        raise ClusterError(f"{key}.end", f"is {end}; must be after start ({start} s)")
    if first is None and last is not None:
        raise ClusterError(f"{key}.end_step", "needs start_step (a change is timed in seconds "
                           "or in iterations, not both)")
    if first is not None:
        if start or end is not None:
            raise ClusterError(f"{key}.start_step", "a change is timed in seconds (start, end) "
                               "or in iterations (start_step, end_step), not both")
        if first < 0:
            raise ClusterError(f"{key}.start_step", f"is {first}; must be >= 0 (an iteration)")
        if last is not None and last <= first:
            raise ClusterError(f"{key}.end_step", f"is {last}; must be after start_step "
                               f"({first})")
    return SpeedChange(str(ch["device"]), float(ch["speed"]), float(start),
                       None if end is None else float(end),
                       None if first is None else int(first), None if last is None else int(last))


class Cluster:
    """Devices, the P x S placement of workers on them, speed changes and links."""

    def __init__(self, devices: Sequence[Device], placement: Sequence[Sequence[str]],
                 changes: Sequence[SpeedChange] = (), links: dict[str, Link] | None = None,
                 hosts: dict[str, str | None] | None = None):
        self.devices = {d.name: d for d in devices}
        self.hosts = {k: v for k, v in (hosts or {}).items() if v}  # real nodes' addresses
        self.placement = [list(row) for row in placement]
        self.pipelines = len(self.placement)
        self.stages = len(self.placement[0]) if self.placement else 0
        self.changes = list(changes)
        # each device's changes in list order: a worker asks for its speed at every action
        self._changes_of: dict[str, list[SpeedChange]] = {}
        for change in self.changes:
            self._changes_of.setdefault(change.device, []).append(change)
        self.links = links or {}
        # rank -> its node: a ring's slowest link is looked up once per simulated round
        self._node_of_rank = [self.devices[name].node for row in self.placement for name in row]

    @classmethod
    def from_config(cls, cluster: DictConfig | dict, stages: int) -> Cluster:
        """The cluster of a (validated) ``cluster`` config section, or of its plain container,
        which is what it reads: a config node's every key costs microseconds, and a schedule of
        thousands of changes would cost seconds in every process; raises :class:`ClusterError`."""
        if OmegaConf.is_config(cluster):
            cluster = cast(dict, OmegaConf.to_container(cluster, resolve=True))
        P, S = int(cluster["pipelines"]), stages
        nodes = list(cluster["nodes"])
        if nodes:
            devices, seen = [], set()
            for n, node in enumerate(nodes):
                name = str(node["name"])
                if name in seen:
                    raise ClusterError(f"cluster.nodes[{n}].name", f"'{name}' names two nodes")
                if not node["devices"]:
                    raise ClusterError(f"cluster.nodes[{n}].devices", f"node '{name}' has no devices")
                seen.add(name)
                for i, dev in enumerate(node["devices"]):
                    key = f"cluster.nodes[{n}].devices[{i}]"
                    _check_speed(dev["speed"], f"{key}.speed")
                    if dev["memory"] is not None and not dev["memory"] > 0:
                        raise ClusterError(f"{key}.memory", "must be positive GiB (or null)")
                    devices.append(Device(f"{name}:{i}", name, i, float(dev["speed"]),
                                          None if dev["memory"] is None else float(dev["memory"])))
        else:
            devices = [Device(f"{LOCAL}:{i}", LOCAL, i) for i in range(P * S)]
        names = [d.name for d in devices]
        if len(cluster["placement"]):
            placement = [[str(x) for x in row] for row in cluster["placement"]]
            if len(placement) != P or any(len(row) != S for row in placement):
                raise ClusterError("cluster.placement", f"must be {P} lists (one per pipeline) of "
                                   f"{S} device names (one per stage)")
            for row in placement:
                for name in row:
                    if name not in names:
                        raise ClusterError("cluster.placement", f"no device '{name}' (devices: "
                                           f"{', '.join(names)})")
        else:
            if len(devices) < P * S:
                raise ClusterError("cluster.nodes", f"{len(devices)} devices for P x S = {P * S} "
                                   "workers; add devices or give cluster.placement")
            placement = default_placement(devices, P, S)
        flat = [name for row in placement for name in row]
        if len(set(flat)) != len(flat):
            twice = sorted({n for n in flat if flat.count(n) > 1})
            raise ClusterError("cluster.placement", f"device {twice[0]} holds two workers; "
                               "give each worker its own device")
        changes = [_change(ch, f"cluster.changes[{k}]", names)
                   for k, ch in enumerate(cluster["changes"])]
        links = {}
        for kind in ("same_node", "cross_node"):
            link = cluster["links"][kind]
            latency, bandwidth = link["latency_ms"], link["bandwidth_gbps"]
            if not 0 <= latency <= MAX_LATENCY_MS:
                raise ClusterError(f"cluster.links.{kind}.latency_ms", f"is {latency:g}; must be in "
                                   f"[0, {MAX_LATENCY_MS:g}] (an hour)")
            if bandwidth is not None and not bandwidth >= MIN_BANDWIDTH_GBPS:
                raise ClusterError(f"cluster.links.{kind}.bandwidth_gbps", f"must be at least "
                                   f"{MIN_BANDWIDTH_GBPS:g} (1 kbit/s; or null: not emulated)")
            links[kind] = Link(kind, latency / 1000.0, None if bandwidth is None else bandwidth * 1e9 / 8)
        hosts = {str(n["name"]): (None if n.get("host") is None else str(n["host"])) for n in nodes}
        return cls(devices, placement, changes, links, hosts)

    # -- placement --------------------------------------------------------------------------
    def device(self, pipeline: int, stage: int) -> Device:
        return self.devices[self.placement[pipeline][stage]]

    def device_of_rank(self, rank: int) -> Device:
        where = Grid(self.pipelines, self.stages).at(rank)
        return self.device(where.pipeline, where.stage)

    def ranks_on(self, node: str) -> list[int]:
        """The workers placed on ``node``."""
        grid = Grid(self.pipelines, self.stages)
        return [grid.rank(p, s) for p in range(self.pipelines) for s in range(self.stages)
                if self.device(p, s).node == node]

    def split_pipelines(self) -> list[int]:
        """The pipelines whose stages are on more than one node."""
        return [p for p in range(self.pipelines)
                if len({self.device(p, s).node for s in range(self.stages)}) > 1]

    @property
    def real(self) -> bool:
        """Whether the nodes are real machines (each runs its own launcher)."""
        return bool(self.hosts)

    @property
    def nodes(self) -> list[str]:
        """Node names in config order."""
        return list(dict.fromkeys(d.node for d in self.devices.values()))

    # -- speed ------------------------------------------------------------------------------
    def speed(self, device: Device, t: float = 0.0, step: int | None = None) -> float:
        """The device's speed at ``t`` seconds of the run, in iteration ``step`` of its
        pipeline: the last active change wins."""
        for change in reversed(self._changes_of.get(device.name, ())):
            if change.active(t, step):
                return change.speed
        return device.speed

    def change_points(self, device: Device) -> list[float]:
        """Where the device's speed may change: seconds of the run, or iterations of its
        pipeline for a change timed so (its speed changes during the run where any)."""
        points: set[float] = set()
        for c in self._changes_of.get(device.name, ()):
            edges = (c.start_step, c.end_step) if c.start_step is not None else (c.start, c.end)
            points.update(float(x) for x in edges if x is not None)
        return sorted(points)

    @property
    def max_speed(self) -> float:
        speeds = [d.speed for d in self.devices.values()] + [c.speed for c in self.changes]
        return max(speeds) if speeds else 1.0

    # -- links ------------------------------------------------------------------------------
    def link(self, rank_a: int, rank_b: int) -> Link:
        """The link class between two workers' devices."""
        a, b = self.device_of_rank(rank_a), self.device_of_rank(rank_b)
        kind = "same_node" if a.node == b.node else "cross_node"
        return self.links.get(kind, Link(kind))

    def slowest_link(self, ranks: Sequence[int]) -> Link:
        """The link a ring over ``ranks`` is bound by: cross-node if the members span nodes."""
        node_of = self._node_of_rank
        nodes = {node_of[r] for r in ranks}
        kind = "cross_node" if len(nodes) > 1 else "same_node"
        return self.links.get(kind, Link(kind))

    def allreduce_s(self, ranks: Sequence[int], nbytes: float) -> float:
        """Emulated time of a ring all-reduce of ``nbytes`` over ``ranks``.

        A ring moves 2(n-1)/n of the data through every member's link in 2(n-1) steps, so it
        costs 2(n-1) latencies plus 2(n-1)/n x size / bandwidth on the slowest link it uses.
        """
        n = len(ranks)
        if n < 2:
            return 0.0
        link = self.slowest_link(ranks)
        steps = 2 * (n - 1)
        return steps * link.latency_s + (steps / n * nbytes / link.bandwidth if link.bandwidth else 0.0)

    @property
    def links_emulated(self) -> bool:
        return any(link.emulated for link in self.links.values())
