"""The rest of a modern block (issue 28, item 4): norms and activations with quantized outputs,
scalar mul/div folded into the requantization, and what stays float -- with its reason.

Oracles: torch's own fake quantization (``torch.fake_quantize_per_tensor_affine``) on torch's
float kernels for the ops quantized at their output, and exact rationals (``fractions``) of the
documented fixed-point requantization for the folded scalar (docs/engine.md, "Modern blocks").
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from qdebug.engine import QConfig, QuantSpec, calibrate, convert, prepare, quant_points, set_mode
from qdebug.engine.ops import fallback_reason, function_category, module_category

UINT8 = QuantSpec(signed=False, symmetric=False)


class Block(nn.Module):
    """A transformer-ish block plus a conv-style tail: every op of item 4 but Embedding."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(2 * d, d)
        self.rms = nn.RMSNorm(d)
        self.silu = nn.SiLU()
        self.hswish = nn.Hardswish()
        self.mish = nn.Mish()
        self.prelu = nn.PReLU()
        self.gn = nn.GroupNorm(2, d)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        h = self.fc2(self.gelu(self.fc1(self.ln(x)))) / 4.0
        h = self.silu(self.rms(h * 0.5))
        h = self.prelu(self.mish(self.hswish(h)))
        h = self.gn(h.transpose(1, 2)).transpose(1, 2)
        h = F.layer_norm(h, h.shape[-1:]) + F.rms_norm(h, h.shape[-1:])
        return self.softmax(F.silu(F.gelu(h)))


OUTPUT_POINTS = ["ln", "gelu", "rms", "silu", "hswish", "mish", "prelu", "gn", "layer_norm", "rms_norm", "softmax",
                 "silu()", "gelu()", "div", "mul"]  # F.silu beside the module silu: an inline op never takes its name


def _calibrated_block():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no quantized kernel" warning: nothing stays float
        qm = prepare(Block().eval(), QConfig(activation=UINT8), example_inputs=x)
    calibrate(qm, [x, x * 1.5])
    return qm, x


def test_norms_and_activations_of_a_modern_block_get_output_points_not_fallbacks():
    qm, _ = _calibrated_block()
    points = quant_points(qm)
    for name in OUTPUT_POINTS:
        assert name in points, (name, list(points))
        assert points[name].kind == "activation" and not points[name].fallback, name
    assert not any(p.fallback for p in points.values())
    for module in (nn.LayerNorm(4), nn.GroupNorm(2, 4), nn.RMSNorm(4), nn.PReLU(), nn.Mish(), nn.InstanceNorm1d(4)):
        assert module_category(module) == "activation", module


