"""LLM-style specs: per-group weights (W4 g128) and per-token dynamic activations.

Every expected value comes from a float64 reference written here from the documented
formula (docs/engine.md, "Per-group weights and per-token activations"): the range of
each group / token widened to hold 0, s = max|x| / qmax (symmetric) or (max - min) /
(qmax - qmin) with z = qmin - round(min / s) (affine), the scale a float32 value, codes
round_half_even(x / s) + z clamped to [qmin, qmax], values (q - z) s.  None is computed by
the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import qdebug
from qdebug.engine import QConfig, QuantSpec, calibrate, convert, prepare, quant_points
from qdebug.engine.fake_quant import fake_quantize, fake_quantize_dynamic, quantize_to_int
from qdebug.errors import QDebugError
from small_models import RESNET, SMALL_RESNET

F32_EPS = float(np.finfo(np.float32).eps)


def reference_qparams(lo: np.ndarray, hi: np.ndarray, bits: int, symmetric: bool):
    """(scale float32, zero point) per slice from float64 min/max, by the documented formula."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
    lo32, hi32 = lo.astype(np.float32), hi.astype(np.float32)
    if symmetric:
        scale = np.maximum(-lo32, hi32) / np.float32(qmax)
        zero = np.zeros_like(scale, dtype=np.int64)
    else:
        scale = np.maximum((hi32 - lo32) / np.float32(qmax - qmin), np.float32(F32_EPS))
        zero = np.clip(qmin - np.round(lo32.astype(np.float64) / scale.astype(np.float64)), qmin, qmax)
        zero = zero.astype(np.int64)
    return np.maximum(scale, np.float32(F32_EPS)).astype(np.float32), zero, qmin, qmax


