"""Read a model quantized by PT2E (torchao's ``prepare_pt2e``/``prepare_qat_pt2e``/``convert_pt2e``).

PT2E works on an exported graph (``torch.export.export(model, x).module()``): a
``torch.fx.GraphModule`` of aten ops that no longer has the user's class, so the importer
needs ``float_model`` (an instance of that class) and maps every graph node back to the call
the engine makes in it (``qdebug.engine.context`` names):

- a node inside a module the engine knows (a conv, a BN, a ReLU module...) is that module's
  call: its path from the node's ``nn_module_stack`` (the k-th call of a shared module is
  ``path#k``: export keys its repeated calls ``...@k``); nodes that torchao rewrote (the
  eval BN, the QAT Conv-BN pattern) lose that record and are found by the parameters they read;
- any other op is an inline op of the deepest module recorded (``<owner>.<op>#k``, counted in
  execution order as the engine counts), a user input is ``input``, ``input#2``...;
- every anchor is checked against the float model's traced plan; one that does not exist is
  left unmapped with a note.

A quantizer (an ``activation_post_process_N`` observer/fake-quant, or after ``convert_pt2e``
a quantize op with constant qparams) quantizes its input node's output, looking through views
(flatten, dropout...) and shared observers; one feeding a conv/linear's weight quantizes that
layer's weight.

A quantizer torch applies on one edge only (another reader takes the float value) is
imported ``approximate``, with a note: the engine quantizes an output for all its readers (the
import's self-check measures the difference, ``qdebug.interop.check``).

Conv-BN: ``prepare_qat_pt2e`` rewrites conv -> BN into ``conv(x, fq(W f)) / f (+ b)`` then the
BN, f = gamma / sqrt(running_var + eps) -- the engine's reverse-fold computation op for op, so
such pairs are the ``bn_pairs`` (torchao computes that pattern with eps = 1e-5 whatever the
BN's eps: the imported BN takes torch's, with a note).  ``prepare_pt2e`` and ``convert_pt2e``
fold the BN into the conv instead: the conv holds the folded weight and bias, the BN's path an
``nn.Identity`` (``folded_bn``).

Weights: a conv/linear's weight and bias are what its graph node computes with -- the
observer's input, or after convert its int8 constant dequantized as the graph does (convert
leaves the stale float weights under the original names; prepare_pt2e's fold writes the
folded weight in place and the bias as ``<conv>.weight_bias``).  The Conv-BN pattern's W and
every other parameter or buffer are read by name from the graph's state_dict: export keeps
the float model's names.

torchao is optional (``qdebug[torchao]``); ``import_torchao`` imports it quietly.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import operator
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx
import torch.nn as nn

from qdebug.engine.ops import canonical_op_name, function_category, is_norm_act, module_category
from qdebug.engine.modules import without_norm
from qdebug.engine.plan import Plan, trace_plan
from qdebug.errors import QDebugError
from qdebug.interop.source import SourceModel, SourceQuantizer, layer_bn_pairs, read_quantizer

_INSTALL_HINT = "pip install 'qdebug[torchao]'"
_QUANT_NAMESPACE = "quantized_decomposed"
_WRAPPER = "WrapperModule"  # torchao's stand-in module on the nodes its rewrites create
_aten = torch.ops.aten
_CONVS = {_aten.conv1d.default, _aten.conv2d.default}
_WEIGHTED = _CONVS | {_aten.linear.default}
_LAYERS = ("conv", "linear")  # engine categories of weighted layers
_BATCH_NORMS = {_aten.batch_norm.default, _aten._native_batch_norm_legit_no_training.default,
                _aten._native_batch_norm_legit.default}
_RESHAPES = {_aten.reshape.default, _aten.view.default}
# aten names of torch functions the engine knows by another name (ops.py lists torch's names).
_ATEN_NAMES = {"slice": "__getitem__", "_unsafe_view": "view", "alias": "view", "split_with_sizes": "split",
               "native_dropout": "dropout", "_softmax": "softmax", "_log_softmax": "log_softmax",
               "max_pool2d_with_indices": "max_pool2d", "max_pool1d_with_indices": "max_pool1d"}


# -- torchao -----------------------------------------------------------------------------

@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence an import: torchao logs failed optional kernels and torch warns about pytree
    registrations, on Python's streams, its logging and the C-level stderr."""
    previous = logging.root.manager.disable
    with contextlib.ExitStack() as stack:
        stack.enter_context(_fd2_silenced())
        stack.enter_context(warnings.catch_warnings())
        stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
        warnings.simplefilter("ignore")
        logging.disable(logging.CRITICAL)
        try:
            yield
        finally:
            logging.disable(previous)


