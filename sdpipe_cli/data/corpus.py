"""Byte corpora: text read as bytes (vocabulary 256, no tokenizer), for the smallest runs.

A corpus is a 1-D ``uint8`` tensor of bytes, split into a train head and a validation tail; the
loader cuts it into windows like any token stream (:class:`~sdpipe_cli.data.tokens.TokenWindows`).
Three sources, none of which needs a download:

* ``stdlib``: the ``.py`` sources of the running Python's standard library, real text that exists
  on every install;
* ``text``: a user's file, or every file under a folder;
* ``synthetic``: a random sparse Markov chain over a small alphabet, learnable well below
  ln 256, for fast tests.

Problems are reported as :class:`DataError`, one line naming the key or file, so the CLI can print
it and exit 2.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sdpipe_cli.runtime.errors import DataError  # noqa: F401 - raised here, caught by callers

SYNTHETIC_MAX_BYTES = 1_000_000
SYNTHETIC_ALPHABET = 32  # distinct bytes used by the synthetic corpus
SYNTHETIC_SUCCESSOR_PROBS = (0.6, 0.25, 0.1, 0.05)  # chance of each state's k-th successor
STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
)


@dataclass
class Corpus:
    """Train and validation bytes, both 1-D ``uint8`` tensors."""

    train: torch.Tensor
    val: torch.Tensor


# ----------------------------------------------------------------------------- loading


def load_corpus(data_cfg: Any, seed: int) -> Corpus:
    """Read or generate the corpus named by ``data_cfg.name``, capped at ``data_cfg.max_bytes``."""
    max_bytes = int(data_cfg.max_bytes)
    if max_bytes <= 0:
        raise DataError("data.max_bytes", f"must be positive, got {max_bytes}")
    if data_cfg.name == "stdlib":
        data = _stdlib_bytes(max_bytes)
    elif data_cfg.name == "text":
        data = _text_bytes(data_cfg.path, max_bytes)
    elif data_cfg.name == "synthetic":
        data = _synthetic_bytes(min(max_bytes, SYNTHETIC_MAX_BYTES), seed)
    else:
        raise DataError(
            "data.name", f"unknown dataset {data_cfg.name!r}; choose stdlib, text or synthetic"
        )
    return _split(data, float(data_cfg.val_fraction))


def _to_tensor(data: bytearray) -> torch.Tensor:
    """Wrap (not copy) the bytes; the tensor keeps the buffer alive."""
    return torch.frombuffer(data, dtype=torch.uint8)


def _split(data: torch.Tensor, val_fraction: float) -> Corpus:
    """The last ``val_fraction`` of the bytes is validation: deterministic and never trained on."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(
            "data.val_fraction", f"must be between 0 and 1 (exclusive), got {val_fraction}"
        )
    n_val = int(len(data) * val_fraction)
    return Corpus(train=data[: len(data) - n_val], val=data[len(data) - n_val :])


def sorted_files(root: Path, skip_dirs: frozenset[str] = frozenset()) -> Iterator[Path]:
    """Regular files under ``root`` in a fixed order (sorted names, depth first)."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip_dirs)
        for name in sorted(files):
            path = Path(folder) / name
            if path.is_file():
                yield path


def _read_capped(paths: Iterator[Path], max_bytes: int, *, skip_unreadable: bool) -> bytearray:
    """Concatenate files until ``max_bytes``; unreadable files are skipped or reported."""
    out = bytearray()
    for path in paths:
        if len(out) >= max_bytes:
            break
        try:
            with open(path, "rb") as f:
                out += f.read(max_bytes - len(out))
        except OSError as e:
            if not skip_unreadable:
                raise DataError(str(path), f"cannot read file: {e.strerror or e}") from e
    return out


def _stdlib_bytes(max_bytes: int) -> torch.Tensor:
    """The standard library's own ``.py`` sources, in sorted order, without its tests."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = (p for p in sorted_files(root, STDLIB_SKIP_DIRS) if p.suffix == ".py")
    data = _read_capped(sources, max_bytes, skip_unreadable=True)
    if not data:
        raise DataError(
            "data.name", f"no .py sources found under {root}; use data=text or data=synthetic"
        )
    return _to_tensor(data)


