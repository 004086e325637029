"""Tests for qdebug.zoo model definitions."""

from __future__ import annotations

import importlib
import inspect
import json
import sys

import pytest
import torch
from torch import nn

from qdebug import zoo
from qdebug.zoo import (
    MODELS,
    BasicBlock,
    InvertedResidual,
    MobileNetV2,
    MultiTaskNet,
    ResNet,
    ShuffleNetV2,
    channel_shuffle,
    resnet18,
)
from small_models import SMALL_MOBILENETV2, SMALL_SHUFFLENETV2

# Small configurations for 1x28x28 inputs: (checkpoint target string, kwargs).
SMALL = {
    "resnet": (
        "qdebug.zoo.resnet:ResNet",
        {"layers": [1, 1, 1], "widths": [8, 16, 32], "num_classes": 10, "in_channels": 1, "stem": "small"},
    ),
    "mobilenetv2": ("qdebug.zoo.mobilenetv2:MobileNetV2", SMALL_MOBILENETV2),
    "shufflenetv2": ("qdebug.zoo.shufflenetv2:ShuffleNetV2", SMALL_SHUFFLENETV2),
    "multitask": (
        "qdebug.zoo.multitask:MultiTaskNet",
        {"num_classes": 10, "num_aux_classes": 2, "in_channels": 1, "width": 8},
    ),
}


def _resolve(target: str) -> type:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    target, kwargs = SMALL[name]
    return _resolve(target)(**kwargs).eval()


def test_models_registry_lists_all():
    assert MODELS == {
        "resnet": ResNet,
        "mobilenetv2": MobileNetV2,
        "shufflenetv2": ShuffleNetV2,
        "multitask": MultiTaskNet,
    }
    assert set(SMALL) == set(MODELS)
    for name, (target, _) in SMALL.items():
        assert _resolve(target) is MODELS[name]
    for mod in ("resnet", "mobilenetv2", "shufflenetv2", "multitask"):
        assert importlib.import_module(f"qdebug.zoo.{mod}").__doc__
    assert zoo.__doc__


@pytest.mark.parametrize("cls", list(MODELS.values()), ids=list(MODELS))
def test_constructor_is_keyword_only_with_json_defaults(cls):
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert params, cls
    for p in params:
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, (cls, p.name)
        assert p.default is not inspect.Parameter.empty, (cls, p.name)
        json.dumps(p.default)  # JSON-serialisable default (tuples become lists)
    names = {p.name for p in params}
    assert {"num_classes", "in_channels"} <= names
    with pytest.raises(TypeError):
        cls(10)  # positional args are rejected


@pytest.mark.parametrize("name", ["resnet", "mobilenetv2", "shufflenetv2"])
def test_small_classifier_output_shape(name):
    model = _build(name)
    with torch.no_grad():
        out = model(torch.randn(2, 1, 28, 28))
    assert out.shape == (2, 10)
    assert torch.isfinite(out).all()


def test_multitask_output_dict():
    model = _build("multitask")
    with torch.no_grad():
        out = model(torch.randn(3, 1, 28, 28))
    assert set(out) == {"cls", "aux"}
    assert out["cls"].shape == (3, 10)
    assert out["aux"].shape == (3, 2)
    for attr in ("backbone", "neck", "head_cls", "head_aux"):
        assert isinstance(getattr(model, attr), nn.Module)


def test_resnet_small_stem_on_8x8():
    model = ResNet(layers=[1, 1], widths=[8, 16], num_classes=4, in_channels=3, stem="small").eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 8, 8)).shape == (1, 4)


def test_resnet18_defaults_params_and_224_forward():
    model = ResNet()
    n_params = sum(p.numel() for p in model.parameters())
    assert abs(n_params - 11_689_512) <= 0.01 * 11_689_512
    assert sum(p.numel() for p in resnet18().parameters()) == n_params
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 224, 224))
    assert out.shape == (1, 1000)


def test_resnet_basicblock_calls_shared_relu_twice():
    model = _build("resnet")
    blocks = [m for m in model.modules() if isinstance(m, BasicBlock)]
    assert len(blocks) == 3
    calls = {id(b): 0 for b in blocks}

    def make_hook(key):
        def hook(module, inputs, output):
            calls[key] += 1

        return hook

    handles = [b.relu.register_forward_hook(make_hook(id(b))) for b in blocks]
    try:
        with torch.no_grad():
            model(torch.randn(1, 1, 28, 28))
    finally:
        for h in handles:
            h.remove()
    assert all(n == 2 for n in calls.values()), calls
    # Exactly one ReLU module per block (shared, not two separate ones).
    for b in blocks:
        assert sum(isinstance(m, nn.ReLU) for m in b.modules()) == 1


