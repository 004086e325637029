"""Read a model torch.ao converted to its int8 modules (eager ``convert``, FX ``convert_fx``).

A converted model computes with torch's quantized modules (``torch.ao.nn.quantized``,
``torch.ao.nn.intrinsic.quantized``): integer weights, and a scale and zero point for each
module's output.  ``read_converted`` reads them into a ``SourceModel`` of stage "quantized":

- the float model holds the *dequantized* weights (q - z) s and torch's float bias, and its
  weight quantizers torch's weight scales, so the engine's weight codes are torch's
  ``int_repr`` exactly; ``qdebug.engine.convert`` of the built model is the integer stage;
- every activation quantizer is the grid of a quantized tensor torch computes -- read off the
  tensors themselves in one run of the converted model, so a module that keeps its input's
  grid (a ReLU, a pooling) needs no rule -- with the dtype's full integer range: torch's
  kernels clamp to [0, 255] for quint8 even when ``reduce_range`` chose the scale on [0, 127].

Where the model comes from:

- eager (``convert``): the user's class and module paths.  Each quantized module is swapped
  for its float twin; the BN and ReLU paths that ``fuse_modules`` emptied hold ``nn.Identity``
  and are found by dataflow (``qdebug.interop.eager``): a fused module's trailing identities
  get their ReLU back, the ones before are BNs torch folded into the conv (``folded_bn``);
- FX (``convert_fx``): a GraphModule.  ``float_model`` gives the architecture and the module
  paths; a quantized module node has its float module's path (a fused ConvReLU2d the conv's),
  and an inline op (``quantized.add_relu``) is matched to the engine call that computes the
  same op on the same values: convert_fx keeps ``nn_module_stack`` only on module nodes, an
  inline op keeps its stack trace alone, and its qparam attributes are named after the module
  observed (``layer1_0_relu_scale_0`` for a ReLU module called twice), not after the op.

A BN folded by torch leaves an ``nn.Identity`` between the conv and its ReLU.  The engine's
trace counts that identity as a second use of the conv's output, which would keep the conv
from fusing into the ReLU (a float conv output, then a requantization: not torch's fused
kernel); ``eager.splice_identities`` takes it out of the plan's dataflow so the conv requantizes
straight onto the ReLU's grid, as torch's ConvReLU2d does.

Where the integer stage differs from torch's kernels (tests/test_interop_converted.py feeds
each engine kernel torch's own input codes):

- conv/linear: torch requantizes in float32 with the float bias and rounds half to even, the
  engine uses an integer bias and a fixed-point multiplier and rounds half away from zero:
  a code differs by 1 at a rounding near-tie (measured: in at most 0.8% of a layer's codes);
- average pooling and mean: torch rounds a tie to even, the engine away from zero: 1 code,
  at ties (measured: at most 1.6% of a pool's codes); add (torch dequantizes, adds in float,
  rounds half to even; the engine's integer add) may differ by 1 the same way (measured: never);
- end to end these 1-code differences travel through the layers after them: the zoo and
  eager test models' outputs differ in 0-25% of their codes, by at most 3;
- on an x86 CPU without AVX512-VNNI torch's int8 conv adds u8 x s8 product pairs in a
  saturating int16: where activation codes above 127 enter it (quint8 outputs span [0, 255]
  even when ``reduce_range`` chose the scale), torch may be off by tens of codes; the engine
  is exact (docs/engine.md).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import torch
import torch.nn as nn

from qdebug.engine.context import split_inputs
from qdebug.engine.modules import without_norm
from qdebug.engine.ops import NORM_FUNCTIONS, function_category, is_norm_act, module_category, tensors_in
from qdebug.engine.plan import CallRecord, Plan, trace_plan
from qdebug.errors import QDebugError
from qdebug.interop.dynamic_rnn import float_rnn, is_dynamic_rnn, rnn_quantizers
from qdebug.interop.torch_grid import Grid, dequantized_weight, grid_of, quantizer_of, torch_name
from qdebug.interop.eager import _set, run_once, trace_float, unfuse
from qdebug.interop.source import SourceModel, SourceQuantizer, layer_bn_pairs

QUANTIZED_PREFIXES = ("torch.ao.nn.quantized", "torch.ao.nn.intrinsic.quantized")
WEIGHTED_FLOAT = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.ConvTranspose1d, nn.ConvTranspose2d,
                  nn.ConvTranspose3d)
# Value ops whose torch kernel on a quantized tensor keeps the input's scale and zero point.
KEEPS_INPUT_GRID = frozenset({"relu", "relu6", "avgpool", "mean"})
ROUNDING_NOTE = ("torch rounds half to even in float32, the engine's integer kernel half away from zero: "
                 "a code may differ by 1 at a near-tie")


def read_converted(model: nn.Module, example_inputs: Any, float_model: nn.Module | None,
                   flow: str) -> tuple[SourceModel, Plan]:
    """The ``SourceModel`` (stage "quantized") of a converted model, and the engine plan of its
    float model.  ``flow``: "eager-converted" or "fx-converted" (``float_model`` required)."""
    if any(type(m).__module__.startswith("torch.ao.nn.quantized.reference") for m in model.modules()):
        raise QDebugError("a reference-quantized model (convert_to_reference_fx) holds float weights and "
                          "quantize/dequantize pairs, not torch's int8 modules",
                          "import the prepared model (prepare_fx/prepare_qat_fx) or the convert_fx model")
    if flow == "eager-converted":
        return _read_eager(model, example_inputs, float_model)
    if flow == "fx-converted":
        if float_model is None:
            raise QDebugError("an FX graph does not keep your model class: pass float_model=",
                              "float_model=YourNet() gives the engine model your module paths")
        return _read_fx(model, example_inputs, float_model)
    raise QDebugError(f"the converted-module importer reads eager and FX models, not {flow!r}",
                      "import it with qdebug.interop.from_torch_ao, which sends a convert_pt2e graph to "
                      "qdebug.interop.pt2e")


# -- what torch's quantized modules and tensors hold -------------------------------------
def is_torch_quantized(module: nn.Module) -> bool:
    """A module of torch's quantized namespaces (``FloatFunctional`` there is a float module)."""
    return type(module).__module__.startswith(QUANTIZED_PREFIXES) and type(module).__name__ != "FloatFunctional"


