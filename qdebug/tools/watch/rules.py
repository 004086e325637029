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
  integer code they had two steps before, and at least ``OSCILLATION_REPEAT`` of those flipped
  back at the previous look too (``oscillation_repeat``), in at least ``PERSISTENT_LOOKS`` looks.
  The repeat is what tells oscillation from noise: an 8-bit QAT run at its usual lr (the demo's,
  0.002 with momentum) flips 10-15% of its depthwise weights back at a look, but the same weights
  again mostly by chance (1-4% of all: 12-22% of the flips, 31% at one look of one layer);
  weights planted on their boundaries repeat 35-53% of theirs, look after look.  Such
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
  some activation point clips more than ``DEAD_SATURATION`` of its input and the loss is no
  lower than ``DEAD_LOSS_FRACTION`` of the first look's (the batches differ, and a dead
  network's constant output can score a little below a live one's first loss; a run whose
  gradient vanished because it converged has a loss far below that) -- or whatever the loss,
  when a point clips ``DEAD_TOTAL_SATURATION`` (99%) of its input: the pretrained
  EfficientNet-Lite0 at lr 1e6 goes from loss 5.9 to a constant output's 1.39 with its gradient
  exactly 0 and points clipping 100%, and no converged run clips so.  With clipped
  straight-through estimators nothing outside a range passes a gradient: every value past the
  ranges (weights blown up by too large a learning rate) leaves the run unable to move again,
  though every value stays finite (nan-trace reports nothing).  The most saturated point, not
  the median: a dead network's points split into those past their ranges (95-100% clipped)
  and those whose input is all zeros after a clip (0%: the demo's QAT checkpoint at lr 1e4,
  whose median is 0); a healthy calibrated run clips a few percent at most.