@pytest.mark.parametrize("name", list(SMALL))
def test_every_conv_feeds_exactly_one_bn(name):
    """In the traced graph each conv's only user is a BatchNorm2d (Conv-BN pair)."""
    model = _build(name)
    gm = torch.fx.symbolic_trace(model)
    mods = dict(gm.named_modules())
    n_convs = 0
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(mods[node.target], nn.Conv2d):
            n_convs += 1
            conv = mods[node.target]
            assert conv.bias is None, node.target
            users = list(node.users)
            assert len(users) == 1, (node.target, users)
            bn = users[0]
            assert bn.op == "call_module" and isinstance(mods[bn.target], nn.BatchNorm2d), bn
            assert bn.args == (node,) and mods[bn.target].num_features == conv.out_channels
    assert n_convs == sum(isinstance(m, nn.Conv2d) for m in model.modules())


def test_mobilenetv2_depthwise_and_residual():
    model = _build("mobilenetv2")
    dw = [
        m
        for m in model.modules()
        if isinstance(m, nn.Conv2d) and m.groups > 1 and m.groups == m.in_channels == m.out_channels
    ]
    blocks = [m for m in model.modules() if isinstance(m, InvertedResidual)]
    assert len(dw) == len(blocks) == 5
    assert any(isinstance(m, nn.ReLU6) for m in model.modules())
    assert isinstance(model.classifier[0], nn.Dropout)
    assert isinstance(model.classifier[-1], nn.Linear)

    res = [b for b in blocks if b.use_res_connect]
    plain = [b for b in blocks if not b.use_res_connect]
    assert len(res) == 2 and len(plain) == 3
    # Silence the projection (its BN emits exactly zero): a residual block
    # must then be the identity, a non-residual block must output zeros.
    for block in res + plain:
        with torch.no_grad():
            block.conv.project_bn.weight.zero_()
            block.conv.project_bn.bias.zero_()
    x = torch.randn(2, res[0].conv.project_conv.out_channels, 7, 7)
    with torch.no_grad():
        torch.testing.assert_close(res[0](x), x)
        assert plain[0](torch.randn(1, plain[0].conv[0].in_channels, 7, 7)).abs().max() == 0


def test_channel_shuffle_is_expected_permutation():
    x = torch.arange(8.0).view(1, 8, 1, 1)
    out = channel_shuffle(x, 2)
    # groups=2, 4 channels per group: [0 1 2 3 | 4 5 6 7] -> interleaved.
    assert out.flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    x = torch.arange(6.0).view(1, 6, 1, 1).expand(2, 6, 3, 3)
    out = channel_shuffle(x, 3)
    assert out[1, :, 2, 1].tolist() == [0, 2, 4, 1, 3, 5]
    assert sorted(out[0, :, 0, 0].tolist()) == list(range(6))


def test_shufflenetv2_uses_split_cat_shuffle():
    model = _build("shufflenetv2")
    units = list(model.stage2)
    assert units[0].branch1 is not None and units[1].branch1 is None
    x = torch.randn(1, 16, 5, 5)
    with torch.no_grad():
        out = units[1](x)
    # The untouched half of a stride-1 unit lands on the even channels.
    torch.testing.assert_close(out[:, 0::2], x[:, :8])


@pytest.mark.parametrize("name", list(SMALL))
def test_rebuild_from_target_and_kwargs(name):
    target, kwargs = SMALL[name]
    model = _build(name)
    record = json.loads(json.dumps({"target": target, "kwargs": kwargs}))
    rebuilt = _resolve(record["target"])(**record["kwargs"])
    assert type(rebuilt) is type(model)
    sd, sd2 = model.state_dict(), rebuilt.state_dict()
    assert list(sd) == list(sd2)
    assert all(sd[k].shape == sd2[k].shape for k in sd)
    rebuilt.load_state_dict(sd)
    rebuilt.eval()
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        a, b = model(x), rebuilt(x)
    if isinstance(a, dict):
        for k in a:
            torch.testing.assert_close(a[k], b[k])
    else:
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cls", list(MODELS.values()), ids=list(MODELS))
def test_default_rebuild_same_architecture(cls):
    a, b = cls(), cls()
    assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in b.state_dict().items()}


@pytest.mark.parametrize("name", list(SMALL))
def test_fx_traceable(name):
    model = _build(name)
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(1, 1, 28, 28)
    with torch.no_grad():
        a, b = model(x), gm(x)
    if isinstance(a, dict):
        a, b = a["cls"], b["cls"]
    torch.testing.assert_close(a, b)


def test_a_transformers_architecture_without_transformers_says_what_to_install(monkeypatch):
    from qdebug.errors import QDebugError
    from qdebug.zoo.hf import Llama

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(QDebugError, match="needs the transformers package") as raised:
        Llama()
    assert 'qdebug[models]' in raised.value.hint