def top_quantized(model: nn.Module) -> dict[str, nn.Module]:
    """Path -> torch quantized module, outermost only (a QuantizedLinear's packed params are its own)."""
    found: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        if path and is_torch_quantized(module) and not any(path.startswith(p + ".") for p in found):
            found[path] = module
    return found


def quantized_weight(module: nn.Module) -> torch.Tensor | None:
    """The quantized weight tensor of a weighted quantized module (conv, linear), else None."""
    weight = getattr(module, "weight", None)
    if not callable(weight) or isinstance(weight, torch.Tensor):
        return None
    try:
        w = weight()
    except (RuntimeError, TypeError):
        return None
    return w if isinstance(w, torch.Tensor) and w.is_quantized else None


def weight_quantizer(path: str, module: nn.Module) -> SourceQuantizer:
    w = quantized_weight(module)
    return quantizer_of(grid_of(w), f"{path}.weight()", "weight", path,
                        note=f"the integer weight of torch's {torch_name(module)}")


def _bias(module: nn.Module) -> torch.Tensor | None:
    bias = module.bias() if callable(getattr(module, "bias", None)) else None
    return None if bias is None else bias.detach().float().clone()


def _load_weighted(layer: nn.Module, module: nn.Module, path: str) -> None:
    """Put ``module``'s dequantized weight and float bias into the float layer ``layer``."""
    _load_weights(layer, quantized_weight(module), _bias(module), path)


def _load_weights(layer: nn.Module, qweight: torch.Tensor, bias: torch.Tensor | None, path: str) -> None:
    """Put the dequantized ``qweight`` and the float ``bias`` into the float layer ``layer``."""
    weight = dequantized_weight(qweight)
    if tuple(layer.weight.shape) != tuple(weight.shape):
        raise QDebugError(f"{path}: float_model's weight has shape {tuple(layer.weight.shape)}, the converted "
                          f"model's {tuple(weight.shape)}",
                          "pass an instance of the architecture the converted model was made from")
    layer.weight = nn.Parameter(weight.to(layer.weight.device))
    if bias is not None:
        layer.bias = nn.Parameter(bias.to(layer.weight.device))
    elif layer.bias is not None:
        layer.bias = None


