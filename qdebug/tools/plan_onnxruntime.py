"""A suggest plan written back as ONNX Runtime's ``quantize_static`` options.

For a model imported from an ORT-quantized QDQ file (``qdebug import --from onnx-qdq``), the
import report names, for every engine point, the ONNX tensor ORT quantized there (``source``:
an activation's tensor, a weight's float initializer, as quantize_static saw them).  A plan's
point at N bits becomes an entry of ``extra_options["TensorQuantOverrides"]`` keyed by that name:
``[{"quant_type": QuantType.QInt16}]`` (``QUInt16`` for an unsigned point; a per-channel weight
adds its ``axis``); a point the plan leaves float puts the nodes that make and read the tensor in
``nodes_to_exclude`` (ORT quantizes a tensor when any node next to it is quantized).  Every tensor ORT quantizes again on the point's grid (a Flatten's output
after a GlobalAveragePool) is raised with it: the same values, one width.

ONNX Runtime 1.32 raises the model's opset to 21 itself when an override asks for 16 bits (the
opset where QuantizeLinear takes int16); ORT before 1.17 needs ``"UseQDQContribOps": True``
(com.microsoft QuantizeLinear).  ORT quantizes to 4 (weights), 8 and 16 bits: other widths are
rows with ``expressible`` False and the reason, never dropped.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import pandas as pd
import torch.nn as nn

from qdebug.engine import engine_state
from qdebug.errors import QDebugError

COLUMNS = ["point", "tensor", "onnx_name", "quant_type", "axis", "expressible", "reason", "engine_points"]
MAPPED = ("exact", "moved", "frozen", "approximate")  # report statuses of an ORT quantizer at an engine point
FLOW = "onnx-qdq"


def check_imported(model: nn.Module) -> None:
    """Refuse a model not imported from an ORT-quantized ONNX file: no ONNX names to write back to."""
    from qdebug.interop.build import FLOW_ATTR, REPORT_ATTR

    state = engine_state(model)
    if not getattr(state, REPORT_ATTR, None) or getattr(state, FLOW_ATTR, None) != FLOW:
        raise QDebugError("--to onnxruntime needs a model imported from an ONNX file ONNX Runtime quantized: this "
                          "checkpoint has no ONNX tensor names to write the plan back to",
                          "import it with qdebug import model.onnx --from onnx-qdq --model ..., and run suggest on "
                          "the import")


def quant_type(bits: int, signed: bool, kind: str) -> str | None:
    """ORT's QuantType name for a width, or None when ORT has none."""
    if bits in (8, 16) or (bits == 4 and kind == "weight"):
        return f"Q{'' if signed else 'U'}Int{bits}"
    return None


def onnxruntime_plan(model: nn.Module, overrides: Mapping[str, Mapping[str, Any]], *, bits: int = 16,
                     nodes: Mapping[str, list[str]] | None = None) -> pd.DataFrame:
    """One row per ONNX tensor the plan changes (``COLUMNS``); ``attrs["meta"]``: bits, counts.

    ``model``: the imported engine model the plan was found on; ``overrides``: the plan's
    (``suggest.json``'s ``plan.overrides``); ``nodes``: tensor -> the float model's nodes that make
    and read it (``qdebug.onnx.qdq_source.tensor_nodes``, kept on the import and in the checkpoint's
    ``meta["onnx_nodes"]``), for a point the plan leaves float.
    """
    from qdebug.onnx.qdq_source import NODES_ATTR

    from qdebug.interop.build import REPORT_ATTR
    from qdebug.tools.plan_torch_ao import plan_entries

    check_imported(model)
    state = engine_state(model)
    nodes = dict(nodes if nodes is not None else getattr(state, NODES_ATTR, None) or {})
    report = list(getattr(state, REPORT_ATTR, None) or [])
    by_point: dict[tuple[str, str], list[str]] = {}
    for r in report:
        if r["status"] in MAPPED and r["point"] and r["source"] and r["kind"] in ("weight", "activation"):
            by_point.setdefault((r["kind"], r["point"]), []).append(r["source"])
    rows = []
    for glob, kind, spec, group, c, label in plan_entries(model, overrides, bits):
        base = {"point": label, "tensor": kind, "onnx_name": "", "quant_type": "", "axis": None, "expressible": False,
                "reason": "", "engine_points": ", ".join(c.points) if c else ""}
        points = c.points if c else ((glob,) if kind == "activation" else (f"{glob}.weight",))
        sources = [s for p in points for s in by_point.get((kind, p), [])]
        if group:
            rows.append({**base, "reason": "ONNX Runtime has no grouped weights: a smaller group cannot be written"})
            continue
        if not sources:
            rows.append({**base, "reason": "ONNX Runtime quantizes nothing here: the engine point has no ORT "
                                           "quantizer"})
            continue
        if spec is None:
            for source in sources:
                around = nodes.get(source) if kind == "activation" else None
                rows.append({**base, "onnx_name": ", ".join(around or []) or source, "quant_type": "float",
                             "expressible": bool(around),
                             "reason": "" if around else (
                                 "a weight stays float when its layer's node is excluded, which leaves its "
                                 "activations float too" if kind == "weight" else
                                 "the import does not record the nodes around this tensor (re-import it)")})
            continue
        # The plan changes the width; signedness and granularity stay the imported point's.
        now = state.points[points[0]].spec
        qtype = quant_type(int(spec.get("bits", bits)), bool(spec.get("signed", now.signed)), kind)
        for source in sources:
            row = {**base, "onnx_name": source, "quant_type": qtype or "", "expressible": qtype is not None}
            if qtype is None:
                row["reason"] = f"ONNX Runtime quantizes to 4 (weights), 8 or 16 bits, not {spec.get('bits')}"
            elif kind == "weight" and spec.get("per_channel", now.per_channel):
                row["axis"] = int(spec.get("ch_axis", now.ch_axis))
            rows.append(row)
    frame = pd.DataFrame(rows, columns=COLUMNS)
    frame["axis"] = pd.Series([r["axis"] for r in rows], index=frame.index, dtype=object)  # an int, or None
    written = int(frame["expressible"].sum()) if len(frame) else 0
    frame.attrs["meta"] = {"flow": FLOW, "bits": bits, "expressible": written, "not_expressible": len(frame) - written}
    return frame


