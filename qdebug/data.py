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

Every spec gives a ``qdebug.batch_source.BatchSource``: re-iterable, each pass making the
batches anew (a file is sliced from a memory map: ``qdebug.data_file``), so nothing of
the data is held between batches and a tool may read it several times; the user's data
is checked to be the same on every pass.  ``batches`` limits how many batches are used,
over the whole data (before a ``shard``).  Data qdebug makes or pulls from the user's
function is bounded: an absurd ``random:`` spec (``MAX_BATCHES``, ``memory_limit()``) or
an endless generator without ``--batches`` (``MAX_BATCHES``) is one clear error, not
minutes of swapping and a killed process.

Every batch is a ``Batch``: a named tuple ``(inputs, target)``, so a metric written
the usual PyTorch way (``for x, y in loader``) works on it unchanged, and
``batch.inputs`` / ``batch.target`` name the same two fields.  ``data_kind`` tells
what a loaded object is as data; the checkpoint loader uses it to call a data file
passed as a checkpoint by its name.

torch loads on first use, not on import: ``check_spec`` and ``check_seed`` let the
command line refuse a bad spec before torch's seconds of import.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, NamedTuple

from qdebug.batch_source import BatchSource, HeldOrigin, Origin, RandomOrigin, iterable_origin
from qdebug.errors import QDebugError, first_line

if TYPE_CHECKING:
    import torch

DEFAULT_BATCH_SIZE = 64
DEFAULT_RANDOM_BATCHES = 4
MAX_BATCHES = 100_000  # the most batches a random: spec makes, a data function may yield or a file may hold
MAX_BATCH_BYTES = 8 << 30  # the most one batch of a data file may hold (decoded), at most memory_limit()
SEED_RANGE = (-(2**63), 2**64 - 1)  # the seeds torch.manual_seed and Generator.manual_seed take
RANDOM_SPEC = re.compile(r"random:(\d+(?:x\d+)*)(?::seed=(\d+))?")
RANDOM_HINT = "write it like random:8x3x224x224 or random:8x3x32x32:seed=1"
FUNCTION_HINT = ("it is called with no arguments and returns an iterable of batches (tensors or "
                 "(inputs, target) pairs); --debug shows the traceback")


class Batch(NamedTuple):
    """One batch: ``inputs, target = batch`` (or ``batch.inputs``, ``batch.target``)."""

    inputs: Any  # tensor, tuple of args, or dict of kwargs: what the model is called with
    target: Any = None  # None when the data has no targets

    def size(self) -> int:
        import torch

        first = self.inputs
        if isinstance(first, (tuple, list)):
            first = first[0] if first else None
        elif isinstance(first, dict):
            first = next(iter(first.values()), None)
        return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 1


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
        from qdebug.data_file import FileOrigin

        origin = FileOrigin(Path(spec), size, batches)
    elif ":" in spec:
        origin = _from_function(spec, batches)
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
        from qdebug.usercode import check_module_name

        check_module_name(spec.partition(":")[0], what=f"data function {spec}")


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


def parse_random(spec: str, batches: int | None) -> tuple[list[int], int, int]:
    """(shape, seed, count) of a ``random:`` spec, refused when it is malformed or absurd:
    a dimension of 0, a seed torch cannot take, more than ``MAX_BATCHES`` batches, or more
    data than ``memory_limit()`` (the limit is named, so the fix is plain)."""
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
    seed = int(seed_text) if len(seed_text) <= 21 else SEED_RANGE[1] + 1  # 21 digits are past the range already
    check_seed(seed, f"the seed of {spec!r}", "e.g. random:8x3x32x32:seed=1")
    count = batches or DEFAULT_RANDOM_BATCHES
    if count > MAX_BATCHES:
        raise QDebugError(f"random: data makes at most {MAX_BATCHES} batches, got --batches {count}",
                          "use fewer --batches (random data is for smoke tests; evaluate on a .pt file or "
                          "package.module:function)")
    size = 4 * count  # bytes of float32 per element, over every batch
    for dim in shape:
        size *= dim
    if size > memory_limit():
        raise QDebugError(f"random data {spec!r} x {count} batch(es) is {gib(size)}, over the {gib(memory_limit())} "
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
                                       errors=lambda: _user_data_errors(name, what=name)))


