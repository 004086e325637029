"""``compare`` (qdebug.tools.compare) and ``qdebug compare``: any stages, every layer, two errors
per layer, streaming statistics, planted defects and their diagnoses, and the CLI.

Expected statistics are computed by hand from whole tensors in float64 with plain torch.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import math
import warnings
import weakref

import pandas as pd
import pytest
import torch
import torch.nn as nn

import qdebug
import qdebug.tools.compare as compare_module
from qdebug.engine import QConfig, calibrate, prepare, quant_points, set_mode
from qdebug.errors import QDebugError
from qdebug.io.modelspec import ModelSpec, build
from qdebug.measure.stats import ErrorStats
from qdebug.tools.compare import METRICS, compare
from tables import body_rows, header_cells

from small_models import RESNET, SMALL_RESNET as SMALL
# float32 feature maps are reduced in float32 blocks (qdebug.measure.stats: relative error ~1e-7).
STATS_REL = 1e-6
# Every value call of the small ResNet's forward, in execution order, written out from its code:
# a BasicBlock calls its one ReLU twice and adds inline; flatten is a reshape, not a value call.
LAYERS = [
    "input", "conv1", "bn1", "relu",
    "layer1.0.conv1", "layer1.0.bn1", "layer1.0.relu", "layer1.0.conv2", "layer1.0.bn2", "layer1.0.add",
    "layer1.0.relu#2",
    "layer2.0.conv1", "layer2.0.bn1", "layer2.0.relu", "layer2.0.conv2", "layer2.0.bn2",
    "layer2.0.downsample.0", "layer2.0.downsample.1", "layer2.0.add", "layer2.0.relu#2",
    "avgpool", "fc",
]
CONVS = {"conv1": "bn1", "layer1.0.conv1": "layer1.0.bn1", "layer1.0.conv2": "layer1.0.bn2",
         "layer2.0.conv1": "layer2.0.bn1", "layer2.0.conv2": "layer2.0.bn2",
         "layer2.0.downsample.0": "layer2.0.downsample.1"}


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny tensors: intra-op threads only add waiting on a busy machine (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _images(n, seed):
    return torch.randn(n, 1, 16, 16, generator=torch.Generator().manual_seed(seed))


def _sqnr(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 20.0 * math.log10(float(x.norm()) / float((x - y).norm()))


def _rows(result, target=None):
    frame = result.frame if target is None else result.frame[result.frame["target"] == target]
    return {row["layer"]: row for row in frame.to_dict("records")}


def _first_flagged(result):
    flagged = result.flagged()
    return flagged.iloc[0] if len(flagged) else None


def _recorded(model: nn.Module, module: nn.Module, batches, outputs: bool) -> list[torch.Tensor]:
    """What ``module`` returns (or its first argument) at each call while ``model`` runs the batches,
    seen by a plain hook."""
    seen: list[torch.Tensor] = []
    if outputs:
        handle = module.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    else:
        handle = module.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    try:
        with torch.no_grad():
            for b in batches:
                model(b)
    finally:
        handle.remove()
    return seen


def _outputs(model: nn.Module, module: nn.Module, batches) -> list[torch.Tensor]:
    return _recorded(model, module, batches, outputs=True)


def _inputs(model: nn.Module, module: nn.Module, batches) -> list[torch.Tensor]:
    return _recorded(model, module, batches, outputs=False)


def _fake_quant(x: torch.Tensor, point) -> torch.Tensor:
    """Affine fake quantization written out: (clamp(round(x / s) + z, qmin, qmax) - z) * s."""
    s, z = float(point.scale), int(point.zero_point)
    q = torch.clamp(torch.round(x.double() / s) + z, point.spec.qmin, point.spec.qmax)
    return (q - z) * s


# -- any stages ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stage_batches():
    return [_images(4, 20), _images(4, 21)]


@pytest.fixture(scope="module")
def all_stages(stages, stage_batches):
    models = [(label, stages.models[label]) for label in ("float", "calibrated", "qat", "quantized")]
    return compare(models, stage_batches)


def test_any_stages_in_one_call(all_stages, stages, stage_batches):
    frame = all_stages.frame
    assert all_stages.meta["reference"] == "float"
    assert all_stages.meta["targets"] == ["calibrated", "qat", "quantized"]
    assert all_stages.meta["batches"] == 2
    for target in ("calibrated", "qat", "quantized"):
        assert list(frame[frame["target"] == target]["layer"]) == LAYERS
    # the last layer's output is the model's output: its SQNR by hand, for every stage
    fp = stages.models["float"]
    with torch.no_grad():
        ref = torch.cat([fp(b) for b in stage_batches])
        for target in ("calibrated", "qat", "quantized"):
            model = stages.models[target]
            out = torch.cat([model(b) for b in stage_batches])
            row = _rows(all_stages, target)["fc"]
            assert row["sqnr_db"] == pytest.approx(_sqnr(ref, out), rel=STATS_REL), target
            cos = float((ref.double() * out.double()).sum() / (ref.double().norm() * out.double().norm()))
            assert row["cosine"] == pytest.approx(cos, rel=STATS_REL), target
            assert row["note"] == ""
    assert not stages.models["qat"].training  # compare restores the modes it found


def test_isolated_error_is_the_layer_on_the_reference_input(all_stages, stages, stage_batches):
    """The stem ReLU of the calibrated model replayed on the float model's ReLU input: the
    float ReLU output fake-quantized with the calibrated point's scale and zero point."""
    fp, cal = stages.models["float"], stages.models["calibrated"]
    ref = torch.cat(_outputs(fp, fp.relu, stage_batches))
    own = _fake_quant(ref, quant_points(cal)["relu"])
    row = _rows(all_stages, "calibrated")["relu"]
    assert row["isolated_sqnr_db"] == pytest.approx(_sqnr(ref, own), rel=1e-6)
    # propagated error includes the input and BN quantization: worse than the layer's own
    assert row["sqnr_db"] < row["isolated_sqnr_db"] - 1


def test_ref_index(all_stages, stages, stage_batches):
    models = [(label, stages.models[label]) for label in ("float", "calibrated")]
    backward = compare(models, stage_batches, ref=1)
    assert backward.meta["reference"] == "calibrated" and backward.meta["targets"] == ["float"]
    assert set(backward.frame["target"]) == {"float"}
    a, b = _rows(all_stages, "calibrated"), _rows(backward, "float")
    # cosine and mse are symmetric; SQNR is relative to the reference's power
    for layer in ("relu", "layer1.0.add", "layer2.0.relu#2", "fc"):
        assert b[layer]["cosine"] == pytest.approx(a[layer]["cosine"], rel=STATS_REL)
        assert b[layer]["mse"] == pytest.approx(a[layer]["mse"], rel=STATS_REL)
    with torch.no_grad():
        cal_out = torch.cat([stages.models["calibrated"](x) for x in stage_batches])
        fp_out = torch.cat([stages.models["float"](x) for x in stage_batches])
    assert b["fc"]["sqnr_db"] == pytest.approx(_sqnr(cal_out, fp_out), rel=STATS_REL)
    assert b["fc"]["sqnr_db"] != pytest.approx(a["fc"]["sqnr_db"], rel=1e-6)