@contextlib.contextmanager
def _fd2_silenced() -> Iterator[None]:
    """The process's file descriptor 2 (what C code writes to) pointed at /dev/null."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no fd 2 (a closed or replaced stderr): nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def import_torchao():
    """The ``torchao.quantization.pt2e`` package, imported quietly, or a QDebugError saying how to get it."""
    loaded = sys.modules.get("torchao.quantization.pt2e")
    if loaded is not None:
        return loaded
    try:
        with _quiet():
            import torchao.quantization.pt2e as pt2e
    except ImportError as err:
        raise QDebugError(f"reading a PT2E model needs torchao ({err})", _INSTALL_HINT) from None
    return pt2e


# -- graph nodes -> engine calls ---------------------------------------------------------

def _fetch(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _is_quant_op(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", "") == _QUANT_NAMESPACE


def _op_name(node: torch.fx.Node) -> str:
    if node.target is operator.getitem:
        return "__getitem__"
    packet = getattr(node.target, "_overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(node.target, "__name__", str(node.target))


def _is_quantizer(gm: nn.Module, node: torch.fx.Node) -> bool:
    if node.op != "call_module" or not str(node.target).startswith("activation_post_process_"):
        return False
    module = gm.get_submodule(node.target)
    return hasattr(module, "calculate_qparams") or hasattr(module, "scale")


def _floating(node: torch.fx.Node) -> bool:
    """Whether ``node`` makes a floating tensor (or several: split, chunk)."""
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        return any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in val)
    if isinstance(val, torch.Tensor):
        return val.is_floating_point()
    return val is None and node.op != "placeholder"


class _Named:
    """Stands in for a torch function in ``ops.function_category`` (which reads ``__name__``)."""

    def __init__(self, name: str):
        self.__name__ = name


def _inline_category(node: torch.fx.Node) -> tuple[str, str]:
    """(engine category, canonical op name) of an aten node written inline."""
    raw = _op_name(node)
    if raw.startswith("upsample_"):
        return ("passthrough" if "nearest" in raw else "activation"), "interpolate"
    if raw == "constant_pad_nd":
        value = node.args[2] if len(node.args) > 2 else 0
        return ("passthrough" if not value else "fallback"), "pad"
    name = _ATEN_NAMES.get(raw, raw)
    category = function_category(_Named(name), tuple(node.args), dict(node.kwargs))
    if category == "fallback" and name.endswith("_"):  # in-place twins: relu_, hardtanh_, ...
        stripped = function_category(_Named(name[:-1]), tuple(node.args), dict(node.kwargs))
        if stripped != "fallback":
            name, category = name[:-1], stripped
    return category, canonical_op_name(_Named(name), category)


@dataclass
class _Call:
    name: str | None  # the engine call name; None: not a call of the engine (a view, a constant)
    category: str
    path: str | None = None  # the module path of a module call


class _GraphCalls:
    """Names each activation node of ``gm`` as the engine names the call it comes from."""

    def __init__(self, gm: torch.fx.GraphModule, model: nn.Module, internal: dict[torch.fx.Node, torch.fx.Node]):
        self.gm = gm
        self.modules = dict(model.named_modules())
        self.internal = internal  # node -> the node whose call it belongs to (QAT Conv-BN pattern)
        self.calls: dict[torch.fx.Node, _Call] = {}
        self.active: set[torch.fx.Node] = set()
        self.seen_paths: set[str] = set()
        self.instance_of: dict[torch.fx.Node, Any] = {}
        self._name()

    def _stack(self, node: torch.fx.Node) -> list[tuple[str, str]]:
        """(key, module path) of the modules recorded on ``node``, outermost first, torchao's
        stand-in modules left out."""
        stack = node.meta.get("nn_module_stack") or {}
        found = []
        for key, value in stack.items():
            path, kind = value[0], value[1]
            kind = kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"
            if kind.endswith(_WRAPPER):
                continue
            found.append((str(key), path))
        return found

    def _module_call(self, node: torch.fx.Node) -> tuple[str | None, str | None, Any, str]:
        """(module path, category, instance key, owner) of the call ``node`` belongs to."""
        stack = self._stack(node)
        owner = ""
        for key, path in stack:
            module = self.modules.get(path)
            if module is None:
                break
            if path and (category := module_category(module)) is not None:
                if is_norm_act(module) and "norm" not in _op_name(node):
                    # A norm-act layer (timm's BatchNormAct2d): its call is its norm alone; its
                    # act is a module call of its own, deeper in the stack.
                    owner = path
                    continue
                if category in _LAYERS and node.target not in _WEIGHTED:
                    # An op a conv/linear subclass runs in its own forward before its conv (TF
                    # SAME padding): not the layer's output, which only its conv computes; the
                    # engine runs it inside the layer's call, so it is an op of its own here.
                    owner = path
                    continue
                return path, category, key, path
            owner = path
        if not stack:
            # Rewritten by torchao (no module record): a BN or a layer is known by its parameters.
            for arg in node.args:
                if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
                    path = str(arg.target).rpartition(".")[0]
                    category = module_category(self.modules[path]) if path in self.modules else None
                    if category in ("bn", *_LAYERS):
                        return path, category, node, path
        return None, None, None, owner

    def _name(self) -> None:
        counts: dict[str, int] = {}
        names: dict[Any, str] = {}
        inputs = 0
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                if _floating(node):
                    self.active.add(node)
                    inputs += 1
                    self.calls[node] = _Call("input" if inputs == 1 else f"input#{inputs}", "input")
                continue
            if node.op not in ("call_function", "call_module"):
                continue
            if not any(a in self.active for a in node.all_input_nodes):
                continue  # computed from parameters and constants only (the fold factor, a weight)
            self.active.add(node)
            if node.op == "call_module" or _is_quant_op(node) or not _floating(node):
                continue
            if node in self.internal:
                self.calls[node] = self.calls.get(self.internal[node], _Call(None, "internal"))  # conv / f + b
                continue
            path, category, key, owner = self._module_call(node)
            if path is not None:
                self.seen_paths.add(path)
                base = path
            else:
                category, op = _inline_category(node)
                base = f"{owner}.{op}" if owner else op
                key = node
            if category == "passthrough":
                self.calls[node] = _Call(None, "passthrough", path)
                continue
            if key not in names:
                counts[base] = counts.get(base, 0) + 1
                names[key] = base if counts[base] == 1 else f"{base}#{counts[base]}"
            self.instance_of[node] = key
            self.calls[node] = _Call(names[key], category, path)
        for node in self.gm.graph.nodes:  # parameters read by the graph (a folded BN reads none)
            if node.op == "get_attr":
                self.seen_paths.add(str(node.target).rpartition(".")[0])

    def produced(self, node: torch.fx.Node, is_quantizer) -> tuple[torch.fx.Node, list[str]]:
        """The node whose value ``node`` carries, looking through views, observers and q/dq
        ops, and what was looked through."""
        through: list[str] = []
        for _ in range(64):
            call = self.calls.get(node)
            if is_quantizer(node) or _is_quant_op(node) or (call is not None and call.category == "passthrough"):
                through.append(node.name)
                node = node.args[0]
                continue
            break
        return node, through

    def anchor(self, node: torch.fx.Node, plan: Plan) -> tuple[str | None, str]:
        """The engine call whose output ``node`` is, checked against ``plan``, and a note."""
        if node.op == "get_attr" or node not in self.active:
            return None, f"quantizes the constant {node.name!r}: the engine quantizes weights and activations only"
        call = self.calls.get(node)
        if call is None or call.name is None:
            what = _op_name(node) if node.op == "call_function" else node.op
            return None, f"no engine call computes {node.name!r} ({what})"
        rec = plan.calls.get(call.name)
        if rec is None:
            return None, f"{node.name!r} maps to {call.name!r}, which the float model's forward does not call"
        if rec.category != call.category:
            return None, (f"{node.name!r} maps to {call.name!r}, a {rec.category} call in the float model, "
                          f"not a {call.category}")
        key = self.instance_of.get(node)
        if key is not None and any(self.instance_of.get(u) == key for u in node.users):
            return None, f"{node.name!r} is an intermediate value inside {call.name!r}"
        return call.name, ""


# -- the QAT Conv-BN pattern ---------------------------------------------------------------

@dataclass
class _ConvBn:
    conv: torch.fx.Node
    bn: torch.fx.Node
    inner: list[torch.fx.Node]  # the division by f (and the bias add) between them
    eps: float | None  # the eps of f = gamma / sqrt(running_var + eps)


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _unreshape(node: Any) -> Any:
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _RESHAPES:
        node = node.args[0]
    return node


def _fold_factor_eps(factor: Any) -> float | None:
    """eps of f = div(gamma, sqrt(add(running_var, eps))), or None when ``factor`` is not that."""
    if not (isinstance(factor, torch.fx.Node) and factor.target == _aten.div.Tensor):
        return None
    std = factor.args[1]
    if not (isinstance(std, torch.fx.Node) and std.target == _aten.sqrt.default):
        return None
    var_eps = std.args[0]
    if not (isinstance(var_eps, torch.fx.Node) and var_eps.target == _aten.add.Tensor):
        return None
    eps = var_eps.args[1]
    return float(eps) if isinstance(eps, (int, float)) else None


def _conv_bn_patterns(gm: torch.fx.GraphModule, is_quantizer) -> list[_ConvBn]:
    """torchao's QAT Conv-BN: conv(x, fq(W * f)) / f [+ b] -> batch_norm."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _CONVS:
            continue
        div = _only_user(node)
        if div is None or div.target != _aten.div.Tensor or div.args[0] is not node:
            continue
        factor = _unreshape(div.args[1])
        weight = node.args[1]
        if isinstance(weight, torch.fx.Node) and is_quantizer(weight):
            weight = weight.args[0]
        if not (isinstance(weight, torch.fx.Node) and weight.target == _aten.mul.Tensor
                and _unreshape(weight.args[1]) is factor):
            continue
        inner = [div]
        after = _only_user(div)
        if after is not None and after.target == _aten.add.Tensor and after.args[0] is div:
            inner.append(after)
            after = _only_user(after)
        if after is None or after.target not in _BATCH_NORMS:
            continue
        found.append(_ConvBn(node, after, inner, _fold_factor_eps(factor)))
    return found


