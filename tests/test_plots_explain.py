"""Plots that explain the diagnosis (issue 31 item 3): every figure has a title, axis labels
and a legend; compare's lines along the network stay whole where rows have no numbers (BN
folded); compare writes ``outlier_<layer>.png`` for each outlier_channels layer -- the
reference's channel ranges, the outlier in red, the next layer's weights on it that round to
code 0 -- and none when there is no such diagnosis.

The figures are inspected as matplotlib built them: ``qdebug.report.plots._save`` is wrapped
to keep each figure it writes."""

from __future__ import annotations

import json
import shlex
import math

import pandas as pd
import pytest
import torch
from matplotlib.colors import to_hex

import qdebug
import qdebug.report.plots as plots
from qdebug.cli.compare import _outlier_file
from qdebug.engine import QConfig, calibrate, prepare

OUTLIER_LAYER, OUTLIER_CHANNEL = "layer1.0.relu", 3
RED, BLUE = to_hex("tab:red"), to_hex("tab:blue")


@pytest.fixture
def figures(monkeypatch):
    """{file name: figure} of every plot written while the test runs."""
    kept = {}
    save = plots._save

    def keep(fig, path):
        kept[str(path).rsplit("/", 1)[-1]] = fig
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    return kept


def assert_explained(fig) -> None:
    """A title, and on every panel that draws something: axis labels (the x label of a stack
    sharing its x axis may sit on the bottom panel) and a legend with named entries."""
    drawn = [ax for ax in fig.axes if ax.lines or ax.patches or ax.collections]
    assert drawn, "an empty figure"
    assert any(ax.get_title() for ax in fig.axes), "no title"
    for ax in drawn:
        assert ax.get_ylabel(), ax.get_title()
        shared = ax.get_shared_x_axes().get_siblings(ax)
        assert ax.get_xlabel() or any(other.get_xlabel() for other in shared), ax.get_title()
        legend = ax.get_legend()
        assert legend is not None, f"no legend: {ax.get_title()}"
        names = [t.get_text() for t in legend.get_texts()]
        assert names and all(names), names


@pytest.fixture(scope="module")
def planted(tmp_path_factory, make_resnet, images):
    """A float ResNet whose ``layer1.0.bn1`` channel 3 is x64 and ``layer1.0.conv2`` reads it /64
    (the float function unchanged), calibrated per tensor in fuse_bn mode; both saved, with data."""
    d = tmp_path_factory.mktemp("planted")
    fp = make_resnet(0)
    block = fp.layer1[0]
    with torch.no_grad():
        block.bn1.weight[OUTLIER_CHANNEL] *= 64
        block.bn1.bias[OUTLIER_CHANNEL] *= 64
        block.conv2.weight[:, OUTLIER_CHANNEL] /= 64
    x = images(4, seed=1)
    cal = calibrate(prepare(fp, QConfig(), mode="fuse_bn", example_inputs=x), [images(8, seed=s) for s in (30, 31)])
    qdebug.save(fp, d / "float.pt", stage="float", sample_inputs=x)
    qdebug.save(cal, d / "calibrated.pt", stage="calibrated", sample_inputs=x)
    data = images(12, seed=5)
    torch.save(data, d / "data.pt")
    return d, fp, data


def _first_relu_output(model, data):
    """``layer1.0.relu``'s first call (the block calls its ReLU twice), by a hook of our own."""
    seen = []
    handle = model.layer1[0].relu.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    with torch.no_grad():
        model(data)
    handle.remove()
    return seen[0]