def test_compare_argument_errors(stages, stage_batches):
    fp, cal = stages.models["float"], stages.models["calibrated"]
    with pytest.raises(QDebugError, match="compared with itself"):
        compare([("a", fp), ("b", fp)], stage_batches)
    with pytest.raises(QDebugError, match="at least two models"):
        compare([("float", fp)], stage_batches)
    with pytest.raises(QDebugError, match="at least two models"):
        compare([], stage_batches)
    with pytest.raises(QDebugError, match="out of range"):
        compare([("float", fp), ("cal", cal)], stage_batches, ref=2)
    with pytest.raises(QDebugError, match="share the label"):
        compare([("x", fp), ("x", cal)], stage_batches)
    with pytest.raises(QDebugError, match="no batches"):
        compare([("float", fp), ("cal", cal)], [])
    with pytest.raises(QDebugError, match="unknown threshold"):
        compare([("float", fp), ("cal", cal)], stage_batches, thresholds={"snr": 3.0})


# -- every layer ----------------------------------------------------------------------------------
def test_inline_ops_and_shared_module_calls_are_rows(all_stages):
    rows = _rows(all_stages, "calibrated")
    for layer in ("layer1.0.add", "layer1.0.relu", "layer1.0.relu#2", "layer2.0.add", "layer2.0.relu#2"):
        assert rows[layer]["note"] == "", layer
        assert math.isfinite(rows[layer]["sqnr_db"]) and 0 < rows[layer]["cosine"] <= 1, layer
    assert rows["layer1.0.add"]["type"] == "add" and rows["layer1.0.relu#2"]["type"] == "ReLU"
    # the two calls of the shared ReLU are measured separately
    assert rows["layer1.0.relu"]["sqnr_db"] != rows["layer1.0.relu#2"]["sqnr_db"]


def test_a_folded_bn_is_listed_with_a_note(all_stages):
    rows = _rows(all_stages, "calibrated")
    for conv, bn in CONVS.items():
        assert "BN folded" in rows[conv]["note"] and bn in rows[conv]["note"], conv
        assert rows[conv]["diagnosis"] == "" and math.isnan(rows[conv]["sqnr_db"])
        assert rows[bn]["note"] == "" and math.isfinite(rows[bn]["sqnr_db"]), bn  # compared at the BN
        assert math.isfinite(rows[bn]["isolated_sqnr_db"]), bn  # the conv+BN chain replayed


def test_quantized_fused_relu_carries_a_note(all_stages):
    rows = _rows(all_stages, "quantized")
    for op, relu in (("layer1.0.add", "layer1.0.relu#2"), ("layer2.0.add", "layer2.0.relu#2"),
                     ("layer1.0.bn1", "layer1.0.relu"), ("bn1", "relu")):
        note = rows[op]["note"]
        assert "fused into its integer kernel" in note and note.endswith(relu), (op, note)
        assert rows[op]["diagnosis"] == ""
        assert rows[relu]["note"] == "" and math.isfinite(rows[relu]["sqnr_db"]), relu
    # in the fake-quant stages the same ops are measured
    assert _rows(all_stages, "calibrated")["layer1.0.add"]["note"] == ""


# -- a realistic model and planted defects ----------------------------------------------------------
def _realistic_resnet(seed=0) -> nn.Module:
    """The small ResNet with BN statistics from train-mode forwards (unit-scale activations)."""
    torch.manual_seed(seed)
    model = build(ModelSpec(RESNET, dict(SMALL)), from_user=True)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None  # cumulative average
    gen = torch.Generator().manual_seed(seed + 50)
    model.train()
    with torch.no_grad():
        for _ in range(8):
            model(torch.randn(16, 1, 16, 16, generator=gen))
    return model.eval()


def _calibrated(model: nn.Module, qconfig: QConfig | None = None, mode: str = "fuse_bn") -> nn.Module:
    cal = prepare(model, qconfig or QConfig(), mode=mode, example_inputs=_images(4, 1))
    calibrate(cal, [_images(8, s) for s in (30, 31, 32, 33)])
    return cal


@pytest.fixture(scope="module")
def realistic():
    fp = _realistic_resnet()
    return fp, _calibrated(fp), [_images(8, 40), _images(8, 41)]


def test_clean_int8_model_is_not_flagged(realistic):
    fp, cal, batches = realistic
    result = compare([("float", fp), ("calibrated", cal)], batches)
    assert result.meta["flagged"] == 0, result.flagged()[["layer", "diagnosis"]]
    assert "nothing flagged" in result.summary and result.meta["findings"]["calibrated"]["flagged"] == 0


@pytest.mark.parametrize("point, factor", [("layer1.0.relu", 12.0), ("layer2.0.bn2", 8.0), ("layer2.0.relu", 20.0)])
def test_planted_too_small_scale_is_the_first_row_flagged_as_clipping(realistic, point, factor):
    fp, cal, batches = realistic
    clip = copy.deepcopy(cal)
    target = quant_points(clip)[point]
    with torch.no_grad():
        target.scale /= factor
    result = compare([("float", fp), ("clip", clip)], batches)
    first = _first_flagged(result)
    assert first is not None and first["layer"] == point and first["diagnosis"] == "clipping", result.flagged()
    found = result.meta["findings"]["clip"]
    assert found["at_fault"] == point and found["at_fault_diagnosis"] == "clipping", found
    assert f"  at fault:      {point} (clipping)" in result.summary.splitlines()
    # saturation by hand: the share of the values the point received that lie more than half a
    # step beyond either end of the shrunk grid (the module's float output, before the point)
    module = clip.get_submodule(point.split("#")[0])
    inputs = _inputs(clip, module, batches)
    if isinstance(module, nn.ReLU):
        inputs = [torch.relu(t) for t in inputs[::2]]  # the shared ReLU: its first call of each forward
    raw = torch.cat(inputs).double()
    v = raw / float(target.scale) + int(target.zero_point)
    clipped = (v > target.spec.qmax + 0.5) | (v < target.spec.qmin - 0.5)
    assert _rows(result)[point]["saturation"] == pytest.approx(float(clipped.double().mean()), rel=1e-9)
    assert _rows(result)[point]["saturation"] > 0.05


@pytest.mark.parametrize("point", ["layer1.0.bn2", "layer2.0.bn2"])
def test_planted_int4_layer_is_flagged_rounding(realistic, point):
    fp, _, batches = realistic
    int4 = _calibrated(fp, QConfig(overrides={point: {"activation": {"bits": 4}}}))
    assert quant_points(int4)[point].spec.bits == 4
    result = compare([("float", fp), ("int4", int4)], batches)
    row = _rows(result)[point]
    assert row["diagnosis"] == "rounding", row
    assert row["isolated_sqnr_db"] < 25 and row["saturation"] < 0.01
    first = _first_flagged(result)
    assert first["layer"] == point


