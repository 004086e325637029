"""The fused statistics kernel (qdebug.measure.fused, _fused_stats.c) against float64 sums
computed by hand with plain torch, and against the torch-op path of qdebug.measure.stats that
it stands in for.

The kernel widens float32 to float64 before it subtracts or squares, so its sums are held to
float64 precision (REL64: only the order of the additions differs from torch's float64 sums).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from qdebug.engine import fake_quant
from qdebug.engine.spec import QuantSpec
from qdebug.measure import fused
from qdebug.measure.stats import ErrorStats, update_together

REL64 = 1e-12
needs_kernel = pytest.mark.skipif(fused.KERNEL is None, reason="the fused kernel is not built here")


def _by_hand(x: torch.Tensor, y: torch.Tensor) -> dict:
    """Every sum the kernel returns, for (n, c, m) tensors, in float64 with plain torch."""
    x, y = x.double(), y.double()
    e = y - x
    return {"sxx": float((x * x).sum()), "syy": float((y * y).sum()), "see": float((e * e).sum()),
            "sae": float(e.abs().sum()), "max": float(e.abs().max()),
            "ch_xx": (x * x).sum((0, 2)), "ch_ee": (e * e).sum((0, 2)),
            "ch_min": x.amin((0, 2)), "ch_max": x.amax((0, 2))}


def _pair(shape, seed=0, noise=(0.03, 0.2)):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    x *= torch.logspace(-2, 2, shape[1]).view(1, -1, 1)  # channels of very different scale
    ys = [x + level * x.abs().mean() * torch.randn(*shape, generator=gen) for level in noise]
    return x, ys


def _assert_matches(got: dict, want: dict) -> None:
    for key in ("sxx", "syy", "see", "sae"):
        assert got[key] == pytest.approx(want[key], rel=REL64), key
    assert got["max"] == want["max"]  # a maximum is exact
    for key in ("ch_xx", "ch_ee"):
        torch.testing.assert_close(got[key], want[key], rtol=REL64, atol=0, msg=key)
    for key in ("ch_min", "ch_max"):
        assert torch.equal(got[key], want[key]), key


SHAPES = [
    (8, 64, 3136),  # a ResNet stage's map: shared out by channel
    (3, 1, 70_000),  # one long channel: shared out by column
    (1, 1, 300_001),  # a flat tensor of odd length: a tail of m % W values in the last row
    (5, 7, 13),  # short rows, below the size where threads are woken
    (4, 512, 1),  # a linear layer's [N, C] output: rows of one value
]


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("outputs", [1, 2])
def test_the_kernel_matches_float64_by_hand(shape, outputs):
    x, ys = _pair(shape)
    got = fused.fold(x, ys[:outputs])
    assert len(got) == outputs
    for part, y in zip(got, ys):
        _assert_matches(part, _by_hand(x, y))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_sums_hold_for_any_number_of_threads(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shape in ((8, 64, 3136), (2, 1, 100_003)):  # split by channel, by column
            x, ys = _pair(shape, seed=3)
            for part, y in zip(fused.fold(x, ys), ys):
                _assert_matches(part, _by_hand(x, y))
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_rows_are_read_where_their_strides_put_them():
    """x and the two y are views into larger tensors, each with its own strides."""
    gen = torch.Generator().manual_seed(5)
    big_x = torch.randn(4, 10, 5000, generator=gen)
    big_y0 = torch.randn(4, 6, 5100, generator=gen)
    big_y1 = torch.randn(6, 4, 5000, generator=gen)
    x = big_x[:, 2:8]  # strides (50000, 5000, 1): a sample's rows are not c * m apart
    y0 = big_y0[:, :, 40:5040]  # strides (30600, 5100, 1)
    y1 = big_y1.transpose(0, 1)  # strides (5000, 20000, 1): channel-major
    assert len({t.stride() for t in (x, y0, y1)}) == 3
    for part, y in zip(fused.fold(x, [y0, y1]), (y0, y1)):
        _assert_matches(part, _by_hand(x, y))


@needs_kernel
def test_an_output_folded_beside_another_gets_the_same_bits_as_alone():
    x, ys = _pair((6, 32, 777), seed=7)
    together = fused.fold(x, ys)
    for k, y in enumerate(ys):
        alone = fused.fold(x, [y])[0]
        for key, value in alone.items():
            assert (torch.equal(value, together[k][key]) if isinstance(value, torch.Tensor)
                    else value == together[k][key]), key


@needs_kernel
def test_an_output_with_a_nan_or_inf_gets_no_result_and_the_other_keeps_its_own():
    x, ys = _pair((4, 16, 900), seed=9)
    ys[1][2, 3, 4] = float("nan")
    got = fused.fold(x, ys)
    assert got[1] is None
    _assert_matches(got[0], _by_hand(x, ys[0]))
    ys[0][0, 0, 0] = float("inf")
    assert fused.fold(x, ys[:1]) == [None]
    x[1, 1, 1] = float("nan")  # in the reference: no output gets a result
    assert fused.fold(x, [ys[0].nan_to_num()]) == [None]


def test_only_float32_cpu_tensors_with_contiguous_rows_are_taken():
    x = torch.randn(2, 3, 4)
    if fused.KERNEL is None:
        assert not fused.takes(x, [x])
        return
    assert fused.takes(x, [x])
    assert not fused.takes(x.double(), [x.double()])
    assert not fused.takes(x, [x.half()])
    assert not fused.takes(x, [x.transpose(1, 2).contiguous().transpose(1, 2)])  # columns 3 apart


def _both_paths(monkeypatch, fold_batches) -> tuple[ErrorStats, ErrorStats]:
    """The same batches folded through the kernel, then with it switched off (torch ops)."""
    through_kernel = fold_batches()
    monkeypatch.setattr(fused, "KERNEL", None)
    return through_kernel, fold_batches()


@needs_kernel
@pytest.mark.parametrize("channels", [True, False])
def test_error_stats_through_the_kernel_equal_the_torch_op_path_and_float64(monkeypatch, channels):
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(3, 24, 17, 19, generator=gen) for _ in range(3)]
    for x in xs:
        x[:, 5] *= 40.0  # an outlier channel
    ys = [x + 0.02 * torch.randn(x.shape, generator=gen) for x in xs]

    def fold_batches():
        stats = ErrorStats(want_channels=channels, want_kl=False)
        for x, y in zip(xs, ys):
            stats.update(x, y)
        return stats

    kernel, ops = _both_paths(monkeypatch, fold_batches)
    a, b = kernel.result(), ops.result()
    assert a.keys() == b.keys()
    for key, value in b.items():
        assert a[key] == pytest.approx(value, rel=1e-6), key
    # The kernel's own sums are float64-exact against the concatenated batches by hand.
    x, y = torch.cat(xs).double(), torch.cat(ys).double()
    e = y - x
    assert kernel.see == pytest.approx(float((e * e).sum()), rel=REL64)
    assert kernel.sxy == pytest.approx(float((x * y).sum()), rel=1e-9)  # from (sxx + syy - see) / 2
    assert a["sqnr_db"] == pytest.approx(10 * math.log10(float((x * x).sum()) / float((e * e).sum())), rel=REL64)
    if channels:
        assert a["widest_channel"] == 5


@needs_kernel
def test_a_nan_still_reaches_the_metrics_through_the_torch_path(monkeypatch):
    x = torch.randn(2, 8, 30, 30)
    y = x + 0.01
    y[1, 2, 3, 4] = float("nan")

    def fold_batches():
        stats = ErrorStats(want_kl=False)
        stats.update(x, y)
        return stats

    kernel, ops = _both_paths(monkeypatch, fold_batches)
    assert kernel.nonfinite == ops.nonfinite == 1
    assert math.isnan(kernel.result()["sqnr_db"]) and math.isnan(kernel.result()["min_channel_sqnr_db"])


@needs_kernel
def test_values_whose_squares_overflow_float32_stay_finite():
    x = torch.randn(2, 4, 100)
    y = x.clone()
    y[0, 1, 7] = 3e19  # its square, 9e38, is past float32's 3.4e38
    stats = ErrorStats(want_kl=False)
    stats.update(x, y)
    assert stats.syy == pytest.approx(float((y.double() ** 2).sum()), rel=REL64)
    assert math.isfinite(stats.result()["sqnr_db"])


@needs_kernel
def test_errors_folded_together_through_the_kernel_are_the_errors_folded_apart():
    x, ys = _pair((4, 12, 400), seed=13)
    x, ys = x.view(4, 12, 20, 20), [y.view(4, 12, 20, 20) for y in ys]
    makers = [lambda: ErrorStats(want_kl=False), lambda: ErrorStats(want_ranges=False, want_kl=False)]
    together = [make() for make in makers]
    update_together(x, [(stats, y, {}) for stats, y in zip(together, ys)])
    for stats, make, y in zip(together, makers, ys):
        apart = make()
        apart.update(x, y)
        a, b = stats.state(), apart.state()
        for key in a:
            assert (torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]), key
    assert together[0].ch_xx is not together[1].ch_xx  # each grows its own copy


def test_the_kernel_is_built_where_a_c_compiler_is():
    """A silent fallback to torch ops would cost compare half its speed: where pip had a C
    compiler, the kernel must be there."""
    if os.environ.get("QDEBUG_FUSED") == "0":
        pytest.skip("QDEBUG_FUSED=0 turns the kernel off")
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the kernel is optional")
    assert fused.KERNEL is not None, "no fused kernel although a C compiler is here: see pip's build log"


def test_qdebug_fused_0_turns_the_kernel_off():
    code = "from qdebug.measure import fused; print(fused.KERNEL is None)"
    env = {**os.environ, "QDEBUG_FUSED": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@needs_kernel
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_kernel_runs_on_torchs_own_openmp_runtime():
    """Built with -fopenmp, the kernel needs libgomp.so.1: it must bind to the copy torch
    loaded, not bring a second runtime with a second set of threads."""
    with open("/proc/self/maps") as maps:
        runtimes = set(re.findall(r"\S*lib[gi]?omp[^/\s]*\.so[.\d]*", maps.read()))
    assert len(runtimes) <= 1, runtimes


# -- the saturation count (qd_count_outside) ------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("size", [1, 15, 4097, 300_001])  # a tail; one thread; two threads
def test_values_outside_a_range_are_counted_as_torch_counts_them(size):
    gen = torch.Generator().manual_seed(size)
    codes = (torch.randn(size, generator=gen) * 120).round()
    codes[:: 7] = float("nan")  # never counted
    codes[3 % size] = float("inf")
    codes[5 % size] = -float("inf")
    for lo, hi in ((-128.0, 127.0), (0.0, 255.0), (-1e30, 1e30)):
        want = int(((codes < lo) | (codes > hi)).sum())
        assert fused.count_outside(codes, lo, hi) == want == fake_quant._count_outside_by_torch(codes, lo, hi)


@needs_kernel
def test_the_count_leaves_to_torch_what_the_kernel_does_not_take():
    codes = torch.arange(-300.0, 300.0)
    assert fused.count_outside(codes.double(), -128, 127) is None
    assert fused.count_outside(codes.view(20, 30).t(), -128, 127) is None  # not contiguous
    assert fake_quant.count_outside(codes.view(20, 30).t(), -128, 127) == 600 - 256


@needs_kernel
def test_the_engine_counts_clipped_codes_with_the_kernel_and_gets_torchs_count(monkeypatch):
    assert fake_quant._outside_counter is fused.count_outside  # installed when fused loads
    x = torch.randn(4, 8, 30, 30) * 3
    scale, zero_point = torch.tensor(0.02), torch.tensor(3)
    spec = QuantSpec(symmetric=False)
    out, clipped = fake_quant.fake_quantize_counting(x, scale, zero_point, spec)
    monkeypatch.setattr(fake_quant, "_outside_counter", None)
    out_torch, clipped_torch = fake_quant.fake_quantize_counting(x, scale, zero_point, spec)
    assert clipped == clipped_torch > 0 and torch.equal(out, out_torch)


def test_the_help_example_for_qdebug_fused_runs_as_printed():
    """``qdebug --help`` shows ``QDEBUG_FUSED=0 qdebug compare ...``: run word for word from the
    repository root, it compares on torch ops and gives the table the kernel gives."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    shown = subprocess.run([sys.executable, "-m", "qdebug", "--help"], capture_output=True, text=True, check=True).stdout
    example = re.search(r"Example: (QDEBUG_FUSED=0 qdebug compare \S+ \S+ --data \S+)", " ".join(shown.split()))
    assert example is not None, shown
    words = example.group(1).split()
    tables = {}
    for fused_env in ("0", "1"):
        env = {**os.environ, "QDEBUG_FUSED": fused_env, "COLUMNS": "80"}
        done = subprocess.run([sys.executable, "-m", "qdebug", *words[2:]], cwd=root, env=env,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        tables[fused_env] = done.stdout
    assert tables["0"] == tables["1"]
