"""ONNX parity on real networks (issue 32, must-have 5): export, the ONNX Runtime stage, ORT's own quantization.

Models: torchvision's ResNet-18 and MobileNetV2 (their own code, through tests/vision_libraries.py:
torchvision in ``.vendor``), random weights; BN statistics estimated on real images -- crops of
scikit-learn's two bundled photographs (``load_sample_images``), ImageNet-normalized, ``--size`` px --
so activations have a real image's ranges.  qdebug's int8 defaults (per-channel symmetric weights,
per-tensor affine activations), calibrated on ``--calib`` crops, measured on ``--eval`` others.

(a) Export parity: ``qdebug export``'s QDQ model (``export_onnx``) run by ONNX Runtime (CPU EP,
    default optimizations) vs qdebug's quantized stage (``convert``), in LSB of the output point's
    scale: share within 1 LSB (target >= 99%), largest difference, histogram 0/1/2/>2, and which
    compute nodes ORT runs as int8 kernels (when the parity reports them).
(b) compare with the ONNX stage: ``qdebug.compare(float, calibrated, quantized, "model.onnx")`` on the
    eval crops: rows the ONNX stage fills, unmatched tensors, output SQNR of the quantized stage and
    of ONNX Runtime against float (the same model twice: they must agree), and compare's time with
    and without the ONNX stage.
(c) ORT's own quantization imported: torch's export of the float model, ``quantize_static`` (QDQ,
    MinMax) on the calibration crops -- per-channel QInt8 activations, and per-tensor QUInt8 -- then
    ``qdebug import --from onnx-qdq`` (``import_qdq``): the import report's statuses and the
    imported model's output vs ONNX Runtime's own run of the file on the eval crops (share within
    1 LSB of the output scale).

    python benchmarks/onnx_parity.py                       # both models, 224 px, parts abc
    python benchmarks/onnx_parity.py --models resnet18 --size 96 --parts a

Results: a Markdown table per part on stdout, every figure in the JSON (``--json``).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

MEAN, STD = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])


def image_crops(count: int, size: int, seed: int) -> torch.Tensor:
    """``count`` random ``size`` px crops of scikit-learn's sample photographs, ImageNet-normalized."""
    from sklearn.datasets import load_sample_images

    images = [torch.from_numpy(im).permute(2, 0, 1).float() / 255 for im in load_sample_images().images]
    gen = torch.Generator().manual_seed(seed)
    crops = []
    for k in range(count):
        image = images[k % len(images)]
        scale = float(torch.empty(1).uniform_(0.4, 1.0, generator=gen))
        side = max(size, int(min(image.shape[1:]) * scale))
        top = int(torch.randint(0, image.shape[1] - side + 1, (1,), generator=gen))
        left = int(torch.randint(0, image.shape[2] - side + 1, (1,), generator=gen))
        crop = image[:, top:top + side, left:left + side].unsqueeze(0)
        crop = nn.functional.interpolate(crop, size=(size, size), mode="bilinear", align_corners=False)
        crops.append(((crop[0] - MEAN[:, None, None]) / STD[:, None, None]))
    return torch.stack(crops)


def float_model(name: str, images: torch.Tensor) -> nn.Module:
    """torchvision's ``name`` with random weights and BN statistics estimated on ``images``."""
    import vision_libraries

    tv = vision_libraries.torchvision()
    torch.manual_seed(0)
    model = getattr(tv.models, name)(num_classes=1000)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the batches
    model.train()
    with torch.no_grad():
        for batch in images.split(4):
            model(batch)
    return model.eval()


def calibrated(model: nn.Module, images: torch.Tensor) -> nn.Module:
    from qdebug.engine import calibrate, prepare

    prepared = prepare(model, example_inputs=images[:2])
    return calibrate(prepared, list(images.split(4)))


def part_a(name: str, model: nn.Module, cal: nn.Module, evals: torch.Tensor, workdir: Path) -> dict:
    from qdebug.engine import convert
    from qdebug.onnx.export import export_onnx
    from qdebug.onnx.parity import export_parity

    start = time.perf_counter()
    proto, info = export_onnx(cal, evals[:2])
    seconds = time.perf_counter() - start
    path = workdir / f"{name}.onnx"
    path.write_bytes(proto.SerializeToString())
    parity = export_parity(proto, convert(cal), list(evals.split(4)))  # both arithmetics, one conversion
    keys = ("equal", "within_1_lsb", "max_lsb", "histogram")
    found = {"float32": {k: parity[k] for k in keys}, "fixed_point": {k: parity["fixed_point"][k] for k in keys}}
    return {"model": name, "export_s": round(seconds, 2), "bytes": path.stat().st_size, "values": parity["values"],
            "kernels": parity.get("kernels"), "float_kernels": parity.get("float_kernels"), **found, "path": str(path)}


