"""The import checks itself: torch's model and the import run on the example batch, compared.

``self_check`` runs after ``build`` (``from_torch_ao``).  What it compares with (docs/interop.md,
*How the import checks itself*):

- a prepared fake-quant model (QAT; eager, FX, PT2E): a deep copy of it in eval mode with its
  observers off -- what torch evaluates -- and the import must be **bit-identical**: every output
  tensor, and every report row (the values torch's quantizer module outputs against the values
  at the row's engine point, a weight row's quantized weight too);
- a PTQ-prepared FX or PT2E model (observers only: its forward is float): torch's own
  conversion of a deep copy that computes with quantize/dequantize pairs in float
  (``convert_to_reference_fx``; ``convert_pt2e``); an eager PTQ model converts only to int8
  kernels: each imported point's scale and zero point are checked against the ones torch's
  observer computes instead;
- a converted model: the converted model itself (torch's int8 kernels).

PTQ and converted imports are not bit-identical (a value at a rounding tie, torch's float
requantization against the engine's integer one: docs/interop.md): the mean |code difference|
over the output must be at most ``MEAN_LSB`` steps of its grid (a float output: the mean
|difference| at most ``FLOAT_RELATIVE`` of the mean |output|).

A row whose values differ from torch's is not ``exact``: it becomes ``approximate``, its note
says by how much.  Outputs beyond the tolerance with nothing in the report to explain them (no
unmapped quantizer, no row a front end flagged approximate) are refused: ``QDebugError``.  The result is a dict kept on the engine
state (``CHECK_ATTR``; ``qdebug.interop.import_check``), and ``qdebug import`` prints it.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn as nn

from qdebug.engine import engine_state
from qdebug.engine.context import split_inputs
from qdebug.engine.ops import tensors_in
from qdebug.errors import QDebugError
from qdebug.interop.source import APPROXIMATE, EXACT, FROZEN, MOVED, UNMAPPED, SourceModel

CHECK_ATTR = "import_check"  # on the engine state: the self-check's result (a dict)
# A PTQ or converted import against torch: the mean |code difference| over the output, in steps of
# its grid.  One code at a rounding (near-)tie per kernel, travelling on: measured up to 2.0 on
# torchvision's Inception v3 converted, 1.3 ResNet-18, 0.8 MobileNetV3 against FX's reference model
# (docs/interop.md).  A real mistake (item 4: a BN applied twice) is tens of steps.
MEAN_LSB = 4.0
# A float output (no grid to count steps on): the mean |difference| relative to the mean |output|
# (measured up to 0.056 for the same models).
FLOAT_RELATIVE = 0.1
_REPORT_HINT = ("report it to qdebug with the model, the torch.ao flow and torch's version; "
                "from_torch_ao(..., check=False) imports it unchecked")


def self_check(torch_model: nn.Module, model: nn.Module, source: SourceModel, example_inputs: Any,
               folded_by_choice: bool = False) -> dict[str, Any]:
    """Compare the import ``model`` with torch's ``torch_model`` on ``example_inputs``; edit the
    report rows of the points that differ; refuse an unexplained mismatch.  Returns the result.
    ``folded_by_choice``: the user asked for qat_mode fuse_bn, which folds torch's Conv-BN pairs
    (equal within float rounding): a difference is explained by it."""
    from qdebug.interop.build import REPORT_ATTR

    state = engine_state(model)
    rows = list(getattr(state, REPORT_ATTR, None) or [])
    flagged = folded_by_choice and bool(source.bn_pairs) or any(r["status"] in (UNMAPPED, APPROXIMATE) for r in rows)
    converted = source.flow.endswith("-converted")
    if source.stage == "qat" and not converted:
        kind, tolerance = "fake-quant", "bit-identical"
        reference, captures = _fake_quant_twin(torch_model, source.flow, rows)
    elif converted:
        kind, tolerance = "converted", f"mean |code difference| <= {MEAN_LSB:g} output LSB"
        reference, captures = torch_model, None
    else:
        kind, tolerance = "ptq", f"mean |code difference| <= {MEAN_LSB:g} output LSB"
        reference, captures = _ptq_reference(torch_model, source.flow), None
    why_not = None
    if isinstance(reference, str):  # torch could not convert it: its qparams are what can be checked
        reference, why_not = None, reference
    check: dict[str, Any] = {"compared_with": kind, "tolerance": tolerance}
    if reference is None:
        check["compared_with"] = "quantizer qparams"
        check["tolerance"] = "equal scale and zero point"
        wrong = _qparams_check(torch_model, state, rows)
        check.update(outputs=0, max_abs_diff=None, max_lsb=None, within_tolerance=not wrong,
                     note=why_not or "torch's eager convert computes with int8 kernels only: each imported scale "
                                     "and zero point was checked against its observer's instead")
        if wrong:
            raise QDebugError(f"the import does not hold torch's qparams: {wrong[0]}", _REPORT_HINT)
        setattr(state, CHECK_ATTR, check)
        return check

    want = _run(reference, example_inputs, captures)
    engine_values: dict[str, list[torch.Tensor]] = {}
    have = _run_engine(model, example_inputs, engine_values)
    want_t = [t for t in tensors_in(want) if torch.is_floating_point(t)]
    have_t = [t for t in tensors_in(have) if torch.is_floating_point(t)]
    if len(want_t) != len(have_t) or any(a.shape != b.shape for a, b in zip(want_t, have_t)):
        raise QDebugError(f"the import's outputs ({_shapes(have_t)}) are not torch's ({_shapes(want_t)})", _REPORT_HINT)
    scales = _output_scales(model, have_t, engine_values)
    diffs = [float((a.float() - b.float()).abs().max()) if a.numel() else 0.0 for a, b in zip(want_t, have_t)]
    lsbs = [d / s if s else None for d, s in zip(diffs, scales)]
    max_diff = max(diffs, default=0.0)
    max_lsb = max((x for x in lsbs if x is not None), default=None) if all(x is not None for x in lsbs) else None
    check.update(outputs=len(want_t), max_abs_diff=max_diff,
                 max_lsb=None if max_lsb is None else round(max_lsb, 3))
    if kind == "fake-quant":
        within = max_diff == 0.0
    else:
        mean = _mean_lsb(want_t, have_t, scales)
        check["mean_lsb"] = None if mean is None else round(mean, 4)
        if mean is not None:
            within = mean <= MEAN_LSB
        else:
            size = sum(float(t.double().abs().sum()) for t in want_t)
            error = sum(float((a.double() - b.double()).abs().sum()) for a, b in zip(want_t, have_t))
            check["relative_mean_diff"] = round(error / size, 6) if size else None
            within = error <= FLOAT_RELATIVE * size
            check["tolerance"] = (f"mean |difference| <= {FLOAT_RELATIVE:g} of the mean |output| (a float output: "
                                  f"no grid to count steps on)")
    check["within_tolerance"] = bool(within)
    changed = _check_rows(rows, captures, engine_values, model) if captures is not None else []
    check["rows_differing"] = changed
    outputs = (f"the model's outputs differ from torch's by up to {max_diff:.3g}"
               f"{f' ({max_lsb:.3g} output LSB)' if max_lsb is not None else ''} on the example batch"
               if max_diff else "the model's outputs equal torch's on the example batch")
    for row in rows:
        if row["status"] == APPROXIMATE and "checked on the example batch" not in row["note"]:
            # flagged by a front end: what the point itself outputs may equal torch's quantizer
            # (the difference is on the edge torch leaves float), the outputs say how much it matters
            row["note"] = "; ".join(n for n in (row["note"], outputs) if n)
    if not within and not flagged:
        what = f"{max_diff:.3g}" + (f" ({max_lsb:.3g} output LSB)" if max_lsb is not None else "")
        first = f"; the first point that differs: {changed[0]!r}" if changed else ""
        raise QDebugError(f"the import does not compute what torch's model computes: outputs differ by up to {what} "
                          f"on example_inputs (tolerance: {check['tolerance']}), and no row of the import report "
                          f"explains it{first}", _REPORT_HINT)
    setattr(state, REPORT_ATTR, rows)
    setattr(state, CHECK_ATTR, check)
    return check


def import_check(model: nn.Module) -> dict[str, Any]:
    """The self-check of a model ``from_torch_ao`` built, or {} (an imported checkpoint keeps it
    in its meta only when ``qdebug import`` wrote it)."""
    return dict(getattr(engine_state(model), CHECK_ATTR, None) or {})


# -- references --------------------------------------------------------------------------

def _fake_quant_twin(model: nn.Module, flow: str, rows: list[dict]) -> tuple[nn.Module, dict]:
    """A deep copy of ``model`` as torch evaluates it (eval mode, observers off), and a capture
    dict filled by forward hooks on the quantizer modules the report rows name."""
    twin = copy.deepcopy(model)
    if flow == "pt2e":
        from qdebug.interop.pt2e import import_torchao

        import_torchao()
        from torchao.quantization.pt2e import move_exported_model_to_eval

        move_exported_model_to_eval(twin)
    twin.eval()
    for module in twin.modules():
        enabled = getattr(module, "observer_enabled", None)
        if isinstance(enabled, torch.Tensor):
            enabled.fill_(0)
    captures: dict[str, list[torch.Tensor]] = {}
    modules = dict(twin.named_modules())
    for name in {r["source"] for r in rows if r["source"] and r["point"]}:
        module = modules.get(name)
        if module is None:
            continue

        def hook(_module, _args, output, name=name):
            if isinstance(output, torch.Tensor) and torch.is_floating_point(output):
                captures.setdefault(name, []).append(output.detach().clone())

        module.register_forward_hook(hook)
    return twin, captures


def _ptq_reference(model: nn.Module, flow: str) -> nn.Module | str | None:
    """torch's conversion of a PTQ-prepared copy that computes in float with quantize/dequantize
    pairs (FX's reference model, PT2E's converted graph); None for eager (int8 kernels only), the
    reason when torch cannot convert it."""
    try:
        if flow == "fx":
            from torch.ao.quantization.quantize_fx import convert_to_reference_fx

            return convert_to_reference_fx(copy.deepcopy(model))
        if flow == "pt2e":
            from qdebug.interop.pt2e import _quiet, import_torchao

            import_torchao()
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

            with _quiet():
                return convert_pt2e(copy.deepcopy(model))
    except Exception as exc:  # torch's own conversion of the user's model
        return (f"torch's reference conversion failed ({type(exc).__name__}): each imported scale and zero point "
                "was checked against its observer's instead")
    return None


def _run(model: nn.Module, example_inputs: Any, captures: dict | None) -> Any:
    args, kwargs = split_inputs(example_inputs)
    try:
        with torch.no_grad():
            out = model(*args, **kwargs)
    except Exception as exc:  # torch's own model on its own example batch
        raise QDebugError(f"torch's model does not run on example_inputs for the import's check: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                          "pass one batch of the inputs the model was prepared with") from None
    return _dequantized(out)


def _dequantized(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.dequantize() if out.is_quantized else out
    if isinstance(out, (list, tuple)):
        return type(out)(_dequantized(o) for o in out) if not hasattr(out, "_fields") else \
            type(out)(*(_dequantized(o) for o in out))
    if isinstance(out, dict):
        return {k: _dequantized(v) for k, v in out.items()}
    return out


def _run_engine(model: nn.Module, example_inputs: Any, values: dict[str, list[torch.Tensor]]) -> Any:
    """The import's outputs; ``values``: call name -> the values flowing on from it."""
    from qdebug.measure.tap import tap

    def listener(event) -> None:
        if isinstance(event.out, torch.Tensor) and torch.is_floating_point(event.out):
            values.setdefault(event.call.name, []).append(event.out.detach().clone())

    args, kwargs = split_inputs(example_inputs)
    with torch.no_grad(), tap(model, listener):
        return model(*args, **kwargs)


