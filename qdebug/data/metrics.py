"""Metrics: ``metric(model, batches) -> number | {task: number}``.

A metric receives the model (in eval mode) and the list of ``qdebug.data.Batch``
objects -- each unpacks as ``(inputs, target)``, so ``for x, y in loader`` works, and
has ``.inputs`` / ``.target`` -- and returns one number or a dict task -> number
(multi-task models, seed 001).  When it raises, the error names the line of the
user's code that raised and the hint states this protocol.  A metric that declares
a ``reference`` keyword also receives the float model (for agreement-style metrics).  ``direction`` ("higher" or "lower") on the
function says which way is better; the default is higher.  Every value a metric returns
must be >= 0 (``check_nonnegative``): baseline's ratio rule compares a quantized to a
float value, and for a value of 0 or less the ratio means nothing (0.99 x -1 asks the
quantized model to be *better*).  A metric that ends the process (``sys.exit``) is an
error, like one that raises.

Ready-made (name them by short name or ``qdebug.data.metrics:NAME``):

- ``top1`` / ``top5``: accuracy of the arg-max (top-k) class against the targets;
  a model returning a dict of logits with dict targets gets one value per task.
- ``agreement``: fraction of samples whose top-1 class equals the float model's.
- ``mse``: mean squared error against the targets (lower is better).

Per-sample protocol (for ``qdebug baseline --confidence``): a metric function with
``per_sample = True`` returns a tensor of one score per sample (or a dict task ->
tensor); the metric value is their mean.  A normal metric may point to such a
function with its ``per_sample`` attribute (``top1.per_sample`` is
``top1_per_sample``: 1.0 where the prediction is right).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from qdebug.errors import QDebugError, first_line, message_of

Metric = Callable[..., Any]


def _outputs(model, batches):
    from qdebug.engine.context import run_model

    with torch.no_grad():
        for batch in batches:
            yield batch, run_model(model, batch.inputs)


def _need_target(batch) -> None:
    if batch.target is None:
        raise QDebugError("this metric needs targets, but the data has none",
                          "pass --data with (inputs, targets), e.g. a .pt file holding a tuple (X, y); a "
                          "checkpoint's sample inputs have no targets")


def _check_class_targets(logits: torch.Tensor, target: Any) -> None:
    """One class index per row of logits: a 0-d target or one of another length would
    broadcast against the predictions and count more right answers than there are samples."""
    if not isinstance(target, torch.Tensor):
        raise QDebugError(f"the targets are a {type(target).__name__}, not a tensor of class indices",
                          "give targets as a tensor, e.g. torch.tensor(labels)")
    rows = logits.numel() // logits.shape[-1] if logits.dim() and logits.shape[-1] else logits.numel()
    if target.numel() != rows:
        raise QDebugError(f"the targets hold {target.numel()} class index(es) for {rows} prediction(s)",
                          "give one class index per sample (targets of shape (batch,))")


def _topk_correct(logits: torch.Tensor, target: torch.Tensor, k: int) -> tuple[int, int]:
    _check_class_targets(logits, target)
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
    return int((top == target.reshape(-1, 1)).any(dim=-1).sum()), int(target.numel())


def topk_accuracy(model, batches, k: int = 1) -> float | dict[str, float]:
    correct: dict[str, int] = {}
    total: dict[str, int] = {}
    for batch, out in _outputs(model, batches):
        _need_target(batch)
        if isinstance(out, dict):
            if not isinstance(batch.target, dict):
                raise QDebugError("the model returns several outputs but the targets are a single tensor",
                                  "give targets as a dict task -> tensor")
            pairs = [(task, out[task], batch.target[task]) for task in batch.target]
        else:
            pairs = [("metric", out, batch.target)]
        for task, logits, target in pairs:
            c, n = _topk_correct(logits, target, k)
            correct[task] = correct.get(task, 0) + c
            total[task] = total.get(task, 0) + n
    result = {t: correct[t] / total[t] for t in correct}
    return result["metric"] if list(result) == ["metric"] else result


def top1(model, batches):
    return topk_accuracy(model, batches, 1)


def top1_per_sample(model, batches) -> torch.Tensor | dict[str, torch.Tensor]:
    """1.0 where the arg-max class is right, else 0.0, per sample (per task for dict outputs)."""
    scores: dict[str, list[torch.Tensor]] = {}
    for batch, out in _outputs(model, batches):
        _need_target(batch)
        pairs = [(t, out[t], batch.target[t]) for t in batch.target] if isinstance(out, dict) else [("metric", out, batch.target)]
        for task, logits, target in pairs:
            # The same tie rule as top1 (torch.topk): quantized logits tie often.
            _check_class_targets(logits, target)
            top = logits.topk(1, dim=-1).indices.reshape(-1)
            scores.setdefault(task, []).append((top == target.reshape(-1)).double())
    result = {t: torch.cat(v) for t, v in scores.items()}
    return result["metric"] if list(result) == ["metric"] else result


top1_per_sample.per_sample = True
top1.per_sample = top1_per_sample  # baseline's confidence interval and McNemar use it


def top5(model, batches):
    return topk_accuracy(model, batches, 5)


def agreement(model, batches, reference=None) -> float:
    if reference is None:
        raise QDebugError("the agreement metric needs the float model as reference",
                          "agreement compares with the float model: use it through qdebug baseline, or pass reference=")
    same = total = 0
    ref_outputs = [out for _, out in _outputs(reference, batches)]
    for (_, out), ref in zip(_outputs(model, batches), ref_outputs):
        if isinstance(out, dict):
            out, ref = torch.cat([v.flatten(1) for v in out.values()], 1), torch.cat([v.flatten(1) for v in ref.values()], 1)
        same += int((out.argmax(-1) == ref.argmax(-1)).sum())
        total += out.shape[0]
    return same / max(total, 1)


def mse(model, batches) -> float:
    total, count = 0.0, 0
    for batch, out in _outputs(model, batches):
        _need_target(batch)
        target = batch.target
        if not isinstance(target, torch.Tensor) or target.numel() != out.numel():
            shape = list(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
            raise QDebugError(f"mse: the targets ({shape}) do not match the model's output ({list(out.shape)})",
                              "give targets of the output's shape: one value per output value")
        # Same values, not broadcast: an output (N, 1) against targets (N,) would give N x N.
        diff = (out.double() - target.double().reshape(out.shape)) ** 2
        total += float(diff.sum())
        count += diff.numel()
    return total / max(count, 1)


mse.direction = "lower"

BUILTIN = {"top1": top1, "top5": top5, "agreement": agreement, "mse": mse, "top1_per_sample": top1_per_sample}


def resolve_metric(spec: str | Metric) -> Metric:
    if callable(spec):
        return spec
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise QDebugError(f"unknown metric {spec!r}",
                          f"choose {', '.join(n for n in BUILTIN if n != 'top1_per_sample')}, or your own as "
                          "package.module:function")
    from qdebug.io.modelspec import resolve

    fn = resolve(spec, from_user=True, what="metric (package.module:function)")
    if not callable(fn):
        raise QDebugError(f"metric {spec!r} is not callable",
                          "name a function metric(model, batches) as package.module:function")
    metric_direction(fn)  # checked now, not after the evaluation
    return fn


def metric_direction(metric: Metric) -> str:
    """The metric function's ``direction`` attribute, "higher" by default."""
    direction = getattr(metric, "direction", "higher")
    if direction not in ("higher", "lower"):
        raise QDebugError(f"metric {getattr(metric, '__name__', metric)}: direction {direction!r} is not "
                          "'higher' or 'lower'", 'set direction = "higher" (an accuracy) or "lower" (an error) '
                          "on the function")
    return direction


