"""Float model -> prepared model, and the knobs on a prepared model.

``prepare`` deep-copies the user's model (the original is never touched), traces
it once to build the ``Plan``, swaps Conv/Linear for ``QConv``/``QLinear`` in
place (same names, same parameters), handles Conv-BN pairs in the chosen QAT
mode, creates every quant point, and installs root hooks so each forward runs
inside a ``ForwardContext`` with the ``QuantHandler``.  The prepared model is
still an instance of the user's class with the user's layer names.

``set_mode``, ``quant_points``, ``calibrate`` and ``absorb_bn`` operate on it.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import itertools
import warnings
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.nn as nn

from qdebug import vocab
from qdebug.config import distributed
from qdebug.config.device import model_device
from qdebug.engine.attention import attention_softmax_spec, swap_attention
from qdebug.engine.context import Call, ForwardContext, active_context, run_model
from qdebug.engine.embedding import QEmbedding, quantizable_embedding
from qdebug.engine.functional import QuantHandler
from qdebug.engine.members import member_name, split_name
from qdebug.engine.module_tree import kept_index, replace_modules
from qdebug.engine.modules import QConv, QLinear, _QWeighted, bn_scale_factor, folded_placeholder
from qdebug.engine.norm_input import norm_input_aliases
from qdebug.engine.observers import merge_ranks
from qdebug.engine.ops import VALUE_CATEGORIES, fallback_reason
from qdebug.engine.plan import CallRecord, Plan, trace_plan
from qdebug.engine.point import MODES, QuantPoint
from qdebug.engine.prelu import QPReLU, quantizable_prelu
from qdebug.engine.recurrent import RecurrentLayer, quantizable_recurrent
from qdebug.engine.fake_quant import group_layout
from qdebug.engine.spec import QConfig, QuantSpec
from qdebug.engine.state import STATE_ATTR, engine_state, is_prepared
from qdebug.errors import QDebugError
from qdebug.safe_text import escaped

WEIGHT_ONLY = (QEmbedding, QPReLU)  # engine modules with a weight point, swapped before the trace
QAT_MODES = dict(zip(vocab.QAT_MODES, ("fused", "with_bn", "reverse_fold")))  # mode -> Conv-BN wrapper's bn_mode
POINTS_ATTR = "qdebug_points"
_NO_BATCH = object()


class PointTable(nn.Module):
    """Holds every quant point as a submodule (so state_dict carries them)."""

    @staticmethod
    def key(name: str) -> str:
        return name.replace(".", "/") or "<root>"


class EngineState:
    """Engine bookkeeping attached to a prepared model (plain attributes, deep-copied with it)."""

    def __init__(self, plan: Plan, qconfig: QConfig, qat_mode: str, table: PointTable):
        self.plan = plan
        self.qconfig = qconfig
        self.qat_mode = qat_mode
        self.stage = "fake"  # "fake" (float/calibrated/qat) or "quantized" (integer simulation)
        self.arithmetic = "fixed_point"  # the quantized stage's requantization (qdebug.engine.integer)
        self.float_kernels: set[str] = set()  # calls the target computes in float (qdebug.engine.arithmetic)
        self.table = table
        self.points: "OrderedDict[str, QuantPoint]" = OrderedDict()
        self.listeners: list = []
        self.discovered: list[str] = []
        self.contexts: list[ForwardContext] = []
        self.served = None  # qdebug.engine.served.ServedCalls while an experiment resumes a run
        self.passthrough_recorder = None  # (call, output) -> None while an experiment records a run
        self.tree = None  # the model tree's index for naming, kept between forwards (module_tree.TreeIndex)

    def add_point(self, point: QuantPoint) -> None:
        self.table.add_module(PointTable.key(point.name), point)
        self.points[point.name] = point

    def discover(self, call: Call, members: Sequence[str] = ()) -> QuantPoint | None:
        """A value call the trace never saw (data-dependent path), or ``members`` of a call's
        structured output it never saw: give them points now.  Returns the point of a call
        whose output is one tensor (``members`` empty)."""
        if call.category not in VALUE_CATEGORIES:
            return None
        rec = self.plan.calls.get(call.name)
        if rec is None:
            rec = self.plan.calls[call.name] = CallRecord(
                call.name, call.category, call.op, call.owner, call.module is not None, point=call.name,
                output_point=call.name, members=list(members),
            )
            names = rec.point_names()
        else:  # a planned call whose output now has more tensors than traced
            new = [m for m in members if m not in rec.members]
            rec.members.extend(new)
            names = [member_name(call.name, m) for m in new]
        made = [self._discover_point(call, name) for name in names]
        return made[0] if not members else None

    def _discover_point(self, call: Call, name: str) -> QuantPoint | None:
        spec = self.qconfig.spec_for("activation", activation_names(call.category, call.owner, name))
        if spec is None:
            return None
        point = QuantPoint(name, "activation", spec, op=call.op, owner=call.owner, fallback=call.category == "fallback")
        # Follow the other activation points (weight points sit in "float" during calibration).
        reference = next((p for p in self.points.values() if p.kind == "activation"), None)
        if reference is not None:
            point.to(reference.scale.device)  # where the model runs
            point.mode = reference.mode
            point.observe_in_fake = reference.observe_in_fake
            point.train(reference.training)
            if point.mode == "fake" and not (point.observe_in_fake and point.training):
                # No scale to fake-quantize with (only running observers could set one): stay float.
                point.mode = "float"
        self.add_point(point)
        self.discovered.append(name)
        warnings.warn(
            f"qdebug: call {name!r} was not seen when the model was traced at prepare; it got a new, "
            f"uncalibrated quant point (mode {point.mode!r}; trace with inputs that take every path, "
            "or calibrate again)",
            stacklevel=2,
        )
        return point


def activation_names(category: str, owner: str, point_name: str) -> tuple[str, ...]:
    """The names a qconfig override glob may match for an activation point: the owner's
    module path, the call without its ``#k``, the call, and for a member of a structured
    output (``lstm#2:1.1``) the member under both (``lstm:1.1``, ``lstm#2:1.1``)."""
    call, path = split_name(point_name)
    base = call.split("#")[0]
    if category == "input":
        return ("input", point_name)
    if not path:
        return (owner, base, call)
    return (owner, base, call, member_name(base, path), point_name)


# -- root hooks: module-level functions so deep copies keep working ----------------------
def _root_pre_hook(module: nn.Module, args: tuple, kwargs: dict):
    state: EngineState = getattr(module, STATE_ATTR)
    ctx = ForwardContext(module, QuantHandler(state), state.listeners, kept_index(state, module))
    ctx.served = getattr(state, "served", None)
    ctx.on_passthrough_call = getattr(state, "passthrough_recorder", None)
    state.contexts[:] = [c for c in state.contexts if not c.closed]  # aborted forwards' (release_aborted)
    ctx.__enter__()
    state.contexts.append(ctx)
    return ctx.process_inputs(args, kwargs)


def _root_post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any):
    state: EngineState = getattr(module, STATE_ATTR)
    ctx = state.contexts.pop()
    try:
        if active_context() is ctx and output is not None:
            output = ctx.process_output(output)
    finally:
        ctx.__exit__(None, None, None)
    return output


