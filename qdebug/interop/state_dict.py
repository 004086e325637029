"""A torch.ao prepared model's ``state_dict`` -> that prepared model again, rebuilt by torch.

``qdebug import`` reads a file of tensors only (never code from a file: ``qdebug.io.torchfile``)
and the user's float class (``--model``, which the user trusts), and makes torch prepare the
float model the way the file's keys say it was prepared:

- the flow: FX puts its quantizers at the root (``activation_post_process_N.*``), eager mode
  on the module they follow (``P.activation_post_process.*``, ``P.weight_fake_quant.*``);
- QAT or PTQ: FakeQuantize modules save ``fake_quant_enabled``, observers do not;
- eager fusion, from the float model's engine plan (its Conv-BN pairs and the ReLU each conv
  or BN feeds) and the keys: a QAT ``ConvBn2d`` keeps its BN as ``P.bn.*``; PTQ
  ``fuse_modules`` folds the BN into the conv (the BN's keys are gone) and makes a fused
  ReLU a ``Sequential`` (``P.0.weight``).  A QAT ``ConvBnReLU2d`` and a ``ConvBn2d`` with a
  separate ReLU have the same keys: the ReLU is taken as fused -- what fuse_modules_qat
  recipes do -- unless the quantizer saw negative values, which after a ReLU it cannot;
- the qconfig: torch's default of ``--backend`` on exactly the modules that have quantizer
  keys (eager), or the default qconfig mapping (FX).  Keys under an ``nn.MultiheadAttention``
  (``attn.linear_Q.activation_post_process.*``) are torch.ao's quantizable MHA, which eager
  prepare swaps in (its default custom module config): the qconfig goes on the attention
  itself, whose ``from_float`` prepares its own Linears.

The rebuilt model must take the file with ``load_state_dict(strict=True)``, and every loaded
FakeQuantize scale must be the one its observer's range gives under that qconfig (the range
[quant_min, quant_max] is not saved: a file prepared with another backend's reduce_range or
granularity would load, then compute something else).  Any mismatch is one error naming
what differs.  ``qdebug.interop.from_torch_ao`` then imports the rebuilt model.

A *converted* model's state_dict (torch's int8 modules: quantized tensors, ``_packed_params``)
is rebuilt the same way up to torch's ``convert`` (``rebuild_converted``): eager, a BN whose
keys are gone was folded into its conv, and a ReLU after a converted conv or linear is taken
as fused where that layer's output zero point is 0 (``nnq.ConvReLU2d`` saves the keys of
``nnq.Conv2d``; on a grid starting at 0 both compute the same codes); ``--backend``'s default
qconfig goes on the modules whose keys the int8 modules save; FX, ``prepare_fx`` with the
default mapping and ``convert_fx``.  Every scale and integer weight is then the file's.
"""

from __future__ import annotations

import copy
import re
from collections import OrderedDict
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from qdebug.errors import QDebugError

BACKENDS = ("x86", "fbgemm", "qnnpack", "onednn")
EAGER_MARKERS = ("activation_post_process", "weight_fake_quant")
FX_QUANTIZER = re.compile(r"^activation_post_process_\d+\.")
# A saved scale vs the one its observer's range gives: torch's fused QAT kernel divides a
# symmetric int8 range by 127 where the observer's calculate_qparams divides by 127.5 (0.4%);
# another backend's range or granularity differs by about 2x, or in shape or zero point.
RANGE_RTOL = 0.01
MISMATCH_HINT = ("is --model the class (with the config's model_kwargs) the state_dict was saved from, and "
                 "--backend the one it was prepared for (x86, fbgemm, qnnpack, onednn)?")
RESAVE_HINT = ("in the script that prepared the model, save torch.save(prepared.state_dict(), path) and import "
               "that file")
# torch.ao's own notices while preparing (deprecation, reduce_range, observers never run):
# about torch's API, not the user's model.
_TORCH_NOTICES = ("torch.ao.quantization is deprecated", "Please use quant_min and quant_max",
                  "must run observer before calling calculate_qparams", "reduce_range will be deprecated")

_LOAD_NOTICES = ("TypedStorage is deprecated", "quantized tensor creation functions")


