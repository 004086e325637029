"""Which modules and torch functions the engine understands, and as what.

Every call the engine sees during a forward falls in one *category*:

- ``conv``, ``linear``: weighted layers (wrapped at prepare, integer in the quantized stage).
- ``bn``: a BatchNorm (folded into the preceding conv when paired).
- ``relu``, ``relu6``: activations a deployed kernel fuses into the op before it.
- ``add``, ``sub``, ``mul``, ``cat``, ``avgpool``, ``mean``: value ops with integer kernels.
- ``matmul``: ``torch.matmul``/``bmm``/``@`` between two activations (neither a parameter):
  an integer kernel on both inputs' codes (attention's QK^T and attn.V).
- ``activation``: other element-wise value ops (sigmoid, tanh, softmax, hardswish,
  leaky_relu, GELU, SiLU, Mish, PReLU, ...) and the norms (LayerNorm, GroupNorm,
  InstanceNorm, RMSNorm, ``F.normalize``): quantized at their output, computed in float (a table lookup
  or a float island on an integer target; docs/engine.md, "Modern blocks").
- ``mul`` also covers ``x * c`` and ``x / c`` with a Python number c, and ``-x`` (c = -1,
  rotary embeddings' ``rotate_half``): folded into the requantization multiplier in the
  quantized stage.
- ``passthrough``: ops that only move or select values (view, flatten, maxpool,
  dropout, identity, nearest upsampling, constant-zero padding, ...): the output stays
  on the input's grid, so no new quant point.
- ``recurrent``: LSTM/GRU and their cells, swapped at prepare for the engine's layers
  (``qdebug.engine.recurrent``) whose points sit inside them; the call has none of its own.
- ``fallback``: any other op producing a float tensor from an activation.  It runs
  in float and its output is re-quantized; ``quant_points`` and a warning report it,
  with the reason of ``FLOAT_REASONS``.
- ``internal``: float steps inside an engine module that deployments (and torch.ao) leave
  unobserved: attention's 1/sqrt(d) scale (folded into the next integer multiplier), its
  masks, its average over heads (``qdebug.engine.attention``).  No point of their own.
- ``ignore``: calls whose result holds no floating tensor (``x.size()``, ``x.shape``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn as nn

# Categories whose output gets an activation quant point (unless fused into the next op).
VALUE_CATEGORIES = frozenset(
    {"conv", "linear", "bn", "relu", "relu6", "add", "sub", "mul", "cat", "avgpool", "mean", "matmul", "activation",
     "fallback"}
)
# A value op whose sole consumer is a relu/relu6 shares that activation's quant point,
# as deployed kernels fuse Conv+ReLU, Add+ReLU, ...
FUSABLE_INTO_ACTIVATION = frozenset({"conv", "linear", "bn", "add", "sub"})
FUSED_ACTIVATIONS = frozenset({"relu", "relu6"})

_MODULE_CATEGORIES: list[tuple[type, str]] = [
    (nn.Conv1d, "conv"),
    (nn.Conv2d, "conv"),
    (nn.Linear, "linear"),
    (nn.BatchNorm1d, "bn"),
    (nn.BatchNorm2d, "bn"),
    (nn.ReLU, "relu"),
    (nn.ReLU6, "relu6"),
    (nn.LeakyReLU, "activation"),
    (nn.Hardswish, "activation"),
    (nn.Hardsigmoid, "activation"),
    (nn.Sigmoid, "activation"),
    (nn.Tanh, "activation"),
    (nn.Softmax, "activation"),
    (nn.LogSoftmax, "activation"),
    (nn.GELU, "activation"),
    (nn.SiLU, "activation"),
    (nn.Mish, "activation"),
    (nn.ELU, "activation"),
    (nn.PReLU, "activation"),
    # Norms: quantized output, computed in float with float affine weights -- as torch.ao's
    # quantized LayerNorm/GroupNorm/InstanceNorm (float weight and bias, quantized in/out),
    # ONNX Runtime QDQ and TensorRT (a norm between a dequantize and a quantize) run them.
    (nn.LayerNorm, "activation"),
    (nn.GroupNorm, "activation"),
    (nn.RMSNorm, "activation"),
    (nn.InstanceNorm1d, "activation"),
    (nn.InstanceNorm2d, "activation"),
    (nn.MaxPool1d, "passthrough"),
    (nn.MaxPool2d, "passthrough"),
    (nn.AdaptiveMaxPool1d, "passthrough"),
    (nn.AdaptiveMaxPool2d, "passthrough"),
    (nn.AvgPool1d, "avgpool"),
    (nn.AvgPool2d, "avgpool"),
    (nn.AdaptiveAvgPool1d, "avgpool"),
    (nn.AdaptiveAvgPool2d, "avgpool"),
    (nn.Flatten, "passthrough"),
    (nn.Unflatten, "passthrough"),
    (nn.Dropout, "passthrough"),
    (nn.Dropout2d, "passthrough"),
    (nn.Identity, "passthrough"),
    (nn.ChannelShuffle, "passthrough"),
    (nn.PixelShuffle, "passthrough"),
    (nn.Upsample, "upsample"),
    # Layers with no quantized kernel here: computed in float (weights too), output
    # re-quantized, and reported -- never silently left out.
    (nn.ConvTranspose1d, "fallback"),
    (nn.ConvTranspose2d, "fallback"),
    (nn.ConvTranspose3d, "fallback"),
    (nn.Conv3d, "fallback"),
    (nn.Embedding, "fallback"),
    (nn.EmbeddingBag, "fallback"),
    (nn.BatchNorm3d, "fallback"),
    # LSTM/GRU (and cells) become the engine's recurrent layers (qdebug.engine.recurrent), whose
    # points sit inside: no point of their own.  A subclass with its own forward stays a fallback.
    (nn.LSTM, "recurrent"),
    (nn.GRU, "recurrent"),
    (nn.LSTMCell, "recurrent"),
    (nn.GRUCell, "recurrent"),
    (nn.RNNBase, "fallback"),
    (nn.MultiheadAttention, "fallback"),
]

# Why an op stays float (a ``fallback``): shown by prepare's warning and inspect's "float fallback"
# rows.  Ops not listed have no kernel here and are no op an int8 deployment quantizes as a rule.
FLOAT_REASONS: dict[str, str] = {
    "Embedding": "a subclass of nn.Embedding with its own forward, or a plan saved before embeddings were "
                 "quantized (prepare again)",
    "EmbeddingBag": "weight not quantized yet (torch.ao's quantized EmbeddingBag uses per-row weights: planned)",
    "ConvTranspose1d": "no transposed-conv kernel in qdebug yet (torch.ao and TensorRT quantize it)",
    "ConvTranspose2d": "no transposed-conv kernel in qdebug yet (torch.ao and TensorRT quantize it)",
    "ConvTranspose3d": "no transposed-conv kernel in qdebug yet (torch.ao and TensorRT quantize it)",
    "Conv3d": "no 3-d conv kernel in qdebug yet (torch.ao quantizes it)",
    "BatchNorm3d": "no 3-d BatchNorm fold in qdebug yet",
    "MultiheadAttention": "a configuration torch.ao's quantizable MultiheadAttention refuses too (add_bias_kv, "
                          "add_zero_attn, kdim/vdim) or a subclass with its own forward",
    "div": "division by a tensor: no integer kernel in any common int8 runtime (a reciprocal lookup at best)",
    "truediv": "division by a tensor: no integer kernel in any common int8 runtime (a reciprocal lookup at best)",
    "rtruediv": "a number divided by a tensor: a reciprocal, float in torch.ao, ONNX Runtime and TensorRT int8",
    "matmul": "a product with a parameter written inline (x @ self.w): no weight point -- use nn.Linear",
    "pad": "non-zero or reflect/replicate padding leaves the input's grid",
    "pow": "element-wise power: float in torch.ao, ONNX Runtime QDQ and TensorRT int8",
    "sqrt": "element-wise root: float in torch.ao, ONNX Runtime QDQ and TensorRT int8",
    "rsqrt": "element-wise root: float in torch.ao, ONNX Runtime QDQ and TensorRT int8",
    "exp": "float in torch.ao, ONNX Runtime QDQ and TensorRT int8",
    "erf": "float in torch.ao, ONNX Runtime QDQ and TensorRT int8",
    "norm": "a vector norm (sum of squares, root): float in torch.ao, ONNX Runtime QDQ and TensorRT int8 -- "
            "for L2 normalisation write F.normalize(x, dim=...), one op quantized at its output",
    "linalg_vector_norm": "a vector norm (sum of squares, root): float in torch.ao, ONNX Runtime QDQ and TensorRT "
                          "int8 -- for L2 normalisation write F.normalize(x, dim=...), one op quantized at its output",
}
_DEFAULT_FLOAT_REASON = "no quantized kernel known to qdebug for this op"


def fallback_reason(op: str) -> str:
    """Why ``op`` (a module class name or a function's canonical name) runs in float."""
    if op in FLOAT_REASONS:
        return FLOAT_REASONS[op]
    if op in ("RNN", "RNNBase", "LSTM", "GRU", "LSTMCell", "GRUCell"):
        return "a plain RNN (tanh/relu cell) or a subclass with its own forward: no quantizable recurrent layer here"
    return _DEFAULT_FLOAT_REASON


# Engine-owned module classes register themselves here (wrappers, placeholders).
_EXTRA_MODULE_CATEGORIES: dict[type, str] = {}


def register_module_category(cls: type, category: str) -> None:
    _EXTRA_MODULE_CATEGORIES[cls] = category


def module_category(module: nn.Module) -> str | None:
    """The category of a module the engine treats as one op, or None for a container."""
    cls = type(module)
    if cls in _EXTRA_MODULE_CATEGORIES:
        category = _EXTRA_MODULE_CATEGORIES[cls]
    else:
        category = None
        for base, cat in _MODULE_CATEGORIES:
            if isinstance(module, base):
                category = cat
                break
    if category is None and is_rms_norm_by_name(module):
        category = "activation"
    if category == "upsample":
        return "passthrough" if getattr(module, "mode", "nearest") == "nearest" else "activation"
    if category == "recurrent" and cls not in _EXTRA_MODULE_CATEGORIES and cls.forward not in _RECURRENT_FORWARDS:
        return "fallback"
    return category


def is_rms_norm_by_name(module: nn.Module) -> bool:
    """A model library's own RMSNorm (transformers' ``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``T5LayerNorm``,
    ...): written with pow/mean/rsqrt, one norm to a deployment -- ONNX's RMSNormalization, a fused
    NPU kernel -- so one op here too, quantized at its output like ``nn.RMSNorm``.  Recognised by
    its class name and shape: a leaf module holding a weight vector and nothing else to learn."""
    name = type(module).__name__
    if not (name.endswith("RMSNorm") or name == "T5LayerNorm") or next(module.children(), None) is not None:
        return False
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    return weight is not None and weight.dim() == 1 and set(params) <= {"weight"}


_RECURRENT_FORWARDS = frozenset({nn.LSTM.forward, nn.GRU.forward, nn.LSTMCell.forward, nn.GRUCell.forward})

# Norm-act layers (timm's ``BatchNormAct2d``, ``GroupNormAct``, ``LayerNormAct``): a subclass of a
# torch norm whose own forward calls the norm function, then child modules (``self.drop``,
# ``self.act``) -- a BN followed by its activation, written as one module so that its weights keep
# the BN's names.  The engine sees the norm and each child as calls of their own: the norm
# function's call is the module's (its path, its category: a ``bn`` that pairs with the conv
# before it), then ``<path>.act``; an ``nn.Identity`` child (no dropout, no activation) is no call.
NORM_FUNCTIONS = frozenset({"batch_norm", "group_norm", "layer_norm", "rms_norm"})
_NORM_BASES = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


def is_norm_act(module: nn.Module) -> bool:
    """Whether ``module`` is a norm-act layer (see ``NORM_FUNCTIONS``): a torch norm subclass with
    child modules and a forward of its own, or the engine's placeholder of one folded into its conv."""
    if getattr(type(module), "norm_act_placeholder", False):
        return True
    if not isinstance(module, _NORM_BASES) or next(module.children(), None) is None:
        return False
    base = next(c for c in type(module).__mro__ if c.__module__.startswith("torch.nn."))
    return type(module).forward is not base.forward


def norm_only(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The norm part of a norm-act layer's forward (its torch base class's forward) on ``x``; the
    placeholder of a folded one returns ``x``."""
    if getattr(type(module), "norm_act_placeholder", False):
        return x
    base = next(c for c in type(module).__mro__ if c.__module__.startswith("torch.nn."))
    return base.forward(module, x)


_FUNCTION_NAMES: dict[str, str] = {}


def _names(category: str, *names: str) -> None:
    for name in names:
        _FUNCTION_NAMES[name] = category


_names("add", "add", "__add__", "__radd__", "__iadd__", "add_")
_names("sub", "sub", "__sub__", "__rsub__", "__isub__", "sub_", "subtract", "rsub")
_names("mul", "mul", "__mul__", "__rmul__", "__imul__", "mul_", "multiply")
_names("cat", "cat", "concat", "concatenate", "stack")
_names("matmul", "matmul", "bmm", "__matmul__", "__rmatmul__")
_names("relu", "relu", "relu_")
_names("relu6", "relu6")
_names("mean", "mean")
_names("avgpool", "avg_pool1d", "avg_pool2d", "adaptive_avg_pool1d", "adaptive_avg_pool2d")
_names(
    "activation",
    "sigmoid", "sigmoid_", "tanh", "tanh_", "softmax", "log_softmax", "hardswish", "hardsigmoid",
    "leaky_relu", "leaky_relu_", "gelu", "silu", "elu", "mish", "prelu",
    "layer_norm", "group_norm", "rms_norm", "instance_norm",
    "normalize",  # F.normalize: L2 normalisation, one norm op (TFLite's L2_NORMALIZATION kernel)
)
# ``x / c`` with a Python number c is ``x * (1/c)``, and ``-x`` is ``x * -1``: category ``mul``,
# folded into the requantization.
_NEGATIONS = frozenset({"neg", "neg_", "negative", "__neg__"})
_names("mul", *_NEGATIONS)
_SCALAR_DIVISIONS = frozenset({"div", "div_", "__truediv__", "__itruediv__", "__idiv__", "true_divide", "divide"})
_names(
    "passthrough",
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "permute", "transpose", "t",
    "contiguous", "squeeze", "unsqueeze", "chunk", "split", "tensor_split", "unbind", "__getitem__",
    "expand", "expand_as", "to", "float", "type", "clone", "detach", "narrow", "select", "movedim",
    "max_pool1d", "max_pool2d", "max_pool1d_with_indices", "max_pool2d_with_indices",
    "adaptive_max_pool1d", "adaptive_max_pool2d", "dropout", "dropout2d", "feature_dropout", "flip",
    "repeat", "channel_shuffle", "native_channel_shuffle", "pixel_shuffle", "pixel_unshuffle", "roll",
    "__get__", "identity", "cpu", "cuda", "requires_grad_",
)


def function_category(func: Callable, args: tuple, kwargs: dict[str, Any]) -> str:
    """The category of a torch function/method call (``fallback`` when unknown)."""
    name = getattr(func, "__name__", "")
    category = _FUNCTION_NAMES.get(name, "fallback")
    if name in _SCALAR_DIVISIONS:
        folds = scalar_operand(args, kwargs) is not None and isinstance(args[0], torch.Tensor)
        return "mul" if folds else "fallback"  # c / x is a reciprocal; rounding_mode makes kwargs
    if category == "matmul":
        # Activation x activation only: a product with a weight (``x @ self.w``) is a linear
        # layer written inline, which has no weight point here -- reported as a fallback.
        operands = tensors_in((args, kwargs))
        if len(operands) != 2 or any(isinstance(t, nn.Parameter) for t in operands):
            return "fallback"
    if name in ("hardtanh", "hardtanh_", "clamp", "clamp_", "clip"):
        lo, hi = _bounds(name, args, kwargs)
        if lo == 0 and hi == 6:
            return "relu6"
        if lo == 0 and hi is None:
            return "relu"
        return "activation"
    if name == "interpolate":
        mode = kwargs.get("mode", args[3] if len(args) > 3 else "nearest")
        return "passthrough" if mode == "nearest" else "activation"
    if name == "pad":
        # Constant-zero padding (TF "SAME" padding) keeps a tensor on its grid: 0 is always
        # representable (code = the zero point), so a deployed int8 model pads in integers.
        mode = kwargs.get("mode", args[2] if len(args) > 2 else "constant")
        value = kwargs.get("value", args[3] if len(args) > 3 else None)
        return "passthrough" if mode == "constant" and not value else "fallback"
    return category


def scalar_operand(args: tuple, kwargs: dict[str, Any]) -> float | None:
    """c of ``x * c``, ``c * x``, ``x / c``: a finite Python number beside one tensor, else None."""
    if kwargs or len(args) != 2:
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    numbers = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    if len(tensors) != 1 or len(numbers) != 1 or not math.isfinite(numbers[0]) or numbers[0] == 0:
        return None
    return float(numbers[0])


def is_division(func: Callable) -> bool:
    return getattr(func, "__name__", "") in _SCALAR_DIVISIONS


def is_negation(func: Callable) -> bool:
    return getattr(func, "__name__", "") in _NEGATIONS


def _bounds(name: str, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    if name.startswith("hardtanh"):
        lo = kwargs.get("min_val", args[1] if len(args) > 1 else -1.0)
        hi = kwargs.get("max_val", args[2] if len(args) > 2 else 1.0)
    else:
        lo = kwargs.get("min", args[1] if len(args) > 1 else None)
        hi = kwargs.get("max", args[2] if len(args) > 2 else None)
    return lo, hi


def canonical_op_name(func: Callable, category: str) -> str:
    """Short name used in quant point names: ``add`` for ``x + y``, ``torch.add``, ``x.add_``."""
    if category == "mul" and is_division(func):
        return "div"
    if category == "mul" and is_negation(func):
        return "neg"
    if category in ("add", "sub", "mul", "cat", "relu", "relu6", "mean"):
        return category
    name = getattr(func, "__name__", "op").strip("_")
    if name.endswith("_"):
        name = name[:-1]
    return name or "op"


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """All tensors in a (possibly nested) structure of args, in order."""
    found: list[torch.Tensor] = []
    _collect(obj, found)
    return found


def _collect(obj: Any, found: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _collect(item, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            _collect(item, found)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in a nested structure, keeping its shape."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(o, fn) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn)) for k, v in obj.items())
    return obj
