"""Image data: scikit-learn's handwritten digits, and the transforms image training uses.

``data=digits`` is the 8x8 digits that ship inside scikit-learn (1797 real scans, 10 classes):
a real image classification task that needs no download, so the image models can be trained,
tested and measured anywhere. Each image is upscaled to 32x32 (bilinear) and repeated over 3
channels, the input of CIFAR-style networks, and normalised by the train split's mean and
standard deviation. A seeded permutation holds out ``data.val_fraction`` for validation.

Transforms are written on tensors (torchvision's wheels do not import against every torch build):
a random crop from the image padded by ``CROP_PAD`` pixels, drawn per sample from the batch's
generator, so a batch is still a pure function of ``(seed, shard, index)``. Digits are not
mirror-symmetric, so there is no flip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sdpipe_cli.runtime.errors import DataError

SIZE = 32  # pixels per side after upscaling
CHANNELS = 3
CROP_PAD = 2  # pixels of zero padding around the image before a random crop (training only)
DIGITS_CLASSES = 10
DIGITS_COUNT = 1797  # images in scikit-learn's copy (checked when loaded)


@dataclass
class Images:
    """Train and validation images (N, C, H, W) float32, normalised, and their labels (N,) int64."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor


def load_digits(val_fraction: float, seed: int) -> Images:
    """scikit-learn's digits as 3x32x32 images, split by a permutation of ``seed``."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise DataError("data.name", "digits needs scikit-learn: pip install -e '.[digits]'") from None
    digits = sklearn_digits()
    if len(digits.target) != DIGITS_COUNT:
        raise DataError("data.name", f"scikit-learn's digits hold {len(digits.target)} images, "
                        f"not {DIGITS_COUNT}; this version of scikit-learn is not supported")
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    x = F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
    x = x.expand(-1, CHANNELS, -1, -1).contiguous()
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(int(seed)))
    n_val = int(len(y) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return Images(x[train], y[train], x[val], y[val])


def random_crop(x: torch.Tensor, g: torch.Generator, pad: int = CROP_PAD) -> torch.Tensor:
    """Each image of ``x`` (B, C, H, W) cropped back to H x W from a random place in the image
    padded by ``pad`` zeros on every side."""
    if pad <= 0:
        return x
    b, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=g)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=g)
    rows = (dy[:, None] + torch.arange(h))[:, None, :, None].expand(-1, x.shape[1], -1, w + 2 * pad)
    picked = padded.gather(2, rows)
    cols = (dx[:, None] + torch.arange(w))[:, None, None, :].expand(-1, x.shape[1], h, -1)
    return picked.gather(3, cols)