# -- weights -----------------------------------------------------------------------------

def _constant(gm: torch.fx.GraphModule, arg: Any) -> Any:
    """The value of a node computed from constants only (a get_attr, a dequantized weight)."""
    if isinstance(arg, torch.fx.Node):
        if arg.op == "get_attr":
            return _fetch(gm, str(arg.target))
        if arg.op == "call_function":
            args = [_constant(gm, a) for a in arg.args]
            kwargs = {k: _constant(gm, v) for k, v in arg.kwargs.items()}
            return arg.target(*args, **kwargs)
        raise QDebugError(f"the PT2E graph computes {arg.name!r} from its inputs where a constant was expected",
                          "pass the model returned by prepare_pt2e/prepare_qat_pt2e/convert_pt2e")
    if isinstance(arg, (list, tuple)):
        return type(arg)(_constant(gm, a) for a in arg)
    return arg


def _set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)


def _layer_nodes(calls: _GraphCalls) -> dict[str, torch.fx.Node]:
    """Module path -> its first conv/linear aten node."""
    found: dict[str, torch.fx.Node] = {}
    for node, call in calls.calls.items():
        if node.op == "call_function" and node.target in _WEIGHTED and call.path and call.category in _LAYERS:
            found.setdefault(call.path, node)
    return found


