"""Image datasets: a folder of class folders, CIFAR-10's python batches, and scikit-learn's digits.

Every dataset is map-style: ``dataset[i]`` is ``(image, label)``, the image already transformed
(an :class:`~sdpipe_cli.data.transforms.ImageTransform` or any callable), and ``describe(i)``
names the sample for messages. A file that cannot be decoded raises from ``__getitem__``; the
loader, not the dataset, decides what to do about it (substitute, count, report the file).

Only local files are read, nothing is downloaded. Bad input is a :class:`DataError` naming the
config key or file at fault. CIFAR-10's batches are pickles, and unpickling can run code, so they
are read by an unpickler that only rebuilds numpy arrays.

``data=digits`` is the 8x8 digits that ship inside scikit-learn (1797 real scans, 10 classes): a
real image task that needs no download, upscaled to 3x32x32 so CIFAR-style networks take it.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from sdpipe_cli.runtime.errors import DataError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck")
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
CIFAR10_SUBDIR = "cifar-10-batches-py"  # the folder cifar-10-python.tar.gz extracts to
CIFAR10_PIXELS = 3 * 32 * 32

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp"})

DIGITS_SIZE = 32  # pixels per side after upscaling
DIGITS_CHANNELS = 3
DIGITS_CLASSES = 10
DIGITS_COUNT = 1797  # images in scikit-learn's copy (checked when loaded)

Transform = Callable[[torch.Tensor], torch.Tensor]
Samples = list[tuple[str, int]]


# ----------------------------------------------------------------------------- image folders


class ImageFolder(Dataset):
    """Image files and their labels (as listed by :func:`index_image_folder`), decoded with pillow
    to RGB uint8 CHW and passed through ``transform``."""

    def __init__(self, samples: Samples, classes: list[str], transform: Transform | None = None):
        self.samples = list(samples)
        self.classes = list(classes)
        self.targets = [label for _, label in self.samples]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[i]
        img = decode_image(path)
        return (self.transform(img) if self.transform is not None else img), label

    def describe(self, i: int) -> str:
        """The file of sample ``i``."""
        return self.samples[i][0]

    def target(self, i: int) -> int:
        """Sample ``i``'s label without decoding its file (what the last stage needs)."""
        return self.targets[i]


def decode_image(path: str) -> torch.Tensor:
    """The image file at ``path`` as an RGB uint8 ``(3, H, W)`` tensor.

    Raises OSError (unreadable), ``PIL.UnidentifiedImageError`` (not an image) or ValueError
    (an image too large to be trusted, which pillow refuses as a decompression bomb).
    """
    from PIL import Image  # the images extra: only image folders need it

    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB")
    except Image.DecompressionBombError as err:
        raise ValueError(f"{path}: {err}") from err
    w, h = rgb.size
    return torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1)


def _hidden(name: str) -> bool:
    return name.startswith(".")


def _class_folders(split_dir: str) -> list[str]:
    return sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not _hidden(e.name))


def _image_files(class_dir: str) -> list[str]:
    """Image files under ``class_dir``, at any depth, in sorted (deterministic) order."""
    found = []
    for folder, dirs, files in os.walk(class_dir, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not _hidden(d))
        found += [os.path.join(folder, f) for f in sorted(files)
                  if not _hidden(f) and os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS]
    return found


def _index_split(split_dir: str, classes: list[str]) -> dict[str, list[str]]:
    """Each class's image files under ``split_dir/CLASS`` (no folder: no files)."""
    out = {}
    for name in classes:
        class_dir = os.path.join(split_dir, name)
        out[name] = _image_files(class_dir) if os.path.isdir(class_dir) else []
    return out


def _hold_out(files: list[str], split_dir: str, val_fraction: float,
              seed: int) -> tuple[list[str], list[str]]:
    """``files`` split into (train, val): val is the ``floor(n * val_fraction)`` files (at most
    n - 1) of smallest seeded hash of their path under ``split_dir``, so a file's split depends
    neither on the other files nor on where the folder lives."""
    n_val = min(len(files) - 1, int(len(files) * val_fraction))
    if n_val <= 0:
        return files, []

    def rank(path: str) -> bytes:
        return hashlib.sha256(f"{seed}\0{os.path.relpath(path, split_dir)}".encode()).digest()

    val = set(sorted(files, key=rank)[:n_val])
    return [f for f in files if f not in val], [f for f in files if f in val]


