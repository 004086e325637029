"""Data-parallel runs: ranks under ``torchrun``, each on its shard of the batches, combined exactly.

qdebug's statistics are sums, counts, minima, maxima and histograms, so a run over
many batches splits into runs over shards whose results combine exactly.  Under
``torchrun`` (its ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` environment), every rank
runs the same command:

- **the split** (``shard``): batch ``i`` of the data belongs to rank ``i % world``,
  the strided split of ``DistributedSampler`` applied to batches, without padding
  (a padded batch would be counted twice).  ``--batches N`` limits the whole data,
  before the split;
- **the combination** (``Group.combine``): each rank packs its state (plain values and
  tensors) and every rank receives every rank's state (``all_gather`` over a gloo
  group), then merges them in rank order with the tool's own merge.  Every rank so
  holds bit-identical results, whatever the backend's reduction order, and steers
  the next step (suggest's search, calibrate's frozen scales) the same way.  Per
  batch results (per-sample scores, stored outputs) carry their batch index and are
  put back in data order, so a bootstrap sees the samples as one process would;
- **failures** (``Group.fail``): every exchange starts with a status round; a rank
  that fails says so in the next round, and every rank then raises the same
  ``QDebugError`` (``rank R: <message>``), lowest failing rank first.  A rank that
  dies or hangs makes the others' exchange time out (``QDEBUG_DIST_TIMEOUT``
  seconds; default 1800), also one clean error.

Outside ``torchrun`` (``WORLD_SIZE`` unset or 1) ``current()`` is a one-rank group
whose exchanges return the state as it is: the single-process path is the same code.
The transport is JSON for the structure and raw bytes for the tensors -- nothing
from another rank is unpickled.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, TypeVar

from qdebug.errors import QDebugError, shown

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 1800.0
TIMEOUT_ENV = "QDEBUG_DIST_TIMEOUT"
DOCS = "see docs/scale.md"


def environment() -> tuple[int, int]:
    """(rank, world) that torchrun gives this process, (0, 1) outside it; read without torch."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        raise QDebugError(f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} are not "
                          "whole numbers", "start ranks with torchrun, which sets them") from None
    if world < 1 or not 0 <= rank < world:
        raise QDebugError(f"RANK={rank} is outside WORLD_SIZE={world}", "start ranks with torchrun, which sets them")
    return rank, world


def is_rank_zero() -> bool:
    """Whether this process writes outputs (every process outside torchrun)."""
    return environment()[0] == 0


def timeout_seconds(configured: Any = None) -> float:
    """The exchange timeout: ``QDEBUG_DIST_TIMEOUT``, else ``configured``, else 1800 s."""
    text = os.environ.get(TIMEOUT_ENV)
    value: Any = text if text is not None else configured
    if value is None:
        return DEFAULT_TIMEOUT_S
    where = f"{TIMEOUT_ENV}={shown(text)}" if text is not None else f"timeout {shown(configured)}"
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        raise QDebugError(f"{where} is not a number of seconds", "e.g. QDEBUG_DIST_TIMEOUT=600") from None
    # NaN fails the comparison; inf and the absurd are refused too: timedelta overflows past ~10^14 s.
    if not 0 < seconds < 10**7 or isinstance(value, bool):
        raise QDebugError(f"{where} must be a number of seconds, more than 0 and less than 10^7",
                          "e.g. QDEBUG_DIST_TIMEOUT=600")
    return seconds


class PeerFailure(QDebugError):
    """Another rank (or this one) failed: the same error on every rank."""

    shared = False  # True when every rank raised it at the same status round: rank 0 alone says it


