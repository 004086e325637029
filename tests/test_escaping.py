"""No escape sequence reaches a terminal (issue 27, item 3): names and messages that come from
files or user code -- quant point and layer names, model kwargs, state keys, task names,
import-report rows, paths, exception messages -- are shown escaped (``qdebug.safe_text``) in
tables, CSV, summaries, Markdown, JUnit and ``error:`` lines; JSON and plan.toml carry them
exactly, escaped by their own rules.

Every case plants the same payload: an OSC that retitles the window, a CSI that recolours, a
C1 CSI (U+009B), a right-to-left override (U+202E) and a newline followed by a fake
``error:`` line.  None of those characters may appear on stdout or stderr, and no line may
start with the fake one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

import qdebug
from qdebug.engine import QConfig, calibrate, prepare
from qdebug.safe_text import escaped

PAYLOAD = "x\x1b]0;pwned\x07\x1b[31m\u202e\x9b\nerror: fake verdict PASSED"
RAW = ("\x1b", "\x9b", "\u202e", "\x07")  # none of these may reach a terminal
FAKE = "error: fake verdict PASSED"
REPO = Path(__file__).resolve().parent.parent


def _assert_inert(*texts: str) -> None:
    """No raw control, C1 or bidi character, and no line that starts with the fake verdict."""
    for text in texts:
        for ch in RAW:
            assert ch not in text, (ch, text)
        assert not any(line.lstrip().startswith(FAKE) for line in text.splitlines()), text


def _assert_inert_result(result) -> None:
    _assert_inert(result.out, result.err)


def _strings(value) -> set[str]:
    """Every string in a JSON document, keys included."""
    if isinstance(value, dict):
        return set(value) | set().union(*map(_strings, value.values()))
    if isinstance(value, list):
        return set().union(*map(_strings, value))
    return {value} if isinstance(value, str) else set()


# -- the rule --------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, shown", [
    ("\x1b[31m", "\\x1b[31m"),
    ("a\nb\rc\td", "a\\nb\\rc\\td"),
    ("\x7f\x9b\x85", "\\x7f\\x9b\\x85"),
    ("\u202egpj.exe", "\\u202egpj.exe"),
    ("\u2066\u2069\u200e\u200f\u061c\u202a", "\\u2066\\u2069\\u200e\\u200f\\u061c\\u202a"),
    ("\u2028", "\\u2028"),
    ("\udcff", "\\udcff"),  # a file name that is not UTF-8 (surrogateescape)
])
def test_controls_and_bidi_are_escaped_as_repr_writes_them(raw, shown):
    assert escaped(raw) == shown


def test_printable_text_stays_as_it_is():
    for text in ("layer3.1.conv2", "é中 ünïcødé", "C:\\models\\net.pt", "it's \"quoted\"", "[bold]x[/]", ""):
        assert escaped(text) == text


def test_the_rule_imports_without_torch_pandas_or_rich():
    code = ("import sys, qdebug.safe_text; "
            "sys.exit(sorted(m for m in ('torch', 'pandas', 'rich') if m in sys.modules) != [])")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


# -- error lines -----------------------------------------------------------------------------
def _edited(stages, edit, tmp_path: Path, name: str = "x.pt") -> Path:
    ckpt = torch.load(stages.path("calibrated"), map_location="cpu", weights_only=True)
    edit(ckpt)
    path = tmp_path / name
    torch.save(ckpt, path)
    return path


def _kwarg(ckpt: dict) -> None:
    ckpt["model"]["kwargs"][PAYLOAD] = 1


def _state_key(ckpt: dict) -> None:
    ckpt["state"][PAYLOAD] = torch.zeros(1)


def _class(ckpt: dict) -> None:
    ckpt["model"]["class"] = "torch.nn:Lin" + PAYLOAD


@pytest.mark.parametrize("edit", [_kwarg, _state_key, _class], ids=lambda f: f.__name__.strip("_"))
def test_a_crafted_checkpoint_is_one_inert_error_line(cli, stages, tmp_path, edit):
    result = cli("inspect", _edited(stages, edit, tmp_path))
    result.assert_error()
    _assert_inert_result(result)
    assert "\\x1b" in result.err  # shown, not dropped: the reader sees what the file holds


def test_a_path_with_controls_is_shown_escaped(cli, tmp_path):
    result = cli("inspect", tmp_path / f"{PAYLOAD}.pt")
    result.assert_error("no such file")
    _assert_inert_result(result)


def test_an_exception_message_from_user_code_is_one_inert_line(cli, stages, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"qdesc_metric_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(f"def broken(model, batches):\n    raise ValueError({PAYLOAD!r})\n")
    result = cli("baseline", stages.float, stages.quantized, "--metric", f"{name}:broken", "--data", stages.data)
    result.assert_error()
    _assert_inert_result(result)


def test_the_error_printer_escapes_any_message(capsys):
    from qdebug.cli.app import _say_error
    from qdebug.errors import QDebugError

    _say_error(QDebugError(f"internal error: ValueError: {PAYLOAD}", f"hint {PAYLOAD}"))
    err = capsys.readouterr().err
    _assert_inert(err)
    assert [line.split(":")[0] for line in err.splitlines()] == ["error", "hint"]


# -- task names: table, CSV, JSON, JUnit, Markdown -------------------------------------------
@pytest.mark.parametrize("fmt", ["table", "csv", "json"])
def test_task_names_from_json_results(cli, tmp_path, monkeypatch, fmt):
    (tmp_path / "f.json").write_text(json.dumps({PAYLOAD: 0.9, "aux": 0.8}))
    (tmp_path / "q.json").write_text(json.dumps({PAYLOAD: 0.5, "aux": 0.8}))
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = cli("baseline", "--float-json", "f.json", "--quant-json", "q.json", "--format", fmt,
                 "--junit", "junit.xml", "--out", "out")
    assert result.code == 1, result.err
    _assert_inert_result(result)
    _assert_inert(summary.read_text(), (tmp_path / "junit.xml").read_text(), (tmp_path / "out/baseline.csv").read_text())
    assert len(summary.read_text().strip().splitlines()) == 6  # heading, blank, header, rule, 2 rows: no broken row
    cases = ET.parse(tmp_path / "junit.xml").getroot().findall("testcase")
    assert sorted(c.get("name") for c in cases) == sorted(["aux", escaped(PAYLOAD)])
    if fmt == "json":  # JSON carries the exact name, escaped by JSON itself
        assert PAYLOAD in [row["task"] for row in json.loads(result.out)["rows"]]
    assert PAYLOAD in [row["task"] for row in json.loads((tmp_path / "out/baseline.json").read_text())["rows"]]


# -- layer and quant point names: inspect, compare, suggest, plan.toml -----------------------
EVIL_NET = f"""\
import torch.nn as nn

