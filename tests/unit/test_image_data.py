"""Image transforms on tensors, and the image datasets: folders, CIFAR-10 batches, digits."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, UnidentifiedImageError

from sdpipe_cli.data import transforms as T
from sdpipe_cli.data.images import (
    CIFAR10_CLASSES,
    DIGITS_COUNT,
    ArrayImages,
    ImageFolder,
    index_image_folder,
    load_cifar10,
    load_digits,
)
from sdpipe_cli.runtime.errors import DataError

# ----------------------------------------------------------------------------- transforms


def ramp(c: int = 3, h: int = 6, w: int = 8) -> torch.Tensor:
    return torch.arange(c * h * w, dtype=torch.float32).reshape(c, h, w)


def test_to_float_scales_uint8_and_normalize_is_per_channel():
    img = torch.tensor([0, 51, 255], dtype=torch.uint8).view(3, 1, 1)
    x = T.to_float(img)
    assert x.dtype == torch.float32 and torch.allclose(x.flatten(), torch.tensor([0.0, 0.2, 1.0]))
    assert torch.equal(T.to_float(x), x)
    y = T.normalize(torch.ones(3, 2, 2), (0.5, 1.0, 0.0), (0.5, 1.0, 2.0))
    assert torch.allclose(y[:, 0, 0], torch.tensor([1.0, 0.0, 0.5]))
    assert torch.allclose(T.normalize(torch.ones(3, 2, 2), (1.0,), (2.0,)), torch.zeros(3, 2, 2))


def test_pad_crop_is_a_window_of_the_padded_image_and_pad_0_is_identity():
    sq = ramp(h=6, w=6)
    assert torch.equal(T.pad_crop(sq, 6, pad=0), sq)
    padded = torch.nn.functional.pad(sq, (2, 2, 2, 2))
    windows = set()
    for s in range(30):
        torch.manual_seed(s)
        c = T.pad_crop(sq, 6, pad=2)
        assert c.shape == (3, 6, 6)
        hits = [(dy, dx) for dy in range(5) for dx in range(5)
                if torch.equal(c, padded[:, dy:dy + 6, dx:dx + 6])]
        assert hits
        windows.add(hits[0])
    assert len(windows) > 5
    assert T.pad_crop(torch.ones(3, 2, 2), 8, pad=1).shape == (3, 8, 8)  # too small: padded further


def test_random_transforms_repeat_under_the_same_global_seed():
    x = ramp(h=20, w=30)
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append((T.pad_crop(x, 16, 4), T.hflip_random(x), T.random_resized_crop(x, 12)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_hflip_random_flips_or_keeps():
    x = ramp()
    assert torch.equal(T.hflip_random(x, p=1.0), x.flip(-1))
    assert torch.equal(T.hflip_random(x, p=0.0), x)
    seen = set()
    for s in range(20):
        torch.manual_seed(s)
        seen.add(torch.equal(T.hflip_random(x), x))
    assert seen == {True, False}


def test_random_resized_crop_has_the_size_and_stays_within_the_image():
    x = torch.rand(3, 40, 60)
    for s in range(20):
        torch.manual_seed(s)
        top, left, h, w = T._resized_crop_box(40, 60, (0.08, 1.0), (3 / 4, 4 / 3))
        assert 0 <= top and top + h <= 40 and 0 <= left and left + w <= 60 and h > 0 and w > 0
        torch.manual_seed(s)
        y = T.random_resized_crop(x, 16)
        assert y.shape == (3, 16, 16) and y.min() >= 0 and y.max() <= 1
    # an impossible scale falls back to the centre crop with the ratio clamped
    assert T._resized_crop_box(10, 40, (2.0, 3.0), (1.0, 1.0)) == (0, 15, 10, 10)
    u8 = T.random_resized_crop(torch.full((3, 30, 30), 200, dtype=torch.uint8), 8)
    assert u8.dtype == torch.uint8 and torch.all(u8 == 200)


def test_resize_center_crop_keeps_the_centre_of_a_known_pattern():
    x = torch.zeros(1, 8, 12)
    x[:, 2:6, 4:8] = 1.0  # a 4x4 square in the middle
    assert torch.equal(T.resize_center_crop(x, 4, resize=8), torch.ones(1, 4, 4))
    assert torch.equal(T.center_crop(x, 4), torch.ones(1, 4, 4))
    y = T.resize_center_crop(torch.rand(3, 300, 400), 224)
    assert y.shape == (3, 224, 224)
    wide = T.resize_center_crop(torch.rand(3, 50, 100), 20, resize=25)
    assert wide.shape == (3, 20, 20)


def test_image_transform_recipes_are_picklable_and_normalised():
    img = torch.randint(0, 256, (3, 40, 50), dtype=torch.uint8)
    for kind, shape in [("resized_crop_flip", (3, 24, 24)), ("pad_crop_flip", (3, 24, 24)),
                        ("pad_crop", (3, 24, 24)), ("resize_center", (3, 24, 24)), ("none", (3, 40, 50))]:
        t = T.ImageTransform(kind, 24, mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25])
        t2 = pickle.loads(pickle.dumps(t))
        assert t2 == t
        torch.manual_seed(0)
        a = t(img)
        torch.manual_seed(0)
        b = t2(img)
        assert a.shape == shape and a.dtype == torch.float32 and torch.equal(a, b)
    plain = T.ImageTransform("none", 0, mean=(0.5,), std=(0.5,))
    assert torch.allclose(plain(img), (img.float() / 255 - 0.5) / 0.5)
    assert torch.equal(plain(img.float() / 255), plain(img))  # float input is not rescaled
    with pytest.raises(ValueError, match="unknown image transform"):
        T.ImageTransform("rotate", 24)


# ----------------------------------------------------------------------------- image folders


def write_png(path: Path, value: int, size=(6, 5)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value, 255 - value, 7)).save(path)


def make_folder(root: Path, counts: dict[str, int]) -> None:
    for c, (name, n) in enumerate(counts.items()):
        for i in range(n):
            write_png(root / name / ("sub" if i % 3 == 0 else "") / f"img{i:02d}.png", 10 * c + i)


def per_class(samples: list[tuple[str, int]], label: int) -> list[str]:
    return [p for p, y in samples if y == label]


def test_index_image_folder_is_sorted_deterministic_and_holds_out_per_class(tmp_path):
    make_folder(tmp_path, {"cat": 10, "ant": 7, "bee": 1})
    (tmp_path / "ant" / "notes.txt").write_text("not an image")
    write_png(tmp_path / "ant" / ".hidden" / "x.png", 0)
    write_png(tmp_path / ".git" / "x.png", 0)
    (tmp_path / "bee" / "UPPER.JPG").parent.mkdir(exist_ok=True)
    Image.new("RGB", (4, 4)).save(tmp_path / "bee" / "UPPER.JPG", format="JPEG")

    train, val, classes = index_image_folder(str(tmp_path), 0.3, seed=0)
    assert classes == ["ant", "bee", "cat"]
    assert [len(per_class(val, k)) for k in range(3)] == [2, 0, 3]  # floor(n * 0.3) of 7, 2 and 10
    assert [len(per_class(train, k)) for k in range(3)] == [5, 2, 7]
    paths = [p for p, _ in train + val]
    assert all(".hidden" not in p and ".git" not in p and p.endswith((".png", ".JPG")) for p in paths)
    assert not {p for p, _ in train} & {p for p, _ in val}
    assert index_image_folder(str(tmp_path), 0.3, seed=0) == (train, val, classes)
    assert index_image_folder(str(tmp_path), 0.3, seed=1)[1] != val
    assert [p for p, _ in train] == sorted(p for p, _ in train)
    all_train, no_val, _ = index_image_folder(str(tmp_path), 0.0, seed=0)
    assert no_val == [] and len(all_train) == 19
    # a single image per class stays in train whatever the fraction
    assert len(per_class(index_image_folder(str(tmp_path), 0.9, seed=0)[0], 1)) == 1


def test_train_val_layout_is_used_as_it_is(tmp_path):
    make_folder(tmp_path / "train", {"a": 3, "b": 2})
    make_folder(tmp_path / "val", {"a": 1, "b": 2})
    train, val, classes = index_image_folder(str(tmp_path), 0.5, seed=0)
    assert classes == ["a", "b"] and len(train) == 5 and len(val) == 3
    assert all(f"{os.sep}train{os.sep}" in p for p, _ in train)
    assert [y for _, y in val] == [0, 1, 1]
    write_png(tmp_path / "val" / "zebra" / "z.png", 1)
    with pytest.raises(DataError, match="zebra") as err:
        index_image_folder(str(tmp_path), 0.5, seed=0)
    assert err.value.key == "data.path"


def test_image_folder_decodes_rgb_and_a_bad_file_raises_and_is_named(tmp_path):
    make_folder(tmp_path, {"a": 2, "b": 2})
    (tmp_path / "b" / "broken.png").write_bytes(b"this is not a png")
    Image.new("L", (6, 5), 9).save(tmp_path / "a" / "gray.png")
    train, _, classes = index_image_folder(str(tmp_path), 0.0, seed=0)
    plain = ImageFolder(train, classes)
    assert plain.classes == ["a", "b"] and plain.targets == [0, 0, 0, 1, 1, 1]
    img, label = plain[0]
    assert img.dtype == torch.uint8 and img.shape == (3, 5, 6) and label == 0
    gray = next(i for i, (p, _) in enumerate(train) if p.endswith("gray.png"))
    assert torch.all(plain[gray][0] == 9)
    first = next(i for i, (p, _) in enumerate(train) if p.endswith("img01.png"))
    assert plain[first][0][:, 0, 0].tolist() == [1, 254, 7]  # (value, 255 - value, 7) of image 1 of a
    ds = ImageFolder(train, classes, T.ImageTransform("pad_crop_flip", 4, pad=1))
    assert ds[0][0].shape == (3, 4, 4) and ds[0][0].dtype == torch.float32
    bad = next(i for i, (p, _) in enumerate(train) if p.endswith("broken.png"))
    with pytest.raises(UnidentifiedImageError):
        ds[bad]
    assert ds.describe(bad) == str(tmp_path / "b" / "broken.png")


@pytest.mark.parametrize("case", ["missing", "file", "no_classes", "empty_classes", "one_empty"])
def test_bad_image_folders_are_data_errors_on_data_path(tmp_path, case):
    root = tmp_path / "data"
    if case == "file":
        root.write_text("x")
    elif case == "no_classes":
        write_png(root / "loose.png", 1)
    elif case == "empty_classes":
        (root / "a").mkdir(parents=True)
        (root / "b").mkdir()
        (root / "b" / "readme.txt").write_text("x")
    elif case == "one_empty":
        make_folder(root, {"a": 2})
        (root / "b").mkdir()
    with pytest.raises(DataError) as err:
        index_image_folder(str(root), 0.1, seed=0)
    assert err.value.key == "data.path" and "\n" not in str(err.value)
    if case == "no_classes":
        assert "DIR/CLASS/IMAGE" in err.value.reason


# ----------------------------------------------------------------------------- CIFAR-10


def write_cifar(root: Path, per_batch: int = 20, skip: str | None = None, protocol: int = 2) -> None:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for k, name in enumerate(names):
        if name == skip:
            continue
        batch = {b"batch_label": f"batch {k}".encode(),
                 b"labels": [int(v) for v in (np.arange(per_batch) + k) % 10],
                 b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 b"filenames": [f"f{i}.png".encode() for i in range(per_batch)]}
        with open(root / name, "wb") as f:
            pickle.dump(batch, f, protocol=protocol)
    meta = {b"num_cases_per_batch": per_batch, b"label_names": [c.encode() for c in CIFAR10_CLASSES[::-1]],
            b"num_vis": 3072}
    with open(root / "batches.meta", "wb") as f:
        pickle.dump(meta, f, protocol=protocol)


@pytest.mark.parametrize("protocol", [2, 5])
def test_cifar10_batches_load_with_shapes_labels_and_classes(tmp_path, protocol):
    write_cifar(tmp_path / "cifar-10-batches-py", protocol=protocol)
    train_x, train_y, test_x, test_y, classes = load_cifar10(str(tmp_path))
    assert train_x.shape == (100, 3, 32, 32) and train_x.dtype == torch.uint8
    assert test_x.shape == (20, 3, 32, 32) and test_y.dtype == torch.int64
    assert train_y[:20].tolist() == [i % 10 for i in range(20)] and test_y[0] == 5
    assert classes == list(CIFAR10_CLASSES[::-1])
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        raw = pickle.load(f)[b"data"]
    assert torch.equal(train_x[3, 1], torch.from_numpy(raw[3, 1024:2048].reshape(32, 32)))  # channel-major
    ds = ArrayImages(train_x, train_y, T.ImageTransform("pad_crop_flip", 32), classes=classes)
    assert ds[3][0].shape == (3, 32, 32) and ds[3][1] == 3 and ds.describe(3) == "image 3"
    assert ds.targets[:3] == [0, 1, 2] and len(ds) == 100


def test_cifar10_accepts_the_legacy_numpy_module_names_of_the_real_files(tmp_path):
    write_cifar(tmp_path)
    for path in tmp_path.iterdir():  # protocol 2 names globals as text: rewrite them as numpy 1 did
        path.write_bytes(path.read_bytes().replace(b"numpy._core.multiarray", b"numpy.core.multiarray"))
    assert b"numpy.core.multiarray" in (tmp_path / "test_batch").read_bytes()
    assert load_cifar10(str(tmp_path))[2].shape == (20, 3, 32, 32)


def test_cifar10_missing_folder_or_batch_names_it(tmp_path):
    with pytest.raises(DataError) as err:
        load_cifar10(str(tmp_path / "nope"))
    assert err.value.key == "data.path"
    write_cifar(tmp_path, skip="data_batch_3")
    with pytest.raises(DataError, match="data_batch_3") as err:
        load_cifar10(str(tmp_path))
    assert err.value.key == "data.path" and "test_batch" in err.value.reason


class Hostile:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_cifar10_refuses_a_pickle_that_would_run_code(tmp_path):
    write_cifar(tmp_path)
    marker = tmp_path / "pwned"
    with open(tmp_path / "data_batch_2", "wb") as f:
        pickle.dump({b"data": Hostile(marker), b"labels": []}, f, protocol=2)
    with pytest.raises(DataError, match="refusing") as err:
        load_cifar10(str(tmp_path))
    assert err.value.key == str(tmp_path / "data_batch_2")
    assert not marker.exists()
    (tmp_path / "data_batch_2").write_bytes(b"garbage")
    with pytest.raises(DataError, match="not a CIFAR-10"):
        load_cifar10(str(tmp_path))
    with open(tmp_path / "data_batch_2", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 5), np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(DataError, match="not a CIFAR-10"):
        load_cifar10(str(tmp_path))


# ----------------------------------------------------------------------------- digits


def test_digits_are_3x32x32_split_by_the_seed():
    pytest.importorskip("sklearn")
    a = load_digits(0.2, seed=0)
    assert a.train_x.shape == (DIGITS_COUNT - 359, 3, 32, 32) and a.val_x.shape == (359, 3, 32, 32)
    assert a.train_y.dtype == torch.int64 and set(a.train_y.tolist()) == set(range(10))
    assert 0 <= float(a.train_x.min()) and float(a.train_x.max()) <= 1 and len(a.mean) == len(a.std) == 3
    x = T.normalize(a.train_x, a.mean, a.std)
    assert abs(float(x.mean())) < 1e-3 and abs(float(x.std()) - 1) < 1e-2
    b, c = load_digits(0.2, seed=0), load_digits(0.2, seed=1)
    assert torch.equal(a.val_y, b.val_y) and torch.equal(a.train_x, b.train_x)
    assert not torch.equal(a.val_y, c.val_y)
    train_x, train_y, val_x, val_y, mean, std = load_digits(0.0, seed=0)
    assert len(train_x) == DIGITS_COUNT and len(val_x) == 0
