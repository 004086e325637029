"""The experiment primitive with bit-width changes: suggest's ranking pattern (everything
quantized, one point at a time raised to 16 bits) resumes from the "everything quantized"
run and stays bit-identical to full reruns."""

from __future__ import annotations

import math

import pytest
import torch

from qdebug.engine import QConfig, calibrate, convert, prepare, quant_points
from qdebug.engine.context import run_model
from qdebug.engine.respec import raise_bits
from qdebug.tools.experiment import Experiment, Trial


def _full_run(model, trial, x):
    points = quant_points(model)
    loaded = {n: p.mode for n, p in points.items()}
    try:
        for name, point in points.items():
            point.mode = loaded[name] if name in trial.quantized else "float"
        undo = raise_bits(model, trial.bits, points)
        try:
            with torch.no_grad():
                return run_model(model.eval(), x)
        finally:
            undo.restore()
    finally:
        for name, point in points.items():
            point.mode = loaded[name]


@pytest.mark.parametrize("stage", ["calibrated", "quantized"])
def test_one_point_at_16_bits_resumes_from_the_quantized_run(make_resnet, images, monkeypatch, stage):
    model = calibrate(prepare(make_resnet(0), QConfig(), example_inputs=images(4, seed=1)),
                      [images(16, seed=s) for s in (10, 11)])
    if stage == "quantized":
        model = convert(model)
    names = list(quant_points(model))
    everything = frozenset(names)
    trials = [Trial(everything)] + [Trial(everything, bits={name: 16}) for name in names]
    trials.append(Trial(everything, bits={names[3]: 16, names[-2]: 16}))  # a plan of two
    seen = []
    import qdebug.tools.experiment as experiment

    original = experiment._OutputStats.update
    monkeypatch.setattr(experiment._OutputStats, "update",
                        lambda self, ref, out: (seen.append(out["output"].clone()), original(self, ref, out))[1])
    batches = [images(6, seed=s) for s in (30, 31)]
    results = Experiment(model, batches).run(trials)
    # Each single-point trial takes every call before its point from the "everything quantized" run.
    assert results[-2].served_calls > results[6].served_calls > 0
    for b, x in enumerate(batches):
        for k, trial in enumerate(trials):
            assert torch.equal(seen[b * len(trials) + k], _full_run(model, trial, x)), (b, k)
    assert all(p.spec.bits == 8 for p in quant_points(model).values())  # every width put back
    gains = [r.outputs["output"]["sqnr_db"] - results[0].outputs["output"]["sqnr_db"] for r in results[1:-1]]
    assert max(gains) > 0  # some point at 16 bits helps


def _sqnr_by_hand(model, trial, batches) -> float:
    """10 log10(sum x^2 / sum (x - y)^2) over ``batches``, x the all-float run, y ``trial``'s, in float64."""
    signal = error = 0.0
    for x in batches:
        ref = _full_run(model, Trial(frozenset()), x).double()
        out = _full_run(model, trial, x).double()
        signal += float((ref * ref).sum())
        error += float(((ref - out) ** 2).sum())
    return 10 * math.log10(signal / error)  # in float64: torch.tensor(float) would round it to float32


def test_trials_stopped_early_are_measured_on_the_batches_they_ran(make_resnet, images):
    """``run(stop=)``: the trials it names after the first batch are measured on that batch alone;
    the others, and trial 0 even when named, on all of them."""
    model = calibrate(prepare(make_resnet(0), QConfig(), example_inputs=images(4, seed=1)),
                      [images(16, seed=s) for s in (10, 11)])
    names = list(quant_points(model))
    everything = frozenset(names)
    trials = [Trial(everything)] + [Trial(everything, bits={name: 16}) for name in names[:4]]
    batches = [images(6, seed=s) for s in (30, 31, 32)]
    asked = []

    def stop(position, partial):
        asked.append((position, sorted(partial)))
        # The float64 sums so far: sum x^2 is the reference's, the same for every trial.
        assert len({round(partial[k]["output"][0], 6) for k in partial}) == 1
        assert all(len(partial[k]["output"]) == 4 and partial[k]["output"][1] > 0 for k in partial)
        return {0, 2, 4} if position == 0 else set()

    results = Experiment(model, batches).run(trials, stop=stop)
    # Asked after each batch but the last, about the trials still running.
    assert asked == [(0, [0, 1, 2, 3, 4]), (1, [0, 1, 3])]
    assert [r.batches for r in results] == [3, 3, 1, 3, 1]
    for k in range(len(trials)):
        ran = batches[:1] if k in (2, 4) else batches
        assert results[k].outputs["output"]["sqnr_db"] == pytest.approx(_sqnr_by_hand(model, trials[k], ran), abs=1e-6)


def test_stop_is_for_output_statistics_only(make_resnet, images):
    model = calibrate(prepare(make_resnet(0), QConfig(), example_inputs=images(4, seed=1)),
                      [images(16, seed=s) for s in (10, 11)])
    experiment = Experiment(model, [images(2, seed=3)], metric=lambda m, batches: {"metric": 1.0})
    with pytest.raises(ValueError, match="output statistics only"):
        experiment.run([Trial(frozenset(quant_points(model)))], stop=lambda position, partial: set())


def test_a_run_that_would_serve_only_model_inputs_is_not_recorded(make_resnet, images, monkeypatch):
    """step's sweep: "everything quantized", then the unit quantizing the input.  The second
    could resume from the first only at its first layer (the input is computed anyway), so the
    first run is not recorded: one recording a batch, the base run's.  Both still measure what
    full runs measure."""
    import qdebug.tools.experiment as experiment

    model = calibrate(prepare(make_resnet(0), QConfig(), example_inputs=images(4, seed=1)),
                      [images(16, seed=s) for s in (10, 11)])
    names = list(quant_points(model))
    assert names[0] == "input"
    later = frozenset(n for n in names if n.startswith("layer2"))
    trials = [Trial(frozenset(names)), Trial(frozenset({"input"})), Trial(later)]
    recorded = []
    original = experiment.Experiment._record
    monkeypatch.setattr(experiment.Experiment, "_record", lambda self, inputs, recording, costs=False: (
        recorded.append(recording is not None), original(self, inputs, recording, costs))[1])
    batches = [images(6, seed=s) for s in (30, 31)]
    results = Experiment(model, batches).run(trials)
    assert recorded.count(True) == len(batches)  # the base run of each batch, nothing else
    assert results[2].served_calls > 0  # the third resumes from the base run at its first point
    for k, trial in enumerate(trials):
        assert results[k].outputs["output"]["sqnr_db"] == pytest.approx(_sqnr_by_hand(model, trial, batches), abs=1e-6)