def _graph_weight(gm: torch.fx.GraphModule, node: torch.fx.Node, is_quantizer) -> tuple[torch.Tensor, Any]:
    """(weight, bias) a conv/linear node computes with: an observer's input, or what a
    dequantize op makes of an int8 constant."""
    weight = node.args[1]
    if isinstance(weight, torch.fx.Node) and is_quantizer(weight):
        weight = weight.args[0]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return _constant(gm, weight), (None if bias is None else _constant(gm, bias))


def _load_weights(model: nn.Module, gm: torch.fx.GraphModule, calls: _GraphCalls, folded: list[tuple[str, str]],
                  pattern_convs: set[str], is_quantizer) -> None:
    """The source's weights into ``model`` (the float architecture): conv/linear layers as
    their graph nodes use them, everything else by its original name."""
    state = gm.state_dict()
    folded_bn = {bn for _, bn in folded}
    from_graph: set[str] = set()
    with torch.no_grad():
        for path, node in _layer_nodes(calls).items():
            if path in pattern_convs:
                continue  # W is read by name: the graph multiplies it by f first
            layer = model.get_submodule(path)
            weight, bias = _graph_weight(gm, node, is_quantizer)
            if tuple(weight.shape) != tuple(layer.weight.shape):
                raise QDebugError(f"the PT2E model's {path!r} has a weight of shape {tuple(weight.shape)}, "
                                  f"float_model's {tuple(layer.weight.shape)}",
                                  "pass an instance of the architecture that was exported")
            layer.weight.copy_(weight.to(layer.weight.dtype))
            if bias is not None:
                if layer.bias is None:  # a BN folded into a bias-free conv
                    layer.bias = nn.Parameter(bias.detach().clone().to(layer.weight))
                else:
                    layer.bias.copy_(bias)
            elif layer.bias is not None:
                layer.bias.zero_()
            from_graph.update({f"{path}.weight", f"{path}.bias"})
        for key, value in model.state_dict().items():
            if key in from_graph or key.rpartition(".")[0] in folded_bn:
                continue
            source = state.get(key)
            if source is None or tuple(source.shape) != tuple(value.shape):
                found = "no" if source is None else f"a {tuple(source.shape)}"
                raise QDebugError(f"the PT2E model has {found} {key!r} where float_model has a "
                                  f"{tuple(value.shape)} one",
                                  "pass an instance of the architecture that was exported (export keeps its "
                                  "parameter names)")
            value.copy_(source)


