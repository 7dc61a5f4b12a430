"""One model out of a run, in the format its users load: writing an export, and reading it back.

The merged weights (:mod:`~sdpipe_cli.export.weights`) are loaded, block by block, into the
blocks of the whole model (:func:`sdpipe_cli.model.models.build_whole`), which share that
model's parameters; the whole model is then saved under the names its own code gives it:

* ``transformers`` (gpt2, bert): ``save_pretrained`` (``config.json``, ``model.safetensors``),
  which ``AutoModelForCausalLM`` / ``AutoModelForMaskedLM.from_pretrained(DIR)`` loads; a run on
  ``data=tokens`` with a saved tokenizer adds its files, for ``AutoTokenizer.from_pretrained``;
* ``torchvision`` (the ResNets): one state dict with torchvision's names;
* ``state_dict`` (any model): the whole model's state dict, keyed as the module a user's
  ``build`` returns (or the blocks' ``nn.Sequential``), and ``model.yaml``, the model's config.

The state-dict formats are written twice: ``model.safetensors`` (no code can hide in it; a
weight tied to another is stored once, restored by ``safetensors.torch.load_model``) and
``model.pt`` (``torch.load(weights_only=True)`` then ``load_state_dict(strict=True)``).
``export.json`` records the run, the weights it came from, the replicas merged and their
consensus distance, the run's config and every file's SHA-256.

An export is written into a temporary folder beside ``--out`` (``.<name>.partial-*``) and renamed
into place once complete: ``--out`` never holds half an export, and a folder that holds anything
is refused. Its writer holds a lock on that folder (``flock``, released by the kernel however the
writer ends), so the next export to ``--out`` removes what a killed one left, and refuses to
start beside one still writing. A failed write (a full disk) is one line naming the file, and
leaves nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from sdpipe_cli import checkpoint
from sdpipe_cli.config import trust
from sdpipe_cli.config.local_files import remove_empty_folders
from sdpipe_cli.config.saved import typed
from sdpipe_cli.config.schema import HF_ARCHS, RESNET_BLOCKS, ConfigError
from sdpipe_cli.data.sources import CORPORA
from sdpipe_cli.export.weights import Merged, Source, by_block
from sdpipe_cli.model import models
from sdpipe_cli.runtime.errors import CheckpointError, os_error, os_reason, refused

__all__ = ["FORMATS", "Export", "default_format", "load", "write"]

MANIFEST = "export.json"
FORMATS = ("transformers", "torchvision", "state_dict")
FILES = {"transformers": ("config.json", "model.safetensors"),  # what each format always has
         "torchvision": ("model.pt", "model.safetensors"),
         "state_dict": ("model.pt", "model.safetensors", "model.yaml")}
_MAX_MANIFEST = 64 << 20
PARTIAL = ".partial-"  # .<--out's name>.partial-XXXXXXXX: an export being written beside --out


def default_format(model_cfg: DictConfig) -> str:
    if model_cfg.arch in HF_ARCHS:
        return "transformers"
    return "torchvision" if model_cfg.arch in RESNET_BLOCKS else "state_dict"


def check_format(fmt: str, model_cfg: DictConfig) -> None:
    """``fmt`` is one this model can be written in; else a ConfigError naming ``--format``."""
    if fmt not in FORMATS:
        raise ConfigError("--format", f"is {fmt!r}; use one of {', '.join(FORMATS)}")
    takes = {"transformers": HF_ARCHS, "torchvision": RESNET_BLOCKS}.get(fmt)
    if takes is not None and model_cfg.arch not in takes:
        raise ConfigError("--format", f"{fmt} takes model.arch {' or '.join(takes)}; this run "
                          f"trained {model_cfg.arch} (use --format state_dict)")


def assemble(config: DictConfig, merged: Merged) -> tuple[nn.Module, list[nn.Module]]:
    """The whole model and its blocks, holding the merged weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(config.train.seed))
        whole, blocks, _ = models.build_whole(config.model)
    for places in models.tied_parameters(blocks):  # copies the stages kept equal
        values = [merged.state[p] for p in places]
        if any(not torch.equal(values[0], v) for v in values[1:]):
            raise CheckpointError("weights", f"the copies of the tied weight {places} differ")
    for b, block in enumerate(blocks):
        block.load_state_dict(by_block(merged.state, b), strict=True)
    return whole.eval(), blocks


