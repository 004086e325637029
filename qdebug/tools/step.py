"""``step``: step-wise partial quantization -- which module is to blame, down to the layer.

Every step is a trial of the experiment primitive (``qdebug.tools.experiment``):
some quant points in their quantized mode, every other point in float, measured
against the float model's outputs (and metric) over all batches.  Step 0 is the
whole model quantized, for scale.

Units.  A quant point's path is its layer's module path (a weight: its layer; a
module's output: the module; an inline op: its name under its container, e.g.
``layer1.0.add``), with the ``#k`` of a second call (``layer1.0.relu#2`` is a unit of
its own, as it is a point of its own); a BN paired with a conv counts as
the conv (a Conv-BN pair is one unit in every BN mode).  The unit at depth d is the
first d components of the path: at depth 1 ``layer1``, at depth 2 ``layer1.0``.

Modes:

- ``only``: the selection (``--module`` patterns) quantized, the rest float;
- ``except``: everything quantized but the selection;
- ``auto``: every unit at ``depth`` alone (inside the selection, if given);
- ``cumulative``: the units at ``depth`` quantized one after another in execution
  order -- the error curve as quantization spreads through the network;
- ``drill``: the units one level down alone, then the children of the worst, and so
  on until the worst is a single quant point.  Beside each unit's cost alone, a drill
  measures what leaving it in float recovers (everything quantized but the unit, vs
  everything quantized): a unit can cost much alone and still leave the whole model
  where it was -- the loss builds up over many layers, and no single unit is to blame
  (``single_culprit``; compare says the same from its isolated errors).

``kind`` ("weight" | "activation" | "both") says which of a selection's points are
switched (AIMET's weights-only / activations-only analysis).  When the costliest
unit has both, two more steps quantize its weights alone and its activations alone,
so the summary can say which one loses.

"Worst" is the lowest metric score (quantized / float, baseline's rule) when a
metric is given -- steps within one sample's worth of it (1 / samples) count as tied
and are ranked by output SQNR, since one flipped sample is noise -- else the lowest
output SQNR.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import pandas as pd
import torch.nn as nn

from qdebug.engine import engine_state
from qdebug.engine.prepare import name_matches
from qdebug.errors import QDebugError
from qdebug.data.metrics import Metric
from qdebug.safe_text import escaped
from qdebug.tools.baseline import TaskRule
from qdebug.tools.experiment import Experiment, Trial, TrialResult, nan_low, worst

MODES = ("only", "except", "auto", "cumulative", "drill")
SMALL_EVAL = 1000  # below this many samples the summary says how coarse the metric is
# A drill's unit is a single culprit when, left in float with everything else quantized, it
# wins back half the loss: the output's quantization noise power halved (this many dB), or half
# the metric ratio lost (and more than one sample's worth).  Below it on every unit the loss
# builds up over many layers.
RECOVERS_DB = 10 * math.log10(2)
KINDS = ("both", "weight", "activation")


@dataclass
class StepResult:
    frame: pd.DataFrame  # one row per step
    meta: dict[str, Any]
    summary: str


class Units:
    """The quantizable points of a model grouped by module path (see module docstring)."""

    def __init__(self, model: nn.Module, points: Sequence[str]):
        state = engine_state(model)
        self.points = list(points)  # execution order
        self.order = {name: i for i, name in enumerate(self.points)}
        self.kind = {name: state.points[name].kind for name in self.points}
        bn_to_conv = {bn: conv for conv, bn in state.plan.pairs}
        self.path: dict[str, str] = {}
        for name in self.points:
            point = state.points[name]
            # ``relu#2``: its own unit; a member of a structured output (``lstm:1.1``): its call's.
            path = point.owner if point.kind == "weight" else state.plan.call_of_point(name)
            if path not in state.plan.calls and point.owner in state.plan.calls:
                path = point.owner  # a point inside a recurrent layer (``lstm.l0.cell``): its layer's unit
            for bn, conv in bn_to_conv.items():
                if path == bn or path.startswith(bn + "."):
                    path = conv + path[len(bn):]
            self.path[name] = path
        self.owner = {name: state.points[name].owner for name in self.points}
        self.modules = sorted({m for m, _ in model.named_modules() if m} | set(self.path.values()))

    def select(self, patterns: Sequence[str]) -> list[str]:
        """Points matching any pattern (a glob or module prefix, on point names, owners or paths)."""
        chosen = []
        for pattern in patterns:
            hits = [n for n in self.points if name_matches(pattern, n) or name_matches(pattern, self.owner[n])
                    or name_matches(pattern, self.path[n])]
            if not hits:
                close = difflib.get_close_matches(pattern, self.modules + self.points, n=3, cutoff=0.5)
                raise QDebugError(f"--module {pattern!r} matches no quantized layer",
                                  (f"closest names: {', '.join(close)}" if close else
                                   "give a module path such as layer1 or a glob such as 'layer1.*'")
                                  + "; qdebug inspect lists them")
            chosen += hits
        return sorted(set(chosen), key=self.order.__getitem__)

    def of_kind(self, names: Sequence[str], kind: str) -> list[str]:
        return [n for n in names if kind == "both" or self.kind[n] == kind]

    def depth_of(self, names: Sequence[str]) -> int:
        """Depth of the deepest module path containing all of ``names`` (0: the root)."""
        parts = [self.path[n].split(".") for n in names]
        depth = 0
        while all(len(p) > depth for p in parts) and len({tuple(p[:depth + 1]) for p in parts}) == 1:
            depth += 1
        return depth

    def group(self, names: Sequence[str], depth: int) -> dict[str, list[str]]:
        """``names`` by unit at ``depth``, in execution order of each unit's first point."""
        groups: dict[str, list[str]] = {}
        for name in sorted(names, key=self.order.__getitem__):
            groups.setdefault(".".join(self.path[name].split(".")[:depth]), []).append(name)
        return groups

    def children(self, names: Sequence[str]) -> dict[str, list[str]]:
        """The next level of a drill inside ``names``: units one level below their common
        module; a unit that cannot be split by path (a conv with its BN) splits into points."""
        depth = self.depth_of(names)
        while True:
            groups = self.group(names, depth + 1)
            if len(groups) > 1:
                return groups
            if max(len(self.path[n].split(".")) for n in names) <= depth + 1:
                return {n: [n] for n in names} if len(names) > 1 else {}
            depth += 1


