"""step's drill: what leaving a unit in float recovers, and "no single culprit" (issue 30 item 3).

A unit can cost much alone (quantizing only it) and still leave the whole model where it was
when it alone stays in float: the loss builds up over many layers.  The drill measures both;
these tests check ``recovers_db`` and ``<task>_recovers`` against a brute force (the model run
with every point fake-quantized but the unit's), on a chain where the loss is spread evenly
and on one where one layer is to blame.
"""

from __future__ import annotations

import json
import math
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

import qdebug
from qdebug.data.batch import Batch
from qdebug.engine import QConfig, calibrate, prepare, quant_points
from qdebug.tools.step import RECOVERS_DB, _above_noise, step

from tables import body_rows, header_cells

LAYERS = 6


def _chain(bad: int | None = None):
    """Linear layers with orthogonal weights (each keeps the signal's norm, so each layer's
    weight rounding weighs the same at the output) in a ``blocks`` container, then a head; every
    block's weights at 6 bits, block ``bad``'s at 3.  (float model, calibrated model, batches
    whose targets are the float model's classes)."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Linear(16, 16) for _ in range(LAYERS)])
    for layer in blocks:
        nn.init.orthogonal_(layer.weight)
        nn.init.zeros_(layer.bias)
    model = nn.Sequential(OrderedDict(blocks=blocks, head=nn.Linear(16, 5))).eval()
    x = torch.randn(96, 16, generator=torch.Generator().manual_seed(1))
    overrides = {f"blocks.{i}": {"weight": {"bits": 3 if i == bad else 6}} for i in range(LAYERS)}
    qm = prepare(model, QConfig.from_dict({"overrides": overrides}), example_inputs=x)
    calibrate(qm, [x])
    with torch.no_grad():
        batches = [Batch(x[i:i + 48], model(x[i:i + 48]).argmax(-1)) for i in (0, 48)]
    return model, qm, batches


def _drill(model, qm, batches, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return step(qm, batches, reference=model, mode="drill", **kwargs)


def _points_of(qm, selection: str, kind: str) -> set[str]:
    points = quant_points(qm)
    return {n for n in points if (n == selection or n.startswith(selection + "."))
            and (kind == "both" or points[n].kind == kind)}


def _brute_force(model, qm, batches, float_points: set[str]) -> tuple[float, float]:
    """(output SQNR in dB, top-1) of ``qm`` with every point fake-quantized but ``float_points``,
    against the float model, over all batches: computed here, without the experiment primitive."""
    points = quant_points(qm)
    signal = noise = 0.0
    right = total = 0
    try:
        for name, point in points.items():
            point.mode = "float" if name in float_points else "fake"
        with torch.no_grad():
            for batch in batches:
                ref, out = model(batch.inputs).double(), qm(batch.inputs).double()
                signal += float((ref ** 2).sum())
                noise += float(((ref - out) ** 2).sum())
                # torch.topk's choice among tied logits, as top1's (quantized logits tie often)
                right += int((out.topk(1, dim=-1).indices.reshape(-1) == batch.target).sum())
                total += len(batch.target)
    finally:
        for point in points.values():
            point.mode = "fake"
    return 10 * math.log10(signal / noise), right / total


def _check_against_brute_force(model, qm, batches, frame) -> None:
    whole_db, whole_top1 = _brute_force(model, qm, batches, set())
    assert frame.iloc[0]["sqnr_db"] == pytest.approx(whole_db, abs=1e-6)
    drilled = frame[frame["mode"] == "drill"]
    assert len(drilled) > LAYERS and drilled["recovers_db"].notna().all()
    for row in drilled.itertuples():
        db, top1 = _brute_force(model, qm, batches, _points_of(qm, row.selection, row.kind))
        assert row.recovers_db == pytest.approx(db - whole_db, abs=1e-6), row.selection
        if "top1_recovers" in frame:  # float top-1 is 1: the ratio is top-1 itself
            assert row.top1_recovers == pytest.approx(top1 - whole_top1, abs=1e-9), row.selection
    assert math.isnan(frame.iloc[0]["recovers_db"])  # step 0 is what the others are measured from


def test_spread_loss_has_no_single_culprit():
    model, qm, batches = _chain()
    result = _drill(model, qm, batches)
    frame, meta = result.frame, result.meta
    _check_against_brute_force(model, qm, batches, frame)
    # The container the drill went into recovers most of the loss; none of its parts does.
    by_unit = frame[frame["mode"] == "drill"].set_index("selection")["recovers_db"]
    assert by_unit["blocks"] > 10
    parts = by_unit[[f"blocks.{i}" for i in range(LAYERS)]]
    assert (parts.abs() < 2).all(), parts  # 0.1 to 1.4 dB (about 10 log10(6/5) = 0.8 dB each)
    assert meta["single_culprit"] is False
    assert meta["recovers_most"]["selection"] != "blocks"
    assert meta["recovers_most"]["recovers_db"] == pytest.approx(
        frame[frame["selection"] == meta["recovers_most"]["selection"]]["recovers_db"].max())
    assert "no single culprit: the loss builds up over many layers" in result.summary
    assert "qdebug suggest" in result.summary
    # The costliest unit alone is still named, with what leaving it in float recovers: little.
    culprit = meta["culprit"]
    assert abs(culprit["recovers_db"]) < RECOVERS_DB
    assert f"left in float, everything else quantized: recovers {culprit['recovers_db']:+.1f} dB" in result.summary


def test_one_layer_to_blame_is_a_single_culprit_and_recovers_the_loss():
    model, qm, batches = _chain(bad=3)
    result = _drill(model, qm, batches, metric=qdebug.data.metrics.top1, metric_name="top1")
    frame, meta = result.frame, result.meta
    _check_against_brute_force(model, qm, batches, frame)
    assert meta["culprit"]["selection"] == "blocks.3.weight"
    assert meta["single_culprit"] is True and meta["recovers_most"]["selection"] == "blocks.3.weight"
    assert meta["culprit"]["recovers_db"] > 10 and meta["culprit"]["top1_recovers"] > 0.1
    assert "no single culprit" not in result.summary
    assert "left in float, everything else quantized: recovers +" in result.summary


@pytest.mark.parametrize("row, expected", [
    ({"recovers_db": 2.9}, False),  # under half the noise power
    ({"recovers_db": 3.02}, True),  # the noise power halved
    ({"recovers_db": 0.1, "top1_recovers": 1 / 48}, False),  # one sample of 48: noise
    ({"recovers_db": 0.1, "top1_recovers": 2 / 48}, True),  # two samples, half of the 4 lost
    ({"recovers_db": 0.1, "top1_recovers": 2 / 48 - 1e-3}, False),  # under half the loss
])
def test_a_culprit_wins_back_half_the_loss_and_more_than_one_sample(row, expected):
    whole = {"top1_ratio": 1 - 4 / 48}  # four samples lost
    assert _above_noise(row, whole, tolerance=1 / 48) is expected


def test_cli_drill_reports_the_recovery_columns(cli, stages):
    args = ["step", stages.float, stages.calibrated, "--drill", "--metric", "agreement", "--data", stages.data]
    data = json.loads(cli(*args, "--format", "json").out)
    rows, meta = data["rows"], data["meta"]
    assert rows[0]["recovers_db"] is None  # step 0: NaN in JSON is null
    assert all(isinstance(r["recovers_db"], float) and "agreement_recovers" in r for r in rows
               if r["mode"] == "drill")
    assert isinstance(meta["single_culprit"], bool) and meta["recovers_most"]["selection"]
    assert "recovers_db" in meta["culprit"]
    table = cli(*args, "--wide")
    assert table.code == 0, table.err
    assert "recovers_db" in table.out and "agreement_recovers" in table.out
    # --sort recovers_db: the unit that recovers the most first (step 0, which has none, last).
    ranked = cli(*args, "--sort", "recovers_db", "--wide")
    column = header_cells(ranked.out).index("recovers_db")
    rows = [[c for c in row if c] for row in body_rows(ranked.out)]  # the right-aligned step leaves a blank cell
    shown = [row[column] for row in rows]
    values = [float(v) for v in shown[:-1]]
    assert values == sorted(values, reverse=True) and shown[-1] == "-", shown
