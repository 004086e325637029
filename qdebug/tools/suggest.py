"""``suggest``: the smallest set of int16 changes proven to bring the model back over its target.

Candidates.  Every quantized point below ``bits`` (16), as a qconfig override can
name it, so that the plan can be written as one and reproduced by ``calibrate``: a
layer's weight (override ``<layer>`` ``weight``), and an activation point (override
``<name>`` ``activation``; an override on a module that is called several times
raises every call, so the candidate ``relu`` holds ``relu`` and ``relu#2``, while
``relu#2`` alone is a candidate of its own).  A grouped weight (``group_size``) also gets
candidates that keep its width and shrink its groups to a half and a quarter
(``<layer>.weight@g64``; ``smaller_groups``), at any ``bits``.  An activation point diagnosed
``clipping`` by ``compare`` is a range problem, not a resolution one: it is not a
candidate; instead the ranges a ``percentile`` and an ``mse`` observer pick for it on
the data (observed as calibration observes) are measured, and the better one named.

Ranking (``rank="exact"``): every candidate alone at ``bits``, the rest as loaded, in
one pass of the experiment primitive (each trial resumes from the "everything
quantized" run at its point); the gain is the output SQNR gained over everything
quantized (and each task's metric gain).  Candidates are ordered by metric gain --
gains within one sample's worth are tied -- then by SQNR gain.  Early rejection (SQNR
target): from the second searched batch on, a candidate whose share of each batch's
output error removed, 1 - E_c / E_all per batch (E: error over signal energy, the
candidate alone and everything quantized, paired on the batch), has a mean below 0 at
99.5% one-sided confidence (Student's t over the batches so far) on every output is
measured on no further batch: it makes the output worse, so it ranks below every
candidate that helps, where the plan search reaches only when nothing shorter passes.
The rejected rank last, by the gain over the batches they ran.  ``rank="fast"``:
every candidate scored at once by its gradient-weighted quantization noise, one
forward+backward per batch (``qdebug.tools.noise_score``); the plan search verifies
the result all the same.

Plan.  The target: every task's metric >= its rule (baseline's, ratio 0.99 by
default) with a metric, else output SQNR >= ``min_sqnr``.  A binary search finds the
shortest prefix of the ranking that meets it (ceil(log2(L + 1)) evaluations, the
whole ranking among them when no shorter prefix passes: then the target is out of
reach); each member is then dropped in turn, last first, and stays out when the target
still holds (< k evaluations for a prefix of k), so no member of the plan can be
removed.  Evaluations after ranking <= ceil(log2 L) + 1 + k, with k >= |plan|.  With a per-sample metric the
plan's evaluation keeps every sample's score, and baseline's bootstrap interval comes
from them, with no further run.  Unreachable: the best value is reported, and
the same search on keeping candidates in float says which layers would reach it.

Held out.  From 4 batches on, the last quarter of them (``holdout_size``) is held out:
the diagnosis, the ranking and the plan search read only the first part, and the plan
is then confirmed on the held-out part -- its margin over the target there, with a
bootstrap interval over the held-out samples (the SQNR's from each sample's signal and
error energy, ``output_energies``; a metric's from its per-sample scores, baseline's
interval).  A plan that misses the target there is grown along the ranking (the same
search, on the held-out batches) until it holds; a margin whose interval reaches across
the target is inside the noise, and said so.  Fewer than 4 batches: nothing is held out,
and the interval is over the searched samples.

Cost.  Every forward pass (one batch through the model or its float reference, any copy
of them included) is counted per phase -- diagnosis, ranking, search, confirm -- by a
hook on the two top-level modules (``ForwardCount``).
"""

from __future__ import annotations

import copy
import inspect
import math
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import pandas as pd
import torch
import torch.nn as nn

from qdebug.config import distributed
from qdebug.data.source import BatchSource, Origin
from qdebug.data.spec import as_source
from qdebug.engine import engine_state
from qdebug.engine.context import run_model
from qdebug.errors import QDebugError
from qdebug.data.metrics import Metric
from qdebug.safe_text import escaped
from qdebug.tools.baseline import TaskRule, bootstrap_interval
from qdebug.measure.stats import sqnr_db
from qdebug.tools.experiment import Experiment, Trial, TrialResult, named_outputs, nan_low, worst

DEFAULT_MIN_SQNR = 30.0
RANKS = ("exact", "fast")
COLUMNS = ["rank", "point", "layer", "kind", "bits", "diagnosis", "gain_db", "macs_share", "act_share", "in_plan",
           "recalibrate"]


@dataclass(frozen=True)
class Candidate:
    """One change a qconfig override can express: ``glob`` at ``bits`` for ``kind``, or, with
    ``group_size``, a grouped weight's groups shrunk to it (its width kept)."""

    glob: str
    kind: str  # "weight" | "activation"
    points: tuple[str, ...]
    layer: str
    bits: int
    group_size: int | None = None

    @property
    def key(self) -> str:
        """Tells candidates apart: a point's wider-bits and smaller-group candidates are two."""
        return f"{self.glob}/{self.kind}" + (f"/g{self.group_size}" if self.group_size else "")

    def spec_change(self, bits: int) -> dict[str, int]:
        return {"group_size": self.group_size} if self.group_size else {"bits": bits}


def plan_changes(chosen: Sequence[Candidate], bits: int) -> dict[str, dict[str, int]]:
    """Point -> spec changes (``raise_bits``'s tables) of the chosen candidates, merged per point:
    wider bits and smaller groups together, the smallest group when several are chosen."""
    out: dict[str, dict[str, int]] = {}
    for c in chosen:
        for p in c.points:
            change = out.setdefault(p, {})
            for key, value in c.spec_change(bits).items():
                change[key] = min(value, change[key]) if key == "group_size" and key in change else value
    return out