# -- eager: float twins of torch's quantized modules ------------------------------------
def _float_twin(module: nn.Module, path: str) -> tuple[nn.Module, list[nn.Module]]:
    """(the float module computing what ``module`` computes, the float modules fused after it)."""
    import torch.ao.nn.intrinsic.quantized as nniq
    import torch.ao.nn.quantized as nnq
    from torch.ao.nn.quantized import FloatFunctional
    from torch.ao.quantization import DeQuantStub, QuantStub

    relu_fused = (nniq.ConvReLU1d, nniq.ConvReLU2d, nniq.ConvReLU3d, nniq.LinearReLU, nniq.BNReLU2d, nniq.BNReLU3d)
    followers: list[nn.Module] = [nn.ReLU()] if isinstance(module, relu_fused) else []
    if isinstance(module, nnq.Quantize):
        return QuantStub(), []
    if isinstance(module, nnq.DeQuantize):
        return DeQuantStub(), []
    if isinstance(module, nnq.QFunctional):
        return FloatFunctional(), []
    if quantized_weight(module) is not None:
        return _float_weighted(module, path), followers
    if isinstance(module, (nnq.BatchNorm2d, nnq.BatchNorm3d)):
        bn = (nn.BatchNorm2d if isinstance(module, nnq.BatchNorm2d) else nn.BatchNorm3d)(
            module.num_features, module.eps, module.momentum)
        bn.load_state_dict({k: v for k, v in module.state_dict().items() if k in bn.state_dict()})
        return bn, followers
    simple = {
        nnq.ReLU6: lambda m: nn.ReLU6(),
        nnq.Hardswish: lambda m: nn.Hardswish(),
        nnq.ELU: lambda m: nn.ELU(m.alpha),
        nnq.LeakyReLU: lambda m: nn.LeakyReLU(m.negative_slope),
        nnq.Sigmoid: lambda m: nn.Sigmoid(),
        nnq.Softmax: lambda m: nn.Softmax(m.dim),
        nnq.Dropout: lambda m: nn.Dropout(m.p),
        nnq.MaxPool2d: lambda m: nn.MaxPool2d(m.kernel_size, m.stride, m.padding, m.dilation,
                                              ceil_mode=m.ceil_mode),
    }
    make = simple.get(type(module))
    if is_dynamic_rnn(module):  # nnqd.LSTM/GRU: int8 weights on QLSTM/QGRU (qdebug.interop.dynamic_rnn)
        return float_rnn(module), []
    if make is None and type(module).__module__.startswith("torch.ao.nn.quantized.dynamic"):
        raise QDebugError(f"{path}: cannot import torch's dynamic {type(module).__name__} yet",
                          "quantize_dynamic only the Linear, LSTM and GRU layers, or prepare the model with "
                          "torch.ao's eager prepare/prepare_qat (its quantizable LSTM imports exactly)")
    if isinstance(module, nnq.MultiheadAttention):
        # Its float bmm/softmax between int8 projections would import, but its linears' weights
        # and output grids would need the decomposition's names: not done yet.
        raise QDebugError(f"{path}: cannot import torch's converted MultiheadAttention yet",
                          "import the model torch's prepare/prepare_qat returned (before convert): its quantizable "
                          "MultiheadAttention imports exactly, and qdebug convert makes the integer stage")
    if make is None:
        raise QDebugError(f"{path}: cannot import torch's converted {type(module).__name__}",
                          "qdebug reads converted conv, linear, BatchNorm, ReLU6, Hardswish, ELU, LeakyReLU, "
                          "Sigmoid, Softmax, Dropout, QuantStub/DeQuantStub and FloatFunctional modules; import the "
                          "prepared model instead")
    return make(module), []


def _float_weighted(module: nn.Module, path: str) -> nn.Module:
    """A plain torch conv or linear layer holding ``module``'s dequantized weight and bias."""
    import torch.ao.nn.quantized as nnq

    if isinstance(module, nnq.Linear):  # the dynamic Linear too
        layer: nn.Module = nn.Linear(module.in_features, module.out_features)
    else:
        pairs = [(nnq.ConvTranspose1d, nn.ConvTranspose1d), (nnq.ConvTranspose2d, nn.ConvTranspose2d),
                 (nnq.ConvTranspose3d, nn.ConvTranspose3d), (nnq.Conv1d, nn.Conv1d), (nnq.Conv2d, nn.Conv2d),
                 (nnq.Conv3d, nn.Conv3d)]
        cls = next((f for q, f in pairs if isinstance(module, q)), None)
        if cls is None:
            raise QDebugError(f"{path}: cannot import torch's converted {type(module).__name__}",
                              "qdebug reads converted conv and linear layers; import the prepared model instead")
        kwargs = {"output_padding": module.output_padding} if getattr(module, "transposed", False) else {}
        layer = cls(module.in_channels, module.out_channels, module.kernel_size, module.stride, module.padding,
                    dilation=module.dilation, groups=module.groups, padding_mode=module.padding_mode, **kwargs)
    _load_weighted(layer, module, path)
    return layer


QFUNCTIONAL_OPS = ("add", "add_relu", "add_scalar", "mul", "mul_scalar", "cat", "matmul")


