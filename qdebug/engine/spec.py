"""What to quantize and how: ``QuantSpec`` (one tensor) and ``QConfig`` (a model).

Both are plain, immutable values that round-trip through a dict of JSON/TOML
types, so a checkpoint or a ``qdebug.toml`` can carry them.  ``qparams_from_range``
turns an observed range into a scale and zero point; every observer ends there,
so the range rules (0 always inside the range, the symmetric divisor) live in one
place and are documented in docs/engine.md.
"""

from __future__ import annotations

import dataclasses
import math
import fnmatch
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import torch

from qdebug.errors import QDebugError, shown
from qdebug.vocab import OBSERVERS  # one list, shared with the command line

ESTIMATORS = ("ste", "clipped_ste", "qte", "alpha_blend", "lsq")
# Estimators whose scale is an ``nn.Parameter`` trained by the optimizer.
LEARNABLE_SCALE_ESTIMATORS = ("qte", "lsq")
MIN_BITS, MAX_BITS = 2, 16
# The smallest scale we hand out: torch's observers use the same floor, so a
# constant-zero tensor gets a tiny but valid scale instead of 0 (division by 0).
SCALE_EPS = float(torch.finfo(torch.float32).eps)
# Histogram observers keep channels x bins int64 counts: 2^16 bins is 32x the default and
# a per-channel histogram of 1024 channels at 512 MB; more is a file asking for memory.
MAX_BINS = 1 << 16
# A group is part of one weight row: 2^24 elements is past any layer's row (and bounds a file's value).
MAX_GROUP_SIZE = 1 << 24


def _names(keys: Any) -> str:
    """Keys from a file, sorted and joined for a message (one that is no string, shown as such)."""
    return ", ".join(k if isinstance(k, str) else shown(k) for k in sorted(keys, key=str))


