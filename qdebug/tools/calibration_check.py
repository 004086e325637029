"""After calibration: does the calibrated model still compute its float function?

``check_calibration(model, batches)`` runs each batch twice -- every quant point off (the
float run), then as calibrated -- and returns the output SQNR of the calibrated run
against the float one over all batches,

    SQNR (dB) = 10 log10( sum ||x||^2 / sum ||x - y||^2 )   (float64 sums, every output tensor)

and, per activation point, the fraction of its values that its clamp changes (counted by
the fake-quant kernel itself, ``QuantPoint.count_clipped``: the values beyond half a step
past either end of [(qmin - z) s, (qmax - z) s]).  A range far too small for its data (an
observer that went wrong) shows as a point clipping much of its input and a low SQNR.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.nn as nn

from qdebug.config import distributed
from qdebug.engine import engine_state, quantization_off
from qdebug.engine.context import Event, run_model
from qdebug.engine.members import named_members
from qdebug.measure.stats import sqnr_db
from qdebug.measure.tap import tap
from qdebug.tools.experiment import named_outputs

CLIPPING = 0.01  # a point clipping more than this fraction of its values is listed
LOW_SQNR_DB = 20.0  # an output SQNR below this is a warning: the model no longer computes its function


@dataclass
class CalibrationCheck:
    sqnr_db: float  # the output SQNR of the calibrated model against its float run (inf: identical)
    clipping: list[dict[str, Any]] = field(default_factory=list)  # {"point", "clipped"}, most first, > CLIPPING

    @property
    def low(self) -> bool:
        return not self.sqnr_db >= LOW_SQNR_DB  # NaN is low too


def check_calibration(model: nn.Module, batches: Iterable[Any]) -> CalibrationCheck:
    """The calibrated ``model``'s output SQNR against its float run, and the points that clip
    (module docstring).  ``batches``: model inputs (a tensor, a tuple of args or a dict) or
    ``qdebug.data.Batch``es; under torchrun each rank checks its share and the sums combine."""
    state = engine_state(model)
    counts: dict[str, list[int]] = {}

    def count(event: Event) -> None:
        rec = state.plan.calls.get(event.call.name)
        if rec is None or not rec.point:
            return
        if rec.members:  # a structured output: each tensor on its own point
            outputs = [(state.points.get(name), t) for name, _, t in named_members(rec.name, event.out)]
        else:
            outputs = [(state.points.get(rec.point), event.out)]
        for point, out in outputs:
            if point is not None and point.clipped is not None and isinstance(out, torch.Tensor):
                seen = counts.setdefault(point.name, [0, 0])
                seen[0] += int(point.clipped)
                seen[1] += out.numel()

    activations = [p for p in state.points.values() if p.kind == "activation"]
    signal = error = 0.0
    group = distributed.current()
    was_training = model.training
    model.eval()
    try:
        for point in activations:
            point.count_clipped = True
        with torch.no_grad():
            for _, batch in group.shard(batches):
                inputs = getattr(batch, "inputs", batch)
                with quantization_off(model):
                    reference = named_outputs(run_model(model, inputs))
                with tap(model, count):
                    output = named_outputs(run_model(model, inputs))
                for name, x in reference.items():
                    y = output.get(name)
                    if y is None or y.shape != x.shape:
                        continue
                    x64, y64 = x.double(), y.double()
                    signal += float((x64 * x64).sum())
                    error += float(((x64 - y64) ** 2).sum())
    finally:
        for point in activations:
            point.count_clipped, point.clipped = False, None
        model.train(was_training)
    if group.active:
        signal, error, counts = group.combine((signal, error, counts), _merge_sums)
    clipping = [{"point": name, "clipped": n / total} for name, (n, total) in counts.items()
                if total and n / total > CLIPPING]
    clipping.sort(key=lambda row: -row["clipped"])
    return CalibrationCheck(sqnr_db(signal, error), clipping)


def _merge_sums(a: tuple, b: tuple) -> tuple:
    """Two ranks' (signal, error, clip counts) as one."""
    counts = {name: [x + y for x, y in zip(a[2].get(name, [0, 0]), b[2].get(name, [0, 0]))] for name in {**a[2], **b[2]}}
    return a[0] + b[0], a[1] + b[1], counts
