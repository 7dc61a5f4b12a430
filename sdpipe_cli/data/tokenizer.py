"""The tokenizer of ``sdpipe prepare text``: ``--tokenizer`` checked and loaded, trained, and used
to turn document pieces into token ids.

``bytes`` takes each byte as its id (vocabulary 256, no end-of-text token); ``bpe:VOCAB`` (GPT-2's
byte-level BPE) and ``wordpiece:VOCAB`` (BERT uncased) are trained with Hugging Face
``tokenizers`` from an iterator over the documents; a ``tokenizer.json`` path is loaded as it is.
A Hugging Face tokenizer reads text, so there surrogates (bytes that were not UTF-8) become U+FFFD
(:func:`as_text`, which counts them). Pieces are encoded one chunk at a time, each document
followed by the end-of-text id.

Tokenizer calls, which cannot be interrupted, run in a worker thread, so that an interrupt handler
runs at once in the main thread (:func:`_off_main_thread`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdpipe_cli.data.documents import Piece, open_source, utf8
from sdpipe_cli.runtime.errors import DataError

EOS = "<|endoftext|>"
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
EOS_NAMES = (EOS, "</s>", "<eos>", "<|eos|>", "[SEP]")  # looked up in a tokenizer.json, in order
MASK_NAMES = ("[MASK]", "<mask>", "<|mask|>")
ENCODE_CHUNK_DOCS = 1024
ENCODE_CHUNK_BYTES = 4 << 20  # characters of text per encode_batch call (at most one piece more)
MAX_VOCAB = 1 << 24  # bpe:/wordpiece: sizes above this are refused (the trainers allocate per token)
WAIT_S = 0.1  # how often the main thread wakes while a tokenizer call runs

_SURROGATE = re.compile("[\ud800-\udfff]")  # not text: bytes that were not UTF-8, lone escapes


@dataclass
class TextTokenizer:
    """``--tokenizer`` as parsed: its kind and vocabulary, and once loaded or trained the Hugging
    Face tokenizer with its end-of-text and mask ids."""

    kind: str  # bytes | bpe | wordpiece | file
    vocab: int  # requested (bpe, wordpiece) or actual size
    path: Path | None = None
    hf: Any = None  # a tokenizers.Tokenizer once built
    eos_id: int | None = None
    mask_id: int | None = None
    raw: bytes | None = None  # a tokenizer.json file's bytes, copied as they are


def parse_tokenizer(spec: str) -> TextTokenizer:
    """Check ``--tokenizer`` before any text is read; a file is loaded here. A vocabulary size
    must lie between the smallest that holds the special tokens and :data:`MAX_VOCAB` (the
    trainers allocate for every token up front: 5e9 would abort the process)."""
    if spec == "bytes":
        return TextTokenizer("bytes", 256)
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
        return TextTokenizer(kind, n)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.exists() or path.is_dir():
        raise DataError("--tokenizer", f"{spec!r} is neither bytes, bpe:VOCAB, wordpiece:VOCAB nor an "
                        "existing tokenizer.json file")
    with open_source(path, "--tokenizer") as f:
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
    return TextTokenizer("file", hf.get_vocab_size(with_added_tokens=True), path=path, hf=hf,
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


def train_tokenizer(tok: TextTokenizer, docs: Iterator[str]) -> None:
    """Train a ``bpe`` (GPT-2's byte-level BPE) or ``wordpiece`` (BERT uncased) tokenizer from
    texts of at most :data:`PIECE_CHARS` characters (its memory grows with the longest)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    trainer: trainers.Trainer
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


def as_text(text: str, replaced: list[int]) -> str:
    """``text`` as a Hugging Face tokenizer can take it: surrogates (bytes that were not UTF-8,
    lone JSON escapes) become U+FFFD, counted in ``replaced[0]``."""
    if _SURROGATE.search(text) is None:
        return text
    replaced[0] += len(_SURROGATE.findall(text))
    return _SURROGATE.sub("\ufffd", text)


def encode(tok: TextTokenizer, docs: Iterator[Piece]) -> Iterator[list[int] | bytes]:
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


def _encode_chunk(tok: TextTokenizer, chunk: list[Piece]) -> list[int] | bytes:
    if tok.hf is None:
        return b"".join(utf8(text) for text, _ in chunk)
    texts = [text for text, _ in chunk]
    encodings = _off_main_thread(lambda: tok.hf.encode_batch(texts, add_special_tokens=False))
    ids: list[int] = []
    for enc, (_, end) in zip(encodings, chunk):
        ids.extend(enc.ids)
        if end and tok.eos_id is not None:
            ids.append(tok.eos_id)
    return ids

