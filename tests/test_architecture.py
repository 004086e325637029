"""The house's import rules (pyproject.toml's [tool.importlinter], docs/architecture.md): they
hold, a violation breaks them, and the modules that moved keep their old import paths."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import qdebug

ROOT = Path(__file__).resolve().parents[1]
LINT = shutil.which("lint-imports")
needs_linter = pytest.mark.skipif(LINT is None, reason="import-linter is not installed (pip install -e '.[test]')")


def _lint(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the package found first in ``root`` (grimp imports nothing: it reads the files)."""
    return subprocess.run([LINT, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(root)})


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "qdebug", tmp_path / "qdebug", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _append(path: Path, code: str) -> None:
    path.write_text(path.read_text() + "\n\n" + code + "\n")


@needs_linter
def test_the_contracts_hold():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 3 kept, 0 broken." in result.stdout


@needs_linter
def test_the_engine_importing_a_tool_breaks_the_layers(tmp_path):
    root = _copy(tmp_path)
    # A lazy import, the kind that slips in: it counts.
    _append(root / "qdebug/engine/ops.py", "def _shortcut():\n    from qdebug.tools import compare  # noqa: F401")
    result = _lint(root)
    assert result.returncode == 1, result.stdout
    assert "qdebug.engine is not allowed to import qdebug.tools" in result.stdout
    assert "Contracts: 0 kept, 3 broken." in result.stdout  # layers, the engine's own, and a cycle


@needs_linter
def test_a_cycle_inside_one_package_breaks_the_acyclic_contract(tmp_path):
    root = _copy(tmp_path)
    # batch -> spec -> batch: the data package's one-way path turned back (no layer is crossed).
    _append(root / "qdebug/data/batch.py", "def _spec():\n    from qdebug.data import spec  # noqa: F401")
    result = _lint(root)
    assert result.returncode == 1, result.stdout
    assert "Contracts: 2 kept, 1 broken." in result.stdout
    assert "No cycles are allowed in qdebug.data." in result.stdout.replace("\n", " ")
    assert "- .batch -> .spec (1 import)" in result.stdout


@pytest.mark.parametrize("old, new", sorted(qdebug.MOVED.items()))
def test_a_moved_module_keeps_its_old_import_path(old, new):
    moved = importlib.import_module(old)
    assert moved is importlib.import_module(new)
    assert moved.__spec__.name == new  # the module keeps its own spec (pickling, reload, inspect)
    assert getattr(sys.modules[old.rpartition(".")[0]], old.rpartition(".")[2]) is moved


def test_old_paths_in_user_facing_names_still_resolve():
    from qdebug.data.metrics import mse, resolve_metric

    assert resolve_metric("qdebug.metrics:mse") is mse  # a --metric or config written before the move
    from qdebug.metrics import top1  # noqa: F401  (``from OLD import name``)

    assert qdebug.data.load_batches is importlib.import_module("qdebug.data.spec").load_batches  # docs/cli.md
    assert qdebug.config.DEBUG_ORDER == ("qat", "calibrated", "quantized")  # docs/config.md


def test_python_m_qdebug_launch_still_runs():
    result = subprocess.run([sys.executable, "-m", "qdebug.launch", "--help"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "usage: python -m qdebug.launch [torchrun options] COMMAND" in result.stdout + result.stderr


def test_the_package_root_holds_only_the_facade_and_the_ground():
    """New modules go into the package of their concern (docs/architecture.md, "Where a new thing goes")."""
    loose = sorted(p.name for p in (ROOT / "qdebug").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "api.py", "checkpoint.py", "errors.py", "safe_text.py", "vocab.py"]
