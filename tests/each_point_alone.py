"""The oracle of step's rankings, written without step: each quant point fake-quantized alone.

``sqnr_of_each_point_alone(model, qm, x, sqnr)`` runs ``qm`` once per point with only that point
in fake mode and returns ``{point: sqnr(model(x), qm(x))}``; every point is left in fake mode.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from qdebug.engine import quant_points, set_mode


def sqnr_of_each_point_alone(model: torch.nn.Module, qm: torch.nn.Module, x: Any,
                             sqnr: Callable[[Any, Any], float]) -> dict[str, float]:
    alone = {}
    with torch.no_grad():
        ref = model(x)
        for name in quant_points(qm):
            set_mode(qm, "float")
            set_mode(qm, "fake", name)
            alone[name] = sqnr(ref, qm(x))
    set_mode(qm, "fake")
    return alone
