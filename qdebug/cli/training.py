"""The training options the commands that train QAT steps share (``nan-trace``, ``watch``):
``--lr``, ``--optimizer``, ``--loss``, ``--train``, ``--seed``, their checks, and the user's
``--train`` function wrapped so that its errors become one clear line.  Both commands run
``qdebug.tools.nan.trace.trace_steps``: the same loop, the same options, the same errors."""

from __future__ import annotations

from typing import Optional

import typer

from qdebug.errors import QDebugError, first_line

FLOAT32_MAX = 3.4028234663852886e38

LR_OPTION = typer.Option(None, "--lr", metavar="LR", help="Learning rate (default 0.01).")
OPTIMIZER_OPTION = typer.Option(None, "--optimizer", metavar="sgd|adam",
                                help="The optimizer (default sgd, momentum 0.9).")
LOSS_OPTION = typer.Option(None, "--loss", metavar="auto|ce|mse|distill",
                           help="auto: cross-entropy for class targets, MSE for float targets, "
                                "distillation to the float-mode output without targets.")
TRAIN_OPTION = typer.Option(None, "--train", metavar="PKG.MODULE:FUNCTION",
                            help="Your training step, called as function(model, batch) -> loss.")
SEED_OPTION = typer.Option(None, "--seed", metavar="N", help="Seed of the run (default 0).")


def check_training(*, lr: Optional[float], optimizer: Optional[str], loss: Optional[str], train: Optional[str],
                   seed: Optional[int]) -> None:
    """The training options' values, checked before any work starts (one ``error:`` line each)."""
    if lr is not None and not 0 <= lr <= FLOAT32_MAX:
        raise QDebugError(f"--lr must be a number from 0 to 3.4e38 (float32's largest), got {lr}", "e.g. --lr 0.01")
    if optimizer is not None and optimizer not in ("sgd", "adam"):
        raise QDebugError(f"--optimizer {optimizer!r} is not sgd or adam", "e.g. --optimizer adam")
    if loss is not None and loss not in ("auto", "ce", "mse", "distill"):
        raise QDebugError(f"--loss {loss!r} is not one of auto, ce, mse, distill", "e.g. --loss mse")
    if train and loss is not None:
        raise QDebugError("--train computes the loss itself: --loss does not apply", "give one of --train and --loss")
    if seed is not None:
        from qdebug.data.limits import check_seed

        check_seed(seed, "--seed", "e.g. --seed 1")


def trainer(spec: Optional[str]):
    """The user's ``--train package.module:function`` (their trusted code), wrapped so that its
    own errors become one clear line."""
    if not spec:
        return None
    from qdebug.io.modelspec import resolve
    from qdebug.io.usercode import raised_by_user_code, where_raised

    fn = resolve(spec, from_user=True, what="train function")
    if not callable(fn):
        raise QDebugError(f"--train {spec} is not callable", "name a function: def step(model, batch): ... return loss")

    def train(model, batch):
        try:
            return fn(model, batch)
        except BaseException as exc:  # SystemExit too: a training step has no business ending qdebug
            if not raised_by_user_code(exc):  # Ctrl-C, a NonFiniteError, a QDebugError
                raise
            where = where_raised(exc)
            raise QDebugError(f"the --train function {spec} raised {type(exc).__name__}: {first_line(exc)}"
                              + (f", at {where}" if where else ""),
                              "it is called as function(model, batch) and returns the loss; --debug shows the "
                              "traceback") from exc
    return train
