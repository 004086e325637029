"""The quantized stage (``convert``): integer arithmetic, checked against exact references.

Oracles, in order of authority:

- an exact reference written here from docs/engine.md: integer codes, int64 accumulation,
  the documented fixed-point requantization in Python/int64 integers.  It never calls
  qdebug's integer kernels, and it is the same on every CPU: every integer test compares
  the quantized stage with it to the LSB (0 LSB);
- torch's quantized modules (x86/fbgemm engine), only where torch itself is exact.  Its
  u8 x s8 kernels add adjacent product pairs in a saturating int16 on x86 CPUs without
  AVX512-VNNI (vpmaddubsw: 2 x 255 x 127 = 64770 > 32767), so there full-range uint8
  activations are off by tens of LSB.  Activations with ``reduce_range`` (codes [0, 127]:
  |pair| <= 2 x 127 x 128 = 32512) are exact on every CPU and always compared; full-range
  ones only on a CPU with AVX512-VNNI, skipped with the reason elsewhere.  See
  docs/engine.md, "torch's x86 kernels and VNNI";
- the fake-quant stage the quantized stage simulates (float kernels: a tolerance, explained
  where it is used).

Nothing here compares qdebug with itself, except the quantized stage with the
fake-quant stage it simulates (which is the point of that check).
"""

from __future__ import annotations

import math
import os
import random
from collections import OrderedDict
from fractions import Fraction

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qdebug.engine.integer as integer
from qdebug.engine import QConfig, QuantSpec, calibrate, convert, prepare, quant_points
from qdebug.engine.modules import QConv, QLinear
from qdebug.engine.point import grid_of
from qdebug.zoo import MobileNetV2, ResNet, ShuffleNetV2
from small_models import SMALL_MOBILENETV2, SMALL_RESNET, SMALL_SHUFFLENETV2

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions.*:UserWarning")

UINT8_AFFINE = QuantSpec(signed=False, symmetric=False)  # what torch's quantized kernels take
# torch's reduce_range for quint8 activations: codes [0, 127] (7 bits, unsigned, affine).
UINT8_REDUCE_RANGE = QuantSpec(bits=7, signed=False, symmetric=False)
ACTIVATIONS = {"uint8": UINT8_AFFINE, "uint8_reduce_range": UINT8_REDUCE_RANGE}
INT16 = (-(2**15), 2**15 - 1)  # the saturating int16 of vpmaddubsw's pair sums


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


# -- the exact reference (docs/engine.md, "Quantized stage"), independent of qdebug's kernels --
def _multiplier_bits(acc: torch.Tensor) -> int:
    """p = 31 bits, fewer when the largest |acc| needs the headroom (|acc m0| < 2^62), at least 8."""
    max_acc = int(acc.abs().max()) if acc.numel() else 0
    return max(min(31, 62 - max(max_acc.bit_length(), 1)), 8)


def _reference_requantize(acc: torch.Tensor, multipliers: list[float], out_point, activation: str | None):
    """Output codes q_y (with zero point) of an int64 accumulator (output channels on axis 1).

    M = f 2^e (f in [0.5, 1)) becomes m0 2^-n, m0 = round_half_even(f 2^p), n = p - e;
    q_y = z_y + sign(v) ((|v| + 2^(n-1)) >> n) with v = acc m0 (round half away from zero),
    clamped to [qmin, qmax], for a fused ReLU to [z_y, qmax], ReLU6 [z_y, z_y + round(6 / s_y)].
    Integer arithmetic only (int64 tensors; Python integers for an unusual shift).
    """
    bits = _multiplier_bits(acc)
    by_channel = acc.movedim(1, 0)
    out = torch.empty_like(by_channel)
    for c in range(by_channel.shape[0]):
        mantissa, exponent = math.frexp(multipliers[c] if len(multipliers) > 1 else multipliers[0])
        m0, n = round(mantissa * 2**bits), bits - exponent  # exact float product; round half to even
        v = by_channel[c] * m0  # |v| <= 2^62 by the choice of p: exact in int64
        if 1 <= n <= 62:
            out[c] = torch.sign(v) * ((v.abs() + (1 << (n - 1))) >> n)
        else:
            exact = [_round_half_away(Fraction(a * m0) / Fraction(2) ** n) for a in by_channel[c].flatten().tolist()]
            out[c] = torch.tensor(exact, dtype=torch.int64).reshape(v.shape)
    spec, z = out_point.spec, int(out_point.zero_point)
    lo, hi = spec.qmin, spec.qmax
    if activation in ("relu", "relu6"):
        lo = max(lo, z)
    if activation == "relu6":
        hi = min(hi, z + round(6.0 / float(out_point.scale)))
    return (out.movedim(0, 1) + z).clamp(lo, hi)


