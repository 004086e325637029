"""Reading the terminal tables qdebug prints (rich's SIMPLE_HEAD style), for tests."""

from __future__ import annotations

import re

RULE = "─"


def table_lines(out: str) -> tuple[list[str], list[str]]:
    """(header lines, body lines) of the first table in ``out``."""
    lines = out.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.strip() and set(line.strip()) == {RULE})
    start = rule
    while start > 0 and lines[start - 1].strip() and not _is_title(lines[start - 1], lines[rule]):
        start -= 1
    body = []
    for line in lines[rule + 1:]:
        if not line.strip() or line.startswith("+") or set(line.strip()) == {RULE}:
            break
        body.append(line)
    return lines[start:rule], body


def _is_title(line: str, rule: str) -> bool:
    return line.startswith(" ") and line.strip() and len(line) - len(line.lstrip()) > len(rule) // 4


def header_cells(out: str) -> list[str]:
    """The column names of a one-line-header table (``--wide``)."""
    head, _ = table_lines(out)
    return head[-1].split()


def cells(line: str) -> list[str]:
    """A body line's cells (cells hold single spaces only; a blank first cell is kept)."""
    parts = re.split(r" {2,}", line.rstrip())
    return parts if parts[0] or line.startswith(" ") else parts[1:]


def body_rows(out: str) -> list[list[str]]:
    return [cells(line) for line in table_lines(out)[1]]
