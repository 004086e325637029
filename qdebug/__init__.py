"""qdebug: precision debugging for quantized PyTorch models.

Python API (the CLI is a thin layer over the same functions):

    import qdebug
    model, info = qdebug.load("qat.pt")          # any of the four stages, safely
    qdebug.save(model, "calibrated.pt", stage="calibrated")
    frame = qdebug.compare("float.pt", "qat.pt", data="eval.pt")   # per-layer DataFrame
"""

from qdebug.api import compare
from qdebug.checkpoint import load, save
from qdebug.errors import QDebugError

__all__ = ["load", "save", "compare", "QDebugError"]
