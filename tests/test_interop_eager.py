"""Importing torch.ao eager-mode models (prepare_qat / prepare): exact against torch itself.

The oracle is torch's own prepared model, in eval with its observers disabled (an enabled
observer moves its scale on every forward, eval or not): the engine model must give the same
bits on the same input, after QAT steps made the BN statistics, scales and weights real.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import qdebug
from qdebug.engine import quant_points
from qdebug.engine.plan import trace_plan
from qdebug.errors import QDebugError
from qdebug.interop import from_torch_ao, import_report
from qdebug.zoo import ResNet
from small_models import interop_zoo

tq = pytest.importorskip("torch.ao.quantization")


class EagerNet(nn.Module):
    """An eager-ready model: QuantStub, FloatFunctional adds, a module called twice, a sigmoid."""

    def __init__(self):
        super().__init__()
        self.quant = tq.QuantStub()
        self.dequant = tq.DeQuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.dw_bn = nn.BatchNorm2d(8)
        self.act6 = nn.ReLU6()
        self.ff = torch.ao.nn.quantized.FloatFunctional()
        self.ff2 = torch.ao.nn.quantized.FloatFunctional()
        self.gate = nn.Sigmoid()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = self.quant(x)
        y = self.relu(self.bn(self.conv(x)))
        z = self.relu2(self.conv2(y))
        z = self.ff.add(y, z)
        z = self.act6(self.dw_bn(self.dw(z)))
        z = self.ff2.mul(z, self.gate(z))
        z = self.pool(z).flatten(1)
        return self.dequant(self.fc(z))


def _fusions(model: nn.Module, x) -> list[list[str]]:
    """Conv-BN(-ReLU) and Conv-ReLU groups eager fusion accepts (a ReLU module called once)."""
    plan = trace_plan(model, x)
    groups = []
    for conv, bn in plan.pairs:
        after = plan.calls[bn].fused_into
        rec = plan.calls.get(after) if after else None
        relu = rec is not None and rec.is_module and rec.op == "ReLU" and plan.call_counts.get(after) == 1
        groups.append([conv, bn, after] if relu else [conv, bn])
    paired = {conv for conv, _ in plan.pairs}
    for rec in plan.calls.values():
        if rec.category == "conv" and rec.name not in paired and rec.fused_into:
            after = plan.calls[rec.fused_into]
            if after.is_module and after.op == "ReLU" and plan.call_counts.get(after.name) == 1:
                groups.append([rec.name, after.name])
    return groups


def _per_tensor_qat_qconfig():
    from torch.ao.quantization import FusedMovingAvgObsFakeQuantize, MovingAverageMinMaxObserver, QConfig

    act = FusedMovingAvgObsFakeQuantize.with_args(observer=MovingAverageMinMaxObserver, quant_min=0,
                                                  quant_max=127, dtype=torch.quint8)
    weight = FusedMovingAvgObsFakeQuantize.with_args(observer=MovingAverageMinMaxObserver, quant_min=-128,
                                                     quant_max=127, dtype=torch.qint8,
                                                     qscheme=torch.per_tensor_symmetric)
    return QConfig(activation=act, weight=weight)


def _outputs(model, x):
    with torch.no_grad():
        out = model(x)
    return list(out.values()) if isinstance(out, dict) else [out]


def _qat(model: nn.Module, x: torch.Tensor, per_channel: bool = True, steps: int = 3) -> nn.Module:
    torch.manual_seed(0)
    model.train()
    groups = _fusions(model, x)
    if groups:
        tq.fuse_modules_qat(model, groups, inplace=True)
    model.qconfig = tq.get_default_qat_qconfig("x86") if per_channel else _per_tensor_qat_qconfig()
    prepared = tq.prepare_qat(model)
    opt = torch.optim.SGD(prepared.parameters(), lr=0.05)
    for _ in range(steps):
        loss = sum(o.float().pow(2).mean() for o in _outputs_train(prepared, torch.randn_like(x)))
        loss.backward()
        opt.step()
        opt.zero_grad()
    prepared.apply(tq.disable_observer)
    return prepared.eval()


def _outputs_train(model, x):
    out = model(x)
    return list(out.values()) if isinstance(out, dict) else [out]


ZOO = interop_zoo()


@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_qat_is_bit_identical(name, per_channel):
    torch.manual_seed(1)
    x = torch.randn(2, 3, 16, 16)
    prepared = _qat(ZOO[name](), x, per_channel)
    qm = from_torch_ao(prepared, x)
    probe = torch.randn(4, 3, 16, 16) * 2
    for theirs, ours in zip(_outputs(prepared, probe), _outputs(qm, probe)):
        assert torch.equal(theirs, ours), (theirs - ours).abs().max()
    report = import_report(qm)
    quantizers = [n for n, m in prepared.named_modules()
                  if n.rpartition(".")[2] in ("activation_post_process", "weight_fake_quant")
                  and isinstance(m, tq.FakeQuantizeBase)]
    assert set(quantizers) <= set(report["source"]), set(quantizers) - set(report["source"])
    assert set(report.loc[report["source"] != "", "status"]) <= {"exact", "moved"}
    weights = [p for p in quant_points(qm).values() if p.kind == "weight" and p.mode == "fake"]
    assert weights and all(p.spec.per_channel == per_channel and p.frozen for p in weights)


def test_eager_ready_model_maps_stub_floatfunctional_and_fixed_qparams():
    torch.manual_seed(2)
    x = torch.randn(2, 3, 12, 12)
    model = EagerNet()
    prepared = _qat(model, x)
    assert type(prepared.conv).__name__ == "ConvBnReLU2d"
    qm = from_torch_ao(prepared, x)
    probe = torch.randn(3, 3, 12, 12)
    assert torch.equal(prepared(probe), qm(probe))
    report = import_report(qm).set_index("source")
    assert report.loc["quant.activation_post_process", "point"] == "input"
    assert report.loc["ff.activation_post_process", "point"] == "add"
    assert report.loc["ff2.activation_post_process", "point"] == "mul"
    # Conv-BN-ReLU fused by torch: the output point is the ReLU's, the BN a reverse-fold pair.
    assert report.loc["conv.activation_post_process", "point"] == "relu"
    state = qdebug.engine.engine_state(qm)
    assert ("conv", "bn") in [tuple(p) for p in state.plan.pairs] and qm.conv.bn_mode == "reverse_fold"
    # The sigmoid's fixed qparams (1/256, 0) have no engine observer: imported frozen and said so.
    gate = report.loc["gate.activation_post_process"]
    assert gate["status"] == "frozen" and "FixedQParams" in gate["note"]
    assert gate["scale_max"] == pytest.approx(1 / 256)
    # The pool is not quantized by eager torch: float in the engine too, and listed.
    floats = import_report(qm).query("status == 'float'")["point"].tolist()
    assert "pool" in floats


class AddReluBlock(nn.Module):
    """torchvision's QuantizableBasicBlock pattern: a ReLU module (fused into conv1) beside a
    FloatFunctional whose ``add_relu`` runs an inline ReLU in the same scope."""

    def __init__(self):
        super().__init__()
        self.quant = tq.QuantStub()
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.add_relu = torch.ao.nn.quantized.FloatFunctional()
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        x = self.quant(x)
        out = self.conv2(self.relu(self.bn1(self.conv1(x))))
        return self.dequant(self.add_relu.add_relu(out, x))


def test_an_inline_op_never_takes_the_name_of_a_module():
    x = torch.randn(2, 4, 8, 8)
    names = list(trace_plan(AddReluBlock(), x).calls)
    assert "relu" in names and "relu()" in names and "relu#2" not in names


def test_add_relu_beside_a_relu_module_imports_exactly():
    torch.manual_seed(4)
    x = torch.randn(2, 4, 8, 8)
    prepared = _qat(AddReluBlock(), x)
    assert type(prepared.conv1).__name__ == "ConvBnReLU2d"
    qm = from_torch_ao(prepared, x)
    probe = torch.randn(3, 4, 8, 8)
    assert torch.equal(prepared(probe), qm(probe))
    report = import_report(qm).set_index("source")
    assert report.loc["add_relu.activation_post_process", "point"] == "relu()"
    assert report.loc["conv1.activation_post_process", "point"] == "relu"
    assert "unmapped" not in set(report["status"])


def test_shared_module_called_twice_gets_its_quantizer_at_each_call():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)
            self.act = nn.Hardswish()

        def forward(self, x):
            return self.act(self.conv(self.act(x)))

    x = torch.randn(2, 3, 8, 8)
    prepared = _qat(Twice(), x)
    qm = from_torch_ao(prepared, x)
    assert torch.equal(prepared(x), qm(x))
    points = import_report(qm).query("source == 'act.activation_post_process'")["point"].tolist()
    assert points == ["act", "act#2"]


def test_disabled_fake_quant_is_a_float_point():
    torch.manual_seed(3)
    x = torch.randn(2, 3, 12, 12)
    prepared = _qat(EagerNet(), x)
    prepared.conv2.activation_post_process.disable_fake_quant()
    qm = from_torch_ao(prepared, x)
    assert quant_points(qm)["relu2"].mode == "float"
    assert torch.equal(prepared(x), qm(x))


def test_fuse_bn_mode_equals_within_float_rounding():
    torch.manual_seed(4)
    x = torch.randn(2, 3, 12, 12)
    prepared = _qat(EagerNet(), x)
    qm = from_torch_ao(prepared, x, qat_mode="fuse_bn")
    assert qm.conv.bn_mode == "fused"
    theirs, ours = prepared(x), qm(x)
    # Folding reorders float products: a value on a rounding tie may land one step away.
    step = float(prepared.fc.activation_post_process.scale)
    assert (theirs - ours).abs().max() <= step + 1e-6


def test_ptq_prepared_model_imports_observers_and_weights_like_convert():
    torch.manual_seed(5)
    x = torch.randn(4, 3, 12, 12)
    model = EagerNet().eval()
    tq.fuse_modules(model, [["conv", "bn", "relu"], ["conv2", "relu2"], ["dw", "dw_bn"]], inplace=True)
    model.qconfig = tq.get_default_qconfig("x86")
    prepared = tq.prepare(model)
    with torch.no_grad():
        for _ in range(4):
            prepared(torch.randn(4, 3, 12, 12))
    qm = from_torch_ao(prepared, x)
    report = import_report(qm)
    assert "conv.qconfig.weight()" in set(report["source"])
    folded = report.query("kind == 'bn'")
    assert sorted(folded["source"]) == ["bn", "dw_bn"]
    converted = tq.convert(prepared)
    probe = torch.randn(8, 3, 12, 12)
    with torch.no_grad():
        theirs, ours = converted(probe), qm(probe)
    # torch's integer kernels against the engine's fake quant (the calibrated stage): rounding
    # differs layer by layer (integer requantization, a sigmoid lookup), one output step at most.
    step = float(converted.fc.scale)
    assert (theirs - ours).abs().max() <= step * 1.001


def test_imported_model_saves_and_reloads_as_a_qdebug_checkpoint(tmp_path):
    torch.manual_seed(6)
    x = torch.randn(2, 3, 16, 16)
    kwargs = {"layers": [1, 1], "widths": [8, 16], "num_classes": 10, "stem": "small"}
    prepared = _qat(ResNet(**kwargs), x)
    qm = from_torch_ao(prepared, x)
    path = qdebug.save(qm, tmp_path / "qat.pt", stage="qat", model_spec="qdebug.zoo.resnet:ResNet",
                       model_kwargs=kwargs, sample_inputs=x)
    loaded, info = qdebug.load(path)
    assert info.stage == "qat"
    probe = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(loaded(probe), prepared(probe))


def test_refusals():
    with pytest.raises(QDebugError, match="holds no torch.ao quantizer"):
        from_torch_ao(nn.Conv2d(3, 3, 1), torch.randn(1, 3, 4, 4))
    with pytest.raises(QDebugError, match="needs an nn.Module"):
        from_torch_ao("model.pt", torch.randn(1, 3, 4, 4))


def test_narrow_range_weights_import_exactly():
    """torch's quant_min=-127 weights (TFLite/XNNPACK style) map to the engine's narrow_range."""
    from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver, QConfig

    weight = FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, quant_min=-127, quant_max=127,
                                    dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    torch.manual_seed(7)
    x = torch.randn(2, 3, 12, 12)
    model = EagerNet().train()
    tq.fuse_modules_qat(model, [["conv", "bn", "relu"]], inplace=True)
    model.qconfig = QConfig(activation=tq.get_default_qat_qconfig("x86").activation, weight=weight)
    prepared = tq.prepare_qat(model)
    prepared(x)
    prepared.apply(tq.disable_observer)
    prepared.eval()
    qm = from_torch_ao(prepared, x)
    spec = quant_points(qm)["conv.weight"].spec
    assert (spec.qmin, spec.qmax, spec.narrow_range) == (-127, 127, True)
    assert torch.equal(prepared(x * 3), qm(x * 3))


def test_compare_and_step_run_on_an_imported_model_with_the_float_names():
    import copy

    torch.manual_seed(8)
    x = torch.randn(2, 3, 16, 16)
    float_model = ZOO["resnet"]()
    names = {n for n, m in float_model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    qm = qdebug.from_torch_ao(_qat(copy.deepcopy(float_model), x), x)
    reference = copy.deepcopy(qm)
    qdebug.engine.set_mode(reference, "float")
    batches = [torch.randn(2, 3, 16, 16) for _ in range(2)]
    frame = qdebug.compare(("float", reference), ("qat", qm), data=batches)
    assert names <= set(frame["layer"])
    assert (frame.set_index("layer").loc[sorted(names), "sqnr_db"] > 10).all()
    steps = qdebug.step(qm, data=batches, module="layer1")
    assert steps["selection"].tolist()[1] == "layer1"


def test_a_quantizer_that_never_saw_data_is_said_so():
    model = EagerNet().train()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    prepared = tq.prepare_qat(model).eval()
    x = torch.randn(1, 3, 8, 8)
    report = import_report(from_torch_ao(prepared, x)).set_index("source")
    assert "never observed" in report.loc["conv.activation_post_process", "note"]


class _EndsInFoldedConvBn(nn.Module):
    """torch's zoo ``ModelForFusionWithBias`` pattern: a Conv-BN that fuse_modules folds feeds the
    model's output through a DeQuantStub (issue 29 item 2: KeyError '<output>' on import)."""

    def __init__(self):
        super().__init__()
        import torch.ao.quantization as tq

        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, bias=True)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.dequant(self.bn(self.conv(self.quant(x))))


def test_a_model_ending_in_a_folded_conv_bn_imports_and_computes_torchs_convert():
    import warnings

    import torch.ao.quantization as tq

    torch.manual_seed(0)
    model = _EndsInFoldedConvBn().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    model.qconfig = tq.get_default_qconfig("x86")  # reduce_range: torch's x86 kernel exact on any CPU
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = tq.prepare(tq.fuse_modules(model, [["conv", "bn"]]))
        x = torch.randn(4, 3, 8, 8)
        prepared(x)
        converted = tq.convert(prepared)
        imported = from_torch_ao(prepared, x)
    with torch.no_grad():
        expected, got, float_out = converted(x), imported(x), model(x)
    assert torch.allclose(got, expected, atol=float(converted.conv.scale) * 1.01)  # within one output step
    assert float((got - expected).abs().max()) < float((float_out - expected).abs().max())  # quantized, not float
