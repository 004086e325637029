"""Writing the project config in place: add or change top-level keys of ``qdebug.toml`` (or
of the ``[tool.qdebug]`` table of ``pyproject.toml``), keeping every other line, comment and
table as it is.  ``qdebug init`` uses it.

TOML wants a table's own keys before its sub-tables, so a new key goes right after the
table's last key (in ``qdebug.toml``: before the first ``[header]``).  The file is read as
a sequence of headers and assignments -- an assignment's extent is found by parsing, so a
multi-line array or string is one item and a ``[`` inside it is never taken for a header.
The edited text is parsed back and must equal the old document with exactly the asked
changes; anything else is an error and nothing is written, so an edit never corrupts a file.
"""

from __future__ import annotations

import copy
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qdebug.config.project import toml_value
from qdebug.errors import QDebugError

TABLE = ("tool", "qdebug")  # where the keys live in pyproject.toml
HEADER_COMMENT = "# qdebug project configuration (docs/config.md lists every key; command-line flags override it)\n"
EXAMPLES = """
# Other keys, for when you need them:
# model = "mypkg.net:Net"      # the class of plain state_dict files (your module is then trusted)
# float = "ckpt/float.pt"      # also calibrated, qat, quantized
# data = "data/eval.pt"        # or "mypkg.data:eval_batches", or "random:8x3x224x224"
# metric = "top1"              # or "mypkg.metrics:evaluate"
"""


@dataclass
class Change:
    key: str
    value: Any  # the value the file will hold
    action: str  # "added" | "extended" (trust) | "replaced" | "unchanged"
    previous: Any = None


@dataclass
class _Item:
    kind: str  # "header" | "assign"
    start: int  # first line
    end: int  # one past the last line
    name: tuple[str, ...]  # the header's table path, or the assignment's top-level key


def plan(current: dict[str, Any], wanted: dict[str, Any], *, force: bool, source: Path) -> list[Change]:
    """What writing ``wanted`` into a table holding ``current`` changes.  ``trust`` lists are
    merged; another key the file sets differently is an error unless ``force``."""
    changes, conflicts = [], []
    for key, value in wanted.items():
        if key not in current:
            changes.append(Change(key, value, "added"))
        elif key == "trust" and isinstance(current[key], list):
            merged = list(current[key]) + [v for v in value if v not in current[key]]
            changes.append(Change(key, merged, "unchanged" if merged == current[key] else "extended", current[key]))
        elif current[key] == value:
            changes.append(Change(key, value, "unchanged", current[key]))
        elif force:
            changes.append(Change(key, value, "replaced", current[key]))
        else:
            conflicts.append(f"{key} = {toml_value(current[key])}")
    if conflicts:
        raise QDebugError(
            f"{source} already sets {'; '.join(conflicts)}",
            "pass --force to replace the value(s), or edit the file yourself",
        )
    return changes


def new_text(changes: list[Change], *, pyproject: bool) -> str:
    """A fresh config file holding ``changes``."""
    lines = [f"{c.key} = {toml_value(c.value)}\n" for c in changes]
    if pyproject:
        return "[tool.qdebug]\n" + "".join(lines)
    return HEADER_COMMENT + "".join(lines) + EXAMPLES


def edit_text(text: str, changes: list[Change], *, pyproject: bool, source: Path) -> str:
    """``text`` with ``changes`` applied in place; checked by parsing it back."""
    try:
        before = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise QDebugError(f"{source} is not valid TOML: {exc}",
                          "fix the syntax error at the position given (or move the file away), then run qdebug init again") from None
    todo = [c for c in changes if c.action != "unchanged"]
    if not todo:
        return text
    newline = "\r\n" if "\r\n" in text else "\n"
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith(("\n", "\r")):
        lines[-1] += newline
    for change in (c for c in todo if c.action != "added"):  # in place, one at a time
        item = _find(_own_keys(lines, pyproject, source)[0], change.key, source)
        lines[item.start:item.end] = [f"{change.key} = {toml_value(change.value)}{newline}"]
    region, start, stop = _own_keys(lines, pyproject, source)
    added = [f"{c.key} = {toml_value(c.value)}{newline}" for c in todo if c.action == "added"]
    if pyproject and start is None:  # no [tool.qdebug] table yet: a new one at the end
        if lines and lines[-1].strip():
            lines.append(newline)
        lines += [f"[tool.qdebug]{newline}", *added]
    elif added:
        if region:
            at = max(i.end for i in region)
        elif pyproject:
            at = start  # right after the [tool.qdebug] header
        elif stop < len(lines):  # only tables: the keys go above the first one (and its comments)
            added = added + [newline]
            at = stop
            while at > 0 and lines[at - 1].strip().startswith("#"):
                at -= 1
        else:
            at = len(lines)
        lines[at:at] = added
    result = "".join(lines)
    _check(before, result, changes, pyproject, source)
    return result


