"""Streaming error statistics (qdebug.measure.stats.ErrorStats) against values computed by hand.

Every expected value is computed directly from the whole (concatenated) tensors in
float64 with plain torch, never with qdebug.  float32 inputs are reduced block-wise
in float32 (documented relative error ~1e-7), hence REL; float64 inputs are held
to float64 precision.
"""

from __future__ import annotations

import math

import pytest
import torch

from qdebug.measure.stats import ErrorStats, update_together

REL = 1e-6
REL64 = 1e-12


def _batches(n_batches=3, shape=(2, 5, 3, 4), noise=0.05, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for _ in range(n_batches):
        x = torch.randn(*shape, generator=gen)
        y = x + noise * torch.randn(*shape, generator=gen)
        xs.append(x)
        ys.append(y)
    return xs, ys


def _fold(xs, ys, **kwargs) -> ErrorStats:
    stats = ErrorStats(**kwargs)
    for x, y in zip(xs, ys):
        stats.update(x, y)
    return stats


def _kl_by_hand(x: torch.Tensor, y: torch.Tensor) -> float:
    """mean over positions (N, H, W) of sum_c p_c log(p_c / q_c), p = softmax(x), q = softmax(y) over axis 1."""
    ex, ey = x.exp(), y.exp()
    p = ex / ex.sum(dim=1, keepdim=True)
    q = ey / ey.sum(dim=1, keepdim=True)
    per_position = (p * (p / q).log()).sum(dim=1)
    return float(per_position.sum()) / per_position.numel()


def test_streaming_metrics_equal_metrics_of_the_concatenated_tensors():
    xs, ys = _batches()
    result = _fold(xs, ys).result()
    x = torch.cat(xs).double()
    y = torch.cat(ys).double()
    e = y - x
    norm_x, norm_y, norm_e = float(x.norm()), float(y.norm()), float(e.norm())
    expected = {
        "cosine": float((x * y).sum()) / (norm_x * norm_y),
        "sqnr_db": 20.0 * math.log10(norm_x / norm_e),
        "mse": float((e**2).mean()),
        "rel_l2": norm_e / norm_x,
        "max_abs": float(e.abs().max()),
        "mean_abs": float(e.abs().mean()),
        "kl": _kl_by_hand(x, y),
    }
    for name, value in expected.items():
        assert result[name] == pytest.approx(value, rel=REL), name
    assert result["nonfinite"] == 0
    # sanity of the test data itself: a ~26 dB match, so the metrics are not trivially 0/1/inf
    assert 20 < result["sqnr_db"] < 35 and result["kl"] > 0
    # no output grid given: no saturation / scale-relative metrics are invented
    assert "saturation" not in result and "max_abs_scales" not in result


def test_batch_order_and_split_do_not_matter():
    xs, ys = _batches(4)
    whole = _fold([torch.cat(xs)], [torch.cat(ys)]).result()
    split = _fold(xs, ys).result()
    reversed_ = _fold(xs[::-1], ys[::-1]).result()
    for name, value in whole.items():
        assert split[name] == pytest.approx(value, rel=REL), name
        assert reversed_[name] == pytest.approx(value, rel=REL), name


def _by_hand(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Every metric of one whole pair of tensors, in float64 (channels on axis 1 when 2-d or more)."""
    x, y = x.double(), y.double()
    e = y - x
    out = {
        "cosine": float((x * y).sum()) / (float(x.norm()) * float(y.norm())),
        "sqnr_db": 20.0 * math.log10(float(x.norm()) / float(e.norm())),
        "mse": float((e**2).mean()),
        "rel_l2": float(e.norm()) / float(x.norm()),
        "max_abs": float(e.abs().max()),
        "mean_abs": float(e.abs().mean()),
    }
    if x.dim() >= 2:
        c = x.shape[1]
        xc, ec = x.transpose(0, 1).reshape(c, -1), e.transpose(0, 1).reshape(c, -1)
        sq = sorted(10 * math.log10(float((xc[i] ** 2).sum()) / float((ec[i] ** 2).sum())) for i in range(c))
        ranges = sorted(float(xc[i].max() - xc[i].min()) for i in range(c))
        out.update(kl=_kl_by_hand(x, y), min_channel_sqnr_db=sq[0], median_channel_sqnr_db=sq[(c - 1) // 2],
                   channel_range_ratio=ranges[-1] / ranges[(c - 1) // 2])
    return out


@pytest.mark.parametrize("shape", [
    (3, 5, 130, 130),  # one sample's map is larger than a block: blocks of positions
    (41, 7, 30, 30),  # many samples per block, with a partial last block
    (40, 9),  # a linear layer's output
    (300_001,),  # flat
])
def test_large_tensors_match_the_whole_tensor_metrics(shape):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(*shape, generator=gen)
    if len(shape) > 1:
        x[:, 2] *= 9.0  # channels of different scale
    y = x + 0.03 * torch.randn(*shape, generator=gen)
    result = _fold([x], [y]).result()
    for name, value in _by_hand(x, y).items():
        assert result[name] == pytest.approx(value, rel=REL), name


def test_large_tensor_with_nonfinite_values_in_several_blocks():
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(2, 3, 200, 200, generator=gen)
    y = x + 0.01 * torch.randn(2, 3, 200, 200, generator=gen)
    y[0, 0, 0, 0] = float("nan")  # the first block
    y[1, 2, 199, 150] = float("inf")  # a late block
    y[1, 1, 100, 7] = float("-inf")
    result = _fold([x], [y]).result()
    assert result["nonfinite"] == 3
    for name in ("cosine", "sqnr_db", "mse", "max_abs", "mean_abs", "min_channel_sqnr_db"):
        assert math.isnan(result[name]), name


def test_max_abs_scales_uses_the_output_scale():
    xs, ys = _batches(2)
    stats = ErrorStats()
    for x, y in zip(xs, ys):
        stats.update(x, y, grid=(0.25, 0, -128, 127))
    max_abs = float((torch.cat(ys).double() - torch.cat(xs).double()).abs().max())
    assert stats.result()["max_abs_scales"] == pytest.approx(max_abs / 0.25, rel=REL)


def test_identical_tensors_are_a_perfect_match():
    xs, _ = _batches(2)
    result = _fold(xs, [x.clone() for x in xs]).result()
    assert result["sqnr_db"] == math.inf
    assert result["cosine"] == pytest.approx(1.0, rel=1e-12)
    assert result["mse"] == 0 and result["max_abs"] == 0 and result["mean_abs"] == 0 and result["rel_l2"] == 0
    assert result["kl"] == pytest.approx(0.0, abs=1e-12)
    assert result["min_channel_sqnr_db"] == math.inf and result["median_channel_sqnr_db"] == math.inf


@pytest.mark.parametrize("bad_batch", [0, 2])
def test_a_nan_in_y_is_counted_and_never_hidden(bad_batch):
    xs, ys = _batches(3)
    ys[bad_batch] = ys[bad_batch].clone()
    ys[bad_batch][1, 2, 0, 3] = float("nan")
    result = _fold(xs, ys).result()
    assert result["nonfinite"] == 1
    for name in ("cosine", "sqnr_db", "mse", "rel_l2", "max_abs", "mean_abs", "kl", "min_channel_sqnr_db",
                 "median_channel_sqnr_db"):
        assert math.isnan(result[name]), (name, result[name])


def test_an_inf_in_y_is_counted():
    xs, ys = _batches(2)
    ys[1] = ys[1].clone()
    ys[1][0, 0, 0, 0] = float("inf")
    ys[1][0, 1, 0, 0] = float("-inf")
    result = _fold(xs, ys).result()
    assert result["nonfinite"] == 2
    assert result["max_abs"] == math.inf and result["mse"] == math.inf
    assert not result["sqnr_db"] > 0  # -inf or NaN, never a finite "good" value


def test_per_channel_metrics_on_a_crafted_outlier_channel():
    gen = torch.Generator().manual_seed(7)
    c, outlier = 5, 2
    gain = torch.ones(1, c, 1, 1)
    gain[0, outlier] = 64.0
    xs, ys = [], []
    for _ in range(2):
        x = torch.randn(3, c, 4, 4, generator=gen) * gain
        y = x + 0.1 * torch.randn(3, c, 4, 4, generator=gen)  # the same absolute noise in every channel
        xs.append(x)
        ys.append(y)
    result = _fold(xs, ys).result()
    x = torch.cat(xs).double().transpose(0, 1).reshape(c, -1)
    e = torch.cat(ys).double().transpose(0, 1).reshape(c, -1) - x
    channel_sqnr = sorted(10.0 * math.log10(float((x[i] ** 2).sum()) / float((e[i] ** 2).sum())) for i in range(c))
    ranges = sorted(float(x[i].max() - x[i].min()) for i in range(c))
    assert result["min_channel_sqnr_db"] == pytest.approx(channel_sqnr[0], rel=REL)
    assert result["median_channel_sqnr_db"] == pytest.approx(channel_sqnr[c // 2], rel=REL)
    assert result["channel_range_ratio"] == pytest.approx(ranges[-1] / ranges[c // 2], rel=REL)
    assert 40 < result["channel_range_ratio"] < 90  # the x64 channel stands out
    assert result["widest_channel"] == outlier  # and is named
    # the outlier channel has the best SQNR (same noise, 64x the signal): +36 dB over the median
    assert channel_sqnr[-1] - channel_sqnr[c // 2] == pytest.approx(20 * math.log10(64), abs=3)


def test_channel_sqnr_without_ranges_keeps_the_sqnr_and_drops_the_range_columns():
    """compare's isolated statistics: per-channel SQNR, but the channel ranges of x (the same
    reference as the propagated statistics') are not reduced twice."""
    xs, ys = _batches(shape=(3, 6, 4, 5), seed=11)
    both, sqnr_only = _fold(xs, ys), _fold(xs, ys, want_ranges=False)
    a, b = both.result(), sqnr_only.result()
    assert "channel_range_ratio" not in b and "widest_channel" not in b
    for key in ("sqnr_db", "min_channel_sqnr_db", "median_channel_sqnr_db", "cosine"):
        assert b[key] == a[key]
    x = torch.cat(xs).double().transpose(0, 1).reshape(6, -1)
    e = torch.cat(ys).double().transpose(0, 1).reshape(6, -1) - x
    by_hand = sorted(10 * math.log10(float((x[i] ** 2).sum()) / float((e[i] ** 2).sum())) for i in range(6))
    assert b["min_channel_sqnr_db"] == pytest.approx(by_hand[0], rel=REL)


@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 8, 300, 300)])  # one block, several blocks
def test_the_same_tensor_per_channel_without_ranges_is_a_perfect_match_in_every_channel(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    x[:, 1] = 0.0  # a dead channel stays out of the channel SQNR
    stats = ErrorStats(want_ranges=False, want_kl=False)
    stats.update(x, x)
    result = stats.result()
    assert result["sqnr_db"] == math.inf and result["min_channel_sqnr_db"] == math.inf
    assert stats.ch_xx.tolist() == pytest.approx(x.double().transpose(0, 1).reshape(shape[1], -1).square().sum(1).tolist(),
                                                 rel=REL)
    assert stats.sxx == pytest.approx(float(x.double().square().sum()), rel=REL)


def test_dead_channels_do_not_count_for_channel_sqnr():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 3, 4, 4, generator=gen)
    x[:, 1] = 0.0  # a dead ReLU channel: no signal at all
    y = x + 0.01 * torch.randn(2, 3, 4, 4, generator=gen)
    result = _fold([x], [y]).result()
    xd, yd = x.double(), y.double()
    live = [10 * math.log10(float((xd[:, i] ** 2).sum()) / float(((yd - xd)[:, i] ** 2).sum())) for i in (0, 2)]
    assert result["min_channel_sqnr_db"] == pytest.approx(min(live), rel=REL)  # not -inf from channel 1
    assert math.isfinite(result["min_channel_sqnr_db"])


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def _saturation(raw: list[float], scale: float, zero_point: int, qmin: int, qmax: int, shape=None) -> float:
    """Fold (x = y = the fake-quantized raw, raw) and return the saturation."""
    raw_t = torch.tensor(raw, dtype=torch.float32)
    if shape is not None:
        raw_t = raw_t.reshape(shape)
    s = _f32(scale)
    y = (torch.clamp(torch.round(raw_t / s) + zero_point, qmin, qmax) - zero_point) * s
    stats = ErrorStats()
    stats.update(y.clone(), y, grid=(s, zero_point, qmin, qmax), raw=raw_t)
    return stats.result()["saturation"]


