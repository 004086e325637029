"""One config for every command and the Python API (issue 31 item 4).

After ``qdebug init`` names float and calibrated, every command takes them (baseline and compare
refused before: they looked for qat or quantized only); a config lacking a stage is an error
naming what it has.  ``qdebug.load`` and ``qdebug.compare/step/suggest`` read the same config
with the same walk up and trust rules, and their errors name Python arguments."""

from __future__ import annotations

import json
import os

import pytest
import torch

import qdebug
from qdebug.errors import QDebugError
from user_project import clean_imports, forget, write_package


def _json(result, codes=(0,)) -> dict:
    assert result.code in codes, result.err
    return json.loads(result.out)


def _init_float_and_calibrated(cli, stages) -> None:
    result = cli("init", "--float", stages.float, "--calibrated", stages.calibrated, "--data", stages.data,
                 "--metric", "agreement")
    assert result.code == 0, result.err


def test_every_command_uses_the_float_and_calibrated_init_names(cli, stages, tmp_path):
    _init_float_and_calibrated(cli, stages)
    gate = _json(cli("baseline", "--json"))
    assert gate["meta"]["checkpoints"] == [str(stages.float), str(stages.calibrated)]
    assert gate["meta"]["stages"] == ["float", "calibrated"]
    compared = _json(cli("compare", "--json", "--no-isolated"))
    assert list(compared["meta"]["checkpoints"].values()) == [str(stages.float), str(stages.calibrated)]
    assert set(row["target"] for row in compared["rows"]) == {"calibrated"}
    stepped = cli("step", "--json")
    assert stepped.code == 0, stepped.err
    inspected = _json(cli("inspect", "--json"))
    assert inspected["meta"]["stage"] == "calibrated"


def test_baseline_gates_the_shipped_stage_compare_debugs_the_qat_one(cli, stages, tmp_path):
    (tmp_path / "qdebug.toml").write_text(
        "".join(f'{key} = "{stages.path(key)}"\n' for key in ("float", "calibrated", "qat", "quantized"))
        + f'data = "{stages.data}"\nmetric = "agreement"\n')
    gate = _json(cli("baseline", "--json"), codes=(0, 1))  # the verdict is not the point: which pair it gates
    assert gate["meta"]["stages"] == ["float", "quantized"]
    compared = _json(cli("compare", "--json", "--no-isolated"))
    assert list(compared["meta"]["checkpoints"]) == ["float", "qat"]


@pytest.mark.parametrize("command", ["baseline", "compare"])
def test_a_config_without_a_quantized_stage_says_what_it_names(cli, tmp_path, command):
    (tmp_path / "qdebug.toml").write_text('float = "float.pt"\nmetric = "top1"\n')
    cli(command).assert_error(f"{command} needs a FLOAT and a QUANT checkpoint", "none given, and qdebug.toml "
                              "names float only (no", "qdebug init --calibrated calibrated.pt")
    (tmp_path / "qdebug.toml").write_text('calibrated = "c.pt"\n')
    cli(command).assert_error("qdebug.toml names calibrated only (no float)", "qdebug init --float float.pt")


def test_without_any_config_the_error_says_none_was_found(cli, tmp_path):
    (tmp_path / ".git").mkdir()  # the project's root: the search upward ends here
    cli("compare").assert_error("none given, and no qdebug.toml was found",
                                "qdebug init --float float.pt --calibrated calibrated.pt")


# -- the Python API ----------------------------------------------------------------------------
def test_the_python_api_takes_the_configs_pair_and_data(cli, stages, tmp_path):
    _init_float_and_calibrated(cli, stages)  # cli runs in tmp_path, as these calls do
    with open(tmp_path / "qdebug.toml", "a") as fh:
        fh.write("batch_size = 4\n")
    frame = qdebug.compare(isolated=False)
    assert set(frame["target"]) == {"calibrated"}
    assert frame.attrs["meta"]["batches"] == 3  # the config's data: 12 samples in batches of 4
    # Paths given: still the config's data, as on the command line; config=False: the sample inputs.
    assert qdebug.compare(stages.float, stages.calibrated, isolated=False).attrs["meta"]["batches"] == 3
    explicit = qdebug.compare(stages.float, stages.calibrated, isolated=False, config=False)
    assert explicit.attrs["meta"]["batches"] == 1
    steps = qdebug.step()
    assert "agreement" in steps.columns  # the config's metric
    with pytest.raises(QDebugError) as caught:
        qdebug.compare(config=False)
    assert "qdebug.compare needs models or checkpoint paths: none given" in caught.value.message
    assert 'qdebug.compare("float.pt", "calibrated.pt")' in caught.value.hint


