"""Quant points at another bit width for a while: the int16 experiments of ``suggest``.

``raise_bits(model, {point: bits})`` gives each named point what calibrating it at
``bits`` would have given, from the statistics it already holds, and returns a
``Respec`` that puts everything back (``restore()``):

- an activation point (frozen scale): a new observer for the wider spec takes over
  the old observer's state (min/max, histogram) and computes the qparams -- what
  ``calibrate`` with an override ``bits = 16`` on the same data computes, since the
  observer's statistics do not depend on the bit width;
- a weight point with a dynamic scale: its qparams from the weight at the new width;
- a learned scale (lsq, qte), or an observer that holds no statistics: the same real
  range as the current grid, [(qmin - z) s, (qmax - z) s], at the new width;
- in the quantized stage a layer's cached integer weight codes (``weight_int``) are
  dropped, so the integer kernel recomputes them on the new grid.

``observed_qparams(model, names, spec, batches)`` measures what another range
estimator would choose for activation points -- calibration's way: every point in
float, the named ones observing -- and ``set_qparams(model, {name: (scale, zero
point)}, points)`` puts such qparams in for a while (same undo).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn as nn

from qdebug.engine.modules import _QWeighted
from qdebug.config import distributed
from qdebug.engine.observers import make_observer, merge_ranks
from qdebug.engine.point import QuantPoint
from qdebug.engine.spec import qparams_from_range
from qdebug.errors import QDebugError


@dataclass
class Respec:
    """What ``raise_bits`` changed, to put back."""

    saved: list[tuple[QuantPoint, Any, Any, torch.Tensor, torch.Tensor, Any]] = field(default_factory=list)
    codes: list[tuple[_QWeighted, torch.Tensor | None]] = field(default_factory=list)

    def restore(self) -> None:
        for point, spec, observer, scale, zero_point, cache_key in reversed(self.saved):
            point.spec, point.observer = spec, observer
            point.set_qparams(scale, zero_point)
            point._cache_key = cache_key
            point.forget_cached() if cache_key is None else setattr(point, "_fq_cache", None)
        for layer, codes in self.codes:
            layer._buffers.pop("weight_int", None)
            if codes is not None:
                layer.register_buffer("weight_int", codes)
        self.saved.clear()
        self.codes.clear()


def _grid_range(point: QuantPoint) -> tuple[torch.Tensor, torch.Tensor]:
    scale, zero_point = point.scale.detach().float(), point.zero_point.float()
    return (point.spec.qmin - zero_point) * scale, (point.spec.qmax - zero_point) * scale


def _layers_by_weight_point(model: nn.Module) -> dict[str, _QWeighted]:
    return {m.weight_point.name: m for m in model.modules() if isinstance(m, _QWeighted) and m.weight_point is not None}


def _point(points: Mapping[str, QuantPoint], name: str) -> QuantPoint:
    point = points.get(name)
    if point is None:
        raise QDebugError(f"no quant point {name!r}", "qdebug inspect lists the points")
    return point


def _change(model: nn.Module, names: Iterable[str], points: Mapping[str, QuantPoint],
            change: Callable[[QuantPoint, _QWeighted | None], None]) -> Respec:
    """Apply ``change(point, its layer)`` to each named point, remembering what to put back;
    the cached fake-quantized weight and a quantized layer's integer codes are dropped so
    they follow.  Anything raising restores what was changed so far."""
    undo = Respec()
    names = [_point(points, name).name for name in names]
    if not names:
        return undo
    layers = _layers_by_weight_point(model)
    try:
        for name in names:
            point, layer = points[name], layers.get(name)
            undo.saved.append((point, point.spec, point.observer, point.scale.detach().clone(),
                               point.zero_point.clone(), point._cache_key))
            change(point, layer)
            point._fq_cache = None
            if layer is not None and getattr(layer, "stage", "fake") == "quantized":
                undo.codes.append((layer, layer._buffers.pop("weight_int", None)))
    except Exception:
        undo.restore()
        raise
    return undo


def set_qparams(model: nn.Module, qparams: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                points: Mapping[str, QuantPoint]) -> Respec:
    """Give the named points these qparams (a recalibrated range) until ``restore()``."""
    return _change(model, qparams, points, lambda point, _: point.set_qparams(*qparams[point.name]))


def observed_qparams(model: nn.Module, names: list[str], spec_changes: Mapping[str, Any], batches: list,
                     points: Mapping[str, QuantPoint]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The qparams a fresh observer (each point's spec with ``spec_changes``, e.g. a
    ``percentile`` observer) picks for the named activation points on ``batches``, observed
    as calibration observes: every point in float, these observing.  The model is left as it was."""
    from qdebug.engine.context import run_model

    saved = {n: (p.mode, p.observer) for n, p in points.items()}
    was_training = model.training
    try:
        model.eval()
        for name, point in points.items():
            point.mode = "float"
        for name in names:
            point = points[name]
            point.observer = make_observer(point.spec.replace(**dict(spec_changes)))
            point.mode = "observe"
        group = distributed.current()
        with torch.no_grad():
            for _, batch in group.shard(batches):  # under torchrun: this rank's share, observers merged below
                run_model(model, getattr(batch, "inputs", batch))
        if group.active:
            merge_ranks(group, {name: points[name].observer for name in names})
        return {name: qparams_with_spec(points[name]) for name in names}
    finally:
        for name, (mode, observer) in saved.items():
            points[name].mode, points[name].observer = mode, observer
        model.train(was_training)


