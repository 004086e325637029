"""Fake quantization and its gradient estimators.

Forward, for every estimator (q, s, z, [qmin, qmax] from the ``QuantSpec``)::

    q  = clamp(round_half_even(x * (1/s)) + z, qmin, qmax)
    x' = (q - z) * s

computed by torch's own kernels (``torch.fake_quantize_per_{tensor,channel}_affine``
and their learnable twins), so the output is bit-identical to torch's.  One
deliberate difference: torch maps NaN to ``qmin``; qdebug keeps NaN as NaN so a
NaN is never hidden behind a plausible number (nan-trace depends on it).  +-Inf
saturate to the range ends, as an integer would.

Grouped weights (``group_size``) and dynamic per-token activations run the same per-channel
kernel on a 2-d view -- [rows * groups, group_size], [tokens, channels] -- with the qparams
flattened alike (docs/engine.md, "Per-group weights and per-token activations").

Per tensor and without autograd (every eval forward), the same arithmetic runs as
a few vectorized torch ops instead (``_per_tensor_exact``): torch's CPU kernel
rounds one value at a time, ~4 ns per value, an order of magnitude slower than the
ops, and the results are the same bits (tested against torch's kernel on ties,
signed zeros, subnormals, +-Inf and huge values at every width).

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

import functools
import math

import torch

from qdebug.engine.spec import QuantSpec
from qdebug.errors import QDebugError


def _kernel(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec, axis: int,
    within_range: bool = False,
) -> torch.Tensor:
    """torch's fake-quant kernel for per-tensor or per-channel qparams (NaN: see ``_keep_nan``).

    ``within_range``: x is finite and inside the range its qparams came from, so
    the per-channel overflow guard (``_clamp_for_per_channel``) can be skipped.
    Per tensor without autograd: ``_per_tensor_exact`` (same bits, NaN kept).
    """
    if spec.per_channel:
        if not within_range:
            x = _clamp_for_per_channel(x, scale, zero_point, spec, axis)
        return torch.fake_quantize_per_channel_affine(x, scale, zero_point, axis, spec.qmin, spec.qmax)
    if _exact_path(x, scale):
        return _per_tensor_exact(x, scale, zero_point, spec)
    return torch.fake_quantize_per_tensor_affine(x, scale, zero_point, spec.qmin, spec.qmax)


def _exact_path(x: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether ``_per_tensor_exact`` may stand in for torch's kernel: float32 and no autograd
    graph to record (torch's kernel carries the backward)."""
    if x.dtype != torch.float32 or scale.numel() != 1:
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad))


def _rounded_codes(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """round_half_even(x * (1/s)) + z in float32, as torch's kernel computes it, and z as float32."""
    s = scale.detach().reshape(())
    z = zero_point.detach().reshape(()).to(torch.float32)
    # 1/s in float32, then one float32 product and nearbyint: torch's kernel, op for op.
    return torch.mul(x, torch.reciprocal(s.to(torch.float32))).round_().add_(z), z


def _per_tensor_exact(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``torch.fake_quantize_per_tensor_affine``'s values as vectorized ops, NaN kept as NaN.

    (clamp(round(x / s) + z, qmin, qmax) - z) * s, float32 throughout: every step is exact
    (integers below 2^24) except the product with 1/s and the final product with s, which
    round exactly as torch's kernel does (it forms (q - z) * s in double from float32
    operands: an exact product, rounded once to float32, like the float32 product here).
    Adding z before the clamp turns a -0 code into +0, as torch's integer codes do.
    """
    codes, z = _rounded_codes(x, scale, zero_point)
    return codes.clamp_(spec.qmin, spec.qmax).sub_(z).mul_(scale.detach().reshape(()).to(torch.float32))


def quantize_dividing(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """(clamp(round_half_even(x / s) + z, qmin, qmax) - z) s in float32, per tensor, NaN kept: ONNX
    Runtime's QuantizeLinear (MLAS divides by the scale; torch's kernel multiplies by 1/s, which
    rounds a few values per million the other way) and its DequantizeLinear."""
    s = scale.detach().reshape(()).to(torch.float32)
    z = zero_point.detach().reshape(()).to(torch.float32)
    return torch.div(x, s).round_().add_(z).clamp_(spec.qmin, spec.qmax).sub_(z).mul_(s)


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


def _keep_nan(x: torch.Tensor, out: torch.Tensor, spec: QuantSpec | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` with x's NaN put back where torch's kernel wrote ``qmin``.

    Not needed (no pass at all) after ``_per_tensor_exact``, which keeps NaN itself.
    """
    if spec is not None and scale is not None and not spec.per_channel and _exact_path(x, scale):
        return out
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
        out = _keep_nan(x, _kernel(x, scale.detach(), zero_point, spec, axis), spec, scale.detach())
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
        fq = _keep_nan(x, _kernel(x, scale, zero_point, spec, axis), spec, scale)
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
    if spec.group_size is not None:
        return _fake_quantize_grouped(x, scale, zero_point, spec, estimator=estimator, alpha=alpha, training=training,
                                      kind=kind, known_finite=known_finite, within_range=within_range)
    axis = channel_axis(spec, x.dim()) if spec.per_channel else 0
    if x.dtype != torch.float32:
        # torch's kernels compute in float32 for float32 input; keep one precision.
        return fake_quantize(
            x.float(), scale, zero_point, spec, estimator=estimator, alpha=alpha, training=training, kind=kind
        ).to(x.dtype)
    if estimator == "clipped_ste":
        out = _kernel(x, scale.detach(), zero_point, spec, axis, within_range)
        return out if known_finite else _keep_nan(x, out, spec, scale.detach())  # an observer just proved x finite
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


