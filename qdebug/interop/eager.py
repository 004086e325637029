"""Read a model prepared by torch.ao's eager mode (``prepare_qat`` / ``prepare``).

Eager prepare keeps the user's class and module paths and adds quantizers as children:

- ``P.activation_post_process`` quantizes the output of module ``P`` (a forward hook); on a
  fused module (``ConvBnReLU2d`` at ``conv``) that output is the last fused op's, the ReLU's;
  on a ``QuantStub`` it is the stub's input; on a ``FloatFunctional`` it is its op's result;
- ``P.weight_fake_quant`` quantizes ``P``'s weight (QAT).  A PTQ-prepared layer has no weight
  quantizer yet: torch observes the weight at convert with ``P.qconfig.weight()``, and so does
  the importer.

``fuse_modules(_qat)`` replaced the fused BN and ReLU by ``nn.Identity`` at their own paths.
``unfuse`` undoes that: it finds those identities by dataflow (the ones called on the fused
module's output, in call order), puts the BN and a ReLU back, turns QAT layers into float
ones and drops every quantizer, so the engine wraps the user's architecture with the source's
weights and the same names.  ``trace_float`` traces the result, finding what each QuantStub
and FloatFunctional quantizes, and ``splice_identities`` keeps a BN that torch folded (its
identity) from splitting the conv from its ReLU.  A ``torch.ao.nn.quantizable.LSTM`` (the
custom-module flow's swap of ``nn.LSTM``) goes back to an ``nn.LSTM`` whose quantizers map onto
the engine's ``QLSTM`` points (``qdebug.interop.recurrent``); a quantizable
``MultiheadAttention`` to an ``nn.MultiheadAttention``, whose quantizers map onto the calls of
the engine's ``QMultiheadAttention`` (``qdebug.interop.attention``): the plan is traced on the
float model with its attentions decomposed, as ``prepare`` traces it.  Converted eager models
(``qdebug.interop.converted``) share all three.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.nn as nn

from qdebug.engine.attention import decomposed_copy
from qdebug.engine.context import split_inputs
from qdebug.engine.ops import FUSABLE_INTO_ACTIVATION, FUSED_ACTIVATIONS
from qdebug.engine.plan import CallRecord, Plan, TraceHandler, resolve_outputs, trace_plan
from qdebug.errors import QDebugError
from qdebug.interop.attention import attention_quantizers, float_attention, quantizable_attentions
from qdebug.interop.recurrent import float_lstm, lstm_quantizers, quantizable_lstms
from qdebug.interop.source import (TRANSPOSED_CONVS, SourceModel, SourceQuantizer, full_range, read_quantizer,
                                   transposed_weight_note)

try:
    from torch.ao.quantization import FakeQuantizeBase, ObserverBase
except ImportError:  # pragma: no cover - torch without torch.ao
    FakeQuantizeBase = ObserverBase = ()  # type: ignore[assignment]

QUANTIZER_TYPES = tuple(t for t in (FakeQuantizeBase, ObserverBase) if isinstance(t, type))
_TORCH_HOOKS = ("_observer_forward_hook", "_observer_forward_pre_hook")


def is_quantizer(module: nn.Module) -> bool:
    return bool(QUANTIZER_TYPES) and isinstance(module, QUANTIZER_TYPES)


def is_eager_prepared(model: nn.Module) -> bool:
    """Whether ``model`` holds torch.ao quantizers as ``activation_post_process``/``weight_fake_quant`` children."""
    return any(is_quantizer(m) and name.rpartition(".")[2] in ("activation_post_process", "weight_fake_quant")
               for name, m in model.named_modules())


def _fused_parts(module: nn.Module) -> tuple[nn.Module, list[nn.Module]] | None:
    """(the float layer, the float modules fused after it) of a torch fused or QAT module, else None."""
    import torch.ao.nn.intrinsic as nni

    name = type(module).__module__
    if not (name.startswith("torch.ao.nn.intrinsic.qat") or name.startswith("torch.ao.nn.qat")):
        if isinstance(module, nni._FusedModule):  # PTQ-fused: a Sequential of the float modules
            children = list(module.children())
            return _float_layer(children[0]), [copy.deepcopy(c) for c in children[1:] if not is_quantizer(c)]
        return None
    followers: list[nn.Module] = []
    bn = getattr(module, "bn", None)
    if isinstance(bn, nn.modules.batchnorm._BatchNorm):
        followers.append(copy.deepcopy(bn))
    if "ReLU" in type(module).__name__:
        followers.append(nn.ReLU())
    return _float_layer(module), followers


def _float_layer(module: nn.Module) -> nn.Module:
    """A plain ``nn.Conv1d/2d`` or ``nn.Linear`` holding ``module``'s weight and bias."""
    if isinstance(module, nn.Linear):
        layer = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
    elif isinstance(module, (nn.Conv1d, nn.Conv2d)):
        cls = nn.Conv1d if isinstance(module, nn.Conv1d) else nn.Conv2d
        layer = cls(module.in_channels, module.out_channels, module.kernel_size, module.stride, module.padding,
                    module.dilation, module.groups, bias=module.bias is not None, padding_mode=module.padding_mode)
    elif isinstance(module, nn.modules.batchnorm._BatchNorm):
        return copy.deepcopy(module)
    else:
        raise QDebugError(f"cannot import a fused {type(module).__name__}",
                          "qdebug imports fused Conv1d/Conv2d/Linear/BatchNorm modules of torch.ao")
    layer.weight = nn.Parameter(module.weight.detach().clone())
    if module.bias is not None:
        layer.bias = nn.Parameter(module.bias.detach().clone())
    return layer.to(module.weight.device)


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)


