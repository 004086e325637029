"""Fuzzing the loaders: damaged and crafted copies of the demo files, run through the CLI.

A *case* is one mutated file and the commands pointed at it.  Mutations, all seeded:

- bytes: flip bits, truncate, zero-fill a run, duplicate a run (a damaged download or disk);
- structure: the file loaded (weights_only), one value somewhere in its nested dicts and
  lists deleted, renamed or replaced by a value of another kind -- None, numbers at the
  edges, strings, containers, and tensors that are empty, 0-d, of the wrong dtype (bool,
  integer, complex, half), the wrong shape, huge in one dimension's say-so, or NaN -- then
  saved again (a crafted or buggy writer).

The cases run in a worker process (``python tests/fuzzing.py --worker CASES.json``) that
imports torch once and calls the CLI in-process for each case, with its stdout and stderr
captured, a time limit per case (SIGALRM) and an address-space limit for the whole worker,
and prints one JSON line per case.  ``tests/test_fuzz.py`` runs it and holds every case to
the error contract: exit 0 or 2 (or 1, a failed check, for inspect), never an internal error or a traceback, no --out folder
left behind by a failed run.
"""

from __future__ import annotations

import copy
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

CASE_SECONDS = 60  # a case that runs longer is a hang
WORKER_ADDRESS_SPACE = 8 << 30  # bytes: a file that makes qdebug allocate more fails the case

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "fixtures" / "demo"
CHECKPOINTS = ("float.pt", "calibrated.pt", "qat.pt", "quantized.pt")
# Commands whose exit code 1 means "a check failed" (inspect: a file whose zeroed bytes left
# all-zero weights or scales is a loadable file with an error to report, not a crash).
CHECKING_COMMANDS = ("inspect",)
DATA = "eval.pt"


@dataclass
class Case:
    id: int
    source: str  # the demo file it was made from
    mutation: str  # what was done, in words
    argv: list[list[str]] = field(default_factory=list)  # the commands run on it
    out_dirs: list[str] = field(default_factory=list)  # each command's --out (must not exist after exit 2)


# -- byte-level damage ----------------------------------------------------------------------
def damage_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    size = len(data)
    kind = rng.choice(["flip", "truncate", "zero", "duplicate"])
    if kind == "flip":
        buf = bytearray(data)
        count = rng.randint(1, 16)
        for _ in range(count):
            buf[rng.randrange(size)] ^= 1 << rng.randrange(8)
        return bytes(buf), f"{count} bit(s) flipped"
    if kind == "truncate":
        cut = rng.randrange(size)
        return data[:cut], f"truncated to {cut} of {size} bytes"
    start = rng.randrange(size)
    length = min(size - start, rng.choice([1, 8, 64, 512, 4096, 65536]))
    if kind == "zero":
        return data[:start] + bytes(length) + data[start + length:], f"{length} bytes zeroed at {start}"
    return data[:start + length] + data[start:], f"{length} bytes at {start} duplicated"


# -- structural edits -------------------------------------------------------------------------
def _replacements(torch, original) -> list[tuple[str, object]]:
    """Values of other kinds to put where ``original`` was."""
    values: list[tuple[str, object]] = [
        ("None", None), ("0", 0), ("-1", -1), ("True", True), ("10**12", 10**12), ("1e308", 1e308),
        ("nan", float("nan")), ("'x'", "x"), ("[]", []), ("{}", {}), ("{1: 2}", {1: 2}),
        ("tensor 0-d", torch.tensor(3.0)), ("tensor empty", torch.zeros(0)),
        ("tensor NaN", torch.full((4,), float("nan"))), ("tensor bool", torch.ones(3, dtype=torch.bool)),
        ("tensor int64", torch.arange(6)), ("tensor complex", torch.zeros(2, dtype=torch.complex64)),
    ]
    if torch.is_tensor(original) and original.numel() > 0:
        values += [
            ("same tensor as half", original.to(torch.float16)),
            ("same tensor flattened", original.reshape(-1)),
            ("same tensor with its first row dropped", original[1:] if original.dim() else original),
            ("same tensor, negated", -original if original.dtype != torch.bool else original),
            ("same tensor x 1e30", original * 1e30 if original.is_floating_point() else original),
            ("same tensor as a stride-0 view of 10^5 rows",
             original.reshape(1, -1).expand(100000, -1) if original.numel() < 64 else original),
        ]
    if isinstance(original, int) and not isinstance(original, bool):
        values += [("value + 1", original + 1), ("-value", -original), ("value x 10^6", original * 10**6)]
    if isinstance(original, str):
        values += [("'' (empty)", ""), ("value reversed", original[::-1]), ("'os:system'", "os:system")]
    return values


def _paths(obj, prefix=()) -> list[tuple]:
    """Every (container path) to a value inside nested dicts and lists."""
    found = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            found.append(prefix + (key,))
            found += _paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for index, value in enumerate(obj[:8]):  # long lists: the first few are enough
            found.append(prefix + (index,))
            found += _paths(value, prefix + (index,))
    return found


