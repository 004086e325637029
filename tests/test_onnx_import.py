"""``qdebug import model.onnx --from onnx-qdq``: an ONNX model ONNX Runtime quantized (QDQ) as a
qdebug checkpoint (docs/onnx.md, *Importing a model ONNX Runtime quantized*).

The user's route is made by the real tools (tests/onnx_helpers.py): torch's exporter, then ONNX
Runtime's ``quantize_static``.  The oracles are independent of the import: ONNX Runtime's own run
of the file (outputs within 1 LSB of its output scale), and the scales, zero points and integer
weights stored in the file, read here with onnx's own ``numpy_helper``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from onnx_helpers import onnx, ort_quantize, run_ort, torch_export  # skips without onnx/onnxruntime
from small_models import RESNET, SMALL_MOBILENETV2, SMALL_RESNET, randomize_bn

import qdebug
from qdebug.interop import import_check, import_report
from qdebug.io.modelspec import ModelSpec, build
from qdebug.onnx.model_file import read_onnx
from qdebug.onnx.qdq_import import import_qdq

MOBILENET = "qdebug.zoo.mobilenetv2:MobileNetV2"
# ORT's quantize_static settings: per-channel / per-tensor weights, asymmetric / symmetric activations,
# QInt8 / QUInt8 activations (and weights).
VARIANTS = {
    "per-channel": {},
    "per-tensor-symmetric": {"per_channel": False, "symmetric_activations": True},
    "quint8": {"per_channel": False, "activation_type": "QUInt8", "weight_type": "QUInt8"},
    "quint8-per-channel": {"activation_type": "QUInt8"},
}


def _model(target: str, kwargs: dict, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return randomize_bn(build(ModelSpec(target, kwargs), from_user=False), seed).eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The user's side: float models, torch's export of them, ORT's quantized files, the data."""
    d = tmp_path_factory.mktemp("onnx_import")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(24, 1, 16, 16, generator=gen)
    torch.save((x[16:], torch.randint(0, 10, (8,), generator=gen)), d / "data.pt")
    calibration = [x[:8], x[8:16]]
    resnet = _model(RESNET, SMALL_RESNET, 0)
    mobilenet = _model(MOBILENET, SMALL_MOBILENETV2, 1)
    qdebug.save(resnet, d / "float.pt", sample_inputs=x[:4])
    for name, model in (("resnet", resnet), ("mobilenet", mobilenet)):
        torch_export(model, x[:2], d / f"{name}.onnx")
    for variant, options in VARIANTS.items():
        ort_quantize(d / "resnet.onnx", d / f"resnet-{variant}.onnx", calibration, **options)
    ort_quantize(d / "mobilenet.onnx", d / "mobilenet-per-channel.onnx", calibration)
    return {"dir": d, "x": x, "calibration": calibration, "resnet": resnet, "mobilenet": mobilenet}


def _stored(path: Path) -> dict:
    """Every initializer of an ONNX file as a tensor, read by onnx itself."""
    from onnx import numpy_helper

    return {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in onnx.load(str(path)).graph.initializer}


def _within_one_lsb(path: Path, qm, x: torch.Tensor) -> float:
    """Share of output values of the import within 1 LSB of ONNX Runtime's own run of ``path``."""
    scale = float(_stored(path)["output_scale"])
    theirs = run_ort(path, x)
    with torch.no_grad():
        ours = qm(x)
    return float(((ours - theirs).abs() <= 1.001 * scale).double().mean())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_ort_quantized_resnet_imports_within_one_lsb_of_ort(files, variant):
    path = files["dir"] / f"resnet-{variant}.onnx"
    fresh = build(ModelSpec(RESNET, SMALL_RESNET), from_user=False)  # weights: the file's only
    qm = import_qdq(read_onnx(path), fresh, files["x"][16:])
    assert _within_one_lsb(path, qm, files["x"]) >= 0.99
    report = import_report(qm)
    quantizers = report[report["kind"] != "bn"]
    assert set(quantizers["status"]) == {"exact"}, quantizers[quantizers["status"] != "exact"].to_string()
    assert sorted(report.loc[report["kind"] == "bn", "source"]) == [
        "bn1", "layer1.0.bn1", "layer1.0.bn2", "layer2.0.bn1", "layer2.0.bn2", "layer2.0.downsample.1"]
    # Every scale and zero point is the file's, read independently.
    stored = _stored(path)
    points = qdebug.engine.engine_state(qm).points
    for row in quantizers[quantizers["kind"].isin(["weight", "activation"])].itertuples():
        if "quantized again" in row.note:  # the Flatten's output, on the pool's grid (its scale's name)
            continue
        assert torch.equal(points[row.point].scale.detach().flatten().float(), stored[f"{row.source}_scale"].flatten())
        assert torch.equal(points[row.point].zero_point.detach().flatten().to(torch.int32),
                           stored[f"{row.source}_zero_point"].flatten().to(torch.int32)), row
    spec = " ".join(quantizers.loc[quantizers["kind"] == "activation", "spec"])
    weights = " ".join(quantizers.loc[quantizers["kind"] == "weight", "spec"])
    assert ("per-channel" in weights) == (variant in ("per-channel", "quint8-per-channel"))
    assert ("uint8" in spec) == variant.startswith("quint8")
    assert ("affine" not in spec) == (variant == "per-tensor-symmetric")
    # With symmetric activations ORT keeps each Relu (its removal needs zero point = qmin): the conv
    # before it and the Relu are quantized apart, each on its own engine point.
    convs = set(quantizers.loc[quantizers["kind"] == "activation", "point"])
    assert ("layer1.0.conv1" in convs) == (variant == "per-tensor-symmetric")
    check = import_check(qm)
    assert check["compared_with"] == "onnxruntime" and check["within_1_lsb"] >= 0.99 and check["within_tolerance"]


