"""qdebug: precision debugging for quantized PyTorch models.

Python API (the CLI is a thin layer over the same functions):

    import qdebug
    model, info = qdebug.load("qat.pt")          # any of the four stages, safely; reads qdebug.toml
    qdebug.save(model, "calibrated.pt", stage="calibrated")
    frame = qdebug.compare("float.pt", "qat.pt", data="eval.pt")   # per-layer DataFrame
    fixed, report = qdebug.fix(model, batches)   # equalization, bias correction..., each proven
    steps = qdebug.step("float.pt", "calibrated.pt", mode="drill", metric="top1", data="eval.pt")
    with qdebug.nan_trace(model) as trace:       # your own loop: raises qdebug.NonFiniteError at the first NaN/Inf
        ...; trace.step(loss)
    with qdebug.watch(model, float_model=fm) as w:   # a QAT run's timeline: w.findings (oscillation, BN drift...)
        ...; w.step(loss)

``import qdebug`` is cheap: torch and pandas load when one of these names is first used.
"""

from __future__ import annotations

from importlib import import_module

from qdebug.errors import QDebugError

_LAZY = {"load": "qdebug.api", "save": "qdebug.checkpoint", "compare": "qdebug.api", "step": "qdebug.api",
         "suggest": "qdebug.api", "nan_trace": "qdebug.tools.nan_guard", "NonFiniteError": "qdebug.tools.nan_watch",
         "from_torch_ao": "qdebug.interop", "watch": "qdebug.tools.qat_watch"}

__all__ = ["load", "save", "compare", "step", "suggest", "fix", "nan_trace", "NonFiniteError", "from_torch_ao", "watch",
           "QDebugError", "__version__"]


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("qdebug")
    except Exception:  # not installed (a source tree on sys.path)
        return "0+unknown"


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value  # resolved once
        return value
    if name == "fix":  # the package of the fixes, callable (qdebug/fix/__init__.py)
        return import_module("qdebug.fix")
    if name == "__version__":
        globals()["__version__"] = value = _version()
        return value
    raise AttributeError(f"module 'qdebug' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