def test_saturation_counts_values_clipped_at_either_end():
    # signed int8, zero point 0: representable [-12.8, 12.7]; clipped = more than half a step beyond
    raw = [13.0, 100.0, float("inf"), -13.0, -50.0,  # clipped: 5
           12.74, 12.7, -12.8, -12.84, 0.0, 3.3, -7.0]  # inside, or rounding onto an end code: 7
    assert _saturation(raw, 0.1, 0, -128, 127) == pytest.approx(5 / 12, rel=REL)


def test_saturation_ignores_a_qmin_that_encodes_zero():
    # affine int8 after a ReLU: zero point -128, so qmin is the value 0 -- ReLU zeros are not clipped
    raw = [0.0] * 6 + [20.0, 12.8, 12.7, 3.0]  # top of the range: 255 * 0.05 = 12.75
    assert _saturation(raw, 0.05, -128, -128, 127, shape=(2, 5)) == pytest.approx(2 / 10, rel=REL)
    # ... but values really below it are (a negative qmin end is a clipping end)
    raw = [0.0, 0.0, -0.01, -1.0, -3.0, 1.0]
    assert _saturation(raw, 0.05, -128, -128, 127, shape=(2, 3)) == pytest.approx(2 / 6, rel=REL)
    # unsigned uint8 with zero point 0: the same rule
    raw = [0.0, 0.0, 0.0, 5.2, 17.0, 5.1, 5.0, 0.01]  # top: 255 * 0.02 = 5.1
    assert _saturation(raw, 0.02, 0, 0, 255, shape=(2, 4)) == pytest.approx(2 / 8, rel=REL)