@pytest.mark.parametrize("block", ["layer1.0", "layer2.0"])
def test_planted_outlier_channel_is_flagged_outlier_channels(realistic, block):
    fp, _, batches = realistic
    outlier = copy.deepcopy(fp)
    k = 3
    bn1, conv2 = outlier.get_submodule(f"{block}.bn1"), outlier.get_submodule(f"{block}.conv2")
    with torch.no_grad():
        bn1.weight[k] *= 64  # channel k of bn1 (and of the ReLU after it) x64 ...
        bn1.bias[k] *= 64
        conv2.weight[:, k] /= 64  # ... and conv2 reads it /64: the float function is unchanged
        for b in batches:
            assert torch.allclose(outlier(b), fp(b), rtol=1e-5, atol=1e-6)
    cal = _calibrated(outlier)  # default: per-tensor activations
    assert not quant_points(cal)[f"{block}.relu"].spec.per_channel
    result = compare([("float", outlier), ("calibrated", cal)], batches)
    first = _first_flagged(result)
    assert first is not None and first["layer"] == f"{block}.relu", result.flagged()
    assert first["diagnosis"] == "outlier_channels"
    assert first["channel_range_ratio"] > 8
    assert result.meta["findings"]["calibrated"]["outlier_layers"] == [f"{block}.relu"]  # what qdebug fix may mend
    # the same layer in the unmodified model is fine
    clean_result = compare([("float", fp), ("calibrated", realistic[1])], batches)
    clean = _rows(clean_result)[f"{block}.relu"]
    assert clean["diagnosis"] == "" and clean["channel_range_ratio"] < 8
    assert "outlier_layers" not in clean_result.meta["findings"]["calibrated"]


def test_planted_nan_weight_shows_as_nonfinite_where_it_starts(realistic):
    fp, cal, batches = realistic
    nan_float = copy.deepcopy(fp)
    with torch.no_grad():
        nan_float.get_submodule("layer2.0.conv1").weight[0, 0, 0, 0] = float("nan")
    result = compare([("float", fp), ("nan", nan_float)], batches)
    first = _first_flagged(result)
    assert first["layer"] == "layer2.0.conv1" and first["diagnosis"] == "nonfinite"
    produced = torch.cat(_outputs(nan_float, nan_float.get_submodule("layer2.0.conv1"), batches))
    assert first["nonfinite"] == int(torch.isnan(produced).sum()) > 0
    assert math.isnan(first["sqnr_db"]) and math.isnan(first["min_channel_sqnr_db"])
    rows = _rows(result)
    for layer in LAYERS[: LAYERS.index("layer2.0.conv1")]:
        assert rows[layer]["sqnr_db"] == math.inf and rows[layer]["diagnosis"] == "", layer
    assert rows["fc"]["diagnosis"] == "nonfinite"
    assert result.meta["findings"]["nan"]["at_fault_diagnosis"] == "nonfinite"
    assert "qdebug inspect" in result.summary  # a command that exists

    # the same NaN in a calibrated (BN-folded) model: the conv is listed, compared at its BN
    nan_cal = copy.deepcopy(cal)
    with torch.no_grad():
        nan_cal.get_submodule("layer2.0.conv1").weight[0, 0, 0, 0] = float("nan")
    result = compare([("float", fp), ("nan", nan_cal)], batches)
    rows = _rows(result)
    assert "BN folded" in rows["layer2.0.conv1"]["note"]
    first = _first_flagged(result)
    assert first["layer"] == "layer2.0.bn1" and first["diagnosis"] == "nonfinite" and first["nonfinite"] > 0


# -- two errors per layer ------------------------------------------------------------------------
def test_propagated_and_isolated_errors(realistic):
    """Only layer1.0.bn2's activation is quantized (int4): its own error is large; every layer
    after it inherits the error (low propagated SQNR) but adds none (high isolated SQNR)."""
    fp, _, batches = realistic
    point = "layer1.0.bn2"
    model = _calibrated(fp, QConfig(overrides={point: {"activation": {"bits": 4}}}))
    set_mode(model, "float")
    set_mode(model, "fake", point, kind="activation")
    assert [n for n, p in quant_points(model).items() if p.mode == "fake"] == [point]
    result = compare([("float", fp), ("int4", model)], batches)
    rows = _rows(result)
    at = LAYERS.index(point)
    # the layer's own error, by hand: the float BN output on the int4 grid
    ref = torch.cat(_outputs(fp, fp.get_submodule(point), batches))
    by_hand = _sqnr(ref, _fake_quant(ref, quant_points(model)[point]))
    assert rows[point]["isolated_sqnr_db"] == pytest.approx(by_hand, rel=1e-3)
    assert rows[point]["sqnr_db"] == pytest.approx(by_hand, rel=1e-3)  # nothing upstream is quantized
    assert rows[point]["isolated_sqnr_db"] < 25 and rows[point]["diagnosis"] == "rounding"
    for layer in LAYERS[:at]:
        assert rows[layer]["note"] != "" or rows[layer]["sqnr_db"] > 100, layer  # float-exact upstream
        assert rows[layer]["diagnosis"] == "", layer
    downstream = [rows[layer] for layer in LAYERS[at + 1:] if rows[layer]["note"] == ""]
    assert len(downstream) >= 8
    for row in downstream:
        assert row["isolated_sqnr_db"] > 100, row["layer"]  # float layers: no own error
        assert row["diagnosis"] in ("propagated", ""), row["layer"]
    propagated = [row for row in downstream if row["diagnosis"] == "propagated"]
    assert len(propagated) >= 6 and all(row["sqnr_db"] < 20 for row in propagated)
    assert _first_flagged(result)["layer"] == point
    assert result.meta["findings"]["int4"]["at_fault"] == point
    assert f"  at fault:      {point} (rounding)" in result.summary.splitlines()


# -- streaming -------------------------------------------------------------------------------------
RATIO_METRICS = [m for m in METRICS if m != "nonfinite"]


