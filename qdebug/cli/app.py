"""The typer application, its global options, and the error contract.

Exit codes: 0 ok, 1 a check failed, 2 usage or input error (one ``error:`` line
plus a ``hint:`` line on stderr; ``--debug`` shows the traceback instead), 130
interrupted (Ctrl-C), 143 terminated (SIGTERM).

Only typer, rich's console and qdebug's light modules load here: ``--help``,
``--version`` and usage errors never wait for torch or pandas, which each command
imports when it runs.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from pathlib import Path
from typing import Iterator, Optional

import typer

from qdebug.cli import INTERRUPTED
from qdebug.cli.interrupts import TERMINATED, Terminated
from qdebug.cli.early_exit import EarlyExit
from qdebug.cli.common import STATE, err_console
from qdebug.errors import QDebugError, message_of

app = typer.Typer(
    name="qdebug",
    help=(
        "Precision debugging for quantized PyTorch models: where accuracy is lost, which layer "
        "is to blame and why.\n\n"
        "Example: qdebug compare fixtures/demo/float.pt fixtures/demo/quantized.pt --data fixtures/demo/eval.pt\n\n"
        "Data-parallel (compare, step, suggest, baseline, calibrate): python -m qdebug.launch --nproc-per-node 2 "
        "compare fixtures/demo/float.pt fixtures/demo/qat.pt --data fixtures/demo/eval.pt (torchrun's options, "
        "qdebug's exit codes); see docs/scale.md.\n\n"
        "Every command takes --format table|json|csv and --out DIR; see docs/cli.md.\n\n"
        "Progress goes to stderr: a bar on a terminal, else one line every 10 s (QDEBUG_PROGRESS_SECONDS); "
        "--quiet drops it. Example: qdebug --quiet compare fixtures/demo/float.pt fixtures/demo/qat.pt "
        "--data fixtures/demo/eval.pt\n\n"
        "A command keeps the memory of freed tensors for the next ones (glibc's malloc; QDEBUG_MALLOC=default leaves "
        "it as it is). Example: QDEBUG_MALLOC=default qdebug compare fixtures/demo/float.pt fixtures/demo/qat.pt "
        "--data fixtures/demo/eval.pt\n\n"
        "compare's statistics run in a C kernel where pip built one (QDEBUG_FUSED=0: on torch ops, same results "
        "to ~1e-7). Example: QDEBUG_FUSED=0 qdebug compare fixtures/demo/float.pt fixtures/demo/qat.pt "
        "--data fixtures/demo/eval.pt"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: no type noise, nothing cut off, readable when piped
    context_settings={"max_content_width": 100},
)


def _show_version(value: bool) -> None:
    if value:
        import qdebug

        sys.stdout.write(f"qdebug {qdebug.__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _global(
    config: Optional[Path] = typer.Option(None, "--config", metavar="FILE",
                                          help="Config file (default: qdebug.toml or [tool.qdebug] found upward)."),
    debug: bool = typer.Option(False, "--debug", help="Show the Python traceback of errors."),
    quiet: bool = typer.Option(False, "--quiet",
                               help="No progress on stderr (neither the bar nor, when stderr is not a "
                               "terminal, the plain progress line)."),
    version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                 help="Print qdebug's version and exit."),
) -> None:
    STATE.config_path = config
    STATE.debug = debug
    STATE.quiet = quiet
    from qdebug.config.memory import reuse_freed_memory

    reuse_freed_memory()  # a command is about to run: freed tensors' memory kept for the next ones


def _register() -> None:
    """Add the subcommands to ``app`` once: each module records its own (``qdebug.cli.registry``) when
    imported here, in the debug flow's order, which --help keeps."""
    if app.registered_commands:
        return
    from qdebug.cli import (  # noqa: F401
        baseline, compare, step, suggest, fix, nan_trace, watch, inspect, calibrate, convert, export, import_, init,
    )
    from qdebug.cli.registry import COMMANDS

    for function, name, options in COMMANDS:
        app.command(name, **options)(function)


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


def _say(line: str) -> None:
    from qdebug.safe_text import one_line

    # A message may quote a file's or user code's text: no control character, bidi override or
    # newline of it reaches the terminal (one error is one line; qdebug's own lines have none),
    # and no 100 KB of it: a line past MAX_LINE characters is cut in the middle.
    line = one_line(line)
    if err_console.quiet:  # a rank other than 0 under torchrun: its errors are still said
        sys.stderr.write(line + "\n")
        return
    # emoji=False: a name like "mypkg.x:cross_mark:" in a message is text, not an emoji code.
    err_console.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)


def _say_error(error: QDebugError) -> None:
    if err_console.quiet and getattr(error, "shared", False):  # every rank has it: rank 0 says it, once
        return
    _say(f"error: {error.message}")
    if error.hint:
        _say(f"hint: {error.hint}")


def _quiet_other_ranks() -> None:
    """Under torchrun only rank 0 prints and writes (``qdebug.config.distributed``); the others
    still say their errors.  Read from the environment: no torch needed."""
    from qdebug.cli.common import console
    from qdebug.config.distributed import environment

    if environment()[0] != 0:
        console.quiet = err_console.quiet = True


