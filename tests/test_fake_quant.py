"""Forward of qdebug.engine.fake_quant against torch's kernels and hand values.

The forward of every estimator must be bit-identical to
``torch.fake_quantize_per_{tensor,channel}_affine`` with the same scale and
zero point, for every supported bit width and scheme.  Deliberate differences
(NaN kept; +-Inf and huge values saturating on the per-channel path too) are
asserted explicitly.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from qdebug.engine.fake_quant import channel_axis, fake_quantize, quantize_to_int
from qdebug.engine.spec import QuantSpec

ESTIMATORS = ("ste", "clipped_ste", "qte", "alpha_blend", "lsq")
# (per_channel, ch_axis) for a 3-D tensor; -1 is the last axis.
GRANULARITIES = ((False, 0), (True, 0), (True, 1), (True, -1))
SHAPE = (3, 4, 5)


def _qparams(spec: QuantSpec, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Arbitrary scale(s) and zero point(s) valid for ``spec`` (not derived from qdebug)."""
    scale = (torch.rand(n, generator=gen) * 0.9 + 0.1) * 2.0 ** torch.randint(-6, 3, (n,), generator=gen)
    if spec.symmetric:
        zp = torch.zeros(n, dtype=torch.int32)
    else:
        zp = torch.randint(spec.qmin, spec.qmax + 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    if not spec.per_channel:
        return scale[0].clone(), zp[0].clone()
    return scale, zp


def _data(spec: QuantSpec, scale: torch.Tensor, zp: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Data spanning the whole code range and 30% beyond each end, plus exact ties and zeros."""
    axis = channel_axis(spec, len(SHAPE)) if spec.per_channel else 0
    shape = [1] * len(SHAPE)
    if spec.per_channel:
        shape[axis] = -1
    s = scale.reshape(shape)
    z = zp.reshape(shape).float()
    lo, hi = (spec.qmin - z) * s, (spec.qmax - z) * s
    u = torch.rand(SHAPE, generator=gen) * 1.6 - 0.3
    x = lo + u * (hi - lo)
    x = x.flatten().clone()
    x[:4] = 0.0
    x = x.reshape(SHAPE)
    # Exact half-way points (ties) to pin down round-half-even.
    ties = ((torch.randint(-6, 6, SHAPE, generator=gen).float() + 0.5) * s).expand(SHAPE)
    return torch.where(torch.rand(SHAPE, generator=gen) < 0.2, ties, x)


def _torch_ref(x, scale, zp, spec):
    if spec.per_channel:
        axis = spec.ch_axis % x.dim()
        return torch.fake_quantize_per_channel_affine(x, scale, zp, axis, spec.qmin, spec.qmax)
    return torch.fake_quantize_per_tensor_affine(x, scale, zp, spec.qmin, spec.qmax)


def _all_specs():
    for bits, signed, symmetric, (per_channel, ch_axis) in itertools.product(
        range(2, 17), (True, False), (True, False), GRANULARITIES
    ):
        yield QuantSpec(bits=bits, signed=signed, symmetric=symmetric, per_channel=per_channel, ch_axis=ch_axis)


def test_bit_identical_to_torch_kernel_every_width_scheme_and_estimator():
    gen = torch.Generator().manual_seed(1234)
    checked = 0
    for spec in _all_specs():
        n = SHAPE[channel_axis(spec, len(SHAPE))] if spec.per_channel else 1
        scale, zp = _qparams(spec, n, gen)
        x = _data(spec, scale, zp, gen)
        ref = _torch_ref(x, scale, zp, spec)
        runs = [(e, {}) for e in ESTIMATORS] + [
            ("alpha_blend", {"training": True, "alpha": 1.0}),
            ("lsq", {"kind": "weight"}),
        ]
        for estimator, kw in runs:
            out = fake_quantize(x, scale, zp, spec, estimator=estimator, **kw)
            assert out.dtype == torch.float32 and out.shape == x.shape
            assert torch.equal(out, ref), (spec, estimator, kw, (out - ref).abs().max())
            checked += 1
        # The learnable-scale estimators with a Parameter scale (as a module holds it) too.
        for estimator in ("qte", "lsq"):
            p = torch.nn.Parameter(scale.clone())
            out = fake_quantize(x, p, zp, spec, estimator=estimator, training=True)
            assert torch.equal(out.detach(), ref), (spec, estimator)
        # The estimator taken from the spec itself.
        for estimator in ESTIMATORS:
            out = fake_quantize(x, scale, zp, spec.replace(estimator=estimator))
            assert torch.equal(out, ref), (spec, estimator)
        # Every output lies on the grid (q - z) * s with q in [qmin, qmax].
        shape = [1] * x.dim()
        if spec.per_channel:
            shape[channel_axis(spec, x.dim())] = -1
        codes = torch.round(ref / scale.reshape(shape)) + zp.reshape(shape)
        assert codes.min() >= spec.qmin and codes.max() <= spec.qmax
    assert checked == 15 * 2 * 2 * 4 * 7


def test_hand_values_int8_affine():
    # s = 0.5, z = 1, int8: q = clamp(round_half_even(x / 0.5) + 1, -128, 127); x' = (q - 1) * 0.5
    spec = QuantSpec(symmetric=False)
    s, z = torch.tensor(0.5), torch.tensor(1, dtype=torch.int32)
    x = torch.tensor([0.26, -0.74, 100.0, -100.0, 0.25, 0.75, -0.25, 63.0, -64.5, 0.0])
    # 0.52->1: q2 ->0.5 | -1.48->-1: q0 -> -0.5 | 200->q127 -> 63 | -200->q-128 -> -64.5
    # 0.5 ties to 0 -> 0 | 1.5 ties to 2 -> 1.0 | -0.5 ties to -0 -> 0 | 126 -> q127 -> 63 | -129 -> q-128 -> -64.5
    expected = torch.tensor([0.5, -0.5, 63.0, -64.5, 0.0, 1.0, 0.0, 63.0, -64.5, 0.0])
    for estimator in ESTIMATORS:
        assert torch.equal(fake_quantize(x, s, z, spec, estimator=estimator), expected), estimator
    q = quantize_to_int(x, s, z, spec)
    assert q.dtype == torch.int64
    assert q.tolist() == [2, 0, 127, -128, 1, 3, 1, 127, -128, 1]


def test_hand_values_uint4_per_channel_negative_axis():
    # uint4 [0, 15]; two channels on the last axis: (s=1, z=0) and (s=0.25, z=8)
    spec = QuantSpec(bits=4, signed=False, symmetric=False, per_channel=True, ch_axis=-1)
    s = torch.tensor([1.0, 0.25])
    z = torch.tensor([0, 8], dtype=torch.int32)
    x = torch.tensor([[-3.0, -3.0], [2.4, 0.3], [20.0, 20.0], [7.5, -0.125]])
    # ch0: -3 -> q0 -> 0 | 2.4 -> 2 | 20 -> 15 | 7.5 ties to 8 -> 8
    # ch1: -12+8=-4 -> q0 -> -2.0 | 1.2->1 +8 = 9 -> 0.25 | 80+8 -> q15 -> 1.75 | -0.5 ties to -0 -> q8 -> 0
    expected = torch.tensor([[0.0, -2.0], [2.0, 0.25], [15.0, 1.75], [8.0, 0.0]])
    for estimator in ESTIMATORS:
        assert torch.equal(fake_quantize(x, s, z, spec, estimator=estimator), expected), estimator
    assert quantize_to_int(x, s, z, spec).tolist() == [[0, 0], [2, 9], [15, 15], [8, 8]]


def test_constant_tensor():
    for spec in (QuantSpec(), QuantSpec(symmetric=False), QuantSpec(per_channel=True, ch_axis=1)):
        for value in (0.0, 0.75):
            x = torch.full((2, 3), value)
            if spec.per_channel:
                s, z = torch.full((3,), 0.25), torch.zeros(3, dtype=torch.int32)
            else:
                s, z = torch.tensor(0.25), torch.tensor(0, dtype=torch.int32)
            for estimator in ESTIMATORS:
                out = fake_quantize(x, s, z, spec, estimator=estimator)
                assert torch.equal(out, x), (spec, value, estimator)  # 0 and 0.75 are on the grid
    # A constant-zero tensor with the floor scale (what qparams_from_range gives it).
    eps = torch.tensor(torch.finfo(torch.float32).eps)
    x = torch.zeros(4)
    assert torch.equal(fake_quantize(x, eps, torch.tensor(0, dtype=torch.int32), QuantSpec()), x)
    assert torch.equal(fake_quantize(x, eps, torch.tensor(-128, dtype=torch.int32), QuantSpec(symmetric=False)), x)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_out_of_range_saturates(per_channel, estimator):
    # int4 signed, s = 0.5, z = -2: the range is [(-8 + 2) * 0.5, (7 + 2) * 0.5] = [-3, 4.5]
    spec = QuantSpec(bits=4, symmetric=False, per_channel=per_channel, ch_axis=0)
    s, z = torch.tensor(0.5), torch.tensor(-2, dtype=torch.int32)
    if per_channel:
        s, z = s.reshape(1), z.reshape(1)
    x = torch.tensor([[-2.74, -3.26, -1e6, 4.24, 4.76, 1e6, 1e12, -1e12, 3e38, -3e38]])
    # -2.74/0.5 = -5.48 -> -5, -2 -> q -7 -> (-7 + 2) * 0.5 = -2.5 (inside)
    # -3.26/0.5 = -6.52 -> -7, -2 -> -9 -> clamp -8 -> -3.0
    # 4.24/0.5 = 8.48 -> 8, -2 -> q 6 -> 4.0 (inside);  4.76 -> 9.52 -> 10 - 2 = 8 -> clamp 7 -> 4.5
    # Huge values (beyond int64 after / s on the per-channel path too) saturate.
    expected = torch.tensor([[-2.5, -3.0, -3.0, 4.0, 4.5, 4.5, 4.5, -3.0, 4.5, -3.0]])
    out = fake_quantize(x, s, z, spec, estimator=estimator)
    assert torch.equal(out, expected), out


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_nan_kept_and_inf_saturates(per_channel, estimator):
    spec = QuantSpec(symmetric=False, per_channel=per_channel, ch_axis=0)
    s, z = torch.tensor(0.1), torch.tensor(3, dtype=torch.int32)
    if per_channel:
        s, z = s.reshape(1), z.reshape(1)
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[nan, inf, -inf, 0.3]])
    out = fake_quantize(x, s, z, spec, estimator=estimator)
    assert torch.isnan(out[0, 0])
    # +Inf -> (127 - 3) * s, -Inf -> (-128 - 3) * s, exactly as torch computes (q - z) * s
    hi = torch.tensor(124.0) * torch.tensor(0.1)
    lo = torch.tensor(-131.0) * torch.tensor(0.1)
    assert out[0, 1] == hi and out[0, 2] == lo
    assert out[0, 3] == torch.tensor(3.0) * torch.tensor(0.1)
    # quantize_to_int saturates infinities to the code range ends.
    q = quantize_to_int(x, s, z, spec)
    assert q[0, 1].item() == 127 and q[0, 2].item() == -128


def test_torch_kernel_maps_nan_to_qmin():
    """Documents the deliberate difference: torch's kernel hides NaN as (qmin - z) * s."""
    s, z = torch.tensor(0.1), torch.tensor(3, dtype=torch.int32)
    x = torch.tensor([float("nan"), 1.0])
    ref = torch.fake_quantize_per_tensor_affine(x, s, z, -128, 127)
    assert ref[0] == torch.tensor(-131.0) * torch.tensor(0.1)
    ours = fake_quantize(x, s, z, QuantSpec(symmetric=False))
    assert torch.isnan(ours[0]) and ours[1] == ref[1]
    ref_pc = torch.fake_quantize_per_channel_affine(x.reshape(1, 2), s.reshape(1), z.reshape(1), 0, -128, 127)
    assert ref_pc[0, 0] == torch.tensor(-131.0) * torch.tensor(0.1)


def test_nan_does_not_leak_into_neighbours():
    x = torch.tensor([[float("nan"), 0.5], [1.0, float("nan")]], requires_grad=True)
    spec = QuantSpec(per_channel=True, ch_axis=0)
    s, z = torch.tensor([0.25, 0.5]), torch.zeros(2, dtype=torch.int32)
    for estimator in ESTIMATORS:
        out = fake_quantize(x, s, z, spec, estimator=estimator)
        assert torch.isnan(out[0, 0]) and torch.isnan(out[1, 1])
        assert out[0, 1].item() == 0.5 and out[1, 0].item() == 1.0


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("per_channel", [False, True])
def test_float64_input(estimator, per_channel):
    gen = torch.Generator().manual_seed(7)
    spec = QuantSpec(bits=6, symmetric=False, per_channel=per_channel, ch_axis=1)
    x64 = torch.randn(4, 3, generator=gen, dtype=torch.float64) * 2
    if per_channel:
        s, z = torch.tensor([0.05, 0.1, 0.07]), torch.tensor([-3, 0, 5], dtype=torch.int32)
    else:
        s, z = torch.tensor(0.07), torch.tensor(4, dtype=torch.int32)
    out = fake_quantize(x64, s, z, spec, estimator=estimator)
    assert out.dtype == torch.float64
    ref32 = _torch_ref(x64.float(), s, z, spec)
    assert torch.equal(out, ref32.double())
    assert torch.equal(out, fake_quantize(x64.float(), s, z, spec, estimator=estimator).double())
    # Gradients flow back to the float64 input with its dtype.
    xg = x64.clone().requires_grad_()
    fake_quantize(xg, s, z, spec, estimator=estimator, training=True, alpha=0.5).sum().backward()
    assert xg.grad is not None and xg.grad.dtype == torch.float64


def test_quantize_to_int_reconstructs_fake_quant_exactly():
    gen = torch.Generator().manual_seed(99)
    for spec in _all_specs():
        n = SHAPE[channel_axis(spec, len(SHAPE))] if spec.per_channel else 1
        scale, zp = _qparams(spec, n, gen)
        x = _data(spec, scale, zp, gen)
        q = quantize_to_int(x, scale, zp, spec)
        assert q.dtype == torch.int64
        assert q.min() >= spec.qmin and q.max() <= spec.qmax, spec
        shape = [1] * x.dim()
        if spec.per_channel:
            shape[channel_axis(spec, x.dim())] = -1
        s, z = scale.reshape(shape), zp.reshape(shape).long()
        recon = (q - z).float() * s
        assert torch.equal(recon, fake_quantize(x, scale, zp, spec)), spec
        assert torch.equal(recon, _torch_ref(x, scale, zp, spec)), spec
        # The codes themselves, straight from the definition (no clamping error near the ends).
        direct = (torch.round(x * (1.0 / s)) + z).clamp(spec.qmin, spec.qmax).long()
        assert torch.equal(q, direct), spec


def test_quantize_to_int_float64_input():
    x = torch.tensor([0.26, -0.74, 100.0], dtype=torch.float64)
    q = quantize_to_int(x, torch.tensor(0.5), torch.tensor(1, dtype=torch.int32), QuantSpec(symmetric=False))
    assert q.tolist() == [2, 0, 127]


def test_channel_axis():
    assert channel_axis(QuantSpec(per_channel=True, ch_axis=-1), 4) == 3
    assert channel_axis(QuantSpec(per_channel=True, ch_axis=-4), 4) == 0
    assert channel_axis(QuantSpec(per_channel=True, ch_axis=2), 4) == 2


def _hard_values(scale: float, n: int, gen: torch.Generator) -> torch.Tensor:
    """Values where an implementation of fake quant could differ in a bit: exact ties between
    two codes, values rounding to -0, signed zeros, subnormals, +-Inf, finite values whose
    code overflows int64 or float32, plus plain noise across and beyond the range."""
    k = torch.randint(-70000, 70000, (n,), generator=gen).to(torch.float32)
    ties = (k + 0.5) * scale
    to_minus_zero = -torch.rand(n, generator=gen) * scale * 0.49
    noise = torch.randn(n, generator=gen) * scale * 300
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, 1e30, -1e30, 3e38, -3e38, 1e-40, -1e-40, 1e-45])
    return torch.cat([ties, to_minus_zero, noise, special])


