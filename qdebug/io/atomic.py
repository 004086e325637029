"""Atomic output: a file, or a folder of files, appears complete or not at all.

Files (``atomic_path`` / ``atomic_open``): written to a temp file beside the target, then
renamed onto it. An interrupted or failed run never leaves a half-written output: the target
is either the old file, absent, or the complete new one.

Targets that are not plain files (the rules of docs/cli.md, "Output"):

- a symbolic link is followed: the file it points to is replaced atomically and the link
  stays a link. A dangling link (or a loop) is refused: creating a file wherever a link points
  is how a planted link redirects output;
- a character device (``/dev/null``, ``/dev/full``), and a link under ``/dev`` or ``/proc``
  (``/dev/stdout``: whatever stdout is), is written directly: a node is never swapped for a
  file, and a device that refuses the bytes is an error;
- a named pipe (FIFO) is refused, before any work: opening one with no reader blocks forever;
- a directory, a block device or a socket is refused.

A write that fails (a full disk, a file-size limit, a device that refuses) raises a
``WriteError`` naming the target -- a ``QDebugError`` the command line prints as one clean
error, and an ``OSError`` for callers that catch those. The target keeps its old content,
and neither the temp file nor a folder created for it is left behind.

Folders (the ``--out DIR`` of every command) are ``qdebug.io.staged.StagedDir``'s, built on these
rules. A temp file is locked while its run writes it: one that a killed run left is removed by the
next write of the same file (``qdebug.io.leftovers``). Inside ``qdebug.io.together.holding()`` the
finished temp file waits to be renamed with the ``--out`` folder (both outputs, or neither).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import IO, Iterator, Literal

from qdebug.io import leftovers, together
from qdebug.errors import QDebugError, checked_path
from qdebug.io.filesystem import SHOWN, write_error, make_dirs, mode_for, remove_dirs, shown, write_errors

Kind = Literal["file", "stream"]

_DEVICE_TREES = ("/dev/", "/proc/")


# -- what a target is ------------------------------------------------------------------------
def output_kind(path: str | os.PathLike) -> Kind:
    """How ``path`` is written: ``"file"`` (absent, or a regular file, maybe through a link:
    temp file + rename) or ``"stream"`` (a device: written directly). Anything else is
    refused with a ``QDebugError`` -- checked before the work starts, and again when writing."""
    target = checked_path(path)
    try:
        link = stat.S_ISLNK(os.lstat(target).st_mode)
    except FileNotFoundError:
        return "file"
    except OSError as exc:
        raise write_error(target, exc) from None
    try:
        mode = os.stat(target).st_mode
    except OSError as exc:
        if link and exc.errno in (errno.ENOENT, errno.ELOOP):
            raise QDebugError(f"cannot write {target}: it is a symbolic link to {os.readlink(target)}, "
                              f"which {'does not exist' if exc.errno == errno.ENOENT else 'loops'}",
                              "remove the link, or create the file it points to first") from None
        raise write_error(target, exc) from None
    if stat.S_ISCHR(mode) or (link and _in_device_tree(target)):
        return "stream"
    if stat.S_ISFIFO(mode):  # no reader: open() would wait forever; a reader: it is no file to replace
        raise QDebugError(f"cannot write {shown(target)}: it is a named pipe (FIFO)",
                          "give the path of a regular file (qdebug does not write into named pipes)")
    if stat.S_ISREG(mode):
        return "file"
    what = "a directory" if stat.S_ISDIR(mode) else "a block device" if stat.S_ISBLK(mode) else "not a regular file"
    raise QDebugError(f"cannot write {target}: it is {what}", "give the path of a file")


def _in_device_tree(target: Path) -> bool:
    """A path under /dev or /proc. A link there names a node, not a file to replace
    (``/dev/stdout`` is whatever stdout is): it is written through even when it ends at a
    regular file (stdout redirected to one), whose reader holds it open."""
    return any(str(target.absolute()).startswith(tree) for tree in _DEVICE_TREES)


def refuse_dangling_link(path: str | os.PathLike) -> None:
    """A folder named by a link that points nowhere is refused, as a file is (``output_kind``)."""
    target = Path(path)
    if target.is_symlink() and not target.exists():
        raise QDebugError(f"cannot write {target}: it is a symbolic link to {os.readlink(target)}, "
                          "which does not exist", "remove the link, or create the folder it points to first")


# -- files -----------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield the path to write ``path``'s content to: a temp file beside the file (renamed onto it
    on success), or ``path`` itself for a device or FIFO. Follows the module's rules."""
    target = Path(path)
    if output_kind(target) == "stream":
        with write_errors(target):
            yield target
        return
    real = Path(os.path.realpath(target))
    made: list[Path] = []
    try:
        made = make_dirs(real.parent)
        lock, tmp = _locked_temp(real)
    except OSError as exc:
        remove_dirs(made)
        raise write_error(target, exc) from None
    tmp_path = Path(tmp)
    try:
        with write_errors(target):
            yield tmp_path
            os.chmod(tmp_path, mode_for(real))
            if together.held(tmp_path, real, target, lock, made):  # a second output: renamed with --out's
                return
            os.replace(tmp_path, real)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        remove_dirs(made)
        leftovers.release(lock)
        raise
    leftovers.release(lock)


def _locked_temp(real: Path) -> tuple[int | None, str]:
    """A new temp file beside ``real``, locked while this run writes it; the temp files of ``real``
    that a killed run left are removed first (``qdebug.io.leftovers``). In a staging folder of this
    run (new, and locked by it) there is nothing to sweep."""
    if real.parent in SHOWN:
        fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".tmp", dir=real.parent)
        os.close(fd)
        return None, tmp
    lock, tmp_path = leftovers.new_temp_file(real.parent, real.name)
    return lock, str(tmp_path)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs) -> Iterator[IO]:
    """``open(path, mode)`` that follows ``atomic_path``'s rules (closing is part of the write)."""
    with atomic_path(path) as tmp:
        with open(tmp, mode, **kwargs) as fh:
            yield fh
