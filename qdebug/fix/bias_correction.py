"""Empirical bias correction (Nagel et al. 2019, "Data-Free Quantization Through Weight
Equalization and Bias Correction", sec. 4.2; AIMET's "empirical bias correction") of a float model.

Quantizing a layer's weights shifts the mean of its output: E[W_q x] != E[W x], and a
systematic shift -- weights that all round the same way, small weights of one channel all
rounding to 0 while its inputs are all positive after a ReLU -- is not noise that averages out
downstream but an offset every later layer reads.  ``correct_bias(model, batches, qconfig)``
measures that offset per output channel on the data and subtracts it from the float model's
bias, so that once the corrected float model is calibrated again (the weights' grid does not
move: only biases change) its quantized layers' output means match the float ones again.

Measurement, one pass for every layer (per-layer error):

1. a deep copy of the float model is prepared with ``qconfig`` and ``mode`` and calibrated on
   ``batches`` (``qdebug.engine.prepare``/``calibrate``);
2. the batches are run through it again, the points in "fake" mode, and at every conv/linear
   call of the traced plan (``qdebug.measure.tap``) the quantized call's output before its output point
   (``Event.raw``: conv(x_q, W_q) + b, with mode "fuse_bn" and a folded BN W = W_bn f,
   b = (b - mu) f + beta, i.e. the BN is part of the call) is compared with the float layer
   (and, when folded, its BN in eval, applied in float64) computed on the SAME input x_q the
   quantized call received (the layer in its own dtype, the differences summed in float64):

       delta_c = mean over the batches and every other axis of  y_q[c] - y_float(x_q)[c]

   so delta is the layer's own error, (W_q - W) x_q, not the error that reaches it from above
   (which is the upstream layers' to correct).  Correcting every layer from this one pass is
   first order exact: an upstream correction moves a layer's input mean by delta_up, which
   changes its own delta by (W_q - W) delta_up, a product of two quantization errors (a
   sequential version, one calibration per layer, measured no better: docs/fix.md).  Apply it
   once, to the original float model: run on its own result it would subtract the shift again.

Where the correction goes (the float model's existing tensors: no key is added).  Let
f = gamma / sqrt(running_var + eps) be the paired BN's scale (gamma = 1 without affine).  A delta
measured after a folded BN is delta_post = delta, before it delta_pre = delta / f (0 where f = 0:
a zero channel's weight quantizes to 0 exactly, so its delta is 0 anyway); measured before the BN
(mode "with_bn"/"with_bn_reverse_fold", or no BN) delta_pre = delta, delta_post = delta f.

- the layer has a ``bias``:                  bias -= delta_pre
- no bias, its BN (a plan pair) is affine:   bn.bias -= delta_post   (BN's output moves by -delta_post)
- no bias, BN without affine parameters:     bn.running_mean += delta_pre   ((z - mu - d) / sigma)
- none of these: skipped, with the reason (adding a bias would add a state_dict key).

Skipped with a reason: layers called more than once in one forward or sharing their weight with
another module (one bias cannot serve several calls' errors), weights computed at each call
(weight norm), layers the engine does not quantize (no weight point under ``qconfig``), deltas
that are not finite.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from qdebug.engine import QConfig, calibrate, engine_state, prepare
from qdebug.engine.context import run_model
from qdebug.engine.modules import bn_scale_factor
from qdebug.errors import QDebugError, first_line
from qdebug.fix.pairs import check_float_model, own_weight, tied_weights

COLUMNS = ["layer", "channels", "shift_max", "shift_rms", "output_std", "held_by", "applied", "reason"]
BATCH_HINT = "check that every batch matches the model's input (the batches are run as model(*args, **kwargs))"


@dataclass
class _Layer:
    """One conv/linear call to measure: its float reference and the per-channel float64 sums."""

    path: str
    bn: str  # the BN paired with it in the plan ("" when none)
    folded: bool  # the prepared call's output includes that BN (mode "fuse_bn")
    axis: int  # the output's channel axis
    reference: nn.Module  # the float layer, in its own dtype
    fold: tuple[torch.Tensor, torch.Tensor] | None = None  # (f, beta - mu f) when folded, float64
    error_sum: torch.Tensor | None = None  # sum of y_q - y_float per channel
    float_sum: torch.Tensor | None = None
    float_square_sum: torch.Tensor | None = None
    count: int = 0

    def add(self, quantized: torch.Tensor, x: torch.Tensor) -> None:
        with torch.no_grad():
            # The reference in the layer's own dtype (float64 convs are slow on CPU); its rounding,
            # ~1e-7 of the output, is far below the quantization error measured; sums in float64.
            ref = self.reference(x.detach()).double()
            if self.fold is not None:
                shape = [1] * ref.dim()
                shape[self.axis] = -1
                ref = ref * self.fold[0].reshape(shape) + self.fold[1].reshape(shape)
            error = _per_channel(quantized.detach().double() - ref, self.axis)
            ref = _per_channel(ref, self.axis)
            sums = (error.sum(1), ref.sum(1), ref.square().sum(1))
        if self.error_sum is None:
            self.error_sum, self.float_sum, self.float_square_sum = sums
        else:
            self.error_sum += sums[0]
            self.float_sum += sums[1]
            self.float_square_sum += sums[2]
        self.count += error.shape[1]


@dataclass
class _Row:
    layer: str
    channels: int | None = None
    shift_max: float = math.nan
    shift_rms: float = math.nan
    output_std: float = math.nan
    held_by: str = ""
    applied: bool = False
    reason: str = ""


def correct_bias(model: nn.Module, batches: Any, qconfig: QConfig | dict | None = None, *, mode: str = "fuse_bn",
                 example_inputs: Any = None):
    """Empirical bias correction of a float model (module docstring).  Returns ``(new_model, report)``:
    ``new_model`` a deep copy of ``model`` (same class, module tree and state_dict keys) whose
    conv/linear biases (or their BNs' bias / running_mean) hold minus each output channel's mean
    quantization error measured on ``batches`` under ``qconfig`` (None: ``QConfig()``) and
    ``mode``; ``report`` a DataFrame with ``COLUMNS``, one row per conv/linear module.
    ``batches``: inputs (each a tensor, tuple of args or dict of kwargs), the calibration data;
    ``example_inputs`` traces the model (default: the first batch).  The float function changes on
    purpose: calibrate the result again before measuring it."""
    import pandas as pd

    check_float_model(model, "correct_bias")
    batches = [getattr(batch, "inputs", batch) for batch in batches]
    if not batches:
        raise QDebugError("correct_bias got no batches", "pass the calibration batches: the shift is measured on them")
    example = batches[0] if example_inputs is None else example_inputs
    new = copy.deepcopy(model)
    qconfig = QConfig() if qconfig is None else qconfig
    prepared = _guarded("while being traced on the example inputs",
                        lambda: prepare(new, qconfig, mode, example_inputs=example))
    layers, rows = _candidates(new, prepared, mode)
    if not rows:
        raise QDebugError("the model has no conv or linear layer: there is no bias to correct",
                          "bias correction applies to Conv1d/Conv2d/Linear layers")
    if layers:
        _calibrate(prepared, batches)
        _measure(prepared, layers, batches)
    modules = dict(new.named_modules())
    with torch.no_grad():
        for row in rows:
            layer = layers.get(row.layer)
            if layer is not None:
                _apply(row, layer, modules)
    report = pd.DataFrame([{c: getattr(r, c) for c in COLUMNS} for r in rows], columns=COLUMNS)
    report["channels"] = report["channels"].astype("Int64")  # <NA> where skipped before measuring
    return new, report


def _per_channel(t: torch.Tensor, axis: int) -> torch.Tensor:
    moved = t.movedim(axis, 0)
    return moved.reshape(moved.shape[0], -1)


def _guarded(what: str | Callable[[], str], run: Callable[[], Any]) -> Any:
    """``run()``, an exception raised by the user's model (or data) turned into one QDebugError
    saying ``what`` was run (a string, or a callable giving it once it failed)."""
    from qdebug.io.usercode import raised_by_user_code, where_raised

    try:
        return run()
    except QDebugError:
        raise
    except BaseException as exc:
        if not raised_by_user_code(exc):
            raise
        where = where_raised(exc)
        what = what() if callable(what) else what
        raise QDebugError(f"the model raised {type(exc).__name__} {what}: {first_line(exc)}"
                          + (f" (at {where})" if where else ""), BATCH_HINT) from exc


def _calibrate(prepared: nn.Module, batches: list) -> None:
    done = [0]  # batches calibrate finished: the failing one is the next

    def progress(count: int) -> None:
        done[0] = count

    _guarded(lambda: f"on batch {done[0] + 1} of {len(batches)} (calibration)",
             lambda: calibrate(prepared, batches, progress=progress))


def _candidates(new: nn.Module, prepared: nn.Module, mode: str) -> tuple[dict[str, _Layer], list[_Row]]:
    """The conv/linear modules of the plan: those to measure (path -> _Layer), and a report row for
    every one (the skipped ones with their reason)."""
    plan = engine_state(prepared).plan
    modules = dict(new.named_modules())
    prepared_modules = dict(prepared.named_modules())
    bn_of = dict(plan.pairs)
    tied = tied_weights(new)
    layers: dict[str, _Layer] = {}
    rows: list[_Row] = []
    seen: set[str] = set()
    for rec in plan.calls.values():
        if rec.category not in ("conv", "linear") or not rec.is_module:
            continue
        path = rec.name.split("#")[0]
        if path in seen:
            continue
        seen.add(path)
        row = _Row(path)
        rows.append(row)
        module = modules.get(path)
        bn = bn_of.get(path, "")
        row.reason = _refusal(plan, path, module, prepared_modules.get(path), bn and modules[bn], tied)
        if row.reason:
            continue
        row.channels = int(module.weight.shape[0])
        layer = _Layer(path, bn, folded=bool(bn) and mode == "fuse_bn",
                       axis=-1 if isinstance(module, nn.Linear) else 1,
                       reference=copy.deepcopy(module).eval())
        if layer.folded:
            f = bn_scale_factor(modules[bn]).detach().double()
            beta = modules[bn].bias.detach().double() if modules[bn].bias is not None else torch.zeros_like(f)
            layer.fold = (f, beta - modules[bn].running_mean.detach().double() * f)
        layers[path] = layer
    return layers, rows


def _refusal(plan, path: str, module: nn.Module | None, prepared_layer: nn.Module | None, bn: nn.Module | str,
             tied: set[str]) -> str:
    """Why the conv/linear module ``path`` cannot be corrected, or ""."""
    calls = plan.call_counts.get(path, 0)
    if calls != 1:
        return f"module {path} is called {calls} times in one forward (shared): one bias cannot hold each call's shift"
    if path in tied:
        return f"the weight of {path} is shared with another module"
    if not hasattr(prepared_layer, "weight_point"):
        return f"the engine does not quantize the weight of a {type(module).__name__}"
    if module is None or not own_weight(module):
        return f"the weight of {path} is computed (weight norm or a parametrization), not a Parameter"
    if prepared_layer.weight_point is None:
        return f"the weight of {path} is not quantized by this qconfig: no shift to correct"
    if getattr(module, "bias", None) is None and not bn:
        return (f"{path} has no bias and no BatchNorm right after it to hold the correction "
                "(adding a bias would change the state_dict keys)")
    return ""


def _measure(prepared: nn.Module, layers: dict[str, _Layer], batches: list) -> None:
    """Run ``batches`` through the calibrated ``prepared`` model, accumulating every layer's sums."""
    from qdebug.measure.tap import tap

    def listener(event) -> None:
        layer = layers.get(event.call.name)
        if layer is not None and event.args and isinstance(event.raw, torch.Tensor):
            layer.add(event.raw, event.args[0])

    prepared.eval()
    with tap(prepared, listener), torch.no_grad():
        for index, batch in enumerate(batches, 1):
            _guarded(f"on batch {index} of {len(batches)}", lambda: run_model(prepared, batch))


def _apply(row: _Row, layer: _Layer, modules: dict[str, nn.Module]) -> None:
    """Subtract the measured shift from the tensor that holds the channel's offset; fill ``row``."""
    if layer.count == 0:
        row.reason = f"{layer.path} was not reached on the batches"
        return
    delta = layer.error_sum / layer.count
    mean = layer.float_sum / layer.count
    std = (layer.float_square_sum / layer.count - mean.square()).clamp(min=0).sqrt()
    row.shift_max = delta.abs().max().item()
    row.shift_rms = delta.square().mean().sqrt().item()
    row.output_std = std.median().item()
    if not torch.isfinite(delta).all():
        row.reason = "the measured shift is not finite (non-finite values on the batches)"
        return
    module = modules[layer.path]
    bn = modules[layer.bn] if layer.bn else None
    f = bn_scale_factor(bn).detach().double() if bn is not None else None
    if layer.folded:  # measured after the BN
        pre = torch.where(f != 0, delta / torch.where(f != 0, f, 1.0), 0.0)
        post = delta
    else:
        pre = delta
        post = delta * f if f is not None else None
    if module.bias is not None:
        target, change, row.held_by = module.bias, -pre, f"{layer.path}.bias"
    elif bn.bias is not None:
        target, change, row.held_by = bn.bias, -post, f"{layer.bn}.bias"
    else:
        target, change, row.held_by = bn.running_mean, pre, f"{layer.bn}.running_mean"
    target.copy_((target.detach().double() + change).to(target.dtype))
    row.applied = True
    if layer.folded:
        row.reason = f"measured after the folded {layer.bn}"
