"""compare's rows for the quant points inside a recurrent layer (issue 28, item 1).

An LSTM or GRU is one call, whose output tensors get rows (``lstm:0``, ``lstm:1.0``,
``lstm:1.1``), but its quant points sit inside the step loop (``lstm.l0.forget_gate``,
``lstm.l0.cell``, ...; ``qdebug.engine.recurrent``) and a call's rows never reached them.
Each such point gets a row of its own here, named ``<call>.<local>`` (``lstm.l0.cell``:
the point's own name; ``lstm#2.l0.cell`` for a second call of the layer), placed before the
layer's output rows, in the order the step runs.

Per call, x = the reference layer's values of the point at every step, y = the compared
layer's, both stacked over the steps and laid out ``[steps x batch, features]`` so the
per-channel columns are per hidden unit (or gate row).  A torch ``nn.LSTM`` reference runs
the engine's step loop without points (its float function; the fused kernel has no steps).
The isolated values: the compared layer run step by step on the reference's operands
(``step_values(..., teacher=...)``): every op reads the reference's tensors, so each row's
isolated error is its own op, weights and point alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from qdebug.engine.recurrent import step_names, step_values


def inner_rows(call: str, module: nn.Module | None) -> list[tuple[str, str]]:
    """(row name, local point name) of each step point of ``call`` when its module is an
    LSTM/GRU (cell) the engine runs; [] for any other call."""
    if module is None:
        return []
    names = step_names(module)
    return [(f"{call}.{local}", local) for local in names or ()]


def row_op(module: nn.Module, local: str) -> str:
    """The ``type`` column of a step row: the point's op, ``LSTM.cell``."""
    base = next(cls for cls in type(module).__mro__ if cls.__module__.startswith("torch.nn"))
    return f"{base.__name__}.{local.rpartition('.')[2]}"


def features(t: torch.Tensor) -> torch.Tensor:
    """``[steps, batch, ..., features]`` -> ``[steps x batch x ..., features]``."""
    return t.reshape(-1, t.shape[-1]) if t.dim() >= 2 else t.reshape(1, -1)


def measure(module: nn.Module, args: tuple, reference: nn.Module, ref_args: tuple, ref_kwargs: dict,
            iso_args: tuple | None) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]] | None:
    """local name -> (x, y, y before its point, isolated y or None), each laid out by
    ``features``; None when either side cannot be stepped (a PackedSequence input)."""
    ref = step_values(reference, ref_args, ref_kwargs)
    own = step_values(module, args)
    if ref is None or own is None:
        return None
    iso = step_values(module, iso_args, ref_kwargs, teacher=ref[0]) if iso_args is not None else None
    out = {}
    for local, y in own[0].items():
        x = ref[0].get(local)
        if x is None:
            continue
        iso_y = features(iso[0][local]) if iso is not None and local in iso[0] else None
        out[local] = (features(x), features(y), features(own[1][local]), iso_y)
    return out
