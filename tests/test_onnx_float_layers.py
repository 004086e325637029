"""Layers ONNX Runtime runs in float in a model its ``quantize_static`` quantized (docs/onnx.md,
*Importing*): on x86 its int8 -> uint8 conversion applies only to a QuantizeLinear with one
reader, so a conv or add mixing int8 and uint8 codes stays DequantizeLinear -> Conv/Add (float32)
-> QuantizeLinear.  The import asks ORT's optimized graph which layers those are and marks their
engine calls (``float_kernels``): the quantized stage computes them as ORT does.  ORT's own run of
the file is the oracle; ORT's optimized graph says which layers are float."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from onnx_helpers import onnx, ort_quantize, run_ort, torch_export  # skips without onnx/onnxruntime
from small_models import RESNET, SMALL_RESNET, randomize_bn

import qdebug
from qdebug.engine import engine_state
from qdebug.engine.arithmetic import run_in_float
from qdebug.errors import QDebugError
from qdebug.interop import import_check, import_report
from qdebug.io.modelspec import ModelSpec, build
from qdebug.onnx.model_file import read_onnx
from qdebug.onnx.parity import session_and_kernels
from qdebug.onnx.qdq_import import import_qdq


class Residual(nn.Module):
    """conv(x) + x: the input has two readers, so ORT keeps it int8 and runs both layers in float."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) + x


# Scales putting half the values on exact rounding ties (y / s = k + 1/2 in real numbers): there the
# roundings of a float kernel and of an integer one part.  One input channel and a 1x1 kernel: a
# single product per output, so no summation order is involved.
SX, SW = np.float32(0.1), np.float32(0.3)
TIES = {"input_scale": SX, "input_zero_point": 0, "conv.weight_scale": SW, "conv.weight_quantized": 1,
        "conv.bias_quantized": 0, "conv.bias_quantized_scale": SX * SW, "/conv/Conv_output_0_scale": 2 * SX * SW,
        "/conv/Conv_output_0_zero_point": 0, "output_scale": np.float32(0.08), "output_zero_point": 0}


@pytest.fixture(scope="module")
def ties(tmp_path_factory):
    """ORT's quantization of ``Residual`` (per channel, QInt8), its scales set to ``TIES``."""
    from onnx import numpy_helper

    d = tmp_path_factory.mktemp("float_layers")
    x = torch.randn(8, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    torch_export(Residual().eval(), x[:2], d / "residual.onnx")
    ort_quantize(d / "residual.onnx", d / "residual-int8.onnx", [x[:4], x[4:]])
    model = onnx.load(str(d / "residual-int8.onnx"))
    assert TIES.keys() <= {t.name for t in model.graph.initializer}
    for t in model.graph.initializer:
        if t.name in TIES:
            old = numpy_helper.to_array(t)
            t.CopyFrom(numpy_helper.from_array(np.full(old.shape, TIES[t.name]).astype(old.dtype), t.name))
    onnx.save(model, str(d / "ties.onnx"))
    return d / "ties.onnx"


def test_layers_ort_runs_in_float_compute_as_ort_does(ties):
    proto = read_onnx(ties)
    kernels, in_float = session_and_kernels(proto)[2:]  # ORT's optimized graph: what it runs
    assert kernels == {"Conv": {"int8": 0, "float": 1}, "Add": {"int8": 0, "float": 1}}, kernels
    x = torch.randn(16, 1, 16, 16, generator=torch.Generator().manual_seed(1)) * 2
    qm = import_qdq(proto, Residual(), x[:4])
    assert engine_state(qm).float_kernels == {"conv", "add"}
    assert import_check(qm)["ort_float_layers"] == ["add", "conv"]
    report = import_report(qm).set_index("source")
    assert set(report["status"]) == {"exact"}
    assert "ONNX Runtime runs /conv/Conv in float" in report.loc["/conv/Conv_output_0", "note"]
    assert "ONNX Runtime runs /Add in float" in report.loc["output", "note"]
    theirs = run_ort(ties, x)
    with torch.no_grad():
        assert torch.equal(qm(x), theirs)  # bit for bit, ties included
    # Without the marks the integer kernels part from ORT at the ties (within 1 LSB still).
    run_in_float(qm, [])
    with torch.no_grad():
        ours = qm(x)
    assert float((ours == theirs).double().mean()) < 0.95
    assert float(((ours - theirs).abs() <= 1.001 * 0.08).double().mean()) == 1.0


def test_an_int8_resnet_import_marks_the_float_layers_and_they_survive_save_and_load(tmp_path):
    torch.manual_seed(0)
    net = randomize_bn(build(ModelSpec(RESNET, SMALL_RESNET), from_user=False), 0).eval()
    x = torch.randn(24, 1, 16, 16, generator=torch.Generator().manual_seed(3))
    torch_export(net, x[:2], tmp_path / "resnet.onnx")
    path = ort_quantize(tmp_path / "resnet.onnx", tmp_path / "resnet-int8.onnx", [x[:8], x[8:16]])
    proto = read_onnx(path)
    kernels = session_and_kernels(proto)[2]
    assert kernels["Conv"]["float"] and kernels["Add"]["float"], kernels  # ORT leaves convs and adds float
    qm = import_qdq(proto, build(ModelSpec(RESNET, SMALL_RESNET), from_user=False), x[16:])
    marked = engine_state(qm).float_kernels
    assert len(marked) == kernels["Conv"]["float"] + kernels["Add"]["float"] and "layer1.0.add" in marked
    report = import_report(qm)
    assert set(report.loc[report["kind"] != "bn", "status"]) == {"exact"}
    assert report["note"].str.contains("ONNX Runtime runs /layer1/layer1.0/Add in float").any()
    theirs = run_ort(path, x)
    with torch.no_grad():
        ours = qm(x)
    scale = float(engine_state(qm).points["fc"].scale)
    assert float(((ours - theirs).abs() <= 1.001 * scale).double().mean()) >= 0.99

    qdebug.save(qm, tmp_path / "ort.pt", stage="quantized", model_spec=ModelSpec(RESNET, SMALL_RESNET))
    loaded, info = qdebug.load(tmp_path / "ort.pt", model=ModelSpec(RESNET, SMALL_RESNET))
    assert engine_state(loaded).float_kernels == marked and engine_state(loaded).arithmetic == "float32"
    with torch.no_grad():
        assert torch.equal(loaded(x), ours)

    saved = torch.load(tmp_path / "ort.pt", weights_only=True)
    for damaged, fragment in ((["layer9.add"], "does not have: layer9.add"), ("conv1", "not a list of call names")):
        torch.save({**saved, "float_kernels": damaged}, tmp_path / "damaged.pt")
        with pytest.raises(QDebugError, match=fragment):
            qdebug.load(tmp_path / "damaged.pt", model=ModelSpec(RESNET, SMALL_RESNET))


def test_the_import_command_says_which_layers_ort_runs_in_float(cli, ties, tmp_path):
    x = torch.randn(4, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    torch.save(x, tmp_path / "x.pt")
    result = cli("import", ties, "--from", "onnx-qdq", "--model", f"{__name__}:Residual", "--data", tmp_path / "x.pt",
                 "-o", tmp_path / "ort.pt")
    assert result.code == 0, result.err
    text = " ".join((result.out + result.err).split())
    assert "ONNX Runtime runs 2 layer(s) in float, simulated so: add, conv" in text, text
