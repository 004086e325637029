"""A ``.pt`` data file read lazily: its batches sliced from a memory map, a few at a time.

When the data is loaded the file is checked and mapped once (``qdebug.torchfile.read_file``
with ``mmap=True``: every check of a checkpoint, weights-only): what it holds
(``qdebug.data.data_kind``), its shapes and its number of batches are known then, and no
tensor data is read.  Each pass maps it again and makes its batches one by one: the slice
of the inputs (and targets), copied out of the map and decoded (``input_scale`` /
``input_offset``, half precision) -- the same values, bit for bit, as decoding the whole
file and slicing that.  The map is dropped after ``REMAP_BYTES`` of batches and made again
for the next ones: pages of a mapped file that were read count in the process's RSS until
the map goes, so a pass over a file of any size holds at most that much of it.

A legacy (non-zip) file cannot be mapped: it is read whole, once, and held.

The file must stay as it is while a command runs: one whose size, modification time or inode
changed between passes is an error, never a silent mix of two datasets.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any, Iterator

from qdebug.batch_source import Origin
from qdebug.errors import QDebugError

REMAP_BYTES = 32 << 20  # batches taken from one map of the file before it is mapped again


class FileOrigin(Origin):
    """The batches of a data file (see module docstring): a dataset (a tensor, ``(X, y)`` or a
    dict) cut into ``batch_size`` samples, or a list of ready batches; at most ``limit``."""

    def __init__(self, path: Path, batch_size: int, limit: int | None):
        from qdebug.data import data_kind, to_batch
        from qdebug.torchfile import read_file

        self.name, self._path, self._batch_size = str(path), path, batch_size
        obj = read_file(path, mmap=True)
        self._stamp = _stamp(path)
        if not isinstance(obj, list) and data_kind(obj) is None:  # a list's odd item is named by to_batch
            raise QDebugError(
                f"{path} holds {type(obj).__name__}, not data qdebug understands",
                "save a tensor, a tuple (inputs, targets), a dict {'inputs', 'targets'} or a list of batches",
            )
        if isinstance(obj, list):
            for item in obj:
                to_batch(item)
            count = len(obj)
        else:
            inputs = _dataset(obj, self.name)[0]
            count = -(-int(inputs.shape[0]) // batch_size)
        self.total = count if limit is None else min(limit, count)
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
        from qdebug.torchfile import read_file

        if _stamp(self._path) != self._stamp:
            raise QDebugError(f"{self._path} changed while qdebug was reading it",
                              "qdebug reads the data several times: leave the file as it is until the command ends")
        return read_file(self._path, mmap=True)

    def _batch(self, obj: Any, index: int) -> Any:
        """Batch ``index``, copied out of the map (nothing of it stays mapped)."""
        from qdebug.data import Batch, _decode, to_batch

        if isinstance(obj, list):
            return _copied(to_batch(obj[index]))
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

    from qdebug.data import INPUT_KEYS, TARGET_KEYS, _check_dataset, _first

    if isinstance(obj, torch.Tensor):
        inputs, target, codes = obj, None, {}
    elif isinstance(obj, tuple):
        inputs, target, codes = obj[0], obj[1], {}
    else:
        inputs, target = _first(obj, INPUT_KEYS), _first(obj, TARGET_KEYS)
        codes = {key: obj[key] for key in ("input_scale", "input_offset") if key in obj}
    _check_dataset(inputs, target, source)
    if codes:
        _check_codes(inputs, codes, source)
    return inputs, target, codes


def _check_codes(inputs: Any, codes: dict, source: str) -> None:
    """``input_scale`` / ``input_offset`` must be numbers or tensors broadcasting to the inputs'
    shape: checked on shapes, before any batch is decoded."""
    import torch

    try:
        shapes = [torch.as_tensor(value, dtype=torch.float32).shape for value in codes.values()]
        shape = torch.broadcast_shapes(inputs.shape, *shapes)
    except (TypeError, ValueError, RuntimeError) as exc:
        from qdebug.usercode import first_line

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
