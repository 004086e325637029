"""Progress where no terminal shows a bar (piped, in CI, in a log): one plain line at a bounded rate.

A rich bar redraws in place and so needs a terminal; a log only appends.  ``PlainProgress`` writes
``<what>: <i>/<n> <unit>, <elapsed> elapsed, ~<eta> left`` at most once per ``interval`` seconds
(``QDEBUG_PROGRESS_SECONDS``, default 10), plus a last line when the work ends -- only once a
line was written: work shorter than the interval says nothing.  Work made of several passes
(``runs=True``: step's and suggest's experiment runs, each counted from 0) says which it is in,
``(run 3)``, and estimates what is left of that run: how many runs follow is not known ahead.
``qdebug.cli.common.progress_bar`` chooses between this and rich's bar; this module only counts,
times and formats.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Optional

from qdebug.errors import QDebugError

INTERVAL_ENV = "QDEBUG_PROGRESS_SECONDS"
DEFAULT_INTERVAL = 10.0
clock = time.monotonic  # what progress_bar times with: a test replaces it, and sleeps for nothing


def interval_from_env() -> float:
    """Seconds between two plain progress lines: ``QDEBUG_PROGRESS_SECONDS``, else 10."""
    given = os.environ.get(INTERVAL_ENV, "").strip()
    if not given:
        return DEFAULT_INTERVAL
    try:
        seconds = float(given)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise QDebugError(f"{INTERVAL_ENV}={given!r} is not a number of seconds",
                          f"e.g. {INTERVAL_ENV}=30 (one progress line every 30 s when stderr is not a terminal)")
    return seconds


def duration(seconds: float) -> str:
    """``seconds`` as a log reads it: 45s, 3m12s, 1h02m."""
    whole = max(0, int(round(seconds)))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


class PlainProgress:
    """Counts ``advance(done, total=None)`` calls and writes a line through ``write`` when
    ``interval`` seconds have passed since the last one (or since the start).  ``clock`` is
    injectable: tests drive it without sleeping."""

    def __init__(self, description: str, total: Optional[int], *, unit: str = "batches",
                 runs: bool = False, write: Callable[[str], None], interval: float = DEFAULT_INTERVAL,
                 clock: Callable[[], float] = time.monotonic):
        self.description, self.total, self.unit, self.runs = description, total, unit, runs
        self.write, self.interval, self.clock = write, interval, clock
        self.done = 0
        self.run = 1  # with ``runs``: the run the work is in (a count starting again begins the next)
        self.started = self.run_started = self.last_written = self.last_advanced = clock()
        self.lines = 0
        self.last_shown: tuple[int, int] | None = None  # (run, done) of the last line written

    def advance(self, done: int = 1, total: Optional[int] = None) -> None:
        now = self.clock()
        if self.runs and done <= self.done:  # counted from 0 again: the next run, of its own size
            self.run += 1
            self.run_started = self.last_advanced  # it began when the last one ended
            self.total = None
        self.done, self.last_advanced = done, now
        if total:
            self.total = total
        if now - self.last_written >= self.interval:
            self._say(now, final=False)

    def finish(self) -> None:
        """The work is over: its last line, when the log has had one (a short run stays silent)
        and that one showed less than all the work."""
        if self.lines and self.last_shown != (self.run, self.done):
            self._say(self.clock(), final=True)

    def line(self, now: float, *, final: bool = False) -> str:
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        where = f" (run {self.run})" if self.runs else ""
        text = f"{self.description}: {count} {self.unit}{where}, {duration(now - self.started)} elapsed"
        if final:
            return text + ", done"
        if self.total and 0 < self.done < self.total:
            per_unit = (now - self.run_started) / self.done
            left = " of this run" if self.runs else ""
            text += f", ~{duration(per_unit * (self.total - self.done))} left{left}"
        return text

    def _say(self, now: float, *, final: bool) -> None:
        self.write(self.line(now, final=final))
        self.lines += 1
        self.last_written = now
        self.last_shown = (self.run, self.done)
