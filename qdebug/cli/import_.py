"""``qdebug import``: a torch.ao prepared (or converted) model's state_dict, or an ONNX model ONNX
Runtime quantized (QDQ), -> a qdebug checkpoint.

Reads tensors only (``qdebug.interop.state_dict``): torch rebuilds the prepared model (or the
converted one, from a state_dict of torch's int8 modules) from the user's float class
(``--model``), ``qdebug.interop.from_torch_ao`` imports it, and the engine model is saved as an
ordinary qat, calibrated or quantized checkpoint with its import report (printed here, kept in
the file's meta, shown by ``qdebug inspect``).  ``--from onnx-qdq`` reads an ONNX file (only through
``qdebug.onnx.model_file.read_onnx``) with ``qdebug.onnx.qdq_source``: a quantized checkpoint,
checked against ONNX Runtime's own run of the file.  See docs/interop.md and docs/onnx.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from qdebug.cli.registry import command
from qdebug.cli.common import (
    STATE, DATA_HELP, MODEL_KWARGS_OPTION, check_data, model_errors, resolve_batches, user_model_kwargs, writable_file,
)
from qdebug.cli.inspect import render_import
from qdebug.cli.output import (
    CHECKPOINT_OUTPUT_OPTION, FORMAT_OPTION, JSON_OPTION, OUT_OPTION, WIDE_OPTION, Report, emit, note, output_format,
    prepare_out, print_table, say, table_width, with_out,
)
from qdebug.errors import QDebugError
from qdebug.safe_text import escaped

SOURCES = ("torch-ao", "onnx-qdq")
BACKENDS = ("x86", "fbgemm", "qnnpack", "onednn")  # qdebug.interop.state_dict.BACKENDS, said before torch loads
QAT_MODES = ("with_bn_reverse_fold", "fuse_bn")  # how torch's Conv-BN modules map (from_torch_ao's qat_mode)


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise QDebugError(f"{flag} {value!r} is not one of {', '.join(choices)}", f"e.g. {flag} {choices[0]}")


def _model_target(model: Optional[str]) -> str:
    """--model, else the config's model, checked for its form before torch loads."""
    target = model or STATE.config().get("model")
    if not target:
        raise QDebugError("qdebug import needs the float model's class: a state_dict does not name it",
                          "pass --model package.module:Class (or set model = ... in qdebug.toml)")
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise QDebugError(f"--model {target!r} is not of the form package.module:Name", "e.g. --model mypkg.net:Net")
    return target


