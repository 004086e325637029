"""The quantized stage (``convert``): integer arithmetic, checked against exact
rational arithmetic, int64 reference kernels and torch's quantized engine.

Nothing here compares qdebug with itself, except the quantized stage with the
fake-quant stage it simulates (which is the point of that check).
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch
import torch.ao.nn.intrinsic.quantized as nniq
import torch.ao.nn.quantized as nnq
import torch.nn as nn
import torch.nn.functional as F

import qdebug.engine.integer as integer
from qdebug.engine import QConfig, QuantSpec, calibrate, convert, prepare, quant_points
from qdebug.engine.modules import QConv, QLinear
from qdebug.zoo import MobileNetV2, ResNet, ShuffleNetV2
from small_models import SMALL_MOBILENETV2, SMALL_RESNET, SMALL_SHUFFLENETV2

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions.*:UserWarning")

UINT8_AFFINE = QuantSpec(signed=False, symmetric=False)  # what torch's quantized kernels take


def _round_half_away(x: Fraction) -> int:
    sign = -1 if x < 0 else 1
    return sign * math.floor(abs(x) + Fraction(1, 2))


def _codes(t: torch.Tensor, point) -> torch.Tensor:
    """Integer codes q (with zero point) of an on-grid float tensor of a per-tensor point."""
    return (torch.round(t.double() / point.scale.double()) + int(point.zero_point)).to(torch.int64)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


# -- fixed-point requantization ---------------------------------------------------------
def _reference_fixed_point(acc: list[int], mult: list[float]) -> tuple[list[int], list[Fraction]]:
    """round_half_away(acc * m0 / 2^shift) with m0/shift derived as documented in
    qdebug.engine.integer (a p-bit multiplier, p = 31 or less when the accumulator needs
    the headroom, m0 = round(frac(M) 2^p)); also the multiplier's representation error."""
    max_acc = max(abs(a) for a in acc)
    bits = max(min(31, 62 - max(max_acc.bit_length(), 1)), 8)
    out, errors = [], []
    for a, m in zip(acc, mult):
        mantissa, exponent = math.frexp(m)
        m0 = round(mantissa * 2**bits)  # exact float product, round half to even like torch.round
        shift = bits - exponent
        fixed = Fraction(m0, 2**shift) if shift >= 0 else Fraction(m0 * 2**-shift)
        out.append(_round_half_away(a * fixed))
        errors.append(abs(fixed - Fraction(m)))
    return out, errors


@pytest.mark.parametrize("acc_bits", [8, 16, 24, 32, 40, 53])
def test_fixed_point_multiply_is_exact_rational_rounding(acc_bits):
    rng = random.Random(acc_bits)
    n = 3000
    acc = [rng.randint(-(2**acc_bits) + 1, 2**acc_bits - 1) for _ in range(n)]
    acc[:4] = [0, 1, -1, 2**acc_bits - 1]
    mult = [10 ** rng.uniform(-6, 1) for _ in range(n)]
    mult[:4] = [1e-6, 10.0, 1.0, 0.5]
    got = integer.fixed_point_multiply(torch.tensor(acc, dtype=torch.int64), torch.tensor(mult, dtype=torch.float64))
    assert got.dtype == torch.int64
    expected, errors = _reference_fixed_point(acc, mult)
    # Exactly round_half_away(acc * m0 / 2^shift): no overflow, no rounding shortcut.
    assert got.tolist() == expected

    # Against the real-number product acc * M: the only discrepancy allowed comes from the
    # fixed-point multiplier m0 2^-shift != M (relative error <= 2^-p, p = 31 bits, fewer for
    # accumulators above 2^31).  The result is always within 1/2 + |acc| |m0 2^-shift - M| of
    # acc M.  Where that multiplier error is below half an LSB (|acc M| < ~2^30 with p = 31:
    # every realistic requantization, whose outputs are 8/16-bit codes), a result may differ
    # from round_half_away(acc M) only by 1, and only where acc M lies within
    # |acc| |m0 2^-shift - M| of a rounding tie k + 1/2.
    mismatches = 0
    for a, m, g, err in zip(acc, mult, got.tolist(), errors):
        exact = a * Fraction(m)
        real = _round_half_away(exact)
        assert abs(g - exact) <= Fraction(1, 2) + abs(a) * err
        if g != real:
            mismatches += 1
            if abs(a) * err < Fraction(1, 2):
                assert abs(g - real) == 1
                frac = abs(exact) - math.floor(abs(exact))
                assert abs(frac - Fraction(1, 2)) <= abs(a) * err, (a, m, g, real)
    if acc_bits <= 24:  # |acc M| < 2^28: the 31-bit multiplier is good to ~2^-3 of an LSB
        assert mismatches <= n // 500


