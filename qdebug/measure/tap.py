"""Hook every layer of any model (float or prepared), name every call, stream what passes.

``tap(model, listener)`` runs a listener on every value call of the model's
forward passes -- module calls, inline ops, model inputs -- with the engine's
names (``layer1.0.add#2``), whether the model is a plain float model or a
prepared/quantized one.  Tools never hook modules themselves.

``Capture`` records one forward's outputs (and inputs) by call name: the
reference side of a comparison.  Only one batch is held at a time.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from qdebug.engine import engine_state, is_prepared
from qdebug.engine.context import Call, Event, ForwardContext, active_context, open_contexts, release_aborted
from qdebug.engine.ops import map_tensors, tensors_in


@contextlib.contextmanager
def tap(model: nn.Module, listener: Callable[[Event], None]) -> Iterator[None]:
    """While active, ``listener`` sees every value call of ``model``'s forward passes."""
    own = getattr(type(model), "qdebug_tap", None)
    if own is not None:  # a model that reports its calls itself (``qdebug.interop.torch_stage``)
        with own(model, listener):
            yield
        return
    depth = open_contexts()
    if is_prepared(model):
        state = engine_state(model)
        state.listeners.append(listener)
        try:
            yield
        finally:
            state.listeners.remove(listener)
            release_aborted(depth)  # a forward aborted inside the block left its context open
        return
    # A plain model: wrap its forward in a naming context for the duration.
    handles = []

    def pre_hook(module, args, kwargs):
        if active_context() is not None and active_context().root is module:
            return None
        ctx = ForwardContext(module, listeners=[listener])
        contexts[:] = [c for c in contexts if not c.closed]  # aborted forwards' (release_aborted)
        ctx.__enter__()
        contexts.append(ctx)
        return ctx.process_inputs(args, kwargs)

    def post_hook(module, args, kwargs, output):
        ctx = contexts.pop()
        try:
            if output is not None:
                output = ctx.process_output(output)
        finally:
            ctx.__exit__(None, None, None)
        return output

    contexts: list[ForwardContext] = []
    handles.append(model.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True))
    handles.append(model.register_forward_hook(post_hook, with_kwargs=True, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        release_aborted(depth)  # a forward aborted inside the block left its context open


class ReportsCalls:
    """What a model that runs outside the engine and reports its own calls shares (a converted
    model run by torch's kernels, ``qdebug.interop.torch_stage``; an ONNX model run by ONNX
    Runtime, ``qdebug.onnx.stage``): ``tap`` finds ``qdebug_tap`` on it, and each forward reports
    the rows it tapped with ``_emit``, as the engine reports its calls.  ``_calls`` maps a row to
    its call's (category, op, owner); ``_listeners`` are the taps listening now."""

    _calls: dict[str, tuple[str, str, str]]
    _listeners: list[Callable[[Event], None]]

    def _emit(self, row: str, y: torch.Tensor) -> None:
        category, op, owner = self._calls[row]
        base, _, index = row.partition("#")
        call = Call(row, base, int(index) if index.isdigit() else 1, category, op, owner)
        event = Event(call, (), {}, None, None, y)
        for listener in list(self._listeners):
            listener(event)

    @contextlib.contextmanager
    def qdebug_tap(self, listener: Callable[[Event], None]) -> Iterator[None]:
        """``qdebug.measure.tap``'s entry for this model: ``listener`` sees each forward's tapped rows."""
        self._listeners.append(listener)
        try:
            yield
        finally:
            self._listeners.remove(listener)


@dataclass
class Record:
    name: str
    op: str
    category: str
    inputs: tuple  # detached clones of the call's args (for isolated replays)
    kwargs: dict
    output: Any
    func: Callable | None = None  # the torch function of an inline op (None for modules and inputs)
    module: nn.Module | None = None  # the module called (None for inline ops and inputs)


@dataclass
class Capture:
    """Outputs (and inputs) of one forward, by call name, in execution order.

    Everything recorded is a copy: a later in-place op (``ReLU(inplace=True)``)
    must not rewrite it.  A call's input is usually an earlier call's output,
    unchanged since: that copy is reused rather than made twice.  The copies of
    one forward are written into the buffers of the previous one when shapes
    agree, so after the first batch recording allocates nothing (no page faults,
    no heap fragmentation): records are valid until the next ``clear()``;
    ``release()`` drops the buffers.

    With ``hold``, a value is recorded as the tensor itself, kept alive, unless an
    earlier forward saw that slot written in place after it was recorded: a copy
    costs a read and a write of every output, as much as the statistics' own pass.
    ``settle()`` after the forward checks every held tensor's version counter (any
    in-place op moves it); a held value that was written is marked for copying, and
    the caller runs that forward again.
    """

    keep_inputs: bool | Callable[[Event], bool] = True  # or per call: whether to keep its inputs
    hold: bool = False
    records: dict[str, Record] = field(default_factory=dict)
    # (slot, the held tensor, its version when recorded), this forward
    _held: list = field(default_factory=list, repr=False)
    # slots seen written in place after they were recorded: copied from then on
    _written: set = field(default_factory=set, repr=False)
    # id(original) -> (weak reference to it, its version when copied, the copy)
    _copies: dict[int, tuple] = field(default_factory=dict, repr=False)
    # (call name, part, index) -> the buffer that slot was copied into last time
    _buffers: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    def __call__(self, event: Event) -> None:
        call = event.call
        name = call.name
        keep = self.keep_inputs(event) if callable(self.keep_inputs) else self.keep_inputs
        self.records[name] = Record(
            name,
            call.op,
            call.category,
            self._copies_of(event.args, (name, "args")) if keep else (),
            self._copies_of(event.kwargs, (name, "kwargs")) if keep else {},
            self._copies_of(event.out, (name, "out")),
            event.func,
            call.module,
        )

    def _copies_of(self, obj: Any, slot: tuple) -> Any:
        index = itertools.count()
        return map_tensors(obj, lambda t: self._copy(t, (*slot, next(index))))

    def _copy(self, t: torch.Tensor, slot: tuple) -> torch.Tensor:
        version = _version(t)
        entry = self._copies.get(id(t))
        if entry is not None and version is not None:
            ref, then, copy = entry
            if ref() is t and version == then:  # the same tensor, not modified in place since
                return copy
        if self.hold and slot not in self._written and version is not None:
            held = t.detach()  # the same storage and version counter
            self._held.append((slot, held, version))
            self._copies[id(t)] = (weakref.ref(t), version, held)
            return held
        buffer = self._buffers.get(slot)
        if buffer is not None and buffer.shape == t.shape and buffer.dtype == t.dtype and buffer.device == t.device:
            copy = buffer.copy_(t.detach())
        else:
            copy = self._buffers[slot] = t.detach().clone()
        self._copies[id(t)] = (weakref.ref(t), version, copy)
        return copy

    def settle(self) -> bool:
        """After a forward with ``hold``: True when no held value was written in place since it
        was recorded.  Otherwise those slots are copied from now on, and the records are not
        the forward's values: run it again."""
        written = {slot for slot, held, version in self._held if held._version != version}
        self._written |= written
        return not written

    def clear(self) -> None:
        """Forget the records (their buffers are reused by the next forward)."""
        self.records.clear()
        self._copies.clear()
        self._held.clear()

    def release(self) -> None:
        """Forget the records and free the buffers."""
        self.clear()
        self._buffers.clear()


def _version(t: torch.Tensor) -> int | None:
    """The tensor's version counter (moved by every in-place op), None for an inference tensor,
    which keeps none: it is copied every time, never reused or held."""
    try:
        return t._version
    except RuntimeError:
        return None


def first_tensor(obj: Any) -> torch.Tensor | None:
    found = [t for t in tensors_in(obj) if torch.is_floating_point(t)]
    return found[0] if found else None
