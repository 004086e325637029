"""Which arithmetic the running quantized stage computes in: ``current``.

A quantized stage is converted with one (``qdebug.engine.convert``): ``fixed_point`` (TFLite,
gemmlowp, most NPUs) or ``float32`` (ONNX Runtime's CPU kernels, MLAS).  Kernels ask while a
forward runs, through the active ``ForwardContext``'s engine state, so one model's choice never
leaks into another's forward.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

from qdebug.engine.context import active_context
from qdebug.errors import QDebugError
from qdebug.vocab import ARITHMETICS


def current() -> str:
    """The arithmetic of the model running now: ``fixed_point`` outside any forward and for
    stages converted without one."""
    handler = getattr(active_context(), "handler", None)
    state = getattr(handler, "state", None)
    if getattr(state, "stage", None) != "quantized":
        return "fixed_point"
    return getattr(state, "arithmetic", "fixed_point")


@contextlib.contextmanager
def computing(model: nn.Module, arithmetic: str) -> Iterator[None]:
    """While active, the quantized stage ``model`` computes in ``arithmetic`` (its own is restored
    after): measuring one converted model in both takes no second conversion."""
    from qdebug.engine.prepare import engine_state

    if arithmetic not in ARITHMETICS:
        raise QDebugError(f"unknown arithmetic {arithmetic!r}", f"choose one of {', '.join(ARITHMETICS)}")
    state = engine_state(model)
    before = getattr(state, "arithmetic", "fixed_point")
    state.arithmetic = arithmetic
    try:
        yield
    finally:
        state.arithmetic = before
