"""High-bias absorption (Nagel et al. 2019, "Data-Free Quantization Through Weight Equalization
and Bias Correction", sec. 4.1; AIMET's "high bias fold"), on a float model.

``absorb_high_bias(model, batches)`` works on a deep copy of a float model, after folding its BNs
as ``qdebug.fix.equalize`` does (same pairs, same state_dict keys):

1. Pairs: L1 -> [its folded BN] -> ReLU (or ReLU6) -> L2, found by ``qdebug.fix.pairs.find_pairs`` (equalization's).
2. Per channel i of the ReLU's input z_i (L1's pre-activation), the minimum m_i and maximum M_i
   over every position of every batch, and c_i = m_i - margin (M_i - m_i), ``margin`` (0.3) of
   the channel's range below its minimum: the minimum of a few batches is a sample minimum that
   unseen inputs undercut; the margin keeps the absorption exact on them too (measured in
   docs/fix.md), for a slightly smaller c_i.  Where c_i > 0 the ReLU never clips channel i, so
   relu(z_i - c_i) = relu(z_i) - c_i there: lowering L1's bias by c_i shifts the activation by
   -c_i, and L2 gets it back through its bias, b1_i -= c_i, b2_o += sum_{i,k} W2[o, i, k] c_i
   (the sum over the kernel positions k of a conv; over a grouped conv's own group of inputs).
   The activation channel then starts near 0 instead of m_i: its range, and the per-tensor int8
   grid it shares with the other channels when it is the widest, shrink by c_i.
3. ReLU6: relu6(z - c) = relu6(z) - c only while z <= 6 (past it the clip sits at 6, not 6 - c),
   so a ReLU6 channel is absorbed only where M_i + margin (M_i - m_i) <= 6 too; a channel
   reaching the clip keeps its bias.  Like equalize's ReLU6 scales, this is exact on the batches
   and an assumption about inputs that push the channel higher.
4. Exactness needs every activation L2 reads to be shifted by c: a conv L2 padding with zeros
   reads zeros, not -c, at the image's border, so its output would change there.  Such pairs are
   skipped with that reason (reflect/replicate/circular padding copies the shifted values: exact;
   Linear layers and unpadded convs: exact).
5. Where L1 has no bias, or L2 none (nor a folded BN holding one), there is no tensor to hold the
   offset without adding a parameter: skipped with that reason.

Data-free variant (``batches=None``, AIMET's): c_i = max(0, beta_i - 3 |gamma_i|) from L1's BN
before folding -- the BN's output taken as N(beta, gamma^2), three sigmas above zero.  It needs a
BN (else skipped), takes ReLU pairs only (ReLU6 needs the measured maximum), and is an assumption,
not exact: a channel that does go below beta - 3|gamma| is clipped differently.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from qdebug.engine.plan import Plan, trace_plan
from qdebug.errors import QDebugError
from qdebug.fix.observe import channel_extrema
from qdebug.fix.pairs import (
    CONVS, RELU6_CLIP, activation_input, bn_output_distribution, channel_axis, check_float_model, find_pairs, fold_all,
    folded_bn, grouped_view,
)

COLUMNS = ["layer1", "layer2", "through", "channels_absorbed", "absorbed_max", "range_before", "range_after",
           "applied", "reason"]
SIGMAS = 3.0  # the data-free variant's c_i = beta_i - SIGMAS |gamma_i| (AIMET's)
MARGIN = 0.3  # c_i sits this fraction of the channel's measured range below its minimum (docs/fix.md)


def absorb_high_bias(model: nn.Module, batches: Any, *, example_inputs: Any = None, margin: float = MARGIN):
    """High-bias absorption of a float model (module docstring).  Returns ``(new_model, report)``:
    ``new_model`` a deep copy of ``model`` (same class, module tree and state_dict keys, BNs folded,
    eval output unchanged on ``batches`` within float rounding), ``report`` a DataFrame with
    ``COLUMNS``, one row per conv/linear considered.  ``batches``: inputs (each a tensor, tuple of
    args or dict of kwargs) on which the pre-activations' minima are measured; None for the
    data-free variant.  ``example_inputs``: for tracing; default the first batch.  ``margin``: the
    fraction of each channel's measured range (max - min) kept below its minimum (module docstring)."""
    import pandas as pd

    check_float_model(model, "absorb_high_bias")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < float("inf"):
        raise QDebugError(f"margin must be a non-negative number, got {margin!r}", f"e.g. margin={MARGIN}")
    batches = _reiterable(batches)
    if example_inputs is None:
        if batches is None:
            raise QDebugError("absorb_high_bias needs batches or example_inputs to trace the model",
                              "pass the calibration batches (or example_inputs= for the data-free variant)")
        first = next(iter(batches), None)
        if first is None:
            raise QDebugError("absorb_high_bias got no batches",
                              "pass at least one batch, or batches=None for the data-free variant")
        example_inputs = getattr(first, "inputs", first)
    new = copy.deepcopy(model)
    plan = trace_plan(new, example_inputs)
    modules = dict(new.named_modules())
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        bn_statistics = {bn: bn_output_distribution(modules[bn]) for _, bn in plan.pairs}  # before folding
        biases = fold_all(plan, modules)
        pairs, skipped = find_pairs(new, plan, modules, relu6=True)
        candidates = []
        for pair in pairs:
            activation = _activation(plan, pair.through)
            source = activation_input(plan, pair.layer1, pair.through)
            bn = folded_bn(plan, pair.through)
            reason = _refusal(plan, modules, biases, pair.layer1, pair.layer2, bn, activation, batches is None)
            row = {"layer1": pair.layer1, "layer2": pair.layer2, "through": " > ".join(pair.through),
                   "applied": False, "reason": reason}
            rows.append(row)
            if not reason:
                candidates.append((row, source, bn, activation))
        extrema = {} if batches is None else channel_extrema(
            new, modules, {source: channel_axis(modules[row["layer1"]]) for row, source, _, _ in candidates}, batches)
        for row, source, bn, activation in candidates:
            if batches is None:
                absorbed, note = _data_free_offsets(*bn_statistics[bn]), "data-free: c = beta - 3|gamma|"
            elif source not in extrema:
                row["reason"] = f"{source.path} did not run on the batches"
                continue
            else:
                absorbed, note = _measured_offsets(row, *extrema[source], float(margin),
                                                   clip=RELU6_CLIP if activation == "relu6" else None)
            count = int((absorbed > 0).sum())
            row.update(channels_absorbed=count, absorbed_max=absorbed.max().item() if absorbed.numel() else 0.0)
            if not count:
                where = "on the batches (margin included)" if batches is not None else "by 3 sigmas"
                row["reason"] = _joined(f"no channel's pre-activation stays above 0 {where}", note)
                continue
            if not _adds_its_response(modules[row["layer2"]], absorbed):
                row["reason"] = (f"{row['layer2']} does not add W2 c at every position of a constant input (it pads "
                                 "inside its own forward, as TF-style SAME convs do): not exact at the border")
                continue
            first, second = (_bias_holder(plan, modules, biases, row[side]) for side in ("layer1", "layer2"))
            _absorb(first, second, modules[row["layer2"]], absorbed)
            row.update(applied=True, reason=note)
    rows += [{"layer1": layer1, "layer2": layer2, "through": "", "applied": False, "reason": reason}
             for layer1, layer2, reason in skipped]
    report = pd.DataFrame(rows, columns=COLUMNS)
    report["channels_absorbed"] = report["channels_absorbed"].astype("Int64")  # <NA> where not measured
    for column in ("absorbed_max", "range_before", "range_after"):
        report[column] = report[column].astype(float)
    return new, report