def write(source: Source, merged: Merged, out: Path, fmt: str | None = None,
          log=lambda line: None) -> dict[str, Any]:
    """Export ``merged`` (from ``source``) into the new folder ``out``; returns the manifest."""
    config = source.config
    fmt = fmt or default_format(config.model)
    check_format(fmt, config.model)
    out = Path(out).absolute()
    check_out(out)
    whole, _ = assemble(config, merged)
    made = _make_parents(out)
    try:
        staging, lock = _partial_folder(out)
    except BaseException:
        remove_empty_folders(made)
        raise
    previous = _removed_on_interrupt(staging, made)
    try:
        tokenizer = _write_model(fmt, whole, config, staging, out, log)
        _usual_modes(staging)
        manifest = {
            "format": fmt, "arch": str(config.model.arch),
            "run": None if source.run is None else str(source.run),
            "source": {"kind": source.kind, "path": str(source.path),
                       "steps": None if source.steps is None else
                       {str(p): n for p, n in source.steps.items()}},
            "replicas": {"how": merged.how, "pipelines": merged.pipelines,
                         "consensus_distance": merged.distance},
            "tokenizer": tokenizer, "keys": list(whole.state_dict())[:4],
            "torch_version": torch.__version__, "time": time.time(),
            "config": OmegaConf.to_container(config, resolve=False),
            "files": {p.name: checkpoint.sha256(p) for p in sorted(staging.iterdir()) if p.is_file()},
        }
        with _writing(out, MANIFEST):
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        check_out(out)  # nothing appeared there meanwhile
        if out.is_dir():
            out.rmdir()
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        remove_empty_folders(made)
        raise
    finally:
        os.close(lock)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return manifest


def _make_parents(out: Path) -> list[Path]:
    """The folders above ``out`` that are not there yet, made; returns them, to be removed again
    if the export fails."""
    missing = [p for p in out.parents if not p.exists()][::-1]
    for i, folder in enumerate(missing):
        try:
            folder.mkdir(exist_ok=True)
        except OSError as err:
            remove_empty_folders(missing[:i])
            raise ConfigError("--out", f"cannot make {folder}: {os_reason(err)}; nothing was "
                              "written") from None
    return missing