def reference_fake_quant(x: np.ndarray, scale: np.ndarray, zero: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    """Float64 codes round_half_even(x / s) + z (np.round is half-to-even), clamped, dequantized."""
    s = scale.astype(np.float64)[..., None]
    q = np.clip(np.round(x / s) + zero[..., None], qmin, qmax)
    return ((q - zero[..., None]) * s).astype(np.float32), q.astype(np.int64)


def reference_grouped(w: torch.Tensor, group: int, bits: int, symmetric: bool):
    rows = w.shape[0]
    x = w.detach().double().numpy().reshape(rows, -1, group)
    scale, zero, qmin, qmax = reference_qparams(x.min(-1), x.max(-1), bits, symmetric)
    out, codes = reference_fake_quant(x, scale, zero, qmin, qmax)
    return out.reshape(w.shape), codes.reshape(w.shape), scale, zero


def reference_per_token(x: torch.Tensor, bits: int, symmetric: bool):
    rows = x.detach().double().numpy().reshape(-1, x.shape[-1])
    scale, zero, qmin, qmax = reference_qparams(rows.min(-1), rows.max(-1), bits, symmetric)
    out, _ = reference_fake_quant(rows, scale, zero, qmin, qmax)
    return out.reshape(x.shape)


def llm_weight(rows: int = 16, cols: int = 256, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with a few outlier columns (the reason groups exist) and varied row scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.linspace(0.05, 2.0, rows)[:, None]
    w[:, 7] *= 20.0
    return w


def grouped_point_output(w: torch.Tensor, spec: QuantSpec):
    point = qdebug.engine.point.QuantPoint("fc.weight", "weight", spec)
    point.mode = "fake"
    return point, point.apply(w)


@pytest.mark.parametrize("bits,group,symmetric", [(4, 128, True), (4, 32, False), (8, 64, False), (3, 16, True)])
def test_grouped_fake_quant_matches_float64_reference(bits, group, symmetric):
    w = llm_weight()
    spec = QuantSpec(bits=bits, symmetric=symmetric, per_channel=True, group_size=group)
    point, out = grouped_point_output(w, spec)
    expected, codes, scale, zero = reference_grouped(w, group, bits, symmetric)
    assert point.scale.shape == (16, 256 // group)
    assert np.array_equal(point.scale.numpy(), scale)
    assert np.array_equal(point.zero_point.numpy().astype(np.int64), zero)
    assert np.array_equal(out.numpy(), expected)
    assert torch.equal(quantize_to_int(w, point.scale, point.zero_point, spec), torch.from_numpy(codes))
    # The outlier column spoils only its own group: finer than one scale per row.
    per_row = reference_grouped(w, 256, bits, symmetric)[0]
    assert np.abs(expected - w.numpy()).sum() < np.abs(per_row - w.numpy()).sum()


def test_grouped_conv_weight_groups_the_flattened_row():
    w = torch.randn(4, 8, 3, 3, generator=torch.Generator().manual_seed(1))
    spec = QuantSpec(bits=4, symmetric=False, per_channel=True, group_size=24)  # 72 = 8 * 3 * 3 per row
    point, out = grouped_point_output(w, spec)
    expected, _, _, _ = reference_grouped(w, 24, 4, False)
    assert point.scale.shape == (4, 3)
    assert np.array_equal(out.numpy(), expected)


@pytest.mark.parametrize("estimator", ["ste", "clipped_ste"])
def test_grouped_gradient_is_straight_through(estimator):
    w = llm_weight().requires_grad_(True)
    spec = QuantSpec(bits=4, per_channel=True, group_size=32, estimator=estimator)
    _, out = grouped_point_output(w, spec)
    upstream = torch.randn(w.shape, generator=torch.Generator().manual_seed(2))
    (out * upstream).sum().backward()
    # min/max groups hold every value inside their range: dL/dw = upstream everywhere.
    assert torch.equal(w.grad, upstream)


def test_grouped_lsq_learns_one_scale_per_group():
    w = llm_weight()
    point, _ = grouped_point_output(w, QuantSpec(bits=4, per_channel=True, group_size=64, estimator="lsq"))
    out = point.apply(w)
    out.pow(2).sum().backward()
    assert isinstance(point.scale, nn.Parameter) and point.scale.grad.shape == (16, 4)
    assert bool(point.scale.grad.abs().sum() > 0)


@pytest.mark.parametrize("bits,symmetric", [(8, False), (8, True), (4, False)])
def test_per_token_dynamic_matches_float64_reference(bits, symmetric):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 48, generator=g) * torch.logspace(-3, 2, 10).reshape(2, 5, 1)
    spec = QuantSpec(bits=bits, symmetric=symmetric, dynamic=True, per_token=True)
    point = qdebug.engine.point.QuantPoint("fc", "activation", spec)
    point.mode = "fake"
    out = point.apply(x)
    assert np.array_equal(out.numpy(), reference_per_token(x, bits, symmetric))
    # A second batch gets its own scales: nothing was frozen.
    y = x.flip(0) * 3.0
    assert np.array_equal(point.apply(y).numpy(), reference_per_token(y, bits, symmetric))
    assert not bool(point.qparams_set)


def test_per_tensor_dynamic_matches_float64_reference():
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(4)) * 5
    out = fake_quantize_dynamic(x, QuantSpec(symmetric=False, dynamic=True))
    rows = x.double().numpy().reshape(1, -1)
    scale, zero, qmin, qmax = reference_qparams(rows.min(-1), rows.max(-1), 8, False)
    assert np.array_equal(out.numpy(), reference_fake_quant(rows, scale, zero, qmin, qmax)[0].reshape(x.shape))


def test_per_token_ignores_non_finite_values_in_the_range():
    x = torch.tensor([[1.0, -0.5, float("inf"), float("nan")], [0.25, 0.5, -1.0, 2.0]])
    out = fake_quantize_dynamic(x, QuantSpec(dynamic=True, per_token=True))
    # Row 0's range is its finite values: s = 1 / 127; Inf saturates there, NaN stays NaN.
    assert out[0, 0] == torch.tensor(127 / 127.0) and out[0, 2] == out[0, 0] and torch.isnan(out[0, 3])
    assert np.array_equal(out[1].numpy(), reference_per_token(x[1:], 8, True)[0])


def test_per_token_gradient_is_straight_through():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    out = fake_quantize_dynamic(x, QuantSpec(dynamic=True, per_token=True, estimator="ste"))
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 32)
        self.act = nn.ReLU()
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.act(self.fc(x)))


def test_override_prepares_calibrates_and_runs_grouped_and_per_token():
    torch.manual_seed(0)
    model = TwoLinear().eval()
    qconfig = QConfig.from_dict({"overrides": {"fc": {"weight": {"bits": 4, "group_size": 32}},
                                               "head": {"activation": {"dynamic": True, "per_token": True}}}})
    x = torch.randn(6, 64)
    qm = calibrate(prepare(model, qconfig, example_inputs=(x,)), [x, x * 0.5])
    points = quant_points(qm)
    assert points["fc.weight"].spec.group_size == 32 and points["fc.weight"].scale.shape == (32, 2)
    assert points["head"].spec.per_token and points["head"].mode == "fake"
    with torch.no_grad():
        out = qm(x)
        # The head's output, token by token: the float64 reference of the head's float output
        # on the calibrated input grid of the head (set the head point to float to read it).
        points["head"].mode = "float"
        raw = qm(x)
    assert np.array_equal(out.numpy(), reference_per_token(raw, 8, False))
    expected_w, _, _, _ = reference_grouped(model.fc.weight, 32, 4, True)
    assert np.array_equal(points["fc.weight"].apply(qm.fc.weight.detach()).numpy(), expected_w)


