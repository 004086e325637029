"""ShuffleNetV2 in plain PyTorch.

Exercises the data-movement ops a quantization engine must handle:

* stride-1 units split channels with ``x.chunk(2, dim=1)``, transform one half
  and re-join with ``torch.cat``;
* stride-2 units run two branches on the full input and ``torch.cat`` them;
* every unit ends with :func:`channel_shuffle` (``view`` -> ``transpose`` ->
  ``reshape``);
* the final 1x1 Conv-BN uses an inline ``F.relu`` instead of a module.

Every ``nn.Conv2d`` has ``bias=False`` and feeds exactly one
``nn.BatchNorm2d``; adds/activations are never in-place.

Constructors take keyword-only, JSON-typed kwargs so a checkpoint can record
``"qdebug.zoo.shufflenetv2:ShuffleNetV2"`` plus kwargs and rebuild the model.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["channel_shuffle", "ShuffleUnit", "ShuffleNetV2"]


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Interleave channels across ``groups``: (N, g*k, H, W) -> channel order
    ``[0, k, 2k, ..., 1, k+1, ...]``."""
    n, c, h, w = x.shape
    x = x.view(n, groups, c // groups, h, w)
    x = torch.transpose(x, 1, 2).contiguous()
    return x.reshape(n, c, h, w)


def _depthwise(channels: int, stride: int) -> nn.Conv2d:
    return nn.Conv2d(channels, channels, 3, stride=stride, padding=1, groups=channels, bias=False)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2 unit.

    ``stride == 1``: input must have ``out_channels`` channels; half goes
    through ``branch2``, the other half passes through untouched.
    ``stride == 2``: ``branch1`` (dw Conv-BN, 1x1 Conv-BN-ReLU) and ``branch2``
    both see the full input; ``branch1`` is ``None`` for stride 1.
    """

    def __init__(self, *, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f"stride must be 1 or 2, got {stride}")
        if out_channels % 2:
            raise ValueError(f"out_channels must be even, got {out_channels}")
        branch = out_channels // 2
        if stride == 1 and in_channels != 2 * branch:
            raise ValueError(f"stride-1 unit needs in_channels == out_channels, got {in_channels} != {out_channels}")
        self.stride = stride

        if stride > 1:
            self.branch1 = nn.Sequential(
                _depthwise(in_channels, stride),
                nn.BatchNorm2d(in_channels),
                nn.Conv2d(in_channels, branch, 1, bias=False),
                nn.BatchNorm2d(branch),
                nn.ReLU(),
            )
        else:
            self.branch1 = None

        branch_in = in_channels if stride > 1 else branch
        self.branch2 = nn.Sequential(
            nn.Conv2d(branch_in, branch, 1, bias=False),
            nn.BatchNorm2d(branch),
            nn.ReLU(),
            _depthwise(branch, stride),
            nn.BatchNorm2d(branch),
            nn.Conv2d(branch, branch, 1, bias=False),
            nn.BatchNorm2d(branch),
            nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.branch1 is None:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    """ShuffleNetV2 classifier (defaults: the 1.0x model, ~2.28M parameters).

    Kwargs:
        stages_repeats: units per stage (first unit of each stage has stride 2).
        stages_out_channels: ``[stem, stage2, ..., stageN, conv5]`` widths;
            must have ``len(stages_repeats) + 2`` even entries (bar the last).
        num_classes: classifier outputs.
        in_channels: input image channels.
        stem_stride: stride of the 3x3 stem conv (use 1 for 28x28 inputs).
        stem_pool: apply the 3x3 stride-2 max-pool after the stem.

    Attributes: ``conv1`` (Conv-BN-ReLU), ``maxpool`` (or ``None``),
    ``stage2`` .. ``stage{N+1}``, ``conv5`` (Conv-BN; ReLU applied inline with
    ``F.relu``), ``avgpool``, ``fc``.
    """

    def __init__(
        self,
        *,
        stages_repeats: Sequence[int] = (4, 8, 4),
        stages_out_channels: Sequence[int] = (24, 116, 232, 464, 1024),
        num_classes: int = 1000,
        in_channels: int = 3,
        stem_stride: int = 2,
        stem_pool: bool = True,
    ) -> None:
        super().__init__()
        repeats = [int(r) for r in stages_repeats]
        widths = [int(c) for c in stages_out_channels]
        if not repeats or len(widths) != len(repeats) + 2:
            raise ValueError(
                f"stages_out_channels needs len(stages_repeats) + 2 entries, got {widths} for {repeats}"
            )
        self.num_stages = len(repeats)

        stem = widths[0]
        self.conv1 = nn.Sequential(
            nn.Conv2d(in_channels, stem, 3, stride=stem_stride, padding=1, bias=False),
            nn.BatchNorm2d(stem),
            nn.ReLU(),
        )
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1) if stem_pool else None

        channels = stem
        for i, (n_units, width) in enumerate(zip(repeats, widths[1:-1])):
            units = [ShuffleUnit(in_channels=channels, out_channels=width, stride=2)]
            units += [ShuffleUnit(in_channels=width, out_channels=width, stride=1) for _ in range(n_units - 1)]
            setattr(self, f"stage{i + 2}", nn.Sequential(*units))
            channels = width

        self.conv5 = nn.Sequential(
            nn.Conv2d(channels, widths[-1], 1, bias=False),
            nn.BatchNorm2d(widths[-1]),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        if self.maxpool is not None:
            x = self.maxpool(x)
        for i in range(self.num_stages):
            x = getattr(self, f"stage{i + 2}")(x)
        x = F.relu(self.conv5(x))
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x
