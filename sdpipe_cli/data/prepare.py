"""Writing tokenized corpora (``sdpipe prepare text``): text in, token shards and a manifest out.

Tokenizing is done once, ahead of training, so that a run starts at once and every process only
maps the shards it reads (``sdpipe_cli.data.tokens``). Documents are streamed: a tokenizer is
trained from an iterator over them, and the token ids of one chunk of documents at a time are
encoded and appended to the current shard, so memory stays flat whatever the corpus size. The
validation split is the stream's tail, unknown until the end: it is copied out of the last train
shards, which are then truncated.

Everything is written into a temporary folder beside ``--out`` and renamed into place at the end,
so a failure (always a one-line :class:`DataError` for bad input) never leaves half a corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import sys
import sysconfig
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
ENCODE_CHUNK_BYTES = 4 << 20
COPY_CHUNK = 1 << 20
JSON_SUFFIXES = (".jsonl", ".json")


# ----------------------------------------------------------------------------- documents


def _resolve_sources(sources: list[str]) -> list[tuple[str, list[Path] | None]]:
    """Each source with its files (None for ``stdlib``), failing early on a missing one."""
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
            raise DataError(source, "no such file or folder")
    return out


def _stdlib_files() -> Iterator[Path]:
    """The standard library's ``.py`` sources, in ``corpus._stdlib_bytes``'s order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return (p for p in sorted_files(root, STDLIB_SKIP_DIRS) if p.suffix == ".py")


def _text_file(path: Path, *, skip_unreadable: bool = False) -> Iterator[str]:
    """A whole file as one document; binary files (with a NUL byte) are skipped."""
    try:
        data = path.read_bytes()
    except OSError as e:
        if skip_unreadable:
            return
        raise DataError(str(path), f"cannot read file: {e.strerror or e}") from e
    if b"\0" not in data:
        yield data.decode("utf-8", errors="replace")


def _json_lines(path: Path, text_key: str) -> Iterator[str]:
    """One document per line of a JSON-lines file: the string under ``text_key``."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(where, f"not JSON ({e.msg}); a {path.suffix} source must hold one JSON "
                                "object per line") from e
            if not isinstance(row, dict) or text_key not in row:
                raise DataError(where, f"no {text_key!r} field; name the text field with --text-key")
            if not isinstance(row[text_key], str):
                raise DataError(where, f"field {text_key!r} is {type(row[text_key]).__name__}, not text")
            yield row[text_key]


def _parquet_rows(path: Path, text_key: str) -> Iterator[str]:
    """One document per row of a Parquet file's ``text_key`` column (nulls are empty)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(str(path), "reading .parquet needs pyarrow: pip install pyarrow") from e
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise DataError(str(path), f"not a readable Parquet file: {str(e).splitlines()[0]}") from e
    names = table.schema_arrow.names
    if text_key not in names:
        raise DataError(str(path), f"no column {text_key!r} (columns: {', '.join(names)}); "
                        "choose one with --text-key")
    for batch in table.iter_batches(columns=[text_key], batch_size=1024):
        for value in batch.column(0).to_pylist():
            if value is not None and not isinstance(value, str):
                raise DataError(str(path), f"column {text_key!r} holds {type(value).__name__}, not text")
            yield value or ""


def _hf_rows(sources: list[str], dataset_format: str, text_key: str) -> Iterator[str]:
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
            yield value if isinstance(value, str) else ""


def _raw_documents(resolved, text_key: str, dataset_format: str | None) -> Iterator[str]:
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


def _documents(resolved, text_key: str, dataset_format: str | None, max_bytes: int | None
               ) -> Iterator[str]:
    """Non-empty documents, stopping once ``max_bytes`` UTF-8 bytes were given (the last document
    is cut there, at a character boundary), so every pass over them sees the same text."""
    left = max_bytes
    for doc in _raw_documents(resolved, text_key, dataset_format):
        if not doc:
            continue
        if left is not None:
            data = doc.encode("utf-8")
            if len(data) >= left:
                doc = data[:left].decode("utf-8", errors="ignore")
                if doc:
                    yield doc
                return
            left -= len(data)
        yield doc


# ----------------------------------------------------------------------------- tokenizers


@dataclass
class _Tokenizer:
    kind: str  # bytes | bpe | wordpiece | file
    vocab: int  # requested (bpe, wordpiece) or actual size
    path: Path | None = None
    hf: Any = None  # a tokenizers.Tokenizer once built
    eos_id: int | None = None
    mask_id: int | None = None


