"""The user's data, one way: a spec -> an origin -> a ``BatchSource`` -> ``Batch``es; and metrics.

- ``spec``: what the user gave (``--data`` spec, a list, a DataLoader) -> a ``BatchSource``
  (``load_batches``, ``batches_from_iterable``, ``as_source``);
- ``origins``: where batches come from: ``random:``, the user's function or iterable, a
  map-style DataLoader; ``file``: a ``.pt`` data file, read lazily from a memory map;
- ``source``: ``BatchSource``, re-iterable and lazy, sharded, moved to a device;
- ``batch``: one ``Batch`` (``inputs, target``), how an item is recognised as one, its fingerprint;
- ``limits``: how much data qdebug makes or reads;
- ``metrics``: ``metric(model, batches)``, the built-in ones and the user's.

Each module imports only those listed after it (metrics aside, which reads batches).
"""

from qdebug.data.batch import Batch
from qdebug.data.source import BatchSource
from qdebug.data.spec import as_source, batches_from_iterable, load_batches

__all__ = ["Batch", "BatchSource", "load_batches", "batches_from_iterable", "as_source"]
