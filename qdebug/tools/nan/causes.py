"""Why the first non-finite value appeared: one cause per finding, each from a documented rule.

``diagnose(finding, evidence)`` tries the rules below in order and returns the first
that holds as ``Diagnosis(cause, detail, fix)`` (docs/nan_trace.md lists the same rules):

1. ``input``: the batch itself holds NaN/Inf (which samples).
2. ``bn_fold``: a conv's parameter was non-finite when the step began in whole output
   channels, and a BatchNorm was folded into that conv (fuse_bn): the fold's factor
   gamma / sqrt(running_var + eps) was NaN there (a negative variance), not training.
   ``weights``: any other parameter already non-finite when the step began (as loaded,
   or since the update of an earlier step).
3. ``scale``: a quant point's scale is NaN, Inf, <= 0 or subnormal, or its zero point
   is off its integer range (an observer's update, a learned scale driven <= 0, or as
   loaded).
4. ``bn_variance``: a BatchNorm in the failing call's module has a negative or NaN
   running_var (sqrt(var + eps) is NaN).
5. ``bn_zero_weight``: a BatchNorm has gamma = 0 channels and the failing call divides by
   its factor gamma / sqrt(var + eps), computing 0 / 0 there: an inline division in the
   BN's module, torch.ao's fused QAT Conv-BN modules (``ConvBn1d/2d/3d``,
   ``ConvBnReLU1d/2d/3d``: their default forward divides, pytorch#85744), or any module
   holding that BN as ``.bn`` whose output is non-finite in exactly those channels.
6. ``range_collapse`` (seed 000): in the steps before, an activation point clipped
   more than ``SATURATED`` of its input in most steps while the largest weight of the
   layers feeding it grew at least ``GROWTH`` times: a range far below the data's,
   compensated by ever larger weights until something overflows.
7. ``gradient_explosion``: the gradient norm grew at least ``GROWTH`` times over the
   last steps, step over step, before the value appeared: the growth per step, the
   layer whose gradient grew most, and the lr.
   ``grown_weights``: a parameter had grown past ``HUGE_WEIGHT`` before the step:
   whatever op meets such values overflows, and guarding that op would not help.  It
   needs no history, so a one-step replay says it too, with what it cannot know.
8. ``op_domain``: a forward op with a restricted domain (log, sqrt, rsqrt, div, pow,
   reciprocal, acos, ...) created the value from finite inputs outside that domain.
9. ``backward_op``: a finite forward whose backward created the value (sqrt at 0: an
   infinite derivative; for an op without a singular derivative, values too large).
10. ``overflow``: finite inputs, an output beyond the dtype's range (fp16's 65504
    under autocast, an optimizer update past float32's 3.4e38).
11. ``unknown``: none of the above holds; the finding still says where.

A fix that guards an op's input (a clamp, an eps, a mask) names the quant point its
input comes through, if any: an int8 point between the guard and the op rounds small
values back to 0 (``torch.where(y > 0, y, 100)`` quantized before ``log``).  No text
points at a repro bundle: the context manager (``nan_guard``) writes none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from qdebug.engine import engine_state, is_prepared
from qdebug.tools.nan.detect import Finding, finite

SATURATED = 0.9  # a point clipping more than this fraction of its input is saturated
GROWTH = 10.0  # weights or gradient norms growing this many times is growth, not noise
HUGE_WEIGHT = 1e10  # no trained parameter is this large: a runaway update made it
DOMAIN_OPS = {
    "log": "x > 0", "log2": "x > 0", "log10": "x > 0", "log1p": "x > -1", "sqrt": "x >= 0", "rsqrt": "x > 0",
    "div": "a divisor != 0", "truediv": "a divisor != 0", "rtruediv": "a divisor != 0", "true_divide": "a divisor != 0",
    "reciprocal": "x != 0", "pow": "a non-negative base for fractional powers", "acos": "|x| <= 1",
    "asin": "|x| <= 1", "atanh": "|x| < 1", "acosh": "x >= 1", "lgamma": "x not a non-positive integer",
    "digamma": "x not a non-positive integer",
}
DIVIDING = ("div", "truediv", "rtruediv", "true_divide", "reciprocal", "rsqrt")


@dataclass
class StepStats:
    """One step of the timeline (the steps before a finding are its history)."""

    step: int
    batch: int
    loss: float | None = None
    max_abs_weight: float | None = None
    grad_norm: float | None = None
    worst_saturation: float | None = None
    worst_point: str | None = None
    weight_max: dict[str, float] = field(default_factory=dict)  # parameter -> max |w| after the step
    grad_norms: dict[str, float] = field(default_factory=dict)  # parameter -> gradient 2-norm
    saturation: dict[str, float] = field(default_factory=dict)  # activation point -> clipped fraction

    def take_saturation(self, found: dict[str, torch.Tensor]) -> None:
        """Each point's clipped fraction this step (0-dim tensors, read at once); the worst
        named only when it clips anything."""
        if not found:
            return
        self.saturation = dict(zip(found, torch.stack(list(found.values())).tolist()))
        worst = max(self.saturation, key=self.saturation.get)
        self.worst_saturation = self.saturation[worst]
        self.worst_point = worst if self.worst_saturation > 0 else None

    def take_grad_norms(self, names: list[str], norms: list[torch.Tensor]) -> None:
        if names:
            self.grad_norms = dict(zip(names, torch.stack([n.double() for n in norms]).tolist()))
            self.grad_norm = math.sqrt(sum(v * v for v in self.grad_norms.values()))

    def take_weight_maxima(self, names: list[str], maxima: list[torch.Tensor]) -> None:
        if names:
            self.weight_max = dict(zip(names, torch.stack(list(maxima)).tolist()))
            self.max_abs_weight = max(self.weight_max.values())

    def row(self) -> dict[str, Any]:
        return {"step": self.step, "batch": self.batch, "loss": self.loss, "max_abs_weight": self.max_abs_weight,
                "grad_norm": self.grad_norm, "worst_saturation": self.worst_saturation,
                "worst_point": self.worst_point}


@dataclass
class Evidence:
    """What the rules look at besides the finding."""

    model: nn.Module  # in its state when the value appeared (BN statistics, scales)
    inputs: Any = None  # the failing batch's model inputs
    targets: Any = None  # and its targets
    history: list[StepStats] = field(default_factory=list)  # the steps before the failing one
    lr: float | None = None
    optimizer: str | None = None
    feeding: dict[str, list[str]] = field(default_factory=dict)  # activation point -> weights of its layers
    learned_scales: set[str] = field(default_factory=set)  # points whose scale is an nn.Parameter


@dataclass
class Diagnosis:
    cause: str
    detail: str
    fix: str


def evidence_for(model: nn.Module, **known: Any) -> Evidence:
    """``Evidence`` about ``model`` plus what the caller knows; for an engine model, which
    scales are learned and which weights feed each activation point."""
    ev = Evidence(model, **known)
    if is_prepared(model):
        state = engine_state(model)
        params = dict(model.named_parameters())
        ev.learned_scales = {n for n, p in state.points.items() if isinstance(p.scale, nn.Parameter)}
        for rec in state.plan.calls.values():
            weight = f"{rec.owner}.weight"
            if rec.output_point and rec.is_module and rec.category in ("conv", "linear") and weight in params:
                ev.feeding.setdefault(rec.output_point, []).append(weight)
    return ev


def diagnose(f: Finding, ev: Evidence) -> Diagnosis:
    for rule in (_nondeterministic, _input, _bn_fold, _weights, _scale_as_set, _bn_variance, _bn_zero_weight,
                 _half_overflow, _range_collapse, _gradient_explosion, _grown_weights, _scale, _op_domain,
                 _backward_op, _overflow):
        found = rule(f, ev)
        if found is not None:
            return found
    if f.layer == "loss":
        return Diagnosis("unknown", "every tensor of the model was finite, but the loss was not",
                         "check the targets (NaN/Inf, class indices out of range) and the loss function (a log of 0, "
                         "a division by a zero count)")
    # No repro bundle is named here: the context manager writes none (the CLI prints its own repro line).
    return Diagnosis("unknown", f"{f.op} {'created' if f.created else 'passed on'} the value in the {f.phase}; "
                     "no rule explains it", f"inspect {f.layer} in the failing step: the finding's inputs give the "
                     "ranges of its inputs, and its counts how many values went non-finite")


# -- the rules, in order ------------------------------------------------------------------
def _input(f: Finding, ev: Evidence) -> Diagnosis | None:
    if f.phase != "forward":
        return None
    if ev.inputs is None and ev.targets is None:  # a user's loop: the model's input call is the batch
        if f.layer != "input" or f.op != "input":
            return None
        shown = ", ".join(map(str, f.samples)) or "unknown"
        return Diagnosis("input", f"the batch's inputs hold NaN/Inf (samples {shown})",
                         "clean the data: drop those samples or replace the values (torch.nan_to_num) before the model")
    for part, values in (("inputs", ev.inputs), ("targets", ev.targets)):
        samples = _nonfinite_samples(values)
        if samples:
            shown = ", ".join(map(str, samples[:16])) + (" ..." if len(samples) > 16 else "")
            f.samples = samples[:16]
            return Diagnosis("input", f"the batch's {part} hold NaN/Inf in {len(samples)} sample(s): {shown}",
                             "clean the data: drop those samples or replace the values (torch.nan_to_num) before "
                             "the model")
    return None


def _nonfinite_samples(values: Any) -> list[int]:
    from qdebug.engine.ops import tensors_in

    bad: set[int] = set()
    for t in tensors_in(values):
        if torch.is_floating_point(t) and not finite(t):
            rows = (~torch.isfinite(t)).reshape(t.shape[0], -1).any(1) if t.dim() else torch.ones(1, dtype=torch.bool)
            bad.update(int(i) for i in rows.nonzero().reshape(-1))
    return sorted(bad)


def _bn_fold(f: Finding, ev: Evidence) -> Diagnosis | None:
    """A folded conv's weight (or bias) non-finite in whole output channels when the step began:
    the pattern a fold with a NaN factor gamma / sqrt(var + eps) leaves (W' = W f, b' = (b - mu) f
    + beta).  Restarting from the float checkpoint folds the same NaN; its BatchNorm is the root."""
    if f.what != "param" or f.phase != "forward" or not is_prepared(ev.model):
        return None
    bn = dict(engine_state(ev.model).plan.pairs).get(f.layer)
    conv = dict(ev.model.named_modules()).get(f.layer)
    if bn is None or getattr(conv, "bn_mode", None) != "fused" or f.tensor not in (f"{f.layer}.weight",
                                                                                 f"{f.layer}.bias"):
        return None
    weight = conv.weight.detach()
    rows = ~torch.isfinite(weight.reshape(weight.shape[0], -1))
    whole = rows.all(1)
    bias = conv.bias.detach() if conv.bias is not None else torch.zeros_like(whole, dtype=weight.dtype)
    stray = (rows.any(1) | ~torch.isfinite(bias)) & ~whole  # a non-finite value outside the whole channels
    if not bool(whole.any()) or bool(stray.any()):
        return None
    channels = [int(c) for c in whole.nonzero().reshape(-1)[:8]]
    return Diagnosis("bn_fold", f"{f.layer}'s weights are non-finite in whole output channel(s) {channels}, the "
                     f"mark of its folded BatchNorm {bn} (fuse_bn: W' = W gamma / sqrt(running_var + eps)): a "
                     "negative or NaN running_var (or a NaN gamma) in those channels made the fold NaN; re-preparing "
                     "the float checkpoint folds the same NaN",
                     f"fix {bn}'s statistics in the float checkpoint (qdebug inspect warns on them: "
                     "bn.reset_running_stats(), then training-mode forwards on clean data) and prepare it again "
                     "(prepare now refuses such a BatchNorm, naming it); if they are finite there, an update made "
                     "the NaN: restart from an earlier checkpoint")


def _weights(f: Finding, ev: Evidence) -> Diagnosis | None:
    if f.what != "param" or f.phase != "forward" or f.tensor.endswith("running_var"):
        return None
    # Every watched update is checked, so a parameter non-finite at a step's start came that way.
    origin = "as loaded" if not ev.history else "changed outside the watched steps"
    return Diagnosis("weights", f"parameter {f.tensor} was already non-finite when step {f.step} began ({origin})",
                     "restart from an earlier, finite checkpoint (and lower the lr if an update broke it)")


def _nondeterministic(f: Finding, ev: Evidence) -> Diagnosis | None:
    if f.reproducible:
        return None
    return Diagnosis("nondeterministic", f"the step's check saw a non-finite {f.what.replace('_', ' ')} at "
                     f"{f.layer or f.phase}, but re-running the step from its snapshot (model, optimizer, torch's, "
                     "numpy's and Python's RNG) stayed finite: something outside them changes between runs",
                     "make the data and training functions deterministic (no counters, unseeded generators or "
                     "global state), then trace again")


def _scale_as_set(f: Finding, ev: Evidence) -> Diagnosis | None:
    """A scale invalid before the step or driven there by the optimizer: the cause itself.  One an
    observer made invalid is weighed after the history (exploding values also ruin ranges)."""
    return _scale(f, ev) if f.phase != "observer" else None


def _scale(f: Finding, ev: Evidence) -> Diagnosis | None:
    if f.what != "scale":
        return None
    point = f.point or f.tensor
    value = f"{f.value:g}" if f.value is not None else "invalid"
    learned = point in ev.learned_scales
    if f.phase == "observer":
        how, fix = "its observer's update made it", (
            "fix the observer: start its range from the first batch's min/max (never from 0), or recalibrate "
            "(qdebug calibrate) and freeze the scales")
    elif f.phase == "update":
        how, fix = "the optimizer drove the learned scale there", (
            "clamp the learned scale (e.g. scale.data.clamp_(min=1e-8) after each step) or lower the lr of the "
            "scale parameters")
    else:
        how, fix = ("it was so before this step" + (" (a learned scale)" if learned else "")), (
            "recalibrate the model (qdebug calibrate) so every point gets a positive, normal scale")
    return Diagnosis("scale", f"quant point {point} has scale {value} (must be finite and >= {1.2e-38:g}, with its "
                     f"zero point in range): {how}", fix)


def _bn_modules(f: Finding, ev: Evidence, *, scope: bool) -> list[tuple[str, nn.Module]]:
    """The BatchNorms of the failing call: the called module itself or its paired BN (a QConv's
    sits beside it), and with ``scope`` every BN in the module whose forward made the call (an
    inline op's container)."""
    found: dict[int, tuple[str, nn.Module]] = {}
    modules = dict(ev.model.named_modules())
    names = {id(m): n for n, m in modules.items()}
    called = modules.get(f.layer.split("#")[0])
    for module in (called, getattr(called, "bn", None)):
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            found[id(module)] = (names.get(id(module), ""), module)
    container = (modules.get(f.owner) if f.owner else ev.model) if scope else None
    for path, module in (container.named_modules() if container is not None else []):
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            found.setdefault(id(module), (names.get(id(module), path), module))
    return list(found.values())


def _bn_variance(f: Finding, ev: Evidence) -> Diagnosis | None:
    if f.what == "param" and f.tensor.endswith("running_var"):  # found before the step ran
        candidates = [(f.layer, ev.model.get_submodule(f.layer))] if f.layer else []
    elif f.phase == "forward" and f.created:
        candidates = _bn_modules(f, ev, scope=False)
    else:
        return None
    # A NaN that this step's own forward wrote into the statistics is a consequence: only a
    # negative variance, or one that was already not finite when the step began, is a cause.
    found = _bad_channels(candidates, lambda bn: None if bn.running_var is None else (bn.running_var < 0) | (
        ~torch.isfinite(bn.running_var) if f.what == "param" else torch.zeros_like(bn.running_var, dtype=torch.bool)))
    if found is None:
        return None
    name, channels = found
    return Diagnosis("bn_variance", f"BatchNorm {name} has a negative or NaN running_var in channel(s) {channels}: "
                     "sqrt(var + eps) is NaN",
                     f"reset {name}'s running statistics (bn.reset_running_stats()) or recompute them on clean data, "
                     "then freeze them (qdebug.engine.freeze_bn_stats)")


def _zero_gamma(bn: nn.Module) -> torch.Tensor | None:
    return None if bn.weight is None else bn.weight.detach() == 0


def _bn_zero_weight(f: Finding, ev: Evidence) -> Diagnosis | None:
    if f.phase != "forward" or not f.created:
        return None
    called = dict(ev.model.named_modules()).get(f.layer.split("#")[0])
    if _torch_fused_conv_bn(called):
        found = _bad_channels([(f"{f.layer.split('#')[0]}.bn", called.bn)], _zero_gamma)
        if found is None:
            return None
        name, channels = found
        return Diagnosis("bn_zero_weight", f"{f.layer} is torch.ao's fused {type(called).__name__}, whose forward "
                         f"divides its conv output by the BN factor gamma / sqrt(var + eps) (pytorch#85744); {name}'s "
                         f"gamma is 0 in channel(s) {channels}: 0 / 0 = NaN",
                         f"switch {f.layer} to torch's exact two-pass forward, which handles gamma = 0 "
                         f"({f.layer}._enable_slow_path_for_better_numerical_stability = True, before training), or "
                         "prepare the float model with qdebug (with_bn_reverse_fold handles gamma = 0 exactly)")
    if not _dividing(f.op) and not _nonfinite_in_exactly(f, getattr(called, "bn", None)):
        return None
    found = _bad_channels(_bn_modules(f, ev, scope=True), _zero_gamma)
    if found is None:
        return None
    name, channels = found
    return Diagnosis("bn_zero_weight", f"{f.layer} divides by the BN factor gamma / sqrt(var + eps) of {name}, whose "
                     f"gamma is 0 in channel(s) {channels}: 0 / 0 = NaN",
                     f"fold {name} with qdebug's with_bn_reverse_fold (it handles gamma = 0 exactly), or divide by "
                     "torch.where(f == 0, 1, f)")


def _torch_fused_conv_bn(module: nn.Module | None) -> bool:
    """torch.ao's fused QAT Conv-BN (ConvBn1d/2d/3d, ConvBnReLU1d/2d/3d) on its default
    forward, which divides the conv output by the BN factor; its slow path does not."""
    try:
        from torch.ao.nn.intrinsic.qat.modules.conv_fused import _ConvBnNd
    except ImportError:  # pragma: no cover - a torch without torch.ao's fused QAT modules
        return False
    return isinstance(module, _ConvBnNd) and not getattr(module, "_enable_slow_path_for_better_numerical_stability",
                                                         False)


def _nonfinite_in_exactly(f: Finding, bn: nn.Module | None) -> bool:
    """The call's output is non-finite in exactly as many values as ``bn``'s gamma = 0 channels
    hold (channels on dim 1): the mark of a forward dividing by the BN factor (a zero gamma
    otherwise gives a constant channel, never NaN)."""
    if not isinstance(bn, nn.modules.batchnorm._BatchNorm) or len(f.shape) < 2 or f.shape[1] != bn.num_features:
        return False
    zero = _zero_gamma(bn)
    if zero is None or not bool(zero.any()):
        return False
    return f.nan + f.posinf + f.neginf == f.numel // bn.num_features * int(zero.sum())


def _bad_channels(bns: list[tuple[str, nn.Module]], mask_of) -> tuple[str, list[int]] | None:
    """The first BatchNorm whose per-channel ``mask_of(bn)`` holds a channel, and (up to 8 of) them."""
    for name, bn in bns:
        mask = mask_of(bn)
        if mask is not None and bool(mask.any()):
            return name, [int(i) for i in mask.nonzero().reshape(-1)[:8]]
    return None


def _half_overflow(f: Finding, ev: Evidence) -> Diagnosis | None:
    """A half-precision op overflowing is that op's range, whatever the history (autocast)."""
    if f.dtype in ("float16", "bfloat16") and f.phase == "forward" and f.created and (f.posinf or f.neginf):
        return _overflow(f, ev)
    return None


def _range_collapse(f: Finding, ev: Evidence) -> Diagnosis | None:
    history = ev.history
    if len(history) < 5:
        return None
    best = None
    for point in history[-1].saturation:
        values = [h.saturation.get(point) for h in history if h.saturation.get(point) is not None]
        if len(values) < 5:
            continue
        saturated = sum(v > SATURATED for v in values) / len(values)
        if saturated < 0.8:
            continue
        weights = ev.feeding.get(point, [])
        growth, weight = 1.0, None
        for w in weights:
            first = next((h.weight_max.get(w) for h in history if h.weight_max.get(w)), None)
            last = history[-1].weight_max.get(w)
            if first and last is not None:
                g = (last / first) if math.isfinite(last) else math.inf
                if g > growth:
                    growth, weight = g, w
        if growth >= GROWTH and (best is None or growth > best[1]):
            best = (point, growth, weight, values)
    if best is None:
        return None
    point, growth, weight, values = best
    mean = sum(values) / len(values)
    return Diagnosis(
        "range_collapse",
        f"activation point {point} clipped {mean:.0%} of its input on average over {len(values)} steps (last "
        f"{values[-1]:.0%}) while {weight}, feeding it, grew x{_fmt_growth(growth)}: the range is far below the "
        "data's and the weights grow to push through it until they overflow",
        f"fix {point}'s observer: start its range from the first batch's min/max (never from 0), recalibrate it "
        "(qdebug calibrate), or learn the scale (estimator lsq)")


def _gradient_explosion(f: Finding, ev: Evidence) -> Diagnosis | None:
    norms = [h.grad_norm for h in ev.history if h.grad_norm is not None]
    if len(norms) < 3:
        return None
    # The run of growing norms that ends at the last step.
    start = len(norms) - 1
    while start > 0 and norms[start - 1] > 0 and norms[start] > norms[start - 1]:
        start -= 1
    rising = norms[start:]
    if len(rising) < 3 or rising[0] <= 0:  # two rises in a row, at least: one is noise
        return None
    growth = (rising[-1] / rising[0]) if math.isfinite(rising[-1]) else math.inf
    if growth < GROWTH:
        return None
    per_step = growth ** (1 / (len(rising) - 1)) if math.isfinite(growth) else math.inf
    layer = _fastest_growing(ev.history[-len(rising):])
    lr = f", lr {ev.lr:g}" if ev.lr is not None else ""
    return Diagnosis(
        "gradient_explosion",
        f"the gradient norm grew x{_fmt_growth(growth)} over the last {len(rising)} steps (x{per_step:.3g} per step"
        f"{lr}){f', fastest in {layer}' if layer else ''}, until values overflowed",
        f"lower the lr ({f'e.g. {ev.lr / 10:g}' if ev.lr else 'e.g. a tenth'}) or clip gradients "
        "(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))")


def _grown_weights(f: Finding, ev: Evidence) -> Diagnosis | None:
    """A parameter past ``HUGE_WEIGHT`` before the step: the op that overflowed on it is a
    victim.  Needs no history (a one-step replay has none), and says what it cannot tell."""
    if f.phase not in ("forward", "backward") or not f.created:
        return None
    params = [(n, p.detach()) for n, p in ev.model.named_parameters() if p.is_floating_point()]
    if not params:
        return None
    maxima = torch.stack([m.float() for m in torch._foreach_norm([p for _, p in params], float("inf"))]).tolist()
    largest = max(range(len(params)), key=lambda i: maxima[i])
    name, value = params[largest][0], maxima[largest]
    if not math.isfinite(value) or value < HUGE_WEIGHT:
        return None
    first = next((h.max_abs_weight for h in ev.history if h.max_abs_weight), None)
    if first is not None:
        how = (f"the largest |w| grew from {first:.3g} to {value:.3g} over the {len(ev.history)} step(s) before (no "
               f"gradient-norm run explains it: look at the timeline's max_abs_weight and the lr"
               f"{f' {ev.lr:g}' if ev.lr is not None else ''})")
    else:
        how = ("with no step before this one in view (a one-step replay, or the first step watched), what made them "
               "grow -- an lr too high, an exploding gradient -- cannot be told here; the run that led to them can")
    return Diagnosis("grown_weights", f"{f.layer} ({f.op}) overflowed in the {f.phase} on weights no training "
                     f"should reach: {name} holds |w| = {value:.3g}; {how}",
                     "lower the lr (or clip gradients) and restart from a checkpoint from before the weights grew; "
                     f"guarding {f.op} would not help")


def _op_domain(f: Finding, ev: Evidence) -> Diagnosis | None:
    op = _base_op(f.op)
    if f.phase != "forward" or not f.created or op not in DOMAIN_OPS:
        return None
    facts = []
    for i, x in enumerate(f.inputs):
        if x.get("negative"):
            facts.append(f"input {i} has {x['negative']} negative value(s) (min {x['min']:g})")
        if x.get("zero"):
            facts.append(f"input {i} has {x['zero']} zero(s)")
        if x.get("max") is not None and op == "exp" and x["max"] > 88:
            facts.append(f"input {i} reaches {x['max']:g}")
    found = "; ".join(facts) or "its inputs are finite but outside its domain"
    return Diagnosis("op_domain", f"{op} needs {DOMAIN_OPS[op]}: {found}",
                     f"clamp that input (e.g. x.clamp_min(1e-6) before {op}, or add an eps), or keep the op in "
                     "float32 outside autocast" + _point_before(f, ev))


def _backward_op(f: Finding, ev: Evidence) -> Diagnosis | None:
    if f.phase != "backward" or not f.created or f.layer == "loss":
        return None
    op = _base_op(f.op)
    why = {"sqrt": "the derivative of sqrt, 1 / (2 sqrt(x)), is infinite at x = 0",
           "rsqrt": "the derivative of rsqrt is infinite at x = 0",
           "pow": "the derivative of a fractional power is infinite at 0",
           "log": "the derivative of log, 1 / x, is infinite at x = 0",
           "div": "the derivative of a / b, -a / b^2, overflows for b near 0",
           "truediv": "the derivative of a / b, -a / b^2, overflows for b near 0"}.get(op, "its derivative overflowed "
                                                                                     "on finite values")
    target = "the gradient of " + (f.tensor or "its input")
    if f.layer in f.hidden:  # its forward made NaN/Inf that a mask (torch.where) kept out of the output
        return Diagnosis("backward_op", f"the forward of {f.layer} ({op}) made NaN/Inf where a mask hid it from the "
                         f"output; the backward multiplies the mask's zero gradient by its derivative there "
                         f"(0 x Inf = NaN) and so created {target}",
                         f"mask the op's input, not its output: e.g. torch.{op}(torch.where(c, x, 1)) inside "
                         "torch.where(c, ..., 0)" + (_QUANTIZED_MASK.format(op=op) if is_prepared(ev.model) else ""))
    guard = SINGULAR_GUARDS.get(op)
    if guard is None:  # a derivative without a singularity (conv, linear, mul): the values were too large
        return Diagnosis("backward_op", f"the forward of {f.layer} ({op}) was finite, but its backward created "
                         f"{target}: {why}",
                         "scale the values its backward multiplies down: lower the lr or clip gradients "
                         "(torch.nn.utils.clip_grad_norm_), or run it in float32 outside autocast")
    return Diagnosis("backward_op", f"the forward of {f.layer} ({op}) was finite, but its backward created {target}: "
                     f"{why}", f"guard the op (e.g. {guard}) so its derivative stays finite" + _point_before(f, ev))


# How to keep a singular derivative finite, per op (backward_op's fix).
SINGULAR_GUARDS = {"sqrt": "torch.sqrt(x + 1e-12)", "rsqrt": "torch.rsqrt(x + 1e-12)",
                   "pow": "(x + 1e-12) ** p", "log": "torch.log(x.clamp_min(1e-12))",
                   "div": "a / b.clamp_min(1e-12) for a positive divisor", "truediv":
                   "a / b.clamp_min(1e-12) for a positive divisor"}
_QUANTIZED_MASK = ("; in this quantized model the mask gets a quant point of its own (every op's output is "
                   "quantized, a where's too), between it and {op}: it rounds small values back to 0 before {op} -- "
                   "keep that point in float (a qconfig override naming it, with activation None) or give it more "
                   "bits (qdebug inspect lists the names)")


def _point_before(f: Finding, ev: Evidence) -> str:
    """The quant point (in fake mode) on the input of ``f``'s op, as a clause for a fix that
    guards that input: the point sits between any guard before it and the op, and rounds every
    value below half its scale back to 0 (``torch.where(y > 0, y, 1)`` then ``log``)."""
    if not is_prepared(ev.model):
        return ""
    state = engine_state(ev.model)
    rec = state.plan.calls.get(f.layer)
    for producer in rec.inputs if rec is not None else []:
        source = state.plan.calls.get(producer)
        name = source.output_point if source is not None else None
        point = state.points.get(name) if name else None
        if point is None or point.mode != "fake" or not point.initialized:
            continue
        scale = float(point.scale.detach().float().max())
        return (f"; but {f.op}'s input comes through quant point {name} ({point.spec.dtype_name}, scale {scale:.3g}), "
                f"which rounds every value below {scale / 2:.3g} to 0 after any mask, clamp or eps placed before "
                f"it: keep {name} in float (qconfig override {{'{name}': {{'activation': None}}}}, or "
                f"set_mode(model, 'float', '{name}')) or give it more bits, then guard the op")
    return ""


def _overflow(f: Finding, ev: Evidence) -> Diagnosis | None:
    if not f.created or not (f.posinf or f.neginf) and f.phase != "update":
        return None
    limit = {"float16": "65504", "bfloat16": "3.4e38", "float32": "3.4e38", "float64": "1.8e308"}.get(f.dtype, "")
    where = f"{f.what.replace('_', ' ')} of {f.layer}" if f.phase != "update" else f"parameter {f.tensor}"
    half = f.dtype in ("float16", "bfloat16")
    return Diagnosis("overflow", f"finite inputs, but the {where} exceeds {f.dtype}'s range"
                     f"{f' (max {limit})' if limit else ''}",
                     ("run that op in float32 (outside torch.autocast, or x.float()) or scale its inputs down"
                      if half else "scale the inputs or weights down, or lower the lr"))


# -- helpers ------------------------------------------------------------------------------
def _base_op(op: str) -> str:
    return op.strip("_").removesuffix("_")


def _dividing(op: str) -> bool:
    return _base_op(op) in DIVIDING


def _fastest_growing(history: list[StepStats]) -> str | None:
    if len(history) < 2:
        return None
    first, last = history[0].grad_norms, history[-1].grad_norms
    best, name = 0.0, None
    for key, value in last.items():
        start = first.get(key)
        if start and start > 0:
            g = value / start if math.isfinite(value) else math.inf
            if g > best:
                best, name = g, key
    return name


def _fmt_growth(g: float) -> str:
    return "inf" if not math.isfinite(g) else f"{g:.3g}"