def group_layout(shape: torch.Size | tuple[int, ...], group_size: int) -> tuple[int, int]:
    """(rows, groups per row) of a weight of ``shape`` cut into groups of ``group_size``: a row is
    one output channel, flattened over the other dimensions (in * kh * kw, GPTQ/AWQ's layout)."""
    shape = tuple(shape)
    if len(shape) < 2:
        raise QDebugError(f"group_size={group_size} needs a weight with an input dimension, got shape {list(shape)}",
                          "drop group_size for this tensor (override it with group_size unset)")
    rows = shape[0]
    length = math.prod(shape[1:])
    if length % group_size:
        raise QDebugError(f"group_size={group_size} does not divide the weight's row of {length} "
                          f"(shape {list(shape)})", f"use a divisor of {length}, e.g. group_size = "
                                                     f"{math.gcd(length, group_size)}")
    return rows, length // group_size


@functools.lru_cache(maxsize=None)
def flat_spec(spec: QuantSpec) -> QuantSpec:
    """The per-channel (axis 0) spec that quantizes a grouped tensor viewed as [rows * groups,
    group_size], or a per-token tensor viewed as [tokens, channels]; per tensor for a
    per-tensor dynamic spec.  Same bits, range, symmetry and estimator."""
    if spec.group_size is not None:
        return spec.replace(group_size=None)
    return spec.replace(dynamic=False, per_token=False, per_channel=spec.per_token, ch_axis=0)


def grouped_view(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x`` as [rows * groups, group_size] (a view when contiguous): one group a row."""
    rows, groups = group_layout(x.shape, group_size)
    return x.reshape(rows * groups, group_size)


def _fake_quantize_grouped(x, scale, zero_point, spec, **kwargs) -> torch.Tensor:
    """Grouped weight: torch's per-channel kernel over the [rows * groups, group_size] view with
    the [rows, groups] qparams flattened alike -- torch's own arithmetic, every estimator's backward."""
    flat = grouped_view(x, spec.group_size)
    out = fake_quantize(flat, scale.reshape(-1), zero_point.reshape(-1), flat_spec(spec), **kwargs)
    return out.reshape(x.shape)


def elementwise(qparam: torch.Tensor, spec: QuantSpec, shape: torch.Size) -> torch.Tensor:
    """A weight point's scale (or zero point) broadcastable against the weight of ``shape``:
    0-d per tensor, [C, 1, ...] per channel (axis 0), each group's value repeated over its
    elements (grouped)."""
    if qparam.dim() == 0:
        return qparam
    if spec.group_size is not None:
        return qparam.repeat_interleave(spec.group_size, dim=-1).reshape(shape)
    return qparam.reshape([-1] + [1] * (len(shape) - 1))


def token_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [tokens, channels]: every row over the last dimension a token (a 0-d tensor one token)."""
    return x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)