def test_compare_out_draws_the_outlier_its_underflowing_weights_and_whole_lines(
        cli, tmp_path, planted, figures):
    d, fp, data = planted
    result = cli("compare", d / "float.pt", d / "calibrated.pt", "--data", d / "data.pt", "--out", "cmp",
                 "--format", "json")
    assert result.code == 0, result.err
    meta = json.loads((tmp_path / "cmp" / "compare.json").read_text())["meta"]
    found = meta["findings"]["calibrated"]
    assert (found["at_fault"], found["at_fault_diagnosis"], found["outlier_channel"]) == \
        (OUTLIER_LAYER, "outlier_channels", OUTLIER_CHANNEL)
    name = "outlier_layer1.0.relu.png"
    assert meta["files"] == ["compare_along_network.png", "compare_worst_histograms.png", name]
    for file in meta["files"]:
        assert (tmp_path / "cmp" / file).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", file
        assert_explained(figures[file])
    ranges, weights = figures[name].axes[:2]
    # Top: one bar per channel from its min to its max over every batch, the hook's own numbers.
    out = _first_relu_output(fp, data).transpose(0, 1).reshape(8, -1)
    bars = ranges.patches
    assert len(bars) == 8
    low, high = out.min(1).values.double(), out.max(1).values.double()
    torch.testing.assert_close(torch.tensor([b.get_y() for b in bars]), low, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor([b.get_y() + b.get_height() for b in bars]), high, rtol=1e-5, atol=1e-6)
    assert [to_hex(b.get_facecolor()) for b in bars] == [RED if i == OUTLIER_CHANNEL else BLUE for i in range(8)]
    assert f"channel {OUTLIER_CHANNEL}: {found['channel_range_ratio']:.0f}x" in ranges.get_legend().get_texts()[0].get_text()
    # Bottom: the share of conv2's weights on each input channel that round to 0, the summary's numbers.
    assert found["downstream_layer"] == "layer1.0.conv2" and "layer1.0.conv2" in weights.get_title()
    shares = [b.get_height() for b in weights.patches]
    assert shares[OUTLIER_CHANNEL] == pytest.approx(found["downstream_zero_codes"])
    others = [v for i, v in enumerate(shares) if i != OUTLIER_CHANNEL]
    assert sum(others) / len(others) == pytest.approx(found["downstream_zero_codes_elsewhere"])
    assert shares[OUTLIER_CHANNEL] > 0.2 > max(others)
    _assert_lines_stay_whole(pd.DataFrame(json.loads(result.out)["rows"]), figures["compare_along_network.png"])


def _assert_lines_stay_whole(rows: pd.DataFrame, fig) -> None:
    """fuse_bn: every conv row of the calibrated model has a note and no numbers; the lines join
    the measured rows across them, and the x axis holds the measured rows only."""
    folded = rows[rows["note"].str.contains("BN folded")]
    assert len(folded) >= 5  # the premise: rows without numbers between the measured ones
    measured = rows[rows["note"] == ""]
    sqnr, cosine = fig.axes[:2]
    [propagated] = [line for line in sqnr.lines if line.get_label() == "calibrated (propagated)"]
    ys = list(propagated.get_ydata())
    finite = [float(v) for v in measured["sqnr_db"] if v is not None and math.isfinite(float(v))]
    assert ys == pytest.approx(finite) and not any(math.isnan(v) for v in ys)  # one line, no gap
    assert list(propagated.get_xdata()) == sorted(propagated.get_xdata())
    names = [t.get_text() for t in cosine.get_xticklabels()]
    assert names == list(measured["layer"]) and not set(names) & set(folded["layer"])
    assert f"{len(folded)} row(s) without numbers left out" in cosine.get_xlabel()


