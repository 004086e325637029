"""The quantization plan: one traced forward turned into decisions.

``trace_plan(model, example_inputs)`` runs the float model once inside a
``ForwardContext`` that records, for every call, which calls produced its inputs
and which consumed its output.  From that dataflow graph it decides:

- Conv->BN pairs: the BN's input is exactly the conv's output and nothing else
  uses it (both modules called once).  Conv->ReLU->BN is not a pair.
- constants: an inline op that reads no activation (only parameters, buffers, integer
  tensors not made from the model's inputs, and what is computed from them: a rotary
  embedding's cos/sin table, a mask built from positions) computes a constant that an exporter folds into
  an initializer.  It gets no point of its own -- unless an activation op reads it:
  the last constant before the activations is quantized once, like the initializer
  a deployed model holds (``constant``: never reported as a float fallback).
- fused activations: a conv/linear/bn/add/sub whose only consumer is a
  relu/relu6 has no quant point of its own; the activation's point quantizes
  both (as deployed kernels fuse them).  Conv->BN->ReLU fuses all three.
- which calls get an activation quant point, and for every call the point
  that quantizes its output (its own, or the fused activation's).  A call whose
  output holds several floating tensors gets a point per tensor (``members``,
  ``qdebug.engine.members``) and is never fused.

The plan is plain data (``to_dict``/``from_dict``) so checkpoints carry it and a
reload needs no example inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from qdebug.engine.context import Call, ForwardContext, Handler
from qdebug.engine.members import member_name, member_paths, split_name
from qdebug.engine.ops import (
    FUSABLE_INTO_ACTIVATION,
    FUSED_ACTIVATIONS,
    VALUE_CATEGORIES,
    module_category,
    tensors_in,
)


@dataclass
class CallRecord:
    name: str
    category: str
    op: str
    owner: str
    is_module: bool
    inputs: list[str] = field(default_factory=list)  # producer call names ("" = not produced by a call)
    consumers: list[str] = field(default_factory=list)
    point: str | None = None  # activation point quantizing this call's own output
    output_point: str | None = None  # point whose grid the output lands on (own or fused)
    fused_into: str | None = None  # the relu/relu6 (or BN) call that takes over the output
    fused_activation: str | None = None  # "relu"/"relu6" clamp to apply in integer kernels
    # Paths of the output's floating tensors when it holds several (``qdebug.engine.members``):
    # each gets a point of its own, ``<point>:<path>``; [] = one point named ``point``.
    members: list[str] = field(default_factory=list)
    constant: bool = False  # reads no activation (folded by an exporter)

    def point_names(self) -> list[str]:
        """The names of the activation points quantizing this call's own output (none when fused)."""
        if self.point is None:
            return []
        return [member_name(self.point, m) for m in self.members] or [self.point]

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "members": list(self.members)}


