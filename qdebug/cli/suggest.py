"""``qdebug suggest``: the smallest verified set of int16 changes, and the plan as config."""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, List, Mapping, Optional

import typer

from qdebug.cli.against_float import checkpoint_paths, load_against_float
from qdebug.cli.registry import command
from qdebug.cli.compare import fix_command
from qdebug.cli.rules import METRIC_OPTION, RATIO_OPTION, check_ratio, metric_rules
from qdebug.cli.common import (
    BATCHES_OPTION, BATCH_SIZE_OPTION, DATA_HELP, DEVICE_OPTION, MODEL_KWARGS_OPTION,
    MODEL_OPTION, UNSAFE_LOAD_OPTION, STATE, RunOptions,
    check_data, command_line, model_errors, option_text, progress_bar, resolve_batches, writable_file,
)
from qdebug.cli.output import (
    FORMAT_OPTION, JSON_OPTION, OUT_OPTION, WIDE_OPTION, Report, emit, output_format, prepare_out, print_table, say,
    table_width, with_out,
)
from qdebug.errors import QDebugError

if TYPE_CHECKING:
    import pandas as pd

SHOWN_RANKS = 20  # rows of the ranking on the terminal; --wide, CSV and JSON have them all


def render_suggest(frame: "pd.DataFrame", meta: dict, *, width: Optional[int] = None, top: Optional[int] = SHOWN_RANKS):
    """The ranking: one row per candidate, best gain first, the plan's members highlighted."""
    from qdebug.report.table import fixed, render_table

    view = frame if top is None else frame.head(top)
    view = view.reset_index(drop=True).copy()
    view["in_plan"] = ["yes" if v else "" for v in view["in_plan"]]
    gains = [c for c in view.columns if c.endswith("_gain")]
    lead = "noise_score" if "noise_score" in view and view["gain_db"].isna().all() else "gain_db"
    priority = ["rank", "point", "kind", lead, "in_plan", "diagnosis", "recalibrate", *gains, "macs_share", "act_share",
                "bits", "layer", "ranked_batches"]
    formats = {"gain_db": fixed(2), "macs_share": fixed(3), "act_share": fixed(3)}
    formats.update({c: fixed(4) for c in gains})
    highlight = [i for i, v in enumerate(view["in_plan"]) if v]
    shown = f"top {len(view)} of {len(frame)}" if len(view) < len(frame) else f"{len(frame)}"
    what = "gain over everything quantized" if lead == "gain_db" else "ranked by gradient-weighted noise"
    title = f"suggest: {shown} candidate(s) at {meta['bits']} bits, {what}"
    priority = [c for c in priority if c in view]
    return render_table(view, title=title, columns=priority, priority=priority, width=width,
                        names=("point", "layer"), formats=formats, highlight=highlight)


def merged_overrides(old: Mapping[str, Mapping], plan: Mapping[str, Mapping]) -> dict[str, dict]:
    """The plan's overrides on top of ``old``: a glob both name is written once (TOML refuses a
    table twice), the plan's settings refining the old ones -- a W4 g128 override keeps its
    bits when the plan shrinks its groups; None (float) replaces them."""
    merged = {glob: dict(entry) for glob, entry in old.items()}
    for glob, entry in plan.items():
        before = merged.get(glob) or {}
        merged[glob] = {**before, **{kind: spec if spec is None or before.get(kind) is None
                                     else {**before[kind], **spec} for kind, spec in entry.items()}}
    return merged


