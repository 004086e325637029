"""Checkpoints of the four stages: one file each, safe to load.

A qdebug checkpoint is a dict readable with ``torch.load(weights_only=True)``
(tensors, numbers, strings, lists, dicts only -- see docs/checkpoints.md):

    format         "qdebug-checkpoint"
    version        1
    stage          "float" | "calibrated" | "qat" | "quantized"
    model          {"class": "package.module:Class", "kwargs": {...}}
    qconfig        QConfig.to_dict() (None for float)
    qat_mode       "fuse_bn" | "with_bn" | "with_bn_reverse_fold" (None for float)
    arithmetic     a quantized stage's requantization: "fixed_point" | "float32" (absent: fixed_point)
    float_kernels  a quantized stage's calls its target computes in float (ONNX Runtime's unfused
                   layers, ``qdebug.engine.arithmetic.run_in_float``; absent: none)
    plan           the engine's traced plan (None for float)
    absorbed       conv paths whose BN was folded mid-QAT
    points         {name: {mode, frozen, observe_in_fake, alpha}}
    state          the model's state_dict: weights, BN statistics, every quant
                   point's scale / zero point / observer state, integer weights
    sample_inputs  optional example batch
    folded_bn      BatchNorm paths torch folded into their convs before quantizing (a model
                   imported from torch.ao PTQ, ``qdebug.interop``): nn.Identity there, and
                   the conv holds the folded weights and a bias
    meta           {"qdebug": version, "torch": version, "time": ISO-8601, ...}; a model
                   imported from torch.ao adds its import report: "import" (rows of
                   ``qdebug.engine.imported.REPORT_COLUMNS``) and "import_flow"

``load`` also accepts a plain float ``state_dict`` file (with the architecture
named by the user) and, only with ``unsafe=True``, a pickled whole module.

Every field a file holds is checked once, before it is used, by one function per concept
(``_check_version``, ``check_state``, ``_checked_points``, ``_check_plan``, ...); the model a
file names is built on the meta device first and must fit its state (``_build_fitting``)
before any memory is allocated; see docs/checkpoints.md, "What is refused".
"""

from __future__ import annotations

import datetime as _dt
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import qdebug
from qdebug.io.atomic import atomic_path, output_kind
from qdebug.engine.imported import FLOW_ATTR, REPORT_ATTR, REPORT_COLUMNS, import_report
from qdebug.engine import QConfig, absorb_bn, convert, engine_state, is_prepared, prepare
from qdebug.engine.fusebn import freeze_bn_stats, frozen_bn_paths
from qdebug.engine.arithmetic import run_in_float
from qdebug.engine.integer import ARITHMETICS
from qdebug.engine.modules import _QWeighted, without_norm
from qdebug.engine.point import MODES as POINT_MODES
from qdebug.engine.prepare import POINTS_ATTR, QAT_MODES, refresh_weight_qparams
from qdebug.errors import QDebugError, shown
from qdebug.io.modelspec import ModelSpec, build, build_meta, is_model_class, remember, spec_of
from qdebug.io.torchfile import read_file

FORMAT = "qdebug-checkpoint"
VERSION = 1
STAGES = ("float", "calibrated", "qat", "quantized")
SAMPLE_LIMIT = 64  # sample_inputs rows kept from a file (docs/checkpoints.md)
SAMPLE_BYTES = 64 << 20  # ... and bytes: a few rows of a crafted file may be huge
SIZE_SLACK = 2**20  # bytes a model may hold beyond what its file's state stores
# The smallest scale a file may hold: below it 1/s overflows float32 (qdebug floors its own at eps).
SCALE_TINY = float(torch.finfo(torch.float32).tiny)
FLOAT_MAX = float(torch.finfo(torch.float64).max)
MAX_NESTING = 64  # levels of lists/dicts in a file's meta: qdebug writes 3
MODULES_PER_ENTRY, MODULES_BASE = 8, 1000  # modules + tensors a model may register per state entry, + a base
DAMAGED = "the file is damaged or not from qdebug.save: re-save it"
ARCHITECTURE = "the checkpoint belongs to another architecture or other model kwargs"


@dataclass
class CheckpointInfo:
    path: str
    stage: str
    model: ModelSpec
    qconfig: QConfig | None = None
    qat_mode: str | None = None
    sample_inputs: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = "qdebug"  # "qdebug" | "state_dict" | "pickle"


def infer_stage(model: nn.Module) -> str:
    if not is_prepared(model):
        return "float"
    return "quantized" if engine_state(model).stage == "quantized" else "calibrated"