@dataclass
class Plan:
    candidates: list[Candidate] = field(default_factory=list)
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    passed: bool = False
    evaluations: int = 0
    keep_float: list[Candidate] = field(default_factory=list)  # unreachable at int16: these in float
    history: list[dict[str, Any]] = field(default_factory=list)  # each evaluation: size, values, passed
    final: TrialResult | None = None  # the evaluation of the plan itself (its per-sample scores)
    prefix: int = 0  # the shortest passing prefix of the ranking, before dropping members
    searched: list[Candidate] | None = None  # the search's own plan, when it was grown to hold on held-out data
    confirm: dict[str, Any] | None = None  # its margin on the confirmation data (``_confirmation``)

    def overrides(self, bits: int) -> dict[str, dict[str, dict[str, int]]]:
        """The qconfig overrides that apply the plan (``qdebug calibrate --qconfig``)."""
        out: dict[str, dict[str, Any]] = {}
        for c in self.candidates:
            entry = out.setdefault(c.glob, {}).setdefault(c.kind, {})
            for key, value in c.spec_change(bits).items():
                entry[key] = min(value, entry[key]) if key == "group_size" and key in entry else value
        for c in self.keep_float:
            out.setdefault(c.glob, {})[c.kind] = None
        return out


@dataclass
class SuggestResult:
    frame: pd.DataFrame  # one row per candidate, in rank order
    plan: Plan
    meta: dict[str, Any]
    summary: str


# -- the data split ------------------------------------------------------------------------
HOLDOUT_MIN_BATCHES = 4  # below this, a held-out part would leave too little to search on


def holdout_size(batches: int) -> int:
    """The batches held out of ``batches``: the last quarter (rounded down) from 4 on, none below."""
    return batches // 4 if batches >= HOLDOUT_MIN_BATCHES else 0


class _PartOrigin(Origin):
    """Batches ``start`` to ``stop`` of another source, read through it (lazily, pass after
    pass), with their indices in the whole data; a shard takes every ``world``-th of them."""

    def __init__(self, source: BatchSource, start: int, stop: int):
        self._source, self._start, self._stop = source, start, stop
        self.total = stop - start
        self.name = f"{source.name}, batches {start}-{stop - 1}"

    def items(self, rank: int, world: int) -> Iterator[tuple[int, Any]]:
        for index, batch in self._source.indexed():
            if index >= self._stop:
                break
            if index >= self._start and (index - self._start) % world == rank:
                yield index, batch


def part_of(source: BatchSource, start: int, stop: int) -> BatchSource:
    return BatchSource(_PartOrigin(source, start, stop))


def batch_count(source: BatchSource) -> int:
    """The number of batches, known from the source or by one pass over it (data only, no forward)."""
    if source.count is None:
        for _ in source:
            pass
    return int(source.count or 0)


# -- what it cost ----------------------------------------------------------------------------
PHASES = ("diagnosis", "ranking", "search", "confirm")


class ForwardCount:
    """Forward passes per phase: a pre-hook on each top-level module given (the model, its float
    reference) counts every call of it.  A plain function, so a deep copy of a module (compare's
    float copy of the model) keeps counting into the same table.  Under torchrun the ranks' counts
    are added (``totals``)."""

    def __init__(self, *modules: nn.Module | None):
        self.modules = [m for m in dict.fromkeys(modules) if m is not None]
        self.by_phase = dict.fromkeys(PHASES, 0)
        self.phase = PHASES[0]
        self._handles: list = []

    def __enter__(self) -> "ForwardCount":
        counts, now = self.by_phase, self

        def count(module, args):  # noqa: ARG001 - a forward pre-hook's signature
            counts[now.phase] += 1

        self._handles = [m.register_forward_pre_hook(count) for m in self.modules]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def totals(self) -> dict[str, int]:
        """Per phase, every rank's passes together (this process's alone outside torchrun)."""
        return distributed.current().combine(dict(self.by_phase),
                                             lambda a, b: {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}})


# -- the confirmation --------------------------------------------------------------------------
SIGNAL, ERROR = "signal:", "error:"


def output_energies(model, batches, reference) -> dict[str, torch.Tensor]:
    """Per sample and model output, the float output's energy sum x^2 (``signal:<output>``) and the
    error's sum (x - y)^2 (``error:<output>``): summed over any samples, they give the SQNR of those
    samples, so a bootstrap over samples gives the SQNR's interval.  A per-sample metric, for the
    experiment primitive to evaluate on the outputs it already has."""
    scores: dict[str, list[torch.Tensor]] = {}
    for batch in batches:
        inputs = getattr(batch, "inputs", batch)
        ref, out = named_outputs(run_model(reference, inputs)), named_outputs(run_model(model, inputs))
        for name, x in ref.items():
            x64 = x.detach().double()
            rows = x64.reshape(x64.shape[0], -1) if x64.dim() else x64.reshape(1, 1)
            error = rows - out[name].detach().double().reshape(rows.shape)
            scores.setdefault(SIGNAL + name, []).append((rows * rows).sum(1))
            scores.setdefault(ERROR + name, []).append((error * error).sum(1))
    return {key: torch.cat(parts) for key, parts in scores.items()}


output_energies.per_sample = True


def _sqnr_interval(samples: Mapping[str, torch.Tensor], output: str,
                   confidence: float | None) -> tuple[float, float] | None:
    """The bootstrap interval of one output's SQNR over samples: baseline's paired interval of
    sum(signal) / sum(error) (the same resamples for both), in dB."""
    signal, error = samples.get(SIGNAL + output), samples.get(ERROR + output)
    if confidence is None or signal is None or error is None or signal.numel() != error.numel():
        return None
    low, high = bootstrap_interval(error, signal, TaskRule("higher"), confidence=confidence)
    return tuple(10 * math.log10(v) if v > 0 else (-math.inf if v == 0 else math.nan) for v in (low, high))


