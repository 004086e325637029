"""Checkpoints of the four stages: one file each, safe to load.

A qdebug checkpoint is a dict readable with ``torch.load(weights_only=True)``
(tensors, numbers, strings, lists, dicts only -- see docs/checkpoints.md):

    format         "qdebug-checkpoint"
    version        1
    stage          "float" | "calibrated" | "qat" | "quantized"
    model          {"class": "package.module:Class", "kwargs": {...}}
    qconfig        QConfig.to_dict() (None for float)
    qat_mode       "fuse_bn" | "with_bn" | "with_bn_reverse_fold" (None for float)
    plan           the engine's traced plan (None for float)
    absorbed       conv paths whose BN was folded mid-QAT
    points         {name: {mode, frozen, observe_in_fake, alpha}}
    state          the model's state_dict: weights, BN statistics, every quant
                   point's scale / zero point / observer state, integer weights
    sample_inputs  optional example batch
    meta           {"qdebug": version, "torch": version, "time": ISO-8601, ...}

``load`` also accepts a plain float ``state_dict`` file (with the architecture
named by the user) and, only with ``unsafe=True``, a pickled whole module.
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
from qdebug.atomic import atomic_path
from qdebug.engine import QConfig, absorb_bn, convert, engine_state, is_prepared, prepare
from qdebug.engine.fusebn import freeze_bn_stats, frozen_bn_paths
from qdebug.engine.modules import _QWeighted
from qdebug.engine.prepare import POINTS_ATTR, refresh_weight_qparams
from qdebug.errors import QDebugError
from qdebug.modelspec import ModelSpec, build, remember, spec_of
from qdebug.torchfile import read_file

FORMAT = "qdebug-checkpoint"
VERSION = 1
STAGES = ("float", "calibrated", "qat", "quantized")


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
    actual = infer_stage(model)
    stage = stage or actual
    if stage not in STAGES:
        raise QDebugError(f"unknown stage {stage!r}", f"choose one of {', '.join(STAGES)}")
    compatible = {"float": ("float",), "calibrated": ("calibrated", "qat"), "quantized": ("quantized",)}[actual]
    if stage not in compatible:
        raise QDebugError(f"cannot save a {actual} model as stage {stage!r}", f"this model can be saved as: {', '.join(compatible)}")
    if isinstance(model_spec, str):
        spec = ModelSpec(model_spec, dict(model_kwargs or {}))
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
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "sample_inputs": sample_inputs,
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
            ckpt["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ckpt["qconfig"] = state.qconfig.to_dict()
        ckpt["qat_mode"] = state.qat_mode
        ckpt["plan"] = state.plan.to_dict()
        ckpt["absorbed"] = [
            c for c, _ in state.plan.pairs if model.get_submodule(c).bn is None and state.qat_mode != "fuse_bn"
        ]
        ckpt["points"] = {
            n: {"mode": p.mode, "frozen": p.frozen, "observe_in_fake": p.observe_in_fake, "alpha": float(p.alpha)}
            for n, p in state.points.items()
        }
    with atomic_path(path) as tmp:
        torch.save(ckpt, tmp)
    return Path(path)


def _looks_like_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    )


def _extract_state_dict(obj: Any) -> dict[str, torch.Tensor] | None:
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
    overrides the file's.  ``default_model`` (e.g. from the project config) is
    used only for plain state_dict files, which name no architecture.
    """
    obj = read_file(path, unsafe=unsafe)
    user_spec = None
    if model is not None:
        user_spec = model if isinstance(model, ModelSpec) else ModelSpec(model, dict(model_kwargs or {}))
    elif default_model is not None and not (isinstance(obj, dict) and obj.get("format") == FORMAT):
        user_spec = (
            default_model if isinstance(default_model, ModelSpec) else ModelSpec(default_model, dict(model_kwargs or {}))
        )
    if isinstance(obj, nn.Module):
        info = CheckpointInfo(str(path), "float", spec_of(obj), source="pickle")
        return obj.eval(), info
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        return _load_qdebug(obj, str(path), user_spec, trusted_modules)
    state = _extract_state_dict(obj)
    _refuse_data_file(obj, state, path)
    if state is not None:
        if user_spec is None:
            raise QDebugError(
                f"{path} is a plain state_dict: it does not say which architecture it belongs to",
                "name it with --model package.module:Class (or model = ... in qdebug.toml)",
            )
        net = build(user_spec, from_user=True)
        _load_state(net, state, str(path))
        return net.eval(), CheckpointInfo(str(path), "float", user_spec, source="state_dict")
    raise QDebugError(
        f"{path} is not a qdebug checkpoint or a state_dict (found {type(obj).__name__})",
        "save models with qdebug.save(model, path, stage=...) or torch.save(model.state_dict(), path)",
    )


def _refuse_data_file(obj: Any, state: dict | None, path: str | Path) -> None:
    """A data file passed as a checkpoint is called a data file (data.py's recognition rule).
    A flat dict of tensors is a state_dict unless it has no dotted (module.param) keys."""
    from qdebug.data import data_kind

    kind = data_kind(obj)
    if kind is None or (state is not None and (state is not obj or any("." in k for k in obj))):
        return
    raise QDebugError(f"{path} is a data file ({kind}), not a checkpoint",
                      f"pass it as --data {path}, and the model's checkpoint as the argument")


