"""The quantized stage's ``float32`` arithmetic is ONNX Runtime's: checked against ORT's own integer
kernels (QLinearConv, QLinearMatMul) fed the same codes, in graphs written here with onnx.helper --
not against qdebug's export, and not against qdebug itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from onnx_helpers import onnx, ort  # noqa: F401  (skips without the [onnx] extra)
from qdebug.engine import calibrate, convert, engine_state, prepare
from qdebug.engine.integer import codes


def _conv_model(seed: int, ties: bool) -> tuple[nn.Module, torch.Tensor]:
    """A calibrated conv pair.  ``ties``: scales of powers of two, M = s_in s_w / s_out = 2^-5, so
    every accumulator = 16 (mod 32) is an exact tie -- where fixed point (half away from zero) and
    ONNX Runtime (half to even) part."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 4, 1)).eval()
    x = torch.randn(4, 8, 12, 12)
    calibrated = calibrate(prepare(net, example_inputs=x), [x, torch.randn(4, 8, 12, 12)])
    if ties:
        state = engine_state(calibrated)
        state.points["input"].set_qparams(torch.tensor(2.0**-5), torch.tensor(0))
        weight = state.points["0.weight"]
        weight.set_qparams(torch.full((16,), 2.0**-7), torch.zeros(16, dtype=torch.int32))
        weight.freeze(True)
        state.points["0"].set_qparams(torch.tensor(2.0**-7), torch.tensor(-3))
    return calibrated, x


