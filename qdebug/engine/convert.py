"""Prepared (fake-quant) model -> quantized stage: integer simulation.

``convert`` deep-copies a calibrated/QAT model, folds every BatchNorm still
attached to a conv (with_bn: the folded weight is re-quantized with a new scale,
the loss that mode defers to here; with_bn_reverse_fold: lossless), freezes all
scales, stores the integer weight codes of every Conv/Linear (``weight_int``)
and switches those layers and the inline add/sub/mul/cat/mean/avg-pool kernels
to integer arithmetic (``qdebug.engine.integer``).  Grouped conv weights and dynamic
activation points have no integer kernel yet and are refused (a grouped Linear has one).

``export_graph`` is the same stage computed in fake quant, the model an exporter traces
(``qdebug.engine.export_mode``).
"""

from __future__ import annotations

import copy

import torch.nn as nn

from qdebug.engine.integer import ARITHMETICS
from qdebug.engine.modules import QLinear, _QWeighted
from qdebug.engine.prepare import absorb_bn
from qdebug.engine.state import engine_state
from qdebug.errors import QDebugError


def convert(model: nn.Module, arithmetic: str = "fixed_point") -> nn.Module:
    """The quantized stage of a prepared, calibrated model (the input is not modified).

    ``arithmetic``: how layers requantize (``qdebug.engine.integer``): ``fixed_point`` (TFLite,
    gemmlowp, most NPUs) or ``float32`` (ONNX Runtime's CPU kernels)."""
    if arithmetic not in ARITHMETICS:
        raise QDebugError(f"unknown arithmetic {arithmetic!r}", f"choose one of {', '.join(ARITHMETICS)}")
    state = engine_state(model)
    if state.stage == "quantized":
        raise QDebugError("the model is already converted", "convert a calibrated or QAT model")
    _refuse_without_kernel(model, state.points)
    uninitialised = [n for n, p in state.points.items() if p.kind == "activation" and not p.initialized and p.mode != "float"]
    qm = copy.deepcopy(model)
    qm.eval()
    absorb_bn(qm) if state.plan.pairs else None
    qstate = engine_state(qm)
    qstate.stage = "quantized"
    qstate.arithmetic = arithmetic
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


def _refuse_without_kernel(model: nn.Module, points) -> None:
    """Grouped conv weights and dynamic (per-token) activations have no integer kernel yet (a
    grouped Linear has one): the quantized stage would silently compute them as fake quant, so
    converting them is refused."""
    grouped_linear = {m.weight_point.name for m in model.modules()
                      if isinstance(m, QLinear) and m.weight_point is not None}
    for name, point in points.items():
        if point.mode == "float":
            continue
        if point.spec.dynamic or (point.spec.group_size is not None and name not in grouped_linear):
            what = "dynamic activations" if point.spec.dynamic else "grouped conv weights"
            raise QDebugError(
                f"quant point {name!r} ({point.spec.describe()}): the integer stage has no kernel for {what} yet",
                "debug it in the calibrated (fake-quant) stage, or drop group_size/dynamic to convert",
            )


def export_graph(model: nn.Module) -> nn.Module:
    """The quantized stage of ``model`` (calibrated, QAT or already converted) as a fake-quant
    model, in eval mode: ``convert``'s BN folding, frozen weight qparams and observe -> fake,
    computed by fake quant instead of the integer kernels (the input is not modified)."""
    graph = copy.deepcopy(model) if engine_state(model).stage == "quantized" else convert(model)
    graph.eval()
    state = engine_state(graph)
    state.stage = "fake"
    for module in graph.modules():
        if isinstance(module, _QWeighted):
            module.stage = "fake"
    for point in state.points.values():
        point.forget_cached()  # a cached weight would enter the trace as a constant, without its point
        point.freeze(True)
    return graph
