"""Measuring a cluster for ``sdpipe profile``: one process per worker, placed as training places it.

Started by the launcher as ``python -m sdpipe_cli.hetero.profiler``, P x S times, with the
environment, device and process group of a training worker
(:func:`sdpipe_cli.runtime.bootstrap.joined`; no scheduler). Each process measures what
training will cost on its device, and rank 0 writes ``<run>/profile.json`` (the schema is in
:mod:`sdpipe_cli.config.measurements`):

1. **blocks**: the process builds the whole model and times each block's forward and backward
   at the micro-batch size (``train.batch_size // pipeline.microbatches``): token ids into block
   0, activations of :func:`~sdpipe_cli.model.models.activation_shape` into the others, a random output
   gradient for the backward, and the head's forward through ``loss_fn`` (as the last stage does).
   Untimed warm-ups, then the minimum over up to :data:`REPEATS` repeats (see below).
2. **peak memory**: :meth:`~sdpipe_cli.hetero.emulation.MemoryLimit.peak_mb` (RSS on CPU, the allocator's
   maximum on CUDA), the process's peak over the whole profile.
3. **p2p**, for each pair of pipeline neighbours: a ping-pong of a 4-byte message (latency: half
   the shortest round trip) and a :data:`BANDWIDTH_BYTES` message acknowledged by the receiver
   (bandwidth: the extra bytes over the extra time, so that latency cancels out).
4. **links between nodes**: the same two measurements between each pair of nodes (:func:`node_pairs`):
   what the group rounds of a stage's replicas cross, so that a slow link between two machines
   shows by name. Beyond :data:`MAX_NODES_PAIRED` nodes, each node's link to the first one.
5. **all-reduce**: for each stage s and group size k = 2..P, the replicas of stage s in pipelines
   0..k-1 all-reduce a flat float32 tensor the size of stage s's weights (under the configured
   partition), through the same :class:`~sdpipe_cli.sync.strategies.GroupCache` as training.

Measurements take turns: one worker (or one pair, or one group) measures while all the others wait
at a barrier, so that on a shared machine a number is not inflated by the others' compute. The
list of turns (:func:`turns`) is the same on every rank. Every time kept is the minimum over the
repeats, not the median: processes outside the run only ever add time (a 1 ms block that loses the
core for a scheduler time slice takes several), and on a loaded machine most repeats can be hit.
On the 2-core development machine under load, medians of the same layer on identical devices came
out up to 7x apart; minima stay within tens of percent. The profile describes the devices, not the
load they happened to share.

Emulation shows up as it would in training. A device's ``speed`` goes through the same
:class:`~sdpipe_cli.hetero.emulation.EmulatedSlowdown` (measured mode): the profile records
``EmulatedSlowdown.target``, the time the action must take, rather than sleeping it, because a sleep would
only add the timer's overshoot to sub-millisecond blocks (and could not emulate a speed above 1).
Links are emulated by :func:`~sdpipe_cli.hetero.emulation.link_delay` on every send and by the group
cache's all-reduce delay: those sleeps are inside the measured time.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from sdpipe_cli.config import measurements
from sdpipe_cli.core.interleaved import stage_blocks
from sdpipe_cli.core.placement import Grid, Placement
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.core.schedule import Action, Kind
from sdpipe_cli.data import sources
from sdpipe_cli.hetero.emulation import EmulatedSlowdown, MemoryLimit, link_delay
from sdpipe_cli.model import models
from sdpipe_cli.model.boundary import map_tensors, tensors_of
from sdpipe_cli.model.models import ModelSection
from sdpipe_cli.pipeline.executor import to_device
from sdpipe_cli.runtime import store
from sdpipe_cli.runtime.bootstrap import Joined, joined
from sdpipe_cli.sync.groups import GroupCache, for_worker

log = logging.getLogger("sdpipe.profiling")

WARMUP = 2  # untimed repeats first: allocator, caches, lazily created communicators
REPEATS = 20  # timed repeats of a block; the minimum is kept
MIN_REPEATS = 3  # a slow block stops repeating after BLOCK_BUDGET_S, but not before this many
BLOCK_BUDGET_S = 1.0
COMM_REPEATS = 9  # timed repeats of a message or an all-reduce (fixed: both sides must agree)
BANDWIDTH_BYTES = 4 * 2**20  # the bandwidth message: large enough that its transfer time dominates
FORWARD, BACKWARD = Action(Kind.F, 0), Action(Kind.B, 0)
# every pair of nodes up to this many (28 links); beyond, a star from the first node (N - 1)
MAX_NODES_PAIRED = 8


# -- the plan: the same on every rank -------------------------------------------------------------
def replica_groups(grid: Grid) -> list[tuple[int, list[int]]]:
    """(stage s, ranks of its replicas in pipelines 0..k-1) for every s and k = 2..P."""
    return [(s, grid.stage_ranks(s, range(k)))
            for s in range(grid.stages) for k in range(2, grid.pipelines + 1)]


def node_pairs(grid: Grid, node_of: Callable[[int], str]) -> list[tuple[int, int]]:
    """Two ranks for each pair of nodes whose link is measured: replicas of one stage where the
    two nodes hold some (what a group round crosses), else each node's lowest rank. Every pair
    up to :data:`MAX_NODES_PAIRED` nodes; beyond, each node with the first (a slow node still
    shows, in N - 1 measurements instead of N (N - 1) / 2)."""
    first: dict[tuple[int | None, str], int] = {}  # (stage or None: any, node) -> lowest rank
    for r in range(grid.workers):
        first.setdefault((grid.stage_of(r), node_of(r)), r)
        first.setdefault((None, node_of(r)), r)
    nodes = [n for stage, n in first if stage is None]
    pairs: list[tuple[int, int]] = []
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:] if len(nodes) <= MAX_NODES_PAIRED or i == 0 else ():
            stage = next((s for s in range(grid.stages) if (s, a) in first and (s, b) in first),
                         None)
            x, y = first[(stage, a)], first[(stage, b)]
            pairs.append((min(x, y), max(x, y)))
    return sorted(pairs)


def turns(grid: Grid, links: Sequence[tuple[int, int]] = ()) -> list[tuple[str, list[int]]]:
    """Every measurement as (phase, the ranks that take part), in the order they run;
    ``links``: the pairs of :func:`node_pairs`."""
    return ([("blocks", [r]) for r in range(grid.workers)]
            + [("p2p", list(pair)) for pair in grid.neighbour_pairs()]
            + [("link", list(pair)) for pair in links]
            + [("allreduce", ranks) for _, ranks in replica_groups(grid)])


def fresh_input(value):
    """``value`` as a received activation: detached, its floating tensors leaves needing a grad."""
    return map_tensors(lambda t: t.detach().requires_grad_() if t.is_floating_point() else t, value)


def stage_weight_bytes(model: ModelSection, plan: RunPlan, pipeline: int, stage: int) -> int:
    """float32 bytes of stage ``stage``'s weights in pipeline ``pipeline``, under its split as
    the plan resolved it."""
    counts = models.block_param_counts(model)
    held = stage_blocks(plan.partition_of(pipeline), len(counts), plan.stages)[stage]
    return 4 * sum(sum(counts[start:stop]) for start, stop in held)


def repeat(once: Callable[[], Sequence[float]], repeats: int, warmup: int = WARMUP,
           min_repeats: int | None = None, budget_s: float = math.inf,
           clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Per value that ``once()`` returns, its minimum over the timed repeats after ``warmup``
    untimed ones; past ``budget_s`` seconds of timed repeats, stop after ``min_repeats``."""
    for _ in range(warmup):
        once()
    samples: list[Sequence[float]] = []
    start = clock()
    while len(samples) < repeats:
        samples.append(once())
        if min_repeats is not None and len(samples) >= min_repeats and clock() - start > budget_s:
            break
    return [min(column) for column in zip(*samples)]


