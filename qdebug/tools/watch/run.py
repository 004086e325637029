"""``qdebug watch``'s run: QAT steps with nan-trace's training loop, watched by ``qdebug.watch``.

``watch_steps`` trains ``steps`` steps with ``qdebug.tools.nan.trace.trace_steps`` (the same
loop, losses, optimizers and seeding as ``nan-trace``; its cheap non-finite checks too, so a
run that goes NaN stops there and says where) and calls ``QatWatch.step`` after each step's
update.  ``held_out_inputs`` makes the held-out batch of ``output_sqnr_db``: the inputs of the
last batches of the data, which the run does not train on.

``dead_run_of(result)`` reads a nan-trace run the same way: a run that stayed finite but died
(``qdebug.tools.watch.rules.dead_run`` over its steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from qdebug.data.batch import Batch
from qdebug.errors import QDebugError
from qdebug.tools.watch.timeline import watch


@dataclass
class WatchRun:
    """What a watched run gives: the timeline and findings (``qdebug.tools.watch.timeline``), the
    steps it ran, and nan-trace's first non-finite value when the run went non-finite."""

    timeline: Any  # pandas DataFrame: step, kind, name, metric, value
    findings: Any  # pandas DataFrame: rule, name, from_step, evidence, fix
    steps_run: int
    non_finite: dict | None
    meta: dict


def held_out_inputs(batches: Sequence[Batch]) -> Any:
    """One batch of inputs from ``batches`` (their inputs concatenated along the first dimension):
    tensors, tuples/lists of tensors, or dicts of them."""
    inputs = [b.inputs for b in batches]
    if len(inputs) == 1:
        return inputs[0]
    return _cat(inputs)


def _cat(items: list) -> Any:
    first = items[0]
    if isinstance(first, torch.Tensor):
        if any(not isinstance(t, torch.Tensor) or t.shape[1:] != first.shape[1:] for t in items):
            raise QDebugError("the held-out batches' inputs differ in shape: they cannot make one batch",
                              "use --held-out 1")
        return torch.cat(items)
    if isinstance(first, (tuple, list)) and all(isinstance(i, type(first)) and len(i) == len(first) for i in items):
        return type(first)(_cat(list(parts)) for parts in zip(*items))
    if isinstance(first, dict) and all(isinstance(i, dict) and i.keys() == first.keys() for i in items):
        return {k: _cat([i[k] for i in items]) for k in first}
    raise QDebugError(f"held-out inputs of type {type(first).__name__} cannot be joined into one batch",
                      "use --held-out 1")


def watch_steps(model: nn.Module, batches: Sequence[Batch], *, steps: int, every: int = 10,
                float_model: nn.Module | None = None, held_out: Any = None, loss: str = "auto",
                optimizer: str = "sgd", lr: float = 0.01, seed: int = 0, train: Callable | None = None,
                progress: Callable[[int, int], None] | None = None) -> WatchRun:
    """Train ``steps`` QAT steps on ``batches`` (module docstring), looking every ``every`` steps."""
    from qdebug.tools.nan.trace import trace_steps

    if steps < 1:
        raise QDebugError(f"watch trains steps: steps must be >= 1, got {steps}", "e.g. --steps 500")
    with watch(model, float_model, every=every, held_out=held_out) as w:
        result = trace_steps(model, batches, steps=steps, loss=loss, optimizer=optimizer, lr=lr, seed=seed,
                             train=train, progress=progress, on_step=w.step)
    meta = {"steps": steps, "every": every, "loss": result.meta["loss"], "optimizer": optimizer, "lr": lr,
            "seed": seed, "looks": int(w.timeline["step"].nunique()) if w.rows else 0,
            "float_model": float_model is not None, "held_out": held_out is not None}
    return WatchRun(w.timeline, w.findings, result.steps_run, result.first, meta)


def dead_run_of(result: Any) -> dict | None:
    """When every step of a nan-trace run (``TraceResult``) stayed finite but its timeline shows a
    dead run -- the gradient norm gone to 0, the points saturating, the loss no lower
    (``qdebug.tools.watch.rules.dead_run``, each step a look) -- that finding (``rule``, ``name``,
    ``from_step``, ``evidence``, ``fix``); else None."""
    import pandas as pd

    from qdebug.tools.watch.rules import FINDING_COLUMNS, dead_run
    from qdebug.tools.watch.timeline import COLUMNS

    if result.first is not None:
        return None
    rows = []
    for s in result.timeline:
        rows += [(s.step, "model", "", metric, value) for metric, value in (("loss", s.loss), ("grad_norm", s.grad_norm))
                 if value is not None]
        rows += [(s.step, "point", name, "saturation", value) for name, value in s.saturation.items()]
    found = dead_run(pd.DataFrame(rows, columns=COLUMNS))
    return dict(zip(FINDING_COLUMNS, found[0])) if found else None
