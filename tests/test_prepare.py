"""prepare / calibrate / set_mode / state_dict / deepcopy on prepared models.

Expected values come from the float model, from the data (observed ranges
computed here), or from torch's own fake-quant kernels.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from qdebug.engine import QConfig, QuantSpec, calibrate, convert, engine_state, is_prepared, prepare, quant_points, set_mode
from qdebug.engine.context import active_context
from qdebug.engine.observers import EMAObserver, MinMaxObserver, PercentileObserver
from qdebug.errors import QDebugError
from qdebug.zoo import ResNet


def _resnet():
    torch.manual_seed(0)
    model = ResNet(layers=[1, 1, 1], widths=[8, 16, 32], num_classes=10, in_channels=1, stem="small").eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model


def _batches(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 1, 16, 16, generator=g) for _ in range(n)]


def _snapshot(model):
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        [(n, type(m)) for n, m in model.named_modules()],
        [p.requires_grad for p in model.parameters()],
        model.training,
        {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in model.named_modules()},
    )


class Small(nn.Module):
    """conv -> relu -> conv -> bn -> add (with the first relu) -> flatten -> fc; no BN pair break."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.relu = nn.ReLU()
        self.layer2 = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Sigmoid())
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        y = self.relu(self.conv1(x))
        y = self.layer2(y) + y
        return self.fc(torch.flatten(y, 1))


# -- the user's model is never touched ---------------------------------------------------------


@pytest.mark.parametrize("mode", ["fuse_bn", "with_bn", "with_bn_reverse_fold"])
def test_user_model_unmodified_and_prepared_is_users_class(mode):
    model = _resnet()
    model.train()  # prepare must not run BN in training on the user's model (or its copy)
    x = _batches(1)[0]
    before = _snapshot(model)
    with torch.no_grad():
        model.eval()
        ref = model(x)
        model.train()
    qm = prepare(model, QConfig(), mode=mode, example_inputs=x)
    calibrate(qm, _batches(2))
    # neither the trace nor calibration (eval) updated the prepared copy's BN statistics
    if mode != "fuse_bn":
        assert torch.equal(qm.layer1[0].bn1.running_mean, model.layer1[0].bn1.running_mean)
    with torch.no_grad():
        qm(x)  # training-mode forward of the copy
    after = _snapshot(model)
    for k, v in before[0].items():
        assert torch.equal(v, after[0][k]), k
    assert before[1:] == after[1:]
    assert type(model.layer1[0].conv1) is nn.Conv2d and type(model.layer1[0].bn1) is nn.BatchNorm2d
    assert not is_prepared(model)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), ref)

    assert isinstance(qm, ResNet) and type(qm) is ResNet
    assert qm.training  # prepare keeps the training flag
    assert qm.layer1[0].conv1 is not model.layer1[0].conv1
    # layer names are the user's
    user_paths = {n for n, _ in model.named_modules()}
    assert user_paths <= {n for n, _ in qm.named_modules()}


def test_prepare_argument_errors():
    model, x = Small().eval(), torch.randn(1, 2, 4, 4)
    with pytest.raises(QDebugError, match="unknown QAT mode"):
        prepare(model, QConfig(), mode="fold", example_inputs=x)
    with pytest.raises(QDebugError, match="example_inputs"):
        prepare(model, QConfig())
    qm = prepare(model, QConfig(), example_inputs=x)
    with pytest.raises(QDebugError, match="already prepared"):
        prepare(qm, QConfig(), example_inputs=x)
    with pytest.raises(QDebugError, match="not prepared"):
        quant_points(model)
    with pytest.raises(QDebugError, match="not prepared"):
        set_mode(model, "fake")


# -- float before calibration --------------------------------------------------------------------


@pytest.mark.parametrize("mode,exact", [("with_bn", True), ("fuse_bn", False), ("with_bn_reverse_fold", False)])
def test_points_start_float_and_reproduce_float_output(mode, exact):
    model = _resnet()
    qm = prepare(model, QConfig(), mode=mode, example_inputs=_batches(1)[0])
    assert {p.mode for p in quant_points(qm).values()} == {"float"}
    assert not any(p.initialized for p in quant_points(qm).values())
    for x in _batches(2, seed=5):
        with torch.no_grad():
            ref, out = model(x), qm(x)
        if exact:
            assert torch.equal(out, ref)
        else:
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


