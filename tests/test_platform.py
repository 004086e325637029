"""What every command inherits: instant help, --version, Ctrl-C, one output convention, tables
fitted to the terminal, no wrong answers from a wrong order, and saying when data is missing."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tables import table_lines

REPO = Path(__file__).resolve().parent.parent
COMMANDS = ["baseline", "compare", "inspect", "calibrate", "convert"]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env.update({"PYTHONPATH": str(REPO), **extra})
    return env


def _qdebug(*args, timeout=120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qdebug", *map(str, args)], capture_output=True, text=True,
                          env=_env(**env), timeout=timeout, cwd=REPO)


# -- instant help ------------------------------------------------------------------------------
_IMPORTED = """
import sys
from qdebug.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("IMPORTED", sorted(m for m in ("torch", "pandas", "matplotlib", "numpy") if m in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["compare", "--help"], ["inspect", "--help"],
                                  ["compare", "--format", "xml", "a.pt", "b.pt"], ["calibrate", "x.pt"],
                                  ["nosuchcommand"]])
def test_help_version_and_usage_errors_import_no_heavy_module(args):
    proc = subprocess.run([sys.executable, "-c", _IMPORTED, *args], capture_output=True, text=True, env=_env(),
                          cwd=REPO, timeout=60)
    assert "IMPORTED []" in proc.stderr, proc.stderr


def test_import_qdebug_is_lazy_and_the_api_names_still_work():
    code = ("import sys, qdebug; assert 'torch' not in sys.modules; "
            "assert callable(qdebug.load) and callable(qdebug.compare) and 'torch' in sys.modules; "
            "print(qdebug.__version__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*\n", proc.stdout)


def test_version(cli):
    import qdebug

    result = cli("--version")
    assert result.code == 0 and result.out == f"qdebug {qdebug.__version__}\n"


@pytest.mark.parametrize("command", [None, *COMMANDS, "init"])
def test_help_has_no_type_noise_and_nothing_cut_off(cli, command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    result = cli(*([command] if command else []), "--help")
    assert result.code == 0, result.err
    for noise in ("<bool>", "<str>", "<int>", "<float>", "<path>", "<list", "TEXT", "INTEGER", "BOOLEAN"):
        assert noise not in result.out, (noise, result.out)
    described = result.out.split("\n", 1)[1]  # all but the usage line, where "..." means "repeatable"
    assert "…" not in described and "..." not in described
    assert "Example: qdebug" in result.out


# When to send Ctrl-C, read from the process's own stderr (no sleep: a loaded machine only makes
# the wait longer): -X importtime writes a line as each import ends, and the progress line
# (QDEBUG_PROGRESS_SECONDS=0: one per batch) says computing has begun.
_START_UP_MOMENTS = {
    "importing qdebug's commands": re.compile(r"^import time:.*\|\s*qdebug\.cli\.app$"),
    "loading the checkpoints": re.compile(r"^import time:.*\|\s*torch$"),
    "computing": re.compile(r"^comparing: 1/200 batches"),
}


def _interrupted_when(marker: re.Pattern, args: list, timeout: float = 120) -> tuple[int, str, bool]:
    """Run ``qdebug ARGS``, send SIGINT once a stderr line matches ``marker``: the exit code,
    stderr less -X importtime's lines, and whether the marker was seen."""
    import queue
    import threading

    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "qdebug", *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=_env(QDEBUG_PROGRESS_SECONDS="0"), cwd=REPO)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [*map(lines.put, proc.stderr), lines.put(None)], daemon=True)
    reader.start()
    seen, reached = [], False
    try:
        while (line := lines.get(timeout=timeout)) is not None:
            seen.append(line)
            if not reached and marker.search(line.rstrip("\n")):
                proc.send_signal(signal.SIGINT)
                reached = True
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    return proc.returncode, "".join(line for line in seen if not line.startswith("import time:")), reached


@pytest.mark.parametrize("moment", list(_START_UP_MOMENTS))
def test_ctrl_c_during_start_up_exits_130_without_a_traceback(stages, moment):
    """SIGINT at each moment of a start-up (imports, loading, computing): always 130 and one line.
    The signal goes once the process says it reached the moment, never after a sleep: it lands in
    that moment or a later one, each of which must end the same way.  (Inside torch's import:
    test_ctrl_c_inside_torch_import_waits_for_the_import_to_end.)"""
    code, err, reached = _interrupted_when(_START_UP_MOMENTS[moment], [
        "compare", stages.float, stages.qat, "--data", "random:64x1x16x16", "--batches", "200"])
    assert reached, (moment, code, err)  # the run got there (and did not end first)
    # 130, or (rarely, when CPython itself re-raises SIGINT at exit) death by SIGINT, which
    # a shell reports as 130 too
    assert code in (130, -signal.SIGINT), (moment, code, err)
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "error: interrupted", (moment, err)


