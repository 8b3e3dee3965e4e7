"""A small ResNet of our own for the suite and the benchmarks: BatchNorm, residual blocks of different shapes.

torchvision and timm do not install beside the CPU torch here (issue 25), so the BatchNorm, channels_last and
compiled-conv-net cases run on this stand-in for torchvision's resnet18: the same ``BasicBlock`` (two 3x3
convolutions with BatchNorm, a strided 1x1 projection where the shape changes), blocks that each change the channel
count or the resolution, so no two blocks share a shape and every block is its own unit under ``{BasicBlock}``.
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """torchvision's ``BasicBlock``: conv-BN-ReLU-conv-BN plus the input (projected when the shape changes)."""

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.downsample = None
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    """Stem, three blocks of (channels, stride) ``(8, 1), (12, 2), (16, 2)``, pooling and a linear head."""

    def __init__(self, num_classes: int = 5, widths: tuple[tuple[int, int], ...] = ((8, 1), (12, 2), (16, 2))) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0][0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0][0]))
        blocks, channels = [], widths[0][0]
        for width, stride in widths:
            blocks.append(BasicBlock(channels, width, stride))
            channels = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.blocks(torch.relu(self.stem(images)))
        return self.head(features.mean(dim=(2, 3)))


def batch_norms(model: nn.Module) -> list[tuple[str, nn.modules.batchnorm._BatchNorm]]:
    """Every BatchNorm of ``model`` with its name."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
