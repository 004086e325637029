"""High-bias absorption (qdebug.fix.absorb): offsets and biases equal the ones computed here by hand
from the measured pre-activations, the float function holds on the batches, the activation ranges
shrink, what cannot be absorbed exactly is left alone with a reason -- and the issue's planted
outlier: equalization + absorption bring per-tensor int8 activations back to the unplanted model's
SQNR."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from qdebug.engine import QConfig, QuantSpec, calibrate, prepare
from qdebug.errors import QDebugError
from qdebug.fix.absorb import MARGIN, absorb_high_bias
from qdebug.fix.equalize import equalize
from qdebug.measure.stats import sqnr_db as power_sqnr_db
from small_models import randomize_bn


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    reference, other = reference.double(), other.double()
    return power_sqnr_db(reference.pow(2).sum().item(), (reference - other).pow(2).sum().item())


class ConvDwPw(nn.Module):
    """conv -> BN -> ReLU -> depthwise conv (unpadded) -> ReLU -> pointwise conv: two pairs whose
    pre-activations stay above 0 in some channels (BN beta and the depthwise bias set high)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, bias=False)
        self.bn = nn.BatchNorm2d(6)
        self.relu1 = nn.ReLU()
        self.dw = nn.Conv2d(6, 6, 3, groups=6)
        self.relu2 = nn.ReLU()
        self.pw = nn.Conv2d(6, 4, 1)

    def forward(self, x):
        return self.pw(self.relu2(self.dw(self.relu1(self.bn(self.conv(x))))))


def _conv_dw_pw() -> nn.Module:
    torch.manual_seed(0)
    model = randomize_bn(ConvDwPw(), 1).eval()
    with torch.no_grad():
        model.bn.bias.copy_(torch.tensor([3.0, -1.0, 4.0, 0.0, 5.0, 2.5]))
        model.bn.weight.mul_(0.3)
        model.dw.bias.copy_(torch.tensor([6.0, 0.0, -2.0, 8.0, 3.0, 5.0]))
    return model


def _offsets(pre_activations: list[torch.Tensor], margin: float) -> torch.Tensor:
    """c_i = m_i - margin (M_i - m_i) where > 0, from the channel's minimum and maximum, by hand."""
    stacked = torch.cat([z.double().transpose(0, 1).reshape(z.shape[1], -1) for z in pre_activations], dim=1)
    low, high = stacked.min(dim=1).values, stacked.max(dim=1).values
    lower = low - margin * (high - low)
    return torch.where(lower > 0, lower, torch.zeros_like(lower))


def _constant_response(conv: nn.Conv2d, constant: torch.Tensor) -> torch.Tensor:
    """What an unpadded conv adds at every position to an input equal to c_i on channel i:
    conv(c) - conv(0), evaluated by torch's own conv on a constant image."""
    image = constant.reshape(1, -1, 1, 1).expand(1, constant.numel(), 5, 5)
    return F.conv2d(image, conv.weight.double(), groups=conv.groups)[0, :, 0, 0]


