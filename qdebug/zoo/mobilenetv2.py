"""MobileNetV2 in plain PyTorch.

Inverted residual blocks: 1x1 expand Conv-BN-ReLU6 (skipped when the expansion
factor is 1), 3x3 depthwise Conv-BN-ReLU6 (``groups == channels``), 1x1 project
Conv-BN with no activation, and an inline out-of-place residual add
(``x + self.conv(x)``) when stride is 1 and input/output channels match.

Every ``nn.Conv2d`` has ``bias=False`` and feeds exactly one
``nn.BatchNorm2d``; activations are ``nn.ReLU6`` modules (not in-place).
The head is ``nn.AdaptiveAvgPool2d`` + ``torch.flatten`` + ``classifier``
(``nn.Dropout`` followed by ``nn.Linear``).

Constructors take keyword-only, JSON-typed kwargs so a checkpoint can record
``"qdebug.zoo.mobilenetv2:MobileNetV2"`` plus kwargs and rebuild the model.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import torch
from torch import nn

__all__ = ["InvertedResidual", "MobileNetV2", "DEFAULT_SETTING", "make_divisible"]

#: Standard MobileNetV2 table: expansion t, output channels c, repeats n, stride s.
DEFAULT_SETTING = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def make_divisible(value: float, divisor: int = 8, min_value: Optional[int] = None) -> int:
    """Round ``value`` to a multiple of ``divisor``, never dropping below 90% of it."""
    if min_value is None:
        min_value = divisor
    new_value = max(min_value, int(value + divisor / 2) // divisor * divisor)
    if new_value < 0.9 * value:
        new_value += divisor
    return new_value


def _conv_bn_relu6(in_channels: int, out_channels: int, kernel_size: int, stride: int, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        OrderedDict(
            conv=nn.Conv2d(
                in_channels,
                out_channels,
                kernel_size,
                stride=stride,
                padding=(kernel_size - 1) // 2,
                groups=groups,
                bias=False,
            ),
            bn=nn.BatchNorm2d(out_channels),
            act=nn.ReLU6(),
        )
    )


class InvertedResidual(nn.Module):
    """MobileNetV2 block; ``self.conv`` holds the whole expand/dw/project chain.

    ``self.conv`` submodules: ``expand_conv``/``expand_bn``/``expand_act`` (only
    when ``expand_ratio != 1``), ``dw_conv``/``dw_bn``/``dw_act``,
    ``project_conv``/``project_bn``. ``use_res_connect`` tells whether the
    forward adds the input back.
    """

    def __init__(self, *, in_channels: int, out_channels: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f"stride must be 1 or 2, got {stride}")
        hidden = int(round(in_channels * expand_ratio))
        self.use_res_connect = stride == 1 and in_channels == out_channels
        layers: "OrderedDict[str, nn.Module]" = OrderedDict()
        if expand_ratio != 1:
            layers["expand_conv"] = nn.Conv2d(in_channels, hidden, 1, bias=False)
            layers["expand_bn"] = nn.BatchNorm2d(hidden)
            layers["expand_act"] = nn.ReLU6()
        layers["dw_conv"] = nn.Conv2d(hidden, hidden, 3, stride=stride, padding=1, groups=hidden, bias=False)
        layers["dw_bn"] = nn.BatchNorm2d(hidden)
        layers["dw_act"] = nn.ReLU6()
        layers["project_conv"] = nn.Conv2d(hidden, out_channels, 1, bias=False)
        layers["project_bn"] = nn.BatchNorm2d(out_channels)
        self.conv = nn.Sequential(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 classifier.

    Kwargs:
        num_classes: classifier outputs.
        in_channels: input image channels.
        width_mult: channel multiplier (channels rounded to multiples of 8).
        setting: list of ``[t, c, n, s]`` rows (default: the standard table).
        stem_stride: stride of the first 3x3 conv (use 1 for 28x28 inputs).
        dropout: dropout probability before the final ``nn.Linear``.
        last_channel: width of the final 1x1 conv (1280 in the paper; scaled
            up, never down, by ``width_mult`` > 1).

    Attributes: ``features`` (stem, blocks, final Conv-BN-ReLU6), ``avgpool``,
    ``classifier`` (``nn.Dropout``, ``nn.Linear``).
    """

    def __init__(
        self,
        *,
        num_classes: int = 1000,
        in_channels: int = 3,
        width_mult: float = 1.0,
        setting: Sequence[Sequence[int]] = DEFAULT_SETTING,
        stem_stride: int = 2,
        dropout: float = 0.2,
        last_channel: int = 1280,
    ) -> None:
        super().__init__()
        rows = [[int(v) for v in row] for row in setting]
        if not rows or any(len(row) != 4 for row in rows):
            raise ValueError(f"setting must be a non-empty list of [t, c, n, s] rows, got {setting!r}")

        input_channel = make_divisible(32 * width_mult)
        self.last_channel = make_divisible(last_channel * max(1.0, width_mult))

        features = [_conv_bn_relu6(in_channels, input_channel, 3, stride=stem_stride)]
        for t, c, n, s in rows:
            output_channel = make_divisible(c * width_mult)
            for i in range(n):
                features.append(
                    InvertedResidual(
                        in_channels=input_channel,
                        out_channels=output_channel,
                        stride=s if i == 0 else 1,
                        expand_ratio=t,
                    )
                )
                input_channel = output_channel
        features.append(_conv_bn_relu6(input_channel, self.last_channel, 1, stride=1))
        self.features = nn.Sequential(*features)

        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.classifier = nn.Sequential(
            OrderedDict(dropout=nn.Dropout(p=dropout), fc=nn.Linear(self.last_channel, num_classes))
        )

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x
