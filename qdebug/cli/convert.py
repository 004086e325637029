"""``qdebug convert``: calibrated or QAT checkpoint -> quantized (integer simulation) checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from qdebug.cli.registry import command
from qdebug.cli.common import (
    DEVICE_OPTION, MODEL_KWARGS_OPTION, MODEL_OPTION, UNSAFE_LOAD_OPTION, load_checkpoint, stage_path, writable_file,
)
from qdebug.cli.inspect import render_layers
from qdebug.vocab import ARITHMETICS
from qdebug.cli.output import (
    CHECKPOINT_OUTPUT_OPTION, FORMAT_OPTION, JSON_OPTION, OUT_OPTION, WIDE_OPTION, Report, emit, note, output_format,
    prepare_out, print_table, table_width, with_out,
)


@command(
    short_help="A calibrated or QAT checkpoint as the quantized (integer) stage.",
    help=(
        "Convert a calibrated or QAT CHECKPOINT (default: the config's qat, then calibrated) to the "
        "quantized stage: BN folded, integer weights, "
        "integer kernels with fixed-point requantization (--arithmetic float32: ONNX Runtime's).\n\n"
        "Example: qdebug convert fixtures/demo/qat.pt -o quantized.pt\n\n"
        "Example: qdebug convert fixtures/demo/qat.pt -o quantized_ort.pt --arithmetic float32"
    )
)
def convert(
    checkpoint: Optional[str] = typer.Argument(None, metavar="CHECKPOINT", hidden=True),
    output: Path = CHECKPOINT_OUTPUT_OPTION,
    fmt: Optional[str] = FORMAT_OPTION,
    as_json: bool = JSON_OPTION,
    out: Optional[Path] = OUT_OPTION,
    wide: bool = WIDE_OPTION,
    model: Optional[str] = MODEL_OPTION,
    model_kwargs: Optional[str] = MODEL_KWARGS_OPTION,  # read through STATE by load_checkpoint
    unsafe_load: bool = UNSAFE_LOAD_OPTION,
    device: Optional[str] = DEVICE_OPTION,  # read through STATE by load_checkpoint and resolve_batches
    arithmetic: str = typer.Option(
        "fixed_point", "--arithmetic", metavar="fixed_point|float32",
        help="How layers requantize their accumulators: fixed_point (int32 multiplier and shift, ties away "
        "from zero: TFLite, gemmlowp, most NPUs) or float32 (float32 multiplier, ties to even: ONNX Runtime's "
        "CPU kernels, so the stage matches an exported model run there).",
    ),
) -> None:
    from qdebug.cli.import_ import _choice

    _choice("--arithmetic", arithmetic, ARITHMETICS)
    fmt = output_format(fmt, as_json)
    writable_file(output)
    out = prepare_out(out)
    path = stage_path(checkpoint, "qat", "calibrated", what="QAT or calibrated")
    net, info = load_checkpoint(path, model=model, unsafe=unsafe_load, expect=("calibrated", "qat"),
                                command="convert")

    from qdebug.checkpoint import save
    from qdebug.engine import convert as run_convert
    from qdebug.tools.inspect import inspect_model

    quantized = run_convert(net, arithmetic=arithmetic)
    with with_out(out):  # with --out: both appear, or neither
        save(quantized, output, stage="quantized", model_spec=info.model, sample_inputs=info.sample_inputs,
             meta={"source": str(path), "source_stage": info.stage})
    result = inspect_model(quantized, stage="quantized")
    meta = {**result.meta, "output": str(output), "source": path, "arithmetic": arithmetic}

    def render() -> None:
        print_table(render_layers(result.layers, title="quantized layers", width=table_width(wide)))

    emit(Report("convert", result.layers, meta), fmt, out, render)
    note(f"wrote {output} (stage quantized from {info.stage})")
