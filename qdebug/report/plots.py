"""PNG plots of comparison results (matplotlib, headless).

Names in titles, labels and ticks come from the model and the user's code: they pass through
``_text`` (``qdebug.safe_text.escaped``, and a ``$`` is a dollar, not mathtext), so a PNG
shows what a table shows and a crafted name cannot make matplotlib's parser fail."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from qdebug.io.atomic import atomic_path  # noqa: E402
from qdebug.safe_text import escaped  # noqa: E402


def _text(value) -> str:
    """A name for a title, label or tick: controls escaped, ``$`` literal (not mathtext)."""
    return escaped(value).replace("$", r"\$")


def _finite(values) -> list[float]:
    out = []
    for v in values:
        v = float(v) if v is not None else math.nan
        out.append(v if math.isfinite(v) else math.nan)
    return out


def plot_along_network(frame: pd.DataFrame, path: str | Path, *, reference: str,
                       thresholds: dict | None = None) -> Path:
    """SQNR (dB) and cosine per layer, in execution order: one colour per compared model in
    both panels (propagated solid, isolated dashed), the flagging thresholds as lines, the
    flagged rows marked; every n-th layer named when there are too many to read.

    Only measured rows are on the x axis (a row with no numbers in any compared model -- a
    BN torch folded, a fused ReLU -- is left out and counted in the axis label), and each
    line joins the rows it has a finite value for: in fuse_bn mode every conv row has a
    note, and gaps there would cut the line into pieces of two points."""
    measured = frame[frame["note"] == ""]
    layers = list(dict.fromkeys(measured["layer"]))
    position = {name: i for i, name in enumerate(layers)}
    left_out = frame["layer"].nunique() - len(layers)
    fig, (ax_sqnr, ax_cos) = plt.subplots(2, 1, figsize=(min(max(8, len(layers) * 0.16), 24) + 2.5, 7.5),
                                          sharex=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (target, rows) in enumerate(measured.groupby("target", sort=False)):
        colour = colours[k % len(colours)]

        def along(column: str, rows=rows) -> tuple[list[int], list[float]]:
            points = [(position[name], float(v)) for name, v in zip(rows["layer"], rows[column])
                      if v is not None and math.isfinite(float(v))]
            return [x for x, _ in points], [v for _, v in points]

        ax_sqnr.plot(*along("sqnr_db"), marker=".", color=colour, label=f"{_text(target)} (propagated)")
        if rows["isolated_sqnr_db"].notna().any():
            ax_sqnr.plot(*along("isolated_sqnr_db"), linestyle="--", marker="_", color=colour, alpha=0.75,
                         label=f"{_text(target)} (isolated: own error)")
        ax_cos.plot(*along("cosine"), marker=".", color=colour, label=_text(target))
        if "diagnosis" in rows:
            flagged = [(position[n], v) for n, d, v in zip(rows["layer"], rows["diagnosis"], rows["sqnr_db"])
                       if d and v is not None and math.isfinite(float(v))]
            if flagged:
                ax_sqnr.scatter([x for x, _ in flagged], [v for _, v in flagged], marker="x", color="tab:red",
                                zorder=3, label=f"{_text(target)}: flagged")
    for key, style in (("sqnr_db", "-"), ("isolated_sqnr_db", "--")):
        if thresholds and key in thresholds:
            ax_sqnr.axhline(thresholds[key], color="gray", linestyle=style, linewidth=0.8,
                            label=f"{key} threshold ({thresholds[key]:g} dB)")
    ax_sqnr.set_ylabel(f"SQNR vs {_text(reference)} (dB)")
    ax_sqnr.set_title(f"error along the network, against {_text(reference)}", fontsize=10)
    ax_sqnr.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))  # beside the data, not over it
    ax_sqnr.grid(alpha=0.3)
    ax_cos.set_ylabel(f"cosine vs {_text(reference)}")
    ax_cos.set_title(f"cosine similarity, against {_text(reference)}", fontsize=10)
    ax_cos.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))
    ax_cos.grid(alpha=0.3)
    every = max(1, math.ceil(len(layers) / 80))
    ax_cos.set_xticks(range(0, len(layers), every))
    ax_cos.set_xticklabels([_text(name) for name in layers[::every]], rotation=90, fontsize=6)
    ax_cos.set_xlabel("layer, in execution order" + (f" (every {every}th named)" if every > 1 else "")
                      + (f"; {left_out} row(s) without numbers left out (see the table's note)" if left_out else ""))
    fig.tight_layout()
    return _save(fig, path)


def plot_histograms(samples: dict, layers: list[tuple[str, str]], path: str | Path, *, reference: str,
                    frame: pd.DataFrame | None = None) -> Path:
    """The error distribution (compared - reference, on the same sampled positions) of the given
    (layer, target) pairs -- the layers with the worst own error -- with log-scale counts and
    a line at no error."""
    n = max(len(layers), 1)
    fig, axes = plt.subplots(n, 1, figsize=(7, 2.5 * n), squeeze=False)
    for ax, key in zip(axes[:, 0], layers):
        x, y = samples[key]
        error = (y - x) if x.shape == y.shape else y.new_empty(0)
        error = error[torch.isfinite(error)]
        title = f"{_text(key[0])} ({_text(key[1])})"
        if frame is not None:
            row = frame[(frame["layer"] == key[0]) & (frame["target"] == key[1])]
            if len(row):
                own = row["isolated_sqnr_db"].iloc[0]
                title += f": {float(row['sqnr_db'].iloc[0]):.1f} dB" + (
                    f", own error {float(own):.1f} dB" if own is not None and not pd.isna(own) else "")
        if error.numel() == 0:
            ax.set_title(title + ": no finite error", fontsize=9)
            continue
        ax.hist(error.numpy(), bins=81, color="tab:purple", alpha=0.8,
                label=f"{error.numel()} sampled values (first batch)")
        ax.axvline(0.0, color="gray", linestyle=":", linewidth=1, label="no error")
        ax.set_yscale("log")
        ax.ticklabel_format(axis="x", style="sci", scilimits=(-3, 4), useOffset=False)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(f"error: {_text(key[1])} - {_text(reference)}", fontsize=8)
        ax.set_ylabel("count (log)", fontsize=8)
        ax.legend(fontsize=7, loc="upper right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_steps(frame: pd.DataFrame, path: str | Path, *, tasks: list[str], cumulative: bool,
               ratio: float = 0.99, culprit: tuple[str, str] | None = None) -> Path:
    """One bar per step (a line along the network for a cumulative sweep): the metric's
    ratio to float with the ``ratio`` line when there is a metric, else output SQNR.
    The y axis is zoomed to the values (ratios near 1 differ in the third digit); a drill's
    levels are separated by dotted lines; the costliest unit (``culprit``: its selection and
    kind, as step's ``meta.culprit`` names them) is red."""
    column = f"{tasks[0]}_ratio" if tasks else "sqnr_db"
    rows = frame[frame["mode"] == "cumulative"] if cumulative else frame[frame["mode"] != "all"]
    labels = [f"{s}" + (f" ({k})" if k != "both" else "") for s, k in zip(rows["selection"], rows["kind"])]
    values = _finite(rows[column])
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 0.45) + 3, 4.2))  # + the legend beside
    xs = list(range(len(labels)))
    measure = f"{_text(tasks[0])} / float" if tasks else "output SQNR"
    keys: list = []  # legend entries of artists that carry no label (bars coloured one by one)
    if cumulative:
        ax.plot(xs, values, marker="o", label=f"{measure}, quantized up to this layer")
        ax.set_xlabel("quantized up to and including (execution order)")
        ax.set_title(f"{measure} as the network is quantized layer by layer", fontsize=10)
    else:
        red = [(s, k) == tuple(culprit or ()) for s, k in zip(rows["selection"], rows["kind"])]
        colours = ["tab:red" if r else "tab:blue" for r in red]
        ax.bar(xs, values, color=colours)
        keys = [Patch(color="tab:blue", label=f"{measure}, this unit alone quantized")]  # the colours, explained
        if any(red):
            keys.append(Patch(color="tab:red", label=f"the costliest unit ({_text(culprit[0])})"))
        ax.set_xlabel("quantized alone (the rest in float)")
        ax.set_title(f"{measure} with each unit quantized alone", fontsize=10)
        if "level" in rows:
            levels = list(rows["level"])
            bounds = [i for i in range(1, len(levels)) if levels[i] != levels[i - 1]]
            for n, i in enumerate(bounds):
                ax.axvline(i - 0.5, color="gray", linestyle=":", linewidth=1,
                           label="next drill level" if n == 0 else None)
    shown = [v for v in values if not math.isnan(v)] + ([ratio] if tasks else [])
    if shown:
        lo, hi = min(shown), max(shown)
        pad = max((hi - lo) * 0.15, 0.002 if tasks else 0.5)
        ax.set_ylim(lo - pad, hi + pad)
    if tasks:
        ax.axhline(ratio, color="tab:red", linestyle="--", linewidth=1, label=f"target: {ratio:g} x float")
        ax.set_ylabel(f"{_text(tasks[0])} / float {_text(tasks[0])}")
    else:
        ax.set_ylabel("output SQNR vs float (dB)")
    ax.legend(handles=keys + ax.get_legend_handles_labels()[0], fontsize=8, loc="upper left",
              bbox_to_anchor=(1.005, 1.0))  # beside the bars, never over one
    ax.set_xticks(xs)
    ax.set_xticklabels([_text(label) for label in labels], rotation=60, ha="right", fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return _save(fig, path)


def plot_suggest(frame: pd.DataFrame, meta: dict, path: str | Path, *, top: int = 30) -> Path:
    """Left: output SQNR gained by each candidate alone at the plan's width (the plan's members
    red). Right: each evaluation of the plan search -- plan size against the target measure
    (the first task's ratio to float with the ratio line, else output SQNR with --min-sqnr)."""
    ranked = frame[frame["rank"].notna()].head(top)
    fig, (ax_gain, ax_plan) = plt.subplots(1, 2, figsize=(max(9, 4 + len(ranked) * 0.3), 4.4),
                                           gridspec_kw={"width_ratios": [2, 1]})
    xs = list(range(len(ranked)))
    # --rank fast measures no gain per candidate: its gradient-weighted noise score instead.
    fast = "noise_score" in ranked and ranked["gain_db"].isna().all()
    ax_gain.bar(xs, _finite(ranked["noise_score" if fast else "gain_db"]),
                color=["tab:red" if v else "tab:blue" for v in ranked["in_plan"]])
    if fast:
        ax_gain.set_yscale("log")
    ax_gain.set_xticks(xs)
    ax_gain.set_xticklabels([f"{_text(p)} ({_text(k[0])})" for p, k in zip(ranked["point"], ranked["kind"])], rotation=70,
                            ha="right", fontsize=7)
    ax_gain.set_ylabel("gradient-weighted noise (fast rank)" if fast else f"output SQNR gained at {meta['bits']} bits (dB)")
    ax_gain.set_title("each candidate's score, one backward pass (plan in red)" if fast
                      else "each candidate alone (plan in red)", fontsize=9)
    ax_gain.set_xlabel("candidate point (kind), best first" + (f"; the first {top} shown" if len(ranked) == top else ""))
    ax_gain.legend(handles=[Patch(color="tab:red", label="in the plan"), Patch(color="tab:blue", label="not in the plan")],
                   fontsize=8)
    ax_gain.grid(alpha=0.3, axis="y")
    history = meta["plan"].get("history") or []
    tasks = meta.get("tasks") or []
    column = f"{tasks[0]}_ratio" if tasks else "sqnr_db"
    target = meta.get("ratio", 0.99) if tasks else meta.get("min_sqnr")
    if history:
        sizes = [h["size"] for h in history]
        values = _finite(h.get(column) for h in history)
        passed = [h["passed"] for h in history]
        for verdict, colour, label in ((True, "tab:green", "plan met the target"),
                                       (False, "tab:red", "plan fell short")):
            picked = [(x, y) for x, y, p in zip(sizes, values, passed) if bool(p) == verdict]
            if picked:  # one artist per verdict: the legend names the dots' colours
                ax_plan.scatter(*zip(*picked), color=colour, zorder=3, label=label)
        for i, (x, y) in enumerate(zip(sizes, values)):
            ax_plan.annotate(str(i + 1), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    else:
        ax_plan.text(0.5, 0.5, "no plan search ran", ha="center", va="center", transform=ax_plan.transAxes,
                     fontsize=9)
    if target is not None:
        ax_plan.axhline(target, color="tab:red", linestyle="--", linewidth=1,
                        label=f"target ({target:g} x float)" if tasks else f"target ({target:g} dB)")
    if ax_plan.get_legend_handles_labels()[0]:
        ax_plan.legend(fontsize=8)
    ax_plan.set_xlabel("candidates raised")
    ax_plan.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_plan.set_ylabel(f"{_text(tasks[0])} / float" if tasks else "output SQNR (dB)")
    ax_plan.set_title("the plan search (evaluations numbered)", fontsize=9)
    ax_plan.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_fix(frame: pd.DataFrame, changes: pd.DataFrame, meta: dict, path: str | Path) -> Path:
    """Left: the quantized model's output SQNR against float, as given and after each method
    tried (``qdebug.tools.fix``): kept in green, tried and dropped in grey (the tick says why: its
    float output moved, or the gain was too small), a method that changed nothing without a bar;
    under each measured method, how far its float model is from the original's. Right: cross-layer
    equalization's effect on each pair's weight range ratio (the worse of the pair's two layers,
    max/mean channel range), before and after, when it changed any pair."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    pairs = changes[(changes["method"] == "equalize") & changes["applied"].astype(bool)] \
        if "range_ratio_before" in changes else changes.iloc[:0]
    fig, axes = plt.subplots(1, 2 if len(pairs) else 1, figsize=(12 if len(pairs) else 6, 4.8), squeeze=False)
    ax = axes[0][0]
    labels, values, colours = ["as given"], [meta["baseline_sqnr_db"]], ["tab:blue"]
    for row in frame.to_dict("records"):
        if math.isnan(row["sqnr_after_db"]):
            labels.append(f"{_text(row['method'])}\n(no change)")
        else:
            float_db = row["float_sqnr_db"]
            verdict = "kept" if row["kept"] else "dropped:\nfloat moved" if float_db < 80 and \
                row["method"] != "bias_correction" else "dropped"
            labels.append(f"{_text(row['method'])}\n{verdict}\n(float {float_db:.0f} dB)")
        values.append(row["sqnr_after_db"])
        colours.append("tab:green" if row["kept"] else "tab:gray")
    xs = list(range(len(labels)))
    shown = [v for v in values if math.isfinite(v)]
    # From 0 where every value is positive (a 0.2 dB gain looks as small as it is), else below the lowest.
    low = 0.0 if min(shown, default=0.0) > 0 else min(shown) - 3.0
    ax.bar(xs, [v - low if math.isfinite(v) else 0.0 for v in values], bottom=low, color=colours)
    for x, v in zip(xs, values):
        if math.isfinite(v):
            ax.annotate(f"{v:.2f}", (x, v), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    ax.axhline(meta["fixed_sqnr_db"], color="tab:green", linestyle="--", linewidth=1,
               label=f"fixed: {meta['fixed_sqnr_db']:.2f} dB")
    ax.set_ylim(low, max(shown, default=1.0) * 1.3 if low == 0 else max(shown) + 6)  # room for the legend
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("quantized output SQNR vs float (dB)")
    held = f"{meta['held_out']} held-out batch(es)" if meta["held_out"] else f"{meta['batches']} batch(es)"
    ax.set_title(f"each method, calibrated alike (measured on {held})", fontsize=9)
    ax.legend(handles=[Patch(color="tab:green", label="kept"), Patch(color="tab:gray", label="dropped"),
                       *ax.get_legend_handles_labels()[0]], fontsize=7, loc="upper left", ncol=3)
    ax.grid(alpha=0.3, axis="y")
    if len(pairs):
        right = axes[0][1]
        ys = list(range(len(pairs)))
        right.scatter(pairs["range_ratio_before"], ys, color="tab:red", label="before", zorder=3)
        right.scatter(pairs["range_ratio_after"], ys, color="tab:green", label="after", zorder=3)
        for y, (a, b) in enumerate(zip(pairs["range_ratio_before"], pairs["range_ratio_after"])):
            right.plot([a, b], [y, y], color="tab:gray", linewidth=0.8)
        right.set_xscale("log")
        ratios = [v for v in (*pairs["range_ratio_before"], *pairs["range_ratio_after"]) if math.isfinite(v)]
        # Round ticks inside the range drawn: a log axis spanning less than a decade has no label of its own.
        nice = [m * 10 ** e for e in range(0, 7) for m in (1, 1.5, 2, 3, 5, 7)]
        right.set_xticks([t for t in nice if min(ratios, default=1) / 1.1 <= t <= max(ratios, default=1) * 1.1])
        right.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        right.xaxis.set_minor_formatter(NullFormatter())  # 1.3x10^0, 1.4x10^0... overlapped
        right.set_yticks(ys)
        right.set_yticklabels([f"{_text(a)} > {_text(b)}" for a, b in zip(pairs["layer1"], pairs["layer2"])],
                              fontsize=6 if len(pairs) > 20 else 8)
        right.invert_yaxis()
        right.set_xlabel("weight range ratio, max / mean channel\n(the pair's worse layer; 1: balanced)", fontsize=8)
        kept = bool(frame.loc[frame["method"] == "equalize", "kept"].any())
        right.set_title("cross-layer equalization, per pair" + ("" if kept else " (tried; dropped: not in the model written)"),
                        fontsize=9)
        right.legend(fontsize=8)
        right.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return _save(fig, path)


def plot_outlier_channels(layer: str, evidence: dict, path: str | Path, *, reference: str, target: str) -> Path:
    """The picture behind an ``outlier_channels`` diagnosis (``qdebug.tools.compare``'s
    ``CompareResult.outliers``): top, each channel's range (min to max) of the reference's output
    at ``layer``, the widest channel in red; bottom, when a weighted layer follows, the share of
    its weights on each input channel that quantize to code 0 in ``target``, the same channel
    in red -- the weights shrunk to compensate the wide channel, rounded away."""
    low, high = evidence["channel_min"].tolist(), evidence["channel_max"].tolist()
    channel = evidence["channel"]
    downstream = evidence.get("downstream_zero_codes")
    panels = 2 if downstream is not None else 1
    fig, axes = plt.subplots(panels, 1, figsize=(min(max(7, len(low) * 0.12), 20) + 2.5, 3.6 * panels + 0.4),
                             squeeze=False)
    xs = list(range(len(low)))

    def colours(n: int) -> list[str]:
        return ["tab:red" if i == channel else "tab:blue" for i in range(n)]

    ax = axes[0, 0]
    ax.bar(xs, [h - lo for lo, h in zip(low, high)], bottom=low, color=colours(len(low)), width=0.8)
    ax.axhline(0.0, color="gray", linewidth=0.8)
    # The median as the range ratio takes it (qdebug.measure.stats: torch's, the lower middle).
    median = float((evidence["channel_max"] - evidence["channel_min"]).clamp(min=0).median())
    outlier = f"channel {channel}: {evidence['channel_range_ratio']:.0f}x\nthe median channel's range"
    others = "the other channels: min to max"
    scale = evidence.get("out_scale")
    if scale and median > 0:  # what the per-tensor grid leaves the typical channel
        others += f"\n(the median one spans {median / scale:.1f} steps\nof {_text(target)}'s grid)"
    beside = {"fontsize": 8, "loc": "upper left", "bbox_to_anchor": (1.005, 1.0)}  # never over a bar
    ax.legend(handles=[Patch(color="tab:red", label=outlier), Patch(color="tab:blue", label=others)], **beside)
    ax.set_title(f"{_text(layer)}: each channel's range in {_text(reference)}'s output "
                 f"(outlier_channels in {_text(target)})", fontsize=10)
    ax.set_xlabel(f"output channel of {_text(layer)}")
    ax.set_ylabel(f"{_text(reference)} output value")
    ax.grid(alpha=0.3, axis="y")
    if downstream is not None:
        shares = downstream.tolist()
        name = _text(evidence["downstream_layer"])
        ax = axes[1, 0]
        ax.bar(list(range(len(shares))), shares, color=colours(len(shares)), width=0.8)
        rest = [v for i, v in enumerate(shares) if i != channel]
        handles = [Patch(color="tab:red", label=f"input channel {channel}: {shares[channel]:.0%} on code 0"),
                   Patch(color="tab:blue", label="the other input channels")]
        if rest:
            mean = sum(rest) / len(rest)
            handles.append(ax.axhline(mean, color="gray", linestyle="--", linewidth=1,
                                      label=f"the others' mean ({mean:.0%})"))
        ax.legend(handles=handles, **beside)
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{name} in {_text(target)}: its weights that read each channel, rounded to code 0",
                     fontsize=10)
        ax.set_xlabel(f"input channel of {name}")
        ax.set_ylabel("share of weights on code 0")
        ax.grid(alpha=0.3, axis="y")
    for ax in axes[:, 0]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return Path(path)


def plot_nan_timeline(frame: pd.DataFrame, path: str | Path, *, first: dict | None) -> Path:
    """The steps before the first non-finite value: loss, largest |weight| and gradient norm (log
    scales when they span more than 100x; symlog when a value is 0), the worst activation point's
    saturation; the failing step marked in red."""
    panels = [("loss", "loss"), ("max_abs_weight", "max |weight|"), ("grad_norm", "gradient norm"),
              ("worst_saturation", "worst saturation")]
    panels = [(c, label) for c, label in panels if c in frame and frame[c].notna().any()] or [("step", "step")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 1.9 * len(panels) + 0.6), sharex=True, squeeze=False)
    steps = list(frame["step"]) if len(frame) else []
    for ax, (column, label) in zip(axes[:, 0], panels):
        values = _finite(frame[column]) if column != "step" else []
        if values:
            ax.plot(steps, values, marker="." if len(steps) < 60 else None, linewidth=1, label=f"{label}, per step")
        shown = [v for v in values if v == v]
        positive = [v for v in shown if v > 0]
        if column != "worst_saturation" and positive and max(positive) / min(positive) > 100:
            if len(positive) < len(shown):  # a 0 (a dead gradient) has no place on a log axis
                ax.set_yscale("symlog", linthresh=min(positive))
            else:
                ax.set_yscale("log")
        elif column == "worst_saturation":
            ax.set_ylim(-0.03, 1.03)
        if ax.get_yscale() == "linear":
            ax.ticklabel_format(axis="y", useOffset=False)
        ax.set_ylabel(label if column != "step" else "", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    if not steps:
        axes[0, 0].text(0.5, 0.5, "no finite step before the first non-finite value", ha="center", va="center",
                        transform=axes[0, 0].transAxes, fontsize=9)
    if first is not None:
        for ax in axes[:, 0]:
            ax.axvline(first["step"], color="tab:red", linestyle="--", linewidth=1,
                       label=f"first non-finite (step {first['step']})")
        axes[0, 0].set_title(_text(f"first non-finite: {first['phase']} of step {first['step']}, {first['layer']} "
                                   f"({first['cause']})"), fontsize=9)
    else:
        axes[0, 0].set_title(f"all {len(steps)} step(s) finite", fontsize=9)
    axes[-1, 0].set_xlabel("step")
    for ax in axes[:, 0]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return _save(fig, path)