- ``scale_collapse``: a point's or layer's scale (a learned one: lsq, qte) falls below
  ``1 / COLLAPSE_FACTOR`` of its first look's in at least ``PERSISTENT_LOOKS`` looks -- for an
  activation point, also relative to the data's range it received, so a scale following
  data that shrinks is no collapse (nor is a fixed scale that data outgrow:
  ``range_frozen_early``).  A scale heading to 0 leaves every value past a few grid
  steps clipped (all of them past ``qmax * s``): the layer's output degenerates to a few
  levels, and with LSQ the scale's own gradient shrinks with it.  Weight decay on the scale
  parameters (a step ``s *= 1 - lr * wd`` every step) or too large a learning rate for them are
  the usual causes.  ``COLLAPSE_FACTOR`` = 10: a calibrated or running range moves by tens of
  percent in a run (the small zoo ResNet's healthy run: under 10%), a 10x smaller step is 3.3
  bits of the grid's range gone.
- ``grid_too_coarse_for_lr``: at every look (at least ``PERSISTENT_LOOKS``) a layer's weights
  get a gradient and move (``update_to_step`` > 0), yet by less than ``GRID_UPDATE`` of a grid
  step a step and with no more than ``CODE_STILL`` of them changing integer code.  Latent
  weights sit a quarter step from a rounding boundary on average: at ``GRID_UPDATE`` = 0.001
  a weight needs 250 steps of updates of one sign to change code (a random walk, 250^2):
  training does nothing to the quantized weights.  The small zoo ResNet at lr 0.01 moves its
  weights 0.007-0.15 of a step a step.  A layer that does not move at all (lr 0, frozen) is
  not this rule's.
- ``range_frozen_early``: an activation point's tracked range stays where the first look saw
  it (each end within ``RANGE_STILL`` of its width) while the data it receives grows past it:
  its saturation rises at least ``SATURATION_RISE`` above the first look's and the data's
  range spans at least ``RANGE_OUTGROWN`` times the tracked one, in at least
  ``PERSISTENT_LOOKS`` looks.  A range frozen after calibration (or an observer disabled too
  early) cannot follow activations that QAT makes grow; every value past it is clipped.  Not
  reported on a dead run, whose saturation is its symptom (``dead_run`` says so).
"""

from __future__ import annotations

import math

FINDING_COLUMNS = ["rule", "name", "from_step", "evidence", "fix"]

EARLY_LOOKS = 2  # ema_startup_bias: the first looks judged (one may be an outlier batch)
RANGE_INSIDE_DATA = 0.5  # tracked range / data range below which the range is "far inside" the data
OSCILLATION_FRACTION = 0.1  # a layer's weights flipping back per step (Nagel 2022 saw 10-20% in depthwise layers)
OSCILLATION_REPEAT = 0.3  # share of a look's flip-backs that flipped back at the previous look too: stuck weights
PERSISTENT_LOOKS = 2  # looks a rate must exceed its threshold in: one noisy step is no finding
BN_DRIFT = 0.05  # a normalisation's relative error: -26 dB, past int8's own noise
DEAD_GRAD_RATIO = 1e-3  # gradient norm fallen this far below the first look's: nothing trains
DEAD_SATURATION = 0.5  # the most saturated point's clipped fraction: most of its input past the range
DEAD_TOTAL_SATURATION = 0.99  # ... all but a trace of it: dead whatever the loss did
DEAD_LOSS_FRACTION = 0.5  # a dead run's loss stays above this fraction of the first look's
COLLAPSE_FACTOR = 10.0  # a scale this many times below its first look's (relative to its data): collapsed
GRID_UPDATE = 1e-3  # a step's mean update in grid steps below which codes take >= 250 steps to move
CODE_STILL = 1e-3  # fraction of sampled weights changing code: none, below ~1000 sampled weights
RANGE_STILL = 1e-3  # a tracked range end's move (in the range's width) counted as not moving
SATURATION_RISE = 0.02  # saturated fraction above the first look's: values are being clipped
RANGE_OUTGROWN = 1.25  # data range / tracked range: the data outgrew the range


def findings(timeline):
    """The findings of every rule on ``timeline`` (module docstring): a DataFrame with
    ``FINDING_COLUMNS``, empty when the run looks healthy."""
    import pandas as pd

    rows = []
    for rule in (ema_startup_bias, oscillation, bn_drift, dead_run, scale_collapse, grid_too_coarse_for_lr):
        rows += rule(timeline)
    if not any(row[0] == "dead_run" for row in rows):  # a dead run's saturation is its symptom
        rows += range_frozen_early(timeline)
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
        if "oscillation_repeat" not in rows:
            continue
        # Stuck weights flip back at look after look; a noisy update's flips mostly do not repeat
        # (by chance only the previous look's fraction of them does: 1-4% on the demo's QAT run).
        over = rows[(rows["oscillation"] > OSCILLATION_FRACTION)
                    & (rows["oscillation_repeat"] >= OSCILLATION_REPEAT * rows["oscillation"])]
        if len(over) < PERSISTENT_LOOKS:
            continue
        distance = rows["boundary_distance"].median() if "boundary_distance" in rows else math.nan
        found.append(["oscillation", name, int(over.index[0]),
                      f"{len(over)} of {len(rows)} looks with more than {OSCILLATION_FRACTION:.0%} of the weights "
                      f"flipping back to their code of two steps before (median {rows['oscillation'].median():.1%}, "
                      f"max {rows['oscillation'].max():.1%}), the same weights again at "
                      f"{(over['oscillation_repeat'] / over['oscillation']).median():.0%} of them; mean distance to a "
                      f"rounding boundary "
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
    # The most saturated point, not the median: a dead network's points split into those past their
    # range (95-100% clipped) and those before a clip whose input is all zeros (0%; the demo at lr 1e4).
    saturation = points["saturation"].groupby(level="step").max()
    saturating = (points["saturation"] > 0.5).groupby(level="step").sum()
    peak = saturation.reindex(model.index).fillna(0)
    # A point clipping all but a trace of its input is past any converged run: the loss condition
    # then waits for nothing (a dead EfficientNet-Lite0's constant output scored below its first loss).
    stuck = (model["loss"] >= DEAD_LOSS_FRACTION * first_loss) | (peak >= DEAD_TOTAL_SATURATION)
    dead = model[(model["grad_norm"] <= DEAD_GRAD_RATIO * first_grad) & stuck & (peak > DEAD_SATURATION)]
    if len(dead) < PERSISTENT_LOOKS:
        return []
    step = int(dead.index[0])
    return [["dead_run", "", step,
             f"from step {step} ({len(dead)} looks): gradient norm {dead['grad_norm'].iloc[0]:.3g} against "
             f"{first_grad:.3g} at the first look, {int(saturating[step])} point(s) clipping more than half their input "
             f"(up to {saturation[step]:.0%}), "
             f"loss {dead['loss'].iloc[0]:.4g} (first {first_loss:.4g}, last {model['loss'].iloc[-1]:.4g}): the "
             "straight-through estimator passes no gradient outside the ranges, so the run cannot recover",
             "restart from a checkpoint before the step with a learning rate 10-1000x lower (or gradient "
             "clipping); qdebug nan-trace finds nothing here, as every value stays finite"]]


def _collapsed(scale, first: float):
    """Looks where ``scale`` is below ``1 / COLLAPSE_FACTOR`` of ``first`` (a positive number)."""
    return scale[scale < first / COLLAPSE_FACTOR] if first > 0 else scale.iloc[:0]


def scale_collapse(timeline) -> list[list]:
    found = []
    points = _wide(timeline, "point")
    if _has(points, "scale", "data_min", "data_max"):
        for name, rows in points.groupby(level="name"):
            rows = rows.droplevel("name").dropna(subset=["scale", "data_min", "data_max"])
            rows = rows[rows["data_max"] > rows["data_min"]]
            if rows.empty:
                continue
            relative = rows["scale"] / (rows["data_max"] - rows["data_min"])  # per unit of the data's range
            over = _collapsed(relative, relative.iloc[0])  # shrinking, and not with its data ...
            over = over[over.index.isin(_collapsed(rows["scale"], rows["scale"].iloc[0]).index)]  # ... nor a fixed one outgrown
            if len(over) < PERSISTENT_LOOKS:
                continue
            step = int(over.index[0])
            sat = rows["saturation"].get(step, math.nan) if "saturation" in rows else math.nan
            found.append(["scale_collapse", name, step,
                          f"scale {rows['scale'].iloc[0]:.4g} -> {rows.loc[step, 'scale']:.4g} at step {step} (last "
                          f"{rows['scale'].iloc[-1]:.4g}): {_times_smaller(rows['scale'].iloc[0], rows.loc[step, 'scale'])}, "
                          f"while the data's range went {rows['data_max'].iloc[0] - rows['data_min'].iloc[0]:.4g} -> "
                          f"{rows.loc[step, 'data_max'] - rows.loc[step, 'data_min']:.4g}; {len(over)} looks"
                          + (f"; saturating {sat:.0%}" if not math.isnan(sat) else ""),
                          _COLLAPSE_FIX])
    layers = _wide(timeline, "layer")
    if _has(layers, "scale"):
        for name, rows in layers.groupby(level="name"):
            scale = rows.droplevel("name")["scale"].dropna()
            if scale.empty:
                continue
            over = _collapsed(scale, scale.iloc[0])
            if len(over) < PERSISTENT_LOOKS:
                continue
            step = int(over.index[0])
            found.append(["scale_collapse", name, step,
                          f"weight scale {scale.iloc[0]:.4g} -> {scale[step]:.4g} at step {step} (last {scale.iloc[-1]:.4g}): "
                          f"{_times_smaller(scale.iloc[0], scale[step])}, {len(over)} looks", _COLLAPSE_FIX])
    return sorted(found, key=lambda f: f[2])


def _times_smaller(first: float, now: float) -> str:
    return f"{first / now:.0f}x smaller" if now > 0 else "down to 0 or below (an invalid scale)"


_COLLAPSE_FIX = ("exclude the scale parameters from weight decay (an optimizer parameter group with weight_decay=0), "
                 "give them a lower learning rate, or start them from calibration; restart from before the collapse")


def grid_too_coarse_for_lr(timeline) -> list[list]:
    layers = _wide(timeline, "layer")
    if not _has(layers, "update_to_step", "code_change", "grad_norm"):
        return []
    found = []
    for name, rows in layers.groupby(level="name"):
        rows = rows.droplevel("name").dropna(subset=["update_to_step", "code_change", "grad_norm"])
        if len(rows) < PERSISTENT_LOOKS:
            continue
        still = (rows["grad_norm"] > 0) & (rows["update_to_step"] > 0) & (rows["update_to_step"] < GRID_UPDATE) \
            & (rows["code_change"] <= CODE_STILL)
        if not bool(still.all()):
            continue
        found.append(["grid_too_coarse_for_lr", name, int(rows.index[0]),
                      f"at all {len(rows)} looks its weights moved {rows['update_to_step'].median():.2g} of a grid step "
                      f"a step (median; max {rows['update_to_step'].max():.2g}) and {rows['code_change'].max():.2%} at most "
                      f"changed integer code: about {0.25 / rows['update_to_step'].median():.0f} steps of one sign to "
                      "cross a rounding boundary (a quarter step away on average)",
                      "raise the learning rate (the updates should be a sizeable fraction of a grid step: "
                      f"0.01-0.1 of one a step), or train {name} in float first; at this lr QAT changes nothing "
                      "in the quantized network"])
    return found


def range_frozen_early(timeline) -> list[list]:
    points = _wide(timeline, "point")
    if not _has(points, "range_min", "range_max", "data_min", "data_max", "saturation"):
        return []
    found = []
    for name, rows in points.groupby(level="name"):
        rows = rows.droplevel("name").dropna(subset=["range_min", "range_max", "data_min", "data_max", "saturation"])
        if len(rows) <= PERSISTENT_LOOKS:
            continue
        first = rows.iloc[0]
        width = first["range_max"] - first["range_min"]
        if not width > 0:
            continue
        still = ((rows["range_min"] - first["range_min"]).abs() <= RANGE_STILL * width) \
            & ((rows["range_max"] - first["range_max"]).abs() <= RANGE_STILL * width)
        outgrown = (rows["saturation"] >= first["saturation"] + SATURATION_RISE) \
            & (rows["data_max"] - rows["data_min"] >= RANGE_OUTGROWN * width)
        over = rows[still & outgrown]
        if len(over) < PERSISTENT_LOOKS:
            continue
        step = int(over.index[0])
        last = rows.iloc[-1]
        found.append(["range_frozen_early", name, step,
                      f"tracked range [{first['range_min']:.4g}, {first['range_max']:.4g}] unchanged since step "
                      f"{int(rows.index[0])} while the data grew to [{over.loc[step, 'data_min']:.4g}, "
                      f"{over.loc[step, 'data_max']:.4g}] at step {step} ([{last['data_min']:.4g}, {last['data_max']:.4g}] "
                      f"at the last look); saturation {first['saturation']:.1%} -> {over.loc[step, 'saturation']:.1%} "
                      f"(last {last['saturation']:.1%})",
                      f"let {name}'s observer run during QAT (set_mode(model, 'fake', observe=True): running ranges; "
                      "ema for a smooth one) or learn the range (estimator='lsq'), and freeze it only once the "
                      "activations settle; or recalibrate"])
    return sorted(found, key=lambda f: f[2])
