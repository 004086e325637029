"""Watching a model for its first non-finite value: forward, backward, optimizer update, scales.

``Watch`` hooks a model (engine-prepared or plain) for one training or inference step at
a time and looks at every tensor it produces:

- forward: every value call's output (``tap``'s calls, with compare's names), and, for
  a call with a quant point, its output *before* the point too (fake quantization
  saturates an Inf to the range end, hiding it);
- backward: the gradient arriving at every call's output (produced by the backward of
  the calls consuming it, or by the loss for the model's output) and every parameter's
  accumulated gradient;
- update: every parameter after the optimizer's step;
- scales: every quant point in use whose scale is NaN, Inf, <= 0 or subnormal, or whose
  zero point lies outside its integer range (an observer's or a learned scale's update).

Two ways to look, one set of hooks:

- cheap (``detail=False``): each tensor costs one fused reduction (its sum: NaN and
  +-Inf anywhere make it non-finite), kept without synchronising; ``flush()`` stacks
  them once per step and answers *where* the first non-finite value was.  A finite sum
  is proof; a non-finite one can, rarely, be a finite tensor whose sum overflowed.
- detailed (``detail=True``): each tensor is checked as it appears, and the first
  non-finite one raises ``NonFiniteError`` carrying a ``Finding``: the phase, the call
  and its op and quant point, NaN/+Inf/-Inf counts, the samples holding them, and
  whether the call *created* the value (its inputs finite) or only propagated it.

A training loop runs cheaply and re-runs a flagged step in detail from a snapshot
taken before it (``qdebug.tools.nan.trace``); a user's own loop runs in detail
(``qdebug.tools.nan.guard``), as it cannot be re-run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn

from qdebug.engine import engine_state, is_prepared
from qdebug.engine.context import Event
from qdebug.engine.members import named_members
from qdebug.engine.ops import tensors_in
from qdebug.measure.tap import tap

# The smallest normal float32: a scale below it is subnormal (1/s overflows, precision is gone).
TINY = torch.finfo(torch.float32).tiny
MAX_SAMPLES = 16  # sample indices listed in a finding
SATURATION_SAMPLE = 1 << 14  # values of a point's input its saturation is estimated from


@dataclass
class Finding:
    """Where the first non-finite value appeared (see the module docstring)."""

    phase: str  # forward | backward | update | observer
    layer: str  # call name (forward, backward), the layer owning a parameter, or "loss"
    op: str  # the call's op (module class or function), "loss", or the optimizer's
    what: str  # output | raw_output | output_grad | param_grad | param | scale
    tensor: str = ""  # the parameter or point concerned, when not the call's output
    point: str | None = None  # the quant point on the layer's output (or weight)
    created: bool | None = None  # the layer's inputs were finite: it made the value
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    numel: int = 0
    dtype: str = ""
    shape: list[int] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    step: int = 0
    batch: int = 0
    consumers: list[str] = field(default_factory=list)  # backward: the calls whose backward produced it
    inputs: list[dict] = field(default_factory=list)  # forward: per input, min/max/finite/count of <= 0
    params: list[str] = field(default_factory=list)  # the layer's own parameters that are not finite
    value: float | None = None  # a scale's value
    owner: str = ""  # the module whose forward made the call (an inline op's container)
    reproducible: bool = True  # False: the cheap check saw it, the step's detailed re-run did not
    hidden: list[str] = field(default_factory=list)  # calls of this step whose non-finite output a mask or a
    # saturating quant point kept from spreading (torch.where, a -inf mask, an Inf clamped by fake quantization)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class NonFiniteError(Exception):
    """A non-finite value was found.  ``finding`` says where; ``report`` (set by nan-trace)
    adds why and what to do."""

    def __init__(self, finding: Finding, report: dict | None = None):
        self.finding = finding
        self.report = report
        where = f"{finding.phase} of step {finding.step}, batch {finding.batch}: {finding.what} of {finding.layer}"
        super().__init__(f"non-finite value in the {where} ({counts_text(finding)})")


def counts_text(f: Finding) -> str:
    parts = [f"{n} {label}" for n, label in ((f.nan, "NaN"), (f.posinf, "+Inf"), (f.neginf, "-Inf")) if n]
    return ", ".join(parts) if parts else (f"value {f.value:g}" if f.value is not None else "invalid")


def is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and torch.is_floating_point(t)


def fused_sum(t: torch.Tensor) -> torch.Tensor:
    """One reduction that is non-finite whenever ``t`` holds a NaN or an Inf (half types summed
    in float32, so a finite fp16 tensor's sum does not overflow at 65504)."""
    t = t.detach()
    return t.sum(dtype=torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t.sum()


def finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t.detach()).all())


