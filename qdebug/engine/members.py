"""Member tensors of a call's output: one quant point per tensor of a structured output.

A call (a leaf module, an inline op) whose output holds two or more floating tensors
-- a tuple, a list, a dict, nested: ``nn.LSTM``'s ``(output, (h_n, c_n))``,
``torch.std_mean``'s ``(std, mean)`` -- gets one quant point per floating tensor: the
tensors mean different things and have ranges of their own (an LSTM's hidden state
lies in ±1, its cell state may reach ±160), so no scale is shared between them.

A member is named by its path in the output structure, ``<call>:<path>``: the path's
components are joined by "." and are a position for a tuple or list (a named tuple
too) and, for a dict, its key when the key is a str identifier, else its position
among the dict's items.  So ``lstm:0``, ``lstm:1.0``, ``lstm:1.1``; the second call of
a shared module gives ``lstm#2:1.1``; ``head:logits`` for a dict output.  ":" never
appears in a call name the engine makes (module paths and op names), and the path
neither holds ":" nor starts a "#", so a name splits back into its call and member.

Non-floating members (indices, masks, None, ints) get no point, and a call whose
output holds a single floating tensor -- however nested: ``topk``'s
``(values, indices)`` -- keeps the bare call name, as every call did before.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

SEPARATOR = ":"
# One member path: components (a position or an identifier key) joined by ".".
_PATH = re.compile(r"(?:[0-9]+|[A-Za-z_][A-Za-z0-9_]*)(?:\.(?:[0-9]+|[A-Za-z_][A-Za-z0-9_]*))*")
# How deep a structure is walked for members: deeper nesting is one opaque value (no point).
MAX_DEPTH = 16


def is_member_path(path: Any) -> bool:
    return isinstance(path, str) and _PATH.fullmatch(path) is not None


def _key_component(key: Any, position: int) -> str:
    return key if isinstance(key, str) and key.isidentifier() and key.isascii() else str(position)


def _walk(obj: Any, prefix: str, depth: int, visit: Callable[[str, torch.Tensor], torch.Tensor | None],
          rebuild: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        if torch.is_floating_point(obj):
            out = visit(prefix, obj)
            return out if rebuild else None
        return obj
    if depth >= MAX_DEPTH:
        return obj

    def child(component: str, value: Any) -> Any:
        return _walk(value, f"{prefix}.{component}" if prefix else component, depth + 1, visit, rebuild)

    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple: by position
        items = [child(str(i), v) for i, v in enumerate(obj)]
        return type(obj)(*items) if rebuild else None
    if isinstance(obj, (list, tuple)):
        items = [child(str(i), v) for i, v in enumerate(obj)]
        return type(obj)(items) if rebuild else None
    if isinstance(obj, dict):
        items = [(k, child(_key_component(k, i), v)) for i, (k, v) in enumerate(obj.items())]
        return type(obj)(items) if rebuild else None
    return obj


def floating_members(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) of every floating tensor in ``obj``, in order ("" for a bare tensor)."""
    found: list[tuple[str, torch.Tensor]] = []

    def visit(path: str, t: torch.Tensor) -> None:
        found.append((path, t))

    _walk(obj, "", 0, visit, rebuild=False)
    return found


def member_paths(obj: Any) -> list[str]:
    """The member paths of an output that gets one point per tensor; [] when it holds at
    most one floating tensor (its call keeps one point, under the bare call name)."""
    found = floating_members(obj)
    return [path for path, _ in found] if len(found) > 1 else []


def map_members(obj: Any, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with each floating tensor replaced by ``fn(path, tensor)``, structure kept."""
    return _walk(obj, "", 0, fn, rebuild=True)


def member_name(call: str, path: str) -> str:
    """The quant point (and compare row) name of member ``path`` of call ``call``."""
    return f"{call}{SEPARATOR}{path}" if path else call


def split_name(name: str) -> tuple[str, str]:
    """(call, member path) of a point or row name; the path is "" for a bare call name."""
    call, sep, path = name.rpartition(SEPARATOR)
    if sep and call and is_member_path(path):
        return call, path
    return name, ""


def named_members(call: str, obj: Any) -> list[tuple[str, str, torch.Tensor]]:
    """(name, path, tensor) per point-worthy tensor of a call's output: one entry named
    ``call`` when the output holds one floating tensor, else one per member."""
    found = floating_members(obj)
    if len(found) == 1:
        return [(call, "", found[0][1])]
    return [(member_name(call, path), path, t) for path, t in found]


def member_at(obj: Any, path: str) -> torch.Tensor | None:
    """The floating tensor at ``path`` of ``obj`` ("" for the first floating tensor), or None."""
    for found_path, t in floating_members(obj):
        if found_path == path or not path:
            return t
    return None
