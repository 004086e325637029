"""``qdebug fix``: apply the float-side fixes one by one, prove each on the data, keep what helps.

The transforms of ``qdebug.fix`` (cross-layer equalization, high-bias absorption, SmoothQuant,
bias correction) each return a new float model and a report of what they changed.  A change to
the float model is only worth deploying when the *quantized* model gets better, so every one is
measured the way it will be used:

1. The batches are split as suggest splits them (``holdout_size``): from 4 batches on, the last
   quarter is held out; the rest is the *calibration part*.  The transforms measure what they
   need on the calibration part; with fewer than 4 batches both parts are all the batches (the
   result says so: ``meta["held_out"]`` is 0).
2. The **baseline** is the original float model prepared with the given ``QConfig`` and mode,
   calibrated on the calibration part, and run on the held-out part against the original float
   model's outputs (``qdebug.tools.experiment.Experiment``: one trial with every point quantized):
   its worst output SQNR and, with a metric, each task's value.
3. For each method, in ``METHODS`` order: the transform runs on the current model; when it
   changes nothing the row says why and nothing is measured; else the candidate is prepared and
   calibrated with the same QConfig on the same batches and measured the same way, always
   against the ORIGINAL float outputs (bias correction changes the float function on purpose;
   measuring it against its own float would hide that).  The candidate is **kept** when it
   helps: with a metric, no task worse and one better, or every task equal and the SQNR higher by
   at least ``MIN_GAIN_DB``; without one, the SQNR higher by at least ``MIN_GAIN_DB``.  A kept
   candidate is the next method's starting point and the next row's "before".

``float_sqnr_db`` is the candidate's float output against the original float model's on the
held-out part (prepared in float mode: BN folding included).  A function-preserving method is
dropped below ``FLOAT_PRESERVED_DB`` (80 dB): its data-based parts (a ReLU6 pair's peaks, an absorbed
bias's minimum) did not hold on inputs it had not seen.  Bias correction moves it on purpose and
the summary says by how much.  Equalization that moved the float output is tried again without its
ReLU6 pairs (``EXACT_FALLBACK``: every remaining pair is exact on any input), and that variant is
measured and judged instead; the row says so.

Why this order: equalization and absorption reshape ranges without changing the function; SmoothQuant
moves activation outliers into weights (also function preserving); bias correction last, because it
corrects the mean error left by everything before it, measured on the model that will be deployed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch.nn as nn

from qdebug import vocab
from qdebug.data.source import BatchSource
from qdebug.data.spec import as_source
from qdebug.errors import QDebugError

METHODS = vocab.FIX_METHODS
MIN_GAIN_DB = 0.1  # a kept method must raise the output SQNR by this much (or improve the metric)
# A function-preserving method must leave the float output this close to the original's on the
# held-out part (the bar for CLE; float32 rounding alone gives 120-140 dB); a data-based
# method (a ReLU6 pair, an absorbed bias) can fail it on inputs beyond the batches it measured.
FLOAT_PRESERVED_DB = 80.0
CHANGES_FUNCTION = ("bias_correction",)  # on purpose: the float output moves, and the row says so


def _equalize_exact(model: nn.Module, example: Any):
    """Equalization without the data: ReLU6 pairs skipped, every pair exact on any input."""
    from qdebug.fix.equalize import equalize

    return equalize(model, example)


# method -> its variant without data-based parts, tried when the method moved the float output on
# the held-out part: equalization's ReLU6 pairs rest on the peaks the calibration part showed.
EXACT_FALLBACK: dict[str, Callable] = {"equalize": _equalize_exact}
COLUMNS = ["method", "kept", "changes", "float_sqnr_db", "sqnr_before_db", "sqnr_after_db", "gain_db", "reason"]
WHAT = {  # one line per method, for the summary and docs/fix.md
    "equalize": "cross-layer equalization (Nagel et al. 2019)",
    "absorb": "high-bias absorption",
    "smooth": "SmoothQuant scaling after norms (Xiao et al. 2023)",
    "bias_correction": "empirical bias correction",
}


@dataclass
class FixResult:
    model: nn.Module  # the fixed float model (the original's deep copy when nothing was kept)
    frame: Any  # pd.DataFrame, COLUMNS (+ <task>_before/_after with a metric): one row per method
    changes: Any  # pd.DataFrame: every transform's report rows, with their ``method``
    meta: dict[str, Any] = field(default_factory=dict)
    summary: str = ""

    @property
    def kept(self) -> list[str]:
        return [row["method"] for row in self.frame.to_dict("records") if row["kept"]]


class _Inputs:
    """The inputs of a batch source's batches, re-iterable (each pass reads the source anew)."""

    def __init__(self, source: BatchSource):
        self._source = source

    def __iter__(self) -> Iterator[Any]:
        return (getattr(batch, "inputs", batch) for batch in self._source)  # a Batch, or model inputs as handed


