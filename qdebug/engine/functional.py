"""Quant points at work during a forward: the handler of a prepared model.

``QuantHandler`` is the ``ForwardContext`` handler installed by ``prepare``.  At
each named call it applies the call's activation quant point (module outputs,
inline ``x + y`` / ``torch.cat`` / ``F.relu`` / ``x.mean()`` ..., model inputs).
Passthrough ops carry the grid tag of their input forward.  In the quantized
stage, inline add/sub/mul/cat/mean/avg-pool, a scalar mul/div (folded), activation
x activation matmuls and PReLU (``qdebug.engine.prelu``) run as integer kernels
on the codes of their inputs and land directly on the
output point's grid (TFLite-style rescaling, see docs/engine.md); everything
else computes in float and is re-quantized by its point, which is what a
lookup-table kernel does.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.nn as nn

from qdebug.engine import arithmetic, integer
from qdebug.engine.context import Call, ForwardContext, Handler
from qdebug.engine.members import map_members, member_name, member_paths
from qdebug.engine.modules import _QWeighted
from qdebug.engine.ops import is_division, is_negation, map_tensors, scalar_operand, tensors_in
from qdebug.engine.prelu import QPReLU, integer_prelu
from qdebug.engine.point import QuantPoint, grid_of, on_grid, pending_of, tag, tag_pending
from qdebug.safe_text import escaped


# A rounded mean within this many float64 ulp below a half-integer is the tie (``_rescale_average``):
# the devices' computations of a mean differ by a few ulp (one to four roundings of the exact sum).
TIE_ULPS = 8
TIE_TOLERANCE = TIE_ULPS * 2.0**-52


class QuantHandler(Handler):
    def __init__(self, state: "Any") -> None:
        self.state = state  # qdebug.engine.prepare.EngineState

    # -- helpers ----------------------------------------------------------------
    def _point(self, call: Call) -> QuantPoint | None:
        point = self.state.points.get(call.name)
        if point is None and call.name not in self.state.plan.calls:
            point = self.state.discover(call)
        return point

    def _apply(self, call: Call, output: Any) -> Any:
        self.last_raw = output  # what the point received: listeners measure clipping on it
        members = self._members(call, output)
        if not members:
            return self._quantize(self._point(call), output)
        points = self.state.points
        # Each floating tensor of a structured output on its own point (``qdebug.engine.members``).
        return map_members(output, lambda path, t: self._quantize(points.get(member_name(call.name, path)), t))

    def _members(self, call: Call, output: Any) -> list[str]:
        """The member paths whose points quantize ``output``; [] for one point (the call's).

        The plan's when the call was traced -- a plan saved before outputs had members (one
        point shared by a tuple's tensors) keeps that one point until the model is prepared
        again -- and a member the trace never saw, or an untraced call's, is discovered."""
        rec = self.state.plan.calls.get(call.name)
        if rec is not None and not rec.members:
            return []
        found = member_paths(output)
        if rec is None:
            if not found:
                return []
            self.state.discover(call, found)
            rec = self.state.plan.calls.get(call.name)
            return rec.members if rec is not None else []
        if found and not set(found) <= set(rec.members):
            self.state.discover(call, found)
        return rec.members

    def _quantize(self, point: QuantPoint | None, output: Any) -> Any:
        """``output`` through one point (every floating tensor of it)."""
        if point is None or point.mode == "float":
            if point is not None and self.state.stage == "quantized":
                # Left in float inside an integer model: integer consumers project it (``on_grid``).
                map_tensors(output, lambda t: tag_pending(t, point) if torch.is_floating_point(t) else t)
            return output
        return map_tensors(output, lambda t: point.apply(t) if torch.is_floating_point(t) else t)

    def _out_target(self, call: Call) -> tuple[QuantPoint | None, str | None]:
        rec = self.state.plan.calls.get(call.name)
        if rec is None or rec.output_point is None:
            return None, None
        return self.state.points.get(rec.output_point), rec.fused_activation

    # -- events -------------------------------------------------------------------
    def on_input(self, ctx: ForwardContext, call: Call, x: torch.Tensor) -> torch.Tensor:
        return self._apply(call, x)

    def before_module(self, ctx, call, module, args):
        if isinstance(module, _QWeighted):
            point, activation = self._out_target(call)
            object.__setattr__(module, "_out_point", point if point is not None and point.mode == "fake" else None)
            object.__setattr__(module, "_fused_activation", activation)
            object.__setattr__(module, "_in_float", arithmetic.in_float(self.state, call.name))

    def on_module_output(self, ctx, call, module, args, output):
        if self.state.stage == "quantized" and call.category in ("relu", "relu6") and args:
            point = self.state.points.get(call.name)
            if point is not None and grid_of(args[0]) is point:
                # The integer kernel before already clamped onto this point's grid (fused
                # ReLU): the ReLU and its requantization are the identity on these values.
                self.last_raw = args[0]
                return args[0]
        if self.state.stage == "quantized" and isinstance(module, QPReLU) and args:
            result = integer_prelu(args[0], module, self._out_target(call)[0])
            if result is not None:
                return self._apply(call, result)
        if (self.state.stage == "quantized" and not isinstance(module, _QWeighted)
                and arithmetic.in_float(self.state, call.name)):
            result = _float_kernel(output, *self._out_target(call))
            if result is not None:
                return self._apply(call, result)
        if self.state.stage == "quantized" and call.category == "avgpool" and isinstance(output, torch.Tensor):
            out_point, activation = self._out_target(call)
            result = _integer_rescale_average(args[0], output, module, out_point)
            if result is not None:
                return self._apply(call, result)
        return self._apply(call, output)

    def on_op(self, ctx, call, func, args, kwargs):
        if self.state.stage == "quantized":
            out_point, activation = self._out_target(call)
            if out_point is not None and out_point.mode == "fake":
                if arithmetic.in_float(self.state, call.name):  # the op computed once, in float
                    output = func(*args, **kwargs)
                    result = _float_kernel(output, out_point, activation)
                    return self._apply(call, output if result is None else result)
                result = _integer_op(call.category, func, args, kwargs, out_point, activation)
                if result is not None:
                    return self._apply(call, result)
        return self._apply(call, func(*args, **kwargs))

    def on_fallback(self, ctx, call, func, args, output):
        return self._apply(call, output)

    def on_float_output(self, ctx, call, output):
        return self._apply(call, output)

    def on_passthrough(self, ctx, func, args, output):
        view = ctx.view_call if func is None else None
        if view is not None and view.name in self.state.points:
            # A view the source model re-quantizes on a grid of its own (an imported FX model's
            # observer after a Dropout): its point quantizes the output like any value call's.
            return self._apply(view, output)
        sources = [t for t in tensors_in(args) if isinstance(t, torch.Tensor)]
        if not sources:
            return output
        for t in tensors_in(output):
            if not torch.is_floating_point(t):
                continue
            # Each output tensor stays on the grid of the input it moves: an ``nn.Identity``
            # given (a, b) returns a and b on their own grids, never both on a's.
            source = _source_of(t, sources)
            if source is t:
                continue
            point = grid_of(source) if source is not None else None
            pending = pending_of(source) if source is not None and point is None else None
            if point is not None:
                tag(t, point)
            elif pending is not None:
                tag_pending(t, pending)
        return output


def _source_of(t: torch.Tensor, sources: list[torch.Tensor]) -> torch.Tensor | None:
    """The input whose values the passthrough output ``t`` holds: ``t`` itself, the tensor it
    is a view of, else the first input (a select, a pool, a view of a view); None when the
    floating inputs lie on several grids and none of them is ``t``'s own (left untagged: its
    consumers then compute in float)."""
    for s in sources:
        if t is s or (t._base is not None and (t._base is s or t._base is s._base)):
            return s
    floating = [s for s in sources if torch.is_floating_point(s)]
    grids = {id(grid_of(s) if grid_of(s) is not None else pending_of(s)) for s in floating}
    return sources[0] if len(grids) <= 1 else None


# -- integer kernels for inline ops ---------------------------------------------------
def _grid_inputs(tensors: list) -> tuple[list[torch.Tensor], list[QuantPoint]] | None:
    """The inputs on their grids (float-mode producers' outputs projected) and the grids'
    points, or None when one input has no per-tensor grid (the op then computes in float)."""
    on, points = [], []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            return None
        t, point = on_grid(t)
        if point is None or point.spec.per_channel:
            return None
        on.append(t)
        points.append(point)
    return on, points


def _left_shift_for(points: list[QuantPoint]) -> int:
    # Headroom so (q << shift) * m0 stays below 2^62 for 8- and 16-bit codes (TFLite uses 20 for int8).
    return 28 - max(p.spec.bits for p in points)


def _integer_op(category: str, func: Callable, args: tuple, kwargs: dict, out_point: QuantPoint, activation: str | None):
    if out_point.spec.per_channel:
        return None
    if category in ("add", "sub") and len(args) == 2 and not kwargs:
        grids = _grid_inputs(list(args))
        if grids is None:
            return None
        (a, b), points = grids
        if category == "add" and integer.arithmetic() == "float32":
            return tag(_float32_add(a, b, points, out_point, activation), out_point)
        shift = _left_shift_for(points)
        s_a, s_b = (p.scale.detach().double() for p in points)
        s_out = out_point.scale.detach().double()
        twice_max = 2 * torch.maximum(s_a, s_b)
        qa = integer.fixed_point_multiply(integer.codes(a, points[0]).to(torch.int64) << shift, s_a / twice_max)
        qb = integer.fixed_point_multiply(integer.codes(b, points[1]).to(torch.int64) << shift, s_b / twice_max)
        total = qa + qb if category == "add" else qa - qb
        y = integer.requantize(total, twice_max / (2**shift * s_out), out_point, activation)
        return tag(y, out_point)
    if category == "mul" and (scalar_operand(args, kwargs) is not None or is_negation(func)):
        return _integer_scalar_mul(func, args, kwargs, out_point, activation)
    if category == "mul" and len(args) == 2 and not kwargs:
        grids = _grid_inputs(list(args))
        if grids is None:
            return None
        (a, b), points = grids
        product = (integer.codes(a, points[0]) * integer.codes(b, points[1])).to(torch.int64)
        multiplier = points[0].scale.detach().double() * points[1].scale.detach().double() / out_point.scale.detach().double()
        return tag(integer.requantize(product, multiplier, out_point, activation), out_point)
    if category == "matmul" and len(args) == 2 and not kwargs:
        return _integer_matmul(func, args, out_point, activation)
    if category == "cat":
        seq = args[0] if args else kwargs.get("tensors")
        grids = _grid_inputs(list(seq)) if isinstance(seq, (list, tuple)) else None
        if grids is None:
            return None
        seq, points = grids
        s_out = out_point.scale.detach().double()
        parts = []
        for t, p in zip(seq, points):
            q = integer.fixed_point_multiply(integer.codes(t, p).to(torch.int64), p.scale.detach().double() / s_out)
            parts.append(integer.requantize_codes(q, out_point, activation))
        rest = {k: v for k, v in kwargs.items() if k != "tensors"}
        return tag(func(parts, *args[1:], **rest), out_point)
    if category in ("mean", "avgpool"):
        grids = _grid_inputs([args[0] if args else None])
        if grids is None:
            return None
        (x,), points = grids
        average = func(integer.codes(x, points[0]), *args[1:], **kwargs)  # float64: exact sum / count
        return tag(_rescale_average(average, points[0], out_point, activation, x.numel()), out_point)
    return None


def _integer_scalar_mul(func: Callable, args: tuple, kwargs: dict, out_point: QuantPoint, activation: str | None):
    """``x * c``, ``c * x``, ``x / c`` (c a Python number) and ``-x`` (c = -1) folded into the
    requantization: y = round_half_away((q_x - z_x) * sign(c) * M) + z_y, M = s_x |c| / s_y
    (``x / c``: s_x / (|c| s_y)) -- one rounding, as a deployment that folds the constant into
    the multiplier of the op before or after computes it."""
    c = -1.0 if is_negation(func) else scalar_operand(args, kwargs)
    tensor = next(a for a in args if isinstance(a, torch.Tensor))
    if is_division(func) and args[0] is not tensor:
        return None  # c / x: a reciprocal, no fold
    grids = _grid_inputs([tensor])
    if grids is None:
        return None
    (x,), (point,) = grids
    factor = 1.0 / abs(c) if is_division(func) else abs(c)
    q = integer.codes(x, point).to(torch.int64)
    if c < 0:
        q = -q
    multiplier = point.scale.detach().double() * factor / out_point.scale.detach().double()
    return tag(integer.requantize(q, multiplier, out_point, activation), out_point)


def _integer_matmul(func: Callable, args: tuple, out_point: QuantPoint, activation: str | None):
    """acc = sum (q_a - z_a)(q_b - z_b), requantized by M = s_a s_b / s_y (``integer.requantize``).

    The sum runs as a float64 matmul of the codes: every product and partial sum is an integer
    below 2^53 (16-bit codes over 2^21 terms), so it is exact in any summation order, on any
    device.  ``func`` itself computes it, so ``bmm``, ``matmul``, ``@`` and its reflected form
    keep their operand order and broadcasting."""
    grids = _grid_inputs(list(args))
    if grids is None:
        return None
    (a, b), points = grids
    acc = func(integer.codes(a, points[0]), integer.codes(b, points[1])).to(torch.int64)
    multiplier = integer.layer_multiplier(points[0].scale.detach(), points[1].scale.detach(), out_point.scale.detach())
    return tag(integer.requantize(acc, multiplier, out_point, activation), out_point)


def _float32_add(a: torch.Tensor, b: torch.Tensor, points: list[QuantPoint], out_point: QuantPoint,
                 activation: str | None) -> torch.Tensor:
    """ONNX Runtime's QLinearAdd on x86 (MLAS's AVX2 kernel): with r = s / s_y in float32 and the
    stored codes q (an asymmetric int8 tensor is stored as uint8, q + 128, as qdebug's export and
    ORT's own conversion write it), q_y = rint(fma(q_a, r_a, fma(q_b, r_b, z_y - fma(r_a, z_a, r_b z_b))))
    in float32, saturated to the stored type (tests/test_integer_arithmetic.py checks it against
    ORT's kernel, on values where a plain multiply-then-add rounds the other way)."""
    s_out = out_point.scale.detach().float()
    out_offset = _storage_offset(out_point)
    ratio_a, ratio_b = (p.scale.detach().float() / s_out for p in points)
    za, zb = (float(p.zero_point) + _storage_offset(p) for p in points)
    # z_y - (r_a z_a + r_b z_b): ORT's compiled setup contracts r_a z_a + (r_b z_b) into one fma too.
    zero_part = (ratio_a.double() * za + (ratio_b * zb).double()).float()
    fixed = torch.tensor(float(out_point.zero_point) + out_offset, dtype=torch.float32) - zero_part
    stored_a, stored_b = (integer.codes(t, p, torch.float32) + (float(p.zero_point) + _storage_offset(p))
                          for t, p in zip((a, b), points))
    # Two fused multiply-adds (AVX2's vfmadd): one rounding each, emulated exactly in float64 (a
    # product of two float32 values is exact there).
    inner = (stored_b.double() * ratio_b.double() + fixed.double()).float()
    q = torch.round((stored_a.double() * ratio_a.double() + inner.double()).float()).to(torch.int64)
    low, high = (0, 255) if out_offset else (out_point.spec.qmin, out_point.spec.qmax)
    q = q.clamp(low, high) - int(out_point.zero_point) - out_offset
    return integer.requantize_codes(q, out_point, activation)


def _float_kernel(output: Any, out_point: QuantPoint | None, activation: str | None) -> torch.Tensor | None:
    """A call the target computes in float (``qdebug.engine.arithmetic.in_float``): ``output``, the
    op's float32 result on its dequantized inputs, through the fused ReLU/ReLU6, quantized by ONNX
    Runtime's QuantizeLinear (``quantize_dividing``) onto the output point; None (the op's usual
    path) without a per-tensor output grid."""
    if out_point is None or out_point.mode != "fake" or out_point.spec.per_channel or \
            not isinstance(output, torch.Tensor) or not torch.is_floating_point(output):
        return None
    return tag(integer.quantize_float(output.float(), out_point, activation), out_point)


def _storage_offset(point: QuantPoint) -> int:
    """128 where ONNX Runtime stores the point's int8 codes as uint8 (asymmetric 8-bit signed: the
    export's and ORT's own int8 -> uint8 conversion), else 0."""
    spec = point.spec
    return 128 if spec.bits == 8 and spec.signed and not spec.symmetric else 0


def _rescale_average(average: torch.Tensor, in_point: QuantPoint, out_point: QuantPoint, activation: str | None,
                     numel: int | None = None):
    """round_half_away(mean of codes * s_in / s_out) + z_out, clamped.

    Under ONNX Runtime's arithmetic (``float32``) a global average -- one output per sample and
    channel, of ``numel`` input values in all -- is its QLinearGlobalAveragePool instead:
    round_half_even(float32(sum of codes) * (s_in / (s_out * count))) in float32.

    The mean of integer codes is a fraction, and an exact tie (sum / count = k + 1/2) is common
    when s_in = s_out.  Devices compute it differently -- the CPU's ``mean`` divides by the
    count, CUDA's multiplies by its reciprocal -- a few ulp apart, which would round a tie
    away on one and down on the other.  So a value within ``TIE_ULPS`` ulp below a half counts
    as the tie: every device gives the same integer."""
    count = numel // average.numel() if numel and average.numel() else 0
    if integer.arithmetic() == "float32" and count and _global(average, numel):
        total = torch.round(average * count)  # the integer sum of the codes: exact in float64
        scale = in_point.scale.detach().float() / (out_point.scale.detach().float() * float(count))
        q = torch.round(total.to(torch.float32) * scale).to(torch.int64)
        return integer.requantize_codes(q, out_point, activation)
    scaled = average * (in_point.scale.detach().double() / out_point.scale.detach().double())
    magnitude = scaled.abs()
    q = torch.sign(scaled) * torch.floor(magnitude + 0.5 + magnitude * TIE_TOLERANCE)
    return integer.requantize_codes(q.to(torch.int64), out_point, activation)


def _global(average: torch.Tensor, numel: int) -> bool:
    """Whether ``average`` holds one value per sample and channel (a global pool or a spatial mean)."""
    return average.dim() >= 2 and average.shape[0] * average.shape[1] == average.numel() and \
        numel % average.numel() == 0


def _integer_rescale_average(x: Any, output: torch.Tensor, module: nn.Module, out_point: QuantPoint | None):
    if out_point is None or out_point.mode != "fake" or out_point.spec.per_channel:
        return None
    grids = _grid_inputs([x])
    if grids is None:
        return None
    (x,), points = grids
    average = module.forward(integer.codes(x, points[0]))
    return tag(_rescale_average(average, points[0], out_point, None, x.numel()), out_point)


def warn_fallbacks(names: list[str]) -> None:
    if names:
        warnings.warn(
            f"qdebug: {len(names)} op(s) have no integer/quantized kernel and run in float, re-quantized at "
            f"their output: {', '.join(escaped(name) for name in names[:8])}{' ...' if len(names) > 8 else ''}",
            stacklevel=3,
        )