def _load_qdebug(obj: dict, path: str, user_spec: ModelSpec | None, trusted: tuple[str, ...]):
    version = obj.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise QDebugError(f"{path} has checkpoint version {version!r}; this qdebug reads up to {VERSION}",
                          "upgrade qdebug")
    stage = obj.get("stage")
    if stage not in STAGES:
        raise QDebugError(f"{path} has an unknown stage {stage!r}",
                          "stages: float, calibrated, qat, quantized; save with qdebug.save(model, path, stage=...)")
    for key in ("model", "state"):
        if key not in obj:
            raise QDebugError(f"{path} lacks the {key!r} field", "the file is not a complete qdebug checkpoint")
    file_spec = ModelSpec.from_dict(obj["model"])
    if user_spec is not None and user_spec.target == file_spec.target and not user_spec.kwargs:
        user_spec = ModelSpec(user_spec.target, dict(file_spec.kwargs))  # same class: keep the file's kwargs
    spec = user_spec or file_spec
    net = build(spec, from_user=user_spec is not None, trusted_modules=trusted)
    qconfig = None
    if stage != "float":
        try:
            qconfig = QConfig.from_dict(obj.get("qconfig"))
        except QDebugError as exc:
            raise QDebugError(f"{path}: invalid qconfig: {exc.message}", exc.hint) from None
        if not isinstance(obj.get("plan"), dict):
            raise QDebugError(f"{path} is a {stage} checkpoint without a plan", "re-save it with qdebug.save")
        try:
            with warnings.catch_warnings():  # told when the model was prepared; inspect reports fallbacks
                warnings.filterwarnings("ignore", message="qdebug: no quantized kernel")
                net = prepare(net, qconfig, mode=obj.get("qat_mode") or "fuse_bn", plan=obj["plan"])
        except (KeyError, AttributeError, TypeError) as exc:
            raise QDebugError(
                f"{path}: the saved plan does not fit model {spec.target} ({type(exc).__name__}: {exc})",
                "the checkpoint belongs to another architecture or other model kwargs",
            ) from None
        remember(net, spec)
        for conv in obj.get("absorbed") or []:
            absorb_bn(net, conv)
        if stage == "quantized":
            net = convert(net)
            remember(net, spec)
            _make_integer_buffers(net, obj["state"])
    _load_state(net, obj["state"], path)
    if stage != "float":
        points = engine_state(net).points
        for name, attrs in (obj.get("points") or {}).items():
            point = points.get(name)
            if point is None:
                continue
            point.mode = attrs.get("mode", point.mode)
            point.frozen = bool(attrs.get("frozen", point.frozen))
            point.observe_in_fake = bool(attrs.get("observe_in_fake", False))
            point.alpha = float(attrs.get("alpha", 1.0))
            point.forget_cached()
    _refreeze_bn(net, obj.get("frozen_bn"))
    info = CheckpointInfo(
        path, stage, spec, qconfig, obj.get("qat_mode"), obj.get("sample_inputs"), dict(obj.get("meta") or {})
    )
    return net.eval(), info


def _refreeze_bn(net: nn.Module, paths: Any) -> None:
    """Freeze again the BatchNorm statistics that were frozen when the model was saved
    (paths that name no BatchNorm of this model are ignored: the state check names real mismatches)."""
    if not isinstance(paths, list):
        return
    modules = dict(net.named_modules())
    for path in paths:
        if isinstance(path, str) and isinstance(modules.get(path), nn.modules.batchnorm._BatchNorm):
            freeze_bn_stats(net, path)


def _make_integer_buffers(net: nn.Module, state: dict) -> None:
    for name, module in net.named_modules():
        if isinstance(module, _QWeighted) and f"{name}.weight_int" in state:
            module.register_buffer("weight_int", torch.empty_like(state[f"{name}.weight_int"]))


def _load_state(net: nn.Module, state: dict[str, torch.Tensor], path: str) -> None:
    """load_state_dict with missing/unexpected keys and shape mismatches named."""
    if not isinstance(state, dict):
        raise QDebugError(f"{path}: 'state' is not a dict of tensors",
                          "the file is damaged or not from qdebug.save: save the model again")
    own = net.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s) e.g. {', '.join(missing[:4])}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s) e.g. {', '.join(unexpected[:4])}")
        raise QDebugError(
            f"{path} does not match the model architecture: {'; '.join(parts)}",
            "is the checkpoint from this model (and these model kwargs)?",
        )
    for key, value in state.items():
        if key.startswith(POINTS_ATTR + "."):
            continue  # per-channel qparams and observer buffers take the saved shape
        if own[key].shape != value.shape:
            raise QDebugError(
                f"{path}: shape mismatch for tensor {key!r}: checkpoint {list(value.shape)}, model {list(own[key].shape)}",
                "the checkpoint was trained with other model kwargs (widths, classes)",
            )
    net.load_state_dict(state, strict=True)