def _folded_pairs(model: nn.Module, example_inputs: Any, calls: _GraphCalls) -> list[tuple[str, str]]:
    """The (conv, bn) pairs of the float model whose BN the graph no longer runs: folded."""
    absent = [path for path, m in model.named_modules()
              if isinstance(m, nn.modules.batchnorm._BatchNorm) and path not in calls.seen_paths]
    if not absent:
        return []
    pairs = layer_bn_pairs(trace_plan(model, example_inputs), model)  # Linear-BN too: prepare_pt2e folds it
    return [(conv, bn) for conv, bn in pairs if bn in absent and conv in calls.seen_paths]


def _float_model(gm: torch.fx.GraphModule, model: nn.Module, example_inputs: Any, calls: _GraphCalls,
                 patterns: list[_ConvBn], is_quantizer) -> list[tuple[str, str]]:
    """Make ``model`` (a copy of float_model) hold the source's weights; returns the folded pairs."""
    folded = _folded_pairs(model, example_inputs, calls)
    pattern_convs = {calls.calls[p.conv].path for p in patterns if p.conv in calls.calls}
    _load_weights(model, gm, calls, folded, pattern_convs, is_quantizer)
    for _, bn in folded:
        _set_module(model, bn, without_norm(model.get_submodule(bn)))  # a norm-act layer keeps its act
    return folded


