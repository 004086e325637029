"""Fake quantization and its gradient estimators.

Forward, for every estimator (q, s, z, [qmin, qmax] from the ``QuantSpec``)::

    q  = clamp(round_half_even(x * (1/s)) + z, qmin, qmax)
    x' = (q - z) * s

computed by torch's own kernels (``torch.fake_quantize_per_{tensor,channel}_affine``
and their learnable twins), so the output is bit-identical to torch's.  One
deliberate difference: torch maps NaN to ``qmin``; qdebug keeps NaN as NaN so a
NaN is never hidden behind a plausible number (nan-trace depends on it).  +-Inf
saturate to the range ends, as an integer would.

Backward, selected by ``spec.estimator`` (seed 004):

- ``ste``: identity, dL/dx = g.
- ``clipped_ste``: dL/dx = g inside the clamp range, 0 outside (torch's own backward).
- ``qte``: quantized-through estimation.  dL/dx = g (fq(x + s/2) - fq(x - s/2)) / s,
  the one-step central difference of the quantizer: 1 inside, 0 outside, 1/2 at
  an edge (a threshold exactly on the window's end counts half, so values already
  on the grid get 1, not 0 or 2 by round-half-even parity); dL/ds = sum g (q - z), the
  dequantization x' = (q - z) s differentiated with the integer code held fixed.
- ``alpha_blend``: y = (1 - a) x + a fq(x) in training, dL/dx = (1 - a) g (no
  gradient through the rounding); y = fq(x) in eval.  ``a`` is set by the training loop.
- ``lsq``: learned step size.  dL/dx as clipped_ste; dL/ds = g * grad_factor *
  (round(x/s) - x/s inside, qmin - z below, qmax - z above), grad_factor =
  1/sqrt(N Qp) with Qp = qmax and N the elements per sample (activations), per
  tensor (weights), divided by the channel count when per-channel.
"""

from __future__ import annotations

import math

import torch

from qdebug.engine.spec import QuantSpec
from qdebug.errors import QDebugError


def _kernel(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec, axis: int,
    within_range: bool = False,
) -> torch.Tensor:
    """torch's fake-quant kernel for per-tensor or per-channel qparams (no NaN handling).

    ``within_range``: x is finite and inside the range its qparams came from, so
    the per-channel overflow guard (``_clamp_for_per_channel``) can be skipped.
    """
    if spec.per_channel:
        if not within_range:
            x = _clamp_for_per_channel(x, scale, zero_point, spec, axis)
        return torch.fake_quantize_per_channel_affine(x, scale, zero_point, axis, spec.qmin, spec.qmax)
    return torch.fake_quantize_per_tensor_affine(x, scale, zero_point, spec.qmin, spec.qmax)


def _clamp_for_per_channel(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec, axis: int
) -> torch.Tensor:
    """Clamp ``x`` to two codes beyond each end of the range before torch's per-channel kernels.

    Those kernels cast ``x / s`` to int64 *before* clamping, so +Inf and any
    ``|x / s|`` past 2^63 come out as ``qmin`` instead of saturating.  Two codes
    past the ends are still outside the range, so the output and the
    inside/outside masks of the backward are unchanged.  NaN stays NaN.
    """
    s = _broadcast(scale.detach(), x, axis, True)
    z = _broadcast(zero_point.detach(), x, axis, True).to(s.dtype)
    return torch.clamp(x, (spec.qmin - 2 - z) * s, (spec.qmax + 2 - z) * s)


