"""Where batches come from: ``random:`` specs, the user's function or iterable, a map-style DataLoader.

An origin's ``items(rank, world)`` is one pass over a shard (``qdebug.data.source.Origin``); a
``BatchSource`` runs it again for every pass.  A ``.pt`` file's origin is ``qdebug.data.file``'s.

The user's data must be the same on every pass: each batch of a data function gets an exact
fingerprint (``qdebug.data.batch.fingerprint``) the first time it is made, and a later pass
that makes another batch there, or another number of batches, is one error naming the batch.
A map-style ``torch.utils.data.DataLoader`` is read through its batch sampler's index lists,
taken once: every pass (and every shard) builds a loader over the same dataset with those
lists, so even ``shuffle=True`` gives the same batches, and a shard loads only its own samples.
The user's function is called once, here (``function_origin``); its iterable is read lazily,
and its code raising is one error naming it and the user's line (``user_data_errors``).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, ContextManager, Iterable, Iterator

from qdebug.data.batch import Batch, fingerprint, to_batch
# limits read at call time (module attributes): a test or a user may lower them
from qdebug.data import limits
from qdebug.data.source import Origin
from qdebug.errors import QDebugError, first_line


CONSISTENCY_HINT = ("qdebug reads the data several times, so it must come in the same order with the same "
                    "values on every pass: shuffle=False (a map-style DataLoader may shuffle: qdebug fixes its "
                    "order), fixed seeds, no random augmentation")


ONE_SHOT_HINT = ("qdebug reads the data several times: return a list or a DataLoader, or name a function that "
                 "makes the batches (package.module:function), which is called again for each pass")


class RandomOrigin(Origin):
    """``random:`` batches, made again from the seed on every pass (the same generator sequence,
    so the same values); a shard draws the other shards' batches too, and drops them."""

    def __init__(self, name: str, shape: list[int], seed: int, count: int):
        self.name, self._shape, self._seed, self.total = name, shape, seed, count

    def items(self, rank: int, world: int) -> Iterator[tuple[int, Any]]:
        import torch

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
        if self._limit is None and count > limits.MAX_BATCHES:
            raise QDebugError(f"{self.name} yields more than {limits.MAX_BATCHES} batches",
                              f"pass --batches N (N <= {limits.MAX_BATCHES}) to take the first N: an endless generator "
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
        self.name, self._loader, self._errors = name, loader, errors
        with errors():
            lists = [list(b) for b in itertools.islice(loader.batch_sampler, limit or limits.MAX_BATCHES + 1)]
        if limit is None and len(lists) > limits.MAX_BATCHES:
            raise QDebugError(f"{name} yields more than {limits.MAX_BATCHES} batches",
                              f"pass --batches N (N <= {limits.MAX_BATCHES}) to take the first N")
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


FUNCTION_HINT = ("it is called with no arguments and returns an iterable of batches (tensors or "
                 "(inputs, target) pairs); --debug shows the traceback")


def function_origin(spec: str, batches: int | None) -> Origin:
    """The origin of the user's function's batches: the function is called once, here; its
    iterable is read lazily, pass by pass (``qdebug.data.source.iterable_origin``): at most
    ``batches`` items are asked for, without ``batches`` at most ``limits.MAX_BATCHES``, so an endless
    generator ends in an error that asks for ``--batches``."""
    from qdebug.io.modelspec import resolve

    fn = resolve(spec, from_user=True, what="data function (package.module:function)")
    name = f"data function {spec}" if callable(fn) else f"data {spec}"
    with user_data_errors(spec):
        produced: Iterable = fn() if callable(fn) else fn
        return iterable_origin(produced, name=name, remake=fn if callable(fn) else None, limit=batches,
                               errors=lambda: user_data_errors(spec))


@contextlib.contextmanager
def user_data_errors(spec: str, what: str | None = None) -> Iterator[None]:
    """The data function raising (or calling ``sys.exit``), while called or iterated, as one
    error naming it (``what``: how, by default ``data function SPEC``) and the user's line."""
    from qdebug.io.usercode import exit_error, raised_by_user_code, where_raised

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
