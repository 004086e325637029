"""Hostile output targets and faults (docs/cli.md, "Output"): ``-o``/``--junit``/``--out`` never
replace what is not a regular file, follow links by the documented rule, and a write the file
system refuses (a full device, a full disk, a file-size limit) is one clean error that leaves
the old output as it was; ``--out DIR`` appears all at once, or not at all."""

from __future__ import annotations

import hashlib
import os
import resource
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import qdebug
from qdebug.io.atomic import atomic_path
from qdebug.io.filesystem import WriteError
from qdebug.io.staged import StagedDir
from qdebug.errors import QDebugError

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "fixtures" / "demo"


# -- helpers ---------------------------------------------------------------------------------
def _limit_file_size(nbytes: int) -> None:
    """In the child: files may not grow past ``nbytes`` (a full disk, reproducibly); the write fails
    with EFBIG instead of the process dying of SIGXFSZ."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


def _command(*args) -> list[str]:
    return [sys.executable, "-m", "qdebug", *map(str, args)]


def _env() -> dict:
    return {**{k: v for k, v in os.environ.items() if k != "COLUMNS"}, "PYTHONPATH": str(REPO)}


def _qdebug(*args, cwd: Path, file_limit: int | None = None) -> subprocess.CompletedProcess:
    limit = (lambda: _limit_file_size(file_limit)) if file_limit else None
    return subprocess.run(_command(*args), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300,
                          preexec_fn=limit)


def _assert_clean_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit 2 with one ``error:`` line and a hint: no traceback, no internal error."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    assert lines[-2].startswith("error: ") and lines[-1].startswith("hint: "), proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, (fragment, proc.stderr)


def _contents(folder: Path) -> dict[str, str]:
    """Every entry of ``folder`` (hidden ones too) with a hash of its bytes."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
            for p in sorted(folder.iterdir())}


@pytest.fixture
def device_copy(tmp_path):
    """``device_copy(source, name)``: a character device node in tmp_path with ``source``'s device
    number (a copy of /dev/full or /dev/null), so no test can harm the real one."""
    def make(source: str, name: str) -> Path:
        node = tmp_path / name
        if not hasattr(os, "mknod") or not os.path.exists(source):
            pytest.skip(f"no {source} or os.mknod on this platform")
        try:
            os.mknod(node, stat.S_IFCHR | 0o666, os.stat(source).st_rdev)
            with open(node, "wb"):
                pass
        except OSError as exc:
            pytest.skip(f"cannot create and open a copy of {source} here ({exc.strerror}): needs root")
        return node

    return make


def _is_char_device(path: Path) -> bool:
    return stat.S_ISCHR(os.lstat(path).st_mode)


# -- devices ---------------------------------------------------------------------------------
def test_a_checkpoint_to_a_full_device_is_a_clean_error_and_the_node_stays(cli, stages, device_copy):
    full = device_copy("/dev/full", "full")
    cli("convert", stages.qat, "-o", "full").assert_error("cannot write full")
    assert _is_char_device(full)


def test_junit_to_a_full_device_is_a_clean_error_and_the_node_stays(cli, device_copy):
    full = device_copy("/dev/full", "full")
    cli("baseline", "--float-metric", "0.8", "--quant-metric", "0.8", "--junit", "full").assert_error(
        "cannot write full: No space left on device")
    assert _is_char_device(full)


def test_outputs_to_a_null_device_are_written_through(cli, stages, device_copy):
    null = device_copy("/dev/null", "null")
    result = cli("convert", stages.qat, "-o", "null")
    assert result.code == 0, result.err
    result = cli("baseline", "--float-metric", "0.8", "--quant-metric", "0.8", "--junit", "null")
    assert result.code == 0, result.err
    assert _is_char_device(null) and sorted(os.listdir(null.parent)) == ["null"]  # no temp file either


