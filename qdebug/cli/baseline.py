"""``qdebug baseline``: the CI gate -- quantized metric >= ratio x float metric, per task.

It owns the gate's guard on its inputs: FLOAT must be the float stage and FLOAT and QUANT two
files (a swapped pair or one file twice would pass a gate it should fail), unless
``--allow-any-order`` says the user means it."""

from __future__ import annotations

import filecmp
import json
import os
import shlex
from pathlib import Path
from typing import Any, Optional

import typer

from qdebug.cli.registry import command
from qdebug.cli.rules import METRIC_OPTION, RATIO_OPTION, check_ratio, ratio_in_force, task_rules
from qdebug.cli.common import (
    BATCHES_OPTION, BATCH_SIZE_OPTION, DATA_HELP, DEVICE_OPTION, MODEL_KWARGS_OPTION,
    MODEL_OPTION, UNSAFE_LOAD_OPTION, STATE,
    check_counts, check_data, config_checkpoints, err_console, load_checkpoint, resolve_batches, writable_file,
)
from qdebug.cli.output import (
    FORMAT_OPTION, JSON_OPTION, OUT_OPTION, WIDE_OPTION, Report, emit, note, output_format, prepare_out, print_table,
    say, table_width, with_out,
)
from qdebug.config.project import GATE_ORDER
from qdebug.config.distributed import is_rank_zero
from qdebug.errors import QDebugError
from qdebug.safe_text import escaped

FLIPPED_SHOWN = 8  # sample indices on the terminal; JSON's meta.flipped_samples has them all
SHOWN = ["task", "float", "quantized", "score", "ratio", "required", "margin", "verdict"]
_STYLE = {"pass": "green", "fail": "bold red", "inconclusive": "yellow"}


def _read_json_metrics(path: Path) -> dict[str, float]:
    from qdebug.config.project import read_text

    if not path.is_file():
        raise QDebugError(f"no such file: {path}", "check the path")
    try:
        data = json.loads(read_text(path, "metrics file"))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise QDebugError(f"{path} is not valid JSON: {exc}", 'write {"task": value, ...} or a single number') from None
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return {"metric": float(data)}
    if not isinstance(data, dict) or not data:
        raise QDebugError(f"{path} must hold a number or an object task -> number", 'e.g. {"top1": 0.91, "top5": 0.99}')
    out = {}
    for task, value in data.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise QDebugError(f"{path}: task {task!r} is not a number ({value!r})", "every value must be a number")
        out[str(task)] = float(value)
    return out


def _precomputed(checkpoints: Optional[list[str]], numbers: tuple, files: tuple) -> bool:
    """Whether precomputed results are gated (no evaluation), checked before anything runs:
    both of a pair, one kind of pair, and no checkpoints beside them (they would be ignored)."""
    given_numbers = any(v is not None for v in numbers)
    given_files = any(v is not None for v in files)
    if given_numbers and given_files:
        raise QDebugError("give --float-metric/--quant-metric or --float-json/--quant-json, not both",
                          "e.g. --float-metric 0.91 --quant-metric 0.905")
    if (given_numbers or given_files) and checkpoints:
        raise QDebugError("baseline gates checkpoints or precomputed metrics, not both: the checkpoints would "
                          "be ignored", "drop FLOAT QUANT to gate the precomputed values, or drop those to evaluate")
    if given_numbers and None in numbers:
        raise QDebugError("give both --float-metric and --quant-metric",
                          "e.g. --float-metric 0.91 --quant-metric 0.905")
    if given_files and None in files:
        raise QDebugError("give both --float-json and --quant-json",
                          "e.g. --float-json float.json --quant-json quant.json")
    return given_numbers or given_files


ORDER_HINT = "or --allow-any-order if you mean it"


def _checkpoint_pair(given: Optional[list[str]]) -> tuple[list[str], tuple[str, str], Optional[str]]:
    """FLOAT QUANT as given, else the config's float and the stage it ships (quantized, else qat,
    else calibrated: ``GATE_ORDER``); with what an error calls each (the argument, or the config
    key that named it) and that key of QUANT's."""
    if given:
        return list(given), ("FLOAT", "QUANT"), None
    paths, (_, quant_key) = config_checkpoints("baseline", GATE_ORDER,
                                               "a FLOAT and a QUANT checkpoint (or precomputed metrics)")
    return paths, ("the config's float", f"the config's {quant_key}"), quant_key


