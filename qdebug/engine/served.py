"""Served calls: outputs a forward takes from an earlier run instead of computing them.

A prepared model holds ``state.served`` (None normally).  While it is set, each
named value call -- a leaf module call or an inline op -- whose name it knows
returns the stored output: a module's ``forward`` is not run, an inline op's
function is not called.  The engine's treatment of the output still runs (the
call's quant point, listeners), so a served call looks like a computed one to
everything downstream.

This is how experiments resume from cached activations: every call *before*
the first quant point whose mode differs from the earlier run computes exactly
what that run computed (same function, same parameters, same inputs), so its
stored output is bit-identical to a recomputation.  Deciding which calls those
are is the caller's job (``qdebug.tools.experiment``); the engine only serves.

Leaf passthrough modules (a stem's max-pool, which costs more than a small conv)
are served too; their outputs reach a recording through
``ForwardContext.on_passthrough_call``, as no listener sees them.  Model inputs,
inline passthrough ops (reshape, flatten) and fallback ops are always computed:
they are cheap, and fallbacks are only recognised after they ran.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch
import torch.nn as nn

from qdebug.engine.context import active_context
from qdebug.engine.module_tree import kept_index
from qdebug.engine.ops import map_tensors
from qdebug.engine.state import engine_state

class ServedCalls:
    """Stored outputs by call name.  ``clone``: names whose output a later call writes in
    place, served as fresh copies so the stored value survives for the next forward."""

    def __init__(self, outputs: Mapping[str, Any], clone: frozenset[str] | set[str] = frozenset()):
        self.outputs = outputs
        self.clone = clone
        self.served = 0  # calls served since creation (for tests and benchmarks)

    def take(self, name: str) -> Any:
        """The stored output of call ``name``, or None when it is not served."""
        out = self.outputs.get(name)
        if out is None:
            return None
        self.served += 1
        return map_tensors(out, torch.clone) if name in self.clone else out


def _serving_forward(module: nn.Module, original):
    def forward(*args, **kwargs):
        ctx = active_context()
        served = getattr(ctx, "served", None)
        if served is not None and not ctx.busy and ctx.frames:
            frame = ctx.frames[-1]
            if frame.kind == "leaf" and frame.call is not None and frame.call.module is module:
                out = served.take(frame.call.name)
                if out is not None:
                    return out
        return original(*args, **kwargs)

    return forward


@contextlib.contextmanager
def serving(model: nn.Module, served: ServedCalls | None) -> Iterator[None]:
    """While active, ``model``'s forwards take the outputs ``served`` knows (see module docstring)."""
    state = engine_state(model)
    if served is None:
        yield
        return
    patched = []
    # The index the model's forwards keep: walking a deep model's tree on every trial's every
    # batch cost ~1 ms a forward at 64 px (7% of step's sweep).
    for module in kept_index(state, model).call_modules():
        if "forward" in module.__dict__:
            continue
        module.__dict__["forward"] = _serving_forward(module, module.forward)
        patched.append(module)
    state.served = served
    try:
        yield
    finally:
        state.served = None
        for module in patched:
            module.__dict__.pop("forward", None)
