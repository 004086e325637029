"""Data-parallel runs (qdebug.config.distributed): the split, the exact combination, the failures.

The multi-process tests spawn two ranks over gloo (``tests/ranks.py``, torchrun's
environment without torchrun) and hold their results to the single-process run over
the same batches.  Both sides run torch with one thread: float32 block sums depend on
torch's thread count, in one process as across several (docs/scale.md).
"""

from __future__ import annotations

import json
import re
import math
import sys

import pytest
import torch

from qdebug.config.distributed import Group, environment, pack, timeout_seconds, unpack
from qdebug.errors import QDebugError
from qdebug.measure.stats import ErrorStats
from qdebug.tools.metric_replay import MetricRun
from ranks import cli_ranks


# -- pieces, in one process ----------------------------------------------------------------
def test_states_cross_the_transport_exactly():
    state = {("conv", "qat"): (1.5, math.nan, -math.inf, 2**60, "x", None, True, {3, 1}),
             "tensors": [torch.arange(6.0).reshape(2, 3), torch.tensor([True, False]), torch.tensor(0.1, dtype=torch.bfloat16),
                         torch.empty(0, 4, dtype=torch.int64), torch.tensor([2**62], dtype=torch.int64)],
             "nested": {"a": {"b": (torch.tensor([1e-300], dtype=torch.float64),)}}}
    back = unpack(pack(state))
    assert back[("conv", "qat")][0] == 1.5 and math.isnan(back[("conv", "qat")][1])
    assert back[("conv", "qat")][2:] == (-math.inf, 2**60, "x", None, True, {1, 3})
    for a, b in zip(state["tensors"], back["tensors"]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert float(back["nested"]["a"]["b"][0]) == 1e-300


def test_an_object_the_transport_cannot_carry_is_named():
    with pytest.raises(TypeError, match="Generator"):
        pack({"x": torch.Generator()})


def test_one_rank_is_the_single_process_path():
    group = Group()
    state = {"n": 1}
    assert not group.active and group.combine(state, lambda a, b: 1 / 0) is state
    assert group.gather(state) == [state]
    assert list(group.shard(["a", "b", "c"])) == [(0, "a"), (1, "b"), (2, "c")]


def test_the_split_is_strided_over_batches_without_padding():
    batches = list("abcde")
    assert list(Group(rank=0, world=2).shard(batches)) == [(0, "a"), (2, "c"), (4, "e")]
    assert list(Group(rank=1, world=2).shard(batches)) == [(1, "b"), (3, "d")]
    assert list(Group(rank=2, world=3).shard(batches)) == [(2, "c")]
    assert list(Group(rank=5, world=6).shard(batches)) == []  # more ranks than batches: nothing, not a repeat


def test_torchrun_environment_and_timeout_are_checked(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert environment() == (1, 2)
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(QDebugError, match="outside WORLD_SIZE"):
        environment()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(QDebugError, match="not whole numbers"):
        environment()
    monkeypatch.delenv("QDEBUG_DIST_TIMEOUT", raising=False)
    assert timeout_seconds() == 1800 and timeout_seconds(60) == 60
    monkeypatch.setenv("QDEBUG_DIST_TIMEOUT", "-1")
    with pytest.raises(QDebugError, match="QDEBUG_DIST_TIMEOUT"):
        timeout_seconds()


def _pairs(n: int, seed: int = 0, nan: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(3, 5, 4, 4, generator=g) * (1 + i)
        out.append((x, x + 0.1 * torch.randn(x.shape, generator=g)))
    if nan:
        out[2][1][0, 0, 0, 0] = math.nan  # a NaN in one shard is never averaged away
    return out


def test_error_stats_of_two_shards_merge_into_the_stats_of_all_batches():
    pairs = _pairs(5)
    whole = ErrorStats()
    for x, y in pairs:
        whole.update(x, y)
    shards = [ErrorStats(), ErrorStats()]
    for i, (x, y) in enumerate(pairs):
        shards[i % 2].update(x, y)
    merged = ErrorStats.from_state(shards[0].state()).merge(ErrorStats.from_state(shards[1].state()))
    expected, got = whole.result(), merged.result()
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12, nan_ok=True), key
    clean = [ErrorStats(), ErrorStats()]
    for i, (x, y) in enumerate(_pairs(3, seed=1, nan=False)):
        clean[i % 2].update(x, y)
    both = clean[0].merge(clean[1]).result()
    assert math.isfinite(both["sqnr_db"]) and both["channel_range_ratio"] >= 1


def test_metric_runs_of_two_ranks_merge_back_into_data_order():
    ranks = [MetricRun(streaming=True, keep_samples=True) for _ in range(2)]
    scores = [torch.tensor([1.0, 0.0]), torch.tensor([0.0]), torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0.5])]
    for index, value in enumerate(scores):
        ranks[index % 2].add({"top1": value}, index)
        ranks[index % 2].keep_output(torch.full((1,), float(index)), index)
    merged = MetricRun(streaming=True, keep_samples=True)
    merged.absorb(MetricRun.merge(unpack(pack(ranks[0].state())), unpack(pack(ranks[1].state()))))
    assert torch.equal(merged.sample_scores()["top1"], torch.cat(scores).double())
    assert merged.values()["top1"] == pytest.approx(float(torch.cat(scores).mean()))
    assert [float(o) for o in merged.outputs] == [0.0, 1.0, 2.0, 3.0]


