"""The documents that ``sdpipe prepare text`` tokenizes, read from its sources in bounded pieces.

Sources are files, folders, ``stdlib`` or, with ``--dataset``, whatever Hugging Face
``datasets`` loads; each is checked before any text is read (a named pipe, device or socket is
refused: reading one would wait forever or never end). A ``.jsonl``/``.json`` file holds one
document per line, a ``.parquet`` file one per row, any other file is one document.

Memory stays flat whatever a document's length: a tokenizer takes about a hundred times a
text's size to split it, so no text longer than :data:`PIECE_CHARS` characters reaches it. A text
file is read :data:`READ_CHUNK` bytes at a time, and any longer document (a file of one line, a
long JSON value) is handed over in pieces, cut before a whitespace that precedes a word (where
``bpe`` and ``wordpiece`` split anyway, so the tokens are those of the whole document; a
``tokenizer.json`` of another kind may differ at a cut) or, with no whitespace near, at the limit.
A piece carries whether its document ends with it, so the end-of-text token follows a document's
last piece only. A JSON line or a Parquet value is still held whole while it is parsed (a few
times its size).

Bytes that are not UTF-8 are kept: text is decoded with ``surrogateescape``, which turns back into
the same bytes (:func:`utf8`), so the ``bytes`` tokenizer writes the sources' bytes as they are.
Bad input is one :class:`DataError` naming the file (and line).
"""

from __future__ import annotations

import codecs
import io
import json
import os
import re
import stat
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from sdpipe_cli.config.local_files import special_kind
from sdpipe_cli.data.corpus import STDLIB_SKIP_DIRS, sorted_files
from sdpipe_cli.runtime.errors import DataError

PIECE_CHARS = 1 << 18  # the longest text handed to a tokenizer; longer documents go in pieces
CUT_WINDOW = 1 << 16  # how far back from PIECE_CHARS a piece's end looks for a whitespace
READ_CHUNK = 1 << 18  # bytes read from a text file at a time
SMALL_FILE = 4 << 20  # text files up to this size are read in one go
COPY_CHUNK = 1 << 20
JSON_SUFFIXES = (".jsonl", ".json")

_CUT = re.compile(r"[ \t\n\r\f\v](?=\S)")  # where a long document may be cut: before " word"
LONE_SURROGATE = re.compile("[\ud800-\udc7f\udd00-\udfff]")  # surrogates that stand for no byte
Piece = tuple[str, bool]  # some text of a document, and whether the document ends with it


def resolve_sources(sources: list[str]) -> list[tuple[str, list[Path] | None]]:
    """Each source with its files (None for ``stdlib``), failing early on a missing one or on a
    named pipe, device or socket (reading one would wait forever or never end). Inside a folder
    only regular files are read (:func:`sorted_files`)."""
    if not sources:
        raise DataError("sources", "give at least one file, folder, or stdlib")
    out: list[tuple[str, list[Path] | None]] = []
    for source in sources:
        if source == "stdlib":
            out.append((source, None))
            continue
        path = Path(source).expanduser()
        if path.is_dir():
            files = list(sorted_files(path))
            if not files:
                raise DataError(source, "the folder contains no files")
            out.append((str(path.resolve()), files))
        elif path.is_file():
            out.append((source, [path]))
        else:
            try:
                what = special_kind(path.stat().st_mode)
            except OSError:
                what = None
            if what:
                raise DataError(source, f"is {what}, not a regular file or folder; sdpipe prepare reads "
                                "files to their end: copy the text into a file first")
            raise DataError(source, "no such file or folder")
    return out


