"""Isolated errors: one call of a compared model, run on the reference model's inputs.

``IsolatedReplay.output(event, record)`` gives what the compared model's call
would output had it received the reference's inputs for that call (same quant
point, same integer kernel) -- compared with the reference output, that is the
call's own error, free of everything upstream.

Most calls are replayed: run again on the recorded reference inputs.  A call
that computes *the same float function* in both models needs no run: its float
result on the reference inputs is the reference output itself, so only the
compared model's quant point is applied to it.  That holds, exactly, when

- the compared model computes in float (not the integer kernels of the
  quantized stage) and the reference output is the reference's float result
  (no active quant point at that call in the reference);
- an inline op is the same torch function (``record.func is event.func``; the
  replay would call it on the very same recorded arguments);
- a module is of the same class, not a quantized weighted layer, in the same
  train/eval mode, with equal settings (plain attributes by value, any other
  attribute only if it is the same object), bitwise-equal parameters and
  buffers, and no per-module hooks: BN of a calibrated model, ReLU, pooling.

So a calibrated model's BN, ReLU and add cost one quantization (or nothing) instead
of a recomputation.  The decision is made once per call name and compare run.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from qdebug.engine import engine_state, is_prepared
from qdebug.engine.context import Event, active_context
from qdebug.engine.modules import _QWeighted
from qdebug.engine.ops import map_tensors, tensors_in
from qdebug.engine.point import QuantPoint, grid_of
from qdebug.measure.tap import Record

_PLAIN = (bool, int, float, str, tuple, type(None))


def project(ref_args: Any, own_args: Any) -> Any:
    """Reference inputs moved onto the grids the model's own inputs lie on (integer kernels)."""
    own = iter(tensors_in(own_args))

    def one(t: torch.Tensor) -> torch.Tensor:
        mine = next(own, None)
        point: QuantPoint | None = grid_of(mine) if isinstance(mine, torch.Tensor) else None
        if point is None or not torch.is_floating_point(t):
            return t
        return point.apply(t)

    return map_tensors(ref_args, one)


def _same_settings(a: nn.Module, b: nn.Module) -> bool:
    """Public attributes equal: plain values (sizes, flags, eps, modes) by value, anything
    else (a function, a tensor that is not a buffer) only if it is the very same object."""
    sa = {k: v for k, v in vars(a).items() if not k.startswith("_")}
    sb = {k: v for k, v in vars(b).items() if not k.startswith("_")}
    if sa.keys() != sb.keys():
        return False
    for key, va in sa.items():
        vb = sb[key]
        if isinstance(va, _PLAIN) and isinstance(vb, _PLAIN):
            if type(va) is not type(vb) or va != vb:
                return False
        elif va is not vb:
            return False
    return True


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _has_hooks(module: nn.Module) -> bool:
    return any(getattr(module, attr, None) for attr in (
        "_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs"))


def same_module_function(a: nn.Module | None, b: nn.Module | None) -> bool:
    """Whether modules ``a`` and ``b`` compute the same float function (see module docstring)."""
    if a is None or b is None or type(a) is not type(b) or isinstance(b, _QWeighted):
        return False
    if a.training != b.training or _has_hooks(a) or _has_hooks(b):
        return False
    if not _same_settings(a, b):
        return False
    sa, sb = _state(a), _state(b)
    if sa.keys() != sb.keys():
        return False
    return all(
        x.dtype == sb[k].dtype and x.shape == sb[k].shape and torch.equal(x, sb[k]) for k, x in sa.items()
    )


class IsolatedReplay:
    """The isolated outputs of one compared model's calls against one reference model."""

    def __init__(self, model: nn.Module, reference: nn.Module, pairs: dict[str, str], *, reference_float: bool = False):
        """``reference_float``: the reference ran with every quant point in float mode (the
        model itself with its quantization off: compare's own-float reference), whatever
        the points' modes are now."""
        self.quantized = is_prepared(model) and engine_state(model).stage == "quantized"
        # The reference output is its float result unless a quant point of the reference changed it.
        self.ref_points = engine_state(reference).points if is_prepared(reference) and not reference_float else {}
        self.ref_plan = engine_state(reference).plan if is_prepared(reference) else None
        self.ref_quantized = is_prepared(reference) and engine_state(reference).stage == "quantized"
        self.bn_of_pair = {bn: conv for conv, bn in pairs.items()}
        # An activation whose ReLU the conv's integer kernel already applies (quantized stage): its
        # input in the model is on the activation's own grid, after the ReLU, so the reference's
        # (pre-activation) input cannot stand in for it; the conv is replayed instead.
        plan = engine_state(model).plan if self.quantized else None
        self.conv_of_fused = {rec.output_point: rec.name for rec in (plan.calls.values() if plan else ())
                              if rec.point is None and rec.fused_activation and rec.output_point}
        # A conv skipped because BN is folded in one model only: its event, kept to replay the
        # conv+BN chain for the BN's isolated error.
        self.skipped_convs: dict[str, Event] = {}
        self._same: dict[str, bool] = {}

    def reuses_reference(self, event: Event, record: Record) -> bool:
        """Whether the call computes the reference's float function (decided once per name)."""
        name = event.call.name
        known = self._same.get(name)
        if known is None:
            known = self._same[name] = self._same_function(event, record)
        return known

    def _same_function(self, event: Event, record: Record) -> bool:
        if self.quantized or self.ref_quantized or event.call.category == "input":
            return False
        ref_points = [self.ref_points.get(n) for n in self._ref_point_names(record.name)]
        if any(p is not None and p.mode != "float" for p in ref_points):
            return False
        if event.func is not None or record.func is not None:
            return event.func is record.func and event.call.category == record.category
        return same_module_function(record.module, event.call.module)

    def _ref_point_names(self, call: str) -> list[str]:
        """The reference's points on the output of ``call``: one per tensor of a structured output."""
        rec = self.ref_plan.calls.get(call) if self.ref_plan is not None else None
        return rec.point_names() if rec is not None and rec.members else [call]

    def output(self, event: Event, record: Record, records: dict[str, Record]) -> Any:
        """This call of the model, on the reference's inputs (see module docstring)."""
        ctx = active_context()
        conv = self.bn_of_pair.get(event.call.name) or self.conv_of_fused.get(event.call.name)
        with torch.no_grad():
            if conv in self.skipped_convs and conv in records:
                # BN folded in one model only, or a ReLU in the conv's integer kernel: run the chain
                # from the conv's reference input.
                conv_event, conv_record = self.skipped_convs[conv], records[conv]
                inner = ctx.replay(conv_event, self._inputs(conv_event, conv_record), conv_record.kwargs)
                return ctx.replay(event, (inner,), {})
            if self.reuses_reference(event, record):
                return ctx.replay(event, record.inputs, record.kwargs, float_output=record.output)
            return ctx.replay(event, self._inputs(event, record), record.kwargs)

    def _inputs(self, event: Event, record: Record) -> Any:
        """The reference's inputs of the call, on the model's input grids if it runs integer kernels."""
        return project(record.inputs, event.args) if self.quantized else record.inputs