def quantize_static_options(frame: pd.DataFrame) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """(TensorQuantOverrides with QuantType *names*, nodes_to_exclude) of the expressible rows."""
    overrides: dict[str, list[dict[str, Any]]] = {}
    exclude: list[str] = []
    for row in frame.to_dict("records"):
        if not row["expressible"]:
            continue
        if row["quant_type"] == "float":
            exclude += [n for n in row["onnx_name"].split(", ") if n not in exclude]
            continue
        entry: dict[str, Any] = {"quant_type": row["quant_type"]}
        if row["axis"] is not None:
            entry["axis"] = int(row["axis"])
        overrides[row["onnx_name"]] = [entry]
    return overrides, exclude


def json_document(frame: pd.DataFrame) -> str:
    """``meta``, ``extra_options`` (TensorQuantOverrides, QuantType as names: ``QuantType[name]``),
    ``nodes_to_exclude`` and ``rows`` (``COLUMNS``), not-expressible rows included."""
    overrides, exclude = quantize_static_options(frame)
    meta = dict(frame.attrs["meta"])
    meta["apply"] = ("quantize_static(..., nodes_to_exclude=nodes_to_exclude, extra_options={**yours, "
                     "'TensorQuantOverrides': {name: [{**e, 'quant_type': QuantType[e['quant_type']]} for e in v] "
                     "for name, v in extra_options['TensorQuantOverrides'].items()}})")
    rows = [{k: bool(v) if k == "expressible" else v for k, v in row.items()} for row in frame.to_dict("records")]
    return json.dumps({"meta": meta, "extra_options": {"TensorQuantOverrides": overrides},
                       "nodes_to_exclude": exclude, "rows": rows}, indent=2)


def python_source(frame: pd.DataFrame) -> str:
    """The options as a Python module: ``TENSOR_QUANT_OVERRIDES``, ``NODES_TO_EXCLUDE`` and
    ``extra_options(yours)``; names are Python literals (``repr``), reasons escaped comments."""
    from qdebug.safe_text import escaped

    overrides, exclude = quantize_static_options(frame)
    meta = frame.attrs["meta"]
    lines = [f'"""qdebug suggest\'s plan for onnxruntime.quantization.quantize_static: {meta["expressible"]} '
             'tensor(s) (generated by qdebug suggest --to onnxruntime).', "",
             "    quantize_static(float_model, quantized_model, reader, quant_format=QuantFormat.QDQ, ...,",
             "                    nodes_to_exclude=NODES_TO_EXCLUDE, extra_options=extra_options({...yours...}))",
             "", "onnxruntime 1.32 raises the model to opset 21 for 16-bit types itself (older: add",
             '"UseQDQContribOps": True to extra_options)."""', "",
             "from onnxruntime.quantization import QuantType", ""]
    skipped = [f"#   {escaped(r.point)} ({r.tensor}): {escaped(r.reason)}" for r in frame.itertuples()
               if not r.expressible]
    if skipped:
        lines += ["# Not expressible in ONNX Runtime (not in these options):", *skipped, ""]
    lines.append("TENSOR_QUANT_OVERRIDES = {")
    for name, entries in overrides.items():
        items = ", ".join(f"{k!r}: QuantType.{v}" if k == "quant_type" else f"{k!r}: {v!r}"
                          for k, v in entries[0].items())
        lines.append(f"    {name!r}: [{{{items}}}],")
    lines += ["}", f"NODES_TO_EXCLUDE = {exclude!r}", "", "",
              "def extra_options(yours=None):",
              '    """Your quantize_static extra_options with the plan\'s TensorQuantOverrides added (the plan\'s',
              '    entry wins for a tensor both name)."""',
              "    options = dict(yours or {})",
              '    options["TensorQuantOverrides"] = {**dict(options.get("TensorQuantOverrides") or {}),',
              "                                       **TENSOR_QUANT_OVERRIDES}",
              "    return options", ""]
    return "\n".join(lines)


__all__ = ["check_imported", "onnxruntime_plan", "quantize_static_options", "python_source", "json_document",
           "COLUMNS"]
