"""Read a model prepared by torch.ao's FX mode (``prepare_qat_fx`` / ``prepare_fx``).

An FX-prepared model is a ``GraphModule``: the user's class is gone, so the caller passes
``float_model`` (an instance of it).  What the importer reads:

- every ``activation_post_process_N`` node quantizes the value of the node in its
  ``args[0]``.  That node is named after a node of the graph FX traced from the float
  model before it fused anything; ``meta["_observed_graph_module_attrs"].node_name_to_scope``
  lists all of those (fused-away ones too), in execution order, with the module each ran in.
  The importer traces ``float_model`` the same way, checks the node names and scopes agree
  (else the architecture differs), and runs that original graph once inside the engine's own
  naming context (``ForwardContext``), each inline op in its FX scope, so every node gets
  the very name -- ``layer1.0.relu#2``, ``layer1.0.add``, ``input`` -- the engine gives it
  when it runs the float model.  A fused module (``ConvBnReLU2d`` at the conv's path)
  outputs what its last fused op outputs: the node it swallowed last (the ReLU, or the BN);
  a passthrough op (max-pool, flatten, dropout) has no engine call and keeps its input's
  grid, so an observer after one is anchored at the call feeding it (``build`` reports a
  second quantizer on the same point: equal grid, or not mapped -- FX re-quantizes a
  Dropout's output, or one half of a chunk, on a grid of its own).  An observer on a cat's
  input sharing the cat's output grid is the cat's point (the same values).  Each name is
  checked against the engine plan of the float model (exists, same category), else left
  unmapped with a note.
- weights: QAT modules hold ``weight_fake_quant``; a PTQ-prepared model has none (torch's
  convert observes each quantized layer's weight with ``qconfig.weight()``), so the importer
  does what convert does.  A PTQ model's only quantized semantics is its converted one, which
  clamps to the dtype's full range (``source.full_range``); a QAT model's fake quants clamp to their
  own quant_min/max, and so does the import.
- the float model copy gets the prepared model's weights (trained by QAT): a QAT
  ``ConvBn2d`` at ``P`` gives ``P.weight/bias`` to the float conv ``P`` and ``P.bn`` to the
  BN fused after it (a ``bn_pairs`` entry: the engine's reverse-fold mode is torch's
  scheme); PTQ ``prepare_fx`` folded the BN into the conv: the folded weights go to the conv
  and an ``nn.Identity`` to the BN's path (``folded_bn``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx
import torch.nn as nn

from qdebug.engine.context import ForwardContext, _Frame, split_inputs
from qdebug.engine.ops import VALUE_CATEGORIES, tensors_in
from qdebug.engine.plan import Plan, TraceHandler, trace_plan
from qdebug.errors import QDebugError
from qdebug.interop.eager import is_quantizer
from qdebug.interop.source import (TRANSPOSED_CONVS, SourceModel, SourceQuantizer, full_range, read_quantizer,
                                   transposed_weight_note)

OBSERVER_PREFIX = "activation_post_process_"
_ARCH_HINT = ("pass float_model=an instance of the class you gave prepare_fx/prepare_qat_fx, built with the same "
              "arguments (its weights do not matter: the prepared model's replace them)")


def read_fx(prepared: torch.fx.GraphModule, example_inputs: Any, float_model: nn.Module) -> tuple[SourceModel, Plan]:
    """The ``SourceModel`` of an FX-prepared model, and the engine plan of its float model."""
    attrs = prepared.meta.get("_observed_graph_module_attrs") if isinstance(getattr(prepared, "meta", None), dict) \
        else None
    if attrs is None:
        raise QDebugError("this GraphModule has no FX observed-graph attributes (meta['_observed_graph_module_attrs'])",
                          "pass the model returned by torch.ao.quantization.quantize_fx.prepare_fx/prepare_qat_fx")
    if not isinstance(float_model, nn.Module):
        raise QDebugError(f"float_model must be an nn.Module, got {type(float_model).__name__}", _ARCH_HINT)
    qat = bool(attrs.is_qat)
    model = copy.deepcopy(float_model)
    # The source's weights land in the copy's modules: both on the source's device.
    device = next((t.device for t in (*prepared.parameters(), *prepared.buffers())), None)
    if device is not None:
        model.to(device)
    original = _retrace(model, attrs, train=qat)
    nodes = {n.name: n for n in original.nodes}
    present = {n.name for n in prepared.graph.nodes}
    chains = _fused_chains(prepared, nodes, present)
    bn_pairs, folded = _copy_weights(prepared, model, chains)
    names, records = _engine_names(model, original, attrs.node_name_to_scope, example_inputs)
    plan = trace_plan(model, example_inputs)

    source = SourceModel("fx", "qat" if qat else "calibrated", model, example_inputs, bn_pairs=bn_pairs,
                         folded_bn=folded)
    resolver = _Anchors(names, records, plan, nodes, chains, {bn for _, bn in folded})
    source.quantizers.extend(_activation_quantizers(prepared, resolver))
    batch_statistics = _batch_statistics(prepared, attrs.node_name_to_scope)
    for q in source.quantizers:  # the BN's own quantizer (those after its drop come later: the same grid)
        if q.kind == "activation" and q.anchor in batch_statistics:
            q.approximate = True
            q.note = "; ".join(n for n in (q.note, batch_statistics.pop(q.anchor)) if n)
    source.quantizers.extend(_weight_quantizers(prepared, model, attrs, qat, source))
    if not qat:
        for q in source.quantizers:
            full_range(q)
    return source, plan


# -- the original graph ------------------------------------------------------------------

def _retrace(model: nn.Module, attrs: Any, train: bool) -> torch.fx.Graph:
    """The graph ``prepare_fx`` traced from the float model (before fusing), re-traced from
    ``model`` the same way; a clean error when ``model`` is another architecture."""
    from torch.ao.quantization.fx.tracer import QuantizationTracer
    from torch.ao.quantization.fx.utils import get_skipped_module_name_and_classes

    try:  # prepare_fx swaps FloatFunctional for FXFloatFunctional before tracing: so do we
        from torch.ao.quantization.quantize_fx import _swap_ff_with_fxff

        _swap_ff_with_fxff(model)
    except ImportError:  # pragma: no cover - older torch
        pass
    names, classes = get_skipped_module_name_and_classes(attrs.prepare_custom_config, False)
    tracer = QuantizationTracer(names, classes)
    was_training = model.training
    model.train(train)
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # the user's model: FX may fail on anything in its forward
        raise QDebugError(f"torch.fx cannot trace float_model ({type(model).__name__}): "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", _ARCH_HINT) from None
    finally:
        model.train(was_training)
    _same_graph(tracer.node_name_to_scope, attrs.node_name_to_scope)
    return graph


def _same_graph(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Raise unless two ``node_name_to_scope`` maps name the same nodes, in the same scopes."""
    def scope(entry):
        path, cls = entry
        return path, getattr(cls, "__qualname__", None)

    a, b = list(ours.items()), list(theirs.items())
    for (name, ours_scope), (their_name, their_scope) in zip(a, b):
        if name != their_name or scope(ours_scope) != scope(their_scope):
            raise QDebugError(f"float_model is not the architecture the FX model was prepared from: its traced "
                              f"graph has node {name!r} in {_where(scope(ours_scope)[0])} where the prepared "
                              f"model's has {their_name!r} in {_where(scope(their_scope)[0])}", _ARCH_HINT)
    if len(a) != len(b):
        extra = a[len(b)][0] if len(a) > len(b) else b[len(a)][0]
        raise QDebugError(f"float_model is not the architecture the FX model was prepared from: one traced graph "
                          f"has {len(a)} nodes, the other {len(b)} (first unmatched: {extra!r})", _ARCH_HINT)