def _reiterable(batches: Any) -> Any:
    """``batches`` as something iterated twice (the first batch traces, all are measured)."""
    if batches is None:
        return None
    try:
        iterator = iter(batches)
    except TypeError:
        raise QDebugError(f"batches must be an iterable of model inputs, not a {type(batches).__name__}",
                          "pass a list of batches (tensors, tuples of args or dicts of kwargs)") from None
    return list(iterator) if iterator is batches else batches


def _activation(plan: Plan, through: list[str]) -> str:
    """"relu", "relu6", or "" when nothing but a BN lies between the pair."""
    return next((plan.calls[t].category for t in through if plan.calls[t].category in ("relu", "relu6")), "")


def _refusal(plan: Plan, modules: dict[str, nn.Module], biases: dict[str, torch.Tensor], layer1: str, layer2: str,
             bn: str, activation: str, data_free: bool) -> str:
    """Why (layer1, layer2) cannot absorb a bias, or "".  ``bn``: L1's folded BN ("" when none)."""
    if not activation:
        return "no ReLU between them: absorption moves what a ReLU never clips"
    if data_free and activation == "relu6":
        return "ReLU6 needs the data's maximum (relu6(z - c) = relu6(z) - c only below the clip): pass batches"
    if data_free and not bn:
        return f"{layer1} has no folded BN: the data-free variant needs its statistics (pass batches)"
    if _bias_holder(plan, modules, biases, layer1) is None:
        return f"{layer1} has no bias (nor a folded BN) to lower"
    if _bias_holder(plan, modules, biases, layer2) is None:
        return f"{layer2} has no bias (nor a folded BN) to hold W2 c"
    second = modules[layer2]
    if isinstance(second, CONVS) and second.padding_mode == "zeros" and _padded(second):
        return f"{layer2} pads with zeros: at the border it reads 0, not the shifted activation (not exact)"
    return ""


