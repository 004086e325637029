"""``nan-trace``: train (or run) a model step by step until its first non-finite value, and say why.

``trace_steps(model, batches, steps=...)`` runs ``steps`` training steps (forward, loss,
backward, optimizer step) cycling over ``batches`` -- or, with ``steps=0``, one forward
per batch -- watching every tensor cheaply (``qdebug.tools.nan.detect``).  Before each
step it snapshots the model, the optimizer and the RNG; when a step's cheap check
flags a non-finite value it restores the snapshot and re-runs that step in detail, so
the finding names the phase, the call, its quant point, the counts and whether the
call created the value.  ``qdebug.tools.nan.causes`` then says why, from the finding
and the timeline of the steps before.  With ``float_model`` the same steps are run on
the plain float architecture: whether quantization is to blame at all.

A repro bundle keeps the run's diagnosis (``run_record``); its one-step replay has no
history, so ``against_run`` reads the replay's finding against it: at the same place the
run's diagnosis stands (it saw the same step and the steps before), and the replay's own
verdict is quoted beside it, never contradicting it silently.

The loss: ``train(model, batch) -> loss`` when given (the user's code), else by the
targets: class indices -> cross-entropy, float targets -> MSE, none -> distillation to
the model's own output with every quant point off.  Deterministic for a seed.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from qdebug.data.source import BatchSource
from qdebug.data.spec import as_source
from qdebug.data.batch import Batch
from qdebug.engine import engine_state, is_prepared, quantization_off
from qdebug.engine.context import run_model
from qdebug.engine.fusebn import freeze_bn_stats, frozen_bn_paths
from qdebug.errors import QDebugError, shown
from qdebug.tools.nan.causes import StepStats, diagnose, evidence_for
from qdebug.tools.nan.detect import Finding, NonFiniteError, Watch, consumers_of

LOSSES = ("auto", "ce", "mse", "distill")
CONTAINED_EVERY = 16  # cheap steps that also look for contained non-finite values: 0, 16, 32, ...
OPTIMIZERS = ("sgd", "adam")
SGD_MOMENTUM = 0.9
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclass
class Snapshot:
    """The model, optimizer and RNG just before a step: enough to run the step again."""

    model_state: dict[str, torch.Tensor]
    optimizer_state: dict | None
    rng_state: torch.Tensor
    step: int
    batch: int
    other_rng: tuple = ()  # Python's, numpy's and CUDA's generator states (a user's data or training code may draw)


@dataclass
class TraceResult:
    first: dict | None  # the finding plus cause, detail, fix; None when every step stayed finite
    timeline: list[StepStats]
    steps_run: int
    float_check: dict | None = None
    snapshot: Snapshot | None = None  # before the failing step (for the repro bundle)
    failing_batch: Batch | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def frame(self):
        import pandas as pd

        columns = list(StepStats(0, 0).row())
        return pd.DataFrame([s.row() for s in self.timeline], columns=columns)


# What a repro bundle keeps of the run's finding (``run_record``): where, why, and the steps of
# history the diagnosis had.
RUN_TEXT_KEYS = ("phase", "layer", "what", "cause", "detail", "fix")
RUN_COUNT_KEYS = ("step", "history")


def run_record(first: dict, history: int) -> dict:
    """The run's finding as a repro bundle keeps it (``against_run`` reads a replay against it)."""
    return {**{k: str(first.get(k) or "") for k in RUN_TEXT_KEYS}, "step": int(first["step"]), "history": history}