@dataclass
class Plan:
    calls: dict[str, CallRecord]
    pairs: list[tuple[str, str]]  # (conv module path, bn module path)
    call_counts: dict[str, int]  # module path -> calls in one forward (0 = dead)

    def to_dict(self) -> dict[str, Any]:
        return {
            "calls": [c.to_dict() for c in self.calls.values()],
            "pairs": [list(p) for p in self.pairs],
            "call_counts": dict(self.call_counts),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        calls = {}
        for c in data["calls"]:
            rec = CallRecord(**{**c, "members": list(c.get("members", []))})  # its own list: discover extends it
            calls[rec.name] = rec
        return cls(calls=calls, pairs=[tuple(p) for p in data["pairs"]], call_counts=dict(data["call_counts"]))

    def point_calls(self) -> list[CallRecord]:
        return [c for c in self.calls.values() if c.point]

    def call_of_point(self, name: str) -> str:
        """The call an activation point (or compare row) ``name`` belongs to: ``lstm`` for
        ``lstm:1.1``; a name that is no member of a planned call is returned as it is."""
        if name in self.calls:
            return name
        call, path = split_name(name)
        rec = self.calls.get(call)
        return call if rec is not None and path in rec.members else name


class TraceHandler(Handler):
    """Records producers/consumers of every tensor by object identity."""

    # Read by the engine's modules below this one (attention, sdpa): while tracing, a decomposition
    # is what gets recorded, never torch's own float kernel.
    tracing = True

    def __init__(self) -> None:
        self.records: dict[str, CallRecord] = {}
        self.producer: dict[int, str] = {}
        self.alive: list[torch.Tensor] = []  # keep tensors alive so ids are not reused
        self.constant_ids: set[int] = set()  # parameters, buffers and what constant ops made of them
        self.from_inputs: set[int] = set()  # integer tensors made from the model's inputs (ids, uint8 pixels)

    def seed_constants(self, model: nn.Module) -> None:
        for t in (*model.parameters(), *model.buffers()):
            self.constant_ids.add(id(t))
            self.alive.append(t)

    def seed_inputs(self, inputs: Any) -> None:
        for t in tensors_in(inputs):
            self.from_inputs.add(id(t))
            self.alive.append(t)

    def _reads_no_activation(self, args: Any) -> bool:
        """Every tensor read is a parameter, a buffer, a constant op's output or an integer tensor
        not made from the model's inputs (positions, sizes).  A float tensor of unknown origin --
        one an engine layer made internally -- counts as an activation, and so does an integer
        input (``x.float() / 255`` of uint8 pixels is the first activation)."""
        return all(id(t) in self.constant_ids if torch.is_floating_point(t) else id(t) not in self.from_inputs
                   for t in tensors_in(args))

    def _mark_constant(self, rec: CallRecord | None, args: Any, output: Any) -> None:
        if self._reads_no_activation(args):
            if rec is not None:
                rec.constant = True
            self.constant_ids.update(id(t) for t in tensors_in(output))
        else:  # integer results of the inputs stay the inputs' (a mask from ids, ids.view(...))
            self.from_inputs.update(id(t) for t in tensors_in(output) if not torch.is_floating_point(t))
        self.alive.extend(tensors_in(output))

    def on_untracked(self, args, kwargs, output):
        self._mark_constant(None, (args, kwargs), output)

    def _inputs(self, args: Any) -> list[str]:
        return [self.producer.get(id(t), "") for t in tensors_in(args)]

    def _produce(self, name: str, output: Any) -> None:
        for t in tensors_in(output):
            self.producer[id(t)] = name
            self.alive.append(t)

    def _record(self, call: Call, args: Any, output: Any, is_module: bool) -> None:
        # Members only where the output gets points (a recurrent layer's points are inside it).
        members = member_paths(output) if call.category in VALUE_CATEGORIES else []
        rec = CallRecord(call.name, call.category, call.op, call.owner, is_module, self._inputs(args),
                         members=members)
        if not is_module:  # a layer applied to a constant is still a layer
            self._mark_constant(rec, args, output)
        self.records[call.name] = rec
        for producer in rec.inputs:
            if producer:
                self.records[producer].consumers.append(call.name)
        self._produce(call.name, output)

    def on_input(self, ctx, call, x):
        self.records[call.name] = CallRecord(call.name, "input", "input", "", False)
        self._produce(call.name, x)
        return x

    def on_module_output(self, ctx, call, module, args, output):
        self._record(call, args, output, True)
        return output

    def on_op(self, ctx, call, func, args, kwargs):
        out = func(*args, **kwargs)
        self._record(call, (args, kwargs), out, False)
        return out

    def on_fallback(self, ctx, call, func, args, output):
        self._record(call, args, output, False)
        return output

    def on_passthrough(self, ctx, func, args, output):
        # A passthrough is a consumer that blocks fusion; its output is "produced"
        # by a synthetic node so consumers of the view are counted too.
        producers = [p for p in self._inputs(args) if p]
        name = f"~view{len(self.records)}"
        # A passthrough module's call name as its owner (importers anchor re-quantizations there).
        owner = ctx.view_call.name if func is None and ctx.view_call is not None else ""
        rec = CallRecord(name, "passthrough", getattr(func, "__name__", "module"), owner, func is None, producers)
        self._mark_constant(rec, args, output)
        self.records[name] = rec
        for p in producers:
            self.records[p].consumers.append(name)
        self._produce(name, output)
        return output

    def on_model_output(self, ctx, output):
        for t in tensors_in(output):
            producer = self.producer.get(id(t))
            if producer:
                self.records[producer].consumers.append("<output>")
        return output


def trace_plan(model: nn.Module, example_inputs: Any, handler: "TraceHandler | None" = None) -> Plan:
    """Trace ``model`` (float, eval, no grad) on ``example_inputs`` and derive the plan.

    ``handler``: a ``TraceHandler`` of the caller's, whose ``producer`` map (tensor id ->
    call name) its own module hooks may read during the run (the torch.ao importer does).
    """
    handler = handler or TraceHandler()
    handler.seed_constants(model)
    handler.seed_inputs(getattr(example_inputs, "inputs", example_inputs))  # a qdebug.data.Batch too
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), ForwardContext(model, handler) as ctx:
            ctx.run(model, example_inputs)
        counts = dict(ctx.counts)
    finally:
        model.train(was_training)
    return _decide(model, handler.records, counts)