@dataclass
class Rebuilt:
    """A prepared model rebuilt from a state_dict, and how."""

    prepared: nn.Module
    flow: str  # "eager" | "fx"
    qat: bool
    float_model: nn.Module  # a float copy of the user's model (FX imports need it)
    fusions: list[list[str]] = field(default_factory=list)  # eager: the module groups fused
    converted: bool = False  # ``prepared`` is torch's converted model (int8 modules), rebuilt


# -- reading the file --------------------------------------------------------------------
def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a saved state_dict (a prepared model's, or a converted one's: see
    ``is_converted_state``), refused with one clear error when the file is anything else."""
    from qdebug.checkpoint import FORMAT, check_state, extract_state_dict
    from qdebug.io.torchfile import pickled_class, read_file

    p = Path(path)
    try:
        with warnings.catch_warnings():  # torch's notices on reading quantized tensors: about its API
            for notice in _LOAD_NOTICES:
                warnings.filterwarnings("ignore", message=f".*{re.escape(notice)}")
            obj = read_file(p)
    except QDebugError as exc:
        if "pickled" not in exc.message:  # missing, damaged, not a regular file: said as it is
            raise
        whole = pickled_class(p)
        if whole is not None:
            raise QDebugError(f"{p} is a whole pickled model (torch.save(model)) of class {whole}: qdebug import "
                              "reads tensors only, never code from a file", RESAVE_HINT) from None
        raise QDebugError(f"{p} holds pickled Python objects besides tensors: qdebug import reads tensors only",
                          RESAVE_HINT) from None
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        raise QDebugError(f"{p} is already a qdebug checkpoint", f"use it as it is, e.g. qdebug inspect {p}")
    if isinstance(obj, dict) and _converted_keys(obj):
        state = obj.get("state_dict", obj) if isinstance(obj.get("state_dict"), dict) else obj
        check_converted_state(state, str(p))
        kept = dict(state)
        # torch's int8 modules read their key layout from the saved versions (nnq.Linear's
        # version 1 had ``P.weight``): keep the state_dict's ``_metadata``.
        metadata = getattr(state, "_metadata", None)
        if isinstance(metadata, dict):
            kept = OrderedDict(kept)
            kept._metadata = metadata  # type: ignore[attr-defined]
        return kept
    state = extract_state_dict(obj)
    if state is None:
        raise QDebugError(f"{p} is not a state_dict (found {type(obj).__name__})", RESAVE_HINT)
    check_state(state, str(p))
    return dict(state)


def is_converted_state(state: dict) -> bool:
    """Whether a state_dict is a converted model's (torch's int8 modules), not a prepared one's."""
    return _converted_keys(state)


