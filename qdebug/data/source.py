"""``BatchSource``: the batches of ``--data``, produced lazily, pass after pass.

A tool reads its data several times (step and suggest run many trials, calibrate runs
the data twice), so a ``BatchSource`` is re-iterable: every ``iter()`` is a fresh pass
that makes the batches anew, one at a time, and nothing is held between batches but
what the consumer keeps.  Peak memory is then flat in the size of the data.

- ``iter(source)``: one pass, yielding ``Batch``es (or, for a list a tool was handed,
  its items as they are);
- ``source.indexed()``: one pass, yielding ``(global_index, batch)``: the batch's place
  in the whole, unsharded data;
- ``source.shard(rank, world)``: the batches ``i`` with ``i % world == rank`` (a
  DistributedSampler-style strided split of batches, no padding); ``--batches`` was
  applied before, to the whole data;
- ``source.to(device)``: the batches moved to ``device`` as they are produced;
- ``source.count``: this shard's number of batches when known without a pass (a file,
  ``random:``, a list, a map-style DataLoader), else None until a pass has completed;
  ``len(source)`` raises TypeError while it is None, as for an iterator.

Where the batches come from is an *origin* (``Origin.items(rank, world)``: one pass over a
shard): ``HeldOrigin`` here (batches already in memory), the others in ``qdebug.data.origins``
(``random:``, the user's function, iterable or DataLoader) and ``qdebug.data.file`` (``.pt`` files).
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Sequence

from qdebug.data.batch import first_input_shape
from qdebug.errors import QDebugError


class BatchSource:
    """Re-iterable, lazy batches (module docstring).  Build one with ``load_batches``,
    ``batches_from_inputs``, ``batches_from_iterable`` or ``as_source``."""

    def __init__(self, origin: "Origin", *, rank: int = 0, world: int = 1, device: Any = None):
        self._origin = origin
        self._rank, self._world = rank, world
        self._device = device

    @classmethod
    def of(cls, items: Sequence[Any], name: str = "batches") -> "BatchSource":
        """A list already in memory, its items as they are (model inputs or ``Batch``es)."""
        return cls(HeldOrigin(list(items), name))

    # -- the passes ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        for _, batch in self.indexed():
            yield batch

    def indexed(self) -> Iterator[tuple[int, Any]]:
        """One pass: ``(global index, batch)``, the index counting every batch of the whole data."""
        for index, batch in self._origin.items(self._rank, self._world):
            if self._origin.input_shape is None:
                self._origin.input_shape = first_input_shape(batch)
                self._origin.has_targets = getattr(batch, "target", None) is not None
            if self._device is not None:
                from qdebug.config.device import to_device

                batch = to_device(batch, self._device)
            yield index, batch

    def __getitem__(self, position: int) -> Any:
        """The batch at ``position`` in this shard, found by a pass that stops there (for tests and
        small uses: a tool iterates)."""
        if not isinstance(position, int):
            raise TypeError(f"BatchSource indices must be integers, not {type(position).__name__}")
        if position < 0:
            position += len(self)
        if position >= 0:
            for batch in itertools.islice(self, position, None):
                return batch
        raise IndexError(f"batch {position} is past the end of {self.name}")

    # -- views --------------------------------------------------------------------------
    def shard(self, rank: int, world: int) -> "BatchSource":
        """The batches ``i`` with ``i % world == rank`` (of this source's batches, when it is a
        shard already); ``indexed()`` still gives their indices in the whole data."""
        if not (isinstance(world, int) and isinstance(rank, int) and world >= 1 and 0 <= rank < world):
            raise QDebugError(f"cannot take shard {rank} of {world}", "rank is 0 to world - 1, world >= 1")
        # Batch j of this shard is batch rank0 + world0 * j of the whole data: every world-th of
        # those from the rank-th on is every (world0 * world)-th of the whole.
        return BatchSource(self._origin, rank=self._rank + self._world * rank, world=self._world * world,
                           device=self._device)

    def to(self, device: Any) -> "BatchSource":
        """The same batches, moved to ``device`` (``qdebug.config.device.to_device``) as they are made."""
        return BatchSource(self._origin, rank=self._rank, world=self._world, device=device)

    # -- what is known ---------------------------------------------------------------------
    @property
    def count(self) -> int | None:
        """This shard's number of batches, or None while unknown (before a data function's first
        complete pass)."""
        total = self._origin.total
        return None if total is None else len(range(self._rank, total, self._world))

    def __len__(self) -> int:
        count = self.count
        if count is None:
            raise TypeError(f"the number of batches of {self.name} is not known before a pass over it")
        return count

    def __bool__(self) -> bool:
        return self.count != 0

    @property
    def name(self) -> str:
        return self._origin.name

    @property
    def input_shape(self) -> list[int] | None:
        """The shape of the first input tensor of the first batch a pass has made (for an error
        message about the model and its data), None before."""
        return self._origin.input_shape

    @property
    def has_targets(self) -> bool | None:
        """Whether the first batch a pass has made carries targets, None before (a next command's
        metric, without another pass over data that may differ on it)."""
        return self._origin.has_targets

    def __repr__(self) -> str:
        shard = f", shard {self._rank} of {self._world}" if self._world > 1 else ""
        device = f", on {self._device}" if self._device is not None else ""
        count = "? batches" if self.count is None else f"{self.count} batch(es)"
        return f"<BatchSource {self.name}: {count}{shard}{device}>"


# -- origins -------------------------------------------------------------------------------
class Origin:
    """Where a BatchSource's batches come from.  ``total``: batches in the whole data (after
    the --batches limit), None until known; ``items(rank, world)``: one pass over a shard."""

    name = "data"
    total: int | None = None
    input_shape: list[int] | None = None  # see BatchSource.input_shape
    has_targets: bool | None = None  # see BatchSource.has_targets

    def items(self, rank: int, world: int) -> Iterator[tuple[int, Any]]:
        raise NotImplementedError


class HeldOrigin(Origin):
    """Batches already in memory (a list handed to a tool, a checkpoint's sample inputs)."""

    def __init__(self, items: list, name: str):
        self._items, self.name, self.total = items, name, len(items)

    def items(self, rank: int, world: int) -> Iterator[tuple[int, Any]]:
        for index in range(rank, self.total, world):
            yield index, self._items[index]


