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
"""

from __future__ import annotations

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
}
TASK_KEYS = {"direction": str, "ratio": (int, float)}


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
    return Config(validate(data, cfg_path), cfg_path.resolve())


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
        if not isinstance(value, expected):
            raise QDebugError(f"{source}: {key} must be {_type_name(expected)}, got {type(value).__name__}",
                              "fix the value in the config (docs/config.md lists every key and its type)")
        values[key] = value
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


def _type_name(expected: Any) -> str:
    if isinstance(expected, tuple):
        return "a number"
    return {str: "a string", int: "an integer", dict: "a table", bool: "true or false"}[expected]
