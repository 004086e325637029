"""PNG plots of a watched QAT run (``qdebug watch --out DIR``): one figure per kind of the
timeline (``qdebug.tools.watch.timeline``), each finding's first step marked on its figure.

- ``watch_points.png``: each activation point's tracked range as a fraction of the data's
  range, and its saturation, over steps;
- ``watch_layers.png``: each weighted layer's code changes and flip-backs (oscillation) per step;
- ``watch_bn.png``: each BN's drift against the float model's statistics;
- ``watch_model.png``: the loss, the gradient norm and the output SQNR against the float model.

Names pass through ``qdebug.report.plots._text`` (escaped; ``$`` literal)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from qdebug.report.plots import _finite, _save, _text, plt
from qdebug.tools.watch.rules import BN_DRIFT, OSCILLATION_FRACTION, RANGE_INSIDE_DATA

LEGEND_MAX = 8  # lines named in a legend; past that the worst ones are named, the others drawn grey
RULE_KIND = {"ema_startup_bias": "point", "range_frozen_early": "point", "scale_collapse": "point",
             "oscillation": "layer", "grid_too_coarse_for_lr": "layer", "bn_drift": "bn", "dead_run": "model"}


def plot_watch(timeline: pd.DataFrame, findings: pd.DataFrame, folder: Path) -> list[Path]:
    """The four figures (module docstring) into ``folder``: their paths."""
    points = _wide(timeline, "point")
    if len(points) and {"range_min", "range_max", "data_min", "data_max"} <= set(points):
        span = points["data_max"] - points["data_min"]
        points["range_fraction"] = ((points["range_max"] - points["range_min"]) / span.where(span > 0)).clip(upper=2)
    layers, bns, model = _wide(timeline, "layer"), _wide(timeline, "bn"), _wide(timeline, "model")
    if len(bns):
        bns["drift"] = pd.concat([bns.get("mean_drift"), bns.get("var_drift") / 2], axis=1).max(axis=1)
    figures = [
        ("watch_points.png", "point", points, [("range_fraction", "tracked range / data range", RANGE_INSIDE_DATA),
                                               ("saturation", "saturation", None)],
         "no activation point measured"),
        ("watch_layers.png", "layer", layers, [("code_change", "code changes per step", None),
                                               ("oscillation", "flip-backs per step", OSCILLATION_FRACTION)],
         "no weighted layer with a weight quant point"),
        ("watch_bn.png", "bn", bns, [("drift", "BN drift vs float", BN_DRIFT)],
         "no BN drift: it needs a float model and BN kept in the model (with_bn)"),
        ("watch_model.png", "model", model, [("loss", "loss", None), ("grad_norm", "gradient norm", None),
                                             ("output_sqnr_db", "output SQNR vs float (dB)", None)],
         "no model metric"),
    ]
    return [_figure(frame, panels, folder / name, _marks(findings, kind), empty, kind)
            for name, kind, frame, panels, empty in figures]


def _wide(timeline: pd.DataFrame, kind: str) -> pd.DataFrame:
    part = timeline[timeline["kind"] == kind]
    if part.empty:
        return pd.DataFrame(columns=["step", "name"])
    return part.pivot_table(index=["step", "name"], columns="metric", values="value", aggfunc="last").reset_index()


def _marks(findings: pd.DataFrame, kind: str) -> list[tuple[int, str]]:
    """(from_step, label) of the findings a figure of ``kind`` shows."""
    if findings is None or findings.empty:
        return []
    return [(int(r.from_step), f"{r.rule} {r.name}".strip()) for r in findings.itertuples()
            if RULE_KIND.get(r.rule) == kind]


def _figure(frame: pd.DataFrame, panels: list, path: Path, marks: list, empty: str, kind: str) -> Path:
    panels = [p for p in panels if p[0] in frame and frame[p[0]].notna().any()]
    fig, axes = plt.subplots(max(1, len(panels)), 1, figsize=(8, 2.3 * max(1, len(panels)) + 0.6), sharex=True,
                             squeeze=False)
    if not panels:
        axes[0, 0].text(0.5, 0.5, empty, ha="center", va="center", transform=axes[0, 0].transAxes, fontsize=9)
        axes[0, 0].set_axis_off()
    for ax, (column, label, threshold) in zip(axes[:, 0], panels):
        series = {name: part.sort_values("step") for name, part in frame[frame[column].notna()].groupby("name")}
        low_is_bad = column == "range_fraction"  # a range far inside the data's: the smallest are the worst
        worst = sorted(series, key=lambda n: _peak(series[n][column], low_is_bad))[:LEGEND_MAX]
        for name, part in series.items():
            named = name in worst
            ax.plot(list(part["step"]), _finite(part[column]), marker="." if len(part) < 40 else None, linewidth=1,
                    color=None if named else "0.75", label=_text(name or "model") if named else None,
                    zorder=2 if named else 1)
        if threshold is not None:
            ax.axhline(threshold, color="tab:red", linestyle=":", linewidth=1, label=f"rule threshold {threshold:g}")
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
        if len(series) > 1 or threshold is not None:  # one unnamed line (the model's) needs no legend
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    for step, label in marks[:LEGEND_MAX]:
        for ax in axes[:, 0] if panels else []:
            ax.axvline(step, color="tab:red", linestyle="--", linewidth=0.8)
    if marks:
        more = f" and {len(marks) - 1} more" if len(marks) > 1 else ""
        axes[0, 0].set_title(_text(f"{len(marks)} finding(s), the first from step {marks[0][0]}: {marks[0][1]}{more}"),
                             fontsize=8)
    elif panels:
        axes[0, 0].set_title(f"no finding on the {kind}s (findings of the other kinds: their figures)"
                             if kind != "model" else "no finding on the model", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    return _save(fig, path)


def _peak(values, low_is_bad: bool) -> float:
    """A sort key, worst first: the lowest value when ``low_is_bad``, else minus the highest."""
    shown = [v for v in _finite(values) if v == v]
    if not shown:
        return float("inf")
    return min(shown) if low_is_bad else -max(shown)
