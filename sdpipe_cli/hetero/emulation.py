"""Heterogeneity emulation: make a worker's compute and links slower, honestly.

What slows a worker down (combined by multiplying):

* its device's ``speed`` (:mod:`sdpipe_cli.core.cluster`; 0.5 = twice the wall time), which scheduled
  ``cluster.changes`` may replace between two times of the run clock;
* its pipeline's ``cluster.slowdown`` factor (3.0 = three times slower);
* random stragglers (``cluster.stragglers``): with probability q a micro-batch (or a whole
  iteration) is slowed by a further factor f, from a generator seeded by (seed, rank), so runs
  are reproducible.

Two ways to turn the factor into wall time:

* measured (``cluster.emulation=measured``): after each forward or backward the worker sleeps
  ``(factor - 1) x`` the time the action took. Simple, but on a busy machine the measured time
  already includes CPU contention, which the sleep then multiplies.
* modelled (``cluster.emulation=modelled``): every micro-batch forward costs a modelled time
  (``cluster.compute_ms``, or the stage's blocks' forward times from a profile) x factor, the
  backward its own modelled time (twice the forward, or the profile's); the real compute runs
  inside that budget and the worker sleeps for the rest. The results then do not depend on how
  many processes share the cores, as long as the real compute fits in the budget (the worker
  counts the actions where it did not: ``slowdown_overruns``).

Links (``cluster.links``): a message to a neighbouring stage costs the link's latency plus its
size over the link's bandwidth, slept by the sender before it posts the send (a transfer that
is not overlapped with compute); a group all-reduce costs a ring's time on the slowest link it
uses (:meth:`~sdpipe_cli.core.cluster.Cluster.allreduce_s`), slept by every member before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import psutil
import torch

from sdpipe_cli.config import measurements
from sdpipe_cli.config.schema import Config, emulation
from sdpipe_cli.core.cluster import Cluster, Device, EmulatedStragglers
from sdpipe_cli.core.interleaved import stage_blocks
from sdpipe_cli.core.schedule import SPLIT_SCHEDULES, SPLIT_SHARE, Action, Kind

__all__ = ["EmulatedStragglers", "EmulatedSlowdown", "make_slowdown", "link_delay", "MemoryLimit",
           "MemoryLimitExceeded"]


class EmulatedSlowdown:
    """An ``on_action`` hook for :class:`~sdpipe_cli.pipeline.stage.FlushedStage`.

    ``factor`` is the static slow-down; ``speed()`` the device's speed now (it may change during
    the run, ``dynamic`` says it may); ``compute_ms``/``backward_ms`` the modelled cost of a forward/backward at speed 1
    (None: measured mode); ``stragglers`` draws the random factor, per micro-batch or, with
    ``per_iteration``, once per :meth:`new_iteration`. ``chunk_ms``: an interleaved stage's
    modelled (forward, backward) ms of each chunk, in place of ``compute_ms``/``backward_ms``.
    """

    def __init__(self, factor: float = 1.0, compute_ms: float | None = None,
                 sleep: Callable[[float], None] = time.sleep, *,
                 backward_ms: float | None = None,
                 speed: Callable[[], float] = lambda: 1.0,
                 stragglers: EmulatedStragglers | None = None, per_iteration: bool = False,
                 dynamic: bool = False, split_backward: bool = False,
                 chunk_ms: Sequence[tuple[float, float]] | None = None):
        self.factor, self.sleep, self.speed, self.dynamic = factor, sleep, speed, dynamic
        self.split_backward = split_backward  # the schedule runs each backward as B and W
        self.forward_s = (compute_ms or 0) / 1000.0
        self.backward_s = (backward_ms / 1000.0 if backward_ms is not None else 2 * self.forward_s)
        self.chunk_s = [(f / 1000.0, b / 1000.0) for f, b in chunk_ms] if chunk_ms else None
        if self.chunk_s:  # the stage's whole: what says the compute is modelled
            self.forward_s, self.backward_s = (sum(c[0] for c in self.chunk_s),
                                               sum(c[1] for c in self.chunk_s))
        self.stragglers, self.per_iteration = stragglers, per_iteration
        self._iteration_factor = 1.0
        self.step: int | None = None  # the iteration under way (new_iteration)
        self._owed = 0.0  # seconds the emulation is behind its model
        self.actions = 0  # actions seen
        self.straggled = 0  # actions slowed by a random straggler
        self.overruns = 0  # actions whose real compute exceeded the modelled budget

    @property
    def active(self) -> bool:
        """Whether the hook changes anything (else the worker does not install it)."""
        return (self.factor != 1.0 or self.modelled or self.stragglers is not None
                or self.dynamic or self.speed() != 1.0)

    @property
    def modelled(self) -> bool:
        return self.forward_s > 0 or self.backward_s > 0

    def new_iteration(self, step: int | None = None) -> None:
        """Iteration ``step`` starts (a speed change may be timed by it): draw its straggler
        factor (``per_iteration`` mode)."""
        self.step = step
        if self.stragglers is not None and self.per_iteration:
            self._iteration_factor = self.stragglers.draw()

    def target(self, action: Action, seconds: float, straggle: float = 1.0) -> float:
        """Wall time the action must take."""
        factor = self.factor * straggle / self.speed()
        if self.modelled:
            return self.modelled_s(action) * factor
        return seconds * factor

    def modelled_s(self, action: Action) -> float:
        """The modelled compute of ``action`` at speed 1: a backward split into ``B`` and
        ``W`` (a zero-bubble schedule) has :data:`~sdpipe_cli.core.schedule.SPLIT_SHARE` of it
        each."""
        forward_s, backward_s = (self.chunk_s[action.chunk] if self.chunk_s
                                 else (self.forward_s, self.backward_s))
        if action.kind is Kind.F:
            return forward_s
        return backward_s * SPLIT_SHARE if self.split_backward else backward_s

    def __call__(self, action: Action, seconds: float) -> None:
        self.actions += 1
        straggle = 1.0
        if self.stragglers is not None:
            straggle = self._iteration_factor if self.per_iteration else self.stragglers.draw()
        if straggle != 1.0:
            self.straggled += 1
        target = self.target(action, seconds, straggle)
        if self.modelled and seconds > target:
            self.overruns += 1
        # Time lost to an overrun or to waking up late is owed and taken from the next sleeps,
        # so that over a run the wall time follows the model as long as the compute fits on
        # average (a loaded machine makes single actions late, not the run).
        rest = target - seconds - self._owed
        if rest > 0:
            start = time.perf_counter()
            self.sleep(rest)
            self._owed = max(0.0, time.perf_counter() - start - rest)
        else:
            self._owed = -rest

    def stats(self) -> dict:
        return {"actions": self.actions, "straggled": self.straggled, "overruns": self.overruns}


def make_slowdown(settings: Config, cluster: Cluster, pipeline: int, stage: int,
                  clock: Callable[[], float], partition: Sequence[int] | None = None
                  ) -> EmulatedSlowdown:
    """The hook for worker (pipeline, stage) of a run; ``clock()`` is the run time in s;
    ``partition``: the pipeline's split (default ``pipeline.partition``)."""
    c, pipe = settings.cluster, settings.pipeline
    device = cluster.device(pipeline, stage)
    forward_ms = backward_ms = None
    chunk_ms: list[tuple[float, float]] | None = None  # interleaved: each chunk's
    if emulation(c) == "modelled":
        chunks = pipe.chunks
        if c.compute_ms is not None:  # a stage's forward: its chunks share it
            forward_ms, backward_ms = float(c.compute_ms), 2.0 * float(c.compute_ms)
            chunk_ms = [(forward_ms / chunks, backward_ms / chunks)] * chunks
        else:  # the stage's blocks, as the profile measured them, at speed 1.0
            assert settings.profile is not None  # validation: modelled, no compute_ms, a profile
            fwd, bwd = measurements.block_costs(measurements.load(settings.profile), device.name, 1.0)
            bounds = list(pipe.partition if partition is None else partition)
            held = stage_blocks(bounds, len(fwd), pipe.stages)[stage]
            chunk_ms = [(sum(fwd[a:b]), sum(bwd[a:b])) for a, b in held]
            forward_ms, backward_ms = sum(f for f, _ in chunk_ms), sum(b for _, b in chunk_ms)
        if chunks == 1:
            chunk_ms = None
    st = c.stragglers
    stragglers = EmulatedStragglers.of_device(st, settings.train.seed, device.name)
    slow = list(c.slowdown)
    hook = EmulatedSlowdown(slow[pipeline] if slow else 1.0, forward_ms, backward_ms=backward_ms,
                    stragglers=stragglers, per_iteration=st.per == "iteration",
                    dynamic=bool(cluster.change_points(device)),
                    split_backward=pipe.schedule in SPLIT_SCHEDULES, chunk_ms=chunk_ms)
    hook.speed = lambda: cluster.speed(device, clock(), hook.step)
    return hook