def _reference_weight_codes(layer: nn.Module, w_point) -> torch.Tensor:
    """q_w - z_w (int64) of the layer's float weight: torch's fake quantization (float-exact on every
    CPU, the definition in docs/engine.md), divided back by the scale."""
    w, spec = layer.weight.detach(), w_point.spec
    scale, zp = w_point.qparams()
    if spec.per_channel:
        fq = torch.fake_quantize_per_channel_affine(w, scale, zp.int(), spec.ch_axis, spec.qmin, spec.qmax)
        scale = scale.reshape([-1 if d == spec.ch_axis % w.dim() else 1 for d in range(w.dim())])
    else:
        fq = torch.fake_quantize_per_tensor_affine(w, float(scale), int(zp), spec.qmin, spec.qmax)
    return torch.round(fq.double() / scale.double()).to(torch.int64)


def _int64_conv(x_codes: torch.Tensor, w_codes: torch.Tensor, conv: nn.Module) -> torch.Tensor:
    """sum (q_x - z_x)(q_w - z_w) with unfold + an int64 matmul per group (2-d convs)."""
    n, cin, h, w = x_codes.shape
    cout, cin_g, kh, kw = w_codes.shape
    assert getattr(conv, "padding_mode", "zeros") == "zeros"
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


def _reference_layer(layer: nn.Module, x_codes: torch.Tensor, p_in, p_w, p_out, activation: str | None):
    """The exact integer forward of a Conv2d/Linear: (accumulator without bias, q_b, output codes q_y).

    ``x_codes``: the input codes q_x - z_x (int64).  q_b = round_half_even(b / (s_x s_w)) in float64,
    M = s_x s_w / s_y in float64, per output channel.
    """
    w_codes = _reference_weight_codes(layer, p_w)
    assert torch.equal(layer.weight_int.to(torch.int64), w_codes)  # the codes qdebug stores
    if w_codes.dim() == 4:
        acc = _int64_conv(x_codes, w_codes, layer)
    else:
        acc = x_codes.to(torch.int64) @ w_codes.t()
    s_in = float(p_in.scale)
    s_w = p_w.scale.double().reshape(-1).tolist()
    s_out = float(p_out.scale)
    c_out = acc.shape[1]
    s_w = s_w * c_out if len(s_w) == 1 else s_w
    q_bias = torch.zeros(c_out, dtype=torch.int64)
    if layer.bias is not None:
        q_bias = torch.tensor([round(b / (s_in * s)) for b, s in zip(layer.bias.detach().double().tolist(), s_w)])
    shape = [1, -1] + [1] * (acc.dim() - 2)
    q_out = _reference_requantize(acc + q_bias.reshape(shape), [s_in * s / s_out for s in s_w], p_out, activation)
    return acc, q_bias, q_out


def _check_weighted_layers_exactly(model: nn.Module, run) -> int:
    """Run ``run()`` and check every integer Conv/Linear's output against the exact reference computed
    from the codes it received (so a mismatch points at one layer).  Returns the layers checked."""
    checked = []

    def hook(module, args, output):
        x = args[0]
        p_in, p_out = grid_of(x), module._out_point
        assert p_in is not None and p_out is not None, "the layer fell back to float"
        # (the engine's TorchFunctionMode is active inside the forward: keep the reference's
        # own tensor ops out of its sight)
        with torch._C.DisableTorchFunction():
            x_codes = torch.round(x.double() / p_in.scale.double()).to(torch.int64)
            activation = module._fused_activation
            _, _, expected = _reference_layer(module, x_codes, p_in, module.weight_point, p_out, activation)
            got = _codes(output, p_out)
            assert torch.equal(got, expected), (module, int((got - expected).abs().max()))
        checked.append(module)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (QConv, QLinear))]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return len(checked)


