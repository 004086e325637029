"""Where qdebug computes: the device a command or API call runs on, and moving data there.

``to_device(obj, device)`` moves every tensor of a batch (nested in tuples, lists, dicts and
``Batch``) to ``device``; other values pass through unchanged.
"""

from __future__ import annotations

from typing import Any


def to_device(obj: Any, device: Any) -> Any:
    """``obj`` with every tensor in it on ``device`` (None: unchanged)."""
    if device is None:
        return obj
    import torch

    if isinstance(obj, torch.Tensor):
        return obj if obj.device == torch.device(device) else obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple (Batch)
        return type(obj)(*(to_device(x, device) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj
