"""A calibrated, QAT or quantized model as a QDQ ONNX model: ``export_onnx``.

The graph is the quantized stage's (``qdebug.engine.convert.export_graph``: BN folded as
``convert`` folds it, weight qparams frozen) traced by torch's TorchScript exporter with every
quant point as one ``qdebug::QuantizeDequantize`` node that carries the point's index in the
traced forward.  Each such node is then written out with the ``onnx`` library from the
engine's own values, named by the point P (docs/onnx.md, "Export"):

- activation: [``P/Clip`` when the point's range is narrower than its storage type] ->
  ``P/QuantizeLinear`` -> ``P/quantized`` -> ``P/DequantizeLinear`` -> ``P/dequantized``;
- weight: the integer codes (``quantize_to_int``, as ``convert`` stores them) as the
  initializer ``P/quantized`` -> ``P/DequantizeLinear`` -> ``P/dequantized`` (per channel on
  the point's axis), as ONNX Runtime's own quantizer writes weights;
- ``P/scale`` (float32) and ``P/zero_point`` (the storage type: int8/uint8, int16/uint16; an
  affine int8 activation as uint8, codes and zero point + 128: ``_stored_as_uint8``).

Written for ONNX Runtime's fusions, with the same values: the uint8 activations (its x86
kernels' type, which it cannot convert a value several layers read to itself) and a pair
repeated after a Flatten/Reshape/... (``_requantize_after_moves``), so that every Conv, Add,
Gemm reading quantized values runs as its int8 kernel (``qdebug.onnx.parity`` counts them).

8-bit storage needs opset 13, 16-bit opset 21 (torch's exporter writes at most 20: opset 21
changed no operator but by widening its types, so the graph is declared 21 as it is).  The
model's metadata ``qdebug.export`` lists the points with their rows (the engine calls they
quantize).  A float (unprepared) model is exported by torch unchanged: torch's names, the
file ONNX Runtime's ``quantize_static`` takes.  What QDQ cannot express is refused.
"""

from __future__ import annotations

import io
import json
import re
import warnings
from typing import Any

import torch
import torch.nn as nn

from qdebug.errors import QDebugError, message_of
from qdebug.onnx.model_file import require
from qdebug.safe_text import one_line

MIN_OPSET = 13  # per-axis QuantizeLinear/DequantizeLinear
INT16_OPSET = 21  # 16-bit QuantizeLinear/DequantizeLinear
EXPORTER_MAX_OPSET = 20  # torch's TorchScript exporter
MAX_OPSET = 23  # the newest opset this export declares (ONNX Runtime 1.2x runs it)
DOMAIN = "qdebug"
NODE = "QuantizeDequantize"
METADATA_KEY = "qdebug.export"
UINT8_SHIFT = 128  # int8 code + 128 = the uint8 code of the same value (``_stored_as_uint8``)
# Ops that move or reshape values without computing new ones: their output lies on their
# input's grid, so a QuantizeLinear/DequantizeLinear pair of the input's qparams after them is
# exact -- and lets ONNX Runtime fuse the layer reading them (a Gemm after a Flatten).
MOVES = ("Flatten", "Reshape", "Squeeze", "Unsqueeze", "Transpose")


def export_onnx(model: nn.Module, example_inputs: Any, *, opset: int | None = None,
                stage: str | None = None) -> tuple[Any, dict[str, Any]]:
    """``model`` as an ``onnx.ModelProto`` (checked) and what was exported.

    ``example_inputs``: a tensor or a tuple of tensors the model is traced with (the batch axis
    stays dynamic).  ``opset``: at least the lowest the points need (13, 21 with 16-bit points).
    ``stage``: the checkpoint's stage, recorded in the metadata.  The info dict: ``stage``,
    ``opset``, ``points`` (exported), ``weights``, ``activations``, ``float_points`` (left in
    float mode: no QDQ), ``inputs``, ``outputs`` (graph names).
    """
    onnx = require("onnx")
    from qdebug.engine.prepare import is_prepared

    inputs = input_tuple(example_inputs)
    check_opset(opset)
    if not is_prepared(model):
        return _export_float(onnx, model, inputs, opset or MIN_OPSET)
    return _export_quantized(onnx, model, inputs, opset, stage)