@pytest.mark.parametrize("bits, signed", [(2, True), (4, False), (8, True), (8, False), (16, True), (16, False)])
def test_the_vectorized_per_tensor_path_has_torch_kernels_bits(bits, signed):
    """Eval forwards use ``_per_tensor_exact``: every output bit equals torch's kernel's
    (compared as int32 bit patterns, so even the sign of a zero), NaN aside (kept, see below)."""
    from qdebug.engine.fake_quant import _per_tensor_exact, fake_quantize_counting

    gen = torch.Generator().manual_seed(bits * 2 + signed)
    for trial in range(40):
        spec = QuantSpec(bits=bits, signed=signed, symmetric=trial % 2 == 0)
        scale = torch.tensor(float(torch.rand((), generator=gen)) * 10.0 ** int(torch.randint(-7, 3, (), generator=gen)))
        zero_point = torch.tensor(0 if spec.symmetric else int(torch.randint(spec.qmin, spec.qmax + 1, (), generator=gen)),
                                  dtype=torch.int32)
        x = _hard_values(float(scale), 3000, gen)
        ref = torch.fake_quantize_per_tensor_affine(x, scale, zero_point, spec.qmin, spec.qmax)
        out = _per_tensor_exact(x, scale, zero_point, spec)
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), (spec, float(scale), int(zero_point))
        counted, clipped = fake_quantize_counting(x, scale, zero_point, spec)
        assert torch.equal(counted.view(torch.int32), ref.view(torch.int32))
        # torch's own in-range mask (the kernel behind fake_quantize_per_tensor_affine): no NaN here
        if hasattr(torch.ops.aten, "_fake_quantize_per_tensor_affine_cachemask_tensor_qparams"):
            _, inside = torch.ops.aten._fake_quantize_per_tensor_affine_cachemask_tensor_qparams(
                x, scale, zero_point, torch.ones(1, dtype=torch.long), spec.qmin, spec.qmax)
            assert clipped == int((~inside).sum())
        # the public entry point takes this path in eval and torch's kernel under autograd: same bits
        with torch.no_grad():
            assert torch.equal(fake_quantize(x, scale, zero_point, spec).view(torch.int32), ref.view(torch.int32))
        grad_x = x.clone().requires_grad_(True)
        assert torch.equal(fake_quantize(grad_x, scale, zero_point, spec).detach().view(torch.int32), ref.view(torch.int32))


def test_the_vectorized_path_keeps_nan_without_a_scan():
    from qdebug.engine.fake_quant import _per_tensor_exact

    spec = QuantSpec()
    x = torch.tensor([math.nan, 1.0, -math.nan, 300.0])
    out = _per_tensor_exact(x, torch.tensor(0.1), torch.tensor(0, dtype=torch.int32), spec)
    assert torch.isnan(out[0]) and torch.isnan(out[2])
    assert out[1] == pytest.approx(1.0) and out[3] == pytest.approx(12.7)