def _where(path: str) -> str:
    return repr(path) if path else "the model's own forward"


def _is_observer_node(prepared: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    return node.op == "call_module" and str(node.target).startswith(OBSERVER_PREFIX) and \
        is_quantizer(prepared.get_submodule(str(node.target)))


def _fused_chains(prepared: torch.fx.GraphModule, nodes: dict[str, torch.fx.Node],
                  present: set[str]) -> dict[str, list[torch.fx.Node]]:
    """For each module node of the prepared graph, the original nodes it computes: itself and
    the ones FX fused into it (each the sole user of the one before, gone from the graph)."""
    chains = {}
    for node in prepared.graph.nodes:
        if node.op != "call_module" or _is_observer_node(prepared, node):
            continue
        head = nodes.get(node.name)
        if head is None or head.op != "call_module" or head.target != node.target:
            continue  # made by prepare, not by fusing the float model's modules
        chain = [head]
        while True:
            users = list(chain[-1].users)
            if len(users) != 1 or users[0].name in present or users[0].op not in ("call_module", "call_function",
                                                                                   "call_method"):
                break
            chain.append(users[0])
        chains[node.name] = chain
    return chains


def _batch_statistics(prepared: torch.fx.GraphModule, scopes: dict) -> dict[str, str]:
    """Engine call -> why it differs, for each batch_norm of the graph computed with the batch's
    own statistics whatever the mode: FX traced a forward passing ``self.training`` to
    ``F.batch_norm`` (timm's BatchNormAct2d) in train mode, and training=True became a constant."""
    found = {}
    for node in prepared.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "__name__", "") != "batch_norm":
            continue
        training = node.kwargs.get("training", node.args[5] if len(node.args) > 5 else False)
        path = scopes.get(node.name, ("", None))[0]
        if training is True and path:
            found[path] = (f"torch's graph normalizes {path!r} with each batch's own statistics, in eval and after "
                           "convert_fx too: prepare_qat_fx traced its F.batch_norm(training=self.training) in train "
                           "mode, so training=True is a constant of the graph; the engine uses the running "
                           "statistics, as the float model in eval")
    return found


