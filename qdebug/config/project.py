"""Project configuration: ``qdebug.toml`` or ``[tool.qdebug]`` in ``pyproject.toml``.

Found from the working directory upward (the first directory holding either
file wins; ``qdebug.toml`` before ``pyproject.toml``; the search stops at the
project's root, the home folder and a file-system boundary, and a file another
user owns or may write is ignored: ``find_config``), or named with
``--config PATH``.  Relative paths in it are relative to the file's directory.
CLI flags override it.  Keys (docs/config.md):

    model, model_kwargs         architecture for plain state_dict files
    float, calibrated, qat, quantized   checkpoint paths of the four stages
    data, batch_size, batches   evaluation / calibration data
    metric, tasks               metric spec; per task {direction, ratio}
    ratio                       baseline ratio (default 0.99)
    mode                        QAT mode for calibrate (fuse_bn, with_bn, with_bn_reverse_fold)
    qconfig                     {weight, activation, overrides}
    device, out                 torch device; output directory
    unsafe_load                 ignored with a warning: only --unsafe-load or QDEBUG_UNSAFE_LOAD=1
    trust                       packages whose nn.Module classes a checkpoint may name

The directory of the file read is also where modules are looked for: those the
config names (``model``, ``metric``, ``data``, ``trust``) there only, those named
on the command line after the current directory (``config_root``,
``config_packages``; see qdebug.io.usercode).

Only ``[tool.qdebug]`` of a ``pyproject.toml`` matters: one met on the way up that
cannot be read or parsed (another tool's file, a bad ``[tool.black]``) is skipped
with a warning on stderr, unless it declares ``[tool.qdebug]``; a file named with
``--config`` that cannot be parsed is an error.
"""

from __future__ import annotations

import os
import re
import stat
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qdebug.errors import QDebugError
from qdebug.safe_text import escaped

PATH_KEYS = ("float", "calibrated", "qat", "quantized", "out")
VALID_KEYS = {
    "model": str,
    "model_kwargs": dict,
    "float": str,
    "calibrated": str,
    "qat": str,
    "quantized": str,
    "data": str,
    "batch_size": int,
    "batches": int,
    "metric": str,
    "tasks": dict,
    "ratio": (int, float),
    "mode": str,
    "qconfig": dict,
    "device": str,
    "out": str,
    "unsafe_load": bool,
    "trust": list,
}
TASK_KEYS = {"direction": str, "ratio": (int, float)}
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
MAX_FILE_BYTES = 16 << 20  # a config or qconfig file larger than this is not one (a dump, a device)
RATIO_RANGE = (0.0, 1.5)  # baseline's ratio, exclusive of 0: quantized >= ratio x float
# A pyproject.toml that declares qdebug's table: broken, it is the user's config, not another tool's.
DECLARES_QDEBUG = re.compile(rb"^[ \t]*\[[ \t]*tool[ \t]*\.[ \t]*qdebug[ \t]*[\].]", re.MULTILINE)

_config_root: Path | None = None  # the directory of the config file read last
UNSAFE_ENV = "QDEBUG_UNSAFE_LOAD"  # =1: --unsafe-load for every command (never from a config file)


def config_root() -> Path | None:
    """The directory of the config file read last (an import root for the user's modules)."""
    return _config_root


@dataclass
class Config:
    values: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None  # the file it came from

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def pick(self, key: str, override: Any) -> Any:
        """The CLI value when given, else the config's."""
        return override if override is not None else self.values.get(key)

    def stage_pair(self, order: tuple[str, ...]) -> tuple[str | None, str | None]:
        """The config key of the float checkpoint (None when unset) and of the checkpoint under
        test: the first key of ``order`` the config sets (``DEBUG_ORDER``, ``GATE_ORDER``)."""
        under_test = next((key for key in order if self.values.get(key)), None)
        return ("float" if self.values.get("float") else None), under_test

    def trusted(self, model: Any = None) -> tuple[str, ...]:
        """The modules a checkpoint may name: those of the model the caller names (``--model``,
        ``model=``; a spec string or a ``ModelSpec``) and of the config's ``model``, and the
        config's ``trust`` list -- the one trust rule of the CLI and the Python API."""
        targets = [m if isinstance(m, str) else getattr(m, "target", None) for m in (model, self.values.get("model"))]
        return tuple(t.split(":")[0] for t in targets if t) + tuple(self.values.get("trust") or ())

    def named_stages(self) -> list[str]:
        """The stage keys this config sets, in pipeline order (for an error saying what it has)."""
        return [key for key in STAGE_KEYS if self.values.get(key)]


