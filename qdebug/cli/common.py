"""What every command shares: global state, consoles, config, device, loading, data, progress."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

import typer
from rich.console import Console

from qdebug.config.project import Config, load_config
from qdebug.errors import QDebugError, first_line
from qdebug.safe_text import escaped

if TYPE_CHECKING:  # the heavy modules load inside the commands that need them (a fast --help)
    import torch.nn as nn

    from qdebug.data.source import BatchSource
    from qdebug.checkpoint import CheckpointInfo
    from qdebug.data.batch import Batch

console = Console()
err_console = Console(stderr=True)

# Options several commands share, declared once so their names and help stay the same.
BATCHES_OPTION = typer.Option(None, "--batches", metavar="N", help="Use at most N batches.")
BATCH_SIZE_OPTION = typer.Option(None, "--batch-size", metavar="N", help="Batch size when the data is one tensor.")
MODEL_OPTION = typer.Option(None, "--model", metavar="PKG.MODULE:CLASS",
                            help="The model's class (or factory), for state_dict files or your own classes.")
UNSAFE_LOAD_OPTION = typer.Option(
    False, "--unsafe-load", help="Allow a pickled whole-module file (executes code from it; or QDEBUG_UNSAFE_LOAD=1)."
)


def _record_model_kwargs(value: Optional[str]) -> Optional[str]:
    # Parsed and checked at once (a usage error before torch loads), kept in STATE for
    # load_checkpoint, which every command taking --model calls.
    if value is not None:
        from qdebug.io.modelspec import parse_model_kwargs

        STATE.model_kwargs_option = parse_model_kwargs(value, "--model-kwargs")
    return value


MODEL_KWARGS_OPTION = typer.Option(
    None, "--model-kwargs", metavar="TABLE", callback=_record_model_kwargs,
    help="--model's keyword arguments: a JSON object or TOML inline table, e.g. '{\"num_classes\": 10}' "
    "(default: the config's model_kwargs; a checkpoint's own kwargs go only to the class it names).",
)
DATA_HELP = "Data: a .pt file, package.module:function or random:8x3x224x224."


def _record_device(value: Optional[str]) -> Optional[str]:
    # A bad name is a usage error at once, before torch imports; the name is kept in STATE, where
    # load_checkpoint and resolve_batches -- which every command running a model calls -- read it.
    if value is not None:
        from qdebug.config.device import check_device_name

        check_device_name(value)
    STATE.device_option = value
    return value


DEVICE_OPTION = typer.Option(None, "--device", metavar="cpu|cuda|cuda:N", callback=_record_device,
                             help="Run on this device: models and batches go there (default: the config's "
                             "device, else cpu).")


@dataclass
class _State:
    config_path: Optional[Path] = None
    debug: bool = False
    quiet: bool = False  # --quiet: no progress on stderr (``progress_bar``)
    _config: Optional[Config] = None
    device_option: Optional[str] = None  # --device as given (``DEVICE_OPTION``)
    model_kwargs_option: Optional[dict] = None  # --model-kwargs, parsed (``MODEL_KWARGS_OPTION``)
    _device: Any = None  # the device resolved from it (or the config), once: ``run_device``
    _device_resolved: bool = False

    def config(self) -> Config:
        if self._config is None:
            self._config = load_config(self.config_path)
            if self._config.path is not None:  # once per command: which file's settings apply
                from qdebug.io.usercode import shown_path

                sys.stderr.write(f"config: {escaped(shown_path(str(self._config.path)))}\n")
        return self._config


STATE = _State()


def reset_state() -> None:
    """Forget cached config (tests run many commands in one process)."""
    STATE.config_path = None
    STATE.debug = False
    STATE.quiet = False
    STATE._config = None
    STATE.device_option, STATE._device, STATE._device_resolved = None, None, False
    STATE.model_kwargs_option = None
    if "qdebug.config.device" in sys.modules:  # settings a CUDA run held (``run_device``)
        sys.modules["qdebug.config.device"].release_held()


def stage_path(given: Optional[str], *keys: str, what: str) -> str:
    """The checkpoint path given on the command line, else the first config key set."""
    if given:
        return given
    cfg = STATE.config()
    for key in keys:
        if cfg.get(key):
            return cfg.get(key)
    where = f" (config: {cfg.path})" if cfg.path else ""
    raise QDebugError(
        f"no {what + ' ' if what else ''}checkpoint given{where}",
        f"pass a path, or set {' / '.join(keys)} in qdebug.toml",
    )


def config_checkpoints(command: str, order: tuple[str, ...], needs: str = "a FLOAT and a QUANT checkpoint"
                       ) -> tuple[list[str], tuple[str, str]]:
    """FLOAT and the checkpoint under test from the config, for a command given no checkpoint
    (compare, baseline): ``float`` and the first key of ``order`` the config sets
    (``qdebug.config.DEBUG_ORDER`` or ``GATE_ORDER``); with the keys they came from.  A config
    lacking one is an error naming what it sets and what is missing, in the CLI's terms; ``needs``:
    what the command needs, as the error says it."""
    cfg = STATE.config()
    float_key, test_key = cfg.stage_pair(order)
    if float_key and test_key:
        return [cfg.get(float_key), cfg.get(test_key)], (float_key, test_key)
    example = f"qdebug {command} float.pt calibrated.pt"
    if cfg.path is None:
        raise QDebugError(f"{command} needs {needs}: none given, and no qdebug.toml was found",
                          f"e.g. {example}, or name them once: qdebug init --float float.pt --calibrated calibrated.pt")
    from qdebug.io.usercode import shown_path

    named = cfg.named_stages()
    has = f"names {' and '.join(named)} only" if named else "names no checkpoint"
    missing = "float" if test_key else f"{', '.join(order[:-1])} or {order[-1]}"
    init = "--float float.pt" if test_key else "--calibrated calibrated.pt"
    raise QDebugError(f"{command} needs {needs}: none given, and {shown_path(str(cfg.path))} {has} (no {missing})",
                      f"e.g. {example}, or add it: qdebug init {init}")


@dataclass(frozen=True)
class RunOptions:
    """The options a run was given that choose its model, device and data, as typed.  A
    ``next:`` command carries them all, so that it runs as printed on the same model and data
    (without --model a pasted command is refused: the checkpoint's module is not trusted)."""

    model: Optional[str] = None
    model_kwargs: Optional[str] = None
    unsafe_load: bool = False
    device: Optional[str] = None
    data: Optional[str] = None
    batches: Optional[int] = None
    batch_size: Optional[int] = None

    def data_options(self, *, counts: bool = True) -> list[tuple[str, Any]]:
        """--data, and (``counts``: for a command that takes them) --batches and --batch-size."""
        return [("--data", self.data), *([("--batches", self.batches), ("--batch-size", self.batch_size)]
                                         if counts else [])]

    def model_options(self) -> list[tuple[str, Any]]:
        """--model, --model-kwargs, --unsafe-load and --device: every command that loads a checkpoint takes them."""
        return [("--model", self.model), ("--model-kwargs", self.model_kwargs), ("--unsafe-load", self.unsafe_load),
                ("--device", self.device)]

    def text(self, *, counts: bool = True) -> str:
        """The data options, then the model's, as ``option_text`` writes them."""
        return option_text([*self.data_options(counts=counts), *self.model_options()])


def option_text(options: Iterable[tuple[str, Any]]) -> str:
    """`` --flag value`` per option, shell-quoted: a value None or False is left out, True is a bare flag."""
    parts: list[str] = []
    for flag, value in options:
        if value is None or value is False:
            continue
        parts += [flag] if value is True else [flag, str(value)]
    return "".join(f" {shlex.quote(part)}" for part in parts)


def command_line(command: str, *args: Any, options: Iterable[tuple[str, Any]] = ()) -> str:
    """``qdebug [--config FILE] COMMAND ARGS OPTIONS``, shell-quoted: a ``next:`` command as
    printed.  This run's ``--config`` goes with it (a global option: before the command)."""
    config = ["--config", str(STATE.config_path)] if STATE.config_path is not None else []
    return " ".join(shlex.quote(str(part)) for part in ("qdebug", *config, command, *args)) + option_text(options)


def load_checkpoint(path: str, *, model: Optional[str] = None, unsafe: bool = False,
                    expect: tuple[str, ...] | None = None, command: str = "") -> tuple[nn.Module, CheckpointInfo]:
    if not Path(path).exists():  # said before torch loads: a typo answers at once
        raise QDebugError(f"no such file: {path}", "check the path")

    from qdebug.checkpoint import load

    cfg = STATE.config()
    device = run_device()
    default = cfg.get("model")
    if STATE.model_kwargs_option is not None and not (model or default):
        raise QDebugError("--model-kwargs needs --model (or model = ... in qdebug.toml): a checkpoint's own "
                          "kwargs go only to the class it names", "pass --model package.module:Name with it")
    net, info = load(
        path,
        model=model,
        model_kwargs=user_model_kwargs(),
        default_model=default,
        unsafe=unsafe or unsafe_from_env(),
        trusted_modules=cfg.trusted(model),
    )
    if expect and info.stage not in expect:
        raise QDebugError(
            f"{command} expects a {' or '.join(expect)} checkpoint, but {path} is {info.stage}",
            f"pass the {expect[0]} checkpoint",
        )
    if device is not None:
        from qdebug.config.device import out_of_memory

        with out_of_memory(f"moving {path} to {device}"):
            net = net.to(device)
    return net, info


def user_model_kwargs() -> Optional[dict]:
    """The user's kwargs for --model: --model-kwargs, else the config's model_kwargs."""
    if STATE.model_kwargs_option is not None:
        return STATE.model_kwargs_option
    return STATE.config().get("model_kwargs")


def unsafe_from_env() -> bool:
    """``QDEBUG_UNSAFE_LOAD=1``: --unsafe-load for every command of a session -- the user's own
    environment, the one place besides the flag that may allow it (never a config file)."""
    from qdebug.config.project import UNSAFE_ENV

    value = os.environ.get(UNSAFE_ENV, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise QDebugError(f"{UNSAFE_ENV}={os.environ[UNSAFE_ENV]!r} is not 1 or 0", f"set {UNSAFE_ENV}=1 or unset it")


def run_device() -> Any:
    """The device this command runs on -- ``--device``, else the config's ``device`` -- as a
    ``torch.device``, or None for the CPU (where checkpoints load: nothing to move).  Checked
    against this machine once, before any checkpoint loads (``qdebug.config.device.resolve_device``):
    CUDA asked for where there is none is one error, not torch's words deep in ``.to()``.  On
    CUDA, float32 convolutions and matmuls run in IEEE float32 until the command ends
    (``qdebug.config.device.ieee_float32``)."""
    if STATE._device_resolved:
        return STATE._device
    from qdebug.config.project import device_hint
    from qdebug.config.device import hold, ieee_float32, resolve_device

    cfg = STATE.config()
    if STATE.device_option is not None:
        device = resolve_device(STATE.device_option)
    elif cfg.get("device"):
        device = resolve_device(cfg.get("device"), f"{cfg.path}: device", device_hint(cfg.path))
    else:
        device = None
    if device is not None and device.type == "cpu":
        device = None
    if device is not None:
        hold(ieee_float32())
    STATE._device, STATE._device_resolved = device, True
    return device


def on_run_device(batches: Any) -> Any:
    """``batches`` (a BatchSource, moved as each batch is made; or a list, moved now) on the
    command's device (``run_device``)."""
    device = run_device()
    if device is None or batches is None:
        return batches
    if hasattr(batches, "to"):
        return batches.to(device)
    from qdebug.config.device import out_of_memory, to_device

    with out_of_memory(f"moving the batches to {device}"):
        return [to_device(batch, device) for batch in batches]


def check_data(data: Optional[str], batches: Optional[int], batch_size: Optional[int]) -> None:
    """--data (else the config's), --batches and --batch-size, checked before any checkpoint
    loads and before torch does: a malformed or absurd random: spec, or a function name that
    cannot be imported, answers at once.  Files and functions are read when the batches are."""
    from qdebug.data.spec import check_spec

    limit, _ = check_counts(batches, batch_size)
    spec = data or STATE.config().get("data")
    if spec:
        with _config_data(data, spec):
            check_spec(spec, limit)


@contextlib.contextmanager
def _config_data(data: Optional[str], spec: str) -> Iterator[None]:
    """An error about the config's data spec says where that spec is written."""
    cfg = STATE.config()
    try:
        yield
    except QDebugError as exc:
        if data or cfg.path is None:
            raise
        raise QDebugError(f"{exc.message} (data = {spec!r} in {cfg.path})", exc.hint) from None


def check_counts(batches: Optional[int], batch_size: Optional[int]) -> tuple[Optional[int], Optional[int]]:
    """--batches and --batch-size (else the config's), checked: commands call this before any work."""
    cfg = STATE.config()
    limit = batches if batches is not None else cfg.get("batches")
    size = batch_size if batch_size is not None else cfg.get("batch_size")
    for flag, value in (("--batches", limit), ("--batch-size", size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise QDebugError(f"{flag} must be a whole number >= 1, got {value!r}",
                              f"e.g. {flag} 8 (or {flag.lstrip('-').replace('-', '_')} = 8 in qdebug.toml)")
    return limit, size


def resolve_batches(data: Optional[str], batches: Optional[int], info: CheckpointInfo | None = None,
                    *, batch_size: Optional[int] = None, required: bool = True,
                    announce: bool = True) -> BatchSource | None:
    """The batches of --data (or the config's data), else the checkpoint's sample inputs --
    said on stderr when ``announce``: results on a handful of stored samples are no evaluation.
    A BatchSource: lazy, each pass over it reads the data anew (``qdebug.data.source``)."""
    from qdebug.data.spec import batches_from_inputs, load_batches

    cfg = STATE.config()
    spec = data or cfg.get("data")
    limit, size = check_counts(batches, batch_size)
    if spec:
        with _config_data(data, spec):
            return on_run_device(load_batches(spec, batch_size=size, batches=limit))
    if info is not None and info.sample_inputs is not None:
        found = batches_from_inputs(info.sample_inputs, limit)
        samples = sum(b.size() for b in found)
        if announce:
            err_console.print(escaped(f"note: no --data given: using the {samples} sample input(s) stored in {info.path} "
                                      "(pass --data for a real evaluation)"), markup=False, highlight=False, soft_wrap=True)
        return on_run_device(found)
    if required:
        raise QDebugError("no data given and the checkpoint has no sample inputs",
                          "pass --data (a .pt file, package.module:function or random:8x3x224x224)")
    return None


@contextlib.contextmanager
def progress_bar(description: str, total: Optional[int], *, unit: str = "batches",
                 runs: bool = False) -> Iterator[Any]:
    """Progress on stderr: a rich bar on a terminal, else a plain line at a bounded rate
    (``qdebug.cli.progress``; ``unit`` and ``runs`` word it), nothing with --quiet or on a rank
    other than 0.  Yields an ``advance(n, total=None)`` callback (``total`` when the amount of
    work is only known as it goes)."""
    if STATE.quiet or err_console.quiet:
        yield lambda n=1, total=None: None
        return
    if not err_console.is_terminal:
        from qdebug.cli import progress as plain

        line = plain.PlainProgress(description, total, unit=unit, runs=runs, write=_progress_line,
                                   interval=plain.interval_from_env(), clock=plain.clock)
        yield line.advance
        line.finish()  # not after an error or Ctrl-C: the error is the last word
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err_console, transient=True,
    )
    with progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1, total=None: progress.update(task, completed=n, **({"total": total} if total else {}))


def _progress_line(line: str) -> None:
    # Flushed at once: a CI log shows the line when it is written, not when a buffer fills.
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


@contextlib.contextmanager
def model_errors(what: str, batch: Batch | BatchSource | None = None) -> Iterator[None]:
    """Turn the model failing on the data into one clear error: torch's errors on a wrong
    input (RuntimeError, ValueError, TypeError, IndexError), and anything the user's own
    model code raises or calls (an ``assert`` on the input's shape, a KeyError, ``sys.exit``),
    named at their line.  Other exceptions raised inside qdebug stay internal errors.
    ``batch``: the data (its first batch's input shape is named), a BatchSource or one batch."""
    from qdebug.data.batch import first_input_shape
    from qdebug.data.source import BatchSource
    from qdebug.config.device import out_of_memory
    from qdebug.io.usercode import exit_error, raised_by_user_code, where_raised

    try:
        with out_of_memory(what):  # the GPU's memory ran out, not the data that is wrong
            yield
    except QDebugError:
        raise
    except SystemExit as exc:
        raise exit_error(exc, f"the model, while {what},") from exc
    except BaseException as exc:
        if not raised_by_user_code(exc):
            raise
        where = where_raised(exc, user_only=True)
        if where is None and not isinstance(exc, (RuntimeError, ValueError, TypeError, IndexError)):
            raise
        found = batch.input_shape if isinstance(batch, BatchSource) else first_input_shape(batch) if batch else None
        shape = f" (input shape {found})" if found is not None else ""
        detail = first_line(exc)
        if where is not None:
            detail = f"{type(exc).__name__}: {first_line(exc)}, at {where}"
        raise QDebugError(f"the model failed while {what}{shape}: {detail}",
                          "check that --data matches the model's expected input") from exc


def writable_dir(path: Path) -> Path:
    """``path`` checked as a directory output can be written to -- it exists as a writable
    directory, or can be created -- before the work starts, so a bad --out fails at once, not
    after minutes of computing. Nothing is created here: the writer makes the folder with the
    files (``qdebug.io.atomic``), so a run that fails leaves no empty folder behind."""
    from qdebug.io.atomic import refuse_dangling_link

    refuse_dangling_link(path)
    if path.exists() and not path.is_dir():
        raise QDebugError(f"cannot create output directory {path}: a file has that name",
                          "give a directory path (one that is not an existing file)")
    problem = _folder_problem(path)
    if problem:
        verb = "write to" if path.is_dir() else "create"
        raise QDebugError(f"cannot {verb} output directory {path}: {problem}", "choose a directory you can write to")
    _refuse_pipes_in(path)
    return path


OUT_SUFFIXES = (".csv", ".json", ".png", ".toml", ".pt")  # the kinds of file commands write into --out DIR


def _refuse_pipes_in(folder: Path) -> None:
    """A named pipe in the --out folder where a command may write one of its files is refused now,
    before the work: writing into it would block until a reader comes (``qdebug.io.atomic``)."""
    if not folder.is_dir():
        return
    with os.scandir(folder) as entries:
        for entry in entries:
            if not entry.name.endswith(OUT_SUFFIXES):
                continue
            try:
                is_pipe = stat.S_ISFIFO(entry.stat().st_mode)  # through a link too
            except OSError:
                continue
            if is_pipe:
                raise QDebugError(f"cannot write into output directory {folder}: "
                                  f"{entry.name} there is a named pipe (FIFO)",
                                  "remove it, or choose another --out directory")


def writable_file(path: Path) -> Path:
    """``path`` checked as an output file (not a folder, not a dangling link; its folder exists
    and is writable, or can be created) before the work starts. Nothing is created here: the
    writer makes the folder with the file, so a run that fails leaves no folder behind."""
    from qdebug.io.atomic import output_kind

    if path.is_dir():
        raise QDebugError(f"output {path} is a directory", "give a file name, e.g. -o model.pt")
    parent = path.parent if str(path.parent) else Path(".")
    problem = _folder_problem(parent)
    if problem:
        raise QDebugError(f"cannot create output directory {parent}: {problem}", "choose a directory you can write to")
    output_kind(path)
    return path


def _folder_problem(path: Path) -> Optional[str]:
    """Why folder ``path`` cannot be written or created (None when it can): the nearest part of it
    that exists is a file, or is not writable."""
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        return f"{existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return "permission denied" if existing == path else f"{existing} is not writable"
    return None


def load_qconfig_file(path: Optional[Path]) -> dict[str, Any]:
    """The --qconfig file (TOML by its .toml suffix, else JSON) as a table; what it holds is
    checked by ``QConfig.from_dict``.  Read bounded and as UTF-8, like the config."""
    from qdebug.config.project import read_text

    if path is None:
        return {}
    if not path.exists():  # one that is there but no file (a named pipe): read_text says what it is
        raise QDebugError(f"qconfig file not found: {path}", "check the --qconfig path")
    text = read_text(path, "qconfig file")
    try:
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # a syntax error, or nesting too deep (RecursionError)
        raise QDebugError(f"cannot parse qconfig file {path}: {exc}", "write it as JSON or TOML") from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(
            type(data), "null")
        raise QDebugError(f"qconfig file {path} holds {kind}, not an object",
                          'write an object: {"weight": {...}, "activation": {...}, "overrides": {...}}')
    return data
