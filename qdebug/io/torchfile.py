"""Reading a torch file safely: ``torch.load(weights_only=True)``, every failure one
QDebugError, and a refused pickle named for what it is.

A file that names Python objects is refused unless the user passes ``--unsafe-load``;
the refusal reads the pickle's opcodes (never running them) to say what it holds -- a
whole model saved with ``torch.save(model)`` and its class -- and how to re-save it.
With ``--unsafe-load`` the classes it names are found from the current directory too
(``qdebug.io.usercode``), and one that cannot be found is named, not called "damaged".

Before torch opens anything (``check_readable``): only a regular file is read (a named pipe
would block forever, a link to /dev/zero never ends); a zip archive whose records expand to
more bytes than the file holds (torch.save never compresses; a crafted "zip bomb" does), or
whose pickle fails its CRC-32, is refused.  A file torch cannot read is called damaged: only
an intact pickle that names a Python class is said to hold pickled objects, with the
``--unsafe-load`` hint.

``read_file(path, mmap=True)`` maps a zip archive's tensors rather than reading them, after the
same checks: a data file is then sliced batch by batch (``qdebug.data.file``).

``check_dense`` is the rule every tensor read from a file obeys before it is used: dense, and
holding no more values than its storage (an expanded, stride-0 or overlapping view of a few
stored bytes would describe terabytes).
"""

from __future__ import annotations

import os
import pickle
import stat
import zipfile
from pathlib import Path
from typing import Any

import torch

from qdebug.errors import QDebugError, checked_path, first_line


DAMAGED_HINT = "the file is damaged (cut short or overwritten): save it again, or copy it again"


def read_file(path: str | Path, *, unsafe: bool = False, mmap: bool = False) -> Any:
    """``torch.load`` with every failure turned into one clear QDebugError.

    ``mmap``: map the file's tensors instead of reading them (a zip archive only; a legacy
    file is read whole): a tensor's pages are read when touched, and they leave the
    process's memory when the last tensor of the file is dropped."""
    p = checked_path(path)
    check_readable(p)
    try:
        return torch.load(p, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(p))
    except pickle.UnpicklingError as exc:
        # Only an intact file whose pickle names Python objects is "pickled objects": cut or
        # overwritten bytes fail the weights-only unpickler too, and are called damaged.
        named = _unsupported_global(str(exc))
        if named is None or not _whole_pickle(p):
            raise _damaged(p, _unpickler_says(exc)) from None
        whole = pickled_class(p)  # "mypkg.net.Net" for a torch.save(model) file
        named = whole or named
        if not unsafe:
            raise _pickle_refusal(p, whole, named) from None
        del exc
    except Exception as exc:  # damaged bytes reach many reader error paths (RuntimeError, EOFError, KeyError, ...)
        raise _damaged(p, f"{type(exc).__name__}: {_first_line(exc)}") from None
    return _unsafe_load(p, whole, named)


EXPANDED_HINT = "save real tensors (x.contiguous().clone()), not expanded views"


def check_dense(tensor: torch.Tensor, what: str, source: str | Path) -> None:
    """``tensor`` (read from ``source``) is dense and holds no more values than its storage
    stores: an expanded (stride-0) or overlapping view is refused before it is copied or used,
    so nothing read from a file grows past its size on disk."""
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise QDebugError(f"{source}: {what} is a {tensor.layout} {tensor.dtype} tensor; qdebug reads dense tensors",
                          "save dense tensors (x.to_dense(), x.dequantize())")
    stored = tensor.untyped_storage().nbytes()
    if tensor.numel() * tensor.element_size() > stored:
        raise QDebugError(f"{source}: {what} is an expanded view: {list(tensor.shape)} ({tensor.numel()} values) "
                          f"over {stored // max(tensor.element_size(), 1)} stored", EXPANDED_HINT)


def _damaged(p: Path, detail: str) -> QDebugError:
    """The error for a file torch could not read, saying what is wrong where it can: a record
    failing its checksum, a pickle cut short, else what the reader said."""
    bad = _damaged_record(p)
    if bad is not None:
        detail = f"its record {bad} fails its CRC-32 check"
    elif not _whole_pickle(p):
        detail = "its pickle is cut short or malformed"
    return QDebugError(f"{p} is not a readable torch file: it is damaged ({detail})", DAMAGED_HINT)


