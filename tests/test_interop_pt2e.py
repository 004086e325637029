"""PT2E (torchao) models imported into the engine: tested against torch itself.

- prepare_qat_pt2e (x86 quantizer) after a few training steps, in eval with observers off:
  the engine model is bit-identical to torch's graph (ResNet per-channel, MobileNetV2
  per-tensor, a conv with bias and a BN with its own eps);
- prepare_pt2e calibrated, then convert_pt2e: the engine model (read from the prepared or the
  converted graph) against the converted graph;
- what does not map is in the report, and the difference it makes is measured.

torchao's QAT convert is left out here: its Conv-BN fold exports ~100 pattern graphs (about
50 s for the small ResNet).  Exports and prepares are shared per module (export is slow).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qdebug
from qdebug.errors import QDebugError
from qdebug.interop import detect_flow
from qdebug.interop.build import build, import_report
from qdebug.interop.pt2e import _quiet, import_torchao, read_pt2e, read_pt2e_converted
from qdebug.zoo import MobileNetV2, ResNet
from small_models import randomize_bn

try:
    pt2e = import_torchao()  # quietly: torchao logs the optional kernels it cannot load
except QDebugError:
    pt2e = None
pytest.importorskip("torchao", reason="PT2E lives in torchao: pip install 'qdebug[torchao]'")

from torchao.quantization.pt2e import (  # noqa: E402
    FusedMovingAvgObsFakeQuantize,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
)
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e, prepare_qat_pt2e  # noqa: E402
from torchao.quantization.pt2e.quantizer import QuantizationSpec  # noqa: E402
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (  # noqa: E402
    X86InductorQuantizer,
    get_default_x86_inductor_quantization_config,
)

SHAPE = (4, 3, 16, 16)
# deep copies of exported graphs trip a pytree deprecation warning inside torch
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")


def _config(qat: bool, per_channel: bool):
    """The x86 quantizer's default config (per-channel weights), or the same with per-tensor
    symmetric weights (the quantizer has no switch for it)."""
    config = get_default_x86_inductor_quantization_config(is_qat=qat)
    if per_channel:
        return config
    observer = (FusedMovingAvgObsFakeQuantize.with_args(observer=MovingAverageMinMaxObserver, eps=2**-12) if qat
                else MinMaxObserver.with_args(eps=2**-12))
    weight = QuantizationSpec(dtype=torch.int8, quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric,
                              ch_axis=0, is_dynamic=False, observer_or_fake_quant_ctr=observer)
    return dataclasses.replace(config, weight=weight)


def _resnet() -> nn.Module:
    return ResNet(layers=[1, 1], widths=[8, 16], num_classes=10, stem="small")


def _mobilenet() -> nn.Module:
    return MobileNetV2(num_classes=10, width_mult=0.25, setting=[[1, 16, 1, 1], [6, 24, 2, 2]], stem_stride=1,
                       last_channel=64)


class ConvBiasNet(nn.Module):
    """A conv with a bias before a BN with eps=1e-3, a cat, a mean and inline ops at the root."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=True)
        self.bn = nn.BatchNorm2d(8, eps=1e-3)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        y = self.relu(self.bn(self.conv(x)))
        y = torch.cat([y, self.conv2(y)], 1).mean((2, 3))
        return self.head(y[:, :8] * 2)


class ConvBiasNetNoMul(ConvBiasNet):
    """The same parameters; the forward lacks the ``* 2`` the exported graph quantizes."""

    def forward(self, x):
        y = self.relu(self.bn(self.conv(x)))
        y = torch.cat([y, self.conv2(y)], 1).mean((2, 3))
        return self.head(y[:, :8])