def test_an_outlier_finding_leads_to_the_channels_then_to_step(cli, tmp_path, planted):
    """compare's next line for wide channels: the table sorted by channel SQNR, whose own next
    line goes on (step's drill: which part costs the accuracy) instead of printing itself again;
    beside it, ``meta.fix``: the float-side fix (``qdebug fix``) on the float checkpoint and data."""
    d, _, _ = planted
    meta = json.loads(cli("compare", d / "float.pt", d / "calibrated.pt", "--data", d / "data.pt",
                          "--format", "json").out)["meta"]
    assert meta["findings"]["calibrated"]["outlier_layers"] == [OUTLIER_LAYER]
    assert shlex.split(meta["fix"]) == ["qdebug", "fix", str(d / "float.pt"), "--like", str(d / "calibrated.pt"),
                                        "--data", str(d / "data.pt"), "-o", "fixed_float.pt"]
    fixed = cli(*shlex.split(meta["fix"])[1:], "--format", "json")  # it runs as printed, and equalization pays
    assert fixed.code == 0, fixed.err
    assert "equalize" in json.loads(fixed.out)["meta"]["kept"]
    first = meta["next"]
    assert first.endswith("--sort min_channel_sqnr_db"), first
    again = json.loads(cli(*shlex.split(first)[1:], "--format", "json").out)["meta"]["next"]
    assert again.startswith("qdebug step") and again.endswith("--drill"), again
    assert cli(*shlex.split(again)[1:], "--format", "json").code in (0, 1)  # it runs as printed


def test_an_outlier_finding_prints_the_fix_command_on_the_users_float_and_data(cli, planted, monkeypatch):
    """Under the summary of wide channels: ``qdebug fix`` (cross-layer equalization, docs/fix.md) on
    the float checkpoint and the data options as typed, then the debug flow's next step."""
    from qdebug.cli.common import console

    monkeypatch.setattr(console, "_width", 80)
    d, _, _ = planted
    lines = cli("compare", d / "float.pt", d / "calibrated.pt", "--data", d / "data.pt",
                "--batch-size", "4").out.splitlines()
    at = lines.index("fix: cross-layer equalization may keep the wide channels int8 (docs/fix.md):")
    assert shlex.split(lines[at + 1]) == ["qdebug", "fix", str(d / "float.pt"), "--like", str(d / "calibrated.pt"),
                                          "--data", str(d / "data.pt"), "--batch-size", "4", "-o", "fixed_float.pt"]
    assert lines[at + 2] == "next: see the channels:"
    assert max(len(line) for line in lines[:at + 1]) <= 80  # the table, the summary and the fix line


def test_no_outlier_plot_without_an_outlier_diagnosis_and_an_earlier_one_is_dropped(cli, tmp_path, planted, stages,
                                                                                   figures):
    d, _, _ = planted
    assert cli("compare", d / "float.pt", d / "calibrated.pt", "--data", d / "data.pt", "--out", "cmp").code == 0
    assert (tmp_path / "cmp" / "outlier_layer1.0.relu.png").exists()
    figures.clear()
    result = cli("compare", stages.float, stages.calibrated, "--data", stages.data, "--out", "cmp")
    assert result.code == 0, result.err
    payload = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert "outlier_channels" not in {row["diagnosis"] for row in payload["rows"]}  # the premise
    assert payload["meta"]["fix"] == "" and "fix:" not in result.out  # no wide channels: no float-side fix
    assert not list((tmp_path / "cmp").glob("outlier_*"))  # the earlier run's outlier is not this run's
    assert payload["meta"]["files"] == ["compare_along_network.png", "compare_worst_histograms.png"]
    assert sorted(figures) == sorted(payload["meta"]["files"])
    for fig in figures.values():
        assert_explained(fig)


def test_outlier_file_names_are_safe_and_distinct():
    assert _outlier_file("layer1.0.relu", set()) == "outlier_layer1.0.relu.png"
    assert _outlier_file("blocks.0/attn:q#2", set()) == "outlier_blocks.0_attn_q_2.png"
    assert _outlier_file("../x", set()) == "outlier__x.png"  # no dot first: never hidden, never ..
    assert _outlier_file("a:b", {"outlier_a_b.png"}) == "outlier_a_b-2.png"
    assert _outlier_file("a:b", {"outlier_a_b.png", "outlier_a_b-2.png"}) == "outlier_a_b-3.png"
    assert len(_outlier_file("x" * 500, set())) == len("outlier_.png") + 100