def check_opset(opset: int | None) -> None:
    """Refuse an opset this export cannot declare (None: the lowest the points need)."""
    if opset is not None and not MIN_OPSET <= opset <= MAX_OPSET:
        raise QDebugError(f"--opset {opset} is outside the opsets qdebug exports ({MIN_OPSET}-{MAX_OPSET})",
                          f"e.g. --opset {MIN_OPSET} (8-bit) or {INT16_OPSET} (16-bit points)")


# -- float ----------------------------------------------------------------------------------
def _export_float(onnx, model: nn.Module, inputs: tuple, opset: int) -> tuple[Any, dict[str, Any]]:
    with torch.no_grad():
        outputs = flat_outputs(model.eval()(*inputs))
    proto = _trace(onnx, model, inputs, len(outputs), min(opset, EXPORTER_MAX_OPSET), outputs)
    _declare_opset(proto, opset)
    _set_metadata(proto, "float", [])
    _check(onnx, proto)
    info = {"stage": "float", "opset": opset, "points": 0, "weights": 0, "activations": 0, "float_points": [],
            **_io_names(proto)}
    return proto, info


# -- quantized --------------------------------------------------------------------------------
def _export_quantized(onnx, model: nn.Module, inputs: tuple, opset: int | None,
                      stage: str | None) -> tuple[Any, dict[str, Any]]:
    from qdebug.engine.convert import export_graph
    from qdebug.engine.export_mode import exporting
    from qdebug.engine.prepare import engine_state

    state = engine_state(model)
    active = {name: p for name, p in state.points.items() if p.mode != "float"}
    refuse_inexpressible(active)
    needed = INT16_OPSET if any(p.spec.bits > 8 for p in active.values()) else MIN_OPSET
    if opset is not None and opset < needed:
        wide = next(n for n, p in active.items() if p.spec.bits > 8)
        raise QDebugError(f"quant point {wide!r} is {active[wide].spec.dtype_name}: 16-bit QuantizeLinear needs "
                          f"opset {INT16_OPSET}, not {opset}", f"pass --opset {INT16_OPSET} (or leave --opset out)")
    opset = opset or needed
    graph = export_graph(model)
    _register_symbolic()
    with torch.no_grad():
        outputs = flat_outputs(graph(*inputs))
    with exporting() as recorder:
        proto = _trace(onnx, graph, inputs, len(outputs), min(opset, EXPORTER_MAX_OPSET), outputs,
                       custom=bool(active))
    applied = recorder.applied
    _write_points(proto, applied)
    _remove_no_ops(proto)
    _remove_unused(proto)
    _requantize_after_moves(proto)
    _declare_opset(proto, opset)
    points = _unique_points(applied)
    rows = _rows(engine_state(graph))
    stage = stage or ("quantized" if state.stage == "quantized" else "calibrated")
    _set_metadata(proto, stage, [
        {"name": p.name, "kind": p.kind, "row": p.owner if p.kind == "weight" else rows.get(p.name, p.name),
         "spec": p.spec.describe()} for p in points])
    _check(onnx, proto)
    info = {
        "stage": stage, "opset": opset, "points": len(points),
        "weights": sum(p.kind == "weight" for p in points), "activations": sum(p.kind == "activation" for p in points),
        "float_points": [n for n, p in state.points.items() if p.mode == "float"], **_io_names(proto),
    }
    return proto, info


def refuse_inexpressible(points: dict) -> None:
    """One ``QDebugError`` naming the first point QDQ cannot express: dynamic (per-batch or
    per-token) activations, grouped weights, a narrow range on a per-channel activation."""
    for name, point in points.items():
        spec = point.spec
        if spec.dynamic:
            raise QDebugError(
                f"quant point {name!r} ({spec.describe()}) computes its scale from each batch at run time, which a "
                "QDQ graph cannot express (its QuantizeLinear takes a fixed scale)",
                "give the point a calibrated spec (dynamic = false) and calibrate, or export the float model")
        if spec.group_size is not None:
            raise QDebugError(
                f"quant point {name!r} ({spec.describe()}): grouped weights need blocked quantization, which "
                "qdebug's QDQ export does not write", "drop group_size (per-channel weights export)")
        if point.kind == "activation" and spec.per_channel and _narrow(spec):
            raise QDebugError(
                f"quant point {name!r} ({spec.describe()}): a per-channel activation on a range narrower than its "
                "storage type has no QDQ form here (Clip takes one bound)",
                "use a per-tensor activation spec, or the full 8/16-bit range")