def _plan_toml(meta: dict, qconfig: dict, command: str) -> str:
    """The plan as a qconfig file ``qdebug calibrate --qconfig`` applies as it is: the
    checkpoint's own weight/activation settings and overrides, then the plan's."""
    from qdebug.config.project import toml_key, toml_value
    from qdebug.safe_text import escaped

    # Every string is TOML-escaped, every key quoted unless bare, and a comment (which TOML
    # cannot escape) is shown escaped: a name's newline or quote never breaks out of its place.
    lines = [f"# qdebug suggest: {len(meta['plan']['points'])} point(s) at {meta['bits']} bits, "
             f"verified in {meta['plan']['evaluations']} evaluation(s)"
             + (f", {meta['forwards']} forward pass(es) in all" if "forwards" in meta else ""),
             f"# apply: {escaped(command)}", ""]
    for kind in ("weight", "activation"):
        lines.append(f"[{kind}]")
        lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in (qconfig.get(kind) or {}).items()]
        lines.append("")
    overrides = dict(qconfig.get("overrides") or {})
    skipped = [g for g, e in overrides.items() if any(v is None for v in e.values())]
    kept = {g: e for g, e in overrides.items() if g not in skipped}
    for glob, entry in merged_overrides(kept, meta["plan"]["overrides"]).items():
        lines.append(f"[overrides.{toml_value(glob)}]")
        lines += [f"{toml_key(kind)} = {{{', '.join(f'{toml_key(k)} = {toml_value(v)}' for k, v in spec.items())}}}"
                  for kind, spec in entry.items() if spec is not None]
        lines.append("")
    if skipped:
        lines.insert(2, f"# kept from the project config's qconfig (TOML has no null): float overrides {escaped(skipped)}")
    return "\n".join(lines)


def _apply(found, candidates: list, overrides: dict, bits: int, output: Path) -> None:
    """The checkpoint with the plan applied (what calibrating with the plan's overrides gives
    from the statistics it holds), its qconfig carrying the overrides."""
    import dataclasses

    from qdebug.checkpoint import save
    from qdebug.engine import engine_state, quant_points
    from qdebug.engine.respec import raise_bits
    from qdebug.engine.spec import QConfig
    from qdebug.tools.suggest import plan_changes

    net = found.model
    state = engine_state(net)
    raise_bits(net, plan_changes(candidates, bits), quant_points(net))  # kept: this is the fixed model
    merged = merged_overrides(state.qconfig.overrides, overrides)
    state.qconfig = dataclasses.replace(state.qconfig, overrides=merged)
    QConfig.from_dict(state.qconfig.to_dict())  # the merged config must load back
    save(net, output, stage=found.info.stage, model_spec=found.info.model, sample_inputs=found.info.sample_inputs)


# --to: the files each flow's write-back is (--out DIR)
WRITE_BACK = {"torch-ao": ("plan_torch_ao.py", "plan_torch_ao.json"),
              "onnxruntime": ("plan_onnxruntime.py", "plan_onnxruntime.json")}