@pytest.mark.parametrize("margin", [0.0, MARGIN])
def test_offsets_and_biases_computed_by_hand(margin):
    model = _conv_dw_pw()
    batches = [torch.randn(2, 3, 10, 10) for _ in range(3)]
    original = copy.deepcopy(model.state_dict())
    new, report = absorb_high_bias(model, batches, margin=margin)
    for name, tensor in model.state_dict().items():  # the user's model is untouched
        assert torch.equal(tensor, original[name]), name
    assert type(new) is type(model) and new.state_dict().keys() == model.state_dict().keys()
    with torch.no_grad():
        z1 = [model.bn(model.conv(x)) for x in batches]
        z2 = [model.dw(model.relu1(z)) for z in z1]
    c1, c2 = _offsets(z1, margin), _offsets(z2, margin)
    assert (c1 > 0).sum() >= 2 and (c2 > 0).sum() >= 2  # the plant: both pairs have channels to absorb
    bn = model.bn
    folded = (bn.bias - bn.running_mean * bn.weight / torch.sqrt(bn.running_var + bn.eps)).double()
    # conv has no bias: its folded bias, lowered by c1, lives in the identity BN's bias
    torch.testing.assert_close(new.bn.bias.double(), folded - c1, rtol=1e-5, atol=1e-5)
    assert new.conv.bias is None
    dw_bias = model.dw.bias.double() + _constant_response(model.dw, c1) - c2  # gains W2 c1, loses c2
    torch.testing.assert_close(new.dw.bias.double(), dw_bias, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new.pw.bias.double(), model.pw.bias.double() + _constant_response(model.pw, c2),
                               rtol=1e-5, atol=1e-5)
    rows = report.set_index("layer1")
    assert rows.loc["conv", "layer2"] == "dw" and rows.loc["dw", "layer2"] == "pw"
    assert bool(rows.loc["conv", "applied"]) and bool(rows.loc["dw", "applied"])
    assert rows.loc["conv", "channels_absorbed"] == int((c1 > 0).sum())
    assert rows.loc["dw", "absorbed_max"] == pytest.approx(c2.max().item(), rel=1e-6)
    with torch.no_grad():
        for x, z in zip(batches, z1):
            assert sqnr_db(model(x), new(x)) >= 80
            before = F.relu(z).amax(dim=(0, 2, 3)).double()
            after = new.relu1(new.bn(new.conv(x))).amax(dim=(0, 2, 3)).double()
            torch.testing.assert_close(after, before - c1, rtol=1e-5, atol=1e-5)  # each range shrinks by c_i
    peak_before = torch.stack([F.relu(z).amax(dim=(0, 2, 3)) for z in z1]).amax(dim=0).double()
    assert rows.loc["conv", "range_before"] == pytest.approx(peak_before.max().item(), rel=1e-6)
    assert rows.loc["conv", "range_after"] == pytest.approx((peak_before - c1).max().item(), rel=1e-6)
    assert rows.loc["conv", "range_after"] < rows.loc["conv", "range_before"]
    assert "model's output" in rows.loc["pw", "reason"] and not rows.loc["pw", "applied"]


def test_offsets_held_in_running_mean_and_linear_pairs():
    """No bias and a BN without affine parameters on both sides: the offsets live in the identity
    BNs' running_mean (which holds -b); Linear pairs absorb through W2 c; no bias, no absorption."""
    torch.manual_seed(1)
    convs = nn.Sequential(nn.Conv2d(3, 5, 1, bias=False), nn.BatchNorm2d(5, affine=False), nn.ReLU(),
                          nn.Conv2d(5, 4, 1, bias=False), nn.BatchNorm2d(4, affine=False), nn.ReLU(),
                          nn.Conv2d(4, 2, 1)).eval()
    with torch.no_grad():
        convs[1].running_mean.fill_(-4.0)  # (x + 4) / sigma: above 0 on the data
        convs[4].running_mean.fill_(-4.0)
    batches = [torch.rand(2, 3, 6, 6) for _ in range(2)]
    new, report = absorb_high_bias(convs, batches)
    assert report.applied.tolist()[:2] == [True, True] and report.channels_absorbed.tolist()[:2] == [5, 4]
    assert new.state_dict().keys() == convs.state_dict().keys()
    with torch.no_grad():
        c1 = _offsets([convs[1](convs[0](x)) for x in batches], MARGIN)
    folded = -convs[1].running_mean.double() / torch.sqrt(convs[1].running_var.double() + convs[1].eps)
    torch.testing.assert_close(new[1].running_mean.double(), -(folded - c1), rtol=1e-5, atol=1e-5)  # holds -b
    with torch.no_grad():
        for x in batches:
            assert sqnr_db(convs(x), new(x)) >= 80

    linears = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.ReLU(), nn.Linear(3, 2, bias=False),
                            nn.ReLU(), nn.Linear(2, 2)).eval()
    with torch.no_grad():
        linears[0].bias.fill_(5.0)
        linears[2].bias.fill_(5.0)
    batches = [torch.rand(8, 4) for _ in range(2)]
    new, report = absorb_high_bias(linears, batches, margin=0.0)
    with torch.no_grad():
        c = _offsets([linears[0](x) for x in batches], 0.0)
    torch.testing.assert_close(new[2].bias.double(), linears[2].bias.double() + linears[2].weight.double() @ c,
                               rtol=1e-5, atol=1e-5)
    reasons = report.set_index("layer1").reason
    assert "4 has no bias (nor a folded BN) to hold" in reasons["2"]
    assert "4 has no bias (nor a folded BN) to lower" in reasons["4"]
    with torch.no_grad():
        for x in batches:
            assert sqnr_db(linears(x), new(x)) >= 80