def assemble(cfg: DictConfig, results: Sequence[dict]) -> dict:
    """The profile document from every rank's results (see :mod:`sdpipe_cli.config.measurements`)."""
    mb = RunPlan.of(cfg).microbatch_size
    links = {}
    for kind in ("same_node", "cross_node"):
        link = cfg.cluster.links[kind]
        links[kind] = {"latency_ms": float(link.latency_ms), "bandwidth_gbps":
                       None if link.bandwidth_gbps is None else float(link.bandwidth_gbps)}
    ordered = sorted(results, key=lambda r: r["device"]["rank"])
    return {
        "format": measurements.FORMAT,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "model": {"name": cfg.model.name, "arch": cfg.model.arch,
                  "blocks": models.count_blocks(cfg.model),
                  "block_names": models.block_names(cfg.model),
                  "block_params": models.block_param_counts(cfg.model), "microbatch_size": mb,
                  "seq_len": int(cfg.model.seq_len),
                  "activation_bytes": models.activation_bytes(cfg, sources.example(cfg, mb)[0])},
        "cluster": {"name": cfg.cluster.name, "emulation": "measured",
                    "pipelines": int(cfg.cluster.pipelines), "stages": int(cfg.pipeline.stages),
                    "device": cfg.cluster.device, "links": links},
        "devices": [r["device"] for r in ordered],
        "p2p": sorted((e for r in ordered for e in r["p2p"]), key=lambda e: e["src_rank"]),
        "links": sorted((e for r in ordered for e in r["links"]),
                        key=lambda e: (e["src_rank"], e["dst_rank"])),
        "allreduce": sorted((e for r in ordered for e in r["allreduce"]),
                            key=lambda e: (e["stage"], e["group_size"])),
    }


