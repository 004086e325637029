"""Start-up: how long ``qdebug --help`` and friends take, against the interpreter alone.

Each command runs as a fresh process (``python -m qdebug ...``), as a user types it.  Baselines
in the same script: ``python -c pass`` (the interpreter's own start) and ``python -c "import
torch"`` (what every command that computes must pay, and what help used to pay).  Reported:
medians over ``--repeats`` alternating runs, and each command's time as a ratio to the bare
interpreter and to the torch import.  Target (issue 12): help, --version and usage errors "well
under 1 s" here, i.e. far below the torch import.

Usage:  python benchmarks/startup.py [--repeats 15] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "import torch": [sys.executable, "-c", "import torch"],
    "qdebug --help": [sys.executable, "-m", "qdebug", "--help"],
    "qdebug compare --help": [sys.executable, "-m", "qdebug", "compare", "--help"],
    "qdebug --version": [sys.executable, "-m", "qdebug", "--version"],
    "usage error": [sys.executable, "-m", "qdebug", "compare", "--format", "xml", "a.pt", "b.pt"],
}


def _time(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    for cmd in CASES.values():  # warm the file cache once
        _time(cmd)
    samples: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.repeats):
        for name, cmd in CASES.items():  # alternating: drift hits every case alike
            samples[name].append(_time(cmd))
    median = {name: statistics.median(values) for name, values in samples.items()}
    bare, torch_import = median["python -c pass"], median["import torch"]
    print(f"{'case':<24}{'median s':>10}{'x python':>10}{'x torch':>9}")
    for name, value in median.items():
        print(f"{name:<24}{value:>10.3f}{value / bare:>10.2f}{value / torch_import:>9.2f}")
    if args.json:
        args.json.write_text(json.dumps({"median_s": median, "samples_s": samples}, indent=2) + "\n")


if __name__ == "__main__":
    main()
