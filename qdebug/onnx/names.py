"""Which tensor of a torch-exported ONNX graph is which engine call: ``map_tensors``.

torch's TorchScript exporter (``torch.onnx.export(..., dynamo=False)``) names every node after
the module scope it ran in and its op: ``/layer1/layer1.0/conv1/Conv``, ``/layer1/layer1.0/Add_1``,
a module's second call ``/layer1/layer1.0/relu_1/Relu``; a node's outputs are ``<node>_output_<i>``.
ONNX Runtime's quantizer keeps those names, inserts QuantizeLinear/DequantizeLinear pairs after a
tensor ``T`` (``T_QuantizeLinear`` ... ``T_DequantizeLinear_Output``) and, where it drops the Relu
or Clip after a conv, gives the conv's output the activation's name.  So a tensor is read by its
*own name* first (the scope of ``<node>_output_<i>``), by its producing node's name otherwise.

- **Module calls.**  The deepest module of a scope is the call's layer; its k-th call is the k-th
  distinct scope reaching it (``relu_1`` is the second call of ``relu``).  The tensors of one call
  whose readers lie outside it (or that a QuantizeLinear reads, or the graph returns) are its
  output: exactly one is the call's row; several are listed unmatched.  A conv whose BN the
  exporter folded computes the BN's output: its tensor is the BN's row.
- **Inline ops** (``x + y`` in a block's forward) are nodes directly in their owner's scope.
  They are matched to the owner's inline calls of the engine's plan in order, an ONNX op type to
  the engine categories it can compute (``ONNX_CATEGORIES``), and a match is accepted only when the
  node reads exactly the rows the call reads (followed back through QuantizeLinear/
  DequantizeLinear and value-preserving nodes: Reshape, Flatten, Transpose, ...).  A node an
  exporter made *inside* another op (GELU's Erf and Add) reads no row and is never taken for an
  engine ``add``.
- **Weights**: the tensor a Conv/Gemm/MatMul of a conv or linear call reads as its weight (an
  initializer, or a DequantizeLinear of one) maps to that layer's path; its bias likewise.
- **Inputs**: the graph's float inputs, in order, are the engine's ``input`` calls.

Everything that cannot be matched -- a node of a layer the plan does not have, a call with
several outputs, an inline node that reads other rows than its candidate -- is in ``unmatched``
with the reason: never dropped silently.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from qdebug.engine.plan import Plan

# ONNX op type -> the engine call categories it computes (``qdebug.engine.ops``).
ONNX_CATEGORIES: dict[str, frozenset[str]] = {
    "Add": frozenset({"add"}), "Sub": frozenset({"sub"}), "Mul": frozenset({"mul"}), "Div": frozenset({"mul", "fallback"}),
    "Concat": frozenset({"cat"}), "MatMul": frozenset({"matmul", "linear"}), "Gemm": frozenset({"linear"}),
    "Conv": frozenset({"conv"}), "GlobalAveragePool": frozenset({"avgpool", "mean"}),
    "AveragePool": frozenset({"avgpool"}), "ReduceMean": frozenset({"mean", "avgpool"}),
    "Relu": frozenset({"relu"}), "Clip": frozenset({"relu6", "activation"}),
    "Sigmoid": frozenset({"activation"}), "Tanh": frozenset({"activation"}), "Softmax": frozenset({"activation"}),
    "LogSoftmax": frozenset({"activation"}), "HardSwish": frozenset({"activation"}),
    "HardSigmoid": frozenset({"activation"}), "LeakyRelu": frozenset({"activation"}), "Elu": frozenset({"activation"}),
    "Gelu": frozenset({"activation"}), "PRelu": frozenset({"activation"}), "Mish": frozenset({"activation"}),
    "Neg": frozenset({"mul"}),
}
# Nodes that hand their (first) input's values on unchanged or only rearranged: a row read through
# them is still that row (the engine's passthrough ops, and quantize/dequantize pairs).
VALUE_PRESERVING = frozenset({"QuantizeLinear", "DequantizeLinear", "Identity", "Reshape", "Flatten", "Squeeze",
                              "Unsqueeze", "Transpose", "Cast", "Dropout", "MaxPool", "GlobalMaxPool", "Split",
                              "Slice", "Pad"})
SHAPE_OPS = frozenset({"Shape", "Size"})  # metadata of a tensor, not its values
QDQ = frozenset({"QuantizeLinear", "DequantizeLinear"})
WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
_OUTPUT_NAME = re.compile(r"^(?P<node>/.*)_output_\d+$")
_FLOAT_TYPES = frozenset({1, 10, 11, 16})  # FLOAT, FLOAT16, DOUBLE, BFLOAT16


@dataclass
class TensorMap:
    """Where a torch-exported graph's tensors sit in the engine's plan (module docstring)."""

    rows: dict[str, str] = field(default_factory=dict)  # tensor -> engine call name (its row)
    weights: dict[str, str] = field(default_factory=dict)  # tensor a layer reads as its weight -> layer path
    biases: dict[str, str] = field(default_factory=dict)  # tensor a layer reads as its bias -> layer path
    unmatched: list[tuple[str, str]] = field(default_factory=list)  # (tensor or node, why)

    def tensor_of(self, row: str) -> str | None:
        """The tensor carrying ``row``, if one does."""
        return next((t for t, r in self.rows.items() if r == row), None)


@dataclass
class _Graph:
    """Who makes and who reads every tensor of a graph (value nodes only: no Constant)."""

    nodes: list[Any]
    producer: dict[str, Any]
    readers: dict[str, list[Any]]
    outputs: set[str]
    initializers: set[str]
    values: set[str]  # tensors computed from the graph's inputs (not constant expressions)
    float_tensors: set[str] | None  # None: types unknown (shape inference failed)
    # tensor -> the op type its name says made it: ORT names a conv's output after the Relu it absorbed
    op_label: dict[str, str] = field(default_factory=dict)

    def real_readers(self, tensor: str) -> list[Any]:
        """The nodes reading ``tensor``'s values, a QuantizeLinear/DequantizeLinear pair looked through."""
        found = []
        for node in self.readers.get(tensor, []):
            if node.op_type in QDQ and node.output and node.output[0]:
                found.extend(self.real_readers(node.output[0]) or [node])
            else:
                found.append(node)
        return found

    def is_float(self, tensor: str) -> bool:
        return self.float_tensors is None or tensor in self.float_tensors

    def dequantized(self, tensor: str) -> str | None:
        """The output of the DequantizeLinear of the QuantizeLinear reading ``tensor``, if any."""
        for q in self.readers.get(tensor, []):
            if q.op_type == "QuantizeLinear":
                for dq in self.readers.get(q.output[0], []):
                    if dq.op_type == "DequantizeLinear":
                        return dq.output[0]
        return None


