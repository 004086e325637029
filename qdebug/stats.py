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
    saturation      fraction of values clipped by the output point: before quantization they
                    lay more than half a step beyond its qmin or qmax code
    nonfinite       number of NaN/Inf values in y (never averaged away: metrics become NaN/inf)
    per channel (axis 1):  min_channel_sqnr_db, median_channel_sqnr_db, and
    channel_range_ratio = max over channels of (max - min of x) / median of it.

A perfect match gives sqnr_db = inf and cosine = 1; a NaN anywhere in y makes the
sums NaN, and the metrics say so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).to(torch.float64)


@dataclass
class ErrorStats:
    """Running sums for one (layer, compared model) pair."""

    want_channels: bool = True
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
    ) -> None:
        """Fold one batch.  ``grid`` = (scale, zero_point, qmin, qmax) of y's output point and
        ``raw`` = y before that point quantized it, for saturation."""
        if x.shape != y.shape:
            self.shape_mismatch = f"{list(x.shape)} vs {list(y.shape)}"
            return
        if x.numel() == 0:
            return
        xd, yd = _f64(x), _f64(y)
        err = yd - xd
        self.n += xd.numel()
        self.sxx += float(torch.dot(xd, xd))
        self.syy += float(torch.dot(yd, yd))
        self.sxy += float(torch.dot(xd, yd))
        self.see += float(torch.dot(err, err))
        abs_err = err.abs()
        self.sae += float(abs_err.sum())
        batch_max = float(abs_err.max())
        self.max_abs = batch_max if math.isnan(batch_max) else max(self.max_abs, batch_max)
        self.nonfinite += int((~torch.isfinite(y)).sum())
        if grid is not None:
            scale, zero_point, qmin, qmax = grid
            self.out_scale = scale
            if raw is not None and raw.shape == y.shape:
                # Clipped = beyond half a step past either end of the representable range.
                lo, hi = (qmin - zero_point - 0.5) * scale, (qmax - zero_point + 0.5) * scale
                rf = raw.detach().float()
                self.saturated += int(((rf < lo) | (rf > hi)).sum())
                self.saturation_n += raw.numel()
        if self.want_channels and x.dim() >= 2 and x.shape[1] > 1:
            self._update_channels(x, err.reshape(x.shape))
        if self.want_kl and x.dim() >= 2 and x.shape[1] > 1:
            log_p = torch.log_softmax(x.detach().double(), dim=1)
            log_q = torch.log_softmax(y.detach().double(), dim=1)
            kl = (log_p.exp() * (log_p - log_q)).sum(dim=1)
            self.kl_sum += float(kl.sum())
            self.kl_n += kl.numel()

    def _update_channels(self, x: torch.Tensor, err: torch.Tensor) -> None:
        c = x.shape[1]
        xc = x.detach().double().transpose(0, 1).reshape(c, -1)
        ec = err.transpose(0, 1).reshape(c, -1)
        xx, ee = (xc * xc).sum(1), (ec * ec).sum(1)
        lo, hi = xc.amin(1), xc.amax(1)
        if self.ch_xx is None:
            self.ch_xx, self.ch_ee, self.ch_min, self.ch_max = xx, ee, lo, hi
        else:
            self.ch_xx += xx
            self.ch_ee += ee
            self.ch_min = torch.minimum(self.ch_min, lo)
            self.ch_max = torch.maximum(self.ch_max, hi)

    def result(self, prefix: str = "") -> dict[str, float]:
        if self.n == 0:
            return {}
        out = {
            "cosine": _cosine(self.sxy, self.sxx, self.syy),
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
            channel_sqnr = [sqnr_db(float(a), float(b)) for a, b in zip(self.ch_xx, self.ch_ee) if float(a) > floor]
            if any(math.isnan(v) for v in channel_sqnr):  # a NaN channel is never hidden by the others
                out["min_channel_sqnr_db"] = out["median_channel_sqnr_db"] = math.nan
            elif channel_sqnr:
                out["min_channel_sqnr_db"] = min(channel_sqnr)
                out["median_channel_sqnr_db"] = float(torch.tensor(channel_sqnr, dtype=torch.float64).median())
            ranges = (self.ch_max - self.ch_min).clamp(min=0)
            median = float(ranges.median())
            out["channel_range_ratio"] = float(ranges.max()) / median if median > 0 else (math.inf if float(ranges.max()) > 0 else 1.0)
        return {prefix + k: v for k, v in out.items()}


def _cosine(sxy: float, sxx: float, syy: float) -> float:
    if any(math.isnan(v) for v in (sxy, sxx, syy)):
        return math.nan
    if sxx == 0 and syy == 0:
        return 1.0
    if sxx == 0 or syy == 0:
        return 0.0
    return sxy / math.sqrt(sxx * syy)


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
