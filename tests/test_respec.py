"""``raise_bits``: a point at 16 bits is exactly what calibrating it at 16 bits gives (an
independent path: ``calibrate`` with a qconfig override on the same data), in the fake-quant
and integer stages, for every range estimator; and ``restore`` puts back every bit."""

from __future__ import annotations

import pytest
import torch

from qdebug.engine import QConfig, calibrate, convert, prepare, quant_points
from qdebug.engine.context import run_model
from qdebug.engine.respec import raise_bits

RAISED = {"layer1.0.relu": 16, "layer1.0.relu#2": 16, "layer1.0.conv1.weight": 16}
# The qconfig override that calibrates the same points at 16 bits ("layer1.0.relu" names both calls).
OVERRIDES = {"layer1.0.relu": {"activation": {"bits": 16}}, "layer1.0.conv1": {"weight": {"bits": 16}}}


def _calibrated(make_resnet, images, observer, overrides=None):
    qconfig = QConfig.from_dict({"activation": {"observer": observer, "symmetric": False},
                                 **({"overrides": overrides} if overrides else {})})
    model = prepare(make_resnet(0), qconfig, example_inputs=images(4, seed=1))
    return calibrate(model, [images(8, seed=s) for s in (10, 11)])


@pytest.mark.parametrize("observer", ["minmax", "percentile", "mse"])
@pytest.mark.parametrize("stage", ["fake", "quantized"])
def test_raised_points_equal_a_calibration_at_16_bits(make_resnet, images, observer, stage):
    model = _calibrated(make_resnet, images, observer)
    wide = _calibrated(make_resnet, images, observer, OVERRIDES)
    if stage == "quantized":
        model, wide = convert(model), convert(wide)
    x = images(4, seed=3)
    with torch.no_grad():
        before, expected = run_model(model, x), run_model(wide, x)
    undo = raise_bits(model, RAISED, quant_points(model))
    assert all(quant_points(model)[name].spec.bits == 16 for name in RAISED)
    with torch.no_grad():
        raised = run_model(model, x)
    assert torch.equal(raised, expected)
    assert not torch.equal(raised, before)
    undo.restore()
    assert all(quant_points(model)[name].spec.bits == 8 for name in RAISED)
    with torch.no_grad():
        assert torch.equal(run_model(model, x), before)


def test_a_learned_scale_keeps_its_real_range(make_resnet, images):
    qconfig = QConfig.from_dict({"activation": {"estimator": "lsq", "symmetric": False}})
    model = calibrate(prepare(make_resnet(0), qconfig, example_inputs=images(4, seed=1)), [images(8, seed=10)])
    point = quant_points(model)["layer1.0.relu"]
    lo = (point.spec.qmin - point.zero_point.float()) * point.scale.detach()
    hi = (point.spec.qmax - point.zero_point.float()) * point.scale.detach()
    undo = raise_bits(model, {"layer1.0.relu": 16}, quant_points(model))
    s16, z16 = point.scale.detach(), point.zero_point.float()
    # Hand computation: the same [lo, hi] (0 inside) over 65535 steps.
    assert float(s16) == pytest.approx(float(hi - lo) / 65535, rel=1e-6)
    assert float(z16) == float(-32768 - torch.round(lo / s16))
    undo.restore()
    assert point.spec.bits == 8


def test_an_unknown_point_is_refused_and_nothing_changes(make_resnet, images):
    from qdebug.errors import QDebugError

    model = _calibrated(make_resnet, images, "minmax")
    specs = {n: p.spec for n, p in quant_points(model).items()}
    with pytest.raises(QDebugError, match="no quant point 'nope'"):
        raise_bits(model, {"layer1.0.relu": 16, "nope": 16}, quant_points(model))
    assert {n: p.spec for n, p in quant_points(model).items()} == specs