def _batch(seed: int, shape=SHAPE) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _qat(model: nn.Module, per_channel: bool, strict: bool, shape=SHAPE):
    """(float model, prepared QAT graph after 3 SGD steps, in eval with observers off, input)."""
    torch.manual_seed(0)
    x = _batch(1, shape)
    graph = torch.export.export(copy.deepcopy(model), (x,), strict=strict).module()
    prepared = prepare_qat_pt2e(graph, X86InductorQuantizer().set_global(_config(True, per_channel)))
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.02)
    for step in range(3):
        loss = prepared(_batch(10 + step, shape)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    pt2e.move_exported_model_to_eval(prepared)
    prepared.apply(pt2e.disable_observer)  # an enabled observer moves its scale on every forward
    return model, prepared, x


def _ptq(model: nn.Module, per_channel: bool, strict: bool):
    """(float model, calibrated prepared graph, its convert_pt2e graph, input)."""
    model = randomize_bn(model, 5).eval()
    x = _batch(1)
    graph = torch.export.export(copy.deepcopy(model), (x,), strict=strict).module()
    prepared = prepare_pt2e(graph, X86InductorQuantizer().set_global(_config(False, per_channel)))
    with torch.no_grad():
        for seed in range(3):
            prepared(_batch(20 + seed))
    converted = convert_pt2e(copy.deepcopy(prepared))
    return model, prepared, converted, x


# torchao's x86 QAT annotator raises "Input partition has more than one output node" on
# BasicBlock's shared ReLU when non-strict export records both calls as one module; strict
# export records each call apart (MobileNetV2 covers the non-strict metadata).
@pytest.fixture(scope="module")
def qat_resnet():
    return _qat(_resnet(), per_channel=True, strict=True)


@pytest.fixture(scope="module")
def qat_mobilenet():
    return _qat(_mobilenet(), per_channel=False, strict=False)


@pytest.fixture(scope="module")
def qat_conv_bias():
    return _qat(ConvBiasNet(), per_channel=True, strict=False, shape=(4, 3, 8, 8))


@pytest.fixture(scope="module")
def ptq_resnet():
    return _ptq(_resnet(), per_channel=False, strict=True)


@pytest.fixture(scope="module")
def ptq_mobilenet():
    return _ptq(_mobilenet(), per_channel=True, strict=False)


def _outputs(a: nn.Module, b: nn.Module, shape=SHAPE, seeds=(1, 2)):
    with torch.no_grad():
        return [(a(_batch(s, shape)), b(_batch(s, shape))) for s in seeds]


def _rows(model: nn.Module, status: str | None = None) -> list[dict]:
    return [r for r in import_report(model) if status is None or r["status"] == status]


def _module_of(graph: torch.fx.GraphModule, node_name: str) -> str:
    return next(str(n.target) for n in graph.graph.nodes if n.name == node_name)


# -- QAT: bit-identical ---------------------------------------------------------------------

def test_qat_resnet_per_channel_is_bit_identical(qat_resnet):
    model, prepared, x = qat_resnet
    assert detect_flow(prepared) == "pt2e"
    engine = qdebug.from_torch_ao(prepared, x, float_model=model)
    for torch_out, engine_out in _outputs(prepared, engine):
        assert torch.equal(torch_out, engine_out)
    # The weights are the trained ones, not float_model's.
    trained = prepared.state_dict()["layer1.0.conv1.weight"]
    assert not torch.equal(trained, model.layer1[0].conv1.weight)
    assert torch.equal(engine.layer1[0].conv1.weight, trained)


def test_qat_resnet_maps_every_quantizer(qat_resnet):
    model, prepared, x = qat_resnet
    source, plan = read_pt2e(prepared, x, model)
    assert source.stage == "qat" and source.flow == "pt2e"
    assert sorted(source.bn_pairs) == sorted(plan.pairs) and len(source.bn_pairs) == 6
    anchors = {q.anchor for q in source.quantizers if q.kind == "activation"}
    # the shared ReLU's second call, the downsample BN (its add has no ReLU before), the input
    assert anchors == {"input", "relu", "layer1.0.relu", "layer1.0.relu#2", "layer2.0.relu", "layer2.0.relu#2",
                       "layer2.0.downsample.1", "avgpool"}
    weights = {q.anchor for q in source.quantizers if q.kind == "weight"}
    assert weights == {p for p, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    engine = build(source, plan)
    assert not _rows(engine, "unmapped") and not _rows(engine, "frozen")
    # flatten's quantizer is the avgpool's, shared by torch: the same grid on the same values
    flatten_row = [r for r in _rows(engine) if "the same grid" in r["note"]]
    assert [r["point"] for r in flatten_row] == ["avgpool"]
    assert {r["point"] for r in _rows(engine, "float")} == {"layer1.0.bn2", "layer2.0.bn2", "fc"}


def test_qat_mobilenet_per_tensor_is_bit_identical_but_for_the_classifier_requantization(qat_mobilenet):
    model, prepared, x = qat_mobilenet
    engine = qdebug.from_torch_ao(prepared, x, float_model=model)
    weight_rows = [r for r in _rows(engine) if r["kind"] == "weight" and r["status"] == "exact"]
    assert weight_rows and all("per-tensor" in r["spec"] for r in weight_rows)
    # x86 quantizes the classifier's input again after flatten and dropout, on a grid of its
    # own: the engine has no point after a view, so that quantizer is listed as unmapped.
    unmapped = _rows(engine, "unmapped")
    assert len(unmapped) == 1 and "another grid" in unmapped[0]["note"]
    linear = next(n for n in prepared.graph.nodes if n.target == torch.ops.aten.linear.default)
    requant = linear.args[0]
    assert requant.name == unmapped[0]["source"]
    kept = next(r["source"] for r in _rows(engine) if r["point"] == "avgpool" and r["status"] == "exact")
    real = _outputs(prepared, engine)
    # The difference is that requantization alone: the same graph with the avgpool's
    # quantizer in its place (a no-op on values already on that grid) is bit-identical.
    same_grid = copy.deepcopy(prepared)
    setattr(same_grid, str(requant.target), getattr(same_grid, _module_of(prepared, kept)))
    for torch_out, engine_out in _outputs(same_grid, engine):
        assert torch.equal(torch_out, engine_out)
    # ...and it is at most one step of the requantization grid on each input of the linear.
    fake_quant = getattr(prepared, str(linear.args[1].target))
    with torch.no_grad():
        weight = fake_quant(prepared.classifier.fc.weight)
    step = float(getattr(prepared, str(requant.target)).scale)
    bound = weight.abs().sum(1) * step
    for torch_out, engine_out in real:
        diff = (torch_out - engine_out).abs()
        assert diff.max() > 0 and (diff <= bound).all()


def test_qat_conv_bias_bn_eps_and_inline_ops_are_bit_identical(qat_conv_bias):
    model, prepared, x = qat_conv_bias
    source, plan = read_pt2e(prepared, x, model)
    assert source.bn_pairs == [("conv", "bn")]
    by_anchor = {q.anchor: q for q in source.quantizers}
    assert {"input", "relu", "conv2", "cat", "mul"} <= set(by_anchor)
    # torchao's QAT Conv-BN computes with eps=1e-5 whatever the BN says: imported, and said
    assert "eps=1e-05" in by_anchor["conv"].note and source.float_model.bn.eps == 1e-5
    assert model.bn.eps == 1e-3  # the user's model is left alone
    engine = build(source, plan)
    assert not _rows(engine, "unmapped")
    for torch_out, engine_out in _outputs(prepared, engine, shape=(4, 3, 8, 8)):
        assert torch.equal(torch_out, engine_out)


def test_an_anchor_the_float_model_lacks_is_unmapped_with_a_note(qat_conv_bias):
    _, prepared, x = qat_conv_bias
    source, _ = read_pt2e(prepared, x, ConvBiasNetNoMul())
    missing = [q for q in source.quantizers if q.anchor is None]
    assert len(missing) == 1
    assert "'mul'" in missing[0].note and "does not call" in missing[0].note


# -- PTQ and convert_pt2e: against the converted graph ----------------------------------------

def test_ptq_resnet_per_tensor_matches_the_converted_graph(ptq_resnet):
    model, prepared, converted, x = ptq_resnet
    assert detect_flow(converted) == "pt2e-converted"
    from_prepared = qdebug.from_torch_ao(prepared, x, float_model=model)
    source, plan = read_pt2e_converted(converted, x, model)
    from_converted = build(source, plan)
    for engine in (from_prepared, from_converted):
        for torch_out, engine_out in _outputs(converted, engine):
            assert torch.equal(torch_out, engine_out)
    # prepare_pt2e folded every BN into its conv: identities at the BN paths, folded weights
    assert source.stage == "quantized" and len(source.folded_bn) == 6
    assert isinstance(source.float_model.layer1[0].bn1, nn.Identity)
    assert source.float_model.layer1[0].conv1.bias is not None
    assert not _rows(from_converted, "unmapped") and not _rows(from_converted, "frozen")
    # HistogramObserver has no engine twin: its scales are imported and frozen, and said so
    frozen = _rows(from_prepared, "frozen")
    assert frozen and all("HistogramObserver" in r["note"] for r in frozen)


def test_ptq_mobilenet_per_channel_matches_the_converted_graph_but_for_the_requantization(ptq_mobilenet):
    model, prepared, converted, x = ptq_mobilenet
    source, plan = read_pt2e_converted(converted, x, model)
    engine = build(source, plan)
    weight_rows = [r for r in _rows(engine) if r["kind"] == "weight" and r["point"]]
    assert weight_rows and all("per-channel" in r["spec"] for r in weight_rows if r["status"] == "exact")
    unmapped = _rows(engine, "unmapped")
    assert len(unmapped) == 1 and "another grid" in unmapped[0]["note"]
    kept = next(r["source"] for r in _rows(engine) if r["point"] == "avgpool" and r["status"] == "exact")
    # The converted graph with the classifier's quantize/dequantize put on the avgpool's grid
    # (a no-op there) is bit-identical to the engine model.
    same_grid = copy.deepcopy(converted)
    nodes = {n.name: n for n in same_grid.graph.nodes}
    grid = nodes[kept].args[1:3]
    requant = nodes[unmapped[0]["source"]]
    for node in [requant, *requant.users]:
        node.args = (node.args[0], *grid, *node.args[3:])
    same_grid.recompile()
    for torch_out, engine_out in _outputs(same_grid, engine):
        assert torch.equal(torch_out, engine_out)
    # The real graph: within one step of the requantization grid on each input of the linear.
    linear = next(n for n in converted.graph.nodes if n.target == torch.ops.aten.linear.default)
    with torch.no_grad():
        weight = linear.args[1].target(*[getattr(converted, str(a.target)) if isinstance(a, torch.fx.Node) else a
                                         for a in linear.args[1].args])
    bound = weight.abs().sum(1) * float(requant.args[1])
    for torch_out, engine_out in _outputs(converted, engine):
        assert ((torch_out - engine_out).abs() <= bound).all()
    # Read from the calibrated prepared graph: the same scales, the same numbers.
    from_prepared = qdebug.from_torch_ao(prepared, x, float_model=model)
    for engine_out, prepared_out in _outputs(engine, from_prepared):
        assert torch.equal(engine_out, prepared_out)


# -- refusals -------------------------------------------------------------------------------

def test_a_float_model_of_another_architecture_is_refused(qat_resnet):
    _, prepared, x = qat_resnet
    with pytest.raises(QDebugError, match="float_model"):
        read_pt2e(prepared, x, ResNet(layers=[1, 1], widths=[8, 32], num_classes=10, stem="small"))
    with pytest.raises(QDebugError, match="GraphModule"):
        read_pt2e(nn.Linear(2, 2), torch.randn(1, 2), _resnet())


def test_missing_torchao_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.quantization.pt2e", None)
    with pytest.raises(QDebugError) as err:
        import_torchao()
    assert "torchao" in err.value.message and err.value.hint == "pip install 'qdebug[torchao]'"


def test_the_quiet_import_silences_every_channel_torchao_uses(capfd, caplog, recwarn):
    # torchao's import logs the optional kernels it cannot load and torch warns about pytree
    # registrations; C code writes to file descriptor 2 itself.
    with _quiet():
        os.write(2, b"from C\n")
        print("from Python", file=sys.stderr)
        logging.getLogger("torchao").warning("logged")
        warnings.warn("warned")
    out, err = capfd.readouterr()
    assert out == "" and err == "" and not caplog.records and not len(recwarn)
    os.write(2, b"after\n")  # and fd 2 is back
    assert capfd.readouterr().err == "after\n"


class SamePadConv(nn.Conv2d):
    """A TF "SAME" conv: a Conv2d subclass that pads in its own forward (EfficientNet-Lite's)."""

    def forward(self, x):
        return F.conv2d(F.pad(x, (0, 1, 0, 1)), self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class SamePadNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = SamePadConv(3, 8, 3, stride=2)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU6()
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.head(self.act(self.bn(self.stem(x))))


def test_an_op_inside_a_conv_subclass_is_not_the_conv_output():
    """x86 PT2E quantizes the pad a SAME conv runs before its conv: that is the conv's *input*,
    which the engine quantizes upstream -- never the conv's output (it once took the pad's scale
    there and called it exact).  Against convert_pt2e: bit-identical."""
    model, prepared, converted, x = _ptq(SamePadNet(), per_channel=True, strict=True)
    engine = qdebug.from_torch_ao(prepared, x, float_model=model)
    for torch_out, engine_out in _outputs(converted, engine):
        assert torch.equal(torch_out, engine_out)
    stem = [r for r in _rows(engine) if r["point"] == "stem" and r["kind"] == "activation"]
    assert not stem or stem[0]["status"] != "exact" or "pad" not in stem[0]["note"]