def _measure(name: str, value: float, target: float, interval: tuple[float, float] | None) -> dict[str, Any]:
    """One measure's margin over its target and that margin's interval; ``within_noise``: the
    interval reaches across the target (None: no interval)."""
    low, high = interval if interval is not None else (None, None)
    noisy = None
    if low is not None and not (math.isnan(low) or math.isnan(high)):
        noisy = low < target if value >= target else high >= target
    return {"measure": name, "value": value, "target": target, "margin": value - target,
            "ci_low": low, "ci_high": high,
            "margin_low": None if low is None else low - target, "margin_high": None if high is None else high - target,
            "within_noise": noisy}


def _confirmation(result: TrialResult, experiment: Experiment, rules: Mapping[str, TaskRule] | None,
                  min_sqnr: float, confidence: float | None, holds: bool, held_out: bool) -> dict[str, Any]:
    """The plan's margin on the confirmation data: each measure of the target (the output SQNR, or
    each task's score against float) with its bootstrap interval; the headline is the smallest margin."""
    if rules is not None:
        verdict = experiment.verdict(result.metric, rules)
        ci = _interval(experiment, result, rules, confidence) if confidence is not None else {}
        measures = [_measure(f"{task}_ratio", verdict[f"{task}_ratio"],
                             (rules.get(task) or rules.get("metric") or TaskRule()).ratio,
                             (ci[f"{task}_ci_low"], ci[f"{task}_ci_high"]) if f"{task}_ci_low" in ci else None)
                    for task in result.metric]
    else:
        worst_output = min(result.outputs, key=lambda o: nan_low(result.outputs[o]["sqnr_db"]), default=None)
        measures = [_measure("sqnr_db", _sqnr(result), min_sqnr,
                             _sqnr_interval(result.samples, worst_output, confidence) if worst_output else None)]
    headline = min(measures, key=lambda m: nan_low(m["margin"]))
    flags = [m["within_noise"] for m in measures if m["within_noise"] is not None]
    return {"data": "held-out" if held_out else "searched", "batches": experiment.batches.count,
            "samples": experiment.samples, **headline, "within_noise": any(flags) if flags else None,
            "confidence": confidence, "holds": holds, "evaluations": 1, "grown": [], "measures": measures}


def candidates(model: nn.Module, quantizable: Sequence[str], bits: int) -> list[Candidate]:
    """Every change below ``bits`` an override can name (see module docstring), in execution order."""
    state = engine_state(model)
    found: list[Candidate] = []
    for name in quantizable:
        point = state.points[name]
        if point.spec.bits >= bits:
            if point.kind == "weight":
                found += [Candidate(_weight_glob(point), "weight", (name,), point.owner, point.spec.bits, group)
                          for group in smaller_groups(point.spec.group_size)]
            continue
        if point.kind == "weight":
            found.append(Candidate(_weight_glob(point), "weight", (name,), point.owner, point.spec.bits))
            found += [Candidate(_weight_glob(point), "weight", (name,), point.owner, point.spec.bits, group)
                      for group in smaller_groups(point.spec.group_size)]
            continue
        call, path = _call_and_member(state.plan, name)
        # The glob ``name`` also names the later calls' points (``relu#2``; ``lstm#2:1.1`` for ``lstm:1.1``).
        calls = (name,) if "#" in call else (name, *(
            n for n in quantizable if n != name and state.points[n].kind == "activation"
            and state.points[n].spec.bits < bits and _later_call_of(_call_and_member(state.plan, n), call, path)))
        found.append(Candidate(name, "activation", calls, point.owner or name, point.spec.bits))
    return found


def _weight_glob(point: Any) -> str:
    """The override glob of exactly this weight point: its layer (``fc``, whose one weight is
    ``fc.weight``), or the point's own name where the layer has several (a recurrent layer's
    ``lstm.weight_ih_l0``): a plan must change what was verified, nothing more."""
    return point.owner if point.name == f"{point.owner}.weight" else point.name


def _call_and_member(plan, name: str) -> tuple[str, str]:
    """(call, member path) of an activation point: ("lstm", "1.1") for ``lstm:1.1``, (name, "")."""
    call = plan.call_of_point(name)
    return call, name[len(call) + 1:] if call != name else ""


def _later_call_of(point: tuple[str, str], call: str, path: str) -> bool:
    """Whether ``point`` (call, member) is the same output of a later call of ``call`` (``#k``)."""
    return point[0].startswith(call + "#") and point[1] == path


SMALLEST_GROUP = 8  # below this, groups cost more in scales than they win (and kernels stop at 32 or 16)


def smaller_groups(group_size: int | None) -> list[int]:
    """The group sizes a grouped weight's candidates shrink to: half and a quarter (g128 -> g64,
    g32), even divisors of the current size, so they cut its rows evenly too; none below 8."""
    out, group = [], group_size
    for _ in range(2):
        if group is None or group % 2 or group // 2 < SMALLEST_GROUP:
            break
        group //= 2
        out.append(group)
    return out


def diagnoses_of(reference, model, batches, advance=None) -> dict[str, str]:
    """compare's diagnosis per call of ``model`` against the float model (its own float run when
    no float checkpoint was given): ``clipping`` rows are not int16 candidates."""
    from qdebug.engine import set_mode
    from qdebug.tools.compare import compare, folded_bn_rows

    if reference is None:
        reference = copy.deepcopy(model)
        set_mode(reference, "float")
    result = compare([("float", reference), ("quantized", model)], batches, progress=advance)
    frame = result.frame
    # A pair torch folded (an import) is measured in its BN's row: its point is the conv's.
    point_of = folded_bn_rows(model)
    return {point_of.get(row.layer, row.layer): row.diagnosis for row in frame.itertuples() if row.diagnosis}


