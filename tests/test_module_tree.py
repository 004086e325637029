"""``qdebug.engine.module_tree.every_path``: the walk every forward's context makes is
``named_modules(remove_duplicate=False)``'s, path for path and module for module."""

from __future__ import annotations

import pytest
import torch.nn as nn

from qdebug.engine.module_tree import every_path
from qdebug.zoo import MobileNetV2, ResNet


class _Shared(nn.Module):
    """A module at three paths, one of them nested; a None child; an empty container."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(2, 2)
        self.a = nn.Sequential(shared, nn.ReLU(), nn.Sequential(nn.Identity(), shared))
        self.b = shared
        self.c = None
        self.d = nn.ModuleList()


MODELS = {
    "resnet": ResNet,
    "mobilenetv2": MobileNetV2,
    "shared": _Shared,
    "transformer": lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 2, enable_nested_tensor=False),
}


def _same_walk(model: nn.Module) -> None:
    expected = [(path, id(module)) for path, module in model.named_modules(remove_duplicate=False)]
    assert [(path, id(module)) for path, module in every_path(model)] == expected
    assert len(expected) > 3


@pytest.mark.parametrize("name", MODELS)
def test_every_path_is_named_modules_without_removing_duplicates(name):
    _same_walk(MODELS[name]())


def test_every_path_on_a_timm_network():
    from vision_libraries import timm  # code we did not write: a timm network's tree (skips without .vendor)

    _same_walk(timm().create_model("mobilenetv3_small_050", pretrained=False))