def index_image_folder(root: str, val_fraction: float, seed: int) -> tuple[Samples, Samples, list[str]]:
    """The (train files, val files, class names) of an image folder; labels index the sorted
    class names.

    Layout ``ROOT/CLASS/**/IMAGE``, with a seeded ``val_fraction`` of every class held out for
    validation (every class keeps at least one training image); or ``ROOT/train/CLASS/...`` and
    ``ROOT/val/CLASS/...``, used as they are (classes come from ``train/``; without ``val/``,
    ``val_fraction`` of ``train/`` is held out).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError("data.val_fraction", f"must be in [0, 1), got {val_fraction}")
    if not os.path.exists(root):
        raise DataError("data.path", f"{root} does not exist; point data.path at a folder laid out "
                                     "as DIR/CLASS/IMAGE")
    if not os.path.isdir(root):
        raise DataError("data.path", f"{root} is not a folder; image data is read from a folder laid "
                                     "out as DIR/CLASS/IMAGE")
    train_dir, val_dir = os.path.join(root, "train"), os.path.join(root, "val")
    presplit = os.path.isdir(train_dir)
    if not presplit:
        train_dir = root
    classes = _class_folders(train_dir)
    if not classes:
        raise DataError("data.path", f"{train_dir} has no class folders; expected the layout "
                                     "DIR/CLASS/IMAGE (one sub-folder of images per class)")
    files = _index_split(train_dir, classes)
    empty = [name for name in classes if not files[name]]
    if len(empty) == len(classes):
        raise DataError("data.path", f"no image files in the class folders of {train_dir}; expected "
                                     f"DIR/CLASS/IMAGE with extensions {', '.join(sorted(IMAGE_EXTENSIONS))}")
    if empty:
        raise DataError("data.path", f"class folders without images under {train_dir}: "
                                     f"{', '.join(empty[:5])}{' ...' if len(empty) > 5 else ''}; "
                                     "add images or remove the folders")
    label = {name: i for i, name in enumerate(classes)}
    train: Samples = []
    val: Samples = []
    if presplit and os.path.isdir(val_dir):
        unknown = [name for name in _class_folders(val_dir) if name not in label]
        if unknown:
            raise DataError("data.path", f"{val_dir} has classes missing from {train_dir}: "
                                         f"{', '.join(unknown[:5])}; every val class needs train images")
        val_files = _index_split(val_dir, classes)
        for name in classes:
            train += [(f, label[name]) for f in files[name]]
            val += [(f, label[name]) for f in val_files[name]]
    else:
        for name in classes:
            kept, held = _hold_out(files[name], train_dir, val_fraction, seed)
            train += [(f, label[name]) for f in kept]
            val += [(f, label[name]) for f in held]
    return train, val, classes


# ----------------------------------------------------------------------------- in-memory images


class ArrayImages(Dataset):
    """Images held in memory, ``(N, C, H, W)`` uint8 or float, with labels ``(N,)``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Transform | None,
                 classes: list[str] | None = None):
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = labels
        self.transform = transform
        self.classes = list(classes) if classes is not None else None
        self.targets = [int(y) for y in labels.tolist()]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img = self.images[i]
        return (self.transform(img) if self.transform is not None else img), self.targets[i]

    def describe(self, i: int) -> str:
        """Sample ``i`` by position (in-memory images have no file)."""
        return f"image {i}"

    def target(self, i: int) -> int:
        """Sample ``i``'s label without transforming its image."""
        return self.targets[i]


# ----------------------------------------------------------------------------- CIFAR-10


class _ArrayUnpickler(pickle.Unpickler):
    """Rebuilds dicts, lists, bytes, strings, numbers and numpy arrays, and nothing else: any other
    global a pickle names (a function it would call) is refused, so a hostile file cannot run code."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): ("multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"): ("multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"): ("multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"): ("multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"): ("numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"): ("numeric", "_frombuffer"),
        ("numpy", "ndarray"): ("", "ndarray"),
        ("numpy", "dtype"): ("", "dtype"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_codecs", "encode"):  # how Python 3 writes bytes in protocols < 3
            import codecs
            return codecs.encode
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a CIFAR batch holds only "
                                         "arrays, lists, bytes and numbers")
        submodule, attr = self.ALLOWED[(module, name)]
        if not submodule:
            return getattr(importlib.import_module("numpy"), attr)
        try:  # numpy 2 renamed numpy.core to numpy._core (the old name still imports, with a warning)
            return getattr(importlib.import_module(f"numpy._core.{submodule}"), attr)
        except (ImportError, AttributeError):
            return getattr(importlib.import_module(f"numpy.core.{submodule}"), attr)


def _unpickle(path: Path) -> Any:
    """The object in the pickle at ``path``, written by Python 2 (strings come back as bytes)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DataError(str(path), f"cannot read file: {err.strerror or err}") from err
    try:
        return _ArrayUnpickler(io.BytesIO(data), encoding="bytes").load()
    except Exception as err:  # any failure to rebuild is a file that is not what it claims to be
        raise DataError(str(path), f"not a CIFAR-10 python batch ({type(err).__name__}: {err}); "
                                   "re-extract cifar-10-python.tar.gz") from None