def _shapes(tensors: list[torch.Tensor]) -> str:
    return ", ".join(str(tuple(t.shape)) for t in tensors) or "none"


def _output_scales(model: nn.Module, outputs: list[torch.Tensor], values: dict) -> list[float | None]:
    """The per-tensor scale of the engine point each output lands on, or None (a float output)."""
    state = engine_state(model)
    calls = state.plan.calls
    scales: list[float | None] = []
    for out in outputs:
        scale = None
        for name, seen in reversed(list(values.items())):
            if any(v.shape == out.shape and torch.equal(v, out) for v in seen):
                rec = calls.get(name)
                point = state.points.get(rec.output_point) if rec is not None and rec.output_point else None
                if point is not None and point.mode == "fake" and point.scale.numel() == 1:
                    scale = float(point.scale)
                break
        scales.append(scale)
    return scales


def _mean_lsb(want: list[torch.Tensor], have: list[torch.Tensor], scales: list[float | None]) -> float | None:
    if not want or any(s is None for s in scales):
        return None
    total = sum(float(((a.double() - b.double()).abs() / s).sum()) for a, b, s in zip(want, have, scales))
    count = sum(a.numel() for a in want)
    return total / count if count else 0.0


# -- rows --------------------------------------------------------------------------------

def _engine_value(model: nn.Module, row: dict, values: dict) -> list[torch.Tensor]:
    """The values at ``row``'s engine point: a weight's quantized weight, an activation's output."""
    if row["kind"] == "weight":
        layer_path = row["point"].rsplit(".weight", 1)[0]
        try:
            layer = model.get_submodule(layer_path)
        except AttributeError:
            return []
        if not hasattr(layer, "quantized_input_weight"):
            return []
        with torch.no_grad():
            weight, _ = layer.quantized_input_weight()
            return [layer._quantized_weight(weight, None).detach()]
    return values.get(row["point"], [])


