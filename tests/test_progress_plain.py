"""Progress without a terminal (issue 31 item 2): piped or in CI, long work writes a plain line on
stderr at a bounded rate, with the right counts and an estimate; ``--quiet`` writes none; a
terminal keeps rich's bar.  Time is a fake clock: no test sleeps."""

from __future__ import annotations

import re

import pytest

from qdebug.cli import progress
from qdebug.cli.progress import PlainProgress, duration
from qdebug.errors import QDebugError

PROGRESS = re.compile(r"^(comparing|stepping|suggesting|calibrating|tracing): ")


class FakeClock:
    """Each reading moves time on by ``step`` seconds (the first reads 0)."""

    def __init__(self, step: float = 0.0):
        self.now, self.step = -step, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _progress_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if PROGRESS.match(line)]


# -- the line and its rate ------------------------------------------------------------------------
def test_duration_reads_as_a_log_does():
    assert [duration(s) for s in (0, 45.4, 59.6, 192, 3600, 3720)] == ["0s", "45s", "1m00s", "3m12s", "1h00m", "1h02m"]


def test_at_most_one_line_per_interval_plus_the_last_with_counts_and_estimates():
    clock, lines = FakeClock(), []
    bar = PlainProgress("comparing", 95, write=lines.append, interval=10, clock=clock)
    for done in range(1, 96):  # one batch a second
        clock.now = float(done)
        bar.advance(done)
    clock.now = 95.5
    bar.finish()
    # 1 s a batch: at t = 10 s, 10 done, 85 left -> 1m25s; the last says the whole run
    assert lines[0] == "comparing: 10/95 batches, 10s elapsed, ~1m25s left"
    assert lines[4] == "comparing: 50/95 batches, 50s elapsed, ~45s left"
    assert lines[-1] == "comparing: 95/95 batches, 1m36s elapsed, done"
    assert len(lines) == 10  # t = 10, 20, ..., 90 and the last: 95 seconds, one line per 10 of them
    written = [int(re.search(r"(\d+)/95", line).group(1)) for line in lines]
    assert written == [10, 20, 30, 40, 50, 60, 70, 80, 90, 95]


def test_the_bound_holds_however_often_work_advances():
    clock, lines = FakeClock(step=0.01), []  # 10 000 units at 100 a second: 100 s
    bar = PlainProgress("calibrating", 10_000, write=lines.append, interval=30, clock=clock)
    for done in range(1, 10_001):
        bar.advance(done)
    bar.finish()
    assert len(lines) == 100 // 30 + 1, lines  # at 30, 60 and 90 s, and the last


def test_work_shorter_than_the_interval_writes_nothing():
    clock, lines = FakeClock(step=1), []
    bar = PlainProgress("comparing", 5, write=lines.append, interval=10, clock=clock)
    for done in range(1, 6):
        bar.advance(done)
    bar.finish()
    assert lines == []


def test_work_in_runs_says_the_run_and_estimates_what_is_left_of_it():
    clock, lines = FakeClock(), []
    bar = PlainProgress("stepping", None, unit="forwards", runs=True, write=lines.append, interval=10, clock=clock)
    for done in range(1, 21):  # run 1: 20 forwards of 1 s, its size unknown until the data is counted
        clock.now += 1
        bar.advance(done, None)
    for done in range(1, 31):  # run 2: 30 forwards of 2 s
        clock.now += 2
        bar.advance(done, 30)
    assert lines[:2] == ["stepping: 10 forwards (run 1), 10s elapsed", "stepping: 20 forwards (run 1), 20s elapsed"]
    # run 2 at t = 30 s: 5 forwards in its 10 s, 25 left at 2 s each
    assert lines[2] == "stepping: 5/30 forwards (run 2), 30s elapsed, ~50s left of this run"
    assert lines[-1] == "stepping: 30/30 forwards (run 2), 1m20s elapsed"


def test_an_unknown_total_learnt_as_it_goes_gives_an_estimate_from_then_on():
    clock, lines = FakeClock(step=5), []
    bar = PlainProgress("tracing", None, write=lines.append, interval=10, clock=clock)
    bar.advance(2)
    bar.advance(4, 8)
    assert lines == ["tracing: 4/8 batches, 10s elapsed, ~10s left"]


@pytest.mark.parametrize("given", ["often", "-1", "nan", "inf"])
def test_a_bad_rate_is_a_usage_error_with_an_example(monkeypatch, given):
    monkeypatch.setenv("QDEBUG_PROGRESS_SECONDS", given)
    with pytest.raises(QDebugError, match="is not a number of seconds") as raised:
        progress.interval_from_env()
    assert "QDEBUG_PROGRESS_SECONDS=30" in raised.value.hint