# -- symbolic links --------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["-o", "--junit"])
def test_a_link_to_a_file_is_followed_the_file_replaced_and_the_link_kept(cli, stages, tmp_path, option):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "file"
    target.write_bytes(b"old")
    (tmp_path / "link").symlink_to(target)
    args = ("convert", stages.qat) if option == "-o" else ("baseline", "--float-metric", "0.8", "--quant-metric", "0.8")
    result = cli(*args, option, "link")
    assert result.code == 0, result.err
    assert (tmp_path / "link").is_symlink() and os.readlink(tmp_path / "link") == str(target)
    assert target.read_bytes() != b"old" and os.listdir(tmp_path / "real") == ["file"]
    if option == "-o":
        assert qdebug.load(tmp_path / "link")[1].stage == "quantized"
    else:
        assert target.read_text().startswith("<?xml")


@pytest.mark.parametrize("points_to", ["nowhere.pt", "loop"])
def test_a_dangling_or_looping_link_is_refused_before_the_work(cli, stages, tmp_path, points_to):
    (tmp_path / "link.pt").symlink_to(points_to)
    if points_to == "loop":
        (tmp_path / "loop").symlink_to("link.pt")
    cli("convert", stages.qat, "-o", "link.pt").assert_error(
        "cannot write link.pt: it is a symbolic link", "does not exist" if points_to == "nowhere.pt" else "loops")
    assert sorted(os.listdir(tmp_path)) == sorted(["link.pt"] + (["loop"] if points_to == "loop" else []))


