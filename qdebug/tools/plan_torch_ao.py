"""A suggest plan written back for the torch.ao flow an imported model came from.

``suggest`` verifies a plan of int16 points on the engine model; for a model imported from
torch.ao (``qdebug.from_torch_ao``, ``qdebug import``) this module turns it into what that
flow takes, through the import report (torch quantizer -> engine point), inverted:

- eager (``prepare``/``prepare_qat``): a ``qconfig`` per module, set after fusion and before
  ``prepare``: the module whose ``activation_post_process`` quantizes the point's output, the
  layer whose ``weight_fake_quant`` (PTQ: ``qconfig.weight()``) quantizes the weight;
- FX (``prepare_fx``/``prepare_qat_fx``): a ``QConfigMapping`` on the backend default with
  ``set_module_name(layer, qconfig)`` per weight point (prepare accepts a wider weight with
  torch's own backend configs);
- PT2E (``prepare_pt2e``/``prepare_qat_pt2e``): ``PlanQuantizer(quantizer)`` wraps the user's
  own quantizer and, after it annotated, gives the plan's layers' weights (the ``get_attr``
  of ``<layer>.weight`` a node's annotation quantizes) a wider spec; nothing else changes
  (a quantizer's per-module config would: the x86 quantizer leaves a conv with its own
  config out of its conv-add-relu patterns, so other activations move).

What torch cannot express is a row with ``expressible`` False and the reason, never dropped:
an FX or PT2E activation (FX gives a node one activation qconfig for its inputs and its
output, a PT2E quantizer one config per module for its nodes' inputs and outputs: at int16
the node's inputs are quantized at 16 bits too, and an 8-bit reader quantizes the value
again at 8 bits -- never the plan), a point torch does not quantize, a quantizer
shared with points the plan leaves at their width (a module called twice), a quantizer
inside a module torch.ao swaps in at ``prepare`` (LSTM, MHA internals), a smaller group.

16 bits in torch.ao: the slot's own observer or fake quant ``with_args(dtype=torch.int16,
quant_min=-32768, quant_max=32767, reduce_range=False)`` (N bits < 16: that range of N bits).
torch.int16, not qint32: a PTQ observer's range is read, as torch's convert uses it, as its
dtype's full range (``qdebug.interop.source.full_range``), which for qint32 is 32 bits.
``python_source`` and ``json_document`` write the rows as a Python module and a JSON list.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Mapping

import pandas as pd
import torch.nn as nn

from qdebug.engine import engine_state
from qdebug.errors import QDebugError

COLUMNS = ["point", "tensor", "module_name", "source", "dtype", "quant_min", "quant_max", "expressible", "reason",
           "engine_points"]
MAPPED = ("exact", "moved", "frozen")  # report statuses of a torch quantizer that computes the engine point
FLOWS = {"eager": "eager", "eager-converted": "eager", "fx": "fx", "fx-converted": "fx", "pt2e": "pt2e",
         "pt2e-converted": "pt2e"}
SUFFIXES = (".activation_post_process", ".weight_fake_quant", ".qconfig.weight()")


def int16_range(bits: int) -> tuple[int, int]:
    """The signed range torch.ao's int16 observers take for ``bits``."""
    half = 2 ** (bits - 1)
    return -half, half - 1


def check_imported(model: nn.Module) -> str:
    """The torch.ao flow (eager, fx or pt2e) ``model`` was imported from, or the error saying why
    a plan cannot go back to one: a native checkpoint (qdebug's own qconfig, no torch quantizer:
    module names alone would not say which torch observer or qconfig slot a point is)."""
    from qdebug.interop.build import FLOW_ATTR, REPORT_ATTR

    state = engine_state(model)
    report = getattr(state, REPORT_ATTR, None)
    flow = getattr(state, FLOW_ATTR, None)
    if not report or flow is None:
        raise QDebugError("--to torch-ao needs a model imported from torch.ao: this checkpoint is qdebug's own, "
                          "with no torch quantizer to write the plan back to",
                          "apply the plan with qdebug calibrate --qconfig plan.toml, or import your torch.ao model "
                          "(qdebug import) and run suggest on the import")
    if flow not in FLOWS:
        other = " (--to onnxruntime writes ONNX Runtime's quantize_static options)" if flow == "onnx-qdq" else ""
        raise QDebugError(f"--to torch-ao writes eager, FX and PT2E configs; this model was imported from {flow}",
                          f"apply the plan with qdebug calibrate --qconfig plan.toml{other}")
    return FLOWS[flow]


