"""A ``.pt`` data file read lazily: its batches sliced from a memory map, a few at a time.

When the data is loaded the file is checked and mapped once (``qdebug.io.torchfile.read_file``
with ``mmap=True``: every check of a checkpoint, weights-only): what it holds
(``data_kind``, the one recognition rule of data files: the checkpoint
loader uses it too, to call a data file passed as a checkpoint by its name), its shapes and its number of batches are known then, and no
tensor data is read.  Each pass maps it again and makes its batches one by one: the slice
of the inputs (and targets), copied out of the map and decoded (``input_scale`` /
``input_offset``, half precision) -- the same values, bit for bit, as decoding the whole
file and slicing that.  The map is dropped after ``REMAP_BYTES`` of batches and made again
for the next ones: pages of a mapped file that were read count in the process's RSS until
the map goes, so a pass over a file of any size holds at most that much of it.

A legacy (non-zip) file cannot be mapped: it is read whole, once, and held.

The file must stay as it is while a command runs: one whose size, modification time or inode
changed between passes is an error, never a silent mix of two datasets.

What a file describes is bounded when it is opened, on shapes, before any batch is made (a
few KB may describe terabytes; docs/cli.md, "Data"): every tensor is dense and no larger
than what the file stores for it (``qdebug.io.torchfile.check_dense``: no expanded views); at
most ``limits.MAX_BATCHES`` batches are read; one batch may hold at most ``limits.batch_bytes_limit()``
bytes once decoded; and a list's batches together at most ``REUSE_FACTOR`` times the file's
size plus ``REUSE_SLACK`` (torch.save stores a tensor listed 20,000 times once).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from qdebug.data.batch import Batch, to_batch
# limits read at call time (module attributes): a test or a user may lower them
from qdebug.data import limits
from qdebug.data.source import Origin
from qdebug.errors import QDebugError, first_line
from qdebug.io.torchfile import check_dense, read_file

if TYPE_CHECKING:
    import torch

REMAP_BYTES = 32 << 20  # batches taken from one map of the file before it is mapped again
REUSE_FACTOR, REUSE_SLACK = 4, 256 << 20  # a list's batches hold at most 4 x its file's bytes + 256 MiB
LIST_HINT = ("a list's batches are each a tensor, an (inputs, target) pair or a dict of tensors (the model's "
             "kwargs); see docs/cli.md, \"Data\", for the data file formats")


class FileOrigin(Origin):
    """The batches of a data file (see module docstring): a dataset (a tensor, ``(X, y)`` or a
    dict) cut into ``batch_size`` samples, or a list of ready batches; at most ``limit``."""

    def __init__(self, path: Path, batch_size: int, limit: int | None):
        self.name, self._path, self._batch_size = str(path), path, batch_size
        obj = read_file(path, mmap=True)
        self._stamp = _stamp(path)
        if not isinstance(obj, list) and data_kind(obj) is None:  # a list's odd item is named by to_batch
            raise QDebugError(
                f"{path} holds {type(obj).__name__}, not data qdebug understands",
                "save a tensor, a tuple (inputs, targets), a dict {'inputs', 'targets'} or a list of batches",
            )
        if isinstance(obj, list):
            self.total = _checked_count(len(obj), limit, path, None)
            sizes = [_nbytes(_checked(to_batch(item, f"{path}: batch {index}", LIST_HINT), f"batch {index}", path))
                     for index, item in enumerate(obj[:self.total])]
            if sizes:
                biggest = max(range(len(sizes)), key=sizes.__getitem__)
                _check_batch_bytes(sizes[biggest], biggest, path, None)
            _check_reuse(sum(sizes), path)
        else:
            inputs, target, codes = _dataset(obj, self.name)
            self.total = _checked_count(-(-int(inputs.shape[0]) // batch_size), limit, path, batch_size)
            _check_batch_bytes(_first_batch_bytes(inputs, target, codes, batch_size), 0, path, batch_size)
        self._held = None if zipfile.is_zipfile(path) else obj  # a legacy file cannot be mapped: kept whole

    def items(self, rank: int, world: int) -> Iterator[tuple[int, Any]]:
        obj, taken = None, 0
        for index in range(rank, self.total, world):
            if obj is None:
                obj = self._open()
            batch = self._batch(obj, index)
            taken += _nbytes(batch)
            if taken >= REMAP_BYTES:  # drop the map before the batch is used: its pages leave RSS
                obj, taken = None, 0
            yield index, batch

    def _open(self) -> Any:
        if self._held is not None:
            return self._held

        if _stamp(self._path) != self._stamp:
            raise QDebugError(f"{self._path} changed while qdebug was reading it",
                              "qdebug reads the data several times: leave the file as it is until the command ends")
        return read_file(self._path, mmap=True)

    def _batch(self, obj: Any, index: int) -> Any:
        """Batch ``index``, copied out of the map (nothing of it stays mapped)."""

        if isinstance(obj, list):
            return _copied(to_batch(obj[index], f"{self._path}: batch {index}", LIST_HINT))
        inputs, target, codes = _dataset(obj, self.name)
        n = int(inputs.shape[0])
        rows = slice(index * self._batch_size, (index + 1) * self._batch_size)
        taken = inputs[rows]
        if codes:  # a per-sample scale or offset is sliced with the samples
            codes = {key: value[rows] if _per_sample(value, inputs, n) else value for key, value in codes.items()}
        decoded = _decode(taken, codes, self.name)
        if decoded is taken:
            decoded = taken.clone()
        if isinstance(target, dict):
            target = {task: value[rows].clone() for task, value in target.items()}
        elif target is not None:
            target = target[rows].clone()
        return Batch(decoded, target)


def _dataset(obj: Any, source: str) -> tuple[Any, Any, dict]:
    """(inputs, targets, {input_scale, input_offset} as stored) of a dataset object, checked as
    ``qdebug.data`` checks a dataset; reads no tensor data but the (small) scale and offset."""
    import torch


    if isinstance(obj, torch.Tensor):
        inputs, target, codes = obj, None, {}
    elif isinstance(obj, tuple):
        inputs, target, codes = obj[0], obj[1], {}
    else:
        inputs, target = _first(obj, INPUT_KEYS), _first(obj, TARGET_KEYS)
        codes = {key: obj[key] for key in ("input_scale", "input_offset") if key in obj}
    _check_dataset(inputs, target, source)
    for what, value in (("the input tensor", inputs), ("the target tensor", target), *codes.items()):
        _checked(value, what, source)
    if codes:
        _check_codes(inputs, codes, source)
    return inputs, target, codes


# -- limits: what a small file may describe ---------------------------------------------------
def _checked(obj: Any, where: str, source: Any) -> Any:
    """``obj`` with each of its tensors checked dense, no larger than what the file stores for
    it (``qdebug.io.torchfile.check_dense``: a 1 KB expanded view may describe 10**12 samples)."""
    import torch


    if isinstance(obj, torch.Tensor):
        check_dense(obj, where, source)
    elif isinstance(obj, (tuple, list)):
        names = getattr(obj, "_fields", None) and ("input", "target")  # a Batch
        for i, item in enumerate(obj):
            _checked(item, f"{where}'s {names[i]}" if names else f"{where}[{i}]", source)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _checked(value, f"{where}[{key!r}]", source)
    return obj


def _checked_count(count: int, limit: int | None, path: Path, batch_size: int | None) -> int:
    """The batches a pass reads (``count``, at most ``limit``), refused past ``limits.MAX_BATCHES``."""

    total = count if limit is None else min(limit, count)
    if total > limits.MAX_BATCHES:
        what = f"is cut into {count} batches of {batch_size}" if batch_size else f"lists {count} batches"
        raise QDebugError(f"{path} {what}; qdebug reads at most {limits.MAX_BATCHES} batches of a file",
                          f"pass --batches N to read the first N{' (or a larger --batch-size)' if batch_size else ''}")
    return total


def _check_reuse(described: int, path: Path) -> None:
    """A list's batches hold at most ``REUSE_FACTOR`` times the file's bytes, plus ``REUSE_SLACK``:
    torch.save stores a tensor listed many times once, so a small file may list one tensor
    20,000 times -- hours of work from a few KB.  Honest batches hold their own tensors (a
    small one shared by all, a mask or the targets, fits in the slack)."""

    stored = os.stat(path).st_size
    if described > REUSE_FACTOR * stored + REUSE_SLACK:
        raise QDebugError(f"{path}: its batches hold {limits.gib(described)} from {stored} bytes on disk: "
                          "it lists the same tensors again and again",
                          "save each batch's own tensors (or pass --batches N to read the first N)")


def _first_batch_bytes(inputs: Any, target: Any, codes: dict, batch_size: int) -> int:
    """Bytes of a dataset's biggest batch (its first), as decoded (float32 when it is decoded)."""
    import torch

    n = int(inputs.shape[0])
    rows = min(batch_size, n)
    decoded = 4 if codes or inputs.dtype in (torch.float16, torch.bfloat16) else inputs.element_size()
    size = rows * (inputs.numel() // max(n, 1)) * decoded
    for value in (target.values() if isinstance(target, dict) else [target] if target is not None else []):
        size += rows * (value.numel() // max(n, 1)) * value.element_size()
    return size


def _check_batch_bytes(size: int, index: int, path: Path, batch_size: int | None) -> None:
    """One batch is held in memory whole: past ``limits.batch_bytes_limit()`` it is refused, not allocated."""

    if size > limits.batch_bytes_limit():
        raise QDebugError(f"{path}: batch {index} is {limits.gib(size)}, "
                          f"over the {limits.gib(limits.batch_bytes_limit())} one batch may hold",
                          "use a smaller --batch-size" if batch_size else "save the data in smaller batches")


def _check_codes(inputs: Any, codes: dict, source: str) -> None:
    """``input_scale`` / ``input_offset`` must be numbers or tensors broadcasting to the inputs'
    shape: checked on shapes, before any batch is decoded."""
    import torch

    try:
        shapes = [torch.as_tensor(value, dtype=torch.float32).shape for value in codes.values()]
        shape = torch.broadcast_shapes(inputs.shape, *shapes)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise QDebugError(f"{source}: input_scale/input_offset cannot decode the inputs: {first_line(exc)}",
                          "store them as numbers, or tensors that broadcast to the inputs' shape") from None
    if shape != inputs.shape:
        raise QDebugError(f"{source}: input_scale/input_offset make inputs of shape {list(shape)} from inputs of "
                          f"shape {list(inputs.shape)}",
                          "store them as numbers, or tensors that broadcast to the inputs' shape")


def _per_sample(value: Any, inputs: Any, n: int) -> bool:
    """A scale or offset with one entry per sample (a first dimension of the samples' count)."""
    import torch

    return isinstance(value, torch.Tensor) and n > 1 and value.dim() == inputs.dim() and value.shape[0] == n


def _copied(obj: Any) -> Any:
    """``obj`` with every tensor copied (out of the map)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple (Batch)
        return type(obj)(*(_copied(x) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_copied(x) for x in obj)
    if isinstance(obj, dict):
        return {key: _copied(value) for key, value in obj.items()}
    return obj


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors in a batch."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(x) for x in obj.values())
    return 0


def _stamp(path: Path) -> tuple[int, int, int, int]:
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns, info.st_ino, info.st_dev


INPUT_KEYS = ("inputs", "x", "images", "data")


TARGET_KEYS = ("targets", "target", "y", "labels")


def data_kind(obj: Any) -> str | None:
    """What ``obj`` (a loaded file) holds as data, in words, or None when it is not data.

    The one recognition rule of data files: ``qdebug.data.file`` reads exactly the objects
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
