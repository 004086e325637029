"""SmoothQuant-style scaling (Xiao et al. 2023, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models") of the Linear layers read by a LayerNorm or an RMSNorm.

Transformers' LayerNorm outputs carry a few outlier channels (a gamma 30-100x the others), and a
per-tensor activation grid sized for them leaves the other channels a handful of codes.  A norm
whose output is read only by ``nn.Linear`` modules (q/k/v of an attention block, fc1 of an MLP)
can move those outliers into the weights without changing the function: per input channel j,

    s_j = max|X_j|^alpha / max_k |W_kj|^(1 - alpha)
    norm.weight_j /= s_j,  norm.bias_j /= s_j,  W[:, j] *= s_j   for every reader W

with max|X_j| measured on ``batches`` (the norm's output) and max_k |W_kj| over every reader's
column j.  The norm's output is affine in (weight, bias), so it becomes X / s and each reader
computes (X / s)(W s)^T = X W^T.  A channel whose activation or weight range is 0 (or a scale
that is not finite) keeps s_j = 1.

``alpha=None`` chooses per norm, on the data, from "no change" and 0.0, 0.1, ..., 1.0 by a local
proxy: the captured norm outputs X (a sample of rows of every batch) and the readers' weights are
fake-quantized with the qconfig's specs after scaling (activation per tensor -- its range the
per-channel min/max seen on all batches, divided by s -- or per token for a dynamic per-token
spec; weights as their spec says: per tensor, per channel or per group), and the readers'
outputs X_q W_q^T are compared with the float X W^T; the candidate with the highest SQNR wins
("no change" on a tie).  The proxy's ranges are min/max ones, whatever the observer.

What is skipped (a report row each, with the reason): a norm without an elementwise weight, one
normalizing over several dimensions, one read by anything but Linear modules (the residual add of
a post-LN block), through a view or passthrough, or by the model's output; a norm or a reader
called more than once in a forward, or holding a weight another module holds; a norm whose
output turns out not to scale with its weight (a library's RMSNorm computing (1 + weight) x,
Gemma's): each rescaled norm is re-run on the first batch's captured input and checked.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from qdebug.engine.ops import is_rms_norm_by_name
from qdebug.engine.plan import Plan, TraceHandler, trace_plan
from qdebug.engine.spec import QConfig, QuantSpec, qparams_from_range
from qdebug.errors import QDebugError, shown
from qdebug.fix.pairs import check_float_model, own_weight, tied_weights
from qdebug.fix.observe import run_hooked

COLUMNS = ["norm", "readers", "channels", "alpha", "act_ratio_before", "act_ratio_after", "local_sqnr_before_db",
           "local_sqnr_after_db", "applied", "reason"]
ALPHA_GRID = tuple(i / 10 for i in range(11))
# Rows of the norm's output kept (over all batches) for the alpha proxy; the ranges use every row.
PROXY_ROWS = 1024
# A rescaled norm's output, times s, must match the original's to this relative error (float32 rounding
# is ~1e-7); a norm that does not scale with its weight misses it by orders of magnitude.
VERIFY_TOLERANCE = 1e-4


@dataclass
class _Group:
    norm: str
    readers: list[str]
    channels: int
    amax: torch.Tensor | None = None  # per-channel max |X_j| over the batches (float64)
    low: torch.Tensor | None = None  # per-channel min / max of X (the per-tensor range after scaling)
    high: torch.Tensor | None = None
    rows: list[torch.Tensor] = field(default_factory=list)  # sampled rows of X for the proxy
    first_call: tuple | None = None  # (args, kwargs, output) of the first batch, to verify the scaling


def smooth(model: nn.Module, batches: Any, *, alpha: float | None = None, qconfig: QConfig | dict | None = None,
           example_inputs: Any = None):
    """SmoothQuant scaling of a float model (module docstring).  Returns ``(new_model, report)``:
    ``new_model`` a deep copy of ``model`` (same class, module tree and state_dict keys; output
    unchanged within float rounding), ``report`` a DataFrame with ``COLUMNS``, one row per
    LayerNorm/RMSNorm call of the traced forward.  ``batches``: the inputs (each a tensor, tuple of
    args or dict of kwargs) on which the activation ranges are measured; ``alpha``: the migration
    strength in [0, 1] for every norm, or None to choose it per norm on the data; ``qconfig``: the
    quantization the proxy models (a QConfig or its dict; default: the engine's, per-tensor int8
    activations);
    ``example_inputs``: for tracing, default the first batch."""
    import pandas as pd

    check_float_model(model, "smooth")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, numbers.Real)
                              or not 0.0 <= alpha <= 1.0):
        raise QDebugError(f"alpha must be a number in [0, 1] or None, got {shown(alpha)}",
                          "e.g. alpha=0.5 (SmoothQuant's default), or None to choose it per norm on the data")
    if qconfig is None:
        qconfig = QConfig()
    elif isinstance(qconfig, dict):  # as prepare takes it
        qconfig = QConfig.from_dict(qconfig)
    elif not isinstance(qconfig, QConfig):
        raise QDebugError(f"qconfig must be a QConfig, not a {type(qconfig).__name__}",
                          "e.g. QConfig(weight=QuantSpec(per_channel=False))")
    if isinstance(batches, torch.Tensor):  # list() would cut it into rows, each taken for a batch
        raise QDebugError("smooth takes a list of batches, not one tensor", "wrap it: smooth(model, [x])")
    batches = list(batches) if batches is not None else []
    if not batches:
        raise QDebugError("smooth needs batches to measure the norms' activation ranges on",
                          "pass a list of model inputs, e.g. the calibration batches")
    new = copy.deepcopy(model)
    handler = TraceHandler()
    plan = trace_plan(new, batches[0] if example_inputs is None else example_inputs, handler=handler)
    modules = dict(new.named_modules())
    found = _find_groups(new, plan, handler.records, modules)
    groups = [g for g in found if isinstance(g, _Group)]
    with torch.no_grad():
        if groups:
            _capture(new, modules, groups, batches)
        rows = [_smooth_group(g, modules, qconfig, alpha) if isinstance(g, _Group) else _row(*g[:2], None, reason=g[2])
                for g in found]  # in the forward's order
    if not rows:
        rows.append(_row("", [], None, reason="the model has no LayerNorm or RMSNorm: nothing to smooth"))
    report = pd.DataFrame(rows, columns=COLUMNS)
    report["channels"] = report["channels"].astype("Int64")  # <NA> where skipped
    return new, report


def _row(norm: str, readers: list[str], channels: int | None, *, alpha: float = math.nan,
         ratios: tuple[float, float] = (math.nan, math.nan), sqnrs: tuple[float, float] = (math.nan, math.nan),
         applied: bool = False, reason: str = "") -> dict[str, Any]:
    return {"norm": norm, "readers": ", ".join(readers), "channels": channels, "alpha": alpha,
            "act_ratio_before": ratios[0], "act_ratio_after": ratios[1], "local_sqnr_before_db": sqnrs[0],
            "local_sqnr_after_db": sqnrs[1], "applied": applied, "reason": reason}


# -- which norms ---------------------------------------------------------------------------------
def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or is_rms_norm_by_name(module)


def _find_groups(model: nn.Module, plan: Plan, records: dict, modules: dict[str, nn.Module]):
    """Every norm call of the plan, in order: a ``_Group`` where it may be smoothed, else (norm,
    readers, reason)."""
    found: list[_Group | tuple[str, list[str], str]] = []
    tied = tied_weights(model)
    for rec in plan.calls.values():
        path = rec.name.split("#")[0]
        if not rec.is_module or path not in modules or not _is_norm(modules[path]):
            continue
        if "#" in rec.name:
            continue  # a second call of a shared norm: its first call's row says why
        readers, reason = _readers(plan, records, rec.name)
        reason = _norm_refusal(plan, modules, path, tied) or reason or _reader_refusal(plan, modules, path, readers,
                                                                                        tied)
        found.append((path, readers, reason) if reason else _Group(path, readers, int(modules[path].weight.shape[0])))
    return found


def _readers(plan: Plan, records: dict, name: str) -> tuple[list[str], str]:
    """The calls reading ``name``'s output, and why they cannot all be rescaled ("" when they can)."""
    readers, reason = [], ""
    for consumer in plan.calls[name].consumers:
        if consumer == "<output>":
            reason = reason or f"the output of {name} is the model's output"
            continue
        if consumer.startswith("~"):
            reached = _reached_calls(records, consumer)
            if reached:  # a view read by nothing (``x.shape``) is no reader
                view = records[consumer]
                op = view.owner if view.is_module and view.owner else view.op  # a passthrough module: its path
                readers += [f"{call} (through {op})" for call in reached]
                reason = reason or (f"the output of {name} is read through a view or passthrough op ({op}) "
                                    f"by {', '.join(reached)}")
            continue
        readers.append(consumer)
        reader = plan.calls.get(consumer)
        if reader is None or reader.category != "linear" or not reader.is_module:
            what = f"{reader.category}" if reader is not None else "not in the plan"
            reason = reason or f"{consumer} ({what}) reads the output of {name}: not a Linear (a residual add?)"
        elif len(reader.inputs) != 1:
            reason = reason or f"{consumer} reads more than one tensor"
    if not readers and not reason:
        reason = f"the output of {name} is not read"
    return readers, reason


