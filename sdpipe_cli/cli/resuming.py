"""``sdpipe resume``: from a checkpoint and the user's changes to the run config of the next leg,
resharded first when the layout changed.

A resumed run keeps the saved config except where the user changes it, and may change only
what the saved state does not depend on (:data:`RESUMABLE`), plus the layout: where the run
runs (``cluster=NAME``, any ``cluster.*`` key, ``profile``) and how the model is split
(``cluster.pipelines``, ``pipeline.stages``, ``pipeline.partition``). A new layout is resumed
from a checkpoint written for it (:mod:`sdpipe_cli.training.reshard_checkpoint`); the run's budget in
samples stays as it was unless ``train.steps`` is given too.

A leg goes on in the checkpoint's own run folder, held against other launchers
(:mod:`~sdpipe_cli.runtime.run_lock`), or in a new one (``run.dir``, or beside a checkpoint that
lies outside its run). A saved config is data: the code it names runs only as sealed by one of
this user's launches, or with ``--trust-code`` (:mod:`~sdpipe_cli.config.trust`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf, open_dict
from rich.console import Console

from sdpipe_cli.config import derived, trust, yaml_bounds
from sdpipe_cli.config.composition import compose, mapping_settings
from sdpipe_cli.config.saved import typed
from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.config.validation import validate
from sdpipe_cli.core.interleaved import CHUNKED_SCHEDULES
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.core.schedule import SCHEDULES
from sdpipe_cli.runtime import network, run_lock
from sdpipe_cli.runtime.errors import CheckpointError

__all__ = ["RESUMABLE", "LAYOUT", "Leg", "prepare"]

# What a resumed run may change: its length, logging, timeouts, where it runs, and the learning
# rate and clipping (to go back before a divergence with a lower rate). Everything else (model,
# data, sync, the optimizer's kind and state) shaped the saved state.
RESUMABLE = ("train.steps", "train.time_limit", "train.eval_every", "train.log_every", "train.lr",
             "train.grad_clip", "train.on_nonfinite", "train.max_skipped",
             "run.timeout", "run.heartbeat_timeout", "run.port", "run.save_final",
             "checkpoint.every", "checkpoint.keep", "data.eval_batches", "data.num_workers",
             "data.prefetch", "data.verify", "fault.on_slowdown", "fault.slowed")
# The layout, which a resume may change too: the checkpoint is resharded for it.
_SPLIT = ("pipeline.stages", "pipeline.chunks", "pipeline.partition", "pipeline.partitions",
          "profile")
LAYOUT = ("cluster=NAME", "cluster.*", *_SPLIT)


@dataclass(frozen=True)
class Leg:
    """What the next leg of a resumed run starts from."""

    cfg: DictConfig
    checkpoint: Path
    elapsed: float
    done: int  # pipeline-iterations the checkpoint holds
    fresh: bool = False  # goes on in a new run folder (made already), not in the checkpoint's run


def resumable(key: str) -> bool:
    return key in RESUMABLE or key in _SPLIT or key.startswith("cluster.")


FLUSHED = (*SCHEDULES, *CHUNKED_SCHEDULES)  # each makes the same update from the same state


def keeps_state(saved: DictConfig, key: str, value: str) -> bool:
    """A change the saved state does not depend on by its value: one flushed schedule for
    another (GPipe, 1F1B, ZB-H1, interleaved 1F1B and zero bubble make the same update from the same weights
    and optimizer state, and a checkpoint holds nothing else of them; asynchronous 1F1B keeps weight versions
    of its own)."""
    return (key == "pipeline.schedule" and saved.pipeline.schedule in FLUSHED
            and value in FLUSHED)


def prepare(path: str, overrides: Sequence[str], console: Console, holder: run_lock.Holder,
            trusted: bool = False) -> Leg:
    """The next leg of the run of ``path`` (a run folder or a checkpoint) with ``overrides``:
    checked, prepared for this machine, and resharded if its layout changed. Bad input raises
    :class:`~sdpipe_cli.core.errors.BadInput` before anything is written.

    The leg goes on in the checkpoint's own run folder, whose lock ``holder`` takes before
    anything is read there; or, for a checkpoint that lies outside its run, or with ``run.dir``
    given, in a new run folder (``run.dir``, else one made beside the checkpoint), never in the
    folder that happens to hold the checkpoint. Code the saved config names runs only if a run
    of this user's sealed it, or the user ``trusted`` it (:mod:`~sdpipe_cli.config.trust`)."""
    from sdpipe_cli import checkpoint
    from sdpipe_cli.cli import preparing
    from sdpipe_cli.training import reshard_checkpoint as reshard

    path = str(Path(path).absolute())  # "." names a folder too
    ckpt = checkpoint.resolve(path)
    home = checkpoint.home_of(ckpt, checkpoint.read_manifest(ckpt))
    requested = _value("run.dir", overrides)
    fresh = home is None or requested is not None
    if not fresh:
        run = cast(Path, home)  # not fresh: the checkpoint lies in its run (home is not None)
        _no_links(run)
        holder.take(run)  # before reading what another launcher of this run may be writing
        ckpt = checkpoint.resolve(path)  # the newest complete checkpoint, now that it stays so
        for skipped in checkpoint.damaged(run):
            console.print(f"sdpipe: warning: {skipped} has no readable manifest (cut short or "
                          "damaged): passed over, and kept", markup=False, highlight=False,
                          soft_wrap=True)
    manifest = checkpoint.verify_run(ckpt)  # every shard's checksum, before anything starts
    trust.check(manifest["config"], str(ckpt / checkpoint.MANIFEST), trusted)
    saved = typed(manifest["config"], str(ckpt / checkpoint.MANIFEST))
    cfg = apply_overrides(saved, overrides)
    cfg.run.dir = str(home) if not fresh else (requested or str(_beside(ckpt)))
    validate(cfg)
    network.check_hosts(cfg)
    run_cfg = preparing.prepare(cfg)[0]

    def destination(checked: DictConfig) -> tuple[Path, DictConfig]:
        """The run folder the leg writes into, and its config: a new folder is made (and
        locked) only now, once ``checked`` passed every check, for a run of its own (a new
        ``run.id``) from its checkpoint on."""
        if not fresh:
            return Path(cast(Path, home)), checked  # not fresh: home is not None
        from sdpipe_cli.cli import launcher

        preparing.check_memory(checked)
        folder = launcher.make_run_dir(checked.run.dir)
        holder.take(folder)
        console.print(f"resuming {ckpt} in a new run folder, {folder}"
                      + (" (the checkpoint lies outside its run)" if home is None else ""),
                      highlight=False, soft_wrap=True)
        return folder, derived.with_run(checked, id=uuid.uuid4().hex)

    if reshard.layout_of(saved) != reshard.layout_of(run_cfg):
        return _resharded(ckpt, manifest, saved, run_cfg, _given("train.steps", overrides),
                          console, destination, fresh)
    _left_to_train(RunPlan.of(run_cfg).budget, sum(manifest["steps"].values()), ckpt,
                   "pipeline-iterations")
    _, run_cfg = destination(run_cfg)
    console.print(f"resuming {ckpt} (iterations per pipeline: {manifest['steps']})",
                  highlight=False)
    return Leg(run_cfg, ckpt, manifest["elapsed"], sum(manifest["steps"].values()), fresh)


