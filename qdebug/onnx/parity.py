"""How far an exported model, run by ONNX Runtime, is from qdebug's quantized stage: ``export_parity``.

Each output value of ONNX Runtime (CPU execution provider, default graph optimizations: the
QDQ groups fused into QLinearConv, QLinearMatMul, ... as a deployment runs them) is compared
with the quantized stage's (``qdebug.engine.convert``: the integer simulation) computing ONNX
Runtime's arithmetic (``float32``, ``qdebug.engine.integer``), in LSB of the output's point:
|ort - qdebug| / scale, rounded to whole steps (both lie on the point's grid).  The result:
``values``, ``within_1_lsb`` (share of values at most 1 LSB apart), ``equal`` (share 0 LSB
apart), ``max_lsb``, ``histogram`` (LSB 0, 1, 2, >2), the same figures against the fixed-point
stage under ``fixed_point``, ``disabled_optimizers`` (ONNX Runtime optimizers the
session had to leave out, see ``PROPAGATION``; [] normally), and what ONNX Runtime runs as int8:
``kernels`` (``ort_kernels``: per op type of the exported graph, how many of its quantized
layers ONNX Runtime's optimized graph runs as an int8 kernel, QLinearConv, QGemm, QLinearAdd
..., and how many in float) and ``float_kernels`` (the exported nodes it runs in float).  NaN
on both sides is agreement; NaN on one side counts >2.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from qdebug.errors import QDebugError
from qdebug.onnx.model_file import read_onnx
from qdebug.onnx.session import cpu_session

BINS = ("0", "1", "2", ">2")


# ONNX Runtime 1.32's QDQ propagation (moving a DequantizeLinear past a Transpose, Slice, Reshape
# ...) writes an invalid QuantizeLinear for an int8 zero point at opset >= 21 ("output_dtype INT8
# does not match y_zero_point type UINT8"), so a graph with 16-bit points and such an op fails to
# load with the default optimizations.  Without that one optimizer it loads, every other fusion on.
PROPAGATION = "QDQPropagationTransformer"

# ONNX Runtime's int8 kernels (its QDQ fusions, CPU execution provider) -> the op they compute.
INT8_KERNELS = {
    "QLinearConv": "Conv", "ConvInteger": "Conv", "QGemm": "Gemm", "QLinearMatMul": "MatMul",
    "MatMulInteger": "MatMul", "MatMulIntegerToFloat": "MatMul", "QLinearAdd": "Add", "QLinearMul": "Mul",
    "QLinearAveragePool": "AveragePool", "QLinearGlobalAveragePool": "GlobalAveragePool",
}
COUNTED = ("Conv", "Gemm", "MatMul", "Add", "Mul", "AveragePool", "GlobalAveragePool")  # the order shown


def ort_session(proto: Any, optimized_path: str | Path | None = None) -> tuple[Any, list[str]]:
    """An ONNX Runtime session (``qdebug.onnx.session``) on the model ``proto``, and the optimizers it
    had to leave out (``PROPAGATION`` when the default set cannot load it); ``optimized_path``:
    where ONNX Runtime writes the graph it optimized (what it runs)."""
    hint = "--no-check writes the model without running it (onnx.checker passes on it)"
    threads = max(torch.get_num_threads(), 1)
    try:
        return cpu_session(proto, "the exported model", hint, threads=threads, optimized_path=optimized_path), []
    except QDebugError as first:  # the default optimizers could not take it: without ORT's buggy one?
        try:
            return cpu_session(proto, "the exported model", hint, threads=threads, optimized_path=optimized_path,
                               disabled_optimizers=[PROPAGATION]), [PROPAGATION]
        except QDebugError:
            raise first from None


def session_and_kernels(proto: Any) -> tuple[Any, list[str], dict[str, dict[str, int]], list[str]]:
    """``ort_session`` on ``proto``, the optimizers it left out, and how ONNX Runtime's optimized
    graph runs the quantized layers (``ort_kernels``: the counts, the layers left in float)."""
    with tempfile.TemporaryDirectory(prefix="qdebug-ort-") as folder:
        optimized_path = Path(folder) / "optimized.onnx"
        session, disabled = ort_session(proto, optimized_path)
        try:
            kernels, float_kernels = ort_kernels(proto, read_onnx(optimized_path))
        except QDebugError:  # a model past 2 GiB: ONNX Runtime's graph is not read back, nothing counted
            kernels, float_kernels = {}, []
    return session, disabled, kernels, float_kernels


def export_parity(proto: Any, quantized: nn.Module, batches: Iterable[Any], *,
                  progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """ONNX Runtime on ``proto`` against ``quantized`` (a converted model) on ``batches`` (each
    a tensor or a tuple of tensors): see the module docstring."""
    from qdebug.engine.arithmetic import ARITHMETICS, computing
    from qdebug.engine.point import grid_of
    from qdebug.onnx.export import flat_outputs, input_tuple

    session, disabled, kernels, float_kernels = session_and_kernels(proto)
    names = [i.name for i in session.get_inputs()]
    tallies = {arithmetic: _Tally() for arithmetic in ARITHMETICS}
    done = 0
    for batch in batches:
        inputs = tuple(x.cpu() for x in input_tuple(batch))  # ONNX Runtime's CPU provider
        if len(inputs) != len(names):
            raise QDebugError(f"the model takes {len(names)} input(s), a batch holds {len(inputs)}",
                              "pass --data whose batches are the model's inputs")
        got = session.run(None, {name: x.detach().cpu().numpy() for name, x in zip(names, inputs)})
        for arithmetic, tally in tallies.items():
            with torch.no_grad(), computing(quantized, arithmetic):
                expected = flat_outputs(quantized(*inputs))
            for k, (want, have) in enumerate(zip(expected, got)):
                point = grid_of(want)
                if point is None or point.spec.per_channel:
                    raise QDebugError(f"output {k} of the quantized model lies on no per-tensor grid (a float "
                                      "output)", "parity is measured in LSB of the output's quant point: quantize "
                                      "the output (or pass --no-check)")
                tally.add(_lsb(torch.as_tensor(have), want.detach().cpu().float(), float(point.scale.detach())))
        done += 1
        if progress is not None:
            progress(done)
    # The figures: against the stage computing ONNX Runtime's arithmetic (the check), and the
    # fixed-point stage's beside them (what a TFLite-style target would compute instead).
    return {"batches": done, **tallies["float32"].figures(), "fixed_point": tallies["fixed_point"].figures(),
            "disabled_optimizers": disabled, "kernels": kernels, "float_kernels": float_kernels}


class _Tally:
    """LSB differences of one comparison, binned (``BINS``), and the largest."""

    def __init__(self) -> None:
        self.counts = [0] * len(BINS)
        self.worst = 0.0

    def add(self, lsb: torch.Tensor) -> None:
        for b in range(len(BINS)):
            self.counts[b] += int((lsb == b).sum()) if b < len(BINS) - 1 else int((lsb > b - 1).sum())
        if lsb.numel():
            self.worst = max(self.worst, float(lsb.max()))

    def figures(self) -> dict[str, Any]:
        values = sum(self.counts)
        return {"values": values, "within_1_lsb": (self.counts[0] + self.counts[1]) / values if values else 1.0,
                "equal": self.counts[0] / values if values else 1.0, "max_lsb": self.worst,
                "histogram": dict(zip(BINS, self.counts))}


def ort_kernels(proto: Any, optimized: Any) -> tuple[dict[str, dict[str, int]], list[str]]:
    """How ONNX Runtime runs the exported model's quantized layers: ``{op: {"int8": n, "float":
    m}}`` for each op of ``COUNTED`` reading a DequantizeLinear in ``proto`` (a layer of the
    quantized graph, not shape arithmetic), and the names of those it runs in float.  A layer
    runs as int8 when ONNX Runtime's ``optimized`` graph holds an int8 kernel of its op
    (``INT8_KERNELS``) carrying its name (its own, or with ONNX Runtime's ``_token_N`` suffix)."""
    dequantized = {out for node in proto.graph.node if node.op_type == "DequantizeLinear" for out in node.output}
    layers = [n for n in proto.graph.node if n.op_type in COUNTED and any(v in dequantized for v in n.input)]
    fused = [(n.name, INT8_KERNELS[n.op_type]) for n in optimized.graph.node if n.op_type in INT8_KERNELS]

    def as_int8(name: str, op: str) -> bool:
        return any(computes == op and (f == name or f.startswith(f"{name}_token_")) for f, computes in fused)

    kernels: dict[str, dict[str, int]] = {}
    in_float = []
    for op in COUNTED:
        mine = [n.name for n in layers if n.op_type == op]
        if mine:
            int8 = sum(as_int8(name, op) for name in mine)
            kernels[op] = {"int8": int8, "float": len(mine) - int8}
            in_float.extend(name for name in mine if not as_int8(name, op))
    return kernels, in_float


def _lsb(have: torch.Tensor, want: torch.Tensor, scale: float) -> torch.Tensor:
    """|have - want| in whole steps of ``scale`` (float64); NaN on both sides 0, on one side inf."""
    have, want = have.to(torch.float64).reshape(-1), want.to(torch.float64).reshape(-1)
    steps = torch.round((have - want).abs() / scale)
    same = (have == want) | (torch.isnan(have) & torch.isnan(want))  # equal infinities too
    steps = torch.where(same, torch.zeros_like(steps), steps)
    return torch.nan_to_num(steps, nan=float("inf"))