def check_converted_state(state: Any, path: str) -> None:
    """A converted model's state holds what torch's int8 modules save and nothing else: tensors
    (quantized ones too), each holding no more values than the file stores for it; None (a conv's
    absent bias); a dtype (``P._packed_params.dtype``); a tuple of tensors or None
    (``P._packed_params._packed_params``: a Linear's weight and bias).  The same rule as a
    prepared state's (``check_state``), read before torch's modules copy anything."""

    def stored(tensor: Any, what: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise QDebugError(f"{path}: {what} is a {type(tensor).__name__}, not a tensor", RESAVE_HINT)
        if tensor.layout != torch.strided:
            raise QDebugError(f"{path}: {what} is a {tensor.layout} tensor; qdebug reads dense tensors", RESAVE_HINT)
        held = tensor.untyped_storage().nbytes()
        if tensor.numel() * tensor.element_size() > held:
            raise QDebugError(f"{path}: {what} is an expanded view: {list(tensor.shape)} ({tensor.numel()} values) "
                              f"over {held // max(tensor.element_size(), 1)} stored",
                              "save real tensors (x.contiguous().clone()), not expanded views")

    for key, value in state.items():
        if not isinstance(key, str):
            raise QDebugError(f"{path}: the state_dict has a key {key!r} that is not a string", RESAVE_HINT)
        if value is None or isinstance(value, torch.dtype):  # a conv without bias saves None
            continue
        if isinstance(value, tuple) and key.endswith("_packed_params"):
            for i, item in enumerate(value):
                if item is not None:
                    stored(item, f"entry {key!r}[{i}]")
            continue
        stored(value, f"entry {key!r}")


def _converted_keys(obj: dict) -> bool:
    """Whether a loaded dict is a converted model's state: quantized tensors or packed params."""
    values = obj.get("state_dict", obj) if isinstance(obj.get("state_dict"), dict) else obj
    return any((isinstance(k, str) and "_packed_params" in k) or
               (isinstance(v, torch.Tensor) and v.is_quantized) for k, v in values.items())


# -- what the keys say -------------------------------------------------------------------
def detect_flow(state: dict[str, torch.Tensor]) -> str | None:
    """"fx", "eager", or None when the keys hold no torch.ao quantizer."""
    if any(FX_QUANTIZER.match(k) for k in state):
        return "fx"
    return "eager" if eager_owners(state) else None


def is_qat(state: dict[str, torch.Tensor]) -> bool:
    """FakeQuantize modules (QAT) save their enabled flags; observers (PTQ) do not."""
    return any(k.endswith(".fake_quant_enabled") or k == "fake_quant_enabled" for k in state)


def eager_owners(state: dict[str, torch.Tensor]) -> dict[str, set[str]]:
    """Module path -> the eager quantizers it owns ("activation_post_process", "weight_fake_quant")."""
    owners: dict[str, set[str]] = {}
    for key in state:
        parts = key.split(".")
        at = next((i for i, part in enumerate(parts[:-1]) if part in EAGER_MARKERS), None)
        if at is not None:
            owners.setdefault(".".join(parts[:at]), set()).add(parts[at])
    return owners


# -- rebuilding --------------------------------------------------------------------------
def rebuild(state: dict[str, torch.Tensor], float_model: nn.Module, example_inputs: Any, backend: str,
            *, source: str = "the state_dict") -> Rebuilt:
    """The torch.ao prepared model ``state`` was saved from, rebuilt from ``float_model`` (not
    modified) and loaded with ``state``; ``source`` names the file in errors."""
    if backend not in BACKENDS:
        raise QDebugError(f"unknown backend {backend!r}", f"choose one of {', '.join(BACKENDS)}")
    flow = detect_flow(state)
    if flow is None:
        refuse_pt2e(state, source)
        raise QDebugError(f"{source} holds no torch.ao quantizer (no activation_post_process or weight_fake_quant "
                          "keys): it is not a prepared model's state_dict",
                          "save the state_dict of the model prepare_qat/prepare (or prepare_qat_fx/prepare_fx) "
                          "returned; a float model needs no import (qdebug calibrate quantizes it)")
    qat = is_qat(state)
    with warnings.catch_warnings():
        for notice in _TORCH_NOTICES:
            warnings.filterwarnings("ignore", message=f".*{re.escape(notice)}")
        if flow == "fx":
            prepared, fusions = _prepare_fx(float_model, example_inputs, backend, qat), []
        else:
            prepared, fusions = _prepare_eager(state, float_model, example_inputs, backend, qat)
        _load(prepared, state, source, flow, qat, backend)
        _check_ranges(prepared, source, backend)
    prepared.eval()
    return Rebuilt(prepared, flow, qat, copy.deepcopy(float_model).eval(), fusions)


# convert_pt2e folds each quantized weight into a constant of the graph: ``_frozen_param0``.
PT2E_FROZEN = re.compile(r"^_frozen_param\d+$")
# convert_fx keeps each quantize op's qparams as buffers at the root: ``conv1_input_scale_0``.
FX_CONVERTED_KEY = re.compile(r"^[^.]+_(?:scale|zero_point)_\d+$")


def refuse_pt2e(state: dict, source: str) -> None:
    """A ``convert_pt2e`` graph's state_dict, refused with what to do instead."""
    if any(PT2E_FROZEN.match(k) for k in state):
        raise QDebugError(f"{source} looks like the state_dict of a convert_pt2e graph (_frozen_param keys): "
                          "qdebug does not rebuild PT2E graphs from tensors",
                          "import that model in Python: qdebug.from_torch_ao(converted, example_inputs, "
                          "float_model=...), or compare it: qdebug.compare(float_model, converted, data=...)")


def converted_flow(state: dict) -> str:
    """"fx" (convert_fx) or "eager" (convert) for a converted model's state_dict."""
    return "fx" if any(FX_CONVERTED_KEY.match(k) for k in state) else "eager"


def rebuild_converted(state: dict, float_model: nn.Module, example_inputs: Any, backend: str,
                      *, source: str = "the state_dict") -> Rebuilt:
    """The model torch.ao's ``convert`` (or ``convert_fx``) made, rebuilt by torch from
    ``float_model`` (not modified) and loaded with ``state``: eager, the float model fused the
    way the keys say (``eager_fusions``), ``backend``'s default qconfig on exactly the modules
    whose keys torch's int8 modules save (and the DeQuantStubs, which save none), ``prepare``
    and ``convert``; FX, ``prepare_fx`` with the default qconfig mapping and ``convert_fx``.
    The observers never run: every scale, zero point and integer weight is the file's."""
    if backend not in BACKENDS:
        raise QDebugError(f"unknown backend {backend!r}", f"choose one of {', '.join(BACKENDS)}")
    flow = converted_flow(state)
    with warnings.catch_warnings():
        for notice in _TORCH_NOTICES:
            warnings.filterwarnings("ignore", message=f".*{re.escape(notice)}")
        if flow == "fx":
            converted, fusions = _convert_fx(float_model, example_inputs, backend), []
        else:
            converted, fusions = _convert_eager(state, float_model, example_inputs, backend)
        _check_shapes(converted, state, source, flow, backend)
        _load(converted, state, source, flow, False, backend, made="converted")
    converted.eval()
    return Rebuilt(converted, flow, False, copy.deepcopy(float_model).eval(), fusions, converted=True)


def converted_owners(state: dict) -> set[str]:
    """The module paths whose torch int8 modules saved keys: an output ``P.scale`` and
    ``P.zero_point``, packed ``P._packed_params.*``, a quantized ``P.weight``."""
    owners = set()
    for key, value in state.items():
        if "._packed_params." in key:
            owners.add(key.split("._packed_params.")[0])
        elif key.endswith((".scale", ".zero_point")) or (isinstance(value, torch.Tensor) and value.is_quantized):
            owners.add(key.rpartition(".")[0])
    owners.discard("")
    return owners


def _convert_eager(state: dict, float_model: nn.Module, example_inputs: Any,
                   backend: str) -> tuple[nn.Module, list[list[str]]]:
    import torch.ao.quantization as tq

    from qdebug.engine.plan import trace_plan

    model = copy.deepcopy(float_model).eval()  # fuse_modules folds a BN in eval mode
    groups = eager_fusions(state, model, trace_plan(model, example_inputs), qat=False, converted=True)
    if groups:
        try:
            model = tq.fuse_modules(model, [list(g) for g in groups], inplace=False)
        except (AssertionError, NotImplementedError, RuntimeError, TypeError, AttributeError) as exc:
            raise QDebugError(f"torch cannot fuse {groups[0]} of the float model: {_first_line(exc)}",
                              MISMATCH_HINT) from None
    qconfig = tq.get_default_qconfig(backend)
    modules = dict(model.named_modules())
    owners = converted_owners(state)
    absent = sorted(path for path in owners if path not in modules)
    if absent:
        raise QDebugError(f"the state_dict quantizes module {absent[0]!r}, which the float model does not have"
                          + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""), MISMATCH_HINT)
    inside = tuple(f"{path}." for path in owners)
    for path, module in modules.items():
        if inside and path.startswith(inside):
            continue  # a fused module's parts take its qconfig (torch's propagate_qconfig_)
        # A DeQuantStub becomes torch's DeQuantize only with a qconfig; it saves no key to say so.
        module.qconfig = qconfig if path in owners or isinstance(module, tq.DeQuantStub) else None
    try:
        return tq.convert(tq.prepare(model, inplace=True), inplace=True), groups
    except (AssertionError, NotImplementedError, RuntimeError, TypeError, AttributeError, KeyError) as exc:
        raise QDebugError(f"torch cannot prepare and convert the float model with the {backend} qconfig: "
                          f"{_first_line(exc)}", MISMATCH_HINT) from None


