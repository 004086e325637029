"""The quickstart's walk-through (docs/quickstart.md) on the broken demo, end to end through the CLI.

fixtures/demo/broken/ holds the bundled MobileNetV2 with a planted outlier channel and a range
set too narrow (fixtures/demo/broken/make_broken.py).  Each test runs the commands the quickstart
shows, from that folder and with its qdebug.toml, on a few batches, and checks what the
walk-through claims: baseline fails, compare and step name the planted layer and channel, the
one-point int16 fix passes baseline, nan-trace names the learned scale the lr drove negative.
The planted facts come from the generator's constants, not from the commands' output.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import qdebug
from qdebug.data.spec import load_batches

DEMO = Path(__file__).resolve().parent.parent / "fixtures" / "demo"
BROKEN = DEMO / "broken"
# one intra-op thread: two threads on two shared cores are many times slower (conftest)
pytestmark = pytest.mark.usefixtures("x86_engine_one_thread")


def _generator():
    spec = importlib.util.spec_from_file_location("make_broken", BROKEN / "make_broken.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PLANTED = _generator()


@pytest.fixture
def here(cli, monkeypatch):
    """The CLI, run from fixtures/demo/broken as the quickstart does (its qdebug.toml in effect)."""
    monkeypatch.chdir(BROKEN)
    return cli


def _json(result) -> dict:
    return json.loads(result.out)


def test_the_float_model_computes_the_original_demos_function():
    original, _ = qdebug.load(DEMO / "float.pt")
    broken, info = qdebug.load(BROKEN / "float.pt")
    assert info.stage == "float"
    bn = dict(broken.named_modules())[PLANTED.OUTLIER_LAYER]
    original_bn = dict(original.named_modules())[PLANTED.OUTLIER_LAYER]
    ratio = bn.weight[PLANTED.OUTLIER_CHANNEL] / original_bn.weight[PLANTED.OUTLIER_CHANNEL]
    assert ratio.item() == pytest.approx(PLANTED.OUTLIER_SCALE)  # the channel really is planted
    batches = load_batches(str(DEMO / "eval.pt"), batch_size=500, batches=2)
    with torch.no_grad():
        for batch in batches:
            want, got = original(batch.inputs), broken(batch.inputs)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), (got - want).abs().max()


def test_the_broken_demo_stays_small_and_reuses_the_demos_eval_set():
    assert sum(p.stat().st_size for p in BROKEN.iterdir() if p.is_file()) < 3 * 2**20
    assert not (BROKEN / "eval.pt").exists()
    assert 'data = "../eval.pt"' in (BROKEN / "qdebug.toml").read_text()


def test_baseline_fails_on_the_calibrated_stage_and_points_to_compare(here):
    result = here("baseline", "float.pt", "calibrated.pt")
    assert result.code == 1, result.err
    assert "fail" in result.out
    assert "qdebug compare float.pt calibrated.pt" in result.err


def test_compare_names_the_planted_layer_channel_and_the_clipped_point(here):
    result = here("compare", "float.pt", "calibrated.pt", "--batches", "1", "--format", "json")
    assert result.code == 0, result.err
    report = _json(result)
    finding = report["meta"]["findings"]["calibrated"]
    assert (finding["at_fault"], finding["at_fault_diagnosis"]) == (PLANTED.OUTLIER_LAYER, "outlier_channels")
    assert finding["outlier_channel"] == PLANTED.OUTLIER_CHANNEL
    assert finding["downstream_layer"] == PLANTED.NEXT_CONV  # the next conv's shrunk weights underflow
    diagnoses = {row["layer"]: row["diagnosis"] for row in report["rows"]}
    assert diagnoses[PLANTED.CLIPPED_POINT] == "clipping"


def test_step_drills_down_to_the_outlier_point_and_hands_over_to_suggest(here):
    result = here("step", "float.pt", "calibrated.pt", "--drill", "--batches", "1", "--batch-size", "100",
                  "--format", "json")
    assert result.code == 0, result.err
    meta = _json(result)["meta"]
    assert meta["passed"] is False  # the whole model quantized fails the ratio
    assert meta["drill_path"][-1]["selection"] == PLANTED.OUTLIER_LAYER
    assert meta["culprit"]["selection"] == PLANTED.OUTLIER_LAYER and meta["single_culprit"]
    assert meta["next"].startswith("qdebug suggest float.pt calibrated.pt")


def test_suggests_one_point_plan_recalibrated_as_its_next_line_says_passes_baseline(here, tmp_path):
    out = tmp_path / "suggest-out"
    result = here("suggest", "float.pt", "calibrated.pt", "--batches", "1", "--batch-size", "500", "--rank", "fast",
                  "--out", out)
    assert result.code == 0, result.err
    report = json.loads((out / "suggest.json").read_text())
    assert report["plan"]["points"] == [PLANTED.OUTLIER_LAYER] and report["plan"]["passed"]
    assert list(report["meta"]["recalibrate"]) == [PLANTED.CLIPPED_POINT]  # a range to fix, not bits
    assert f"--qconfig {out / 'plan.toml'}" in result.out  # the printed next: line the quickstart follows
    fixed = tmp_path / "fixed.pt"  # the plan recalibrated from the float model: the clipped range goes too
    result = here("calibrate", "float.pt", "--batches", "2", "--qconfig", out / "plan.toml", "-o", fixed)
    assert result.code == 0, result.err
    assert here("baseline", "float.pt", "calibrated.pt").code == 1
    assert here("baseline", "float.pt", fixed).code == 0


def test_fix_keeps_int8_the_fixed_float_recalibrated_as_printed_passes_baseline(here, tmp_path):
    """The quickstart's "keep int8" path: compare's fix line (its --like), equalization kept (it pulls
    the planted channel back), the printed calibrate command, and baseline passes with no int16."""
    compare = _json(here("compare", "float.pt", "calibrated.pt", "--batches", "1", "--format", "json"))
    assert compare["meta"]["fix"] == "qdebug fix float.pt --like calibrated.pt --batches 1 -o fixed_float.pt"
    fixed = tmp_path / "fixed_float.pt"
    result = here("fix", "float.pt", "--like", "calibrated.pt", "--batches", "4", "--method", "equalize",
                  "-o", fixed, "--format", "json")
    assert result.code == 0, result.err
    report = _json(result)
    (row,) = report["rows"]
    assert row["kept"] and row["gain_db"] >= 20 and row["float_sqnr_db"] >= 80
    pairs = {(r["layer1"], r["layer2"]): r for r in report["changes"] if r["applied"]}
    planted = pairs[(PLANTED.OUTLIER_LAYER.replace("project_bn", "project_conv"), PLANTED.NEXT_CONV)]
    assert planted["range_ratio_before"] > 20 and planted["range_ratio_after"] < 2
    calibrated = tmp_path / "calibrated_fixed.pt"
    next_line = report["meta"]["next"].split()
    assert next_line[:5] == ["qdebug", "calibrate", str(fixed), "--batches", "4"] and "--like" in next_line
    result = here(*next_line[1:-2], "--batches", "2", "-o", calibrated)
    assert result.code == 0, result.err
    assert here("baseline", "float.pt", calibrated).code == 0


def test_nan_trace_names_the_learned_scale_the_lr_drove_negative(here):
    result = here("nan-trace", "qat.pt", "--steps", "5", "--lr", "10", "--batches", "2", "--batch-size", "64",
                  "--format", "json")
    assert result.code == 1, result.err
    first = _json(result)["first"]
    assert (first["cause"], first["phase"], first["what"]) == ("scale", "update", "scale")
    assert first["value"] < 0 and "optimizer drove the learned scale" in first["detail"]
