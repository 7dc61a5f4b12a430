"""The run plan: the facts every process of a run must agree on, resolved once.

A run's topology (P pipelines of S stages, a parameter server per stage after the workers with
``sync=ps``), the device each worker is placed on, the run's budget and the micro-batch size all
follow from the config, and every process needs some of them. Derived in each process, they could
drift apart (a default placement computed differently, a budget counted in steps by one and in
pipeline-iterations by another), and a reader of the run folder would not see them. So the
launcher resolves them once, when the run is prepared (:meth:`RunPlan.resolve`), into the config's
``plan`` section, which ``config.yaml`` carries to every child; the launcher, the scheduler, the
workers, the parameter servers, the profiler and the simulator read them back with
:meth:`RunPlan.of` and derive nothing themselves.

Pure: no I/O. The :class:`~sdpipe_cli.core.cluster.Cluster` is built here and nowhere else
(:func:`cluster_of`): validation checks a config's cluster by building it, the launcher's
preparation resolves the plan from it, and every process builds it once from ``config.yaml``
however often it asks for the plan.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Any

from omegaconf import OmegaConf

from sdpipe_cli.core.cluster import Cluster
from sdpipe_cli.core.errors import BadInput
from sdpipe_cli.core.meetings import precision_of
from sdpipe_cli.core.modes import mode
from sdpipe_cli.core.placement import Grid
from sdpipe_cli.core.segments import Segments, partitions_of

__all__ = ["RunPlan", "cluster_of", "microbatch_size"]


def cluster_of(cfg: Any) -> Cluster:
    """The cluster of a config (its ``cluster`` section laid out for ``pipeline.stages``);
    :class:`~sdpipe_cli.core.cluster.ClusterError` naming the key of a section that cannot be
    one. Built once per process for a given section (the plan is asked for often, and a
    cluster of many nodes is not free to lay out)."""
    section = (OmegaConf.to_container(cfg.cluster, resolve=True) if OmegaConf.is_config(cfg.cluster)
               else cfg.cluster)
    return _built(json.dumps(section, sort_keys=True, default=str), int(cfg.pipeline.stages))


@lru_cache(maxsize=16)
def _built(section: str, stages: int) -> Cluster:
    return Cluster.from_config(json.loads(section), stages)


def _servers(stages: int, sync: str) -> int:
    """Parameter servers of a run: one per stage where the sync mode has them."""
    return stages if mode(sync).servers else 0


def _partitions(cfg: Any) -> tuple[tuple[int, ...], ...]:
    """Each pipeline's partition, once ``pipeline.partition`` is resolved (boundaries)."""
    if isinstance(cfg.pipeline.partition, str):
        return ()
    return partitions_of(cfg.pipeline, int(cfg.cluster.pipelines))


def _in_place(cfg: Any, blocks: int) -> bool:
    """Whether a re-plan re-splits pipelines while the others go on: ``fault.replan_in_place``
    (a config written before it existed: no) under a mode whose pipelines may be split apart
    and whose scheduler heals a restarted one (sdpipe), with two pipelines at least (one to
    heal from) and the model's blocks known; not with bf16 or int8 changes, whose anchor a replica
    healed segment by segment could miss (as ``fault.on_pipeline_loss=restart`` cannot)."""
    f, able = cfg.fault, mode(cfg.sync.name)
    return bool(blocks and f.on_slowdown == "replan" and f.get("replan_in_place", False)
                and able.segments and able.group_policy and int(cfg.cluster.pipelines) >= 2
                and precision_of(cfg.sync) == "fp32")