def test_zero_padding_is_skipped_other_padding_is_exact():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, padding=1, padding_mode="replicate")).eval()
    with torch.no_grad():
        model[0].bias.fill_(4.0)
        model[2].bias.fill_(4.0)
    batches = [torch.rand(2, 3, 6, 6) for _ in range(2)]
    new, report = absorb_high_bias(model, batches)
    rows = report.set_index("layer1")
    assert not rows.loc["0", "applied"] and "2 pads with zeros" in rows.loc["0", "reason"]
    assert rows.loc["2", "applied"] and rows.loc["2", "channels_absorbed"] == 4  # replicate padding: exact
    assert torch.equal(new[0].bias, model[0].bias)
    with torch.no_grad():
        for x in batches:
            assert sqnr_db(model(x), new(x)) >= 80


def test_relu6_channels_absorbed_only_below_the_clip():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU6(), nn.Linear(4, 2)).eval()
    with torch.no_grad():
        model[0].weight.mul_(0.1)
        model[0].bias.copy_(torch.tensor([2.0, 9.0, -3.0, 5.9]))  # absorbed, at the clip, clipped, near it
    batches = [torch.rand(16, 3) for _ in range(2)]
    new, report = absorb_high_bias(model, batches, margin=0.0)
    with torch.no_grad():
        z = torch.cat([model[0](x) for x in batches])
    low, high = z.min(dim=0).values.double(), z.max(dim=0).values.double()
    expected = torch.where((low > 0) & (high <= 6), low, torch.zeros_like(low))
    assert expected[0] > 0 and expected[1] == 0 and expected[2] == 0
    torch.testing.assert_close(new[0].bias.double(), model[0].bias.double() - expected, rtol=1e-6, atol=1e-6)
    row = report.iloc[0]
    assert row.applied and f"{int((high > 6).sum())} channel(s) reach the clip" in row.reason
    with torch.no_grad():
        for x in batches:
            assert sqnr_db(model(x), new(x)) >= 80


def test_data_free_offsets_from_the_bn():
    """batches=None: AIMET's c_i = max(0, beta_i - 3 |gamma_i|) from L1's BN before folding."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4),
                          nn.ReLU6(), nn.Conv2d(4, 2, 1), nn.ReLU(), nn.Conv2d(2, 2, 1)).eval()
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([0.5, -0.5, 1.0, 2.0]))
        model[1].bias.copy_(torch.tensor([2.0, 2.0, 1.0, 7.0]))
    x = torch.randn(2, 3, 8, 8)
    new, report = absorb_high_bias(model, None, example_inputs=x)
    expected = torch.tensor([0.5, 0.5, 0.0, 1.0], dtype=torch.float64)
    bn = model[1]
    folded = ((model[0].bias - bn.running_mean) * bn.weight / torch.sqrt(bn.running_var + bn.eps) + bn.bias).double()
    torch.testing.assert_close(new[0].bias.double(), folded - expected, rtol=1e-5, atol=1e-5)
    rows = report.set_index("layer1")
    assert rows.loc["0", "applied"] and rows.loc["0", "channels_absorbed"] == 3
    assert "ReLU6 needs the data's maximum" in rows.loc["3", "reason"]
    assert "6 has no folded BN" in rows.loc["6", "reason"]
    with pytest.raises(QDebugError, match="needs batches or example_inputs"):
        absorb_high_bias(model, None)


def test_bad_input_gets_one_clear_error():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    x = torch.randn(2, 3)
    with pytest.raises(QDebugError, match="prepared"):
        absorb_high_bias(prepare(model, example_inputs=x), [x])
    with pytest.raises(QDebugError, match="no batches"):
        absorb_high_bias(model, [])
    with pytest.raises(QDebugError, match="margin"):
        absorb_high_bias(model, [x], margin=-0.1)
    with pytest.raises(QDebugError, match="iterable"):
        absorb_high_bias(model, 3)
    _, report = absorb_high_bias(model, iter([x, x]))  # a one-shot iterator traces and measures
    assert len(report) == 2


# --- the planted outlier (must-have 4) ---------------------------------------------------

def _block(inputs: int, outputs: int, kernel: int) -> list[nn.Module]:
    return [nn.Conv2d(inputs, outputs, kernel, padding=kernel // 2, bias=False), nn.BatchNorm2d(outputs), nn.ReLU()]


def _planted_pair():
    """A conv-BN-ReLU stack, and the same with channel k of its second BN x64 (gamma and beta: the
    ReLU output x64) compensated by the next conv's input column / 64 -- the same function."""
    torch.manual_seed(0)
    clean = nn.Sequential(*_block(3, 16, 3), *_block(16, 16, 3), *_block(16, 16, 1), *_block(16, 16, 1),
                          nn.Conv2d(16, 8, 1))
    clean = randomize_bn(clean, 0).eval()
    planted = copy.deepcopy(clean)
    channel = int(clean[4].bias.argmax())  # an active channel (highest beta), so the plant shows
    with torch.no_grad():
        planted[4].weight[channel] *= 64
        planted[4].bias[channel] *= 64
        planted[6].weight[:, channel] /= 64
    return clean, planted


