"""The experiment primitive with bit-width changes: suggest's ranking pattern (everything
quantized, one point at a time raised to 16 bits) resumes from the "everything quantized"
run and stays bit-identical to full reruns."""

from __future__ import annotations

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