def _own_keys(lines: list[str], pyproject: bool, source: Path) -> tuple[list[_Item], int | None, int]:
    """The table's own assignments, and the (start, stop) lines of its region."""
    items = _scan(lines, source)
    start, stop = _region(items, pyproject, len(lines))
    region = [i for i in items if i.kind == "assign" and start is not None and start <= i.start and i.end <= stop]
    return region, start, stop


def _scan(lines: list[str], source: Path) -> list[_Item]:
    items, i = [], 0
    while i < len(lines):
        stripped = lines[i].strip()
        if not stripped or stripped.startswith("#"):
            i += 1
            continue
        if stripped.startswith("["):  # outside any value (values are skipped whole), so a header
            items.append(_Item("header", i, i + 1, _header_path(stripped)))
            i += 1
            continue
        j, parsed = _assignment(lines, i, source)
        items.append(_Item("assign", i, j, tuple(parsed)[:1]))
        i = j
    return items


def _assignment(lines: list[str], i: int, source: Path) -> tuple[int, dict]:
    """The assignment starting on line ``i``: (one past its last line, its parsed value).  Its
    end is where its brackets close outside any string (``_value_end``), checked by parsing it
    once: linear in its lines.  Should that check fail, the shortest prefix that parses is
    searched, from there on (quadratic, but only for a layout the scanner misjudges)."""
    for j in range(_value_end(lines, i), len(lines) + 1):
        try:
            return j, tomllib.loads("".join(lines[i:j]))
        except tomllib.TOMLDecodeError:
            continue
    raise QDebugError(f"cannot read the assignment on line {i + 1} of {source}",
                      "fix the file (or move it away), then run qdebug init again")


def _value_end(lines: list[str], i: int) -> int:
    """One past the first line, from ``i`` on, that ends outside every string, bracket and brace
    (len(lines) when there is none): where the TOML assignment starting on line ``i`` ends."""
    depth, quote = 0, ""  # quote: the open string's delimiter (', ", ''' or """), "" outside
    for n in range(i, len(lines)):
        line, k = lines[n], 0
        while k < len(line):
            if quote:
                if quote[0] == '"' and line[k] == "\\":
                    k += 2  # an escape (in a multi-line string, "\\" at the end joins lines)
                    continue
                if line.startswith(quote, k):
                    run = len(quote)  # a multi-line string may end in up to 2 more quotes ('''''')
                    while len(quote) == 3 and run < 5 and line[k + run:k + run + 1] == quote[0]:
                        run += 1
                    k, quote = k + run, ""
                    continue
                if len(quote) == 1 and line[k] in "\r\n":
                    quote = ""  # a one-line string left open: the parse check reports it
                k += 1
                continue
            char = line[k]
            if char == "#":
                break
            if char in "\"'":
                quote = line[k:k + 3] if line.startswith(char * 3, k) else char
                k += len(quote)
                continue
            depth += (char in "[{") - (char in "]}")
            k += 1
        if not quote and depth <= 0:
            return n + 1
    return len(lines)


def _header_path(line: str) -> tuple[str, ...]:
    """``[tool.qdebug]`` -> ("tool", "qdebug"); an array of tables or odd header -> its first key."""
    try:
        parsed: Any = tomllib.loads(line)
    except tomllib.TOMLDecodeError:
        return ()
    path: list[str] = []
    while isinstance(parsed, dict) and len(parsed) == 1:
        key = next(iter(parsed))
        path.append(key)
        parsed = parsed[key]
    return tuple(path) if isinstance(parsed, dict) and not parsed else ("[[", *path)


def _region(items: list[_Item], pyproject: bool, count: int) -> tuple[int | None, int]:
    """(first line, one past the last line) of the table's own keys; start None when the
    pyproject has no [tool.qdebug] header."""
    headers = [i for i in items if i.kind == "header"]
    if not pyproject:
        return 0, headers[0].start if headers else count
    for n, header in enumerate(headers):
        if header.name == TABLE:
            return header.end, headers[n + 1].start if n + 1 < len(headers) else count
    return None, count


def _find(region: list[_Item], key: str, source: Path) -> _Item:
    for item in region:
        if item.name == (key,):
            return item
    raise QDebugError(f"cannot find where {source} sets {key} (it is not a plain `{key} = ...` line)",
                      f"edit {key} in the file yourself")


def _check(before: dict, text: str, changes: list[Change], pyproject: bool, source: Path) -> None:
    """The edited text must parse to the old document with exactly ``changes``."""
    expected = copy.deepcopy(before)
    table = expected
    if pyproject:
        for key in TABLE:
            table = table.setdefault(key, {})
    for change in changes:
        table[change.key] = change.value
    try:
        after = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        after = None
    if after != expected:
        lines = "; ".join(f"{c.key} = {toml_value(c.value)}" for c in changes if c.action != "unchanged")
        where = " under [tool.qdebug]" if pyproject else " before its first [table]"
        raise QDebugError(f"cannot add to {source} safely (its layout is unusual); nothing was written",
                          f"add these lines yourself{where}: {lines}")
