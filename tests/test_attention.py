"""Attention as deployments run it (issue 28, must-have 3): activation x activation matmul and
``nn.MultiheadAttention``.

Oracles: an integer reference written here from docs/engine.md (codes from torch's own
``fake_quantize_per_tensor_affine``, an int64 matmul, the documented fixed-point
requantization in Python integers); ``nn.MultiheadAttention`` itself (float mode);
``torch.ao.nn.quantizable.MultiheadAttention`` with FakeQuantize modules set to the same
qparams (fake-quant mode).  Nothing here compares qdebug with itself, except a saved and
reloaded model with the one that was saved.
"""

from __future__ import annotations

import copy
import math
import warnings
from fractions import Fraction

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from qdebug.engine import QConfig, QuantSpec, calibrate, convert, engine_state, prepare, quant_points, set_mode
from qdebug.engine.attention import QMultiheadAttention
from qdebug.engine.ops import function_category

UINT8 = QuantSpec(signed=False, symmetric=False)


# -- activation x activation matmul -------------------------------------------------------------
OPS = {
    "matmul": torch.matmul,
    "bmm": torch.bmm,
    "@": lambda a, b: a @ b,
    "Tensor.matmul": lambda a, b: a.matmul(b),
}


class TwoInputMatmul(nn.Module):
    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def forward(self, a, b):
        return OPS[self.op](a, b)


def test_matmul_of_two_activations_is_a_category_of_its_own_and_with_a_weight_a_fallback():
    a, b = torch.ones(2, 3), torch.ones(3, 2)
    w = nn.Parameter(torch.ones(3, 2))
    assert function_category(torch.matmul, (a, b), {}) == "matmul"
    assert function_category(torch.bmm, (a[None], b[None]), {}) == "matmul"
    assert function_category(torch.Tensor.__matmul__, (a, b), {}) == "matmul"
    assert function_category(torch.matmul, (a, w), {}) == "fallback"  # an inline linear layer


def _reference_requantize(acc: list[int], multiplier: float, z_out: int, qmin: int, qmax: int) -> list[int]:
    """docs/engine.md: M = f 2^e -> m0 = round_half_even(f 2^p), n = p - e with p = min(31, 62 -
    bits(max |acc|)) (at least 8); q = z + round_half_away(acc m0 / 2^n), clamped.  Exact rationals."""
    bits = max(min(31, 62 - max(max(abs(v) for v in acc).bit_length(), 1)), 8)
    mantissa, exponent = math.frexp(multiplier)
    m0, n = round(mantissa * 2**bits), bits - exponent
    out = []
    for v in acc:
        x = Fraction(v * m0, 2**n) if n >= 0 else Fraction(v * m0 * 2**-n)
        r = (1 if x >= 0 else -1) * math.floor(abs(x) + Fraction(1, 2))
        out.append(min(max(r + z_out, qmin), qmax))
    return out


def _codes(x: torch.Tensor, point) -> torch.Tensor:
    """q - z of ``x`` quantized by torch's own fake quantization with the point's qparams."""
    s, z = float(point.scale), int(point.zero_point)
    fq = torch.fake_quantize_per_tensor_affine(x, s, z, point.spec.qmin, point.spec.qmax)
    return torch.round(fq.double() / s).to(torch.int64)


