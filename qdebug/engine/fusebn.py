"""``FuseBN``: absorb the BN of named submodules at given training steps or epochs (seed 003).

    fuse = FuseBN(modules=[["backbone"], ["neck"]], step_or_epoch=[1000, 1500], update_by="step")
    for step, batch in enumerate(loader):
        ...; optimizer.step()
        fuse(qat_model, step)          # or fuse.on_step(model, step) / fuse.on_epoch(model, epoch)

At the first call whose count reaches ``step_or_epoch[i]``, every Conv-BN pair
inside ``modules[i]`` is folded with ``absorb_bn`` (lossless under
with_bn_reverse_fold).  Each group is folded once.
"""

from __future__ import annotations

from typing import Sequence

import torch.nn as nn

from qdebug.engine.prepare import absorb_bn
from qdebug.errors import QDebugError


class FuseBN:
    def __init__(self, modules: Sequence[Sequence[str]], step_or_epoch: Sequence[int], update_by: str = "step"):
        if update_by not in ("step", "epoch"):
            raise QDebugError(f"update_by={update_by!r} is not 'step' or 'epoch'",
                              "use update_by='step' or update_by='epoch'")
        if len(modules) != len(step_or_epoch):
            raise QDebugError(
                f"FuseBN got {len(modules)} module groups but {len(step_or_epoch)} steps",
                "give one step_or_epoch per module group",
            )
        self.modules = [[m] if isinstance(m, str) else list(m) for m in modules]
        self.step_or_epoch = [int(s) for s in step_or_epoch]
        self.update_by = update_by
        self.done = [False] * len(self.modules)
        self.absorbed: list[str] = []

    def __call__(self, model: nn.Module, count: int) -> list[str]:
        """Fold every due group at step/epoch ``count``; returns the convs folded now."""
        folded = []
        for i, (group, at) in enumerate(zip(self.modules, self.step_or_epoch)):
            if self.done[i] or count < at:
                continue
            for prefix in group:
                folded += absorb_bn(model, prefix)
            self.done[i] = True
        self.absorbed += folded
        return folded

    def on_step(self, model: nn.Module, step: int) -> list[str]:
        return self(model, step) if self.update_by == "step" else []

    def on_epoch(self, model: nn.Module, epoch: int) -> list[str]:
        return self(model, epoch) if self.update_by == "epoch" else []