def _identity_slots(model: nn.Module, fused: list[str], example_inputs: Any) -> dict[str, list[str]]:
    """For each fused module path, the ``nn.Identity`` paths called on its output, in call order."""
    outputs: dict[int, str] = {}
    alive: list[torch.Tensor] = []  # ids of freed tensors are reused: keep every output alive
    slots: dict[str, list[str]] = {path: [] for path in fused}
    handles = []

    def on_fused(path):
        def hook(module, args, output):
            outputs[id(output)] = path
            alive.append(output)
        return hook

    def on_identity(path):
        def hook(module, args, output):
            owner = outputs.get(id(args[0])) if args else None
            if owner is not None:
                slots[owner].append(path)
        return hook

    for path, module in model.named_modules():
        if path in slots:
            handles.append(module.register_forward_hook(on_fused(path)))
        elif type(module) is nn.Identity:
            handles.append(module.register_forward_hook(on_identity(path)))
    run_once(model, example_inputs, handles)
    return slots


def run_once(model: nn.Module, example_inputs: Any, handles: list) -> None:
    """One eval forward of ``model`` without autograd for its hooks to see; the hooks' ``handles``
    are removed and the training flag restored after, whatever happens."""
    was_training = model.training
    try:
        model.eval()
        args, kwargs = split_inputs(example_inputs)
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()


def _strip_quantizers(model: nn.Module) -> None:
    """Drop torch's quantizers, observer hooks and qconfigs: a float model again."""
    from torch.ao.nn.quantized import FloatFunctional

    for module in list(model.modules()):
        for hooks in (module._forward_hooks, module._forward_pre_hooks):
            for key, hook in list(hooks.items()):
                if getattr(hook, "__name__", "") in _TORCH_HOOKS:
                    del hooks[key]
        for attr in ("activation_post_process", "weight_fake_quant"):
            child = module._modules.get(attr)
            if child is not None and is_quantizer(child):
                if isinstance(module, FloatFunctional):
                    module._modules[attr] = nn.Identity()
                else:
                    del module._modules[attr]
        for attr in ("qconfig", "weight_fake_quant"):
            if attr in module.__dict__:
                del module.__dict__[attr]


def unfuse(model: nn.Module, parts: dict[str, tuple[nn.Module | None, list[nn.Module]]], example_inputs: Any,
           folded_bn: Callable[[str], bool]) -> tuple[nn.Module, list[tuple[str, str]], dict[str, list[str]]]:
    """A float copy of ``model`` with torch's fusion undone and its quantizers dropped.

    ``parts``: path -> (the float layer to put there, or None to keep the module; the float
    modules fused after it).  The followers go back to the last identities called on the
    layer's output, in order; identities before them are BNs torch folded into the layer's
    weights when ``folded_bn(slot)`` says so.  Returns (the copy, [(layer, folded BN path)],
    {layer path: the slots its followers went to}).
    """
    restored = copy.deepcopy(model)  # the run below moves a prepared model's observers: never the user's
    slots = _identity_slots(restored, list(parts), example_inputs) if parts else {}
    folded: list[tuple[str, str]] = []
    placed: dict[str, list[str]] = {}
    for path, (layer, followers) in parts.items():
        found = slots.get(path, [])
        if len(found) < len(followers):
            raise QDebugError(f"cannot find where the modules fused into {path!r} were in the float model",
                              "fuse with torch.ao.quantization.fuse_modules(_qat), which leaves nn.Identity "
                              "at the fused modules' paths")
        if layer is not None:
            _set(restored, path, layer)
        cut = len(found) - len(followers)
        for slot, follower in zip(found[cut:], followers):
            _set(restored, slot, follower)
        placed[path] = found[cut:]
        folded += [(path, slot) for slot in found[:cut] if folded_bn(slot)]
    _strip_quantizers(restored)
    return restored, folded, placed


