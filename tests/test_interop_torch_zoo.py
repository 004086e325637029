"""torch's own quantization test zoo, imported: exact, or the import says why not.

``torch.testing._internal.common_quantization`` holds the models torch tests its quantization
on (annotated and plain, functional ops, FloatFunctional, fusions, norms, nested qconfigs).
Code nobody here wrote.  Each model goes through four flows as torch's own tests run them
(eager: ``QuantWrapper`` around a model without stubs, the x86 default qconfig unless the
model carries its own; FX: the x86 default qconfig mapping), random weights and BN statistics:

- ``eager-qat``/``fx-qat``: torch's prepared model (one SGD step, observers off, eval) is
  the oracle: the import gives its bits;
- ``eager-ptq``/``fx-ptq``: torch's converted model (its int8 kernels) is the oracle for
  the import of the converted model, within ``CONVERTED_STEPS`` of its output grid.

Where torch itself fails (no kernel, an unsupported observer) the case is skipped with torch's
error.  Every other case is exact (``steps``: converted, within ``CONVERTED_STEPS``), or a gap
listed in ``KNOWN_GAPS``: an import that differs and whose report says why (rows not
``exact``: unmapped, approximate, moved), or a refusal with its reason.  A silent difference
fails everywhere; a listed gap that gets exact passes (then drop it from the list).

``python tests/test_interop_torch_zoo.py`` prints the outcome table of docs/interop.md.
"""

from __future__ import annotations

import copy
import inspect
import sys
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

from qdebug.errors import QDebugError
from qdebug.interop import from_torch_ao, import_report

tq = pytest.importorskip("torch.ao.quantization")
quantize_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")
cq = pytest.importorskip("torch.testing._internal.common_quantization")
pytestmark = pytest.mark.filterwarnings("ignore")

FLOWS = ("eager-qat", "eager-ptq", "fx-qat", "fx-ptq")
CONVERTED_STEPS = 2  # torch's integer requantization against the engine's, a step per kernel

# Inputs for the models that have no ``get_example_inputs`` (read off their first layers).
SHAPES = {
    **dict.fromkeys(["AnnotatedCustomConfigNestedModel", "AnnotatedNestedModel", "AnnotatedSkipQuantModel",
                     "AnnotatedSubNestedModel", "InnerModule", "NestedModel", "NormalizationTestModel",
                     "QuantStubModel", "QuantSubModel", "SkipQuantModel", "ModelWithFunctionals",
                     "ManualLinearQATModel", "ManualDropoutQATModel"], (4, 5)),
    **dict.fromkeys(["ActivationsTestModel", "ConvBNReLU", "ResNetBase", "ModelMultipleOps",
                     "ModelMultipleOpsNoAvgPool"], (2, 3, 8, 8)),
    **dict.fromkeys(["ModelForFusionWithBias", "ManualConvLinearQATModel", "ManualConvLinearSymmQATModel",
                     "ModelWithSequentialFusion"], (2, 3, 10, 10)),
    "ModelForFusion": (2, 3, 1, 10),
    **dict.fromkeys(["SubModelForFusion", "SubModelWithoutFusion"], (2, 2, 6, 6)),
    "ModelForLinearBNFusion": (4, 20),
    "ModelForConvTransposeBNFusion": (2, 3, 6),
}
# Dynamic quantization, embeddings and the DLRM-style models: other import paths (or none).
NOT_STATIC = {"SingleLayerLinearDynamicModel", "RNNDynamicModel", "RNNCellDynamicModel", "LSTMwithHiddenDynamicModel",
              "ManualLinearDynamicQATModel", "ManualEmbeddingBagLinear", "DeFusedEmbeddingBagLinear",
              "EmbeddingBagModule", "EmbeddingModule", "EmbeddingWithStaticLinear", "DenseTopMLP", "EmbBagWrapper",
              "SparseNNModel", "DummyObserver"}


# What the import cannot reproduce yet, and says so (docs/interop.md, "torch's own test zoo").
KNOWN_GAPS = {
    # no transposed-conv kernel in the engine: the weight stays float, listed unmapped
    ("ConvTransposeModel", "fx-ptq"): "explained",
    ("AnnotatedConvTransposeModel", "fx-ptq"): "explained",
    ("ModelForConvTransposeBNFusion", "fx-ptq"): "explained",
    # a functional linear's weight tensor: FX quantizes it, the engine's plan sees a constant
    ("FunctionalLinear", "fx-qat"): "explained",
    ("FunctionalLinearReluModel", "fx-qat"): "explained",
    ("SingleLayerFunctionalLinearModel", "fx-qat"): "explained",
    # a PTQ observer standing for a weight fake quant in a QAT model: torch passes the float weight
    ("QuantSubModel", "fx-qat"): "explained",
    # torch's quantized BatchNorm2d after a ReLU re-quantizes; the engine's point moves
    ("ModelMultipleOps", "eager-ptq"): "explained",
    ("ModelForFusion", "eager-qat"): "refused",  # a fused Conv3d
    ("NormalizationTestModel", "eager-ptq"): "refused",  # torch's converted LayerNorm
}


def zoo_names() -> list[str]:
    return sorted(n for n, c in vars(cq).items() if inspect.isclass(c) and issubclass(c, nn.Module)
                  and c.__module__ == cq.__name__ and n not in NOT_STATIC)


class NoCase(Exception):
    """The model cannot run this flow as torch's tests set it up (no input, no stubs)."""


@dataclass
class Outcome:
    kind: str  # "exact" | "steps" | "explained" | "silent" | "refused" | "torch-fails" | "no-case"
    detail: str = ""


