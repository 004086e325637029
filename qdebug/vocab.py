"""The names the command line offers, in a module that imports nothing heavy.

Help texts and option checks use these before torch or pandas load (a fast
``--help``, instant usage errors); the engine and the tools import the same tuples
from here, so there is one list of each.
"""

STAGES = ("float", "calibrated", "qat", "quantized")
# How quantized a stage is, for choosing a reference: the float model is the truth, fake
# quantization (calibrated, QAT) sits between, integer simulation is furthest from it.
STAGE_RANK = {"float": 0, "calibrated": 1, "qat": 1, "quantized": 2}

OBSERVERS = ("minmax", "ema", "percentile", "mse", "kl")
QAT_MODES = ("fuse_bn", "with_bn", "with_bn_reverse_fold")
# The quantized stage's requantization (qdebug.engine.integer): TFLite's fixed point, ONNX Runtime's float32.
ARITHMETICS = ("fixed_point", "float32")
# qdebug fix's methods, in the order they are applied (qdebug.tools.fix, docs/fix.md).
FIX_METHODS = ("equalize", "absorb", "smooth", "bias_correction")

# compare's metric columns, in display order (docs/compare.md defines each).
COMPARE_METRICS = (
    "cosine", "sqnr_db", "mse", "rel_l2", "max_abs", "max_abs_scales", "mean_abs", "kl", "saturation", "nonfinite",
    "min_channel_sqnr_db", "median_channel_sqnr_db", "channel_range_ratio", "widest_channel",
    "isolated_cosine", "isolated_sqnr_db", "isolated_mse", "isolated_max_abs",
    "isolated_min_channel_sqnr_db", "isolated_median_channel_sqnr_db", "drift_sqnr_db",
)
# compare's default table columns, most useful first (the first ones stay at 80 columns).
COMPARE_DEFAULT_SHOW = (
    "sqnr_db", "isolated_sqnr_db", "cosine", "saturation", "max_abs_scales", "min_channel_sqnr_db",
)
# Metrics where a lower value is worse (sorted ascending by --sort).
COMPARE_LOWER_IS_WORSE = (
    "cosine", "sqnr_db", "isolated_cosine", "isolated_sqnr_db", "min_channel_sqnr_db", "median_channel_sqnr_db",
    "isolated_min_channel_sqnr_db", "isolated_median_channel_sqnr_db", "drift_sqnr_db",
)
