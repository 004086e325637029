"""The output convention every command follows (docs/cli.md, "Output").

- ``--format table|json|csv``: what goes to stdout (``--json`` = ``--format json``);
- ``--out DIR``: also write the results as a folder of files: ``<command>.csv`` (one
  per table), ``<command>.json`` and the command's plots, all appearing at once at the end
  (``qdebug.io.atomic.StagedDir``): a failed run leaves the folder as it was;
- a command's other output (``-o FILE``, ``--junit FILE``) written inside ``with_out(out)``
  appears with the ``--out`` folder or not at all (``qdebug.io.together``);
- ``--wide``: the table with every column at its natural width;
- notes ("wrote ...", warnings) go to stderr, so stdout stays one table or one document.

Column names, option values (``--sort``, ``--metrics``) and JSON keys are one vocabulary.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import typer

from qdebug.cli.common import console, err_console, writable_dir
from qdebug.config.distributed import is_rank_zero
from qdebug.errors import QDebugError
from qdebug.safe_text import escaped, one_line

if TYPE_CHECKING:
    import pandas as pd
    from rich.table import Table

    from qdebug.io.staged import StagedDir

FORMATS = ("table", "json", "csv")

FORMAT_OPTION = typer.Option(None, "--format", metavar="table|json|csv",
                             help="What to print on stdout (default table).")
JSON_OPTION = typer.Option(False, "--json", help="Same as --format json.")
OUT_OPTION = typer.Option(None, "--out", metavar="DIR", help="Also write CSV, JSON (and plots) into this folder.")
CHECKPOINT_OUTPUT_OPTION = typer.Option(..., "-o", "--output", metavar="FILE", show_default=False,
                                        help="Where to write the checkpoint.")
WIDE_OPTION = typer.Option(False, "--wide", help="Show every column of the table, whatever the terminal's width.")


@dataclass
class Report:
    """What a command produced: its main table, ``meta``, and any further named tables."""

    command: str
    frame: "pd.DataFrame"
    meta: dict[str, Any]
    tables: dict[str, "pd.DataFrame"] = field(default_factory=dict)  # e.g. inspect's "checks"
    files: list[Path] = field(default_factory=list)  # written by the command itself (plots)
    json_extra: dict[str, Any] = field(default_factory=dict)  # further top-level JSON values (suggest's plan)
    rows_key: str = "rows"  # the JSON key of ``frame``'s records (nan-trace's "timeline")


def output_format(fmt: Optional[str], as_json: bool) -> str:
    """The chosen stdout format, checked before any work starts."""
    if fmt is not None and fmt not in FORMATS:
        raise QDebugError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}",
                          "e.g. --format json (or leave it out for a table)")
    if as_json and fmt not in (None, "json"):
        raise QDebugError(f"--json contradicts --format {fmt}", "give one of them")
    return "json" if as_json else (fmt or "table")


def prepare_out(out: Optional[Path], *, config: bool = True) -> Optional["StagedDir"]:
    """``--out`` (else, with ``config``, the config's ``out``) checked -- creatable, writable --
    before the work starts, as the folder the run writes into: files go to ``out.file(name)``,
    ``emit`` moves them into place together; a run that ends before that leaves nothing."""
    from qdebug.io.staged import StagedDir
    from qdebug.cli.common import STATE

    if out is None and config and STATE.config().get("out"):
        out = Path(STATE.config().get("out"))
    if out is None or not is_rank_zero():  # under torchrun rank 0 alone writes
        return None
    staged = StagedDir(writable_dir(out))
    _discard_when_the_command_ends(staged)
    return staged


def with_out(out: Optional["StagedDir"]):
    """The context to write the command's other output in (``-o FILE``, ``--junit FILE``): with
    ``--out``, the file is renamed into place by ``emit`` together with the folder -- both or
    neither (``qdebug.io.together``); without, as it is written."""
    import contextlib

    if out is None:
        return contextlib.nullcontext()
    from qdebug.io import together

    _when_the_command_ends(together.discard)
    return together.holding()


def _discard_when_the_command_ends(staged: "StagedDir") -> None:
    """Whatever way the command ends (an error, Ctrl-C, a failed check after ``emit``), what it
    staged but did not commit is removed: registered on the running command's context (the click
    typer vendors, or click itself). Outside a command, the folder's own finalizer does it."""
    _when_the_command_ends(staged.discard)


