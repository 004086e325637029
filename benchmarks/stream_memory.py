"""Streaming data: peak RSS of the commands over 64 batches against 8 (issue 18, item 1).

Each command runs as a subprocess of this script, on a zoo ResNet (seeded weights, BN
statistics from a few train-mode forwards, calibrated by qdebug with the default QConfig),
over the same data with ``--batches 8`` and with ``--batches 64``:

- a data function returning a map-style ``torch.utils.data.DataLoader`` (a small package
  written into a temp dir; its dataset makes each sample when asked for, so the data
  exists only as qdebug reads it), and
- a ``.pt`` dataset file of the same samples (sliced from a memory map);
- ``--sources held``, the control: a data function that reads its ``--batches`` batches up
  front into a list (what qdebug itself did before streaming), to show what holding reads.

Peak RSS is the child's own: ``os.wait4``'s ``ru_maxrss`` (Linux reports the child and the
descendants it waited for; the loader has no workers).  This script stays small while the
children run: it writes the files from a child of its own, and never imports torch itself.
Reported per command and source: the two peaks and their ratio 64/8 (target <= 1.1).  The
data of 64 batches (about 330 MB) is several times the model and the size of a command's
baseline RSS, so a command that held its batches would read about 1.6.

Usage:  python benchmarks/stream_memory.py [--batch 48] [--size 96] [--commands compare,step,...]
            [--sources loader,file] [--json PATH]
Small and quick:  --batch 8 --size 32 --commands compare
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = ("compare", "step", "suggest", "baseline", "calibrate")
COUNTS = (8, 64)

PACKAGE = '''
"""The benchmark's data: a map-style dataset whose samples are made when asked for."""
import torch
from torch.utils.data import DataLoader, Dataset

BATCH, SIZE, SAMPLES = {batch}, {size}, {samples}


class Images(Dataset):
    def __init__(self):
        gen = torch.Generator().manual_seed(7)
        self.base = torch.randn(16, 3, SIZE, SIZE, generator=gen)  # 16 patterns, varied per index

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return self.base[i % 16] * (1.0 + (i % 7) / 8.0), i % 10


def eval_loader():
    return DataLoader(Images(), batch_size=BATCH, shuffle=False)


def eval_held():
    """The control: the --batches batches read up front and held, as qdebug did before streaming."""
    import itertools, os
    return list(itertools.islice(eval_loader(), int(os.environ["STREAM_BATCHES"])))
'''

SETUP = '''
import sys, warnings
import torch, torch.nn as nn
import qdebug
from qdebug.engine import QConfig, calibrate, prepare
from qdebug.zoo import ResNet
sys.path.insert(0, sys.argv[1])
from streamdata.loader import BATCH, SIZE, SAMPLES, Images

torch.manual_seed(0)
kwargs = dict(layers=[1, 1], widths=[8, 16], num_classes=10, in_channels=3, stem="imagenet")
model = ResNet(**kwargs)
spec = dict(model_spec="qdebug.zoo.resnet:ResNet", model_kwargs=kwargs)
bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
for bn in bns:
    bn.momentum = None  # BN statistics: the average of a few train-mode forwards
model.train()
data = Images()
with torch.no_grad():
    for k in range(4):
        model(torch.stack([data[i][0] for i in range(k * 16, k * 16 + 16)]))
model.eval()
sample = torch.stack([data[i][0] for i in range(8)])
qdebug.save(model, sys.argv[1] + "/float.pt", stage="float", sample_inputs=sample, **spec)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    qm = prepare(model, QConfig(), mode="fuse_bn", example_inputs=sample)
    calibrate(qm, [torch.stack([data[i][0] for i in range(j, j + 16)]) for j in range(0, 64, 16)])
qdebug.save(qm, sys.argv[1] + "/calibrated.pt", stage="calibrated", sample_inputs=sample, **spec)
pairs = [data[i] for i in range(SAMPLES)]
torch.save({{"inputs": torch.stack([p[0] for p in pairs]), "targets": torch.tensor([p[1] for p in pairs])}},
           sys.argv[1] + "/eval.pt")
