"""QuantPoint in training: the per-step paths QAT takes (dynamic weight qparams, running observers).

These paths skip work when it is provably unneeded (the overflow clamp for a
weight quantized with its own range, the masked EMA update, buffer
reallocation); each test checks the result against torch's kernels and
observers or hand formulas, including the inputs that must take the slow path.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.ao.quantization import MovingAverageMinMaxObserver

from qdebug.engine.point import QuantPoint
from qdebug.engine.spec import QuantSpec


def _weight_point(**spec) -> QuantPoint:
    point = QuantPoint("w", "weight", QuantSpec(per_channel=True, **spec))
    point.mode = "fake"
    return point.train()


def _expected_weight_fq(w: torch.Tensor) -> torch.Tensor:
    """int8 symmetric per-channel by hand: s_c = max|w_c| / 127, z = 0, then torch's kernel."""
    amax = w.abs().amax(dim=(1, 2, 3))
    scale = (amax / 127.0).clamp(min=torch.finfo(torch.float32).eps)
    return torch.fake_quantize_per_channel_affine(w, scale, torch.zeros(w.shape[0], dtype=torch.int32), 0, -128, 127)


def test_dynamic_weight_point_follows_the_weight_every_step():
    g = torch.Generator().manual_seed(0)
    point = _weight_point()
    w = torch.randn(6, 4, 3, 3, generator=g)
    for step in range(4):
        w = w * (1.0 + 0.5 * step) + 0.01 * torch.randn(w.shape, generator=g)
        out = point.apply(w)
        assert torch.equal(out, _expected_weight_fq(w)), f"step {step}"
        torch.testing.assert_close(point.scale, w.abs().amax(dim=(1, 2, 3)) / 127.0, rtol=0, atol=0)


def test_dynamic_weight_point_adapts_to_a_new_channel_count():
    point = _weight_point()
    point.apply(torch.randn(6, 4, 3, 3))
    w = torch.randn(3, 4, 3, 3)
    assert torch.equal(point.apply(w), _expected_weight_fq(w))
    assert point.scale.shape == (3,)


def test_weight_with_inf_and_nan_takes_the_guarded_path():
    point = _weight_point()
    w = torch.randn(4, 2, 3, 3)
    w[0, 0, 0, 0] = math.inf
    w[1, 0, 0, 0] = -math.inf
    w[2, 0, 0, 0] = math.nan
    out = point.apply(w)
    # The infinities are not part of the range: they saturate at its ends; NaN stays NaN.
    finite = torch.where(torch.isfinite(w), w, torch.zeros_like(w))
    amax = finite.abs().amax(dim=(1, 2, 3))
    assert out[0, 0, 0, 0] == pytest.approx(float(amax[0]) / 127.0 * 127, rel=1e-6)
    assert out[1, 0, 0, 0] == pytest.approx(-float(amax[1]) / 127.0 * 128, rel=1e-6)
    assert torch.isnan(out[2, 0, 0, 0])
    assert torch.isfinite(out[3]).all()
    assert int(point.observer.nonfinite) == 3


def test_weight_point_with_a_clipping_observer_still_saturates_outliers():
    # A percentile range is narrower than the data: the outlier saturates at the range end.
    point = _weight_point(observer="percentile", percentile=90.0)
    w = torch.randn(2, 1, 10, 10, generator=torch.Generator().manual_seed(1))
    w[0, 0, 0, 0] = 1e30
    out = point.apply(w)
    scale = point.scale
    assert out[0, 0, 0, 0] == pytest.approx(float(scale[0]) * 127, rel=1e-6)


@pytest.mark.parametrize("c", [0.01, 0.2])
def test_activation_point_in_qat_follows_torch_moving_average(c):
    point = QuantPoint("a", "activation", QuantSpec(signed=False, symmetric=False, observer="ema", averaging_constant=c))
    ref = MovingAverageMinMaxObserver(averaging_constant=c, quant_min=0, quant_max=255, dtype=torch.quint8)
    point.mode = "observe"
    g = torch.Generator().manual_seed(2)
    first = torch.randn(16, generator=g) * 3
    point.apply(first)
    ref(first)
    point.update_from_observer()
    point.mode, point.observe_in_fake = "fake", True
    point.train()
    for step in range(6):
        x = torch.randn(32, generator=g) * (1 + step) + 0.5
        out = point.apply(x)
        ref(x)
        torch.testing.assert_close(point.observer.min_val, ref.min_val, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(point.observer.max_val, ref.max_val, rtol=1e-6, atol=1e-7)
        lo, hi = min(float(ref.min_val), 0.0), max(float(ref.max_val), 0.0)
        scale = (torch.tensor(hi, dtype=torch.float32) - torch.tensor(lo, dtype=torch.float32)) / 255.0
        zero_point = int(torch.clamp(0 - torch.round(torch.tensor(lo) / scale), 0, 255))
        assert float(point.scale) == float(scale)
        assert int(point.zero_point) == zero_point
        assert torch.equal(out, torch.fake_quantize_per_tensor_affine(x, float(scale), zero_point, 0, 255))


def test_activation_point_in_qat_ignores_a_nan_batch():
    point = QuantPoint("a", "activation", QuantSpec(observer="ema", averaging_constant=0.5))
    point.mode, point.observe_in_fake = "fake", True
    point.train()
    point.apply(torch.tensor([-1.0, 2.0]))
    before = (point.observer.min_val.clone(), point.observer.max_val.clone(), point.scale.clone())
    out = point.apply(torch.tensor([math.nan, 100.0, -100.0]))
    assert torch.isnan(out[0])
    # Only the finite values enter: the range moves half way to [-100, 100].
    assert float(point.observer.min_val) == pytest.approx(float(before[0]) + 0.5 * (-100 - float(before[0])))
    assert float(point.observer.max_val) == pytest.approx(float(before[1]) + 0.5 * (100 - float(before[1])))
    all_nan = point.apply(torch.full((3,), math.nan))
    assert torch.isnan(all_nan).all()
    assert float(point.observer.max_val) == pytest.approx(float(before[1]) + 0.5 * (100 - float(before[1])))


# -- the eval-mode weight cache -------------------------------------------------------------------
def _conv_bn_model() -> torch.nn.Module:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    with torch.no_grad():
        model[1].running_var.uniform_(0.5, 2.0)
        model[1].running_mean.uniform_(-0.2, 0.2)
    return model.eval()


def _prepared(mode: str):
    from qdebug.engine import QConfig, calibrate, prepare

    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(4))
    qm = prepare(_conv_bn_model(), QConfig(), mode=mode, example_inputs=x)
    calibrate(qm, [x])
    return qm.eval(), x


