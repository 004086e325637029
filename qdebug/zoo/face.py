"""MTCNN's ONet: the PReLU face CNN (output stage of the MTCNN face detector).

Layer for layer as facenet-pytorch's ``ONet`` (Zhang et al. 2016), on 48x48 RGB crops
scaled to (x - 127.5) / 128:

    conv1 3x3 (3 -> 32)  PReLU  maxpool 3/2     48 -> 46 -> 23
    conv2 3x3 (32 -> 64) PReLU  maxpool 3/2     23 -> 21 -> 10
    conv3 3x3 (64 -> 64) PReLU  maxpool 2/2     10 -> 8 -> 4
    conv4 2x2 (64 -> 128) PReLU                 4 -> 3
    permute to (N, W, H, C) (the Caffe weights' order), flatten 1152, dense5 -> 256, PReLU
    dense6_1 -> 2 (softmax: face probability), dense6_2 -> 4 (box offsets),
    dense6_3 -> 10 (five landmarks)

Max pools round up (``ceil_mode=True``). The state dict has the keys of facenet-pytorch's
``data/onet.pt``; ``forward`` returns its tuple ``(box, landmarks, face_prob)``. Every PReLU
has one slope per channel. ``width`` scales every hidden width (1.0 is the published
network; the flatten then holds 9 x conv4's channels), so tests can be small.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ONet"]


class ONet(nn.Module):
    """MTCNN output network: Conv-PReLU-MaxPool blocks, a PReLU dense layer, three heads.

    Kwargs:
        in_channels: image channels (3).
        width: multiplier of the hidden widths 32, 64, 64, 128, 256 (1.0: the published ONet).
    """

    def __init__(self, *, in_channels: int = 3, width: float = 1.0) -> None:
        super().__init__()
        c1, c2, c3, c4, d5 = (max(1, round(c * float(width))) for c in (32, 64, 64, 128, 256))
        self.conv1 = nn.Conv2d(in_channels, c1, kernel_size=3)
        self.prelu1 = nn.PReLU(c1)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2 = nn.Conv2d(c1, c2, kernel_size=3)
        self.prelu2 = nn.PReLU(c2)
        self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv3 = nn.Conv2d(c2, c3, kernel_size=3)
        self.prelu3 = nn.PReLU(c3)
        self.pool3 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv4 = nn.Conv2d(c3, c4, kernel_size=2)
        self.prelu4 = nn.PReLU(c4)
        self.dense5 = nn.Linear(9 * c4, d5)
        self.prelu5 = nn.PReLU(d5)
        self.dense6_1 = nn.Linear(d5, 2)
        self.softmax6_1 = nn.Softmax(dim=1)
        self.dense6_2 = nn.Linear(d5, 4)
        self.dense6_3 = nn.Linear(d5, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.pool2(self.prelu2(self.conv2(x)))
        x = self.pool3(self.prelu3(self.conv3(x)))
        x = self.prelu4(self.conv4(x))
        x = x.permute(0, 3, 2, 1).contiguous()
        x = self.prelu5(self.dense5(x.view(x.shape[0], -1)))
        face_prob = self.softmax6_1(self.dense6_1(x))
        return self.dense6_2(x), self.dense6_3(x), face_prob
