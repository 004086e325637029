"""``baseline``: the precision gate, quantized metric >= ratio x float metric, per task (seed 001).

Rule per task (ratio r, default 0.99):

- higher is better: pass iff q >= r * f; required = r * f; margin = q - required;
- lower is better (the mirror rule): pass iff q <= f / r, i.e. the error may grow
  by at most a factor 1/r; required = f / r; margin = required - q.

``score`` is q / f for higher-is-better tasks and f / q for lower-is-better ones, so
both pass when score >= r.  Metrics are expected to be >= 0.

Confidence (``--confidence 0.95``): when the metric gives per-sample scores, a
seeded paired bootstrap resamples the samples (the same indices for both
models) and takes the percentile interval of the score; the verdict is
``pass`` if the whole interval is >= r, ``fail`` if it is all < r, else
``inconclusive`` (the eval set is too small to tell).  For 0/1 correctness
scores, McNemar's exact test on the samples whose correctness flipped gives a
p-value, and the first flipped sample indices are listed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from qdebug.errors import QDebugError
from qdebug.data.metrics import check_nonnegative

COLUMNS = ["task", "direction", "float", "quantized", "score", "ratio", "required", "margin",
           "ci_low", "ci_high", "mcnemar_p", "flipped", "verdict"]


@dataclass(frozen=True)
class TaskRule:
    direction: str = "higher"  # "higher" | "lower"
    ratio: float = 0.99


@dataclass
class BaselineResult:
    frame: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)
    flipped: dict[str, list[int]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool((self.frame["verdict"] != "fail").all())


def check_metric_values(name: str, values: dict[str, float]) -> None:
    for task, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise QDebugError(f"{name} metric for task {task!r} is not a number: {value!r}",
                              "the metric must return a number (or a dict of task -> number)")
        if not math.isfinite(value):
            raise QDebugError(f"{name} metric for task {task!r} is {value}", "the metric must be a finite number")
    check_nonnegative(values, f"the {name} metric")  # the ratio rule's domain (docs/baseline.md)


def evaluate_rule(f: float, q: float, rule: TaskRule) -> tuple[float, float, float, bool]:
    """(score, required, margin, passed) of one task."""
    if rule.direction == "lower":
        required = f / rule.ratio
        score = f / q if q > 0 else (math.inf if f > 0 else 1.0)
        margin = required - q
        return score, required, margin, q <= required
    required = rule.ratio * f
    score = q / f if f > 0 else (math.inf if q > 0 else 1.0)
    margin = q - required
    return score, required, margin, q >= required


def bootstrap_interval(f_scores: torch.Tensor, q_scores: torch.Tensor, rule: TaskRule, *,
                       confidence: float, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of the score under a paired bootstrap over samples."""
    n = f_scores.numel()
    if n == 0 or n != q_scores.numel():
        raise QDebugError("per-sample scores of the two models differ in length", "evaluate both on the same data")
    generator = torch.Generator().manual_seed(seed)
    # On the CPU, with the CPU's generator: the same interval whatever device scored the samples.
    f64, q64 = f_scores.detach().double().reshape(-1).cpu(), q_scores.detach().double().reshape(-1).cpu()
    scores = torch.empty(resamples, dtype=torch.float64)
    chunk = max(1, 2_000_000 // n)
    for start in range(0, resamples, chunk):
        count = min(chunk, resamples - start)
        idx = torch.randint(0, n, (count, n), generator=generator)
        fm, qm = f64[idx].mean(1), q64[idx].mean(1)
        if rule.direction == "lower":
            scores[start:start + count] = torch.where(qm > 0, fm / qm, torch.full_like(fm, math.inf))
        else:
            scores[start:start + count] = torch.where(fm > 0, qm / fm, torch.full_like(fm, math.inf))
    alpha = (1.0 - confidence) / 2
    lo, hi = torch.quantile(scores, torch.tensor([alpha, 1 - alpha], dtype=torch.float64)).tolist()
    return lo, hi


def mcnemar_exact(f_correct: torch.Tensor, q_correct: torch.Tensor) -> tuple[float, int, int, list[int]]:
    """Two-sided exact McNemar p-value, (b, c) discordant counts, indices float-right/quant-wrong."""
    f = f_correct.reshape(-1).bool()
    q = q_correct.reshape(-1).bool()
    lost = (f & ~q).nonzero().reshape(-1).tolist()
    gained = int((~f & q).sum())
    b, c = len(lost), gained
    n = b + c
    if n == 0:
        return 1.0, 0, 0, []
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail), b, c, lost


