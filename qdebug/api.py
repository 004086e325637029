"""The Python API's one-call entry points: paths or models in, DataFrames out.

    import qdebug
    frame = qdebug.compare("float.pt", "qat.pt", data="eval.pt", batches=8)
    frame.attrs["summary"]     # the diagnosis paragraph; frame.attrs["meta"] has the rest

They read the project config as the commands do (``qdebug.toml`` or ``[tool.qdebug]``, found
upward from the current directory with the same boundary and ownership checks, or
``config=PATH``): its ``model``, ``model_kwargs`` and ``trust`` for loading, its checkpoints,
``data``, ``batches``, ``batch_size``, ``metric``, ``ratio`` and ``device`` where an argument is
not given.  A config never allows unsafe loading (``unsafe=True`` does).  Errors name Python
arguments (``model=``, ``trusted_modules=``), not the command line's flags (``python_terms``).
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch.nn as nn

from qdebug.checkpoint import load as load_file
from qdebug.config.project import DEBUG_ORDER, Config, load_config
from qdebug.data.source import BatchSource
from qdebug.data.spec import batches_from_inputs, batches_from_iterable, load_batches
from qdebug.errors import QDebugError, shown

if TYPE_CHECKING:  # annotations only: qdebug.load needs no pandas
    import pandas as pd


# -- errors in the caller's terms ----------------------------------------------------------------
# The loaders' hints are written for the command line; called from Python, each flag is named as
# the argument that does the same.  Applied in order; a flag inside a printed ``qdebug COMMAND ...``
# stays as it is (that command runs in a shell).
_PYTHON_TERMS = [
    (re.compile(r'add  trust = \["([\w.]+)"\]  to qdebug\.toml \(qdebug init --trust [\w.]+ writes it\)'),
     r'pass trusted_modules=["\1"] (or add  trust = ["\1"]  to qdebug.toml)'),
    (re.compile(r"--model-kwargs\b"), "model_kwargs="),
    (re.compile(r"--model ([\w.]+:[\w.]+)"), r'model="\1"'),
    (re.compile(r"--model\b"), "model="),
    (re.compile(r"--unsafe-load\b"), "unsafe=True"),
    (re.compile(r"--(device|data|metric) ([^\s,;()]+)"), r'\1="\2"'),
    (re.compile(r"--(batches|ratio) ([^\s,;()]+)"), r"\1=\2"),
    (re.compile(r"--batch-size ([^\s,;()]+)"), r"batch_size=\1"),
    (re.compile(r"--(device|data|metric|batches|ratio)\b"), r"\1="),
    (re.compile(r"--batch-size\b"), "batch_size="),
    (re.compile(r"--config\b"), "config="),
]


def in_python_terms(text: str | None) -> str | None:
    """``text`` (an error's message or hint) with the command line's flags named as the Python
    API's arguments: ``--model pkg.net:Net`` as ``model="pkg.net:Net"``, ``qdebug init --trust
    pkg`` as ``trusted_modules=["pkg"]``, ``--unsafe-load`` as ``unsafe=True``."""
    if not text:
        return text
    for pattern, replacement in _PYTHON_TERMS:
        text = pattern.sub(lambda m: m.group(0) if _in_command(m.string, m.start()) else m.expand(replacement), text)
    return text


def _in_command(text: str, at: int) -> bool:
    """Whether position ``at`` is inside a ``qdebug COMMAND ...`` printed to run in a shell."""
    start = text.rfind("qdebug ", 0, at)
    return start >= 0 and not any(stop in text[start:at] for stop in (";", ",", "(", ")"))


def python_terms(function):
    """Decorator: a ``QDebugError`` out of ``function`` names Python arguments (``in_python_terms``)."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except QDebugError as exc:
            message, hint = in_python_terms(exc.message), in_python_terms(exc.hint)
            if (message, hint) == (exc.message, exc.hint):
                raise
            raise QDebugError(message, hint) from exc
    return wrapper


# -- the project config, read as the commands read it -------------------------------------------
def _config(config: Any) -> Config:
    """The config of one call: ``config=PATH`` (read as given), ``False`` (none), else the one in
    effect in the current directory (``qdebug.config.find_config``: the same walk up, boundary
    and ownership checks as the commands)."""
    if config is False:
        return Config()
    if config is not None and not isinstance(config, (str, Path)):
        raise QDebugError(f"config must be a path to a qdebug.toml or pyproject.toml, or False, got {shown(config)}",
                          'e.g. config="qdebug.toml"')
    return load_config(config)


@python_terms
def load(path: str | Path, *, model: Any = None, model_kwargs: dict[str, Any] | None = None,
         default_model: Any = None, unsafe: bool = False, trusted_modules: tuple[str, ...] = (),
         config: Any = None) -> tuple[nn.Module, Any]:
    """Load a checkpoint of any stage as a model ready to run (eval mode); ``(model, info)``.

    As ``qdebug inspect`` loads it: the project config's ``model`` is the architecture of plain
    state_dict files (``default_model`` overrides it), ``model_kwargs`` its kwargs (the argument
    overrides them), and a checkpoint may name classes of ``trusted_modules``, of the config's
    ``trust`` list and of the model named.  ``unsafe=True`` alone allows a pickled whole-module
    file.  ``config``: a config file to read, or False for none (see ``_config``)."""
    return _load(path, _config(config), model=model, model_kwargs=model_kwargs, default_model=default_model,
                 unsafe=unsafe, trusted_modules=trusted_modules)


def _load(path: Any, cfg: Config, *, model: Any = None, model_kwargs: Any = None, default_model: Any = None,
          unsafe: bool = False, trusted_modules: Any = ()) -> tuple[nn.Module, Any]:
    """``path`` loaded under ``cfg``'s model, kwargs and trust (``load``)."""
    _check_flag("unsafe", unsafe)
    if not isinstance(trusted_modules, (list, tuple, set, frozenset)) or not all(
            isinstance(m, str) for m in trusted_modules):
        raise QDebugError(f"trusted_modules must be a list of package names, got {shown(trusted_modules)}",
                          'e.g. trusted_modules=["mypkg"]')
    default = default_model if default_model is not None else cfg.get("model")
    return load_file(path, model=model,
                     model_kwargs=model_kwargs if model_kwargs is not None else cfg.get("model_kwargs"),
                     default_model=default, unsafe=unsafe,
                     trusted_modules=(*trusted_modules, *cfg.trusted(model if model is not None else default_model)))


def _config_checkpoints(command: str, given: tuple, cfg: Config) -> tuple:
    """The models given, else the config's ``float`` and model under test (``DEBUG_ORDER``, as the
    commands take them); an error saying what the config lacks, in Python's terms."""
    if given:
        return given
    float_key, test_key = cfg.stage_pair(DEBUG_ORDER)
    if float_key and test_key:
        return (cfg.get(float_key), cfg.get(test_key))
    where = (f"{cfg.path} names {' and '.join(cfg.named_stages()) or 'no checkpoint'} (no "
             f"{'float' if test_key else 'qat, calibrated or quantized'})" if cfg.path else "no qdebug.toml was read (none found, or config=False)")
    raise QDebugError(f"qdebug.{command} needs models or checkpoint paths: none given, and {where}",
                      f'e.g. qdebug.{command}("float.pt", "calibrated.pt"), or set float and calibrated in qdebug.toml')


# -- the arguments, checked at the entry as the command line checks its options ----------------
# A wrong type or value is a QDebugError naming the argument, never a TypeError from deep inside.
def _check_count(name: str, value: Any, low: int = 1) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
        raise QDebugError(f"{name} must be a whole number >= {low}, got {shown(value)}", f"e.g. {name}=8")


def _check_number(name: str, value: Any, hint: str) -> None:
    """A finite int or float (a bool, a string "0.5", NaN or Inf is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1e308 <= value <= 1e308:
        raise QDebugError(f"{name} must be a finite number, got {shown(value)}", hint)


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise QDebugError(f"{name} must be True or False, got {shown(value)}", f"e.g. {name}=True")


def _check_ratio(ratio: Any) -> None:
    from qdebug.config.project import check_ratio_range

    _check_number("ratio", ratio, "e.g. ratio=0.99")
    check_ratio_range(ratio, "ratio", "e.g. ratio=0.99")


def _check_metric(metric: Any) -> None:
    if metric is not None and not isinstance(metric, str) and not callable(metric):
        raise QDebugError(f"metric must be a name, a \"package.module:function\" or a function, got {shown(metric)}",
                          'e.g. metric="top1", or metric=my_metric (called as metric(model, batches))')


def _check_thresholds(thresholds: Any) -> None:
    from collections.abc import Mapping

    if thresholds is None:
        return
    if not isinstance(thresholds, Mapping):
        raise QDebugError(f"thresholds must be a dict of metric -> number, got {shown(thresholds)}",
                          'e.g. thresholds={"sqnr_db": 25}')
    for name, value in thresholds.items():
        _check_number(f"thresholds[{shown(name)}]", value, 'e.g. thresholds={"sqnr_db": 25}')


def _check_data_args(data: Any, batches: Any, batch_size: Any) -> None:
    _check_count("batches", batches)
    _check_count("batch_size", batch_size)
    if isinstance(data, (bytes, bytearray)):
        raise QDebugError(f"data must be a data spec string or an iterable of batches, got {shown(data)}",
                          'e.g. data="eval.pt", or a list of (inputs, target) pairs')


def _as_model(item: Any, index: int, cfg: Config) -> tuple[str, nn.Module, Any]:
    from qdebug.interop.torch_stage import TorchStage, is_converted

    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], nn.Module):
        label, model = str(item[0]), item[1]
        return label, TorchStage(model) if is_converted(model) else model, None
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], (str, Path)) and _is_onnx(item[1]):
        return str(item[0]), _onnx_stage(item[1]), None  # ("deployed", "model.onnx")
    if isinstance(item, nn.Module):
        # A model torch.ao converted runs as it is, by torch's kernels (``qdebug.interop.torch_stage``).
        label = "onnx" if _is_onnx_stage(item) else f"model{index}"
        return label, TorchStage(item) if is_converted(item) else item, None
    if isinstance(item, (str, Path)):
        if _is_onnx(item):  # run by ONNX Runtime (``qdebug.onnx.stage``), named after the reference
            return "onnx", _onnx_stage(item), None
        model, info = _load(item, cfg)
        return info.stage, model, info
    raise QDebugError(f"cannot compare a {type(item).__name__}", "pass checkpoint paths, models or (label, model) pairs")


def _is_onnx(path: Any) -> bool:
    from qdebug.onnx.model_file import is_onnx_path

    return is_onnx_path(path)


def _onnx_stage(path: Any) -> nn.Module:
    from qdebug.onnx.model_file import read_onnx
    from qdebug.onnx.stage import OnnxStage

    return OnnxStage(read_onnx(path), source=str(path))


def _is_onnx_stage(model: Any) -> bool:
    """Whether ``model`` is a ``qdebug.onnx.stage.OnnxStage`` (without importing onnx to ask)."""
    module = sys.modules.get("qdebug.onnx.stage")
    return module is not None and isinstance(model, module.OnnxStage)


def _name_torch_stages(models: list[nn.Module], reference: nn.Module) -> None:
    """Give each converted torch model compared its float model: the reference, which must be one
    (a graph keeps no class; the rows are named after the float model's calls); and each ONNX
    model (``qdebug.onnx.stage.OnnxStage``) without one the reference, float or prepared."""
    from qdebug.engine import is_prepared
    from qdebug.interop.torch_stage import TorchStage

    for model in models:
        if _is_onnx_stage(model) and model.reference is None:  # an ONNX model: named after the reference
            if hasattr(type(reference), "qdebug_tap"):
                raise QDebugError("an ONNX model is compared against a checkpoint or model of qdebug's, and the "
                                  "reference is not one", "pass the float model first (or ref= its index)")
            model.use_reference(reference)
            continue
        if not isinstance(model, TorchStage) or model.float_model is not None or model.sources is not None:
            continue
        if isinstance(reference, TorchStage) or is_prepared(reference):
            raise QDebugError("a converted torch model is compared against its float model, and the reference is not one",
                              "pass the float model first (or ref= its index), or "
                              "qdebug.interop.TorchStage(converted, float_model=..., example_inputs=...)")
        model.use_float_model(reference)


@python_terms
def compare(*models: Any, data: Any = None, batches: int | None = None, batch_size: int | None = None,
            ref: int | None = None, thresholds: dict[str, float] | None = None, isolated: bool = True,
            kl_feature_maps: bool = False, device: Any = None, config: Any = None) -> pd.DataFrame:
    """Per-layer comparison of checkpoints/models (see docs/compare.md); a DataFrame.

    ``data``: a data spec string, a list of batches, another iterable of them (a DataLoader,
    read lazily), or None for the reference checkpoint's sample inputs.  ``ref``: the reference's index; by default the least
    quantized model (a warning says so when that is not the first).  ``kl_feature_maps``:
    also compute ``kl`` for feature maps (it is always computed for [N, C] outputs).
    ``device``: where to run (``"cpu"``, ``"cuda"``, ``"cuda:N"``; see ``_placed``).  No models:
    the config's ``float`` and ``qat`` (else ``calibrated``, else ``quantized``); ``data``,
    ``batches``, ``batch_size``, ``device`` not given: the config's (module docstring).
    """
    from qdebug.checkpoint import infer_stage
    from qdebug.tools.compare import choose_reference, compare as run

    cfg = _config(config)
    models = _config_checkpoints("compare", models, cfg)
    data, batches, batch_size, device = _config_data(cfg, data, batches, batch_size, device)
    if len(models) < 2:
        raise QDebugError("compare needs at least two models", 'e.g. qdebug.compare("float.pt", "qat.pt")')
    _check_data_args(data, batches, batch_size)
    if ref is not None:
        _check_count("ref", ref, low=0)
    _check_thresholds(thresholds)
    _check_flag("isolated", isolated)
    _check_flag("kl_feature_maps", kl_feature_maps)
    loaded = [_as_model(m, i, cfg) for i, m in enumerate(models)]
    labels = [label for label, _, _ in loaded]
    for i, label in enumerate(labels):
        if labels.count(label) > 1:
            labels[i] = f"{label}{i}"
    if ref is not None and not 0 <= ref < len(loaded):
        raise QDebugError(f"reference index {ref} is out of range for {len(loaded)} models",
                          "ref is an index into models: 0 up to one less than their number")
    stages = [info.stage if info is not None else getattr(type(m), "stage", None) or infer_stage(m)
              for _, m, info in loaded]
    ref, warning = choose_reference(stages, ref, names=labels)
    if warning:
        warnings.warn(f"qdebug.compare: {warning}", stacklevel=2)
    _name_torch_stages([m for _, m, _ in loaded], loaded[ref][1])
    batch_list = _batches(data, batches, batch_size, loaded[ref][2], "the reference")
    with _placed(device, [m for _, m, _ in loaded], models) as where:
        result = run([(label, m) for label, (_, m, _) in zip(labels, loaded)], _moved(batch_list, where), ref=ref,
                     thresholds=thresholds, isolated=isolated, kl_feature_maps=kl_feature_maps)
    frame = result.frame
    frame.attrs["summary"] = result.summary
    frame.attrs["meta"] = result.meta
    return frame


@python_terms
def step(*checkpoints: Any, data: Any = None, batches: int | None = None, batch_size: int | None = None,
         module: str | list[str] = (), mode: str | None = None, depth: int = 1, kind: str = "both",
         metric: Any = None, ratio: float | None = None, device: Any = None, config: Any = None) -> pd.DataFrame:
    """Step-wise partial quantization (see docs/step.md); a DataFrame, one row per step.

    ``checkpoints``: ``[float,] model`` as paths or modules; without the float one, the model
    with every quant point off is the reference.  ``mode``: default "only" with ``module``, else "auto".  ``metric``: a name (``"top1"``) or a
    function ``metric(model, batches)``.  ``frame.attrs["summary"]`` and ``["meta"]``
    (``drill_path``, ``culprit``) hold the rest.  ``device``: where to run (see ``_placed``).  Not
    given: the config's checkpoints, ``data``, ``metric``, ``ratio`` (else 0.99) and the rest
    (module docstring).
    """
    from qdebug.tools.baseline import TaskRule
    from qdebug.tools.step import step as run

    cfg = _config(config)
    checkpoints = _config_checkpoints("step", checkpoints, cfg)
    data, batches, batch_size, device = _config_data(cfg, data, batches, batch_size, device)
    metric, ratio = cfg.pick("metric", metric), _ratio(cfg, ratio)
    _check_ratio(ratio)
    _check_count("depth", depth)
    if not isinstance(module, str) and not (isinstance(module, (list, tuple))
                                            and all(isinstance(m, str) for m in module)):
        raise QDebugError(f"module must be a module path or a list of them, got {shown(module)}",
                          'e.g. module="backbone" or module=["layer1", "layer2"]')
    for name, value in (("mode", mode), ("kind", kind)):
        if value is not None and not isinstance(value, str):
            raise QDebugError(f"{name} must be a string, got {shown(value)}", "see help(qdebug.step)")
    reference, model, batch_list, metric_fn, name = _against_float("step", checkpoints, data, batches, batch_size, metric,
                                                                  cfg)
    modules = [module] if isinstance(module, str) else list(module)
    with _placed(device, [reference, model], checkpoints) as where:
        result = run(model, _moved(batch_list, where), reference=reference, modules=modules,
                     mode=mode or ("only" if modules else "auto"), depth=depth, kind=kind, metric=metric_fn,
                     metric_name=name, rules={"metric": TaskRule(ratio=ratio)})
    frame = result.frame
    frame.attrs["summary"] = result.summary
    frame.attrs["meta"] = result.meta
    return frame


@python_terms
def suggest(*checkpoints: Any, data: Any = None, batches: int | None = None, batch_size: int | None = None,
            metric: Any = None, ratio: float | None = None, min_sqnr: float = 30.0, bits: int = 16,
            device: Any = None, config: Any = None) -> pd.DataFrame:
    """The ranked int16 candidates and the minimal verified plan (see docs/suggest.md); a DataFrame.

    ``checkpoints``: ``[float,] model``.  ``frame.attrs["plan"]`` holds the plan (``points``,
    ``before``, ``after``, ``passed``, ``evaluations``, ``overrides``), ``["summary"]`` and
    ``["meta"]`` the rest.  ``device``: where to run (see ``_placed``).  Not given: the config's
    checkpoints, ``data``, ``metric``, ``ratio`` (else 0.99) and the rest (module docstring).
    """
    from qdebug.tools.baseline import TaskRule
    from qdebug.tools.suggest import diagnoses_of, suggest as run

    cfg = _config(config)
    checkpoints = _config_checkpoints("suggest", checkpoints, cfg)
    data, batches, batch_size, device = _config_data(cfg, data, batches, batch_size, device)
    metric, ratio = cfg.pick("metric", metric), _ratio(cfg, ratio)
    _check_ratio(ratio)
    _check_number("min_sqnr", min_sqnr, "e.g. min_sqnr=30")
    _check_count("bits", bits, low=2)

    reference, model, batch_list, metric_fn, name = _against_float("suggest", checkpoints, data, batches, batch_size,
                                                                  metric, cfg)
    with _placed(device, [reference, model], checkpoints) as where:
        batch_list = _moved(batch_list, where)
        result = run(model, batch_list, reference=reference, metric=metric_fn, metric_name=name,
                     rules={"metric": TaskRule(ratio=ratio)}, min_sqnr=min_sqnr, bits=bits,
                     diagnoses=lambda searched: diagnoses_of(reference, model, searched))
    frame = result.frame
    frame.attrs.update(summary=result.summary, meta={k: v for k, v in result.meta.items() if k != "plan"},
                       plan=result.meta["plan"])
    return frame


@python_terms
def fix(model: Any, data: Any = None, *, batches: int | None = None, batch_size: int | None = None,
        qconfig: Any = None, mode: str | None = None, methods: Any = None, metric: Any = None,
        config: Any = None) -> tuple[nn.Module, pd.DataFrame]:
    """The float-side fixes, each proven on the data (docs/fix.md); ``(fixed_model, frame)``.

    ``model``: the float model (an nn.Module or a float checkpoint's path); ``data``: its batches
    (a list or iterable of batches, or a data spec), the last quarter held out from 4 batches on.
    ``qconfig``: the ``QConfig`` (or its dict) it will be calibrated with; ``mode``: the QAT mode
    (default the config's, else fuse_bn); ``methods``: a subset of ``qdebug.tools.fix.METHODS``.
    ``frame`` has one row per method; ``attrs["changes"]`` every transform's rows (records),
    ``attrs["summary"]`` and ``attrs["meta"]`` the rest.  The fixed model is the original's deep
    copy when no method helped (``attrs["meta"]["kept"]`` is empty)."""
    from qdebug.engine import QConfig
    from qdebug.data.metrics import resolve_metric
    from qdebug.tools.fix import fix as run

    cfg = _config(config)
    data, batches, batch_size, _ = _config_data(cfg, data, batches, batch_size, None)
    _check_data_args(data, batches, batch_size)
    _check_metric(metric := cfg.pick("metric", metric))
    info = None
    if not isinstance(model, nn.Module):
        model, info = _load(model, cfg)
        if info.stage != "float":
            raise QDebugError(f"fix takes a float checkpoint, and this one is {info.stage}",
                              "pass the float checkpoint (the one you calibrate or train from)")
    if qconfig is None or isinstance(qconfig, dict):
        qconfig = QConfig.from_dict(qconfig if qconfig is not None else cfg.get("qconfig") or {})
    elif not isinstance(qconfig, QConfig):
        raise QDebugError(f"qconfig must be a QConfig or a dict, got {shown(qconfig)}",
                          "e.g. qconfig=QConfig(weight=QuantSpec(per_channel=False))")
    metric_fn = resolve_metric(metric) if metric is not None else None
    name = metric.rsplit(":", 1)[-1] if isinstance(metric, str) else getattr(metric_fn, "__name__", "metric")
    result = run(model, _batches(data, batches, batch_size, info, whose="the model"), qconfig=qconfig,
                 mode=mode or cfg.get("mode") or "fuse_bn", methods=methods, metric=metric_fn, metric_name=name)
    frame = result.frame
    frame.attrs.update(summary=result.summary, meta=result.meta, changes=result.changes.to_dict("records"))
    return result.model, frame


def _against_float(command: str, checkpoints: tuple, data: Any, batches: int | None, batch_size: int | None,
                   metric: Any, cfg: Config) -> tuple[nn.Module | None, nn.Module, BatchSource, Any, str]:
    """``[float,] model`` loaded, their batches, and the metric resolved with its task name
    (a single-number metric's task is named after it, as on the command line)."""
    from qdebug.data.metrics import resolve_metric

    if not 1 <= len(checkpoints) <= 2:
        raise QDebugError(f"{command} takes one or two checkpoints, got {len(checkpoints)}", "pass [float,] model")
    _check_data_args(data, batches, batch_size)
    _check_metric(metric)
    loaded = [_as_model(m, i, cfg) for i, m in enumerate(checkpoints)]
    _, model, info = loaded[-1]
    reference = loaded[0][1] if len(loaded) == 2 else None
    metric_fn = resolve_metric(metric) if metric is not None else None
    name = metric.rsplit(":", 1)[-1] if isinstance(metric, str) else getattr(metric_fn, "__name__", "metric")
    return reference, model, _batches(data, batches, batch_size, info), metric_fn, name


def _config_data(cfg: Config, data: Any, batches: Any, batch_size: Any, device: Any) -> tuple[Any, Any, Any, Any]:
    """``data``, ``batches``, ``batch_size`` and ``device``: each as given, else the config's."""
    return (cfg.pick("data", data), cfg.pick("batches", batches), cfg.pick("batch_size", batch_size),
            cfg.pick("device", device))


def _ratio(cfg: Config, ratio: Any) -> Any:
    """``ratio`` as given, else the config's, else 0.99 (baseline's default)."""
    return ratio if ratio is not None else cfg.get("ratio", 0.99)


def _batches(data: Any, batches: int | None, batch_size: int | None, info: Any,
             whose: str = "the checkpoint") -> BatchSource:
    """``data`` as batches: a data spec string, a list of batches, or None for the sample
    inputs stored in ``whose`` checkpoint (``info``)."""
    if isinstance(data, str):
        return load_batches(data, batch_size=batch_size, batches=batches)
    if data is not None:
        return batches_from_iterable(data, batches)
    if info is None or info.sample_inputs is None:
        raise QDebugError(f"no data given and {whose} has no sample inputs", "pass data=...")
    return batches_from_inputs(info.sample_inputs)


@contextlib.contextmanager
def _placed(device: Any, models: list[nn.Module | None], given: tuple) -> Iterator[Any]:
    """The models of one call on its device for the call's duration; yields that device (None:
    the CPU, where checkpoints load).

    ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``): every model goes
    there, and a model the caller passed (in ``given``) goes back where it was afterwards, so
    the call leaves no trace on it.  ``device=None``: the caller's models stay where they are,
    and models loaded from paths join the first of them.  On CUDA, float32 convolutions and
    matmuls run in IEEE float32 (``qdebug.config.device.ieee_float32``)."""
    from qdebug.config.device import ieee_float32, model_device, resolve_device

    unique = list({id(m): m for m in models if m is not None}.values())
    theirs = {id(item[1] if isinstance(item, tuple) else item) for item in given}
    if device is not None:
        target = resolve_device(device, "device=", 'pass device="cpu"')
    else:
        target = next((model_device(m) for m in unique if id(m) in theirs and model_device(m) is not None), None)
    with contextlib.ExitStack() as stack:
        for model in unique:
            if target is None or (device is None and id(model) in theirs):
                continue
            where = model_device(model)
            model.to(target)
            if id(model) in theirs and where is not None and where != target:
                stack.callback(model.to, where)
        if target is not None and target.type == "cuda":
            stack.enter_context(ieee_float32())
        yield target


def _moved(batches: Any, device: Any) -> Any:
    """``batches`` on ``device`` as they are made (None: as they are)."""
    if device is None:
        return batches
    if hasattr(batches, "to"):
        return batches.to(device)
    from qdebug.config.device import to_device

    return [to_device(b, device) for b in batches]
