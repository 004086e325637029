"""Project configuration: discovery, --config, validation, relative paths, CLI precedence."""

from __future__ import annotations

import json
import shutil

import pytest

import qdebug
from qdebug.config.project import VALID_KEYS, find_config, load_config
from qdebug.errors import QDebugError


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# -- discovery --------------------------------------------------------------------------------
def test_qdebug_toml_found_from_a_subdirectory(tmp_path):
    cfg = _write(tmp_path / "proj" / "qdebug.toml", 'float = "ckpt/float.pt"\nbatch_size = 16\n')
    deep = tmp_path / "proj" / "a" / "b"
    deep.mkdir(parents=True)
    assert find_config(deep) == cfg
    config = load_config(start=deep)
    assert config.path == cfg.resolve()
    assert config.get("batch_size") == 16
    # relative to the file's directory, not to where qdebug runs
    assert config.get("float") == str((tmp_path / "proj" / "ckpt" / "float.pt").resolve())


def test_pyproject_tool_qdebug_found_and_other_pyprojects_end_the_search(tmp_path):
    outer = _write(tmp_path / "pyproject.toml", '[project]\nname = "x"\n[tool.qdebug]\nmetric = "top5"\nqat = "q.pt"\n')
    start = tmp_path / "src"
    start.mkdir()
    assert find_config(start) == outer
    config = load_config(start=start)
    assert config.values == {"metric": "top5", "qat": str((tmp_path / "q.pt").resolve())}
    # a pyproject.toml without [tool.qdebug] is another project's root: the search stops there, as git's at .git
    _write(tmp_path / "pkg" / "pyproject.toml", '[project]\nname = "inner"\n[tool.other]\nx = 1\n')
    (tmp_path / "pkg" / "src").mkdir()
    assert find_config(tmp_path / "pkg" / "src") is None


def test_qdebug_toml_wins_over_pyproject_in_the_same_directory(tmp_path):
    _write(tmp_path / "pyproject.toml", '[tool.qdebug]\nmetric = "top5"\n')
    toml = _write(tmp_path / "qdebug.toml", 'metric = "top1"\n')
    assert find_config(tmp_path) == toml
    assert load_config(start=tmp_path).get("metric") == "top1"


def test_nearest_config_wins(tmp_path):
    _write(tmp_path / "qdebug.toml", 'metric = "top5"\n')
    inner = _write(tmp_path / "sub" / "qdebug.toml", 'metric = "mse"\n')
    assert find_config(tmp_path / "sub") == inner


def test_no_config_is_empty(tmp_path):
    assert find_config(tmp_path) is None
    config = load_config(start=tmp_path)
    assert config.values == {} and config.path is None


def test_explicit_path_and_relative_data(tmp_path):
    cfg = _write(tmp_path / "conf" / "other.toml",
                 'data = "data/eval.pt"\nout = "results"\nqconfig = {activation = {observer = "ema"}}\n')
    config = load_config(cfg)
    assert config.get("data") == str((tmp_path / "conf" / "data" / "eval.pt").resolve())
    assert config.get("out") == str((tmp_path / "conf" / "results").resolve())
    assert config.get("qconfig") == {"activation": {"observer": "ema"}}
    # absolute paths and non-file data specs are kept as written
    cfg2 = _write(tmp_path / "abs.toml", f'float = "{tmp_path / "x.pt"}"\ndata = "random:2x1x16x16"\n')
    assert load_config(cfg2).values == {"float": str(tmp_path / "x.pt"), "data": "random:2x1x16x16"}
    with pytest.raises(QDebugError, match="config file not found"):
        load_config(tmp_path / "missing.toml")


# -- validation --------------------------------------------------------------------------------
def test_unknown_key_names_it_and_lists_valid_keys(tmp_path):
    _write(tmp_path / "qdebug.toml", 'metric = "top1"\nbatchsize = 8\n')
    with pytest.raises(QDebugError) as exc:
        load_config(start=tmp_path)
    assert "batchsize" in exc.value.message
    for key in VALID_KEYS:
        assert key in exc.value.hint


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("batch_size = \"8\"\n", "batch_size must be an integer"),
        ("batches = true\n", "batches must be an integer, not a boolean"),
        ("ratio = \"high\"\n", "ratio must be a number"),
        ("unsafe_load = 1\n", "unsafe_load must be true or false"),
        ("[tasks.cls]\ndirection = \"up\"\n", "direction must be 'higher' or 'lower'"),
        ("[tasks.cls]\nratoi = 0.9\n", "unknown key(s) ratoi"),
    ],
)
def test_wrong_types_are_errors(tmp_path, text, fragment):
    _write(tmp_path / "qdebug.toml", text)
    with pytest.raises(QDebugError) as exc:
        load_config(start=tmp_path)
    assert fragment in exc.value.message