def _read_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``(N, 3, 32, 32)`` uint8 and labels ``(N,)`` int64 of one CIFAR-10 batch file."""
    import numpy

    batch = _unpickle(path)
    data = batch.get(b"data") if isinstance(batch, dict) else None
    labels = batch.get(b"labels") if isinstance(batch, dict) else None
    if not (isinstance(data, numpy.ndarray) and data.dtype == numpy.uint8 and data.ndim == 2
            and data.shape[1] == CIFAR10_PIXELS and isinstance(labels, list) and len(labels) == len(data)
            and all(isinstance(y, int) and 0 <= y < len(CIFAR10_CLASSES) for y in labels)):
        raise DataError(str(path), "not a CIFAR-10 python batch (expected a dict with b'data', "
                                   f"N x {CIFAR10_PIXELS} uint8, and N b'labels' in 0..9); "
                                   "re-extract cifar-10-python.tar.gz")
    images = torch.from_numpy(numpy.ascontiguousarray(data)).view(-1, 3, 32, 32)
    return images, torch.tensor(labels, dtype=torch.int64)


def _cifar_classes(folder: Path) -> list[str]:
    meta_path = folder / "batches.meta"
    if not meta_path.is_file():
        return list(CIFAR10_CLASSES)
    meta = _unpickle(meta_path)
    names = meta.get(b"label_names") if isinstance(meta, dict) else None
    if not (isinstance(names, list) and len(names) == len(CIFAR10_CLASSES)
            and all(isinstance(n, (bytes, str)) for n in names)):
        raise DataError(str(meta_path), f"expected b'label_names', a list of {len(CIFAR10_CLASSES)} "
                                        "names; re-extract cifar-10-python.tar.gz")
    return [n.decode() if isinstance(n, bytes) else n for n in names]


def cifar10_folder(root: Path) -> Path:
    """The folder of CIFAR-10's batches: ``root``, or the one the archive extracts to in it."""
    return root / CIFAR10_SUBDIR if (root / CIFAR10_SUBDIR).is_dir() else root


def load_cifar10(root: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """CIFAR-10 from its python batches on disk: train images ``(50000, 3, 32, 32)`` uint8, train
    labels int64, test images ``(10000, 3, 32, 32)``, test labels, and the class names.

    ``root`` holds ``data_batch_1`` .. ``data_batch_5`` and ``test_batch`` (and optionally
    ``batches.meta``), directly or in ``cifar-10-batches-py/``.
    """
    if not Path(root).is_dir():
        raise DataError("data.path", f"{root} is not a folder; download and extract "
                                     "cifar-10-python.tar.gz and point data.path at it")
    folder = cifar10_folder(Path(root))
    for name in (*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE):
        if not (folder / name).is_file():
            raise DataError("data.path", f"{folder} has no {name}; expected DIR/data_batch_1..5 and "
                                         f"DIR/{CIFAR10_TEST_FILE} (or DIR/{CIFAR10_SUBDIR}/...), as "
                                         "cifar-10-python.tar.gz extracts")
    train = [_read_batch(folder / name) for name in CIFAR10_TRAIN_FILES]
    test_x, test_y = _read_batch(folder / CIFAR10_TEST_FILE)
    train_x = torch.cat([x for x, _ in train])
    train_y = torch.cat([y for _, y in train])
    return train_x, train_y, test_x, test_y, _cifar_classes(folder)


# ----------------------------------------------------------------------------- digits


class DigitsSplits(NamedTuple):
    """Digits as float images in [0, 1] ``(N, 3, 32, 32)``, int64 labels, and the train split's
    per-channel mean and std (the normalisation to give the transform)."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]


def load_digits(val_fraction: float, seed: int) -> DigitsSplits:
    """scikit-learn's digits as 3x32x32 images, ``val_fraction`` held out by a permutation of
    ``seed``."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError("data.val_fraction", f"must be in [0, 1), got {val_fraction}")
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise DataError("data.name", "digits needs scikit-learn: pip install -e '.[digits]'") from None
    digits = sklearn_digits()
    if len(digits.target) != DIGITS_COUNT:
        raise DataError("data.name", f"scikit-learn's digits hold {len(digits.target)} images, "
                        f"not {DIGITS_COUNT}; this version of scikit-learn is not supported")
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    x = F.interpolate(x, size=(DIGITS_SIZE, DIGITS_SIZE), mode="bilinear", align_corners=False)
    x = x.expand(-1, DIGITS_CHANNELS, -1, -1)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(int(seed)))
    n_val = int(len(y) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    train_x = x[train]
    mean = tuple(float(v) for v in train_x.mean(dim=(0, 2, 3)))
    std = tuple(float(v) for v in train_x.std(dim=(0, 2, 3)))
    return DigitsSplits(train_x, y[train], x[val], y[val], mean, std)