@command(
    "import",
    short_help="A torch.ao QAT, PTQ or converted model's state_dict as a qdebug checkpoint.",
    help=(
        "Import SRC, the state_dict of a model prepared by torch.ao (eager prepare_qat/prepare, FX "
        "prepare_qat_fx/prepare_fx), as a qdebug checkpoint: qat for QAT, calibrated for PTQ; or of a model "
        "torch.ao converted to its int8 modules (eager convert, convert_fx): quantized, qdebug's integer "
        "simulation of torch's kernels. Only tensors are "
        "read; torch rebuilds the prepared (or converted) model from your float class (--model) and --backend's "
        "default qconfig, the file must load into it exactly, and the imported model computes what torch's does "
        "(bit-identical for QAT, in eval mode). Prints the import report: every torch quantizer, the engine "
        "point it became and how (exact, moved, frozen, approximate, unmapped), the points left float, and the "
        "import's check of itself against torch's model on the first batch (an unexplained mismatch is refused). "
        "Exit 1 with --strict when a quantizer is unmapped (the checkpoint is written all the same). "
        "See docs/interop.md.\n\n"
        "Example: qdebug import qat_state.pt --from torch-ao --model mypkg.net:Net --data eval.pt -o qat.pt\n\n"
        "Example: qdebug import converted_state.pt --from torch-ao --model mypkg.net:Net --data eval.pt "
        "--backend x86 -o q.pt (torch.save(converted.state_dict(), ...) after convert)\n\n"
        "Example: qdebug import model_int8.onnx --from onnx-qdq --model mypkg.net:Net --data eval.pt -o ort.pt "
        "(an ONNX model onnxruntime's quantize_static made, QDQ format: a quantized checkpoint, checked against "
        "ONNX Runtime's own run of the file)\n\n"
        "Example: qdebug compare float.pt qat.pt --data eval.pt (the imported checkpoint, like any other)"
    ),
)
def import_(
    src: str = typer.Argument(..., metavar="SRC", hidden=True, show_default=False,
                              help="The prepared or converted model's state_dict (torch.save(m.state_dict()))."),
    source: str = typer.Option(..., "--from", metavar="torch-ao|onnx-qdq",
                               help="What made SRC: torch-ao (a state_dict), onnx-qdq (an .onnx file ONNX Runtime's "
                               "quantize_static made in QDQ format from torch.onnx.export of --model)."),
    model: Optional[str] = typer.Option(None, "--model", metavar="PKG.MODULE:CLASS",
                                        help="Your float model's class or factory (default: the config's model; "
                                        "its kwargs: --model-kwargs, else the config's model_kwargs)."),
    model_kwargs: Optional[str] = MODEL_KWARGS_OPTION,  # read through STATE by user_model_kwargs
    data: Optional[str] = typer.Option(None, "--data", metavar="SPEC",
                                       help="Example inputs to trace the model (its first batch). " + DATA_HELP),
    backend: str = typer.Option("x86", "--backend", metavar="x86|fbgemm|qnnpack|onednn",
                                help="The backend whose default qconfig prepared SRC (a PTQ file does not record "
                                "it: give the one you used)."),
    qat_mode: str = typer.Option("with_bn_reverse_fold", "--qat-mode", metavar="with_bn_reverse_fold|fuse_bn",
                                 help="How torch's Conv-BN modules map: with_bn_reverse_fold is torch's own scheme "
                                 "(bit-identical); fuse_bn folds them (equal within float rounding)."),
    output: Path = CHECKPOINT_OUTPUT_OPTION,
    strict: bool = typer.Option(False, "--strict", help="Exit 1 when a quantizer of SRC is unmapped."),
    fmt: Optional[str] = FORMAT_OPTION,
    as_json: bool = JSON_OPTION,
    out: Optional[Path] = OUT_OPTION,
    wide: bool = WIDE_OPTION,
) -> None:
    fmt = output_format(fmt, as_json)
    _choice("--from", source, SOURCES)
    _choice("--backend", backend, BACKENDS)
    _choice("--qat-mode", qat_mode, QAT_MODES)
    target = _model_target(model)
    if not (data or STATE.config().get("data")):
        raise QDebugError("qdebug import needs example inputs to trace the model",
                          "pass --data (a .pt file, package.module:function or random:8x3x224x224)")
    check_data(data, 1, None)
    writable_file(output)
    out = prepare_out(out)
    if not Path(src).exists():  # said before torch loads: a typo answers at once
        raise QDebugError(f"no such file: {src}", "check the path")

    if source == "onnx-qdq":
        from qdebug.onnx.model_file import read_onnx

        proto = read_onnx(src)
        with with_out(out):
            frame, meta = _import_onnx(proto, src, target, data, output)
    else:
        from qdebug.interop.state_dict import read_state_dict

        state = read_state_dict(src)
        with with_out(out):  # with --out: both appear, or neither
            frame, meta = _import(state, src, target, data, backend, qat_mode, output)
    unmapped = meta["statuses"].get("unmapped", 0)
    onnx_flow = meta["flow"] == "onnx-qdq"
    kind = "QDQ" if onnx_flow else "converted" if meta["converted"] else "QAT" if meta["qat"] else "PTQ"

    def render() -> None:
        title = (f"{src}: ONNX Runtime {kind} -> {output}" if onnx_flow
                 else f"{src}: torch.ao {meta['flow']} {kind} ({backend}) -> {output}")
        print_table(render_import(frame, title=title, width=table_width(wide)))
        for line in _summary(meta):
            say(line)
        for line in _exceptions(frame):
            say(line)

    emit(Report("import", frame, meta), fmt, out, render)
    note(f"wrote {output} (stage {meta['stage']}, {meta['flow']} {kind} from {src})")
    if meta["factory"] and not _config_names(target):
        note(_factory_note(output, meta["model"]))
    if strict and unmapped:
        note(f"--strict: {unmapped} quantizer(s) of {src} are unmapped")
        raise typer.Exit(1)


def _config_names(target: str) -> bool:
    """Whether later commands build ``target`` with no flag: the config's model names it, with
    the config's kwargs (not --model-kwargs, which later commands do not see)."""
    return STATE.config().get("model") == target and STATE.model_kwargs_option is None


def _factory_note(output: Path, spec: dict) -> str:
    """What later commands need to build a checkpoint naming a factory: qdebug calls a function
    a file names only when the user names it (docs/checkpoints.md), so say how, once."""
    import json

    target, kwargs = spec["class"], spec["kwargs"]
    flags = f"--model {target}" + (f" --model-kwargs '{json.dumps(kwargs)}'" if kwargs else "")
    table = _toml(kwargs)
    config = "" if table is None else (
        f", or set model = \"{target}\"" + (f" and model_kwargs = {table}" if kwargs else "") + " in qdebug.toml")
    return f"{output} names the factory {target}, which qdebug calls only when you name it: pass {flags} " \
           f"to later commands{config}"


