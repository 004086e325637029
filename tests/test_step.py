"""``step`` and the experiment primitive under it: planted defects found, the cached float
prefix bit-identical to full reruns, costs counted by hand, bad input answered in one line."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn as nn

import qdebug
from each_point_alone import sqnr_of_each_point_alone
from qdebug.data.batch import Batch
from qdebug.engine import QConfig, calibrate, convert, prepare, quant_points, refresh_weight_qparams
from qdebug.engine.context import run_model
from qdebug.engine.observers import make_observer
from qdebug.engine.point import grid_of
from qdebug.errors import QDebugError
from qdebug.measure.tap import Capture, tap
from qdebug.tools.experiment import Experiment, Trial
from qdebug.tools.step import Units, step

from tables import body_rows, header_cells, table_lines


def header_index(out: str, name: str) -> int:
    return header_cells(out).index(name)

DEFECT = "layer2.0.relu"  # the first block's ReLU output of stage 2 (small ResNet)


def _calibrated(make_resnet, images, mode="fuse_bn"):
    model = prepare(make_resnet(0), QConfig(), mode=mode, example_inputs=images(4, seed=1))
    return calibrate(model, [images(16, seed=s) for s in (10, 11)])


def _plant_small_scale(model, name=DEFECT, factor=10.0):
    point = quant_points(model)[name]
    point.set_qparams(point.scale / factor, point.zero_point)
    return model


def _plant_int2_weights(model, layer="layer1.0.conv2"):
    point = quant_points(model)[f"{layer}.weight"]
    point.spec = dataclasses.replace(point.spec, bits=2)
    point.observer = make_observer(point.spec)
    refresh_weight_qparams(model)
    return model


def _labelled(float_model, images, n=48, batch=16, seed=20):
    """Batches whose targets are the float model's own predictions: float top1 = 1.0."""
    out = []
    for i in range(n // batch):
        x = images(batch, seed=seed + i)
        with torch.no_grad():
            out.append(Batch(x, float_model(x).argmax(-1)))
    return out


@pytest.fixture(scope="module")
def defect(make_resnet, images):
    float_model = make_resnet(0)
    model = _plant_small_scale(_calibrated(make_resnet, images))
    return float_model, model, _labelled(float_model, images)


# -- the experiment primitive ----------------------------------------------------------------
def _full_run(model, quantized, x):
    loaded = {n: p.mode for n, p in quant_points(model).items()}
    try:
        for name, point in quant_points(model).items():
            point.mode = loaded[name] if name in quantized else "float"
        with torch.no_grad():
            return run_model(model.eval(), x)
    finally:
        for name, point in quant_points(model).items():
            point.mode = loaded[name]


def _shufflenet(images):
    from qdebug.io.modelspec import ModelSpec, build

    from small_models import SMALL_SHUFFLENETV2

    torch.manual_seed(0)
    model = build(ModelSpec("qdebug.zoo.shufflenetv2:ShuffleNetV2", SMALL_SHUFFLENETV2), from_user=True).eval()
    model = prepare(model, QConfig(), mode="fuse_bn", example_inputs=images(4, seed=1))
    return calibrate(model, [images(16, seed=s) for s in (10, 11)])


@pytest.mark.parametrize("stage", ["fuse_bn", "with_bn", "quantized", "maxpool_stem", "shufflenet"])
def test_cached_prefix_is_bit_identical_to_full_reruns(make_resnet, images, monkeypatch, stage):
    if stage == "shufflenet":  # channel shuffle, split, cat; a max-pool stem
        model = _shufflenet(images)
    elif stage == "maxpool_stem":
        model = prepare(make_resnet(0, stem="imagenet"), QConfig(), example_inputs=images(4, seed=1))
        model = calibrate(model, [images(16, seed=s) for s in (10, 11)])
    else:
        model = _calibrated(make_resnet, images, "with_bn" if stage == "with_bn" else "fuse_bn")
    if stage == "quantized":
        model = convert(model)
    points = list(quant_points(model))
    units = Units(model, points)
    groups = units.group(points, 2)
    trials = [Trial(frozenset(names), {"unit": unit}) for unit, names in groups.items()]
    grown: list[str] = []
    for names in groups.values():  # cumulative trials resume from the previous trial's run
        grown += names
        trials.append(Trial(frozenset(grown)))
    seen = []
    import qdebug.tools.experiment as experiment

    original = experiment._OutputStats.update
    monkeypatch.setattr(experiment._OutputStats, "update",
                        lambda self, ref, out: (seen.append(out["output"].clone()), original(self, ref, out))[1])
    batches = [images(6, seed=s) for s in (30, 31)]
    experiment = Experiment(model, batches)
    results = experiment.run(trials)
    assert sum(r.served_calls for r in results) > 0  # the prefix was served, not recomputed
    if stage in ("maxpool_stem", "shufflenet"):
        assert "maxpool" in experiment.call_order  # a passthrough module is recorded, so served too
    assert len(seen) == len(batches) * len(trials)
    for b, x in enumerate(batches):
        for k, trial in enumerate(trials):
            assert torch.equal(seen[b * len(trials) + k], _full_run(model, trial.quantized, x)), (b, k)
    # Every point is back in its loaded mode.
    assert all(p.mode == "fake" for p in quant_points(model).values())


def test_served_outputs_survive_in_place_consumers(make_resnet, images):
    # ReLU(inplace=True) writes the conv output it consumes: a served conv output must be a copy.
    model = _calibrated(make_resnet, images)
    for m in model.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = True
    x = images(6, seed=30)
    boundary = frozenset(n for n in quant_points(model) if n.startswith("layer1.0.relu"))
    results = Experiment(model, [x, x]).run([Trial(boundary), Trial(boundary)])
    expected = _full_run(model, boundary, x)
    assert results[0].outputs == results[1].outputs
    ref = _full_run(model, frozenset(), x).double()
    noise = float(((ref - expected.double()) ** 2).sum())
    assert results[0].outputs["output"]["sqnr_db"] == pytest.approx(10 * torch.log10(ref.pow(2).sum() / noise).item(), rel=1e-9)


def test_costs_are_counted_by_hand(make_resnet, images):
    model = _calibrated(make_resnet, images)
    experiment = Experiment(model, [images(2, seed=3)])
    experiment.run([Trial(frozenset())])
    # conv1: 1 -> 8 channels, 3x3, 16x16 output (small stem); fc: 16 -> 10.
    assert experiment.macs["conv1"] == 8 * 16 * 16 * (1 * 3 * 3)
    assert experiment.macs["fc"] == 10 * 16
    total_macs = sum(experiment.macs.values())
    macs, params = experiment.shares(["conv1.weight", "relu"])
    assert macs == pytest.approx(8 * 16 * 16 * 9 / total_macs)
    conv1 = model.get_submodule("conv1")
    total_params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("qdebug_points"))
    assert params == pytest.approx((conv1.weight.numel() + conv1.bias.numel()) / total_params)