def _text_bytes(path: str | None, max_bytes: int) -> torch.Tensor:
    """A file, or every regular file under a folder, as bytes."""
    if not path:
        raise DataError("data.path", "data=text needs a file or folder: set data.path=/some/text")
    root = Path(os.path.expanduser(str(path)))
    if root.is_dir():
        files = list(sorted_files(root))
        if not files:
            raise DataError("data.path", f"folder {root} contains no files")
    elif root.exists():
        files = [root]
    else:
        raise DataError("data.path", f"{root} does not exist")
    data = _read_capped(iter(files), max_bytes, skip_unreadable=False)
    if not data:
        raise DataError("data.path", f"corpus at {root} is empty (0 bytes)")
    return _to_tensor(data)


def _synthetic_bytes(n: int, seed: int) -> torch.Tensor:
    """A sparse first-order Markov chain: each of 32 printable bytes has 4 possible successors.

    Its entropy is about 1 nat per byte, so a model that learns it gets far below ln 256, and
    even the attention-free ``mlp`` model can, since one byte of context suffices.
    """
    g = torch.Generator().manual_seed(int(seed))
    alphabet = (32 + torch.randperm(127 - 32, generator=g)[:SYNTHETIC_ALPHABET]).tolist()
    k = len(SYNTHETIC_SUCCESSOR_PROBS)
    # successors[s * k + j]: state index of the j-th possible successor of state s
    successors = torch.cat(
        [torch.randperm(SYNTHETIC_ALPHABET, generator=g)[:k] for _ in alphabet]
    ).tolist()
    choices = torch.multinomial(
        torch.tensor(SYNTHETIC_SUCCESSOR_PROBS), n, replacement=True, generator=g
    )
    return _to_tensor(_walk(alphabet, successors, choices))


WALK_RUN = 4  # choices walked per step of :func:`_walk`


def _walk(alphabet: list[int], successors: list[int], choices: torch.Tensor) -> bytearray:
    """The chain's bytes from state 0, each choice taking the current state's ``choice``-th
    successor.

    Every process that reads the data makes the corpus (the launcher, each worker): one Python
    step per byte cost about 80 ms a million bytes here, the largest part of a small worker's
    start. So the walk goes :data:`WALK_RUN` choices a step, through a table of every state's
    every run of choices (the run's bytes, the state after it), built by doubling from one
    choice: 34 ms, the same bytes.
    """
    k, states = len(successors) // len(alphabet), len(alphabet)
    emit = [bytes([alphabet[successors[i]]]) for i in range(states * k)]
    after = list(successors)
    width, runs = 1, k
    while width < WALK_RUN:  # runs twice as long, each a run and another from where it ends
        longer_emit, longer_after = [], []
        for i in range(states * runs):
            head, base = emit[i], after[i] * runs
            for j in range(base, base + runs):
                longer_emit.append(head + emit[j])
                longer_after.append(after[j])
        emit, after, width, runs = longer_emit, longer_after, width * 2, runs * runs
    whole = len(choices) - len(choices) % width
    codes = (choices[:whole].view(-1, width) * k ** torch.arange(width - 1, -1, -1)).sum(1)
    parts, state = [], 0
    for code in codes.tolist():
        i = state * runs + code
        parts.append(emit[i])
        state = after[i]
    out = bytearray(b"".join(parts))
    for choice in choices[whole:].tolist():
        state = successors[state * k + choice]
        out.append(alphabet[state])
    return out


def check_corpus(corpus: Corpus, seq_len: int) -> None:
    """Fail early when either split cannot hold one sample of ``seq_len + 1`` bytes."""
    need = int(seq_len) + 1
    for split, data in (("train", corpus.train), ("validation", corpus.val)):
        if len(data) < need:
            raise DataError(
                "data",
                f"corpus too small: the {split} split has {len(data)} bytes but one sample needs "
                f"seq_len + 1 = {need}; use more data (data.max_bytes, a bigger data.path) or a "
                "smaller model.seq_len",
            )
