"""The one exception type qdebug raises for user mistakes.

Every problem a user can fix (a bad spec, a missing file, a wrong stage) is a
``QDebugError`` carrying a message and a hint; the CLI turns it into a single
``error: ...`` line and exit code 2.  Anything else is a bug in qdebug.
"""

from __future__ import annotations


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
