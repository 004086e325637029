"""Gradient-weighted quantization noise: every quant point scored in one forward+backward per batch.

The score of a point is sum g^2 (Q(y) - y)^2 over its values and the batches (ModelOpt
AutoQuantize's sensitivity): y the tensor the point quantizes, Q(y) its quantized
value, g the gradient of the loss with respect to Q(y).  To first order it is the loss
the point's quantization noise adds -- and so what raising the point to 16 bits (whose
noise is 256x smaller) wins back.  It ranks every candidate at once, where an exact
ranking runs one trial per candidate.

- activation points: y is the call's output before the point (``Event.raw``), Q(y)
  after it; g comes from ``retain_grad`` on the point's output;
- weight points: y is the tensor the point quantizes (the weight, or W f under reverse
  fold), Q(y) its fake-quantized value, and g = dL/dQ(y) = the weight's gradient
  (divided by f under reverse fold): the straight-through estimator passes it unchanged
  inside the range, and a weight's min/max range holds every value.

The loss: with class-index targets for an [N, C] output (per task for dict outputs),
cross-entropy; without targets, half the squared distance to the float model's output
on the same batch (the float model's output is the target).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from qdebug.config import distributed
from qdebug.engine import engine_state
from qdebug.engine.context import Event, run_model
from qdebug.engine.members import member_at, named_members
from qdebug.engine.modules import _QWeighted, bn_scale_factor
from qdebug.engine.ops import map_tensors
from qdebug.errors import QDebugError
from qdebug.measure.tap import tap
from qdebug.tools.experiment import named_outputs


def _loss(out: Any, target: Any, float_out: Any) -> torch.Tensor:
    outputs = named_outputs(out)
    if target is not None:
        targets = target if isinstance(target, Mapping) else {next(iter(outputs), "output"): target}
        pairs = [(outputs.get(k), t) for k, t in targets.items()]
        if all(o is not None and o.dim() == 2 and isinstance(t, torch.Tensor) and not torch.is_floating_point(t)
               and t.shape == o.shape[:1] for o, t in pairs):
            return sum(F.cross_entropy(o, t, reduction="sum") for o, t in pairs)
    reference = named_outputs(float_out)
    return sum(0.5 * ((o - reference[k].detach()) ** 2).sum() for k, o in outputs.items())


def noise_scores(model: nn.Module, batches: Sequence[Any], names: Sequence[str],
                 reference: nn.Module | None = None) -> dict[str, float]:
    """Point name -> sum g^2 (Q(y) - y)^2 over ``batches`` (see module docstring)."""
    state = engine_state(model)
    points = {n: state.points[n] for n in names}
    wanted = {n for n, p in points.items() if p.kind == "activation"}
    layers = {m.weight_point.name: m for m in model.modules()
              if isinstance(m, _QWeighted) and m.weight_point is not None and m.weight_point.name in points}
    scores = dict.fromkeys(names, 0.0)
    params = [p for p in model.parameters()]
    saved_grad = [p.requires_grad for p in params]
    was_training = model.training
    captured: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    group = distributed.current()

    def listen(event: Event) -> None:
        # Each tensor of a structured output on its own point (``lstm:1.1``); else the call's one.
        for name, path, out in named_members(event.call.name, event.out):
            raw = member_at(event.raw, path) if name in wanted else None
            if raw is not None and raw.shape == out.shape and out.requires_grad:
                out.retain_grad()
                captured.append((name, out, (out - raw).detach()))

    try:
        model.eval()
        for p in params:
            p.requires_grad_(True)
        for _, batch in group.shard(batches):  # under torchrun: this rank's share, the sums combined below
            inputs = getattr(batch, "inputs", batch)
            target = getattr(batch, "target", None)
            with torch.no_grad():
                float_out = None
                if target is None or reference is not None:
                    float_out = run_model(reference, inputs) if reference is not None else _float_run(model, inputs)
            model.zero_grad(set_to_none=True)
            captured.clear()
            inputs = map_tensors(inputs, lambda t: t.detach().clone().requires_grad_(True)
                                 if torch.is_floating_point(t) else t)
            with torch.enable_grad(), tap(model, listen):
                out = run_model(model, inputs)
                loss = _loss(out, target, float_out)
                if not torch.isfinite(loss):
                    raise QDebugError("the loss of the fast ranking is not finite", "use --rank exact")
                loss.backward()
            for name, out_t, noise in captured:
                if out_t.grad is not None:
                    scores[name] += float((out_t.grad.double() ** 2 * noise.double() ** 2).sum())
            for name, layer in layers.items():
                if layer.weight.grad is None:
                    continue
                with torch.no_grad():
                    y, key = layer.quantized_input_weight()
                    quantized = points[name].apply(y.detach(), cache_key=key)
                    grad = layer.weight.grad
                    if layer.bn_mode == "reverse_fold" and layer.bn is not None:
                        shape = [-1] + [1] * (grad.dim() - 1)
                        f = bn_scale_factor(layer.bn)
                        grad = grad / torch.where(f == 0, torch.ones_like(f), f).reshape(shape)
                    scores[name] += float((grad.double() ** 2 * (quantized - y).double() ** 2).sum())
    finally:
        model.zero_grad(set_to_none=True)
        for p, flag in zip(params, saved_grad):
            p.requires_grad_(flag)
        model.train(was_training)
    return group.combine(scores, lambda a, b: {name: a[name] + b[name] for name in a})


def _float_run(model: nn.Module, inputs: Any) -> Any:
    state = engine_state(model)
    modes = {n: p.mode for n, p in state.points.items()}
    try:
        for point in state.points.values():
            point.mode = "float"
        return run_model(model, inputs)
    finally:
        for name, mode in modes.items():
            state.points[name].mode = mode