def _padded(conv: nn.Module) -> bool:
    if isinstance(conv.padding, str):  # "valid", or "same": dilation (k - 1) in total
        return conv.padding == "same" and any(k > 1 for k in conv.kernel_size)
    return any(p != 0 for p in conv.padding)


def _data_free_offsets(gamma: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    return (beta - SIGMAS * gamma.abs()).clamp(min=0)


def _measured_offsets(row: dict[str, Any], low: torch.Tensor, high: torch.Tensor, margin: float,
                      clip: float | None) -> tuple[torch.Tensor, str]:
    """c_i = the trusted interval's lower end, low_i - margin (high_i - low_i), where it is > 0
    (and, under a ReLU6, its upper end high_i + margin (high_i - low_i) <= the clip); fills the
    row's activation ranges before and after.  Returns (c, note)."""
    spread = margin * (high - low)
    lower, upper = low - spread, high + spread
    usable = torch.isfinite(lower) & torch.isfinite(upper) & (lower > 0)
    held = usable & (upper > clip) if clip is not None else torch.zeros_like(usable)
    absorbed = torch.where(usable & ~held, lower, torch.zeros_like(lower))
    row["range_before"] = _activation_peak(high, clip)
    row["range_after"] = _activation_peak(high - absorbed, clip)
    count = int(held.sum())
    return absorbed, (f"ReLU6: {count} channel(s) reach the clip (within the margin) on the data and keep their bias"
                      if count else "")


def _activation_peak(high: torch.Tensor, clip: float | None) -> float:
    """The per-tensor grid's width after the activation: max_i act(max z_i) (the grid includes 0)."""
    if not high.numel():
        return 0.0
    return high.clamp(min=0, max=clip).max().item()


def _bias_holder(plan: Plan, modules: dict[str, nn.Module], biases: dict[str, torch.Tensor],
                 path: str) -> tuple[torch.Tensor, float] | None:
    """The tensor holding ``path``'s (folded) bias and its sign: +1 for a bias, -1 for an identity
    BN's running_mean (which holds -b); None where there is none."""
    layer = modules[path]
    if layer.bias is not None:
        return layer.bias, 1.0
    held = biases.get(path)
    if held is None:
        return None
    bn = modules[dict(plan.pairs)[path]]
    return held, (-1.0 if held is bn.running_mean else 1.0)


def _absorb(first: tuple[torch.Tensor, float], second: tuple[torch.Tensor, float], layer2: nn.Module,
            absorbed: torch.Tensor) -> None:
    """b1 -= c, b2 += W2 c (float64, written in each holder's dtype)."""
    (bias1, sign1), (bias2, sign2) = first, second
    bias1.copy_((bias1.double() - sign1 * absorbed).to(bias1.dtype))
    bias2.copy_((bias2.double() + sign2 * _response(layer2, absorbed)).to(bias2.dtype))


def _response(layer: nn.Module, constant: torch.Tensor) -> torch.Tensor:
    """L2's output change for an input that is ``constant[i]`` on channel i everywhere: W2 c for a
    linear, sum_{i in o's group, k} W2[o, i, k] c_i for a conv (no zero padding)."""
    weight = layer.weight.detach().double()
    if isinstance(layer, nn.Linear):
        return weight @ constant
    grouped = grouped_view(layer, weight).sum(dim=3)  # [groups, out/groups, in/groups]
    return (grouped * constant.reshape(grouped.shape[0], 1, grouped.shape[2])).sum(dim=2).reshape(-1)


def _adds_its_response(layer: nn.Module, constant: torch.Tensor) -> bool:
    """Whether ``layer`` maps an input of ``constant[i]`` on channel i to its zero-input output plus
    ``_response`` at EVERY position, checked by running it (a conv whose own forward pads -- a
    ZeroPad2d child, ``padding=0`` -- reads zeros at the border, which its attributes do not say)."""
    if isinstance(layer, nn.Linear):
        return True
    size = [2 * k + 5 for k in layer.kernel_size]  # border and interior positions, whatever the stride
    param = layer.weight
    shifted = constant.to(param.dtype).reshape(1, -1, *[1] * len(size)).expand(1, constant.numel(), *size)
    change = (layer(shifted) - layer(torch.zeros_like(shifted))).double()
    expected = _response(layer, constant).reshape(1, -1, *[1] * len(size))
    scale = expected.abs().max().item() + 1e-12
    return bool(((change - expected).abs().max() <= 1e-4 * scale).item())


def _joined(*parts: str) -> str:
    return "; ".join(p for p in parts if p)
