"""No hang, no runaway, from any file (issue 27, item 4; docs/cli.md "Where outputs go, safely"
and "Data", docs/checkpoints.md "What is refused").

- A named pipe as an output (``-o``, ``--junit``, a file of ``--out DIR``, ``qdebug.save``'s
  path) or as ``--config`` is an error at once: each case runs ``python -m qdebug`` in a
  subprocess with a timeout, so a regression (open() waiting for a reader) fails, not hangs.
- A small data file that describes huge data (an expanded view, one tensor listed 20,000
  times, 100,001 batches) is refused before any batch is made: run in a subprocess limited to
  3 GiB of address space and a minute, as tests/test_hostile_checkpoints.py runs its
  allocation cases.
- ``sample_inputs`` is cut in bytes as well as in rows.
- Checks that were quadratic are linear: a plan of 200,000 calls, ``qdebug init`` on a
  pyproject.toml with a 12,000-line array -- each under a time limit (SIGALRM) far below what
  the quadratic code took (minutes).
"""

from __future__ import annotations

import contextlib
import copy
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import qdebug
from qdebug.checkpoint import SAMPLE_BYTES, SAMPLE_LIMIT

REPO = Path(__file__).resolve().parent.parent
ADDRESS_SPACE = 3 << 30  # bytes a runaway case may use before it fails cleanly
PIPE_SECONDS = 20  # a refused pipe is an error in a few seconds; open() on one would wait forever
RUNAWAY_SECONDS = 60

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")


