"""``ForwardContext``: names every layer call and inline op of one forward pass.

While a model runs inside a context, two interceptors are active:

- global module hooks see every ``nn.Module`` call.  A module the engine knows
  (``ops.module_category``) is one *call*; a container only scopes the inline ops
  written in its ``forward``;
- a ``TorchFunctionMode`` sees every torch function and tensor method, so
  ``x + y``, ``torch.cat``, ``F.relu`` and ``x.mean()`` written inline in a
  container become calls too -- no model rewrite, and eager models that FX
  cannot trace work the same.

Call names follow the module tree: a module call is its path (``layer1.0.conv1``),
an inline op is ``<container path>.<op>`` (``layer1.0.add``), a model input is
``input``; the k-th call of the same name in one forward gets ``#k``
(``layer1.0.relu#2``).  An inline op never takes a module's name: where the model has a
module at ``<container path>.<op>`` (torchvision's ``self.relu`` beside the ``F.relu`` its
``add_relu`` FloatFunctional runs), the op is ``<container path>.<op>()``
(``layer1.0.relu()``), so it cannot pass for that module's next call.  The tensors of a call
returning several are named by their place in the output, ``lstm:1.1``
(``qdebug.engine.members``).  A norm-act layer (timm's
``BatchNormAct2d``: batch_norm, then ``self.drop``, then ``self.act``; ``ops.is_norm_act``) is a
container whose norm function call is the layer's own call (``blocks.0.bn1``, a ``bn``) and whose
children are calls of their own (``blocks.0.bn1.act``); an ``nn.Identity`` child is none.  A
``Handler`` decides what happens at each call (record a graph, quantize, tap for statistics);
the context itself only names.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

try:  # private helpers of torch.overrides (present since torch 2.0); without them listeners run slower
    from torch.overrides import _get_current_function_mode as _current_mode, _pop_mode, _push_mode
except ImportError:  # pragma: no cover
    _current_mode = _pop_mode = _push_mode = None

from qdebug.engine.module_tree import TreeIndex
from qdebug.engine.ops import (
    NORM_FUNCTIONS,
    canonical_op_name,
    function_category,
    map_tensors,
    module_category,
    norm_only,
    tensors_in,
)


# torch functions a forward the engine names computes in parts (each part a call of its own):
# func -> decompose(ctx, *args, **kwargs).  Registered by the module owning the decomposition
# (``qdebug.engine.sdpa``, loaded with the engine), which sits above this one.
_DECOMPOSITIONS: dict[Callable, Callable[..., Any]] = {}


def register_decomposition(func: Callable, decompose: Callable[..., Any]) -> None:
    """Inside a named forward, a call of ``func`` runs ``decompose(ctx, *args, **kwargs)`` instead."""
    _DECOMPOSITIONS[func] = decompose


@dataclass
class Call:
    """One named call in a forward pass."""

    name: str  # unique in the forward: "layer1.0.relu#2"
    base: str  # without the call index: "layer1.0.relu"
    index: int  # 1-based call index of ``base``
    category: str  # see qdebug.engine.ops
    op: str  # module class name, or function name for inline ops
    owner: str  # module path of the module called, or of the container of an inline op
    module: nn.Module | None = None


class Handler:
    """What to do at each call.  The default handler only computes (naming only).

    A handler that changes outputs sets ``last_raw`` to the output before its change,
    so listeners can see both.
    """

    last_raw: Any = None

    def on_input(self, ctx: "ForwardContext", call: Call, x: torch.Tensor) -> torch.Tensor:
        return x

    def before_module(self, ctx: "ForwardContext", call: Call, module: nn.Module, args: tuple) -> None:
        pass

    def on_module_output(self, ctx: "ForwardContext", call: Call, module: nn.Module, args: tuple, output: Any) -> Any:
        return output

    def on_op(self, ctx: "ForwardContext", call: Call, func: Callable, args: tuple, kwargs: dict) -> Any:
        return func(*args, **kwargs)

    def on_fallback(self, ctx: "ForwardContext", call: Call, func: Callable, args: tuple, output: Any) -> Any:
        return output

    def on_float_output(self, ctx: "ForwardContext", call: Call, output: Any) -> Any:
        """What happens to a call's output computed in float elsewhere (its quant point, if any)."""
        return output

    def on_passthrough(self, ctx: "ForwardContext", func: Callable | None, args: tuple, output: Any) -> Any:
        return output

    def on_untracked(self, args: tuple, kwargs: dict, output: Any) -> None:
        """An op whose result is no activation (integers, masks, creation ops, parameters only):
        no call, no point -- the trace follows what it was made from (``qdebug.engine.plan``)."""

    def on_model_output(self, ctx: "ForwardContext", output: Any) -> Any:
        return output


