"""An ONNX model ONNX Runtime quantized (QDQ) -> a ``SourceModel``: one more import front end.

The user's route: ``torch.onnx.export(float_model, ..., dynamo=False)``, then
``onnxruntime.quantization.quantize_static(..., quant_format=QuantFormat.QDQ)``.  The result keeps
torch's node names (``/layer1/layer1.0/conv1/Conv``), so ``qdebug.onnx.names.map_tensors`` says
which engine call each tensor is; ``read_qdq`` reads the QuantizeLinear/DequantizeLinear pairs
onto those calls, as ``qdebug.interop.converted`` reads torch's int8 modules:

- **Weights**: the DequantizeLinear of an integer initializer a Conv/Gemm/MatMul reads as its
  weight is that layer's weight quantizer (its ``axis`` attribute: per channel); the float model
  holds the dequantized weight (q - z) s, so the engine's codes are ORT's exactly.  The bias is
  ORT's int32 one on the scale s_in * s_w, dequantized -- the engine's integer stage computes
  round(b / (s_x s_w)) from it, the same codes (each bias is a report row, ``kind`` bias).
- **BatchNorm**: torch's exporter (eval mode) folded each BN into its conv: the float model gets
  ``nn.Identity`` at the BN's path and the conv the folded weights (``SourceModel.folded_bn``).
- **Activations**: the QuantizeLinear reading tensor T quantizes ``rows[T]``'s output; a
  QuantizeLinear after a value-preserving node (ORT re-quantizes a Flatten's or MaxPool's output
  on its input's grid) quantizes the row under it again -- the same grid, nothing to add.
- The integer range is the zero point's dtype's (uint8 [0, 255], int8, uint16, int16): ORT's
  QuantizeLinear clamps to it whatever range calibration sized the scale on.

Every QuantizeLinear/DequantizeLinear that maps nowhere is an unmapped row with its reason; every
parameter of the float model is read from the file (``--model`` builds the class only): a layer
the file does not hold is refused (another architecture).

The result is stage ``quantized``: ONNX Runtime's CPU execution provider fuses DQ -> Conv -> Q
into QLinearConv (and Add, MatMul, pooling likewise) -- integer kernels, as torch's converted
modules, which the converted import also makes the engine's integer stage.  A group ORT does not
fuse (on x86, a conv or add mixing int8 and uint8 codes) it runs in float32: ``import_qdq`` builds
the model, marks those layers and checks it against ONNX Runtime's own run of the file
(``qdebug.onnx.qdq_check``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from qdebug.engine.modules import without_norm
from qdebug.engine.plan import Plan, trace_plan
from qdebug.errors import QDebugError
from qdebug.interop.source import SourceModel, SourceQuantizer

FLOW = "onnx-qdq"
# ONNX zero-point data type -> (torch-style dtype name, the integer range ORT's QuantizeLinear clamps to)
ZERO_POINT_TYPES = {2: ("quint8", 0, 255), 3: ("qint8", -128, 127), 4: ("quint16", 0, 65535),
                    5: ("qint16", -32768, 32767)}
ONNX_TYPE_NAMES = {2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32"}
ARCHITECTURE_HINT = "pass --model the class (and --model-kwargs) the ONNX model was exported from"


def read_qdq(model: Any, float_model: nn.Module, example_inputs: Any) -> tuple[SourceModel, Plan, list[dict], Any]:
    """The ``SourceModel`` (flow ``onnx-qdq``, stage quantized) of an ORT-quantized QDQ ``model``
    (a ModelProto from ``qdebug.onnx.model_file.read_onnx``), the engine plan of its float model,
    the report rows of ORT's int32 biases, and the ``TensorMap`` of its tensors."""
    from qdebug.interop.eager import _set, trace_float
    from qdebug.onnx.names import graph_of, map_tensors, scope_path

    graph = graph_of(model)
    if not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in graph.nodes):
        raise QDebugError("the ONNX model holds no QuantizeLinear/DequantizeLinear node: it is a float model",
                          "quantize it first: onnxruntime.quantization.quantize_static(..., "
                          "quant_format=QuantFormat.QDQ), or compare it as a float model")
    constants = constant_tensors(model)
    net = copy.deepcopy(float_model).eval()
    modules = {name for name, _ in net.named_modules() if name}
    with torch.no_grad():
        plan0 = trace_plan(net, example_inputs)
    normalized = set()
    for node in graph.nodes:
        if node.op_type == "BatchNormalization" and node.name.startswith("/"):
            found = scope_path(node.name.split("/")[1:-1], modules)
            if found is not None:
                normalized.add(found[0])
    folded = [(conv, bn) for conv, bn in plan0.pairs if bn not in normalized]
    for _, bn in folded:
        _set(net, bn, without_norm(net.get_submodule(bn)))
    with torch.no_grad():
        plan, _, _ = trace_float(net, example_inputs, [bn for _, bn in folded])
    tensors = map_tensors(model, plan, net)
    source = SourceModel(FLOW, "quantized", net, example_inputs, folded_bn=folded)
    reader = _Reader(model, graph, constants, net, source)
    reader.load_layers(tensors, plan)
    reader.load_norms(graph, modules, normalized)
    reader.activations(tensors, plan)
    reader.leftover_dequantizers()
    reader.refuse_unread_parameters()
    return source, plan, reader.bias_rows, tensors