@command(
    short_help="The smallest set of int16 changes proven to bring the model back over its target.",
    help=(
        "Rank every quant point of a calibrated, QAT or quantized CHECKPOINT raised to 16 bits (or --bits) "
        "by the output SQNR and metric it wins back, then search the shortest prefix of the ranking that "
        "meets the target -- every task's metric >= --ratio x float (baseline's rule) with --metric, "
        "else output SQNR >= --min-sqnr -- and drop every member that is not needed: a plan verified on "
        "the data, written as qconfig overrides (--out DIR: plan.toml for qdebug calibrate --qconfig) "
        "or applied (--apply -o FILE). Points that clip are left to recalibration, not int16. From 4 "
        "batches on, the last quarter is held out: the plan searched on the rest is confirmed there, with "
        "its margin and that margin's bootstrap interval (--confidence), grown when it misses, and a warning "
        "when the margin is inside the noise; the summary counts every forward pass the command made. With "
        "--min-sqnr, a candidate that surely makes the output worse (99.5% confidence over the batches so "
        "far) is measured on no further batch (ranked last; ranked_batches in --wide).\n\n"
        "Example: qdebug suggest fixtures/demo/float.pt fixtures/demo/calibrated.pt --data fixtures/demo/eval.pt "
        "--min-sqnr 38 --wide\n\n"
        "Example: qdebug suggest fixtures/demo/float.pt fixtures/demo/calibrated.pt --data "
        "fixtures/demo/eval.pt --metric top1 --out suggest-out\n\n"
        "Example: qdebug suggest fixtures/demo/float.pt fixtures/demo/calibrated.pt --data fixtures/demo/eval.pt "
        "--batches 2 --min-sqnr 38 --apply -o fixed.pt\n\n"
        "Example: qdebug suggest fixtures/demo/float.pt fixtures/demo/calibrated.pt --data fixtures/demo/eval.pt "
        "--metric top1 --device cuda\n\n"
        "Example: qdebug suggest float.pt ort.pt --data eval.pt --min-sqnr 35 --to onnxruntime --out sout "
        "(ort.pt from qdebug import --from onnx-qdq: the plan as quantize_static's TensorQuantOverrides)"
    ),
)
def suggest(
    checkpoints: Optional[List[str]] = typer.Argument(None, metavar="[FLOAT] CHECKPOINT", hidden=True),
    metric: Optional[str] = METRIC_OPTION,
    min_sqnr: Optional[float] = typer.Option(None, "--min-sqnr", metavar="DB",
                                             help="Without a metric: the output SQNR to reach (default 30)."),
    ratio: Optional[float] = RATIO_OPTION,
    bits: int = typer.Option(16, "--bits", metavar="N", help="The width to raise points to (default 16)."),
    rank: str = typer.Option("exact", "--rank", metavar="exact|fast",
                             help="exact: each candidate alone; fast: gradient-weighted noise, one backward per batch."),
    confidence: float = typer.Option(0.95, "--confidence", metavar="LEVEL",
                                     help="Level of the bootstrap intervals: the plan's margin on the held-out "
                                          "batches (the last quarter, from 4 batches on), a per-sample metric's "
                                          "score."),
    data: Optional[str] = typer.Option(None, "--data", metavar="SPEC", help=DATA_HELP),
    batches: Optional[int] = BATCHES_OPTION,
    batch_size: Optional[int] = BATCH_SIZE_OPTION,
    apply: bool = typer.Option(False, "--apply", help="Write the checkpoint with the plan applied (-o FILE)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", metavar="FILE",
                                          help="With --apply: the checkpoint to write."),
    to: Optional[str] = typer.Option(None, "--to", metavar="torch-ao|onnxruntime",
                                     help="Also write the plan for the flow an imported checkpoint came from (--out "
                                          "DIR): torch-ao (plan_torch_ao.py, plan_torch_ao.json), onnxruntime (an "
                                          "onnx-qdq import: quantize_static's TensorQuantOverrides and "
                                          "nodes_to_exclude in plan_onnxruntime.py, plan_onnxruntime.json)."),
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
    if not 2 <= bits <= 16:
        raise QDebugError(f"--bits must be in [2, 16], got {bits}", "e.g. --bits 16")
    check_ratio(ratio)
    if rank not in ("exact", "fast"):
        raise QDebugError(f"--rank {rank!r} must be exact or fast", "e.g. --rank fast")
    if not 0.5 <= confidence < 1:
        raise QDebugError(f"--confidence {confidence:g} must be in [0.5, 1)", "e.g. --confidence 0.95")
    if apply != (output is not None):
        raise QDebugError("--apply writes a checkpoint: give both --apply and -o FILE",
                          "e.g. --apply -o fixed.pt (or neither)")
    if min_sqnr is not None and not math.isfinite(min_sqnr):  # the tool says so too, after loading
        raise QDebugError(f"--min-sqnr must be a number of dB, got {min_sqnr}", "e.g. --min-sqnr 30")
    check_data(data, batches, batch_size)
    given = list(checkpoints or [])
    paths = checkpoint_paths(given, "suggest")
    cfg = STATE.config()
    if metric and min_sqnr is not None:
        raise QDebugError("--min-sqnr is the target without a metric; with --metric the target is the metric",
                          "drop one of them")
    # --min-sqnr asks for an SQNR target: the config's metric then stays out.
    spec = metric or (cfg.get("metric") if min_sqnr is None else None)
    if to is not None and to not in WRITE_BACK:
        raise QDebugError(f"--to {to!r}: a plan goes back to {' or '.join(WRITE_BACK)}", "e.g. --to torch-ao")
    if output is not None:
        writable_file(output)  # its folder is created only when a plan is written to it
    out = prepare_out(out)
    if to is not None and out is None:
        raise QDebugError(f"--to {to} writes {' and '.join(WRITE_BACK[to])} into a folder", "add --out DIR")

    from qdebug.data.metrics import resolve_metric
    from qdebug.tools.suggest import DEFAULT_MIN_SQNR, diagnoses_of, suggest as run_suggest

    metric_fn = resolve_metric(spec) if spec else None
    found = load_against_float(paths, model=model, unsafe=unsafe_load, command="suggest")
    if to is not None:  # before the search: a checkpoint with no flow to go back to is refused now
        if to == "onnxruntime":
            from qdebug.tools.plan_onnxruntime import check_imported
        else:
            from qdebug.tools.plan_torch_ao import check_imported

        check_imported(found.model)
    batch_list = resolve_batches(data, batches, found.info, batch_size=batch_size)
    task, default_ratio, rules = metric_rules(spec, metric_fn, ratio)
    def diagnoses(searched) -> dict[str, str]:  # compare's on the searched batches, only when a plan is needed
        return diagnoses_of(found.reference, found.model, searched)

    with progress_bar("suggesting", None, unit="forwards", runs=True) as advance, model_errors("suggesting", batch_list):
        result = run_suggest(found.model, batch_list, reference=found.reference, metric=metric_fn, metric_name=task,
                             rules=rules, min_sqnr=min_sqnr if min_sqnr is not None else DEFAULT_MIN_SQNR, bits=bits,
                             diagnoses=diagnoses, confidence=confidence, rank=rank,
                             progress=lambda done, total: advance(done, total))
    frame, meta = result.frame, result.meta
    # The next commands run as printed: the same model, device and data (RunOptions).
    run = RunOptions(model=model, model_kwargs=model_kwargs, unsafe_load=unsafe_load, device=device, data=data,
                     batches=batches, batch_size=batch_size)
    options = run.text()
    float_path = paths[0] if len(paths) == 2 else "FLOAT.pt"
    plan_path = str(out.final / "plan.toml") if out is not None else "plan.toml"
    # A template: the data the float model was calibrated on is the user's to give.
    apply_command = (command_line("calibrate", float_path) + option_text(run.model_options())
                     + f" --data CALIBRATION_DATA --qconfig {shlex.quote(plan_path)} -o calibrated16.pt")
    # The same search again, written out: every option that shapes the plan, as typed.
    shaping = option_text([
        ("--metric", metric), ("--min-sqnr", format(min_sqnr, "g") if min_sqnr is not None else None),
        ("--ratio", ratio), ("--bits", bits if bits != 16 else None), ("--rank", rank if rank != "exact" else None),
        ("--confidence", confidence if confidence != 0.95 else None)])
    exact_command = f"{command_line('suggest', *given)}{options}{shaping} --apply -o fixed.pt"
    # Wide channels among the plan's points: equalizing the float model may keep them int8 (docs/fix.md).
    like = paths[-1] if found.info.qconfig is not None else None  # the fix is proven with this checkpoint's qconfig
    fix = fix_command(float_path, run, like) if meta["plan"]["outlier_points"] else ""
    meta.update(checkpoints=paths, ratio=default_ratio, summary=result.summary, fix=fix)
    files = []
    written_back = None
    plan_ok = meta["plan"]["passed"] and meta["plan"]["points"]
    if out is not None:
        from qdebug.io.atomic import atomic_path
        from qdebug.report.plots import plot_suggest

        qconfig = found.info.qconfig.to_dict() if found.info.qconfig is not None else {}
        if plan_ok:
            with atomic_path(out.file("plan.toml")) as tmp:
                Path(tmp).write_text(_plan_toml(meta, qconfig, apply_command))
            files.append(out.file("plan.toml"))
        else:  # an earlier run's plan would read as this run's
            out.drop_stale("plan.toml")
        if to == "onnxruntime" and plan_ok:
            from qdebug.tools import plan_onnxruntime

            written_back = plan_onnxruntime.onnxruntime_plan(found.model, meta["plan"]["overrides"], bits=bits,
                                                             nodes=(found.info.meta or {}).get("onnx_nodes"))
            for name, text in zip(WRITE_BACK[to], (plan_onnxruntime.python_source(written_back),
                                                   plan_onnxruntime.json_document(written_back))):
                with atomic_path(out.file(name)) as tmp:
                    Path(tmp).write_text(text)
                files.append(out.file(name))
        elif to is not None and plan_ok:
            from qdebug.tools.plan_torch_ao import json_document, python_source, torch_ao_plan

            # Before --apply raises the model's points: the plan is read against the checkpoint as loaded.
            written_back = torch_ao_plan(found.model, meta["plan"]["overrides"], bits=bits,
                                     qat={"qat": True, "calibrated": False}.get(found.info.stage))
            for name, text in (("plan_torch_ao.py", python_source(written_back)),
                               ("plan_torch_ao.json", json_document(written_back))):
                with atomic_path(out.file(name)) as tmp:
                    Path(tmp).write_text(text)
                files.append(out.file(name))
        elif to is not None:
            for name in WRITE_BACK[to]:
                out.drop_stale(name)
        if frame["rank"].notna().any():  # nothing ranked (the model meets the target): no picture to draw
            files.append(plot_suggest(frame, meta, out.file("suggest.png")))
        else:
            out.drop_stale("suggest.png")
    applied = False
    if output is not None and plan_ok:
        with with_out(out):  # with --out: both appear, or neither
            _apply(found, result.plan.candidates, meta["plan"]["overrides"], bits, output)
        files.append(output)
        applied = True
    plan = meta.pop("plan")
    extra = {"plan": plan}
    if written_back is not None:  # JSON key: torch_ao or onnxruntime
        extra[to.replace("-", "_")] = {"meta": written_back.attrs["meta"], "rows": written_back.to_dict("records")}
    report = Report("suggest", frame, {**meta, "plan_points": plan["points"]}, files=files, json_extra=extra)

    def render() -> None:
        if not frame.empty:
            print_table(render_suggest(frame, meta, width=table_width(wide), top=None if wide else SHOWN_RANKS))
        for line in result.summary.splitlines():
            say(line)
        if output is not None and not applied:
            say(f"nothing written to {output}: no plan to apply")
        if applied:
            gate = option_text([("--metric", spec), ("--ratio", ratio)]) + options
            # Without a FLOAT checkpoint there is none for baseline: step's first row is the fixed
            # checkpoint against its own float run, with baseline's verdict.
            check = (command_line("baseline", float_path, output) if len(paths) == 2
                     else command_line("step", output)) + gate
            if spec:  # what was written is said on stderr with the other files (emit): stdout is for results
                say("next: check the fixed checkpoint:")
                say(f"  {check}")
        elif plan_ok:
            say("next: apply the plan from the checkpoint's own statistics (exact):")
            say(f"  {exact_command}")
            if out is not None:
                say(f"  or recalibrate the float model with {plan_path} on the data it was calibrated on:")
                say(f"  {apply_command}")
        if fix:
            say("or equalize the float model first: fewer int16 points (docs/fix.md):")
            say(f"  {fix}")
        if written_back is not None and to == "onnxruntime":
            say(f"onnxruntime: {written_back.attrs['meta']['expressible']} tensor(s) for quantize_static in "
                f"{out.final / WRITE_BACK[to][0]} and {WRITE_BACK[to][1]}")
            for row in written_back.itertuples():
                if not row.expressible:
                    say(f"  not expressible: {row.point} ({row.tensor}): {row.reason}")
        elif written_back is not None:  # with --apply too
            torch_meta = written_back.attrs["meta"]
            say(f"torch.ao ({torch_meta['flow']}): {torch_meta['expressible']} tensor(s) in "
                f"{out.final / 'plan_torch_ao.py'} and plan_torch_ao.json")
            for row in written_back.itertuples():
                if not row.expressible:
                    say(f"  not expressible: {row.point} ({row.tensor}): {row.reason}")

    emit(report, fmt, out, render)
    if not plan["passed"]:
        raise typer.Exit(1)  # no plan at this width meets the target: a check that failed
