"""Manual check (issue 29, item 6): qdebug's integer simulation of a converted model vs torch's kernels.

A model torch.ao converted (eager ``convert``, FX ``convert_fx``) imported with
``qdebug.from_torch_ao`` is qdebug's integer simulation of it: each kernel within 1 code of
torch's, and those 1-code differences travel on through the layers after them.  This measures
how far they travel, end to end, on small and deep nets, and what that does to compare's
numbers: ``qdebug.compare(float, ("torch", converted), ("sim", imported))`` runs torch's own
kernels as one stage (``qdebug.interop.torch_stage``) beside the simulation.

    python benchmarks/torch_kernels.py                          # every model, 2 batches of 2
    python benchmarks/torch_kernels.py --models resnet18 --size 224

Models: the tests' eager ResNet (tests/test_interop_converted.py) and the zoo ResNet under FX
(small, 32 px); torchvision's quantizable resnet18/resnet50/mobilenet_v2 through torchvision's
own recipe (``fuse_model``, x86 default qconfig, ``prepare``, 2 calibration batches,
``convert``), random weights with randomized BN statistics, ``--size`` px.  Needs torchvision in
``.vendor`` (tests/vision_libraries.py).  Per model: the output codes of the simulation that
differ from torch's (share, largest difference in output steps), the output's range in steps,
and the output SQNR against float of torch and of the simulation (compare's last row).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def _batches(n: int, seed: int, shape) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(n)]


def _torchvision(name: str, size: int):
    import torch.ao.quantization as tq

    import vision_libraries
    from small_models import randomize_bn

    tv = vision_libraries.torchvision()
    torch.manual_seed(0)
    model = randomize_bn(getattr(tv.models.quantization, name)(weights=None, quantize=False), 3).eval()
    float_model = copy.deepcopy(model)
    model.fuse_model(is_qat=False)
    model.qconfig = tq.get_default_qconfig("x86")
    prepared = tq.prepare(model)
    with torch.no_grad():
        for x in _batches(2, 5, (2, 3, size, size)):
            prepared(x)
    return float_model, tq.convert(prepared), (2, 3, size, size)


def _case(name: str, size: int):
    import test_interop_converted as t

    if name == "eager-resnet":
        return (*t._eager("resnet", False, True), (2, 3, 32, 32))
    if name == "fx-resnet":
        return (*t._fx("resnet", False, True), (2, 3, 32, 32))
    return _torchvision(name, size)


def measure(name: str, size: int, batches: int) -> dict:
    import qdebug

    float_model, converted, shape = _case(name, size)
    data = _batches(batches, 21, shape)
    start = time.perf_counter()
    sim = qdebug.from_torch_ao(converted, data[0], float_model=float_model)
    frame = qdebug.compare(float_model, ("torch", converted), ("sim", sim), data=data, isolated=False)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        theirs = torch.cat([converted(x) for x in data])
        ours = torch.cat([sim(x) for x in data])
    scale = _output_scale(converted, data[0])
    last = frame["layer"].iloc[-1]
    rows = frame[frame["layer"] == last].set_index("target")["sqnr_db"]
    measured = frame[frame["note"] == ""].groupby("target")["layer"].nunique()
    return {"model": name, "px": shape[-1], "differ": float((theirs != ours).float().mean()),
            "max_steps": float((theirs - ours).abs().max()) / scale,
            "range_steps": float(theirs.max() - theirs.min()) / scale,
            "torch_db": float(rows["torch"]), "sim_db": float(rows["sim"]),
            "rows_torch": int(measured.get("torch", 0)), "rows_sim": int(measured.get("sim", 0)), "s": seconds}


def _output_scale(converted: torch.nn.Module, x: torch.Tensor) -> float:
    """The scale of the last quantized tensor torch computes (the classifier's output grid, which
    the final DeQuantStub or dequantize reads), seen by forward hooks in one run."""
    scales = []

    def keep(module, args, out):  # returns None: the output flows on unchanged
        if isinstance(out, torch.Tensor) and out.is_quantized:
            scales.append(float(out.q_scale()))

    handles = [m.register_forward_hook(keep) for m in converted.modules()]  # nnq.Linear is no leaf
    try:
        with torch.no_grad():
            converted(x)
    finally:
        for handle in handles:
            handle.remove()
    return scales[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="eager-resnet,fx-resnet,resnet18,resnet50,mobilenet_v2")
    parser.add_argument("--size", type=int, default=112, help="torchvision models' input size (px)")
    parser.add_argument("--batches", type=int, default=2)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.backends.quantized.engine = "x86"
    print(f"{'model':14} {'px':>4} {'differ':>7} {'max':>6} {'range':>7} {'torch dB':>9} {'sim dB':>7} "
          f"{'delta':>6} {'rows':>7} {'s':>5}")
    for name in args.models.split(","):
        r = measure(name, args.size, args.batches)
        print(f"{r['model']:14} {r['px']:4d} {r['differ']:7.1%} {r['max_steps']:6.1f} {r['range_steps']:7.0f} "
              f"{r['torch_db']:9.2f} {r['sim_db']:7.2f} {r['sim_db'] - r['torch_db']:+6.2f} "
              f"{r['rows_torch']:3d}/{r['rows_sim']:<3d} {r['s']:5.1f}", flush=True)


if __name__ == "__main__":
    main()
