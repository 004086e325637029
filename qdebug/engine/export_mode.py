"""How quant points compute while an exporter traces the quantized stage: ``exporting``.

An exporter (``qdebug.onnx.export``) traces a model whose quant points must appear in the
graph as quantize-dequantize pairs, not as the engine's autograd kernels, and whose numbers
are those of the quantized stage: BN folded as ``convert`` folds it, weight qparams frozen,
observe -> fake.  ``qdebug.engine.convert.export_graph`` makes that model (a converted copy,
run in fake quant; it lives with ``convert``, which it runs), and inside ``exporting`` every point in ``fake`` mode computes through one op,
``qdebug::quantize_dequantize(x, scale, zero_point, axis, qmin, qmax, index)`` (``axis`` -1
per tensor, ``index`` the call's place in the recorded order), whose eager body is the
engine's own fake quant (same bits) and which the exporter turns into QuantizeLinear ->
DequantizeLinear.  The points are recorded in the order they are applied, a weight point with
the tensor it received (its integer codes come from it).

The engine knows no files: what the graph is written as is the exporter's business.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

OP_NAME = "qdebug::quantize_dequantize"

# The recorder of the ``exporting`` block in progress (``QuantPoint.apply`` hands it every
# fake-mode call), else None.
active: "Recorder | None" = None


@dataclass
class Applied:
    """One application of a point during the exported forward: the point and what it received."""

    point: "object"  # qdebug.engine.point.QuantPoint
    received: torch.Tensor | None  # a weight point's input (its codes come from it); None for an activation


class Recorder:
    """Replaces each fake-mode point's kernel with the exportable op and records the calls."""

    def __init__(self) -> None:
        self.applied: list[Applied] = []

    def apply(self, point, x: torch.Tensor) -> torch.Tensor:
        from qdebug.engine.fake_quant import channel_axis
        from qdebug.errors import QDebugError

        if not point.initialized:
            raise QDebugError(f"quant point {point.name!r} has no scale yet",
                              "calibrate the model before exporting it (or leave the point in float mode)")
        spec = point.spec
        axis = channel_axis(spec, x.dim()) if spec.per_channel else -1
        index = len(self.applied)
        self.applied.append(Applied(point, x.detach() if point.kind == "weight" else None))
        out = quantize_dequantize_op()(x, point.scale.detach(), point.zero_point, axis, spec.qmin, spec.qmax, index)
        out._qdebug_point = point
        return out


@contextlib.contextmanager
def exporting() -> Iterator[Recorder]:
    """Within the block, every point in ``fake`` mode emits ``qdebug::quantize_dequantize``;
    yields the recorder whose ``applied`` lists the calls in order."""
    global active
    if active is not None:
        raise RuntimeError("exporting() blocks do not nest")
    active = Recorder()
    try:
        yield active
    finally:
        active = None


def _eager(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, qmin: int, qmax: int,
           index: int) -> torch.Tensor:
    """The op's body: the engine's fake quant (``index``, the call's place in the traced forward,
    is for the exporter)."""
    from qdebug.engine.fake_quant import fake_quantize

    return fake_quantize(x, scale, zero_point, range_spec(qmin, qmax, axis))


def range_spec(qmin: int, qmax: int, axis: int = -1):
    """The ``QuantSpec`` (bits, signedness, narrow range, per-channel axis) of an integer range."""
    from qdebug.engine.spec import QuantSpec

    signed = qmin < 0
    bits = (qmax - qmin).bit_length()
    narrow = signed and qmin == -qmax
    return QuantSpec(bits=bits, signed=signed, narrow_range=narrow, per_channel=axis >= 0, ch_axis=max(axis, 0))


_OP = None


def quantize_dequantize_op():
    """``torch.ops.qdebug.quantize_dequantize``, registered on first use (not at import: the
    engine loads without it)."""
    global _OP
    if _OP is None:
        _OP = torch.library.custom_op(OP_NAME, mutates_args=())(_eager)
        _OP.register_fake(lambda x, scale, zero_point, axis, qmin, qmax, index: torch.empty_like(x))
    return _OP
