"""Project configuration: ``qdebug.toml`` or ``[tool.qdebug]`` in ``pyproject.toml``.

Found from the working directory upward (the first directory holding either
file wins; ``qdebug.toml`` before ``pyproject.toml``), or named with
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
    unsafe_load                 allow pickled whole-module files (executes code)
    trust                       packages whose nn.Module classes a checkpoint may name

The directory of the file read is also where modules the user names (``model``,
``metric``, ``data``, ``trust``) are looked for after the current directory
(``config_root``; see qdebug.modelspec).

Only ``[tool.qdebug]`` of a ``pyproject.toml`` matters: one met on the way up that
cannot be read or parsed (another tool's file, a bad ``[tool.black]``) is skipped
with a warning on stderr, unless it declares ``[tool.qdebug]``; a file named with
``--config`` that cannot be parsed is an error.
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qdebug.errors import QDebugError

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


def find_config(start: Path | None = None) -> Path | None:
    directory = (start or Path.cwd()).resolve()
    for folder in (directory, *directory.parents):
        toml = folder / "qdebug.toml"
        if toml.is_file():
            return toml
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file() and _pyproject_table(pyproject) is not None:
            return pyproject
    return None


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
            sys.stderr.write(f"warning: {exc.message}: skipped (only a [tool.qdebug] table in it matters to qdebug)\n")
        return None
    return qdebug_table(document, path)


def _declares_qdebug(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return DECLARES_QDEBUG.search(fh.read(MAX_FILE_BYTES)) is not None
    except OSError:
        return False


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
        with open(path, "rb") as fh:
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
        if not cfg_path.is_file():
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
    return config


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
        values[key] = value
    if "ratio" in values:
        check_ratio_range(values["ratio"], f"{source}: ratio", "e.g. ratio = 0.99")
    if "mode" in values:
        from qdebug.vocab import QAT_MODES

        if values["mode"] not in QAT_MODES:
            raise QDebugError(f"{source}: mode {values['mode']!r} is not a QAT mode",
                              f"choose one of {', '.join(QAT_MODES)}")
    if "device" in values:  # the name now; whether this machine has that device when a model loads
        from qdebug.device import check_device_name

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


def _toml_str(text: str) -> str:
    """``text`` as a TOML basic string."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _type_name(expected: Any) -> str:
    if isinstance(expected, tuple):
        return "a number"
    return {str: "a string", int: "an integer", dict: "a table", bool: "true or false", list: "a list"}[expected]