def _module_grids(model: nn.Module, example_inputs: Any) -> dict[str, list[Grid | None]]:
    """Module path -> the grid of its output, per call, in one run of the converted model.

    A ``QFunctional`` computes in its methods, not in ``forward``: its methods are wrapped on
    the instance for the run (and unwrapped after), so its calls are recorded the same way."""
    import torch.ao.nn.quantized as nnq

    grids: dict[str, list[Grid | None]] = defaultdict(list)
    handles = []
    wrapped: list[tuple[nn.Module, str]] = []

    def hook(path):
        def record(module, args, output):
            grids[path].append(grid_of(output))
        return record

    def method(path, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            grids[path].append(grid_of(out))
            return out
        return call

    for path, module in model.named_modules():
        if not path:
            continue
        handles.append(module.register_forward_hook(hook(path)))
        if isinstance(module, nnq.QFunctional):
            for name in QFUNCTIONAL_OPS:
                if hasattr(module, name) and name not in module.__dict__:
                    object.__setattr__(module, name, method(path, getattr(module, name)))
                    wrapped.append((module, name))
    try:
        run_once(model, example_inputs, handles)
    finally:
        for module, name in wrapped:
            del module.__dict__[name]
    return dict(grids)


def _read_eager(converted: nn.Module, example_inputs: Any,
                float_model: nn.Module | None) -> tuple[SourceModel, Plan]:
    quantized = top_quantized(converted)
    model, folded = _eager_float_model(converted, quantized, example_inputs, float_model)
    grids = _module_grids(converted, example_inputs)
    plan, records, anchors = trace_float(model, example_inputs, [slot for _, slot in folded])

    source = SourceModel("eager-converted", "quantized", model, example_inputs, folded_bn=folded)
    for path, module in quantized.items():
        if quantized_weight(module) is not None:
            source.quantizers.append(weight_quantizer(path, module))
        if is_dynamic_rnn(module):
            weights, unmapped = rnn_quantizers(path, module)
            source.quantizers.extend(weights)
            source.unsupported.extend(unmapped)
    _dynamic_inputs(quantized, plan, source)
    assigned: dict[str, Grid] = {}
    for path, calls in anchors.items():
        for k, anchor in enumerate(calls):
            grid = (grids.get(path) or [None] * (k + 1))[k]
            if grid is None:
                continue  # a QuantStub left float (no qconfig): nothing quantized here
            module = quantized.get(path)
            note = (f"output of torch's {torch_name(module)} (its op is the engine's {anchor!r}); {ROUNDING_NOTE}"
                    if module is not None and type(module).__name__ == "QFunctional"
                    else "torch's Quantize (the QuantStub's place): its input is quantized")
            source.quantizers.append(quantizer_of(grid, path if len(calls) == 1 else f"{path}#{k + 1}",
                                                  "activation", anchor or None, note))
            if anchor:
                assigned[anchor] = grid
    source.quantizers.extend(_eager_outputs(converted, plan, records, grids, assigned, source))
    if quantized and all(type(m).__module__.startswith("torch.ao.nn.quantized.dynamic") for m in quantized.values()):
        # Only dynamic layers: the engine's integer stage has no dynamic-activation kernel yet,
        # so the import is the fake-quant model (torch's int8 codes, float accumulation).
        source.stage = "calibrated"
    return source, plan


def _dynamic_inputs(modules: dict[str, nn.Module], plan: Plan, source: SourceModel) -> None:
    """The input quantizer of every dynamic Linear among ``modules`` (path -> torch's module, eager
    or FX converted), or the reason it is unmapped."""
    import torch.ao.nn.quantized.dynamic as nnqd

    linears = {path: m for path, m in modules.items() if isinstance(m, nnqd.Linear)}
    int8 = frozenset(p for p, m in linears.items() if getattr(m._packed_params, "dtype", None) == torch.qint8)
    for path, module in linears.items():
        found = _dynamic_input(path, module, plan, int8)
        if isinstance(found, str):
            source.unsupported.append((path, found))
        else:
            source.quantizers.append(found)


def _dynamic_input(path: str, module: nn.Module, plan: Plan,
                   dynamic: frozenset[str] = frozenset()) -> SourceQuantizer | str:
    """torch's per-batch quantization of dynamic Linear ``path``'s input, as a dynamic point on
    the call producing it; or why it cannot be (the engine quantizes a call's output, for
    every consumer: the producer must feed this layer alone, or only int8 dynamic Linears --
    ``dynamic`` -- which quantize the same tensor the same way: attention's q, k, v projections)."""
    rec = plan.calls.get(path)
    producer = plan.calls.get(rec.inputs[0]) if rec is not None and rec.inputs and rec.inputs[0] else None
    if getattr(module._packed_params, "dtype", None) != torch.qint8:
        return f"dynamic {module._packed_params.dtype} quantization: the engine has no float16 weights; left float"
    consumers = producer.consumers if producer is not None else []
    if producer is None or not consumers or not (
            len(consumers) == 1 or all(c.split("#")[0] in dynamic for c in consumers)):
        return ("dynamic quantization: torch quantizes this layer's input per batch; its producer feeds other "
                "calls too, and an engine point would quantize them as well: the input stays float")
    # nnqd.Linear (version 4+) asks for reduce_range: fbgemm/x86 then quantize to [0, 127];
    # qnnpack ignores it ([0, 255]).
    reduce = (getattr(module, "version", None) or 0) >= 4 and torch.backends.quantized.engine != "qnnpack"
    how = "reduce_range" if reduce else "full range"
    return SourceQuantizer(f"{path}.input", "activation", producer.name, torch.ones(()),
                           torch.zeros((), dtype=torch.int32), 0, 127 if reduce else 255, "quint8",
                           "per_tensor_affine", dynamic=True,
                           note=f"torch's {torch_name(module)} quantizes its input per batch ({how}, from the "
                                "batch's min/max and 0); the int8 GEMM's float rescale differs from the engine's "
                                "fake quant in float rounding only")


def _eager_float_model(converted: nn.Module, quantized: dict[str, nn.Module], example_inputs: Any,
                       float_model: nn.Module | None) -> tuple[nn.Module, list[tuple[str, str]]]:
    """(a copy of ``converted`` with the float twin of each quantized module, the (conv, BN)
    pairs torch folded).  A fused module's emptied paths are the identities called on its
    output: its ReLU goes back to the last ones, the ones before are folded BNs (only those at
    a BatchNorm's path of ``float_model``, when given)."""
    twins = {path: _float_twin(m, path) for path, m in quantized.items()}
    parts = {p: (twin, followers) for p, (twin, followers) in twins.items()
             if isinstance(twin, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.modules.batchnorm._BatchNorm))}
    model, folded, _ = unfuse(converted, parts, example_inputs,
                              folded_bn=lambda slot: float_model is None or _is_bn(float_model, slot))
    for path, (twin, _) in twins.items():
        if path not in parts:
            _set(model, path, twin)
    return model, folded