INPUT_KEYS = ("inputs", "x", "images", "data")
TARGET_KEYS = ("targets", "target", "y", "labels")


def data_kind(obj: Any) -> str | None:
    """What ``obj`` (a loaded file) holds as data, in words, or None when it is not data.

    The one recognition rule of data files: ``qdebug.data_file`` reads exactly the objects
    this names, and ``checkpoint.load`` uses it to call a data file by its name.
    """
    import torch

    if isinstance(obj, torch.Tensor):
        return f"a tensor of {_count(obj)} input(s), no targets"
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(t, torch.Tensor) for t in obj):
        return f"{_count(obj[0])} input(s) and their targets"
    if isinstance(obj, dict):
        inputs = _first(obj, INPUT_KEYS)
        if isinstance(inputs, torch.Tensor):
            has_target = _first(obj, TARGET_KEYS) is not None
            return f"{_count(inputs)} input(s) and their targets" if has_target else f"{_count(inputs)} input(s), no targets"
        return None
    if isinstance(obj, list) and obj:
        try:
            for item in obj:
                to_batch(item)
        except QDebugError:
            return None
        return f"a list of {len(obj)} batch(es)"
    return None


def _count(tensor: torch.Tensor) -> int:
    return int(tensor.shape[0]) if tensor.dim() else 1


def _decode(inputs: torch.Tensor, obj: dict, source: str) -> torch.Tensor:
    """Compactly stored inputs: integer data with input_scale/input_offset, or half precision."""
    import torch

    if "input_scale" in obj or "input_offset" in obj:
        try:
            scale = torch.as_tensor(obj.get("input_scale", 1.0), dtype=torch.float32)
            offset = torch.as_tensor(obj.get("input_offset", 0.0), dtype=torch.float32)
            return inputs.to(torch.float32) * scale + offset
        except (TypeError, ValueError, RuntimeError) as exc:
            raise QDebugError(f"{source}: input_scale/input_offset cannot decode the inputs: {first_line(exc)}",
                              "store them as numbers, or tensors that broadcast to the inputs' shape") from None
    if inputs.dtype in (torch.float16, torch.bfloat16):
        return inputs.to(torch.float32)
    return inputs


