"""The ``qdebug`` command line: parse, load, call a tool, render -- nothing else.

``main`` is the console script.  It imports the application inside its own guard so
that Ctrl-C during start-up ends like Ctrl-C anywhere else: exit 130, no traceback; SIGTERM
likewise ends with ``error: terminated`` and exit 143 (``qdebug.cli.interrupts``).
"""

from __future__ import annotations

import sys

INTERRUPTED = 130


def main(argv: list[str] | None = None) -> None:
    from qdebug.cli.interrupts import TERMINATED, Terminated

    if argv is None:  # the real command: `qdebug ... | head` ends quietly, as cat or grep do
        _default_sigpipe()
        from qdebug.cli.interrupts import hold_interrupts_during_torch_import, raise_on_sigterm

        raise_on_sigterm()
        hold_interrupts_during_torch_import()
    try:
        from qdebug.cli.app import run

        run(argv)  # ends in sys.exit; a SIGTERM while it says its verdict is caught below
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        sys.exit(INTERRUPTED)
    except Terminated:
        sys.stderr.write("error: terminated\n")
        sys.exit(TERMINATED)
    finally:
        if argv is None:
            _verdict_said()


def _verdict_said() -> None:
    """The exit code is decided: the output is flushed now (a SIGTERM during the interpreter's
    shutdown must not lose a report still in a buffer) and SIGTERM kills again, as by default
    (an exception raised in an atexit callback would print a traceback)."""
    from qdebug.cli.interrupts import default_sigterm

    default_sigterm()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stdout: nothing more can reach it
            pass


def _default_sigpipe() -> None:
    """Die of SIGPIPE (exit 141 in a shell) when stdout's reader goes away, instead of Python's
    BrokenPipeError, which typer turns into exit 1 -- the code of a failed check."""
    import signal

    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def __getattr__(name: str):
    if name == "app":  # ``from qdebug.cli import app`` (typer's own testing tools use it), commands added
        from qdebug.cli.app import _register, app

        _register()
        return app
    raise AttributeError(f"module 'qdebug.cli' has no attribute {name!r}")


__all__ = ["main", "app"]
