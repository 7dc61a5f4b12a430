"""Your own dataset: ``data=custom data._target_=PKG.MODULE.FN``.

The callable (keyword arguments: ``+data.KEY=VALUE``, gathered into ``data.kwargs``) returns a
map-style torch ``Dataset`` whose items are ``(inputs, target)``, or a pair ``(train, val)``, or a
dict with ``train`` and ``val``. Without a validation set, a seeded ``data.val_fraction`` of the
training set is held out. The callable runs in every process that reads data, with torch's,
Python's and numpy's RNGs seeded alike (and restored after), so a split or shuffle it draws is
the same in each. sdpipe shards, orders, batches and resumes it like its own data sets;
randomness in the dataset's transforms should come from torch's RNG, which the loader seeds per
sample (see :mod:`sdpipe_cli.data.loader`). A ``classes`` attribute, as torchvision's data sets
have, gives a classifier its number of classes.
"""

from __future__ import annotations

import operator
import random
import sys
from typing import Any, cast

import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset, Subset

from sdpipe_cli.config.targets import import_callable
from sdpipe_cli.data.loader import rng_kept
from sdpipe_cli.data.sampling import seed_of
from sdpipe_cli.runtime.errors import DataError

__all__ = ["open_custom"]

KEY = "data._target_"
# The sampler draws a permutation of every index each epoch (8 bytes a sample, in each process
# that reads data): past this a data set is a stream, not a map-style Dataset sdpipe can order.
MAX_SAMPLES = 2**31


def _text(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"


def _map_style(ds: Any, what: str) -> Dataset:
    if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
        raise DataError(KEY, f"returned {type(ds).__name__} as the {what} set; it must be a map-style "
                        "torch Dataset (with __len__ and __getitem__)")
    try:  # the user's __len__, read raw: len() turns a bad value into an opaque error
        raw = type(ds).__len__(ds)
    except (Exception, SystemExit) as err:
        raise DataError(KEY, f"the {what} set's __len__ failed: {_text(err)}") from None
    try:
        n = operator.index(raw)
    except TypeError:
        raise DataError(KEY, f"the {what} set's __len__ returned {type(raw).__name__} {str(raw)[:50]}; "
                        "it must return the number of samples, an int") from None
    if n <= 0:
        raise DataError(KEY, f"the {what} set is empty" if n == 0 else
                        f"the {what} set's __len__ returned {n}; it must return the number of samples")
    if n > MAX_SAMPLES:
        raise DataError(KEY, f"the {what} set's __len__ returned {n}, more than the {MAX_SAMPLES} "
                        "(2**31) samples sdpipe can index and shuffle; return a part of it")
    return ds


class _Part(Subset):
    """A seeded part of the user's set that keeps its ``target(i)`` (labels without reading)."""

    def __getattr__(self, name: str) -> Any:
        if name == "target" and callable(getattr(self.dataset, "target", None)):
            return lambda i: self.dataset.target(self.indices[i])
        raise AttributeError(name)


def _split(ds: Dataset, val_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    n = len(ds)
    held = int(n * val_fraction)
    if held < 1 or held >= n:
        raise DataError("data.val_fraction", f"holds out {held} of {n} samples; the data set has no "
                        "validation split of its own, so hold out at least one and keep one to train")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed))).tolist()
    return _Part(ds, order[held:]), _Part(ds, order[:held])


def open_custom(data_cfg: Any, seed: int) -> tuple[Dataset, Dataset, int | None]:
    """The user's train and validation sets, and their number of classes if they say."""
    target = getattr(data_cfg, "_target_", None)
    fn = import_callable(target, KEY)
    # data.kwargs: a dict[str, Any] node of the schema (its container is a dict of str keys), or
    # the settings' dict
    given = getattr(data_cfg, "kwargs", None) or {}
    kwargs = cast("dict[str, Any]", OmegaConf.to_container(given, resolve=True)
                  if OmegaConf.is_config(given) else dict(given))
    try:
        with rng_kept():
            draws = seed_of("data", seed)
            torch.default_generator.manual_seed(draws)
            random.seed(draws)
            if "numpy" in sys.modules:
                sys.modules["numpy"].random.seed(draws % 2**32)
            made = fn(**kwargs)
    except Exception as err:  # the user's code: its failure is their input's
        raise DataError(KEY, f"{target}({', '.join(kwargs)}) failed: {_text(err)}") from None
    except SystemExit as exit_:  # a user's sys.exit() is not sdpipe's exit (Ctrl-C stays one)
        raise DataError(KEY, f"{target} called sys.exit({exit_.code!r}) while making the data set") from None
    if isinstance(made, dict):
        train, val = made.get("train"), made.get("val")
    elif isinstance(made, (tuple, list)) and len(made) == 2:
        train, val = made
    else:
        train, val = made, None
    train = _map_style(train, "training")
    if val is None:
        train, val = _split(train, float(data_cfg.val_fraction), seed)
    else:
        val = _map_style(val, "validation")
    base = train.dataset if isinstance(train, Subset) else train
    classes = getattr(base, "classes", None)
    return train, val, (len(classes) if classes else None)
