"""The metric and its pass rule per task, as baseline, step and suggest take them: the
``--metric`` and ``--ratio`` options, the config's ``ratio`` and ``[tasks]``, checked once."""

from __future__ import annotations

from typing import Any, Optional

import typer

from qdebug.cli.common import STATE
from qdebug.config.project import check_ratio_range

METRIC_OPTION = typer.Option(None, "--metric", metavar="NAME",
                             help="Metric: top1, top5, mse, agreement or package.module:function.")
RATIO_OPTION = typer.Option(None, "--ratio", metavar="R",
                            help="Required quantized/float ratio (default 0.99, or the config's).")


def check_ratio(ratio: Optional[float]) -> None:
    """--ratio in baseline's range, checked before minutes of evaluation, not after (the
    config's ratios are checked as it loads)."""
    if ratio is not None:
        check_ratio_range(ratio, "--ratio", "e.g. --ratio 0.99")


def ratio_in_force(ratio: Optional[float]) -> float:
    """--ratio, else the config's ``ratio``, else 0.99."""
    return ratio if ratio is not None else float(STATE.config().get("ratio", 0.99))


def task_rules(metric_fn: Any, default_ratio: float, ratio_given: bool) -> dict:
    """Baseline's rule per task: the config's [tasks] entries, and "metric" for a single-number metric."""
    from qdebug.data.metrics import metric_direction
    from qdebug.tools.baseline import TaskRule

    cfg_tasks = STATE.config().get("tasks") or {}
    default_direction = metric_direction(metric_fn) if metric_fn is not None else "higher"
    rules = {"metric": TaskRule(default_direction, default_ratio)}
    for task, entry in cfg_tasks.items():
        rules[task] = TaskRule(entry.get("direction", default_direction),
                               default_ratio if ratio_given else float(entry.get("ratio", default_ratio)))
    return rules


def metric_rules(spec: Optional[str], metric_fn: Any, ratio: Optional[float]) -> tuple[str, float, dict]:
    """(task, ratio in force, rules): a single-number metric is the task named after it
    (``top1``, or the function of ``package.module:function``), with the default rule."""
    default_ratio = ratio_in_force(ratio)
    rules = task_rules(metric_fn, default_ratio, ratio is not None)
    task = spec.rsplit(":", 1)[-1] if spec else "metric"
    rules.setdefault(task, rules["metric"])
    return task, default_ratio, rules