def test_no_bn_model_is_exact_in_float():
    torch.manual_seed(0)
    model = Small().eval()
    x = torch.randn(3, 2, 4, 4)
    qm = prepare(model, QConfig(), example_inputs=x)
    with torch.no_grad():
        assert torch.equal(qm(x), model(x))


# -- set_mode ------------------------------------------------------------------------------------


def test_set_mode_glob_prefix_kind_and_errors():
    model = _resnet()
    x = _batches(1)[0]
    qm = prepare(model, QConfig(), example_inputs=x)
    calibrate(qm, _batches(2))
    names = list(quant_points(qm))
    with torch.no_grad():
        ref = model(x)
        fake = qm(x)
    assert not torch.equal(fake, ref)  # fake mode really quantizes

    changed = set_mode(qm, "float")
    assert changed == names
    with torch.no_grad():
        torch.testing.assert_close(qm(x), ref, rtol=0, atol=1e-6)  # float restores (BN folded)

    # glob
    changed = set_mode(qm, "fake", "layer2.*")
    assert changed and all(n.startswith("layer2.") for n in changed)
    assert changed == [n for n in names if n.startswith("layer2.")]
    modes = {n: p.mode for n, p in quant_points(qm).items()}
    assert all(m == ("fake" if n.startswith("layer2.") else "float") for n, m in modes.items())
    with torch.no_grad():
        partial = qm(x)
    assert not torch.equal(partial, ref) and not torch.equal(partial, fake)

    # module prefix (no wildcard), kind filter
    set_mode(qm, "float")
    changed = set_mode(qm, "fake", "layer3", kind="weight")
    assert changed == [n for n in names if n.startswith("layer3.") and n.endswith(".weight")]
    changed = set_mode(qm, "fake", "layer1.0", kind="activation")
    assert changed == ["layer1.0.relu", "layer1.0.bn2", "layer1.0.relu#2"]
    assert quant_points(qm)["layer1.0.conv1.weight"].mode == "float"
    # a prefix matches whole path components only
    with pytest.raises(QDebugError, match="layer1.0.rel"):
        set_mode(qm, "fake", "layer1.0.rel")
    # an owner path matches its call points (relu and relu#2 are owned by the shared module)
    set_mode(qm, "float")
    assert set_mode(qm, "fake", "layer2.0.relu") == ["layer2.0.relu", "layer2.0.relu#2"]

    set_mode(qm, "fake")
    with torch.no_grad():
        assert torch.equal(qm(x), fake)  # back to the same fake output

    with pytest.raises(QDebugError, match="unknown mode"):
        set_mode(qm, "int8")
    with pytest.raises(QDebugError, match="nothing_here"):
        set_mode(qm, "float", "nothing_here*")
    with pytest.raises(QDebugError):
        set_mode(qm, "float", "fc", kind="bias")  # kind filter leaving nothing
    assert {p.mode for p in quant_points(qm).values()} == {"fake"}  # failed calls changed nothing


# -- QConfig overrides -----------------------------------------------------------------------------


def test_override_16_bit_activations_only_in_layer2():
    model = _resnet()
    qm = prepare(model, {"overrides": {"layer2.*": {"activation": {"bits": 16}}}}, example_inputs=_batches(1)[0])
    pts = quant_points(qm)
    sixteen = sorted(n for n, p in pts.items() if p.spec.bits == 16)
    assert sixteen == sorted(n for n, p in pts.items() if n.startswith("layer2.") and p.kind == "activation")
    assert "layer2.0.relu#2" in sixteen and "layer2.0.downsample.1" in sixteen
    assert all(p.spec.bits == 8 for n, p in pts.items() if n not in sixteen)
    calibrate(qm, _batches(2))
    p16, p8 = pts["layer2.0.relu"], pts["layer1.0.relu"]
    assert p16.spec.qmax == 2**15 - 1
    # the 16-bit point spends 256x more codes on a comparable range
    assert float(p16.scale) < float(p8.scale) / 20