def open_source(path: Path, where: str | None = None) -> io.BufferedReader:
    """``path`` opened for reading, refused unless it is a regular file: opened without blocking
    (a named pipe put in place of a file since it was listed cannot hang the open) and checked on
    the open descriptor. ``where`` names it in the error (default: the path)."""
    where = where or str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise DataError(where, f"cannot read {path}: {e.strerror or e}") from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = special_kind(mode) or ("a folder" if stat.S_ISDIR(mode) else "not a regular file")
            raise DataError(where, f"{path} is {what}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _stdlib_files() -> Iterator[Path]:
    """The standard library's ``.py`` sources, in ``corpus._stdlib_bytes``'s order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return (p for p in sorted_files(root, STDLIB_SKIP_DIRS) if p.suffix == ".py")


def _cut(text: str, start: int, limit: int) -> int:
    """Where a piece of ``text`` that starts at ``start`` ends, at most at ``limit``: before the
    last whitespace followed by a non-whitespace within :data:`CUT_WINDOW` characters of the
    limit, else at the limit."""
    cuts = list(_CUT.finditer(text, max(start + 1, limit - CUT_WINDOW), limit + 2))
    return cuts[-1].start() if cuts else limit


def _pieces(text: str, end: bool = True) -> Iterator[Piece]:
    """``text`` in pieces of at most :data:`PIECE_CHARS` characters; the last carries ``end``."""
    start = 0
    while len(text) - start > PIECE_CHARS:
        cut = _cut(text, start, start + PIECE_CHARS)
        yield text[start:cut], False
        start = cut
    yield text[start:], end


def _text_file(path: Path, *, skip_unreadable: bool = False) -> Iterator[Piece]:
    """A whole file as one document, in pieces; binary files (with a NUL byte) are skipped.

    Files up to :data:`SMALL_FILE` bytes are read at once; a larger one is first scanned for a NUL
    byte, then read :data:`READ_CHUNK` bytes at a time, so memory is bounded whatever its size
    and however long its lines. Bytes that are not UTF-8 are kept (``surrogateescape``)."""
    try:
        f = open_source(path)
    except DataError:
        if skip_unreadable:
            return
        raise
    with f:
        try:
            head = f.read(SMALL_FILE + 1)
            if len(head) <= SMALL_FILE:
                if b"\0" not in head:
                    yield from _pieces(head.decode("utf-8", "surrogateescape"))
                return
            if b"\0" in head or any(b"\0" in chunk for chunk in iter(lambda: f.read(COPY_CHUNK), b"")):
                return
            del head
            f.seek(0)
            decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
            buf = ""
            while True:
                data = f.read(READ_CHUNK)
                buf += decoder.decode(data, final=not data)
                while len(buf) > PIECE_CHARS:
                    cut = _cut(buf, 0, PIECE_CHARS)
                    yield buf[:cut], False
                    buf = buf[cut:]
                if not data:
                    break
            yield buf, True
        except OSError as e:
            if not skip_unreadable:
                raise DataError(str(path), f"cannot read file: {e.strerror or e}") from e


def _json_lines(path: Path, text_key: str) -> Iterator[Piece]:
    """One document per line of a JSON-lines file: the string under ``text_key``. A line that
    is not JSON, nested too deeply to parse, or without the text is one error naming the line."""
    lineno = 0
    try:
        with io.TextIOWrapper(open_source(path), encoding="utf-8", errors="surrogateescape") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    row = json.loads(line)
                except RecursionError:
                    raise DataError(where, f"the JSON is nested too deeply to read (over "
                                    f"{sys.getrecursionlimit()} levels); a {path.suffix} source must "
                                    "hold one JSON object per line, its text under --text-key") from None
                except ValueError as e:  # JSONDecodeError, or an integer with too many digits
                    raise DataError(where, f"not JSON ({getattr(e, 'msg', e)}); a {path.suffix} "
                                    "source must hold one JSON object per line") from e
                if not isinstance(row, dict) or text_key not in row:
                    raise DataError(where, f"no {text_key!r} field; name the text field with --text-key")
                if not isinstance(row[text_key], str):
                    raise DataError(where, f"field {text_key!r} is {type(row[text_key]).__name__}, "
                                    "not text")
                text, row = row[text_key], None
                yield from _pieces(text)
    except OSError as e:
        raise DataError(f"{path}:{lineno + 1}", f"cannot read file: {e.strerror or e}") from e


def _parquet_rows(path: Path, text_key: str) -> Iterator[Piece]:
    """One document per row of a Parquet file's ``text_key`` column (nulls are empty)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(str(path), "reading .parquet needs pyarrow: pip install pyarrow") from e
    with open_source(path) as source:
        try:
            table = pq.ParquetFile(source)
        except Exception as e:  # pyarrow raises several types for a bad file
            raise DataError(str(path), f"not a readable Parquet file: {str(e).splitlines()[0]}") from e
        names = table.schema_arrow.names
        if text_key not in names:
            raise DataError(str(path), f"no column {text_key!r} (columns: {', '.join(names)}); "
                            "choose one with --text-key")
        try:
            for batch in table.iter_batches(columns=[text_key], batch_size=1024):
                for value in batch.column(0).to_pylist():
                    if value is not None and not isinstance(value, str):
                        raise DataError(str(path), f"column {text_key!r} holds {type(value).__name__}, "
                                        "not text")
                    yield from _pieces(value or "")
        except OSError as e:  # pyarrow's IO errors
            raise DataError(str(path), f"cannot read file: {str(e).splitlines()[0]}") from e


def _hf_rows(sources: list[str], dataset_format: str, text_key: str) -> Iterator[Piece]:
    """Documents read by Hugging Face ``datasets`` (``--dataset``)."""
    try:
        import datasets
    except ImportError as e:
        raise DataError("--dataset", "needs Hugging Face datasets: pip install datasets") from e
    try:
        ds = datasets.load_dataset(dataset_format, data_files=sources, split="train")
    except Exception as e:  # datasets raises many types for bad input
        raise DataError("--dataset", f"datasets could not load {dataset_format!r} from the "
                        f"sources: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    if text_key not in ds.column_names:
        raise DataError("--text-key", f"no column {text_key!r} (columns: {', '.join(ds.column_names)})")
    for batch in ds.select_columns([text_key]).iter(batch_size=1024):
        for value in batch[text_key]:
            yield from _pieces(value if isinstance(value, str) else "")


def _raw_pieces(resolved, text_key: str, dataset_format: str | None) -> Iterator[Piece]:
    if dataset_format:
        yield from _hf_rows([s for s, _ in resolved], dataset_format, text_key)
        return
    for _, files in resolved:
        if files is None:
            for path in _stdlib_files():
                yield from _text_file(path, skip_unreadable=True)
            continue
        for path in files:
            suffix = path.suffix.lower()
            if suffix in JSON_SUFFIXES:
                yield from _json_lines(path, text_key)
            elif suffix == ".parquet":
                yield from _parquet_rows(path, text_key)
            else:
                yield from _text_file(path)


def utf8(text: str) -> bytes:
    """The bytes of a text read by this module: those that were not UTF-8 come back as they were
    (``surrogateescape``); a lone surrogate from a JSON escape, which no bytes spell, is U+FFFD."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return LONE_SURROGATE.sub("\ufffd", text).encode("utf-8", "surrogateescape")


def _utf8_prefix(data: bytes, n: int) -> str:
    """The first ``n`` bytes of ``data`` as text, cut before a character they would split."""
    if n < len(data):
        least = max(n - 3, 0)
        while n > least and 0x80 <= data[n] < 0xC0:
            n -= 1
    return data[:n].decode("utf-8", "surrogateescape")


def documents(resolved, text_key: str, dataset_format: str | None, max_bytes: int | None
               ) -> Iterator[Piece]:
    """Non-empty documents in pieces of at most :data:`PIECE_CHARS` characters, stopping once
    ``max_bytes`` bytes were given (the last document is cut there, at a character boundary), so
    every pass over them sees the same text."""
    left = max_bytes
    inside = False  # a piece of the current document was given
    for text, end in _raw_pieces(resolved, text_key, dataset_format):
        if not text and not (end and inside):
            continue
        if left is not None:
            data = utf8(text)
            if len(data) >= left:
                text = _utf8_prefix(data, left)
                if text or inside:
                    yield text, True
                return
            left -= len(data)
        inside = not end
        yield text, end
