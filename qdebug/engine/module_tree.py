"""A model's tree: walking it (``every_path``), what naming needs of it (``TreeIndex``) and
swapping modules in place (``replace_modules``).

``prepare`` swaps layers for the engine's (attention, embeddings, Conv/Linear, BN
placeholders) and ``qdebug.engine.attention.decomposed_copy`` decomposes a float
model's attentions the same way.  Every forward's context needs the tree's index: a
prepared model keeps it between forwards for as long as ``TreeIndex.describes`` it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch.nn as nn

from qdebug.engine.ops import is_norm_act, module_category


def every_path(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(path, module) for every path of the tree, in ``named_modules(remove_duplicate=False)``'s
    order (depth first, children in registration order; a shared module at each of its paths).

    An explicit stack instead of torch's nested generators, whose cost grows with depth: a
    forward's context walks the tree every forward, and at 64 px that walk was ~3% of a
    ResNet-18 forward.
    """
    stack = [("", root)]
    while stack:
        path, module = stack.pop()
        yield path, module
        children = [(f"{path}.{name}" if path else name, child) for name, child in module._modules.items()
                    if child is not None]
        stack.extend(reversed(children))


class TreeIndex:
    """What a forward's naming needs from ``root``'s tree, from one walk: each module's first
    path (``named_modules``' own), every path, the norm-act layers by path
    (``ops.is_norm_act``) and their ``nn.Identity`` children, which are no calls.

    Kept between forwards of a prepared model (an experiment runs hundreds: at 64 px the
    walk was ~1% of each), it is checked first by ``describes``: every module it saw has the
    same identity, class and children as when it was made.  By induction from the root that is
    the same tree, whichever way a module was swapped (``setattr``, ``add_module``, a write to
    ``_modules`` as ``replace_modules`` and torch.ao's swaps do), at ~0.1 µs a module (17 µs on
    the prepared ResNet-18's 173 modules, against 0.27 ms for the walk).  The identities are compared as ``id()`` numbers too, the keys naming looks
    modules up by: a deep copy of the model (and of the index with it) maps the modules
    through the copy's memo but not those numbers, so a copy's forward builds its own index.
    """

    def __init__(self, root: nn.Module):
        self.module_names: dict[int, str] = {}
        self.module_paths: set[str] = set()
        self.norm_acts: dict[str, nn.Module] = {}
        self._categories: dict[int, str | None] = {}
        self._call_modules: list[nn.Module] | None = None
        self._shape: list[tuple[nn.Module, int, type, dict]] = []  # (module, id, class, children)
        tails = []
        for name, module in every_path(root):
            self.module_paths.add(name)
            if id(module) in self.module_names:
                continue
            self.module_names[id(module)] = name
            self._shape.append((module, id(module), type(module), dict(module._modules)))
            if is_norm_act(module):
                self.norm_acts[name] = module
            if getattr(type(module), "norm_act_tail", False):
                tails.append(module)
        owners = [*self.norm_acts.values(), *tails]
        self.silent = {id(c) for m in owners for c in m.children() if type(c) is nn.Identity}

    def describes(self, root: nn.Module) -> bool:
        """Whether ``root``'s tree is still the one indexed (see the class docstring)."""
        if not self._shape or self._shape[0][0] is not root:
            return False
        for module, key, cls, children in self._shape:
            if id(module) != key or type(module) is not cls or module._modules != children:
                return False
        return True

    def category(self, module: nn.Module) -> str | None:
        """``ops.module_category(module)``, remembered per module: its class is fixed while the
        index holds.  An upsample's category follows its ``mode``, an attribute: asked each time."""
        key = id(module)
        if key in self._categories:
            return self._categories[key]
        category = module_category(module)
        if category not in ("passthrough", "activation") or not isinstance(module, nn.Upsample):
            self._categories[key] = category
        return category


    def call_modules(self) -> list[nn.Module]:
        """The modules whose calls are named (a category of their own), each once, in
        ``named_modules``' order: those ``qdebug.engine.served`` lets serve a stored output."""
        if self._call_modules is None:
            self._call_modules = [m for m, *_ in self._shape if self.category(m) is not None]
        return self._call_modules


def kept_index(holder: Any, root: nn.Module) -> TreeIndex:
    """``holder.tree`` (a prepared model's engine state) when it still describes ``root``'s
    tree, else a new index of it, kept there for the next forward."""
    tree = getattr(holder, "tree", None)
    if tree is None or not tree.describes(root):
        tree = holder.tree = TreeIndex(root)
    return tree


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
