"""A small two-headed network for multi-output debugging.

A shared conv ``backbone`` (three Conv-BN-ReLU layers, two of them stride 2)
feeds a ``neck`` (Conv-BN-ReLU + global average pool), whose flattened
features go to two heads:

* ``head_cls``: ``nn.Linear`` logits over ``num_classes``;
* ``head_aux``: a small MLP (Linear-ReLU-Linear) over ``num_aux_classes``
  (e.g. a coarse grouping of the main classes).

``forward`` returns ``{"cls": logits, "aux": aux_logits}``, so tools must cope
with dict outputs. Every ``nn.Conv2d`` has ``bias=False`` and feeds exactly one
``nn.BatchNorm2d``.

Constructors take keyword-only, JSON-typed kwargs so a checkpoint can record
``"qdebug.zoo.multitask:MultiTaskNet"`` plus kwargs and rebuild the model.
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn

__all__ = ["MultiTaskNet"]


def _conv_bn_relu(in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
    )


class MultiTaskNet(nn.Module):
    """Shared backbone + neck, two classification heads.

    Kwargs:
        num_classes: outputs of ``head_cls``.
        num_aux_classes: outputs of ``head_aux``.
        in_channels: input image channels.
        width: base channel width (backbone goes width -> 2*width -> 4*width).
    """

    def __init__(
        self,
        *,
        num_classes: int = 10,
        num_aux_classes: int = 2,
        in_channels: int = 1,
        width: int = 16,
    ) -> None:
        super().__init__()
        w = int(width)
        self.backbone = nn.Sequential(
            _conv_bn_relu(in_channels, w, 1),
            _conv_bn_relu(w, 2 * w, 2),
            _conv_bn_relu(2 * w, 4 * w, 2),
        )
        self.neck = nn.Sequential(
            _conv_bn_relu(4 * w, 4 * w, 1),
            nn.AdaptiveAvgPool2d((1, 1)),
        )
        self.head_cls = nn.Linear(4 * w, num_classes)
        self.head_aux = nn.Sequential(
            nn.Linear(4 * w, w),
            nn.ReLU(),
            nn.Linear(w, num_aux_classes),
        )

    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        x = self.backbone(x)
        x = self.neck(x)
        x = torch.flatten(x, 1)
        return {"cls": self.head_cls(x), "aux": self.head_aux(x)}
