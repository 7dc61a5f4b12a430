"""Hostile input, as a table: bad values, damaged files, forged store values and signals at odd
moments. Each row says what it does, the exit code it must get and a part of its one-line error.

Bad input a user can fix exits 2 with one line naming the key or file; a store value that no
process of the run wrote fails the run (exit 1) naming the store key, within a bounded time; an
interrupt exits 130. No row may leave a traceback on the terminal or a process behind.

A row starts processes only where a process boundary is what it tests: a worker's refusal of its
shard, a forged value read by the scheduler's or the launcher's own process, workers left running
by a scheduler that ended, a signal. Everything refused before any process starts runs in this
process (``helpers.sdpipe``); what a worker checks of its shard, and what the scheduler makes of
an event, are checked in this process too, by their own code (tables below the rows).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from omegaconf import OmegaConf
from rich.console import Console

from sdpipe_cli import checkpoint as ck
from sdpipe_cli.cli import resuming
from sdpipe_cli.config import trust
from sdpipe_cli.config.composition import compose
from sdpipe_cli.config.saved import typed
from sdpipe_cli.core.plan import RunPlan
from sdpipe_cli.model import models, optim
from sdpipe_cli.runtime import protocol, run_lock, store
from sdpipe_cli.runtime.errors import CheckpointError
from sdpipe_cli.sync.scheduler import process as scheduler_process
from sdpipe_cli.sync.scheduler.handling import Scheduler
from tests.helpers import (
    finish,
    free_port,
    interrupt_command,
    kill_leftovers,
    metrics,
    one_error_line,
    run_processes,
    sdpipe,
    sdpipe_beside,
    sdpipe_popen,
    training_lines,
    wait_for,
)

TINY = ("model=mlp", "data=synthetic", "train.steps=4", "train.batch_size=8")
LONG = ("model=mlp", "data=synthetic", "train.steps=100000", "train.batch_size=8",
        "cluster.pipelines=2", "pipeline.stages=2", "checkpoint.every=0", "train.eval_every=0",
        "run.timeout=20", "cluster.compute_ms=10")  # until stopped: sleeping, not spinning


@dataclass
class Row:
    name: str
    args: Callable[[Path, Path], list[str]]  # (tmp_path, a copy of a finished run) -> CLI args
    code: int
    message: str  # a part of the error line
    inject: Callable[[dist.Store], None] | None = None  # forged store values, once running
    signal_at: float | None = None  # SIGTERM the CLI this many seconds after its start
    absent: str = ""  # a path (under tmp_path) that must not exist afterwards: code that ran


def fixed(*args: str) -> Callable[[Path, Path], list[str]]:
    return lambda tmp, run: list(args)


def train(*args: str) -> Callable[[Path, Path], list[str]]:
    return lambda tmp, run: ["train", f"run.dir={tmp / 'new'}", *TINY, *args]


# -- damaged files ---------------------------------------------------------------------------------


def _rehash(ckpt: Path, name: str) -> None:
    """Make the manifest agree with a rewritten shard, as a careless tool would."""
    manifest = json.loads((ckpt / ck.MANIFEST).read_text())
    manifest["files"][name] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    (ckpt / ck.MANIFEST).write_text(json.dumps(manifest))


def shard_changed(change: Callable[[dict], None]) -> Callable[[Path, Path], list[str]]:
    def args(tmp: Path, run: Path) -> list[str]:
        newest = ck.latest(run)
        state = torch.load(newest / "0.pt", weights_only=True)
        change(state)
        torch.save(state, newest / "0.pt")
        _rehash(newest, "0.pt")
        return ["resume", str(run), "train.steps=30"]  # steps left to train, so workers load it
    return args


def first_weight(state: dict, to: Callable[[torch.Tensor], torch.Tensor]) -> None:
    key = next(iter(state["model"]))
    state["model"][key] = to(state["model"][key])


# A shard whose checksum matches (rehashed) but whose tensors are not the stage's: what the worker
# checks before loading it, and a part of its error.
SHARD_CHANGES: dict[str, tuple[Callable[[dict], None], str]] = {
    "weights saved as integers": (lambda s: first_weight(s, lambda t: t.to(torch.int64)),
                                  "is torch.int64, the model's is torch.float32"),
    "weights of another shape": (lambda s: first_weight(s, lambda t: t[:1]), "has shape"),
    "a weight missing": (lambda s: s["model"].popitem(), "model lacks"),
    "optimizer of other parameters": (lambda s: s["optimizer"]["param_groups"][0]["params"].pop(),
                                      "optimizer state is for other parameters"),
}


def manifest_changed(change: Callable[[dict], None], every: bool = False):
    """Change the newest checkpoint's manifest and resume that checkpoint by name (a run folder
    would pass over it to the one before), or (``every``) every manifest and resume the run."""
    def args(tmp: Path, run: Path) -> list[str]:
        chosen = ck.complete_checkpoints(run) if every else [ck.latest(run)]
        for ckpt in chosen:
            manifest = json.loads((ckpt / ck.MANIFEST).read_text())
            change(manifest)
            (ckpt / ck.MANIFEST).write_text(json.dumps(manifest))
        return ["resume", str(run if every else chosen[0])]
    return args


MARK = "MARK"  # the folder a doctored config asks os.mkdir to make
DOCTORED_MODEL = {"name": "custom", "arch": "custom", "_target_": "os.mkdir", "kwargs": {}}


def doctored_manifest(tmp: Path, run: Path) -> list[str]:
    """A checkpoint whose manifest (which has no checksum of its own) names code to run."""
    newest = ck.latest(run)
    manifest = json.loads((newest / ck.MANIFEST).read_text())
    manifest["config"]["model"] = {**DOCTORED_MODEL, "kwargs": {"path": str(tmp / MARK)}}
    (newest / ck.MANIFEST).write_text(json.dumps(manifest))
    return ["resume", str(run)]


def interpolated_loss(tmp: Path, run: Path) -> list[str]:
    """A manifest whose plain-looking loss resolves into code once merged:
    ``${oc.create:{_target_: ...}}`` (a saved config is written resolved: refused as such)."""
    newest = ck.latest(run)
    manifest = json.loads((newest / ck.MANIFEST).read_text())
    manifest["config"]["model"]["loss"] = "${oc.create:{_target_: os.mkdir, path: %s}}" % (tmp / MARK)
    (newest / ck.MANIFEST).write_text(json.dumps(manifest))
    return ["resume", str(run)]


def linked_metrics(tmp: Path, run: Path) -> list[str]:
    """A run folder whose metrics.jsonl is a link to a file of the user's."""
    (tmp / "victim.txt").write_text("mine\n")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(tmp / "victim.txt")
    return ["resume", str(run), "train.steps=21"]