def check_selection(model: nn.Module, modules: Sequence[str]) -> list[str]:
    """The points ``modules`` select among the model's quantized ones (an error names the
    closest names when a pattern matches none): checked before any data is read."""
    quantizable = [name for name, p in engine_state(model).points.items() if p.mode == "fake"]
    return Units(model, quantizable).select(modules) if modules else quantizable


def _worst(done: Sequence[TrialResult], tolerance: float) -> TrialResult:
    """The worst step: the lowest metric score -- steps within ``tolerance`` of it (one
    sample's worth: a single flipped sample is noise) are ranked by output SQNR -- or,
    without a metric, the lowest output SQNR."""
    lowest = min(_score(r)[0] for r in done)
    close = [r for r in done if _score(r)[0] <= lowest + tolerance] if math.isfinite(lowest) else list(done)
    return min(close, key=lambda r: (_score(r)[1], _score(r)[0]))


def _score(result: TrialResult) -> tuple[float, float]:
    """Sort key, lower is worse: (lowest task score, lowest output SQNR); NaN counts as worst."""
    sqnr = nan_low(result.worst_sqnr_db) if result.outputs else math.inf
    ratio = min((nan_low(v) for k, v in result.row.items() if k.endswith("_ratio")), default=math.inf)
    return ratio, sqnr


