"""``qdebug watch``: train QAT steps (nan-trace's loop) under ``qdebug.watch`` and say what goes wrong.

The run is ``qdebug.tools.watch.run.watch_steps``; this module parses, checks, renders the
findings table, and writes ``--out DIR`` (CSV, JSON, PNG plots, TensorBoard event files)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from qdebug.cli.registry import command
from qdebug.cli.common import (
    BATCHES_OPTION, BATCH_SIZE_OPTION, DATA_HELP, DEVICE_OPTION, MODEL_KWARGS_OPTION, MODEL_OPTION, STATE,
    UNSAFE_LOAD_OPTION, check_data, load_checkpoint, model_errors, progress_bar, resolve_batches, stage_path,
)
from qdebug.cli.output import (
    FORMAT_OPTION, JSON_OPTION, OUT_OPTION, WIDE_OPTION, Report, emit, note, output_format, prepare_out, print_table,
    say, table_width,
)
from qdebug.cli.training import (
    LOSS_OPTION, LR_OPTION, OPTIMIZER_OPTION, SEED_OPTION, TRAIN_OPTION, check_training, trainer,
)
from qdebug.errors import QDebugError

TENSORBOARD_DIR = "tensorboard"  # under --out DIR: the event files (tensorboard --logdir DIR/tensorboard)
TENSORBOARD_HINT = 'TensorBoard files need the tensorboard package: pip install "qdebug[tensorboard]"'


@command(
    "watch",
    short_help="Watch QAT steps: oscillating weights, EMA start-up bias, BN drift, a dead run.",
    help=(
        "Train CHECKPOINT (a qat or calibrated checkpoint) for --steps QAT steps on --data with nan-trace's "
        "training loop (--loss, --optimizer, --lr, --seed, --train as there), and look every --every steps at "
        "each activation point (scale, tracked range vs the data's, saturation), each weighted layer (integer "
        "codes that change and flip back, distance to the rounding boundary, gradient, update in grid steps), "
        "each BN's statistics against the float model's, and the output SQNR against the float model on the "
        "held-out batches (the last --held-out batches of --data, not trained on). The float model: --float, "
        "or float in qdebug.toml. Prints the findings (rule, layer, from which step, evidence, fix); exit code 1 "
        "when there is one. --out DIR also writes timeline.csv, PNG plots and TensorBoard event files.\n\n"
        "Example: qdebug watch fixtures/demo/qat.pt --data fixtures/demo/eval.pt --float fixtures/demo/float.pt "
        "--steps 20 --lr 0.01 --every 5 --batch-size 16\n\n"
        "Example: qdebug watch qat.pt --data train.pt --steps 500 --lr 0.01 --out watch-out\n\n"
        "Example: qdebug watch qat.pt --data train.pt --steps 200 --train mypkg.train:step --format json"
    ),
)
def watch(
    checkpoint: Optional[str] = typer.Argument(None, metavar="CHECKPOINT", show_default=False),
    data: Optional[str] = typer.Option(None, "--data", metavar="SPEC", help=DATA_HELP),
    steps: int = typer.Option(100, "--steps", metavar="N", help="Training steps (>= 1)."),
    every: int = typer.Option(10, "--every", metavar="N", help="Look at step 0 and every N steps."),
    float_path: Optional[str] = typer.Option(None, "--float", metavar="FLOAT.pt",
                                             help="The float checkpoint (default: float in qdebug.toml): BN drift "
                                                  "and output SQNR against it."),
    held_out: Optional[int] = typer.Option(None, "--held-out", metavar="N",
                                           help="With a float model: the last N batches of --data make the "
                                                "held-out batch of the output SQNR, not trained on (default 1)."),
    lr: Optional[float] = LR_OPTION,
    optimizer: Optional[str] = OPTIMIZER_OPTION,
    loss: Optional[str] = LOSS_OPTION,
    train: Optional[str] = TRAIN_OPTION,
    seed: Optional[int] = SEED_OPTION,
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
    if steps < 1:
        raise QDebugError(f"--steps must be >= 1, got {steps}", "e.g. --steps 500")
    if every < 1:
        raise QDebugError(f"--every must be >= 1, got {every}", "e.g. --every 10 (look at step 0, 10, 20, ...)")
    if held_out is not None and held_out < 1:
        raise QDebugError(f"--held-out must be >= 1, got {held_out}", "e.g. --held-out 1 (the last batch)")
    check_training(lr=lr, optimizer=optimizer, loss=loss, train=train, seed=seed)
    check_data(data, batches, batch_size)
    path = stage_path(checkpoint, "qat", "calibrated", what="")
    float_path = float_path or STATE.config().get("float")
    if held_out is not None and not float_path:
        raise QDebugError("--held-out is for the output SQNR against the float model, and none is given",
                          "give --float FLOAT.pt (or set float in qdebug.toml), or leave --held-out out")
    out = prepare_out(out)
    step_fn = trainer(train)

    from qdebug.tools.watch.run import held_out_inputs, watch_steps

    net, info = load_checkpoint(path, model=model, unsafe=unsafe_load, expect=("qat", "calibrated"), command="watch")
    float_net = None
    if float_path:
        float_net, float_info = load_checkpoint(float_path, model=model, unsafe=unsafe_load, command="watch")
        if float_info.stage != "float":
            raise QDebugError(f"--float {float_path} is a {float_info.stage} checkpoint", "give the float checkpoint")
    else:
        note("note: no float model (--float, or float in qdebug.toml): BN drift and output SQNR are not measured")
    settings = {"optimizer": optimizer or "sgd", "lr": lr if lr is not None else 0.01, "loss": loss or "auto",
                "seed": seed if seed is not None else 0}
    items = list(resolve_batches(data, batches, info, batch_size=batch_size))
    keep = (held_out or 1) if float_net is not None else 0
    if len(items) <= keep:
        raise QDebugError(f"the data has {len(items)} batch(es): holding out the last {keep} leaves none to train on",
                          "give more batches (or a smaller --batch-size), or --held-out fewer")
    trained, held = items[:len(items) - keep], items[len(items) - keep:]
    with progress_bar("watching", steps, unit="steps") as advance, model_errors("watching", trained):
        run = watch_steps(net, trained, steps=steps, every=every, float_model=float_net,
                          held_out=held_out_inputs(held) if held else None, train=step_fn,
                          progress=lambda n, t: advance(n, t), **settings)
    bad = run.non_finite
    meta = {**run.meta, "checkpoint": path, "stage": info.stage, "float": float_path or None,
            "steps_run": run.steps_run, "batches": len(trained), "held_out_batches": len(held), "train": train,
            "findings": len(run.findings), "non_finite": _non_finite_text(bad) if bad else None}
    files: list[Path] = []
    if out is not None:
        from qdebug.report.output import write_csv
        from qdebug.report.watch_plots import plot_watch

        files.append(write_csv(out.file("timeline.csv"), run.timeline))
        files += plot_watch(run.timeline, run.findings, out.file("timeline.csv").parent)

    def render() -> None:
        if len(run.findings):
            print_table(render_findings(run.findings, meta, width=table_width(wide)))
            for line in [] if wide else fix_lines(run.findings):  # --wide: the table has the fix column
                say(line)
        say(summary(meta, run.findings))
        if bad:
            say(f"the run went non-finite: {meta['non_finite']} -- qdebug nan-trace says why")

    from qdebug.report.output import records

    emit(Report("watch", run.findings, meta, files=files, json_extra={"timeline": records(run.timeline)}),
         fmt, out, render)
    if out is not None:
        written = write_tensorboard(run.timeline, out.final / TENSORBOARD_DIR)
        if written is not None:
            note(f"wrote {written} (tensorboard --logdir {written})")
    if len(run.findings) or bad:
        raise typer.Exit(1)


def summary(meta: dict, findings) -> str:
    """The last line: no finding, or how many and which rules."""
    where = f"in {meta['steps_run']} step(s) (looks every {meta['every']})"
    if not len(findings):
        return f"no finding {where}"
    rules = ", ".join(dict.fromkeys(findings["rule"]))
    return f"{len(findings)} finding(s) {where}: {rules}"


def render_findings(frame, meta: dict, *, width: Optional[int] = None):
    """The findings table: rule, name, from_step, evidence (wrapped); the fixes follow it as
    text (``fix_lines``), all of them with --wide."""
    from qdebug.report.table import render_table

    columns = ["rule", "name", "from_step", "evidence"] + (["fix"] if width is None else [])
    return render_table(frame, title=f"watch: {len(frame)} finding(s)", columns=columns, priority=columns,
                        width=width, names=("name",), wrap=("evidence", "fix"))


def fix_lines(frame) -> list[str]:
    """One fix line per rule (its first finding's fix; the others' differ only by the name)."""
    lines = []
    for rule, part in frame.groupby("rule", sort=False):
        more = f" ({len(part) - 1} more alike)" if len(part) > 1 else ""
        lines.append(f"fix, {rule}{more}: {part['fix'].iloc[0]}")
    return lines


def _non_finite_text(first: dict) -> str:
    return f"{first['phase']} of step {first['step']}, {first['layer']} ({first['cause']})"


def write_tensorboard(timeline, folder: Path) -> Optional[Path]:
    """One scalar per (kind/name/metric) at each look's step, into ``folder`` (a run's earlier
    event files there are replaced: two runs in one folder would draw as one); None, said on
    stderr, without the tensorboard package."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        note(f"note: {TENSORBOARD_HINT}")
        return None
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("events.out.tfevents.*"):
        old.unlink()
    writer = SummaryWriter(log_dir=str(folder))
    try:
        for step, kind, name, metric, value in timeline.itertuples(index=False):
            writer.add_scalar("/".join(p for p in (kind, name, metric) if p), value, global_step=int(step))
    finally:
        writer.close()
    return folder