_CTRL_C_IN_TORCH_IMPORT = """
import os, signal, sys, threading, traceback
from qdebug.cli.interrupts import hold_interrupts_during_torch_import
hold_interrupts_during_torch_import()
threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
try:
    import torch
except KeyboardInterrupt:
    frames = [frame.filename for frame in traceback.extract_tb(sys.exc_info()[2])]
    print("INSIDE TORCH" if any("/torch/" in name for name in frames) else "AFTER TORCH", *frames)
"""


def test_ctrl_c_inside_torch_import_waits_for_the_import_to_end():
    """torch's import calls Python from C++: an interrupt raised there aborts the process (SIGABRT),
    so it is held back and raised by qdebug's loader, a Python frame, once the import is over."""
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_IN_TORCH_IMPORT], capture_output=True, text=True,
                          env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("AFTER TORCH") and "qdebug/cli/interrupts.py" in proc.stdout, proc.stdout


# -- one output convention ---------------------------------------------------------------------
def _invocations(stages) -> dict[str, list]:
    return {
        "baseline": ["baseline", stages.float, stages.quantized, "--data", stages.data, "--metric", "top1"],
        "compare": ["compare", stages.float, stages.qat, "--data", stages.data],
        "inspect": ["inspect", stages.qat],
        "calibrate": ["calibrate", stages.float, "--data", stages.data, "-o", "cal.pt"],
        "convert": ["convert", stages.qat, "-o", "q.pt"],
    }


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_speaks_table_json_csv_and_out_dir(cli, tmp_path, stages, command):
    args = _invocations(stages)[command]
    as_json = cli(*args, "--format", "json")
    assert as_json.code in (0, 1), as_json.err
    payload = json.loads(as_json.out)  # stdout is the document alone
    assert {"meta", "rows"} <= set(payload) and payload["rows"]
    alias = cli(*args, "--json")
    assert json.loads(alias.out)["rows"] == payload["rows"]
    as_csv = cli(*args, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(as_csv.out)))
    assert len(rows) == len(payload["rows"]) and list(rows[0]) == list(payload["rows"][0])  # same names
    table = cli(*args, "--format", "table", "--wide")
    header = table_lines(table.out)[0][-1].split()
    assert set(header) <= set(payload["rows"][0]), header  # headers are the JSON keys
    folder = cli(*args, "--out", "results")
    assert folder.code == as_json.code, folder.err
    assert json.loads((tmp_path / "results" / f"{command}.json").read_text())["rows"] == payload["rows"]
    assert (tmp_path / "results" / f"{command}.csv").read_text().splitlines()[0] == as_csv.out.splitlines()[0]
    assert "wrote" in folder.err and "wrote" not in folder.out
    cli(*args, "--format", "yaml").assert_error("--format 'yaml'")
    cli(*args, "--json", "--format", "csv").assert_error("--json contradicts --format csv")


def test_inspect_json_and_out_carry_the_checks(cli, tmp_path, stages):
    payload = json.loads(cli("inspect", stages.float, "--json").out)
    assert payload["checks"] and {"severity", "layer", "check", "detail"} <= set(payload["checks"][0])
    cli("inspect", stages.float, "--out", "ins")
    with open(tmp_path / "ins" / "inspect_checks.csv", newline="") as fh:
        assert [r["check"] for r in csv.DictReader(fh)] == [c["check"] for c in payload["checks"]]


def test_checkpoint_output_is_dash_o_and_out_is_a_folder(cli, tmp_path, stages):
    result = cli("convert", stages.qat, "-o", "q.pt", "--out", "tables")
    assert result.code == 0, result.err
    assert (tmp_path / "q.pt").is_file() and (tmp_path / "tables" / "convert.csv").is_file()
    assert "wrote q.pt" in result.err
    cli("convert", stages.qat, "--out", "q.pt").assert_error("Missing option '-o'")


# -- tables at 80 and 200 columns, end to end --------------------------------------------------
@pytest.mark.parametrize("width", [80, 200])
@pytest.mark.parametrize("command", COMMANDS)
def test_real_tables_fit_the_width(cli, stages, monkeypatch, command, width):
    from qdebug.cli.common import console

    monkeypatch.setattr(console, "_width", width)
    args = _invocations(stages)[command]
    result = cli(*args)
    assert result.code in (0, 1), result.err
    names = {r.get("layer") or r.get("task") for r in json.loads(cli(*args, "--json").out)["rows"]}
    head, body = table_lines(result.out)
    for line in head + body:
        assert len(line) <= width, (width, line)
    for line in body:
        first = line.split()[0] if line.strip() and not line.startswith(" ") else None
        if first:  # a layer (or task) name on one line: whole, or its end after "…"
            assert first in names or (first.startswith("…") and any(n.endswith(first[1:]) for n in names)), first