def step(model: nn.Module, batches: Sequence[Any], *, reference: nn.Module | None = None,
         modules: Sequence[str] = (), mode: str = "only", depth: int = 1, kind: str = "both",
         metric: Metric | None = None, metric_name: str = "metric", rules: Mapping[str, TaskRule] | None = None,
         progress: Callable[[int, int], None] | None = None) -> StepResult:
    """Partial-quantization steps of ``model`` against the float outputs (see module docstring).

    ``reference``: the float model (None: ``model`` with every point in float).
    ``rules``: task -> ``TaskRule`` (baseline's rule; ``"metric"`` for a single-number metric).
    """
    if mode not in MODES:
        raise QDebugError(f"unknown step mode {mode!r}", f"choose one of {', '.join(MODES)}")
    if kind not in KINDS:
        raise QDebugError(f"unknown kind {kind!r}", f"choose one of {', '.join(KINDS)}")
    if depth < 1:
        raise QDebugError(f"depth must be >= 1, got {depth}", "depth 1 is the model's top-level modules")
    if mode in ("only", "except") and not modules:
        raise QDebugError(f"--{mode} needs the modules to select", "e.g. --module backbone (repeatable)")
    experiment = Experiment(model, batches, reference=reference, metric=metric, metric_name=metric_name,
                            progress=progress)
    if not experiment.quantizable:
        raise QDebugError("the model has no quantized point to step through",
                          "give a calibrated, QAT or quantized checkpoint (qdebug inspect shows its points)")
    units = Units(model, experiment.quantizable)

    def tolerance() -> float:  # one sample, as a share of the score (the first run counts the samples)
        samples = experiment.samples
        return 1.0 / samples if metric is not None and samples else 0.0

    rules = dict(rules or {})
    selected = units.select(modules) if modules else list(units.points)
    everything = frozenset(units.points)
    rows: list[dict[str, Any]] = []
    results: list[TrialResult] = []
    complements: list[TrialResult] = []  # measured for the recovery columns, no row of their own

    def measure(trials: list[Trial], without: Sequence[Trial] = ()) -> list[TrialResult]:
        """Rows of ``trials``; ``without``: the complements of the last ``len(without)`` trials
        (all quantized but their unit), measured in the same pass: what leaving each unit in
        float recovers goes into its row, and the complements themselves make no row."""
        # Reversed: complement k then resumes from complement k+1's run, which agrees with it
        # up to unit k (they are in execution order), as much as the whole model's run would.
        done = experiment.run([*trials, *reversed(without)])
        for result in done:
            result.row = {**result.trial.info, **experiment.verdict(result.metric, rules)} if metric else dict(result.trial.info)
        done, others = done[:len(trials)], done[len(trials):][::-1]
        if others:
            quantized = results[0] if results else done[0]  # the whole model: step 0
            for result, other in zip(done[len(done) - len(others):], others):
                result.row.update(_recovery(other, quantized))
            complements.extend(others)
        for result in done:
            rows.append(_row(len(rows), result, experiment))
            results.append(result)
        return done

    def without(trials: Sequence[Trial]) -> list[Trial]:
        """Each trial's complement: everything quantized but the trial's points."""
        return [Trial(everything - t.quantized, {**t.info, "mode": "without"}) for t in trials]

    def kind_of(names: Sequence[str]) -> str:
        # Points all of one kind say which (a layer's output point shares the layer's name).
        kinds = {units.kind[n] for n in names}
        return kinds.pop() if len(kinds) == 1 else kind

    def alone(label: str, names: Sequence[str], level: int | None = None, step_mode: str = mode) -> Trial:
        chosen = units.of_kind(names, kind)
        info = {"selection": label, "mode": step_mode, "kind": kind_of(chosen)}
        if level is not None:
            info["level"] = level
        return Trial(frozenset(chosen), info)

    whole = Trial(everything, {"selection": "*", "mode": "all", "kind": "both", **({"level": 0} if mode == "drill" else {})})
    label = ",".join(modules)
    drill_path: list[dict[str, Any]] = []
    if mode == "only":
        measure([whole, alone(label, selected)])
        culprit = results[1]
    elif mode == "except":
        kept = frozenset(units.of_kind(selected, kind))
        measure([whole, Trial(everything - kept, {"selection": label, "mode": "except", "kind": kind})])
        culprit = None
    elif mode in ("auto", "cumulative"):
        # Units with no point of the kind asked for would switch nothing: left out.
        groups = {name: names for name, names in units.group(selected, depth).items() if units.of_kind(names, kind)}
        if mode == "auto":
            trials = [alone(name, names) for name, names in groups.items()]
        else:
            trials, grown = [], []
            for name, names in groups.items():
                added = units.of_kind(names, kind)
                grown += added
                trials.append(Trial(frozenset(grown), {"selection": name, "mode": "cumulative",
                                                       "kind": kind_of(added)}))
        done = measure([whole, *trials])[1:]
        culprit = _costliest(done, cumulative=mode == "cumulative", tolerance=tolerance())
    else:  # drill
        group = selected
        level = 1
        first = True
        culprit = None
        leaves: list[TrialResult] = []  # every single point measured alone on the way
        worst_of_level: list[TrialResult] = []  # all but the last level's were gone into
        while True:
            children = units.children(group)
            if not children:
                break
            children = {name: names for name, names in children.items() if units.of_kind(names, kind)}
            if not children:
                break
            trials = [alone(name, names, level) for name, names in children.items()]
            done = measure(([whole] if first else []) + trials, without(trials))[(1 if first else 0):]
            first = False
            leaves += [r for r in done if len(r.trial.quantized) == 1]
            culprit = _worst(done, tolerance())
            worst_of_level.append(culprit)
            drill_path.append(_path_entry(culprit, experiment))
            group = children[culprit.trial.info["selection"]]
            if len(group) <= 1:
                break
            level += 1
        if culprit is not None and leaves:
            # The costliest point: a point left at an upper level (the input beside an LSTM whose
            # group was worse) can cost more alone than the one the descent ends on.
            culprit = _worst([culprit, *leaves], tolerance())
        if culprit is None:  # a single point selected: nothing to drill into
            only_one = alone(label or units.points[0], selected, 1)
            measure([whole, only_one], without([only_one]))
            culprit = results[1]
    split = None
    own: list[str] = []
    if culprit is not None:
        own = sorted(culprit.trial.quantized, key=units.order.__getitem__)
        if mode == "cumulative":
            own = units.of_kind(units.group(selected, depth)[culprit.trial.info["selection"]], kind)
    if culprit is not None and kind == "both":
        names = own
        weights, activations = units.of_kind(names, "weight"), units.of_kind(names, "activation")
        if weights and activations:
            info = {"selection": culprit.trial.info["selection"], "mode": "split",
                    **({"level": culprit.trial.info.get("level")} if mode == "drill" else {})}
            split = measure([Trial(frozenset(weights), {**info, "kind": "weight"}),
                             Trial(frozenset(activations), {**info, "kind": "activation"})])
    frame = pd.DataFrame(rows)
    tasks = list(experiment.float_metric or {})
    meta = {
        "mode": mode, "kind": kind, "depth": depth, "modules": list(modules), "batches": experiment.batches.count,
        "points": len(units.points), "outputs": list(results[0].outputs) if results else [],
        "float_metric": experiment.float_metric, "tasks": tasks,
        "drill_path": drill_path,
        "culprit": _culprit_meta(culprit, split, experiment, own, results) if culprit is not None else None,
        **_single_culprit(results, worst_of_level[:-1] if mode == "drill" else [], tolerance()),
        "served_calls": sum(r.served_calls for r in (*results, *complements)),
        "floor_sqnr_db": worst(o["sqnr_db"] for o in experiment.floor.values()) if experiment.floor else None,
        "reference": "float model" if reference is not None else "the model with every point in float",
        "samples": experiment.samples,
        "passed": (bool(frame.iloc[0]["verdict"] == "pass") if metric is not None and "verdict" in frame
                   and frame.iloc[0]["mode"] == "all" else None),
    }
    return StepResult(frame, meta, summarize(frame, meta))