@pytest.mark.parametrize("per_channel_weights", [True, False], ids=["weights_per_channel", "weights_per_tensor"])
def test_planted_outlier_fixed_to_the_unplanted_sqnr(per_channel_weights):
    clean, planted = _planted_pair()
    generator = torch.Generator().manual_seed(100)
    calibration = [torch.randn(4, 3, 12, 12, generator=generator) for _ in range(3)]
    held_out = [torch.randn(4, 3, 12, 12, generator=generator) for _ in range(2)]
    qconfig = QConfig(weight=QuantSpec(per_channel=per_channel_weights))
    assert not qconfig.activation.per_channel and qconfig.activation.bits == 8  # per-tensor int8 activations

    def quantized_sqnr(float_model):
        prepared = calibrate(prepare(float_model, qconfig, mode="fuse_bn", example_inputs=calibration[0]),
                             calibration)
        with torch.no_grad():
            return min(sqnr_db(clean(x), prepared(x)) for x in held_out)

    equalized, _ = equalize(planted, calibration[0], batches=calibration)
    fixed, report = absorb_high_bias(equalized, calibration)
    assert report.applied.sum() >= 2
    with torch.no_grad():
        for x in calibration:
            assert sqnr_db(planted(x), fixed(x)) >= 80
            assert sqnr_db(clean(x), planted(x)) >= 80  # the plant keeps the function
    clean_sqnr, planted_sqnr, fixed_sqnr = quantized_sqnr(clean), quantized_sqnr(planted), quantized_sqnr(fixed)
    # measured (CPU): per-channel weights 44.4 / 30.5 / 45.0 dB, per-tensor 44.3 / 32.1 / 44.7 dB
    assert planted_sqnr <= clean_sqnr - 10, (clean_sqnr, planted_sqnr)
    assert fixed_sqnr >= clean_sqnr - 1, (clean_sqnr, fixed_sqnr)


class StaticSamePaddingConv(nn.Conv2d):
    """As efficientnet_lite_pytorch's Conv2dStaticSamePadding: ``padding=0``, a ZeroPad2d child
    applied in its own forward (TF's SAME padding for a fixed image size)."""

    def __init__(self, channels_in, channels_out, kernel):
        super().__init__(channels_in, channels_out, kernel)
        pad = (kernel - 1) // 2
        self.static_padding = nn.ZeroPad2d(pad) if pad else nn.Identity()

    def forward(self, x):
        return super().forward(self.static_padding(x))


def test_a_conv_that_pads_in_its_own_forward_is_found_by_running_it():
    """``padding=0`` says nothing of a ZeroPad2d child: the 3x3 such conv reads zeros at the border
    and is skipped, the 1x1 one (an Identity child) absorbs; the function is kept on the batches."""
    torch.manual_seed(8)
    model = nn.Sequential(nn.Conv2d(3, 6, 1), nn.BatchNorm2d(6), nn.ReLU(), StaticSamePaddingConv(6, 6, 3),
                          nn.BatchNorm2d(6), nn.ReLU(), StaticSamePaddingConv(6, 4, 1)).eval()
    with torch.no_grad():
        for bn in (model[1], model[4]):
            bn.bias.fill_(3.0)  # every pre-activation stays well above 0: all channels absorbable
    batches = [torch.randn(2, 3, 8, 8) for _ in range(3)]
    new, report = absorb_high_bias(model, batches)
    rows = {row.layer2: row for row in report.itertuples()}
    assert not rows["3"].applied and "pads inside its own forward" in rows["3"].reason
    assert rows["6"].applied and rows["6"].channels_absorbed >= 3
    with torch.no_grad():
        for x in batches:
            assert sqnr_db(model(x), new(x)) >= 80
