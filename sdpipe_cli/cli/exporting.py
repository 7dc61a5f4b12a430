"""``sdpipe export``, ``sdpipe eval`` and ``sdpipe sample``: what a user does after training.

Each is thin: find the weights (:mod:`sdpipe_cli.export.weights`), make or read the one model
(:mod:`~sdpipe_cli.export.formats`), evaluate it (:mod:`~sdpipe_cli.export.evaluation`) or let
it write (:mod:`~sdpipe_cli.export.generation`), and say what happened in a few lines. Bad input
(a folder that is neither a run nor an export, weights of another model, an ``--out`` that holds
files) is a :class:`~sdpipe_cli.core.errors.BadInput` raised before anything is written.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from sdpipe_cli.config.schema import ConfigError
from sdpipe_cli.core.errors import BadInput
from sdpipe_cli.runtime.errors import CheckpointError

__all__ = ["evaluate", "export", "sample"]


def _say(console: Console, line: str) -> None:
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def export(run: str, which: str | None, out: str, pipeline: int | None, fmt: str | None,
           console: Console, trusted: bool = False) -> int:
    from sdpipe_cli.export import formats, weights

    target = Path(out).absolute()
    formats.check_out(target)  # before anything is read: a folder that holds files is refused
    formats.clear_partials(target, log=lambda line: _say(console, line))
    source = weights.find(run, which, trusted)
    if fmt is not None:
        formats.check_format(fmt, source.config.model)
    weights.check_pipeline(source, pipeline)
    merged = weights.merge(source, pipeline)  # every shard checked: bad input ends here
    _say(console, f"weights: {source.describe()}")
    _say(console, f"replicas: {merged.describe()}")
    manifest = _as_bad_input(lambda: formats.write(source, merged, target, fmt,
                                                   log=lambda line: _say(console, line)),
                             target)
    size = sum((target / name).stat().st_size for name in manifest["files"])
    _say(console, f"wrote {target}: {manifest['format']}, {', '.join(manifest['files'])} "
                  f"({size / 1e6:.1f} MB)" + (f"; tokenizer: {manifest['tokenizer']}"
                                              if manifest["tokenizer"] else ""))
    if manifest["format"] != "transformers":
        _say(console, f"keys: {', '.join(manifest['keys'])}, ...")
    _say(console, f"load it: {_how_to_load(manifest, target)}")
    return 0


def _how_to_load(manifest: dict, folder: Path) -> str:
    if manifest["format"] == "transformers":
        head = "AutoModelForMaskedLM" if manifest["arch"] == "bert" else "AutoModelForCausalLM"
        return f"transformers.{head}.from_pretrained({str(folder)!r})"
    return (f"model.load_state_dict(torch.load({str(folder / 'model.pt')!r}, weights_only=True)) "
            f"(docs/MODELS.md, \"After training\")")


def evaluate(path: str, overrides: Sequence[str], which: str | None, pipeline: int | None,
             out: str | None, console: Console, trusted: bool = False) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from sdpipe_cli.data import sources
    from sdpipe_cli.export import evaluation, formats, weights

    _new_file(out)
    evaluation.check_keys(overrides)
    folder = Path(path)
    if formats.is_export(folder) and (which is not None or pipeline is not None):
        raise ConfigError("--checkpoint" if which is not None else "--pipeline",
                          f"{folder} is an export, one model: it has no checkpoints or replicas")
    if formats.is_export(folder):
        loaded = _as_bad_input(lambda: formats.load(folder, trusted), folder)
        config, blocks, what = loaded.config, loaded.blocks, f"export {folder}"
    else:
        source = weights.find(path, which, trusted)
        weights.check_pipeline(source, pipeline)
        merged = weights.merge(source, pipeline)
        config = source.config
        blocks, what = formats.assemble(config, merged)[1], str(source.path)
    config = evaluation.with_overrides(config, overrides)
    count = sources.val_count(config)
    evaluation.check_memory(config)  # bad input all: before anything is said
    if not formats.is_export(folder):
        _say(console, f"weights: {source.describe()}; {merged.describe()}")
    with Progress(TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("eval", total=count)
        outcome = evaluation.evaluate(config, blocks, pipeline=pipeline,
                                      on_batch=lambda n: bar.update(task, completed=n),
                                      say=lambda line: _say(console, line))
    samples = outcome.batches * int(config.train.batch_size)
    accuracy = "" if outcome.accuracy is None else f", val_accuracy {outcome.accuracy:.4f}"
    _say(console, f"eval: val_loss {outcome.loss:.6f}{accuracy} on {samples} validation samples "
                  f"of {evaluation.data_name(config)} ({what})")
    if out is not None:
        _write_new(Path(out), {"val_loss": outcome.loss, "val_accuracy": outcome.accuracy,
                               "batches": outcome.batches, "samples": samples, "model": what,
                               "data": evaluation.data_name(config)})
    return 0


def sample(path: str, prompt: str, settings, console: Console, trusted: bool = False) -> int:
    from sdpipe_cli.export import formats, generation

    generation.check(prompt, settings)  # before the export is read
    folder = Path(path)
    if not formats.is_export(folder):
        raise CheckpointError(folder, "is not an export (no export.json): run sdpipe export first")
    loaded = _as_bad_input(lambda: formats.load(folder, trusted), folder)
    print(generation.sample(loaded, prompt, settings))
    return 0


def _as_bad_input(make, where: Path):
    """``make()``, a transformers refusal (a ValueError or OSError) turned into bad input naming
    ``where``; bad input already (naming its own key or file) as it is."""
    try:
        return make()
    except BadInput:
        raise
    except (ValueError, OSError) as err:
        raise CheckpointError(where, " ".join(str(err).split())[:300]) from None


def _new_file(out: str | None) -> None:
    """``--out FILE`` names no file yet, in a folder that can be made."""
    if out is None:
        return
    from sdpipe_cli.export import formats

    try:
        if Path(out).exists() or Path(out).is_symlink():
            raise ConfigError("--out", f"{out} already exists: nothing of it is overwritten")
        formats.check_parent(Path(out))
    except OSError as err:  # a name too long
        raise ConfigError("--out", f"{out}: {err.strerror or err}") from None


def _write_new(path: Path, doc: dict) -> None:
    """``doc`` as JSON at ``path``, which must not exist: written beside it, then linked in.
    Meanwhile Ctrl-C and SIGTERM are ignored: the handler before would end the process at
    once, leaving the temporary file behind and saying that nothing was written; the write
    takes milliseconds, and the command ends right after it."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _write_beside(path.absolute(), doc)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _write_beside(path: Path, doc: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as err:
        raise ConfigError("--out", f"{path} cannot be written: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        os.link(tmp, path)  # fails, writing nothing, if something took the name meanwhile
    except FileExistsError:
        raise ConfigError("--out", f"{path} already exists: nothing of it is overwritten") from None
    finally:
        os.unlink(tmp)
