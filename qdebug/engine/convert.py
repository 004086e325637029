"""Prepared (fake-quant) model -> quantized stage: integer simulation.

``convert`` deep-copies a calibrated/QAT model, folds every BatchNorm still
attached to a conv (with_bn: the folded weight is re-quantized with a new scale,
the loss that mode defers to here; with_bn_reverse_fold: lossless), freezes all
scales, stores the integer weight codes of every Conv/Linear (``weight_int``)
and switches those layers and the inline add/sub/mul/cat/mean/avg-pool kernels
to integer arithmetic (``qdebug.engine.integer``).
"""

from __future__ import annotations

import copy

import torch.nn as nn

from qdebug.engine.modules import _QWeighted
from qdebug.engine.prepare import absorb_bn, engine_state
from qdebug.errors import QDebugError


def convert(model: nn.Module) -> nn.Module:
    """The quantized stage of a prepared, calibrated model (the input is not modified)."""
    state = engine_state(model)
    if state.stage == "quantized":
        raise QDebugError("the model is already converted", "convert a calibrated or QAT model")
    uninitialised = [n for n, p in state.points.items() if p.kind == "activation" and not p.initialized and p.mode != "float"]
    qm = copy.deepcopy(model)
    qm.eval()
    absorb_bn(qm) if state.plan.pairs else None
    qstate = engine_state(qm)
    qstate.stage = "quantized"
    for point in qstate.points.values():
        if point.mode == "observe":
            point.mode = "fake"
        point.observe_in_fake = False
    for module in qm.modules():
        if isinstance(module, _QWeighted):
            module.stage = "quantized"
            if module.weight_point is not None and module.weight_point.mode == "fake":
                point = module.weight_point
                point.compute_from(module.weight) if not point.frozen else None
                point.freeze(True)
                module.weight_codes()
    qstate.uninitialised = uninitialised
    return qm
