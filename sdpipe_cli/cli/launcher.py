"""The launcher: prepares a run folder, hosts the TCPStore, starts and supervises the processes.

Every child is a process of its own (forked from a fork server that imported torch once:
:mod:`sdpipe_cli.runtime.processes`) with its own log file (``<run>/logs/<rank>.log``,
``scheduler.log``), pid file and error file. Children run in their own session (a Ctrl-C
reaches only the launcher, which then stops them in order) and die with the launcher
(PR_SET_PDEATHSIG), so no process outlives a run. A launch's state is one :class:`Launch`:
open the run folder and the store (or join the first node's), start the processes, supervise
them (:class:`~sdpipe_cli.cli.supervisor.Supervisor`), and close, whatever happened.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import DictConfig, OmegaConf

from sdpipe_cli import checkpoint
from sdpipe_cli.cli.supervisor import POLL_S, RUNNING, Child, Interrupted, Phase, Supervisor, quietly, stop_all
from sdpipe_cli.config import derived, trust
from sdpipe_cli.config.run_file import save_run_config
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.config.settings import settings_of
from sdpipe_cli.core import supervision
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.core.schedule import SPLIT_SCHEDULES
from sdpipe_cli.data import sources
from sdpipe_cli.model import models
from sdpipe_cli.pipeline.executor import SPLIT_BACKWARD
from sdpipe_cli.runtime import network, processes, protocol, store, trace
from sdpipe_cli.runtime.errors import WriteFailed, discard_reserves
from sdpipe_cli.runtime.metrics import write_summary


@dataclass(frozen=True)
class Job:
    """What the launcher starts besides the store: P x S workers running ``worker``, and with
    ``helpers`` training's other processes (the scheduler; with ``sync=ps`` the parameter
    servers). ``graceful``: the workers stop at a consistent point when asked
    (``sdpipe/stop_requested``), so a first Ctrl-C waits for that instead of stopping them."""

    worker: str
    helpers: bool = True
    graceful: bool = True


TRAIN = Job("sdpipe_cli.training.main")
PROFILE = Job("sdpipe_cli.hetero.profiler", helpers=False, graceful=False)
SCHEDULER, PS = "sdpipe_cli.sync.scheduler.process", "sdpipe_cli.sync.ps"


@dataclass
class RunResult:
    run_dir: Path | None  # None when stopped before it was made
    returncode: int  # 0 ok, 1 a process failed, 2 bad input a child found, 130 interrupted
    failure: str | None = None
    progress: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    trace: Path | None = None  # <run>/trace.json, with run.trace
    interrupted: bool = False  # Ctrl-C or SIGTERM came (also when a failure followed)
    bad_input: bool = False  # the failure was bad input a child found (a damaged checkpoint shard)
    cfg: DictConfig | None = None  # the config this launch wrote (its folder, id, seal; re-splits)


def _copy_config_dirs(cfg: DictConfig, run_dir: Path) -> None:
    """The YAML files of the run's ``--config-dir`` folders, copied into ``config-dirs/``: the
    files the run was described by, beside the config it resolved to."""
    for i, folder in enumerate(cfg.run.get("config_dirs") or []):
        source = Path(folder)
        for path in sorted(source.rglob("*.yaml")) if source.is_dir() else []:
            target = run_dir / "config-dirs" / f"{i}-{source.name}" / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)


def make_run_dir(requested: str | None) -> Path:
    """A new, empty run folder; never reuses one that already holds a run."""
    if requested:
        path = Path(requested).expanduser()
        try:
            if path.exists() and not path.is_dir():
                raise ConfigError("run.dir", f"'{path}' is a file, not a folder (nothing was written)")
            if path.is_dir() and any(path.iterdir()):
                raise ConfigError("run.dir", f"'{path}' already holds files; choose a new folder "
                                  "(nothing was written)")
        except OSError as err:  # a name too long, a folder that cannot be listed
            shown = str(path) if len(str(path)) <= 80 else f"{str(path)[:77]}..."
            raise ConfigError("run.dir", f"cannot use '{shown}': {err.strerror}") from None
    else:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path, n = Path("runs") / stamp, 1
        while path.exists():
            path, n = Path("runs") / f"{stamp}-{n}", n + 1
    try:
        (path / "logs").mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        shown = str(path) if len(str(path)) <= 80 else f"{str(path)[:77]}..."
        raise ConfigError("run.dir", f"cannot write to '{shown}': {err.strerror}") from None
    return path


def start_store(cfg: DictConfig):
    address = network.check_hosts(cfg)
    try:
        master, bound = store.host_store(address, cfg.run.port, cfg.run.timeout)
    except Exception as err:  # the c10d error types vary by version; the cause is what matters
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        if cfg.run.port:
            raise ConfigError("run.port", f"cannot listen on {address}:{cfg.run.port} "
                              f"(already in use?): {first}") from None
        raise ConfigError("cluster.host", f"cannot listen on {address}: {first}") from None
    if not bound:
        print(f"sdpipe: warning: torch {torch.__version__} cannot take a bound socket "
              "(master_listen_fd); the store listens on every interface, see docs/SECURITY.md",
              file=sys.stderr, flush=True)
    return master


def store_host(cfg: DictConfig) -> str:
    """Where the store listens: the first real node's address, else ``cluster.host``."""
    hosts = [n.host for n in cfg.cluster.nodes if n.get("host")]
    return hosts[0] if hosts else cfg.cluster.host