def _first(obj: dict, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if key in obj:
            return obj[key]
    return None


def _check_dataset(inputs: torch.Tensor, target: Any, source: str) -> None:
    """A dataset is cut along its first dimension: the inputs and every target tensor need one,
    of the same length.  A 0-d tensor (one number) or a list of labels has none to cut."""
    import torch

    if inputs.dim() == 0:
        raise QDebugError(f"{source}: the inputs are a 0-d tensor (one number), not samples",
                          "save the samples stacked along a first dimension, e.g. x.reshape(1, *x.shape)")
    n = inputs.shape[0]
    targets = target.items() if isinstance(target, dict) else [("", target)] if target is not None else []
    for task, value in targets:
        what = f"the targets of {task!r}" if task else "the targets"
        if not isinstance(value, torch.Tensor):
            raise QDebugError(f"{source}: {what} are a {type(value).__name__}, not a tensor",
                              "save targets as a tensor with one entry per sample, e.g. torch.tensor(labels)")
        if value.dim() == 0:
            raise QDebugError(f"{source}: {what} are a 0-d tensor (one number) for {n} input(s)",
                              "save one target per sample: a tensor whose first dimension matches the inputs'")
        if value.shape[0] != n:
            raise QDebugError(f"{source}: data has {n} inputs but {value.shape[0]} targets"
                              + (f" for {task!r}" if task else ""), "inputs and targets must align")


def to_batch(item: Any, where: str | None = None, hint: str | None = None) -> Batch:
    """Recognise one batch: a Batch, a tensor, an (inputs, target) pair, or a dict of kwargs.

    Its inputs must hold a tensor: the model is called with them, and one called with
    ``0`` or ``{}`` fails inside qdebug's own layers, not with a message about the data.
    An error names the batch as ``where`` (e.g. ``"data.pt: batch 3"``) and says ``hint``
    (by default how a data function yields batches)."""
    try:
        batch = _recognised(item)
        _check_inputs(batch.inputs)
    except QDebugError as exc:
        if where is None and hint is None:
            raise
        raise QDebugError(f"{where}: {exc.message}" if where else exc.message, hint or exc.hint) from None
    return batch


def _recognised(item: Any) -> Batch:
    import torch

    if isinstance(item, Batch):
        return item
    if isinstance(item, torch.Tensor) and item.dim() == 0:
        raise QDebugError("a batch is a 0-d tensor (one number): a batch needs a first (sample) dimension",
                          "yield tensors of shape (batch, ...), e.g. x.unsqueeze(0) for one sample")
    if isinstance(item, torch.Tensor) or isinstance(item, dict):
        return Batch(item)
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return Batch(item[0], item[1])
    if isinstance(item, (tuple, list)):
        return Batch(tuple(item))
    raise QDebugError(f"cannot use a {type(item).__name__} as a batch", "yield tensors or (inputs, target) pairs")


def _check_inputs(inputs: Any) -> None:
    """A batch's inputs hold at least one tensor (in a tuple of args or a dict of kwargs)."""
    if _holds_tensor(inputs):
        return
    from qdebug.errors import shown

    raise QDebugError(f"a batch's inputs hold no tensor: {shown(inputs, 40)}",
                      "yield tensors or (inputs, target) pairs whose inputs are a tensor, a tuple or a dict of tensors")


def _holds_tensor(obj: Any, depth: int = 0) -> bool:
    import torch

    if isinstance(obj, torch.Tensor):
        return True
    if depth > 8:  # inputs nested deeper are no model's arguments
        return False
    if isinstance(obj, (tuple, list)):
        return any(_holds_tensor(x, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return any(_holds_tensor(x, depth + 1) for x in obj.values())
    return False


def _from_function(spec: str, batches: int | None) -> Origin:
    """The origin of the user's function's batches: the function is called once, here; its
    iterable is read lazily, pass by pass (``qdebug.batch_source.iterable_origin``): at most
    ``batches`` items are asked for, without ``batches`` at most ``MAX_BATCHES``, so an endless
    generator ends in an error that asks for ``--batches``."""
    from qdebug.modelspec import resolve

    fn = resolve(spec, from_user=True, what="data function (package.module:function)")
    name = f"data function {spec}" if callable(fn) else f"data {spec}"
    with _user_data_errors(spec):
        produced: Iterable = fn() if callable(fn) else fn
        return iterable_origin(produced, name=name, remake=fn if callable(fn) else None, limit=batches,
                               errors=lambda: _user_data_errors(spec))


@contextlib.contextmanager
def _user_data_errors(spec: str, what: str | None = None) -> Iterator[None]:
    """The data function raising (or calling ``sys.exit``), while called or iterated, as one
    error naming it (``what``: how, by default ``data function SPEC``) and the user's line."""
    from qdebug.usercode import exit_error, raised_by_user_code, where_raised

    what = what or f"data function {spec}"
    try:
        yield
    except QDebugError:
        raise
    except SystemExit as exc:
        raise exit_error(exc, what) from exc
    except BaseException as exc:
        if not raised_by_user_code(exc):
            raise
        where = where_raised(exc)
        raise QDebugError(f"{what} raised {type(exc).__name__}: {first_line(exc)}"
                          + (f", at {where}" if where else ""), FUNCTION_HINT) from exc