def _one_file(first: str, second: str, *, by_content: bool) -> Optional[str]:
    """How two paths are one file -- "one file" (one path however spelled, or a link to it) or,
    with ``by_content``, "copies of one file" (the same bytes) -- else None.  A missing path is
    left to the loader, whose error names it."""
    if not (os.path.isfile(first) and os.path.isfile(second)):
        return None
    if os.path.samefile(first, second):
        return "one file"
    if by_content and filecmp.cmp(first, second, shallow=False):  # sizes first: bytes read only when equal
        return "copies of one file (the same bytes)"
    return None


def _refuse_or_warn(problem: str, hint: str, allow: bool, warnings: list[str]) -> None:
    """Refuse ``problem`` (exit 2); with --allow-any-order, say it on stderr and go on, and
    keep it for the JSON report: a gate run this way on purpose still shows that it was."""
    if not allow:
        raise QDebugError(problem, f"{hint}; {ORDER_HINT}")
    warnings.append(problem)
    note(f"warning: {problem} (gated anyway: --allow-any-order)")


def _check_one_file(paths: list[str], labels: tuple[str, str], what: str, *, by_content: bool, allow: bool,
                    warnings: list[str], fix: str) -> None:
    """Both sides of the gate one file: the gate would compare ``what`` (a model, a result) with itself."""
    how = _one_file(paths[0], paths[1], by_content=by_content)
    if how:
        _refuse_or_warn(f"{labels[0]} {paths[0]} and {labels[1]} {paths[1]} are {how}: the gate would compare "
                        f"{what} with itself and pass", fix, allow, warnings)


def _check_order(paths: list[str], stages: list[str], labels: tuple[str, str], quant_key: Optional[str],
                 config_path: Any, *, allow: bool, warnings: list[str]) -> None:
    """FLOAT must be the float stage (the stage each checkpoint records, as step and suggest read
    it): a quantized model as FLOAT turns the ratio over, and a worse model passes."""
    if stages[0] == "float":
        return
    problem = (f"baseline takes the float checkpoint first, then the quantized one (FLOAT QUANT), but "
               f"{labels[0]} {paths[0]} is {stages[0]} and {labels[1]} {paths[1]} is {stages[1]}")
    swapped = stages[1] == "float"
    if quant_key is not None:  # the pair came from the config
        fix = (f"swap float and {quant_key} in {config_path}" if swapped
               else f"set float in {config_path} to the float checkpoint")
    else:
        fix = (f"swap them: qdebug baseline {shlex.quote(paths[1])} {shlex.quote(paths[0])} ..." if swapped
               else f"give the float checkpoint first: qdebug baseline FLOAT.pt {shlex.quote(paths[1])} ...")
    _refuse_or_warn(problem, fix, allow, warnings)


def _plain(text: str):
    """``text`` for a spinner: text, not markup (a path may hold "[bold]"), its controls escaped."""
    from rich.text import Text

    return Text(escaped(text))


def _rename(values: dict, task: str) -> dict:
    return {task: values["metric"]} if list(values) == ["metric"] else values


def render_baseline(frame, *, ratio: float, confidence: Optional[float], width: Optional[int]):
    """The verdict table: one row per task; the verdict stays in view at any width."""
    from qdebug.report.table import render_table

    shown = SHOWN + (["ci_low", "ci_high"] if confidence is not None else []) + (
        ["mcnemar_p", "flipped"] if frame["mcnemar_p"].notna().any() else [])
    return render_table(frame, title=f"baseline: quantized >= {ratio:g} x float",
                        columns=shown if width is not None else list(frame.columns),
                        priority=["task", "verdict", *(["ci_low", "ci_high"] if confidence is not None else []),
                                  "float", "quantized", "score", "required", "margin"],
                        names=("task",), width=width, row_styles=[_STYLE.get(v) for v in frame["verdict"]])