def pinned_interfaces(cfg: DictConfig) -> dict[str, str]:
    """Environment that keeps gloo's and NCCL's sockets on the interface of the address this
    node listens on (they would otherwise bind what the hostname resolves to); a variable the
    user set is kept, and a wildcard pins nothing."""
    address = network.check_hosts(cfg)
    interface = None if address in network.WILDCARDS else network.interface_of(address)
    if interface is None:
        return {}
    return {k: os.environ.get(k, interface) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}


def _join(cfg: DictConfig, plan: RunPlan, phase: Phase):
    """A launcher on another real node: reach the first node's store, take its run config.

    Every node runs the first node's resolved config (same seed, partition, settings), written
    beside it as ``config.<node>.yaml``; the run folder has the same path on every node (a shared
    filesystem keeps logs and checkpoints in one place; checkpoints need one).
    """
    host, port = store_host(cfg), cfg.run.port
    # Said at once: a node that waits for the first one looks hung otherwise.
    print(f"sdpipe: node {cfg.run.node}: waiting for the first node's store at {host}:{port} "
          f"(up to run.timeout={cfg.run.timeout:g}s)", file=sys.stderr, flush=True)
    try:
        master = store.connect_patiently(host, port, cfg.run.timeout, check=phase.check)
        events = store.namespace(master)
        deadline = time.monotonic() + cfg.run.timeout
        while not events.check([store.RUN]):  # polled, so that a Ctrl-C lands at once
            phase.check()
            if time.monotonic() > deadline:
                raise TimeoutError("no run published")
            time.sleep(POLL_S)
        run = json.loads(events.get(store.RUN))
    except Interrupted:
        raise
    except Exception as err:  # c10d raises several types; say where we looked
        raise ConfigError("run.node", f"cannot reach the first node's store at {host}:{port} "
                          f"within run.timeout={cfg.run.timeout:g}s ({str(err).splitlines()[0]}); "
                          "start the first node's launcher") from None
    primary_cfg = OmegaConf.create(run["config"])
    if OmegaConf.to_container(primary_cfg.cluster) != OmegaConf.to_container(cfg.cluster):
        raise ConfigError("cluster", f"differs from the first node's ({plan.cluster.nodes[0]}); every "
                          "node must run the same cluster config")
    run_dir = Path(primary_cfg.run.dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    config_path = _new_path(run_dir / f"config.{cfg.run.node}.yaml")
    config_path.write_text(run["config"])
    resume = Path(run["resume"]) if run["resume"] else None
    return master, events, run_dir, config_path, resume


def spawn(module: str, name: str, role: str, run_dir: Path, env: dict[str, str]) -> Child:
    """Start ``module`` as the child ``name`` (see :mod:`sdpipe_cli.runtime.processes`)."""
    log_path = run_dir / "logs" / f"{name}.log"
    start = log_path.stat().st_size if log_path.exists() else 0
    return Child(name, role, processes.start(module, log_path, env), log_path, log_start=start)


def _open_run(cfg: DictConfig, run: RunPlan, master, result: RunResult,
              run_dir: Path | None, resume: Path | None, elapsed: float, spent: float,
              fresh: bool):
    """The first node's launcher: the run folder (a new one, or the run's own when it resumes or
    starts again; a new one too when it resumes ``fresh``, a checkpoint from outside its run),
    the config written for this leg without replacing any file, with the seal of the code it
    names (:mod:`~sdpipe_cli.config.trust`) and, in a new folder, a new run id, and the run clock
    (and the ``spent`` seconds of ``train.time_limit``) in the store; with real nodes the
    config is published for the other nodes' launchers.
    Returns (the store's events, the run folder, the config's path, the launch time); the config
    written is ``result.cfg``."""
    # a key that cannot be had stops the launch before anything is written; the seal itself is
    # of the config as saved, with its run id and folder (code's arguments may name them)
    trust.seal(cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True)))  # a DictConfig's
    new_run = resume is None or fresh
    if new_run:  # a new run (from scratch, or resumed into a new folder), or one started again
        # a new run gets an id; one resumed fresh got its id with its folder (resuming)
        given = {"id": uuid.uuid4().hex} if run_dir is None else {}
        run_dir = run_dir or make_run_dir(cfg.run.dir)
        cfg = derived.with_run(cfg, **given, dir=str(run_dir.resolve()) if run.cluster.real
                               else str(run_dir))
        config_path = _new_path(run_dir / "config.yaml")
    else:  # not a new run: resume is set
        run_dir = Path(cfg.run.dir)
        config_path = _new_path(run_dir / f"config.resume-{cast(Path, resume).name}.yaml")
    result.run_dir = run_dir
    cfg = result.cfg = derived.sealed(cfg)
    save_run_config(cfg, config_path)
    if resume is None:  # the user's own folders; a resumed config's come from its file
        _copy_config_dirs(cfg, run_dir)
    events = store.namespace(master)
    launched = time.time()
    events.set(store.T0, repr(launched - elapsed))
    if spent:
        events.set(store.LIMIT_SPENT, repr(spent))
    if run.cluster.real:  # the other nodes' launchers run exactly this config
        store.set_json(events, store.RUN, {"config": config_path.read_text(),
                                           "resume": str(resume.resolve()) if resume else None})
    return events, run_dir, config_path, launched