# -- planted defects ----------------------------------------------------------------------------
def test_drill_ends_at_the_planted_activation_scale(defect):
    float_model, model, batches = defect
    result = step(model, batches, reference=float_model, mode="drill", metric=qdebug.data.metrics.top1, metric_name="top1")
    path = [entry["selection"] for entry in result.meta["drill_path"]]
    assert path == ["layer2", DEFECT], path
    assert result.meta["culprit"]["selection"] == DEFECT
    assert result.meta["float_metric"] == {"top1": 1.0}
    assert "drill: layer2 (" in result.summary and f"> {DEFECT} activation (" in result.summary


def test_cumulative_curve_drops_where_the_defect_is_added(defect):
    float_model, model, batches = defect
    frame = step(model, batches, reference=float_model, mode="cumulative", depth=2).frame
    curve = frame[frame["mode"] == "cumulative"].set_index("selection")["sqnr_db"]
    drops = curve.shift(1) - curve
    assert drops.idxmax() == "layer2.0"
    assert curve["layer1.0"] > 35 and curve["layer2.0"] < 15


def test_except_the_defect_recovers_the_float_metric(defect):
    float_model, model, batches = defect
    frame = step(model, batches, reference=float_model, mode="except", modules=[DEFECT],
                 metric=qdebug.data.metrics.top1, metric_name="top1").frame
    whole, rest = frame.iloc[0], frame.iloc[1]
    assert whole["verdict"] == "fail" and whole["top1_ratio"] < 0.9
    assert rest["verdict"] == "pass" and rest["top1_ratio"] >= 0.99


