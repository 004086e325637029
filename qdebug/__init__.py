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

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from importlib import import_module

from qdebug.errors import QDebugError

_LAZY = {"load": "qdebug.api", "save": "qdebug.checkpoint", "compare": "qdebug.api", "step": "qdebug.api",
         "suggest": "qdebug.api", "nan_trace": "qdebug.tools.nan.guard", "NonFiniteError": "qdebug.tools.nan.detect",
         "from_torch_ao": "qdebug.interop", "watch": "qdebug.tools.watch.timeline"}

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


# -- the old homes of modules that moved into packages (0.1: docs/architecture.md) ---------
# ``import qdebug.metrics``, ``--metric qdebug.metrics:top1`` and ``python -m qdebug.launch`` keep
# working: each old name gives the module at its new place (the same module object).
MOVED = {
    "qdebug.torchfile": "qdebug.io.torchfile", "qdebug.usercode": "qdebug.io.usercode",
    "qdebug.modelspec": "qdebug.io.modelspec", "qdebug.atomic": "qdebug.io.atomic",
    "qdebug.staged": "qdebug.io.staged", "qdebug.together": "qdebug.io.together",
    "qdebug.leftovers": "qdebug.io.leftovers", "qdebug.config_edit": "qdebug.config.edit",
    "qdebug.device": "qdebug.config.device", "qdebug.distributed": "qdebug.config.distributed",
    "qdebug.batch_source": "qdebug.data.source", "qdebug.data_file": "qdebug.data.file",
    "qdebug.metrics": "qdebug.data.metrics", "qdebug.tap": "qdebug.measure.tap", "qdebug.stats": "qdebug.measure.stats",
    "qdebug.early_exit": "qdebug.cli.early_exit", "qdebug.launch": "qdebug.cli.launch",
    "qdebug.tools.nan_watch": "qdebug.tools.nan.detect", "qdebug.tools.nan_causes": "qdebug.tools.nan.causes",
    "qdebug.tools.nan_guard": "qdebug.tools.nan.guard", "qdebug.tools.nan_trace": "qdebug.tools.nan.trace",
    "qdebug.tools.qat_watch": "qdebug.tools.watch.timeline", "qdebug.tools.qat_rules": "qdebug.tools.watch.rules",
    "qdebug.tools.watch_run": "qdebug.tools.watch.run",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name of ``MOVED`` and loads it as the module at its new place."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        real = importlib.util.find_spec(new)
        return importlib.util.spec_from_loader(fullname, self, origin=real.origin if real else None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import system stamps the alias's spec on it next
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state  # it keeps its own

    def get_code(self, fullname: str) -> types.CodeType | None:
        """What ``python -m OLD`` runs: the new module's code (runpy asks the loader for it)."""
        real = importlib.util.find_spec(MOVED[fullname])
        return real.loader.get_code(real.name)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
