"""Damaged and crafted copies of every kind of file qdebug reads -- checkpoints, data files,
plans, repro bundles, configs, torch.ao state dicts -- never break the error contract
(tests/fuzzing.py).

CI runs a fixed, seeded set of cases of each kind (well under a minute on 2 cores).  A longer
run, new seeds until the time is up:

    python -m pytest tests/test_fuzz.py --fuzz-minutes 10 [--fuzz-seed 7]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import fuzzing

# Cases per kind: every kind in every run; the demo checkpoints most (two commands each).
CI_CASES = {"checkpoint": 36, "data": 18, "plan": 12, "bundle": 12, "config": 12, "torch-ao": 12}
CI_SEED = 20261203
WORKERS = 2  # processes side by side (one torch thread each)


@pytest.fixture(scope="session")
def seeds(tmp_path_factory) -> Path:
    return fuzzing.build_seeds(tmp_path_factory.mktemp("fuzz-seeds"))


def _run_worker(cases: list, tmp_path: Path) -> dict[int, list[dict]]:
    """Each case's runs; a case that kills the worker (a crash, the address-space limit) is
    recorded as such and the worker restarts after it."""
    results: dict[int, list[dict]] = {}
    pending = list(cases)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    while pending:
        cases_file = tmp_path / f"cases{pending[0].id}.json"
        cases_file.write_text(fuzzing.as_json(pending))
        budget = fuzzing.CASE_SECONDS * 2 * len(pending) + 60
        proc = subprocess.run([sys.executable, str(Path(fuzzing.__file__)), "--worker", str(cases_file)],
                              capture_output=True, text=True, timeout=budget, cwd=fuzzing.REPO, env=env)
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                done = json.loads(line)
                results[done["id"]] = done["runs"]
        finished = [c for c in pending if c.id in results]
        pending = [c for c in pending if c.id not in results]
        if pending:  # the worker died on pending[0]
            dead = pending.pop(0)
            tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            results[dead.id] = [{"code": f"worker died ({tail[0]})", "stderr": proc.stderr[-2000:],
                                 "error_line": False, "traceback": False, "internal": ""}]
        elif not finished:
            break
    return results


def _run_workers(cases: list, tmp_path: Path) -> dict[int, list[dict]]:
    """The cases shared out over ``WORKERS`` processes that run side by side."""
    shards = [cases[i::WORKERS] for i in range(WORKERS)]
    with ThreadPoolExecutor(WORKERS) as pool:
        parts = list(pool.map(lambda shard: _run_worker(shard, tmp_path), [s for s in shards if s]))
    return {case_id: runs for part in parts for case_id, runs in part.items()}


def _check(cases: list, results: dict[int, list[dict]]) -> list[str]:
    """One line per case that broke the contract, with everything it broke."""
    failures = []
    for case in cases:
        runs = results.get(case.id)
        name = f"case {case.id} ({case.kind} {case.source}: {case.mutation})"
        if runs is None:
            failures.append(f"{name}: no result")
            continue
        problems = fuzzing.violations(case, runs) if len(runs) == len(case.argv) else [str(runs[0]["code"])]
        if problems:
            failures.append(f"{name}: {'; '.join(dict.fromkeys(problems))}")
    return failures


def _summary(cases: list, results: dict[int, list[dict]]) -> str:
    """Cases per kind and how their commands' runs ended, e.g. ``data: 14 case(s), runs: exit 0: 5, exit 2: 9``."""
    lines = []
    for kind in fuzzing.KINDS:
        ends = Counter(f"exit {run['code']}" for case in cases if case.kind == kind
                       for run in results.get(case.id, []))
        count = sum(case.kind == kind for case in cases)
        lines.append(f"{kind}: {count} case(s), runs: {', '.join(f'{k}: {v}' for k, v in sorted(ends.items()))}")
    return "\n".join(lines)


