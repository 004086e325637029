"""glibc's malloc told to keep freed memory for the next tensor: ``reuse_freed_memory()``.

By default glibc gives a large block back to the kernel as soon as it is freed: an allocation
above ``M_MMAP_THRESHOLD`` is a mapping of its own, unmapped by ``free``, and free space past
``M_TRIM_THRESHOLD`` at the top of the heap is trimmed (the mmap threshold adapts up to 32 MiB;
larger blocks are always mapped afresh).  A plain forward frees and re-allocates in an order
that the adaptive threshold serves from the heap; a comparison does not: it holds a batch of
the reference's outputs while the compared model runs, and every large tensor of the next
forward is then fresh pages that the kernel must zero, one page fault per 4 KiB.  On
MobileNetV2 at 224 px (8 batches of 8) that was ~700,000 faults and 1.2 s of system time in
compare's 2 s (docs/benchmarks.md, "Compare").

``reuse_freed_memory`` sets both thresholds to 2 GiB - 1 (``mallopt``, once per process): a
block up to that size comes from the heap, and what is freed stays there for the next
allocation (compare: 4.8 -> 3.0 x its two forwards on MobileNetV2, 1.52 -> 1.43 on ResNet-18).
The same tensors are alive at once, but blocks of other sizes do not always fit the holes
freed ones leave: peak RSS grew 3-5% on MobileNetV2 (574 / 624 MB for 2 / 16 batches of
8x112 px, 559 / 593 MB without).  What was freed stays in the process until it ends, as with
jemalloc or tcmalloc.  The command line does it when a command starts; from Python, call it
yourself (it changes malloc for the whole process).  Nothing is done elsewhere than glibc (macOS, Windows, musl), or with
``QDEBUG_MALLOC=default`` in the environment.
"""

from __future__ import annotations

import functools
import os
import sys

ENV = "QDEBUG_MALLOC"  # "default": leave malloc as it is
KEEP_BYTES = 2**31 - 1  # mallopt takes an int: the most it can say
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


@functools.cache  # once per process: the first call's answer stands
def reuse_freed_memory() -> bool:
    """Keep freed memory in the heap for reuse (module docstring); True when malloc was told so
    (now or by an earlier call), False where it cannot be (not glibc) or ``QDEBUG_MALLOC=default``."""
    if os.environ.get(ENV, "").strip().lower() == "default" or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
    except OSError:  # no C library to load: nothing to tune
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or getattr(libc, "gnu_get_libc_version", None) is None:  # glibc's own: musl has mallopt
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))
