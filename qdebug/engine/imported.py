"""What an engine model keeps of where it came from: the import report and the import flow.

A model built from someone else's quantized model (``qdebug.interop``: torch.ao eager, FX, PT2E;
``qdebug.onnx``: a QDQ file ONNX Runtime quantized) carries on its engine state the import report
-- one row per source quantizer and per engine point left float, ``REPORT_COLUMNS`` -- and the flow
it came from ("eager-qat", "onnx-qdq", ...).  A checkpoint saves both (``meta["import"]``,
``meta["import_flow"]``) and a loaded one puts them back, so the engine, the checkpoint and the
tools read them here without depending on the importers.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from qdebug.engine.state import engine_state

REPORT_COLUMNS = ["source", "kind", "point", "status", "spec", "scale_min", "scale_max", "note"]
REPORT_ATTR = "import_report"  # on the engine state; saved in the checkpoint's meta["import"]
FLOW_ATTR = "import_flow"  # on the engine state: the torch.ao flow; saved as meta["import_flow"]


def import_report(model: nn.Module) -> list[dict[str, Any]]:
    """The import report of an engine model built by ``qdebug.interop.build`` (rows of
    ``REPORT_COLUMNS``), or []."""
    return list(getattr(engine_state(model), REPORT_ATTR, None) or [])
