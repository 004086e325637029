"""``qdebug convert``: calibrated or QAT checkpoint -> quantized (integer simulation) checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from qdebug.checkpoint import save
from qdebug.cli.app import app
from qdebug.cli.common import console, load_checkpoint, print_json, stage_path, writable_file
from qdebug.engine import convert as run_convert
from qdebug.report.output import to_json
from qdebug.report.table import render_table
from qdebug.tools.inspect import inspect_model


@app.command(
    help=(
        "Convert a calibrated or QAT checkpoint to the quantized stage: BN folded, integer weights, "
        "integer kernels with fixed-point requantization.\n\n"
        "Example: qdebug convert fixtures/demo/qat.pt --out quantized.pt"
    )
)
def convert(
    checkpoint: Optional[str] = typer.Argument(None, help="Calibrated or QAT checkpoint (default: the config's qat, then calibrated)."),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the quantized checkpoint."),
    model: Optional[str] = typer.Option(None, "--model", help="Architecture package.module:Class, overriding the file's."),
    as_json: bool = typer.Option(False, "--json", help="Print the per-layer table as JSON."),
) -> None:
    writable_file(out)
    path = stage_path(checkpoint, "qat", "calibrated", what="QAT or calibrated")
    net, info = load_checkpoint(path, model=model, expect=("calibrated", "qat"), command="convert")
    quantized = run_convert(net)
    save(quantized, out, stage="quantized", model_spec=info.model, sample_inputs=info.sample_inputs,
         meta={"source": str(path), "source_stage": info.stage})
    result = inspect_model(quantized, stage="quantized")
    meta = {**result.meta, "out": str(out), "source": path}
    if as_json:
        print_json(to_json(result.layers, meta))
        return
    console.print(render_table(result.layers, title="quantized layers"))
    console.print(f"wrote {out} (stage quantized from {info.stage})")