# -- weights -----------------------------------------------------------------------------

def _parts(module: nn.Module) -> tuple[nn.Module, nn.Module | None, bool]:
    """(the layer holding the weight, a BN it carries, whether the BN is trained folded)."""
    import torch.ao.nn.intrinsic as nni

    if isinstance(getattr(module, "weight_fake_quant", None), nn.Module):  # a QAT layer, fused or not
        bn = getattr(module, "bn", None)
        if isinstance(bn, nn.modules.batchnorm._BatchNorm):
            return module, bn, True  # QAT ConvBn(ReLU)Nd: torch's _ConvBnNd scheme
        return module, None, False
    if isinstance(module, nni._FusedModule):  # PTQ: a Sequential of float modules
        children = list(module.children())
        bn = next((c for c in children[1:] if isinstance(c, nn.modules.batchnorm._BatchNorm)), None)
        return children[0], bn, False
    return module, None, False


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)


def _float_module(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise QDebugError(f"float_model has no module {path!r}, which the prepared model calls", _ARCH_HINT) from None


def _copy_layer(src: nn.Module, dst: nn.Module, path: str) -> None:
    """``src``'s parameters and buffers into the float module ``dst`` (quantizers left out)."""
    weighted = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
    if isinstance(src, weighted) and isinstance(dst, weighted):
        if src.weight.shape != dst.weight.shape:
            raise QDebugError(f"float_model's {path!r} has a weight of shape {tuple(dst.weight.shape)}, the prepared "
                              f"model's {tuple(src.weight.shape)}", _ARCH_HINT)
        _same_settings(src, dst, path, ("stride", "padding", "dilation", "groups", "padding_mode"))
        dst.weight = nn.Parameter(src.weight.detach().clone(), requires_grad=dst.weight.requires_grad)
        # PTQ folding gives a bias-free conv a bias: the float conv takes it too.
        dst.bias = None if src.bias is None else nn.Parameter(src.bias.detach().clone())
        return
    state = {k: v for k, v in src.state_dict().items()
             if not any(part in ("weight_fake_quant", "activation_post_process") or part.startswith(OBSERVER_PREFIX)
                        for part in k.split("."))}
    _same_settings(src, dst, path, ("eps", "stride", "padding", "dilation", "groups", "kernel_size", "output_size"))
    try:
        dst.load_state_dict(state)
    except RuntimeError as exc:
        raise QDebugError(f"float_model's {path!r} ({type(dst).__name__}) cannot take the prepared model's "
                          f"{type(src).__name__}: {str(exc).splitlines()[0]}", _ARCH_HINT) from None


def _same_settings(src: nn.Module, dst: nn.Module, path: str, names: tuple[str, ...]) -> None:
    """Raise unless the settings (stride, eps, ...) both modules have are equal: equal
    weights in a conv of another stride would compute something else, silently."""
    for name in names:
        a, b = getattr(src, name, None), getattr(dst, name, None)
        if a is not None and b is not None and a != b:
            raise QDebugError(f"float_model's {path!r} has {name}={b!r}, the prepared model's {name}={a!r}", _ARCH_HINT)


def _copy_weights(prepared: torch.fx.GraphModule, model: nn.Module,
                  chains: dict[str, list[torch.fx.Node]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The prepared model's weights into ``model``; returns (bn_pairs, folded_bn)."""
    bn_pairs, folded = [], []
    for node in prepared.graph.nodes:
        if node.op == "get_attr":  # a parameter or buffer the forward reads directly
            value, dst = _attr(prepared, str(node.target)), _attr(model, str(node.target))
            if isinstance(value, torch.Tensor) and isinstance(dst, torch.Tensor):
                if value.shape != dst.shape:
                    raise QDebugError(f"float_model's {node.target!r} has shape {tuple(dst.shape)}, the prepared "
                                      f"model's {tuple(value.shape)}", _ARCH_HINT)
                with torch.no_grad():
                    dst.copy_(value.detach())
            continue
        if node.op != "call_module" or node.name not in chains:
            continue
        path = str(node.target)
        layer, bn, trained_folded = _parts(prepared.get_submodule(path))
        _copy_layer(layer, _float_module(model, path), path)
        bn_nodes = [n for n in chains[node.name][1:] if n.op == "call_module" and
                    isinstance(_float_module(model, str(n.target)), nn.modules.batchnorm._BatchNorm)]
        if not bn_nodes:
            continue
        bn_path = str(bn_nodes[0].target)
        if bn is None:  # prepare_fx (eval) folded the BN into the conv's weights
            folded.append((path, bn_path))
            _set(model, bn_path, nn.Identity())
            continue
        _copy_layer(bn, _float_module(model, bn_path), bn_path)
        if trained_folded:
            bn_pairs.append((path, bn_path))
    return bn_pairs, folded


def _attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


# -- engine names of the original nodes --------------------------------------------------

class _Namer(torch.fx.Interpreter):
    """Runs the original graph inside the engine's naming context: each node's value is
    named by the engine call that produced it (``TraceHandler.producer``)."""

    def __init__(self, gm: torch.fx.GraphModule, ctx: ForwardContext, handler: TraceHandler, scopes: dict):
        super().__init__(gm)
        self.ctx, self.handler, self.scopes = ctx, handler, scopes
        self.names: dict[str, str] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op in ("call_function", "call_method"):
            # An inline op is named after the module whose forward runs it: FX's scope.
            owner = self.scopes.get(n.name, ("", None))[0] or ""
            self.ctx.frames.append(_Frame("container", owner))
            try:
                out = super().run_node(n)
            finally:
                self.ctx.frames.pop()
        else:
            out = super().run_node(n)
        tensors = [t for t in tensors_in(out) if torch.is_floating_point(t)]
        self.names[n.name] = self.handler.producer.get(id(tensors[0]), "") if tensors else ""
        return out


def _engine_names(model: nn.Module, graph: torch.fx.Graph, scopes: dict,
                  example_inputs: Any) -> tuple[dict[str, str], dict]:
    """Original node name -> the engine call that produced its value ("~viewN" for a
    passthrough, "" for none), and the trace records of that run."""
    gm = torch.fx.GraphModule(model, graph)
    handler = TraceHandler()
    args, kwargs = split_inputs(example_inputs)
    was_training = model.training
    model.eval()
    # A graph traced in train mode may hold a batch_norm with training=True as a constant (timm's
    # BatchNormAct2d passes self.training): its run would move the running statistics just copied.
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    try:
        with torch.no_grad(), ForwardContext(model, handler) as ctx:
            args, kwargs = ctx.process_inputs(args, kwargs)
            namer = _Namer(gm, ctx, handler, scopes)
            namer.run(*_positional(graph, args, kwargs))
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
    except QDebugError:
        raise
    except Exception as exc:
        raise QDebugError(f"the float model's FX graph does not run on example_inputs: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                          "pass one batch of the inputs the model was prepared with") from None
    finally:
        model.train(was_training)
    return namer.names, handler.records


def _positional(graph: torch.fx.Graph, args: tuple, kwargs: dict) -> list:
    """The graph's placeholders' values, in order (keyword inputs by parameter name)."""
    values = list(args)
    for node in [n for n in graph.nodes if n.op == "placeholder"][len(args):]:
        if node.target in kwargs:
            values.append(kwargs[node.target])
        elif node.args:
            values.append(node.args[0])  # the parameter's default
        else:
            raise QDebugError(f"example_inputs lack the model's input {node.target!r}",
                              "pass one batch: a tensor, a tuple of positional inputs, or a dict of keyword inputs")
    return values


class _Anchors:
    """Original FX node -> the engine call whose output the node's value is, validated."""

    def __init__(self, names: dict, records: dict, plan: Plan, nodes: dict, chains: dict, folded: set[str]):
        self.names, self.records, self.plan, self.nodes, self.chains = names, records, plan, nodes, chains
        self.folded = folded  # BN paths now nn.Identity: a passthrough that is no op of the source

    def of(self, node_name: str) -> tuple[str | None, str, bool]:
        """(engine call or None, note, reached through a passthrough op of the source)."""
        if node_name not in self.nodes:
            return None, f"node {node_name!r} was made by prepare_fx: no op of the float model computes it", False
        chain = self.chains.get(node_name, [self.nodes[node_name]])
        head, last = chain[0], chain[-1]
        what = _describe(head)
        if len(chain) > 1:
            what += f" (fused with {', '.join(_describe(n) for n in chain[1:])})"
        name = self.names.get(last.name, "")
        views = []
        while name.startswith("~"):  # a passthrough: its value is on its input's grid
            views.append(name)
            inputs = [p for p in self.records[name].inputs if p]
            name = inputs[0] if inputs else ""
        if not name:
            return None, f"{what} is not computed from the model's inputs by any engine call", False
        rec, ours = self.plan.calls.get(name), self.records.get(name)
        layer = _layer_of(self.plan, ours) if rec is None and ours is not None else None
        if layer is not None:
            return layer, f"{what} in {layer!r}'s own forward: the layer's output", False
        if rec is None or ours is None or rec.category != ours.category:
            return None, (f"{what} is the engine call {name!r}, which the float model's forward does not make"
                          f"{' with the same op' if rec is not None else ''}"), False
        if rec.category not in VALUE_CATEGORIES and rec.category != "input":
            return None, f"{what} is the engine call {name!r}, a {rec.category} op: no quant point", False
        folded_last = last.op == "call_module" and str(last.target) in self.folded
        through = bool(views) and not (folded_last and len(views) == 1)
        if through:
            return name, f"after {what}, which keeps {name!r}'s values on their grid (no engine op)", True
        if len(chain) > 1:
            return name, f"the output of {what}", False
        return name, "", False


    def view(self, node_name: str) -> str | None:
        """The passthrough *module* call (a Dropout) that computes ``node_name``'s value, if one
        does: a re-quantization there can get an engine point of its own (``build``)."""
        chain = self.chains.get(node_name, [self.nodes.get(node_name)])
        last = chain[-1] if chain and chain[-1] is not None else None
        name = self.names.get(last.name, "") if last is not None else ""
        record = self.records.get(name) if name.startswith("~") else None
        return (record.owner or None) if record is not None and record.is_module else None


def _layer_of(plan: Plan, record: Any) -> str | None:
    """The conv/linear layer whose own forward runs ``record``'s conv/linear function: FX
    traces into a layer subclass with a forward of its own (``Conv2dStaticSamePadding``: pad,
    then ``F.conv2d(x, self.weight)``), which the engine calls as one layer; None otherwise."""
    kind = {"conv1d": "conv", "conv2d": "conv", "linear": "linear"}.get(record.op)
    layer = plan.calls.get(record.owner) if kind and not record.is_module else None
    return record.owner if layer is not None and layer.is_module and layer.category == kind else None


def _weight_of(plan: Plan, node: Any) -> str | None:
    """The conv/linear layer whose ``weight`` the get_attr ``node`` reads: FX observes the weight
    of a functional conv (a layer's own forward) like an activation, on that node."""
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    path, _, attr = str(node.target).rpartition(".")
    layer = plan.calls.get(path)
    return path if attr == "weight" and layer is not None and layer.is_module and \
        layer.category in ("conv", "linear") else None


def _describe(node: torch.fx.Node) -> str:
    """A node in the user's terms: a module path, else the op."""
    if node.op == "call_module":
        return repr(str(node.target))
    if node.op in ("call_function", "call_method"):
        return f"{getattr(node.target, '__name__', node.target)!s}() ({node.name})"
    return node.name


def _same_grid(a: nn.Module, b: nn.Module) -> bool:
    if a is b:
        return True
    from qdebug.interop.source import quantizer_settings, torch_qparams

    (sa, za), (sb, zb) = torch_qparams(a), torch_qparams(b)
    ra, rb = quantizer_settings(a), quantizer_settings(b)
    return torch.equal(sa.flatten(), sb.flatten()) and torch.equal(za.flatten(), zb.flatten()) and \
        (ra["quant_min"], ra["quant_max"]) == (rb["quant_min"], rb["quant_max"])


def _cat_input(prepared: torch.fx.GraphModule, node: torch.fx.Node, anchors: _Anchors) -> tuple[str, str] | None:
    """(the cat's engine call, note) when observer ``node`` quantizes an input of a cat whose
    output is quantized on the same grid: fq(cat(fq(a), b)) = fq(cat(a, b)), so the cat's
    point computes it -- torch puts one observer on all of a cat's inputs and its output."""
    users = list(node.users)
    if len({u.name for u in users}) != 1 or users[0].op not in ("call_function", "call_method"):
        return None
    cat = users[0]
    outputs = [u for u in cat.users if _is_observer_node(prepared, u)]
    if not outputs or not _same_grid(prepared.get_submodule(str(node.target)),
                                     prepared.get_submodule(str(outputs[0].target))):
        return None
    anchor, _, through = anchors.of(cat.name)
    if anchor is None or through or anchors.plan.calls[anchor].category != "cat":
        return None
    return anchor, (f"quantizes an input of {anchor!r} on the grid of its output: the same values as "
                    f"quantizing the cat's output")


# -- quantizers --------------------------------------------------------------------------

def _activation_quantizers(prepared: torch.fx.GraphModule, anchors: _Anchors) -> list[SourceQuantizer]:
    """One quantizer per observer node.  Those that re-quantize a value another observer
    quantizes (after a passthrough op, on a cat's input) go last, so the observer of the
    value itself is the one a shared point keeps (``build`` reports the others)."""
    direct, secondary, weights = [], [], []
    first_name: dict[int, str] = {}
    for node in prepared.graph.nodes:
        if not _is_observer_node(prepared, node):
            continue
        module = prepared.get_submodule(str(node.target))
        observed = node.args[0] if node.args else None
        while isinstance(observed, torch.fx.Node) and _is_observer_node(prepared, observed):
            observed = observed.args[0] if observed.args else None  # an observer of an observer
        shared = first_name.setdefault(id(module), str(node.target))
        layer = _weight_of(anchors.plan, observed)
        if layer is not None:
            weights.append(read_quantizer(module, str(node.target), "weight", layer,
                                          f"observes {layer!r}'s weight, which the layer's own forward reads"))
            continue
        if not isinstance(observed, torch.fx.Node):
            anchor, note, later = None, "observes no graph value", False
        else:
            anchor, note, later = anchors.of(observed.name)
            # After a passthrough (a chunk feeding a cat, say), the value may already be on
            # another grid: when this observer is its cat's, the cat's point is its place.
            cat = _cat_input(prepared, node, anchors) if later or anchor is None else None
            if cat is not None:
                anchor, note = cat
        notes = [note, f"the same observer module as {shared!r}" if shared != node.target else ""]
        quantizer = read_quantizer(module, str(node.target), "activation", anchor, "; ".join(n for n in notes if n))
        if later and anchor is not None and isinstance(observed, torch.fx.Node):
            quantizer.view = anchors.view(observed.name)
        (secondary if later else direct).append(quantizer)
    taken = {q.anchor for q in direct if q.anchor}
    for q in secondary:
        rec = anchors.plan.calls.get(q.anchor) if q.anchor else None
        if q.view is not None:
            continue  # a point on the view quantizes that path alone (``build``)
        if rec is not None and q.anchor not in taken and len(rec.consumers) > 1:
            # torch quantizes this one path only; a point at the shared value would also
            # change what its other consumers see.
            q.note = (f"{q.note}; {q.anchor!r} also feeds other ops unquantized: no engine point quantizes "
                      f"only this path")
            q.anchor = None
        elif q.anchor:
            taken.add(q.anchor)
    return direct + secondary + weights


def _weight_quantizers(prepared: torch.fx.GraphModule, model: nn.Module, attrs: Any, qat: bool,
                       source: SourceModel) -> list[SourceQuantizer]:
    """QAT: each module's ``weight_fake_quant``; PTQ: what convert observes with ``qconfig.weight()``."""
    found = []
    for node in prepared.graph.nodes:
        if node.op != "call_module" or _is_observer_node(prepared, node):
            continue
        path = str(node.target)
        module = prepared.get_submodule(path)
        fake_quant = getattr(module, "weight_fake_quant", None)
        if isinstance(fake_quant, nn.Module) and is_quantizer(fake_quant):
            found.append(read_quantizer(fake_quant, f"{path}.weight_fake_quant", "weight", path))
            continue
        layer = model.get_submodule(path)
        if isinstance(layer, TRANSPOSED_CONVS):  # in QAT too: prepare_qat_fx leaves it float, convert_fx quantizes it
            qconfig = getattr(module, "qconfig", None) or attrs.node_name_to_qconfig.get(node.name)
            if qconfig is not None and node.name in attrs.observed_node_names and qconfig.weight is not None:
                source.unsupported.append((f"{path}.qconfig.weight()", transposed_weight_note(layer), "weight"))
            continue
        if qat:
            continue
        if not isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Linear)):
            continue
        qconfig = getattr(module, "qconfig", None) or attrs.node_name_to_qconfig.get(node.name)
        if qconfig is None or node.name not in attrs.observed_node_names or qconfig.weight is None:
            continue  # convert_fx leaves this layer in float
        observer = qconfig.weight()
        if not isinstance(getattr(observer, "dtype", None), torch.dtype) or observer.dtype.is_floating_point:
            source.unsupported.append((f"{path}.qconfig.weight()",
                                       f"a {observer.dtype} weight has no integer grid: left float"))
            continue
        observer(layer.weight.detach())
        found.append(read_quantizer(observer, f"{path}.qconfig.weight()", "weight", path,
                                    note="observed on the weight, as torch's convert does"))
    return found
