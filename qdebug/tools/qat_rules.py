"""What a QAT run's timeline says: named rules over ``qdebug.watch``'s timeline (``qat_watch``).

``findings(timeline)`` returns one row per finding -- ``rule``, ``name`` (the point, layer or
BN concerned; "" for the whole model), ``from_step`` (the first look showing it),
``evidence`` (the numbers), ``fix`` -- in the order the rules are listed here, each rule's
findings by step.  A rule with too few looks to judge stays silent: a false alarm on a healthy
run is a bug.

- ``ema_startup_bias`` (seed 000): at each of the first ``EARLY_LOOKS`` looks where an
  activation point saw data, its observer's tracked range covers less than
  ``RANGE_INSIDE_DATA`` of the data's range.  An EMA started from 0 without bias correction
  holds ``1 - (1 - c)^t`` of the range after t steps (0.1 after 10 steps at c = 0.01): every
  value past it saturates, long before any NaN.  A range set by calibration or by the first
  batch covers about all of a batch's data (a healthy run's first looks: 0.85 and up).
- ``oscillation`` (Nagel et al., "Overcoming Oscillations in Quantization-Aware Training",
  2022): more than ``OSCILLATION_FRACTION`` of a layer's sampled weights flip back to the
  integer code they had two steps before, in at least ``PERSISTENT_LOOKS`` looks.  Such
  weights sit on a rounding boundary and the optimizer pushes them across it and back every
  step; the quantized network the run ends on is a coin toss between two codes each, and BN
  statistics are estimated on a network that keeps changing.  A healthy 8-bit run flips back
  a few percent at most.
- ``bn_drift``: a BN's drift -- the larger of its running mean's move in the float model's
  standard deviations and half its running variance's relative change (about the standard
  deviation's) -- exceeds ``BN_DRIFT`` in the median BN, in at least ``PERSISTENT_LOOKS``
  looks.  A normalisation off by a relative e is noise at about 20 log10(e) dB in its layer:
  ``BN_DRIFT`` = 0.05 is -26 dB, more than int8 quantization's own noise (-35 to -40 dB a
  layer), from statistics alone (small batches: this project saw 20.9 -> 4.4 dB in eight steps
  of batch 4).  Measured on the small zoo ResNet, the median BN drifts about 0.08 on batches
  of 4, 0.03 on batches of 32 and 0.01 on batches of 64 (sampling noise, lr 0 or 0.01 alike).
- ``dead_run``: a run alive at its first look (gradient norm > 0) whose gradient norm falls
  below ``DEAD_GRAD_RATIO`` of that first one, in at least ``PERSISTENT_LOOKS`` looks, while
  the median activation point saturates more than ``DEAD_SATURATION`` of its input and the
  loss is no lower than at the first look.  With clipped straight-through estimators nothing
  outside a range passes a gradient: every value past the ranges (weights blown up by too
  large a learning rate) leaves the run unable to move again, though every value stays finite
  (nan-trace reports nothing).  ``DEAD_SATURATION`` is 0.25, not near 1: a point after a
  ReLU keeps its zeros inside the range, so it saturates at most about half its values.

Not yet: ``scale_collapse``, ``grid_too_coarse_for_lr``, ``range_frozen_early``.
"""

from __future__ import annotations

import math

FINDING_COLUMNS = ["rule", "name", "from_step", "evidence", "fix"]

EARLY_LOOKS = 2  # ema_startup_bias: the first looks judged (one may be an outlier batch)
RANGE_INSIDE_DATA = 0.5  # tracked range / data range below which the range is "far inside" the data
OSCILLATION_FRACTION = 0.1  # a layer's weights flipping back per step (Nagel 2022 saw 10-20% in depthwise layers)
PERSISTENT_LOOKS = 2  # looks a rate must exceed its threshold in: one noisy step is no finding
BN_DRIFT = 0.05  # a normalisation's relative error: -26 dB, past int8's own noise
DEAD_GRAD_RATIO = 1e-3  # gradient norm fallen this far below the first look's: nothing trains
DEAD_SATURATION = 0.25  # median point's saturated fraction (a ReLU's point saturates at most ~half)


def findings(timeline):
    """The findings of every rule on ``timeline`` (module docstring): a DataFrame with
    ``FINDING_COLUMNS``, empty when the run looks healthy."""
    import pandas as pd

    rows = []
    for rule in (ema_startup_bias, oscillation, bn_drift, dead_run):
        rows += rule(timeline)
    return pd.DataFrame(rows, columns=FINDING_COLUMNS)


def _wide(timeline, kind: str):
    """One row per (step, name) of ``kind``, one column per metric."""
    part = timeline[timeline["kind"] == kind]
    if part.empty:
        return part
    return part.pivot_table(index=["name", "step"], columns="metric", values="value", aggfunc="last")


def _has(frame, *columns: str) -> bool:
    return not frame.empty and all(c in frame.columns for c in columns)


