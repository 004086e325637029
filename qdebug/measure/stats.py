"""Streaming per-layer error statistics: running sums in float64, no stored tensors.

``ErrorStats.update(x, y)`` folds one batch of a layer's reference output x and
test output y into a few float64 sums; ``result()`` turns them into metrics.
Memory is constant in the number of batches.  Definitions (x = reference,
e = y - x, sums over every element of every batch):

    cosine          sum(x y) / sqrt(sum(x^2) sum(y^2))
    sqnr_db         10 log10(sum(x^2) / sum(e^2))      (= 20 log10(||x|| / ||x - y||))
    mse             sum(e^2) / n
    rel_l2          sqrt(sum(e^2) / sum(x^2))
    max_abs         max |e|;  mean_abs = sum|e| / n
    max_abs_scales  max_abs / s_out (the layer's output scale: Horizon's "N out_qscale")
    kl              mean over positions of KL(softmax(x) || softmax(y)) along the channel axis (axis 1)
    saturation      fraction of values clipped by the output point: their code round(v/s) + z
                    fell outside [qmin, qmax], i.e. before quantization (v) they lay more than
                    half a step beyond the range (counted by the point's own kernel, or here
                    from the raw values)
    nonfinite       number of NaN/Inf values in y (never averaged away: metrics become NaN/inf)
    per channel (axis 1):  min_channel_sqnr_db, median_channel_sqnr_db, and
    channel_range_ratio = max over channels of (max - min of x) / median of it, and
    widest_channel = the index of that channel.

A perfect match gives sqnr_db = inf and cosine = 1; a NaN anywhere in y makes the
sums NaN, and the metrics say so.

Two ways to the same sums.  Where the fused kernel is built (``qdebug.measure.fused``), the
sums of float32 CPU tensors come from one pass of it, every value widened to float64 first;
the KL and a saturation count from raw values still take torch ops.  Otherwise, and for a
batch with a NaN/Inf (counted here), or other dtypes and devices: each block of ``BLOCK``
values is reduced in the inputs' precision
(float32 for float32/float16/bfloat16 inputs, float64 if either is float64) with
torch's pairwise summation, and the block results accumulate in float64 across
blocks and batches.  Every metric then has a relative error of about 1e-7 for
float32 inputs (tests hold it to 1e-6 against float64 computed by hand), and
reducing float32 blocks costs half the memory traffic of converting them.  The
KL uses a form without cancellation (see ``_block_kl``).  A block whose float32
sums overflow although its values are finite (|values| beyond ~1e19) is redone
in float64, so no finite input gives an infinite metric.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Sequence

import torch

from qdebug.engine.fake_quant import count_outside
from qdebug.measure import fused


# Elements per block of ``ErrorStats.update`` (4 MB of float32): the working copies of a
# block live in reused scratch tensors that stay in the shared cache, and no
# feature-map-sized temporary is allocated (a fresh large allocation page-faults on
# every touch), so the cost is about one streaming read of x and y.  Smaller blocks
# pay torch's per-op overhead more often; measured best at 2^20 on ResNet-18 maps.
BLOCK = 1 << 20


def _blocks(shape: torch.Size, channels: bool) -> list[tuple[slice, ...]]:
    """Slices of the (N, C, rest) view (``channels``: every block holds all C channels of
    its positions) or of the flat view, each about ``BLOCK`` elements."""
    numel = shape.numel()
    if not channels:
        return [(slice(i, i + BLOCK),) for i in range(0, numel, BLOCK)]
    n, c = shape[0], shape[1]
    rest = numel // (n * c)
    if c * rest < BLOCK:
        rows = max(1, BLOCK // (c * rest))
        return [(slice(i, i + rows),) for i in range(0, n, rows)]
    cols = max(1, BLOCK // c)
    return [(slice(i, i + 1), slice(None), slice(j, j + cols)) for i in range(n) for j in range(0, rest, cols)]


def _merge_channels(a: list, b: list) -> list:
    """[sum x^2, sum e^2, min x, max x] per channel of two parts (ranges None when not kept)."""
    if a[2] is None:
        return [a[0] + b[0], a[1] + b[1], None, None]
    return [a[0] + b[0], a[1] + b[1], torch.minimum(a[2], b[2]), torch.maximum(a[3], b[3])]


def work_dtype(x: torch.Tensor, y: torch.Tensor) -> torch.dtype:
    """The precision blocks are reduced in: float64 if either side is float64, else float32."""
    return torch.float64 if torch.float64 in (x.dtype, y.dtype) else torch.float32


_SCRATCH = threading.local()


def _scratch(slot: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """This thread's scratch tensor number ``slot``, shaped like ``like`` and on its device.

    Reused from block to block: a fresh 1 MB tensor per op would be a fresh
    mapping whose pages fault in on first touch, which costs more than the op.
    """
    dtype = dtype or like.dtype
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None:
        buffers = _SCRATCH.buffers = {}
    n = like.numel()
    key = (slot, dtype, like.device)  # a block on the GPU works in GPU scratch, one on the CPU in CPU scratch
    buf = buffers.get(key)
    if buf is None or buf.numel() < n:
        buf = buffers[key] = torch.empty(max(n, BLOCK), dtype=dtype, device=like.device)
    return buf[:n].view(like.shape)


def _block_kl(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Sum over the positions of a block of KL(softmax(x) || softmax(x + e)) along axis 1.

    With p = softmax(x), e_bar = sum_c p_c e_c and d = e - e_bar (so sum_c p_c d_c = 0)::

        KL = log sum_c p_c exp(e_c) - e_bar = log1p(sum_c p_c (exp(d_c) - 1 - d_c))

    Every term of the last sum is >= 0, so nothing cancels: the result keeps its
    relative precision even when x and y nearly agree (the textbook
    sum p (log p - log q) subtracts numbers ~|e| apart to get one ~|e|^2).
    """
    ex = torch.sub(x, x.amax(1, keepdim=True), out=_scratch(2, x)).exp_()
    sx = ex.sum(1, keepdim=True)
    e_bar = torch.mul(ex, e, out=_scratch(3, x)).sum(1, keepdim=True).div_(sx)
    d = torch.sub(e, e_bar, out=_scratch(3, x))
    g = torch.expm1(d, out=_scratch(4, x)).sub_(d).mul_(ex)
    return g.sum(1, keepdim=True).div_(sx).log1p_().sum()


