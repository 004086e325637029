"""An ONNX Runtime import checked against ONNX Runtime itself: ``mark_float_layers``, ``check_against_ort``.

``qdebug.onnx.qdq_import.import_qdq`` builds the engine model of a file ``quantize_static`` made;
this module holds it to the file:

- ``mark_float_layers`` asks ONNX Runtime which quantized layers it runs in float (its optimized
  graph: on x86 a QDQ group mixing int8 and uint8 codes is not fused) and marks their engine calls,
  which the quantized stage then computes in float32 as ORT does (``qdebug.engine.arithmetic``);
- ``check_against_ort`` runs ONNX Runtime on the file's bytes (``qdebug.onnx.session``) and the
  import on the same batch: the outputs in LSB of the output's scale, and each activation row's codes
  against its QuantizeLinear's, read as the compare stage reads them (``qdebug.onnx.stage.TapIndex``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from qdebug.errors import QDebugError
from qdebug.onnx.qdq_source import ARCHITECTURE_HINT, constant_tensors, original_name

FLOAT_LAYERS_ATTR = "ort_float_layers"  # on the engine state: {call: ONNX node} ORT runs in float
UNMARKED_ATTR = "ort_float_unmarked"  # on the engine state: float ONNX nodes no single engine call computes


def mark_float_layers(model: Any, imported: nn.Module, tensors: Any) -> dict[str, str]:
    """Ask ONNX Runtime which of ``model``'s quantized layers it runs in float (its optimized graph,
    ``qdebug.onnx.parity.ort_kernels``: on x86 a QDQ group mixing int8 and uint8 codes is not fused)
    and mark their engine calls (``qdebug.engine.arithmetic.run_in_float``): the import computes
    them in float32 as ORT does.  The activation row each one's output lands on says so in its note.
    Returns ``{call: node}``; a float node that no single engine call computes (its call left
    integer) is named in the note of its output's row and in the self-check's
    ``ort_float_unmarked``."""
    from qdebug.engine import engine_state
    from qdebug.engine.arithmetic import run_in_float
    from qdebug.interop.build import REPORT_ATTR
    from qdebug.onnx.names import ONNX_CATEGORIES, graph_of, row_through_fusion
    from qdebug.onnx.parity import session_and_kernels

    try:
        float_nodes = session_and_kernels(model)[3]
    except QDebugError:  # ONNX Runtime cannot load the file: the self-check says so
        return {}
    state = engine_state(imported)
    plan = state.plan
    nodes = {node.name: node for node in graph_of(model).nodes}
    rows = set(tensors.rows.values())
    found: dict[str, str] = {}
    unmarked: list[str] = []
    notes: dict[str, str] = {}  # point -> the note of its row
    for name in float_nodes:
        node = nodes.get(name)
        row = tensors.rows.get(node.output[0]) if node is not None and node.output else None
        categories = ONNX_CATEGORIES.get(node.op_type, frozenset()) if node is not None else frozenset()
        calls = [c.name for c in plan.calls.values()
                 if row is not None and c.category in categories and row_through_fusion(plan, c.name, rows) == row]
        if len(calls) == 1:
            found[calls[0]] = name
            point = plan.calls[calls[0]].output_point
            note = (f"ONNX Runtime runs {name} in float (no int8 kernel in its optimized graph): computed in "
                    "float32 as ORT does")
        else:
            unmarked.append(name)
            point = plan.calls[row].output_point if row in plan.calls else None
            note = (f"ONNX Runtime runs {name} in float, and {len(calls)} engine calls could compute it: "
                    "computed with integer kernels")
        if point is not None:
            notes[point] = "; ".join(n for n in (notes.get(point), note) if n)
    run_in_float(imported, found)
    for report_row in getattr(state, REPORT_ATTR, None) or []:
        if report_row["kind"] == "activation" and report_row["point"] in notes:
            report_row["note"] = "; ".join(n for n in (report_row["note"], notes[report_row["point"]]) if n)
    setattr(state, FLOAT_LAYERS_ATTR, dict(found))
    setattr(state, UNMARKED_ATTR, unmarked)
    return found


def ort_outputs(model: Any, example_inputs: Any, taps: list[str] | None = None) -> list[torch.Tensor]:
    """ONNX Runtime's CPU execution provider (default graph optimizations: as deployed) on
    ``example_inputs``, from the model's bytes; ``taps``: tensors added as graph outputs (after
    the model's own)."""
    from qdebug.engine.context import split_inputs
    from qdebug.engine.ops import tensors_in
    from qdebug.onnx.model_file import first_line
    from qdebug.onnx.session import cpu_session

    if taps:
        from onnx import helper

        model = copy.deepcopy(model)
        model.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in taps)
    session = cpu_session(model, "the model", "check it runs: onnxruntime.InferenceSession(path)")
    args, kwargs = split_inputs(example_inputs)
    tensors = [t for t in tensors_in((args, kwargs)) if isinstance(t, torch.Tensor)]
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(tensors):
        raise QDebugError(f"the ONNX model takes {len(names)} input(s), the example batch holds {len(tensors)}",
                          "pass --data with the inputs the model was exported with")
    try:
        outs = session.run(None, {n: t.detach().cpu().numpy() for n, t in zip(names, tensors)})
    except Exception as exc:
        raise QDebugError(f"ONNX Runtime cannot run the model on the example batch: {first_line(exc)}",
                          "pass --data with the inputs' shapes and dtypes the model was exported with") from None
    return [torch.from_numpy(o.copy()) for o in outs]


