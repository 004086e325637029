"""Damaged and crafted copies of the demo files never break the error contract (tests/fuzzing.py).

CI runs a fixed, seeded set of cases (under a minute).  A longer run, new seeds until the
time is up:

    python -m pytest tests/test_fuzz.py --fuzz-minutes 10 [--fuzz-seed 7]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import fuzzing

CI_CASES = 48
CI_SEED = 20261203
CASES_PER_ROUND = 48


def _run_worker(cases: list, tmp_path: Path) -> dict[int, list[dict]]:
    """Each case's runs; a case that kills the worker (a crash, the address-space limit) is
    recorded as such and the worker restarts after it."""
    results: dict[int, list[dict]] = {}
    pending = list(cases)
    while pending:
        cases_file = tmp_path / f"cases{pending[0].id}.json"
        cases_file.write_text(fuzzing.as_json(pending))
        budget = fuzzing.CASE_SECONDS * 2 * len(pending) + 60
        proc = subprocess.run([sys.executable, str(Path(fuzzing.__file__)), "--worker", str(cases_file)],
                              capture_output=True, text=True, timeout=budget, cwd=fuzzing.REPO)
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                done = json.loads(line)
                results[done["id"]] = done["runs"]
        finished = [c for c in pending if c.id in results]
        pending = [c for c in pending if c.id not in results]
        if pending:  # the worker died on pending[0]
            dead = pending.pop(0)
            tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            results[dead.id] = [{"code": f"worker died ({tail[0]})", "stderr": proc.stderr[-2000:]}]
        elif not finished:
            break
    return results


def _check(cases: list, results: dict[int, list[dict]]) -> list[str]:
    failures = []
    for case in cases:
        runs = results.get(case.id)
        if runs is None:
            failures.append(f"case {case.id} ({case.source}: {case.mutation}): no result")
            continue
        for problem in fuzzing.violations(case, runs) if len(runs) == len(case.argv) else [runs[0]["code"]]:
            failures.append(f"case {case.id} ({case.source}: {case.mutation}): {problem}")
    return failures


def test_damaged_and_crafted_demo_files_get_a_clean_answer(tmp_path, request):
    minutes = request.config.getoption("--fuzz-minutes")
    seed = request.config.getoption("--fuzz-seed") or CI_SEED
    deadline = time.monotonic() + 60 * minutes
    failures, total, round_ = [], 0, 0
    while True:
        count = CI_CASES if not minutes else CASES_PER_ROUND
        cases = fuzzing.make_cases(seed + round_, count, tmp_path / f"round{round_}", first_id=total)
        failures += _check(cases, _run_worker(cases, tmp_path))
        total += len(cases)
        round_ += 1
        if not minutes or time.monotonic() > deadline:
            break
    assert not failures, f"{len(failures)} of {total} cases broke the error contract:\n" + "\n".join(failures)