def test_the_rate_is_ten_seconds_unless_set(monkeypatch):
    monkeypatch.delenv("QDEBUG_PROGRESS_SECONDS", raising=False)
    assert progress.interval_from_env() == 10
    monkeypatch.setenv("QDEBUG_PROGRESS_SECONDS", " 2.5 ")
    assert progress.interval_from_env() == 2.5


# -- through the command line (the cli fixture's stderr is a pipe, not a terminal) -----------------
def test_piped_compare_writes_bounded_lines_with_the_right_counts(cli, stages, monkeypatch):
    # 4 s per reading: the bar starts at 0, the 6 batches end at 4, 8, ..., 24 s: lines at >= 10 s apart
    monkeypatch.delenv("QDEBUG_PROGRESS_SECONDS")  # the default rate (conftest sets a test-wide one)
    monkeypatch.setattr(progress, "clock", FakeClock(step=4))
    result = cli("compare", stages.float, stages.qat, "--data", stages.data, "--batch-size", 2, "--format", "csv")
    assert result.code == 0, result.err
    assert _progress_lines(result.err) == ["comparing: 3/6 batches, 12s elapsed, ~12s left",
                                           "comparing: 6/6 batches, 24s elapsed"]
    assert "comparing" not in result.out  # stdout is the result's


def test_quiet_writes_no_progress(cli, stages, monkeypatch):
    monkeypatch.setenv("QDEBUG_PROGRESS_SECONDS", "0")  # a line for every batch, unless quiet
    monkeypatch.setattr(progress, "clock", FakeClock(step=0))
    args = ["compare", stages.float, stages.qat, "--data", stages.data, "--batch-size", 4, "--format", "csv"]
    loud, quiet = cli(*args), cli("--quiet", *args)
    assert loud.code == quiet.code == 0, (loud.err, quiet.err)
    assert _progress_lines(loud.err) == ["comparing: 1/3 batches, 0s elapsed, ~0s left",
                                         "comparing: 2/3 batches, 0s elapsed, ~0s left",
                                         "comparing: 3/3 batches, 0s elapsed"]
    assert _progress_lines(quiet.err) == [] and quiet.out == loud.out


def test_a_terminal_keeps_the_bar_not_the_line_and_quiet_drops_it(cli, stages, monkeypatch):
    from qdebug.cli.common import err_console

    monkeypatch.setenv("QDEBUG_PROGRESS_SECONDS", "0")
    monkeypatch.setattr(err_console, "_force_terminal", True)
    args = ["compare", stages.float, stages.qat, "--data", stages.data, "--batch-size", 4, "--format", "csv"]
    result, quiet = cli(*args), cli("--quiet", *args)
    assert result.code == quiet.code == 0, (result.err, quiet.err)
    assert _progress_lines(result.err) == []
    assert "\x1b[?25l" in result.err  # rich's live bar hid the cursor (and cleared itself: transient)
    assert quiet.err == ""  # --quiet: no bar either


@pytest.mark.parametrize("command", ["step", "suggest", "calibrate", "nan-trace"])
def test_every_command_with_a_bar_writes_the_line_when_piped(cli, stages, monkeypatch, command):
    monkeypatch.setenv("QDEBUG_PROGRESS_SECONDS", "0")
    data = ["--data", stages.data, "--batch-size", 6]  # two batches
    args = {"step": ["step", stages.float, stages.calibrated, *data],
            "suggest": ["suggest", stages.float, stages.calibrated, *data],
            "calibrate": ["calibrate", stages.float, *data, "-o", "cal.pt"],
            "nan-trace": ["nan-trace", stages.qat, *data, "--steps", 2]}[command]
    result = cli(*args, "--format", "csv")
    assert result.code in (0, 1), result.err  # 1: a check failed or a NaN found, not this test's business
    lines = _progress_lines(result.err)
    what, unit = {"step": ("stepping", "forwards"), "suggest": ("suggesting", "forwards"),
                  "calibrate": ("calibrating", "batches"), "nan-trace": ("tracing", "steps")}[command]
    assert lines and all(line.startswith(f"{what}: ") and f" {unit}" in line for line in lines), result.err
    if unit != "forwards":  # two batches; two training steps
        assert [line.split(" ")[1] for line in lines] == ["1/2", "2/2"], lines
    else:  # runs counted from 1, each from its first forward pass
        runs = [int(re.search(r"\(run (\d+)\)", line).group(1)) for line in lines]
        assert runs[0] == 1 and runs == sorted(runs), lines
        assert re.match(rf"{what}: 1(/\d+)? forwards \(run 1\)", lines[0]), lines