def _shares(cfg: Any, pipelines: int, given: tuple[int, ...]) -> tuple[int, ...]:
    """Each pipeline's micro-batches: ``given`` (the balance decided at preparation, which the
    plan section records), else ``pipeline.microbatches`` for every pipeline."""
    if not given:
        return (int(cfg.pipeline.microbatches),) * pipelines
    if len(given) != pipelines or not all(1 <= int(k) <= int(cfg.pipeline.microbatches) for k in given):
        raise ValueError(f"plan.microbatches {list(given)} is not one count in 1..pipeline.microbatches "
                         "per pipeline")
    return tuple(int(k) for k in given)


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def microbatch_size(cfg: Any) -> int:
    """Samples per micro-batch: ``train.batch_size // pipeline.microbatches`` (validation
    refuses a batch that does not divide). Defined here only; before the plan exists (while
    the config is checked and prepared) it is asked directly."""
    return int(cfg.train.batch_size) // int(cfg.pipeline.microbatches)


@dataclass(frozen=True)
class RunPlan:
    """A prepared run's topology, placement, budget and micro-batch size."""

    pipelines: int
    stages: int
    servers: int  # parameter servers, one per stage with ``sync=ps``, ranked after the workers
    steps: int  # iterations per pipeline (``train.steps``)
    microbatch_size: int  # samples per micro-batch: ``train.batch_size // pipeline.microbatches``
    placement: tuple[tuple[str, ...], ...]  # the device of (pipeline, stage)
    cluster: Cluster = field(compare=False, repr=False)
    # each pipeline's partition (``pipeline.partitions`` may give one its own split); empty
    # while the partition is not resolved yet
    partitions: tuple[tuple[int, ...], ...] = ()
    blocks: int = 0  # the model's blocks (0: not known, a plan of an older run)
    # a re-plan re-splits pipelines while the others go on (fault.replan_in_place, sdpipe):
    # replicas average per block
    in_place: bool = False
    # each pipeline's micro-batches per iteration: ``pipeline.microbatches`` for all unless
    # ``pipeline.balance`` gave a slower pipeline fewer (core.balance); empty: not resolved
    microbatches: tuple[int, ...] = ()
    # the model's layout as plain values (model.layout.ModelLayout.plain: what crosses each
    # cut, which weights are tied), found once by the launcher; None: each worker traces it
    layout: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    def microbatches_of(self, pipeline: int) -> int:
        """Pipeline ``pipeline``'s micro-batches per iteration."""
        return self.microbatches[pipeline]

    def batch_of(self, pipeline: int) -> int:
        """Samples of pipeline ``pipeline``'s iteration."""
        return self.microbatches[pipeline] * self.microbatch_size

    @property
    def balanced(self) -> bool:
        """Whether the pipelines take unequal shares of the global batch."""
        return len(set(self.microbatches)) > 1

    @cached_property
    def segments(self) -> Segments:
        """What replicas average: the stages, or finer ranges where pipelines are split
        differently (:mod:`~sdpipe_cli.core.segments`). Before the partition is resolved (a
        config not prepared yet, which has no ``pipeline.partitions`` either), one per stage."""
        alike = len(set(self.partitions)) == 1 and not self.in_place
        if not self.partitions or (self.chunks > 1 and alike):  # interleaved alike: by stage
            return Segments.of([tuple(range(1, self.stages))] * self.pipelines)
        return Segments.of(self.partitions, self.blocks if self.in_place else 0, self.stages)

    @property
    def chunks(self) -> int:
        """Model chunks per stage (``pipeline.chunks``): the partition cuts the model into
        ``chunks x stages`` virtual stages (:mod:`~sdpipe_cli.core.interleaved`)."""
        return (len(self.partitions[0]) + 1) // self.stages if self.partitions else 1

    def partition_of(self, pipeline: int) -> list[int]:
        """Pipeline ``pipeline``'s partition: what its workers build their stages from."""
        if not self.partitions:
            raise ValueError("the partition is not resolved yet (the run is being prepared)")
        return list(self.partitions[pipeline])

    @property
    def grid(self) -> Grid:
        return Grid(self.pipelines, self.stages)

    @property
    def workers(self) -> int:
        return self.pipelines * self.stages

    @property
    def world_size(self) -> int:
        """The ranks of the run's process group: the workers, then the servers."""
        return self.workers + self.servers

    @property
    def budget(self) -> int:
        """Pipeline-iterations the whole run trains: P x ``train.steps``, however the
        pipelines share them (sdpipe lets a fast pipeline take more than a slow one)."""
        return self.pipelines * self.steps

    def server_stage(self, rank: int) -> int:
        """The stage whose parameter server ``rank`` is."""
        stage = rank - self.workers
        if not 0 <= stage < self.servers:
            raise ValueError(f"rank {rank} is not a parameter server of this run")
        return stage

    def ranks_on(self, node: str | None) -> list[int]:
        """The workers a launcher on ``node`` starts: all of them unless nodes are real."""
        if not self.cluster.real:
            return list(range(self.workers))
        return [] if node is None else self.cluster.ranks_on(node)

    def for_sync(self, name: str) -> RunPlan:
        """This plan under sync mode ``name`` (the simulator's comparison rows)."""
        return replace(self, servers=_servers(self.stages, name))

    # -- resolving and carrying ---------------------------------------------------------------
    @classmethod
    def resolve(cls, cfg: Any, cluster: Cluster | None = None, blocks: int = 0,
                microbatches: tuple[int, ...] = (), layout: Mapping[str, Any] | None = None) -> RunPlan:
        """The plan of a checked config (``cluster``: its cluster, when already built;
        ``blocks``: the model's, once known; ``microbatches``: each pipeline's, where
        ``pipeline.balance`` decided them, else ``pipeline.microbatches`` for all; ``layout``:
        the model's, once found)."""
        stages, pipelines = int(cfg.pipeline.stages), int(cfg.cluster.pipelines)
        cluster = cluster or cluster_of(cfg)
        return cls(pipelines=pipelines, stages=stages,
                   servers=_servers(stages, cfg.sync.name), steps=int(cfg.train.steps),
                   microbatch_size=microbatch_size(cfg),
                   placement=tuple(tuple(row) for row in cluster.placement), cluster=cluster,
                   partitions=_partitions(cfg), blocks=blocks, in_place=_in_place(cfg, blocks),
                   microbatches=_shares(cfg, pipelines, microbatches), layout=layout)

    def section(self) -> dict[str, Any]:
        """The config's ``plan`` section (what ``config.yaml`` shows; derived values included
        for the reader, and ignored when read back)."""
        return {"pipelines": self.pipelines, "stages": self.stages, "servers": self.servers,
                "steps": self.steps, "microbatch_size": self.microbatch_size,
                "placement": [list(row) for row in self.placement], "blocks": self.blocks,
                "workers": self.workers, "world_size": self.world_size, "budget": self.budget,
                "microbatches": list(self.microbatches),
                **({"layout": dict(self.layout)} if self.layout else {})}

    @classmethod
    def of(cls, cfg: Any) -> RunPlan:
        """The plan a prepared config carries; :class:`BadInput` naming ``plan`` when the
        config was not prepared or its plan does not match its cluster (a hand-edited file)."""
        section = cfg.get("plan")
        if not section:
            raise BadInput("plan", "missing: the config was not prepared by sdpipe (run it with "
                           "`sdpipe train`, or `sdpipe resume` a run folder)")
        try:
            if int(section["stages"]) != int(cfg.pipeline.stages):
                raise ValueError(f"plan.stages {section['stages']} is not pipeline.stages")
            cluster = cluster_of(cfg)
            blocks = int(section.get("blocks") or 0)
            plan = cls(int(section["pipelines"]), int(section["stages"]), int(section["servers"]),
                       int(section["steps"]), int(section["microbatch_size"]),
                       tuple(tuple(str(d) for d in row) for row in section["placement"]), cluster,
                       _partitions(cfg), blocks, _in_place(cfg, blocks),
                       _shares(cfg, int(section["pipelines"]), tuple(section.get("microbatches") or ())),
                       _plain(section.get("layout")) or None)
        except (KeyError, TypeError, ValueError) as err:
            raise BadInput("plan", f"malformed ({err}); prepare the run again") from None
        if plan.placement != tuple(tuple(row) for row in cluster.placement):
            raise BadInput("plan.placement", "differs from the cluster's placement: the run's "
                           "config was changed after it was prepared")
        return plan
