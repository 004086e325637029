"""``qdebug fix`` and ``qdebug.fix``: the proof (same qconfig, held-out batches, against the
original float outputs), what is kept and written, and the errors before any work."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import qdebug
from qdebug.engine import QConfig, QuantSpec, calibrate, prepare

DEMO = Path(__file__).resolve().parent.parent / "fixtures" / "demo"


def _spread_depthwise():
    from test_fix_equalize import _spread_depthwise_net

    return _spread_depthwise_net()


def _sqnr(reference, other) -> float:
    return (10 * torch.log10((reference.double() ** 2).sum() / ((reference - other).double() ** 2).sum())).item()


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The demo's float model with one channel of features.1's projection x64, compensated exactly in
    features.2's expand conv (a linear pair: the float function is unchanged; per-tensor int8
    activations of features.1 lose everything else to that channel)."""
    model, info = qdebug.load(DEMO / "float.pt")
    with torch.no_grad():
        bn = model.features[1].conv.project_bn
        bn.weight[3] *= 64
        bn.bias[3] *= 64
        model.features[2].conv.expand_conv.weight[:, 3] /= 64
    path = tmp_path_factory.mktemp("planted") / "planted.pt"
    qdebug.save(model, path, stage="float", model_spec=info.model, sample_inputs=info.sample_inputs)
    return path


def test_fix_keeps_equalization_proves_it_and_the_next_line_runs(cli, planted, tmp_path):
    data = str(DEMO / "eval.pt")
    result = cli("fix", planted, "--data", data, "--batches", 4, "--method", "equalize", "-o", "fixed.pt",
                 "--out", "report")
    assert result.code == 0, result.err
    assert "kept: cross-layer equalization" in result.out
    report = json.loads((tmp_path / "report" / "fix.json").read_text())
    (row,) = report["rows"]
    assert row["method"] == "equalize" and row["kept"] and row["changes"] >= 1
    assert row["gain_db"] >= 10 and row["float_sqnr_db"] >= 80  # measured, not assumed: checked below
    meta = report["meta"]
    assert meta["held_out"] == 1 and meta["kept"] == ["equalize"]
    assert {p.name for p in (tmp_path / "report").iterdir()} == {"fix.json", "fix.csv", "fix_changes.csv", "fix.png"}
    # The written model: the planted one's function, and quantized by hand as the proof says it was.
    original, _ = qdebug.load(planted)
    fixed, info = qdebug.load(tmp_path / "fixed.pt")
    assert info.stage == "float" and type(fixed) is type(original)
    assert set(fixed.state_dict()) == set(original.state_dict())
    batches = [b.inputs for b in qdebug.api._batches(data, 4, None, None)]
    with torch.no_grad():
        assert _sqnr(original(batches[3]), fixed(batches[3])) >= 80

        def quantized(model):
            q = calibrate(prepare(model, QConfig(), example_inputs=batches[0]), batches[:3])
            return _sqnr(original(batches[3]), q(batches[3]))

        before, after = quantized(original), quantized(fixed)
    assert math.isclose(before, row["sqnr_before_db"], abs_tol=1e-3)
    assert math.isclose(after, row["sqnr_after_db"], abs_tol=1e-3)
    # next: the calibrate command, as printed
    line = result.out.split("next: calibrate the fixed float model with the same qconfig:")[1].split("\n")[1]
    args = line.split()[1:]
    assert args[:2] == ["calibrate", "fixed.pt"]
    assert cli(*args).code == 0 and (tmp_path / "calibrated_fixed.pt").exists()


def test_nothing_to_change_is_one_error_line_before_any_calibration(cli, tmp_path):
    """No norm -> Linear in the demo: SmoothQuant alone has nothing to change -- an input error,
    said in one line with each method's reason, before any calibration; nothing written."""
    result = cli("fix", DEMO / "float.pt", "--data", DEMO / "eval.pt", "--batches", 2, "--method", "smooth",
                 "-o", "fixed.pt")
    result.assert_error("nothing to fix in this model: smooth: nothing to change: the model has no LayerNorm")
    assert not (tmp_path / "fixed.pt").exists()


def test_rows_that_change_nothing_carry_the_model_they_were_tried_on():
    """Methods run in METHODS order whatever the order asked; one that changes nothing says why
    and carries the SQNR of the model it was tried on: the baseline before the first change (no
    calibration is spent on it), the model kept so far after it.  Plain tensors as batches."""
    from qdebug.tools.fix import fix

    model = _spread_depthwise()
    batches = [torch.randn(4, 16, 12, 12) for _ in range(4)]
    per_tensor = QConfig(weight=QuantSpec(per_channel=False))
    result = fix(model, batches, qconfig=per_tensor, methods=["smooth", "absorb", "equalize"])
    rows = result.frame.to_dict("records")
    assert [r["method"] for r in rows] == ["equalize", "absorb", "smooth"]
    equalize, absorb, smooth = rows
    assert equalize["kept"] and equalize["gain_db"] >= 6
    assert absorb["sqnr_before_db"] == equalize["sqnr_after_db"]
    assert smooth["changes"] == 0 and smooth["reason"].startswith("nothing to change") and not smooth["kept"]
    assert smooth["sqnr_before_db"] == result.meta["fixed_sqnr_db"] and math.isnan(smooth["sqnr_after_db"])
    result = fix(model, batches, qconfig=per_tensor, methods=["smooth", "bias_correction"])
    smooth, corrected = result.frame.to_dict("records")
    assert smooth["changes"] == 0 and corrected["changes"] >= 1
    assert smooth["sqnr_before_db"] == corrected["sqnr_before_db"] == result.meta["baseline_sqnr_db"]


