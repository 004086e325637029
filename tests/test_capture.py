"""The reference capture (qdebug.measure.tap.Capture) holding values instead of copying them:
what an in-place op writes later must never reach a record, and compare's numbers must not
depend on whether a value was held or copied."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import qdebug.tools.compare as compare_module
from qdebug.engine import QConfig, calibrate, prepare
from qdebug.measure.tap import Capture, tap
from qdebug.tools.compare import METRICS, compare


class _Chain(nn.Module):
    """conv -> ReLU (in place on the conv's output) -> conv, and a hidden in-place write."""

    def __init__(self, hidden_write: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.hidden_write = hidden_write

    def forward(self, x):
        y = self.conv2(self.relu(self.conv1(x)))
        if self.hidden_write:
            y.mul_(2.0)  # an in-place op the naming sees (not a module): conv2's output is written
        return y


def _record(model, capture, x):
    capture.clear()
    with torch.no_grad(), tap(model, capture):
        model(x)
    return capture.settle()


def test_a_held_value_is_the_tensor_itself_until_an_in_place_op_writes_it():
    torch.manual_seed(0)
    model = _Chain().eval()
    model.relu = nn.Identity()  # nothing in place
    capture = Capture(keep_inputs=False, hold=True)
    x = torch.randn(2, 2, 8, 8)
    assert _record(model, capture, x)
    with torch.no_grad():
        want = model.conv1(x)
    assert torch.equal(capture.records["conv1"].output, want)
    assert capture._held and not capture._written  # held, and nothing seen written


def test_a_value_written_in_place_is_copied_from_the_next_forward_on():
    torch.manual_seed(1)
    model = _Chain().eval()
    capture = Capture(keep_inputs=False, hold=True)
    x = torch.randn(2, 2, 8, 8)
    with torch.no_grad():
        before_relu = model.conv1(x)
    assert (before_relu < 0).any()
    assert not _record(model, capture, x)  # the ReLU wrote conv1's output: run again
    assert _record(model, capture, x)
    assert torch.equal(capture.records["conv1"].output, before_relu)  # the copy, before the ReLU
    assert torch.equal(capture.records["relu"].output, before_relu.clamp(min=0))
    held = {slot[0] for slot, _, _ in capture._held}
    assert "conv1" not in held and "relu" in held and "conv2" in held


def test_a_write_by_an_op_the_model_runs_inside_its_forward_is_caught():
    torch.manual_seed(2)
    model = _Chain(hidden_write=True).eval()
    model.relu = nn.Identity()
    capture = Capture(keep_inputs=False, hold=True)
    x = torch.randn(2, 2, 8, 8)
    with torch.no_grad():
        want = model.conv2(model.conv1(x))
    assert not _record(model, capture, x)
    assert _record(model, capture, x)
    assert torch.equal(capture.records["conv2"].output, want)


def test_without_hold_every_value_is_a_copy():
    model = _Chain().eval()
    capture = Capture(keep_inputs=False)
    assert _record(model, capture, torch.randn(1, 2, 8, 8))
    assert not capture._held


class _Forwards:
    """Counts a model's forwards."""

    def __init__(self, model):
        self.count = 0
        model.register_forward_pre_hook(lambda *_: setattr(self, "count", self.count + 1))


def _calibrated(fp: nn.Module, batches: list) -> nn.Module:
    cal = prepare(fp, QConfig(), example_inputs=batches[0])
    calibrate(cal, batches)
    return cal


def _copying_capture(*args, **kwargs):
    kwargs["hold"] = False
    return Capture(*args, **kwargs)


def test_compare_gives_the_same_numbers_holding_or_copying_and_runs_the_first_batch_twice(monkeypatch):
    torch.manual_seed(3)
    fp = _Chain().eval()
    batches = [torch.randn(3, 2, 8, 8) for _ in range(3)]
    cal = _calibrated(fp, batches)
    forwards = _Forwards(fp)
    held = compare([("float", fp), ("calibrated", cal)], batches).frame
    # compare runs a copy of the reference (decomposed_copy) that shares its hooks: 3 batches + 1 rerun
    assert forwards.count == len(batches) + 1
    monkeypatch.setattr(compare_module, "Capture", _copying_capture)
    forwards.count = 0
    copied = compare([("float", fp), ("calibrated", cal)], batches).frame
    assert forwards.count == len(batches)
    assert list(held["layer"]) == list(copied["layer"])
    for metric in METRICS:
        for a, b in zip(held[metric], copied[metric]):
            assert (math.isnan(a) and math.isnan(b)) or a == b, metric


class _Moving(nn.Module):
    """Writes in place into a different earlier output on each forward."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(2, 2, 1) for _ in range(3))
        self.calls = 0

    def forward(self, x):
        outs = []
        for conv in self.convs:
            x = conv(x)
            outs.append(x)
        self.calls += 1
        outs[self.calls % 3].mul_(1.0)  # the same values, but written: a new slot each time
        return x * 1


def test_compare_copies_everything_when_the_written_values_move_between_forwards():
    torch.manual_seed(4)
    fp = _Moving().eval()
    batches = [torch.randn(2, 2, 4, 4) for _ in range(2)]
    cal = _calibrated(fp, batches)
    forwards = _Forwards(fp)
    result = compare([("float", fp), ("calibrated", cal)], batches)
    assert forwards.count == 3 + 1  # the first batch: held, held again, then all copied
    assert set(result.frame["layer"]) >= {"convs.0", "convs.1", "convs.2"}
    assert result.frame["sqnr_db"].notna().all()


@pytest.mark.parametrize("inference", [True, False])
def test_a_tensor_without_a_version_counter_is_copied(inference):
    capture = Capture(keep_inputs=False, hold=True)
    model = nn.Identity()
    with torch.inference_mode(inference):
        x = torch.randn(3)
    capture.clear()
    with torch.no_grad(), tap(model, capture):
        model(x)
    assert capture.settle()
    assert bool(capture._held) is not inference


def test_compare_takes_batches_made_in_inference_mode():
    """Inference tensors keep no version counter; they used to stop compare with a RuntimeError."""
    torch.manual_seed(5)
    fp = _Chain().eval()
    with torch.inference_mode():
        batches = [torch.randn(2, 2, 8, 8) for _ in range(2)]
    cal = _calibrated(fp, batches)
    frame = compare([("float", fp), ("calibrated", cal)], batches).frame
    assert frame["sqnr_db"].notna().all() and (frame["sqnr_db"] > 20).all()
