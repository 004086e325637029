"""An ONNX model as a stage of ``compare``, run by ONNX Runtime (qdebug.onnx.stage).

The ONNX models are the real route: torch's export of the float model, quantized by ONNX Runtime's
own ``quantize_static`` (tests/onnx_helpers.py), and qdebug's own export.  The numbers are checked
against ONNX Runtime run independently: the untapped model, and the model cut at a tensor by
``onnx.utils.extract_model``."""

from __future__ import annotations

import json
import math
import platform
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from onnx_helpers import onnx, ort, ort_quantize, run_ort, torch_export
import qdebug
from qdebug.data.spec import load_batches
from qdebug.io.modelspec import ModelSpec, build
from qdebug.onnx.model_file import read_onnx
from qdebug.onnx.stage import OnnxStage
from small_models import RESNET, SMALL_RESNET

DEMO = Path(__file__).resolve().parent.parent / "fixtures" / "demo"
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's float model, the first batch compare reads of eval.pt, and ONNX Runtime's
    per-channel quantization of torch's export: int8 activations (ORT's default) and uint8."""
    d = tmp_path_factory.mktemp("onnx_stage")
    model, _ = qdebug.load(DEMO / "float.pt")
    batch = next(iter(load_batches(str(DEMO / "eval.pt"), batches=1))).inputs
    float_onnx = torch_export(model, batch[:2], d / "float.onnx")
    calibration = [batch[:32], batch[32:]]
    return SimpleNamespace(
        dir=d, model=model, batch=batch, float_onnx=float_onnx,
        int8=ort_quantize(float_onnx, d / "q.onnx", calibration),
        uint8=ort_quantize(float_onnx, d / "u8.onnx", calibration, activation_type="QUInt8"))


def _sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 10 * math.log10(float((x ** 2).sum()) / float(((x - y) ** 2).sum()))


def _onnx_rows(out: dict, target: str = "onnx") -> dict[str, dict]:
    return {row["layer"]: row for row in out["rows"] if row["target"] == target}


def test_ort_quantized_demo_beside_the_checkpoints(cli, demo):
    r = cli("compare", DEMO / "float.pt", DEMO / "calibrated.pt", demo.int8, "--data", DEMO / "eval.pt",
            "--batches", "1", "--format", "json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    rows = _onnx_rows(out)
    assert set(rows) == set(_onnx_rows(out, "calibrated"))  # every layer, beside the checkpoint's rows
    for layer in ("input", "features.0.act", "features.1.conv.project_bn", "features.3.add", "features.5.add",
                  "features.7.act", "avgpool", "classifier.fc"):
        assert rows[layer]["note"] == "" and math.isfinite(rows[layer]["sqnr_db"]), rows[layer]
        assert rows[layer]["isolated_sqnr_db"] is None  # propagated only: ORT has no layer to replay alone
    # The exporter folded each BN into its conv; ORT's quantizer dropped the ReLU6 after it.
    assert rows["features.0.bn"]["note"] == "folded into features.0.conv by the exporter: compared at features.0.act"
    assert rows["features.0.conv"]["note"] == "in ONNX Runtime's kernel of features.0.act: compared at features.0.act"
    assert rows["features.1.conv.project_conv"]["note"] == ("the exporter folded 'features.1.conv.project_bn' into "
                                                             "it: compared at features.1.conv.project_bn")
    stage = out["meta"]["stages"]["onnx"]
    assert stage["unmatched"] == [] and stage["float_taps"] == []
    assert stage["tap_check"] == {"batches": 1, "outputs_equal": True, "values_differ": 0, "max_abs_diff": 0.0}
    assert "onnx" in out["meta"]["propagated_only"]
    # Independent: the output row is ONNX Runtime's own output on that batch against the float model's.
    with torch.no_grad():
        expected = _sqnr_db(demo.model(demo.batch), run_ort(demo.int8, demo.batch))
    assert rows["classifier.fc"]["sqnr_db"] == pytest.approx(expected, abs=1e-3)


def test_resnet_block_rows_and_notes(cli, stages, tmp_path):
    """A ResNet (tests/small_models.py SMALL_RESNET): the residual add ORT runs with its ReLU, the
    downsample's folded BN, the second call of a ReLU module."""
    path = ort_quantize(torch_export(stages.models["float"], stages.x, tmp_path / "r.onnx"), tmp_path / "rq.onnx",
                        [stages.x], per_channel=False)
    r = cli("compare", stages.float, stages.qat, path, "--data", stages.data, "--format", "json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    rows = _onnx_rows(out)
    for layer in ("input", "relu", "layer1.0.relu", "layer1.0.bn2", "layer1.0.relu#2", "layer2.0.downsample.1",
                  "layer2.0.relu#2", "avgpool", "fc"):
        assert rows[layer]["note"] == "" and math.isfinite(rows[layer]["sqnr_db"]), rows[layer]
    assert rows["layer1.0.bn1"]["note"] == "folded into layer1.0.conv1 by the exporter: compared at layer1.0.relu"
    assert rows["layer2.0.downsample.0"]["note"].startswith("the exporter folded 'layer2.0.downsample.1'")
    assert rows["layer1.0.add"]["note"] == "in ONNX Runtime's kernel of layer1.0.relu#2: compared at layer1.0.relu#2"
    assert out["meta"]["stages"]["onnx"]["unmatched"] == []


def test_qdebug_export_rows_from_its_metadata(demo):
    """qdebug's own export names its rows in its metadata: every activation point's codes."""
    from qdebug.onnx.export import export_onnx

    calibrated, _ = qdebug.load(DEMO / "calibrated.pt")
    proto, _ = export_onnx(calibrated, demo.batch[:2], stage="calibrated")
    stage = OnnxStage(proto, calibrated, demo.batch[:8])
    points = [p for p in json.loads(proto.metadata_props[0].value)["points"] if p["kind"] == "activation"]
    assert {row: tap.tensor for row, tap in stage.taps.items()} == {p["row"]: f"{p['name']}/quantized" for p in points}
    taps = stage.tapped(demo.batch)
    assert stage.tap_check["outputs_equal"] and not stage.unmatched
    # The output row is ORT's output (the last point's codes, dequantized) bit for bit.
    assert torch.equal(taps["classifier.fc"], torch.from_numpy(
        ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"input": demo.batch.numpy()})[0]))