def test_group_that_does_not_divide_the_row_is_refused_at_prepare():
    qconfig = QConfig.from_dict({"overrides": {"fc": {"weight": {"bits": 4, "group_size": 48}}}})
    with pytest.raises(QDebugError, match=r"fc\.weight: group_size=48 does not divide the weight's row of 64") as e:
        prepare(TwoLinear(), qconfig, example_inputs=(torch.randn(2, 64),))
    assert "group_size = 16" in e.value.hint


def test_convert_refuses_grouped_conv_and_dynamic_points():
    x = torch.randn(4, 64)
    qconfig = QConfig.from_dict({"overrides": {"head": {"activation": {"dynamic": True, "per_token": True}}}})
    qm = calibrate(prepare(TwoLinear(), qconfig, example_inputs=(x,)), [x])
    with pytest.raises(QDebugError, match="'head' .*no kernel for dynamic activations yet"):
        convert(qm)
    conv = nn.Sequential(nn.Conv2d(4, 8, 3))
    images = torch.randn(2, 4, 8, 8)
    qconfig = QConfig.from_dict({"overrides": {"0": {"weight": {"bits": 4, "group_size": 12}}}})  # 36 = 4 * 3 * 3
    qm = calibrate(prepare(conv, qconfig, example_inputs=(images,)), [images])
    with pytest.raises(QDebugError, match="'0.weight' .*no kernel for grouped conv weights yet"):
        convert(qm)


class OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 16)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("group,symmetric", [(32, True), (16, False)])
def test_grouped_linear_integer_kernel_matches_float64_reference(group, symmetric):
    torch.manual_seed(0)
    model = OneLinear().eval()
    qconfig = QConfig.from_dict({"overrides": {"fc": {"weight": {"bits": 4, "group_size": group,
                                                                 "symmetric": symmetric}}}})
    x = torch.randn(8, 64)
    qm = convert(calibrate(prepare(model, qconfig, example_inputs=(x,)), [x]))
    points = quant_points(qm)
    with torch.no_grad():
        out = qm(x).numpy()
    s_in, z_in = float(points["input"].scale), int(points["input"].zero_point)
    s_out, z_out = float(points["fc"].scale), int(points["fc"].zero_point)
    # Input codes q - z (float64 arithmetic), the grouped weight's codes q - z from the reference.
    qx = np.clip(np.round(x.double().numpy() / s_in) + z_in, -128, 127) - z_in
    _, codes, w_scale, w_zero = reference_grouped(model.fc.weight, group, 4, symmetric)
    qw = (codes - np.repeat(w_zero, group, axis=1)).reshape(16, -1, group)
    acc = np.einsum("njk,ojk->noj", qx.reshape(8, -1, group).astype(np.int64), qw)  # int64: exact
    y = s_in * (acc * w_scale.astype(np.float64)).sum(-1) + model.fc.bias.detach().double().numpy()
    expected = ((np.clip(np.round(y / s_out) + z_out, -128, 127) - z_out) * s_out).astype(np.float32)
    assert np.array_equal(out, expected)
    assert qm.fc.integer_fallbacks == 0


def test_checkpoint_round_trip_keeps_groups_and_dynamic_points(tmp_path):
    from qdebug.zoo.resnet import ResNet

    torch.manual_seed(0)
    model = ResNet(**SMALL_RESNET).eval()
    qconfig = QConfig.from_dict({"overrides": {"fc": {"weight": {"bits": 4, "group_size": 8, "symmetric": False},
                                                      "activation": {"dynamic": True, "per_token": True}}}})
    x = torch.randn(3, 1, 16, 16)
    qm = calibrate(prepare(model, qconfig, example_inputs=(x,)), [x])
    path = qdebug.save(qm, tmp_path / "grouped.pt", model_spec=RESNET, model_kwargs=SMALL_RESNET)
    loaded, info = qdebug.load(path)
    assert info.qconfig.to_dict() == qconfig.to_dict()
    twin = quant_points(loaded)
    assert torch.equal(twin["fc.weight"].scale, quant_points(qm)["fc.weight"].scale)
    assert twin["fc"].spec.per_token and not bool(twin["fc"].qparams_set)
    with torch.no_grad():
        assert torch.equal(loaded(x), qm(x))


