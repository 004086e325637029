"""``--data`` specs -> a ``BatchSource``: batches made lazily, each a model input plus an optional target.

Accepted specs (docs/cli.md):

- ``path.pt``: loaded weights-only.  A tensor X (samples), a tuple ``(X, y)``, or a
  dict with ``inputs``/``x`` and ``targets``/``y``/``labels`` is a dataset, cut into
  batches of ``batch_size``.  A dict may store its inputs compactly: integer inputs
  with ``input_scale``/``input_offset`` (decoded as inputs * scale + offset), or
  half precision (upcast to float32); a list is a list of ready batches (each a tensor, an
  ``(inputs, target)`` pair, or a dict of model kwargs).
- ``package.module:function``: the user's function, called with no arguments (once),
  returning an iterable of batches (``(inputs, target)`` pairs recognised): a list, a
  ``torch.utils.data.DataLoader``, a generator; the module is found from the current
  directory as ``python -m`` finds it.  The iterable is consumed lazily, batch by batch:
  never past ``batches``, so an endless generator works with ``--batches N``.
- ``random:8x3x224x224``: seeded standard-normal batches of that shape
  (``random:8x3x224x224:seed=1``); no target.  ``batches`` of them (default 4).

Every spec gives a ``qdebug.data.source.BatchSource``: re-iterable, each pass making the
batches anew (a file is sliced from a memory map: ``qdebug.data.file``), so nothing of
the data is held between batches and a tool may read it several times; the user's data
is checked to be the same on every pass.  ``batches`` limits how many batches are used,
over the whole data (before a ``shard``).  Data qdebug makes or pulls from the user's
function is bounded: an absurd ``random:`` spec (``limits.MAX_BATCHES``, ``limits.memory_limit()``) or
an endless generator without ``--batches`` (``limits.MAX_BATCHES``) is one clear error, not
minutes of swapping and a killed process.

Every batch is a ``qdebug.data.batch.Batch``.

torch loads on first use, not on import: ``check_spec`` and ``limits.check_seed`` let the
command line refuse a bad spec before torch's seconds of import.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable

from qdebug.data.batch import Batch, to_batch
# limits read at call time (module attributes): a test or a user may lower them
from qdebug.data import limits
from qdebug.data.origins import RandomOrigin, function_origin, iterable_origin, user_data_errors
from qdebug.data.source import BatchSource, HeldOrigin
from qdebug.errors import QDebugError

DEFAULT_BATCH_SIZE = 64
DEFAULT_RANDOM_BATCHES = 4
RANDOM_SPEC = re.compile(r"random:(\d+(?:x\d+)*)(?::seed=(\d+))?")
RANDOM_HINT = "write it like random:8x3x224x224 or random:8x3x32x32:seed=1"


def load_batches(spec: str, *, batch_size: int | None = None, batches: int | None = None) -> BatchSource:
    """Resolve a data spec (see module docstring) into a source of at most ``batches`` batches."""
    if batches is not None and batches < 1:
        raise QDebugError(f"--batches must be >= 1, got {batches}", "e.g. --batches 8")
    size = batch_size or DEFAULT_BATCH_SIZE
    if size < 1:
        raise QDebugError(f"batch size must be >= 1, got {size}", "e.g. --batch-size 8")
    if spec.startswith("random:"):
        origin = RandomOrigin(spec, *parse_random(spec, batches))
    elif spec.endswith((".pt", ".pth")) or Path(spec).is_file():
        from qdebug.data.file import FileOrigin

        origin = FileOrigin(Path(spec), size, batches)
    elif ":" in spec:
        origin = function_origin(spec, batches)
    else:
        raise QDebugError(
            f"cannot read data spec {spec!r}", "use a .pt file, package.module:function or random:8x3x224x224"
        )
    if origin.total == 0:  # a data function's emptiness shows at the end of its first pass
        raise QDebugError(f"data {spec!r} holds no batches", "check the data file or function: it yielded nothing")
    return BatchSource(origin)


def check_spec(spec: str, batches: int | None = None) -> None:
    """What can be checked of a data spec without torch, at once: a ``random:`` spec
    whole (shape, count, seed, size), a function's module name.  Files and functions
    are read later, when the batches are needed."""
    if spec.startswith("random:"):
        parse_random(spec, batches)
    elif not spec.endswith((".pt", ".pth")) and ":" in spec and not Path(spec).is_file():
        from qdebug.io.usercode import check_module_name

        check_module_name(spec.partition(":")[0], what=f"data function {spec}")


def parse_random(spec: str, batches: int | None) -> tuple[list[int], int, int]:
    """(shape, seed, count) of a ``random:`` spec, refused when it is malformed or absurd:
    a dimension of 0, a seed torch cannot take, more than ``limits.MAX_BATCHES`` batches, or more
    data than ``limits.memory_limit()`` (the limit is named, so the fix is plain)."""
    match = RANDOM_SPEC.fullmatch(spec)
    if not match:
        raise QDebugError(f"bad random data spec {spec!r}", RANDOM_HINT)
    # Digits past 19 are refused before int(): Python will not even convert 4301 of them.
    if any(len(d) > 19 for d in match.group(1).split("x")):
        raise QDebugError(f"random data spec {spec!r} has a dimension of 10**19 or more",
                          "use a smaller shape, e.g. random:8x3x224x224")
    shape = [int(d) for d in match.group(1).split("x")]
    if 0 in shape:
        raise QDebugError(f"random data spec {spec!r} has a dimension of 0: it holds no samples",
                          "every dimension must be >= 1, e.g. random:8x3x32x32")
    seed_text = match.group(2) or "0"
    seed = int(seed_text) if len(seed_text) <= 21 else limits.SEED_RANGE[1] + 1  # 21 digits are past the range already
    limits.check_seed(seed, f"the seed of {spec!r}", "e.g. random:8x3x32x32:seed=1")
    count = batches or DEFAULT_RANDOM_BATCHES
    if count > limits.MAX_BATCHES:
        raise QDebugError(f"random: data makes at most {limits.MAX_BATCHES} batches, got --batches {count}",
                          "use fewer --batches (random data is for smoke tests; evaluate on a .pt file or "
                          "package.module:function)")
    size = 4 * count  # bytes of float32 per element, over every batch
    for dim in shape:
        size *= dim
    if size > limits.memory_limit():
        raise QDebugError(f"random data {spec!r} x {count} batch(es) is {limits.gib(size)}, over the {limits.gib(limits.memory_limit())} "
                          "qdebug may hold (half this machine's memory)",
                          "use a smaller shape or fewer --batches")
    return shape, seed, count


def batches_from_inputs(sample_inputs: Any, batches: int | None = None) -> BatchSource:
    """A checkpoint's ``sample_inputs`` as batches (at most ``batches`` of them)."""
    found = [to_batch(b) for b in sample_inputs] if isinstance(sample_inputs, list) else [Batch(sample_inputs)]
    return BatchSource(HeldOrigin(found[:batches], "the sample inputs"))


def batches_from_iterable(data: Iterable, batches: int | None = None, name: str = "data") -> BatchSource:
    """Batches handed to the API: a list, a DataLoader or another iterable of batches, read as a data
    function's result is (lazily, each item recognised by ``to_batch``; at most ``batches``).  A
    one-shot iterator (a generator) serves one pass only: a tool that reads the data again says so."""
    if isinstance(data, BatchSource):
        return data
    if isinstance(data, (list, tuple)):
        found = [to_batch(b) for b in data]
        return BatchSource(HeldOrigin(found[:batches], name))
    return BatchSource(iterable_origin(data, name=name, limit=batches,
                                       errors=lambda: user_data_errors(name, what=name)))


def as_source(batches: Any, name: str = "batches") -> BatchSource:
    """What a tool was handed as a ``BatchSource``: itself, a list or tuple (items kept as they
    are: model inputs or ``Batch``es), or another iterable of batches (a DataLoader, a generator:
    read as a data function's result is)."""
    if isinstance(batches, BatchSource):
        return batches
    if isinstance(batches, (list, tuple)):
        return BatchSource.of(batches, name)
    return BatchSource(iterable_origin(batches, name=name))