def _check_rows(rows: list[dict], captures: dict, values: dict, model: nn.Module) -> list[str]:
    """Mark each row whose engine values differ from its torch quantizer's ``approximate``, with the
    measured difference; returns the points that differ, in report order."""
    differing = []
    for row in rows:
        if row["status"] not in (EXACT, MOVED, FROZEN, APPROXIMATE) or not row["point"]:
            continue
        theirs = captures.get(row["source"])
        ours = _engine_value(model, row, values)
        if not theirs or not ours:
            continue
        worst = 0.0
        compared = False
        if row["status"] == MOVED:  # torch quantized before the ReLU the engine's point follows
            theirs = [f(t) for t in theirs for f in (torch.relu, lambda t: t.clamp(0, 6))]
        for value in ours:
            candidates = [t for t in theirs if t.numel() == value.numel()]
            if not candidates:
                continue
            compared = True
            worst = max(worst, min(_difference(t, value) for t in candidates))
        if not compared or worst == 0.0:
            continue
        scale = row.get("scale_max")
        steps = f" ({worst / scale:.3g} step(s) of its grid)" if scale and math.isfinite(scale) else ""
        measured = f"checked on the example batch: differs from torch's by up to {worst:.3g}{steps}"
        row["status"] = APPROXIMATE
        row["note"] = "; ".join(n for n in (row["note"], measured) if n)
        differing.append(row["point"])
    return differing


