"""Writing tokenized corpora (``sdpipe prepare text``): text in, token shards and a manifest out.

Tokenizing is done once, ahead of training, so that a run starts at once and every process only
maps the shards it reads (``sdpipe_cli.data.tokens``). Documents are streamed: a tokenizer is
trained from an iterator over them, and the token ids of one chunk of documents at a time are
encoded and appended to the current shard, so memory stays flat whatever the corpus size. The
validation split is the stream's tail, unknown until the end: it is copied out of the last train
shards, which are then truncated.

Memory stays flat whatever a document's length too: a tokenizer takes about a hundred times a
text's size to split it, so no text longer than :data:`PIECE_CHARS` characters reaches it. A text
file is read :data:`READ_CHUNK` bytes at a time, and any longer document (a file of one line, a
long JSON value) is handed over in pieces, cut before a whitespace that precedes a word (where
``bpe`` and ``wordpiece`` split anyway, so the tokens are those of the whole document; a
``tokenizer.json`` of another kind may differ at a cut) or, with no whitespace near, at the limit.
The end-of-text token follows a document's last piece only. A JSON line or a Parquet value is
still held whole while it is parsed (a few times its size).

The ``bytes`` tokenizer writes the sources' bytes as they are, UTF-8 or not (like ``data=text``
and ``data=stdlib``): text is decoded with ``surrogateescape``, which turns back into the same
bytes. A Hugging Face tokenizer reads text, so there bytes that are not UTF-8 become U+FFFD, and
one warning line says how many.

Everything is written into a temporary folder beside ``--out`` and renamed into place at the end,
so a failure (always a one-line :class:`DataError` for bad input, naming the file or option: a
source that is not a regular file, a JSON line nested too deeply, an ``--out`` that cannot be
written or a full disk) never leaves half a corpus. Tokenizer calls, which cannot be interrupted,
run in a worker thread, so that an interrupt handler runs at once in the main thread:
:func:`abandon` removes what is being written (``sdpipe_cli.cli.commands.prepare_text`` calls it
on Ctrl-C or SIGTERM, then ends the process).
"""

from __future__ import annotations

import codecs
import errno
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import stat
import sys
import sysconfig
import threading
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from sdpipe_cli.data.corpus import STDLIB_SKIP_DIRS, sorted_files
from sdpipe_cli.data.tokens import FORMAT, ITEMSIZE, MANIFEST, VERSION, file_sha256
from sdpipe_cli.runtime.errors import DataError

EOS = "<|endoftext|>"
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
EOS_NAMES = (EOS, "</s>", "<eos>", "<|eos|>", "[SEP]")  # looked up in a tokenizer.json, in order
MASK_NAMES = ("[MASK]", "<mask>", "<|mask|>")
ENCODE_CHUNK_DOCS = 1024
ENCODE_CHUNK_BYTES = 4 << 20  # characters of text per encode_batch call (at most one piece more)
PIECE_CHARS = 1 << 18  # the longest text handed to a tokenizer; longer documents go in pieces
CUT_WINDOW = 1 << 16  # how far back from PIECE_CHARS a piece's end looks for a whitespace
READ_CHUNK = 1 << 18  # bytes read from a text file at a time
SMALL_FILE = 4 << 20  # text files up to this size are read in one go
COPY_CHUNK = 1 << 20
MAX_VOCAB = 1 << 24  # bpe:/wordpiece: sizes above this are refused (the trainers allocate per token)
JSON_SUFFIXES = (".jsonl", ".json")
WAIT_S = 0.1  # how often the main thread wakes while a tokenizer call runs

_CUT = re.compile(r"[ \t\n\r\f\v](?=\S)")  # where a long document may be cut: before " word"
_SURROGATE = re.compile("[\ud800-\udfff]")  # not text: bytes that were not UTF-8, lone escapes
_LONE = re.compile("[\ud800-\udc7f\udd00-\udfff]")  # surrogates that stand for no byte
_SPECIAL = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))

Piece = tuple[str, bool]  # some text of a document, and whether the document ends with it


# ----------------------------------------------------------------------------- documents


def _special_kind(mode: int) -> str | None:
    """What a file that is neither a regular file nor a folder is, as words; None for those two."""
    return next((what for test, what in _SPECIAL if test(mode)), None)