def scale_invalid(point: nn.Module) -> torch.Tensor:
    """Per element of the point's scale: NaN, Inf, <= 0 or subnormal, or a zero point off its range."""
    s = point.scale.detach().float().reshape(-1)
    z = point.zero_point.detach().reshape(-1)
    bad_z = (z < point.spec.qmin) | (z > point.spec.qmax)
    return ~torch.isfinite(s) | (s < TINY) | (bad_z if bad_z.numel() == s.numel() else bad_z.any())


def points_in_use(model: nn.Module) -> list:
    if not is_prepared(model):
        return []
    return [p for p in engine_state(model).points.values() if p.mode == "fake" and p.initialized]


class Watch:
    """Hooks ``model`` for non-finite values (module docstring).  Use as a context manager
    around the steps; call ``begin(step, batch)`` before each and ``flush()`` after (cheap)."""

    def __init__(self, model: nn.Module, *, detail: bool, saturation: bool = False, consumers: dict | None = None,
                 keep_grad_norms: bool = False):
        self.model = model
        self.detail = detail
        self.saturation = saturation and is_prepared(model)
        self.plan = engine_state(model).plan if is_prepared(model) else None
        self.points = engine_state(model).points if is_prepared(model) else {}
        self.static_consumers = consumers or {}  # call -> consumers from a plan: where the run shows none
        self.params = [(n, p) for n, p in model.named_parameters()]
        self.param_names = {id(p): n for n, p in self.params}
        self.batchnorms = [(n, m) for n, m in model.named_modules()
                           if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
        self.keep_grad_norms = keep_grad_norms
        # Cheap mode: also sum the values that do not matter, to note contained ones (the runner
        # looks on some steps only: they cost a read of every activation and its gradient).
        self.look_contained = True
        self.step_index = self.batch_index = self.batch_size = 0
        self.valid_scales: set[str] = set()  # points whose scale was valid when the step began
        self._handles: list[Any] = []
        self._tap = None
        self._reset()

    def _reset(self) -> None:
        # Cheap mode: exact flags of what matters, and sums of everything else (see ``flush``).
        self.essential: list[tuple[tuple, torch.Tensor]] = []
        self.intermediate: list[tuple[tuple, torch.Tensor]] = []
        self.point_saturation: dict[str, torch.Tensor] = {}  # this step: point -> clipped fraction
        # This step: parameter -> its gradient's 2-norm, taken as it is accumulated (a user's loop
        # may zero the gradients before the step's end is reported).
        self.grad_norms: dict[str, torch.Tensor] = {}
        # Detailed mode: this step's non-finite values by call, and the calls' graph as it ran.
        self.forward_events: dict[str, Finding] = {}
        self.grad_events: dict[str, Finding] = {}
        self.producers: dict[str, list[str]] = {}
        self.consumers: dict[str, list[str]] = {}
        self._tensor_call: dict[int, str] = {}
        self._node_call: dict[Any, str] = {}
        self._alive: list[torch.Tensor] = []  # keeps ids unique while the step runs

    # -- installing -----------------------------------------------------------------
    def __enter__(self) -> "Watch":
        self._tap = tap(self.model, self._on_call)
        self._tap.__enter__()
        # After the engine's (and tap's) own root hook: sees the output the caller gets.
        self._handles.append(self.model.register_forward_hook(self._on_model_output))
        for name, p in self.params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_param_grad))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._tap is not None:
            self._tap.__exit__(None, None, None)
            self._tap = None
        self._reset()

    def begin(self, step: int, batch: int, batch_size: int = 0, *, check: bool = True) -> None:
        """A new step: forget the last one's values; check what it starts from (``check_start``)
        unless the caller knows it is what the last step's checks passed (``check=False``)."""
        self.step_index, self.batch_index, self.batch_size = step, batch, batch_size
        self._reset()
        if self.detail:  # which scales an invalid one was valid before: the phase that broke it
            self.valid_scales = {p.name for p in points_in_use(self.model) if not bool(scale_invalid(p).any())}
        if check:
            self.check_start()

    # -- what the step starts from ---------------------------------------------------------
    def check_start(self) -> None:
        """A parameter or a scale already non-finite (or invalid) before the step runs: raised in
        either mode -- nothing to re-run, and an integer kernel would fail on a NaN scale."""
        for name, p in self.params:
            if p.is_floating_point() and not finite(p):
                layer = name.rsplit(".", 1)[0] if "." in name else ""
                f = Finding("forward", layer, self._module_op(layer), "param", tensor=name, created=False,
                            point=self._weight_point(layer, name))
                raise NonFiniteError(self._stamp(f, p))
        for path, bn in self.batchnorms:
            var = bn.running_var
            if not bn.training and var is not None and not bool(((var >= 0) & torch.isfinite(var)).all()):
                # Statistics in use (eval, or frozen) that cannot be: sqrt(var + eps) would be NaN.
                f = Finding("forward", path, type(bn).__name__, "param", tensor=f"{path}.running_var", created=False)
                raise NonFiniteError(self._stamp(f, var))
        for point in points_in_use(self.model):
            self._check_scale(point, point.owner or point.name, point.op)

    # -- the forward ------------------------------------------------------------------------
    def _on_call(self, event: Event) -> None:
        call = event.call
        if call.category == "input" and not self.batch_size and isinstance(event.out, torch.Tensor) and event.out.dim():
            self.batch_size = event.out.shape[0]  # a user's loop: samples are counted along the input's dim 0
        point = self._output_point(call.name)
        if self.detail and point is not None and point.mode == "fake" and point.initialized:
            self._check_scale(point, call.name, call.op)
        raw = [t for t in tensors_in(event.raw) if is_float(t)] if event.raw is not event.out else []
        outs = [t for t in tensors_in(event.out) if is_float(t)]
        if call.category == "input":  # the data itself matters, even where the input's quant point saturates it
            data = (raw or outs)[:1]
            if not self.detail:
                self.essential += [(("forward", call.name, "output", ""), torch.isfinite(t.detach()).all())
                                   for t in data]
            elif data and not finite(data[0]):
                raise NonFiniteError(self._forward_finding(event, data[0], "output", point))
        if self.detail:
            self._link(call.name, [x for x in event.inputs if is_float(x)], outs)
            for what, tensors in (("raw_output", raw), ("output", outs)):
                bad = next((t for t in tensors if not finite(t)), None)
                if bad is not None and call.name not in self.forward_events:
                    self.forward_events[call.name] = self._forward_finding(event, bad, what, point)
        elif self.look_contained:
            # Fake quantization with a valid scale maps a finite input to a finite output: the
            # quantized output needs its own sum only when its input was not summed.
            for t in raw or outs:
                self.intermediate.append((("forward", call.name, "output", ""), fused_sum(t)))
        if self.detail or self.look_contained:
            for t in outs:
                if t.requires_grad and torch.is_grad_enabled():
                    t.register_hook(self._grad_hook(call.name))
        if self.saturation and raw:
            for own, t in self._output_points(call.name, event.raw, point):
                if own is not None and own.kind == "activation" and not own.spec.per_channel \
                        and own.mode == "fake" and own.initialized and not own.spec.dynamic:
                    self.point_saturation[own.name] = clipped_fraction(t, own)

    def _output_points(self, call_name: str, raw: Any, point) -> list[tuple[Any, torch.Tensor]]:
        """(point, the tensor it received) for a call's output: one pair per tensor of a structured
        output (each on its own point, ``qdebug.engine.members``), else ``point`` and the first."""
        rec = self.plan.calls.get(call_name) if self.plan is not None else None
        if rec is not None and rec.members:
            return [(self.points.get(name), t) for name, _, t in named_members(call_name, raw)]
        first = next((t for t in tensors_in(raw) if is_float(t)), None)
        return [(point, first)] if first is not None else []

    def _link(self, name: str, inputs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Detailed mode: the call graph as it runs (tensor identity, else the autograd graph)."""
        found = [p for p in (self._producer_of(x) for x in inputs) if p]
        self.producers[name] = list(dict.fromkeys(found))
        for p in self.producers[name]:
            self.consumers.setdefault(p, []).append(name)
        for t in outs:
            self._tensor_call[id(t)] = name
            self._alive.append(t)
            if t.grad_fn is not None:
                self._node_call[t.grad_fn] = name

    def _producer_of(self, x: torch.Tensor, among: Any = None) -> str | None:
        """The call that produced ``x``: by identity, else the nearest call up its autograd graph
        (a view, a max-pool or another op the tap does not name may sit in between); with
        ``among``, the nearest call in ``among`` (e.g. the calls whose outputs were non-finite)."""
        name = self._tensor_call.get(id(x))
        if name is not None and (among is None or name in among):
            return name
        if x.grad_fn is None:
            return None
        frontier, seen = [x.grad_fn], set()
        for _ in range(256):
            if not frontier:
                break
            node = frontier.pop(0)
            if node in seen:
                continue
            seen.add(node)
            found = self._node_call.get(node)
            if found is not None and (among is None or found in among):
                return found
            frontier += [n for n, _ in node.next_functions if n is not None]
        return None

    def _on_model_output(self, module: nn.Module, args: Any, output: Any) -> None:
        outs = [t for t in tensors_in(output) if is_float(t)]
        if not self.detail:
            for t in outs:
                self.essential.append((("forward", "<output>", "output", ""), torch.isfinite(t.detach()).all()))
            return
        bad = [t for t in outs if not finite(t)]
        if bad:
            self._raise(self._origin_forward(bad))

    def _origin_forward(self, bad: list[torch.Tensor]) -> Finding:
        """The call that created the non-finite ``bad`` values (the model's outputs, or the loss):
        from the nearest call whose output was non-finite, upstream through producers whose
        outputs were non-finite too, to one whose inputs were finite."""
        starts = [self._producer_of(t, among=self.forward_events) for t in bad]
        current = next((s for s in starts if s is not None), None)
        if current is None:  # no call is known to have made it: the earliest non-finite call
            if not self.forward_events:
                f = Finding("forward", "<output>", "output", "output", created=None)
                return self._stamp(f, bad[0])
            current = next(iter(self.forward_events))
        order = list(self.forward_events)
        seen = {current}
        while True:
            upstream = [p for p in self._producers(current) if p in self.forward_events and p not in seen]
            if not upstream:
                break
            current = min(upstream, key=order.index)
            seen.add(current)
        event = self.forward_events[current]
        if event.created is False:
            # Its non-finite input came along a path neither identity nor autograd shows (ops on
            # tensors without gradients, through views): the step's first call that made one.
            earlier = [e for e in order[:order.index(current)] if self.forward_events[e].created]
            if earlier:
                return self.forward_events[earlier[0]]
        return event

    def _contained(self, f: Finding) -> list[str]:
        """The calls of this step whose non-finite output did not reach their consumers' outputs
        (a mask): every consumer known, none with a non-finite output."""
        found = []
        for name in self.forward_events:
            if name == f.layer and f.phase == "forward":
                continue
            consumers = self._consumers(name)
            if consumers and not any(c in self.forward_events for c in consumers):
                found.append(name)
        return found[:8]

    def _producers(self, name: str) -> list[str]:
        found = self.producers.get(name)
        if found:
            return found
        return [p for p, consumers in self.static_consumers.items() if name in consumers]

    def _consumers(self, name: str) -> list[str]:
        return self.consumers.get(name) or [c for c in self.static_consumers.get(name, []) if c != "<output>"]

    def check_loss(self, loss: torch.Tensor) -> None:
        """The loss of the step: made non-finite by the loss function when the model's outputs were finite."""
        if not self.detail:
            self.essential.append((("forward", "loss", "output", ""), torch.isfinite(loss.detach()).all()))
            return
        if not finite(loss):
            if self._producer_of(loss, among=self.forward_events) is not None:  # a model value reached it
                self._raise(self._origin_forward([loss]))
            self._raise(self._stamp(Finding("forward", "loss", "loss", "output", created=True), loss))

    def _output_point(self, call_name: str):
        if self.plan is None:
            return None
        rec = self.plan.calls.get(call_name)
        name = rec.point if rec is not None else None
        return self.points.get(name) if name else None

    def _forward_finding(self, event: Event, t: torch.Tensor, what: str, point) -> Finding:
        call = event.call
        if what == "output" and event.raw is not None and event.raw is not event.out:
            inputs = [x for x in tensors_in(event.raw) if is_float(x)]  # the quant point's own input
        else:
            inputs = [x for x in event.inputs if is_float(x)]
        module = call.module
        bad_params = [f"{call.name}.{n}" for n, p in (module.named_parameters() if module is not None else [])
                      if not finite(p)]
        f = Finding("forward", call.name, call.op, what, point=self._point_name(call.name),
                    created=all(finite(x) for x in inputs), inputs=[describe(x) for x in inputs], params=bad_params,
                    owner=call.owner)
        if what == "output" and event.raw is not event.out and point is not None:
            f.tensor = point.name
        return self._stamp(f, t)

    def _point_name(self, call_name: str) -> str | None:
        if self.plan is None:
            return None
        rec = self.plan.calls.get(call_name)
        return (rec.output_point or rec.point) if rec is not None else None

    # -- the backward -------------------------------------------------------------------------
    def _grad_hook(self, name: str):
        def hook(grad: torch.Tensor) -> None:
            if grad is None or not is_float(grad):
                return
            if not self.detail:
                self.intermediate.append((("backward", name, "output_grad", ""), fused_sum(grad)))
            elif name not in self.grad_events and not finite(grad):
                self.grad_events[name] = self._stamp(Finding("backward", name, "", "output_grad", tensor=name,
                                                             created=True), grad)
        return hook

    def _on_param_grad(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            return
        name = self.param_names.get(id(p), "?")
        if self.keep_grad_norms:
            self.grad_norms[name] = torch.linalg.vector_norm(grad.detach(), dtype=torch.float64)
        if not self.detail:
            return  # the cheap pass checks every gradient at once from their norms (``check_grads``)
        if not finite(grad):
            self._raise(self._origin_backward(name, grad))

    def _origin_backward(self, param: str, grad: torch.Tensor) -> Finding:
        """Who made parameter ``param``'s gradient non-finite: its layer's weight-gradient
        computation when the gradient arriving at the layer's output was finite; else, walking
        from that output toward the loss through calls whose output gradients were non-finite
        too, the backward of the consumers of the last one (or the loss, past the model's output)."""
        layer = param.rsplit(".", 1)[0] if "." in param else ""
        calls = [c for c in self.grad_events if c.split("#")[0] == layer]
        if not calls:
            f = Finding("backward", layer, self._module_op(layer), "param_grad", tensor=param, created=True,
                        point=self._weight_point(layer, param))
            return self._stamp(f, grad)
        order = list(self.grad_events)
        current, seen = min(calls, key=order.index), set()
        while True:
            seen.add(current)
            downstream = [c for c in self._consumers(current) if c in self.grad_events and c not in seen]
            if not downstream:
                break
            current = min(downstream, key=order.index)
        event = self.grad_events[current]
        made_by = [c for c in self._consumers(current) if c != "<output>"]
        if made_by:
            event.layer, event.consumers = made_by[0], made_by
            event.op = self._call_op(made_by[0])
            event.point = self._point_name(made_by[0])
        else:
            event.layer, event.op, event.consumers = "loss", "loss", ["<loss>"]
        return event

    def _call_op(self, name: str) -> str:
        if self.plan is not None and name in self.plan.calls:
            return self.plan.calls[name].op
        try:
            return type(self.model.get_submodule(name.split("#")[0])).__name__
        except AttributeError:
            return _op_of(name)

    def _module_op(self, path: str) -> str:
        try:
            return type(self.model.get_submodule(path)).__name__ if path else type(self.model).__name__
        except AttributeError:
            return ""

    def _weight_point(self, layer: str, param: str) -> str | None:
        name = f"{layer}.weight"
        return name if param.endswith(".weight") and name in self.points else None

    # -- scales and the update ------------------------------------------------------------------
    def _check_scale(self, point, layer: str, op: str, phase: str = "observer") -> None:
        bad = scale_invalid(point)
        if not bool(bad.any()):
            return
        became = point.name in self.valid_scales
        value = point.scale.detach().float().reshape(-1)[bad.reshape(-1).nonzero()[0]].reshape(-1)[0] \
            if bad.numel() > 1 else point.scale.detach().float()
        f = Finding(phase if became else "forward", layer, op, "scale", tensor=point.name, point=point.name,
                    created=True, value=float(value), numel=int(bad.sum()))
        raise NonFiniteError(self._stamp(f, None))

    def check_grads(self, norms: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Cheap mode, after the backward: every parameter's gradient from its 2-norm (one fused
        ``_foreach_norm`` for all): a finite norm proves a finite gradient; a gradient whose norm
        is not finite is looked at itself (its norm may have overflowed on finite values)."""
        if not norms or self.detail:
            return
        finite_norms = torch.isfinite(torch.stack([n.reshape(()) for n in norms]))
        if bool(finite_norms.all()):
            return
        ok = all(finite(g) for g, fine in zip(grads, finite_norms.tolist()) if not fine)
        # On the norms' device: ``flush`` stacks every flag of the step in one tensor.
        self.essential.append((("backward", "", "param_grad", ""), torch.tensor(ok, device=finite_norms.device)))

    def check_scales(self, phase: str) -> None:
        """Every quant point in use: a scale made invalid in this phase (an observer in the
        forward; in the update only learned scales change)."""
        used = points_in_use(self.model)
        if phase == "update":
            used = [p for p in used if isinstance(p.scale, nn.Parameter)]
        if not used:
            return
        if not self.detail:  # one fused look at every scale (zero points come from the same update)
            scales = torch.cat([p.scale.detach().reshape(-1).float() for p in used])
            self.essential.append(((phase, "", "scale", ""), (torch.isfinite(scales) & (scales >= TINY)).all()))
            return
        for p in used:
            self._check_scale(p, p.owner or p.name, p.op, phase)

    def check_params(self, norms: list[torch.Tensor] | None = None) -> None:
        """After the optimizer's step: a parameter that is no longer finite (``norms``: their
        inf-norms, when the caller computed them for the timeline)."""
        params = [p for _, p in self.params]
        if not params:
            return
        if norms is None:
            norms = list(torch._foreach_norm([p.detach() for p in params], float("inf")))
        if not self.detail:
            self.essential.append((("update", "", "param", ""), torch.isfinite(torch.stack(norms)).all()))
            return
        for (name, p), norm in zip(self.params, norms):
            if not math.isfinite(float(norm)):
                layer = name.rsplit(".", 1)[0] if "." in name else ""
                f = Finding("update", layer, self._module_op(layer), "param", tensor=name, created=True,
                            point=self._weight_point(layer, name))
                raise NonFiniteError(self._stamp(f, p))

    def _stamp(self, f: Finding, t: torch.Tensor | None) -> Finding:
        f.step, f.batch = self.step_index, self.batch_index
        if t is not None:  # a parameter's dim 0 is no batch, whatever its size
            count_nonfinite(f, t, 0 if f.what in ("param", "param_grad", "scale") else self.batch_size)
        return f

    def _raise(self, f: Finding) -> None:
        f.hidden = self._contained(f)
        raise NonFiniteError(f)

    # -- cheap mode's verdict -----------------------------------------------------------------------
    def flush(self) -> tuple[tuple | None, tuple | None]:
        """Cheap mode, once per step (one synchronisation): (the key of the first check that
        failed among what matters -- the model's output, the loss, a parameter's gradient, a
        parameter, a scale -- or None; the key of the first non-finite value that stayed
        contained -- masked by torch.where, a -inf mask before a softmax, saturated by a quant
        point, a masked gradient -- or None)."""
        failed = contained = None
        if self.essential:
            ok = torch.stack([flag.reshape(()) for _, flag in self.essential])
            if not bool(ok.all()):
                failed = self.essential[int((~ok).nonzero()[0])][0]
        if failed is None and self.intermediate:
            sums = torch.stack([s.float().reshape(()) for _, s in self.intermediate])
            bad = ~torch.isfinite(sums)
            if bool(bad.any()):
                contained = self.intermediate[int(bad.nonzero()[0])][0]
        return failed, contained


def count_nonfinite(f: Finding, t: torch.Tensor, batch_size: int = 0) -> None:
    """Fill ``f``'s NaN/+Inf/-Inf counts, dtype, shape and the samples (dim 0) holding them."""
    t = t.detach()
    f.nan = int(torch.isnan(t).sum())
    f.posinf = int((t == math.inf).sum())
    f.neginf = int((t == -math.inf).sum())
    f.numel = t.numel()
    f.dtype = str(t.dtype).replace("torch.", "")
    f.shape = list(t.shape)
    if t.dim() >= 1 and (batch_size == 0 or t.shape[0] == batch_size) and batch_size:
        rows = (~torch.isfinite(t)).reshape(t.shape[0], -1).any(1)
        f.samples = [int(i) for i in rows.nonzero().reshape(-1)[:MAX_SAMPLES]]


def describe(x: torch.Tensor) -> dict:
    """A call input as the causes need it: its range, finiteness, and how many values are
    <= 0 (the domain of log, sqrt, division) or exactly 0."""
    x = x.detach()
    fin = x[torch.isfinite(x)] if x.numel() else x
    return {
        "shape": list(x.shape),
        "dtype": str(x.dtype).replace("torch.", ""),
        "finite": bool(fin.numel() == x.numel()),
        "min": float(fin.min()) if fin.numel() else None,
        "max": float(fin.max()) if fin.numel() else None,
        "negative": int((x < 0).sum()),
        "zero": int((x == 0).sum()),
        "numel": x.numel(),
    }


def clipped_fraction(raw: torch.Tensor, point) -> torch.Tensor:
    """The fraction of ``raw`` (a point's input) that its clamp saturates: beyond half a step
    past either end of [(qmin - z) s, (qmax - z) s].  0-dim, not synchronised."""
    s = point.scale.detach().float()
    z = point.zero_point.detach().float()
    lo = (point.spec.qmin - z - 0.5) * s
    hi = (point.spec.qmax - z + 0.5) * s
    raw = raw.detach().reshape(-1)
    if raw.numel() > SATURATION_SAMPLE:  # an evenly strided sample: a trend, not an exact count
        raw = raw[:: raw.numel() // SATURATION_SAMPLE]
    return ((raw < lo) | (raw > hi)).sum() / max(raw.numel(), 1)


def _op_of(name: str) -> str:
    base = name.rsplit("#", 1)[0]
    return base.rsplit(".", 1)[-1]


def consumers_of(plan) -> dict[str, list[str]]:
    """Call name -> the calls consuming its output (``<output>``: the model's output), from a plan."""
    return {name: list(rec.consumers) for name, rec in plan.calls.items()}
