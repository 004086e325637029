"""Empirical bias correction (correct_bias, qdebug/fix/bias_correction.py): a planted
systematic rounding bias is measured and removed, the correction equals the hand formula
delta = mean((W_q - W) x) computed here in float64, it lands in the BN when the conv has no bias
(the state_dict keys unchanged), and what cannot be corrected is refused or skipped with a reason."""

import math

import pytest
import torch
import torch.nn as nn

from qdebug.engine import QConfig, QuantSpec, calibrate, prepare
from qdebug.errors import QDebugError
from qdebug.fix.bias_correction import COLUMNS, correct_bias

PER_TENSOR = QConfig(weight=QuantSpec(per_channel=False))


def _sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    return 10 * math.log10(reference.double().square().sum() / (reference - other).double().square().sum())


def _per_tensor_int8(weight: torch.Tensor) -> torch.Tensor:
    """The engine's default weight grid, per tensor: symmetric int8, scale max|w| / 127, codes [-128, 127]."""
    return torch.fake_quantize_per_tensor_affine(weight, weight.abs().max().item() / 127, 0, -128, 127)


def _on_grid(*shape: int, seed: int) -> torch.Tensor:
    """Inputs j / 255 holding 0 and 1: the default affine int8 input grid (scale 1/255) holds
    them exactly, so the quantized layer reads the very x of the hand formula."""
    x = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed)).float() / 255
    x.view(-1)[:2] = torch.tensor([0.0, 1.0])
    return x


class Planted(nn.Module):
    """conv -> ReLU -> conv, the second conv's weights planted on a per-tensor int8 grid of step
    s = 1/127 (one weight of 1.0 sets it): channel 2's all sit 0.55 s above a code and round up
    by 0.45 s, channel 3's are all 0.4 s and round to 0.  Its inputs are post-ReLU (>= 0), so
    neither error averages out: channel c's output mean is off by (W_q - W)[c] . E[input]."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 6, 3, padding=1)
        step = 1 / 127
        with torch.no_grad():
            self.conv2.weight.normal_(0, 0.05)
            self.conv2.weight[0, 0, 1, 1] = 1.0
            codes = torch.randint(-3, 4, self.conv2.weight[2].shape, generator=torch.Generator().manual_seed(5))
            self.conv2.weight[2] = (codes + 0.55) * step
            self.conv2.weight[3] = 0.4 * step

    def forward(self, x):
        return self.conv2(self.relu(self.conv1(x)))


def _quantized(model, batches, qconfig=PER_TENSOR):
    prepared = prepare(model, qconfig, example_inputs=batches[0])
    calibrate(prepared, batches)
    return prepared.eval()


def test_planted_rounding_bias_removed():
    torch.manual_seed(0)
    model = Planted().eval()
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 3, 12, 12, generator=generator) for _ in range(4)]
    held_out = torch.randn(16, 3, 12, 12, generator=generator)
    with torch.no_grad():
        reference = model(held_out)
        # The planted shift by hand (float64): the rounding error of each planted weight times
        # the mean post-ReLU input it reads (padding included).
        error = (_per_tensor_int8(model.conv2.weight) - model.conv2.weight).double()
        expected = nn.functional.conv2d(model.relu(model.conv1(held_out)).double(), error, padding=1).mean((0, 2, 3))
        before = _quantized(model, batches)(held_out)
    shift_before = (before - reference).double().mean((0, 2, 3))
    assert shift_before[2] > 0.03 and shift_before[3] < -0.03  # the plant is large ...
    torch.testing.assert_close(shift_before[2:4], expected[2:4], rtol=0.1, atol=0)  # ... and what it should be

    fixed, report = correct_bias(model, batches, PER_TENSOR)
    assert list(report.columns) == COLUMNS and report.applied.all()
    assert list(report.held_by) == ["conv1.bias", "conv2.bias"]
    assert report.set_index("layer").shift_max["conv2"] == pytest.approx(expected.abs().max().item(), rel=0.1)
    assert fixed.state_dict().keys() == model.state_dict().keys()
    for name in ("conv1.weight", "conv2.weight"):  # only biases move
        assert torch.equal(fixed.state_dict()[name], model.state_dict()[name])
    with torch.no_grad():
        after = _quantized(fixed, batches)(held_out)  # recalibrated, measured on unseen data
        float_change = _sqnr_db(reference, fixed(held_out))
    shift_after = (after - reference).double().mean((0, 2, 3))
    for channel in (2, 3):  # measured: 0.051 -> 0.00015 and -0.049 -> -0.0004
        assert shift_after[channel].abs() <= shift_before[channel].abs() / 10
    # The quantized model now computes the ORIGINAL float function better (measured 15.0 -> 24.5 dB) ...
    assert _sqnr_db(reference, after) >= _sqnr_db(reference, before) + 6
    # ... and the float model changed on purpose, by as much as the error it cancels (measured 15.8 dB).
    assert 10 < float_change < 25


class OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc(x)


def test_correction_equals_the_hand_formula_on_a_linear():
    torch.manual_seed(2)
    model = OneLinear().eval()
    batches = [_on_grid(8, 16, seed=seed) for seed in range(3)]
    fixed, report = correct_bias(model, batches, PER_TENSOR)
    weight = model.fc.weight.detach()
    x = torch.cat(batches).double()
    delta = x @ (_per_tensor_int8(weight) - weight).double().T  # (W_q - W) x per sample, float64
    expected_bias = model.fc.bias.double() - delta.mean(0)
    torch.testing.assert_close(fixed.fc.bias.double(), expected_bias, rtol=0, atol=1e-6)
    assert delta.mean(0).abs().max() > 1e-3  # a correction worth checking
    row = report.iloc[0]
    assert (row.layer, row.channels, row.held_by, row.applied) == ("fc", 5, "fc.bias", True)
    assert row.shift_max == pytest.approx(delta.mean(0).abs().max().item(), rel=1e-4)
    assert row.shift_rms == pytest.approx(delta.mean(0).square().mean().sqrt().item(), rel=1e-4)
    outputs = x @ weight.double().T + model.fc.bias.double()
    assert row.output_std == pytest.approx(outputs.std(0, unbiased=False).median().item(), rel=1e-6)


class ConvBN(nn.Module):
    """1x1 conv -> BN -> ReLU: the BN's output, before the ReLU, is where the shift shows."""

    def __init__(self, bias: bool, affine: bool):
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 1, bias=bias)
        self.bn = nn.BatchNorm2d(6, affine=affine)
        self.relu = nn.ReLU()
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            self.bn.running_mean.copy_(torch.randn(6, generator=generator) * 0.3)
            self.bn.running_var.copy_(torch.rand(6, generator=generator) + 0.5)
            if affine:
                self.bn.weight.copy_(torch.rand(6, generator=generator) + 0.5)
                self.bn.bias.copy_(torch.randn(6, generator=generator) * 0.2)

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