def read_eager(prepared: nn.Module, example_inputs: Any) -> tuple[SourceModel, Plan]:
    """The ``SourceModel`` of an eager-prepared model, and the engine plan of its float model."""
    quantizers = {name: m for name, m in prepared.named_modules()
                  if is_quantizer(m) and name.rpartition(".")[2] in ("activation_post_process", "weight_fake_quant")
                  and not is_quantizer(prepared.get_submodule(name.rpartition(".")[0]) if "." in name else prepared)}
    qat = any(isinstance(m, FakeQuantizeBase) for m in quantizers.values())
    # torch.ao's quantizable LSTMs (custom-module flow) go back to nn.LSTM: their quantizers
    # map onto the QLSTM's points (qdebug.interop.recurrent), nothing inside them is a layer.
    lstms = quantizable_lstms(prepared)
    # Likewise torch.ao's quantizable MHAs go back to nn.MultiheadAttention (qdebug.interop.attention).
    attentions = quantizable_attentions(prepared)
    inside = tuple(f"{path}." for path in (*lstms, *attentions))
    quantizers = {name: m for name, m in quantizers.items() if not (inside and name.startswith(inside))}
    parts: dict[str, tuple[nn.Module | None, list[nn.Module]]] = {
        path: found for path, m in prepared.named_modules()
        if path and not (inside and path.startswith(inside)) and (found := _fused_parts(m)) is not None}
    if not qat:
        # PTQ fuse_modules leaves a Conv-BN as a plain conv with the BN folded in and nn.Identity
        # at the BN's path: an identity called on a plain layer's output is such a BN.
        parts.update({path: (None, []) for path, m in prepared.named_modules()
                      if path and path not in parts and not (inside and path.startswith(inside))
                      and type(m) in (nn.Conv1d, nn.Conv2d, nn.Linear)})
    parts.update({path: (float_lstm(path, m), []) for path, m in lstms.items()})
    parts.update({path: (float_attention(m), []) for path, m in attentions.items()})
    model, folded, placed = unfuse(prepared, parts, example_inputs, folded_bn=lambda slot: not qat)
    bn_pairs = [(path, placed[path][0]) for path, (_, followers) in parts.items()
                if qat and followers and isinstance(followers[0], nn.modules.batchnorm._BatchNorm)]
    last_of = {path: slots[-1] for path, slots in placed.items() if slots}
    # Traced as prepare traces: each nn.MultiheadAttention decomposed into its calls.
    plan, _, stub_anchor = trace_float(decomposed_copy(model), example_inputs, [slot for _, slot in folded])

    source = SourceModel("eager", "qat" if qat else "calibrated", model, example_inputs, bn_pairs=bn_pairs,
                         folded_bn=folded)
    for name, quantizer in quantizers.items():
        owner, _, attr = name.rpartition(".")
        if attr == "weight_fake_quant":
            slow = getattr(prepared.get_submodule(owner), "_enable_slow_path_for_better_numerical_stability", False)
            # The slow path's eval output is conv(x, fq(W f)) + (b - mean) f + beta: the same values
            # in another float order, so a value on a rounding tie of the next quantizer may differ.
            note = ("torch's slow Conv-BN path folds in eval: equal to the engine's up to float rounding "
                    "(qat_mode='fuse_bn' is its order)") if slow else ""
            source.quantizers.append(read_quantizer(quantizer, name, "weight", owner, note=note))
            source.quantizers[-1].approximate = bool(slow)  # another float order: not bit-identical
            continue
        for anchor in _activation_anchors(prepared, owner, last_of, stub_anchor, plan):
            q = read_quantizer(quantizer, name, "activation", anchor)
            if not qat:
                full_range(q)
            source.quantizers.append(q)
    if not qat:
        source.quantizers.extend(_ptq_weights(prepared, model, inside))
    source.unsupported.extend(_transposed_weights(prepared))
    for path, module in lstms.items():
        source.quantizers.extend(lstm_quantizers(path, module, qat))
    for path, module in attentions.items():
        found, idle = attention_quantizers(path, module, qat, plan.calls)
        source.quantizers.extend(found)
        source.idle.extend(idle)
    return source, plan