def test_a_weight_defect_shows_under_kind_weight_only(make_resnet, images):
    model = _plant_int2_weights(_calibrated(make_resnet, images))
    batches = [images(8, seed=s) for s in (40, 41)]
    by_kind = {kind: step(model, batches, mode="auto", depth=2, kind=kind) for kind in ("weight", "activation")}
    for result in by_kind.values():  # a unit with no point of the kind asked for is left out
        assert (result.frame["points"] > 0).all()
    assert "input" not in set(by_kind["weight"].frame["selection"])
    weight, activation = (by_kind[k].frame.set_index("selection") for k in ("weight", "activation"))
    assert by_kind["weight"].meta["culprit"]["selection"] == "layer1.0"
    assert weight.loc["layer1.0", "sqnr_db"] < 15  # int2 weights: a few dB
    assert activation.loc["layer1.0", "sqnr_db"] > 30  # its activations are fine
    assert by_kind["activation"].meta["culprit"]["selection"] != "layer1.0" or activation.loc["layer1.0", "sqnr_db"] > 30


def test_both_kinds_split_the_costliest_unit(defect):
    float_model, model, batches = defect
    result = step(model, batches, reference=float_model, mode="auto", depth=1)
    culprit = result.meta["culprit"]
    assert culprit["selection"] == "layer2" and culprit["loss_in"] == "activations"
    assert culprit["weights_sqnr_db"] > 30 > culprit["activations_sqnr_db"]
    rows = result.frame[result.frame["selection"] == "layer2"]
    assert rows["kind"].tolist() == ["both", "weight", "activation"]
    assert rows["mode"].tolist() == ["auto", "split", "split"]


def test_a_metric_without_per_sample_scores_runs_on_stored_outputs(defect):
    float_model, model, batches = defect
    calls = []

    def agreement_count(m, data, reference=None):
        calls.append(len(data))
        return qdebug.data.metrics.agreement(m, data, reference=reference)

    frame = step(model, batches, reference=float_model, mode="only", modules=["layer1"], metric=agreement_count,
                 metric_name="agree").frame
    # float, all quantized, layer1, then layer1's weights and its activations: each once over every batch.
    assert calls == [len(batches)] * 5
    assert frame["agree_ratio"].iloc[1] >= 0.99


def test_quantized_stage_projects_inputs_from_float_points(make_resnet, images):
    """A conv whose input point is left in float still runs its integer kernel, on its input
    projected onto that point's grid: its output lies on its own grid."""
    model = convert(_calibrated(make_resnet, images))
    quant_points(model)["layer1.0.relu"].mode = "float"
    capture = Capture(keep_inputs=False)
    with torch.no_grad(), tap(model, capture):
        run_model(model, images(4, seed=2))
    conv = model.get_submodule("layer1.0.conv2")
    assert conv.integer_fallbacks == 0
    out = capture.records["layer1.0.conv2"].output
    scale = quant_points(model)["layer1.0.bn2"].scale
    off_grid = lambda t, s: float((t / s - torch.round(t / s)).abs().max())  # noqa: E731
    assert off_grid(out, scale) < 1e-3
    relu = capture.records["layer1.0.relu"].output
    relu_scale = quant_points(model)["layer1.0.relu"].scale
    assert off_grid(relu, relu_scale) > 0.1  # the point itself stayed float
    assert grid_of(relu) is None


# -- the CLI -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def defect_files(defect, tmp_path_factory):
    float_model, model, batches = defect
    d = tmp_path_factory.mktemp("step")
    qdebug.save(float_model, d / "float.pt", stage="float", sample_inputs=batches[0].inputs)
    qdebug.save(model, d / "calibrated.pt", stage="calibrated", sample_inputs=batches[0].inputs)
    torch.save((torch.cat([b.inputs for b in batches]), torch.cat([b.target for b in batches])), d / "eval.pt")
    return d


def test_cli_drill_table_summary_and_json(cli, defect_files):
    d = defect_files
    args = [d / "float.pt", d / "calibrated.pt", "--drill", "--metric", "top1", "--data", d / "eval.pt"]
    result = cli("step", *args)
    assert result.code == 0, result.err
    assert "drill: layer2 (" in result.out and f"costs the most: {DEFECT}" in result.out
    assert "next: the smallest verified int16 fix (layer2.0.relu first in line" in result.out
    assert f"qdebug suggest {d / 'float.pt'} {d / 'calibrated.pt'} --metric top1 --data {d / 'eval.pt'}" in result.out
    data = json.loads(cli("step", *args, "--format", "json").out)
    assert [e["selection"] for e in data["meta"]["drill_path"]] == ["layer2", DEFECT]
    row = data["rows"][0]
    for key in ("step", "level", "selection", "mode", "kind", "points", "macs_share", "params_share", "sqnr_db",
                "cosine", "top1", "top1_ratio", "verdict"):
        assert key in row, key
    csv = cli("step", *args, "--format", "csv").out.splitlines()
    assert csv[0].startswith("step,level,selection,mode,kind")


