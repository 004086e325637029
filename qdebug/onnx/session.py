"""ONNX Runtime sessions, made one way: ``cpu_session``.

Every ONNX Runtime session qdebug makes (the export's check, the compare stage, the import's
self-check) runs a checked model's bytes -- never a path a file names -- on the CPU execution
provider with the default graph optimizations (the fusions a deployment runs), ONNX Runtime's own
warnings off (unused initializers and the like are not the user's concern).  A model ONNX Runtime
refuses is one ``QDebugError`` with its first line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qdebug.errors import QDebugError
from qdebug.onnx.model_file import first_line, require


def cpu_session(proto: Any, what: str, hint: str, *, threads: int | None = None,
                optimized_path: str | Path | None = None, disabled_optimizers: list[str] | None = None) -> Any:
    """An ONNX Runtime session on the model ``proto`` (module docstring).  ``what`` names the model in
    the error ("the exported model", a file's path), ``hint`` says what to do; ``optimized_path``:
    where ONNX Runtime writes the graph it optimized (the one it runs); ``disabled_optimizers``:
    optimizers to leave out."""
    ort = require("onnxruntime")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads is not None:
        options.intra_op_num_threads = max(threads, 1)
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    extra = {"disabled_optimizers": disabled_optimizers} if disabled_optimizers else {}
    try:
        return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"], **extra)
    except Exception as exc:  # a graph ONNX Runtime's optimizer or kernels do not take
        raise QDebugError(f"ONNX Runtime cannot load {what}: {first_line(exc)}", hint) from None