def copied_into_another_run(tmp: Path, run: Path) -> list[str]:
    """A checkpoint copied into the checkpoints of a run it is not from."""
    other = tmp / "other"
    (other / "checkpoints").mkdir(parents=True)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["run"]["id"] = "another-run"
    (other / "config.yaml").write_text(yaml.safe_dump(config))
    shutil.copytree(ck.latest(run), other / "checkpoints" / "step_20")
    return ["resume", str(other)]


def another_runs_checkpoint(command: str, link: bool = False) -> Callable[[Path, Path], list[str]]:
    """Another run's checkpoint (a run of another id) copied, or linked, into the run's
    checkpoints as its newest, then exported or evaluated by the run's folder."""
    def args(tmp: Path, run: Path) -> list[str]:
        other = tmp / "other" / "step_115"
        shutil.copytree(ck.latest(run), other)
        manifest = json.loads((other / ck.MANIFEST).read_text())
        manifest["config"]["run"]["id"] = "another-run"
        (other / ck.MANIFEST).write_text(json.dumps(manifest))
        if link:
            (run / "checkpoints" / "step_115").symlink_to(other)
        else:
            shutil.copytree(other, run / "checkpoints" / "step_115")
        return [command, str(run), "--out", str(tmp / "out")]
    return args


def out_of_the_run(tmp: Path, run: Path) -> list[str]:
    """A CHECKPOINT whose '..' leads from the run's checkpoints/ into another folder."""
    shutil.copytree(ck.latest(run), tmp / "other" / "checkpoints" / "step_20")
    return ["export", str(run), "../../other/checkpoints/step_20", "--out", str(tmp / "out")]


def under_a_file(command: str, out: str) -> Callable[[Path, Path], list[str]]:
    """``--out`` below a file: refused before the run (here none) is read."""
    def args(tmp: Path, run: Path) -> list[str]:
        (tmp / "afile").write_text("mine")
        return [command, str(run), "--out", str(tmp / "afile" / out)]
    return args


def metrics_file(text: str) -> Callable[[Path, Path], list[str]]:
    def args(tmp: Path, run: Path) -> list[str]:
        folder = tmp / "reported"
        folder.mkdir()
        shutil.copy(run / "config.yaml", folder / "config.yaml")
        (folder / "metrics.jsonl").write_text(text)
        return ["report", str(folder), "--out", str(tmp / "figures")]
    return args


def config_bytes(tmp: Path, run: Path) -> list[str]:
    (run / "config.yaml").write_bytes(b"\xff\xfe not yaml: [")
    return ["report", str(run), "--out", str(tmp / "figures")]


def empty_folder(tmp: Path, run: Path) -> list[str]:
    (tmp / "images").mkdir()
    return ["train", f"run.dir={tmp / 'new'}", "data=imagefolder", f"data.path={tmp / 'images'}",
            "model=resnet_cifar", "train.steps=2"]


