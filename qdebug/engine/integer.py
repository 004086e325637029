"""Integer arithmetic of the quantized stage: codes, fixed-point requantization, kernels.

Tensors still flow between layers as float32 values, but every value lies
exactly on its quant point's grid, x = (q - z) s, so ``codes`` recovers the
integer q - z exactly (|q| <= 2^16 is far inside float32's 24-bit mantissa).
Kernels then compute in integers:

- accumulation: sum of (q_x - z_x)(q_w - z_w) products, exact.  Computed with
  float64 convolutions/matmuls, which are exact for integers below 2^53
  (int8 x uint8 products over 10^6 terms stay below 2^37);
- bias: q_b = round(b / (s_x s_w)), int64 (int32 suffices for 8-bit operands);
- requantization: q_y = z_y + round(acc * M), M = s_x s_w / s_y held as a fixed-point
  multiplier m0 * 2^-n with m0 an integer of p = 31 bits (fewer when a 16-bit
  accumulator needs the headroom, so acc * m0 < 2^62), rounding half away from
  zero: r = sign(v) ((|v| + 2^(n-1)) >> n) with v = acc * m0;
- then clamp to [qmin, qmax] and, for a fused ReLU/ReLU6, to [z, z + round(6/s)].

That requantization is the *fixed-point* arithmetic (TFLite, gemmlowp, most NPUs).  A quantized
stage converted with ``arithmetic="float32"`` requantizes as ONNX Runtime's CPU kernels (MLAS:
QLinearConv, QGemm, QLinearMatMul) do instead: M = (s_x s_w) / s_y in float32 operations,
q_y = z_y + round_half_even(float32(acc) * M) in float32 -- so the quantized stage computes, bit
for bit, what the deployed ONNX model computes wherever ONNX Runtime fuses a layer into an
integer kernel.  Element-wise ops (add, cat, mean) keep their own rescaling in both.  A call ONNX
Runtime leaves in float (``qdebug.engine.arithmetic.in_float``) computes in float32 on the
dequantized values instead and is quantized by ``quantize_float`` (ORT's QuantizeLinear).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

import torch

from qdebug.engine.arithmetic import ARITHMETICS, current as arithmetic  # noqa: F401  (re-exported)
from qdebug.engine.fake_quant import quantize_dividing
from qdebug.engine.point import QuantPoint

MAX_MULTIPLIER_BITS = 31


FLOAT32_EXACT = 2**24  # integers below this are exact in float32, whatever the summation order


def exact_integer_op(op, x_codes: torch.Tensor, w_codes: torch.Tensor, terms: int) -> torch.Tensor:
    """op(x, w) (a conv or linear: sums of ``terms`` products) on integer codes, exactly
    (an int64 or integral float64 tensor), on the codes' device.

    Fast path: when every partial sum is provably below 2^24, float32 kernels are exact
    in any summation order.  Otherwise x = 16 h + l (0 <= l < 16) and two float32 ops
    whose bounds fit are combined in float64.  Else a float64 op (exact below 2^53).
    Every op runs on kernels that sum exact products (``_direct_kernels``).
    """
    with _direct_kernels():
        if not _float32_sums_exact(x_codes.device):
            return op(x_codes.double(), w_codes.double(), None)
        max_x = float(x_codes.abs().amax()) if x_codes.numel() else 0.0
        max_w = float(w_codes.abs().amax()) if w_codes.numel() else 0.0
        x32, w32 = x_codes.float(), w_codes.float()
        if terms * max_x * max_w < FLOAT32_EXACT:
            return op(x32, w32, None).double()
        high = torch.floor(x32 / 16)
        low = x32 - 16 * high
        if terms * max(max_x / 16 + 1, 15.0) * max_w < FLOAT32_EXACT:
            # Each partial result is an exact integer below 2^24: combine them in int64.
            return op(high, w32, None).to(torch.int64).mul_(16).add_(op(low, w32, None).to(torch.int64))
        return op(x_codes.double(), w_codes.double(), None)


@contextlib.contextmanager
def _direct_kernels() -> Iterator[None]:
    """Convolutions as sums of exact products inside the block, on any device, the flags
    restored after.  NNPACK's Winograd convolution (torch's choice on the CPU with oneDNN off)
    transforms its inputs, and so may cuDNN (its Winograd and FFT algorithms; it also
    convolves float32 in TF32 by default): neither sums exact products.  Without cuDNN, CUDA
    convolves by im2col and a cuBLAS matrix product, whose float32 precision
    ``_float32_sums_exact`` checks.  (The cuDNN flag is set on the CPU too, where it changes
    nothing: one code path everywhere.)

    Both through torch's own ``flags()`` context managers, never by assignment: torch's test
    harness (``torch.testing._internal.common_utils``) calls ``torch.backends.disable_global_flags()``,
    after which assigning ``torch.backends.cudnn.enabled`` raises; and the managers restore the
    caller's values on an exception and when nested in the caller's own ``flags()`` block."""
    with torch.backends.cudnn.flags(**_only_cudnn_disabled()), torch.backends.nnpack.flags(enabled=False):
        yield


def _only_cudnn_disabled() -> dict:
    """Arguments of ``torch.backends.cudnn.flags`` that disable cuDNN and leave every other
    cuDNN setting as the caller has it: its other parameters default to values of their own
    (benchmark, deterministic, TF32...), and ``None`` means "unchanged".  Read from its
    signature, which differs between torch versions."""
    parameters = inspect.signature(torch.backends.cudnn.flags).parameters
    return {name: (False if name == "enabled" else None) for name in parameters}


def _float32_sums_exact(device: torch.device) -> bool:
    """Whether float32 matrix products on ``device`` sum exact products in float32: not when the
    user allowed TF32 or bf16 internals -- ``torch.set_float32_matmul_precision("high"|"medium")``,
    or torch's per-backend ``fp32_precision`` (cuBLAS on CUDA; oneDNN's matmuls and convolutions
    on the CPU).  When torch cannot tell (it refuses when both ways of setting were mixed), no."""
    try:
        if torch.get_float32_matmul_precision() != "highest":
            return False
    except RuntimeError:
        return False
    if device.type == "cuda":
        backends = [torch.backends.cuda.matmul]
    else:
        mkldnn = torch.backends.mkldnn
        backends = [getattr(mkldnn, "matmul", None), getattr(mkldnn, "conv", None)]
    return all(getattr(backend, "fp32_precision", "none") in ("none", "ieee") for backend in backends)


def _broadcast_point(v: torch.Tensor, point: QuantPoint, ndim: int) -> torch.Tensor:
    if v.dim() == 0 or not point.spec.per_channel:
        return v
    axis = point.spec.ch_axis % ndim
    shape = [1] * ndim
    shape[axis] = -1
    return v.reshape(shape)


def codes(x: torch.Tensor, point: QuantPoint, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """q - z of an on-grid float tensor, as exact integers of ``dtype`` (float32 holds them exactly too)."""
    scale = _broadcast_point(point.scale.detach(), point, x.dim())
    return torch.round(x.float() / scale).to(dtype)


def values(q: torch.Tensor, point: QuantPoint) -> torch.Tensor:
    """Float32 values of integer codes q (with zero point), computed as torch's kernel does."""
    scale = _broadcast_point(point.scale.detach(), point, q.dim())
    zp = _broadcast_point(point.zero_point, point, q.dim()).to(torch.int64)
    return (q - zp).to(torch.float32) * scale