def against_run(first: dict | None, run: dict, history: int) -> dict | None:
    """A replay's finding (``history``: the finite steps it saw before) read against ``run``,
    the record of the run that wrote its bundle.  The same place (phase, layer, what) with
    another cause: the run's diagnosis stands when it had more history (the replay's own
    verdict is quoted in the detail); another place: the run's finding is quoted."""
    if first is None:
        return None
    if any(first.get(k) != run[k] for k in ("phase", "layer", "what")):
        return {**first, "detail": f"{first['detail']} [the run that wrote this bundle found its first value "
                f"elsewhere: {run['cause']} at {run['layer']} ({run['phase']} of its step {run['step']})]"}
    if first["cause"] == run["cause"] or history >= run["history"]:
        return first
    return {**first, "cause": run["cause"], "fix": run["fix"],
            "detail": f"{run['detail']} [the diagnosis of the run that wrote this bundle, from the {run['history']} "
                      f"step(s) before its step {run['step']}; this replay saw {history} step(s) before and alone "
                      f"would say {first['cause']}: {first['detail']}]"}


def make_optimizer(model: nn.Module, name: str, lr: float) -> torch.optim.Optimizer | None:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=SGD_MOMENTUM)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise QDebugError(f"unknown optimizer {name!r}", f"choose one of {', '.join(OPTIMIZERS)}")


def check_optimizer_state(saved: Any, optimizer: torch.optim.Optimizer, name: str) -> dict:
    """A repro bundle's optimizer state (a file's), checked to have the shape of ``optimizer``'s
    own: the same setting names with values of the same types (numbers within float32's range:
    a huge int overflows inside the optimizer's step), and per parameter only tensors shaped
    like it.  Values are not judged: NaN in a momentum buffer is what nan-trace is for.

    Returns the state to load.  ``load_state_dict`` takes the saved groups wholesale, so a
    setting missing from the file would be missing in the step (a KeyError inside torch):
    every numeric setting (lr, momentum, dampening, weight_decay, betas, eps...) is required,
    as a default would replay another run than the one saved; a missing flag (a bool or None,
    like nesterov or foreach: torch adds them over versions, off by default) takes
    ``optimizer``'s own value, as torch's ``__setstate__`` does for the flags it knows."""
    own = optimizer.state_dict()

    def bad(what: str) -> QDebugError:
        return QDebugError(f"the saved optimizer state does not fit --optimizer {name}: {what}",
                           "use the optimizer the bundle was made with, or trace the original checkpoint again")

    if not isinstance(saved, dict):
        raise bad(f"it is a {type(saved).__name__}, not a table of state and param_groups")
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(own["param_groups"]):
        raise bad(f"it has {shown(groups)} as its param_groups")
    shapes: dict[Any, torch.Size] = {}
    filled = []
    for i, (group, mine) in enumerate(zip(groups, own["param_groups"])):
        if not isinstance(group, dict) or "params" not in group:
            raise bad(f"param group {i} is not a table of {', '.join(sorted(mine))}")
        missing = [key for key, value in mine.items() if key not in group and not _is_flag(value)]
        if missing:
            raise bad(f"param group {i} lacks {', '.join(map(repr, missing))}")
        for key, value in group.items():
            # A setting this torch lacks (a bundle from another version) is ignored by the
            # optimizer, but still a plain value.
            template = mine.get(key, value if value is None or isinstance(value, (bool, str)) else 0.0)
            if key != "params" and not _same_kind(value, template):
                raise bad(f"param group {i} has {shown(key)} = {shown(value)}")
        params = group["params"]
        if not isinstance(params, list) or len(params) != len(mine["params"]) \
                or not all(isinstance(p, int) and not isinstance(p, bool) for p in params):
            raise bad(f"param group {i} lists {shown(params)} as its params")
        shapes.update(zip(params, (p.shape for p in optimizer.param_groups[i]["params"])))
        filled.append({**{key: value for key, value in mine.items() if key != "params"}, **group})
    state = saved.get("state", {})
    if not isinstance(state, dict):
        raise bad(f"its state is a {type(state).__name__}")
    for key, entry in state.items():
        if key not in shapes or not isinstance(entry, dict):
            raise bad(f"it holds state for {shown(key)}, which is no parameter of its groups")
        for what, value in entry.items():
            if what == "step" and _same_kind(value, 0.0):
                continue
            if not isinstance(value, torch.Tensor) or (what != "step" and value.shape != shapes[key]):
                raise bad(f"parameter {key}'s {shown(what)} is not a tensor of shape {list(shapes[key])}")
    return {**saved, "param_groups": filled}