def _qlinearconv(layer, in_point, out_point) -> bytes:
    """One QLinearConv with the layer's codes, int32 bias and qparams, as ORT's quantizer writes it."""
    from onnx import TensorProto, helper, numpy_helper

    w_point = layer.weight_point
    s_in, s_w = in_point.scale.detach().double(), w_point.scale.detach().double()
    bias = torch.round(layer.bias.detach().double() / (s_in * s_w)).to(torch.int32)
    w_codes = (layer.weight_codes().to(torch.int64) + w_point.zero_point.reshape(-1, 1, 1, 1)).to(torch.int8)
    inits = [
        numpy_helper.from_array(in_point.scale.detach().numpy().astype(np.float32), "x_scale"),
        numpy_helper.from_array(in_point.zero_point.numpy().astype(np.int8), "x_zp"),
        numpy_helper.from_array(w_codes.numpy(), "w"),
        numpy_helper.from_array(w_point.scale.detach().numpy().astype(np.float32), "w_scale"),
        numpy_helper.from_array(w_point.zero_point.numpy().astype(np.int8), "w_zp"),
        numpy_helper.from_array(out_point.scale.detach().numpy().astype(np.float32), "y_scale"),
        numpy_helper.from_array(out_point.zero_point.numpy().astype(np.int8), "y_zp"),
        numpy_helper.from_array(bias.numpy(), "b"),
    ]
    node = helper.make_node("QLinearConv", ["x", "x_scale", "x_zp", "w", "w_scale", "w_zp", "y_scale", "y_zp", "b"],
                            ["y"], pads=list(layer.padding) * 2, strides=list(layer.stride))
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", TensorProto.INT8, None)],
                              [helper.make_tensor_value_info("y", TensorProto.INT8, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()


@pytest.mark.parametrize("ties", [True, False])
def test_float32_arithmetic_is_onnx_runtimes_qlinearconv_bit_for_bit(ties):
    calibrated, x = _conv_model(0, ties)
    session = {}
    mismatches = {}
    for arithmetic in ("float32", "fixed_point"):
        quantized = convert(calibrated, arithmetic=arithmetic)
        layer = quantized[0]
        qstate = engine_state(quantized)
        q_in, q_out = qstate.points["input"], qstate.points["0"]
        captured = {}
        handle = layer.register_forward_hook(lambda m, args, out: captured.update(x=args[0], y=out))
        with torch.no_grad():
            quantized(x)
        handle.remove()
        x_codes = (codes(captured["x"], q_in).to(torch.int64) + int(q_in.zero_point)).to(torch.int8)
        ours = codes(captured["y"], q_out).to(torch.int64) + int(q_out.zero_point)
        if "ort" not in session:
            session["ort"] = ort.InferenceSession(_qlinearconv(layer, q_in, q_out), providers=["CPUExecutionProvider"])
        theirs = torch.from_numpy(session["ort"].run(None, {"x": x_codes.numpy()})[0]).to(torch.int64)
        mismatches[arithmetic] = int((ours != theirs).sum())
    assert mismatches["float32"] == 0
    if ties:  # the test can fail: fixed point rounds a tie away from zero, ORT to even
        assert mismatches["fixed_point"] > 0


def test_the_arithmetic_survives_save_and_load(tmp_path):
    import qdebug

    calibrated, info = qdebug.load("fixtures/demo/calibrated.pt")
    quantized = convert(calibrated, arithmetic="float32")
    qdebug.save(quantized, tmp_path / "q.pt", stage="quantized", model_spec=info.model,
                sample_inputs=info.sample_inputs)
    loaded, _ = qdebug.load(tmp_path / "q.pt")
    assert engine_state(loaded).arithmetic == "float32"
    x = info.sample_inputs
    with torch.no_grad():
        assert torch.equal(loaded(x), quantized(x))
    assert engine_state(convert(calibrated)).arithmetic == "fixed_point"


def test_an_unknown_arithmetic_is_one_error(cli, tmp_path):
    from pathlib import Path

    from qdebug.errors import QDebugError

    calibrated, _ = _conv_model(0, ties=False)
    with pytest.raises(QDebugError, match="unknown arithmetic"):
        convert(calibrated, arithmetic="float64")
    demo = Path(__file__).resolve().parents[1] / "fixtures" / "demo" / "qat.pt"
    cli("convert", demo, "-o", tmp_path / "q.pt", "--arithmetic", "float64").assert_error(
        "not one of fixed_point, float32")
    assert not (tmp_path / "q.pt").exists()


# -- element-wise kernels and the input's quantization, against ORT's own nodes --------------------------


def _ort_node(op: str, inputs: list[tuple[str, np.ndarray]], params: list[tuple[str, object, type]],
              domain: str = "", **attributes) -> np.ndarray:
    """ONNX Runtime's ``op`` on ``inputs`` (name, uint8/float array) with constant ``params``."""
    from onnx import TensorProto, helper, numpy_helper

    kind = {np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.float32): TensorProto.FLOAT}
    inits = [numpy_helper.from_array(np.array(v, dtype=t), n) for n, v, t in params]
    names = [n for n, _ in inputs] + [n for n, _, _ in params]
    order = {"QLinearAdd": ["a", "sa", "za", "b", "sb", "zb", "sc", "zc"],
             "QLinearGlobalAveragePool": ["x", "sx", "zx", "sy", "zy"], "QuantizeLinear": ["x", "sy", "zy"]}[op]
    assert sorted(order) == sorted(names)
    node = helper.make_node(op, order, ["y"], domain=domain, **attributes)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, kind[v.dtype], v.shape) for n, v in inputs],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, None)], inits)
    opsets = [helper.make_opsetid("", 13)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    session = ort.InferenceSession(helper.make_model(graph, opset_imports=opsets).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, dict(inputs))[0].astype(np.int64)


class _Add(nn.Module):
    def forward(self, a, b):
        return a + b


def _quantized_add(scales, zero_points):
    """``a + b`` converted in float32 with these qparams (asymmetric int8 points: ORT stores them as
    uint8, zero point + 128)."""
    a = torch.randn(2, 8)
    prepared = calibrate(prepare(_Add(), example_inputs=(a, a)), [(a, a)])
    state = engine_state(prepared)
    for name, s, z in zip(("input", "input#2", "add"), scales, zero_points):
        state.points[name].set_qparams(torch.tensor(s), torch.tensor(z - 128))
    return convert(prepared, arithmetic="float32"), state


@pytest.mark.parametrize("scales, zero_points, codes_ab, expected", [
    # Met in torchvision's MobileNetV2 (features.16.add of qdebug's export): 136.5 plus one float32 ulp
    # where a plain multiply-then-add gives exactly 136.5 and rounds to even, 136 -- ORT gives 137.
    ((0.0624510757625103, 0.04306953027844429, 0.07082371413707733), (137, 127, 132), ((109, 175),), (137,)),
    # Met in its ORT QUInt8 import (features.13.add): only z_y - fma(r_a, z_a, r_b z_b) gives ORT's 135,
    # and only fma(q_a, r_a, fma(q_b, r_b, .)) -- b first -- its 93.
    ((0.06617016345262527, 0.05502394214272499, 0.07904686778783798), (123, 140, 123), ((170, 100), (131, 88)),
     (135, 93)),
])
def test_float32_add_is_onnx_runtimes_qlinearadd_ties_included(scales, zero_points, codes_ab, expected):
    quantized, _ = _quantized_add(scales, zero_points)
    rng = np.random.default_rng(0)
    a = np.concatenate([[p[0] for p in codes_ab], rng.integers(0, 256, 200_000)]).astype(np.uint8)
    b = np.concatenate([[p[1] for p in codes_ab], rng.integers(0, 256, 200_000)]).astype(np.uint8)
    values = [torch.from_numpy((v.astype(np.float32) - z) * np.float32(s)) for v, s, z in zip((a, b), scales, zero_points)]
    with torch.no_grad():
        ours = torch.round(quantized(*values) / torch.tensor(scales[2], dtype=torch.float32)).to(torch.int64)
    ours = ours + zero_points[2]
    params = [("sa", scales[0], np.float32), ("za", zero_points[0], np.uint8), ("sb", scales[1], np.float32),
              ("zb", zero_points[1], np.uint8), ("sc", scales[2], np.float32), ("zc", zero_points[2], np.uint8)]
    theirs = _ort_node("QLinearAdd", [("a", a), ("b", b)], params, domain="com.microsoft")
    assert tuple(int(v) for v in theirs[:len(expected)]) == expected
    assert (ours.numpy() == theirs).all()


class _Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        return self.pool(x)


def test_float32_global_average_is_onnx_runtimes_qlinearglobalaveragepool():
    # s_x / (s_y * 4) = 1/4 exactly: every sum = 2 (mod 4) is a tie, rounded to even as ORT does.
    x = torch.randn(2, 8, 2, 2)
    prepared = calibrate(prepare(_Pool(), example_inputs=x), [x])
    state = engine_state(prepared)
    state.points["input"].set_qparams(torch.tensor(2.0**-4), torch.tensor(-128 + 3))
    state.points["pool"].set_qparams(torch.tensor(2.0**-4), torch.tensor(-128 + 77))
    quantized = convert(prepared, arithmetic="float32")
    rng = np.random.default_rng(1)
    codes_u8 = rng.integers(0, 256, (64, 32, 2, 2)).astype(np.uint8)
    x = torch.from_numpy((codes_u8.astype(np.float32) - 3) * np.float32(2.0**-4))
    with torch.no_grad():
        ours = (torch.round(quantized(x) / 2.0**-4).to(torch.int64) + 77).reshape(64, 32)
    params = [("sx", 2.0**-4, np.float32), ("zx", 3, np.uint8), ("sy", 2.0**-4, np.float32), ("zy", 77, np.uint8)]
    theirs = _ort_node("QLinearGlobalAveragePool", [("x", codes_u8)], params, domain="com.microsoft",
                       channels_last=0).reshape(64, 32)
    sums = codes_u8.astype(np.int64).reshape(64, 32, 4).sum(-1)
    assert ((sums % 4) == 2).any()  # ties are there
    assert (ours.numpy() == theirs).all()


def test_float32_stage_quantizes_its_input_as_onnx_runtimes_quantizelinear():
    """ORT's QuantizeLinear divides by the scale; x * (1/s) -- torch's kernel -- rounds a few values
    per million the other way (-6.47394990921 at s = 0.0371)."""
    s = 0.0371
    rng = np.random.default_rng(0)
    x = np.concatenate([[-6.473949909210205], rng.normal(0, 3, 400_000)]).astype(np.float32)
    prepared = calibrate(prepare(nn.Identity(), example_inputs=torch.zeros(4)), [torch.zeros(4)])
    engine_state(prepared).points["input"].set_qparams(torch.tensor(s), torch.tensor(-128 + 250))
    quantized = convert(prepared, arithmetic="float32")
    with torch.no_grad():
        ours = torch.round(quantized(torch.from_numpy(x)) / torch.tensor(s, dtype=torch.float32)).to(torch.int64) + 250
    theirs = _ort_node("QuantizeLinear", [("x", x)], [("sy", s, np.float32), ("zy", 250, np.uint8)])
    assert (ours.numpy() == theirs).all()
    fixed = convert(prepared)  # torch's own kernel's rounding: the test can fail
    with torch.no_grad():
        other = torch.round(fixed(torch.from_numpy(x[:1])) / torch.tensor(s, dtype=torch.float32)).to(torch.int64) + 250
    assert int(other[0]) != int(theirs[0])
