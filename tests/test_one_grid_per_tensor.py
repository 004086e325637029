"""No scale shared by tensors of different meaning (issue 28, item 1): the places where several
tensors meet one call -- a view of a tuple, a split, a selection with indices.

Checked against float64 arithmetic written here: an integer add must read each input on its
own grid, so its result is the exact sum rounded once onto the output's grid.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from qdebug.engine import calibrate, convert, prepare, quant_points
from qdebug.engine.point import grid_of
from qdebug.measure.tap import tap


class _Pair(nn.Module):
    """Two tensors of very different ranges passed through one ``nn.Identity`` as a tuple."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.keep = nn.Identity()

    def forward(self, x):
        big, small = self.keep((self.a(x) * 100.0, self.b(x)))
        return big + small


def _quantized(model: nn.Module, xs: list[torch.Tensor]) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert(calibrate(prepare(model, example_inputs=xs[0]), xs))


def _xs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randn(16, 4, generator=gen) for _ in range(3)]


def test_a_view_of_a_tuple_keeps_each_tensor_on_its_own_grid():
    torch.manual_seed(0)
    qq = _quantized(_Pair().eval(), _xs())
    points = quant_points(qq)
    seen = {}

    def listener(event):
        if event.call.name == "add":
            seen["grids"] = [grid_of(t) for t in event.args]
            seen["values"] = [t.detach().double() for t in event.args]

    with tap(qq, listener), torch.no_grad():
        total = qq(_xs()[0])
    # Before: both tagged with the first tensor's grid (``mul``'s step ~0.5 for values in ±1).
    assert seen["grids"] == [points["mul"], points["b"]]
    s = float(points["add"].scale)
    exact = seen["values"][0] + seen["values"][1]
    assert float((total.double() - exact).abs().max()) <= s / 2 * (1 + 1e-6)


class _Splits(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x):
        h = self.fc(x)
        left, right = torch.chunk(h, 2, dim=1)  # views of one tensor: one grid, nothing requantized
        values, _ = torch.max(h, dim=1, keepdim=True)  # (values, indices): one float tensor
        return left + right, values


def test_chunks_are_views_on_their_producers_grid_and_max_values_get_one_point():
    torch.manual_seed(0)
    xs = _xs()
    qq = _quantized(_Splits().eval(), xs)
    names = list(quant_points(qq))
    assert not any(n.startswith("chunk") for n in names)  # a passthrough: no point, no requantization
    assert "max" in names and not any(n.startswith("max:") for n in names)  # the indices get none
    seen = {}

    def listener(event):
        if event.call.name == "add":
            seen["grids"] = [grid_of(t) for t in event.args]
            seen["codes"] = [t.detach().double() / float(quant_points(qq)["fc"].scale) for t in event.args]

    with tap(qq, listener), torch.no_grad():
        qq(xs[0])
    assert seen["grids"] == [quant_points(qq)["fc"]] * 2
    for codes in seen["codes"]:  # whole codes of the fc output's step (float32 noise aside): no requantization
        assert float((codes - torch.round(codes)).abs().max()) < 1e-4