# The checkpoint under test a command takes from the config, when it names several and no path is
# given: compare, step and suggest debug the model with quant points (QAT, else calibrated, else
# quantized); baseline gates what ships (quantized, else QAT, else calibrated).  Every command takes
# FLOAT from ``float``.  One table for the CLI and the Python API (docs/config.md, "Which checkpoints
# a command takes").
STAGE_KEYS = ("float", "calibrated", "qat", "quantized")
DEBUG_ORDER = ("qat", "calibrated", "quantized")
GATE_ORDER = ("quantized", "qat", "calibrated")


PROJECT_MARKERS = (".git", "pyproject.toml", "qdebug.toml")  # a folder holding one ends the search upward


def find_config(start: Path | None = None) -> Path | None:
    """The config in effect in ``start`` (default: the current directory), as git finds its
    repository: the first ``qdebug.toml`` (or ``pyproject.toml`` with ``[tool.qdebug]``) upward,
    the search ending at the first folder holding ``.git``, ``pyproject.toml`` or ``qdebug.toml``
    (the project's root), at the user's home and at a file-system boundary -- so a config
    planted in a shared folder above (a CI workspace, /tmp) is never met.  A config found but
    owned by another user or writable by others is ignored with a warning (``unsafe_problem``)."""
    directory = (start or Path.cwd()).resolve()
    home, device = _home(), _device(directory)
    for folder in (directory, *directory.parents):
        if _device(folder) != device:
            break  # another file system (a mount): git's GIT_DISCOVERY_ACROSS_FILESYSTEM
        found = _config_in(folder)
        if found is not None:
            return found if _safe_to_read(found) else None
        if folder == home or any((folder / marker).exists() for marker in PROJECT_MARKERS):
            break
    return None


def _config_in(folder: Path) -> Path | None:
    toml = folder / "qdebug.toml"
    if toml.is_file():
        return toml
    pyproject = folder / "pyproject.toml"
    if pyproject.is_file() and _pyproject_table(pyproject) is not None:
        return pyproject
    return None


def _home() -> Path | None:
    try:
        return Path.home().resolve()
    except (RuntimeError, KeyError, OSError):
        return None


def _device(folder: Path) -> int | None:
    try:
        return folder.stat().st_dev
    except OSError:
        return None


def unsafe_problem(path: Path) -> str | None:
    """Why a config found upward must not be read -- it or its folder is owned by another user,
    or writable by others (as git's ``safe.directory`` check, root included) -- or None."""
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    for item in (path, path.parent):
        try:
            st = item.stat()
        except OSError as exc:
            return f"cannot stat {item}: {exc.strerror or exc}"
        what = "it" if item == path else f"its folder {item}"
        if uid is not None and st.st_uid != uid:
            return f"{what} is owned by another user (uid {st.st_uid})"
        if st.st_mode & stat.S_IWOTH:
            return f"{what} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _safe_to_read(path: Path) -> bool:
    problem = unsafe_problem(path)
    if problem is None:
        return True
    _warn_once(f"warning: ignoring config {path}: {problem} (fix its owner or mode, or name it with --config)")
    return False


def _warn_once(line: str) -> None:
    if line not in _warned_lines:
        _warned_lines.add(line)
        sys.stderr.write(escaped(line) + "\n")  # a path's ESC or newline is shown, not sent


