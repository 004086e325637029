"""The fused statistics kernel: every error sum of a layer in one read of its outputs.

``fold(x, ys)`` computes, for a reference x and one or two compared outputs y of the same
(n, c, m) shape, what ``qdebug.measure.stats`` reduces block by block with torch ops (about
18 passes over each block), in one pass of a C kernel (``_fused_stats.c``, where its math
is)::

    per channel:  sum x^2, min x, max x;   per y:  sum e^2 per channel, sum y^2,
                  sum |e|, max |e|           (e = y - x; all in float64)

``pip install`` builds the kernel where a C compiler is present; without one (or with
``QDEBUG_FUSED=0`` in the environment, for A/B runs) ``KERNEL`` is None and the statistics use
torch ops.  The kernel takes float32 CPU tensors whose rows are contiguous, and gives no
result for an output with a NaN or Inf in it (or in x): the torch path counts those.  It runs
on torch's own OpenMP threads, ``torch.get_num_threads()`` of them.

The same library counts a fake quantizer's clipped codes in one pass (``count_outside``);
loading this module installs it in the engine (``fake_quant.use_outside_counter``).
"""

from __future__ import annotations

import ctypes
import math
import os
from typing import Sequence

import torch

from qdebug.engine import fake_quant


def _load():
    """The kernel's library with its functions' signatures set, or None (not built, or off)."""
    if os.environ.get("QDEBUG_FUSED", "1") == "0":
        return None
    try:
        from qdebug.measure import _fused_stats  # the C file's module: it only marks where the library is
        library = ctypes.CDLL(_fused_stats.__file__)
    except (ImportError, OSError):
        return None
    i64, pointer = ctypes.c_int64, ctypes.c_void_p
    library.qd_fold.argtypes = [pointer, i64, i64, pointer, i64, i64, pointer, i64, i64, i64, i64, i64, pointer]
    library.qd_fold.restype = ctypes.c_int
    library.qd_count_outside.argtypes = [pointer, i64, ctypes.c_float, ctypes.c_float]
    library.qd_count_outside.restype = i64
    return library


_LIBRARY = _load()
KERNEL = _LIBRARY.qd_fold if _LIBRARY is not None else None
LANES = _LIBRARY.qd_lanes() if _LIBRARY is not None else 0  # doubles a vector register of the version this CPU runs


def count_outside(t: torch.Tensor, lo: float, hi: float) -> int | None:
    """How many values of a contiguous float32 CPU tensor lie below ``lo`` or above ``hi`` (NaN
    not counted, +-Inf counted), in one pass of the kernel; None for any other tensor.  ``lo``
    and ``hi`` are a quantizer's integer code limits: exact in float32."""
    if KERNEL is None or t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        return None
    return _LIBRARY.qd_count_outside(t.data_ptr(), t.numel(), lo, hi)


if KERNEL is not None:  # saturation counts in compare: one pass instead of up to five
    fake_quant.use_outside_counter(count_outside)


def describe() -> str:
    """How the statistics are reduced here, for benchmark reports."""
    if KERNEL is None:
        return "torch ops (no fused kernel)"
    return f"the fused kernel ({LANES} float64 lanes)"


def takes(x: torch.Tensor, ys: Sequence[torch.Tensor]) -> bool:
    """Whether the kernel can fold these (n, c, m) views: float32 on the CPU, rows contiguous."""
    if KERNEL is None:
        return False
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 3
               and (t.stride(2) == 1 or t.shape[2] == 1) for t in (x, *ys))


def fold(x: torch.Tensor, ys: Sequence[torch.Tensor]) -> list[dict | None]:
    """The sums of one or two y against x, all (n, c, m) views that ``takes`` accepts.

    Returns, per y, a dict of float64 values: sxx, syy, see, sae, max and the per-channel
    tensors ch_xx, ch_ee, ch_min, ch_max (float64, one set per y: they are grown in place);
    None for a y whose sums are not all finite (a NaN or Inf in it or in x), and for every y
    when the kernel could not allocate its working memory.  A y's results are the same bits
    whether it is folded alone or beside another.
    """
    if len(ys) not in (1, 2):
        raise ValueError(f"the kernel folds 1 or 2 outputs at a time, not {len(ys)}")
    n, c, m = x.shape
    out = _fresh(c, len(ys))
    y0, y1 = ys[0], ys[1] if len(ys) == 2 else None
    failed = KERNEL(x.data_ptr(), x.stride(0), x.stride(1), y0.data_ptr(), y0.stride(0), y0.stride(1),
                    y1.data_ptr() if y1 is not None else None, y1.stride(0) if y1 is not None else 0,
                    y1.stride(1) if y1 is not None else 0, n, c, m, out.data_ptr())
    if failed:
        return [None] * len(ys)
    ch_xx, ch_min, ch_max = out[:c], out[c:2 * c], out[2 * c:3 * c]
    sxx = float(ch_xx.sum())
    results: list[dict | None] = []
    for t in range(len(ys)):
        at = 3 * c + t * (c + 3)
        ch_ee = out[at:at + c]
        syy, sae, biggest = out[at + c:at + c + 3].tolist()
        see = float(ch_ee.sum())
        if not all(map(math.isfinite, (sxx, syy, see, sae))):
            results.append(None)
            continue
        # ``out`` is this call's own: the first y may keep its views; a second gets copies of the
        # reference's part, since each y's channel sums are grown in place.
        shared = (ch_xx, ch_min, ch_max) if t == 0 else (ch_xx.clone(), ch_min.clone(), ch_max.clone())
        results.append({"sxx": sxx, "syy": syy, "see": see, "sae": sae, "max": biggest, "ch_xx": shared[0],
                        "ch_ee": ch_ee, "ch_min": shared[1], "ch_max": shared[2]})
    return results


_FRESH: dict[tuple[int, int], torch.Tensor] = {}


def _fresh(c: int, outputs: int) -> torch.Tensor:
    """``qd_fold``'s starting ``out`` for c channels and 1 or 2 outputs: sums 0, minima +inf,
    maxima -inf (one copy of a kept template: cheaper than filling it op by op)."""
    template = _FRESH.get((c, outputs))
    if template is None:
        template = torch.zeros(3 * c + outputs * (c + 3), dtype=torch.float64)
        template[c:2 * c] = math.inf
        template[2 * c:3 * c] = -math.inf
        _FRESH[(c, outputs)] = template
    return template.clone()