# -- the traced graph ---------------------------------------------------------------------------
def _trace(onnx, model: nn.Module, inputs: tuple, n_outputs: int, opset: int, outputs: list,
           custom: bool = False) -> Any:
    """torch's TorchScript exporter on ``model`` (dynamic batch axis), as a ModelProto; its
    failure (an op it cannot export) as one QDebugError naming the op."""
    input_names = _names("input", len(inputs))
    output_names = _names("output", n_outputs)
    dynamic = {name: {0: "batch"} for name, x in zip(input_names, inputs) if x.dim()}
    dynamic.update({name: {0: "batch"} for name, y in zip(output_names, outputs) if y.dim()})
    buffer = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
            torch.onnx.export(model, inputs, buffer, dynamo=False, opset_version=opset, input_names=input_names,
                              output_names=output_names, dynamic_axes=dynamic,
                              custom_opsets={DOMAIN: 1} if custom else None,
                              do_constant_folding=True)
    except QDebugError:
        raise
    except Exception as exc:
        raise _exporter_error(exc) from None
    return onnx.load_model_from_string(buffer.getvalue())


def _exporter_error(exc: BaseException) -> QDebugError:
    text = message_of(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    op = re.search(r"\b(aten|prim|onnx|quantized|qdebug)::[A-Za-z0-9_.]+", text)
    what = f"op {op.group(0)}" if op else "the model"
    return QDebugError(f"torch's ONNX exporter cannot export {what}: {one_line(first, limit=240)}",
                       "export the layer's float version (leave its points in float mode), or replace the op "
                       "with one ONNX has")


def _names(base: str, count: int) -> list[str]:
    return [base] if count == 1 else [f"{base}_{k}" for k in range(count)]


def input_tuple(example_inputs: Any) -> tuple:
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not inputs or not all(isinstance(x, torch.Tensor) for x in inputs):
        raise QDebugError("ONNX export needs the model's inputs as a tensor or a tuple of tensors",
                          "pass --data whose batches are tensors (a dict of keyword inputs is not exported)")
    return inputs


def flat_outputs(output: Any) -> list[torch.Tensor]:
    """The tensors of a model output in the order torch's exporter makes them graph outputs."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in flat_outputs(item)]
    return []


_REGISTERED = False


def _register_symbolic() -> None:
    """``qdebug::quantize_dequantize`` -> one ``qdebug::QuantizeDequantize`` node holding the
    index of its call (``_write_points`` writes the real nodes from the engine's values)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from torch.onnx import symbolic_helper

    from qdebug.engine.export_mode import OP_NAME

    @symbolic_helper.parse_args("v", "v", "v", "i", "i", "i", "i")
    def symbolic(g, x, scale, zero_point, axis, qmin, qmax, index):
        out = g.op(f"{DOMAIN}::{NODE}", x, index_i=index)
        out.setType(x.type())
        return out

    torch.onnx.register_custom_op_symbolic(OP_NAME, symbolic, MIN_OPSET)
    _REGISTERED = True


# -- writing the points --------------------------------------------------------------------------
def _storage(spec) -> tuple[Any, int, int]:
    """(numpy dtype, its qmin, its qmax) of the integer type a spec's codes are stored in: the
    smallest of int8/uint8, int16/uint16 that holds the range."""
    import numpy as np

    if spec.signed:
        return (np.int8, -128, 127) if spec.bits <= 8 else (np.int16, -2**15, 2**15 - 1)
    return (np.uint8, 0, 255) if spec.bits <= 8 else (np.uint16, 0, 2**16 - 1)


def _narrow(spec) -> bool:
    _, low, high = _storage(spec)
    return (spec.qmin, spec.qmax) != (low, high)


def _write_points(proto: Any, applied: list) -> None:
    """Each ``qdebug::QuantizeDequantize`` node replaced by the point's QDQ nodes and initializers."""
    from onnx import helper, numpy_helper

    graph = proto.graph
    initializers = {t.name: t for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    renamed: dict[str, str] = {}
    seen: dict[str, int] = {}
    nodes = []
    for node in graph.node:
        if node.domain != DOMAIN:
            nodes.append(node)
            continue
        index = next(a.i for a in node.attribute if a.name == "index")
        if not 0 <= index < len(applied):
            raise RuntimeError(f"internal error: exported point index {index} of {len(applied)} applied")
        point, received = applied[index].point, applied[index].received
        name = point.name
        count = seen[name] = seen.get(name, 0) + 1
        if count == 1:
            scale, zero_point = _qparams(point)
            graph.initializer.extend([numpy_helper.from_array(scale, f"{name}/scale"),
                                      numpy_helper.from_array(zero_point, f"{name}/zero_point")])
            if point.kind == "activation" and _narrow(point.spec):
                low, high = _clip_bounds(point)
                graph.initializer.extend([numpy_helper.from_array(low, f"{name}/clip_min"),
                                          numpy_helper.from_array(high, f"{name}/clip_max")])
        axis = {"axis": _axis(point, received)} if point.spec.per_channel else {}
        if point.kind == "weight":
            if count == 1:
                _check_weight_input(node.input[0], initializers, producers, received, name)
                codes = _weight_codes(point, received)
                graph.initializer.append(numpy_helper.from_array(codes, f"{name}/quantized"))
                nodes.append(helper.make_node("DequantizeLinear", [f"{name}/quantized", f"{name}/scale",
                                                                   f"{name}/zero_point"], [f"{name}/dequantized"],
                                              name=f"{name}/DequantizeLinear", **axis))
            renamed[node.output[0]] = f"{name}/dequantized"
            continue
        tag = "" if count == 1 else f"_{count}"  # a point applied again (a shared module's second call)
        source = node.input[0]
        if _narrow(point.spec):
            nodes.append(helper.make_node("Clip", [source, f"{name}/clip_min", f"{name}/clip_max"],
                                          [f"{name}/clipped{tag}"], name=f"{name}/Clip{tag}"))
            source = f"{name}/clipped{tag}"
        qparams = [f"{name}/scale", f"{name}/zero_point"]
        nodes.append(helper.make_node("QuantizeLinear", [source, *qparams], [f"{name}/quantized{tag}"],
                                      name=f"{name}/QuantizeLinear{tag}", **axis))
        nodes.append(helper.make_node("DequantizeLinear", [f"{name}/quantized{tag}", *qparams],
                                      [f"{name}/dequantized{tag}"], name=f"{name}/DequantizeLinear{tag}", **axis))
        renamed[node.output[0]] = f"{name}/dequantized{tag}"
    outputs = {o.name for o in graph.output}
    for node in nodes:
        for k, value in enumerate(node.input):
            if value in renamed:
                node.input[k] = renamed[value]
    for old, new in renamed.items():
        if old in outputs:  # a graph output that is a point's value keeps its name: an Identity gives it
            nodes.append(helper.make_node("Identity", [new], [old], name=f"{old}/Identity"))
    del graph.node[:]
    graph.node.extend(nodes)
    _drop_domain(proto)


def _qparams(point) -> tuple[Any, Any]:
    """(scale, zero point) as written: the zero point in the storage type, an affine int8
    activation's shifted to uint8 (``_stored_as_uint8``)."""
    import numpy as np

    dtype, _, _ = _storage(point.spec)
    scale = point.scale.detach().to(torch.float32).cpu().numpy()
    zero_point = point.zero_point.detach().cpu().numpy().astype(np.int32)
    if _stored_as_uint8(point):
        return scale, (zero_point + UINT8_SHIFT).astype(np.uint8)
    return scale, zero_point.astype(dtype)


def _stored_as_uint8(point) -> bool:
    """An affine (asymmetric) 8-bit signed activation is written as uint8, codes and zero point
    + 128: the same values (``(q + 128) - (z + 128) = q - z``, the same saturation), and what
    ONNX Runtime's x86 optimizer converts an int8 pair to itself (``QDQS8ToU8Transformer``) --
    except for a QuantizeLinear read by several DequantizeLinear nodes (a value several layers
    read), which it leaves int8, so the QLinearConv/QLinearAdd reading it mix int8 and uint8 and
    stay float.  A symmetric one (zero point 0: TensorRT's and most NPUs' form) stays int8."""
    spec = point.spec
    return point.kind == "activation" and spec.signed and spec.bits <= 8 and not spec.symmetric


def _axis(point, received: torch.Tensor | None) -> int:
    axis = point.spec.ch_axis
    ndim = received.dim() if received is not None else None
    return axis + ndim if axis < 0 and ndim is not None else axis


def _weight_codes(point, weight: torch.Tensor) -> Any:
    """The weight's integer codes in the storage type (``quantize_to_int``: what ``convert`` stores)."""
    from qdebug.engine.fake_quant import quantize_to_int

    dtype, _, _ = _storage(point.spec)
    scale, zero_point = point.qparams()
    return quantize_to_int(weight.float(), scale, zero_point, point.spec).cpu().numpy().astype(dtype)


def _clip_bounds(point) -> tuple[Any, Any]:
    """A narrow range's float ends, (qmin - z) s and (qmax - z) s: a Clip to them is exact (every
    value between rounds to a code inside the range)."""
    import numpy as np

    s = np.float32(point.scale.detach().float().item())
    z = int(point.zero_point.item())
    return np.array((point.spec.qmin - z) * s, dtype=np.float32), np.array((point.spec.qmax - z) * s, dtype=np.float32)


def _check_weight_input(value: str, initializers: dict, producers: dict, received: torch.Tensor, name: str) -> None:
    """The traced weight tensor is the one the point quantized (an internal error if not): the
    node reading it is this point's."""
    from onnx import numpy_helper

    while value not in initializers and value in producers and producers[value].op_type == "Identity":
        value = producers[value].input[0]
    if value not in initializers:
        return  # computed in the graph (no initializer to compare with)
    stored = numpy_helper.to_array(initializers[value])
    if stored.shape != tuple(received.shape) or not (stored == received.float().cpu().numpy()).all():
        raise RuntimeError(f"internal error: the exported weight {value!r} is not the tensor point {name!r} "
                           "quantized in the traced forward")


def _unique_points(applied: list) -> list:
    return list({id(a.point): a.point for a in applied}.values())


def _rows(state) -> dict[str, str]:
    """Activation point name -> the engine call whose output it quantizes (compare's row)."""
    return {name: rec.name for rec in state.plan.calls.values() for name in rec.point_names()}


# -- graph hygiene ----------------------------------------------------------------------------------
def _remove_no_ops(proto: Any) -> None:
    """Nodes that pass a tensor on unchanged bypassed, except those that name a graph output:
    the Identity nodes the exporter left (shared initializers) and the float32 Cast of a
    dequantized weight (the layer's ``weight.to(x.dtype)``), which would stand between a
    DequantizeLinear and its layer and keep ONNX Runtime from fusing them."""
    from onnx import TensorProto

    graph = proto.graph
    outputs = {o.name for o in graph.output}
    dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}

    def no_op(node) -> bool:
        if node.op_type == "Identity":
            return True
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        return node.op_type == "Cast" and to == TensorProto.FLOAT and node.input[0] in dequantized

    bypass = {n.output[0]: n.input[0] for n in graph.node if no_op(n) and n.output[0] not in outputs}

    def source(value: str) -> str:
        while value in bypass:
            value = bypass[value]
        return value

    kept = [n for n in graph.node if not (no_op(n) and n.output[0] in bypass)]
    for node in kept:
        for k, value in enumerate(node.input):
            node.input[k] = source(value)
    del graph.node[:]
    graph.node.extend(kept)


def _requantize_after_moves(proto: Any) -> None:
    """A QuantizeLinear/DequantizeLinear pair after each op of ``MOVES`` that reads a per-tensor
    activation's dequantized value and is read by no QuantizeLinear: the input's scale and zero
    point (exact: the values lie on that grid), named by the point and the op:
    ``P/QuantizeLinear/Flatten`` -> ``P/quantized/Flatten`` -> ``P/DequantizeLinear/Flatten`` ->
    ``P/dequantized/Flatten``.  ONNX Runtime fuses DequantizeLinear -> Gemm -> QuantizeLinear
    into a QGemm only when the Gemm reads a DequantizeLinear, not a Flatten between (its own
    quantizer writes the same pair)."""
    from onnx import helper

    graph = proto.graph
    outputs = {o.name for o in graph.output}
    producers = {out: node for node in graph.node for out in node.output}
    readers: dict[str, list] = {}
    for node in graph.node:
        for value in node.input:
            readers.setdefault(value, []).append(node)
    grids = {}  # a dequantized activation value -> its DequantizeLinear (the qparams to requantize with)
    for node in graph.node:
        source = producers.get(node.input[0]) if node.input else None
        if (node.op_type == "DequantizeLinear" and source is not None and source.op_type == "QuantizeLinear"
                and not any(a.name == "axis" for a in node.attribute) and len(node.input) > 2):
            grids[node.output[0]] = node
    nodes = []
    for node in graph.node:
        nodes.append(node)
        if node.op_type not in MOVES or not node.input or node.input[0] not in grids:
            continue
        value = node.output[0]
        after = readers.get(value, [])
        if not after or value in outputs or any(r.op_type == "QuantizeLinear" for r in after):
            continue
        dq = grids[node.input[0]]
        point = dq.name.rsplit("/DequantizeLinear", 1)[0]
        where = node.name if node.name.startswith("/") else f"/{node.name or value}"
        qparams = list(dq.input[1:3])
        nodes.append(helper.make_node("QuantizeLinear", [value, *qparams], [f"{point}/quantized{where}"],
                                      name=f"{point}/QuantizeLinear{where}"))
        nodes.append(helper.make_node("DequantizeLinear", [f"{point}/quantized{where}", *qparams],
                                      [f"{point}/dequantized{where}"], name=f"{point}/DequantizeLinear{where}"))
        for reader in after:
            for k, name in enumerate(reader.input):
                if name == value:
                    reader.input[k] = f"{point}/dequantized{where}"
        grids[f"{point}/dequantized{where}"] = dq  # a Reshape after the Flatten: requantized again
    del graph.node[:]
    graph.node.extend(nodes)


def _remove_unused(proto: Any) -> None:
    """Nodes none of whose outputs reach a graph output, and initializers nothing reads."""
    graph = proto.graph
    needed = {o.name for o in graph.output}
    kept = []
    for node in reversed(list(graph.node)):
        if any(out in needed for out in node.output):
            kept.append(node)
            needed.update(v for v in node.input if v)
    kept.reverse()
    del graph.node[:]
    graph.node.extend(kept)
    initializers = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    del graph.value_info[:]  # shapes of tensors that were renamed or removed: recomputed by who needs them


def _drop_domain(proto: Any) -> None:
    kept = [o for o in proto.opset_import if o.domain != DOMAIN]
    del proto.opset_import[:]
    proto.opset_import.extend(kept)


def _declare_opset(proto: Any, opset: int) -> None:
    for entry in proto.opset_import:
        if entry.domain in ("", "ai.onnx"):
            entry.version = opset


def _set_metadata(proto: Any, stage: str, points: list[dict]) -> None:
    import qdebug

    entry = proto.metadata_props.add()
    entry.key = METADATA_KEY
    entry.value = json.dumps({"version": qdebug.__version__, "stage": stage, "points": points})
    proto.producer_name = "qdebug"
    proto.producer_version = qdebug.__version__


def _check(onnx, proto: Any) -> None:
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as exc:
        raise RuntimeError(f"internal error: the exported model fails onnx.checker: {message_of(exc)}") from None


def _io_names(proto: Any) -> dict[str, list[str]]:
    initializers = {t.name for t in proto.graph.initializer}
    return {"inputs": [i.name for i in proto.graph.input if i.name not in initializers],
            "outputs": [o.name for o in proto.graph.output]}
