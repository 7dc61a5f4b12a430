"""The one place that turns ``data.name`` into data sets: train and validation splits, what was
read, and the shapes a sample has.

Every data set, whichever its origin, ends as a pair of map-style torch ``Dataset``\\ s whose items
are ``(inputs, target)``; the loader does the rest (order, batches, background reading, resume).

The launcher calls :func:`resolve` once, before any process starts: it opens the data (so that a
bad folder, an empty corpus or a corrupt shard is one line and exit 2, with nothing written),
checks a first sample, and records in ``data.resolved`` what was read (paths, sizes, checksums),
the split sizes and a sample's shapes. Workers read that record: a middle stage learns the shapes
it receives without touching the data, and a checkpoint stores the data's fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset

from sdpipe_cli.data.loader import read_sample
from sdpipe_cli.data.sampling import seed_of
from sdpipe_cli.runtime.errors import DataError

__all__ = ["Splits", "check_same", "open_splits", "resolve", "example", "val_count", "workers", "fingerprint",
           "imports", "sampled_digest"]

CORPORA = ("stdlib", "text", "synthetic")
DECODED = ("imagefolder", "cifar10", "custom")  # work per sample worth a background process
DEFAULT_WORKERS = 2
CONTENT = ("sha256", "sample")  # the entries of what was read that stand for its content
SAMPLE_BLOCK, SAMPLE_BLOCKS = 64 * 1024, 16  # a file's content sampled: at most 1 MiB of it
FILES_SAMPLED = 64  # of a data set's files, those whose content is sampled
EVAL_BATCHES_ANY = 4  # validation batches any evaluation may take, even of a smaller split


@dataclass
class Splits:
    """A data set's train and validation splits, and what a run records about it."""

    train: Dataset
    val: Dataset
    classes: int | None = None  # classification: the number of classes
    vocab_size: int | None = None  # token data: the tokenizer's vocabulary
    read: dict[str, Any] = field(default_factory=dict)  # paths, sizes, checksums


def _windows(shards_train, shards_val, cfg: Any, mask_id: int | None, vocab: int) -> tuple:
    from sdpipe_cli.config.schema import objective
    from sdpipe_cli.data.tokens import TokenWindows

    goal, seq = objective(cfg), int(cfg.model.seq_len)
    return tuple(TokenWindows(shards, seq, goal, mask_id, vocab) for shards in (shards_train, shards_val))


def _corpus(cfg: Any) -> Splits:
    from sdpipe_cli.data.corpus import check_corpus, load_corpus

    corpus = load_corpus(cfg.data, cfg.train.seed)
    check_corpus(corpus, int(cfg.model.seq_len))
    # bytes: the mask token is the model's last id, above every byte (the model has >= 257)
    train, val = _windows([corpus.train], [corpus.val], cfg, int(cfg.model.vocab_size) - 1, 256)
    digest = hashlib.sha256(corpus.train.numpy())
    digest.update(corpus.val.numpy())  # the bytes read, in memory already: a full digest is cheap
    read = {"bytes": len(corpus.train) + len(corpus.val), "sha256": digest.hexdigest()[:16]}
    if cfg.data.path:
        read["path"] = str(Path(str(cfg.data.path)).expanduser().resolve())
    return Splits(train, val, read=read)


def _tokens(cfg: Any, verify: bool) -> Splits:
    from sdpipe_cli.data.tokens import MANIFEST, file_sha256, fingerprint as token_fingerprint, open_tokens

    corpus = open_tokens(str(cfg.data.path), verify=verify)
    vocab = corpus.vocab_size
    mask = corpus.mask_id if corpus.mask_id is not None else vocab - 1
    train, val = _windows(corpus.shards("train"), corpus.shards("val"), cfg, mask, vocab)
    read = {"path": str(corpus.root.resolve()), "tokenizer": corpus.manifest["tokenizer"]["spec"],
            "tokens": {s: corpus.tokens(s) for s in ("train", "val")},
            "fingerprint": token_fingerprint(corpus),
            "manifest_sha256": file_sha256(corpus.root / MANIFEST),
            "sample": sampled_digest([corpus.root / e["file"] for s in ("train", "val")
                                      for e in corpus.manifest["splits"][s]], corpus.root)}
    return Splits(train, val, vocab_size=vocab, read=read)


