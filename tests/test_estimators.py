"""Gradients of the fake-quant estimators, against their formulas on hand-checked values.

Each case spells out the codes it expects in a comment: c = x / s + z is the
real-valued code, q = clamp(round_half_even(c), qmin, qmax) the integer one.
Where torch has the same backward (clipped_ste) the test compares against
autograd through torch's own kernel.
"""

from __future__ import annotations

import math

import pytest
import torch

from qdebug.engine.fake_quant import fake_quantize, lsq_grad_factor
from qdebug.engine.spec import QuantSpec

INT4 = QuantSpec(bits=4)  # signed: codes [-8, 7]
INT4_AFFINE = QuantSpec(bits=4, symmetric=False)


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def zp(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _grads(x, scale, zero_point, spec, g, **kw):
    """(output, dL/dx, dL/ds or None) for L = sum(g * fake_quantize(x))."""
    x = x.clone().requires_grad_()
    out = fake_quantize(x, scale, zero_point, spec, **kw)
    (out * g).sum().backward()
    s_grad = scale.grad if isinstance(scale, torch.nn.Parameter) else None
    return out.detach(), x.grad, s_grad


def _torch_kernel_grad(x, scale, zero_point, spec, g, axis=0):
    x = x.clone().requires_grad_()
    if spec.per_channel:
        out = torch.fake_quantize_per_channel_affine(x, scale, zero_point, axis, spec.qmin, spec.qmax)
    else:
        out = torch.fake_quantize_per_tensor_affine(x, scale, zero_point, spec.qmin, spec.qmax)
    (out * g).sum().backward()
    return x.grad


# --------------------------------------------------------------------------- ste


def test_ste_passes_the_gradient_everywhere():
    # s = 1, z = 0, int4: -10 and 20 are far outside [-8, 7]; ste still passes g.
    x = t([-10.0, -3.3, 0.4, 7.6, 20.0, 7.0, -8.0])
    g = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    scale = torch.nn.Parameter(t(1.0))
    out, gx, gs = _grads(x, scale, zp(0), INT4, g, estimator="ste")
    assert torch.equal(out, t([-8.0, -3.0, 0.0, 7.0, 7.0, 7.0, -8.0]))
    assert torch.equal(gx, g)
    assert gs is None  # ste trains no scale


def test_ste_per_channel():
    spec = QuantSpec(bits=4, per_channel=True, ch_axis=1)
    x = t([[-100.0, 0.3], [100.0, -0.3]])
    g = t([[1.0, 2.0], [3.0, 4.0]])
    _, gx, _ = _grads(x, t([1.0, 0.1]), zp([0, 0]), spec, g, estimator="ste")
    assert torch.equal(gx, g)


# --------------------------------------------------------------------------- clipped_ste


def test_clipped_ste_hand_values():
    # s = 1, z = 0, int4 [-8, 7]; "in" is decided on the rounded code:
    # -10 -> -10 out | -8.4 -> -8 in | -8.6 -> -9 out | -3.3 in | 0.4 in | 7.4 -> 7 in | 7.6 -> 8 out | 20 out
    x = t([-10.0, -8.4, -8.6, -3.3, 0.4, 7.4, 7.6, 20.0])
    g = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    scale = torch.nn.Parameter(t(1.0))
    _, gx, gs = _grads(x, scale, zp(0), INT4, g, estimator="clipped_ste")
    assert torch.equal(gx, t([0.0, 2.0, 0.0, 4.0, 5.0, 6.0, 0.0, 0.0]))
    assert gs is None


def test_clipped_ste_hand_values_affine():
    # s = 0.5, z = 2, int4: c = 2x + 2 in [-8, 7] <=> x in [-5, 2.5] (after rounding: [-5.25, 2.75])
    # -5.3 -> c -8.6 -> -9 out | -5.2 -> -8.4 -> -8 in | 2.7 -> 7.4 -> 7 in | 2.8 -> 7.6 -> 8 out
    x = t([-5.3, -5.2, 0.0, 2.7, 2.8])
    g = t([1.0, 1.0, 1.0, 1.0, 1.0])
    _, gx, _ = _grads(x, t(0.5), zp(2), INT4_AFFINE, g, estimator="clipped_ste")
    assert torch.equal(gx, t([0.0, 1.0, 1.0, 1.0, 0.0]))


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
@pytest.mark.parametrize("per_channel", [False, True])
def test_clipped_ste_equals_torch_kernel_backward(bits, per_channel):
    gen = torch.Generator().manual_seed(bits)
    spec = QuantSpec(bits=bits, symmetric=False, per_channel=per_channel, ch_axis=1)
    x = torch.randn(4, 3, 5, generator=gen) * 3
    g = torch.randn(4, 3, 5, generator=gen)
    if per_channel:
        scale = t([0.05, 0.3, 1.0]) * 4 / (spec.qmax - spec.qmin)
        zero = zp([spec.qmin, 0, spec.qmax])
    else:
        scale, zero = t(2.0) / (spec.qmax - spec.qmin), zp(spec.qmin + 1)
    _, gx, _ = _grads(x, scale, zero, spec, g, estimator="clipped_ste")
    ref = _torch_kernel_grad(x, scale, zero, spec, g, axis=1)
    assert torch.equal(gx, ref)
    assert (gx == 0).any() and (gx != 0).any()  # both sides of the range were exercised


# --------------------------------------------------------------------------- qte


def test_qte_input_gradient_hand_values():
    # s = 0.5, z = 2, int4: c = 2x + 2; the range is c in [-8, 7], i.e. x in [-5, 2.5].
    # (fq(x + s/2) - fq(x - s/2)) / s: 1 inside, 0 outside, 1/2 exactly at an edge.
    #  x:   -6     -5     -4.9   -1.3   0.0    0.25   2.5    2.6    9
    #  c:  -10     -8     -7.8   -0.6   2      2.5    7      7.2    20
    #  d:    0     1/2     1      1     1      1      1/2    0      0
    # (c = 2 is on the grid and c = 2.5 a half-way point: both are ties of the
    # numerical difference, where 1 -- not 0 or 2 by rounding parity -- is right.)
    x = t([-6.0, -5.0, -4.9, -1.3, 0.0, 0.25, 2.5, 2.6, 9.0])
    g = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    spec = INT4_AFFINE.replace(estimator="qte")
    _, gx, _ = _grads(x, t(0.5), zp(2), spec, g)
    assert torch.equal(gx, g * t([0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0, 0.0]))


def test_qte_input_gradient_on_grid_values_is_one():
    # Values already on the grid (the output of an earlier quant point with the same
    # scale) are all ties of the central difference; every inside one gets 1.
    s = t(0.25)
    x = torch.arange(-8, 8).float() * s  # codes -8..7 of int4
    _, gx, _ = _grads(x, s, zp(0), INT4, torch.ones(16), estimator="qte")
    expected = torch.ones(16)
    expected[0] = expected[-1] = 0.5  # the two edges
    assert torch.equal(gx, expected)


def test_qte_input_gradient_matches_the_central_difference_off_ties():
    gen = torch.Generator().manual_seed(3)
    spec = QuantSpec(bits=8, symmetric=False, per_channel=True, ch_axis=0)
    scale, zero = t([0.01, 0.02, 0.05]), zp([-20, 0, 30])
    x = torch.randn(3, 200, generator=gen) * 2  # random: no exact ties
    g = torch.randn(3, 200, generator=gen)
    _, gx, _ = _grads(x, scale, zero, spec, g, estimator="qte")
    s = scale.reshape(3, 1)
    up = torch.fake_quantize_per_channel_affine(x + s / 2, scale, zero, 0, spec.qmin, spec.qmax)
    down = torch.fake_quantize_per_channel_affine(x - s / 2, scale, zero, 0, spec.qmin, spec.qmax)
    expected = g * (up - down) / s
    assert torch.allclose(gx, expected, atol=1e-4, rtol=1e-4)
    assert (gx == 0).any() and (gx != 0).any()


def test_qte_scale_gradient_per_tensor():
    # s = 0.5, z = 2, int4.  c = 2x + 2:
    #  x:     -6    -1.3   0.4   2.6   9
    #  c:    -10    -0.6   2.8   7.2   20
    #  q:     -8    -1     3     7     7
    #  q-z:  -10    -3     1     5     5
    # dL/ds = sum g (q - z) = -10 - 6 + 3 + 20 + 25 = 32
    x = t([-6.0, -1.3, 0.4, 2.6, 9.0])
    g = t([1.0, 2.0, 3.0, 4.0, 5.0])
    scale = torch.nn.Parameter(t(0.5))
    out, gx, gs = _grads(x, scale, zp(2), INT4_AFFINE.replace(estimator="qte"), g)
    assert torch.equal(out, t([-5.0, -1.5, 0.5, 2.5, 2.5]))  # (q - z) * s
    assert gs.shape == scale.shape
    assert gs.item() == 32.0
    assert torch.equal(gx, g * t([0.0, 1.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize("ch_axis", [0, 1, -1])
def test_qte_scale_gradient_per_channel(ch_axis):
    # int4, z = 0; channel 0: s = 1, channel 1: s = 0.25
    # ch0: x = [-10, 2.4, 3.6]  -> q = [-8, 2, 4]  g = [1, 2, 3] -> -8 + 4 + 12  = 8
    # ch1: x = [0.3, -0.3, 5]   -> c = [1.2, -1.2, 20] -> q = [1, -1, 7]  g = [4, 5, 6] -> 4 - 5 + 42 = 41
    x = t([[-10.0, 2.4, 3.6], [0.3, -0.3, 5.0]])
    g = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    if ch_axis != 0:
        x, g = x.T.contiguous(), g.T.contiguous()
    spec = QuantSpec(bits=4, per_channel=True, ch_axis=ch_axis, estimator="qte")
    scale = torch.nn.Parameter(t([1.0, 0.25]))
    _, _, gs = _grads(x, scale, zp([0, 0]), spec, g)
    assert torch.equal(gs, t([8.0, 41.0]))


def test_qte_without_a_parameter_scale():
    x = t([0.4, 20.0])
    _, gx, _ = _grads(x, t(1.0), zp(0), INT4, t([1.0, 1.0]), estimator="qte")
    assert torch.equal(gx, t([1.0, 0.0]))


# --------------------------------------------------------------------------- alpha_blend


def test_alpha_blend_training_forward_and_gradient():
    # s = 1, z = 0, int4; a = 0.25: y = 0.75 x + 0.25 fq(x)
    #  x:   0.375    2.625    20      -3.125
    #  fq:  0        3        7       -3
    #  y:   0.28125  2.71875  16.75   -3.09375
    x = t([0.375, 2.625, 20.0, -3.125])
    g = t([1.0, 2.0, 3.0, 4.0])
    scale = torch.nn.Parameter(t(1.0))
    out, gx, gs = _grads(x, scale, zp(0), INT4, g, estimator="alpha_blend", training=True, alpha=0.25)
    assert torch.equal(out, t([0.28125, 2.71875, 16.75, -3.09375]))
    assert torch.equal(gx, 0.75 * g)  # (1 - a) g, also outside the range
    assert gs is None


def test_alpha_blend_eval_is_fake_quant():
    x = t([0.375, 2.625, 20.0, -3.125])
    out = fake_quantize(x, t(1.0), zp(0), INT4, estimator="alpha_blend", training=False, alpha=0.25)
    assert torch.equal(out, t([0.0, 3.0, 7.0, -3.0]))
    # alpha 0 in training is the float tensor; alpha 1 is fake quant.
    assert torch.equal(fake_quantize(x, t(1.0), zp(0), INT4, estimator="alpha_blend", training=True, alpha=0.0), x)
    out1 = fake_quantize(x, t(1.0), zp(0), INT4, estimator="alpha_blend", training=True, alpha=1.0)
    assert torch.equal(out1, t([0.0, 3.0, 7.0, -3.0]))


def test_alpha_blend_per_channel():
    spec = QuantSpec(bits=4, per_channel=True, ch_axis=0)
    x = t([[0.375, 20.0], [0.375, 20.0]])
    # ch0 s = 1: fq = [0, 7];  ch1 s = 0.5: c = [0.75, 40] -> q = [1, 7] -> fq = [0.5, 3.5]
    # a = 0.5: y = (x + fq) / 2
    out, gx, _ = _grads(x, t([1.0, 0.5]), zp([0, 0]), spec, torch.ones(2, 2), estimator="alpha_blend",
                        training=True, alpha=0.5)
    assert torch.equal(out, t([[0.1875, 13.5], [0.4375, 11.75]]))
    assert torch.equal(gx, torch.full((2, 2), 0.5))


# --------------------------------------------------------------------------- lsq


def test_lsq_grad_factor_hand_values():
    x = torch.zeros(4, 3, 5)
    s8 = QuantSpec()  # Qp = 127
    # activation: N = elements per sample = 15
    assert lsq_grad_factor(x, s8, "activation") == pytest.approx(1 / math.sqrt(15 * 127), rel=1e-12)
    # weight: N = whole tensor = 60
    assert lsq_grad_factor(x, s8, "weight") == pytest.approx(1 / math.sqrt(60 * 127), rel=1e-12)
    # weight per-channel on axis 0: 60 / 4 = 15
    assert lsq_grad_factor(x, s8.replace(per_channel=True), "weight") == pytest.approx(1 / math.sqrt(15 * 127))
    # activation per-channel on axis 1: 15 / 3 = 5
    pc1 = s8.replace(per_channel=True, ch_axis=1)
    assert lsq_grad_factor(x, pc1, "activation") == pytest.approx(1 / math.sqrt(5 * 127), rel=1e-12)
    # negative axis: -1 -> 5 channels: weight 60 / 5 = 12
    pcm1 = s8.replace(per_channel=True, ch_axis=-1)
    assert lsq_grad_factor(x, pcm1, "weight") == pytest.approx(1 / math.sqrt(12 * 127), rel=1e-12)
    # uint8: Qp = 255; int4: Qp = 7
    assert lsq_grad_factor(x, s8.replace(signed=False), "activation") == pytest.approx(1 / math.sqrt(15 * 255))
    assert lsq_grad_factor(x, INT4, "weight") == pytest.approx(1 / math.sqrt(60 * 7), rel=1e-12)
    # a 1-D activation has no batch axis: N = 6
    assert lsq_grad_factor(torch.zeros(6), INT4, "activation") == pytest.approx(1 / math.sqrt(42), rel=1e-12)


def test_lsq_scale_gradient_hand_values():
    # s = 0.5, z = 0, int4 [-8, 7]:
    #  x:            0.375  -1.125  1.0   3.125  -10    10
    #  x/s:          0.75   -2.25   2     6.25   -20    20
    #  term:         0.25    0.25   0    -0.25   -8     7      (round(x/s) - x/s | qmin - z | qmax - z)
    #  g:            1       2      3     4       5     6
    # sum g * term = 0.25 + 0.5 + 0 - 1 - 40 + 42 = 1.75;  factor = 1/sqrt(6 * 7)
    x = t([0.375, -1.125, 1.0, 3.125, -10.0, 10.0])
    g = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    scale = torch.nn.Parameter(t(0.5))
    out, gx, gs = _grads(x, scale, zp(0), INT4.replace(estimator="lsq"), g, kind="activation")
    assert torch.equal(out, t([0.5, -1.0, 1.0, 3.0, -4.0, 3.5]))
    assert gs.shape == scale.shape
    assert gs.item() == pytest.approx(1.75 / math.sqrt(42), rel=1e-6)
    assert torch.equal(gx, t([1.0, 2.0, 3.0, 4.0, 0.0, 0.0]))  # clipped_ste


def test_lsq_scale_gradient_with_zero_point():
    # s = 0.5, z = -3, int4: c = 2x - 3
    #  x:      0.375   -10         10        5.0      5.3
    #  c:     -2.25    -23         17        7        7.6 -> 8 (above)
    #  term:   0.25    -8+3 = -5   7+3 = 10  0        10
    # sum = 15.25, g = 1;  factor = 1/sqrt(5 * 7)
    x = t([0.375, -10.0, 10.0, 5.0, 5.3])
    scale = torch.nn.Parameter(t(0.5))
    _, gx, gs = _grads(x, scale, zp(-3), INT4_AFFINE, torch.ones(5), estimator="lsq")
    assert gs.item() == pytest.approx(15.25 / math.sqrt(35), rel=1e-6)
    assert torch.equal(gx, t([1.0, 0.0, 0.0, 1.0, 0.0]))


def test_lsq_scale_gradient_per_channel():
    # weight (2, 3), channels on axis 0, int4, z = 0.  N = 6 / 2 = 3 -> factor 1/sqrt(3 * 7)
    # ch0 s = 0.5: x = [0.375, -10, 3.125] -> terms [0.25, -8, -0.25], g = [1, 2, 3] -> 0.25 - 16 - 0.75 = -16.5
    # ch1 s = 1:   x = [0.25, 9, -2.5]     -> terms [-0.25, 7, 0.5 (-2.5 ties to -2)], g = [4, 5, 6] -> -1 + 35 + 3 = 37
    x = t([[0.375, -10.0, 3.125], [0.25, 9.0, -2.5]])
    g = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    spec = QuantSpec(bits=4, per_channel=True, ch_axis=0, estimator="lsq")
    scale = torch.nn.Parameter(t([0.5, 1.0]))
    _, gx, gs = _grads(x, scale, zp([0, 0]), spec, g, kind="weight")
    assert torch.allclose(gs, t([-16.5, 37.0]) / math.sqrt(21), rtol=1e-6, atol=0)
    assert torch.equal(gx, t([[1.0, 0.0, 4.0], [4.0, 0.0, 6.0]]) * t([[1, 1, 0.75], [1, 1, 1]]))


def test_lsq_kind_changes_only_the_factor():
    # Activation (4, 5): N = 5; weight: N = 20 -> the activation gradient is 2x the weight one.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 5, generator=gen)
    grads = {}
    for kind in ("activation", "weight"):
        scale = torch.nn.Parameter(t(0.1))
        _, gx, gs = _grads(x, scale, zp(0), INT4, torch.ones(4, 5), estimator="lsq", kind=kind)
        grads[kind] = (gx, gs)
    assert torch.equal(grads["activation"][0], grads["weight"][0])
    assert grads["activation"][1].item() == pytest.approx(2 * grads["weight"][1].item(), rel=1e-5)


@pytest.mark.parametrize("per_channel", [False, True])
def test_lsq_input_gradient_equals_clipped_ste(per_channel):
    gen = torch.Generator().manual_seed(11)
    spec = QuantSpec(bits=4, symmetric=False, per_channel=per_channel, ch_axis=0)
    x = torch.randn(3, 40, generator=gen) * 2
    g = torch.randn(3, 40, generator=gen)
    if per_channel:
        scale, zero = t([0.1, 0.25, 0.5]), zp([-2, 0, 3])
    else:
        scale, zero = t(0.25), zp(-3)  # a negative zero point, as signed affine specs give
    _, gx, gs = _grads(x, torch.nn.Parameter(scale.clone()), zero, spec, g, estimator="lsq")
    assert torch.equal(gx, _torch_kernel_grad(x, scale, zero, spec, g, axis=0))
    assert gs is not None and torch.isfinite(gs).all()


@pytest.mark.parametrize("z", [-100, -64, -3, 0, 5, 90])
@pytest.mark.parametrize("per_channel", [False, True])
def test_lsq_scale_gradient_matches_formula(z, per_channel):
    """The documented LSQ formula evaluated directly, for zero points of both signs."""
    gen = torch.Generator().manual_seed(abs(z) + per_channel)
    spec = QuantSpec(symmetric=False, per_channel=per_channel, ch_axis=1)  # int8 [-128, 127]
    x = torch.randn(2, 3, 50, generator=gen) * 4
    g = torch.randn(2, 3, 50, generator=gen)
    if per_channel:
        scale, zero = t([0.02, 0.05, 0.1]), zp([z, -z, z // 2])
        s, zz = scale.reshape(1, 3, 1), zero.reshape(1, 3, 1).float()
    else:
        scale, zero = t(0.05), zp(z)
        s, zz = scale, zero.float()
    p = torch.nn.Parameter(scale.clone())
    _, gx, gs = _grads(x, p, zero, spec, g, estimator="lsq", kind="activation")
    c = torch.round(x * (1.0 / s)) + zz  # rounded code before clamping
    below, above = c < spec.qmin, c > spec.qmax
    term = torch.where(below, spec.qmin - zz, torch.where(above, spec.qmax - zz, (c - zz) - x / s))
    n = 3 * 50 // (3 if per_channel else 1)  # elements per sample, per channel
    factor = 1.0 / math.sqrt(n * 127)
    expected = (g * term * factor).sum(dim=(0, 2) if per_channel else None)
    assert torch.allclose(gs, expected.reshape(gs.shape), rtol=1e-4, atol=1e-5)
    assert torch.equal(gx, torch.where(below | above, torch.zeros_like(g), g))
    assert (below | above).any() and not (below | above).all()


# --------------------------------------------------------------------------- training end to end


def _train_scale(estimator: str, init: float, steps: int, lr: float):
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(4096, generator=gen) * 2 - 1  # uniform in [-1, 1]
    spec = QuantSpec(bits=4, estimator=estimator)
    scale = torch.nn.Parameter(t(init))
    opt = torch.optim.SGD([scale], lr=lr)
    history, losses = [scale.item()], []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((fake_quantize(x, scale, zp(0), spec, training=True, kind="weight") - x) ** 2).mean()
        loss.backward()
        opt.step()
        history.append(scale.item())
        losses.append(loss.item())
    return history, losses


@pytest.mark.parametrize("estimator, lr", [("lsq", 0.5), ("qte", 0.002)])
def test_learnable_scale_grows_from_too_small(estimator, lr):
    # Range of int4 with s = 0.01 is [-0.08, 0.07]: almost everything saturates, so
    # the quantization error shrinks as the scale grows.
    history, losses = _train_scale(estimator, 0.01, 60, lr)
    assert history[1] > history[0]  # the very first step already goes the right way
    assert history[-1] > 5 * history[0]
    assert losses[-1] < 0.25 * losses[0]


def test_lsq_scale_shrinks_from_too_large():
    # s = 10: every |x| <= 1 rounds to 0; the error shrinks as the scale shrinks.
    history, losses = _train_scale("lsq", 10.0, 1, 0.5)
    assert history[1] < history[0]