def _recovery(without: TrialResult, quantized: TrialResult) -> dict[str, float]:
    """What leaving a unit in float recovers: ``recovers_db``, the output SQNR with everything
    quantized but the unit minus with everything quantized; per task ``<task>_recovers``, the
    same of the metric ratio."""
    found = {"recovers_db": _gain(without.worst_sqnr_db, quantized.worst_sqnr_db)}
    for key, value in without.row.items():
        if key.endswith("_ratio"):
            found[f"{key[:-len('_ratio')]}_recovers"] = _gain(value, quantized.row.get(key))
    return found


def _gain(after: float | None, before: float | None) -> float:
    """``after - before`` with NaN counted as the worst (-inf): a unit whose removal makes a
    NaN output finite recovers inf; one that leaves it NaN (or infinite SQNR as it was) recovers 0."""
    a, b = nan_low(after), nan_low(before)
    return 0.0 if a == b else a - b


def _recovered(row: Mapping[str, Any]) -> float:
    """The largest task-ratio recovery of a row (-inf without a metric): the rank before dB."""
    return max((nan_low(v) for k, v in row.items() if k.endswith("_recovers")), default=-math.inf)


def _above_noise(row: Mapping[str, Any], whole: Mapping[str, Any], tolerance: float) -> bool:
    """Whether leaving the row's unit in float wins back half the loss (``RECOVERS_DB``): half
    the output's noise power, or half a task's ratio lost (``whole``: step 0's row) when that is
    more than one sample's worth (``tolerance``: a flipped sample is noise)."""
    for key, value in row.items():
        if key.endswith("_recovers"):
            lost = 1.0 - nan_low(whole.get(key[:-len("_recovers")] + "_ratio"))
            # (1e-12: ratios of sample counts, compared as the fractions they are)
            if nan_low(value) > tolerance + 1e-12 and nan_low(value) >= lost / 2 - 1e-12:
                return True
    return nan_low(row["recovers_db"]) >= RECOVERS_DB - 1e-9