def _normalisation(cfg: Any, mean: tuple, std: tuple) -> tuple[tuple, tuple]:
    d = cfg.data
    mean = tuple(d.mean) if d.mean is not None else tuple(mean)
    std = tuple(d.std) if d.std is not None else tuple(std)
    if len(mean) != len(std):  # one value set beside the data set's three: it stands for each channel
        if min(len(mean), len(std)) != 1:
            raise DataError("data.std", f"has {len(std)} values, data.mean {len(mean)}")
        mean, std = mean * (len(std) if len(mean) == 1 else 1), std * (len(mean) if len(std) == 1 else 1)
    return mean, std


def _native(cfg: Any, side: int) -> int:
    """The side of a fixed-size data set's images: its own (no resizing is offered)."""
    if cfg.data.image_size not in (None, side):
        raise DataError("data.image_size", f"{cfg.data.name} images are {side}x{side}; leave "
                        "data.image_size unset (or use data=imagefolder for other sizes)")
    return side


def _digits(cfg: Any) -> Splits:
    from sdpipe_cli.data import images
    from sdpipe_cli.data.transforms import ImageTransform

    train_x, train_y, val_x, val_y, mean, std = images.load_digits(float(cfg.data.val_fraction),
                                                                   int(cfg.train.seed))
    size = _native(cfg, images.DIGITS_SIZE)
    mean, std = _normalisation(cfg, mean, std)
    train = images.ArrayImages(train_x, train_y, ImageTransform("pad_crop", size, 2, mean, std))
    val = images.ArrayImages(val_x, val_y, ImageTransform("none", size, 0, mean, std))
    return Splits(train, val, classes=images.DIGITS_CLASSES, read={"images": len(train_y) + len(val_y)})


def _cifar10(cfg: Any) -> Splits:
    from sdpipe_cli.data import images
    from sdpipe_cli.data.transforms import ImageTransform

    train_x, train_y, val_x, val_y, classes = images.load_cifar10(str(cfg.data.path))
    size = _native(cfg, 32)
    mean, std = _normalisation(cfg, images.CIFAR10_MEAN, images.CIFAR10_STD)
    train = images.ArrayImages(train_x, train_y, ImageTransform("pad_crop_flip", size, 4, mean, std), classes)
    val = images.ArrayImages(val_x, val_y, ImageTransform("none", size, 0, mean, std), classes)
    root = Path(str(cfg.data.path)).expanduser().resolve()
    batches = [images.cifar10_folder(root) / name
               for name in (*images.CIFAR10_TRAIN_FILES, images.CIFAR10_TEST_FILE)]
    return Splits(train, val, classes=len(classes),
                  read={"path": str(root), "images": {"train": len(train_y), "val": len(val_y)},
                        "sample": sampled_digest(batches, root)})


def _imagefolder(cfg: Any) -> Splits:
    from sdpipe_cli.data import images
    from sdpipe_cli.data.transforms import ImageTransform

    root = str(Path(str(cfg.data.path)).expanduser())
    train_files, val_files, classes = images.index_image_folder(root, float(cfg.data.val_fraction),
                                                                int(cfg.train.seed))
    size = int(cfg.data.image_size or 224)
    mean, std = _normalisation(cfg, images.IMAGENET_MEAN, images.IMAGENET_STD)
    train = images.ImageFolder(train_files, classes, ImageTransform("resized_crop_flip", size, 0, mean, std))
    val = images.ImageFolder(val_files, classes, ImageTransform("resize_center", size, 0, mean, std))
    listing = hashlib.sha256(json.dumps([train_files, val_files]).encode()).hexdigest()[:16]
    every = [Path(f) for f, _ in (*train_files, *val_files)]
    return Splits(train, val, classes=len(classes),
                  read={"path": str(Path(root).resolve()), "classes": len(classes),
                        "images": {"train": len(train_files), "val": len(val_files)}, "listing": listing,
                        "sample": sampled_digest(every, Path(root))})


def _custom(cfg: Any) -> Splits:
    from sdpipe_cli.data.custom import open_custom

    train, val, classes = open_custom(cfg.data, int(cfg.train.seed))
    return Splits(train, val, classes=classes, read={"target": str(getattr(cfg.data, "_target_", None)),
                                                     "samples": {"train": len(train), "val": len(val)}})


# Libraries a data set's reader imports in every worker; the fork server imports them once for all
# (scikit-learn, for the digits, took 3.7 s of CPU per worker). Image folders decode with PIL in
# the loader's own processes, not here.
IMPORTS = {"digits": ["sklearn.datasets"]}