def _convert_fx(float_model: nn.Module, example_inputs: Any, backend: str) -> nn.Module:
    from torch.ao.quantization.quantize_fx import convert_fx

    prepared = _prepare_fx(float_model, example_inputs, backend, False)
    try:
        return convert_fx(prepared)
    except Exception as exc:  # as _prepare_fx: torch says why
        raise QDebugError(f"torch's FX cannot convert the float model: {type(exc).__name__}: {_first_line(exc)}",
                          MISMATCH_HINT) from None


def _check_shapes(model: nn.Module, state: dict, source: str, flow: str, backend: str) -> None:
    """Each entry of ``state`` has the shape and dtype of the rebuilt model's own, and every
    saved scale is finite and positive: torch's int8 modules take a loaded weight whole
    (``set_weight_bias``), so ``load_state_dict`` checks neither, and a NaN scale would run."""
    own = model.state_dict()
    what = f"{source} does not fit the float model {flow}-converted with the {backend} qconfig"

    def items(value: Any) -> tuple:
        return value if isinstance(value, tuple) else (value,)

    def shapes(value: Any) -> list:
        return [list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in items(value)]

    def dtypes(value: Any) -> list:
        return [str(t.dtype) if isinstance(t, torch.Tensor) else str(t) if isinstance(t, torch.dtype)
                else type(t).__name__ for t in items(value)]

    for key, value in state.items():
        if key not in own:
            continue  # key_mismatch names it
        if shapes(value) != shapes(own[key]):
            raise QDebugError(f"{what}: size mismatch for {key}: the file has {shapes(value)}, the model "
                              f"{shapes(own[key])}", MISMATCH_HINT)
        if dtypes(value) != dtypes(own[key]):
            raise QDebugError(f"{what}: dtype mismatch for {key}: the file has {', '.join(dtypes(value))}, the "
                              f"model {', '.join(dtypes(own[key]))}", MISMATCH_HINT)
        for t in items(value):
            scales = None
            if isinstance(t, torch.Tensor) and t.is_quantized:
                scales = t.q_per_channel_scales() if t.qscheme() in (torch.per_channel_affine,
                                                                   torch.per_channel_symmetric) \
                    else torch.tensor(t.q_scale())
            elif key.endswith("scale") and isinstance(t, torch.Tensor) and t.is_floating_point():
                scales = t
            if scales is not None and not bool((torch.isfinite(scales) & (scales > 0)).all()):
                raise QDebugError(f"{source}: {key} holds a scale that is not a finite positive number: torch "
                                  "never saves one", RESAVE_HINT)


