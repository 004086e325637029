"""Cross-layer equalization (Nagel et al. 2019, "Data-Free Quantization Through Weight
Equalization and Bias Correction"), on a float model, without the engine's quant points.

``equalize(model, example_inputs)`` works on a deep copy of a float model:

1. BN fold: every Conv->BN pair of the engine's plan (``qdebug.engine.plan.trace_plan``) is
   folded, W' = W f, b' = (b - mu) f + beta with f = gamma / sqrt(var + eps), and the BN becomes
   an identity in eval (weight 1, running_mean 0, running_var 1 - eps).  A conv without a bias
   keeps none -- its folded bias lives in the identity BN's ``bias`` (or, for a BN without affine
   parameters, in ``running_mean = -b'``) -- so the state_dict keys, and a float checkpoint's fit
   to the user's class, stay the same.
2. Pairs: L1 (conv/linear) whose output reaches L2 (conv/linear) through at most its folded BN
   and one ReLU, every tensor on the way read once (a residual block's output read twice is not a
   pair), L1 and L2 each called once in the forward, each holding its weight as a Parameter of
   its own, with L1's output channels = L2's input channels.  ReLU is positively homogeneous, relu(x / s) = relu(x) / s for s > 0, so scaling
   L1's output channel i by 1/s_i and L2's input channel i by s_i leaves the function unchanged.
   ReLU6 is not: s relu6(z / s) = clip(z, 0, 6 s), so its clip would move.  Without ``batches``
   such pairs are skipped with that reason; with them, the pre-activation's per-channel maximum
   m_i is measured on every batch and s_i is kept where the rescaled channel stays inside the
   clip on the data with headroom h = ``RELU6_HEADROOM`` (1.5): a channel reaching 6 / h (m_i > 4)
   keeps s_i = 1, the others get s_i >= m_i h / 6 (exact on those batches, and on unseen ones
   whose peaks stay within h times the ones measured).  Grouped
   convs (depthwise included) are handled per group: L2's input channel i is column i % (in/g) of
   the output rows of group i // (in/g).
3. Scaling: r1_i = max |W1[i]| (L1's output channel i), r2_i = max |W2[:, i]| (L2's input channel
   i), s_i = sqrt(r1_i r2_i) / r2_i; W1[i] /= s_i, b1[i] /= s_i, W2[:, i] *= s_i, after which both
   ranges equal sqrt(r1_i r2_i).  A zero range leaves its channel (s_i = 1).  Chains (L1-L2-L3)
   share layers, so the pairs are swept again until no scale moves by more than ``tolerance``
   (relative) or ``iterations`` sweeps are done.

The report's ``range_ratio`` of a pair is the worse of its two sides' max_i r_i / mean_i r_i
(L1's output channels, L2's input channels): 1 when every channel uses the per-tensor range
equally, large when one outlier channel sets the range that the others' codes share.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from qdebug.engine.modules import fold_bn
from qdebug.engine.plan import CallRecord, Plan, trace_plan
from qdebug.engine.prepare import is_prepared
from qdebug.errors import QDebugError

COLUMNS = ["layer1", "layer2", "through", "channels", "range_ratio_before", "range_ratio_after", "applied",
           "reason"]
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
RELU6_REASON = "ReLU6 is not positively homogeneous (its clip at 6 would move)"
RELU6_CLIP = 6.0
# Through a ReLU6, the rescaled channel's peak on the batches stays below 6 / RELU6_HEADROOM: an
# unseen input may exceed the peaks measured by this factor before the clip moves (on the demo's
# held-out batches the peaks of 6 calibration batches were exceeded; without headroom the output
# moved to 44 dB from the original, with 1.5 it stays above 120 dB).
RELU6_HEADROOM = 1.5
_RELU6_LIMIT = RELU6_CLIP / RELU6_HEADROOM


@dataclass
class _Pair:
    layer1: str
    layer2: str
    through: list[str] = field(default_factory=list)
    ratio_before: float = float("nan")
    clip_input: str = ""  # through a ReLU6: the module whose output is the clip's input
    peak: torch.Tensor | None = None  # its per-channel maximum on the batches, as L1 is rescaled


def _applied_note(pair: _Pair) -> str:
    if pair.peak is None:
        return ""
    held = int((pair.peak > _RELU6_LIMIT).sum())
    return (f"ReLU6: {held} channel(s) come within {RELU6_HEADROOM:g}x of the clip on the data and keep their scale"
            if held else "")


def equalize(model: nn.Module, example_inputs: Any, *, iterations: int = 20, tolerance: float = 1e-6,
             batches: Any = None):
    """Cross-layer equalization of a float model (module docstring).  Returns ``(new_model, report)``:
    ``new_model`` a deep copy of ``model`` (same class, same module tree, eval output unchanged
    within float rounding), ``report`` a DataFrame with ``COLUMNS``, one row per pair applied and
    one per conv/linear whose output could not be equalized, with the reason.  ``iterations=0``
    folds the BNs only.  ``batches``: inputs (each a tensor, tuple of args or dict of kwargs) on
    which ReLU6 pairs are measured and equalized inside the clip; None skips them."""
    import pandas as pd

    _check_float_model(model, "equalize")
    if not isinstance(iterations, int) or iterations < 0:
        raise QDebugError(f"iterations must be a non-negative integer, got {iterations!r}", "e.g. iterations=20")
    new = copy.deepcopy(model)
    plan = trace_plan(new, example_inputs)
    modules = dict(new.named_modules())
    with torch.no_grad():
        biases = _fold_all(plan, modules)
        pairs, skipped = _find_pairs(new, plan, modules, relu6=batches is not None)
        clipped = [p for p in pairs if p.clip_input]
        if clipped:
            _measure_clip_inputs(new, modules, clipped, batches)
        for pair in pairs:
            pair.ratio_before = _range_ratio(modules[pair.layer1], modules[pair.layer2])
        for _ in range(iterations):
            moved = [_scale_pair(modules[p.layer1], modules[p.layer2], biases.get(p.layer1), p.peak) for p in pairs]
            if max(moved, default=0.0) <= tolerance:
                break
    rows = [
        {"layer1": p.layer1, "layer2": p.layer2, "through": " > ".join(p.through),
         "channels": int(modules[p.layer1].weight.shape[0]), "range_ratio_before": p.ratio_before,
         "range_ratio_after": _range_ratio(modules[p.layer1], modules[p.layer2]), "applied": iterations > 0,
         "reason": _applied_note(p) if iterations > 0 else "iterations=0: BN folded only"}
        for p in pairs
    ]
    rows += [{"layer1": layer1, "layer2": layer2, "through": "", "channels": None,
              "range_ratio_before": float("nan"), "range_ratio_after": float("nan"), "applied": False,
              "reason": reason} for layer1, layer2, reason in skipped]
    report = pd.DataFrame(rows, columns=COLUMNS)
    report["channels"] = report["channels"].astype("Int64")  # <NA> where skipped
    return new, report


def _check_float_model(model: Any, name: str) -> None:
    """Refuse what a float-side fix cannot take: not a module, or a model prepared by qdebug."""
    if not isinstance(model, nn.Module):
        raise QDebugError(f"{name} takes a float nn.Module, not a {type(model).__name__}", "pass the float model")
    if is_prepared(model):
        raise QDebugError(f"{name} takes a float model, and this one is prepared by qdebug",
                          f"run {name} on the float model first, then prepare (or calibrate) the result")


def _fold_all(plan: Plan, modules: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """Fold every Conv->BN pair of the plan (whose conv holds its weight); conv path -> the tensor
    holding its folded bias (``_fold_to_identity``)."""
    return {conv: _fold_to_identity(modules[conv], modules[bn]) for conv, bn in plan.pairs
            if _own_weight(modules[conv])}


def _fold_to_identity(conv: nn.Module, bn: nn.modules.batchnorm._BatchNorm) -> torch.Tensor:
    """Fold ``bn`` into ``conv`` and make ``bn`` an identity in eval; returns the tensor holding
    the folded bias (conv.bias, else the BN's bias, else its running_mean holding -bias)."""
    weight, bias = fold_bn(conv.weight, conv.bias, bn)
    conv.weight.copy_(weight)
    bn.running_mean.zero_()
    bn.running_var.fill_(1.0 - bn.eps)  # sqrt(var + eps) = 1
    if bn.weight is not None:
        bn.weight.fill_(1.0)
    if conv.bias is not None:
        conv.bias.copy_(bias)
        if bn.bias is not None:
            bn.bias.zero_()
        return conv.bias
    if bn.bias is not None:
        bn.bias.copy_(bias)
        return bn.bias
    bn.running_mean.copy_(-bias)  # (x - (-b)) / 1 = x + b; scaling -b by 1/s scales b
    return bn.running_mean


def _find_pairs(model: nn.Module, plan: Plan, modules: dict[str, nn.Module], relu6: bool = False):
    """The equalizable pairs, and (layer1, layer2, reason) for every other conv/linear call."""
    pairs: list[_Pair] = []
    skipped: list[tuple[str, str, str]] = []
    tied = _tied_weights(model)
    for rec in plan.calls.values():
        if rec.category not in ("conv", "linear") or not rec.is_module:
            continue
        layer1 = rec.name.split("#")[0]
        found, through, reason = _follow(plan, rec, relu6)
        layer2 = found.name.split("#")[0] if found is not None else ""
        if found is not None:
            reason = _pair_refusal(plan, modules, layer1, layer2, tied)
        if reason:
            skipped.append((rec.name, found.name if found is not None else "", reason))
        else:
            clip_input = ""
            if any(plan.calls[t].category == "relu6" for t in through):
                clip_input = _activation_input(plan, layer1, through)
            pairs.append(_Pair(layer1, layer2, through, clip_input=clip_input))
    return pairs, skipped


def _activation_input(plan: Plan, layer1: str, through: list[str]) -> str:
    """The module whose output is the activation's input on the way from L1: its folded BN, else L1."""
    return ([t for t in through if plan.calls[t].category == "bn"] or [layer1])[0]


def _follow(plan: Plan, rec: CallRecord, relu6: bool = False) -> tuple[CallRecord | None, list[str], str]:
    """From L1's call, the L2 call its output reaches through at most its folded BN and one ReLU
    (or ReLU6 when ``relu6``), each tensor read once; else (None, through, why not)."""
    folded = {conv: bn for conv, bn in plan.pairs}
    through: list[str] = []
    current = rec
    while True:
        readers = current.consumers
        if len(readers) != 1:
            what = "is not read" if not readers else f"is read {len(readers)} times (a branch or a residual)"
            return None, through, f"the output of {current.name} {what}"
        name = readers[0]
        if name == "<output>":
            return None, through, f"{current.name} computes the model's output"
        if name.startswith("~"):
            return None, through, f"{current.name}'s output is read through a view or passthrough op"
        nxt = plan.calls.get(name)
        if nxt is None:
            return None, through, f"{current.name}'s reader {name} is not in the plan"
        if nxt.category in ("conv", "linear") and nxt.is_module:
            if len(nxt.inputs) != 1:
                return None, through, f"{nxt.name} reads more than one tensor"
            return nxt, through, ""
        if nxt.category == "bn" and not through and folded.get(rec.name) == nxt.name:
            through.append(nxt.name)
        elif (nxt.category == "relu" or relu6 and nxt.category == "relu6") and not any(
                plan.calls[t].category in ("relu", "relu6") for t in through):
            if len(nxt.inputs) != 1:
                return None, through, f"{nxt.name} reads more than one tensor"
            through.append(nxt.name)
        elif nxt.category == "relu6" and not relu6:
            return None, through, RELU6_REASON + "; pass batches= to equalize inside the clip"
        else:
            return None, through, f"{current.name} is followed by {nxt.name} ({nxt.category}), not a folded BN, ReLU or conv/linear"
        current = nxt


def _pair_refusal(plan: Plan, modules: dict[str, nn.Module], layer1: str, layer2: str, tied: set[str]) -> str:
    """Why (layer1, layer2) cannot be equalized, or ""."""
    for path in (layer1, layer2):
        if plan.call_counts.get(path, 0) != 1:
            return f"module {path} is called {plan.call_counts.get(path, 0)} times in one forward (shared)"
        if path in tied:
            return f"the weight of {path} is shared with another module"
    first, second = modules[layer1], modules[layer2]
    for path, layer in ((layer1, first), (layer2, second)):
        if not _own_weight(layer):
            return f"the weight of {path} is computed (weight norm or a parametrization), not a Parameter"
    kinds = [isinstance(m, _CONVS) and "conv" or isinstance(m, nn.Linear) and "linear" for m in (first, second)]
    if not all(kinds):
        return "only torch's Conv1d/2d/3d and Linear are rescaled"
    if kinds[0] != kinds[1]:
        return f"{layer1} is a {kinds[0]} and {layer2} a {kinds[1]}: their channel axes differ"
    out_channels, in_channels = first.weight.shape[0], _in_channels(second)
    if out_channels != in_channels:
        return f"{layer1} has {out_channels} output channels and {layer2} reads {in_channels}"
    return ""


def _own_weight(layer: nn.Module) -> bool:
    """The weight is a Parameter the module holds (not recomputed from others at each call)."""
    return isinstance(getattr(layer, "weight", None), nn.Parameter)


def _tied_weights(model: nn.Module) -> set[str]:
    """Module paths whose weight Parameter another module holds too."""
    owners: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            owners.setdefault(id(weight), []).append(path)
    return {p for paths in owners.values() if len(paths) > 1 for p in paths}


def _grouped_view(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """L2's weight as [groups, out/groups, in/groups, rest]: input channel i is [i // (in/g), :, i % (in/g)]."""
    groups = getattr(layer, "groups", 1)
    return weight.reshape(groups, weight.shape[0] // groups, weight.shape[1], -1)


def _in_channels(layer: nn.Module) -> int:
    return getattr(layer, "groups", 1) * layer.weight.shape[1]


def _output_ranges(layer: nn.Module) -> torch.Tensor:
    """r1_i = max |W1[i]| per output channel (float64)."""
    return layer.weight.detach().double().abs().reshape(layer.weight.shape[0], -1).amax(dim=1)


def _input_ranges(layer: nn.Module) -> torch.Tensor:
    """r2_i = max |W2[:, i]| per input channel (float64), groups respected."""
    return _grouped_view(layer, layer.weight.detach().double().abs()).amax(dim=(1, 3)).reshape(-1)


def _range_ratio(first: nn.Module, second: nn.Module) -> float:
    ratios = [(r.max() / r.mean()).item() for r in (_output_ranges(first), _input_ranges(second))]
    return max(ratios)


def _scale_pair(first: nn.Module, second: nn.Module, folded_bias: torch.Tensor | None,
                peak: torch.Tensor | None = None) -> float:
    """One equalization step of (L1, L2); returns the largest relative scale applied, max |s_i - 1|.
    ``peak``: through a ReLU6, the clip input's per-channel maximum on the data (updated here)."""
    r1, r2 = _output_ranges(first), _input_ranges(second)
    usable = (r1 > 0) & (r2 > 0)
    scale = torch.where(usable, torch.sqrt(r1 * r2) / torch.where(usable, r2, 1.0), torch.ones_like(r1))
    if peak is not None:  # inside the clip with headroom: peak / s <= 6 / RELU6_HEADROOM; a channel near the clip stays
        scale = torch.where(peak > _RELU6_LIMIT, torch.ones_like(scale), torch.maximum(scale, peak / _RELU6_LIMIT))
        peak.div_(scale)
    w1 = first.weight
    w1.copy_((w1.double() / scale.reshape([-1] + [1] * (w1.dim() - 1))).to(w1.dtype))
    bias = first.bias if first.bias is not None else folded_bias
    if bias is not None:
        bias.copy_((bias.double() / scale).to(bias.dtype))
    w2 = second.weight
    grouped = _grouped_view(second, w2.double())
    column = scale.reshape(grouped.shape[0], 1, grouped.shape[2], 1)
    w2.copy_((grouped * column).reshape(w2.shape).to(w2.dtype))
    return (scale - 1).abs().max().item() if scale.numel() else 0.0


def _measure_clip_inputs(model: nn.Module, modules: dict[str, nn.Module], pairs: list[_Pair], batches: Any) -> None:
    """Each ReLU6 pair's ``peak``: the per-channel maximum of the clip's input (channel axis 1 for
    a conv, the last for a linear) over ``batches``, run through the BN-folded model in eval."""
    extrema = _channel_extrema(model, modules, {p.clip_input: _channel_axis(modules[p.layer1]) for p in pairs}, batches)
    for pair in pairs:
        measured = extrema.get(pair.clip_input)
        pair.peak = measured[1] if measured is not None else torch.full(
            (modules[pair.layer1].weight.shape[0],), float("inf"), dtype=torch.float64)


def _channel_axis(layer: nn.Module) -> int:
    """The channel axis of a layer's output: 1 for a conv, the last for a linear."""
    return -1 if isinstance(layer, nn.Linear) else 1


def _channel_extrema(model: nn.Module, modules: dict[str, nn.Module], axes: dict[str, int],
                     batches: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module path -> (per-channel minimum, per-channel maximum) of its output over ``batches``
    (float64; channels along ``axes[path]``), run through ``model`` in eval; a module that never
    ran on them is absent."""
    from qdebug.engine.context import run_model

    extrema: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(path: str, axis: int):
        def hook(module, args, output):
            moved = output.detach().double().movedim(axis, 0)
            flat = moved.reshape(moved.shape[0], -1)
            low, high = flat.amin(dim=1), flat.amax(dim=1)
            if path in extrema:
                low, high = torch.minimum(extrema[path][0], low), torch.maximum(extrema[path][1], high)
            extrema[path] = (low, high)
        return hook

    handles = [modules[path].register_forward_hook(keep(path, axis)) for path, axis in axes.items()]
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            run_model(model, getattr(batch, "inputs", batch))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return extrema