def test_the_integer_weights_are_the_files_codes(files):
    path = files["dir"] / "resnet-per-channel.onnx"
    qm = import_qdq(read_onnx(path), build(ModelSpec(RESNET, SMALL_RESNET), from_user=False), files["x"][16:])
    report = import_report(qm)
    stored = _stored(path)
    layer = qm.get_submodule("layer1.0.conv2")
    source = report.loc[report["point"] == "layer1.0.conv2.weight", "source"].item()
    with torch.no_grad():
        weight, _ = layer.quantized_input_weight()
        ours = layer._quantized_weight(weight, None)
    scale = stored[f"{source}_scale"].reshape(-1, 1, 1, 1)
    assert torch.equal(torch.round(ours / scale).to(torch.int8), stored[f"{source}_quantized"])
    bias = report[(report["kind"] == "bias") & (report["point"] == "layer1.0.conv2.bias")]
    assert bias["status"].item() == "exact" and "s_in * s_w" in bias["note"].item()


def test_a_mobilenet_with_relu6_removed_by_ort_imports_within_one_lsb(files):
    """Depthwise convs, ReLU6 (Clip) that ORT removes after its conv, residual adds, and the Flatten
    output ORT quantizes again on the pool's grid."""
    path = files["dir"] / "mobilenet-per-channel.onnx"
    qm = import_qdq(read_onnx(path), build(ModelSpec(MOBILENET, SMALL_MOBILENETV2), from_user=False),
                    files["x"][16:])
    assert _within_one_lsb(path, qm, files["x"]) >= 0.99
    report = import_report(qm)
    rows = report.set_index("source")
    assert rows.loc["/features/features.0/act/Clip_output_0", "point"] == "features.0.act"
    assert rows.loc["/Flatten_output_0", "status"] == "exact"
    assert "the same grid" in rows.loc["/Flatten_output_0", "note"]
    assert set(report.loc[report["kind"] != "bn", "status"]) == {"exact"}


# -- the command line ------------------------------------------------------------------------

def _import_cli(cli, files, name: str, *extra: str, output: str = "ort.pt"):
    d = files["dir"]
    return cli("import", d / f"{name}.onnx", "--from", "onnx-qdq", "--model", RESNET, "--model-kwargs",
               json.dumps(SMALL_RESNET), "--data", d / "data.pt", "-o", output, *extra)