def _is_number(value: Any) -> bool:
    """An int or float, as TOML and JSON write numbers: a bool, a string ("0.5") or a table
    is not one (``float()`` would take the string silently and fail on the rest)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor is quantized.

    bits: 2..16.  signed: integer range [-2^(b-1), 2^(b-1)-1], else [0, 2^b-1].
    narrow_range: drop the lowest code of a signed range, [-(2^(b-1)-1), 2^(b-1)-1], so a
    symmetric grid is the same on both sides (TFLite's and XNNPACK's int8 weights, torch's
    quant_min=-127).
    symmetric: zero point 0 and scale = max|x| / qmax; else affine with a zero point.
    per_channel: one scale per slice along ``ch_axis``.
    observer: how the range is estimated (minmax, ema, percentile, mse, kl).
    estimator: the gradient used in training (ste, clipped_ste, qte, alpha_blend, lsq).
    averaging_constant: EMA weight of a new batch.  percentile: for ``percentile``.
    bins: histogram size of the histogram observers (percentile, mse, kl).
    group_size: weights only, the LLM-style W4 g128 scheme: each output channel's row (the
    weight as [out, in * kh * kw], flattened as GPTQ/AWQ do) is cut into groups of
    ``group_size`` consecutive elements, each with its own scale (and zero point when
    affine); needs per_channel = true with ch_axis = 0, and the row length a multiple of it.
    dynamic: activations only, qparams from each batch's own min/max at run time (no
    calibration, nothing frozen, as torch's dynamic quantization).  per_token (needs
    dynamic): each token -- each row over the last dimension, a (b, t) row of [B, T, C] --
    gets its own.
    """

    bits: int = 8
    signed: bool = True
    symmetric: bool = True
    per_channel: bool = False
    ch_axis: int = 0
    observer: str = "minmax"
    estimator: str = "clipped_ste"
    averaging_constant: float = 0.01
    percentile: float = 99.99
    bins: int = 2048
    narrow_range: bool = False
    group_size: int | None = None
    dynamic: bool = False
    per_token: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not MIN_BITS <= self.bits <= MAX_BITS:
            raise QDebugError(f"bits={shown(self.bits)} is not supported", f"use an integer from {MIN_BITS} to {MAX_BITS}")
        for name in ("signed", "symmetric", "per_channel", "narrow_range"):
            if not isinstance(getattr(self, name), bool):
                raise QDebugError(f"{name}={shown(getattr(self, name))} must be true or false", "write true or false")
        if self.narrow_range and not self.signed:
            raise QDebugError("narrow_range needs a signed range", "set signed = true, or narrow_range = false")
        if self.observer not in OBSERVERS:
            raise QDebugError(f"unknown observer {shown(self.observer)}", f"choose one of {', '.join(OBSERVERS)}")
        if self.estimator not in ESTIMATORS:
            raise QDebugError(f"unknown estimator {shown(self.estimator)}", f"choose one of {', '.join(ESTIMATORS)}")
        if isinstance(self.ch_axis, bool) or not isinstance(self.ch_axis, int) or not -64 <= self.ch_axis < 64:
            # Bounded (no weight has 64 dimensions): a file's axis of 10^30 is refused here, not
            # carried to the per-channel lookups and messages that use it as it is.
            raise QDebugError(f"ch_axis={shown(self.ch_axis)} must be an integer axis",
                              "e.g. ch_axis = 0 (the output channels of a weight)")
        if not _is_number(self.averaging_constant) or not 0.0 < self.averaging_constant <= 1.0:
            raise QDebugError(f"averaging_constant={shown(self.averaging_constant)} must be a number in (0, 1]",
                              "e.g. averaging_constant = 0.01")
        if not _is_number(self.percentile) or not 50.0 < self.percentile <= 100.0:
            raise QDebugError(f"percentile={shown(self.percentile)} must be a number in (50, 100]",
                              "e.g. percentile = 99.99")
        if isinstance(self.bins, bool) or not isinstance(self.bins, int) or not 16 <= self.bins <= MAX_BINS:
            # The cap: a histogram holds channels x bins int64 counts, and a file names bins.
            raise QDebugError(f"bins={shown(self.bins)} must be an integer in [16, {MAX_BINS}]", "e.g. bins = 2048")
        self._check_group()
        self._check_dynamic()

    def _check_group(self) -> None:
        if self.group_size is None:
            return
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) \
                or not 1 <= self.group_size <= MAX_GROUP_SIZE:
            raise QDebugError(f"group_size={shown(self.group_size)} must be a positive integer "
                              f"(at most {MAX_GROUP_SIZE})", "e.g. group_size = 128")
        if not self.per_channel or self.ch_axis != 0:
            # Groups cut each output channel's row: they refine per-channel along axis 0.
            raise QDebugError(f"group_size={self.group_size} needs per_channel = true with ch_axis = 0",
                              "groups split each output channel's row: set per_channel = true, ch_axis = 0")

    def _check_dynamic(self) -> None:
        for name in ("dynamic", "per_token"):
            if not isinstance(getattr(self, name), bool):
                raise QDebugError(f"{name}={shown(getattr(self, name))} must be true or false", "write true or false")
        if self.per_token and not self.dynamic:
            raise QDebugError("per_token needs dynamic = true",
                              "a token's scale comes from its own values at run time: set dynamic = true")
        if not self.dynamic:
            return
        if self.per_channel or self.group_size is not None:
            raise QDebugError("dynamic takes per_channel = false and no group_size",
                              "per token: per_token = true; per channel and groups are for weights")
        if self.observer != "minmax":
            raise QDebugError(f"dynamic quantization uses each batch's own min/max, not the {self.observer} observer",
                              'set observer = "minmax"')
        if self.learnable_scale:
            raise QDebugError(f"dynamic quantization has no scale for the {self.estimator} estimator to learn",
                              'use estimator = "ste" or "clipped_ste"')

    @property
    def qmin(self) -> int:
        if not self.signed:
            return 0
        return -(2 ** (self.bits - 1)) + (1 if self.narrow_range else 0)

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.signed else 2**self.bits - 1

    @property
    def learnable_scale(self) -> bool:
        return self.estimator in LEARNABLE_SCALE_ESTIMATORS

    @property
    def dtype_name(self) -> str:
        """Short human name, e.g. ``int8``, ``uint16``."""
        return f"{'int' if self.signed else 'uint'}{self.bits}"

    def describe(self) -> str:
        """e.g. ``int8 sym per-channel(0) minmax``; ``int8[-127] ...`` when narrow; ``int4 sym
        group(128) minmax``; ``int8 affine dynamic per-token minmax``."""
        gran = f"per-channel({self.ch_axis})" if self.per_channel else "per-tensor"
        if self.group_size is not None:
            gran = f"group({self.group_size})"
        elif self.dynamic:
            gran = "dynamic per-token" if self.per_token else "dynamic per-tensor"
        name = f"{self.dtype_name}[{self.qmin}]" if self.narrow_range else self.dtype_name
        return f"{name} {'sym' if self.symmetric else 'affine'} {gran} {self.observer}"

    def to_dict(self) -> dict[str, Any]:
        """Every field, except the LLM-style ones at their defaults: TOML has no null for an
        unset ``group_size``, and files written before they existed stay as they were."""
        out = dataclasses.asdict(self)
        for name, default in (("group_size", None), ("dynamic", False), ("per_token", False)):
            if out[name] == default:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "QuantSpec":
        if data is not None and not isinstance(data, Mapping):
            raise QDebugError(f"a quant spec must be a table of settings, got {shown(data)}",
                              'e.g. {bits = 8, observer = "ema"}')
        return _refined(cls(), data or {})

    def replace(self, **changes: Any) -> "QuantSpec":
        valid = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - valid)
        if unknown:
            raise QDebugError(
                f"unknown quant spec key(s): {', '.join(unknown)}", f"valid keys: {', '.join(sorted(valid))}"
            )
        return dataclasses.replace(self, **changes)


