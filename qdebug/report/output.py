"""Machine output: ``{"meta": ..., "rows": [...]}`` JSON and CSV, written atomically.

JSON carries every string exactly, escaped by JSON itself (``ensure_ascii``: a control
character or a bidi override is written ``\\u001b``, ``\\u202e``, keys included).  CSV has no
escape of its own and is read with ``cat``: its cells and column names go through
``qdebug.safe_text.escaped``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from qdebug.io.atomic import atomic_open
from qdebug.safe_text import escaped


def _clean(value: Any) -> Any:
    # JSON has no NaN/Infinity: write them as strings so they are never lost or mistaken.
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        try:
            return _clean(value.item())
        except (ValueError, TypeError, RuntimeError):  # an array or tensor of several values
            # Summarised, never dumped: a checkpoint's meta may hold any tensor (one file's say-so).
            shape = list(getattr(value, "shape", []))
            return f"<{type(value).__name__} shape={shape} dtype={getattr(value, 'dtype', '?')}>"
    return value


def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    rows = frame.astype(object).where(pd.notna(frame), None).to_dict(orient="records")
    return [_clean(r) for r in rows]


def to_json(frame: pd.DataFrame, meta: dict[str, Any], *, rows_key: str = "rows", **extra: Any) -> str:
    payload = {"meta": _clean(meta), rows_key: records(frame)}
    payload.update({k: _clean(v) for k, v in extra.items()})
    return json.dumps(payload, indent=2, ensure_ascii=True)  # ASCII only: nothing in it drives a terminal


def write_json(path: str | Path, frame: pd.DataFrame, meta: dict[str, Any], *, rows_key: str = "rows",
               **extra: Any) -> Path:
    with atomic_open(path, "w") as fh:
        fh.write(to_json(frame, meta, rows_key=rows_key, **extra) + "\n")
    return Path(path)


def escaped_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with every string cell and column name as ``escaped`` writes it (numbers as they are)."""
    def cell(value: Any) -> Any:
        return escaped(value) if isinstance(value, str) else value

    out = frame.rename(columns=lambda c: escaped(c) if isinstance(c, str) else c)
    for i, dtype in enumerate(out.dtypes):
        if dtype == object or pd.api.types.is_string_dtype(dtype):
            out.isetitem(i, out.iloc[:, i].map(cell))
    return out


def to_csv(frame: pd.DataFrame) -> str:
    """``frame`` as CSV text, its strings shown (a name's ESC or newline never reaches ``cat``)."""
    return escaped_frame(frame).to_csv(index=False)


def write_csv(path: str | Path, frame: pd.DataFrame) -> Path:
    with atomic_open(path, "w", newline="") as fh:
        fh.write(to_csv(frame))
    return Path(path)
