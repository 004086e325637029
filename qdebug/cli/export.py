"""``qdebug export``: a checkpoint as a QDQ ONNX model, checked in ONNX Runtime against the quantized stage."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from qdebug.cli.registry import command
from qdebug.cli.common import (
    BATCHES_OPTION, BATCH_SIZE_OPTION, DATA_HELP, DEVICE_OPTION, MODEL_KWARGS_OPTION, MODEL_OPTION, UNSAFE_LOAD_OPTION,
    RunOptions, check_data, command_line, load_checkpoint, model_errors, progress_bar, resolve_batches, stage_path, writable_file,
)
from qdebug.cli.output import (
    FORMAT_OPTION, JSON_OPTION, OUT_OPTION, WIDE_OPTION, Report, emit, note, output_format, prepare_out, say, with_out,
)
from qdebug.errors import QDebugError

PARITY_GATE = 0.99  # share of output values within 1 LSB of the quantized stage (issue 32)


@command(
    short_help="A checkpoint as a QDQ ONNX model, checked in ONNX Runtime.",
    help=(
        "Export a calibrated, QAT or quantized CHECKPOINT (default: the config's qat, then calibrated) as a "
        "QDQ ONNX model: BN folded as convert folds it, per-channel weight codes, QuantizeLinear/"
        "DequantizeLinear at every quant point, named by the points.  A float checkpoint is exported by "
        "torch unchanged.  With --check (default) ONNX Runtime runs it on the sample inputs (or --data) "
        "and its outputs are compared with qdebug's quantized stage, in LSB of the output scale; exit 1 "
        "when fewer than 99% lie within 1 LSB.  The summary says which layers ONNX Runtime runs as int8 "
        "kernels and which in float.  Needs pip install \"qdebug[onnx]\".\n\n"
        "Example: qdebug export fixtures/demo/qat.pt -o model.onnx\n\n"
        "Example: qdebug export calibrated.pt -o model.onnx --data fixtures/demo/eval.pt --batches 4 --format json\n\n"
        "Example: qdebug export int16.pt -o model.onnx --opset 21 --no-check"
    ),
)
def export(
    checkpoint: Optional[str] = typer.Argument(None, metavar="CHECKPOINT", hidden=True),
    output: Path = typer.Option(..., "-o", "--output", metavar="FILE.onnx", show_default=False,
                                help="Where to write the ONNX model (a .onnx file)."),
    data: Optional[str] = typer.Option(None, "--data", metavar="SPEC",
                                       help="Data for the check, its first batch traces the model when the checkpoint "
                                            "has no sample inputs. " + DATA_HELP),
    batches: Optional[int] = BATCHES_OPTION,
    batch_size: Optional[int] = BATCH_SIZE_OPTION,
    opset: Optional[int] = typer.Option(None, "--opset", metavar="N",
                                        help="ONNX opset (default: the lowest the points need, 13, or 21 with "
                                             "16-bit points)."),
    check: bool = typer.Option(True, "--check/--no-check",
                               help="Run the model in ONNX Runtime against the quantized stage (default on)."),
    fmt: Optional[str] = FORMAT_OPTION,
    as_json: bool = JSON_OPTION,
    out: Optional[Path] = OUT_OPTION,
    wide: bool = WIDE_OPTION,  # the convention's option: the summary has no table to widen
    model: Optional[str] = MODEL_OPTION,
    model_kwargs: Optional[str] = MODEL_KWARGS_OPTION,  # read through STATE by load_checkpoint
    unsafe_load: bool = UNSAFE_LOAD_OPTION,
    device: Optional[str] = DEVICE_OPTION,  # read through STATE by load_checkpoint and resolve_batches
) -> None:
    fmt = output_format(fmt, as_json)
    from qdebug.onnx.model_file import is_onnx_path, require

    if not is_onnx_path(output):
        raise QDebugError(f"output {output} does not end in .onnx", f"e.g. -o {Path(output).stem or 'model'}.onnx")
    writable_file(output)
    check_data(data, batches, batch_size)
    require("onnx")
    if check:
        require("onnxruntime")
    from qdebug.onnx.export import check_opset, export_onnx, input_tuple

    check_opset(opset)
    out = prepare_out(out)
    path = stage_path(checkpoint, "qat", "calibrated", what="QAT or calibrated")
    net, info = load_checkpoint(path, model=model, unsafe=unsafe_load, command="export")
    net = net.cpu()  # ONNX Runtime's CPU provider and the exporter run on the CPU
    check = check and info.stage != "float"  # a float model has no quantized stage to check against
    example = tuple(x.cpu() for x in input_tuple(_example_inputs(info, data, batches, batch_size)))

    from qdebug.data.batch import Batch

    with model_errors("exporting the model", Batch(example)):
        proto, exported = export_onnx(net, example, opset=opset, stage=info.stage)
    parity = _check(proto, net, info, data, batches, batch_size) if check else None
    with with_out(out):  # with --out: both appear, or neither
        _write(proto, output)
    row = _row(exported, parity, output)
    meta = {"source": path, "output": str(output), "stage": info.stage, "opset": exported["opset"],
            "inputs": exported["inputs"], "outputs": exported["outputs"], "float_points": exported["float_points"],
            "check": check, "gate_within_1_lsb": PARITY_GATE,
            "ort_disabled_optimizers": parity["disabled_optimizers"] if parity else [],
            "ort_kernels": parity["kernels"] if parity else {}, "ort_float_layers": parity["float_kernels"] if parity else []}
    failed = parity is not None and parity["within_1_lsb"] < PARITY_GATE
    # Runs as printed: the checkpoint (a stage of qdebug's) as the reference, the ONNX model beside it.
    run = RunOptions(model=model, model_kwargs=model_kwargs, unsafe_load=unsafe_load, device=device, data=data,
                     batches=batches, batch_size=batch_size)
    meta["next"] = command_line("compare", path, output, options=[*run.data_options(), *run.model_options()]) \
        if parity is not None else ""

    def render() -> None:
        for line in _summary(row, parity, exported, meta["next"]):
            say(line)

    import pandas as pd

    emit(Report("export", pd.DataFrame([row]), meta), fmt, out, render)
    note(f"wrote {output} (stage {info.stage}, opset {exported['opset']}, {exported['points']} quant points)")
    if failed:
        note(f"check failed: {row['within_1_lsb']:.2%} of ONNX Runtime's output values lie within 1 LSB of the "
             f"quantized stage (< {PARITY_GATE:.0%}); docs/onnx.md says what can explain the rest")
        raise typer.Exit(1)


def _example_inputs(info, data: Optional[str], batches: Optional[int], batch_size: Optional[int]):
    """What the model is traced with: the checkpoint's sample inputs, else the first batch of --data."""
    from qdebug.data.spec import batches_from_inputs

    if info.sample_inputs is not None:
        return batches_from_inputs(info.sample_inputs, 1)[0].inputs
    found = resolve_batches(data, batches, info, batch_size=batch_size, required=False)
    if found is None or not found.count:
        raise QDebugError(f"{info.path} has no sample inputs to trace the model with",
                          "pass --data (its first batch is the example), e.g. --data random:1x3x224x224")
    return found[0].inputs