def test_override_inline_op_by_container_glob():
    qm = prepare(Small().eval(), QConfig(overrides={"add": {"activation": {"bits": 4}}}),
                 example_inputs=torch.randn(1, 2, 4, 4))
    assert [n for n, p in quant_points(qm).items() if p.spec.bits == 4] == ["add"]


def test_override_none_keeps_fc_weight_float():
    model = _resnet()
    x = _batches(1)[0]
    qm = prepare(model, QConfig(overrides={"fc": {"weight": None}}), example_inputs=x)
    pts = quant_points(qm)
    assert "fc.weight" not in pts and "fc" in pts  # the output is still quantized
    assert "layer1.0.conv1.weight" in pts
    assert qm.fc.weight_point is None
    calibrate(qm, _batches(2))
    # fake mode: the fc weight is used as is -> the fc output equals float fc on its (quantized) input
    seen = {}
    qm.fc.register_forward_pre_hook(lambda m, a: seen.__setitem__("in", a[0]))
    set_mode(qm, "float", "fc")
    with torch.no_grad():
        out = qm(x)
        torch.testing.assert_close(out, F.linear(seen["in"], model.fc.weight, model.fc.bias), rtol=0, atol=0)


def test_override_activation_none_and_input():
    model = Small().eval()
    qm = prepare(model, QConfig(overrides={"input": {"activation": None}, "layer2.*": {"activation": None}}),
                 example_inputs=torch.randn(1, 2, 4, 4))
    assert [n for n, p in quant_points(qm).items() if p.kind == "activation"] == ["relu", "add", "fc"]


def test_override_glob_matching_nothing_raises_naming_it():
    model = _resnet()
    with pytest.raises(QDebugError, match="layer9"):
        prepare(model, {"overrides": {"layer2.*": {"activation": {"bits": 16}}, "layer9.*": {"weight": None}}},
                example_inputs=_batches(1)[0])
    with pytest.raises(QDebugError, match="unknown quant spec key"):
        QConfig.from_dict({"overrides": {"fc": {"weight": {"bitz": 4}}}})


# -- calibrate -------------------------------------------------------------------------------------


def test_calibrate_zero_batches_raises_and_changes_nothing():
    model = _resnet()
    qm = prepare(model, QConfig(), example_inputs=_batches(1)[0])
    with pytest.raises(QDebugError, match="no batches"):
        calibrate(qm, [])
    calibrate(qm, _batches(2))
    qm.train()
    scales = {n: p.scale.clone() for n, p in quant_points(qm).items() if p.kind == "activation"}
    with pytest.raises(QDebugError, match="no batches"):
        calibrate(qm, iter([]))
    # a failed calibration leaves the calibrated model as it was
    assert qm.training
    assert {p.mode for p in quant_points(qm).values()} == {"fake"}
    for n, s in scales.items():
        assert torch.equal(quant_points(qm)[n].scale, s)
        assert quant_points(qm)[n].observer.initialized


def test_calibrate_sets_finite_positive_frozen_scales_from_the_data():
    model = _resnet()
    batches = _batches(3)
    qm = prepare(model, QConfig(), example_inputs=batches[0])
    qm.train()
    calibrate(qm, iter(batches))  # a generator works
    assert qm.training  # training flag restored
    pts = quant_points(qm)
    for name, p in pts.items():
        assert p.mode == "fake"
        if p.kind == "activation":
            assert p.frozen and p.initialized, name
            assert torch.isfinite(p.scale).all() and (p.scale > 0).all(), name
    # the input point's range is the min/max over all batches (asymmetric int8)
    data = torch.cat(batches)
    lo, hi = min(data.min().item(), 0.0), max(data.max().item(), 0.0)
    torch.testing.assert_close(pts["input"].scale, torch.tensor((hi - lo) / 255), rtol=1e-6, atol=0)
    assert int(pts["input"].zero_point) == -128 - round(lo / ((hi - lo) / 255))
    # frozen: more data (even wider) does not move the scales
    qm.eval()
    before = {n: p.scale.clone() for n, p in pts.items() if p.kind == "activation"}
    with torch.no_grad():
        qm(batches[0] * 10)
    assert all(torch.equal(pts[n].scale, s) for n, s in before.items())