def test_damaged_grouped_scale_is_refused(tmp_path):
    from qdebug.zoo.resnet import ResNet

    qconfig = QConfig.from_dict({"overrides": {"fc": {"weight": {"bits": 4, "group_size": 8}}}})
    x = torch.randn(2, 1, 16, 16)
    qm = calibrate(prepare(ResNet(**SMALL_RESNET).eval(), qconfig, example_inputs=(x,)), [x])
    path = qdebug.save(qm, tmp_path / "g.pt", model_spec=RESNET, model_kwargs=SMALL_RESNET)
    raw = torch.load(path, weights_only=True)
    key = next(k for k in raw["state"] if k.endswith("fc/weight.scale"))
    raw["state"][key] = raw["state"][key].reshape(-1)  # [10, 2] -> [20]: a per-channel shape
    torch.save(raw, tmp_path / "bad.pt")
    with pytest.raises(QDebugError, match="grouped scale"):
        qdebug.load(tmp_path / "bad.pt")


@pytest.mark.parametrize("table,message", [
    ({"weight": {"group_size": True}}, "group_size=True must be a positive integer"),
    ({"weight": {"group_size": 0}}, "group_size=0 must be a positive integer"),
    ({"weight": {"group_size": 32.0}}, "group_size=32.0 must be a positive integer"),
    ({"weight": {"group_size": "128"}}, "must be a positive integer"),
    ({"weight": {"group_size": 32, "per_channel": False}}, "needs per_channel = true with ch_axis = 0"),
    ({"weight": {"dynamic": True}}, "weight spec sets dynamic = true"),
    ({"activation": {"group_size": 32}}, "activation spec sets group_size = 32; groups are for weights"),
    ({"activation": {"per_token": True}}, "per_token needs dynamic = true"),
    ({"activation": {"dynamic": 1}}, "dynamic=1 must be true or false"),
    ({"activation": {"dynamic": True, "observer": "ema"}}, "not the ema observer"),
    ({"activation": {"dynamic": True, "estimator": "lsq"}}, "no scale for the lsq estimator"),
    ({"activation": {"dynamic": True, "per_channel": True}}, "dynamic takes per_channel = false"),
    ({"overrides": {"fc": {"activation": {"group_size": 32}}}}, "override 'fc' activation spec sets group_size"),
    ({"overrides": {"fc": {"weight": {"dynamic": True, "per_channel": False}}}}, "override 'fc' weight spec sets"),
])
def test_qconfig_from_dict_refuses_bad_group_and_token_settings(table, message):
    with pytest.raises(QDebugError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        QConfig.from_dict(table)


def test_spec_round_trips_and_describes_the_new_settings():
    grouped = QuantSpec(bits=4, per_channel=True, group_size=128)
    token = QuantSpec(symmetric=False, dynamic=True, per_token=True)
    assert QuantSpec.from_dict(grouped.to_dict()) == grouped and QuantSpec.from_dict(token.to_dict()) == token
    assert grouped.describe() == "int4 sym group(128) minmax"
    assert token.describe() == "int8 affine dynamic per-token minmax"


def test_fake_quantize_grouped_equals_torch_per_channel_kernel_on_the_group_view():
    # The documented construction, checked against torch's kernel called directly.
    w = llm_weight()
    spec = QuantSpec(bits=4, symmetric=False, per_channel=True, group_size=32)
    scale = torch.rand(16, 8) * 0.1 + 0.01
    zero = torch.randint(-8, 8, (16, 8), dtype=torch.int32)
    expected = torch.fake_quantize_per_channel_affine(w.reshape(128, 32), scale.reshape(-1), zero.reshape(-1),
                                                      0, -8, 7).reshape(w.shape)
    assert torch.equal(fake_quantize(w, scale, zero, spec), expected)


def outlier_two_linear() -> nn.Module:
    """TwoLinear with one outlier input column: one group per row (g64) pays for it everywhere."""
    torch.manual_seed(0)
    model = TwoLinear().eval()
    with torch.no_grad():
        model.fc.weight[:, 3] *= 30
    return model


def grouped_model(group: int, x: torch.Tensor) -> nn.Module:
    qconfig = QConfig.from_dict({"overrides": {"fc": {"weight": {"bits": 4, "group_size": group}}}})
    return calibrate(prepare(outlier_two_linear(), qconfig, example_inputs=(x,)), [x])


def test_suggest_offers_smaller_groups_and_plans_one_when_it_reaches_the_target():
    from qdebug.tools.suggest import candidates, suggest

    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(6))
    qm = grouped_model(64, x)
    found = candidates(qm, ["fc.weight"], 16)
    assert [(c.bits, c.group_size) for c in found] == [(4, None), (4, 32), (4, 16)]
    # At bits=4 the width cannot grow: only the groups can shrink.  g64 gives 13.3 dB, g32
    # 14.9 dB, g16 17.6 dB (measured); a 16 dB target needs g16.
    result = suggest(qm, [x], min_sqnr=16.0, bits=4)
    assert result.plan.passed and result.plan.overrides(4) == {"fc": {"weight": {"group_size": 16}}}
    assert list(result.frame["point"]) == ["fc.weight@g16", "fc.weight@g32"]


