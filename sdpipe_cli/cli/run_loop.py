"""The run loop of ``sdpipe train``, ``sdpipe resume`` and each job of a sweep: launch the run
with a live progress display, restart it from its latest checkpoint while ``fault.on_failure=restart``
has budget, then show where it is and how it went.

Separate from the commands because three of them share it, and because it owns the signal
handling between launches: the launcher handles interrupts while its processes run; before a
launch the CLI's "preparing" handler ends sdpipe at once; after one, :func:`while_reporting` lets
an interrupt cut only the report short (:class:`InterruptedAfterRun`, caught by ``main``).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any, cast

from rich.console import Console

from sdpipe_cli.analysis.records import RestartLine
from sdpipe_cli.cli import display, resuming
from sdpipe_cli.config import derived
from sdpipe_cli.config.settings import settings_of
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.core.supervision import Restarts
from sdpipe_cli.runtime import run_lock
from sdpipe_cli.runtime.errors import CheckpointError

# sdpipe's exit codes (besides 0 and 2, bad input, which parsing.main returns): a process of the
# run failed, or the run was interrupted
EXIT_FAILED, EXIT_INTERRUPTED = 1, 130


class InterruptedAfterRun(BaseException):
    """An interrupt after a launch returned: only what sdpipe prints about the run is cut short.
    Not an ``Exception``: a sweep's job runner (Hydra) must not take it for a failed job."""

    def __init__(self, result):
        super().__init__("interrupted after the run")
        self.result = result


def while_reporting(result) -> dict:
    """From here on no process of the launch is left and the run's files are written: an
    interrupt only cuts the summary short, so sdpipe then exits with the run's own code (a
    finished run stays 0) instead of the "preparing" handler's 130. Returns the handlers it
    replaced, for the caller to put back once the report is printed (a sweep's next job, a
    restarted run's next leg, is preparing again)."""
    def handler(signum, frame) -> None:
        raise InterruptedAfterRun(result)

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def run_with_restarts(run_cfg, console: Console, done: int = 0, from_checkpoint=None,
                      elapsed: float = 0.0, fresh: bool = False) -> int:
    """Launch the run and show it: from ``from_checkpoint`` (a verified checkpoint) at run-clock
    ``elapsed`` seconds if given (``sdpipe resume``; ``fresh``: in the new run folder
    ``run_cfg.run.dir``). With ``fault.on_failure=restart`` a failed launch is followed by another
    from the run's latest checkpoint while the budget lasts (:func:`_next_leg`). The run folder is
    held against other launchers (:mod:`~sdpipe_cli.runtime.run_lock`) from the moment the first
    launch has it until the last leg ends."""
    with run_lock.Holder(lambda line: console.print(line, markup=False, highlight=False,
                                                     soft_wrap=True)) as holder:
        return _run_legs(run_cfg, console, done, from_checkpoint, elapsed, fresh, holder)


