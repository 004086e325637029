"""The typer application, its global options, and the error contract.

Exit codes: 0 ok, 1 a check failed, 2 usage or input error (one ``error:`` line
plus a ``hint:`` line on stderr; ``--debug`` shows the traceback instead).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Optional

import typer

from qdebug.cli.common import STATE, err_console
from qdebug.errors import QDebugError

app = typer.Typer(
    name="qdebug",
    help=(
        "Precision debugging for quantized PyTorch models.\n\n"
        "Example: qdebug inspect fixtures/demo/qat.pt"
    ),
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


@app.callback()
def _global(
    config: Optional[Path] = typer.Option(None, "--config", help="Config file (default: qdebug.toml or \\[tool.qdebug] found upward)."),
    debug: bool = typer.Option(False, "--debug", help="Show the Python traceback of errors."),
) -> None:
    """Precision debugging for quantized PyTorch models.

    Example: qdebug inspect fixtures/demo/qat.pt
    """
    STATE.config_path = config
    STATE.debug = debug


def _register() -> None:
    from qdebug.cli import baseline, calibrate, compare, convert, inspect  # noqa: F401  (commands register themselves)


def _click_exceptions(name: str) -> tuple[type, ...]:
    """click's exception class ``name``, from click and/or the copy newer typer versions vendor
    (a fresh install of typer may come without click itself)."""
    import importlib

    found = []
    for module in ("click.exceptions", "typer._click.exceptions"):
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def main(argv: list[str] | None = None) -> None:
    _register()
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        code = app(args=args, prog_name="qdebug", standalone_mode=False)
    except QDebugError as exc:
        if debug:
            traceback.print_exc()
        err_console.print(f"error: {exc.message}", markup=False, highlight=False, soft_wrap=True)
        if exc.hint:
            err_console.print(f"hint: {exc.hint}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err_console.print("error: interrupted", markup=False)
        sys.exit(130)
    except OSError as exc:  # the file system refused (a full disk, a read-only mount, permissions)
        if debug:
            traceback.print_exc()
        where = f"{exc.filename}: " if exc.filename else ""
        err_console.print(f"error: {where}{exc.strerror or exc}", markup=False, highlight=False, soft_wrap=True)
        err_console.print("hint: check the path, its permissions and the free disk space", markup=False)
        sys.exit(2)
    except Exception as exc:  # click usage errors and genuine bugs
        if isinstance(exc, _click_exceptions("UsageError")):
            err_console.print(f"error: {exc.format_message()}", markup=False, highlight=False, soft_wrap=True)
            where = exc.ctx.command_path if getattr(exc, "ctx", None) is not None else "qdebug"
            err_console.print(f"hint: see {where} --help", markup=False, highlight=False, soft_wrap=True)
            sys.exit(2)
        if isinstance(exc, _click_exceptions("ClickException")):
            exc.show(file=sys.stderr)
            sys.exit(exc.exit_code)
        if debug:
            traceback.print_exc()
        first = str(exc).splitlines()[0] if str(exc) else ""
        err_console.print(f"error: internal error: {type(exc).__name__}: {first}", markup=False, soft_wrap=True)
        err_console.print("hint: run again with --debug and report the traceback", markup=False)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)
