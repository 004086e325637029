"""The all-or-nothing output folder (``--out DIR`` of every command): ``StagedDir``.

The files of a run are written into a hidden staging folder and moved into place together at
the end, under a lock, so that a failed run changes nothing and two runs on the same folder
never mix their files.  Each file moves by the rules of ``qdebug.io.atomic`` (through a link, into
a device).  The staging folder is locked while its run lives, so the next run removes one that a
killed run left, and only such a one (``qdebug.io.leftovers``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import weakref
from pathlib import Path
from typing import Iterator

from qdebug.io.atomic import output_kind, refuse_dangling_link
from qdebug.io.filesystem import SHOWN, WriteError, make_dirs, mode_for, remove_dirs, shown, umask_now, write_errors
from qdebug.io import leftovers
from qdebug.errors import QDebugError


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
        self._lock: int | None = None  # the staging folder's lock while this run uses it (qdebug.io.leftovers)

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
                os.chmod(self._staging, 0o777 & ~umask_now())
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
            self._cleanup()  # releases the lock too
            self._lock = None
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
            self._made = [] if inside else make_dirs(real.parent)
            staging, self._lock = _new_staging(real, inside)
        except OSError as exc:
            remove_dirs(self._made)
            raise WriteError(f"cannot create output directory {self.final}: {exc.strerror or exc}",
                             "choose a directory you can write to", code=exc.errno) from None
        self._staging = staging
        SHOWN[staging] = self.final
        self._cleanup = weakref.finalize(self, _remove_staging, staging, list(self._made), self._lock)
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
            SHOWN.pop(self._staging, None)
        if self._cleanup is not None:
            self._cleanup.detach()
        leftovers.release(self._lock)
        self._staging, self._cleanup, self._made, self._stale, self._lock = None, None, [], set(), None


def _place(src: Path, dst: Path) -> None:
    """Move the staged file ``src`` onto ``dst`` by the module's rules (through a link; into a device)."""
    if output_kind(dst) == "stream":
        with write_errors(dst), open(src, "rb") as fin, open(dst, "wb") as fout:
            shutil.copyfileobj(fin, fout)
        src.unlink()
        return
    real = Path(os.path.realpath(dst))
    with write_errors(dst):
        os.chmod(src, mode_for(real))
        os.replace(src, real)


def _remove_staging(staging: Path, made: list[Path], lock: int | None = None) -> None:
    """The staging folder and the parents made for it, gone (a failed or abandoned run)."""
    SHOWN.pop(staging, None)
    shutil.rmtree(staging, ignore_errors=True)
    remove_dirs(made)
    leftovers.release(lock)


def _new_staging(real: Path, inside: bool) -> tuple[Path, int | None]:
    """A new staging folder for the folder ``real``, locked while this run uses it: inside it when it
    exists, else beside it. The staging folders of ``real`` that a killed run left (in either place)
    are removed first (``qdebug.io.leftovers``)."""
    if inside:  # one left beside it, when the folder did not exist yet
        leftovers.sweep(real.parent, leftovers.staging_pattern(real.name))
    lock, staging = leftovers.new_staging_dir(real if inside else real.parent, real.name)
    return staging, lock


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