def _prepare_eager(state: dict, float_model: nn.Module, example_inputs: Any, backend: str,
                   qat: bool) -> tuple[nn.Module, list[list[str]]]:
    import torch.ao.quantization as tq

    from qdebug.engine.plan import trace_plan

    model = copy.deepcopy(float_model)
    plan = trace_plan(model, example_inputs)
    groups = eager_fusions(state, model, plan, qat)
    model.train(qat)  # fuse_modules_qat wants train mode, fuse_modules eval (it folds the BN)
    if groups:
        fuse = tq.fuse_modules_qat if qat else tq.fuse_modules
        try:
            model = fuse(model, [list(g) for g in groups], inplace=False)
        except (AssertionError, NotImplementedError, RuntimeError, TypeError, AttributeError) as exc:
            raise QDebugError(f"torch cannot fuse {groups[0]} of the float model: {_first_line(exc)}",
                              MISMATCH_HINT) from None
    qconfig = tq.get_default_qat_qconfig(backend) if qat else tq.get_default_qconfig(backend)
    modules = dict(model.named_modules())
    owners = eager_owners(state)
    # torch.ao's quantizable MHA: its quantizers sit on children (linear_Q, ...) the float
    # nn.MultiheadAttention lacks; its from_float makes and prepares them.  Its own out_proj gets
    # no qconfig: prepare_qat would swap it (NonDynamicallyQuantizableLinear) for a qat.Linear,
    # which torch refuses; from_float replaces it anyway.
    attentions = {path for path, m in modules.items()
                  if type(m) is nn.MultiheadAttention and any(o.startswith(f"{path}.") for o in owners)}
    inside = tuple(f"{path}." for path in attentions)
    owners = {path: kinds for path, kinds in owners.items() if not (inside and path.startswith(inside))}
    owners.update({path: {"activation_post_process"} for path in attentions})
    absent = sorted(path for path in owners if path not in modules)
    if absent:
        raise QDebugError(f"the state_dict quantizes module {absent[0]!r}, which the float model does not have"
                          + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""), MISMATCH_HINT)
    for path, module in modules.items():
        module.qconfig = qconfig if path in owners else None
    try:
        prepared = tq.prepare_qat(model, inplace=True) if qat else tq.prepare(model, inplace=True)
    except (AssertionError, NotImplementedError, RuntimeError, TypeError, AttributeError, KeyError) as exc:
        raise QDebugError(f"torch cannot prepare the float model with the {backend} qconfig: {_first_line(exc)}",
                          MISMATCH_HINT) from None
    return prepared, groups