def run_metric_with_samples(metric: Metric, model, batches, *, reference=None, name: str = "metric"):
    """(values task -> float, per-sample scores task -> tensor, or None)."""
    sampler = getattr(metric, "per_sample", None)
    if sampler is True:
        sampler = metric
    if callable(sampler):
        raw = call_metric(sampler, model, batches, reference, name)
        samples = raw if isinstance(raw, dict) else {"metric": raw}
        if not all(isinstance(v, torch.Tensor) for v in samples.values()):
            raise QDebugError(f"per-sample metric {getattr(sampler, '__name__', name)} must return tensors",
                              "return one score per sample (or a dict task -> tensor)")
        samples = {str(k): v.detach().reshape(-1).double() for k, v in samples.items()}
        return {k: float(v.mean()) for k, v in samples.items()}, samples
    return run_metric(metric, model, batches, reference=reference, name=name), None


def call_metric(metric: Metric, model, batches, reference, name: str):
    kwargs = {}
    try:
        if "reference" in inspect.signature(metric).parameters:
            kwargs["reference"] = reference
    except (TypeError, ValueError):
        pass
    was_training = model.training
    model.eval()
    try:
        value = metric(model, batches, **kwargs)
    except QDebugError:
        raise
    except SystemExit as exc:
        from qdebug.io.usercode import exit_error

        raise exit_error(exc, f"metric {getattr(metric, '__name__', name)}") from exc
    except BaseException as exc:
        from qdebug.io.usercode import raised_by_user_code

        if not raised_by_user_code(exc):
            raise
        raise metric_error(metric, exc, name) from exc
    finally:
        model.train(was_training)
    check_nonnegative(value, f"metric {getattr(metric, '__name__', name)}")
    return value


