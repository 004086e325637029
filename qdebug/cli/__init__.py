"""The ``qdebug`` command line: parse, load, call a tool, render -- nothing else.

``main`` is the console script.  It imports the application inside its own guard so
that Ctrl-C during start-up ends like Ctrl-C anywhere else: exit 130, no traceback.
"""

from __future__ import annotations

import sys

INTERRUPTED = 130


def main(argv: list[str] | None = None) -> None:
    if argv is None:  # the real command: `qdebug ... | head` ends quietly, as cat or grep do
        _default_sigpipe()
        from qdebug.cli.interrupts import hold_interrupts_during_torch_import

        hold_interrupts_during_torch_import()
    try:
        from qdebug.cli.app import run
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        sys.exit(INTERRUPTED)
    run(argv)


def _default_sigpipe() -> None:
    """Die of SIGPIPE (exit 141 in a shell) when stdout's reader goes away, instead of Python's
    BrokenPipeError, which typer turns into exit 1 -- the code of a failed check."""
    import signal

    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def __getattr__(name: str):
    if name == "app":  # ``from qdebug.cli import app`` (typer's own testing tools use it)
        from qdebug.cli.app import app

        return app
    raise AttributeError(f"module 'qdebug.cli' has no attribute {name!r}")


__all__ = ["main", "app"]