def link_delay(cluster: Cluster, rank: int) -> Callable[[int, torch.Tensor], None] | None:
    """A ``before_send`` hook sleeping the emulated link's transfer time (None: no emulation)."""
    if not cluster.links_emulated:
        return None

    def delay(dst: int, tensor: torch.Tensor) -> None:
        seconds = cluster.link(rank, dst).transfer_s(tensor.numel() * tensor.element_size())
        if seconds > 0:
            time.sleep(seconds)

    return delay


class MemoryLimitExceeded(RuntimeError):
    pass


class MemoryLimit:
    """A device's ``memory`` limit. On CUDA the caching allocator is capped, so an allocation
    beyond it raises torch's out-of-memory error; on CPU the process's resident set is checked
    after every iteration and a worker over its limit stops with an error naming the device."""

    def __init__(self, device: Device, torch_device: torch.device):
        self.limit_gib, self.name, self.torch_device = device.memory_gib, device.name, torch_device
        self.cuda = torch_device.type == "cuda"
        self._process = psutil.Process()
        self._peak_rss = 0
        if self.cuda and self.limit_gib:
            total = torch.cuda.get_device_properties(torch_device).total_memory
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, self.limit_gib * 2**30 / total), torch_device)

    def peak_mb(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.torch_device) / 2**20
        self._peak_rss = max(self._peak_rss, self._process.memory_info().rss)
        return self._peak_rss / 2**20

    def check(self) -> None:
        if self.cuda or not self.limit_gib:
            return
        rss = self.peak_mb() / 1024
        if rss > self.limit_gib:
            raise MemoryLimitExceeded(
                f"device {self.name} is limited to {self.limit_gib:g} GiB (cluster.nodes) but "
                f"this worker's resident memory reached {rss:.2f} GiB")