def _partial_folder(out: Path) -> tuple[Path, int]:
    """A new folder beside ``out`` to write the export into, and the descriptor that holds its
    lock until the export is in place or this process ends, however it ends: the next export to
    ``out`` tells a live writer's folder from one left behind (:func:`clear_partials`). It is
    made under another name and renamed once locked: no ``.partial-`` folder is ever unlocked
    while its writer lives."""
    prefix = f".{out.name}.new-"
    try:
        fresh = Path(tempfile.mkdtemp(dir=out.parent, prefix=prefix))
    except OSError as err:
        raise ConfigError("--out", f"cannot write {out}: {os_reason(err)}; nothing was "
                          "written") from None
    lock = os.open(fresh, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise
        except OSError:  # a file system that takes no locks (NFS on a folder, Lustre): unlocked
            pass
        staging = out.with_name(f".{out.name}{PARTIAL}{fresh.name[len(prefix):]}")
        os.rename(fresh, staging)
    except BaseException:
        os.close(lock)
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    return staging, lock


def clear_partials(out: Path, log: Callable[[str], Any]) -> None:
    """Partial exports to ``out`` whose writer ended before it completed (killed: its folder's
    lock went with it) are removed, and each is said; one whose writer still runs means another
    export to ``out`` is under way, and is refused before anything is read."""
    prefix = f".{out.name}{PARTIAL}"
    try:
        found = sorted(p for p in out.parent.iterdir() if p.name.startswith(prefix))
    except OSError:  # no parent yet, or none that can be listed: check_out says which
        return
    for folder in found:
        try:
            lock = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile, or not a folder of ours
            continue
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ConfigError("--out", f"another export to {out} is being written "
                                  f"({folder}): wait for it to end, or name another folder") from None
            except OSError:  # no locks on this file system: whether its writer lives is unknown
                log(f"sdpipe: warning: {folder}, a partial export to {out}, is left as it is: this "
                    "file system takes no locks, so whether an export still writes it is unknown; "
                    "remove it by hand once none runs")
                continue
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            shutil.rmtree(folder, ignore_errors=True)
            log(f"sdpipe: warning: {folder} ({size / 1e6:.1f} MB), a partial export to {out} left "
                "by an export that did not end, " + ("removed" if not folder.exists() else
                                                      "cannot be removed: remove it by hand"))
        finally:
            os.close(lock)


@contextlib.contextmanager
def _writing(out: Path, name: str) -> Iterator[None]:
    """A failed write of the export's file ``name`` (a full disk, a file-size limit, a lost
    mount) as one line on ``--out`` naming it; the caller removes what was written. torch,
    safetensors and tokenizers say an OS error in their own words: the error is found behind
    them (:func:`~sdpipe_cli.runtime.errors.os_error`)."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - re-raised unless the system refused the write
        failed = os_error(err)
        if failed is None or not failed.errno:
            raise
        raise ConfigError("--out", f"cannot write {out} ({name}): {refused(failed)}; "
                          "nothing was written") from None


def _removed_on_interrupt(staging: Path, made: list[Path]) -> dict:
    """Until the export is in place, Ctrl-C or SIGTERM removes the temporary folder (and the
    folders made for ``--out``) and ends the process with one line (exit 130): the handler before
    it would end it at once, leaving the folder behind. Returns the handlers it replaced."""
    def interrupted(signum, frame) -> None:
        shutil.rmtree(staging, ignore_errors=True)
        remove_empty_folders(made)
        os.write(2, f"sdpipe: error: export interrupted ({signal.Signals(signum).name}); "
                 f"nothing was written\n".encode())
        os._exit(130)

    return {sig: signal.signal(sig, interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}


def _usual_modes(folder: Path) -> None:
    """The modes of a folder and files made as usual (under the umask): temporary ones are
    private."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.iterdir():
        os.chmod(path, 0o666 & ~umask)


def check_out(out: Path) -> None:
    """``out`` is a new folder, or an empty one, that can be made where it is named; else a
    ConfigError naming ``--out``."""
    try:
        if out.is_symlink() or (out.exists() and not out.is_dir()):
            raise ConfigError("--out", f"{out} exists and is not a folder: nothing was written")
        if out.is_dir() and any(out.iterdir()):
            raise ConfigError("--out", f"{out} already holds files: nothing of it is overwritten; "
                              "name a new folder")
        check_parent(out)
    except OSError as err:  # a name too long, a folder that cannot be listed
        raise ConfigError("--out", f"{out}: {err.strerror or err}") from None


def check_parent(out: Path) -> None:
    """What ``--out`` names can be made: the nearest folder above it that is there is a folder
    this user may write in. Checked before anything is read, where making it would fail only
    once the work is done."""
    above = next(p for p in Path(out).absolute().parents if p.exists() or p.is_symlink())
    if not above.is_dir():
        raise ConfigError("--out", f"{above} is a file, not a folder: {out} cannot be made under "
                          "it; nothing was written")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError("--out", f"cannot write in {above}: permission denied (EACCES); "
                          "nothing was written")


def _write_model(fmt: str, whole: nn.Module, config: DictConfig, folder: Path, out: Path,
                 log) -> str | None:
    """The model's files in ``folder`` (to be ``out``); returns the tokenizer written with them,
    if any."""
    if fmt == "transformers":
        _quiet_transformers()
        whole.config.use_cache = True  # for generate(); training never used it
        with _writing(out, "the tokenizer's files"):
            tokenizer = _write_tokenizer(config, whole, folder, log)
        with _writing(out, "config.json, model.safetensors"):
            whole.save_pretrained(str(folder), safe_serialization=True)
        return tokenizer
    from safetensors.torch import save_model

    state = whole.state_dict()
    with _writing(out, "model.pt"), open(folder / "model.pt", "wb") as f:
        torch.save(state, f)  # a file of ours: a failed write is an OSError, not torch's words
    with _writing(out, "model.safetensors"):
        save_model(whole, str(folder / "model.safetensors"))
    if fmt == "state_dict":
        model = OmegaConf.to_container(config.model, resolve=True)
        with _writing(out, "model.yaml"):
            (folder / "model.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(model)),
                                               encoding="utf-8")
    return _byte_tokenizer(config)


def _byte_tokenizer(config: DictConfig) -> str | None:
    """``"bytes"`` for a model of UTF-8 bytes (the corpora, and token data made with the bytes
    tokenizer), else None."""
    name = config.data.name
    if name in CORPORA:
        return "bytes"
    if name == "tokens":
        read = (config.data.get("resolved") or {}).get("read") or {}
        return "bytes" if read.get("tokenizer") == "bytes" else None
    return None


def _write_tokenizer(config: DictConfig, whole: nn.Module, folder: Path, log) -> str | None:
    """The run's tokenizer beside a transformers model: its ``tokenizer.json`` (``data=tokens``
    prepared with a trained or saved tokenizer), saved as a fast tokenizer that knows the
    model's length; the model's config learns its end-of-text token (``generate`` stops there)."""
    if config.data.name != "tokens" or not config.data.path:
        return _byte_tokenizer(config)
    from sdpipe_cli.data.tokens import open_tokens

    try:
        corpus = open_tokens(str(config.data.path), verify=False)
    except Exception as err:  # noqa: BLE001 - the weights are the export; say what is missing
        log(f"sdpipe: warning: no tokenizer exported: {config.data.path} cannot be read "
            f"({' '.join(str(err).split())[:120]})")
        return None
    file = corpus.tokenizer_file
    if file is None:
        return "bytes"
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(file))
    special = {"eos_token": corpus.eos_id, "mask_token": corpus.mask_id}
    tok.add_special_tokens({k: tok.convert_ids_to_tokens(int(i))
                            for k, i in special.items() if i is not None})
    tok.model_max_length = int(getattr(whole.config, "n_positions", None)
                               or whole.config.max_position_embeddings)
    tok.save_pretrained(str(folder))
    if corpus.eos_id is not None:
        whole.config.eos_token_id = whole.generation_config.eos_token_id = int(corpus.eos_id)
    return "tokenizer.json"


