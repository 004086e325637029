"""``qdebug.watch(model)``: the timeline of a QAT run in the user's own loop, and what it says.

    with qdebug.watch(qm, float_model=fm, every=10, held_out=x_val) as w:
        for x, y in loader:
            loss = criterion(qm(x), y); loss.backward(); opt.step(); opt.zero_grad()
            w.step(loss)              # the end of a step
    w.timeline                        # long format: step, kind, name, metric, value
    w.findings                        # qdebug.tools.watch.rules: rule, name, from_step, evidence, fix

A *look* happens at step 0 and every ``every`` steps; the steps in between pay nothing (no
hook is installed).  For a look at step k, hooks are installed after step k - 1: a listener on
the engine's calls sees what each activation point receives in step k's forward, and gradient
hooks take each parameter's gradient norm as it is accumulated (a loop may zero gradients
before ``w.step``).  Each weighted layer's integer codes are read on a fixed strided sample of
its weight (``SAMPLE`` values) after steps k - 2, k - 1 and k: code changes and flip-backs are
per-step quantities, and a weight flipping between two codes every step looks still when read
only every ``every`` steps (an even ``every`` would alias it away).  Values are kept as tensors
and read back once per look (one synchronisation).

Metrics (``kind``, ``metric``):

- ``point`` (each activation quant point with stored qparams): ``scale``, ``zero_point``;
  ``range_min``/``range_max``, the observer's tracked range (an EMA's average; the running
  extremes of the other observers); ``data_min``/``data_max``, what the point received in the
  look step's forward(s); ``saturation``, the fraction of it (a strided sample) beyond half a
  step past either end of the grid;
- ``layer`` (each Conv/Linear with a weight point; codes ``clamp(round(w / s) + z)`` with the
  scale the point holds at the read, ``w`` the tensor the point quantizes -- ``W f`` under
  reverse fold): ``scale`` (mean), ``code_change`` (fraction of sampled weights whose code
  changed in step k), ``oscillation`` (fraction whose code changed in step k back to the code
  it had after step k - 2: the flip-back of Nagel et al. 2022), ``oscillation_repeat`` (fraction
  flipping back at this look AND at the previous one: weights stuck on a boundary repeat, weights
  a noisy update carries across one by chance mostly do not), ``boundary_distance`` (mean
  distance of ``w / s`` to the nearest rounding boundary, in grid steps: 0.25 for weights
  spread evenly, near 0 when they sit on boundaries), ``grad_norm`` (the weight's gradient),
  ``update_to_step`` (mean ``|w_k - w_{k-1}| / s``: step k's update in grid steps);
- ``bn`` (each BatchNorm also in ``float_model``, by path): ``mean_drift`` (mean
  ``|mu - mu_f| / sqrt(var_f + eps)``: the running mean's move in the float's standard
  deviations) and ``var_drift`` (mean ``|var - var_f| / (var_f + eps)``);
- ``model``: ``loss`` (from ``w.step(loss)``), ``grad_norm`` (all parameters), and with
  ``float_model`` and ``held_out`` (one batch of inputs) ``output_sqnr_db`` of the model
  against the float model on it (both in eval mode, without gradients).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch
import torch.nn as nn

from qdebug.engine import engine_state, is_prepared
from qdebug.engine.context import run_model
from qdebug.engine.members import named_members
from qdebug.engine.modules import _QWeighted
from qdebug.engine.ops import tensors_in
from qdebug.errors import QDebugError
from qdebug.measure.stats import sqnr_db
from qdebug.tools.nan.detect import clipped_fraction, is_float

COLUMNS = ["step", "kind", "name", "metric", "value"]
SAMPLE = 4096  # weight values a layer's codes are read on: a fraction known to about +-1.5%, at any layer size
BN_EPS = 1e-5


def weight_sample(numel: int) -> torch.Tensor:
    """Evenly strided flat indices, at most ``SAMPLE`` of them (all of a small weight)."""
    step = max(1, numel // SAMPLE)
    return torch.arange(0, numel, step)[:SAMPLE]


def element_qparams_index(point, shape: torch.Size, flat: torch.Tensor) -> torch.Tensor | None:
    """For flat indices ``flat`` of a weight of ``shape``: the index of each one's scale in the
    point's flattened scale (0 per tensor, its channel per channel, row * groups + group when
    grouped); None when the scale's size matches none of these."""
    numel = point.scale.numel()
    if numel == 1:
        return torch.zeros_like(flat)
    if point.spec.group_size is not None:
        row_len = math.prod(shape[1:])
        index = (flat // row_len) * (row_len // point.spec.group_size) + (flat % row_len) // point.spec.group_size
        return index if numel == shape[0] * (row_len // point.spec.group_size) else None
    axis = point.spec.ch_axis % len(shape)
    if numel != shape[axis]:
        return None
    return (flat // math.prod(shape[axis + 1:])) % shape[axis]


class _Layer:
    """One weighted layer's sampled reads: its weight point, sample, and the last three reads."""

    def __init__(self, name: str, module: nn.Module):
        self.name, self.module, self.point = name, module, module.weight_point
        self.flat = weight_sample(module.weight.numel()).to(module.weight.device)
        self.index: torch.Tensor | None = None
        self.reads: deque = deque(maxlen=3)  # (step, sampled w, its scales, codes), oldest first
        self.flipped_back: torch.Tensor | None = None  # the sampled weights flipping back at the last look

    def read(self, step: int) -> tuple | None:
        point = self.point
        if not point.initialized or point.spec.dynamic:
            return None
        with torch.no_grad():
            weight, _ = self.module.quantized_input_weight()
            if self.index is None:
                self.index = element_qparams_index(point, weight.shape, self.flat)
                if self.index is None:
                    return None
            w = weight.detach().reshape(-1)[self.flat].float()
            s = point.scale.detach().reshape(-1).float()[self.index]
            z = point.zero_point.reshape(-1)[self.index].float()
            codes = torch.clamp(torch.round(w / s) + z, point.spec.qmin, point.spec.qmax)
        entry = (step, w, s, codes)
        self.reads.append(entry)
        return entry

    def at(self, step: int) -> tuple | None:
        return next((r for r in self.reads if r[0] == step), None)


class QatWatch:
    """The context manager behind ``qdebug.watch`` (module docstring)."""

    def __init__(self, model: nn.Module, float_model: nn.Module | None = None, *, every: int = 10,
                 held_out: Any = None):
        if not isinstance(model, nn.Module) or not is_prepared(model):
            raise QDebugError(f"watch needs a model prepared by qdebug.engine.prepare, not a "
                              f"{'plain ' if isinstance(model, nn.Module) else ''}{type(model).__name__}",
                              "prepare and calibrate it first: qm = prepare(model, ...); calibrate(qm, batches)")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise QDebugError(f"every={every!r} is not a whole number of steps >= 1",
                              "look every N steps, e.g. qdebug.watch(model, every=10)")
        if float_model is not None and not isinstance(float_model, nn.Module):
            raise QDebugError(f"float_model is a {type(float_model).__name__}, not an nn.Module",
                              "pass the float model the QAT model was prepared from")
        if held_out is not None and float_model is None:
            raise QDebugError("held_out needs float_model: the output SQNR is measured against it",
                              "pass float_model=... as well, or leave held_out out")
        self.model, self.float_model, self.every, self.held_out = model, float_model, every, held_out
        state = engine_state(model)
        self.plan, self.points = state.plan, state.points
        self.layers = [_Layer(n, m) for n, m in model.named_modules()
                       if isinstance(m, _QWeighted) and m.weight_point is not None]
        self.bn_pairs = self._bn_pairs()
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        self.steps = 0  # steps reported so far: the next one is step ``steps``
        self.rows: list[tuple] = []
        self._handles: list[Any] = []
        self._seen: dict[str, list[torch.Tensor]] = {}  # point -> [min, max, saturation] this look
        self._grad_norms: dict[str, torch.Tensor] = {}
        self._entered = False

    def _bn_pairs(self) -> list[tuple[str, nn.Module, nn.Module]]:
        if self.float_model is None:
            return []
        theirs = dict(self.float_model.named_modules())
        pairs = []
        for path, bn in self.model.named_modules():
            other = theirs.get(path)
            if isinstance(bn, nn.modules.batchnorm._BatchNorm) and isinstance(other, nn.modules.batchnorm._BatchNorm) \
                    and bn.running_mean is not None and other.running_mean is not None \
                    and bn.running_mean.shape == other.running_mean.shape:
                pairs.append((path, bn, other))
        return pairs

    # -- the loop ------------------------------------------------------------------------
    def __enter__(self) -> "QatWatch":
        self._entered = True
        for layer in self.layers:  # the weights step 0 starts from: its code changes are against them
            layer.read(self.steps - 1)
        if self._is_look(self.steps):
            self._install()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._remove()
        self._entered = False
        return False

    def _is_look(self, step: int) -> bool:
        return step % self.every == 0

    def step(self, loss: Any = None) -> None:
        """The end of one training step (after the optimizer's update): a look when it is one,
        the layers' code reads before a look, and the next look's hooks."""
        if not self._entered:
            raise QDebugError("w.step() was called outside the with block",
                              "with qdebug.watch(model) as w: ...; w.step(loss)")
        step = self.steps
        if self._is_look(step):
            self._look(step, loss)
            self._remove()
        elif any(self._is_look(step + d) for d in (1, 2)):
            for layer in self.layers:
                layer.read(step)
        self.steps += 1
        if self._is_look(self.steps):
            self._install()

    # -- hooks (look steps only) ------------------------------------------------------------
    def _install(self) -> None:
        if self._handles:
            return
        self._seen, self._grad_norms = {}, {}
        state = engine_state(self.model)
        state.listeners.append(self._on_call)
        self._handles.append(lambda: state.listeners.remove(self._on_call))
        for p in self.model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_param_grad).remove)

    def _remove(self) -> None:
        for undo in self._handles:
            undo()
        self._handles = []

    def _on_call(self, event) -> None:
        if event.raw is event.out:  # no point changed the output
            return
        rec = self.plan.calls.get(event.call.name)
        if rec is None:
            return
        if rec.members:
            received = [(self.points.get(name), t) for name, _, t in named_members(event.call.name, event.raw)]
        else:
            first = next((t for t in tensors_in(event.raw) if is_float(t)), None)
            received = [(self.points.get(rec.point) if rec.point else None, first)]
        for point, t in received:
            if point is None or t is None or point.kind != "activation" or not point.initialized \
                    or point.spec.dynamic or point.mode != "fake" or t.numel() == 0:
                continue
            lo, hi = torch.aminmax(t.detach().float())
            sat = clipped_fraction(t, point) if not point.spec.per_channel else None
            old = self._seen.get(point.name)
            if old is not None:  # a second forward in the step (accumulation): widen, keep the latest saturation
                lo, hi = torch.minimum(lo, old[0]), torch.maximum(hi, old[1])
            self._seen[point.name] = [lo, hi, sat]

    def _on_param_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._grad_norms[self.param_names.get(id(p), "?")] = torch.linalg.vector_norm(
                p.grad.detach(), dtype=torch.float64)

    # -- one look ------------------------------------------------------------------------------
    def _look(self, step: int, loss: Any) -> None:
        pending: list[tuple[str, str, str, torch.Tensor]] = []  # read back at once below

        def add(kind: str, name: str, metric: str, value: torch.Tensor | None) -> None:
            if value is not None:
                pending.append((kind, name, metric, value))

        for name, point in self.points.items():
            if point.kind != "activation" or point.spec.dynamic or not point.initialized:
                continue
            add("point", name, "scale", point.scale.detach().float().mean())
            add("point", name, "zero_point", point.zero_point.float().mean())
            obs = point.observer
            if obs.min_val.numel():
                add("point", name, "range_min", obs.min_val.min())
                add("point", name, "range_max", obs.max_val.max())
            seen = self._seen.get(name)
            if seen is not None:
                add("point", name, "data_min", seen[0])
                add("point", name, "data_max", seen[1])
                add("point", name, "saturation", seen[2])
        for layer in self.layers:
            self._layer_metrics(layer, step, add)
        for path, bn, ref in self.bn_pairs:
            with torch.no_grad():
                std = torch.sqrt(ref.running_var.float() + BN_EPS)
                add("bn", path, "mean_drift", ((bn.running_mean.float() - ref.running_mean.float()).abs() / std).mean())
                add("bn", path, "var_drift", ((bn.running_var.float() - ref.running_var.float()).abs()
                                              / (ref.running_var.float() + BN_EPS)).mean())
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            add("model", "", "loss", loss.detach())
        elif isinstance(loss, (int, float)) and not isinstance(loss, bool):
            self.rows.append((step, "model", "", "loss", float(loss)))
        if self._grad_norms:
            add("model", "", "grad_norm", torch.linalg.vector_norm(torch.stack(list(self._grad_norms.values()))))
        if pending:
            device = pending[0][3].device  # one stack where the values are: one synchronisation
            values = torch.stack([v.detach().reshape(()).double().to(device) for *_, v in pending]).tolist()
            self.rows += [(step, kind, name, metric, value) for (kind, name, metric, _), value in zip(pending, values)]
        if self.held_out is not None:
            self.rows.append((step, "model", "", "output_sqnr_db", self._output_sqnr()))

    def _layer_metrics(self, layer: _Layer, step: int, add) -> None:
        now = layer.read(step)
        if now is None:
            return
        _, w, s, codes = now
        add("layer", layer.name, "scale", layer.point.scale.detach().float().mean())
        v = w / s
        add("layer", layer.name, "boundary_distance", (v - torch.floor(v) - 0.5).abs().mean())
        grad = self._grad_norms.get(f"{layer.name}.weight")
        add("layer", layer.name, "grad_norm", grad)
        before = layer.at(step - 1)
        if before is None:
            return
        changed = codes != before[3]
        add("layer", layer.name, "code_change", changed.float().mean())
        add("layer", layer.name, "update_to_step", ((w - before[1]).abs() / s).mean())
        earlier = layer.at(step - 2)
        if earlier is not None:
            flipped_back = changed & (codes == earlier[3])
            add("layer", layer.name, "oscillation", flipped_back.float().mean())
            if layer.flipped_back is not None:  # the same weights again: a weight stuck on its boundary
                add("layer", layer.name, "oscillation_repeat", (flipped_back & layer.flipped_back).float().mean())
            layer.flipped_back = flipped_back

    def _output_sqnr(self) -> float:
        """The model against the float model on ``held_out``, both in eval mode, no gradients;
        every module's training flag is put back (a frozen BN's stays as it was)."""
        modes = [(m, m.training) for m in (*self.model.modules(), *self.float_model.modules())]
        try:
            self.model.eval()
            self.float_model.eval()
            with torch.no_grad():
                ours = next((t for t in tensors_in(run_model(self.model, self.held_out)) if is_float(t)), None)
                theirs = next((t for t in tensors_in(run_model(self.float_model, self.held_out)) if is_float(t)), None)
        finally:
            for m, training in modes:
                m.training = training
        if ours is None or theirs is None or ours.shape != theirs.shape:
            return math.nan
        ref = theirs.double()
        return sqnr_db(float((ref ** 2).sum()), float(((ours.double() - ref) ** 2).sum()))

    # -- results -----------------------------------------------------------------------------
    @property
    def timeline(self):
        import pandas as pd

        return pd.DataFrame(self.rows, columns=COLUMNS)

    @property
    def findings(self):
        from qdebug.tools.watch.rules import findings

        return findings(self.timeline)


def watch(model: nn.Module, float_model: nn.Module | None = None, *, every: int = 10, held_out: Any = None) -> QatWatch:
    """Watch a QAT run in your own loop (module docstring): ``every`` steps, the points, layers,
    BN statistics (against ``float_model``) and the output SQNR on ``held_out``."""
    return QatWatch(model, float_model, every=every, held_out=held_out)