# -- front ends --------------------------------------------------------------------------

def _check(gm: Any, float_model: Any) -> None:
    if not isinstance(gm, torch.fx.GraphModule):
        raise QDebugError(f"a PT2E model is a torch.fx.GraphModule, got {type(gm).__name__}",
                          "pass the model returned by prepare_pt2e/prepare_qat_pt2e/convert_pt2e")
    if not isinstance(float_model, nn.Module):
        raise QDebugError("a PT2E graph does not keep your model class: pass float_model=",
                          "float_model=YourNet() (any weights: the source's replace them)")


def _prepare(gm: torch.fx.GraphModule, example_inputs: Any, float_model: nn.Module, is_quantizer):
    patterns = _conv_bn_patterns(gm, is_quantizer)
    internal = {n: p.conv for p in patterns for n in p.inner}
    model = copy.deepcopy(float_model)
    calls = _GraphCalls(gm, model, internal)
    folded = _float_model(gm, model, example_inputs, calls, patterns, is_quantizer)
    plan = trace_plan(model, example_inputs)
    return model, plan, calls, patterns, folded


def _weight_layer(node: torch.fx.Node, calls: _GraphCalls) -> tuple[str | None, str]:
    """The layer path whose weight the quantizer ``node`` feeds (as a conv/linear's weight)."""
    for user in node.users:
        if user.op == "call_function" and user.target in _WEIGHTED and len(user.args) > 1 and user.args[1] is node:
            call = calls.calls.get(user)
            if call is not None and call.path and call.category in _LAYERS:
                return call.path, ""
            return None, f"feeds {user.name!r}, a {_op_name(user)} of no conv/linear module of float_model"
    return None, ""


def _unquantized_readers(producer: torch.fx.Node, quantizers: set[torch.fx.Node], calls: _GraphCalls,
                         depth: int = 0) -> list[str]:
    """Nodes that read ``producer``'s output (directly or through views) without a quantizer:
    torch quantizes an edge, the engine an output."""
    readers = []
    for user in producer.users:
        if user in quantizers or _is_quant_op(user):
            continue
        if user.op == "call_module" and not user.users:
            continue  # export's input guards
        call = calls.calls.get(user)
        if call is not None and call.category == "passthrough" and depth < 16:
            readers += _unquantized_readers(user, quantizers, calls, depth + 1)
            continue
        readers.append(user.name)
    return readers


def _edge_note(producer: torch.fx.Node, quantizers: set[torch.fx.Node], calls: _GraphCalls) -> str:
    readers = _unquantized_readers(producer, quantizers, calls)
    if not readers:
        return ""
    return (f"torch leaves {producer.name!r} unquantized on the way to {', '.join(readers)}; the engine quantizes "
            "the output for every reader")


def _bn_eps(node: torch.fx.Node) -> float | None:
    """The eps a batch_norm node normalizes with."""
    index = 7 if node.target == _aten.batch_norm.default else 6
    eps = node.args[index] if len(node.args) > index else node.kwargs.get("eps")
    return float(eps) if isinstance(eps, (int, float)) else None


