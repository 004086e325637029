"""Engine speed, as ratios against baselines run in the same process.

1. QAT training step (forward + backward + SGD step) of a ResNet-18-sized model:
   qdebug's engine (with_bn_reverse_fold, EMA activation observers updating, int8
   per-channel symmetric weights, uint8 affine activations) vs the same model through
   torch's own QAT (``torch.ao.quantization.quantize_fx.prepare_qat_fx``, ConvBn fused,
   moving-average observers, the same scheme; torch's default fused fake quant, and
   its two-pass ``FakeQuantize`` for information).  Target: ratio <= 1.2.
2. Quantized-stage forward (integer simulation) vs the float forward.  Target: <= 4.

Usage:  python benchmarks/engine_speed.py [--batch 16] [--size 224] [--repeats 3]
Timings alternate between the two sides and report medians, since shared
machines are noisy.  Results go to stdout as a Markdown table (paste into
docs/benchmarks.md) and, with --json PATH, as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings

import torch
import torch.nn as nn

from qdebug.engine import QConfig, QuantSpec, calibrate, convert, prepare, quant_points, set_mode
from qdebug.zoo import ResNet


def qat_step_fn(model: nn.Module, x: torch.Tensor, target: torch.Tensor):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), target)
        loss.backward()
        optimizer.step()

    return step


def torch_qat_model(model: nn.Module, x: torch.Tensor, fused: bool = True) -> nn.Module:
    """The model through torch's own QAT with the same int8 scheme as ``qdebug_qat_model``.

    Activations are quint8 affine per-tensor [0, 255]: torch's x86 backend only
    quantizes activations of that dtype (with qint8 activations ``prepare_qat_fx``
    silently leaves every activation float, a weight-only baseline).  ``fused``
    picks torch's default fake-quant class (``FusedMovingAvgObsFakeQuantize``, one
    kernel observing and quantizing) over the two-pass ``FakeQuantize``.
    """
    from torch.ao.quantization import FakeQuantize, FusedMovingAvgObsFakeQuantize, MovingAverageMinMaxObserver
    from torch.ao.quantization import MovingAveragePerChannelMinMaxObserver, QConfig as TorchQConfig, QConfigMapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    fake_quant = FusedMovingAvgObsFakeQuantize if fused else FakeQuantize
    qconfig = TorchQConfig(
        activation=fake_quant.with_args(
            observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
            qscheme=torch.per_tensor_affine,
        ),
        weight=fake_quant.with_args(
            observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8,
            qscheme=torch.per_channel_symmetric,
        ),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_qat_fx(copy.deepcopy(model).train(), QConfigMapping().set_global(qconfig), (x,))
    return prepared


def count_torch_fake_quants(prepared: nn.Module) -> dict[str, int]:
    """Weight and activation fake-quant modules in a torch QAT model (proves the baseline quantizes both)."""
    from torch.ao.quantization import FakeQuantizeBase

    names = [n for n, m in prepared.named_modules() if isinstance(m, FakeQuantizeBase)]
    weights = sum(n.endswith("weight_fake_quant") for n in names)
    return {"weight": weights, "activation": len(names) - weights}


def qdebug_qat_model(model: nn.Module, x: torch.Tensor) -> nn.Module:
    # The torch baseline's scheme: uint8 affine EMA activations, int8 symmetric per-channel weights.
    qcfg = QConfig(activation=QuantSpec(signed=False, symmetric=False, observer="ema"))
    qm = prepare(model, qcfg, mode="with_bn_reverse_fold", example_inputs=x[:2])
    calibrate(qm, [x[:4]])
    set_mode(qm, "fake", observe=True)
    return qm.train()


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def alternate(fns: dict, repeats: int, warmup: int = 1) -> dict[str, float]:
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            samples[k] += timed(fn, 1)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = ResNet(num_classes=1000).eval()
    x = torch.randn(args.batch, 3, args.size, args.size)
    target = torch.randint(0, 1000, (args.batch,))

    torch_fused = torch_qat_model(model, x, fused=True)
    torch_unfused = torch_qat_model(model, x, fused=False)
    if count_torch_fake_quants(torch_fused)["activation"] == 0:
        raise SystemExit("torch baseline quantizes no activation: the comparison would be weight-only")
    ours_qat = qdebug_qat_model(model, x)
    qat = alternate(
        {
            "torch": qat_step_fn(torch_fused, x, target),
            "torch_unfused": qat_step_fn(torch_unfused, x, target),
            "qdebug": qat_step_fn(ours_qat, x, target),
        },
        args.repeats,
    )

    fq = prepare(model, QConfig(), mode="fuse_bn", example_inputs=x[:2])
    calibrate(fq, [x[:4]])
    quantized = convert(fq)
    xb = x[: max(args.batch // 2, 1)]
    with torch.no_grad():
        fwd = alternate(
            {"float": lambda: model(xb), "fake": lambda: fq(xb), "quantized": lambda: quantized(xb)}, args.repeats
        )

    results = {
        "config": {"model": "ResNet-18", "batch_qat": args.batch, "batch_forward": xb.shape[0], "size": args.size,
                   "threads": torch.get_num_threads(), "torch": torch.__version__},
        "qat_step_s": qat,
        "torch_fake_quants": count_torch_fake_quants(torch_fused),
        "qdebug_points": {k: sum(p.kind == k and p.mode == "fake" for p in quant_points(ours_qat).values())
                          for k in ("weight", "activation")},
        "qat_ratio": qat["qdebug"] / qat["torch"],
        "qat_ratio_unfused": qat["qdebug"] / qat["torch_unfused"],
        "forward_s": fwd,
        "quantized_over_float": fwd["quantized"] / fwd["float"],
        "fake_over_float": fwd["fake"] / fwd["float"],
    }
    print("| measure | baseline | qdebug | ratio | target |")
    print("|---|---|---|---|---|")
    print(f"| QAT step, ResNet-18, batch {args.batch}, {args.size}px | torch prepare_qat_fx (fused) {qat['torch']:.2f} s "
          f"| {qat['qdebug']:.2f} s | {results['qat_ratio']:.2f} | <= 1.2 |")
    print(f"| QAT step, same, vs torch's two-pass FakeQuantize | {qat['torch_unfused']:.2f} s "
          f"| {qat['qdebug']:.2f} s | {results['qat_ratio_unfused']:.2f} | (info) |")
    print(f"fake-quant points: torch {results['torch_fake_quants']}, qdebug {results['qdebug_points']}")
    print(f"| quantized-stage forward, batch {xb.shape[0]} | float {fwd['float']:.2f} s | {fwd['quantized']:.2f} s "
          f"| {results['quantized_over_float']:.2f} | <= 4 |")
    print(f"| fake-quant forward, batch {xb.shape[0]} | float {fwd['float']:.2f} s | {fwd['fake']:.2f} s "
          f"| {results['fake_over_float']:.2f} | (info) |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