def test_statistics_stream_without_keeping_batches(realistic, monkeypatch):
    fp, cal, batches = realistic
    made: list[ErrorStats] = []

    class Recording(ErrorStats):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(compare_module, "ErrorStats", Recording)
    batch = _images(8, 42)
    ref = weakref.ref(batch)
    once = compare([("float", fp), ("calibrated", cal)], [batch])
    used_once = [m for m in made if m.n > 0]
    # at most a (propagated, isolated) pair of accumulators per measured layer
    measured = int((once.frame["note"] == "").sum())
    assert measured < len(used_once) <= 2 * measured
    made.clear()
    many = compare([("float", fp), ("calibrated", cal)], [batch] * 5)
    used_many = [m for m in made if m.n > 0]
    assert len(used_many) == len(used_once)  # per layer, not per batch
    assert sorted(m.n for m in used_many) == sorted(5 * m.n for m in used_once)
    for stats in made:
        for name, value in vars(stats).items():
            if isinstance(value, torch.Tensor):
                assert value.dim() == 1, name  # per-channel vectors only
            else:
                assert isinstance(value, (int, float, str, bool, type(None))) or value == {}, name
    assert many.meta["batches"] == 5
    # ratio metrics of one batch repeated equal those of the batch once
    for (_, a), (_, b) in zip(once.frame.iterrows(), many.frame.iterrows()):
        assert a["layer"] == b["layer"]
        for metric in RATIO_METRICS:
            if math.isnan(a[metric]):
                assert math.isnan(b[metric]), (a["layer"], metric)
            else:
                assert b[metric] == pytest.approx(a[metric], rel=1e-9), (a["layer"], metric)
    # the result keeps small samples only, and nothing refers to the batch afterwards
    assert all(x.numel() <= compare_module.HISTOGRAM_SAMPLES for pair in many.samples.values() for x in pair)
    del batch
    assert ref() is None


