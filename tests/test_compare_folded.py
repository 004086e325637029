"""compare on models whose Conv-BN pairs torch folded before quantizing (issue 29 item 3).

torch.ao folds a BatchNorm into its conv before quantizing (eager ``fuse_modules``,
``prepare_fx``/``convert_fx``, ``prepare_pt2e``/``convert_pt2e``): the import holds the folded
conv and an ``nn.Identity`` at the BN's path.  The float reference runs conv, then BN.  The
pair's row is the BN's, as for a pair the engine folds itself: the folded conv's output against
the float BN's output (propagated), and the folded conv run on the float conv's input
(isolated); the conv's row says where it is compared.  Where a ReLU runs in the folded conv's
integer kernel, conv and BN rows point at the ReLU's row, which carries the numbers.

The oracles are torch's own converted modules (forward hooks on the eager and FX converted
models, their quantized kernels run on the float conv input for the isolated error) and the
count of rows left without a number.  torchvision's MobileNetV2 (its 17 projection convs are
Conv-BN without a ReLU) comes from ``.vendor`` (tests/vision_libraries.py), else skips.
"""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
import torch.nn as nn

import qdebug
from qdebug.interop import from_torch_ao, import_report
from small_models import module_io, randomize_bn, torch_ao_ptq

tq = pytest.importorskip("torch.ao.quantization")
nnq = pytest.importorskip("torch.ao.nn.quantized")
quantize_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")
pytestmark = [
    pytest.mark.usefixtures("x86_engine_one_thread"),  # tests/conftest.py
    pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor, torch.quantize_per_channel:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning"),
    pytest.mark.filterwarnings("ignore:must run observer before calling calculate_qparams"),
]
SHAPE = (2, 3, 16, 16)
# (conv, BN) of the small model: Conv-BN-ReLU (stem, conv1), Conv-BN into the residual add (conv2, downsample)
PAIRS = [("conv", "bn"), ("block.conv1", "block.bn1"), ("block.conv2", "block.bn2"),
         ("block.downsample.0", "block.downsample.1")]
WITHOUT_RELU = PAIRS[2:]


