"""``qdebug baseline``'s guard on its inputs (issue 30, item 5): FLOAT must be a float checkpoint,
and FLOAT and QUANT two files -- a swapped pair or one file twice passes a gate it should fail --
unless ``--allow-any-order`` says the user means it.

The metric tells the stages apart by their integer weights and returns values chosen here, so every
expected score is worked out by hand: float 1.0, quantized 0.9 -> the right order scores 0.9 and
fails at 0.99; swapped, it would score 1 / 0.9 = 1.11 and pass (the issue's 1.108, exit 0).
"""

from __future__ import annotations

import json
import shutil
import sys
import uuid

import pytest

FLOAT_VALUE, QUANT_VALUE = 1.0, 0.9

_METRIC = f'''
CALLS = []  # one entry per model evaluated: a refusal must come before any evaluation

def by_stage(model, batches):
    CALLS.append(1)
    quantized = any(k.endswith("weight_int") for k in model.state_dict())
    return {QUANT_VALUE} if quantized else {FLOAT_VALUE}
'''


@pytest.fixture(autouse=True)
def _no_step_summary(monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)


@pytest.fixture
def metric(tmp_path, monkeypatch):
    """The stage-telling metric as an importable module: (its spec, a function giving its call count)."""
    folder = tmp_path / "metric_src"
    folder.mkdir()
    name = f"qdbl_order_{uuid.uuid4().hex[:10]}"
    (folder / f"{name}.py").write_text(_METRIC)
    monkeypatch.syspath_prepend(str(folder))
    return f"{name}:by_stage", lambda: len(sys.modules[name].CALLS) if name in sys.modules else 0


def _gate(cli, stages, metric, *paths, extra=()):
    return cli("baseline", *paths, "--metric", metric[0], "--data", stages.data, *extra)


def _warnings(result) -> list[str]:
    return [line for line in result.err.splitlines() if line.startswith("warning: ")]


def test_right_order_unchanged(cli, stages, metric):
    result = _gate(cli, stages, metric, stages.float, stages.quantized, extra=("--json",))
    assert result.code == 1, result.err  # 0.9 < 0.99 x 1.0
    payload = json.loads(result.out)
    row = payload["rows"][0]
    assert (row["float"], row["quantized"]) == (FLOAT_VALUE, QUANT_VALUE)
    assert row["score"] == pytest.approx(QUANT_VALUE / FLOAT_VALUE)
    assert payload["meta"]["stages"] == ["float", "quantized"]
    assert payload["meta"]["order_warnings"] == []
    assert _warnings(result) == [] and "error:" not in result.err
    assert metric[1]() == 2
    # A float QUANT is no wrong order: two float files of different bytes are gated as given.
    assert _gate(cli, stages, metric, stages.float, stages.calibrated).code == 0  # 1.0 vs 1.0


@pytest.mark.parametrize("first", ["quantized", "calibrated", "qat"])
def test_swapped_order_refused(cli, stages, metric, first):
    result = _gate(cli, stages, metric, stages.path(first), stages.float)
    result.assert_error(f"FLOAT {stages.path(first)} is {first}", f"QUANT {stages.float} is float",
                        "(FLOAT QUANT)",
                        f"hint: swap them: qdebug baseline {stages.float} {stages.path(first)}", "--allow-any-order")
    assert metric[1]() == 0  # refused before the metric ran


def test_no_float_checkpoint_first_refused(cli, stages, metric):
    result = _gate(cli, stages, metric, stages.calibrated, stages.quantized)
    result.assert_error(f"FLOAT {stages.calibrated} is calibrated", f"QUANT {stages.quantized} is quantized",
                        f"give the float checkpoint first: qdebug baseline FLOAT.pt {stages.quantized}",
                        "--allow-any-order")
    assert metric[1]() == 0


def test_same_file_refused_by_path(cli, stages, metric, tmp_path, monkeypatch):
    _gate(cli, stages, metric, stages.float, stages.float).assert_error("are one file", "with itself")
    # The same file however it is spelled: relative against absolute, or through a link.
    monkeypatch.chdir(stages.float.parent)
    _gate(cli, stages, metric, "float.pt", stages.float).assert_error("are one file")
    link = tmp_path / "link.pt"
    link.symlink_to(stages.quantized)
    _gate(cli, stages, metric, stages.quantized, link).assert_error("are one file")
    hard = tmp_path / "hard.pt"
    hard.hardlink_to(stages.float)
    _gate(cli, stages, metric, stages.float, hard).assert_error("are one file")
    assert metric[1]() == 0


