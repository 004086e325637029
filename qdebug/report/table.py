"""A DataFrame as a terminal table that fits the terminal's width.

Rules (docs/cli.md, "Tables"):

- columns are chosen by priority (most useful first) until the width is used up;
  the ones left out are named in the caption and shown by ``--wide`` (all columns,
  natural width) and by ``--format json|csv``;
- a cell is never wrapped or cut inside a number: a column either fits whole or is
  left out;
- a name column (layer names) stays on one line and, when space is short, is
  shortened from the left (``…layer3.1.conv2``: the end of a path says most);
- a header is the column's own name (the name options and JSON use); a long one
  breaks at an underscore onto a second line rather than widen its column;
- free-text columns take what is left: ``wrap`` ones wrap inside it, ``clip`` ones stay on
  one line and end in ``…``;
- every cell, header and the title are text, never markup, and shown as
  ``qdebug.safe_text.escaped`` writes them (a name's ESC or newline is ``\\x1b``, ``\\n``), measured
  after escaping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

from rich import box
from rich.cells import cell_len
from rich.table import Table
from rich.text import Text

from qdebug.safe_text import escaped

if TYPE_CHECKING:
    import pandas as pd

ELLIPSIS = "…"
NAME_MIN = 16  # a shortened name keeps at least this many cells ...
NAME_SHARE = 0.4  # ... and takes at most this share of the width before other columns get theirs
WRAP_MIN = 16  # a text column needs this much room to be worth showing ...
WRAP_SHARE = 0.35  # ... and a wrapping one (sentences) this share of the width, when it has that much text
GAP = 3  # cells between two columns: padding 1, the (blank) rule of box.SIMPLE_HEAD, padding 1


def format_value(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}".rstrip("0").rstrip(".") if abs(value) < 1e5 else f"{value:.4g}"
    return str(value)


def fixed(digits: int) -> Callable[[object], str]:
    """A formatter with ``digits`` decimals (cosines near 1 need six to differ)."""

    def fmt(value) -> str:
        if isinstance(value, float) and math.isfinite(value):
            return f"{value:.{digits}f}"
        return format_value(value)

    return fmt


def shorten_left(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells, cut from the left: ``…layer3.1.conv2``."""
    if cell_len(text) <= width:
        return text
    if width <= 1:
        return ELLIPSIS[:width]
    kept = text[-(width - 1):]
    while cell_len(kept) > width - 1:
        kept = kept[1:]
    return ELLIPSIS + kept


def split_header(name: str) -> str:
    """``name`` on at most two lines, broken after an underscore so the longer line is shortest."""
    best = name
    for i, ch in enumerate(name[:-1]):
        if ch == "_":
            candidate = name[: i + 1] + "\n" + name[i + 1:]
            if _header_width(candidate) < _header_width(best):
                best = candidate
    return best


def _header_width(header: str) -> int:
    return max(cell_len(line) for line in header.split("\n"))


@dataclass
class _Column:
    name: str
    cells: list[str]
    numeric: bool
    kind: str  # "value" | "name" | "wrap" | "clip"
    header: str = ""
    width: int = 0

    @property
    def natural(self) -> int:
        return max([cell_len(c) for c in self.cells], default=0)

    def needed(self, header: str) -> int:
        """The least width this column can be shown in, with ``header``."""
        head = _header_width(header)
        if self.kind == "name":
            return max(min(self.natural, NAME_MIN), head)
        if self.kind in ("wrap", "clip"):
            return max(min(self.natural, WRAP_MIN), head)
        return max(self.natural, head)


def _total(widths: Iterable[int]) -> int:
    widths = list(widths)
    return sum(widths) + GAP * max(len(widths) - 1, 0)


def _shrink_names(chosen: list[_Column], deficit: int) -> int:
    """Narrow the chosen name columns (not below their minimum) by up to ``deficit`` cells, if
    that covers it all; the deficit left (0 when covered, unchanged when not)."""
    names = [c for c in chosen if c.kind == "name"]
    room = sum(c.width - c.needed(c.header) for c in names)
    if room < deficit:
        return deficit
    for col in sorted(names, key=lambda c: -c.width):
        take = min(deficit, col.width - col.needed(col.header))
        col.width, deficit = col.width - take, deficit - take
    return deficit


def _fit(columns: list[_Column], order: list[str], width: int, split: bool) -> list[_Column] | None:
    """The columns of ``order`` (priority) that fit in ``width``, each given its width; None
    when the first column alone does not fit."""
    by_name = {c.name: c for c in columns}
    chosen: list[_Column] = []
    for name in order:
        col = by_name[name]
        header = split_header(col.name) if split else col.name
        need = col.needed(header)
        if col.kind == "name":  # a long name may take its share now; it grows again at the end
            need = max(need, min(col.natural, int(width * NAME_SHARE)))
        elif col.kind == "wrap":  # sentences wrapped into a sliver are unreadable
            need = max(need, min(col.natural, int(width * WRAP_SHARE)))
        deficit = _total([c.width for c in chosen] + [need]) - width
        if deficit > 0 and col.kind == "wrap":  # names give way to sentences, down to their minimum
            deficit = _shrink_names(chosen, deficit)
        if deficit <= 0:
            col.header, col.width = header, need
            chosen.append(col)
        elif not chosen:
            return None
    spare = width - _total(c.width for c in chosen)
    for col in chosen:  # names first: a whole layer name says more than a one-line header
        if col.kind == "name" and spare > 0:
            grow = min(spare, max(col.natural - col.width, 0))
            col.width, spare = col.width + grow, spare - grow
    for col in sorted(chosen, key=lambda c: c.needed(c.name) - c.width):
        extra = col.needed(col.name) - col.width
        if col.header != col.name and 0 <= extra <= spare:  # room to put the header back on one line
            col.header, col.width, spare = col.name, col.width + extra, spare - extra
    for col in chosen:
        if col.kind in ("wrap", "clip") and spare > 0:
            grow = min(spare, max(col.natural - col.width, 0))
            col.width, spare = col.width + grow, spare - grow
    return chosen