def test_saturation_accumulates_over_batches():
    s = _f32(0.1)
    grid = (s, 0, -128, 127)
    stats = ErrorStats()
    for raw in (torch.tensor([[20.0, 0.0, 0.0, 0.0]]), torch.tensor([[-20.0, -30.0, 1, 2], [3, 4, 5, 6]])):
        y = torch.clamp(torch.round(raw / s), -128, 127) * s
        stats.update(y.clone(), y, grid=grid, raw=raw)
    assert stats.result()["saturation"] == pytest.approx(3 / 12, rel=REL)


def test_memory_is_constant_in_the_number_of_batches():
    xs, ys = _batches(1)
    once = _fold(xs, ys)
    many = _fold(xs * 25, ys * 25)
    # only scalars and per-channel vectors are held, however many batches were folded
    for stats in (once, many):
        for name, value in vars(stats).items():
            if isinstance(value, torch.Tensor):
                assert value.shape == (5,), name
            else:
                assert isinstance(value, (int, float, str, dict, bool, type(None))), name
        assert stats.extra == {}
    assert many.n == 25 * once.n
    # ratio metrics of one batch repeated N times equal those of the batch alone
    a, b = once.result(), many.result()
    for name in ("cosine", "sqnr_db", "mse", "rel_l2", "max_abs", "mean_abs", "kl", "min_channel_sqnr_db",
                 "median_channel_sqnr_db", "channel_range_ratio"):
        assert b[name] == pytest.approx(a[name], rel=1e-9), name


