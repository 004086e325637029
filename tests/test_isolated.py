"""Isolated errors without recomputation (qdebug.tools.isolated): a call computing the same float
function as the reference's only gets its quant point applied to the reference output.  Checked
against the full replay (every number identical) and on every condition that must force a replay."""

from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch
import torch.nn as nn

from qdebug.engine import QConfig, calibrate, convert, prepare, quant_points
from qdebug.engine.modules import _QWeighted
from qdebug.io.modelspec import ModelSpec, build
from qdebug.tools.compare import compare
from qdebug.tools.isolated import IsolatedReplay, same_module_function

from small_models import RESNET, SMALL_RESNET

BNS = {"bn1", "layer1.0.bn1", "layer1.0.bn2", "layer2.0.bn1", "layer2.0.bn2", "layer2.0.downsample.1"}
CONVS = {"conv1", "layer1.0.conv1", "layer1.0.conv2", "layer2.0.conv1", "layer2.0.conv2", "layer2.0.downsample.0"}
PARAMETER_FREE = {"relu", "layer1.0.relu", "layer1.0.add", "layer1.0.relu#2", "layer2.0.relu", "layer2.0.add",
                  "layer2.0.relu#2", "avgpool"}


def _images(n, seed):
    return torch.randn(n, 1, 16, 16, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def batches():
    return [_images(4, 40), _images(4, 41)]


@pytest.fixture(scope="module")
def pair(batches):
    """A float ResNet and its calibrated twin with BN kept as modules (reverse fold)."""
    torch.manual_seed(0)
    fp = build(ModelSpec(RESNET, dict(SMALL_RESNET)), from_user=True).eval()
    with torch.no_grad():  # BN statistics that are not the identity
        fp.train()
        for seed in (1, 2):
            fp(_images(8, seed))
        fp.eval()
    cal = prepare(fp, QConfig(), mode="with_bn_reverse_fold", example_inputs=batches[0])
    calibrate(cal, [_images(8, 3), _images(8, 4)])
    return fp, cal.eval()


def _run(models, batches, monkeypatch, force_replay=False):
    """compare's frame, and the names whose isolated output reused the reference output."""
    reused: set[str] = set()
    original = IsolatedReplay.reuses_reference

    def spy(self, event, record):
        if force_replay:
            return False
        answer = original(self, event, record)
        if answer:
            reused.add(event.call.name)
        return answer

    with monkeypatch.context() as m:
        m.setattr(IsolatedReplay, "reuses_reference", spy)
        frame = compare(models, batches).frame
    return frame, reused


def test_reuse_gives_exactly_the_numbers_of_the_full_replay(pair, batches, monkeypatch):
    fp, cal = pair
    models = [("float", fp), ("calibrated", cal)]
    fast, reused = _run(models, batches, monkeypatch)
    slow, _ = _run(models, batches, monkeypatch, force_replay=True)
    assert BNS | PARAMETER_FREE <= reused  # same float function: BN of a calibrated model, ReLU, add, pooling
    assert not reused & (CONVS | {"fc", "input"})  # quantized weights: recomputed
    pd.testing.assert_frame_equal(fast, slow, check_exact=True)
    # a BN followed by a ReLU has no quant point of its own: its own error is exactly none
    rows = {r["layer"]: r for r in fast.to_dict("records")}
    assert rows["layer1.0.bn1"]["isolated_sqnr_db"] == float("inf")
    assert rows["layer1.0.bn1"]["isolated_cosine"] == 1.0
    assert rows["layer1.0.relu"]["isolated_sqnr_db"] < 60  # its quant point's rounding


def test_changed_bn_statistics_force_a_replay(pair, batches, monkeypatch):
    fp, cal = pair
    qat = copy.deepcopy(cal)
    qat.train()
    with torch.no_grad():  # a QAT step moves BN running statistics
        qat(_images(8, 9))
    qat.eval()
    for name in BNS:  # not the reference's function any more
        assert not same_module_function(fp.get_submodule(name), qat.get_submodule(name)), name
    # compare measures such a model's isolated errors against its own float run (its BN is that
    # run's very module: reused), and the numbers are still those of the full replay.
    models = [("float", fp), ("qat", qat)]
    fast, reused = _run(models, batches, monkeypatch)
    slow, _ = _run(models, batches, monkeypatch, force_replay=True)
    assert BNS | PARAMETER_FREE <= reused
    assert not reused & (CONVS | {"fc", "input"})
    assert fast["drift_sqnr_db"].notna().any()
    pd.testing.assert_frame_equal(fast, slow, check_exact=True)


def test_a_quantized_reference_output_is_never_reused(pair, batches, monkeypatch):
    fp, cal = pair
    other = copy.deepcopy(cal)
    models = [("calibrated", cal), ("other", other)]
    fast, reused = _run(models, batches, monkeypatch)
    slow, _ = _run(models, batches, monkeypatch, force_replay=True)
    points = quant_points(cal)
    # the reference's ReLU and pooling outputs went through its quant points: not float results
    assert not reused & {"relu", "layer1.0.relu", "layer1.0.relu#2", "layer2.0.relu#2", "avgpool"}
    assert all(points.get(name) is None for name in reused)
    assert {"layer1.0.bn1", "layer1.0.add"} <= reused  # before a ReLU: no point in the reference either
    pd.testing.assert_frame_equal(fast, slow, check_exact=True)


def test_integer_kernels_are_always_replayed(pair, batches, monkeypatch):
    fp, cal = pair
    _, reused = _run([("float", fp), ("quantized", convert(copy.deepcopy(cal)))], batches, monkeypatch)
    assert reused == set()


def test_same_module_function():
    bn = nn.BatchNorm2d(4).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
    twin = copy.deepcopy(bn)
    assert same_module_function(bn, twin)
    assert same_module_function(nn.ReLU(), nn.ReLU(inplace=True)) is False  # plain attributes differ
    assert same_module_function(nn.ReLU(), nn.ReLU())
    assert not same_module_function(nn.ReLU(), nn.ReLU6())
    assert not same_module_function(bn, None)
    changed = copy.deepcopy(bn)
    with torch.no_grad():
        changed.running_var[0] += 1e-6
    assert not same_module_function(bn, changed)
    eps = copy.deepcopy(bn)
    eps.eps = 1e-3
    assert not same_module_function(bn, eps)
    training = copy.deepcopy(bn).train()
    assert not same_module_function(bn, training)
    hooked = copy.deepcopy(bn)
    hooked.register_forward_hook(lambda m, a, out: out * 2)
    assert not same_module_function(bn, hooked)
    wide = nn.MaxPool2d(3, stride=2)
    assert not same_module_function(nn.MaxPool2d(2), wide)
    assert not same_module_function(nn.Softmax(dim=1), nn.Softmax(dim=-1))
    # an attribute that is not a plain value counts only as the very same object
    a, b = nn.ReLU(), nn.ReLU()
    a.table, b.table = torch.ones(3), torch.ones(3)
    assert not same_module_function(a, b)
    b.table = a.table
    assert same_module_function(a, b)
    assert not same_module_function(nn.Dropout(0.5), nn.Dropout(1))  # 0.5 vs int 1: types differ too


def test_quantized_weighted_layers_never_count_as_the_same_function(pair):
    fp, cal = pair
    qconv = cal.get_submodule("conv1")
    assert isinstance(qconv, _QWeighted)
    assert not same_module_function(qconv, qconv)


@pytest.mark.parametrize("name", ["mobilenetv2", "shufflenetv2", "multitask"])
@pytest.mark.parametrize("mode", ["with_bn_reverse_fold", "fuse_bn"])
def test_reuse_matches_the_full_replay_on_every_zoo_model(name, mode, monkeypatch):
    """Inline ops (channel shuffle, cat, chunk, mean, hardswish, several outputs) and both BN
    modes: the reused isolated outputs give exactly the full replay's numbers."""
    from qdebug.zoo import MobileNetV2, MultiTaskNet, ShuffleNetV2

    from small_models import SMALL_MOBILENETV2, SMALL_SHUFFLENETV2

    build_model = {
        "mobilenetv2": lambda: MobileNetV2(**SMALL_MOBILENETV2),
        "shufflenetv2": lambda: ShuffleNetV2(**SMALL_SHUFFLENETV2),
        "multitask": lambda: MultiTaskNet(num_classes=10, num_aux_classes=2, in_channels=1, width=8),
    }[name]
    torch.manual_seed(1)
    fp = build_model().eval()
    batches = [_images(3, 50), _images(3, 51)]
    cal = prepare(fp, QConfig(), mode=mode, example_inputs=batches[0])
    calibrate(cal, [_images(6, 52)])
    models = [("float", fp), ("calibrated", cal.eval())]
    fast, reused = _run(models, batches, monkeypatch)
    slow, _ = _run(models, batches, monkeypatch, force_replay=True)
    assert reused  # something was reused on every model
    pd.testing.assert_frame_equal(fast, slow, check_exact=True)