def eager_fusions(state: dict, model: nn.Module, plan: Any, qat: bool, converted: bool = False) -> list[list[str]]:
    """The module groups fuse_modules(_qat) joined, read from the keys (module docstring)."""
    modules = dict(model.named_modules())
    calls, counts = plan.calls, plan.call_counts
    paired = dict(plan.pairs)
    groups = []
    for rec in calls.values():
        if not rec.is_module or rec.category not in ("conv", "linear") or counts.get(rec.name) != 1:
            continue
        group, follower = [rec.name], rec.fused_into
        bn = paired.get(rec.name)
        if bn is not None:
            folded = f"{rec.name}.bn.running_mean" in state if qat else not any(k.startswith(bn + ".") for k in state)
            if not folded:
                continue  # torch fuses a ReLU only with what comes right before it
            group.append(bn)
            follower = calls[bn].fused_into
        relu = calls.get(follower) if follower else None
        if relu is not None and relu.is_module and counts.get(relu.name) == 1 and \
                type(modules.get(relu.name)) is nn.ReLU:
            if converted:
                fused = f"{rec.name}.0.weight" in state or _zero_at_min(state, rec.name)
            else:
                fused = (not _saw_negative(state, rec.name)) if qat else f"{rec.name}.0.weight" in state
            if fused:
                group.append(relu.name)
        if len(group) > 1:
            groups.append(group)
    return groups


def _zero_at_min(state: dict, path: str) -> bool:
    """Whether the converted output of ``path`` is on a grid starting at 0 (quint8 zero point 0):
    an ``nnq.ConvReLU2d`` and an ``nnq.Conv2d`` save the same keys, but an unfused conv's output
    grid covers the negative values its ReLU then clips.  On a grid starting at 0 the fused kernel
    and the conv followed by torch's ReLU compute the same codes."""
    found = state.get(f"{path}.zero_point")
    return isinstance(found, torch.Tensor) and found.numel() > 0 and bool((found == 0).all())


def _saw_negative(state: dict, path: str) -> bool:
    """Whether the activation quantizer of ``path`` observed a value below zero."""
    found = state.get(f"{path}.activation_post_process.activation_post_process.min_val")
    return found is not None and found.numel() > 0 and bool(torch.isfinite(found).all()) and \
        bool((found < 0).any())


def _prepare_fx(float_model: nn.Module, example_inputs: Any, backend: str, qat: bool) -> nn.Module:
    from torch.ao.quantization import get_default_qat_qconfig_mapping, get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_fx, prepare_qat_fx

    from qdebug.engine.context import split_inputs

    args, kwargs = split_inputs(example_inputs)
    if kwargs:
        raise QDebugError("an FX import traces the model with positional inputs only",
                          "give --data whose batches are a tensor or a tuple of tensors")
    model = copy.deepcopy(float_model).train(qat)
    try:
        if qat:
            return prepare_qat_fx(model, get_default_qat_qconfig_mapping(backend), example_inputs=args)
        return prepare_fx(model, get_default_qconfig_mapping(backend), example_inputs=args)
    except QDebugError:
        raise
    except Exception as exc:  # symbolic tracing fails on data-dependent control flow, and says why
        raise QDebugError(f"torch's FX cannot prepare the float model: {type(exc).__name__}: {_first_line(exc)}",
                          MISMATCH_HINT) from None


def _load(prepared: nn.Module, state: dict, source: str, flow: str, qat: bool, backend: str,
          made: str = "prepared") -> None:
    """``load_state_dict(strict=True)``, its refusals said in one line."""
    from qdebug.checkpoint import key_mismatch

    mismatch = key_mismatch(prepared.state_dict(), state)
    if mismatch:
        how = f"{flow}-converted" if made == "converted" else f"prepared for {flow} {'QAT' if qat else 'PTQ'}"
        raise QDebugError(f"{source} does not fit the float model {how} with the {backend} qconfig: {mismatch}",
                          MISMATCH_HINT)
    try:
        prepared.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # sizes: "size mismatch for conv1.weight: copying a param with shape ..."
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = next((line for line in lines if line.startswith("size mismatch")), lines[-1] if lines else str(exc))
        raise QDebugError(f"{source} does not load into the rebuilt model: {detail}"[:400], MISMATCH_HINT) from None


