"""Cross-layer equalization (qdebug.fix.equalize): the float function is preserved, planted outlier
channels are balanced with the scales computed here by hand, per-tensor int8 weights of a depthwise
network gain what the paper promises, and what may not be rescaled is left alone with a reason."""

import copy

import pytest
import torch
import torch.nn as nn

import qdebug
from qdebug.engine.prepare import calibrate, prepare
from qdebug.engine.spec import QConfig, QuantSpec
from qdebug.errors import QDebugError
from qdebug.fix import equalize
from qdebug.zoo.mobilenetv2 import MobileNetV2
from qdebug.zoo.resnet import ResNet
from small_models import SMALL_MOBILENETV2, SMALL_RESNET, randomize_bn


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    return (20 * torch.log10(reference.norm() / (reference - other).norm())).item()


class ConvReluConv(nn.Module):
    """conv -> BN -> ReLU -> grouped conv (2 groups) -> ReLU -> depthwise conv -> ReLU -> conv,
    then linear -> ReLU -> linear: a chain of pairs of every kind equalize rescales."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu1 = nn.ReLU()
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.relu2 = nn.ReLU()
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.relu3 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 6, 1)
        self.fc1 = nn.Linear(6 * 8 * 8, 12)
        self.relu4 = nn.ReLU()
        self.fc2 = nn.Linear(12, 5)

    def forward(self, x):
        x = self.conv2(self.relu3(self.dw(self.relu2(self.grouped(self.relu1(self.bn1(self.conv1(x))))))))
        return self.fc2(self.relu4(self.fc1(torch.flatten(x, 1))))


class DepthwiseNet(nn.Module):
    """Depthwise conv -> BN -> ReLU -> pointwise conv: where per-tensor weights suffer most."""

    def __init__(self, channels=16, out=24):
        super().__init__()
        self.dw = nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.pw = nn.Conv2d(channels, out, 1)

    def forward(self, x):
        return self.pw(self.relu(self.bn(self.dw(x))))


def _output_ranges(layer):
    return torch.stack([layer.weight[i].abs().max() for i in range(layer.weight.shape[0])])


def _input_ranges(layer):
    """max |W[o, i]| over the outputs o that read input channel i (one group's outputs)."""
    groups = getattr(layer, "groups", 1)
    per_group_in, per_group_out = layer.weight.shape[1], layer.weight.shape[0] // groups
    ranges = []
    for i in range(per_group_in * groups):
        group, local = divmod(i, per_group_in)
        ranges.append(layer.weight[group * per_group_out:(group + 1) * per_group_out, local].abs().max())
    return torch.stack(ranges)


def _planted(model, layer1, layer2, channel, factor):
    """Scale ``layer1``'s output channel by ``factor`` and ``layer2``'s input column by 1/factor
    (the function is unchanged: ReLU between them)."""
    with torch.no_grad():
        layer1.weight[channel] *= factor
        if layer1.bias is not None:
            layer1.bias[channel] *= factor
        layer2.weight[:, channel] /= factor
    return model


@pytest.mark.parametrize("build", [
    lambda: (randomize_bn(ResNet(**SMALL_RESNET), 1), SMALL_RESNET, torch.randn(4, 1, 16, 16)),
    lambda: (randomize_bn(MobileNetV2(**SMALL_MOBILENETV2), 2), SMALL_MOBILENETV2, torch.randn(4, 1, 16, 16)),
    lambda: (randomize_bn(ConvReluConv(), 3), None, torch.randn(4, 3, 8, 8)),
], ids=["resnet", "mobilenetv2", "conv_relu_conv"])
def test_function_preserved_same_class_saves_and_loads(build, tmp_path):
    torch.manual_seed(0)
    model, kwargs, x = build()
    model.eval()
    new, report = equalize(model, x)
    assert type(new) is type(model)
    assert [n for n, _ in new.named_modules()] == [n for n, _ in model.named_modules()]
    assert new.state_dict().keys() == model.state_dict().keys()
    folded_only, _ = equalize(model, x, iterations=0)
    applied = report[report.applied]
    assert len(applied) >= 1
    with torch.no_grad():
        reference = model(x)
        assert sqnr_db(reference, new(x)) >= 80
        assert sqnr_db(reference, folded_only(x)) >= 80
    for row in applied.itertuples():  # really rescaled: its weights moved from the plain fold's
        assert not torch.equal(new.get_submodule(row.layer1).weight, folded_only.get_submodule(row.layer1).weight)
    for row in applied.itertuples():  # the fixed point: every pair's shared channels have equal ranges
        first, second = new.get_submodule(row.layer1), new.get_submodule(row.layer2)
        torch.testing.assert_close(_output_ranges(first), _input_ranges(second), rtol=1e-4, atol=0)
    if kwargs is not None:
        path = qdebug.save(new, tmp_path / "eq.pt", stage="float", model_kwargs=kwargs)
        loaded, info = qdebug.load(path)
        assert type(loaded) is type(model) and info.stage == "float"
        with torch.no_grad():
            assert torch.equal(loaded(x), new.eval()(x))


def test_conv_relu_conv_chain_pairs():
    torch.manual_seed(0)
    model = randomize_bn(ConvReluConv(), 3).eval()
    _, report = equalize(model, torch.randn(2, 3, 8, 8))
    applied = report[report.applied].set_index("layer1")
    assert applied.layer2.to_dict() == {"conv1": "grouped", "grouped": "dw", "dw": "conv2", "fc1": "fc2"}
    assert applied.loc["conv1", "through"] == "bn1 > relu1"
    skipped = report[~report.applied].set_index("layer1").reason
    assert "view or passthrough" in skipped["conv2"]  # flatten changes the channel axis
    assert "model's output" in skipped["fc2"]


def test_planted_outlier_balanced_with_hand_computed_scales():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 6, 3, padding=1)).eval()
    _planted(model, model[0], model[2], channel=3, factor=64.0)
    x = torch.randn(2, 4, 10, 10)
    new, report = equalize(model, x)
    w1, b1, w2 = model[0].weight.detach().double(), model[0].bias.detach().double(), model[2].weight.detach().double()
    r1 = w1.abs().amax(dim=(1, 2, 3))
    r2 = w2.abs().amax(dim=(0, 2, 3))
    s = torch.sqrt(r1 * r2) / r2  # Nagel et al. 2019, eq. (8)
    assert s[3] > 20  # the planted channel carries the outlier
    torch.testing.assert_close(new[0].weight.double(), w1 / s[:, None, None, None], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(new[0].bias.double(), b1 / s, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(new[2].weight.double(), w2 * s[None, :, None, None], rtol=1e-6, atol=1e-7)
    r1_after = new[0].weight.detach().abs().amax(dim=(1, 2, 3))
    r2_after = new[2].weight.detach().abs().amax(dim=(0, 2, 3))
    torch.testing.assert_close(r1_after / r2_after, torch.ones(8), rtol=1e-5, atol=0)  # balanced, channel 3 too
    row = report.iloc[0]
    assert (row.layer1, row.layer2, bool(row.applied)) == ("0", "2", True)
    ratio_before = max((r1.max() / r1.mean()).item(), (r2.max() / r2.mean()).item())
    assert row.range_ratio_before == pytest.approx(ratio_before)
    assert ratio_before > 5 and row.range_ratio_after < 1.5
    assert row.channels == 8 and row.through == "1"
    with torch.no_grad():
        assert sqnr_db(model(x), new(x)) >= 80


def _weights_per_tensor_int8(model):
    """Per-tensor symmetric int8 weights (scale = max|w| / 127), torch's own fake-quant kernel."""
    quantized = copy.deepcopy(model)
    with torch.no_grad():
        for m in quantized.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                scale = m.weight.abs().max().item() / 127
                m.weight.copy_(torch.fake_quantize_per_tensor_affine(m.weight, scale, 0, -128, 127))
    return quantized


def _spread_depthwise_net() -> nn.Module:
    """As in trained depthwise layers after BN folding: channel ranges spread over decades while the
    next layer reads every channel at its own scale (a plant that keeps the function)."""
    torch.manual_seed(2)
    model = randomize_bn(DepthwiseNet(), 4).eval()
    spread = torch.exp(torch.randn(16) * 1.5)
    with torch.no_grad():
        model.dw.weight *= spread[:, None, None, None]
        model.pw.weight /= spread[None, :, None, None]
    return model


def test_depthwise_per_tensor_int8_weights_gain():
    model = _spread_depthwise_net()
    x = torch.randn(8, 16, 12, 12)
    folded, _ = equalize(model, x, iterations=0)
    new, report = equalize(model, x)
    assert report[report.applied].layer1.tolist() == ["dw"]
    with torch.no_grad():
        reference = model(x)
        before = sqnr_db(reference, _weights_per_tensor_int8(folded)(x))
        after = sqnr_db(reference, _weights_per_tensor_int8(new)(x))
    assert after - before >= 6, (before, after)


def test_equalized_model_prepares_and_calibrates_better_with_the_engine():
    """The engine's own per-tensor int8 weights (and int8 activations) on the depthwise network:
    the equalized float model is an ordinary float model to prepare and calibrate, and gains."""
    model = _spread_depthwise_net()
    batches = [torch.randn(8, 16, 12, 12) for _ in range(3)]
    x = torch.randn(8, 16, 12, 12)

    def quantized_sqnr(float_model):
        prepared = prepare(float_model, QConfig(weight=QuantSpec(per_channel=False)), example_inputs=batches[0])
        calibrate(prepared, batches)
        with torch.no_grad():
            return sqnr_db(model(x), prepared(x))

    new, _ = equalize(model, batches[0])
    before, after = quantized_sqnr(model), quantized_sqnr(new)
    assert after - before >= 6, (before, after)


class SharedConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.shared = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.shared(self.relu(self.shared(self.relu(self.first(x)))))


def test_residual_and_shared_modules_are_left_alone_with_reasons():
    torch.manual_seed(3)
    resnet = randomize_bn(ResNet(**SMALL_RESNET), 1).eval()
    _, report = equalize(resnet, torch.randn(2, 1, 16, 16))
    reasons = report.set_index("layer1").reason
    assert "read 2 times" in reasons["conv1"]  # the stem's ReLU output feeds the block and its shortcut
    assert "layer1.0.add" in reasons["layer1.0.conv2"]  # the block's output joins the residual add
    assert set(report[report.applied].layer1) == {"layer1.0.conv1", "layer2.0.conv1"}

    shared = SharedConv().eval()
    x = torch.randn(2, 3, 8, 8)
    new, report = equalize(shared, x)
    assert not report.applied.any()
    assert "called 2 times" in report.set_index("layer1").reason["first"]
    for name, tensor in shared.state_dict().items():
        assert torch.equal(new.state_dict()[name], tensor), name

    mobilenet = MobileNetV2(**SMALL_MOBILENETV2).eval()
    _, report = equalize(mobilenet, torch.randn(2, 1, 16, 16))
    assert "ReLU6 is not positively homogeneous" in report.set_index("layer1").reason["features.1.conv.dw_conv"]


def test_prepared_model_is_refused():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 1)).eval()
    x = torch.randn(1, 3, 8, 8)
    with pytest.raises(QDebugError, match="prepared"):
        equalize(prepare(model, example_inputs=x), x)


