"""Swapping modules in a model's tree in place: ``replace_modules``.

``prepare`` swaps layers for the engine's (attention, embeddings, Conv/Linear, BN
placeholders) and ``qdebug.engine.attention.decomposed_copy`` decomposes a float
model's attentions the same way.
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn


def replace_modules(root: nn.Module, make: Callable[[str, nn.Module], nn.Module | None]) -> dict[int, nn.Module]:
    """Swap modules in the tree (every path an instance appears at); returns old id -> new."""
    replaced: dict[int, nn.Module] = {}
    for path, module in list(root.named_modules(remove_duplicate=False)):
        if not path:
            continue
        new = replaced.get(id(module))
        if new is None:
            new = make(path, module)
            if new is None:
                continue
            replaced[id(module)] = new
        parent_path, _, attr = path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        parent._modules[attr] = new
    return replaced
