"""What an importer reads out of a torch.ao model: its quantizers, as plain values.

Every front end (eager, FX, PT2E, converted modules) turns the model it reads into a
``SourceModel``: the float model the engine will wrap (the user's architecture with the
source's weights) and a list of ``SourceQuantizer`` -- one per FakeQuantize, observer or
quantize/dequantize pair -- each anchored to what it quantizes *in the float model's
terms*: a weighted layer's path (its weight) or an engine call name (its output, see
``qdebug.engine.context``).  ``spec_of`` turns a quantizer's torch settings into the
engine's ``QuantSpec``; ``qdebug.interop.build`` does the rest.

torch's qparams are copied, never recomputed: torch's symmetric scale is
max|x| / ((qmax - qmin) / 2), the engine's max|x| / qmax, so an imported point is frozen
with the source's scale and zero point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from qdebug.engine.spec import MAX_BITS, MIN_BITS, QuantSpec
from qdebug.errors import QDebugError

# Status of one report row (docs/interop.md).
EXACT = "exact"  # the engine point computes what the source quantizer computes
MOVED = "moved"  # quantizes an equivalent place (after a ReLU the source quantized before)
FROZEN = "frozen"  # scale imported, but the source's way of updating it has no engine twin
UNMAPPED = "unmapped"  # nothing in the engine quantizes this (listed, never dropped silently)
FLOAT = "float"  # the engine has a quant point here that the source leaves in float
# the engine point computes something else than the source quantizer on some path (torch quantizes
# one reader's edge, the engine the output for all): the note says why, the self-check by how much
APPROXIMATE = "approximate"

# torch observer class -> engine observer name; anything else is imported frozen.
OBSERVER_NAMES = {
    "MinMaxObserver": "minmax",
    "PerChannelMinMaxObserver": "minmax",
    "MovingAverageMinMaxObserver": "ema",
    "MovingAveragePerChannelMinMaxObserver": "ema",
}


@dataclass
class SourceQuantizer:
    """One quantizer of the source model."""

    source: str  # its name in the source: module path or graph node
    kind: str  # "weight" | "activation"
    anchor: str | None  # weight: the layer's path; activation: the engine call name; None: unmapped
    scale: torch.Tensor
    zero_point: torch.Tensor
    quant_min: int
    quant_max: int
    dtype: str  # "quint8", "qint8", "qint32", ...
    qscheme: str  # "per_tensor_affine", "per_channel_symmetric", ...
    ch_axis: int = 0
    observer: str = ""  # the observer's class name
    averaging_constant: float | None = None
    fake_quant_enabled: bool = True
    note: str = ""  # why it maps the way it does (filled by front ends and the builder)
    # The passthrough module call (a Dropout) between ``anchor``'s output and this quantizer, if
    # any: where the engine re-quantizes when this grid is not the anchor's own.
    view: str | None = None
    # The engine point it maps onto by name, when no call or layer anchors it (a point inside a
    # recurrent layer: "lstm.l0.cell", "lstm.weight_ih_l0"); ``anchor`` is then the layer's path.
    point: str | None = None
    # torch's dynamic quantization: qparams from each batch's own range (scale, zero_point are
    # one batch's, for the report); the engine point is a per-tensor ``dynamic`` spec.
    dynamic: bool = False
    # A front end knows the engine point cannot compute what this quantizer does on every path
    # (torch quantizes one edge only): the row is ``approximate`` (``qdebug.interop.check``).
    approximate: bool = False
    # An observer, not a fake quant: in a QAT model torch's forward passes its values on
    # unquantized (a PTQ qconfig on one module of a QAT model); its convert quantizes with it.
    observes_only: bool = False

    @property
    def per_channel(self) -> bool:
        return "per_channel" in self.qscheme

    @property
    def symmetric_scheme(self) -> bool:
        return "symmetric" in self.qscheme


@dataclass
class SourceModel:
    """A torch.ao model read by a front end (see module docstring)."""

    flow: str  # "eager", "fx", "pt2e", "eager-converted", ...
    stage: str  # the qdebug stage it becomes: "qat", "calibrated" or "quantized"
    float_model: nn.Module  # the user's architecture holding the source's float weights
    example_inputs: Any
    quantizers: list[SourceQuantizer] = field(default_factory=list)
    bn_pairs: list[tuple[str, str]] = field(default_factory=list)  # (conv, bn) the source trains folded
    unsupported: list[tuple[str, str]] = field(default_factory=list)  # (source name, why) left float
    # (source name, why) of quantizers the source holds but never runs (torch.ao MHA's
    # mul_scalar): nothing to map, and nothing the engine computes differs.
    idle: list[tuple[str, str]] = field(default_factory=list)
    # (conv, bn) whose BN the source folded into the conv's weights before quantizing (PTQ
    # fusion): the float model holds the folded weights and an nn.Identity at the BN's path.
    folded_bn: list[tuple[str, str]] = field(default_factory=list)


def range_shape(quant_min: int, quant_max: int) -> tuple[int, bool, bool] | None:
    """(bits, signed, narrow_range) of an integer range the engine's specs express, or None.

    The engine's ranges: [-2^(b-1), 2^(b-1) - 1], its narrow twin [-(2^(b-1) - 1), 2^(b-1) - 1],
    and [0, 2^b - 1]; torch's reduce_range quint8 [0, 127] is uint7.
    """
    for bits in range(MIN_BITS, MAX_BITS + 1):
        half = 2 ** (bits - 1)
        if (quant_min, quant_max) == (-half, half - 1):
            return bits, True, False
        if (quant_min, quant_max) == (-half + 1, half - 1):
            return bits, True, True
        if (quant_min, quant_max) == (0, 2**bits - 1):
            return bits, False, False
    return None


def spec_of(q: SourceQuantizer, base: QuantSpec) -> tuple[QuantSpec | None, str]:
    """The engine spec reproducing ``q`` (``base`` gives the fields torch has no word for),
    and a note; None when the engine cannot express its integer range."""
    shape = range_shape(q.quant_min, q.quant_max)
    if shape is None:
        return None, (f"integer range [{q.quant_min}, {q.quant_max}] is not a full signed or unsigned "
                      f"range of {MIN_BITS}-{MAX_BITS} bits, nor a narrow signed one")
    bits, signed, narrow = shape
    # The engine's symmetric means zero point 0; torch's symmetric quint8 has zero point 128,
    # which the engine writes as affine -- the same grid either way.
    symmetric = q.symmetric_scheme and bool((q.zero_point == 0).all())
    notes = []
    observer = OBSERVER_NAMES.get(q.observer)
    spec = base.replace(bits=bits, signed=signed, narrow_range=narrow, symmetric=symmetric, per_channel=q.per_channel,
                        ch_axis=q.ch_axis if q.per_channel else base.ch_axis)
    if q.dynamic:
        return spec.replace(dynamic=True, observer="minmax", per_channel=False, symmetric=False), ""
    if observer is not None:
        spec = spec.replace(observer=observer)
        if observer == "ema" and q.averaging_constant is not None and 0 < q.averaging_constant <= 1:
            spec = spec.replace(averaging_constant=float(q.averaging_constant))
    elif q.observer:
        notes.append(f"{q.observer} has no engine observer: its scale is imported and frozen")
    return spec, "; ".join(notes)


def torch_qparams(module: nn.Module, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """A FakeQuantize's current (scale, zero point), or an observer's computed ones (``name``:
    the module's, for the error when its range gives none)."""
    scale = getattr(module, "scale", None)
    zero_point = getattr(module, "zero_point", None)
    if isinstance(scale, torch.Tensor) and isinstance(zero_point, torch.Tensor):
        return scale.detach().clone().float(), zero_point.detach().clone().to(torch.int32)
    try:
        scale, zero_point = module.calculate_qparams()
    except (AssertionError, RuntimeError, ValueError) as exc:  # a loaded range torch never observes: min > max
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise QDebugError(f"the observer {name or type(module).__name__} gives no scale from its range: {detail}",
                          "its min_val / max_val are damaged: save prepared.state_dict() again") from None
    return scale.detach().clone().float(), zero_point.detach().clone().to(torch.int32)


def quantizer_settings(module: nn.Module) -> dict[str, Any]:
    """The settings of a torch FakeQuantize or observer, as ``SourceQuantizer`` fields."""
    inner = getattr(module, "activation_post_process", None)
    observer = inner if isinstance(inner, nn.Module) else module
    qscheme = getattr(module, "qscheme", getattr(observer, "qscheme", torch.per_tensor_affine))
    dtype = getattr(module, "dtype", getattr(observer, "dtype", torch.quint8))
    quant_min = getattr(module, "quant_min", getattr(observer, "quant_min", None))
    quant_max = getattr(module, "quant_max", getattr(observer, "quant_max", None))
    if quant_min is None or quant_max is None:
        info = torch.iinfo(dtype)
        quant_min, quant_max = info.min, info.max
    enabled = getattr(module, "fake_quant_enabled", None)
    return {
        "quant_min": int(quant_min),
        "quant_max": int(quant_max),
        "dtype": str(dtype).replace("torch.", ""),
        "qscheme": str(qscheme).replace("torch.", ""),
        "ch_axis": int(getattr(module, "ch_axis", getattr(observer, "ch_axis", 0)) or 0),
        "observer": type(observer).__name__,
        "averaging_constant": getattr(observer, "averaging_constant", None),
        "fake_quant_enabled": bool(enabled[0]) if isinstance(enabled, torch.Tensor) and enabled.numel() else True,
    }


def read_quantizer(module: nn.Module, source: str, kind: str, anchor: str | None, note: str = "") -> SourceQuantizer:
    """A ``SourceQuantizer`` from a torch FakeQuantize/observer module."""
    scale, zero_point = torch_qparams(module, source)
    settings = quantizer_settings(module)
    if not _observed(module):
        note = "; ".join(n for n in (note, "the source never observed data: its scale is torch's initial value") if n)
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        note = "; ".join(n for n in (note, "the source's scale is not a positive finite number") if n)
    if type(module).__name__ not in ("FakeQuantize", "FusedMovingAvgObsFakeQuantize") and \
            "FakeQuantize" in type(module).__name__:
        # FixedQParamsFakeQuantize, LearnableFakeQuantize, a user's subclass: its values are
        # imported, its own way of choosing them is not.
        settings["observer"] = type(module).__name__
    observes_only = not hasattr(module, "fake_quant_enabled") and "FakeQuantize" not in type(module).__name__
    return SourceQuantizer(source, kind, anchor, scale, zero_point, note=note, observes_only=observes_only, **settings)


def _observed(module: nn.Module) -> bool:
    """Whether a torch quantizer's observer has seen data (min/max no longer +-inf or empty)."""
    inner = getattr(module, "activation_post_process", None)
    observer = inner if isinstance(inner, nn.Module) else module
    min_val = getattr(observer, "min_val", None)
    if not isinstance(min_val, torch.Tensor):
        return True  # no min/max to tell (fixed qparams, a custom observer): assume it has
    return min_val.numel() > 0 and bool(torch.isfinite(min_val).all())


def full_range(q: SourceQuantizer) -> None:
    """A PTQ observer's range as torch's convert uses it: the dtype's full range.

    An observer's quant_min/max (``reduce_range``: quint8 [0, 127]) only size its scale;
    convert quantizes with ``torch.quantize_per_tensor/channel`` and the int8 kernels write
    their outputs, all clamping to the dtype's range ([0, 255] for quint8) with that scale.
    A PTQ model has no other quantized semantics (its observers never fake-quantize).
    """
    bounds = {"quint8": (0, 255), "qint8": (-128, 127), "qint32": (-(2 ** 31), 2 ** 31 - 1)}.get(q.dtype)
    if bounds is None or (q.quant_min, q.quant_max) == bounds:
        return
    note = (f"the observer's range [{q.quant_min}, {q.quant_max}] sized the scale; torch's convert clamps to "
            f"{q.dtype}'s [{bounds[0]}, {bounds[1]}]")
    q.quant_min, q.quant_max = bounds
    q.note = f"{q.note}; {note}" if q.note else note


def layer_bn_pairs(plan: Any, model: nn.Module) -> list[tuple[str, str]]:
    """The (layer, BN) pairs torch folds: the engine plan's Conv-BN pairs, and Linear-BN pairs
    by the same rule (the BN's only input is the Linear's output, nothing else reads it, both
    called once, the BN tracks running statistics over the Linear's features).  torch fuses
    Linear + BatchNorm1d (FX ``LinearBn1d`` in QAT, folded by ``prepare_fx``/``prepare_pt2e``);
    the engine's own plan pairs convs only, so the importer adds these (``build``)."""
    pairs = [tuple(p) for p in plan.pairs]
    modules = dict(model.named_modules())
    for rec in plan.calls.values():
        if rec.category != "linear" or not rec.is_module or plan.call_counts.get(rec.name) != 1:
            continue
        if len(rec.consumers) != 1:
            continue
        bn = plan.calls.get(rec.consumers[0])
        if bn is None or bn.category != "bn" or not bn.is_module or plan.call_counts.get(bn.name) != 1 \
                or len(bn.inputs) != 1:
            continue
        linear, norm = modules.get(rec.name), modules.get(bn.name)
        if not isinstance(linear, nn.Linear) or not isinstance(norm, nn.modules.batchnorm._BatchNorm):
            continue
        if not norm.track_running_stats or norm.running_var is None or norm.num_features != linear.out_features:
            continue
        pairs.append((rec.name, bn.name))
    return pairs


# Transposed convolutions: torch's convert quantizes their weights (nnq.ConvTranspose*d), the
# engine has no kernel for them (qdebug.engine.ops: "fallback").  Every flow -- eager and FX,
# QAT and PTQ, prepared and converted -- lists the weight quantizer torch has or will build for
# one as unmapped, with this one reason (docs/interop.md).
TRANSPOSED_CONVS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def transposed_weight_note(layer: nn.Module) -> str:
    return (f"{type(layer).__name__}: no transposed-conv kernel in qdebug yet, its weight stays float "
            "(torch's convert quantizes it)")