def _refined(spec: QuantSpec, table: Mapping[Any, Any]) -> QuantSpec:
    """``spec`` with the settings of ``table`` (from a file: its keys are checked before they
    become keyword arguments, which must be strings)."""
    odd = [k for k in table if not isinstance(k, str)]
    if odd:
        raise QDebugError(f"unknown quant spec key(s): {_names(odd)}",
                          f"valid keys: {', '.join(sorted(f.name for f in fields(QuantSpec)))}")
    return spec.replace(**table)


def check_kind(spec: QuantSpec | Mapping[str, Any], kind: str, where: str = "") -> None:
    """Refuse a spec (or a file's table of settings, checked before it is refined, so that
    this is the error it gets) its kind of tensor cannot take: groups are for weights,
    dynamic (per-token) quantization for activations.  ``where``: e.g. "override 'fc' "."""
    get = spec.get if isinstance(spec, Mapping) else (lambda key: getattr(spec, key))
    if kind == "weight" and (get("dynamic") or get("per_token")):
        key = "dynamic" if get("dynamic") else "per_token"
        raise QDebugError(
            f"{where}weight spec sets {key} = true; dynamic (per-token) quantization is for activations",
            "weights are quantized from their own values already: drop dynamic/per_token")
    if kind == "activation" and get("group_size") is not None:
        raise QDebugError(f"{where}activation spec sets group_size = {shown(get('group_size'))}; groups are for weights",
                          "for activations use dynamic = true, per_token = true")


def _refined_kind(spec: QuantSpec, table: Mapping[Any, Any], kind: str, where: str = "") -> QuantSpec:
    """``_refined`` for a ``kind`` point: the kind's rules checked on the table first, then on the result."""
    check_kind(table, kind, where)
    refined = _refined(spec, table)
    check_kind(refined, kind, where)
    return refined


def default_weight_spec() -> QuantSpec:
    """int8 symmetric per-channel (output channels), min/max of the weight."""
    return QuantSpec(per_channel=True, ch_axis=0)


def default_activation_spec() -> QuantSpec:
    """int8 affine per-tensor with a zero point, min/max: the TFLite int8 scheme."""
    return QuantSpec(signed=True, symmetric=False)


_OVERRIDE_KINDS = ("weight", "activation")


