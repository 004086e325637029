"""Which arithmetic the running quantized stage computes in: ``current``.

A quantized stage is converted with one (``qdebug.engine.convert``): ``fixed_point`` (TFLite,
gemmlowp, most NPUs) or ``float32`` (ONNX Runtime's CPU kernels, MLAS).  Kernels ask while a
forward runs, through the active ``ForwardContext``'s engine state, so one model's choice never
leaks into another's forward.

Under ``float32`` a quantized stage may also mark calls its target runtime computes in float
(``float_kernels``, set by ``run_in_float``): ONNX Runtime leaves a QDQ group it cannot fuse
(DequantizeLinear -> Conv/Add -> QuantizeLinear, e.g. a conv mixing int8 and uint8 codes on x86)
in float32, on the dequantized values, and its QuantizeLinear divides.  Such a call computes so
(``qdebug.engine.modules``, ``qdebug.engine.functional``); every other call keeps its integer kernel.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch.nn as nn

from qdebug.engine.context import active_context
from qdebug.engine.state import engine_state
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
    if arithmetic not in ARITHMETICS:
        raise QDebugError(f"unknown arithmetic {arithmetic!r}", f"choose one of {', '.join(ARITHMETICS)}")
    state = engine_state(model)
    before = getattr(state, "arithmetic", "fixed_point")
    state.arithmetic = arithmetic
    try:
        yield
    finally:
        state.arithmetic = before


def in_float(state: object, call: str) -> bool:
    """Whether ``call`` of the quantized stage with engine state ``state`` computes in float now: a
    call of its ``float_kernels`` under the ``float32`` arithmetic (a float kernel is ONNX
    Runtime's; the fixed-point targets run every layer in integers)."""
    return call in getattr(state, "float_kernels", ()) and current() == "float32"


def run_in_float(model: nn.Module, calls: Iterable[str]) -> None:
    """Mark ``calls`` (plan call names) of the quantized stage ``model`` as computed in float by its
    target (``float_kernels``, saved with the checkpoint), replacing the marks it had."""
    from qdebug.safe_text import escaped

    state = engine_state(model)
    calls = set(calls)
    unknown = sorted(c for c in calls if not isinstance(c, str) or c not in state.plan.calls)
    if unknown:
        raise QDebugError(f"float_kernels names {len(unknown)} call(s) the model's plan does not have: "
                          f"{', '.join(escaped(str(c)) for c in unknown[:3])}",
                          "name calls of the plan (qdebug inspect lists them)")
    state.float_kernels = calls