def _keep_nan(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # A max-reduction propagates NaN: one cheap read decides whether the exact
    # (allocating) select is needed at all; most tensors have no NaN.
    if x.numel() == 0 or not torch.isnan(x.detach().amax()):
        return out
    return torch.where(torch.isnan(x), x, out)


def channel_axis(spec: QuantSpec, ndim: int) -> int:
    """``spec.ch_axis`` as a non-negative axis of an ``ndim`` tensor (torch's kernels need one)."""
    if not -ndim <= spec.ch_axis < ndim:
        raise QDebugError(
            f"per-channel axis {spec.ch_axis} does not exist in a {ndim}-d tensor",
            "set ch_axis to an axis of the tensor (0 = output channels of a weight)",
        )
    return spec.ch_axis + ndim if spec.ch_axis < 0 else spec.ch_axis


def _broadcast(v: torch.Tensor, x: torch.Tensor, axis: int, per_channel: bool) -> torch.Tensor:
    if not per_channel:
        return v
    shape = [1] * x.dim()
    shape[axis] = -1
    return v.reshape(shape)


class _NoGradFakeQuant(torch.autograd.Function):
    """Forward: torch's kernel (NaN kept).  Backward: chosen by ``mode``."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, spec, axis, mode):
        out = _keep_nan(x, _kernel(x, scale.detach(), zero_point, spec, axis))
        ctx.spec, ctx.axis, ctx.mode = spec, axis, mode
        ctx.scale_requires_grad = scale.requires_grad
        ctx.save_for_backward(x, scale, zero_point)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, scale, zero_point = ctx.saved_tensors
        spec, axis = ctx.spec, ctx.axis
        if ctx.mode == "ste":
            return grad, None, None, None, None, None
        # qte
        s = _broadcast(scale.detach(), x, axis, spec.per_channel)
        z = _broadcast(zero_point, x, axis, spec.per_channel)
        with torch.no_grad():
            # (fq(x + s/2) - fq(x - s/2)) / s in closed form: the one-step window
            # [c - 1/2, c + 1/2] around the real-valued code c holds exactly one
            # rounding threshold while qmin < c < qmax, none outside.  Evaluating
            # fq numerically would let round-half-even decide the ties -- every x
            # already on the grid (0, the output of an earlier quant point) -- and
            # give 0 or 2 there; the tie takes the mean of both sides instead
            # (1 inside, 1/2 at an edge).
            c = x * (1.0 / s) + z.to(x.dtype)
            inside = (c > spec.qmin) & (c < spec.qmax)
            edge = (c == spec.qmin) | (c == spec.qmax)
            grad_x = grad * (inside.to(grad.dtype) + 0.5 * edge.to(grad.dtype))
            grad_s = None
            if ctx.scale_requires_grad:
                fq = _kernel(x, scale.detach(), zero_point, spec, axis)
                code = torch.round(fq / s)  # q - z, exact: fq is (q - z) * s
                per_elem = grad * code
                if spec.per_channel:
                    dims = [d for d in range(x.dim()) if d != axis]
                    grad_s = per_elem.sum(dim=dims).reshape(scale.shape)
                else:
                    grad_s = per_elem.sum().reshape(scale.shape)
        return grad_x, grad_s, None, None, None, None


class _AlphaBlend(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, zero_point, spec, axis, alpha):
        fq = _keep_nan(x, _kernel(x, scale, zero_point, spec, axis))
        ctx.alpha = alpha
        if alpha >= 1.0:
            return fq
        return (1.0 - alpha) * x + alpha * fq

    @staticmethod
    def backward(ctx, grad):
        return grad * (1.0 - ctx.alpha), None, None, None, None, None


def lsq_grad_factor(x: torch.Tensor, spec: QuantSpec, kind: str) -> float:
    """1 / sqrt(N * Qp) of LSQ, N = elements per sample (activation) or per tensor (weight), per channel."""
    n = x.numel()
    if kind == "activation" and x.dim() > 1:
        n //= max(x.shape[0], 1)
    if spec.per_channel:
        n //= max(x.shape[channel_axis(spec, x.dim())], 1)
    return 1.0 / math.sqrt(max(n, 1) * max(spec.qmax, 1))


def fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    spec: QuantSpec,
    *,
    estimator: str | None = None,
    alpha: float = 1.0,
    training: bool = False,
    kind: str = "activation",
    known_finite: bool = False,
    within_range: bool = False,
) -> torch.Tensor:
    """Fake-quantize ``x`` with ``scale``/``zero_point`` (0-dim, or [C] per-channel).

    ``estimator`` defaults to ``spec.estimator``; it only changes the backward
    (and, for ``alpha_blend`` in training, the forward blend).  ``known_finite``:
    the caller has just proved x has no NaN (skips the NaN scan).  ``within_range``:
    x is finite and its qparams were derived from x's own min/max (a weight
    point), so no value can overflow the per-channel kernel's int64 cast.
    """
    estimator = estimator or spec.estimator
    axis = channel_axis(spec, x.dim()) if spec.per_channel else 0
    if x.dtype != torch.float32:
        # torch's kernels compute in float32 for float32 input; keep one precision.
        return fake_quantize(
            x.float(), scale, zero_point, spec, estimator=estimator, alpha=alpha, training=training, kind=kind
        ).to(x.dtype)
    if estimator == "clipped_ste":
        out = _kernel(x, scale.detach(), zero_point, spec, axis, within_range)
        return out if known_finite else _keep_nan(x, out)  # an observer just proved x finite
    if estimator == "ste":
        return _NoGradFakeQuant.apply(x, scale, zero_point, spec, axis, "ste")
    if estimator == "qte":
        return _NoGradFakeQuant.apply(x, scale, zero_point, spec, axis, "qte")
    if estimator == "alpha_blend":
        return _AlphaBlend.apply(x, scale.detach(), zero_point, spec, axis, float(alpha) if training else 1.0)
    if estimator == "lsq":
        factor = lsq_grad_factor(x, spec, kind)
        zp = zero_point.to(torch.float32)
        if spec.per_channel:
            out = torch._fake_quantize_learnable_per_channel_affine(
                _clamp_for_per_channel(x, scale, zp, spec, axis), scale, zp, axis, spec.qmin, spec.qmax, factor
            )
        else:
            # Per-tensor runs as one channel: torch's per-tensor learnable backward
            # truncates z + 0.5 toward zero, so a negative zero point is taken as
            # z + 1 there (wrong scale gradient and in-range mask); the per-channel
            # op rounds z in forward and backward alike.
            flat = x.reshape(1, -1)
            s1, z1 = scale.reshape(1), zp.reshape(1)
            out = torch._fake_quantize_learnable_per_channel_affine(
                _clamp_for_per_channel(flat, s1, z1, spec, 0), s1, z1, 0, spec.qmin, spec.qmax, factor
            ).reshape(x.shape)
        return _keep_nan(x, out)
    raise ValueError(f"unknown estimator {estimator!r}")


_ENABLED = torch.ones(1, dtype=torch.long)
# The kernel torch.fake_quantize_per_tensor_affine runs, with its in-range mask kept.
HAS_COUNTING_KERNEL = hasattr(torch.ops.aten, "_fake_quantize_per_tensor_affine_cachemask_tensor_qparams")


def fake_quantize_counting(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor fake quantization (forward only, float32) that also counts clipped values.

    The output is ``fake_quantize``'s (the same torch kernel, NaN kept).  The count
    is of the values whose code round(x / s) + z fell outside [qmin, qmax], i.e.
    that the clamp changed -- read from the in-range mask torch's kernel computes
    anyway, so it costs one pass over a byte mask.  NaN is not counted.
    """
    out, inside = torch.ops.aten._fake_quantize_per_tensor_affine_cachemask_tensor_qparams(
        x, scale.detach(), zero_point, _ENABLED, spec.qmin, spec.qmax
    )
    clipped = inside.numel() - torch.count_nonzero(inside)
    if x.numel() and torch.isnan(x.amax()):
        nan = torch.isnan(x)
        out = torch.where(nan, x, out)
        clipped = clipped - nan.sum()
    return out, clipped


def quantize_to_int(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Integer codes q (int64) with (q - z) * s == fake_quantize(x) exactly.

    Derived from the fake-quant output itself so the integer and fake-quant
    stages can never disagree about a code.
    """
    axis = channel_axis(spec, x.dim()) if spec.per_channel else 0
    fq = _kernel(x.float(), scale, zero_point, spec, axis)
    s = _broadcast(scale, fq, axis, spec.per_channel)
    z = _broadcast(zero_point, fq, axis, spec.per_channel)
    return (torch.round(fq / s).to(torch.int64) + z.to(torch.int64)).clamp(spec.qmin, spec.qmax)
