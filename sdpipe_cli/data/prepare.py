"""Writing tokenized corpora (``sdpipe prepare text``): text in, token shards and a manifest out.

Tokenizing is done once, ahead of training, so that a run starts at once and every process only
maps the shards it reads (``sdpipe_cli.data.tokens``). Documents are streamed
(:mod:`~sdpipe_cli.data.documents`): a tokenizer is trained from an iterator over them, and the
token ids of one chunk of documents at a time are encoded (:mod:`~sdpipe_cli.data.tokenizer`) and
appended to the current shard (:mod:`~sdpipe_cli.data.shard_writer`), so memory stays flat
whatever the corpus size. The validation split is the stream's tail, unknown until the end: it is
copied out of the last train shards, which are then truncated.

The ``bytes`` tokenizer writes the sources' bytes as they are, UTF-8 or not (like ``data=text``
and ``data=stdlib``). A Hugging Face tokenizer reads text, so there bytes that are not UTF-8
become U+FFFD, and one warning line says how many.

This module is the command: the options checked, then everything written into a temporary folder
beside ``--out`` and renamed into place at the end, so a failure (always a one-line
:class:`DataError` for bad input, naming the file or option: a source that is not a regular file,
a JSON line nested too deeply, an ``--out`` that cannot be written or a full disk) never leaves
half a corpus. Tokenizer calls, which cannot be interrupted, run in a worker thread, so that an
interrupt handler runs at once in the main thread: :func:`abandon` removes what is being written
(``sdpipe_cli.cli.commands.prepare_text`` calls it on Ctrl-C or SIGTERM, then ends the process).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sdpipe_cli.config.local_files import remove_empty_folders
from sdpipe_cli.data.documents import LONE_SURROGATE, Piece, documents, resolve_sources, utf8
from sdpipe_cli.data.shard_writer import ShardWriter, split_off_val
from sdpipe_cli.data.tokenizer import TextTokenizer, as_text, encode, parse_tokenizer, train_tokenizer
from sdpipe_cli.data.tokens import FORMAT, ITEMSIZE, MANIFEST, VERSION
from sdpipe_cli.runtime.errors import DataError, os_reason


def _check_options(val_fraction: float, shard_tokens: int, dtype: str | None, max_bytes: int | None,
                   tok: TextTokenizer) -> None:
    if not 0.0 < float(val_fraction) < 1.0:
        raise DataError("--val-fraction", f"must be between 0 and 1 (exclusive), got {val_fraction}")
    if int(shard_tokens) < 1:
        raise DataError("--shard-tokens", f"must be a positive number of tokens, got {shard_tokens}")
    if max_bytes is not None and int(max_bytes) < 1:
        raise DataError("--max-bytes", f"must be a positive number of bytes, got {max_bytes}")
    if dtype is not None and dtype not in ITEMSIZE:
        raise DataError("--dtype", f"must be one of {', '.join(ITEMSIZE)}, got {dtype!r}")
    _check_dtype(dtype, tok.vocab)


def _check_dtype(dtype: str | None, vocab: int) -> str:
    """The shard dtype: as asked, or the smallest that holds ``vocab`` ids."""
    if dtype is None:
        return "uint16" if vocab <= 2**16 else "uint32"
    if vocab > 2 ** (8 * ITEMSIZE[dtype]):
        raise DataError("--dtype", f"{dtype} cannot hold a vocabulary of {vocab}; use --dtype uint32")
    return dtype


_STAGING: dict[Path, tuple[Path, list[Path]]] = {}  # of the prepares in progress: temporary folder
# -> (the final folder, the folders above it that were made for it)


def _staging_folder(out: str) -> tuple[Path, Path, list[Path]]:
    """The final folder, refused when it holds anything, a fresh temporary folder beside it, and
    the folders made above them (removed again on failure). Every problem is one DataError on
    ``--out``: a file where a folder is needed, a location that cannot be written."""
    final = Path(out).expanduser().absolute()
    try:
        if final.exists() and (not final.is_dir() or any(final.iterdir())):
            raise DataError("--out", f"{final} already exists and is not an empty folder; choose a new "
                            "one or remove it")
    except OSError as e:
        raise DataError("--out", f"cannot read {final}: {os_reason(e)}") from e
    missing = []
    parent = final.parent
    while not parent.exists() and not parent.is_symlink() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise DataError("--out", f"{parent} is a file, not a folder: {final} cannot be made under it")
    made: list[Path] = []
    try:
        for folder in reversed(missing):
            folder.mkdir()
            made.append(folder)
        tmp = final.parent / f".{final.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
        tmp.mkdir()  # not mkdtemp: the corpus gets the usual permissions, not 0700
        _STAGING[tmp] = (final, made)  # at once: abandon() must see it from the next bytecode on
    except OSError as e:
        remove_empty_folders(made)
        raise DataError("--out", f"cannot make a folder in {Path(e.filename or final).parent}: "
                        f"{os_reason(e)}") from e
    return final, tmp, made


def abandon() -> bool:
    """Remove the temporary folder of every prepare in progress in this process, and the folders
    made for it: for an interrupt handler that then ends the process at once. True when one had
    been renamed into place already (its corpus is complete)."""
    complete = False
    for tmp, (_final, made) in list(_STAGING.items()):
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
            remove_empty_folders(made)
        else:
            complete = True
        _STAGING.pop(tmp, None)
    return complete


def prepare_text(sources: list[str], out: str, tokenizer: str = "bytes", *, text_key: str = "text",
                 val_fraction: float = 0.01, shard_tokens: int = 2**27, dtype: str | None = None,
                 max_bytes: int | None = None, dataset_format: str | None = None,
                 log: Callable[[str], Any] = print) -> dict:
    """Tokenize ``sources`` into shards under ``out`` and return the manifest written there.

    Sources are files or folders (``.jsonl``/``.json``: JSON lines, text under ``text_key``;
    ``.parquet``: column ``text_key``; anything else: one document per file) or ``stdlib``; with
    ``dataset_format`` they are read by Hugging Face ``datasets`` instead. ``tokenizer`` is
    ``bytes``, ``bpe:VOCAB``, ``wordpiece:VOCAB`` or a ``tokenizer.json`` path. The last
    ``val_fraction`` of the token stream is the validation split.

    Bad input is one :class:`DataError` naming the option or file, and so is a failure to write
    (``--out`` under a file, a full disk, a file size limit); then, as on any exception
    (KeyboardInterrupt included), nothing is left: no temporary folder, no folder made for
    ``out``, and an existing empty ``out`` is kept.
    """
    resolved = resolve_sources(list(sources))
    tok = parse_tokenizer(tokenizer)
    _check_options(val_fraction, shard_tokens, dtype, max_bytes, tok)
    final, tmp, made = _staging_folder(out)
    try:
        try:
            manifest = _prepare_into(tmp, resolved, tok, tokenizer, text_key, float(val_fraction),
                                     int(shard_tokens), dtype, max_bytes, dataset_format, log)
        except OSError as e:  # the sources' read errors are DataErrors already: this is --out
            what = f" ({Path(e.filename).name})" if e.filename else ""
            raise DataError("--out", f"cannot write {final}{what}: {os_reason(e)}; nothing was "
                            "written") from e
        try:  # onto an empty folder, or none; refused if anything appeared there meanwhile
            os.rename(tmp, final)
        except OSError as e:
            raise DataError("--out", f"cannot move the finished corpus into {final}: {os_reason(e)} (did "
                            "something appear there meanwhile?); nothing was written") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_empty_folders(made)
        raise
    finally:
        _STAGING.pop(tmp, None)
    return manifest


def _count(pattern: re.Pattern, text: str) -> int:
    return 0 if pattern.search(text) is None else len(pattern.findall(text))


def _prepare_into(tmp: Path, resolved, tok: TextTokenizer, spec: str, text_key: str, val_fraction: float,
                  shard_tokens: int, dtype: str | None, max_bytes: int | None,
                  dataset_format: str | None, log: Callable[[str], Any]) -> dict:
    def docs() -> Iterator[Piece]:
        return documents(resolved, text_key, dataset_format, max_bytes)

    if next(docs(), None) is None:
        names = ", ".join(s for s, _ in resolved)
        raise DataError("sources", f"empty corpus: no text in {names}; give files with text")
    _make_tokenizer(tmp, tok, docs, log)
    dtype = _check_dtype(dtype, tok.vocab)
    train, n_docs, n_bytes = _write_train(tmp, tok, docs, shard_tokens, ITEMSIZE[dtype], log)
    total = sum(e["tokens"] for e in train)
    train, val, n_val = _split_val(tmp, train, total, val_fraction, shard_tokens, ITEMSIZE[dtype])
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": {"spec": spec, "kind": tok.kind, "vocab_size": tok.vocab,
                      "file": "tokenizer.json" if tok.hf is not None else None,
                      "eos_id": tok.eos_id, "mask_id": tok.mask_id},
        "dtype": dtype,
        "splits": {"train": train, "val": val},
        "documents": n_docs,
        "sources": [s for s, _ in resolved],
        "text_bytes": n_bytes,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    log(f"wrote {total - n_val} train and {n_val} validation tokens ({dtype}, "
        f"{len(train) + len(manifest['splits']['val'])} shards)")
    return manifest


def _make_tokenizer(tmp: Path, tok: TextTokenizer, docs: Callable[[], Iterator[Piece]],
                    log: Callable[[str], Any]) -> None:
    """Train a ``bpe`` or ``wordpiece`` tokenizer on a pass over the documents; write a Hugging
    Face tokenizer's ``tokenizer.json`` into ``tmp`` (a loaded file's bytes as they were)."""
    if tok.kind in ("bpe", "wordpiece"):
        train_tokenizer(tok, (as_text(text, [0]) for text, _ in docs()))
        log(f"trained a {tok.kind} tokenizer: {tok.vocab} tokens")
    if tok.hf is not None:
        data = tok.raw if tok.raw is not None else tok.hf.to_str(pretty=True).encode("utf-8")
        (tmp / "tokenizer.json").write_bytes(data)


def _write_train(tmp: Path, tok: TextTokenizer, docs: Callable[[], Iterator[Piece]], shard_tokens: int,
                 itemsize: int, log: Callable[[str], Any]) -> tuple[list[dict], int, int]:
    """Encode every document into the train shards: their entries, the number of documents and
    their bytes of text. Logs those counts, and how many characters became U+FFFD."""
    writer = ShardWriter(tmp, "train", shard_tokens, itemsize)
    n_docs = n_bytes = 0
    replaced = [0]  # characters that a tokenizer could not take as they were: now U+FFFD

    def counted() -> Iterator[Piece]:
        nonlocal n_docs, n_bytes
        for text, end in docs():
            n_docs += end
            n_bytes += len(utf8(text))
            if tok.hf is not None:
                text = as_text(text, replaced)
            else:
                replaced[0] += _count(LONE_SURROGATE, text)
            yield text, end

    try:
        for ids in encode(tok, counted()):
            writer.write(ids)
    except BaseException:
        writer.discard()
        raise
    train = writer.close()
    log(f"read {n_docs} documents, {n_bytes} bytes of text")
    _warn_replaced(tok, replaced[0], log)
    return train, n_docs, n_bytes


def _warn_replaced(tok: TextTokenizer, replaced: int, log: Callable[[str], Any]) -> None:
    """One warning line when ``replaced`` characters of the sources became U+FFFD."""
    if replaced and tok.hf is not None:
        log(f"sdpipe: warning: {replaced:,} bytes of the sources are not UTF-8 (or are lone "
            f"surrogate escapes): the {tok.kind} tokenizer reads text, so each became U+FFFD; the "
            "bytes tokenizer keeps them")
    elif replaced:
        log(f"sdpipe: warning: {replaced:,} lone surrogate escapes in JSON text (such as "
            "\\ud800, which no UTF-8 bytes spell) became U+FFFD")


def _split_val(tmp: Path, train: list[dict], total: int, val_fraction: float, shard_tokens: int,
               itemsize: int) -> tuple[list[dict], list[dict], int]:
    """Move the last ``val_fraction`` of the ``total`` train tokens into val shards, refusing an
    empty split: the train entries left, the val entries, the number of val tokens."""
    n_val = int(total * val_fraction)
    if n_val < 1 or total - n_val < 1:
        raise DataError("--val-fraction", f"{total} tokens with --val-fraction {val_fraction} leave an "
                        "empty train or validation split; use more text or another --val-fraction")
    val = ShardWriter(tmp, "val", shard_tokens, itemsize)
    try:
        train = split_off_val(tmp, train, n_val, val)
    except BaseException:
        val.discard()
        raise
    return train, val.close(), n_val