def _steps_frame() -> pd.DataFrame:
    """step's rows as a drill writes them: the costliest unit 'layer1' (both) also appears
    split by kind, at the next level."""
    return pd.DataFrame({
        "selection": ["*", "conv1", "layer1", "layer2", "layer1", "layer1"],
        "kind": ["both", "weight", "both", "both", "weight", "activation"],
        "mode": ["all", "auto", "auto", "auto", "split", "split"],
        "level": [0, 1, 1, 1, 2, 2],
        "sqnr_db": [20.0, 50.0, 24.0, 45.0, 25.0, 35.0],
        "top1_ratio": [0.5, 1.0, 0.5, 1.0, 0.5, 1.0],
    })


@pytest.mark.parametrize("tasks", [["top1"], []])
def test_step_plot_has_a_title_a_legend_and_the_culprit_red(tmp_path, figures, tasks):
    plots.plot_steps(_steps_frame(), tmp_path / "step.png", tasks=tasks, cumulative=False, culprit=("layer1", "both"))
    fig = figures["step.png"]
    assert_explained(fig)
    ax = fig.axes[0]
    # Only the culprit's own row is red -- not the same selection split by kind.
    assert [to_hex(b.get_facecolor()) for b in ax.patches] == [BLUE, RED, BLUE, BLUE, BLUE]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "the costliest unit (layer1)" in legend and "next drill level" in legend
    assert ("target: 0.99 x float" in legend) == bool(tasks)
    plots.plot_steps(_steps_frame(), tmp_path / "step.png", tasks=tasks, cumulative=False, culprit=None)
    assert RED not in {to_hex(b.get_facecolor()) for b in figures["step.png"].axes[0].patches}
    cumulative = _steps_frame().assign(mode="cumulative")
    plots.plot_steps(cumulative, tmp_path / "step.png", tasks=tasks, cumulative=True)
    assert_explained(figures["step.png"])


def test_suggest_plot_names_its_colours(tmp_path, figures):
    frame = pd.DataFrame({"rank": [1, 2, 3], "point": ["a", "b", "c"], "kind": ["weight", "activation", "weight"],
                          "gain_db": [10.0, 2.0, 0.5], "in_plan": [True, False, False]})
    meta = {"bits": 16, "tasks": ["top1"], "ratio": 0.99,
            "plan": {"history": [{"size": 3, "top1_ratio": 1.0, "passed": True},
                                 {"size": 1, "top1_ratio": 0.9, "passed": False},
                                 {"size": 2, "top1_ratio": 0.995, "passed": True}]}}
    plots.plot_suggest(frame, meta, tmp_path / "suggest.png")
    fig = figures["suggest.png"]
    assert_explained(fig)
    gains, search = fig.axes[:2]
    assert [t.get_text() for t in gains.get_legend().get_texts()] == ["in the plan", "not in the plan"]
    dots = {c.get_label(): [tuple(xy) for xy in c.get_offsets()] for c in search.collections}
    assert dots == {"plan met the target": [(3.0, 1.0), (2.0, 0.995)], "plan fell short": [(1.0, 0.9)]}
    assert {to_hex(c.get_facecolor()[0]) for c in search.collections} == {to_hex("tab:green"), RED}
    assert "target (0.99 x float)" in [t.get_text() for t in search.get_legend().get_texts()]


def test_nan_timeline_has_a_legend_on_every_panel(tmp_path, figures):
    frame = pd.DataFrame({"step": [0, 1, 2], "loss": [2.0, 3.0, 50.0], "grad_norm": [0.5, 5.0, 500.0]})
    first = {"step": 3, "phase": "forward", "layer": "fc", "cause": "overflow"}
    plots.plot_nan_timeline(frame, tmp_path / "nan.png", first=first)
    assert_explained(figures["nan.png"])
    plots.plot_nan_timeline(frame, tmp_path / "nan.png", first=None)
    assert_explained(figures["nan.png"])