def dynamic_qparams(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of a dynamic spec from ``x``'s own finite min/max (``qparams_from_range``):
    one pair per token ([tokens]) when per_token, else one (0-d).  Non-finite values do not
    widen the range (+-Inf saturate, NaN stays NaN)."""
    from qdebug.engine.spec import qparams_from_range

    with torch.no_grad():
        data = token_rows(x.detach().float()) if spec.per_token else x.detach().float().reshape(1, -1)
        lo, hi = torch.aminmax(data, dim=1)
        if not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
            # aminmax propagates NaN and Inf: take the range of the finite values only (0 when none).
            finite = torch.where(torch.isfinite(data), data, torch.zeros_like(data))
            lo, hi = torch.aminmax(finite, dim=1)
        scale, zero_point = qparams_from_range(lo, hi, spec)
    return (scale, zero_point) if spec.per_token else (scale.reshape(()), zero_point.reshape(()))


def fake_quantize_dynamic(x: torch.Tensor, spec: QuantSpec, **kwargs) -> torch.Tensor:
    """Dynamic fake quantization: qparams from ``x`` itself (``dynamic_qparams``, not
    differentiated: the gradient is the estimator's w.r.t. x), then torch's kernel per token
    (per-channel over the [tokens, channels] view) or per tensor."""
    if x.numel() == 0:
        return x
    scale, zero_point = dynamic_qparams(x, spec)
    if not spec.per_token:
        return fake_quantize(x, scale, zero_point, flat_spec(spec), **kwargs)
    out = fake_quantize(token_rows(x), scale, zero_point, flat_spec(spec), **kwargs)
    return out.reshape(x.shape)


def fake_quantize_counting(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec
) -> tuple[torch.Tensor, int]:
    """Per-tensor fake quantization (forward only, float32) that also counts clipped values.

    The output is ``fake_quantize``'s (``_per_tensor_exact``: torch's values, NaN kept).
    The count is of the values whose code round(x / s) + z fell outside [qmin, qmax],
    i.e. that the clamp changes -- usually settled by one min/max of the codes, counted
    only when some lie outside.  NaN is not counted; +-Inf is.
    """
    codes, z = _rounded_codes(x, scale, zero_point)
    clipped = count_outside(codes, spec.qmin, spec.qmax) if codes.numel() else 0
    out = codes.clamp_(spec.qmin, spec.qmax).sub_(z).mul_(scale.detach().reshape(()).to(torch.float32))
    return out, clipped


def _count_outside_by_torch(t: torch.Tensor, lo: float, hi: float) -> int:
    """How many values of ``t`` lie below ``lo`` or above ``hi`` (NaN is not counted, +-Inf is):
    usually settled by one min/max pass, counted only when some lie outside.  Every comparison
    is torch's, in ``t``'s dtype."""
    low, high = torch.aminmax(t)  # NaN in either: count (NaN compares false, so is not counted)
    if bool(low >= lo) and bool(high <= hi):
        return 0
    return int(torch.count_nonzero(t < lo)) + int(torch.count_nonzero(t > hi))


def count_outside(t: torch.Tensor, lo: float, hi: float) -> int:
    """``_count_outside_by_torch``'s count, by the one-pass counter ``use_outside_counter`` installed
    where it takes ``t`` (``qdebug.measure.fused`` installs its C kernel's)."""
    if _outside_counter is not None:
        count = _outside_counter(t, lo, hi)
        if count is not None:
            return count
    return _count_outside_by_torch(t, lo, hi)


_outside_counter = None


def use_outside_counter(counter) -> None:
    """Count clipped codes with ``counter(t, lo, hi) -> int | None`` (None: not a tensor it
    takes) before torch's ops.  The engine ships none: a measuring layer above installs one."""
    global _outside_counter
    _outside_counter = counter


def quantize_to_int(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Integer codes q (int64) with (q - z) * s == fake_quantize(x) exactly.

    Derived from the fake-quant output itself so the integer and fake-quant
    stages can never disagree about a code.  Grouped: codes of the weight's shape, each
    element against its group's [rows, groups] qparams.
    """
    if spec.group_size is not None:
        flat = grouped_view(x, spec.group_size)
        return quantize_to_int(flat, scale.reshape(-1), zero_point.reshape(-1), flat_spec(spec)).reshape(x.shape)
    axis = channel_axis(spec, x.dim()) if spec.per_channel else 0
    fq = _kernel(x.float(), scale, zero_point, spec, axis)
    s = _broadcast(scale, fq, axis, spec.per_channel)
    z = _broadcast(zero_point, fq, axis, spec.per_channel)
    return (torch.round(fq / s).to(torch.int64) + z.to(torch.int64)).clamp(spec.qmin, spec.qmax)
