"""Reading tokenized corpora: the folder ``sdpipe prepare text`` writes, checked before training.

A corpus that is too big for memory must still start training at once and cost each process only
the pages it reads, so every shard is memory-mapped (``torch.from_file``) and a sample slices its
window out before converting it. What is mapped must also be what was prepared: ``open_tokens``
checks the manifest, every shard's size and (by default) its SHA-256, so a truncated copy or a
changed file fails in one line naming the file instead of training on garbage, and
:func:`fingerprint` lets a checkpoint notice that its data changed under it.

Layout of a corpus folder (see ``sdpipe_cli.data.prepare``)::

    manifest.json       format, tokenizer, dtype, and per split the shards with tokens and sha256
    tokenizer.json      the Hugging Face tokenizer (absent for the ``bytes`` tokenizer)
    train-00000.bin     raw little-endian token ids, ``dtype`` each
    val-00000.bin
"""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

from sdpipe_cli.runtime.errors import DataError

MANIFEST = "manifest.json"
FORMAT = "sdpipe-tokens"
VERSION = 1
SPLITS = ("train", "val")
DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}
ITEMSIZE = {"uint16": 2, "uint32": 4}
HASH_CHUNK = 1 << 20
MLM_PROBABILITY = 0.15  # BERT: the share of positions predicted, of which 80 % masked, 10 % random
KEY = "data.path"


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class TokenCorpus:
    """A checked corpus folder: its manifest, and its shards opened on demand."""

    root: Path
    manifest: dict

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int | None:
        return self.manifest["tokenizer"].get("eos_id")

    @property
    def mask_id(self) -> int | None:
        return self.manifest["tokenizer"].get("mask_id")

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.manifest["dtype"]]

    @property
    def tokenizer_file(self) -> Path | None:
        """The saved Hugging Face tokenizer, or None for the ``bytes`` tokenizer."""
        name = self.manifest["tokenizer"].get("file")
        return self.root / name if name else None

    def _entries(self, split: str) -> list[dict]:
        if split not in self.manifest["splits"]:
            raise ValueError(f"unknown split {split!r}; the corpus has {sorted(self.manifest['splits'])}")
        return self.manifest["splits"][split]

    def shards(self, split: str) -> list[torch.Tensor]:
        """The split's shards as 1-D tensors mapped from their files: pages are read when indexed."""
        out = []
        for entry in self._entries(split):
            n = int(entry["tokens"])
            if n == 0:
                out.append(torch.empty(0, dtype=self.dtype))
            else:
                out.append(torch.from_file(str(self.root / entry["file"]), shared=False, size=n,
                                           dtype=self.dtype))
        return out

    def tokens(self, split: str) -> int:
        """Total tokens of a split."""
        return sum(int(entry["tokens"]) for entry in self._entries(split))


def _read_manifest(root: Path) -> dict:
    path = root / MANIFEST
    if not path.is_file():
        raise DataError(KEY, f"{root} has no {MANIFEST}; make one with: sdpipe prepare text SRC --out DIR")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(KEY, f"{path} is not readable JSON ({e}); re-run sdpipe prepare") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(KEY, f"{path} is not an {FORMAT} manifest; make one with: sdpipe prepare text")
    if manifest.get("version") != VERSION:
        raise DataError(KEY, f"{path} has version {manifest.get('version')!r}, this sdpipe reads "
                        f"version {VERSION}; re-run sdpipe prepare")
    _check_shape(manifest, path)
    return manifest


def _check_shape(manifest: dict, path: Path) -> None:
    """The fields every reader relies on exist and have the right types."""
    problem = None
    tok, splits = manifest.get("tokenizer"), manifest.get("splits")
    if manifest.get("dtype") not in DTYPES:
        problem = f"dtype {manifest.get('dtype')!r} is not one of {', '.join(DTYPES)}"
    elif not isinstance(tok, dict) or not isinstance(tok.get("vocab_size"), int) or tok["vocab_size"] < 1:
        problem = "tokenizer.vocab_size is missing or not a positive integer"
    elif not isinstance(splits, dict) or any(not isinstance(splits.get(s), list) for s in SPLITS):
        problem = f"splits must list the shards of {' and '.join(SPLITS)}"
    else:
        for split in SPLITS:
            for entry in splits[split]:
                if not (isinstance(entry, dict) and isinstance(entry.get("file"), str)
                        and Path(entry["file"]).name == entry["file"]
                        and isinstance(entry.get("tokens"), int) and entry["tokens"] >= 0
                        and isinstance(entry.get("sha256"), str)):
                    problem = f"a {split} shard entry is malformed: {entry!r}"
                    break
    if problem:
        raise DataError(KEY, f"{path}: {problem}; re-run sdpipe prepare")