def _toml_key(key: str) -> str:
    import json
    import re

    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _toml(value) -> str | None:
    """A JSON-typed value as TOML (inline tables), or None when it holds a None: TOML has no null."""
    import json

    if value is None:
        return None
    if isinstance(value, (dict, list)):
        items = [(_toml_key(k) + " = ", v) for k, v in value.items()] if isinstance(value, dict) \
            else [("", v) for v in value]
        parts = [_toml(v) for _, v in items]
        if any(p is None for p in parts):
            return None
        inner = ", ".join(prefix + p for (prefix, _), p in zip(items, parts))
        return "{" + inner + "}" if isinstance(value, dict) else "[" + inner + "]"
    return json.dumps(value)


def _import(state: dict, src: str, target: str, data: Optional[str], backend: str, qat_mode: str, output: Path):
    """Rebuild, import and save; the report's frame and the command's meta."""
    import pandas as pd

    from qdebug.checkpoint import save
    from qdebug.cli.calibrate import _first_samples  # the samples a checkpoint keeps, as calibrate keeps them
    from qdebug.interop import from_torch_ao, import_check
    from qdebug.interop.build import REPORT_COLUMNS, import_report
    from qdebug.interop.state_dict import is_converted_state, rebuild, rebuild_converted
    from qdebug.io.modelspec import ModelSpec, build, is_model_class

    spec = ModelSpec(target, dict(user_model_kwargs() or {}))
    float_model = build(spec, from_user=True)
    first = resolve_batches(data, 1, None, announce=False)[0]
    # A converted model's state_dict (torch's int8 modules): torch converts the float model
    # again and the file loads into it; the import is then qdebug's integer simulation of it.
    remake = rebuild_converted if is_converted_state(state) else rebuild
    with model_errors("rebuilding the torch.ao model", first):
        rebuilt = remake(state, float_model, first.inputs, backend, source=src)
    with model_errors("importing the torch.ao model", first):
        qm = from_torch_ao(rebuilt.prepared, first.inputs, qat_mode=qat_mode,
                           float_model=rebuilt.float_model if rebuilt.flow != "eager" else None)
    stage = "quantized" if rebuilt.converted else "qat" if rebuilt.qat else "calibrated"
    check = import_check(qm)
    save(qm, output, stage=stage, model_spec=spec, sample_inputs=_first_samples(first.inputs),
         meta={"source": str(src), "import_backend": backend, "import_fusions": rebuilt.fusions,
               "import_check": check})
    frame = pd.DataFrame(import_report(qm), columns=REPORT_COLUMNS)
    quantizers = frame[(frame["source"] != "") & (frame["kind"] != "bn")]
    meta = {"source": str(src), "output": str(output), "stage": stage, "flow": rebuilt.flow, "qat": rebuilt.qat,
            "converted": rebuilt.converted,
            "backend": backend, "qat_mode": qat_mode, "model": spec.to_dict(), "factory": not is_model_class(target),
            "fusions": rebuilt.fusions,
            "quantizers": len(quantizers),
            "statuses": {str(k): int(v) for k, v in quantizers["status"].value_counts().items()},
            "float_points": int((frame["status"] == "float").sum()), "check": check,
            "folded_bn": [str(s) for s in frame.loc[frame["kind"] == "bn", "source"]]}
    return frame, meta


def _import_onnx(proto, src: str, target: str, data: Optional[str], output: Path):
    """Import an ORT-quantized QDQ model and save it (a quantized checkpoint); the report's frame and
    the command's meta (the torch.ao import's keys, backend and fusions empty)."""
    import pandas as pd

    from qdebug.checkpoint import save
    from qdebug.cli.calibrate import _first_samples
    from qdebug.engine import engine_state
    from qdebug.interop import import_check
    from qdebug.interop.build import REPORT_COLUMNS, import_report
    from qdebug.io.modelspec import ModelSpec, build, is_model_class
    from qdebug.onnx.qdq_import import import_qdq
    from qdebug.onnx.qdq_source import FLOW, NODES_ATTR

    spec = ModelSpec(target, dict(user_model_kwargs() or {}))
    float_model = build(spec, from_user=True)
    first = resolve_batches(data, 1, None, announce=False)[0]
    with model_errors("importing the ONNX model", first):
        qm = import_qdq(proto, float_model, first.inputs)
    check = import_check(qm)
    save(qm, output, stage="quantized", model_spec=spec, sample_inputs=_first_samples(first.inputs),
         meta={"source": str(src), "import_check": check,
               NODES_ATTR: getattr(engine_state(qm), NODES_ATTR, {})})  # suggest --to onnxruntime reads it
    frame = pd.DataFrame(import_report(qm), columns=REPORT_COLUMNS)
    quantizers = frame[(frame["source"] != "") & (frame["kind"] != "bn")]
    meta = {"source": str(src), "output": str(output), "stage": "quantized", "flow": FLOW, "qat": False,
            "converted": True, "backend": None, "qat_mode": None, "model": spec.to_dict(),
            "factory": not is_model_class(target), "fusions": [], "quantizers": len(quantizers),
            "statuses": {str(k): int(v) for k, v in quantizers["status"].value_counts().items()},
            "float_points": int((frame["status"] == "float").sum()), "check": check,
            "folded_bn": [str(s) for s in frame.loc[frame["kind"] == "bn", "source"]]}
    return frame, meta


