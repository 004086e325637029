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
"""

from __future__ import annotations

import re
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
        if pyproject.is_file() and "tool" in _read(pyproject) and "qdebug" in _read(pyproject)["tool"]:
            return pyproject
    return None


def _read(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise QDebugError(f"{path} is not valid TOML: {exc}", "fix the syntax error at the position given") from None
    except OSError as exc:
        raise QDebugError(f"cannot read {path}: {exc.strerror}",
                          "check the config file's path and permissions") from None


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
        data = data.get("tool", {}).get("qdebug", {})
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
        if entry.get("direction", "higher") not in ("higher", "lower"):
            raise QDebugError(f"{source}: tasks.{task}.direction must be 'higher' or 'lower'",
                              'direction = "higher" (an accuracy) or "lower" (an error)')
    return values


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