def output_scales(model: Any) -> list[float | None]:
    """The per-tensor scale of each graph output's DequantizeLinear, None where it is float."""
    from qdebug.onnx.names import graph_of

    graph = graph_of(model)
    constants = constant_tensors(model)
    scales = []
    for output in model.graph.output:
        node = graph.producer.get(output.name)
        scale = None
        if node is not None and node.op_type == "DequantizeLinear" and node.input[1] in constants:
            from qdebug.onnx.model_file import tensor_array

            values = tensor_array(constants[node.input[1]]).reshape(-1)
            scale = float(values[0]) if values.size == 1 else None
        scales.append(scale)
    return scales


def _check_rows(model: Any, imported: nn.Module, example_inputs: Any, rows: list[dict]) -> dict[str, Any]:
    """Each activation row's integer codes against ORT's on the example batch: the output of its
    QuantizeLinear (a graph output in a second session, tapped as the ONNX stage taps so that ORT
    keeps the deployed model's kernels: ``qdebug.onnx.stage``) and the engine's value at the row's
    point, on the file's grid.

    One layer's kernels agree exactly or by one code at a rounding tie, and such a code travels on
    through the layers after it (a random-weight ResNet with 8 residual blocks grows it to a few
    codes on some 15% of its last rows' codes); a tensor read onto the wrong call is tens of codes
    off.  So a row whose mean |code difference| exceeds ``ROW_MEAN_CODES`` is ``approximate``, with
    the measured difference.  A tensor ORT quantizes again after a pooling view on its input's grid
    has another shape than the row's point: not compared.  Returns the counts."""
    from qdebug.interop.check import _run_engine
    from qdebug.onnx.model_file import tensor_array
    from qdebug.onnx.stage import TapIndex

    quantizers = {}
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear":
            quantizers.setdefault(original_name(node.input[0]), node)
    checked = [r for r in rows if r["kind"] == "activation" and r["point"] and r["source"] in quantizers
               and r["status"] in ("exact", "moved")]
    if not checked:
        return {"rows_checked": 0, "rows_differing": []}
    # Tapped as the ONNX stage taps (``qdebug.onnx.stage``): a plain graph output on an int8 pair's codes
    # stops ONNX Runtime's uint8 conversion on x86, and the layers after it would run in float.
    index = TapIndex(model)
    taps = {id(r): index.tap(quantizers[r["source"]].input[0]) for r in checked}
    checked = [r for r in checked if taps[id(r)] is not None and taps[id(r)].how != "float"]
    tapped = index.tapped_model([taps[id(r)] for r in checked])
    by_name = dict(zip((o.name for o in tapped.graph.output), ort_outputs(tapped, example_inputs)))
    theirs = [taps[id(r)].value(by_name[taps[id(r)].tensor].numpy()) for r in checked]
    values: dict[str, list[torch.Tensor]] = {}
    _run_engine(imported, example_inputs, values)
    constants = constant_tensors(model)
    differing: list[str] = []
    compared, worst_mean, least_within = 0, 0.0, 1.0
    for row, dequantized in zip(checked, theirs):
        node = quantizers[row["source"]]
        scale = float(tensor_array(constants[node.input[1]]).reshape(-1)[0])
        zero = int(tensor_array(constants[node.input[2]]).reshape(-1)[0]) if len(node.input) > 2 else 0
        codes = torch.round(dequantized.double() / scale) + zero
        ours = [v for v in values.get(row["point"], []) if v.numel() == codes.numel()]
        if not ours or not codes.numel():
            continue
        mine = torch.round(ours[-1].double().flatten() / scale) + zero
        codes = codes.double().flatten()
        if row["status"] == "moved":  # ORT quantized before the ReLU (ReLU6) the engine's point follows
            relu = codes.clamp(min=zero)
            candidates = (relu, relu.clamp(max=zero + round(6 / scale)))
        else:
            candidates = (codes,)
        gap = min(((mine - c).abs() for c in candidates), key=lambda g: float(g.mean()))
        mean, within = float(gap.mean()), float((gap <= 1).double().mean())
        compared += 1
        worst_mean, least_within = max(worst_mean, mean), min(least_within, within)
        if mean > ROW_MEAN_CODES:
            row["status"] = "approximate"
            measured = (f"checked on the example batch: its codes differ from ONNX Runtime's by {mean:.2f} on "
                        f"average, up to {int(gap.max())} ({100 * within:.1f}% within 1)")
            row["note"] = "; ".join(n for n in (row["note"], measured) if n)
            differing.append(row["point"]) if row["point"] not in differing else None
    return {"rows_checked": compared, "rows_differing": differing, "rows_max_mean_codes": round(worst_mean, 4),
            "rows_min_within_1_code": round(least_within, 6)}