def _count_weight_quantizations(monkeypatch) -> list:
    import qdebug.engine.fake_quant as fq

    calls = []
    real = torch.fake_quantize_per_channel_affine

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(fq.torch, "fake_quantize_per_channel_affine", counting)
    return calls


@pytest.mark.parametrize("mode", ["fuse_bn", "with_bn", "with_bn_reverse_fold"])
def test_eval_forwards_quantize_each_weight_once_and_give_the_same_output(monkeypatch, mode):
    qm, x = _prepared(mode)
    with torch.no_grad():
        first = qm(x)
    calls = _count_weight_quantizations(monkeypatch)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(qm(x), first)
    assert calls == []  # all three forwards used the cached weight
    with torch.enable_grad():
        out = qm(x)  # with autograd the weight is quantized in the graph, not taken from the cache
    assert torch.equal(out.detach(), first) and len(calls) == 1


@pytest.mark.parametrize("change", ["weight", "running_var", "bn_weight", "qparams", "scale_in_place", "train_step"])
def test_the_weight_cache_never_serves_a_stale_weight(change):
    qm, x = _prepared("with_bn_reverse_fold")
    conv = qm.get_submodule("0")
    bn = qm.get_submodule("1")
    point = conv.weight_point
    with torch.no_grad():
        qm(x)
        if change == "weight":
            conv.weight.mul_(1.5)
        elif change == "running_var":
            bn.running_var.mul_(3.0)
        elif change == "bn_weight":
            bn.weight.mul_(-2.0)
        elif change == "qparams":
            point.set_qparams(point.scale * 2, point.zero_point)
            point.frozen = True  # keep them: a dynamic point would recompute from the weight
        elif change == "scale_in_place":
            point.frozen = True
            point.scale.mul_(2)
    if change == "train_step":
        qm.train()
        opt = torch.optim.SGD(qm.parameters(), lr=0.5)
        qm(x).sum().backward()
        opt.step()
        qm.eval()
    with torch.no_grad():
        cached_path = qm(x)
        point._fq_cache = None  # force the uncached computation
        fresh = qm(x)
    assert torch.equal(cached_path, fresh)


# -- clipped-value counting (compare's saturation) -------------------------------------------------
def test_counting_fake_quant_equals_torch_and_counts_what_the_clamp_changed():
    from qdebug.engine.fake_quant import fake_quantize, fake_quantize_counting

    spec = QuantSpec(signed=False, symmetric=False)
    scale, zero_point = torch.tensor(0.05), torch.tensor(10, dtype=torch.int32)
    # representable: (0 - 10) * 0.05 = -0.5 .. (255 - 10) * 0.05 = 12.25
    x = torch.tensor([-3.0, -0.52, -0.5, 0.0, 5.0, 12.25, 12.27, 12.3, 40.0, math.inf, -math.inf, math.nan])
    out, clipped = fake_quantize_counting(x, scale, zero_point, spec)
    expected = fake_quantize(x, scale, zero_point, spec)
    assert torch.equal(out[:-1], expected[:-1]) and torch.isnan(out[-1]) and torch.isnan(expected[-1])
    finite = x[torch.isfinite(x)]
    assert torch.equal(out[:9], torch.fake_quantize_per_tensor_affine(finite, 0.05, 10, 0, 255))
    # clipped = the finite values whose code round(x / s) + z lies outside [0, 255]
    codes = torch.round(finite.double() / 0.05) + 10
    by_hand = int(((codes < 0) | (codes > 255)).sum()) + 2  # + the two infinities; NaN is not counted
    assert int(clipped) == by_hand


def test_a_point_counts_only_in_eval_without_autograd():
    point = QuantPoint("a", "activation", QuantSpec())
    point.set_qparams(torch.tensor(0.1), torch.tensor(0, dtype=torch.int32))
    point.mode = "fake"
    point.count_clipped = True
    x = torch.tensor([0.0, 1.0, 50.0, -50.0])
    point.eval()
    with torch.no_grad():
        out = point.apply(x)
    assert int(point.clipped) == 2
    assert torch.equal(out, torch.fake_quantize_per_tensor_affine(x, 0.1, 0, -128, 127))
    point.apply(x)  # autograd on: the training kernel, no count
    assert point.clipped is None
    point.train()
    with torch.no_grad():
        point.apply(x)
    assert point.clipped is None


def test_refresh_after_an_edit_through_data_drops_the_cached_weight():
    from qdebug.engine import refresh_weight_qparams

    qm, x = _prepared("with_bn_reverse_fold")
    conv = qm.get_submodule("0")
    with torch.no_grad():
        before = qm(x)
        conv.weight.data.mul_(-1.0)  # invisible to version counters
        refresh_weight_qparams(qm)
        after = qm(x)
        conv.weight_point._fq_cache = None
        fresh = qm(x)
    assert torch.equal(after, fresh) and not torch.equal(after, before)