# -- the measuring process -----------------------------------------------------------------------
class Profiler:
    """One worker's measurements; :meth:`run` takes part in every turn and returns its results."""

    def __init__(self, ctx: Joined, groups: GroupCache):
        self.settings, self.where, self.device, self.groups = ctx.settings, ctx.where, ctx.device, groups
        self.events = store.namespace(ctx.client)
        self.plan = ctx.plan
        self.cluster = ctx.plan.cluster
        self.placed = self.cluster.device(self.where.pipeline, self.where.stage)
        self.speed = self.cluster.speed(self.placed, 0.0)
        self.slowdown = EmulatedSlowdown(speed=lambda: self.speed)  # measured mode: time / speed
        self.memory = MemoryLimit(self.placed, self.device)
        self.before_send = link_delay(self.cluster, self.where.rank)
        self.p2p: list[dict] = []
        self.links: list[dict] = []  # between nodes
        self.allreduce: list[dict] = []
        self.forward_ms: list[float] = []
        self.backward_ms: list[float] = []

    def now(self) -> float:
        """Wall time once the device has finished what was queued (CUDA runs asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def run(self) -> dict:
        w = self.where
        plan = turns(self.plan.grid, node_pairs(self.plan.grid,
                                                lambda r: self.cluster.device_of_rank(r).node))
        for n, (phase, members) in enumerate(plan):
            if w.rank == 0:
                store.set_json(self.events, store.PROGRESS,
                               {"phase": phase, "turn": n + 1, "turns": len(plan)})
            if w.rank in members:
                if phase == "blocks":
                    self.measure_blocks()
                elif phase in ("p2p", "link"):
                    src, dst = members
                    self.measure_p2p(src, dst, self.p2p if phase == "p2p" else self.links)
                else:
                    self.measure_allreduce(members)
                self.memory.peak_mb()  # the RSS peak is sampled: after each of this rank's turns
            dist.barrier()
        return {"device": {"name": self.placed.name, "node": self.placed.node, "speed": self.speed,
                           "rank": w.rank, "pipeline": w.pipeline, "stage": w.stage,
                           "forward_ms": self.forward_ms, "backward_ms": self.backward_ms,
                           "peak_memory_mb": round(self.memory.peak_mb(), 1),
                           "memory_source": "cuda_max_allocated" if self.memory.cuda else "rss"},
                "p2p": self.p2p, "links": self.links, "allreduce": self.allreduce}

    # -- 1. blocks ---------------------------------------------------------------------------------
    def measure_blocks(self) -> None:
        settings = self.settings
        torch.manual_seed(settings.train.seed)
        blocks = [b.to(self.device).train() for b in models.build(settings.model)[0]]
        loss_fn = models.loss_function(settings.model)
        inputs, targets = to_device(sources.example(settings, self.plan.microbatch_size), self.device)
        ins = [inputs]  # each block's input: the previous block's output on the example
        with torch.no_grad():
            for block in blocks[:-1]:
                ins.append(block(ins[-1]))
        last = len(blocks) - 1
        for i, block in enumerate(blocks):
            def once(i=i, block=block) -> tuple[float, float]:
                x = ins[i] if i == 0 else fresh_input(ins[i])
                t0 = self.now()
                out = block(x)
                if i == last:
                    out = loss_fn(out, targets)
                t1 = self.now()
                outs = [out] if i == last else [t for t in tensors_of(out) if t.requires_grad]
                # .grad accumulates, as in training; ones stand in for the next block's gradient
                torch.autograd.backward(outs, None if i == last else [torch.ones_like(t) for t in outs])
                t2 = self.now()
                return (self.slowdown.target(FORWARD, t1 - t0),
                        self.slowdown.target(BACKWARD, t2 - t1))

            fwd, bwd = repeat(once, REPEATS, min_repeats=MIN_REPEATS, budget_s=BLOCK_BUDGET_S)
            self.forward_ms.append(round(fwd * 1000, 4))
            self.backward_ms.append(round(bwd * 1000, 4))
        log.info("blocks: forward %.2f ms, backward %.2f ms in all (speed %g)",
                 sum(self.forward_ms), sum(self.backward_ms), self.speed)

    # -- 3. p2p ------------------------------------------------------------------------------------
    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        if self.before_send is not None:
            self.before_send(dst, tensor)  # the emulated link's transfer time
        dist.send(tensor, dst)

    def measure_p2p(self, src: int, dst: int, into: list[dict]) -> None:
        """Latency and bandwidth from ``src`` to ``dst``, appended to ``into`` on ``src``."""
        me = self.where.rank
        ping = torch.zeros(1, dtype=torch.float32, device=self.device)
        bulk = torch.zeros(BANDWIDTH_BYTES // 4, dtype=torch.float32, device=self.device)
        if me == src:
            def round_trip() -> tuple[float]:
                t0 = self.now()
                self._send(ping, dst)
                dist.recv(ping, dst)
                return (self.now() - t0,)

            def acknowledged() -> tuple[float]:
                t0 = self.now()
                self._send(bulk, dst)
                dist.recv(ping, dst)
                return (self.now() - t0,)
        else:
            def round_trip() -> tuple[float]:
                dist.recv(ping, src)
                self._send(ping, src)
                return (0.0,)

            def acknowledged() -> tuple[float]:
                dist.recv(bulk, src)
                self._send(ping, src)
                return (0.0,)
        rtt, = repeat(round_trip, COMM_REPEATS)
        big, = repeat(acknowledged, COMM_REPEATS)
        if me != src:
            return
        extra_s = big - rtt  # the bulk message's transfer minus the ping's: latency cancels
        extra_bytes = bulk.nbytes - ping.nbytes
        device = self.cluster.device_of_rank
        into.append({"src": device(src).name, "dst": device(dst).name, "src_rank": src,
                     "dst_rank": dst, "src_node": device(src).node, "dst_node": device(dst).node,
                     "link": self.cluster.link(src, dst).kind,
                     "latency_ms": round(rtt / 2 * 1000, 4),
                     "bandwidth_gbps": round(extra_bytes * 8 / extra_s / 1e9, 4)
                     if extra_s > 0 else None,
                     "bytes": bulk.nbytes})

    # -- 4. all-reduce -----------------------------------------------------------------------------
    def measure_allreduce(self, ranks: list[int]) -> None:
        stage = self.where.stage
        # the same size on every member: the first one's stage (pipelines may be split apart)
        first = Placement(ranks[0], self.plan.pipelines, self.plan.stages).pipeline
        nbytes = stage_weight_bytes(self.settings.model, self.plan, first, stage)
        flat = torch.zeros(nbytes // 4, dtype=torch.float32, device=self.device)

        def once() -> tuple[float]:
            t0 = self.now()
            self.groups.all_reduce(flat, ranks)
            return (self.now() - t0,)

        seconds, = repeat(once, COMM_REPEATS)
        if self.where.rank == ranks[0]:
            self.allreduce.append({"stage": stage, "group_size": len(ranks), "ranks": ranks,
                                   "bytes": nbytes, "ms": round(seconds * 1000, 4)})


def main() -> int:
    with joined() as ctx:
        profiler = Profiler(ctx, for_worker(ctx, ctx.settings.run.timeout))
        events = profiler.events
        store.set_json(events, store.profile_key(ctx.where.rank), profiler.run())
        dist.barrier()  # every rank's results are in the store
        if ctx.where.rank == 0:
            results = [store.get_json(events, store.profile_key(r))
                       for r in range(ctx.where.workers)]
            path = measurements.write(assemble(ctx.cfg, results), ctx.run_dir)
            store.set_json(events, store.PROGRESS, {"phase": "done", "path": str(path)})
            log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
