"""Conv subclasses with a forward of their own (TF-style SAME padding, as EfficientNet ports
write it) keep that forward when prepared: checked against torch's own conv and fake-quant
kernels, in float, fake-quant and integer stages."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from qdebug.engine import QConfig, calibrate, convert, prepare, quant_points
from qdebug.engine.modules import QConv


class SamePadConv(nn.Conv2d):
    """Pads like TensorFlow's SAME (more on the bottom/right), then convolves without padding."""

    def __init__(self, cin: int, cout: int, k: int, stride: int):
        super().__init__(cin, cout, k, stride=stride, padding=0, bias=True)
        self.static_padding = nn.ZeroPad2d((0, 1, 0, 1))  # 3x3 / stride 2 on an even size

    def forward(self, x):
        x = self.static_padding(x)
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = SamePadConv(3, 8, 3, 2)
        self.act = nn.ReLU()
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.head(self.act(self.stem(x)))


def _net_and_data():
    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return net, x


def test_the_subclass_forward_survives_prepare_in_float_mode():
    net, x = _net_and_data()
    prepared = prepare(net, QConfig(), example_inputs=x)
    stem = prepared.get_submodule("stem")
    assert isinstance(stem, QConv) and stem.own_forward_of.endswith("SamePadConv")
    with torch.no_grad():
        assert torch.equal(prepared(x), net(x))  # every point in float: the very same computation
        assert prepared(x).shape == (4, 4, 8, 8)


def test_fake_quant_pads_then_convolves_with_the_quantized_weight():
    net, x = _net_and_data()
    prepared = calibrate(prepare(net, QConfig(), example_inputs=x), [x])
    point = quant_points(prepared)["stem.weight"]
    scale, zp = point.qparams()
    w = net.stem.weight.detach()
    # torch's own kernels as the oracle: the weight fake-quantized per channel, SAME padding, conv.
    if scale.dim():
        wq = torch.fake_quantize_per_channel_affine(w, scale, zp.to(torch.int32), 0, point.spec.qmin, point.spec.qmax)
    else:
        wq = torch.fake_quantize_per_tensor_affine(w, float(scale), int(zp), point.spec.qmin, point.spec.qmax)
    expected = F.conv2d(F.pad(x, (0, 1, 0, 1)), wq, net.stem.bias.detach(), stride=2)
    for name, p in quant_points(prepared).items():
        if name != "stem.weight":
            p.mode = "float"
    with torch.no_grad():
        got = prepared.get_submodule("stem")(x)
    assert torch.equal(got, expected)


def test_integer_stage_runs_the_integer_kernel_through_the_padding():
    net, x = _net_and_data()
    prepared = calibrate(prepare(net, QConfig(), example_inputs=x), [x])
    quantized = convert(prepared)
    with torch.no_grad():
        y_int, y_fake = quantized(x), prepared(x)
    assert sum(m.integer_fallbacks for m in quantized.modules() if isinstance(m, QConv)) == 0
    out = quant_points(quantized)["head"]
    step = float(out.scale)
    # Integer requantization and float fake quant round differently by at most one step.
    assert float((y_int - y_fake).abs().max()) <= step * (1 + 1e-4)
    codes = y_int / step
    assert float((codes - torch.round(codes)).abs().max()) < 1e-3 and not math.isnan(float(codes.sum()))


def test_a_bias_free_subclass_under_reverse_fold_keeps_its_missing_bias():
    """The weight/bias stand-ins must leave a bias-free conv bias-free (its None bias is a
    plain attribute the stand-in replaces for the call), in a BN mode that calls the
    layer's own forward without a bias."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = SamePadConv(3, 8, 3, 2)
            self.conv.bias = None
            self.bn = nn.BatchNorm2d(8)
            self.act = nn.ReLU()

        def forward(self, x):
            return self.act(self.bn(self.conv(x)))

    net = Block().eval()
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    prepared = prepare(net, QConfig(), mode="with_bn_reverse_fold", example_inputs=x)
    with torch.no_grad():
        first, second = prepared(x), prepared(x)
    assert torch.allclose(first, net(x), atol=1e-5) and torch.equal(first, second)
    assert prepared.get_submodule("conv").bias is None


class InlinePad(nn.Module):
    """SAME padding written in the container's forward (F.pad, then a valid conv), and a
    reflection pad that is not a zero pad."""

    def __init__(self, reflect: bool = False):
        super().__init__()
        self.reflect = reflect
        self.conv = nn.Conv2d(3, 8, 3, stride=2)
        self.act = nn.ReLU()
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        x = F.pad(x, (0, 1, 0, 1), mode="reflect") if self.reflect else F.pad(x, (0, 1, 0, 1))
        return self.head(self.act(self.conv(x)))


def test_a_zero_pad_is_an_integer_pass_through_and_other_pads_fall_back():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a zero pad is no float fallback: no warning
        prepared = calibrate(prepare(InlinePad().eval(), QConfig(), example_inputs=x), [x])
    assert not any("pad" in name for name in quant_points(prepared))  # the output stays on the input's grid
    quantized = convert(prepared)
    with torch.no_grad():
        y_int, y_fake = quantized(x), prepared(x)
    assert sum(m.integer_fallbacks for m in quantized.modules() if isinstance(m, QConv)) == 0
    step = float(quant_points(quantized)["head"].scale)
    assert float((y_int - y_fake).abs().max()) <= step * (1 + 1e-4)
    # The fake-quant run pads the quantized input with exact zeros, as torch's own ops do.
    with torch.no_grad():
        for name, point in quant_points(prepared).items():
            if name != "input":
                point.mode = "float"
        p = quant_points(prepared)["input"]
        xq = torch.fake_quantize_per_tensor_affine(x, float(p.scale), int(p.zero_point), p.spec.qmin, p.spec.qmax)
        # Only the input point on: the model is the float layers after a zero pad of the
        # fake-quantized input (torch's kernels as the oracle).
        float_layers = InlinePad().eval()
        float_layers.load_state_dict({k: v for k, v in prepared.state_dict().items() if "qdebug" not in k})
        expected = float_layers.head(float_layers.act(float_layers.conv(F.pad(xq, (0, 1, 0, 1)))))
        assert torch.equal(prepared(x), expected)
    with pytest.warns(UserWarning, match="no quantized kernel"):  # reflection is not a zero pad
        reflected = prepare(InlinePad(reflect=True).eval(), QConfig(), example_inputs=x)
    assert any(point.fallback for point in quant_points(reflected).values())