def test_taps_are_the_deployed_numbers(demo, tmp_path):
    """uint8 activations: the tapped session's output is the untapped one's bit for bit, and a tapped
    intermediate is exactly what ORT computes for the model cut there (onnx.utils.extract_model)."""
    x = demo.batch
    stage = OnnxStage(read_onnx(demo.uint8), demo.model, x[:8])
    taps = stage.tapped(x)
    assert stage.tap_check["outputs_equal"] and stage.tap_check["values_differ"] == 0
    graph = onnx.load(str(demo.uint8)).graph
    for row in ("features.1.conv.project_bn", "features.5.add"):
        codes = stage.taps[row].tensor
        dequantized = next(n.output[0] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] == codes)
        cut = tmp_path / "cut.onnx"
        onnx.utils.extract_model(str(demo.uint8), str(cut), ["input"], [dequantized])
        assert torch.equal(taps[row], run_ort(cut, x)), row


def _optimized_ops(proto, path: Path) -> Counter:
    """The op types of ORT's optimized graph of ``proto`` (default optimizations, CPU)."""
    options = ort.SessionOptions()
    options.optimized_model_filepath, options.log_severity_level = str(path), 3
    ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node if n.op_type.startswith(("QLinear", "QGemm")))


@pytest.mark.skipif(not X86, reason="ONNX Runtime converts int8 QDQ pairs to uint8 (and then fuses) on x86 only")
def test_tapping_keeps_ort_fused_kernels_with_int8_activations(demo, tmp_path):
    """The trap: a QuantizeLinear whose int8 codes are also a graph output is not converted to uint8,
    and ORT's QLinearConv fusions after it are lost (the tapped model would compute in float).  The
    stage's tapped model keeps every fused kernel of the deployed one, and its output bit for bit."""
    proto = read_onnx(demo.int8)
    stage = OnnxStage(proto, demo.model, demo.batch[:8])
    stage.tapped(demo.batch)
    assert stage.tap_check["outputs_equal"]
    deployed = _optimized_ops(proto, tmp_path / "deployed.onnx")
    assert deployed["QLinearConv"] > 0
    assert _optimized_ops(stage.tapped_proto, tmp_path / "tapped.onnx") == deployed
    naive = onnx.ModelProto()
    naive.CopyFrom(proto)
    for tap in stage.taps.values():
        if tap.how == "codes":
            naive.graph.output.append(onnx.helper.make_empty_tensor_value_info(tap.tensor))
    assert _optimized_ops(naive, tmp_path / "naive.onnx")["QLinearConv"] < deployed["QLinearConv"]