def _resolve_sources(sources: list[str]) -> list[tuple[str, list[Path] | None]]:
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
                what = _special_kind(path.stat().st_mode)
            except OSError:
                what = None
            if what:
                raise DataError(source, f"is {what}, not a regular file or folder; sdpipe prepare reads "
                                "files to their end: copy the text into a file first")
            raise DataError(source, "no such file or folder")
    return out


def _open_source(path: Path, where: str | None = None) -> io.BufferedReader:
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
            what = _special_kind(mode) or ("a folder" if stat.S_ISDIR(mode) else "not a regular file")
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
    last = None
    for last in _CUT.finditer(text, max(start + 1, limit - CUT_WINDOW), limit + 2):
        pass
    return last.start() if last is not None else limit


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
        f = _open_source(path)
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
        with io.TextIOWrapper(_open_source(path), encoding="utf-8", errors="surrogateescape") as f:
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
    with _open_source(path) as source:
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


def _utf8(text: str) -> bytes:
    """The bytes of a text read by this module: those that were not UTF-8 come back as they were
    (``surrogateescape``); a lone surrogate from a JSON escape, which no bytes spell, is U+FFFD."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return _LONE.sub("\ufffd", text).encode("utf-8", "surrogateescape")


def _utf8_prefix(data: bytes, n: int) -> str:
    """The first ``n`` bytes of ``data`` as text, cut before a character they would split."""
    if n < len(data):
        least = max(n - 3, 0)
        while n > least and 0x80 <= data[n] < 0xC0:
            n -= 1
    return data[:n].decode("utf-8", "surrogateescape")


def _documents(resolved, text_key: str, dataset_format: str | None, max_bytes: int | None
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
            data = _utf8(text)
            if len(data) >= left:
                text = _utf8_prefix(data, left)
                if text or inside:
                    yield text, True
                return
            left -= len(data)
        inside = not end
        yield text, end


# ----------------------------------------------------------------------------- tokenizers


@dataclass
class _Tokenizer:
    kind: str  # bytes | bpe | wordpiece | file
    vocab: int  # requested (bpe, wordpiece) or actual size
    path: Path | None = None
    hf: Any = None  # a tokenizers.Tokenizer once built
    eos_id: int | None = None
    mask_id: int | None = None
    raw: bytes | None = None  # a tokenizer.json file's bytes, copied as they are


def _parse_tokenizer(spec: str) -> _Tokenizer:
    """Check ``--tokenizer`` before any text is read; a file is loaded here. A vocabulary size
    must lie between the smallest that holds the special tokens and :data:`MAX_VOCAB` (the
    trainers allocate for every token up front: 5e9 would abort the process)."""
    if spec == "bytes":
        return _Tokenizer("bytes", 256)
    kind, sep, vocab = spec.partition(":")
    if sep and kind in ("bpe", "wordpiece"):
        try:
            n = int(vocab)
        except ValueError:
            raise DataError("--tokenizer", f"{spec[:40]!r}: the vocabulary size must be an integer, "
                            f"as in {kind}:32000") from None
        least = 257 if kind == "bpe" else len(BERT_SPECIALS) + 1
        if n < least:
            why = "256 bytes + <|endoftext|>" if kind == "bpe" else "5 special tokens + 1"
            raise DataError("--tokenizer", f"{spec!r}: the vocabulary must be at least {least} ({why})")
        if n > MAX_VOCAB:
            raise DataError("--tokenizer", f"{spec[:40]!r}: the vocabulary must be at most {MAX_VOCAB:,} "
                            "(2**24; real ones hold 30 000 to 260 000 tokens)")
        return _Tokenizer(kind, n)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.exists() or path.is_dir():
        raise DataError("--tokenizer", f"{spec!r} is neither bytes, bpe:VOCAB, wordpiece:VOCAB nor an "
                        "existing tokenizer.json file")
    with _open_source(path, "--tokenizer") as f:
        try:
            raw = f.read()
        except OSError as e:
            raise DataError("--tokenizer", f"cannot read {path}: {e.strerror or e}") from e
    from tokenizers import Tokenizer

    try:
        hf = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception for a bad file
        raise DataError("--tokenizer", f"cannot load {path} as a tokenizer.json: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    return _Tokenizer("file", hf.get_vocab_size(with_added_tokens=True), path=path, hf=hf,
                      eos_id=_first_id(hf, EOS_NAMES), mask_id=_first_id(hf, MASK_NAMES), raw=raw)


def _first_id(hf, names: Iterable[str]) -> int | None:
    for name in names:
        token_id = hf.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def _off_main_thread(fn: Callable[..., Any], *args) -> Any:
    """``fn(*args)`` run in a worker thread while this one waits for it.

    A tokenizers call keeps the thread that made it until it returns (training a vocabulary of
    30 000 spends half a minute in one call), and Python runs signal handlers in the main
    thread only: waiting here instead lets Ctrl-C's handler run within :data:`WAIT_S`. When the
    wait ends by an exception (KeyboardInterrupt), the call goes on in the background until it
    returns (a training's iterator stops at its next document); its result is dropped.
    """
    result: list[Any] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn(*args))
        except BaseException as e:  # handed to the waiting thread
            failure.append(e)

    worker = threading.Thread(target=run, name="sdpipe-tokenizer", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(WAIT_S)
    if failure:
        raise failure[0]
    return result[0]


def _train(tok: _Tokenizer, docs: Iterator[str]) -> None:
    """Train a ``bpe`` (GPT-2's byte-level BPE) or ``wordpiece`` (BERT uncased) tokenizer from
    texts of at most :data:`PIECE_CHARS` characters (its memory grows with the longest)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if tok.kind == "bpe":
        hf = Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=tok.vocab, special_tokens=[EOS], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        hf = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        hf.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
        hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        hf.decoder = decoders.WordPiece(prefix="##")
        trainer = trainers.WordPieceTrainer(vocab_size=tok.vocab, special_tokens=list(BERT_SPECIALS),
                                            continuing_subword_prefix="##", show_progress=False)
    stop = threading.Event()

    def feed() -> Iterator[str]:
        for text in docs:
            if stop.is_set():  # the wait for this training was interrupted: end it early
                return
            yield text

    try:
        _off_main_thread(lambda: hf.train_from_iterator(feed(), trainer=trainer))
    finally:
        stop.set()
    if tok.kind == "wordpiece":
        cls, sep = hf.token_to_id("[CLS]"), hf.token_to_id("[SEP]")
        hf.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
        tok.eos_id, tok.mask_id = sep, hf.token_to_id("[MASK]")
    else:
        tok.eos_id = hf.token_to_id(EOS)
    tok.hf, tok.vocab = hf, hf.get_vocab_size(with_added_tokens=True)


def _as_text(text: str, replaced: list[int]) -> str:
    """``text`` as a Hugging Face tokenizer can take it: surrogates (bytes that were not UTF-8,
    lone JSON escapes) become U+FFFD, counted in ``replaced[0]``."""
    if _SURROGATE.search(text) is None:
        return text
    replaced[0] += len(_SURROGATE.findall(text))
    return _SURROGATE.sub("\ufffd", text)


def _encode(tok: _Tokenizer, docs: Iterator[Piece]) -> Iterator[list[int] | bytes]:
    """Token ids, one chunk of pieces at a time, each document followed by the eos id."""
    chunk: list[Piece] = []
    size = 0
    for piece in docs:
        chunk.append(piece)
        size += len(piece[0])
        if len(chunk) >= ENCODE_CHUNK_DOCS or size >= ENCODE_CHUNK_BYTES:
            yield _encode_chunk(tok, chunk)
            chunk, size = [], 0
    if chunk:
        yield _encode_chunk(tok, chunk)


def _encode_chunk(tok: _Tokenizer, chunk: list[Piece]) -> list[int] | bytes:
    if tok.hf is None:
        return b"".join(_utf8(text) for text, _ in chunk)
    texts = [text for text, _ in chunk]
    encodings = _off_main_thread(lambda: tok.hf.encode_batch(texts, add_special_tokens=False))
    ids: list[int] = []
    for enc, (_, end) in zip(encodings, chunk):
        ids.extend(enc.ids)
        if end and tok.eos_id is not None:
            ids.append(tok.eos_id)
    return ids


# ----------------------------------------------------------------------------- shards


def _typecode(itemsize: int) -> str:
    return next(code for code in "HILQ" if array(code).itemsize == itemsize)


class _ShardWriter:
    """Appends token ids to ``SPLIT-NNNNN.bin`` files of at most ``shard_tokens`` tokens each,
    hashing them on the way."""

    def __init__(self, folder: Path, split: str, shard_tokens: int, itemsize: int):
        self.folder, self.split, self.limit, self.itemsize = folder, split, shard_tokens, itemsize
        self.typecode = _typecode(itemsize)
        self.entries: list[dict] = []
        self._file = None
        self._hash = None

    def write(self, ids: list[int] | bytes) -> None:
        """Append token ids; ``bytes`` are byte-valued ids (the ``bytes`` tokenizer)."""
        if isinstance(ids, bytes):
            wide = bytearray(len(ids) * self.itemsize)
            wide[:: self.itemsize] = ids  # little-endian: the low byte first, the rest zero
            self.write_raw(wide)
            return
        data = array(self.typecode, ids)
        if sys.byteorder == "big":
            data.byteswap()
        self.write_raw(data.tobytes())

    def write_raw(self, data: bytes | bytearray) -> None:
        """Append little-endian token bytes (a whole number of tokens)."""
        view = memoryview(data)
        while len(view):
            if self._file is None:
                name = f"{self.split}-{len(self.entries):05d}.bin"
                self._file, self._hash = open(self.folder / name, "wb"), hashlib.sha256()
                self.entries.append({"file": name, "tokens": 0, "sha256": ""})
            entry = self.entries[-1]
            take = min(len(view) // self.itemsize, self.limit - entry["tokens"]) * self.itemsize
            self._file.write(view[:take])
            self._hash.update(view[:take])
            entry["tokens"] += take // self.itemsize
            view = view[take:]
            if entry["tokens"] == self.limit:
                self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self.entries[-1]["sha256"] = self._hash.hexdigest()
            self._file = self._hash = None

    def close(self) -> list[dict]:
        self._close()
        return self.entries

    def discard(self) -> None:
        """Close the open shard after a failure, dropping a second error (a full disk's) so that
        the garbage collector does not report it again."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = self._hash = None

    @property
    def tokens(self) -> int:
        return sum(e["tokens"] for e in self.entries)


def _split_off_val(folder: Path, train: list[dict], n_val: int, val: _ShardWriter) -> list[dict]:
    """Move the last ``n_val`` tokens of the train shards into ``val``; the train entries left."""
    itemsize = val.itemsize
    cut = sum(e["tokens"] for e in train) - n_val
    start = 0
    kept = []
    for entry in train:
        path, n = folder / entry["file"], entry["tokens"]
        lo = max(cut - start, 0)
        if lo < n:
            with open(path, "rb") as f:
                f.seek(lo * itemsize)
                while data := f.read(COPY_CHUNK * itemsize):
                    val.write_raw(data)
        if lo == 0:
            path.unlink()
        elif lo < n:
            os.truncate(path, lo * itemsize)
            kept.append({**entry, "tokens": lo, "sha256": file_sha256(path)})
        else:
            kept.append(entry)
        start += n
    return kept


# ----------------------------------------------------------------------------- the command


def _check_options(val_fraction: float, shard_tokens: int, dtype: str | None, max_bytes: int | None,
                   tok: _Tokenizer) -> None:
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


def _why(e: OSError) -> str:
    """An OSError's reason, with its errno's name (ENOSPC, EFBIG, EACCES...)."""
    name = errno.errorcode.get(e.errno or 0)
    return f"{e.strerror or e} ({name})" if name else str(e.strerror or e)


def _remove_folders(folders: list[Path]) -> None:
    """Remove the folders made for ``--out`` (the deepest first) that are still empty."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return


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
        raise DataError("--out", f"cannot read {final}: {_why(e)}") from e
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
        _remove_folders(made)
        raise DataError("--out", f"cannot make a folder in {Path(e.filename or final).parent}: "
                        f"{_why(e)}") from e
    return final, tmp, made


def abandon() -> bool:
    """Remove the temporary folder of every prepare in progress in this process, and the folders
    made for it: for an interrupt handler that then ends the process at once. True when one had
    been renamed into place already (its corpus is complete)."""
    complete = False
    for tmp, (_final, made) in list(_STAGING.items()):
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
            _remove_folders(made)
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
    resolved = _resolve_sources(list(sources))
    tok = _parse_tokenizer(tokenizer)
    _check_options(val_fraction, shard_tokens, dtype, max_bytes, tok)
    final, tmp, made = _staging_folder(out)
    try:
        try:
            manifest = _prepare_into(tmp, resolved, tok, tokenizer, text_key, float(val_fraction),
                                     int(shard_tokens), dtype, max_bytes, dataset_format, log)
        except OSError as e:  # the sources' read errors are DataErrors already: this is --out
            what = f" ({Path(e.filename).name})" if e.filename else ""
            raise DataError("--out", f"cannot write {final}{what}: {_why(e)}; nothing was "
                            "written") from e
        try:  # onto an empty folder, or none; refused if anything appeared there meanwhile
            os.rename(tmp, final)
        except OSError as e:
            raise DataError("--out", f"cannot move the finished corpus into {final}: {_why(e)} (did "
                            "something appear there meanwhile?); nothing was written") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_folders(made)
        raise
    finally:
        _STAGING.pop(tmp, None)
    return manifest


def _count(pattern: re.Pattern, text: str) -> int:
    return 0 if pattern.search(text) is None else len(pattern.findall(text))


def _prepare_into(tmp: Path, resolved, tok: _Tokenizer, spec: str, text_key: str, val_fraction: float,
                  shard_tokens: int, dtype: str | None, max_bytes: int | None,
                  dataset_format: str | None, log: Callable[[str], Any]) -> dict:
    def docs() -> Iterator[Piece]:
        return _documents(resolved, text_key, dataset_format, max_bytes)

    if next(docs(), None) is None:
        names = ", ".join(s for s, _ in resolved)
        raise DataError("sources", f"empty corpus: no text in {names}; give files with text")
    if tok.kind in ("bpe", "wordpiece"):
        _train(tok, (_as_text(text, [0]) for text, _ in docs()))
        log(f"trained a {tok.kind} tokenizer: {tok.vocab} tokens")
    if tok.hf is not None:
        data = tok.raw if tok.raw is not None else tok.hf.to_str(pretty=True).encode("utf-8")
        (tmp / "tokenizer.json").write_bytes(data)
    dtype = _check_dtype(dtype, tok.vocab)

    writer = _ShardWriter(tmp, "train", shard_tokens, ITEMSIZE[dtype])
    n_docs = n_bytes = 0
    replaced = [0]  # characters that a tokenizer could not take as they were: now U+FFFD

    def counted() -> Iterator[Piece]:
        nonlocal n_docs, n_bytes
        for text, end in docs():
            n_docs += end
            n_bytes += len(_utf8(text))
            if tok.hf is not None:
                text = _as_text(text, replaced)
            else:
                replaced[0] += _count(_LONE, text)
            yield text, end

    try:
        for ids in _encode(tok, counted()):
            writer.write(ids)
    except BaseException:
        writer.discard()
        raise
    train = writer.close()
    log(f"read {n_docs} documents, {n_bytes} bytes of text")
    if replaced[0] and tok.hf is not None:
        log(f"sdpipe: warning: {replaced[0]:,} bytes of the sources are not UTF-8 (or are lone "
            f"surrogate escapes): the {tok.kind} tokenizer reads text, so each became U+FFFD; the "
            "bytes tokenizer keeps them")
    elif replaced[0]:
        log(f"sdpipe: warning: {replaced[0]:,} lone surrogate escapes in JSON text (such as "
            "\\ud800, which no UTF-8 bytes spell) became U+FFFD")

    total = writer.tokens
    n_val = int(total * val_fraction)
    if n_val < 1 or total - n_val < 1:
        raise DataError("--val-fraction", f"{total} tokens with --val-fraction {val_fraction} leave an "
                        "empty train or validation split; use more text or another --val-fraction")
    val = _ShardWriter(tmp, "val", shard_tokens, ITEMSIZE[dtype])
    try:
        train = _split_off_val(tmp, train, n_val, val)
    except BaseException:
        val.discard()
        raise
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": {"spec": spec, "kind": tok.kind, "vocab_size": tok.vocab,
                      "file": "tokenizer.json" if tok.hf is not None else None,
                      "eos_id": tok.eos_id, "mask_id": tok.mask_id},
        "dtype": dtype,
        "splits": {"train": train, "val": val.close()},
        "documents": n_docs,
        "sources": [s for s, _ in resolved],
        "text_bytes": n_bytes,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    log(f"wrote {total - n_val} train and {n_val} validation tokens ({dtype}, "
        f"{len(train) + len(manifest['splits']['val'])} shards)")
    return manifest
