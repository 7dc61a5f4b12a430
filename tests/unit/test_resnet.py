"""ResNets: torchvision-compatible parameter counts and state-dict keys, and pipeline blocks.

The expected keys are generated here from torchvision's architecture (its ``resnet.py``), not read
back from the code under test: a stem conv + BN, per block its convs and BNs in registration order,
a ``downsample`` (1x1 conv + BN) on the first block of a stage whose stride or width changes, then fc.
"""

from __future__ import annotations

import copy

import pytest
import torch

from sdpipe_cli.model.resnet import ARCHS, Head, ResNet, Stem, build, resnet18, resnet50, resnet_cifar

BN_ENTRIES = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def torchvision_keys(n_convs: int, layers: list[int], downsampled: list[bool]) -> list[str]:
    """torchvision's state-dict keys, in order, for blocks of ``n_convs`` conv+BN pairs."""

    def conv_bn(conv: str, bn: str) -> list[str]:
        return [f"{conv}.weight"] + [f"{bn}.{e}" for e in BN_ENTRIES]

    keys = conv_bn("conv1", "bn1")
    for s, (n, down) in enumerate(zip(layers, downsampled)):
        for b in range(n):
            p = f"layer{s + 1}.{b}"
            for c in range(1, n_convs + 1):
                keys += conv_bn(f"{p}.conv{c}", f"{p}.bn{c}")
            if b == 0 and down:
                keys += conv_bn(f"{p}.downsample.0", f"{p}.downsample.1")
    return keys + ["fc.weight", "fc.bias"]


# resnet18: layer1 keeps 64 channels at stride 1, so only layers 2-4 have a downsample.
# resnet50: layer1 expands 64 -> 256, so every stage's first block has one.
RESNET18_KEYS = torchvision_keys(2, [2, 2, 2, 2], [False, True, True, True])
RESNET50_KEYS = torchvision_keys(3, [3, 4, 6, 3], [True, True, True, True])


@pytest.fixture(scope="module")
def meta_resnet50() -> ResNet:
    # Counting is all these tests need: the meta device skips allocating and initialising 25M weights.
    with torch.device("meta"):
        return resnet50()


def test_parameter_counts(meta_resnet50):
    # The published counts of torchvision's resnet18 and resnet50 with 1000 classes.
    assert n_params(resnet18()) == 11_689_512
    assert n_params(meta_resnet50) == 25_557_032
    # ResNet-20 with projection shortcuts: stem 432 + 32, stage 1 3 * 4_672, stage 2 14_528 + 2 * 18_560,
    # stage 3 57_728 + 2 * 73_984, fc 650.
    assert n_params(resnet_cifar(20, num_classes=10)) == 272_474
    assert n_params(build("resnet_cifar", 10)) == 272_474


def test_key_counts_follow_from_the_architecture():
    # Every conv has one entry (no bias) and every BN five; fc has two.
    # resnet18: stem 1 + 5, 8 blocks x 2 x 6, 3 downsamples x 6, fc 2 = 6 + 96 + 18 + 2.
    assert len(RESNET18_KEYS) == 122
    # resnet50: stem 6, 16 blocks x 3 x 6, 4 downsamples x 6, fc 2 = 6 + 288 + 24 + 2.
    assert len(RESNET50_KEYS) == 320


def test_state_dict_keys_match_torchvision(meta_resnet50):
    assert list(resnet18().state_dict()) == RESNET18_KEYS
    assert list(meta_resnet50.state_dict()) == RESNET50_KEYS
    # 62 and 161 parameter tensors: the entries that are not BN buffers.
    assert len(list(resnet18().parameters())) == 62
    assert len(list(meta_resnet50.parameters())) == 161
    for key in ("layer1.0.conv1.weight", "layer2.0.downsample.0.weight",
                "layer2.0.downsample.1.running_mean", "bn1.num_batches_tracked", "fc.bias"):
        assert key in RESNET18_KEYS
    assert "layer1.0.downsample.0.weight" not in RESNET18_KEYS
    assert "layer1.0.downsample.0.weight" in RESNET50_KEYS
    assert "layer4.2.conv3.weight" in RESNET50_KEYS


