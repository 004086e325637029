"""Transformer architectures from Hugging Face ``transformers``, as qdebug checkpoints can name them.

transformers' models take a config object, which a checkpoint cannot store; these wrappers
take the config's sizes as keyword-only JSON-typed kwargs (so ``qdebug.save`` records
``"qdebug.zoo.hf:Llama"`` plus kwargs), build the model from transformers' own code with
random weights (no hub download), and return one tensor:

* ``ViT``: ``ViTForImageClassification``; the defaults are DeiT-tiny's sizes (ViT-Ti/16:
  hidden 192, 12 layers, 3 heads, 224x224 images).  ``forward(pixel_values) -> logits [B, C]``.
* ``BertClassifier``: ``BertForSequenceClassification`` (BERT-style encoder, post-LN, GELU,
  a pooler and a classifier).  ``forward(input_ids) -> logits [B, C]`` (every token attended).
* ``Llama``: ``LlamaForCausalLM`` (decoder-only: RMSNorm, rotary embeddings, SiLU-gated MLP,
  grouped-query attention).  ``forward(input_ids) -> logits [B, L, vocab]``: qdebug's
  built-in metrics and nan-trace's loss take next-token targets ``[B, L]`` against it.

Attention runs through ``F.scaled_dot_product_attention`` (transformers' "sdpa"), which the
engine decomposes into quantized parts (docs/engine.md, "Attention").  ``transformers`` is an
optional dependency (``pip install "qdebug[models]"``); building a model without it raises a
``QDebugError`` saying so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qdebug.errors import QDebugError

__all__ = ["BertClassifier", "Llama", "ViT"]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise QDebugError("this model needs the transformers package",
                          'pip install "qdebug[models]" (or pip install transformers)') from exc
    return transformers


class ViT(nn.Module):
    """Vision transformer (DeiT-tiny sizes by default) from transformers' ``ViTForImageClassification``."""

    def __init__(self, *, image_size: int = 224, patch_size: int = 16, in_channels: int = 3, hidden_size: int = 192,
                 num_hidden_layers: int = 12, num_attention_heads: int = 3, intermediate_size: int = 768,
                 num_classes: int = 1000):
        super().__init__()
        hf = _transformers()
        config = hf.ViTConfig(image_size=image_size, patch_size=patch_size, num_channels=in_channels,
                              hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                              num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
                              num_labels=num_classes, attn_implementation="sdpa")
        self.net = hf.ViTForImageClassification(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.net(pixel_values=pixel_values).logits


class BertClassifier(nn.Module):
    """BERT-style encoder with a sequence-classification head (transformers' ``BertForSequenceClassification``)."""

    def __init__(self, *, vocab_size: int = 30522, hidden_size: int = 768, num_hidden_layers: int = 12,
                 num_attention_heads: int = 12, intermediate_size: int = 3072, max_position_embeddings: int = 512,
                 num_classes: int = 2):
        super().__init__()
        hf = _transformers()
        config = hf.BertConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                               num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
                               max_position_embeddings=max_position_embeddings, num_labels=num_classes,
                               attn_implementation="sdpa")
        self.net = hf.BertForSequenceClassification(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=input_ids).logits


class Llama(nn.Module):
    """Decoder-only language model (transformers' ``LlamaForCausalLM``): logits per token."""

    def __init__(self, *, vocab_size: int = 32000, hidden_size: int = 256, intermediate_size: int = 688,
                 num_hidden_layers: int = 4, num_attention_heads: int = 8, num_key_value_heads: int = 4,
                 max_position_embeddings: int = 2048):
        super().__init__()
        hf = _transformers()
        config = hf.LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                                num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                                num_key_value_heads=num_key_value_heads,
                                max_position_embeddings=max_position_embeddings, use_cache=False,
                                attn_implementation="sdpa")
        self.net = hf.LlamaForCausalLM(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=input_ids).logits
