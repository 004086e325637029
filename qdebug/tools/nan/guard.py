"""``qdebug.nan_trace(model)``: the first non-finite value in the user's own training loop.

    with qdebug.nan_trace(model) as trace:
        for x, y in loader:
            loss = criterion(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
            trace.step(loss)          # the end of a step: checks the update, keeps the timeline

Any ``nn.Module`` (engine-prepared or not).  The user's loop cannot be re-run, so every
tensor is checked as it appears (``Watch(detail=True)``): the first non-finite one raises
``qdebug.NonFiniteError`` from where it appeared -- the forward, ``loss.backward()`` or
``trace.step()`` (the optimizer's update, a learned scale) -- with ``report`` holding the
finding, its cause and a fix (``qdebug.tools.nan.causes``), as ``trace.report`` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from qdebug.engine import engine_state, is_prepared
from qdebug.tools.nan.causes import StepStats, diagnose, evidence_for
from qdebug.tools.nan.detect import NonFiniteError, Watch, consumers_of


class NanTrace:
    """The context manager behind ``qdebug.nan_trace`` (module docstring)."""

    def __init__(self, model: nn.Module, *, lr: float | None = None):
        if not isinstance(model, nn.Module):
            from qdebug.errors import QDebugError

            raise QDebugError(f"nan_trace watches an nn.Module, not a {type(model).__name__}",
                              "pass the model: with qdebug.nan_trace(model) as trace: ...")
        self.model = model
        self.lr = lr
        consumers = consumers_of(engine_state(model).plan) if is_prepared(model) else {}
        self.watch = Watch(model, detail=True, saturation=True, consumers=consumers, keep_grad_norms=True)
        self.history: list[StepStats] = []
        self.report: dict[str, Any] | None = None
        self.steps = 0
        self._stats = StepStats(0, 0)

    def __enter__(self) -> "NanTrace":
        self.watch.__enter__()
        try:
            self._begin()  # a parameter or scale already invalid raises here, before the block runs
        except NonFiniteError as exc:
            self.__exit__(type(exc), exc, None)
            raise
        return self

    def _begin(self) -> None:
        # What the model starts from is checked once; afterwards each step() checked the update.
        self.watch.begin(self.steps, self.steps, check=not self.steps)
        self._stats = StepStats(self.steps, self.steps)

    def step(self, loss: Any = None) -> None:
        """The end of one training step: check the parameters and learned scales after the
        optimizer's update, add the step to the timeline, start the next."""
        stats = self._stats
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            stats.loss = float(loss.detach())
        elif isinstance(loss, (int, float)):
            stats.loss = float(loss)
        params = [(n, p.detach()) for n, p in self.model.named_parameters()]
        norms = self.watch.grad_norms
        stats.take_grad_norms(list(norms), list(norms.values()))
        maxima = list(torch._foreach_norm([p for _, p in params], float("inf"))) if params else []
        stats.take_weight_maxima([n for n, _ in params], maxima)
        stats.take_saturation(self.watch.point_saturation)
        self.watch.check_scales("update")
        self.watch.check_params(maxima or None)
        self.history.append(stats)
        self.steps += 1
        self._begin()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.watch.__exit__(None, None, None)
        if isinstance(exc, NonFiniteError):
            self.report = self._diagnosed(exc)
            exc.report = self.report
        return False

    def _diagnosed(self, exc: NonFiniteError) -> dict[str, Any]:
        finding = exc.finding
        diagnosis = diagnose(finding, evidence_for(self.model, history=list(self.history),
                                                   lr=self.lr))
        return {**finding.to_dict(), "cause": diagnosis.cause, "detail": diagnosis.detail, "fix": diagnosis.fix}


def nan_trace(model: nn.Module, *, lr: float | None = None) -> NanTrace:
    """Watch ``model`` in your own loop for its first NaN/Inf (module docstring).  ``lr``: your
    learning rate, quoted in a gradient-explosion diagnosis."""
    return NanTrace(model, lr=lr)
