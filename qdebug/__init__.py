"""qdebug: precision debugging for quantized PyTorch models.

Python API (the CLI is a thin layer over the same functions):

    import qdebug
    model, info = qdebug.load("qat.pt")          # any of the four stages, safely
    qdebug.save(model, "calibrated.pt", stage="calibrated")
"""

from qdebug.checkpoint import load, save
from qdebug.errors import QDebugError

__all__ = ["load", "save", "QDebugError"]
