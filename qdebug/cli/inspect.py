"""``qdebug inspect``: stage, model, qconfig and a per-layer table with checks (and, for a
model imported from torch.ao, its import report)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from qdebug.cli.registry import command
from qdebug.cli.common import (
    DATA_HELP, DEVICE_OPTION, MODEL_KWARGS_OPTION, MODEL_OPTION, UNSAFE_LOAD_OPTION, console,
    load_checkpoint, model_errors, resolve_batches, stage_path,
)
from qdebug.cli.output import (
    FORMAT_OPTION, JSON_OPTION, OUT_OPTION, WIDE_OPTION, Report, emit, output_format, prepare_out, print_table, say,
    table_width,
)

if TYPE_CHECKING:
    import pandas as pd

_STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}
INFO_ROWS = 3  # more info rows of one check than this are one row in a fitted table
# The per-layer table at a given width: what a layer is quantized as comes first.
LAYER_PRIORITY = ["layer", "weight", "activation", "act_scale_max", "fused_into", "type", "mode", "calls",
                  "weight_scale_max", "weight_scale_min", "act_scale_min"]
# The import report of a model imported from torch.ao (qdebug.interop; qdebug import prints the same).
IMPORT_PRIORITY = ["source", "point", "status", "kind", "note", "spec", "scale_max", "scale_min"]
_IMPORT_STYLE = {"unmapped": "bold red", "approximate": "yellow", "frozen": "yellow", "float": "dim"}


def render_import(imports: "pd.DataFrame", *, title: str, width: Optional[int]):
    """An import report as a table: which torch quantizer became which engine point, and how."""
    from qdebug.report.table import render_table

    return render_table(imports, title=title, priority=IMPORT_PRIORITY, names=("source", "point"), wrap=("note",),
                        formats={"source": import_owner}, width=width,
                        row_styles=[_IMPORT_STYLE.get(s) for s in imports["status"]])


def import_owner(source: object) -> str:
    """A torch quantizer's name as the import table shows it: an eager quantizer is a child of
    the module it serves, shown as that module (the kind column says which child; JSON and CSV
    keep the whole name)."""
    text = "" if source is None else str(source)
    for child in (".activation_post_process", ".weight_fake_quant"):
        if text.endswith(child) and len(text) > len(child):
            return text[: -len(child)]
    return text


def render_layers(layers: "pd.DataFrame", *, title: str, width: Optional[int]):
    """The per-layer table of inspect, calibrate and convert."""
    from qdebug.report.table import render_table

    return render_table(layers, title=title, priority=LAYER_PRIORITY, width=width, names=("layer", "fused_into"))


def render_checks(checks: "pd.DataFrame", *, width: Optional[int]):
    """The checks table; in a fitted table, many info rows of one check are one row (JSON has them all)."""
    import pandas as pd

    from qdebug.report.table import render_table

    if width is not None:
        rows = []
        for (severity, check), group in checks.groupby(["severity", "check"], sort=False):
            if severity == "info" and len(group) > INFO_ROWS:
                first = group.iloc[0]
                rows.append({"severity": severity, "layer": f"{len(group)} layers", "check": check,
                             "detail": f"e.g. {first['layer']}: {first['detail']}"})
            else:
                rows.extend(group.to_dict("records"))
        checks = pd.DataFrame(rows, columns=checks.columns)
    return render_table(checks, title="checks", width=width, priority=["severity", "layer", "check", "detail"],
                        wrap=("detail",), row_styles=[_STYLE.get(s) for s in checks["severity"]])


def _import_counts(imports: "pd.DataFrame") -> str:
    quantizers = imports[(imports["source"] != "") & (imports["kind"] != "bn")]
    counts = quantizers["status"].value_counts()
    return f"{len(quantizers)} quantizer(s): " + ", ".join(f"{int(n)} {status}" for status, n in counts.items())


@command(
    short_help="What a checkpoint holds, layer by layer, and what looks wrong.",
    help=(
        "Show what a CHECKPOINT of any stage holds (default: the config's qat, calibrated, quantized or "
        "float): stage, model, qconfig, every layer's weight/activation "
        "dtype and scales, and checks (unfused Conv-BN, shared or dead modules, bad scales, "
        "uninitialised observers, float fallbacks, non-finite weights, BatchNorm statistics, unmapped torch "
        "quantizers); for a model "
        "imported from torch.ao (qdebug import), its import report. Exit 1 when a check is an error.\n\n"
        "Example: qdebug inspect fixtures/demo/qat.pt\n\n"
        "Example: qdebug inspect fixtures/demo/quantized.pt --format json"
    )
)
def inspect(
    checkpoint: Optional[str] = typer.Argument(None, metavar="CHECKPOINT", hidden=True),
    data: Optional[str] = typer.Option(None, "--data", metavar="SPEC",
                                       help="Inputs to trace a float model (default: its sample inputs). " + DATA_HELP),
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
    out = prepare_out(out)
    path = stage_path(checkpoint, "qat", "calibrated", "quantized", "float", what="")
    net, info = load_checkpoint(path, model=model, unsafe=unsafe_load, command="inspect")
    batches = resolve_batches(data, 1, info, required=False, announce=False) if info.stage == "float" else None
    first = batches[0] if batches else None  # one batch: a pass that stops there
    example = first.inputs if first is not None else None

    from qdebug.tools.inspect import inspect_model

    with model_errors("tracing the model", first):
        result = inspect_model(net, stage=info.stage, example_inputs=example)
    # The import rows are the "import" table; the file's meta keeps the rest.
    file_meta = {k: v for k, v in info.meta.items() if k != "import"}
    meta = {**result.meta, "path": path, "model": info.model.to_dict(), "checkpoint_meta": file_meta,
            "qconfig": info.qconfig.to_dict() if info.qconfig else None}
    imports = result.imports

    def render() -> None:
        from rich.markup import escape as markup_escape
        from rich.panel import Panel

        from qdebug.safe_text import escaped

        def escape(text: str) -> str:  # the file's text is neither markup nor terminal control
            return markup_escape(escaped(text))

        qcfg = info.qconfig
        lines = [
            f"[bold]{escape(path)}[/]  stage: [bold]{escape(info.stage)}[/]",
            escape(f"model: {info.model.target} {info.model.kwargs or ''}"),
            f"qat mode: {escape(str(meta['qat_mode'] or '-'))}   quant points: {meta['quant_points']}",
        ]
        if qcfg is not None:
            lines += [f"weights: {qcfg.weight.describe()}", f"activations: {qcfg.activation.describe()}"]
            if qcfg.overrides:
                lines.append(escape(f"overrides: {dict(qcfg.overrides)}"))
        if len(imports):
            flow = info.meta.get("import_flow")
            lines.append(escape(f"imported from torch.ao{' ' + flow if isinstance(flow, str) else ''}: "
                                f"{_import_counts(imports)}"))
        console.print(Panel("\n".join(lines), title="qdebug inspect", expand=False))
        width = table_width(wide)
        print_table(render_layers(result.layers, title="layers", width=width))
        if len(imports):
            print_table(render_import(imports, title="import", width=width))
        if len(result.checks):
            print_table(render_checks(result.checks, width=width))
        say(f"{meta['errors']} error(s), {meta['warnings']} warning(s)")

    # JSON always has "import" ([] for a native checkpoint); --out writes inspect_import.csv for an imported one.
    tables = {"checks": result.checks, **({"import": imports} if len(imports) else {})}
    emit(Report("inspect", result.layers, meta, tables=tables, json_extra={} if len(imports) else {"import": []}),
         fmt, out, render)
    if result.has_errors:
        raise typer.Exit(1)