def constant_tensors(model: Any) -> dict[str, Any]:
    """Tensor name -> TensorProto of every initializer and Constant node's value."""
    found = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value" and attribute.HasField("t"):
                    found[node.output[0]] = attribute.t
    return found


def _attribute(node: Any, name: str, default: Any) -> Any:
    from onnx import helper

    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


class _Reader:
    """Reads one graph's quantizers and parameters into ``source`` (``read_qdq``'s steps)."""

    def __init__(self, model: Any, graph: Any, constants: dict, net: nn.Module, source: SourceModel) -> None:
        self.model, self.graph, self.constants, self.net, self.source = model, graph, constants, net, source
        self.used: set[int] = set()  # ids of the Q/DQ nodes read onto something
        self.loaded: set[str] = set()  # float-model parameter/buffer names set from the file
        self.done_layers: set[str] = set()  # layer paths whose weight and bias were read
        self.bias_rows: list[dict] = []  # the report rows of ORT's int32 biases

    # -- values ------------------------------------------------------------------------
    def array(self, name: str) -> torch.Tensor:
        from qdebug.onnx.model_file import tensor_array

        tensor = self.constants.get(name)
        if tensor is None:
            raise QDebugError(f"ONNX tensor {name!r} is computed, not stored: qdebug reads quantization parameters "
                              "and weights stored in the file", "quantize the model with ONNX Runtime's "
                              "quantize_static, which stores them as initializers")
        return torch.from_numpy(tensor_array(tensor).copy())

    def qparams(self, node: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(scale float32, zero point int32, the zero point's ONNX data type) of a Q/DQ node."""
        scale = self.array(node.input[1]).float()
        if len(node.input) > 2 and node.input[2]:
            zp_type = self.constants[node.input[2]].data_type if node.input[2] in self.constants else 0
            zero_point = self.array(node.input[2]).to(torch.int32)
        else:  # ONNX's default zero point: uint8 0
            zp_type, zero_point = 2, torch.zeros_like(scale, dtype=torch.int32)
        return scale, zero_point, zp_type

    def quantizer(self, node: Any, kind: str, anchor: str | None, source: str, note: str = "") -> SourceQuantizer:
        scale, zero_point, zp_type = self.qparams(node)
        dtype, low, high = ZERO_POINT_TYPES.get(zp_type, (ONNX_TYPE_NAMES.get(zp_type, f"type {zp_type}"), 0, 0))
        per_channel = scale.numel() > 1
        signed = dtype.startswith("qint")
        symmetric = signed and bool((zero_point == 0).all())
        qscheme = f"{'per_channel' if per_channel else 'per_tensor'}_{'symmetric' if symmetric else 'affine'}"
        axis = int(_attribute(node, "axis", 1))
        q = SourceQuantizer(source, kind, anchor, scale if per_channel else scale.reshape(()),
                            zero_point if per_channel else zero_point.reshape(()), low, high, dtype, qscheme,
                            axis, note=note)
        if zp_type not in ZERO_POINT_TYPES:
            q.anchor = None
            why = (f"zero point of ONNX type {ONNX_TYPE_NAMES.get(zp_type, zp_type)}: qdebug reads uint8, int8, "
                   "uint16 and int16")
            q.note = "; ".join(n for n in (note, why) if n)
        self.used.add(id(node))
        return q

    def dequantizer_of(self, tensor: str) -> Any | None:
        node = self.graph.producer.get(tensor)
        return node if node is not None and node.op_type == "DequantizeLinear" else None

    # -- weights and biases --------------------------------------------------------------
    def load_layers(self, tensors: Any, plan: Plan) -> None:
        """Every conv/linear call's weight and bias from the file; ORT's weight quantizers."""
        readers = {}
        for node in self.graph.nodes:
            if node.op_type in ("Conv", "Gemm", "MatMul") and len(node.input) > 1:
                readers.setdefault(node.input[1], node)
        bias_of = {layer: tensor for tensor, layer in tensors.biases.items()}
        layers = {}
        for tensor, layer in tensors.weights.items():
            layers.setdefault(layer, tensor)
        for rec in plan.calls.values():
            if rec.category not in ("conv", "linear") or not rec.is_module:
                continue
            path = rec.name.split("#", 1)[0]
            module = self.net.get_submodule(path)
            if not isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)) or path in self.done_layers:
                continue
            tensor = layers.get(path)
            if tensor is None:
                raise QDebugError(f"the ONNX model has no weight for {path!r} ({type(module).__name__}), a layer of "
                                  "--model's forward: it was exported from another architecture",
                                  ARCHITECTURE_HINT)
            weight_scale = self.load_weight(path, module, tensor, readers.get(tensor))
            self.load_bias(path, module, bias_of.get(path), readers.get(tensor), weight_scale)
            self.done_layers.add(path)

    def load_weight(self, path: str, module: nn.Module, tensor: str, node: Any) -> torch.Tensor | None:
        """Read the layer's weight; its weight quantizer's scale (None: ORT left it float)."""
        scale = None
        transposed = node is not None and (node.op_type == "MatMul" or (
            node.op_type == "Gemm" and not _attribute(node, "transB", 0)))
        dq = self.dequantizer_of(tensor)
        if dq is not None and dq.input[0] in self.constants:
            codes = self.array(dq.input[0]).to(torch.int64)
            q = self.quantizer(dq, "weight", path, original_name(dq.input[0]))
            weight = _dequantize(codes, q.scale, q.zero_point, q.ch_axis if q.per_channel else None)
            if transposed:
                weight = weight.t()
                q.ch_axis = 1 - q.ch_axis if q.per_channel else q.ch_axis
            self.source.quantizers.append(q)
            scale = q.scale
        elif tensor in self.constants:  # a weight ORT left float (nodes_to_exclude)
            weight = self.array(tensor).float()
            weight = weight.t() if transposed else weight
        else:
            raise QDebugError(f"the weight of {path!r} ({tensor!r}) is computed in the ONNX graph, not stored",
                              "export the model with torch.onnx.export(..., do_constant_folding=True)")
        if tuple(weight.shape) != tuple(module.weight.shape):
            raise QDebugError(f"{path}: --model's weight has shape {tuple(module.weight.shape)}, the ONNX model's "
                              f"{tuple(weight.shape)}: it was exported from another architecture", ARCHITECTURE_HINT)
        module.weight = nn.Parameter(weight.contiguous())
        self.loaded.add(f"{path}.weight")
        return scale

    def load_bias(self, path: str, module: nn.Module, tensor: str | None, node: Any,
                  weight_scale: torch.Tensor | None) -> None:
        """Read the layer's bias; ORT's int32 one is a report row, checked against s_in * s_w."""
        self.loaded.add(f"{path}.bias")
        if tensor is None:
            module.bias = None
            return
        dq = self.dequantizer_of(tensor)
        if dq is not None and dq.input[0] in self.constants:
            codes = self.array(dq.input[0]).to(torch.int64)
            scale, zero_point, _ = self.qparams(dq)
            self.used.add(id(dq))
            bias = _dequantize(codes, scale, zero_point, 0 if scale.numel() > 1 else None)
            self.bias_rows.append(self.bias_row(dq, path, scale, node, weight_scale))
        elif tensor in self.constants:
            bias = self.array(tensor).float()
        else:
            raise QDebugError(f"the bias of {path!r} ({tensor!r}) is computed in the ONNX graph, not stored",
                              "export the model with torch.onnx.export(..., do_constant_folding=True)")
        if bias.numel() != module.weight.shape[0]:
            raise QDebugError(f"{path}: the ONNX model's bias has {bias.numel()} values for "
                              f"{module.weight.shape[0]} output channels", ARCHITECTURE_HINT)
        module.bias = nn.Parameter(bias.reshape(-1).contiguous())

    def bias_row(self, dq: Any, path: str, scale: torch.Tensor, node: Any, weight_scale: torch.Tensor | None) -> dict:
        """The report row of ORT's int32 bias: exact when its scale is s_in * s_w in float32, which the
        engine's integer stage divides by (round(b / (s_x s_w)) gives ORT's codes back)."""
        status, note = "exact", "int32 on s_in * s_w, as the engine's integer bias"
        feeding = self.dequantizer_of(node.input[0]) if node is not None else None
        if feeding is None or weight_scale is None:
            status, note = "approximate", ("int32 bias of a layer with a float input or weight: the engine "
                                           "re-rounds it on its own s_x * s_w")
        else:
            expected = (self.qparams(feeding)[0].reshape(()) * weight_scale.reshape(-1)).float()
            if expected.numel() != scale.numel() or not torch.allclose(scale.reshape(-1), expected.reshape(-1),
                                                                         rtol=1e-6, atol=0.0):
                status, note = "approximate", ("int32 on a scale other than s_in * s_w: the engine re-rounds it "
                                               "on s_x * s_w")
        return {"source": original_name(dq.input[0]), "kind": "bias", "point": f"{path}.bias", "status": status,
                "spec": "int32", "scale_min": float(scale.min()), "scale_max": float(scale.max()), "note": note}

    def load_norms(self, graph: Any, modules: set[str], normalized: set[str]) -> None:
        """A BatchNormalization the exporter kept (not folded): its parameters and statistics."""
        from qdebug.onnx.names import scope_path

        for node in graph.nodes:
            if node.op_type != "BatchNormalization" or not node.name.startswith("/"):
                continue
            found = scope_path(node.name.split("/")[1:-1], modules)
            if found is None or found[0] not in normalized:
                continue
            bn = self.net.get_submodule(found[0])
            values = [self.array(name).float() for name in node.input[1:5]]
            with torch.no_grad():
                for attr, value in zip(("weight", "bias", "running_mean", "running_var"), values):
                    target = getattr(bn, attr, None)
                    if target is None or target.shape != value.shape:
                        raise QDebugError(f"{found[0]}: the ONNX model's BatchNormalization holds {tuple(value.shape)} "
                                          f"values for {attr}", ARCHITECTURE_HINT)
                    target.copy_(value)
                    self.loaded.add(f"{found[0]}.{attr}")
            bn.eps = float(_attribute(node, "epsilon", bn.eps))

    # -- activations -----------------------------------------------------------------------
    def activations(self, tensors: Any, plan: Plan) -> None:
        from qdebug.onnx.names import _source_row

        found = []
        for node in self.graph.nodes:
            if node.op_type != "QuantizeLinear":
                continue
            tensor = node.input[0]
            if tensor in self.constants:
                found.append(self.quantizer(node, "weight", None, node.name,
                                            "quantizes a stored tensor at run time that no layer reads as a weight"))
                continue
            row = tensors.rows.get(tensor)
            note = _removed_activation(tensor, self.graph.producer.get(tensor))
            if row is None:
                row = _source_row(self.graph, tensor, tensors.rows)
                if row is not None:
                    note = f"{row!r}'s value after a {self.graph.producer[tensor].op_type}, quantized again by ORT"
            q = self.quantizer(node, "activation", row, original_name(tensor), note)
            if row is None:
                why = next((w for t, w in tensors.unmatched if t == tensor), "no engine call computes this tensor")
                q.note = f"ORT's QuantizeLinear {node.name}: {why}"
            found.append(q)
            for dq in self.graph.readers.get(node.output[0], []):
                if dq.op_type == "DequantizeLinear":
                    self.used.add(id(dq))
                    theirs = self.qparams(dq)
                    if not (torch.equal(theirs[0].flatten(), q.scale.flatten()) and
                            torch.equal(theirs[1].flatten(), q.zero_point.flatten())):
                        q.approximate = True
                        q.note = "; ".join(n for n in (q.note, f"its DequantizeLinear {dq.name} reads other qparams") if n)
        # A tensor quantized both before and after a ReLU the engine fuses into the layer (ORT keeps
        # the Relu with symmetric activations): the ReLU's quantizer first, so the layer's own stays
        # on the layer (``build._place`` moves it onto a ReLU nobody quantizes).
        relu = [q for q in found if q.anchor and plan.calls.get(q.anchor) is not None
                and plan.calls[q.anchor].category in ("relu", "relu6")]
        self.source.quantizers += relu + [q for q in found if q not in relu]

    def leftover_dequantizers(self) -> None:
        """A DequantizeLinear read onto nothing (a weight of a layer the plan has no point for)."""
        for node in self.graph.nodes:
            if node.op_type == "DequantizeLinear" and id(node) not in self.used:
                readers = ", ".join(sorted({r.name for r in self.graph.readers.get(node.output[0], [])})) or "nothing"
                kind = "weight" if node.input[0] in self.constants else "activation"
                self.source.quantizers.append(self.quantizer(
                    node, kind, None, original_name(node.input[0]),
                    f"ORT's DequantizeLinear {node.name} (read by {readers}) maps to no engine point"))

    def refuse_unread_parameters(self) -> None:
        """Every parameter and statistic the engine model computes with came from the file."""
        folded = {bn for _, bn in self.source.folded_bn}
        for name, _ in [*self.net.named_parameters(), *self.net.named_buffers()]:
            owner = name.rpartition(".")[0]
            if name in self.loaded or owner in folded or name.endswith("num_batches_tracked"):
                continue
            raise QDebugError(f"the ONNX model holds no value for --model's {name!r}: qdebug reads conv and linear "
                              "weights and BatchNorm statistics from the file",
                              f"check that the file was exported from --model's class; {ARCHITECTURE_HINT}")


