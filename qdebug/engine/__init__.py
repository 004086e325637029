"""qdebug's embedded quantization engine: no files, no terminal, just modules.

    from qdebug.engine import QuantSpec, QConfig, prepare, calibrate, set_mode, quant_points, convert, absorb_bn, FuseBN,
        FreezeBN, freeze_bn_stats
"""

# Registers the SDPA decomposition with the naming context (qdebug.engine.context): loaded
# before any engine module is used, since a package's __init__ runs before its submodules.
from qdebug.engine import sdpa  # noqa: F401
from qdebug.engine.convert import convert
from qdebug.engine.fusebn import FreezeBN, FuseBN, freeze_bn_stats
from qdebug.engine.prepare import (
    absorb_bn, calibrate, engine_state, is_prepared, prepare, quant_points, quantization_off, refresh_weight_qparams,
    set_mode,
)
from qdebug.engine.spec import QConfig, QuantSpec

__all__ = [
    "QuantSpec",
    "QConfig",
    "prepare",
    "calibrate",
    "set_mode",
    "quant_points",
    "convert",
    "absorb_bn",
    "FuseBN",
    "FreezeBN",
    "freeze_bn_stats",
    "engine_state",
    "is_prepared",
    "refresh_weight_qparams",
    "quantization_off",
]