def _is_binary(t: torch.Tensor) -> bool:
    return bool(((t == 0) | (t == 1)).all())


def gate(
    float_metrics: dict[str, float],
    quant_metrics: dict[str, float],
    rules: dict[str, TaskRule] | None = None,
    *,
    ratio: float = 0.99,
    float_samples: dict[str, torch.Tensor] | None = None,
    quant_samples: dict[str, torch.Tensor] | None = None,
    confidence: float | None = None,
    flipped_limit: int = 20,
    seed: int = 0,
) -> BaselineResult:
    """Apply the rule to every task; with per-sample scores, add the interval and McNemar."""
    if not 0 < ratio <= 1.5:
        raise QDebugError(f"ratio {ratio} is out of range", "use e.g. 0.99")
    if confidence is not None and not 0.5 <= confidence < 1:
        raise QDebugError(f"confidence {confidence} must be in [0.5, 1)", "e.g. --confidence 0.95")
    check_metric_values("float", float_metrics)
    check_metric_values("quantized", quant_metrics)
    missing_q = sorted(set(float_metrics) - set(quant_metrics))
    missing_f = sorted(set(quant_metrics) - set(float_metrics))
    if missing_q or missing_f:
        parts = []
        if missing_q:
            parts.append(f"missing in the quantized result: {', '.join(missing_q)}")
        if missing_f:
            parts.append(f"missing in the float result: {', '.join(missing_f)}")
        raise QDebugError("the two results do not have the same tasks (" + "; ".join(parts) + ")",
                          "both metrics must report every task")
    rules = rules or {}
    unknown = sorted(set(rules) - set(float_metrics) - {"metric"})
    if unknown:
        raise QDebugError(f"rules for unknown task(s): {', '.join(unknown)}", f"tasks: {', '.join(float_metrics)}")
    rows, flipped = [], {}
    for task, f in float_metrics.items():
        rule = rules.get(task) or TaskRule(ratio=ratio)
        if rule.direction not in ("higher", "lower"):
            raise QDebugError(f"task {task!r}: direction must be 'higher' or 'lower'",
                              "direction is 'higher' (an accuracy) or 'lower' (an error)")
        q = quant_metrics[task]
        if rule.direction == "higher" and f == 0:
            # q >= 0.99 x 0 holds for any q: the verdict would say nothing.
            raise QDebugError(f"the float model scores 0 on task {task!r}: a ratio to it means nothing",
                              "check that the data's targets match the model's outputs (class indices), "
                              "or choose another metric")
        score, required, margin, passed = evaluate_rule(f, q, rule)
        row = {"task": task, "direction": rule.direction, "float": f, "quantized": q, "score": score,
               "ratio": rule.ratio, "required": required, "margin": margin, "ci_low": math.nan,
               "ci_high": math.nan, "mcnemar_p": math.nan, "flipped": math.nan,
               "verdict": "pass" if passed else "fail"}
        fs = (float_samples or {}).get(task)
        qs = (quant_samples or {}).get(task)
        if fs is not None and qs is not None:
            if confidence is not None:
                lo, hi = bootstrap_interval(fs, qs, rule, confidence=confidence, seed=seed)
                row["ci_low"], row["ci_high"] = lo, hi
                row["verdict"] = "pass" if lo >= rule.ratio else ("fail" if hi < rule.ratio else "inconclusive")
            if _is_binary(fs) and _is_binary(qs):
                p, b, c, lost = mcnemar_exact(fs, qs)
                row["mcnemar_p"], row["flipped"] = p, b + c
                flipped[task] = lost[:flipped_limit]
        rows.append(row)
    frame = pd.DataFrame(rows, columns=COLUMNS)
    meta = {"ratio": ratio, "confidence": confidence, "passed": bool((frame["verdict"] != "fail").all()),
            "verdicts": dict(zip(frame["task"], frame["verdict"]))}
    return BaselineResult(frame, meta, flipped)