LSB_SLACK = 1e-3  # "within 1 LSB": |difference| <= (1 + this) scale (float32 dequantization rounds)
# A row's mean |code difference| from ORT's above this: approximate (the outputs' own tolerance,
# qdebug.interop.check.MEAN_LSB: one-code ties travelling on stay far below, a wrong tensor is tens).
ROW_MEAN_CODES = 4.0


def check_against_ort(model: Any, imported: nn.Module, example_inputs: Any) -> dict[str, Any]:
    """Compare the import with ONNX Runtime's own run of ``model`` on ``example_inputs``; refuse
    an unexplained mismatch (as ``qdebug.interop.check`` does for torch's converted models)."""
    from qdebug.engine import engine_state
    from qdebug.engine.context import split_inputs
    from qdebug.engine.ops import tensors_in
    from qdebug.interop.build import REPORT_ATTR
    from qdebug.interop.check import CHECK_ATTR, FLOAT_RELATIVE, MEAN_LSB

    want = ort_outputs(model, example_inputs)
    args, kwargs = split_inputs(example_inputs)
    with torch.no_grad():
        have = [t for t in tensors_in(imported(*args, **kwargs)) if torch.is_floating_point(t)]
    if len(want) != len(have) or any(tuple(a.shape) != tuple(b.shape) for a, b in zip(want, have)):
        raise QDebugError(f"the import's outputs ({[tuple(t.shape) for t in have]}) are not ONNX Runtime's "
                          f"({[tuple(t.shape) for t in want]})", ARCHITECTURE_HINT)
    scales = output_scales(model)
    check: dict[str, Any] = {"compared_with": "onnxruntime", "outputs": len(want)}
    diffs = [(a.double() - b.double()).abs() for a, b in zip(want, have)]
    check["max_abs_diff"] = max((float(d.max()) for d in diffs if d.numel()), default=0.0)
    if all(s for s in scales):
        steps = torch.cat([(d / s).flatten() for d, s in zip(diffs, scales)]) if diffs else torch.zeros(0)
        mean = float(steps.mean()) if steps.numel() else 0.0
        check.update(tolerance=f"mean |code difference| <= {MEAN_LSB:g} output LSB",
                     max_lsb=round(float(steps.max()), 3) if steps.numel() else 0.0, mean_lsb=round(mean, 4),
                     within_1_lsb=round(float((steps <= 1 + LSB_SLACK).double().mean()), 6) if steps.numel() else 1.0)
        within = mean <= MEAN_LSB
    else:
        size = sum(float(a.double().abs().sum()) for a in want)
        error = sum(float(d.sum()) for d in diffs)
        check.update(tolerance=f"mean |difference| <= {FLOAT_RELATIVE:g} of the mean |output| (a float output)",
                     max_lsb=None, relative_mean_diff=round(error / size, 6) if size else None)
        within = error <= FLOAT_RELATIVE * size
    check["within_tolerance"] = bool(within)
    state = engine_state(imported)
    rows = getattr(state, REPORT_ATTR, None) or []
    check.update(_check_rows(model, imported, example_inputs, rows))
    check["ort_float_layers"] = sorted(getattr(state, FLOAT_LAYERS_ATTR, None) or {})  # the engine calls
    if getattr(state, UNMARKED_ATTR, None):
        check["ort_float_unmarked"] = list(state.ort_float_unmarked)  # ONNX nodes
    explained = any(r["status"] in ("unmapped", "approximate") for r in rows)
    if not within and not explained:
        raise QDebugError(f"the import does not compute what ONNX Runtime computes: outputs differ by up to "
                          f"{check['max_abs_diff']:.3g} on the example batch (tolerance: {check['tolerance']}), and "
                          "no row of the import report explains it",
                          "report it to qdebug with the model, ONNX Runtime's version and the quantize_static "
                          "options; qdebug.onnx.qdq_import.import_qdq(..., check=False) imports it unchecked")
    setattr(state, CHECK_ATTR, check)
    return check
