"""A ``SourceModel`` -> an engine model that computes what the source computes, and a report.

The engine's own plan (``qdebug.engine.plan``) is traced on the float model, then made to
follow the source:

- Conv-BN pairs are the ones the source trains folded (torch's ``ConvBn2d``), in the
  engine's reverse-fold mode, which is torch's own scheme (``conv(x, fq(W f)) / f + b``,
  then the BN);
- a call the source quantizes gets a point of its own; where the engine would fuse it into
  the ReLU after it, the point moves onto the ReLU instead -- the same values, since
  relu(fq(x)) = fq(relu(x)) whenever 0 is on the grid, which every torch range ensures --
  and anything else fused is split apart;
- a quantizer after a view module (FX's observer after a Dropout) on a grid of its own gets a
  point on that module's call, which the plan otherwise never has;
- every point the source does not quantize is float (an override ``None``);
- the specs are a ``QConfig`` (the commonest weight and activation spec as defaults, exact
  point names as overrides), so a saved checkpoint re-creates the same points;
- every imported point is frozen with the source's scale and zero point.

The report has a row per source quantizer and per engine point left float
(``REPORT_COLUMNS``, documented in docs/interop.md).
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import torch
import torch.nn as nn

from qdebug.engine.modules import _QWeighted

from qdebug.engine.plan import CallRecord, Plan, resolve_outputs
from qdebug.engine.prepare import engine_state, prepare
from qdebug.engine.recurrent import CELL_STATE_BITS, activation_spec_from
from qdebug.engine.spec import QConfig, QuantSpec, default_activation_spec, default_weight_spec
from qdebug.errors import QDebugError
from qdebug.engine.imported import FLOW_ATTR, REPORT_ATTR, REPORT_COLUMNS, import_report  # noqa: F401 (importable from here too)
from qdebug.interop.attention import attention_points
from qdebug.interop.recurrent import recurrent_points
from qdebug.interop.source import (APPROXIMATE, EXACT, FLOAT, FROZEN, MOVED, TRANSPOSED_CONVS, UNMAPPED, SourceModel,
                                   SourceQuantizer, layer_bn_pairs, spec_of, transposed_weight_note)

def _module_at(model: nn.Module, path: str | None) -> nn.Module | None:
    try:
        return model.get_submodule(path) if path else None
    except AttributeError:
        return None
def build(source: SourceModel, plan: Plan, qat_mode: str = "with_bn_reverse_fold") -> nn.Module:
    """The engine model of ``source`` (``plan``: ``trace_plan`` of ``source.float_model``).

    Its report is ``import_report(model)``.
    """
    plan = copy.deepcopy(plan)
    rows: list[dict[str, Any]] = []
    _follow_bn_pairs(plan, source)
    acts, weights = _assign(plan, source, rows)
    qconfig = _qconfig(plan, source.float_model, acts, weights)
    model = prepare(source.float_model, qconfig, qat_mode, plan=plan)
    state = engine_state(model)
    for name, (quantizer, spec) in {**acts, **weights}.items():
        point = state.points[name]
        if spec.dynamic:  # its qparams come from each batch: nothing to import or freeze
            point.mode = "fake"
            continue
        scale, zero_point = quantizer.scale, quantizer.zero_point
        if not spec.per_channel:
            scale, zero_point = scale.reshape(()), zero_point.reshape(())
        elif scale.numel() == 1 and quantizer.kind == "weight":
            # A per-channel quantizer torch never ran holds its initial one-element scale: it
            # stands for every channel (a checkpoint holds one scale per channel).
            channels = model.get_submodule(quantizer.anchor).weight.shape[spec.ch_axis]
            scale = scale.reshape(1).expand(channels).clone()
            zero_point = zero_point.reshape(1).expand(channels).clone()
        point.set_qparams(scale.to(point.scale.device), zero_point.to(point.scale.device))
        point.freeze(True)
        point.mode = "fake" if quantizer.fake_quant_enabled else "float"
    for row in rows:
        if row["kind"] != "bn" and row["point"] and row["point"] in state.points and row["status"] != FLOAT:
            point = state.points[row["point"]]
            row["spec"] = point.spec.describe()
            if point.spec.dynamic:
                continue  # no stored scale
            row["scale_min"] = float(point.scale.detach().min())
            row["scale_max"] = float(point.scale.detach().max())
    setattr(state, REPORT_ATTR, rows)
    setattr(state, FLOW_ATTR, source.flow)
    model.eval()
    return model


def _row(source: str, kind: str, point: str, status: str, note: str = "") -> dict[str, Any]:
    return {"source": source, "kind": kind, "point": point, "status": status, "spec": "",
            "scale_min": None, "scale_max": None, "note": note}


def _follow_bn_pairs(plan: Plan, source: SourceModel) -> None:
    """Keep exactly the Conv-BN pairs the source folds; split the others."""
    wanted = {tuple(p) for p in source.bn_pairs}
    traced = {tuple(p) for p in plan.pairs}
    linear = sorted((wanted - traced) & set(layer_bn_pairs(plan, source.float_model)))
    for layer, bn in linear:
        # A Linear-BN pair (torch's QAT LinearBn1d): the engine's plan pairs convs only, its
        # layers run any pair in reverse-fold mode (``_QWeighted``).
        rec = plan.calls[layer]
        rec.fused_into, rec.point = bn, None
        plan.pairs.append((layer, bn))
        traced.add((layer, bn))
    if linear:
        resolve_outputs(plan.calls)
    missing = sorted(wanted - traced)
    if missing:
        conv, bn = missing[0]
        raise QDebugError(
            f"the source folds {bn!r} into {conv!r}, but the float model's forward does not run {bn!r} "
            f"on {conv!r}'s output alone",
            "the float model must be the architecture the source was prepared from, traced on the same inputs")
    for conv, bn in traced - wanted:
        rec = plan.calls[conv]
        if rec.fused_into == bn:
            rec.fused_into = None
            rec.point = conv
    plan.pairs = [p for p in plan.pairs if tuple(p) in wanted]


def _assign(plan: Plan, source: SourceModel, rows: list) -> tuple[dict, dict]:
    """Point name -> (quantizer, spec) for activations and weights; edits ``plan``; fills ``rows``."""
    calls = plan.calls
    weighted = {path for path, m in source.float_model.named_modules() if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear))}
    inner = {**recurrent_points(source.float_model), **attention_points(source.float_model)}
    acts: dict[str, tuple[SourceQuantizer, QuantSpec]] = {}
    weights: dict[str, tuple[SourceQuantizer, QuantSpec]] = {}
    base = {"activation": default_activation_spec(), "weight": default_weight_spec()}
    for q in source.quantizers:
        spec, note = spec_of(q, base[q.kind])
        notes = [n for n in (q.note, note) if n]
        if q.observes_only and source.stage == "qat":
            q.approximate = True
            notes.append(f"a {q.observer or 'observer'} in a QAT model: torch's forward passes these values on "
                         "unquantized, the import quantizes them as torch's convert would")
        status = APPROXIMATE if q.approximate else FROZEN if note else EXACT
        if spec is None:
            rows.append(_row(q.source, q.kind, "", UNMAPPED, "; ".join(notes)))
            continue
        if q.anchor is None:
            rows.append(_row(q.source, q.kind, "", UNMAPPED, "; ".join(notes) or "no engine point quantizes it"))
            continue
        if q.point is not None:  # a point inside a recurrent layer, named by the front end
            if inner.get(q.point, ("",))[0] != q.kind:
                rows.append(_row(q.source, q.kind, "", UNMAPPED,
                                 "; ".join(notes + [f"the engine's layer {q.anchor!r} has no point {q.point!r}"])))
                continue
            name = q.point
            table = weights if q.kind == "weight" else acts
        elif q.kind == "weight":
            if q.anchor not in weighted:
                layer = _module_at(source.float_model, q.anchor)
                why = (transposed_weight_note(layer) if isinstance(layer, TRANSPOSED_CONVS)
                       else f"no conv or linear layer {q.anchor!r}")
                rows.append(_row(q.source, q.kind, "", UNMAPPED, why))
                continue
            name = f"{q.anchor}.weight"
            table = weights
        else:
            rec = calls.get(q.anchor)
            if rec is None:
                rows.append(_row(q.source, q.kind, "", UNMAPPED,
                                 f"the float model's forward has no call {q.anchor!r}"))
                continue
            table = acts
            landing = rec.output_point or q.anchor
            if q.view is not None and not (landing in acts and _same_grid(acts[landing][0], q)):
                # Re-quantized after a view (a Dropout) on a grid of its own: the view's call
                # gets a point, which quantizes only what flows through the view.
                name = _view_point(plan, source.float_model, q.view, q.anchor)
                if name is None:
                    rows.append(_row(q.source, q.kind, "", UNMAPPED,
                                     "; ".join(notes + [f"{q.view!r} is no passthrough module call"])))
                    continue
                notes.append(f"re-quantizes the output of the view {name!r} on a grid of its own")
            elif q.view is not None:
                name = landing  # the same grid as the value under the view: nothing to add
            else:
                name, moved = _place(calls, q.anchor, acts)
                if moved:
                    status = MOVED if status == EXACT else status
                    notes.append(f"quantized after {name!r}, as the engine fuses it (the same values)")
        if name in table:
            other = table[name][0]
            same = _same_grid(other, q)
            # A second quantizer on the same values (FX shares observers) changes nothing when
            # its grid is the same one; a different grid after it has no engine place.
            why = (f"the same grid as {other.source!r}" if same else
                   f"re-quantizes {name!r} on another grid; the engine keeps {other.source!r}'s")
            rows.append(_row(q.source, q.kind, name if same else "", EXACT if same else UNMAPPED,
                             "; ".join(notes + [why])))
            continue
        table[name] = (q, spec)
        rows.append(_row(q.source, q.kind, name, status, "; ".join(notes)))
    for conv, bn in source.folded_bn:
        # point: the conv whose output now carries the BN (compare compares it with the float BN's)
        rows.append(_row(bn, "bn", conv, EXACT, f"folded into {conv!r}'s weights by torch before quantization"))
    for entry in source.unsupported:  # (source name, why[, kind]): an activation unless it says
        source_name, why, kind = (*entry, "activation")[:3]
        rows.append(_row(source_name, kind, "", UNMAPPED, why))
    for source_name, why in source.idle:
        rows.append(_row(source_name, "activation", "", EXACT, why))
    for rec in calls.values():
        if rec.point and rec.point not in acts:
            for name in rec.point_names():  # a point per tensor of a structured output
                rows.append(_row("", "activation", name, FLOAT, "the source does not quantize this output"))
    for path in sorted(weighted):
        if f"{path}.weight" not in weights:
            rows.append(_row("", "weight", f"{path}.weight", FLOAT, "the source keeps this weight in float"))
    for name, (kind, _, role) in inner.items():
        if role != "dynamic" and name not in (weights if kind == "weight" else acts):
            why = "the source keeps this weight in float" if kind == "weight" else "the source does not quantize this"
            rows.append(_row("", kind, name, FLOAT, why))
    return acts, weights


def _spec_at(qconfig: QConfig, kind: str, name: str, names: tuple, inner: dict) -> QuantSpec | None:
    """The spec ``prepare`` gives point ``name`` under ``qconfig`` (an LSTM's cell state cascades
    from the 16-bit default; a GEMM input exists only with a dynamic spec: qdebug.engine.recurrent)."""
    role = inner[name][2] if name in inner else ""
    if role == "cell":
        return activation_spec_from(qconfig, qconfig.activation.replace(bits=CELL_STATE_BITS), names)
    spec = qconfig.spec_for(kind, names)
    return None if role == "dynamic" and spec is not None and not spec.dynamic else spec


def _same_grid(a: SourceQuantizer, b: SourceQuantizer) -> bool:
    return torch.equal(a.scale.flatten(), b.scale.flatten()) and torch.equal(
        a.zero_point.flatten(), b.zero_point.flatten()) and (a.quant_min, a.quant_max) == (b.quant_min, b.quant_max)


def _view_point(plan: Plan, model: nn.Module, view: str, after: str) -> str | None:
    """Give the passthrough module call ``view`` a point of its own in ``plan`` (listed right after
    ``after``, the call it views); its name, or None when ``view`` is no passthrough module."""
    from qdebug.engine.ops import module_category

    try:
        module = model.get_submodule(view.split("#")[0])
    except AttributeError:
        return None
    if module_category(module) != "passthrough":
        return None
    if view not in plan.calls:
        record = CallRecord(view, "passthrough", type(module).__name__, view.split("#")[0], True, inputs=[after],
                            point=view, output_point=view)
        calls = list(plan.calls.items())
        at = next((i + 1 for i, (name, _) in enumerate(calls) if name == after), len(calls))
        plan.calls.clear()  # the same dict, in order: callers hold it
        plan.calls.update(calls[:at] + [(view, record)] + calls[at:])
    return view


def _place(calls: dict, anchor: str, taken: dict) -> tuple[str, bool]:
    """The point quantizing ``anchor``'s output as the source does: (name, moved onto a ReLU)."""
    rec = calls[anchor]
    follower = calls.get(rec.fused_into) if rec.fused_into else None
    if follower is not None and follower.category == "relu" and follower.point and follower.name not in taken \
            and rec.category != "input":
        return follower.name, True
    if rec.fused_into is not None:
        rec.fused_into = None
    rec.point = anchor
    resolve_outputs(calls)
    return anchor, False