# -- two ranks against one process ----------------------------------------------------------
@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rows(text: str) -> list[dict]:
    payload = json.loads(text)
    return payload[next(k for k, v in payload.items() if isinstance(v, list) and v and isinstance(v[0], dict))]


def _same_numbers(a, b, path: str = "") -> None:
    """Equal structures; numbers within 1e-9 relative (float64 summation order), NaN = NaN."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _same_numbers(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same_numbers(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert b == pytest.approx(a, rel=1e-9, abs=1e-12, nan_ok=True), path
    else:
        assert a == b, path


def _without_pass_counts(payload: dict) -> dict:
    """suggest's forward passes (``meta.forwards``, its summary's ``cost:`` line) counted over the
    ranks: compare settles a target's float model on each rank's first batch, one more pass per
    extra rank (the numbers it gives are the same); and the files a ``--out`` run alone wrote."""
    meta = payload.get("meta", {})
    for key in ("forwards", "forwards_by_phase", "files"):  # files: the --out run's plots, one run only
        meta.pop(key, None)
    if isinstance(meta.get("summary"), str):
        meta["summary"] = re.sub(r"cost: \d+ forward pass.*?\(diagnosis[^)]*\)", "cost:", meta["summary"], flags=re.S)  # wrapped
    return payload


def test_two_ranks_give_the_results_of_one_process(stages, cli, tmp_path, one_thread):
    data = ["--data", str(stages.data), "--batch-size", "2"]  # 6 batches: 3 per rank
    commands = {
        "compare": ["compare", stages.float, stages.qat, *data, "--format", "json"],
        "baseline": ["baseline", stages.float, stages.quantized, *data, "--metric", "top1", "--confidence", "0.9",
                     "--ratio", "0.5", "--format", "json"],
        "baseline_whole_set": ["baseline", stages.float, stages.quantized, *data, "--metric", "agreement",
                               "--ratio", "0.5", "--format", "json"],
        "step_whole_set": ["step", stages.float, stages.qat, *data, "--metric", "agreement", "--format", "json"],
        "suggest": ["suggest", stages.float, stages.qat, *data, "--metric", "top1", "--ratio", "0.99",
                    "--format", "json"],
    }
    commands = {name: [str(a) for a in argv] for name, argv in commands.items()}
    calibrate = ["calibrate", str(stages.float), *data, "--observer", "kl", "--per-channel", "--format", "json", "-o"]
    with_out = {name: argv + (["--out", "ranked"] if name == "compare" else []) for name, argv in commands.items()}
    ranked = cli_ranks(*with_out.values(), calibrate + [str(tmp_path / "ranks.pt")], cwd=str(tmp_path))
    written = sorted(p.name for p in (tmp_path / "ranked").iterdir())
    assert "compare.json" in written and "compare.csv" in written  # rank 0 wrote the --out folder, whole
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # nothing staged is left
    for (name, argv), per_rank in zip(commands.items(), ranked):
        single = cli(*argv)
        assert single.code in (0, 1), single.err  # 1: a gate that fails fails on every rank too
        (code0, out0, err0), (code1, out1, err1) = per_rank
        assert (code0, code1) == (single.code, single.code), (name, err0, err1)
        assert out1 == "" and err1 == ""  # rank 0 alone prints (and writes)
        _same_numbers(_without_pass_counts(json.loads(single.out)), _without_pass_counts(json.loads(out0)), name)
    (code0, _, err0), (code1, _, _) = ranked[-1]
    assert (code0, code1) == (0, 0), err0
    assert cli(*calibrate, tmp_path / "one.pt").code == 0
    one, two = (torch.load(tmp_path / name, weights_only=True) for name in ("one.pt", "ranks.pt"))
    assert one["state"].keys() == two["state"].keys()
    for key, value in one["state"].items():
        assert torch.equal(value, two["state"][key]), key  # every rank froze the very same scales


def write_data(root, name: str) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    (root / name / "data.py").write_text(DATA)


DATA = """\
import os
import time

