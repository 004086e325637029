"""``nn.MultiheadAttention`` as deployments run it: ``QMultiheadAttention``.

``prepare`` swaps every ``nn.MultiheadAttention`` for a ``QMultiheadAttention`` before it
traces the model (``swap_attention``), so the attention's parts are calls of their own,
named under the module's path and quantized by the engine's usual machinery:

    linear_Q, linear_K, linear_V   QLinear: weight point + output point    (torch.ao: same)
    q_scaling                      q * head_dim^-1/2, no point              (torch.ao: unobserved mul_scalar)
    bmm                            QK^T, an integer matmul, output point    (torch.ao: float)
    mask                           attn_mask / key_padding_mask, float      (torch.ao: float)
    softmax                        output point (see docs/engine.md)        (torch.ao: float)
    dropout                        float, as torch does
    bmm#2                          attn.V, an integer matmul, output point  (torch.ao: quant_attn_output)
    out_proj                       QLinear: weight point + output point     (torch.ao: same)
    quant_attn_output_weights      the returned weights' point              (torch.ao: same)
    average_heads                  mean over heads of the returned weights, float (torch.ao: same)

The layout follows ``torch.ao.nn.quantizable.MultiheadAttention`` (``from_float`` splits
``in_proj_weight`` the same way): with ``bmm`` and ``softmax`` in float mode, the
fake-quant forward is bit-identical to torch.ao's on the same qparams.  Two places differ
on purpose: torch.ao's ``batch_first=True`` output reshapes (B*H, L, d) straight to
(B, L, E), mixing heads and positions when H > 1 (here heads are put back as
``nn.MultiheadAttention`` does), and a float ``key_padding_mask`` is added (torch.ao
refuses it).

Float mode: torch's own kernels (the fused fast path, ``scaled_dot_product_attention``
when ``need_weights=False``) sum in orders no decomposition reproduces.  So while every
point of the module is in float mode, the module returns ``nn.MultiheadAttention``'s own
forward on the same weights (bit-identical); the decomposition still runs first, so
listeners see every internal call.  The scale c = head_dim^-1/2 has no point: the scaled q
lies on q's grid scaled by c (``ScaledGrid``), so the integer QK^T folds c into its
multiplier M = s_q c s_k / s_y, as torch's quantized ``mul_scalar`` does.

Not swapped (a float fallback, reported by prepare): ``add_bias_kv`` and
``add_zero_attn``, whose appended key/value rows have no grid of their own.

``F.scaled_dot_product_attention`` written inline is decomposed by the naming context
(``qdebug.engine.sdpa``): ``matmul`` (QK^T), ``softmax`` and ``matmul#2`` (attn.V) become
calls of the container, the scale, masks and dropout stay hidden floats.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from qdebug.engine.context import active_context
from qdebug.engine.module_tree import replace_modules
from qdebug.engine.modules import QLinear, _QWeighted
from qdebug.engine.ops import register_module_category
from qdebug.engine.point import grid_of, tag
from qdebug.engine.sdpa import ScaledGrid
from qdebug.engine.sdpa import decomposed_sdpa as decomposed_sdpa  # re-exported: it was defined here


class QScale(nn.Module):
    """y = x * c (attention's 1/sqrt(head_dim)), no point: y stays on x's grid scaled by c."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = float(factor)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.mul(x, self.factor)  # as torch.ao's FloatFunctional.mul_scalar
        point = grid_of(x)
        if point is not None and not point.spec.per_channel and self.factor > 0:
            tag(out, ScaledGrid(point, self.factor))
        return out

    def extra_repr(self) -> str:
        return f"factor={self.factor!r}"


class AttentionMask(nn.Module):
    """Scores of shape (B*H, L, S) with attn_mask and key_padding_mask applied, in float as
    torch does: a bool mask writes -inf, a float mask is added."""

    optional_call = True  # runs only when a mask is given: never called is no finding (inspect)

    def forward(self, scores: Tensor, attn_mask: Tensor | None, key_padding_mask: Tensor | None) -> Tensor:
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(attn_mask, float("-inf"))
            else:
                scores = scores + attn_mask
        if key_padding_mask is not None:
            heads_batch, tgt_len, src_len = scores.shape
            bsz = key_padding_mask.size(0)
            scores = scores.view(bsz, heads_batch // bsz, tgt_len, src_len)
            mask = key_padding_mask.view(bsz, 1, 1, src_len)
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(mask, float("-inf"))
            else:
                scores = scores + mask.to(scores.dtype)
            scores = scores.view(heads_batch, tgt_len, src_len)
        return scores


class WeightsPoint(nn.Module):
    """Identity holding the quant point of the returned attention weights (torch.ao's
    ``quant_attn_output_weights``)."""

    optional_call = True  # runs only with need_weights: never called is no finding (inspect)

    def forward(self, x: Tensor) -> Tensor:
        return x


class AverageHeads(nn.Module):
    """(B*H, L, S) weights -> (B, H, L, S), averaged over heads when asked; float (torch.ao too)."""

    optional_call = True  # runs only with need_weights: never called is no finding (inspect)

    def forward(self, weights: Tensor, bsz: int, average: bool) -> Tensor:
        heads_batch, tgt_len, src_len = weights.shape
        weights = weights.view(bsz, heads_batch // bsz, tgt_len, src_len)
        return weights.mean(dim=1) if average else weights


register_module_category(QScale, "internal")
register_module_category(AttentionMask, "internal")
register_module_category(AverageHeads, "internal")
register_module_category(WeightsPoint, "activation")


class PackedProjection(QLinear):
    """linear_Q / linear_K / linear_V: a QLinear whose weight and bias are rows of the attention's
    own ``in_proj_weight`` / ``in_proj_bias`` (or its ``q/k/v_proj_weight``), read at each use.

    The attention keeps ``nn.MultiheadAttention``'s parameters themselves: its state dict is the
    float one, and torch's own forward (float mode) runs on the very same tensors.  The slices
    are those torch.ao's ``from_float`` takes."""

    SEPARATE = ("q_proj_weight", "k_proj_weight", "v_proj_weight")

    def __init__(self, owner: "QMultiheadAttention", index: int, in_features: int):
        _QWeighted.__init__(self)
        self.in_features = in_features
        self.out_features = owner.embed_dim
        self.index = index
        object.__setattr__(self, "_owner", owner)  # not a child: the tree holds it already
        self._init_state()  # the parameters are the owner's

    def _source(self) -> Tensor:
        owner = self._owner
        return owner.in_proj_weight if owner._qkv_same_embed_dim else getattr(owner, self.SEPARATE[self.index])

    def _rows(self, packed: Tensor) -> Tensor:
        e = self._owner.embed_dim
        return packed[self.index * e:(self.index + 1) * e]

    @property
    def weight(self) -> Tensor:
        source = self._source()
        return self._rows(source) if self._owner._qkv_same_embed_dim else source

    @property
    def bias(self) -> Tensor | None:
        packed = self._owner.in_proj_bias
        return None if packed is None else self._rows(packed)

    def weight_cache_key(self) -> object:
        source = self._source()  # a slice is a new object at each use: key on the parameter
        return (id(source), source._version, source.device, self.index)


register_module_category(PackedProjection, "linear")


class QMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` decomposed into quantizable parts (see module docstring)."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 kdim: int | None = None, vdim: int | None = None, batch_first: bool = False,
                 device: Any = None, dtype: Any = None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self.head_dim * num_heads != embed_dim:
            raise ValueError("embed_dim must be divisible by num_heads")
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        # nn.MultiheadAttention's parameters, under its names (its float state dict loads unchanged).
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            for name in PackedProjection.SEPARATE:
                self.register_parameter(name, None)
        else:
            self.register_parameter("in_proj_weight", None)
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
        if bias:
            self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.linear_Q = PackedProjection(self, 0, embed_dim)
        self.linear_K = PackedProjection(self, 1, self.kdim)
        self.linear_V = PackedProjection(self, 2, self.vdim)
        self.q_scaling = QScale(float(self.head_dim) ** -0.5)
        self.mask = AttentionMask()
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.quant_attn_output_weights = WeightsPoint()
        self.average_heads = AverageHeads()
        object.__setattr__(self, "_float_twin", None)

    @classmethod
    def from_float(cls, mha: nn.MultiheadAttention) -> "QMultiheadAttention":
        """The decomposition of ``mha``, holding ``mha``'s own parameters and out_proj."""
        new = cls(mha.embed_dim, mha.num_heads, mha.dropout, mha.in_proj_bias is not None, mha.kdim, mha.vdim,
                  mha.batch_first, device="meta")
        for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias"):
            new._parameters[name] = getattr(mha, name)
        new.out_proj = mha.out_proj
        new.train(mha.training)
        return new

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint.")
        args = (query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights)
        ctx = active_context()
        if ctx is None:  # outside a prepared model's forward: plain float attention
            return self._torch_forward(*args, is_causal=is_causal)
        out = self._decomposed(*args)
        if self._points_all_float(ctx):
            # torch's own forward: engine code, not the model's calls; and off the function-mode
            # stack, where torch takes the same fused fast path as outside a prepared model.
            ctx.busy += 1
            try:
                with ctx._off_the_mode_stack():
                    return self._torch_forward(*args, is_causal=is_causal)
            finally:
                ctx.busy -= 1
        return out

    def _points_all_float(self, ctx: Any) -> bool:
        if getattr(ctx.handler, "tracing", False):  # qdebug.engine.plan.TraceHandler
            return False  # tracing: the decomposition is what gets recorded
        state = getattr(ctx.handler, "state", None)
        path = ctx.module_names.get(id(self))
        if state is None or path is None:
            return True  # a float model under a listener (compare's reference, decomposed_copy)
        prefix = f"{path}."
        return all(p.mode == "float" for name, p in state.points.items() if name.startswith(prefix))

    def _torch_forward(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                       *, is_causal: bool = False):
        twin = self._float_twin
        if twin is None:
            twin = nn.MultiheadAttention(self.embed_dim, self.num_heads, self.dropout, self.linear_Q.bias is not None,
                                         kdim=self.kdim, vdim=self.vdim, batch_first=self.batch_first, device="meta")
            object.__setattr__(self, "_float_twin", twin)
        twin.train(self.training)
        params = {name: p for name, p in self.named_parameters() if not name.startswith("out_proj.")}
        params["out_proj.weight"] = self.out_proj.weight  # a QLinear after prepare: its float parameters
        if self.out_proj.bias is not None:
            params["out_proj.bias"] = self.out_proj.bias
        return torch.func.functional_call(
            twin, params, (query, key, value),
            dict(key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
                 average_attn_weights=average_attn_weights, is_causal=is_causal),
        )

    def _decomposed(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights):
        """torch.ao.nn.quantizable.MultiheadAttention's forward, step for step (module docstring)."""
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
            key_padding_mask = key_padding_mask.unsqueeze(0) if key_padding_mask is not None else None
        elif self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        tgt_len, bsz, _ = query.shape
        heads = self.num_heads
        q = self.linear_Q(query)
        k = self.linear_K(key)
        v = self.linear_V(value)
        q = self.q_scaling(q)
        attn_mask = _canonical_attn_mask(attn_mask, bsz * heads, tgt_len, key.size(0))
        if key_padding_mask is not None and key_padding_mask.dtype == torch.uint8:
            key_padding_mask = key_padding_mask.to(torch.bool)
        q = q.contiguous().view(tgt_len, bsz * heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * heads, self.head_dim).transpose(0, 1)
        scores = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None or key_padding_mask is not None:
            scores = self.mask(scores, attn_mask, key_padding_mask)
        weights = F.softmax(scores, dim=-1)
        weights = F.dropout(weights, p=self.dropout, training=self.training)
        attn_output = torch.bmm(weights, v)
        attn_output = attn_output.transpose(0, 1).contiguous().view(tgt_len, bsz, self.embed_dim)
        attn_output = self.out_proj(attn_output)
        if self.batch_first and not unbatched:
            attn_output = attn_output.transpose(0, 1)
        if unbatched:
            attn_output = attn_output.squeeze(1)
        if not need_weights:
            return attn_output, None
        weights = self.average_heads(self.quant_attn_output_weights(weights), bsz, average_attn_weights)
        return attn_output, weights.squeeze(0) if unbatched else weights


def _canonical_attn_mask(attn_mask: Tensor | None, batch_heads: int, tgt_len: int, src_len: int) -> Tensor | None:
    """A 2-D or 3-D attn_mask as a (1 | B*H, L, S) bool or float tensor (torch.ao's checks)."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.uint8:
        attn_mask = attn_mask.to(torch.bool)
    if not attn_mask.is_floating_point() and attn_mask.dtype != torch.bool:
        raise AssertionError(f"Only float and bool types are supported for attn_mask, not {attn_mask.dtype}")
    if attn_mask.dim() == 2:
        if list(attn_mask.shape) != [tgt_len, src_len]:
            raise RuntimeError("The size of the 2D attn_mask is not correct.")
        return attn_mask.unsqueeze(0)
    if attn_mask.dim() == 3:
        if list(attn_mask.shape) != [batch_heads, tgt_len, src_len]:
            raise RuntimeError("The size of the 3D attn_mask is not correct.")
        return attn_mask
    raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")


def decomposable(module: nn.Module) -> bool:
    """Whether prepare swaps ``module`` for a ``QMultiheadAttention`` (module docstring)."""
    return type(module) is nn.MultiheadAttention and module.bias_k is None and not module.add_zero_attn


def swap_attention(path: str, module: nn.Module) -> nn.Module | None:
    """prepare's swap: a ``QMultiheadAttention`` for each ``nn.MultiheadAttention`` it can decompose."""
    return QMultiheadAttention.from_float(module) if decomposable(module) else None


PARTS = ("linear_Q", "linear_K", "linear_V", "q_scaling", "mask", "out_proj", "quant_attn_output_weights",
         "average_heads")


def decomposed_copy(model: nn.Module) -> nn.Module:
    """A float, unprepared ``model`` with its attentions decomposed as prepare does (a deep copy;
    ``model`` itself when it has none): a reference with the same calls as the prepared model,
    row for row, and torch's own outputs."""
    if not any(decomposable(m) for m in model.modules()):
        return model
    copied = copy.deepcopy(model)
    replace_modules(copied, swap_attention)
    return copied


def decomposed_paths(model: nn.Module) -> dict[str, nn.Module]:
    """The module paths prepare adds to a float ``model`` (the parts of each attention it
    decomposes), each mapped to its attention: a saved plan names them."""
    return {f"{path}.{part}" if path else part: module
            for path, module in model.named_modules() if decomposable(module) for part in PARTS}


def attention_softmax_spec(model: nn.Module, rec: Any, spec: Any, matched_globs: list[str]) -> Any:
    """The spec of an attention softmax's output point: unsigned and affine (every code on the
    probabilities in [0, max p], the uint8 grid deployments use) unless a qconfig override
    names the point; bits and observer stay the configured ones (``bits = 16``: int16 softmax)."""
    if rec.op != "softmax" or matched_globs or not rec.owner or not spec.signed:
        return spec
    try:
        owner = model.get_submodule(rec.owner)
    except AttributeError:
        return spec
    if not isinstance(owner, QMultiheadAttention):
        return spec
    return spec.replace(signed=False, symmetric=False, narrow_range=False)