def fixed_point_multiply(acc: torch.Tensor, multiplier: torch.Tensor) -> torch.Tensor:
    """round_half_away(acc * M) with M as an integer multiplier and a right shift.

    ``acc`` int64; ``multiplier`` float64 broadcastable to it, all > 0.
    """
    multiplier = multiplier.to(torch.float64)
    max_acc = 0
    if acc.numel():
        lo, hi = torch.aminmax(acc)
        max_acc = max(-int(lo), int(hi))
    acc_bits = max(max_acc.bit_length(), 1)
    bits = max(min(MAX_MULTIPLIER_BITS, 62 - acc_bits), 8)
    mantissa, exponent = torch.frexp(multiplier)  # M = f 2^e, f in [0.5, 1)
    m0 = torch.round(mantissa * float(2**bits)).to(torch.int64)
    shift = bits - exponent.to(torch.int64)  # M = m0 2^-shift
    # m0 may round up to 2^bits; harmless (still < 2^(bits+1) and exact).
    product = acc * m0
    if bool(((shift < 1) | (shift > 62)).any()):
        return _shift_general(product, shift)
    # Round half away from zero in one pass: (v + 2^(n-1) - [v < 0]) >> n with an
    # arithmetic shift equals sign(v) ((|v| + 2^(n-1)) >> n).
    rounding = torch.bitwise_left_shift(torch.ones_like(shift), shift - 1)
    negative = product < 0
    product.add_(rounding).sub_(negative.to(torch.int64))
    return product.bitwise_right_shift_(shift) if shift.dim() == 0 or shift.shape == product.shape else torch.bitwise_right_shift(product, shift)


