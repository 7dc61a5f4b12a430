"""Byte-level language-modelling data: corpora, pipeline shards and reproducible batches.

A corpus is a 1-D ``uint8`` tensor of bytes (vocabulary 256, no tokenizer), split into a train
head and a validation tail. Three sources, none of which needs a download:

* ``stdlib``: the ``.py`` sources of the running Python's standard library, real text that exists
  on every install;
* ``text``: a user's file, or every file under a folder;
* ``synthetic``: a random sparse Markov chain over a small alphabet, learnable well below
  ln 256, for fast tests.

Each pipeline trains on its own disjoint contiguous shard of the train split. A batch depends only
on ``(seed, shard, index)``, so the data position of a run is just the iteration number (resuming
needs no sampler state) and every process that asks for the same batch (the first stage, which
needs the inputs, and the last, which needs the targets) gets the same bytes without talking.

Problems are reported as :class:`DataError`, one line naming the key or file, so the CLI can print
it and exit 2.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

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


def _sorted_files(root: Path, skip_dirs: frozenset[str] = frozenset()) -> Iterator[Path]:
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
    sources = (p for p in _sorted_files(root, STDLIB_SKIP_DIRS) if p.suffix == ".py")
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
        files = list(_sorted_files(root))
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
    ).tolist()
    state, out = 0, bytearray(n)
    for t, choice in enumerate(choices):
        state = successors[state * k + choice]
        out[t] = alphabet[state]
    return _to_tensor(out)


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


# ----------------------------------------------------------------------------- batches


def _seed_of(*parts: object) -> int:
    """A 63-bit generator seed from the parts, identical in every process and on every run."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def shard_bounds(n: int, shard: int, num_shards: int) -> tuple[int, int]:
    """``[start, end)`` of shard ``shard`` of ``n`` bytes cut into ``num_shards`` equal parts.

    The remainder (fewer than ``num_shards`` bytes) is dropped so that every pipeline sees as much
    data as every other.
    """
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in range for {num_shards} shards")
    size = n // num_shards
    return shard * size, (shard + 1) * size