def _removed_activation(tensor: str, producer: Any) -> str:
    """The note of a tensor named after a Relu/Clip that ORT removed: its producer (a Conv, Gemm)
    now makes it, and the QuantizeLinear's range (zero point at its low end) clamps as it did."""
    from qdebug.onnx.names import _OUTPUT_NAME

    named = _OUTPUT_NAME.match(original_name(tensor))
    op = named.group("node").rsplit("/", 1)[-1].rstrip("_0123456789") if named else ""
    if producer is None or op not in ("Relu", "Clip") or producer.op_type in ("Relu", "Clip"):
        return ""
    return f"ORT removed this {op}: {producer.name}'s output is quantized on its grid, which clamps as the {op} did"


def original_name(name: str) -> str:
    """The float model's name of a tensor ORT renamed: a weight's ``W_quantized`` is ``W``; a graph
    output it quantized, ``Y_QuantizeLinear_Input``, is ``Y`` -- the names quantize_static's
    options (TensorQuantOverrides, nodes_to_exclude) take."""
    for suffix in ("_QuantizeLinear_Input", "_quantized"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int | None) -> torch.Tensor:
    """(q - z) s in float32 (per channel along ``axis``)."""
    if axis is not None and scale.numel() > 1:
        shape = [1] * codes.dim()
        shape[axis] = -1
        scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
    return (codes - zero_point.to(torch.int64)).float() * scale.float()


