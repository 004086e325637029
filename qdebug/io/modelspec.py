"""Naming and rebuilding model architectures: ``package.module:Class`` + kwargs.

A checkpoint records its architecture as a spec string and JSON-typed kwargs.
Rebuilding from a *file* is restricted, because a file is not the user: the
named attribute must be an ``nn.Module`` subclass (never a function: ``os:system``
or ``builtins:eval`` are refused before anything is called), and its module
must be qdebug's own zoo, already imported, or trusted by the user (``--model``,
the config's ``model``, or the config's ``trust`` list: ``trust = ["mypkg"]``
trusts ``mypkg`` and ``mypkg.*``, never ``mypkgevil``).  A file's spec is looked up
without running code (no module ``__getattr__``, no lazy submodule import), and a refusal's
hint names ``--model`` with the file's name only when that name's source defines a class.
A spec the *user* names may also be a factory function, since the user chose to run it --
with the user's own kwargs only, never the file's (``qdebug.checkpoint.load``).

A file's spec is also bounded: its kwargs are JSON-typed (None, bool, int, float, str,
lists, tables with string keys; at most ``KWARGS_NODES`` values, ``KWARGS_DEPTH`` deep),
and ``build_meta`` builds the model on the meta device -- every tensor factory sent there,
whatever device the code asks for -- so its size can be checked against the file's state
before any memory is allocated (``qdebug.checkpoint``).

Importing what is allowed, and naming the user's line when it raises, is
``qdebug.io.usercode``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch.nn as nn

from qdebug.errors import QDebugError, first_line, shown
from qdebug.io.usercode import import_user_module, raised_by_user_code, where_raised

SPEC_ATTR = "qdebug_model"  # set on models built here so save() can record them
ALWAYS_TRUSTED_PREFIXES = ("qdebug.zoo",)
KWARGS_NODES = 10_000  # values in a file's model kwargs, all levels together
KWARGS_DEPTH = 32


@dataclass(frozen=True)
class ModelSpec:
    target: str  # "package.module:Attr"
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:  # the Python API's callers may pass anything
        if not isinstance(self.target, str):
            raise QDebugError(f"a model is named as a string, got {shown(self.target)}",
                              'e.g. model="mypkg.models:Net"')
        if not isinstance(self.kwargs, dict):
            raise QDebugError(f"model kwargs must be a dict, got {shown(self.kwargs)}",
                              'e.g. model_kwargs={"num_classes": 10}')

    def to_dict(self) -> dict[str, Any]:
        return {"class": self.target, "kwargs": dict(self.kwargs)}

    @classmethod
    def from_dict(cls, data: Any) -> "ModelSpec":
        """The spec a checkpoint records, checked: a class string and JSON-typed kwargs."""
        if isinstance(data, str):
            return cls(data, {})
        if not isinstance(data, dict) or not isinstance(data.get("class"), str):
            raise QDebugError("the checkpoint's model spec is malformed",
                              "expected {'class': 'pkg.module:Class', 'kwargs': {...}}")
        kwargs = data.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise QDebugError("the checkpoint's model kwargs are not a table",
                              "model kwargs are a table, e.g. model_kwargs = {num_classes = 10}")
        check_json_kwargs(kwargs)
        return cls(data["class"], dict(kwargs))

    @property
    def module_name(self) -> str:
        return split_target(self.target)[0]


def check_json_kwargs(kwargs: dict) -> None:
    """Refuse model kwargs a file could not have meant: anything but JSON-typed values, keys
    that are not strings, more than KWARGS_NODES values or KWARGS_DEPTH levels (shared
    references count each time: a pickle can nest them exponentially)."""
    hint = "the file is damaged or not from qdebug.save; or name the model yourself with --model"
    todo: list[tuple[str, Any, int]] = [("", kwargs, 0)]
    seen = 0
    while todo:
        where, value, depth = todo.pop()
        seen += 1
        if seen > KWARGS_NODES or depth > KWARGS_DEPTH:
            raise QDebugError(f"the checkpoint's model kwargs are too large (over {KWARGS_NODES} values or "
                              f"{KWARGS_DEPTH} levels deep)", hint)
        if value is None or isinstance(value, (bool, int, float, str)):
            continue
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise QDebugError(f"the checkpoint's model kwargs have a key {key!r} that is not a string", hint)
                todo.append((f"{where}.{key}" if where else key, item, depth + 1))
        elif isinstance(value, (list, tuple)):
            todo.extend((f"{where}[{i}]", item, depth + 1) for i, item in enumerate(value[: KWARGS_NODES + 1]))
        else:
            raise QDebugError(f"the checkpoint's model kwarg {where!r} is a {type(value).__name__}; model kwargs "
                              "are numbers, strings, lists and tables", hint)


def parse_model_kwargs(text: str, flag: str = "--model-kwargs") -> dict[str, Any]:
    """``--model-kwargs`` text as a table: a JSON object (``{"num_classes": 10}``) or a TOML
    inline table (``{num_classes = 10}``, the config's ``model_kwargs`` syntax)."""
    import json
    import tomllib

    hint = f"e.g. {flag} '{{\"num_classes\": 10}}' (JSON) or {flag} '{{num_classes = 10}}' (TOML)"
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        try:
            value = tomllib.loads(f"kwargs = {text}")["kwargs"]
        except (tomllib.TOMLDecodeError, RecursionError, KeyError):
            raise QDebugError(f"{flag} {text[:80]!r} is neither a JSON object nor a TOML inline table", hint) from None
    if not isinstance(value, dict):
        raise QDebugError(f"{flag} {text[:80]!r} is not a table of keyword arguments", hint)
    try:
        check_json_kwargs(value)
    except QDebugError as exc:
        message = exc.message.replace("the checkpoint's model kwargs", flag).replace("the checkpoint's model kwarg",
                                                                                       f"{flag}'s")
        raise QDebugError(message, hint) from None
    return value


def split_target(target: str) -> tuple[str, str]:
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise QDebugError(f"{target!r} is not of the form package.module:Name", "e.g. qdebug.zoo.resnet:ResNet")
    return module, attr


def is_trusted(module_name: str, trusted: tuple[str, ...] | list[str]) -> bool:
    """``module_name`` is one of ``trusted`` or inside one of them (``mypkg`` trusts ``mypkg.net``)."""
    return any(module_name == p or module_name.startswith(p + ".") for p in trusted)


def resolve(target: str, *, from_user: bool, trusted_modules: tuple[str, ...] = (), what: str = "model spec") -> Any:
    """The object named by ``target``, with the safety rules of the module docstring.
    ``what`` names the spec in messages ("model spec", "metric")."""
    module_name, attr = split_target(target)
    if from_user:
        return _getattr_path(import_user_module(module_name), module_name, attr, what)
    trusted = is_trusted(module_name, tuple(trusted_modules) + ALWAYS_TRUSTED_PREFIXES)
    if not trusted and module_name not in sys.modules:
        raise _untrusted(target, module_name, attr)
    module = import_user_module(module_name) if trusted else sys.modules[module_name]
    obj = _static_attr_path(module, module_name, attr)
    if not (inspect.isclass(obj) and issubclass(obj, nn.Module)):
        raise QDebugError(
            f"refusing to call {target!r} named by a file: it is not an nn.Module subclass",
            f"a checkpoint may only name model classes; {FACTORY_HINT}",
        )
    return obj


def _getattr_path(module: Any, module_name: str, attr: str, what: str) -> Any:
    """``module.attr`` (dotted) for a name the user gave: an ordinary getattr walk."""
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise QDebugError(f"{module_name!r} has no attribute {attr!r}", f"check the spelling of the {what}")
    return obj


def _static_attr_path(module: Any, module_name: str, attr: str) -> Any:
    """``module.attr`` (dotted) for a name a *file* gave, looked up without running code: in the
    module's ``__dict__`` and classes' own dicts (``inspect.getattr_static``), never a module's
    ``__getattr__`` -- ``torch:_dynamo.OptimizedModule`` would import ``torch._dynamo`` (and
    ``torch._inductor``) that way -- and only through modules already imported."""
    obj = module
    walked = module_name
    for part in attr.split("."):
        try:
            found = vars(obj)[part] if inspect.ismodule(obj) else inspect.getattr_static(obj, part)
        except (KeyError, AttributeError, TypeError):
            raise QDebugError(
                f"the checkpoint names {module_name}:{attr}, but {walked!r} defines no {part!r} "
                "(qdebug does not import modules a file names lazily)",
                "a checkpoint names a model class where it is defined, as package.module:Class",
            ) from None
        if inspect.ismodule(found) and sys.modules.get(found.__name__) is not found:
            raise QDebugError(f"the checkpoint names {module_name}:{attr}, through module {found.__name__!r}, "
                              "which is not imported", "a checkpoint names a model class where it is defined, "
                              "as package.module:Class")
        obj = found
        walked = f"{walked}.{part}"
    return obj


def _untrusted(target: str, module_name: str, attr: str) -> QDebugError:
    """The refusal of a file naming a module nobody trusted.  Its hint suggests trusting the
    package, and ``--model`` with the file's name only when that module's source (read, not
    run) defines a class of that name: never a function (``pty:spawn``), whose call with the
    user's say-so the hint must not invite."""
    top = module_name.partition(".")[0]
    if top in sys.stdlib_module_names:
        return QDebugError(f"the checkpoint names {target}, in the standard library, which holds no model classes",
                           "the file is damaged or crafted; load only checkpoints saved by qdebug.save from "
                           "sources you trust")
    if _top_level_kind(module_name, attr) == "function":
        # A factory (qdebug import --model pkg.mod:factory writes one): trusting its package
        # would not make qdebug call it; naming it yourself does.  The hint names no function.
        return QDebugError(
            f"the checkpoint names {target}, a function, not a model class; qdebug calls a factory only "
            "when you name it yourself",
            FACTORY_HINT,
        )
    also = f", or pass --model {target}" if suggestable(module_name, attr) else ""
    return QDebugError(
        f"the checkpoint names model class {target}; qdebug does not import modules named by a file "
        f"unless you trust them, and {top!r} is not trusted",
        f'if you trust it, add  trust = ["{top}"]  to qdebug.toml (qdebug init --trust {top} writes it){also}',
    )


FACTORY_HINT = ("if it is your factory, pass --model package.module:function with its --model-kwargs, or set "
                "model = and model_kwargs = in qdebug.toml (a factory gets your kwargs only, never the file's)")


SOURCE_LIMIT = 4 << 20  # bytes of a module's source read to find a class name in it


def _defines_class(module_name: str, attr: str) -> bool:
    """Whether the source of ``module_name`` -- found as an import would find it, but read with
    ``ast``, never imported -- defines a top-level class ``attr`` with base classes."""
    return _top_level_kind(module_name, attr) == "class"


def _top_level_kind(module_name: str, attr: str) -> str | None:
    """"class" (with base classes) or "function" when the source of ``module_name`` (found as
    an import would find it, read with ``ast``, never imported) defines a top-level ``attr`` so."""
    if "." in attr:
        return None
    import ast
    from importlib.machinery import PathFinder

    from qdebug.io.usercode import import_roots

    search: Any = [*sys.path, *(str(root) for root in import_roots())]
    parts = module_name.split(".")
    try:
        for i in range(len(parts)):
            spec = PathFinder.find_spec(".".join(parts[: i + 1]), search)
            if spec is None:
                return None
            search = spec.submodule_search_locations
            if search is None and i < len(parts) - 1:
                return None
        if not spec.origin or not spec.origin.endswith(".py"):
            return None
        with open(spec.origin, "rb") as fh:
            tree = ast.parse(fh.read(SOURCE_LIMIT + 1)[:SOURCE_LIMIT])
    except (ImportError, OSError, SyntaxError, ValueError, RecursionError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == attr and node.bases:
            return "class"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == attr:
            return "function"
    return None


def suggestable(module_name: str, attr: str) -> bool:
    """Whether a hint may tell the user to pass ``--model module_name:attr``, a name read from a
    file: only when it is no standard-library name and its module's source (read, never run)
    defines a class of that name -- never a function (``posix:system``, ``pty:spawn``)."""
    return module_name.partition(".")[0] not in sys.stdlib_module_names and _defines_class(module_name, attr)


def is_model_class(target: str) -> bool:
    """Whether ``target``, a name the user gave (``--model``), is an ``nn.Module`` subclass: the
    one kind of name a checkpoint's own kwargs may go to (``qdebug.checkpoint.load``).  A
    factory function gets the user's kwargs only."""
    obj = resolve(target, from_user=True)
    return inspect.isclass(obj) and issubclass(obj, nn.Module)


def build(spec: ModelSpec, *, from_user: bool, trusted_modules: tuple[str, ...] = ()) -> nn.Module:
    """Construct the model of ``spec`` and remember the spec on it."""
    model = _construct(spec, _factory(spec, from_user, trusted_modules))
    remember(model, spec)
    return model


class _TooLarge(BaseException):
    """Raised inside a constructor run by ``build_meta`` when the model outgrows its budget
    (a BaseException: a constructor's own ``except Exception`` does not swallow it)."""


def build_meta(spec: ModelSpec, *, from_user: bool, trusted_modules: tuple[str, ...] = (),
               max_modules: int) -> nn.Module | None:
    """The model of ``spec`` built on the meta device: its tensors have shapes and dtypes but no
    memory, whatever device its code asks for.  A constructor that registers more than
    ``max_modules`` modules, parameters and buffers is stopped as it goes (QDebugError).
    None when the constructor cannot run on meta (it reads tensor values, e.g. ``.item()``):
    the caller then has no size to check before building it for real."""
    factory = _factory(spec, from_user, trusted_modules)
    try:
        with _on_meta(max_modules):
            # Not _construct: it turns every failure into a QDebugError, and a constructor that
            # cannot run on meta (one loading pretrained weights) is no error: the real build follows.
            model = factory(**spec.kwargs)
    except _TooLarge:
        raise QDebugError(
            f"model {spec.target} with the kwargs the checkpoint names has over {max_modules} modules and tensors, "
            "far more than the file's state holds",
            "the file is damaged or crafted: its model kwargs do not fit its weights",
        ) from None
    except QDebugError:
        raise
    except BaseException as exc:  # data-dependent construction: no meta build (a real one reports real errors)
        if not raised_by_user_code(exc):  # Ctrl-C
            raise
        return None
    return model if isinstance(model, nn.Module) else None


@contextlib.contextmanager
def _on_meta(max_modules: int) -> Iterator[None]:
    """Every tensor factory call lands on the meta device; registrations are counted."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors

    constructors = _device_constructors()
    fills = _random_fills()
    count = [0]

    class OnMeta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in constructors:
                kwargs["device"] = "meta"
            elif func in fills:
                target = args[0] if args else kwargs.get("tensor")  # nn.init.normal_ passes tensor=
                if isinstance(target, torch.Tensor) and target.is_meta:
                    return target  # a meta tensor has no values to fill (see _random_fills)
            return func(*args, **kwargs)

    def counted(*_args: Any) -> None:
        count[0] += 1
        if count[0] > max_modules:
            raise _TooLarge

    from torch.nn.modules import module as torch_module

    handles = [torch_module.register_module_module_registration_hook(counted),
               torch_module.register_module_parameter_registration_hook(counted),
               torch_module.register_module_buffer_registration_hook(counted)]
    try:
        with OnMeta():
            yield
    finally:
        for handle in handles:
            handle.remove()


def _random_fills() -> frozenset:
    """The in-place fills whose meta kernels are torch's Python references, which import
    torch._dynamo on first use (1-4 s): ``nn.init.kaiming_normal_``, ``nn.Embedding`` and
    every other ``normal_`` in a constructor would pay it on each checkpoint load.  On a meta
    tensor they change nothing but values it does not have, so ``_on_meta`` skips them; a
    fill with bad arguments (a negative std) still fails in the real build that follows."""
    import torch

    init = torch.nn.init  # its functions reach the mode themselves: what they call inside does not
    return frozenset({torch.Tensor.normal_, torch.Tensor.exponential_, torch.Tensor.log_normal_,
                      torch.Tensor.cauchy_, torch.Tensor.geometric_, init.normal_, init.xavier_normal_,
                      init.kaiming_normal_})


def _factory(spec: ModelSpec, from_user: bool, trusted_modules: tuple[str, ...]) -> Any:
    factory = resolve(spec.target, from_user=from_user, trusted_modules=trusted_modules)
    if not callable(factory):
        raise QDebugError(f"{spec.target!r} is not callable",
                          "name a class or a function that builds the model, as package.module:Name")
    return factory


def _construct(spec: ModelSpec, factory: Any) -> nn.Module:
    try:
        model = factory(**spec.kwargs)
    except (QDebugError, _TooLarge):
        raise
    except TypeError as exc:
        raise QDebugError(f"cannot build {spec.target} with kwargs {spec.kwargs}: {first_line(exc)}",
                          "check the model kwargs (--model-kwargs, or model_kwargs in qdebug.toml)") from None
    except BaseException as exc:  # the constructor refused its kwargs (ValueError, RuntimeError, ...)
        if not raised_by_user_code(exc):
            raise
        where = where_raised(exc)
        raise QDebugError(
            f"cannot build {spec.target} with kwargs {spec.kwargs}: {type(exc).__name__}: {first_line(exc)}"
            + (f" (at {where})" if where else ""),
            "check the model kwargs",
        ) from None
    if not isinstance(model, nn.Module):
        raise QDebugError(f"{spec.target} returned {type(model).__name__}, not an nn.Module",
                          "the factory must return the model itself (an nn.Module)")
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