# -- Conv-BN-ReLU + Linear: the exact reference, and torch's quantized modules ------------
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


def _conv_bn_linear(relu: bool, act: str) -> dict:
    """The quantized stage of ConvBnLinear (uint8 activations, full or reduced range), run on fresh
    data, its exact reference computed layer by layer from the input x."""
    spec = ACTIVATIONS[act]
    torch.manual_seed(10)
    model = _warm_bn(ConvBnLinear(relu=relu), (16, 3, 8, 8))
    data = [torch.randn(8, 3, 8, 8) for _ in range(4)]
    qm = prepare(model, QConfig(activation=spec), mode="fuse_bn", example_inputs=data[0])
    calibrate(qm, data)
    cq = convert(qm)

    points = quant_points(cq)
    p_in, p_w, p_fw, p_fc = points["input"], points["conv.weight"], points["fc.weight"], points["fc"]
    p_conv = points["relu" if relu else "bn"]  # conv -> bn (-> relu) lands on one point
    assert p_w.spec.per_channel and p_w.scale.shape == (8,) and p_fw.spec.per_channel
    assert (p_in.spec.qmin, p_in.spec.qmax) == (spec.qmin, spec.qmax) == (p_conv.spec.qmin, p_conv.spec.qmax)

    captured = {}
    cq.conv.register_forward_pre_hook(lambda m, args: captured.__setitem__("conv_in", args[0]))
    cq.fc.register_forward_pre_hook(lambda m, args: captured.__setitem__("fc_in", args[0]))
    x = 1.5 * torch.randn(16, 3, 8, 8)  # wider than the calibration data: codes at both ends of the range
    with torch.no_grad():
        out = cq(x)
    assert cq.conv.integer_fallbacks == 0 and cq.fc.integer_fallbacks == 0

    # The reference, from x alone: input codes by the documented quantizer (torch's fake-quant
    # kernel, float-exact everywhere), then each layer in integers.
    s_in, z_in = float(p_in.scale), int(p_in.zero_point)
    fq_x = torch.fake_quantize_per_tensor_affine(x, s_in, z_in, spec.qmin, spec.qmax)
    x_q = torch.round(fq_x.double() / s_in).to(torch.int64) + z_in
    assert (int(x_q.min()), int(x_q.max())) == (spec.qmin, spec.qmax)
    conv_acc, _, conv_q = _reference_layer(cq.conv, x_q - z_in, p_in, p_w, p_conv, "relu" if relu else None)
    z_conv = int(p_conv.zero_point)
    _, _, fc_q = _reference_layer(cq.fc, torch.flatten(conv_q, 1) - z_conv, p_conv, p_fw, p_fc, None)
    return dict(
        spec=spec, model=model, qm=qm, cq=cq, x=x, out=out, captured=captured,
        p_in=p_in, p_w=p_w, p_conv=p_conv, p_fw=p_fw, p_fc=p_fc, x_q=x_q, conv_acc=conv_acc, conv_q=conv_q, fc_q=fc_q,
    )


RELU_IDS = dict(argnames="relu", argvalues=[True, False], ids=["conv_bn_relu", "conv_bn"])


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize(**RELU_IDS)
def test_integer_model_matches_exact_reference(relu, act):
    r = _conv_bn_linear(relu, act)
    # Every layer, to the LSB: input codes, Conv(+BN folded)(+ReLU), then Linear.
    assert torch.equal(_codes(r["captured"]["conv_in"], r["p_in"]), r["x_q"])
    ours_conv = _codes(r["captured"]["fc_in"], r["p_conv"]).reshape(r["conv_q"].shape)
    assert torch.equal(ours_conv, r["conv_q"])
    assert torch.equal(_codes(r["out"], r["p_fc"]), r["fc_q"])
    if relu:
        assert int(r["conv_q"].min()) == int(r["p_conv"].zero_point)  # the fused ReLU clamped something
    # Full range: a pair of u8 x s8 products can exceed int16, the case torch's x86 kernels get
    # wrong without VNNI; reduce_range: no pair can.
    pairs = _max_pair_sum(r["x_q"], r["cq"].conv.weight_int)
    assert (pairs > INT16[1]) == (act == "uint8"), pairs

    # The quantized stage against the fake-quant stage it simulates.  The fake-quant stage runs
    # float kernels (summation order and rounding vary by CPU and library): a conv output that
    # lands within float error of a rounding tie may get the other code, and moves the linear
    # outputs it feeds by a fraction of an LSB -- at most one LSB at the output.
    qm, x, p_fc = r["qm"], r["x"], r["p_fc"]
    qm.eval()
    with torch.no_grad():
        fake = qm(x)
    diff = (_codes(fake, p_fc) - r["fc_q"]).abs()
    assert diff.max() <= 1 and (diff != 0).float().mean() < 0.05
    assert not torch.allclose(fake, r["model"](x), atol=1e-6)  # quantization did happen


