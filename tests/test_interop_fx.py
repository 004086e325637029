"""Importing torch.ao FX-mode models (prepare_qat_fx / prepare_fx): exact against torch itself.

The oracles are torch's own models: a QAT-prepared GraphModule in eval with its observers
disabled (an enabled observer moves its scale on every forward), after SGD steps made the BN
statistics, scales and weights real, must give the engine model's bits; a PTQ-prepared one,
calibrated, is compared with torch's int8 model from ``convert_fx`` (x86 kernels, reduce-range
activations, so torch's own kernels are exact), within one step of the output grid.
FX keeps no model class: ``float_model`` gives the engine the user's module paths.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qdebug
from qdebug.engine import quant_points
from qdebug.errors import QDebugError
from qdebug.interop import from_torch_ao, import_report
from qdebug.zoo import MobileNetV2, MultiTaskNet, ResNet, ShuffleNetV2

tq = pytest.importorskip("torch.ao.quantization")
quantize_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")


class InlineNet(nn.Module):
    """Inline ops FX keeps as call_function/call_method nodes: a functional ReLU FX fuses into
    a Conv-BN, a ReLU module called twice (once after ``torch.add``), two adds in one scope, a
    max-pool called twice feeding a cat, and ``x.mean``."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        a = F.relu(self.bn1(self.conv1(x)))
        b = self.relu(self.conv2(a))
        s = self.relu(torch.add(a, b))
        s = s + a
        t = torch.cat([self.pool(s), self.pool(a)], 1)
        return self.fc(t.mean((2, 3)))


MOBILENET = {"num_classes": 10, "width_mult": 0.25, "setting": [[1, 16, 1, 1], [6, 24, 2, 2]], "last_channel": 64}


def _mobilenet(dropout: bool = False) -> nn.Module:
    model = MobileNetV2(**MOBILENET)
    if not dropout:
        # An Identity where the Dropout was (FX observes its output too, on the same grid); the
        # Dropout itself: test_mobilenetv2_dropout_requantization_gets_a_point_on_the_view.
        model.classifier.dropout = nn.Identity()
    return model


MODELS = {
    "resnet": (lambda: ResNet(layers=[1, 1], widths=[8, 16], num_classes=10), (2, 3, 32, 32)),
    "mobilenetv2": (_mobilenet, (2, 3, 32, 32)),
    "multitask": (lambda: MultiTaskNet(width=8), (2, 1, 16, 16)),
    "inline": (InlineNet, (2, 3, 16, 16)),
    "shufflenetv2": (lambda: ShuffleNetV2(stages_repeats=[2, 1], stages_out_channels=[8, 16, 32, 64], num_classes=10),
                     (2, 3, 32, 32)),
    "mobilenetv2-dropout": (lambda: _mobilenet(dropout=True), (2, 3, 32, 32)),
}


def _qat_mapping(kind: str):
    if kind == "per_channel":
        return tq.get_default_qat_qconfig_mapping("x86")
    qconfig = tq.QConfig(activation=tq.default_fused_act_fake_quant, weight=tq.default_fused_wt_fake_quant)
    return tq.QConfigMapping().set_global(qconfig)


def _ptq_mapping(kind: str):
    if kind == "per_channel":
        return tq.get_default_qconfig_mapping("x86")
    # Reduce-range activations ([0, 127]) keep x86's int8 conv exact without VNNI.
    qconfig = tq.QConfig(activation=tq.HistogramObserver.with_args(reduce_range=True),
                         weight=tq.default_weight_observer)
    return tq.QConfigMapping().set_global(qconfig)


def _outputs(out) -> list[torch.Tensor]:
    return list(out.values()) if isinstance(out, dict) else [out]