def _build(name: str):
    cls = getattr(cq, name)
    params = list(inspect.signature(cls.__init__).parameters)[1:]
    args = {"qengine": "x86", "qconfig": tq.get_default_qconfig("x86")}
    model = cls(*(args[p] for p in params if p in args))
    if hasattr(model, "get_example_inputs"):
        inputs = tuple(model.get_example_inputs())
    elif name in SHAPES:
        inputs = (torch.randn(*SHAPES[name], generator=torch.Generator().manual_seed(1)),)
    else:
        raise NoCase("no example input")
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):  # statistics a trained model has
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return model, inputs


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out.dequantize() if out.is_quantized else out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def _has_stub(model: nn.Module) -> bool:
    return any(isinstance(m, tq.QuantStub) for m in model.modules())


def _torch_side(name: str, flow: str):
    """(torch's model as the user has it, the float model, inputs) or raises what torch raised."""
    model, inputs = _build(name)
    float_model = copy.deepcopy(model).eval()
    if flow.startswith("eager"):
        default = (tq.get_default_qat_qconfig if flow == "eager-qat" else tq.get_default_qconfig)("x86")
        annotated = [m for m in model.modules() if getattr(m, "qconfig", None) is not None]
        for m in annotated:  # the model's own annotations, in QAT with QAT's qconfig
            m.qconfig = default if flow == "eager-qat" else m.qconfig
        if not _has_stub(model):
            if len(inputs) > 1:
                raise NoCase("eager mode needs a QuantStub per input: the model has none")
            model = tq.QuantWrapper(model)
        if not annotated:
            model.qconfig = default
        if flow == "eager-qat":
            prepared = tq.prepare_qat(model.train())
        else:
            prepared = tq.prepare(model.eval())
    else:
        mapping = (tq.get_default_qat_qconfig_mapping if flow == "fx-qat" else tq.get_default_qconfig_mapping)("x86")
        prepare = quantize_fx.prepare_qat_fx if flow == "fx-qat" else quantize_fx.prepare_fx
        prepared = prepare(model.train() if flow == "fx-qat" else model.eval(), mapping, inputs)
    if flow.endswith("qat"):
        loss = sum(t.float().square().mean() for t in _tensors(prepared(*inputs)))
        if list(prepared.parameters()):  # functional models keep their weights as plain tensors
            optimizer = torch.optim.SGD(prepared.parameters(), lr=0.01)
            loss.backward()
            optimizer.step()
        prepared.apply(tq.disable_observer)
        prepared.eval()
    else:
        with torch.no_grad():
            prepared(*inputs)
        prepared = tq.convert(prepared) if flow == "eager-ptq" else quantize_fx.convert_fx(prepared)
    with torch.no_grad():
        _tensors(prepared(*inputs))  # torch's own kernels run, or the case is torch's failure
    return prepared, float_model, inputs


def _grid_step(t: torch.Tensor) -> float:
    """The output grid's step, read off the output: its smallest gap between distinct values."""
    values = t.flatten().unique()
    gaps = values[1:] - values[:-1]
    return float(gaps.min()) if gaps.numel() else 1.0


def outcome(name: str, flow: str) -> Outcome:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            source, float_model, inputs = _torch_side(name, flow)
        except NoCase as e:
            return Outcome("no-case", str(e))
        except Exception as e:  # torch's own failure: not the import's to answer for
            return Outcome("torch-fails", f"{type(e).__name__}: {str(e).splitlines()[0][:90]}")
        example = inputs if len(inputs) > 1 else inputs[0]
        try:
            qm = from_torch_ao(source, example, float_model=None if flow.startswith("eager") else float_model)
        except QDebugError as e:
            return Outcome("refused", str(e).splitlines()[0][:120])
        with torch.no_grad():
            theirs, ours = _tensors(source(*inputs)), _tensors(qm(*inputs))
    report = import_report(qm)
    not_exact = report.query("status not in ('exact', 'frozen', 'mapped')")
    reasons = "; ".join(sorted(set(f"{r.status}: {r.note[:60]}" for r in not_exact.itertuples())))[:200]
    if len(theirs) != len(ours):
        return Outcome("explained" if len(not_exact) else "silent", f"{len(ours)} outputs, torch {len(theirs)}")
    diff = max((float((a - b).abs().max()) for a, b in zip(theirs, ours)), default=0.0)
    if diff == 0:
        return Outcome("exact")
    steps = max(float((a - b).abs().max()) / _grid_step(a) for a, b in zip(theirs, ours))
    if flow.endswith("ptq") and steps <= CONVERTED_STEPS:
        return Outcome("steps", f"{steps:.0f} output steps")
    return Outcome("explained" if len(not_exact) else "silent", f"max |diff| {diff:.3g} ({steps:.1f} steps); {reasons}")


@pytest.mark.parametrize("flow", FLOWS)
@pytest.mark.parametrize("name", zoo_names())
def test_torch_zoo_imports_exactly_or_says_why(name, flow):
    result = outcome(name, flow)
    if result.kind in ("torch-fails", "no-case"):
        pytest.skip(f"torch itself: {result.detail}" if result.kind == "torch-fails" else result.detail)
    assert result.kind != "silent", f"the import differs from torch and its report says nothing: {result.detail}"
    if result.kind not in ("exact", "steps"):
        assert KNOWN_GAPS.get((name, flow)) == result.kind, f"{result.kind}: {result.detail}"


if __name__ == "__main__":  # the table in docs/interop.md
    names = sys.argv[1:] or zoo_names()
    print("| model | " + " | ".join(FLOWS) + " |")
    print("|---|" + "---|" * len(FLOWS))
    for name in names:
        cells = []
        for flow in FLOWS:
            r = outcome(name, flow)
            cells.append(r.kind if r.kind == "exact" else f"{r.kind}: {r.detail}".replace("|", "/"))
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
