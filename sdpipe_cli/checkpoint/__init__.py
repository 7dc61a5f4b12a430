"""Checkpoints: every rank saves its own shard, one process makes the set a checkpoint atomically.

A run keeps its checkpoints in ``<run>/checkpoints/step_<N>/``; each holds one shard per rank and
the scheduler's, and a ``manifest.json`` with the SHA-256 of every file. A crash in the middle of
a save never touches an earlier checkpoint, and a checkpoint is verified before any shard of it
is loaded, with ``torch.load(weights_only=True)``: one copied from elsewhere can hold tensors and
plain containers, never code that runs on load. In parts:

- :mod:`.layout`: where the files live and what they are called; hashing;
- :mod:`.writing`: shards written atomically, a staging folder finalized into a checkpoint,
  pruning, stand-ins for missing replicas, ``final/`` sealed;
- :mod:`.reading`: complete checkpoints, the latest, a path resolved, manifests and shards
  verified and loaded.

Its users import this package (``from sdpipe_cli import checkpoint``); the names below are its
interface. Resharding a checkpoint into another layout is ``training.reshard_checkpoint``'s.
"""

from sdpipe_cli.checkpoint.layout import (
    DELETING_PREFIX,
    FINAL,
    MANIFEST,
    STAGING_PREFIX,
    STEP_DIR,
    checkpoints_dir,
    final_dir,
    final_name,
    free_name,
    home_of,
    of_run,
    run_dir_of,
    sha256,
    shard_name,
    staging_dir,
)
from sdpipe_cli.checkpoint.reading import (
    check_optimizer,
    check_tensors,
    complete_checkpoints,
    damaged,
    go_on_from,
    latest,
    load_shard,
    read_manifest,
    resolve,
    verify,
    verify_run,
)
from sdpipe_cli.checkpoint.writing import SaveFailed, discard_staging, finalize, save_shard, seal, seal_final, stand_in

__all__ = [
    "MANIFEST", "STAGING_PREFIX", "DELETING_PREFIX", "STEP_DIR", "FINAL", "checkpoints_dir",
    "staging_dir", "final_dir", "run_dir_of", "home_of", "of_run", "shard_name", "free_name",
    "final_name", "sha256", "damaged", "complete_checkpoints", "latest", "go_on_from", "resolve",
    "read_manifest", "load_shard", "check_tensors", "check_optimizer", "verify", "verify_run",
    "save_shard", "SaveFailed", "discard_staging", "stand_in", "finalize", "seal", "seal_final"]