def test_same_file_refused_by_content(cli, stages, metric, tmp_path):
    copy = tmp_path / "copy.pt"
    shutil.copyfile(stages.float, copy)  # a float FLOAT: only the bytes give it away
    result = _gate(cli, stages, metric, stages.float, copy)
    result.assert_error(f"FLOAT {stages.float} and QUANT {copy} are copies of one file (the same bytes)",
                        "--allow-any-order")
    assert metric[1]() == 0


def test_allow_any_order_proceeds_swapped(cli, stages, metric):
    result = _gate(cli, stages, metric, stages.quantized, stages.float, extra=("--allow-any-order", "--json"))
    assert result.code == 0, result.err  # the gate as asked: 1.0 >= 0.99 x 0.9
    payload = json.loads(result.out)
    row = payload["rows"][0]
    assert (row["float"], row["quantized"]) == (QUANT_VALUE, FLOAT_VALUE)
    assert row["score"] == pytest.approx(FLOAT_VALUE / QUANT_VALUE)
    assert payload["meta"]["stages"] == ["quantized", "float"]
    (warning,) = _warnings(result)
    assert f"FLOAT {stages.quantized} is quantized" in warning and "--allow-any-order" in warning
    assert payload["meta"]["order_warnings"] == [warning.removeprefix("warning: ").rsplit(" (gated anyway", 1)[0]]


@pytest.mark.parametrize("copied", [False, True])
def test_allow_any_order_proceeds_one_file(cli, stages, metric, tmp_path, copied):
    second = stages.quantized
    if copied:
        second = tmp_path / "copy.pt"
        shutil.copyfile(stages.quantized, second)
    result = _gate(cli, stages, metric, stages.quantized, second, extra=("--allow-any-order", "--json"))
    assert result.code == 0, result.err  # a model against itself: 0.9 vs 0.9, score 1
    row = json.loads(result.out)["rows"][0]
    assert (row["float"], row["quantized"], row["score"]) == (QUANT_VALUE, QUANT_VALUE, 1.0)
    warnings = _warnings(result)  # both problems said: one file, and a quantized FLOAT
    assert len(warnings) == 2, result.err
    assert ("copies of one file" if copied else "are one file") in warnings[0]
    assert "is quantized" in warnings[1]


def test_the_config_pair_is_checked_too(cli, stages, metric, tmp_path):
    config = tmp_path / "qdebug.toml"
    config.write_text(f'float = "{stages.quantized}"\nquantized = "{stages.float}"\n')
    result = cli("baseline", "--metric", metric[0], "--data", stages.data)
    result.assert_error(f"the config's float {stages.quantized} is quantized",
                        f"the config's quantized {stages.float} is float", "hint: swap float and quantized in",
                        "--allow-any-order")
    config.write_text(f'float = "{stages.float}"\nqat = "{stages.float}"\n')
    cli("baseline", "--metric", metric[0], "--data", stages.data).assert_error(
        "the config's float", "the config's qat", "are one file", "hint: set float and qat in")
    assert metric[1]() == 0
    config.write_text(f'float = "{stages.float}"\nquantized = "{stages.quantized}"\n')
    assert cli("baseline", "--metric", metric[0], "--data", stages.data).code == 1  # the right pair: gated


def test_one_results_file_twice_refused(cli, tmp_path):
    (tmp_path / "f.json").write_text('{"top1": 0.9}')
    cli("baseline", "--float-json", "f.json", "--quant-json", tmp_path / "f.json").assert_error(
        f"--float-json f.json and --quant-json {tmp_path / 'f.json'} are one file", "--allow-any-order")
    # Two files of equal numbers are two evaluations that agree, not a mistake.
    (tmp_path / "q.json").write_text('{"top1": 0.9}')
    result = cli("baseline", "--float-json", "f.json", "--quant-json", "q.json")
    assert result.code == 0 and _warnings(result) == [], result.err
    allowed = cli("baseline", "--float-json", "f.json", "--quant-json", "f.json", "--allow-any-order")
    assert allowed.code == 0 and len(_warnings(allowed)) == 1, allowed.err


def test_help_shows_the_option_with_an_example(cli):
    result = cli("baseline", "--help")
    assert result.code == 0, result.err
    assert "--allow-any-order" in result.out
    assert any(line.startswith("Example:") and "--allow-any-order" in line
               for line in " ".join(result.out.split()).replace("Example:", "\nExample:").splitlines())