@command(
    short_help="Is it good enough: the CI gate, quantized metric >= 0.99 x float, per task.",
    help=(
        "The precision gate for CI, on the FLOAT and QUANT checkpoints (default: the config's float and "
        "quantized, else qat, else calibrated): each task passes when quantized >= ratio x float (default 0.99; "
        "lower-is-better tasks: quantized <= float / ratio). Exit 0 pass, 1 fail, 2 error. With "
        "--confidence, a paired bootstrap decides pass / fail / inconclusive (inconclusive does not fail). "
        "FLOAT must be a float checkpoint and QUANT another file (a swapped pair, or one file twice, would "
        "pass): exit 2 otherwise, unless --allow-any-order.\n\n"
        "Example: qdebug baseline fixtures/demo/float.pt fixtures/demo/quantized.pt --data fixtures/demo/eval.pt "
        "--metric top1 --confidence 0.95 --junit baseline.xml\n\n"
        "Example: qdebug baseline fixtures/demo/float.pt fixtures/demo/quantized.pt --data fixtures/demo/eval.pt "
        "--metric top1 --device cuda\n\n"
        "Example: qdebug baseline fixtures/demo/calibrated.pt fixtures/demo/qat.pt --data fixtures/demo/eval.pt "
        "--metric top1 --allow-any-order (QAT gated against the calibrated model, on purpose)"
    )
)
def baseline(
    checkpoints: Optional[list[str]] = typer.Argument(None, metavar="FLOAT QUANT", hidden=True),
    metric: Optional[str] = METRIC_OPTION,
    data: Optional[str] = typer.Option(None, "--data", metavar="SPEC", help="Evaluation data. " + DATA_HELP),
    batches: Optional[int] = BATCHES_OPTION,
    batch_size: Optional[int] = BATCH_SIZE_OPTION,
    ratio: Optional[float] = RATIO_OPTION,
    direction: Optional[str] = typer.Option(None, "--direction", metavar="higher|lower",
                                            help="Which way is better, for a single-number metric."),
    float_metric: Optional[float] = typer.Option(None, "--float-metric", metavar="X", help="Precomputed float metric (no evaluation)."),
    quant_metric: Optional[float] = typer.Option(None, "--quant-metric", metavar="X", help="Precomputed quantized metric."),
    float_json: Optional[Path] = typer.Option(None, "--float-json", metavar="FILE", help="Precomputed float results: JSON task -> value."),
    quant_json: Optional[Path] = typer.Option(None, "--quant-json", metavar="FILE", help="Precomputed quantized results: JSON task -> value."),
    confidence: Optional[float] = typer.Option(None, "--confidence", metavar="LEVEL",
                                               help="Confidence level of the bootstrap interval, e.g. 0.95."),
    junit: Optional[Path] = typer.Option(None, "--junit", metavar="FILE", help="Write JUnit XML (one testcase per task)."),
    fmt: Optional[str] = FORMAT_OPTION,
    as_json: bool = JSON_OPTION,
    out: Optional[Path] = OUT_OPTION,
    wide: bool = WIDE_OPTION,
    model: Optional[str] = MODEL_OPTION,
    model_kwargs: Optional[str] = MODEL_KWARGS_OPTION,  # read through STATE by load_checkpoint
    unsafe_load: bool = UNSAFE_LOAD_OPTION,
    device: Optional[str] = DEVICE_OPTION,  # read through STATE by load_checkpoint and resolve_batches
    allow_any_order: bool = typer.Option(
        False, "--allow-any-order",
        help="Gate even when FLOAT is not a float checkpoint, or FLOAT and QUANT are one file (a warning says so)."),
) -> None:
    fmt = output_format(fmt, as_json)
    out = prepare_out(out)
    check_ratio(ratio)
    if confidence is not None and not 0.5 <= confidence < 1:
        raise QDebugError(f"--confidence {confidence:g} must be in [0.5, 1)", "e.g. --confidence 0.95")
    if direction not in (None, "higher", "lower"):
        raise QDebugError(f"--direction {direction!r} must be higher or lower", "e.g. --direction lower for an error metric")
    precomputed = _precomputed(checkpoints, (float_metric, quant_metric), (float_json, quant_json))
    if precomputed:
        check_counts(batches, batch_size)
    else:
        check_data(data, batches, batch_size)
    if junit is not None:
        writable_file(junit)
    cfg = STATE.config()
    default_ratio = ratio_in_force(ratio)
    float_samples = quant_samples = None
    paths: list[str] = []
    stages: Optional[list[str]] = None
    order_warnings: list[str] = []  # what --allow-any-order let through
    metric_fn = None
    if precomputed:
        from qdebug.data.metrics import check_nonnegative

        if float_metric is not None:
            float_values, quant_values = {"metric": float_metric}, {"metric": quant_metric}
            sources = ("--float-metric", "--quant-metric")
        else:
            # One path twice only: two evaluations may well write the same numbers.
            _check_one_file([str(float_json), str(quant_json)], ("--float-json", "--quant-json"), "a result",
                            by_content=False, allow=allow_any_order, warnings=order_warnings,
                            fix="give the float model's results, then the quantized model's")
            float_values, quant_values = _read_json_metrics(float_json), _read_json_metrics(quant_json)
            sources = (str(float_json), str(quant_json))
        for values, source in zip((float_values, quant_values), sources):
            check_nonnegative(values, source)
    else:
        paths, labels, quant_key = _checkpoint_pair(checkpoints)
        if len(paths) != 2:
            raise QDebugError(f"baseline needs a FLOAT and a QUANT checkpoint (or precomputed metrics), got "
                              f"{len(paths)} checkpoint(s)",
                              "e.g. qdebug baseline float.pt quantized.pt --metric top1 --data eval.pt")
        spec = metric or cfg.get("metric")
        if not spec:
            raise QDebugError("no metric given", "pass --metric (e.g. top1) or set metric in qdebug.toml")
        # Before torch loads anything: a path given twice answers at once.
        _check_one_file(paths, labels, "a model", by_content=True, allow=allow_any_order, warnings=order_warnings,
                        fix=(f"set float and {quant_key} in {cfg.path} to two checkpoints" if quant_key else
                             "give the float checkpoint, then the quantized one"))
        from qdebug.data.metrics import resolve_metric
        from qdebug.tools.evaluate import evaluate

        metric_fn = resolve_metric(spec)
        float_model, info = load_checkpoint(paths[0], model=model, unsafe=unsafe_load, command="baseline")
        quant_model, quant_info = load_checkpoint(paths[1], model=model, unsafe=unsafe_load, command="baseline")
        stages = [info.stage, quant_info.stage]
        _check_order(paths, stages, labels, quant_key, cfg.path, allow=allow_any_order, warnings=order_warnings)
        batch_list = resolve_batches(data, batches, info, batch_size=batch_size)
        on = f" on {batch_list.count} batch(es)" if batch_list.count is not None else ""  # a generator's: after a pass
        with err_console.status(_plain(f"evaluating {paths[0]}{on}")):
            float_values, float_samples = evaluate(metric_fn, float_model, batch_list, reference=float_model)
        with err_console.status(_plain(f"evaluating {paths[1]} on {batch_list.count} batch(es)")):
            quant_values, quant_samples = evaluate(metric_fn, quant_model, batch_list, reference=float_model)
        # A single-number metric is the task named after the metric, so [tasks.top1] applies to it.
        task_name = spec.rsplit(":", 1)[-1]
        float_values, quant_values = (_rename(v, task_name) for v in (float_values, quant_values))
        float_samples, quant_samples = (_rename(v, task_name) if v else v for v in (float_samples, quant_samples))
    from qdebug.tools.baseline import TaskRule, gate

    rules = task_rules(metric_fn, default_ratio, ratio is not None)
    single = list(float_values)[0] if len(float_values) == 1 else None
    if single is not None and single not in rules:
        rules[single] = rules["metric"]
    if direction is not None:
        if single is None:
            raise QDebugError("--direction applies to a single-number metric", "declare per-task directions in [tasks.NAME]")
        rules[single] = TaskRule(direction, rules[single].ratio)
    unknown = sorted(set(rules) - set(float_values) - {"metric"})
    if unknown:
        raise QDebugError(f"config [tasks] name task(s) the metric does not report: {', '.join(unknown)}",
                          f"the metric reports: {', '.join(float_values)}")
    result = gate(float_values, quant_values, rules, ratio=default_ratio, float_samples=float_samples,
                  quant_samples=quant_samples, confidence=confidence)
    if confidence is not None and float_samples is None:
        err_console.print("note: the metric gives no per-sample scores, so --confidence is ignored", markup=False)
    frame = result.frame
    meta = {**result.meta, "checkpoints": paths, "stages": stages, "order_warnings": order_warnings,
            "flipped_samples": result.flipped}
    if junit is not None:
        from qdebug.report.junit import write_junit

        if is_rank_zero():
            with with_out(out):  # with --out: both appear, or neither
                write_junit(junit, frame)
    summary_path = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary_path and is_rank_zero():
        from qdebug.report.markdown import markdown_table

        verdict = "passed" if result.passed else "FAILED"
        with open(summary_path, "a") as fh:  # appended by design: the summary collects every step
            fh.write(f"### qdebug baseline {verdict}\n\n{markdown_table(frame, SHOWN)}\n\n")

    def render() -> None:
        print_table(render_baseline(frame, ratio=default_ratio, confidence=confidence, width=table_width(wide)))
        for task, indices in result.flipped.items():
            if indices:
                shown = ", ".join(map(str, indices[:FLIPPED_SHOWN]))
                more = f", ... ({len(indices)} listed in --format json)" if len(indices) > FLIPPED_SHOWN else ""
                say(f"{task}: right in float, wrong quantized: samples {shown}{more}")

    emit(Report("baseline", frame, meta), fmt, out, render)
    if not result.passed:
        where = (f"{paths[0]} {paths[1]}" + (f" --data {data}" if data else "")) if paths else "FLOAT.pt QUANT.pt --data EVAL"
        named = metric or cfg.get("metric")
        fix = f"qdebug suggest {where}" + (f" --metric {named}" if named and paths else "")
        err_console.print(escaped(f"hint: find where accuracy is lost: qdebug compare {where}; the fix: {fix}"),
                          markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1)