def _check_ranges(prepared: nn.Module, source: str, backend: str) -> None:
    """Every FakeQuantize's saved scale and zero point are what its observer's saved range gives
    under the rebuilt qconfig (torch recomputes them from that range on every observed step):
    a file made with another integer range or granularity is refused, not imported wrongly."""
    from torch.ao.quantization import FakeQuantizeBase

    for name, module in prepared.named_modules():
        observer = getattr(module, "activation_post_process", None)
        if not isinstance(module, FakeQuantizeBase) or not hasattr(observer, "calculate_qparams"):
            continue
        low, high = getattr(observer, "min_val", None), getattr(observer, "max_val", None)
        if not isinstance(low, torch.Tensor) or low.numel() == 0 or not bool(torch.isfinite(low).all()) or \
                not bool(torch.isfinite(high).all()):
            continue  # never observed: nothing to compare
        if low.shape != high.shape or bool((low > high).any()):  # torch's calculate_qparams asserts on it
            raise QDebugError(f"{source}: {name} holds an observed range whose min is above its max (or whose "
                              "min and max differ in shape): torch never saves one", RESAVE_HINT)
        try:
            scale, zero_point = observer.calculate_qparams()
        except (AssertionError, RuntimeError, ValueError) as exc:  # values torch's observer cannot take
            raise QDebugError(f"{source}: {name}'s saved range gives no scale: {type(exc).__name__}: "
                              f"{_first_line(exc)}", RESAVE_HINT) from None
        saved_scale, saved_zero = module.scale.detach(), module.zero_point.detach()
        if not _agree(scale, zero_point, saved_scale, saved_zero, observer):
            raise QDebugError(
                f"{source}: {name} holds scale {_shown(saved_scale)} and zero point {_shown(saved_zero)}, but torch's "
                f"{backend} qconfig gives {_shown(scale)} and {_shown(zero_point)} for its saved range: the model was "
                "prepared with another qconfig",
                "try the --backend it was prepared for (x86, fbgemm, qnnpack, onednn); a custom qconfig needs the "
                "Python API: qdebug.interop.from_torch_ao(prepared, example_inputs) (docs/interop.md)")


def _agree(scale: torch.Tensor, zero_point: torch.Tensor, saved_scale: torch.Tensor, saved_zero: torch.Tensor,
           observer: nn.Module) -> bool:
    """Whether saved qparams are the ones a qconfig computes from the saved range, channel by channel.

    Per tensor: the scale within ``RANGE_RTOL``, the zero point within 1.  Per channel, every
    channel, allowing what torch's fused per-channel fake quant (``FusedMovingAvgObsFakeQuantize``)
    computes where its observer's ``calculate_qparams`` does not: a channel whose range lies on
    one side of 0 gets affine qparams over [0, max] or [min, 0] (half the scale, zero point
    quant_min or quant_max: 175 of 240 channels of an EfficientNet-Lite0 depthwise conv), a
    scale under 2**-14 is raised to 2**-14, and an all-zero channel gets scale 0.1 (zero is on
    every grid).  Another backend's range or granularity moves channels none of these explain.
    """
    if scale.shape != saved_scale.shape:
        return False

    def close(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return torch.isclose(s.float(), saved_scale.float(), rtol=RANGE_RTOL) & (
            (z.to(torch.int64) - saved_zero.to(torch.int64)).abs() <= 1)

    def floored(s: torch.Tensor) -> torch.Tensor:
        return torch.clamp(s.float(), min=2.0 ** -14)

    ok = close(scale, zero_point) | close(floored(scale), zero_point)
    if ok.numel() > 1:
        low, high = observer.min_val.detach(), observer.max_val.detach()
        qmin, qmax = int(observer.quant_min), int(observer.quant_max)
        positive = low >= 0
        span = torch.where(positive, high, -low) / float(qmax - qmin)
        zero = torch.where(positive, torch.full_like(low, qmin), torch.full_like(low, qmax))
        one_signed = positive | (high <= 0)
        ok |= one_signed & (close(span, zero) | close(floored(span), zero))
        ok |= (low == 0) & (high == 0) & (saved_zero >= qmin) & (saved_zero <= qmax)
    return bool(ok.all())


def _shown(t: torch.Tensor) -> str:
    values = t.flatten().tolist()
    text = ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in values[:3])
    return f"[{text}{', ...' if len(values) > 3 else ''}] ({len(values)} value(s))"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]
