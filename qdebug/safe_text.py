"""The one rule for showing text that came from outside qdebug (issue 27).

Quant point names, model class names, state and kwargs keys, task names, paths, and the
messages of exceptions raised by user code all come from files or code qdebug does not
own.  Printed raw, an ESC would drive the terminal (a CSI recolours it, an OSC retitles
the window or writes the clipboard), a U+202E turns ``gpj.exe`` into ``exe.jpg``, and a
newline fakes a line of qdebug's own (``error: fake verdict PASSED``).  Every table cell
and header, CSV cell and column name, Markdown and JUnit text, warning and ``error:``
line goes through :func:`escaped` on its way out.

Machine formats keep the exact value: JSON escapes what it carries itself (``json.dumps``
with ``ensure_ascii``: ``\\u001b``, ``\\u202e``), and plan.toml TOML-escapes every string
(``qdebug.config.toml_value``).

Importable without torch, pandas or rich: the CLI's error path uses it.
"""

from __future__ import annotations

__all__ = ["escaped", "one_line"]

MAX_LINE = 2000  # characters of one error, hint or warning line: a 100 KB path is quoted by its ends


def escaped(text: object) -> str:
    """``text`` as it may be shown on a terminal: every character Python's ``repr`` would
    escape is escaped the way ``repr`` writes it, everything else stays as it is.

    Escaped (``str.isprintable`` is false): the C0 controls (``\\x1b``, ``\\n``, ``\\r``,
    ``\\t``, ...), DEL, the C1 controls U+0080..U+009F (``\\x9b`` is a CSI on its own), the
    format characters -- bidi embeddings, overrides and isolates (``\\u202e``, ``\\u2066``),
    the marks (``\\u200e``, ``\\u200f``, ``\\u061c``), zero-width characters -- the line and
    paragraph separators, spaces other than U+0020, lone surrogates (a file name that is not
    UTF-8) and unassigned code points.  Kept: printable text in any script (``é``, ``中``),
    and the space.

    Quotes and backslashes are not doubled (a Windows path stays readable), so ``\\x1b`` in
    the output is either an escaped ESC or those four characters in the name: what is shown
    can be ambiguous, never live.  The exact value is in ``--format json``.
    """
    text = text if isinstance(text, str) else str(text)
    if text.isprintable():  # the common case: nothing to do
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def one_line(text: object, limit: int = MAX_LINE) -> str:
    """``text`` escaped (:func:`escaped`) and at most ``limit`` characters long: a longer line
    is cut in the middle, ``...(N characters cut)...``, so that both ends stay -- the start
    says what is wrong, the end a path's file name.  A message may quote a value from a file
    of any size (a config's ``out`` of 100,000 characters); one error stays one readable line."""
    line = escaped(text)
    if len(line) <= limit:
        return line
    keep = max(limit - 40, 2)  # room for the marker (40 characters hold any count)
    head, tail = keep // 2, keep - keep // 2
    return f"{line[:head]}...({len(line) - keep} characters cut)...{line[-tail:]}"