def test_damaged_and_crafted_inputs_of_every_kind_get_a_clean_answer(tmp_path, request, seeds):
    minutes = request.config.getoption("--fuzz-minutes")
    seed = request.config.getoption("--fuzz-seed") or CI_SEED
    deadline = time.monotonic() + 60 * minutes
    failures, all_cases, results, round_ = [], [], {}, 0
    while True:
        cases = fuzzing.make_cases(seed + round_, CI_CASES, tmp_path / f"round{round_}", seeds,
                                   first_id=len(all_cases))
        if not round_:
            cases += fuzzing.control_cases(tmp_path / "controls", seeds, first_id=len(cases))
        done = _run_workers(cases, tmp_path)
        failures += _check(cases, done)
        all_cases += cases
        results.update(done)
        round_ += 1
        if not minutes or time.monotonic() > deadline:
            break
    summary = _summary(all_cases, results)
    print(f"\nfuzz: {len(all_cases)} case(s) in {round_} round(s) from seed {seed}\n{summary}")  # pytest -s shows it
    assert not failures, (f"{len(failures)} of {len(all_cases)} cases broke the error contract:\n"
                          + "\n".join(failures) + "\n" + summary)


def test_the_contract_check_flags_each_kind_of_breach():
    """The harness is no rubber stamp: each way a run can break the contract is named."""
    case = fuzzing.Case(0, "checkpoint", "float.pt", "test", "/nowhere",
                        [["inspect", "f.pt"], ["compare", "a.pt", "f.pt", "--out", "o"]])
    clean = {"code": 2, "stderr": "error: x\nhint: y", "error_line": True, "traceback": False, "internal": "",
             "new": []}
    assert fuzzing.violations(case, [dict(clean, code=1), clean]) == []  # inspect: 1 is a failed check
    breaches = {
        "compare: exit 1": dict(clean, code=1),  # compare has no check to fail
        "compare: exit 'timeout'": dict(clean, code="timeout"),
        "compare: error: internal error: KeyError": dict(clean, internal="error: internal error: KeyError"),
        "compare: left o behind after exit 2": dict(clean, new=["o"]),
        "compare: exit 2 without an error: line": dict(clean, error_line=False),
    }
    for expected, run in breaches.items():
        assert expected in fuzzing.violations(case, [clean, run]), expected
    rerun = dict(clean, with_out=dict(clean, new=[".o.qdebug-1.partial"]))  # the run again with --out
    assert fuzzing.violations(case, [clean, rerun]) == ["compare: left .o.qdebug-1.partial behind after exit 2"]
    control = fuzzing.Case(1, "plan", "plan.toml", "none", "/nowhere", [["calibrate", "f.pt"]], control=True)
    assert fuzzing.violations(control, [clean])[0].startswith("calibrate: the unchanged seed failed: exit 2")


# -- what the fuzz found (each fails before its fix) ------------------------------------------------
@pytest.mark.parametrize("source, backend, key, fragment", [
    # QAT: the FakeQuantize's check against its observer's range (qdebug/interop/state_dict.py)
    ("ao-eager-qat-x86.pt", "x86", "conv1.activation_post_process.activation_post_process",
     "conv1.activation_post_process holds an observed range whose min is above its max"),
    ("ao-eager-qat-x86.pt", "x86", "layer1.0.conv1.weight_fake_quant.activation_post_process",  # per channel
     "layer1.0.conv1.weight_fake_quant holds an observed range whose min is above its max"),
    # PTQ: an observer's scale computed from its range (qdebug/interop/source.py)
    ("ao-eager-ptq-qnnpack.pt", "qnnpack", "layer2.0.conv1.activation_post_process",
     "the observer layer2.0.conv1.activation_post_process gives no scale from its range"),
])
def test_a_torch_ao_observed_range_with_min_above_max_is_one_error(cli, seeds, tmp_path, source, backend, key,
                                                                   fragment):
    """torch's observer asserts on such a range (an AssertionError: an internal error before)."""
    import torch

    state = torch.load(seeds / source, weights_only=True)
    state[f"{key}.min_val"] = state[f"{key}.max_val"] + 1
    torch.save(state, tmp_path / "swapped.pt")
    result = cli("import", "swapped.pt", "--from", "torch-ao", "--model", fuzzing.TINY_MODEL, "--model-kwargs",
                 json.dumps(fuzzing.TINY_KWARGS), "--data", seeds / "data-tuple.pt", "--backend", backend, "-o", "q.pt")
    result.assert_error(fragment)
    assert not (tmp_path / "q.pt").exists()
