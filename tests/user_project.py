"""A user's project in a temporary directory: their own package, model class, metric and data
function, as the tests of "metrics and models as users write them" need them.

``clean_imports`` (use it as a fixture body) undoes what importing such a project leaves
behind -- modules loaded from the temporary directory, ``sys.path`` entries, the config root --
so later tests import their own ``mypkg``, not this one's.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterator

NET = """\
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, width=4, classes=3):
        super().__init__()
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        return self.fc(x)


def make(**kwargs):
    open(MARKER, "w").write("called")
    return Net(**kwargs)


MARKER = {marker!r}
"""


def write_package(root: Path, name: str = "mypkg", *, marker: Path | None = None) -> Path:
    """``root/name/__init__.py`` and ``root/name/net.py`` (class ``Net``, factory ``make``)."""
    pkg = root / name
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "net.py").write_text(NET.format(marker=str(marker or root / f"{name}-make-called.txt")))
    return pkg


def user_module(root: Path, package: str, module: str, source: str) -> Path:
    """``root/package/__init__.py`` and ``root/package/module.py`` holding ``source``, with ``root``
    on ``sys.path`` (use inside ``clean_imports(root)``, which takes it off again)."""
    pkg = root / package
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / f"{module}.py").write_text(source)
    sys.path.insert(0, str(root))
    return pkg


def forget(name: str) -> None:
    """Drop ``name`` and its submodules from ``sys.modules``."""
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]


@contextlib.contextmanager
def clean_imports(*roots: Path) -> Iterator[None]:
    import qdebug.config.project

    path = list(sys.path)
    before = set(sys.modules)
    try:
        yield
    finally:
        sys.path[:] = path
        resolved = [str(Path(r).resolve()) for r in roots]
        for name in set(sys.modules) - before:
            file = getattr(sys.modules.get(name), "__file__", None) or ""
            if any(str(Path(file).resolve()).startswith(r) for r in resolved if file):
                del sys.modules[name]
        qdebug.config._config_root = None


def exit_before_torch(argv: list[str], cwd: Path) -> tuple[str, str]:
    """``qdebug ARGV`` in a fresh interpreter: (stdout -- "<exit code> <whether torch was
    imported>" -- and stderr), for usage errors that must answer before torch loads."""
    import subprocess

    code = ("import sys\nfrom qdebug.cli import main\ntry:\n    main(%r)\nexcept SystemExit as exc:\n"
            "    print(exc.code, 'torch' in sys.modules)\n" % (list(argv),))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=120)
    return proc.stdout, proc.stderr
