"""Leftovers of killed runs: each run's temp files and staging folders are locked while it lives,
and the next run into the same place removes the ones no live run holds.

A run that SIGKILL (or a power cut) ends cannot clean up: it leaves a ``.x.pt.*.tmp`` temp file
(``qdebug.io.atomic``) or a ``.DIR.qdebug-*.partial`` staging folder (``qdebug.io.staged``) behind.
Every run therefore holds an exclusive ``flock`` on each such file or folder it creates, for as
long as it uses it; the kernel releases the lock when the process ends, however it ends. Before
it creates its own, a run removes those of the same target whose lock it can take: their run is
gone. A live run's are never touched: their lock is held from before they have their name --
each is created under a ``.new`` name, locked, then renamed -- so a sweep never meets one that
is not locked yet. (A ``.new`` one, left by a run killed in the microseconds between, is removed
once it is a minute old.) Where locks are not available (Windows, some network file systems)
nothing is removed: a leftover that cannot be proven stale stays.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock, no sweeping
    fcntl = None  # type: ignore[assignment]

_RANDOM = r"[a-z0-9_]{8}"  # the random part of tempfile's names
_UNNAMED_AGE_S = 60  # a ".new" entry older than this was left by a run killed while naming it


def temp_file_pattern(name: str) -> re.Pattern:
    """The temp files ``atomic_path`` makes for the file ``name``: ``.name.XXXXXXXX.tmp`` (``.new`` while made)."""
    return re.compile(rf"\.{re.escape(name)}\.{_RANDOM}\.(tmp|new)")


def staging_pattern(name: str) -> re.Pattern:
    """The staging folders ``StagedDir`` makes for the folder ``name``: ``.name.qdebug-XXXXXXXX.partial``."""
    return re.compile(rf"\.{re.escape(name)}\.qdebug-{_RANDOM}\.(partial|new)")


def new_temp_file(folder: Path, name: str) -> tuple[int | None, Path]:
    """A new empty temp file for the file ``name`` in ``folder``, locked: (lock, path). The stale
    temp files of ``name`` are removed first."""
    sweep(folder, temp_file_pattern(name))
    fd, made = tempfile.mkstemp(prefix=f".{name}.", suffix=".new", dir=folder)
    os.close(fd)
    return _named(Path(made), ".tmp")


def new_staging_dir(folder: Path, name: str) -> tuple[int | None, Path]:
    """A new empty staging folder for the folder ``name`` in ``folder``, locked: (lock, path). The
    stale staging folders of ``name`` are removed first."""
    sweep(folder, staging_pattern(name))
    return _named(Path(tempfile.mkdtemp(prefix=f".{name}.qdebug-", suffix=".new", dir=folder)), ".partial")


def link_beside(real: Path) -> tuple[int | None, Path]:
    """A hard link to the file ``real`` under a temp name beside it, locked: (lock, path). Raises
    OSError where the file system has no hard links."""
    for _ in range(100):
        made = real.parent / f".{real.name}.{secrets.token_hex(4)}.new"
        try:
            os.link(real, made)
        except FileExistsError:
            continue
        return _named(made, ".tmp")
    raise FileExistsError(f"no free temp name beside {real}")


def _named(made: Path, suffix: str) -> tuple[int | None, Path]:
    """``made`` (a ``.new`` entry) locked, then renamed to its working name ending in ``suffix``."""
    lock = claim(made)
    final = made.with_name(made.name[:-len(".new")] + suffix)
    try:
        if os.path.lexists(final):  # the same random name taken meanwhile: never replace it
            raise FileExistsError(final)
        os.rename(made, final)
    except OSError:
        release(lock)
        _remove(made, os.lstat(made).st_mode if os.path.lexists(made) else 0)
        raise
    return lock, final


def claim(path: str | os.PathLike) -> int | None:
    """Lock ``path`` (a file or folder this run just created) for the rest of its use: a
    descriptor to ``release`` when done, or None where locks are not available."""
    fd = _open_for_lock(Path(path))
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def release(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)  # closing releases the lock


def sweep(folder: Path, pattern: re.Pattern) -> None:
    """Remove the entries of ``folder`` whose names match ``pattern`` and whose lock is free:
    what a run that was killed left."""
    if fcntl is None:
        return
    try:
        names = [n for n in os.listdir(folder) if pattern.fullmatch(n)]
    except OSError:
        return
    for name in names:
        _remove_if_stale(folder / name)


def _remove_if_stale(path: Path) -> None:
    try:
        info = os.lstat(path)
    except OSError:
        return
    if not (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)):  # a link or a node of that name: not ours
        return
    if path.name.endswith(".new") and time.time() - info.st_mtime < _UNNAMED_AGE_S:  # maybe being named now
        return
    fd = claim(path)
    if fd is None:  # held by a live run, or no way to tell: kept
        return
    try:
        _remove(path, info.st_mode)
    finally:
        release(fd)


def _remove(path: Path, mode: int) -> None:
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _open_for_lock(path: Path) -> int | None:
    if fcntl is None:
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