def ema_startup_bias(timeline) -> list[list]:
    points = _wide(timeline, "point")
    if not _has(points, "range_min", "range_max", "data_min", "data_max"):
        return []
    found = []
    for name, rows in points.groupby(level="name"):
        rows = rows.droplevel("name").dropna(subset=["range_min", "range_max", "data_min", "data_max"])
        data = rows["data_max"] - rows["data_min"]
        rows = rows[data > 0]
        early = rows.head(EARLY_LOOKS)
        if early.empty:
            continue
        covered = (early["range_max"] - early["range_min"]) / (early["data_max"] - early["data_min"])
        if not bool((covered < RANGE_INSIDE_DATA).all()):
            continue
        first = early.iloc[0]
        sat = f", saturating {first['saturation']:.0%} of it" if not math.isnan(first.get("saturation", math.nan)) \
            else ""
        trend = "; ".join(f"step {int(s)}: {c:.0%}" for s, c in covered.items())
        found.append(["ema_startup_bias", name, int(early.index[0]),
                      f"tracked range [{first['range_min']:.4g}, {first['range_max']:.4g}] covers {covered.iloc[0]:.1%} "
                      f"of the data's [{first['data_min']:.4g}, {first['data_max']:.4g}]{sat} (covered: {trend})",
                      "start the observer's range from the first batch's, never from 0 (qdebug's ema observer "
                      "does), or calibrate before QAT; then restart the run"])
    return sorted(found, key=lambda f: f[2])


def oscillation(timeline) -> list[list]:
    layers = _wide(timeline, "layer")
    if not _has(layers, "oscillation"):
        return []
    found = []
    for name, rows in layers.groupby(level="name"):
        rows = rows.droplevel("name").dropna(subset=["oscillation"])
        over = rows[rows["oscillation"] > OSCILLATION_FRACTION]
        if len(over) < PERSISTENT_LOOKS:
            continue
        distance = rows["boundary_distance"].median() if "boundary_distance" in rows else math.nan
        found.append(["oscillation", name, int(over.index[0]),
                      f"{len(over)} of {len(rows)} looks with more than {OSCILLATION_FRACTION:.0%} of the weights "
                      f"flipping back to their code of two steps before (median {rows['oscillation'].median():.1%}, "
                      f"max {rows['oscillation'].max():.1%}); mean distance to a rounding boundary "
                      f"{distance:.3f} steps (0.25 when spread evenly)",
                      f"freeze {name}'s oscillating weights at their most frequent code, or dampen them (a loss "
                      "term pulling latent weights toward their grid points), as Nagel et al. 2022 do; or lower "
                      "the learning rate"])
    return sorted(found, key=lambda f: f[2])


def bn_drift(timeline) -> list[list]:
    bns = _wide(timeline, "bn")
    if not _has(bns, "mean_drift", "var_drift"):
        return []
    drift = bns["mean_drift"].combine(bns["var_drift"] / 2, max)
    by_step = drift.groupby(level="step")
    median = by_step.median()
    over = median[median > BN_DRIFT]
    if len(over) < PERSISTENT_LOOKS:
        return []
    step = int(over.index[0])
    at = drift.xs(step, level="step")
    worst = at.idxmax()
    share = int((at > BN_DRIFT).sum())
    return [["bn_drift", worst, step,
             f"{share} of {len(at)} BN layers drifted more than {BN_DRIFT} (relative) from the float model's "
             f"statistics at step {step} (median {over.iloc[0]:.3f}, {len(over)} looks; {worst}: mean drift "
             f"{bns.loc[(worst, step), 'mean_drift']:.3f} std, var drift {bns.loc[(worst, step), 'var_drift']:.1%})",
             "freeze the BN statistics (qdebug.engine.freeze_bn_stats(model), or FreezeBN at a step), or fold BN "
             "(prepare's default fuse_bn, FuseBN); or train on larger batches"]]


def dead_run(timeline) -> list[list]:
    model = _wide(timeline, "model")
    points = _wide(timeline, "point")
    if not _has(model, "grad_norm", "loss") or not _has(points, "saturation"):
        return []
    model = model.droplevel("name").dropna(subset=["grad_norm", "loss"])
    if model.empty or not model["grad_norm"].iloc[0] > 0:
        return []  # never alive, or unknown: nothing died
    first_grad, first_loss = model["grad_norm"].iloc[0], model["loss"].iloc[0]
    saturation = points["saturation"].groupby(level="step").median()
    dead = model[(model["grad_norm"] <= DEAD_GRAD_RATIO * first_grad) & (model["loss"] >= first_loss)]
    dead = dead[saturation.reindex(dead.index).fillna(0) > DEAD_SATURATION]
    if len(dead) < PERSISTENT_LOOKS:
        return []
    step = int(dead.index[0])
    return [["dead_run", "", step,
             f"from step {step} ({len(dead)} looks): gradient norm {dead['grad_norm'].iloc[0]:.3g} against "
             f"{first_grad:.3g} at the first look, the median point saturating {saturation[step]:.0%} of its input, "
             f"loss {dead['loss'].iloc[0]:.4g} (first {first_loss:.4g}, last {model['loss'].iloc[-1]:.4g}): the "
             "straight-through estimator passes no gradient outside the ranges, so the run cannot recover",
             "restart from a checkpoint before the step with a learning rate 10-1000x lower (or gradient "
             "clipping); qdebug nan-trace finds nothing here, as every value stays finite"]]
