"""A metric evaluated on model outputs already computed, for the experiment tools.

A metric is ``metric(model, batches)``: it runs the model itself.  An experiment has
already run the model (one trial at a time, batch by batch, with a cached prefix), so
the metric gets a ``ReplayModel`` instead: called on a batch's inputs, it returns that
batch's stored output.  ``MetricRun`` holds one trial's metric as it goes: per-sample
scores summed batch by batch when the metric has a per-sample function (nothing
stored), else the outputs, evaluated once at the end.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

from qdebug.engine.ops import tensors_in
from qdebug.errors import QDebugError
from qdebug.metrics import Metric


class ReplayModel(nn.Module):
    """Stands in for a model inside a metric: returns the stored output of each batch."""

    def __init__(self, batches: Sequence[Any], outputs: list[Any]):
        super().__init__()
        self._batches = list(batches)
        self._outputs = outputs
        self._index = {id(_first(b)): i for i, b in enumerate(self._batches)}
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        first = _first((args, kwargs))
        i = self._index.get(id(first))
        if i is None and first is not None:
            i = next((j for j, b in enumerate(self._batches)
                      if (f := _first(b)) is not None and f.shape == first.shape and torch.equal(f, first)), None)
        if i is None or i >= len(self._outputs):
            raise QDebugError("the metric ran the model on inputs that are not the data's batches",
                              "under step and suggest, a metric must call the model on each batch's inputs, "
                              "e.g. for x, y in batches: model(x)")
        return self._outputs[i]


def _first(obj: Any) -> torch.Tensor | None:
    obj = getattr(obj, "inputs", obj)
    found = tensors_in(obj)
    return found[0] if found else None


def per_sample_function(metric: Metric | None) -> Callable | None:
    """The metric's per-sample function (``metric.per_sample``), or None."""
    sampler = getattr(metric, "per_sample", None)
    if sampler is True:
        return metric
    return sampler if callable(sampler) else None


class MetricRun:
    """One trial's metric: per-sample sums streamed batch by batch, or stored outputs."""

    def __init__(self, streaming: bool, keep_samples: bool = False):
        self.streaming = streaming
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.outputs: list[Any] = []
        # The per-sample scores themselves (one float64 per sample and task), for a bootstrap.
        self.samples: dict[str, list[torch.Tensor]] | None = {} if keep_samples else None

    def add(self, scores: Any) -> None:
        scores = scores if isinstance(scores, Mapping) else {"metric": scores}
        for task, value in scores.items():
            if not isinstance(value, torch.Tensor):
                raise QDebugError(f"per-sample metric returned {type(value).__name__} for task {task!r}",
                                  "return one score per sample (or a dict task -> tensor)")
            value = value.detach().double().reshape(-1)
            self.sums[str(task)] = self.sums.get(str(task), 0.0) + float(value.sum())
            self.counts[str(task)] = self.counts.get(str(task), 0) + value.numel()
            if self.samples is not None:
                self.samples.setdefault(str(task), []).append(value.clone())

    def values(self) -> dict[str, float]:
        return {task: self.sums[task] / max(self.counts[task], 1) for task in self.sums}

    def sample_scores(self) -> dict[str, torch.Tensor]:
        """Task -> every sample's score, in data order ({} unless kept)."""
        return {task: torch.cat(parts) for task, parts in (self.samples or {}).items()}
