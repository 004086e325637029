"""Reading a torch file safely: ``torch.load(weights_only=True)``, every failure one
QDebugError, and a refused pickle named for what it is.

A file that names Python objects is refused unless the user passes ``--unsafe-load``;
the refusal reads the pickle's opcodes (never running them) to say what it holds -- a
whole model saved with ``torch.save(model)`` and its class -- and how to re-save it.
With ``--unsafe-load`` the classes it names are found from the current directory too
(``qdebug.usercode``), and one that cannot be found is named, not called "damaged".
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from qdebug.errors import QDebugError
from qdebug.usercode import first_line


def read_file(path: str | Path, *, unsafe: bool = False) -> Any:
    """``torch.load`` with every failure turned into one clear QDebugError."""
    p = Path(path)
    if not p.exists():
        raise QDebugError(f"no such file: {p}", "check the path")
    if p.is_dir():
        raise QDebugError(f"{p} is a directory, not a checkpoint file", "pass the checkpoint file, not its directory")
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # Only a well-formed file that names Python objects is "pickled objects"; random
        # or corrupt bytes fail the weights-only unpickler too, and are reported as such.
        if not (zipfile.is_zipfile(p) or "Unsupported global" in str(exc)):
            raise QDebugError(
                f"{p} is not a readable torch file (not a torch.save archive, nor valid pickle data)",
                "the file may be truncated or corrupt; re-save it",
            ) from None
        whole = pickled_class(p)  # "mypkg.net.Net" for a torch.save(model) file
        named = whole or _unsupported_global(str(exc))
        if not unsafe:
            raise _pickle_refusal(p, whole, named) from None
        del exc
    except Exception as exc:  # random bytes reach many unpickler error paths (IndexError, KeyError, ...)
        raise QDebugError(
            f"{p} is not a readable torch file ({type(exc).__name__}: {_first_line(exc)})",
            "the file may be truncated or corrupt; re-save it",
        ) from None
    return _unsafe_load(p, whole, named)


def pickled_class(path: Path) -> str | None:
    """The class of the object a torch.save archive holds at its top (``mypkg.net.Net`` for
    ``torch.save(model)``), read from the pickle's opcodes without running any; None when the
    top object is a plain container (a dict, a list, a tensor) or the file is no such archive."""
    import pickletools

    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
            if name is None:
                return None
            data = archive.read(name)
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
    except Exception:  # not an archive we can read: the caller's message stays generic
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
        return QDebugError(
            f"{p} is a whole pickled model (torch.save(model)) of class {whole}: loading it would run code "
            "from the file, so qdebug refuses",
            f"re-save it with torch.save(model.state_dict(), path) and name the class with --model {module}:{name} "
            f'(or model = "{module}:{name}" in qdebug.toml), or pass --unsafe-load if you trust the file',
        )
    what = f" (e.g. {named})" if named else ""
    return QDebugError(
        f"{p} contains pickled Python objects{what} besides tensors; loading it would execute code "
        "from the file, so qdebug refuses",
        "re-save only tensors: torch.save(model.state_dict(), path) or qdebug.save(model, path); "
        "or pass --unsafe-load if you trust the file",
    )


def _searched() -> str:
    from qdebug.usercode import import_roots

    return ", ".join(str(r) for r in import_roots())


def _unsafe_load(p: Path, whole: str | None, named: str | None) -> Any:
    """``torch.load(weights_only=False)``, asked for with --unsafe-load: the classes it names
    are found from the current directory too, and a class that cannot be found is named."""
    from qdebug.usercode import make_findable

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


def _first_line(exc: BaseException) -> str:
    return first_line(exc, empty="empty or cut-off data")  # a truncated file often says nothing