_warned_lines: set[str] = set()


_warned: set[Path] = set()


def _pyproject_table(path: Path) -> dict[str, Any] | None:
    """``[tool.qdebug]`` of a pyproject.toml met while searching upward, or None.  Only that
    table matters: a file that cannot be read or parsed is another tool's problem, skipped
    with a warning -- unless it declares ``[tool.qdebug]``, whose settings would otherwise
    be silently dropped (a baseline run with another ratio than the one written)."""
    try:
        document = _read(path)
    except QDebugError as exc:
        if _declares_qdebug(path):
            raise
        if path not in _warned:
            _warned.add(path)
            sys.stderr.write(escaped(f"warning: {exc.message}: skipped (only a [tool.qdebug] table in it matters to qdebug)") + "\n")
        return None
    return qdebug_table(document, path)


def _declares_qdebug(path: Path) -> bool:
    try:
        with open_regular(path) as fh:
            return DECLARES_QDEBUG.search(fh.read(MAX_FILE_BYTES)) is not None
    except OSError:
        return False


def open_regular(path: Path):
    """``open(path, "rb")`` that never waits: opened without blocking (a named pipe with no writer
    would hold ``open`` forever) and refused, with an ``OSError`` saying what it is, unless it is
    a regular file (a pipe or a device: ``/dev/zero`` never ends)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(f"it is {_node_kind(mode)}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _node_kind(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a named pipe (FIFO)" if stat.S_ISFIFO(mode)
            else "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "no regular file")


def qdebug_table(document: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """The ``[tool.qdebug]`` table of a parsed pyproject.toml, None when it has none.  A
    ``tool`` that is not a table is no concern of qdebug's; a ``qdebug`` in it that is not a
    table (``[tool] qdebug = 5``) is a config error."""
    tool = document.get("tool")
    if not isinstance(tool, dict) or "qdebug" not in tool:
        return None
    table = tool["qdebug"]
    if not isinstance(table, dict):
        raise QDebugError(f"{path}: tool.qdebug must be a table, got {type(table).__name__}",
                          "write the settings under a [tool.qdebug] header, one key = value per line")
    return table


def read_text(path: Path, what: str = "config file") -> str:
    """A config or qconfig file's text: at most ``MAX_FILE_BYTES`` read, UTF-8 (as TOML and JSON
    are), each failure one error naming the file."""
    try:
        with open_regular(path) as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise QDebugError(f"cannot read {path}: {exc.strerror or exc}",
                          f"check the {what}'s path and permissions") from None
    if len(raw) > MAX_FILE_BYTES:
        raise QDebugError(f"{path} is larger than {MAX_FILE_BYTES >> 20} MiB: not a {what}",
                          f"check the {what}'s path")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise QDebugError(f"{path} is not UTF-8 text (byte {exc.start})",
                          f"save the {what} as UTF-8 (TOML and JSON files are UTF-8)") from None


def _read(path: Path) -> dict[str, Any]:
    text = read_text(path)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise QDebugError(f"{path} is not valid TOML: {exc}", "fix the syntax error at the position given") from None
    except RecursionError:
        raise QDebugError(f"{path} is not valid TOML: nested too deeply", "fix the file") from None


def load_config(path: str | Path | None = None, *, start: Path | None = None) -> Config:
    """The config at ``path``, or found upward from ``start``/cwd; empty when there is none."""
    global _config_root
    _config_root = None
    if path is not None:
        cfg_path = Path(path)
        if not cfg_path.exists():  # one that is there but no file: read_text says what it is
            raise QDebugError(f"config file not found: {cfg_path}", "check the --config path")
    else:
        cfg_path = find_config(start)
        if cfg_path is None:
            return Config()
    data = _read(cfg_path)
    if cfg_path.name == "pyproject.toml":
        data = qdebug_table(data, cfg_path) or {}
    config = Config(validate(data, cfg_path), cfg_path.resolve())
    _config_root = config.path.parent
    _config_packages.clear()
    _config_packages.update(_packages_named(config))
    return config


def config_packages() -> set[str]:
    """The top-level packages the config read last names (``trust``, ``model``, ``metric``,
    ``data``): they are found from the config's folder only (``qdebug.io.usercode``)."""
    return set(_config_packages) if _config_root is not None else set()