'''


def arguments(command: str, folder: Path, data: str, count: int) -> list[str]:
    float_pt, cal = str(folder / "float.pt"), str(folder / "calibrated.pt")
    common = ["--data", data, "--batches", str(count), "--format", "json"]
    return {
        "compare": ["compare", float_pt, cal, *common],
        "step": ["step", float_pt, cal, "--metric", "top1", *common],
        "suggest": ["suggest", float_pt, cal, "--metric", "agreement", "--ratio", "0.999", *common],
        "baseline": ["baseline", float_pt, cal, "--metric", "top1", *common],
        "calibrate": ["calibrate", float_pt, "-o", str(folder / f"recalibrated{count}.pt"), *common],
    }[command]


def peak_mb(args: list[str], folder: Path) -> tuple[float, float, int]:
    """(peak RSS in MB, seconds, exit code) of ``python -m qdebug ARGS`` run in ``folder``."""
    env = {**os.environ, "PYTHONPATH": str(folder), "STREAM_BATCHES": args[args.index("--batches") + 1]}
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "qdebug", *args], cwd=folder, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1):
        sys.exit(f"qdebug {' '.join(args)} failed ({code}):\n{stderr.decode()}")
    return usage.ru_maxrss / 1024.0, seconds, code  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=48, help="samples per batch")
    parser.add_argument("--size", type=int, default=96, help="image side: 3 x size x size float32 samples")
    parser.add_argument("--commands", default=",".join(COMMANDS))
    parser.add_argument("--sources", default="loader,file")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    commands = args.commands.split(",")
    sources = args.sources.split(",")
    samples = args.batch * COUNTS[-1]
    data_mb = samples * 3 * args.size * args.size * 4 / 2**20
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "streamdata").mkdir()
        (folder / "streamdata" / "__init__.py").write_text("")
        (folder / "streamdata" / "loader.py").write_text(PACKAGE.format(batch=args.batch, size=args.size,
                                                                        samples=samples))
        subprocess.run([sys.executable, "-c", SETUP.format(), str(folder)], check=True)
        model_mb = (folder / "float.pt").stat().st_size / 2**20
        specs = {"loader": "streamdata.loader:eval_loader", "file": str(folder / "eval.pt"),
                 "held": "streamdata.loader:eval_held"}
        for source in sources:
            for command in commands:
                peaks = {}
                for count in COUNTS:
                    peaks[count] = peak_mb(arguments(command, folder, specs[source], count), folder)
                low, high = peaks[COUNTS[0]], peaks[COUNTS[-1]]
                rows.append({"command": command, "source": source, "peak_mb_8": round(low[0], 1),
                             "peak_mb_64": round(high[0], 1), "ratio": round(high[0] / low[0], 3),
                             "seconds_8": round(low[1], 1), "seconds_64": round(high[1], 1)})
                print(f"{command:9s} {source:6s} {low[0]:7.1f} MB -> {high[0]:7.1f} MB  ratio {high[0] / low[0]:.3f}  "
                      f"({low[1]:.0f} s, {high[1]:.0f} s)", file=sys.stderr, flush=True)
    print(f"\nPeak RSS over 64 batches / over 8 (target <= 1.1); data of 64 batches: {data_mb:.0f} MB "
          f"({args.batch} x 3 x {args.size} x {args.size} float32 per batch), model file: {model_mb:.2f} MB\n")
    print("| command | data | peak RSS, 8 batches | peak RSS, 64 batches | 64 / 8 |")
    print("|---|---|---|---|---|")
    for row in rows:
        what = {"loader": "DataLoader function", "file": ".pt file", "held": "control: a list held"}[row["source"]]
        print(f"| {row['command']} | {what} | {row['peak_mb_8']:.0f} MB | {row['peak_mb_64']:.0f} MB | "
              f"{row['ratio']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"batch": args.batch, "size": args.size, "data_mb_64": data_mb,
                                         "model_mb": model_mb, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