def _run_legs(run_cfg, console: Console, done: int, from_checkpoint, elapsed: float, fresh: bool,
              holder: run_lock.Holder) -> int:
    from sdpipe_cli.cli import launcher, preparing

    preparing.check_memory(run_cfg)  # bad input: before anything is written
    settings = settings_of(run_cfg)  # what the loop reads (typed): the legs' configs are derived
    restarts = (Restarts(settings.fault.max_restarts, settings.fault.restart_backoff)
                if settings.fault.on_failure == "restart" else None)
    began, origin = time.monotonic(), time.time() - elapsed  # origin: the run clock's zero
    # the first launch makes the run folder (or resumes in its own, or in the new one made for it)
    run_dir = Path(run_cfg.run.dir) if fresh else None
    started_from = from_checkpoint
    preparing_handlers: dict | None = None  # the handlers before the first launch's report
    primary = launcher.is_primary(run_cfg)

    def first_folder(folder: Path) -> None:
        if primary:  # the other nodes' launchers join the first's run
            holder.take(folder)
        shown.folder(folder)

    first, limit = True, settings.train.time_limit
    furthest = done  # iterations: the most any leg reached
    while True:
        shown = display.ProgressDisplay(console, RunPlan.of(run_cfg).budget, done)
        with shown:  # the launcher handles interrupts from here on
            result = launcher.launch(run_cfg, on_progress=shown.update, run_dir=run_dir,
                                     resume=from_checkpoint, elapsed=elapsed,
                                     on_folder=first_folder if first else _nothing,
                                     on_phase=shown.phase, fresh=fresh and first,
                                     spent=0.0 if first else time.monotonic() - began)
            if result.progress:  # the last snapshot: a device named in the run's last moments
                shown.update(result.progress)
        # the config the launch wrote (its run id and folder, pipelines re-split): later legs'
        first, run_cfg = False, run_cfg if result.cfg is None else result.cfg
        replaced = while_reporting(result)
        preparing_handlers = replaced if preparing_handlers is None else preparing_handlers
        replan = _replan_of(result)
        timed_out = limit is not None and time.monotonic() - began >= limit
        if replan and timed_out:
            console.print(f"sdpipe: train.time_limit ({limit:g} s) passed while the run stopped "
                          "to re-plan; it ends here", markup=False, highlight=False, soft_wrap=True)
        elif replan and not result.interrupted and result.run_dir is not None:
            for sig, handler in replaced.items():  # preparing again: an interrupt ends sdpipe
                signal.signal(sig, handler)
            leg = _replanned_leg(console, result, replan, holder)
            if leg is None:
                break
            run_cfg, run_dir = leg.cfg, result.run_dir
            from_checkpoint, done = leg.checkpoint, leg.done
            started_from = leg.checkpoint  # a failure of this leg restarts from here at worst
            elapsed = time.time() - origin  # the run clock goes on through the re-plan
            continue
        if (restarts is None or result.returncode != EXIT_FAILED or result.interrupted
                or result.run_dir is None):
            break  # an interrupt is never restarted, nor a run stopped before its folder existed
        if timed_out:  # a failed launch (EXIT_FAILED) says why: its failure is set
            result.failure = cast(str, result.failure) + (
                f" (train.time_limit={limit:g} s has passed: not restarted)")
            break
        left = None if limit is None else round(limit - (time.monotonic() - began), 4)
        run_cfg = carry_slowdowns(run_cfg, result.progress)
        reached = _reached(result.progress)
        # a crash loop fails where the last failure did; a run that got further made progress
        progressed, furthest = reached > furthest, max(furthest, reached)
        leg = _next_leg(console, result, restarts, origin, run_cfg, started_from, progressed, left)
        if leg is None:
            break
        run_dir, (from_checkpoint, done) = result.run_dir, leg
        elapsed = time.time() - origin
    try:
        display.run_folder(console, result)
        if result.failure:
            console.print(f"sdpipe: error: {result.failure}", markup=False, highlight=False,
                          soft_wrap=True)
            return result.returncode
        display.summary(console, result, time.monotonic() - began, restarts.used if restarts else 0)
        return 0
    finally:  # reported: what comes next (a sweep's next job) is preparing again
        for sig, handler in (preparing_handlers or {}).items():
            signal.signal(sig, handler)


def _replan_of(result) -> dict | None:
    """The re-plan a launch stopped for (the scheduler's last snapshot, else its summary.json);
    None when it ended otherwise."""
    if result.returncode != 0 or result.run_dir is None:
        return None
    replan = (result.progress or {}).get("replan")
    if replan is None and (Path(result.run_dir) / "summary.json").is_file():
        import json

        try:
            replan = json.loads((Path(result.run_dir) / "summary.json").read_text()).get("replan")
        except (OSError, ValueError, AttributeError):
            replan = None
    return replan if isinstance(replan, dict) else None


def _replanned_leg(console: Console, stopped, replan: dict, holder: run_lock.Holder):
    """The leg after a launch that stopped to re-plan (``fault.on_slowdown=replan``): the run
    goes on from the checkpoint its stop wrote, resharded to the new split, as ``sdpipe resume
    RUN pipeline.partition=[...] pipeline.partitions={...}`` would (the new splits and the
    slowdowns measured so far are in the next leg's config). A new split that cannot be had (it
    does not fit the devices' memory) leaves the split as it is: the run goes on from the
    checkpoint with it, and says why. None, with ``stopped`` saying why, when it cannot go on."""
    from sdpipe_cli.core.errors import BadInput

    partition = ",".join(str(int(b)) for b in replan["partition"])
    own = ", ".join(f"{int(p)}: [{', '.join(str(int(b)) for b in bounds)}]"
                    for p, bounds in (replan.get("partitions") or {}).items())
    slowed = ", ".join(f"{k}: {float(v)}" for k, v in replan.get("slowed", {}).items())
    split = f"pipelines {own} (the others [{partition}])" if own else f"[{partition}]"
    console.print(f"sdpipe: re-planning the split to {split}: {replan.get('reason', '')}",
                  markup=False, highlight=False, soft_wrap=True)
    try:
        try:
            return resuming.prepare(str(stopped.run_dir), [f"pipeline.partition=[{partition}]",
                                                           f"pipeline.partitions={{{own}}}",
                                                           f"fault.slowed={{{slowed}}}"],
                                    console, holder)
        except BadInput as err:
            console.print(f"sdpipe: the new split cannot be had ({err}); going on with the "
                          "split as it was", markup=False, highlight=False, soft_wrap=True)
            return resuming.prepare(str(stopped.run_dir), [f"fault.slowed={{{slowed}}}"],
                                    console, holder)
    except (BadInput, CheckpointError) as err:
        stopped.returncode = EXIT_FAILED
        stopped.failure = f"the run stopped to re-plan but cannot go on: {err}"
        return None


