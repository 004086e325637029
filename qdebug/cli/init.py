"""``qdebug init``: write the project config once -- trust your model package, name the
checkpoints, data and metric -- so later commands need no flags.

It writes ``qdebug.toml`` in the current directory, or adds to the config already in
effect there (a ``qdebug.toml`` or ``pyproject.toml`` ``[tool.qdebug]`` found upward, or
``--config FILE``), since a new file beside it would hide it.  Keys the file lacks are
added, ``trust`` lists are merged, other keys it sets differently need ``--force``; the
file is edited in place (qdebug.config.edit), written atomically and read back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from qdebug.cli.registry import command
from qdebug.cli.common import STATE
from qdebug.cli.output import (
    FORMAT_OPTION, JSON_OPTION, OUT_OPTION, WIDE_OPTION, Report, emit, note, output_format, prepare_out, print_table,
    say, table_width,
)
from qdebug.errors import QDebugError

PATH_OPTIONS = ("float", "calibrated", "qat", "quantized")


def _target() -> tuple[Path, bool]:
    """(the config file to write, whether it exists)."""
    from qdebug.config.project import find_config, unsafe_problem

    if STATE.config_path is not None:
        path = Path(STATE.config_path)
        return path, path.is_file()
    found = find_config()
    if found is not None:
        return found, True
    here = Path("qdebug.toml")
    if here.is_file():  # there, but ignored as unsafe: never overwritten with a starter, never adopted
        raise QDebugError(f"qdebug.toml here is not read as a config: {unsafe_problem(here.resolve())}",
                          "fix its owner or mode (chmod o-w), or name it with qdebug --config qdebug.toml init")
    return here, False


def _relative_to(value: str, folder: Path) -> str:
    """A path given relative to the current directory, written relative to the config's folder
    (the config reads its paths that way)."""
    if Path(value).is_absolute():
        return value
    return Path(os.path.relpath(Path.cwd() / value, folder.resolve())).as_posix()


def _check_trust(entries: list[str]) -> list[str]:
    from qdebug.config.project import trust_problem

    for entry in entries:
        problem, package = trust_problem(entry)
        if problem:
            raise QDebugError(f"--trust {entry!r} {problem}",
                              f"e.g. --trust {package} (it trusts every module inside it)" if package
                              else "give an importable name, e.g. --trust mypkg or --trust mypkg.models")
    return list(dict.fromkeys(entries))


def _check_spec(flag: str, value: str, example: str) -> None:
    module, sep, attr = value.partition(":")
    if not sep or not module or not attr:
        raise QDebugError(f"{flag} {value!r} is not of the form package.module:Name", f"e.g. {flag} {example}")


@command(
    short_help="Write qdebug.toml once: trust your model package, name checkpoints, data, metric.",
    help=(
        "Write the project config qdebug.toml in the current directory, or add to the config already in "
        "effect here (qdebug.toml or pyproject.toml [tool.qdebug] found upward, or --config FILE). "
        "Keys the file lacks are added, --trust lists are merged; a key the file sets differently "
        "needs --force. Later commands read it, so no flag is needed again.\n\n"
        "Example: qdebug init --trust mypkg\n\n"
        "Example: qdebug init --model mypkg.net:Net --float ckpt/float.pt --data data/eval.pt --metric top1"
    ),
)
def init(
    trust: Optional[list[str]] = typer.Option(
        None, "--trust", metavar="PKG",
        help="A package (or module) whose model classes checkpoints may name; repeatable."),
    model: Optional[str] = typer.Option(None, "--model", metavar="PKG.MODULE:CLASS",
                                        help="The model's class (or factory), for state_dict files."),
    data: Optional[str] = typer.Option(None, "--data", metavar="SPEC",
                                       help="Data: a .pt file, package.module:function or random:8x3x224x224."),
    metric: Optional[str] = typer.Option(None, "--metric", metavar="NAME",
                                         help="Metric: top1, top5, mse, agreement or package.module:function."),
    float_path: Optional[str] = typer.Option(None, "--float", metavar="PATH", help="The float checkpoint."),
    calibrated: Optional[str] = typer.Option(None, "--calibrated", metavar="PATH", help="The calibrated checkpoint."),
    qat: Optional[str] = typer.Option(None, "--qat", metavar="PATH", help="The QAT checkpoint."),
    quantized: Optional[str] = typer.Option(None, "--quantized", metavar="PATH", help="The quantized checkpoint."),
    force: bool = typer.Option(False, "--force", help="Replace values the file already sets differently."),
    fmt: Optional[str] = FORMAT_OPTION,
    as_json: bool = JSON_OPTION,
    out: Optional[Path] = OUT_OPTION,
    wide: bool = WIDE_OPTION,
) -> None:
    fmt = output_format(fmt, as_json)
    out = prepare_out(out, config=False)  # the config may not exist yet: init writes it
    target, exists = _target()
    folder = target.parent
    wanted: dict = {}
    if trust:
        wanted["trust"] = _check_trust(trust)
    if model:
        _check_spec("--model", model, "mypkg.net:Net")
        wanted["model"] = model
    missing = []
    for key, value in zip(PATH_OPTIONS, (float_path, calibrated, qat, quantized)):
        if value:
            wanted[key] = _relative_to(value, folder)
            if not Path(value).exists():
                missing.append(value)
    if data:
        is_file = data.endswith((".pt", ".pth")) or Path(data).is_file()
        if not is_file and not data.startswith("random:"):
            _check_spec("--data", data, "mypkg.data:eval_batches")
        wanted["data"] = _relative_to(data, folder) if is_file else data
        if is_file and not Path(data).exists():
            missing.append(data)
    if metric:
        from qdebug.data.metrics import BUILTIN

        if metric not in BUILTIN:
            _check_spec("--metric", metric, "top1 (or mypkg.metrics:evaluate)")
        wanted["metric"] = metric

    import tomllib

    from qdebug.io.atomic import atomic_open
    from qdebug.config.project import load_config, qdebug_table, toml_value, validate
    from qdebug.config.edit import TABLE, edit_text, new_text, plan

    pyproject = target.name == "pyproject.toml"
    if exists:
        try:
            text = target.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise QDebugError(f"cannot read {target}: {getattr(exc, 'strerror', None) or exc}",
                              "check the file's permissions, or pass --config to write another file") from None
        try:
            document = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise QDebugError(f"{target} is not valid TOML: {exc}",
                              "fix the syntax error at the position given, then run qdebug init again") from None
        current = (qdebug_table(document, target) or {}) if pyproject else document
        changes = plan(current, wanted, force=force, source=target)
        content = edit_text(text, changes, pyproject=pyproject, source=target)
        final = {**current, **{c.key: c.value for c in changes}}
    else:
        changes = plan({}, wanted, force=force, source=target)
        content = new_text(changes, pyproject=pyproject)
        final = {c.key: c.value for c in changes}
    validate(final, target)  # a bad value is refused before anything is written
    written = content != (text if exists else None)
    if written:
        with atomic_open(target, "w", encoding="utf-8", newline="") as fh:
            fh.write(content)
        load_config(target)  # read back as every command will read it
        STATE._config = None

    import pandas as pd

    frame = pd.DataFrame([{"key": c.key, "value": toml_value(c.value), "action": c.action} for c in changes],
                         columns=["key", "value", "action"])
    try:
        shown = target.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        shown = str(target)
    where = f"[{'.'.join(TABLE)}] of {shown}" if pyproject else shown
    meta = {"path": str(target.resolve()), "created": not exists, "written": written}

    def render() -> None:
        from qdebug.report.table import render_table

        if len(frame):
            print_table(render_table(frame, title=where, priority=["key", "action", "value"], names=(),
                                     wrap=("value",), width=table_width(wide)))
        elif not exists:
            say(f"{shown}: a starter file with examples (give --trust PKG, --model SPEC, ... to set keys)")
        else:
            say(f"{shown} exists; nothing to add (give --trust PKG, --model SPEC, --data SPEC, ...)")

    emit(Report("init", frame, meta), fmt, out, render)
    for path in missing:
        note(f"note: {path} does not exist yet")
    if written:
        note(f"{'wrote' if not exists else 'updated'} {shown}")
