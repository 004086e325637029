"""``nn.PReLU`` with a quantized slope and an integer kernel: the engine's ``QPReLU``.

As torch.ao's quantized PReLU (``torch.ao.nn.quantized.PReLU``), the slope a is quantized
by a weight point of its own (per channel with the default per-channel weight spec: one
slope per channel).  In the quantized stage, with x on a per-tensor grid (s_x, z_x):

    q_y = z_y + fpm(q_x - z_x, s_x / s_y)                     where q_x >= z_x
    q_y = z_y + fpm((q_x - z_x)(q_a - z_a), s_x s_a / s_y)     where q_x <  z_x

clamped to [qmin, qmax] (fpm: the fixed-point multiply of docs/engine.md, one rounding).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from qdebug.engine import integer
from qdebug.engine.ops import register_module_category
from qdebug.engine.point import QuantPoint, on_grid, tag
from qdebug.engine.weight_only import WeightOnly


class QPReLU(WeightOnly, nn.Module):
    """An ``nn.PReLU`` whose slope is fake-quantized by ``weight_point``."""

    def __init__(self, prelu: nn.PReLU):
        super().__init__()
        self.num_parameters = prelu.num_parameters
        self.weight = prelu.weight
        object.__setattr__(self, "weight_point", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.prelu(x, self.quantized_weight())

    def extra_repr(self) -> str:
        return f"num_parameters={self.num_parameters}"


def quantizable_prelu(module: nn.Module) -> QPReLU | None:
    """A ``QPReLU`` for a plain ``nn.PReLU`` (not a subclass with its own forward)."""
    return QPReLU(module) if type(module) is nn.PReLU else None


def integer_prelu(x: torch.Tensor, module: QPReLU, out_point: QuantPoint | None) -> torch.Tensor | None:
    """The integer kernel above, or None where it does not apply (no per-tensor grids, a slope
    point not in fake mode): the float result re-quantized then stands."""
    point = module.weight_point
    if out_point is None or out_point.mode != "fake" or out_point.spec.per_channel:
        return None
    if point is None or point.mode != "fake" or point.spec.group_size is not None or point.spec.dynamic:
        return None
    if not isinstance(x, torch.Tensor):
        return None
    x, in_point = on_grid(x)
    if in_point is None or in_point.spec.per_channel:
        return None
    with torch.no_grad():
        slope = module.quantized_weight().detach()
        s_a = point.scale.detach().double().reshape(-1)
        q_a = torch.round(slope.double().reshape(-1) / s_a).to(torch.int64)  # q_a - z_a (symmetric or not)
    q_x = integer.codes(x, in_point).to(torch.int64)
    shape = [1] * x.dim()
    if q_a.numel() > 1:  # one slope per channel, on dim 1 of the input (dim 0 for a 1-d input)
        shape[1 if x.dim() >= 2 else 0] = -1
    s_x, s_y = in_point.scale.detach().double(), out_point.scale.detach().double()
    positive = integer.fixed_point_multiply(q_x, s_x / s_y)
    negative = integer.fixed_point_multiply(q_x * q_a.reshape(shape), (s_x * s_a / s_y).reshape(shape))
    q = torch.where(q_x >= 0, positive, negative)
    return tag(integer.requantize_codes(q, out_point, None), out_point)


register_module_category(QPReLU, "activation")