def prepare(
    model: nn.Module,
    qconfig: QConfig | dict | None = None,
    mode: str = "fuse_bn",
    example_inputs: Any = None,
    *,
    plan: Plan | dict | None = None,
) -> nn.Module:
    """A prepared deep copy of ``model`` (see module docstring).  ``model`` is not modified.

    ``mode``: "fuse_bn" | "with_bn" | "with_bn_reverse_fold".  ``example_inputs``: one
    batch (tensor, tuple of args or dict of kwargs) used to trace the model; a saved
    ``plan`` can replace it.  All points start in mode "float".
    """
    if mode not in QAT_MODES:
        raise QDebugError(f"unknown QAT mode {mode!r}", f"choose one of {', '.join(QAT_MODES)}")
    if isinstance(qconfig, dict):
        qconfig = QConfig.from_dict(qconfig)
    qconfig = qconfig or QConfig()
    if is_prepared(model):
        raise QDebugError("the model is already prepared", "prepare the float model")
    qm = copy.deepcopy(model)
    # Before the trace: the attention's parts (projections, QK^T, softmax, attn.V) are its calls.
    replace_modules(qm, swap_attention)
    # Embeddings and PReLUs too: the trace records their calls as ``activation`` (qdebug.engine.embedding,
    # qdebug.engine.prelu); their weight points are made with the weighted layers'.
    replace_modules(qm, lambda path, module: quantizable_embedding(module) or quantizable_prelu(module))
    if plan is None:
        if example_inputs is None:
            raise QDebugError("prepare needs example_inputs to trace the model", "pass one batch of inputs")
        plan = trace_plan(qm, example_inputs)
    elif isinstance(plan, dict):
        plan = Plan.from_dict(plan)
    else:
        plan = copy.deepcopy(plan)

    def wrap(path: str, module: nn.Module) -> nn.Module | None:
        if isinstance(module, (nn.Conv1d, nn.Conv2d)) and not isinstance(module, _QWeighted):
            return QConv(module)
        if isinstance(module, nn.Linear):
            return QLinear(module)
        return quantizable_recurrent(module)  # LSTM/GRU (cells): qdebug.engine.recurrent

    replace_modules(qm, wrap)

    bn_mode = QAT_MODES[mode]
    for conv_path, bn_path in plan.pairs:
        conv = qm.get_submodule(conv_path)
        bn = qm.get_submodule(bn_path)
        conv.attach_bn(bn, "with_bn" if bn_mode == "fused" else bn_mode)
        if bn_mode == "fused":
            _absorb_pair(qm, conv_path, bn_path)
        elif invalid := _invalid_statistics(bn):
            warnings.warn(f"qdebug: BatchNorm {escaped(bn_path)}: {invalid}: every eval forward "
                          "through it (calibration, evaluation) is NaN there; recompute its statistics in the float "
                          "model", stacklevel=2)

    table = PointTable()
    state = EngineState(plan, qconfig, mode, table)
    used_names: list[tuple[str, ...]] = []
    fallbacks: list[str] = []
    weighted = {path: m for path, m in qm.named_modules() if isinstance(m, (_QWeighted,) + WEIGHT_ONLY)}
    recurrent = {path: m for path, m in qm.named_modules() if isinstance(m, RecurrentLayer)}
    norm_inputs = norm_input_aliases(plan)  # "@norm_input" names (qdebug.engine.norm_input)
    for rec in plan.calls.values():
        if rec.is_module and recurrent.get(rec.name) is not None:  # its points, in execution order
            used_names += recurrent.pop(rec.name).attach_points(rec.name, qconfig, state.add_point)
        # An embedding a saved plan calls a fallback (saved before embeddings were quantized) stays float.
        keeps_float = rec.category == "fallback" and isinstance(weighted.get(rec.name), WEIGHT_ONLY)
        if rec.is_module and rec.name in weighted and weighted[rec.name].weight_point is None and not keeps_float:
            layer = weighted[rec.name]
            names = (rec.name, f"{rec.name}.weight")
            used_names.append(names)
            spec = qconfig.spec_for("weight", names)
            if spec is not None:
                _check_groups(rec.name, layer, spec)
                point = QuantPoint(f"{rec.name}.weight", "weight", spec, op=rec.op, owner=rec.name)
                state.add_point(point)
                layer.attach_weight_point(point)
        for point_name in rec.point_names():  # one per tensor of a structured output (qdebug.engine.members)
            names = activation_names(rec.category, rec.owner, point_name) + norm_inputs.get(point_name, ())
            used_names.append(names)
            spec = qconfig.spec_for("activation", names)
            if spec is None:
                continue
            spec = attention_softmax_spec(qm, rec, spec, qconfig.matching_globs(names))
            state.add_point(QuantPoint(point_name, "activation", spec, op=rec.op, owner=rec.owner,
                                       fallback=rec.category == "fallback" and not rec.constant))
        if rec.category == "fallback" and not rec.constant and any(n in state.points for n in rec.point_names()):
            fallbacks.append(f"{rec.name} ({rec.op}: {fallback_reason(rec.op)})")
    for path, layer in recurrent.items():  # recurrent layers the trace never called (dead)
        used_names += layer.attach_points(path, qconfig, state.add_point)
    for layer in weighted.values():  # weighted layers the trace never called (dead): still quantizable
        if layer.weight_point is None and not isinstance(layer, WEIGHT_ONLY):
            path = next(p for p, m in weighted.items() if m is layer)
            spec = qconfig.spec_for("weight", (path, f"{path}.weight"))
            used_names.append((path, f"{path}.weight"))
            if spec is not None:
                _check_groups(path, layer, spec)
                point = QuantPoint(f"{path}.weight", "weight", spec, op=type(layer).__name__, owner=path)
                state.add_point(point)
                layer.attach_weight_point(point)

    matched = {g for names in used_names for g in qconfig.matching_globs(names)}
    unmatched = [g for g in qconfig.overrides if g not in matched]
    if unmatched:
        raise QDebugError(
            f"qconfig override(s) match no layer: {', '.join(repr(g) for g in unmatched)}",
            "globs match module paths such as 'backbone.*' or quant point names; see qdebug inspect for the names",
        )
    if fallbacks:
        warnings.warn(
            "qdebug: no quantized kernel for these ops; they run in float (weights too) and are re-quantized at "
            "their output: "
            + ", ".join(escaped(name) for name in fallbacks[:10])  # layer names: shown, never sent raw
            + (" ..." if len(fallbacks) > 10 else ""),
            stacklevel=2,
        )
    device = model_device(qm)
    if device is not None:  # the points' scales and observers live with the model's tensors
        table.to(device)
    qm.add_module(POINTS_ATTR, table)
    if isinstance(qm, nn.Sequential):
        qm.__class__ = _sequential_without_points(type(qm))
    object.__setattr__(qm, STATE_ATTR, state)
    qm.register_forward_pre_hook(_root_pre_hook, with_kwargs=True)
    qm.register_forward_hook(_root_post_hook, with_kwargs=True, always_call=True)
    return qm