def _environment(cfg: DictConfig, world: int, run_dir: Path, port: int, config_path: Path,
                 resume: Path | None) -> dict[str, str]:
    """What every child of this launch finds in its environment (torchrun's variables, the run
    folder, its config and the checkpoint to resume from); each adds its rank."""
    base = {**os.environ, "SDPIPE_RUN_DIR": str(run_dir.resolve()),
            "MASTER_ADDR": network.connect_address(store_host(cfg)),
            "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
            "PYTHONUNBUFFERED": "1", "SDPIPE_CONFIG": str(config_path.resolve()),
            "SDPIPE_LAUNCHER_PID": str(os.getpid()),  # its children end when it is gone
            **pinned_interfaces(cfg)}
    if resume is not None:
        base["SDPIPE_RESUME"] = str(resume.resolve())
    if cfg.cluster.device == "cpu":
        base.setdefault("OMP_NUM_THREADS", "1")  # P x S processes share the cores
    return base


@dataclass
class Spawner:
    """Starts a launch's processes, each with ``base`` and its own rank: the workers (again,
    under a new incarnation, when their pipeline is restarted), the scheduler (again, after it
    was killed) and the parameter servers. How a child is started is
    :mod:`sdpipe_cli.runtime.processes`'; when, is the supervision policy's."""

    job: Job
    plan: RunPlan
    run_dir: Path
    base: dict[str, str] = field(default_factory=dict)
    incarnations: list[int] = field(default_factory=list)
    # the config workers started from now on read, once pipelines were re-split in place (the
    # scheduler keeps the leg's: a scheduler started again replays its journal under it)
    workers_config: str | None = None

    def __post_init__(self) -> None:
        self.incarnations = [0] * self.plan.pipelines

    @property
    def servers(self) -> int:
        """The parameter servers this job starts (training's helpers only)."""
        return self.plan.servers if self.job.helpers else 0

    def worker(self, rank: int, incarnation: int = 0) -> Child:
        # one GPU per worker: its index on a real node, the rank on one machine
        cluster = self.plan.cluster
        local = cluster.device_of_rank(rank).index if cluster.real else rank
        env = {**self.base, "RANK": str(rank), "LOCAL_RANK": str(local),
               "SDPIPE_INCARNATION": str(incarnation)}
        if self.workers_config is not None:
            env["SDPIPE_CONFIG"] = self.workers_config
        where = self.plan.grid.at(rank)
        role = f"worker rank {rank} (pipeline {where.pipeline}, stage {where.stage})"
        child = spawn(self.job.worker, str(rank), role, self.run_dir, env)
        child.rank, child.pipeline, child.since = rank, where.pipeline, time.time()
        child.incarnation = incarnation
        return child

    def pipeline(self, pipeline: int, announce: Callable[[int, int], None]) -> list[Child]:
        """Start lost ``pipeline``'s workers again, under its next incarnation."""
        self.incarnations[pipeline] += 1
        # announced before the processes start: the scheduler then knows the incarnation
        # before any event of it arrives, and refuses events of one it does not know
        grid = self.plan.grid
        announce(grid.rank(pipeline, 0), self.incarnations[pipeline])
        return [self.worker(rank, self.incarnations[pipeline])
                for rank in grid.pipeline_ranks(pipeline)]

    def scheduler(self, restart: int = 0) -> Child:
        env = {**self.base, "SDPIPE_SCHEDULER_RESTART": str(restart)} if restart else self.base
        return spawn(SCHEDULER, "scheduler", "scheduler", self.run_dir, env)

    def server(self, stage: int) -> Child:
        rank = self.plan.grid.server_rank(stage)
        env = {**self.base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        return spawn(PS, f"ps{stage}", f"parameter server of stage {stage}", self.run_dir, env)


def _new_path(path: Path) -> Path:
    """``path``, or ``path`` with a counter, so that nothing already written is replaced."""
    candidate, n = path, 1
    while candidate.exists():
        candidate, n = path.with_name(f"{path.stem}-{n}{path.suffix}"), n + 1
    return candidate


def is_primary(cfg: DictConfig) -> bool:
    """Whether this launcher is the run's first (hosts the store and the scheduler, owns the run
    folder): always, unless the cluster is real nodes and this is not the first."""
    cluster = RunPlan.of(cfg).cluster
    return not cluster.real or cfg.run.node == cluster.nodes[0]


def launch(cfg: DictConfig, on_progress: Callable[[dict], None] = lambda _: None,
           run_dir: Path | None = None, resume: Path | None = None,
           elapsed: float = 0.0, job: Job = TRAIN,
           on_folder: Callable[[Path], None] = lambda _: None,
           on_phase: Callable[[str], None] = lambda _: None, fresh: bool = False,
           spent: float = 0.0) -> RunResult:
    """Run a job (training, or :data:`PROFILE`) to the end; ``cfg`` must be validated and prepared.

    Without ``job.helpers`` a failed worker always stops the job: there is no scheduler to drop
    its pipeline (``fault.on_pipeline_loss=continue``).

    With ``resume`` (a verified checkpoint folder), the run goes on in its own run folder: the
    config for this leg is written beside the original (which stays as it was), metrics are
    appended, and the run clock goes on from ``elapsed`` seconds. With ``run_dir`` (a folder
    that already holds this run) and no ``resume``, the run starts again from scratch there,
    in the same way: its config is written as ``config-<n>.yaml``, nothing is replaced. With
    ``resume`` and ``fresh``, the run goes on from the checkpoint in a new folder (``run_dir``, or
    ``cfg.run.dir`` made new), a run of its own. ``spent``: seconds of ``train.time_limit`` that
    earlier legs of this command used (a restart's or a re-plan's leg has only the rest).
    ``on_folder(run_dir)`` is called once the run folder exists, before any process starts;
    ``on_phase(what)`` at each step of the start-up (for a status line).
    """
    state = Launch(cfg, job, resume, fresh, on_progress, on_phase)
    previous = state.phase.install()
    try:
        state.open(run_dir, elapsed, spent)
        on_folder(cast(Path, state.run_dir))  # open() set it: the user can look at the logs
        state.start()
        state.supervise()
    except Interrupted:
        state.interrupted()
    finally:
        state.close(previous)
    return state.result


class Launch:
    """One launch: its config (what it reads of it typed, ``settings``, but for ``run.dir``:
    the folder open() makes or joins) and plan, whether this launcher is the run's first, the
    store, the run folder, the children, the interrupts and the result, which every step fills."""

    def __init__(self, cfg: DictConfig, job: Job, resume: Path | None, fresh: bool,
                 on_progress: Callable[[dict], None], on_phase: Callable[[str], None]):
        self.cfg, self.job, self.resume, self.fresh = cfg, job, resume, fresh
        self.on_progress = on_progress
        self.children: list[Child] = []
        self.run, self.primary, self.settings = RunPlan.of(cfg), is_primary(cfg), settings_of(cfg)
        self.started = time.monotonic()
        self.result = RunResult(Path(cfg.run.dir) if resume is not None and not fresh else None, 0)
        self.phase = Phase("starting the store" if self.primary else
                           f"waiting for the first node's store at {store_host(cfg)}:"
                           f"{self.settings.run.port}", on_phase)
        self.events: Any = None  # these four: set by open()
        self.master: Any = None
        self.run_dir: Path | None = None
        self.config_path: Path | None = None
        self.launched = 0.0

    def open(self, run_dir: Path | None, elapsed: float, spent: float = 0.0) -> None:
        """The store and the run folder: hosted and written here, or the first node's joined."""
        cfg = self.cfg
        if self.primary:
            self.master = start_store(cfg)  # first: a busy port must fail before anything is written
            self.phase.advance("writing the run folder")
            self.events, self.run_dir, self.config_path, self.launched = _open_run(
                cfg, self.run, self.master, self.result, run_dir, self.resume, elapsed, spent,
                self.fresh)
            self.cfg = cast(DictConfig, self.result.cfg)  # what _open_run wrote
        else:
            self.master, self.events, self.run_dir, self.config_path, self.resume = _join(
                cfg, self.run, self.phase)
            self.cfg = self.result.cfg = derived.with_run(cfg, dir=str(self.run_dir))
            self.result.run_dir = self.run_dir
            self.launched = float(self.events.get(store.T0))

    def start(self) -> None:
        """Every process of this node: the scheduler and servers on the first, then the workers."""
        cfg, job, run, primary = self.cfg, self.job, self.run, self.primary
        self.phase.advance("starting the processes")
        run_dir, config_path = cast(Path, self.run_dir), cast(Path, self.config_path)  # open()'s
        self.spawner = spawner = Spawner(job, run, run_dir)
        spawner.base = _environment(cfg, run.workers + spawner.servers, run_dir,
                                    self.master.port, config_path, self.resume)
        helpers = [SCHEDULER] if job.helpers and primary else []
        helpers += [PS] if spawner.servers and primary else []
        splits = [SPLIT_BACKWARD] if self.settings.pipeline.schedule in SPLIT_SCHEDULES else []
        processes.preload([job.worker, *helpers, *models.imports(cfg.model), *sources.imports(cfg),
                           *splits], spawner.base)
        if job.helpers and primary:
            self.children.append(spawner.scheduler())
        for rank in run.ranks_on(self.settings.run.node):
            self.children.append(spawner.worker(rank))
            self.phase.check()
        for stage in range(spawner.servers if primary else 0):
            self.children.append(spawner.server(stage))

    def supervise(self) -> None:
        """Until every child is done, or the first failure; the result's code and failure."""
        fault, job, result = self.settings.fault, self.job, self.result
        self.phase.advance("waiting for the workers to join")
        tolerate = job.helpers and fault.on_pipeline_loss in ("continue", "restart")
        restarts = (supervision.Restarts(fault.max_restarts, fault.restart_backoff)
                    if tolerate and fault.on_pipeline_loss == "restart" else None)
        supervisor = Supervisor(  # self.run_dir: set by open()
            self.children, cast(Path, self.run_dir), self.events, self.on_progress, self.launched,
            tolerate, graceful=job.graceful, workers=self.run.workers, phase=self.phase,
            restarts=restarts, restart=self.spawner.pipeline, pipelines=self.run.pipelines,
            restart_scheduler=self.spawner.scheduler, on_resplit=self.resplit,
            # a stranded worker gives up at run.timeout; 10 s at least for a slow teardown (NCCL)
            stranded_s=max(10.0, min(supervision.STRANDED_S, self.settings.run.timeout / 2)))
        result.failure, interrupted, result.bad_input = supervisor.run()
        result.returncode = ((2 if result.bad_input else 1) if result.failure
                             else 130 if interrupted else 0)
        result.interrupted = interrupted
        if interrupted and not result.failure:
            result.failure = "interrupted; stopped at a consistent point, every process exited"

    def resplit(self, splits: dict[int, list[int]], slowed: dict[str, float]) -> None:
        """Pipelines re-split in place: the run's config with their new splits (and the
        slowdowns measured, ``fault.slowed``), written beside the others (``config.replan.yaml``,
        then ``config.replan-1.yaml``, ...: the run's history of its splits), is the one their
        new workers, and any worker started later, read."""
        self.cfg = self.result.cfg = cfg = derived.sealed(derived.resplit(self.cfg, splits, slowed))
        path = _new_path(cast(Path, self.run_dir) / "config.replan.yaml")  # set by open()
        save_run_config(cfg, path)
        self.spawner.workers_config = str(path.resolve())

    def interrupted(self) -> None:
        """A stop at once (:class:`~sdpipe_cli.cli.supervisor.Interrupted`): what to say."""
        result = self.result
        result.interrupted = True
        if self.phase.now == RUNNING:
            twice = "interrupted twice" if self.job.graceful else "interrupted"
            result.failure = f"{twice}; all processes stopped"
        else:
            result.failure = f"interrupted while {self.phase.now}; every started process stopped"
        result.returncode = 130

    def close(self, previous: dict) -> None:
        """Whatever happened: stop every child, remove saves cut short, restore the signal
        handlers, merge the trace and read the last progress."""
        result = self.result
        stop_all(self.children)  # further interrupts are only counted: stopping is bounded
        if result.run_dir is not None and self.primary and self.children:
            for staging in checkpoint.discard_staging(result.run_dir):  # saves cut short
                print(f"sdpipe: warning: removed {staging}: a checkpoint save that did not "
                      "complete", file=sys.stderr, flush=True)
        self.phase.restore(previous)
        if self.settings.run.trace and (run_dir := result.run_dir) is not None and self.primary:
            result.trace = quietly(lambda: trace.merge(run_dir))
        if self.events is not None:
            try:
                result.progress = quietly(lambda: store.read_progress(self.events, {})) or {}
            except protocol.ProtocolError:  # supervision has failed the run for it already
                result.progress = {}
        if result.run_dir is not None:
            discard_reserves(result.run_dir)
        if result.returncode == 1 and result.failure and self.primary:
            self.failed_summary()
        result.wall_s = time.monotonic() - self.started

    def failed_summary(self) -> None:
        """A failed run's ``summary.json``: its scheduler, stopped, wrote none, so the last
        progress it published, with the failure. It is small, but may not fit a disk that filled
        up: then the console says so, and the run's end is reported as ever."""
        result = self.result
        if result.run_dir is None or not result.progress:
            return
        try:
            write_summary(result.run_dir, {**result.progress, "failure": result.failure})
        except WriteFailed as err:
            print(f"sdpipe: warning: the run's summary is not written: {err}", file=sys.stderr,
                  flush=True)
