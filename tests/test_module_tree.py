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


# -- TreeIndex: what naming needs of the tree, kept between a prepared model's forwards ----------
def test_tree_index_holds_each_modules_first_path_and_every_path():
    from qdebug.engine.module_tree import TreeIndex

    model = _Shared()
    index = TreeIndex(model)
    assert index.module_names == {id(m): path for path, m in model.named_modules()}
    assert index.module_paths == {path for path, _ in model.named_modules(remove_duplicate=False)}
    assert index.describes(model)


@pytest.mark.parametrize("change", ["setattr", "modules_dict", "delattr", "class", "other_root"])
def test_tree_index_no_longer_describes_a_changed_tree(change):
    from qdebug.engine.module_tree import TreeIndex

    model = ResNet()
    index = TreeIndex(model)
    block = model.layer2[1]
    if change == "setattr":
        block.relu = nn.ReLU()
    elif change == "modules_dict":  # as replace_modules and torch.ao's swaps write
        block._modules["conv2"] = nn.Conv2d(128, 128, 3, padding=1, bias=False)
    elif change == "delattr":
        del block.bn2
    elif change == "class":
        block.relu.__class__ = nn.ReLU6
    else:
        model = ResNet()
    assert not index.describes(model)


def test_a_prepared_models_forward_sees_a_swapped_module(make_resnet, images):
    """The index a prepared model keeps is rebuilt when the tree changed: a module swapped in
    after a forward is named and quantized as the one it replaced (a stale index would skip it)."""
    import copy

    import torch

    from qdebug.engine import QConfig, calibrate, prepare
    from qdebug.engine.context import run_model
    from qdebug.measure.tap import tap

    model = calibrate(prepare(make_resnet(0), QConfig(), example_inputs=images(2, seed=1)), [images(8, seed=2)])
    x = images(4, seed=3)

    def named_run(m):
        names = []
        with torch.no_grad(), tap(m, lambda event: names.append(event.call.name)):
            out = run_model(m.eval(), x)
        return names, out

    before, out_before = named_run(model)
    relu = model.layer1[0].relu
    model.layer1[0].relu = copy.deepcopy(relu)  # the same layer, another instance
    after, out_after = named_run(model)
    assert after == before and torch.equal(out_after, out_before)
    copied = copy.deepcopy(model)  # its engine state (and the index in it) copied along
    names, out = named_run(copied)
    assert names == before and torch.equal(out, out_before)


def test_tree_index_asks_an_upsample_its_mode_each_time():
    from qdebug.engine.module_tree import TreeIndex

    model = nn.Sequential(nn.Conv2d(1, 1, 1), nn.Upsample(scale_factor=2))
    index = TreeIndex(model)
    assert index.category(model[1]) == "passthrough"  # nearest: a copy of values
    model[1].mode = "bilinear"
    assert index.category(model[1]) == "activation"  # new values: quantized at its output
    assert index.category(model[0]) == index.category(model[0]) is not None
