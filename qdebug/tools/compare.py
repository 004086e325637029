"""``compare``: per-layer feature-map similarity of models of one architecture, any stages.

Every compared model runs on the same batches.  The reference (the first model,
or ``ref``) is tapped and its per-call outputs and inputs for the current batch
are kept; each other model is then tapped and, at every call with the same name:

- propagated error: its own output (each model runs on its own inputs) vs the
  reference output -- the accumulated error;
- isolated error: the same call replayed on the reference's inputs (same quant
  point, same integer kernel) vs the reference output -- the layer's own error.
  A quantized (integer) model's kernels consume integer codes, so for it the
  reference inputs are first projected onto its input grid.  A call computing
  the same float function as the reference's only has its quant point applied
  to the reference output (``qdebug.tools.isolated``).

A Conv-BN pair torch folded before quantizing (a model imported from torch.ao: the folded
conv, an ``nn.Identity`` at the BN's path) is measured in the BN's row, as a pair the engine
folds: the folded conv's output against the reference BN's, replayed from the reference conv's
input for the isolated error (``_measured_at_bn``).

Statistics stream into float64 sums (``qdebug.measure.stats``); nothing is stored across
batches, so memory does not grow with the number of batches.  Flagged rows get a
diagnosis: ``nonfinite``, ``clipping``, ``outlier_channels``, ``rounding``,
``propagated``; then, where a layer's kind explains it, a more precise name
(``modern_cause``): ``shared_scale``, ``cell_state_range``, ``softmax_collapse``,
``logits_clipped``, ``norm_input_outliers`` (docs/compare.md has the rules and
default thresholds).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import pandas as pd
import torch
import torch.nn as nn

from qdebug import vocab
from qdebug.config import distributed
from qdebug.engine import engine_state, is_prepared, quantization_off
from qdebug.engine.attention import decomposed_copy
from qdebug.engine.context import Event, run_model
from qdebug.engine.fake_quant import elementwise
from qdebug.engine.members import member_at, named_members, split_name
from qdebug.engine.modules import _QWeighted
from qdebug.engine.ops import tensors_in
from qdebug.engine.point import QuantPoint
from qdebug.errors import QDebugError
from qdebug.safe_text import escaped
from qdebug.measure.stats import ErrorStats, update_together
from qdebug.measure.tap import Capture, tap
from qdebug.tools.isolated import IsolatedReplay
from qdebug.tools.recurrent_rows import inner_rows, measure, row_op

# Metric columns in display order, and the default table's columns (most useful first).
METRICS = list(vocab.COMPARE_METRICS)
DEFAULT_SHOW = list(vocab.COMPARE_DEFAULT_SHOW)
# Defaults that flag real problems.  An int8 layer with a well-fitted range rounds at
# ~30-40 dB SQNR; int4 at ~16 dB; a clipped range saturates far more than 1% of values.
DEFAULT_THRESHOLDS = {
    "sqnr_db": 20.0,  # propagated: below it the layer is flagged
    "isolated_sqnr_db": 25.0,  # own error: below it the layer itself is at fault
    "saturation": 0.01,  # fraction of values at the range ends: clipping above it
    "min_channel_sqnr_db": 15.0,  # a channel this bad ...
    "channel_range_ratio": 8.0,  # ... in a layer whose channel ranges differ this much: outlier channels
}
HISTOGRAM_SAMPLES = 4096
# An outlier channel's consequence is named when this share (and twice the share elsewhere) of
# the next layer's weights on it round to 0: weights shrunk to compensate the stretched channel.
UNDERFLOW = 0.1
OUTLIER_PLOTS = 8  # at most this many outlier_channels rows get the evidence a plot shows


@dataclass
class CompareResult:
    frame: pd.DataFrame  # one row per (layer, target), execution order
    meta: dict[str, Any]
    summary: str
    samples: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Per outlier_channels row (layer, target): what its plot shows (``_outlier_evidence``).
    outliers: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    def flagged(self) -> pd.DataFrame:
        return self.frame[self.frame["diagnosis"] != ""]


def _folded_convs(model: nn.Module) -> set[str]:
    if not is_prepared(model):
        return set()
    out = set()
    for conv, _ in engine_state(model).plan.pairs:
        module = model.get_submodule(conv)
        if isinstance(module, _QWeighted) and module.bn_mode == "fused":
            out.add(conv)
    return out


def _pairs(model: nn.Module) -> dict[str, str]:
    return dict(engine_state(model).plan.pairs) if is_prepared(model) else {}


def _grid(point: QuantPoint | None) -> tuple[float, int, int, int] | None:
    """(scale, zero_point, qmin, qmax) of the point quantizing a call's own output."""
    if point is None or point.mode != "fake" or not point.initialized or point.scale.numel() != 1 \
            or point.spec.dynamic:  # a dynamic point's grid is each batch's (or token's) own
        return None
    return float(point.scale), int(point.zero_point), point.spec.qmin, point.spec.qmax


