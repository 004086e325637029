"""``qdebug export`` and ``qdebug.onnx.export``: a quantized stage as a QDQ ONNX model, run in ONNX Runtime.

The references are independent of the export: ONNX Runtime's own kernels (CPU provider, default
optimizations) against qdebug's integer stage (``convert``), the exported weight initializers
dequantized with numpy against the engine's stored integer codes and torch's own fake-quant
kernel, and the names of docs/onnx.md's conventions.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from onnx_helpers import onnx, ort  # noqa: F401  (skips this module without the [onnx] extra)
from small_models import INTEROP_ZOO, SMALL_MOBILENETV2, SMALL_RESNET, SMALL_SHUFFLENETV2, randomize_bn

import qdebug
from qdebug.engine import QConfig, QuantSpec, calibrate, convert, engine_state, prepare
from qdebug.engine.modules import _QWeighted
from qdebug.errors import QDebugError
from qdebug.onnx.export import METADATA_KEY, export_onnx
from qdebug.onnx.model_file import read_onnx, tensor_array
from qdebug.onnx.parity import export_parity
from qdebug.zoo import ResNet

pytestmark = pytest.mark.filterwarnings("ignore")


class SameBlock(nn.Module):
    """A MobileNet-style block as TF exports it: SAME padding (F.pad on a strided depthwise conv,
    padding='same' on a stride-1 one), BN folded into every conv, ReLU6, and residual adds."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding="same", bias=False)
        self.stem_bn = nn.BatchNorm2d(c)
        self.dw = nn.Conv2d(c, c, 3, stride=2, groups=c, bias=False)
        self.dw_bn = nn.BatchNorm2d(c)
        self.pw = nn.Conv2d(c, c, 1, bias=False)
        self.pw_bn = nn.BatchNorm2d(c)
        self.dw2 = nn.Conv2d(c, c, 5, padding="same", groups=c, bias=False)
        self.dw2_bn = nn.BatchNorm2d(c)
        self.head = nn.Linear(c, 5)

    def forward(self, x):
        x = F.relu6(self.stem_bn(self.stem(x)))
        y = F.relu6(self.dw_bn(self.dw(F.pad(x, (0, 1, 0, 1)))))  # TF SAME for stride 2: pad right/bottom
        y = y + self.pw_bn(self.pw(y))
        y = y + F.relu6(self.dw2_bn(self.dw2(y)))
        return self.head(y.mean((2, 3)))