def test_piped_output_is_80_columns_wide(stages):
    proc = _qdebug("compare", stages.float, stages.quantized, "--data", stages.data)
    assert proc.returncode == 0, proc.stderr
    head, body = table_lines(proc.stdout)
    assert max(len(line) for line in head + body) <= 80
    summary = proc.stdout.split("\n\n", 1)[1].splitlines()
    assert len(summary) <= 10 and all(len(line) <= 80 for line in summary if not line.startswith("  qdebug "))
    assert summary[-2].startswith("next: ") and summary[-1].startswith("  qdebug ")


# -- no confident wrong answers from a wrong order -----------------------------------------------
def test_a_more_quantized_first_checkpoint_is_not_the_reference(cli, stages):
    result = cli("compare", stages.quantized, stages.float, "--data", stages.data, "--json")
    assert result.code == 0, result.err
    meta = json.loads(result.out)["meta"]
    assert meta["reference"] == "float" and meta["targets"] == ["quantized"]
    assert "more quantized than" in result.err and "--ref 0" in result.err and "warning:" in result.err
    assert "more quantized than" in meta["warning"]
    table = cli("compare", stages.quantized, stages.float, "--data", stages.data)
    assert "compare vs float (least quantized)" in table.out
    # the same numbers as in the right order
    right = json.loads(cli("compare", stages.float, stages.quantized, "--data", stages.data, "--json").out)
    assert json.loads(result.out)["rows"] == right["rows"]