def _across_ranks(error: QDebugError | None) -> QDebugError | None:
    """The command is over on this rank: under torchrun, one last round with the others, so
    every rank ends with the same error (or none).  Outside torchrun: ``error`` as it is."""
    from qdebug.config.distributed import finish

    return finish(error)


def run(argv: list[str] | None = None) -> None:
    """Run the command line; every outcome ends in ``sys.exit`` with the house's exit codes."""
    from qdebug.cli.early_exit import os_exit_raises

    args = sys.argv[1:] if argv is None else argv
    try:
        with os_exit_raises(), _escaped_warnings():  # os._exit(0) in a metric: an error, not a silent pass
            _run(args)
    finally:
        _release_aborted_forwards()
        _release_device_settings()


@contextlib.contextmanager
def _escaped_warnings() -> Iterator[None]:
    """Python warnings (the user's code, torch, a model's) reach stderr through the one rule of
    ``qdebug.safe_text``: a warning quoting a file's layer name is one inert line, as an error is."""
    import linecache
    import warnings

    from qdebug.safe_text import escaped

    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 (warnings' own signature)
        head = warnings.formatwarning(message, category, filename, lineno, "").rstrip("\n")  # "" : no code line
        source = (line if line is not None else linecache.getline(str(filename), lineno)).strip()
        out = file if file is not None else sys.stderr
        try:
            out.write(escaped(head) + "\n" + (f"  {escaped(source)}\n" if source else ""))
        except OSError:  # stderr gone (a closed pipe): a warning is not worth a crash
            pass

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = original


def _release_aborted_forwards() -> None:
    """A command is over: a forward that Ctrl-C or a user's sys.exit aborted must not leave
    its naming mode on torch's stack (it would outlive an in-process run; see
    ``qdebug.engine.context.release_aborted``).  Nothing to do where torch never loaded."""
    context = sys.modules.get("qdebug.engine.context")
    if context is not None:
        context.release_aborted(0)


def _release_device_settings() -> None:
    """A command is over: settings a CUDA run held (IEEE float32 convolutions: ``qdebug.config.device``)
    go back to what they were (they would outlive an in-process run)."""
    device = sys.modules.get("qdebug.config.device")
    if device is not None:
        device.release_held()


def _run(args: list[str]) -> None:
    debug = "--debug" in args
    try:
        _quiet_other_ranks()
        _register()
        try:
            code = app(args=args, prog_name="qdebug", standalone_mode=False)
        except typer.Exit as exc:
            code = exc.exit_code
        failure = _across_ranks(None) if code != INTERRUPTED else None
        if failure is not None:
            raise failure
    except QDebugError as exc:
        if debug:
            traceback.print_exc()
        _say_error(_across_ranks(exc))
        sys.exit(2)
    except EarlyExit as exc:  # os._exit outside the user-code guards (qdebug.cli.early_exit)
        if debug:
            traceback.print_exc()
        _say_error(_across_ranks(QDebugError(f"os._exit({exc.code!r}) was called while qdebug ran, before its verdict",
                                             "find the os._exit call in your metric, data function or model; "
                                             "run again with --debug to see where")))
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        _say("error: interrupted")
        sys.exit(INTERRUPTED)
    except Terminated:  # SIGTERM (qdebug.cli.interrupts): the cleanup has run on the way here
        if not err_console.quiet:  # under torchrun rank 0 says it for the job
            _say("error: terminated")
        sys.exit(TERMINATED)
    except OSError as exc:  # the file system refused (a full disk, a read-only mount, permissions)
        if debug:
            traceback.print_exc()
        where = f"{exc.filename}: " if exc.filename else ""
        _say_error(_across_ranks(QDebugError(f"{where}{exc.strerror or exc}",
                                             "check the path, its permissions and the free disk space")))
        sys.exit(2)
    except Exception as exc:  # click usage errors and genuine bugs
        if isinstance(exc, _click_exceptions("NoArgsIsHelpError")):  # bare `qdebug`: the help, not an error
            sys.stdout.write(exc.format_message().rstrip("\n") + "\n")
            sys.exit(2)
        if isinstance(exc, _click_exceptions("UsageError")):
            if err_console.quiet:  # every rank has the same command line: rank 0 says it, once
                sys.exit(2)
            _say(f"error: {exc.format_message()}")
            where = exc.ctx.command_path if getattr(exc, "ctx", None) is not None else "qdebug"
            _say(f"hint: see {where} --help")
            sys.exit(2)
        if isinstance(exc, _click_exceptions("ClickException")):
            exc.show(file=sys.stderr)
            sys.exit(exc.exit_code)
        if debug:
            traceback.print_exc()
        text = message_of(exc)  # an exception's own __str__ may raise: the report must not
        first = text.splitlines()[0] if text else ""
        _say_error(_across_ranks(QDebugError(f"internal error: {type(exc).__name__}: {first}",
                                             "run again with --debug and report the traceback")))
        sys.exit(2)
    if code == INTERRUPTED:  # typer turns Ctrl-C inside a command into a silent return of 130
        _say("error: interrupted")
    sys.exit(code if isinstance(code, int) else 0)