def test_resnet50_shapes_follow_torchvision(meta_resnet50):
    shapes = {k: tuple(v.shape) for k, v in meta_resnet50.state_dict().items()}
    assert shapes["conv1.weight"] == (64, 3, 7, 7)
    # v1.5: the stride is on the 3x3 conv, the 1x1 convs have stride 1.
    assert meta_resnet50.layer2[0].conv2.stride == (2, 2)
    assert meta_resnet50.layer2[0].conv1.stride == (1, 1)
    assert shapes["layer2.0.conv1.weight"] == (128, 256, 1, 1)
    assert shapes["layer2.0.downsample.0.weight"] == (512, 256, 1, 1)
    assert shapes["fc.weight"] == (1000, 2048)


def test_state_dict_loads_strictly_into_a_fresh_model():
    torch.manual_seed(0)
    source = resnet18(num_classes=7, in_channels=1)
    source.train()
    source(torch.randn(2, 1, 64, 64))  # move the BN running stats away from their init
    torch.manual_seed(1)
    target = resnet18(num_classes=7, in_channels=1)
    target.load_state_dict(source.state_dict(), strict=True)
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key


def test_init_follows_torchvision():
    model = resnet_cifar()
    assert torch.equal(model.bn1.weight, torch.ones(16))
    assert torch.equal(model.layer3[0].downsample[1].bias, torch.zeros(64))
    # kaiming_normal_(fan_out): std = sqrt(2 / (out_channels * 3 * 3)) for the 64-channel 3x3 convs.
    weights = torch.cat([model.layer3[i].conv2.weight.flatten() for i in range(3)])
    assert weights.std().item() == pytest.approx((2 / (64 * 9)) ** 0.5, rel=0.05)


def compose(blocks: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


@pytest.mark.parametrize("train", [False, True])
def test_blocks_compose_to_forward(train):
    torch.manual_seed(0)
    model = resnet_cifar(20, num_classes=10)
    twin = copy.deepcopy(model)  # train mode updates BN stats: each path runs on its own copy
    model.train(train)
    twin.train(train)
    x = torch.randn(2, 3, 32, 32)
    blocks, names = twin.blocks()
    assert torch.equal(compose(blocks, x), model(x))
    # In train mode both paths also moved the BN running stats identically.
    for (key, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), key


def test_blocks_names_and_types():
    blocks, names = resnet_cifar(20).blocks()
    assert names == ["stem"] + [f"layer{s}.{b}" for s in (1, 2, 3) for b in range(3)] + ["head"]
    assert isinstance(blocks[0], Stem) and isinstance(blocks[-1], Head)
    _, names18 = resnet18().blocks()
    assert len(names18) == 1 + 8 + 1 and names18[1] == "layer1.0" and names18[-2] == "layer4.1"


def test_blocks_share_parameters_with_the_model():
    model = resnet_cifar(20)
    blocks, _ = model.blocks()
    block_params = [p for block in blocks for p in block.parameters()]
    assert [p.data_ptr() for p in block_params] == [p.data_ptr() for p in model.parameters()]
    assert all(a is b for a, b in zip(block_params, model.parameters()))
    assert blocks[0].conv1 is model.conv1 and blocks[-1].fc is model.fc
    assert blocks[0].bn1.running_mean.data_ptr() == model.bn1.running_mean.data_ptr()


def test_block_output_shapes():
    model = resnet_cifar(20, num_classes=10).eval()
    blocks, names = model.blocks()
    x = torch.randn(2, 3, 32, 32)
    shapes = {}
    for name, block in zip(names, blocks):
        x = block(x)
        shapes[name] = tuple(x.shape)
    stage = {1: (2, 16, 32, 32), 2: (2, 32, 16, 16), 3: (2, 64, 8, 8)}
    expected = {"stem": (2, 16, 32, 32), "head": (2, 10)}
    expected.update({f"layer{s}.{b}": stage[s] for s in (1, 2, 3) for b in range(3)})
    assert shapes == expected


def test_build():
    assert ARCHS == ("resnet18", "resnet50", "resnet_cifar")
    model = build("resnet_cifar", 100, in_channels=1)
    assert model.conv1.in_channels == 1 and model.fc.out_features == 100
    assert isinstance(model.maxpool, torch.nn.Identity)
    with pytest.raises(ValueError, match="nope"):
        build("nope", 10)
    with pytest.raises(ValueError, match="21"):
        resnet_cifar(21)
