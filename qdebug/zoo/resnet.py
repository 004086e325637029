"""ResNet family (BasicBlock only) in plain PyTorch.

Engine-friendly by construction:

* every ``nn.Conv2d`` has ``bias=False`` and feeds exactly one
  ``nn.BatchNorm2d`` (so Conv-BN pairs are detectable),
* residual adds are inline and out-of-place (``out = out + identity``),
* each :class:`BasicBlock` owns ONE ``nn.ReLU`` module that it calls twice
  (a shared module, deliberately, as in the classic reference design),
* no in-place activations, so hooks always see the tensors a module produced.

``ResNet()`` with default kwargs is ResNet-18 sized (11,689,512 parameters).
``stem="small"`` swaps the 7x7/stride-2 conv + max-pool stem for a 3x3/stride-1
conv without pooling, for 28x28 or 8x8 inputs.

Constructors take keyword-only, JSON-typed kwargs so a checkpoint can record
``"qdebug.zoo.resnet:ResNet"`` plus kwargs and rebuild the model.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

__all__ = ["BasicBlock", "ResNet", "resnet18"]


class BasicBlock(nn.Module):
    """Two 3x3 Conv-BN layers with an identity (or 1x1 Conv-BN) shortcut."""

    expansion = 1

    def __init__(self, *, in_channels: int = 64, out_channels: int = 64, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()  # shared: called twice in forward
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.downsample = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out = out + identity
        out = self.relu(out)
        return out


class ResNet(nn.Module):
    """ResNet built from :class:`BasicBlock` stages.

    Kwargs:
        layers: blocks per stage (default ``[2, 2, 2, 2]`` = ResNet-18).
        widths: output channels per stage (same length as ``layers``).
        num_classes: classifier outputs.
        in_channels: input image channels.
        stem: ``"imagenet"`` (7x7 stride-2 conv + 3x3 max-pool) or
            ``"small"`` (3x3 stride-1 conv, no pooling).

    Stages are exposed as ``layer1`` .. ``layerN``; the head is ``avgpool``
    (``nn.AdaptiveAvgPool2d``) + ``torch.flatten`` + ``fc`` (``nn.Linear``).
    """

    def __init__(
        self,
        *,
        layers: Sequence[int] = (2, 2, 2, 2),
        widths: Sequence[int] = (64, 128, 256, 512),
        num_classes: int = 1000,
        in_channels: int = 3,
        stem: str = "imagenet",
    ) -> None:
        super().__init__()
        layers = [int(n) for n in layers]
        widths = [int(w) for w in widths]
        if len(layers) != len(widths) or not layers:
            raise ValueError(f"layers {layers} and widths {widths} must be non-empty and of equal length")
        if stem not in ("imagenet", "small"):
            raise ValueError(f"stem must be 'imagenet' or 'small', got {stem!r}")
        self.num_stages = len(layers)

        stem_width = widths[0]
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(in_channels, stem_width, 7, stride=2, padding=3, bias=False)
            self.bn1 = nn.BatchNorm2d(stem_width)
            self.relu = nn.ReLU()
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        else:
            self.conv1 = nn.Conv2d(in_channels, stem_width, 3, stride=1, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(stem_width)
            self.relu = nn.ReLU()
            self.maxpool = None

        channels = stem_width
        for i, (n_blocks, width) in enumerate(zip(layers, widths)):
            stride = 1 if i == 0 else 2
            blocks = []
            for j in range(n_blocks):
                blocks.append(
                    BasicBlock(in_channels=channels, out_channels=width, stride=stride if j == 0 else 1)
                )
                channels = width
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))

        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(channels, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        if self.maxpool is not None:
            x = self.maxpool(x)
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x


def resnet18(**kwargs) -> ResNet:
    """ResNet-18 (``layers=[2, 2, 2, 2]``); extra kwargs go to :class:`ResNet`."""
    kwargs.setdefault("layers", [2, 2, 2, 2])
    return ResNet(**kwargs)
