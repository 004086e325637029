"""The conv/linear pairs the float-side fixes work on, and the BN folding they start from.

A pair is L1 (a ``Conv1d/2d/3d`` or ``Linear`` module) whose output reaches L2 (a module of the
same kind) through at most its folded BN and one ReLU (or ReLU6, when asked), every tensor on the
way read by one consumer only, found in the engine's traced plan (``qdebug.engine.plan``); both
called once in the forward, each holding its own weight Parameter, with L1's output channels equal
to L2's input channels (grouped convs: per group, ``grouped_view``).  Equalization rescales such
pairs, high-bias absorption moves constants across them.

BN folding keeps the state_dict's keys: W' = W f, b' = (b - mu) f + beta with f = gamma /
sqrt(var + eps), and the BN becomes an identity in eval (weight 1, running_mean 0, running_var
1 - eps); a conv without a bias keeps none -- its folded bias lives in the identity BN's ``bias``
(or, for a BN without affine parameters, in ``running_mean = -b'``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from qdebug.engine.modules import fold_bn
from qdebug.engine.plan import CallRecord, Plan
from qdebug.engine.prepare import is_prepared
from qdebug.errors import QDebugError

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
RELU6_REASON = "ReLU6 is not positively homogeneous (its clip at 6 would move)"
RELU6_CLIP = 6.0


@dataclass(frozen=True)
class Tap:
    """Where a value is read in the forward: the output of module ``path`` or, ``reads_input``, its
    first input."""

    path: str
    reads_input: bool = False


@dataclass
class Pair:
    layer1: str
    layer2: str
    through: list[str] = field(default_factory=list)
    ratio_before: float = float("nan")
    clip_input: Tap | None = None  # through a ReLU6: where the clip's input is read
    peak: torch.Tensor | None = None  # its per-channel maximum on the batches, as L1 is rescaled


def check_float_model(model: Any, name: str) -> None:
    """Refuse what a float-side fix cannot take: not a module, or a model prepared by qdebug."""
    if not isinstance(model, nn.Module):
        raise QDebugError(f"{name} takes a float nn.Module, not a {type(model).__name__}", "pass the float model")
    if is_prepared(model):
        raise QDebugError(f"{name} takes a float model, and this one is prepared by qdebug",
                          f"run {name} on the float model first, then prepare (or calibrate) the result")


def fold_all(plan: Plan, modules: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """Fold every Conv->BN pair of the plan (whose conv holds its weight); conv path -> the tensor
    holding its folded bias (``fold_to_identity``)."""
    return {conv: fold_to_identity(modules[conv], modules[bn]) for conv, bn in plan.pairs
            if own_weight(modules[conv])}


def fold_to_identity(conv: nn.Module, bn: nn.modules.batchnorm._BatchNorm) -> torch.Tensor:
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


def find_pairs(model: nn.Module, plan: Plan, modules: dict[str, nn.Module], relu6: bool = False):
    """The equalizable pairs, and (layer1, layer2, reason) for every other conv/linear call."""
    pairs: list[Pair] = []
    skipped: list[tuple[str, str, str]] = []
    tied = tied_weights(model)
    for rec in plan.calls.values():
        if rec.category not in ("conv", "linear") or not rec.is_module:
            continue
        layer1 = rec.name.split("#")[0]
        found, through, reason = follow(plan, rec, relu6)
        layer2 = found.name.split("#")[0] if found is not None else ""
        if found is not None:
            reason = pair_refusal(plan, modules, layer1, layer2, tied)
        if reason:
            skipped.append((rec.name, found.name if found is not None else "", reason))
        else:
            clip_input = None
            if any(plan.calls[t].category == "relu6" for t in through):
                clip_input = activation_input(plan, layer1, through)
            pairs.append(Pair(layer1, layer2, through, clip_input=clip_input))
    return pairs, skipped


def activation_input(plan: Plan, layer1: str, through: list[str]) -> Tap:
    """Where the activation's input is read on the way from L1: the activation module's own input
    when it is a module -- also when it sits inside a BN+activation module (timm's BatchNormAct2d,
    whose output is the activation's, not the BN's) and called once (one ReLU6 module applied all
    over a network, as efficientnet_lite_pytorch's ``_swish``, is hooked at every call) --, else the
    output of L1's folded BN, else of L1."""
    for name in through:
        path = name.split("#")[0]
        if (plan.calls[name].category in ("relu", "relu6") and plan.calls[name].is_module
                and plan.call_counts.get(path) == 1):
            return Tap(path, reads_input=True)
    return Tap(([t for t in through if plan.calls[t].category == "bn"] or [layer1])[0])


def folded_bn(plan: Plan, through: list[str]) -> str:
    """The folded BN on the way from L1 ("" when none)."""
    return next((t for t in through if plan.calls[t].category == "bn"), "")


def follow(plan: Plan, rec: CallRecord, relu6: bool = False) -> tuple[CallRecord | None, list[str], str]:
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


def pair_refusal(plan: Plan, modules: dict[str, nn.Module], layer1: str, layer2: str, tied: set[str]) -> str:
    """Why (layer1, layer2) cannot be equalized, or ""."""
    for path in (layer1, layer2):
        if plan.call_counts.get(path, 0) != 1:
            return f"module {path} is called {plan.call_counts.get(path, 0)} times in one forward (shared)"
        if path in tied:
            return f"the weight of {path} is shared with another module"
    first, second = modules[layer1], modules[layer2]
    for path, layer in ((layer1, first), (layer2, second)):
        if not own_weight(layer):
            return f"the weight of {path} is computed (weight norm or a parametrization), not a Parameter"
    kinds = [isinstance(m, CONVS) and "conv" or isinstance(m, nn.Linear) and "linear" for m in (first, second)]
    if not all(kinds):
        return "only torch's Conv1d/2d/3d and Linear are rescaled"
    if kinds[0] != kinds[1]:
        return f"{layer1} is a {kinds[0]} and {layer2} a {kinds[1]}: their channel axes differ"
    out_channels, reads = first.weight.shape[0], in_channels(second)
    if out_channels != reads:
        return f"{layer1} has {out_channels} output channels and {layer2} reads {reads}"
    return ""


def own_weight(layer: nn.Module) -> bool:
    """The weight is a Parameter the module holds (not recomputed from others at each call)."""
    return isinstance(getattr(layer, "weight", None), nn.Parameter)


def tied_weights(model: nn.Module) -> set[str]:
    """Module paths whose weight Parameter another module holds too."""
    owners: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            owners.setdefault(id(weight), []).append(path)
    return {p for paths in owners.values() if len(paths) > 1 for p in paths}


def grouped_view(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """L2's weight as [groups, out/groups, in/groups, rest]: input channel i is [i // (in/g), :, i % (in/g)]."""
    groups = getattr(layer, "groups", 1)
    return weight.reshape(groups, weight.shape[0] // groups, weight.shape[1], -1)


def in_channels(layer: nn.Module) -> int:
    return getattr(layer, "groups", 1) * layer.weight.shape[1]


def channel_axis(layer: nn.Module) -> int:
    """The channel axis of a layer's output: 1 for a conv, the last for a linear."""
    return -1 if isinstance(layer, nn.Linear) else 1


def bn_output_distribution(bn: nn.modules.batchnorm._BatchNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(gamma, beta) of a BN, float64: its output per channel is distributed as N(beta, gamma^2)
    under its own running statistics (gamma 1, beta 0 without affine parameters).  Read before
    folding: the folded BN is an identity."""
    channels = bn.running_mean.shape[0] if bn.running_mean is not None else bn.num_features
    gamma = bn.weight.detach().double().clone() if bn.weight is not None else torch.ones(channels, dtype=torch.float64)
    beta = bn.bias.detach().double().clone() if bn.bias is not None else torch.zeros(channels, dtype=torch.float64)
    return gamma, beta
