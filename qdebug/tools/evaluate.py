"""A metric over the data: on one process, or split over the ranks of a torchrun job.

``evaluate(metric, model, batches)`` returns ``(values, samples)`` -- task -> value, and
task -> per-sample scores in data order (None without a per-sample function) -- as
``qdebug.data.metrics.run_metric_with_samples`` does on one process, which it calls there.

Under torchrun (``qdebug.config.distributed``) each rank takes its share of the batches:

- a metric with a per-sample function is called batch by batch on the rank's batches;
  the ranks' sums, counts and per-sample scores (keyed by batch index) combine into
  data order, so a bootstrap or McNemar's test sees every sample as one process would;
- any other metric (mAP-like, over the whole set) cannot be split: each rank runs the
  model on its batches and keeps the outputs (of ``reference`` too, for a metric that
  takes one); the outputs are exchanged and every rank calls the metric on the whole
  data with a ``ReplayModel`` serving them -- the same value on every rank.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn

from qdebug.config import distributed
from qdebug.engine.context import run_model
from qdebug.data.metrics import Metric, call_metric, run_metric, run_metric_with_samples
from qdebug.tools.metric_replay import MetricRun, ReplayModel, per_sample_function


def evaluate(metric: Metric, model: nn.Module, batches: Iterable[Any], *, reference: nn.Module | None = None,
             name: str = "metric") -> tuple[dict[str, float], dict[str, torch.Tensor] | None]:
    """(task -> value, task -> per-sample scores or None): see the module docstring."""
    group = distributed.current()
    if not group.active:
        return run_metric_with_samples(metric, model, batches, reference=reference, name=name)
    sampler = per_sample_function(metric)
    if sampler is not None:
        run = MetricRun(streaming=True, keep_samples=True)
        for index, batch in group.shard(batches):
            run.add(call_metric(sampler, model, [batch], reference, name), index)
        run.absorb(group.combine(run.state(), MetricRun.merge))
        samples = run.sample_scores()
        return {task: float(scores.mean()) if scores.numel() else float("nan") for task, scores in samples.items()}, samples
    mine, theirs = MetricRun(streaming=False), MetricRun(streaming=False)
    models = [(model, mine)] + ([(reference, theirs)] if reference is not None and reference is not model else [])
    states = [(m, m.training) for m, _ in models]
    try:
        for m, _ in models:
            m.eval()
        with torch.no_grad():
            for index, batch in group.shard(batches):
                inputs = getattr(batch, "inputs", batch)
                for m, run in models:
                    run.keep_output(_detached(run_model(m, inputs)), index)
    finally:
        for m, training in states:
            m.train(training)
    for _, run in models:
        run.absorb(group.combine(run.state(), MetricRun.merge))
    replay = ReplayModel(batches, mine.outputs)
    replay_reference = ReplayModel(batches, theirs.outputs) if len(models) > 1 else replay
    return run_metric(metric, replay, batches, reference=replay_reference if reference is not None else None,
                      name=name), None


def _detached(out: Any) -> Any:
    from qdebug.engine.ops import map_tensors

    return map_tensors(out, lambda t: t.detach().clone())