def _difference(theirs: torch.Tensor, ours: torch.Tensor) -> float:
    """max |difference| of two tensors of one size; of another shape (torch quantizes after a
    reshape: torch.ao's MHA after attn.V's transpose), of their values sorted: the same values in
    another layout are equal (the outputs are compared element by element)."""
    a, b = theirs.flatten().float(), ours.flatten().float()
    if theirs.shape != ours.shape:
        a, b = a.sort().values, b.sort().values
    return float((a - b).abs().max()) if a.numel() else 0.0


def _qparams_check(model: nn.Module, state: Any, rows: list[dict]) -> list[str]:
    """Rows whose engine point does not hold the scale and zero point torch's observer computes."""
    from qdebug.interop.source import torch_qparams

    modules = dict(model.named_modules())
    wrong = []
    for row in rows:
        if row["status"] not in (EXACT, MOVED, FROZEN, APPROXIMATE) or not row["point"]:
            continue
        module, point = modules.get(row["source"]), state.points.get(row["point"])
        if module is None or point is None or not hasattr(module, "calculate_qparams"):
            continue
        scale, zero_point = torch_qparams(module, row["source"])
        ours, zp = point.qparams()
        if ours.numel() != scale.numel() or not torch.equal(ours.detach().flatten().float(), scale.flatten()) or \
                not torch.equal(zp.flatten().to(torch.int32), zero_point.flatten()):
            wrong.append(f"{row['point']!r} has scale {ours.flatten()[:3].tolist()}, torch's {row['source']!r} "
                         f"{scale.flatten()[:3].tolist()}")
    return wrong
