"""What a simulated run is asked (:class:`Workload`: the cluster, the work of an iteration in
seconds and bytes, the mode's settings) and what it did (:class:`Result`: iterations, times,
rounds, bytes, drift), apart from the event loop of :mod:`sdpipe_cli.core.simulation` that
turns one into the other, so that a reader of either finds the fields without the loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from sdpipe_cli.core.cluster import Cluster, EmulatedStragglers

__all__ = ["Workload", "Result"]

@dataclass
class Workload:
    """What a run asks of the cluster, in seconds and bytes (built from a config by
    :mod:`sdpipe_cli.hetero.simulated_run`)."""

    cluster: Cluster
    microbatches: int
    batch_size: int  # samples per pipeline-iteration
    steps: int  # budget: P x steps pipeline-iterations
    forward_s: list[list[float]]  # [p][s] one micro-batch at speed 1, before slow-downs
    backward_s: list[list[float]]
    stage_bytes: list[int]  # the weights of each stage
    activation_bytes: int  # one micro-batch's activation between stages
    slowdown: list[float] = field(default_factory=list)  # per pipeline; empty: all 1
    shares: list[int] = field(default_factory=list)  # each pipeline's m (pipeline.balance); empty: all m
    stragglers: list[list[EmulatedStragglers | None]] = field(default_factory=list)  # [p][s]
    per_iteration: bool = False  # straggler draws per iteration (else per action)
    schedule: str = "1f1b"
    chunks: int = 1  # model chunks a stage (an interleaved schedule)
    chunk_forward: list[list[list[float]]] = field(default_factory=list)  # [p][s][c]: a chunk's
    chunk_backward: list[list[list[float]]] = field(default_factory=list)  # share (empty: 1 / v)
    average: str = "weights_grads"  # sdpipe's payload: weights and gradients, or weights
    rtt_s: float = 0.0005  # worker <-> scheduler round trip through the store
    event_s: float = 0.0001  # the scheduler's handling of one event
    collective_s: float = 0.0003  # fixed cost of one collective call
    p2p_s: float = 0.0  # fixed cost of one message between stages, on top of its link
    jitter: float = 0.0  # sigma of a log-normal factor on a worker's iteration
    staleness: int | None = None  # ps: sync.staleness (set by the modes that have it)
    local_steps: int | None = None  # diloco: sync.local_steps, iterations between outer steps
    every: int = 1  # sdpipe: iterations between a replica's meetings (sync.every)
    precision: str = "fp32"  # sdpipe's group rounds, diloco's outer gradient (sync.precision)
    overlap: int = 0  # sdpipe: steps a group round's average runs behind (sync.overlap)
    seed: int = 0  # adpsgd's matchings

    @property
    def pipelines(self) -> int:
        return self.cluster.pipelines

    @property
    def stages(self) -> int:
        return self.cluster.stages


@dataclass
class Result:
    """What a simulated run did. Times in seconds from its start."""

    sync: str
    iterations: list[int]  # per pipeline
    finished_at: list[float]  # per pipeline: the end of its last iteration
    busy_s: list[float]  # per pipeline: its first stage's compute time
    wait_s: list[float]  # per pipeline: its first stage's time from ready to synced
    group_sizes: list[int]  # one entry per group round (all stages)
    batch_size: int
    global_sizes: list[int] = field(default_factory=list)  # sdpipe's global syncs
    sent_bytes: dict[str, float] = field(default_factory=dict)  # by link class (sync.traffic's)
    comm_s: float = 0.0
    stages: int = 1
    # how far the replicas of a stage drift apart (see _Run._step): the root mean square of
    # their distance from their mean, averaged over the first stage's steps; None for ps
    consensus: float | None = None
    batches: list[int] = field(default_factory=list)  # each pipeline's (pipeline.balance); empty: all alike

    @property
    def sync_bytes_per_sample(self) -> float:
        samples = sum(self.samples())
        return sum(self.sent_bytes.values()) / samples if samples else 0.0

    def samples(self) -> list[int]:
        """Each pipeline's samples."""
        return [k * b for k, b in zip(self.iterations, self.batches or [self.batch_size] * len(self.iterations))]

    @property
    def comm_share(self) -> float:
        """The workers' seconds in sync collectives over their seconds alive (each pipeline's
        workers alive until it finished)."""
        alive = sum(self.finished_at) * self.stages
        return self.comm_s / alive if alive else 0.0

    @property
    def wall_s(self) -> float:
        return max(self.finished_at) if self.finished_at else 0.0

    @property
    def samples_per_s(self) -> float:
        return sum(self.samples()) / max(self.wall_s, 1e-12)

    def solo_rates(self) -> list[float]:
        """Each pipeline's own samples/s, over its own time: summed, the limit (``sync=none``)."""
        return [n / max(t, 1e-12) for n, t in zip(self.samples(), self.finished_at)]

    @property
    def mean_group_size(self) -> float:
        """Over every round, global syncs included (as the scheduler's summary counts it)."""
        sizes = self.group_sizes + self.global_sizes
        return sum(sizes) / len(sizes) if sizes else 1.0