def _parse_tokenizer(spec: str) -> _Tokenizer:
    """Check ``--tokenizer`` before any text is read; a file is loaded here."""
    if spec == "bytes":
        return _Tokenizer("bytes", 256)
    kind, sep, vocab = spec.partition(":")
    if sep and kind in ("bpe", "wordpiece"):
        try:
            n = int(vocab)
        except ValueError:
            raise DataError("--tokenizer", f"{spec!r}: the vocabulary size must be an integer, "
                            f"as in {kind}:32000") from None
        least = 257 if kind == "bpe" else len(BERT_SPECIALS) + 1
        if n < least:
            why = "256 bytes + <|endoftext|>" if kind == "bpe" else "5 special tokens + 1"
            raise DataError("--tokenizer", f"{spec!r}: the vocabulary must be at least {least} ({why})")
        return _Tokenizer(kind, n)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError("--tokenizer", f"{spec!r} is neither bytes, bpe:VOCAB, wordpiece:VOCAB nor an "
                        "existing tokenizer.json file")
    from tokenizers import Tokenizer

    try:
        hf = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a bad file
        raise DataError("--tokenizer", f"cannot load {path} as a tokenizer.json: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    return _Tokenizer("file", hf.get_vocab_size(with_added_tokens=True), path=path, hf=hf,
                      eos_id=_first_id(hf, EOS_NAMES), mask_id=_first_id(hf, MASK_NAMES))


def _first_id(hf, names: Iterable[str]) -> int | None:
    for name in names:
        token_id = hf.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def _train(tok: _Tokenizer, docs: Iterator[str]) -> None:
    """Train a ``bpe`` (GPT-2's byte-level BPE) or ``wordpiece`` (BERT uncased) tokenizer."""
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
    hf.train_from_iterator(docs, trainer=trainer)
    if tok.kind == "wordpiece":
        cls, sep = hf.token_to_id("[CLS]"), hf.token_to_id("[SEP]")
        hf.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
        tok.eos_id, tok.mask_id = sep, hf.token_to_id("[MASK]")
    else:
        tok.eos_id = hf.token_to_id(EOS)
    tok.hf, tok.vocab = hf, hf.get_vocab_size(with_added_tokens=True)


def _encode(tok: _Tokenizer, docs: Iterator[str]) -> Iterator[list[int] | bytes]:
    """Token ids, one chunk of documents at a time, each document followed by the eos id."""
    chunk: list[str] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if len(chunk) >= ENCODE_CHUNK_DOCS or size >= ENCODE_CHUNK_BYTES:
            yield _encode_chunk(tok, chunk)
            chunk, size = [], 0
    if chunk:
        yield _encode_chunk(tok, chunk)


def _encode_chunk(tok: _Tokenizer, chunk: list[str]) -> list[int] | bytes:
    if tok.hf is None:
        return "".join(chunk).encode("utf-8")
    ids: list[int] = []
    for enc in tok.hf.encode_batch(chunk, add_special_tokens=False):
        ids.extend(enc.ids)
        if tok.eos_id is not None:
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


def _staging_folder(out: str) -> tuple[Path, Path]:
    """The final folder, refused when it holds anything, and a fresh temporary folder beside it."""
    final = Path(out).expanduser().absolute()
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise DataError("--out", f"{final} already exists and is not an empty folder; choose a new one "
                        "or remove it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    tmp.mkdir()  # not mkdtemp: the corpus gets the usual permissions, not 0700
    return final, tmp


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
    """
    resolved = _resolve_sources(list(sources))
    tok = _parse_tokenizer(tokenizer)
    _check_options(val_fraction, shard_tokens, dtype, max_bytes, tok)
    final, tmp = _staging_folder(out)
    try:
        manifest = _prepare_into(tmp, resolved, tok, tokenizer, text_key, float(val_fraction),
                                 int(shard_tokens), dtype, max_bytes, dataset_format, log)
        if final.exists():
            final.rmdir()  # empty, checked above
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _prepare_into(tmp: Path, resolved, tok: _Tokenizer, spec: str, text_key: str, val_fraction: float,
                  shard_tokens: int, dtype: str | None, max_bytes: int | None,
                  dataset_format: str | None, log: Callable[[str], Any]) -> dict:
    def docs() -> Iterator[str]:
        return _documents(resolved, text_key, dataset_format, max_bytes)

    if next(docs(), None) is None:
        names = ", ".join(s for s, _ in resolved)
        raise DataError("sources", f"empty corpus: no text in {names}; give files with text")
    if tok.kind in ("bpe", "wordpiece"):
        _train(tok, docs())
        log(f"trained a {tok.kind} tokenizer: {tok.vocab} tokens")
    if tok.hf is not None:
        if tok.kind == "file":
            shutil.copyfile(tok.path, tmp / "tokenizer.json")
        else:
            tok.hf.save(str(tmp / "tokenizer.json"))
    dtype = _check_dtype(dtype, tok.vocab)

    writer = _ShardWriter(tmp, "train", shard_tokens, ITEMSIZE[dtype])
    n_docs = n_bytes = 0

    def counted() -> Iterator[str]:
        nonlocal n_docs, n_bytes
        for doc in docs():
            n_docs += 1
            n_bytes += len(doc.encode("utf-8"))
            yield doc

    for ids in _encode(tok, counted()):
        writer.write(ids)
    train = writer.close()
    log(f"read {n_docs} documents, {n_bytes} bytes of text")

    total = writer.tokens
    n_val = int(total * val_fraction)
    if n_val < 1 or total - n_val < 1:
        raise DataError("--val-fraction", f"{total} tokens with --val-fraction {val_fraction} leave an "
                        "empty train or validation split; use more text or another --val-fraction")
    val = _ShardWriter(tmp, "val", shard_tokens, ITEMSIZE[dtype])
    train = _split_off_val(tmp, train, n_val, val)
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