def test_cli_out_writes_table_json_and_plot(cli, defect_files, tmp_path):
    d = defect_files
    result = cli("step", d / "calibrated.pt", "--cumulative", "--depth", "2", "--out", tmp_path / "o")
    assert result.code == 0, result.err
    assert {p.name for p in (tmp_path / "o").iterdir()} == {"step.csv", "step.json", "step.png"}
    assert (tmp_path / "o" / "step.png").read_bytes()[:4] == b"\x89PNG"
    assert "next: drill into layer2.0" in result.out
    assert "qdebug step" in result.out and "--drill --module layer2.0" in result.out


@pytest.mark.parametrize("width", [80, 200])
def test_cli_table_fits_the_width(cli, defect_files, monkeypatch, width):
    from qdebug.cli.common import console

    monkeypatch.setattr(console, "_width", width)
    result = cli("step", defect_files / "calibrated.pt", "--auto", "--depth", "2")
    assert result.code == 0, result.err
    head, body = table_lines(result.out)
    assert max(len(line) for line in head + body) <= width
    assert any("layer2.0" in row for row in body_rows(result.out))
    assert "sqnr_db" in result.out


def test_cli_bad_input_is_one_error_line(cli, defect_files, make_resnet, images, tmp_path):
    d = defect_files
    cli("step", d / "calibrated.pt", "--module", "layer9").assert_error("matches no quantized layer", "closest names")
    cli("step", d / "calibrated.pt", "--module", "layr2").assert_error("closest names: layer2")
    cli("step", d / "calibrated.pt", "--only").assert_error("--only needs --module")
    cli("step", d / "calibrated.pt", "--module", "").assert_error("--module '' names nothing")
    cli("step", d / "calibrated.pt", "--auto", "--drill").assert_error("choose one of --auto, --drill")
    cli("step", d / "calibrated.pt", "--auto", "--kind", "weights").assert_error("--kind")
    cli("step", d / "calibrated.pt", "--auto", "--depth", "0").assert_error("--depth")
    cli("step", d / "float.pt", "--auto").assert_error("float checkpoint")
    cli("step", d / "calibrated.pt", d / "float.pt", "--auto").assert_error("float checkpoint: it goes first")
    cli("step", d / "calibrated.pt", d / "calibrated.pt", "--auto").assert_error("not the float model")
    # A float checkpoint of another model (other widths).
    other = tmp_path / "other.pt"
    qdebug.save(make_resnet(0, widths=[4, 8]), other, stage="float", sample_inputs=images(2))
    cli("step", other, d / "calibrated.pt", "--auto").assert_error("not the same model")
    (tmp_path / "badmetric.py").write_text("def metric(model, batches):\n    raise ValueError('boom')\n")
    cli("step", d / "calibrated.pt", "--auto", "--metric", "badmetric:metric", "--data", d / "eval.pt").assert_error(
        "metric metric raised ValueError: boom")
    cli("step", d / "calibrated.pt", "--auto", "--sort", "nope").assert_error("cannot sort by 'nope'")
    cli("step", tmp_path / "missing.pt", "--auto").assert_error("no such file")


def test_python_api(defect_files):
    frame = qdebug.step(str(defect_files / "float.pt"), str(defect_files / "calibrated.pt"), mode="drill",
                        data=str(defect_files / "eval.pt"), metric="top1")
    assert frame.attrs["meta"]["culprit"]["selection"] == DEFECT
    assert "drill:" in frame.attrs["summary"]
    with pytest.raises(QDebugError, match="matches no quantized layer"):
        qdebug.step(str(defect_files / "calibrated.pt"), module="nothing")


def test_a_qat_checkpoint_reports_the_floor_its_own_weights_set(make_resnet, images, qat_steps):
    float_model = make_resnet(0)
    qat = qat_steps(_calibrated(make_resnet, images), steps=2)
    result = step(qat, [images(8, seed=50)], reference=float_model, mode="auto")
    floor = result.meta["floor_sqnr_db"]
    assert 0 < floor < 60  # trained weights: even with no point quantized the output differs
    assert f"nothing quantized: {floor:.1f} dB vs float" in result.summary
    # Against its own float run there is no floor.
    assert step(qat, [images(8, seed=50)], mode="auto").meta["floor_sqnr_db"] is None


