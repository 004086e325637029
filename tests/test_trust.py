"""Trust boundaries (issue 27): a name the user passes never receives a file's arguments, a file's
model spec is looked up without running code, and a config has a boundary, as git's has.

Each case would have run the file's payload (a marker file appears), imported what it must not
(``sys.modules`` in a fresh interpreter), or read a config it must not (its settings, or the
``config:`` line on stderr) before the fix.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import qdebug
from qdebug.config.project import find_config
from qdebug.errors import QDebugError

from user_project import clean_imports, forget, write_package


def _naming(stages, tmp_path: Path, target: str, kwargs: dict, name: str = "named.pt") -> Path:
    """The float checkpoint of ``stages`` with its model spec replaced by ``target(**kwargs)``."""
    ckpt = copy.deepcopy(torch.load(stages.float, map_location="cpu", weights_only=True))
    ckpt["model"] = {"class": target, "kwargs": kwargs}
    path = tmp_path / name
    torch.save(ckpt, path)
    return path


# -- 1. a name the user passes never receives the file's arguments ---------------------------
FUNCTIONS = {  # a function a crafted file names, and kwargs that would create the marker
    "subprocess:run": lambda marker: {"args": ["touch", str(marker)]},
    "os:system": lambda marker: {"command": f"touch {marker}"},
    "runpy:run_path": lambda marker: {"path_name": str(marker.with_suffix(".py"))},
    "pty:spawn": lambda marker: {"argv": ["touch", str(marker)]},
}


def _runpy_payload(marker: Path) -> None:
    marker.with_suffix(".py").write_text(f"open({str(marker)!r}, 'w').close()\n")


@pytest.mark.parametrize("target", sorted(FUNCTIONS))
def test_a_function_the_file_names_never_gets_its_kwargs_even_when_the_user_names_it(cli, stages, tmp_path, target):
    marker = tmp_path / "marker"
    _runpy_payload(marker)
    path = _naming(stages, tmp_path, target, FUNCTIONS[target](marker))
    refused = cli("inspect", path)
    refused.assert_error()
    assert f"--model {target}" not in refused.err  # the hint never invites the user to run it
    cli("inspect", path, "--model", target).assert_error()  # called with the user's kwargs (none): refused
    with pytest.raises(QDebugError):
        qdebug.load(path, model=target)
    assert not marker.exists()


def test_a_factory_of_the_users_own_gets_the_users_kwargs_not_the_files(cli, stages, tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    (tmp_path / "factories.py").write_text(textwrap.dedent(f"""\
        from qdebug.io.modelspec import build_zoo


        def make(path=None, **kwargs):
            if path:
                open(path, "w").close()
            return build_zoo("resnet", **kwargs)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    small = dict(stages.kwargs)
    path = _naming(stages, tmp_path, "factories:make", {"path": str(marker), **small})
    try:
        cli("inspect", path, "--model", "factories:make").assert_error()  # built with no kwargs, not the file's
        assert not marker.exists()
        result = cli("inspect", path, "--model", "factories:make", "--model-kwargs", json.dumps(small), "--json")
        assert result.code == 0, result.err
        assert not marker.exists()
    finally:
        forget("factories")


def test_a_model_class_the_user_names_keeps_the_files_kwargs(cli, stages):
    result = cli("inspect", stages.float, "--model", stages.spec, "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["meta"]["model"]["kwargs"] == stages.kwargs


@pytest.mark.parametrize("text, fragment", [
    ("[1, 2]", "is not a table"), ("{num_classes = ", "neither a JSON object nor a TOML inline table"),
    ("{when = 1979-05-27}", "is a date"),
])
def test_model_kwargs_option_is_checked(cli, stages, text, fragment):
    cli("inspect", stages.float, "--model", stages.spec, "--model-kwargs", text).assert_error(fragment)


def test_model_kwargs_option_takes_a_toml_inline_table(cli, stages):
    table = "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in stages.kwargs.items()) + "}"
    result = cli("inspect", stages.float, "--model", stages.spec, "--model-kwargs", table, "--json")
    assert result.code == 0, result.err


def test_model_kwargs_without_a_model_is_refused(cli, stages):
    cli("inspect", stages.float, "--model-kwargs", "{}").assert_error("--model-kwargs needs --model")