def _windows(
    data: torch.Tensor, starts: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets, int64 (B, seq_len), from windows of seq_len + 1 bytes."""
    idx = starts[:, None] + torch.arange(seq_len + 1)
    window = data[idx].long()
    return window[:, :-1], window[:, 1:]


def train_batch(
    corpus: Corpus,
    shard: int,
    num_shards: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``index``-th training batch of pipeline ``shard``: random windows inside its shard."""
    start, end = shard_bounds(len(corpus.train), shard, num_shards)
    if end - start < seq_len + 1:
        key = "cluster.pipelines" if num_shards > 1 else "data"
        raise DataError(
            key,
            f"each of the {num_shards} training shards has {end - start} bytes, fewer than "
            f"seq_len + 1 = {seq_len + 1}; use more data (data.max_bytes) or fewer pipelines",
        )
    g = torch.Generator().manual_seed(_seed_of("train", seed, shard, index))
    starts = start + torch.randint(0, end - start - seq_len, (batch_size,), generator=g)
    return _windows(corpus.train, starts, seq_len)


def val_batches(
    corpus: Corpus, count: int, batch_size: int, seq_len: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` fixed validation batches, the same for every pipeline, so losses are comparable."""
    check_corpus(corpus, seq_len)
    g = torch.Generator().manual_seed(_seed_of("val", seed))
    high = len(corpus.val) - seq_len
    return [
        _windows(corpus.val, torch.randint(0, high, (batch_size,), generator=g), seq_len)
        for _ in range(count)
    ]


# ----------------------------------------------------------------------------- what a run reads

MLM_PROBABILITY = 0.15  # BERT: the share of tokens predicted, of which 80 % masked, 10 % random


def mask_tokens(tokens: torch.Tensor, g: torch.Generator, mask_id: int, vocab: int = 256
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masked-LM inputs and targets from ``tokens``: 15 % of the positions are predicted
    (target: the token; elsewhere -100, ignored by the loss); of those, 80 % become ``mask_id``,
    10 % a random token below ``vocab`` and 10 % stay as they are."""
    chosen = torch.rand(tokens.shape, generator=g) < MLM_PROBABILITY
    fate = torch.rand(tokens.shape, generator=g)
    randoms = torch.randint(0, vocab, tokens.shape, generator=g)
    inputs = torch.where(chosen & (fate < 0.8), torch.full_like(tokens, mask_id), tokens)
    inputs = torch.where(chosen & (fate >= 0.8) & (fate < 0.9), randoms, inputs)
    return inputs, torch.where(chosen, tokens, torch.full_like(tokens, -100))


class TokenSource:
    """Batches of a byte corpus: next-byte windows (``clm``), or BERT's masked windows (``mlm``,
    the mask token is ``vocab_size - 1``, drawn from the batch's own generator)."""

    def __init__(self, corpus: Corpus, seq_len: int, objective: str, vocab_size: int):
        check_corpus(corpus, seq_len)
        self.corpus, self.seq_len, self.objective = corpus, int(seq_len), objective
        self.mask_id = int(vocab_size) - 1

    def _shape(self, batch: tuple[torch.Tensor, torch.Tensor], *key: object
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.objective != "mlm":
            return batch
        return mask_tokens(batch[0], torch.Generator().manual_seed(_seed_of("mlm", *key)), self.mask_id)

    def train_batch(self, shard: int, num_shards: int, batch_size: int, seed: int, index: int):
        batch = train_batch(self.corpus, shard, num_shards, batch_size, self.seq_len, seed, index)
        return self._shape(batch, seed, shard, index)

    def val_batches(self, count: int, batch_size: int, seed: int):
        return [self._shape(b, "val", seed, i) for i, b in
                enumerate(val_batches(self.corpus, count, batch_size, self.seq_len, seed))]


class ImageSource:
    """Batches of labelled images: each pipeline samples from its own shard of the train split,
    randomly cropped; evaluation reads every full batch of the validation split."""

    def __init__(self, images):
        self.images = images

    def train_batch(self, shard: int, num_shards: int, batch_size: int, seed: int, index: int):
        from sdpipe_cli.model.images import random_crop

        start, end = shard_bounds(len(self.images.train_y), shard, num_shards)
        if end - start < 1:
            raise DataError("cluster.pipelines", f"{num_shards} pipelines share "
                            f"{len(self.images.train_y)} training images; use fewer pipelines")
        g = torch.Generator().manual_seed(_seed_of("train", seed, shard, index))
        picks = start + torch.randint(0, end - start, (batch_size,), generator=g)
        return random_crop(self.images.train_x[picks], g), self.images.train_y[picks]

    def val_batches(self, count: int, batch_size: int, seed: int):
        n = len(self.images.val_y) // batch_size
        if n < 1:
            raise DataError("data.val_fraction", f"the validation split has {len(self.images.val_y)} "
                            f"images, fewer than one batch of train.batch_size={batch_size}")
        return [(self.images.val_x[i * batch_size:(i + 1) * batch_size],
                 self.images.val_y[i * batch_size:(i + 1) * batch_size]) for i in range(n)]


def open_source(cfg: Any):
    """The run's data, read or generated, ready to give batches (first and last stages only)."""
    from sdpipe_cli.config.schema import objective

    if cfg.data.name == "digits":
        from sdpipe_cli.model.images import load_digits

        return ImageSource(load_digits(float(cfg.data.val_fraction), int(cfg.train.seed)))
    return TokenSource(load_corpus(cfg.data, cfg.train.seed), cfg.model.seq_len, objective(cfg),
                       cfg.model.vocab_size)


def val_count(cfg: Any) -> int:
    """Validation batches per evaluation, known to every stage without reading the data:
    ``data.eval_batches`` of a corpus; every full batch of an image set's validation split."""
    if cfg.data.name == "digits":
        from sdpipe_cli.model.images import DIGITS_COUNT

        return max(1, int(DIGITS_COUNT * float(cfg.data.val_fraction)) // int(cfg.train.batch_size))
    return int(cfg.data.eval_batches)


def example(cfg: Any, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An input and target batch of the run's shapes and dtypes (zeros), without reading data:
    what every stage infers the pipeline's boundaries from."""
    if cfg.data.name == "digits":
        from sdpipe_cli.model import images

        return (torch.zeros(batch_size, images.CHANNELS, images.SIZE, images.SIZE),
                torch.zeros(batch_size, dtype=torch.int64))
    tokens = torch.zeros(batch_size, int(cfg.model.seq_len), dtype=torch.int64)
    return tokens, tokens.clone()