_SEQUENTIAL_CLASSES: dict[type, type] = {}


def _sequential_without_points(cls: type) -> type:
    """A subclass of a Sequential root whose forward skips the point table (a child it must not call)."""
    if cls not in _SEQUENTIAL_CLASSES:

        def forward(self, *args):
            layers = [m for name, m in self._modules.items() if name != POINTS_ATTR]
            x = args[0] if len(args) == 1 else args
            for layer in layers:
                x = layer(x)
            return x

        _SEQUENTIAL_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
    return _SEQUENTIAL_CLASSES[cls]


def _absorb_pair(qm: nn.Module, conv_path: str, bn_path: str) -> None:
    conv = qm.get_submodule(conv_path)
    bn = conv.bn
    invalid = _invalid_statistics(bn)
    if invalid:
        raise QDebugError(f"BatchNorm {bn_path} cannot be folded into {conv_path}: {invalid} and would fold to NaN "
                          "weights", f"recompute {bn_path}'s statistics in the float model (bn.reset_running_stats(), "
                          "then training-mode forwards on clean data) and prepare it again; qdebug inspect lists "
                          "every such BatchNorm")
    conv.absorb()
    placeholder = folded_placeholder(bn, conv_path)  # a norm-act layer keeps its activation
    placeholder.train(bn.training)
    replace_modules(qm, lambda path, m: placeholder if m is bn else None)