def qparams_with_spec(point: QuantPoint) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero point) from the point's current observer, for the point's own spec's width."""
    observer = point.observer
    if not getattr(observer, "initialized", False):
        raise QDebugError(f"quant point {point.name!r} saw no data", "the data never reaches it")
    return observer.calculate_qparams()


def raise_bits(model: nn.Module, bits: Mapping[str, int | Mapping[str, Any]],
               points: Mapping[str, QuantPoint]) -> Respec:
    """Set each named point to ``bits`` (see module docstring); returns the undo.  A value may
    also be a table of spec changes, ``{"bits": 16}`` or ``{"group_size": 64}`` (a grouped
    weight with smaller groups: its qparams from the weight, as for a new width)."""
    changes = {name: _spec_changes(value) for name, value in bits.items()}
    changing = [name for name, change in changes.items()
                if _point(points, name).spec != _point(points, name).spec.replace(**change)]
    return _change(model, changing, points, lambda point, layer: _set_width(point, layer, changes[point.name]))


def _spec_changes(value: int | Mapping[str, Any]) -> dict[str, Any]:
    """A width, or a table of the spec changes an experiment may make (bits, group_size)."""
    if isinstance(value, Mapping):
        unknown = set(value) - {"bits", "group_size"}
        if unknown:
            raise QDebugError(f"an experiment cannot change {', '.join(sorted(map(str, unknown)))}",
                              "change bits or group_size")
        return dict(value)
    return {"bits": value}


def _set_width(point: QuantPoint, layer: _QWeighted | None, changes: Mapping[str, Any]) -> None:
    """The point with ``changes`` (a width, a group size), with the qparams calibration would give it."""
    spec = point.spec.replace(**changes)
    if spec.group_size != point.spec.group_size and (point.kind != "weight" or layer is None or point.frozen):
        raise QDebugError(f"quant point {point.name!r}: only a weight with a dynamic scale can change its group size",
                          "change its bits instead")
    learned = spec.learnable_scale and point.initialized
    observer = make_observer(spec)
    if point.kind == "weight" and layer is not None and not point.frozen and not learned:
        point.spec, point.observer = spec, observer
        weight, key = layer.quantized_input_weight()
        point.compute_from(weight.detach())
        point._cache_key = key
        return
    old = point.observer
    if getattr(old, "initialized", False) and not learned:
        for key, value in old.named_buffers(recurse=False):  # shapes may differ from a fresh one's
            observer._buffers[key] = value.clone()
        scale, zero_point = observer.calculate_qparams()
    else:
        scale, zero_point = qparams_from_range(*_grid_range(point), spec)
    if spec.group_size is not None and scale.numel() == point.scale.numel():
        # A grouped weight's observer holds one channel a group: back to [rows, groups].
        scale, zero_point = scale.reshape(point.scale.shape), zero_point.reshape(point.scale.shape)
    point.spec, point.observer = spec, observer
    point.set_qparams(scale, zero_point)