def part_b(name: str, model: nn.Module, cal: nn.Module, evals: torch.Tensor, onnx_path: str,
           repeats: int) -> dict:
    import qdebug
    from qdebug.engine import convert

    quantized = convert(cal)
    batches = list(evals.split(4))
    times: dict[str, list[float]] = {"without": [], "with": []}
    frames = {}
    for _ in range(repeats):
        for key, extra in (("without", ()), ("with", (onnx_path,))):
            start = time.perf_counter()
            frames[key] = qdebug.compare(("float", model), ("calibrated", cal), ("quantized", quantized), *extra,
                                         data=batches, isolated=False)
            times[key].append(time.perf_counter() - start)
    frame = frames["with"]
    onnx_rows = frame[frame["target"] == "onnx"]
    measured = onnx_rows[onnx_rows["sqnr_db"].notna()]
    output = frame[frame["layer"] == frame["layer"].iloc[-1]]
    sqnr = {row.target: round(float(row.sqnr_db), 2) for row in output.itertuples()}
    stages = frame.attrs.get("meta", {}).get("stages", {}) if hasattr(frame, "attrs") else {}
    unmatched = len(stages.get("onnx", {}).get("unmatched", [])) if stages else None
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"model": name, "onnx_rows": len(onnx_rows), "onnx_rows_measured": len(measured),
            "unmatched": unmatched, "output_layer": str(frame["layer"].iloc[-1]), "output_sqnr_db": sqnr,
            "compare_s": {k: round(v, 2) for k, v in median.items()},
            "ratio_with_onnx": round(median["with"] / median["without"], 2)}


def part_c(name: str, model: nn.Module, cals: torch.Tensor, evals: torch.Tensor, workdir: Path) -> list[dict]:
    from onnx_helpers import ort_quantize, torch_export
    from qdebug.onnx.model_file import read_onnx
    from qdebug.onnx.qdq_check import check_against_ort
    from qdebug.onnx.qdq_import import import_qdq
    from qdebug.interop.build import import_report

    float_path = torch_export(model, evals[:2], workdir / f"{name}_float.onnx")
    results = []
    for label, options in (("per-channel QInt8", {"per_channel": True, "activation_type": "QInt8"}),
                           ("per-tensor QUInt8", {"per_channel": False, "activation_type": "QUInt8"})):
        path = ort_quantize(float_path, workdir / f"{name}_{label.split()[0]}.onnx", list(cals.split(4)), **options)
        proto = read_onnx(path)
        start = time.perf_counter()
        imported = import_qdq(proto, copy.deepcopy(model), evals[:2])
        seconds = time.perf_counter() - start
        statuses: dict[str, int] = {}
        for row in import_report(imported):
            statuses[row["status"]] = statuses.get(row["status"], 0) + 1
        check = check_against_ort(proto, imported, evals)
        results.append({"model": name, "quantization": label, "import_s": round(seconds, 2), "statuses": statuses,
                        **{k: v for k, v in check.items() if not isinstance(v, torch.Tensor)}})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--calib", type=int, default=16)
    parser.add_argument("--eval", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="abc")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    cals = image_crops(args.calib, args.size, seed=1)
    evals = image_crops(args.eval, args.size, seed=2)
    results: dict[str, list] = {"a": [], "b": [], "c": []}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for name in args.models:
            model = float_model(name, cals)
            cal = calibrated(model, cals)
            onnx_path = None
            if "a" in args.parts or "b" in args.parts:
                a = part_a(name, model, cal, evals, workdir)
                onnx_path = a.pop("path")
                results["a"].append(a)
                print(json.dumps(a), flush=True)
            if "b" in args.parts:
                results["b"].append(part_b(name, model, cal, evals, onnx_path, args.repeats))
                print(json.dumps(results["b"][-1]), flush=True)
            if "c" in args.parts:
                results["c"].extend(part_c(name, model, cals, evals, workdir))
                print(json.dumps(results["c"][-2:]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **results}, indent=1))


if __name__ == "__main__":
    main()
