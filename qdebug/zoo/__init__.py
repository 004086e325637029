"""qdebug.zoo: small, engine-friendly model definitions for demos, tests and benchmarks.

Every model is an ``nn.Module`` whose constructor takes keyword-only,
JSON-typed kwargs with defaults, so a checkpoint can store
``"qdebug.zoo.<module>:<Class>"`` plus kwargs and rebuild the architecture.

``MODELS`` maps a short name to each image classifier (Conv-BN pairs, 1- or 3-channel
images). ``PUBLISHED_ARCHITECTURES`` maps a short name to each published network reproduced
key for key, so its released weights load with ``strict=True`` (other inputs, no BN pairing):
the GE2E speaker encoder (Resemblyzer), a GRU keyword spotter and MTCNN's ONet.
"""

from __future__ import annotations

from .mobilenetv2 import InvertedResidual, MobileNetV2
from .face import ONet
from .multitask import MultiTaskNet
from .resnet import BasicBlock, ResNet, resnet18
from .shufflenetv2 import ShuffleNetV2, ShuffleUnit, channel_shuffle
from .speech import KeywordGRU, SpeakerEncoder

MODELS = {
    "resnet": ResNet,
    "mobilenetv2": MobileNetV2,
    "shufflenetv2": ShuffleNetV2,
    "multitask": MultiTaskNet,
}

PUBLISHED_ARCHITECTURES = {
    "speaker_encoder": SpeakerEncoder,
    "keyword_gru": KeywordGRU,
    "onet": ONet,
}

__all__ = [
    "BasicBlock",
    "InvertedResidual",
    "KeywordGRU",
    "MODELS",
    "MobileNetV2",
    "MultiTaskNet",
    "ONet",
    "PUBLISHED_ARCHITECTURES",
    "ResNet",
    "ShuffleNetV2",
    "ShuffleUnit",
    "SpeakerEncoder",
    "channel_shuffle",
    "resnet18",
]
