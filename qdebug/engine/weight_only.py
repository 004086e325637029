"""``WeightOnly``: the weight point of a layer whose one weight is quantized and nothing else
of its own arithmetic (``QEmbedding``'s table, ``QPReLU``'s slope).

The point sits outside the module tree (``object.__setattr__``), so the layer's state dict
keeps torch's keys.  Its qparams follow the weight as ``QConv``'s do: dynamic unless frozen,
recomputed from the current weight when training changed it (``weight._version``), and the
fake-quantized weight is cached per (tensor, version, device).
"""

from __future__ import annotations

import torch

from qdebug.engine.point import QuantPoint


class WeightOnly:
    """Mixin for an ``nn.Module`` with a ``weight`` parameter and a ``weight_point``."""

    weight: torch.Tensor
    weight_point: QuantPoint | None

    def attach_weight_point(self, point: QuantPoint | None) -> None:
        object.__setattr__(self, "weight_point", point)

    def weight_cache_key(self) -> object:
        return (id(self.weight), self.weight._version, self.weight.device)

    def quantized_weight(self) -> torch.Tensor:
        """The weight as the point quantizes it (the float weight when it has no point)."""
        if self.weight_point is None:
            return self.weight
        cached = self.weight_point.cached_weight(self.weight_cache_key())
        if cached is not None:
            return cached
        return self.weight_point.apply(self.weight, cache_key=self.weight_cache_key())

    def refresh_weight_qparams(self) -> None:
        """Recompute a dynamic point's qparams from the weight now (frozen and learned scales,
        once initialised, are kept)."""
        point = self.weight_point
        if point is None or (point.initialized and (point.frozen or point.spec.learnable_scale)):
            return
        with torch.no_grad():
            point.compute_from(self.weight)
        point.forget_cached()
