"""Importing an ORT-quantized QDQ model: ``import_qdq``, the file read (``qdq_source``), built by the
interop builder, converted to ONNX Runtime's arithmetic and held to the file (``qdq_check``).

The two halves meet only here, so neither imports the other.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from qdebug.onnx.qdq_check import check_against_ort, mark_float_layers
from qdebug.onnx.qdq_source import NODES_ATTR, read_qdq, tensor_nodes


def import_qdq(model: Any, float_model: nn.Module, example_inputs: Any, *, check: bool = True) -> nn.Module:
    """The engine model (quantized stage, ONNX Runtime's ``float32`` arithmetic) of an ORT-quantized
    QDQ ``model``: ``read_qdq``, the interop builder, ``qdebug.engine.convert``, the layers ORT runs
    in float marked (``mark_float_layers``); its report is ``qdebug.interop.import_report``.
    ``check``: run ONNX Runtime on the file and the import on ``example_inputs`` and compare
    (``check_against_ort``; the result is ``qdebug.interop.import_check``)."""
    from qdebug.engine import convert, engine_state
    from qdebug.interop.build import REPORT_ATTR, build

    source, plan, bias_rows, tensors = read_qdq(model, float_model, example_inputs)
    # ONNX Runtime's own arithmetic (float32 requantization, its add and pooling kernels): the
    # quantized stage computes what the file computes there, bit for bit where ORT fuses a layer.
    imported = convert(build(source, plan), arithmetic="float32")
    state = engine_state(imported)
    setattr(state, REPORT_ATTR, list(getattr(state, REPORT_ATTR, None) or []) + bias_rows)
    mark_float_layers(model, imported, tensors)
    setattr(state, NODES_ATTR, tensor_nodes(model))
    if check:
        check_against_ort(model, imported, example_inputs)
    return imported
