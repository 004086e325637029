"""The engine state a prepared model carries, and how to reach it: ``engine_state``, ``is_prepared``.

``prepare`` attaches an ``EngineState`` (``qdebug.engine.prepare``) to the model under
``STATE_ATTR``; every part of the engine that works on a prepared model (convert, the
arithmetic switch, served calls, export) reaches it here, without depending on ``prepare``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn

from qdebug.errors import QDebugError

if TYPE_CHECKING:
    from qdebug.engine.prepare import EngineState

STATE_ATTR = "_qdebug_state"


def engine_state(model: nn.Module) -> EngineState:
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise QDebugError("this model is not prepared by qdebug", "call qdebug.engine.prepare(model, ...) first")
    return state


def is_prepared(model: nn.Module) -> bool:
    return getattr(model, STATE_ATTR, None) is not None