def _sample(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1).float()
    step = max(1, flat.numel() // HISTOGRAM_SAMPLES)
    return flat[::step][:HISTOGRAM_SAMPLES].clone().cpu()  # for the plots (numpy), from any device


class _Listener:
    """Accumulates one compared model's statistics against the current reference capture."""

    def __init__(self, label: str, model: nn.Module, reference: nn.Module, capture: Capture, skip: dict[str, str],
                 isolated: bool, stats: dict, notes: dict, samples: dict, kinds: dict, kl_feature_maps: bool = False,
                 evidence: dict | None = None, at_bn: dict[str, str] | None = None, own: Capture | None = None):
        self.label, self.model, self.capture, self.skip = label, model, capture, skip
        # The model's own float run of the batch (its quantization off), when its float model is
        # not the reference's: the isolated error is then measured against it (quantization's own).
        self.own = own
        self.own_replay = IsolatedReplay(model, model, _pairs(model), reference_float=True) if own is not None else None
        # conv -> BN torch folded into it (``_measured_at_bn``), and the ReLUs run in its integer kernel.
        self.at_bn = at_bn or {}
        self.kernel_fused = _fused_in_integer_kernels(model)
        # A model run by torch's own kernels (``qdebug.interop.torch_stage``) has no layer to replay alone.
        self.isolated = isolated and not getattr(type(model), "propagated_only", "")
        self.kl_feature_maps = kl_feature_maps
        self.stats, self.notes, self.samples, self.kinds = stats, notes, samples, kinds
        self.evidence = evidence if evidence is not None else {}
        self.seen: set[str] = set()
        self.first_batch = True
        self.replay = IsolatedReplay(model, reference, _pairs(model))
        self.points = engine_state(model).points if is_prepared(model) else {}

    def __call__(self, event: Event) -> None:
        call = event.call.name
        if call in self.at_bn.values() and event.call.category == "passthrough":
            return  # the place (an nn.Identity) of a BN torch folded: its conv's call has its row
        members = _rows_of(call, event.out)
        for name, _, _ in members:
            self.seen.add(name)
            self.kinds.setdefault(name, event.call.op)
        record = self.capture.records.get(call)
        inputs_from = record  # the reference call whose inputs the isolated replay takes
        bn = self.at_bn.get(call) if event.call.category in ("conv", "linear") else None
        bn_record = self.capture.records.get(bn) if bn is not None and record is not None else None
        if bn_record is not None and bn_record.category != "bn":
            bn_record = None  # the reference's call of that name is no BN: nothing to stand for
        if bn_record is not None:
            # torch folded the BN into this conv: its output is the reference BN's, and its row
            # is the BN's -- unless a ReLU runs in its integer kernel (then the ReLU's row is the pair's).
            self.seen.add(bn)
            self.kinds.setdefault(bn, bn_record.op)
            if call in self.kernel_fused:
                for name in (call, bn):
                    self.notes[(name, self.label)] = self.kernel_fused[call]
                self.replay.skipped_convs[call] = event  # the ReLU's isolated error replays it
                return
            self.notes[(call, self.label)] = f"torch folded {bn!r} into it in {self.label} only: compared at {bn}"
            members = [(bn, path, y) for _, path, y in members]
            record = bn_record
        elif record is None or call in self.skip:
            for name, _, _ in members:
                self.notes[(name, self.label)] = "not in the reference model" if record is None else self.skip[call]
            if record is not None and event.call.category == "conv":
                self.replay.skipped_convs[call] = event
                if self.own_replay is not None:  # its BN's isolated error replays it from its own input
                    self.own_replay.skipped_convs[call] = event
            return
        isolated = None
        own_record = self.own.records.get(call) if self.own is not None else None
        for name, path, y in members:
            x = member_at(record.output, path)
            if x is None or y is None:
                continue
            key = (name, self.label)
            if x.shape != y.shape:
                self.notes[key] = f"shape differs: {list(x.shape)} vs {list(y.shape)}"
                continue
            if key not in self.stats:
                # KL over the classes of a [N, C] output always; over a feature map's channels on request.
                want_kl = self.kl_feature_maps or x.dim() <= 2
                self.stats[key] = (ErrorStats(want_kl=want_kl), ErrorStats(want_ranges=False, want_kl=False))
            stats = self.stats[key]
            raw = member_at(event.raw, path) if event.raw is not None else None
            # The point of this very tensor (a member's own, or the call's when it has one tensor):
            # applied once per call, so its count of clipped values is this tensor's.
            point = self.points.get(call if bn_record is not None else name)
            clipped = point.clipped if point is not None and (path or isinstance(event.out, torch.Tensor)) else None
            cumulative = (stats[0], y, {"grid": _grid(point), "raw": None if clipped is not None else raw,
                                        "clipped": clipped})
            if self.first_batch and key not in self.samples:
                self.samples[key] = (_sample(x), _sample(y))
            self._gather_evidence(key, event, record, path, x, point)
            base = iso_y = None
            if self.isolated and event.call.category != "input":
                if self.own is None:
                    if isolated is None:
                        isolated = self.replay.output(event, inputs_from, self.capture.records)
                    base = x
                elif own_record is not None:  # on the model's own float inputs, against its own float call
                    if isolated is None:
                        isolated = self.own_replay.output(event, own_record, self.own.records)
                    base = member_at(own_record.output, path)
                iso_y = member_at(isolated, path) if base is not None else None
                if iso_y is None or base is None or base.shape != iso_y.shape:
                    base = iso_y = None
            if base is x:  # both errors against the reference's output: its blocks read once
                update_together(x, [cumulative, (stats[1], iso_y, {})])
            else:
                update_together(x, [cumulative])
                if base is not None:
                    stats[1].update(base, iso_y)
        self._step_rows(event, record)

    def _step_rows(self, event: Event, record: Any) -> None:
        """The rows of the quant points inside a recurrent layer (``qdebug.tools.recurrent_rows``)."""
        module = event.call.module
        rows = inner_rows(event.call.name, module)
        if not rows or record.module is None:
            return
        for name, local in rows:
            self.seen.add(name)
            self.kinds.setdefault(name, row_op(module, local))
        iso_args = self.replay._inputs(event, record) if self.isolated else None
        found = measure(module, event.args, record.module, record.inputs, record.kwargs, iso_args)
        for name, local in rows:
            if found is None or local not in found:
                self.notes[(name, self.label)] = "its steps could not be replayed (a PackedSequence input)"
                continue
            x, y, raw, iso_y = found[local]
            key = (name, self.label)
            if key not in self.stats:
                self.stats[key] = (ErrorStats(want_kl=False), ErrorStats(want_ranges=False, want_kl=False))
            # The layer's points are its module's (``lstm.l0.cell``), shared by its calls.
            point = self.points.get(f"{event.call.owner}.{local}")
            if self.first_batch and key not in self.samples:
                self.samples[key] = (_sample(x), _sample(y))
            isolated = [(self.stats[key][1], iso_y, {})] if iso_y is not None else []
            update_together(x, [(self.stats[key][0], y, {"grid": _grid(point), "raw": raw}), *isolated])


    def _gather_evidence(self, key: tuple[str, str], event: Event, record: Any, path: str, x: torch.Tensor,
                         point: QuantPoint | None) -> None:
        """What the layer-specific causes read (``modern_causes``), for the rows they concern
        only: a softmax's codes, a norm's input channels, a member on a point it shares."""
        if x.numel() == 0:
            return
        op = str(event.call.op)
        found = self.evidence.setdefault(key, {})
        if op.lower() == "softmax" and _any_grid(point) is not None:
            scale, zero_point, _, _ = _any_grid(point)
            found["softmax"] = _add(found.get("softmax"), _zero_codes(x, scale, zero_point))
        if _norm_axis(op) is not None and not path:
            inputs = [t for t in tensors_in(record.inputs) if t.is_floating_point()] if record.inputs else []
            inputs = inputs or [t for t in event.inputs if t.is_floating_point()]
            if inputs:
                found["norm_input"] = _channel_peaks(inputs[0], _norm_axis(op), found.get("norm_input"))
        shared = self.points.get(event.call.name)
        if path and point is None and _any_grid(shared) is not None:  # a plan saved before members: one point for all
            low, high = float(x.min()), float(x.max())
            old = found.get("shared")
            found["shared"] = (min(low, old[0]), max(high, old[1])) if old else (low, high)
            found["shared_grid"] = _any_grid(shared)
        if not found:
            del self.evidence[key]


def _any_grid(point: QuantPoint | None) -> tuple[float, int, int, int] | None:
    """(scale, zero_point, qmin, qmax) of a static per-tensor point in any quantized mode
    (fake or integer): the grid a tensor's codes lie on."""
    if point is None or point.mode == "float" or not point.initialized or point.scale.numel() != 1 \
            or point.spec.dynamic:
        return None
    return float(point.scale), int(point.zero_point), point.spec.qmin, point.spec.qmax


def _add(a: tuple | None, b: tuple) -> tuple:
    return b if a is None else tuple(u + v for u, v in zip(a, b))


def _zero_codes(x: torch.Tensor, scale: float, zero_point: int) -> tuple[int, int]:
    """(nonzero values, of them those whose code is the zero point's: round(x / s) = 0)."""
    nonzero = x != 0
    return int(nonzero.sum()), int((nonzero & (torch.round(x.float() / scale) == 0)).sum())


def _norm_axis(op: str) -> int | None:
    """The axis a norm's input channels lie on: the last for LayerNorm and RMSNorm (they
    normalize each token over its channels), 1 for GroupNorm; None for any other op."""
    name = op.lower().replace("_", "")
    if name.endswith(("layernorm", "rmsnorm")):
        return -1
    if name.endswith("groupnorm"):
        return 1
    return None


def _channel_peaks(x: torch.Tensor, axis: int, peaks: torch.Tensor | None) -> torch.Tensor | None:
    """max |x| per channel along ``axis``, folded into the running ``peaks``."""
    if x.dim() < 2 or x.shape[axis] < 2:
        return peaks
    batch = x.detach().abs().movedim(axis, -1).reshape(-1, x.shape[axis]).amax(0).double().cpu()
    if peaks is None or peaks.shape != batch.shape:
        return batch
    return torch.maximum(peaks, batch)


def _rows_of(call: str, out: Any) -> list[tuple[str, str, torch.Tensor | None]]:
    """(row name, member path, tensor) of a call's output: one row per tensor of a structured
    output (``qdebug.engine.members``), else one row named after the call (its tensor None
    when it has no floating tensor)."""
    return named_members(call, out) or [(call, "", None)]


def _fused_in_integer_kernels(model: nn.Module) -> dict[str, str]:
    """Calls of a quantized model whose integer kernel already applies the following ReLU."""
    if not is_prepared(model) or engine_state(model).stage != "quantized":
        return {}
    return {
        rec.name: f"{rec.fused_activation} fused into its integer kernel: compared at {rec.output_point}"
        for rec in engine_state(model).plan.calls.values()
        if rec.point is None and rec.fused_activation and rec.output_point
    }


def _skips(ref: nn.Module, other: nn.Module, ref_label: str, label: str) -> dict[str, str]:
    """Calls whose outputs mean different things in the two models: a conv with BN folded in
    one only, or an op whose ReLU runs inside a quantized model's integer kernel."""
    ref_folded, other_folded = _folded_convs(ref), _folded_convs(other)
    pairs = {**_pairs(ref), **_pairs(other)}
    skip = {**_fused_in_integer_kernels(ref), **_fused_in_integer_kernels(other)}
    for conv in ref_folded ^ other_folded:
        where = label if conv in other_folded else ref_label
        skip.setdefault(conv, f"BN folded into it in {where} only: compared at {pairs.get(conv, 'its BN')}")
    ref_torch, other_torch = _torch_folded(ref), _torch_folded(other)
    for conv in ref_torch.keys() ^ other_torch.keys():
        where, bn = (label, other_torch[conv]) if conv in other_torch else (ref_label, ref_torch[conv])
        skip.setdefault(conv, f"torch folded {bn!r} into it in {where} only: its output is the BN's")
    return skip


def folded_bn_rows(model: nn.Module) -> dict[str, str]:
    """BN row -> the conv (its call and output point) of each pair torch folded in ``model``, an
    import: that row holds the conv's numbers (``_measured_at_bn``)."""
    return {bn: conv for conv, bn in _torch_folded(model).items()}


def _measured_at_bn(ref: nn.Module, other: nn.Module) -> dict[str, str]:
    """conv -> BN of the pairs torch folded in ``other`` (an import) but not in ``ref``: the
    folded conv's output is conv + BN, so it is measured against the reference BN's output, in
    the BN's row -- the row an engine-folded pair has (its point named after the BN)."""
    ref_torch = _torch_folded(ref)
    return {conv: bn for conv, bn in _torch_folded(other).items() if conv not in ref_torch}


def _torch_folded(model: nn.Module) -> dict[str, str]:
    """conv -> BN of the BNs torch folded into their convs before quantizing, in a model imported
    from torch.ao (the BN's place is an ``nn.Identity``; the import report's ``bn`` row names the conv)."""
    from qdebug.interop.build import import_report

    if not is_prepared(model):
        return {}
    return {row["point"]: row["source"] for row in import_report(model) if row["kind"] == "bn" and row["point"]}


def _calls_without_output_point(model: nn.Module) -> set[str]:
    """The calls of a prepared model whose output no point of their own quantizes (it is fused
    into the next op's, a ReLU6's): an activation range problem there -- clipping, outlier
    channels -- is not theirs, the range that is quantized is the next op's."""
    if not is_prepared(model):
        return set()
    found = {name for name, rec in engine_state(model).plan.calls.items()
             if rec.point is None and rec.category != "input"}
    return found | _rows_of_torch_folded(model, found)


def _rows_of_torch_folded(model: nn.Module, calls: set[str]) -> set[str]:
    """The BN rows of the convs in ``calls`` that torch folded: such a row is its conv's output."""
    return {bn for conv, bn in _torch_folded(model).items() if conv in calls}


def _unquantized_calls(model: nn.Module) -> set[str]:
    """The calls of a prepared model that quantize nothing themselves: no output point of their
    own (fused into the next op's) and no weight point.  Empty for a model not prepared."""
    if not is_prepared(model):
        return set()
    plan = engine_state(model).plan
    # A BN folded into its conv stands for conv + BN: its row carries the conv's weight point
    # (the conv's own row is skipped, "compared at its BN").
    folded_convs = _folded_convs(model)  # once: not once a pair (it walks the pairs itself)
    folded = {bn: conv for conv, bn in plan.pairs if conv in folded_convs}
    found = set()
    for name, rec in plan.calls.items():
        if rec.point is not None or rec.category == "input":
            continue
        owner = folded.get(rec.owner, rec.owner)
        module = model.get_submodule(owner) if rec.is_module and owner else None
        if getattr(module, "weight_point", None) is None:
            found.add(name)
    return found | _rows_of_torch_folded(model, found)


def _downstream_underflow(model: nn.Module, layer: str, channel: int) -> dict[str, Any]:
    """Where an outlier channel's stretch lands: the first weighted layer fed by ``layer``, and
    the fraction of its weights on input ``channel`` that quantize to code 0 -- weights shrunk
    to compensate the channel underflow -- against that fraction on its other input channels.
    Empty when ``model`` is not prepared, no such layer follows, or nothing underflows
    (``UNDERFLOW``)."""
    found = _downstream_zero_codes(model, layer)
    if found is None or found[1].numel() <= channel:
        return {}
    owner, shares = found
    on = float(shares[channel])
    rest = torch.cat([shares[:channel], shares[channel + 1:]])  # every column holds as many weights
    elsewhere = float(rest.mean()) if rest.numel() else 0.0
    if on < UNDERFLOW or on < 2 * elsewhere:  # no underflow worth naming
        return {}
    return {"downstream_layer": owner, "downstream_zero_codes": on, "downstream_zero_codes_elsewhere": elsewhere}


def _downstream_zero_codes(model: nn.Module, layer: str) -> tuple[str, torch.Tensor] | None:
    """The first weighted layer fed by ``layer`` (its module's name) and, per its input channel,
    the share of its quantized weights that are code 0.  None when ``model`` is not prepared,
    no such layer follows, or it is depthwise (each channel kept to itself)."""
    if not is_prepared(model):
        return None
    plan = engine_state(model).plan
    layer = plan.call_of_point(layer)  # a member row (``lstm:1.1``): its call's consumers
    layer = folded_bn_rows(model).get(layer, layer)  # a torch-folded BN's row: its conv's consumers
    frontier, seen = list(plan.calls[layer].consumers) if layer in plan.calls else [], set()
    while frontier:
        name = frontier.pop(0)
        rec = plan.calls.get(name)
        if name in seen or rec is None:
            continue
        seen.add(name)
        module = model.get_submodule(rec.owner) if rec.is_module and rec.owner else None
        point = getattr(module, "weight_point", None)
        if isinstance(module, _QWeighted) and point is not None and point.initialized:
            with torch.no_grad():
                weight, _ = module.quantized_input_weight()
                if weight.dim() < 2 or module.weight.shape[1] == 1:
                    return None  # a depthwise layer keeps each channel to itself
                scale = elementwise(point.scale.detach(), point.spec, weight.shape)
                zero = torch.round(weight / scale) == 0
                shares = zero.transpose(0, 1).reshape(weight.shape[1], -1).float().mean(1)
            return rec.owner, shares.cpu()
        frontier += [c for c in rec.consumers if c != "<output>"]
    return None


def _outlier_evidence(frame: pd.DataFrame, stats: dict, models: dict[str, nn.Module],
                      found: dict[str, dict]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per outlier_channels row (the layers at fault first, then in execution order, at most
    ``OUTLIER_PLOTS``): the reference output's min and max per channel (axis 1, over every
    batch: the sums the row's metrics came from, no pass more), the widest channel, its
    range ratio, the output point's scale when there is one, and the first weighted layer
    downstream with the share of its weights on code 0 per input channel
    (``_downstream_zero_codes``)."""
    rows = frame[frame["diagnosis"] == "outlier_channels"]
    at_fault = {(item.get("at_fault"), target) for target, item in found.items()}
    keys = [(r.layer, r.target) for r in rows.itertuples() if not pd.isna(r.widest_channel)]
    keys = sorted(keys, key=lambda key: key not in at_fault)[:OUTLIER_PLOTS]  # a stable sort: order kept
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for layer, target in keys:
        measured = stats.get((layer, target))
        if measured is None or measured[0].ch_min is None:
            continue
        row = rows[(rows["layer"] == layer) & (rows["target"] == target)].iloc[0]
        evidence: dict[str, Any] = {
            "channel_min": measured[0].ch_min.double().cpu(), "channel_max": measured[0].ch_max.double().cpu(),
            "channel": int(row["widest_channel"]), "channel_range_ratio": float(row["channel_range_ratio"]),
            "out_scale": measured[0].out_scale}
        downstream = _downstream_zero_codes(models[target], layer)
        if downstream is not None and downstream[1].numel() > evidence["channel"]:
            evidence.update(downstream_layer=downstream[0], downstream_zero_codes=downstream[1])
        out[(layer, target)] = evidence
    return out


@dataclass
class _RankState:
    """What one rank of a data-parallel compare accumulated (``qdebug.config.distributed``)."""

    stats: dict
    notes: dict
    samples: dict
    kinds: dict
    order: list
    seen: dict
    count: int
    evidence: dict = field(default_factory=dict)

    def pack(self) -> dict:
        return {"stats": {key: (a.state(), b.state()) for key, (a, b) in self.stats.items()}, "notes": self.notes,
                "samples": self.samples, "kinds": self.kinds, "order": self.order,
                "seen": {label: set(names) for label, names in self.seen.items()}, "count": self.count,
                "evidence": self.evidence}

    @staticmethod
    def merge(a: dict, b: dict) -> dict:
        """Rank a's state, then rank b's: sums added, first sightings (notes, samples from
        the first batch, layer order) kept from the lower rank."""
        stats = dict(a["stats"])
        for key, (prop, iso) in b["stats"].items():
            if key in stats:
                mine = stats[key]
                stats[key] = (ErrorStats.from_state(mine[0]).merge(ErrorStats.from_state(prop)).state(),
                              ErrorStats.from_state(mine[1]).merge(ErrorStats.from_state(iso)).state())
            else:
                stats[key] = (prop, iso)
        seen = {label: a["seen"].get(label, set()) | b["seen"].get(label, set()) for label in {*a["seen"], *b["seen"]}}
        return {"stats": stats, "notes": {**b["notes"], **a["notes"]}, "samples": {**b["samples"], **a["samples"]},
                "kinds": {**b["kinds"], **a["kinds"]}, "order": a["order"] + [n for n in b["order"] if n not in a["order"]],
                "seen": seen, "count": a["count"] + b["count"],
                "evidence": _merge_evidence(a.get("evidence", {}), b.get("evidence", {}))}

    @staticmethod
    def unpack(state: dict) -> tuple:
        stats = {key: (ErrorStats.from_state(p), ErrorStats.from_state(i)) for key, (p, i) in state["stats"].items()}
        return (stats, state["notes"], state["samples"], state["kinds"], state["order"], state["seen"], state["count"],
                state.get("evidence", {}))


def _merge_evidence(a: dict, b: dict) -> dict:
    """Two ranks' evidence (``_Listener._gather_evidence``) as one run over both shares of batches."""
    out = {key: dict(found) for key, found in a.items()}
    for key, theirs in b.items():
        mine = out.setdefault(key, {})
        for field_name, value in theirs.items():
            old = mine.get(field_name)
            if old is None or field_name == "shared_grid":
                mine[field_name] = value
            elif field_name == "softmax":
                mine[field_name] = _add(old, value)
            elif field_name == "norm_input":
                mine[field_name] = torch.maximum(old, value) if old.shape == value.shape else old
            elif field_name == "shared":
                mine[field_name] = (min(old[0], value[0]), max(old[1], value[1]))
    return out


def compare(
    models: Sequence[tuple[str, nn.Module]],
    batches: Sequence[Any],
    *,
    ref: int = 0,
    thresholds: dict[str, float] | None = None,
    isolated: bool = True,
    kl_feature_maps: bool = False,
    progress: Callable[[int], None] | None = None,
) -> CompareResult:
    """Compare every model with ``models[ref]`` layer by layer (see module docstring).

    ``models``: (label, model) pairs of one architecture in any stage; ``batches``:
    model inputs (tensor, tuple or dict) or ``qdebug.data.Batch`` objects.
    ``kl``: always for [N, C] outputs (logits); for feature maps (3-d and more) only
    with ``kl_feature_maps`` -- two exponentials per value, it costs more than every
    other metric together.
    """
    if len(models) < 2:
        raise QDebugError("compare needs at least two models", "e.g. qdebug compare float.pt qat.pt")
    if not 0 <= ref < len(models):
        raise QDebugError(f"reference index {ref} is out of range for {len(models)} models",
                          "ref is an index into models: 0 up to one less than their number")
    limits = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    unknown = sorted(set(limits) - set(METRICS))
    if unknown:
        raise QDebugError(f"unknown threshold metric(s): {', '.join(unknown)}", f"choose from {', '.join(METRICS)}")
    ref_label, ref_model = models[ref]
    ref_model = decomposed_copy(ref_model)  # a float model's attentions in prepare's parts: row for row
    others = [(label, model) for i, (label, model) in enumerate(models) if i != ref]
    labels = [label for label, _ in models]
    if len(set(labels)) != len(labels):
        raise QDebugError(f"two compared models share the label {labels}", "give each model its own label")
    if len({id(model) for _, model in models}) != len(models):
        raise QDebugError("a model is compared with itself", "load each stage from its own checkpoint")

    # Inputs for the isolated replays; a recurrent layer's always (its step rows replay it).
    # The reference's values are held, not copied, where no in-place op writes them (``Capture.hold``).
    capture = Capture(keep_inputs=True if isolated else (lambda event: bool(inner_rows("", event.call.module))),
                      hold=True)
    stats: dict = {}
    notes: dict = {}
    samples: dict = {}
    kinds: dict = {}
    evidence: dict = {}
    order: list[str] = []
    check = _ReferenceCheck(ref_model, others)  # before count_clipped: it applies weight points
    # A prepared target whose float model is not the reference's (QAT moved its weights, an import,
    # another float file) also runs with its quantization off: that run is its drift, per layer,
    # against the reference, and its isolated errors are measured against it (``_Listener.own``).
    drifting = [label for label, model in others if label in check.sums and is_prepared(model)]
    own_captures = {label: Capture(keep_inputs=True) for label in drifting} if isolated else {}
    listeners = [
        _Listener(label, model, ref_model, capture, _skips(ref_model, model, ref_label, label), isolated, stats, notes, samples,
                  kinds, kl_feature_maps, evidence, _measured_at_bn(ref_model, model), own=own_captures.get(label))
        for label, model in others
    ]
    drift_listeners = {  # the drift's rows: stats under (layer, (label, OWN_FLOAT)), nothing else kept
        label: _Listener((label, OWN_FLOAT), model, ref_model, capture, _skips(ref_model, model, ref_label, label),
                         False, stats, {}, {}, {}, False, {}, _measured_at_bn(ref_model, model))
        for label, model in others if label in drifting}
    states = [(m, m.training) for _, m in models]
    counting = [p for _, m in models if is_prepared(m) for p in engine_state(m).points.values()]
    for _, model in models:
        model.eval()
    for point in counting:  # saturation from the fake-quant kernels' own masks (no pass over raw)
        point.count_clipped = True
    count = 0
    group = distributed.current()
    try:
        with torch.no_grad():
            for batch_index, batch in group.shard(batches):  # every batch, or this rank's share (docs/scale.md)
                inputs = getattr(batch, "inputs", batch)
                for attempt in itertools.count():  # again when a held value was written in place
                    capture.clear()
                    with tap(ref_model, capture):
                        ref_out = run_model(ref_model, inputs)
                    if capture.settle():
                        break
                    if attempt:  # the slots written move from forward to forward: copy them all
                        capture.hold = False
                for call, record in capture.records.items():
                    for name, local in inner_rows(call, record.module):  # a recurrent layer's points first
                        if name not in kinds:
                            kinds[name] = row_op(record.module, local)
                            order.append(name)
                    for name, _, _ in _rows_of(call, record.output):
                        if name not in kinds:
                            kinds[name] = record.op
                            order.append(name)
                for (label, model), listener in zip(others, listeners):
                    if label in drift_listeners and drift_listeners[label].first_batch and _settled(
                            check, label, model, inputs, ref_out):  # BN folding's float rounding: no drift
                        del drift_listeners[label]
                        listener.own = listener.own_replay = None
                    off = _own_float_run(model, inputs, drift_listeners.get(label), own_captures.get(label))
                    with tap(model, listener):
                        out = run_model(model, inputs)
                    check.update(ref_out, label, out, off)
                    listener.first_batch = False
                    for name in listener.seen:
                        if name not in kinds or name not in order:
                            order.append(name)
                count += 1
                if progress is not None:
                    progress(count)
    finally:
        for model, was_training in states:
            model.train(was_training)
        for point in counting:
            point.count_clipped, point.clipped = False, None
        capture.release()
        for own in own_captures.values():
            own.release()
    if group.active:
        seen = {listener.label: listener.seen for listener in listeners}
        merged = group.combine(_RankState(stats, notes, samples, kinds, order, seen, count, evidence).pack(),
                               _RankState.merge)
        stats, notes, samples, kinds, order, seen, count, evidence = _RankState.unpack(merged)
        for listener in listeners:
            listener.seen = seen.get(listener.label, set())
    if count == 0:
        raise QDebugError("compare got no batches", "pass --data with at least one batch")
    for label, model in others:  # the rows a self-tapping model computes inside another row's kernel
        for name, note in (getattr(model, "row_notes", {}) if hasattr(type(model), "qdebug_tap") else {}).items():
            notes.setdefault((name, label), note)

    rows = []
    # Constants an exporter folds (rotary tables, positions: ``qdebug.engine.plan``) are no layer of
    # the deployed graph, and equal in every stage: no row, unless a point quantizes them.
    folded = {name for _, model in models if is_prepared(model)
              for name, rec in engine_state(model).plan.calls.items() if rec.constant and not rec.point_names()}
    for index, name in enumerate(n for n in dict.fromkeys(order) if n not in folded):
        for label, _ in others:
            key = (name, label)
            row: dict[str, Any] = {"index": index, "layer": name, "type": kinds.get(name, ""), "target": label}
            if key in stats:
                row.update(stats[key][0].result())
                row.update(stats[key][1].result("isolated_"))
                drift = stats.get((name, (label, OWN_FLOAT)))
                row["drift_sqnr_db"] = drift[0].result()["sqnr_db"] if drift is not None else math.nan
                row["note"] = ""
            else:
                listener = next(li for li in listeners if li.label == label)
                row["note"] = notes.get(key) or ("not in " + label if name not in listener.seen else "no tensor output")
            rows.append(row)
    frame = pd.DataFrame(rows)
    for col in METRICS:
        if col not in frame:
            frame[col] = math.nan
    frame = frame[["index", "layer", "type", "target", *METRICS, "note"]]
    frame["diagnosis"] = [diagnose(r, limits) for r in frame.to_dict("records")]
    models_by_label = dict(others)
    if group.active:
        check.sums = group.combine(check.sums, _ReferenceCheck.merge)
    reference_check = check.result(limits["sqnr_db"])
    differs = {label for label, found in reference_check.items() if found.get("float_differs")}
    frame["diagnosis"] = [  # the causes that know recurrent layers, attention and norms
        modern_cause(r["diagnosis"], models_by_label[r["target"]], r["layer"], evidence.get((r["layer"], r["target"]), {}))
        for r in frame.to_dict("records")]
    frame["diagnosis"] = [  # the error a float difference explains is no quantization's
        FLOAT_DIFFERS if _drift_explains(r, limits, r["target"] in differs) else r["diagnosis"]
        for r in frame.to_dict("records")]
    unquantized = {label: _unquantized_calls(model) for label, model in others}
    unranged = {label: _calls_without_output_point(model) for label, model in others}
    found = findings(frame, unquantized, unranged)
    for label, model in others:  # an outlier channel's consequence: the next layer's weights on it
        at_fault = found.get(label, {})
        if "outlier_channel" in at_fault:
            at_fault.update(_downstream_underflow(model, at_fault["at_fault"], at_fault["outlier_channel"]))
        if at_fault.get("at_fault"):
            at_fault.update(_cause_details(at_fault["at_fault_diagnosis"], evidence.get((at_fault["at_fault"], label), {})))
    for label in drifting:  # where the float model moved most from the reference
        drift = frame[(frame["target"] == label) & frame["drift_sqnr_db"].notna()]
        if label in found and not drift.empty:
            worst = drift.sort_values("drift_sqnr_db").iloc[0]
            found[label].update(worst_drift_layer=worst["layer"], worst_drift_sqnr_db=float(worst["drift_sqnr_db"]))
    for label in differs:
        found[label]["float_differs"] = reference_check[label]
    summary = summarize(frame, limits, ref_label, unquantized, found)  # found: made just above
    propagated_only = {label: type(model).propagated_only for label, model in others
                       if getattr(type(model), "propagated_only", "")}
    if propagated_only:
        summary += "".join(f"\n{escaped(label)}: {reason}" for label, reason in propagated_only.items())
    # What a self-tapping stage says of itself (an ONNX model's unmatched tensors: qdebug.onnx.stage).
    stage_reports = {label: model.stage_report() for label, model in others if hasattr(type(model), "stage_report")}
    for label, report in stage_reports.items():
        summary += "".join(f"\n{escaped(label)}: {line}" for line in report.pop("summary", []))
    meta = {
        "reference": ref_label,
        "targets": [label for label, _ in others],
        "batches": count,
        "thresholds": limits,
        "isolated": isolated,
        "kl_feature_maps": kl_feature_maps,
        "layers": int(frame["layer"].nunique()),
        "flagged": int((frame["diagnosis"] != "").sum()),
        "findings": found,
        "reference_check": reference_check,
    }
    if propagated_only:
        meta["propagated_only"] = propagated_only
    if stage_reports:
        meta["stages"] = stage_reports
    return CompareResult(frame, meta, summary, samples, _outlier_evidence(frame, stats, models_by_label, found))


def choose_reference(stages: Sequence[str], asked: int | None, *, names: Sequence[str] | None = None) -> tuple[int, str | None]:
    """The reference index and a warning, or None.

    Every diagnosis assumes the reference is the more precise model: a quantized
    reference would call the float model's layers int16 candidates.  Unasked, the least
    quantized model is the reference (the first of them); asked for a reference more
    quantized than another model, the answer is kept but a warning says so.
    """
    names = list(names or [f"model {i}" for i in range(len(stages))])
    rank = [vocab.STAGE_RANK.get(stage, 0) for stage in stages]
    least = rank.index(min(rank))
    if asked is None:
        if rank[0] == rank[least]:
            return 0, None
        return least, (f"{names[0]} ({stages[0]}) is more quantized than {names[least]} ({stages[least]}): "
                       f"comparing against {names[least]} (--ref 0 keeps the given order)")
    if rank[asked] > rank[least]:
        return asked, (f"the reference {names[asked]} ({stages[asked]}) is more quantized than {names[least]} "
                       f"({stages[least]}): diagnoses assume the reference is the more precise model")
    return asked, None


def _bad(value: float, limit: float, lower_is_bad: bool = True) -> bool:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False
    return value < limit if lower_is_bad else value > limit


def diagnose(row: dict[str, Any], limits: dict[str, float]) -> str:
    """The diagnosis of one row, or "" when nothing is flagged (rules in docs/compare.md)."""
    if row.get("note"):
        return ""
    nonfinite = row.get("nonfinite") or 0
    if nonfinite and not math.isnan(nonfinite) and nonfinite > 0:
        return "nonfinite"
    if any(isinstance(row.get(k), float) and math.isnan(row.get(k)) for k in ("sqnr_db", "cosine")):
        return "nonfinite"
    propagated_bad = _bad(row.get("sqnr_db"), limits["sqnr_db"])
    isolated_bad = _bad(row.get("isolated_sqnr_db"), limits["isolated_sqnr_db"])
    clipping = _bad(row.get("saturation"), limits["saturation"], lower_is_bad=False)
    isolated_known = row.get("isolated_sqnr_db") is not None and not math.isnan(row.get("isolated_sqnr_db"))
    # Outlier channels are the layer's own fault only when its own quantization costs the
    # typical channel (when measured): a wide channel stretches the per-tensor range, so the
    # median channel's isolated SQNR falls (7 dB beside a planted x64 channel).  A few tiny
    # channels rounding to 0 beside a healthy median (40 dB) are not what a wide channel did.
    typical = row.get("isolated_median_channel_sqnr_db")
    typical_known = typical is not None and not math.isnan(typical)
    outliers = (_bad(row.get("min_channel_sqnr_db"), limits["min_channel_sqnr_db"])
                and _bad(row.get("channel_range_ratio"), limits["channel_range_ratio"], lower_is_bad=False)
                and (_bad(typical, limits["isolated_sqnr_db"]) if typical_known else True))
    # Clipping is the layer's own fault only when its own error is bad too (when measured):
    # downstream of a clipped layer, values can pile up at a range end without own error.
    if clipping and (isolated_bad if isolated_known else (propagated_bad or row.get("saturation", 0) > 5 * limits["saturation"])):
        return "clipping"
    if outliers:
        return "outlier_channels"
    if isolated_bad:
        return "rounding"
    if propagated_bad:
        isolated = row.get("isolated_sqnr_db")
        return "propagated" if isolated is not None and not math.isnan(isolated) else "rounding"
    return ""


# The causes that know recurrent layers, attention and norms (docs/compare.md has the rules).
OWN_ERROR = ("rounding", "clipping", "outlier_channels")  # a row flagged for its own error
SOFTMAX_ZERO_SHARE = 0.5  # this share of a softmax's nonzero probabilities on code 0: collapsed
SHARED_CODES = 1 / 16  # a member spanning less than this share of a shared point's codes
NORM_OUTLIER_RATIO = 100.0  # a norm input channel this many times the median channel's max |x|
NORM_TYPICAL_CODES = 16  # ... while the median channel's max |x| spans fewer steps of the input's grid
ELEMENTWISE = {"add", "sub", "mul", "div", "truediv", "maskedfill", "where"}  # scale and mask ops


def modern_cause(cause: str, model: nn.Module, row: str, found: dict) -> str:
    """``cause`` named more precisely for a recurrent layer, a softmax, attention logits or a
    norm's input (rules in docs/compare.md); ``cause`` itself when none applies.  ``found``:
    the row's evidence (``_Listener._gather_evidence``)."""
    if cause in ("", "nonfinite") or not is_prepared(model):
        return cause
    call, _ = split_name(row)
    if cause in OWN_ERROR and _spans_few_shared_codes(found):
        return "shared_scale"
    # A step row of a recurrent layer (``lstm.l0.cell``): its layer's call, for its cell row only.
    point = engine_state(model).points.get(row) if call not in engine_state(model).plan.calls else None
    layer = point.owner if point is not None and row.endswith(".cell") else call
    if cause in OWN_ERROR and _coarse_cell_state(model, layer):
        return "cell_state_range"
    if cause in OWN_ERROR and _softmax_collapsed(found):
        return "softmax_collapse"
    if cause == "clipping" and _feeds_softmax(model, call):
        return "logits_clipped"
    if _norm_input_outliers(model, call, found):
        return "norm_input_outliers"
    return cause


def _cause_details(cause: str, found: dict) -> dict[str, Any]:
    """The measured facts behind a layer-specific cause, for ``meta.findings`` and the summary:
    a softmax's share of nonzero probabilities on code 0; a norm input's widest channel."""
    if cause == "softmax_collapse" and "softmax" in found:
        nonzero, zero_coded = found["softmax"]
        return {"zero_code_share": zero_coded / nonzero}
    if cause == "norm_input_outliers" and "norm_input" in found:
        peaks = found["norm_input"]
        median = float(peaks.median())
        return {"norm_input_channel": int(peaks.argmax()),
                "norm_input_ratio": float(peaks.max()) / median if median > 0 else math.inf}
    return {}


def _spans_few_shared_codes(found: dict) -> bool:
    """A member of a structured output quantized by its call's one point (a plan saved before
    members existed) whose own range spans less than ``SHARED_CODES`` of that point's codes."""
    if "shared" not in found:
        return False
    (low, high), (scale, _, qmin, qmax) = found["shared"], found["shared_grid"]
    return (high - low) / scale < SHARED_CODES * (qmax - qmin)


def _coarse_cell_state(model: nn.Module, call: str) -> bool:
    """An LSTM layer (or cell) one of whose cell-state points is below 16 bits with a step
    coarser than its hidden state's: tanh(c) passes c's rounding to h at slope up to 1, so
    h's own grid cannot be reached."""
    from qdebug.engine.recurrent import QLSTM, QLSTMCell

    rec = engine_state(model).plan.calls.get(call)
    if rec is None or not rec.is_module or not rec.owner:
        return False
    if not isinstance(model.get_submodule(rec.owner), (QLSTM, QLSTMCell)):
        return False
    points = engine_state(model).points
    for name, cell in points.items():
        if not name.startswith(rec.owner + ".") or not name.endswith(".cell"):
            continue
        hidden = points.get(name[: -len("cell")] + "hidden")
        if hidden is None or cell.mode == "float" or not cell.initialized or not hidden.initialized:
            continue
        if cell.spec.bits < 16 and float(cell.scale.max()) > float(hidden.scale.max()):
            return True
    return False


def _softmax_collapsed(found: dict) -> bool:
    """At least ``SOFTMAX_ZERO_SHARE`` of a softmax's nonzero probabilities quantize to code 0."""
    nonzero, zero_coded = found.get("softmax", (0, 0))
    return nonzero > 0 and zero_coded >= SOFTMAX_ZERO_SHARE * nonzero


def _feeds_softmax(model: nn.Module, call: str) -> bool:
    """``call``'s output reaches a softmax directly or through at most two elementwise calls
    (the logits' scale, an additive mask): it is attention logits (QK^T, or its scaled copy)."""
    calls = engine_state(model).plan.calls
    frontier = [(c, 0) for c in calls[call].consumers] if call in calls else []
    while frontier:
        name, hops = frontier.pop(0)
        rec = calls.get(name)
        if rec is None:
            continue
        op = str(rec.op).lower().replace("_", "")
        if op == "softmax":
            return True
        if op in ELEMENTWISE and hops < 2:
            frontier += [(c, hops + 1) for c in rec.consumers]
    return False


def _norm_input_outliers(model: nn.Module, call: str, found: dict) -> bool:
    """A norm (LayerNorm, RMSNorm, GroupNorm) whose input has a channel with max |x| at least
    ``NORM_OUTLIER_RATIO`` times the median channel's, quantized by one static per-tensor
    point on whose grid the median channel's max |x| spans fewer than ``NORM_TYPICAL_CODES``
    steps (a per-token or per-channel input point, or an int16 one, already fixes it)."""
    peaks = found.get("norm_input")
    if peaks is None or peaks.numel() < 2:
        return False
    median, top = float(peaks.median()), float(peaks.max())
    if top < NORM_OUTLIER_RATIO * median or top == 0:
        return False
    state = engine_state(model)
    rec = state.plan.calls.get(call)
    producer = state.plan.calls.get(rec.inputs[0]) if rec is not None and rec.inputs else None
    point = state.points.get(producer.output_point) if producer is not None and producer.output_point else None
    grid = _any_grid(point)
    if grid is None:  # a float, dynamic (per-token) or per-channel input, or a view between: not this
        return False
    return median / grid[0] < NORM_TYPICAL_CODES  # the typical channel keeps few codes (an int16 input keeps many)


# -- is the reference the target's float model? ------------------------------------------------
# A QAT run that did not freeze its BN statistics (or trained its weights far) leaves a checkpoint
# whose own float model is no longer the reference: measured against it, every layer looks
# quantized badly.  Each prepared target whose state does not hold the reference's tensors is
# therefore also run with every quant point in float mode (its own float model, OWN_FLOAT), on
# every batch, tapped: its drift per layer (``drift_sqnr_db``) and at the output are measured
# against the reference, and its isolated errors against that run -- the difference quantization
# makes, on the target's own float inputs.  When the output's drift is below the ``sqnr_db``
# threshold (the float difference alone would be flagged) and within FLOAT_DIFFERS_MARGIN_DB of the
# target's own output SQNR (it is at least half the target's output error), the summary says so
# first; a row whose propagated error its drift explains the same way is ``float_differs``
# (docs/compare.md).  Cost: a forward of such a target per batch (a calibrated model that kept
# its BN holds the reference and pays nothing).
OWN_FLOAT = "own_float"
# A float model this close to the reference at the output on the first batch (BN folding's float
# rounding: > 100 dB) is the reference's: no further own float run (about 10 bits: below int8's
# rounding by far, so the isolated errors against the reference are the quantization's own).
NEGLIGIBLE_DRIFT_DB = 60.0
FLOAT_DIFFERS_MARGIN_DB = 3.0
FLOAT_DIFFERS = "float_differs"  # the rows' diagnosis under the warning, instead of rounding/propagated
NOT_QUANTIZATION = ("rounding", "propagated")  # the diagnoses an SQNR alone made: the float difference explains them


def _settled(check: "_ReferenceCheck", label: str, model: nn.Module, inputs: Any, ref_out: Any) -> bool:
    """Whether the target's float model is the reference's within float rounding, by its output
    on this (the first) batch with its quantization off, untapped (``_ReferenceCheck.settle``)."""
    with quantization_off(model):
        off = run_model(model, inputs)
    return check.settle(label, ref_out, off)


def _own_float_run(model: nn.Module, inputs: Any, drift: "_Listener | None", own: Capture | None) -> Any:
    """The model's output with its quantization off, tapped by its drift listener and captured
    for its isolated replays; None (nothing run) for a model whose float model is the reference."""
    if drift is None:
        return None
    if own is not None:
        own.clear()

    def listen(event: Event) -> None:
        if own is not None:
            own(event)
        drift(event)

    with quantization_off(model), tap(model, listen):
        out = run_model(model, inputs)
    drift.first_batch = False
    return out


def _drift_explains(row: dict[str, Any], limits: dict[str, float], output_differs: bool) -> bool:
    """Whether a row's flagged error is its float model's drift, not quantization: a diagnosis an
    SQNR alone made (``propagated``; ``rounding`` only where no isolated error was measured against
    the target's own float model), with a drift that alone would be flagged and is at least half the
    row's error.  Without a per-layer drift (a float target), the output's verdict decides."""
    if row["diagnosis"] not in NOT_QUANTIZATION:
        return False
    drift = row.get("drift_sqnr_db")
    if drift is None or math.isnan(drift):
        return output_differs
    isolated = row.get("isolated_sqnr_db")
    if row["diagnosis"] == "rounding" and isolated is not None and not math.isnan(isolated):
        return False  # measured against the target's own float call: quantization's own error
    return drift < limits["sqnr_db"] and drift < row["sqnr_db"] + FLOAT_DIFFERS_MARGIN_DB


class _ReferenceCheck:
    """Per target, float64 sums of its output and of its output with quantization off against the
    reference's output (``result``: the figures and the verdict, JSON's ``meta.reference_check``)."""

    def __init__(self, reference: nn.Module, others: Sequence[tuple[str, nn.Module]]):
        self.skipped: dict[str, str] = {}
        if is_prepared(reference) or hasattr(type(reference), "qdebug_tap"):
            reason = "the reference is quantized itself"
            self.skipped = {label: reason for label, _ in others}
        for label, model in others:
            if label not in self.skipped and hasattr(type(model), "qdebug_tap"):
                runner = getattr(type(model), "runner", "torch's kernels")
                self.skipped[label] = f"run by {runner}: its quantization cannot be turned off"
            elif label not in self.skipped and _weights_on_their_grids(model):
                self.skipped[label] = "its float weights are its quantized ones (a converted import)"
            elif label not in self.skipped and _holds_the_reference(model, reference):
                # a calibrated model with BN kept: its float model is the reference, bit for bit
                self.skipped[label] = "its float weights and BN statistics are the reference's"
        self.sums: dict[str, dict[str, list[float]]] = {label: {} for label, _ in others if label not in self.skipped}
        self.float_targets = {label for label, model in others if not is_prepared(model)}  # their own float model

    def update(self, ref_out: Any, label: str, out: Any, off: Any) -> None:
        """``off``: the target's output with its quantization off (``_own_float_run``), or None: a
        float target is its own float model; a target ``settle`` measured has its verdict."""
        if label not in self.sums:
            return
        if off is None and label in self.float_targets:
            off = out
        ref, ours, floats = (_named_float(o) for o in (ref_out, out, out if off is None else off))
        if not (ref.keys() == ours.keys() == floats.keys()) or any(
                ref[k].shape != ours[k].shape or ref[k].shape != floats[k].shape for k in ref):
            self.sums.pop(label)
            self.skipped[label] = "its outputs are not the reference's"
            return
        sums = self.sums[label]
        for name, x in ref.items():
            x64 = x.detach().double()
            # signal, error of the target, and over the batches run with quantization off: signal, error
            row = sums.setdefault(name, [0.0, 0.0, 0.0, 0.0])
            signal = float((x64 * x64).sum())
            row[0] += signal
            row[1] += float(((x64 - ours[name].detach().double()) ** 2).sum())
            if off is not None:
                row[2] += signal
                row[3] += float(((x64 - floats[name].detach().double()) ** 2).sum())

    def settle(self, label: str, ref_out: Any, off: Any) -> bool:
        """Measure the target's float model on the first batch: when every output is >=
        NEGLIGIBLE_DRIFT_DB from the reference's (a calibrated model whose BN was folded), it is
        the reference's within float rounding -- that batch's figure stands for the float model,
        and no further own float run is needed (the quantized output is measured on every batch)."""
        ref, floats = _named_float(ref_out), _named_float(off)
        if ref.keys() != floats.keys() or any(ref[k].shape != floats[k].shape for k in ref):
            return False  # ``update`` says why
        sums = {}
        for name, x in ref.items():
            x64 = x.detach().double()
            sums[name] = [float((x64 * x64).sum()), float(((x64 - floats[name].detach().double()) ** 2).sum())]
        if any(_db(signal, err) < NEGLIGIBLE_DRIFT_DB for signal, err in sums.values()):
            return False
        for name, (signal, err) in sums.items():
            self.sums.setdefault(label, {})[name] = [0.0, 0.0, signal, err]
        return True

    @staticmethod
    def merge(a: dict, b: dict) -> dict:
        merged = {}
        for label in {**a, **b}:
            rows_a, rows_b = a.get(label, {}), b.get(label, {})
            merged[label] = {name: [x + y for x, y in zip(rows_a.get(name, [0.0] * 4), rows_b.get(name, [0.0] * 4))]
                             for name in {**rows_a, **rows_b}}
        return merged

    def result(self, limit_db: float) -> dict[str, dict[str, Any]]:
        """``limit_db``: the ``sqnr_db`` threshold, below which a float difference alone is flagged."""
        out: dict[str, dict[str, Any]] = {label: {"measured": False, "reason": reason}
                                          for label, reason in self.skipped.items()}
        for label, rows in self.sums.items():
            if not rows:
                out[label] = {"measured": False, "reason": "no batch"}
                continue
            # The worst output (the lowest SQNR with quantization off) speaks for the model.
            name = min(rows, key=lambda n: _db(rows[n][2], rows[n][3]))
            signal, err, signal_off, err_off = rows[name]
            off_db, whole_db = _db(signal_off, err_off), _db(signal, err)
            differs = off_db < limit_db and off_db < whole_db + FLOAT_DIFFERS_MARGIN_DB
            out[label] = {"measured": True, "output": name, "quantization_off_sqnr_db": off_db,
                          "output_sqnr_db": whole_db, "float_differs": bool(differs)}
        return out


def _db(signal: float, noise: float) -> float:
    if noise <= 0:
        return math.inf
    if signal <= 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def _named_float(out: Any) -> dict[str, torch.Tensor]:
    from qdebug.tools.experiment import named_outputs

    return named_outputs(out)


def _holds_the_reference(model: nn.Module, reference: nn.Module) -> bool:
    """Whether every float tensor of the reference's state is in the model's, equal: then turning
    the model's points off gives the reference's function, and the check has nothing to measure."""
    own = model.state_dict()
    with torch.no_grad():
        for name, tensor in reference.state_dict().items():
            mine = own.get(name)
            if mine is None or mine.shape != tensor.shape or mine.dtype != tensor.dtype or not torch.equal(
                    mine.to(tensor.device), tensor):
                return False
    return True


def _weights_on_their_grids(model: nn.Module) -> bool:
    """Whether every weight of a prepared model already lies on its point's grid -- an import of a
    model torch converted, whose float weights are gone: turning its points off undoes nothing."""
    if not is_prepared(model):
        return False
    found = False
    with torch.no_grad():
        for module in model.modules():
            point = getattr(module, "weight_point", None) if isinstance(module, _QWeighted) else None
            weight = getattr(module, "weight", None)
            if point is None or not isinstance(weight, torch.Tensor) or not torch.is_floating_point(weight):
                continue
            found = True
            if not torch.equal(point.apply(weight.detach()), weight.detach()):
                return False
    return found


def reference_warning(label: str, ref_label: str, check: dict[str, Any], found: dict[str, Any] | None = None) -> str:
    """The summary's first lines for a target whose float model is not the reference (``found``:
    its findings, for the layer whose float output moved most)."""
    lines = [
        f"warning: {label}'s float model differs from {ref_label}: not quantization",
        (f"  quantization off: {_fmt_db(check['quantization_off_sqnr_db'])} vs {ref_label} "
         f"({_fmt_db(check['output_sqnr_db'])} quantized); rows {FLOAT_DIFFERS}"),
        "  its weights or BN statistics changed (QAT with BN statistics not frozen?)"]
    if found and found.get("worst_drift_layer"):  # the same line, with where: at most 10 lines in all
        lines[-1] = (f"  drifted most:  {found['worst_drift_layer']} ({_fmt_db(found['worst_drift_sqnr_db'])}; "
                     "BN statistics not frozen?)")
    return "\n".join(lines)


# One short line of advice per cause (the summary's "cause" line; docs/compare.md explains more).
ADVICE = {
    "clipping": "range cut off: recalibrate (observer, data), not more bits",
    "rounding": "range fine, steps too coarse: int16 (+{gain:.0f} dB; qdebug suggest)",
    "outlier_channels": "wide channels: equalize (CLE), then int16, per-channel last",
    "nonfinite": "NaN/Inf appears here: check weights and scales (qdebug inspect)",
    "shared_scale": "one point shared by several tensors: prepare again (one each)",
    "cell_state_range": "int8 cell state coarser than h: int16 cell points (the default)",
    "softmax_collapse": "probabilities round to 0: uint8 at scale 1/256, or int16",
    "logits_clipped": "attention logits clipped: recalibrate wider, or int16",
    "norm_input_outliers": "outlier channels into a norm: int16 @norm_input, SmoothQuant",
    FLOAT_DIFFERS: "float weights differ: compare with the float model it came from",
}


def findings(frame: pd.DataFrame, unquantized: dict[str, set[str]] | None = None,
             unranged: dict[str, set[str]] | None = None) -> dict[str, dict[str, Any]]:
    """Per compared model: the worst layer, where error first crosses a threshold, and the
    first layer at fault itself (its own error) -- or, when every flagged row only inherits
    its error, the layer with the largest own error.  JSON's ``meta.findings``.

    ``unquantized``: per target, the rows with no quantization of their own (no weight point
    and no output point: a BN whose ReLU6 holds the point): they can carry error, never
    be at fault.  ``unranged``: per target, the rows whose output no point of their own
    quantizes (a conv + BN before a fused ReLU6): at fault for rounding (their weights), never
    for an activation range (clipping, outlier channels)."""
    unquantized, unranged = unquantized or {}, unranged or {}
    out: dict[str, dict[str, Any]] = {}
    for target, rows in frame.groupby("target", sort=False):
        measured = rows[rows["note"] == ""]
        if measured.empty:
            out[target] = {"layers": 0, "flagged": 0}
            continue
        flagged = measured[measured["diagnosis"] != ""]
        own_rows = measured[~measured["layer"].isin(unquantized.get(target, set()))]
        own_rows = own_rows if not own_rows.empty else measured
        if own_rows["isolated_sqnr_db"].notna().any():
            # The worst layer is the one whose *own* error is worst, not one that inherits it.
            worst = own_rows.sort_values("isolated_sqnr_db", na_position="last").iloc[0]
        else:  # --no-isolated: only the propagated error is known
            worst = own_rows.sort_values("sqnr_db", na_position="first").iloc[0]
        found: dict[str, Any] = {"layers": int(len(measured)), "flagged": int(len(flagged)),
                                 "worst_layer": worst["layer"], "worst_sqnr_db": worst["sqnr_db"],
                                 "worst_isolated_sqnr_db": worst["isolated_sqnr_db"]}
        if not flagged.empty:
            first = flagged.iloc[0]
            found.update(first_flagged=first["layer"], first_diagnosis=first["diagnosis"])
            range_problem = flagged["diagnosis"].isin(["clipping", "outlier_channels", "logits_clipped"])
            cause = flagged[~flagged["diagnosis"].isin(["propagated", FLOAT_DIFFERS])
                            & ~flagged["layer"].isin(unquantized.get(target, set()))
                            & ~(range_problem & flagged["layer"].isin(unranged.get(target, set())))]
            # Every layer whose own quantized range its wide channels stretch, in execution order (at
            # fault or not): what a float-side fix (cross-layer equalization, ``qdebug.fix``) may keep int8.
            wide = cause.loc[cause["diagnosis"] == "outlier_channels", "layer"]
            if not wide.empty:
                found["outlier_layers"] = list(dict.fromkeys(wide))
            if cause.empty:  # every flagged row only inherits its error: no single layer is to blame
                found.update(at_fault=None, largest_own_error=worst["layer"],
                             largest_own_error_db=worst["isolated_sqnr_db"])
            else:
                row = cause.iloc[0]
                found.update(at_fault=row["layer"], at_fault_diagnosis=row["diagnosis"])
                if row["diagnosis"] == "outlier_channels" and not pd.isna(row.get("widest_channel")):
                    found.update(outlier_channel=int(row["widest_channel"]),
                                 channel_range_ratio=row["channel_range_ratio"])
        out[target] = found
    return out


def summarize(frame: pd.DataFrame, limits: dict[str, float], ref_label: str,
              unquantized: dict[str, set[str]] | None = None, found: dict | None = None) -> str:
    """A few short lines per compared model (see ``findings``; ``found``: findings already made)."""
    lines = []
    for target, found in (found if found is not None else findings(frame, unquantized)).items():
        if not found["layers"]:
            lines.append(f"{target} vs {ref_label}: no comparable layer")
            continue
        if found.get("float_differs"):  # said first: what the rows below measure is mostly not quantization
            lines += reference_warning(target, ref_label, found["float_differs"], found).splitlines()
        own = found["worst_isolated_sqnr_db"]
        worst = f"{found['worst_layer']} ({_fmt_db(found['worst_sqnr_db'])}" + (
            f"; its own error {_fmt_db(own)} isolated)" if own is not None and not math.isnan(own) else ")")
        if not found["flagged"]:
            lines += [f"{target} vs {ref_label}: nothing flagged "
                      f"(sqnr_db < {limits['sqnr_db']:g}, isolated_sqnr_db < {limits['isolated_sqnr_db']:g})",
                      f"  worst layer:   {worst}"]
            continue
        drifted = int(((frame["target"] == target) & (frame["diagnosis"] == FLOAT_DIFFERS)).sum())
        lines += [f"{target} vs {ref_label}: {found['flagged']} of {found['layers']} layers flagged"
                  + (f" ({drifted} {FLOAT_DIFFERS}: drift)" if drifted else ""),
                  f"  worst layer:   {worst}",
                  f"  first flagged: {found['first_flagged']} ({found['first_diagnosis']})"]
        if drifted and not found.get("float_differs") and found.get("worst_drift_layer"):  # not said above
            lines.append(f"  drifted most:  {found['worst_drift_layer']} ({_fmt_db(found['worst_drift_sqnr_db'])} "
                         "quantization off)")
        if found.get("float_differs") and found["at_fault"] is None:
            lines += ["  at fault:      no layer: the float model differs, not quantization"]
        elif found["at_fault"] is None:  # the worst layer above is the one with the largest own error
            lines += ["  at fault:      no layer alone: the loss builds up over many layers"]
        else:
            diagnosis = found["at_fault_diagnosis"]
            detail = diagnosis
            if "outlier_channel" in found:
                detail += (f": channel {found['outlier_channel']} spans {found['channel_range_ratio']:.0f}x the "
                           "median channel's range")
            if "zero_code_share" in found:
                detail += f": {found['zero_code_share']:.0%} of its nonzero probabilities on code 0"
            if "norm_input_channel" in found:
                detail += (f": input channel {found['norm_input_channel']} reaches {found['norm_input_ratio']:.0f}x "
                           "the median channel's max |x|")
            lines += [f"  at fault:      {found['at_fault']} ({detail})"]
            if found.get("downstream_layer"):
                lines.append(f"  consequence:   {found['downstream_layer']}: {found['downstream_zero_codes']:.0%} of "
                             f"its channel-{found['outlier_channel']} weights round to 0 "
                             f"({found['downstream_zero_codes_elsewhere']:.0%} elsewhere)")
            lines.append(f"  cause:         {ADVICE[diagnosis].format(gain=6.02 * 8)}")
    return "\n".join(escaped(line) for line in lines)  # a name's newline stays inside its line


def _fmt_db(value: float) -> str:
    if value is None or math.isnan(value):
        return "NaN dB"
    if math.isinf(value):
        return "inf dB"
    return f"{value:.1f} dB"


__all__ = ["compare", "choose_reference", "CompareResult", "METRICS", "DEFAULT_SHOW", "DEFAULT_THRESHOLDS", "diagnose",
           "modern_cause", "findings"]