def test_raising_a_group_change_equals_calibrating_with_that_group():
    from qdebug.engine.respec import raise_bits

    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(6))
    qm, direct = grouped_model(64, x), grouped_model(16, x)
    with torch.no_grad():
        before = qm(x)
        undo = raise_bits(qm, {"fc.weight": {"group_size": 16}}, quant_points(qm))
        assert quant_points(qm)["fc.weight"].scale.shape == (32, 4)
        assert torch.equal(qm(x), direct(x))
        undo.restore()
        assert torch.equal(qm(x), before) and quant_points(qm)["fc.weight"].spec.group_size == 64


def test_compare_and_inspect_read_grouped_and_per_token_points():
    import copy

    from qdebug.engine import set_mode
    from qdebug.tools.compare import compare
    from qdebug.tools.inspect import inspect_model

    torch.manual_seed(0)
    qconfig = QConfig.from_dict({"overrides": {"fc": {"weight": {"bits": 4, "group_size": 32}},
                                               "head": {"activation": {"dynamic": True, "per_token": True}}}})
    x = torch.randn(16, 64)
    qm = calibrate(prepare(TwoLinear().eval(), qconfig, example_inputs=(x,)), [x])
    reference = copy.deepcopy(qm)
    set_mode(reference, "float")
    frame = compare([("float", reference), ("quantized", qm)], [x * 3]).frame.set_index("layer")
    # The per-token point has no stored grid: no saturation measured against the placeholder
    # scale of 1 (which would read as "nothing clips" or, on large values, as clipping).
    assert np.isnan(frame.loc["head", "saturation"]) and frame.loc["head", "diagnosis"] != "clipping"
    layers = inspect_model(qm, stage="calibrated").layers.set_index("layer")
    row = layers.loc["fc"].to_dict()
    assert "int4 sym g32" in row.values(), row
    assert "int8 affine per-token" in layers.loc["head"].to_dict().values()