def test_fixed_point_multiply_rounds_ties_away_from_zero_and_broadcasts():
    acc = torch.tensor([3, -3, 5, -5, 2, -2, 1, -1, 0], dtype=torch.int64)
    got = integer.fixed_point_multiply(acc, torch.tensor(0.5, dtype=torch.float64))
    assert got.tolist() == [2, -2, 3, -3, 1, -1, 1, -1, 0]  # 1.5 -> 2, 2.5 -> 3 (not 2), 0.5 -> 1
    got = integer.fixed_point_multiply(acc, torch.tensor(0.25, dtype=torch.float64))
    assert got.tolist() == [1, -1, 1, -1, 1, -1, 0, 0, 0]  # 0.75 -> 1, 1.25 -> 1, 0.5 -> 1, 0.25 -> 0
    # Per-channel multipliers broadcast along the channel axis.
    torch.manual_seed(0)
    acc = torch.randint(-(2**20), 2**20, (2, 4, 5), dtype=torch.int64)
    mult = torch.rand(4, dtype=torch.float64) * 1e-3 + 1e-5
    got = integer.fixed_point_multiply(acc, mult.reshape(1, 4, 1))
    flat_mult = mult.reshape(1, 4, 1).expand_as(acc).flatten().tolist()
    expected, _ = _reference_fixed_point(acc.flatten().tolist(), flat_mult)
    assert got.flatten().tolist() == expected


# -- Conv-BN-ReLU + Linear against torch's quantized engine ------------------------------
class ConvBnLinear(nn.Module):
    def __init__(self, relu: bool = True):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, bias=True)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU() if relu else nn.Identity()
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(8 * 6 * 6, 10)

    def forward(self, x):
        return self.fc(self.flatten(self.relu(self.bn(self.conv(x)))))


def _warm_bn(model: nn.Module, shape: tuple[int, ...], steps: int = 4) -> nn.Module:
    """Realistic BN running statistics: a few train-mode forwards on random data."""
    model.train()
    with torch.no_grad():
        for _ in range(steps):
            model(torch.randn(*shape))
    return model.eval()


def _quantized_engine() -> None:
    engines = torch.backends.quantized.supported_engines
    torch.backends.quantized.engine = "x86" if "x86" in engines else "fbgemm"