def _when_the_command_ends(callback: Callable[[], None]) -> None:
    import importlib

    for module in ("typer._click.globals", "click.globals"):
        try:
            ctx = importlib.import_module(module).get_current_context(silent=True)
        except (ImportError, AttributeError):
            continue
        if ctx is not None:
            ctx.call_on_close(callback)
            return


def table_width(wide: bool) -> Optional[int]:
    """The width tables are fitted to: the terminal's (80 when piped), or None for --wide."""
    return None if wide else console.width


def print_table(table: "Table") -> None:
    """Print a fitted table and a blank line; a --wide one at its own width (the terminal may wrap it)."""
    from qdebug.report.table import table_width as measured

    wanted = measured(table)
    if wanted <= console.width:
        console.print(table)
    else:
        saved = console._width  # rich caps print(width=) at the console's width: widen it for this table
        console.width = wanted
        try:
            console.print(table, crop=False)
        finally:
            console._width = saved
    console.print()


def emit(report: Report, fmt: str, out: Optional["StagedDir"], render: Callable[[], None]) -> None:
    """Write ``--out`` files and move them into place with the command's own (``report.files``),
    then stdout in ``fmt``; ``render`` prints the table view."""
    from qdebug.report.output import records, to_csv, to_json, write_csv, write_json

    if not is_rank_zero():  # under torchrun rank 0 alone prints and writes (qdebug.config.distributed)
        return
    written = list(report.files)
    if out is not None:
        written.append(write_csv(out.file(f"{report.command}.csv"), report.frame))
        for name, frame in report.tables.items():
            written.append(write_csv(out.file(f"{report.command}_{name}.csv"), frame))
        extra = {**{name: records(frame) for name, frame in report.tables.items()}, **report.json_extra}
        written.append(write_json(out.file(f"{report.command}.json"), report.frame, report.meta,
                                  rows_key=report.rows_key, **extra))
        written = [out.shown(p) for p in written]
        from qdebug.io import together

        together.commit_with(out.commit)  # every file of the run appears at once (-o/--junit's too)
    if fmt == "json":
        extra = {**{name: records(frame) for name, frame in report.tables.items()}, **report.json_extra}
        _stdout(to_json(report.frame, report.meta, rows_key=report.rows_key, **extra))
    elif fmt == "csv":
        _stdout(to_csv(report.frame).rstrip("\n"))
    else:
        render()
    if written:
        note(f"wrote {', '.join(str(p) for p in written)}")


def say(text: str) -> None:
    """A line of the table view's text (summary, next command), on stdout; what it quotes from
    files or user code is shown escaped (``qdebug.safe_text``), and it is wrapped to the
    console's width (80 when piped: ``fitted``)."""
    console.print(fitted(escaped(text), console.width), markup=False, highlight=False, emoji=False, soft_wrap=True)


PASTE_PREFIXES = ("qdebug ", "python -m qdebug")  # a printed command: never wrapped, it must run as pasted


def fitted(text: str, width: int) -> str:
    """``text`` wrapped to ``width`` columns, each line's continuation indented two spaces more
    than it; a command to paste (an indented ``qdebug ...``) stays whole, and so does a word
    longer than the width (a layer's name is not cut)."""
    import textwrap

    from rich.cells import cell_len

    lines = []
    for line in text.split("\n"):
        body = line.lstrip()
        if cell_len(line) <= width or body.startswith(PASTE_PREFIXES):
            lines.append(line)
            continue
        indent = line[: len(line) - len(body)]
        lines.append(textwrap.fill(line, width, subsequent_indent=indent + "  ", break_long_words=False,
                                   break_on_hyphens=False))
    return "\n".join(lines)


def note(text: str) -> None:
    """A line for the person at the terminal, on stderr (stdout stays machine-readable), shown
    escaped as ``say`` shows it, and cut as an error line is (``qdebug.safe_text.one_line``)."""
    err_console.print(one_line(text), markup=False, highlight=False, emoji=False, soft_wrap=True)


def _stdout(payload: str) -> None:
    sys.stdout.write(payload + "\n")
    sys.stdout.flush()