def _single_culprit(results: Sequence[TrialResult], descended: Sequence[TrialResult],
                    tolerance: float) -> dict[str, Any]:
    """``single_culprit``: whether some unit of a drill, left in float with everything else
    quantized, wins back half the loss (None outside a drill); ``recovers_most``: the unit that
    recovers the most (among those that do, when any does).  The units the drill went into
    (``descended``: its children were measured) are not counted: a module holding half the
    network recovers much, and the question is whether one of its parts does."""
    skipped = {id(r) for r in descended}
    measured = [r for r in results if "recovers_db" in r.row and id(r) not in skipped]
    if not measured:
        return {"single_culprit": None, "recovers_most": None}
    above = [r for r in measured if _above_noise(r.row, results[0].row, tolerance)]
    best = max(above or measured, key=lambda r: (_recovered(r.row), nan_low(r.row["recovers_db"])))
    entry = {"selection": best.trial.info["selection"], "kind": best.trial.info["kind"],
             **{k: v for k, v in best.row.items() if k == "recovers_db" or k.endswith("_recovers")}}
    return {"single_culprit": bool(above), "recovers_most": entry}


def _row(index: int, result: TrialResult, experiment: Experiment) -> dict[str, Any]:
    row: dict[str, Any] = {"step": index}
    info = dict(result.trial.info)
    if "level" in info:
        row["level"] = info.pop("level")
    row.update(selection=info.pop("selection"), mode=info.pop("mode"), kind=info.pop("kind"), **info)
    row.update(points=result.points, macs_share=result.macs_share, params_share=result.params_share)
    outputs = result.outputs
    row["sqnr_db"] = result.worst_sqnr_db
    row["cosine"] = worst(o["cosine"] for o in outputs.values())
    if len(outputs) > 1:
        for name, values in outputs.items():
            row[f"{name}_sqnr_db"], row[f"{name}_cosine"] = values["sqnr_db"], values["cosine"]
    for key, value in getattr(result, "row", {}).items():
        if key not in row:
            row[key] = value
    return row