# what a launcher writes or appends to in a run folder it goes on in
_WRITTEN = ("metrics.jsonl", "summary.json", "logs", "checkpoints", "resharded", "final", "tb",
            "trace.json", "run.lock")


def _no_links(run: Path) -> None:
    """A run folder from elsewhere can hold links where sdpipe writes (``metrics.jsonl`` to a
    file of yours): going on there would write through them. Refused, naming the first."""
    logs = run / "logs"
    places = [run / name for name in _WRITTEN]
    if logs.is_dir() and not logs.is_symlink():
        places += sorted(logs.iterdir())
    for place in places:
        if place.is_symlink():
            raise ConfigError(str(place), "is a symbolic link, where the run writes; resume into "
                              "a new folder with run.dir=NEW")


def _beside(ckpt: Path) -> Path:
    """A new run folder beside a checkpoint that lies outside its run: ``<ckpt>-resumed``."""
    if ckpt.parent.name in ("checkpoints", "resharded"):
        raise ConfigError("run.dir", f"{ckpt} lies in {ckpt.parent.parent} but is not that run's "
                          "checkpoint (it carries another run's id): resume it into a new folder "
                          "with run.dir=NEW")
    from sdpipe_cli import checkpoint

    folder = ckpt.with_name(f"{ckpt.name}-resumed")
    return checkpoint.free_name(folder, "") if folder.exists() else folder