def _invalid_statistics(bn: nn.Module) -> str:
    """The channels of ``bn`` whose statistics no eval forward or fold survives, as a phrase ("" if
    none): a running_var + eps <= 0 (a negative variance) or a NaN statistic makes
    gamma / sqrt(running_var + eps) NaN.  Folding it (fuse_bn, absorb_bn) is refused: it would
    write NaN into whole output channels of the conv, silently, which nothing after repairs --
    calibrate then fails far from the cause ("no scale yet"), and preparing the same float
    checkpoint again folds the same NaN.  A BN kept beside its conv (with_bn,
    with_bn_reverse_fold) is only warned about: training forwards normalize with the batch's
    statistics and re-estimate the running ones, but every eval forward is NaN there."""
    if getattr(bn, "running_var", None) is None or getattr(bn, "running_mean", None) is None:
        return ""  # no running statistics (track_running_stats=False): nothing to fold or to normalize with
    with torch.no_grad():
        bad = ~torch.isfinite(bn_scale_factor(bn)) | ~torch.isfinite(bn.running_mean)
    if not bool(bad.any()):
        return ""
    channels = [int(c) for c in bad.nonzero().reshape(-1)]
    shown = ", ".join(map(str, channels[:8])) + (" ..." if len(channels) > 8 else "")
    return (f"channel(s) {shown} have invalid statistics (running_var {bn.running_var[channels[0]].item():g} in "
            f"channel {channels[0]}: sqrt(running_var + eps) is not a positive number)")


