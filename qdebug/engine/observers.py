"""Range estimation: the observers that turn the tensors they see into a clip range.

This module owns *how* a quant point's range is estimated from data.  Each
observer is an ``nn.Module`` fed batches through ``forward`` (which returns its
input unchanged); ``clip_range()`` gives the chosen ``(lo, hi)`` and
``calculate_qparams()`` hands that range to ``qdebug.engine.spec.qparams_from_range``,
the single place where a range becomes a scale and zero point (0 inside the
range, the symmetric divisor, the eps floor).  Nothing here decides those rules.

Shared behaviour (all observers):

* All state lives in registered buffers, so ``state_dict()`` is a complete
  checkpoint of the observer.  Buffers whose shape is only known after the
  first batch (per-channel size ``C``, histograms) start empty and are resized
  by ``_load_from_state_dict`` when a state dict is loaded into a fresh observer.
* Non-finite values (NaN, +Inf, -Inf) never enter a range; they are counted in
  the int64 buffer ``nonfinite``.
* ``spec.per_channel``: statistics are kept per slice along ``spec.ch_axis``
  (negative axes allowed); results have shape ``[C]``.  Per-tensor results are
  0-dim.  Every observer supports both.
* ``min_val`` / ``max_val`` buffers always hold the exact running min/max of the
  finite values seen (for ``ema``: the moving averages).  ``+inf`` / ``-inf``
  there means "no finite value yet" (``qparams_from_range`` then gives s=1, z=0).

Observers (``spec.observer``):

* ``minmax``      -- running min and max over all batches.
* ``ema``         -- exponential moving average of the per-batch min and max.
* ``percentile``  -- a percentile of the histogram of all values seen.
* ``mse``         -- the clip range minimising the expected quantization MSE.
* ``kl``          -- TensorRT-style entropy (KL divergence) calibration.

The three histogram observers share ``HistogramObserver``'s fixed-size,
exactly-mergeable histogram (memory does not grow with the number of batches);
its scheme is documented there.  Each class docstring carries its exact math.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from qdebug.engine.spec import QuantSpec, qparams_from_range
from qdebug.errors import QDebugError

__all__ = [
    "Observer",
    "MinMaxObserver",
    "EMAObserver",
    "HistogramObserver",
    "PercentileObserver",
    "MSEObserver",
    "KLObserver",
    "make_observer",
]

_INF = float("inf")
_SAVED_HINT = "the file is damaged or was saved with another spec: re-save it"


class Observer(torch.nn.Module):
    """Base class: batch reduction, non-finite handling, per-channel layout, buffers.

    Subclasses implement ``_update(rows, bmin, bmax, mask)`` (fold one batch in)
    and ``clip_range()``.  ``rows`` is the batch as float32 ``[C, M]`` (``C = 1``
    per-tensor), ``bmin``/``bmax`` its per-row min/max over finite values
    (``+inf``/``-inf`` for a row without any), ``mask`` the finite mask or None
    when every value is finite.
    """

    def __init__(self, spec: QuantSpec):
        super().__init__()
        if not isinstance(spec, QuantSpec):
            raise QDebugError(f"an observer needs a QuantSpec, got {type(spec).__name__}",
                              "e.g. make_observer(QuantSpec())")
        self.last_batch_finite = False  # set by each batch: True when it held no NaN/Inf
        self.spec = spec
        # Names of buffers whose shape depends on the data (resized on load / first batch).
        self._lazy_buffers: list[str] = []
        self.register_buffer("nonfinite", torch.zeros((), dtype=torch.int64))
        if spec.per_channel:
            self.register_buffer("min_val", torch.empty(0, dtype=torch.float32))
            self.register_buffer("max_val", torch.empty(0, dtype=torch.float32))
            self._lazy_buffers += ["min_val", "max_val"]
        else:
            self.register_buffer("min_val", torch.tensor(_INF, dtype=torch.float32))
            self.register_buffer("max_val", torch.tensor(-_INF, dtype=torch.float32))

    # -- public API ----------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Fold ``x`` into the statistics and return ``x`` unchanged."""
        with torch.no_grad():
            rows = self._rows(x.detach())
            if rows.numel() == 0:
                return x  # nothing to learn from an empty batch
            if self.nonfinite.device != rows.device:
                # A fresh observer (a new spec tried by suggest, a point found mid-forward) is made
                # on the CPU: its statistics go where the data is, as a model's would with .to().
                self.to(rows.device)
            self._ensure_channels(rows.shape[0], rows.device)
            bmin, bmax, mask = self._batch_minmax(rows)
            self._update(rows, bmin, bmax, mask)
        return x

    def reset(self, keep_channels: int | None = None) -> None:
        """Forget everything seen (lazy buffers go back to empty).

        ``keep_channels``: the next batch will have this many channels; when the
        buffers already have that size they are cleared in place rather than
        reallocated (weight points reset every training step).
        """
        if keep_channels is not None and self.spec.per_channel and self.min_val.numel() == keep_channels:
            with torch.no_grad():
                self.nonfinite.zero_()
                self.min_val.fill_(_INF)
                self.max_val.fill_(-_INF)
            return
        with torch.no_grad():
            self.nonfinite.zero_()
            if self.spec.per_channel:
                dev = self.min_val.device
                self.min_val = torch.empty(0, dtype=torch.float32, device=dev)
                self.max_val = torch.empty(0, dtype=torch.float32, device=dev)
            else:
                self.min_val.fill_(_INF)
                self.max_val.fill_(-_INF)

    @property
    def initialized(self) -> bool:
        """True once at least one finite value was seen (in any channel)."""
        return bool(self.min_val.numel() > 0 and torch.isfinite(self.min_val).any())

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale float32, zero_point int32) of ``clip_range()`` via ``qparams_from_range``."""
        lo, hi = self.clip_range()
        return qparams_from_range(lo, hi, self.spec)

    def clip_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen (lo, hi): 0-dim per-tensor, ``[C]`` per-channel (float32)."""
        return self.min_val.clone(), self.max_val.clone()

    def extra_repr(self) -> str:
        return self.spec.describe()

    # -- batch layout ------------------------------------------------------------------
    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as float32 ``[C, M]``: one row per channel (per-tensor: one row)."""
        if self.spec.per_channel:
            axis = self.spec.ch_axis
            if not -x.dim() <= axis < x.dim():
                raise QDebugError(
                    f"per-channel axis ch_axis={axis} does not exist for a tensor of shape "
                    f"{tuple(x.shape)} ({x.dim()} dims)",
                    f"use an axis in [{-x.dim()}, {x.dim() - 1}] or per_channel=false",
                )
            axis %= x.dim()
            rows = x.movedim(axis, 0).reshape(x.shape[axis], -1)
        else:
            rows = x.reshape(1, -1)
        # Buffers are float32; wider inputs are reduced in float32 like torch's observers.
        return rows if rows.dtype == torch.float32 else rows.to(torch.float32)

    def _ensure_channels(self, channels: int, device: torch.device) -> None:
        """Size the lazy buffers on the first batch; later batches must agree on C."""
        if not self.spec.per_channel:
            return
        if self.min_val.numel() == 0:
            self.min_val = torch.full((channels,), _INF, dtype=torch.float32, device=device)
            self.max_val = torch.full((channels,), -_INF, dtype=torch.float32, device=device)
        elif self.min_val.numel() != channels:
            raise QDebugError(
                f"observer has {self.min_val.numel()} channels but a batch has {channels} along "
                f"ch_axis={self.spec.ch_axis}",
                "reset() the observer before feeding a tensor with a different channel count",
            )

    def _batch_minmax(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Per-row min/max over finite values; counts non-finite values.

        Fast path: one ``torch.aminmax``.  NaN propagates through it and an Inf
        shows up as a bound, so a finite result proves every value is finite and
        the masked (slower, extra-memory) path runs only on dirty batches.
        """
        if rows.shape[0] == 1:
            # A whole-tensor reduction is parallel and vectorised; torch.aminmax along
            # a dim runs ~10-20x slower on CPU than it, or than amin + amax along the dim.
            bmin, bmax = torch.aminmax(rows)
            bmin, bmax = bmin.reshape(1), bmax.reshape(1)
        else:
            bmin, bmax = rows.amin(dim=1), rows.amax(dim=1)
        # bmax - bmin is finite only when both bounds are (inf - inf is NaN); the
        # sum is one number to check.  An overflow to inf merely takes the exact path.
        if math.isfinite(float((bmax - bmin).sum())):
            self.last_batch_finite = True  # lets fake quant skip its own NaN scan of this tensor
            return bmin, bmax, None
        self.last_batch_finite = False
        mask = torch.isfinite(rows)
        self.nonfinite += (~mask).sum()
        bmin = torch.where(mask, rows, _INF).amin(dim=1)
        bmax = torch.where(mask, rows, -_INF).amax(dim=1)
        return bmin, bmax, mask

    def _update(self, rows, bmin, bmax, mask) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def merge(self, other: "Observer") -> None:
        """Fold in what ``other`` (the same observer, spec and layout, fed other batches) saw:
        afterwards this holds what one observer fed both sets of batches would hold, exactly.
        Processes of a data-parallel calibration combine their observers with it."""
        if type(other) is not type(self) or other.spec != self.spec:
            raise QDebugError(f"cannot merge a {type(other).__name__} into a {type(self).__name__}",
                              "merge observers of one quant point")
        with torch.no_grad():
            self.nonfinite += other.nonfinite.to(self.nonfinite.device)
            if other.min_val.numel() == 0:
                return
            theirs = [t.to(self.min_val.device) for t in (other.min_val, other.max_val)]
            if self.min_val.numel() == 0:
                self.min_val, self.max_val = theirs[0].clone(), theirs[1].clone()
            else:
                self._merge_minmax(*theirs)

    def _merge_minmax(self, other_min: torch.Tensor, other_max: torch.Tensor) -> None:
        self._store_minmax(torch.minimum(self.min_val, other_min), torch.maximum(self.max_val, other_max))

    def _store_minmax(self, new_min: torch.Tensor, new_max: torch.Tensor) -> None:
        self.min_val.copy_(new_min.reshape(self.min_val.shape))
        self.max_val.copy_(new_max.reshape(self.max_val.shape))

    def _flat(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.reshape(-1)

    def _shape_out(self, t: torch.Tensor) -> torch.Tensor:
        """``[C]`` -> 0-dim per-tensor, unchanged per-channel."""
        return t.reshape(()) if not self.spec.per_channel else t

    # -- checkpoints ---------------------------------------------------------------
    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        self._check_saved(state_dict, prefix)
        # Lazy buffers may still be empty here (fresh observer) or sized for another
        # channel count: adopt the saved shape so the copy below restores it exactly.
        for name in self._lazy_buffers:
            saved = state_dict.get(prefix + name)
            current = self._buffers.get(name)
            if saved is None or current is None or saved.shape == current.shape:
                continue
            self._buffers[name] = torch.empty(saved.shape, dtype=current.dtype, device=current.device)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _check_saved(self, state_dict, prefix: str) -> None:
        """Refuse saved buffers this observer could not have written (one QDebugError naming the
        buffer): a non-tensor, another shape (lazy buffers: another number of dims, or lengths
        that disagree), NaN or an inverted infinity in a range, a negative count, histogram
        count or width -- values the update rules could loop on or never recover from.  (A
        file's keys and dtypes are checked before: ``qdebug.checkpoint``.)"""
        saved = {name: state_dict[prefix + name] for name in self._buffers if prefix + name in state_dict}
        hint = _SAVED_HINT
        for name, value in saved.items():
            what = f"saved observer buffer {prefix + name}"
            current = self._buffers[name]
            if not isinstance(value, torch.Tensor):
                raise QDebugError(f"{what} is a {type(value).__name__}, not a tensor", hint)
            lazy = name in self._lazy_buffers
            if (value.dim() != current.dim()) if lazy else (value.shape != current.shape):
                raise QDebugError(f"{what} has shape {tuple(value.shape)}, which does not fit a "
                                  f"{self.spec.describe()} observer", "load it with the spec it was saved with")
            self._check_loaded(name, value)
        lengths = {name: saved[name].shape[0] for name in self._lazy_buffers if name in saved}
        if len(set(lengths.values())) > 1 or (not self.spec.per_channel and any(n > 1 for n in lengths.values())):
            shown = ", ".join(f"{name} {n}" for name, n in lengths.items())
            raise QDebugError(f"saved observer buffers {prefix}* disagree on the channel count ({shown})", hint)
        for name, wrong in (("min_val", -_INF), ("max_val", _INF)):
            if name in saved and bool((torch.isnan(saved[name]) | (saved[name] == wrong)).any()):
                raise QDebugError(f"saved observer buffer {prefix + name} holds NaN or {'-' if wrong < 0 else '+'}inf; "
                                  "an observer's range holds finite values (min +inf, max -inf before any data)", hint)
        if "nonfinite" in saved and int(saved["nonfinite"]) < 0:
            raise QDebugError(f"saved observer buffer {prefix}nonfinite is negative", hint)

    def _check_loaded(self, name: str, saved: torch.Tensor) -> None:
        """Hook for subclasses to reject a saved buffer that cannot match the spec."""


class MinMaxObserver(Observer):
    """Running min/max over all batches.

    After batches ``x_1..x_n`` (finite values only, per channel ``c`` when
    per-channel)::

        min_val = min_t min(x_t),   max_val = max_t max(x_t)
        clip_range = (min_val, max_val)

    Matches ``torch.ao.quantization.MinMaxObserver`` / ``PerChannelMinMaxObserver``.
    """

    def _update(self, rows, bmin, bmax, mask) -> None:
        self._store_minmax(
            torch.minimum(self._flat(self.min_val), bmin), torch.maximum(self._flat(self.max_val), bmax)
        )


class EMAObserver(Observer):
    """Exponential moving average of the per-batch min and max.

    With ``c = spec.averaging_constant`` and ``b_t = min(x_t)`` (resp. max)::

        m_1 = b_1                                   (the first batch sets the range)
        m_t = m_{t-1} + c * (b_t - m_{t-1})  =  (1 - c) * m_{t-1} + c * b_t

    per channel when per-channel; a batch (channel) without finite values leaves
    ``m`` unchanged.  Starting from the first batch rather than from 0 matters:
    a zero-initialised EMA without bias correction is ``(1 - (1-c)^t)`` times too
    small (about 10x after 10 steps with c = 0.01), which collapsed QAT ranges.
    Same update (and operation order) as
    ``torch.ao.quantization.MovingAverageMinMaxObserver``.
    """

    def _update(self, rows, bmin, bmax, mask) -> None:
        c = float(self.spec.averaging_constant)
        old_min, old_max = self._flat(self.min_val), self._flat(self.max_val)
        if mask is None and math.isfinite(float((old_max - old_min).sum())):
            # Every channel has a running range and the batch is finite (the QAT
            # steady state): the plain update, without the masking below.
            self._store_minmax(old_min + c * (bmin - old_min), old_max + c * (bmax - old_max))
            return
        have = torch.isfinite(bmin)  # this batch has finite data in the channel
        fresh = ~torch.isfinite(old_min)  # channel never saw data: take the batch as is
        # The EMA branch is NaN for fresh channels (inf - inf); torch.where discards it.
        new_min = torch.where(have, torch.where(fresh, bmin, old_min + c * (bmin - old_min)), old_min)
        new_max = torch.where(have, torch.where(fresh, bmax, old_max + c * (bmax - old_max)), old_max)
        self._store_minmax(new_min, new_max)

    def merge(self, other: "Observer") -> None:
        raise QDebugError("the ema observer's range depends on the order of the batches, so processes that "
                          "saw different batches cannot combine it",
                          "calibrate with minmax, percentile, mse or kl, or on one process")


class HistogramObserver(Observer):
    """Base of ``percentile``/``mse``/``kl``: a fixed-size, exactly mergeable histogram.

    Per channel ``c`` (one row per-tensor) the state is ``hist[c]`` (``bins =
    spec.bins`` int64 counts), a width ``w_c`` (float64) and an integer anchor
    ``a_c``.  Bin ``j`` counts the finite values ``x`` with::

        floor(x / w_c) - a_c == j,    i.e.  x in [(a_c + j) w_c, (a_c + j + 1) w_c)

    so the histogram covers ``[a_c w_c, (a_c + bins) w_c)`` and its edges sit on
    integer multiples of ``w_c`` (0 is always an edge, which makes folding onto
    ``|x|`` exact).  Memory is ``C * bins`` counts whatever the number of batches.

    The width is *canonical*: with ``[m, M]`` the running min/max, ``w`` is the
    smallest power of two with

        floor(M / w) - floor(m / w) + 1 <= bins     (the range fits),
        w >= max(|m|, |M|) 2^-30                     (anchors stay far inside int64),
        w >= 2^-126                                  (all-zero data).

    Each condition only gets harder as ``[m, M]`` grows and easier as ``w`` doubles,
    so the canonical width of a wider range is a power-of-two multiple of a narrower
    range's: every batch finds the smallest ``k >= 0`` for which ``w 2^k`` meets them
    for the running range, sets ``w <- w 2^k`` and re-anchors ``a <- floor(m / w)``.
    The final ``(w, a)`` depend on the data's min and max alone, not on the order or
    the split of the batches, which is what lets the histograms of several processes
    merge exactly (``merge``).  Old absolute bin ``i``
    moves to ``floor(i / 2^k)``: each new bin is the exact union of ``2^k`` old
    bins, so merging loses nothing and the histogram equals the one built from
    all data at once with the final ``(w, a)``.  (Division by a power of two is
    exact in floating point, so ``floor(x / (w 2^k)) == floor(floor(x / w) / 2^k)``
    holds bit-for-bit, not only mathematically.)

    Buffers ``hist [C, bins]``, ``width [C]``, ``anchor [C]`` start empty (``C = 1``
    per-tensor); ``width == 0`` marks a channel that has not seen data yet.
    ``min_val``/``max_val`` keep the exact running min/max; every histogram-derived
    bound is clamped into them.
    """

    def __init__(self, spec: QuantSpec):
        super().__init__(spec)
        self.bins = int(spec.bins)
        self.register_buffer("hist", torch.zeros(0, self.bins, dtype=torch.int64))
        self.register_buffer("width", torch.zeros(0, dtype=torch.float64))
        self.register_buffer("anchor", torch.zeros(0, dtype=torch.int64))
        self._lazy_buffers += ["hist", "width", "anchor"]

    def reset(self, keep_channels: int | None = None) -> None:
        super().reset()  # the histogram's layout is rebuilt from the next batch either way
        dev = self.hist.device
        self.hist = torch.zeros(0, self.bins, dtype=torch.int64, device=dev)
        self.width = torch.zeros(0, dtype=torch.float64, device=dev)
        self.anchor = torch.zeros(0, dtype=torch.int64, device=dev)

    def _ensure_channels(self, channels: int, device: torch.device) -> None:
        super()._ensure_channels(channels, device)
        if self.hist.shape[0] == 0:
            self.hist = torch.zeros(channels, self.bins, dtype=torch.int64, device=device)
            self.width = torch.zeros(channels, dtype=torch.float64, device=device)
            self.anchor = torch.zeros(channels, dtype=torch.int64, device=device)

    def _check_loaded(self, name: str, saved: torch.Tensor) -> None:
        hint = _SAVED_HINT
        if name == "hist" and saved.shape[1] != self.bins:
            raise QDebugError(
                f"saved observer histogram has {saved.shape[1]} bins but the spec says bins={self.bins}",
                "load it with the spec it was saved with",
            )
        if name == "hist" and bool((saved < 0).any()):
            raise QDebugError("saved observer histogram holds negative counts", hint)
        if name == "width" and not bool((torch.isfinite(saved) & (saved >= 0)).all()):
            raise QDebugError("saved observer histogram width is negative or not finite", hint)
        if name == "anchor" and bool(((saved > 2**62) | (saved < -(2**62))).any()):
            raise QDebugError("saved observer histogram anchor is out of range", hint)

    # -- histogram maintenance ---------------------------------------------------------
    def _update(self, rows, bmin, bmax, mask) -> None:
        old_min, old_max = self._flat(self.min_val), self._flat(self.max_val)
        new_min, new_max = torch.minimum(old_min, bmin), torch.maximum(old_max, bmax)
        self._store_minmax(new_min, new_max)
        have = torch.isfinite(bmin)
        if not bool(have.any()):
            return
        bins = self.bins
        lo, hi = new_min.double(), new_max.double()
        w, a = self.width, self.anchor
        fresh = have & (w == 0)
        if bool(fresh.any()):
            w = torch.where(fresh, self._canonical_width(lo, hi, have), w)
        k = self._doublings(lo, hi, w, have)
        w_new = torch.ldexp(w, k)
        safe_w = torch.where(have, w_new, torch.ones_like(w_new))  # no 0-division on idle channels
        a_new = torch.where(have, torch.floor(torch.where(have, lo, 0.0) / safe_w).long(), a)

        hist = self.hist
        if bool(((k != 0) | (a_new != a)).any()):
            hist = self._remap(hist, a, k, a_new)

        # Bin the batch: local index floor(x / w) - a, offset by row so a single
        # bincount fills all channels at once.
        row_off = torch.arange(rows.shape[0], device=rows.device) * bins
        vals = rows.double() if mask is None else torch.where(mask, rows, 0.0).double()
        idx = torch.floor(vals / safe_w[:, None]).long() - a_new[:, None] + row_off[:, None]
        idx = idx.reshape(-1) if mask is None else idx[mask]
        hist = hist + torch.bincount(idx, minlength=hist.numel()).view_as(hist)

        self.hist = hist
        self.width = w_new
        self.anchor = a_new

    def _doublings(self, lo, hi, w, have) -> torch.Tensor:
        """Smallest k >= 0 per channel with the whole [lo, hi] inside ``bins`` bins of width w 2^k."""
        bins = self.bins
        lo = torch.where(have, lo, 0.0)
        hi = torch.where(have, hi, 0.0)
        w = torch.where(have, w, 1.0)
        span = hi - lo
        # w 2^k >= span / (bins - 2) always fits (floor difference <= span / w + 1), so
        # start one below that bound and step up: at most a couple of iterations.
        need = torch.log2(torch.clamp(span / (w * (bins - 2)), min=1.0))
        k = torch.clamp(torch.ceil(need) - 1, min=0).long()

        floor = torch.maximum(lo.abs(), hi.abs()) * 2.0**-30

        def fits(k):
            wk = torch.ldexp(w, k)
            return (torch.floor(hi / wk) - torch.floor(lo / wk) + 1 <= bins) & (wk >= floor)

        ok = fits(k)
        while not bool(ok.all()):
            k = torch.where(ok, k, k + 1)
            ok = fits(k)
        return k

    def _canonical_width(self, lo: torch.Tensor, hi: torch.Tensor, have: torch.Tensor) -> torch.Tensor:
        """The smallest power of two meeting the three conditions of the class docstring for
        [lo, hi] (float64 per channel; 1 where ``have`` is False)."""
        lo, hi = torch.where(have, lo, 0.0), torch.where(have, hi, 0.0)
        # floor(M/w) - floor(m/w) >= (M - m)/w - 1, so a fitting w is >= (M - m) / bins: the
        # smallest power of two above every lower bound is where the search starts.
        bound = torch.maximum((hi - lo) / self.bins, torch.maximum(lo.abs(), hi.abs()) * 2.0**-30).clamp(min=2.0**-126)
        mantissa, exponent = torch.frexp(bound)  # bound = mantissa 2^exponent, mantissa in [0.5, 1)
        start = torch.ldexp(torch.ones_like(bound), torch.where(mantissa == 0.5, exponent - 1, exponent))
        return torch.where(have, torch.ldexp(start, self._doublings(lo, hi, start, have)), torch.ones_like(bound))

    def _remap(self, hist, a_old, k, a_new) -> torch.Tensor:
        """Move counts to width w 2^k and anchor a_new: old absolute bin i -> floor(i / 2^k)."""
        bins = self.bins
        j = torch.arange(bins, device=hist.device)
        absolute = a_old[:, None] + j[None, :]
        # |absolute| stays far below 2^62, so shifting by more than 62 gives the same 0/-1.
        factor = torch.pow(torch.full_like(k, 2), torch.clamp(k, max=62))
        local = torch.div(absolute, factor[:, None], rounding_mode="floor") - a_new[:, None]
        # Only empty bins can fall outside the new window (occupied ones lie inside
        # [floor(min/w'), floor(max/w')] by construction); clamping them adds zeros.
        local = local.clamp(0, bins - 1)
        return torch.zeros_like(hist).scatter_add_(1, local, hist)

    # -- helpers for subclasses ----------------------------------------------------------
    def merge(self, other: "Observer") -> None:
        """Both histograms moved onto the canonical width of the united range and added: exact,
        since each is on a power-of-two fraction of it (class docstring)."""
        mine = (self.hist, self.width, self.anchor) if self.hist.shape[0] else None
        device = self.hist.device
        theirs = tuple(t.to(device) for t in (other.hist, other.width, other.anchor)) if other.hist.shape[0] else None
        super().merge(other)
        if theirs is None:
            return
        if mine is None:
            self.hist, self.width, self.anchor = (t.clone() for t in theirs)
            return
        lo, hi = self._flat(self.min_val).double(), self._flat(self.max_val).double()
        have = torch.isfinite(lo)
        w = torch.maximum(mine[1], theirs[1])  # the wider of two canonical widths: a start for the united range
        w = torch.where(have, torch.ldexp(w, self._doublings(lo, hi, torch.where(w > 0, w, 1.0), have)), w)
        anchor = torch.where(have, torch.floor(torch.where(have, lo, 0.0) / torch.where(have, w, 1.0)).long(), mine[2])
        hist = torch.zeros_like(mine[0])
        for part_hist, part_w, part_a in (mine, theirs):
            used = part_w > 0
            mantissa, exponent = torch.frexp(torch.where(used, w / torch.where(used, part_w, 1.0), 1.0))
            if bool((used & (mantissa != 0.5)).any()):
                raise QDebugError("these observers' histograms are not on power-of-two related grids, so they "
                                  "cannot be merged exactly (one was saved by an older qdebug)",
                                  "calibrate again from the float checkpoint")
            k = torch.where(used, exponent - 1, 0).long()
            hist += self._remap(part_hist, torch.where(used, part_a, anchor), k, anchor)
        self.hist, self.width, self.anchor = hist, w, anchor

    def _bin_lower_edges(self) -> torch.Tensor:
        """float64 [C, bins]: lower edge of each bin, ``(a + j) w``."""
        j = torch.arange(self.bins, device=self.hist.device, dtype=torch.float64)
        return (self.anchor.double()[:, None] + j[None, :]) * self.width[:, None]

    def _folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Histogram of |x| on the same grid: (counts [C, bins], first folded index f0 [C]).

        Absolute bin ``i`` (``x in [i w, (i+1) w)``) maps to ``|x|`` bin ``i`` for
        ``i >= 0`` and ``-i-1`` for ``i < 0`` (``|x| in ((-i-1) w, -i w]``): exact up to
        which side of an edge a value lying exactly on it is counted.  Local folded
        bin ``j`` covers ``|x| in [(f0 + j) w, (f0 + j + 1) w)``; the occupied folded
        indices always fit in ``bins`` slots starting at ``f0``.
        """
        bins = self.bins
        a = self.anchor
        j = torch.arange(bins, device=a.device)
        absolute = a[:, None] + j[None, :]
        folded = torch.where(absolute >= 0, absolute, -absolute - 1)
        f0 = torch.where(a >= 0, a, torch.where(a + bins <= 0, -a - bins, torch.zeros_like(a)))
        local = folded - f0[:, None]
        return torch.zeros_like(self.hist).scatter_add_(1, local, self.hist), f0

    def _finish(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Clamp into the observed range, keep uninitialised channels at +-inf, shape for output."""
        mn, mx = self._flat(self.min_val).double(), self._flat(self.max_val).double()
        data = torch.isfinite(mn)
        lo = torch.where(data, torch.maximum(torch.minimum(lo, mx), mn), mn)
        hi = torch.where(data, torch.minimum(torch.maximum(hi, mn), mx), mx)
        return self._shape_out(lo.float()), self._shape_out(hi.float())

    def _symmetric_signed(self) -> bool:
        return self.spec.symmetric and self.spec.signed

    def _max_abs(self) -> torch.Tensor:
        mn, mx = self._flat(self.min_val).double(), self._flat(self.max_val).double()
        return torch.maximum(mn.abs(), mx.abs())

    def _threshold_range(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Range of a threshold T on |x|: [-T, T] symmetric signed, else [max(min,-T), min(max,T)]."""
        mn, mx = self._flat(self.min_val).double(), self._flat(self.max_val).double()
        data = torch.isfinite(mn)
        if self._symmetric_signed():
            lo, hi = -t, t
        else:
            lo, hi = torch.maximum(mn, -t), torch.minimum(mx, t)
        lo = torch.where(data, lo, mn)
        hi = torch.where(data, hi, mx)
        return self._shape_out(lo.float()), self._shape_out(hi.float())


def _hist_quantile(counts: torch.Tensor, edge0: torch.Tensor, width: torch.Tensor, q: float) -> torch.Tensor:
    """Per-row value of the sample at 0-based rank ``q (N - 1)`` of a histogram.

    The ``n_b`` samples of bin ``b`` are placed at ``edge_b + (s + 1/2) w / n_b``,
    ``s = 0..n_b-1`` (uniform inside the bin); the rank's fractional part is
    interpolated between neighbours in the same way.  So the estimate is within
    one bin width of the exact order statistic.
    """
    counts = counts.double()
    total = counts.sum(dim=1)
    rank = q * torch.clamp(total - 1, min=0)
    cum = counts.cumsum(dim=1)
    b = torch.searchsorted(cum, rank[:, None], right=True).squeeze(1).clamp(max=counts.shape[1] - 1)
    n_b = counts.gather(1, b[:, None]).squeeze(1)
    before = cum.gather(1, b[:, None]).squeeze(1) - n_b
    frac = ((rank - before + 0.5) / n_b.clamp(min=1)).clamp(0.0, 1.0)
    return edge0 + (b.double() + frac) * width


class PercentileObserver(HistogramObserver):
    """Clip range from a percentile ``p = spec.percentile`` of the histogram.

    Quantile ``Q(q)`` = value of 0-based rank ``q (N - 1)`` (torch.quantile's
    convention), read from the histogram with samples spread uniformly inside
    their bin (see ``_hist_quantile``), hence within one bin width of the exact
    ``torch.quantile`` of all data seen.

    * symmetric signed: ``T = Q_|x|(p / 100)`` on the ``|x|`` histogram, range
      ``[-T, T]`` (T clamped to ``max|x|``);
    * otherwise: ``lo = Q(1 - p/100)``, ``hi = Q(p/100)``, clamped into ``[min, max]``.

    ``p = 100`` gives exactly the observed min/max (or max|x|).
    """

    def clip_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.hist.shape[0] == 0:
            return self._shape_out(self.min_val.clone()), self._shape_out(self.max_val.clone())
        p = float(self.spec.percentile) / 100.0
        if self._symmetric_signed():
            amax = self._max_abs()
            if p >= 1.0:
                return self._threshold_range(amax)
            folded, f0 = self._folded()
            t = _hist_quantile(folded, f0.double() * self.width, self.width, p)
            return self._threshold_range(torch.minimum(t, amax))
        if p >= 1.0:
            return super().clip_range()
        edge0 = self.anchor.double() * self.width
        lo = _hist_quantile(self.hist, edge0, self.width, 1.0 - p)
        hi = _hist_quantile(self.hist, edge0, self.width, p)
        return self._finish(lo, hi)


class MSEObserver(HistogramObserver):
    """Clip range minimising the expected quantization MSE, estimated on the histogram.

    Candidates (``G = num_candidates = 256``, ``g = 1..G``):

    * symmetric: threshold ``T_g = (g / G) * A`` with ``A = max|x|`` (signed) or
      ``A = max(max, 0)`` (unsigned); candidate range ``[max(min, -T), min(max, T)]``
      and the returned range is ``[-T, T]`` for signed specs.
    * affine: both ends scaled by ``alpha_g = g / G``: ``[alpha min, alpha max]``.

    Each candidate range goes through ``qparams_from_range`` (so 0-widening and
    zero-point rounding are those really used), giving ``s`` and ``z`` and the
    representable interval ``[r_lo, r_hi] = [(qmin - z) s, (qmax - z) s]``.  With
    ``h_k`` the count of bin ``k`` and ``c_k`` its centre (clamped into the
    observed [min, max]), the expected error is::

        E = sum_{c_k < r_lo} h_k (c_k - r_lo)^2  +  sum_{c_k > r_hi} h_k (c_k - r_hi)^2
            + sum_{c_k in Z} h_k c_k^2  +  (s^2 / 12) * sum_{c_k in [r_lo, r_hi], not in Z} h_k

    where ``Z = [-s/2, s/2) ∩ [r_lo, r_hi]`` is the rounding cell of the grid point
    0 (always representable), whose values round to 0.  Approximations: each
    bin's mass sits at its centre, and rounding noise elsewhere inside the range
    is uniform with variance ``s^2 / 12`` (exact for values spread smoothly over
    many quantization steps; the ``Z`` term fixes the case where the step dwarfs
    the bulk of the data, e.g. 4-bit with outliers, where that model is far off).  The sums are
    prefix sums, so all candidates of all channels cost ``O(C (bins + G log bins))``.
    Ties go to the widest candidate (least clipping).
    """

    num_candidates = 256

    def clip_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.hist.shape[0] == 0:
            return self._shape_out(self.min_val.clone()), self._shape_out(self.max_val.clone())
        spec = self.spec
        mn, mx = self._flat(self.min_val).double(), self._flat(self.max_val).double()
        data = torch.isfinite(mn)
        mn0, mx0 = torch.where(data, mn, 0.0), torch.where(data, mx, 0.0)
        G = self.num_candidates
        frac = torch.arange(1, G + 1, device=mn.device, dtype=torch.float64) / G  # [G]
        if spec.symmetric:
            top = torch.maximum(mn0.abs(), mx0.abs()) if spec.signed else mx0.clamp(min=0.0)
            t = top[:, None] * frac[None, :]  # [C, G]
            c_lo, c_hi = torch.maximum(mn0[:, None], -t), torch.minimum(mx0[:, None], t)
        else:
            c_lo, c_hi = mn0[:, None] * frac[None, :], mx0[:, None] * frac[None, :]

        scale, zp = qparams_from_range(c_lo.float(), c_hi.float(), spec)
        s, z = scale.double(), zp.double()
        r_lo, r_hi = (spec.qmin - z) * s, (spec.qmax - z) * s

        h = self.hist.double()
        centres = (self._bin_lower_edges() + 0.5 * self.width[:, None]).clamp(mn0[:, None], mx0[:, None])
        zero = torch.zeros(h.shape[0], 1, dtype=torch.float64, device=h.device)
        H = torch.cat([zero, h.cumsum(1)], dim=1)
        S1 = torch.cat([zero, (h * centres).cumsum(1)], dim=1)
        S2 = torch.cat([zero, (h * centres * centres).cumsum(1)], dim=1)
        # Clamped centres are non-decreasing per row, as searchsorted needs.
        i_lo = torch.searchsorted(centres.contiguous(), r_lo.contiguous(), right=False)  # bins < r_lo
        i_hi = torch.searchsorted(centres.contiguous(), r_hi.contiguous(), right=True)  # bins <= r_hi

        def take(P, i):
            return P.gather(1, i)

        below = take(S2, i_lo) - 2 * r_lo * take(S1, i_lo) + r_lo * r_lo * take(H, i_lo)
        n = H[:, -1:]
        above = (
            (S2[:, -1:] - take(S2, i_hi))
            - 2 * r_hi * (S1[:, -1:] - take(S1, i_hi))
            + r_hi * r_hi * (n - take(H, i_hi))
        )
        # The cell of grid point 0 (0 is always representable): values there round
        # to 0 with error x^2, which is far below s^2/12 when the step dwarfs the
        # bulk (coarse candidates, low bits) -- the uniform model would overcharge them.
        i_z0 = torch.maximum(i_lo, torch.searchsorted(centres.contiguous(), (-0.5 * s).contiguous(), right=False))
        i_z1 = torch.minimum(i_hi, torch.searchsorted(centres.contiguous(), (0.5 * s).contiguous(), right=False))
        i_z1 = torch.maximum(i_z1, i_z0)
        zero_cell = take(S2, i_z1) - take(S2, i_z0)
        rest = (take(H, i_hi) - take(H, i_lo)) - (take(H, i_z1) - take(H, i_z0))
        inside = zero_cell + rest * s * s / 12.0
        err = below.clamp(min=0) + above.clamp(min=0) + inside  # clamp: cancellation noise
        # Widest among the minima: flip, take the first argmin, flip the index back.
        best = G - 1 - torch.argmin(err.flip(1), dim=1)
        lo = c_lo.gather(1, best[:, None]).squeeze(1)
        hi = c_hi.gather(1, best[:, None]).squeeze(1)
        if spec.symmetric and spec.signed:
            return self._threshold_range(t.gather(1, best[:, None]).squeeze(1))
        return self._finish(lo, hi)


# Normalised Q value given to the one bin that can have P > 0 but Q = 0 (see KLObserver);
# the same constant the MXNet/TVM entropy calibrators smooth with.
KL_EMPTY_Q = 1e-4
# Divergences closer than this count as equal (the first candidate wins).
KL_TIE_TOL = 1e-10


def _xlogx(v: np.ndarray) -> np.ndarray:
    return np.where(v > 0, v * np.log(np.where(v > 0, v, 1.0)), 0.0)


def _kl_best_bin(h: np.ndarray, levels: int) -> int:
    """Number of bins ``i`` kept (threshold at the upper edge of bin ``i-1``) minimising KL(P_i || Q_i).

    ``h``: float64 counts of the |x| histogram from 0, last entry non-zero,
    ``len(h) > levels``.  Closed form per candidate from prefix sums (formula in
    ``KLObserver``), vectorised over all candidates and groups: O(L (n - L)).
    """
    n = h.shape[0]
    total = h.sum()
    cum = np.concatenate([[0.0], np.cumsum(h)])
    nz = np.concatenate([[0.0], np.cumsum(h > 0)])
    cum_hlogh = np.concatenate([[0.0], np.cumsum(_xlogx(h))])

    i = np.arange(levels, n + 1)  # candidate numbers of bins kept
    inside = cum[i]  # M_i: mass of the kept bins, what Q is built from
    tail = total - inside  # clipped mass, added to P's bin i-1
    last = h[i - 1] + tail
    plogp = (cum_hlogh[i - 1] + _xlogx(last)) / total - np.log(total)

    m = i // levels  # bins per group; the last group also takes the remainder
    g = np.arange(levels)
    start = g[None, :] * m[:, None]  # [K, L]
    stop = np.where(g[None, :] == levels - 1, i[:, None], start + m[:, None])
    s_g = cum[stop] - cum[start]  # group mass without the tail (Q's source)
    n_g = nz[stop] - nz[start]  # non-empty bins of P in the group
    n_g[:, -1] += (h[i - 1] == 0) & (tail > 0)  # the tail can make bin i-1 non-empty
    t_g = s_g.copy()  # group mass of P: the tail sits in the last group
    t_g[:, -1] += tail
    full = s_g > 0  # implies n_g >= 1 and inside > 0
    denom = np.maximum(n_g, 1.0) * np.where(inside > 0, inside, 1.0)[:, None]
    log_q = np.log(np.where(full, s_g, 1.0) / denom)
    cross = np.where(full, t_g * log_q, 0.0).sum(axis=1)
    # Last group empty in Q but holding the clipped tail in P: q = KL_EMPTY_Q there.
    orphan = (s_g[:, -1] == 0) & (tail > 0)
    cross = cross + np.where(orphan, tail * np.log(KL_EMPTY_Q), 0.0)
    kl = plogp - cross / total
    # First minimum, as TensorRT/MXNet's argmin; the tolerance only absorbs rounding
    # of the closed form, so mathematically tied candidates (e.g. extending a
    # single-bin grouping over empty bins) resolve to the smallest, deterministically.
    best = np.nonzero(kl <= kl.min() + KL_TIE_TOL)[0][0]
    return int(i[best])


class KLObserver(HistogramObserver):
    """TensorRT-style entropy calibration on the histogram of ``|x|``.

    The signed histogram is folded onto ``|x|`` (exact on the 0-anchored grid)
    and, if its first occupied bin is far from 0, coarsened by exact bin-pair
    merges until it starts at 0 and has at most ``bins`` bins: ``h_0..h_{n-1}``
    of width ``w``, ``h_{n-1} > 0``, ``N = sum h``.  Then ``h_0 <- h_1`` (the
    zero-bin rule of NVIDIA's pytorch-quantization): exact zeros -- a ReLU's,
    often most of its output -- quantize exactly, but merging that spike with
    its neighbours would cost more than any clipping, so without the rule the
    first candidate (``L`` bins, an eighth of a ReLU6's range at int8) wins.
    ``L`` = quantized levels on the |x| axis: ``2^(bits-1)`` signed, ``2^bits``
    unsigned.  For each ``i = L..n``:

    * ``P = (h_0, .., h_{i-2}, h_{i-1} + t)`` with the clipped tail
      ``t = sum_{k>=i} h_k``, normalised by ``N``;
    * split bins ``0..i-1`` into ``L`` groups of ``m = i // L`` bins (the last
      group takes the remainder).  ``Q`` is the *kept* histogram ``h_0..h_{i-1}``
      (without the tail, as in TensorRT's description) merged per group and
      expanded back: each bin where ``P > 0`` in group ``g`` gets ``S_g / n_g``
      (``S_g`` = the group's sum of ``h``, ``n_g`` = its number of bins with
      ``P > 0``), other bins 0; normalised by ``M = sum_{k<i} h_k``.
      (Building Q from P itself would make Q == P at ``i = L`` -- every group a
      single bin -- so the divergence would always pick ``i = L``.)
    * ``KL(P || Q) = sum_k p_k ln p_k - sum_g (T_g / N) ln(S_g / (n_g M))``,
      ``T_g`` = the group's mass in P (``S_g``, plus ``t`` for the last group).
      The one bin that can have ``p > 0 = q`` is bin ``i-1`` when the last group
      is empty in ``h`` but receives the tail; it gets ``q = KL_EMPTY_Q = 1e-4``
      (the smoothing constant of the MXNet/TVM calibrators) instead of an
      infinite divergence, so a lone far outlier does not force ``T = max``.

    ``T = i* w`` for the first ``i*`` of minimal KL (divergences within
    ``KL_TIE_TOL`` count as ties), clamped to ``max|x|``; since ``i >= L``, T is at
    least ``L`` bins (``max|x| / 16`` for int8 with 2048 bins on a grid from 0).
    If ``n <= L`` (e.g. 16-bit: at least as many levels as occupied bins) nothing
    is lost and ``T = max|x|``.  Range
    ``[-T, T]`` for symmetric signed specs, else ``[max(min, -T), min(max, T)]``.
    Cost ``O(L (n - L))`` per channel (numpy, vectorised over i): a few ms for
    2048 bins; channels are processed one after another.
    """

    def clip_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.hist.shape[0] == 0:
            return self._shape_out(self.min_val.clone()), self._shape_out(self.max_val.clone())
        spec = self.spec
        levels = 2 ** (spec.bits - 1) if spec.signed else 2**spec.bits
        amax = self._max_abs()
        folded, f0 = self._folded()
        folded_np = folded.cpu().numpy()
        f0_np = f0.cpu().numpy()
        width_np = self.width.double().cpu().numpy()
        thresholds = amax.clone().cpu()
        for c in range(folded_np.shape[0]):
            row = folded_np[c]
            occupied = np.nonzero(row)[0]
            if occupied.size == 0:
                continue
            first_abs = int(f0_np[c])
            n_abs = first_abs + int(occupied[-1]) + 1  # bins from 0 up to the last occupied one
            k = 0
            while (n_abs - 1) >> k >= self.bins:  # coarsen until the 0-based grid fits
                k += 1
            idx = (first_abs + occupied) >> k
            h = np.bincount(idx, weights=row[occupied].astype(np.float64), minlength=int(idx[-1]) + 1)
            if h.shape[0] <= levels:
                continue  # no more bins than levels: nothing to clip, T = max|x|
            h[0] = h[1]  # the zero-bin rule (docstring)
            best = _kl_best_bin(h, levels)
            thresholds[c] = best * width_np[c] * 2.0**k
        t = torch.minimum(thresholds.to(amax.device), amax)
        return self._threshold_range(t)


_OBSERVER_CLASSES: dict[str, type[Observer]] = {
    "minmax": MinMaxObserver,
    "ema": EMAObserver,
    "percentile": PercentileObserver,
    "mse": MSEObserver,
    "kl": KLObserver,
}


def merge_ranks(group, observers: dict[str, Observer]) -> None:
    """The observers of every rank of a data-parallel run merged into these (``Observer.merge``,
    exact), the same on every rank.  ``group``: a ``qdebug.config.distributed.Group``."""
    def merge(a: dict, b: dict) -> dict:
        merged = {}
        for name, saved in a.items():
            mine, theirs = make_observer(observers[name].spec), make_observer(observers[name].spec)
            mine.load_state_dict(saved)
            theirs.load_state_dict(b[name])
            mine.merge(theirs)
            merged[name] = mine.state_dict()
        return merged

    combined = group.combine({name: obs.state_dict() for name, obs in observers.items()}, merge)
    for name, obs in observers.items():
        obs.load_state_dict({key: value.to(obs.nonfinite.device) for key, value in combined[name].items()})


def make_observer(spec: QuantSpec) -> Observer:
    """The observer named by ``spec.observer`` (minmax, ema, percentile, mse, kl)."""
    try:
        cls = _OBSERVER_CLASSES[spec.observer]
    except KeyError:
        raise QDebugError(
            f"unknown observer {spec.observer!r}", f"choose one of {', '.join(_OBSERVER_CLASSES)}"
        ) from None
    return cls(spec)