def _max_pair_sum(x_q: torch.Tensor, w_codes: torch.Tensor) -> int:
    """A bound on |q_x w + q_x' w'|, two products of one output as a u8 x s8 kernel multiplies
    them (raw codes, zero point included): the largest q_x times a channel's two largest |w|."""
    w = w_codes.to(torch.int64).flatten(1).abs()
    top2 = w.topk(2, dim=1).values.sum(1)
    return int(x_q.max()) * int(top2.max())


# torch's x86 engine runs its int8 conv on oneDNN where the CPU has AVX512-VNNI (Linux) and on
# fbgemm otherwise; both multiply u8 by s8 with vpdpbusd (exact int32) given VNNI, and with
# vpmaddubsw (adjacent pairs added in a saturating int16) without it.
def _cpu_has_avx512_vnni() -> bool:
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is not None:
        return bool(capabilities().get("avx512_vnni", False))
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512_vnni" in line for line in f)
    except OSError:
        return False


def _torch_not_exact_because(spec: QuantSpec) -> str | None:
    """Why torch's x86/fbgemm int8 conv/linear may differ from exact arithmetic here, or None."""
    engines = torch.backends.quantized.supported_engines
    if "x86" not in engines and "fbgemm" not in engines:
        return f"torch has no x86/fbgemm quantized engine here (engines: {engines})"
    if spec.qmax <= 127:
        return None  # reduce_range: |pair| <= 2 x 127 x 128 = 32512 fits int16 on every CPU
    # The kernels' instruction sets can be capped below the CPU's (how a CPU without VNNI is
    # emulated on one with it): then the CPU's flags say nothing.
    for var in ("FBGEMM_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        if os.environ.get(var, "ALL").upper() not in ("ALL", "DEFAULT", ""):
            return f"{var}={os.environ[var]} may take VNNI from torch's int8 kernels (int16 pair sums saturate)"
    if not _cpu_has_avx512_vnni():
        return (
            "this CPU has no AVX512-VNNI: torch's x86/fbgemm int8 kernels add u8 x s8 product pairs in "
            "a saturating int16 (vpmaddubsw; 2 x 255 x 127 = 64770 > 32767), so full-range uint8 "
            "activations are not exact there; the reduce_range case (codes <= 127) is compared with "
            "torch on every CPU, and this one with the exact reference"
        )
    return None  # VNNI: vpdpbusd accumulates u8 x s8 products in int32, exactly


def _assert_equal_but_for_ties(torch_q, exact_q, acc, float_bias, s_in, s_w, p_out) -> int:
    """torch's output codes against the exact ones, given the same int32 accumulator.

    torch requantizes in float32 with the float bias (acc + b / (s_x s_w)) s_x s_w / s_y, rounding
    half to even; the reference uses q_b = round(b / (s_x s_w)) and a 31-bit fixed-point
    multiplier, rounding half away.  The two real values differ by at most 1/2 M (the bias
    rounding, M = s_x s_w / s_y) plus float32 rounding (~1e-5 LSB), so the codes may differ by 1,
    and only where the real value lies that close to a rounding tie k + 1/2.  Returns the count.
    """
    torch_q, exact_q = torch_q.to(torch.int64), exact_q.to(torch.int64)
    diff = torch_q - exact_q
    assert int(diff.abs().max()) <= 1
    shape = [1, -1] + [1] * (acc.dim() - 2)
    scale = (s_in * s_w.double()).reshape(shape)
    real = (acc.double() * scale + float_bias.double().reshape(shape)) / float(p_out.scale)
    tie = (torch_q + exact_q).double() / 2 - int(p_out.zero_point)
    allowed = (scale / float(p_out.scale) / 2 + 1e-3).expand_as(real)
    off = diff != 0
    assert bool(((real - tie).abs()[off] <= allowed[off]).all()), "torch differs away from a rounding tie"
    return int(off.sum())


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize(**RELU_IDS)
def test_integer_model_matches_torch_quantized_modules(relu, act, monkeypatch):
    nnq = pytest.importorskip("torch.ao.nn.quantized")
    nniq = pytest.importorskip("torch.ao.nn.intrinsic.quantized")
    spec = ACTIVATIONS[act]
    reason = _torch_not_exact_because(spec)
    if reason is not None:
        pytest.skip(reason)
    engines = torch.backends.quantized.supported_engines
    monkeypatch.setattr(torch.backends.quantized, "engine", "x86" if "x86" in engines else "fbgemm")
    r = _conv_bn_linear(relu, act)
    cq, p_in, p_conv, p_fc = r["cq"], r["p_in"], r["p_conv"], r["p_fc"]

    def quint8(q: torch.Tensor, point) -> torch.Tensor:
        # torch gets exactly the reference codes (no second rounding of float values).
        return torch._make_per_tensor_quantized_tensor(q.to(torch.uint8), float(point.scale), int(point.zero_point))

    def qint8_weight(layer: nn.Module, point) -> torch.Tensor:
        codes = _reference_weight_codes(layer, point).to(torch.int8)
        zeros = torch.zeros(codes.shape[0], dtype=torch.int64)
        return torch._make_per_channel_quantized_tensor(codes, point.scale.double(), zeros, 0)

    # Conv(+BN folded)(+ReLU): torch's quantized conv with the folded weight's codes, the float
    # folded bias, and the conv point's scale / zero point.
    tconv = nniq.ConvReLU2d(3, 8, 3) if relu else nnq.Conv2d(3, 8, 3)
    tconv.set_weight_bias(qint8_weight(cq.conv, r["p_w"]), cq.conv.bias.detach().float())
    tconv.scale, tconv.zero_point = float(p_conv.scale), int(p_conv.zero_point)
    # torch's quint8 output spans [0, 255]; a reduce_range point clamps to its own [0, 127].
    yq = tconv(quint8(r["x_q"], p_in)).int_repr().to(torch.int64).clamp(spec.qmin, spec.qmax)
    ties = _assert_equal_but_for_ties(
        yq, r["conv_q"], r["conv_acc"], cq.conv.bias.detach(), float(p_in.scale), r["p_w"].scale, p_conv
    )
    assert ties <= yq.numel() // 100

    # Linear, fed with torch's own conv output (the torch chain end to end): against the
    # reference computed from those same codes.
    tfc = nnq.Linear(8 * 6 * 6, 10)
    tfc.set_weight_bias(qint8_weight(cq.fc, r["p_fw"]), cq.fc.bias.detach().float())
    tfc.scale, tfc.zero_point = float(p_fc.scale), int(p_fc.zero_point)
    fc_in = torch.flatten(yq, 1)
    torch_fc = tfc(quint8(fc_in, p_conv)).int_repr().to(torch.int64).clamp(spec.qmin, spec.qmax)
    fc_acc, _, fc_q = _reference_layer(cq.fc, fc_in - int(p_conv.zero_point), p_conv, r["p_fw"], p_fc, None)
    ties += _assert_equal_but_for_ties(
        torch_fc, fc_q, fc_acc, cq.fc.bias.detach(), float(p_conv.scale), r["p_fw"].scale, p_fc
    )
    assert ties <= (yq.numel() + torch_fc.numel()) // 100


# -- where x86 kernels without VNNI saturate, qdebug is exact ------------------------------
def _vpmaddubsw_accumulate(x_q: torch.Tensor, w_codes: torch.Tensor) -> torch.Tensor:
    """What a u8 x s8 kernel without VNNI computes for x_q @ w.T: adjacent products added in
    a saturating int16 (vpmaddubsw), then widened and summed in int32 (vpmaddwd, vpaddd)."""
    a = x_q.to(torch.int64)[:, None, :]  # (N, 1, K) raw u8 codes
    w = w_codes.to(torch.int64)[None]  # (1, C, K)
    pairs = a[..., 0::2] * w[..., 0::2] + a[..., 1::2] * w[..., 1::2]
    return pairs.clamp(*INT16).sum(-1)


# K = 32, 1024 and 8192 inputs: with codes up to 255, qdebug's exact accumulation takes its
# float32, split (x = 16 h + l) and float64 paths in turn.
@pytest.mark.parametrize("in_features", [32, 1024, 8192])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_integer_linear_is_exact_where_int16_pair_sums_saturate(act, in_features, monkeypatch):
    spec = ACTIVATIONS[act]
    torch.manual_seed(40)
    model = nn.Sequential(OrderedDict(fc=nn.Linear(in_features, 4, bias=False))).eval()
    with torch.no_grad():
        w = torch.rand(4, in_features) * 2 - 1
        w[0], w[1] = 1.0, -1.0  # every weight code +127 / -127
        w[2, 0::2], w[2, 1::2] = 1.0, -1.0  # pairs that cancel: no saturation either way
        w[3, 0] = 1.0
        model.fc.weight.copy_(w)
    # Activations on [0, 1]: z_x = 0, q_x = x qmax; x = 1 gives the top code (255, or 127).
    x = torch.randint(0, spec.qmax + 1, (6, in_features)).float() / spec.qmax
    x[0] = 1.0
    x[1, 0::2] = 1.0
    x[2] = 0.0
    qm = prepare(model, QConfig(activation=spec), example_inputs=x)
    calibrate(qm, [x])
    cq = convert(qm)
    points = quant_points(cq)
    p_in, p_w, p_out = points["input"], points["fc.weight"], points["fc"]
    assert int(p_in.zero_point) == 0
    accumulators = []  # what qdebug's kernel hands to requantization
    real_requantize = integer.requantize

    def spy(acc, *args):
        accumulators.append(acc.clone())
        return real_requantize(acc, *args)

    monkeypatch.setattr(integer, "requantize", spy)
    with torch.no_grad():
        out = cq(x)

    fq_x = torch.fake_quantize_per_tensor_affine(x, float(p_in.scale), 0, spec.qmin, spec.qmax)
    x_q = torch.round(fq_x.double() / float(p_in.scale)).to(torch.int64)
    assert int(x_q[0].min()) == spec.qmax
    acc, _, expected = _reference_layer(cq.fc, x_q, p_in, p_w, p_out, None)
    w_q = cq.fc.weight_int
    assert int(w_q[0].min()) == 127 and int(w_q[1].max()) == -127
    assert int(acc[0, 0]) == spec.qmax * 127 * in_features  # far beyond int16 and the pairs' reach
    # qdebug: the exact accumulator (every unit of it, not only what survives requantization)
    # and the exact output codes, whatever the codes.
    assert len(accumulators) == 1 and torch.equal(accumulators[0], acc)
    assert torch.equal(_codes(out, p_out), expected)

    saturated = _vpmaddubsw_accumulate(x_q, w_q)
    if spec.qmax <= 127:
        # reduce_range: |q_x w + q_x' w'| <= 2 x 127 x 128 = 32512 < 32767, nothing saturates.
        assert torch.equal(saturated, acc)
    else:
        # 2 x 255 x 127 = 64770 saturates at 32767: half the accumulator lost, tens of LSB
        # (the 75 and 39 LSB of issue 12); the cancelling pairs (row 2 of w) stay exact.
        half = in_features // 2
        assert (int(saturated[0, 0]), int(saturated[0, 1])) == (32767 * half, -32768 * half)
        assert torch.equal(saturated[:, 2], acc[:, 2])
        s_in, s_w, s_out = float(p_in.scale), p_w.scale.double().tolist(), float(p_out.scale)
        wrong = _reference_requantize(saturated, [s_in * s / s_out for s in s_w], p_out, None)
        assert int((wrong - expected).abs().max()) > 30


# -- zoo models: every integer layer exact, and the quantized stage vs the fake-quant stage --
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
    # Every conv (grouped, depthwise, strided, 1x1) and linear, to the LSB, on the codes it received.
    assert _check_weighted_layers_exactly(cq, lambda: cq(held_out[0])) == len(weighted)
    # The fake-quant stage runs float kernels (their rounding varies by CPU and library): a
    # tolerance, the quantized stage simulating it.
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


# -- integer conv kernels: exact int64 accumulation and requantization ---------------------
class StridedGrouped(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(8, 12, 3, stride=2, padding=2, dilation=2, groups=4, bias=True)
        self.conv2 = nn.Conv2d(12, 12, 3, stride=1, padding=1, groups=12, bias=True)  # depthwise
        self.conv3 = nn.Conv2d(12, 6, (1, 3), stride=(1, 2), padding=(0, 1), bias=False)

    def forward(self, x):
        return self.conv3(self.conv2(self.conv1(x)))


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
        calls.append((acc.clone(), out_point))
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
    for (acc, out_point), name in zip(calls, ("conv1", "conv2", "conv3")):
        conv = cq.get_submodule(name)
        p_in, p_w = points[in_names[name]], points[f"{name}.weight"]
        assert out_point is points[name]
        z_in = int(p_in.zero_point)
        # Input codes q - z, taken from the tensor the layer received; the first layer's
        # input must be torch's own fake quantization of x.
        received = inputs[name]
        if name == "conv1":
            fq = torch.fake_quantize_per_tensor_affine(x, float(p_in.scale), z_in, act_spec.qmin, act_spec.qmax)
            assert torch.equal(received, fq)
        x_codes = torch.round(received.double() / p_in.scale.double()).to(torch.int64)
        assert x_codes.min() >= act_spec.qmin - z_in and x_codes.max() <= act_spec.qmax - z_in
        assert conv.weight_int.dtype == torch.int8

        # The accumulator, int64 exact, and the requantized output codes, to the LSB (the
        # documented fixed-point rule; its relation to rounding acc M in the reals is the
        # subject of test_fixed_point_multiply_is_exact_rational_rounding).
        expected_acc, q_bias, expected = _reference_layer(conv, x_codes, p_in, p_w, out_point, None)
        assert acc.dtype == torch.int64
        assert torch.equal(acc, expected_acc + q_bias.reshape(1, -1, 1, 1)), name
        produced = inputs.get({"conv1": "conv2", "conv2": "conv3"}.get(name, ""), out)
        assert torch.equal(_codes(produced, out_point), expected), name

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
    weighted = [m for m in cq.modules() if isinstance(m, (QConv, QLinear))]
    # 16-bit codes: accumulators past 2^31 take the multiplier's headroom rule; still exact.
    assert _check_weighted_layers_exactly(cq, lambda: cq(x)) == len(weighted)
    with torch.no_grad():
        fake, quant = qm(x), cq(x)
    assert _cos(quant, fake) >= 0.99999
    assert sum(m.integer_fallbacks for m in weighted) == 0


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


@pytest.mark.parametrize("setting", ["mkldnn_off", "matmul_precision_medium"])
def test_exact_integer_op_stays_exact_when_torch_picks_inexact_kernels(setting):
    """With oneDNN off, torch runs float32 convs of 16+ images through NNPACK's Winograd
    transform (not a sum of exact products); with a lower matmul precision, float32 may use
    TF32/bf16 internally.  The integer simulation must not care."""
    import torch.nn.functional as F

    from qdebug.engine.integer import exact_integer_op

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-128, 128, (16, 32, 28, 28), generator=gen).double()
    w = torch.randint(-127, 128, (32, 32, 3, 3), generator=gen).double()
    expected = F.conv2d(x, w)  # float64 im2col: exact below 2^53
    saved_precision = torch.get_float32_matmul_precision()
    # flags(): a direct assignment raises once torch's test utilities froze the global flags
    with torch.backends.mkldnn.flags(enabled=setting != "mkldnn_off"):
        try:
            if setting == "mkldnn_off":
                inexact = F.conv2d(x.float(), w.float()).double()
                if torch.backends.nnpack.is_available():
                    assert (inexact - expected).abs().max() > 0  # the trap is real here
            else:
                torch.set_float32_matmul_precision("medium")
            got = exact_integer_op(F.conv2d, x, w, terms=32 * 9)
        finally:
            torch.set_float32_matmul_precision(saved_precision)
    assert torch.equal(got.double(), expected)
