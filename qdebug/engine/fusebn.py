"""BN under control during QAT: fold it (``FuseBN``) or freeze its statistics (``FreezeBN``,
``freeze_bn_stats``) for named submodules at given training steps or epochs (seed 003).

    fuse = FuseBN(modules=[["backbone"], ["neck"]], step_or_epoch=[1000, 1500], update_by="step")
    freeze = FreezeBN(modules=[[""]], step_or_epoch=[200])     # every BN, from step 200
    for step, batch in enumerate(loader):
        ...; optimizer.step()
        fuse(qat_model, step); freeze(qat_model, step)   # or .on_step(model, step) / .on_epoch(model, epoch)

At the first call whose count reaches ``step_or_epoch[i]``, the action runs once on
every Conv-BN pair (``FuseBN``: ``absorb_bn``, lossless under with_bn_reverse_fold) or
BatchNorm (``FreezeBN``: ``freeze_bn_stats``) inside ``modules[i]`` ("" = the whole
model).

``freeze_bn_stats(model)``: the BatchNorm layers stop updating their running mean and
variance and normalize with them, in training too -- as torch.ao's
``freeze_bn_stats`` does for its ConvBn modules.  Small QAT batches then no longer
drag the statistics the deployed (folded) model will use.  They stay in eval mode
through ``model.train()`` until ``freeze_bn_stats(model, freeze=False)``.
"""

from __future__ import annotations

import types
from typing import Callable, Sequence

import torch.nn as nn

from qdebug.engine.prepare import absorb_bn, name_matches
from qdebug.errors import QDebugError


def _stay_in_eval(module: nn.Module, mode: bool = True) -> nn.Module:
    # Bound to the BN instance (a method, so deep copies rebind it to the copy).
    return nn.Module.train(module, False)


def freeze_bn_stats(model: nn.Module, pattern: str = "*", *, freeze: bool = True) -> list[str]:
    """Freeze (or thaw) the running statistics of every BatchNorm whose path matches
    ``pattern`` (a glob or module prefix); returns their paths (see module docstring)."""
    changed = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        if pattern not in ("*", "") and not name_matches(pattern, path):
            continue
        if freeze:
            module.__dict__["train"] = types.MethodType(_stay_in_eval, module)
            nn.Module.train(module, False)
        else:
            module.__dict__.pop("train", None)
            nn.Module.train(module, model.training)
        changed.append(path)
    if not changed:
        raise QDebugError(f"no BatchNorm matches {pattern!r}", "give a module path such as backbone, or '*' for all")
    return changed


class _AtCount:
    """Runs ``action(model, prefix)`` once per group, at the first count reaching its step/epoch."""

    action: Callable[[nn.Module, str], list[str]]

    def __init__(self, modules: Sequence[Sequence[str]], step_or_epoch: Sequence[int], update_by: str = "step"):
        if update_by not in ("step", "epoch"):
            raise QDebugError(f"update_by={update_by!r} is not 'step' or 'epoch'",
                              "use update_by='step' or update_by='epoch'")
        if len(modules) != len(step_or_epoch):
            raise QDebugError(
                f"{type(self).__name__} got {len(modules)} module groups but {len(step_or_epoch)} steps",
                "give one step_or_epoch per module group",
            )
        self.modules = [[m] if isinstance(m, str) else list(m) for m in modules]
        self.step_or_epoch = [int(s) for s in step_or_epoch]
        self.update_by = update_by
        self.done = [False] * len(self.modules)
        self.applied: list[str] = []

    def __call__(self, model: nn.Module, count: int) -> list[str]:
        """Act on every due group at step/epoch ``count``; returns the modules acted on now."""
        acted = []
        for i, (group, at) in enumerate(zip(self.modules, self.step_or_epoch)):
            if self.done[i] or count < at:
                continue
            for prefix in group:
                acted += self.action(model, prefix)
            self.done[i] = True
        self.applied += acted
        return acted

    def on_step(self, model: nn.Module, step: int) -> list[str]:
        return self(model, step) if self.update_by == "step" else []

    def on_epoch(self, model: nn.Module, epoch: int) -> list[str]:
        return self(model, epoch) if self.update_by == "epoch" else []


class FuseBN(_AtCount):
    """Fold the Conv-BN pairs of each group at its step (``absorb_bn``)."""

    @staticmethod
    def action(model: nn.Module, prefix: str) -> list[str]:
        return absorb_bn(model, prefix or "*")

    @property
    def absorbed(self) -> list[str]:
        return self.applied


def frozen_bn_paths(model: nn.Module) -> list[str]:
    """The paths of the BatchNorm layers ``freeze_bn_stats`` froze (checkpoints keep them frozen)."""
    return [path for path, module in model.named_modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and "train" in module.__dict__]


class FreezeBN(_AtCount):
    """Freeze the BN statistics of each group at its step (``freeze_bn_stats``)."""

    @staticmethod
    def action(model: nn.Module, prefix: str) -> list[str]:
        return freeze_bn_stats(model, prefix or "*")
