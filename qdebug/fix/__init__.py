"""The float-side fixes: transforms of a float model that keep int8 deployable.

Each takes the user's float ``nn.Module`` and returns a new one of the same class with the same
module tree (a float checkpoint of it saves and loads like the original), plus a report
(a DataFrame) of what it changed and what it skipped, and why.

- ``equalize``: cross-layer equalization (Nagel et al. 2019) -- BN folded, then the channels of
  consecutive conv/linear pairs (through a ReLU, or a ReLU6 inside its clip on given batches)
  rescaled so both layers' per-channel weight ranges match; the float function is unchanged
  (docs/fix.md).
"""

from qdebug.fix.equalize import equalize

__all__ = ["equalize"]