def _decide(model: nn.Module, records: dict[str, CallRecord], counts: dict[str, int]) -> Plan:
    calls = {n: r for n, r in records.items() if not n.startswith("~")}
    # A consumer that is a view (passthrough) counts as "another use": it blocks fusion.
    modules = dict(model.named_modules())
    call_counts = {}
    for path, module in modules.items():
        if path and module_category(module) is not None:
            call_counts[path] = counts.get(path, 0)

    pairs: list[tuple[str, str]] = []
    for rec in calls.values():
        if rec.category != "conv" or not rec.is_module or call_counts.get(rec.name) != 1:
            continue
        if len(rec.consumers) != 1:
            continue
        bn = calls.get(rec.consumers[0])
        if bn is None or bn.category != "bn" or not bn.is_module or call_counts.get(bn.name) != 1:
            continue
        bn_module = modules[bn.name]
        conv_module = modules[rec.name]
        if not getattr(bn_module, "track_running_stats", False) or bn_module.running_var is None:
            continue
        if bn_module.num_features != conv_module.out_channels or len(bn.inputs) != 1:
            continue
        pairs.append((rec.name, bn.name))
        rec.fused_into = bn.name

    constants = {name for name, rec in records.items() if rec.constant}
    for rec in calls.values():
        if rec.category not in VALUE_CATEGORIES and rec.category != "input":
            continue
        if rec.constant:
            if all(c in constants for c in _consumers_through_views(records, rec)):
                continue  # only constants read it: folded away, no point
        fusable = rec.category in FUSABLE_INTO_ACTIVATION and not rec.members  # one tensor, one grid
        if rec.fused_into is None and fusable and len(rec.consumers) == 1:
            follower = calls.get(rec.consumers[0])
            if follower is not None and follower.category in FUSED_ACTIVATIONS and len(follower.inputs) == 1:
                rec.fused_into = follower.name
        if rec.fused_into is None:
            rec.point = rec.name

    resolve_outputs(calls)
    return Plan(calls=calls, pairs=pairs, call_counts=call_counts)


def _consumers_through_views(records: dict[str, CallRecord], rec: CallRecord) -> list[str]:
    """The calls reading ``rec``'s output, looking through views (``~view``) to their readers;
    ``<output>`` (the model's output) is one of them and never a constant."""
    found, todo, seen = [], list(rec.consumers), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name.startswith("~") and name in records:
            todo.extend(records[name].consumers)
        else:
            found.append(name)
    return found


def resolve_outputs(calls: dict[str, CallRecord]) -> None:
    """Set where each call's output lands (``output_point``, ``fused_activation``) by following
    its fused chain to a point; run again after editing ``point``/``fused_into`` (an importer
    that matches another tool's choices does)."""
    for rec in calls.values():
        target, activation = rec, None
        seen = 0
        while target.fused_into is not None and seen < 8:
            target = calls[target.fused_into]
            if target.category in FUSED_ACTIVATIONS:
                activation = target.category
            seen += 1
        rec.output_point = target.point
        rec.fused_activation = activation