def _bn_pairs(patterns: list[_ConvBn], calls: _GraphCalls, model: nn.Module, source: SourceModel) -> dict[str, str]:
    """Fill ``source.bn_pairs`` from the QAT Conv-BN patterns; returns notes by conv path.

    torchao's pattern computes with eps = 1e-5 whatever the BN's own eps ("TODO: allow setting
    eps" in its qat_utils): the imported BN takes the eps torch computes with, and says so.
    """
    notes: dict[str, str] = {}
    for p in patterns:
        conv, bn = calls.calls.get(p.conv), calls.calls.get(p.bn)
        if conv is None or bn is None or not conv.path or not bn.path:
            source.unsupported.append((p.conv.name, "a QAT Conv-BN whose conv or BN is no module of float_model: "
                                                    "computed as a plain conv and BN"))
            continue
        module = model.get_submodule(bn.path)
        eps = _bn_eps(p.bn)
        if eps is not None and (p.eps is None or p.eps == eps) and eps != module.eps:
            notes[conv.path] = (f"torch computes {bn.path!r} (and its fold factor) with eps={eps}, not the BN's "
                                f"eps={module.eps}: the imported BN uses torch's")
            module.eps = eps
        elif p.eps is not None and eps is not None and p.eps != eps:
            notes[conv.path] = (f"torch folds {bn.path!r} with eps={p.eps} but normalizes with eps={eps}; the "
                                f"engine uses eps={module.eps} for both (not the same values)")
        source.bn_pairs.append((conv.path, bn.path))
    return notes


def _add(source: SourceModel, module: nn.Module, name: str, kind: str, anchor: str | None, note: str) -> None:
    """Append the quantizer ``module`` to ``source``, or list it as unsupported when it has no
    qparams to import (a PlaceholderObserver of dynamic quantization)."""
    why = "dynamic quantization" if getattr(module, "is_dynamic", False) else ""
    if not why:
        try:
            source.quantizers.append(read_quantizer(module, name, kind, anchor, note))
            return
        except (RuntimeError, ValueError, AttributeError, NotImplementedError) as err:
            why = str(err).splitlines()[0] if str(err) else type(err).__name__
    source.unsupported.append((name, f"{type(module).__name__} has no scale to import ({why}): left float"))


def _activation_anchor(value: torch.fx.Node, calls: "_GraphCalls", plan: Plan, quantizers: set,
                       is_quantizer) -> tuple[str | None, str, bool]:
    """(the engine call a quantizer of ``value`` quantizes, or None; the note saying how; whether
    torch quantizes one edge only, which the engine point cannot: the row is approximate)."""
    producer, through = calls.produced(value, is_quantizer)
    anchor, note = calls.anchor(producer, plan)
    notes = [note] if note else []
    if through:
        notes.append(f"quantizes {producer.name!r} through {', '.join(through)}")
    edge = _edge_note(value, quantizers, calls) if anchor is not None else ""
    if edge:
        notes.append(edge)
    return anchor, "; ".join(notes), bool(edge)


def read_pt2e(prepared: torch.fx.GraphModule, example_inputs: Any, float_model: nn.Module) -> tuple[SourceModel, Plan]:
    """The ``SourceModel`` of a ``prepare_pt2e``/``prepare_qat_pt2e`` graph, and the plan of its float model."""
    _check(prepared, float_model)
    import_torchao()
    gm = prepared

    def is_quantizer(node: Any) -> bool:
        return isinstance(node, torch.fx.Node) and _is_quantizer(gm, node)

    model, plan, calls, patterns, folded = _prepare(gm, example_inputs, float_model, is_quantizer)
    quantizer_nodes = [n for n in gm.graph.nodes if is_quantizer(n)]
    qat = any(hasattr(gm.get_submodule(n.target), "fake_quant_enabled") for n in quantizer_nodes)
    source = SourceModel("pt2e", "qat" if qat else "calibrated", model, example_inputs, folded_bn=folded)
    bn_notes = _bn_pairs(patterns, calls, model, source)
    members = set(quantizer_nodes)
    for node in quantizer_nodes:
        module = gm.get_submodule(node.target)
        layer, note = _weight_layer(node, calls)
        if layer is not None or note:
            note = "; ".join(n for n in (note, bn_notes.pop(layer, "")) if n)
            _add(source, module, node.name, "weight", layer, note)
            continue
        anchor, note, approximate = _activation_anchor(node.args[0], calls, plan, members, is_quantizer)
        _add(source, module, node.name, "activation", anchor, note)
        if approximate and source.quantizers and source.quantizers[-1].source == node.name:
            source.quantizers[-1].approximate = True
    source.unsupported.extend(bn_notes.items())  # pairs whose weight torch does not quantize
    return source, plan