def _check(proto, net, info, data: Optional[str], batches: Optional[int], batch_size: Optional[int]) -> dict:
    """ONNX Runtime against the quantized stage on --data, else on the sample inputs."""
    from qdebug.engine import convert
    from qdebug.onnx.parity import export_parity

    batch_list = resolve_batches(data, batches, info, batch_size=batch_size)
    quantized = net if info.stage == "quantized" else convert(net)
    with progress_bar("checking in ONNX Runtime", batch_list.count) as advance, \
            model_errors("checking the exported model", batch_list):
        return export_parity(proto, quantized, (b.inputs for b in batch_list), progress=advance)


def _write(proto, output: Path) -> None:
    from qdebug.io.atomic import atomic_open

    with atomic_open(output, "wb") as fh:
        fh.write(proto.SerializeToString())


def _row(exported: dict, parity: Optional[dict], output: Path) -> dict:
    """The command's one row: the export's figures and the check's (docs/export.md)."""
    histogram = (parity or {}).get("histogram", {})
    return {
        "output": str(output), "stage": exported["stage"], "opset": exported["opset"], "points": exported["points"],
        "weights": exported["weights"], "activations": exported["activations"],
        "batches": parity["batches"] if parity else 0, "values": parity["values"] if parity else 0,
        "within_1_lsb": parity["within_1_lsb"] if parity else None, "max_lsb": parity["max_lsb"] if parity else None,
        "lsb_0": histogram.get("0"), "lsb_1": histogram.get("1"), "lsb_2": histogram.get("2"),
        "lsb_over_2": histogram.get(">2"), "equal": parity["equal"] if parity else None,
        "fixed_point_within_1_lsb": parity["fixed_point"]["within_1_lsb"] if parity else None,
        "fixed_point_max_lsb": parity["fixed_point"]["max_lsb"] if parity else None,
        "ort_int8": sum(k["int8"] for k in parity["kernels"].values()) if parity else None,
        "ort_float": sum(k["float"] for k in parity["kernels"].values()) if parity else None,
    }