def test_valid_tasks_and_ratio(tmp_path):
    _write(tmp_path / "qdebug.toml", 'ratio = 0.98\n[tasks.cls]\ndirection = "higher"\n[tasks.aux]\nratio = 1\n')
    config = load_config(start=tmp_path)
    assert config.get("ratio") == 0.98
    assert config.get("tasks") == {"cls": {"direction": "higher"}, "aux": {"ratio": 1}}


def test_invalid_toml(tmp_path):
    _write(tmp_path / "qdebug.toml", "metric = \n")
    with pytest.raises(QDebugError, match="not valid TOML"):
        load_config(start=tmp_path)


# -- through the CLI --------------------------------------------------------------------------
def test_cli_invalid_toml_is_one_error_line(cli, tmp_path, stages):
    _write(tmp_path / "qdebug.toml", "float = [\n")
    cli("inspect", stages.float).assert_error("not valid TOML", "qdebug.toml")


def test_cli_unknown_config_key(cli, tmp_path, stages):
    _write(tmp_path / "qdebug.toml", "flaot = 'x.pt'\n")
    line = cli("inspect", stages.float).assert_error("valid keys:", "model_kwargs")
    assert "flaot" in line


def test_inspect_without_path_uses_the_config_from_a_subdirectory(cli, tmp_path, stages, monkeypatch):
    proj = tmp_path / "proj"
    (proj / "ckpt").mkdir(parents=True)
    shutil.copy(stages.quantized, proj / "ckpt" / "q.pt")
    _write(proj / "pyproject.toml", '[tool.qdebug]\nquantized = "ckpt/q.pt"\n')
    sub = proj / "src" / "deep"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    result = cli("inspect", "--json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    assert payload["meta"]["stage"] == "quantized"
    assert payload["meta"]["path"] == str((proj / "ckpt" / "q.pt").resolve())


def test_inspect_without_path_or_config_is_an_error(cli):
    cli("inspect").assert_error("error: no checkpoint given", "qdebug.toml")


def test_config_option_picks_a_file(cli, tmp_path, stages):
    _write(tmp_path / "qdebug.toml", f'float = "{stages.float}"\n')  # would be found, but --config wins
    _write(tmp_path / "elsewhere" / "alt.toml", f'qat = "{stages.qat}"\n')
    result = cli("--config", tmp_path / "elsewhere" / "alt.toml", "inspect", "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["meta"]["stage"] == "qat"
    result = cli("inspect", "--json")
    assert json.loads(result.out)["meta"]["stage"] == "float"
    cli("--config", tmp_path / "nope.toml", "inspect").assert_error("config file not found")


def test_config_model_names_plain_state_dicts(cli, tmp_path, stages):
    import torch

    torch.save(stages.models["float"].state_dict(), tmp_path / "sd.pt")
    cli("inspect", "sd.pt").assert_error("--model")
    _write(tmp_path / "qdebug.toml",
           f'model = "{stages.spec}"\nmodel_kwargs = {json.dumps(stages.kwargs).replace(":", " =")}\n')
    assert load_config(start=tmp_path).get("model_kwargs") == stages.kwargs
    result = cli("inspect", "sd.pt", "--data", "random:2x1x16x16", "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["meta"]["model"]["class"] == stages.spec


def _calibrate_config(tmp_path, stages):
    _write(tmp_path / "cfgdir" / "qdebug.toml",
           f'float = "{stages.float}"\ndata = "eval.pt"\nbatch_size = 4\nbatches = 1\nmode = "with_bn"\n'
           '[qconfig.activation]\nobserver = "ema"\n')
    shutil.copy(stages.data, tmp_path / "cfgdir" / "eval.pt")
    (tmp_path / "run").mkdir()


def test_calibrate_takes_config_values(cli, tmp_path, stages, monkeypatch):
    _calibrate_config(tmp_path, stages)
    monkeypatch.chdir(tmp_path / "run")  # data = "eval.pt" is relative to the config, not the cwd
    result = cli("--config", tmp_path / "cfgdir" / "qdebug.toml", "calibrate", "-o", "cal.pt")
    assert result.code == 0, result.err
    model, info = qdebug.load(tmp_path / "run" / "cal.pt")
    assert info.meta["calibration_batches"] == 1
    assert info.qat_mode == "with_bn"
    assert info.qconfig.activation.observer == "ema"
    assert info.sample_inputs.shape == (4, 1, 16, 16)  # batch_size 4 from the config


def test_cli_flags_override_config_values(cli, tmp_path, stages, monkeypatch):
    _calibrate_config(tmp_path, stages)
    monkeypatch.chdir(tmp_path / "run")
    result = cli("--config", tmp_path / "cfgdir" / "qdebug.toml", "calibrate", "-o", "cal.pt",
                 "--batches", "2", "--batch-size", "3", "--mode", "with_bn_reverse_fold", "--observer", "percentile")
    assert result.code == 0, result.err
    model, info = qdebug.load(tmp_path / "run" / "cal.pt")
    assert info.meta["calibration_batches"] == 2
    assert info.qat_mode == "with_bn_reverse_fold"
    assert info.qconfig.activation.observer == "percentile"
    assert info.sample_inputs.shape == (3, 1, 16, 16)


# -- trust: your own model classes ---------------------------------------------------------------
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from user_project import clean_imports, forget, write_package  # noqa: E402


@pytest.mark.parametrize(
    "text, message, hint",
    [
        ('trust = "mypkg"', "trust must be a list, got the string 'mypkg'", 'trust = ["mypkg"]'),
        ("trust = [1]", "non-empty strings, got 1", 'trust = ["mypkg"]'),
        ('trust = [""]', "non-empty strings, got ''", 'trust = ["mypkg"]'),
        ('trust = ["mypkg.net:Net"]', "names a class", 'trust = ["mypkg"]'),
        ('trust = ["my-pkg"]', "'my-pkg' is not a package or module name", "importable names"),
        ("trust = {a = 1}", "trust must be a list, got dict", "docs/config.md"),
    ],
)
def test_trust_must_be_a_list_of_package_names(tmp_path, text, message, hint):
    cfg = _write(tmp_path / "qdebug.toml", text + "\n")
    with pytest.raises(QDebugError) as exc:
        load_config(cfg)
    assert message in exc.value.message and str(cfg) in exc.value.message
    assert hint in exc.value.hint


def test_valid_trust_list(tmp_path):
    cfg = _write(tmp_path / "qdebug.toml", 'trust = ["mypkg", " other.models "]\n')
    assert load_config(cfg).get("trust") == ["mypkg", "other.models"]
    assert "trust" in VALID_KEYS


@pytest.fixture
def user_project(tmp_path, monkeypatch, cli):
    """mypkg/net.py in tmp_path (the cli's working directory), a checkpoint of its Net, and
    nothing of it importable before qdebug finds it."""
    import torch

    write_package(tmp_path)
    with clean_imports(tmp_path):
        sys.path.insert(0, str(tmp_path))
        from mypkg.net import Net

        torch.manual_seed(0)
        qdebug.save(Net().eval(), tmp_path / "net.pt", stage="float", sample_inputs=torch.randn(2, 4))
        sys.path.remove(str(tmp_path))
        forget("mypkg")
        monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and Path(p) != tmp_path])
        yield tmp_path
        forget("mypkg")


def test_own_model_refused_once_then_trusted_from_the_config(cli, user_project):
    first = cli("inspect", "net.pt")
    first.assert_error("names model class mypkg.net:Net",
                       'hint: if you trust it, add  trust = ["mypkg"]  to qdebug.toml (qdebug init --trust mypkg '
                       "writes it), or pass --model mypkg.net:Net")
    _write(user_project / "qdebug.toml", 'trust = ["mypkg"]\n')
    result = cli("inspect", "net.pt", "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["meta"]["model"]["class"] == "mypkg.net:Net"


def test_own_model_found_from_the_config_directory_below_it(cli, user_project, monkeypatch):
    _write(user_project / "qdebug.toml", 'trust = ["mypkg"]\nfloat = "net.pt"\n')
    (user_project / "runs" / "today").mkdir(parents=True)
    monkeypatch.chdir(user_project / "runs" / "today")  # mypkg/ is not here: the config's folder has it
    result = cli("inspect", "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["meta"]["model"]["class"] == "mypkg.net:Net"


def test_config_metric_found_from_the_config_directory(cli, tmp_path, stages, monkeypatch):
    with clean_imports(tmp_path):
        monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
        (tmp_path / "proj" / "sub").mkdir(parents=True)
        (tmp_path / "proj" / "proj_metrics.py").write_text(
            "def first_target(model, batches):\n"
            "    for inputs, target in batches:\n"
            "        return float(target[0]) + 1  # never 0: a float metric of 0 is refused\n")
        _write(tmp_path / "proj" / "qdebug.toml", f'metric = "proj_metrics:first_target"\ndata = "{stages.data}"\n')
        monkeypatch.chdir(tmp_path / "proj" / "sub")
        result = cli("baseline", stages.float, stages.quantized, "--json")
        assert result.code == 0, result.err
        import torch

        expected = float(torch.load(stages.data)[1][0]) + 1
        assert json.loads(result.out)["rows"][0]["float"] == expected
