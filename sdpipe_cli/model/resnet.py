"""ResNets for image classification, written in the project and split at residual blocks.

torchvision's wheels do not import against the CPU torch build used here, so the networks are
written in the project instead. They keep torchvision's attribute names, registration order and
initialisation, so a torchvision ``resnet18`` / ``resnet50`` state dict loads into them with
``strict=True`` and the parameter counts match the published ones.

A pipeline stage owns a contiguous range of blocks, so :meth:`ResNet.blocks` also returns the
model as an ordered list: a :class:`Stem`, every residual block in order, then a :class:`Head`.
Each block takes one tensor and returns one, the composition equals :meth:`ResNet.forward`, and
the blocks share the model's parameters rather than copying them.

Besides the ImageNet variants there is the CIFAR ResNet of He et al. 2016 (section 4.2): a 3x3
stem with 16 channels and no max-pool, then three stages of 16, 32 and 64 channels. Where the
shape changes it uses a projection shortcut (1x1 conv + BN, the paper's "option B") rather than
the paper's zero-padding "option A", so that every block has the same structure as torchvision's.

The module does no I/O and keeps no global state.
"""

from __future__ import annotations

import torch
from torch import nn

ARCHS = ("resnet18", "resnet50", "resnet_cifar")


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution with padding and no bias (a BatchNorm follows every conv)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution with no bias: bottleneck reductions and projection shortcuts."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convs plus a shortcut (ResNet-18/34 and the CIFAR ResNets)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4) plus a shortcut (ResNet-50 and deeper).

    The stride sits on the 3x3 conv (torchvision's "v1.5"), not on the first 1x1 as in the paper.
    """

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class Stem(nn.Module):
    """First pipeline block: the model's own conv1, bn1, relu and maxpool, under the same names."""

    def __init__(self, conv1: nn.Module, bn1: nn.Module, relu: nn.Module, maxpool: nn.Module):
        super().__init__()
        self.conv1 = conv1
        self.bn1 = bn1
        self.relu = relu
        self.maxpool = maxpool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))


class Head(nn.Module):
    """Last pipeline block: the model's own avgpool and fc, with the flatten between them."""

    def __init__(self, avgpool: nn.Module, fc: nn.Module):
        super().__init__()
        self.avgpool = avgpool
        self.fc = fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ResNet(nn.Module):
    """A ResNet with torchvision's attribute names, so torchvision state dicts load into it.

    ``layers`` gives the number of blocks per stage and ``widths`` each stage's planes; the first
    stage keeps the resolution and every later one halves it. ``cifar_stem`` swaps the ImageNet
    stem (7x7/2 conv + 3x3/2 max-pool) for a 3x3/1 conv and no pooling, for 32x32 inputs.
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: list[int],
        num_classes: int = 1000,
        in_channels: int = 3,
        widths: tuple[int, ...] = (64, 128, 256, 512),
        cifar_stem: bool = False,
    ):
        super().__init__()
        if len(layers) != len(widths):
            raise ValueError(f"layers {layers} and widths {widths} differ in length")
        self.inplanes = widths[0]
        if cifar_stem:
            self.conv1 = conv3x3(in_channels, self.inplanes)
        else:
            self.conv1 = nn.Conv2d(in_channels, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity() if cifar_stem else nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.n_stages = len(layers)
        for i, (n, planes) in enumerate(zip(layers, widths)):
            setattr(self, f"layer{i + 1}", self._make_layer(block, planes, n, stride=1 if i == 0 else 2))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[-1] * block.expansion, num_classes)

        # torchvision's init; fc keeps nn.Linear's default.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block, planes: int, n: int, stride: int) -> nn.Sequential:
        """One stage: the first block changes stride/width (with a projection shortcut), the rest don't."""
        out = planes * block.expansion
        downsample = None
        if stride != 1 or self.inplanes != out:
            downsample = nn.Sequential(conv1x1(self.inplanes, out, stride), nn.BatchNorm2d(out))
        stage = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = out
        stage += [block(self.inplanes, planes) for _ in range(1, n)]
        return nn.Sequential(*stage)

    def stages(self) -> list[nn.Sequential]:
        """``layer1``, ``layer2``, ... in order."""
        return [getattr(self, f"layer{i + 1}") for i in range(self.n_stages)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for stage in self.stages():
            x = stage(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))

    def blocks(self) -> tuple[list[nn.Module], list[str]]:
        """The model as pipeline blocks and their names: stem, every residual block, head.

        The blocks hold the model's own submodules, so parameters and BN buffers are shared, not
        copied, and running them in order computes exactly :meth:`forward`.
        """
        modules: list[nn.Module] = [Stem(self.conv1, self.bn1, self.relu, self.maxpool)]
        names = ["stem"]
        for i, stage in enumerate(self.stages()):
            for j, block in enumerate(stage):
                modules.append(block)
                names.append(f"layer{i + 1}.{j}")
        modules.append(Head(self.avgpool, self.fc))
        names.append("head")
        return modules, names


def resnet18(num_classes: int = 1000, in_channels: int = 3) -> ResNet:
    """torchvision's ResNet-18: BasicBlocks [2, 2, 2, 2]."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, in_channels)


def resnet50(num_classes: int = 1000, in_channels: int = 3) -> ResNet:
    """torchvision's ResNet-50 (v1.5): Bottlenecks [3, 4, 6, 3]."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, in_channels)


def resnet_cifar(depth: int = 20, num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """The CIFAR ResNet of He et al. 2016: depth = 6n + 2, three stages of n BasicBlocks."""
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"CIFAR ResNet depth must be 6n + 2 with n >= 1, got {depth}")
    n = (depth - 2) // 6
    return ResNet(BasicBlock, [n, n, n], num_classes, in_channels, widths=(16, 32, 64), cifar_stem=True)


def build(arch: str, num_classes: int, in_channels: int = 3) -> ResNet:
    """The network named ``arch`` (one of :data:`ARCHS`; ``resnet_cifar`` is ResNet-20)."""
    if arch == "resnet18":
        return resnet18(num_classes, in_channels)
    if arch == "resnet50":
        return resnet50(num_classes, in_channels)
    if arch == "resnet_cifar":
        return resnet_cifar(20, num_classes, in_channels)
    raise ValueError(f"unknown ResNet arch {arch!r}; expected one of {ARCHS}")