def edit_structure(obj, rng: random.Random, torch) -> tuple[object, str]:
    obj = copy.deepcopy(obj)
    path = rng.choice(_paths(obj))
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    where = "/".join(map(str, path))
    action = rng.choice(["replace", "replace", "replace", "delete", "rename"])
    if action == "delete":
        del parent[key]
        return obj, f"{where} deleted"
    if action == "rename" and isinstance(parent, dict):
        parent[f"{key}_renamed" if isinstance(key, str) else -1 - key] = parent.pop(key)
        return obj, f"{where} renamed"
    label, value = rng.choice(_replacements(torch, parent[key]))
    parent[key] = value
    return obj, f"{where} = {label}"


# -- cases ----------------------------------------------------------------------------------------
def _commands(path: Path, source: str, out: Path) -> tuple[list[list[str]], list[str]]:
    if source == DATA:
        compare_out = out / "compare_out"
        return ([["compare", str(DEMO / "float.pt"), str(DEMO / "calibrated.pt"), "--data", str(path),
                  "--batches", "1", "--batch-size", "16", "--format", "json", "--out", str(compare_out)]], [str(compare_out)])
    compare_out = out / "compare_out"
    return ([["inspect", str(path), "--format", "json"],
             ["compare", str(DEMO / "float.pt"), str(path), "--data", str(DEMO / DATA), "--batches", "1", "--batch-size", "16",
              "--format", "json", "--out", str(compare_out)]], ["", str(compare_out)])


def make_cases(seed: int, count: int, workdir: Path, first_id: int = 0) -> list[Case]:
    """``count`` seeded cases written under ``workdir`` (half byte damage, half structural edits)."""
    import torch

    rng = random.Random(seed)
    originals = {name: (DEMO / name).read_bytes() for name in (*CHECKPOINTS, DATA)}
    loaded: dict[str, object] = {}
    cases = []
    for i in range(first_id, first_id + count):
        source = rng.choice([*CHECKPOINTS, *CHECKPOINTS, DATA])  # checkpoints twice as often
        case_dir = workdir / f"case{i}"
        case_dir.mkdir(parents=True, exist_ok=True)
        path = case_dir / source
        if rng.random() < 0.5:
            data, mutation = damage_bytes(originals[source], rng)
            path.write_bytes(data)
        else:
            if source not in loaded:
                loaded[source] = torch.load(DEMO / source, weights_only=True)
            obj, mutation = edit_structure(loaded[source], rng, torch)
            torch.save(obj, path)
        argv, outs = _commands(path, source, case_dir)
        cases.append(Case(i, source, mutation, argv, outs))
    return cases


# -- the worker ---------------------------------------------------------------------------------
class _Timeout(BaseException):
    pass


def _run_one(argv: list[str]) -> dict:
    import contextlib
    import io
    import signal

    from qdebug.cli import main

    out, err = io.StringIO(), io.StringIO()

    def alarm(signum, frame):
        raise _Timeout()

    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(CASE_SECONDS)
    start = time.perf_counter()
    code: object = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(argv)
            except SystemExit as exc:
                code = exc.code if exc.code is not None else 0
    except _Timeout:
        code = "timeout"
    except BaseException as exc:  # escaped the CLI's own error handling: a bug
        code = f"escaped {type(exc).__name__}: {exc}"
    finally:
        signal.alarm(0)
    return {"code": code, "stderr": err.getvalue()[-2000:], "seconds": round(time.perf_counter() - start, 3)}


def worker(cases_file: str) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_ADDRESS_SPACE, WORKER_ADDRESS_SPACE))
    for raw in json.loads(Path(cases_file).read_text()):
        case = Case(**raw)
        runs: list[dict] = []
        for argv in case.argv:
            if runs and runs[-1]["code"] == 0 and "--out" in argv:
                # The file loads (inspect passed): compare will most likely succeed, and its
                # plots would cost seconds.  --out is what is checked after a *failure*.
                at = argv.index("--out")
                argv = argv[:at] + argv[at + 2:]
            runs.append(_run_one(argv))
        print(json.dumps({"id": case.id, "runs": runs}), flush=True)


def violations(case: Case, runs: list[dict]) -> list[str]:
    """What in one case's runs breaks the error contract (empty: none)."""
    problems = []
    for argv, out_dir, run in zip(case.argv, case.out_dirs, runs):
        command = argv[0]
        code, err = run["code"], run["stderr"]
        if code not in ((0, 1, 2) if command in CHECKING_COMMANDS else (0, 2)):
            problems.append(f"{command}: exit {code!r}")
        if "internal error" in err or "Traceback" in err:
            lines = err.strip().splitlines()
            problems.append(f"{command}: " + next((line for line in lines if "internal error" in line), lines[-1]))
        if code == 2 and out_dir and Path(out_dir).exists():
            problems.append(f"{command}: --out folder left behind after exit 2")
        if code == 2 and not any(line.startswith("error: ") for line in err.splitlines()):
            problems.append(f"{command}: exit 2 without an error: line")
    return problems


def as_json(cases: list[Case]) -> str:
    return json.dumps([asdict(c) for c in cases])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        sys.exit("usage: python tests/fuzzing.py --worker CASES.json")
