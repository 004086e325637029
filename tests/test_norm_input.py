"""A norm's input at int16, as NPUs offer: the override ``@norm_input`` (issue 28, item 4).

The norm's output is checked against a LayerNorm / GroupNorm computed here in float64 over
the input fake-quantized by hand at int16 with minmax qparams of its own computing.
"""

from __future__ import annotations

import tomllib
import warnings

import pytest
import torch
import torch.nn as nn

from qdebug.engine import QConfig, calibrate, prepare, quant_points, set_mode
from qdebug.errors import QDebugError

INT16 = {"overrides": {"@norm_input": {"activation": {"bits": 16}}}}


class Block(nn.Module):
    """A projection with one massive output channel (LLMs' "massive activations"), then LayerNorm."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():  # one output channel ~400x the others
            self.fc.weight[5] *= 400.0
            self.fc.bias[5] = 400.0
            self.ln.weight[5] = 0.0  # LLMs' norms weigh the massive channel down

    def forward(self, x):
        return self.head(self.ln(self.fc(x)))


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.gn = nn.GroupNorm(2, 8)

    def forward(self, x):
        return self.gn(self.relu(self.conv(x)))


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(32, 16, generator=gen) for _ in range(3)]


def _calibrated(model: nn.Module, xs: list[torch.Tensor], qconfig=None) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return calibrate(prepare(model, qconfig, example_inputs=xs[0]), xs)


def _fq_minmax(values: list[torch.Tensor], x: torch.Tensor, qmin: int, qmax: int) -> tuple[torch.Tensor, float]:
    """x fake-quantized on the affine minmax grid of ``values`` (float64, by hand), and its step."""
    lo = min(0.0, min(float(v.double().min()) for v in values))
    hi = max(0.0, max(float(v.double().max()) for v in values))
    scale = (hi - lo) / (qmax - qmin)
    zero_point = min(qmax, max(qmin, qmin - round(lo / scale)))
    q = torch.clamp(torch.round(x.double() / scale) + zero_point, qmin, qmax)
    return (q - zero_point) * scale, scale


def _layer_norm64(x: torch.Tensor, ln: nn.LayerNorm) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + ln.eps) * ln.weight.double() + ln.bias.double()


def test_norm_input_override_gives_the_point_feeding_the_norm_16_bits_only():
    torch.manual_seed(0)
    points = quant_points(_calibrated(Block().eval(), _batches(), QConfig.from_dict(INT16)))
    assert {n: p.spec.bits for n, p in points.items() if p.kind == "activation"} == {
        "input": 8, "fc": 16, "ln": 8, "head": 8}


def test_layer_norm_over_an_int16_input_matches_float64_by_hand():
    torch.manual_seed(0)
    model, xs = Block().eval(), _batches()
    qm = _calibrated(model, xs, QConfig.from_dict(INT16))
    set_mode(qm, "float")
    set_mode(qm, "fake", "fc", kind="activation")  # the norm's input point alone: the norm reads int16 codes
    x = xs[1]
    seen = {}
    handle = qm.ln.register_forward_hook(lambda m, a, out: seen.update(out=out.detach()))
    with torch.no_grad():
        qm(x)
        residuals = [model.fc(xi) for xi in xs]
        expected_input, step = _fq_minmax(residuals, residuals[1], -32768, 32767)
        expected = _layer_norm64(expected_input, model.ln)
    handle.remove()
    assert float(quant_points(qm)["fc"].scale) == pytest.approx(step, rel=1e-6)
    assert float((seen["out"].double() - expected).abs().max()) < 1e-4
    # int8 (the default) on the same data: the typical channels round to a few codes.
    with torch.no_grad():
        exact = _layer_norm64(residuals[1].double(), model.ln)
        int8_input, _ = _fq_minmax(residuals, residuals[1], -128, 127)
        err16 = float((expected - exact).abs().max())
        err8 = float((_layer_norm64(int8_input, model.ln) - exact).abs().max())
    assert err8 > 50 * err16


def test_group_norm_input_is_the_fused_relus_point_and_a_glob_names_one_norm():
    torch.manual_seed(0)
    xs = [torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    qconfig = QConfig.from_dict({"overrides": {"@norm_input.g*": {"activation": {"bits": 16}}}})
    qm = _calibrated(Conv().eval(), xs, qconfig)
    points = quant_points(qm)
    assert points["relu"].spec.bits == 16 and points["gn"].spec.bits == 8  # conv + relu: one point
    set_mode(qm, "float")
    set_mode(qm, "fake", "relu")
    with torch.no_grad():  # torch's conv on the layer's float weights, then the int16 grid by hand
        feats = [torch.relu(nn.functional.conv2d(x, qm.conv.weight, qm.conv.bias, padding=1)) for x in xs]
        x_q, _ = _fq_minmax(feats, feats[0], -32768, 32767)
        groups = x_q.reshape(2, 2, -1)
        mean, var = groups.mean(-1, keepdim=True), groups.var(-1, unbiased=False, keepdim=True)
        expected = ((groups - mean) / torch.sqrt(var + qm.gn.eps)).reshape_as(x_q)
        expected = expected * qm.gn.weight.double()[None, :, None, None] + qm.gn.bias.double()[None, :, None, None]
        got = qm(xs[0])
    assert float((got.double() - expected).abs().max()) < 1e-4


def test_from_qconfig_toml_and_refused_without_a_norm():
    text = '[overrides."@norm_input"]\nactivation = { bits = 16 }\n'
    qconfig = QConfig.from_dict(tomllib.loads(text))
    torch.manual_seed(0)
    assert quant_points(_calibrated(Block().eval(), _batches(), qconfig))["fc"].spec.bits == 16
    with pytest.raises(QDebugError, match="match no layer"):  # a model without norms: said, not ignored
        _calibrated(nn.Sequential(nn.Linear(16, 4)).eval(), _batches(), qconfig)


def test_a_module_glob_never_matches_the_alias():
    torch.manual_seed(0)
    qconfig = QConfig.from_dict({"overrides": {"ln*": {"activation": {"bits": 16}}}})
    points = quant_points(_calibrated(Block().eval(), _batches(), qconfig))
    assert points["ln"].spec.bits == 16 and points["fc"].spec.bits == 8


def test_compare_names_the_fix_and_is_silent_once_it_is_applied():
    from qdebug.tools.compare import ADVICE, compare

    torch.manual_seed(0)
    model, xs = Block().eval(), _batches()
    before = compare([("float", model), ("int8", _calibrated(model, xs))], xs)
    assert before.frame.set_index("layer").loc["ln", "diagnosis"] == "norm_input_outliers"
    assert "@norm_input" in ADVICE["norm_input_outliers"]  # the summary's cause line when it is at fault
    after = compare([("float", model), ("int16 in", _calibrated(model, xs, QConfig.from_dict(INT16)))], xs)
    rows = after.frame.set_index("layer")
    assert rows.loc["ln", "diagnosis"] != "norm_input_outliers"
    assert rows.loc["ln", "sqnr_db"] > before.frame.set_index("layer").loc["ln", "sqnr_db"] + 12


def test_suggest_marks_the_point_feeding_the_norm_with_the_norms_cause():
    from qdebug.tools.suggest import diagnoses_of, suggest

    torch.manual_seed(0)
    model, xs = Block().eval(), _batches()
    qm = _calibrated(model, xs)
    ranked = suggest(qm, xs, reference=model, min_sqnr=60, confidence=None,
                     diagnoses=lambda: diagnoses_of(model, qm, xs))  # as the CLI passes them
    rows = ranked.frame.set_index("point")
    assert rows.loc["fc", "diagnosis"] == "norm_input_outliers"  # its int16 candidate is the fix
    assert rows.loc["ln", "diagnosis"] == "norm_input_outliers"
