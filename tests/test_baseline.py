"""``baseline`` (qdebug.tools.baseline) and ``qdebug baseline``: the precision gate per task, exit codes,
table / JSON / JUnit / step-summary output, the paired bootstrap and McNemar, the demo.

Every expectation is worked out by hand from the rule in the module docstring:
higher is better: pass iff q >= r * f; lower is better: pass iff q <= f / r.
"""

from __future__ import annotations

import json
import math
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

import qdebug
from qdebug.data.spec import load_batches
from tables import body_rows, header_cells
from qdebug.engine import quant_points
from qdebug.tools.baseline import TaskRule, bootstrap_interval, gate, mcnemar_exact

DEMO = Path(__file__).resolve().parent.parent / "fixtures" / "demo"


@pytest.fixture(autouse=True)
def _no_step_summary(monkeypatch):
    """Never append to a real CI step summary while testing."""
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)


def _write_json(path: Path, data) -> Path:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def _payload(result) -> dict:
    assert result.out.strip(), (result.code, result.err)
    return json.loads(result.out)


def _rows(payload: dict) -> dict[str, dict]:
    return {row["task"]: row for row in payload["rows"]}


@pytest.fixture
def metric_module(tmp_path, monkeypatch):
    """Write ``source`` as an importable module in tmp_path; returns its unique name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        name = f"qdbl_metric_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{name}.py").write_text(source)
        return name

    return write


# A metric that tells the float stage from the quantized one (integer weights) and returns values we choose.
_IS_QUANT = '''
import torch

def is_quant(model):
    return any(k.endswith("weight_int") for k in model.state_dict())
'''


def _vectors(n: int, right: int, lost: list[int] = (), gained: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """0/1 float scores with the first ``right`` samples right; quant = float with ``lost`` set to 0
    and ``gained`` set to 1."""
    f = torch.zeros(n, dtype=torch.float64)
    f[:right] = 1
    q = f.clone()
    for i in lost:
        assert f[i] == 1
        q[i] = 0
    for i in gained:
        assert f[i] == 0
        q[i] = 1
    return f, q


# -- the rule (precomputed values) -----------------------------------------------------------------
def test_single_number_pass_and_fail_at_default_ratio(cli):
    # required = 0.99 * 0.8 = 0.792
    ok = cli("baseline", "--float-metric", "0.8", "--quant-metric", "0.793", "--json")
    assert ok.code == 0, ok.err
    row = _payload(ok)["rows"][0]
    assert row["task"] == "metric" and row["verdict"] == "pass"
    assert row["ratio"] == 0.99
    assert row["required"] == pytest.approx(0.792)
    assert row["margin"] == pytest.approx(0.001)
    assert row["score"] == pytest.approx(0.793 / 0.8)
    bad = cli("baseline", "--float-metric", "0.8", "--quant-metric", "0.791", "--json")
    assert bad.code == 1, bad.err
    row = _payload(bad)["rows"][0]
    assert row["verdict"] == "fail" and row["margin"] == pytest.approx(-0.001)
    assert _payload(bad)["meta"]["passed"] is False


def test_ratio_option(cli):
    # --ratio 0.95: required = 0.95 * 0.8 = 0.76; 0.77 passes (it fails at 0.99: 0.77 < 0.792), 0.75 fails
    ok = cli("baseline", "--float-metric", "0.8", "--quant-metric", "0.77", "--ratio", "0.95", "--json")
    assert ok.code == 0, ok.err
    assert _payload(ok)["rows"][0]["required"] == pytest.approx(0.76)
    assert cli("baseline", "--float-metric", "0.8", "--quant-metric", "0.77").code == 1
    assert cli("baseline", "--float-metric", "0.8", "--quant-metric", "0.75", "--ratio", "0.95").code == 1


def test_lower_is_better_mirror_rule(cli):
    # error 0.1 may grow to 0.1 / 0.99 = 0.101010...
    ok = cli("baseline", "--float-metric", "0.1", "--quant-metric", "0.101", "--direction", "lower", "--json")
    assert ok.code == 0, ok.err
    row = _payload(ok)["rows"][0]
    assert row["direction"] == "lower" and row["verdict"] == "pass"
    assert row["required"] == pytest.approx(0.1 / 0.99)
    assert row["margin"] == pytest.approx(0.1 / 0.99 - 0.101)
    assert row["score"] == pytest.approx(0.1 / 0.101)
    bad = cli("baseline", "--float-metric", "0.1", "--quant-metric", "0.102", "--direction", "lower", "--json")
    assert bad.code == 1
    assert _payload(bad)["rows"][0]["margin"] == pytest.approx(0.1 / 0.99 - 0.102)
    # a lower error is fine when lower is better, and fails when higher is better
    assert cli("baseline", "--float-metric", "0.1", "--quant-metric", "0.05", "--direction", "lower").code == 0
    assert cli("baseline", "--float-metric", "0.1", "--quant-metric", "0.05").code == 1
    # ... and vice versa: a grown error passes the higher-is-better rule
    assert cli("baseline", "--float-metric", "0.1", "--quant-metric", "0.102").code == 0


def test_json_files_two_tasks_one_fails(cli, tmp_path):
    # cls: 0.88 / 0.90 = 0.9778 < 0.99 -> fail; aux: 0.797 / 0.80 = 0.99625 -> pass
    _write_json(tmp_path / "f.json", {"cls": 0.90, "aux": 0.80})
    _write_json(tmp_path / "q.json", {"cls": 0.88, "aux": 0.797})
    result = cli("baseline", "--float-json", "f.json", "--quant-json", "q.json", "--json")
    assert result.code == 1, result.err
    payload = _payload(result)
    assert payload["meta"]["verdicts"] == {"cls": "fail", "aux": "pass"}
    rows = _rows(payload)
    assert rows["cls"]["required"] == pytest.approx(0.891) and rows["cls"]["margin"] == pytest.approx(-0.011)
    assert rows["aux"]["required"] == pytest.approx(0.792) and rows["aux"]["margin"] == pytest.approx(0.005)


def test_json_file_with_a_single_number(cli, tmp_path):
    _write_json(tmp_path / "f.json", 0.5)
    _write_json(tmp_path / "q.json", 0.496)  # >= 0.495
    result = cli("baseline", "--float-json", "f.json", "--quant-json", "q.json", "--json")
    assert result.code == 0, result.err
    assert _payload(result)["rows"][0]["required"] == pytest.approx(0.495)


def test_config_per_task_ratio_and_direction(cli, tmp_path):
    (tmp_path / "qdebug.toml").write_text(
        '[tasks.cls]\nratio = 0.95\n\n[tasks.aux]\ndirection = "lower"\nratio = 0.9\n'
    )
    # cls (higher, 0.95): required 0.855, 0.86 passes (would fail at 0.99: 0.891)
    # aux (lower, 0.9): required 0.2 / 0.9 = 0.2222, 0.22 passes
    # det (default 0.99): required 0.495, 0.49 fails
    _write_json(tmp_path / "f.json", {"cls": 0.90, "aux": 0.20, "det": 0.50})
    _write_json(tmp_path / "q.json", {"cls": 0.86, "aux": 0.22, "det": 0.49})
    result = cli("baseline", "--float-json", "f.json", "--quant-json", "q.json", "--json")
    assert result.code == 1, result.err
    rows = _rows(_payload(result))
    assert {t: r["verdict"] for t, r in rows.items()} == {"cls": "pass", "aux": "pass", "det": "fail"}
    assert rows["cls"]["ratio"] == 0.95 and rows["cls"]["required"] == pytest.approx(0.855)
    assert rows["aux"]["direction"] == "lower" and rows["aux"]["required"] == pytest.approx(0.2 / 0.9)
    assert rows["aux"]["margin"] == pytest.approx(0.2 / 0.9 - 0.22)
    assert rows["det"]["ratio"] == 0.99 and rows["det"]["direction"] == "higher"
    # aux at 0.23 breaks its own rule (0.23 > 0.2222) while det is fixed
    _write_json(tmp_path / "q.json", {"cls": 0.86, "aux": 0.23, "det": 0.496})
    result = cli("baseline", "--float-json", "f.json", "--quant-json", "q.json", "--json")
    assert result.code == 1
    assert _payload(result)["meta"]["verdicts"] == {"cls": "pass", "aux": "fail", "det": "pass"}


def test_config_top_level_ratio(cli, tmp_path):
    (tmp_path / "qdebug.toml").write_text("ratio = 0.9\n")
    # required 0.9 * 0.8 = 0.72
    result = cli("baseline", "--float-metric", "0.8", "--quant-metric", "0.73", "--json")
    assert result.code == 0, result.err
    assert _payload(result)["rows"][0]["required"] == pytest.approx(0.72)


# -- exit code 2 ---------------------------------------------------------------------------------
def test_missing_json_file(cli, tmp_path):
    _write_json(tmp_path / "q.json", {"cls": 0.9})
    cli("baseline", "--float-json", "nope.json", "--quant-json", "q.json").assert_error("nope.json")


@pytest.mark.parametrize("bad", ['{"cls": "high"}', '{"cls": true}', '{"cls": null}', '"0.9"', "[0.9]", "{}", "{oops"])
def test_malformed_json_values(cli, tmp_path, bad):
    _write_json(tmp_path / "f.json", bad)
    _write_json(tmp_path / "q.json", {"cls": 0.9})
    cli("baseline", "--float-json", "f.json", "--quant-json", "q.json").assert_error("f.json")


def test_non_finite_value(cli, tmp_path):
    _write_json(tmp_path / "f.json", '{"cls": NaN}')
    _write_json(tmp_path / "q.json", {"cls": 0.9})
    cli("baseline", "--float-json", "f.json", "--quant-json", "q.json").assert_error("cls")


def test_task_missing_in_one_result(cli, tmp_path):
    _write_json(tmp_path / "f.json", {"cls": 0.9, "aux": 0.8})
    _write_json(tmp_path / "q.json", {"cls": 0.9})
    cli("baseline", "--float-json", "f.json", "--quant-json", "q.json").assert_error("aux", "quantized")
    _write_json(tmp_path / "f.json", {"cls": 0.9})
    _write_json(tmp_path / "q.json", {"cls": 0.9, "seg": 0.5})
    cli("baseline", "--float-json", "f.json", "--quant-json", "q.json").assert_error("seg", "float")


def test_only_one_side_given(cli, tmp_path):
    cli("baseline", "--float-metric", "0.9").assert_error("--quant-metric")
    cli("baseline", "--quant-metric", "0.9").assert_error("--float-metric")
    _write_json(tmp_path / "f.json", {"cls": 0.9})
    cli("baseline", "--float-json", "f.json").assert_error("--quant-json")


@pytest.mark.parametrize("args", [
    ["--direction", "sideways"],
    ["--ratio", "0"],
    ["--ratio", "-0.5"],
    ["--confidence", "1.0"],
])
def test_bad_options(cli, args):
    cli("baseline", "--float-metric", "0.9", "--quant-metric", "0.9", *args).assert_error()


def test_no_checkpoints_and_no_config(cli, stages):
    cli("baseline").assert_error("FLOAT and a QUANT")
    cli("baseline", stages.float).assert_error("FLOAT and a QUANT")
    cli("baseline", stages.float, stages.quantized).assert_error("metric")  # no metric given, no config


def test_metric_that_raises(cli, stages, metric_module):
    name = metric_module("def broken(model, batches):\n    raise ValueError('boom in the metric')\n")
    result = cli("baseline", stages.float, stages.quantized, "--metric", f"{name}:broken", "--data", stages.data)
    line = result.assert_error("boom in the metric")
    assert "ValueError" in line


def test_metric_returning_garbage(cli, stages, metric_module):
    name = metric_module("def words(model, batches):\n    return 'great'\n")
    cli("baseline", stages.float, stages.quantized, "--metric", f"{name}:words", "--data", stages.data).assert_error()


# -- output --------------------------------------------------------------------------------------
def test_table_output(cli):
    # f 0.8, q 0.78, ratio 0.95: score 0.975, required 0.76, margin 0.02
    result = cli("baseline", "--float-metric", "0.8", "--quant-metric", "0.78", "--ratio", "0.95")
    assert result.code == 0, result.err
    assert header_cells(result.out) == ["task", "float", "quantized", "score", "ratio", "required", "margin", "verdict"]
    assert body_rows(result.out) == [["metric", "0.8", "0.78", "0.975", "0.95", "0.76", "0.02", "pass"]]
    assert "qdebug compare" not in result.err


def test_junit_pass_and_fail(cli, tmp_path):
    _write_json(tmp_path / "f.json", {"cls": 0.90, "aux": 0.80})
    _write_json(tmp_path / "q.json", {"cls": 0.88, "aux": 0.797})
    result = cli("baseline", "--float-json", "f.json", "--quant-json", "q.json", "--junit", "out/gate.xml")
    assert result.code == 1
    root = ET.parse(tmp_path / "out" / "gate.xml").getroot()
    assert root.tag == "testsuite"
    assert (root.get("tests"), root.get("failures"), root.get("skipped")) == ("2", "1", "0")
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert set(cases) == {"cls", "aux"}
    assert cases["cls"].find("failure") is not None and cases["cls"].find("skipped") is None
    assert "0.88" in cases["cls"].find("failure").text and "0.9" in cases["cls"].find("failure").text
    assert cases["aux"].find("failure") is None and cases["aux"].find("skipped") is None


def test_step_summary_is_appended(cli, tmp_path, monkeypatch):
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    assert cli("baseline", "--float-metric", "0.8", "--quant-metric", "0.78", "--ratio", "0.95").code == 0
    first = summary.read_text()
    assert first.startswith("earlier step\n")
    assert "### qdebug baseline passed" in first
    lines = first.splitlines()
    head = lines.index("| task | float | quantized | score | ratio | required | margin | verdict |")
    assert lines[head + 2] == "| metric | 0.8 | 0.78 | 0.975 | 0.95 | 0.76 | 0.02 | pass |"
    assert cli("baseline", "--float-metric", "0.8", "--quant-metric", "0.7", "--ratio", "0.95").code == 1
    second = summary.read_text()
    assert second.startswith(first)  # appended, not rewritten
    rest = second[len(first):]
    assert "### qdebug baseline FAILED" in rest and "| fail |" in rest
    assert second.count("### qdebug baseline") == 2


def test_no_summary_without_the_variable(cli, tmp_path):
    assert cli("baseline", "--float-metric", "0.8", "--quant-metric", "0.8").code == 0
    assert list(tmp_path.iterdir()) == []


# -- evaluated metrics on real checkpoints (the small ResNet stages) --------------------------------
def test_multi_task_metric_fails_on_one_task(cli, stages, metric_module):
    name = metric_module(_IS_QUANT + '''
def two_heads(model, batches):
    if is_quant(model):
        return {"cls": 0.85, "aux": 0.70}
    return {"cls": 0.90, "aux": 0.70}
''')
    result = cli("baseline", stages.float, stages.quantized, "--metric", f"{name}:two_heads",
                 "--data", stages.data, "--json")
    assert result.code == 1, result.err
    payload = _payload(result)
    assert payload["meta"]["verdicts"] == {"cls": "fail", "aux": "pass"}
    rows = _rows(payload)
    assert rows["cls"]["float"] == 0.90 and rows["cls"]["quantized"] == 0.85
    assert rows["cls"]["required"] == pytest.approx(0.891)
    assert rows["aux"]["margin"] == pytest.approx(0.70 - 0.693)
    assert "qdebug compare" in result.err and str(stages.float) in result.err and str(stages.quantized) in result.err


def test_metric_direction_attribute_and_multi_task_config(cli, tmp_path, stages, metric_module):
    # a dict metric whose 'err' task is lower-is-better by config
    (tmp_path / "qdebug.toml").write_text('[tasks.err]\ndirection = "lower"\n')
    name = metric_module(_IS_QUANT + '''
def heads(model, batches):
    return {"acc": 0.9, "err": 0.105 if is_quant(model) else 0.1}
''')
    result = cli("baseline", stages.float, stages.quantized, "--metric", f"{name}:heads", "--data", stages.data,
                 "--json")
    assert result.code == 1, result.err  # 0.105 > 0.1 / 0.99
    assert _payload(result)["meta"]["verdicts"] == {"acc": "pass", "err": "fail"}
    # a single-number metric declaring direction = "lower" on the function
    name = metric_module(_IS_QUANT + '''
def loss(model, batches):
    return 0.1005 if is_quant(model) else 0.1
loss.direction = "lower"
''')
    (tmp_path / "qdebug.toml").unlink()
    result = cli("baseline", stages.float, stages.quantized, "--metric", f"{name}:loss", "--data", stages.data,
                 "--json")
    assert result.code == 0, result.err
    row = _payload(result)["rows"][0]
    assert row["direction"] == "lower" and row["required"] == pytest.approx(0.1 / 0.99)


_CONFIDENCE_METRIC = _IS_QUANT + '''
def _vec(n, right, lost):
    f = torch.zeros(n, dtype=torch.float64)
    f[:right] = 1
    q = f.clone()
    q[lost] = 0
    return f, q

SAME = _vec(50, 40, [])
TINY = _vec(50, 45, [7])                              # 44/45 = 0.978 on 50 samples
BIG = _vec(5000, 4500, list(range(0, 4500, 18)))      # 250 lost: 4250/4500 = 0.944 on 5000 samples

def scores(model, batches):
    k = 1 if is_quant(model) else 0
    return {"same": SAME[k].clone(), "tiny": TINY[k].clone(), "big": BIG[k].clone()}
scores.per_sample = True

def tiny_only(model, batches):
    return TINY[1 if is_quant(model) else 0].clone()
tiny_only.per_sample = True
'''


def test_confidence_verdicts_junit_and_flips_via_cli(cli, tmp_path, stages, metric_module):
    name = metric_module(_CONFIDENCE_METRIC)
    result = cli("baseline", stages.float, stages.quantized, "--metric", f"{name}:scores", "--data", stages.data,
                 "--confidence", "0.95", "--json", "--junit", "gate.xml")
    assert result.code == 1, result.err  # 'big' fails; inconclusive alone would not fail
    payload = _payload(result)
    assert payload["meta"]["verdicts"] == {"same": "pass", "tiny": "inconclusive", "big": "fail"}
    rows = _rows(payload)
    assert rows["same"]["ci_low"] == rows["same"]["ci_high"] == 1.0
    assert rows["tiny"]["float"] == pytest.approx(0.9) and rows["tiny"]["quantized"] == pytest.approx(0.88)
    assert rows["tiny"]["ci_low"] < 0.99 <= rows["tiny"]["ci_high"]
    assert rows["big"]["ci_high"] < 0.99
    assert rows["big"]["ci_low"] <= 4250 / 4500 <= rows["big"]["ci_high"]
    assert rows["big"]["flipped"] == 250 and rows["tiny"]["flipped"] == 1 and rows["same"]["flipped"] == 0
    assert rows["same"]["mcnemar_p"] == 1.0
    assert rows["tiny"]["mcnemar_p"] == 1.0  # b=1, c=0: 2 * 1/2 = 1
    flipped = payload["meta"]["flipped_samples"]
    assert flipped["tiny"] == [7]
    assert flipped["big"] == list(range(0, 20 * 18, 18))  # the first 20
    root = ET.parse(tmp_path / "gate.xml").getroot()
    assert (root.get("tests"), root.get("failures"), root.get("skipped")) == ("3", "1", "1")
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert cases["big"].find("failure") is not None
    assert cases["tiny"].find("skipped") is not None and cases["tiny"].find("failure") is None
    assert cases["same"].find("failure") is None and cases["same"].find("skipped") is None


def test_inconclusive_does_not_fail_but_the_point_rule_does(cli, stages, metric_module):
    name = metric_module(_CONFIDENCE_METRIC)
    args = ("baseline", stages.float, stages.quantized, "--metric", f"{name}:tiny_only", "--data", stages.data)
    result = cli(*args, "--confidence", "0.95")
    assert result.code == 0, result.err
    assert "inconclusive" in result.out
    assert "right in float, wrong quantized: samples 7" in result.out
    result = cli(*args)  # no --confidence: 0.88 < 0.99 * 0.9 = 0.891
    assert result.code == 1
    assert "qdebug compare" in result.err


# -- the bootstrap and McNemar (library) ------------------------------------------------------------
def test_identical_scores_pass_with_a_point_interval():
    f, q = _vectors(200, 150)
    result = gate({"t": 0.75}, {"t": 0.75}, float_samples={"t": f}, quant_samples={"t": q}, confidence=0.95)
    row = result.frame.iloc[0]
    assert row["verdict"] == "pass"
    assert (row["ci_low"], row["ci_high"]) == (1.0, 1.0)
    assert row["mcnemar_p"] == 1.0 and row["flipped"] == 0
    assert result.flipped == {"t": []}


def test_tiny_gap_on_few_samples_is_inconclusive():
    f, q = _vectors(50, 45, lost=[7])
    rule = TaskRule()
    lo, hi = bootstrap_interval(f, q, rule, confidence=0.95, seed=0)
    # the one lost sample is missing from about (49/50)^50 = 36% of resamples: the score is then exactly 1
    assert hi == 1.0
    assert lo < 0.99
    assert lo <= 44 / 45 <= hi
    assert bootstrap_interval(f, q, rule, confidence=0.95, seed=0) == (lo, hi)
    result = gate({"t": 0.9}, {"t": 0.88}, float_samples={"t": f}, quant_samples={"t": q}, confidence=0.95)
    assert result.frame.iloc[0]["verdict"] == "inconclusive"
    assert result.passed  # inconclusive does not fail the gate
    without = gate({"t": 0.9}, {"t": 0.88}, float_samples={"t": f}, quant_samples={"t": q})
    assert without.frame.iloc[0]["verdict"] == "fail" and math.isnan(without.frame.iloc[0]["ci_low"])


def test_big_gap_on_many_samples_fails():
    f, q = _vectors(5000, 4500, lost=list(range(0, 4500, 18)))
    point = 4250 / 4500
    rule = TaskRule()
    lo, hi = bootstrap_interval(f, q, rule, confidence=0.95, seed=0)
    # sd of the ratio ~ sqrt(250 * (1 - 250/4500)) / 4500 = 0.0034: the 95% interval is about point +- 0.007
    assert lo < point < hi
    assert point - 0.012 < lo and hi < point + 0.012
    assert hi < 0.99
    assert bootstrap_interval(f, q, rule, confidence=0.95, seed=0) == (lo, hi)  # seeded
    assert bootstrap_interval(f, q, rule, confidence=0.95, seed=1) != (lo, hi)  # the seed matters
    lo99, hi99 = bootstrap_interval(f, q, rule, confidence=0.99, seed=0)
    assert lo99 <= lo and hi <= hi99  # a higher confidence widens the interval
    result = gate({"t": 0.9}, {"t": 0.85}, float_samples={"t": f}, quant_samples={"t": q}, confidence=0.95)
    assert result.frame.iloc[0]["verdict"] == "fail" and not result.passed
    again = gate({"t": 0.9}, {"t": 0.85}, float_samples={"t": f}, quant_samples={"t": q}, confidence=0.95)
    assert (again.frame.iloc[0]["ci_low"], again.frame.iloc[0]["ci_high"]) == (lo, hi)


def test_lower_is_better_interval():
    # per-sample errors all 0.2 (float) and 0.4 (quant): every resample gives f / q = 0.5
    f = torch.full((100,), 0.2, dtype=torch.float64)
    q = torch.full((100,), 0.4, dtype=torch.float64)
    lo, hi = bootstrap_interval(f, q, TaskRule("lower"), confidence=0.95)
    assert lo == pytest.approx(0.5) and hi == pytest.approx(0.5)
    result = gate({"e": 0.2}, {"e": 0.4}, {"e": TaskRule("lower")}, float_samples={"e": f}, quant_samples={"e": q},
                  confidence=0.95)
    row = result.frame.iloc[0]
    assert row["verdict"] == "fail" and math.isnan(row["mcnemar_p"])  # not 0/1 scores: no McNemar


def test_mcnemar_hand_computed():
    # b = 8 (float right, quant wrong), c = 2: p = 2 * (C(10,0) + C(10,1) + C(10,2)) / 2^10 = 2 * 56 / 1024
    lost = [1, 4, 6, 10, 11, 15, 17, 19]
    f, q = _vectors(30, 20, lost=lost, gained=[22, 27])
    p, b, c, indices = mcnemar_exact(f, q)
    assert p == pytest.approx(0.109375, abs=1e-12)
    assert (b, c) == (8, 2)
    assert indices == lost
    # symmetric in b and c, but only float-right/quant-wrong samples are listed
    p2, b2, c2, indices2 = mcnemar_exact(q, f)
    assert p2 == pytest.approx(0.109375, abs=1e-12) and (b2, c2) == (2, 8) and indices2 == [22, 27]
    # b = 5, c = 0: 2 / 32
    assert mcnemar_exact(*_vectors(10, 5, lost=[0, 1, 2, 3, 4]))[0] == pytest.approx(0.0625)
    # b = c = 3: 2 * 42 / 64 > 1, capped
    assert mcnemar_exact(*_vectors(12, 6, lost=[0, 1, 2], gained=[6, 7, 8]))[0] == 1.0
    # through gate: the row has p and b + c, the result the listed indices
    result = gate({"t": 20 / 30}, {"t": 14 / 30}, float_samples={"t": f}, quant_samples={"t": q})
    row = result.frame.iloc[0]
    assert row["mcnemar_p"] == pytest.approx(0.109375) and row["flipped"] == 10
    assert result.flipped == {"t": lost}


def test_flipped_indices_are_limited():
    lost = list(range(3, 53, 2))  # 25 samples
    f, q = _vectors(60, 55, lost=lost)
    result = gate({"t": 55 / 60}, {"t": 30 / 60}, float_samples={"t": f}, quant_samples={"t": q})
    assert result.flipped["t"] == lost[:20]
    assert result.frame.iloc[0]["flipped"] == 25
    assert gate({"t": 1.0}, {"t": 1.0}, float_samples={"t": f}, quant_samples={"t": q},
                flipped_limit=3).flipped["t"] == lost[:3]


# -- the demo -----------------------------------------------------------------------------------
def test_demo_passes_from_its_config(cli, monkeypatch):
    monkeypatch.chdir(DEMO)  # qdebug.toml names float.pt, quantized.pt, eval.pt, batch_size 250, top1
    before = sorted(p.name for p in DEMO.iterdir())
    result = cli("baseline", "--batches", "2", "--json")
    assert result.code == 0, result.err
    payload = _payload(result)
    assert payload["meta"]["checkpoints"] == [str(DEMO / "float.pt"), str(DEMO / "quantized.pt")]
    row = payload["rows"][0]
    assert row["verdict"] == "pass" and row["score"] >= 0.99
    # the float value, computed here with plain torch on the same 500 samples
    model, _ = qdebug.load(DEMO / "float.pt")
    batches = load_batches(str(DEMO / "eval.pt"), batch_size=250, batches=2)
    with torch.no_grad():
        right = torch.cat([model.eval()(b.inputs).argmax(-1) == b.target for b in batches])
    assert right.numel() == 500
    assert row["float"] == pytest.approx(float(right.double().mean()))
    assert row["float"] > 0.85 and row["quantized"] > 0.85
    # McNemar from top1's per-sample scores: every listed sample is right in float
    listed = payload["meta"]["flipped_samples"]["top1"]
    assert listed and all(bool(right[i]) for i in listed)
    assert 0 < row["mcnemar_p"] <= 1 and row["flipped"] >= len(listed)
    assert sorted(p.name for p in DEMO.iterdir()) == before  # nothing written into the demo


def test_damaged_checkpoint_fails(cli, tmp_path):
    model, info = qdebug.load(DEMO / "calibrated.pt")
    point = quant_points(model)["features.0.act"]
    with torch.no_grad():
        point.scale.mul_(40)  # the first activation quantized 40x too coarsely
    qdebug.save(model, tmp_path / "damaged.pt", stage="calibrated", sample_inputs=info.sample_inputs)
    data = str(DEMO / "eval.pt")
    float_path = str(DEMO / "float.pt")
    result = cli("baseline", float_path, "damaged.pt", "--metric", "top1", "--data", data,
                 "--batches", "1", "--batch-size", "250", "--json")
    assert result.code == 1, result.err
    row = _payload(result)["rows"][0]
    assert row["verdict"] == "fail"
    assert row["quantized"] < 0.99 * row["float"]
    assert row["quantized"] < row["float"] - 0.05  # clearly damaged, not noise
    hint = [line for line in result.err.splitlines() if line.startswith("hint:")]
    assert hint and f"qdebug compare {float_path} damaged.pt --data {data}" in hint[0]
    # the undamaged calibrated stage passes the same gate
    ok = cli("baseline", float_path, str(DEMO / "calibrated.pt"), "--metric", "top1", "--data", data,
             "--batches", "1", "--batch-size", "250")
    assert ok.code == 0, ok.err


def test_a_float_metric_of_zero_is_an_error_not_a_pass(cli):
    # 0 >= 0.99 x 0 would pass whatever the quantized model does.
    cli("baseline", "--float-metric", "0", "--quant-metric", "0").assert_error(
        "the float model scores 0 on task", "targets match")


def test_the_python_gate_refuses_negative_metric_values_as_the_cli_does():
    from qdebug.errors import QDebugError
    from qdebug.tools.baseline import gate

    with pytest.raises(QDebugError, match="negative"):
        gate({"score": -1.0}, {"score": -1.0})  # 0.99 x -1 would pass -1.0 and fail -0.99
