"""``qdebug nan-trace``: the first NaN/Inf in forward, backward or update, at which layer and step, and why."""

from __future__ import annotations

import math

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from qdebug.cli.registry import command
from qdebug.cli.common import (
    BATCHES_OPTION, BATCH_SIZE_OPTION, DATA_HELP, DEVICE_OPTION, MODEL_KWARGS_OPTION, MODEL_OPTION, UNSAFE_LOAD_OPTION,
    check_data, load_checkpoint, model_errors, progress_bar, resolve_batches, stage_path,
)
from qdebug.cli.training import (
    FLOAT32_MAX, LOSS_OPTION, LR_OPTION, OPTIMIZER_OPTION, SEED_OPTION, TRAIN_OPTION, check_training, trainer as _trainer,
)
from qdebug.cli.output import (
    FORMAT_OPTION, JSON_OPTION, OUT_OPTION, WIDE_OPTION, Report, emit, note, output_format, prepare_out, print_table,
    say, table_width,
)
from qdebug.errors import QDebugError

if TYPE_CHECKING:
    import pandas as pd

    from qdebug.io.staged import StagedDir

SHOWN_STEPS = 12  # timeline rows on the terminal (the last ones); --wide, CSV and JSON have them all
BUNDLE_KEY = "nan_trace"  # the meta key of a repro bundle's before.pt


def render_timeline(frame: "pd.DataFrame", meta: dict, *, width: Optional[int] = None,
                    top: Optional[int] = SHOWN_STEPS):
    from qdebug.report.table import fixed, render_table

    view = frame if top is None else frame.tail(top)
    view = view.reset_index(drop=True)
    columns = ["step", "batch", *[c for c in ("loss", "max_abs_weight", "grad_norm", "worst_saturation", "worst_point")
                                  if c in view and view[c].notna().any()]]
    formats = {"worst_saturation": fixed(3)}
    shown = f"last {len(view)} of {len(frame)}" if len(view) < len(frame) else f"{len(frame)}"
    unit = "step(s)" if meta.get("steps") else "forward pass(es)"
    title = f"nan-trace timeline: {shown} finite {unit} before" if meta.get("found") else \
        f"nan-trace timeline: {shown} {unit}, all finite"
    return render_table(view, title=title, columns=columns, priority=columns, width=width, names=("worst_point",),
                        formats=formats)


def headline(first: dict) -> list[str]:
    """The first event in a few lines: where, what, why, what to do."""
    from qdebug.tools.nan.detect import Finding, counts_text

    finding = Finding(**{k: v for k, v in first.items() if k in Finding.__dataclass_fields__})
    verb = "created" if first.get("created") else "passed on"
    what = "output (before its quant point)" if first["what"] == "raw_output" else first["what"]
    subject = first.get("tensor") or first["layer"]
    if first["what"] in ("output_grad", "param_grad"):
        where = f"the backward of {first['layer']} ({first['op']}) {verb} a non-finite gradient of {subject}"
    elif first["layer"] == "optimizer":
        where = f"the {first['op']} optimizer's step size left float32's range"
    elif first["what"] == "param" and first["phase"] == "forward":
        where = f"{subject} was already invalid before the step ran"
    elif first["what"] == "param":
        where = f"the optimizer's step left {subject} non-finite"
    elif first["what"] == "scale":
        where = f"quant point {subject} has {_scale_kind(first.get('value'))} scale"
    elif first["layer"] == "input" and first["op"] == "input":
        where = "the batch holds non-finite values"
    else:
        where = f"{first['layer']} ({first['op']}) {verb} a non-finite {what}"
    label = "FIRST NON-FINITE" if _non_finite(first) else "FIRST INVALID SCALE"
    lines = [f"{label}: {first['phase']} of step {first['step']}, batch {first['batch']}: {where}"]
    facts = [counts_text(finding)] if first.get("numel") or first.get("value") is not None else []
    if first.get("numel") and first["what"] != "scale":
        facts[0] += f" of {first['numel']} values ({first['dtype']} {first['shape']})"
    if first.get("point"):
        facts.append(f"quant point {first['point']}")
    if first.get("samples"):
        facts.append(f"samples {', '.join(map(str, first['samples']))}")
    if facts:
        lines.append("  " + "; ".join(facts))
    lines.append(f"  cause: {first['cause']}: {first['detail']}")
    lines.append(f"  fix: {first['fix']}")
    return lines