@pytest.mark.parametrize("relu", [True, False], ids=["conv_bn_relu", "conv_bn"])
def test_integer_model_matches_torch_quantized_modules(relu):
    _quantized_engine()
    torch.manual_seed(10)
    model = _warm_bn(ConvBnLinear(relu=relu), (16, 3, 8, 8))
    data = [torch.randn(8, 3, 8, 8) for _ in range(4)]
    qm = prepare(model, QConfig(activation=UINT8_AFFINE), mode="fuse_bn", example_inputs=data[0])
    calibrate(qm, data)
    cq = convert(qm)

    points = quant_points(cq)
    p_in, p_w, p_fw, p_fc = points["input"], points["conv.weight"], points["fc.weight"], points["fc"]
    p_conv = points["relu" if relu else "bn"]  # conv -> bn (-> relu) lands on one point
    assert p_w.spec.per_channel and p_w.scale.shape == (8,) and p_fw.spec.per_channel

    captured = {}
    cq.conv.register_forward_pre_hook(lambda m, args: captured.__setitem__("conv_in", args[0]))
    cq.fc.register_forward_pre_hook(lambda m, args: captured.__setitem__("fc_in", args[0]))
    x = torch.randn(16, 3, 8, 8)
    with torch.no_grad():
        out = cq(x)
    assert cq.conv.integer_fallbacks == 0 and cq.fc.integer_fallbacks == 0

    # Input: our input point's codes are torch's quantize_per_tensor codes.
    xq = torch.quantize_per_tensor(x, float(p_in.scale), int(p_in.zero_point), torch.quint8)
    assert torch.equal(_codes(captured["conv_in"], p_in), xq.int_repr().to(torch.int64))

    # Conv(+BN folded)(+ReLU): torch's quantized conv with our folded weight, quantized
    # per channel with our scales, our float bias, our output scale / zero point.
    w_scales = p_w.scale.double()
    wq = torch.quantize_per_channel(cq.conv.weight.detach(), w_scales, torch.zeros(8, dtype=torch.int64), 0, torch.qint8)
    assert torch.equal(wq.int_repr(), cq.conv.weight_int)
    tconv = nniq.ConvReLU2d(3, 8, 3) if relu else nnq.Conv2d(3, 8, 3)
    tconv.set_weight_bias(wq, cq.conv.bias.detach().float())
    tconv.scale, tconv.zero_point = float(p_conv.scale), int(p_conv.zero_point)
    yq = tconv(xq)
    ours = _codes(captured["fc_in"], p_conv).reshape(yq.shape)
    diff = (ours - yq.int_repr().to(torch.int64)).abs()
    assert diff.max() <= 1
    assert (diff != 0).float().mean() < 0.01  # fixed point vs fbgemm's float requantization: rare ties
    if relu:
        assert ours.min() >= int(p_conv.zero_point)

    # Linear: torch's quantized linear fed with *our* conv output (layer by layer) ...
    fwq = torch.quantize_per_channel(
        cq.fc.weight.detach(), p_fw.scale.double(), torch.zeros(10, dtype=torch.int64), 0, torch.qint8
    )
    assert torch.equal(fwq.int_repr(), cq.fc.weight_int)
    tfc = nnq.Linear(8 * 6 * 6, 10)
    tfc.set_weight_bias(fwq, cq.fc.bias.detach().float())
    tfc.scale, tfc.zero_point = float(p_fc.scale), int(p_fc.zero_point)
    fc_in = torch.quantize_per_tensor(captured["fc_in"], float(p_conv.scale), int(p_conv.zero_point), torch.quint8)
    ours_fc = _codes(out, p_fc)
    diff = (ours_fc - tfc(fc_in).int_repr().to(torch.int64)).abs()
    assert diff.max() <= 1 and (diff != 0).float().mean() < 0.01
    # ... and the whole torch chain end to end.
    chain = tfc(torch.flatten(yq, 1)).int_repr().to(torch.int64)
    assert (ours_fc - chain).abs().max() <= 1

    # The quantized stage against the fake-quant stage it simulates.
    qm.eval()
    with torch.no_grad():
        fake = qm(x)
    # (end to end: a conv-output code off by one moves some linear outputs by one LSB too)
    diff = (_codes(fake, p_fc) - ours_fc).abs()
    assert diff.max() <= 1 and (diff != 0).float().mean() < 0.05
    assert not torch.allclose(fake, model(x), atol=1e-6)  # quantization did happen


# -- zoo models: quantized stage vs fake-quant stage ---------------------------------------
ZOO = {
    "resnet": (ResNet, SMALL_RESNET),
    "mobilenetv2": (MobileNetV2, SMALL_MOBILENETV2),
    "shufflenetv2": (ShuffleNetV2, SMALL_SHUFFLENETV2),
}


@pytest.mark.parametrize(
    "name,mode",
    [("resnet", "fuse_bn"), ("resnet", "with_bn_reverse_fold"), ("mobilenetv2", "fuse_bn"), ("shufflenetv2", "fuse_bn")],
)
def test_zoo_quantized_stage_matches_fake_quant(name, mode):
    cls, kwargs = ZOO[name]
    torch.manual_seed(0)
    model = _warm_bn(cls(**kwargs), (16, 1, 28, 28))
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(8, 1, 28, 28, generator=gen) for _ in range(8)]
    held_out = [torch.randn(8, 1, 28, 28, generator=gen) for _ in range(2)]
    qm = prepare(model, QConfig(), mode=mode, example_inputs=calib[0])
    calibrate(qm, calib)
    cq = convert(qm)
    weighted = [m for m in cq.modules() if isinstance(m, (QConv, QLinear))]
    assert weighted and all(m.stage == "quantized" for m in weighted)
    last = list(quant_points(cq).values())[-1]  # the classifier's output point
    assert last.kind == "activation" and not last.spec.per_channel
    qm.eval()
    with torch.no_grad():
        for x in held_out:
            fake, quant = qm(x), cq(x)
            assert _cos(quant, fake) >= 0.9999
            # Cosine ignores a common scale error (say a 1% wrong requantization multiplier
            # in every layer); the relative error and the output codes do not.
            assert float((quant - fake).norm() / fake.norm()) <= 0.01
            assert float(((quant - fake) / last.scale).round().abs().max()) <= 2
            assert not torch.equal(quant, model(x))
    # Every weighted layer really ran its integer kernel.
    assert sum(m.integer_fallbacks for m in weighted) == 0