def graph_of(model: Any) -> _Graph:
    """The reader/producer index of ``model``'s main graph (tensor types from shape inference)."""
    graph = model.graph
    nodes = [n for n in graph.node if n.op_type != "Constant"]
    producer = {out: n for n in nodes for out in n.output if out}
    readers: dict[str, list[Any]] = defaultdict(list)
    for node in nodes:
        for name in node.input:
            if name:
                readers[name].append(node)
    constants = {i.name for i in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}
    values = {i.name for i in graph.input if i.name not in constants}
    for node in nodes:  # ONNX keeps nodes in topological order; a shape is no value
        if node.op_type not in SHAPE_OPS and any(name in values for name in node.input):
            values.update(o for o in node.output if o)
    return _Graph(nodes, producer, readers, {o.name for o in graph.output}, constants, values, _float_tensors(model))


def _float_tensors(model: Any) -> set[str] | None:
    from onnx import shape_inference

    try:
        inferred = shape_inference.infer_shapes(model)
    except Exception:  # an op shape inference does not know: read every tensor as float
        return None
    graph = inferred.graph
    infos = [*graph.value_info, *graph.input, *graph.output]
    return {v.name for v in infos if v.type.tensor_type.elem_type in _FLOAT_TYPES}


def scope_path(scopes: list[str], modules: set[str]) -> tuple[str, list[str]] | None:
    """(module path, the scope strings that reached each level) of a node's scope components, or
    None when a component names no module.  torch writes a child's full path where it nests in a
    list-like parent (``features/features.0``) and its attribute name elsewhere (``conv``); a
    module's k-th call adds ``_<k-1>`` to its component (``relu_1``)."""
    path, previous, reached = "", "", []
    for component in scopes:
        written = component
        candidate = _join(path, previous, component)
        if candidate not in modules:
            base, _, index = component.rpartition("_")
            if not (base and index.isdigit() and _join(path, previous, base) in modules):
                return None
            candidate, written = _join(path, previous, base), base
        path, previous = candidate, written
        reached.append(component)
    return path, reached