def test_an_explicit_more_quantized_reference_is_kept_with_a_warning(cli, stages):
    result = cli("compare", stages.float, stages.quantized, "--data", stages.data, "--ref", "quantized", "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["meta"]["reference"] == "quantized"
    assert "warning: the reference" in result.err and "more precise" in result.err
    calm = cli("compare", stages.calibrated, stages.qat, "--data", stages.data, "--json")  # same rank: no warning
    assert "warning" not in calm.err


def test_python_api_chooses_the_least_quantized_reference(stages):
    import qdebug

    with pytest.warns(UserWarning, match="more quantized than"):
        frame = qdebug.compare(stages.quantized, stages.float, data=str(stages.data))
    assert frame.attrs["meta"]["reference"] == "float"


def test_forgotten_data_is_said_on_stderr(cli, stages):
    result = cli("compare", stages.float, stages.qat)
    assert result.code == 0, result.err
    assert "note: no --data given: using the 4 sample input(s) stored in" in result.err
    assert "note:" not in result.out
    quiet = cli("compare", stages.float, stages.qat, "--data", stages.data)
    assert "note:" not in quiet.err
    assert "note:" not in cli("inspect", stages.float).err  # tracing is no evaluation


def test_the_config_out_is_the_default_folder(cli, tmp_path, stages):
    (tmp_path / "qdebug.toml").write_text('out = "reports"\n')
    result = cli("inspect", stages.qat)
    assert result.code == 0, result.err
    assert (tmp_path / "reports" / "inspect.json").is_file() and (tmp_path / "reports" / "inspect_checks.csv").is_file()
    cli("inspect", stages.qat, "--out", "mine")
    assert (tmp_path / "mine" / "inspect.json").is_file()  # the flag wins


def test_the_next_command_keeps_the_data_options_and_moves_on(cli, tmp_path, stages):
    import qdebug
    from qdebug.engine import QConfig, calibrate, prepare

    # A layer at fault for rounding against float (an int4 output planted in a calibrated model,
    # whose float model is the reference's: the fixture's QAT step moved its BN statistics).
    int4 = prepare(stages.models["float"], QConfig(overrides={"layer2.0.relu": {"activation": {"bits": 4}}}),
                   mode="fuse_bn", example_inputs=stages.x)
    calibrate(int4, [stages.x])
    target = tmp_path / "int4.pt"
    qdebug.save(int4, target, stage="calibrated", sample_inputs=stages.x)
    args = ("compare", stages.float, target, "--data", stages.data, "--batches", "1")
    first = json.loads(cli(*args, "--json").out)["meta"]["next"]
    # straight to the verified int16 plan
    assert first == f"qdebug suggest {stages.float} {target} --data {stages.data} --batches 1", first
    second = json.loads(cli(*args, "--sort", "isolated_sqnr_db", "--json").out)["meta"]["next"]
    assert "--sort" not in second and second.startswith("qdebug suggest"), second
    (tmp_path / "qdebug.toml").write_text(f'float = "{stages.float}"\nqat = "{target}"\ndata = "{stages.data}"\n')
    from_config = json.loads(cli("compare", "--json").out)["meta"]["next"]
    assert from_config == "qdebug suggest", from_config  # suggest reads the same config keys


def test_usage_mistakes_answer_before_any_loading(cli, stages, monkeypatch):
    """Each is refused before a checkpoint is read (the loader is not even called)."""
    import qdebug.cli.common as common

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded a checkpoint before checking the options")

    monkeypatch.setattr(common, "load_checkpoint", no_loading)
    for module in ("compare", "baseline", "calibrate"):
        monkeypatch.setattr(f"qdebug.cli.{module}.load_checkpoint", no_loading)
    cli("compare", stages.float, stages.qat, "--batches", "0").assert_error("--batches must be")
    cli("compare", stages.float, stages.qat, "--ref", "5").assert_error("--ref 5 is not an index below 2")
    cli("baseline", stages.float, stages.qat, "--metric", "top1", "--ratio", "2").assert_error("--ratio 2 is out of range")
    cli("baseline", stages.float, stages.qat, "--confidence", "1.5").assert_error("--confidence 1.5")
    cli("calibrate", stages.float, "--bits", "1", "-o", "x.pt").assert_error("--bits 1 is outside 2-16")
    cli("calibrate", stages.float, "--observer", "foo", "-o", "x.pt").assert_error("unknown observer 'foo'")
    cli("calibrate", stages.float, "--mode", "fused", "-o", "x.pt").assert_error("unknown QAT mode 'fused'")
    cli("inspect", "nowhere.pt").assert_error("no such file: nowhere.pt")


def test_small_things_a_newcomer_meets(cli, tmp_path, stages):
    cli("baseline", stages.float, stages.quantized, "--metric", "top3", "--data", stages.data).assert_error(
        "unknown metric 'top3'", "top1, top5, agreement, mse")
    no_data = cli("baseline", stages.float, stages.quantized, "--metric", "top1")
    assert no_data.code == 2 and "note: no --data given" in no_data.err
    assert "error: this metric needs targets" in no_data.err and "hint: pass --data with (inputs, targets)" in no_data.err
    (tmp_path / "qdebug.toml").write_text('data = "nowhere/eval.pt"\n')
    cli("compare", stages.float, stages.qat).assert_error("no such file", "in " + str(tmp_path / "qdebug.toml"))
    (tmp_path / "afile").write_text("x")
    cli("inspect", stages.qat, "--out", "afile").assert_error("a file has that name")
    result = cli("convert", stages.qat, "-o", "q.pt", "--unsafe-load")  # every loading command takes it
    assert result.code == 0, result.err
    bare = cli()
    assert bare.code == 2 and "Usage: qdebug" in bare.out and "error:" not in bare.err


def test_a_closed_pipe_is_not_a_failed_check(stages):
    """`qdebug ... | head -1`: the reader leaves early; the exit is SIGPIPE's (141 in a shell), never 1."""
    proc = subprocess.run(f"{sys.executable} -m qdebug inspect {stages.qat} | head -1; echo \"rc=${{PIPESTATUS[0]}}\"",
                          shell=True, executable="/bin/bash", capture_output=True, text=True, env=_env(), cwd=REPO,
                          timeout=120)
    assert "rc=141" in proc.stdout or "rc=0" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_forward_aborted_by_sys_exit_or_ctrl_c_leaves_no_naming_mode_behind(stages):
    """torch runs always_call forward hooks on Exception only: a SystemExit or KeyboardInterrupt
    inside a prepared model's forward skipped the hook that leaves its naming context, and every
    later torch call of the process went through qdebug's mode (an in-process run, a notebook)."""
    from torch.overrides import _get_current_function_mode

    import qdebug
    from qdebug.engine.context import open_contexts, run_model
    from qdebug.measure.tap import tap

    prepared, _ = qdebug.load(stages.qat)
    plain, _ = qdebug.load(stages.float)

    def under_tap(model):
        with tap(model, lambda event: None):
            model(stages.x)

    for abort in (SystemExit, KeyboardInterrupt):
        def aborts(module, args):
            raise abort()

        for model in (prepared, plain):
            handle = model.layer1.register_forward_pre_hook(aborts)
            for run in (lambda: run_model(model, stages.x), lambda: under_tap(model)):
                with pytest.raises(abort):
                    run()
                assert open_contexts() == 0 and _get_current_function_mode() is None
            handle.remove()
    run_model(prepared, stages.x)  # and the models still run, named as before
    under_tap(plain)
    assert open_contexts() == 0 and _get_current_function_mode() is None
