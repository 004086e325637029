"""One batch: ``Batch`` (``inputs, target``), how an item is recognised as one, and its fingerprint.

Every batch a tool sees is a ``Batch``: a named tuple ``(inputs, target)``, so a metric written
the usual PyTorch way (``for x, y in loader``) works on it unchanged, and ``batch.inputs`` /
``batch.target`` name the same two fields.  ``to_batch`` recognises what a data function, a
DataLoader or a data file yields (a tensor, an ``(inputs, target)`` pair, a dict of model
kwargs); ``fingerprint`` is a batch's exact identity, by which a later pass over the user's data
is checked to make the same batches.

torch loads on first use, not on import.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

from qdebug.errors import QDebugError, shown


def first_input_shape(batch: Any) -> list[int] | None:
    """The shape of a batch's input tensor (its first argument's when the inputs are a tuple)."""
    import torch

    inputs = getattr(batch, "inputs", batch)
    first = inputs[0] if isinstance(inputs, (tuple, list)) and inputs else inputs
    return list(first.shape) if isinstance(first, torch.Tensor) else None


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
