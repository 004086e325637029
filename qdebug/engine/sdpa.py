"""``F.scaled_dot_product_attention`` written inline, decomposed: ``decomposed_sdpa``, ``ScaledGrid``.

Inside a forward the engine names, the naming context (``qdebug.engine.context``) hands every
SDPA call to ``decomposed_sdpa`` (registered here, at import; ``qdebug.engine`` imports this
module, so it is registered whenever the engine is loaded): ``matmul`` (QK^T), ``softmax`` and
``matmul#2`` (attn.V) become calls of the container, the scale, masks and dropout stay hidden
floats.  The scale has no point: the scaled q lies on q's grid scaled by c (``ScaledGrid``, which
``qdebug.engine.attention``'s ``QScale`` tags too), so the integer QK^T folds c into its multiplier.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from qdebug.engine.context import _pop_mode, _push_mode, register_decomposition
from qdebug.engine.point import grid_of, tag


class ScaledGrid:
    """The grid of a point's values times a constant c > 0: the same codes, scale s c.

    Integer kernels read ``spec``, ``scale`` and ``zero_point`` of a grid; the scale is kept
    in float64 so M = s c s' / s_y is the exact product."""

    def __init__(self, point: Any, factor: float):
        self.point = point
        self.spec = point.spec
        self.scale = point.scale.detach().double() * factor
        self.zero_point = point.zero_point
        self.name = f"{point.name}*{factor:g}"
        self.initialized = True


def decomposed_sdpa(ctx: Any, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention`` inside a forward the engine names (``ctx``): torch's
    reference math (its documentation's), with ``q @ kᵀ``, the softmax and ``p @ v`` as calls of
    their own -- ``<container>.matmul``, ``.softmax``, ``.matmul#2`` -- and the scale, the masks
    and the dropout hidden from the engine (float, no point; the scale folds into QK^T's
    multiplier as in ``QMultiheadAttention``).  While those points are float (or the model is
    not prepared), torch's own kernel gives the output: bit-identical to an unprepared run."""
    if _push_mode is None:  # pragma: no cover (torch < 2.0): one float call, as before
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    # torch runs a mode's __torch_function__ with the mode off its stack: back on it, the parts
    # below reach ``ctx`` as calls.
    _push_mode(ctx)
    try:
        return _decomposed_sdpa(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    finally:
        _pop_mode()


def _decomposed_sdpa(ctx: Any, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None,
                     dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> Tensor:
    before = dict(ctx.counts)
    factor = float(scale) if scale is not None else float(query.size(-1)) ** -0.5
    query_in, key_in, value_in = query, key, value
    ctx.busy += 1
    try:
        q = torch.mul(query, factor)
        point = grid_of(query)
        if point is not None and not point.spec.per_channel and factor > 0:
            tag(q, ScaledGrid(point, factor))
        bias = _sdpa_bias(query, key, attn_mask, is_causal)
        if enable_gqa and key.size(-3) != query.size(-3):
            groups = query.size(-3) // key.size(-3)
            # Repeated heads keep their codes: the grid tags carry over.
            key = tag(key.repeat_interleave(groups, -3), grid_of(key))
            value = tag(value.repeat_interleave(groups, -3), grid_of(value))
    finally:
        ctx.busy -= 1
    scores = torch.matmul(q, key.transpose(-2, -1))
    if bias is not None:
        ctx.busy += 1
        try:
            scores = scores + bias
        finally:
            ctx.busy -= 1
    weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, dropout_p, training=True)
    out = torch.matmul(weights, value)
    names = _new_calls(before, ctx.counts)
    if not _sdpa_points_float(ctx, names):
        return out
    ctx.busy += 1
    try:
        with ctx._off_the_mode_stack():
            return F.scaled_dot_product_attention(query_in, key_in, value_in, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    finally:
        ctx.busy -= 1


def _sdpa_bias(query: Tensor, key: Tensor, attn_mask: Tensor | None, is_causal: bool) -> Tensor | None:
    """The additive float mask of SDPA: -inf where a bool mask is False or above the causal diagonal."""
    if attn_mask is None and not is_causal:
        return None
    length, source = query.size(-2), key.size(-2)
    bias = torch.zeros(length, source, dtype=query.dtype, device=query.device)
    if is_causal:
        keep = torch.ones(length, source, dtype=torch.bool, device=query.device).tril(diagonal=0)
        bias = bias.masked_fill(keep.logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = bias.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            bias = attn_mask + bias
    return bias


def _new_calls(before: dict[str, int], after: dict[str, int]) -> list[str]:
    names = []
    for base, count in after.items():
        for index in range(before.get(base, 0) + 1, count + 1):
            names.append(base if index == 1 else f"{base}#{index}")
    return names


def _sdpa_points_float(ctx: Any, names: list[str]) -> bool:
    if getattr(ctx.handler, "tracing", False):  # qdebug.engine.plan.TraceHandler
        return False  # tracing: the decomposition is what gets recorded
    state = getattr(ctx.handler, "state", None)
    if state is None:
        return True
    return all(state.points[n].mode == "float" for n in names if n in state.points)


register_decomposition(F.scaled_dot_product_attention, decomposed_sdpa)