def bomb_text() -> str:
    """A YAML document of a few hundred bytes that expands to 10**10 values."""
    lines = ["pipelines: 2", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    return "\n".join(lines) + "\nall: *a9\n"


def alias_bomb(tmp: Path, run: Path) -> list[str]:
    """A cluster file of a few hundred bytes that YAML expands to 10**10 values."""
    (tmp / "mine" / "cluster").mkdir(parents=True)
    (tmp / "mine" / "cluster" / "bomb.yaml").write_text(bomb_text())
    return ["train", "--config-dir", str(tmp / "mine"), "cluster=bomb", f"run.dir={tmp / 'new'}",
            *TINY]


def named_pipe(tmp: Path, run: Path) -> list[str]:
    """A FIFO as a text corpus: its reader would wait for a writer forever."""
    os.mkfifo(tmp / "fifo")
    return ["train", f"run.dir={tmp / 'new'}", *TINY, "data=text", f"data.path={tmp / 'fifo'}"]


def bombed_run(tmp: Path) -> Path:
    """A run folder whose config.yaml is an alias bomb (its metrics a recorded group round)."""
    run = tmp / "r"
    run.mkdir()
    (run / "config.yaml").write_text(bomb_text())
    (run / "metrics.jsonl").write_text('{"kind": "group", "stage": 0, "round": 1, "group": '
                                       '"group", "members": [0], "iterations": [0], "stop": '
                                       'false, "done": 1}\n')
    return run


def replayed_bomb(tmp: Path, run: Path) -> list[str]:
    return ["train", f"run.dir={tmp / 'new'}", *TINY, f"sync.replay={bombed_run(tmp)}"]


def reported_bomb(tmp: Path, run: Path) -> list[str]:
    return ["report", str(bombed_run(tmp)), "--out", str(tmp / "figures")]


def named_pipe_profile(tmp: Path, run: Path) -> list[str]:
    """A FIFO as the profile: its reader would wait for a writer forever."""
    os.mkfifo(tmp / "fifo")
    return ["train", f"run.dir={tmp / 'new'}", *TINY, f"profile={tmp / 'fifo'}"]


def many_changes(tmp: Path, run: Path) -> list[str]:
    """A cluster file of plain speed changes, one more than a list may hold: no alias in it."""
    (tmp / "mine" / "cluster").mkdir(parents=True)
    entry = "  - {device: 'local:0', speed: 0.5, start: %d, end: %d.5}"
    lines = ["pipelines: 2", "changes:", *(entry % (i, i) for i in range(10_001))]
    (tmp / "mine" / "cluster" / "many.yaml").write_text("\n".join(lines) + "\n")
    return ["train", "--config-dir", str(tmp / "mine"), "cluster=many", f"run.dir={tmp / 'new'}",
            *TINY]


# -- forged store values -------------------------------------------------------------------------


def push_raw(text: str) -> Callable[[dist.Store], None]:
    return lambda events: events.queue_push(store.EVENTS, text)


def push_record(**record) -> Callable[[dist.Store], None]:
    return push_raw(json.dumps(record))


def forged_done(events: dist.Store) -> None:
    for rank in range(4):
        events.queue_push(store.EVENTS, json.dumps({
            "type": "done", "rank": rank, "pipeline": rank // 2, "stage": rank % 2, "time": 1.0,
            "steps": 1, "samples": 8}))


def long_run(*args: str) -> Callable[[Path, Path], list[str]]:
    return lambda tmp, run: ["train", f"run.dir={tmp / 'new'}", *LONG, *args]


TRAIN_LR = "train.lr"
# values: refused before anything is written or started (in this process, no run needed)
VALUE_ROWS = [
    Row("lr infinite", train("train.lr=inf"), 2, TRAIN_LR),
    Row("lr negative", train("train.lr=-1"), 2, TRAIN_LR),
    Row("lr not a number", train("train.lr=fast"), 2, TRAIN_LR),
    Row("momentum above 1", train("train.optimizer=sgd", "train.momentum=1.5"), 2, "train.momentum"),
    Row("weight decay nan", train("train.weight_decay=nan"), 2, "train.weight_decay"),
    Row("negative clip", train("train.grad_clip=-1"), 2, "train.grad_clip"),
    Row("no stages", train("pipeline.stages=0"), 2, "pipeline.stages"),
    Row("empty batch", train("train.batch_size=0"), 2, "train.batch_size"),
    Row("negative steps", train("train.steps=-5"), 2, "train.steps"),
    Row("unknown model", train("model=nonexistent"), 2, "model"),
    Row("unknown sync mode", train("sync=bogus"), 2, "sync"),
    Row("unknown key", train("+foo.bar=1"), 2, "foo"),
    Row("run.dir too long", lambda tmp, run: ["train", f"run.dir={tmp / ('d' * 300)}", *TINY], 2,
        "run.dir"),
    Row("on_nonfinite unknown", train("train.on_nonfinite=maybe"), 2, "train.on_nonfinite"),
    Row("port out of range", train("run.port=70000"), 2, "run.port"),
    Row("partition of the wrong length", train("pipeline.stages=2", "pipeline.partition=[1,2,3]"), 2,
        "pipeline.partition"),
    Row("dataset that does not import", train("data=custom", "data._target_=no.such.maker"), 2,
        "data._target_"),
    Row("slow-down infinite", train("cluster.pipelines=2", "cluster.slowdown=[inf,1]"), 2,
        "cluster.slowdown[0]: must be a finite number"),
    Row("compute infinite", train("cluster.compute_ms=inf"), 2, "cluster.compute_ms: must be a finite"),
    Row("link latency infinite", train("cluster.links.cross_node.latency_ms=inf"), 2,
        "cluster.links.cross_node.latency_ms: must be a finite"),
    Row("group timeout infinite", train("sync.group_timeout=inf"), 2, "sync.group_timeout: must be"),
    # finite, but past what a clock, a C int, a float32 or a generator holds
    Row("link latency of 1e300 ms", train("cluster.links.same_node.latency_ms=1e300"), 2,
        "cluster.links.same_node.latency_ms: is 1e+300; must be in [0, 3.6e+06]"),
    Row("link bandwidth of 1e-300", train("cluster.links.same_node.bandwidth_gbps=1e-300"), 2,
        "cluster.links.same_node.bandwidth_gbps: must be at least 1e-06"),
    Row("group timeout of 1e300 s", train("sync.group_timeout=1e300"), 2, "sync.group_timeout: is 1e+300"),
    Row("run timeout of 1e300 s", train("run.timeout=1e300"), 2, "run.timeout: is 1e+300 s; at most 1e+06"),
    Row("learning rate of 1e300", train("train.lr=1e300"), 2, "train.lr: is 1e+300; must be in [0, 3.4e+38]"),
    Row("seed past 64 bits", train("train.seed=100000000000000000000"), 2, "train.seed: is 1000000000"),
    Row("a billion loader processes", train("data.num_workers=1000000000"), 2,
        "data.num_workers: is 1000000000; must be in 0..64"),
    Row("simulated jitter of 1e300", lambda tmp, run: ["simulate", f"run.dir={tmp / 'new'}", *TINY,
                                                       "cluster.compute_ms=10", "simulate.jitter=1e300"], 2,
        "simulate.jitter: is 1e+300; must be in [0, 1e+06]"),
    Row("sixty thousand slowdowns on the command line", train(
        "cluster.slowdown=[" + ",".join(["1"] * 60000) + "]"), 2,
        "cluster.slowdown: the override is 120,018 characters; one has at most 10,000"),
    Row("a straggler device named twice", train("cluster.stragglers.devices=[local:0,local:0]"), 2,
        "cluster.stragglers.devices: names local:0 twice"),
    Row("run timeout of a microsecond", train("run.timeout=1e-6"), 2, "run.timeout: is 1e-06 s"),
    Row("run timeout infinite", train("run.timeout=inf"), 2, "run.timeout: must be a finite"),
    Row("batch past int64", train("train.batch_size=100000000000000000000000"), 2,
        "train.batch_size: is 100000000000000000000000; at most"),
    Row("batch of a trillion", train("train.batch_size=1000000000000"), 2,
        "train.batch_size: the 4 workers on this machine need about"),
    Row("two thousand pipelines", train("cluster.pipelines=2000"), 2,
        "cluster.pipelines: the 4000 workers on this machine need"),
    Row("a million pipelines", train("cluster.pipelines=1000000"), 2,
        "cluster.pipelines: 1,000,000 pipelines of 2 stages are 2,000,000 workers; sdpipe runs "
        "at most 16,384"),
    Row("a million layers", train("model.n_layers=1000000"), 2, "model.n_layers: is 1,000,000; at most 1,024"),
    Row("a hundred million micro-batches", train("pipeline.microbatches=100000000",
                                                 "train.batch_size=100000000"), 2,
        "pipeline.microbatches: is 100,000,000; an iteration takes at most 65,536"),
    Row("a model whose weights alone do not fit", train("model.vocab_size=1000000000"), 2,
        "model: the 4 workers on this machine need about"),
    Row("a model too wide for a tensor", train("model.d_model=10000000000", "model.d_hidden=10000000000"), 2,
        "model: cannot be built at these sizes"),
    Row("home folder unquoted", train("data=text", "data.path=~/corpus"), 2,
        "data.path: Hydra's override grammar does not take '~'"),
    Row("alias bomb in a config folder", alias_bomb, 2, "expands to more than 100,000 values"),
    Row("named pipe as the data", named_pipe, 2, "is a named pipe (FIFO), not a file or a folder"),
    Row("device as the data", train("data=text", "data.path=/dev/zero"), 2,
        "data.path: '/dev/zero' is a character device"),
    Row("loss that does not import", train("model.loss={_target_: no.such.loss}"), 2,
        "model.loss._target_: cannot import 'no.such.loss'"),
    Row("loss class of other arguments", train("model.loss={_target_: torch.nn.CrossEntropyLoss, bogus: 1}"),
        2, "model.loss: torch.nn.CrossEntropyLoss(bogus) failed: TypeError"),
    Row("model that does not import", train("model=custom", "model._target_=no.such.build"), 2,
        "model._target_: cannot import 'no.such.build'"),
    Row("image folder without images", empty_folder, 2, "data.path"),
    # round three: eval
    Row("a billion evaluation batches", train("data.eval_batches=1000000000"), 2,
        "data.eval_batches: is 1000000000, but"),
    # round three: sample
    Row("sample prompt not UTF-8", lambda tmp, run: ["sample", str(tmp), "--prompt", "\udcff\udcfe"],
        2, "--prompt: is not UTF-8 text: byte 0xff at character 0"),
    Row("sample seed past 64 bits", lambda tmp, run: ["sample", str(tmp), "--prompt", "a", "--seed",
                                                      "99999999999999999999999"], 2, "--seed: must fit"),
    # round three: export
    Row("export --out below a file", under_a_file("export", "sub"), 2,
        "/afile is a file, not a folder: "),
    Row("eval --out below a file", under_a_file("eval", "sub/result.json"), 2,
        "/afile is a file, not a folder: "),
    # round three: config validation and bounded reading
    Row("meetings further apart than the run", train("sync.every=100"), 2,
        "sync.every: is 100, more than train.steps=4"),
    Row("meetings a billion steps apart", train("sync.every=1000000000"), 2,
        "sync.every: is 1000000000, more than train.steps=4"),
    Row("a round merged before it is sent", train("sync.overlap=-1"), 2,
        "sync.overlap: must be in [0, 1000] local steps, got -1"),
    Row("a round merged a billion steps late", train("sync.overlap=1000000000"), 2,
        "sync.overlap: must be in [0, 1000] local steps, got 1000000000"),
    Row("a setting of another sync mode", train("sync=allreduce", "sync.every=4"), 2,
        "sync.every: is a setting of sync=sdpipe, not of sync=allreduce"),
    Row("a speed change before the run", train("cluster.changes=[{device: 'local:0', speed: 0.5, "
                                               "start: -5, end: 2}]"), 2,
        "cluster.changes[0].start: is -5.0; must be >= 0"),
    Row("a speed change of 1e-300", train("cluster.changes=[{device: 'local:0', speed: 1e-300}]"),
        2, "cluster.changes[0].speed: is 1e-300; must be at least 0.01"),
    Row("a device of speed 1e-300", train("cluster.nodes=[{name: a, devices: [{speed: 1e-300}, "
                                          "{}, {}, {}]}]"), 2,
        "cluster.nodes[0].devices[0].speed: is 1e-300; must be at least 0.01"),
    Row("a pipeline slowed 1e300 times", train("cluster.slowdown=[1,1e300]"), 2,
        "cluster.slowdown: factors must be in [1, 100]"),
    Row("a straggler slowed 1e300 times", train("cluster.stragglers.probability=0.5",
                                                "cluster.stragglers.factor=1e300"), 2,
        "cluster.stragglers.factor: is 1e+300; must be >= 1.0 and at most 100"),
    Row("alias bomb as the replayed run's config", replayed_bomb, 2,
        "expands to more than 100,000 values through YAML aliases (*name); a config needs no "
        "such thing (given by sync.replay)"),
    Row("alias bomb as the reported run's config", reported_bomb, 2,
        "expands to more than 100,000 values"),
    Row("named pipe as the profile", named_pipe_profile, 2,
        "is a named pipe (FIFO), not a profile.json"),
    Row("ten thousand and one speed changes", many_changes, 2,
        "many.yaml: changes: has more than 10,000 entries; a list in a config has at most 10,000"),
]
# files: a copy of the shared finished run, damaged; refused before anything starts, but for one
# shard that a launched worker refuses
FILE_ROWS = [
    Row("resume of nothing", lambda tmp, run: ["resume", str(tmp / "absent")], 2, "does not exist"),
    Row("garbage manifest everywhere", manifest_changed(lambda m: m.clear(), every=True), 2,
        "no complete checkpoint"),
    Row("manifest steps of the wrong type", manifest_changed(lambda m: m.update(steps="many")), 2,
        "'steps' should be"),
    Row("manifest without its config", manifest_changed(lambda m: m.pop("config")), 2,
        "lacks 'config'"),
    Row("manifest doctored to run code", doctored_manifest, 2, "model._target_: ", absent=MARK),
    Row("manifest loss interpolated into code", interpolated_loss, 2,
        "model.loss: ", absent=MARK),
    Row("metrics.jsonl a link to another file", linked_metrics, 2,
        "metrics.jsonl: is a symbolic link, where the run writes"),
    Row("checkpoint copied into another run", copied_into_another_run, 2,
        "run.dir: ", absent="other/checkpoints/step_20-resumed"),
    Row("weights saved as integers", shard_changed(SHARD_CHANGES["weights saved as integers"][0]),
        2, SHARD_CHANGES["weights saved as integers"][1]),
    Row("metrics eval line without its loss", metrics_file(
        '{"kind": "note"}\n{oops\n{"kind": "eval", "time": 1.0}\n'), 2,
        "metrics.jsonl:3: a 'eval' line lacks 'val_loss'"),
    Row("metrics loss of the wrong type", metrics_file(
        '{"kind": "train", "time": 1, "pipeline": 0, "samples": 8, "loss": "low"}\n'), 2,
        "'loss' of a 'train' line"),
    Row("metrics line not an object", metrics_file("[1, 2]\n{}\n"), 2, "a metrics line is a JSON object"),
    Row("config.yaml not text", config_bytes, 2, "config.yaml"),
    # round three: export
    Row("another run's checkpoint copied into the run, exported", another_runs_checkpoint("export"),
        2, "/run/checkpoints/step_115: lies in ", absent="out"),
    Row("another run's checkpoint linked into the run, evaluated",
        another_runs_checkpoint("eval", link=True), 2, "(it carries another run's id)", absent="out"),
    Row("a CHECKPOINT that leads out of the run", out_of_the_run, 2,
        "CHECKPOINT: ../../other/checkpoints/step_20 is not a checkpoint of", absent="out"),
]
# forged store values, while a P=2 x S=2 run trains: one read by the scheduler's process (the
# others it refuses alike: FORGED_EVENTS below, in this process), workers left running by a
# scheduler that took forged reports for the end, one read by the launcher
STORE_ROWS = [
    Row("an event that is not JSON", long_run(), 1, "store key 'sdpipe/events': not JSON",
        inject=push_raw("{garbage")),
    Row("forged done reports", long_run(), 1, "still ran", inject=forged_done),
    Row("a malformed hung list", long_run("fault.on_pipeline_loss=restart"), 1,
        "store key 'sdpipe/hung'", inject=lambda events: events.set(store.HUNG, "[[1]]")),
]
# signals (SIGINT a moment after the start: test_supervision.py::test_interrupt_while_loading_is_one_line)
SIGNAL_ROWS = [
    Row("SIGTERM while starting", long_run(), 130, "interrupted while", signal_at=1.0),
]
ROWS = VALUE_ROWS + FILE_ROWS + STORE_ROWS + SIGNAL_ROWS


@pytest.fixture
def run_copy(allreduce_2x2_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(allreduce_2x2_run, copy)
    return copy


def _inject(port: int, inject: Callable[[dist.Store], None], stop: threading.Event) -> None:
    """Once the run's workers have all started, forge its store values."""
    deadline = time.monotonic() + 120
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            client = dist.TCPStore("127.0.0.1", port, is_master=False,
                                   timeout=timedelta(seconds=2))
            break
        except Exception:  # noqa: BLE001 - not listening yet
            time.sleep(0.2)
    else:
        return
    events = store.namespace(client)
    while not stop.is_set() and time.monotonic() < deadline:
        progress = store.get_json(events, store.PROGRESS) or {}
        if progress.get("started", 0) >= 4 and progress.get("iterations", 0) > 0:
            inject(events)
            return
        time.sleep(0.2)


def _param(row: Row):
    """A row as a test case: one on the shared run, or that starts processes, is multiprocess."""
    fast = any(row is r for r in VALUE_ROWS)
    return pytest.param(row, id=row.name, marks=() if fast else pytest.mark.multiprocess)


@pytest.mark.parametrize("row", [_param(r) for r in ROWS])
def test_hostile_input(row: Row, tmp_path, request):
    # only a file row changes a run: the others need none (and so no run is trained for them)
    on_run = any(row is r for r in FILE_ROWS)
    run_copy = request.getfixturevalue("run_copy") if on_run else tmp_path / "no-run"
    args = row.args(tmp_path, run_copy)
    before = {p: p.read_bytes() for p in run_copy.rglob("*") if p.is_file() and p.suffix != ".pid"}
    if row.signal_at is not None:
        proc = sdpipe_popen(*args)
        time.sleep(row.signal_at)
        proc.send_signal(signal.SIGTERM)
        code, err, _ = finish(proc, timeout=60)
    elif row.inject is not None:
        port = free_port()
        stop = threading.Event()
        forger = threading.Thread(target=_inject, args=(port, row.inject, stop), daemon=True)
        forger.start()
        try:
            out = sdpipe(*args, f"run.port={port}", timeout=120)
        finally:
            stop.set()
            forger.join(5)
        code, err = out.returncode, out.stderr
    else:
        out = sdpipe(*args)
        code, err = out.returncode, out.stderr
    assert code == row.code, err
    assert row.message in err, err
    assert not row.absent or not (tmp_path / row.absent).exists()
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("sdpipe: error:")]
    if row.code == 2:
        assert errors == [err.splitlines()[-1]], err
    if row.code == 130:
        assert len(errors) == 1, err
    for folder in (tmp_path / "new", run_copy):
        assert not kill_leftovers(folder) and not run_processes(folder)
    # nothing already written is lost or overwritten (logs and metrics may grow)
    changed = [p for p, data in before.items()
               if not p.exists() or not p.read_bytes().startswith(data)]
    assert not changed, changed


# -- in this process: what a worker checks of its shard, what the scheduler makes of an event ------


@pytest.mark.multiprocess  # the shard is the shared run's
@pytest.mark.parametrize("name", list(SHARD_CHANGES))
def test_a_shard_of_other_tensors_is_refused_by_the_workers_own_checks(allreduce_2x2_run, name):
    """Each change of SHARD_CHANGES, against the stage's module and optimizer built from the
    checkpoint's config as a resumed worker builds them, through the checks it makes before
    loading its shard (``training.worker``'s restore): one CheckpointError naming the shard. The
    shard as saved passes them. (That a worker's refusal ends the run in one line, exit 2: the
    row "weights saved as integers", launched.)"""
    change, message = SHARD_CHANGES[name]
    newest = ck.latest(allreduce_2x2_run)
    manifest = ck.read_manifest(newest)
    cfg = typed(manifest["config"], str(newest / ck.MANIFEST))
    state = ck.load_shard(newest, "0", manifest)
    module = models.build_stage_module(cfg, state["stage"])
    optimizer = optim.build_optimizer(module.parameters(), cfg.train)
    path = newest / ck.shard_name("0")
    ck.check_tensors(path, "model", module.state_dict(), state["model"])  # as saved: fine
    ck.check_optimizer(path, optimizer, state["optimizer"])
    change(state)
    with pytest.raises(CheckpointError) as refused:
        ck.check_tensors(path, "model", module.state_dict(), state.get("model"))
        ck.check_optimizer(path, optimizer, state.get("optimizer"))
    assert message in str(refused.value) and str(path) in str(refused.value)


@pytest.mark.multiprocess  # the run is the shared run
def test_a_config_yaml_doctored_to_run_code_is_not_what_a_resume_runs(tmp_path, run_copy):
    """A run folder whose config.yaml names code: a resume takes its config from the checkpoint
    and reads config.yaml for nothing but the run's id (what the leg's processes then read is
    the leg's own config file, written from the checkpoint's: each resume with a changed
    ``train.steps`` shows they run by it)."""
    config = yaml.safe_load((run_copy / "config.yaml").read_text())
    saved_model = config["model"]
    config["model"] = {**DOCTORED_MODEL, "kwargs": {"path": str(tmp_path / MARK)}}
    (run_copy / "config.yaml").write_text(yaml.safe_dump(config))
    said = io.StringIO()
    holder = run_lock.Holder()
    try:
        leg = resuming.prepare(str(run_copy), ["train.steps=21"], Console(file=said, width=200),
                               holder)
    finally:
        holder.release_all()
    assert leg.checkpoint == ck.latest(run_copy) and not leg.fresh
    assert leg.cfg.model.name == saved_model["name"] == "mlp" and leg.cfg.train.steps == 21
    assert "os.mkdir" not in str(OmegaConf.to_container(leg.cfg, resolve=False))
    assert "resuming" in said.getvalue()
    assert not (tmp_path / MARK).exists()


# round three: the trust key

@pytest.mark.multiprocess  # the run is the shared run
def test_a_manifest_sealed_with_a_key_others_can_read_runs_nothing(tmp_path, run_copy, monkeypatch):
    """SDPIPE_TRUST_KEY naming a file every user can read: anyone could seal a manifest with it.
    The resume refuses the key, naming it, before the code the manifest names is called."""
    shared = tmp_path / "motd"
    shared.write_bytes(os.urandom(64))
    shared.chmod(0o644)
    monkeypatch.setenv(trust.KEY_ENV, str(shared))
    newest = ck.latest(run_copy)
    manifest = json.loads((newest / ck.MANIFEST).read_text())
    manifest["config"]["model"] = {**DOCTORED_MODEL, "_target_": "os.makedirs",
                                   "kwargs": {"name": str(tmp_path / MARK)}}
    named = trust.code_named(manifest["config"])
    manifest["config"]["run"]["code_seal"] = trust._digest(named, shared.read_bytes())  # forged
    (newest / ck.MANIFEST).write_text(json.dumps(manifest))
    out = sdpipe("resume", str(run_copy))
    assert out.returncode == 2, out.stderr
    line = one_error_line(out.stderr, str(shared))
    assert "can be read by others (mode 0644)" in line and f"chmod 600 {shared}" in line
    assert not (tmp_path / MARK).exists()


@pytest.mark.parametrize("how", ["empty key", "key a folder", "config home a file"])
def test_a_run_naming_code_without_a_usable_key_stops_at_the_start(tmp_path, monkeypatch, how):
    """Sealing nothing would write a run its own user could not resume without --trust-code."""
    path = tmp_path / "key"
    if how == "empty key":
        path.write_bytes(b"")
        path.chmod(0o600)
    elif how == "key a folder":
        path.mkdir()
    if how == "config home a file":
        path.write_text("")
        monkeypatch.delenv(trust.KEY_ENV)
        monkeypatch.setenv("XDG_CONFIG_HOME", str(path))
        path = path / "sdpipe" / "trust.key"
    else:
        monkeypatch.setenv(trust.KEY_ENV, str(path))
    out = sdpipe("train", f"run.dir={tmp_path / 'new'}", *TINY,
                 "model.loss={_target_: sdpipe_cli.model.models.cross_entropy}")  # code to seal
    assert out.returncode == 2, out.stderr
    one_error_line(out.stderr, str(path))
    assert not (tmp_path / "new").exists()


# Events no process of the run sent, as the scheduler reads them from the store: the rest of the
# forged store values (one of their kind is launched: "an event that is not JSON").
FORGED_EVENTS = [
    ("an event of the wrong type",
     push_record(type="ready", rank=1, pipeline=0, stage=1, iteration="one"),
     "field 'iteration' should be int"),
    ("an event from no worker of the run",
     push_record(type="ready", rank=9, pipeline=4, stage=1, iteration=0), "no such worker"),
    ("an event from an incarnation never started",
     push_record(type="saved", rank=0, pipeline=0, stage=0, checkpoint=1, step=1, incarnation=5),
     "never started"),
]


@pytest.mark.parametrize("inject, message", [(i, m) for _, i, m in FORGED_EVENTS],
                         ids=[name for name, _, _ in FORGED_EVENTS])
def test_a_forged_event_is_refused_by_the_scheduler_naming_the_store_key(tmp_path, inject, message):
    """The scheduler of a P=2 x S=2 run, on a real TCPStore, reads the forged event off the queue
    with its own code (as its process does) and refuses it, naming the key: no decision on it."""
    cfg = compose(["model=mlp", "data=synthetic", "cluster.pipelines=2", "pipeline.stages=2"])
    cfg.run.dir = str(tmp_path)
    cfg.plan = RunPlan.resolve(cfg).section()  # what preparing the run writes
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    events = store.namespace(master)
    scheduler = Scheduler(cfg, tmp_path, events, clock=lambda: 0.0)
    inject(events)
    with pytest.raises(protocol.ProtocolError, match="store key 'sdpipe/events'") as refused:
        for event in scheduler_process.in_order(scheduler_process.next_batch(events)):
            scheduler.handle(event)
    assert message in str(refused.value)


@pytest.mark.multiprocess
def test_a_checkpoint_copied_out_of_its_run_resumes_in_a_new_folder_beside_it(tmp_path, run_copy):
    """``cp -a RUN/checkpoints/step_20 home/backups/my_ckpt``: the resume must not take ``home/``
    for the run (it would write its summary, metrics, logs and config there)."""
    home = tmp_path / "home"
    (home / "backups").mkdir(parents=True)
    (home / "summary.json").write_text('{"mine": true}')
    shutil.copytree(ck.latest(run_copy), home / "backups" / "my_ckpt")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "creds.yaml").write_text("token: 123\n")
    manifest = json.loads((home / "backups" / "my_ckpt" / ck.MANIFEST).read_text())
    manifest["config"]["run"]["config_dirs"] = [str(secret)]  # a manifest's folders: not copied
    (home / "backups" / "my_ckpt" / ck.MANIFEST).write_text(json.dumps(manifest))
    out = sdpipe("resume", str(home / "backups" / "my_ckpt"), "train.steps=22")
    assert out.returncode == 0, out.stderr
    assert "lies outside its run" in out.stderr
    assert sorted(p.name for p in home.iterdir()) == ["backups", "summary.json"]
    assert (home / "summary.json").read_text() == '{"mine": true}'
    resumed = home / "backups" / "my_ckpt-resumed"
    assert {d["steps"] for d in metrics(resumed, "done")} == {22}
    assert (resumed / "summary.json").is_file()
    own = yaml.safe_load((resumed / "config.yaml").read_text())["run"]["id"]
    original = yaml.safe_load((run_copy / "config.yaml").read_text())["run"]["id"]
    assert own and original and own != original  # a run of its own
    assert not (resumed / "config-dirs").exists()