def test_shape_mismatch_is_recorded_not_compared():
    stats = ErrorStats()
    stats.update(torch.zeros(2, 3), torch.zeros(2, 4))
    assert stats.shape_mismatch == "[2, 3] vs [2, 4]"
    assert stats.result() == {}


def test_float64_inputs_are_reduced_in_float64():
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(3, 6, 40, 40, generator=gen, dtype=torch.float64)
    y = x + 1e-3 * torch.randn(3, 6, 40, 40, generator=gen, dtype=torch.float64)
    result = _fold([x], [y]).result()
    for name, value in _by_hand(x, y).items():
        assert result[name] == pytest.approx(value, rel=REL64), name


def test_finite_values_whose_squares_overflow_float32_are_redone_in_float64():
    gen = torch.Generator().manual_seed(22)
    x = torch.randn(2, 4, 30, 30, generator=gen) * 1e20  # x^2 ~ 1e40 > float32 max
    y = x * (1 + 1e-3 * torch.randn(2, 4, 30, 30, generator=gen))
    result = _fold([x], [y]).result()
    assert result["nonfinite"] == 0
    for name, value in _by_hand(x, y).items():
        if name == "kl":
            continue  # softmax of 1e20-sized logits: one-hot, KL ~0 either way
        assert math.isfinite(result[name]), name
        assert result[name] == pytest.approx(value, rel=REL), name


@pytest.mark.parametrize("noise", [1e-5, 1e-3, 0.3])
def test_kl_keeps_its_precision_when_x_and_y_nearly_agree(noise):
    # The textbook sum p (log p - log q) in float32 loses every digit at noise 1e-5;
    # qdebug's cancellation-free form keeps the float64 value to a few 1e-5 relative.
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(4, 16, 8, 8, generator=gen) * 3
    y = x + noise * torch.randn(4, 16, 8, 8, generator=gen)
    expected = _kl_by_hand(x.double(), y.double())
    assert expected > 0
    assert _fold([x], [y]).result()["kl"] == pytest.approx(expected, rel=1e-4)


def test_kl_of_far_apart_distributions_stays_finite_and_exact():
    # exp(d) overflows float32 for d > 88: such a block is redone in float64.
    gen = torch.Generator().manual_seed(24)
    x = torch.randn(2, 5, 3, 3, generator=gen)
    y = x.clone()
    y[:, 0] += 120.0
    result = _fold([x], [y]).result()
    assert result["kl"] == pytest.approx(_kl_by_hand(x.double(), y.double()), rel=1e-9)
    assert result["nonfinite"] == 0