def test_out_through_a_link_fills_the_folder_it_points_to(cli, stages, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    assert cli("inspect", stages.qat, "--out", "link").code == 0
    assert (tmp_path / "link").is_symlink()
    assert sorted(os.listdir(tmp_path / "real")) == ["inspect.csv", "inspect.json", "inspect_checks.csv"]
    (tmp_path / "gone").symlink_to("nowhere")
    cli("inspect", stages.qat, "--out", "gone").assert_error("symbolic link to nowhere, which does not exist")
    assert not (tmp_path / "nowhere").exists()


# -- full disk -------------------------------------------------------------------------------
def test_a_full_disk_during_a_checkpoint_write_is_a_clean_error_naming_the_target(tmp_path):
    (tmp_path / "x.pt").write_bytes(b"the previous checkpoint")
    proc = _qdebug("convert", DEMO / "qat.pt", "-o", "x.pt", cwd=tmp_path, file_limit=100 * 1024)
    _assert_clean_error(proc, "cannot write x.pt")
    assert os.listdir(tmp_path) == ["x.pt"] and (tmp_path / "x.pt").read_bytes() == b"the previous checkpoint"


def test_write_failures_become_one_clean_error_and_other_errors_stay_bugs(tmp_path):
    target = tmp_path / "model.pt"
    with pytest.raises(WriteError) as caught:  # what torch's zip writer raises on a full disk
        with atomic_path(target):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 89856 vs 89744")
    assert isinstance(caught.value, QDebugError) and isinstance(caught.value, OSError)
    assert caught.value.message.startswith(f"cannot write {target}")
    with pytest.raises(RuntimeError, match="a bug"):
        with atomic_path(target):
            raise RuntimeError("a bug")
    with pytest.raises(WriteError, match=f"cannot write {target}: No space left on device"):
        with atomic_path(target):
            raise OSError(28, "No space left on device")
    assert os.listdir(tmp_path) == []


# -- --out DIR: all or nothing ---------------------------------------------------------------
def test_a_full_disk_leaves_no_out_folder(tmp_path):
    proc = _qdebug("inspect", DEMO / "qat.pt", "--out", "new/sub", cwd=tmp_path, file_limit=8 * 1024)
    _assert_clean_error(proc, "cannot write new/sub/inspect")  # named where the user looks, not the staging folder
    assert os.listdir(tmp_path) == []  # neither the folder, its parent, nor a staging folder


def test_a_failed_run_leaves_the_earlier_results_untouched(tmp_path):
    assert _qdebug("inspect", DEMO / "qat.pt", "--out", "res", cwd=tmp_path).returncode == 0
    before = _contents(tmp_path / "res")
    proc = _qdebug("inspect", DEMO / "quantized.pt", "--out", "res", cwd=tmp_path, file_limit=8 * 1024)
    _assert_clean_error(proc, "cannot write res/inspect")
    assert _contents(tmp_path / "res") == before and os.listdir(tmp_path) == ["res"]


def test_an_input_error_leaves_no_output_folder(cli, stages, tmp_path):
    cli("compare", "missing.pt", stages.qat, "--out", "a/b").assert_error("no such file")
    cli("convert", "missing.pt", "-o", "new/x.pt").assert_error("no such file")
    (tmp_path / "qdebug.toml").write_text('out = "from-config"\n')
    cli("inspect", "missing.pt").assert_error("no such file")
    assert os.listdir(tmp_path) == ["qdebug.toml"]


def test_a_target_that_cannot_be_replaced_stops_the_run_before_any_file_moves(cli, stages, tmp_path):
    (tmp_path / "res" / "inspect.json").mkdir(parents=True)
    (tmp_path / "res" / "inspect.csv").write_text("old\n")
    cli("inspect", stages.qat, "--out", "res").assert_error("cannot write res/inspect.json: it is a directory")
    assert sorted(os.listdir(tmp_path / "res")) == ["inspect.csv", "inspect.json"]  # no staging folder left
    assert (tmp_path / "res" / "inspect.csv").read_text() == "old\n"


def test_out_dot_fills_the_current_folder_and_keeps_other_files(cli, stages, tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    assert cli("inspect", stages.qat, "--out", ".").code == 0
    assert sorted(os.listdir(tmp_path)) == ["inspect.csv", "inspect.json", "inspect_checks.csv", "notes.txt"]


def test_stale_files_go_only_when_the_new_run_commits(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "before.pt").write_text("an earlier run's bundle")
    (folder / "notes.txt").write_text("mine")
    abandoned = StagedDir(folder)
    abandoned.file("nan_trace.csv").write_text("abandoned")
    abandoned.drop_stale("before.pt")
    abandoned.discard()
    assert sorted(os.listdir(folder)) == ["before.pt", "notes.txt"]
    run = StagedDir(folder)
    run.file("nan_trace.csv").write_text("new")
    run.drop_stale("before.pt")
    assert (folder / "before.pt").exists() and not (folder / "nan_trace.csv").exists()
    run.commit()
    assert sorted(os.listdir(folder)) == ["nan_trace.csv", "notes.txt"]


def test_concurrent_runs_on_one_out_folder_never_mix_their_files(tmp_path):
    runs = {"qat": DEMO / "qat.pt", "quantized": DEMO / "quantized.pt"}
    alone = {}
    for name, checkpoint in runs.items():  # what each run writes on its own
        assert _qdebug("inspect", checkpoint, "--out", name, cwd=tmp_path).returncode == 0
        alone[name] = _contents(tmp_path / name)
    assert alone["qat"]["inspect.json"] != alone["quantized"]["inspect.json"]
    for round_ in range(2):
        shared = tmp_path / f"shared{round_}"
        procs = [subprocess.Popen(_command("inspect", checkpoint, "--out", shared), cwd=tmp_path, env=_env(),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for checkpoint in runs.values()]
        for proc in procs:
            assert proc.wait(timeout=300) == 0, proc.stderr.read()
        assert _contents(shared) in alone.values(), "the folder mixes files of both runs"


@pytest.mark.skipif(sys.platform == "win32", reason="flock on a directory: POSIX only")
def test_the_files_move_in_only_under_the_lock_all_at_once(tmp_path):
    import fcntl

    lock = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as a concurrent run committing into tmp_path would hold it
    proc = subprocess.Popen(_command("inspect", DEMO / "qat.pt", "--out", "res"), cwd=tmp_path, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".res.*/inspect.json")):  # all staged: waiting for the lock
            assert proc.poll() is None and time.monotonic() < deadline, "the run never staged its files"
            time.sleep(0.1)
        time.sleep(0.5)
        assert not (tmp_path / "res").exists()
    finally:
        os.close(lock)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    assert sorted(os.listdir(tmp_path)) == ["res"]
    assert sorted(os.listdir(tmp_path / "res")) == ["inspect.csv", "inspect.json", "inspect_checks.csv"]
