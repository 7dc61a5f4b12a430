"""The launcher: prepares a run folder, hosts the TCPStore, starts and supervises the processes.

Supervision follows torchrun: every child is a process of its own (forked from a fork server that
imported torch once: :mod:`sdpipe_cli.runtime.processes`) with its own log file
(``<run>/logs/<rank>.log``, ``scheduler.log``), pid file and error file; the launcher polls them, and as soon
as one exits non-zero (or is killed) it stops the others (SIGTERM, a grace period, then SIGKILL)
and reports the first failure in one line: which worker (pipeline, stage, rank), how it ended,
and the last lines of its error. Children run in their own session (a Ctrl-C reaches only the
launcher, which then stops them in order) and die with the launcher (PR_SET_PDEATHSIG), so no
process outlives a run.

This module is the *mechanism*: it spawns, polls the children and the store, counts interrupts
(:class:`Phase`), sends signals, writes store keys and prints. The *decisions* (when a run has
finished or failed, which failure is the root cause, when a lost pipeline may be dropped, what an
interrupt means at this point, when another node's failure ends this one) are made by the pure
policy :class:`sdpipe_cli.core.supervision.Supervision`, to which :func:`_supervise` hands one
observation per poll and whose action it carries out; the rules are listed and unit-tested there
(``tests/unit/test_supervision_policy.py``), and the end-to-end behaviour here
(``tests/integration/test_supervision.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from sdpipe_cli.config import trust
from sdpipe_cli.config.run_file import save_run_config
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.core import supervision
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.model import checkpoint, models
from sdpipe_cli.runtime import network, processes, protocol, store, trace
from sdpipe_cli.runtime.errors import read_error

GRACE_S = 10.0  # SIGTERM -> SIGKILL
RUNNING = "running"  # the launch phase after start-up
POLL_S = 0.1


@dataclass
class Child:
    name: str  # "scheduler" or the worker's rank
    role: str  # human description, e.g. "worker rank 3 (pipeline 1, stage 1)"
    proc: processes.ChildProcess
    log_path: Path
    rank: Optional[int] = None  # workers only
    pipeline: Optional[int] = None  # workers only
    since: float = 0.0  # when it was started (time.time()): older error files are not its own
    incarnation: int = 0  # workers: restarts of its pipeline before it
    log_start: int = 0  # where its output begins in the log (a restarted worker appends)


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
    run_dir: Optional[Path]  # None when stopped before it was made
    returncode: int  # 0 ok, 1 a process failed, 2 bad input a child found, 130 interrupted
    failure: Optional[str] = None
    progress: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    trace: Optional[Path] = None  # <run>/trace.json, with run.trace
    interrupted: bool = False  # Ctrl-C or SIGTERM came (also when a failure followed)
    bad_input: bool = False  # the failure was bad input a child found (a damaged checkpoint shard)


def _copy_config_dirs(cfg: DictConfig, run_dir: Path) -> None:
    """The YAML files of the run's ``--config-dir`` folders, copied into ``config-dirs/``: the
    files the run was described by, beside the config it resolved to."""
    for i, folder in enumerate(cfg.run.get("config_dirs") or []):
        source = Path(folder)
        for path in sorted(source.rglob("*.yaml")) if source.is_dir() else []:
            target = run_dir / "config-dirs" / f"{i}-{source.name}" / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)


def make_run_dir(requested: Optional[str]) -> Path:
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


def _join(cfg: DictConfig, plan: RunPlan, phase: "Phase"):
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
    except _Interrupted:
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
    cfg.run.dir = str(run_dir)
    resume = Path(run["resume"]) if run["resume"] else None
    return master, events, run_dir, config_path, resume


def spawn(module: str, name: str, role: str, run_dir: Path, env: dict[str, str]) -> Child:
    """Start ``module`` as the child ``name`` (see :mod:`sdpipe_cli.runtime.processes`)."""
    log_path = run_dir / "logs" / f"{name}.log"
    start = log_path.stat().st_size if log_path.exists() else 0
    return Child(name, role, processes.start(module, log_path, env), log_path, log_start=start)


def _open_run(cfg: DictConfig, run: RunPlan, master, result: "RunResult",
              run_dir: Optional[Path], resume: Optional[Path], elapsed: float, fresh: bool):
    """The first node's launcher: the run folder (a new one, or the run's own when it resumes or
    starts again; a new one too when it resumes ``fresh``, a checkpoint from outside its run),
    the config written for this leg without replacing any file, with the seal of the code it
    names (:mod:`~sdpipe_cli.config.trust`) and, in a new folder, a new run id, and the run clock
    in the store; with real nodes the config is published for the other nodes' launchers.
    Returns (the store's events, the run folder, the config's path, the launch time)."""
    new_run = resume is None or fresh
    if new_run:  # a new run (from scratch, or resumed into a new folder), or one started again
        if run_dir is None:  # a new run; one resumed fresh got its id with its folder (resuming)
            cfg.run.id = uuid.uuid4().hex
        run_dir = run_dir or make_run_dir(cfg.run.dir)
        cfg.run.dir = str(run_dir.resolve()) if run.cluster.real else str(run_dir)
        config_path = _new_path(run_dir / "config.yaml")
    else:
        run_dir = Path(cfg.run.dir)
        config_path = _new_path(run_dir / f"config.resume-{resume.name}.yaml")
    result.run_dir = run_dir
    cfg.run.code_seal = trust.seal(OmegaConf.to_container(cfg, resolve=True))
    save_run_config(cfg, config_path)
    if resume is None:  # the user's own folders; a resumed config's come from its file
        _copy_config_dirs(cfg, run_dir)
    events = store.namespace(master)
    launched = time.time()
    events.set(store.T0, repr(launched - elapsed))
    if run.cluster.real:  # the other nodes' launchers run exactly this config
        store.set_json(events, store.RUN, {"config": config_path.read_text(),
                                           "resume": str(resume.resolve()) if resume else None})
    return events, run_dir, config_path, launched


def _environment(cfg: DictConfig, world: int, run_dir: Path, port: int, config_path: Path,
                 resume: Optional[Path]) -> dict[str, str]:
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


def is_primary(cfg: DictConfig) -> bool:
    """Whether this launcher is the run's first (hosts the store and the scheduler, owns the run
    folder): always, unless the cluster is real nodes and this is not the first."""
    cluster = RunPlan.of(cfg).cluster
    return not cluster.real or cfg.run.node == cluster.nodes[0]


def launch(cfg: DictConfig, on_progress: Callable[[dict], None] = lambda _: None,
           run_dir: Optional[Path] = None, resume: Optional[Path] = None,
           elapsed: float = 0.0, job: Job = TRAIN,
           on_folder: Callable[[Path], None] = lambda _: None,
           on_phase: Callable[[str], None] = lambda _: None, fresh: bool = False) -> RunResult:
    """Run a job (training, or :data:`PROFILE`) to the end; ``cfg`` must be validated and prepared.

    Without ``job.helpers`` a failed worker always stops the job: there is no scheduler to drop
    its pipeline (``fault.on_pipeline_loss=continue``).

    With ``resume`` (a verified checkpoint folder), the run goes on in its own run folder: the
    config for this leg is written beside the original (which stays as it was), metrics are
    appended, and the run clock goes on from ``elapsed`` seconds. With ``run_dir`` (a folder
    that already holds this run) and no ``resume``, the run starts again from scratch there,
    in the same way: its config is written as ``config-<n>.yaml``, nothing is replaced. With
    ``resume`` and ``fresh``, the run goes on from the checkpoint in a new folder (``run_dir``, or
    ``cfg.run.dir`` made new), a run of its own.
    ``on_folder(run_dir)`` is called once the run folder exists, before any process starts;
    ``on_phase(what)`` at each step of the start-up (for a status line).
    """
    run = RunPlan.of(cfg)
    primary = is_primary(cfg)
    children: list[Child] = []
    started = time.monotonic()
    result = RunResult(Path(cfg.run.dir) if resume is not None and not fresh else None, 0)
    phase = Phase("starting the store" if primary else
                   f"waiting for the first node's store at {store_host(cfg)}:{cfg.run.port}",
                  on_phase)
    events = None
    previous = phase.install()
    try:
        if primary:
            master = start_store(cfg)  # first: a busy port must fail before anything is written
            phase.advance("writing the run folder")
            events, run_dir, config_path, launched = _open_run(cfg, run, master, result, run_dir,
                                                               resume, elapsed, fresh)
        else:
            master, events, run_dir, config_path, resume = _join(cfg, run, phase)
            result.run_dir = run_dir
            launched = float(events.get(store.T0))

        on_folder(run_dir)  # the user can look at the logs from here on
        phase.advance("starting the processes")
        spawner = Spawner(job, run, run_dir)
        spawner.base = _environment(cfg, run.workers + spawner.servers, run_dir, master.port,
                                    config_path, resume)
        helpers = [SCHEDULER] if job.helpers and primary else []
        helpers += [PS] if spawner.servers and primary else []
        processes.preload([job.worker, *helpers, *models.imports(cfg.model)], spawner.base)
        if job.helpers and primary:
            children.append(spawner.scheduler())
        for rank in run.ranks_on(cfg.run.node):
            children.append(spawner.worker(rank))
            phase.check()
        for stage in range(spawner.servers if primary else 0):
            children.append(spawner.server(stage))

        phase.advance("waiting for the workers to join")
        tolerate = job.helpers and cfg.fault.on_pipeline_loss in ("continue", "restart")
        restarts = (supervision.Restarts(cfg.fault.max_restarts, cfg.fault.restart_backoff)
                    if tolerate and cfg.fault.on_pipeline_loss == "restart" else None)
        result.failure, interrupted, result.bad_input = _supervise(children, run_dir, events, on_progress, launched,
                                                 tolerate, graceful=job.graceful,
                                                 workers=run.workers, phase=phase, restarts=restarts,
                                                 restart=spawner.pipeline, pipelines=run.pipelines,
                                                 restart_scheduler=spawner.scheduler,
                                                 # a stranded worker gives up at run.timeout;
                                                 # 10 s at least for a slow teardown (NCCL)
                                                 stranded_s=max(10.0, min(supervision.STRANDED_S,
                                                                          cfg.run.timeout / 2)))
        result.returncode = (2 if result.bad_input else 1) if result.failure else \
            130 if interrupted else 0
        result.interrupted = interrupted
        if interrupted and not result.failure:
            result.failure = "interrupted; stopped at a consistent point, every process exited"
    except _Interrupted:
        result.interrupted = True
        if phase.now == RUNNING:
            twice = "interrupted twice" if job.graceful else "interrupted"
            result.failure = f"{twice}; all processes stopped"
        else:
            result.failure = f"interrupted while {phase.now}; every started process stopped"
        result.returncode = 130
    finally:
        stop_all(children)  # further interrupts are only counted: stopping is bounded
        if result.run_dir is not None and primary and children:
            for staging in checkpoint.discard_staging(result.run_dir):  # saves cut short
                print(f"sdpipe: warning: removed {staging}: a checkpoint save that did not "
                      "complete", file=sys.stderr, flush=True)
        phase.restore(previous)
        if cfg.run.trace and result.run_dir is not None and primary:
            result.trace = _quietly(lambda: trace.merge(result.run_dir))
        if events is not None:
            try:
                result.progress = _quietly(lambda: store.read_progress(events, {})) or {}
            except protocol.ProtocolError:  # supervision has failed the run for it already
                result.progress = {}
        result.wall_s = time.monotonic() - started
    return result


class _Interrupted(Exception):
    """Raised by the launcher itself, at a point it chose, to stop at once."""


class Phase:
    """Where a launch is (for the line an interrupt prints) and the interrupts that came.

    Ctrl-C and SIGTERM are only counted by the signal handler; the launcher acts on them at points
    it chooses. An exception raised from a handler lands anywhere, and one raised inside a fork
    handler (logging's, while a child is being spawned) is swallowed, which loses the interrupt.
    Start-up phases stop at the first interrupt; from :data:`RUNNING` (every worker started) the
    first asks for a graceful stop and the second stops at once (during supervision that decision
    is :class:`~sdpipe_cli.core.supervision.Supervision`'s, which also says when start-up is over).
    """

    def __init__(self, now: str, on_change: Callable[[str], None] = lambda _: None):
        self.now, self.signals, self.on_change = now, 0, on_change
        on_change(now)

    def __call__(self, signum, frame) -> None:
        self.signals += 1

    def install(self) -> dict:
        """Count SIGINT and SIGTERM (main thread only); returns the handlers to restore."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore(self, previous: dict) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def check(self) -> None:
        """During start-up: stop if an interrupt came."""
        if self.signals:
            raise _Interrupted

    def advance(self, now: str) -> None:
        self.check()
        self.now = now
        self.on_change(now)


def _new_path(path: Path) -> Path:
    """``path``, or ``path`` with a counter, so that nothing already written is replaced."""
    candidate, n = path, 1
    while candidate.exists():
        candidate, n = path.with_name(f"{path.stem}-{n}{path.suffix}"), n + 1
    return candidate


def _supervise(children: list[Child], run_dir: Path, events, on_progress,
               since: float = 0.0, tolerate: bool = False, graceful: bool = True,
               workers: int = 0, phase: Optional[Phase] = None,
               restarts: Optional[supervision.Restarts] = None,
               restart: Callable[[int, Callable[[int, int], None]], list[Child]] = lambda p, a: [],
               pipelines: int = 0, stranded_s: float = supervision.STRANDED_S,
               restart_scheduler: Optional[Callable[[int], Child]] = None
               ) -> tuple[Optional[str], bool, bool]:
    """Wait for every child: (the first failure's description or None, whether interrupted,
    whether that failure was bad input a child found, such as a damaged checkpoint shard).

    The mechanism only: each poll becomes a :class:`~sdpipe_cli.core.supervision.Observation`,
    and the :class:`~sdpipe_cli.core.supervision.Supervision` policy says what to do (its module
    has the rules: graceful and immediate stops, ``fault.on_pipeline_loss=continue`` with
    ``tolerate``, another node's failure, which failure to name). A stop at once raises
    :class:`_Interrupted` and the caller stops everything. The policy's view of start-up (all
    ``workers`` started) is copied to ``phase``, whose name the caller's message uses.
    ``restart(pipeline)`` starts a lost pipeline's workers again (``restarts``: the budget, which
    the nodes' launchers share through the store's :data:`~sdpipe_cli.runtime.store.RESTARTS`
    count); ``pipelines``: how many the run has, on every node; ``stranded_s``: see
    :data:`~sdpipe_cli.core.supervision.STRANDED_S`.
    """
    phase = phase or Phase(RUNNING)
    policy = supervision.Supervision(workers=workers, tolerate=tolerate, graceful=graceful,
                                     started=phase.now == RUNNING, restarts=restarts,
                                     pipelines=pipelines, stranded_s=stranded_s)
    by_name = {c.name: c for c in children}
    error_times: dict[str, Optional[float]] = {}
    scheduler_restarts = 0
    pauses = Pauses()
    while True:
        pauses.tick()
        seen = _observe(children, run_dir, events, phase, since, error_times, tolerate,
                        restarts.used if restarts else None)
        action = policy.decide(seen)
        if policy.started:
            phase.now = RUNNING
        if isinstance(action, supervision.Wait):
            if seen.progress:
                on_progress(seen.progress)
            time.sleep(POLL_S)
        elif isinstance(action, supervision.RequestStop):
            events.set(store.STOP_REQUESTED, "1")
        elif isinstance(action, supervision.DropPipelines):
            again = action.restart or (False,) * len(action.lost)
            for (pipeline, name), again in zip(action.lost, again):
                _lose_pipeline(by_name[name], pipeline, children, run_dir, events, since, again)
                if again:
                    _quietly(lambda: events.add(store.RESTARTS, 1))
        elif isinstance(action, supervision.Respawn):
            fresh = restart(action.pipeline, lambda rank, incarnation: _announce_restart(
                action, rank, incarnation, events, since, restarts.limit if restarts else 0))
            children[:] = [c for c in children if c.pipeline != action.pipeline] + fresh
            by_name.update((c.name, c) for c in fresh)
            for c in fresh:
                error_times.pop(c.name, None)  # a new process: its own error file, when it fails
        elif isinstance(action, supervision.RespawnScheduler) and restart_scheduler is not None:
            dead = by_name["scheduler"]
            print(f"sdpipe: warning: the scheduler {supervision.ending(dead.proc.returncode)}; "
                  f"starting it again (restart {action.restart} of "
                  f"{restarts.limit if restarts else 0}); it replays its journal",
                  file=sys.stderr, flush=True)
            scheduler_restarts += 1
            fresh = restart_scheduler(scheduler_restarts)
            children[:] = [c if c is not dead else fresh for c in children]
            by_name["scheduler"] = fresh
            error_times.pop("scheduler", None)
        elif isinstance(action, supervision.Kill):
            for name in action.names:
                print(f"sdpipe: warning: {by_name[name].role} is hung (silent past "
                      "run.heartbeat_timeout); killing it", file=sys.stderr, flush=True)
                _signal(by_name[name], signal.SIGKILL)
        elif isinstance(action, supervision.StopNow):
            raise _Interrupted
        elif isinstance(action, supervision.Finished):
            return None, action.interrupted, False
        elif isinstance(action, supervision.Failed):
            reason = pauses.explain(describe_failure(by_name[action.child], run_dir, since))
            err = _error_since(run_dir, action.child, max(since, by_name[action.child].since))
            _quietly(lambda: events.compare_set(store.FAILED, "", reason))  # tell other nodes
            return reason, action.interrupted, bool(err and err.get("bad_input"))
        elif isinstance(action, supervision.Broken):
            _quietly(lambda: events.compare_set(store.FAILED, "", action.reason))
            return action.reason, action.interrupted, False
        else:
            assert isinstance(action, supervision.FailedElsewhere), action
            return f"another node failed: {action.reason}", action.interrupted, False


class Pauses:
    """The launcher's own stops (Ctrl-Z, SIGSTOP, a suspended machine), seen as gaps between its
    polls. The store lives in the launcher: while it is stopped no rendezvous or collective is
    answered, the workers give up after ``run.timeout``, and the first failure then names a
    worker's gloo error. A failure after a long pause says that the pause came first."""

    LONG_S = 10.0  # a gap between polls this long is no slow poll

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock, self.last, self.longest = clock, None, 0.0

    def tick(self) -> None:
        now = self.clock()
        if self.last is not None:
            self.longest = max(self.longest, now - self.last)
        self.last = now

    def explain(self, reason: str) -> str:
        if self.longest < self.LONG_S:
            return reason
        return (f"the launcher itself was stopped for {self.longest:.0f} s (Ctrl-Z, SIGSTOP, a "
                "suspended machine?), and with it the store every process waits on; then: " + reason)


def _observe(children: list[Child], run_dir: Path, events, phase: Phase, since: float,
             error_times: dict[str, Optional[float]], tolerate: bool = False,
             restarted: Optional[int] = None) -> supervision.Observation:
    """One poll. The interrupts are counted first, so that what is read after them is at least as
    recent (a Ctrl-C right after the last worker started finds it started); then the children,
    then the store. A failed child's error file is read once, when its exit is first seen: the
    child writes it before it exits. Hung workers are read only where a loss is tolerated
    (``tolerate``), the restart count only with a restart budget (``restarted``: the pipeline
    restarts this launcher made; the rest of the store's count are other nodes')."""
    signals = phase.signals
    states = []
    for c in children:
        rc = c.proc.poll()
        if rc not in (None, 0) and c.name not in error_times:
            err = _error_since(run_dir, c.name, max(since, c.since))
            error_times[c.name] = err["time"] if err else None
        states.append(supervision.ChildState(c.name, c.pipeline, rc, error_times.get(c.name)))
    elsewhere = _quietly(lambda: events.check([store.FAILED]) and events.get(store.FAILED))
    malformed = None
    try:
        hung = set((_quietly(lambda: store.read(events, store.HUNG, protocol.Hung))
                    or protocol.Hung([])).ranks if tolerate else [])
        progress = _quietly(lambda: store.read_progress(events))
    except protocol.ProtocolError as err:
        malformed, hung, progress = str(err), set(), None
    elsewhere_restarts = 0
    if restarted is not None:
        elsewhere_restarts = max(0, (_quietly(lambda: events.add(store.RESTARTS, 0)) or 0) - restarted)
    return supervision.Observation(
        now=time.monotonic(), children=tuple(states), signals=signals, progress=progress,
        elsewhere=elsewhere.decode(errors="replace") if elsewhere else None,
        hung=tuple(c.name for c in children if (c.rank, c.incarnation) in hung),
        restarts_elsewhere=elsewhere_restarts, malformed=malformed)


def _quietly(read: Callable[[], Any]) -> Any:
    """A store access that may fail once the first node's launcher (the store) is gone. A value
    that is there but malformed is not such a failure: its
    :class:`~sdpipe_cli.runtime.protocol.ProtocolError` goes through."""
    try:
        return read()
    except protocol.ProtocolError:
        raise
    except Exception:  # noqa: BLE001 - c10d raises several types for a closed store
        return None


def _lose_pipeline(failed: Child, pipeline: int, children: list[Child], run_dir: Path, events,
                   since: float, restart: bool = False) -> None:
    """Stop every worker of ``pipeline``, which ``failed`` cost, and tell the scheduler to drop it
    (``restart``: until its new workers rejoin)."""
    mates = [c for c in children if c.pipeline == pipeline]
    stop_all(mates)
    reason = describe_failure(failed, run_dir, since)
    store.push(events, store.EVENTS, protocol.Lost(failed.rank, pipeline, reason, restart,
                                                   round(time.time() - since, 4)))
    then = "it will be restarted" if restart else "the others go on"
    print(f"sdpipe: warning: pipeline {pipeline} lost, {then}: {reason}",
          file=sys.stderr, flush=True)


def _announce_restart(action: supervision.Respawn, rank: int, incarnation: int, events,
                      since: float, limit: int) -> None:
    """Tell the scheduler (and the user) that a lost pipeline's workers are started again."""
    store.push(events, store.EVENTS, protocol.Restart(
        rank, action.pipeline, incarnation, action.restart, action.backoff_s,
        round(time.time() - since, 4)))
    print(f"sdpipe: pipeline {action.pipeline} restarted (restart {action.restart} of {limit})",
          file=sys.stderr, flush=True)


def _error_since(run_dir: Path, name: str, since: float) -> Optional[dict]:
    """The child's error file, unless it is left over from an earlier leg of a resumed run."""
    err = read_error(run_dir, name)
    return err if err and err.get("time", 0) >= since else None


def describe_failure(child: Child, run_dir: Path, since: float = 0.0) -> str:
    """One line for the user: who (role), how it ended, its error message (else its log's last
    lines), and where its log is."""
    err = _error_since(run_dir, child.name, max(since, child.since))
    detail = err["message"] if err else _tail(child.log_path, 5, child.log_start)
    full = _disk_full(run_dir)
    if full and not err:  # it could write neither its error file nor its log: say why
        detail = f"{full} ({detail})"
    return f"{child.role} {supervision.ending(child.proc.returncode)}: {detail} (log: {child.log_path})"


FULL_BYTES = 1 << 20  # a disk with less free than this cannot take a log line or a metrics record


def _disk_full(run_dir: Path) -> str:
    """What to say when the run folder's file system is full ('' when it is not): a child that
    fails there usually fails writing, and can record nothing."""
    try:
        usage = shutil.disk_usage(run_dir)
    except OSError:
        return ""
    return (f"the disk holding {run_dir} is full ({usage.free:,} bytes free): free space and "
            "resume from the latest checkpoint") if usage.free < FULL_BYTES else ""


def _tail(path: Path, lines: int, start: int = 0) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(text[-lines:]) if text else "no output"


def stop_all(children: list[Child], grace: float = GRACE_S) -> None:
    """SIGTERM every live child, wait up to ``grace`` seconds, then SIGKILL the rest."""
    live = [c for c in children if c.proc.poll() is None]
    for c in live:
        _signal(c, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in live:
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(c, signal.SIGKILL)
            c.proc.wait()


def _signal(child: Child, sig: int) -> None:
    try:
        os.killpg(child.proc.pid, sig)  # the child's whole session, helpers included
    except ProcessLookupError:
        try:  # a forked child a moment old may not have its own session yet
            os.kill(child.proc.pid, sig)
        except ProcessLookupError:
            pass