def _join(path: str, previous: str, component: str) -> str:
    """The module path a scope component names below ``path`` (reached by component ``previous``):
    a list-like parent's child is written ``<parent's component>.<index>`` (``features.0`` below
    ``features``, ``conv.0.0`` below ``conv.0``), any other child by its attribute name."""
    if previous and component.startswith(previous + "."):
        component = component[len(previous) + 1:]
    return f"{path}.{component}" if path else component


def map_tensors(model: Any, plan: Plan, float_model: nn.Module) -> TensorMap:
    """The rows, weights and unmatched tensors of a torch-exported graph (module docstring)."""
    graph = graph_of(model)
    modules = {name for name, _ in float_model.named_modules() if name}
    result = TensorMap()
    _map_inputs(model, plan, graph, result)
    scoped = _scopes(graph, modules, plan, result)
    module_calls, inline = _split(graph, scoped, plan)
    _map_module_calls(graph, module_calls, plan, result)
    _fold_bn(plan, result)
    _map_inline(graph, inline, plan, result)
    _map_weights(graph, modules, plan, result)
    return result


def _map_inputs(model: Any, plan: Plan, graph: _Graph, result: TensorMap) -> None:
    inputs = [i.name for i in model.graph.input if i.name not in graph.initializers and graph.is_float(i.name)]
    calls = [c.name for c in plan.calls.values() if c.category == "input"]
    if len(inputs) != len(calls):
        result.unmatched.extend((name, f"the graph has {len(inputs)} float input(s), qdebug's plan {len(calls)}")
                                for name in inputs)
        return
    result.rows.update(zip(inputs, calls))


def _scopes(graph: _Graph, modules: set[str], plan: Plan, result: TensorMap) -> dict[str, tuple[str, int, Any]]:
    """tensor -> (module path of its scope, that module's call index, producing node), for every
    float tensor a value node makes (QuantizeLinear/DequantizeLinear outputs excluded)."""
    calls_seen: dict[str, list[str]] = defaultdict(list)  # module path -> distinct scope strings, in order
    scoped: dict[str, tuple[str, int, Any]] = {}
    for node in graph.nodes:
        if node.op_type in QDQ:
            continue
        for tensor in node.output:
            if not tensor or not graph.is_float(tensor) or not _makes_value(graph, tensor):
                continue
            named = _OUTPUT_NAME.match(tensor)
            where = named.group("node") if named else node.name
            parts = where.split("/")[1:] if where.startswith("/") else None
            found = scope_path(parts[:-1], modules) if parts else None
            if found is None:
                if parts is None:  # not a torch scope name at all (another exporter, a hand-made node)
                    result.unmatched.append((tensor, "its name is not a torch exporter scope (/module/.../Op)"))
                else:
                    result.unmatched.append((tensor, f"scope {'/'.join(parts[:-1]) or '/'} names no module of "
                                                     "the model"))
                continue
            path, reached = found
            key = "/".join(reached)
            if key not in calls_seen[path]:
                calls_seen[path].append(key)
            scoped[tensor] = (path, calls_seen[path].index(key) + 1, node)
            graph.op_label[tensor] = re.sub(r"_\d+$", "", parts[-1]) if named else node.op_type
    return scoped


def _call_name(path: str, k: int) -> str:
    return path if k == 1 else f"{path}#{k}"