def _left_to_train(budget: int, done: int, ckpt: Path, unit: str) -> None:
    """A leg with nothing left of its budget would train nothing and then write a summary of no
    steps over the run's own: refused, before anything is written."""
    if done >= budget:
        raise ConfigError("train.steps", f"leaves nothing to train: {ckpt} has done {done} of the "
                          f"{budget} {unit} the budget allows; give a larger train.steps to go on")


def _resharded(ckpt: Path, manifest: dict[str, Any], old: DictConfig, new: DictConfig,
               steps_given: bool, console: Console, destination, fresh: bool) -> Leg:
    """``old``: the checkpoint's own (prepared) config; ``new``: the next leg's."""
    from sdpipe_cli.cli import preparing
    from sdpipe_cli.training import reshard_checkpoint as reshard

    before, after = reshard.layout_of(old), reshard.layout_of(new)
    plan = reshard.plan_for(ckpt, manifest, old, new,
                            int(new.train.steps) if steps_given else None)
    new = derived.with_values(new, {"train.steps": plan.train_steps})
    _left_to_train(plan.budget[1], plan.done[1], ckpt, "samples")
    known = RunPlan.of(new)  # its budget changed
    new = derived.with_values(new, {"plan": RunPlan.resolve(
        new, known.cluster, known.blocks,
        preparing.balance_of(new, known.cluster, known.blocks), known.layout).section()})
    preparing.check_memory(new)  # bad input: before the resharded checkpoint is written
    folder, new = destination(new)
    folder = reshard.write(ckpt, manifest, old, new, plan, folder)
    console.print(f"resharded {ckpt}: {before.describe()} -> {after.describe()}; train.steps "
                  f"{old.train.steps} -> {plan.train_steps}",
                  highlight=False, soft_wrap=True)
    if plan.changed and not steps_given:
        console.print(f"sdpipe: warning: {after.pipelines} pipelines cannot share the rest of the "
                      f"budget evenly: the run trains {plan.budget[1] - plan.done[1]} more samples "
                      f"instead of {plan.budget[0] - plan.done[0]}", markup=False,
                      highlight=False, soft_wrap=True)
    console.print(f"resuming {folder} (iterations per pipeline: {plan.steps})", highlight=False,
                  soft_wrap=True)
    return Leg(new, folder, manifest["elapsed"], sum(plan.steps.values()), fresh)


def _key_of(item: str) -> str:
    """The key an override sets (``+``/``++``/``~`` taken off)."""
    return item.split("=", 1)[0].lstrip("+~")


def _values(key: str, overrides: Sequence[str]) -> list[str]:
    """The values ``overrides`` give ``key``, in order."""
    return [item.partition("=")[2] for item in overrides
            if _key_of(item) == key]


def _value(key: str, overrides: Sequence[str]) -> str | None:
    """The (last) value ``overrides`` give ``key``; None if none, or empty."""
    return (_values(key, overrides) or [""])[-1] or None


