"""Terminal tables: fitted to the width (80 when piped), never a wrapped number, layer names on
one line; snapshots of every command's table at 80 and 200 columns.

Snapshots are of fixed frames (typed-in results), so they do not depend on the CPU's float
arithmetic.  After an intended change of layout, rewrite them with
``QDEBUG_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_tables.py`` and read the diff.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console

from qdebug.cli.baseline import render_baseline
from qdebug.cli.compare import render_compare
from qdebug.cli.inspect import render_checks, render_layers
from qdebug.cli.step import render_step
from qdebug.cli.suggest import render_suggest
from qdebug.report.table import render_table, shorten_left, split_header, table_width
from qdebug.tools.baseline import TaskRule, gate
from tables import table_lines

SNAPSHOTS = Path(__file__).parent / "snapshots"
WIDTHS = (80, 200)
NAN = math.nan


def _text(table, width: int) -> str:
    console = Console(width=max(width, table_width(table)), record=True, color_system=None, file=open(os.devnull, "w"))
    console.print(table)
    return console.export_text()


# -- the fitting rules ---------------------------------------------------------------------------
def test_shorten_left_keeps_the_end_of_a_path():
    assert shorten_left("features.1.conv.project_bn", 12) == "….project_bn"
    assert len(shorten_left("features.1.conv.project_bn", 12)) == 12
    assert shorten_left("fc", 12) == "fc"


def test_split_header_breaks_at_the_best_underscore():
    assert split_header("isolated_sqnr_db") == "isolated_\nsqnr_db"
    assert split_header("min_channel_sqnr_db") == "min_channel_\nsqnr_db"
    assert split_header("layer") == "layer"


def _frame(n=6):
    return pd.DataFrame({
        "layer": [f"backbone.stage{i}.block{i}.conv_pointwise_linear" for i in range(n)],
        "sqnr_db": [12.3456 * (i + 1) for i in range(n)],
        "isolated_sqnr_db": [30.5 + i for i in range(n)],
        "cosine": [0.999912] * n,
        "saturation": [1.25e-4] * n,
        "note": ["a long free-text note that is cut at the end"] * n,
    })


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_no_line_is_wider_than_the_width_and_numbers_stay_whole(width):
    frame = _frame()
    table = render_table(frame, width=width, clip=("note",), priority=["layer", "sqnr_db", "isolated_sqnr_db"])
    text = _text(table, width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width, text
    body = table_lines(text)[1]
    assert len(body) == len(frame)  # one line per row: nothing wrapped
    for line, value in zip(body, frame["sqnr_db"]):
        assert f"{value:.4f}".rstrip("0") in line  # the whole number, on the row's one line
    names = [line.split()[0] for line in body]
    for shown, full in zip(names, frame["layer"]):
        assert shown == full or (shown.startswith("…") and full.endswith(shown[1:])), shown


def test_columns_are_chosen_by_priority_and_the_rest_named_in_the_caption():
    table = render_table(_frame(), width=60, priority=["layer", "saturation", "sqnr_db"])
    shown = [str(c.header).replace("\n", "") for c in table.columns]
    assert shown[0] == "layer" and "saturation" in shown and "sqnr_db" in shown
    assert "note" not in shown and "note" in table.caption and "--wide" in table.caption


def test_wide_shows_every_column_at_its_natural_width():
    frame = _frame()
    table = render_table(frame, width=None, clip=("note",))
    assert [str(c.header) for c in table.columns] == list(frame.columns)
    text = _text(table, 80)
    assert frame["layer"][0] in text and frame["note"][0] in text and table.caption is None


def test_a_first_column_wider_than_the_terminal_is_cut_not_wrapped():
    table = render_table(pd.DataFrame({"layer": ["x" * 50], "v": [1.0]}), width=20)
    assert max(len(line) for line in _text(table, 20).splitlines()) <= 20


# -- snapshots of every command's table ----------------------------------------------------------
def _compare_frame() -> pd.DataFrame:
    rows = [
        ("input", "Identity", "calibrated", 62.29, NAN, 1.0, 0.0, 0.07, NAN, "", ""),
        ("input", "Identity", "quantized", 62.29, NAN, 1.0, 0.0, 0.07, NAN, "", ""),
        ("features.0.conv", "Conv2d", "calibrated", 50.86, 51.18, 0.999996, NAN, NAN, 42.41, "", ""),
        ("features.0.conv", "Conv2d", "quantized", NAN, NAN, NAN, NAN, NAN, NAN, "",
         "ReLU6 fused into its integer kernel: compared at features.0.act"),
        ("features.1.conv.project_bn", "BatchNorm2d", "calibrated", 31.06, 34.27, 0.999606, NAN, NAN, 29.52, "", ""),
        ("features.1.conv.project_bn", "BatchNorm2d", "quantized", 22.55, 29.66, 0.997221, 0.0, 9.3, 17.26,
         "propagated", ""),
        ("features.3.conv.dw_act", "ReLU6", "calibrated", 27.73, 43.34, 0.999145, 7.8e-4, 1.31, 24.1, "", ""),
        ("features.3.conv.dw_act", "ReLU6", "quantized", 19.02, 18.4, 0.993421, 0.0231, 14.2, 3.5,
         "clipping", ""),
        ("classifier.fc", "Linear", "calibrated", 33.9, 43.03, 0.999798, 7.81e-4, 4.52, 31.5, "", ""),
        ("classifier.fc", "Linear", "quantized", math.inf, math.inf, 1.0, 0.0, 0.0, NAN, "", ""),
    ]
    cols = ["layer", "type", "target", "sqnr_db", "isolated_sqnr_db", "cosine", "saturation", "max_abs_scales",
            "min_channel_sqnr_db", "diagnosis", "note"]
    return pd.DataFrame(rows, columns=cols)


def _layers_frame() -> pd.DataFrame:
    rows = [
        ("input", "input", 1, "", None, None, "uint8 affine", 0.0111, 0.0111, "", "fake"),
        ("features.0.conv", "QConv", 1, "int8 sym per-ch", 1.2e-4, 0.0183, "uint8 affine", 0.0235, 0.0235,
         "features.0.act", "fake"),
        ("features.1.conv.project_conv", "QConv", 1, "int8 sym per-ch", 3.05e-5, 0.00441, "int16 affine [observe]",
         None, None, "features.1.conv.project_bn", "observe"),
        ("features.3.add", "add", 1, "", None, None, "uint8 affine", 0.0805, 0.0805, "", "fake"),
        ("classifier.fc", "QLinear", 2, "int8 sym per-ch", 9.1e-4, 0.0021, "uint8 affine", 0.1241, 0.1241, "", "fake"),
    ]
    cols = ["layer", "type", "calls", "weight", "weight_scale_min", "weight_scale_max", "activation", "act_scale_min",
            "act_scale_max", "fused_into", "mode"]
    return pd.DataFrame(rows, columns=cols)


def _checks_frame() -> pd.DataFrame:
    rows = [("info", f"features.{i}.conv", "unfused Conv-BN", f"BN features.{i}.bn kept (reverse_fold); convert folds it")
            for i in range(5)]
    rows += [("warning", "features.4.erf", "float fallback", "no quantized kernel for erf: computed in float, "
              "re-quantized after"),
             ("error", "classifier.fc.weight", "non-finite weights", "3 of 1280 values are NaN/Inf")]
    return pd.DataFrame(rows, columns=["severity", "layer", "check", "detail"])


def _baseline_frame() -> pd.DataFrame:
    rules = {"metric": TaskRule("higher", 0.99), "detection_map": TaskRule("higher", 0.99),
             "segmentation_miou": TaskRule("higher", 0.98)}
    floats = {"detection_map": 0.4125, "segmentation_miou": 0.7031}
    quants = {"detection_map": 0.4098, "segmentation_miou": 0.6702}
    return gate(floats, quants, rules, ratio=0.99).frame


def _step_frame() -> tuple[pd.DataFrame, dict]:
    rows = [
        (0, 0, "*", "all", "both", 62, 1.0, 1.0, 14.21, 0.981234, 0.8412, 0.9312, "fail"),
        (1, 1, "input", "drill", "both", 1, 0.0, 0.0, 52.97, 0.999998, 0.9031, 0.9997, "pass"),
        (2, 1, "backbone", "drill", "both", 48, 0.912, 0.801, 14.9, 0.983311, 0.8501, 0.9411, "fail"),
        (3, 1, "head.classifier", "drill", "both", 13, 0.088, 0.199, 43.08, 0.999877, 0.9012, 0.9976, "pass"),
        (4, 2, "backbone.layer3", "drill", "both", 12, 0.251, 0.302, 15.2, 0.984101, 0.8602, 0.9523, "fail"),
        (5, 3, "backbone.layer3.1.conv2", "drill", "both", 2, 0.061, 0.075, 15.9, 0.985401, 0.8713, 0.9645, "fail"),
        (6, 3, "backbone.layer3.1.conv2", "only", "weight", 1, 0.061, 0.075, 44.2, 0.999912, 0.9031, 0.9997, "pass"),
        (7, 3, "backbone.layer3.1.conv2", "only", "activation", 1, 0.0, 0.0, 16.0, 0.985522, 0.8722, 0.9656, "fail"),
    ]
    cols = ["step", "level", "selection", "mode", "kind", "points", "macs_share", "params_share", "sqnr_db", "cosine",
            "top1", "top1_ratio", "verdict"]
    meta = {"mode": "drill", "kind": "both", "batches": 8, "tasks": ["top1"],
            "culprit": {"selection": "backbone.layer3.1.conv2"}}
    return pd.DataFrame(rows, columns=cols), meta


def _suggest_frame() -> pd.DataFrame:
    rows = [
        (1, "backbone.layer1.0.conv2", "backbone.layer1.0.conv2", "weight", 8, "", 10.05, 0.0412, 0.2716, 0.0, True),
        (2, "backbone.layer1.0.relu", "backbone.layer1.0.relu", "activation", 8, "outlier_channels", 1.27, 0.0208,
         0.0, 0.3259, True),
        (3, "backbone.layer2.0.conv1", "backbone.layer2.0.conv1", "weight", 8, "", 0.53, 0.0, 0.1358, 0.0, False),
        (4, "input", "input", "activation", 8, "", 0.23, 0.0, 0.0, 0.0204, False),
        (5, "head.fc", "head.fc", "weight", 8, "rounding", -0.32, -0.0208, 0.0003, 0.0, False),
        (None, "backbone.layer2.0.relu", "backbone.layer2.0.relu", "activation", 8, "clipping", NAN, NAN, 0.0, 0.0815,
         False),
    ]
    cols = ["rank", "point", "layer", "kind", "bits", "diagnosis", "gain_db", "top1_gain", "macs_share", "act_share",
            "in_plan"]
    return pd.DataFrame(rows, columns=cols)


TABLES = {
    "compare": lambda width: render_compare(_compare_frame(), ["sqnr_db", "isolated_sqnr_db", "cosine", "saturation",
                                                               "max_abs_scales", "min_channel_sqnr_db"],
                                            title="compare vs float, 2 batch(es)", width=width),
    "compare_sorted": lambda width: render_compare(_compare_frame(), ["sqnr_db", "isolated_sqnr_db"], sort="sqnr_db",
                                                   top=3, title="compare vs float", width=width),
    "inspect_layers": lambda width: render_layers(_layers_frame(), title="layers", width=width),
    "inspect_checks": lambda width: render_checks(_checks_frame(), width=width),
    "calibrate": lambda width: render_layers(_layers_frame(), title="calibrated on 8 batch(es)", width=width),
    "convert": lambda width: render_layers(_layers_frame(), title="quantized layers", width=width),
    "step": lambda width: render_step(*_step_frame(), width=width),
    "suggest": lambda width: render_suggest(_suggest_frame(), {"bits": 16}, width=width),
    "baseline": lambda width: render_baseline(_baseline_frame(), ratio=0.99, confidence=None, width=width),
}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", sorted(TABLES))
def test_snapshot(name, width):
    text = _text(TABLES[name](width), width)
    assert max(len(line) for line in text.splitlines()) <= width, text
    path = SNAPSHOTS / f"{name}_{width}.txt"
    if os.environ.get("QDEBUG_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"no snapshot {path.name}: run with QDEBUG_UPDATE_SNAPSHOTS=1 once and read it"
    assert text == path.read_text(), f"{name} at {width} columns changed:\n{text}"


@pytest.mark.parametrize("width", WIDTHS)
def test_snapshot_init(cli, monkeypatch, width):
    """init's table (key, value, action), through the command itself: no numbers, so end to end."""
    from qdebug.cli.common import console

    monkeypatch.setattr(console, "_width", width)
    result = cli("init", "--trust", "mypkg", "--model", "mypkg.net:Net", "--data", "mypkg.data:eval_batches",
                 "--metric", "mypkg.metrics:evaluate_with_a_long_name")
    assert result.code == 0, result.err
    text = result.out
    assert max(len(line) for line in text.splitlines()) <= width, text
    path = SNAPSHOTS / f"init_{width}.txt"
    if os.environ.get("QDEBUG_UPDATE_SNAPSHOTS") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"init at {width} columns changed:\n{text}"
