"""``inspect``: what a checkpoint holds, layer by layer, and what looks wrong.

Returns DataFrames: ``layers`` (one row per call of the traced forward:
weight/activation dtype and granularity, scale range, call count), ``checks``
(one row per finding, with a severity): unfused Conv-BN, shared module (called
more than once), dead module (never called), zero/NaN/Inf scale, uninitialised
observer, float-fallback op, non-finite weights, BatchNorm statistics that break an eval
forward or a fold (negative, NaN or zero variance, zero gamma), a torch quantizer an
imported model could not map; and ``imports``: the import report of a model imported from torch.ao
(``qdebug.interop``; empty for others).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
import torch.nn as nn

from qdebug.engine import engine_state, is_prepared
from qdebug.engine.modules import FoldedBatchNorm, _QWeighted
from qdebug.engine.ops import fallback_reason, module_category
from qdebug.engine.plan import Plan, trace_plan
from qdebug.engine.prepare import WEIGHT_ONLY
from qdebug.engine.point import QuantPoint
from qdebug.engine.recurrent import RecurrentLayer
from qdebug.engine.spec import SCALE_EPS

LAYER_COLUMNS = [
    "layer", "type", "calls", "weight", "weight_scale_min", "weight_scale_max",
    "activation", "act_scale_min", "act_scale_max", "fused_into", "mode",
]
CHECK_COLUMNS = ["severity", "layer", "check", "detail"]


@dataclass
class InspectResult:
    layers: pd.DataFrame
    checks: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)
    imports: pd.DataFrame | None = None  # rows of qdebug.interop.build.REPORT_COLUMNS (empty: not imported)

    @property
    def has_errors(self) -> bool:
        return bool((self.checks["severity"] == "error").any()) if len(self.checks) else False


def _dtype(point: QuantPoint | None) -> str:
    """A short label: ``int8 sym per-ch``, ``uint8 affine``, ``int8 sym per-ch(1) [observe]``."""
    if point is None:
        return "float"
    spec = point.spec
    gran = (" per-ch" if spec.ch_axis == 0 else f" per-ch({spec.ch_axis})") if spec.per_channel else ""
    if spec.group_size is not None:
        gran = f" g{spec.group_size}"
    elif spec.dynamic:
        gran = " per-token" if spec.per_token else " dynamic"
    label = f"{spec.dtype_name} {'sym' if spec.symmetric else 'affine'}{gran}"
    return label if point.mode == "fake" else f"{label} [{point.mode}]"


def _scale_range(point: QuantPoint | None) -> tuple[float | None, float | None]:
    if point is None or not point.initialized or point.spec.dynamic:  # dynamic: no stored scale
        return None, None
    scale = point.scale.detach().float()
    return float(scale.min()), float(scale.max())


def inspect_model(model: nn.Module, *, stage: str = "float", example_inputs: Any = None) -> InspectResult:
    """Inspect a loaded model of any stage.  A float model needs ``example_inputs`` to see inline ops."""
    checks: list[dict[str, Any]] = []
    modules = dict(model.named_modules())
    prepared = is_prepared(model)
    points: dict[str, QuantPoint] = {}
    plan: Plan | None = None
    if prepared:
        state = engine_state(model)
        plan, points = state.plan, state.points
    elif example_inputs is not None:
        plan = trace_plan(model, example_inputs)

    imports = _import_rows(model if prepared else None)
    rows = []
    if plan is not None:
        for rec in plan.calls.values():
            module = modules.get(rec.name.split("#")[0]) if rec.is_module else None
            weight_point = points.get(f"{rec.name}.weight")
            w_lo, w_hi = _scale_range(weight_point)
            has_weight = isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Linear, nn.Embedding, nn.PReLU, _QWeighted)
                                    + WEIGHT_ONLY)
            if isinstance(module, RecurrentLayer) and module.qpoints:  # its points are inside it: a row each
                rows += [_inner_point_row(point, module, rec) for point in module.qpoints.values()]
                continue
            # One row per tensor of a structured output (``lstm:0``, ``lstm:1.0``...), each with its point.
            outputs = [(name, name) for name in rec.point_names()] if rec.members and rec.point else [
                (rec.name, rec.output_point)]
            for layer, landing in outputs:
                act_point = points.get(landing) if landing else None
                a_lo, a_hi = _scale_range(act_point)
                rows.append({
                    "layer": layer,
                    "type": type(module).__name__ if module is not None else rec.op,
                    "calls": plan.call_counts.get(rec.name.split("#")[0], 1) if rec.is_module else 1,
                    "weight": _dtype(weight_point) if has_weight else "",
                    "weight_scale_min": w_lo, "weight_scale_max": w_hi,
                    "activation": _dtype(act_point) if act_point is not None else (
                        "float" if rec.category != "passthrough" else ""),
                    "act_scale_min": a_lo, "act_scale_max": a_hi,
                    "fused_into": landing if act_point is not None and landing != layer else "",
                    "mode": act_point.mode if act_point is not None else "float",
                })
        _structure_checks(model, plan, prepared, modules, checks, imported=bool(len(imports)))
    else:
        for name, module in modules.items():
            if name and module_category(module) is not None:
                rows.append({"layer": name, "type": type(module).__name__, "calls": None, "weight": "",
                             "weight_scale_min": None, "weight_scale_max": None, "activation": "float",
                             "act_scale_min": None, "act_scale_max": None, "fused_into": "", "mode": "float"})
        checks.append({"severity": "info", "layer": "", "check": "not traced",
                       "detail": "no sample inputs: inline ops, shared and dead modules are not shown (pass --data)"})
    _point_checks(points, checks)
    _weight_checks(model, checks)
    _bn_checks(model, checks)
    _import_checks(imports, checks)
    layers = pd.DataFrame(rows, columns=LAYER_COLUMNS)
    check_frame = pd.DataFrame(checks, columns=CHECK_COLUMNS)
    meta = {
        "stage": stage,
        "prepared": prepared,
        "quant_points": len(points),
        "qat_mode": engine_state(model).qat_mode if prepared else None,
        "errors": int((check_frame["severity"] == "error").sum()),
        "warnings": int((check_frame["severity"] == "warning").sum()),
        "imported": bool(len(imports)),
    }
    return InspectResult(layers, check_frame, meta, imports)


def _inner_point_row(point: QuantPoint, module: nn.Module, rec) -> dict[str, Any]:
    """A row for a quant point inside a layer (a recurrent layer's gate weights and step
    points: ``lstm.weight_ih_l0``, ``lstm.l0.cell``)."""
    lo, hi = _scale_range(point)
    weight = point.kind == "weight"
    return {"layer": point.name, "type": type(module).__name__, "calls": 1, "fused_into": "", "mode": point.mode,
            "weight": _dtype(point) if weight else "", "weight_scale_min": lo if weight else None,
            "weight_scale_max": hi if weight else None, "activation": "" if weight else _dtype(point),
            "act_scale_min": None if weight else lo, "act_scale_max": None if weight else hi}


def _import_rows(model: nn.Module | None) -> pd.DataFrame:
    """The import report a model imported from torch.ao carries (``qdebug.interop.build``)."""
    from qdebug.interop import import_report
    from qdebug.interop.build import REPORT_COLUMNS

    return import_report(model) if model is not None else pd.DataFrame([], columns=REPORT_COLUMNS)


def _import_checks(imports: pd.DataFrame, checks: list) -> None:
    """A torch quantizer the engine could not map computes nothing in the imported model; one it
    maps approximately computes something else there (docs/interop.md)."""
    for row in imports[imports["status"] == "unmapped"].itertuples():
        checks.append({"severity": "warning", "layer": row.source, "check": "unmapped quantizer",
                       "detail": f"the torch.ao {row.kind} quantizer is not in the imported model: {row.note}"})
    for row in imports[imports["status"] == "approximate"].itertuples():
        checks.append({"severity": "warning", "layer": row.source, "check": "approximate quantizer",
                       "detail": f"the imported point {row.point!r} does not compute what torch's {row.kind} "
                                 f"quantizer does: {row.note}"})


def _structure_checks(model, plan: Plan, prepared: bool, modules: dict, checks: list, *, imported: bool = False) -> None:
    paired_bns = {bn for _, bn in plan.pairs}
    for conv, bn in plan.pairs:
        module = modules.get(conv)
        if not prepared:
            checks.append({"severity": "info", "layer": conv, "check": "unfused Conv-BN",
                           "detail": f"{conv} -> {bn} is a Conv-BN pair; prepare folds it (fuse_bn) or keeps BN for QAT"})
        elif isinstance(module, _QWeighted) and module.bn is not None:
            checks.append({"severity": "info", "layer": conv, "check": "unfused Conv-BN",
                           "detail": f"BN {bn} kept ({module.bn_mode}); convert folds it"
                           + (" and re-quantizes the weight: a real change" if module.bn_mode == "with_bn" else "")})
    for rec in plan.calls.values():
        if rec.category == "bn" and rec.is_module and rec.name not in paired_bns:
            module = modules.get(rec.name)
            if not isinstance(module, FoldedBatchNorm):
                why = ("the torch.ao model it was imported from does not fuse it with a conv" if imported else
                       "BatchNorm not directly after a conv used only by it")
                checks.append({"severity": "warning", "layer": rec.name, "check": "unfused Conv-BN",
                               "detail": f"{why}: it runs as a separate op"})
    for path, count in plan.call_counts.items():
        # A part of an engine layer that runs only for some arguments (attention's mask, its
        # returned weights) is idle by design, not a dead module of the user's.
        if count == 0 and not getattr(modules.get(path), "optional_call", False):
            checks.append({"severity": "warning", "layer": path, "check": "dead module",
                           "detail": "never called in the traced forward: its quantization has no effect"})
        elif count > 1:
            checks.append({"severity": "info", "layer": path, "check": "shared module",
                           "detail": f"called {count} times per forward: one quant point per call (#2 ...)"})


def _point_checks(points: dict[str, QuantPoint], checks: list) -> None:
    for name, point in points.items():
        if point.fallback:
            checks.append({"severity": "warning", "layer": name, "check": "float fallback",
                           "detail": f"no quantized kernel for {point.op}: computed in float, re-quantized after "
                                     f"({fallback_reason(point.op)})"})
        if point.mode == "float":
            continue
        if not point.initialized:
            if point.kind == "activation":
                checks.append({"severity": "error", "layer": name, "check": "uninitialised observer",
                               "detail": "no scale yet: the point never saw data (calibrate it)"})
            continue
        scale = point.scale.detach().float()
        if not torch.isfinite(scale).all():
            checks.append({"severity": "error", "layer": name, "check": "non-finite scale",
                           "detail": f"scale holds NaN/Inf ({int((~torch.isfinite(scale)).sum())} of {scale.numel()})"})
        elif bool((scale <= SCALE_EPS * 1.0001).any()):
            checks.append({"severity": "warning", "layer": name, "check": "zero scale",
                           "detail": "scale at its floor (eps): the observed range was empty or constant zero"})
        nonfinite = int(getattr(point.observer, "nonfinite", torch.zeros(())).sum()) if hasattr(point.observer, "nonfinite") else 0
        if nonfinite:
            checks.append({"severity": "warning", "layer": name, "check": "non-finite data",
                           "detail": f"its observer saw {nonfinite} NaN/Inf values"})


def _weight_checks(model: nn.Module, checks: list) -> None:
    for name, param in model.named_parameters():
        bad = int((~torch.isfinite(param.detach())).sum())
        if bad:
            checks.append({"severity": "error", "layer": name, "check": "non-finite weights",
                           "detail": f"{bad} of {param.numel()} values are NaN/Inf"})


# What each invalid BatchNorm statistic does, keyed by the check's name (docs/inspect.md).
BN_STATISTICS = {
    "negative BN variance": "sqrt(running_var + eps) is NaN there: every eval forward, and folding the BN "
                            "(fuse_bn), gives NaN",
    "non-finite BN statistics": "an eval forward and a fold (fuse_bn) carry the NaN/Inf into the output",
    "zero BN variance": "the channel was constant on the data it saw; folding multiplies its weights by "
                        "gamma / sqrt(eps), an outlier for a per-tensor weight scale",
    "zero BN gamma": "the channel's output is its constant beta; a Conv-BN that divides by the BN factor "
                     "gamma / sqrt(var + eps) (torch.ao's fused ConvBn2d, pytorch#85744) computes 0 / 0 = NaN there",
}


def _bn_checks(model: nn.Module, checks: list) -> None:
    """BatchNorm statistics that turn into NaN (or outliers) in an eval forward or a fold: each a
    warning naming the BN and its channels (a placeholder of a folded BN has none left)."""
    for name, bn in model.named_modules():
        if not isinstance(bn, nn.modules.batchnorm._BatchNorm) or bn.running_var is None:
            continue
        var, mean = bn.running_var.detach(), bn.running_mean.detach()
        masks = {"negative BN variance": var < 0,
                 "non-finite BN statistics": ~torch.isfinite(var) | ~torch.isfinite(mean),
                 "zero BN variance": var == 0,
                 "zero BN gamma": bn.weight.detach() == 0 if bn.weight is not None else torch.zeros_like(var).bool()}
        for check, mask in masks.items():
            channels = [int(c) for c in mask.nonzero().reshape(-1)]
            if not channels:
                continue
            shown = ", ".join(map(str, channels[:8])) + (" ..." if len(channels) > 8 else "")
            low = f" (min {float(var.min()):g})" if check == "negative BN variance" else ""
            checks.append({"severity": "warning", "layer": name, "check": check,
                           "detail": f"channel(s) {shown} of {var.numel()}{low}: {BN_STATISTICS[check]}"})