def test_a_norm_output_is_torch_fake_quantize_of_torch_norm():
    """Fake quant only: torch's LayerNorm (float weights), then torch's fake quantization."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.LayerNorm(8), nn.RMSNorm(8)).eval()
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 2.0)
        model[1].weight.uniform_(0.5, 2.0)
    x = torch.randn(4, 8) * 3
    qm = prepare(model, QConfig(activation=UINT8), example_inputs=x)
    calibrate(qm, [x])
    points = quant_points(qm)
    with torch.no_grad():
        got = qm(x)
        fq = {name: (float(points[name].scale), int(points[name].zero_point)) for name in ("input", "0", "1")}
        ref = torch.fake_quantize_per_tensor_affine(x, *fq["input"], 0, 255)
        ref = torch.fake_quantize_per_tensor_affine(model[0](ref), *fq["0"], 0, 255)
        ref = torch.fake_quantize_per_tensor_affine(model[1](ref), *fq["1"], 0, 255)
    assert torch.equal(got, ref)


def test_the_modern_block_converts_and_stays_close_to_its_fake_quant_stage():
    qm, x = _calibrated_block()
    with torch.no_grad():
        fake = qm(x)
        quantized = convert(qm)(x)
    step = float(quant_points(qm)["softmax"].scale)
    assert torch.isfinite(quantized).all()
    assert float((fake - quantized).abs().max()) <= 4 * step  # the folded scalars round once, not twice


# -- scalar mul / div folded ------------------------------------------------------------------------
class ScalarOps(nn.Module):
    def __init__(self, op: str, c: float):
        super().__init__()
        self.op, self.c = op, c

    def forward(self, x):
        if self.op == "mul":
            return x * self.c
        if self.op == "rmul":
            return self.c * x
        if self.op == "div":
            return x / self.c
        if self.op == "neg":  # rotary embeddings' rotate_half
            return -x
        if self.op == "torch_neg":
            return torch.neg(x)
        return torch.div(x, self.c)


def _reference(q_in: list[int], multiplier: Fraction, z_out: int, qmin: int, qmax: int) -> list[int]:
    """docs/engine.md: M = f 2^e -> m0 = round_half_even(f 2^p), n = p - e, p = min(31, 62 -
    bits(max |acc|)) (at least 8); q = z + round_half_away(acc m0 / 2^n), clamped.  The sign of c
    is taken into the accumulator; M > 0."""
    bits = max(min(31, 62 - max(max(abs(v) for v in q_in).bit_length(), 1)), 8)
    mantissa, exponent = math.frexp(float(multiplier))
    m0, n = round(mantissa * 2**bits), bits - exponent
    out = []
    for v in q_in:
        x = Fraction(v * m0, 2**n) if n >= 0 else Fraction(v * m0 * 2**-n)
        r = (1 if x >= 0 else -1) * math.floor(abs(x) + Fraction(1, 2))
        out.append(min(max(r + z_out, qmin), qmax))
    return out


@pytest.mark.parametrize("op,c", [("mul", 3.0), ("rmul", -0.75), ("div", 2.0), ("torch_div", -3.0), ("mul", 0.1),
                                  ("neg", -1.0), ("torch_neg", -1.0)])
def test_a_scalar_mul_or_div_is_folded_into_the_requantization_exactly(op, c):
    torch.manual_seed(2)
    x = torch.randn(4, 33)
    qm = prepare(ScalarOps(op, c), QConfig(activation=UINT8), example_inputs=x)
    calibrate(qm, [x])
    points = quant_points(qm)
    out_name = "div" if op in ("div", "torch_div") else "neg" if "neg" in op else "mul"
    assert list(points) == ["input", out_name]
    qi, qy = points["input"], points[out_name]
    # Power-of-two scales: s_in c / s_y lands ties on a grid of halves (round half away from zero
    # in the kernel, half to even in a float computation) -- the case that shows a second rounding.
    qi.set_qparams(torch.tensor(2.0**-5), torch.tensor(128))
    qy.set_qparams(torch.tensor(2.0**-4), torch.tensor(128))
    with torch.no_grad():
        got = convert(qm)(x)
    q_in = torch.fake_quantize_per_tensor_affine(x, 2.0**-5, 128, 0, 255).double().div(2.0**-5).round().long()
    factor = Fraction(1) / Fraction(abs(c)) if "div" in op else Fraction(abs(c))
    signed = (q_in if c > 0 else -q_in).flatten().tolist()
    expected = _reference(signed, Fraction(2**-5) * factor / Fraction(2**-4), 128, 0, 255)
    expected = (torch.tensor(expected).reshape(x.shape) - 128).float() * 2.0**-4
    assert torch.equal(got, expected)


# -- constants: what reads no activation is folded, as an exporter folds it -------------------------
class Rotary(nn.Module):
    """Llama's rotary embedding, written as transformers writes it: cos/sin tables computed in the
    forward from a buffer and integer positions, applied to an activation with rotate_half."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, x):
        positions = torch.arange(x.shape[1])
        freqs = self.inv_freq[None, :, None].float() @ positions[None, None, :].float()
        emb = torch.cat((freqs.transpose(1, 2), freqs.transpose(1, 2)), dim=-1)
        cos, sin = emb.cos() * 1.0, emb.sin() * 1.0
        q = self.proj(x)
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return q * cos + rotated * sin


