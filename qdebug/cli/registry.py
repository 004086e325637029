"""The subcommands, recorded where they are defined: ``@command(...)``.

A subcommand module marks its function with ``@command(name, short_help=..., help=...)`` (typer's
``app.command`` arguments, unchanged) and imports nothing of the application; ``qdebug.cli.app``
imports the modules in the debug flow's order and adds what they recorded (``COMMANDS``, in that
order) to the typer application.  So the application depends on its commands and never the
other way round.
"""

from __future__ import annotations

from typing import Any, Callable

COMMANDS: list[tuple[Callable[..., Any], str | None, dict[str, Any]]] = []


def command(name: str | None = None, **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Record the decorated function as the subcommand ``name`` (default: the function's name)."""

    def record(function: Callable[..., Any]) -> Callable[..., Any]:
        COMMANDS.append((function, name, options))
        return function

    return record