def _transforms() -> dict[str, Callable]:
    """method -> transform(model, calibration inputs, example, qconfig, mode) -> (model, report)."""
    from qdebug.fix.absorb import absorb_high_bias
    from qdebug.fix.bias_correction import correct_bias
    from qdebug.fix.equalize import equalize
    from qdebug.fix.smooth import smooth

    return {
        "equalize": lambda m, data, example, qconfig, mode: equalize(m, example, batches=data),
        "absorb": lambda m, data, example, qconfig, mode: absorb_high_bias(m, data, example_inputs=example),
        "smooth": lambda m, data, example, qconfig, mode: smooth(m, data, qconfig=qconfig, example_inputs=example),
        "bias_correction": lambda m, data, example, qconfig, mode: correct_bias(m, data, qconfig, mode=mode,
                                                                               example_inputs=example),
    }


def check_methods(methods: Sequence[str] | None) -> list[str]:
    """The methods asked for, in ``METHODS`` order; an unknown or repeated name is refused."""
    if methods is None:
        return list(METHODS)
    asked = list(methods)
    unknown = [m for m in asked if m not in METHODS]
    if unknown or not asked:
        raise QDebugError(f"unknown fix method {unknown[0]!r}" if unknown else "no fix method given",
                          f"choose from {', '.join(METHODS)}")
    return [m for m in METHODS if m in asked]