def test_ops_reading_no_activation_are_folded_and_the_tables_quantized_once():
    torch.manual_seed(3)
    x = torch.randn(2, 6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no float fallback reported: cos/sin are constants
        qm = prepare(Rotary(), example_inputs=x)
    points = quant_points(qm)
    # the matmul, cat, cos and sin of the tables have no point; the two tables an activation op
    # reads (cos * 1.0, sin * 1.0) are quantized once, like a deployed model's initializers
    assert [n for n in points if not n.startswith(("proj", "input"))] == ["mul", "mul#2", "neg", "cat#2", "mul#3",
                                                                          "mul#4", "add"]
    assert not any(p.fallback for p in points.values())
    calibrate(qm, [x])
    table = points["mul"]
    positions = torch.arange(6).double()
    angles = positions[:, None] * (1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8)))[None, :]
    cos = torch.cat((angles, angles), -1).cos().float()
    assert float(table.observer.max_val) == pytest.approx(float(cos.max()), abs=1e-6)
    seen = {}
    handle = qm.proj.register_forward_hook(lambda m, a, out: seen.setdefault("q", out))
    with torch.no_grad():
        got = qm(x)
    handle.remove()
    fq = lambda t, p: torch.fake_quantize_per_tensor_affine(t, float(p.scale), int(p.zero_point), p.spec.qmin,
                                                            p.spec.qmax)
    q = seen["q"]
    cos_q = fq(cos, table)[None]
    sin_q = fq(torch.cat((angles, angles), -1).sin().float(), points["mul#2"])[None]
    half = torch.cat((fq(-q[..., 4:], points["neg"]), q[..., :4]), -1)
    expected = fq(fq(q * cos_q, points["mul#3"]) + fq(fq(half, points["cat#2"]) * sin_q, points["mul#4"]),
                  points["add"])
    assert torch.equal(got, expected)


def test_what_an_integer_input_becomes_is_an_activation_not_a_constant():
    class Pixels(nn.Module):  # a deployment wrapper reading uint8 pixels
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return self.conv(x.float() / 255 - 0.5)

    x = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    qm = prepare(Pixels(), example_inputs=x)
    assert [n for n in quant_points(qm) if not n.startswith("conv")] == ["div", "sub"]
    calibrate(qm, [x])
    seen = {}
    qm.conv.register_forward_pre_hook(lambda m, args: seen.setdefault("in", args[0]))
    with torch.no_grad():
        qm(x)
    div, sub = quant_points(qm)["div"], quant_points(qm)["sub"]
    fq = lambda t, p: torch.fake_quantize_per_tensor_affine(t, float(p.scale), int(p.zero_point), p.spec.qmin,
                                                            p.spec.qmax)
    normalised = x.float() / 255 - 0.5
    assert torch.equal(seen["in"], fq(fq(x.float() / 255, div) - 0.5, sub))
    assert not torch.equal(seen["in"], normalised)  # the conv reads quantized pixels, as deployed


def test_a_library_rms_norm_module_is_one_norm_op():
    class LlamaRMSNorm(nn.Module):  # transformers' own, as written there
        def __init__(self, size, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.linspace(0.5, 1.5, size))
            self.variance_epsilon = eps

        def forward(self, h):
            variance = h.pow(2).mean(-1, keepdim=True)
            return self.weight * (h * torch.rsqrt(variance + self.variance_epsilon))

    model = nn.Sequential(nn.Linear(8, 8), LlamaRMSNorm(8))
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pow and rsqrt are no fallbacks here
        qm = prepare(model, example_inputs=x)
    assert [n for n in quant_points(qm) if not n.startswith(("0", "input"))] == ["1"]
    calibrate(qm, [x])
    set_mode(qm, "float")
    set_mode(qm, "fake", "1")
    point = quant_points(qm)["1"]
    with torch.no_grad():
        expected = torch.fake_quantize_per_tensor_affine(F.rms_norm(model[0](x), (8,), model[1].weight, 1e-6),
                                                         float(point.scale), int(point.zero_point), point.spec.qmin,
                                                         point.spec.qmax)
        assert torch.allclose(qm(x), expected, atol=float(point.scale) * 1e-3)  # rsqrt vs F.rms_norm: ulp apart
    not_a_norm = type("FancyRMSNorm", (nn.Module,), {})()
    not_a_norm.scale = nn.Parameter(torch.ones(3))  # another parameter name: not recognised
    assert module_category(not_a_norm) is None