def _prepared_matmul(op: str, a: torch.Tensor, b: torch.Tensor, qparams: dict | None):
    qm = prepare(TwoInputMatmul(op), QConfig(activation=UINT8), example_inputs=(a, b))
    calibrate(qm, [(a, b), (a * 1.5, b * 1.5)])
    points = quant_points(qm)
    for name, (s, z) in (qparams or {}).items():
        points[name].set_qparams(torch.tensor(s), torch.tensor(z))
    return qm, points


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("ties", [True, False], ids=["ties", "calibrated"])
def test_integer_matmul_is_exact_against_a_float64_reference(op, ties):
    torch.manual_seed(3)
    a, b = torch.randn(2, 3, 8), torch.randn(2, 8, 5)
    out_name = "bmm" if op == "bmm" else "matmul"
    # Power-of-two scales with s_y = 2 s_a s_b: M = 1/2, so every odd accumulator is a tie
    # (rounded away from zero by the kernel; a float computation rounds it to even).
    qparams = {"input": (2.0**-5, 120), "input#2": (2.0**-4, 131), out_name: (2.0**-8, 128)} if ties else None
    qm, points = _prepared_matmul(op, a, b, qparams)
    assert list(points) == ["input", "input#2", out_name]
    qa, qb, qy = points["input"], points["input#2"], points[out_name]
    with torch.no_grad():
        got = convert(qm)(a, b)

    acc = torch.matmul(_codes(a, qa), _codes(b, qb))  # int64: exact
    multiplier = float(qa.scale.double() * qb.scale.double() / qy.scale.double())
    expected = _reference_requantize(acc.flatten().tolist(), multiplier, int(qy.zero_point), qy.spec.qmin, qy.spec.qmax)
    expected = (torch.tensor(expected).reshape(acc.shape) - int(qy.zero_point)).float() * qy.scale
    assert torch.equal(got, expected)
    if ties:
        odd = acc % 2 != 0
        inside = (acc.abs() < 200)  # away from the clamp
        assert bool((odd & inside).any())  # the case a float kernel rounds differently


# -- nn.MultiheadAttention ------------------------------------------------------------------------
E, HEADS, L, S, B = 16, 4, 5, 6, 3


class SelfAttention(nn.Module):
    """y, w = attn(x, x, x, masks...) (or cross attention on a second input)."""

    def __init__(self, batch_first=False, need_weights=True, average=True, attn_mask=None, key_padding_mask=None,
                 **mha):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, HEADS, batch_first=batch_first, **mha)
        self.need_weights, self.average = need_weights, average
        self.attn_mask, self.key_padding_mask = attn_mask, key_padding_mask

    def forward(self, x, memory=None):
        memory = x if memory is None else memory
        return self.attn(x, memory, memory, key_padding_mask=self.key_padding_mask, need_weights=self.need_weights,
                         attn_mask=self.attn_mask, average_attn_weights=self.average)


def _masks(kind: str, length: int = L):
    g = torch.Generator().manual_seed(5)
    if kind == "none":
        return {}
    if kind == "bool_attn":
        return {"attn_mask": torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)}
    if kind == "float_attn":
        return {"attn_mask": torch.randn(length, length, generator=g)}
    if kind == "padding":
        mask = torch.zeros(B, length, dtype=torch.bool)
        mask[0, -2:] = True
        return {"key_padding_mask": mask}
    raise ValueError(kind)


def _input(batch_first: bool, length: int = L, seed: int = 0):
    x = torch.randn(B, length, E, generator=torch.Generator().manual_seed(seed))
    return x if batch_first else x.transpose(0, 1).contiguous()