@pytest.mark.parametrize("bias, affine, mode, held_by", [
    (False, True, "fuse_bn", "bn.bias"),
    (False, False, "fuse_bn", "bn.running_mean"),
    (True, True, "fuse_bn", "conv.bias"),
    (False, True, "with_bn", "bn.bias"),
])
def test_correction_held_by_the_bn_or_the_bias(bias, affine, mode, held_by):
    torch.manual_seed(3)
    model = ConvBN(bias, affine).eval()
    batches = [_on_grid(4, 4, 5, 5, seed=seed) for seed in range(3)]
    fixed, report = correct_bias(model, batches, PER_TENSOR, mode=mode)
    assert report.held_by.tolist() == [held_by] and report.applied.all()
    assert fixed.state_dict().keys() == model.state_dict().keys()
    assert (fixed.conv.bias is None) == (not bias)
    for name, value in model.state_dict().items():  # only the holder moved
        assert torch.equal(fixed.state_dict()[name], value) == (name != held_by), name

    # By hand, float64: the weight the engine quantizes (fuse_bn: W f, the BN folded in float32 as
    # the engine does; with_bn: W), its per-tensor int8 rounding error, times the data's mean input.
    bn = model.bn
    f = bn.weight / torch.sqrt(bn.running_var + bn.eps) if affine else 1 / torch.sqrt(bn.running_var + bn.eps)
    weight = model.conv.weight.detach() * f.detach().reshape(-1, 1, 1, 1) if mode == "fuse_bn" else model.conv.weight
    error = (_per_tensor_int8(weight.detach()) - weight.detach()).double().flatten(1)  # [out, in]
    mean_input = torch.cat(batches).double().mean((0, 2, 3))
    shift = error @ mean_input  # the quantized call's mean error, where it is measured
    after_bn = shift if mode == "fuse_bn" else shift * f.detach().double()  # with_bn: before the BN
    assert after_bn.abs().max() > 1e-3

    def bn_output(m, x):
        return m.bn(m.conv(x)).double()

    x = torch.randn(2, 4, 5, 5)
    with torch.no_grad():  # the BN's output moves by -shift, the same at every input
        change = (bn_output(fixed, x) - bn_output(model, x)).mean((0, 2, 3))
    torch.testing.assert_close(change, -after_bn, rtol=0, atol=2e-6)


class Skipped(nn.Module):
    """A conv called twice, a linear without bias (and no BN), and a linear that can be corrected."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Conv2d(2, 2, 3, padding=1)
        self.no_bias = nn.Linear(32, 8, bias=False)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        x = torch.relu(self.shared(torch.relu(self.shared(x))))
        return self.fc(torch.relu(self.no_bias(x.flatten(1))))


def test_what_cannot_be_corrected_keeps_its_reason():
    torch.manual_seed(4)
    model = Skipped().eval()
    batches = [torch.randn(2, 2, 4, 4) for _ in range(2)]
    fixed, report = correct_bias(model, batches)  # qconfig None: QConfig()
    rows = report.set_index("layer")
    assert not rows.applied["shared"] and "called 2 times" in rows.reason["shared"]
    assert not rows.applied["no_bias"] and "no bias" in rows.reason["no_bias"]
    assert rows.applied["fc"] and rows.held_by["fc"] == "fc.bias"
    assert report.channels.isna().tolist() == [True, True, False]
    assert fixed.state_dict().keys() == model.state_dict().keys()
    for name in ("shared.weight", "shared.bias", "no_bias.weight"):
        assert torch.equal(fixed.state_dict()[name], model.state_dict()[name])
    _, report = correct_bias(model, batches, QConfig(overrides={"fc": {"weight": None}}))
    assert report.set_index("layer").reason["fc"] == "the weight of fc is not quantized by this qconfig: no shift to correct"


def test_bad_input_one_error():
    model = OneLinear().eval()
    batches = [torch.randn(2, 16)]
    prepared = _quantized(model, batches)
    with pytest.raises(QDebugError, match="prepared by qdebug"):
        correct_bias(prepared, batches)
    with pytest.raises(QDebugError, match="no conv or linear layer"):
        correct_bias(nn.Sequential(nn.ReLU(), nn.Flatten()), batches)
    with pytest.raises(QDebugError, match="no batches"):
        correct_bias(model, [])
    # The second batch does not fit the layer: one error naming it, raised while calibrating.
    with pytest.raises(QDebugError, match=r"the model raised RuntimeError on batch 2 of 2 \(calibration\)") as info:
        correct_bias(model, [torch.randn(2, 16), torch.randn(2, 7)])
    assert "\n" not in str(info.value)
