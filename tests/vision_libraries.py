"""torchvision and timm for the import tests: their pure-Python model code, run on the CPU torch.

PyPI's torchvision wheel is built against CUDA torch: its C extension does not load beside the
CPU build, and its import then fails registering meta kernels for operators that do not exist
(``operator torchvision::nms does not exist``).  Installed into site-packages it would also
break ``transformers``, which imports it when present.  So the README's test command installs
both packages apart, ``pip install --no-deps --target .vendor torchvision timm``, and the tests
that need them call ``torchvision()``/``timm()`` here: the operator schemas are declared (the
models never call these detection ops), then ``.vendor`` joins ``sys.path``.  A user with a
working torchvision needs none of this.  Tests skip, with the command to run, when ``.vendor``
is absent.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest

VENDOR = Path(__file__).resolve().parents[1] / ".vendor"
INSTALL = 'pip install --no-deps --upgrade --target .vendor "torchvision==0.28.0" "timm==1.0.31"'

# torchvision's operators (torchvision/csrc/ops/*.cpp): declared so that its Python side imports.
_SCHEMAS = [
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, "
    "SymInt width) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
    "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, "
    "SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, "
    "Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, "
    "SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
]
_library = None  # the torch.library.Library holding the schemas: kept alive for the process


def _vendored(name: str) -> ModuleType:
    global _library
    import torch

    if name in sys.modules:
        return sys.modules[name]
    if not (VENDOR / name).is_dir():
        pytest.skip(f"{name} is not in .vendor: run `{INSTALL}`")
    if _library is None:
        try:
            torch.ops.torchvision.nms  # a working torchvision already registered them
        except (AttributeError, RuntimeError):
            _library = torch.library.Library("torchvision", "DEF")
            for schema in _SCHEMAS:
                _library.define(schema)
    if str(VENDOR) not in sys.path:
        sys.path.append(str(VENDOR))  # last: an installed copy wins
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Failed to load image Python extension", timm's deprecations
        return importlib.import_module(name)


def torchvision() -> ModuleType:
    """torchvision (its models, ``models.quantization`` included), or skip the test."""
    return _vendored("torchvision")


def timm() -> ModuleType:
    """timm, or skip the test."""
    torchvision()  # timm imports it
    return _vendored("timm")