def _split(graph: _Graph, scoped: dict, plan: Plan) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Tensors grouped by the module call that makes them, and inline tensors by owner path."""
    module_calls: dict[str, list[str]] = defaultdict(list)
    inline: dict[str, list[str]] = defaultdict(list)
    for tensor, (path, k, _) in scoped.items():
        rec = plan.calls.get(_call_name(path, k))
        if rec is not None and rec.is_module:
            module_calls[rec.name].append(tensor)
        else:
            inline[path].append(tensor)
    return module_calls, inline


def _map_module_calls(graph: _Graph, module_calls: dict[str, list[str]], plan: Plan, result: TensorMap) -> None:
    for call, tensors in module_calls.items():
        inside = {id(graph.producer[t]) for t in tensors if t in graph.producer}
        leaving = [t for t in tensors
                   if t in graph.outputs or any(r.op_type in QDQ or id(r) not in inside for r in graph.real_readers(t))]
        if len(leaving) == 1:
            result.rows[leaving[0]] = call
        else:
            why = (f"{len(leaving)} tensors leave call {call}" if leaving else f"no tensor leaves call {call}")
            result.unmatched.extend((t, why) for t in (leaving or tensors))


def _fold_bn(plan: Plan, result: TensorMap) -> None:
    """A conv whose BN the exporter folded: its tensor carries the BN's output, the BN's row."""
    taken = set(result.rows.values())
    for conv, bn in plan.pairs:
        if bn in taken or conv not in taken:
            continue
        tensor = result.tensor_of(conv)
        if tensor is not None:
            result.rows[tensor] = bn


def _source_row(graph: _Graph, tensor: str, rows: dict[str, str]) -> str | None:
    """The row ``tensor`` carries, followed back through value-preserving nodes; None if none."""
    for _ in range(len(graph.nodes) + 1):
        if tensor in rows:
            return rows[tensor]
        node = graph.producer.get(tensor)
        if node is None or node.op_type not in VALUE_PRESERVING or not node.input:
            return None
        tensor = node.input[0]
    return None


def _reads(graph: _Graph, node: Any, rows: dict[str, str]) -> tuple[set[str], bool]:
    """(rows ``node`` reads, whether it also reads a float tensor that carries no row)."""
    found, stray = set(), False
    for name in node.input:
        if not name or name in graph.initializers:
            continue
        row = _source_row(graph, name, rows)
        if row is not None:
            found.add(row)
        elif graph.is_float(name) and _makes_value(graph, name):
            stray = True
    return found, stray


def _makes_value(graph: _Graph, tensor: str) -> bool:
    """Whether ``tensor`` is computed from the model's inputs (not a constant expression: shapes,
    a folded table, an exporter's Identity of an initializer)."""
    return tensor in graph.values


def _map_inline(graph: _Graph, inline: dict[str, list[str]], plan: Plan, result: TensorMap) -> None:
    """The owners' inline nodes matched to the plan's inline calls.  A call is matched to one node
    of its owner that reads exactly the call's rows; a call the exporter wrote as several nodes
    (an inline ``F.gelu``: Div, Erf, Add, Mul, Mul) is found through the call reading it: the one
    tensor of the owner that this reader takes in place of the call's row, when everything that
    tensor is computed from reads exactly the call's own rows.  Repeated until nothing more matches."""
    free: dict[str, list[str]] = {owner: list(tensors) for owner, tensors in inline.items()}
    pending = [rec for rec in plan.calls.values()
               if not rec.is_module and rec.category not in ("input", "ignore", "passthrough", "internal")
               and not rec.constant]
    progress = True
    while pending and progress:
        progress = False
        for rec in list(pending):
            tensor = _direct_match(graph, rec, free, plan, result) or _match_through_reader(graph, rec, free, plan,
                                                                                          result)
            if tensor is not None:
                result.rows[tensor] = rec.name
                free[rec.owner].remove(tensor)
                pending.remove(rec)
                progress = True
    for owner, tensors in free.items():
        for tensor in tensors:
            node = graph.producer[tensor]
            if node.op_type in ONNX_CATEGORIES:
                result.unmatched.append((tensor, f"{node.op_type} in {owner or 'the model'}'s forward matches no "
                                                 "call of qdebug's plan reading the same layers"))


@dataclass(frozen=True)
class _Wanted:
    """The rows a call reads: ``known`` ones, plus ``views`` inputs read through a view (flatten,
    reshape: the plan keeps no record of whose), each some row."""

    known: frozenset[str]
    views: int

    def matches(self, rows: set[str] | None) -> bool:
        if rows is None or (not rows and (self.known or self.views)):
            return False
        return self.known <= rows and len(rows - self.known) <= self.views


def _wanted(plan: Plan, inputs: list[str], result: TensorMap, allow_none: bool = False) -> _Wanted | None:
    """What a call with these producers reads, or None while one of them has no row yet (or it
    reads no row at all, unless ``allow_none``)."""
    views = sum(1 for p in inputs if p.startswith("~"))
    rows = {_row_of(plan, p, result) for p in inputs if p and not p.startswith("~")}
    if None in rows or (not rows and not views and not allow_none):
        return None
    return _Wanted(frozenset(rows), views)


def _direct_match(graph: _Graph, rec: Any, free: dict, plan: Plan, result: TensorMap) -> str | None:
    """The owner's one tensor made by an op of ``rec``'s category reading exactly ``rec``'s rows.
    A tensor ORT renamed after an activation it absorbed (a Conv's output called ``.../Relu_output_0``)
    reads what the fused chain before ``rec`` reads."""
    plain = _wanted(plan, rec.inputs, result)
    fused = _wanted(plan, _inputs_through_fusion(plan, rec, result), result)
    for tensor in free.get(rec.owner, []):
        node = graph.producer[tensor]
        label = graph.op_label.get(tensor, node.op_type)
        wanted = plain if label == node.op_type else fused
        if wanted is None or rec.category not in ONNX_CATEGORIES.get(label, frozenset()):
            continue
        reads, stray = _reads(graph, node, result.rows)
        if not stray and wanted.matches(reads):
            return tensor
    return None


