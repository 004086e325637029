"""``--data`` specs -> a list of batches, each a model input plus an optional target.

Accepted specs (docs/cli.md):

- ``path.pt``: loaded weights-only.  A tensor X (samples), a tuple ``(X, y)``, or a
  dict with ``inputs``/``x`` and ``targets``/``y``/``labels`` is a dataset, cut into
  batches of ``batch_size``.  A dict may store its inputs compactly: integer inputs
  with ``input_scale``/``input_offset`` (decoded as inputs * scale + offset), or
  half precision (upcast to float32); a list is a list of ready batches (each a tensor, an
  ``(inputs, target)`` pair, or a dict of model kwargs).
- ``package.module:function``: the user's function, called with no arguments,
  returning an iterable of batches (``(inputs, target)`` pairs recognised); the
  module is found from the current directory as ``python -m`` finds it.
- ``random:8x3x224x224``: seeded standard-normal batches of that shape
  (``random:8x3x224x224:seed=1``); no target.

``batches`` limits how many batches are used.

Every batch is a ``Batch``: a named tuple ``(inputs, target)``, so a metric written
the usual PyTorch way (``for x, y in loader``) works on it unchanged, and
``batch.inputs`` / ``batch.target`` name the same two fields.  ``data_kind`` tells
what a loaded object is as data; the checkpoint loader uses it to call a data file
passed as a checkpoint by its name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import torch

from qdebug.errors import QDebugError

DEFAULT_BATCH_SIZE = 64
DEFAULT_RANDOM_BATCHES = 4


class Batch(NamedTuple):
    """One batch: ``inputs, target = batch`` (or ``batch.inputs``, ``batch.target``)."""

    inputs: Any  # tensor, tuple of args, or dict of kwargs: what the model is called with
    target: Any = None  # None when the data has no targets

    def size(self) -> int:
        first = self.inputs
        if isinstance(first, (tuple, list)):
            first = first[0]
        elif isinstance(first, dict):
            first = next(iter(first.values()))
        return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 1


def load_batches(spec: str, *, batch_size: int | None = None, batches: int | None = None) -> list[Batch]:
    """Resolve a data spec (see module docstring) into at most ``batches`` batches."""
    if batches is not None and batches < 1:
        raise QDebugError(f"--batches must be >= 1, got {batches}", "e.g. --batches 8")
    size = batch_size or DEFAULT_BATCH_SIZE
    if size < 1:
        raise QDebugError(f"batch size must be >= 1, got {size}", "e.g. --batch-size 8")
    if spec.startswith("random:"):
        result = _random(spec, batches)
    elif spec.endswith((".pt", ".pth")) or Path(spec).is_file():
        result = _from_file(Path(spec), size)
    elif ":" in spec:
        result = _from_function(spec)
    else:
        raise QDebugError(
            f"cannot read data spec {spec!r}", "use a .pt file, package.module:function or random:8x3x224x224"
        )
    if batches is not None:
        result = result[:batches]
    if not result:
        raise QDebugError(f"data {spec!r} holds no batches", "check the data file or function: it yielded nothing")
    return result


def batches_from_inputs(sample_inputs: Any) -> list[Batch]:
    """A checkpoint's ``sample_inputs`` as batches."""
    if isinstance(sample_inputs, list):
        return [to_batch(b) for b in sample_inputs]
    return [Batch(sample_inputs)]


def _random(spec: str, batches: int | None) -> list[Batch]:
    match = re.fullmatch(r"random:(\d+(?:x\d+)*)(?::seed=(\d+))?", spec)
    if not match:
        raise QDebugError(f"bad random data spec {spec!r}",
                          "write it like random:8x3x224x224 or random:8x3x32x32:seed=1")
    shape = [int(d) for d in match.group(1).split("x")]
    generator = torch.Generator().manual_seed(int(match.group(2) or 0))
    count = batches or DEFAULT_RANDOM_BATCHES
    return [Batch(torch.randn(*shape, generator=generator)) for _ in range(count)]