def _summary(row: dict, parity: Optional[dict], exported: dict, next_command: str = "") -> list[str]:
    lines = [f"exported {row['points']} quant points ({row['weights']} weights, {row['activations']} activations) "
             f"at opset {row['opset']} to {row['output']}"]
    if exported["float_points"]:
        lines.append(f"{len(exported['float_points'])} point(s) left in float mode have no QDQ: "
                     + ", ".join(exported["float_points"][:5]) + (" ..." if len(exported["float_points"]) > 5 else ""))
    if parity is None:
        lines.append("not checked in ONNX Runtime" + (" (a float model)" if row["stage"] == "float" else ""))
        return lines
    lines.append(f"ONNX Runtime vs qdebug's quantized stage in ONNX Runtime's arithmetic, {row['values']} "
                 f"output values ({row['batches']} batch(es)): {row['equal']:.2%} equal, {row['within_1_lsb']:.2%} "
                 f"within 1 LSB, max {row['max_lsb']:g} LSB (0: {row['lsb_0']}, 1: {row['lsb_1']}, 2: "
                 f"{row['lsb_2']}, >2: {row['lsb_over_2']})")
    lines.append(f"in fixed-point arithmetic (convert's default): {row['fixed_point_within_1_lsb']:.2%} within 1 "
                 f"LSB, max {row['fixed_point_max_lsb']:g} LSB")
    lines.extend(_kernel_lines(parity))
    if parity["disabled_optimizers"]:
        lines.append(f"ONNX Runtime loads it only without its {', '.join(parity['disabled_optimizers'])} (an ONNX "
                     "Runtime bug at opset 21 with int8 points, docs/onnx.md): pass disabled_optimizers=[...] to "
                     "InferenceSession where you deploy it")
    if next_command:
        lines += ["next: the deployed model beside the stage it came from, layer by layer:", f"  {next_command}"]
    return lines


def _kernel_lines(parity: dict) -> list[str]:
    """What ONNX Runtime runs as int8 kernels, per op, and the layers it leaves in float."""
    kernels = parity["kernels"]
    if not kernels:
        return []
    counts = ", ".join(f"{k['int8']}/{k['int8'] + k['float']} {op}" for op, k in kernels.items())
    lines = [f"ONNX Runtime runs {counts} as int8 kernels"]
    left = parity["float_kernels"]
    if left:
        lines.append(f"in float ({len(left)}): " + ", ".join(left[:4]) + (" ..." if len(left) > 4 else "")
                     + " (docs/onnx.md#export says why)")
    return lines
