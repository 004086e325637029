"""Naming and rebuilding model architectures: ``package.module:Class`` + kwargs.

A checkpoint records its architecture as a spec string and JSON-typed kwargs.
Rebuilding from a *file* is restricted, because a file is not the user: the
named attribute must be an ``nn.Module`` subclass (never a function: ``os:system``
or ``builtins:eval`` are refused before anything is called), and its module
must be qdebug's own zoo, already imported, or trusted by the user (``--model``,
the config's ``model``, or the config's ``trust`` list: ``trust = ["mypkg"]``
trusts ``mypkg`` and ``mypkg.*``, never ``mypkgevil``).  A spec the *user* names
may also be a factory function, since the user chose to run it.

A file's spec is also bounded: its kwargs are JSON-typed (None, bool, int, float, str,
lists, tables with string keys; at most ``KWARGS_NODES`` values, ``KWARGS_DEPTH`` deep),
and ``build_meta`` builds the model on the meta device -- every tensor factory sent there,
whatever device the code asks for -- so its size can be checked against the file's state
before any memory is allocated (``qdebug.checkpoint``).

Importing what is allowed, and naming the user's line when it raises, is
``qdebug.usercode``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch.nn as nn

from qdebug.errors import QDebugError
from qdebug.usercode import first_line, import_user_module, where_raised

SPEC_ATTR = "qdebug_model"  # set on models built here so save() can record them
ALWAYS_TRUSTED_PREFIXES = ("qdebug.zoo",)
KWARGS_NODES = 10_000  # values in a file's model kwargs, all levels together
KWARGS_DEPTH = 32


@dataclass(frozen=True)
class ModelSpec:
    target: str  # "package.module:Attr"
    kwargs: dict[str, Any] = field(default_factory=dict)

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
            raise QDebugError(f"{module_name!r} has no attribute {attr!r}", f"check the spelling of the {what}")
    if not from_user and not (inspect.isclass(obj) and issubclass(obj, nn.Module)):
        raise QDebugError(
            f"refusing to call {target!r} named by a file: it is not an nn.Module subclass",
            "a checkpoint may only name model classes; pass --model to name a factory yourself",
        )
    return obj


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
    except Exception:  # data-dependent construction: no meta build (a real one reports real errors)
        return None
    return model if isinstance(model, nn.Module) else None


@contextlib.contextmanager
def _on_meta(max_modules: int) -> Iterator[None]:
    """Every tensor factory call lands on the meta device; registrations are counted."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors

    constructors = _device_constructors()
    count = [0]

    class OnMeta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in constructors:
                kwargs["device"] = "meta"
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
        raise QDebugError(f"cannot build {spec.target} with kwargs {spec.kwargs}: {exc}",
                          "check the model kwargs") from None
    except Exception as exc:  # the constructor refused its kwargs (ValueError, RuntimeError, ...)
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