def test_cli_suggest_shrinks_a_group_and_its_plan_reproduces_through_calibrate_and_apply(cli, tmp_path):
    import json
    import tomllib

    from qdebug.zoo.resnet import ResNet

    torch.manual_seed(0)
    model = ResNet(**SMALL_RESNET).eval()
    with torch.no_grad():
        model.fc.weight[:, 3] *= 30  # one outlier input: a group of 16 (the whole row) pays for it
    x = torch.randn(32, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    qconfig = QConfig.from_dict({"overrides": {"fc": {"weight": {"bits": 4, "group_size": 16}}}})
    qm = calibrate(prepare(model, qconfig, example_inputs=(x[:2],)), [x[:16]])
    qdebug.save(model, tmp_path / "float.pt", stage="float", model_spec=RESNET, model_kwargs=SMALL_RESNET)
    qdebug.save(qm, tmp_path / "cal.pt", model_spec=RESNET, model_kwargs=SMALL_RESNET)
    torch.save(x[:16].clone(), tmp_path / "calib.pt")
    torch.save(x[16:].clone(), tmp_path / "eval.pt")
    # g16 gives 15.4 dB, g8 21.1 dB (measured): at --bits 4 only the group can change.
    args = [tmp_path / "float.pt", tmp_path / "cal.pt", "--data", tmp_path / "eval.pt", "--batch-size", 16,
            "--bits", 4, "--min-sqnr", 20]
    result = cli("suggest", *args, "--out", tmp_path / "out")
    assert result.code == 0, result.err
    plan = json.loads((tmp_path / "out" / "suggest.json").read_text())["plan"]
    assert plan["points"] == ["fc.weight@g8"] and plan["overrides"] == {"fc": {"weight": {"group_size": 8}}}
    toml = tomllib.loads((tmp_path / "out" / "plan.toml").read_text())  # one [overrides."fc"] table
    assert toml["overrides"]["fc"] == {"weight": {"bits": 4, "group_size": 8}}
    calibrated = cli("calibrate", tmp_path / "float.pt", "--data", tmp_path / "calib.pt", "--batch-size", 16,
                     "--qconfig", tmp_path / "out" / "plan.toml", "-o", tmp_path / "g8.pt")
    assert calibrated.code == 0, calibrated.err
    step = cli("step", tmp_path / "float.pt", tmp_path / "g8.pt", "--auto", "--data", tmp_path / "eval.pt",
               "--batch-size", 16, "--format", "json")
    assert json.loads(step.out)["rows"][0]["sqnr_db"] == plan["after"]["sqnr_db"]
    applied = cli("suggest", *args, "--apply", "-o", tmp_path / "fixed.pt")
    assert applied.code == 0, applied.err
    fixed, info = qdebug.load(tmp_path / "fixed.pt")
    assert quant_points(fixed)["fc.weight"].spec.describe() == "int4 sym group(8) minmax"
    assert info.qconfig.overrides["fc"] == {"weight": {"bits": 4, "group_size": 8}}


@pytest.mark.parametrize("body,message", [
    ('[overrides."fc"]\nweight = {bits = 4, group_size = true}\n', "group_size=True must be a positive integer"),
    ('[overrides."fc"]\nactivation = {per_token = true}\n', "per_token needs dynamic = true"),
])
def test_cli_refuses_a_bad_llm_spec_in_a_qconfig_file(cli, tmp_path, body, message):
    from qdebug.zoo.resnet import ResNet

    qdebug.save(ResNet(**SMALL_RESNET).eval(), tmp_path / "float.pt", stage="float", model_spec=RESNET,
                model_kwargs=SMALL_RESNET)
    torch.save(torch.randn(4, 1, 16, 16), tmp_path / "calib.pt")
    (tmp_path / "q.toml").write_text(body)
    result = cli("calibrate", tmp_path / "float.pt", "--data", tmp_path / "calib.pt",
                 "--qconfig", tmp_path / "q.toml", "-o", tmp_path / "out.pt")
    assert result.code == 2 and message in result.err and "hint:" in result.err, result.err
    assert "Traceback" not in result.err
    assert not (tmp_path / "out.pt").exists()


def test_quantized_stage_with_a_grouped_linear_round_trips(tmp_path):
    from qdebug.zoo.resnet import ResNet

    torch.manual_seed(0)
    x = torch.randn(4, 1, 16, 16)
    qconfig = QConfig.from_dict({"overrides": {"fc": {"weight": {"bits": 4, "group_size": 8, "symmetric": False}}}})
    qm = convert(calibrate(prepare(ResNet(**SMALL_RESNET).eval(), qconfig, example_inputs=(x,)), [x]))
    path = qdebug.save(qm, tmp_path / "q.pt", model_spec=RESNET, model_kwargs=SMALL_RESNET)
    loaded, info = qdebug.load(path)
    assert info.stage == "quantized" and loaded.fc.weight_int.shape == (10, 16)
    with torch.no_grad():
        assert torch.equal(loaded(x), qm(x))
    assert qm.fc.integer_fallbacks == 0


def test_raising_the_bits_of_a_converted_grouped_linear_keeps_its_integer_kernel_exact():
    from qdebug.engine.respec import raise_bits

    torch.manual_seed(0)
    x = torch.randn(8, 64)
    qconfig = QConfig.from_dict({"overrides": {"fc": {"weight": {"bits": 4, "group_size": 16}}}})
    model = OneLinear().eval()
    qm = convert(calibrate(prepare(model, qconfig, example_inputs=(x,)), [x]))
    eight = convert(calibrate(prepare(model, QConfig.from_dict(
        {"overrides": {"fc": {"weight": {"bits": 8, "group_size": 16}}}}), example_inputs=(x,)), [x]))
    with torch.no_grad():
        undo = raise_bits(qm, {"fc.weight": 8}, quant_points(qm))
        assert quant_points(qm)["fc.weight"].scale.shape == (16, 4)
        # The frozen weight's observer statistics at 8 bits: what converting at 8 bits gives.
        assert torch.equal(qm(x), eight(x)) and qm.fc.integer_fallbacks == 0
        undo.restore()
