"""The experiment primitive: quantize these points, run the batches, measure against float.

step, suggest and the tools after them ask one question many times: with *these*
quant points quantized (every other point in float), how far are the model's
outputs from the float model's, and does the task metric still hold?
``Experiment(...).run(trials)`` answers it for a list of trials in one pass over
the batches:

- **batches outside, trials inside.**  Per batch the float reference runs once
  (in the first run; its outputs -- model outputs only -- are kept for later runs);
  they and the recorded runs of one batch are all that is held.  The batches are a
  ``qdebug.data.source.BatchSource``: each run reads them anew, one at a time;
- **the float prefix is cached.**  Per batch the model first runs with every
  point in float (the *base* run) and every call's output is recorded
  (``qdebug.measure.tap.Capture``).  A trial's forward then takes the stored output of
  every call before its first quantized point instead of computing it
  (``qdebug.engine.served``): those calls compute the same function, with the
  same parameters, on the same inputs -- the isolated replay's reuse rule -- so
  the result is bit-identical to a full rerun (after the first run the base run is
  skipped when no trial can resume from it).  When a trial agrees with the
  previous trial on a longer prefix than with the base run (trial k of a
  cumulative sweep quantizes modules 1..k, trial k+1 adds module k+1), the
  previous trial's run is recorded and served instead;
- **statistics stream**: per trial and model output, float64 sums give
  ``sqnr_db`` = 10 log10(sum x^2 / sum (x - y)^2) and ``cosine``;
- **the metric**: one with a per-sample function (``top1``) is evaluated batch by
  batch, nothing stored; any other metric is evaluated once per trial at the end,
  on that trial's model outputs (outputs only, not feature maps), held until then;
- **trials may stop early** (``run(..., stop=)``): after each batch the caller sees
  every running trial's output sums so far and may name trials to measure no
  further; their results are over the batches they ran (``TrialResult.batches``).
  The first trial (the anchor later trials resume from) always runs to the end.

The reference is the float model when one is given, else the model itself with
every point in float (its base run).  A point counts as quantizable when it is in
``fake`` mode as loaded; the others stay as they are in every trial.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn as nn

from qdebug.config import distributed
from qdebug.engine import engine_state
from qdebug.engine.context import Call, Event, run_model, writes_its_inputs
from qdebug.engine.members import named_members
from qdebug.engine.modules import _QWeighted
from qdebug.engine.recurrent import RecurrentLayer
from qdebug.engine.respec import raise_bits, set_qparams
from qdebug.engine.ops import map_tensors, tensors_in
from qdebug.engine.served import ServedCalls, serving
from qdebug.data.spec import as_source
from qdebug.errors import QDebugError
from qdebug.data.metrics import Metric, call_metric, run_metric
from qdebug.measure.stats import cosine_of_sums, sqnr_db
from qdebug.measure.tap import Capture, tap
from qdebug.tools.baseline import TaskRule, check_metric_values, evaluate_rule
from qdebug.tools.metric_replay import MetricRun, ReplayModel, input_fingerprint, per_sample_function


@dataclass(frozen=True)
class Trial:
    """One setting to measure: ``quantized`` points in their quantized mode, the rest float;
    ``bits``: some of the quantized points at another width (``qdebug.engine.respec``).
    ``info``: columns carried into the result row unchanged (the selection, the mode...)."""

    quantized: frozenset[str]
    info: Mapping[str, Any] = field(default_factory=dict)
    bits: Mapping[str, int] = field(default_factory=dict)
    qparams: Mapping[str, tuple] = field(default_factory=dict)  # point -> (scale, zero point): another range

    def differs_at(self, other: "Trial") -> set[str]:
        """The points treated differently by the two trials (mode, width or range)."""
        changed = set(self.quantized ^ other.quantized)
        both = self.quantized & other.quantized
        for name in set(self.bits) | set(other.bits):
            if name in both and self.bits.get(name) != other.bits.get(name):
                changed.add(name)
        for name in set(self.qparams) | set(other.qparams):
            if name in both and self.qparams.get(name) is not other.qparams.get(name):
                changed.add(name)
        return changed


NOTHING = Trial(frozenset())  # the base run: every point in float


# -- what a run leaves behind -------------------------------------------------------
class _Recording:
    """One run's outputs by call name, and which of them a later call wrote in place
    (served as copies, so the stored value survives the next forward)."""

    def __init__(self) -> None:
        self.capture = Capture(keep_inputs=False)
        self.written: set[str] = set()
        self._producer: dict[int, tuple[weakref.ref, str]] = {}

    def __call__(self, event: Event) -> None:
        if writes_its_inputs(event):
            for t in tensors_in((event.args, event.kwargs)):
                entry = self._producer.get(id(t))
                if entry is not None and entry[0]() is t:
                    self.written.add(entry[1])
        self.capture(event)
        for t in tensors_in(event.out):
            self._producer[id(t)] = (weakref.ref(t), event.call.name)

    def passthrough(self, call: Call, out: Any) -> None:
        """A passthrough module call (max-pool): recorded, so it can be served too."""
        self(Event(call, (), {}, None, out, out))

    def clear(self) -> None:
        self.capture.clear()
        self._producer.clear()

    def order(self) -> list[str]:
        return list(self.capture.records)

    def served(self, before: int) -> ServedCalls:
        names = self.order()[:before]
        outputs = {name: self.capture.records[name].output for name in names}
        return ServedCalls(outputs, clone=self.written & set(names))


def _input_calls(index: Mapping[str, int]) -> int:
    """How many of the calls are model inputs: the first ones of a forward, never served."""
    return sum(1 for name in index if name.split("#")[0] == "input")


class _Costs:
    """Per sample (first batch): multiply-accumulates of each weighted layer, and the size of
    each call's output (the activation memory a quant point's width multiplies)."""

    def __init__(self) -> None:
        self.macs: dict[str, int] = {}
        self.sizes: dict[str, int] = {}

    def __call__(self, event: Event) -> None:
        module = event.call.module
        out = event.out
        if isinstance(module, RecurrentLayer):
            self.macs[event.call.owner] = self.macs.get(event.call.owner, 0) + _recurrent_macs(module, out)
        if not isinstance(out, torch.Tensor):  # a structured output: each member's own size
            for name, _, t in named_members(event.call.name, out):
                if t.dim() >= 1 and t.shape[0]:
                    self.sizes[name] = t.numel() // t.shape[0]
            return
        if not (out.dim() >= 1 and out.shape[0]):
            return
        per_sample = out.numel() // out.shape[0]
        self.sizes[event.call.name] = per_sample
        if isinstance(module, _QWeighted):
            self.macs[event.call.owner] = self.macs.get(event.call.owner, 0) + per_sample * module.weight[0].numel()


def _recurrent_macs(module: nn.Module, out: Any) -> int:
    """Multiply-accumulates per sample of a recurrent layer: every weight element (input,
    hidden and projection weights, every layer and direction) is used once per time step."""
    weights = sum(p.numel() for name, p in module.named_parameters(recurse=False) if name.startswith("weight"))
    if isinstance(module, (nn.LSTMCell, nn.GRUCell)):
        return weights
    output = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(output, torch.Tensor) or output.dim() < 2:  # a PackedSequence: no step count here
        return 0
    steps = output.shape[0] if output.dim() == 2 or not module.batch_first else output.shape[1]
    return int(steps) * weights


def named_outputs(out: Any) -> dict[str, torch.Tensor]:
    """A model output as named float tensors: ``output``; dict keys; ``output0``, ``output1``..."""
    if isinstance(out, torch.Tensor):
        return {"output": out}
    if isinstance(out, Mapping):
        found = {}
        for key, value in out.items():
            for sub, t in named_outputs(value).items():
                found[str(key) if sub == "output" else f"{key}.{sub}"] = t
        return found
    tensors = [t for t in tensors_in(out) if torch.is_floating_point(t)]
    return {f"output{i}": t for i, t in enumerate(tensors)}


class _OutputStats:
    """float64 sums of one trial's model outputs against the reference's."""

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}  # name -> [sxx, see, sxy, syy]

    def update(self, ref: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> None:
        if ref.keys() != out.keys():
            raise QDebugError(f"the model's outputs ({', '.join(out)}) differ from the float model's ({', '.join(ref)})",
                              "compare checkpoints of one model")
        for name, x in ref.items():
            y = out[name]
            if x.shape != y.shape:
                raise QDebugError(f"output {name!r} has shape {list(y.shape)}, the float model's {list(x.shape)}",
                                  "compare checkpoints of one model")
            x64, y64 = x.detach().double(), y.detach().double()
            e = x64 - y64
            sums = self.sums.setdefault(name, [0.0, 0.0, 0.0, 0.0])
            sums[0] += float((x64 * x64).sum())
            sums[1] += float((e * e).sum())
            sums[2] += float((x64 * y64).sum())
            sums[3] += float((y64 * y64).sum())

    @staticmethod
    def merge_sums(a: dict[str, list[float]], b: dict[str, list[float]]) -> dict[str, list[float]]:
        """Two ranks' sums (over other batches) as one."""
        return {name: [x + y for x, y in zip(a.get(name, [0.0] * 4), b.get(name, [0.0] * 4))] for name in {**a, **b}}

    def result(self) -> dict[str, dict[str, float]]:
        return {name: {"sqnr_db": sqnr_db(s[0], s[1]), "cosine": cosine_of_sums(s[2], s[0], s[3])}
                for name, s in self.sums.items()}


