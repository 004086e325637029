"""All or nothing, whatever the signal (issue 27, must-have 6).

- SIGTERM ends a run as Ctrl-C does: its staging folder and temp files removed, exit 143 and
  ``error: terminated`` (``qdebug.cli.interrupts``);
- a command with two outputs (``-o`` or ``--junit``, and ``--out``) writes both or neither
  (``qdebug.io.together``);
- what a SIGKILL left (``.DIR.qdebug-*.partial``, ``.x.pt.*.tmp``) is removed by the next run
  into the same place, and only that: a live run's are locked (``qdebug.io.leftovers``).

The signal tests run the real command line in a subprocess, paused at a chosen point by a seam
(a function of qdebug replaced by one that marks a file and sleeps), so the signal lands where
the test wants it on a slow machine too: the test polls for the mark, never sleeps a fixed time.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

_PAUSED_AT = """
import os, sys, time
import importlib
module, _, attr = sys.argv.pop(1).partition(":")
owner = importlib.import_module(module)
if "." in attr:
    owner_name, attr = attr.split(".")
    owner = getattr(owner, owner_name)
original = getattr(owner, attr)
def paused(*args, **kwargs):
    open(os.environ["PAUSED_MARK"], "w").close()
    time.sleep(120)
    return original(*args, **kwargs)
