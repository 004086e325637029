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
   clip on the data (m_i: the activation's input peak, no lower than beta + 6 |gamma| of a folded
   BN) with headroom h = ``RELU6_HEADROOM`` (1.5): a channel reaching 6 / h (m_i > 4)
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
from typing import Any

import torch
import torch.nn as nn

from qdebug.engine.plan import trace_plan
from qdebug.errors import QDebugError
from qdebug.fix.observe import channel_extrema
from qdebug.fix.pairs import (
    RELU6_CLIP, Pair, bn_output_distribution, channel_axis, check_float_model, find_pairs, fold_all, folded_bn,
    grouped_view,
)

COLUMNS = ["layer1", "layer2", "through", "channels", "range_ratio_before", "range_ratio_after", "applied",
           "reason"]
# Through a ReLU6, the rescaled channel's peak on the batches stays below 6 / RELU6_HEADROOM: an
# unseen input may exceed the peaks measured by this factor before the clip moves (on the demo's
# held-out batches the peaks of 6 calibration batches were exceeded; without headroom the output
# moved to 44 dB from the original, with 1.5 it stays above 120 dB).
RELU6_HEADROOM = 1.5
_RELU6_LIMIT = RELU6_CLIP / RELU6_HEADROOM
# A channel whose pre-activation is almost always below zero has a measured peak that is an
# extreme-value statistic of a few batches: new inputs exceed it by 100x and more (a random-BN
# EfficientNet-Lite0: 2300x on one channel).  Through a folded BN the peak used is no lower than
# beta + BN_SIGMAS |gamma|, the BN's own statistics of the channel.
BN_SIGMAS = 6.0


def _applied_note(pair: Pair) -> str:
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

    check_float_model(model, "equalize")
    if not isinstance(iterations, int) or iterations < 0:
        raise QDebugError(f"iterations must be a non-negative integer, got {iterations!r}", "e.g. iterations=20")
    new = copy.deepcopy(model)
    plan = trace_plan(new, example_inputs)
    modules = dict(new.named_modules())
    with torch.no_grad():
        bn_bounds = {bn: _bn_peak_bound(modules[bn]) for _, bn in plan.pairs}  # before folding
        biases = fold_all(plan, modules)
        pairs, skipped = find_pairs(new, plan, modules, relu6=batches is not None)
        clipped = [p for p in pairs if p.clip_input]
        if clipped:
            _measure_clip_inputs(new, modules, clipped, batches)
            for pair in clipped:  # a peak no lower than the BN's own statistics allow
                bound = bn_bounds.get(folded_bn(plan, pair.through))
                if bound is not None:
                    pair.peak = torch.maximum(pair.peak, bound)
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


def _output_ranges(layer: nn.Module) -> torch.Tensor:
    """r1_i = max |W1[i]| per output channel (float64)."""
    return layer.weight.detach().double().abs().reshape(layer.weight.shape[0], -1).amax(dim=1)


def _input_ranges(layer: nn.Module) -> torch.Tensor:
    """r2_i = max |W2[:, i]| per input channel (float64), groups respected."""
    return grouped_view(layer, layer.weight.detach().double().abs()).amax(dim=(1, 3)).reshape(-1)


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
    grouped = grouped_view(second, w2.double())
    column = scale.reshape(grouped.shape[0], 1, grouped.shape[2], 1)
    w2.copy_((grouped * column).reshape(w2.shape).to(w2.dtype))
    return (scale - 1).abs().max().item() if scale.numel() else 0.0


def _bn_peak_bound(bn: nn.modules.batchnorm._BatchNorm) -> torch.Tensor:
    """beta + BN_SIGMAS |gamma| per channel: the peak of the BN's output distribution N(beta, gamma^2)."""
    gamma, beta = bn_output_distribution(bn)
    return beta + BN_SIGMAS * gamma.abs()


def _measure_clip_inputs(model: nn.Module, modules: dict[str, nn.Module], pairs: list[Pair], batches: Any) -> None:
    """Each ReLU6 pair's ``peak``: the per-channel maximum of the clip's input (channel axis 1 for
    a conv, the last for a linear) over ``batches``, run through the BN-folded model in eval."""
    extrema = channel_extrema(model, modules, {p.clip_input: channel_axis(modules[p.layer1]) for p in pairs}, batches)
    for pair in pairs:
        measured = extrema.get(pair.clip_input)
        pair.peak = measured[1] if measured is not None else torch.full(
            (modules[pair.layer1].weight.shape[0],), float("inf"), dtype=torch.float64)