def _costliest(done: list[TrialResult], *, cumulative: bool, tolerance: float) -> TrialResult:
    """The unit costing the most: the worst step, or in a cumulative sweep the step that lost
    the most when its unit was added (score drop; noise power added, without a metric)."""
    if not cumulative:
        return _worst(done, tolerance)
    best, best_cost = done[0], -math.inf
    previous = (math.inf, math.inf)
    for result in done:
        ratio, sqnr = _score(result)
        if math.isfinite(previous[0]) or math.isfinite(ratio):
            cost = (previous[0] if math.isfinite(previous[0]) else 1.0) - ratio
        else:
            cost = _noise(sqnr) - _noise(previous[1])
        if cost > best_cost:
            best, best_cost = result, cost
        previous = (ratio, sqnr)
    return best


def _noise(sqnr: float) -> float:
    """Noise power relative to the signal: 10^(-SQNR/10)."""
    if math.isnan(sqnr):
        return math.inf
    return 10 ** (-sqnr / 10) if math.isfinite(sqnr) else (0.0 if sqnr > 0 else math.inf)


def _path_entry(result: TrialResult, experiment: Experiment) -> dict[str, Any]:
    entry: dict[str, Any] = {"selection": result.trial.info["selection"], "kind": result.trial.info["kind"],
                             "sqnr_db": result.worst_sqnr_db}
    for task, value in result.metric.items():
        f = (experiment.float_metric or {}).get(task)
        entry[f"{task}_delta"] = value - f if f is not None else math.nan
    return entry


def _culprit_meta(culprit: TrialResult, split: list[TrialResult] | None, experiment: Experiment,
                  own: list[str], results: list[TrialResult]) -> dict[str, Any]:
    found = _path_entry(culprit, experiment)
    found["macs_share"], found["params_share"] = experiment.shares(own)
    found.update({k: v for k, v in culprit.row.items() if k == "recovers_db" or k.endswith("_recovers")})
    if culprit.trial.info.get("mode") == "cumulative":
        index = results.index(culprit)
        before = results[index - 1] if index > 1 else None  # results[0] is the whole model
        found["before_sqnr_db"] = before.worst_sqnr_db if before is not None else math.inf
    if split:
        w, a = (r.worst_sqnr_db for r in split)
        found.update(weights_sqnr_db=w, activations_sqnr_db=a,
                     loss_in="weights" if nan_low(w) < nan_low(a) else "activations")
    return found


def _db(v: float) -> str:
    if v is None or math.isnan(v):
        return "NaN dB"
    return "inf dB" if math.isinf(v) else f"{v:.1f} dB"


def _delta(entry: Mapping[str, Any], samples: int | None = None) -> str:
    """One path entry as a short loss: metric points when the metric is a fraction (and, on
    few samples, how many samples that is), else the step's output SQNR."""
    deltas = [(k[:-6], v) for k, v in entry.items() if k.endswith("_delta")]
    if not deltas:
        return _db(entry["sqnr_db"])
    task, d = min(deltas, key=lambda kv: nan_low(kv[1]))
    if math.isnan(d) or abs(d) > 1:
        return f"{d:+.3g}"
    text = f"{d * 100:+.1f} pts" if abs(d) >= 0.001 or d == 0 else f"{d * 100:+.2f} pts"
    if samples and samples < SMALL_EVAL and d:
        flipped = round(abs(d) * samples)
        text += f", {flipped} sample{'s' if flipped != 1 else ''}"
    return f"{text}; {_db(entry['sqnr_db'])}"


def _gains(entry: Mapping[str, Any]) -> str:
    """What leaving a unit in float recovers: ``+0.5 dB`` and per task ``top1 +0.021 x float``."""
    db = entry["recovers_db"]
    parts = ["NaN dB" if math.isnan(db) else f"{db:+.1f} dB"]
    parts += [f"{key[:-len('_recovers')]} {value:+.3f} x float" for key, value in entry.items()
              if key.endswith("_recovers")]
    return ", ".join(parts)