def _packages_named(config: Config) -> set[str]:
    names = list(config.get("trust") or ())
    names += [config.get(key).partition(":")[0] for key in ("model", "metric", "data")
              if isinstance(config.get(key), str) and ":" in config.get(key)]
    return {name.partition(".")[0] for name in names if MODULE_NAME.fullmatch(name)}


_config_packages: set[str] = set()


def validate(data: dict[str, Any], source: Path) -> dict[str, Any]:
    unknown = sorted(set(data) - set(VALID_KEYS))
    if unknown:
        raise QDebugError(
            f"{source}: unknown config key(s): {', '.join(unknown)}", f"valid keys: {', '.join(sorted(VALID_KEYS))}"
        )
    values = {}
    for key, value in data.items():
        expected = VALID_KEYS[key]
        if isinstance(value, bool) and expected is not bool:
            raise QDebugError(f"{source}: {key} must be {_type_name(expected)}, not a boolean",
                              "fix the value in the config (docs/config.md lists every key and its type)")
        if key == "trust" and isinstance(value, str):
            raise QDebugError(f"{source}: trust must be a list, got the string {value!r}",
                              f"write it as a list: trust = {toml_value([value])}")
        if not isinstance(value, expected):
            raise QDebugError(f"{source}: {key} must be {_type_name(expected)}, got {type(value).__name__}",
                              "fix the value in the config (docs/config.md lists every key and its type)")
        if isinstance(value, str) and "\0" in value:  # no path, name or spec holds one: os refuses it with a ValueError
            raise QDebugError(f"{source}: {key} holds a NUL character (\\u0000)",
                              "remove it from the value in the config")
        values[key] = value
    if values.pop("unsafe_load", False):
        _warn_once(f"warning: {source}: unsafe_load is ignored: a config file cannot switch on loading pickled code "
                   f"(pass --unsafe-load, or set {UNSAFE_ENV}=1, for the one run that needs it)")
    if "ratio" in values:
        check_ratio_range(values["ratio"], f"{source}: ratio", "e.g. ratio = 0.99")
    if "mode" in values:
        from qdebug.vocab import QAT_MODES

        if values["mode"] not in QAT_MODES:
            raise QDebugError(f"{source}: mode {values['mode']!r} is not a QAT mode",
                              f"choose one of {', '.join(QAT_MODES)}")
    if "device" in values:  # the name now; whether this machine has that device when a model loads
        from qdebug.config.device import check_device_name

        check_device_name(values["device"], f"{source}: device", device_hint(source))
    if "trust" in values:
        values["trust"] = _validate_trust(values["trust"], source)
    base = source.parent.resolve()
    for key in PATH_KEYS:
        if key in values:
            values[key] = str((base / values[key]).resolve()) if not Path(values[key]).is_absolute() else values[key]
    data_spec = values.get("data")
    if data_spec and (data_spec.endswith(".pt") or data_spec.endswith(".pth")) and not Path(data_spec).is_absolute():
        values["data"] = str((base / data_spec).resolve())
    for task, entry in (values.get("tasks") or {}).items():
        if not isinstance(entry, dict):
            raise QDebugError(f"{source}: tasks.{task} must be a table with direction and/or ratio",
                              'e.g. [tasks.top1] with direction = "higher" and ratio = 0.99')
        bad = sorted(set(entry) - set(TASK_KEYS))
        if bad:
            raise QDebugError(f"{source}: tasks.{task} has unknown key(s) {', '.join(bad)}", "valid: direction, ratio")
        for key, expected in TASK_KEYS.items():
            if key in entry and (isinstance(entry[key], bool) or not isinstance(entry[key], expected)):
                raise QDebugError(f"{source}: tasks.{task}.{key} must be {_type_name(expected)}, got "
                                  f"{type(entry[key]).__name__}", 'e.g. [tasks.top1] with direction = "higher" '
                                  "and ratio = 0.99")
        if entry.get("direction", "higher") not in ("higher", "lower"):
            raise QDebugError(f"{source}: tasks.{task}.direction must be 'higher' or 'lower'",
                              'direction = "higher" (an accuracy) or "lower" (an error)')
        if "ratio" in entry:
            check_ratio_range(entry["ratio"], f"{source}: tasks.{task}.ratio", "e.g. ratio = 0.99")
    return values


