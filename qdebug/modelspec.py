"""Naming and rebuilding model architectures: ``package.module:Class`` + kwargs.

A checkpoint records its architecture as a spec string and JSON-typed kwargs.
Rebuilding from a *file* is restricted, because a file is not the user: the
named attribute must be an ``nn.Module`` subclass (never a function: ``os:system``
or ``builtins:eval`` are refused before anything is called), and its module
must be qdebug's own zoo, already imported, or trusted by the user (``--model``,
the config's ``model``, or the config's ``trust`` list: ``trust = ["mypkg"]``
trusts ``mypkg`` and ``mypkg.*``, never ``mypkgevil``).  A spec the *user* names
may also be a factory function, since the user chose to run it.

A module the user named or trusted is found from the current directory (and
then the directory of the config file read), as ``python -m`` and pytest's
rootdir find it, when ``sys.path`` does not hold it: no ``PYTHONPATH=.``
needed.  This only locates modules qdebug may import anyway; what a file may
name is decided before.  ``where_raised`` points at the user's line when their
code raises.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.nn as nn

from qdebug.errors import QDebugError

SPEC_ATTR = "qdebug_model"  # set on models built here so save() can record them
ALWAYS_TRUSTED_PREFIXES = ("qdebug.zoo",)


@dataclass(frozen=True)
class ModelSpec:
    target: str  # "package.module:Attr"
    kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"class": self.target, "kwargs": dict(self.kwargs)}

    @classmethod
    def from_dict(cls, data: Any) -> "ModelSpec":
        if isinstance(data, str):
            return cls(data, {})
        if not isinstance(data, dict) or not isinstance(data.get("class"), str):
            raise QDebugError("the checkpoint's model spec is malformed",
                              "expected {'class': 'pkg.module:Class', 'kwargs': {...}}")
        kwargs = data.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise QDebugError("the checkpoint's model kwargs are not a table",
                              "model kwargs are a table, e.g. model_kwargs = {num_classes = 10}")
        return cls(data["class"], dict(kwargs))

    @property
    def module_name(self) -> str:
        return split_target(self.target)[0]


def split_target(target: str) -> tuple[str, str]:
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise QDebugError(f"{target!r} is not of the form package.module:Name", "e.g. qdebug.zoo.resnet:ResNet")
    return module, attr


def is_trusted(module_name: str, trusted: tuple[str, ...] | list[str]) -> bool:
    """``module_name`` is one of ``trusted`` or inside one of them (``mypkg`` trusts ``mypkg.net``)."""
    return any(module_name == p or module_name.startswith(p + ".") for p in trusted)


def resolve(target: str, *, from_user: bool, trusted_modules: tuple[str, ...] = ()) -> Any:
    """The object named by ``target``, with the safety rules of the module docstring."""
    module_name, attr = split_target(target)
    allowed = (
        from_user
        or module_name in sys.modules
        or is_trusted(module_name, tuple(trusted_modules) + ALWAYS_TRUSTED_PREFIXES)
    )
    if not allowed:
        top = module_name.partition(".")[0]
        raise QDebugError(
            f"the checkpoint names model class {target}; qdebug does not import modules named by a file "
            f"unless you trust them, and {top!r} is not trusted",
            f'if you trust it, add  trust = ["{top}"]  to qdebug.toml (qdebug init --trust {top} writes it), '
            f"or pass --model {target}",
        )
    module = import_user_module(module_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise QDebugError(f"{module_name!r} has no attribute {attr!r}", "check the spelling of the model spec")
    if not from_user and not (inspect.isclass(obj) and issubclass(obj, nn.Module)):
        raise QDebugError(
            f"refusing to call {target!r} named by a file: it is not an nn.Module subclass",
            "a checkpoint may only name model classes; pass --model to name a factory yourself",
        )
    return obj


def import_user_module(module_name: str) -> Any:
    """Import a module qdebug may import (named or trusted by the user), found from the
    current directory or the config's when ``sys.path`` lacks it; failures as QDebugErrors."""
    make_findable(module_name)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.partition(".")[0]
        missing = exc.name or top
        if module_name == missing or module_name.startswith(missing + "."):
            searched = ", ".join(str(r) for r in import_roots())
            raise QDebugError(
                f"cannot import {module_name!r}: no module {missing!r} in {searched} or on sys.path",
                f"run qdebug from the directory that holds {top}/ (or {top}.py), or install your package "
                "(pip install -e .)",
            ) from None
        where = where_raised(exc)
        raise QDebugError(
            f"importing {module_name!r} failed: it imports {missing!r}, which is not installed"
            + (f" (at {where})" if where else ""),
            f"install {missing.partition('.')[0]!r} in this environment (python -m pip install ...)",
        ) from exc
    except QDebugError:
        raise
    except Exception as exc:  # a syntax error or an exception while the user's module runs
        where = where_raised(exc)
        raise QDebugError(
            f"importing {module_name!r} raised {type(exc).__name__}: {first_line(exc)}"
            + (f" (at {where})" if where else ""),
            "fix the error in that module (python -c 'import " + module_name + "' shows it too); "
            "--debug shows the traceback",
        ) from exc