def _calibrated(model: nn.Module, shape: tuple, qconfig: QConfig | None = None, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    randomize_bn(model, seed + 7)
    model.eval()
    batches = [torch.randn(*shape, generator=gen) for _ in range(3)]
    cal = prepare(model, qconfig or QConfig(), example_inputs=batches[0])
    calibrate(cal, batches[:2])
    return cal, batches


def _node(proto, name: str):
    return next(n for n in proto.graph.node if n.name == name)


def _initializers(proto) -> dict:
    return {t.name: tensor_array(t) for t in proto.graph.initializer}


def test_real_block_exports_with_parity_names_and_weight_codes():
    torch.manual_seed(0)
    cal, batches = _calibrated(SameBlock(), (4, 3, 17, 17))
    proto, info = export_onnx(cal, batches[0][:1], stage="calibrated")
    quantized = convert(cal)
    qstate = engine_state(quantized)
    assert info["opset"] == 13 and info["points"] == len(qstate.points)
    ops = [n.op_type for n in proto.graph.node]
    assert "BatchNormalization" not in ops and ops.count("QuantizeLinear") == info["activations"]
    assert ops.count("DequantizeLinear") == info["points"]
    # ONNX Runtime (fused QLinear kernels) against qdebug's integer stage, computed here with numpy.
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    scale = float(qstate.points["head"].scale)
    got = np.concatenate([session.run(None, {"input": b.numpy()})[0] for b in batches])
    with torch.no_grad():
        want = np.concatenate([quantized(b).numpy() for b in batches])
    lsb = np.round(np.abs(got - want) / scale)
    assert (lsb <= 1).mean() >= 0.99
    parity = export_parity(proto, quantized, batches)
    assert parity["values"] == lsb.size and parity["max_lsb"] == lsb.max()
    assert parity["within_1_lsb"] == pytest.approx((lsb <= 1).mean())
    # Weights: integer initializer + DQ only; (q - z) equals the engine's codes, (q - z) * s torch's fake quant.
    init = _initializers(proto)
    for path, layer in quantized.named_modules():
        if not isinstance(layer, _QWeighted):
            continue
        p = layer.weight_point.name
        q, s, z = init[f"{p}/quantized"], init[f"{p}/scale"], init[f"{p}/zero_point"]
        assert q.dtype == np.int8 and z.dtype == np.int8
        assert not any(n.op_type == "QuantizeLinear" and n.input[0] == f"{p}/quantized" for n in proto.graph.node)
        zb = z.reshape([-1] + [1] * (q.ndim - 1)) if z.ndim else z
        sb = s.reshape([-1] + [1] * (q.ndim - 1)) if s.ndim else s
        assert np.array_equal(q.astype(np.int64) - zb, layer.weight_int.numpy().astype(np.int64)), path
        reference = torch.fake_quantize_per_channel_affine(
            layer.weight.detach(), layer.weight_point.scale, layer.weight_point.zero_point, 0, -128, 127)
        assert np.array_equal((q - zb).astype(np.float32) * sb, reference.numpy()), path
        assert _node(proto, f"{p}/DequantizeLinear").output[0] == f"{p}/dequantized"
    # Activations: P/QuantizeLinear -> P/quantized -> P/DequantizeLinear -> P/dequantized, metadata rows.
    meta = json.loads(next(m.value for m in proto.metadata_props if m.key == METADATA_KEY))
    assert meta["stage"] == "calibrated" and {p["name"] for p in meta["points"]} == set(qstate.points)
    for entry in meta["points"]:
        p = entry["name"]
        assert entry["spec"] == qstate.points[p].spec.describe()
        if entry["kind"] == "activation":
            assert entry["row"] in qstate.plan.calls and qstate.plan.calls[entry["row"]].point == p
            q_node, dq_node = _node(proto, f"{p}/QuantizeLinear"), _node(proto, f"{p}/DequantizeLinear")
            assert list(q_node.input[1:]) == [f"{p}/scale", f"{p}/zero_point"]
            assert q_node.output[0] == f"{p}/quantized" == dq_node.input[0]
            assert dq_node.output[0] == f"{p}/dequantized"
            assert float(init[f"{p}/scale"]) == float(qstate.points[p].scale)
        else:
            assert entry["row"] == qstate.points[p].owner
    # The batch axis is free.
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"


@pytest.mark.parametrize("name", ["mobilenetv2", "shufflenetv2", "multitask"])
def test_zoo_models_match_the_quantized_stage(name):
    from qdebug.zoo import MODELS

    kwargs = {"mobilenetv2": SMALL_MOBILENETV2, "shufflenetv2": SMALL_SHUFFLENETV2}.get(name, INTEROP_ZOO.get(name))
    channels = kwargs.get("in_channels", 3)
    torch.manual_seed(1)
    cal, batches = _calibrated(MODELS[name](**kwargs), (4, channels, 16, 16), seed=1)
    proto, info = export_onnx(cal, batches[0][:1])
    assert info["points"] == len(engine_state(cal).points)
    parity = export_parity(proto, convert(cal), batches)
    assert parity["within_1_lsb"] >= 0.99, parity


def test_int16_points_export_at_opset_21_and_run():
    torch.manual_seed(2)
    qconfig = QConfig(overrides={"layer1.*": {"activation": {"bits": 16}}})
    cal, batches = _calibrated(ResNet(**SMALL_RESNET),
                               (4, 1, 16, 16), qconfig)
    wide = [n for n, p in engine_state(cal).points.items() if p.spec.bits == 16]
    assert wide
    with pytest.raises(QDebugError, match="opset 21"):
        export_onnx(cal, batches[0][:1], opset=13)
    proto, info = export_onnx(cal, batches[0][:1])
    assert info["opset"] == 21 and proto.opset_import[0].version == 21
    assert _initializers(proto)[f"{wide[0]}/zero_point"].dtype == np.int16
    parity = export_parity(proto, convert(cal), batches)
    assert parity["within_1_lsb"] >= 0.99, parity


def test_recurrent_model_at_opset_21_loads_and_matches():
    """A GRU's transposes after int8 DequantizeLinear nodes at opset 21 (symmetric activations:
    affine ones are written as uint8): ONNX Runtime 1.32's QDQ propagation cannot load it by
    default; the check leaves that one optimizer out and says so."""
    from qdebug.onnx.parity import PROPAGATION
    from qdebug.zoo import KeywordGRU

    torch.manual_seed(4)
    model = KeywordGRU(mel_channels=8, conv_channels=8, hidden_size=8, num_layers=1, num_classes=4).eval()
    batches = [torch.randn(3, 20, 8, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    cal = prepare(model, QConfig(activation=QuantSpec(bits=8, signed=True, symmetric=True)), example_inputs=batches[0])
    calibrate(cal, batches[:1])
    proto, info = export_onnx(cal, batches[0][:1], opset=21)
    assert info["opset"] == 21
    parity = export_parity(proto, convert(cal), batches)
    assert parity["within_1_lsb"] >= 0.99 and parity["disabled_optimizers"] in ([], [PROPAGATION]), parity


def test_narrow_activation_range_gets_an_exact_clip():
    torch.manual_seed(3)
    qconfig = QConfig(activation=QuantSpec(bits=7, signed=False, symmetric=False))  # uint7 in uint8
    cal, batches = _calibrated(ResNet(**SMALL_RESNET),
                               (4, 1, 16, 16), qconfig)
    proto, _ = export_onnx(cal, batches[0][:1])
    point = engine_state(cal).points["input"]
    clip = _node(proto, "input/Clip")
    low, high = (float(_initializers(proto)[name]) for name in clip.input[1:])
    z, s = int(point.zero_point), float(point.scale)
    assert (low, high) == (np.float32((0 - z) * np.float32(s)), np.float32((127 - z) * np.float32(s)))
    assert export_parity(proto, convert(cal), batches)["within_1_lsb"] >= 0.99


def test_cli_exports_each_quantized_stage(cli, stages):
    for stage in ("calibrated", "qat", "quantized"):
        result = cli("export", stages.path(stage), "-o", f"{stage}.onnx", "--format", "json")
        assert result.code == 0, result.err
        row = json.loads(result.out)["rows"][0]
        assert row["stage"] == stage and row["opset"] == 13 and row["values"] == 40 and row["within_1_lsb"] >= 0.99
        assert row["lsb_0"] + row["lsb_1"] + row["lsb_2"] + row["lsb_over_2"] == row["values"]
        proto = read_onnx(Path.cwd() / f"{stage}.onnx")
        assert row["points"] == len(engine_state(stages.models[stage]).points) > 0
        assert any(n.name == "input/QuantizeLinear" for n in proto.graph.node)
    table = cli("export", stages.quantized, "-o", "t.onnx", "--data", stages.data, "--batches", 2, "--batch-size", 5)
    text = " ".join(table.out.split())  # the summary is wrapped to the terminal's width
    assert table.code == 0, table.err
    assert "100 output values (2 batch(es)): 100.00% equal, 100.00% within 1 LSB, max 0 LSB" in text, text
    # The next line runs as printed: the checkpoint and its export, side by side, on the same data.
    command = table.out.splitlines()[-1].strip()
    assert command.startswith("qdebug compare ") and "t.onnx" in command and "--batch-size 5" in command
    rerun = cli(*shlex.split(command)[1:], "--format", "json")
    assert rerun.code == 0, rerun.err
    assert "onnx" in json.loads(rerun.out)["meta"]["targets"]


def test_cli_float_stage_is_torchs_own_export(cli, stages):
    result = cli("export", stages.float, "-o", "float.onnx", "--format", "csv")
    assert result.code == 0, result.err
    assert result.out.splitlines()[1].startswith("float.onnx,float,13,0,")
    proto = read_onnx(Path.cwd() / "float.onnx")
    assert not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in proto.graph.node)
    assert any(n.name.startswith("/layer1/layer1.0/") for n in proto.graph.node)  # torch's scope names
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        want = stages.models["float"](stages.x).numpy()
    assert np.allclose(session.run(None, {"input": stages.x.numpy()})[0], want, atol=1e-5)


def test_cli_check_failure_exits_1_and_keeps_the_file(cli, stages, monkeypatch):
    import qdebug.cli.export as command

    monkeypatch.setattr(command, "PARITY_GATE", 1.01)  # no model reaches it: the failing path
    result = cli("export", stages.calibrated, "-o", "m.onnx")
    assert result.code == 1 and "check failed" in result.err
    assert (Path.cwd() / "m.onnx").is_file()


@pytest.mark.parametrize("override, fragment", [
    ({"layer1.*": {"activation": {"dynamic": True}}}, "computes its scale from each batch"),
    ({"layer1.0.conv1": {"weight": {"group_size": 8}}}, "grouped weights"),
])
def test_cli_refuses_what_qdq_cannot_express(cli, stages, tmp_path, override, fragment):
    model = ResNet(**SMALL_RESNET)
    cal = prepare(model.eval(), QConfig(overrides=override), example_inputs=stages.x)
    calibrate(cal, [stages.x])
    qdebug.save(cal, tmp_path / "odd.pt", stage="calibrated", model_spec=stages.spec, model_kwargs=stages.kwargs,
                sample_inputs=stages.x)
    result = cli("export", tmp_path / "odd.pt", "-o", "odd.onnx")
    result.assert_error(fragment)
    assert not (tmp_path / "odd.onnx").exists()


def test_cli_refuses_bad_options_before_work(cli, stages, tmp_path):
    cli("export", stages.calibrated, "-o", "model.pt").assert_error("does not end in .onnx")
    cli("export", stages.calibrated, "-o", "m.onnx", "--opset", "9").assert_error("--opset 9")
    assert not (tmp_path / "m.onnx").exists() and not (tmp_path / "model.pt").exists()


def test_export_names_an_op_torchs_exporter_cannot_write():
    class Odd(nn.Module):
        def forward(self, x):
            return torch.special.i1(x)  # no ONNX symbolic in torch's exporter

    with pytest.raises(QDebugError, match=r"cannot export op aten::special_i1"):
        export_onnx(Odd(), torch.randn(2, 3))


def test_without_onnxruntime_the_cli_says_how_to_install(cli, stages, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    cli("export", stages.calibrated, "-o", "m.onnx").assert_error("onnxruntime", "qdebug[onnx]")


# -- ONNX Runtime's int8 kernels (issue 32 follow-up) --------------------------------------------
DEMO = Path(__file__).resolve().parent.parent / "fixtures" / "demo"
X86 = __import__("platform").machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
COMPUTE = {"Conv": ("QLinearConv",), "Add": ("QLinearAdd",), "Gemm": ("QGemm",)}


def _ort_optimized(proto, tmp_path: Path, name: str):
    """The graph ONNX Runtime runs (CPU provider, default optimizations), as it writes it itself."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / f"{name}.opt.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return onnx.load(options.optimized_model_filepath)


def _without_requantization(proto):
    """``proto`` as qdebug wrote it before ONNX Runtime's fusions were planned for: uint8
    activation pairs back to int8 (zero point - 128) and the pairs after a Flatten removed."""
    from onnx import numpy_helper

    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    graph = copy.graph
    added = [n for n in graph.node if "/Flatten" in n.name and n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    for q in (n for n in added if n.op_type == "QuantizeLinear"):
        dq = next(n for n in added if n.input[0] == q.output[0])
        for node in graph.node:
            node.input[:] = [q.input[0] if v == dq.output[0] else v for v in node.input]
    kept = [n for n in graph.node if n not in added]
    del graph.node[:]
    graph.node.extend(kept)
    for k, tensor in enumerate(graph.initializer):
        if tensor.name.endswith("/zero_point") and tensor.data_type == onnx.TensorProto.UINT8:
            signed = (numpy_helper.to_array(tensor).astype(np.int32) - 128).astype(np.int8)
            graph.initializer[k].CopyFrom(numpy_helper.from_array(signed, tensor.name))
    return copy


@pytest.mark.parametrize("name", ["small_resnet", "demo_mobilenetv2"])
def test_onnx_runtime_runs_every_layer_as_an_int8_kernel(name, tmp_path):
    """Every Conv, Add and Gemm of the export runs as ONNX Runtime's int8 kernel (counted in the
    graph ORT optimized), the parity reports it, and the graph computes what the int8 form did."""
    if name == "small_resnet":
        torch.manual_seed(5)
        cal, batches = _calibrated(ResNet(**SMALL_RESNET), (4, 1, 16, 16), seed=5)
    else:
        from qdebug.data.spec import load_batches

        cal, _ = qdebug.load(DEMO / "calibrated.pt")
        batches = [next(iter(load_batches(str(DEMO / "eval.pt"), batches=1))).inputs[:16]]
    proto, _ = export_onnx(cal, batches[0][:1])
    exported = [n.op_type for n in proto.graph.node]
    producers = {out: n for n in proto.graph.node for out in n.output}
    for gemm in (n for n in proto.graph.node if n.op_type == "Gemm"):  # after the Flatten: its pair
        assert producers[gemm.input[0]].op_type == "DequantizeLinear" and producers[gemm.input[0]].name.endswith(
            "/DequantizeLinear/Flatten")
    fused = [n.op_type for n in _ort_optimized(proto, tmp_path, name).graph.node]
    for op, kernels in COMPUTE.items():
        assert exported.count(op) > 0 and sum(fused.count(k) for k in kernels) == exported.count(op), (op, fused)
        assert op not in fused
    parity = export_parity(proto, convert(cal), batches)
    assert parity["within_1_lsb"] >= 0.99, parity
    assert parity["float_kernels"] == [] and all(k["float"] == 0 for k in parity["kernels"].values())
    assert {op: parity["kernels"][op]["int8"] for op in COMPUTE} == {op: exported.count(op) for op in COMPUTE}
    # The same numbers as the int8 form, with ONNX Runtime's fusions off (each op as ONNX defines it).
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    feed = {"input": batches[0].numpy()}
    plain = [ort.InferenceSession(p.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feed)[0]
             for p in (proto, _without_requantization(proto))]
    assert np.array_equal(plain[0], plain[1])


def test_affine_int8_activations_are_written_as_uint8():
    torch.manual_seed(6)
    cal, batches = _calibrated(ResNet(**SMALL_RESNET), (4, 1, 16, 16), seed=6)
    proto, _ = export_onnx(cal, batches[0][:1])
    init = _initializers(proto)
    for name, point in engine_state(cal).points.items():
        z = init[f"{name}/zero_point"]
        if point.kind == "activation":  # the engine's int8 codes + 128: the same values
            assert z.dtype == np.uint8 and z.astype(np.int32) == int(point.zero_point) + 128, name
        else:
            assert z.dtype == np.int8, name


@pytest.mark.skipif(not X86, reason="ONNX Runtime runs int8 (not only uint8) activations fused off x86")
def test_layers_onnx_runtime_leaves_in_float_are_named(cli, stages, tmp_path):
    """Symmetric int8 activations stay int8 (TensorRT's form): on x86 ONNX Runtime converts a pair
    to uint8 only when one layer reads it, so a residual block's layers stay float -- reported."""
    cal = prepare(ResNet(**SMALL_RESNET).eval(), QConfig(activation=QuantSpec(bits=8, signed=True, symmetric=True)),
                  example_inputs=stages.x)
    calibrate(cal, [stages.x])
    qdebug.save(cal, tmp_path / "sym.pt", stage="calibrated", model_spec=stages.spec, model_kwargs=stages.kwargs,
                sample_inputs=stages.x)
    result = cli("export", tmp_path / "sym.pt", "-o", "sym.onnx", "--format", "json")
    assert result.code == 0, result.err
    out = json.loads(result.out)
    kernels, left = out["meta"]["ort_kernels"], out["meta"]["ort_float_layers"]
    assert kernels["Add"] == {"int8": 0, "float": 2} and "/layer1/layer1.0/Add" in left
    assert out["rows"][0]["ort_float"] == len(left) == sum(k["float"] for k in kernels.values()) > 0
    text = " ".join(cli("export", tmp_path / "sym.pt", "-o", "sym.onnx").out.split())
    assert f"in float ({len(left)}): {left[0]}" in text and "0/2 Add" in text, text


def test_cli_reports_onnx_runtimes_int8_kernels(cli, stages):
    result = cli("export", stages.calibrated, "-o", "m.onnx", "--format", "json")
    assert result.code == 0, result.err
    out = json.loads(result.out)
    proto = read_onnx(Path.cwd() / "m.onnx")
    convs = sum(n.op_type == "Conv" for n in proto.graph.node)
    assert out["meta"]["ort_kernels"]["Conv"] == {"int8": convs, "float": 0} and out["meta"]["ort_float_layers"] == []
    assert out["rows"][0]["ort_float"] == 0 and out["rows"][0]["ort_int8"] == sum(
        k["int8"] for k in out["meta"]["ort_kernels"].values())
    table = cli("export", stages.calibrated, "-o", "m.onnx")
    assert f"ONNX Runtime runs {convs}/{convs} Conv, 1/1 Gemm, 2/2 Add" in " ".join(table.out.split()), table.out
