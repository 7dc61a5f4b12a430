"""Image transforms on CHW tensors, written here because torchvision's wheels do not import
against every torch build.

Each function takes one image, ``(C, H, W)``. The random ones draw from torch's *global* RNG and
nothing else, always in the same order: the loader seeds that RNG per sample from
``(run seed, pipeline, sample position)``, so an augmented batch is the same in every process
that builds it and after a resume.

:class:`ImageTransform` names a whole recipe (crop, flip, scale to [0, 1], normalise) in a few
plain fields, so a config can describe it and DataLoader worker processes can pickle it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IMAGENET_RESIZE_RATIO = 256 / 224  # evaluation resizes the shorter side to size * 256 / 224
RESIZED_CROP_TRIES = 10


def to_float(img: torch.Tensor) -> torch.Tensor:
    """``img`` as float32: uint8 pixels are scaled to [0, 1], float images are kept as they are."""
    if img.dtype == torch.uint8:
        return img.to(torch.float32).div_(255.0)
    return img.to(torch.float32)


def normalize(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """``(x - mean) / std`` per channel; a single mean and std apply to every channel."""
    m = torch.tensor(mean, dtype=x.dtype).view(-1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(-1, 1, 1)
    return (x - m) / s


def _randint(high: int) -> int:
    """A draw from ``[0, high)`` of the global RNG."""
    return int(torch.randint(0, high, (1,)).item())


def _uniform(low: float, high: float) -> float:
    return float(torch.empty(1).uniform_(low, high).item())


def pad_crop(x: torch.Tensor, size: int, pad: int = 4) -> torch.Tensor:
    """A random ``size`` x ``size`` window of ``x`` zero-padded by ``pad`` on every side.

    CIFAR's training augmentation (pad 4). An image still smaller than ``size`` after padding is
    padded further, evenly, rather than failing.
    """
    h, w = x.shape[-2:]
    extra_h, extra_w = max(0, size - h - 2 * pad), max(0, size - w - 2 * pad)
    if pad or extra_h or extra_w:
        x = F.pad(x, (pad + extra_w // 2, pad + extra_w - extra_w // 2,
                      pad + extra_h // 2, pad + extra_h - extra_h // 2))
    h, w = x.shape[-2:]
    top, left = _randint(h - size + 1), _randint(w - size + 1)
    return x[..., top:top + size, left:left + size]


def hflip_random(x: torch.Tensor, p: float = 0.5) -> torch.Tensor:
    """``x`` mirrored left to right with probability ``p`` (one draw every call)."""
    return x.flip(-1) if float(torch.rand(()).item()) < p else x


def _resize(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Bilinear, antialiased resize of one CHW image; an integer image comes back rounded."""
    out = F.interpolate(x.unsqueeze(0).to(torch.float32), size=(h, w), mode="bilinear",
                        antialias=True, align_corners=False).squeeze(0)
    if x.dtype.is_floating_point:
        return out.to(x.dtype)
    info = torch.iinfo(x.dtype)
    return out.round_().clamp_(info.min, info.max).to(x.dtype)


def _resized_crop_box(h: int, w: int, scale: tuple[float, float],
                      ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a random crop covering ``scale`` of the area with aspect
    ratio in ``ratio`` (log-uniform); after ``RESIZED_CROP_TRIES`` misses, the centre crop with
    the aspect ratio clamped to ``ratio``."""
    area = h * w
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(RESIZED_CROP_TRIES):
        target_area = area * _uniform(scale[0], scale[1])
        aspect = math.exp(_uniform(log_ratio[0], log_ratio[1]))
        cw = int(round(math.sqrt(target_area * aspect)))
        ch = int(round(math.sqrt(target_area / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            return _randint(h - ch + 1), _randint(w - cw + 1), ch, cw
    in_ratio = w / h
    if in_ratio < min(ratio):
        cw, ch = w, int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        ch, cw = h, int(round(h * max(ratio)))
    else:
        ch, cw = h, w
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def random_resized_crop(x: torch.Tensor, size: int, scale: tuple[float, float] = (0.08, 1.0),
                        ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> torch.Tensor:
    """ImageNet's training crop: a random box of ``scale`` of the area and aspect ratio in
    ``ratio``, resized to ``size`` x ``size``."""
    top, left, ch, cw = _resized_crop_box(x.shape[-2], x.shape[-1], scale, ratio)
    return _resize(x[..., top:top + ch, left:left + cw], size, size)


def center_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """The central ``size`` x ``size`` window of ``x`` (zero-padded first where ``x`` is smaller)."""
    h, w = x.shape[-2:]
    if h < size or w < size:
        ph, pw = max(0, size - h), max(0, size - w)
        x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
        h, w = x.shape[-2:]
    top, left = int(round((h - size) / 2)), int(round((w - size) / 2))
    return x[..., top:top + size, left:left + size]


def resize_center_crop(x: torch.Tensor, size: int, resize: int | None = None) -> torch.Tensor:
    """ImageNet's evaluation view: the shorter side resized to ``resize`` (default
    ``round(size * 256 / 224)``), then the central ``size`` x ``size`` window."""
    if resize is None:
        resize = round(size * IMAGENET_RESIZE_RATIO)
    h, w = x.shape[-2:]
    if h <= w:
        new_h, new_w = resize, int(resize * w / h)
    else:
        new_h, new_w = int(resize * h / w), resize
    if (new_h, new_w) != (h, w):
        x = _resize(x, new_h, new_w)
    return center_crop(x, size)


KINDS = ("resized_crop_flip", "pad_crop_flip", "pad_crop", "resize_center", "none")


@dataclass(frozen=True)
class ImageTransform:
    """A whole image recipe: ``kind`` picks the geometry, then pixels are scaled to [0, 1] (uint8
    input) and normalised by ``mean`` and ``std`` (one value, or one per channel).

    * ``resized_crop_flip``: ImageNet training (random resized crop to ``size``, random flip);
    * ``pad_crop_flip``: CIFAR training (random ``size`` crop of the image padded by ``pad``, flip);
    * ``pad_crop``: the same without the flip, for images that are not mirror-symmetric;
    * ``resize_center``: ImageNet evaluation (resize to ``size * 256 / 224``, centre crop ``size``);
    * ``none``: no geometry, only scaling and normalisation.
    """

    kind: str
    size: int
    pad: int = 4
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown image transform {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.kind != "none" and self.size <= 0:
            raise ValueError(f"image transform size must be positive, got {self.size}")
        if self.pad < 0:
            raise ValueError(f"image transform pad must be >= 0, got {self.pad}")
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        if len(self.mean) != len(self.std) or not self.mean:
            raise ValueError(f"mean {self.mean} and std {self.std} must have the same, non-zero length")
        if min(self.std) <= 0:
            raise ValueError(f"std must be positive, got {self.std}")

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        """``img`` (uint8 or float CHW) transformed: float32, normalised, CHW."""
        x = img
        if self.kind in ("pad_crop", "pad_crop_flip"):
            x = pad_crop(x, self.size, self.pad)
        x = to_float(x)  # after a plain crop (fewer pixels to convert), before any resampling
        if self.kind == "resized_crop_flip":
            x = random_resized_crop(x, self.size)
        elif self.kind == "resize_center":
            x = resize_center_crop(x, self.size)
        if self.kind in ("resized_crop_flip", "pad_crop_flip"):
            x = hflip_random(x)
        return normalize(x, self.mean, self.std)