def _reached_calls(records: dict, name: str) -> list[str]:
    """The calls (and ``<output>``) that read the view ``name``'s output, through further views."""
    found, todo, seen = [], [name], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for consumer in records[current].consumers if current in records else []:
            if consumer.startswith("~") and consumer in records:
                todo.append(consumer)
            elif consumer not in found:
                found.append(consumer)
    return found


def _norm_refusal(plan: Plan, modules: dict[str, nn.Module], path: str, tied: set[str]) -> str:
    norm = modules[path]
    if plan.call_counts.get(path, 0) != 1:
        return f"module {path} is called {plan.call_counts.get(path, 0)} times in one forward (shared)"
    if getattr(norm, "weight", None) is None:
        return f"{type(norm).__name__} without elementwise affine: no weight to divide by s"
    if not own_weight(norm) or (getattr(norm, "bias", None) is not None and not isinstance(norm.bias, nn.Parameter)):
        return f"the weight of {path} is computed (a parametrization), not a Parameter"
    if norm.weight.dim() != 1:
        return f"{path} normalizes over several dimensions (weight {tuple(norm.weight.shape)}); a Linear reads one"
    if path in tied:
        return f"the weight of {path} is shared with another module"
    return ""


def _reader_refusal(plan: Plan, modules: dict[str, nn.Module], path: str, readers: list[str], tied: set[str]) -> str:
    channels = modules[path].weight.shape[0]
    for call in readers:
        reader = call.split("#")[0]  # a reader's second call: the count below says why
        layer = modules.get(reader)
        if not isinstance(layer, nn.Linear):
            return f"{reader} is not an nn.Linear"
        if plan.call_counts.get(reader, 0) != 1:
            return f"module {reader} is called {plan.call_counts.get(reader, 0)} times in one forward (shared)"
        if reader in tied:
            return f"the weight of {reader} is shared with another module"
        if not own_weight(layer):
            return f"the weight of {reader} is computed (weight norm or a parametrization), not a Parameter"
        if layer.weight.shape[1] != channels:
            return f"{reader} reads {layer.weight.shape[1]} features and {path} has {channels} channels"
    return ""


