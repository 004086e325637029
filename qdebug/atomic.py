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

Folders (the ``--out DIR`` of every command) are ``qdebug.staged.StagedDir``'s, built on these
rules. A temp file is locked while its run writes it: one that a killed run left is removed by the
next write of the same file (``qdebug.leftovers``). Inside ``qdebug.together.holding()`` the
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

from qdebug import leftovers, together
from qdebug.errors import QDebugError, checked_path

Kind = Literal["file", "stream"]

# How torch's zip writer reports a write the file system refused (it raises RuntimeError,
# not OSError, and loses the errno): a full disk, a file-size limit, a device.
_TORCH_WRITE_FAILURES = ("inline_container", "PytorchStreamWriter", "iostream error", "file write failed")
_DEVICE_TREES = ("/dev/", "/proc/")
_WRITE_HINT = "check the path, its permissions and the free disk space"

# staging folder -> the folder the user named: errors about a staged file name the file the
# user will look for, not the temporary folder it is written in first.
SHOWN: dict[Path, Path] = {}


class WriteError(QDebugError, OSError):
    """An output the file system refused to take. A ``QDebugError`` (one clean ``error:`` line)
    that is also an ``OSError``, so code that caught ``qdebug.save``'s OSError still does."""

    def __init__(self, message: str, hint: str | None = None, *, code: int | None = None,
                 filename: str | None = None):
        QDebugError.__init__(self, message, hint)
        self.errno, self.strerror, self.filename = code, None, filename


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
        raise _write_error(target, exc) from None
    try:
        mode = os.stat(target).st_mode
    except OSError as exc:
        if link and exc.errno in (errno.ENOENT, errno.ELOOP):
            raise QDebugError(f"cannot write {target}: it is a symbolic link to {os.readlink(target)}, "
                              f"which {'does not exist' if exc.errno == errno.ENOENT else 'loops'}",
                              "remove the link, or create the file it points to first") from None
        raise _write_error(target, exc) from None
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


# -- errors ----------------------------------------------------------------------------------
def shown(path: str | os.PathLike) -> Path:
    """``path`` as the user knows it: a file in a staging folder is named at its final place."""
    path = Path(path)
    for staging, final in SHOWN.items():
        if path == staging or staging in path.parents:
            return final / path.relative_to(staging)
    return path


def _write_error(target: Path, exc: OSError) -> WriteError:
    """``exc`` as an error that names the output (never a temp file) and says what to do."""
    hint = _WRITE_HINT + (" (and the file-size limit: ulimit -f)" if exc.errno == errno.EFBIG else "")
    name = shown(target)
    return WriteError(f"cannot write {name}: {exc.strerror or exc}", hint, code=exc.errno, filename=str(name))


@contextlib.contextmanager
def write_errors(target: Path) -> Iterator[None]:
    """Turn the file system refusing a write to ``target`` (OSError, or torch's RuntimeError from
    its zip writer) into a ``WriteError`` naming ``target``; other errors pass unchanged."""
    try:
        yield
    except QDebugError:
        raise
    except OSError as exc:
        raise _write_error(target, exc) from exc
    except RuntimeError as exc:
        if not any(marker in str(exc) for marker in _TORCH_WRITE_FAILURES):
            raise
        name = shown(target)
        raise WriteError(f"cannot write {name}: the write failed (a full disk, a file-size limit or a device "
                         "that refuses data)", _WRITE_HINT, filename=str(name)) from exc


# -- folders made on the way -----------------------------------------------------------------
def make_dirs(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; return the ones created (outermost first), so a
    write that fails can remove them again instead of leaving empty folders behind."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()][::-1]
    made = []
    for p in missing:
        try:
            p.mkdir()
        except FileExistsError:
            continue
        made.append(p)
    return made


def remove_dirs(made: list[Path]) -> None:
    """Remove the folders ``make_dirs`` created, innermost first, if they are still empty."""
    for p in reversed(made):
        with contextlib.suppress(OSError):
            p.rmdir()


def mode_for(real: Path) -> int:
    """The permissions a written file gets: a replaced file keeps its own (a private 0600 config
    stays private); a new one gets what a plain open() would give (mkstemp creates 0600)."""
    try:
        return real.stat().st_mode & 0o777
    except OSError:
        return 0o666 & ~umask_now()


def umask_now() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


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
        raise _write_error(target, exc) from None
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
    that a killed run left are removed first (``qdebug.leftovers``). In a staging folder of this
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