@dataclass
class Event:
    """What a listener sees of one value call (tools such as compare attach here)."""

    call: Call
    args: tuple
    kwargs: dict
    func: Callable | None  # the torch function of an inline op; None for modules and inputs
    raw: Any  # the output before the handler changed it (e.g. before the quant point)
    out: Any  # the output that flows on

    @property
    def inputs(self) -> list[torch.Tensor]:
        return tensors_in((self.args, self.kwargs))


Listener = Callable[[Event], None]

_local = threading.local()


def active_context() -> "ForwardContext | None":
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def open_contexts() -> int:
    """How many forwards are in progress in this thread (contexts entered, not yet left)."""
    return len(getattr(_local, "stack", None) or [])


def release_aborted(depth: int = 0) -> None:
    """Leave the contexts entered after the first ``depth`` ones: forwards that a BaseException
    (SystemExit, KeyboardInterrupt, a timeout) aborted.

    torch runs ``always_call`` forward hooks on ``Exception`` only, so the root hook that
    leaves a context never ran, and its naming mode would stay on torch's mode stack, seeing
    every later torch call of the process.  A context is left only while it is torch's
    current mode: one with another mode above it is not this code's to unwind.
    """
    stack = getattr(_local, "stack", None) or []
    while len(stack) > depth:
        ctx = stack[-1]
        if _current_mode is not None and _current_mode() is not ctx:
            break
        ctx.__exit__(None, None, None)


@dataclass
class _Frame:
    kind: str  # "container" | "leaf" | "skip"
    name: str = ""
    call: Call | None = None


