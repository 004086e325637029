"""Conv-BN handling in the three QAT modes, checked against torch's own modules.

References: ``torch.nn.utils.fusion.fuse_conv_bn_eval`` (the eval fold) and
``torch.ao.nn.intrinsic.qat.ConvBn{1,2}d`` / ``ConvBnReLU2d`` (the reverse-fold
training scheme).  Nothing here compares qdebug with itself.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.ao.nn.intrinsic.qat as nniqat
import torch.nn as nn
from torch.ao.quantization import FakeQuantize, PerChannelMinMaxObserver
from torch.ao.quantization import QConfig as TorchQConfig
from torch.ao.quantization import default_fake_quant
from torch.nn.utils.fusion import fuse_conv_bn_eval

from qdebug.engine import FuseBN, QConfig, QuantSpec, absorb_bn, calibrate, convert, prepare, quant_points, set_mode
from qdebug.engine.modules import FoldedBatchNorm, QConv

PER_TENSOR = QuantSpec(per_channel=False)  # int8 symmetric per-tensor weights
PER_CHANNEL = QuantSpec(per_channel=True, ch_axis=0)  # the default: int8 symmetric per-channel


def _randomize_bn(bn: nn.modules.batchnorm._BatchNorm, *, negative_gamma: bool = True) -> None:
    """Non-trivial running stats and affine parameters (some gammas negative)."""
    with torch.no_grad():
        n = bn.num_features
        bn.running_mean.copy_(torch.randn(n) * 0.5)
        bn.running_var.copy_(torch.rand(n) * 2.0 + 0.2)
        gamma = torch.rand(n) * 1.5 + 0.25
        if negative_gamma:
            gamma[::3] *= -1
        bn.weight.copy_(gamma)
        bn.bias.copy_(torch.randn(n) * 0.3)


class ConvBN(nn.Module):
    def __init__(self, bias: bool = True, relu: bool = False, dims: int = 2, cin: int = 3, cout: int = 8):
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv1d
        bn = nn.BatchNorm2d if dims == 2 else nn.BatchNorm1d
        self.conv = conv(cin, cout, 3, padding=1, bias=bias)
        self.bn = bn(cout)
        self.relu = nn.ReLU() if relu else nn.Identity()
        _randomize_bn(self.bn)

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# -- fuse_bn -----------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False])
def test_fuse_bn_folds_like_torch(bias):
    torch.manual_seed(0)
    model = ConvBN(bias=bias).eval()
    x = torch.randn(2, 3, 8, 8)
    qm = prepare(model, QConfig(), mode="fuse_bn", example_inputs=x)

    ref = fuse_conv_bn_eval(copy.deepcopy(model.conv), copy.deepcopy(model.bn))
    assert isinstance(qm.conv, QConv) and qm.conv.bn_mode == "fused" and qm.conv.bn is None
    torch.testing.assert_close(qm.conv.weight.detach(), ref.weight.detach(), atol=1e-6, rtol=0)
    assert qm.conv.bias is not None
    torch.testing.assert_close(qm.conv.bias.detach(), ref.bias.detach(), atol=1e-6, rtol=0)

    assert isinstance(qm.bn, FoldedBatchNorm)
    assert qm.bn.folded_into == "conv"
    assert "bn" in dict(qm.named_modules())
    # All points still in "float" after prepare: the folded model computes conv -> BN(eval).
    with torch.no_grad():
        torch.testing.assert_close(qm.eval()(x), model(x), atol=1e-5, rtol=1e-5)


# -- with_bn_reverse_fold in training == torch's ConvBn ------------------------------------
def _torch_qat_qconfig() -> TorchQConfig:
    weight = FakeQuantize.with_args(
        observer=PerChannelMinMaxObserver,
        quant_min=-128,
        quant_max=127,
        dtype=torch.qint8,
        qscheme=torch.per_channel_symmetric,
        ch_axis=0,
    )
    return TorchQConfig(activation=default_fake_quant, weight=weight)


def _torch_conv_bn(model: ConvBN, cls) -> nn.Module:
    conv, bn = model.conv, model.bn
    ref = cls(
        conv.in_channels,
        conv.out_channels,
        conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=conv.groups,
        bias=conv.bias is not None,
        eps=bn.eps,
        momentum=bn.momentum,
        qconfig=_torch_qat_qconfig(),
    )
    with torch.no_grad():
        ref.weight.copy_(conv.weight)
        if conv.bias is not None:
            ref.bias.copy_(conv.bias)
        ref.bn.load_state_dict(bn.state_dict())
    return ref


@pytest.mark.parametrize(
    "dims,relu,cls,bias",
    [
        (2, False, nniqat.ConvBn2d, True),
        (2, False, nniqat.ConvBn2d, False),
        (2, True, nniqat.ConvBnReLU2d, True),
        (1, False, nniqat.ConvBn1d, True),
    ],
)
def test_reverse_fold_training_matches_torch_convbn(dims, relu, cls, bias):
    torch.manual_seed(1)
    model = ConvBN(bias=bias, relu=relu, dims=dims)
    shape = (4, 3, 10, 10) if dims == 2 else (4, 3, 16)
    x = torch.randn(*shape)
    ref = _torch_conv_bn(model, cls).train()

    qm = prepare(model, QConfig(), mode="with_bn_reverse_fold", example_inputs=x)
    calibrate(qm, [x])
    set_mode(qm, "float", kind="activation")  # torch's ConvBn has no activation fake-quant
    assert quant_points(qm)["conv.weight"].mode == "fake"
    qm.train()
    out = qm(x)

    # Both sides quantize W * gamma / sqrt(running_var + eps) per channel, symmetric int8,
    # fake-quant range [-128, 127].  The scales themselves are not comparable: torch's
    # symmetric observer divides max|w| by (qmax - qmin) / 2 = 127.5, qdebug by qmax = 127.
    # So we take the scale qdebug computed in this very forward (from W f with the running
    # variance *before* the update, as torch does) and install it in torch's
    # weight_fake_quant with its observer disabled.  That isolates what is being tested:
    # where the fake-quant sits (on W f), the division by f, the bias, the BN in training.
    point = quant_points(qm)["conv.weight"]
    scale, zero_point = point.qparams()
    assert scale.shape == (model.conv.out_channels,)
    ref.weight_fake_quant.disable_observer()
    ref.weight_fake_quant.scale = scale.clone()
    ref.weight_fake_quant.zero_point = zero_point.to(torch.int32).clone()
    expected = ref(x)

    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # The scale really followed W f (not W): at least one code reaches +-127 per channel.
    f = model.bn.weight / torch.sqrt(model.bn.running_var + model.bn.eps)
    wf = model.conv.weight * f.reshape([-1] + [1] * (model.conv.weight.dim() - 1))
    amax = wf.detach().abs().flatten(1).max(dim=1).values
    torch.testing.assert_close(scale, amax / 127, rtol=1e-6, atol=0)

    # BN running statistics updated identically by the training forward.
    torch.testing.assert_close(qm.bn.running_mean, ref.bn.running_mean, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(qm.bn.running_var, ref.bn.running_var, atol=1e-6, rtol=1e-6)
    assert int(qm.bn.num_batches_tracked) == int(ref.bn.num_batches_tracked) == 1
    assert not torch.equal(qm.bn.running_mean, model.bn.running_mean)

    # Gradients flow the same way too (straight-through, clipped).
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(qm.conv.weight.grad, ref.weight.grad, atol=1e-4, rtol=1e-4)


# -- absorb: lossless under reverse fold, a real change under with_bn ---------------------
def _eval_out(qm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    qm.eval()
    with torch.no_grad():
        return qm(x)


@pytest.mark.parametrize("weight_spec", [PER_TENSOR, PER_CHANNEL], ids=["per_tensor", "per_channel"])
def test_absorb_under_reverse_fold_keeps_eval_output(weight_spec):
    torch.manual_seed(2)
    model = ConvBN(bias=True, relu=True)
    x = torch.randn(4, 3, 10, 10)
    qm = prepare(model, QConfig(weight=weight_spec), mode="with_bn_reverse_fold", example_inputs=x)
    calibrate(qm, [x])
    set_mode(qm, "float", kind="activation")  # isolate the weight quantization
    before = _eval_out(qm, x)
    # The weight really is quantized (else the check below is vacuous).
    assert _rel(before, model.eval()(x).detach()) > 1e-4

    assert absorb_bn(qm) == ["conv"]
    assert isinstance(qm.bn, FoldedBatchNorm) and qm.conv.bn_mode == "fused"
    after = _eval_out(qm, x)
    assert _rel(after, before) <= 1e-5
    assert absorb_bn(qm) == []  # nothing left to fold


def test_absorb_under_with_bn_changes_eval_output_per_tensor():
    torch.manual_seed(3)
    model = ConvBN(bias=True, relu=False)
    x = torch.randn(4, 3, 10, 10)
    qm = prepare(model, QConfig(weight=PER_TENSOR), mode="with_bn", example_inputs=x)
    calibrate(qm, [x])
    set_mode(qm, "float", kind="activation")
    before = _eval_out(qm, x)
    # with_bn in eval: conv(x, fq(W)) + b, then BN with running stats -- check against torch.
    w = qm.conv.weight.detach()
    s = w.abs().max() / 127
    fq_w = torch.fake_quantize_per_tensor_affine(w, s, 0, -128, 127)
    bn = copy.deepcopy(model.bn).eval()
    expected = bn(nn.functional.conv2d(x, fq_w, model.conv.bias, padding=1))
    torch.testing.assert_close(before, expected.detach(), atol=1e-5, rtol=1e-5)

    absorb_bn(qm)
    after = _eval_out(qm, x)
    # A per-tensor scale is re-fit to W f, whose channels were scaled by different f:
    # the grid changes, so the folded eval output differs measurably.
    assert _rel(after, before) > 1e-4
    # ... and it is exactly torch's fold, quantized per tensor.
    folded = fuse_conv_bn_eval(copy.deepcopy(model.conv).eval(), copy.deepcopy(model.bn).eval())
    wf = folded.weight.detach()
    fq_wf = torch.fake_quantize_per_tensor_affine(wf, wf.abs().max() / 127, 0, -128, 127)
    expected = nn.functional.conv2d(x, fq_wf, folded.bias.detach(), padding=1)
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-5)


def test_absorb_under_with_bn_per_channel_symmetric_is_invisible():
    # Why per-channel symmetric weights hide the with_bn folding loss: channel c of W f is
    # f_c W_c, its scale is max|f_c W_c| / 127 = |f_c| s_c, so its codes are
    # round(f_c W_c / (|f_c| s_c)) = sign(f_c) round(W_c / s_c) (round-half-even is odd-
    # symmetric) and fq(W f) = f fq(W) up to float rounding.  The fold then changes nothing,
    # which is why the with_bn case above uses per-tensor weights.
    torch.manual_seed(3)
    model = ConvBN(bias=True)
    x = torch.randn(4, 3, 10, 10)
    qm = prepare(model, QConfig(weight=PER_CHANNEL), mode="with_bn", example_inputs=x)
    calibrate(qm, [x])
    set_mode(qm, "float", kind="activation")
    before = _eval_out(qm, x)
    absorb_bn(qm)
    after = _eval_out(qm, x)
    assert _rel(after, before) <= 1e-5


# -- what is (not) a pair -----------------------------------------------------------------
class ConvReluBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.relu = nn.ReLU()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.relu(self.conv(x)))


class ConvUsedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


@pytest.mark.parametrize("cls", [ConvReluBN, ConvUsedTwice])
@pytest.mark.parametrize("mode", ["fuse_bn", "with_bn", "with_bn_reverse_fold"])
def test_not_a_pair_is_not_folded(cls, mode):
    torch.manual_seed(4)
    model = cls().eval()
    _randomize_bn(model.bn)
    x = torch.randn(2, 3, 8, 8)
    qm = prepare(model, QConfig(), mode=mode, example_inputs=x)
    assert type(qm.bn) is nn.BatchNorm2d
    assert qm.conv.bn is None and qm.conv.bn_mode == "none"
    torch.testing.assert_close(qm.conv.weight, model.conv.weight)
    assert absorb_bn(qm) == []
    with torch.no_grad():
        torch.testing.assert_close(qm.eval()(x), model(x))


# -- FuseBN schedule ----------------------------------------------------------------------
class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.block1 = ConvBN(bias=False, relu=True, cin=3, cout=4)
        self.block2 = ConvBN(bias=False, relu=True, cin=4, cout=4)

    def forward(self, x):
        return self.block2(self.block1(x))


def _two_blocks():
    torch.manual_seed(5)
    model = TwoBlocks()
    x = torch.randn(2, 3, 8, 8)
    qm = prepare(model, QConfig(), mode="with_bn_reverse_fold", example_inputs=x)
    calibrate(qm, [x])
    return qm, x


def _folded(qm) -> dict[str, bool]:
    return {b: isinstance(qm.get_submodule(f"{b}.bn"), FoldedBatchNorm) for b in ("block1", "block2")}


def test_fusebn_by_step_absorbs_each_group_once_at_its_step():
    qm, x = _two_blocks()
    fuse = FuseBN(modules=[["block1"], ["block2"]], step_or_epoch=[2, 4], update_by="step")
    history = {}
    for step in range(6):
        history[step] = (fuse.on_step(qm, step), _folded(qm))
        qm.train()
        qm(x)  # a training forward between steps keeps working on the partly folded model
    assert history[0] == ([], {"block1": False, "block2": False})
    assert history[1] == ([], {"block1": False, "block2": False})
    assert history[2] == (["block1.conv"], {"block1": True, "block2": False})
    assert history[3] == ([], {"block1": True, "block2": False})
    assert history[4] == (["block2.conv"], {"block1": True, "block2": True})
    assert history[5] == ([], {"block1": True, "block2": True})
    assert fuse.absorbed == ["block1.conv", "block2.conv"]
    assert fuse(qm, 100) == []
    assert qm.block1.conv.bn_mode == "fused" and qm.block1.bn.folded_into == "block1.conv"


def test_fusebn_late_first_call_folds_all_due_groups():
    qm, _ = _two_blocks()
    fuse = FuseBN(modules=[["block1"], ["block2"]], step_or_epoch=[2, 4], update_by="step")
    assert fuse.on_step(qm, 7) == ["block1.conv", "block2.conv"]
    assert fuse.on_step(qm, 8) == []


def test_fusebn_by_epoch_ignores_steps():
    qm, _ = _two_blocks()
    fuse = FuseBN(modules=[["block1"], ["block2"]], step_or_epoch=[2, 4], update_by="epoch")
    for step in range(10):
        assert fuse.on_step(qm, step) == []
    assert _folded(qm) == {"block1": False, "block2": False}
    assert fuse.on_epoch(qm, 1) == []
    assert fuse.on_epoch(qm, 2) == ["block1.conv"]
    assert fuse.on_epoch(qm, 5) == ["block2.conv"]
    assert _folded(qm) == {"block1": True, "block2": True}


# -- the user's model is never touched ----------------------------------------------------
@pytest.mark.parametrize("mode", ["fuse_bn", "with_bn", "with_bn_reverse_fold"])
def test_user_model_is_never_modified(mode):
    torch.manual_seed(6)
    model = TwoBlocks().train()
    x = torch.randn(4, 3, 8, 8)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    types = {n: type(m) for n, m in model.named_modules()}
    model.eval()
    with torch.no_grad():
        out = model(x)
    model.train()

    qm = prepare(model, QConfig(), mode=mode, example_inputs=x)
    calibrate(qm, [x, torch.randn(4, 3, 8, 8)])
    qm.train()
    opt = torch.optim.SGD(qm.parameters(), lr=0.1)
    qm(x).sum().backward()
    opt.step()
    absorb_bn(qm, "block1")
    # convert leaves the prepared model alone too (it works on a copy).
    qm.eval()
    with torch.no_grad():
        prepared_out = qm(x)  # (brings the lazily recomputed weight scales up to date)
    prepared_sd = {k: v.clone() for k, v in qm.state_dict().items()}
    converted = convert(qm)
    with torch.no_grad():
        converted(x)
        assert torch.equal(qm(x), prepared_out)
    assert qm.block1.conv.stage == "fake" and not hasattr(qm.block1.conv, "weight_int")
    if mode != "fuse_bn":
        assert isinstance(qm.block2.bn, nn.BatchNorm2d)  # convert folded its copy only
    for k, v in prepared_sd.items():
        assert torch.equal(qm.state_dict()[k], v), k

    assert model.training
    assert {n: type(m) for n, m in model.named_modules()} == types
    after = model.state_dict()
    assert after.keys() == sd.keys()
    for k, v in sd.items():
        assert torch.equal(after[k], v), k
    assert all(p.grad is None for p in model.parameters())
    assert not hasattr(model, "_qdebug_state")
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), out)


def test_reverse_fold_with_a_zero_gamma_stays_finite_and_outputs_beta(make_resnet, images):
    """gamma = 0 makes f = 0: the forward must not compute 0 / 0 (torch's old ConvBn2d bug).
    The channel's BN output is beta, in every point mode, in training too, and after folding."""
    import torch

    from qdebug.engine import QConfig, absorb_bn, calibrate, prepare, set_mode

    float_model = make_resnet(0)
    with torch.no_grad():
        float_model.layer1[0].bn1.weight[2] = 0.0
    x = images(4, seed=3)
    model = prepare(float_model, QConfig(), mode="with_bn_reverse_fold", example_inputs=x)
    bn = model.get_submodule("layer1.0.bn1")
    seen = {}
    bn.register_forward_hook(lambda m, a, out: seen.__setitem__("bn1", out.detach().clone()))
    with torch.no_grad():
        expected = float_model(x)
        got = model.eval()(x)  # every point in float
    assert torch.isfinite(got).all()
    assert torch.allclose(got, expected, atol=1e-4)
    assert torch.equal(seen["bn1"][:, 2], torch.full_like(seen["bn1"][:, 2], float(bn.bias[2].detach())))
    calibrate(model, [images(8, seed=s) for s in (10, 11)])
    set_mode(model, "fake")
    model.train()
    out = model(x)
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        before = model(x)
        absorb_bn(model)
        after = model(x)
    assert torch.isfinite(after).all() and torch.allclose(before, after, atol=1e-5)


@pytest.mark.parametrize("mode", ["with_bn", "with_bn_reverse_fold"])
def test_frozen_bn_statistics_keep_the_eval_output_through_training_steps(make_resnet, images, mode):
    """lr = 0: only BN's running statistics can move the eval output; frozen, they do not."""
    import copy

    import torch

    from qdebug.engine import FreezeBN, calibrate, freeze_bn_stats, prepare
    from qdebug.engine import QConfig

    model = calibrate(prepare(make_resnet(0), QConfig(), mode=mode, example_inputs=images(4, seed=1)),
                      [images(8, seed=s) for s in (10, 11)])
    x = images(4, seed=3)

    def eval_after_steps(net):
        opt = torch.optim.SGD(net.parameters(), lr=0.0)
        net.train()
        for step in range(8):
            loss = net(images(4, seed=40 + step)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            return net(x)

    with torch.no_grad():
        before = model.eval()(x)
    drifting = eval_after_steps(copy.deepcopy(model))
    assert not torch.allclose(drifting, before)  # running statistics moved on 4-image batches
    frozen = copy.deepcopy(model)
    names = freeze_bn_stats(frozen)
    assert "layer1.0.bn1" in names
    assert torch.equal(eval_after_steps(frozen), before)
    assert not frozen.get_submodule("layer1.0.bn1").training  # train() keeps frozen BN in eval mode
    freeze_bn_stats(frozen, freeze=False)
    frozen.train()
    assert frozen.get_submodule("layer1.0.bn1").training
    # The step callback: nothing before its step, every BN from it on.
    later = copy.deepcopy(model)
    callback = FreezeBN(modules=[["layer1"]], step_or_epoch=[3])
    assert callback(later, 2) == [] and callback(later, 3) == ["layer1.0.bn1", "layer1.0.bn2"]
    assert callback(later, 4) == []
    later.train()
    assert not later.get_submodule("layer1.0.bn1").training and later.get_submodule("layer2.0.bn1").training


def test_checkpoints_keep_bn_statistics_frozen(tmp_path, make_resnet, images):
    """A QAT checkpoint saved with frozen BN statistics resumes with them frozen; the others train."""
    import qdebug
    from qdebug.engine import freeze_bn_stats

    x = images()
    qm = prepare(make_resnet(), QConfig(), mode="with_bn_reverse_fold", example_inputs=x)
    calibrate(qm, [x])
    freeze_bn_stats(qm, "layer1")
    qdebug.save(qm, tmp_path / "qat.pt", stage="qat")
    loaded, _ = qdebug.load(tmp_path / "qat.pt")
    loaded.train()
    assert not loaded.layer1[0].bn1.training and not loaded.layer1[0].bn2.training
    assert loaded.layer2[0].bn1.training
