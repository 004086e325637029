"""``qdebug calibrate``: float checkpoint + data -> calibrated checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from qdebug import vocab
from qdebug.cli.registry import command
from qdebug.cli.common import (
    BATCHES_OPTION, BATCH_SIZE_OPTION, DATA_HELP, DEVICE_OPTION, MODEL_KWARGS_OPTION, MODEL_OPTION, UNSAFE_LOAD_OPTION,
    STATE, check_data, load_checkpoint, load_qconfig_file, model_errors, progress_bar, resolve_batches, stage_path, writable_file,
)
from qdebug.cli.inspect import render_layers
from qdebug.cli.output import (
    CHECKPOINT_OUTPUT_OPTION, FORMAT_OPTION, JSON_OPTION, OUT_OPTION, WIDE_OPTION, Report, emit, note, output_format,
    prepare_out, print_table, say, table_width, with_out,
)
from qdebug.config.distributed import is_rank_zero
from qdebug.errors import QDebugError

SAMPLE_INPUTS = 8  # samples of the first batch stored in the checkpoint for later tools
# The qconfig's options: calibrate's, and every command that calibrates on the way (fix).
OBSERVER_OPTION = typer.Option(None, "--observer", metavar="NAME",
                               help=f"Activation observer: {', '.join(vocab.OBSERVERS)}.")
PER_CHANNEL_OPTION = typer.Option(None, "--per-channel/--per-tensor", show_default=False,
                                  help="Weight granularity (default per-channel).")
BITS_OPTION = typer.Option(None, "--bits", metavar="N", help="Bit width of weights and activations (2-16).")
QCONFIG_OPTION = typer.Option(None, "--qconfig", metavar="FILE",
                              help="QConfig file (JSON or TOML: weight, activation, overrides).")
MODE_OPTION = typer.Option(None, "--mode", metavar="MODE", help=f"QAT mode: {', '.join(vocab.QAT_MODES)}.")
LIKE_OPTION = typer.Option(None, "--like", metavar="CKPT",
                           help="Start from the qconfig and QAT mode of this calibrated, QAT or quantized checkpoint "
                                "(the other qconfig options refine it).")


def like_settings(like: Optional[str], *, model: Optional[str], unsafe: bool, command: str):
    """(qconfig dict, QAT mode) of the --like checkpoint, or (None, None) without one."""
    if like is None:
        return None, None
    _, info = load_checkpoint(like, model=model, unsafe=unsafe, expect=("calibrated", "qat", "quantized"),
                              command=f"{command} --like")
    if info.qconfig is None:
        raise QDebugError(f"{like} holds no qconfig (not written by qdebug calibrate, convert or import)",
                          "give a checkpoint qdebug wrote, or the qconfig options (--qconfig, --per-tensor...)")
    return info.qconfig.to_dict(), info.qat_mode


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
                  bits: Optional[int], like: Optional[dict] = None):
    """The qconfig of a run: ``like`` (a checkpoint's, --like) or the config's ``qconfig``, refined
    by the --qconfig file, then by --observer, --per-channel/--per-tensor and --bits."""
    from qdebug.engine import QConfig

    base = like if like is not None else STATE.config().get("qconfig") or {}
    data = merge_tables(base, load_qconfig_file(qconfig_file))
    qcfg = QConfig.from_dict(data)
    if observer is not None:  # checked by the command before any loading
        qcfg = QConfig(qcfg.weight, qcfg.activation.replace(observer=observer), qcfg.overrides)
    if per_channel is not None:
        qcfg = QConfig(qcfg.weight.replace(per_channel=per_channel), qcfg.activation, qcfg.overrides)
    if bits is not None:
        qcfg = QConfig(qcfg.weight.replace(bits=bits), qcfg.activation.replace(bits=bits), qcfg.overrides)
    return qcfg


def check_qconfig_options(observer: Optional[str], bits: Optional[int], mode: Optional[str]) -> None:
    """The qconfig's command-line options, checked before torch loads (calibrate's, and fix's)."""
    if observer is not None and observer not in vocab.OBSERVERS:
        raise QDebugError(f"unknown observer {observer!r}", f"choose one of {', '.join(vocab.OBSERVERS)}")
    if bits is not None and not 2 <= bits <= 16:
        raise QDebugError(f"--bits {bits} is outside 2-16", "e.g. --bits 8 (or 16 for int16)")
    if mode is not None and mode not in vocab.QAT_MODES:
        raise QDebugError(f"unknown QAT mode {mode!r}", f"choose one of {', '.join(vocab.QAT_MODES)}")


def _check_mergeable(qcfg) -> None:
    """Under torchrun every rank observes its own batches and the observers merge: the ema
    observer's range depends on the order of all batches, so it cannot be split."""
    from qdebug.config.distributed import environment

    if environment()[1] == 1:
        return
    asked = [qcfg.activation.observer] + [(entry.get("activation") or {}).get("observer")
                                          for entry in qcfg.overrides.values()]
    if "ema" in asked:
        raise QDebugError("the ema observer cannot be calibrated over several ranks: its range depends on the "
                          "order of all batches", "use --observer minmax, percentile, mse or kl, or run one process")


def _first_samples(inputs):
    import torch

    if isinstance(inputs, torch.Tensor):
        return inputs[:SAMPLE_INPUTS].clone()
    if isinstance(inputs, (tuple, list)):
        return tuple(_first_samples(x) for x in inputs)
    if isinstance(inputs, dict):
        return {k: _first_samples(v) for k, v in inputs.items()}
    return inputs


@command(
    short_help="Calibrate a float checkpoint with any observer, bit width or overrides.",
    help=(
        "Calibrate the FLOAT checkpoint (default: the config's float): prepare it with a qconfig, run the "
        "data through every "
        "observer, freeze the scales and write a calibrated checkpoint.\n\n"
        "Example: qdebug calibrate fixtures/demo/float.pt --data fixtures/demo/eval.pt --batches 8 "
        "--observer percentile -o calibrated.pt\n\n"
        "Example: qdebug calibrate fixtures/demo/float.pt --data fixtures/demo/eval.pt --device cuda -o "
        "calibrated.pt (the file holds CPU tensors, whatever the device)\n\n"
        "Example: qdebug calibrate fixed_float.pt --like fixtures/demo/calibrated.pt --data fixtures/demo/eval.pt "
        "-o calibrated_fixed.pt (the demo's qconfig and QAT mode)"
    )
)
def calibrate(
    checkpoint: Optional[str] = typer.Argument(None, metavar="FLOAT", hidden=True),
    output: Path = CHECKPOINT_OUTPUT_OPTION,
    data: Optional[str] = typer.Option(None, "--data", metavar="SPEC", help="Calibration data. " + DATA_HELP),
    batches: Optional[int] = BATCHES_OPTION,
    batch_size: Optional[int] = BATCH_SIZE_OPTION,
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
    writable_file(output)
    out = prepare_out(out)
    path = stage_path(checkpoint, "float", what="float")
    like_qconfig, like_mode = like_settings(like, model=model, unsafe=unsafe_load, command="calibrate")
    qcfg = build_qconfig(qconfig, observer, per_channel, bits, like_qconfig)  # a bad --qconfig: before loading
    _check_mergeable(qcfg)
    net, info = load_checkpoint(path, model=model, unsafe=unsafe_load, expect=("float",), command="calibrate")
    batch_list = resolve_batches(data, batches, info, batch_size=batch_size)
    qat_mode = mode or like_mode or STATE.config().get("mode") or "fuse_bn"

    from qdebug.checkpoint import save
    from qdebug.engine import calibrate as run_calibration, prepare
    from qdebug.tools.calibration_check import CLIPPING, LOW_SQNR_DB, check_calibration
    from qdebug.tools.inspect import inspect_model

    first = batch_list[0]  # the one batch kept: the example to trace and the samples stored
    with model_errors("tracing the model", first):
        qm = prepare(net, qcfg, mode=qat_mode, example_inputs=first.inputs)
    with progress_bar("calibrating", batch_list.count) as advance, model_errors("calibrating", batch_list):
        run_calibration(qm, (b.inputs for b in batch_list), progress=advance)  # lazily: one batch at a time
    if is_rank_zero():  # under torchrun rank 0 alone writes (every rank froze the same scales)
        with with_out(out):  # with --out: both appear, or neither
            save(qm, output, stage="calibrated", model_spec=info.model, sample_inputs=_first_samples(first.inputs),
                 meta={"calibration_batches": len(batch_list), "source": str(path)})
    result = inspect_model(qm, stage="calibrated")
    with progress_bar("checking", None), model_errors("checking the calibrated model", batch_list):
        check = check_calibration(qm, (b.inputs for b in batch_list))
    meta = {**result.meta, "output": str(output), "batches": len(batch_list), "qconfig": qcfg.to_dict(),
            "output_sqnr_db": check.sqnr_db, "clipping": check.clipping}
    summary = _check_lines(check, len(batch_list))

    def render() -> None:
        print_table(render_layers(result.layers, title=f"calibrated on {len(batch_list)} batch(es)",
                                  width=table_width(wide)))
        for line in summary:
            say(line)

    emit(Report("calibrate", result.layers, meta), fmt, out, render)
    note(f"wrote {output} (stage calibrated, {meta['quant_points']} quant points, qat mode {qat_mode})")
    if check.low:
        worst = ", ".join(f"{c['point']} ({c['clipped']:.0%} clipped)" for c in check.clipping[:3])
        note(f"warning: the calibrated model's output SQNR against float is {check.sqnr_db:.1f} dB (< {LOW_SQNR_DB:g}): "
             f"it no longer computes its float function; "
             + (f"worst points: {worst}; try another --observer (minmax, percentile, mse)" if worst else
                f"no point clips more than {CLIPPING:.0%}: qdebug compare {path} {output} says where the error enters"))


def _check_lines(check, batches: int) -> list[str]:
    """The calibration check as the table view's last lines."""
    from qdebug.tools.calibration_check import CLIPPING

    lines = [f"output SQNR vs float: {check.sqnr_db:.2f} dB over {batches} batch(es)"]
    if check.clipping:
        shown = ", ".join(f"{c['point']} {c['clipped']:.1%}" for c in check.clipping[:8])
        more = f" (+{len(check.clipping) - 8} more)" if len(check.clipping) > 8 else ""
        lines.append(f"points clipping more than {CLIPPING:.0%} of their values: {shown}{more}")
    else:
        lines.append(f"no point clips more than {CLIPPING:.0%} of its values")
    return lines