# -- converted ---------------------------------------------------------------------------

def _qparams(gm: torch.fx.GraphModule, node: torch.fx.Node) -> dict[str, Any]:
    """The SourceQuantizer fields of a quantized_decomposed quantize/dequantize node."""
    per_channel = "per_channel" in _op_name(node)
    args = list(node.args) + [node.kwargs[k] for k in ("quant_min", "quant_max", "dtype") if k in node.kwargs]
    scale, zero_point = _constant(gm, args[1]), _constant(gm, args[2])
    rest = args[4:] if per_channel else args[3:]
    quant_min, quant_max, dtype = int(rest[0]), int(rest[1]), rest[2]
    scale = torch.as_tensor(scale, dtype=torch.float32).detach().clone().reshape(-1)
    zero_point = torch.as_tensor(zero_point).detach().clone().to(torch.int32).reshape(-1)
    symmetric = quant_min < 0 and bool((zero_point == 0).all())
    qscheme = f"{'per_channel' if per_channel else 'per_tensor'}_{'symmetric' if symmetric else 'affine'}"
    return {"scale": scale, "zero_point": zero_point, "quant_min": quant_min, "quant_max": quant_max,
            "dtype": str(dtype).replace("torch.", ""), "qscheme": qscheme,
            "ch_axis": int(args[3]) if per_channel else 0}


def read_pt2e_converted(converted: torch.fx.GraphModule, example_inputs: Any,
                        float_model: nn.Module) -> tuple[SourceModel, Plan]:
    """The ``SourceModel`` of a ``convert_pt2e`` graph (quantize/dequantize ops with constant
    qparams, int8 weights), and the plan of its float model."""
    _check(converted, float_model)
    import_torchao()
    gm = converted

    def is_quantizer(node: Any) -> bool:
        return False  # no observers left: the dequantize ops are evaluated as the graph does

    model, plan, calls, patterns, folded = _prepare(gm, example_inputs, float_model, is_quantizer)
    source = SourceModel("pt2e-converted", "quantized", model, example_inputs, folded_bn=folded)
    quantizes = {n for n in gm.graph.nodes if _is_quant_op(n) and _op_name(n).startswith("quantize_per")}
    for node in gm.graph.nodes:
        if not _is_quant_op(node):
            continue
        name = _op_name(node)
        if not name.startswith(("quantize_per", "dequantize_per")):
            if node in calls.active:  # choose_qparams (dynamic quantization) and the like
                source.unsupported.append((node.name, f"{name} has no engine twin: left float"))
            continue
        if name.startswith("quantize_per") and node not in calls.active:
            continue  # a weight quantized in the graph (fold_quantize=False): its dequantize is read
        if name.startswith("dequantize_per") and node in calls.active:
            continue  # an activation's dequantize: its quantize op is the quantizer
        fields = _qparams(gm, node)
        if name.startswith("dequantize_per"):
            layer, note = _weight_layer(node, calls)
            if layer is None and not note:
                note = f"dequantizes the constant {node.args[0].name!r}, which feeds no conv/linear weight"
            source.quantizers.append(SourceQuantizer(node.name, "weight", layer, note=note, **fields))
            continue
        anchor, note, approximate = _activation_anchor(node.args[0], calls, plan, quantizes, lambda n: False)
        source.quantizers.append(SourceQuantizer(node.name, "activation", anchor, note=note, approximate=approximate,
                                                 **fields))
    return source, plan