def _non_finite(first: dict) -> bool:
    """Whether the first event is a NaN/Inf: a scale that is finite but negative, zero or too small
    is an invalid scale, and is called one, not a non-finite value."""
    value = first.get("value")
    return not (first["what"] == "scale" and value is not None and math.isfinite(value))


def _scale_kind(value: float | None) -> str:
    """What is wrong with a scale of ``value``: "a negative", "a zero", "a NaN"... (for "has ... scale")."""
    if value is None:
        return "an invalid"
    if math.isnan(value):
        return "a NaN"
    if math.isinf(value):
        return "an infinite"
    return "a negative" if value < 0 else "a zero" if value == 0 else "a tiny"


def float_check_line(check: dict | None, first: dict | None) -> str:
    """What the float check says about blame, given the traced run's first finding (if any)."""
    if check is None:
        return ""
    how = "" if check.get("model") == "plain" else f" ({check.get('model')})"
    if check["finite"]:
        verdict = "quantization is to blame" if first else "as the traced model does"
        return f"float check{how}: the float model stays finite over the same {check['steps']} step(s): {verdict}"
    f = check["first"]
    if first is None:
        verdict = "only the float model does"
    elif f["step"] > first["step"]:
        verdict = (f"{f['step'] - first['step']} step(s) later than the traced model: quantization brings it "
                   "forward, the training is the cause")
    else:
        verdict = "not quantization's fault"
    return (f"float check{how}: the float model goes non-finite too ({f['phase']} of step {f['step']}, "
            f"{f['layer']}): {verdict}")


def _float_model(net, info, float_path: Optional[str], model: Optional[str], unsafe: bool):
    """The plain float architecture with the checkpoint's weights (``--float`` names another
    architecture, e.g. the float class of a user's own QAT module)."""
    from qdebug.tools.nan.trace import plain_float_model

    spec = info.model
    if float_path:
        _, float_info = load_checkpoint(float_path, model=model, unsafe=unsafe, command="nan-trace")
        if float_info.stage != "float":
            raise QDebugError(f"--float {float_path} is a {float_info.stage} checkpoint", "give the float checkpoint")
        spec = float_info.model
    return plain_float_model(net, spec, strict=bool(float_path))


def _bundle(info, path: str) -> dict:
    """The repro settings a before.pt carries (empty for other checkpoints), checked: a file
    is not trusted to hold the types the replay feeds to float(), int() and the optimizer."""
    import torch

    from qdebug.data.limits import SEED_RANGE

    found = (info.meta or {}).get(BUNDLE_KEY)
    if not isinstance(found, dict):
        return {}
    checks = {
        "optimizer": lambda v: isinstance(v, str),
        "loss": lambda v: isinstance(v, str),
        # Compared, not float()ed: a huge int would overflow; NaN fails the comparison.
        "lr": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= FLOAT32_MAX,
        "seed": lambda v: isinstance(v, int) and not isinstance(v, bool) and SEED_RANGE[0] <= v <= SEED_RANGE[1],
        "optimizer_state": lambda v: isinstance(v, dict) and set(v) <= {"state", "param_groups"},
        "rng_state": lambda v: isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1,
        "diagnosis": _run_record_ok,
    }
    for key, ok in checks.items():
        if key in found and found[key] is not None and not ok(found[key]):
            raise QDebugError(f"{path}: the repro bundle's {key} is damaged ({type(found[key]).__name__})",
                              "trace the original checkpoint again to write a new bundle")
    return found


