"""``qdebug inspect``: stage, model, qconfig and a per-layer table with checks."""

from __future__ import annotations

from typing import Optional

import typer
from rich.panel import Panel

from qdebug.cli.app import app
from qdebug.cli.common import MODEL_OPTION, UNSAFE_LOAD_OPTION, console, load_checkpoint, model_errors, print_json, resolve_batches, stage_path
from qdebug.report.output import to_json
from qdebug.report.table import render_table
from qdebug.tools.inspect import inspect_model

_STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}


@app.command(
    help=(
        "Show what a checkpoint holds: stage, model, qconfig, every layer's weight/activation "
        "dtype and scales, and checks (unfused Conv-BN, shared or dead modules, bad scales, "
        "uninitialised observers, float fallbacks, non-finite weights). Exit 1 when a check is an error.\n\n"
        "Example: qdebug inspect fixtures/demo/qat.pt --json"
    )
)
def inspect(
    checkpoint: Optional[str] = typer.Argument(None, help="Checkpoint of any stage (default: the config's qat, calibrated, quantized or float)."),
    data: Optional[str] = typer.Option(None, "--data", help="Inputs to trace a float model (default: the checkpoint's sample inputs)."),
    model: Optional[str] = MODEL_OPTION,
    unsafe_load: bool = UNSAFE_LOAD_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print JSON {meta, rows, checks} instead of tables."),
) -> None:
    path = stage_path(checkpoint, "qat", "calibrated", "quantized", "float", what="")
    net, info = load_checkpoint(path, model=model, unsafe=unsafe_load, command="inspect")
    batches = resolve_batches(data, 1, info, required=False) if info.stage == "float" else None
    example = batches[0].inputs if batches else None
    with model_errors("tracing the model", batches[0] if batches else None):
        result = inspect_model(net, stage=info.stage, example_inputs=example)
    meta = {**result.meta, "path": path, "model": info.model.to_dict(), "checkpoint_meta": info.meta,
            "qconfig": info.qconfig.to_dict() if info.qconfig else None}
    if as_json:
        from qdebug.report.output import records

        print_json(to_json(result.layers, meta, checks=records(result.checks)))
    else:
        qcfg = info.qconfig
        lines = [
            f"[bold]{path}[/]  stage: [bold]{info.stage}[/]  model: {info.model.target} {info.model.kwargs or ''}",
            f"qat mode: {meta['qat_mode'] or '-'}   quant points: {meta['quant_points']}",
        ]
        if qcfg is not None:
            lines.append(f"weights: {qcfg.weight.describe()}   activations: {qcfg.activation.describe()}")
            if qcfg.overrides:
                lines.append(f"overrides: {dict(qcfg.overrides)}")
        console.print(Panel("\n".join(lines), title="qdebug inspect", expand=False))
        console.print(render_table(result.layers, title="layers"))
        if len(result.checks):
            table = render_table(result.checks, title="checks")
            for i, sev in enumerate(result.checks["severity"]):
                table.rows[i].style = _STYLE.get(sev)
            console.print(table)
        console.print(f"{meta['errors']} error(s), {meta['warnings']} warning(s)")
    if result.has_errors:
        raise typer.Exit(1)

