"""The user's own code: importing the modules they named or trusted, and pointing at their
line when it raises.

A module the user named or trusted is found from the current directory (and then the
directory of the config file read), as ``python -m`` and pytest's rootdir find it, when
``sys.path`` does not hold it: no ``PYTHONPATH=.`` needed.  This only locates modules
qdebug may import anyway: what a file may name is decided before (``qdebug.io.modelspec``).
``where_raised`` turns an exception from the user's metric, data function or model into
``file:line (code)`` of their own frame.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Any

from qdebug.errors import QDebugError, first_line


def import_user_module(module_name: str) -> Any:
    """Import a module qdebug may import (named or trusted by the user), found from the
    current directory or the config's when ``sys.path`` lacks it; failures as QDebugErrors."""
    check_module_name(module_name)
    make_findable(module_name)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.partition(".")[0]
        missing = exc.name or top
        if module_name == missing or module_name.startswith(missing + "."):
            searched = ", ".join(str(r) for r in import_roots(module_name))
            raise QDebugError(
                f"cannot import {module_name!r}: no module {missing!r} in {searched} or on sys.path",
                f"run qdebug from the directory that holds {top}/ (or {top}.py), or install your package "
                "(pip install -e .)",
            ) from None
        where = where_raised(exc)
        raise QDebugError(
            f"importing {module_name!r} failed: it imports {missing!r}, which is not installed"
            + (f" (at {where})" if where else ""),
            f"install {missing.partition('.')[0]!r} in this environment (python -m pip install ...)",
        ) from exc
    except QDebugError:
        raise
    except SystemExit as exc:  # sys.exit() at the module's top level
        raise exit_error(exc, f"importing {module_name!r}",
                         "guard the module's script code with if __name__ == '__main__': (qdebug imports it)") from exc
    except BaseException as exc:  # a syntax error or an exception while the user's module runs
        if not raised_by_user_code(exc):
            raise
        where = where_raised(exc)
        raise QDebugError(
            f"importing {module_name!r} raised {type(exc).__name__}: {first_line(exc)}"
            + (f" (at {where})" if where else ""),
            "fix the error in that module (python -c 'import " + module_name + "' shows it too); "
            "--debug shows the traceback",
        ) from exc


def check_module_name(module_name: str, what: str | None = None) -> None:
    """``module_name`` as an absolute, importable name (``pkg.mod``): a relative one (``.mod``)
    or one with spaces or slashes would reach importlib and fail there with a message about
    its own arguments.  ``what`` names the spec in the message."""
    from qdebug.config.project import MODULE_NAME

    if not MODULE_NAME.fullmatch(module_name):
        raise QDebugError(f"{module_name!r} is not an importable module name" + (f" (in {what})" if what else ""),
                          "write package.module:Name with an absolute module path (Python names joined by "
                          "dots: no leading dot, no file path)")


EXIT_HINT = "return the result (or raise an exception) instead: sys.exit ends qdebug with no verdict"


def exit_error(exc: SystemExit, what: str, hint: str = EXIT_HINT) -> QDebugError:
    """``sys.exit()`` inside the user's code (a data function, a metric, a module being
    imported) as an error naming it: let through, it would end qdebug silently with the
    exit code the user's code chose -- often 0, a pass with no verdict."""
    where = where_raised(exc)
    called = getattr(exc, "called", "sys.exit")  # os._exit: qdebug.cli.early_exit
    return QDebugError(f"{what} called {called}({exc.code!r})" + (f", at {where}" if where else ""), hint)


def raised_by_user_code(exc: BaseException) -> bool:
    """Whether ``exc``, caught around a call into the user's code, is that code's failure to
    report as one error naming it: any exception but Ctrl-C (KeyboardInterrupt: "interrupted")
    and qdebug's own (a QDebugError, a NonFiniteError, a signal qdebug raises to stop a run).
    A ``BaseException`` subclass of the user's, or a stray ``GeneratorExit``, counts: let
    through, it would end qdebug with a traceback and exit 1, the code of "a check failed"."""
    if isinstance(exc, KeyboardInterrupt):
        return False
    return not type(exc).__module__.startswith("qdebug.")


def import_roots(module_name: str = "") -> list[Path]:
    """Where modules the user names are looked for beyond ``sys.path``: the current
    directory (as ``python -m`` puts it first), then the directory of the config file --
    only the latter for a package the config itself names (its ``trust``, ``model``,
    ``metric``, ``data``): a config's names resolve against its own folder, never against
    whatever folder qdebug runs in."""
    from qdebug.config.project import config_packages, config_root

    root = config_root()
    if root is not None and module_name.partition(".")[0] in config_packages():
        return [root]
    roots = [Path.cwd()]
    if root is not None and root not in roots:
        roots.append(root)
    return roots


def make_findable(module_name: str) -> bool:
    """Put the import root holding ``module_name``'s top-level package on ``sys.path``
    when nothing on it holds that package.  Returns whether a root was added."""
    top = module_name.partition(".")[0]
    if not top or top in sys.modules:
        return False
    importlib.invalidate_caches()  # a module written since the last import (tests, notebooks) is seen
    try:
        if importlib.util.find_spec(top) is not None:
            return False
    except (ImportError, ValueError):
        return False
    for root in import_roots(top):
        if (root / top).is_dir() or (root / f"{top}.py").is_file():
            if str(root) not in sys.path:
                # Appended, not prepended: the root adds the user's package without
                # shadowing anything installed that later imports might mean.
                sys.path.append(str(root))
                importlib.invalidate_caches()
            return True
    return False


def _library_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(qdebug's and torch's directories, those plus the standard library and site-packages)."""
    import torch

    core = {str(Path(__file__).resolve().parents[1]), str(Path(torch.__file__).resolve().parent)}  # qdebug/, torch/
    every = set(core)
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            every.add(str(Path(path).resolve()))
    return tuple(d + os.sep for d in core), tuple(d + os.sep for d in every)


def where_raised(exc: BaseException, *, user_only: bool = False) -> str | None:
    """``file:line (code)`` of the innermost frame of ``exc`` in the user's own code -- not
    in qdebug or torch, and preferably not in the standard library or installed packages
    either (``user_only``: never) -- or None."""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f"{shown_path(exc.filename)}:{exc.lineno}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    core, every = _library_dirs()
    for skipped in (every,) if user_only else (every, core):
        for frame in reversed(frames):
            if str(Path(frame.filename).resolve()).startswith(skipped):
                continue
            code = (frame.line or "").strip()
            return f"{shown_path(frame.filename)}:{frame.lineno}" + (f" ({code})" if code else "")
    return None


def shown_path(filename: str) -> str:
    """A path relative to the current directory when it is inside it."""
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return filename
