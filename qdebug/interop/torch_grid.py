"""torch's quantized tensors read as grids: ``grid_of`` (scale, zero point, dtype, scheme, axis), the
``SourceQuantizer`` a grid makes, the float weight a quantized one stands for, and torch's short
names of its quantized modules -- shared by the converted-model and dynamic-RNN readers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from qdebug.errors import QDebugError
from qdebug.interop.source import SourceQuantizer

# Integer range of each torch quantized dtype: what its kernels clamp to.
DTYPE_RANGES = {
    "quint8": (0, 255),
    "qint8": (-128, 127),
    "quint4x2": (0, 15),
    "quint2x4": (0, 3),
    "qint32": (-(2**31), 2**31 - 1),
}


@dataclass
class Grid:
    """The quantization grid of one quantized tensor torch computed."""

    scale: torch.Tensor  # float32, 0-d (per tensor) or 1-d (per channel)
    zero_point: torch.Tensor  # int32, same shape
    dtype: str  # "quint8", "qint8", ...
    qscheme: str  # "per_tensor_affine", "per_channel_symmetric", ...
    ch_axis: int = 0



def grid_of(t: Any) -> Grid | None:
    """The grid of a quantized tensor, else None."""
    if not isinstance(t, torch.Tensor) or not t.is_quantized:
        return None
    dtype = str(t.dtype).replace("torch.", "")
    if t.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric,
                       torch.per_channel_affine_float_qparams):
        scale = t.q_per_channel_scales().detach().float().clone()
        zero_point = t.q_per_channel_zero_points().detach().to(torch.int32).clone()
        return Grid(scale, zero_point, dtype, _scheme("per_channel", dtype, zero_point), int(t.q_per_channel_axis()))
    zero_point = torch.tensor(int(t.q_zero_point()), dtype=torch.int32)
    return Grid(torch.tensor(float(t.q_scale()), dtype=torch.float32), zero_point, dtype,
                _scheme("per_tensor", dtype, zero_point))



def _scheme(granularity: str, dtype: str, zero_point: torch.Tensor) -> str:
    # torch stores a symmetric weight as affine with zero point 0: the same grid, named as
    # the observer that made it (per_channel_symmetric) so the engine spec reads "sym".
    symmetric = dtype.startswith("qint") and bool((zero_point == 0).all())
    return f"{granularity}_{'symmetric' if symmetric else 'affine'}"



def quantizer_of(grid: Grid, source: str, kind: str, anchor: str | None, note: str = "") -> SourceQuantizer:
    if grid.dtype not in DTYPE_RANGES:
        raise QDebugError(f"{source}: torch quantized dtype {grid.dtype} is not known here",
                          f"qdebug reads {', '.join(DTYPE_RANGES)}")
    quant_min, quant_max = DTYPE_RANGES[grid.dtype]
    return SourceQuantizer(source, kind, anchor, grid.scale.clone(), grid.zero_point.clone(), quant_min, quant_max,
                           grid.dtype, grid.qscheme, grid.ch_axis, note=note)



def dequantized_weight(w: torch.Tensor) -> torch.Tensor:
    """(q - z) s in float32: the float weight the engine re-quantizes to exactly torch's codes."""
    grid = grid_of(w)
    q = w.int_repr().to(torch.int32)
    if grid.scale.dim():
        shape = [1] * q.dim()
        shape[grid.ch_axis] = -1
        return (q - grid.zero_point.reshape(shape)).float() * grid.scale.reshape(shape)
    return (q - grid.zero_point).float() * grid.scale



def torch_name(module: nn.Module) -> str:
    """``nnq.Conv2d``, ``nniq.ConvReLU2d``, ``nnqd.Linear``: a module as torch's docs name it."""
    where = type(module).__module__
    for prefix, short in (("torch.ao.nn.quantized.dynamic", "nnqd"), ("torch.ao.nn.intrinsic.quantized", "nniq"),
                          ("torch.ao.nn.quantized", "nnq")):
        if where.startswith(prefix):
            return f"{short}.{type(module).__name__}"
    return type(module).__name__