def _inputs_through_fusion(plan: Plan, rec: Any, result: TensorMap) -> list[str]:
    """``rec``'s producers, each one without a row of its own whose output is fused into ``rec``
    (a conv and BN before an absorbed ReLU) replaced by its own producers."""
    found, todo = [], list(rec.inputs)
    for _ in range(4 * len(plan.calls) + 4):
        if not todo:
            break
        name = todo.pop(0)
        producer = plan.calls.get(name)
        if producer is not None and name not in result.rows.values() and _fused_chain_reaches(plan, name, rec.name):
            todo.extend(producer.inputs)
        else:
            found.append(name)
    return found


def _fused_chain_reaches(plan: Plan, call: str, target: str) -> bool:
    for _ in range(len(plan.calls) + 1):
        rec = plan.calls.get(call)
        if rec is None or not rec.fused_into:
            return False
        if rec.fused_into == target:
            return True
        call = rec.fused_into
    return False


def _match_through_reader(graph: _Graph, rec: Any, free: dict, plan: Plan, result: TensorMap) -> str | None:
    """``rec``'s output as the one stray tensor a candidate node of a call reading ``rec`` takes."""
    wanted = _wanted(plan, rec.inputs, result)
    if wanted is None:
        return None
    own = set(free.get(rec.owner, []))
    for consumer in rec.consumers:
        reader = plan.calls.get(consumer)
        if reader is None or reader.is_module:
            continue
        others = _wanted(plan, [p for p in reader.inputs if p != rec.name], result, allow_none=True)
        if others is None:
            continue
        for tensor in free.get(reader.owner, []):
            node = graph.producer[tensor]
            if reader.category not in ONNX_CATEGORIES.get(node.op_type, frozenset()):
                continue
            stray = [i for i in node.input if i in own and _source_row(graph, i, result.rows) is None]
            resolved = {r for i in node.input if i and (r := _source_row(graph, i, result.rows)) is not None}
            if len(set(stray)) == 1 and others.matches(resolved) and wanted.matches(
                    _cone_reads(graph, stray[0], own, result.rows)):
                return stray[0]
    return None


def _cone_reads(graph: _Graph, tensor: str, own: set[str], rows: dict[str, str]) -> set[str] | None:
    """The rows everything ``tensor`` is computed from reads, walking back through the owner's own
    unmatched tensors (``own``); None when the walk meets a float tensor that is neither."""
    found: set[str] = set()
    seen, todo = set(), [tensor]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        row = _source_row(graph, name, rows) if name != tensor else None
        if row is not None:
            found.add(row)
            continue
        node = graph.producer.get(name)
        if node is None or name in graph.initializers:
            if name not in graph.initializers:
                return None
            continue
        if name != tensor and name not in own and graph.is_float(name) and _makes_value(graph, name):
            return None
        todo.extend(i for i in node.input if i)
    return found


def _row_of(plan: Plan, call: str, result: TensorMap) -> str | None:
    return row_through_fusion(plan, call, set(result.rows.values()))


def row_through_fusion(plan: Plan, call: str, rows: set[str]) -> str | None:
    """The row (of ``rows``) carrying ``call``'s output in the graph: its own, else that of the call
    a fused BN or activation hands it to (the exporter or ONNX Runtime folded it in); None."""
    for _ in range(len(plan.calls) + 1):
        if call in rows:
            return call
        rec = plan.calls.get(call)
        if rec is None or not rec.fused_into:
            return None
        call = rec.fused_into
    return None


def _map_weights(graph: _Graph, modules: set[str], plan: Plan, result: TensorMap) -> None:
    """By the weighted node's own name: ORT's quantizer may have renamed its output after the
    activation it absorbed, never the node."""
    for node in graph.nodes:
        if node.op_type not in WEIGHTED or not node.name.startswith("/"):
            continue
        found = scope_path(node.name.split("/")[1:-1], modules)
        rec = plan.calls.get(found[0]) if found else None
        if rec is None or rec.category not in ("conv", "linear"):
            continue
        if len(node.input) > 1 and node.input[1]:
            result.weights.setdefault(node.input[1], rec.name)
        if len(node.input) > 2 and node.input[2]:
            result.biases.setdefault(node.input[2], rec.name)