import torch


def batches():
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        x = torch.randn(2, 1, 16, 16, generator=g)
        if i == 1 and os.environ.get("RANK") == "1":
            if os.environ.get("FAIL") == "raise":
                raise ValueError("batch 1 is unreadable")
            time.sleep(float(os.environ["FAIL"]))
        yield x, torch.zeros(2, dtype=torch.long)
"""


def test_a_failing_rank_fails_every_rank_with_the_same_error(stages, tmp_path):
    write_data(tmp_path, "faulty")
    compare = ["compare", str(stages.float), str(stages.qat), "--data", "faulty.data:batches", "--out", "out"]
    ema = ["calibrate", str(stages.float), "--data", str(stages.data), "--observer", "ema", "-o", "cal.pt"]
    ranked = cli_ranks(compare, ema, cwd=str(tmp_path), env={"FAIL": "raise"})
    for per_rank, words in zip(ranked, (["rank 1: data function faulty.data:batches raised ValueError",
                                         "batch 1 is unreadable"], ["ema observer cannot be calibrated"])):
        assert [code for code, _, _ in per_rank] == [2, 2]  # the same error on every rank
        assert per_rank[1][1:] == ("", "")  # said once, by rank 0, not once per rank
        code, out, err = per_rank[0]
        assert out == "" and "Traceback" not in err
        lines = err.strip().splitlines()
        assert lines[0].startswith("error: ") and lines[1].startswith("hint: ") and len(lines) == 2, err
        assert all(w in err for w in words), err
    assert not (tmp_path / "out").exists() and not (tmp_path / "cal.pt").exists()


def test_a_rank_that_hangs_ends_in_a_timeout_not_a_hang(stages, tmp_path):
    write_data(tmp_path, "slow")
    compare = ["compare", str(stages.float), str(stages.qat), "--data", "slow.data:batches"]
    (per_rank,) = cli_ranks(compare, cwd=str(tmp_path), env={"FAIL": "6", "QDEBUG_DIST_TIMEOUT": "2"})
    (code0, _, err0), (code1, _, err1) = per_rank
    assert code0 == 2 and "did not answer within 2 s" in err0 and "QDEBUG_DIST_TIMEOUT" in err0, err0
    assert code1 == 2 and "Traceback" not in err1, err1


def test_cuda_under_torchrun_is_each_ranks_own_gpu(monkeypatch):
    from qdebug.config.device import _rank_gpu

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert _rank_gpu("cuda") == "cuda:3" and _rank_gpu("cuda:1") == "cuda:1" and _rank_gpu("cpu") == "cpu"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _rank_gpu("cuda") == "cuda"


# -- python -m qdebug.launch: torchrun with qdebug's exit codes ------------------------------
def test_the_launcher_gives_one_process_exit_codes():
    from qdebug.cli.launch import exit_code

    assert exit_code([0, 0]) == 0
    assert exit_code([1, 1]) == 1 and exit_code([0, 1]) == 1  # a failed check
    assert exit_code([2, -15]) == 2 and exit_code([143, 2]) == 2 and exit_code([1, 2]) == 2  # an input error wins
    assert exit_code([-15, 0]) == 143 and exit_code([-9]) == 137  # killed: what a shell reports


def _processes_with(marker: str) -> list[int]:
    """The pids of the processes whose environment holds ``marker`` (a /proc scan: no psutil)."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if marker.encode() in fh.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_hung_rank_under_the_launcher_ends_2_with_one_error_and_no_orphans(stages, tmp_path):
    """Rank 1 hangs in its data: rank 0's exchange times out (exit 2, one error, no torchrun
    traceback), torchrun's agent stops rank 1, and no worker outlives the launcher."""
    import os
    import subprocess
    import time
    import uuid
    from pathlib import Path

    write_data(tmp_path, "hung")
    marker = f"QDEBUG_TEST_RUN={uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parent.parent), FAIL="600", QDEBUG_DIST_TIMEOUT="3",
               OMP_NUM_THREADS="1", QDEBUG_TEST_RUN=marker.split("=", 1)[1])
    proc = subprocess.run([sys.executable, "-m", "qdebug.launch", "--nproc-per-node", "2", "compare",
                           str(stages.float), str(stages.qat), "--data", "hung.data:batches"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "did not answer within 3 s" in errors[0], proc.stderr
    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker) == []