LAZY = """\
import sys, torch, qdebug
from qdebug.errors import QDebugError
try:
    qdebug.load(sys.argv[1])
except QDebugError as exc:
    print("refused:", exc.message)
print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""


def test_a_file_named_spec_imports_nothing_lazily(stages, tmp_path):
    path = _naming(stages, tmp_path, "torch:_dynamo.OptimizedModule", {})
    proc = subprocess.run([sys.executable, "-c", LAZY, str(path)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    refused, imported = proc.stdout.strip().splitlines()
    assert refused.startswith("refused:") and "_dynamo" in refused
    assert imported == "[]"


def test_a_file_named_stdlib_module_is_refused_unimported(stages, tmp_path):
    forget("pty")
    with pytest.raises(QDebugError) as exc:
        qdebug.load(_naming(stages, tmp_path, "pty:spawn", {"argv": ["true"]}))
    assert "standard library" in exc.value.message and "--model" not in exc.value.hint
    assert "pty" not in sys.modules


# -- 2. configs have a boundary --------------------------------------------------------------
PLANTED = 'float = "planted.pt"\ntrust = ["evil"]\n'


def test_a_config_above_a_git_folder_is_not_used(cli, tmp_path, monkeypatch):
    (tmp_path / "qdebug.toml").write_text(PLANTED)
    work = tmp_path / "work"
    (work / ".git").mkdir(parents=True)
    (work / "src").mkdir()
    assert find_config(work / "src") is None
    monkeypatch.chdir(work / "src")
    result = cli("inspect")
    result.assert_error("no checkpoint given")
    assert "planted" not in result.err and "config:" not in result.err


@pytest.mark.parametrize("marker", ["pyproject.toml", "home"])
def test_the_search_stops_at_a_project_root_and_at_home(tmp_path, monkeypatch, marker):
    (tmp_path / "qdebug.toml").write_text(PLANTED)
    inner = tmp_path / "inner"
    (inner / "deep").mkdir(parents=True)
    if marker == "home":
        monkeypatch.setenv("HOME", str(inner))
    else:
        (inner / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert find_config(inner / "deep") is None


def test_a_config_writable_by_others_is_ignored_with_a_warning(cli, tmp_path, capsys):
    cfg = tmp_path / "qdebug.toml"
    cfg.write_text(PLANTED)
    cfg.chmod(0o666)
    result = cli("inspect")
    assert result.code == 2 and "error: no checkpoint given" in result.err and "config:" not in result.err
    assert f"warning: ignoring config {cfg}: it is writable by others (mode 666)" in result.err


def test_a_config_in_a_folder_writable_by_others_is_ignored(tmp_path, capsys):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "qdebug.toml").write_text(PLANTED)
    shared.chmod(0o1777)  # as /tmp: sticky, still anyone's to write
    assert find_config(shared) is None
    assert f"its folder {shared} is writable by others (mode 1777)" in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another user needs root")
def test_a_config_owned_by_another_user_is_ignored(tmp_path, capsys):
    cfg = tmp_path / "qdebug.toml"
    cfg.write_text(PLANTED)
    os.chown(cfg, 4242, -1)
    assert find_config(tmp_path) is None
    assert "it is owned by another user (uid 4242)" in capsys.readouterr().err


def test_an_owners_config_is_still_found(tmp_path):
    cfg = tmp_path / "qdebug.toml"
    cfg.write_text('metric = "top5"\n')
    (tmp_path / "a" / "b").mkdir(parents=True)
    assert find_config(tmp_path / "a" / "b") == cfg


class Payload:
    """A pickled object whose unpickling creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_unsafe_load_in_a_config_does_not_unpickle_code(cli, tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    torch.save(Payload(marker), tmp_path / "whole.pt")
    (tmp_path / "qdebug.toml").write_text("unsafe_load = true\n")
    monkeypatch.delenv("QDEBUG_UNSAFE_LOAD", raising=False)
    result = cli("inspect", "whole.pt")
    assert result.code == 2 and "--unsafe-load" in result.err
    assert "unsafe_load is ignored" in result.err and "QDEBUG_UNSAFE_LOAD=1" in result.err
    assert not marker.exists()
    monkeypatch.setenv("QDEBUG_UNSAFE_LOAD", "1")  # the user's own environment may allow it
    cli("inspect", "whole.pt")
    assert marker.exists()


def test_a_bad_unsafe_load_env_value_is_an_error(cli, stages, monkeypatch):
    monkeypatch.setenv("QDEBUG_UNSAFE_LOAD", "maybe")
    cli("inspect", stages.float).assert_error("QDEBUG_UNSAFE_LOAD='maybe' is not 1 or 0")


def test_the_config_is_named_once_on_stderr_and_json_is_untouched(cli, stages, tmp_path):
    (tmp_path / "qdebug.toml").write_text(f'float = "{stages.float}"\n')
    result = cli("inspect", "--json")
    assert result.code == 0, result.err
    assert result.err.count("config: qdebug.toml\n") == 1 and result.err.startswith("config: qdebug.toml\n")
    assert json.loads(result.out)["meta"]["stage"] == "float"


PLANTED_PKG = "open({marker!r}, 'w').close()\n"


def test_a_configs_trust_resolves_against_its_own_folder_only(cli, tmp_path, monkeypatch):
    """A ``mypkg/`` beside where qdebug runs is not the package the config trusts."""
    marker = tmp_path / "planted-imported"
    write_package(tmp_path)
    sub = tmp_path / "sub"
    (sub / "mypkg").mkdir(parents=True)
    (sub / "mypkg" / "__init__.py").write_text(PLANTED_PKG.format(marker=str(marker)))
    with clean_imports(tmp_path):
        sys.path.insert(0, str(tmp_path))
        from mypkg.net import Net

        qdebug.save(Net().eval(), tmp_path / "net.pt", stage="float", sample_inputs=torch.randn(2, 4))
        sys.path.remove(str(tmp_path))
        forget("mypkg")
        monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
        (tmp_path / "qdebug.toml").write_text('trust = ["mypkg"]\nfloat = "net.pt"\n')
        monkeypatch.chdir(sub)
        try:
            result = cli("inspect", "--json")
        finally:
            forget("mypkg")
    assert result.code == 0, result.err
    assert not marker.exists()


def test_init_neither_overwrites_nor_adopts_an_ignored_config(cli, tmp_path):
    cfg = tmp_path / "qdebug.toml"
    cfg.write_text(PLANTED)
    cfg.chmod(0o666)
    result = cli("init", "--trust", "mypkg")
    assert result.code == 2 and "error: qdebug.toml here is not read as a config: it is writable by others" in result.err
    assert cfg.read_text() == PLANTED


class SystemCall:
    """A pickle whose top object is a call of os.system, not a model."""

    def __reduce__(self):
        return (os.system, ("true",))


def test_a_pickle_refusal_never_suggests_a_function_it_names(cli, tmp_path):
    torch.save(SystemCall(), tmp_path / "whole.pt")
    result = cli("inspect", "whole.pt")
    result.assert_error("--unsafe-load")
    assert "system" not in result.err.splitlines()[1]  # the hint: no --model posix:system
