"""``qdebug init``: writes qdebug.toml, adds to an existing config without disturbing it, refuses
what it cannot do safely (the file stays byte for byte as it was), and fixes the refusal of a
user's own model class in one step."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest

import qdebug
from qdebug.config.project import load_config

from user_project import clean_imports, forget, write_package


def _toml(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def test_init_writes_a_new_qdebug_toml(cli, tmp_path):
    result = cli("init", "--trust", "mypkg", "--trust", "other.models", "--model", "mypkg.net:Net",
                 "--metric", "top1", "--data", "data/eval.pt", "--float", "ckpt/float.pt")
    assert result.code == 0, result.err
    path = tmp_path / "qdebug.toml"
    assert _toml(path) == {"trust": ["mypkg", "other.models"], "model": "mypkg.net:Net", "metric": "top1",
                           "data": "data/eval.pt", "float": "ckpt/float.pt"}
    config = load_config(path)  # what every command reads
    assert config.get("float") == str(tmp_path / "ckpt" / "float.pt")
    assert config.get("data") == str(tmp_path / "data" / "eval.pt")
    assert "wrote qdebug.toml" in result.err and "ckpt/float.pt does not exist yet" in result.err
    assert "trust" in result.out and '"mypkg.net:Net"' in result.out


def test_init_without_options_writes_a_valid_starter(cli, tmp_path):
    result = cli("init")
    assert result.code == 0, result.err
    assert load_config(tmp_path / "qdebug.toml").values == {}
    assert "# model = " in (tmp_path / "qdebug.toml").read_text()
    again = cli("init")
    assert again.code == 0 and "nothing to add" in again.out


def test_init_json_rows_say_what_changed(cli, tmp_path):
    (tmp_path / "qdebug.toml").write_text('trust = ["a"]\nmetric = "top1"\n')
    result = cli("init", "--trust", "b", "--metric", "top1", "--model", "a.m:Net", "--json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    assert sorted(payload["rows"], key=lambda r: r["key"]) == [
        {"key": "metric", "value": '"top1"', "action": "unchanged"},
        {"key": "model", "value": '"a.m:Net"', "action": "added"},
        {"key": "trust", "value": '["a", "b"]', "action": "extended"},
    ]
    assert payload["meta"]["created"] is False and payload["meta"]["written"] is True


EXISTING = """\
# my project
float = "ckpt/float.pt"   # the float model
trust = [
    "first",   # the first package
]

# per task
[tasks.top1]
ratio = 0.98

[qconfig.activation]
observer = "percentile"
"""


def test_init_adds_keys_before_the_first_table_and_keeps_every_line(cli, tmp_path):
    path = tmp_path / "qdebug.toml"
    path.write_text(EXISTING)
    result = cli("init", "--trust", "mypkg", "--model", "mypkg.net:Net", "--quantized", "ckpt/q.pt")
    assert result.code == 0, result.err
    after = path.read_text()
    before = tomllib.loads(EXISTING)
    assert tomllib.loads(after) == {**before, "trust": ["first", "mypkg"], "model": "mypkg.net:Net",
                                    "quantized": "ckpt/q.pt"}
    kept = [line for line in EXISTING.splitlines() if not line.startswith(("trust", "    \"first\"", "]"))]
    remaining = iter(after.splitlines())
    assert all(any(line == other for other in remaining) for line in kept)  # in order, unchanged
    assert after.index('model = "mypkg.net:Net"') < after.index("# per task") < after.index("[tasks.top1]")
    load_config(path)


def test_init_refuses_to_change_a_value_without_force(cli, tmp_path):
    path = tmp_path / "qdebug.toml"
    path.write_text(EXISTING)
    cli("init", "--float", "other.pt", "--trust", "x").assert_error(
        f"{path} already sets float = \"ckpt/float.pt\"", "--force")
    assert path.read_text() == EXISTING  # nothing written, not even the trust part
    result = cli("init", "--float", "other.pt", "--force")
    assert result.code == 0, result.err
    assert _toml(path) == {**tomllib.loads(EXISTING), "float": "other.pt"}
    assert "# the float model" not in path.read_text() and "# my project" in path.read_text()


def test_init_refuses_an_invalid_existing_file(cli, tmp_path):
    path = tmp_path / "qdebug.toml"
    path.write_text("trust = [\n")
    for extra in ([], ["--force"]):
        cli("init", "--trust", "mypkg", *extra).assert_error("is not valid TOML", "fix the syntax error")
        assert path.read_text() == "trust = [\n"


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--trust", "mypkg.net:Net"), "--trust 'mypkg.net:Net' names a class"),
        (("--trust", "my-pkg"), "--trust 'my-pkg' is not a package or module name"),
        (("--model", "mypkg.Net"), "--model 'mypkg.Net' is not of the form package.module:Name"),
        (("--metric", "accuracy"), "--metric 'accuracy' is not of the form package.module:Name"),
        (("--data", "somewhere"), "--data 'somewhere' is not of the form package.module:Name"),
    ],
)
def test_init_checks_its_values_before_writing(cli, tmp_path, args, fragment):
    cli("init", *args).assert_error(fragment)
    assert not (tmp_path / "qdebug.toml").exists()


def test_init_adds_to_the_config_found_upward_with_paths_relative_to_it(cli, tmp_path, monkeypatch):
    (tmp_path / "qdebug.toml").write_text('metric = "top1"\n')
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path / "runs")
    result = cli("init", "--qat", "qat.pt")
    assert result.code == 0, result.err
    assert not (tmp_path / "runs" / "qdebug.toml").exists()  # a new file here would hide the project's
    assert _toml(tmp_path / "qdebug.toml") == {"metric": "top1", "qat": "runs/qat.pt"}
    assert load_config(start=tmp_path / "runs").get("qat") == str(tmp_path / "runs" / "qat.pt")


PYPROJECT = """\
[project]
name = "mine"

