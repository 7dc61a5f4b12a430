"""Writing token shards for ``sdpipe prepare text``: ids appended to ``SPLIT-NNNNN.bin`` files,
hashed on the way, and the validation split moved out of the train shards' tail.

The shards are the little-endian arrays of ids that ``sdpipe_cli.data.tokens`` maps; the entries
returned (file, tokens, sha256) go into the manifest. The validation split is the token stream's
tail, unknown until the end: it is copied out of the last train shards, which are then truncated.
"""

from __future__ import annotations

import hashlib
import os
import sys
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from sdpipe_cli.data.documents import COPY_CHUNK
from sdpipe_cli.data.tokens import file_sha256

if TYPE_CHECKING:
    from _hashlib import HASH


def _typecode(itemsize: int) -> str:
    return next(code for code in "HILQ" if array(code).itemsize == itemsize)


class ShardWriter:
    """Appends token ids to ``SPLIT-NNNNN.bin`` files of at most ``shard_tokens`` tokens each,
    hashing them on the way."""

    def __init__(self, folder: Path, split: str, shard_tokens: int, itemsize: int):
        self.folder, self.split, self.limit, self.itemsize = folder, split, shard_tokens, itemsize
        self.typecode = _typecode(itemsize)
        self.entries: list[dict] = []
        self._open: tuple[BinaryIO, HASH] | None = None  # the shard being written, its hash so far

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
            if self._open is None:
                name = f"{self.split}-{len(self.entries):05d}.bin"
                self._open = open(self.folder / name, "wb"), hashlib.sha256()
                self.entries.append({"file": name, "tokens": 0, "sha256": ""})
            entry = self.entries[-1]
            take = min(len(view) // self.itemsize, self.limit - entry["tokens"]) * self.itemsize
            file, digest = self._open
            file.write(view[:take])
            digest.update(view[:take])
            entry["tokens"] += take // self.itemsize
            view = view[take:]
            if entry["tokens"] == self.limit:
                self._close()

    def _close(self) -> None:
        if self._open is not None:
            file, digest = self._open
            file.close()
            self.entries[-1]["sha256"] = digest.hexdigest()
            self._open = None

    def close(self) -> list[dict]:
        self._close()
        return self.entries

    def discard(self) -> None:
        """Close the open shard after a failure, dropping a second error (a full disk's) so that
        the garbage collector does not report it again."""
        if self._open is not None:
            try:
                self._open[0].close()
            except OSError:
                pass
            self._open = None

    @property
    def tokens(self) -> int:
        return sum(e["tokens"] for e in self.entries)


def split_off_val(folder: Path, train: list[dict], n_val: int, val: ShardWriter) -> list[dict]:
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