def _norm_inputs_diagnosed(model: nn.Module, diagnoses: dict[str, str]) -> dict[str, str]:
    """``diagnoses`` with each norm's ``norm_input_outliers`` also on the point feeding it (its
    ``@norm_input``, ``qdebug.engine.norm_input``): that point's int16 candidate is the fix, so
    its row says so (a clipped or non-finite point keeps its own diagnosis)."""
    from qdebug.engine.norm_input import ALIAS, norm_input_aliases

    out = dict(diagnoses)
    for point, aliases in norm_input_aliases(engine_state(model).plan).items():
        norms = [alias[len(ALIAS) + 1:] for alias in aliases if alias != ALIAS]
        if any(diagnoses.get(n) == "norm_input_outliers" for n in norms) \
                and out.get(point) not in ("clipping", "nonfinite"):
            out[point] = "norm_input_outliers"
    return out


def suggest(model: nn.Module, batches: Sequence[Any], *, reference: nn.Module | None = None,
            metric: Metric | None = None, metric_name: str = "metric", rules: Mapping[str, TaskRule] | None = None,
            min_sqnr: float = DEFAULT_MIN_SQNR, bits: int = 16,
            diagnoses: Mapping[str, str] | Callable[..., Mapping[str, str]] | None = None,
            confidence: float | None = 0.95, rank: str = "exact",
            progress: Callable[[int, int], None] | None = None) -> SuggestResult:
    """Rank int16 candidates and find the minimal verified plan (see module docstring).

    ``diagnoses``: compare's diagnosis per call name (``clipping`` rows are not candidates), or a
    function giving them, called only when a ranking is needed -- with the batches to diagnose
    (the searched ones) when it takes an argument.
    """
    if not 2 <= bits <= 16:
        raise QDebugError(f"bits must be in [2, 16], got {bits}", "e.g. --bits 16")
    if rank not in RANKS:
        raise QDebugError(f"unknown rank {rank!r}", f"choose one of {', '.join(RANKS)}")
    if rank == "fast" and engine_state(model).stage == "quantized":
        raise QDebugError("--rank fast needs gradients, and integer kernels have none",
                          "rank a calibrated or QAT checkpoint, or use --rank exact")
    if not math.isfinite(min_sqnr):
        raise QDebugError(f"min_sqnr must be a number of dB, got {min_sqnr}", "e.g. --min-sqnr 30")
    source = as_source(batches)
    total = batch_count(source)
    held = holdout_size(total)
    searched = part_of(source, 0, total - held) if held else source
    forwards = ForwardCount(model, reference)
    with forwards:
        experiment = Experiment(model, searched, reference=reference, metric=metric, metric_name=metric_name,
                                progress=progress)
        # The confirmation's data: the held-out batches, else the searched ones again; its metric
        # gives per-sample scores for the interval (the SQNR's: each sample's energies).
        confirming = experiment if metric is not None and not held else Experiment(
            model, part_of(source, total - held, total) if held else source, reference=reference,
            metric=metric or output_energies, metric_name=metric_name if metric is not None else "energy",
            progress=progress)
        rules = dict(rules or {})
        scored = rules if metric is not None else None
        everything = frozenset(experiment.quantizable)
        whole = Trial(everything, {"label": "as loaded"})
        found = candidates(model, experiment.quantizable, bits)

        def meets(result: TrialResult, on: Experiment = experiment) -> bool:
            if metric is not None:
                return on.verdict(result.metric, rules)["verdict"] == "pass"
            return _sqnr(result) >= min_sqnr

        def raised(chosen: Sequence[Candidate]) -> Trial:
            return Trial(everything, {"label": "plan"}, plan_changes(chosen, bits))

        def confirmed(chosen: Sequence[Candidate]) -> TrialResult:
            forwards.phase = "confirm"
            return confirming.run([raised(chosen) if chosen else whole], keep_samples=True)[0]

        # A model that already meets the target -- on the held-out batches too -- needs no
        # diagnosis and no ranking: one run (two with a held-out part) says so.
        forwards.phase = "ranking"
        base = experiment.run([whole])[0]
        done = meets(base)
        loaded_confirmed = confirmed([]) if done else None
        if done and held:
            done = meets(loaded_confirmed, confirming)
        forwards.phase = "diagnosis"
        diagnoses = _norm_inputs_diagnosed(model, dict(_diagnosed(diagnoses, searched))) if not done else {}
        forwards.phase = "ranking"
        clipping = [c for c in found if c.kind == "activation" and any(diagnoses.get(p) == "clipping" for p in c.points)]
        ranked_pool = [c for c in found if c not in clipping]
        # Clipping points: the range another observer picks, observed on the data as calibration does.
        recalibrations = _recalibrations(model, clipping, experiment) if clipping else []
        # Ranking: (exact) each candidate alone at ``bits``, then the recalibrations; the fast rank
        # scores every candidate in one forward+backward per batch.
        singles_trials = [raised([c]) for c in ranked_pool] if rank == "exact" and not done else []
        extra = [*singles_trials, *(t for _, _, t in recalibrations)]
        # "Everything quantized" leads again: its run is the anchor every single-point trial resumes from.
        reject = _EarlyRejection(range(1, len(singles_trials) + 1)) if metric is None else None
        ran = experiment.run([whole, *extra], stop=reject) if extra else []
        measured = ran[1:]
        fixes = measured[len(singles_trials):]
        singles = measured[:len(singles_trials)]
        rejected = {c.key for c, r in zip(ranked_pool, singles) if r.batches < ran[0].batches}
        ranking = [base, *singles]
        base_sqnr = _sqnr(base)
        gains = []
        if rank == "exact":
            for k, (c, result) in enumerate(zip(ranked_pool, singles), start=1):
                task_gain = {t: result.metric[t] - base.metric[t] for t in result.metric}
                # Rejected early: its gain over the anchor on the batches it ran on.
                anchor_sqnr = base_sqnr if reject is None or k not in reject.anchor_at else worst(
                    sqnr_db(signal, error) for signal, error, *_ in reject.anchor_at[k].values())
                gains.append((c, _sqnr(result) - anchor_sqnr, task_gain, math.nan))
            samples = experiment.samples  # counted by the first run
            tolerance = 1.0 / samples if metric is not None and samples else 0.0
            gains.sort(key=lambda g: (g[0].key in rejected, -_bucket(min(g[2].values(), default=0.0), tolerance),
                                      -nan_low(g[1])))
        elif not done:
            from qdebug.tools.noise_score import noise_scores

            scores = noise_scores(model, experiment.batches, [p for c in ranked_pool for p in c.points], reference)
            gains = [(c, math.nan, {}, sum(scores[p] for p in c.points)) for c in ranked_pool]
            gains.sort(key=lambda g: -g[3])
        order = [g[0] for g in gains]

        forwards.phase = "search"
        plan = Plan(before=_values(base, experiment, scored))
        if done:
            plan.passed, plan.after = True, plan.before
        elif order:
            plan = _search(order, lambda chosen: experiment.run([raised(chosen)], keep_samples=True)[0], meets, plan,
                           experiment, scored)
            if not plan.passed:
                def floated(chosen: Sequence[Candidate]) -> Trial:
                    return Trial(everything - {p for c in chosen for p in c.points}, {"label": "float"},
                                 plan_changes([c for c in order if c not in chosen], bits))

                fallback = _search(order, lambda chosen: experiment.run([floated(chosen)])[0], meets,
                                   Plan(before=plan.before), experiment, scored)
                plan.evaluations += fallback.evaluations
                if fallback.passed:
                    plan.keep_float = fallback.candidates
        if plan.passed:
            chosen = plan.candidates
            result = loaded_confirmed if done else confirmed(chosen)
            plan.confirm = _confirmation(result, confirming, scored, min_sqnr, confidence, meets(result, confirming),
                                         bool(held))
            if held and not plan.confirm["holds"] and chosen:
                _grow(plan, order, experiment, confirming, scored, min_sqnr, confidence, meets, raised, confirmed)
    recalibrated = {}
    for (c, observer, _), result in zip(recalibrations, fixes):
        gain = _sqnr(result) - base_sqnr
        best = recalibrated.get(c.glob)
        if best is None or gain > best["gain_db"]:
            recalibrated[c.glob] = {"observer": observer, "gain_db": gain,
                                    **{f"{t}_gain": result.metric[t] - base.metric[t] for t in result.metric}}
    if plan.passed and plan.candidates and plan.final is not None and confidence is not None:
        plan.after.update(_interval(experiment, plan.final, rules, confidence))
    ranked_on = {c.key: r.batches for c, r in zip(ranked_pool, singles)}
    frame = _frame(gains, clipping, plan, experiment, diagnoses, metric is not None, recalibrated, ranked_on)
    plan_meta = _plan_meta(plan, bits)
    # The plan's points whose wide channels stretch their range: a float-side fix may keep them int8.
    plan_meta["outlier_points"] = [row.point for row in frame.itertuples()
                                   if row.in_plan and row.diagnosis == "outlier_channels"]
    by_phase = forwards.totals()
    meta = {
        "bits": bits, "target": "metric" if metric is not None else f"sqnr_db >= {min_sqnr:g}",
        "min_sqnr": None if metric is not None else min_sqnr, "candidates": len(ranked_pool),
        "clipping": [c.glob for c in clipping], "recalibrate": recalibrated,
        "batches": total, "search_batches": total - held, "holdout_batches": held, "samples": experiment.samples,
        "float_metric": experiment.float_metric, "tasks": list(experiment.float_metric or {}),
        # Settings measured over the searched batches in the ranking: the model as loaded, each
        # candidate alone, each recalibrated range (the fast rank's noise-score pass: one).
        "rank": rank, "ranking_evaluations": 1 + len(extra) + (rank == "fast" and not done),
        "rejected_early": len(rejected) if rank == "exact" and not done else 0,
        "forwards": sum(by_phase.values()), "forwards_by_phase": by_phase,
        "confidence": confidence, "served_calls": sum(r.served_calls for r in ranking),
        "plan": plan_meta,
    }
    return SuggestResult(frame, plan, meta, summarize(meta))