def fix(model: nn.Module, batches: Any, *, qconfig: Any = None, mode: str = "fuse_bn",
        methods: Sequence[str] | None = None, metric: Any = None, metric_name: str = "metric",
        progress: Callable[[int, int | None], None] | None = None) -> FixResult:
    """Apply ``methods`` to the float ``model`` one by one and keep each only when the quantized
    model measurably improves (module docstring).  ``batches``: a BatchSource or list of batches;
    ``qconfig``: the QConfig the model will be calibrated with (default ``QConfig()``);
    ``metric``: ``metric(model, batches)`` as for baseline (None: output SQNR only)."""
    import pandas as pd

    from qdebug.engine import QConfig
    from qdebug.engine.prepare import is_prepared
    from qdebug.tools.suggest import batch_count, holdout_size, part_of

    if not isinstance(model, nn.Module):
        raise QDebugError(f"fix takes a float nn.Module, not a {type(model).__name__}", "pass the float model")
    if is_prepared(model):
        raise QDebugError("fix takes a float model, and this one is prepared by qdebug",
                          "give the float checkpoint (the one you calibrate or train from)")
    methods = check_methods(methods)
    qconfig = qconfig if qconfig is not None else QConfig()
    source = as_source(batches)
    count = batch_count(source)
    if count == 0:
        raise QDebugError("fix got no batches", "pass --data with at least one batch")
    held = holdout_size(count)
    calibration = part_of(source, 0, count - held) if held else source
    measured_on = part_of(source, count - held, count) if held else source
    example = next(iter(_Inputs(calibration)))
    data = _Inputs(calibration)
    forwards = [0]

    def advanced(n: int = 1) -> None:
        forwards[0] += n
        if progress is not None:
            progress(forwards[0], None)

    original = model.eval()
    proof = _Proof(original, qconfig, mode, example, data, measured_on, metric, metric_name, advanced)
    before: _Measured | None = None  # measured at the first change: a model nothing applies to costs no calibration
    rows, details = [], []
    current = original
    transforms = _transforms()
    for method in methods:
        candidate, report = transforms[method](current, data, example, qconfig, mode)
        advanced()
        details.append(report.assign(method=method))
        changes = int(report["applied"].astype(bool).sum()) if "applied" in report else 0
        row: dict[str, Any] = {"method": method, "kept": False, "changes": changes, "float_sqnr_db": math.nan,
                               "sqnr_before_db": math.nan, "sqnr_after_db": math.nan, "gain_db": math.nan,
                               "reason": _nothing_changed(report) if not changes else ""}
        rows.append(row)
        if not changes:
            if before is not None:  # else filled with the baseline once it is measured
                row["sqnr_before_db"] = before.sqnr_db
                row.update({f"{task}_before": value for task, value in before.metric.items()})
            continue
        before = before or proof.measure(original)
        after = proof.measure(candidate)
        row["kept"], row["reason"] = _verdict(method, before, after)
        if method in EXACT_FALLBACK and not row["kept"] and after.float_sqnr_db < FLOAT_PRESERVED_DB:
            # Its data-based part did not hold on the held-out part: the exact variant instead.
            exact, exact_report = EXACT_FALLBACK[method](current, example)
            advanced()
            exact_changes = int(exact_report["applied"].astype(bool).sum())
            moved = f"with ReLU6 pairs the float output moved to {after.float_sqnr_db:.1f} dB on held-out data"
            if exact_changes:
                candidate, after, changes = exact, proof.measure(exact), exact_changes
                details[-1] = exact_report.assign(method=method)
                row["kept"], row["reason"] = _verdict(method, before, after)
                row["reason"] = f"{moved}; without them: {row['reason']}"
            else:
                row["reason"] = f"{moved}; without them nothing to change"
        row.update(changes=changes, sqnr_before_db=before.sqnr_db, float_sqnr_db=after.float_sqnr_db,
                   sqnr_after_db=after.sqnr_db, gain_db=after.sqnr_db - before.sqnr_db)
        row.update({f"{task}_before": value for task, value in before.metric.items()})
        row.update({f"{task}_after": value for task, value in after.metric.items()})
        if row["kept"]:
            current, before = candidate, after
    if before is None:
        raise QDebugError("nothing to fix in this model: " + "; ".join(f"{r['method']}: {r['reason']}" for r in rows),
                          "fix rescales conv/linear pairs (through BN, ReLU), norms read by Linear layers, and the "
                          "biases of quantized conv/linear layers (docs/fix.md)")
    for row in rows:  # the methods that changed nothing before the first that did: the model as given
        if math.isnan(row["sqnr_before_db"]) and not row["changes"]:
            row["sqnr_before_db"] = proof.baseline.sqnr_db
            row.update({f"{task}_before": value for task, value in proof.baseline.metric.items()})
    frame = pd.DataFrame(rows)
    frame = frame[COLUMNS + [c for c in frame.columns if c not in COLUMNS]]
    changes = pd.concat(details, ignore_index=True) if details else pd.DataFrame()
    changes = changes[["method"] + [c for c in changes.columns if c != "method"]]
    result = FixResult(current if current is not original else _copy(original), frame, changes)
    result.meta = {"methods": methods, "kept": result.kept, "batches": count, "held_out": held,
                   "baseline_sqnr_db": proof.baseline.sqnr_db, "fixed_sqnr_db": before.sqnr_db,
                   "baseline_metric": proof.baseline.metric, "fixed_metric": before.metric,
                   "float_metric": proof.float_metric, "min_gain_db": MIN_GAIN_DB, "mode": mode,
                   "qconfig": qconfig.to_dict(), "forwards": forwards[0]}
    result.summary = _summary(result)
    return result


@dataclass
class _Measured:
    sqnr_db: float  # worst output SQNR of the calibrated candidate vs the original float outputs
    float_sqnr_db: float  # the candidate's float (prepared, points off) vs the original float
    metric: dict[str, float]