def test_bad_data_and_metrics_are_errors_not_numbers(defect, tmp_path):
    float_model, model, batches = defect
    nan = [Batch(batches[0].inputs.clone(), batches[0].target)]
    nan[0].inputs[0, 0, 0, 0] = float("nan")
    with pytest.raises(QDebugError, match="batch 0 of the data holds NaN/Inf inputs"):
        step(model, nan, reference=float_model, mode="auto")
    wrong = [Batch(b.inputs, torch.full_like(b.target, 99)) for b in batches]  # no class 99: float top1 = 0
    with pytest.raises(QDebugError, match="the float model scores 0 on top1"):
        step(model, wrong, reference=float_model, mode="auto", metric=qdebug.data.metrics.top1, metric_name="top1")
    for value in (float("nan"), float("inf")):
        with pytest.raises(QDebugError, match="float metric for task 'odd' is"):
            step(model, batches, mode="auto", metric=lambda m, data, v=value: [m(x) for x, _ in data] and v,
                 metric_name="odd")
    with pytest.raises(QDebugError, match="metric constant never called the model"):
        step(model, batches, mode="auto", metric=lambda m, data: 0.5, metric_name="constant")
    broken = copy.deepcopy(float_model)
    with torch.no_grad():
        broken.fc.weight[0, 0] = float("nan")
    with pytest.raises(QDebugError, match="the float model's output output is NaN/Inf on batch 0"):
        step(model, batches, reference=broken, mode="auto")


def test_next_command_quotes_what_the_shell_would_expand(cli, defect_files):
    result = cli("step", defect_files / "calibrated.pt", "--module", "layer*", "--auto", "--depth", "2")
    assert result.code == 0, result.err
    assert "--drill --module layer2.0" in result.out
    result = cli("step", defect_files / "calibrated.pt", "--auto", "--data", "random:4x1x16x16")
    assert result.code == 0, result.err
    assert "--data random:4x1x16x16" in result.out


def _multitask(images, aux_defect: bool):
    from qdebug.io.modelspec import ModelSpec, build

    torch.manual_seed(0)
    float_model = build(ModelSpec("qdebug.zoo.multitask:MultiTaskNet", {"width": 8, "num_aux_classes": 10}),
                        from_user=True).eval()
    model = prepare(float_model, QConfig(), mode="fuse_bn", example_inputs=images(4, seed=1))
    calibrate(model, [images(16, seed=s) for s in (10, 11)])
    if aux_defect:
        _plant_small_scale(model, "head_aux.2", factor=20.0)
    batches = []
    for seed in (60, 61, 62):
        x = images(16, seed=seed)
        with torch.no_grad():
            out = float_model(x)
        batches.append(Batch(x, {task: logits.argmax(-1) for task, logits in out.items()}))
    return float_model, model, batches


def test_multitask_outputs_and_tasks_each_get_columns_and_rules(images):
    from qdebug.tools.baseline import TaskRule

    float_model, model, batches = _multitask(images, aux_defect=True)
    result = step(model, batches, reference=float_model, mode="drill", metric=qdebug.data.metrics.top1, metric_name="top1")
    frame = result.frame
    for column in ("cls", "cls_ratio", "aux", "aux_ratio", "cls_sqnr_db", "aux_sqnr_db", "cls_cosine", "verdict"):
        assert column in frame, column
    assert result.meta["outputs"] == ["cls", "aux"] and result.meta["tasks"] == ["cls", "aux"]
    # sqnr_db is the worse output's; the defect is in the aux head only.
    whole = frame.iloc[0]
    assert whole["sqnr_db"] == min(whole["cls_sqnr_db"], whole["aux_sqnr_db"]) == whole["aux_sqnr_db"] < 5
    assert whole["cls_sqnr_db"] > 30
    path = result.meta["drill_path"]
    assert [(e["selection"], e["kind"]) for e in path] == [("head_aux", "both"), ("head_aux.2", "both"),
                                                          ("head_aux.2", "activation")]
    assert "drill: head_aux (-100.0 pts) > head_aux.2 (-100.0 pts) > head_aux.2 activation" in result.summary
    # Each task is judged by its own rule.
    only_cls = dict(reference=float_model, mode="only", modules=["head_cls"], metric=qdebug.data.metrics.top1,
                    metric_name="top1")
    row = step(model, batches, **only_cls, rules={"metric": TaskRule(ratio=0.99)}).frame.iloc[1]
    assert 0.9 < row["cls_ratio"] < 0.99 and row["aux_ratio"] == 1.0 and row["verdict"] == "fail"
    loose = {"cls": TaskRule(ratio=0.9), "metric": TaskRule(ratio=0.99)}
    assert step(model, batches, **only_cls, rules=loose).frame.iloc[1]["verdict"] == "pass"