def _given(key: str, overrides: Sequence[str]) -> bool:
    return bool(_values(key, overrides))


def apply_overrides(saved: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """``saved`` with the user's changes: ``cluster=NAME`` takes that cluster config (from
    sdpipe's configs and the run's ``--config-dir`` folders), then KEY=VALUE items apply. A new
    ``pipeline.stages`` or ``pipeline.chunks`` without a partition splits uniformly."""
    dotlist = []
    cluster = None
    for item in overrides:
        key = _key_of(item)
        if "=" not in item:
            raise ConfigError(key or "overrides", f"'{item}' is not KEY=VALUE")
        if key == "cluster":
            cluster = item.split("=", 1)[1]
        elif key == "run.dir":
            continue  # where the leg goes on: set by prepare
        elif not (resumable(key) or keeps_state(saved, key, item.split("=", 1)[1])):
            raise ConfigError(key, "cannot change when resuming: the saved state depends on it "
                              f"(resume may change {', '.join(RESUMABLE + LAYOUT)}, "
                              f"pipeline.schedule between {', '.join(FLUSHED)}, "
                              "and run.dir: a new folder)")
        else:
            dotlist.append(item)
    cfg = saved.copy()
    if cluster is not None:
        dirs = list(saved.run.config_dirs)
        for folder in dirs:
            if Path(folder).is_dir():
                yaml_bounds.check_folder(Path(folder), "run.config_dirs")
        search = [f"hydra.searchpath=[{','.join('file://' + d for d in dirs)}]"] if dirs else []
        cfg.cluster = compose([*search, f"cluster={cluster}"]).cluster
    if ((_given("pipeline.stages", overrides) or _given("pipeline.chunks", overrides))
            and not _given("pipeline.partition", overrides)):
        cfg.pipeline.partition = "uniform"
    # a mapping given (pipeline.partitions, fault.slowed) is the mapping, not added to the saved
    mappings = [i for i in dotlist if _key_of(i) in mapping_settings()]
    try:
        merged = cast(DictConfig, OmegaConf.merge(cfg, OmegaConf.from_dotlist(  # into a DictConfig
            [i for i in dotlist if i not in mappings])))
        for item in mappings:
            key = _key_of(item)
            with open_dict(merged):
                OmegaConf.update(merged, key, OmegaConf.select(OmegaConf.from_dotlist([item]), key),
                                 merge=False)
        return merged
    except Exception as err:  # OmegaConf's validation errors name the key
        key = getattr(err, "full_key", None) or "overrides"
        raise ConfigError(key, str(err).splitlines()[0]) from None


def _own(partitions: Any) -> dict[int, list[int]]:
    """``pipeline.partitions`` as written in a config or a manifest (JSON: keys as strings)."""
    return {int(k): [int(b) for b in v] for k, v in (partitions or {}).items()}


def restart_points(run_dir: Path, cfg: DictConfig, started_from: Path | None) -> list[Path]:
    """The checkpoints a failed leg of ``cfg`` may start again from, newest first: the run's own
    of this layout, and the one the leg started from (a resharded one lies apart)."""
    from sdpipe_cli import checkpoint

    found = checkpoint.complete_checkpoints(run_dir)
    if started_from is not None and started_from not in found:
        found.append(started_from)
    want = (int(cfg.cluster.pipelines), int(cfg.pipeline.stages), list(cfg.pipeline.partition),
            _own(cfg.pipeline.get("partitions")))
    points = []
    for candidate in found:
        try:
            manifest = checkpoint.read_manifest(candidate)
            saved = manifest["config"]["pipeline"]
            layout = (manifest["config"]["cluster"]["pipelines"], saved["stages"],
                      manifest.get("partition"), _own(saved.get("partitions")))
        except (CheckpointError, KeyError, TypeError):
            continue
        if layout == want:
            points.append((manifest["step"], candidate))
    return [path for _, path in sorted(points, key=lambda sp: sp[0], reverse=True)]
