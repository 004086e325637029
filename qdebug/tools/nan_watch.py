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
taken before it (``qdebug.tools.nan_trace``); a user's own loop runs in detail
(``qdebug.tools.nan_guard``), as it cannot be re-run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn

from qdebug.engine import engine_state, is_prepared
from qdebug.engine.context import Event
from qdebug.engine.ops import tensors_in
from qdebug.tap import tap

PHASES = ("forward", "backward", "update", "observer")
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
        self.consumers = consumers or {}  # call name -> consumer call names ("<output>" for the model's)
        self.params = [(n, p) for n, p in model.named_parameters()]
        self.param_names = {id(p): n for n, p in self.params}
        self.step_index = 0
        self.batch_index = 0
        self.batch_size = 0
        self.pending: list[tuple[tuple, torch.Tensor]] = []  # ((phase, layer, what, tensor), sum)
        self.point_saturation: dict[str, torch.Tensor] = {}  # this step: point -> clipped fraction
        # This step: parameter -> its gradient's 2-norm, taken as it is accumulated (a user's loop
        # may zero the gradients before the step's end is reported).
        self.keep_grad_norms = keep_grad_norms
        self.grad_norms: dict[str, torch.Tensor] = {}
        self.valid_scales: set[str] = set()  # points whose scale was valid when the step began
        self._handles: list[Any] = []
        self._tap = None

    # -- installing -----------------------------------------------------------------
    def __enter__(self) -> "Watch":
        self._tap = tap(self.model, self._on_call)
        self._tap.__enter__()
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

    def begin(self, step: int, batch: int, batch_size: int = 0) -> None:
        self.step_index, self.batch_index, self.batch_size = step, batch, batch_size
        self.pending = []
        self.point_saturation = {}
        self.grad_norms = {}
        self.valid_scales = {p.name for p in points_in_use(self.model) if not bool(scale_invalid(p).any())}

    # -- the checks -------------------------------------------------------------------
    def _look(self, key: tuple, t: torch.Tensor, make: Any) -> None:
        """Cheap: keep the fused sum.  Detailed: raise at once when ``t`` is not finite
        (``make()`` builds the finding)."""
        if not self.detail:
            self.pending.append((key, fused_sum(t)))
            return
        if math.isfinite(float(fused_sum(t))) or finite(t):
            return
        finding = make()
        raise NonFiniteError(finding)

    def _stamp(self, f: Finding, t: torch.Tensor | None) -> Finding:
        f.step, f.batch = self.step_index, self.batch_index
        if t is not None:
            count_nonfinite(f, t, self.batch_size)
        return f

    def _on_call(self, event: Event) -> None:
        call = event.call
        if call.category == "input" and not self.batch_size and isinstance(event.out, torch.Tensor) and event.out.dim():
            self.batch_size = event.out.shape[0]  # a user's loop: samples are counted along the input's dim 0
        point = self._output_point(call.name)
        if self.detail and point is not None and point.mode == "fake" and point.initialized:
            self._check_scale(point, call.name, call.op, during=True)
        raw = [t for t in tensors_in(event.raw) if is_float(t)] if event.raw is not event.out else []
        outs = [t for t in tensors_in(event.out) if is_float(t)]
        for t in raw:
            self._look(("forward", call.name, "raw_output", ""), t,
                       lambda t=t: self._forward_finding(event, t, "raw_output", point))
        # Fake quantization with a valid scale (checked apart) maps a finite input to a finite
        # output: the quantized output needs its own look only when its input was not summed.
        for t in (outs if not raw or self.detail else []):
            self._look(("forward", call.name, "output", ""), t,
                       lambda t=t: self._forward_finding(event, t, "output", point))
        for t in outs:
            if t.requires_grad and torch.is_grad_enabled():
                t.register_hook(self._grad_hook(call.name, call.op))
        if self.saturation and point is not None and point.kind == "activation" and raw and not point.spec.per_channel \
                and point.mode == "fake" and point.initialized:
            self.point_saturation[point.name] = clipped_fraction(raw[0], point)

    def _output_point(self, call_name: str):
        if self.plan is None:
            return None
        rec = self.plan.calls.get(call_name)
        name = rec.point if rec is not None else None
        return self.points.get(name) if name else None

    def _forward_finding(self, event: Event, t: torch.Tensor, what: str, point) -> Finding:
        call = event.call
        inputs = [x for x in event.inputs if is_float(x)]
        if what == "output" and event.raw is not event.out:
            inputs = [x for x in tensors_in(event.raw) if is_float(x)]  # the quant point's own input
            created = all(finite(x) for x in inputs)
            described = [describe(x) for x in inputs]
        else:
            created = all(finite(x) for x in inputs)
            described = [describe(x) for x in inputs]
        module = call.module
        bad_params = [f"{call.name}.{n}" for n, p in (module.named_parameters() if module is not None else [])
                      if not finite(p)]
        f = Finding("forward", call.name, call.op, what, point=self._point_name(call.name), created=created,
                    inputs=described, params=bad_params, owner=call.owner)
        if what == "output" and event.raw is not event.out and point is not None:
            f.tensor = point.name
        return self._stamp(f, t)

    def _point_name(self, call_name: str) -> str | None:
        if self.plan is None:
            return None
        rec = self.plan.calls.get(call_name)
        return (rec.output_point or rec.point) if rec is not None else None

    def _grad_hook(self, name: str, op: str):
        def hook(grad: torch.Tensor) -> None:
            if grad is None or not is_float(grad):
                return
            self._look(("backward", name, "output_grad", ""), grad, lambda: self._grad_finding(name, grad))
        return hook

    def _grad_finding(self, name: str, grad: torch.Tensor) -> Finding:
        consumers = self.consumers.get(name) or []
        made_by = [c for c in consumers if c != "<output>"]
        if not made_by:
            f = Finding("backward", "loss", "loss", "output_grad", tensor=name, created=True, consumers=["<loss>"])
        else:
            op = self.plan.calls[made_by[0]].op if self.plan is not None and made_by[0] in self.plan.calls else ""
            f = Finding("backward", made_by[0], op or _op_of(made_by[0]), "output_grad", tensor=name, created=True,
                        consumers=made_by)
        f.point = self._point_name(f.layer) if f.layer != "loss" else None
        return self._stamp(f, grad)

    def _on_param_grad(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            return
        name = self.param_names.get(id(p), "?")
        layer = name.rsplit(".", 1)[0] if "." in name else ""
        if self.keep_grad_norms:
            self.grad_norms[name] = torch.linalg.vector_norm(grad.detach())
        self._look(("backward", layer, "param_grad", name), grad, lambda: self._stamp(Finding(
            "backward", layer, self._module_op(layer), "param_grad", tensor=name, created=True,
            point=self._weight_point(layer, name)), grad))

    def _module_op(self, path: str) -> str:
        try:
            return type(self.model.get_submodule(path)).__name__ if path else type(self.model).__name__
        except AttributeError:
            return ""

    def _weight_point(self, layer: str, param: str) -> str | None:
        name = f"{layer}.weight"
        return name if param.endswith(".weight") and name in self.points else None

    def _check_scale(self, point, layer: str, op: str, *, during: bool) -> None:
        bad = scale_invalid(point)
        if not bool(bad.any()):
            return
        became = point.name in self.valid_scales
        values = point.scale.detach().float().reshape(-1)[bad.reshape(-1)] if bad.numel() > 1 else \
            point.scale.detach().float().reshape(-1)
        f = Finding("observer" if became else "forward", layer, op, "scale", tensor=point.name, point=point.name,
                    created=True, value=float(values[0]), numel=int(bad.sum()))
        raise NonFiniteError(self._stamp(f, None))

    # -- after a phase ------------------------------------------------------------------
    def check_scales(self, phase: str) -> None:
        """Every quant point in use: a scale made invalid in this phase (an observer in the
        forward, a learned scale in the update), or one invalid from the start."""
        used = points_in_use(self.model)
        if not used:
            return
        if not self.detail:
            flags = torch.stack([scale_invalid(p).any() for p in used])
            self.pending.append(((phase, "", "scale", ""), torch.where(flags.any(), torch.nan, 0.0)))
            return
        for p in used:
            bad = scale_invalid(p)
            if bool(bad.any()):
                became = p.name in self.valid_scales
                value = float(p.scale.detach().float().reshape(-1)[bad.reshape(-1).nonzero()[0]].reshape(-1)[0]) \
                    if bad.numel() > 1 else float(p.scale.detach().float())
                f = Finding(phase if became else "forward", p.owner or p.name, p.op, "scale", tensor=p.name,
                            point=p.name, created=True, value=value, numel=int(bad.sum()))
                raise NonFiniteError(self._stamp(f, None))

    def check_params(self, norms: list[torch.Tensor] | None = None) -> None:
        """After the optimizer's step: a parameter that is no longer finite (``norms``: their
        inf-norms, when the caller computed them for the timeline)."""
        params = [p for _, p in self.params]
        if not params:
            return
        if norms is None:
            norms = list(torch._foreach_norm([p.detach() for p in params], float("inf")))
        if not self.detail:
            self.pending.append((("update", "", "param", ""), torch.stack(norms).sum()))
            return
        for (name, p), norm in zip(self.params, norms):
            if not math.isfinite(float(norm)):
                layer = name.rsplit(".", 1)[0] if "." in name else ""
                f = Finding("update", layer, self._module_op(layer), "param", tensor=name, created=True,
                            point=self._weight_point(layer, name))
                raise NonFiniteError(self._stamp(f, p))

    def flush(self) -> tuple | None:
        """Cheap mode: the key (phase, layer, what, tensor) of the first non-finite sum of this
        step, else None.  One synchronisation per step."""
        if not self.pending:
            return None
        sums = torch.stack([s.float().reshape(()) for _, s in self.pending])
        bad = ~torch.isfinite(sums)
        if not bool(bad.any()):
            return None
        return self.pending[int(bad.nonzero()[0])][0]


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
