"""``qdebug calibrate``: float checkpoint + data -> calibrated checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from qdebug.checkpoint import save
from qdebug.cli.app import app
from qdebug.cli.common import (
    BATCHES_OPTION, BATCH_SIZE_OPTION, MODEL_OPTION, UNSAFE_LOAD_OPTION,
    STATE, console, load_checkpoint, load_qconfig_file, model_errors, print_json, progress_bar, resolve_batches, writable_file,
    stage_path,
)
from qdebug.engine import QConfig, calibrate as run_calibration, prepare
from qdebug.engine.spec import OBSERVERS
from qdebug.errors import QDebugError
from qdebug.tools.inspect import inspect_model
from qdebug.report.output import to_json
from qdebug.report.table import render_table

SAMPLE_INPUTS = 8  # samples of the first batch stored in the checkpoint for later tools


def merge_tables(base: dict, update: dict) -> dict:
    """Deep merge: the --qconfig file refines the config's qconfig key by key."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_tables(merged[key], value)
        else:
            merged[key] = value
    return merged


def build_qconfig(qconfig_file: Optional[Path], observer: Optional[str], per_channel: Optional[bool],
                  bits: Optional[int]) -> QConfig:
    data = merge_tables(STATE.config().get("qconfig") or {}, load_qconfig_file(qconfig_file))
    qcfg = QConfig.from_dict(data)
    if observer is not None:
        if observer not in OBSERVERS:
            raise QDebugError(f"unknown observer {observer!r}", f"choose one of {', '.join(OBSERVERS)}")
        qcfg = QConfig(qcfg.weight, qcfg.activation.replace(observer=observer), qcfg.overrides)
    if per_channel is not None:
        qcfg = QConfig(qcfg.weight.replace(per_channel=per_channel), qcfg.activation, qcfg.overrides)
    if bits is not None:
        qcfg = QConfig(qcfg.weight.replace(bits=bits), qcfg.activation.replace(bits=bits), qcfg.overrides)
    return qcfg


def _first_samples(inputs):
    import torch

    if isinstance(inputs, torch.Tensor):
        return inputs[:SAMPLE_INPUTS].clone()
    if isinstance(inputs, (tuple, list)):
        return tuple(_first_samples(x) for x in inputs)
    if isinstance(inputs, dict):
        return {k: _first_samples(v) for k, v in inputs.items()}
    return inputs


@app.command(
    help=(
        "Calibrate a float checkpoint: prepare it with a qconfig, run the data through every "
        "observer, freeze the scales and write a calibrated checkpoint.\n\n"
        "Example: qdebug calibrate fixtures/demo/float.pt --data fixtures/demo/eval.pt --batches 8 "
        "--observer percentile --out calibrated.pt"
    )
)
def calibrate(
    checkpoint: Optional[str] = typer.Argument(None, help="Float checkpoint (default: the config's float)."),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the calibrated checkpoint."),
    data: Optional[str] = typer.Option(None, "--data", help="Calibration data: .pt file, package.module:function or random:NxCxHxW."),
    batches: Optional[int] = BATCHES_OPTION,
    batch_size: Optional[int] = BATCH_SIZE_OPTION,
    observer: Optional[str] = typer.Option(None, "--observer", help=f"Activation observer: {', '.join(OBSERVERS)}."),
    per_channel: Optional[bool] = typer.Option(None, "--per-channel/--per-tensor", help="Weight granularity (default per-channel)."),
    bits: Optional[int] = typer.Option(None, "--bits", help="Bit width of weights and activations (2-16)."),
    qconfig: Optional[Path] = typer.Option(None, "--qconfig", help="QConfig file (JSON or TOML: weight, activation, overrides)."),
    mode: Optional[str] = typer.Option(None, "--mode", help="QAT mode: fuse_bn, with_bn, with_bn_reverse_fold."),
    model: Optional[str] = MODEL_OPTION,
    unsafe_load: bool = UNSAFE_LOAD_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print the per-layer table as JSON."),
) -> None:
    writable_file(out)
    path = stage_path(checkpoint, "float", what="float")
    net, info = load_checkpoint(path, model=model, unsafe=unsafe_load, expect=("float",), command="calibrate")
    batch_list = resolve_batches(data, batches, info, batch_size=batch_size)
    qcfg = build_qconfig(qconfig, observer, per_channel, bits)
    qat_mode = mode or STATE.config().get("mode") or "fuse_bn"
    with model_errors("tracing the model", batch_list[0]):
        qm = prepare(net, qcfg, mode=qat_mode, example_inputs=batch_list[0].inputs)
    with progress_bar("calibrating", len(batch_list)) as advance, model_errors("calibrating", batch_list[0]):
        run_calibration(qm, [b.inputs for b in batch_list], progress=advance)
    save(qm, out, stage="calibrated", model_spec=info.model, sample_inputs=_first_samples(batch_list[0].inputs),
         meta={"calibration_batches": len(batch_list), "source": str(path)})
    result = inspect_model(qm, stage="calibrated")
    meta = {**result.meta, "out": str(out), "batches": len(batch_list), "qconfig": qcfg.to_dict()}
    if as_json:
        print_json(to_json(result.layers, meta))
        return
    console.print(render_table(result.layers, title=f"calibrated on {len(batch_list)} batch(es)"))
    console.print(f"wrote {out} (stage calibrated, {meta['quant_points']} quant points, qat mode {qat_mode})")
