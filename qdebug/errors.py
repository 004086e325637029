"""The one exception type qdebug raises for user mistakes.

Every problem a user can fix (a bad spec, a missing file, a wrong stage) is a
``QDebugError`` carrying a message and a hint; the CLI turns it into a single
``error: ...`` line and exit code 2.  Anything else is a bug in qdebug.  The helpers
here keep an error about a hostile value from raising another: ``shown`` (a bounded repr),
``message_of`` (an exception's message, whatever its ``__str__`` does), ``first_line`` (its
first line), ``checked_path``.
"""

from __future__ import annotations

import os
from pathlib import Path


class QDebugError(Exception):
    """A user-fixable problem: ``message`` says what is wrong, ``hint`` how to fix it."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message} (hint: {self.hint})"
        return self.message


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for a message about a bad value from a file
    or a caller: a huge int (its repr raises past 4300 digits), a list nested deep, or an
    object whose ``__repr__`` raises must not turn the error itself into a crash."""
    try:
        text = repr(value)
    except Exception:
        if isinstance(value, int):
            return f"<a {value.bit_length()}-bit integer>"
        return f"<a {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def message_of(exc: BaseException) -> str:
    """``str(exc)``, or "" when the exception's own ``__str__`` raises or returns no string (a
    user's exception class): reporting an error must not raise another."""
    try:
        text = str(exc)
    except Exception:
        return ""
    return text if isinstance(text, str) else ""


def first_line(exc: BaseException, empty: str | None = None) -> str:
    """The first non-empty line of an exception's message (some, e.g. EOFError, have none:
    then ``empty``, or the type's name)."""
    lines = [line for line in message_of(exc).splitlines() if line.strip()]
    return lines[0].strip()[:200] if lines else (empty or type(exc).__name__)


def checked_path(value: object, what: str = "path") -> Path:
    """``value`` as a ``Path``, if it is a file path (a str or os.PathLike without NUL):
    the Python API's callers may hand anything, and os would answer with a bare TypeError."""
    if isinstance(value, (str, os.PathLike)):
        try:
            path = Path(value)
        except TypeError:  # an os.PathLike whose __fspath__ gives bytes (or anything else)
            path = None
        if path is not None and "\0" not in str(path):
            return path
    raise QDebugError(f"{what} must be a file path (a str or pathlib.Path), got {shown(value)}",
                      'e.g. "model.pt" or pathlib.Path("model.pt")')
