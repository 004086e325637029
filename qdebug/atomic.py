"""Atomic output: a file, or a folder of files, appears complete or not at all.

Files (``atomic_path`` / ``atomic_open``): written to a temp file beside the target, then
renamed onto it. An interrupted or failed run never leaves a half-written output: the target
is either the old file, absent, or the complete new one.

Targets that are not plain files (the rules of docs/cli.md, "Output"):

- a symbolic link is followed: the file it points to is replaced atomically and the link
  stays a link. A dangling link (or a loop) is refused: creating a file wherever a link points
  is how a planted link redirects output;
- a character device or a FIFO (``/dev/null``, ``/dev/full``, a named pipe), and a link under
  ``/dev`` or ``/proc`` (``/dev/stdout``: whatever stdout is), is written directly: a node is
  never swapped for a file, and a device that refuses the bytes is an error;
- a directory, a block device or a socket is refused.

A write that fails (a full disk, a file-size limit, a device that refuses) raises a
``WriteError`` naming the target -- a ``QDebugError`` the command line prints as one clean
error, and an ``OSError`` for callers that catch those. The target keeps its old content,
and neither the temp file nor a folder created for it is left behind.

Folders (``StagedDir``, the ``--out DIR`` of every command): the files are written into a
staging folder and moved into place together at the end, under a lock, so that a failed run
changes nothing and two runs on the same folder never mix their files.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
import weakref
from pathlib import Path
from typing import IO, Iterator, Literal

from qdebug.errors import QDebugError

Kind = Literal["file", "stream"]

# How torch's zip writer reports a write the file system refused (it raises RuntimeError,
# not OSError, and loses the errno): a full disk, a file-size limit, a device.
_TORCH_WRITE_FAILURES = ("inline_container", "PytorchStreamWriter", "iostream error", "file write failed")
_DEVICE_TREES = ("/dev/", "/proc/")
_WRITE_HINT = "check the path, its permissions and the free disk space"

# staging folder -> the folder the user named: errors about a staged file name the file the
# user will look for, not the temporary folder it is written in first.
_SHOWN: dict[Path, Path] = {}


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
    temp file + rename) or ``"stream"`` (a device or FIFO: written directly). Anything else is
    refused with a ``QDebugError`` -- checked before the work starts, and again when writing."""
    target = Path(path)
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
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode) or (link and _in_device_tree(target)):
        return "stream"
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
    for staging, final in _SHOWN.items():
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
def _make_dirs(folder: Path) -> list[Path]:
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


def _remove_dirs(made: list[Path]) -> None:
    """Remove the folders ``_make_dirs`` created, innermost first, if they are still empty."""
    for p in reversed(made):
        with contextlib.suppress(OSError):
            p.rmdir()


def _mode_for(real: Path) -> int:
    """The permissions a written file gets: a replaced file keeps its own (a private 0600 config
    stays private); a new one gets what a plain open() would give (mkstemp creates 0600)."""
    try:
        return real.stat().st_mode & 0o777
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
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
        made = _make_dirs(real.parent)
        fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".tmp", dir=real.parent)
    except OSError as exc:
        _remove_dirs(made)
        raise _write_error(target, exc) from None
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        with write_errors(target):
            yield tmp_path
            os.chmod(tmp_path, _mode_for(real))
            os.replace(tmp_path, real)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        _remove_dirs(made)
        raise


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs) -> Iterator[IO]:
    """``open(path, mode)`` that follows ``atomic_path``'s rules (closing is part of the write)."""
    with atomic_path(path) as tmp:
        with open(tmp, mode, **kwargs) as fh:
            yield fh