class ForwardContext(TorchFunctionMode):
    """Names calls of ``root``'s forward and routes them to ``handler`` (see module docstring)."""

    def __init__(self, root: nn.Module, handler: Handler | None = None, listeners: list[Listener] | None = None,
                 tree: TreeIndex | None = None):
        super().__init__()
        self.root = root
        self.handler = handler or Handler()
        self.listeners = list(listeners or [])
        # ``tree``: the caller's index of ``root``'s tree, checked by the caller (a prepared
        # model keeps one between forwards); else one walk now.
        self.tree = tree if tree is not None else TreeIndex(root)
        self.module_names = self.tree.module_names
        self.module_paths = self.tree.module_paths
        self.norm_acts = self.tree.norm_acts
        self.silent = self.tree.silent
        self.counts: dict[str, int] = defaultdict(int)
        self.frames: list[_Frame] = [_Frame("container", "")]
        self.leaf_depth = 0
        self.busy = 0  # >0 while engine code runs: its own torch calls are not the model's
        self.served = None  # qdebug.engine.served.ServedCalls: outputs taken instead of computed
        # Called with (call, output) after each passthrough module call (max-pool, flatten...):
        # no listener sees those, but a recording of the run for ``served`` needs them.
        self.on_passthrough_call: Callable[[Call, Any], None] | None = None
        # The passthrough module call being handled (handlers' on_passthrough read its name): a
        # view some importers re-quantize on a grid of its own (``qdebug.interop``).
        self.view_call: Call | None = None
        self._handles: list[Any] = []
        self.closed = False

    # -- entering / leaving --------------------------------------------------------
    def __enter__(self):
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(self)
        self._handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._pre_hook),
            torch.nn.modules.module.register_module_forward_hook(self._post_hook, always_call=True),
        ]
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        _local.stack.remove(self)
        self.closed = True  # a root hook's list of contexts drops it (an aborted forward's)
        return super().__exit__(exc_type, exc, tb)

    # -- naming ---------------------------------------------------------------------
    def new_call(self, base: str, category: str, op: str, owner: str, module: nn.Module | None = None) -> Call:
        self.counts[base] += 1
        index = self.counts[base]
        name = base if index == 1 else f"{base}#{index}"
        return Call(name=name, base=base, index=index, category=category, op=op, owner=owner, module=module)

    def inline_base(self, owner: str, op: str) -> str:
        """The name of inline op ``op`` written in container ``owner``, before its call index."""
        base = f"{owner}.{op}" if owner else op
        return f"{base}()" if base in self.module_paths else base

    def container(self) -> str:
        for frame in reversed(self.frames):
            if frame.kind == "container":
                return frame.name
        return ""

    def emit(self, call: Call, args: tuple, kwargs: dict, func: Callable | None, raw: Any, out: Any) -> None:
        if self.listeners:
            event = Event(call, args, kwargs, func, raw, out)
            self.busy += 1
            try:
                with self._off_the_mode_stack():
                    for listener in self.listeners:
                        listener(event)
            finally:
                self.busy -= 1

    @contextlib.contextmanager
    def _off_the_mode_stack(self) -> Iterator[None]:
        """This mode taken off torch's mode stack while listeners run.

        Listeners (statistics, recording, replays) make thousands of torch calls per
        forward; with the mode on the stack each one detours through Python into
        ``__torch_function__`` only to be passed through (``busy``), which costs more than
        the op itself on small tensors.  Only done when this mode is the top one (another
        mode above it stays untouched) and torch has the helpers.
        """
        if _pop_mode is None or _current_mode() is not self:
            yield
            return
        _pop_mode()
        try:
            yield
        finally:
            _push_mode(self)

    def replay(self, event: Event, args: tuple, kwargs: dict | None = None, *, float_output: Any = None) -> Any:
        """Run the call of ``event`` again on other inputs, with the same handler treatment
        (quant point, integer kernel).  Used for isolated errors; counts nothing.

        ``float_output``: the call's float result on these inputs, already known (the caller
        proved the call computes the same float function as the one that produced it): only
        the handler's treatment of the output runs.  Not for calls with integer kernels.
        """
        kwargs = kwargs or {}
        call = event.call
        if float_output is not None:
            self.busy += 1
            try:
                return self.handler.on_float_output(self, call, float_output)
            finally:
                self.busy -= 1
        if writes_its_inputs(event):
            # The caller's tensors (recorded reference values) must survive an in-place op.
            args, kwargs = map_tensors(args, torch.clone), map_tensors(kwargs, torch.clone)
        self.busy += 1
        try:
            if call.category == "input":
                return self.handler.on_input(self, call, args[0])
            if event.func is None:
                module = call.module
                self.handler.before_module(self, call, module, args)
                # A norm-act layer's call is its norm alone (its act is a call of its own).
                output = norm_only(module, *args) if call.base in self.norm_acts else module(*args, **kwargs)
                return self.handler.on_module_output(self, call, module, args, output)
            if call.category == "fallback":
                return self.handler.on_fallback(self, call, event.func, args, event.func(*args, **kwargs))
            return self.handler.on_op(self, call, event.func, args, kwargs)
        finally:
            self.busy -= 1

    # -- model inputs and outputs -------------------------------------------------
    def process_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def one(x: torch.Tensor) -> torch.Tensor:
            if not torch.is_floating_point(x):
                return x
            call = self.new_call("input", "input", "input", "")
            self.busy += 1
            try:
                out = self.handler.on_input(self, call, x)
            finally:
                self.busy -= 1
            self.emit(call, (x,), {}, None, x, out)
            return out

        return map_tensors(args, one), map_tensors(kwargs, one)

    def run(self, model: nn.Module, inputs: Any) -> Any:
        """Call ``model`` (this context's root) on one batch, inputs and output processed."""
        args, kwargs = self.process_inputs(*split_inputs(inputs))
        return self.process_output(model(*args, **kwargs))

    def process_output(self, output: Any) -> Any:
        self.busy += 1
        try:
            return self.handler.on_model_output(self, output)
        finally:
            self.busy -= 1

    # -- module hooks -------------------------------------------------------------
    def _pre_hook(self, module: nn.Module, args: tuple) -> None:
        if self.busy or module is self.root or active_context() is not self:
            return None
        name = self.module_names.get(id(module))
        if name is None or self.leaf_depth or id(module) in self.silent:
            self.frames.append(_Frame("skip"))
            return None
        category = self.tree.category(module)
        if category is None:
            self.frames.append(_Frame("container", name))
            return None
        if name in self.norm_acts:
            # A container whose norm function is the module's own call (``_norm_call``); the
            # placeholder of one folded into its conv makes that call on its input, here.
            frame = _Frame("container", name)
            self.frames.append(frame)
            if getattr(type(module), "norm_act_placeholder", False) and args:
                return (self._norm_call(frame, module, args[0], args[0]), *args[1:])
            return None
        call = self.new_call(name, category, type(module).__name__, name, module)
        self.frames.append(_Frame("leaf", name, call))
        self.leaf_depth += 1
        self.busy += 1
        try:
            self.handler.before_module(self, call, module, args)
        finally:
            self.busy -= 1
        return None

    def _post_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.busy or module is self.root or active_context() is not self:
            return None
        frame = self.frames.pop()
        if frame.kind != "leaf":
            return None
        self.leaf_depth -= 1
        self.busy += 1
        try:
            if frame.call.category == "passthrough":
                self.view_call = frame.call
                try:
                    new = self.handler.on_passthrough(self, None, args, output)
                finally:
                    self.view_call = None
                if self.on_passthrough_call is not None:
                    # The module's own output: served again, it gets the handler's treatment again.
                    self.on_passthrough_call(frame.call, output)
            else:
                new = self.handler.on_module_output(self, frame.call, module, args, output)
        finally:
            self.busy -= 1
        if frame.call.category != "passthrough":
            self.emit(frame.call, args, {}, None, output, new)
        return new

    def _norm_call(self, frame: _Frame, module: nn.Module, x: Any, output: Any) -> Any:
        """The norm of norm-act layer ``module`` (its container ``frame``) as the module's call,
        with input ``x`` and float output ``output``."""
        call = self.new_call(frame.name, module_category(module), type(module).__name__, frame.name, module)
        frame.call = call  # one norm call per forward of the module: a second is an inline op
        self.busy += 1
        try:
            self.handler.before_module(self, call, module, (x,))
            new = self.handler.on_module_output(self, call, module, (x,), output)
        finally:
            self.busy -= 1
        self.emit(call, (x,), {}, None, output, new)
        return new

    # -- inline ops -----------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.busy or self.leaf_depth:
            return func(*args, **kwargs)
        if self.norm_acts:
            frame = self.frames[-1]
            if frame.kind == "container" and frame.call is None and frame.name in self.norm_acts:
                if args and getattr(func, "__name__", "") in NORM_FUNCTIONS:
                    return self._norm_call(frame, self.norm_acts[frame.name], args[0], func(*args, **kwargs))
                # Before its norm, a norm-act layer only checks its input (timm: ``x.ndim == 4``):
                # no op of the model, and no reader of the conv's output that would keep its BN apart.
                return func(*args, **kwargs)
        decompose = _DECOMPOSITIONS.get(func)
        if decompose is not None:  # e.g. SDPA: QK^T, softmax and attn.V become calls (qdebug.engine.sdpa)
            return decompose(self, *args, **kwargs)
        category = function_category(func, args, kwargs)
        if category == "passthrough":
            out = func(*args, **kwargs)
            self.busy += 1
            try:
                return self.handler.on_passthrough(self, func, args, out)
            finally:
                self.busy -= 1
        if category == "fallback":
            return self._fallback(func, args, kwargs)
        owner = self.container()
        op = canonical_op_name(func, category)
        call = self.new_call(self.inline_base(owner, op), category, op, owner)
        stored = self.served.take(call.name) if self.served is not None else None
        self.busy += 1
        try:
            if stored is not None:  # known from an earlier run: only the quant point's treatment runs
                out = self.handler.on_float_output(self, call, stored)
            else:
                out = self.handler.on_op(self, call, func, args, kwargs)
        finally:
            self.busy -= 1
        self.emit(call, args, kwargs, func, getattr(self.handler, "last_raw", None), out)
        return out

    def _fallback(self, func, args, kwargs):
        out = func(*args, **kwargs)
        inputs = [t for t in tensors_in((args, kwargs)) if torch.is_floating_point(t)]
        produced = [t for t in tensors_in(out) if torch.is_floating_point(t)]
        # Creation ops (no tensor input) and parameter-only ops are constants, and
        # results with no float tensor (sizes, masks) are not activations.
        if not produced or not any(not isinstance(t, nn.Parameter) for t in inputs) or all(
                t.dim() == 0 for t in produced):  # a scalar (a branch condition, a norm) is not a feature map
            self.handler.on_untracked(args, kwargs, out)
            return out
        owner = self.container()
        op = canonical_op_name(func, "fallback")
        call = self.new_call(self.inline_base(owner, op), "fallback", op, owner)
        self.busy += 1
        try:
            new = self.handler.on_fallback(self, call, func, args, out)
        finally:
            self.busy -= 1
        self.emit(call, args, kwargs, func, out, new)
        return new


def writes_its_inputs(event: Event) -> bool:
    """Whether the call of ``event`` may modify its inputs in place (erring on the side of yes)."""
    if event.func is None:
        return bool(getattr(event.call.module, "inplace", False))
    name = getattr(event.func, "__name__", "")
    if name.startswith("__i") or (name.endswith("_") and not name.startswith("__")):
        return True  # x += y, x.add_(y), F.relu_(x)
    return bool(event.kwargs.get("inplace")) or any(a is True for a in event.args)


def split_inputs(inputs: Any) -> tuple[tuple, dict]:
    """One batch of model inputs as (args, kwargs): a tensor, a tuple/list of args, or a dict of kwargs."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def run_model(model: nn.Module, inputs: Any) -> Any:
    """Call ``model`` on one batch of inputs: a tensor, a tuple/list of args, or a dict of kwargs.
    A forward aborted by a BaseException leaves no naming context behind (``release_aborted``)."""
    args, kwargs = split_inputs(inputs)
    depth = open_contexts()
    try:
        return model(*args, **kwargs)
    except BaseException:
        release_aborted(depth)
        raise