def test_relu6_pairs_equalized_inside_the_clip_on_the_data():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU6(), nn.Conv2d(8, 4, 1)).eval()
    _planted(model, model[0], model[2], channel=2, factor=2.5)  # still inside the clip, with headroom
    with torch.no_grad():
        model[0].bias[5] = 10.0  # channel 5 always reaches the clip: its scale must stay 1
        model[2].weight[:, 0] *= 20  # channel 0 would shrink below the data's peak / 6: held there
    batches = [torch.randn(2, 3, 8, 8) for _ in range(3)]
    new, report = equalize(model, batches[0], batches=batches)
    w1, b1, w2 = model[0].weight.detach().double(), model[0].bias.detach().double(), model[2].weight.detach().double()
    with torch.no_grad():
        peak = torch.stack([model[0](x).amax(dim=(0, 2, 3)) for x in batches]).amax(dim=0).double()
    r1, r2 = w1.abs().amax(dim=(1, 2, 3)), w2.abs().amax(dim=(0, 2, 3))
    limit = 6 / 1.5  # the clip, with the documented headroom for unseen inputs
    s = torch.where(peak > limit, torch.ones(8, dtype=torch.float64), torch.maximum(torch.sqrt(r1 / r2), peak / limit))
    assert s[5] == 1 and s[2] > 1.5 and s[0] == peak[0] / limit > torch.sqrt(r1 / r2)[0]
    torch.testing.assert_close(new[0].weight.double(), w1 / s[:, None, None, None], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(new[0].bias.double(), b1 / s, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(new[2].weight.double(), w2 * s[None, :, None, None], rtol=1e-6, atol=1e-7)
    row = report.iloc[0]
    assert bool(row.applied) and "1 channel(s) come within 1.5x of the clip" in row.reason
    with torch.no_grad():
        for x in batches:
            assert sqnr_db(model(x), new(x)) >= 80

    mobilenet = randomize_bn(MobileNetV2(**SMALL_MOBILENETV2), 2).eval()
    batches = [torch.randn(2, 1, 16, 16) for _ in range(2)]
    new, report = equalize(mobilenet, batches[0], batches=batches)
    assert report.applied.sum() == 11  # the 10 ReLU6 pairs join the one linear project -> expand pair
    with torch.no_grad():
        for x in batches:
            assert sqnr_db(mobilenet(x), new(x)) >= 80


def test_a_parametrized_weight_is_left_alone():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.utils.parametrizations.weight_norm(nn.Conv2d(4, 4, 1)))
    x = torch.randn(1, 3, 8, 8)
    new, report = equalize(model.eval(), x)
    assert not report.applied.any() and "parametrization" in report.reason.iloc[0]
    with torch.no_grad():
        assert torch.equal(new(x), model(x))


def test_timm_efficientnet_lite0_keeps_its_function_on_unseen_inputs():
    """Code we did not write: timm's EfficientNet-Lite0 (BatchNormAct2d: the ReLU6 sits inside the
    BN module, in place) with randomized BN.  Its ReLU6 pairs are measured at the activation's own
    input (read before the in-place clip overwrites it) and bounded by the BN's statistics: on a new
    batch of the same distribution the output stays >= 80 dB from the original (measured peaks
    alone, 3 batches of 4, gave 45 dB: a channel almost always below zero exceeded its peak 2300x)."""
    from vision_libraries import timm

    torch.manual_seed(0)
    model = randomize_bn(timm().create_model("efficientnet_lite0", pretrained=False, num_classes=10), 1).eval()
    batches = [torch.randn(4, 3, 32, 32) for _ in range(3)]
    new, report = equalize(model, batches[0], batches=batches)
    assert report.applied.sum() >= 15  # the expand/depthwise/project pairs through BatchNormAct2d
    assert "blocks.1.0.bn1 > blocks.1.0.bn1.act" in set(report.through)
    x = torch.randn(8, 3, 32, 32)
    with torch.no_grad():
        assert sqnr_db(model(x), new(x)) >= 80


class SharedActivation(nn.Module):
    """One ReLU6 module applied after every BN, as efficientnet_lite_pytorch's ``_swish``."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 12, 1), nn.BatchNorm2d(12)
        self.conv3 = nn.Conv2d(12, 4, 1)
        self.act = nn.ReLU6()

    def forward(self, x):
        return self.conv3(self.act(self.bn2(self.conv2(self.act(self.bn1(self.conv1(x)))))))


def test_one_activation_module_applied_twice_is_measured_at_its_bn():
    """A stateless activation module called at several places is not a shared layer: both pairs are
    equalized, measured at each BN's output (a hook on the activation would mix its calls)."""
    torch.manual_seed(6)
    model = randomize_bn(SharedActivation(), 3).eval()
    batches = [torch.randn(4, 3, 8, 8) for _ in range(3)]
    new, report = equalize(model, batches[0], batches=batches)
    assert report[report.applied].layer1.tolist() == ["conv1", "conv2"]
    with torch.no_grad():
        for x in batches:
            assert sqnr_db(model(x), new(x)) >= 80