def plan_entries(model: nn.Module, overrides: Mapping[str, Mapping[str, Any]], bits: int) -> Iterator[tuple]:
    """Each entry of a suggest plan's ``overrides`` on ``model``: (glob, kind, spec, group_size, its
    suggest candidate or None, the point's name for a row) -- what a plan writer (torch.ao,
    ONNX Runtime) turns into its tool's options."""
    from qdebug.tools.suggest import _point_name, candidates

    quantizable = [n for n, p in engine_state(model).points.items() if p.mode == "fake"]
    found = {(c.glob, c.kind, c.group_size): c for c in candidates(model, quantizable, bits)}
    for glob, entry in overrides.items():
        for kind, spec in (entry or {}).items():
            group = (spec or {}).get("group_size")
            c = found.get((glob, kind, group))
            label = _point_name(c) if c else glob if kind == "activation" else f"{glob}.weight"
            yield glob, kind, spec, group, c, label


def torch_ao_plan(model: nn.Module, overrides: Mapping[str, Mapping[str, Any]], *, bits: int = 16,
                  qat: bool | None = None) -> pd.DataFrame:
    """One row per plan entry (``COLUMNS``): where its torch quantizer's qconfig goes.

    ``model``: the imported engine model the plan was found on; ``overrides``: the plan's
    (``frame.attrs["plan"]["overrides"]``, suggest.json's ``plan.overrides``).  ``attrs["meta"]``:
    ``flow`` (eager/fx), ``qat`` (from the report unless given), ``bits``, ``dtype``.
    """
    from qdebug.interop.build import REPORT_ATTR

    flow = check_imported(model)
    if not 2 <= bits <= 16:
        raise QDebugError(f"bits must be in [2, 16], got {bits}", "e.g. bits=16")
    state = engine_state(model)
    report = list(getattr(state, REPORT_ATTR, None) or [])
    if qat is None:
        qat = any(str(r["source"]).endswith(".weight_fake_quant") for r in report)
    low, high = int16_range(bits)
    modules = dict(model.named_modules())
    by_point: dict[str, list[dict]] = {}
    by_source: dict[str, list[dict]] = {}
    for r in report:
        if r["status"] in MAPPED and r["point"] and r["source"]:
            by_point.setdefault(r["point"], []).append(r)
            by_source.setdefault(r["source"], []).append(r)
    left_float = {r["point"] for r in report if r["status"] == "float"}
    rows = []
    for glob, kind, spec, group, c, label in plan_entries(model, overrides, bits):
        row = {"point": label, "tensor": kind, "module_name": "", "source": "",
               "dtype": _dtype(bits), "quant_min": low, "quant_max": high,
               "expressible": False, "reason": "", "engine_points": ", ".join(c.points) if c else ""}
        if spec is None:
            row["reason"] = "kept in float: torch.ao's qconfig None on the module (not a width)"
        elif group:
            row["reason"] = "torch.ao has no grouped weights: a smaller group cannot be written"
        elif c is None and ({glob, f"{glob}.weight"} & left_float):
            row["reason"] = "torch quantizes nothing here: the engine point has no torch quantizer"
        elif c is None:
            row["reason"] = f"not a point of this model below {bits} bits"
        else:
            _locate(row, c, flow, by_point, by_source, modules)
        rows.append(row)
    frame = pd.DataFrame(rows, columns=COLUMNS)
    written = sum(bool(r["expressible"]) for r in rows)
    frame.attrs["meta"] = {"flow": flow, "qat": bool(qat), "bits": bits, "dtype": _dtype(bits), "quant_min": low,
                           "quant_max": high, "expressible": written, "not_expressible": len(rows) - written}
    return frame


def _dtype(bits: int) -> str:
    """torch's dtype for a signed range of ``bits``: torch.int16 (not qint32, see module docstring)."""
    return "torch.int16" if bits > 8 else "torch.int8"