def _diagnosed(diagnoses: Mapping[str, str] | Callable[..., Mapping[str, str]] | None,
               batches: BatchSource) -> Mapping[str, str]:
    """The diagnoses as given, or the function's on ``batches`` (a function of no argument: its own)."""
    if not callable(diagnoses):
        return diagnoses or {}
    try:
        takes_batches = bool(inspect.signature(diagnoses).parameters)
    except (TypeError, ValueError):
        takes_batches = False
    return diagnoses(batches) if takes_batches else diagnoses()


def _grow(plan: Plan, order: list[Candidate], experiment: Experiment, confirming: Experiment,
          rules: Mapping[str, TaskRule] | None, min_sqnr: float, confidence: float | None,
          meets: Callable[..., bool], raised: Callable[[Sequence[Candidate]], Trial],
          confirmed: Callable[[Sequence[Candidate]], TrialResult]) -> None:
    """A plan that misses the target on the held-out batches, grown along the ranking until it
    holds there (the plan search again, over the candidates it left out, on the held-out
    batches), and kept when the grown plan still meets the target on the searched ones too.
    Held-out data that chose the plan no longer confirms it independently: ``grown`` says so."""
    rest = [c for c in order if c not in plan.candidates]
    if not rest:
        return
    growth = _search(rest, lambda more: confirmed([*plan.candidates, *more]), lambda r: meets(r, confirming),
                     Plan(), confirming, rules)
    plan.confirm["evaluations"] += growth.evaluations
    if not growth.passed:
        return
    chosen = [*plan.candidates, *growth.candidates]
    on_searched = experiment.run([raised(chosen)], keep_samples=True)[0]
    plan.evaluations += 1
    if not meets(on_searched):
        return
    missed = plan.confirm
    plan.searched, plan.candidates, plan.final = plan.candidates, chosen, on_searched
    plan.after = _values(on_searched, experiment, rules)
    plan.confirm = _confirmation(growth.final, confirming, rules, min_sqnr, confidence, True, True)
    plan.confirm.update(grown=[_point_name(c) for c in growth.candidates], evaluations=missed["evaluations"],
                        search_plan_margin=missed["margin"])


