"""What the file system says to a write, as the user should hear it: ``WriteError`` (a
``QDebugError`` that is also an ``OSError``) naming the output at its final place (``shown``: a
file in a staging folder is named where it will be), ``write_errors`` (OSError, or torch's zip
writer failing, turned into one), and the folders a write makes on its way (``make_dirs``,
``remove_dirs``) and the mode a written file gets (``mode_for``).

``qdebug.io.atomic`` (one file), ``qdebug.io.staged`` (a folder) and ``qdebug.io.together`` (both
at once) write through these.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Iterator

from qdebug.errors import QDebugError

# How torch's zip writer reports a write the file system refused (it raises RuntimeError,
# not OSError, and loses the errno): a full disk, a file-size limit, a device.
_TORCH_WRITE_FAILURES = ("inline_container", "PytorchStreamWriter", "iostream error", "file write failed")

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


def shown(path: str | os.PathLike) -> Path:
    """``path`` as the user knows it: a file in a staging folder is named at its final place."""
    path = Path(path)
    for staging, final in SHOWN.items():
        if path == staging or staging in path.parents:
            return final / path.relative_to(staging)
    return path


def write_error(target: Path, exc: OSError) -> WriteError:
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
        raise write_error(target, exc) from exc
    except RuntimeError as exc:
        if not any(marker in str(exc) for marker in _TORCH_WRITE_FAILURES):
            raise
        name = shown(target)
        raise WriteError(f"cannot write {name}: the write failed (a full disk, a file-size limit or a device "
                         "that refuses data)", _WRITE_HINT, filename=str(name)) from exc


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
