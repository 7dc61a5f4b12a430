"""Image data (scikit-learn's digits), tensor transforms, and masked-LM batches."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from sdpipe_cli.model import data
from sdpipe_cli.model.images import DIGITS_COUNT, load_digits, random_crop

pytest.importorskip("sklearn")


def test_digits_are_normalised_3x32x32_images_split_by_the_seed():
    a = load_digits(0.2, seed=0)
    assert a.train_x.shape == (DIGITS_COUNT - 359, 3, 32, 32) and a.val_x.shape == (359, 3, 32, 32)
    assert a.train_y.dtype == torch.int64 and set(a.train_y.tolist()) == set(range(10))
    assert abs(float(a.train_x.mean())) < 1e-4 and abs(float(a.train_x.std()) - 1) < 1e-3
    b, c = load_digits(0.2, seed=0), load_digits(0.2, seed=1)
    assert torch.equal(a.val_y, b.val_y) and not torch.equal(a.val_y, c.val_y)


def test_random_crop_keeps_the_shape_moves_content_and_zero_padding_is_identity():
    x = torch.arange(2 * 1 * 6 * 6, dtype=torch.float32).reshape(2, 1, 6, 6)
    g = torch.Generator().manual_seed(0)
    y = random_crop(x, g, pad=2)
    assert y.shape == x.shape
    assert torch.equal(random_crop(x, g, pad=0), x)
    crops = [random_crop(x, torch.Generator().manual_seed(s), pad=2) for s in range(20)]
    assert any(not torch.equal(c, x) for c in crops)
    for c in crops:  # every crop is a window of the padded image
        padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
        for i in range(2):
            assert any(torch.equal(c[i, 0], padded[i, 0, dy:dy + 6, dx:dx + 6])
                       for dy in range(5) for dx in range(5))


def cfg(**data_keys):
    return OmegaConf.create({"data": {"name": "digits", "val_fraction": 0.2, **data_keys},
                             "train": {"seed": 0, "batch_size": 32},
                             "model": {"seq_len": 8, "vocab_size": 257, "objective": "auto"}})


def test_image_batches_are_per_pipeline_shards_and_reproducible():
    source = data.open_source(cfg())
    x, y = source.train_batch(0, 2, 16, 0, 3)
    assert x.shape == (16, 3, 32, 32) and y.shape == (16,)
    x2, y2 = source.train_batch(0, 2, 16, 0, 3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    batches = source.val_batches(99, 32, 0)
    assert len(batches) == data.val_count(cfg()) == 359 // 32
    assert data.example(cfg(), 4)[0].shape == (4, 3, 32, 32)


def test_masked_lm_targets_only_the_chosen_tokens():
    tokens = torch.randint(0, 256, (64, 128), generator=torch.Generator().manual_seed(1))
    inputs, targets = data.mask_tokens(tokens, torch.Generator().manual_seed(2), mask_id=256)
    chosen = targets != -100
    assert 0.13 < chosen.float().mean() < 0.17
    assert torch.equal(targets[chosen], tokens[chosen])
    assert torch.equal(inputs[~chosen], tokens[~chosen])
    masked = (inputs == 256)[chosen].float().mean()
    kept = (inputs == tokens)[chosen].float().mean()
    assert 0.75 < masked < 0.85 and 0.07 < kept < 0.16
