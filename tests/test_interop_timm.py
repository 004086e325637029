"""timm's models imported as torch users quantize them: exact against torch itself.

timm writes BatchNorm + activation as one module, ``BatchNormAct2d`` (an ``nn.BatchNorm2d``
subclass whose forward runs ``F.batch_norm``, then ``self.drop``, then ``self.act``).  The
engine sees it as a BN call (``blocks.0.0.bn1``, paired with the conv before it) and its
activation's call (``blocks.0.0.bn1.act``); FX and PT2E trace into it and the import maps their
nodes there.  Random weights, randomized BN statistics, small inputs; the oracles:

- the engine's own prepare: with quantization off it computes the float model (the fold of a
  norm-act layer into its conv keeps its activation);
- FX ``prepare_qat_fx``: torch's prepared graph in eval, observers off, gives the import's bits --
  once its norm-act BNs compute with running statistics: prepare_qat_fx traces
  ``F.batch_norm(training=self.training)`` in train mode, so torch's graph normalizes with each
  batch's statistics even in eval (and after convert_fx); the import flags those rows;
- FX ``prepare_fx``: the import's self-check against torch's reference model, and the
  ``convert_fx`` model itself imports (it used to be refused: "float_model has no module
  ...act"), checked against torch's int8 kernels;
- PT2E ``prepare_qat_pt2e`` (x86, XNNPACK): torch's graph gives the import's bits, or the rows
  that differ say why (torch leaves one reader of a value unquantized); ``prepare_pt2e`` folds
  the norm-act layers' BNs into their convs, and their activations stay.

timm comes from ``.vendor`` (tests/vision_libraries.py); without it these tests skip.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from qdebug.engine import calibrate, convert, engine_state, prepare, quantization_off
from qdebug.engine.modules import FoldedNormAct
from qdebug.interop import from_torch_ao, import_check, import_report
from small_models import randomize_bn
from vision_libraries import timm

tq = pytest.importorskip("torch.ao.quantization")
pytestmark = [pytest.mark.filterwarnings("ignore:must run observer before calling calculate_qparams"),
              pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")]
SHAPE = (2, 3, 64, 64)
BATCH_STATISTICS = "with each batch's own statistics"


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(*SHAPE, generator=torch.Generator().manual_seed(seed))


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "efficientnet_lite0":
            # EfficientNet-Lite0's own builder (its blocks, ReLU6, BatchNormAct2d), narrower and
            # shallower so that the test stays fast; the full model imports the same way.
            build = timm().models.efficientnet._gen_efficientnet_lite
            model = build(name, channel_multiplier=0.25, depth_multiplier=0.5, num_classes=10)
        else:
            model = timm().create_model(name, pretrained=False, num_classes=10)
    return randomize_bn(model, 3).eval()


def _rows(qm) -> list[dict]:
    return import_report(qm).to_dict("records")


def _unmapped(qm) -> list[str]:
    return [r["source"] for r in _rows(qm) if r["status"] == "unmapped"]


def test_the_engine_sees_a_norm_act_layer_as_its_bn_then_its_activation():
    model = _model("mobilenetv3_small_050")
    x = _batch(1)
    qm = prepare(model, mode="with_bn_reverse_fold", example_inputs=x).eval()
    plan = engine_state(qm).plan
    assert ("conv_stem", "bn1") in plan.pairs and ("blocks.0.0.conv_dw", "blocks.0.0.bn1") in plan.pairs
    assert plan.calls["bn1"].category == "bn" and plan.calls["bn1.act"].op == "Hardswish"
    assert plan.calls["blocks.0.0.bn1"].fused_into == "blocks.0.0.bn1.act"  # BN -> ReLU, as a plain BN
    assert not [n for n in plan.calls if n.endswith(".drop")]  # nn.Identity children are no calls
    with torch.no_grad():
        expected = model(x)
        with quantization_off(qm):
            assert torch.allclose(qm(x), expected, atol=1e-5)
    calibrate(qm, [x])
    converted = convert(qm)  # folds each BN into its conv: the activation must stay
    assert isinstance(converted.get_submodule("bn1"), FoldedNormAct)
    with torch.no_grad(), quantization_off(converted):
        assert torch.allclose(converted(x), expected, atol=1e-5)


def test_a_group_norm_act_layer_is_its_norm_then_its_activation_and_fx_qat_imports_exactly():
    from torch.ao.quantization import get_default_qat_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.gn = timm().layers.GroupNormAct(8, num_groups=2, act_layer=torch.nn.ReLU)
            self.head = torch.nn.Conv2d(8, 4, 3)

        def forward(self, x):
            return self.head(self.gn(self.conv(x)))

    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(2, 3, 16, 16)
    calls = engine_state(prepare(model, example_inputs=x)).plan.calls
    assert (calls["gn"].op, calls["gn"].category, calls["gn.act"].category) == ("GroupNormAct", "activation", "relu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_qat_fx(copy.deepcopy(model).train(), get_default_qat_qconfig_mapping("x86"), (x,))
    prepared(x)
    prepared.apply(tq.disable_observer)
    prepared.eval()
    qm = from_torch_ao(prepared, x, float_model=model)
    rows = {r["source"]: r for r in _rows(qm)}
    assert rows["activation_post_process_2"]["point"] == "gn" and rows["activation_post_process_4"]["point"] == "gn.act"
    assert _unmapped(qm) == []
    with torch.no_grad():
        assert torch.equal(qm(x), prepared(x))


def _fx_qat(name: str):
    from torch.ao.quantization import get_default_qat_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    model, x = _model(name), _batch(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_qat_fx(copy.deepcopy(model).train(), get_default_qat_qconfig_mapping("x86"), (x,))
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.01)
    prepared(_batch(10)).square().mean().backward()
    optimizer.step()
    prepared.apply(tq.disable_observer)
    prepared.eval()
    return model, prepared, x


@pytest.mark.parametrize("name", ["resnet10t", "mobilenetv3_small_050", "efficientnet_lite0"])
def test_fx_qat_is_bit_identical(name):
    model, prepared, x = _fx_qat(name)
    baked = [n for n in prepared.graph.nodes if n.op == "call_function" and n.kwargs.get("training") is True]
    qm = from_torch_ao(prepared, x, float_model=model)
    assert _unmapped(qm) == []
    flagged = [r for r in _rows(qm) if BATCH_STATISTICS in r["note"]]
    assert bool(flagged) == bool(baked)  # timm's ResNet has plain BatchNorm2d modules: nothing baked
    assert all(r["status"] == "approximate" for r in flagged)
    # What torch computes once its graph normalizes with the running statistics, as in eval.
    for node in baked:
        node.kwargs = {**node.kwargs, "training": False}
    prepared.recompile()
    with torch.no_grad():
        want, have = prepared(_batch(2)), qm(_batch(2))
    assert want.unique().numel() > 4 and torch.equal(have, want)



@pytest.mark.parametrize("name", ["resnet10t", "mobilenetv3_small_050", "efficientnet_lite0"])
def test_fx_ptq_and_its_converted_model(name):
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    model, x = _model(name), _batch(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (x,))
    with torch.no_grad():
        prepared(_batch(20))
        prepared(x)
    qm = from_torch_ao(prepared, x, float_model=model)  # checked against torch's reference model
    assert _unmapped(qm) == [] and import_check(qm)["within_tolerance"]
    converted = convert_fx(copy.deepcopy(prepared))
    imported = from_torch_ao(converted, x, float_model=model)  # torch's int8 kernels: checked too
    check = import_check(imported)
    assert _unmapped(imported) == [] and check["within_tolerance"], check
    # timm's Linear (MobileNetV3's classifier) has a forward of its own: convert_fx calls
    # torch.ops.quantized.linear on packed weights at the graph root.  The import reads them
    # into the classifier, as for a converted nn.quantized.Linear module.
    packed = [n for n in converted.graph.nodes if n.op == "call_function"
              and str(n.target) == "quantized.linear" and n.args[1].op == "get_attr"]
    assert bool(packed) == (name == "mobilenetv3_small_050")
    for node in packed:
        weight, bias = getattr(converted, node.args[1].target).unpack()
        rows = {r["source"]: r for r in _rows(imported)}
        assert (rows[node.args[1].target]["point"], rows[node.args[1].target]["status"]) == ("classifier.weight", "exact")
        assert rows[node.name]["point"] == "classifier"
        layer = imported.get_submodule("classifier")
        assert torch.equal(layer.weight, weight.dequantize()) and torch.equal(layer.bias, bias)
        assert torch.equal(layer.weight_point.scale.flatten(), weight.q_per_channel_scales().float())


def _pt2e_qat(model: torch.nn.Module, kind: str):
    pytest.importorskip("torchao", reason="PT2E lives in torchao: pip install 'qdebug[torchao]'")
    import torchao.quantization.pt2e as pt2e
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e

    if kind == "x86":
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer,
            get_default_x86_inductor_quantization_config,
        )

        quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config(is_qat=True))
    else:
        from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

        quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True, is_qat=True))
    x = _batch(1)
    graph = torch.export.export(copy.deepcopy(model).train(), (x,), strict=False).module()
    prepared = prepare_qat_pt2e(graph, quantizer)
    with torch.no_grad():
        prepared(_batch(10))
    pt2e.move_exported_model_to_eval(prepared)
    prepared.apply(pt2e.disable_observer)
    return prepared, x


# timm's ResNet (plain BatchNorm2d modules) under PT2E is torchvision's case
# (tests/test_interop_torchvision.py); x86 and XNNPACK were checked by hand: bit-identical.
@pytest.mark.parametrize("name,kind", [("mobilenetv3_small_050", "x86"), ("efficientnet_lite0", "xnnpack")])
def test_pt2e_qat_is_bit_identical_or_says_why(name, kind):
    model = _model(name)
    prepared, x = _pt2e_qat(model, kind)
    qm = from_torch_ao(prepared, x, float_model=model)
    assert _unmapped(qm) == []
    approximate = [r for r in _rows(qm) if r["status"] == "approximate"]
    with torch.no_grad():
        want, have = prepared(x), qm(x)
    assert want.unique().numel() > 4
    if not approximate:
        assert torch.equal(have, want)
    else:  # torch quantizes the BN (or add) output for one reader only: the import says so
        assert any("unquantized on the way to" in r["note"] for r in approximate)
        assert not import_check(qm)["within_tolerance"]


def test_pt2e_ptq_folds_the_bn_of_a_norm_act_layer_and_keeps_its_activation():
    pytest.importorskip("torchao", reason="PT2E lives in torchao: pip install 'qdebug[torchao]'")
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    from qdebug.engine.modules import NormActTail

    model, x = _model("efficientnet_lite0"), _batch(1)
    graph = torch.export.export(copy.deepcopy(model), (x,), strict=False).module()
    prepared = prepare_pt2e(graph, X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config()))
    with torch.no_grad():
        prepared(_batch(20))
        prepared(x)
    qm = from_torch_ao(prepared, x, float_model=model)  # checked against torch's convert_pt2e
    assert _unmapped(qm) == [] and import_check(qm)["within_tolerance"]
    folded = [r["source"] for r in _rows(qm) if r["kind"] == "bn"]
    assert "bn1" in folded and "blocks.0.0.bn1" in folded  # prepare_pt2e folded them into the convs
    assert isinstance(qm.get_submodule("bn1"), NormActTail)
    assert engine_state(qm).plan.calls["bn1.act"].category == "relu6"  # the folded BN's ReLU6 still runs