def save(
    model: nn.Module,
    path: str | Path,
    *,
    stage: str | None = None,
    model_spec: ModelSpec | str | None = None,
    model_kwargs: dict[str, Any] | None = None,
    sample_inputs: Any = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` as a checkpoint of ``stage`` (inferred when omitted; prepared models default to calibrated)."""
    if not isinstance(model, nn.Module):
        raise QDebugError(f"save takes an nn.Module, not a {type(model).__name__}", "pass the model itself")
    if meta is not None and not isinstance(meta, dict):
        raise QDebugError(f"meta must be a dict, got {shown(meta)}", 'e.g. meta={"run": "exp-3"}')
    output_kind(path)  # a named pipe, a directory, a dangling link: refused before any work
    actual = infer_stage(model)
    stage = stage or actual
    if stage not in STAGES:
        raise QDebugError(f"unknown stage {stage!r}", f"choose one of {', '.join(STAGES)}")
    compatible = {"float": ("float",), "calibrated": ("calibrated", "qat"), "quantized": ("quantized",)}[actual]
    if stage not in compatible:
        raise QDebugError(f"cannot save a {actual} model as stage {stage!r}", f"this model can be saved as: {', '.join(compatible)}")
    if isinstance(model_spec, str):
        spec = ModelSpec(model_spec, dict(model_kwargs or {}))
    elif model_spec is None and model_kwargs is not None:  # the model's own class, built with these kwargs
        spec = ModelSpec(spec_of(model).target, dict(model_kwargs))
    else:
        spec = model_spec or spec_of(model)
    ckpt: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "stage": stage,
        "model": spec.to_dict(),
        "qconfig": None,
        "qat_mode": None,
        "plan": None,
        "absorbed": [],
        "points": {},
        "frozen_bn": frozen_bn_paths(model),
        "state": _cpu_state(model),
        "sample_inputs": _own_copy(sample_inputs),
        "meta": {
            "qdebug": qdebug.__version__,
            "torch": str(torch.__version__),
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            **(meta or {}),
        },
    }
    if stage != "float":
        state = engine_state(model)
        if state.stage != "quantized":
            refresh_weight_qparams(model)  # a weight changed by optimizer.step() gets its scale now
            ckpt["state"] = _cpu_state(model)
        ckpt["qconfig"] = state.qconfig.to_dict()
        ckpt["qat_mode"] = state.qat_mode
        if state.stage == "quantized":
            ckpt["arithmetic"] = getattr(state, "arithmetic", "fixed_point")
            if getattr(state, "float_kernels", None):
                ckpt["float_kernels"] = sorted(state.float_kernels)
        ckpt["plan"] = state.plan.to_dict()
        ckpt["absorbed"] = [
            c for c, _ in state.plan.pairs if model.get_submodule(c).bn is None and state.qat_mode != "fuse_bn"
        ]
        ckpt["points"] = {
            n: {"mode": p.mode, "frozen": p.frozen, "observe_in_fake": p.observe_in_fake, "alpha": float(p.alpha)}
            for n, p in state.points.items()
        }
        rows = _import_rows(model)
        if rows:
            ckpt["meta"]["import"] = rows
            flow = getattr(state, FLOW_ATTR, None)
            if isinstance(flow, str):
                ckpt["meta"]["import_flow"] = flow
            ckpt["folded_bn"] = [row["source"] for row in rows if row["kind"] == "bn" and
                                 type(_module_at(model, row["source"])) is nn.Identity]
    with atomic_path(path) as tmp:
        torch.save(ckpt, tmp)
    return Path(path)


def _import_rows(model: nn.Module) -> list[dict[str, Any]]:
    """The import report of a model imported from torch.ao (``qdebug.interop``) in JSON types, or []."""
    return [{col: _json_cell(row.get(col)) for col in REPORT_COLUMNS} for row in import_report(model)]


def _json_cell(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return str(value)


def _module_at(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's state on the CPU: a model that ran on a GPU saves a file that loads
    anywhere, as one from the CPU does."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _own_copy(value: Any) -> Any:
    """Tensors of ``value`` (nested in tuples, lists, dicts) as compact copies on the CPU: a view
    saves only its own values (not its whole storage), an expanded view no stride-0 layout a
    loader would refuse."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone(memory_format=torch.contiguous_format).cpu()
    if isinstance(value, dict):
        return {k: _own_copy(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_own_copy(v) for v in value)
    return value


def _looks_like_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    )


def extract_state_dict(obj: Any) -> dict[str, torch.Tensor] | None:
    if _looks_like_state_dict(obj):
        return obj
    if isinstance(obj, dict):  # common training checkpoints: {"state_dict": ..., "epoch": ...}
        for key in ("state_dict", "model_state_dict", "model", "net"):
            if _looks_like_state_dict(obj.get(key)):
                return obj[key]
    return None


def load(
    path: str | Path,
    *,
    model: str | ModelSpec | None = None,
    model_kwargs: dict[str, Any] | None = None,
    default_model: str | ModelSpec | None = None,
    unsafe: bool = False,
    trusted_modules: tuple[str, ...] = (),
) -> tuple[nn.Module, CheckpointInfo]:
    """Load a checkpoint of any stage as a model ready to run (eval mode).

    ``model`` names the architecture (``package.module:Class`` or factory) and
    overrides the file's; it is built with ``model_kwargs``, except that a class
    (an ``nn.Module`` subclass) the file names too, given no kwargs, takes the
    file's -- a factory function never does.  ``default_model`` (e.g. from the
    project config) names the architecture of plain state_dict files, which name none,
    and acts as ``model`` for a qdebug checkpoint naming that very target: the user
    named it, so a factory a checkpoint names (``qdebug import --model pkg.mod:factory``
    writes one) is built when the config names it too, with the user's kwargs.
    """
    if model_kwargs is not None and not isinstance(model_kwargs, dict):
        raise QDebugError(f"model_kwargs must be a dict of keyword arguments, got {type(model_kwargs).__name__}",
                          "e.g. model_kwargs={'num_classes': 10}")
    obj = read_file(path, unsafe=unsafe)
    user_spec = default_spec = None
    if model is not None:
        user_spec = model if isinstance(model, ModelSpec) else ModelSpec(model, dict(model_kwargs or {}))
    elif default_model is not None:
        default_spec = (
            default_model if isinstance(default_model, ModelSpec) else ModelSpec(default_model, dict(model_kwargs or {}))
        )
        if not (isinstance(obj, dict) and obj.get("format") == FORMAT):
            user_spec = default_spec
    if isinstance(obj, nn.Module):
        info = CheckpointInfo(str(path), "float", spec_of(obj), source="pickle")
        return obj.eval(), info
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        return _load_qdebug(obj, str(path), user_spec, trusted_modules, default_spec)
    state = extract_state_dict(obj)
    _refuse_data_file(obj, state, path)
    if state is not None:
        if user_spec is None:
            raise QDebugError(
                f"{path} is a plain state_dict: it does not say which architecture it belongs to",
                "name it with --model package.module:Class (or model = ... in qdebug.toml)",
            )
        check_state(state, str(path))
        net = _build_fitting(user_spec, state, str(path), from_user=True, trusted=(), sized_by_file=False)
        _load_state(net, state, str(path))
        return net.eval(), CheckpointInfo(str(path), "float", user_spec, source="state_dict")
    raise QDebugError(
        f"{path} is not a qdebug checkpoint or a state_dict (found {type(obj).__name__})",
        "save models with qdebug.save(model, path, stage=...) or torch.save(model.state_dict(), path)",
    )


def _refuse_data_file(obj: Any, state: dict | None, path: str | Path) -> None:
    """A data file passed as a checkpoint is called a data file (data.py's recognition rule).
    A flat dict of tensors is a state_dict unless it has no dotted (module.param) keys."""
    from qdebug.data.file import data_kind

    kind = data_kind(obj)
    if kind is None or (state is not None and (state is not obj or any("." in k for k in obj))):
        return
    raise QDebugError(f"{path} is a data file ({kind}), not a checkpoint",
                      f"pass it as --data {path}, and the model's checkpoint as the argument")


def _load_qdebug(obj: dict, path: str, user_spec: ModelSpec | None, trusted: tuple[str, ...],
                 default_spec: ModelSpec | None = None):
    _check_version(obj.get("version"), path)
    stage = obj.get("stage")
    if stage not in STAGES:
        raise QDebugError(f"{path} has an unknown stage {shown(stage)}",
                          "stages: float, calibrated, qat, quantized; save with qdebug.save(model, path, stage=...)")
    for key in ("model", "state"):
        if key not in obj:
            raise QDebugError(f"{path} lacks the {key!r} field", "the file is not a complete qdebug checkpoint")
    state = obj["state"]
    check_state(state, path)
    meta = _checked_table(obj.get("meta"), "meta", path)
    points = _checked_points(obj.get("points"), path)
    qat_mode = obj.get("qat_mode")
    if qat_mode is not None and (not isinstance(qat_mode, str) or qat_mode not in QAT_MODES):
        raise QDebugError(f"{path} has an unknown qat_mode {shown(qat_mode)}", f"QAT modes: {', '.join(QAT_MODES)}")
    arithmetic = obj.get("arithmetic", "fixed_point")  # files before it: fixed point, the only one there was
    if arithmetic not in ARITHMETICS:
        raise QDebugError(f"{path} has an unknown arithmetic {shown(arithmetic)}",
                          f"arithmetics: {', '.join(ARITHMETICS)}; re-save it with qdebug.save")
    float_kernels = obj.get("float_kernels", [])
    if not isinstance(float_kernels, list) or not all(isinstance(c, str) for c in float_kernels) or \
            (float_kernels and stage != "quantized"):
        raise QDebugError(f"{path}: 'float_kernels' is not a list of call names of a quantized stage", DAMAGED)
    absorbed = _checked_paths(obj.get("absorbed"), "absorbed", path)
    frozen_bn = _checked_paths(obj.get("frozen_bn"), "frozen_bn", path)
    folded_bn = _checked_paths(obj.get("folded_bn"), "folded_bn", path)
    imported = _checked_import(meta, path)
    samples = _checked_samples(obj.get("sample_inputs"), path)
    try:
        file_spec = ModelSpec.from_dict(obj["model"])
    except QDebugError as exc:
        raise QDebugError(f"{path}: {exc.message}", exc.hint) from None
    if user_spec is None and default_spec is not None and default_spec.target == file_spec.target:
        # The config names the file's very target: the user's consent, as --model would be
        # (a factory is then called, with the user's kwargs only; a different target the
        # config names only trusts its module).
        user_spec = default_spec
    sized_by_file = user_spec is None
    if (user_spec is not None and user_spec.target == file_spec.target and not user_spec.kwargs
            and is_model_class(user_spec.target)):
        # The class the user named is the file's: it gets the file's kwargs.  A function the user
        # named (a factory, or os:system a crafted file suggests) gets the user's kwargs only.
        user_spec = ModelSpec(user_spec.target, dict(file_spec.kwargs))
        sized_by_file = True
    spec = user_spec or file_spec
    qconfig = plan = None
    if stage != "float":
        try:
            qconfig = QConfig.from_dict(obj.get("qconfig"))
        except QDebugError as exc:
            raise QDebugError(f"{path}: invalid qconfig: {exc.message}", exc.hint) from None
        plan = obj.get("plan")
        if not isinstance(plan, dict):
            raise QDebugError(f"{path} is a {stage} checkpoint without a plan", "re-save it with qdebug.save")
    net = _build_fitting(spec, state, path, from_user=user_spec is not None, trusted=trusted, plan=plan,
                         sized_by_file=sized_by_file)
    if folded_bn:
        _refold(net, folded_bn, state, path)
    if stage != "float":
        try:
            with warnings.catch_warnings():  # told when the model was prepared; inspect reports fallbacks
                warnings.filterwarnings("ignore", message="qdebug: no quantized kernel")
                net = prepare(net, qconfig, mode=qat_mode or "fuse_bn", plan=plan)
        except (KeyError, AttributeError, TypeError, ValueError, IndexError) as exc:
            raise QDebugError(
                f"{path}: the saved plan does not fit model {spec.target} ({type(exc).__name__}: {exc})",
                ARCHITECTURE,
            ) from None
        remember(net, spec)
        convs = {conv for conv, _ in engine_state(net).plan.pairs}
        for conv in absorbed:
            if conv not in convs:
                raise QDebugError(f"{path}: 'absorbed' names {conv!r}, which is no conv of a Conv-BN pair of the plan",
                                  DAMAGED)
            absorb_bn(net, conv)
        if stage == "quantized":
            net = convert(net, arithmetic=arithmetic)
            try:
                run_in_float(net, float_kernels)
            except QDebugError as exc:
                raise QDebugError(f"{path}: {exc.message}", DAMAGED) from None
            remember(net, spec)
            _make_integer_buffers(net, state)
    _load_state(net, state, path)
    if stage != "float":
        _check_quantization(net, path)
        _apply_points(net, points, path)
        if imported:
            setattr(engine_state(net), REPORT_ATTR, imported)
            setattr(engine_state(net), FLOW_ATTR, meta.get("import_flow"))
    _refreeze_bn(net, frozen_bn)
    info = CheckpointInfo(path, stage, spec, qconfig, qat_mode, samples, meta)
    return net.eval(), info


# -- validation: every field of a file is checked here, once, before it is used -----------
def _check_version(version: Any, path: str) -> None:
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise QDebugError(f"{path} has an invalid checkpoint version {shown(version)}; versions are whole numbers from 1",
                          DAMAGED)
    if version > VERSION:
        raise QDebugError(f"{path} has checkpoint version {shown(version)}; this qdebug reads up to {VERSION}",
                          "upgrade qdebug")


def check_state(state: Any, path: str) -> None:
    """A state is a dict of string keys and dense tensors, each holding no more memory than the
    file stores for it: an expanded (stride-0) view of a small storage is refused, so nothing
    read from a file grows in memory past its size on disk."""
    if not isinstance(state, dict):
        raise QDebugError(f"{path}: 'state' is a {type(state).__name__}, not a dict of tensors", DAMAGED)
    for key, value in state.items():
        if not isinstance(key, str):
            raise QDebugError(f"{path}: 'state' has a key {key!r} that is not a string", DAMAGED)
        if not isinstance(value, torch.Tensor):
            raise QDebugError(f"{path}: state entry {key!r} is a {type(value).__name__}, not a tensor", DAMAGED)
        _check_stored(value, f"state entry {key!r}", path)


def _check_stored(tensor: torch.Tensor, what: str, path: str) -> None:
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise QDebugError(f"{path}: {what} is a {tensor.layout} {tensor.dtype} tensor; checkpoints hold dense tensors",
                          DAMAGED)
    stored = tensor.untyped_storage().nbytes()
    if tensor.numel() * tensor.element_size() > stored:
        raise QDebugError(
            f"{path}: {what} is an expanded view: {list(tensor.shape)} ({tensor.numel()} values) over "
            f"{stored // max(tensor.element_size(), 1)} stored",
            "save real tensors (x.contiguous().clone()), not expanded views",
        )


def _checked_table(value: Any, key: str, path: str) -> dict:
    """An optional table of the file (``meta``): a dict with string keys, or absent."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise QDebugError(f"{path}: {key!r} is a {type(value).__name__}, not a table", DAMAGED)
    bad = next((k for k in value if not isinstance(k, str)), None)
    if bad is not None:
        raise QDebugError(f"{path}: {key!r} has a key {shown(bad)} that is not a string", DAMAGED)
    _check_nesting(value, key, path)
    return dict(value)


def _check_nesting(value: Any, key: str, path: str) -> None:
    """``value`` nests lists, tuples and dicts at most MAX_NESTING deep: whatever walks it later
    (inspect, JSON output, the import report) recurses, and a file nesting 100,000 deep would
    end that walk in a RecursionError.  Walked with a stack of its own, so the check cannot."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_NESTING:
            raise QDebugError(f"{path}: {key!r} nests more than {MAX_NESTING} levels deep", DAMAGED)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)


def _checked_points(value: Any, path: str) -> dict[str, dict]:
    """``points``: {name: {mode, frozen, observe_in_fake, alpha}}, every value checked."""
    points = _checked_table(value, "points", path)
    for name, attrs in points.items():
        what = f"{path}: points entry {name!r}"
        if not isinstance(attrs, dict):
            raise QDebugError(f"{what} is a {type(attrs).__name__}, not a table", DAMAGED)
        if "mode" in attrs and attrs["mode"] not in POINT_MODES:
            raise QDebugError(f"{what} has an unknown mode {attrs['mode']!r}",
                              f"modes: {', '.join(POINT_MODES)}; {DAMAGED}")
        for flag in ("frozen", "observe_in_fake"):
            if flag in attrs and not isinstance(attrs[flag], bool):
                raise QDebugError(f"{what}: {flag} is {attrs[flag]!r}, not true or false", DAMAGED)
        alpha = attrs.get("alpha", 1.0)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise QDebugError(f"{what}: alpha is {alpha!r}, not a number in [0, 1]", DAMAGED)
    return points


def _checked_paths(value: Any, key: str, path: str) -> list[str]:
    """``absorbed`` / ``frozen_bn``: a list of module paths, or absent."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise QDebugError(f"{path}: {key!r} is not a list of module paths", DAMAGED)
    return value


def _checked_import(meta: dict, path: str) -> list[dict[str, Any]]:
    """``meta["import"]``: the import report of a model imported from torch.ao -- a list of rows,
    each a table of ``REPORT_COLUMNS`` (text, or numbers and null for the scales) -- and
    ``meta["import_flow"]``, text; [] when absent.  Columns a later qdebug adds are dropped."""
    rows, flow = meta.get("import"), meta.get("import_flow")
    if rows is None:
        return []
    if not isinstance(rows, list):
        raise QDebugError(f"{path}: meta 'import' is a {type(rows).__name__}, not a list of rows", DAMAGED)
    if flow is not None and not isinstance(flow, str):
        raise QDebugError(f"{path}: meta 'import_flow' is a {type(flow).__name__}, not text", DAMAGED)
    numbers = ("scale_min", "scale_max")
    checked = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise QDebugError(f"{path}: meta 'import' row {i} is a {type(row).__name__}, not a table", DAMAGED)
        clean = {}
        for col in REPORT_COLUMNS:
            value = row.get(col)
            # A huge int is no scale either: float() would overflow on it.
            number = col in numbers and (value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                                           and abs(value) <= FLOAT_MAX))
            if not (number or (col not in numbers and isinstance(value, str))):
                raise QDebugError(f"{path}: meta 'import' row {i} has a {type(value).__name__} {col}; "
                                  f"{'scales are numbers or null' if col in numbers else 'it is text'}", DAMAGED)
            clean[col] = float(value) if col in numbers and value is not None else value
        checked.append(clean)
    return checked


def _checked_samples(value: Any, path: str) -> Any:
    """``sample_inputs`` with at most SAMPLE_LIMIT samples and SAMPLE_BYTES bytes: a batch (a
    tensor, or a tuple or dict of them) keeps the first rows of each tensor, a list of batches
    (``data.batches_from_inputs``) its first batches -- a batch counts at least one sample, and
    its bytes each time it is listed (a file may list one large tensor many times); every tensor
    kept may hold no more memory than the file stores for it (``_check_stored``).  Slicing makes
    views: nothing is copied."""
    if not isinstance(value, list):
        return _within_bytes(value, SAMPLE_LIMIT, SAMPLE_BYTES, path)
    kept, left, room = [], SAMPLE_LIMIT, SAMPLE_BYTES
    for batch in value:
        if left <= 0 or room <= 0:
            break
        batch = _within_bytes(batch, left, room, path, first=not kept)
        if batch is None:
            break
        kept.append(batch)
        left -= max(_rows(batch), 1)
        room -= _bytes(batch)
    return kept


def _within_bytes(batch: Any, rows: int, room: int, path: str, first: bool = True) -> Any:
    """``batch`` cut to at most ``rows`` samples and ``room`` bytes; None when not even one sample
    fits (an error for the first batch: a single sample over SAMPLE_BYTES is no example input)."""
    kept = _capped(batch, rows, path)
    size = _bytes(kept)
    if size <= room:
        return kept
    fit = min(room // max(size // max(_rows(kept), 1), 1), _rows(kept) - 1)  # fewer rows each time
    if fit >= 1:
        return _within_bytes(batch, int(fit), room, path, first)
    if not first:
        return None
    raise QDebugError(f"{path}: 'sample_inputs' holds a sample of {size} bytes; at most {SAMPLE_BYTES >> 20} MiB "
                      "of sample inputs are read", "save a small example batch (sample_inputs=x[:8]), or pass --data")


def _bytes(batch: Any) -> int:
    """Bytes of the tensors in ``batch`` (a tensor listed twice counts twice: each is used)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    parts = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    return sum(_bytes(p) for p in parts)


def _capped(item: Any, rows: int, path: str, depth: int = 0) -> Any:
    if isinstance(item, torch.Tensor):
        kept = item[:rows] if item.dim() else item
        _check_stored(kept, "'sample_inputs'", path)
        return kept
    if not isinstance(item, (tuple, list, dict)):
        return item
    if depth >= 4 or len(item) > SAMPLE_LIMIT:
        raise QDebugError(f"{path}: 'sample_inputs' nests more than 4 levels or {SAMPLE_LIMIT} parts in a batch",
                          DAMAGED)
    if isinstance(item, dict):
        return {k: _capped(v, rows, path, depth + 1) for k, v in item.items()}
    return type(item)(_capped(v, rows, path, depth + 1) for v in item)


def _rows(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor with a batch dimension (else 1)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    parts = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    return next((n for n in (_rows(p) for p in parts if isinstance(p, (torch.Tensor, tuple, list, dict)))), 1)


def _check_plan(plan: dict, net: nn.Module, spec: ModelSpec, path: str) -> None:
    """``plan``: the fields of ``Plan.to_dict`` with their types; a call is fused into a call
    of the plan, with a known activation; every module path (a module call, an owner, a
    Conv-BN pair) names a module of ``net`` (the float model of ``spec``, on meta or not),
    and each pair joins a conv and a BatchNorm of as many channels."""
    from dataclasses import MISSING, fields

    from qdebug.engine.attention import decomposed_paths
    from qdebug.engine.members import is_member_path
    from qdebug.engine.ops import FUSED_ACTIVATIONS
    from qdebug.engine.plan import CallRecord

    def bad(what: str) -> QDebugError:
        return QDebugError(f"{path}: the saved plan {what}", DAMAGED)

    calls, pairs, counts = plan.get("calls"), plan.get("pairs"), plan.get("call_counts")
    if not isinstance(calls, list) or not isinstance(pairs, list) or not isinstance(counts, dict):
        raise bad("lacks its calls, pairs or call_counts")
    types = {"name": str, "category": str, "op": str, "owner": str, "is_module": bool, "inputs": list,
             "consumers": list, "point": (str, type(None)), "output_point": (str, type(None)),
             "fused_into": (str, type(None)), "fused_activation": (str, type(None)), "members": list,
             "constant": bool}
    required = {f.name for f in fields(CallRecord) if f.default is MISSING and f.default_factory is MISSING}
    modules = dict(net.named_modules()) | decomposed_paths(net)  # prepare's attention parts too
    for call in calls:
        if not isinstance(call, dict) or set(call) - set(types) or required - set(call):
            raise bad(f"has a malformed call {shown(call, 80)}")
        wrong = next((k for k, v in call.items() if not isinstance(v, types[k])), None)
        if wrong is not None:
            raise bad(f"call {call['name']!r} has a {type(call[wrong]).__name__} {wrong}")
    names = {call["name"] for call in calls}
    for call in calls:
        name = call["name"]
        if not all(isinstance(n, str) for n in [*call.get("inputs", []), *call.get("consumers", [])]):
            raise bad(f"call {name!r} has inputs or consumers that are not names")
        if call.get("fused_into") is not None and call["fused_into"] not in names:  # a set: linear, not quadratic
            raise bad(f"call {name!r} is fused into {call['fused_into']!r}, a call the plan does not have")
        members = call.get("members", [])
        if not all(is_member_path(m) for m in members) or len(set(members)) != len(members) or members == [""]:
            raise bad(f"call {name!r} has malformed output members {shown(members, 80)}")
        if members and (call.get("point") != name or call.get("fused_into") is not None):
            raise bad(f"call {name!r} has output members but no point of its own")
        if call.get("fused_activation") not in (None, *FUSED_ACTIVATIONS):
            raise bad(f"call {name!r} has an unknown fused activation {call['fused_activation']!r}")
        called = name.partition("#")[0]  # "path#2": the second call of a shared module
        for module in ((called,) if call["is_module"] else ()) + ((call["owner"],) if call["owner"] else ()):
            if module not in modules:
                raise QDebugError(f"{path}: the saved plan does not fit model {spec.target}: call {name!r} names "
                                  f"module {module!r}, which it does not have", ARCHITECTURE)
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(n, str) for n in pair)):
            raise bad(f"has a malformed Conv-BN pair {shown(pair, 80)}")
        conv, bn = (modules.get(n) for n in pair)
        if not isinstance(conv, (nn.Conv1d, nn.Conv2d)) or not isinstance(bn, nn.modules.batchnorm._BatchNorm):
            raise QDebugError(f"{path}: the saved plan does not fit model {spec.target}: it pairs {pair[0]!r} with "
                              f"{pair[1]!r}, which are no conv and BatchNorm of it", ARCHITECTURE)
        if conv.out_channels != bn.num_features:
            raise bad(f"pairs {pair[0]!r} ({conv.out_channels} channels) with {pair[1]!r} ({bn.num_features})")
    if any(not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v < 0 for k, v in counts.items()):
        raise bad("has call_counts that are not whole numbers >= 0 per module path")


def _build_fitting(spec: ModelSpec, state: dict[str, torch.Tensor], path: str, *, from_user: bool,
                   trusted: tuple[str, ...], plan: dict | None = None, sized_by_file: bool = True) -> nn.Module:
    """Build ``spec`` only once it is known to fit ``state`` (and the ``plan`` of a prepared
    checkpoint): when the file says how large it is (``sized_by_file``: its kwargs come from
    the file), first on the meta device (no memory), where its tensors must have the state's
    shapes and dtypes and may not add up to more than the state stores -- so a file naming a
    huge model over a small state is refused before anything is allocated.  A prepared
    checkpoint also holds quant points and may lack its BatchNorms (folded into their convs);
    the full check follows the load.  A model the user sized (``--model`` with its kwargs),
    or that cannot be built on meta (its constructor reads tensor values), is checked after
    its real build."""
    budget = MODULES_PER_ENTRY * len(state) + MODULES_BASE
    sizes = None
    if sized_by_file:
        sizes = build_meta(spec, from_user=from_user, trusted_modules=trusted, max_modules=budget)
    if sizes is not None:
        folded = set()
        if plan is not None:
            _check_plan(plan, sizes, spec, path)
            for name, module in sizes.named_modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    folded.update(f"{name}.{k}" if name else k for k in module.state_dict())
        _check_fit(sizes.state_dict(), state, path, extra_ok=plan is not None, missing_ok=folded)
        need, stored = _model_bytes(sizes), _stored_bytes(state)
        if need > stored + SIZE_SLACK:
            raise QDebugError(
                f"{path}: model {spec.target} with the kwargs it names holds {_mib(need)} of tensors, but the file's "
                f"state stores only {_mib(stored)}",
                "the file is damaged or crafted: its model kwargs do not fit its weights",
            )
    net = build(spec, from_user=from_user, trusted_modules=trusted)
    if sizes is None and plan is not None:
        _check_plan(plan, net, spec, path)
    return net


def _model_bytes(model: nn.Module) -> int:
    """Bytes of a model's saved tensors, each shared tensor once."""
    seen: set[int] = set()
    total = 0
    for tensor in model.state_dict(keep_vars=True).values():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def _stored_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes a state's tensors really hold: each storage once."""
    storages = {}
    for tensor in state.values():
        storage = tensor.untyped_storage()
        storages[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    return sum(storages.values())


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def _kind(t: torch.Tensor) -> str:
    if t.is_complex():
        return "complex"
    if t.dtype == torch.bool:
        return "bool"
    return "floating-point" if t.is_floating_point() else "integer"


def key_mismatch(own: Any, state: Any, *, extra_ok: bool = False,
                 missing_ok: set[str] | frozenset[str] = frozenset()) -> str:
    """How the keys of ``state`` differ from a model's ``own``, in a few words ("missing 3 key(s)
    e.g. a, b; unexpected 1 key(s) e.g. c"), or "" when they fit."""
    missing = [k for k in own if k not in state and k not in missing_ok]
    unexpected = [] if extra_ok else [k for k in state if k not in own]
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} key(s) e.g. {', '.join(missing[:4])}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)} key(s) e.g. {', '.join(unexpected[:4])}")
    return "; ".join(parts)


def _check_fit(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor], path: str, *,
               extra_ok: bool = False, missing_ok: set[str] | frozenset[str] = frozenset()) -> None:
    """The state fits the model's own tensors ``own``: the same keys (or, before preparing,
    extra keys when ``extra_ok`` and absent ``missing_ok`` ones), each of the same kind of dtype
    (a float weight is not filled from integers, bools or complex numbers) and the same shape
    (quant points' tensors take their saved shapes; ``QuantPoint`` and its observer check them)."""
    mismatch = key_mismatch(own, state, extra_ok=extra_ok, missing_ok=missing_ok)
    if mismatch:
        raise QDebugError(
            f"{path} does not match the model architecture: {mismatch}",
            "is the checkpoint from this model (and these model kwargs)?",
        )
    for key, mine in own.items():
        value = state.get(key)
        if value is None:
            continue
        if _kind(value) != _kind(mine):
            raise QDebugError(
                f"{path}: tensor {key!r} has dtype {value.dtype}, but the model keeps {_kind(mine)} values there "
                f"({mine.dtype})",
                "the file is damaged or not saved from this model: re-save it",
            )
        if not key.startswith(POINTS_ATTR + ".") and mine.shape != value.shape:
            raise QDebugError(
                f"{path}: shape mismatch for tensor {key!r}: checkpoint {list(value.shape)}, model {list(mine.shape)}",
                "the checkpoint was trained with other model kwargs (widths, classes)",
            )


def _apply_points(net: nn.Module, points: dict[str, dict], path: str) -> None:
    """Set each quant point's mode and flags from the file's (checked) ``points`` table."""
    own = engine_state(net).points
    for name, attrs in points.items():
        point = own.get(name)
        if point is None:
            raise QDebugError(f"{path}: 'points' names {name!r}, which is no quant point of the model",
                              ARCHITECTURE)
        point.mode = attrs.get("mode", point.mode)
        point.frozen = attrs.get("frozen", point.frozen)
        point.observe_in_fake = attrs.get("observe_in_fake", False)
        point.alpha = float(attrs.get("alpha", 1.0))
        point.forget_cached()


def _check_quantization(net: nn.Module, path: str) -> None:
    """The loaded quantization is one qdebug could have saved: no scale is negative, zero (-0.0
    too) or below float32's smallest normal number -- x / s would overflow to Inf where no
    data did, and qdebug's own scales never go below eps -- (NaN and Inf are data a diverged
    run leaves, which inspect and nan-trace report); a per-channel
    weight scale has one value per channel of its weight; integer weight codes (``weight_int``,
    quantized stage) have the weight's shape, an integer dtype and values within what q - z
    can be for the point's spec.  (Each point checks its own saved shapes and zero points as
    it loads: ``QuantPoint``.)"""
    for point in engine_state(net).points.values():
        scale = point.scale.detach()
        if bool((scale < 0).any()):
            raise QDebugError(f"{path}: quant point {point.name!r} has a negative scale ({float(scale.min()):g}); "
                              "scales are > 0", DAMAGED)
        if bool((scale < SCALE_TINY).any()):
            low = float(scale.min())
            what = "a zero scale" if low == 0 else f"a subnormal scale ({low:g})"
            raise QDebugError(f"{path}: quant point {point.name!r} has {what}; scales are at least "
                              f"{SCALE_TINY:g} (float32's smallest normal number)", DAMAGED)
    for name, layer in net.named_modules():
        if not isinstance(layer, _QWeighted) or layer.weight_point is None:
            continue
        point, weight = layer.weight_point, layer.weight
        if point.spec.group_size is not None and point.initialized:
            layout = _group_layout_of(weight, point.spec.group_size, path)
            if tuple(point.scale.shape) != layout:
                raise QDebugError(f"{path}: quant point {point.name!r} has grouped scales of shape "
                                  f"{list(point.scale.shape)}, but its weight needs {list(layout)} (rows, groups)",
                                  DAMAGED)
        elif point.spec.per_channel and point.initialized:
            axis = point.spec.ch_axis
            channels = weight.shape[axis] if -weight.dim() <= axis < weight.dim() else None
            if point.scale.dim() != 1 or point.scale.shape[0] != channels:
                raise QDebugError(
                    f"{path}: quant point {point.name!r} has {point.scale.numel()} per-channel scale(s), but its weight "
                    f"has {channels} channel(s) along axis {axis}",
                    DAMAGED,
                )
        codes = layer._buffers.get("weight_int")
        if codes is None:
            continue
        what = f"{path}: tensor '{name}.weight_int'"
        if codes.shape != weight.shape:
            raise QDebugError(f"{what} has shape {list(codes.shape)}, but its weight {list(weight.shape)}", DAMAGED)
        if _kind(codes) != "integer":
            raise QDebugError(f"{what} has dtype {codes.dtype}; integer weight codes are integers", DAMAGED)
        zero = point.zero_point.to(torch.int64)
        low, high = point.spec.qmin - int(zero.max()), point.spec.qmax - int(zero.min())
        if codes.numel() and (int(codes.min()) < low or int(codes.max()) > high):
            bad = int(codes.min()) if int(codes.min()) < low else int(codes.max())
            raise QDebugError(f"{what} holds {bad}, outside [{low}, {high}] of its {point.spec.describe()} weight spec",
                              DAMAGED)


def _group_layout_of(weight: torch.Tensor, group_size: int, path: str) -> tuple[int, int]:
    """(rows, groups) of a grouped weight (its spec came from the file: refused when it cannot cut it)."""
    from qdebug.engine.fake_quant import group_layout

    try:
        return group_layout(weight.shape, group_size)
    except QDebugError as exc:
        raise QDebugError(f"{path}: {exc.message}", DAMAGED) from None


def _refreeze_bn(net: nn.Module, paths: list[str]) -> None:
    """Freeze again the BatchNorm statistics that were frozen when the model was saved
    (paths that name no BatchNorm of this model -- one folded since -- are ignored)."""
    modules = dict(net.named_modules())
    for path in paths:
        if isinstance(modules.get(path), nn.modules.batchnorm._BatchNorm):
            freeze_bn_stats(net, path)


def _refold(net: nn.Module, folded: list[str], state: dict, path: str) -> None:
    """An imported torch.ao PTQ model whose BatchNorms torch folded into their convs: those BNs
    are nn.Identity, and a conv or linear layer that had no bias takes the one the file holds
    (the folded BN's shift) -- one per folded BN at most."""
    for bn in folded:
        module = _module_at(net, bn)
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise QDebugError(f"{path}: 'folded_bn' names {bn!r}, which is no BatchNorm of the model", ARCHITECTURE)
        parent, _, attr = bn.rpartition(".")
        setattr(net.get_submodule(parent) if parent else net, attr, without_norm(module))  # a norm-act keeps its act
    biased = [(name, m) for name, m in net.named_modules() if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear))
              and m.bias is None and f"{name}.bias" in state]
    if len(biased) > len(folded):
        raise QDebugError(f"{path} holds biases for {len(biased)} layers that have none, more than its "
                          f"{len(folded)} folded BatchNorm(s)", ARCHITECTURE)
    for _, layer in biased:
        channels = layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels
        layer.bias = nn.Parameter(torch.zeros(channels, dtype=layer.weight.dtype, device=layer.weight.device))


def _make_integer_buffers(net: nn.Module, state: dict) -> None:
    for name, module in net.named_modules():
        if isinstance(module, _QWeighted) and f"{name}.weight_int" in state:
            module.register_buffer("weight_int", torch.empty_like(state[f"{name}.weight_int"]))


def _load_state(net: nn.Module, state: dict[str, torch.Tensor], path: str) -> None:
    """load_state_dict once ``_check_fit`` passed (missing/unexpected keys, dtypes and shapes
    named); a quant point or observer refusing its saved tensors is named with the file."""
    _check_fit(net.state_dict(), state, path)
    try:
        net.load_state_dict(state, strict=True)
    except QDebugError as exc:
        raise QDebugError(f"{path}: {exc.message}", exc.hint) from None
    except RuntimeError as exc:  # a custom module's own refusal ("Error(s) in loading state_dict ...")
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise QDebugError(f"{path} does not load into the model: {lines[-1] if lines else exc}"[:400],
                          "is the checkpoint from this model (and these model kwargs)?") from None