@dataclass(frozen=True)
class QConfig:
    """Specs for a whole model: defaults plus overrides by module-name glob.

    ``overrides`` maps a glob (matched against the owning module's path, e.g.
    ``backbone.*``, and against the quant point's own name) to
    ``{"weight": {...}, "activation": {...}}``; each value is a partial
    ``QuantSpec`` dict, or ``None`` to keep that kind in float.  Matching globs
    cascade in order: each refines the spec left by the ones before it (a later
    dict after a ``None`` starts again from the default).
    """

    weight: QuantSpec = field(default_factory=default_weight_spec)
    activation: QuantSpec = field(default_factory=default_activation_spec)
    overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.weight, QuantSpec) or not isinstance(self.activation, QuantSpec):
            raise QDebugError("QConfig weight/activation must be QuantSpec objects",
                              "build them with QuantSpec(...) or QuantSpec.from_dict({...})")
        check_kind(self.weight, "weight")
        check_kind(self.activation, "activation")
        if not isinstance(self.overrides, Mapping):
            raise QDebugError("QConfig overrides must be a table mapping module globs to settings",
                              'e.g. overrides = {"layer1.*" = {activation = {bits = 16}}}')
        for glob, entry in self.overrides.items():
            if not isinstance(glob, str):
                raise QDebugError(f"override key {shown(glob)} must be a module glob (a string)",
                                  'e.g. overrides = {"layer1.*" = {activation = {bits = 16}}}')
            if not isinstance(entry, Mapping):
                raise QDebugError(f"override {glob!r} must be a table of weight/activation settings",
                                  'e.g. overrides = {"layer1.*" = {activation = {bits = 16}}}')
            unknown = set(entry) - set(_OVERRIDE_KINDS)
            if unknown:
                raise QDebugError(
                    f"override {glob!r} has unknown key(s) {_names(unknown)}", "use 'weight' and/or 'activation'"
                )
            for kind in _OVERRIDE_KINDS:
                if entry.get(kind) is not None and not isinstance(entry[kind], Mapping):
                    raise QDebugError(
                        f"override {glob!r} {kind} must be a table of quant spec settings, got {shown(entry[kind])}",
                        "use a table of QuantSpec keys such as {bits = 4}",
                    )
                if entry.get(kind) is not None:
                    # Validate eagerly: a typo must fail at load, not mid-run.
                    _refined_kind(getattr(self, kind), entry[kind], kind, f"override {glob!r} ")

    def spec_for(self, kind: str, names: tuple[str, ...]) -> QuantSpec | None:
        """The spec of a ``kind`` quant point known by ``names``; None means float."""
        spec: QuantSpec | None = getattr(self, kind)
        for glob in self.matching_globs(names):
            entry = self.overrides[glob]
            if kind not in entry:
                continue
            if entry[kind] is None:
                spec = None
            else:
                # Cascade: a later glob refines what earlier ones set (from the default after a None).
                spec = _refined(spec or getattr(self, kind), entry[kind])
        return spec

    def matching_globs(self, names: tuple[str, ...]) -> list[str]:
        return [g for g in self.overrides if any(fnmatch.fnmatchcase(n, g) for n in names if n is not None)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "weight": self.weight.to_dict(),
            "activation": self.activation.to_dict(),
            "overrides": {
                g: {k: (None if v is None else dict(v)) for k, v in e.items()} for g, e in self.overrides.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "QConfig":
        if data is not None and not isinstance(data, Mapping):
            raise QDebugError(f"a qconfig must be a table of settings, got {shown(data)}",
                              'e.g. {weight = {bits = 8}, activation = {observer = "ema"}}')
        data = dict(data or {})
        for key in ("weight", "activation", "overrides"):
            if data.get(key) is not None and not isinstance(data[key], Mapping):
                raise QDebugError(f"qconfig {key} must be a table of settings, got {shown(data[key])}",
                                  "e.g. weight = {bits = 8, per_channel = true}")
        unknown = set(data) - {"weight", "activation", "overrides"}
        if unknown:
            raise QDebugError(
                f"unknown qconfig key(s): {_names(unknown)}", "valid keys: weight, activation, overrides"
            )
        return cls(
            weight=_refined_kind(default_weight_spec(), data.get("weight") or {}, "weight"),
            activation=_refined_kind(default_activation_spec(), data.get("activation") or {}, "activation"),
            overrides={
                g: (dict(e) if isinstance(e, Mapping) else e) for g, e in dict(data.get("overrides") or {}).items()
            },
        )


def qparams_from_range(
    min_val: torch.Tensor, max_val: torch.Tensor, spec: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (float32) and zero point (int32) covering [min_val, max_val].

    The range is first widened to contain 0 (so 0 is exactly representable,
    which padding and ReLU rely on).  Symmetric: z = 0, s = max|x| / qmax
    (unsigned symmetric: s = max / qmax, negatives saturate at 0).  Affine:
    s = (max - min) / (qmax - qmin), z = qmin - round_half_even(min / s), clamped
    into [qmin, qmax].  s is floored at float32 eps so a constant tensor still
    quantizes.  Non-finite bounds (an observer that saw no finite value) give
    s = 1, z = 0 -- callers report such points as uninitialised.
    """
    min_val = torch.as_tensor(min_val, dtype=torch.float32)
    max_val = torch.as_tensor(max_val, dtype=torch.float32)
    # QAT recomputes qparams every step: skip the masking ops in the usual all-finite
    # case (max - min is finite only when both are; an overflow takes the masked path).
    all_finite = math.isfinite(float((max_val - min_val).sum()))
    if not all_finite:
        finite = torch.isfinite(min_val) & torch.isfinite(max_val)
        min_val = torch.where(finite, min_val, torch.zeros_like(min_val))
        max_val = torch.where(finite, max_val, torch.zeros_like(max_val))
    lo = torch.clamp(min_val, max=0.0)
    hi = torch.clamp(max_val, min=0.0)
    qmin, qmax = spec.qmin, spec.qmax
    if spec.symmetric:
        amax = torch.maximum(-lo, hi) if spec.signed else hi
        scale = amax / float(qmax)
        zero_point = torch.zeros_like(scale, dtype=torch.int32)
    else:
        scale = (hi - lo) / float(qmax - qmin)
        scale = torch.clamp(scale, min=SCALE_EPS)
        zero_point = (qmin - torch.round(lo / scale)).clamp(qmin, qmax).to(torch.int32)
    scale = torch.clamp(scale, min=SCALE_EPS)
    if not all_finite:
        scale = torch.where(finite, scale, torch.ones_like(scale))
        zero_point = torch.where(finite, zero_point, torch.zeros_like(zero_point))
    return scale.to(torch.float32), zero_point.to(torch.int32)