@pytest.mark.multiprocess
def test_two_resumes_of_one_run_started_together_one_runs_the_other_is_refused(tmp_path, run_copy):
    """Both ask for a long run; the one that takes the run's lock trains, the other exits 2 naming
    it at once; the run's metrics then hold one timeline. One resume is a launcher in this
    process, the other a process of its own, started at the same moment: either may win."""
    before, trained = len(metrics(run_copy)), len(metrics(run_copy, "train"))
    long = ("train.steps=100000", "cluster.compute_ms=10")  # modelled: the winner idles while it waits

    def the_other(command):
        proc = sdpipe_popen("resume", str(run_copy), *long, "train.lr=0.02")
        try:
            deadline = time.monotonic() + 120
            while proc.poll() is None and command.poll() is None:
                assert time.monotonic() < deadline, "neither resume was refused"
                time.sleep(0.2)
            if proc.poll() is not None:  # refused: the resume in this process trains
                code, err, _ = finish(proc, timeout=30)
                command.wait_for(training_lines(run_copy, trained + 4), what="the other resume training")
                interrupt_command()
                return code, err, os.getpid(), None
            # the resume in this process was refused: this one trains
            wait_for(training_lines(run_copy, trained + 4), proc, what="the other resume training")
            proc.send_signal(signal.SIGINT)
            code, err, _ = finish(proc, timeout=90)
            return None, None, proc.pid, (code, err)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    here, (code, err, runner, there) = sdpipe_beside(the_other, run_copy, "resume", str(run_copy),
                                                     *long, "train.lr=0.003", timeout=180)
    if there is None:  # the process was refused, this one ran until interrupted
        assert here.returncode == 130, here.stderr
    else:  # this one was refused, the process ran until interrupted
        assert there[0] == 130, there[1]
        code, err = here.returncode, here.stderr
    assert code == 2, err
    assert f"is in use by another launcher: pid {runner}" in one_error_line(err, str(run_copy))
    assert not kill_leftovers(run_copy) and not run_processes(run_copy)
    resumes = [line for line in metrics(run_copy)[before:] if line["kind"] == "resume"]
    assert len(resumes) == 1  # one leg appended
    assert not (run_copy / "run.lock").exists()


MEASURED = """
import resource, subprocess, sys
done = subprocess.run([sys.executable, "-m", "sdpipe_cli", *sys.argv[1:]], capture_output=True,
                      text=True, timeout=120)
sys.stderr.write(done.stderr)
print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def test_a_batch_too_large_is_refused_on_shapes_before_any_is_allocated(tmp_path):
    """train.batch_size=1e8: the memory check runs on meta tensors, so the launcher refuses it
    with the estimate in one line and never holds the batch (a real one: 3.2 GB per example)."""
    done = subprocess.run([sys.executable, "-c", MEASURED, "train", f"run.dir={tmp_path / 'new'}",
                           "model=mlp", "data=synthetic", "train.batch_size=100000000"],
                          capture_output=True, text=True, timeout=180)
    code, peak_kib = map(int, done.stdout.split())
    line = one_error_line(done.stderr, "train.batch_size")
    assert code == 2 and "GiB" in line and "available" in line
    assert peak_kib < 1024 * 1024, f"the launcher peaked at {peak_kib / 1024:.0f} MiB"
    assert not (tmp_path / "new").exists()
