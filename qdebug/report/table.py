"""A DataFrame as a rich table: numbers formatted, chosen rows highlighted."""

from __future__ import annotations

import math
from typing import Iterable

import pandas as pd
from rich.table import Table


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


def render_table(
    frame: pd.DataFrame,
    *,
    title: str | None = None,
    columns: Iterable[str] | None = None,
    highlight: Iterable[int] = (),
    highlight_style: str = "bold red",
) -> Table:
    cols = list(columns) if columns is not None else list(frame.columns)
    table = Table(title=title, header_style="bold", show_lines=False)
    for col in cols:
        numeric = pd.api.types.is_numeric_dtype(frame[col]) if col in frame else False
        table.add_column(col, justify="right" if numeric else "left", overflow="fold")
    marked = set(highlight)
    for i, (_, row) in enumerate(frame.iterrows()):
        table.add_row(*(format_value(row.get(c)) for c in cols), style=highlight_style if i in marked else None)
    return table
