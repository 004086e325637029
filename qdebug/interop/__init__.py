"""Bring your own quantized model: torch.ao (eager, FX, PT2E; QAT, PTQ, converted) -> engine.

    qm = qdebug.from_torch_ao(prepared_model, example_inputs=x)
    qdebug.interop.import_report(qm)      # a DataFrame: what mapped where, what did not
    qdebug.save(qm, "qat.pt")             # an ordinary qdebug checkpoint

Front ends (``eager``, ``fx``, ``pt2e``, ``converted``) read a model into a
``SourceModel``; ``build`` makes the engine model.  See docs/interop.md.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from qdebug.errors import QDebugError

__all__ = ["from_torch_ao", "import_report"]


def from_torch_ao(model: nn.Module, example_inputs: Any, *, float_model: nn.Module | None = None,
                  qat_mode: str = "with_bn_reverse_fold") -> nn.Module:
    """An engine model computing what the torch.ao ``model`` computes, with the float model's names.

    ``model``: prepared (eager ``prepare_qat``/``prepare``, FX ``prepare_qat_fx``/``prepare_fx``,
    PT2E ``prepare_qat_pt2e``/``prepare_pt2e``) or converted.  ``example_inputs``: one batch
    (traces both models).  ``float_model``: an instance of the user's architecture; required for
    FX and PT2E graphs, which do not keep it (its weights are replaced by the source's).
    ``qat_mode``: how torch's Conv-BN modules map; the default, with_bn_reverse_fold, is torch's
    own scheme and bit-identical, fuse_bn folds them (equal within float rounding).
    """
    from qdebug.interop.build import build
    from qdebug.interop.eager import is_eager_prepared, read_eager

    if not isinstance(model, nn.Module):
        raise QDebugError(f"from_torch_ao needs an nn.Module, got {type(model).__name__}",
                          "pass the model returned by torch.ao's prepare/prepare_qat/convert")
    if is_eager_prepared(model):
        source, plan = read_eager(model, example_inputs)
    else:
        raise QDebugError(f"{type(model).__name__} holds no torch.ao quantizer",
                          "pass a model prepared or converted by torch.ao.quantization or torchao's PT2E")
    return build(source, plan, qat_mode)


def import_report(model: nn.Module):
    """The import report of a model from ``from_torch_ao`` or an imported checkpoint, as a DataFrame."""
    import pandas as pd

    from qdebug.interop.build import REPORT_COLUMNS, import_report as rows

    return pd.DataFrame(rows(model), columns=REPORT_COLUMNS)