def _is_bn(model: nn.Module, path: str) -> bool:
    try:
        return isinstance(model.get_submodule(path), nn.modules.batchnorm._BatchNorm)
    except AttributeError:
        return False


def _eager_outputs(converted: nn.Module, plan: Plan, records: dict[str, CallRecord],
                   grids: dict[str, list[Grid | None]], assigned: dict[str, Grid],
                   source: SourceModel) -> list[SourceQuantizer]:
    """Quantizers of the module calls (their outputs' grids) and of inline ops (their input's)."""
    found = []
    for rec in plan.calls.values():
        if rec.category == "input" or rec.name in assigned:
            continue
        if rec.is_module:
            path, _, index = rec.name.partition("#")
            module = _submodule(converted, path)
            if module is None or type(module) is nn.Identity:
                continue  # a fused module's emptied slot: its grid is the fused module's
            calls = grids.get(path, [])
            k = int(index or 1)
            grid = calls[k - 1] if k <= len(calls) else None
            if grid is None:
                continue  # a float output (after a DeQuantStub, or a module left float)
            note = f"output of torch's {torch_name(module)}"
            if rec.category in ("conv", "linear", "avgpool", "mean", "add"):
                note += f"; {ROUNDING_NOTE}"
            found.append(quantizer_of(grid, rec.name, "activation", rec.name, note))
            assigned[rec.name] = grid
        elif rec.point:  # an inline op fused into the op after it lands on that op's grid
            producer = _producer(records, rec.inputs[0]) if rec.inputs else ""
            grid = assigned.get(producer) or assigned.get(_end(plan, producer)) if producer else None
            if rec.category in KEEPS_INPUT_GRID and grid is not None:
                note = f"torch's quantized {rec.op} keeps its input's scale and zero point"
                if rec.category in ("avgpool", "mean"):
                    note += f"; {ROUNDING_NOTE}"
                found.append(quantizer_of(grid, rec.name, "activation", rec.name, note))
                assigned[rec.name] = grid
            elif grid is not None:
                source.unsupported.append((rec.name, f"inline {rec.op} on torch's quantized tensors: the converted "
                                                     "model records no grid for its output; left float"))
    return found


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


# -- the plan: identities of folded BNs are not a second use -----------------------------
def _producer(records: dict[str, CallRecord], name: str) -> str:
    """The call whose value ``name`` carries (through passthrough views)."""
    for _ in range(len(records)):
        if not name.startswith("~"):
            return name
        rec = records.get(name)
        name = rec.inputs[0] if rec is not None and rec.inputs else ""
    return name


def _end(plan: Plan, name: str) -> str:
    """The last call of ``name``'s fused chain (conv -> relu: the relu)."""
    for _ in range(len(plan.calls)):
        rec = plan.calls.get(name)
        if rec is None or rec.fused_into is None:
            return name
        name = rec.fused_into
    return name


# -- FX: the graph's nodes matched to the engine's calls ----------------------------------
class _Named:
    """A stand-in carrying a function name, for ``function_category`` on method and op names."""

    def __init__(self, name: str):
        self.__name__ = name


def _op_name(node) -> str:
    """An FX node's function name: ``add_relu`` for ``torch.ops.quantized.add_relu``."""
    target = node.target
    if isinstance(target, str):
        return target
    qualified = getattr(target, "_qualified_op_name", None)
    if qualified:
        return qualified.split("::")[-1]
    return getattr(target, "__name__", str(target))


def _norm_act_node(node, float_modules: dict[str, nn.Module]) -> str | None:
    """The path of the norm-act layer (timm's BatchNormAct2d) whose norm the FX ``node`` computes
    (FX traced into the layer: a batch_norm reading the layer's parameters), else None."""
    if node.op != "call_function" or _op_name(node) not in NORM_FUNCTIONS:
        return None
    owners = {str(a.target).rpartition(".")[0] for a in (*node.args, *node.kwargs.values())
              if isinstance(a, torch.fx.Node) and a.op == "get_attr"}
    path = owners.pop() if len(owners) == 1 else None
    return path if path is not None and is_norm_act(float_modules.get(path, nn.Module())) else None