def _qdebug(*args: Any, cwd: Path, timeout: float, limit_memory: bool = False) -> subprocess.CompletedProcess:
    """``python -m qdebug ARGS`` in ``cwd``, killed after ``timeout`` seconds (the test then fails)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "qdebug", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env, preexec_fn=limit if limit_memory else None)


def _assert_clean(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("config: ")]
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert lines and lines[0].startswith("error: ") and len(lines) <= 2, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, (fragment, proc.stderr)


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Fail the test (TimeoutError) when the block runs past ``seconds``."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: quadratic again?")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- named pipes: refused before any work, never opened ---------------------------------------
def _pipe(path: Path) -> Path:
    os.mkfifo(path)
    return path


def test_a_pipe_as_checkpoint_output_is_refused_at_once(stages, tmp_path):
    _pipe(tmp_path / "pipe.pt")
    proc = _qdebug("convert", stages.qat, "-o", "pipe.pt", cwd=tmp_path, timeout=PIPE_SECONDS)
    _assert_clean(proc, "cannot write pipe.pt: it is a named pipe (FIFO)")


def test_a_pipe_as_junit_output_is_refused_at_once(stages, tmp_path):
    proc = _qdebug("baseline", stages.float, stages.qat, "--data", stages.data, "--junit",
                   _pipe(tmp_path / "junit.xml"), cwd=tmp_path, timeout=PIPE_SECONDS)
    _assert_clean(proc, "junit.xml: it is a named pipe (FIFO)")


def test_a_pipe_among_the_files_of_out_dir_is_refused_before_the_work(stages, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _pipe(out / "compare.json")
    proc = _qdebug("compare", stages.float, stages.qat, "--data", stages.data, "--out", out,
                   cwd=tmp_path, timeout=PIPE_SECONDS)
    _assert_clean(proc, "compare.json there is a named pipe (FIFO)")


def test_a_pipe_as_config_is_refused_at_once(stages, tmp_path):
    proc = _qdebug("--config", _pipe(tmp_path / "qdebug.toml"), "inspect", stages.qat, cwd=tmp_path,
                   timeout=PIPE_SECONDS)
    _assert_clean(proc, "qdebug.toml: it is a named pipe (FIFO), not a regular file")


def test_a_pipe_as_the_config_init_writes_is_refused_at_once(tmp_path):
    proc = _qdebug("--config", _pipe(tmp_path / "qdebug.toml"), "init", "--trust", "mypkg", cwd=tmp_path,
                   timeout=PIPE_SECONDS)
    _assert_clean(proc, "cannot write", "named pipe (FIFO)")


def test_save_to_a_pipe_is_refused_at_once(tmp_path):
    pipe = _pipe(tmp_path / "model.pt")
    code = ("import torch, qdebug\n"
            "try:\n"
            f"    qdebug.save(torch.nn.Linear(2, 2), {str(pipe)!r})\n"
            "except qdebug.QDebugError as exc:\n"
            "    print(exc.message)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=PIPE_SECONDS,
                          cwd=REPO)
    assert "it is a named pipe (FIFO)" in proc.stdout, (proc.stdout, proc.stderr)


def test_a_pipe_as_qconfig_is_refused_at_once(stages, cli, tmp_path):
    _pipe(tmp_path / "qconfig.toml")
    with time_limit(PIPE_SECONDS):  # SIGALRM interrupts an open() that waits for a writer
        cli("calibrate", stages.float, "--qconfig", "qconfig.toml", "--data", stages.data, "-o", "cal.pt").assert_error(
            "qconfig.toml: it is a named pipe (FIFO), not a regular file")


def test_a_pipe_named_like_a_config_on_the_way_up_is_never_opened(stages, cli, tmp_path):
    _pipe(tmp_path / "qdebug.toml")
    _pipe(tmp_path / "pyproject.toml")
    with time_limit(PIPE_SECONDS):
        result = cli("inspect", stages.qat, "--format", "json")
    assert result.code == 0, result.err


def test_a_pipe_in_out_dir_under_another_name_is_left_alone(stages, cli, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _pipe(out / "progress")  # no file a command writes: never opened
    cli("inspect", stages.qat, "--out", out, "--format", "json")
    assert (out / "inspect.json").is_file()


# -- data files that describe more than they hold ---------------------------------------------
def _data(tmp_path: Path, obj: Any, name: str = "data.pt") -> Path:
    path = tmp_path / name
    torch.save(obj, path)
    return path


RUNAWAY_DATA = {
    # 2 KB describing 10**12 samples of the demo model's 1x16x16 input
    "an expanded dataset": (lambda: torch.zeros(1, 1, 16, 16).expand(10**12, 1, 16, 16), (),
                            ("the input tensor is an expanded view",)),
    # 44 KB: one expanded tensor listed 20,000 times
    "a list of one expanded batch": (lambda: [torch.zeros(1, 1, 1, 1).expand(64, 1, 16, 16)] * 20_000, (),
                                     ("batch 0's input is an expanded view",)),
    # 110 KB: one real batch listed 20,000 times (1.2 GiB of batches)
    "a list of one batch, again and again": (lambda: [torch.zeros(64, 1, 16, 16)] * 20_000, (),
                                             ("it lists the same tensors again and again",)),
    # 100,001 one-sample batches: past the cap on batches
    "too many batches": (lambda: {"inputs": torch.zeros(100_001, 1, 1, 1, dtype=torch.uint8), "input_scale": 1.0},
                         ("--batch-size", "1"),
                         ("is cut into 100001 batches of 1", "reads at most 100000 batches")),
}


@pytest.mark.parametrize("make, extra, fragments", RUNAWAY_DATA.values(), ids=list(RUNAWAY_DATA))
def test_a_data_file_describing_huge_data_is_refused_at_once(stages, tmp_path, make, extra, fragments):
    data = _data(tmp_path, make())
    proc = _qdebug("compare", stages.float, stages.qat, "--data", data, *extra, cwd=tmp_path,
                   timeout=RUNAWAY_SECONDS, limit_memory=True)
    _assert_clean(proc, *fragments)


def test_a_file_of_many_batches_is_read_with_batches(tmp_path):
    from qdebug.data.spec import load_batches

    data = _data(tmp_path, torch.zeros(100_001, 1, 16, 16, dtype=torch.uint8))
    assert load_batches(str(data), batch_size=1, batches=3).count == 3


def test_one_batch_past_the_byte_cap_is_refused_before_it_is_made(stages, cli, tmp_path, monkeypatch):
    import qdebug.data.limits

    monkeypatch.setattr(qdebug.data.limits, "MAX_BATCH_BYTES", 1 << 20)
    data = _data(tmp_path, {"inputs": torch.zeros(64, 1, 64, 65, dtype=torch.uint8), "input_scale": 0.5})
    cli("compare", stages.float, stages.qat, "--data", data).assert_error(  # 64 x 4160 x 4 bytes decoded
        "data.pt: batch 0 is", "over the 0.000977 GiB one batch may hold", "smaller --batch-size")
    assert cli("compare", stages.float, stages.qat, "--data", data, "--batch-size", "32",
               "--format", "json").code == 0


def test_a_shared_small_tensor_in_every_batch_is_fine(stages, cli, tmp_path):
    target = torch.zeros(4, dtype=torch.long)  # listed in every batch: within the margin
    data = _data(tmp_path, [(torch.randn(4, 1, 16, 16), target) for _ in range(20)])
    assert cli("compare", stages.float, stages.qat, "--data", data, "--format", "json").code == 0


# -- sample_inputs: cut in bytes, not only rows -----------------------------------------------
def _with_samples(stages, tmp_path: Path, samples: Any) -> Path:
    ckpt = copy.deepcopy(torch.load(stages.qat, map_location="cpu", weights_only=True))
    ckpt["sample_inputs"] = samples
    return _data(tmp_path, ckpt, "samples.pt")


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return sum(_nbytes(x) for x in (obj.values() if isinstance(obj, dict) else obj))


def test_sample_inputs_listing_one_large_tensor_are_cut_in_bytes(stages, tmp_path):
    big = torch.randn(1, 1, 1024, 1024)  # 4 MiB, listed 64 times: 256 MiB of samples from 4 MiB
    _, info = qdebug.load(_with_samples(stages, tmp_path, [big] * 64))
    assert _nbytes(info.sample_inputs) <= SAMPLE_BYTES
    assert len(info.sample_inputs) == SAMPLE_BYTES // _nbytes(big)


def test_sample_inputs_of_empty_batches_are_cut_too(stages, tmp_path):
    _, info = qdebug.load(_with_samples(stages, tmp_path, [torch.zeros(0, 1, 16, 16)] * 10_000))
    assert len(info.sample_inputs) <= SAMPLE_LIMIT


def test_one_large_sample_batch_keeps_the_rows_that_fit(stages, tmp_path):
    rows = torch.randn(64, 1, 512, 512)  # 64 MiB: fits exactly; one row more would not
    _, info = qdebug.load(_with_samples(stages, tmp_path, torch.cat([rows, rows[:1]])))
    assert info.sample_inputs.shape[0] == 64


# -- quadratic checks made linear -------------------------------------------------------------
def test_a_plan_of_200000_calls_is_checked_in_linear_time(stages):
    from qdebug.checkpoint import _check_plan

    net, info = qdebug.load(stages.float)
    plan = copy.deepcopy(torch.load(stages.qat, map_location="cpu", weights_only=True)["plan"])
    plan["calls"] += [{"name": f"x{i}", "category": "add", "op": "add", "owner": "", "is_module": False,
                       "inputs": [f"x{i - 1}" if i else ""], "consumers": [f"x{i + 1}"], "point": None,
                       "output_point": None, "fused_into": f"x{i + 1}" if i + 1 < 200_000 else None,
                       "fused_activation": None} for i in range(200_000)]
    start = time.monotonic()
    with time_limit(20):  # the quadratic check took hours here
        _check_plan(plan, net, info.model, "plan.pt")
    assert time.monotonic() - start < 20


def test_init_edits_a_pyproject_with_a_12000_line_array_in_linear_time(cli, tmp_path):
    lines = ["[project]", 'name = "x"', "dependencies = [", *(f'  "pkg{i}",' for i in range(12_000)), "]", "",
             "[tool.qdebug]", 'metric = "top1"', ""]
    (tmp_path / "pyproject.toml").write_text("\n".join(lines))
    with time_limit(20):  # over 300 s when every line re-parsed the array so far
        result = cli("init", "--trust", "mypkg", "--format", "json")
    assert result.code == 0, result.err
    import tomllib

    written = tomllib.loads((tmp_path / "pyproject.toml").read_text())
    assert written["tool"]["qdebug"]["trust"] == ["mypkg"]
    assert len(written["project"]["dependencies"]) == 12_000
