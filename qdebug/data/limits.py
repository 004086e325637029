"""How much data qdebug makes or reads: the limits that turn a mistake into one clear error.

An absurd ``random:`` spec (``MAX_BATCHES``, ``memory_limit()``), an endless generator without
``--batches`` (``MAX_BATCHES``) or a data file's batch too large to hold (``batch_bytes_limit()``)
is refused at once, not minutes of swapping and a killed process.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from qdebug.errors import QDebugError


MAX_BATCHES = 100_000  # the most batches a random: spec makes, a data function may yield or a file may hold


MAX_BATCH_BYTES = 8 << 30  # the most one batch of a data file may hold (decoded), at most memory_limit()


SEED_RANGE = (-(2**63), 2**64 - 1)  # the seeds torch.manual_seed and Generator.manual_seed take


def check_seed(seed: int, name: str, hint: str) -> None:
    """A seed torch's generators accept, -2**63 to 2**64 - 1: others fail deep inside torch
    with an overflow that names neither the option nor the limit."""
    low, high = SEED_RANGE
    if not low <= seed <= high:
        raise QDebugError(f"{name} must be from -2**63 to 2**64 - 1 ({high})", hint)


def memory_limit() -> int:
    """Bytes of data a ``random:`` spec may make in all: half the memory of this machine (or
    of its container, when that is less).  Batches are made one at a time, but a spec past
    this is a mistake (a shape typed wrong), and its passes would take hours."""
    total = 8 << 30  # when the machine does not say
    with contextlib.suppress(ValueError, OSError, AttributeError):
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for cgroup in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(ValueError, OSError):
            total = min(total, int(Path(cgroup).read_text().strip()))
    return total // 2


def batch_bytes_limit() -> int:
    """Bytes one batch of a data file may hold: ``MAX_BATCH_BYTES``, or ``memory_limit()`` when less."""
    return min(MAX_BATCH_BYTES, memory_limit())


def gib(count: int) -> str:
    return f"{count / 2**30:.3g} GiB"