NAME = {PAYLOAD.replace('.', '_')!r}  # a module name may hold anything but a dot


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module(NAME, nn.Conv2d(1, 4, 3))

    def forward(self, x):
        return getattr(self, NAME)(x)
"""


@pytest.fixture
def evil(tmp_path, monkeypatch):
    """A trusted user model whose one layer is named PAYLOAD: float and calibrated checkpoints,
    data, and a qdebug.toml that trusts the module."""
    name = f"qdesc_net_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(EVIL_NET)
    (tmp_path / "qdebug.toml").write_text(f'trust = ["{name}"]\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    torch.manual_seed(0)
    net = module.Net().eval()
    x = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    qdebug.save(net, tmp_path / "f.pt", stage="float", sample_inputs=x[:2])
    cal = calibrate(prepare(net, QConfig(), example_inputs=x), [x])
    qdebug.save(cal, tmp_path / "c.pt", stage="calibrated", sample_inputs=x[:2])
    torch.save((x, torch.randint(0, 2, (8,))), tmp_path / "d.pt")
    return module.NAME


@pytest.mark.parametrize("fmt", ["table", "csv", "json"])
def test_layer_names_in_inspect_and_compare(cli, evil, tmp_path, fmt):
    for args in (["inspect", "c.pt"], ["compare", "f.pt", "c.pt", "--data", "d.pt", "--no-isolated"]):
        result = cli(*args, "--format", fmt, "--out", f"out_{args[0]}")
        assert result.code == 0, result.err
        _assert_inert_result(result)
        for csv in (tmp_path / f"out_{args[0]}").glob("*.csv"):
            _assert_inert(csv.read_text())
        if fmt == "json":  # JSON's own escapes, the exact name behind them
            assert "\\u202e" in result.out and evil in _strings(json.loads(result.out))


def test_suggest_writes_a_plan_toml_that_reads_back_the_exact_name(cli, evil, tmp_path):
    result = cli("suggest", "f.pt", "c.pt", "--data", "d.pt", "--min-sqnr", "70", "--out", "out")
    assert result.code == 0, result.err
    _assert_inert_result(result)
    text = (tmp_path / "out/plan.toml").read_text()
    _assert_inert(text)
    plan = tomllib.loads(text)
    assert evil in plan["overrides"], list(plan["overrides"])  # the exact name, back from TOML
    _assert_inert((tmp_path / "out/suggest.csv").read_text())
    applied = cli("calibrate", "f.pt", "--data", "d.pt", "--qconfig", "out/plan.toml", "-o", "c16.pt")
    assert applied.code == 0, applied.err  # the plan applies as written: its globs name the points
    _assert_inert_result(applied)


def test_toml_keys_and_strings_round_trip():
    from qdebug.config.project import toml_key, toml_value

    for text in (PAYLOAD, 'a "quoted" \\ name', "bare_key-1", "a.b", "", "\U000e0001tag"):
        document = f"{toml_key(text)} = {toml_value(text)}\n[t.{toml_key(text)}]\nk = 1\n"
        _assert_inert(document)
        parsed = tomllib.loads(document)
        assert parsed[text] == text and parsed["t"][text] == {"k": 1}


# -- import reports: inspect's rows ----------------------------------------------------------
def test_inspect_shows_a_crafted_import_report_escaped(cli, stages, tmp_path):
    row = {"source": PAYLOAD, "kind": "activation", "point": "", "status": "exact", "spec": PAYLOAD,
           "note": PAYLOAD, "scale_min": None, "scale_max": None}

    def edit(ckpt: dict) -> None:
        ckpt["meta"]["import"] = [row]
        ckpt["meta"]["import_flow"] = PAYLOAD

    path = _edited(stages, edit, tmp_path)
    result = cli("inspect", path, "--out", "out")
    assert result.code in (0, 1), result.err
    assert "pwned" in result.out, result.out  # the row is shown ...
    _assert_inert_result(result)  # ... escaped
    _assert_inert((tmp_path / "out/inspect_import.csv").read_text())


def test_import_shows_a_crafted_torch_ao_state_dict_key_escaped(cli, tmp_path):
    pytest.importorskip("torch.ao.quantization")
    from small_models import SMALL_RESNET
    from test_interop_cli import RESNET, _eager

    state = _eager(True, "x86").state_dict()
    state[PAYLOAD] = torch.zeros(1)
    torch.save(state, tmp_path / "sd.pt")
    result = cli("import", "sd.pt", "--from", "torch-ao", "--model", RESNET, "--model-kwargs", json.dumps(SMALL_RESNET),
                 "--data", "random:2x1x16x16", "-o", "q.pt")
    result.assert_error("unexpected 1 key(s)")
    _assert_inert_result(result)


def test_a_python_warning_quoting_a_name_is_one_inert_line(tmp_path, capsys):
    """A warning raised while a command runs (here by the user's metric) goes through the same rule."""
    import warnings

    from qdebug.cli.app import _escaped_warnings

    with _escaped_warnings(), warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("layer x\x1b]0;pwned\x07\nerror: fake verdict PASSED", UserWarning)
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err
    assert not any(line.startswith("error:") for line in err.splitlines())
    assert "\\x1b]0;pwned\\x07\\nerror: fake verdict PASSED" in err