RECALIBRATION_OBSERVERS = ("percentile", "mse")


def _recalibrations(model: nn.Module, clipping: list[Candidate], experiment: Experiment) -> list[tuple]:
    """(candidate, observer, trial) for each clipping point and each observer that clips
    less: the range that observer picks on the data, everything else as loaded."""
    from qdebug.engine.respec import observed_qparams

    points = experiment.state.points
    names = [p for c in clipping for p in c.points]
    everything = frozenset(experiment.quantizable)
    out = []
    for observer in RECALIBRATION_OBSERVERS:
        qparams = observed_qparams(model, names, {"observer": observer}, experiment.batches, points)
        for c in clipping:
            out.append((c, observer, Trial(everything, {"label": observer}, qparams={p: qparams[p] for p in c.points})))
    return out


def _interval(experiment: Experiment, result: TrialResult, rules: Mapping[str, TaskRule],
              confidence: float) -> dict[str, float]:
    """baseline's paired bootstrap interval of each task's score (``<task>_ci_low``, ``_high``)
    from the per-sample scores of the float model and of the plan's evaluation: no extra run."""
    out = {}
    for task, q in result.samples.items():
        f = experiment.float_samples.get(task)
        if f is None or f.numel() != q.numel():
            continue
        rule = rules.get(task) or rules.get("metric") or TaskRule()
        out[f"{task}_ci_low"], out[f"{task}_ci_high"] = bootstrap_interval(f, q, rule, confidence=confidence)
    return out


class _EarlyRejection:
    """The ranking's ``stop`` (module docstring, Ranking): the single-candidate trials ``singles``
    whose share of each batch's output error removed is, at 99.5% one-sided confidence, below 0
    on every output.  ``anchor_at[k]``: the anchor's sums over the batches trial k ran on, for its
    gain over those same batches."""

    def __init__(self, singles: range):
        self.singles = singles
        self.anchor_at: dict[int, dict[str, list[float]]] = {}
        self._previous: dict[int, dict[str, list[float]]] = {}
        self._removed: dict[tuple[int, str], list[float]] = {}  # (trial, output) -> the share removed, per batch

    def _batch_error(self, sums: dict, k: int, name: str) -> float:
        """Trial k's error energy over signal energy on the last batch alone (NaN: no signal)."""
        before = self._previous.get(k, {}).get(name, [0.0, 0.0])
        signal, error = sums[k][name][0] - before[0], sums[k][name][1] - before[1]
        return error / signal if signal > 0 else math.nan

    def __call__(self, position: int, sums: dict[int, dict[str, list[float]]]) -> set[int]:
        rejected = set()
        for k in (k for k in self.singles if k in sums):
            confident = []
            for name in sums[0]:
                anchor, alone = self._batch_error(sums, 0, name), self._batch_error(sums, k, name)
                shares = self._removed.setdefault((k, name), [])
                shares.append(1.0 - alone / anchor if anchor > 0 else math.nan)
                confident.append(_surely_below_zero(shares))
            if confident and all(confident):
                rejected.add(k)
                self.anchor_at[k] = sums[0]
        self._previous = sums
        return rejected


# One-sided 99.5% quantiles of Student's t by degrees of freedom (1..30; beyond, the one for 30).
T_995 = (63.657, 9.925, 5.841, 4.604, 4.032, 3.707, 3.499, 3.355, 3.250, 3.169, 3.106, 3.055, 3.012, 2.977, 2.947,
         2.921, 2.898, 2.878, 2.861, 2.845, 2.831, 2.819, 2.807, 2.797, 2.787, 2.779, 2.771, 2.763, 2.756, 2.750)


def _surely_below_zero(values: Sequence[float]) -> bool:
    """Whether the mean of ``values`` (per-batch measurements) is below 0 at 99.5% one-sided
    confidence: mean + t * sd / sqrt(n) < 0, from 2 values on; never with a NaN among them."""
    n = len(values)
    if n < 2 or any(math.isnan(v) or math.isinf(v) for v in values):
        return False
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean + T_995[min(n - 1, len(T_995)) - 1] * sd / math.sqrt(n) < 0