NONNEGATIVE_HINT = ('for a score that can be negative, return a non-negative one: an error or loss with '
                    'direction = "lower" (a log-likelihood: its negation), or the score plus an offset')


def check_nonnegative(value: Any, source: str) -> None:
    """The rule for metric values <= 0 (docs/baseline.md): a negative value is refused, for
    every ratio of baseline, step and suggest divides by or scales the float value, and a
    ratio of signed values inverts the verdict (required = 0.99 x -1 = -0.99 > -1).  ``value``
    is what a metric returned (a number, a tensor of per-sample scores, or a dict of either);
    other types and NaN are left to the checks that follow."""
    items = value.items() if isinstance(value, dict) else [("metric", value)]
    for task, v in items:
        if isinstance(v, torch.Tensor):
            if v.is_complex() or v.numel() == 0 or v.dtype == torch.bool:
                continue
            v = float(v.detach().min())
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
            label = "" if task == "metric" else f" for task {task!r}"
            raise QDebugError(f"{source} is negative ({v:g}{label}): the ratio rule needs metric values >= 0",
                              NONNEGATIVE_HINT)


PROTOCOL = (
    "a metric is called as metric(model, batches); each batch unpacks as (inputs, target) "
    "(also batch.inputs / batch.target; target is None when the data has none); "
    "it returns a number or a dict task -> number"
)


def metric_error(metric: Metric, exc: BaseException, name: str = "metric") -> QDebugError:
    """A raising metric as one error: the metric, the exception and the user's line that raised
    it; the hint states the protocol (a built-in metric fails on the model or the data instead)."""
    from qdebug.io.usercode import where_raised

    label = getattr(metric, "__name__", name)
    where = where_raised(exc)
    detail = f": {first_line(exc)}" if message_of(exc).strip() else ""
    message = f"metric {label} raised {type(exc).__name__}{detail}" + (f", at {where}" if where else "")
    caller = _line_in(metric, exc)
    if caller and where and where.split(" (")[0] != caller:
        message += f", called from {caller}"
    in_model = _raised_in_model(exc)
    if getattr(metric, "__module__", None) == __name__:
        hint = ("the model failed on the data: check that --data matches the model's input "
                "(and holds targets for this metric); --debug shows the traceback")
    elif in_model:
        hint = (f"the model failed on the data the metric gave it (check that --data matches the model's input); "
                f"{PROTOCOL}; --debug shows the traceback")
    else:
        hint = f"{PROTOCOL}; --debug shows the traceback"
    return QDebugError(message, hint)


def _line_in(metric: Metric, exc: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``exc`` inside the metric's own source file."""
    import traceback

    from qdebug.io.usercode import shown_path

    try:
        source = inspect.getsourcefile(metric)
    except TypeError:
        return None
    if not source:
        return None
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename == source:
            return f"{shown_path(frame.filename)}:{frame.lineno}"
    return None


def _raised_in_model(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a module's forward (torch's nn.Module call is in its traceback)."""
    import traceback

    return any(
        frame.name in ("_call_impl", "_wrapped_call_impl") and frame.filename.replace("\\", "/").endswith("nn/modules/module.py")
        for frame in traceback.extract_tb(exc.__traceback__)
    )


def run_metric(metric: Metric, model, batches, *, reference=None, name: str = "metric") -> dict[str, float]:
    """Evaluate ``metric``; always a dict task -> float.  A raising metric becomes a QDebugError."""
    value = call_metric(metric, model, batches, reference, name)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {"metric": float(value)}
    if isinstance(value, dict) and value and all(isinstance(v, (int, float, torch.Tensor)) for v in value.values()):
        return {str(k): float(v) for k, v in value.items()}
    raise QDebugError(
        f"metric {getattr(metric, '__name__', name)} returned {type(value).__name__}",
        "return a number or a dict task -> number",
    )
