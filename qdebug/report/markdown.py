"""Markdown tables, e.g. for ``$GITHUB_STEP_SUMMARY``; names and cells shown as
``qdebug.safe_text.escaped`` writes them (a newline would end the table row)."""

from __future__ import annotations

import pandas as pd

from qdebug.report.table import format_value
from qdebug.safe_text import escaped


def _cell(text: str) -> str:
    return escaped(text).replace("|", "\\|")


def markdown_table(frame: pd.DataFrame, columns: list[str] | None = None) -> str:
    cols = columns or list(frame.columns)
    lines = ["| " + " | ".join(_cell(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for row in frame.to_dict("records"):
        lines.append("| " + " | ".join(_cell(format_value(row.get(c))) for c in cols) + " |")
    return "\n".join(lines)