# -- the CLI -----------------------------------------------------------------------------------------
def test_cli_writes_csv_json_and_plots(cli, tmp_path, stages):
    result = cli("compare", stages.float, stages.calibrated, stages.qat, "--data", stages.data, "--out", "cmp")
    assert result.code == 0, result.err
    assert "cmp/compare.csv" in result.err and "wrote" in result.err  # stderr: stdout is the table
    out = tmp_path / "cmp"
    payload = json.loads((out / "compare.json").read_text())
    assert set(payload) == {"meta", "rows"}
    assert payload["meta"]["reference"] == "float" and payload["meta"]["targets"] == ["calibrated", "qat"]
    assert payload["meta"]["checkpoints"]["qat"] == str(stages.qat)
    assert len(payload["rows"]) == 2 * len(LAYERS)
    for row in payload["rows"]:
        assert {"layer", "type", "target", "diagnosis", *METRICS} <= set(row)
    with open(out / "compare.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    assert [r["layer"] for r in table] == [r["layer"] for r in payload["rows"]]
    assert {"layer", "type", "target", "sqnr_db", "diagnosis"} <= set(table[0])
    for png in ("compare_along_network.png", "compare_worst_histograms.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_cli_json_and_csv_to_stdout(cli, stages):
    result = cli("compare", stages.float, stages.qat, "--data", stages.data, "--format", "json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    assert [r["layer"] for r in payload["rows"]] == LAYERS
    assert all(r["target"] == "qat" for r in payload["rows"])
    result = cli("compare", stages.float, stages.qat, "--data", stages.data, "--format", "csv")
    assert result.code == 0, result.err
    table = list(csv.DictReader(io.StringIO(result.out)))
    assert [r["layer"] for r in table] == LAYERS and "sqnr_db" in table[0]
    cli("compare", stages.float, stages.qat, "--format", "xml").assert_error("--format 'xml'")


def _kl_by_hand(x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean over positions of sum_c p log(p / q), softmax over axis 1, in float64."""
    log_p, log_q = torch.log_softmax(x.double(), 1), torch.log_softmax(y.double(), 1)
    per_position = (log_p.exp() * (log_p - log_q)).sum(1)
    return float(per_position.mean())


def test_kl_for_logits_always_and_for_feature_maps_on_request(stages, stage_batches):
    fp, cal = stages.models["float"], stages.models["calibrated"]
    default = _rows(compare([("float", fp), ("calibrated", cal)], stage_batches))
    asked = compare([("float", fp), ("calibrated", cal)], stage_batches, kl_feature_maps=True)
    assert asked.meta["kl_feature_maps"] is True
    asked_rows = _rows(asked)
    with torch.no_grad():
        logits = [torch.cat([m(b) for b in stage_batches]) for m in (fp, cal)]
    # [N, C] logits: computed either way, equal to the float64 formula
    for rows in (default, asked_rows):
        assert rows["fc"]["kl"] == pytest.approx(_kl_by_hand(*logits), rel=1e-4)
    # a feature map: NaN (not computed) by default, the hand value when asked
    fp_maps = _outputs(fp, fp.layer1[0].bn2, stage_batches)
    # bn2 is folded into conv2 in this model; its placeholder returns the quantized map
    cal_maps = _outputs(cal, cal.get_submodule("layer1.0.bn2"), stage_batches)
    assert math.isnan(default["layer1.0.bn2"]["kl"])
    expected = _kl_by_hand(torch.cat(fp_maps), torch.cat(cal_maps))
    assert expected > 0
    assert asked_rows["layer1.0.bn2"]["kl"] == pytest.approx(expected, rel=1e-4)
    # the other metrics do not depend on it
    for metric in ("sqnr_db", "cosine", "isolated_sqnr_db", "min_channel_sqnr_db"):
        assert asked_rows["layer1.0.bn2"][metric] == default["layer1.0.bn2"][metric]


def test_cli_metrics_kl_and_all(cli, stages):
    base = ("compare", stages.float, stages.qat, "--data", stages.data, "--format", "json")
    plain = json.loads(cli(*base).out)
    with_kl = cli(*base, "--metrics", "sqnr_db,kl")
    assert with_kl.code == 0, with_kl.err
    payload = json.loads(with_kl.out)
    assert plain["meta"]["kl_feature_maps"] is False and payload["meta"]["kl_feature_maps"] is True
    plain_rows = {r["layer"]: r for r in plain["rows"]}
    rows = {r["layer"]: r for r in payload["rows"]}
    assert plain_rows["layer1.0.relu"]["kl"] is None  # NaN in JSON is null
    assert rows["layer1.0.relu"]["kl"] >= 0
    assert plain_rows["fc"]["kl"] == pytest.approx(rows["fc"]["kl"], rel=1e-12)
    table = cli("compare", stages.float, stages.qat, "--data", stages.data, "--metrics", "all", "--wide")
    assert table.code == 0, table.err
    assert header_cells(table.out) == ["layer", *METRICS, "diagnosis", "note", "type"]  # the names options use


def test_cli_metrics_threshold_sort_top(cli, stages):
    base = ("compare", stages.float, stages.qat, "--data", stages.data)
    result = cli(*base, "--metrics", "cosine,sqnr_db", "--wide")
    assert result.code == 0, result.err
    assert header_cells(result.out) == ["layer", "cosine", "sqnr_db", "diagnosis", "note", "type"]
    cli(*base, "--metrics", "cosine,snr").assert_error("unknown metric(s): snr")

    default = json.loads(cli(*base, "--format", "json").out)["meta"]["flagged"]
    strict = json.loads(cli(*base, "--format", "json", "--threshold", "sqnr_db=60").out)
    assert strict["meta"]["thresholds"]["sqnr_db"] == 60
    assert strict["meta"]["flagged"] > default
    strict_rows = {r["layer"]: r for r in strict["rows"]}
    assert all(r["diagnosis"] != "" for r in strict_rows.values() if r["note"] == "" and r["layer"] != "input"
               and isinstance(r["sqnr_db"], float) and r["sqnr_db"] < 60)
    cli(*base, "--threshold", "sqnr_db").assert_error("METRIC=VALUE")

    result = cli(*base, "--sort", "sqnr_db", "--top", "3")
    assert result.code == 0, result.err
    rows = body_rows(result.out)
    assert len(rows) == 3
    measured = [r for r in strict["rows"] if r["note"] == ""]
    worst = sorted(measured, key=lambda r: r["sqnr_db"])[:3]
    assert [row[0] for row in rows] == [r["layer"] for r in worst]


def test_cli_ref_by_label(cli, stages):
    result = cli("compare", stages.float, stages.calibrated, stages.qat, "--data", stages.data, "--ref", "calibrated",
                 "--format", "json")
    assert result.code == 0, result.err
    meta = json.loads(result.out)["meta"]
    assert meta["reference"] == "calibrated" and meta["targets"] == ["float", "qat"]
    cli("compare", stages.float, stages.qat, "--ref", "quantized").assert_error("--ref 'quantized'")


def test_cli_paths_from_the_config(cli, tmp_path, stages):
    (tmp_path / "qdebug.toml").write_text(f'float = "{stages.float}"\nqat = "{stages.qat}"\ndata = "{stages.data}"\n')
    result = cli("compare", "--format", "json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    assert payload["meta"]["reference"] == "float" and payload["meta"]["targets"] == ["qat"]
    assert payload["meta"]["checkpoints"] == {"float": str(stages.float), "qat": str(stages.qat)}


def test_cli_different_architectures_is_one_error(cli, tmp_path, stages):
    torch.manual_seed(0)
    other = build(ModelSpec("qdebug.zoo.mobilenetv2:MobileNetV2", {
        "num_classes": 10, "in_channels": 1, "width_mult": 0.5, "setting": [[1, 8, 1, 1], [6, 16, 2, 2]],
        "stem_stride": 1, "last_channel": 32}), from_user=True).eval()
    qdebug.save(other, tmp_path / "other.pt", sample_inputs=stages.x)
    cli("compare", stages.float, "other.pt", "--data", stages.data).assert_error("same architecture")
    cli("compare", stages.float).assert_error("two or more checkpoints")


@pytest.mark.parametrize("args, fragment", [
    (("--ref", "5"), "index below 2"),
    (("--top", "0"), "--top must be >= 1"),
    (("--top", "-3"), "--top must be >= 1"),
    (("--batches", "0"), "--batches must be a whole number >= 1"),
    (("--batches", "-2"), "--batches must be a whole number >= 1"),
    (("--batch-size", "0"), "--batch-size must be a whole number >= 1"),
    (("--metrics", ","), "names no metric"),
    (("--threshold", "sqnr_db=abc"), "'abc' is not a number"),
    (("--format", "xml"), "is not one of table, json, csv"),
])
def test_cli_bad_options_are_one_error_with_a_hint(cli, stages, args, fragment):
    result = cli("compare", stages.float, stages.qat, *args)
    result.assert_error(fragment)  # exit 2, one error line, no traceback
    assert "\nhint: " in result.err


def test_cli_unwritable_out_fails_before_comparing(cli, tmp_path, stages):
    (tmp_path / "afile").write_text("x")
    # A directory under a regular file can never be created, whoever runs the test (root too).
    cli("compare", stages.float, stages.qat, "--out", "afile/sub").assert_error("cannot create output directory afile/sub")
    assert not (tmp_path / "afile" / "sub").exists()


def test_cli_help_has_an_example(cli):
    result = cli("compare", "--help")
    assert result.code == 0, result.err
    assert "Example:" in result.out and "qdebug compare" in result.out


class _InPlaceNet(nn.Module):
    """In-place ops everywhere a recorded reference value could be overwritten."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 16 * 16, 5)

    def forward(self, x):
        y = self.relu(self.conv1(x))
        z = self.conv2(y)
        z += y
        return self.fc(torch.relu_(z).flatten(1))


def test_in_place_ops_never_overwrite_recorded_reference_values():
    torch.manual_seed(0)
    fp = _InPlaceNet().eval()
    batches = [_images(3, 30), _images(3, 31)]
    cal = prepare(fp, QConfig(), example_inputs=batches[0])
    calibrate(cal, batches)
    twin = copy.deepcopy(cal)
    result = compare([("float", fp), ("a", cal), ("b", twin)], batches)
    a, b = _rows(result, "a"), _rows(result, "b")
    assert a.keys() == b.keys() and "conv1" in a and "relu" in a
    for layer in a:
        for metric in METRICS:
            x, y = a[layer][metric], b[layer][metric]
            assert (math.isnan(x) and math.isnan(y)) or x == y, (layer, metric)
    # conv1's reference output is the map before the in-place ReLU (it has negative values)
    fp_maps = torch.cat(_outputs(fp, fp.conv1, batches))
    cal_maps = torch.cat(_outputs(cal, cal.conv1, batches))
    assert (fp_maps < 0).any()
    assert a["conv1"]["sqnr_db"] == pytest.approx(_sqnr(fp_maps, cal_maps), rel=STATS_REL)


def test_compare_leaves_no_counting_switched_on(stages, stage_batches):
    fp, cal = stages.models["float"], stages.models["calibrated"]
    points = list(quant_points(cal).values())
    compare([("float", fp), ("calibrated", cal)], stage_batches)
    assert not any(p.count_clipped for p in points) and all(p.clipped is None for p in points)
    with pytest.raises(Exception):
        compare([("float", fp), ("calibrated", cal)], [torch.randn(2, 3, 5)])  # wrong input shape
    assert not any(p.count_clipped for p in points)


def _summary_frame(rows):
    base = {**{m: math.nan for m in METRICS}, "cosine": 0.999, "nonfinite": 0.0, "note": "", "target": "qat"}
    frame = pd.DataFrame([{**base, **row} for row in rows])
    frame["diagnosis"] = [compare_module.diagnose(r, compare_module.DEFAULT_THRESHOLDS) for r in frame.to_dict("records")]
    return compare_module.summarize(frame, compare_module.DEFAULT_THRESHOLDS, "float")


def test_summary_when_every_flagged_layer_only_inherits_its_error():
    text = _summary_frame([
        {"layer": "a", "sqnr_db": 30.0, "isolated_sqnr_db": 31.0},
        {"layer": "b", "sqnr_db": 18.0, "isolated_sqnr_db": 27.0},  # flagged, own error fine
        {"layer": "c", "sqnr_db": 15.0, "isolated_sqnr_db": 40.0},
    ])
    assert text.splitlines() == [
        "qat vs float: 2 of 3 layers flagged",
        "  worst layer:   b (18.0 dB; its own error 27.0 dB isolated)",  # c only inherits its 15 dB
        "  first flagged: b (propagated)",
        "  at fault:      no layer alone: the loss builds up over many layers",
    ]


def test_summary_names_the_first_layer_at_fault():
    text = _summary_frame([
        {"layer": "a", "sqnr_db": 19.0, "isolated_sqnr_db": 30.0},  # propagated
        {"layer": "b", "sqnr_db": 12.0, "isolated_sqnr_db": 14.0},  # rounding
    ])
    assert text.splitlines()[2:] == [
        "  first flagged: a (propagated)",
        "  at fault:      b (rounding)",
        "  cause:         range fine, steps too coarse: int16 (+48 dB; qdebug suggest)",
    ]
    assert all(len(line) <= 80 for line in text.splitlines())


def test_every_cause_line_fits_80_columns():
    for cause, advice in compare_module.ADVICE.items():
        line = f"  cause:         {advice.format(gain=6.02 * 8)}"
        assert len(line) <= 80, (cause, line)


def test_a_row_without_its_own_quantization_is_never_at_fault():
    """A BN whose ReLU6 holds the quant point carries the error it is handed: the ReLU6 (which
    quantizes) is at fault, not the BN, however the BN's row is flagged (issue 16)."""
    from qdebug.tools.compare import findings

    rows = [
        {"layer": "conv", "target": "q", "note": "", "sqnr_db": 40.0, "isolated_sqnr_db": 40.0, "diagnosis": ""},
        {"layer": "bn", "target": "q", "note": "", "sqnr_db": 12.0, "isolated_sqnr_db": 12.0,
         "diagnosis": "outlier_channels"},
        {"layer": "relu6", "target": "q", "note": "", "sqnr_db": 11.0, "isolated_sqnr_db": 14.0,
         "diagnosis": "outlier_channels"},
    ]
    frame = pd.DataFrame(rows)
    assert findings(frame)["q"]["at_fault"] == "bn"
    assert findings(frame, {"q": {"bn"}})["q"]["at_fault"] == "relu6"
    # The layers a float-side fix (qdebug fix) may keep int8: those whose own range is wide.
    assert findings(frame)["q"]["outlier_layers"] == ["bn", "relu6"]
    assert findings(frame, {"q": {"bn"}})["q"]["outlier_layers"] == ["relu6"]
    # A conv + BN (weights quantized) whose output point is its ReLU6's: an activation range
    # problem there is the ReLU6's; rounding would be its own.
    assert findings(frame, {}, {"q": {"bn"}})["q"]["at_fault"] == "relu6"
    frame.loc[1, "diagnosis"] = "rounding"
    assert findings(frame, {}, {"q": {"bn"}})["q"]["at_fault"] == "bn"


def test_unquantized_calls_are_the_ones_with_neither_output_nor_weight_point(make_resnet, images):
    from qdebug.tools.compare import _unquantized_calls

    qm = prepare(make_resnet(), QConfig(), mode="with_bn", example_inputs=images())
    calls = _unquantized_calls(qm)
    assert "bn1" in calls and "layer1.0.bn1" in calls  # each BN's point is its ReLU's
    assert "conv1" not in calls and "relu" not in calls and "fc" not in calls
    assert _unquantized_calls(make_resnet()) == set()
    # Folded, a BN's row stands for conv + BN: it carries the conv's weight point.
    folded = _unquantized_calls(prepare(make_resnet(), QConfig(), mode="fuse_bn", example_inputs=images()))
    assert "bn1" not in folded and "layer1.0.bn1" not in folded


def test_an_outlier_channel_at_fault_is_named_with_its_range_ratio():
    text = _summary_frame([
        {"layer": "a", "sqnr_db": 30.0, "isolated_sqnr_db": 31.0},
        {"layer": "b", "sqnr_db": 18.0, "isolated_sqnr_db": 19.0, "min_channel_sqnr_db": 5.0,
         "channel_range_ratio": 64.0, "widest_channel": 5},
    ])
    assert "  at fault:      b (outlier_channels: channel 5 spans 64x the median channel's range)" in text.splitlines()
    assert "equalize (CLE), then int16, per-channel last" in text


@pytest.mark.parametrize("typical, expected", [
    (7.0, "outlier_channels"),  # the layer's own quantization costs its median channel: a wide channel did it
    (40.0, "propagated"),  # healthy median (a few tiny channels round to 0): the low channel was inherited
    (None, "outlier_channels"),  # --no-isolated: only the propagated channels are known
])
def test_outlier_channels_need_the_typical_channel_hurt_by_the_layers_own_quantization(typical, expected):
    """EfficientNet-Lite0's ``_blocks.14._swish#2`` (a channel 15x the median, a few channels of
    near-zero values at 0 dB, median channel 38.7 dB isolated) was blamed on a healthy model."""
    row = {"sqnr_db": 18.0, "isolated_sqnr_db": None if typical is None else 44.0, "min_channel_sqnr_db": -10.0,
           "channel_range_ratio": 15.0, "isolated_median_channel_sqnr_db": typical, "nonfinite": 0.0}
    row = {k: (math.nan if v is None else v) for k, v in row.items()}
    assert compare_module.diagnose(row, compare_module.DEFAULT_THRESHOLDS) == expected


class _SameConv(nn.Conv2d):
    """TensorFlow's "SAME" padding (EfficientNet's): pad by what the stride leaves over, more
    at the bottom/right, then a valid convolution."""

    def forward(self, x):
        ih, iw = x.shape[-2:]
        (kh, kw), (sh, sw) = self.kernel_size, self.stride
        ph = max((-(-ih // sh) - 1) * sh + kh - ih, 0)
        pw = max((-(-iw // sw) - 1) * sw + kw - iw, 0)
        x = nn.functional.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])
        return nn.functional.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class _MBBlock(nn.Module):
    """EfficientNet-Lite's block: 1x1 expand, BN, ReLU6, depthwise SAME, BN, ReLU6, 1x1 project, BN."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        mid = cin * 4
        self._expand_conv, self._bn0 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self._depthwise_conv = _SameConv(mid, mid, 3, stride=stride, groups=mid, bias=False)
        self._bn1 = nn.BatchNorm2d(mid)
        self._project_conv, self._bn2 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu6 = nn.ReLU6()

    def forward(self, x):
        y = self.relu6(self._bn0(self._expand_conv(x)))
        y = self._bn2(self._project_conv(self.relu6(self._bn1(self._depthwise_conv(y)))))
        return y + x if y.shape == x.shape else y


class _EfficientNetLike(nn.Module):
    def __init__(self):
        super().__init__()
        self._conv_stem, self._bn0 = _SameConv(3, 16, 3, stride=2, bias=False), nn.BatchNorm2d(16)
        self.relu6 = nn.ReLU6()
        self._blocks = nn.ModuleList([_MBBlock(16, 24), _MBBlock(24, 24, stride=2), _MBBlock(24, 24)])
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        x = self.relu6(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


def test_a_planted_outlier_channel_in_an_efficientnet_like_model_is_named_and_nothing_else_blamed():
    """Channel 5 of ``_blocks.0._bn2`` x64, compensated exactly by ``_blocks.1._expand_conv``'s
    input channel 5 / 64 (the float function is unchanged): the summary blames that BN, names
    the channel, and its worst own error is the compensating layer's."""
    torch.manual_seed(0)
    model = _EfficientNetLike().train()
    with torch.no_grad():
        for _ in range(4):  # BN statistics
            model(torch.randn(8, 3, 32, 32))
    model.eval()
    x = torch.randn(8, 3, 32, 32)
    with torch.no_grad():
        before = model(x)
        bn = model._blocks[0]._bn2
        bn.weight[5] *= 64
        bn.bias[5] *= 64
        model._blocks[1]._expand_conv.weight[:, 5] /= 64
        torch.testing.assert_close(model(x), before, rtol=1e-4, atol=1e-5)
    calibration = [torch.randn(8, 3, 32, 32) for _ in range(4)]
    with warnings.catch_warnings():  # prepare names any op it runs in float: not what this test is about
        warnings.simplefilter("ignore")
        qm = prepare(model, QConfig(), mode="fuse_bn", example_inputs=calibration[0])
    calibrate(qm, calibration)
    result = compare([("float", model), ("calibrated", qm)], [torch.randn(8, 3, 32, 32) for _ in range(2)])
    found = result.meta["findings"]["calibrated"]
    assert (found["at_fault"], found["at_fault_diagnosis"], found["outlier_channel"]) == \
        ("_blocks.0._bn2", "outlier_channels", 5)
    assert 40 < found["channel_range_ratio"] < 100
    rows = result.frame.set_index("layer")
    assert rows.loc["_blocks.0._bn2", "isolated_median_channel_sqnr_db"] < 25  # the typical channel pays
    assert found["worst_layer"] == "_blocks.1._bn0"  # the expand conv (BN folded in) with the tiny weights
    assert "channel 5 spans" in result.summary
    # The consequence downstream: the weights that compensate the channel underflow at int8.
    assert found["downstream_layer"] == "_blocks.1._expand_conv"
    assert found["downstream_zero_codes"] > 0.2 and found["downstream_zero_codes_elsewhere"] < 0.05
    assert "consequence:   _blocks.1._expand_conv: " in result.summary


# -- is the reference the target's float model? (issue 29 item 8) ------------------------------
def _engine_qat(fp: nn.Module, *, steps: int, lr: float, freeze_bn: bool, input_scale: float) -> nn.Module:
    """The float model prepared with its BNs kept (``with_bn``), calibrated, then QAT steps of the
    engine: weights, scales and (unless frozen) BN statistics move; ``input_scale`` makes the
    training data's statistics other than the float model's (data its BN statistics were not
    measured on)."""
    from qdebug.engine.fusebn import freeze_bn_stats

    qat = _calibrated(fp, mode="with_bn").train()
    if freeze_bn:
        freeze_bn_stats(qat)
    gen = torch.Generator().manual_seed(7)
    opt = torch.optim.SGD([p for p in qat.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        x = input_scale * torch.randn(8, 1, 16, 16, generator=gen)
        loss = nn.functional.cross_entropy(qat(x), torch.randint(0, 10, (8,), generator=gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return qat.eval()


def _sqnr_by_hand(model_a: nn.Module, model_b: nn.Module, batches) -> float:
    signal = noise = 0.0
    with torch.no_grad():
        for x in batches:
            a, b = model_a(x).double(), model_b(x).double()
            signal += float((a * a).sum())
            noise += float(((a - b) ** 2).sum())
    return 10 * math.log10(signal / noise)


@pytest.fixture(scope="module")
def drifted_and_healthy(tmp_path_factory, realistic):
    fp, _, batches = realistic
    d = tmp_path_factory.mktemp("reference_check")
    drifted = _engine_qat(fp, steps=6, lr=0.05, freeze_bn=False, input_scale=3.0)
    healthy = _engine_qat(fp, steps=6, lr=1e-3, freeze_bn=True, input_scale=1.0)
    qdebug.save(fp, d / "float.pt", stage="float", sample_inputs=batches[0])
    for name, model in (("drifted", drifted), ("healthy", healthy)):
        qdebug.save(model, d / f"{name}.pt", stage="qat", sample_inputs=batches[0])
    torch.save(torch.cat(batches), d / "eval.pt")
    return d, fp, drifted, healthy, batches


def test_compare_says_first_when_the_targets_float_model_differs(cli, drifted_and_healthy):
    """QAT with BN statistics updating on other data: the checkpoint's own float model is not
    float.pt.  compare measures that (every point off, against the reference) and says it
    before anything else, in the title, the summary and JSON; its rows blame no rounding."""
    d, fp, drifted, _, batches = drifted_and_healthy
    off = copy.deepcopy(drifted)
    set_mode(off, "float")
    expected_off, expected_whole = _sqnr_by_hand(fp, off, batches), _sqnr_by_hand(fp, drifted, batches)
    assert expected_off < 20 and expected_off < expected_whole + 3  # the scenario is what it should be

    result = cli("compare", d / "float.pt", d / "drifted.pt", "--data", d / "eval.pt", "--batch-size", 8,
                 "--format", "json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    check = payload["meta"]["reference_check"]["qat"]
    assert check["measured"] and check["float_differs"]
    assert check["quantization_off_sqnr_db"] == pytest.approx(expected_off, abs=1e-3)
    assert check["output_sqnr_db"] == pytest.approx(expected_whole, abs=1e-3)
    assert payload["meta"]["findings"]["qat"]["float_differs"] == check
    diagnoses = [r["diagnosis"] for r in payload["rows"]]
    assert "float_differs" in diagnoses and "rounding" not in diagnoses and "propagated" not in diagnoses
    summary = payload["meta"]["summary"].splitlines()
    assert summary[0] == "warning: qat's float model differs from float: not quantization"
    assert summary[1] == (f"  quantization off: {expected_off:.1f} dB vs float "
                          f"({expected_whole:.1f} dB quantized); rows float_differs")
    assert "suggest" not in payload["meta"]["next"]  # no int16 plan for a float difference

    table = cli("compare", d / "float.pt", d / "drifted.pt", "--data", d / "eval.pt", "--batch-size", 8)
    assert table.code == 0, table.err
    assert "qat: float model differs from float" in table.out.splitlines()[0] + table.out
    assert "drift_" in table.out.splitlines()[1]  # its drift beside the errors, in the default table
    # What is at fault now is quantization's own: a range measured against the target's own float
    # run (its avgpool clips 5% of its own float values), never a rounding its drift explains.
    at_fault = payload["meta"]["findings"]["qat"]["at_fault"]
    if at_fault is None:
        assert "at fault:      no layer: the float model differs, not quantization" in table.out
    else:
        row = next(r for r in payload["rows"] if r["layer"] == at_fault)
        assert row["diagnosis"] == "clipping" and row["saturation"] > 0.01 and row["isolated_sqnr_db"] < 25
    assert "  drifted most:  layer2.0.downsample.1 (4.5 dB; BN statistics not frozen?)" in summary
    assert max(len(line) for line in summary) <= 80


def test_drift_is_measured_per_layer_and_isolated_errors_against_the_targets_own_float_model(drifted_and_healthy):
    """Item 6 of issue 30: per layer, ``drift_sqnr_db`` is the target's float model (every point
    off) against the reference -- here by forward hooks on both models; its isolated errors are
    quantization's own: those of a compare whose reference *is* that float model."""
    from small_models import module_io

    _, fp, drifted, _, batches = drifted_and_healthy
    result = compare([("float", fp), ("qat", drifted)], batches)
    rows = result.frame.set_index("layer")
    off = copy.deepcopy(drifted)
    set_mode(off, "float")
    names = ["conv1", "layer1.0.conv2", "layer2.0.downsample.0", "fc"]
    sums = {n: [0.0, 0.0] for n in names}
    for x in batches:
        want, have = module_io(fp, names, x), module_io(off, names, x)
        for n in names:
            a, b = want[n][1].double(), have[n][1].double()
            sums[n][0] += float((a * a).sum())
            sums[n][1] += float(((a - b) ** 2).sum())
    for n in names:
        assert rows.loc[n, "drift_sqnr_db"] == pytest.approx(10 * math.log10(sums[n][0] / sums[n][1]), abs=1e-3), n
    own = compare([("own", off), ("qat", drifted)], batches).frame.set_index("layer")
    for n in names + ["layer1.0.relu", "avgpool"]:
        assert rows.loc[n, "isolated_sqnr_db"] == pytest.approx(own.loc[n, "isolated_sqnr_db"], abs=1e-6), n
        assert math.isnan(own.loc[n, "drift_sqnr_db"])  # a reference with points: no drift measured
    assert result.meta["findings"]["qat"]["worst_drift_layer"] == rows["drift_sqnr_db"].idxmin()
    drifted = int((result.frame["diagnosis"] == "float_differs").sum())
    assert drifted and f"layers flagged ({drifted} float_differs: drift)" in result.summary


def test_a_calibrated_model_with_folded_bn_runs_no_float_pass(realistic, monkeypatch):
    """BN folding changes a calibrated model's weights by float rounding only: one first-batch
    check settles it (no drift column, isolated errors against the reference, as before)."""
    fp, cal, batches = realistic
    runs = []
    monkeypatch.setattr(compare_module, "_own_float_run",
                        lambda *a: runs.append(a[2]) or None)
    result = compare([("float", fp), ("calibrated", cal)], batches)
    check = result.meta["reference_check"]["calibrated"]
    assert check["measured"] and check["quantization_off_sqnr_db"] >= 60 and not check["float_differs"]
    assert runs == [None] * len(batches) and result.frame["drift_sqnr_db"].isna().all()


def test_a_healthy_qat_checkpoint_gets_no_float_differs_warning(cli, drifted_and_healthy):
    """QAT with BN statistics frozen and a small learning rate: its float model is still float.pt
    (within what training moved), so no warning -- nor for a calibrated checkpoint."""
    d, fp, _, healthy, batches = drifted_and_healthy
    off = copy.deepcopy(healthy)
    set_mode(off, "float")
    result = cli("compare", d / "float.pt", d / "healthy.pt", "--data", d / "eval.pt", "--batch-size", 8,
                 "--format", "json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    check = payload["meta"]["reference_check"]["qat"]
    assert check["measured"] and not check["float_differs"]
    assert check["quantization_off_sqnr_db"] == pytest.approx(_sqnr_by_hand(fp, off, batches), abs=1e-3)
    assert check["quantization_off_sqnr_db"] >= 30  # far above the 20 dB it takes
    assert "float_differs" not in {r["diagnosis"] for r in payload["rows"]}
    assert "warning" not in payload["meta"]["summary"] and "float_differs" not in payload["meta"]["findings"]["qat"]


def test_the_reference_check_is_skipped_where_it_cannot_measure(realistic):
    fp, cal, batches = realistic
    other = _engine_qat(fp, steps=1, lr=1e-3, freeze_bn=True, input_scale=1.0)
    result = compare([("calibrated", cal), ("qat", other)], batches[:1])  # a quantized reference
    assert result.meta["reference_check"]["qat"] == {"measured": False, "reason": "the reference is quantized itself"}
    # A float target with other weights: its float model is itself, and differs.
    other_float = _realistic_resnet(seed=5)
    found = compare([("float", fp), ("other", other_float)], batches[:1]).meta["reference_check"]["other"]
    assert found["measured"] and found["float_differs"]
    assert found["quantization_off_sqnr_db"] == found["output_sqnr_db"]
    # A calibrated model that kept its BN holds the reference's tensors: nothing to measure, no forward spent.
    kept = _calibrated(fp, mode="with_bn_reverse_fold")
    found = compare([("float", fp), ("kept", kept)], batches[:1]).meta["reference_check"]["kept"]
    assert found == {"measured": False, "reason": "its float weights and BN statistics are the reference's"}
    # ... unless a tensor differs (a BN statistic moved by a train-mode forward)
    with torch.no_grad():
        kept.train()(batches[1])
    found = compare([("float", fp), ("kept", kept.eval())], batches[:1]).meta["reference_check"]["kept"]
    assert found["measured"]


def test_the_float_differs_warning_follows_the_sqnr_db_threshold(drifted_and_healthy):
    """The float difference is blamed only where it alone would be flagged: below ``sqnr_db``."""
    _, fp, drifted, _, batches = drifted_and_healthy
    default = compare([("float", fp), ("qat", drifted)], batches).meta["reference_check"]["qat"]
    below = default["quantization_off_sqnr_db"] - 0.5
    lowered = compare([("float", fp), ("qat", drifted)], batches, thresholds={"sqnr_db": below})
    check = lowered.meta["reference_check"]["qat"]
    assert default["float_differs"] and check["measured"] and not check["float_differs"]
    assert "warning" not in lowered.summary
    # per layer too: a row is float_differs only where its own drift is below the threshold
    differs = lowered.frame[lowered.frame["diagnosis"] == "float_differs"]
    assert (differs["drift_sqnr_db"] < below).all()
    assert (differs["drift_sqnr_db"] < differs["sqnr_db"] + 3).all()