def test_only_division_of_a_tensor_by_a_number_folds():
    x, y = torch.ones(3), torch.ones(3)
    assert function_category(torch.Tensor.__truediv__, (x, 2.0), {}) == "mul"
    assert function_category(torch.div, (x, 2), {}) == "mul"
    assert function_category(torch.Tensor.__mul__, (x, 0.5), {}) == "mul"
    assert function_category(torch.Tensor.__truediv__, (x, y), {}) == "fallback"  # by a tensor
    assert function_category(torch.div, (2.0, x), {}) == "fallback"  # a reciprocal
    assert function_category(torch.div, (x, 2.0), {"rounding_mode": "floor"}) == "fallback"
    assert function_category(torch.Tensor.__truediv__, (x, 0.0), {}) == "fallback"


# -- what stays float, and why ----------------------------------------------------------------------
class WithFloatOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(10, 8, mode="mean")
        self.fc = nn.Linear(8, 8)

    def forward(self, ids):
        h = self.fc(self.emb(ids))
        return h / h.abs().amax(dim=-1, keepdim=True)


def test_prepare_and_inspect_name_each_float_op_with_its_reason():
    from qdebug.tools.inspect import inspect_model

    ids = torch.randint(0, 10, (2, 5))
    with pytest.warns(UserWarning, match="no quantized kernel") as record:
        qm = prepare(WithFloatOps().eval(), QConfig(), example_inputs=ids)
    message = " ".join(str(w.message) for w in record)
    assert f"emb (EmbeddingBag: {fallback_reason('EmbeddingBag')})" in message
    assert "division by a tensor" in message
    calibrate(qm, [ids])
    checks = inspect_model(qm, stage="calibrated").checks
    rows = checks[checks["check"] == "float fallback"].set_index("layer")
    assert {"emb", "div"} <= set(rows.index)  # abs, amax: float too, with the default reason
    assert fallback_reason("EmbeddingBag") in rows.loc["emb", "detail"]
    assert "no quantized kernel known to qdebug" in rows.loc["abs", "detail"]
    assert "division by a tensor" in rows.loc["div", "detail"]
    assert fallback_reason("some_custom_op") == "no quantized kernel known to qdebug for this op"


# -- Embedding: weight quantized per row ------------------------------------------------------------
class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 6, padding_idx=0)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


def _prepared_embedder():
    torch.manual_seed(4)
    model = Embedder().eval()
    ids = torch.randint(0, 12, (3, 7))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an embedding is no float fallback any more
        qm = prepare(model, QConfig(), example_inputs=ids)
    calibrate(qm, [ids])
    return model, qm, ids


def test_an_embedding_keeps_its_weight_and_quantizes_it_per_row_as_torch_ao_observes():
    model, qm, ids = _prepared_embedder()
    assert qm.emb.weight is qm.state_dict(keep_vars=True)["emb.weight"]
    assert torch.equal(qm.emb.weight, model.emb.weight)
    point = quant_points(qm)["emb.weight"]
    spec = point.spec  # the default weight spec, int8 symmetric: s = max |row| / 127 (docs/engine.md)
    observer = torch.ao.quantization.PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, quant_min=-spec.qmax,
                                                              quant_max=spec.qmax, qscheme=torch.per_channel_symmetric)
    observer(model.emb.weight.detach())
    scale, zero_point = observer.calculate_qparams()
    assert point.scale.shape == (12,)  # one scale per embedding vector
    assert torch.allclose(point.scale, scale) and not torch.any(point.zero_point)


