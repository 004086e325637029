"""nan-trace's overhead while everything is finite, against plain QAT steps.

Target (issue 15): "Overhead while finite <= 1.3x a plain QAT step."

Model: ``qdebug.zoo.ResNet()`` (ResNet-18) with BN statistics from a few train-mode forwards,
prepared with ``prepare(model, QConfig(), mode="with_bn_reverse_fold")`` (QAT's lossless BN
scheme), calibrated on two random batches, then ``set_mode(model, "fake", observe=True)``:
QAT with running EMA activation ranges, in train mode.  Seeded random images and class
targets, ``--batches`` of them cycled.

(a) Plain: ``--steps`` QAT steps written the usual way -- zero_grad, cross-entropy of the
    model's output, backward, SGD (momentum 0.9) step -- on a deep copy of the model.
(b) Traced: ``trace_steps(copy, batches, steps=..., lr=...)`` (``qdebug.tools.nan.trace``) on
    another deep copy: the same steps plus nan-trace's snapshot before each step (model,
    optimizer, RNG), the cheap finiteness sums of every forward output and raw output, of
    every output gradient and parameter gradient, the scale and parameter checks after the
    update, the timeline's statistics (per-parameter gradient and inf-norms, per-point
    saturation) and one synchronisation per step.

Both are warmed up with one step, then run ``--repeats`` times taking turns; the best (min)
time of each is reported.  Ratio = traced / plain.  Exit status 0 when the ratio <= 1.3.

Usage:  python benchmarks/nan_trace_overhead.py [--steps 6] [--batches 2] [--batch-size 8]
            [--size 112] [--repeats 3] [--json PATH]
Small and quick:  --size 64 --steps 3 --repeats 1
The machine may be shared: only the ratio means much.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torch.nn.functional as F

from workload import calibrated, random_batches, resnet18

from qdebug.data.batch import Batch
from qdebug.engine import set_mode
from qdebug.tools.nan.trace import SGD_MOMENTUM, trace_steps

TARGET = 1.3


def plain_steps(model, batches: list[Batch], steps: int, lr: float) -> None:
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=SGD_MOMENTUM)
    for step in range(steps):
        batch = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(batch.inputs), batch.target).backward()
        opt.step()


def traced_steps(model, batches: list[Batch], steps: int, lr: float) -> None:
    result = trace_steps(model, batches, steps=steps, lr=lr)
    assert result.first is None, result.first  # the benchmark measures the finite case


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())

    model = calibrated(resnet18(args.batch_size, args.size, 0, 2), args.batch_size, args.size, 0,
                       mode="with_bn_reverse_fold")
    set_mode(model, "fake", observe=True)
    gen = torch.Generator().manual_seed(7)
    batches = [Batch(x, torch.randint(0, 1000, (args.batch_size,), generator=gen))
               for x in random_batches(args.batches, args.batch_size, args.size, 11)]

    plain_steps(copy.deepcopy(model), batches, 1, args.lr)  # warm-up
    traced_steps(copy.deepcopy(model), batches, 1, args.lr)
    times: dict[str, list[float]] = {"plain": [], "traced": []}
    for _ in range(args.repeats):
        for name, run in (("plain", plain_steps), ("traced", traced_steps)):
            copy_ = copy.deepcopy(model)
            start = time.perf_counter()
            run(copy_, batches, args.steps, args.lr)
            times[name].append(time.perf_counter() - start)
            del copy_
    plain, traced = min(times["plain"]), min(times["traced"])
    ratio = traced / plain
    print(f"ResNet-18 QAT (with_bn_reverse_fold, EMA observers), {args.size} px, batch {args.batch_size}, "
          f"{args.steps} steps, best of {args.repeats}")
    print(f"  plain QAT steps:   {plain:8.2f} s  ({plain / args.steps * 1000:.0f} ms/step)")
    print(f"  nan-trace steps:   {traced:8.2f} s  ({traced / args.steps * 1000:.0f} ms/step)")
    print(f"  ratio traced / plain: {ratio:.3f}  (target <= {TARGET})")
    print(("PASS" if ratio <= TARGET else "FAIL") + f": overhead while finite {ratio:.3f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "times": times, "ratio": ratio}, fh, indent=2)
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