@pytest.fixture
def user_checkpoint(tmp_path):
    """``mypkg.net:Net`` in tmp_path/project, a checkpoint naming it and its plain state_dict."""
    project = tmp_path / "project"
    write_package(project)
    (project / ".git").mkdir()
    with clean_imports(project):
        import sys

        sys.path.insert(0, str(project))
        from mypkg.net import Net

        net = Net()
        qdebug.save(net, project / "net.pt", stage="float")
        torch.save(net.state_dict(), project / "state.pt")
        torch.save(net, project / "whole.pt")
        sys.path.remove(str(project))
        forget("mypkg")
        yield project
        forget("mypkg")


def test_load_reads_the_configs_trust_and_model(user_checkpoint, monkeypatch):
    monkeypatch.chdir(user_checkpoint)
    with pytest.raises(QDebugError) as caught:
        qdebug.load("net.pt")
    hint = caught.value.hint
    assert 'pass trusted_modules=["mypkg"]' in hint and 'model="mypkg.net:Net"' in hint
    assert "--" not in hint and "qdebug init" not in hint  # Python's terms, not the command line's
    (user_checkpoint / "qdebug.toml").write_text('trust = ["mypkg"]\n')
    model, info = qdebug.load("net.pt")
    assert type(model).__name__ == "Net" and info.stage == "float"
    with pytest.raises(QDebugError) as caught:
        qdebug.load("state.pt")
    assert 'model="package.module:Class"' in caught.value.hint
    (user_checkpoint / "qdebug.toml").write_text('model = "mypkg.net:Net"\nmodel_kwargs = { classes = 3 }\n')
    model, info = qdebug.load("state.pt")
    assert info.source == "state_dict" and model.fc.out_features == 3
    model, _ = qdebug.load("net.pt", config=False, trusted_modules=["mypkg"])  # the argument alone
    assert type(model).__name__ == "Net"


def test_a_config_never_allows_unsafe_loading_from_python(user_checkpoint, monkeypatch, capsys):
    monkeypatch.chdir(user_checkpoint)
    (user_checkpoint / "qdebug.toml").write_text('unsafe_load = true\ntrust = ["mypkg"]\n')
    with pytest.raises(QDebugError) as caught:
        qdebug.load("whole.pt")
    assert "unsafe=True" in caught.value.hint and "--unsafe-load" not in caught.value.hint
    assert "unsafe_load is ignored" in capsys.readouterr().err


def test_load_skips_a_config_others_may_write(user_checkpoint, monkeypatch, capsys):
    monkeypatch.chdir(user_checkpoint)
    config = user_checkpoint / "qdebug.toml"
    config.write_text('trust = ["mypkg"]\n')
    os.chmod(config, 0o666)
    with pytest.raises(QDebugError) as caught:
        qdebug.load("net.pt")
    assert "is not trusted" in caught.value.message
    assert f"warning: ignoring config {config}: it is writable by others" in capsys.readouterr().err
    os.chmod(config, 0o644)
    assert type(qdebug.load("net.pt")[0]).__name__ == "Net"


def test_cli_hints_become_python_arguments():
    from qdebug.api import in_python_terms
    from qdebug.io.modelspec import FACTORY_HINT

    assert in_python_terms(FACTORY_HINT).startswith(
        'if it is your factory, pass model="package.module:function" with its model_kwargs=')
    assert in_python_terms("pass --device cpu, or --data a.pt --batch-size 4 (or --metric)") == \
        'pass device="cpu", or data="a.pt" batch_size=4 (or metric=)'
    # A command printed to run in a shell keeps its flags.
    command = "convert it once: qdebug import state.pt --model pkg.net:Net -o net.pt"
    assert in_python_terms(command) == command
