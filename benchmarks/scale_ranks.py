"""Data-parallel scaling on CPU processes: the same command over the same batches, as one
process and as ``torchrun --nproc-per-node 2`` (docs/scale.md).

Workload: ResNet-18 (``workload.resnet18``: seeded weights, BN statistics from random
warm-up batches) saved as a float checkpoint and as a calibrated one (int8 defaults), and a
``.pt`` dataset of ``--batches`` seeded batches of ``--batch`` x 3 x ``--size``^2 images with
random labels.  Each command runs as a fresh subprocess (start-up included, as a user runs it):

- ``1x1``: one process, one torch thread -- the unit;
- ``1x2``: one process, two threads -- what a user of this 2-core machine runs today;
- ``2x1``: ``python -m torch.distributed.run --nproc-per-node 2``, one thread per rank.

Each layout also runs the command on 2 batches (one per rank): its time is the start-up
(interpreters, torch's import, torchrun's agent and rendezvous, loading), paid once per
command whatever the data.  Reported: seconds (median of ``--repeats``); the speed-up of 2x1
over 1x1 (ideal: 2) and over 1x2 on the whole command and on the work past start-up
(``T(N batches) - T(2 batches)``, what grows with the data); and whether 2x1's JSON equals
1x1's within 1e-9 relative (the same thread count per process: float32 block sums depend on it).

Usage:  python benchmarks/scale_ranks.py [--size 160] [--batch 8] [--batches 16] [--repeats 2]
            [--commands compare baseline calibrate step]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import qdebug
from workload import calibrated, resnet18


def _write_workload(folder: Path, size: int, batch: int, batches: int) -> None:
    model = resnet18(batch, size, seed=0, warmups=2)
    qdebug.save(model, folder / "float.pt", stage="float")
    qdebug.save(calibrated(model, batch, size, seed=0), folder / "calibrated.pt", stage="calibrated")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(batch * batches, 3, size, size, generator=gen)
    torch.save((x, torch.randint(0, 1000, (batch * batches,), generator=gen)), folder / "eval.pt")


def _argv(command: str, folder: Path, batch: int, batches: int) -> list[str]:
    data = ["--data", str(folder / "eval.pt"), "--batch-size", str(batch), "--batches", str(batches), "--format", "json"]
    f, c = str(folder / "float.pt"), str(folder / "calibrated.pt")
    return {
        "compare": ["compare", f, c, *data],
        "baseline": ["baseline", f, c, *data, "--metric", "agreement", "--ratio", "0.5"],
        "calibrate": ["calibrate", f, *data, "--observer", "percentile", "-o", str(folder / "out.pt")],
        "step": ["step", f, c, *data, "--depth", "1"],
    }[command]


def _run(layout: str, argv: list[str]) -> tuple[float, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "2" if layout == "1x2" else "1"}
    head = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "qdebug"]
            if layout == "2x1" else [sys.executable, "-m", "qdebug"])
    start = time.perf_counter()
    done = subprocess.run(head + argv, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"{layout} {' '.join(argv[:1])} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return seconds, done.stdout


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b))
    return a == b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=160)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--commands", nargs="+", default=["compare", "baseline", "calibrate", "step"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        _write_workload(folder, args.size, args.batch, args.batches)
        print(f"ResNet-18, {args.batches} batches of {args.batch}x3x{args.size}x{args.size}, "
              f"median of {args.repeats}\n")
        print("| command | 1x1 s | 1x2 s | 2x1 s | start-up 1x1 / 1x2 / 2x1 s | 2x1 vs 1x1: whole / past start-up "
              "| 2x1 vs 1x2: whole / past start-up | 2x1 = 1x1 |")
        print("|---|---|---|---|---|---|---|---|")
        layouts = ("1x1", "1x2", "2x1")
        for command in args.commands:
            argv, small = _argv(command, folder, args.batch, args.batches), _argv(command, folder, args.batch, 2)
            times: dict[str, list[float]] = {k: [] for k in layouts}
            starts: dict[str, list[float]] = {k: [] for k in layouts}
            outputs: dict[str, str] = {}
            for _ in range(args.repeats):
                for layout in layouts:  # alternated, so drift on a shared machine hits every side
                    seconds, out = _run(layout, argv)
                    times[layout].append(seconds)
                    outputs[layout] = out
                    starts[layout].append(_run(layout, small)[0])
            med = {k: statistics.median(v) for k, v in times.items()}
            start = {k: statistics.median(v) for k, v in starts.items()}
            work = {k: max(med[k] - start[k], 1e-9) for k in layouts}
            same = _equal(json.loads(outputs["1x1"]), json.loads(outputs["2x1"]))
            print(f"| {command} | {med['1x1']:.1f} | {med['1x2']:.1f} | {med['2x1']:.1f} | "
                  f"{start['1x1']:.1f} / {start['1x2']:.1f} / {start['2x1']:.1f} | "
                  f"{med['1x1'] / med['2x1']:.2f}x / {work['1x1'] / work['2x1']:.2f}x | "
                  f"{med['1x2'] / med['2x1']:.2f}x / {work['1x2'] / work['2x1']:.2f}x | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