def _shift_general(product: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The same rounding for any shift: left shifts (n < 1) and shifts past the int64 width."""
    left = torch.clamp(-shift, min=0)
    right = torch.clamp(shift, min=0)
    magnitude = product.abs()
    rounding = torch.where(right > 0, torch.bitwise_left_shift(torch.ones_like(right), (right - 1).clamp(min=0)), 0)
    too_far = right > 62
    shifted = torch.bitwise_right_shift(magnitude + rounding, right.clamp(max=62))
    shifted = torch.where(too_far, torch.zeros_like(shifted), shifted)
    return torch.sign(product) * torch.bitwise_left_shift(shifted, left)


def activation_bounds(point: QuantPoint, activation: str | None) -> tuple[int, int]:
    """Integer clamp [lo, hi] for the output codes, including a fused ReLU/ReLU6."""
    spec = point.spec
    lo, hi = spec.qmin, spec.qmax
    zp = point.zero_point
    if zp.dim() != 0 or activation is None:
        return lo, hi
    z = int(zp)
    if activation in ("relu", "relu6"):
        lo = max(lo, z)
    if activation == "relu6":
        six = int(torch.round(6.0 / point.scale.detach().float()))  # on the scale's device, float32 as before
        hi = min(hi, z + six)
    return lo, hi


def requantize_codes(q: torch.Tensor, out_point: QuantPoint, activation: str | None) -> torch.Tensor:
    """Codes already on the output scale (without zero point) -> clamped float32 values."""
    lo, hi = activation_bounds(out_point, activation)
    if out_point.zero_point.dim() == 0:
        # Clamp the codes without the zero point: (q + z).clamp(lo, hi) - z in one pass.
        z = int(out_point.zero_point)
        return q.clamp(lo - z, hi - z).to(torch.float32).mul_(out_point.scale.detach())
    zp = _broadcast_point(out_point.zero_point, out_point, q.dim()).to(torch.int64)
    return values((q + zp).clamp(lo, hi), out_point)


def layer_multiplier(s_in: torch.Tensor, s_w: torch.Tensor, s_out: torch.Tensor) -> torch.Tensor:
    """M = s_in s_w / s_out of a conv/linear/matmul, float64: exact in float64 for fixed point, the
    float32 operations ONNX Runtime performs (``(s_in * s_w) / s_out``) for ``float32``."""
    if arithmetic() == "float32":
        return ((s_in.float() * s_w.float()) / s_out.float()).double()
    return s_in.double() * s_w.double() / s_out.double()


def bias_codes(bias: torch.Tensor, s_in: torch.Tensor, s_w: torch.Tensor) -> torch.Tensor:
    """q_b = round_half_even(b / (s_in s_w)) as int64: in float64 for fixed point; in float32
    operations for ``float32``, as ONNX Runtime's bias quantization computes it when it fuses a
    layer whose bias is float."""
    if arithmetic() == "float32":
        return torch.round(bias.float() / (s_in.float() * s_w.float())).to(torch.int64)
    return torch.round(bias.to(torch.float64) / (s_in.double() * s_w.double())).to(torch.int64)


def float32_multiply(acc: torch.Tensor, multiplier: torch.Tensor) -> torch.Tensor:
    """round_half_even(float32(acc) * float32(M)) as int64: ONNX Runtime's requantization (MLAS
    converts the int32 accumulator to float32, multiplies by the float32 scale and rounds to
    nearest even)."""
    return torch.round(acc.to(torch.float32) * multiplier.to(torch.float32)).to(torch.int64)


def requantize(acc: torch.Tensor, multiplier: torch.Tensor, out_point: QuantPoint, activation: str | None) -> torch.Tensor:
    """Integer accumulator -> output codes (with zero point), clamped; returns float32 values."""
    scaled = float32_multiply(acc, multiplier) if arithmetic() == "float32" else fixed_point_multiply(acc, multiplier)
    return requantize_codes(scaled, out_point, activation)


# ONNX Runtime's float GEMM (MLAS's sgemm, behind its Conv and Gemm) sums K in blocks of this many
# terms and adds the blocks' sums in order: its float Conv is im2col + that GEMM.
MLAS_STRIDE_K = 128


def float_gemm(a: torch.Tensor, b: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """``start + a @ b`` in float32 summed as ONNX Runtime's float kernels sum it (``MLAS_STRIDE_K``
    blocks of K, each block's product added in order); ``a`` [..., M, K], ``b`` [..., K, N].
    Measured against ONNX Runtime 1.32's float Conv in torchvision's ResNet-18 (its first float 3x3
    conv, 3.2 million codes on the same input): no code apart, where torch's own conv puts 20 one
    step off, and summing K in one block 22."""
    total = start
    for k in range(0, a.shape[-1], MLAS_STRIDE_K):
        block = a[..., k:k + MLAS_STRIDE_K] @ b[..., k:k + MLAS_STRIDE_K, :]
        total = block if total is None else total + block
    return total


def quantize_float(y: torch.Tensor, out_point: QuantPoint, activation: str | None) -> torch.Tensor:
    """The end of a group ONNX Runtime runs in float (``qdebug.engine.arithmetic.in_float``): the
    float32 result through the fused ReLU/ReLU6 in float (a Relu ORT's quantizer removed is its
    QuantizeLinear's clamp at z = qmin: the same values), then its QuantizeLinear, which divides."""
    if activation in ("relu", "relu6"):
        y = y.clamp(0.0, 6.0) if activation == "relu6" else y.clamp(min=0.0)
    return quantize_dividing(y, out_point.scale, out_point.zero_point, out_point.spec)


def channel_shape(ndim: int, axis: int = 1) -> list[int]:
    shape = [1] * ndim
    shape[axis] = -1
    return shape
