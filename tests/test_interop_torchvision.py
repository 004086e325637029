"""torchvision's models imported as torch users quantize them: exact against torch itself.

Code nobody here wrote: torchvision's quantizable models (``models.quantization``) through the
recipe of its ``references/classification/train_quantization.py`` (``fuse_model``, the
backend's default qconfig, ``prepare_qat``/``prepare``, ``convert``), and its float models
through FX.  Random weights, randomized BN statistics, small inputs.  The oracles:

- QAT: torch's prepared model in eval with observers off gives the import's bits exactly;
- PTQ: torch's ``convert`` (its integer kernels) against the import of the calibrated model,
  fake quant, within a few steps of the output grid (rounding differs kernel by kernel and
  adds up with depth: docs/interop.md);
- the import report maps every quantizer torch used: ``add_relu``'s FloatFunctional lands on
  its own inline ReLU (``layer1.0.relu()``), never on the ReLU module ``layer1.0.relu``.

torchvision comes from ``.vendor`` (tests/vision_libraries.py); without it these tests skip.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from qdebug.interop import from_torch_ao, import_report
from small_models import randomize_bn
from vision_libraries import torchvision

tq = pytest.importorskip("torch.ao.quantization")
# MobileNetV2's skip_add in a block without a residual never runs: torch warns at convert
pytestmark = pytest.mark.filterwarnings("ignore:must run observer before calling calculate_qparams")
SHAPE = (2, 3, 32, 32)


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(*SHAPE, generator=torch.Generator().manual_seed(seed))


def _quantizable(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = getattr(torchvision().models.quantization, name)(weights=None, quantize=False)
    return randomize_bn(model, 3)


@pytest.fixture
def backend(request):
    engine = torch.backends.quantized.engine
    torch.backends.quantized.engine = request.param
    yield request.param
    torch.backends.quantized.engine = engine


def _eager(name: str, backend: str, qat: bool) -> torch.nn.Module:
    """torchvision's recipe: fuse, the backend's default qconfig, prepare; then two SGD steps
    and observers off (QAT, in eval) or two calibration batches (PTQ)."""
    model = _quantizable(name).train(qat)
    model.fuse_model(is_qat=qat)
    model.qconfig = (tq.get_default_qat_qconfig if qat else tq.get_default_qconfig)(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = (tq.prepare_qat if qat else tq.prepare)(model)
    if not qat:
        with torch.no_grad():
            for seed in (10, 11):
                prepared(_batch(seed))
        return prepared
    return _trained(prepared)


def _trained(prepared):
    """Two SGD steps on the output's mean square, observers off, eval: a QAT model as trained."""
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.01)
    for seed in (10, 11):
        prepared(_batch(seed)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    prepared.apply(tq.disable_observer)
    return prepared.eval()


def _unmapped(qm: torch.nn.Module) -> list[str]:
    report = import_report(qm)
    return list(report.query("status == 'unmapped'")["source"])


@pytest.mark.parametrize("backend", ["x86", "qnnpack"], indirect=True)
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_eager_qat_is_bit_identical(name, backend):
    prepared = _eager(name, backend, qat=True)
    x = _batch(1)
    with torch.no_grad():
        qm = from_torch_ao(prepared, x)
        for seed in (1, 2):
            assert torch.equal(qm(_batch(seed)), prepared(_batch(seed)))
    # MobileNetV2's skip_add of a block without a residual never runs: torch never fed it data.
    assert all(s.endswith("skip_add.activation_post_process") for s in _unmapped(qm))


@pytest.mark.parametrize("backend", ["x86", "qnnpack"], indirect=True)
def test_eager_qat_resnet50_bottleneck_is_bit_identical(backend):
    prepared = _eager("resnet50", backend, qat=True)
    with torch.no_grad():
        qm = from_torch_ao(prepared, _batch(1))
        assert torch.equal(qm(_batch(2)), prepared(_batch(2)))
    assert _unmapped(qm) == []


@pytest.mark.parametrize("backend", ["x86", "qnnpack"], indirect=True)
def test_add_relu_maps_to_its_own_relu_not_the_relu_module(backend):
    qm = from_torch_ao(_eager("resnet18", backend, qat=True), _batch(1))
    report = import_report(qm).set_index("source")
    for block in ("layer1.0", "layer2.1", "layer4.0"):
        assert report.loc[f"{block}.add_relu.activation_post_process", "point"] == f"{block}.relu()"
        assert report.loc[f"{block}.add_relu.activation_post_process", "status"] == "exact"
        # the block's ReLU module is fused into conv1: its point is conv1's quantizer
        assert report.loc[f"{block}.conv1.activation_post_process", "point"] == f"{block}.relu"


@pytest.mark.parametrize("backend", ["x86", "qnnpack"], indirect=True)
@pytest.mark.parametrize("name", ["resnet18", "resnet50", "mobilenet_v2"])
def test_eager_ptq_matches_torchs_convert(name, backend):
    prepared = _eager(name, backend, qat=False)
    qm = from_torch_ao(prepared, _batch(1))
    assert all(s.endswith("skip_add.activation_post_process") for s in _unmapped(qm))
    converted = tq.convert(copy.deepcopy(prepared))
    probe = _batch(2)
    with torch.no_grad():
        theirs, ours = converted(probe), qm(probe)
    out = converted.classifier[1] if name == "mobilenet_v2" else converted.fc
    steps = (theirs - ours).abs().max() / float(out.scale)
    # torch's kernels requantize in integers, the import's fake quant in float: up to a step per
    # layer, which depth adds up (docs/interop.md, "What is not exact"); measured here (x86,
    # qnnpack): resnet18 0 and 4, resnet50 6 and 5, mobilenet_v2 0 and 1
    assert steps <= 8


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_fx_qat_of_torchvisions_float_models_is_bit_identical(name):
    from torch.ao.quantization import get_default_qat_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    torch.manual_seed(0)
    float_model = randomize_bn(getattr(torchvision().models, name)(weights=None), 3)
    x = _batch(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_qat_fx(copy.deepcopy(float_model).train(), get_default_qat_qconfig_mapping("x86"), (x,))
    prepared = _trained(prepared)
    with torch.no_grad():
        qm = from_torch_ao(prepared, x, float_model=float_model)
        assert torch.equal(qm(_batch(2)), prepared(_batch(2)))
    assert _unmapped(qm) == []


def _pt2e_quantizer(kind: str):
    if kind == "x86":
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer,
            get_default_x86_inductor_quantization_config,
        )

        return X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config(is_qat=True))
    from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

    return XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True, is_qat=True))


@pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")
@pytest.mark.parametrize("kind", ["x86", "xnnpack"])
def test_pt2e_qat_of_torchvisions_resnet_is_bit_identical(kind):
    pytest.importorskip("torchao", reason="PT2E lives in torchao: pip install 'qdebug[torchao]'")
    import torchao.quantization.pt2e as pt2e
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e

    torch.manual_seed(0)
    resnet = torchvision().models.resnet  # ResNet-10: torchvision's BasicBlock, a block per stage
    float_model = randomize_bn(resnet.ResNet(resnet.BasicBlock, [1, 1, 1, 1]), 3)
    x = _batch(1)
    # strict export: BasicBlock calls its ReLU twice, which non-strict export records as one
    # module that torchao's QAT annotators refuse (tests/test_interop_pt2e.py)
    graph = torch.export.export(copy.deepcopy(float_model), (x,), strict=True).module()
    prepared = prepare_qat_pt2e(graph, _pt2e_quantizer(kind))
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.01)
    for seed in (10, 11):
        prepared(_batch(seed)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    pt2e.move_exported_model_to_eval(prepared)
    prepared.apply(pt2e.disable_observer)
    with torch.no_grad():
        qm = from_torch_ao(prepared, x, float_model=float_model)
        assert torch.equal(qm(_batch(2)), prepared(_batch(2)))
    assert _unmapped(qm) == []
