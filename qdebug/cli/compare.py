"""``qdebug compare``: per-layer similarity of checkpoints of one model, any stages."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable, List, Optional

import typer

from qdebug import vocab
from qdebug.cli.registry import command
from qdebug.cli.common import (
    BATCHES_OPTION, BATCH_SIZE_OPTION, DATA_HELP, DEVICE_OPTION, MODEL_KWARGS_OPTION, MODEL_OPTION, UNSAFE_LOAD_OPTION,
    STATE, RunOptions, check_data, command_line, config_checkpoints, err_console, load_checkpoint, model_errors,
    option_text, progress_bar, resolve_batches,
)
from qdebug.cli.output import (
    FORMAT_OPTION, JSON_OPTION, OUT_OPTION, WIDE_OPTION, Report, emit, output_format, prepare_out, print_table, say,
    table_width,
)
from qdebug.config.project import DEBUG_ORDER
from qdebug.errors import QDebugError
from qdebug.safe_text import escaped

if TYPE_CHECKING:
    import pandas as pd

    from qdebug.io.staged import StagedDir

HISTOGRAM_LAYERS = 4
METRICS = vocab.COMPARE_METRICS
DEFAULT_SHOW = vocab.COMPARE_DEFAULT_SHOW


def _labels(infos, paths: list[str]) -> list[str]:
    stages = [info.stage for info in infos]
    labels = []
    for stage, path in zip(stages, paths):
        label = stage if stages.count(stage) == 1 else Path(path).stem
        while label in labels:
            label += "'"
        labels.append(label)
    return labels


def parse_thresholds(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise QDebugError(f"--threshold {item!r} is not METRIC=VALUE", "e.g. --threshold sqnr_db=25")
        if name not in METRICS:
            raise QDebugError(f"unknown threshold metric {name!r}", f"choose from {', '.join(METRICS)}")
        try:
            out[name] = float(value)
        except ValueError:
            raise QDebugError(f"--threshold {item!r}: {value!r} is not a number", "e.g. --threshold sqnr_db=25") from None
        if not math.isfinite(out[name]):  # nan flags nothing, inf everything: no threshold either way
            raise QDebugError(f"--threshold {item!r}: the value must be a finite number", "e.g. --threshold sqnr_db=25")
    return out


def parse_metrics(spec: Optional[str]) -> list[str]:
    if not spec:
        return list(DEFAULT_SHOW)
    names = [m.strip() for m in spec.split(",") if m.strip()]
    if not names:
        raise QDebugError(f"--metrics {spec!r} names no metric", f"e.g. --metrics {','.join(DEFAULT_SHOW[:3])}, or all")
    if names == ["all"]:
        return list(METRICS)
    unknown = [m for m in names if m not in METRICS]
    if unknown:
        raise QDebugError(f"unknown metric(s): {', '.join(unknown)}", f"choose from {', '.join(METRICS)}, or 'all' alone")
    return names


def _short_note(note: str) -> str:
    if "BN folded" in note:
        return "BN folded: see " + note.rsplit("compared at ", 1)[-1]
    if "fused into its integer kernel" in note:
        return "ReLU fused: see " + note.rsplit("compared at ", 1)[-1]
    return note


def render_compare(frame: "pd.DataFrame", metrics: list[str], *, sort: Optional[str] = None, top: Optional[int] = None,
                   title: str | None = None, width: Optional[int] = None):
    """The table view: rows in execution order (or sorted), one per layer and compared model.

    Columns keep their names (the ones --metrics, --sort and JSON use).  At a given width
    the layer, the first metrics and the diagnosis come first; the rest go to --wide.
    """
    from qdebug.report.table import fixed, render_table

    several = frame["target"].nunique() > 1
    view = frame
    if sort:
        if sort not in view:
            raise QDebugError(f"cannot sort by {sort!r}", f"choose from {', '.join(METRICS)}")
        view = view.sort_values(sort, ascending=sort in vocab.COMPARE_LOWER_IS_WORSE, na_position="last")
    if top:
        view = view[view["note"] == ""].head(top)
    view = view.reset_index(drop=True)
    columns = ["layer", *(["target"] if several else []), *metrics, "diagnosis", "note", "type"]
    view = view[columns].copy()
    view["note"] = view["note"].map(_short_note)
    # A row with no numbers says why in the diagnosis cell, so the reason shows at 80 columns too.
    view["diagnosis"] = [d or (f"({n.split(':')[0]})" if n else "") for d, n in zip(view["diagnosis"], view["note"])]
    if several and not sort:  # a layer's name once, on its first row
        view["layer"] = [name if i == 0 or name != prev else "" for i, (name, prev) in
                         enumerate(zip(view["layer"], [None, *view["layer"][:-1]]))]
    formats = {m: fixed(6) for m in metrics if m.endswith("cosine")}
    formats.update({m: fixed(2) for m in metrics if m.endswith("_db")})
    priority = ["layer", "target", *metrics[:2], "diagnosis", *metrics[2:], "note", "type"]
    highlight = [i for i, v in enumerate(view["diagnosis"]) if v and not v.startswith("(")]
    return render_table(view, title=title, priority=priority, width=width, clip=("note",), formats=formats,
                        highlight=highlight)


def _next_command(result, labels: list[str], paths: list[str], ref_index: int, *, given: list[str],
                  options: str, sort: Optional[str], skip: tuple[str, ...] = (), model_options: str = "",
                  again: str = "", baseline_metric: str | Callable[[], str] = " --metric top1") -> tuple[str, str]:
    """(why, command): the next step of the debug flow, for the first compared model with a
    finding, written to run as printed (``qdebug.cli.common.command_line``).  ``given``: the
    checkpoints as typed (none when they came from the config); ``options``: the data and model
    options as typed (``RunOptions.text``), so the command runs on the same model and data;
    ``model_options``: the model's alone (for inspect); ``again``: compare's own options that
    shaped this run (--ref, --threshold, --torch-kernels), for compare again; ``baseline_metric``:
    baseline's --metric (empty when the config names one), or a function saying it (asked only
    when baseline is the next command); ``skip``: labels of models no command
    takes as a checkpoint (``--torch-kernels``' torch model)."""
    found = {target: item for target, item in result.meta["findings"].items() if target not in skip}
    compare_again = command_line("compare", *given) + options + again
    for target, item in found.items():
        if not item.get("flagged") or item.get("float_differs"):  # no quantization fix: its float model differs
            continue
        cause = item.get("at_fault_diagnosis")
        if cause == "nonfinite":
            return "look for non-finite weights and scales", command_line("inspect", paths[labels.index(target)]) + \
                model_options
        if cause == "clipping" and result.meta.get("reference_stage") == "float":
            return ("recalibrate with a range that clips less",
                    command_line("calibrate", paths[ref_index]) + options + " --observer percentile -o recalibrated.pt")
        if cause == "outlier_channels" and sort != "min_channel_sqnr_db":
            return "see the channels", (f"{compare_again} --metrics min_channel_sqnr_db,channel_range_ratio "
                                        "--sort min_channel_sqnr_db")
        if cause == "shared_scale" and result.meta.get("reference_stage") == "float":  # an old plan
            return ("prepare the float model again: one point per output tensor",
                    command_line("calibrate", paths[ref_index]) + options + " -o recalibrated.pt")
        # The pair as typed (none when it came from the config: suggest reads the same keys).
        suggest = command_line("suggest", *([paths[ref_index], paths[labels.index(target)]] if given else [])) + options
        if cause == "outlier_channels":  # the channels seen: which flagged layer costs the accuracy
            if result.meta.get("reference_stage") == "float":
                step = command_line("step", *([paths[ref_index], paths[labels.index(target)]] if given else []))
                return "which part costs the accuracy, down to the layer", step + options + " --drill"
            return "", ""
        # An int16 point is among the fixes of these (the cause line names the point and the rest).
        int16_fix = ("rounding", "cell_state_range", "softmax_collapse", "logits_clipped")
        if cause in int16_fix and result.meta.get("reference_stage") == "float":
            return "the smallest set of int16 changes that meets the target, verified", suggest
        if sort != "isolated_sqnr_db":
            return "each layer's own error, worst first (int16 candidates)", f"{compare_again} --sort isolated_sqnr_db"
        if result.meta.get("reference_stage") == "float":
            return "a verified int16 plan for the worst of these", suggest
        return "", ""
    target = next(iter(found), None)
    if target is None or result.meta.get("reference_stage") != "float":
        return "", ""  # baseline gates a checkpoint against its float model, and refuses any other order
    metric = baseline_metric() if callable(baseline_metric) else baseline_metric
    return ("check that the task metric holds",
            command_line("baseline", paths[ref_index], paths[labels.index(target)]) + metric + options)


FIXED_FLOAT = "fixed_float.pt"  # the fix command's output, as docs/fix.md names it


def fix_command(float_path: str, run: RunOptions, like: str | None = None) -> str:
    """``qdebug fix FLOAT --like CKPT --data SPEC -o fixed_float.pt`` (docs/fix.md) on the run's data
    and model options as typed, shell-quoted as a ``next:`` command; ``--like`` the diagnosed
    checkpoint (a stage qdebug wrote), so that the fix is proven with its qconfig; ``--data DATA``
    to fill in when the run had no data of its own (a checkpoint's few stored samples prove no
    fix).  compare's and suggest's pointer to the float-side fixes."""
    data = "" if run.data or STATE.config().get("data") else " --data DATA"
    return (command_line("fix", float_path) + option_text([("--like", like)]) + run.text() + data
            + f" -o {FIXED_FLOAT}")


def _fix_next(result, paths: list[str], labels: list[str], infos: list, ref_index: int, run: RunOptions) -> str:
    """The ``qdebug fix`` command for the float model when a compared model has layers diagnosed
    outlier_channels (``findings``' ``outlier_layers``; not a model whose own float model differs:
    its error is no quantization's), else "".  FLOAT: the reference when it is the float
    checkpoint, else the config's ``float``, else ``FLOAT.pt`` to fill in; ``--like`` the first
    such model when its checkpoint holds a qconfig."""
    flagged = [label for label, item in result.meta["findings"].items()
               if item.get("outlier_layers") and not item.get("float_differs")]
    if not flagged:
        return ""
    if result.meta.get("reference_stage") == "float":
        float_path = paths[ref_index]
    else:
        float_path = STATE.config().get("float") or "FLOAT.pt"
    index = labels.index(flagged[0]) if flagged[0] in labels else None
    like = paths[index] if index is not None and getattr(infos[index], "qconfig", None) is not None else None
    return fix_command(float_path, run, like)


@command(
    short_help="Where does the error enter, and why: per-layer error of two or more checkpoints.",
    help=(
        "Per-layer feature-map similarity of two or more CHECKPOINTs of one model in any stages (float, "
        "calibrated, QAT, quantized; default: the config's float and qat, else calibrated, else quantized), each against the least "
        "quantized one (or --ref): propagated and isolated error, SQNR, cosine, saturation, per-channel "
        "SQNR, and a diagnosis (clipping, rounding, outlier_channels, propagated, nonfinite; for recurrent layers, "
        "attention and norms: shared_scale, cell_state_range, softmax_collapse, logits_clipped, "
        "norm_input_outliers; float_differs when the compared model's own float model is not the reference) "
        "for flagged layers.\n\n"
        "Example: qdebug compare fixtures/demo/float.pt fixtures/demo/calibrated.pt fixtures/demo/quantized.pt "
        "--data fixtures/demo/eval.pt --batches 4 --out compare-out\n\n"
        "Example: qdebug compare fixtures/demo/float.pt fixtures/demo/qat.pt --metrics sqnr_db,kl --sort kl\n\n"
        "Example: qdebug compare fixtures/demo/float.pt fixtures/demo/quantized.pt --data fixtures/demo/eval.pt "
        "--device cuda (on the GPU; the same results as on the CPU, within float32 rounding)\n\n"
        "Example: qdebug compare float.pt q.pt --torch-kernels converted_state.pt --data eval.pt (q.pt: qdebug "
        "import of converted_state.pt; torch's own int8 kernels as one more model, 'torch')\n\n"
        "Example: qdebug compare fixtures/demo/float.pt fixtures/demo/qat.pt model.onnx --data fixtures/demo/eval.pt "
        "(a CHECKPOINT ending .onnx: that model run by ONNX Runtime, tapped per layer, as one more model, 'onnx'; "
        "propagated error only)"
    )
)
def compare(
    checkpoints: Optional[List[str]] = typer.Argument(None, metavar="CHECKPOINT", hidden=True),
    ref: Optional[str] = typer.Option(None, "--ref", metavar="LABEL|INDEX",
                                      help="Reference: a stage label or a 0-based index (default: the least quantized)."),
    data: Optional[str] = typer.Option(None, "--data", metavar="SPEC", help=DATA_HELP),
    batches: Optional[int] = BATCHES_OPTION,
    batch_size: Optional[int] = BATCH_SIZE_OPTION,
    metrics: Optional[str] = typer.Option(
        None, "--metrics", metavar="NAME[,NAME]",
        help=f"Metric columns, comma-separated, or 'all' (default: {', '.join(DEFAULT_SHOW)}). Naming kl also "
        "computes it for feature maps.",
    ),
    threshold: Optional[List[str]] = typer.Option(None, "--threshold", metavar="METRIC=VALUE",
                                                  help="Override a flag threshold, e.g. sqnr_db=25 (repeatable)."),
    sort: Optional[str] = typer.Option(None, "--sort", metavar="METRIC", help="Sort rows by this metric, worst first."),
    top: Optional[int] = typer.Option(None, "--top", metavar="N", help="Show only the first N measured rows."),
    isolated: bool = typer.Option(True, "--isolated/--no-isolated", help="Also measure each layer on the reference's input."),
    fmt: Optional[str] = FORMAT_OPTION,
    as_json: bool = JSON_OPTION,
    out: Optional[Path] = OUT_OPTION,
    wide: bool = WIDE_OPTION,
    model: Optional[str] = MODEL_OPTION,
    model_kwargs: Optional[str] = MODEL_KWARGS_OPTION,  # read through STATE by load_checkpoint
    unsafe_load: bool = UNSAFE_LOAD_OPTION,
    device: Optional[str] = DEVICE_OPTION,  # read through STATE by load_checkpoint and resolve_batches
    torch_kernels: Optional[str] = typer.Option(
        None, "--torch-kernels", metavar="STATE_DICT",
        help="A converted model's state_dict (torch.save(converted.state_dict()) after eager convert or "
        "convert_fx): torch converts the float reference's model again as qdebug import does, loads it, and "
        "compare runs it by torch's own int8 kernels as one more model, 'torch' (propagated error only).",
    ),
    backend: Optional[str] = typer.Option(None, "--backend", metavar="x86|fbgemm|qnnpack|onednn",
                                          help="With --torch-kernels: the backend whose default qconfig made it "
                                          "(default x86)."),
) -> None:
    cfg = STATE.config()
    paths = list(checkpoints or [])
    if not paths:  # the config's float and the model under test, as step and suggest take them
        paths, _ = config_checkpoints("compare", DEBUG_ORDER)
    if len(paths) < 2:
        raise QDebugError(f"compare needs two or more checkpoints, got {len(paths)}",
                          f"e.g. qdebug compare float.pt {paths[0] if paths else 'calibrated.pt'}")
    fmt = output_format(fmt, as_json)
    if top is not None and top < 1:
        raise QDebugError(f"--top must be >= 1, got {top}", "e.g. --top 20 (leave it out for every row)")
    if sort is not None and sort not in METRICS:
        raise QDebugError(f"cannot sort by {sort!r}", f"choose from {', '.join(METRICS)}")
    shown = parse_metrics(metrics)
    limits = parse_thresholds(threshold or [])
    check_data(data, batches, batch_size)
    if ref is not None and ref.isdigit() and int(ref) >= len(paths):
        raise QDebugError(f"--ref {ref} is not an index below {len(paths)}", "e.g. --ref 0 (or a stage label)")
    paths, onnx_models, ref = _onnx_paths(paths, ref)  # read (and checked) before torch loads
    if backend is not None and torch_kernels is None:
        raise QDebugError("--backend applies only with --torch-kernels", "e.g. --torch-kernels converted_state.pt "
                          f"--backend {backend}")
    if torch_kernels is not None:  # said before torch loads
        from qdebug.cli.import_ import BACKENDS, _choice

        backend = backend or "x86"
        _choice("--backend", backend, BACKENDS)
        if not Path(torch_kernels).exists():
            raise QDebugError(f"no such file: {torch_kernels}", "check the path")
    out = prepare_out(out)

    from qdebug.tools.compare import choose_reference, compare as run_compare

    loaded = [load_checkpoint(p, model=model, unsafe=unsafe_load, command="compare") for p in paths]
    infos = [info for _, info in loaded]
    labels = _labels(infos, paths)
    asked = None
    if ref is not None:
        if ref in labels:
            asked = labels.index(ref)
        elif ref.isdigit() and int(ref) < len(labels):
            asked = int(ref)
        else:
            raise QDebugError(
                f"--ref {ref!r} is neither a label ({', '.join(labels)}) nor an index below {len(labels)}",
                f"e.g. --ref {labels[0]} or --ref 0",
            )
    ref_index, warning = choose_reference([info.stage for info in infos], asked, names=paths)
    if warning:
        err_console.print(escaped(f"warning: {warning}"), markup=False, highlight=False, soft_wrap=True)
    batch_list = resolve_batches(data, batches, infos[ref_index], batch_size=batch_size)
    pairs = [(label, net) for label, (net, _) in zip(labels, loaded)]
    skip: tuple[str, ...] = ()
    if torch_kernels is not None:
        label = "torch"
        while label in labels:
            label += "'"
        pairs.append((label, _torch_kernels(torch_kernels, loaded[ref_index][0], infos[ref_index], batch_list,
                                            backend)))
        labels, paths, skip = [*labels, label], [*paths, torch_kernels], (label,)
    for path, proto in onnx_models:  # run by ONNX Runtime, named after the reference's calls
        label = _onnx_label(path, labels, len(onnx_models))
        pairs.append((label, _onnx_stage(proto, path, loaded[ref_index][0], batch_list)))
        labels, paths, skip = [*labels, label], [*paths, path], (*skip, label)
    with progress_bar("comparing", batch_list.count) as advance, model_errors("comparing", batch_list):
        result = run_compare(pairs, batch_list, ref=ref_index, thresholds=limits, isolated=isolated,
                             kl_feature_maps="kl" in shown, progress=advance)
    _check_architecture(result.frame, labels[ref_index])
    result.meta["reference_stage"] = infos[ref_index].stage
    frame = result.frame
    # The next command runs as printed: the same model, device and data, and compare's own options.
    run = RunOptions(model=model, model_kwargs=model_kwargs, unsafe_load=unsafe_load, device=device, data=data,
                     batches=batches, batch_size=batch_size)
    shaping = [("--ref", ref), *(("--threshold", t) for t in threshold or []), ("--torch-kernels", torch_kernels),
               ("--backend", backend if torch_kernels is not None else None)]

    def baseline_metric() -> str:  # the config's metric, else top-1 on data with targets, else agreement with float
        if cfg.get("metric"):
            return ""
        targets = getattr(batch_list, "has_targets", None)  # seen by compare's pass: no pass more
        if targets is None:
            targets = getattr(batch_list[0], "target", None) is not None
        return " --metric top1" if targets else " --metric agreement"

    why, next_command = _next_command(result, labels, paths, ref_index, given=list(checkpoints or []),
                                      options=run.text(), sort=sort, skip=skip,
                                      model_options=option_text(run.model_options()), again=option_text(shaping),
                                      baseline_metric=baseline_metric)
    fix = _fix_next(result, paths, labels, infos, ref_index, run)  # wide channels: equalize the float model (docs/fix.md)
    meta = {**result.meta, "checkpoints": dict(zip(labels, paths)), "summary": result.summary, "next": next_command,
            "fix": fix}
    if warning:
        meta["warning"] = warning
    files = _plots(result, out, labels[ref_index]) if out is not None else []
    meta["files"] = [path.name for path in files]  # the plots, in the --out folder (none without --out)
    report = Report("compare", frame, meta, files=files)

    def render() -> None:
        reordered = " (least quantized)" if asked is None and ref_index != 0 else ""
        title = f"compare vs {labels[ref_index]}{reordered}, {result.meta['batches']} batch(es)"
        differs = [label for label, item in result.meta["findings"].items() if item.get("float_differs")]
        if differs:  # in the header: the rows of these targets measure a float difference, not quantization
            title += f" -- {', '.join(differs)}: float model differs from {labels[ref_index]} (see below)"
        columns = shown
        if not metrics and "isolated_sqnr_db" in shown and frame["drift_sqnr_db"].notna().any():
            at = shown.index("isolated_sqnr_db") + 1  # a float model that moved: its drift beside the errors
            columns = [*shown[:at], "drift_sqnr_db", *shown[at:]]
        print_table(render_compare(frame, columns, sort=sort, top=top, title=title, width=table_width(wide)))
        for line in result.summary.splitlines():
            say(line)
        if fix:
            say("fix: cross-layer equalization may keep the wide channels int8 (docs/fix.md):")
            say(f"  {fix}")
        if next_command:
            say(f"next: {why}:")
            say(f"  {next_command}")

    emit(report, fmt, out, render)


def _torch_kernels(path: str, reference, info, batch_list, backend: str):
    """torch's converted model of ``path`` (a converted state_dict), rebuilt from the float
    reference's model as ``qdebug import`` rebuilds it, as a compare stage run by torch's kernels
    (``qdebug.interop.torch_stage``).  The model class is the reference checkpoint's, loaded under
    the usual trust rules; the file gives tensors only."""
    import copy

    from qdebug.engine.ops import map_tensors
    from qdebug.interop.state_dict import is_converted_state, read_state_dict, rebuild_converted, refuse_pt2e
    from qdebug.interop.torch_stage import TorchStage

    if info.stage != "float":
        raise QDebugError(f"--torch-kernels needs a float reference: torch converts its model again, and "
                          f"{info.path} is {info.stage}", "pass the float checkpoint first (or --ref its label)")
    state = read_state_dict(path)
    if not is_converted_state(state):
        refuse_pt2e(state, path)
        raise QDebugError(f"--torch-kernels {path} is not a converted model's state_dict (it holds no quantized "
                          "tensors)", "save torch.save(converted.state_dict()) after torch.ao's convert or "
                          "convert_fx; a prepared model's state_dict: qdebug import it, and compare the checkpoint")
    first = next(iter(batch_list))
    inputs = map_tensors(first.inputs, lambda t: t.cpu())  # torch's int8 kernels run on the CPU
    float_model = copy.deepcopy(reference).cpu().eval()
    with model_errors("rebuilding the torch.ao model", first):
        rebuilt = rebuild_converted(state, float_model, inputs, backend, source=path)
        return TorchStage(rebuilt.prepared, float_model=rebuilt.float_model, example_inputs=inputs)


def _onnx_paths(paths: list[str], ref: Optional[str]) -> tuple[list[str], list[tuple[str, object]], Optional[str]]:
    """The checkpoints of ``paths``, the ONNX models among them (``(path, ModelProto)``, read by
    ``qdebug.onnx.model_file.read_onnx``), and ``--ref`` as an index among the checkpoints."""
    from qdebug.onnx.model_file import is_onnx_path

    found = [p for p in paths if is_onnx_path(p)]
    if not found:
        return paths, [], ref
    checkpoints = [p for p in paths if not is_onnx_path(p)]
    if not checkpoints:
        raise QDebugError("compare needs a checkpoint to compare the ONNX model with: an ONNX model cannot be the "
                          "reference", f"e.g. qdebug compare float.pt {found[0]} --data eval.pt")
    if ref is not None and ref.isdigit():
        if is_onnx_path(paths[int(ref)]):
            raise QDebugError(f"--ref {ref} is the ONNX model {paths[int(ref)]}: the reference must be a checkpoint",
                              "pass the float checkpoint first (or --ref its index)")
        ref = str(sum(not is_onnx_path(p) for p in paths[:int(ref)]))
    from qdebug.onnx.model_file import read_onnx

    return checkpoints, [(p, read_onnx(p)) for p in found], ref


def _onnx_label(path: str, taken: list[str], count: int) -> str:
    """``onnx``, or the file's stem when several ONNX models are compared (or ``onnx`` is taken)."""
    label = "onnx" if count == 1 and "onnx" not in taken else Path(path).stem
    while label in taken:
        label += "'"
    return label


def _onnx_stage(proto, path: str, reference, batch_list):
    """The ONNX model of ``path`` run by ONNX Runtime as a compare stage (``qdebug.onnx.stage``),
    its rows named after ``reference``'s calls on the first batch."""
    from qdebug.onnx.stage import OnnxStage

    first = next(iter(batch_list))
    with model_errors("running the ONNX model", first):
        return OnnxStage(proto, reference, first.inputs, source=path)


def _plots(result, out: "StagedDir", reference: str) -> list[Path]:
    """The along-network plot, the worst layers' error histograms, and one ``outlier_<layer>.png``
    per outlier_channels layer (``_outlier_plots``)."""
    from qdebug.report.plots import plot_along_network, plot_histograms

    frame = result.frame
    written = [plot_along_network(frame, out.file("compare_along_network.png"), reference=reference,
                                  thresholds=result.meta.get("thresholds"))]
    measured = frame[frame["note"] == ""]
    # The layers whose own error is worst (propagated error when isolated errors were not taken).
    if measured["isolated_sqnr_db"].notna().any():
        worst = measured[measured["isolated_sqnr_db"].notna()].sort_values("isolated_sqnr_db")
    else:
        worst = measured.sort_values("sqnr_db", na_position="first")
    worst = worst.head(HISTOGRAM_LAYERS)
    keys = [(r.layer, r.target) for r in worst.itertuples() if (r.layer, r.target) in result.samples]
    if keys:
        written.append(plot_histograms(result.samples, keys, out.file("compare_worst_histograms.png"),
                                       reference=reference, frame=frame))
    else:  # an earlier run's histograms would show layers this run does not rank
        out.drop_stale("compare_worst_histograms.png")
    return written + _outlier_plots(result, out, reference)


def _outlier_plots(result, out: "StagedDir", reference: str) -> list[Path]:
    """``outlier_<layer>.png`` for each layer diagnosed outlier_channels (its first compared model's
    evidence: ``CompareResult.outliers``); an earlier run's outlier plots this run does not write
    are dropped, so the folder never shows an outlier this run did not find."""
    from qdebug.report.plots import plot_outlier_channels

    written: list[Path] = []
    names: dict[str, str] = {}  # layer -> its file name
    for (layer, target), evidence in result.outliers.items():
        if layer in names:  # written already, from another compared model's row of this layer
            continue
        names[layer] = _outlier_file(layer, set(names.values()))
        written.append(plot_outlier_channels(layer, evidence, out.file(names[layer]), reference=reference,
                                             target=target))
    final = Path(out.final)
    if final.is_dir():
        out.drop_stale(*(p.name for p in final.glob("outlier_*.png") if p.name not in names.values()))
    return written


def _outlier_file(layer: str, taken: set[str]) -> str:
    """``outlier_<layer>.png`` with the layer's name made a safe file name (letters, digits, ``.``,
    ``-``, ``_``; anything else ``_``; at most 100 characters; never hidden), ``-2``, ``-3`` ... added
    when that name is ``taken`` (another layer's name came out the same)."""
    import re

    stem = re.sub(r"[^A-Za-z0-9._-]", "_", layer)[:100].lstrip(".") or "_"
    name, n = f"outlier_{stem}.png", 1
    while name in taken:
        n += 1
        name = f"outlier_{stem}-{n}.png"
    return name


def _check_architecture(frame: "pd.DataFrame", reference: str) -> None:
    for target, rows in frame.groupby("target", sort=False):
        missing = rows["note"].str.startswith("not in").sum()
        if len(rows) and missing > len(rows) / 2:
            raise QDebugError(
                f"{target} and {reference} do not look like the same architecture: {missing} of {len(rows)} layers "
                "have no counterpart",
                "compare checkpoints of one model (same class and kwargs)",
            )