@dataclass
class TrialResult:
    trial: Trial
    outputs: dict[str, dict[str, float]]  # output name -> {"sqnr_db", "cosine"}
    metric: dict[str, float]  # task -> value (empty without a metric)
    points: int
    macs_share: float
    params_share: float
    served_calls: int = 0
    row: dict[str, Any] = field(default_factory=dict)  # what the calling tool derives from it
    samples: dict[str, torch.Tensor] = field(default_factory=dict)  # task -> per-sample scores (keep_samples)
    batches: int = 0  # the batches it was measured on (fewer than the run's when ``stop`` ended it early)

    @property
    def worst_sqnr_db(self) -> float:
        """The lowest output SQNR (NaN counts as lowest, and is kept); NaN without outputs."""
        return worst(o["sqnr_db"] for o in self.outputs.values())


def nan_low(value: float | None) -> float:
    """A sort key where a missing or NaN measure is the worst: -inf."""
    return -math.inf if value is None or math.isnan(value) else value


def worst(values: Iterable[float]) -> float:
    """The lowest of ``values`` with NaN counted lowest (and returned as it is); NaN when empty."""
    return min(values, default=math.nan, key=nan_low)


class Experiment:
    """Trials on one prepared ``model`` against the float outputs (see module docstring).

    ``reference``: the float model (None: the model with every point in float).
    ``metric``: ``metric(model, batches)`` as for baseline (None: outputs only).
    ``progress(done, total)``: called after each forward.
    """

    def __init__(self, model: nn.Module, batches: Sequence[Any], *, reference: nn.Module | None = None,
                 metric: Metric | None = None, metric_name: str = "metric",
                 progress: Callable[[int, int], None] | None = None):
        self.model = model
        self.batches = as_source(batches)  # lazy and re-iterable: each run is one pass over the data
        if self.batches.count == 0:
            raise QDebugError("the experiment got no batches", "pass --data with at least one batch")
        self.reference = reference
        self.metric = metric
        self.metric_name = metric_name
        self.progress = progress
        self.state = engine_state(model)
        # Points quantized as loaded: the ones trials switch.
        self.quantizable = [name for name, p in self.state.points.items() if p.mode == "fake"]
        self.float_metric: dict[str, float] | None = None
        self.float_samples: dict[str, torch.Tensor] = {}  # task -> the float model's per-sample scores
        # The reference's outputs per batch, kept after the first run (model outputs only).
        self._references: list[Any] | None = None
        # Output SQNR/cosine of the model with every point in float against ``reference``:
        # below inf when its own weights differ from float (QAT, BN folded).
        self.floor: dict[str, dict[str, float]] = {}
        self._float_outputs: list[Any] = []  # for a metric evaluated on stored outputs
        self.macs: dict[str, int] = {}
        self.sizes: dict[str, int] = {}  # call -> output values per sample
        self.params, self._other_params = self._parameters()
        self.samples: int | None = None  # the batches' first dimension, summed by the first run
        self._input_prints: list[bytes] = []  # each batch's ReplayModel fingerprint, for a metric on stored outputs
        self.group = distributed.current()  # under torchrun: this rank's share of the batches, combined after each run
        self._all_prints: list[bytes] | None = None  # under torchrun: every batch's fingerprint (not only this rank's)
        self._batch_index = 0
        self.call_order: list[str] = []  # the base run's calls, in execution order
        self._acting_calls = self._calls_acted_on()
        self._done = 0

    # -- public -------------------------------------------------------------------
    def run(self, trials: Sequence[Trial], *, keep_samples: bool = False,
            stop: Callable[[int, dict[int, dict[str, list[float]]]], Iterable[int]] | None = None,
            ) -> list[TrialResult]:
        """Measure every trial over all batches (one pass; see module docstring).  ``keep_samples``:
        with a per-sample metric, each trial's per-sample scores in ``TrialResult.samples`` (the
        float model's are always in ``float_samples``), for a bootstrap interval.

        ``stop(position, partial)``: called after each batch but the last with the float64 sums
        so far of every trial still running (trial index -> output name -> [sum x^2, sum (x - y)^2,
        sum x y, sum y^2], x the reference's output); the trials it returns are not run on the
        later batches.  Trial 0 always runs on.  Not with a metric (a metric's value over part
        of the data is another quantity), and ignored under torchrun (each rank sees only its
        share of the batches, and they must agree).
        """
        trials = list(trials)
        if stop is not None and self.metric is not None:
            raise ValueError("Experiment.run: stop= measures output statistics only, not a metric")
        if self.group.active:
            stop = None
        unknown = sorted({p for t in trials for p in (*t.quantized, *t.bits, *t.qparams)} - set(self.quantizable))
        if unknown:
            raise QDebugError(f"not a quantized point of this model: {', '.join(unknown[:5])}",
                              "trials name quant points in fake mode (qdebug inspect lists them)")
        sampler = per_sample_function(self.metric)
        runs = [MetricRun(streaming=sampler is not None, keep_samples=keep_samples) for _ in trials]
        first_metric = self.metric is not None and self.float_metric is None
        float_run = MetricRun(streaming=sampler is not None, keep_samples=True) if first_metric else None
        stats = [_OutputStats() for _ in trials]
        floor = _OutputStats()  # the model with no point quantized against the float model
        served_counts = [0] * len(trials)
        loaded = {name: p.mode for name, p in self.state.points.items()}
        modes = [(self.model, self.model.training)] + ([(self.reference, self.reference.training)] if self.reference else [])
        # The base run; the first trial's run (the anchor: "everything quantized" in suggest's
        # ranking, where each later trial changes one point of it); and two trial runs in turn:
        # trial k may serve from trial k-1's run while its own is recorded for trial k+1.
        base, anchor, recordings = _Recording(), _Recording(), (_Recording(), _Recording())
        # After the first run the reference outputs are known and the base run is only worth
        # recording when a trial can resume from it (one that quantizes from the input cannot).
        first = self._references is None
        with_base = first or self._base_serves(trials)
        references: list[Any] = [] if first else self._references
        count = self.batches.count  # None until a first pass has counted the user's data
        if count is not None and self.group.active:  # this rank's share (docs/scale.md)
            count = len(range(self.group.rank, count, self.group.world))
        total = count * (len(trials) + with_base + (first and self.reference is not None)) if count is not None else None
        samples = 0
        self._done = 0
        running = list(range(len(trials)))  # the trials not stopped early
        measured = [0] * len(trials)  # batches each trial ran on
        for module, _ in modes:
            module.eval()
        try:
            with torch.no_grad():
                for position, (batch_index, batch) in enumerate(self.group.shard(self.batches)):
                    self._batch_index = batch_index  # where the metric's per-batch values go
                    inputs = getattr(batch, "inputs", batch)
                    self._check_batch(batch_index, inputs)
                    if first:
                        samples += _samples_in(batch)
                        if self.metric is not None and sampler is None:
                            self._input_prints.append(input_fingerprint(batch))
                    if with_base:
                        self._set(frozenset(), loaded)
                        base_out = self._record(inputs, base, costs=not self.macs)
                        self._tick(total)
                    if not first:
                        ref_out = references[position]
                    elif self.reference is not None:
                        ref_out = run_model(self.reference, inputs)
                        self._tick(total)
                        floor.update(named_outputs(ref_out), named_outputs(base_out))
                    else:
                        ref_out = base_out
                    if first:
                        self._check_reference(batch_index, ref_out)
                        references.append(_clone(ref_out))
                    ref_named = named_outputs(ref_out)
                    if float_run is not None:
                        self._score(float_run, sampler, ref_out, ref_out, batch)
                    index = {name: i for i, name in enumerate(self.call_order)}
                    served_now = [0] * len(running)
                    self._run_trials([trials[k] for k in running], loaded, inputs, index, base, anchor, recordings,
                                     served_now,
                                     lambda j, out: self._measure(running[j], out, stats, runs, sampler, ref_named,
                                                                  ref_out, batch, total))
                    for j, k in enumerate(running):
                        served_counts[k] += served_now[j]
                        measured[k] += 1
                    for recording in (base, anchor, *recordings):
                        recording.clear()
                    if stop is not None and (count is None or position + 1 < count):
                        sums = {k: {name: list(v) for name, v in stats[k].sums.items()} for k in running}
                        ended = set(stop(position, sums)) & set(running[1:])
                        running = [k for k in running if k not in ended]
                        if total is not None:  # the progress bar's end: the stopped trials' forwards are not coming
                            total -= len(ended) * (count - position - 1)
        finally:
            for name, mode in loaded.items():
                self.state.points[name].mode = mode
            for module, training in modes:
                module.train(training)
            for recording in (base, anchor, *recordings):
                recording.capture.release()
        if self.group.active:
            samples = self._combine_ranks(stats, floor if first else None, runs, float_run, served_counts, measured,
                                          samples)
        if first:
            self._references = references
            self.samples = samples
            if self.reference is not None:
                self.floor = floor.result()
        if float_run is not None:
            self._float_outputs = float_run.outputs
            self.float_metric = self._finish(float_run, of_float=True)
            self.float_samples = self._named(float_run.sample_scores())
        results = []
        for k, trial in enumerate(trials):
            metric = self._finish(runs[k]) if self.metric is not None else {}
            results.append(TrialResult(trial, stats[k].result(), metric, len(trial.quantized),
                                       *self.shares(trial.quantized), served_calls=served_counts[k],
                                       samples=self._named(runs[k].sample_scores()), batches=measured[k]))
        return results

    def _combine_ranks(self, stats: list["_OutputStats"], floor: "_OutputStats | None", runs: list[MetricRun],
                       float_run: MetricRun | None, served: list[int], measured: list[int], samples: int) -> int:
        """Under torchrun: every rank's sums, metric runs and counts (served calls, batches measured)
        merged into this rank's (the same on every rank, so every rank takes the same next step);
        the samples counted."""
        def merge(a: dict, b: dict) -> dict:
            return {
                "stats": [_OutputStats.merge_sums(x, y) for x, y in zip(a["stats"], b["stats"])],
                "floor": _OutputStats.merge_sums(a["floor"], b["floor"]) if a["floor"] is not None else None,
                "runs": [MetricRun.merge(x, y) for x, y in zip(a["runs"], b["runs"])],
                "float_run": MetricRun.merge(a["float_run"], b["float_run"]) if a["float_run"] is not None else None,
                "served": [x + y for x, y in zip(a["served"], b["served"])],
                "measured": [x + y for x, y in zip(a["measured"], b["measured"])],
                "samples": a["samples"] + b["samples"],
                # Costs and call order come from a rank that ran a batch (rank 0, unless it had none).
                "costs": a["costs"] if a["costs"][2] else b["costs"],
            }

        mine = {"stats": [s.sums for s in stats], "floor": floor.sums if floor is not None else None,
                "runs": [r.state() for r in runs], "float_run": float_run.state() if float_run is not None else None,
                "served": served, "measured": measured, "samples": samples, "costs": (self.macs, self.sizes, self.call_order)}
        merged = self.group.combine(mine, merge)
        for s, sums in zip(stats, merged["stats"]):
            s.sums = sums
        if floor is not None:
            floor.sums = merged["floor"]
        for run, state in zip(runs, merged["runs"]):
            run.absorb(state)
        if float_run is not None:
            float_run.absorb(merged["float_run"])
        served[:] = merged["served"]
        measured[:] = merged["measured"]
        self.macs, self.sizes, self.call_order = (dict(merged["costs"][0]), dict(merged["costs"][1]),
                                                  list(merged["costs"][2]))
        return merged["samples"]

    def _base_serves(self, trials: Sequence[Trial]) -> bool:
        """Whether a trial would take a call other than a model input from the base run."""
        index = {name: i for i, name in enumerate(self.call_order)}
        return any(self._boundary(t.differs_at(NOTHING), index, len(index)) > _input_calls(index) for t in trials)

    def _run_trials(self, trials: list[Trial], loaded: Mapping[str, str], inputs: Any, index: Mapping[str, int],
                    base: "_Recording", anchor: "_Recording", recordings: tuple, served_counts: list[int],
                    measure: Callable[[int, Any], None]) -> None:
        """One batch through every trial, each serving from the recorded run (base, anchor or
        previous trial) that agrees with it on the longest prefix of calls."""
        end = len(index)
        # A recorded run is worth its copies only where it serves more than the base run would and
        # more than the model inputs, which are computed anyway (step's "all" trial, followed by a
        # trial that quantizes from its first layer on, is not recorded).
        input_calls = _input_calls(index)

        def start(a: Trial, b: Trial) -> int:
            return self._boundary(a.differs_at(b), index, end)

        anchored = len(trials) > 1 and any(start(t, trials[0]) > max(start(t, NOTHING), input_calls) for t in trials[1:])
        previous: tuple[Trial, _Recording] | None = None  # the last trial recorded, and where
        for k, trial in enumerate(trials):
            sources = [(start(trial, NOTHING), base)]
            if anchored and k > 0:
                sources.append((start(trial, trials[0]), anchor))
            if previous is not None:
                sources.append((start(trial, previous[0]), previous[1]))
            first, source = max(sources, key=lambda item: item[0])
            following = trials[k + 1] if k + 1 < len(trials) else None
            keep = following is not None and start(following, trial) > max(
                start(following, NOTHING), start(following, trials[0]) if anchored else -1, input_calls)
            record = anchor if (k == 0 and anchored) else (recordings[k % 2] if keep else None)
            served = source.served(first)
            self._set(trial.quantized, loaded)
            undo = raise_bits(self.model, trial.bits, self.state.points)
            ranges = set_qparams(self.model, trial.qparams, self.state.points)
            try:
                with serving(self.model, served):
                    out = self._record(inputs, record)
            finally:
                ranges.restore()
                undo.restore()
            previous = (trial, record) if record is not None else None
            served_counts[k] += served.served
            measure(k, out)

    def _measure(self, k: int, out: Any, stats: list, runs: list, sampler, ref_named: dict, ref_out: Any, batch: Any,
                 total: int) -> None:
        stats[k].update(ref_named, named_outputs(out))
        if self.metric is not None:
            self._score(runs[k], sampler, out, ref_out, batch)
        self._tick(total)

    def shares(self, quantized: Iterable[str]) -> tuple[float, float]:
        """(macs_share, params_share): the multiply-accumulates and parameters of the layers
        whose weight point is among ``quantized``, as shares of the model's."""
        layers: dict[str, float] = {}  # layer -> the share of its weights quantized
        for name in quantized:
            point = self.state.points[name]
            if point.kind == "weight":
                layers[point.owner] = min(1.0, layers.get(point.owner, 0.0) + self._weight_fraction(point))
        total_macs = sum(self.macs.values())
        macs = sum(v * layers[k] for k, v in self.macs.items() if k in layers)
        total_params = sum(self.params.values()) + self._other_params
        params = sum(v * layers[k] for k, v in self.params.items() if k in layers)
        return (macs / total_macs if total_macs else 0.0), (params / total_params if total_params else 0.0)

    def _weight_fraction(self, point: Any) -> float:
        """The part of its layer's weights a weight point quantizes: all of a conv's or linear's;
        one of a recurrent layer's gate matrices (``lstm.weight_hh_l1``) by its elements."""
        try:
            layer = self.model.get_submodule(point.owner)
        except AttributeError:
            return 1.0
        if not isinstance(layer, RecurrentLayer):
            return 1.0
        weights = {n: p.numel() for n, p in layer.named_parameters(recurse=False) if n.startswith("weight")}
        own = weights.get(point.name[len(point.owner) + 1:] if point.owner else point.name)
        return own / sum(weights.values()) if own and sum(weights.values()) else 1.0

    def activation_share(self, points: Iterable[str]) -> float:
        """The activation values the given points quantize, as a share of all activation points'."""
        sizes = {n: self.sizes.get(n, 0) for n, p in self.state.points.items() if p.kind == "activation"}
        total = sum(sizes.values())
        return sum(sizes.get(n, 0) for n in points) / total if total else 0.0

    def verdict(self, values: Mapping[str, float], rules: Mapping[str, TaskRule]) -> dict[str, Any]:
        """Per task the value and its ``<task>_ratio`` against the float metric (baseline's
        score), and ``verdict``: pass when every task meets its rule."""
        out: dict[str, Any] = {}
        passed = True
        for task, value in values.items():
            rule = rules.get(task) or rules.get("metric") or TaskRule()
            f = (self.float_metric or {}).get(task, math.nan)
            score, _, _, ok = evaluate_rule(f, value, rule)
            out[task], out[f"{task}_ratio"] = value, score
            passed = passed and ok
        out["verdict"] = "pass" if passed else "fail"
        return out

    # -- runs -------------------------------------------------------------------------
    def _tick(self, total: int) -> None:
        self._done += 1
        if self.progress is not None:
            self.progress(self._done, total)

    def _set(self, quantized: frozenset[str], loaded: Mapping[str, str]) -> None:
        for name, point in self.state.points.items():
            mode = loaded[name] if name in quantized or loaded[name] != "fake" else "float"
            if point.mode != mode:  # nn.Module.__setattr__ costs ~2 us: hundreds of points, every run
                point.mode = mode

    def _record(self, inputs: Any, recording: _Recording | None, costs: bool = False) -> Any:
        """One forward; with a recording, every call's output kept (and, once, the layers' costs)."""
        with contextlib.ExitStack() as stack:
            if recording is not None:
                recording.clear()
                stack.enter_context(tap(self.model, recording))
                self.state.passthrough_recorder = recording.passthrough
                stack.callback(setattr, self.state, "passthrough_recorder", None)
            counter = _Costs() if costs else None
            if counter is not None:
                stack.enter_context(tap(self.model, counter))
            out = run_model(self.model, inputs)
        if counter is not None:
            self.macs, self.sizes = counter.macs, counter.sizes
        if recording is not None and not self.call_order:
            self.call_order = recording.order()
        return out

    def _boundary(self, changed: Iterable[str], index: Mapping[str, int], end: int) -> int:
        """Index of the first call that a change of the ``changed`` points affects (``end``:
        none).  A weight point acts at its layer's (first) call; an activation point at its own."""
        first = end
        for name in changed:
            for call in self._acting_calls.get(name, (name,)):
                first = min(first, index.get(call, end))
        return first

    def _calls_acted_on(self) -> dict[str, tuple[str, ...]]:
        """Per point, the calls whose result it changes: a weight point its layer's calls; an
        activation point its own call and, in the quantized stage, the integer kernel whose
        output lands on its grid (a conv before its fused ReLU's point)."""
        acting: dict[str, list[str]] = {}
        plan = self.state.plan
        for name, point in self.state.points.items():
            # A member of a structured output (``lstm:1.1``) acts at its call (``lstm``).
            call = plan.call_of_point(name)
            # A point inside a recurrent layer (``lstm.l0.cell``) is no call: it acts at its layer's.
            inner = call not in plan.calls and point.owner in plan.calls
            acting[name] = [point.owner] if point.kind == "weight" or inner else [call]
        if self.state.stage == "quantized":
            for record in self.state.plan.calls.values():
                if record.output_point in acting and record.name not in acting[record.output_point]:
                    acting[record.output_point].append(record.name)
        return {name: tuple(calls) for name, calls in acting.items()}

    # -- metric ---------------------------------------------------------------------------
    def _score(self, run: MetricRun, sampler, out: Any, ref_out: Any, batch: Any) -> None:
        if not run.streaming:
            run.keep_output(_clone(out), self._batch_index)
            return
        model = ReplayModel([batch], [out])
        run.add(call_metric(sampler, model, [batch], ReplayModel([batch], [ref_out]), self.metric_name),
                self._batch_index)
        self._called(model)

    def _finish(self, run: MetricRun, *, of_float: bool = False) -> dict[str, float]:
        """Task -> value; a single-number metric is the task named after the metric (as in baseline).
        The float model's values must be finite and not all zero: every ratio divides by them."""
        if run.streaming:
            values = run.values()
        else:
            if self.group.active and self._all_prints is None:  # every batch's, for outputs of every rank
                self._all_prints = [input_fingerprint(b) for b in self.batches]
            prints = self._all_prints if self.group.active else self._input_prints
            model = ReplayModel(None, run.outputs, prints)
            values = run_metric(self.metric, model, self.batches, reference=ReplayModel(None, self._float_outputs, prints),
                                name=self.metric_name)
            self._called(model)
        values = {self.metric_name: values["metric"]} if list(values) == ["metric"] else values
        if of_float:
            check_metric_values("float", values)
            if all(v == 0 for v in values.values()):
                raise QDebugError(f"the float model scores 0 on {self.metric_name}: a ratio to it means nothing",
                                  "check that the data's targets match the model's outputs (class indices), "
                                  "or choose another metric")
        return values

    def _named(self, by_task: dict[str, Any]) -> dict[str, Any]:
        """A single-number metric's only task is named after the metric (as ``_finish`` does)."""
        return {self.metric_name: by_task["metric"]} if list(by_task) == ["metric"] else by_task

    def _called(self, model: "ReplayModel") -> None:
        if not model.calls:
            raise QDebugError(f"metric {self.metric_name} never called the model",
                              "a metric gets (model, batches) and must run model(inputs) on each batch")

    def _check_batch(self, index: int, inputs: Any) -> None:
        for t in tensors_in(inputs):
            if torch.is_floating_point(t) and not bool(torch.isfinite(t).all()):
                raise QDebugError(f"batch {index} of the data holds NaN/Inf inputs",
                                  "every measure compares with the float model's outputs: give finite data")

    @staticmethod
    def _check_reference(index: int, out: Any) -> None:
        for name, t in named_outputs(out).items():
            if not bool(torch.isfinite(t).all()):
                raise QDebugError(f"the float model's output {name} is NaN/Inf on batch {index}",
                                  "the float model must give finite outputs on the data (check its weights "
                                  "with qdebug inspect)")

    def _parameters(self) -> tuple[dict[str, int], int]:
        """Parameters of each weighted layer, and of everything else (quant points' own excluded)."""
        params: dict[str, int] = {}
        seen: set[int] = set()
        for path, module in self.model.named_modules():
            if isinstance(module, (_QWeighted, RecurrentLayer)):
                own = ([p for p in (module.weight, module.bias) if p is not None] if isinstance(module, _QWeighted)
                       else list(module.parameters(recurse=False)))  # every gate weight and bias of every layer
                params[path] = sum(p.numel() for p in own)
                seen.update(id(p) for p in own)
        points = getattr(self.model, "qdebug_points", None)
        seen.update(id(p) for p in points.parameters()) if points is not None else None
        other = sum(p.numel() for p in self.model.parameters() if id(p) not in seen)
        return params, other


def _samples_in(batch: Any) -> int:
    found = tensors_in(getattr(batch, "inputs", batch))
    return int(found[0].shape[0]) if found and found[0].dim() else 1


def _clone(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.detach().clone())