def _locate(row: dict, c: Any, flow: str, by_point: dict, by_source: dict, modules: dict) -> None:
    """Fill ``row``'s module and source, or say why torch cannot express it."""
    rows = [r for p in c.points for r in by_point.get(p, []) if r["kind"] == c.kind]
    sources = sorted({r["source"] for r in rows})
    row["source"] = ", ".join(sources)
    missing = [p for p in c.points if not any(r["kind"] == c.kind for r in by_point.get(p, []))]
    if missing:
        row["reason"] = f"torch quantizes nothing at {', '.join(missing)} (the engine point has no torch quantizer)"
        return
    if c.kind == "activation" and flow in ("fx", "pt2e"):
        row["reason"] = (("FX gives a node one activation qconfig for its inputs and its output" if flow == "fx"
                          else "a PT2E quantizer gives a module's nodes one config for their inputs and outputs") +
                         ": at int16 it re-quantizes the node's inputs at 16 bits too, "
                         "and an 8-bit reader quantizes the value again at 8 bits (not this plan)")
        return
    # Every engine point a raised quantizer serves must be in the plan: torch cannot raise one call alone.
    served = sorted({r["point"] for s in sources for r in by_source.get(s, []) if r["kind"] == c.kind} - set(c.points))
    if served:
        row["reason"] = (f"torch's quantizer {row['source']} also serves {', '.join(served)}, which the plan leaves "
                         f"at its width")
        return
    if c.kind == "weight":
        path = c.layer
    else:
        paths = {s[: -len(suffix)] for s in sources for suffix in SUFFIXES if s.endswith(suffix)}
        path = next(iter(paths)) if len(paths) == 1 and len(sources) == 1 else ""
        if not path:
            row["reason"] = f"torch's quantizer {row['source']} is no module's activation_post_process"
            return
    if flow == "eager" and c.kind == "weight":
        owners = {s[: -len(suffix)] for s in sources for suffix in SUFFIXES if s.endswith(suffix)}
        path = next(iter(owners)) if len(owners) == 1 else ""
    if not path or path not in modules:
        row["reason"] = (f"torch's quantizer {row['source']} sits in a module torch.ao swaps in at prepare "
                         f"(no module {path!r} to give a qconfig)")
        return
    row["module_name"], row["expressible"] = path, True


def _modules(frame: pd.DataFrame) -> dict[str, set[str]]:
    """module_name -> the tensors (weight, activation) the plan raises there, expressible rows only."""
    out: dict[str, set[str]] = {}
    for row in frame.itertuples():
        if row.expressible:
            out.setdefault(row.module_name, set()).add(row.tensor)
    return out


def _not_expressible_lines(frame: pd.DataFrame) -> list[str]:
    from qdebug.safe_text import escaped

    return [f"#   {escaped(r.point)} ({r.tensor}): {escaped(r.reason)}" for r in frame.itertuples()
            if not r.expressible]


def python_source(frame: pd.DataFrame) -> str:
    """The rows as a Python module: ``apply_qconfigs(model)`` (eager), ``qconfig_mapping()`` (FX)
    on the backend's default qconfig, or ``PlanQuantizer(quantizer)`` (PT2E) around the user's
    own quantizer; names are Python literals (``repr``), reasons escaped comments."""
    meta = frame.attrs["meta"]
    flow, qat = meta["flow"], meta["qat"]
    suffix = {"eager": "", "fx": "_fx", "pt2e": "_pt2e"}[flow]
    lines = [f'"""qdebug suggest\'s plan for torch.ao {flow} mode: {meta["expressible"]} tensor(s) at '
             f'{meta["bits"]} bits (generated by qdebug suggest --to torch-ao)."""', "", "import torch"]
    if flow == "fx":
        lines += ["from torch.ao.quantization import QConfig",
                  "from torch.ao.quantization import get_default_qat_qconfig_mapping, get_default_qconfig_mapping"]
    elif flow == "eager":
        lines += ["from torch.ao.quantization import QConfig",
                  "from torch.ao.quantization import get_default_qat_qconfig, get_default_qconfig"]
    else:
        lines.insert(2, "import dataclasses")
    lines += ["", f"QAT = {qat!r}  # the flow the plan was found on: prepare_qat{suffix} (True) or "
                  f"prepare{suffix} (False)"]
    skipped = _not_expressible_lines(frame)
    if skipped:
        lines += ["# Not expressible in torch.ao (not in this config):", *skipped]
    modules = _modules(frame)
    if flow == "pt2e":
        return "\n".join(lines + _pt2e_lines(meta, modules))
    lines += ["", "", "def _wider(factory):",
              f'    """The slot\'s own observer or fake quant at {meta["bits"]} bits."""',
              f"    return factory.with_args(dtype={meta['dtype']}, quant_min={meta['quant_min']}, "
              f"quant_max={meta['quant_max']}, reduce_range=False)", ""]

    def qconfig(tensors: set[str]) -> str:
        act = "_wider(base.activation)" if "activation" in tensors else "base.activation"
        weight = "_wider(base.weight)" if "weight" in tensors else "base.weight"
        return f"QConfig(activation={act}, weight={weight})"

    if flow == "eager":
        lines += ["", 'def qconfigs(backend="x86", qat=QAT):',
                  '    """Module path -> its qconfig: the backend default, the plan\'s tensors wider."""',
                  "    base = get_default_qat_qconfig(backend) if qat else get_default_qconfig(backend)",
                  "    return {"]
        lines += [f"        {path!r}: {qconfig(t)}," for path, t in modules.items()]
        lines += ["    }", "", "",
                  'def apply_qconfigs(model, backend="x86", qat=QAT):',
                  '    """Give the plan\'s modules their qconfig: after fuse_modules(_qat) and model.qconfig = ...,',
                  '    before prepare / prepare_qat (a module\'s own qconfig wins over its parent\'s)."""',
                  "    for path, qconfig in qconfigs(backend, qat).items():",
                  "        model.get_submodule(path).qconfig = qconfig",
                  "    return model", ""]
    else:
        lines += ["", 'def qconfig_mapping(backend="x86", qat=QAT):',
                  '    """The backend\'s default QConfigMapping with the plan\'s layers\' weights wider',
                  '    (for prepare_fx / prepare_qat_fx)."""',
                  "    mapping = (get_default_qat_qconfig_mapping(backend) if qat",
                  "               else get_default_qconfig_mapping(backend))",
                  "    base = mapping.global_qconfig"]
        lines += [f"    mapping.set_module_name({path!r}, {qconfig(t)})" for path, t in modules.items()]
        lines += ["    return mapping", ""]
    return "\n".join(lines)


