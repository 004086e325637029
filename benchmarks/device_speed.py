"""Device speed: compare, step and the integer simulation on CUDA against the CPU, same script.

Issue 18, item 2: "``benchmarks/`` records the GPU speed-up when a GPU is available".  Without a
CUDA device this script says so and exits 0: nothing is measured, and nothing may be recorded.

Model: ResNet-18 (``qdebug.zoo.ResNet()``, seeded weights, BN statistics from random train-mode
forwards; ``benchmarks/workload.py``), prepared (fuse_bn, default QConfig) and calibrated on two
random batches, then converted: the float, calibrated and quantized stages of one model.  Data:
``--batches`` seeded random batches of ``--batch`` x 3 x ``--size`` x ``--size``.

Measured, each on ``device="cpu"`` and ``device="cuda"`` through the Python API (each call moves
fresh copies of the models to the device and back, and the batches as they are used: what a
user's call costs), wall time:

1. ``qdebug.compare(float, calibrated, quantized)``: every layer, propagated and isolated error;
2. ``qdebug.step(float, calibrated, mode="auto")``: one trial per top-level module;
3. the quantized stage's forward (integer simulation) over the batches, the model already on the
   device (``torch.cuda.synchronize`` before the clock stops).

Both sides are warmed up once (CUDA's context, cuDNN and cuBLAS start on first use), then run
``--repeats`` times taking turns; medians are reported, with every sample in the JSON.  The
largest SQNR difference between the devices' compare tables is printed beside the times, a check
that both computed the same thing (docs/benchmarks.md states the tolerance: tests/test_device.py).

Usage:  python benchmarks/device_speed.py [--batch 8] [--size 224] [--batches 2] [--repeats 3]
            [--json PATH]
Small and quick:  --size 64 --batches 2 --repeats 1
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time

import torch

import qdebug
from qdebug.engine import convert
from workload import calibrated, random_batches, resnet18

BN_WARMUP_FORWARDS = 3


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def _integer_forward(model, batches, device: str):
    def run():
        with torch.no_grad():
            return [model(x.to(device)) for x in batches]
    return run


def _max_sqnr_gap(a, b) -> float:
    """The largest |sqnr_db| difference between two compare frames (both capped at 60 dB, where
    the noise left is float32 rounding, which no two devices share)."""
    gap = 0.0
    for column in ("sqnr_db", "isolated_sqnr_db"):
        for x, y in zip(a[column], b[column]):
            if not (math.isnan(x) or math.isnan(y)):
                gap = max(gap, abs(min(x, 60.0) - min(y, 60.0)))
    return gap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        built = "built with CUDA " + str(torch.version.cuda) if torch.backends.cuda.is_built() else "built without CUDA"
        print(f"no CUDA device here (torch {torch.__version__}, {built}): nothing measured")
        return 0

    float_model = resnet18(args.batch, args.size, args.seed, BN_WARMUP_FORWARDS)
    calibrated_model = calibrated(float_model, args.batch, args.size, args.seed)
    quantized_model = convert(calibrated_model)
    batches = list(random_batches(args.batches, args.batch, args.size, args.seed + 10))
    stages = [("float", float_model), ("calibrated", calibrated_model), ("quantized", quantized_model)]

    def compare(device: str):
        return lambda: qdebug.compare(*[(n, copy.deepcopy(m)) for n, m in stages], data=batches, device=device)

    def step(device: str):
        return lambda: qdebug.step(copy.deepcopy(float_model), copy.deepcopy(calibrated_model), data=batches,
                                   mode="auto", device=device)

    on_gpu = copy.deepcopy(quantized_model).to("cuda")
    cases = {
        "compare (float, calibrated, quantized)": {"cpu": compare("cpu"), "cuda": compare("cuda")},
        "step --auto": {"cpu": step("cpu"), "cuda": step("cuda")},
        "integer simulation forward": {"cpu": _integer_forward(quantized_model, batches, "cpu"),
                                       "cuda": _integer_forward(on_gpu, batches, "cuda")},
    }
    samples: dict[str, dict[str, list[float]]] = {name: {"cpu": [], "cuda": []} for name in cases}
    frames = {}
    for name, sides in cases.items():
        for device, fn in sides.items():  # warm-up: CUDA's context and libraries start here
            _, frames[(name, device)] = _timed(fn)
        for _ in range(args.repeats):
            for device, fn in sides.items():
                seconds, _ = _timed(fn)
                samples[name][device].append(seconds)

    gap = _max_sqnr_gap(frames[(next(iter(cases)), "cpu")], frames[(next(iter(cases)), "cuda")])
    gpu = torch.cuda.get_device_name(0)
    print(f"ResNet-18, batch {args.batch}, {args.size} px, {args.batches} batch(es), {args.repeats} repeat(s); "
          f"torch {torch.__version__}, CPU: {torch.get_num_threads()} threads, GPU: {gpu}\n")
    print("| measure | CPU | CUDA | speed-up |")
    print("|---|---|---|---|")
    rows = []
    for name in cases:
        cpu, cuda = statistics.median(samples[name]["cpu"]), statistics.median(samples[name]["cuda"])
        rows.append({"measure": name, "cpu_s": cpu, "cuda_s": cuda, "speedup": cpu / cuda})
        print(f"| {name} | {cpu:.3f} s | {cuda:.3f} s | {cpu / cuda:.1f}x |")
    print(f"\nlargest compare SQNR difference CPU vs CUDA (capped at 60 dB): {gap:.3f} dB")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "gpu": gpu, "torch": torch.__version__, "rows": rows,
                       "samples": samples, "max_sqnr_gap_db": gap}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