def carry_slowdowns(run_cfg, progress: dict | None):
    """``fault.on_slowdown=replan``: the leg after a failure starts from the slowdowns the failed
    one measured (its scheduler's last snapshot), as a re-plan's leg does, so a device that
    slowed down since the last re-plan is not taken for the device's own speed."""
    slowed = (progress or {}).get("slowed")
    if run_cfg.fault.on_slowdown == "replan" and isinstance(slowed, dict):
        return derived.with_slowed(run_cfg, slowed)
    return run_cfg


def _reached(progress: dict | None) -> int:
    """The iterations of all pipelines a failed leg reached (its scheduler's last snapshot)."""
    return sum(int(s["steps"]) for s in (progress or {}).get("pipelines", {}).values())


def _next_leg(console: Console, failed, restarts, origin: float, run_cfg, started_from,
              progressed: bool, time_left: float | None):
    """What follows the ``failed`` launch of a run with ``fault.on_failure=restart``: (the
    checkpoint to resume from, or None to start again from scratch, and the iterations it holds),
    once the back-off has passed; None when the run ends instead, with ``failed`` saying why (the
    budget is used up, or an interrupt came during the back-off).

    The checkpoint is the run's newest complete one of this layout whose files check out (or the
    one the run was resumed from); without one the run starts again in its folder. Says so on
    stderr and in ``metrics.jsonl`` (a ``restart`` line, with the iterations each pipeline will
    do again: the last it reached minus the checkpoint's, and ``time_left``, what is left of
    ``train.time_limit`` for the legs to come).
    """
    from sdpipe_cli import checkpoint
    from sdpipe_cli.cli import supervisor
    from sdpipe_cli.runtime.metrics import MetricsLog

    wait = restarts.take("run", time.monotonic(), progressed=progressed)
    if wait is None:
        failed.failure += f" (restarts used up: fault.max_restarts={restarts.limit})"
        return None
    manifest: dict[str, Any]  # checkpoint.verify's
    ckpt, manifest = None, {"steps": {}}
    for candidate in resuming.restart_points(failed.run_dir, run_cfg, started_from):
        try:
            manifest = checkpoint.verify(candidate)
        except CheckpointError:
            continue
        ckpt = candidate
        break
    steps = manifest["steps"]
    reached = {str(p): s["steps"] for p, s in failed.progress.get("pipelines", {}).items()}
    redone = {p: max(0, k - int(steps.get(p, 0))) for p, k in sorted(reached.items())}
    where = (f"{ckpt.relative_to(failed.run_dir)}" if ckpt is not None
             else "the start (no checkpoint yet)")
    console.print(f"sdpipe: warning: {failed.failure}; restarting from {where} (restart "
                  f"{restarts.used} of {restarts.limit}, in {wait:.1f} s)", markup=False,
                  highlight=False, soft_wrap=True)
    log = MetricsLog(failed.run_dir / "metrics.jsonl")
    try:
        log.write(RestartLine.line(restart=restarts.used, time=round(time.time() - origin, 4),
                                   reason=failed.failure,
                                   from_checkpoint=None if ckpt is None else manifest["step"],
                                   redone=redone, backoff_s=wait,
                                   **({} if time_left is None else {"time_left": time_left})))
    finally:
        log.close()
    phase = supervisor.Phase("waiting to restart")  # counts Ctrl-C and SIGTERM while nothing runs
    previous = phase.install()
    try:
        deadline = time.monotonic() + wait
        while not phase.signals and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    finally:
        phase.restore(previous)
    if phase.signals:
        failed.returncode = EXIT_INTERRUPTED
        failed.failure = "interrupted while waiting to restart; no process of the run was running"
        return None
    return ckpt, sum(int(k) for k in steps.values())


def _nothing(*_) -> None:
    pass
