"""``[FLOAT] CHECKPOINT``: the arguments of the commands that experiment on one quantized
checkpoint against its float model (step, suggest), checked and loaded one way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from qdebug.cli.common import STATE, load_checkpoint
from qdebug.errors import QDebugError


@dataclass
class AgainstFloat:
    paths: list[str]  # as given, or from the config
    model: Any  # the prepared model experimented on
    info: Any  # its CheckpointInfo
    reference: Any = None  # the float model, when FLOAT was given
    reference_info: Any = None


def checkpoint_paths(given: list[str], command: str) -> list[str]:
    """The paths given, else the config's ``float`` and its checkpoint under test (``DEBUG_ORDER``:
    ``qat``, else ``calibrated``, else ``quantized``)."""
    from qdebug.config.project import DEBUG_ORDER

    paths = list(given)
    if not paths:
        cfg = STATE.config()
        keys = cfg.stage_pair(DEBUG_ORDER)  # the same table as compare's and the Python API's
        paths = [cfg.get(key) for key in keys if key]
    if not paths:
        raise QDebugError(f"{command} needs a checkpoint", f"e.g. qdebug {command} float.pt calibrated.pt "
                          "(or set float and calibrated/qat in qdebug.toml)")
    if len(paths) > 2:
        raise QDebugError(f"{command} takes one or two checkpoints, got {len(paths)}", "give [FLOAT] CHECKPOINT")
    return paths


def load_against_float(paths: list[str], *, model: Optional[str], unsafe: bool, command: str) -> AgainstFloat:
    """Load ``[FLOAT] CHECKPOINT``: the last a prepared (calibrated, QAT, quantized) model, the
    first, when given, the float checkpoint of the same model."""
    from qdebug.engine import is_prepared

    loaded = [load_checkpoint(p, model=model, unsafe=unsafe, command=command) for p in paths]
    net, info = loaded[-1]
    if info.stage == "float" and len(loaded) == 2 and loaded[0][1].stage != "float":
        raise QDebugError(f"{paths[1]} is the float checkpoint: it goes first", f"qdebug {command} {paths[1]} {paths[0]} ...")
    if info.stage == "float":
        raise QDebugError(f"{paths[-1]} is a float checkpoint: there is nothing to {command}",
                          f"give a calibrated, QAT or quantized checkpoint (last), e.g. qdebug {command} float.pt "
                          "calibrated.pt")
    found = AgainstFloat(paths, net, info)
    if len(loaded) == 2:
        found.reference, found.reference_info = loaded[0]
        if found.reference_info.stage != "float":
            raise QDebugError(f"{paths[0]} is a {found.reference_info.stage} checkpoint, not the float model",
                              "give FLOAT first, or the checkpoint alone (its float run is then the reference)")
        ref_spec, spec = found.reference_info.model, info.model
        if ref_spec.target != spec.target or ref_spec.kwargs != spec.kwargs:
            raise QDebugError(f"{paths[0]} and {paths[1]} are not the same model ({ref_spec.target} vs {spec.target})",
                              f"{command} a checkpoint against the float checkpoint it came from")
    if not is_prepared(net):
        raise QDebugError(f"{paths[-1]} holds no quantized model", "give a calibrated, QAT or quantized checkpoint")
    return found