def _exceptions(frame) -> list[str]:
    """What did not map as torch has it, said under the table whatever its width: every
    unmapped quantizer with its reason, frozen ones once per reason."""
    lines = []
    for row in frame[frame["status"] == "unmapped"].itertuples():
        lines.append(f"unmapped: {row.source} ({row.kind}): {row.note}")
    frozen = frame[frame["status"] == "frozen"]
    for reason, group in frozen.groupby("note", sort=False):
        lines.append(f"frozen: {len(group)} quantizer(s), e.g. {group['source'].iloc[0]}: {reason}")
    return lines


FUSIONS_SHOWN = 3  # fusions named under the table; JSON's meta.fusions has them all


def _summary(meta: dict) -> list[str]:
    """The lines under the table: the counts, then (a few of) the fusions found."""
    counts = meta["statuses"]
    shown = ", ".join(f"{n} {status}" for status, n in counts.items())
    who = "ONNX Runtime" if meta["flow"] == "onnx-qdq" else "torch"
    lines = [f"{meta['quantizers']} {who} quantizer(s): {shown or 'none'}"]
    if meta["float_points"]:
        lines.append(f"{meta['float_points']} engine point(s) left float, as in {who}")
    if meta["folded_bn"]:
        lines.append(f"{len(meta['folded_bn'])} BatchNorm(s) torch{'.onnx.export' if who != 'torch' else ''} "
                     "folded into their convs")
    if meta.get("check"):
        lines += check_lines(meta["check"])
    fusions = meta["fusions"]
    if fusions:
        more = f", the first {FUSIONS_SHOWN} (--format json: all)" if len(fusions) > FUSIONS_SHOWN else ""
        lines.append(f"fused as torch did: {len(fusions)} group(s){more}")
        lines += [f"  {' + '.join(group)}" for group in fusions[:FUSIONS_SHOWN]]
    if meta.get("converted") and meta["flow"] == "eager":
        lines += CONVERTED_RELU_NOTE
    return lines


# torch's ConvReLU2d (LinearReLU) saves the keys of a Conv2d (Linear): what decides (docs/interop.md).
CONVERTED_RELU_NOTE = [
    "a ReLU after a converted conv or linear is taken as fused where that layer's",
    "  output zero point is 0 (the keys cannot say; on such a grid both compute the same)",
]


def check_lines(check: dict) -> list[str]:
    """The import's self-check (qdebug.interop.check), in lines of at most 80 columns: against
    what, the measured difference, the tolerance."""
    against = {"fake-quant": "torch's model (eval, observers off)",
               "ptq": "torch's reference conversion of it",
               "converted": "torch's converted model",
               "quantizer qparams": "torch's observers' qparams",
               "onnxruntime": "ONNX Runtime's run of the file"}.get(check.get("compared_with"), "torch")
    if check.get("max_abs_diff") is None:
        measured = "equal" if check.get("within_tolerance") else "not equal"
    elif check["max_abs_diff"] == 0:
        measured = "bit-identical outputs"
    else:
        lsb = f" ({check['max_lsb']:g} output LSB)" if check.get("max_lsb") is not None else ""
        measured = f"outputs differ by up to {check['max_abs_diff']:.3g}{lsb}"
    verdict = "within" if check.get("within_tolerance") else "beyond"
    lines = [f"checked on the first batch against {against}:", f"  {measured}, {verdict} the tolerance",
             f"  (tolerance: {check.get('tolerance')})"]
    if check.get("within_1_lsb") is not None:
        lines.append(f"  {100 * check['within_1_lsb']:.2f}% of output values within 1 LSB")
    if check.get("rows_checked"):
        lines.append(f"  {check['rows_checked']} row(s) checked against its codes: mean difference at most "
                     f"{check['rows_max_mean_codes']:g}")
    floats = check.get("ort_float_layers") or []
    if floats:  # ORT could not fuse them: simulated as it runs them (docs/onnx.md)
        shown = ", ".join(escaped(c) for c in floats[:4]) + (" ..." if len(floats) > 4 else "")
        lines.append(f"  ONNX Runtime runs {len(floats)} layer(s) in float, simulated so: {shown}")
    rows = check.get("rows_differing") or []
    if rows:
        theirs = "ONNX Runtime's" if check.get("compared_with") == "onnxruntime" else "torch's"
        lines.append(f"  {len(rows)} row(s) approximate: their values differ from {theirs}")
    return lines