def _from_file(path: Path, batch_size: int) -> list[Batch]:
    from qdebug.torchfile import read_file

    obj = read_file(path)
    if not isinstance(obj, list) and data_kind(obj) is None:  # a list's odd item is named by to_batch
        raise QDebugError(
            f"{path} holds {type(obj).__name__}, not data qdebug understands",
            "save a tensor, a tuple (inputs, targets), a dict {'inputs', 'targets'} or a list of batches",
        )
    return as_batches(obj, batch_size)


INPUT_KEYS = ("inputs", "x", "images", "data")
TARGET_KEYS = ("targets", "target", "y", "labels")


def data_kind(obj: Any) -> str | None:
    """What ``obj`` (a loaded file) holds as data, in words, or None when it is not data.

    The one recognition rule of data files: ``as_batches`` reads exactly the objects
    this names, and ``checkpoint.load`` uses it to call a data file by its name.
    """
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


def as_batches(obj: Any, batch_size: int) -> list[Batch]:
    """The batches of an object ``data_kind`` recognises (a list of ready batches is not re-cut)."""
    if isinstance(obj, list):
        return [to_batch(b) for b in obj]
    if isinstance(obj, torch.Tensor):
        return _split(obj, None, batch_size)
    if isinstance(obj, tuple):
        return _split(obj[0], obj[1], batch_size)
    inputs, target = _first(obj, INPUT_KEYS), _first(obj, TARGET_KEYS)
    return _split(_decode(inputs, obj), target, batch_size)


def _count(tensor: torch.Tensor) -> int:
    return int(tensor.shape[0]) if tensor.dim() else 1


def _decode(inputs: torch.Tensor, obj: dict) -> torch.Tensor:
    """Compactly stored inputs: integer data with input_scale/input_offset, or half precision."""
    if "input_scale" in obj or "input_offset" in obj:
        scale = torch.as_tensor(obj.get("input_scale", 1.0), dtype=torch.float32)
        offset = torch.as_tensor(obj.get("input_offset", 0.0), dtype=torch.float32)
        return inputs.to(torch.float32) * scale + offset
    if inputs.dtype in (torch.float16, torch.bfloat16):
        return inputs.to(torch.float32)
    return inputs


def _first(obj: dict, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if key in obj:
            return obj[key]
    return None


def _split(inputs: torch.Tensor, target: Any, batch_size: int) -> list[Batch]:
    n = inputs.shape[0] if inputs.dim() else 1
    if target is not None and not isinstance(target, dict) and getattr(target, "shape", [n])[0] != n:
        raise QDebugError(f"data has {n} inputs but {target.shape[0]} targets", "inputs and targets must align")
    out = []
    for start in range(0, n, batch_size):
        sl = slice(start, start + batch_size)
        tgt = None
        if isinstance(target, dict):
            tgt = {k: v[sl] for k, v in target.items()}
        elif target is not None:
            tgt = target[sl]
        out.append(Batch(inputs[sl], tgt))
    return out


def to_batch(item: Any) -> Batch:
    """Recognise one batch: a Batch, a tensor, an (inputs, target) pair, or a dict of kwargs."""
    if isinstance(item, Batch):
        return item
    if isinstance(item, torch.Tensor) or isinstance(item, dict):
        return Batch(item)
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return Batch(item[0], item[1])
    if isinstance(item, (tuple, list)):
        return Batch(tuple(item))
    raise QDebugError(f"cannot use a {type(item).__name__} as a batch", "yield tensors or (inputs, target) pairs")


def _from_function(spec: str) -> list[Batch]:
    from qdebug.modelspec import resolve
    from qdebug.usercode import first_line, where_raised

    fn = resolve(spec, from_user=True)
    try:
        produced: Iterable = fn() if callable(fn) else fn
        return [to_batch(b) for b in produced]
    except QDebugError:
        raise
    except Exception as exc:
        where = where_raised(exc)
        raise QDebugError(f"data function {spec} raised {type(exc).__name__}: {first_line(exc)}"
                          + (f", at {where}" if where else ""),
                          "it is called with no arguments and returns an iterable of batches (tensors or "
                          "(inputs, target) pairs); --debug shows the traceback") from exc
