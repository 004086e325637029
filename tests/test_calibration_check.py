"""calibrate ends with the calibrated model's output SQNR against float and the points that
clip: checked against values computed here, and the warning when the SQNR is low."""

from __future__ import annotations

import json
import math

import torch

from qdebug.engine import QConfig, calibrate, prepare, quant_points, quantization_off
from qdebug.tools.calibration_check import check_calibration


def _calibrated(make_resnet, images):
    qm = prepare(make_resnet(), QConfig(), mode="fuse_bn", example_inputs=images())
    calibrate(qm, [images(8, seed=s) for s in (10, 11)])
    return qm


def test_the_sqnr_is_the_one_computed_by_hand(make_resnet, images):
    qm = _calibrated(make_resnet, images)
    batches = [images(4, seed=s) for s in (20, 21)]
    check = check_calibration(qm, batches)
    signal = error = 0.0
    with torch.no_grad():
        for x in batches:
            with quantization_off(qm):
                ref = qm(x).double()
            out = qm(x).double()
            signal += float((ref ** 2).sum())
            error += float(((ref - out) ** 2).sum())
    assert math.isclose(check.sqnr_db, 10 * math.log10(signal / error), rel_tol=1e-9)
    assert check.sqnr_db > 20 and not check.low and check.clipping == []
    assert all(p.mode == "fake" and not p.count_clipped for p in quant_points(qm).values())  # left as found


def test_a_range_far_too_small_is_named_with_its_clipped_fraction(make_resnet, images):
    qm = _calibrated(make_resnet, images)
    name = "layer1.0.relu"
    point = quant_points(qm)[name]
    point.set_qparams(point.scale * 0.02, point.zero_point)
    x = images(4, seed=30)
    check = check_calibration(qm, [x])
    assert check.clipping[0]["point"] == name and check.low
    # The fraction by hand: the point's input, from a float run up to it, against its range.
    seen = []

    def grab(module, args, out):  # the module's first call is the point's (its second is relu#2)
        seen.append(out)

    handle = qm.layer1[0].relu.register_forward_hook(grab)
    with torch.no_grad(), quantization_off(qm):
        qm(x)
    handle.remove()
    s, z = float(point.scale), int(point.zero_point)
    lo, hi = (point.spec.qmin - z - 0.5) * s, (point.spec.qmax - z + 0.5) * s
    raw = seen[0]
    by_hand = float(((raw < lo) | (raw > hi)).double().mean())
    assert by_hand > 0.3
    # Not equal: the calibrated run's input to this point carries the quantization of the
    # layers before it; close, because layer1.0.relu comes early.
    assert abs(check.clipping[0]["clipped"] - by_hand) < 0.05


def test_cli_calibrate_reports_the_check_and_warns_when_low(cli, stages):
    good = cli("calibrate", stages.float, "--data", stages.data, "--batch-size", 4, "-o", "cal.pt", "--json")
    assert good.code == 0, good.err
    meta = json.loads(good.out)["meta"]
    assert meta["output_sqnr_db"] > 20 and isinstance(meta["clipping"], list) and "warning" not in good.err
    table = cli("calibrate", stages.float, "--data", stages.data, "--batch-size", 4, "-o", "cal.pt")
    assert "output SQNR vs float:" in table.out
    low = cli("calibrate", stages.float, "--data", stages.data, "--batch-size", 4, "--bits", 2, "-o", "cal2.pt")
    assert low.code == 0, low.err
    assert "warning: the calibrated model's output SQNR against float is" in low.err
