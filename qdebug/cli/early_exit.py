"""``os._exit`` while a command runs: an error, not a silent end with the code the caller chose.

``os._exit(0)`` in a metric, a data function or a model's forward ends the process at once:
no ``finally``, no atexit, no verdict -- and exit code 0, a baseline gate that passed.  While
a command runs, ``os._exit`` (and ``posix._exit``, the same function) in this process raises
``EarlyExit``, a ``SystemExit``: the user-code guards report it as one error naming the caller
(``qdebug.io.usercode.exit_error``), exit code 2.  In a process the command forked (a
``DataLoader`` worker) ``os._exit`` is the real one: the pid is checked.

Not covered, because no process can catch it in itself: a C-level exit (``ctypes``'s
``libc._exit(0)``, a C extension calling ``exit(0)``) or an ``os.exec*`` of another program.
A gate that must hold against those checks that its report exists: the ``--junit`` file and
the ``--out`` folder are written only with a verdict (docs/cli.md, "Exit codes").
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

_OS = sys.modules[os.name if os.name in ("posix", "nt") else "posix"]  # where os._exit comes from


class EarlyExit(SystemExit):
    """``os._exit(code)`` called while a command runs."""

    called = "os._exit"


@contextlib.contextmanager
def os_exit_raises() -> Iterator[None]:
    """Within: ``os._exit`` in this process raises ``EarlyExit`` (in a forked child it exits)."""
    real = os._exit
    if getattr(real, "_qdebug_guard", False):  # already guarded (a command run inside another)
        yield
        return
    owner = os.getpid()

    def guarded_exit(code: int) -> None:
        if os.getpid() != owner:
            real(code)
        raise EarlyExit(code)

    guarded_exit._qdebug_guard = True  # type: ignore[attr-defined]
    os._exit = _OS._exit = guarded_exit  # type: ignore[assignment]
    try:
        yield
    finally:
        os._exit = _OS._exit = real  # type: ignore[assignment]
