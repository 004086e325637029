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