class Block(nn.Module):
    """conv1-bn1-relu1, conv2-bn2 (no ReLU) into a residual add with a strided Conv-BN downsample."""

    def __init__(self, eager: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(8, 16, 3, 2, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 16, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.downsample = nn.Sequential(nn.Conv2d(8, 16, 1, 2, bias=False), nn.BatchNorm2d(16))
        self.skip = nnq.FloatFunctional() if eager else None

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        identity = self.downsample(x)
        return self.skip.add(out, identity) if self.skip is not None else out + identity


class Net(nn.Module):
    """(QuantStub,) a Conv-BN-ReLU stem, the block, pooling, a linear head (, DeQuantStub)."""

    def __init__(self, eager: bool = False):
        super().__init__()
        self.quant, self.dequant = (tq.QuantStub(), tq.DeQuantStub()) if eager else (nn.Identity(), nn.Identity())
        self.conv = nn.Conv2d(3, 8, 3, 1, 1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.block = Block(eager)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.block(self.relu(self.bn(self.conv(self.quant(x)))))
        return self.dequant(self.fc(torch.flatten(self.pool(x), 1)))


def _batches(n: int, seed: int, shape=SHAPE) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(n)]


def _float(eager: bool) -> nn.Module:
    torch.manual_seed(0)
    return randomize_bn(Net(eager), 11).eval()


def _eager() -> tuple[nn.Module, nn.Module, nn.Module]:
    """(float model, torch's calibrated PTQ model, its convert)."""
    model = _float(True)
    float_model = copy.deepcopy(model)
    tq.fuse_modules(model, [["conv", "bn", "relu"], ["block.conv1", "block.bn1", "block.relu1"],
                            ["block.conv2", "block.bn2"], ["block.downsample.0", "block.downsample.1"]], inplace=True)
    model.qconfig = tq.get_default_qconfig("x86")
    prepared = tq.prepare(model)
    with torch.no_grad():
        for x in _batches(2, 5):
            prepared(x)
    return float_model, prepared, tq.convert(copy.deepcopy(prepared))


def _fx() -> tuple[nn.Module, nn.Module, nn.Module]:
    model = _float(False)
    mapping = tq.QConfigMapping().set_global(tq.get_default_qconfig("x86"))
    prepared = quantize_fx.prepare_fx(copy.deepcopy(model), mapping, (_batches(1, 5)[0],))
    with torch.no_grad():
        for x in _batches(2, 5):
            prepared(x)
    return model, prepared, quantize_fx.convert_fx(copy.deepcopy(prepared))


def _pt2e() -> tuple[nn.Module, nn.Module, nn.Module]:
    pytest.importorskip("torchao", reason="PT2E lives in torchao: pip install 'qdebug[torchao]'")
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    model = _float(False)
    graph = torch.export.export(copy.deepcopy(model), (_batches(1, 5)[0],), strict=True).module()
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        for x in _batches(2, 5):
            prepared(x)
    return model, prepared, convert_pt2e(copy.deepcopy(prepared))


FLOWS = {"eager": _eager, "fx": _fx, "pt2e": _pt2e}


@pytest.fixture(scope="module", params=list(FLOWS))
def flow(request):
    """(flow, float model, torch's prepared model, torch's converted model)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return (request.param, *FLOWS[request.param]())


def _rows(frame) -> dict[str, dict]:
    return {row["layer"]: row for row in frame.to_dict("records")}


def _finite(row: dict) -> bool:
    return math.isfinite(row["sqnr_db"]) and math.isfinite(row["isolated_sqnr_db"])


def _compared_at(note: str) -> str | None:
    found = re.search(r"compared at (\S+)$", note or "")
    return found.group(1) if found else None


def _assert_every_pair_measured(frame, pairs: list[tuple[str, str]]) -> None:
    """One row per pair with finite numbers (the BN's, or the ReLU's its conv's integer kernel
    applies); every row without a number names the row that has them."""
    rows = _rows(frame)
    assert len(frame) == frame["layer"].nunique()  # one row per layer: the pair is never counted twice
    for conv, bn in pairs:
        at = _compared_at(rows[conv]["note"])
        assert at in (bn, _compared_at(rows[bn]["note"])), (conv, rows[conv]["note"])
        assert isinstance(rows[at]["diagnosis"], str) and _finite(rows[at]), (conv, at, rows[at])
    for name, row in rows.items():
        if math.isnan(row["sqnr_db"]):
            at = _compared_at(row["note"])
            assert at is not None and math.isfinite(rows[at]["sqnr_db"]), (name, row["note"])


@pytest.mark.parametrize("stage", ["prepared", "converted"])
def test_every_folded_pair_has_one_row_with_numbers(flow, stage):
    name, float_model, prepared, converted = flow
    x = _batches(1, 5)[0]
    qm = from_torch_ao(copy.deepcopy(prepared if stage == "prepared" else converted), x, float_model=float_model)
    assert sorted((r["point"], r["source"]) for r in import_report(qm).to_dict("records") if r["kind"] == "bn") == sorted(PAIRS)
    frame = qdebug.compare(float_model, qm, data=_batches(2, 9))
    _assert_every_pair_measured(frame, PAIRS)
    rows = _rows(frame)
    for conv, bn in WITHOUT_RELU:  # their own requantization: the BN's row, named as the user's model names it
        assert rows[conv]["note"].endswith(f"compared at {bn}") and "torch folded" in rows[conv]["note"]
        assert rows[bn]["type"] == "BatchNorm2d" and rows[bn]["note"] == ""


def _sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 10 * math.log10(float(x.square().sum() / (x - y).square().sum()))


@pytest.mark.parametrize("name", ["eager", "fx"])
def test_a_folded_pairs_numbers_are_torchs_converted_conv_against_the_float_bn(name):
    """Propagated: torch's converted conv output (dequantized) against the float BN's output;
    isolated: torch's quantized conv module run on the float conv input quantized onto the grid
    its own input lies on.  The import's integer kernels are torch's within a code at rounding
    ties, so the row agrees with torch's figures to 0.1 dB (0.05 dB isolated: one kernel)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        float_model, _, converted = FLOWS[name]()
    batch = _batches(1, 9)[0]
    qm = from_torch_ao(copy.deepcopy(converted), _batches(1, 5)[0], float_model=float_model)
    rows = _rows(qdebug.compare(float_model, qm, data=[batch]))
    convs = [conv for conv, _ in WITHOUT_RELU]
    floats = module_io(float_model, convs + [bn for _, bn in WITHOUT_RELU], batch)
    torchs = module_io(converted, convs, batch)
    for conv, bn in WITHOUT_RELU:
        q_in, q_out = torchs[conv]
        assert q_out.is_quantized  # torch's own integer kernel
        alone = converted.get_submodule(conv)(
            torch.quantize_per_tensor(floats[conv][0], q_in.q_scale(), q_in.q_zero_point(), q_in.dtype))
        assert rows[bn]["sqnr_db"] == pytest.approx(_sqnr_db(floats[bn][1], q_out.dequantize()), abs=0.1), bn
        assert rows[bn]["isolated_sqnr_db"] == pytest.approx(_sqnr_db(floats[bn][1], alone.dequantize()), abs=0.05), bn


def test_suggest_reads_a_folded_pairs_diagnosis_as_its_conv_points():
    """The pair's row is the BN's, but its point is the conv's: a range 8 times too small on
    the folded conv's output is diagnosed ``clipping`` at the BN's row, and suggest's
    diagnoses (clipping points are no int16 candidates) name the conv's point."""
    from qdebug.engine import quant_points
    from qdebug.tools.suggest import diagnoses_of

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        float_model, prepared, _ = _eager()
    qm = from_torch_ao(copy.deepcopy(prepared), _batches(1, 5)[0], float_model=float_model)
    point = quant_points(qm)["block.conv2"]
    point.set_qparams(point.scale / 8, point.zero_point)
    rows = _rows(qdebug.compare(float_model, qm, data=_batches(2, 9)))
    assert rows["block.bn2"]["diagnosis"] == "clipping" and rows["block.bn2"]["saturation"] > 0.01
    found = diagnoses_of(float_model, qm, _batches(2, 9))
    assert found["block.conv2"] == "clipping" and "block.bn2" not in found


@pytest.fixture(scope="module")
def torchvision_mobilenet_v2():
    """torchvision's quantizable MobileNetV2 as its PTQ recipe makes it: (float, prepared, converted, x)."""
    from vision_libraries import torchvision

    tv = torchvision()
    torch.manual_seed(0)
    model = randomize_bn(tv.models.quantization.mobilenet_v2(weights=None, quantize=False).eval(), 3)
    float_model = copy.deepcopy(model)
    model.fuse_model()
    batches = _batches(2, 1, (2, 3, 64, 64))
    prepared = torch_ao_ptq(model, batches)  # the x86 qconfig, prepared, the batches observed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = tq.convert(copy.deepcopy(prepared))
    return float_model, prepared, converted, batches[0]


@pytest.mark.parametrize("stage", ["prepared", "converted"])
def test_no_projection_conv_of_torchvisions_mobilenet_v2_is_left_without_numbers(torchvision_mobilenet_v2, stage):
    """Its 17 projection convs (Conv-BN, no ReLU: the layers most often at fault) each get the
    BN's row with numbers; no row is left without a number and without the row that has it."""
    float_model, prepared, converted, x = torchvision_mobilenet_v2
    qm = from_torch_ao(copy.deepcopy(prepared if stage == "prepared" else converted), x, float_model=float_model)
    projections = [(name, f"{name.rpartition('.')[0]}.{int(name.rpartition('.')[2]) + 1}")
                   for name, m in float_model.named_modules()
                   if isinstance(m, nn.Conv2d) and re.fullmatch(r"features\.\d+\.conv\.\d+", name)]
    assert len(projections) == 17
    frame = qdebug.compare(float_model, qm, data=[x])
    _assert_every_pair_measured(frame, projections)
    rows = _rows(frame)
    assert all(rows[bn]["note"] == "" and rows[conv]["note"].endswith(f"compared at {bn}") for conv, bn in projections)


class ConvThenReLU(nn.Module):
    """A conv whose ReLU torch leaves unfused (its own module, after the conv's int8 output),
    which the engine runs in the conv's integer kernel: the ReLU's row is the pair's."""

    def __init__(self):
        super().__init__()
        self.quant = tq.QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        return self.dequant(self.conv2(self.relu(self.conv(self.quant(x)))))


def test_an_unfused_relu_after_a_converted_conv_is_measured_as_torchs_conv_then_relu():
    """Isolated: torch's int8 conv on the float conv's input (on its input grid), then torch's
    quantized ReLU, against the float ReLU.  (It used to replay the ReLU alone on the float conv
    output put on the ReLU's signed grid: -10 dB for an SQNR of 28.)"""
    torch.manual_seed(3)
    float_model = ConvThenReLU().eval()
    model = copy.deepcopy(float_model)
    model.qconfig = tq.get_default_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = tq.prepare(model)
        with torch.no_grad():
            for batch in _batches(2, 1, (4, 3, 8, 8)):
                prepared(batch)
        converted = tq.convert(prepared)
    batch = _batches(1, 9, (4, 3, 8, 8))[0]
    qm = from_torch_ao(copy.deepcopy(converted), batch)
    rows = _rows(qdebug.compare(float_model, qm, data=[batch]))
    floats, torchs = module_io(float_model, ["conv", "relu"], batch), module_io(converted, ["conv", "relu"], batch)
    q_in = torchs["conv"][0]
    alone = converted.relu(converted.conv(
        torch.quantize_per_tensor(floats["conv"][0], q_in.q_scale(), q_in.q_zero_point(), q_in.dtype)))
    assert rows["relu"]["sqnr_db"] == pytest.approx(_sqnr_db(floats["relu"][1], torchs["relu"][1].dequantize()), abs=0.1)
    assert rows["relu"]["isolated_sqnr_db"] == pytest.approx(_sqnr_db(floats["relu"][1], alone.dequantize()), abs=0.05)
    assert rows["relu"]["isolated_sqnr_db"] > rows["relu"]["sqnr_db"] - 1  # its own error, not more than all of it