# -- reading an export back ----------------------------------------------------------------------

@dataclass
class Export:
    """An export read back: the whole model, its blocks, and what ``export.json`` says."""

    folder: Path
    manifest: dict[str, Any]
    config: DictConfig
    whole: nn.Module
    blocks: list[nn.Module]

    @property
    def tokenizer(self) -> str | None:
        return self.manifest.get("tokenizer")


def is_export(folder: Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def read_manifest(folder: Path, trusted: bool = False) -> dict[str, Any]:
    """``export.json``, once every file it lists matches its checksum and its config names no
    code this user did not seal (or ``trusted``)."""
    path = Path(folder) / MANIFEST
    if path.stat().st_size > _MAX_MANIFEST:
        raise CheckpointError(path, f"is over {_MAX_MANIFEST >> 20} MiB: not an export's")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        raise CheckpointError(path, f"unreadable: {str(err).splitlines()[0][:120]}") from None
    if not (isinstance(manifest, dict) and manifest.get("format") in FORMATS
            and isinstance(manifest.get("config"), dict) and isinstance(manifest.get("files"), dict)):
        raise CheckpointError(path, "lacks 'format', 'config' or 'files': not an sdpipe export")
    for name in FILES[manifest["format"]]:
        if name not in manifest["files"]:
            raise CheckpointError(path, f"does not list {name}, which a {manifest['format']} "
                                  "export has: not an sdpipe export, or changed by hand")
    for name, digest in manifest["files"].items():
        file = Path(folder) / str(name)
        if not isinstance(name, str) or "/" in name or name in ("", ".", "..") or not file.is_file():
            raise CheckpointError(file, "listed in export.json but missing")
        if checkpoint.sha256(file) != digest:
            raise CheckpointError(file, "checksum mismatch: truncated or changed since the export")
    trust.check(manifest["config"], str(path), trusted)
    return manifest


def load(folder: Path, trusted: bool = False) -> Export:
    """An export as a model: through transformers for the ``transformers`` format (as its users
    load it), else the built model with ``load_state_dict(strict=True)`` of ``model.pt``."""
    folder = Path(folder)
    manifest = read_manifest(folder, trusted)
    config = typed(manifest["config"], str(folder / MANIFEST))
    if manifest["format"] == "transformers":
        from sdpipe_cli.model import hf

        _quiet_transformers()
        saved = hf.saved_type(folder)
        if saved != config.model.arch:
            raise CheckpointError(folder / "config.json", f"holds a {saved!r} model; export.json "
                                  f"says {config.model.arch!r}")
        whole = hf.load_pretrained(folder)
        blocks, _ = hf.split_blocks(whole)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(config.train.seed))
            whole, blocks, _ = models.build_whole(config.model)
        state = checkpoint.load_shard(folder, "model", manifest)  # checked, tensors only
        try:
            whole.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise CheckpointError(folder / "model.pt", f"does not fit the model of export.json: "
                                  f"{' '.join(str(err).split())[:200]}") from None
    return Export(folder, manifest, config, whole.eval(), blocks)


def _quiet_transformers() -> None:
    """No progress bars of transformers' own between sdpipe's lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # sdpipe says what went wrong, in one line