def test_calibrate_uses_the_observer_of_the_spec():
    model = Small().eval()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 2, 4, 4, generator=g) for _ in range(4)]
    batches[1][0, 0, 0, 0] = 40.0  # one outlier
    scales = {}
    for obs in ("minmax", "ema", "percentile"):
        cfg = QConfig(activation=QuantSpec(signed=True, symmetric=False, observer=obs, averaging_constant=0.5,
                                           percentile=99.0))
        qm = prepare(model, cfg, example_inputs=batches[0])
        expected_cls = {"minmax": MinMaxObserver, "ema": EMAObserver, "percentile": PercentileObserver}[obs]
        assert all(type(p.observer) is expected_cls for p in quant_points(qm).values() if p.kind == "activation")
        calibrate(qm, batches)
        scales[obs] = float(quant_points(qm)["input"].scale)
    data_max = max(b.max().item() for b in batches)
    assert scales["minmax"] == pytest.approx((data_max - min(b.min().item() for b in batches)) / 255, rel=1e-6)
    # the EMA forgets the outlier batch, the percentile clips it
    assert scales["ema"] < 0.8 * scales["minmax"]
    assert scales["percentile"] < 0.5 * scales["minmax"]
    assert scales["ema"] != scales["percentile"]


# -- QAT with running observers ----------------------------------------------------------------------


def test_observe_in_fake_updates_scales_only_in_training():
    model = Small().eval()
    x = torch.randn(4, 2, 4, 4)
    qm = prepare(model, QConfig(), example_inputs=x)
    calibrate(qm, [x])
    acts = [n for n, p in quant_points(qm).items() if p.kind == "activation"]
    scales = {n: quant_points(qm)[n].scale.clone() for n in acts}

    # plain fake mode in training: the frozen scales stay
    qm.train()
    qm(x * 4)
    assert all(torch.equal(quant_points(qm)[n].scale, s) for n, s in scales.items())

    set_mode(qm, "fake", observe=True)
    assert all(p.observe_in_fake for p in quant_points(qm).values())
    qm.eval()
    with torch.no_grad():
        qm(x * 4)
    assert all(torch.equal(quant_points(qm)[n].scale, s) for n, s in scales.items())  # eval: no update

    qm.train()
    out = qm(x * 4)
    out.sum().backward()  # QAT: gradients flow
    assert qm.conv1.weight.grad is not None
    grown = float(quant_points(qm)["input"].scale)
    assert grown == pytest.approx(float(scales["input"]) * 4, rel=0.05)  # wider range seen in training
    assert all(not torch.equal(quant_points(qm)[n].scale, scales[n]) for n in ("input", "relu", "fc"))

    set_mode(qm, "fake", observe=False)
    qm(x * 16)
    assert float(quant_points(qm)["input"].scale) == grown


# -- models torch.fx cannot trace; paths the trace never saw ------------------------------------------


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3, padding=1)
        self.b = nn.Conv2d(2, 3, 1)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent Python control flow
            y = F.relu(self.a(x))
        else:
            y = torch.sigmoid(self.b(x))
        return self.head(y.mean((2, 3)))