def device_hint(source: Path | None) -> str:
    """How to run on the CPU when the config file ``source`` names a device that cannot be used."""
    return f'pass --device cpu, or set device = "cpu" in {source}' if source else "pass --device cpu"


def check_ratio_range(ratio: float, name: str, hint: str) -> None:
    """The one range of baseline's ratio, (0, 1.5], for --ratio and the config alike: a ratio
    of 0 or less passes any quantized model (and divides by zero for lower-is-better tasks),
    one above 1.5 asks it to beat float by half.  NaN is refused too."""
    low, high = RATIO_RANGE
    if not low < ratio <= high:
        raise QDebugError(f"{name} {ratio:g} is out of range ({low:g}, {high:g}]", hint)


def _validate_trust(entries: list, source: Path) -> list[str]:
    """``trust``: a list of package or module names (``mypkg``, ``mypkg.models``)."""
    for entry in entries:
        if not isinstance(entry, str) or not entry.strip():
            raise QDebugError(f"{source}: trust must list package names as non-empty strings, got {entry!r}",
                              'e.g. trust = ["mypkg"] (the packages whose model classes checkpoints may name)')
        problem, package = trust_problem(entry.strip())
        if problem and package:
            raise QDebugError(f"{source}: trust entry {entry!r} {problem}",
                              f"write trust = {toml_value([package])} (it trusts every module inside it)")
        if problem:
            raise QDebugError(f"{source}: trust entry {entry!r} {problem}",
                              'write importable names, e.g. trust = ["mypkg", "otherpkg.models"]')
    return [entry.strip() for entry in entries]


def trust_problem(entry: str) -> tuple[str | None, str | None]:
    """What is wrong with one ``trust`` entry, and for a class the package to trust instead:
    (None, None) when it is a package or module name.  The config and ``init --trust`` share it."""
    if ":" in entry:
        return "names a class; trust takes packages or modules", entry.partition(":")[0].partition(".")[0] or "mypkg"
    if not MODULE_NAME.fullmatch(entry):
        return "is not a package or module name", None
    return None, None


def toml_value(value: Any) -> str:
    """``value`` (a string, number, boolean or list of them) written as TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return _toml_str(str(value))


def toml_key(key: str) -> str:
    """``key`` as a TOML key: bare when TOML allows it, else a quoted (escaped) string."""
    return key if BARE_KEY.fullmatch(key) else _toml_str(key)


BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_str(text: str) -> str:
    """``text`` as a TOML basic string that ``tomllib`` reads back exactly.  Quotes and
    backslashes are escaped, and so is every character ``str.isprintable`` refuses (controls,
    C1, bidi overrides, line separators: ``\\u001b``, ``\\u202e``), so a file holding a crafted
    name neither breaks the TOML nor drives the terminal it is ``cat``-ed on."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        elif 0xD800 <= ord(ch) <= 0xDFFF:  # TOML holds Unicode scalar values only
            raise QDebugError(f"{escaped(text)} cannot be written as TOML: it holds a lone surrogate",
                              "rename it to valid Unicode text")
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'


def _type_name(expected: Any) -> str:
    if isinstance(expected, tuple):
        return "a number"
    return {str: "a string", int: "an integer", dict: "a table", bool: "true or false", list: "a list"}[expected]