NODES_ATTR = "onnx_nodes"  # on the engine state; ``qdebug import`` saves it as the checkpoint's meta["onnx_nodes"]


def tensor_nodes(model: Any) -> dict[str, list[str]]:
    """ORT-quantized tensor (its float-model name) -> the float model's nodes that make and read it:
    what ``quantize_static``'s ``nodes_to_exclude`` must name to leave that tensor float (ORT
    quantizes a tensor when any node next to it is quantized).  The maker is the exporter's node
    whose ``<node>_output_<i>`` the tensor is (a Relu ORT removed is in the float model still)."""
    from qdebug.onnx.names import _OUTPUT_NAME, graph_of

    graph = graph_of(model)
    found: dict[str, list[str]] = {}
    for node in graph.nodes:
        if node.op_type != "QuantizeLinear":
            continue
        tensor = original_name(node.input[0])
        named = _OUTPUT_NAME.match(tensor)
        producer = graph.producer.get(node.input[0])
        names = [named.group("node")] if named else [producer.name] if producer is not None else []
        for dq in graph.readers.get(node.output[0], []):
            names += [r.name for r in graph.readers.get(dq.output[0], []) if r.op_type not in ("QuantizeLinear",
                                                                                              "DequantizeLinear")]
        found.setdefault(tensor, [])
        found[tensor] += [n for n in names if n and n not in found[tensor]]
    return found
