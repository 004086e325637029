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

__all__ = ["from_torch_ao", "import_check", "import_report", "TorchStage"]


def __getattr__(name: str) -> Any:
    if name == "TorchStage":  # torch's own kernels as a compare stage (docs/interop.md)
        from qdebug.interop.torch_stage import TorchStage

        return TorchStage
    raise AttributeError(f"module 'qdebug.interop' has no attribute {name!r}")


def from_torch_ao(model: nn.Module, example_inputs: Any, *, float_model: nn.Module | None = None,
                  qat_mode: str = "with_bn_reverse_fold", check: bool = True) -> nn.Module:
    """An engine model computing what the torch.ao ``model`` computes, with the float model's names.

    ``model``: prepared (eager ``prepare_qat``/``prepare``, FX ``prepare_qat_fx``/``prepare_fx``,
    PT2E ``prepare_qat_pt2e``/``prepare_pt2e``) or converted.  ``example_inputs``: one batch
    (traces both models).  ``float_model``: an instance of the user's architecture; required for
    FX and PT2E graphs, which do not keep it (its weights are replaced by the source's).
    ``qat_mode``: how torch's Conv-BN modules map; the default, with_bn_reverse_fold, is torch's
    own scheme and bit-identical, fuse_bn folds them (equal within float rounding).
    ``check``: run torch's model and the import on ``example_inputs`` and compare them
    (``qdebug.interop.check``: rows that differ become ``approximate``, an unexplained mismatch
    is refused; the result is ``import_check(model)``); False imports unchecked.
    """
    from qdebug.interop.build import build

    if not isinstance(model, nn.Module):
        raise QDebugError(f"from_torch_ao needs an nn.Module, got {type(model).__name__}",
                          "pass the model returned by torch.ao's prepare/prepare_qat/convert")
    flow = detect_flow(model)
    if flow is None:
        raise QDebugError(f"{type(model).__name__} holds no torch.ao quantizer",
                          "pass a model prepared or converted by torch.ao.quantization or torchao's PT2E")
    if flow in ("fx", "pt2e", "fx-converted", "pt2e-converted") and float_model is None:
        raise QDebugError(f"a {flow} graph does not keep your model class: pass float_model=",
                          "float_model=YourNet() (any weights: the source's replace them) gives the engine "
                          "model your module paths")
    if flow == "eager":
        from qdebug.interop.eager import read_eager

        source, plan = read_eager(model, example_inputs)
    elif flow == "fx":
        from qdebug.interop.fx import read_fx

        source, plan = read_fx(model, example_inputs, float_model)
    elif flow == "pt2e":
        from qdebug.interop.pt2e import read_pt2e

        source, plan = read_pt2e(model, example_inputs, float_model)
    elif flow == "pt2e-converted":
        from qdebug.interop.pt2e import read_pt2e_converted

        source, plan = read_pt2e_converted(model, example_inputs, float_model)
    else:
        from qdebug.interop.converted import read_converted

        source, plan = read_converted(model, example_inputs, float_model, flow)
    imported = build(source, plan, qat_mode)
    if source.stage == "quantized":
        from qdebug.engine import convert

        imported = convert(imported)  # torch's converted model computes in integers: so does the import
    if check:
        from qdebug.interop.check import self_check

        # fuse_bn folds torch's Conv-BN: equal within float rounding only, as documented
        self_check(model, imported, source, example_inputs, folded_by_choice=qat_mode == "fuse_bn")
    return imported


def detect_flow(model: nn.Module) -> str | None:
    """Which torch.ao flow made ``model``: "eager", "fx", "pt2e", "eager-converted",
    "fx-converted", "pt2e-converted", or None when it holds no torch.ao quantization."""
    import torch
    import torch.fx

    from qdebug.interop.eager import is_eager_prepared

    if isinstance(model, torch.fx.GraphModule):
        aten = any(isinstance(n.target, torch._ops.OpOverload) for n in model.graph.nodes if n.op == "call_function")
        quantizers = any(n.op == "call_module" and str(n.target).startswith("activation_post_process_")
                         for n in model.graph.nodes)
        if quantizers:
            return "pt2e" if aten else "fx"
        if _converted(model) or any(n.op == "call_function" and "quantize_per" in str(n.target)
                                    for n in model.graph.nodes):
            return "pt2e-converted" if aten else "fx-converted"
        return None
    if is_eager_prepared(model):
        return "eager"
    if _converted(model):
        return "eager-converted"
    return None


def _converted(model: nn.Module) -> bool:
    """Whether ``model`` holds torch's quantized modules (``torch.ao.nn.quantized``, intrinsic
    quantized); ``FloatFunctional`` lives there too but is a float module."""
    prefixes = ("torch.ao.nn.quantized", "torch.ao.nn.intrinsic.quantized")
    return any(type(m).__module__.startswith(prefixes) and type(m).__name__ != "FloatFunctional"
               for m in model.modules())


def import_report(model: nn.Module):
    """The import report of a model from ``from_torch_ao`` or an imported checkpoint, as a DataFrame."""
    import pandas as pd

    from qdebug.interop.build import REPORT_COLUMNS, import_report as rows

    return pd.DataFrame(rows(model), columns=REPORT_COLUMNS)


def import_check(model: nn.Module) -> dict:
    """How the import checked itself against torch on the example batch (docs/interop.md, *How the
    import checks itself*): what it compared with, the tolerance, the measured difference; {} when
    not checked."""
    from qdebug.interop.check import import_check as result

    return result(model)
