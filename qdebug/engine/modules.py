"""Quantized wrappers for weighted layers, and Conv-BN in the three QAT modes.

``QConv`` / ``QLinear`` replace ``nn.Conv1d/2d`` / ``nn.Linear`` at prepare.  They
keep the same parameter names (``weight``, ``bias``) and the same place in the
module tree, so a float state dict loads into them and layer names never change.

Conv-BN (seed 003), with f = gamma / sqrt(running_var + eps):

- ``fused`` (qat mode ``fuse_bn``, and after ``absorb``): BN folded into the conv,
  W' = W f, b' = (b - mu) f + beta; the conv fake-quantizes W'.  The BN's place in
  the tree holds a ``FoldedBatchNorm`` (identity) that keeps its name.
- ``with_bn``: y = conv(x, fq(W)) + b, then the real BN (batch statistics in
  training).  Folding later re-quantizes W f with a new scale: a real change.
- ``reverse_fold``: y = conv(x, fq(W f)) / f + b, then the real BN -- the scheme of
  ``torch.ao.nn.intrinsic.qat.ConvBn2d``.  The weight scale already sees W f, so
  folding (``absorb``) leaves the eval output unchanged.  A channel with gamma = 0
  (f = 0) divides by 1 instead: its conv output is 0, and the BN outputs beta.

In the quantized stage (``stage = "quantized"``) the forward is integer: see
``qdebug.engine.integer``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from qdebug.engine import integer
from qdebug.engine.fake_quant import elementwise, quantize_to_int
from qdebug.engine.ops import register_module_category
from qdebug.engine.point import QuantPoint, on_grid, tag

BN_MODES = ("none", "fused", "with_bn", "reverse_fold")


def bn_scale_factor(bn: nn.modules.batchnorm._BatchNorm) -> torch.Tensor:
    """f = gamma / sqrt(running_var + eps) (gamma = 1 without affine)."""
    std = torch.sqrt(bn.running_var + bn.eps)
    gamma = bn.weight if bn.weight is not None else torch.ones_like(std)
    return gamma / std


def fold_bn(weight: torch.Tensor, bias: torch.Tensor | None, bn: nn.modules.batchnorm._BatchNorm):
    """W' = W f, b' = (b - mu) f + beta: the conv that equals conv -> BN(eval)."""
    f = bn_scale_factor(bn)
    shape = [-1] + [1] * (weight.dim() - 1)
    bias = bias if bias is not None else torch.zeros_like(bn.running_mean)
    beta = bn.bias if bn.bias is not None else torch.zeros_like(bn.running_mean)
    return weight * f.reshape(shape), (bias - bn.running_mean) * f + beta


class FoldedBatchNorm(nn.Module):
    """Identity holding the place (and name) of a BatchNorm folded into ``folded_into``."""

    def __init__(self, num_features: int, folded_into: str):
        super().__init__()
        self.num_features = num_features
        self.folded_into = folded_into

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return f"{self.num_features}, folded_into={self.folded_into!r}"


class _NormActChildren:
    """What is left of a norm-act layer once its norm is gone: its children (``drop``, ``act``),
    adopted and run in their order."""

    def _adopt_children(self, norm_act: nn.Module) -> None:
        for name, child in norm_act.named_children():
            self.add_module(name, child)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for child in self.children():
            x = child(x)
        return x


class FoldedNormAct(_NormActChildren, FoldedBatchNorm):
    """A ``FoldedBatchNorm`` for a norm-act layer (timm's ``BatchNormAct2d``, ``ops.is_norm_act``):
    its norm is folded into the conv, its children (``drop``, ``act``) still run, in their order."""

    norm_act_placeholder = True  # the context makes the (identity) norm call on its input

    def __init__(self, norm_act: nn.Module, folded_into: str):
        super().__init__(norm_act.num_features, folded_into)
        self._adopt_children(norm_act)


def folded_placeholder(bn: nn.Module, folded_into: str) -> FoldedBatchNorm:
    """What holds the place of BatchNorm ``bn`` once folded into ``folded_into``: an identity,
    which keeps a norm-act layer's activation."""
    from qdebug.engine.ops import is_norm_act

    if is_norm_act(bn):
        return FoldedNormAct(bn, folded_into)
    return FoldedBatchNorm(bn.num_features, folded_into)


class NormActTail(_NormActChildren, nn.Module):
    """What is left of a norm-act layer whose norm torch folded into the conv before it (an
    imported PTQ or converted model): its children (``drop``, ``act``), run in order."""

    norm_act_tail = True  # its nn.Identity children are no calls, as a norm-act layer's (context)

    def __init__(self, norm_act: nn.Module):
        super().__init__()
        self._adopt_children(norm_act)


def without_norm(bn: nn.Module) -> nn.Module:
    """The module that replaces BatchNorm ``bn`` once torch folded it into its conv: an
    ``nn.Identity`` (no call), or the activation a norm-act layer still applies."""
    from qdebug.engine.ops import is_norm_act

    return NormActTail(bn) if is_norm_act(bn) else nn.Identity()


class _QWeighted(nn.Module):
    """Shared machinery of QConv and QLinear: weight point, stage, integer path."""

    # Output channels lie on this axis of the layer's output.
    out_channel_axis = 1

    def _init_common(self, layer: nn.Module) -> None:
        self.weight = layer.weight
        self.bias = layer.bias
        self._init_state()

    def _init_state(self) -> None:
        """Everything but the parameters (a layer that reads them from elsewhere calls this alone)."""
        self.stage = "fake"  # "fake" (float/calibrated/qat) or "quantized" (integer)
        self.bn_mode = "none"
        object.__setattr__(self, "_bn", None)
        object.__setattr__(self, "weight_point", None)
        # Set per call by the engine's handler: the point the output lands on, fused activation.
        object.__setattr__(self, "_out_point", None)
        object.__setattr__(self, "_fused_activation", None)
        object.__setattr__(self, "_in_float", False)  # the target computes this call in float
        self.integer_fallbacks = 0

    def attach_weight_point(self, point: QuantPoint | None) -> None:
        object.__setattr__(self, "weight_point", point)

    def attach_bn(self, bn: nn.Module | None, mode: str) -> None:
        object.__setattr__(self, "_bn", bn)
        self.bn_mode = mode

    @property
    def bn(self) -> nn.Module | None:
        return self._bn

    def _op(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def _quantized_weight(self, weight: torch.Tensor, cache_key) -> torch.Tensor:
        if self.weight_point is None:
            return weight
        return self.weight_point.apply(weight, cache_key=cache_key)

    def quantized_input_weight(self, f: torch.Tensor | None = None) -> tuple[torch.Tensor, object]:
        """The tensor the weight point quantizes (W, or W f under reverse fold) and its cache key.

        ``f``: the BN scale factor when the caller already computed it (one
        differentiable division per step instead of two).
        """
        key = self.weight_cache_key()
        if self.bn_mode == "reverse_fold" and self._bn is not None:
            f = bn_scale_factor(self._bn) if f is None else f
            shape = [-1] + [1] * (self.weight.dim() - 1)
            return self.weight * f.reshape(shape), key
        return self.weight, key

    def weight_cache_key(self) -> object:
        """Identifies the tensor the weight point quantizes without computing it: the
        identities and versions of everything it is made of (in-place updates bump a
        version).  None in training under reverse fold, where W f changes every step.  The
        weight's device is part of it: ``model.to(device)`` keeps each parameter's identity and
        version, and a weight quantized on the old device must not be served on the new one."""
        if self.bn_mode == "reverse_fold" and self._bn is not None:
            if self.training:
                return None
            bn = self._bn
            gamma = (id(bn.weight), bn.weight._version) if bn.weight is not None else None
            return (id(self.weight), self.weight._version, self.weight.device, id(bn.running_var),
                    bn.running_var._version, gamma)
        return (id(self.weight), self.weight._version, self.weight.device)

    def refresh_weight_qparams(self) -> None:
        """Recompute a dynamic weight point's qparams from the current weight now (e.g. before saving)."""
        point = self.weight_point
        if point is None or (point.initialized and (point.frozen or point.spec.learnable_scale)):
            return  # frozen or learned scales are not derived from the weight
        with torch.no_grad():
            weight, _ = self.quantized_input_weight()
            point.compute_from(weight)
        point.forget_cached()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stage == "quantized":
            return self._integer_forward(x)
        f = bn_scale_factor(self._bn) if self.bn_mode == "reverse_fold" and self._bn is not None else None
        w = self.weight_point.cached_weight(self.weight_cache_key()) if self.weight_point is not None else None
        if w is None:
            weight, key = self.quantized_input_weight(f)
            w = self._quantized_weight(weight, key)
        if f is not None:
            out_shape = [1] * x.dim()
            out_shape[self.out_channel_axis] = -1
            # A channel with gamma = 0 has f = 0: its weight W f is 0, so its conv output is 0,
            # and 0 / 0 would be NaN.  Dividing it by 1 keeps the 0, and the BN after it outputs
            # gamma (...) + beta = beta exactly, as the folded layer (W' = 0, b' = beta) does.
            y = self._op(x, w, None) / torch.where(f == 0, torch.ones_like(f), f).reshape(out_shape)
            if self.bias is not None:
                y = y + self.bias.reshape(out_shape)
            return y
        return self._op(x, w, self.bias)

    # -- integer stage --------------------------------------------------------------
    def weight_codes(self) -> torch.Tensor:
        """Integer weight codes q_w - z_w (float64), cached in ``weight_int``."""
        cached = getattr(self, "weight_int", None)
        if cached is None:
            point = self.weight_point
            scale, zp = point.qparams()
            q = quantize_to_int(self.weight.detach(), scale, zp, point.spec)
            if point.spec.group_size is not None:  # [rows, groups] -> each element its group's
                zp_b = elementwise(zp, point.spec, q.shape).to(torch.int64)
            else:
                zp_b = integer._broadcast_point(zp, point, q.dim()).to(torch.int64)
            # q - z spans [qmin - max z, qmax - min z]: int8 for symmetric int8 (z = 0), but an
            # affine int8 weight (z != 0) needs 9 bits and would wrap around in int8.
            lo = point.spec.qmin - int(zp.max())
            hi = point.spec.qmax - int(zp.min())
            dtype = next(
                (t for t in (torch.int8, torch.int16) if torch.iinfo(t).min <= lo and hi <= torch.iinfo(t).max),
                torch.int32,
            )
            self.register_buffer("weight_int", (q - zp_b).to(dtype))
            cached = self.weight_int
        return cached.to(torch.float64)

    def _integer_forward(self, x: torch.Tensor) -> torch.Tensor:
        out_point = self._out_point
        w_point = self.weight_point
        if out_point is not None and w_point is not None and w_point.mode == "fake":
            x, in_point = on_grid(x)  # a float-mode producer's output is projected onto its grid
        else:
            in_point = None
        if (
            in_point is None
            or out_point is None
            or w_point is None
            or in_point.spec.per_channel
            or out_point.spec.per_channel
            or (w_point.spec.per_channel and w_point.spec.ch_axis % self.weight.dim() != 0)
        ):
            # No integer grid in or out: compute as the fake-quant stage does.
            self.integer_fallbacks += 1
            w = self._quantized_weight(self.weight, (id(self.weight), self.weight._version))
            return self._op(x, w, self.bias)
        if w_point.spec.group_size is not None:
            return tag(self._grouped_integer_forward(x, in_point, out_point), out_point)
        if self._in_float:
            return tag(self._float_kernel_forward(x, out_point), out_point)
        s_in = in_point.scale.detach().to(torch.float64)
        s_w = w_point.scale.detach().to(torch.float64)
        s_out = out_point.scale.detach().to(torch.float64)
        w_codes = self.weight_codes()
        acc = integer.exact_integer_op(self._op, integer.codes(x, in_point, torch.float32), w_codes, w_codes[0].numel())
        shape = [1] * acc.dim()
        shape[self.out_channel_axis] = -1
        acc = acc.to(torch.int64)
        if self.bias is not None:
            acc = acc + integer.bias_codes(self.bias.detach(), s_in, s_w).reshape(shape)
        multiplier = integer.layer_multiplier(s_in, s_w, s_out)
        if multiplier.dim():
            multiplier = multiplier.reshape(shape)
        y = integer.requantize(acc, multiplier, out_point, self._fused_activation)
        return tag(y, out_point)

    def _float_kernel_forward(self, x: torch.Tensor, out_point: QuantPoint) -> torch.Tensor:
        """The layer as ONNX Runtime runs a QDQ group it does not fuse (``integer.quantize_float``):
        its float Conv/Gemm on the dequantized input and weight, (q - z) s in float32 as its
        DequantizeLinear computes them, then the bias added (the DequantizeLinear of an imported
        int32 bias: the layer's ``bias``), then QuantizeLinear onto ``out_point``."""
        scale = integer._broadcast_point(self.weight_point.scale.detach().float(), self.weight_point, self.weight.dim())
        bias = self.bias.detach().float() if self.bias is not None else None
        y = self._float_op(x.float(), self.weight_codes().float() * scale, bias)
        return integer.quantize_float(y, out_point, self._fused_activation)

    def _float_op(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer in float32 as ONNX Runtime's float kernel sums it: torch's op, the bias added
        after the sum (subclasses sum as MLAS's GEMM does where they can)."""
        y = self._op(x, weight, None)
        if bias is not None:
            shape = [1] * y.dim()
            shape[self.out_channel_axis] = -1
            y = y + bias.reshape(shape)
        return y

    def _grouped_integer_forward(self, x: torch.Tensor, in_point: QuantPoint, out_point: QuantPoint) -> torch.Tensor:
        """A grouped weight (W4A8-style, Linear only): per group j of g inputs, the integer partial
        sum acc_j = sum_k (q_x - z_x)(q_w - z_w) (exact: float64 on integers); y = s_x sum_j s_w[o, j]
        acc_j + b in float64, as W4A8 kernels rescale each group's partial sum (the bias stays
        real: no one s_w to quantize it with); q_y = clamp(z_y + round_half_even(y / s_y))."""
        spec = self.weight_point.spec
        groups = spec.group_size
        x_codes = integer.codes(x, in_point).unflatten(-1, (-1, groups))  # [..., G, g]
        w_codes = self.weight_codes().reshape(self.out_features, -1, groups)  # [out, G, g]
        acc = torch.einsum("...jk,ojk->...oj", x_codes, w_codes)  # integers below 2^53: exact
        s_w = self.weight_point.scale.detach().to(torch.float64)  # [out, G]
        y = (acc * s_w).sum(-1) * in_point.scale.detach().to(torch.float64)
        if self.bias is not None:
            y = y + self.bias.detach().to(torch.float64)
        q = torch.round(y / out_point.scale.detach().to(torch.float64)).to(torch.int64)
        return integer.requantize_codes(q, out_point, self._fused_activation)

    def absorb(self) -> None:
        """Fold the attached BN into weight and bias now (the caller swaps the BN out of the tree)."""
        if self._bn is None:
            return
        with torch.no_grad():
            weight, bias = fold_bn(self.weight, self.bias, self._bn)
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=self.weight.requires_grad)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=self.weight.requires_grad)
        previous = self.bn_mode
        self.attach_bn(None, "fused")
        point = self.weight_point
        if point is not None and previous == "with_bn" and point.spec.learnable_scale:
            # A learned scale was fit to W, not W f: restart it from the folded weight.
            point.compute_from(self.weight)
        if point is not None:
            point.forget_cached()


def _own_forward(layer: nn.Module, *bases: type) -> object | None:
    """The ``forward`` a subclass of a torch layer defines itself (TF-style SAME padding convs
    pad inside it), or None when it keeps the base class's."""
    forward = type(layer).forward
    return None if any(forward is base.forward for base in bases) else forward


class QConv(_QWeighted):
    """Conv1d/Conv2d with a fake-quantized (or integer) weight; see module docstring.

    A subclass with a forward of its own (``Conv2dStaticSamePadding``: pad, then
    ``F.conv2d(x, self.weight, ...)``) keeps it: its children and public attributes come
    along, and its forward runs with ``self.weight``/``self.bias`` standing for the
    quantized weight (or the integer codes), so the padding stays part of the layer --
    as in a deployed conv, whose zero padding is the zero point.  A forward that
    transforms the weight itself (weight standardization) would see the quantized weight.
    """

    def __init__(self, conv: nn.Conv1d | nn.Conv2d):
        super().__init__()
        for attr in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups", "padding_mode"):
            setattr(self, attr, getattr(conv, attr))
        self.dims = 1 if isinstance(conv, nn.Conv1d) else 2
        self._reversed_padding_repeated_twice = getattr(conv, "_reversed_padding_repeated_twice", None)
        self._init_common(conv)
        own = _own_forward(conv, nn.Conv1d, nn.Conv2d)
        object.__setattr__(self, "_own_forward", own)
        self.own_forward_of = f"{type(conv).__module__}.{type(conv).__qualname__}" if own is not None else ""
        if own is not None:
            for name, child in conv.named_children():
                self.add_module(name, child)
            for key, value in vars(conv).items():
                if not key.startswith("_") and key not in vars(self) and key != "training":
                    object.__setattr__(self, key, value)

    def _op(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._own_forward is not None:
            return self._run_own_forward(x, weight, bias)
        fn = F.conv1d if self.dims == 1 else F.conv2d
        padding = self.padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = 0
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return fn(x, weight.to(x.dtype), bias, self.stride, padding, self.dilation, self.groups)

    def _float_op(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """ONNX Runtime's float Conv: im2col (K ordered channel, kernel row, column) and MLAS's GEMM
        (``integer.float_gemm``), the bias added after; a grouped, padded-by-mode, 1-d or
        own-forward conv as torch computes it."""
        padding = self.padding
        if (self.dims != 2 or self.groups != 1 or self._own_forward is not None or self.padding_mode != "zeros"
                or not all(isinstance(p, int) for p in padding)):
            return super()._float_op(x, weight, bias)
        cols = F.unfold(x, self.kernel_size, self.dilation, padding, self.stride)  # [N, C kh kw, L]
        height = (x.shape[2] + 2 * padding[0] - self.dilation[0] * (self.kernel_size[0] - 1) - 1) // self.stride[0] + 1
        y = integer.float_gemm(weight.reshape(weight.shape[0], -1), cols)
        y = y.reshape(x.shape[0], weight.shape[0], height, -1)
        return y + bias.reshape(1, -1, 1, 1) if bias is not None else y

    def _run_own_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # Instance attributes shadow the parameters (nn.Module looks those up only when
        # normal lookup fails): the layer's own forward reads the weight we give it.
        shadow = self.__dict__
        missing = object()
        saved = {key: shadow.get(key, missing) for key in ("weight", "bias")}  # a None bias lives here already
        shadow["weight"] = weight.to(x.dtype)
        shadow["bias"] = bias.to(x.dtype) if bias is not None else None
        try:
            return self._own_forward(self, x)
        finally:
            for key, value in saved.items():
                if value is missing:
                    shadow.pop(key, None)
                else:
                    shadow[key] = value

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, groups={self.groups}, bn_mode={self.bn_mode}, stage={self.stage}"
        )


class QLinear(_QWeighted):
    """Linear with a fake-quantized (or integer) weight."""

    out_channel_axis = -1

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self._init_common(linear)

    def _op(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return F.linear(x, weight.to(x.dtype), bias)

    def _float_op(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """ONNX Runtime's float Gemm (a 2-d input): the bias broadcast into the output first, then
        MLAS's GEMM adds the product to it (``integer.float_gemm``); else MatMul, then Add."""
        if x.dim() == 2:
            return integer.float_gemm(x, weight.t(), bias.expand(x.shape[0], -1) if bias is not None else None)
        return super()._float_op(x, weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, stage={self.stage}"


register_module_category(QConv, "conv")
register_module_category(QLinear, "linear")
register_module_category(FoldedBatchNorm, "bn")
register_module_category(FoldedNormAct, "bn")