# torch's quantized kernels on packed weights: convert_fx lowers an F.linear/F.conv it traced (a
# layer's own forward -- timm's Linear -- or the model's functional op) to one of these at the
# graph root, its packed weight a root attribute (``classifier_packed_weight_0``).
PACKED_OPS = {"linear": "linear", "linear_relu": "linear", "conv1d": "conv", "conv2d": "conv", "conv3d": "conv",
              "conv1d_relu": "conv", "conv2d_relu": "conv", "conv3d_relu": "conv"}


def _packed_weight(node, gm: nn.Module):
    """The get_attr node of the packed weight torch's quantized conv/linear ``node`` reads, else None."""
    if node.op != "call_function" or _op_name(node) not in PACKED_OPS:
        return None
    if not str(getattr(node.target, "_qualified_op_name", "")).startswith("quantized::"):
        return None
    attr = node.args[1] if len(node.args) > 1 else None
    if not isinstance(attr, torch.fx.Node) or attr.op != "get_attr":
        return None
    return attr if isinstance(_attribute(gm, str(attr.target)), torch.ScriptObject) else None


def _attribute(gm: nn.Module, target: str) -> Any:
    owner = gm
    for part in target.split("."):
        owner = getattr(owner, part, None)
    return owner


def _fx_category(node, modules: dict[str, nn.Module], float_modules: dict[str, nn.Module]) -> str:
    """The engine category of an FX node: "quantize"/"dequantize" for torch's borders."""
    norm_act = _norm_act_node(node, float_modules)
    if norm_act is not None:
        return module_category(float_modules[norm_act]) or "fallback"
    if node.op == "call_module":
        module = float_modules.get(node.target)
        if module is None:
            module = modules.get(node.target)
        return (module_category(module) or "fallback") if module is not None else "fallback"
    name = _op_name(node)
    if name.startswith("quantize_per") or name == "quantize":
        return "quantize"
    if name == "dequantize":
        return "dequantize"
    if name.endswith("_relu") and name[: -len("_relu")] in ("add", "mul", "cat", "add_scalar", "mul_scalar"):
        name = name[: -len("_relu")]
    name = {"add_scalar": "add", "mul_scalar": "mul"}.get(name, name)
    return function_category(_Named(name), tuple(node.args), dict(node.kwargs))