def _run_record_ok(value: Any) -> bool:
    """A bundle's record of the run's finding (``qdebug.tools.nan.trace.run_record``): every key,
    text as text (shown escaped), counts as non-negative ints."""
    from qdebug.tools.nan.trace import RUN_COUNT_KEYS, RUN_TEXT_KEYS

    return isinstance(value, dict) and set(value) == set(RUN_TEXT_KEYS + RUN_COUNT_KEYS) \
        and all(isinstance(value[k], str) for k in RUN_TEXT_KEYS) \
        and all(isinstance(value[k], int) and not isinstance(value[k], bool) and 0 <= value[k] < 2**63
                for k in RUN_COUNT_KEYS)


@command(
    "nan-trace",
    short_help="The first NaN/Inf in forward, backward or update: which layer, which step, and why.",
    help=(
        "Train CHECKPOINT step by step (or, with --steps 0, run it forward) on --data until the first "
        "non-finite value: in the forward (every layer and inline op, quant points included), the backward "
        "(each layer's gradient, each parameter's), the optimizer's update, or a scale. Reports the phase, "
        "step, batch, samples, layer, op, quant point, NaN/Inf counts, whether the layer created the value, "
        "its cause and a fix, and the timeline of the steps before. The checkpoint's stage decides the modes "
        "(qat: as saved; calibrated: frozen scales). Exit code 1 when a non-finite value was found.\n\n"
        "Example: qdebug nan-trace fixtures/demo/qat.pt --data fixtures/demo/eval.pt --steps 20 --batch-size 16 "
        "--lr 0.01\n\n"
        "Example: qdebug nan-trace fixtures/demo/calibrated.pt --data fixtures/demo/eval.pt --steps 0\n\n"
        "Example: qdebug nan-trace qat.pt --data train.pt --train mypkg.train:step --float-check --out nan-out\n\n"
        "Example: qdebug nan-trace fixtures/demo/qat.pt --data fixtures/demo/eval.pt --steps 20 --device cuda"
    ),
)
def nan_trace(
    checkpoint: Optional[str] = typer.Argument(None, metavar="CHECKPOINT", show_default=False),
    data: Optional[str] = typer.Option(None, "--data", metavar="SPEC", help=DATA_HELP),
    steps: int = typer.Option(100, "--steps", metavar="N",
                              help="Training steps (0: forward passes only, one per batch)."),
    lr: Optional[float] = LR_OPTION,
    optimizer: Optional[str] = OPTIMIZER_OPTION,
    loss: Optional[str] = LOSS_OPTION,
    train: Optional[str] = TRAIN_OPTION,
    seed: Optional[int] = SEED_OPTION,
    float_check: bool = typer.Option(False, "--float-check",
                                     help="Run the same steps on the plain float architecture: is quantization "
                                          "to blame at all?"),
    float_path: Optional[str] = typer.Option(None, "--float", metavar="FLOAT.pt",
                                             help="For --float-check: the float checkpoint whose architecture to "
                                                  "use (default: the checkpoint's own)."),
    batches: Optional[int] = BATCHES_OPTION,
    batch_size: Optional[int] = BATCH_SIZE_OPTION,
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
    if steps < 0:
        raise QDebugError(f"--steps must be >= 0, got {steps}", "e.g. --steps 500, or --steps 0 for forward passes")
    check_training(lr=lr, optimizer=optimizer, loss=loss, train=train, seed=seed)
    if train and steps == 0:
        raise QDebugError("--train runs training steps: it does nothing with --steps 0", "give --steps N (N >= 1)")
    if float_path and not float_check:
        raise QDebugError("--float only names the architecture of --float-check", "add --float-check")
    check_data(data, batches, batch_size)
    path = stage_path(checkpoint, "qat", "calibrated", "float", what="")
    out = prepare_out(out)
    trainer = _trainer(train)

    from qdebug.tools.nan.trace import against_run, trace_steps

    net, info = load_checkpoint(path, model=model, unsafe=unsafe_load, command="nan-trace")
    if info.stage == "quantized" and steps:
        raise QDebugError(f"{path} is a quantized checkpoint: integer kernels have no gradients to train",
                          "trace it with --steps 0, or train the qat (or calibrated) checkpoint")
    bundle = _bundle(info, path)
    settings = {"optimizer": optimizer or bundle.get("optimizer") or "sgd",
                "lr": lr if lr is not None else float(bundle.get("lr", 0.01)),
                "loss": loss or bundle.get("loss") or "auto",
                "seed": seed if seed is not None else int(bundle.get("seed", 0))}
    if settings["loss"] == "train":  # a bundle made by --train: the function must be given again
        if trainer is None:
            raise QDebugError(f"{path} was traced with a --train function", "give the same --train again")
        settings["loss"] = "auto"
    batch_list = resolve_batches(data, batches, info, batch_size=batch_size)
    if float_check and steps and trainer is None and settings["loss"] in ("auto", "distill") \
            and (settings["loss"] == "distill" or batch_list[0].target is None):  # the first batch: no pass
        raise QDebugError("--float-check needs targets (or --train): distilling a float model to its own "
                          "output trains nothing", "give (inputs, target) data, or --train package.module:function")
    float_net, float_kind = _float_model(net, info, float_path, model, unsafe_load) if float_check else (None, "")
    total = steps or batch_list.count
    with progress_bar("tracing", total, unit="steps" if steps else "batches") as advance, model_errors("tracing", batch_list):
        result = trace_steps(net, batch_list, steps=steps, loss=settings["loss"], optimizer=settings["optimizer"],
                             lr=settings["lr"], seed=settings["seed"], train=trainer,
                             optimizer_state=bundle.get("optimizer_state"), rng_state=bundle.get("rng_state"),
                             float_model=float_net, float_kind=float_kind, progress=lambda n, t: advance(n, t))
    run = bundle.get("diagnosis")  # a replay: the run that wrote the bundle had the history this step lacks
    first = result.first = against_run(result.first, run, len(result.timeline)) if run else result.first
    meta = {**result.meta, "checkpoint": path, "stage": info.stage, "found": first is not None,
            "steps_run": result.steps_run, "train": train,
            "replay_of": {"step": run["step"], "cause": run["cause"]} if run else None}
    files: list[Path] = []
    repro = ""
    if out is not None:
        from qdebug.report.plots import plot_nan_timeline

        if first is not None:
            files += _write_bundle(out, net, info, result, settings, train, run)
            repro = _repro_command(out.final, steps, train, model, device)
        else:  # a bundle of an earlier run in this folder would contradict this one
            out.drop_stale("before.pt", "batch.pt")
        files.append(plot_nan_timeline(result.frame, out.file("nan_trace.png"), first=first))
    meta["repro"] = repro
    from qdebug.tools.watch.run import dead_run_of

    collapse = dead_run_of(result) if steps else None
    meta["dead_run"] = collapse
    extra: dict[str, Any] = {"first": first, "float_check": result.float_check}

    def render() -> None:
        if first is not None:
            for line in headline(first):
                say(line)
        else:
            what = f"{result.steps_run} step(s)" if steps else f"{result.steps_run} forward pass(es)"
            say(f"all finite: {what} without a NaN or Inf (forward{', backward and update' if steps else ''})")
            if collapse:  # finite is not healthy: the timeline says the run can no longer train
                say(f"but the run looks dead (qdebug.watch's dead_run, docs/watch.md): {collapse['evidence']}")
                say(f"fix: {collapse['fix']}")
            if run:  # a replay that does not reproduce its run says so, never silently
                say(f"note: the run that wrote this bundle found {run['cause']} at {run['layer']} ({run['phase']} of "
                    f"its step {run['step']}); this replay stayed finite: the step does not reproduce here "
                    "(another device, or the loss or data differ from the run's)")
        for seen in result.meta.get("contained") or []:
            what = seen["what"].replace("_", " ")
            say(f"note: a non-finite {what} at {seen['layer']} (first in step {seen['step']}) "
                "stayed contained (a mask, or a saturating quant point): not a failure")
        line = float_check_line(result.float_check, first)
        if line:
            say(line)
        if repro:
            say(f"repro: {repro}")
        elif first is not None:
            say("repro: add --out DIR to write the failing batch and the model before the step")
        say("")
        measured = [c for c in ("loss", "max_abs_weight", "grad_norm", "worst_saturation")
                    if c in result.frame and result.frame[c].notna().any()]
        if len(result.frame) and measured:  # a float model's forward passes measure nothing worth a table
            print_table(render_timeline(result.frame, meta, width=table_width(wide), top=None if wide else SHOWN_STEPS))

    if fmt == "csv" and first is not None:  # the CSV is the timeline: the finding goes to the person
        for line in headline(first):
            note(line)
    emit(Report("nan_trace", result.frame, meta, files=files, json_extra=extra, rows_key="timeline"), fmt, out, render)
    if first is not None:
        raise typer.Exit(1)


def _write_bundle(out: "StagedDir", net, info, result, settings: dict, train: Optional[str],
                  run: Optional[dict] = None) -> list[Path]:
    """``before.pt`` (the model, optimizer and RNG state before the failing step, and the run's
    diagnosis) and ``batch.pt`` (the failing batch): ``--steps 1`` on them reproduces the event.
    A replay's bundle keeps the diagnosis of the run it replays (``run``) when it agreed."""
    import torch

    from qdebug.io.atomic import atomic_path
    from qdebug.checkpoint import save
    from qdebug.config.device import to_device
    from qdebug.tools.nan.trace import run_record

    snapshot, batch = result.snapshot, result.failing_batch
    net.load_state_dict(snapshot.model_state)
    bundle = {"optimizer": settings["optimizer"], "lr": settings["lr"],
              "loss": "train" if train else settings["loss"], "seed": settings["seed"],
              "step": snapshot.step, "batch": snapshot.batch, "rng_state": snapshot.rng_state,
              "diagnosis": run if run and run["cause"] == result.first["cause"] else
              run_record(result.first, len(result.timeline))}
    if snapshot.optimizer_state is not None and result.meta.get("steps"):
        bundle["optimizer_state"] = to_device(snapshot.optimizer_state, "cpu")  # a file that loads anywhere
    stage = info.stage
    before = save(net, out.file("before.pt"), stage=stage, model_spec=info.model, meta={BUNDLE_KEY: bundle})
    data = to_device([(batch.inputs, batch.target)] if batch.target is not None else [batch.inputs], "cpu")
    with atomic_path(out.file("batch.pt")) as tmp:
        torch.save(data, tmp)
    return [before, out.file("batch.pt")]


def _repro_command(out: Path, steps: int, train: Optional[str], model: Optional[str],
                   device: Optional[str] = None) -> str:
    """The command that replays the failing step alone (the bundle holds the optimizer, lr and loss);
    ``out`` is the folder the bundle will be in (the user's, not the staging one); ``device``: the
    --device the run was given (a GPU's kernels may round otherwise than the CPU's)."""
    parts = ["qdebug nan-trace", shlex.quote(str(out / "before.pt")), "--data", shlex.quote(str(out / "batch.pt")),
             "--steps", "1" if steps else "0"]
    if train:
        parts += ["--train", shlex.quote(train)]
    if model:
        parts += ["--model", shlex.quote(model)]
    if device:
        parts += ["--device", shlex.quote(device)]
    return " ".join(parts)