def _pt2e_lines(meta: dict, modules: dict[str, set[str]]) -> list[str]:
    """PT2E's part of ``python_source``: the layers, and a quantizer that wraps the user's own and
    widens those layers' weight specs after it annotated (only weights are expressible there)."""
    return ["", "from torchao.quantization.pt2e.quantizer import Quantizer", "",
            f"LAYERS = {sorted(modules)!r}  # their weights at {meta['bits']} bits", "", "",
            "def wider(spec):",
            f'    """A weight QuantizationSpec at {meta["bits"]} bits: prepare builds the observer or fake quant',
            '    from the spec\'s dtype and range."""',
            f"    return dataclasses.replace(spec, dtype={meta['dtype']}, quant_min={meta['quant_min']}, "
            f"quant_max={meta['quant_max']})", "", "",
            "class PlanQuantizer(Quantizer):",
            '    """``quantizer``\'s annotations, the plan\'s layers\' weights wider: for prepare_pt2e /',
            "    prepare_qat_pt2e in place of ``quantizer``.  Nothing else changes (a quantizer's own",
            "    per-module config would: the x86 quantizer then drops the layer from its conv-add-relu",
            '    patterns)."""', "",
            "    def __init__(self, quantizer):",
            "        super().__init__()",
            "        self.quantizer = quantizer", "",
            "    def transform_for_annotation(self, model):",
            "        return self.quantizer.transform_for_annotation(model)", "",
            "    def annotate(self, model):",
            "        model = self.quantizer.annotate(model)",
            "        weights = {f\"{path}.weight\" for path in LAYERS}",
            "        for node in model.graph.nodes:",
            "            annotation = node.meta.get(\"quantization_annotation\")",
            "            for source, spec in list(getattr(annotation, \"input_qspec_map\", {}).items()):",
            "                if source.op == \"get_attr\" and source.target in weights and spec is not None:",
            "                    annotation.input_qspec_map[source] = wider(spec)",
            "        return model", "",
            "    def validate(self, model):",
            "        return self.quantizer.validate(model)", ""]


def json_document(frame: pd.DataFrame) -> str:
    """The rows as JSON: ``meta`` (flow, qat, bits, dtype, quant range, the default it builds on)
    and ``rows`` (``COLUMNS``), not-expressible rows included."""
    meta = dict(frame.attrs["meta"])
    qat = meta["qat"]
    meta["base"] = {
        "fx": f"torch.ao.quantization.get_default_{'qat_' if qat else ''}qconfig_mapping(backend)",
        "eager": f"torch.ao.quantization.get_default_{'qat_' if qat else ''}qconfig(backend)",
        "pt2e": "your quantizer's annotations, each row's <module_name>.weight spec replaced",
    }[meta["flow"]]
    meta["observer"] = (f"the slot's own: with_args(dtype={meta['dtype']}, quant_min={meta['quant_min']}, "
                        f"quant_max={meta['quant_max']}, reduce_range=False)") if meta["flow"] != "pt2e" else (
        f"the annotation's weight QuantizationSpec with dtype={meta['dtype']}, quant_min={meta['quant_min']}, "
        f"quant_max={meta['quant_max']}")
    rows = [{k: (bool(v) if k == "expressible" else int(v) if k in ("quant_min", "quant_max") else v)
             for k, v in row.items()} for row in frame.to_dict("records")]
    return json.dumps({"meta": meta, "rows": rows}, indent=2)


__all__ = ["check_imported", "torch_ao_plan", "python_source", "json_document", "COLUMNS"]