def _search(order: list[Candidate], evaluate: Callable[[Sequence[Candidate]], TrialResult],
            meets: Callable[[TrialResult], bool], plan: Plan, experiment: Experiment,
            rules: Mapping[str, TaskRule] | None) -> Plan:
    """Shortest passing prefix of ``order`` by binary search, then drop members last first."""
    results: dict[tuple, TrialResult] = {}

    def check(chosen: Sequence[Candidate]) -> bool:
        key = tuple(c.key for c in chosen)
        if key not in results:
            results[key] = evaluate(chosen)
            plan.evaluations += 1
            plan.history.append({"size": len(chosen), **_values(results[key], experiment, rules),
                                 "passed": meets(results[key])})
        return meets(results[key])

    # The shortest passing prefix, in [1, L + 1) (L + 1: none): ceil(log2(L + 1)) evaluations,
    # the whole ranking among them when nothing shorter passes.
    lo, hi = 1, len(order) + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if check(order[:mid]):
            hi = mid
        else:
            lo = mid + 1
    if lo > len(order):
        best = results[tuple(c.key for c in order)]
        plan.after, plan.candidates, plan.passed = _values(best, experiment, rules), list(order), False
        return plan
    chosen = list(order[:lo])
    plan.prefix = lo
    for c in reversed(list(chosen)):
        trial = [x for x in chosen if x is not c]
        if trial and check(trial):
            chosen = trial
    final = results[tuple(c.key for c in chosen)]
    plan.candidates, plan.after, plan.passed, plan.final = chosen, _values(final, experiment, rules), True, final
    return plan


def _sqnr(result: TrialResult) -> float:
    """The lowest output SQNR, NaN as -inf: a value to compare with a target."""
    return nan_low(result.worst_sqnr_db)


def _bucket(gain: float, tolerance: float) -> float:
    """Metric gains within one sample's worth count as equal (a flipped sample is noise)."""
    return round(gain / tolerance) if tolerance else gain


def _values(result: TrialResult, experiment: Experiment, rules: Mapping[str, TaskRule] | None) -> dict[str, float]:
    """Output SQNR and, with a metric (``rules`` not None), each task's value, its score
    against float (baseline's ``<task>_ratio``) and the verdict."""
    values: dict[str, Any] = {"sqnr_db": _sqnr(result)}
    if rules is not None:
        values.update(experiment.verdict(result.metric, rules))
    return values


def _frame(gains, clipping, plan: Plan, experiment: Experiment, diagnoses: Mapping[str, str],
           with_metric: bool, recalibrated: Mapping[str, dict], ranked_on: Mapping[str, int]) -> pd.DataFrame:
    chosen = {c.key for c in plan.candidates} if plan.passed else set()
    rows = []
    for position, (c, gain_db, task_gain, score) in enumerate(gains, start=1):
        macs, _ = experiment.shares(c.points) if c.kind == "weight" else (0.0, 0.0)
        row = {"rank": position, "point": _point_name(c), "layer": c.layer, "kind": c.kind, "bits": c.bits,
               "diagnosis": next((diagnoses[p] for p in c.points if diagnoses.get(p)), ""), "gain_db": gain_db}
        if not math.isnan(score):
            row["noise_score"] = score
        for task, value in task_gain.items():
            row[f"{task}_gain"] = value
        row.update(macs_share=macs, act_share=experiment.activation_share(c.points) if c.kind == "activation" else 0.0,
                   in_plan=c.key in chosen)
        if c.key in ranked_on:  # the exact rank: the batches its gain is measured on
            row["ranked_batches"] = ranked_on[c.key]
        rows.append(row)
    for c in clipping:
        fix = recalibrated.get(c.glob, {})
        rows.append({"rank": None, "point": _point_name(c), "layer": c.layer, "kind": c.kind, "bits": c.bits,
                     "diagnosis": "clipping", "gain_db": fix.get("gain_db", math.nan),
                     **{k: v for k, v in fix.items() if k.endswith("_gain")}, "macs_share": 0.0,
                     "act_share": experiment.activation_share(c.points), "in_plan": False,
                     "recalibrate": fix.get("observer", "")})
    for row in rows:
        row.setdefault("recalibrate", "")
    frame = pd.DataFrame(rows)
    if frame.empty:
        frame = pd.DataFrame(columns=COLUMNS)
    return frame


def _point_name(c: Candidate) -> str:
    """A candidate as the table and the plan name it: its (first) quant point -- ``<layer>.weight``
    for a weight; an activation point's name is also its override's."""
    if c.group_size:
        return f"{_weight_label(c)}@g{c.group_size}"
    return c.glob if c.kind == "activation" else _weight_label(c)


def _plan_meta(plan: Plan, bits: int) -> dict[str, Any]:
    return {"points": [_point_name(c) for c in plan.candidates] if plan.passed else [],
            "before": plan.before, "after": plan.after, "passed": plan.passed, "evaluations": plan.evaluations,
            "prefix": plan.prefix,
            "search_points": [_point_name(c) for c in (plan.searched if plan.searched is not None else
                                                       plan.candidates)] if plan.passed else [],
            "confirm": plan.confirm,
            "keep_float": [_point_name(c) for c in plan.keep_float],
            "overrides": plan.overrides(bits) if plan.passed else {}, "history": plan.history}


def _fmt(values: Mapping[str, float], tasks: Sequence[str]) -> str:
    parts = [f"{values['sqnr_db']:.1f} dB"] if "sqnr_db" in values else []
    parts += [f"{t} {values[t]:.4g} ({values[t + '_ratio']:.3f} x float)" for t in tasks if t in values]
    verdict = f" ({values['verdict']})" if values.get("verdict") else ""
    return ", ".join(parts) + verdict


