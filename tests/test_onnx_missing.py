"""Without the [onnx] extra, every ONNX route is one error saying how to install it -- checked
whether or not onnx is installed here (its import is made to fail), so this file never skips."""

from __future__ import annotations

import sys

import pytest

DEMO = "fixtures/demo"


@pytest.fixture
def no_onnx(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx -> ImportError
    monkeypatch.setitem(sys.modules, "onnxruntime", None)


@pytest.mark.parametrize("command", [
    ["export", f"{DEMO}/calibrated.pt", "-o", "m.onnx"],
    ["compare", f"{DEMO}/float.pt", f"{DEMO}/calibrated.pt", "model.onnx", "--data", f"{DEMO}/eval.pt", "--batches", "1"],
    ["import", "model.onnx", "--from", "onnx-qdq", "--model", "qdebug.zoo.mobilenetv2:MobileNetV2", "--data", "random:2x1x28x28",
     "-o", "x.pt"],
])
def test_each_onnx_route_says_how_to_install_the_extra(cli, no_onnx, tmp_path, command):
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    args = [str(root / a) if a.startswith(DEMO) else a for a in command]
    (tmp_path / "model.onnx").write_bytes(b"\x08\x07")  # exists: the missing package is the error
    cli(*args).assert_error("qdebug[onnx]")
    assert not (tmp_path / "m.onnx").exists() and not (tmp_path / "x.pt").exists()
