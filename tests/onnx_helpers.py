"""What the ONNX tests share: the skip when onnx/onnxruntime are missing, torch's own export of a
float model, and ONNX Runtime's own static quantization of it (QDQ) -- the user's route that
qdebug imports and compares, made by the real tools, never by hand."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Iterable

import pytest
import torch
import torch.nn as nn

onnx = pytest.importorskip("onnx", reason="the ONNX tests need the [onnx] extra (onnx, onnxruntime)")
ort = pytest.importorskip("onnxruntime", reason="the ONNX tests need the [onnx] extra (onnx, onnxruntime)")


def torch_export(model: nn.Module, example: torch.Tensor, path: Path, opset: int = 13) -> Path:
    """``model`` (float, eval) exported by torch's TorchScript exporter, input ``input``, batch axis free."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (example,), str(path), dynamo=False, opset_version=opset,
                          input_names=["input"], output_names=["output"],
                          dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
    return path


def ort_quantize(float_onnx: Path, out: Path, batches: Iterable[torch.Tensor], *, per_channel: bool = True,
                 activation_type: str = "QInt8", weight_type: str = "QInt8", symmetric_activations: bool = False,
                 **extra_options: Any) -> Path:
    """ONNX Runtime's ``quantize_static`` (QDQ format, MinMax calibration) of ``float_onnx`` on
    ``batches``: the model an engineer ships through ONNX Runtime."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"input": b.numpy()} for b in batches])

        def get_next(self):
            return next(self.batches, None)

    options = {"ActivationSymmetric": symmetric_activations, **extra_options}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_static(str(float_onnx), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                        activation_type=getattr(QuantType, activation_type), weight_type=getattr(QuantType, weight_type),
                        extra_options=options)
    return out


def run_ort(path: Path, x: torch.Tensor) -> torch.Tensor:
    """ONNX Runtime's CPU execution provider on ``x`` (default graph optimizations: as deployed)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return torch.from_numpy(session.run(None, {name: x.numpy()})[0])