def _fx_grids(gm: torch.fx.GraphModule, example_inputs: Any) -> tuple[dict, dict]:
    """(FX node -> the grid of its output, placeholder node -> its input tensor) in one run."""
    args, kwargs = split_inputs(example_inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    positional = list(args)
    for node in placeholders[len(args):]:
        if node.target in kwargs:
            positional.append(kwargs[node.target])
        elif node.args:
            positional.append(node.args[0])
    grids: dict = {}
    inputs: dict = {}

    class Capture(torch.fx.Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            grids[node] = grid_of(out)
            if node.op == "placeholder":
                inputs[node] = out
            return out

    with torch.no_grad():
        Capture(gm).run(*positional)
    return grids, inputs


def _read_fx(gm: nn.Module, example_inputs: Any, float_model: nn.Module) -> tuple[SourceModel, Plan]:
    model = copy.deepcopy(float_model)
    modules = dict(gm.named_modules())
    graph_modules = [n for n in gm.graph.nodes if n.op == "call_module"]
    called = {n.target for n in graph_modules}

    # FX folds every Conv-BN (Linear-BN) pair into the layer (one left out of quantization too):
    # the BN's path is no longer called.
    # Linear-BN pairs too (``layer_bn_pairs``): convert_fx folds a BatchNorm1d into its Linear.
    # A norm-act layer (timm's BatchNormAct2d) is no module call of the graph: FX traced into it,
    # its batch_norm reads the BN's parameters (get_attr) when it still runs.
    read = {str(n.target).rpartition(".")[0] for n in gm.graph.nodes if n.op == "get_attr"}
    folded = [(conv, bn) for conv, bn in layer_bn_pairs(trace_plan(model, example_inputs), model)
              if conv in called and bn not in called and bn not in read]
    for _, bn in folded:
        _set(model, bn, without_norm(_submodule(model, bn)))
    source = SourceModel("fx-converted", "quantized", model, example_inputs, folded_bn=folded)
    for path in sorted(called):
        _load_fx_module(model, path, modules[path], source)

    plan, records, _ = trace_float(model, example_inputs, [bn for _, bn in folded])
    quantized = {path: modules[path] for path in sorted(called) if is_torch_quantized(modules[path])}
    _dynamic_inputs(quantized, plan, source)
    if quantized and all(type(m).__module__.startswith("torch.ao.nn.quantized.dynamic") for m in quantized.values()):
        source.stage = "calibrated"  # only dynamic layers: as in the eager flow (``_read_eager``)

    grids, inputs = _fx_grids(gm, example_inputs)
    float_modules = dict(model.named_modules())
    categories = {n: _fx_category(n, modules, float_modules) for n in gm.graph.nodes
                  if n.op in ("call_module", "call_function", "call_method")}
    norm_acts = {n: p for n in categories if (p := _norm_act_node(n, float_modules)) is not None}
    packed = {n: attr for n in categories if (attr := _packed_weight(n, gm)) is not None}
    categories.update({n: PACKED_OPS[_op_name(n)] for n in packed})
    matched = _match_fx(gm, categories, plan, records, inputs, example_inputs, norm_acts, packed)
    loaded: set[str] = set()
    for node, attr in packed.items():
        _load_packed(model, gm, node, attr, plan.calls.get(matched.get(node, "")), source, loaded)
    for node, category in categories.items():
        grid = grids.get(node)
        if grid is None:
            continue  # a float value: torch leaves it unquantized
        if category == "quantize":
            anchor = _fx_value(node.args[0], matched, categories)
            source.quantizers.append(quantizer_of(grid, node.name, "activation", anchor,
                                                  "torch's quantize_per_tensor of this value"))
            # After a view module (timm's global_pool.flatten), on a grid of its own: ``build``
            # gives that module's call a point (as for a prepared FX model's observer there).
            source.quantizers[-1].view = _view_module(node.args[0], categories)
        elif node in matched:
            note = f"output of torch's {_describe(node, modules)}"
            if category in ("conv", "linear", "add", "avgpool", "mean"):
                note += f"; {ROUNDING_NOTE}"
            source.quantizers.append(quantizer_of(grid, node.name, "activation", matched[node], note))
        elif category not in ("passthrough", "dequantize", "ignore"):
            source.unsupported.append((node.name, f"{_describe(node, modules)} matches no call of float_model's "
                                                  "forward; its output grid is not imported"))
    return source, plan


def _load_fx_module(model: nn.Module, path: str, module: nn.Module, source: SourceModel) -> None:
    """Put what the graph's module at ``path`` holds into float_model's: a quantized layer's
    dequantized weight (and its weight quantizer), a quantized BN's statistics, a float
    module's parameters and buffers (QAT trained them too)."""
    layer = _submodule(model, path)
    if layer is None:
        raise QDebugError(f"float_model has no module {path!r}, which the converted graph calls",
                          "pass an instance of the architecture the converted model was made from")
    if quantized_weight(module) is not None:
        if not isinstance(layer, WEIGHTED_FLOAT):
            raise QDebugError(f"float_model's {path!r} is a {type(layer).__name__}, the converted graph's "
                              f"a {torch_name(module)}",
                              "pass an instance of the architecture the converted model was made from")
        _load_weighted(layer, module, path)
        source.quantizers.append(weight_quantizer(path, module))
        return
    if isinstance(module, WEIGHTED_FLOAT) and isinstance(layer, WEIGHTED_FLOAT):
        # A float layer left out of quantization: its weights may be folded or trained.
        if tuple(layer.weight.shape) != tuple(module.weight.shape):
            raise QDebugError(f"{path}: float_model's weight has shape {tuple(layer.weight.shape)}, the converted "
                              f"graph's {tuple(module.weight.shape)}",
                              "pass an instance of the architecture the converted model was made from")
        layer.weight = nn.Parameter(module.weight.detach().clone())
        layer.bias = None if module.bias is None else nn.Parameter(module.bias.detach().clone())
        return
    state = module.state_dict()
    if is_torch_quantized(module):
        # A quantized BN (or norm) keeps float parameters; its output grid is read off the run.
        own = layer.state_dict()
        state = {k: v for k, v in state.items() if k in own and not k.startswith(("scale", "zero_point"))}
    if state and set(state) <= set(layer.state_dict()):
        layer.load_state_dict(state, strict=False)


def _load_packed(model: nn.Module, gm: nn.Module, node, attr, rec: CallRecord | None, source: SourceModel,
                 loaded: set[str]) -> None:
    """The weight and bias of torch's quantized conv/linear ``node`` (packed in ``attr``) into the
    float layer whose own forward FX traced into (timm's Linear: the engine calls it as one
    layer), with its weight quantizer, as for a converted module; a functional op's weight has
    no engine weight point: listed."""
    weight, bias = _attribute(gm, str(attr.target)).unpack()
    where = f"torch's quantized::{_op_name(node)} (FX node {node.name!r})"
    if rec is None or not rec.is_module:
        source.unsupported.append((str(attr.target), f"the weight {where} reads: "
                                   + ("a functional op's weight has no engine weight point (only modules' "
                                      "weights are quantized), it stays float" if rec is not None
                                      else "no call of float_model's forward computes it")))
        return
    path = rec.name.split("#", 1)[0]  # a layer called k times: its k-th call ``path#k``
    if path in loaded:
        return
    layer = _submodule(model, path)
    if not isinstance(layer, WEIGHTED_FLOAT):
        raise QDebugError(f"float_model's {path!r} is a {type(layer).__name__}, the converted graph's "
                          f"{where} reads a packed weight there",
                          "pass an instance of the architecture the converted model was made from")
    _load_weights(layer, weight, None if bias is None else bias.detach().float().clone(), path)
    source.quantizers.append(quantizer_of(grid_of(weight), str(attr.target), "weight", path,
                                          note=f"the integer weight {where} reads: FX traced into "
                                               f"{type(layer).__name__}'s own forward"))
    loaded.add(path)


def _describe(node, modules: dict[str, nn.Module]) -> str:
    if node.op == "call_module":
        return f"{torch_name(modules[node.target])} at {node.target!r}"
    return f"{_op_name(node)} (FX node {node.name!r})"


def _view_module(node, categories: dict) -> str | None:
    """The passthrough module (an ``nn.Flatten``) whose output FX ``node`` is, looking through
    dequantize nodes, else None."""
    while isinstance(node, torch.fx.Node) and categories.get(node) == "dequantize" and node.args:
        node = node.args[0]
    if isinstance(node, torch.fx.Node) and node.op == "call_module" and categories.get(node) == "passthrough":
        return str(node.target)
    return None


def _fx_value(node, matched: dict, categories: dict) -> str | None:
    """The engine call whose value the FX ``node`` carries: its own, or (through quantize,
    dequantize and passthrough nodes) its source's."""
    for _ in range(len(categories) + 1):
        if node in matched:
            return matched[node]
        if categories.get(node) not in ("quantize", "dequantize", "passthrough") or not node.args:
            return None
        node = node.args[0]
    return None


def _match_fx(gm, categories: dict, plan: Plan, records: dict[str, CallRecord], inputs: dict,
              example_inputs: Any, norm_acts: dict | None = None, packed: dict | None = None) -> dict:
    """FX node -> the engine call (in ``plan``) computing the same thing.

    Placeholders: the engine's inputs, by tensor identity.  Module nodes: the call of the
    same path (the k-th node of a path: its k-th call).  Inline ops: the engine call of the
    same category whose inputs carry the same values (compared as the ends of fused chains:
    torch's fused ConvReLU2d is the engine's conv -> relu); the first such call in order.  The
    norm of a norm-act layer (``norm_acts``: node -> the layer's path) is that layer's call.
    torch's quantized conv/linear on a packed weight (``packed``) is the call of the layer of its
    category whose forward FX traced into (a module call), else the functional op's own call.
    """
    args, kwargs = split_inputs(example_inputs)
    float_inputs = [id(t) for t in tensors_in((args, kwargs)) if torch.is_floating_point(t)]
    input_names = [r.name for r in plan.calls.values() if r.category == "input"]
    matched: dict = {}
    taken: set[str] = set()
    occurrences: dict[str, int] = defaultdict(int)
    module_targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            t = inputs.get(node)
            if isinstance(t, torch.Tensor) and id(t) in float_inputs:
                k = float_inputs.index(id(t))
                if k < len(input_names):
                    matched[node] = input_names[k]
            continue
        category = categories.get(node)
        if category is None or category in ("quantize", "dequantize", "passthrough", "ignore"):
            continue
        if node.op == "call_module" or node in (norm_acts or {}):
            path = node.target if node.op == "call_module" else norm_acts[node]
            occurrences[path] += 1
            k = occurrences[path]
            name = path if k == 1 else f"{path}#{k}"
            if name in plan.calls:
                matched[node] = name
                taken.add(name)
            continue
        wanted = sorted(_end(plan, v) for v in (_fx_value(a, matched, categories) for a in _node_args(node)) if v)
        functional = _op_name(node).removesuffix("_relu") if node in (packed or {}) else None
        for rec in plan.calls.values():
            if rec.name in taken:
                continue
            if functional is not None:
                # A layer the graph calls as a module is that node's, wherever it comes.
                if not (rec.category == category and rec.name.split("#", 1)[0] not in module_targets
                        if rec.is_module else rec.op == functional):
                    continue
            elif rec.is_module or rec.category != category:
                continue
            got = sorted(_end(plan, _producer(records, p)) for p in rec.inputs if p and _producer(records, p))
            if got == wanted:
                matched[node] = rec.name
                taken.add(rec.name)
                break
    return matched


def _node_args(node) -> list:
    """The FX nodes among ``node``'s arguments that carry tensors (not scale/zero-point attributes)."""
    found: list = []

    def visit(a):
        if isinstance(a, torch.fx.Node):
            if a.op != "get_attr":
                found.append(a)
        elif isinstance(a, (list, tuple)):
            for item in a:
                visit(item)
        elif isinstance(a, dict):
            for item in a.values():
                visit(item)

    visit(node.args)
    visit(node.kwargs)
    return found