[tool.qdebug]
metric = "top1"

[tool.qdebug.tasks.top1]
ratio = 0.97

[tool.pytest.ini_options]
addopts = "-q"
"""


def test_init_adds_to_tool_qdebug_of_pyproject(cli, tmp_path):
    path = tmp_path / "pyproject.toml"
    path.write_text(PYPROJECT)
    result = cli("init", "--trust", "mypkg")
    assert result.code == 0, result.err
    assert not (tmp_path / "qdebug.toml").exists()
    expected = tomllib.loads(PYPROJECT)
    expected["tool"]["qdebug"]["trust"] = ["mypkg"]
    assert _toml(path) == expected
    assert load_config(path).get("trust") == ["mypkg"]


def test_init_adds_a_tool_qdebug_table_to_a_named_pyproject(cli, tmp_path):
    path = tmp_path / "pyproject.toml"
    path.write_text('[project]\nname = "mine"\n')
    result = cli("--config", path, "init", "--trust", "mypkg")
    assert result.code == 0, result.err
    assert _toml(path) == {"project": {"name": "mine"}, "tool": {"qdebug": {"trust": ["mypkg"]}}}


def test_init_refuses_a_layout_it_cannot_edit_safely(cli, tmp_path):
    path = tmp_path / "pyproject.toml"
    text = '[tool]\nqdebug.metric = "top1"\n'  # [tool.qdebug] written as dotted keys
    path.write_text(text)
    cli("init", "--trust", "mypkg").assert_error("nothing was written", 'trust = ["mypkg"]')
    assert path.read_text() == text


def test_init_fixes_the_refusal_of_your_own_model_class(cli, tmp_path, monkeypatch):
    import torch

    write_package(tmp_path)
    with clean_imports(tmp_path):
        sys.path.insert(0, str(tmp_path))
        from mypkg.net import Net

        qdebug.save(Net().eval(), tmp_path / "net.pt", stage="float", sample_inputs=torch.randn(2, 4))
        sys.path.remove(str(tmp_path))
        forget("mypkg")
        monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and Path(p) != tmp_path])
        refused = cli("inspect", "net.pt")
        refused.assert_error("names model class mypkg.net:Net")
        command = refused.err.split("(", 1)[1].split(" writes it)")[0]  # what the hint says to run
        assert command == "qdebug init --trust mypkg"
        result = cli(*command.split()[1:])
        assert result.code == 0, result.err
        ok = cli("inspect", "net.pt", "--json")  # and no flag is needed any more
        assert ok.code == 0, ok.err
        assert json.loads(ok.out)["meta"]["model"]["class"] == "mypkg.net:Net"
        forget("mypkg")