# -- measuring -----------------------------------------------------------------------------------
def _capture(model: nn.Module, modules: dict[str, nn.Module], groups: list[_Group], batches: list) -> None:
    """Each group's per-channel range of the norm's output over ``batches``, a sample of its rows
    for the proxy, and the first call's input and output (to verify the scaling)."""
    per_batch = max(1, PROXY_ROWS // len(batches))

    def keep(group: _Group):
        def hook(module, args, kwargs, output):
            x = output.detach().double().reshape(-1, group.channels)
            low, high = x.amin(dim=0), x.amax(dim=0)
            group.low = low if group.low is None else torch.minimum(group.low, low)
            group.high = high if group.high is None else torch.maximum(group.high, high)
            picked = torch.linspace(0, x.shape[0] - 1, min(per_batch, x.shape[0])).round().long()
            group.rows.append(x[picked])
            if group.first_call is None:  # copies: a later op may write into the input in place
                group.first_call = (tuple(_copied(a) for a in args), {k: _copied(v) for k, v in kwargs.items()},
                                    output.detach().clone())
        return hook

    run_hooked(model, batches, [(modules[g.norm], keep(g)) for g in groups], with_kwargs=True)
    for group in groups:
        if group.low is not None:
            group.amax = torch.maximum(group.low.abs(), group.high.abs())


def _copied(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _act_ratio(amax: torch.Tensor) -> float:
    """max_j max|X_j| / mean_j max|X_j|: 1 when every channel fills the per-tensor range."""
    mean = amax.mean().item()
    return amax.max().item() / mean if mean > 0 else math.nan


def scales(amax: torch.Tensor, weight_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = amax_j^alpha / weight_amax_j^(1 - alpha) (float64); 1 where either range is 0 or s is
    not a finite positive number."""
    amax, weight_amax = amax.double(), weight_amax.double()
    usable = (amax > 0) & (weight_amax > 0)
    s = amax.clamp(min=1e-300).pow(alpha) / weight_amax.clamp(min=1e-300).pow(1.0 - alpha)
    good = usable & torch.isfinite(s) & (s > 0)
    return torch.where(good, s, torch.ones_like(s))


def _smooth_group(group: _Group, modules: dict[str, nn.Module], qconfig: QConfig, alpha: float | None) -> dict:
    norm = modules[group.norm]
    readers = [modules[r] for r in group.readers]
    if group.amax is None:
        return _row(group.norm, group.readers, group.channels, reason=f"{group.norm} was not run by the batches")
    weights = [r.weight.detach().double() for r in readers]
    weight_amax = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)
    proxy = _Proxy(group, weights, [r.bias.detach().double() if r.bias is not None else None for r in readers],
                   qconfig.spec_for("activation", (group.norm,)),
                   [qconfig.spec_for("weight", (name,)) for name in group.readers])
    ones = torch.ones(group.channels, dtype=torch.float64)
    before = proxy.sqnr_db(ones)
    if alpha is None:  # (alpha, scales, proxy SQNR); the first of equals wins: no change
        candidates = [(math.nan, ones, before)] + [
            (a, s, proxy.sqnr_db(s)) for a, s in ((a, scales(group.amax, weight_amax, a)) for a in ALPHA_GRID)]
        chosen, scale, after = max(candidates, key=lambda c: c[2])
    else:
        chosen, scale = float(alpha), scales(group.amax, weight_amax, float(alpha))
        after = proxy.sqnr_db(scale)
    ratios = (_act_ratio(group.amax), _act_ratio(group.amax / scale))
    row = {"alpha": chosen, "ratios": ratios, "sqnrs": (before, after)}
    if math.isnan(chosen):
        return _row(group.norm, group.readers, group.channels, **row,
                    reason="no alpha improves the local proxy: left unchanged")
    saved = [t.detach().clone() for t in _tensors(norm, readers)]
    _apply(norm, readers, scale)
    if not _scales_output(norm, group, scale):
        for tensor, old in zip(_tensors(norm, readers), saved):
            tensor.copy_(old)
        return _row(group.norm, group.readers, group.channels, **{**row, "ratios": (ratios[0], ratios[0])},
                    reason=f"the output of {group.norm} does not scale with its weight (e.g. (1 + weight) x): "
                           "left unchanged")
    return _row(group.norm, group.readers, group.channels, **row, applied=True)


def _tensors(norm: nn.Module, readers: list[nn.Module]) -> list[torch.Tensor]:
    return [t for t in (norm.weight, getattr(norm, "bias", None), *(r.weight for r in readers)) if t is not None]


def _apply(norm: nn.Module, readers: list[nn.Module], scale: torch.Tensor) -> None:
    """norm.weight /= s, norm.bias /= s, reader.weight[:, j] *= s_j; in float64, written in each dtype."""
    for tensor in (norm.weight, getattr(norm, "bias", None)):
        if tensor is not None:
            tensor.copy_((tensor.double() / scale).to(tensor.dtype))
    for reader in readers:
        reader.weight.copy_((reader.weight.double() * scale).to(reader.weight.dtype))


def _scales_output(norm: nn.Module, group: _Group, scale: torch.Tensor) -> bool:
    """The rescaled norm, re-run on the first batch's captured input, gives the original output / s."""
    args, kwargs, original = group.first_call
    rescaled = norm(*args, **kwargs).double() * scale
    original = original.double()
    reference = original.norm().item()
    error = (rescaled - original).norm().item()
    return error <= VERIFY_TOLERANCE * reference if reference > 0 else error == 0


# -- the proxy -----------------------------------------------------------------------------------
class _Proxy:
    """SQNR of the readers' outputs when the scaled norm output and the scaled weights are
    fake-quantized, against the float outputs, on the captured rows (module docstring)."""

    def __init__(self, group: _Group, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                 act_spec: QuantSpec | None, weight_specs: list[QuantSpec | None]):
        self.group, self.weights, self.act_spec, self.weight_specs = group, weights, act_spec, weight_specs
        self.x = torch.cat(group.rows)
        self.reference = [self.x @ w.T for w in weights]
        self.signal = sum(float(((y + b if b is not None else y) ** 2).sum()) for y, b in zip(self.reference, biases))

    def sqnr_db(self, scale: torch.Tensor) -> float:
        from qdebug.measure.stats import sqnr_db

        x = self.x / scale
        spec = self.act_spec
        if spec is not None:
            if spec.dynamic and spec.per_token:
                x = fake_quant(x, x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True), spec)
            else:  # the per-tensor range of every batch: X / s over the per-channel min/max
                x = fake_quant(x, (self.group.low / scale).min(), (self.group.high / scale).max(), spec)
        noise = 0.0
        for weight, spec, reference in zip(self.weights, self.weight_specs, self.reference):
            noise += float(((x @ fake_quant_weight(weight * scale, spec).T - reference) ** 2).sum())
        return sqnr_db(self.signal, noise)


def fake_quant(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``x`` on the grid ``spec`` puts on [low, high] (broadcastable to x), in float64: the engine's
    range rules (``qparams_from_range``), then round half to even and clamp, as torch's kernels."""
    scale, zero_point = qparams_from_range(low, high, spec)
    scale, zero_point = scale.double(), zero_point.double()
    codes = torch.clamp(torch.round(x / scale) + zero_point, spec.qmin, spec.qmax)
    return (codes - zero_point) * scale


def fake_quant_weight(weight: torch.Tensor, spec: QuantSpec | None) -> torch.Tensor:
    """A Linear weight [out, in] fake-quantized as ``spec`` says: per tensor, per channel (output
    rows for ch_axis 0, input columns for 1) or per group of ``group_size`` along each row."""
    if spec is None:
        return weight
    if spec.group_size is not None and weight.shape[1] % spec.group_size == 0:
        grouped = weight.reshape(weight.shape[0], -1, spec.group_size)
        return fake_quant(grouped, grouped.amin(dim=2, keepdim=True), grouped.amax(dim=2, keepdim=True),
                          spec).reshape(weight.shape)
    if spec.per_channel or spec.group_size is not None:
        reduce = 1 if spec.ch_axis % 2 == 0 else 0
        return fake_quant(weight, weight.amin(dim=reduce, keepdim=True), weight.amax(dim=reduce, keepdim=True), spec)
    return fake_quant(weight, weight.min(), weight.max(), spec)
