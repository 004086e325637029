"""``qdebug fix``: float checkpoint + data -> a fixed float checkpoint that quantizes better, proven."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer

from qdebug import vocab
from qdebug.cli.registry import command
from qdebug.cli.calibrate import (
    BITS_OPTION, LIKE_OPTION, MODE_OPTION, OBSERVER_OPTION, PER_CHANNEL_OPTION, QCONFIG_OPTION, build_qconfig,
    check_qconfig_options, like_settings,
)
from qdebug.cli.common import (
    BATCHES_OPTION, BATCH_SIZE_OPTION, DATA_HELP, DEVICE_OPTION, MODEL_KWARGS_OPTION, MODEL_OPTION, UNSAFE_LOAD_OPTION,
    STATE, RunOptions, check_data, command_line, load_checkpoint, model_errors, option_text, progress_bar,
    resolve_batches, stage_path, writable_file,
)
from qdebug.cli.output import (
    CHECKPOINT_OUTPUT_OPTION, FORMAT_OPTION, JSON_OPTION, OUT_OPTION, WIDE_OPTION, Report, emit, note, output_format,
    prepare_out, print_table, say, table_width, with_out,
)
from qdebug.cli.rules import METRIC_OPTION
from qdebug.errors import QDebugError

if TYPE_CHECKING:
    import pandas as pd


def render_fix(frame: "pd.DataFrame", meta: dict, *, width: Optional[int] = None):
    """One row per method: what it changed, the SQNR before and after, kept or not."""
    from qdebug.report.table import fixed, render_table

    view = frame.copy()
    view["kept"] = ["yes" if v else "no" for v in view["kept"]]
    tasks = [c[: -len("_after")] for c in view.columns if c.endswith("_after") and c != "sqnr_after_db"]
    columns = ["method", "kept", "changes", "sqnr_before_db", "sqnr_after_db", "gain_db",
               *[c for t in tasks for c in (f"{t}_before", f"{t}_after")], "float_sqnr_db", "reason"]
    priority = ["method", "kept", "gain_db", "reason", *[f"{t}_after" for t in tasks], "sqnr_after_db", "changes",
                "float_sqnr_db", "sqnr_before_db", *[f"{t}_before" for t in tasks]]
    formats = {c: fixed(2) for c in ("gain_db", "sqnr_after_db", "sqnr_before_db", "float_sqnr_db")}
    formats.update({c: fixed(4) for t in tasks for c in (f"{t}_before", f"{t}_after")})
    highlight = [i for i, v in enumerate(frame["kept"]) if v]
    title = f"fix: {len(meta['kept'])} of {len(frame)} method(s) kept"
    return render_table(view, title=title, columns=columns, priority=priority, width=width, names=(),
                        wrap=("reason",), formats=formats, highlight=highlight, highlight_style="bold green")


def _methods(given: Optional[List[str]]) -> Optional[List[str]]:
    """--method NAME, repeated or comma-separated; checked before torch loads."""
    if not given:
        return None
    names = [n.strip() for item in given for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in vocab.FIX_METHODS]
    if unknown or not names:
        raise QDebugError(f"unknown fix method {unknown[0]!r}" if unknown else "--method names no method",
                          f"choose from {', '.join(vocab.FIX_METHODS)}, e.g. --method equalize,bias_correction")
    return names


@command(
    short_help="Fix the float model so int8 holds: equalization, bias correction, SmoothQuant, proven.",
    help=(
        "Apply the float-side fixes to the FLOAT checkpoint -- cross-layer equalization, high-bias absorption, "
        "SmoothQuant scaling after norms, bias correction -- one by one; calibrate the original and each result "
        "with the same qconfig, measure the quantized output SQNR (and --metric) on held-out batches against the "
        "original float model, keep a method only when it helps, and write the fixed float checkpoint.\n\n"
        "Example: qdebug fix fixtures/demo/float.pt --data fixtures/demo/eval.pt --batches 8 --per-tensor "
        "-o fixed_float.pt\n\n"
        "Example: qdebug fix float.pt --model mypkg.models:Net --data mypkg.data:calib --metric top1 "
        "--method equalize,bias_correction --out fix_report -o fixed_float.pt\n\n"
        "Example: qdebug fix fixtures/demo/float.pt --like fixtures/demo/calibrated.pt --data fixtures/demo/eval.pt "
        "-o fixed_float.pt (the qconfig and QAT mode the calibrated checkpoint was made with)"
    )
)
def fix(
    checkpoint: Optional[str] = typer.Argument(None, metavar="FLOAT", hidden=True),
    output: Path = CHECKPOINT_OUTPUT_OPTION,
    data: Optional[str] = typer.Option(None, "--data", metavar="SPEC",
                                       help="Calibration and held-out data (the last quarter from 4 batches). "
                                            + DATA_HELP),
    batches: Optional[int] = BATCHES_OPTION,
    batch_size: Optional[int] = BATCH_SIZE_OPTION,
    method: Optional[List[str]] = typer.Option(None, "--method", metavar="NAME",
                                               help=f"Methods to try (default all, in this order): "
                                                    f"{', '.join(vocab.FIX_METHODS)}; repeat or comma-separate."),
    metric: Optional[str] = METRIC_OPTION,
    observer: Optional[str] = OBSERVER_OPTION,
    per_channel: Optional[bool] = PER_CHANNEL_OPTION,
    bits: Optional[int] = BITS_OPTION,
    qconfig: Optional[Path] = QCONFIG_OPTION,
    mode: Optional[str] = MODE_OPTION,
    like: Optional[str] = LIKE_OPTION,
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
    check_data(data, batches, batch_size)
    check_qconfig_options(observer, bits, mode)
    methods = _methods(method)
    writable_file(output)
    out = prepare_out(out)
    path = stage_path(checkpoint, "float", what="float")
    like_qconfig, like_mode = like_settings(like, model=model, unsafe=unsafe_load, command="fix")
    qcfg = build_qconfig(qconfig, observer, per_channel, bits, like_qconfig)
    spec = metric or STATE.config().get("metric")

    from qdebug.data.metrics import resolve_metric

    metric_fn = resolve_metric(spec) if spec else None
    net, info = load_checkpoint(path, model=model, unsafe=unsafe_load, expect=("float",), command="fix")
    batch_list = resolve_batches(data, batches, info, batch_size=batch_size)
    qat_mode = mode or like_mode or STATE.config().get("mode") or "fuse_bn"
    task = spec.rsplit(":", 1)[-1] if spec else "metric"

    from qdebug.checkpoint import save
    from qdebug.tools.fix import fix as run_fix

    with progress_bar("fixing", None, unit="forwards", runs=True) as advance, model_errors("fixing", batch_list):
        result = run_fix(net, batch_list, qconfig=qcfg, mode=qat_mode, methods=methods, metric=metric_fn,
                         metric_name=task, progress=lambda done, total: advance(done, total))
    frame, meta = result.frame, result.meta
    meta.update(source=str(path), output=str(output) if result.kept else None, summary=result.summary)
    run = RunOptions(model=model, model_kwargs=model_kwargs, unsafe_load=unsafe_load, device=device, data=data,
                     batches=batches, batch_size=batch_size)
    granularity = ("--per-channel" if per_channel else "--per-tensor", per_channel is not None)
    shaping = option_text([("--like", like), ("--observer", observer), granularity, ("--bits", bits),
                           ("--qconfig", qconfig), ("--mode", mode)])  # the next calibrate: the same qconfig
    meta["next"] = (command_line("calibrate", output) + run.text() + shaping + " -o calibrated_fixed.pt"
                    if result.kept else None)
    files = []
    if out is not None:
        from qdebug.report.plots import plot_fix

        files.append(plot_fix(frame, result.changes, meta, out.file("fix.png")))
    if result.kept:
        with with_out(out):  # with --out: both appear, or neither
            save(result.model, output, stage="float", model_spec=info.model,
                 sample_inputs=info.sample_inputs if info.sample_inputs is not None else None,
                 meta={"fix": meta["kept"], "source": str(path)})
    report = Report("fix", frame, meta, tables={"changes": result.changes}, files=files)

    def render() -> None:
        print_table(render_fix(frame, meta, width=table_width(wide)))
        for line in result.summary.splitlines():
            say(line)
        if meta["next"]:
            say("next: calibrate the fixed float model with the same qconfig:")
            say(f"  {meta['next']}")
        else:
            say(f"nothing written to {output}: no method improved the quantized model")

    emit(report, fmt, out, render)
    if result.kept:
        note(f"wrote {output} (stage float; {', '.join(meta['kept'])})")
    else:
        raise typer.Exit(1)  # no fix helped: a check that failed, as suggest without a plan