# -- folders ---------------------------------------------------------------------------------
class StagedDir:
    """An output folder whose files appear together or not at all.

    ``file(name)`` is where to write ``name``: a hidden staging folder, made on first use (a run
    that fails before writing anything creates nothing). ``commit()`` moves the files into the
    folder under a lock on its parent, so two runs on one folder never mix their files: the
    folder is renamed into place when it does not exist yet; an existing folder (shared by
    several commands, or holding the user's own files) keeps everything else, and only the files
    this run wrote -- and those it names with ``drop_stale`` -- are replaced. ``discard()`` (also
    run when the object is collected) removes the staging folder and the parents made for it.
    """

    def __init__(self, path: str | os.PathLike):
        self.final = Path(path)
        self._staging: Path | None = None
        self._made: list[Path] = []
        self._stale: set[str] = set()
        self._cleanup: weakref.finalize | None = None

    def file(self, name: str) -> Path:
        """Where to write the file ``name`` of this folder now."""
        return self._staging_dir() / name

    def shown(self, path: str | os.PathLike) -> Path:
        """``path`` (a file this run staged) as the user will find it once committed."""
        return shown(path)

    def drop_stale(self, *names: str) -> None:
        """Files this run does not write whose earlier version would contradict it (nan-trace's
        repro bundle after a clean run): removed when this run's files move in, not before."""
        self._stale.update(names)

    def commit(self) -> None:
        """Move the staged files into the folder, all at once (under the lock)."""
        real = Path(os.path.realpath(self.final))
        with _locked(real.parent), write_errors(self.final):
            if self._staging is not None and not os.path.lexists(real):  # staged beside it: rename into place
                os.chmod(self._staging, 0o777 & ~_umask())
                os.rename(self._staging, real)
            elif real.is_dir():
                self._merge_into(self.final)
            elif self._staging is not None:
                raise QDebugError(f"cannot write into {self.final}: it is no longer a directory",
                                  "give a directory path (one that is not an existing file)")
        self._forget()

    def discard(self) -> None:
        """Remove whatever this run staged; the folder itself is left as it was. Safe to repeat."""
        if self._cleanup is not None:
            self._cleanup()
        self._forget()

    def _staging_dir(self) -> Path:
        """The staging folder, made on first use: inside the folder when it exists (its parent may
        not be writable: ``--out .``), else beside it, to be renamed into place."""
        if self._staging is not None:
            return self._staging
        refuse_dangling_link(self.final)
        real = Path(os.path.realpath(self.final))
        inside = real.is_dir()
        try:
            self._made = [] if inside else _make_dirs(real.parent)
            staging = Path(tempfile.mkdtemp(prefix=f".{real.name}.qdebug-", suffix=".partial",
                                            dir=real if inside else real.parent))
        except OSError as exc:
            _remove_dirs(self._made)
            raise WriteError(f"cannot create output directory {self.final}: {exc.strerror or exc}",
                             "choose a directory you can write to", code=exc.errno) from None
        self._staging = staging
        _SHOWN[staging] = self.final
        self._cleanup = weakref.finalize(self, _remove_staging, staging, list(self._made))
        return staging

    def _merge_into(self, folder: Path) -> None:
        """Replace the folder's files of the same names with the staged ones (each target checked
        before any moves), then drop the stale ones this run did not write."""
        names = sorted(os.listdir(self._staging)) if self._staging is not None else []
        for name in names:
            output_kind(folder / name)
        for name in names:
            _place(self._staging / name, folder / name)
        for name in sorted(self._stale - set(names)):
            if (folder / name).is_symlink() or (folder / name).is_file():
                (folder / name).unlink()
        if self._staging is not None:
            self._staging.rmdir()

    def _forget(self) -> None:
        if self._staging is not None:
            _SHOWN.pop(self._staging, None)
        if self._cleanup is not None:
            self._cleanup.detach()
        self._staging, self._cleanup, self._made, self._stale = None, None, [], set()


def _place(src: Path, dst: Path) -> None:
    """Move the staged file ``src`` onto ``dst`` by the module's rules (through a link; into a device)."""
    if output_kind(dst) == "stream":
        with write_errors(dst), open(src, "rb") as fin, open(dst, "wb") as fout:
            shutil.copyfileobj(fin, fout)
        src.unlink()
        return
    real = Path(os.path.realpath(dst))
    with write_errors(dst):
        os.chmod(src, _mode_for(real))
        os.replace(src, real)


def _remove_staging(staging: Path, made: list[Path]) -> None:
    """The staging folder and the parents made for it, gone (a failed or abandoned run)."""
    _SHOWN.pop(staging, None)
    shutil.rmtree(staging, ignore_errors=True)
    _remove_dirs(made)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (flock on the directory itself, so no lock file is
    left anywhere) while runs commit into it. Without flock (Windows) or without read access to
    the folder, the commit runs unlocked: the files still move in together, at once."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