def test_fx_untraceable_model_prepares_calibrates_converts():
    torch.manual_seed(0)
    model = Branchy().eval()
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(model)
    pos = [torch.rand(2, 2, 5, 5) + 0.1 for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # x.sum() is a float-only (fallback) op
        qm = prepare(model, QConfig(), example_inputs=pos[0])
    assert "a.weight" in quant_points(qm) and "relu" in quant_points(qm)
    with torch.no_grad():
        assert torch.equal(qm(pos[0]), model(pos[0]))
    calibrate(qm, pos)
    qc = convert(qm)
    with torch.no_grad():
        ref, fake, integer = model(pos[1]), qm(pos[1]), qc(pos[1])
    assert torch.isfinite(integer).all()
    torch.testing.assert_close(fake, ref, rtol=0, atol=0.05)
    torch.testing.assert_close(integer, fake, rtol=0, atol=0.05)


def test_path_not_seen_at_trace_gets_a_new_point_with_warning():
    torch.manual_seed(0)
    model = Branchy().eval()
    pos = torch.rand(2, 2, 5, 5) + 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = prepare(model, QConfig(), example_inputs=pos)
    assert "b" not in quant_points(qm) and "sigmoid" not in quant_points(qm)
    assert "b.weight" in quant_points(qm)  # a layer the trace never called still has its weight point

    # 1) discovered during calibration: the new points are calibrated with the rest
    qm2 = copy.deepcopy(qm)
    with pytest.warns(UserWarning, match="not seen"):
        calibrate(qm2, [pos, -pos])
    pts = quant_points(qm2)
    assert engine_state(qm2).discovered == ["b", "sigmoid"]
    assert list(pts)[-2:] == ["b", "sigmoid"]
    for n in ("b", "sigmoid"):
        assert pts[n].initialized and pts[n].mode == "fake" and pts[n].kind == "activation"
    with torch.no_grad():
        out = qm2(-pos)
    _on_grid(out, pts["head"])

    # 2) discovered after calibration, in fake mode: no crash, the new point stays float
    calibrate(qm, [pos])
    with pytest.warns(UserWarning, match="not seen"):
        with torch.no_grad():
            out = qm(-pos)
    assert torch.isfinite(out).all()
    assert engine_state(qm).discovered == ["b", "sigmoid"]
    assert quant_points(qm)["b"].mode == "float" and not quant_points(qm)["b"].initialized
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only once
        with torch.no_grad():
            qm(-pos)
    # a later calibration on both paths calibrates it
    calibrate(qm, [pos, -pos])
    assert quant_points(qm)["b"].initialized and quant_points(qm)["b"].mode == "fake"


def _on_grid(t, point):
    s, z = point.qparams()
    q = t.double() / float(s) + int(z)
    assert (q - q.round()).abs().max() < 1e-3


# -- state_dict round trip, deepcopy ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fuse_bn", "with_bn", "with_bn_reverse_fold"])
def test_state_dict_loads_into_fresh_prepare_from_plan(mode):
    model = _resnet()
    x = _batches(1, seed=9)[0]
    cfg = QConfig(overrides={"layer1.*": {"activation": {"per_channel": True, "ch_axis": 1}}})
    qm = prepare(model, cfg, mode=mode, example_inputs=x)
    calibrate(qm, _batches(2))
    with torch.no_grad():
        out = qm(x)
    sd = qm.state_dict()
    assert sd["qdebug_points.layer2/0/conv1/weight.scale"].shape == (16,)
    assert sd["qdebug_points.layer1/0/relu.scale"].shape == (8,)

    plan = engine_state(qm).plan.to_dict()
    fresh = prepare(_resnet(), cfg, mode=mode, plan=plan)  # no example inputs
    assert list(quant_points(fresh)) == list(quant_points(qm))
    missing, unexpected = fresh.load_state_dict(sd)
    assert not missing and not unexpected
    for n, p in quant_points(fresh).items():
        assert p.scale.shape == quant_points(qm)[n].scale.shape, n
    set_mode(fresh, "fake")  # modes are not part of the state dict
    with torch.no_grad():
        assert torch.equal(fresh(x), out)


def test_state_dict_round_trip_with_a_different_float_start():
    # the loaded weights (folded) and qparams win over the fresh model's own
    model = _resnet()
    x = _batches(1)[0]
    qm = prepare(model, QConfig(), example_inputs=x)
    calibrate(qm, _batches(2))
    with torch.no_grad():
        out = qm(x)
    torch.manual_seed(123)
    other = ResNet(layers=[1, 1, 1], widths=[8, 16, 32], num_classes=10, in_channels=1, stem="small").eval()
    fresh = prepare(other, QConfig(), plan=engine_state(qm).plan.to_dict())
    fresh.load_state_dict(qm.state_dict())
    set_mode(fresh, "fake")
    with torch.no_grad():
        assert torch.equal(fresh(x), out)


def test_deepcopy_is_independent():
    model = _resnet()
    x = _batches(1)[0]
    qm = prepare(model, QConfig(), example_inputs=x)
    calibrate(qm, _batches(2))
    with torch.no_grad():
        fake = qm(x)
    twin = copy.deepcopy(qm)
    assert is_prepared(twin) and type(twin) is ResNet
    assert engine_state(twin) is not engine_state(qm)
    assert quant_points(twin)["input"] is not quant_points(qm)["input"]
    assert quant_points(twin)["input"] is twin.qdebug_points.get_submodule("input")
    assert twin.fc.weight_point is quant_points(twin)["fc.weight"]
    with torch.no_grad():
        assert torch.equal(twin(x), fake)

    set_mode(twin, "float")
    assert {p.mode for p in quant_points(qm).values()} == {"fake"}
    with torch.no_grad():
        torch.testing.assert_close(twin(x), model(x), rtol=0, atol=1e-6)
        assert torch.equal(qm(x), fake)
        twin.fc.weight.add_(1.0)
    with torch.no_grad():
        assert torch.equal(qm(x), fake)  # parameters are not shared either


def test_forward_leaves_no_interceptor_behind_even_on_error():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            if y.shape[0] == 3:
                raise RuntimeError("boom")
            return y + 1

    model = Boom().eval()
    qm = prepare(model, QConfig(), example_inputs=torch.randn(2, 4))
    hooks = torch.nn.modules.module
    assert not hooks._global_forward_hooks and not hooks._global_forward_pre_hooks
    with pytest.raises(RuntimeError, match="boom"):
        qm(torch.randn(3, 4))
    assert active_context() is None
    assert not hooks._global_forward_hooks and not hooks._global_forward_pre_hooks
    assert not engine_state(qm).contexts
    # later forwards are named as usual, and plain torch code outside is not intercepted
    torch.randn(2) + 1
    assert list(quant_points(qm)) == ["input", "fc.weight", "fc", "add"]
    with torch.no_grad():
        assert torch.equal(qm(torch.ones(2, 4)), model(torch.ones(2, 4)))


def test_a_plan_can_give_a_passthrough_module_a_point_of_its_own():
    """A view (a Dropout) some source re-quantizes on a grid of its own -- an FX model imported
    from torch.ao -- is a call with a point when the plan says so: calibrated, fake-quantized,
    the integer stage's next layer on its grid."""
    from qdebug.engine.plan import CallRecord, trace_plan
    from qdebug.engine.point import grid_of

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.drop = nn.Dropout(0.5)
            self.fc = nn.Linear(4 * 6 * 6, 5)

        def forward(self, x):
            return self.fc(self.drop(self.conv(x)).flatten(1))

    torch.manual_seed(0)
    model, x = Head().eval(), torch.randn(2, 3, 8, 8)
    plan = trace_plan(model, x)
    assert "drop" not in plan.calls  # a view: no point by default
    plan.calls["drop"] = CallRecord("drop", "passthrough", "Dropout", "drop", True, inputs=["conv"], point="drop",
                                    output_point="drop")
    qconfig = QConfig(overrides={"drop": {"activation": {"bits": 4}}})
    qm = calibrate(prepare(model, qconfig, plan=plan), [x])
    points = quant_points(qm)
    assert set(points) == {"input", "conv.weight", "conv", "drop", "fc.weight", "fc"}
    drop = points["drop"]
    assert drop.spec.bits == 4 and drop.initialized
    conv_out = {}
    qm.conv.register_forward_hook(lambda m, a, out: conv_out.update(y=out))
    with torch.no_grad():
        out = qm(x)
        expected = qm.fc(drop.apply(conv_out["y"]).flatten(1))
    assert torch.equal(out, points["fc"].apply(expected))
    seen = {}
    integer = convert(qm)
    integer.fc.register_forward_pre_hook(lambda m, a: seen.update(grid=grid_of(a[0])))
    with torch.no_grad():
        integer(x)
    assert seen["grid"] is quant_points(integer)["drop"]
