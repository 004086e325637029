"""Run the batches through a float model in eval with forward hooks on some of its modules: how
the fixes measure what they need on the data (ReLU6 peaks, pre-activation minima, a norm's
channel ranges).  The hooks are removed and the model's mode restored whatever happens."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn as nn


def run_hooked(model: nn.Module, batches: Iterable[Any], hooks: Iterable[tuple[nn.Module, Callable]], *,
               with_kwargs: bool = False) -> None:
    """Each batch (a ``Batch`` or model inputs) through ``model`` in eval, with ``hook`` registered
    as a forward hook on each ``(module, hook)`` (``with_kwargs``: torch's hook with the call's
    kwargs) for the duration."""
    from qdebug.engine.context import run_model

    handles = [module.register_forward_hook(hook, with_kwargs=with_kwargs) for module, hook in hooks]
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            run_model(model, getattr(batch, "inputs", batch))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()


def channel_extrema(model: nn.Module, modules: dict[str, nn.Module], axes: dict[str, int],
                     batches: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module path -> (per-channel minimum, per-channel maximum) of its output over ``batches``
    (float64; channels along ``axes[path]``), run through ``model`` in eval; a module that never
    ran on them is absent."""
    extrema: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(path: str, axis: int):
        def hook(module, args, output):
            moved = output.detach().double().movedim(axis, 0)
            flat = moved.reshape(moved.shape[0], -1)
            low, high = flat.amin(dim=1), flat.amax(dim=1)
            if path in extrema:
                low, high = torch.minimum(extrema[path][0], low), torch.maximum(extrema[path][1], high)
            extrema[path] = (low, high)
        return hook

    run_hooked(model, batches, [(modules[path], keep(path, axis)) for path, axis in axes.items()])
    return extrema
