"""``nn.Embedding`` with a quantized weight: the engine's ``QEmbedding``.

torch.ao quantizes an embedding table weight-only, per row (one scale per embedding vector,
``torch.ao.nn.quantized.Embedding``): a lookup copies rows, so every output value is a weight
code times its row's scale -- exact on codes, no arithmetic to simulate.  ``QEmbedding``
keeps the ``weight`` parameter (same name, same tensor), quantizes it by its weight point
(per-row with the default per-channel weight spec: channel axis 0 is the row), and looks up
the quantized rows.  The call is category ``activation``: its output point is the quantize
that follows a weight-only embedding in a deployment (docs/engine.md, "Modern blocks").
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from qdebug.engine.ops import register_module_category
from qdebug.engine.weight_only import WeightOnly


class QEmbedding(WeightOnly, nn.Module):
    """An ``nn.Embedding`` whose table is fake-quantized by ``weight_point``."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.max_norm = embedding.max_norm
        self.norm_type = embedding.norm_type
        self.scale_grad_by_freq = embedding.scale_grad_by_freq
        self.sparse = embedding.sparse
        self.weight = embedding.weight
        object.__setattr__(self, "weight_point", None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.max_norm is not None:  # renormalises the float table in place, as nn.Embedding does
            with torch.no_grad():
                torch.embedding_renorm_(self.weight, ids, self.max_norm, self.norm_type)
        return F.embedding(ids, self.quantized_weight(), self.padding_idx, None, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


def quantizable_embedding(module: nn.Module) -> QEmbedding | None:
    """A ``QEmbedding`` for a plain ``nn.Embedding`` (not a subclass with its own forward)."""
    return QEmbedding(module) if type(module) is nn.Embedding else None


register_module_category(QEmbedding, "activation")
