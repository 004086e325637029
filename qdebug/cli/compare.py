"""``qdebug compare``: per-layer similarity of checkpoints of one model, any stages."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import pandas as pd
import typer

from qdebug.cli.app import app
from qdebug.cli.common import (
    BATCHES_OPTION, BATCH_SIZE_OPTION, MODEL_OPTION, UNSAFE_LOAD_OPTION,
    STATE, console, load_checkpoint, model_errors, print_json, progress_bar, resolve_batches, writable_dir,
)
from qdebug.errors import QDebugError
from qdebug.report.output import to_json, write_csv, write_json
from qdebug.report.table import render_table
from qdebug.tools.compare import DEFAULT_SHOW, METRICS, compare as run_compare

HISTOGRAM_LAYERS = 4


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


SHORT = {
    "cosine": "cos", "sqnr_db": "SQNR dB", "isolated_sqnr_db": "own SQNR", "isolated_cosine": "own cos",
    "isolated_mse": "own mse", "isolated_max_abs": "own max|e|", "max_abs_scales": "max|e|/s", "saturation": "sat",
    "min_channel_sqnr_db": "min ch SQNR", "median_channel_sqnr_db": "med ch SQNR",
    "channel_range_ratio": "ch range ratio", "nonfinite": "NaN/Inf", "max_abs": "max|e|", "mean_abs": "mean|e|",
}
_LOWER_IS_WORSE = ("cosine", "sqnr_db", "isolated_cosine", "isolated_sqnr_db", "min_channel_sqnr_db", "median_channel_sqnr_db")


def _short_note(note: str) -> str:
    if "BN folded" in note:
        return "BN folded: see " + note.rsplit("compared at ", 1)[-1]
    if "fused into its integer kernel" in note:
        return "ReLU fused: see " + note.rsplit("compared at ", 1)[-1]
    return note


def _display(frame: pd.DataFrame, metrics: list[str], sort: Optional[str], top: Optional[int], several: bool):
    """Rows in execution order (or sorted), one per layer and compared model; short headers."""
    view = frame.copy()
    if sort:
        if sort not in view:
            raise QDebugError(f"cannot sort by {sort!r}", f"choose from {', '.join(METRICS)}")
        view = view.sort_values(sort, ascending=sort in _LOWER_IS_WORSE, na_position="last")
    if top:
        view = view[view["note"] == ""].head(top)
    columns = ["layer", "type", *(["target"] if several else []), *metrics, "diagnosis", "note"]
    view = view[columns].copy()
    view["note"] = view["note"].map(_short_note)
    for col in view.columns:
        if col.endswith("_db"):
            view[col] = view[col].round(2)
        elif col.endswith("cosine"):
            view[col] = view[col].round(6)
    if several and not sort:
        view["layer"] = [name if i == 0 or name != prev else "" for i, (name, prev) in
                         enumerate(zip(view["layer"], [None, *view["layer"][:-1]]))]
    highlight = [i for i, v in enumerate(view["diagnosis"]) if v]
    return view.rename(columns=SHORT), highlight


@app.command(
    help=(
        "Per-layer feature-map similarity of checkpoints of one model in any stages (float, calibrated, "
        "QAT, quantized), each against the first (or --ref): propagated and isolated error, SQNR, cosine, "
        "saturation, per-channel SQNR, and a diagnosis (clipping, rounding, outlier_channels, propagated, "
        "nonfinite) for flagged layers.\n\n"
        "Example: qdebug compare fixtures/demo/float.pt fixtures/demo/calibrated.pt fixtures/demo/quantized.pt "
        "--data fixtures/demo/eval.pt --batches 4 --out compare-out\n\n"
        "Example: qdebug compare fixtures/demo/float.pt fixtures/demo/qat.pt --metrics sqnr_db,kl --sort kl"
    )
)
def compare(
    checkpoints: Optional[List[str]] = typer.Argument(None, help="Two or more checkpoints (default: the config's float and qat)."),
    ref: Optional[str] = typer.Option(None, "--ref", help="Reference: a stage label or a 0-based index (default: the first)."),
    data: Optional[str] = typer.Option(None, "--data", help="Data spec (default: the config's data, else the sample inputs)."),
    batches: Optional[int] = BATCHES_OPTION,
    batch_size: Optional[int] = BATCH_SIZE_OPTION,
    metrics: Optional[str] = typer.Option(
        None, "--metrics",
        help=f"Columns to show, comma-separated, or 'all' (default {','.join(DEFAULT_SHOW)}). Naming kl (or all) "
        "also computes kl for feature maps, not only for [N, C] outputs.",
    ),
    threshold: Optional[List[str]] = typer.Option(None, "--threshold", help="Override a flag threshold, e.g. sqnr_db=25 (repeatable)."),
    sort: Optional[str] = typer.Option(None, "--sort", help="Sort rows by this metric (worst first)."),
    top: Optional[int] = typer.Option(None, "--top", help="Show only the first N rows."),
    isolated: bool = typer.Option(True, "--isolated/--no-isolated", help="Also measure each layer on the reference's input."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write compare.csv, compare.json and PNG plots here."),
    fmt: Optional[str] = typer.Option(None, "--format", help="Write json or csv to stdout instead of a table."),
    model: Optional[str] = MODEL_OPTION,
    unsafe_load: bool = UNSAFE_LOAD_OPTION,
) -> None:
    cfg = STATE.config()
    paths = list(checkpoints or [])
    if not paths:
        paths = [p for p in (cfg.get("float"), cfg.get("qat")) if p]
    if len(paths) < 2:
        raise QDebugError("compare needs two or more checkpoints", "e.g. qdebug compare float.pt qat.pt (or set float and qat in qdebug.toml)")
    if fmt not in (None, "json", "csv"):
        raise QDebugError(f"--format {fmt!r} is not json or csv", "--format json, --format csv, or no --format for a table")
    if top is not None and top < 1:
        raise QDebugError(f"--top must be >= 1, got {top}", "e.g. --top 20 (leave it out for every row)")
    shown = parse_metrics(metrics)
    limits = parse_thresholds(threshold or [])
    if out is not None:
        writable_dir(out)
    loaded = [load_checkpoint(p, model=model, unsafe=unsafe_load, command="compare") for p in paths]
    labels = _labels([info for _, info in loaded], paths)
    ref_index = 0
    if ref is not None:
        if ref in labels:
            ref_index = labels.index(ref)
        elif ref.isdigit() and int(ref) < len(labels):
            ref_index = int(ref)
        else:
            raise QDebugError(
                f"--ref {ref!r} is neither a label ({', '.join(labels)}) nor an index below {len(labels)}",
                f"e.g. --ref {labels[0]} or --ref 0",
            )
    infos = [info for _, info in loaded]
    batch_list = resolve_batches(data, batches, infos[ref_index], batch_size=batch_size)
    pairs = [(label, net) for label, (net, _) in zip(labels, loaded)]
    with progress_bar("comparing", len(batch_list)) as advance, model_errors("comparing", batch_list[0]):
        result = run_compare(pairs, batch_list, ref=ref_index, thresholds=limits, isolated=isolated,
                             kl_feature_maps="kl" in shown, progress=advance)
    _check_architecture(result.frame, labels[ref_index])
    frame = result.frame
    meta = {**result.meta, "checkpoints": dict(zip(labels, paths)), "summary": result.summary}
    if out is not None:
        write_csv(out / "compare.csv", frame)
        write_json(out / "compare.json", frame, meta)
        from qdebug.report.plots import plot_along_network, plot_histograms

        plot_along_network(frame, out / "compare_along_network.png", reference=labels[ref_index])
        worst = (frame[frame["note"] == ""].sort_values("sqnr_db", na_position="first").head(HISTOGRAM_LAYERS))
        keys = [(r.layer, r.target) for r in worst.itertuples() if (r.layer, r.target) in result.samples]
        if keys:
            plot_histograms(result.samples, keys, out / "compare_worst_histograms.png", reference=labels[ref_index])
    if fmt == "json":
        print_json(to_json(frame, meta))
        return
    if fmt == "csv":
        print_json(frame.to_csv(index=False).rstrip("\n"))
        return
    several = len(labels) > 2
    view, highlight = _display(frame, shown, sort, top, several)
    title = f"compare vs {labels[ref_index]} ({result.meta['batches']} batch(es))"
    console.print(render_table(view, title=title, highlight=highlight))
    console.print(result.summary, soft_wrap=True, markup=False, highlight=False)
    if out is not None:
        console.print(f"wrote {out}/compare.csv, compare.json and plots")


def _check_architecture(frame: pd.DataFrame, reference: str) -> None:
    for target, rows in frame.groupby("target", sort=False):
        missing = rows["note"].str.startswith("not in").sum()
        if len(rows) and missing > len(rows) / 2:
            raise QDebugError(
                f"{target} and {reference} do not look like the same architecture: {missing} of {len(rows)} layers "
                "have no counterpart",
                "compare checkpoints of one model (same class and kwargs)",
            )