class _Proof:
    """Calibrate a float candidate with the run's QConfig and measure it on the held-out part
    against the original float model (one Experiment trial: every point quantized)."""

    def __init__(self, original, qconfig, mode, example, data, measured_on, metric, metric_name, advanced):
        self.original, self.qconfig, self.mode, self.example = original, qconfig, mode, example
        self.data, self.measured_on, self.metric, self.metric_name = data, measured_on, metric, metric_name
        self.advanced = advanced
        self.baseline: _Measured | None = None
        self.float_metric: dict[str, float] = {}

    def measure(self, candidate: nn.Module) -> _Measured:
        from qdebug.engine import calibrate, prepare
        from qdebug.tools.experiment import Experiment, Trial

        prepared = prepare(candidate, self.qconfig, mode=self.mode, example_inputs=self.example)
        calibrate(prepared, self.data, progress=lambda *_: self.advanced())
        experiment = Experiment(prepared, self.measured_on, reference=self.original, metric=self.metric,
                                metric_name=self.metric_name, progress=lambda *_: self.advanced())
        (result,) = experiment.run([Trial(frozenset(experiment.quantizable))])
        floor = min((o["sqnr_db"] for o in experiment.floor.values()), default=math.inf)
        measured = _Measured(result.worst_sqnr_db, floor, dict(result.metric))
        if self.baseline is None:
            self.baseline = measured
            self.float_metric = dict(experiment.float_metric or {})
        return measured


def _verdict(method: str, before: _Measured, after: _Measured) -> tuple[bool, str]:
    """(kept, why): the metric decides where there is one, the SQNR breaks ties (module docstring)."""
    gain = after.sqnr_db - before.sqnr_db
    if math.isnan(after.sqnr_db):
        return False, "the quantized output is not finite"
    if method not in CHANGES_FUNCTION and after.float_sqnr_db < FLOAT_PRESERVED_DB:
        return False, (f"the float output moved to {after.float_sqnr_db:.1f} dB from the original's on the held-out "
                       f"data (< {FLOAT_PRESERVED_DB:g}): the inputs go beyond what was measured ({gain:+.2f} dB)")
    if before.metric:
        worse = [t for t in before.metric if after.metric.get(t, -math.inf) < before.metric[t]]
        better = [t for t in before.metric if after.metric.get(t, -math.inf) > before.metric[t]]
        if worse:
            return False, f"{', '.join(worse)} lower ({gain:+.2f} dB)"
        if better:
            return True, f"{', '.join(better)} higher ({gain:+.2f} dB)"
    if gain >= MIN_GAIN_DB:
        return True, f"{gain:+.2f} dB" + (" (metric equal)" if before.metric else "")
    return False, f"{gain:+.2f} dB: less than {MIN_GAIN_DB:g} dB" + (" (metric equal)" if before.metric else "")


def _nothing_changed(report: Any) -> str:
    """Why a transform changed nothing: its most frequent reason (its report has one per row)."""
    reasons = [r for r in report.get("reason", []) if isinstance(r, str) and r]
    if not reasons:
        return "nothing to change"
    common = max(reasons, key=reasons.count)  # the first of the most frequent, in the report's order
    others = len(reasons) - reasons.count(common)
    return f"nothing to change: {common}" + (f" (+{others} other reason(s))" if others else "")


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def _summary(result: FixResult) -> str:
    meta = result.meta
    where = (f"on the {meta['held_out']} held-out batch(es)" if meta["held_out"]
             else f"on the {meta['batches']} calibration batch(es) (4 or more hold a quarter out)")
    lines = [f"output SQNR vs float, calibrated with the same qconfig, {where}: "
             f"{meta['baseline_sqnr_db']:.2f} dB as given -> {meta['fixed_sqnr_db']:.2f} dB fixed"]
    for task, value in meta["baseline_metric"].items():
        lines.append(f"{task}: {value:.4g} as given -> {meta['fixed_metric'].get(task, math.nan):.4g} fixed"
                     + (f" (float {meta['float_metric'][task]:.4g})" if task in meta["float_metric"] else ""))
    kept = meta["kept"]
    lines.append(f"kept: {', '.join(WHAT[m] for m in kept)}" if kept else "no method helped: the model is unchanged")
    corrected = [r for r in result.frame.to_dict("records") if r["kept"] and r["method"] == "bias_correction"]
    if corrected:
        lines.append(f"bias correction changes the float function on purpose: the fixed float model's output is "
                     f"{corrected[0]['float_sqnr_db']:.1f} dB from the original's")
    return "\n".join(lines)