def _share(value: float) -> str:
    """A share as a percentage that never rounds a part to 0% or 100%."""
    if 0 < value < 0.01:
        return "<1%"
    if 0.99 < value < 1:
        return ">99%"
    return f"{value * 100:.0f}%"


def _unit(entry: Mapping[str, Any]) -> str:
    """A unit as the summary names it: ``layer3`` or, for one kind of point, ``fc activation``."""
    kind = entry.get("kind", "both")
    return entry["selection"] if kind == "both" else f"{entry['selection']} {kind}"


def summarize(frame: pd.DataFrame, meta: Mapping[str, Any]) -> str:
    """A few short lines: the whole model, the costliest unit and its kind of loss, the drill path."""
    if frame.empty:
        return "no step measured"
    lines = []
    whole = frame.iloc[0]
    tasks = meta.get("tasks") or []
    scores = ", ".join(f"{t} {whole[t]:.4g} = {whole[t + '_ratio']:.3f} x float" for t in tasks if t in whole)
    lines.append(f"all quantized: {_db(whole['sqnr_db'])} output SQNR" + (f"; {scores} ({whole['verdict']})" if scores else ""))
    floor = meta.get("floor_sqnr_db")
    # Said when it matters next to the quantization loss (not BN folding's ~150 dB rounding).
    if floor is not None and not math.isinf(floor) and floor < nan_low(whole["sqnr_db"]) + 20:
        lines.append(f"nothing quantized: {_db(floor)} vs float (the checkpoint's weights differ from float)")
    if meta["mode"] == "except":
        row = frame.iloc[1]
        scores = ", ".join(f"{t} {row[t + '_ratio']:.3f} x float" for t in tasks if t + "_ratio" in row)
        lines.append(f"all but {row['selection']}: {_db(row['sqnr_db'])}" + (f"; {scores} ({row['verdict']})" if scores else ""))
    culprit = meta.get("culprit")
    if meta.get("passed"):
        lines.append("nothing to fix: the whole model meets the rule")
    if culprit:
        share = f", {_share(culprit['macs_share'])} of MACs" if culprit.get("macs_share") else ""
        change = _delta(culprit, meta.get("samples"))
        if "before_sqnr_db" in culprit and not any(k.endswith("_delta") for k in culprit):
            change = f"{_db(culprit['before_sqnr_db'])} -> {change} when added"
        lines.append(f"costs the most: {_unit(culprit)} ({change}{share})")
        if "loss_in" in culprit:
            lines.append(f"  loss in its {culprit['loss_in']}: weights alone {_db(culprit['weights_sqnr_db'])}, "
                         f"activations alone {_db(culprit['activations_sqnr_db'])}")
        if "recovers_db" in culprit:
            lines.append(f"  left in float, everything else quantized: recovers {_gains(culprit)}")
    most = meta.get("recovers_most")
    if meta.get("single_culprit") is False and not meta.get("passed"):
        lines.append(f"no single culprit: the loss builds up over many layers -- no unit left in float wins back "
                     f"half of it (the most: {_unit(most)}, {_gains(most)})")
        lines.append("  qdebug suggest finds the smallest verified set of int16 points that meets the target")
    elif meta.get("single_culprit") and culprit and (most["selection"], most["kind"]) != (culprit["selection"],
                                                                                          culprit["kind"]):
        lines.append(f"recovers the most: {_unit(most)} ({_gains(most)} when left in float)")
    if meta.get("drill_path"):
        lines.append("drill: " + " > ".join(f"{_unit(e)} ({_delta(e).split(';')[0]})" for e in meta["drill_path"]))
    if tasks and meta.get("samples", 0) < SMALL_EVAL:
        lines.append(f"note: metric on {meta['samples']} samples: steps within one sample of the worst rank by SQNR")
    return "\n".join(escaped(line) for line in lines)  # a name's newline stays inside its line


__all__ = ["step", "check_selection", "StepResult", "Units", "MODES", "KINDS", "summarize"]