# -- integer conv kernels: exact int64 accumulation ---------------------------------------
class StridedGrouped(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(8, 12, 3, stride=2, padding=2, dilation=2, groups=4, bias=True)
        self.conv2 = nn.Conv2d(12, 12, 3, stride=1, padding=1, groups=12, bias=True)  # depthwise
        self.conv3 = nn.Conv2d(12, 6, (1, 3), stride=(1, 2), padding=(0, 1), bias=False)

    def forward(self, x):
        return self.conv3(self.conv2(self.conv1(x)))


def _int64_conv(x_codes: torch.Tensor, w_codes: torch.Tensor, conv: nn.Module) -> torch.Tensor:
    """sum (q_x - z_x)(q_w - z_w) with unfold + an int64 matmul per group."""
    n, cin, h, w = x_codes.shape
    cout, cin_g, kh, kw = w_codes.shape
    cols = F.unfold(
        x_codes.double(), (kh, kw), dilation=conv.dilation, padding=conv.padding, stride=conv.stride
    ).to(torch.int64)  # unfold only moves values (and pads zeros): exact
    g = conv.groups
    k = cin_g * kh * kw
    parts = []
    for i in range(g):
        wg = w_codes[i * cout // g : (i + 1) * cout // g].reshape(cout // g, k).to(torch.int64)
        parts.append(wg @ cols[:, i * k : (i + 1) * k])  # int64 x int64
    out = torch.cat(parts, dim=1)
    oh = (h + 2 * conv.padding[0] - conv.dilation[0] * (kh - 1) - 1) // conv.stride[0] + 1
    ow = (w + 2 * conv.padding[1] - conv.dilation[1] * (kw - 1) - 1) // conv.stride[1] + 1
    return out.reshape(n, cout, oh, ow)


@pytest.mark.parametrize(
    "act_spec",
    [QuantSpec(signed=True, symmetric=False), UINT8_AFFINE, QuantSpec(bits=16)],
    ids=["int8_affine", "uint8_affine", "int16_sym"],
)
def test_integer_conv_accumulates_exactly(act_spec, monkeypatch):
    torch.manual_seed(20)
    model = StridedGrouped().eval()
    data = [torch.randn(4, 8, 11, 11) for _ in range(3)]
    qm = prepare(model, QConfig(activation=act_spec), example_inputs=data[0])
    calibrate(qm, data)
    cq = convert(qm)
    points = quant_points(cq)

    # Capture what each integer kernel hands to requantization: the int64 accumulator.
    calls = []
    real_requantize = integer.requantize

    def spy(acc, multiplier, out_point, activation):
        calls.append((acc.clone(), multiplier, out_point))
        return real_requantize(acc, multiplier, out_point, activation)

    monkeypatch.setattr(integer, "requantize", spy)
    inputs = {}
    for name in ("conv1", "conv2", "conv3"):
        cq.get_submodule(name).register_forward_pre_hook(lambda m, a, name=name: inputs.__setitem__(name, a[0]))
    x = torch.randn(4, 8, 11, 11)
    with torch.no_grad():
        out = cq(x)
    assert len(calls) == 3

    in_names = {"conv1": "input", "conv2": "conv1", "conv3": "conv2"}
    for (acc, multiplier, out_point), name in zip(calls, ("conv1", "conv2", "conv3")):
        conv = cq.get_submodule(name)
        p_in, p_w = points[in_names[name]], points[f"{name}.weight"]
        assert out_point is points[name]
        s_in, z_in = p_in.scale.double(), int(p_in.zero_point)
        s_w = p_w.scale.double()
        # Input codes q - z, taken from the tensor the layer received; the first layer's
        # input must be torch's own fake quantization of x.
        received = inputs[name]
        if name == "conv1":
            fq = torch.fake_quantize_per_tensor_affine(x, float(p_in.scale), z_in, act_spec.qmin, act_spec.qmax)
            assert torch.equal(received, fq)
        x_codes = torch.round(received.double() / s_in).to(torch.int64)
        assert x_codes.min() >= act_spec.qmin - z_in and x_codes.max() <= act_spec.qmax - z_in
        # Weight codes from torch's per-channel fake quantization of the (float) weight.
        w = conv.weight.detach()
        wfq = torch.fake_quantize_per_channel_affine(w, p_w.scale, p_w.zero_point, 0, -128, 127)
        w_codes = torch.round(wfq.double() / s_w.reshape(-1, 1, 1, 1)).to(torch.int64)
        assert conv.weight_int.dtype == torch.int8
        assert torch.equal(conv.weight_int.to(torch.int64), w_codes)

        expected = _int64_conv(x_codes, w_codes, conv)
        if conv.bias is not None:
            q_bias = torch.round(conv.bias.detach().double() / (s_in * s_w)).to(torch.int64)
            expected = expected + q_bias.reshape(1, -1, 1, 1)
        assert acc.dtype == torch.int64
        assert torch.equal(acc, expected), name

        # Requantized output: round(acc * s_in s_w / s_out) + z_out (clamped), to the LSB.
        s_out, z_out = out_point.scale.double(), int(out_point.zero_point)
        real = (acc.double() * (s_in * s_w).reshape(1, -1, 1, 1) / s_out)
        ref = (torch.sign(real) * torch.floor(real.abs() + 0.5) + z_out).clamp(act_spec.qmin, act_spec.qmax)
        produced = inputs.get({"conv1": "conv2", "conv2": "conv3"}.get(name, ""), out)
        got = torch.round(produced.double() / s_out) + z_out
        assert (got - ref).abs().max() <= 1
        assert (got != ref).double().mean() < 0.01

    qm.eval()
    with torch.no_grad():
        fake = qm(x)
    threshold = 0.99999 if act_spec.bits == 16 else 0.9999
    assert _cos(out, fake) >= threshold


def test_int16_activations_on_a_zoo_model():
    cls, kwargs = ZOO["resnet"]
    torch.manual_seed(0)
    model = _warm_bn(cls(**kwargs), (16, 1, 28, 28))
    calib = [torch.randn(16, 1, 28, 28) for _ in range(4)]
    qm = prepare(model, QConfig(activation=QuantSpec(bits=16)), example_inputs=calib[0])
    calibrate(qm, calib)
    cq = convert(qm)
    qm.eval()
    x = torch.randn(16, 1, 28, 28)
    with torch.no_grad():
        fake, quant = qm(x), cq(x)
    assert _cos(quant, fake) >= 0.99999
    assert sum(m.integer_fallbacks for m in cq.modules() if isinstance(m, (QConv, QLinear))) == 0


# -- stored weight codes --------------------------------------------------------------
class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3)
        self.fc = nn.Linear(6 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(torch.flatten(self.conv(x), 1))


@pytest.mark.parametrize(
    "weight_spec,dtype",
    [
        (QuantSpec(per_channel=True, ch_axis=0), torch.int8),  # the default
        (QuantSpec(per_channel=False), torch.int8),
        (QuantSpec(bits=4, per_channel=True), torch.int8),
        # Affine int8: q - z spans 9 bits, so int8 storage would wrap around.
        (QuantSpec(symmetric=False, per_channel=False), torch.int16),
        (QuantSpec(symmetric=False, per_channel=True), torch.int16),
    ],
    ids=["int8_sym_pc", "int8_sym_pt", "int4_sym_pc", "int8_affine_pt", "int8_affine_pc"],
)
def test_weight_codes_reproduce_fake_quant_weight(weight_spec, dtype):
    torch.manual_seed(30)
    model = TwoLayer().eval()
    with torch.no_grad():
        model.conv.weight.add_(0.2)  # skewed: an affine weight gets a non-zero zero point
        model.fc.weight.add_(0.05)
    data = [torch.randn(4, 3, 6, 6) for _ in range(2)]
    qm = prepare(model, QConfig(weight=weight_spec), example_inputs=data[0])
    calibrate(qm, data)
    cq = convert(qm)
    points = quant_points(cq)
    for name in ("conv", "fc"):
        layer = cq.get_submodule(name)
        point = points[f"{name}.weight"]
        q = layer.weight_int
        assert q.dtype == dtype
        scale, zp = point.qparams()
        w = model.get_submodule(name).weight.detach()
        if weight_spec.per_channel:
            assert scale.shape == (w.shape[0],)
            ref = torch.fake_quantize_per_channel_affine(w, scale, zp, 0, weight_spec.qmin, weight_spec.qmax)
            s = scale.reshape([-1] + [1] * (w.dim() - 1))
        else:
            ref = torch.fake_quantize_per_tensor_affine(w, float(scale), int(zp), weight_spec.qmin, weight_spec.qmax)
            s = scale
        if not weight_spec.symmetric:
            assert (zp != 0).any()
        # weight_int holds q - z: (q - z) * s is torch's fake-quantized weight, bit for bit.
        assert torch.equal(q.to(torch.float32) * s, ref)
        assert weight_spec.qmin <= int((q.to(torch.int64) + zp.reshape(s.shape).to(torch.int64)).min())
        assert int((q.to(torch.int64) + zp.reshape(s.shape).to(torch.int64)).max()) <= weight_spec.qmax
    # and the integer model computes with those codes as the fake-quant model does
    qm.eval()
    x = torch.randn(4, 3, 6, 6)
    with torch.no_grad():
        assert _cos(cq(x), qm(x)) >= 0.9999