def name_matches(pattern: str, name: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or name == pattern or name.startswith(pattern + ".")


def set_mode(
    model: nn.Module, mode: str, pattern: str = "*", *, kind: str | None = None, observe: bool | None = None
) -> list[str]:
    """Set the mode of the quant points whose name matches ``pattern`` (glob or module prefix).

    ``mode``: "float" | "observe" | "fake".  ``kind``: "weight" | "activation" | None (both).
    ``observe=True`` with "fake" keeps activation observers updating in training (QAT
    with running ranges, as torch's FakeQuantize).  Returns the names changed.
    """
    if mode not in MODES:
        raise QDebugError(f"unknown mode {mode!r}", f"choose one of {', '.join(MODES)}")
    state = engine_state(model)
    changed = []
    for name, point in state.points.items():
        if kind is not None and point.kind != kind:
            continue
        if name_matches(pattern, name) or (point.owner and name_matches(pattern, point.owner)):
            point.mode = mode
            if observe is not None:
                point.observe_in_fake = bool(observe)
            changed.append(name)
    if not changed:
        raise QDebugError(f"no quant point matches {pattern!r}", "list the names with qdebug.engine.quant_points")
    return changed


@contextlib.contextmanager
def quantization_off(model: nn.Module) -> Iterator[None]:
    """Every quant point of a prepared ``model`` in float mode for the duration (its float run),
    the modes restored after; a model the engine did not prepare is left alone."""
    if not is_prepared(model):
        yield
        return
    saved = [(p, p.mode) for p in engine_state(model).points.values()]
    for point, _ in saved:
        point.mode = "float"
    try:
        yield
    finally:
        for point, mode in saved:
            point.mode = mode


def quant_points(model: nn.Module) -> "OrderedDict[str, QuantPoint]":
    """All quant points in execution order: name -> point (.spec, .scale, .zero_point, .mode, .kind)."""
    return OrderedDict(engine_state(model).points)


def calibrate(
    model: nn.Module, batches: Iterable[Any], *, progress: Callable[[int], None] | None = None
) -> nn.Module:
    """Run ``batches`` through the model with every observer on, then freeze the scales.

    Each batch is the model's input (a tensor, a tuple of args or a dict of kwargs) or a
    ``qdebug.data.Batch``.  Afterwards every point is in mode "fake".  Points never reached
    keep no scale and are reported by ``quant_points`` as uninitialised.  Under torchrun
    (``qdebug.config.distributed``) each rank observes its share of the batches and the ranks'
    observers are merged before the scales freeze, so every rank freezes the same scales.
    """
    state = engine_state(model)
    group = distributed.current()
    batches = (getattr(batch, "inputs", batch) for _, batch in group.shard(batches))
    first = next(batches, _NO_BATCH)
    if first is _NO_BATCH and not group.active:  # checked before any observer is reset or mode changed
        raise QDebugError("calibration got no batches", "pass at least one batch of inputs")
    batches = itertools.chain([first] if first is not _NO_BATCH else [], batches)
    was_training = model.training
    model.eval()
    for point in state.points.values():
        if point.kind == "activation":
            point.observer.reset()
            point.mode = "observe"
        else:
            point.mode = "float"
    count = 0
    with torch.no_grad():
        for batch in batches:
            run_model(model, batch)
            count += 1
            if progress is not None:
                progress(count)
    if group.active:
        count = _merge_observers(group, state, count)
    if count == 0:
        raise QDebugError("calibration got no batches", "pass at least one batch of inputs")
    for name, point in state.points.items():
        if point.kind == "activation":
            if point.observer.initialized:
                point.update_from_observer()
            point.freeze(True)
        point.mode = "fake"
    _refresh_weight_points(model)
    model.train(was_training)
    return model


def _check_groups(path: str, layer: nn.Module, spec: QuantSpec) -> None:
    """A grouped weight spec must cut the layer's weight rows evenly: refused at prepare, naming the layer."""
    if spec.group_size is None:
        return
    try:
        group_layout(layer.weight.shape, spec.group_size)
    except QDebugError as exc:
        raise QDebugError(f"{path}.weight: {exc.message}", exc.hint) from None


def _merge_observers(group: "distributed.Group", state: Any, count: int) -> int:
    """Every rank's activation observers merged into this rank's (exact); the number of
    batches all ranks saw."""
    merge_ranks(group, {name: p.observer for name, p in state.points.items() if p.kind == "activation"})
    return group.combine(count, lambda a, b: a + b)


def _refresh_weight_points(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, WEIGHT_ONLY):
            module.refresh_weight_qparams()
        elif isinstance(module, _QWeighted) and module.weight_point is not None:
            point = module.weight_point
            point.forget_cached()
            if not point.spec.learnable_scale or not point.initialized:
                # Learnable scales are initialised once here and then belong to the optimizer.
                was_frozen = point.frozen
                point.frozen = False
                module.refresh_weight_qparams()
                point.frozen = was_frozen
        elif isinstance(module, RecurrentLayer):
            module.refresh_weight_qparams(calibrating=True)


def refresh_weight_qparams(model: nn.Module) -> None:
    """Bring every dynamic weight point's qparams up to date with its weight (done before saving),
    and drop every cached fake-quantized weight (call it after editing weights through ``.data``)."""
    for module in model.modules():
        if isinstance(module, (_QWeighted,) + WEIGHT_ONLY):
            if module.weight_point is not None:
                module.weight_point.forget_cached()
            module.refresh_weight_qparams()
        elif isinstance(module, RecurrentLayer):
            module.refresh_weight_qparams()


def absorb_bn(model: nn.Module, pattern: str = "*") -> list[str]:
    """Fold the BN of every Conv-BN pair whose conv (or BN) path matches ``pattern`` now.

    Under with_bn_reverse_fold the eval output is unchanged; under with_bn the
    folded weight is re-quantized with a new scale.  Returns the convs folded.
    """
    state = engine_state(model)
    done = []
    for conv_path, bn_path in state.plan.pairs:
        conv = model.get_submodule(conv_path)
        if conv.bn is None:
            continue
        if name_matches(pattern, conv_path) or name_matches(pattern, bn_path):
            _absorb_pair(model, conv_path, bn_path)
            done.append(conv_path)
    return done
