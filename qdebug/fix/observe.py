"""Run the batches through a float model in eval with forward hooks on some of its modules: how
the fixes measure what they need on the data (ReLU6 peaks, pre-activation minima, a norm's
channel ranges).  The hooks are removed and the model's mode restored whatever happens."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from qdebug.fix.pairs import Tap


def run_hooked(model: nn.Module, batches: Iterable[Any], hooks: Iterable[tuple[nn.Module, Callable]], *,
               with_kwargs: bool = False, pre_hooks: Iterable[tuple[nn.Module, Callable]] = ()) -> None:
    """Each batch (a ``Batch`` or model inputs) through ``model`` in eval, with ``hook`` registered
    as a forward hook on each ``(module, hook)`` (``with_kwargs``: torch's hook with the call's
    kwargs) and each of ``pre_hooks`` as a forward pre-hook, for the duration."""
    from qdebug.engine.context import run_model

    handles = [module.register_forward_hook(hook, with_kwargs=with_kwargs) for module, hook in hooks]
    handles += [module.register_forward_pre_hook(hook) for module, hook in pre_hooks]
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            run_model(model, getattr(batch, "inputs", batch))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()


def channel_extrema(model: nn.Module, modules: dict[str, nn.Module], axes: dict[Tap, int],
                    batches: Any) -> dict[Tap, tuple[torch.Tensor, torch.Tensor]]:
    """Tap -> (per-channel minimum, per-channel maximum) of the value it reads (a module's output,
    or its first input) over ``batches`` (float64; channels along ``axes[tap]``), run through
    ``model`` in eval; a tap whose module never ran on them is absent."""
    extrema: dict[Tap, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(tap: Tap, axis: int):
        def hook(module, args, output=None):
            value = args[0] if tap.reads_input else output
            moved = value.detach().double().movedim(axis, 0)
            flat = moved.reshape(moved.shape[0], -1)
            low, high = flat.amin(dim=1), flat.amax(dim=1)
            if tap in extrema:
                low, high = torch.minimum(extrema[tap][0], low), torch.maximum(extrema[tap][1], high)
            extrema[tap] = (low, high)
        return hook

    # An input is read before the call (a pre-hook): an in-place activation (ReLU6(inplace=True),
    # timm's) has overwritten it by the time a forward hook runs.
    run_hooked(model, batches, [(modules[t.path], keep(t, axis)) for t, axis in axes.items() if not t.reads_input],
               pre_hooks=[(modules[t.path], keep(t, axis)) for t, axis in axes.items() if t.reads_input])
    return extrema
