"""80 columns everywhere (issue 31 item 5): every command's table and summary, piped at
COLUMNS=80, fits in 80 columns -- but a printed command to paste (an indented ``qdebug ...``),
which must stay whole to run as printed.  stdout holds results only (``suggest --apply``
says what it wrote on stderr), and a finite invalid scale is not called non-finite."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from rich.cells import cell_len

from qdebug.cli.output import PASTE_PREFIXES, fitted

WIDTH = 80


def too_wide(text: str) -> list[str]:
    """The lines of ``text`` wider than 80 columns, less the commands to paste."""
    return [line for line in text.splitlines() if cell_len(line) > WIDTH
            and not (line.startswith("  ") and line.lstrip().startswith(PASTE_PREFIXES))]


@pytest.fixture
def cli80(cli, monkeypatch):
    """The ``cli`` fixture at the width of a pipe with COLUMNS=80."""
    from qdebug.cli.common import console

    monkeypatch.setattr(console, "_width", WIDTH)
    return cli


def _commands(stages, tmp_path) -> list[list]:
    data = ["--data", stages.data, "--batch-size", 4]
    return [
        ["inspect", stages.qat],
        ["inspect", stages.quantized],
        ["compare", stages.float, stages.calibrated, stages.qat, stages.quantized, *data],
        ["compare", stages.float, stages.qat, *data, "--sort", "isolated_sqnr_db", "--metrics", "all"],
        ["baseline", stages.float, stages.quantized, "--metric", "agreement", *data, "--confidence", "0.9"],
        ["step", stages.float, stages.qat, "--metric", "agreement", *data],
        ["step", stages.float, stages.qat, "--drill", *data],
        ["nan-trace", stages.qat, *data, "--steps", 2],
        ["watch", stages.qat, *data, "--steps", 4, "--every", 2, "--lr", 1e4],  # findings: their table
        ["fix", stages.float, *data, "--method", "equalize,bias_correction", "-o", tmp_path / "fixed.pt"],
        ["calibrate", stages.float, *data, "-o", tmp_path / "recalibrated.pt"],
        ["convert", stages.qat, "-o", tmp_path / "converted.pt"],
        ["init", "--float", stages.float, "--calibrated", stages.calibrated],
    ]


def test_every_command_fits_80_columns(cli80, stages, tmp_path):
    """Unwrapped, step --drill's summary ran to 126 columns here (the demo's compare to 85, its
    suggest to 96: the same ``say``, wrapped by ``fitted``)."""
    for args in _commands(stages, tmp_path):
        result = cli80(*args)
        assert result.code in (0, 1), (args, result.err)
        assert result.out.strip(), args
        assert too_wide(result.out) == [], (args[0], too_wide(result.out))


def test_a_real_pipe_at_columns_80(stages, tmp_path):
    """The width comes from COLUMNS in a real process whose stdout is a pipe."""
    env = {**os.environ, "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-m", "qdebug", "compare", str(stages.float), str(stages.calibrated),
                           str(stages.quantized), "--data", str(stages.data)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "worst layer:" in proc.stdout
    assert too_wide(proc.stdout) == []
    assert max(cell_len(line) for line in proc.stdout.splitlines()) > 60  # the table uses the width it has


def test_summary_lines_wrap_with_a_hanging_indent_commands_stay_whole():
    line = "  worst layer:   features.1.conv.project_bn (22.6 dB; its own error 33.4 dB isolated)"
    assert fitted(line, 80).splitlines() == [
        "  worst layer:   features.1.conv.project_bn (22.6 dB; its own error 33.4 dB",
        "    isolated)"]
    command = "  qdebug compare float.pt calibrated.pt qat.pt quantized.pt --batches 2 --sort isolated_sqnr_db"
    assert fitted(command, 80) == command
    long_name = "x" * 90
    assert fitted(f"worst layer: {long_name}", 80) == f"worst layer:\n  {long_name}"  # a name is not cut


def test_suggest_apply_without_a_metric_says_wrote_on_stderr(cli80, stages, tmp_path):
    fixed = tmp_path / "fixed.pt"
    result = cli80("suggest", stages.float, stages.calibrated, "--min-sqnr", "40", "--data", stages.data,
                   "--batch-size", 12, "--apply", "-o", fixed)
    assert result.code == 0, result.err
    assert too_wide(result.out) == []
    assert fixed.exists()  # a plan was found and applied
    assert "wrote" not in result.out and str(fixed) not in result.out
    assert result.err.count(f"wrote {fixed}") == 1


def test_a_finite_negative_scale_is_named_an_invalid_scale_not_non_finite():
    from qdebug.cli.nan_trace import headline
    from test_nan_trace import negative_scale_run

    first = negative_scale_run()
    assert first["what"] == "scale" and first["value"] < 0  # finite: the optimizer drove it below zero
    lines = headline(first)
    assert lines[0].startswith("FIRST INVALID SCALE: update of step 0")
    assert f"quant point {first['point']} has a negative scale" in lines[0]
    assert "NON-FINITE" not in "\n".join(lines)
    nan_scale = {**first, "value": float("nan"), "nan": 1}
    assert headline(nan_scale)[0].startswith("FIRST NON-FINITE") and "has a NaN scale" in headline(nan_scale)[0]