def _prepare_quietly(model, x, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an MHA that is decomposed is no fallback: no warning
        return prepare(model, example_inputs=(x,), **kwargs)


def test_quant_points_list_the_attention_parts_in_order():
    x = _input(False)
    qm = _prepare_quietly(SelfAttention().eval(), x)
    assert isinstance(qm.attn, QMultiheadAttention)
    assert list(quant_points(qm)) == [
        "input",
        "attn.linear_Q.weight", "attn.linear_Q",
        "attn.linear_K.weight", "attn.linear_K",
        "attn.linear_V.weight", "attn.linear_V",
        "attn.bmm",  # QK^T (scaled)
        "attn.softmax",
        "attn.bmm#2",  # attn.V: torch.ao's quant_attn_output
        "attn.out_proj.weight", "attn.out_proj",
        "attn.quant_attn_output_weights",
    ]


def test_softmax_output_is_unsigned_by_default_and_an_override_wins():
    x = _input(False)
    qm = _prepare_quietly(SelfAttention().eval(), x)
    spec = quant_points(qm)["attn.softmax"].spec
    assert (spec.bits, spec.signed, spec.symmetric) == (8, False, False)
    assert quant_points(qm)["attn.bmm"].spec.signed  # the logits keep the configured spec
    cfg = QConfig(overrides={"attn.softmax": {"activation": {"bits": 16, "signed": True}}})
    spec = quant_points(_prepare_quietly(SelfAttention().eval(), x, qconfig=cfg))["attn.softmax"].spec
    assert (spec.bits, spec.signed) == (16, True)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("masks", ["none", "bool_attn", "float_attn", "padding"])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_float_mode_is_bit_identical_to_nn_multihead_attention(batch_first, masks, need_weights, grad):
    torch.manual_seed(1)
    model = SelfAttention(batch_first, need_weights, **_masks(masks)).eval()
    x = _input(batch_first, seed=2)
    qm = _prepare_quietly(model, x)
    with torch.set_grad_enabled(grad):  # no_grad + batch_first: torch's fused fast path
        expected, got = model(x), qm(x)
    assert torch.equal(got[0], expected[0])
    assert (got[1] is None) == (expected[1] is None)
    if expected[1] is not None:
        assert torch.equal(got[1], expected[1])


def test_float_mode_cross_attention_with_kdim_vdim_and_unbatched_input():
    torch.manual_seed(4)
    model = SelfAttention(kdim=8, vdim=12).eval()

    class Cross(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = model.attn

        def forward(self, q, k, v):
            return self.attn(q, k, v)

    q, k, v = torch.randn(L, B, E), torch.randn(S, B, 8), torch.randn(S, B, 12)
    cross = Cross().eval()
    qm = prepare(cross, example_inputs=(q, k, v))
    for args in ((q, k, v), (q[:, 0], k[:, 0], v[:, 0])):
        expected, got = cross(*args), qm(*args)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def _torch_ao_twin(mha: nn.MultiheadAttention, points: dict, path: str = "attn"):
    """torch.ao's quantizable MHA of ``mha`` whose FakeQuantize modules hold the qdebug points' qparams
    and whose linear weights are torch's fake quantization of the float weights with them."""
    from torch.ao.nn.quantizable import MultiheadAttention as AOMultiheadAttention
    from torch.ao.quantization import FakeQuantize, MinMaxObserver
    from torch.ao.quantization import QConfig as AOQConfig

    act = points[f"{path}.linear_Q"].spec
    float_mha = copy.deepcopy(mha)
    float_mha.qconfig = AOQConfig(
        activation=FakeQuantize.with_args(observer=MinMaxObserver, quant_min=act.qmin, quant_max=act.qmax,
                                          dtype=torch.qint8 if act.signed else torch.quint8),
        weight=FakeQuantize.with_args(observer=MinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8),
    )
    ao = AOMultiheadAttention.from_float(float_mha)
    places = {
        "linear_Q": ao.linear_Q, "linear_K": ao.linear_K, "linear_V": ao.linear_V, "out_proj": ao.out_proj,
        "bmm#2": ao.quant_attn_output, "quant_attn_output_weights": ao.quant_attn_output_weights,
    }
    with torch.no_grad():
        for name, module in places.items():
            fq, point = module.activation_post_process, points[f"{path}.{name}"]
            fq.disable_observer()
            fq.scale = point.scale.detach().reshape(1).clone()
            fq.zero_point = point.zero_point.reshape(1).clone()
        for name in ("linear_Q", "linear_K", "linear_V", "out_proj"):
            linear, point = places[name], points[f"{path}.{name}.weight"]
            spec = point.spec
            if spec.per_channel:
                w = torch.fake_quantize_per_channel_affine(linear.weight, point.scale, point.zero_point, spec.ch_axis,
                                                           spec.qmin, spec.qmax)
            else:
                w = torch.fake_quantize_per_tensor_affine(linear.weight, float(point.scale), int(point.zero_point),
                                                          spec.qmin, spec.qmax)
            linear.weight = nn.Parameter(w)
    return ao.eval()


@pytest.mark.parametrize("masks", ["none", "bool_attn", "float_attn", "padding"])
@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("activation", ["int8", "uint8"])
def test_fake_quant_is_bit_identical_to_torch_ao_quantizable_mha(masks, average, activation):
    torch.manual_seed(6)
    model = SelfAttention(average=average, **_masks(masks)).eval()
    x = _input(False, seed=7)
    cfg = QConfig(activation=UINT8) if activation == "uint8" else QConfig()
    qm = _prepare_quietly(model, x, qconfig=cfg)
    calibrate(qm, [_input(False, seed=s) for s in (7, 8)])
    set_mode(qm, "float", "attn.bmm")  # torch.ao leaves QK^T and the softmax output in float
    set_mode(qm, "float", "attn.softmax")
    points = quant_points(qm)
    ao = _torch_ao_twin(model.attn, points)
    s_in, z_in, spec_in = float(points["input"].scale), int(points["input"].zero_point), points["input"].spec
    with torch.no_grad():
        got = qm(x)
        xq = torch.fake_quantize_per_tensor_affine(x, s_in, z_in, spec_in.qmin, spec_in.qmax)
        expected = ao(xq, xq, xq, key_padding_mask=model.key_padding_mask, attn_mask=model.attn_mask,
                      average_attn_weights=average)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
    with torch.no_grad():  # and quantization really acts: float mode gives another output
        set_mode(qm, "float")
        assert not torch.equal(qm(x)[0], got[0])


def test_integer_stage_runs_both_attention_matmuls_as_integer_kernels():
    torch.manual_seed(8)
    model = SelfAttention().eval()
    x = _input(False, seed=9)
    qm = _prepare_quietly(model, x)
    calibrate(qm, [x])
    seen = {}

    def spy(event):
        if event.call.name in ("attn.bmm", "attn.bmm#2"):
            seen[event.call.name] = [t.detach().clone() for t in event.inputs] + [event.out.detach().clone()]

    qmodel = convert(qm)
    engine_state(qmodel).listeners.append(spy)
    with torch.no_grad():
        y = qmodel(x)[0]
    assert torch.isfinite(y).all()
    points = quant_points(qmodel)
    c = (E // HEADS) ** -0.5
    for name, (pa, pb), transpose in (("attn.bmm", ("attn.linear_Q", "attn.linear_K"), True),
                                      ("attn.bmm#2", ("attn.softmax", "attn.linear_V"), False)):
        a, b, out = seen[name]
        p_a, p_b, p_y = points[pa], points[pb], points[name]
        s_a = p_a.scale.double() * (c if name == "attn.bmm" else 1.0)  # the 1/sqrt(d) folded into M
        qa = torch.round(a.double() / s_a).to(torch.int64)
        qb = torch.round(b.double() / p_b.scale.double()).to(torch.int64)
        acc = torch.bmm(qa, qb)  # b already transposed by the model (k.transpose(1, 2))
        multiplier = float(s_a * p_b.scale.double() / p_y.scale.double())
        z = int(p_y.zero_point)
        expected = _reference_requantize(acc.flatten().tolist(), multiplier, z, p_y.spec.qmin, p_y.spec.qmax)
        expected = (torch.tensor(expected).reshape(acc.shape) - z).float() * p_y.scale
        assert torch.equal(out, expected), name


def test_calibrated_model_with_attention_survives_a_state_dict_round_trip():
    torch.manual_seed(10)
    model = SelfAttention(**_masks("padding")).eval()
    x = _input(False, seed=11)
    qm = _prepare_quietly(model, x)
    calibrate(qm, [x])
    with torch.no_grad():
        before = qm(x)
    fresh = prepare(copy.deepcopy(model), plan=engine_state(qm).plan.to_dict())
    missing, unexpected = fresh.load_state_dict(qm.state_dict())
    assert not missing and not unexpected
    set_mode(fresh, "fake")
    with torch.no_grad():
        after = fresh(x)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


@pytest.mark.parametrize("stage", ["calibrated", "quantized"])
def test_qdebug_save_and_load_keep_an_attention_model(tmp_path, stage):
    """The saved plan names the attention's parts (modules the float class does not have):
    the load must rebuild them and give the same outputs."""
    import qdebug

    torch.manual_seed(13)
    x = _input(False, seed=14)
    qm = _prepare_quietly(SelfAttention().eval(), x)
    calibrate(qm, [x])
    model = convert(qm) if stage == "quantized" else qm
    loaded, _ = qdebug.load(qdebug.save(model, tmp_path / f"{stage}.pt"))
    assert isinstance(loaded.attn, QMultiheadAttention)
    with torch.no_grad():
        before, after = model(x), loaded(x)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_a_float_multihead_attention_state_dict_loads_into_the_decomposition():
    torch.manual_seed(12)
    mha = nn.MultiheadAttention(E, HEADS).eval()
    other = QMultiheadAttention(E, HEADS).eval()
    other.load_state_dict(mha.state_dict())
    x = torch.randn(L, B, E)
    assert torch.equal(other(x, x, x)[0], mha(x, x, x)[0])


def test_attention_with_bias_kv_stays_a_reported_float_fallback():
    model = SelfAttention(add_bias_kv=True).eval()
    x = _input(False)
    with pytest.warns(UserWarning, match="attn"):
        qm = prepare(model, example_inputs=(x,))
    assert isinstance(qm.attn, nn.MultiheadAttention)
    fallbacks = [name for name, p in quant_points(qm).items() if p.fallback]
    assert fallbacks and all(name.startswith("attn") for name in fallbacks)  # its output point(s)


class AttentionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, HEADS)
        self.fc = nn.Linear(E, 4)

    def forward(self, x):
        return self.fc(self.attn(x, x, x)[0])


def test_compare_against_the_float_model_has_a_row_for_every_attention_part():
    """The float reference (an nn.MultiheadAttention: one call) is decomposed as prepare does, so
    each part of the prepared attention has its reference row, not "not in the reference model"."""
    import qdebug

    torch.manual_seed(15)
    model = AttentionBlock().eval()
    xs = [(_input(False, seed=s),) for s in range(2)]
    qm = _prepare_quietly(model, xs[0][0])
    calibrate(qm, xs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frame = qdebug.compare(model, qm, data=xs)
    rows = frame.set_index("layer")
    for part in ("attn.linear_Q", "attn.bmm", "attn.softmax", "attn.bmm#2", "attn.out_proj", "fc"):
        assert rows.loc[part, "sqnr_db"] > 20, part
    assert isinstance(model.attn, nn.MultiheadAttention)  # the user's model is left alone


# -- F.scaled_dot_product_attention written inline ------------------------------------------------
class InlineAttention(nn.Module):
    """q, k, v projections, then F.scaled_dot_product_attention on (B, H, L, d) heads."""

    def __init__(self, causal=False, kv_heads=HEADS, attn_mask=None, scale=None):
        super().__init__()
        self.q = nn.Linear(E, E)
        self.k = nn.Linear(E, kv_heads * (E // HEADS))
        self.v = nn.Linear(E, kv_heads * (E // HEADS))
        self.causal, self.kv_heads, self.attn_mask, self.scale = causal, kv_heads, attn_mask, scale

    def forward(self, x):
        b, length, _ = x.shape
        d = E // HEADS
        q = self.q(x).view(b, length, HEADS, d).transpose(1, 2)
        k = self.k(x).view(b, length, self.kv_heads, d).transpose(1, 2)
        v = self.v(x).view(b, length, self.kv_heads, d).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.attn_mask, is_causal=self.causal, scale=self.scale,
                                           enable_gqa=self.kv_heads != HEADS)
        return y.transpose(1, 2).reshape(b, length, E)


SDPA_CASES = {
    "plain": {},
    "causal": {"causal": True},
    "bool_mask": {"attn_mask": torch.rand(L, L, generator=torch.Generator().manual_seed(1)) > 0.3},
    "float_mask": {"attn_mask": torch.randn(L, L, generator=torch.Generator().manual_seed(2))},
    "gqa_scale": {"kv_heads": 2, "scale": 0.3},
}


def test_inline_sdpa_is_decomposed_into_points():
    x = _input(True)
    qm = _prepare_quietly(InlineAttention().eval(), x)
    assert list(quant_points(qm))[-3:] == ["matmul", "softmax", "matmul#2"]


@pytest.mark.parametrize("case", list(SDPA_CASES))
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_inline_sdpa_float_mode_is_bit_identical_to_torch(case, grad):
    torch.manual_seed(16)
    model = InlineAttention(**SDPA_CASES[case]).eval()
    x = _input(True, seed=17)
    qm = _prepare_quietly(model, x)
    with torch.set_grad_enabled(grad):
        assert torch.equal(qm(x), model(x))


def _fq(t, point):
    return torch.fake_quantize_per_tensor_affine(t, float(point.scale), int(point.zero_point), point.spec.qmin,
                                                 point.spec.qmax)


@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_inline_sdpa_fake_quant_is_the_reference_decomposition_on_torch_fake_quant(case):
    """torch's documented SDPA math with torch's fake quantization at the engine's points:
    q' = fq(q) c; s = fq(q' kᵀ) + mask; p = fq(softmax(s)); y = fq(p v)."""
    torch.manual_seed(18)
    kwargs = SDPA_CASES[case]
    model = InlineAttention(**kwargs).eval()
    x = _input(True, seed=19)
    qm = _prepare_quietly(model, x)
    calibrate(qm, [x])
    p = quant_points(qm)
    with torch.no_grad():
        got = qm(x)
        xq = _fq(x, p["input"])
        b, d, kv = x.shape[0], E // HEADS, model.kv_heads
        lin = {n: F.linear(xq, _fq_weight(getattr(model, n), p[f"{n}.weight"]), getattr(model, n).bias) for n in "qkv"}
        q = _fq(lin["q"], p["q"]).view(b, L, HEADS, d).transpose(1, 2)
        k = _fq(lin["k"], p["k"]).view(b, L, kv, d).transpose(1, 2).repeat_interleave(HEADS // kv, 1)
        v = _fq(lin["v"], p["v"]).view(b, L, kv, d).transpose(1, 2).repeat_interleave(HEADS // kv, 1)
        c = kwargs.get("scale") or d ** -0.5
        scores = _fq(torch.matmul(q * c, k.transpose(-2, -1)), p["matmul"])
        mask = kwargs.get("attn_mask")
        if kwargs.get("causal"):
            mask = torch.ones(L, L, dtype=torch.bool).tril()
        if mask is not None:
            if mask.dtype == torch.bool:
                mask = torch.zeros(L, L).masked_fill(~mask, float("-inf"))
            scores = scores + mask
        probs = _fq(torch.softmax(scores, dim=-1), p["softmax"])
        y = _fq(torch.matmul(probs, v), p["matmul#2"])
        expected = y.transpose(1, 2).reshape(b, L, E)
    assert torch.equal(got, expected)


def _fq_weight(linear, point):
    spec = point.spec
    if spec.per_channel:
        return torch.fake_quantize_per_channel_affine(linear.weight, point.scale, point.zero_point, spec.ch_axis,
                                                      spec.qmin, spec.qmax)
    return torch.fake_quantize_per_tensor_affine(linear.weight, float(point.scale), int(point.zero_point),
                                                 spec.qmin, spec.qmax)


def test_inline_sdpa_runs_both_matmuls_as_integer_kernels(monkeypatch):
    import qdebug.engine.functional as functional

    ran = []
    real = functional._integer_matmul

    def spy(*args):
        out = real(*args)
        ran.append(out is not None)  # None: the kernel declined (no grid) and float ran instead
        return out

    monkeypatch.setattr(functional, "_integer_matmul", spy)
    x = _input(True, seed=20)
    qm = _prepare_quietly(InlineAttention(kv_heads=2).eval(), x)
    calibrate(qm, [x])
    with torch.no_grad():
        convert(qm)(x)
    assert ran == [True, True]



def test_inspect_raises_no_dead_module_for_attention_parts_a_call_does_not_use():
    """need_weights=False and no mask leave the mask and weights parts idle: by design, not a finding."""
    from qdebug.tools.inspect import inspect_model

    torch.manual_seed(0)
    model = SelfAttention(need_weights=False).eval()
    x = _input(batch_first=False)
    qm = _prepare_quietly(model, x)
    calibrate(qm, [x])
    checks = inspect_model(qm, stage="calibrated").checks
    assert not (checks["check"] == "dead module").any(), checks.to_string()
