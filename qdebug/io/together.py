"""Two outputs of one command, written both or neither: a file (``-o FILE``, ``--junit FILE``)
and the ``--out DIR`` folder.

Inside ``holding()``, ``qdebug.io.atomic.atomic_path`` writes a file's temp file as usual but does
not rename it into place: the temp file waits, locked (``qdebug.io.leftovers``), in the pending
list. ``commit_with(commit_folder)`` then renames the pending files into place -- each keeping
the file it replaces as a hard link (a copy where links are refused) -- and commits the folder;
if the folder's commit fails, the files get their previous content back (or are removed where
there was none) before the error goes on. ``discard()`` drops whatever is still pending: a run
that fails before its end writes neither output.

A device or FIFO target (``-o /dev/stdout``) is written as it goes and is no part of this.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from qdebug.io import leftovers


@dataclass
class _Pending:
    tmp: Path  # the written temp file, beside its target
    real: Path  # the target (links resolved)
    target: Path  # the target as given (for errors)
    lock: int | None  # the temp file's lock (qdebug.io.leftovers)
    made: list[Path]  # the folders atomic_path created for it


_PENDING: list[_Pending] = []
_HOLDING = [False]


@contextlib.contextmanager
def holding() -> Iterator[None]:
    """Within: files written with ``atomic_path`` wait for ``commit_with`` instead of being renamed."""
    before = _HOLDING[0]
    _HOLDING[0] = True
    try:
        yield
    finally:
        _HOLDING[0] = before


def held(tmp: Path, real: Path, target: Path, lock: int | None, made: list[Path]) -> bool:
    """Called by ``atomic_path`` with its finished temp file: True when it is kept for ``commit_with``
    (the temp file and its lock are then this module's), False to rename it now."""
    if not _HOLDING[0]:
        return False
    _PENDING.append(_Pending(tmp, real, target, lock, made))
    return True


def commit_with(commit_folder: Callable[[], None]) -> None:
    """The pending files renamed into place, then ``commit_folder()``; on any failure the files
    replaced so far are put back as they were, the rest dropped, and the error goes on."""
    from qdebug.io.filesystem import write_errors

    pending, _PENDING[:] = list(_PENDING), []
    undo: list[tuple[_Pending, Path | None, int | None]] = []
    try:
        while pending:
            item = pending[0]
            with write_errors(item.target):
                backup, lock = _keep_previous(item.real)
                try:
                    os.replace(item.tmp, item.real)
                except BaseException:
                    _forget(backup, lock)
                    raise
            undo.append((item, backup, lock))
            pending.pop(0)
            leftovers.release(item.lock)
        commit_folder()
    except BaseException:
        for item, backup, lock in reversed(undo):
            _put_back(item, backup, lock)
        _drop(pending)
        raise
    for _, backup, lock in undo:
        _forget(backup, lock)


def discard() -> None:
    """Drop the pending files (a run that ends before its outputs are committed). Safe to repeat."""
    pending, _PENDING[:] = list(_PENDING), []
    _drop(pending)


def _keep_previous(real: Path) -> tuple[Path | None, int | None]:
    """The file ``real`` replaces, kept under a temp name beside it (locked, so a sweep of another
    run leaves it), or None where there is none."""
    if not real.is_file():
        return None, None
    try:
        lock, backup = leftovers.link_beside(real)
    except FileExistsError:
        raise
    except OSError:  # no hard links here: a copy
        lock, backup = leftovers.new_temp_file(real.parent, real.name)
        shutil.copy2(real, backup)
    return backup, lock


def _put_back(item: _Pending, backup: Path | None, lock: int | None) -> None:
    from qdebug.io.filesystem import remove_dirs

    with contextlib.suppress(OSError):
        if backup is not None:
            os.replace(backup, item.real)
        else:
            item.real.unlink()
            remove_dirs(item.made)
    leftovers.release(lock)


def _forget(backup: Path | None, lock: int | None) -> None:
    if backup is not None:
        with contextlib.suppress(OSError):
            backup.unlink()
    leftovers.release(lock)


def _drop(pending: list[_Pending]) -> None:
    from qdebug.io.filesystem import remove_dirs

    for item in pending:
        with contextlib.suppress(OSError):
            item.tmp.unlink()
        leftovers.release(item.lock)
        remove_dirs(item.made)