def check_readable(p: Path) -> None:
    """Refuse, before torch opens it: what is no regular file (a directory, a named pipe, a
    device, a socket; symlinks resolved) -- a pipe would block forever, /dev/zero never end;
    a zip archive whose records claim more bytes than the file holds (torch.save never
    compresses: a "zip bomb"); an archive whose pickle fails its CRC-32 (damaged)."""
    try:
        info = os.stat(p)  # follows symlinks: a link to /dev/zero is the device
    except FileNotFoundError:
        raise QDebugError(f"no such file: {p}", "check the path") from None
    except OSError as exc:
        raise QDebugError(f"cannot read {p}: {exc.strerror or exc}", "check the path and its permissions") from None
    if stat.S_ISDIR(info.st_mode):
        raise QDebugError(f"{p} is a directory, not a checkpoint file", "pass the checkpoint file, not its directory")
    if not stat.S_ISREG(info.st_mode):
        kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(info.st_mode) else "a character device"
                if stat.S_ISCHR(info.st_mode) else "a block device" if stat.S_ISBLK(info.st_mode)
                else "a socket" if stat.S_ISSOCK(info.st_mode) else "not a regular file")
        shown = f"{p} (-> {p.resolve()})" if p.is_symlink() else str(p)
        raise QDebugError(f"{shown} is {kind}, not a regular file: qdebug reads only regular files",
                          "save the checkpoint or data to a file and pass that file")
    try:
        with zipfile.ZipFile(p) as archive:
            claimed = sum(item.file_size for item in archive.infolist())
    except Exception as exc:  # no zip archive (a legacy torch file), or a damaged one: torch's reader says what
        del exc
        return
    if claimed > info.st_size:
        raise QDebugError(
            f"{p} is a compressed archive: its records expand to {claimed} bytes from {info.st_size} on disk, "
            "and torch.save never compresses",
            "the file is damaged or crafted: re-save it with torch.save or qdebug.save",
        )
    bad = _damaged_record(p, only="data.pkl")
    if bad is not None:
        raise _damaged(p, f"its record {bad} fails its CRC-32 check")


def _damaged_record(p: Path, only: str = "") -> str | None:
    """The first record of a zip archive (ending in ``only``) whose bytes fail their CRC-32, or
    None (also for no archive).  Reads are bounded: records were checked to fit the file."""
    try:
        with zipfile.ZipFile(p) as archive:
            for item in archive.infolist():
                if not item.filename.endswith(only):
                    continue
                try:
                    with archive.open(item) as record:
                        while record.read(1 << 22):
                            pass
                except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, RuntimeError):
                    return item.filename
    except Exception as exc:  # no archive Python can read: nothing to say
        del exc
    return None


def _archive_pickle(path: Path) -> bytes | None:
    """The pickle (``data.pkl``) of a torch.save zip archive, or None."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
            return archive.read(name) if name is not None else None
    except Exception as exc:  # not an archive we can read
        del exc
        return None


def _whole_pickle(path: Path) -> bool:
    """The archive's pickle is well formed (its opcodes parse, read without running any, and
    end with STOP at its last byte): a pickle cut short or overwritten is not.  True when
    there is no archive pickle to read (a legacy torch file)."""
    import pickletools

    data = _archive_pickle(path)
    if data is None:
        return True
    try:
        last = None
        for op, _, pos in pickletools.genops(data):
            last = (op.name, pos)
    except Exception as exc:  # an unknown opcode, a cut argument, ...
        del exc
        return False
    return last is not None and last[0] == "STOP" and last[1] == len(data) - 1


def pickled_class(path: Path) -> str | None:
    """The class of the object a torch.save archive holds at its top (``mypkg.net.Net`` for
    ``torch.save(model)``), read from the pickle's opcodes without running any; None when the
    top object is a plain container (a dict, a list, a tensor) or the file is no such archive."""
    import pickletools

    data = _archive_pickle(path)
    if data is None:
        return None
    try:
        strings: list[str] = []
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("PROTO", "FRAME", "MEMOIZE", "BINPUT", "LONG_BINPUT", "PUT"):
                continue
            if op.name == "GLOBAL":  # protocol < 4: "module name"
                module, _, qualname = str(arg).partition(" ")
                return f"{module}.{qualname}"
            if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE") and len(strings) < 2:
                strings.append(str(arg))
                continue
            if op.name == "STACK_GLOBAL" and len(strings) == 2:
                return f"{strings[0]}.{strings[1]}"
            return None
    except Exception:  # opcodes we cannot parse: the caller's message stays generic
        return None
    return None


def _unsupported_global(message: str) -> str | None:
    """The global torch's weights-only unpickler refused (``GLOBAL mypkg.net.Net``)."""
    import re

    match = re.search(r"GLOBAL ([\w.]+)", message)
    return match.group(1) if match else None