def open_tokens(path: str, verify: bool = True) -> TokenCorpus:
    """Open and check a prepared corpus folder; ``verify`` also compares every shard's SHA-256.

    Every problem is a :class:`DataError` keyed ``data.path`` that names the file at fault.
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(KEY, f"{root} does not exist; make one with: sdpipe prepare text SRC --out DIR")
    if not root.is_dir():
        raise DataError(KEY, f"{root} is not a folder; give the folder sdpipe prepare wrote (--out)")
    manifest = _read_manifest(root)
    dtype_name = manifest["dtype"]
    vocab = manifest["tokenizer"]["vocab_size"]
    if vocab > 2 ** (8 * ITEMSIZE[dtype_name]):
        raise DataError(KEY, f"{root / MANIFEST}: vocab_size {vocab} does not fit {dtype_name}; "
                        "re-run sdpipe prepare with --dtype uint32")
    for split in SPLITS:
        if sum(entry["tokens"] for entry in manifest["splits"][split]) == 0:
            raise DataError(KEY, f"{root / MANIFEST}: the {split} split has 0 tokens; re-run sdpipe "
                            "prepare with more text or another --val-fraction")
    for split in SPLITS:
        for entry in manifest["splits"][split]:
            _check_shard(root / entry["file"], entry, ITEMSIZE[dtype_name], verify)
    return TokenCorpus(root=root, manifest=manifest)


def _check_shard(file: Path, entry: dict, itemsize: int, verify: bool) -> None:
    if not file.is_file():
        raise DataError(KEY, f"shard {file} is missing; copy the whole folder or re-run sdpipe prepare")
    want = entry["tokens"] * itemsize
    size = file.stat().st_size
    if size != want:
        raise DataError(KEY, f"shard {file} has {size} bytes, the manifest says {entry['tokens']} tokens "
                        f"= {want} bytes; the copy is incomplete or changed, re-run sdpipe prepare")
    if verify and file_sha256(file) != entry["sha256"]:
        raise DataError(KEY, f"shard {file} does not match its SHA-256 in {MANIFEST}: the data is corrupt "
                        "or changed since sdpipe prepare; copy it again or re-run sdpipe prepare")


def fingerprint(corpus: TokenCorpus) -> str:
    """A short stable digest of the shards' checksums and the tokenizer: what a checkpoint records
    to notice that the data it trained on changed. How the tokenizer was named (its spec and kind)
    and where the folder lies are left out: the same tokens moved, or made again with the saved
    ``tokenizer.json``, keep the fingerprint."""
    m = corpus.manifest
    tok = m["tokenizer"]
    content: dict[str, Any] = {
        "tokenizer": {k: tok.get(k) for k in ("vocab_size", "eos_id", "mask_id")},
        "dtype": m["dtype"],
        "splits": {s: [[e["tokens"], e["sha256"]] for e in m["splits"][s]] for s in SPLITS},
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def mask_tokens(tokens: torch.Tensor, mask_id: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masked-LM inputs and targets from ``tokens``.

    15 % of the positions are predicted (target: the token there; elsewhere -100, which the loss
    ignores); of those, 80 % become ``mask_id``, 10 % a random token in ``[0, vocab)`` and 10 %
    stay as they are. Draws from torch's global RNG: the loader seeds it per sample, which makes
    a sample's masking reproducible.
    """
    chosen = torch.rand(tokens.shape) < MLM_PROBABILITY
    fate = torch.rand(tokens.shape)
    randoms = torch.randint(0, vocab, tokens.shape, dtype=tokens.dtype)
    inputs = torch.where(chosen & (fate < 0.8), torch.full_like(tokens, mask_id), tokens)
    inputs = torch.where(chosen & (fate >= 0.8) & (fate < 0.9), randoms, inputs)
    return inputs, torch.where(chosen, tokens, torch.full_like(tokens, -100))


class TokenWindows(torch.utils.data.Dataset):
    """Samples of ``seq_len`` tokens cut from shards: window ``i`` is ``seq_len + 1`` consecutive
    tokens of one shard, windows start every ``seq_len`` tokens (neighbours share one token, so
    every token but a shard's first is a target once), never cross a shard, and a shard's tail
    shorter than a window is dropped.

    ``clm`` gives ``(window[:-1], window[1:])``; ``mlm`` gives :func:`mask_tokens` of
    ``window[:-1]`` with ``mask_id`` (default ``vocab_size - 1``). Both int64 of shape (seq_len,).
    """

    def __init__(self, shards: list[torch.Tensor], seq_len: int, objective: str = "clm",
                 mask_id: int | None = None, vocab_size: int = 256):
        if objective not in ("clm", "mlm"):
            raise ValueError(f"objective must be clm or mlm, got {objective!r}")
        if int(seq_len) < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.shards = list(shards)
        self.seq_len = int(seq_len)
        self.objective = objective
        self.vocab_size = int(vocab_size)
        self.mask_id = int(mask_id) if mask_id is not None else self.vocab_size - 1
        counts = [max(0, (len(s) - 1) // self.seq_len) for s in self.shards]
        self._ends = list(accumulate(counts))
        if not self._ends or self._ends[-1] == 0:
            longest = max((len(s) for s in self.shards), default=0)
            raise DataError("data", f"every shard has fewer than seq_len + 1 = {self.seq_len + 1} tokens "
                            f"(the longest has {longest}); use more data or a smaller model.seq_len")

    def __len__(self) -> int:
        return self._ends[-1]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"window {i} out of range for {n} windows")
        shard = bisect_right(self._ends, i)
        start = (i - (self._ends[shard - 1] if shard else 0)) * self.seq_len
        window = self.shards[shard][start:start + self.seq_len + 1].to(torch.int64)
        if len(window) and not 0 <= int(window.min()) <= int(window.max()) < self.vocab_size:
            # what the manifest's checksums would have caught (data.verify=false, or a manifest
            # whose vocabulary was changed): an embedding would fail far from the data's name
            bad = int(window.max()) if int(window.max()) >= self.vocab_size else int(window.min())
            raise DataError(KEY, f"shard {shard} holds token id {bad}, outside the vocabulary "
                            f"(0..{self.vocab_size - 1}): the shards do not match their manifest; "
                            "check them with data.verify=true, or re-run sdpipe prepare")
        if self.objective == "mlm":
            return mask_tokens(window[:-1], self.mask_id, self.vocab_size)
        return window[:-1], window[1:]
