"""The float-side fixes: transforms of a float model that keep int8 deployable.

Each takes the user's float ``nn.Module`` and returns a new one of the same class with the same
module tree (a float checkpoint of it saves and loads like the original), plus a report
(a DataFrame) of what it changed and what it skipped, and why:

- ``equalize``: cross-layer equalization (Nagel et al. 2019) -- BN folded, then the channels of
  consecutive conv/linear pairs (through a ReLU, or a ReLU6 inside its clip on given batches)
  rescaled so both layers' per-channel weight ranges match; the float function is unchanged.
- ``absorb_high_bias``: high-bias absorption -- a ReLU's input that never falls below c_i > 0 on
  the data gives c_i to the next layer's bias, shrinking the activation's range.
- ``smooth``: SmoothQuant -- activation outlier channels after a norm migrated into the weights
  of the Linear layers that read it.
- ``correct_bias``: empirical bias correction -- the mean error quantization adds to each
  layer's output, measured on the data, taken out of its bias (changes the float function).

The package itself is callable: ``qdebug.fix(model, batches, qconfig=...)`` runs them in order,
calibrates the original and each result with the same qconfig, keeps what helps and returns
``(fixed_model, frame)`` (``qdebug.api.fix``; the command line's ``qdebug fix``; docs/fix.md).
"""

import sys
import types

from qdebug.fix.absorb import absorb_high_bias
from qdebug.fix.bias_correction import correct_bias
from qdebug.fix.equalize import equalize
from qdebug.fix.smooth import smooth

__all__ = ["equalize", "absorb_high_bias", "smooth", "correct_bias"]


class _CallableModule(types.ModuleType):
    """``qdebug.fix`` is the package of the transforms and, called, the proven pipeline."""

    def __call__(self, *args, **kwargs):
        from qdebug.api import fix

        return fix(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