def _qconfig(plan: Plan, model: nn.Module, acts: dict, weights: dict) -> QConfig:
    """Specs as a QConfig: the commonest spec per kind as default, point names as overrides."""
    wanted: dict[tuple[str, str], tuple[tuple[str, ...], QuantSpec | None]] = {}
    for rec in plan.calls.values():
        if not rec.point:
            continue
        if rec.category == "input":
            names = ("input", rec.name)
        else:
            names = (rec.owner, rec.name.split("#")[0], rec.name)
        wanted[("activation", rec.name)] = (names, acts[rec.name][1] if rec.name in acts else None)
    for path, module in model.named_modules():
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Linear, _QWeighted)):
            name = f"{path}.weight"
            wanted[("weight", name)] = ((path, name), weights[name][1] if name in weights else None)
    inner = {**recurrent_points(model), **attention_points(model)}
    for name, (kind, names, _) in inner.items():
        wanted[(kind, name)] = (names, (weights if kind == "weight" else acts).get(name, (None, None))[1])
    defaults = {}
    for kind, fallback in (("activation", default_activation_spec()), ("weight", default_weight_spec())):
        counts = Counter(spec for (k, _), (_, spec) in wanted.items() if k == kind and spec is not None)
        defaults[kind] = counts.most_common(1)[0][0] if counts else fallback
    overrides: dict[str, dict[str, Any]] = {}
    qconfig = QConfig(weight=defaults["weight"], activation=defaults["activation"])
    # Overrides cascade and match owners and call bases too: add exact names until every
    # point gets its wanted spec (a later entry refines an earlier one).
    for _ in range(4):
        wrong = [(kind, name, spec) for (kind, name), (names, spec) in wanted.items()
                 if _spec_at(qconfig, kind, name, names, inner) != spec]
        if not wrong:
            return qconfig
        for kind, name, spec in wrong:
            entry = dict(overrides.pop(name, {}))
            entry[kind] = None if spec is None else spec.to_dict()
            overrides[name] = entry  # re-inserted last: it wins the cascade
        qconfig = QConfig(weight=defaults["weight"], activation=defaults["activation"], overrides=dict(overrides))
    raise QDebugError("could not express the imported specs as a qconfig",
                      "report this: the source's point names overlap in a way the importer does not handle")