def _channel_min_max(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel min and max of an (n, C, m) block.

    The reduction order matters on CPU (torch.aminmax along a dim is slower still):
    for short rows (small feature maps) folding the n samples together first is
    several times faster than reducing (0, 2) at once; for long rows, the reverse.
    """
    if xb.shape[0] > 1 and xb.shape[2] <= 256:
        return xb.amin(0).amin(1), xb.amax(0).amax(1)
    return xb.amin((0, 2)), xb.amax((0, 2))


# Positions in the vector of one block's partial results.
_SXX, _SYY, _SEE, _SAE, _KL, _MAX, _SAT = range(7)


@dataclass
class _Target:
    """One output compared with the reference x in a walk of x's blocks (``_fold``)."""

    yv: torch.Tensor  # y in x's block layout
    rv: torch.Tensor | None  # y before its output point, for saturation counted here (with ``clip``)
    channels: bool  # per-channel sums of x^2 and e^2
    ranges: bool  # per-channel min and max of x
    want_kl: bool
    clip: tuple[float, float] | None


def _reference_block(xb: torch.Tensor, channels: bool, ranges: bool) -> list:
    """The reference's part of a block, the same for every output compared with it:
    [sum x^2 (per channel with ``channels``), per-channel min x, max x (None without ``ranges``)]."""
    square = torch.mul(xb, xb, out=_scratch(1, xb))
    xx = square.sum((0, 2)) if channels else square.sum()
    lo, hi = _channel_min_max(xb) if ranges else (None, None)
    return [xx, lo, hi]


def _block_sums(xb: torch.Tensor, yb: torch.Tensor, rb: torch.Tensor | None, reference: list, target: _Target,
                dtype: torch.dtype) -> tuple[torch.Tensor, list | None]:
    """One block's partial results in ``dtype`` (see the positions above) and per-channel parts,
    given the reference's part (``_reference_block``, of x in ``dtype``).

    sum(x y) is not reduced here: it is (sxx + syy - see) / 2 exactly, one pass fewer.
    Temporaries live in this thread's scratch tensors (``_scratch``).
    """
    yb = yb.to(dtype)
    e = torch.sub(yb, xb, out=_scratch(0, xb))
    square = _scratch(1, xb)
    ch_xx = reference[0]
    ch_ee = torch.mul(e, e, out=square).sum((0, 2)) if target.channels else torch.mul(e, e, out=square).sum()
    syy = torch.mul(yb, yb, out=square).sum()
    ch = None
    if target.channels:
        lo, hi = (reference[1], reference[2]) if target.ranges else (None, None)
        ch = [ch_xx, ch_ee, lo, hi]
        sxx, see = ch_xx.sum(), ch_ee.sum()
    else:
        sxx, see = (ch_xx if ch_xx.dim() == 0 else ch_xx.sum()), ch_ee
    zero = xb.new_zeros(())
    kl = _block_kl(xb, e) if target.want_kl else zero
    abs_err = e.abs_()  # e is not needed any more
    saturated = zero if target.clip is None else zero + count_outside(rb, *target.clip)
    sums = torch.stack([sxx, syy, see, abs_err.sum(), kl, abs_err.max(), saturated])
    return sums, ch


def _fold(xv: torch.Tensor, targets: list[_Target], blocks: list, dtype: torch.dtype) -> list[dict]:
    """The sums of ``ErrorStats.update`` over some blocks of the view of x, for each target.

    Each block of x is read once for all targets: its reference part (sum of squares, channel
    ranges) is computed once, and the targets' blocks are folded while it is in cache.  Each
    block is reduced in ``dtype`` (torch's pairwise summation: relative error ~1e-7 in float32)
    and the block results accumulate in float64.  A block whose float32 results overflow
    although its values are finite (|values| beyond ~1e19) is redone in float64.
    """
    channels = any(t.channels for t in targets)
    ranges = any(t.channels and t.ranges for t in targets)
    out = []
    for _ in targets:
        out.append({"totals": [0.0] * 7, "max": 0.0, "nonfinite": 0, "ch": None})
    for block in blocks:
        xb = xv[block].to(dtype)
        reference = _reference_block(xb, channels, ranges)
        for target, acc in zip(targets, out):
            yb = target.yv[block]
            rb = target.rv[block] if target.clip is not None else None
            own = reference if target.channels or not channels else [reference[0].sum(), None, None]
            sums, ch_part = _block_sums(xb, yb, rb, own, target, dtype)
            values = sums.tolist()
            if not all(map(math.isfinite, values)):
                bad = int((~torch.isfinite(yb)).sum())
                acc["nonfinite"] += bad
                if bad == 0 and dtype != torch.float64 and bool(torch.isfinite(xb).all()):
                    x64 = xb.to(torch.float64)
                    again = _reference_block(x64, target.channels, target.channels and target.ranges)
                    sums, ch_part = _block_sums(x64, yb, rb, again, target, torch.float64)
                    values = sums.tolist()
            totals = acc["totals"]
            for i in (_SXX, _SYY, _SEE, _SAE, _KL, _SAT):
                totals[i] += values[i]
            block_max = values[_MAX]
            if not math.isnan(acc["max"]):
                acc["max"] = block_max if math.isnan(block_max) else max(acc["max"], block_max)
            if ch_part is not None:
                # Copies: the reference's part is shared by the targets, and their sums grow in place.
                ch_part = [t.to(torch.float64, copy=True) if t is not None else None for t in ch_part]
                acc["ch"] = ch_part if acc["ch"] is None else _merge_channels(acc["ch"], ch_part)
    results = []
    for acc in out:
        totals = acc["totals"]
        # sum(x y) = (sum(x^2) + sum(y^2) - sum((y - x)^2)) / 2, in float64 from the block sums.
        sxy = (totals[_SXX] + totals[_SYY] - totals[_SEE]) / 2.0
        results.append({"sxx": totals[_SXX], "syy": totals[_SYY], "sxy": sxy, "see": totals[_SEE],
                        "sae": totals[_SAE], "max": acc["max"], "nonfinite": acc["nonfinite"],
                        "saturated": int(totals[_SAT]), "kl_sum": totals[_KL], "ch": acc["ch"]})
    return results


def _fold_fused(xv: torch.Tensor, targets: list[_Target], blocks: list, dtype: torch.dtype) -> list[dict | None]:
    """``_fold``'s result for each target the fused kernel folds (``qdebug.measure.fused``: one
    pass, sums in float64), None for the others: every target when there is no kernel or the
    layout or dtype is not one it takes, and a target with a NaN/Inf (``_fold`` counts those).
    Targets go through the kernel two at a time, and a target's sums are the same bits alone or
    beside another, with or without its KL or saturation (``_kl_and_saturation``, torch ops)."""
    results: list[dict | None] = [None] * len(targets)
    if fused.KERNEL is None:
        return results
    as_rows = (lambda v: v) if xv.dim() == 3 else (lambda v: v.view(1, 1, -1))
    x3, ys = as_rows(xv), [as_rows(t.yv) for t in targets]
    if not fused.takes(x3, ys):
        return results
    for at in range(0, len(targets), 2):
        for k, part in enumerate(fused.fold(x3, ys[at:at + 2]), start=at):
            if part is None:
                continue
            target = targets[k]
            ch = None
            if target.channels:
                ranges = (part["ch_min"], part["ch_max"]) if target.ranges else (None, None)
                ch = [part["ch_xx"], part["ch_ee"], *ranges]
            kl_sum, saturated = _kl_and_saturation(xv, target, blocks, dtype)
            sxx, syy, see = part["sxx"], part["syy"], part["see"]
            results[k] = {"sxx": sxx, "syy": syy, "sxy": (sxx + syy - see) / 2.0, "see": see,
                          "sae": part["sae"], "max": part["max"], "nonfinite": 0, "saturated": saturated,
                          "kl_sum": kl_sum, "ch": ch}
    return results


def _kl_and_saturation(xv: torch.Tensor, target: _Target, blocks: list, dtype: torch.dtype) -> tuple[float, int]:
    """A finite target's KL sum and count of saturated raw values, block by block with torch ops
    (0 for what it does not ask for); a block's KL that overflows float32 is redone in float64."""
    kl, saturated = 0.0, 0
    if not target.want_kl and target.clip is None:
        return kl, saturated
    for block in blocks:
        if target.want_kl:
            xb, yb = xv[block].to(dtype), target.yv[block].to(dtype)
            value = float(_block_kl(xb, torch.sub(yb, xb, out=_scratch(0, xb))))
            if not math.isfinite(value) and dtype != torch.float64:
                x64 = xb.to(torch.float64)
                value = float(_block_kl(x64, yb.to(torch.float64) - x64))
            kl += value
        if target.clip is not None:
            saturated += count_outside(target.rv[block], *target.clip)
    return kl, saturated


@dataclass
class ErrorStats:
    """Running sums for one (layer, compared model) pair."""

    want_channels: bool = True  # per-channel SQNR (min, median)
    want_ranges: bool = True  # per-channel ranges of x (channel_range_ratio, widest_channel)
    want_kl: bool = True
    n: int = 0
    sxx: float = 0.0
    syy: float = 0.0
    sxy: float = 0.0
    see: float = 0.0
    sae: float = 0.0
    max_abs: float = 0.0
    nonfinite: int = 0
    saturated: int = 0
    saturation_n: int = 0
    kl_sum: float = 0.0
    kl_n: int = 0
    ch_xx: torch.Tensor | None = None
    ch_ee: torch.Tensor | None = None
    ch_min: torch.Tensor | None = None
    ch_max: torch.Tensor | None = None
    out_scale: float | None = None
    shape_mismatch: str | None = None
    extra: dict = field(default_factory=dict)

    def update(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        grid: tuple[float, int, int, int] | None = None,
        raw: torch.Tensor | None = None,
        clipped: torch.Tensor | int | None = None,
    ) -> None:
        """Fold one batch.  ``grid`` = (scale, zero_point, qmin, qmax) of y's output point; for
        saturation either ``clipped`` = how many of y's values that point clipped (counted by
        the point itself, see ``QuantPoint.count_clipped``) or ``raw`` = y before the point."""
        update_together(x, [(self, y, {"grid": grid, "raw": raw, "clipped": clipped})])

    def _plan(self, x: torch.Tensor, y: torch.Tensor, grid: tuple[float, int, int, int] | None = None,
              raw: torch.Tensor | None = None, clipped: torch.Tensor | int | None = None,
              ) -> tuple[_Target, bool, torch.dtype] | None:
        """``update``'s checks and bookkeeping: what is left to fold -- the target, whether it
        is walked by channel, its precision -- or None when nothing is."""
        if x.shape != y.shape:
            self.shape_mismatch = f"{list(x.shape)} vs {list(y.shape)}"
            return None
        if x.numel() == 0:
            return None
        clip = None
        if grid is not None:
            scale, zero_point, qmin, qmax = grid
            self.out_scale = scale
            if clipped is not None:
                self.saturated += int(clipped)
                self.saturation_n += y.numel()
            elif raw is not None and raw.shape == y.shape:
                # Clipped = beyond half a step past either end of the representable range.
                clip = ((qmin - zero_point - 0.5) * scale, (qmax - zero_point + 0.5) * scale)
        per_channel = x.dim() >= 2 and x.shape[1] > 1
        channels, want_kl = self.want_channels and per_channel, self.want_kl and per_channel
        # An exact match (y is x) takes one pass over x, unless the kernel folds x: then it folds
        # x against itself, so the sums are those of an equal copy, bit for bit.
        by_kernel = fused.KERNEL is not None and x.dtype == torch.float32 and x.device.type == "cpu"
        if (y is x and clip is None and not want_kl and not (channels and self.want_ranges) and not by_kernel
                and self._fold_identical(x, channels)):
            return None
        # Block by block (see BLOCK, _fold): float32 block sums accumulated in float64.
        by_channel = channels or want_kl
        layout = (x.shape[0], x.shape[1], -1) if by_channel else (-1,)
        target = _Target(y.detach().reshape(layout), raw.detach().reshape(layout) if clip is not None else None,
                         channels, self.want_ranges, want_kl, clip)
        return target, by_channel, work_dtype(x, y)

    def _absorb(self, part: dict, x: torch.Tensor, target: _Target) -> None:
        """Add one batch's sums (``_fold``'s, for ``target``)."""
        self.sxx += part["sxx"]
        self.syy += part["syy"]
        self.sxy += part["sxy"]
        self.see += part["see"]
        self.sae += part["sae"]
        self.nonfinite += part["nonfinite"]
        self.saturated += part["saturated"]
        self.kl_sum += part["kl_sum"]
        self.n += x.numel()
        batch_max = part["max"]
        self.max_abs = batch_max if math.isnan(batch_max) else max(self.max_abs, batch_max)
        if target.clip is not None:
            self.saturation_n += target.rv.numel()
        if target.want_kl:
            self.kl_n += x.numel() // x.shape[1]
        if part["ch"] is not None:
            self._add_channels(*part["ch"])

    def _add_channels(self, xx: torch.Tensor, ee: torch.Tensor, lo: torch.Tensor | None,
                      hi: torch.Tensor | None) -> None:
        if self.ch_xx is None:
            self.ch_xx, self.ch_ee, self.ch_min, self.ch_max = xx, ee, lo, hi
            return
        self.ch_xx += xx
        self.ch_ee += ee
        if lo is not None:
            torch.minimum(self.ch_min, lo, out=self.ch_min)
            torch.maximum(self.ch_max, hi, out=self.ch_max)

    def _fold_identical(self, x: torch.Tensor, channels: bool) -> bool:
        """Fold a batch whose y is x itself (an exact match): only sum(x^2) needs a pass
        (per channel with ``channels``; the error sums are 0).

        Returns False, folding nothing, when x is not finite (the general path counts and
        propagates NaN/Inf, and redoes float32 overflow in float64).
        """
        view = x.detach().reshape((x.shape[0], x.shape[1], -1) if channels else (-1,))
        dtype = work_dtype(x, x)
        per_channel = None
        for block in _blocks(x.shape, channels):
            xb = view[block].to(dtype)
            square = torch.mul(xb, xb, out=_scratch(1, xb))
            part = square.sum((0, 2)) if channels else square.sum().reshape(1)
            per_channel = part.double() if per_channel is None else per_channel + part.double()
        total = float(per_channel.sum())
        if not math.isfinite(total):
            return False
        self.n += x.numel()
        self.sxx += total
        self.syy += total
        self.sxy += total
        if channels:
            self._add_channels(per_channel, torch.zeros_like(per_channel), None, None)
        return True

    # -- combining runs over shards of the batches (qdebug.config.distributed) -------------------
    _SUMMED = ("n", "sxx", "syy", "sxy", "see", "sae", "nonfinite", "saturated", "saturation_n", "kl_sum", "kl_n")

    def state(self) -> dict:
        """Everything ``merge`` needs, as plain values and CPU tensors (for the exchange)."""
        out = {name: getattr(self, name) for name in (*self._SUMMED, "max_abs", "out_scale", "shape_mismatch",
                                                      "want_channels", "want_ranges", "want_kl")}
        for name in ("ch_xx", "ch_ee", "ch_min", "ch_max"):
            value = getattr(self, name)
            out[name] = value.cpu() if value is not None else None
        return out

    @classmethod
    def from_state(cls, state: dict) -> "ErrorStats":
        return cls(**state)

    def merge(self, other: "ErrorStats") -> "ErrorStats":
        """Fold in the sums of ``other`` (the same layer over other batches): afterwards this
        holds what one run over both sets of batches holds, up to float64 summation order
        (min, max and counts exactly).  Returns self."""
        for name in self._SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if math.isnan(self.max_abs) or math.isnan(other.max_abs):  # a NaN error is never hidden
            self.max_abs = math.nan
        else:
            self.max_abs = max(self.max_abs, other.max_abs)
        self.out_scale = self.out_scale if self.out_scale is not None else other.out_scale
        self.shape_mismatch = self.shape_mismatch or other.shape_mismatch
        if other.ch_xx is not None:
            device = self.ch_xx.device if self.ch_xx is not None else other.ch_xx.device
            moved = [t.to(device) if t is not None else None for t in (other.ch_xx, other.ch_ee, other.ch_min, other.ch_max)]
            if self.ch_xx is None:
                self.ch_xx, self.ch_ee, self.ch_min, self.ch_max = (t.clone() if t is not None else None for t in moved)
            else:
                self._add_channels(*moved)
        return self

    def result(self, prefix: str = "") -> dict[str, float]:
        if self.n == 0:
            return {}
        out = {
            "cosine": cosine_of_sums(self.sxy, self.sxx, self.syy),
            "sqnr_db": sqnr_db(self.sxx, self.see),
            "mse": self.see / self.n,
            "rel_l2": math.sqrt(self.see / self.sxx) if self.sxx > 0 else (0.0 if self.see == 0 else math.inf),
            "max_abs": self.max_abs,
            "mean_abs": self.sae / self.n,
            "nonfinite": float(self.nonfinite),
        }
        if self.out_scale:
            out["max_abs_scales"] = self.max_abs / self.out_scale
        if self.saturation_n:
            out["saturation"] = self.saturated / self.saturation_n
        if self.kl_n:
            out["kl"] = self.kl_sum / self.kl_n
        if self.ch_xx is not None:
            # Channels with (almost) no signal -- dead ReLU channels -- have no meaningful SQNR.
            floor = 1e-6 * float(self.ch_xx.max()) if self.ch_xx.numel() else 0.0
            channel_sqnr = [sqnr_db(a, b) for a, b in zip(self.ch_xx.tolist(), self.ch_ee.tolist()) if a > floor]
            if any(math.isnan(v) for v in channel_sqnr):  # a NaN channel is never hidden by the others
                out["min_channel_sqnr_db"] = out["median_channel_sqnr_db"] = math.nan
            elif channel_sqnr:
                out["min_channel_sqnr_db"] = min(channel_sqnr)
                out["median_channel_sqnr_db"] = float(torch.tensor(channel_sqnr, dtype=torch.float64).median())
        if self.ch_min is not None:
            ranges = (self.ch_max - self.ch_min).clamp(min=0)
            median = float(ranges.median())
            out["channel_range_ratio"] = float(ranges.max()) / median if median > 0 else (math.inf if float(ranges.max()) > 0 else 1.0)
            out["widest_channel"] = int(ranges.argmax())
        return {prefix + k: v for k, v in out.items()}


def update_together(x: torch.Tensor, compared: Sequence[tuple["ErrorStats", torch.Tensor, dict]]) -> None:
    """``stats.update(x, y, **kwargs)`` for each (stats, y, kwargs) compared with one reference x,
    reading x once: per block, its sum of squares (and channel ranges) is computed once and
    every y is folded while that block of x is in cache.  The same sums as separate updates,
    bit for bit."""
    groups: dict[tuple[bool, torch.dtype], list[tuple[ErrorStats, _Target]]] = {}
    for stats, y, kwargs in compared:
        planned = stats._plan(x, y, **kwargs)
        if planned is not None:
            target, by_channel, dtype = planned
            groups.setdefault((by_channel, dtype), []).append((stats, target))
    # One thread walks the blocks; torch's intra-op threads share out each op.  (Python threads
    # folding blocks side by side fought torch's spinning worker threads for the cores and ran
    # slower than this.)
    for (by_channel, dtype), members in groups.items():
        xv = x.detach().reshape((x.shape[0], x.shape[1], -1) if by_channel else (-1,))
        targets = [target for _, target in members]
        blocks = _blocks(x.shape, by_channel)
        parts = _fold_fused(xv, targets, blocks, dtype)
        rest = [k for k, part in enumerate(parts) if part is None]
        if rest:
            for k, part in zip(rest, _fold(xv, [targets[k] for k in rest], blocks, dtype)):
                parts[k] = part
        for (stats, target), part in zip(members, parts):
            stats._absorb(part, x, target)


def cosine_of_sums(sxy: float, sxx: float, syy: float) -> float:
    if any(math.isnan(v) for v in (sxy, sxx, syy)):
        return math.nan
    if sxx == 0 and syy == 0:
        return 1.0
    if sxx == 0 or syy == 0:
        return 0.0
    # sxy is derived from float32 block sums: keep rounding from stepping past +-1.
    return min(1.0, max(-1.0, sxy / math.sqrt(sxx * syy)))


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise) with exact matches = inf and NaN kept."""
    if math.isnan(signal) or math.isnan(noise):
        return math.nan
    if noise == 0:
        return math.inf
    if math.isinf(noise):  # an Inf in y: infinitely bad (or undefined if the signal is infinite too)
        return -math.inf if math.isfinite(signal) else math.nan
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
