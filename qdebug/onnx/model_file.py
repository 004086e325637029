"""Reading an ONNX file as data: ``read_onnx`` and ``tensor_array``.

An ONNX file is a protobuf message: parsing it runs no code.  What a file from someone else can
still do is point outside itself or ask for memory it does not hold, so ``read_onnx``

- reads a regular file of at most ``MAX_BYTES`` (protobuf's own 2 GiB limit) and nothing else:
  *external data* (a tensor whose bytes live in another file, named by the model) is refused,
  never followed -- a path in a file must not choose what qdebug reads;
- parses it and runs ``onnx.checker`` (shallow: types, opsets, graph structure), whose first
  complaint becomes the error;

and ``tensor_array`` turns an initializer into an array only after checking that the bytes it
holds are the bytes its shape declares (a tensor claiming 10^12 elements with 4 bytes of data is
refused, not allocated).

Every failure is one ``QDebugError`` naming the file.  ``onnx`` is imported here, when an ONNX
file is read: ``require`` says how to install it when it is missing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from qdebug.errors import QDebugError, message_of
from qdebug.safe_text import one_line

MAX_BYTES = 2**31 - 1  # protobuf cannot parse a larger message
INSTALL_HINT = 'pip install "qdebug[onnx]" (onnx and onnxruntime)'


def require(package: str = "onnx") -> Any:
    """The module ``package`` (``onnx`` or ``onnxruntime``), or one error saying how to install it."""
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise QDebugError(f"ONNX support needs the {package} package, which is not installed ({exc})",
                          INSTALL_HINT) from None


def is_onnx_path(path: str | Path) -> bool:
    """Whether ``path`` names an ONNX file (by its suffix: what the command line goes by)."""
    return str(path).lower().endswith(".onnx")


def read_onnx(path: str | Path) -> Any:
    """The ``onnx.ModelProto`` in ``path``, checked (module docstring)."""
    onnx = require("onnx")
    file = Path(path)
    if not file.exists():
        raise QDebugError(f"no such file: {_short(str(file))}", "check the path")
    if not file.is_file():
        raise QDebugError(f"{_short(str(file))} is not a regular file", "pass an .onnx model file")
    size = file.stat().st_size
    if size > MAX_BYTES:
        raise QDebugError(f"{_short(str(file))} is {size / 2**30:.1f} GiB, more than an ONNX file can hold "
                          "(2 GiB)", "a larger model keeps its weights as external data, which is never read")
    if size == 0:
        raise QDebugError(f"{_short(str(file))} is empty", "pass an .onnx model file")
    data = file.read_bytes()
    try:
        model = onnx.load_model_from_string(data)
    except Exception as exc:  # protobuf's DecodeError and friends: the file is not a model
        raise QDebugError(f"{_short(str(file))} is not an ONNX model ({first_line(exc)})",
                          "pass a file written by torch.onnx.export, qdebug export or onnx.save") from None
    if not model.HasField("graph"):
        raise QDebugError(f"{_short(str(file))} holds no ONNX graph", "pass a file written by torch.onnx.export, "
                          "qdebug export or onnx.save")
    external = _external_tensor(model.graph)
    if external is not None:
        raise QDebugError(f"{_short(str(file))}: tensor {_short(external)} keeps its data in another file "
                          "(external data), never followed",
                          "save the model with its data inside: onnx.save(model, path, "
                          "save_as_external_data=False)")
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise QDebugError(f"{_short(str(file))} is not a valid ONNX model: {first_line(exc)}",
                          "re-export it (torch.onnx.export), or check it with onnx.checker.check_model") from None
    return model


def first_line(exc: BaseException) -> str:
    """An exception's first line, escaped and at most 300 characters (its type when it says nothing)."""
    lines = message_of(exc).strip().splitlines()
    return one_line(lines[0], limit=300) if lines else type(exc).__name__


def _short(text: str) -> str:
    """A name or path from the file, bounded (the error line escapes it on the way out)."""
    return one_line(text, limit=300)


def _graphs(graph: Any):
    """``graph`` and every subgraph of its nodes' attributes (If, Loop, Scan bodies)."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield from _graphs(attribute.g)
            for sub in attribute.graphs:
                yield from _graphs(sub)


def _tensors(graph: Any):
    """Every TensorProto a graph (and its subgraphs) holds: initializers, sparse initializers'
    values and indices, and tensors in node attributes (Constant's ``value``)."""
    for g in _graphs(graph):
        yield from g.initializer
        for sparse in g.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in g.node:
            for attribute in node.attribute:
                if attribute.HasField("t"):
                    yield attribute.t
                yield from attribute.tensors


def _external_tensor(graph: Any) -> str | None:
    """The name of the first tensor whose data is stored in another file, else None."""
    from onnx import TensorProto

    for tensor in _tensors(graph):
        if tensor.data_location == TensorProto.EXTERNAL or len(tensor.external_data):
            return tensor.name or "<unnamed>"
    return None


def tensor_array(tensor: Any) -> Any:
    """A TensorProto as a numpy array, after checking its bytes match its declared shape."""
    import numpy as np

    onnx = require("onnx")
    from onnx import helper, numpy_helper

    name = _short(tensor.name or "<unnamed>")
    if any(d < 0 for d in tensor.dims):
        raise QDebugError(f"ONNX tensor {name} has a negative dimension {list(tensor.dims)}",
                          "the file is damaged: re-export it")
    count = math.prod(tensor.dims)
    try:
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    except Exception:
        raise QDebugError(f"ONNX tensor {name} has data type {tensor.data_type}, which qdebug does not read",
                          "quantization parameters and weights are float, int8/uint8/int16/uint16 or int32") from None
    if tensor.HasField("raw_data"):
        held = len(tensor.raw_data) // max(np.dtype(dtype).itemsize, 1)
    else:
        field = helper.tensor_dtype_to_field(tensor.data_type)
        held = len(getattr(tensor, field))
    if held != count:
        raise QDebugError(f"ONNX tensor {name} declares shape {list(tensor.dims)} ({count} values) but holds "
                          f"{held}", "the file is damaged: re-export it")
    del onnx
    return numpy_helper.to_array(tensor)