def _split_class(qualified: str) -> tuple[str, str]:
    """``mypkg.net.Net`` -> (``mypkg.net``, ``Net``)."""
    module, _, name = qualified.rpartition(".")
    return module, name


def _pickle_refusal(p: Path, whole: str | None, named: str | None) -> QDebugError:
    if whole is not None:
        module, name = _split_class(whole)
        if module == "__main__":
            return QDebugError(
                f"{p} is a whole pickled model (torch.save(model)) of class {name}, defined in the script "
                "that saved it (__main__): no other program can rebuild it, and loading it would run code "
                "from the file",
                f"in that script, save torch.save(model.state_dict(), path), move {name} into a module of "
                f"your project (e.g. mypkg/net.py) and pass --model mypkg.net:{name}",
            )
        from qdebug.io.modelspec import suggestable

        # The class name is the file's: suggested only when its source defines such a class
        # (a crafted pickle's top object may be posix.system).
        named_class = (f"--model {module}:{name} (or model = \"{module}:{name}\" in qdebug.toml)"
                       if suggestable(module, name) else "--model package.module:Class")
        return QDebugError(
            f"{p} is a whole pickled model (torch.save(model)) of class {whole}: loading it would run code "
            "from the file, so qdebug refuses",
            f"re-save it with torch.save(model.state_dict(), path) and name the class with {named_class}, "
            "or pass --unsafe-load if you trust the file",
        )
    what = f" (e.g. {named})" if named else ""
    return QDebugError(
        f"{p} contains pickled Python objects{what} besides tensors; loading it would execute code "
        "from the file, so qdebug refuses",
        "re-save only tensors: torch.save(model.state_dict(), path) or qdebug.save(model, path); "
        "or pass --unsafe-load if you trust the file",
    )


def _searched() -> str:
    from qdebug.io.usercode import import_roots

    return ", ".join(str(r) for r in import_roots())


def _unsafe_load(p: Path, whole: str | None, named: str | None) -> Any:
    """``torch.load(weights_only=False)``, asked for with --unsafe-load: the classes it names
    are found from the current directory too, and a class that cannot be found is named."""
    from qdebug.io.usercode import make_findable

    cls = whole or named
    if cls:
        make_findable(cls)
    what = f"a whole pickled model of class {whole}" if whole else "pickled objects"
    module, name = _split_class(cls) if cls else ("", "")
    resave = (f"re-save it with torch.save(model.state_dict(), path) and pass --model {module}:{name}"
              if whole and module != "__main__" else "re-save it with torch.save(model.state_dict(), path)")
    try:
        return torch.load(p, map_location="cpu", weights_only=False)
    except ModuleNotFoundError as exc:
        missing = exc.name or "?"
        if cls and (module == missing or module.startswith(missing + ".")):
            top = missing.partition(".")[0]
            raise QDebugError(
                f"{p} is {what}, and its module {missing!r} cannot be imported from {_searched()} or sys.path",
                f"run qdebug from the directory that holds {top}/ (or install your package); better, {resave}",
            ) from None
        raise QDebugError(
            f"{p} is {what}; unpickling it needs module {missing!r}, which is not installed",
            f"install {missing.partition('.')[0]!r} in this environment; or {resave}",
        ) from None
    except AttributeError as exc:
        if "Can't get attribute" not in str(exc):
            raise QDebugError(f"{p} could not be unpickled ({type(exc).__name__}: {_first_line(exc)})",
                              f"the file's classes may have changed since it was saved; {resave}") from None
        if module == "__main__":
            raise QDebugError(
                f"{p} is {what}, defined in the script that saved it (__main__): no other program can rebuild it",
                f"in that script, save torch.save(model.state_dict(), path), move {name} into a module of your "
                f"project and pass --model pkg.module:{name}",
            ) from None
        raise QDebugError(
            f"{p} is {what}, but the class cannot be found: {_first_line(exc)}",
            f"was it renamed or moved since the file was saved? {resave}",
        ) from None
    except Exception as exc:
        raise QDebugError(
            f"{p} could not be unpickled ({type(exc).__name__}: {_first_line(exc)})",
            f"the file may be damaged, or its classes changed since it was saved; {resave}",
        ) from None


def _unpickler_says(exc: BaseException) -> str:
    """What the weights-only unpickler found, without torch's advice to load unsafely."""
    import re

    found = re.search(r"WeightsUnpickler error:\s*(\S.*)", str(exc))
    return found.group(1).strip()[:200] if found else _first_line(exc)


def _first_line(exc: BaseException) -> str:
    return first_line(exc, empty="empty or cut-off data")  # a truncated file often says nothing