def test_import_compare_step_and_suggest_run_on_the_imported_checkpoint(cli, files, tmp_path):
    d = files["dir"]
    result = _import_cli(cli, files, "resnet-per-channel", "--format", "json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    assert payload["meta"]["flow"] == "onnx-qdq" and payload["meta"]["stage"] == "quantized"
    assert payload["meta"]["check"]["within_1_lsb"] >= 0.99
    model, info = qdebug.load(tmp_path / "ort.pt", model=ModelSpec(RESNET, SMALL_RESNET))
    assert info.stage == "quantized" and info.meta["import_flow"] == "onnx-qdq"
    assert _within_one_lsb(d / "resnet-per-channel.onnx", model, files["x"]) >= 0.99
    text = _import_cli(cli, files, "resnet-per-channel", output="ort2.pt")
    assert text.code == 0 and "ONNX Runtime quantizer(s)" in text.err + text.out
    assert "within 1 LSB" in text.err + text.out

    kwargs = ["--model", RESNET, "--model-kwargs", json.dumps(SMALL_RESNET)]
    compared = cli("compare", d / "float.pt", "ort.pt", "--data", d / "data.pt", "--format", "json", *kwargs)
    assert compared.code == 0, compared.err
    layers = {row["layer"] for row in json.loads(compared.out)["rows"]}
    assert {"layer1.0.add", "fc"} <= layers
    stepped = cli("step", "ort.pt", "--data", d / "data.pt", "--format", "json", *kwargs)
    assert stepped.code == 0, stepped.err

    # suggest's plan back to ORT: quantize_static with the written options, imported again --
    # exactly the plan's tensors are 16-bit, everything else as before.
    sqnr = _sqnr(files["resnet"], model, files["x"][16:])
    suggested = cli("suggest", d / "float.pt", "ort.pt", "--data", d / "data.pt", "--min-sqnr", f"{sqnr + 3:.1f}",
                    "--to", "onnxruntime", "--out", "plan", "--format", "json", *kwargs)
    assert suggested.code == 0, suggested.err
    plan = json.loads((tmp_path / "plan" / "plan_onnxruntime.json").read_text())
    overrides = plan["extra_options"]["TensorQuantOverrides"]
    assert overrides and plan["nodes_to_exclude"] == []
    assert "TENSOR_QUANT_OVERRIDES" in (tmp_path / "plan" / "plan_onnxruntime.py").read_text()
    from onnxruntime.quantization import QuantType

    options = {name: [{**e, "quant_type": QuantType[e["quant_type"]]} for e in entries]
               for name, entries in overrides.items()}
    again = ort_quantize(d / "resnet.onnx", tmp_path / "resnet16.onnx", files["calibration"],
                         TensorQuantOverrides=options)
    qm16 = import_qdq(read_onnx(again), build(ModelSpec(RESNET, SMALL_RESNET), from_user=False), files["x"][16:])
    before = import_report(model).set_index(["source", "kind"])
    after = import_report(qm16).set_index(["source", "kind"])
    for (source, kind), row in after.iterrows():
        if kind not in ("weight", "activation"):
            continue
        if source in overrides:
            assert "int16" in row["spec"], (source, row["spec"])
        else:
            assert row["spec"] == before.loc[(source, kind), "spec"], source
            assert row["scale_max"] == before.loc[(source, kind), "scale_max"], source
    assert _sqnr(files["resnet"], qm16, files["x"][16:]) > sqnr


def _sqnr(reference, model, x) -> float:
    with torch.no_grad():
        want, have = reference(x), model(x)
    return float(10 * torch.log10(want.pow(2).sum() / (want - have).pow(2).sum()))


def test_bad_input_is_one_error_and_writes_nothing(cli, files, tmp_path):
    d = files["dir"]
    (tmp_path / "corrupt.onnx").write_bytes(b"\x08\x07 not a protobuf model at all")
    cases = {
        "a float ONNX model": ([d / "resnet.onnx"], "holds no QuantizeLinear/DequantizeLinear"),
        "another architecture": ([d / "mobilenet-per-channel.onnx"], "another architecture"),
        "a corrupt file": ([tmp_path / "corrupt.onnx"], "is not an ONNX model"),
        "a missing file": ([tmp_path / "none.onnx"], "no such file"),
    }
    for case, (src, fragment) in cases.items():
        result = cli("import", *src, "--from", "onnx-qdq", "--model", RESNET, "--model-kwargs",
                     json.dumps(SMALL_RESNET), "--data", d / "data.pt", "-o", "out.pt")
        try:
            result.assert_error(fragment)
        except AssertionError as exc:
            raise AssertionError(f"{case}: {exc}") from None
        assert not (tmp_path / "out.pt").exists(), case
    wider = cli("import", d / "resnet-per-channel.onnx", "--from", "onnx-qdq", "--model", RESNET, "--model-kwargs",
                json.dumps({**SMALL_RESNET, "widths": [8, 32]}), "--data", d / "data.pt", "-o", "out.pt")
    wider.assert_error("another architecture")
    assert not (tmp_path / "out.pt").exists()


def test_suggest_to_onnxruntime_refuses_a_checkpoint_not_imported_from_onnx(cli, stages):
    result = cli("suggest", stages.float, stages.calibrated, "--data", stages.data, "--batches", "1",
                 "--to", "onnxruntime", "--out", "plan")
    result.assert_error("--to onnxruntime needs a model imported from an ONNX file")


def test_the_self_check_finds_a_row_mapped_to_the_wrong_call(files, monkeypatch):
    """Each row's codes are checked against ORT's own (its QuantizeLinear's output): two tensors of
    one shape read onto each other's calls make both rows approximate, with the share measured."""
    import qdebug.onnx.names as names

    real = names.map_tensors

    def swapped(*args):
        found = real(*args)
        first, second = (t for t, row in found.rows.items() if row in ("layer1.0.relu", "layer1.0.relu#2"))
        found.rows[first], found.rows[second] = found.rows[second], found.rows[first]
        return found

    monkeypatch.setattr(names, "map_tensors", swapped)
    path = files["dir"] / "resnet-per-channel.onnx"
    qm = import_qdq(read_onnx(path), build(ModelSpec(RESNET, SMALL_RESNET), from_user=False), files["x"][16:])
    check = import_check(qm)
    report = import_report(qm).set_index("source")
    assert set(check["rows_differing"]) >= {"layer1.0.relu", "layer1.0.relu#2"}, check  # and the rows after
    for tensor in ("/layer1/layer1.0/relu/Relu_output_0", "/layer1/layer1.0/relu_1/Relu_output_0"):
        assert report.loc[tensor, "status"] == "approximate" and \
            "differ from ONNX Runtime's by" in report.loc[tensor, "note"]


def test_a_point_the_plan_leaves_float_is_excluded_with_the_nodes_around_it(files, tmp_path):
    """``nodes_to_exclude``: ORT quantizes a tensor when any node next to it is quantized, so the plan
    names the node that makes it (the Relu ORT would remove) and those that read it."""
    import warnings

    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    from qdebug.tools.plan_onnxruntime import onnxruntime_plan, python_source, quantize_static_options

    path = files["dir"] / "resnet-per-channel.onnx"
    qm = import_qdq(read_onnx(path), build(ModelSpec(RESNET, SMALL_RESNET), from_user=False), files["x"][16:])
    frame = onnxruntime_plan(qm, {"layer1.0.relu": {"activation": None}})
    overrides, exclude = quantize_static_options(frame)
    assert overrides == {} and "/layer1/layer1.0/relu/Relu" in exclude and "/layer1/layer1.0/conv2/Conv" in exclude
    assert repr(exclude) in python_source(frame)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"input": b.numpy()} for b in files["calibration"]])

        def get_next(self):
            return next(self.batches, None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_static(str(files["dir"] / "resnet.onnx"), str(tmp_path / "excluded.onnx"), Reader(),
                        quant_format=QuantFormat.QDQ, per_channel=True, nodes_to_exclude=exclude,
                        extra_options={"ActivationSymmetric": False})
    again = import_qdq(read_onnx(tmp_path / "excluded.onnx"), build(ModelSpec(RESNET, SMALL_RESNET), from_user=False),
                       files["x"][16:])
    sources = set(import_report(again)["source"])
    # the point stands for both calls of the module layer1.0.relu: both tensors float, the rest quantized
    assert not sources & {"/layer1/layer1.0/relu/Relu_output_0", "/layer1/layer1.0/relu_1/Relu_output_0"}
    assert "/layer2/layer2.0/relu/Relu_output_0" in sources
    assert _within_one_lsb(tmp_path / "excluded.onnx", again, files["x"]) >= 0.99


def test_the_plan_keeps_each_points_signedness_and_axis(files):
    """suggest's plan changes the width only: a QUInt8 activation goes to QUInt16, a QInt8 one to
    QInt16, a per-channel weight keeps its axis."""
    from qdebug.tools.plan_onnxruntime import onnxruntime_plan, quantize_static_options

    for variant, activation in (("quint8-per-channel", "QUInt16"), ("per-channel", "QInt16")):
        path = files["dir"] / f"resnet-{variant}.onnx"
        qm = import_qdq(read_onnx(path), build(ModelSpec(RESNET, SMALL_RESNET), from_user=False), files["x"][16:])
        overrides, exclude = quantize_static_options(onnxruntime_plan(
            qm, {"layer1.0.conv2": {"activation": {"bits": 16}}, "layer1.0.conv1": {"weight": {"bits": 16}}}))
        weight = import_report(qm).set_index("point").loc["layer1.0.conv1.weight", "source"]
        assert overrides == {"/layer1/layer1.0/conv2/Conv_output_0": [{"quant_type": activation}],
                             weight: [{"quant_type": "QInt16", "axis": 0}]} and exclude == [], overrides
