"""Checkpoints on disk: save/finalize/load round trip, pruning, crash safety, errors, weights_only."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from sdpipe_cli import checkpoint as ck
from sdpipe_cli.runtime.errors import CheckpointError

NAMES = ["0", "1", "scheduler"]


def trained_state(seed: int = 0) -> dict:
    """A small model's state, AdamW's state after one step, and the RNG state."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "rng": torch.get_rng_state(), "step": 1, "note": None}


def save_step(run: Path, step: int, names=NAMES, keep: int = 0, **meta) -> Path:
    for name in names:
        ck.save_shard(ck.staging_dir(run, step), name, {"name": name, "step": step, "t": torch.arange(step)})
    return ck.finalize(run, step, {"config": {"steps": 100}, **meta}, list(names), keep=keep)


def assert_equal_states(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_equal_states(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal_states(x, y)
    else:
        assert a == b


def raises_about(path, *fragments: str):
    """Context manager: a CheckpointError (or, for a save that went wrong, a SaveFailed) whose
    message names ``path`` and every fragment."""
    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises((CheckpointError, ck.SaveFailed))
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.ctx.__exit__(*exc)
            err = self.info.value
            assert str(path) in str(err) and err.path in str(err)
            assert str(err) == f"{err.path}: {err.reason}"
            for fragment in fragments:
                assert fragment in str(err)
            return handled
    return _Check()


# --- round trip ------------------------------------------------------------------------------------

def test_round_trip(tmp_path):
    run = tmp_path / "run"
    states = {name: trained_state(seed=i) for i, name in enumerate(NAMES)}
    for name, state in states.items():
        shard = ck.save_shard(ck.staging_dir(run, 5), name, state)
        assert shard.name == ck.shard_name(name)
    final = ck.finalize(run, 5, {"config": {"lr": 0.01}, "partition": [[0, 2], [2, 4]]}, NAMES)

    assert final == ck.final_dir(run, 5) == run / "checkpoints" / "step_5"
    assert not ck.staging_dir(run, 5).exists()
    assert ck.latest(run) == final
    assert ck.resolve(run) == final and ck.resolve(final) == final
    assert ck.run_dir_of(final) == run

    manifest = ck.verify(final)
    assert manifest["step"] == 5 and manifest["torch_version"] == torch.__version__
    assert manifest["config"] == {"lr": 0.01} and manifest["partition"] == [[0, 2], [2, 4]]
    assert set(manifest["files"]) == {"0.pt", "1.pt", "scheduler.pt"}
    for name, state in states.items():
        assert_equal_states(state, ck.load_shard(final, name))
        assert_equal_states(state, ck.load_shard(final, name, manifest))


def test_paths_and_names(tmp_path):
    assert ck.checkpoints_dir(tmp_path) == tmp_path / "checkpoints"
    assert ck.staging_dir(tmp_path, 7) == tmp_path / "checkpoints" / ".staging-step_7"
    assert ck.shard_name("3") == "3.pt" and ck.shard_name("scheduler") == "scheduler.pt"
    for bad in ["", ".hidden", "a/b"]:
        with pytest.raises(ValueError):
            ck.shard_name(bad)


def test_save_shard_replaces_and_leaves_no_temp(tmp_path):
    ck.save_shard(tmp_path / "d", "0", {"v": 1})
    path = ck.save_shard(tmp_path / "d", "0", {"v": 2})
    assert torch.load(path, weights_only=True)["v"] == 2
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["0.pt"]


def test_complete_checkpoints_sorted_by_step_number(tmp_path):
    for step in (100, 9, 20):
        save_step(tmp_path, step)
    assert [p.name for p in ck.complete_checkpoints(tmp_path)] == ["step_9", "step_20", "step_100"]
    assert ck.latest(tmp_path).name == "step_100"


# --- pruning ---------------------------------------------------------------------------------------

def test_keep_prunes_older_checkpoints_but_not_staging(tmp_path):
    for step in (10, 20):
        save_step(tmp_path, step, keep=2)
    ck.save_shard(ck.staging_dir(tmp_path, 40), "0", {"x": 1})  # a newer save in progress
    save_step(tmp_path, 30, keep=2)

    assert [p.name for p in ck.complete_checkpoints(tmp_path)] == ["step_20", "step_30"]
    assert not ck.final_dir(tmp_path, 10).exists()
    assert (ck.staging_dir(tmp_path, 40) / "0.pt").is_file()
    assert sorted(p.name for p in ck.checkpoints_dir(tmp_path).iterdir()) == [
        ".staging-step_40", "step_20", "step_30"]


def test_keep_zero_keeps_everything(tmp_path):
    for step in (1, 2, 3):
        save_step(tmp_path, step)
    assert len(ck.complete_checkpoints(tmp_path)) == 3


def test_pruning_error_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    save_step(tmp_path, 10)

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(shutil, "rmtree", refuse)
    with caplog.at_level(logging.WARNING, logger="sdpipe.checkpoint"):
        final = save_step(tmp_path, 20, keep=1)

    assert final.is_dir() and ck.latest(tmp_path) == final
    assert ck.complete_checkpoints(tmp_path) == [final]  # step_10 stopped being a checkpoint
    assert any("step_10" in r.getMessage() for r in caplog.records if r.name == "sdpipe.checkpoint")

    monkeypatch.undo()  # the leftover goes at the next prune
    save_step(tmp_path, 30, keep=1)
    assert sorted(p.name for p in ck.checkpoints_dir(tmp_path).iterdir()) == ["step_30"]


def test_pruning_rename_error_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    save_step(tmp_path, 10)
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name == "step_10":
            raise OSError(16, "Device or resource busy", str(src))
        return real_rename(src, dst)
    monkeypatch.setattr(os, "rename", rename)
    with caplog.at_level(logging.WARNING, logger="sdpipe.checkpoint"):
        save_step(tmp_path, 20, keep=1)
    assert [p.name for p in ck.complete_checkpoints(tmp_path)] == ["step_10", "step_20"]
    assert "busy" in caplog.text


# --- crash safety ----------------------------------------------------------------------------------

def test_unfinished_staging_is_ignored(tmp_path):
    good = save_step(tmp_path, 10)
    for name in NAMES:  # the "crash": shards written, never finalized
        ck.save_shard(ck.staging_dir(tmp_path, 20), name, {"x": torch.ones(2)})
    assert ck.latest(tmp_path) == good and ck.resolve(tmp_path) == good
    assert ck.complete_checkpoints(tmp_path) == [good]


def test_staging_with_manifest_is_still_not_a_checkpoint(tmp_path):
    staging = ck.staging_dir(tmp_path, 20)
    ck.save_shard(staging, "0", {"x": 1})
    (staging / ck.MANIFEST).write_text(json.dumps({"step": 20, "files": {}}))
    assert ck.latest(tmp_path) is None
    with raises_about(tmp_path, "no complete checkpoint"):
        ck.resolve(tmp_path)


def test_step_folder_without_manifest_is_not_a_checkpoint(tmp_path):
    good = save_step(tmp_path, 10)
    ck.save_shard(ck.final_dir(tmp_path, 30), "0", {"x": 1})
    assert ck.latest(tmp_path) == good


def test_finalize_leaves_previous_checkpoint_intact(tmp_path):
    ten = save_step(tmp_path, 10)
    before = {p.name: p.read_bytes() for p in ten.iterdir()}
    twenty = save_step(tmp_path, 20)
    assert {p.name: p.read_bytes() for p in ten.iterdir()} == before
    assert ck.verify(ten)["step"] == 10 and ck.load_shard(ten, "1")["step"] == 10
    assert ck.latest(tmp_path) == twenty


def test_crash_inside_finalize_keeps_previous_latest(tmp_path, monkeypatch):
    ten = save_step(tmp_path, 10)
    staging = ck.staging_dir(tmp_path, 20)
    for name in NAMES:
        ck.save_shard(staging, name, {"x": torch.zeros(3)})

    def crashing(real):
        def move(src, dst, *args, **kwargs):
            if Path(src) == staging:
                assert (staging / ck.MANIFEST).is_file()  # the crash comes after the manifest
                raise OSError(5, "Input/output error")
            return real(src, dst, *args, **kwargs)
        return move
    monkeypatch.setattr(os, "rename", crashing(os.rename))
    monkeypatch.setattr(os, "replace", crashing(os.replace))
    with pytest.raises(ck.SaveFailed, match=r"cannot be written \(Input/output error\)") as failed:
        ck.finalize(tmp_path, 20, {}, NAMES)
    assert ck.go_on_from(failed.value.run_dir).startswith(f"the latest complete checkpoint is {ten}")

    assert ck.latest(tmp_path) == ten and ck.resolve(tmp_path) == ten
    assert ck.load_shard(ten, "0")["step"] == 10
    assert not ck.final_dir(tmp_path, 20).exists()

    monkeypatch.undo()  # the scheduler retries the same step
    assert ck.finalize(tmp_path, 20, {}, NAMES) == ck.latest(tmp_path)


# --- errors ----------------------------------------------------------------------------------------

def test_missing_path(tmp_path):
    with raises_about(tmp_path / "nope", "does not exist"):
        ck.resolve(tmp_path / "nope")


def test_run_folder_without_checkpoints(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with raises_about(run, "no complete checkpoint", str(run / "checkpoints")):
        ck.resolve(run)


def test_resolve_a_file(tmp_path):
    (tmp_path / "f.txt").write_text("x")
    with raises_about(tmp_path / "f.txt"):
        ck.resolve(tmp_path / "f.txt")


def test_manifest_missing(tmp_path):
    ckpt = save_step(tmp_path, 10)
    (ckpt / ck.MANIFEST).unlink()
    with raises_about(ckpt / ck.MANIFEST, "missing"):
        ck.read_manifest(ckpt)
    with raises_about(ckpt / ck.MANIFEST, "missing"):
        ck.resolve(ckpt)
    with raises_about(ckpt / ck.MANIFEST):
        ck.load_shard(ckpt, "0")
    assert ck.latest(tmp_path) is None


def test_manifest_not_json(tmp_path):
    ckpt = save_step(tmp_path, 10)
    (ckpt / ck.MANIFEST).write_text("{not json")
    with raises_about(ckpt / ck.MANIFEST, "JSON"):
        ck.verify(ckpt)
    assert ck.latest(tmp_path) is None


@pytest.mark.parametrize("content", [[], {"files": {}}, {"step": 1}, {"step": 1, "files": {"../x.pt": "0"}}])
def test_manifest_lacking_fields(tmp_path, content):
    ckpt = save_step(tmp_path, 10)
    (ckpt / ck.MANIFEST).write_text(json.dumps(content))
    with raises_about(ckpt / ck.MANIFEST, "lacks"):
        ck.read_manifest(ckpt)


def test_shard_missing(tmp_path):
    ckpt = save_step(tmp_path, 10)
    (ckpt / "1.pt").unlink()
    with raises_about(ckpt / "1.pt", "missing"):
        ck.load_shard(ckpt, "1")
    with raises_about(ckpt / "1.pt", "missing"):
        ck.verify(ckpt)


def test_shard_not_in_manifest(tmp_path):
    ckpt = save_step(tmp_path, 10)
    with raises_about(ckpt / "7.pt", "not listed"):
        ck.load_shard(ckpt, "7")


def test_shard_truncated(tmp_path):
    ckpt = save_step(tmp_path, 10)
    shard = ckpt / "0.pt"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with raises_about(shard, "checksum mismatch", "truncated or corrupted"):
        ck.load_shard(ckpt, "0")
    with raises_about(shard, "checksum mismatch"):
        ck.verify(ckpt)


def test_shard_bytes_flipped(tmp_path):
    ckpt = save_step(tmp_path, 10)
    shard = ckpt / "scheduler.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with raises_about(shard, "checksum mismatch"):
        ck.load_shard(ckpt, "scheduler")


def test_finalize_with_expected_shard_missing(tmp_path):
    staging = ck.staging_dir(tmp_path, 10)
    ck.save_shard(staging, "0", {"x": 1})
    with raises_about(staging / "1.pt", "missing"):
        ck.finalize(tmp_path, 10, {}, ["0", "1"])
    assert staging.is_dir() and not ck.final_dir(tmp_path, 10).exists()


def test_finalize_without_staging(tmp_path):
    with raises_about(ck.staging_dir(tmp_path, 10), "does not exist"):
        ck.finalize(tmp_path, 10, {}, [])


def test_an_existing_final_dir_is_kept_aside_never_replaced(tmp_path):
    """Another timeline's step_10 (a resume of an older checkpoint) or a damaged one: finalizing
    the new step_10 keeps the old folder, byte for byte, under a name pruning never touches."""
    first = save_step(tmp_path, 10)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    ck.save_shard(ck.staging_dir(tmp_path, 10), "0", {"x": 2})
    new = ck.finalize(tmp_path, 10, {}, ["0"], keep=1)
    aside = ck.checkpoints_dir(tmp_path) / "step_10.superseded-1"
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == before
    assert ck.complete_checkpoints(tmp_path) == [new]
    ck.final_dir(tmp_path, 12).mkdir(parents=True)  # an empty one, as a cut-short write leaves
    assert ck.damaged(tmp_path) == [ck.final_dir(tmp_path, 12)]
    ck.save_shard(ck.staging_dir(tmp_path, 12), "0", {"x": 3})
    ck.finalize(tmp_path, 12, {}, ["0"], keep=1)
    assert sorted(p.name for p in ck.checkpoints_dir(tmp_path).iterdir()) == [
        "step_10.superseded-1", "step_12", "step_12.superseded-1"]  # pruned step_10 only


def test_meta_cannot_overwrite_files(tmp_path):
    ck.save_shard(ck.staging_dir(tmp_path, 10), "0", {"x": 2})
    with raises_about(ck.staging_dir(tmp_path, 10), "files"):
        ck.finalize(tmp_path, 10, {"files": {}}, ["0"])


def test_manifest_ignores_temp_files_of_interrupted_saves(tmp_path):
    staging = ck.staging_dir(tmp_path, 10)
    ck.save_shard(staging, "0", {"x": 2})
    (staging / ".1.pt.abc.tmp").write_bytes(b"half a shard")
    manifest = ck.verify(ck.finalize(tmp_path, 10, {}, ["0"]))
    assert list(manifest["files"]) == ["0.pt"]


# --- weights_only ----------------------------------------------------------------------------------

MARKER = {"path": None}


def _touch(path: str) -> None:
    Path(path).write_text("code ran")


class Payload:
    """Unpickling this would run ``_touch``: exactly what weights_only must refuse."""

    def __reduce__(self):
        return _touch, (MARKER["path"],)


def test_weights_only_refuses_arbitrary_objects(tmp_path):
    marker = tmp_path / "pwned"
    MARKER["path"] = str(marker)
    ck.save_shard(ck.staging_dir(tmp_path, 10), "0", {"x": Payload(), "t": torch.ones(1)})
    ckpt = ck.finalize(tmp_path, 10, {}, ["0"])
    ck.verify(ckpt)  # the checksum matches: only the content is hostile

    with raises_about(ckpt / "0.pt", "weights_only", "test_checkpoint._touch"):
        ck.load_shard(ckpt, "0")
    assert not marker.exists()


def test_non_dict_shard_is_refused(tmp_path):
    staging = ck.staging_dir(tmp_path, 10)
    staging.mkdir(parents=True)
    torch.save([torch.ones(1)], staging / "0.pt")
    ckpt = ck.finalize(tmp_path, 10, {}, ["0"])
    with raises_about(ckpt / "0.pt", "not a dict"):
        ck.load_shard(ckpt, "0")


def test_a_stand_in_is_a_copy_of_another_shard_with_its_own_fields(tmp_path):
    staging = tmp_path / "staging"
    ck.save_shard(staging, "0", {"step": 9, "pipeline": 0, "model": {"w": torch.ones(3)}})
    ck.stand_in(staging, "0", "4", {"step": 5, "pipeline": 2})
    stood = torch.load(staging / "4.pt", weights_only=True)
    assert stood["step"] == 5 and stood["pipeline"] == 2 and torch.equal(stood["model"]["w"],
                                                                           torch.ones(3))
    assert torch.load(staging / "0.pt", weights_only=True)["step"] == 9  # the source is untouched


def test_a_save_that_cannot_be_written_names_the_file_and_the_last_complete_checkpoint(tmp_path):
    """A full disk (here: a staging folder that is a file) fails the save with the file and the
    checkpoint to go on from; the complete checkpoint stays, and the cut-short staging folder is
    discarded once nobody can finish it."""
    save_step(tmp_path, 10)
    blocked = ck.staging_dir(tmp_path, 20)
    blocked.mkdir(parents=True)
    (blocked / "0.pt").mkdir()  # os.replace onto a folder fails as a write to a full disk would
    with pytest.raises(ck.SaveFailed, match=r"0\.pt: cannot be written ") as failed:
        ck.save_shard(blocked, "0", {"x": torch.ones(2)})
    assert ck.go_on_from(failed.value.run_dir) == (f"the latest complete checkpoint is "
                                                   f"{ck.final_dir(tmp_path, 10)}: sdpipe resume {tmp_path}")
    assert ck.latest(tmp_path) == ck.final_dir(tmp_path, 10)
    assert ck.discard_staging(tmp_path) == [blocked]
    assert sorted(p.name for p in ck.checkpoints_dir(tmp_path).iterdir()) == ["step_10"]


def test_a_checkpoint_is_its_runs_own_only_in_place_and_with_the_runs_id(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_4").mkdir(parents=True)
    (run / "config.yaml").write_text("run:\n  id: abc\n")
    mine = {"config": {"run": {"id": "abc"}}}
    assert ck.home_of(run / "checkpoints" / "step_4", mine) == run
    assert ck.home_of(run / "resharded" / "step_4-P2xS2-1_2", mine) == run
    assert ck.home_of(run / "checkpoints" / "step_4", {"config": {"run": {"id": "xyz"}}}) is None
    assert ck.home_of(tmp_path / "backups" / "step_4", mine) is None  # copied out of its run
    assert ck.home_of(tmp_path / "elsewhere" / "checkpoints" / "step_4", mine) is None  # no run
    legacy = {"config": {"run": {}}}  # written before runs had ids: its place alone says
    assert ck.home_of(run / "checkpoints" / "step_4", legacy) == run


def test_a_manifest_nested_past_the_parser_is_a_checkpoint_error(tmp_path):
    (tmp_path / ck.MANIFEST).write_text('{"step": 1, "files": {}, "x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(CheckpointError, match="nests too deeply"):
        ck.read_manifest(tmp_path)


def test_the_run_folder_of_a_checkpoint_is_read_within_bounds(tmp_path):
    from sdpipe_cli.config.schema import ConfigError

    run = tmp_path / "run"
    (run / "checkpoints" / "step_4").mkdir(parents=True)
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    (run / "config.yaml").write_text("\n".join(lines) + "\nrun: {id: *a8}\n")
    with pytest.raises(ConfigError, match="expands to more"):
        ck.home_of(run / "checkpoints" / "step_4", {"config": {"run": {"id": "abc"}}})


# -- a checkpoint holds what its manifest says: not after a failed global sync ---------------------
def test_a_replica_whose_global_sync_failed_writes_no_shard_and_says_why():
    """sdpipe: the global sync a checkpoint follows fails here (the other member never comes,
    as one lost inside the all-reduce): this replica's weights were never averaged, so it does
    not write its shard for that checkpoint and tells the scheduler why; its weights are its own,
    untouched."""
    from datetime import timedelta

    import torch.distributed as dist

    from sdpipe_cli.runtime import protocol, store
    from sdpipe_cli.sync.group_sync import GroupSync
    from sdpipe_cli.sync.groups import GroupCache

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    events = store.namespace(master)
    groups = GroupCache(master, 0, "gloo", timeout=1.0)  # pipeline 1's replica never joins
    sync = GroupSync(events, rank=0, pipeline=0, stage=0, stages=1, pipelines=2, groups=groups,
                     average="weights")
    store.put(events, store.decision_key(0, 0, 0), protocol.Group(
        members=[0, 1], round=4, kind="global", stop=True, incarnations=[0, 0], checkpoint=1))
    module = nn.Linear(3, 2)
    before = [p.detach().clone() for p in module.parameters()]
    sync.after_step(module, 0)
    assert sync.stop and sync.checkpoint_due() is None
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    sent = []
    while True:
        try:
            sent.append(protocol.decode_event(events.queue_pop(store.EVENTS, block=False)))
        except dist.QueueEmptyError:
            break
    (said,) = [e for e in sent if isinstance(e, protocol.Saved)]
    assert (said.checkpoint, said.step, said.rank) == (1, 1, 0)
    assert "global sync it follows failed" in said.dropped


def test_a_checkpoint_a_replica_dropped_is_never_made(tmp_path):
    """The scheduler: one replica of a checkpoint's global sync says it failed there. The
    checkpoint is not made (nor made from stand-ins), its staging folder goes, a
    ``checkpoint_dropped`` line says why, and shards that still come change nothing; the next
    global sync's checkpoint is made as ever."""
    from sdpipe_cli.runtime import store
    from tests.helpers import event, metrics
    from tests.unit.test_scheduler_restart import scheduler

    sched, events, now, _ = scheduler(tmp_path, "train.steps=6", "sync.global_every=2",
                                      "checkpoint.every=2", "fault.on_pipeline_loss=stop")

    def iteration(k: int) -> None:
        for p in range(2):
            for s in range(2):
                sched.handle(event(type="ready", rank=2 * p + s, pipeline=p, stage=s,
                                   iteration=k))
        now[0] += 1.0
        sched.handle(event(type="tick"))

    def saved(rank: int, ckpt: int, step: int, **more) -> None:
        if "dropped" not in more:
            ck.save_shard(ck.staging_dir(tmp_path, ckpt), str(rank), {"step": step})
        sched.handle(event(type="saved", rank=rank, pipeline=rank // 2, stage=rank % 2,
                           checkpoint=ckpt, step=step, **more))

    for k in range(3):
        iteration(k)
    assert store.get_json(events, store.decision_key(0, 0, 2))["checkpoint"] == 3
    for rank in (0, 1, 3):
        saved(rank, 3, 3)
    saved(2, 3, 3, dropped="the global sync it follows failed")
    assert not ck.staging_dir(tmp_path, 3).exists()
    saved(2, 3, 3)  # a shard written after all: too late, and not one model's with the others
    assert not ck.complete_checkpoints(tmp_path)
    (dropped,) = metrics(tmp_path, "checkpoint_dropped")
    assert dropped["step"] == 3 and "pipeline 1, stage 0: the global sync" in dropped["reason"]
    for k in range(3, 6):
        iteration(k)
    for rank in range(4):
        saved(rank, 6, 6)
    assert [c.name for c in ck.complete_checkpoints(tmp_path)] == ["step_6"]