def test_a_function_preserving_method_that_moves_the_float_output_is_dropped():
    """ReLU6 pairs are equalized inside the peaks measured on the calibration part; a held-out
    batch 10x larger goes past them, the float output moves, and the proof drops the method
    whatever its quantized gain -- never a gain it did not measure on data it had not seen."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU6(), torch.nn.Conv2d(8, 4, 1)).eval()
    with torch.no_grad():
        model[0].weight[2] *= 8  # an outlier channel that equalization would pull in
        model[2].weight[:, 2] /= 8
    batches = [0.2 * torch.randn(2, 3, 8, 8) for _ in range(3)] + [10 * torch.randn(2, 3, 8, 8)]
    _, frame = qdebug.fix(model, batches, methods=["equalize"])
    (row,) = frame.to_dict("records")
    assert row["changes"] == 1 and row["float_sqnr_db"] < 80 and not row["kept"]
    assert "the float output moved" in row["reason"]


@pytest.mark.parametrize("args, message", [
    (["--method", "cle"], "unknown fix method 'cle'"),
    (["--method", ","], "--method names no method"),
    (["--bits", "1"], "--bits 1 is outside 2-16"),
    (["--observer", "median"], "unknown observer 'median'"),
])
def test_bad_options_are_refused_before_loading(cli, args, message):
    result = cli("fix", DEMO / "float.pt", "-o", "fixed.pt", *args)
    result.assert_error(message)


def test_a_calibrated_checkpoint_is_refused(cli):
    result = cli("fix", DEMO / "calibrated.pt", "-o", "fixed.pt")
    result.assert_error("fix expects a float checkpoint")


def test_a_metric_that_raises_is_one_error_line(cli, tmp_path):
    (tmp_path / "badmetric.py").write_text("def metric(model, batches):\n    raise ValueError('boom')\n")
    result = cli("fix", DEMO / "float.pt", "--data", DEMO / "eval.pt", "--batches", 2,
                 "--method", "equalize", "--metric", "badmetric:metric", "-o", "fixed.pt")
    result.assert_error("metric metric raised ValueError: boom")
    assert not (tmp_path / "fixed.pt").exists()


def test_python_api_is_the_package_called():
    """``qdebug.fix(model, batches)``: the package of the transforms, called, runs the proof."""
    model, _ = qdebug.load(DEMO / "float.pt")
    batches = [b.inputs for b in qdebug.api._batches(str(DEMO / "eval.pt"), 2, None, None)]
    fixed, frame = qdebug.fix(model, batches, qconfig=QConfig(weight=QuantSpec(per_channel=False)),
                              methods=["equalize"])
    assert list(frame["method"]) == ["equalize"] and frame.attrs["meta"]["held_out"] == 0
    assert "calibration batch(es)" in frame.attrs["summary"]
    assert fixed is not model and frame.attrs["changes"][0]["method"] == "equalize"
    with pytest.raises(qdebug.QDebugError, match="unknown fix method 'cle'"):
        qdebug.fix(model, batches, methods=["cle"])
    with pytest.raises(qdebug.QDebugError, match="qconfig must be a QConfig or a dict"):
        qdebug.fix(model, batches, qconfig="per-tensor")


def test_suggest_on_the_fixed_model_needs_fewer_int16_points():
    """Must-have 3: the fixed float model, calibrated with the same qconfig, is what suggest
    searches (against the ORIGINAL float model): per-tensor weights on the spread depthwise
    network need three int16 points as given and none once fixed."""
    model = _spread_depthwise()
    torch.manual_seed(3)
    batches = [torch.randn(4, 16, 12, 12) for _ in range(4)]
    per_tensor = QConfig(weight=QuantSpec(per_channel=False))
    fixed, frame = qdebug.fix(model, batches, qconfig=per_tensor)
    assert frame.attrs["meta"]["kept"][0] == "equalize"
    plans = []
    for float_model in (model, fixed):
        calibrated = calibrate(prepare(float_model, per_tensor, example_inputs=batches[0]), batches)
        plans.append(qdebug.suggest(model, calibrated, data=batches, min_sqnr=30).attrs["plan"])
    assert len(plans[0]["points"]) >= 2 and plans[0]["passed"]
    assert plans[1]["points"] == [] and plans[1]["passed"]


def test_like_takes_a_checkpoints_qconfig_and_mode_and_the_options_refine_it(cli, tmp_path):
    """``--like CKPT`` (calibrate and fix): the qconfig and QAT mode the diagnosed checkpoint was
    made with, refined by the qconfig options; compare and suggest print it in their fix line."""
    like_model, like = qdebug.load(DEMO / "calibrated.pt")
    assert like.qat_mode == "with_bn_reverse_fold" and like.qconfig.weight.per_channel
    result = cli("calibrate", DEMO / "float.pt", "--like", DEMO / "calibrated.pt", "--per-tensor", "--data",
                 DEMO / "eval.pt", "--batches", 1, "-o", "again.pt", "--format", "json")
    assert result.code == 0, result.err
    meta = json.loads(result.out)["meta"]
    expected = like.qconfig.to_dict()
    expected["weight"]["per_channel"] = False
    assert meta["qconfig"] == expected and meta["qat_mode"] == "with_bn_reverse_fold"
    report = json.loads(cli("fix", DEMO / "float.pt", "--like", DEMO / "calibrated.pt", "--data", DEMO / "eval.pt",
                            "--batches", 2, "--method", "equalize", "--format", "json", "-o", "f.pt").out)
    assert report["meta"]["mode"] == "with_bn_reverse_fold" and report["meta"]["qconfig"] == like.qconfig.to_dict()
    cli("fix", DEMO / "float.pt", "--like", DEMO / "float.pt", "-o", "f.pt").assert_error(
        "fix --like expects a calibrated or qat or quantized checkpoint")


def test_smoothquant_is_kept_on_a_transformer_block_with_outlier_channels():
    """The pipeline on a pre-LN transformer MLP block with planted activation outliers (LayerNorm
    gammas x30..x100, the readers' columns compensating): SmoothQuant is the method that pays, the
    float function is kept, and bias correction, if kept, says it changed the function."""
    from test_fix_smooth import MLPBlock, _batches, _block

    model = _block(MLPBlock, ["fc1"])
    fixed, frame = qdebug.fix(model, _batches(8))
    rows = {row["method"]: row for row in frame.to_dict("records")}
    assert rows["smooth"]["kept"] and rows["smooth"]["gain_db"] >= 10 and rows["smooth"]["float_sqnr_db"] >= 80
    assert rows["equalize"]["changes"] == 0  # LayerNorm -> Linear is no conv/linear pair
    assert frame.attrs["meta"]["fixed_sqnr_db"] >= frame.attrs["meta"]["baseline_sqnr_db"] + 10


def test_equalization_whose_relu6_pairs_move_the_float_output_falls_back_to_its_exact_pairs():
    """A ReLU6 pair measured on the calibration part breaks on a held-out batch with a spike; the
    linear pair after it (conv -> BN -> conv) needs no data.  fix sees the float output move and
    measures the exact variant (ReLU6 pairs skipped) instead: the row's changes, float SQNR and
    verdict are that variant's, its reason says why."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU6(), torch.nn.Conv2d(8, 8, 1),
                                torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 4, 1)).eval()
    with torch.no_grad():
        model[0].weight[2] *= 8
        model[2].weight[:, 2] /= 8
        model[3].weight[5] *= 64
        model[3].bias[5] *= 64
        model[4].weight[:, 5] /= 64
    held = 0.5 * torch.randn(2, 3, 8, 8)
    held[:, :, 4, 4] = 20.0
    _, frame = qdebug.fix(model, [0.5 * torch.randn(2, 3, 8, 8) for _ in range(3)] + [held], methods=["equalize"])
    (row,) = frame.to_dict("records")
    assert row["reason"].startswith("with ReLU6 pairs the float output moved to") and "without them:" in row["reason"]
    assert row["changes"] == 1 and row["float_sqnr_db"] >= 80 and math.isfinite(row["sqnr_after_db"])
    (applied,) = [r for r in frame.attrs["changes"] if r["applied"]]
    assert (applied["layer1"], applied["layer2"]) == ("2", "4")


def test_a_model_whose_only_pairs_are_shared_is_one_error_line():
    """Bad input for fix: every pair runs through a module called twice -- nothing to equalize or
    absorb -- is one QDebugError naming each method's reason, before any calibration."""
    from test_fix_equalize import SharedConv

    torch.manual_seed(0)
    with pytest.raises(qdebug.QDebugError) as raised:
        qdebug.fix(SharedConv().eval(), [torch.randn(2, 3, 8, 8) for _ in range(2)], methods=["equalize", "absorb"])
    message = str(raised.value)
    assert message.startswith("nothing to fix in this model: equalize: nothing to change: module shared is called 2 "
                              "times in one forward (shared)") and "; absorb: nothing to change" in message
