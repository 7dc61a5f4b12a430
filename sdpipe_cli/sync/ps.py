"""Parameter server of one stage (the ``sync=ps`` baseline): the centralized design SDPipe avoids.

Started by the launcher as ``python -m sdpipe_cli.sync.ps`` with rank ``P x S + s`` for stage s. It holds
the stage's weights and optimizer; the stage's P workers push gradients after each iteration and
pull the weights back, so all of the stage's model traffic goes through this one process — the
bottleneck the paper measures. Replies are asynchronous, bounded by stale-synchronous parallelism:
a worker more than ``sync.staleness`` iterations ahead of the slowest live worker gets its reply only
when the slowest catches up. The first stage's server owns the run's length: after ``P x train.steps``
pushes it tells each pipeline, in its next reply, to stop.

Messages (gloo point-to-point; ``recv`` from any source): a worker sends an int64 header
``[iteration, kind]`` (kind 0 = push, then the flat gradients; kind 1 = leave), and gets back
``[stop]`` and the flat weights.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from sdpipe_cli.config.run_file import load_child_config
from sdpipe_cli.config.schema import Config, PsSyncConfig
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.core.schedule import ASYNC_SCHEDULES, updates_per_iteration
from sdpipe_cli.model import optim
from sdpipe_cli.model.models import build_stage_module
from sdpipe_cli.runtime.bootstrap import child, connect_store, process_group
from sdpipe_cli.sync.strategies import PSSync

log = logging.getLogger("sdpipe.ps")


class ParameterServer:
    """Stage ``stage``'s server: its module, the optimizer, the schedule and the staleness bound,
    from the run's typed ``settings``."""

    def __init__(self, settings: Config, plan: RunPlan, stage: int):
        P, S = plan.pipelines, plan.stages
        self.train, self.stage, self.P = settings.train, stage, P
        self.module = build_stage_module(settings, stage)
        self.params = list(self.module.parameters())
        self.optimizer = optim.build_optimizer(self.params, self.train)
        self.numel = sum(p.numel() for p in self.params)
        # worker rank -> last pushed iteration
        self.clock = {r: -1 for r in plan.grid.stage_ranks(stage)}
        self.left: set[int] = set()
        self.deferred: list[int] = []  # workers whose reply waits for the staleness bound
        self.pushes = 0
        # With async_1f1b a worker pushes after every update (m per iteration, or one with
        # weight_versions=2), and the stages of one pipeline are up to S updates apart, which the
        # staleness bound must allow, or a stage held back would hold back its own pipeline's
        # stage that everyone waits for.
        pipe = settings.pipeline
        asynchronous = pipe.schedule in ASYNC_SCHEDULES
        self.per_iteration = updates_per_iteration(pipe.schedule, pipe.microbatches,
                                                   pipe.weight_versions)
        sync = settings.sync
        assert isinstance(sync, PsSyncConfig)  # servers are started for sync=ps only
        self.staleness = sync.staleness * self.per_iteration + (S if asynchronous else 0)
        self.budget = plan.budget * self.per_iteration if stage == 0 else None

    def serve(self) -> None:
        header = torch.empty(2, dtype=torch.int64)
        grad = torch.empty(self.numel)
        while len(self.left) < len(self.clock):
            src = dist.recv(header, tag=PSSync.HEADER_TAG)
            iteration, kind = int(header[0]), int(header[1])
            if kind == PSSync.LEAVE:
                self.left.add(src)
            else:
                dist.recv(grad, src, tag=PSSync.DATA_TAG)
                self._apply(grad)
                self.clock[src] = iteration
                self.pushes += 1
                self.deferred.append(src)
            self._release()
        log.info("stage %d: %d pushes served", self.stage, self.pushes)

    def _apply(self, grad: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.grad = grad[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        # The run's global progress (updates served over P), as sdpipe's groups use it: the
        # pushing worker's own iteration would decay fast pipelines early.
        optim.set_lr(self.optimizer, optim.lr_at(self.pushes / self.P / self.per_iteration, self.train))
        self.optimizer.step()

    def _release(self) -> None:
        live = [k for r, k in self.clock.items() if r not in self.left]
        slowest = min(live) if live else 0
        waiting = []
        for rank in self.deferred:
            if self.clock[rank] - slowest <= self.staleness:
                self._reply(rank)
            else:
                waiting.append(rank)
        self.deferred = waiting

    def _reply(self, rank: int) -> None:
        stop = self.budget is not None and self.pushes >= self.budget
        dist.send(torch.tensor([int(stop)], dtype=torch.int64), rank, tag=PSSync.HEADER_TAG)
        with torch.no_grad():
            dist.send(parameters_to_vector(self.params).detach(), rank, tag=PSSync.DATA_TAG)


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    loaded = load_child_config()
    plan, settings = RunPlan.of(loaded.cfg), loaded.settings
    stage = plan.server_stage(rank)
    timeout = settings.run.timeout
    with child(f"ps{stage}", loaded=loaded, rank=rank, role="parameter server", stage=stage):
        torch.set_num_threads(1)
        with process_group(connect_store(timeout), rank, world, torch.device("cpu"), timeout):
            ParameterServer(settings, plan, stage).serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