def test_an_embedding_output_is_the_lookup_of_torch_fake_quantized_rows():
    model, qm, ids = _prepared_embedder()
    points = quant_points(qm)
    w_point, out_point = points["emb.weight"], points["emb"]
    assert not out_point.fallback
    rows = torch.fake_quantize_per_channel_affine(model.emb.weight.detach(), w_point.scale.detach(),
                                                  w_point.zero_point.int(), 0, w_point.spec.qmin, w_point.spec.qmax)
    expected = torch.fake_quantize_per_tensor_affine(F.embedding(ids, rows), float(out_point.scale),
                                                     int(out_point.zero_point), out_point.spec.qmin,
                                                     out_point.spec.qmax)
    captured = {}
    qm.norm.register_forward_pre_hook(lambda module, args: captured.update(x=args[0]))
    with torch.no_grad():
        qm(ids)
    assert torch.equal(captured["x"], expected)


def test_an_embedding_survives_convert_save_and_load(tmp_path):
    import qdebug

    _, qm, ids = _prepared_embedder()
    with torch.no_grad():
        fake = qm(ids)
        quantized = convert(qm)(ids)
    assert torch.isfinite(quantized).all() and float((fake - quantized).abs().max()) < 0.05
    path = qdebug.save(qm, tmp_path / "emb.pt", stage="calibrated")
    loaded, info = qdebug.load(path, model=f"{Embedder.__module__}:Embedder")
    assert info.stage == "calibrated" and "emb.weight" in quant_points(loaded)
    with torch.no_grad():
        assert torch.equal(loaded(ids), fake)