def trace_float(model: nn.Module, example_inputs: Any,
                folded_slots: list[str]) -> tuple[Plan, dict[str, CallRecord], dict[str, list[str]]]:
    """(the plan, the trace's records, QuantStub/FloatFunctional path -> the engine call its
    grid quantizes, per call): a QuantStub quantizes its input, a FloatFunctional its op's
    result (both found as the producer of what they are given)."""
    from torch.ao.nn.quantized import FloatFunctional
    from torch.ao.quantization import QuantStub

    handler = TraceHandler()
    anchors: dict[str, list[str]] = defaultdict(list)
    views: list[str] = []  # the trace's names of the folded-BN identities
    hooks = []

    def input_of(path):
        def pre_hook(module, args):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if tensors:  # a FloatFunctional called k times: k calls
                anchors[path].append(handler.producer.get(id(tensors[0]), ""))
        return pre_hook

    def view_of(module, args, output):
        views.append(handler.producer.get(id(output), ""))

    for path, module in model.named_modules():
        if isinstance(module, QuantStub):
            hooks.append(module.register_forward_pre_hook(input_of(path)))
        elif isinstance(module, FloatFunctional):
            hooks.append(module.activation_post_process.register_forward_pre_hook(input_of(path)))
        elif path in folded_slots:
            hooks.append(module.register_forward_hook(view_of))
    try:
        plan = trace_plan(model, example_inputs, handler)
    finally:
        for handle in hooks:
            handle.remove()
    splice_identities(plan, handler.records, views)
    return plan, handler.records, dict(anchors)


def splice_identities(plan: Plan, records: dict[str, CallRecord], views: list[str]) -> None:
    """Take the identities a folded BN left out of the dataflow, and fuse what they kept apart.

    The trace records an ``nn.Identity`` as a passthrough view, a second use of the conv's
    output that blocks the conv's fusion into the ReLU after it.  torch's fused kernel
    (ConvReLU2d) requantizes straight onto the ReLU's grid; so does the engine once the view
    is gone (the rule is ``qdebug.engine.plan``'s: a fusable op whose one consumer is a
    relu/relu6 with one input).
    """
    touched = []
    for view in views:
        rec = records.get(view)
        if rec is None or not view.startswith("~") or len(rec.inputs) != 1 or not rec.inputs[0]:
            continue
        src = records[rec.inputs[0]]
        at = src.consumers.index(view) if view in src.consumers else len(src.consumers)
        src.consumers[at:at + 1] = rec.consumers
        for name in rec.consumers:
            consumer = records.get(name)
            if consumer is None:  # "<output>": the view was the model's output
                continue
            consumer.inputs = [src.name if i == view else i for i in consumer.inputs]
        rec.inputs, rec.consumers = [], []
        touched.append(src.name)
    for name in touched:
        src = plan.calls.get(name)
        if src is None or src.fused_into is not None or src.category not in FUSABLE_INTO_ACTIVATION:
            continue
        if len(src.consumers) == 1:
            follower = plan.calls.get(src.consumers[0])
            if follower is not None and follower.category in FUSED_ACTIVATIONS and len(follower.inputs) == 1:
                src.fused_into = follower.name
                src.point = None
    resolve_outputs(plan.calls)


def _activation_anchors(prepared: nn.Module, owner: str, last_of: dict[str, str], stub_anchor: dict[str, list[str]],
                        plan: Plan) -> list[str | None]:
    """The engine calls whose output the eager quantizer of module ``owner`` quantizes."""
    if owner in stub_anchor:
        return [anchor or None for anchor in stub_anchor[owner]]
    path = last_of.get(owner, owner)
    count = plan.call_counts.get(path, 0)
    if count == 0:
        return [path] if path in plan.calls else [None]
    # A module called k times shares its one quantizer between its calls (torch's hook).
    return [path if k == 1 else f"{path}#{k}" for k in range(1, count + 1)]


def _transposed_weights(prepared: nn.Module) -> list[tuple[str, str, str]]:
    """The weight quantizers torch's convert builds for transposed convs (``qconfig.weight()``; in
    QAT too: torch's prepare_qat leaves them float, its convert quantizes them): unmapped rows."""
    found = []
    for path, module in prepared.named_modules():
        if getattr(module, "qconfig", None) is None or getattr(module, "activation_post_process", None) is None:
            continue
        if isinstance(module, TRANSPOSED_CONVS):
            found.append((f"{path}.qconfig.weight()", transposed_weight_note(module), "weight"))
    return found


def _ptq_weights(prepared: nn.Module, model: nn.Module, inside: tuple[str, ...] = ()) -> list[SourceQuantizer]:
    """PTQ: the weight quantizers torch's convert would build (``qconfig.weight()`` on each weight);
    ``inside``: prefixes of custom modules whose front ends read their own weights."""
    found = []
    for path, module in prepared.named_modules():
        if inside and path.startswith(inside):
            continue
        qconfig = getattr(module, "qconfig", None)
        if qconfig is None or getattr(module, "activation_post_process", None) is None:
            continue
        try:
            layer = model.get_submodule(path)
        except AttributeError:
            continue
        if not isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Linear)):
            continue
        observer = qconfig.weight()
        observer(layer.weight.detach())
        found.append(read_quantizer(observer, f"{path}.qconfig.weight()", "weight", path,
                                    note="observed on the weight, as torch's convert does"))
    return found
