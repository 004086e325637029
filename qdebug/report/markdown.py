"""Markdown tables, e.g. for ``$GITHUB_STEP_SUMMARY``."""

from __future__ import annotations

import pandas as pd

from qdebug.report.table import format_value


def markdown_table(frame: pd.DataFrame, columns: list[str] | None = None) -> str:
    cols = columns or list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in frame.to_dict("records"):
        lines.append("| " + " | ".join(format_value(row.get(c)).replace("|", "\\|") for c in cols) + " |")
    return "\n".join(lines)