def summarize(meta: Mapping[str, Any]) -> str:
    plan = meta["plan"]
    tasks = meta.get("tasks") or []
    target = "every task >= its ratio x float" if tasks else meta["target"]
    lines = [f"as quantized: {_fmt(plan['before'], tasks)}; target: {target}"]
    if plan["passed"] and not plan["points"]:
        lines.append("already meets the target: no change needed")
    elif plan["passed"]:
        lines += textwrap.wrap(f"plan: {len(plan['points'])} point(s) at {meta['bits']} bits: "
                               f"{', '.join(plan['points'])}", width=80, subsequent_indent="  ",
                               break_on_hyphens=False)
        searched = " on the searched batches" if meta.get("holdout_batches") else ""
        lines += textwrap.wrap(f"  after: {_fmt(plan['after'], tasks)} -- verified{searched} in "
                               f"{plan['evaluations']} evaluation(s)", width=80, subsequent_indent="    ")
        for task in tasks:
            if f"{task}_ci_low" in plan["after"]:
                lines.append(f"  {task} / float, {meta.get('confidence', 0.95):g} interval: "
                             f"[{plan['after'][task + '_ci_low']:.3f}, {plan['after'][task + '_ci_high']:.3f}]")
        if plan.get("outlier_points"):  # the float-side fix that may spare these their int16 (docs/fix.md)
            lines += textwrap.wrap(f"  wide channels (outlier_channels) at {', '.join(plan['outlier_points'])}: "
                                   "cross-layer equalization of the float model (qdebug fix, docs/fix.md) may "
                                   "keep them int8", width=80, subsequent_indent="    ", break_on_hyphens=False)
    if plan.get("confirm"):
        lines += _confirm_lines(plan["confirm"], plan.get("search_points") or [], meta)
    if not plan["passed"]:
        lines.append(f"no plan at {meta['bits']} bits reaches the target: at best {_fmt(plan['after'], tasks)}")
        if not plan["keep_float"]:
            lines.append("  keeping candidates in float does not reach it either")
        else:
            lines += textwrap.wrap(f"  these kept in float (the other candidates at {meta['bits']} bits) reach it: "
                                   f"{', '.join(plan['keep_float'])}", width=80, subsequent_indent="    ",
                                   break_on_hyphens=False)
    if meta["clipping"]:
        lines.append(f"clipping, so no int16 candidate: {', '.join(meta['clipping'])}")
        for glob, fix in (meta.get("recalibrate") or {}).items():
            lines.append(f"  {glob}: the {fix['observer']} observer's range wins {fix['gain_db']:+.1f} dB "
                         f"(qdebug calibrate --observer {fix['observer']})")
    if meta.get("rejected_early"):
        lines += textwrap.wrap(f"ranking: {meta['rejected_early']} of {meta['candidates']} candidate(s) rejected "
                               "early, surely making the output worse (ranked last, on the batches in "
                               "ranked_batches)", width=80, subsequent_indent="  ")
    if "forwards" in meta:
        phases = ", ".join(f"{phase} {n}" for phase, n in meta["forwards_by_phase"].items() if n)
        lines += textwrap.wrap(f"cost: {meta['forwards']} forward pass(es) of a batch through the model or its "
                               f"float reference ({phases})", width=80, subsequent_indent="  ")
    return "\n".join(escaped(line) for line in lines)  # a name's newline stays inside its line


def _confirm_lines(confirm: Mapping[str, Any], search_points: Sequence[str], meta: Mapping[str, Any]) -> list[str]:
    """The plan's margin on the confirmation data, its interval, and the warnings."""
    def shown(value: float | None, signed: bool = False) -> str:
        sign = "+" if signed else ""
        return f"{value:{sign}.2f} dB" if confirm["measure"] == "sqnr_db" else f"{value:{sign}.4f}"

    def wrap(text: str) -> list[str]:
        return textwrap.wrap(text, width=80, initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False)
    lines = []
    if confirm["grown"]:
        lines += wrap(f"the search's plan ({len(search_points)} point(s)) misses the target on the held-out "
                      f"batches (margin {shown(confirm['search_plan_margin'], True)}): grown by "
                      f"{', '.join(confirm['grown'])} to hold there (held-out data that chose the plan no longer "
                      f"confirms it independently)")
    where = (f"held-out ({confirm['batches']} of {meta['batches']} batches, {confirm['samples']} samples)"
             if confirm["data"] == "held-out" else
             f"no batch held out (fewer than {HOLDOUT_MIN_BATCHES}), the searched samples again")
    what = "" if confirm["measure"] == "sqnr_db" else f"{confirm['measure']} "
    interval = (f", {confirm['confidence']:g} interval [{shown(confirm['margin_low'], True)}, "
                f"{shown(confirm['margin_high'], True)}]" if confirm["margin_low"] is not None
                else " (no interval: the metric gives no per-sample scores)")
    lines += wrap(f"{where}: {what}{shown(confirm['value'])}, margin {shown(confirm['margin'], True)}{interval}: "
                  f"{'holds' if confirm['holds'] else 'misses the target'}")
    if not confirm["holds"]:
        lines += wrap("warning: the plan meets the target only on the batches it was searched on; no plan grown "
                      "along the ranking holds on the held-out ones")
    elif confirm["within_noise"]:
        lines += wrap(f"warning: the margin is inside the noise: its {confirm['confidence']:g} interval reaches "
                      f"below the target (more data narrows it; a stricter target buys margin)")
    return lines


__all__ = ["suggest", "candidates", "diagnoses_of", "Candidate", "Plan", "SuggestResult", "summarize", "DEFAULT_MIN_SQNR"]


def _weight_label(c: Candidate) -> str:
    """A weight candidate's point: ``fc.weight``, or the glob that already names it (``lstm.weight_ih_l0``)."""
    return c.glob if c.glob == c.points[0] else f"{c.glob}.weight"