setattr(owner, attr, paused)
sys.argv[0] = "qdebug"
from qdebug.cli import main
main()
"""


def _start_paused(tmp_path: Path, seam: str, *args) -> tuple[subprocess.Popen, Path]:
    """``qdebug ARGS`` in a subprocess (the console script's path: ``main()``), paused in ``seam``."""
    mark = tmp_path / "paused.mark"
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env.update(PYTHONPATH=str(REPO), PAUSED_MARK=str(mark))
    proc = subprocess.Popen([sys.executable, "-c", _PAUSED_AT, seam, *map(str, args)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not mark.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the run never reached {seam}: {proc.returncode}\n{out}\n{err}")
        time.sleep(0.02)
    return proc, mark


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and p.name != ".paused.mark")


def _assert_terminated(proc: subprocess.Popen) -> None:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, (proc.returncode, err)
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "error: terminated", err


def test_sigterm_while_the_out_folder_is_staged_ends_143_and_changes_nothing(stages, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "inspect.json").write_text("old\n")
    proc, _ = _start_paused(tmp_path, "qdebug.io.staged:StagedDir.commit", "inspect", stages.qat, "--out", "out")
    assert len(_hidden(tmp_path / "out")) == 1  # the staging folder, full, waiting for its commit
    proc.send_signal(signal.SIGTERM)
    _assert_terminated(proc)
    assert os.listdir(tmp_path / "out") == ["inspect.json"]  # no staging folder, no new file
    assert (tmp_path / "out" / "inspect.json").read_text() == "old\n"


def test_sigterm_while_a_checkpoint_is_written_leaves_no_temp_file(stages, tmp_path):
    proc, _ = _start_paused(tmp_path, "qdebug.io.atomic:mode_for", "convert", stages.qat, "-o", "q.pt")
    assert [n for n in _hidden(tmp_path) if n.startswith(".q.pt.")]  # the temp file, written
    proc.send_signal(signal.SIGTERM)
    _assert_terminated(proc)
    assert not (tmp_path / "q.pt").exists() and _hidden(tmp_path) == []


_SIGTERM_IN_TORCH_IMPORT = """
import os, signal, sys, threading, traceback
from qdebug.cli.interrupts import Terminated, hold_interrupts_during_torch_import, raise_on_sigterm
raise_on_sigterm()
hold_interrupts_during_torch_import()
threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
try:
    import torch
except Terminated:
    frames = [frame.filename for frame in traceback.extract_tb(sys.exc_info()[2])]
    print("INSIDE TORCH" if any("/torch/" in name for name in frames) else "AFTER TORCH", *frames)
"""


def test_sigterm_inside_torch_import_waits_for_the_import_to_end():
    """As Ctrl-C (tests/test_platform.py): raised inside torch's C++ callbacks it would abort the
    process (SIGABRT); it is held back and raised by qdebug's loader once the import is over."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _SIGTERM_IN_TORCH_IMPORT], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("AFTER TORCH") and "qdebug/cli/interrupts.py" in proc.stdout, proc.stdout


def test_what_a_sigkill_left_is_removed_by_the_next_run_into_the_same_place(cli, stages, tmp_path):
    proc, _ = _start_paused(tmp_path, "qdebug.io.staged:StagedDir.commit", "inspect", stages.qat, "--out", "out")
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    (left,) = [n for n in _hidden(tmp_path) if n.startswith(".out.qdebug-")]  # no cleanup can run on SIGKILL
    assert cli("inspect", stages.qat, "--out", "out").code == 0
    assert _hidden(tmp_path) == [] and (tmp_path / "out" / "inspect.json").exists()


def _leftover(folder: Path, name: str, *, live: bool) -> tuple[Path, int | None]:
    """A leftover of a run: a killed one's (no lock), or a live one's (locked, as a running run holds it)."""
    path = folder / name
    if name.endswith(".partial"):
        path.mkdir()
        (path / "compare.json").write_text("half\n")
    else:
        path.write_bytes(b"half")
    if not live:
        return path, None
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return path, fd


def test_only_stale_leftovers_are_removed_a_live_runs_stay(cli, stages, tmp_path):
    (tmp_path / "out").mkdir()
    stale = [_leftover(tmp_path, ".out.qdebug-a1b2c3d4.partial", live=False)[0],
             _leftover(tmp_path / "out", ".out.qdebug-e5f6g7h8.partial", live=False)[0],
             _leftover(tmp_path, ".cal.pt.abcd1234.tmp", live=False)[0]]
    live = [_leftover(tmp_path, ".out.qdebug-livelive.partial", live=True),
            _leftover(tmp_path / "out", ".out.qdebug-liveone_.partial", live=True),
            _leftover(tmp_path, ".cal.pt.live1234.tmp", live=True)]
    # killed while naming one (between its creation and its lock): removed once a minute old, not before
    unnamed_old = _leftover(tmp_path, ".cal.pt.oldnew12.new", live=False)[0]
    os.utime(unnamed_old, (time.time() - 120, time.time() - 120))
    stale.append(unnamed_old)
    unnamed_now = _leftover(tmp_path, ".out.qdebug-newnew12.new", live=False)[0]
    others = [tmp_path / ".cal.pt.keep", tmp_path / ".other.pt.abcd1234.tmp", unnamed_now]  # not stale or not ours
    for path in others[:2]:
        path.write_text("mine\n")
    try:
        assert cli("calibrate", stages.float, "--data", stages.data, "-o", "cal.pt", "--out", "out").code == 0
        assert not any(p.exists() for p in stale)
        assert all(path.exists() for path, _ in live) and all(p.exists() for p in others)
    finally:
        for _, fd in live:
            os.close(fd)
    assert (tmp_path / "cal.pt").exists() and (tmp_path / "out" / "calibrate.json").exists()


# -- two outputs: both or neither -----------------------------------------------------------
def _blocked_out(tmp_path: Path, command: str) -> None:
    """An --out folder whose commit fails after the work: its <command>.json is a directory."""
    (tmp_path / "out" / f"{command}.json").mkdir(parents=True)


def test_junit_and_out_are_written_both_or_neither(cli, stages, tmp_path):
    (tmp_path / "j.xml").write_text("old junit\n")
    _blocked_out(tmp_path, "baseline")
    result = cli("baseline", stages.float, stages.quantized, "--data", stages.data, "--metric", "top1",
                 "--junit", "j.xml", "--out", "out")
    result.assert_error("cannot write out/baseline.json: it is a directory")
    assert (tmp_path / "j.xml").read_text() == "old junit\n"  # the out folder failed: the old report stays
    assert _hidden(tmp_path) == [] and os.listdir(tmp_path / "out") == ["baseline.json"]


@pytest.mark.parametrize("existing", [False, True])
def test_a_checkpoint_and_out_are_written_both_or_neither(cli, stages, tmp_path, existing):
    if existing:
        (tmp_path / "cal.pt").write_bytes(b"old checkpoint")
    _blocked_out(tmp_path, "calibrate")
    result = cli("calibrate", stages.float, "--data", stages.data, "-o", "cal.pt", "--out", "out")
    result.assert_error("cannot write out/calibrate.json: it is a directory")
    if existing:
        assert (tmp_path / "cal.pt").read_bytes() == b"old checkpoint"
    else:
        assert not (tmp_path / "cal.pt").exists()
    assert _hidden(tmp_path) == []


def test_a_failing_second_output_leaves_out_unwritten(cli, stages, tmp_path):
    (tmp_path / "out").mkdir()
    result = cli("calibrate", stages.float, "--data", stages.data, "-o", "/dev/full", "--out", "out")
    assert result.code == 2 and "/dev/full" in result.err, result.err
    assert os.listdir(tmp_path / "out") == []


def test_both_outputs_appear_when_the_run_succeeds(cli, stages, tmp_path):
    (tmp_path / "cal.pt").write_bytes(b"old checkpoint")
    assert cli("calibrate", stages.float, "--data", stages.data, "-o", "cal.pt", "--out", "out").code == 0
    assert (tmp_path / "cal.pt").read_bytes() != b"old checkpoint" and (tmp_path / "out" / "calibrate.json").exists()
    assert _hidden(tmp_path) == []


# -- os._exit(0) in a metric: no gate passed in silence --------------------------------------
def test_os_exit_0_in_a_metric_fails_the_gate_with_one_error(stages, tmp_path):
    """Run in a subprocess: in-process, a regression would end pytest itself with exit 0."""
    (tmp_path / "quitter.py").write_text("import os\n\ndef metric(model, batches):\n    os._exit(0)\n")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-m", "qdebug", "baseline", str(stages.float), str(stages.quantized),
                           "--data", str(stages.data), "--metric", "quitter:metric", "--junit", "j.xml"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("error: metric metric called os._exit(0)") and "quitter.py:4" in lines[0], lines
    assert lines[1].startswith("hint: ") and len(lines) == 2 and "Traceback" not in proc.stderr
    assert not (tmp_path / "j.xml").exists()  # no verdict, no report


def test_os_exit_in_a_forked_child_of_a_command_still_exits_the_child():
    import qdebug.cli.early_exit as early

    with early.os_exit_raises():
        pid = os.fork()
        if pid == 0:  # the child: the real os._exit, with its own code
            os._exit(7)
        _, status = os.waitpid(pid, 0)
        with pytest.raises(early.EarlyExit):
            os._exit(0)
    assert os.waitstatus_to_exitcode(status) == 7
    assert not getattr(os._exit, "_qdebug_guard", False)  # put back