def test_cosine_never_leaves_its_range():
    gen = torch.Generator().manual_seed(25)
    for _ in range(5):
        x = torch.randn(1000, generator=gen)
        for y in (x.clone(), -x, x * 1.0000001):
            assert -1.0 <= _fold([x], [y]).result()["cosine"] <= 1.0


@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 8, 300, 300)])  # one block, several blocks
def test_the_same_tensor_as_y_folds_like_an_equal_copy(shape):
    """update(x, x) reads x once (an exact match); its metrics equal those of an equal copy."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
    fast, general = ErrorStats(want_channels=False, want_kl=False), ErrorStats(want_channels=False, want_kl=False)
    for _ in range(2):
        fast.update(x, x)
        general.update(x, x.clone())
    assert fast.result() == general.result()
    assert fast.result()["sqnr_db"] == math.inf and fast.result()["cosine"] == 1.0
    assert fast.sxx == pytest.approx(float(x.double().square().sum()) * 2, rel=REL)


def test_the_same_tensor_with_nan_still_counts_it():
    x = torch.randn(4, 6)
    x[1, 2] = math.nan
    stats = ErrorStats(want_channels=False, want_kl=False)
    stats.update(x, x)
    assert stats.result()["nonfinite"] == 1.0 and math.isnan(stats.result()["sqnr_db"])


def test_errors_folded_together_are_the_errors_folded_apart():
    """``update_together`` reads x once for several compared outputs; every sum, channel tensor and
    count equals the separate updates', bit for bit: ranges for one, KL for another, saturation from
    raw values, a NaN in one output, a float32 overflow redone in float64, and a block walk of
    several blocks (x larger than BLOCK)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 6, 300, 400, generator=gen)  # 2.16M values: 3 blocks of the channel walk
    y1 = x + 0.05 * torch.randn(x.shape, generator=gen)
    y2 = x + 0.2 * torch.randn(x.shape, generator=gen)
    y2[1, 2, 5, 7] = float("nan")
    y3 = x.clone()
    y3[0, 0, 0, 0] = 3e19  # finite, but its square overflows float32
    raw = y1 * 1.5
    grid = (0.02, 128, 0, 255)
    compared = [
        (lambda: ErrorStats(), y1, {"grid": grid, "raw": raw}),
        (lambda: ErrorStats(want_ranges=False, want_kl=False), y2, {}),
        (lambda: ErrorStats(want_kl=True), y3, {}),
        (lambda: ErrorStats(want_channels=False, want_kl=False), y1, {}),
    ]
    together = [(make(), y, kw) for make, y, kw in compared]
    update_together(x, together)
    for (stats, y, kw), (make, _, _) in zip(together, compared):
        apart = make()
        apart.update(x, y, **kw)
        a, b = stats.state(), apart.state()
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], torch.Tensor) or a[key] is None:
                assert (a[key] is None) == (b[key] is None), key
                if a[key] is not None:
                    assert torch.equal(a[key], b[key]) or (a[key].isnan() == b[key].isnan()).all(), key
            elif isinstance(a[key], float) and math.isnan(a[key]):
                assert math.isnan(b[key]), key
            else:
                assert a[key] == b[key], key
    assert together[1][0].nonfinite == 1 and math.isfinite(together[2][0].result()["sqnr_db"])
    assert together[0][0].saturation_n == x.numel() and together[0][0].kl_n == x.numel() // 6
    # The shared reference sums are copies: growing one stats' channel sums leaves the other's.
    assert together[0][0].ch_xx is not together[1][0].ch_xx


def test_errors_folded_together_keep_their_own_channel_sums_over_batches():
    """One block per batch: the reference's channel sums, shared by both outputs within a batch,
    must not be one tensor that both grow in place over the next batches."""
    gen = torch.Generator().manual_seed(8)
    together, apart = [ErrorStats(), ErrorStats(want_ranges=False)], [ErrorStats(), ErrorStats(want_ranges=False)]
    for _ in range(3):
        x = torch.randn(2, 4, 5, 5, generator=gen, dtype=torch.float64)  # float64: no conversion copy either
        ys = [x + 0.1 * torch.randn(x.shape, generator=gen, dtype=torch.float64) for _ in range(2)]
        update_together(x, [(stats, y, {}) for stats, y in zip(together, ys)])
        for stats, y in zip(apart, ys):
            stats.update(x, y)
    for a, b in zip(together, apart):
        assert torch.equal(a.ch_xx, b.ch_xx) and torch.equal(a.ch_ee, b.ch_ee)
        assert a.result() == b.result()
