"""Where qdebug computes: the device a command or API call runs on, and moving data there.

- ``check_device_name(name)``: ``cpu``, ``cuda`` or ``cuda:N``, checked without torch (a typo
  answers at once, before torch's seconds of import); anything else is one ``QDebugError``;
- ``resolve_device(name)``: that device checked against this machine with torch -- CUDA asked
  for on a torch built without it, on a machine without a GPU, or ``cuda:N`` past the GPUs
  there is one error naming where the name came from and what the machine has;
- ``to_device(obj, device)`` moves every tensor of a batch (nested in tuples, lists, dicts and
  ``Batch``) to ``device``; other values pass through unchanged.  ``model_device(model)`` is
  where a model's tensors are;
- ``ieee_float32()``: float32 convolutions and matmuls computed in IEEE float32 on CUDA, not
  in TF32, while qdebug runs there (see its docstring); ``hold``/``release_held`` keep such a
  setting for the rest of a command;
- ``out_of_memory(what)``: the GPU running out of memory as one clear error.

Every engine computation takes its device from its inputs (the model's tensors, the batch),
so moving the model and the batches is all a device choice takes.
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, Any, ContextManager, Iterator

from qdebug.errors import QDebugError, first_line

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

DEVICE_NAME = re.compile(r"cpu|cuda(?::\d{1,4})?")
DEVICES = "cpu, cuda (the current GPU) or cuda:N (GPU N, counted from 0)"


def check_device_name(name: Any, source: str = "--device", hint: str | None = None) -> str:
    """``name`` (a string, or a ``torch.device``) as a device name qdebug runs on, checked
    without importing torch.  ``source`` names where it was given (``--device``, a config
    file's ``device``, ``device=``); ``hint`` how to pick the CPU there."""
    text = str(name) if type(name).__name__ == "device" else name  # a torch.device, without importing torch
    if not isinstance(text, str) or not DEVICE_NAME.fullmatch(text):
        raise QDebugError(f"{source} {name!r} cannot be used here: qdebug runs on {DEVICES}",
                          hint or "e.g. --device cuda:0, or --device cpu")
    return text


def _rank_gpu(text: str) -> str:
    """``cuda`` under torchrun is each rank's own GPU, ``cuda:$LOCAL_RANK`` (docs/scale.md):
    otherwise every rank of a machine would compute on GPU 0."""
    import os

    if text != "cuda" or int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return text
    local = os.environ.get("LOCAL_RANK", "")
    return f"cuda:{local}" if local.isdigit() else text


def resolve_device(name: Any, source: str = "--device", hint: str | None = None) -> "torch.device":
    """The ``torch.device`` of ``name``, checked against this machine: a CUDA device needs a
    torch built with CUDA, a visible GPU, and an index below their number.  Each failure is one
    ``QDebugError`` saying what this machine has; ``hint`` (default: ``use --device cpu``)
    says how to run on the CPU instead."""
    text = check_device_name(name, source, hint)
    import torch

    device = torch.device(_rank_gpu(text))
    if device.type == "cpu":
        return device
    problem = None
    if not torch.backends.cuda.is_built():
        problem = f"this torch ({torch.__version__}) is built without CUDA"
    elif not torch.cuda.is_available():
        problem = (f"torch {torch.__version__} finds no CUDA device on this machine (check the driver and "
                   "CUDA_VISIBLE_DEVICES)")
    else:
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            problem = f"this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}"
    if problem is None:
        try:  # a driver too old for this torch, a GPU in a bad state: said now, not deep in a forward
            torch.empty(0, device=device)
        except Exception as exc:  # RuntimeError, AssertionError (torch's lazy CUDA init), ...
            problem = f"CUDA fails to start: {first_line(exc)}"
    if problem is not None:
        raise QDebugError(f"{source} {text!r} cannot be used here: {problem}", hint or "use --device cpu")
    return device


def to_device(obj: Any, device: Any) -> Any:
    """``obj`` with every tensor in it on ``device`` (None: unchanged)."""
    if device is None:
        return obj
    import torch

    if isinstance(obj, torch.Tensor):
        target = torch.device(device)
        if obj.device == target:
            return obj
        # Asynchronous only towards a GPU: a copy to the CPU made so could be read before it lands.
        return obj.to(target, non_blocking=target.type != "cpu")
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple (Batch)
        return type(obj)(*(to_device(x, device) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def model_device(model: "nn.Module") -> "torch.device | None":
    """The device of ``model``'s first parameter (else buffer); None when it holds no tensor."""
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return None


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """float32 convolutions and matmuls on CUDA computed in IEEE float32 inside the block, and
    torch's settings restored after.

    cuDNN convolves float32 in TF32 by default (a 10-bit mantissa: errors of ~1e-3 of the signal,
    about 60 dB below it -- the size of what qdebug measures, and far from the CPU's float32
    rounding), and a user may have allowed TF32 matmuls.  qdebug measures quantization error,
    not TF32's, so it turns both off while it runs on CUDA.  Nothing changes on the CPU.
    """
    import torch

    knobs = _precision_knobs(torch)
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in knobs]
    try:
        for owner, attr, value in knobs:
            setattr(owner, attr, value)
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


def _precision_knobs(torch: Any) -> list[tuple[Any, str, Any]]:
    """(owner, attribute, IEEE value) of cuDNN's convolutions and CUDA's matmuls: torch's
    per-backend ``fp32_precision`` where it has it (mixing it with the older ``allow_tf32``
    flags makes torch refuse to read them), else those flags."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    matmul = torch.backends.cuda.matmul
    if hasattr(conv, "fp32_precision") and hasattr(matmul, "fp32_precision"):
        return [(conv, "fp32_precision", "ieee"), (matmul, "fp32_precision", "ieee")]
    return [(torch.backends.cudnn, "allow_tf32", False), (matmul, "allow_tf32", False)]


_HELD = contextlib.ExitStack()  # settings a command keeps until it ends (``release_held``)


def hold(manager: ContextManager[Any]) -> None:
    """Enter ``manager`` until ``release_held()`` (the command line calls it when a command ends)."""
    _HELD.enter_context(manager)


def release_held() -> None:
    """Leave every context ``hold`` entered, last first."""
    _HELD.close()


@contextlib.contextmanager
def out_of_memory(what: str) -> Iterator[None]:
    """The GPU running out of memory while ``what`` (e.g. "moving the batches to cuda") as one
    ``QDebugError`` with the ways out, instead of torch's traceback."""
    import torch

    oom = getattr(torch.cuda, "OutOfMemoryError", ())
    try:
        yield
    except oom as exc:
        raise QDebugError(f"out of GPU memory while {what}: {first_line(exc)}",
                          "use smaller batches (--batch-size), fewer (--batches), or --device cpu") from None