def _ranks(chosen: list[_Column], rank: list[str]) -> tuple[int, ...]:
    """The priorities a fit shows, best first, padded: the smaller tuple shows the more useful columns."""
    shown = sorted(rank.index(c.name) for c in chosen)
    return tuple(shown + [len(rank)] * (len(rank) - len(shown)))


def render_table(
    frame: "pd.DataFrame",
    *,
    title: str | None = None,
    columns: Sequence[str] | None = None,
    priority: Sequence[str] | None = None,
    width: int | None = None,
    names: Sequence[str] = ("layer",),
    wrap: Sequence[str] = (),
    clip: Sequence[str] = (),
    formats: Mapping[str, Callable[[object], str]] | None = None,
    highlight: Iterable[int] = (),
    highlight_style: str = "bold red",
    row_styles: Sequence[str | None] | None = None,
) -> Table:
    """``frame`` as a rich Table.

    ``columns``: display order (default: all).  ``priority``: most useful first (default:
    the display order); with ``width`` only the columns that fit are shown, the others are
    named in the caption.  ``width=None`` shows every column at its natural width (``--wide``).
    ``names``: columns shortened from the left; ``wrap``: text columns that wrap; ``clip``:
    text columns cut at the end.  ``formats``: per-column cell formatters (default
    ``format_value``; a formatter gets the raw value, None/NaN included).
    """
    import pandas as pd

    display = list(columns) if columns is not None else list(frame.columns)
    rank = [c for c in (priority or display) if c in display]
    rank += [c for c in display if c not in rank]
    rank = [escaped(c) for c in rank]  # columns go by their shown names from here on
    cols = []
    for name in display:
        values = frame[name] if name in frame else [None] * len(frame)
        numeric = name in frame and pd.api.types.is_numeric_dtype(frame[name]) and not pd.api.types.is_bool_dtype(frame[name])
        kind = "name" if name in names else "wrap" if name in wrap else "clip" if name in clip else "value"
        fmt = (formats or {}).get(name, format_value)
        cols.append(_Column(escaped(name), [escaped(fmt(v)) for v in values], numeric, kind))
    by_name = {c.name: c for c in cols}
    if width is None:
        chosen = cols
        for col in cols:
            col.header, col.width = col.name, max(col.natural, cell_len(col.name))
    else:
        # no empty columns: blank, or "-" (not there) in every row
        visible = [c for c in rank if any(cell.strip() not in ("", "-") for cell in by_name[c].cells)]
        order = visible or rank[:1]
        chosen = _fit(cols, order, width, split=False)
        if chosen is None or len(chosen) < len(visible):
            whole = None if chosen is None else _ranks(chosen, rank)
            split = _fit(cols, order, width, split=True)
            if split is not None and (whole is None or _ranks(split, rank) < whole):
                chosen = split
            else:  # _fit sets the columns' widths: give them back the one-line fit's
                chosen = _fit(cols, order, width, split=False)
        if chosen is None:  # not even the first column fits: show it cut to the width
            first = next(c for c in cols if c.name == rank[0])
            first.header, first.width = shorten_left(first.name, width), max(width, 1)
            chosen = [first]
    shown = [c for c in cols if any(c is k for k in chosen)]  # back to display order
    hidden = [c.name for c in cols if not any(c is k for k in chosen)]
    table = Table(title=Text(escaped(title), style="italic") if title else None, header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  padding=(0, 1), collapse_padding=False)
    if hidden:
        table.caption = Text(f"+{len(hidden)} column(s) with --wide: {', '.join(hidden)}", style="dim")
        table.caption_justify = "left"
    for col in shown:
        table.add_column(Text(col.header), justify="right" if col.numeric else "left", width=col.width,
                         no_wrap=col.kind != "wrap", overflow="fold" if col.kind == "wrap" else "ellipsis")
    marked = set(highlight)
    for i in range(len(frame)):
        cells = [shorten_left(c.cells[i], c.width) if c.kind == "name" else c.cells[i] for c in shown]
        style = highlight_style if i in marked else (row_styles[i] if row_styles is not None else None)
        table.add_row(*(Text(cell) for cell in cells), style=style)  # Text: "[observe]" is data, not markup
    return table


def table_width(table: Table) -> int:
    """The cells a rendered ``table`` takes (its columns' widths and gaps)."""
    return _total(c.width or 0 for c in table.columns)
