"""``qdebug step``: which part of the model is to blame -- partial quantization, step by step."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional

import typer

from qdebug.cli.against_float import checkpoint_paths, load_against_float
from qdebug.cli.registry import command
from qdebug.cli.rules import METRIC_OPTION, RATIO_OPTION, check_ratio, metric_rules
from qdebug.cli.common import (
    BATCHES_OPTION, BATCH_SIZE_OPTION, DATA_HELP, DEVICE_OPTION, MODEL_KWARGS_OPTION,
    MODEL_OPTION, UNSAFE_LOAD_OPTION, STATE, RunOptions,
    check_data, command_line, err_console, model_errors, progress_bar, resolve_batches,
)
from qdebug.cli.output import (
    FORMAT_OPTION, JSON_OPTION, OUT_OPTION, WIDE_OPTION, Report, emit, output_format, prepare_out, print_table, say,
    table_width,
)
from qdebug.errors import QDebugError
from qdebug.safe_text import escaped

if TYPE_CHECKING:
    import pandas as pd

MODE_FLAGS = ("only", "except", "auto", "cumulative", "drill")
KINDS = ("both", "weight", "activation")
# Worst first: a low SQNR, cosine or metric ratio; a large cost, or much recovered when left in float.
SORT_DESCENDING = ("points", "macs_share", "params_share", "recovers_db")
COLUMNS = ("step", "level", "selection", "mode", "kind", "points", "macs_share", "params_share", "sqnr_db", "cosine",
           "verdict", "recovers_db")


def render_step(frame: "pd.DataFrame", meta: dict, *, sort: Optional[str] = None, width: Optional[int] = None):
    """The step table: one row per step, the costliest step highlighted."""
    from qdebug.report.table import fixed, render_table

    view = frame
    if sort:
        descending = sort in SORT_DESCENDING or sort.endswith("_recovers")
        # NaN first when low is worst; a recovery's NaN (step 0 has none) last.
        view = view.sort_values(sort, ascending=not descending, na_position="last" if descending else "first",
                                kind="stable")
    view = view.reset_index(drop=True)
    tasks = meta.get("tasks") or []
    ratios = [f"{t}_ratio" for t in tasks]
    outputs = [c for c in view.columns if c.endswith("_sqnr_db") or (c.endswith("_cosine") and c != "cosine")]
    recovers = [f"{t}_recovers" for t in tasks]
    lead = ["step", *(["level"] if "level" in view else []), "selection"]
    priority = [*lead, *ratios, "sqnr_db", *recovers, "recovers_db", "verdict" if tasks else "", "kind", "macs_share",
                *tasks, "mode", "points", "cosine", "params_share", *outputs]
    priority = [c for c in priority if c and c in view]
    formats = {c: fixed(2) for c in view.columns if c.endswith("_db")}
    formats.update({c: fixed(6) for c in view.columns if c.endswith("cosine")})
    formats.update({c: fixed(3) for c in [*ratios, *recovers, "macs_share", "params_share"] if c in view})
    formats.update({t: fixed(4) for t in tasks if t in view})
    culprit = (meta.get("culprit") or {}).get("selection")
    highlight = [i for i, (s, m, k) in enumerate(zip(view["selection"], view["mode"], view["kind"]))
                 if s == culprit and m != "all" and k == meta.get("kind", "both")]
    styles = [("bold red" if v == "fail" else None) for v in view["verdict"]] if "verdict" in view else None
    checkpoints = meta.get("checkpoints") or []
    against = f"{Path(checkpoints[-1]).name} vs {Path(checkpoints[0]).name if len(checkpoints) == 2 else 'its float run'}" \
        if checkpoints else "output vs float"
    title = f"step ({meta['mode']}{', kind ' + meta['kind'] if meta['kind'] != 'both' else ''}): {against}, " \
            f"{meta['batches']} batch(es)"
    return render_table(view, title=title, columns=priority, priority=priority, width=width, names=("selection",),
                        formats=formats, highlight=highlight[:1], row_styles=styles)


def _mode(flags: dict[str, bool], modules: list[str]) -> str:
    """The chosen mode; unnamed, --only with a --module selection, else --auto."""
    chosen = [name for name, on in flags.items() if on]
    if len(chosen) > 1:
        raise QDebugError(f"choose one of --{', --'.join(chosen)}", "the modes are --only, --except, --auto, "
                          "--cumulative and --drill")
    return chosen[0] if chosen else ("only" if modules else "auto")


def _next_command(meta: dict, given: list[str], run: RunOptions,
                  shaping: list[tuple[str, Any]]) -> tuple[str, str]:
    """(why, command): drill into the costliest module, or see the culprit layer's own error.
    ``run``: the model, device and data options as typed; ``shaping``: the metric and ratio
    options.  Both go with the command, so it runs as printed on the same model and data;
    ``given``: the checkpoints as typed (none: the next command reads the same config keys)."""
    culprit = meta.get("culprit")
    if not culprit or meta.get("passed"):
        return "", ""
    if meta["mode"] != "drill":
        options = [*shaping, *run.data_options(), *run.model_options(), ("--drill", True),
                   ("--module", culprit["selection"]), ("--kind", meta["kind"] if meta["kind"] != "both" else None)]
        return f"drill into {culprit['selection']}, down to the layer", command_line("step", *given, options=options)
    # suggest takes the metric, ratio and data options too (no step-only option).
    suggest = command_line("suggest", *given, options=[*shaping, *run.data_options(), *run.model_options()])
    if meta.get("single_culprit") is False:
        return "no single culprit: the smallest verified int16 set", suggest
    return (f"the smallest verified int16 fix ({culprit['selection']} first in line; a clipping range gets "
            "recalibration instead)", suggest)


@command(
    short_help="Which module is to blame: quantize part of the model at a time, down to the layer.",
    help=(
        "Step-wise partial quantization of a calibrated, QAT or quantized CHECKPOINT: some modules "
        "quantized, the rest float, measured against the float model (FLOAT, or the checkpoint with every "
        "quant point off; default: the config's float and qat, calibrated or quantized): output SQNR and "
        "cosine, the metric's ratio to float and baseline's verdict, and each step's share of MACs. "
        "Modes: --only (default) / --except the --module selection, --auto (each module at --depth "
        "alone), --cumulative (module after module), --drill (into the worst, down to one layer). "
        "Calls before a step's first quantized layer reuse the float run's outputs.\n\n"
        "Example: qdebug step fixtures/demo/float.pt fixtures/demo/calibrated.pt --drill --metric top1 "
        "--data fixtures/demo/eval.pt --batches 4\n\n"
        "Example: qdebug step fixtures/demo/calibrated.pt --cumulative --depth 2 --out step-out\n\n"
        "Example: qdebug step fixtures/demo/float.pt fixtures/demo/calibrated.pt --auto --data fixtures/demo/eval.pt "
        "--device cuda:0"
    ),
)
def step(
    checkpoints: Optional[List[str]] = typer.Argument(None, metavar="[FLOAT] CHECKPOINT", hidden=True),
    module: Optional[List[str]] = typer.Option(None, "--module", metavar="PATTERN",
                                               help="Module path or glob to select, e.g. backbone or 'layer3.*' (repeatable)."),
    only: bool = typer.Option(False, "--only", help="Quantize only the selection, the rest float (the default with --module; "
                              "without it, --auto)."),
    except_: bool = typer.Option(False, "--except", help="Quantize everything but the selection."),
    auto: bool = typer.Option(False, "--auto", help="Each module at --depth alone (inside the selection, if any)."),
    cumulative: bool = typer.Option(False, "--cumulative", help="Modules at --depth quantized one after another."),
    drill: bool = typer.Option(False, "--drill", help="Each module alone, then into the worst, down to one layer; "
                               "beside each, what leaving it in float recovers (recovers_db)."),
    depth: int = typer.Option(1, "--depth", metavar="N", help="Module depth for --auto and --cumulative (1: top level)."),
    kind: str = typer.Option("both", "--kind", metavar="weight|activation|both",
                             help="Which of the selection's quant points to switch."),
    metric: Optional[str] = METRIC_OPTION,
    data: Optional[str] = typer.Option(None, "--data", metavar="SPEC", help=DATA_HELP),
    batches: Optional[int] = BATCHES_OPTION,
    batch_size: Optional[int] = BATCH_SIZE_OPTION,
    ratio: Optional[float] = RATIO_OPTION,
    sort: Optional[str] = typer.Option(None, "--sort", metavar="COLUMN", help="Sort rows by a column, worst first."),
    fmt: Optional[str] = FORMAT_OPTION,
    as_json: bool = JSON_OPTION,
    out: Optional[Path] = OUT_OPTION,
    wide: bool = WIDE_OPTION,
    model: Optional[str] = MODEL_OPTION,
    model_kwargs: Optional[str] = MODEL_KWARGS_OPTION,  # read through STATE by load_checkpoint
    unsafe_load: bool = UNSAFE_LOAD_OPTION,
    device: Optional[str] = DEVICE_OPTION,  # read through STATE by load_checkpoint and resolve_batches
) -> None:
    fmt = output_format(fmt, as_json)
    modules = list(module or [])
    if any(not m.strip() for m in modules):
        raise QDebugError("--module '' names nothing", "give a module path such as layer1 or a glob such as 'layer1.*'")
    mode = _mode({"only": only, "except": except_, "auto": auto, "cumulative": cumulative, "drill": drill}, modules)
    if mode in ("only", "except") and not modules:
        raise QDebugError(f"--{mode} needs --module", "e.g. --module backbone, or --auto / --drill to search every module")
    if kind not in KINDS:
        raise QDebugError(f"--kind {kind!r} must be weight, activation or both", "e.g. --kind weight")
    if depth < 1:
        raise QDebugError(f"--depth must be >= 1, got {depth}", "--depth 1 is the model's top-level modules")
    check_ratio(ratio)
    check_data(data, batches, batch_size)
    given = list(checkpoints or [])
    paths = checkpoint_paths(given, "step")
    cfg = STATE.config()
    spec = metric or cfg.get("metric")
    tasks = [spec.rsplit(":", 1)[-1]] if spec else []
    tasks += list(cfg.get("tasks") or {})
    sortable = [*COLUMNS, *tasks, *(f"{t}_ratio" for t in tasks), *(f"{t}_recovers" for t in tasks)]
    if sort is not None and sort not in sortable and not sort.endswith(("_ratio", "_sqnr_db", "_cosine", "_recovers")):
        raise QDebugError(f"cannot sort by {sort!r}", f"choose from {', '.join(sortable)}")
    out = prepare_out(out)

    from qdebug.data.metrics import resolve_metric
    from qdebug.tools.step import check_selection, step as run_step

    metric_fn = resolve_metric(spec) if spec else None
    found = load_against_float(paths, model=model, unsafe=unsafe_load, command="step")
    net, info, reference = found.model, found.info, found.reference
    check_selection(net, modules)
    batch_list = resolve_batches(data, batches, info, batch_size=batch_size)
    task, default_ratio, rules = metric_rules(spec, metric_fn, ratio)
    with progress_bar("stepping", None, unit="forwards", runs=True) as advance, model_errors("stepping", batch_list):
        result = run_step(net, batch_list, reference=reference, modules=modules, mode=mode, depth=depth, kind=kind,
                          metric=metric_fn, metric_name=task, rules=rules,
                          progress=lambda done, total: advance(done, total))
    frame = result.frame
    if sort is not None and sort not in frame:  # a column of the model's outputs or tasks, named only as it ran
        err_console.print(escaped(f"warning: cannot sort by {sort!r}: the rows stay in step order (columns: "
                                  f"{', '.join(map(str, frame.columns))})"), markup=False, highlight=False, soft_wrap=True)
        sort = None
    run = RunOptions(model=model, model_kwargs=model_kwargs, unsafe_load=unsafe_load, device=device, data=data,
                     batches=batches, batch_size=batch_size)
    why, next_command = _next_command(result.meta, given, run, [("--metric", metric), ("--ratio", ratio)])
    meta = {**result.meta, "checkpoints": paths, "ratio": default_ratio, "summary": result.summary, "next": next_command}
    files = []
    if out is not None:
        from qdebug.report.plots import plot_steps

        files.append(plot_steps(frame, out.file("step.png"), tasks=meta["tasks"], cumulative=mode == "cumulative",
                                ratio=default_ratio, culprit=(culprit["selection"], culprit["kind"])
                                if (culprit := meta.get("culprit")) else None))

    def render() -> None:
        print_table(render_step(frame, meta, sort=sort, width=table_width(wide)))
        for line in result.summary.splitlines():
            say(line)
        if next_command:
            say(f"next: {why}:")
            say(f"  {next_command}")

    emit(Report("step", frame, meta, files=files), fmt, out, render)