@dataclass
class Group:
    """This process's place in a data-parallel run: ``rank`` of ``world``."""

    rank: int = 0
    world: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    handle: Any = None  # the torch.distributed process group of the exchanges (gloo)
    broken: bool = False  # an exchange timed out or lost a rank: the ranks are out of step for good

    @property
    def active(self) -> bool:
        return self.world > 1

    # -- the split --------------------------------------------------------------------
    def shard(self, batches: Iterable[T]) -> Iterator[tuple[int, T]]:
        """This rank's ``(index, batch)`` pairs: batches ``i`` with ``i % world == rank``.

        A source with ``indexed()``/``shard()`` (``qdebug.data.BatchSource``) is split
        without producing the other ranks' batches; any other iterable is enumerated.
        """
        if self.active and hasattr(batches, "shard"):
            return batches.shard(self.rank, self.world).indexed()
        if hasattr(batches, "indexed"):
            return batches.indexed()
        pairs = enumerate(batches)
        if not self.active:
            return pairs
        return ((i, b) for i, b in pairs if i % self.world == self.rank)

    # -- the exchanges ----------------------------------------------------------------
    def gather(self, state: Any) -> list[Any]:
        """Every rank's ``state`` in rank order (``[state]`` for one rank).  ``state`` is made
        of None, bools, ints, floats, strings, tensors, and lists, tuples, sets and dicts of them."""
        if not self.active:
            return [state]
        try:
            payload = pack(state)
        except TypeError as exc:  # a model output qdebug cannot carry (a custom class)
            raise QDebugError(f"cannot send this rank's results to the others: {exc}",
                              "model outputs must be tensors, or tuples, lists and dicts of them") from None
        self._status(ok=True)
        return [unpack(part) for part in self._exchange(payload)]

    def combine(self, state: T, merge: Callable[[T, T], T]) -> T:
        """Every rank's ``state`` merged in rank order: ``merge(merge(s0, s1), s2)...``; the
        same result on every rank.  One rank: ``state`` itself, untouched."""
        if not self.active:
            return state
        parts = self.gather(state)
        merged = parts[0]
        for part in parts[1:]:
            merged = merge(merged, part)
        return merged

    def check(self) -> None:
        """A status round alone: raises the failure of any rank (every command ends with one)."""
        if self.active and not self.broken:
            self._status(ok=True)

    def fail(self, error: QDebugError) -> PeerFailure:
        """Tell the other ranks this rank failed; the error every rank raises (the lowest
        failing rank's).  After a failure was exchanged, ``error`` as it is."""
        if not self.active or self.broken or isinstance(error, PeerFailure):
            return error if isinstance(error, PeerFailure) else PeerFailure(error.message, error.hint)
        try:
            self._status(ok=False, error=error)
        except PeerFailure as exc:
            return exc
        raise AssertionError("a failed status round returned")  # pragma: no cover - _status raises

    def _status(self, *, ok: bool, error: QDebugError | None = None) -> None:
        """One round of who failed; on any failure every rank raises the same PeerFailure."""
        import torch

        flags = self._all_gather_fixed(torch.tensor([0 if ok else 1], dtype=torch.int64))
        failing = [r for r, flag in enumerate(flags) if int(flag[0])]
        if not failing:
            return
        # Every rank raises at this same round, so the ranks stay in step (a later command
        # in the same processes can exchange again).
        message = pack({"message": error.message, "hint": error.hint} if error is not None else None)
        reports = [unpack(part) for part in self._exchange(message)]
        first = failing[0]
        report = reports[first] or {"message": "failed", "hint": ""}
        failure = PeerFailure(f"rank {first}: {report['message']}", report.get("hint") or "")
        failure.shared = True
        raise failure

    def _exchange(self, payload: bytes) -> list[bytes]:
        """Every rank's bytes (lengths first, then the padded bytes)."""
        import torch

        sizes = self._all_gather_fixed(torch.tensor([len(payload)], dtype=torch.int64))
        longest = max(int(s[0]) for s in sizes)
        buffer = torch.zeros(longest, dtype=torch.uint8)
        if payload:
            buffer[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        parts = self._all_gather_fixed(buffer)
        return [bytes(part[:int(size[0])].numpy().tobytes()) for part, size in zip(parts, sizes)]

    def _all_gather_fixed(self, tensor: "torch.Tensor") -> list["torch.Tensor"]:
        import torch
        import torch.distributed as dist

        out = [torch.empty_like(tensor) for _ in range(self.world)]
        try:
            dist.all_gather(out, tensor, group=self.handle)
        except RuntimeError as exc:  # gloo: a timeout, a closed connection (a rank died)
            self.broken = True
            first = str(exc).splitlines()[0][:200]
            raise PeerFailure(f"rank {self.rank}: the other ranks did not answer within {self.timeout_s:g} s "
                              f"(a rank died, hangs, or is far slower): {first}",
                              f"raise {TIMEOUT_ENV} (seconds) if the ranks are only slow; {DOCS}") from None
        return out


_GROUP: Group | None = None


def current(configured_timeout: Any = None) -> Group:
    """This process's group: a one-rank group outside torchrun; under torchrun, the job's
    ranks, joined on first use (``env://`` rendezvous, gloo, the timeout of ``timeout_seconds``).
    Where the program has initialised torch.distributed itself, its ranks are used."""
    global _GROUP
    if _GROUP is not None:
        return _GROUP
    rank, world = environment()
    if world == 1:
        import sys

        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return Group()  # not remembered: a process group may be set up later
    _GROUP = _join(configured_timeout)
    return _GROUP


def _join(configured_timeout: Any) -> Group:
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timeout_seconds(configured_timeout)
    if not dist.is_available():
        raise QDebugError("this torch has no torch.distributed, so it cannot run under torchrun",
                          "run qdebug as one process, or install a torch build with distributed support")
    if not dist.is_initialized():
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if key not in os.environ:
                raise QDebugError(f"WORLD_SIZE is set but {key} is not", f"start ranks with torchrun; {DOCS}")
        try:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
            # Torn down before the interpreter ends: gloo's threads otherwise abort the process
            # ("terminate called without an active exception") after the command succeeded.
            import atexit

            atexit.register(_leave)
        except (RuntimeError, ValueError) as exc:
            first = str(exc).splitlines()[0][:200]
            raise QDebugError(f"cannot join the other ranks: {first}",
                              f"check MASTER_ADDR/MASTER_PORT and that every rank started; {DOCS}") from None
        handle = None
    else:  # the program's own group: exchanges need gloo (CPU tensors), whatever its backend
        handle = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo",
                                                                         timeout=timedelta(seconds=timeout))
    return Group(dist.get_rank(), dist.get_world_size(), timeout, handle)