def _qat(name: str, kind: str = "per_channel", steps: int = 3):
    """(prepared QAT GraphModule after ``steps`` SGD steps, in eval, observers off; input)."""
    make, shape = MODELS[name]
    torch.manual_seed(0)
    x = torch.randn(shape)
    prepared = quantize_fx.prepare_qat_fx(make().train(), _qat_mapping(kind), (x,))
    opt = torch.optim.SGD(prepared.parameters(), lr=0.02, momentum=0.9)
    for _ in range(steps):
        batch = torch.randn((8,) + shape[1:])
        loss = sum(F.cross_entropy(o, torch.randint(0, o.shape[1], (8,))) for o in _outputs(prepared(batch)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    prepared.apply(tq.disable_observer)
    prepared.eval()
    return prepared, x


def _observer_nodes(prepared) -> dict[str, torch.fx.Node]:
    return {str(n.target): n for n in prepared.graph.nodes
            if n.op == "call_module" and str(n.target).startswith("activation_post_process_")}


def _report(model) -> list[dict]:
    return import_report(model).to_dict("records")


def _rows(model) -> dict[str, dict]:
    """The import report's rows by source quantizer."""
    return {row["source"]: row for row in _report(model) if row["source"]}


def _assert_reports_every_quantizer(prepared, rows: dict[str, dict]) -> None:
    for target in _observer_nodes(prepared):
        assert target in rows, f"observer {target} missing from the report"
    for path, module in prepared.named_modules():
        if isinstance(getattr(module, "weight_fake_quant", None), nn.Module):
            assert rows[f"{path}.weight_fake_quant"]["point"] == f"{path}.weight"


@pytest.mark.parametrize("name,kind", [
    ("resnet", "per_channel"), ("resnet", "per_tensor"),
    ("mobilenetv2", "per_channel"), ("mobilenetv2", "per_tensor"),
    ("multitask", "per_channel"), ("inline", "per_tensor"),
])
def test_qat_is_bit_identical_to_torch(name, kind):
    prepared, x = _qat(name, kind)
    with torch.no_grad():
        expected = _outputs(prepared(x))
    float_model = MODELS[name][0]()
    before = copy.deepcopy(float_model.state_dict())
    model = from_torch_ao(prepared, x, float_model=float_model)
    with torch.no_grad():
        got = _outputs(model(x))
    for want, have in zip(expected, got, strict=True):
        assert want.unique().numel() >= min(want.numel(), 8) // 2, "a dead network proves nothing"
        assert torch.equal(want, have), f"max |diff| {(want - have).abs().max():.3g}"
    rows = _rows(model)
    _assert_reports_every_quantizer(prepared, rows)
    assert not [r for r in rows.values() if r["status"] == "unmapped"]
    # The user's model is a template: its weights are not the source's and stay untouched.
    assert all(torch.equal(before[k], v) for k, v in float_model.state_dict().items())


def test_qat_points_carry_the_float_models_names(tmp_path):
    prepared, x = _qat("inline")
    rows = _rows(from_torch_ao(prepared, x, float_model=InlineNet()))
    # FX node observed -> the engine call: the functional ReLU fused into conv1-bn1 is "relu()"
    # (an inline op never takes the name of the module ``relu``), the module's calls are relu
    # (after conv2) and relu#2 (after torch.add); ``s + a`` is the 2nd add.
    expected = {"x": "input", "conv1": "relu()", "conv2": "relu", "relu_2": "relu#2", "add_1": "add#2",
                "cat": "cat", "mean": "mean", "fc": "fc"}
    seen = {}
    for target, node in _observer_nodes(prepared).items():
        if node.args[0].name in expected:
            seen[node.args[0].name] = rows[target]["point"]
    assert seen == expected
    # the pool after ``s + a`` and the one after the fused ReLU feed the cat on its own grid
    pools = [t for t, n in _observer_nodes(prepared).items() if n.args[0].name in ("pool", "pool_1")]
    assert len(pools) == 2 and all(rows[t]["point"] == "cat" and rows[t]["status"] == "exact" for t in pools)

    prepared, x = _qat("resnet")
    model = from_torch_ao(prepared, x, float_model=MODELS["resnet"][0]())
    points = {row["point"]: row for row in _report(model)}
    for name in ("input", "relu", "layer1.0.relu", "layer1.0.bn2", "layer1.0.relu#2", "layer2.0.downsample.1",
                 "avgpool", "fc", "layer1.0.conv1.weight", "fc.weight"):
        assert points[name]["status"] == "exact", name
    # the max-pool keeps the stem ReLU's grid: its observer is the same point, reported as such
    maxpool = [t for t, n in _observer_nodes(prepared).items() if n.args[0].name == "maxpool"]
    assert _rows(model)[maxpool[0]]["point"] == "relu"
    # an ordinary qdebug checkpoint of the user's class: it reloads without torch.ao
    path = tmp_path / "qat.pt"
    qdebug.save(model, path, stage="qat", model_spec="qdebug.zoo.resnet:ResNet",
                model_kwargs={"layers": [1, 1], "widths": [8, 16], "num_classes": 10})
    reloaded, _ = qdebug.load(path)
    with torch.no_grad():
        assert torch.equal(reloaded(x), prepared(x))


def test_mobilenetv2_dropout_requantization_gets_a_point_on_the_view(tmp_path):
    """x86 FX re-quantizes the classifier's Dropout output on a grid of its own: the engine gives
    that passthrough module call a point, and the import is bit-identical -- through a save and
    load too (the plan carries the view's point)."""
    prepared, x = _qat("mobilenetv2-dropout")
    model = from_torch_ao(prepared, x, float_model=_mobilenet(dropout=True))
    rows = _rows(model)
    dropout = [t for t, n in _observer_nodes(prepared).items() if n.args[0].name == "classifier_dropout"]
    assert len(dropout) == 1 and rows[dropout[0]]["status"] == "exact"
    assert rows[dropout[0]]["point"] == "classifier.dropout" and "grid of its own" in rows[dropout[0]]["note"]
    assert not [t for t, r in rows.items() if r["status"] == "unmapped"]
    point = quant_points(model)["classifier.dropout"]
    assert float(point.scale) == float(getattr(prepared, dropout[0]).scale)
    probe = torch.randn_like(x)
    with torch.no_grad():
        assert torch.equal(prepared(x), model(x)) and torch.equal(prepared(probe), model(probe))
    saved = qdebug.save(model, tmp_path / "qat.pt", stage="qat", model_spec="qdebug.zoo.mobilenetv2:MobileNetV2",
                        model_kwargs=MOBILENET, sample_inputs=x)
    loaded, _ = qdebug.load(saved)
    with torch.no_grad():
        assert torch.equal(prepared(probe), loaded(probe))
    # Without the view's point the outputs differ: the test can fail.
    bypassed = copy.deepcopy(prepared)
    setattr(bypassed, dropout[0], nn.Identity())
    with torch.no_grad():
        assert not torch.equal(bypassed(x), model(x))


def test_shufflenetv2_chunk_and_cat():
    prepared, x = _qat("shufflenetv2")
    model = from_torch_ao(prepared, x, float_model=MODELS["shufflenetv2"][0]())
    rows = _rows(model)
    observers = _observer_nodes(prepared)
    _assert_reports_every_quantizer(prepared, rows)
    # stage2.1 splits its input with chunk: the half that goes straight into the cat is
    # quantized on the cat's grid (the cat's point computes that), the half that feeds
    # branch2's conv is re-quantized on a grid of its own, which no engine point holds.
    halves = {t: n for t, n in observers.items()
              if n.args[0].op == "call_function" and "getitem" in n.args[0].name}
    into_cat = [t for t, n in halves.items() if any(u.name.startswith("cat") for u in n.users)]
    into_conv = [t for t in halves if t not in into_cat]
    assert len(into_cat) == 1 and len(into_conv) == 1
    assert rows[into_cat[0]]["point"] == "stage2.1.cat" and rows[into_cat[0]]["status"] == "exact"
    assert rows[into_conv[0]]["status"] == "unmapped"
    assert [t for t, r in rows.items() if r["status"] == "unmapped"] == into_conv
    bypassed = copy.deepcopy(prepared)
    setattr(bypassed, into_conv[0], nn.Identity())
    with torch.no_grad():
        assert torch.equal(bypassed(x), model(x))


@pytest.mark.parametrize("name,kind", [("resnet", "per_channel"), ("resnet", "per_tensor"),
                                       ("mobilenetv2", "per_channel"), ("mobilenetv2", "per_tensor")])
def test_ptq_matches_torchs_converted_model(name, kind):
    make, shape = MODELS[name]
    torch.manual_seed(1)
    float_model = make()
    float_model.train()
    with torch.no_grad():  # BN statistics and affine parameters that fold into something real
        for module in float_model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.2, 0.2)
        for _ in range(3):
            float_model(torch.randn((8,) + shape[1:]) * 2 + 0.5)
    x = torch.randn(shape)
    prepared = quantize_fx.prepare_fx(copy.deepcopy(float_model).eval(), _ptq_mapping(kind), (x,))
    with torch.no_grad():
        for _ in range(2):
            prepared(torch.randn((8,) + shape[1:]))
    model = from_torch_ao(prepared, x, float_model=make())
    converted = quantize_fx.convert_fx(copy.deepcopy(prepared))
    reference = quantize_fx.convert_to_reference_fx(copy.deepcopy(prepared))
    with torch.no_grad():
        want, have, simulated = converted(x), model(x), reference(x)
    output = [n for n in prepared.graph.nodes if n.op == "output"][0].args[0]
    lsb = float(prepared.get_submodule(str(output.target)).calculate_qparams()[0])
    assert want.unique().numel() > 4
    # torch's int8 kernels (x86, reduce-range activations): within one step of the output grid.
    # Torch's reference model (quantize/dequantize around float ops: no CPU kernel in it) too;
    # both clamp to quint8's [0, 255], not the observers' [0, 127], as the import does.  Not
    # bit for bit: an average of codes lands within float rounding of a .5 tie, where torch's
    # quantize_per_tensor (zero point added before rounding) and its fake quant (the engine's)
    # can round apart.
    for oracle in (want, simulated):
        assert (oracle - have).abs().max() <= lsb * 1.001, f"{(oracle - have).abs().max() / lsb:.2f} LSB"

    rows = _rows(model)
    _assert_reports_every_quantizer(prepared, rows)
    assert not [r for r in rows.values() if r["status"] == "unmapped"]
    bns = [p for p, m in float_model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert sorted(r["source"] for r in rows.values() if r["kind"] == "bn") == sorted(bns)
    convs = [p for p, m in float_model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert all(rows[f"{p}.qconfig.weight()"]["point"] == f"{p}.weight" for p in convs)


def test_float_model_is_required():
    prepared, x = _qat("resnet", steps=0)
    with pytest.raises(QDebugError, match="float_model"):
        from_torch_ao(prepared, x)


@pytest.mark.parametrize("other", [
    lambda: MultiTaskNet(width=8, in_channels=3),  # another class
    lambda: ResNet(layers=[1, 1], widths=[8, 32], num_classes=10),  # the class, other widths
    lambda: ResNet(layers=[1, 2], widths=[8, 16], num_classes=10),  # the class, another depth
], ids=["another-class", "other-widths", "other-depth"])
def test_another_architecture_is_refused_cleanly(other):
    prepared, x = _qat("resnet", steps=0)
    with pytest.raises(QDebugError) as info:
        from_torch_ao(prepared, x, float_model=other())
    assert "\n" not in str(info.value) and info.value.__cause__ is None
    assert "prepared" in info.value.message


def test_a_conv_subclass_fx_traces_into_is_its_layer():
    """FX traces into a conv subclass with its own forward (TF SAME padding): its F.conv2d and
    the observer on its weight's get_attr are the layer's conv and weight quantizer."""
    import torch.nn.functional as F
    from torch.ao.quantization import get_default_qat_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    class SamePadConv(nn.Conv2d):
        def forward(self, x):
            return F.conv2d(F.pad(x, (0, 1, 0, 1)), self.weight, self.bias, self.stride, 0, self.dilation,
                            self.groups)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = SamePadConv(3, 8, 3, stride=2)
            self.act = nn.ReLU6()
            self.head = nn.Conv2d(8, 4, 1)

        def forward(self, x):
            return self.head(self.act(self.stem(x)))

    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    prepared = prepare_qat_fx(Net().train(), get_default_qat_qconfig_mapping("x86"), (x,))
    prepared(x)
    prepared.apply(torch.ao.quantization.disable_observer)
    prepared.eval()
    model = from_torch_ao(prepared, x, float_model=Net())
    rows = _rows(model)
    assert any(r["point"] == "stem.weight" and r["status"] == "exact" for r in rows.values())
    with torch.no_grad():
        assert torch.equal(prepared(x), model(x))


class _ConvBnAtTheOutput(nn.Module):
    """torch's zoo FX ``ConvBnModel``: the Conv-BN prepare_fx folds is the model's output (issue 29 item 2)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


def test_a_folded_conv_bn_at_the_output_imports_and_computes_torchs_convert():
    import warnings

    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.manual_seed(0)
    model = _ConvBnAtTheOutput().eval()
    x = torch.randn(4, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (x,))  # reduce_range
        prepared(x)
        imported = from_torch_ao(prepared, x, float_model=_ConvBnAtTheOutput())
        converted = convert_fx(copy.deepcopy(prepared))
    with torch.no_grad():
        expected, got, float_out = converted(x), imported(x), model(x)
    step = float((expected.unique().diff()).min())  # the output grid's step
    assert torch.allclose(got, expected, atol=step * 1.01)
    assert float((got - expected).abs().max()) < float((float_out - expected).abs().max())
