"""Which calls get a quant point, what they are called, and what fake mode does at each.

Expected values are computed here from the float model and torch's own
fake-quant kernels (``torch.fake_quantize_per_*_affine``), never read back from
the code under test beyond the calibrated activation qparams (whose derivation
from the observed float range is checked separately).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from qdebug.engine import QConfig, calibrate, engine_state, prepare, quant_points
from qdebug.engine.point import grid_of
from qdebug.zoo import MobileNetV2, MultiTaskNet, ResNet, ShuffleNetV2

QMIN = -128


# -- helpers ------------------------------------------------------------------------------


def _prepare(model, x, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # supported ops must not warn
        return prepare(model.eval(), QConfig(), example_inputs=x, **kw)


def _act_names(qm):
    return [n for n, p in quant_points(qm).items() if p.kind == "activation"]


def _weight_names(qm):
    return [n for n, p in quant_points(qm).items() if p.kind == "weight"]


def _fq(t, point):
    """Per-tensor fake quant of ``t`` with ``point``'s qparams (torch's kernel)."""
    s, z = point.qparams()
    return torch.fake_quantize_per_tensor_affine(t, float(s), int(z), point.spec.qmin, point.spec.qmax)


def _fq_weight(w):
    """Default weight spec computed independently: int8 symmetric per output channel, min/max."""
    amax = w.detach().abs().flatten(1).amax(1)
    scale = torch.clamp(amax / 127.0, min=torch.finfo(torch.float32).eps)
    return torch.fake_quantize_per_channel_affine(w, scale, torch.zeros_like(scale, dtype=torch.int32), 0, -127 - 1, 127)


def _assert_on_grid(t, point):
    s, z = point.qparams()
    q = t.detach().double() / float(s) + int(z)
    assert (q - q.round()).abs().max() < 1e-3, point.name
    assert q.round().min() >= point.spec.qmin and q.round().max() <= point.spec.qmax, point.name


def _record_outputs(qm):
    """Attach a listener: returns dict call name -> output after the handler."""
    seen = {}
    engine_state(qm).listeners.append(lambda event: seen.__setitem__(event.call.name, event.out))
    return seen


def _record_order(qm):
    order = []
    engine_state(qm).listeners.append(lambda event: order.append(event.call.name))
    return order


class Single(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)


class ConvAct(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.act = act

    def forward(self, x):
        return self.act(self.conv(x))


# -- weighted layers ----------------------------------------------------------------------

WEIGHTED = {
    "conv2d_stride_pad": (lambda: nn.Conv2d(4, 8, 3, stride=2, padding=1), (2, 4, 9, 9)),
    "conv2d_groups": (lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), (2, 4, 7, 7)),
    "conv2d_depthwise": (lambda: nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False), (2, 6, 7, 7)),
    "conv2d_dilation": (lambda: nn.Conv2d(4, 5, 3, padding=2, dilation=2), (2, 4, 9, 9)),
    "conv2d_rect_stride": (lambda: nn.Conv2d(3, 5, (3, 1), stride=(2, 1), padding=(1, 0)), (2, 3, 8, 6)),
    "conv2d_reflect": (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (2, 3, 6, 6)),
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2), (2, 4, 17)),
    "conv1d_depthwise": (lambda: nn.Conv1d(4, 4, 5, padding=2, groups=4), (2, 4, 11)),
    "linear": (lambda: nn.Linear(7, 5), (3, 7)),
    "linear_3d": (lambda: nn.Linear(7, 5), (2, 3, 7)),
}


@pytest.mark.parametrize("case", list(WEIGHTED))
def test_weighted_layer_points_and_fake_quant_reference(case):
    make, shape = WEIGHTED[case]
    torch.manual_seed(0)
    model = Single(make()).eval()
    x = torch.randn(shape)
    qm = _prepare(model, x)
    assert list(quant_points(qm)) == ["input", "layer.weight", "layer"]
    with torch.no_grad():
        ref = model(x)
        assert torch.equal(qm(x), ref)  # float mode: exact
        calibrate(qm, [x])
        out = qm(x)

    pts = quant_points(qm)
    # The output point took its range from the float output of the layer.
    lo, hi = min(ref.min().item(), 0.0), max(ref.max().item(), 0.0)
    torch.testing.assert_close(pts["layer"].scale, torch.tensor((hi - lo) / 255.0), rtol=1e-6, atol=0)

    layer = model.layer
    wq = _fq_weight(layer.weight)
    xq = _fq(x, pts["input"])
    with torch.no_grad():
        if isinstance(layer, nn.Linear):
            y = F.linear(xq, wq, layer.bias)
        else:
            y = type(layer)(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                            padding=layer.padding, dilation=layer.dilation, groups=layer.groups,
                            bias=layer.bias is not None, padding_mode=layer.padding_mode)
            y.weight.copy_(wq)
            if layer.bias is not None:
                y.bias.copy_(layer.bias)
            y = y(xq)
        expected = _fq(y, pts["layer"])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert not torch.equal(out, ref)
    # weight scale shape: one per output channel
    assert pts["layer.weight"].scale.shape == (layer.weight.shape[0],)


# -- activations and fusion -----------------------------------------------------------------

ACTS = {
    "ReLU": (lambda: nn.ReLU(), True),
    "ReLU6": (lambda: nn.ReLU6(), True),
    "LeakyReLU": (lambda: nn.LeakyReLU(0.1), False),
    "Hardswish": (lambda: nn.Hardswish(), False),
    "Sigmoid": (lambda: nn.Sigmoid(), False),
    "Tanh": (lambda: nn.Tanh(), False),
    "Softmax": (lambda: nn.Softmax(dim=1), False),
}


@pytest.mark.parametrize("name", list(ACTS))
def test_activation_modules(name):
    make, fused = ACTS[name]
    torch.manual_seed(1)
    model = ConvAct(make()).eval()
    x = torch.randn(2, 3, 5, 5) * 3
    qm = _prepare(model, x)
    expected_points = ["input", "conv.weight", "act"] if fused else ["input", "conv.weight", "conv", "act"]
    assert list(quant_points(qm)) == expected_points
    rec = engine_state(qm).plan.calls["conv"]
    assert rec.fused_into == ("act" if fused else None)
    with torch.no_grad():
        ref = model(x)
        assert torch.equal(qm(x), ref)
        calibrate(qm, [x])
        out = qm(x)
    pts = quant_points(qm)
    with torch.no_grad():
        y = F.conv2d(_fq(x, pts["input"]), _fq_weight(model.conv.weight), model.conv.bias, padding=1)
        if not fused:
            y = _fq(y, pts["conv"])  # a non-fusable activation reads a quantized conv output
        expected = _fq(model.act(y), pts["act"])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    if fused:  # a fused activation's range starts at 0: the point never wastes codes on negatives
        assert int(pts["act"].zero_point) == QMIN


class ConvBNAct(nn.Module):
    def __init__(self, dims=2, act=True):
        super().__init__()
        Conv, BN = (nn.Conv1d, nn.BatchNorm1d) if dims == 1 else (nn.Conv2d, nn.BatchNorm2d)
        self.conv = Conv(3, 6, 3, padding=1, bias=False)
        self.bn = BN(6)
        self.relu = nn.ReLU() if act else nn.Identity()
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("mode", ["fuse_bn", "with_bn", "with_bn_reverse_fold"])
def test_conv_bn_relu_one_point(dims, mode):
    torch.manual_seed(2)
    model = ConvBNAct(dims).eval()
    x = torch.randn((2, 3, 12) if dims == 1 else (2, 3, 6, 6))
    qm = _prepare(model, x, mode=mode)
    assert list(quant_points(qm)) == ["input", "conv.weight", "relu"]
    plan = engine_state(qm).plan
    assert plan.pairs == [("conv", "bn")]
    assert plan.calls["conv"].output_point == plan.calls["bn"].output_point == "relu"
    with torch.no_grad():
        ref = model(x)
        out = qm(x)
    if mode == "with_bn":
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


def test_conv_bn_without_relu_point_at_bn():
    model = ConvBNAct(act=False).eval()
    x = torch.randn(2, 3, 6, 6)
    qm = _prepare(model, x)
    assert list(quant_points(qm)) == ["input", "conv.weight", "bn"]  # identity is a passthrough


def test_linear_bn1d_and_standalone_bn2d_get_points():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn0 = nn.BatchNorm2d(2)
            self.fc = nn.Linear(8, 4)
            self.bn1 = nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn1(self.fc(torch.flatten(self.bn0(x), 1)))

    x = torch.randn(3, 2, 2, 2)
    qm = _prepare(M(), x)
    # No conv before either BN: nothing is folded, each BN output is quantized.
    assert engine_state(qm).plan.pairs == []
    assert _act_names(qm) == ["input", "bn0", "fc", "bn1"]


class AddRelu(nn.Module):
    def __init__(self, reuse_sum=False):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 4, 1)
        self.reuse_sum = reuse_sum

    def forward(self, x):
        s = self.a(x) + self.b(x)
        y = F.relu(s)
        return y * s if self.reuse_sum else y


def test_add_relu_fused_one_point():
    x = torch.randn(2, 3, 4, 4)
    qm = _prepare(AddRelu().eval(), x)
    assert _act_names(qm) == ["input", "a", "b", "relu"]
    assert engine_state(qm).plan.calls["add"].fused_into == "relu"
    calibrate(qm, [x])
    seen = _record_outputs(qm)
    with torch.no_grad():
        out = qm(x)
        pts = quant_points(qm)
        expected = _fq(F.relu(seen["a"] + seen["b"]), pts["relu"])  # the sum itself is not quantized
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_add_with_two_consumers_not_fused():
    x = torch.randn(2, 3, 4, 4)
    qm = _prepare(AddRelu(reuse_sum=True).eval(), x)
    assert _act_names(qm) == ["input", "a", "b", "add", "relu", "mul"]


def test_conv_output_used_twice_not_fused():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)
            self.relu = nn.ReLU()

        def forward(self, x):
            y = self.conv(x)
            return self.relu(y) + y

    qm = _prepare(M().eval(), torch.randn(1, 3, 2, 2))
    assert _act_names(qm) == ["input", "conv", "relu", "add"]


def test_inline_relu_variants_fuse_and_are_named():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2, self.c3 = nn.Conv2d(2, 2, 1), nn.Conv2d(2, 2, 1), nn.Conv2d(2, 2, 1)

        def forward(self, x):
            a = F.relu(self.c1(x))
            b = F.hardtanh(self.c2(x), 0.0, 6.0)  # relu6 spelled as hardtanh
            c = torch.clamp(self.c3(x), min=0)  # relu spelled as clamp
            return torch.cat([a, b, c], 1)

    qm = _prepare(M().eval(), torch.randn(1, 2, 3, 3))
    assert _act_names(qm) == ["input", "relu", "relu6", "relu#2", "cat"]


# -- passthrough, pools, upsampling ----------------------------------------------------------


class Passthrough(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.maxpool = nn.MaxPool2d(2)
        self.drop = nn.Dropout(0.5)
        self.ident = nn.Identity()
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        y = self.up(self.ident(self.drop(self.maxpool(self.conv(x)))))
        y = F.max_pool2d(y, 1)
        y = F.interpolate(y, scale_factor=1.0)  # nearest by default
        y = y.view(y.shape[0], 4, -1).reshape(y.shape[0], 4, 4, 4)
        return self.fc(self.flatten(y))


def test_passthrough_ops_get_no_point_and_keep_the_grid():
    torch.manual_seed(3)
    model = Passthrough().eval()
    x = torch.randn(2, 2, 4, 4)
    qm = _prepare(model, x)
    assert list(quant_points(qm)) == ["input", "conv.weight", "conv", "fc.weight", "fc"]
    with torch.no_grad():
        assert torch.equal(qm(x), model(x))
    calibrate(qm, [x])
    fc_in = []
    qm.fc.register_forward_pre_hook(lambda m, args: fc_in.append(args[0]))
    with torch.no_grad():
        qm(x)
    _assert_on_grid(fc_in[0], quant_points(qm)["conv"])
    assert grid_of(fc_in[0]) is quant_points(qm)["conv"]  # integer kernels downstream find the grid
    # and it really is the quantized conv output, moved around: its values are a subset of them
    seen = _record_outputs(qm)
    with torch.no_grad():
        qm(x)
    assert set(fc_in[-1].unique().tolist()) <= set(seen["conv"].unique().tolist())


def test_pools_and_linear_upsampling_get_points():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 4, 3, padding=1)
            self.avg = nn.AvgPool2d(2)
            self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
            self.gap = nn.AdaptiveAvgPool2d(1)

        def forward(self, x):
            y = self.up(self.avg(self.conv(x)))
            y = F.interpolate(y, scale_factor=0.5, mode="bilinear", align_corners=False)
            y = F.avg_pool2d(y, 2)
            return self.gap(y)

    torch.manual_seed(4)
    x = torch.randn(2, 2, 8, 8)
    qm = _prepare(M().eval(), x)
    assert _act_names(qm) == ["input", "conv", "avg", "up", "interpolate", "avg_pool2d", "gap"]
    calibrate(qm, [x])
    seen = _record_outputs(qm)
    with torch.no_grad():
        qm(x)
    for name in _act_names(qm):
        _assert_on_grid(seen[name], quant_points(qm)[name])


# -- inline ops -------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        s = a + b  # add
        s = torch.add(s, a)  # add#2
        s = F.relu(s)  # fused with add#2
        c = torch.cat([s, b], dim=1)  # cat
        m = torch.mul(c, 0.5)  # mul (by a scalar)
        m = m * c  # mul#2
        v = m.view(m.shape[0], 8, -1).reshape(m.shape[0], 8, 4, 4)  # passthrough
        f = torch.flatten(v, 2)  # passthrough
        return f.mean(dim=2)  # mean


class InlineModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(self.block(x))


def test_inline_ops_get_named_points_without_rewrite():
    torch.manual_seed(5)
    model = InlineModel().eval()
    x = torch.randn(2, 3, 4, 4)
    qm = _prepare(model, x)
    assert type(qm.block) is Block  # the container is not rewritten
    assert _act_names(qm) == [
        "input", "block.a", "block.b", "block.add", "block.relu", "block.cat", "block.mul", "block.mul#2",
        "block.mean", "fc",
    ]
    plan = engine_state(qm).plan
    assert plan.calls["block.add#2"].fused_into == "block.relu"
    assert plan.calls["block.add#2"].category == "add"
    inline = ["block.add", "block.relu", "block.cat", "block.mul", "block.mul#2", "block.mean"]
    assert {quant_points(qm)[n].owner for n in inline} == {"block"}
    assert quant_points(qm)["block.a"].owner == "block.a"
    assert not any(p.fallback for p in quant_points(qm).values())

    with torch.no_grad():
        assert torch.equal(qm(x), model(x))
    calibrate(qm, [x])
    seen = _record_outputs(qm)
    with torch.no_grad():
        qm(x)
    pts = quant_points(qm)
    for name in _act_names(qm):
        _assert_on_grid(seen[name], pts[name])
    # each inline op really computes on the quantized values it is given
    with torch.no_grad():
        torch.testing.assert_close(seen["block.add"], _fq(seen["block.a"] + seen["block.b"], pts["block.add"]))
        torch.testing.assert_close(
            seen["block.relu"], _fq(F.relu(seen["block.add"] + seen["block.a"]), pts["block.relu"])
        )
        torch.testing.assert_close(seen["block.cat"], _fq(torch.cat([seen["block.relu"], seen["block.b"]], 1),
                                                          pts["block.cat"]))
        torch.testing.assert_close(seen["block.mean"], _fq(seen["block.mul#2"].flatten(2).mean(2), pts["block.mean"]))


class Unsupported(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.soft = nn.Softplus()  # a module the engine does not know

    def forward(self, x):
        y = torch.exp(self.conv(x))
        y = y.pow(2)
        return self.soft(y)


def test_unsupported_ops_fall_back_with_point_and_warning():
    torch.manual_seed(6)
    model = Unsupported().eval()
    x = torch.randn(2, 2, 3, 3) * 0.3
    with pytest.warns(UserWarning) as record:
        qm = prepare(model, QConfig(), example_inputs=x)
    text = " ".join(str(w.message) for w in record)
    for name in ("exp", "pow", "soft.softplus"):
        assert name in text
    pts = quant_points(qm)
    assert _act_names(qm) == ["input", "conv", "exp", "pow", "soft.softplus"]
    assert [n for n, p in pts.items() if p.fallback] == ["exp", "pow", "soft.softplus"]
    assert not pts["conv"].fallback
    with torch.no_grad():
        assert torch.equal(qm(x), model(x))  # the fallback ops run in float
    calibrate(qm, [x])
    seen = _record_outputs(qm)
    with torch.no_grad():
        qm(x)
        torch.testing.assert_close(seen["exp"], _fq(torch.exp(seen["conv"]), pts["exp"]))
        torch.testing.assert_close(seen["pow"], _fq(seen["exp"].pow(2), pts["pow"]))
    for name in ("exp", "pow", "soft.softplus"):
        _assert_on_grid(seen[name], pts[name])


def test_non_activation_results_get_no_point():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            n = x.size(0)  # a size: not a tensor
            mask = x > 0  # bool: not an activation
            b = self.fc.bias.abs()  # parameter-only: a constant
            y = self.fc(x)
            return y.masked_fill(~mask, 0.0)[:n] + b

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        qm = prepare(M().eval(), QConfig(), example_inputs=torch.randn(2, 3))
    # masked_fill on an activation is unsupported -> fallback; nothing else sneaks in
    assert _act_names(qm) == ["input", "fc", "masked_fill", "add"]
    assert [n for n, p in quant_points(qm).items() if p.fallback] == ["masked_fill"]
    messages = [str(w.message) for w in record if "qdebug" in str(w.message)]
    assert len(messages) == 1 and "masked_fill" in messages[0] and "abs" not in messages[0]


# -- naming -------------------------------------------------------------------------------------


def test_module_called_several_times_gets_a_point_per_call():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = nn.Sigmoid()

        def forward(self, x):
            return self.act(self.fc(self.act(self.fc(x))))

    torch.manual_seed(7)
    model = M().eval()
    x = torch.randn(3, 4)
    qm = _prepare(model, x)
    assert list(quant_points(qm)) == ["input", "fc.weight", "fc", "act", "fc#2", "act#2"]
    calibrate(qm, [x])
    pts = quant_points(qm)
    # the two calls have their own ranges
    assert not torch.equal(pts["fc"].scale, pts["fc#2"].scale)
    assert pts["fc#2"].owner == "fc" and pts["act#2"].op == "Sigmoid"


def test_two_input_model_names_inputs():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, y):
            return self.fc(x) * y

    model = M().eval()
    x, y = torch.randn(2, 4), torch.randn(2, 4) * 10
    qm = _prepare(model, (x, y))
    assert _act_names(qm) == ["input", "input#2", "fc", "mul"]
    calibrate(qm, [(x, y)])
    pts = quant_points(qm)
    assert float(pts["input#2"].scale) > 5 * float(pts["input"].scale)  # each input its own range
    with torch.no_grad():
        out = qm(x, y)
        fc = F.linear(_fq(x, pts["input"]), _fq_weight(model.fc.weight), model.fc.bias)
        expected = _fq(_fq(fc, pts["fc"]) * _fq(y, pts["input#2"]), pts["mul"])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_nested_inline_names_and_k_th_call_in_zoo_resnet():
    torch.manual_seed(0)
    model = ResNet(layers=[1, 1, 1], widths=[8, 16, 32], num_classes=10, in_channels=1, stem="small").eval()
    x = torch.randn(2, 1, 28, 28)
    qm = _prepare(model, x)
    pts = quant_points(qm)
    plan = engine_state(qm).plan
    for block in ("layer1.0", "layer2.0", "layer3.0"):
        # conv->bn->relu: one point at relu; add->relu (shared relu, 2nd call): one point at relu#2
        assert f"{block}.relu" in pts and f"{block}.relu#2" in pts
        assert f"{block}.conv1" not in pts and f"{block}.bn1" not in pts and f"{block}.add" not in pts
        assert plan.calls[f"{block}.add"].fused_into == f"{block}.relu#2"
        assert plan.calls[f"{block}.add"].owner == block
        assert f"{block}.bn2" in pts  # feeds the add, not a relu
        assert f"{block}.conv1.weight" in pts and f"{block}.conv2.weight" in pts
    assert "layer2.0.downsample.1" in pts and "layer2.0.downsample.0" not in pts
    assert "maxpool" not in pts and "flatten" not in pts
    assert [n for n in pts if not n.endswith(".weight")][:2] == ["input", "relu"]
    assert list(pts)[-3:] == ["avgpool", "fc.weight", "fc"]
    assert all(p.op == "Conv2d" or p.op == "Linear" for n, p in pts.items() if n.endswith(".weight"))


# -- execution order and the zoo ------------------------------------------------------------------

ZOO = {
    "resnet": lambda: ResNet(layers=[1, 1, 1], widths=[8, 16, 32], num_classes=10, in_channels=1, stem="small"),
    "mobilenetv2": lambda: MobileNetV2(num_classes=10, in_channels=1, width_mult=0.5,
                                       setting=[[1, 8, 1, 1], [6, 16, 2, 2], [6, 24, 2, 2]], stem_stride=1,
                                       dropout=0.1, last_channel=64),
    "shufflenetv2": lambda: ShuffleNetV2(stages_repeats=[2, 2, 1], stages_out_channels=[8, 16, 32, 64, 128],
                                         num_classes=10, in_channels=1, stem_stride=1),
    "multitask": lambda: MultiTaskNet(num_classes=10, num_aux_classes=2, in_channels=1, width=8),
}


def _flat(out):
    return torch.cat([v.flatten() for v in out.values()]) if isinstance(out, dict) else out


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_models_fully_supported_in_execution_order(name):
    torch.manual_seed(0)
    model = ZOO[name]().eval()
    for m in model.modules():  # non-trivial BN statistics
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
    x = torch.randn(2, 1, 28, 28)
    qm = _prepare(model, x)  # no fallback warning
    pts = quant_points(qm)
    assert not any(p.fallback for p in pts.values())
    n_weighted = sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in model.modules())
    assert len(_weight_names(qm)) == n_weighted
    with torch.no_grad():
        torch.testing.assert_close(_flat(qm(x)), _flat(model(x)), rtol=1e-5, atol=1e-5)
    calibrate(qm, [x])
    order = _record_order(qm)
    with torch.no_grad():
        out = _flat(qm(x))
    assert torch.isfinite(out).all()
    # quant_points lists the activation points in the order the forward reaches them
    assert [n for n in order if n in pts] == _act_names(qm)
    # a weight point sits between the activation points executed before and after its layer
    listed = list(pts)
    for w in _weight_names(qm):
        at = order.index(w[: -len(".weight")])
        before = [n for n in order[:at] if n in pts]
        after = [n for n in order[at + 1:] if n in pts]
        assert all(listed.index(n) < listed.index(w) for n in before), w
        assert all(listed.index(n) > listed.index(w) for n in after), w
    assert all(p.initialized for p in pts.values() if p.kind == "activation")


def test_listeners_run_with_the_naming_mode_off_the_stack():
    """A listener's own torch calls (statistics, replays) are not detoured through the naming
    mode (a Python round trip per op); a user's mode above it is left alone."""
    from torch.overrides import TorchFunctionMode, _get_current_function_mode

    from qdebug.engine.context import ForwardContext

    seen = []
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU())
    ctx = ForwardContext(net, listeners=[lambda event: seen.append((event.call.name, _get_current_function_mode()))])
    with torch.no_grad(), ctx:
        ctx.run(net, torch.randn(1, 1, 5, 5))
        assert _get_current_function_mode() is ctx  # back on the stack after every listener
    assert [name for name, _ in seen] == ["input", "0", "1"]
    assert all(mode is not ctx for _, mode in seen)

    class Outer(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    seen.clear()
    with torch.no_grad(), ctx, Outer() as outer:
        ctx.run(net, torch.randn(1, 1, 5, 5))
    assert [mode for _, mode in seen] == [outer] * 3  # not ours to pop: nothing popped
