"""``QuantPoint``: one place where a tensor is quantized.

A point is a layer's weight, a layer's output, an inline op's output or a model
input.  It owns its spec, its observer, its scale and zero point, and a mode:

- ``float``: pass the tensor through untouched;
- ``observe``: pass through, but feed the observer (calibration);
- ``fake``: fake-quantize with the current scale/zero point.  With
  ``observe_in_fake`` (QAT with running observers, as torch's FakeQuantize) the
  observer keeps updating and the qparams follow it.

Weight points are *dynamic* unless frozen: their qparams are recomputed from
the current weight whenever it changed (training steps bump ``_version``), so a
weight's scale always matches the weight it quantizes.  Activation points are
frozen by ``calibrate``; a ``dynamic`` activation point has no stored qparams at all
(each batch's, or token's, own min/max: calibration leaves it as it is).
Learnable-scale estimators (lsq, qte) hold the scale as an ``nn.Parameter``
initialised from the observer once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from qdebug.engine import export_mode
from qdebug.engine import arithmetic
from qdebug.engine.fake_quant import (fake_quantize, fake_quantize_counting, fake_quantize_dynamic, group_layout,
                                       grouped_view, quantize_dividing)
from qdebug.engine.observers import make_observer
from qdebug.engine.spec import QuantSpec, check_kind
from qdebug.errors import QDebugError

MODES = ("float", "observe", "fake")


class QuantPoint(nn.Module):
    """A quantization point (see module docstring)."""

    def __init__(self, name: str, kind: str, spec: QuantSpec, *, op: str = "", owner: str = "", fallback: bool = False):
        super().__init__()
        if kind not in ("weight", "activation"):
            raise ValueError(kind)
        check_kind(spec, kind, f"quant point {name!r}: ")
        self.name = name
        self.kind = kind
        self.spec = spec
        self.op = op  # what produced the tensor: "Conv2d", "add", "input", ...
        self.owner = owner  # module path owning the op
        self.fallback = fallback  # op computed in float, output re-quantized
        self.mode = "float"
        self.observe_in_fake = False
        self.frozen = kind == "activation"
        self.alpha = 1.0  # alpha_blend: weight of the fake-quantized branch
        self.observer = make_observer(spec)
        self._group_layout: tuple[int, int] | None = None  # a grouped weight's (rows, groups), once seen
        self.register_buffer("zero_point", torch.zeros((), dtype=torch.int32))
        if spec.learnable_scale:
            self.scale = nn.Parameter(torch.ones((), dtype=torch.float32))
        else:
            self.register_buffer("scale", torch.ones((), dtype=torch.float32))
        # True once scale/zero_point hold real values (calibrated, computed or loaded).
        self.register_buffer("qparams_set", torch.zeros((), dtype=torch.bool))
        self._cache_key: Any = None
        # (key, ids of scale and zero point, their versions, output) of the last eval-mode
        # weight quantization without autograd: see ``cached_weight``.
        self._fq_cache: tuple | None = None
        # Set by tools that measure saturation (compare): each eval-mode, no-grad,
        # per-tensor fake quantization then leaves in ``clipped`` how many values its
        # clamp changed (a 0-dim tensor), else None.
        self.count_clipped = False
        self.clipped: torch.Tensor | None = None

    # -- qparams ---------------------------------------------------------------
    def set_qparams(self, scale: torch.Tensor, zero_point: torch.Tensor) -> None:
        scale = scale.detach().to(torch.float32)
        zero_point = zero_point.detach().to(torch.int32)
        with torch.no_grad():
            if isinstance(self.scale, nn.Parameter):
                if self.scale.shape != scale.shape:
                    self.scale = nn.Parameter(scale.clone())
                else:
                    self.scale.copy_(scale)
            else:
                # Straight into the buffer dict: Module.__setattr__ is a measurable
                # cost when QAT sets qparams on every point every step.  A fresh
                # tensor (not copy_) so a backward holding the old one stays valid.
                self._buffers["scale"] = scale.clone()
            self._buffers["zero_point"] = zero_point.clone()
            if not self.qparams_set:
                self.qparams_set.fill_(True)

    def update_from_observer(self) -> None:
        """Take scale/zero point from the observer's current range (a grouped weight's as
        [rows, groups]: its observer sees one group a channel, see ``_observed``)."""
        scale, zero_point = self.observer.calculate_qparams()
        layout = getattr(self, "_group_layout", None)
        if self.spec.group_size is not None and layout is not None and scale.numel() == layout[0] * layout[1]:
            scale, zero_point = scale.reshape(layout), zero_point.reshape(layout)
        self.set_qparams(scale, zero_point)

    def _observed(self, tensor: torch.Tensor) -> torch.Tensor:
        """What the observer sees: a grouped weight as [rows * groups, group_size] (one group a
        channel of its per-channel observer), anything else as it is."""
        if self.spec.group_size is None:
            return tensor
        self._group_layout = group_layout(tensor.shape, self.spec.group_size)
        return grouped_view(tensor, self.spec.group_size)

    def compute_from(self, tensor: torch.Tensor) -> None:
        """Reset the observer, observe ``tensor`` alone and take its qparams (weights)."""
        tensor = self._observed(tensor)
        channels = None
        if self.spec.per_channel and -tensor.dim() <= self.spec.ch_axis < tensor.dim():
            channels = tensor.shape[self.spec.ch_axis]
        self.observer.reset(keep_channels=channels)
        self.observer(tensor.detach())
        self.update_from_observer()

    @property
    def initialized(self) -> bool:
        """Whether the point can quantize: qparams set, or dynamic (they come from each batch)."""
        return self.spec.dynamic or bool(self.qparams_set)

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scale.detach(), self.zero_point

    # -- forward -----------------------------------------------------------------
    def cached_weight(self, cache_key: Any) -> torch.Tensor | None:
        """The fake-quantized weight from the last call with this ``cache_key``, or None.

        Only in eval mode without autograd (compare, baseline and every other
        inference pass): the weight, its BN factor and the qparams are then the
        same from batch to batch, and re-quantizing them is pure cost.  Any change
        -- a new key (weight or BN versions), new or in-place-updated qparams, a
        mode change, ``forget_cached`` -- misses.  Memory: one
        fake-quantized copy of each weight.
        """
        entry = self._fq_cache
        if entry is None or cache_key is None or self.training or self.mode != "fake" or torch.is_grad_enabled():
            return None
        key, qparams, versions, out = entry
        if key != cache_key or qparams != (id(self.scale), id(self.zero_point)):
            return None
        if versions != (self.scale._version, self.zero_point._version):
            return None
        # Dynamic qparams are valid for the key they were computed for (a refresh resets it).
        derived = not (self.frozen or (self.spec.learnable_scale and self.initialized))
        return None if derived and key != self._cache_key else out

    def forget_cached(self) -> None:
        """Drop the cached qparams key and fake-quantized weight: the next call recomputes both.

        Needed only after changing a weight in a way its version counter does not
        see (``param.data = ...`` or in-place ops on ``param.data``).
        """
        self._cache_key = None
        self._fq_cache = None

    def _can_count(self, x: torch.Tensor) -> bool:
        """The counting kernel gives this call's exact output: an eval forward without autograd
        of a float32 activation, per tensor (every estimator's eval forward is plain fake quant)."""
        if self.kind != "activation" or self.training or torch.is_grad_enabled() or self.spec.dynamic:
            return False
        return not self.spec.per_channel and x.dtype == torch.float32

    def _remember_weight(self, cache_key: Any, out: torch.Tensor) -> None:
        if cache_key is not None and not self.training and not torch.is_grad_enabled():
            self._fq_cache = (cache_key, (id(self.scale), id(self.zero_point)),
                              (self.scale._version, self.zero_point._version), out)
        else:
            self._fq_cache = None

    def apply(self, x: torch.Tensor, cache_key: Any = None) -> torch.Tensor:
        """Quantize ``x`` according to the mode (the point's forward)."""
        if self.clipped is not None:  # not through nn.Module.__setattr__ on every call of every forward
            self.clipped = None
        if self.mode == "float" or not torch.is_floating_point(x):
            return x
        if self.mode == "observe":
            if not self.spec.dynamic:  # a dynamic point has nothing to calibrate
                self.observer(self._observed(x))
            return x
        if export_mode.active is not None:  # an exporter's trace: an exportable op (qdebug.engine.export_mode)
            return export_mode.active.apply(self, x)
        if self.spec.dynamic:
            out = fake_quantize_dynamic(x, self.spec, alpha=self.alpha, training=self.training, kind=self.kind)
            out._qdebug_point = self
            return out
        observed = within_range = False
        if self.kind == "weight" and not self.frozen and not (self.spec.learnable_scale and self.initialized):
            if self.training or cache_key is None or cache_key != self._cache_key or not self.initialized:
                self.observer.last_batch_finite = False
                self.compute_from(x)
                self._cache_key = cache_key
                observed = True
                # The range is this very tensor's own min/max: every value is inside it.
                within_range = self.spec.observer in ("minmax", "ema")
        elif self.observe_in_fake and self.training:
            self.observer.last_batch_finite = False
            self.observer(x)
            observed = True
            if self.spec.learnable_scale and self.initialized:
                pass  # a learned scale is the optimizer's, not the observer's
            else:
                self.update_from_observer()
        if not self.initialized:
            raise QDebugError(
                f"quant point {self.name!r} has no scale yet",
                "calibrate the model (qdebug.engine.calibrate) before fake quantization",
            )
        if self.kind == "activation" and not self.spec.per_channel and arithmetic.current() == "float32":
            # A quantized stage computing as ONNX Runtime does: its QuantizeLinear divides.
            out = quantize_dividing(x, self.scale, self.zero_point, self.spec)
            out._qdebug_point = self
            return out
        if self.count_clipped and self._can_count(x):
            out, self.clipped = fake_quantize_counting(x, self.scale, self.zero_point, self.spec)
            out._qdebug_point = self
            return out
        known_finite = observed and bool(getattr(self.observer, "last_batch_finite", False))
        out = fake_quantize(
            x, self.scale, self.zero_point, self.spec, alpha=self.alpha, training=self.training, kind=self.kind,
            known_finite=known_finite, within_range=within_range and known_finite,
        )
        out._qdebug_point = self  # lets integer kernels find the grid a tensor lies on
        if self.kind == "weight":
            self._remember_weight(cache_key, out)
        return out

    forward = apply

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` fake-quantized onto this point's grid whatever the mode, tagged with it.

        What a quantize op at the border of a partially quantized model does: in the
        quantized stage, an integer kernel fed by a point left in ``float`` mode first
        projects its input onto that point's grid (see ``on_grid``).
        """
        if self.spec.dynamic:
            out = fake_quantize_dynamic(x.detach(), self.spec, kind=self.kind)
        else:
            out = fake_quantize(x.detach(), self.scale.detach(), self.zero_point, self.spec, kind=self.kind)
        out._qdebug_point = self
        return out

    def freeze(self, frozen: bool = True) -> None:
        self.frozen = frozen

    def extra_repr(self) -> str:
        return f"{self.name!r}, {self.kind}, {self.spec.describe()}, mode={self.mode}"

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        self._check_saved(state_dict, prefix)
        # Per-channel qparams have a shape only known after observing: adopt the saved one.
        for key in ("scale", "zero_point"):
            saved = state_dict.get(prefix + key)
            current = getattr(self, key)
            if saved is not None and saved.shape != current.shape:
                if isinstance(current, nn.Parameter):
                    setattr(self, key, nn.Parameter(torch.empty_like(saved, dtype=current.dtype)))
                else:
                    setattr(self, key, torch.empty_like(saved, dtype=current.dtype))
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _check_saved(self, state_dict, prefix: str) -> None:
        """Refuse saved qparams this point could not have written (one QDebugError naming the
        point): ``qparams_set`` one value; the scale 0-dim per tensor (also per channel while
        unset) or one value per channel; the zero point shaped like the scale, inside [qmin,
        qmax] (0 when symmetric).  Scale values are not judged here: a training step may set
        any (nan-trace restores such states).  A file's keys and dtypes are checked before, its
        scales' signs and a per-channel scale's length against its weight after
        (``qdebug.checkpoint``)."""
        saved = {k: state_dict[prefix + k] for k in ("scale", "zero_point", "qparams_set") if prefix + k in state_dict}
        hint = "the file is damaged or not from qdebug.save: re-save it"
        for key, value in saved.items():
            if not isinstance(value, torch.Tensor):
                raise QDebugError(f"quant point {self.name!r}: saved {key} is a {type(value).__name__}, not a tensor",
                                  hint)
        flag = saved.get("qparams_set")
        if flag is not None and flag.dim() != 0:
            raise QDebugError(f"quant point {self.name!r}: saved qparams_set has shape {list(flag.shape)}, "
                              "not one value", hint)
        scale = saved.get("scale")
        if scale is not None and self.spec.group_size is not None:
            if scale.dim() not in (0, 2):  # 0-d: never computed
                raise QDebugError(f"quant point {self.name!r}: saved scale has shape {list(scale.shape)}; a "
                                  "grouped scale has shape [rows, groups]", hint)
        elif scale is not None:
            if scale.dim() > 1 or (scale.dim() == 1 and not self.spec.per_channel):
                raise QDebugError(
                    f"quant point {self.name!r}: saved scale has shape {list(scale.shape)}; a "
                    f"{'per-channel' if self.spec.per_channel else 'per-tensor'} scale has shape "
                    f"{'[channels]' if self.spec.per_channel else '[] (one value)'}", hint)
        zero_point = saved.get("zero_point")
        if zero_point is not None:
            if scale is not None and zero_point.shape != scale.shape:
                raise QDebugError(f"quant point {self.name!r}: saved zero_point has shape "
                                  f"{list(zero_point.shape)} but its scale {list(scale.shape)}", hint)
            if zero_point.dim() > (2 if self.spec.group_size is not None else 1):
                raise QDebugError(f"quant point {self.name!r}: saved zero_point has shape "
                                  f"{list(zero_point.shape)}", hint)
            if zero_point.numel():
                low, high = int(zero_point.min()), int(zero_point.max())
                qmin, qmax = self.spec.qmin, self.spec.qmax
                if low < qmin or high > qmax:
                    bad = low if low < qmin else high
                    raise QDebugError(f"quant point {self.name!r}: saved zero point {bad} is outside "
                                      f"[{qmin}, {qmax}] of its {self.spec.describe()} spec", hint)
                if self.spec.symmetric and (low, high) != (0, 0):
                    raise QDebugError(f"quant point {self.name!r}: saved zero point {low or high} is not 0, "
                                      f"as its symmetric spec ({self.spec.describe()}) requires", hint)


def grid_of(x: torch.Tensor) -> QuantPoint | None:
    """The point whose grid ``x`` lies on (set by ``QuantPoint.apply`` and passthrough ops)."""
    return getattr(x, "_qdebug_point", None)


def tag_pending(x: torch.Tensor, point: QuantPoint) -> torch.Tensor:
    """Mark a float ``x`` as the output of ``point`` left in float mode (quantized stage)."""
    if isinstance(x, torch.Tensor):
        x._qdebug_pending = point
    return x


def pending_of(x: torch.Tensor) -> QuantPoint | None:
    return getattr(x, "_qdebug_pending", None)


def on_grid(x: torch.Tensor) -> tuple[torch.Tensor, QuantPoint | None]:
    """(x on its grid, the grid's point): ``x`` itself when it lies on a grid, its projection
    when it is a float-mode point's output (``tag_pending``), else (x, None)."""
    point = grid_of(x)
    if point is not None:
        return x, point
    pending = pending_of(x)
    if pending is None or not pending.initialized:
        return x, None
    return pending.project(x), pending


def tag(x: torch.Tensor, point: QuantPoint | None) -> torch.Tensor:
    if point is not None and isinstance(x, torch.Tensor):
        x._qdebug_point = point
    return x
