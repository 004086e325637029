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

Where the batches come from is an *origin* (``items(rank, world)``: one pass over a
shard).  This module holds the origins of data already in memory (a list), of
``random:`` specs and of the user's iterables (a data function's result: a list, a
DataLoader, a generator); ``qdebug.data_file`` holds the one of ``.pt`` files.

The user's data must be the same on every pass: each batch of a data function gets an
exact fingerprint (blake2b of its tensors' bytes, on the CPU) the first time it is made,
and a later pass that makes another batch there, or another number of batches, is one
error naming the batch.  A map-style ``torch.utils.data.DataLoader`` is read through its
batch sampler's index lists, taken once: every pass (and every shard) builds a loader
over the same dataset with those lists, so even ``shuffle=True`` gives the same batches,
and a shard loads only its own samples.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from typing import Any, Callable, ContextManager, Iterator, Sequence

from qdebug.errors import QDebugError

CONSISTENCY_HINT = ("qdebug reads the data several times, so it must come in the same order with the same "
                    "values on every pass: shuffle=False (a map-style DataLoader may shuffle: qdebug fixes its "
                    "order), fixed seeds, no random augmentation")
ONE_SHOT_HINT = ("qdebug reads the data several times: return a list or a DataLoader, or name a function that "
                 "makes the batches (package.module:function), which is called again for each pass")


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
                from qdebug.device import to_device

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
        """The same batches, moved to ``device`` (``qdebug.device.to_device``) as they are made."""
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


def as_source(batches: Any, name: str = "batches") -> BatchSource:
    """What a tool was handed as a ``BatchSource``: itself, a list or tuple (items kept as they
    are: model inputs or ``Batch``es), or another iterable of batches (a DataLoader, a generator:
    read as a data function's result is)."""
    if isinstance(batches, BatchSource):
        return batches
    if isinstance(batches, (list, tuple)):
        return BatchSource.of(batches, name)
    return BatchSource(iterable_origin(batches, name=name))


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


class RandomOrigin(Origin):
    """``random:`` batches, made again from the seed on every pass (the same generator sequence,
    so the same values); a shard draws the other shards' batches too, and drops them."""

    def __init__(self, name: str, shape: list[int], seed: int, count: int):
        self.name, self._shape, self._seed, self.total = name, shape, seed, count

    def items(self, rank: int, world: int) -> Iterator[tuple[int, Any]]:
        import torch

        from qdebug.data import Batch

        generator = torch.Generator().manual_seed(self._seed)
        for index in range(self.total):
            inputs = torch.randn(*self._shape, generator=generator)
            if index % world == rank:
                yield index, Batch(inputs)


UserErrors = Callable[[], ContextManager[None]]  # turns the user's code raising into one QDebugError


def iterable_origin(produced: Any, *, name: str, remake: Callable[[], Any] | None = None,
                    limit: int | None = None, errors: UserErrors | None = None) -> Origin:
    """The origin of the user's iterable ``produced`` (a data function's result, or data handed
    to the API).  ``remake``: makes it again (the data function), for another pass over a
    one-shot iterator; ``limit``: --batches; ``errors``: the user's code raising, named."""
    import collections.abc

    errors = errors or contextlib.nullcontext
    if _is_map_loader(produced):
        return LoaderOrigin(produced, name=name, limit=limit, errors=errors)
    if isinstance(produced, collections.abc.Iterator):
        return IterableOrigin(produced, name=name, one_shot=True, remake=remake, limit=limit, errors=errors)
    if not (isinstance(produced, collections.abc.Iterable) or hasattr(type(produced), "__getitem__")):
        from qdebug.data import FUNCTION_HINT

        raise QDebugError(f"{name} {'returned' if remake else 'is'} {type(produced).__name__}, not an iterable "
                          "of batches", FUNCTION_HINT)
    return IterableOrigin(produced, name=name, one_shot=False, remake=remake, limit=limit, errors=errors)


class _Consistency:
    """The batches of the user's data, checked to be the same on every pass: a fingerprint per
    batch index, and the number of batches once a pass has counted them."""

    def __init__(self, name: str, check: bool):
        self.name, self.check = name, check
        self.prints: dict[int, bytes] = {}
        self.total: int | None = None

    def batch(self, index: int, batch: Any) -> None:
        if not self.check:
            return
        found = fingerprint(batch)
        seen = self.prints.setdefault(index, found)
        if seen != found:
            raise QDebugError(f"{self.name} gave a different batch {index} on a later pass", CONSISTENCY_HINT)

    def completed(self, count: int) -> None:
        """A pass ended after ``count`` batches (the --batches limit applied)."""
        if count == 0:
            raise QDebugError(f"{self.name} holds no batches", "check the data file or function: it yielded nothing")
        if self.total is None:
            self.total = count
        elif count != self.total:
            raise QDebugError(f"{self.name} gave {count} batch(es) on a later pass, {self.total} on the first",
                              CONSISTENCY_HINT)


class IterableOrigin(Origin):
    """The user's iterable, read item by item: a re-iterable one (a list, an iterable-style
    DataLoader, ``iter(x) is not x``) is iterated again on each pass; a one-shot iterator (a
    generator) serves the first pass, and ``remake`` (the data function, called again) the
    others.  A shard skips the other shards' items."""

    def __init__(self, produced: Any, *, name: str, one_shot: bool, remake: Callable[[], Any] | None,
                 limit: int | None, errors: UserErrors):
        self.name, self._limit, self._errors = name, limit, errors
        self._one_shot, self._remake = one_shot, remake
        self._unused: Any = produced if one_shot else None  # the first pass's iterator, until taken
        self._produced = None if one_shot else produced
        # A list cannot change between passes, and says its length: neither check nor pass is needed.
        fixed = isinstance(produced, (list, tuple))
        self._seen = _Consistency(name, check=not fixed)
        if fixed:
            self._check_max(len(produced))
            self._seen.total = len(produced) if limit is None else min(limit, len(produced))

    @property
    def total(self) -> int | None:  # type: ignore[override]
        return self._seen.total

    def _check_max(self, count: int) -> None:
        from qdebug.data import MAX_BATCHES

        if self._limit is None and count > MAX_BATCHES:
            raise QDebugError(f"{self.name} yields more than {MAX_BATCHES} batches",
                              f"pass --batches N (N <= {MAX_BATCHES}) to take the first N: an endless generator "
                              "needs it")

    def _stream(self) -> Iterator[Any]:
        if not self._one_shot:
            with self._errors():
                return iter(self._produced)
        if self._unused is not None:
            stream, self._unused = self._unused, None
            return stream
        if self._remake is None:
            raise QDebugError(f"{self.name} is a one-shot iterator, and this command reads the data more than once",
                              ONE_SHOT_HINT)
        with self._errors():
            produced = self._remake()
            if not hasattr(produced, "__next__"):
                produced = iter(produced)
        return produced

    def items(self, rank: int, world: int) -> Iterator[tuple[int, Any]]:
        from qdebug.data import to_batch

        stream = self._stream()
        index = 0
        while self._limit is None or index < self._limit:
            with self._errors():
                item = next(stream, _END)
            if item is _END:
                break
            self._check_max(index + 1)
            if index % world == rank:
                batch = to_batch(item, f"{self.name}: batch {index}")
                self._seen.batch(index, batch)
                yield index, batch
            index += 1
        self._seen.completed(index)


class LoaderOrigin(Origin):
    """A map-style ``DataLoader``: its batch sampler's index lists are taken once (cut to
    --batches); each shard reads its own lists through a loader built like the user's (same
    dataset, collate_fn, workers, pinning, worker_init_fn, generator...), so every pass gives
    the same batches, shuffled or not, and a shard loads only its own samples."""

    def __init__(self, loader: Any, *, name: str, limit: int | None, errors: UserErrors):
        from qdebug.data import MAX_BATCHES

        self.name, self._loader, self._errors = name, loader, errors
        with errors():
            lists = [list(b) for b in itertools.islice(loader.batch_sampler, limit or MAX_BATCHES + 1)]
        if limit is None and len(lists) > MAX_BATCHES:
            raise QDebugError(f"{name} yields more than {MAX_BATCHES} batches",
                              f"pass --batches N (N <= {MAX_BATCHES}) to take the first N")
        self._lists = lists
        self._seen = _Consistency(name, check=True)
        self._seen.total = len(lists)
        self._shards: dict[tuple[int, int], Any] = {}  # (rank, world) -> its loader, kept for persistent workers

    @property
    def total(self) -> int | None:  # type: ignore[override]
        return self._seen.total

    def _shard_loader(self, rank: int, world: int) -> Any:
        loader = self._shards.get((rank, world))
        if loader is None:
            from torch.utils.data import DataLoader

            user = self._loader
            workers = user.num_workers
            options = {"num_workers": workers, "collate_fn": user.collate_fn, "pin_memory": user.pin_memory,
                       "timeout": user.timeout, "worker_init_fn": user.worker_init_fn,
                       "multiprocessing_context": user.multiprocessing_context, "generator": user.generator,
                       "pin_memory_device": getattr(user, "pin_memory_device", "")}
            if workers:  # torch refuses these without workers
                options.update(prefetch_factor=user.prefetch_factor, persistent_workers=user.persistent_workers)
            if hasattr(user, "in_order"):
                options["in_order"] = user.in_order
            with self._errors():
                loader = DataLoader(user.dataset, batch_sampler=self._lists[rank::world], **options)
            self._shards[(rank, world)] = loader
        return loader

    def items(self, rank: int, world: int) -> Iterator[tuple[int, Any]]:
        from qdebug.data import to_batch

        indices = range(rank, len(self._lists), world)
        if not indices:
            return
        with self._errors():
            stream = iter(self._shard_loader(rank, world))
        for index in indices:
            with self._errors():
                item = next(stream, _END)
            if item is _END:  # a batch sampler list the dataset could not fill: cannot happen for a Map dataset
                raise QDebugError(f"{self.name} gave fewer batches than its batch sampler lists", CONSISTENCY_HINT)
            batch = to_batch(item, f"{self.name}: batch {index}")
            self._seen.batch(index, batch)
            yield index, batch


def _is_map_loader(obj: Any) -> bool:
    """A ``DataLoader`` over a map-style dataset, batched by a batch sampler."""
    import sys

    if "torch" not in sys.modules:
        return False
    from torch.utils.data import DataLoader, IterableDataset

    return (isinstance(obj, DataLoader) and obj.batch_sampler is not None
            and not isinstance(obj.dataset, IterableDataset) and hasattr(obj.dataset, "__getitem__"))


_END = object()


def first_input_shape(batch: Any) -> list[int] | None:
    """The shape of a batch's input tensor (its first argument's when the inputs are a tuple)."""
    import torch

    inputs = getattr(batch, "inputs", batch)
    first = inputs[0] if isinstance(inputs, (tuple, list)) and inputs else inputs
    return list(first.shape) if isinstance(first, torch.Tensor) else None


# -- fingerprints ----------------------------------------------------------------------------
def fingerprint(obj: Any) -> bytes:
    """An exact fingerprint of a batch (or of any nest of tuples, lists, dicts and tensors): its
    structure, and each tensor's dtype, shape and bytes (copied to the CPU when elsewhere)."""
    digest = hashlib.blake2b(digest_size=16)
    _feed(digest, obj)
    return digest.digest()


def _feed(digest: Any, obj: Any) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.layout != torch.strided:
            t = t.to_dense()
        t = t.cpu().resolve_conj().resolve_neg().contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(obj, (tuple, list)):
        digest.update(f"({len(obj)}".encode())
        for item in obj:
            _feed(digest, item)
    elif isinstance(obj, dict):
        digest.update(f"{{{len(obj)}".encode())
        for key, value in obj.items():
            digest.update(repr(key).encode())
            _feed(digest, value)
    elif isinstance(obj, (str, bytes, int, float, complex, type(None))):
        digest.update(repr(obj).encode())
    else:  # another object: its repr may hold its address, different on every pass
        digest.update(type(obj).__qualname__.encode())