def imports(cfg: Any) -> list[str]:
    """Modules every worker reading ``cfg.data`` imports (those installed: a missing one is the
    reader's to name, in one line)."""
    import importlib.util

    return [name for name in IMPORTS.get(str(cfg.data.name), [])
            if importlib.util.find_spec(name.split(".")[0]) is not None]


def open_splits(cfg: Any, verify: bool = False) -> Splits:
    """The run's data (``verify``: also every token shard's checksum, which the launcher does
    once; workers check sizes only)."""
    name = cfg.data.name
    if name in CORPORA:
        return _corpus(cfg)
    if name == "tokens":
        return _tokens(cfg, verify)
    opener = {"digits": _digits, "cifar10": _cifar10, "imagefolder": _imagefolder, "custom": _custom}
    if name not in opener:
        raise DataError("data.name", f"unknown data set {name!r}")
    return opener[name](cfg)


# ----------------------------------------------------------------------------- the record


def sampled_digest(files: list[Path], root: Path) -> str:
    """A short digest of :data:`FILES_SAMPLED` of ``files`` spread evenly (all of them when
    fewer): each one's name under ``root``, size, and content, whole up to :data:`SAMPLE_BLOCKS` x
    :data:`SAMPLE_BLOCK` bytes, else that many blocks spread evenly (the first and the last among
    them). Data replaced, or edited in place, is noticed at a cost that does not grow with its
    size (at most 64 MiB read and 64 files opened, in every process that opens the data); an
    edit between the blocks, or of a file not sampled, is not (the listing of every name is
    recorded beside it; ``data.verify`` checks token shards whole)."""
    digest = hashlib.sha256()
    for path in files[::-(-len(files) // FILES_SAMPLED)] if files else []:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                digest.update(f"{path.relative_to(root)}\0{size}\0".encode())
                if size <= SAMPLE_BLOCK * SAMPLE_BLOCKS:
                    digest.update(f.read())
                    continue
                for i in range(SAMPLE_BLOCKS):
                    f.seek((size - SAMPLE_BLOCK) * i // (SAMPLE_BLOCKS - 1))
                    digest.update(f.read(SAMPLE_BLOCK))
        except OSError as err:
            raise DataError(str(path), f"cannot read: {err.strerror or err}") from None
    return digest.hexdigest()[:16]


def check_same(splits: Splits, resolved: Any, reader: str, recorded: str) -> bool:
    """``splits`` are what ``data.resolved`` recorded (split sizes, what was read: paths,
    sizes, digests of the content); else a DataError naming ``data.path`` (or ``data``) and
    what differs. Two stages that read different copies would pair inputs with the wrong
    targets, and an evaluation of changed data would score other samples, without any other
    error. False when the record, an older sdpipe's, holds no digest of the content the data
    has now: then only the rest (sizes, counts) was compared."""
    if not resolved:
        return True
    before = resolved["read"]
    unrecorded = [k for k in CONTENT if k in splits.read and k not in before]
    now = {k: v for k, v in splits.read.items() if k not in unrecorded}
    seen = {"train": len(splits.train), "val": len(splits.val), **now}
    then = {"train": resolved["train"], "val": resolved["val"], **before}
    differs = [k for k in {**then, **seen} if seen.get(k) != then.get(k)]
    if differs:
        what = "; ".join(f"{_WORDS.get(k, k)}: {seen.get(k)} here, {then.get(k)} {recorded}"
                         for k in differs)
        path = before.get("path")
        raise DataError("data.path" if path else "data",
                        f"{path + ': ' if path else ''}{reader} reads other data than the run did "
                        f"({what}); every node needs the same copy of the data, unchanged since")
    return not unrecorded


_WORDS = {"train": "training samples", "val": "validation samples",
          "sha256": "its content's SHA-256", "sample": "its files' sizes and sampled content"}


def _spec(value: Any, what: str) -> dict[str, Any]:
    """Shape and dtype of one sample's ``value``: a tensor, a number or an array, or a dict or
    tuple of them (a tokenizer's ``input_ids`` and ``attention_mask``), nested as the value is."""
    if isinstance(value, dict):
        return {"dict": {str(k): _spec(v, f"{what}[{k!r}]") for k, v in value.items()}}
    if isinstance(value, (tuple, list)):
        return {"tuple": [_spec(v, f"{what}[{i}]") for i, v in enumerate(value)]}
    try:
        t = torch.as_tensor(value)
    except (TypeError, RuntimeError, ValueError):
        t = None
    if t is None or isinstance(value, (bool, str, bytes)):
        raise DataError("data", f"a sample's {what} must be tensors or numbers, not {type(value).__name__}")
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def _zeros(spec: dict[str, Any], batch_size: int, device: str = "cpu") -> Any:
    if "dict" in spec:
        return {k: _zeros(v, batch_size, device) for k, v in spec["dict"].items()}
    if "tuple" in spec:
        return tuple(_zeros(v, batch_size, device) for v in spec["tuple"])
    return torch.zeros(batch_size, *spec["shape"], dtype=getattr(torch, spec["dtype"]), device=device)


def resolve(cfg: Any) -> dict[str, Any]:
    """Open the data once and describe it: ``data.resolved`` (see the module's docstring)."""
    splits = open_splits(cfg, verify=bool(cfg.data.verify))
    if len(splits.train) == 0 or len(splits.val) == 0:
        empty = "training" if len(splits.train) == 0 else "validation"
        raise DataError("data.path" if cfg.data.path else "data", f"the {empty} split is empty")
    x, y = read_sample(splits.train, seed_of("probe", int(cfg.train.seed)))
    out = {"train": len(splits.train), "val": len(splits.val),
           "input": _spec(x, "input"), "target": _spec(y, "target"), "read": splits.read}
    if splits.classes is not None:
        out["classes"] = splits.classes
    if splits.vocab_size is not None:
        out["vocab_size"] = splits.vocab_size
    return out


def _resolved(cfg: Any) -> dict[str, Any]:
    return getattr(cfg.data, "resolved", None) or resolve(cfg)


def fingerprint(cfg: Any, content: bool = True) -> str:
    """A short digest of what the run reads: a checkpoint keeps it, a resume compares it.
    ``content=False``: without the digests of the content, as an older sdpipe recorded it (a
    checkpoint of one is compared by sizes alone, and says nothing false)."""
    given = _resolved(cfg)["read"]
    # as a config node, also when read from the typed settings: its nested values are written by
    # their ``str`` (the digest every checkpoint so far holds), a plain dict's as JSON
    node = given if OmegaConf.is_config(given) else OmegaConf.create(given)
    read = {k: v for k, v in node.items() if content or k not in CONTENT}
    return hashlib.sha256(json.dumps(read, sort_keys=True, default=str).encode()).hexdigest()[:16]


def example(cfg: Any, batch_size: int, device: str = "cpu") -> tuple[Any, Any]:
    """An input and target batch of the run's shapes and dtypes (zeros), from the record: what
    every stage infers the pipeline's boundaries from without reading data. On ``device="meta"``
    it has shapes and no memory: what the launcher's checks use, so that a batch too large to
    fit is refused by the memory check instead of being allocated first."""
    r = _resolved(cfg)
    return _zeros(r["input"], batch_size, device), _zeros(r["target"], batch_size, device)


def val_count(cfg: Any) -> int:
    """Validation batches per evaluation: ``data.eval_batches``, or every full batch.

    More batches than it takes to read the validation split once would only read it again
    (the batches start over at its end), for as long as the count says: a billion of them is a
    worker that evaluates for days. Such a count is bad input, unless it is small
    (:data:`EVAL_BATCHES_ANY`, the default's 4, which may well repeat a small split)."""
    size, batch = int(_resolved(cfg)["val"]), int(cfg.train.batch_size)
    if cfg.data.eval_batches is not None:
        count, once = int(cfg.data.eval_batches), -(-size // batch)
        if count > max(once, EVAL_BATCHES_ANY):
            raise DataError("data.eval_batches", f"is {count}, but {once} batch(es) of "
                            f"train.batch_size={batch} read all {size} validation samples; use at "
                            f"most {max(once, EVAL_BATCHES_ANY)} (null: every full batch)")
        return count
    full = size // batch
    if full < 1:
        raise DataError("data.val_fraction", f"the validation split has {size} samples, "
                        f"fewer than one batch of train.batch_size={cfg.train.batch_size}")
    return full


def workers(cfg: Any) -> int:
    """Background reading processes per reading stage (``data.num_workers``, or the default:
    none for data in memory or memory-mapped, where a batch costs microseconds)."""
    if cfg.data.num_workers is not None:
        return int(cfg.data.num_workers)
    return min(DEFAULT_WORKERS, os.cpu_count() or 1) if cfg.data.name in DECODED else 0
