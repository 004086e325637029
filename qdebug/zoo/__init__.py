"""qdebug.zoo: small, engine-friendly model definitions for demos, tests and benchmarks.

Every model is an ``nn.Module`` whose constructor takes keyword-only,
JSON-typed kwargs with defaults, so a checkpoint can store
``"qdebug.zoo.<module>:<Class>"`` plus kwargs and rebuild the architecture.

``MODELS`` maps a short name to each model class.
"""

from __future__ import annotations

from .mobilenetv2 import InvertedResidual, MobileNetV2
from .multitask import MultiTaskNet
from .resnet import BasicBlock, ResNet, resnet18
from .shufflenetv2 import ShuffleNetV2, ShuffleUnit, channel_shuffle

MODELS = {
    "resnet": ResNet,
    "mobilenetv2": MobileNetV2,
    "shufflenetv2": ShuffleNetV2,
    "multitask": MultiTaskNet,
}

__all__ = [
    "BasicBlock",
    "InvertedResidual",
    "MODELS",
    "MobileNetV2",
    "MultiTaskNet",
    "ResNet",
    "ShuffleNetV2",
    "ShuffleUnit",
    "channel_shuffle",
    "resnet18",
]