# -- PReLU: quantized slope, integer kernel --------------------------------------------------------
class ConvPReLU(nn.Module):
    def __init__(self, channels: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(2, channels, 3, padding=1)
        self.act = nn.PReLU(channels)

    def forward(self, x):
        return self.act(self.conv(x))


def _prepared_prelu(qconfig: QConfig, channels: int = 4):
    torch.manual_seed(5)
    model = ConvPReLU(channels).eval()
    with torch.no_grad():
        model.act.weight.copy_(torch.linspace(-0.3, 0.6, channels))
    x = torch.randn(2, 2, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a PReLU is no float fallback
        qm = prepare(model, qconfig, example_inputs=x)
    calibrate(qm, [x])
    return model, qm, x


def _codes_of(t: torch.Tensor, point) -> torch.Tensor:
    return torch.round(t.double() / point.scale.double()).long()  # q - z


def test_a_prelu_slope_is_quantized_and_its_integer_kernel_is_exact():
    model, qm, x = _prepared_prelu(QConfig(activation=UINT8))
    points = quant_points(qm)
    slope, conv_out, out = points["act.weight"], points["conv"], points["act"]
    assert slope.kind == "weight" and slope.scale.shape == (4,) and not out.fallback  # one slope per channel
    # Power-of-two scales: s_x / s_y = 1/2 puts every odd positive code on a tie.
    conv_out.set_qparams(torch.tensor(2.0**-5), torch.tensor(128))
    out.set_qparams(torch.tensor(2.0**-4), torch.tensor(100))
    captured = {}
    qc = convert(qm)
    qc.act.register_forward_pre_hook(lambda module, args: captured.update(x=args[0]))
    with torch.no_grad():
        got = qc(x)
    q_x = _codes_of(captured["x"], conv_out)
    q_a = torch.round(model.act.weight.detach().double() / slope.scale.double()).long()  # symmetric: z_a = 0
    expected = []
    channels = torch.arange(q_x.shape[1]).reshape(1, -1, 1, 1).expand_as(q_x)
    for c, v in zip(channels.flatten().tolist(), q_x.flatten().tolist()):
        if v >= 0:
            expected += _reference([v], Fraction(2**-5) / Fraction(2**-4), 100, 0, 255)
        else:
            m = Fraction(2**-5) * Fraction(float(slope.scale[c])) / Fraction(2**-4)
            expected += _reference([v * int(q_a[c])], m, 100, 0, 255)
    expected = (torch.tensor(expected).reshape(q_x.shape) - 100).float() * 2.0**-4
    assert torch.equal(got, expected)
    assert bool(((q_x > 0) & (q_x % 2 == 1)).any())  # ties were there


def test_a_prelu_agrees_with_torch_ao_quantized_prelu_on_the_same_codes():
    per_tensor_quint8 = {"weight": {"signed": False, "symmetric": False, "per_channel": False}}
    _, qm, x = _prepared_prelu(QConfig(activation=UINT8, overrides={"act": per_tensor_quint8}), channels=3)
    points = quant_points(qm)
    slope, conv_out, out = points["act.weight"], points["conv"], points["act"]
    # torch's kernel is no oracle everywhere: with some qparams (e.g. calibrated s_y ~ 0.0093, z_y = 67,
    # slope z = 85) it is tens of LSB off its own float math, positive inputs included (torch 2.13,
    # x86).  These qparams are where it stays within half an LSB of that math.
    conv_out.set_qparams(torch.tensor(1 / 64), torch.tensor(128))
    slope.set_qparams(torch.tensor(1 / 128), torch.tensor(20))
    slope.freeze(True)
    out.set_qparams(torch.tensor(1 / 32), torch.tensor(100))
    captured = {}
    qc = convert(qm)
    qc.act.register_forward_pre_hook(lambda module, args: captured.update(x=args[0]))
    with torch.no_grad():
        got = qc(x)
    s_x, z_x = float(conv_out.scale), int(conv_out.zero_point)
    reference = torch.ao.nn.quantized.PReLU(float(out.scale), int(out.zero_point), 3)
    reference.set_weight(torch.quantize_per_tensor(qm.act.weight.detach(), float(slope.scale), int(slope.zero_point),
                                                   torch.quint8))
    q_in = torch.quantize_per_tensor(captured["x"], s_x, z_x, torch.quint8)
    torch_codes = reference(q_in).int_repr().long()
    ours = _codes_of(got, out) + int(out.zero_point)
    # torch's kernel dequantizes and rounds a float32 product half to even: at most 1 code apart
    # (ties: s_x / s_y = 1/2), and equal where nothing rounds (an even positive q_x - z_x).
    assert int((ours - torch_codes).abs().max()) <= 1
    exact = (q_in.int_repr().long() - z_x) % 2 == 0
    exact &= q_in.int_repr().long() >= z_x
    assert bool(exact.any()) and torch.equal(ours[exact], torch_codes[exact])


def test_a_prelu_fake_quant_stage_is_torch_prelu_on_the_fake_quantized_slope():
    model, qm, x = _prepared_prelu(QConfig(activation=UINT8))
    points = quant_points(qm)
    slope, out = points["act.weight"], points["act"]
    captured = {}
    qm.act.register_forward_pre_hook(lambda module, args: captured.update(x=args[0]))
    with torch.no_grad():
        got = qm(x)
        a = torch.fake_quantize_per_channel_affine(model.act.weight, slope.scale, slope.zero_point.int(), 0,
                                                   slope.spec.qmin, slope.spec.qmax)
        expected = torch.fake_quantize_per_tensor_affine(F.prelu(captured["x"], a), float(out.scale),
                                                         int(out.zero_point), 0, 255)
    assert torch.equal(got, expected)
    assert qm.act.weight is qm.state_dict(keep_vars=True)["act.weight"]


def test_inspect_shows_the_weight_of_an_embedding_and_a_prelu():
    from qdebug.tools.inspect import inspect_model

    _, qm, _ = _prepared_prelu(QConfig(activation=UINT8))
    layers = inspect_model(qm, stage="calibrated").layers.set_index("layer")
    assert layers.loc["act", "weight"] and layers.loc["act", "weight_scale_min"] is not None
    _, qm, _ = _prepared_embedder()
    layers = inspect_model(qm, stage="calibrated").layers.set_index("layer")
    assert layers.loc["emb", "weight"] and layers.loc["emb", "activation"] != "float"