def _leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):  # a broken group: the process ends anyway
            pass


def finish(error: QDebugError | None = None) -> QDebugError | None:
    """The end of a command under torchrun: one last status round, so a failure of any rank
    (rank 0's writing included) is every rank's.  Returns the error to report, or None."""
    try:
        alone = environment()[1] == 1
    except QDebugError:  # a malformed torchrun environment: that is the error to report
        return error
    if alone and _GROUP is None:
        return error
    try:
        group = current()
    except QDebugError as exc:  # this rank could not join (a bad QDEBUG_DIST_TIMEOUT, no MASTER_ADDR): no round
        return error or exc
    if error is not None:
        return group.fail(error)
    try:
        group.check()
    except PeerFailure as exc:
        return exc
    return None


def reset() -> None:
    """Forget the group (tests; the process group itself is torch's to destroy)."""
    global _GROUP
    _GROUP = None


# -- the transport: JSON for the structure, raw bytes for the tensors --------------------
_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")


def pack(state: Any) -> bytes:
    """``state`` as bytes: a length, the JSON structure, then every tensor's bytes."""
    tensors: list[Any] = []
    structure = json.dumps(_encode(state, tensors), allow_nan=False).encode()
    blobs = [t.detach().cpu().contiguous().view(-1).view(_byte_dtype()).numpy().tobytes() for t in tensors]
    return struct.pack("<Q", len(structure)) + structure + b"".join(blobs)


def unpack(payload: bytes) -> Any:
    (length,) = struct.unpack_from("<Q", payload)
    structure = json.loads(payload[8:8 + length].decode())
    return _decode(structure, memoryview(payload)[8 + length:], [0])


def _byte_dtype():
    import torch

    return torch.uint8


def _encode(obj: Any, tensors: list) -> Any:
    import torch

    if obj is None or isinstance(obj, (bool, str)) or (isinstance(obj, int) and abs(obj) < 2**53):
        return obj
    if isinstance(obj, int):
        return {"i": str(obj)}
    if isinstance(obj, float):
        return {"f": obj.hex()}  # exact, and inf/nan included
    if isinstance(obj, torch.Tensor):
        name = str(obj.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise TypeError(f"cannot exchange a {obj.dtype} tensor")
        tensors.append(obj)
        return {"t": [name, list(obj.shape), obj.numel() * obj.element_size()]}
    if isinstance(obj, (list, tuple, set, frozenset)):
        kind = "u" if isinstance(obj, tuple) else "s" if isinstance(obj, (set, frozenset)) else "l"
        items = sorted(obj, key=repr) if kind == "s" else obj
        return {kind: [_encode(x, tensors) for x in items]}
    if isinstance(obj, dict):
        return {"d": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    raise TypeError(f"cannot exchange a {type(obj).__name__}")


def _decode(obj: Any, blob: memoryview, at: list[int]) -> Any:
    import torch

    if not isinstance(obj, dict):
        return obj
    (kind, value), = obj.items()
    if kind == "i":
        return int(value)
    if kind == "f":
        return float.fromhex(value)
    if kind == "t":
        name, shape, nbytes = value
        if name not in _DTYPES:
            raise QDebugError(f"another rank sent a {name!r} tensor", DOCS)
        raw = bytearray(blob[at[0]:at[0] + nbytes])
        at[0] += nbytes
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(getattr(torch, name)).reshape(shape)
    if kind in ("l", "u", "s"):
        items = [_decode(x, blob, at) for x in value]
        return items if kind == "l" else tuple(items) if kind == "u" else set(items)
    if kind == "d":
        return {_hashable(_decode(k, blob, at)): _decode(v, blob, at) for k, v in value}
    raise QDebugError(f"another rank sent an unknown value kind {kind!r}", DOCS)


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


# -- merges shared by the tools ----------------------------------------------------------
def merge_indexed(a: dict[int, T], b: dict[int, T]) -> dict[int, T]:
    """Two ranks' per-batch values (batch index -> value) as one, in data order."""
    return dict(sorted({**a, **b}.items()))