def import_roots() -> list[Path]:
    """Where modules the user names are looked for beyond ``sys.path``: the current
    directory (as ``python -m`` puts it first), then the directory of the config file."""
    from qdebug.config import config_root

    roots = [Path.cwd()]
    root = config_root()
    if root is not None and root not in roots:
        roots.append(root)
    return roots


def make_findable(module_name: str) -> bool:
    """Put the import root holding ``module_name``'s top-level package on ``sys.path``
    when nothing on it holds that package.  Returns whether a root was added."""
    top = module_name.partition(".")[0]
    if not top or top in sys.modules:
        return False
    importlib.invalidate_caches()  # a module written since the last import (tests, notebooks) is seen
    try:
        if importlib.util.find_spec(top) is not None:
            return False
    except (ImportError, ValueError):
        return False
    for root in import_roots():
        if (root / top).is_dir() or (root / f"{top}.py").is_file():
            if str(root) not in sys.path:
                # Appended, not prepended: the root adds the user's package without
                # shadowing anything installed that later imports might mean.
                sys.path.append(str(root))
                importlib.invalidate_caches()
            return True
    return False


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (or its type's name)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0].strip()[:200] if lines else type(exc).__name__


def _library_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(qdebug's and torch's directories, those plus the standard library and site-packages)."""
    import torch

    core = {str(Path(__file__).resolve().parent), str(Path(torch.__file__).resolve().parent)}
    every = set(core)
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            every.add(str(Path(path).resolve()))
    return tuple(d + os.sep for d in core), tuple(d + os.sep for d in every)


def where_raised(exc: BaseException) -> str | None:
    """``file:line (code)`` of the innermost frame of ``exc`` in the user's own code -- not
    in qdebug or torch, and preferably not in the standard library or installed packages
    either -- or None."""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f"{shown_path(exc.filename)}:{exc.lineno}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    core, every = _library_dirs()
    for skipped in (every, core):
        for frame in reversed(frames):
            if str(Path(frame.filename).resolve()).startswith(skipped):
                continue
            code = (frame.line or "").strip()
            return f"{shown_path(frame.filename)}:{frame.lineno}" + (f" ({code})" if code else "")
    return None


def shown_path(filename: str) -> str:
    """A path relative to the current directory when it is inside it."""
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return filename


def build(spec: ModelSpec, *, from_user: bool, trusted_modules: tuple[str, ...] = ()) -> nn.Module:
    """Construct the model of ``spec`` and remember the spec on it."""
    factory = resolve(spec.target, from_user=from_user, trusted_modules=trusted_modules)
    if not callable(factory):
        raise QDebugError(f"{spec.target!r} is not callable",
                          "name a class or a function that builds the model, as package.module:Name")
    try:
        model = factory(**spec.kwargs)
    except TypeError as exc:
        raise QDebugError(f"cannot build {spec.target} with kwargs {spec.kwargs}: {exc}",
                          "check the model kwargs") from None
    if not isinstance(model, nn.Module):
        raise QDebugError(f"{spec.target} returned {type(model).__name__}, not an nn.Module",
                          "the factory must return the model itself (an nn.Module)")
    remember(model, spec)
    return model


def remember(model: nn.Module, spec: ModelSpec) -> nn.Module:
    object.__setattr__(model, SPEC_ATTR, spec)
    return model


def spec_of(model: nn.Module) -> ModelSpec:
    """The spec recorded on ``model``, or its class path with no kwargs."""
    spec = getattr(model, SPEC_ATTR, None)
    if isinstance(spec, ModelSpec):
        return spec
    cls = type(model)  # a prepared model is still an instance of the user's class
    if cls.__module__ == "__main__":
        raise QDebugError(
            f"model class {cls.__qualname__} is defined in __main__, so no other process can rebuild it",
            "move it into an importable module, or pass model_spec='package.module:Class'",
        )
    return ModelSpec(f"{cls.__module__}:{cls.__qualname__}", {})


def build_zoo(name: str, **kwargs: Any) -> nn.Module:
    """Build a ``qdebug.zoo`` model by short name (resnet, mobilenetv2, ...), recording its spec."""
    from qdebug import zoo

    if name not in zoo.MODELS:
        raise QDebugError(f"unknown zoo model {name!r}", f"choose one of {', '.join(zoo.MODELS)}")
    cls = zoo.MODELS[name]
    return build(ModelSpec(f"{cls.__module__}:{cls.__qualname__}", kwargs), from_user=True)
