"""A metric evaluated on model outputs already computed, for the experiment tools.

A metric is ``metric(model, batches)``: it runs the model itself.  An experiment has
already run the model (one trial at a time, batch by batch, with a cached prefix), so
the metric gets a ``ReplayModel`` instead: called on a batch's inputs, it returns that
batch's stored output (matched by position and an exact fingerprint of the inputs, so the
batches themselves need not be held).  ``MetricRun`` holds one trial's metric as it goes: per-sample
scores summed batch by batch when the metric has a per-sample function (nothing
stored), else the outputs, evaluated once at the end.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn as nn

from qdebug.engine.ops import tensors_in
from qdebug.errors import QDebugError
from qdebug.data.metrics import Metric


class ReplayModel(nn.Module):
    """Stands in for a model inside a metric: returns the stored output of each batch.

    The k-th call is matched to the k-th stored output when its first input tensor is the k-th
    batch's (the same tensor, or the same exact fingerprint), else to the batch whose fingerprint
    it has, wherever it is; inputs of no batch are an error.  The batches are not held:
    ``fingerprints`` (``input_fingerprint`` of each batch, in order) stand for them; without them,
    a list of batches is fingerprinted here, and a ``BatchSource`` in one pass over it."""

    def __init__(self, batches: Iterable[Any] | None, outputs: list[Any], fingerprints: Sequence[bytes] | None = None):
        super().__init__()
        self._outputs = outputs
        held = batches if isinstance(batches, (list, tuple)) else None
        # A batch in hand is known by its tensor's id: no fingerprint needed when the metric passes it on.
        self._ids = {id(_first(b)): i for i, b in enumerate(held)} if held is not None else {}
        if fingerprints is None and held is None:
            fingerprints = [input_fingerprint(b) for b in batches or ()]
        self._held = held
        self._prints = list(fingerprints) if fingerprints is not None else None  # a list's: when first needed
        self._where: dict[bytes, int] | None = None  # fingerprint -> batch, built at the first call out of order
        self._next = 0
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        first = _first((args, kwargs))
        i = self._ids.get(id(first)) if first is not None else None
        if i is None:
            if self._prints is None:
                self._prints = [input_fingerprint(b) for b in self._held]
            found = _fingerprint(first)
            if self._next < len(self._prints) and self._prints[self._next] == found:
                i = self._next
            else:
                if self._where is None:
                    self._where = {}
                    for j, known in enumerate(self._prints):
                        self._where.setdefault(known, j)
                i = self._where.get(found)
        if i is None or i >= len(self._outputs):
            raise QDebugError("the metric ran the model on inputs that are not the data's batches",
                              "under step and suggest, a metric must call the model on each batch's inputs, "
                              "e.g. for x, y in batches: model(x)")
        self._next = i + 1
        return self._outputs[i]


def input_fingerprint(batch: Any) -> bytes:
    """What ``ReplayModel`` knows a batch by: the exact fingerprint of its first input tensor."""
    return _fingerprint(_first(batch))


def _fingerprint(tensor: torch.Tensor | None) -> bytes:
    from qdebug.data.batch import fingerprint

    return fingerprint(tensor)


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
    """One trial's metric: per-sample sums streamed batch by batch, or stored outputs.

    Per-sample scores and stored outputs carry their batch's index in the data, so the
    runs of several ranks (``qdebug.config.distributed``) merge back into data order."""

    def __init__(self, streaming: bool, keep_samples: bool = False):
        self.streaming = streaming
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.outputs: list[Any] = []
        self.output_index: list[int] = []  # the batch index of each stored output
        # The per-sample scores themselves (one float64 per sample and task), for a bootstrap.
        self.samples: dict[str, dict[int, torch.Tensor]] | None = {} if keep_samples else None

    def add(self, scores: Any, index: int | None = None) -> None:
        """Fold one batch's per-sample scores in; ``index``: the batch's index in the data
        (default: the next one)."""
        scores = scores if isinstance(scores, Mapping) else {"metric": scores}
        for task, value in scores.items():
            if not isinstance(value, torch.Tensor):
                raise QDebugError(f"per-sample metric returned {type(value).__name__} for task {task!r}",
                                  "return one score per sample (or a dict task -> tensor)")
            value = value.detach().double().reshape(-1)
            self.sums[str(task)] = self.sums.get(str(task), 0.0) + float(value.sum())
            self.counts[str(task)] = self.counts.get(str(task), 0) + value.numel()
            if self.samples is not None:
                kept = self.samples.setdefault(str(task), {})
                kept[len(kept) if index is None else index] = value.cpu().clone()

    def keep_output(self, out: Any, index: int | None = None) -> None:
        """Store one batch's model output (for a metric evaluated at the end)."""
        self.outputs.append(out)
        self.output_index.append(len(self.output_index) if index is None else index)

    def values(self) -> dict[str, float]:
        return {task: self.sums[task] / max(self.counts[task], 1) for task in self.sums}

    def sample_scores(self) -> dict[str, torch.Tensor]:
        """Task -> every sample's score, in data order ({} unless kept)."""
        return {task: torch.cat([parts[i] for i in sorted(parts)]) for task, parts in (self.samples or {}).items()}

    # -- combining ranks (qdebug.config.distributed) ------------------------------------------------
    def state(self) -> dict:
        return {"sums": self.sums, "counts": self.counts, "samples": self.samples,
                "outputs": dict(zip(self.output_index, self.outputs))}

    def absorb(self, state: dict) -> None:
        """Take a combined ``state`` as this run's (outputs in data order)."""
        self.sums, self.counts, self.samples = state["sums"], state["counts"], state["samples"]
        ordered = sorted(state["outputs"].items())
        self.output_index, self.outputs = [i for i, _ in ordered], [o for _, o in ordered]

    @staticmethod
    def merge(a: dict, b: dict) -> dict:
        """Two ranks' runs: sums and counts added, samples and outputs united by batch index."""
        sums = {task: a["sums"].get(task, 0.0) + b["sums"].get(task, 0.0) for task in {**a["sums"], **b["sums"]}}
        counts = {task: a["counts"].get(task, 0) + b["counts"].get(task, 0) for task in {**a["counts"], **b["counts"]}}
        samples = None
        if a["samples"] is not None:
            samples = {task: {**a["samples"].get(task, {}), **b["samples"].get(task, {})}
                       for task in {**a["samples"], **b["samples"]}}
        return {"sums": sums, "counts": counts, "samples": samples, "outputs": {**a["outputs"], **b["outputs"]}}