def test_unmatched_tensors_are_listed(cli, demo, tmp_path):
    """A node no layer of the model makes: listed in the table's summary and in the JSON."""
    model = onnx.load(str(demo.int8))
    model.graph.node.append(onnx.helper.make_node("Relu", ["input"], ["/stray/Relu_output_0"], name="/stray/Relu"))
    model.graph.output.append(onnx.helper.make_tensor_value_info("/stray/Relu_output_0", onnx.TensorProto.FLOAT,
                                                                  ["batch", 1, 28, 28]))
    onnx.save(model, tmp_path / "stray.onnx")
    r = cli("compare", DEMO / "float.pt", tmp_path / "stray.onnx", "--data", DEMO / "eval.pt", "--batches", "1",
            "--no-isolated")
    assert r.code == 0, r.err
    assert "onnx: 1 ONNX tensor(s) matched no layer: /stray/Relu_output_0 (see --format json)" in " ".join(r.out.split())
    frame = qdebug.compare(DEMO / "float.pt", tmp_path / "stray.onnx", data=str(DEMO / "eval.pt"), batches=1,
                           isolated=False, config=False)
    [(tensor, why)] = [(u["tensor"], u["why"]) for u in frame.attrs["meta"]["stages"]["onnx"]["unmatched"]]
    assert tensor == "/stray/Relu_output_0" and "names no module" in why


def test_another_architecture_is_said_not_measured(cli, demo, tmp_path):
    """A ResNet's ONNX model against the demo's MobileNetV2: its tensors match no layer, listed; no row
    gets numbers but the input; compare's architecture check refuses the pair."""
    torch.manual_seed(0)
    resnet = build(ModelSpec(RESNET, SMALL_RESNET), from_user=True).eval()
    path = torch_export(resnet, demo.batch[:2], tmp_path / "resnet.onnx")
    frame = qdebug.compare(DEMO / "float.pt", path, data=str(DEMO / "eval.pt"), batches=1, isolated=False,
                           config=False)
    measured = frame[(frame["target"] == "onnx") & (frame["note"] == "")]
    assert list(measured["layer"]) == ["input"]
    unmatched = frame.attrs["meta"]["stages"]["onnx"]["unmatched"]
    assert any(u["tensor"].startswith("/layer1/") for u in unmatched)
    r = cli("compare", DEMO / "float.pt", path, "--data", DEMO / "eval.pt", "--batches", "1", "--no-isolated")
    r.assert_error("do not look like the same architecture")


def _hostile(kind: str, demo, tmp_path: Path) -> Path:
    path = tmp_path / f"{kind}.onnx"
    if kind == "not-onnx":
        path.write_text("this is no model\n")
    elif kind == "truncated":
        data = demo.int8.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "external-data":
        onnx.save(onnx.load(str(demo.float_onnx)), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location="weights.bin", size_threshold=0)
    elif kind == "unknown-op":
        value = [None, 1, 28, 28]
        graph = onnx.helper.make_graph(
            [onnx.helper.make_node("Foo", ["input"], ["output"], domain="custom.x")], "g",
            [onnx.helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, value)],
            [onnx.helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, value)])
        onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13),
                                                               onnx.helper.make_opsetid("custom.x", 1)]), path)
    return path


@pytest.mark.parametrize("kind, fragment", [
    ("not-onnx", "is not an ONNX model"), ("truncated", "is not an ONNX model"),
    ("external-data", "external data"), ("unknown-op", "ONNX Runtime cannot load"),
])
def test_bad_onnx_files_are_one_error(cli, demo, tmp_path, kind, fragment):
    path = _hostile(kind, demo, tmp_path)
    r = cli("compare", DEMO / "float.pt", path, "--data", DEMO / "eval.pt", "--batches", "1")
    r.assert_error(fragment)


def test_help_shows_an_onnx_example(cli):
    assert "fixtures/demo/qat.pt model.onnx" in " ".join(cli("compare", "--help").out.split())


def test_wrong_inputs_and_reference_are_one_error(cli, demo, stages, tmp_path):
    # The demo's 28x28 data into a model exported for 16x16 inputs: the expected shape is said.
    small = torch_export(stages.models["float"], stages.x, tmp_path / "small.onnx")
    r = cli("compare", DEMO / "float.pt", small, "--data", DEMO / "eval.pt", "--batches", "1", "--no-isolated")
    r.assert_error("input input has shape [?, 1, 16, 16]", "got [64, 1, 28, 28]")
    # The ONNX model is never the reference.
    r = cli("compare", demo.int8, DEMO / "float.pt", "--ref", "0", "--data", DEMO / "eval.pt")
    r.assert_error("the reference must be a checkpoint")
    r = cli("compare", demo.int8, demo.uint8, "--data", DEMO / "eval.pt")
    r.assert_error("an ONNX model cannot be the reference")


def test_the_api_takes_an_onnx_path_under_a_label_of_the_users(demo):
    frame = qdebug.compare(DEMO / "float.pt", ("deployed", demo.uint8), data=str(DEMO / "eval.pt"), batches=1,
                           isolated=False, config=False)
    rows = frame[(frame["target"] == "deployed") & frame["sqnr_db"].notna()]
    assert len(rows) > 10 and "onnx" not in set(frame["target"])
    assert "deployed" in frame.attrs["meta"]["stages"]