def _is_flag(value: Any) -> bool:
    """An optimizer setting that is a switch (nesterov, foreach, fused...), not a number."""
    return value is None or isinstance(value, bool)


def _same_kind(value: Any, template: Any) -> bool:
    """``value`` is of ``template``'s kind: a bool, a number within float32's range (NaN is
    not), a tuple of such numbers, None (or a bool where None is a default, e.g. foreach)."""
    if template is None:
        return value is None or isinstance(value, bool)
    if isinstance(template, bool):
        return isinstance(value, bool)
    if isinstance(template, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and -FLOAT32_MAX <= value <= FLOAT32_MAX
    if isinstance(template, (tuple, list)):
        return isinstance(value, (tuple, list)) and len(value) == len(template) \
            and all(_same_kind(v, t) for v, t in zip(value, template))
    if isinstance(template, torch.Tensor):
        return isinstance(value, torch.Tensor) and value.numel() == template.numel()
    return isinstance(value, type(template))


def compute_loss(model: nn.Module, batch: Batch, kind: str, train: Callable | None) -> torch.Tensor:
    """The step's loss (module docstring); a clean error when the data cannot give one."""
    if train is not None:
        loss = train(model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not torch.is_floating_point(loss):
            what = f"a {loss.dtype} tensor of {loss.numel()} value(s)" if isinstance(loss, torch.Tensor) else \
                type(loss).__name__
            raise QDebugError(f"the --train function returned {what}, not a floating-point scalar loss",
                              "return the loss: def step(model, batch): ... return loss")
        if not loss.requires_grad:
            raise QDebugError("the --train function's loss does not depend on the model's parameters "
                              "(computed without the model, under torch.no_grad, or detached)",
                              "return the loss the model's output gives, not a copy or a number")
        return loss.reshape(())
    if kind == "distill" or (kind == "auto" and batch.target is None):
        if not is_prepared(model):
            raise QDebugError("no targets to train against, and a float model has no quantized output to distil",
                              "give data with targets, or --train package.module:function")
        with torch.no_grad(), quantization_off(model):
            teacher = run_model(model, batch.inputs)
        return _pairwise(run_model(model, batch.inputs), teacher, "mse")
    if batch.target is None:
        raise QDebugError(f"--loss {kind} needs targets, and the data has none", "give (inputs, target) data")
    return _pairwise(run_model(model, batch.inputs), batch.target, kind)


def _pairwise(output: Any, target: Any, kind: str) -> torch.Tensor:
    if isinstance(output, dict) and isinstance(target, dict):
        shared = [k for k in output if k in target]
        if not shared:
            raise QDebugError("the model's outputs and the targets share no key", "name targets by output key")
        return sum(_pairwise(output[k], target[k], kind) for k in shared)
    if isinstance(output, (tuple, list)) and isinstance(target, (tuple, list)) and len(output) == len(target):
        return sum(_pairwise(o, t, kind) for o, t in zip(output, target))
    if not isinstance(output, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise QDebugError(f"cannot compute a loss between a {type(output).__name__} output and a "
                          f"{type(target).__name__} target", "give --train package.module:function for this model")
    if kind in ("auto", "ce") and not torch.is_floating_point(target):
        if output.dim() == target.dim() + 1 and output.shape[:-1] == target.shape:  # classes last: [B, L, C]
            return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), target.long().reshape(-1))
        if output.dim() == target.dim() + 1 and output.shape[:1] + output.shape[2:] == target.shape:  # [B, C, ...]
            return F.cross_entropy(output.float(), target.long())
        raise QDebugError(f"class targets of shape {list(target.shape)} do not fit outputs of shape "
                          f"{list(output.shape)}", "give class indices shaped like the output without its class "
                          "dimension (the last, or the second)")
    if kind == "ce":
        raise QDebugError("--loss ce needs integer class targets", "use --loss mse for float targets")
    if output.shape != target.shape:
        raise QDebugError(f"float targets of shape {list(target.shape)} do not match outputs of shape "
                          f"{list(output.shape)}", "give targets shaped like the output, or --train")
    return F.mse_loss(output.float(), target.float())


def trace_steps(model: nn.Module, batches: Iterable[Batch], *, steps: int, loss: str = "auto", optimizer: str = "sgd",
                lr: float = 0.01, seed: int = 0, train: Callable | None = None,
                optimizer_state: dict | None = None, rng_state: torch.Tensor | None = None,
                float_model: nn.Module | None = None, float_kind: str = "plain",
                progress: Callable[[int, int], None] | None = None,
                on_step: Callable[[float], None] | None = None) -> TraceResult:
    """Run ``steps`` steps (0: forward passes only) until the first non-finite value (module docstring).
    ``batches``: a list or a ``BatchSource``, read lazily, pass after pass while the steps cycle.
    ``on_step(loss)``: called after each finite step's update (``qdebug watch`` looks at the run there)."""
    batches = as_source(batches)
    if loss not in LOSSES:
        raise QDebugError(f"unknown loss {loss!r}", f"choose one of {', '.join(LOSSES)}")
    _seed_all(seed)
    if rng_state is not None:
        torch.set_rng_state(rng_state)
    run = _Run(model, batches, steps=steps, loss=loss, optimizer=optimizer, lr=lr, train=train, saturation=True)
    if optimizer_state is not None and run.optimizer is not None:
        optimizer_state = check_optimizer_state(optimizer_state, run.optimizer, optimizer)
        try:
            run.optimizer.load_state_dict(optimizer_state)
        except (ValueError, KeyError, TypeError) as exc:
            raise QDebugError(f"the saved optimizer state does not fit --optimizer {optimizer}: {exc}",
                              "use the optimizer the bundle was made with") from None
    finding = run.go(progress, on_step)
    contained = [{"phase": k[0], "layer": k[1], "what": k[2], "step": step} for k, step in run.contained.items()]
    result = TraceResult(None, run.history, run.steps_run, meta={
        "steps": steps, "loss": run.loss_kind, "optimizer": optimizer if steps else None,
        "lr": lr if steps else None, "seed": seed, "batches": run.batch_count, "contained": contained})
    if finding is not None:
        if run.failing_snapshot is not None:  # the evidence as the step found it (BN statistics, scales)
            run.restore(run.failing_snapshot)
        diagnosis = diagnose(finding, run.evidence(finding))
        result.first = {**finding.to_dict(), "cause": diagnosis.cause, "detail": diagnosis.detail,
                        "fix": diagnosis.fix}
        result.snapshot = run.failing_snapshot
        result.failing_batch = run.failing_batch
    if float_model is not None:
        _seed_all(seed)
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        # All the requested steps, not only those up to the finding: a float model that fails a
        # few steps later is no proof that quantization is to blame.
        check = _Run(float_model, batches, steps=steps, loss=loss, optimizer=optimizer, lr=lr, train=train,
                     saturation=False, float_check=True)
        float_finding = check.go(None)
        result.float_check = {"finite": float_finding is None, "steps": check.steps_run, "model": float_kind,
                              "first": float_finding.to_dict() if float_finding is not None else None}
    return result


class _Run:
    """One traced run: the loop, its snapshots, the cheap checks and the detailed re-run."""

    def __init__(self, model: nn.Module, batches: BatchSource, *, steps: int, loss: str, optimizer: str, lr: float,
                 train: Callable | None, saturation: bool, float_check: bool = False):
        self.model = model
        self.batches = batches
        self.steps = steps
        self.train = train
        self.loss_kind = "train" if train is not None else loss
        self.lr = lr
        self.optimizer_name = optimizer
        self.optimizer = make_optimizer(model, optimizer, lr) if steps else None
        if steps and self.optimizer is None:
            raise QDebugError("the model has no trainable parameters: there is nothing to train",
                              "trace its forward passes with --steps 0")
        self.float_check = float_check
        self.history: list[StepStats] = []
        self.steps_run = 0
        self.failing_snapshot: Snapshot | None = None
        self.failing_batch: Batch | None = None  # the batch of the failing step (the only batch kept)
        self._seen = 0  # batches the steps have reached, while the data's count is unknown
        self.contained: dict[tuple, int] = {}  # (phase, layer, what) of a contained non-finite value -> first step
        consumers = consumers_of(engine_state(model).plan) if is_prepared(model) else _traced_consumers(model, batches)
        self.watch = Watch(model, detail=False, saturation=saturation, consumers=consumers)
        self._buffers: dict[str, Any] = {}  # the last snapshot, whose tensors the next one reuses
        self.params = [(n, p) for n, p in model.named_parameters()]

    # -- the loop ---------------------------------------------------------------------
    @property
    def batch_count(self) -> int:
        """Batches in the data: known once a pass has counted them, else the ones the steps saw."""
        count = self.batches.count
        return count if count is not None else self._seen

    def _schedule(self) -> Iterator[tuple[int, Batch]]:
        """(batch index, batch) for each step: one pass (``steps`` 0), else passes over the data
        until ``steps`` steps, each pass reading the batches anew."""
        done = 0
        while not self.steps or done < self.steps:
            for batch_index, batch in enumerate(self.batches):
                self._seen = max(self._seen, batch_index + 1)
                yield batch_index, batch
                done += 1
                if self.steps and done == self.steps:
                    return
            if not self.steps or not self._seen:
                return

    def go(self, progress: Callable[[int, int], None] | None,
           on_step: Callable[[float], None] | None = None) -> Finding | None:
        total = self.steps if self.steps else self.batches.count
        if self.steps:
            self.model.train()
        else:
            self.model.eval()
        with self.watch:
            for step, (batch_index, batch) in enumerate(self._schedule()):
                found = self._one(step, batch_index, batch)
                self.steps_run = step + 1
                if found is None and on_step is not None:
                    on_step(self.history[-1].loss)
                if progress is not None:
                    progress(step + 1, total)
                if found is not None:
                    self.failing_batch = batch
                    return found
        return None

    def _one(self, step: int, batch_index: int, batch: Batch) -> Finding | None:
        snapshot = self._snapshot(step, batch_index)
        stats = StepStats(step, batch_index)
        self.watch.detail = False
        self.watch.look_contained = step % CONTAINED_EVERY == 0
        try:
            # What the step starts from: the last step's checks passed it, so only the first is checked.
            self.watch.begin(step, batch_index, batch.size(), check=not self.history)
            self._step(batch, stats)
        except NonFiniteError as exc:
            self.failing_snapshot = snapshot
            return exc.finding
        failed, contained = self.watch.flush()
        if failed is None:
            if contained is not None:
                self.contained.setdefault(contained[:3], step)
            self.history.append(stats)
            return None
        # Re-run the step in detail from the snapshot: the first non-finite value, with its story.
        self.restore(snapshot)
        self.failing_snapshot = snapshot
        self.watch.detail = True
        try:
            self.watch.begin(step, batch_index, batch.size())
            self._step(batch, StepStats(step, batch_index))
        except NonFiniteError as exc:
            return exc.finding
        finally:
            self.watch.detail = False
        # The re-run stayed finite: the step is not reproducible from its snapshot.
        phase, layer, what, tensor = failed
        return Finding(phase, layer, "", what, tensor=tensor, step=step, batch=batch_index, reproducible=False)

    def _step(self, batch: Batch, stats: StepStats) -> None:
        watch = self.watch
        if not self.steps:
            with torch.no_grad():
                run_model(self.model, batch.inputs)
            watch.check_scales("observer")
            stats.take_saturation(watch.point_saturation)
            return
        self.optimizer.zero_grad(set_to_none=True)
        loss = compute_loss(self.model, batch, self.loss_kind, self.train)
        watch.check_scales("observer")
        watch.check_loss(loss)
        stats.take_saturation(watch.point_saturation)
        stats.loss = float(loss.detach())
        if not math.isfinite(stats.loss):
            return  # flagged: the detailed re-run says where
        try:
            loss.backward()
        except RuntimeError as exc:
            if self.train is not None and ("second time" in str(exc) or "does not require grad" in str(exc)):
                raise QDebugError(f"the --train function's loss cannot be back-propagated: {str(exc).splitlines()[0]}",
                                  "return the loss the model computed, without calling backward() on it") from None
            raise
        grads = [(n, p.grad.detach()) for n, p in self.params if p.grad is not None]
        if grads:
            names, tensors = [n for n, _ in grads], [g for _, g in grads]
            norms = list(torch._foreach_norm(tensors))
            watch.check_grads(norms, tensors)
            stats.take_grad_norms(names, _unoverflowed(norms, tensors))
        try:
            self.optimizer.step()
        except RuntimeError as exc:
            if "overflow" not in str(exc):
                raise
            # The optimizer's own step size (lr over a bias correction) left float32's range.
            raise NonFiniteError(Finding("update", "optimizer", self.optimizer_name, "param", tensor="step size",
                                         created=True, dtype="float32", step=stats.step, batch=stats.batch)) from None
        watch.check_scales("update")
        tensors = [p.detach() for _, p in self.params]
        if tensors:
            maxima = torch._foreach_norm(tensors, float("inf"))
            watch.check_params(list(maxima))
            stats.take_weight_maxima([n for n, _ in self.params], maxima)

    # -- snapshots ----------------------------------------------------------------------
    def _snapshot(self, step: int, batch: int) -> Snapshot:
        """Copied into the buffers of the last snapshot when shapes agree: after the first steps a
        snapshot allocates nothing (no page faults).  A snapshot is valid until the next one."""
        state = _copy_into(self._buffers.get("model"), self.model.state_dict())
        opt = _copy_into(self._buffers.get("optimizer"), self.optimizer.state_dict()) \
            if self.optimizer is not None else None
        self._buffers = {"model": state, "optimizer": opt}
        return Snapshot(state, opt, torch.get_rng_state(), step, batch, _other_rng_states())

    def restore(self, snapshot: Snapshot) -> None:
        self.model.load_state_dict(snapshot.model_state)
        if self.optimizer is not None and snapshot.optimizer_state is not None:
            self.optimizer.load_state_dict(copy.deepcopy(snapshot.optimizer_state))
        torch.set_rng_state(snapshot.rng_state)
        _set_other_rng_states(snapshot.other_rng)
        if is_prepared(self.model):
            for point in engine_state(self.model).points.values():
                point.forget_cached()

    # -- evidence for the causes --------------------------------------------------------------
    def evidence(self, finding: Finding):
        batch = self.failing_batch
        return evidence_for(self.model, inputs=batch.inputs, targets=batch.target, history=list(self.history),
                            lr=self.lr if self.steps else None,
                            optimizer=self.optimizer_name if self.steps else None)


def _traced_consumers(model: nn.Module, batches: BatchSource) -> dict[str, list[str]]:
    """A plain model's call graph, from one traced forward of the first batch."""
    from qdebug.engine.plan import trace_plan

    was_training = model.training
    try:
        with torch.no_grad():
            plan = trace_plan(model.eval(), batches[0].inputs)
    except Exception:  # only a fallback for naming backward culprits; the run itself reports a failing model
        return {}
    finally:
        model.train(was_training)
    return consumers_of(plan)


def _copy_into(old: Any, new: Any) -> Any:
    """A deep copy of ``new`` (nested dicts and lists of tensors and plain values), written into
    the tensors of ``old`` wherever the structure, shape and dtype agree."""
    if isinstance(new, torch.Tensor):
        if isinstance(old, torch.Tensor) and old.shape == new.shape and old.dtype == new.dtype:
            return old.copy_(new.detach())
        return new.detach().clone()
    if isinstance(new, dict):
        old = old if isinstance(old, dict) else {}
        return type(new)((k, _copy_into(old.get(k), v)) for k, v in new.items())
    if isinstance(new, (list, tuple)):
        old = old if isinstance(old, (list, tuple)) and len(old) == len(new) else [None] * len(new)
        return type(new)(_copy_into(o, v) for o, v in zip(old, new))
    return copy.deepcopy(new)


def _unoverflowed(norms: list[torch.Tensor], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Float32 2-norms, each one that overflowed on finite values taken again in float64 (the
    timeline's gradient norms stay numbers while they grow past 1e19)."""
    flat = torch.stack([n.reshape(()) for n in norms])
    if bool(torch.isfinite(flat).all()):
        return norms
    return [n if bool(torch.isfinite(n)) else torch.linalg.vector_norm(t, dtype=torch.float64)
            for n, t in zip(norms, tensors)]


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        pass


def _other_rng_states() -> tuple:
    """Python's, numpy's and CUDA's generator states (CUDA's once it has started: dropout on the
    GPU draws from it, and a re-run step must draw the same masks)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        import numpy as np

        return random.getstate(), np.random.get_state(), cuda
    except ImportError:  # pragma: no cover
        return random.getstate(), None, cuda


def _set_other_rng_states(states: tuple) -> None:
    if not states:
        return
    random.setstate(states[0])
    if states[1] is not None:
        import numpy as np

        np.random.set_state(states[1])
    if len(states) > 2 and states[2] is not None:
        torch.cuda.set_rng_state_all(states[2])


def plain_float_model(model: nn.Module, spec, *, strict: bool = False) -> tuple[nn.Module, str]:
    """The float architecture ``spec`` (a ModelSpec) built without the engine, holding ``model``'s
    weights: every parameter and buffer it has, found under the same name and shape in ``model``.
    When ``model`` lacks some (BN folded away by fuse_bn), a copy of ``model`` with every quant
    point off stands in: the same float function, computed by the engine's modules.  Returns
    (the model, "plain" or "quantization off")."""
    from qdebug.config.device import model_device
    from qdebug.io.modelspec import build

    plain = build(spec, from_user=True)
    device = model_device(model)
    if device is not None:  # built on the CPU: it runs where the traced model runs
        plain.to(device)
    source = model.state_dict()
    wanted = plain.state_dict()
    if all(k in source and source[k].shape == v.shape for k, v in wanted.items()):
        plain.load_state_dict({k: source[k].detach().clone() for k in wanted})
        for path in frozen_bn_paths(model):  # the same steps: BN statistics frozen where they were
            if isinstance(dict(plain.named_modules()).get(path), nn.modules.batchnorm._BatchNorm):
                freeze_bn_stats(plain, path)
        return plain, "plain"
    if strict:  # an architecture the user named: it must hold these weights
        missing = [k for k, v in wanted.items() if k not in source]
        shaped = [k for k, v in wanted.items() if k in source and source[k].shape != v.shape]
        what = f"lacks {missing[0]}" if missing else f"has {shaped[0]} shaped {list(source[shaped[0]].shape)}, " \
            f"not {list(wanted[shaped[0]].shape)}"
        raise QDebugError(f"the float architecture {spec.target} does not fit the checkpoint's weights (the "
                          f"checkpoint {what})", "give --float the float checkpoint of this same model")
    stand_in = copy.deepcopy(model)
    if is_prepared(stand_in):
        for point in engine_state(stand_in).points.values():
            point.mode = "float"
    return stand_in, "quantization off"