def test_cli_reads_task_rules_from_the_config(cli, images, tmp_path):
    float_model, model, batches = _multitask(images, aux_defect=True)
    qdebug.save(float_model, tmp_path / "float.pt", stage="float", sample_inputs=batches[0].inputs)
    qdebug.save(model, tmp_path / "calibrated.pt", stage="calibrated", sample_inputs=batches[0].inputs)
    torch.save({"inputs": torch.cat([b.inputs for b in batches]),
                "targets": {t: torch.cat([b.target[t] for b in batches]) for t in ("cls", "aux")}}, tmp_path / "eval.pt")
    (tmp_path / "qdebug.toml").write_text('metric = "top1"\n[tasks.cls]\nratio = 0.9\n')
    args = ["step", "float.pt", "calibrated.pt", "--module", "head_cls", "--data", "eval.pt"]
    rows = json.loads(cli(*args, "--format", "json").out)["rows"]
    assert rows[1]["cls_ratio"] < 0.99 and rows[1]["verdict"] == "pass"  # the config lets cls lose up to 10%
    rows = json.loads(cli(*args, "--ratio", "0.99", "--format", "json").out)["rows"]
    assert rows[1]["verdict"] == "fail"  # --ratio overrides the config's per-task ratios


def test_a_model_that_meets_the_rule_has_nothing_to_fix(cli, stages):
    result = cli("step", stages.float, stages.calibrated, "--metric", "agreement", "--data", stages.data)
    assert result.code == 0, result.err
    data = json.loads(cli("step", stages.float, stages.calibrated, "--metric", "agreement", "--data", stages.data,
                          "--format", "json").out)
    assert data["meta"]["passed"] is (data["rows"][0]["verdict"] == "pass")
    if data["meta"]["passed"]:
        assert "nothing to fix" in result.out and "next:" not in result.out
    else:
        assert "next:" in result.out


def test_sort_puts_the_worst_first(cli, defect_files):
    result = cli("step", defect_files / "calibrated.pt", "--auto", "--depth", "2", "--sort", "sqnr_db",
                 "--format", "table", "--wide")
    rows = [[c for c in row if c] for row in body_rows(result.out)]  # the right-aligned step leaves a blank cell
    assert rows[0][header_index(result.out, "selection")] in ("*", "layer2.0")  # the defect's block: ~7 dB
    values = [float(r[header_index(result.out, "sqnr_db")]) for r in rows]
    assert values == sorted(values)


def test_drill_names_a_point_passed_at_an_upper_level_when_it_costs_more_alone():
    """Six 5-bit Linears are the worst module together (37.0 dB), each alone at best 42.1 dB;
    the 4-bit model input alone costs 42.0 dB. The drill descends into the group, and costs
    the most is still the input: the worst point in our own loop, each point alone."""
    import warnings
    from collections import OrderedDict

    torch.manual_seed(0)
    first = nn.Linear(16, 16)  # built in this order: the seeded weights the figures above are of
    group = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    model = nn.Sequential(OrderedDict(first=first, group=group, last=nn.Linear(16, 4))).eval()
    x = torch.randn(64, 16)
    qconfig = QConfig.from_dict({"overrides": {"group.*": {"weight": {"bits": 5}},
                                               "input": {"activation": {"bits": 4}}}})
    qm = prepare(model, qconfig, example_inputs=x)
    calibrate(qm, [x])
    alone = sqnr_of_each_point_alone(
        model, qm, x, lambda ref, out: 10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()).item())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frame = qdebug.step(model, qm, data=[x], mode="drill")
    meta = frame.attrs["meta"]
    assert [e["selection"] for e in meta["drill_path"]] == ["group", "group.4", "group.4.weight"]
    assert min(alone, key=alone.get) == "input" == meta["culprit"]["selection"]
    assert "costs the most: input activation" in frame.attrs["summary"]
