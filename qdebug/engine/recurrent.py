"""Recurrent layers as deployments run them: ``QLSTM``, ``QGRU``, ``QLSTMCell``, ``QGRUCell``.

``prepare`` swaps ``nn.LSTM``/``nn.GRU``/``nn.LSTMCell``/``nn.GRUCell`` (not subclasses with
a forward of their own) for these.  Each *is* the torch layer (a subclass; same parameters,
same names: ``weight_ih_l0``, ``bias_hh_l1_reverse``, ``weight_hr_l0``, ... so a float state
dict loads unchanged) plus quant points at the places torch.ao's quantizable LSTM observes,
in the same order of operations (``torch/ao/nn/quantizable/modules/rnn.py``).  Per layer k
and direction (``l{k}``, ``l{k}_reverse``; a cell has no prefix), one LSTM step is::

    igates      = x_t W_ih^T + b_ih                   (W_ih fake-quantized per gate row)
    hgates      = h W_hh^T + b_hh                     (W_hh likewise)
    gates       = igates + hgates
    input_gate  = sigmoid(gates[0:H])     forget_gate = sigmoid(gates[H:2H])
    cell_gate   = tanh(gates[2H:3H])      output_gate = sigmoid(gates[3H:4H])
    fgate_cx    = forget_gate * c                     (int16)
    igate_cgate = input_gate * cell_gate              (int16)
    cell        = fgate_cx + igate_cgate              (torch.ao: fgate_cx_igate_cgate; int16)
    hidden      = output_gate * tanh(cell)            (torch.ao: ogate_cy; tanh(cell) unquantized)
    projection  = hidden W_hr^T                       (proj_size only; torch.ao has none)

each left-hand side quantized by its point ``<layer path>.l{k}[_reverse].<name>``; weights
are points ``<layer path>.weight_ih_l{k}`` etc.  The cell state's points -- ``cell`` and the two
products it adds, ``fgate_cx`` (f * c spans c's range) and ``igate_cgate`` -- default to 16 bits
(the qconfig's activation spec with ``bits = 16``), as torch.ao's docs and NPU toolchains
recommend (torch.ao's ``_get_lstm_with_individually_observed_parts`` gives these three its
cell-state observer; TFLite's integer LSTM computes both products onto the int16 cell grid):
c's range (tens to hundreds) would leave an int8 grid far too coarse, and an int8 f * c would
undo an int16 cell.  Any
override matching the point (or the layer) changes it.  A GRU step (torch has no
quantizable GRU; the order of ATen's ``GRUCell``)::

    igates, hgates as above (3H rows)
    gates       = igates[0:2H] + hgates[0:2H]
    reset_gate  = sigmoid(gates[0:H])     update_gate = sigmoid(gates[H:2H])
    rgate_hn    = reset_gate * hgates[2H:3H]
    new_gates   = igates[2H:3H] + rgate_hn
    new_gate    = tanh(new_gates)
    hdiff       = h - new_gate
    update      = update_gate * hdiff
    hidden      = new_gate + update

Dynamic GEMM inputs (torch's ``quantize_dynamic`` LSTM/GRU, ``nnqd.LSTM``): two more points
per layer and direction, made only when the spec a qconfig gives them is ``dynamic`` (no
default qconfig makes them; an override naming them does)::

    input       the layer's whole input sequence, quantized once per call (one grid for all
                steps) before the x W_ih^T GEMM of every step
    h           each step's hidden state, quantized (a grid of its own per step) before h W_hh^T

so a step's GEMMs read fq(x) and fq(h) while h, c and the gates stay as computed, as
``torch.quantized_lstm`` does (a float emulation of it with these two grids agrees with
torch's within float rounding).

Initial states are used as given (zeros when absent), unquantized, as torch.ao does.  When
every point of a layer is in float mode the layer runs torch's own kernel, so float mode is
bit-identical to ``nn.LSTM``/``nn.GRU`` (a step-by-step loop is not: the fused kernel rounds
the gate sums differently in the last bit).  Otherwise the loop above runs, one step at a
time as torch.ao's does (observers see each step; the arithmetic is torch.ao's to the bit).
The quantized stage runs the same fake-quant arithmetic: an integer LSTM kernel is future work.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import PackedSequence

from qdebug.engine.ops import register_module_category
from qdebug.engine.point import QuantPoint, tag
from qdebug.engine.spec import QConfig, QuantSpec, _refined
from qdebug.errors import QDebugError

CELL_STATE_BITS = 16
CELL_STATE_POINTS = ("fgate_cx", "igate_cgate", "cell")  # on the cell state's grid: int16 by default
LSTM_STEP_POINTS = ("igates", "hgates", "gates", "input_gate", "forget_gate", "cell_gate", "output_gate",
                    "fgate_cx", "igate_cgate", "cell", "hidden")
GRU_STEP_POINTS = ("igates", "hgates", "gates", "reset_gate", "update_gate", "rgate_hn", "new_gates", "new_gate",
                   "hdiff", "update", "hidden")
GEMM_INPUT_POINTS = ("input", "h")  # dynamic only (module docstring)


def activation_spec_from(qconfig: QConfig, base: QuantSpec, names: tuple[str, ...]) -> QuantSpec | None:
    """``QConfig.spec_for("activation", names)`` cascading from ``base`` instead of the default."""
    spec: QuantSpec | None = base
    for glob in qconfig.matching_globs(names):
        entry = qconfig.overrides[glob]
        if "activation" not in entry:
            continue
        spec = None if entry["activation"] is None else _refined(spec or base, entry["activation"])
    return spec


class RecurrentLayer:
    """Shared by the four layers: the points (held outside the module tree, like QConv's weight
    point, so the state dict keeps torch's keys) and their creation."""

    def _init_points(self) -> None:
        object.__setattr__(self, "qpoints", {})  # local name ("l0.cell", "weight_ih_l0") -> point
        self.stage = "fake"

    def _directions(self) -> list[str]:
        """Step-point prefixes and weight-name suffixes: ("l0", "_l0"), ... (cells: ("", ""))."""
        raise NotImplementedError

    def step_point_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def weight_names(self) -> list[str]:
        return [name for name, _ in self.named_parameters(recurse=False) if name.startswith("weight_")]

    def attach_points(self, path: str, qconfig: QConfig, add_point: Callable[[QuantPoint], None]) -> list[tuple]:
        """Create this layer's points (named under ``path``) with ``add_point``; returns the name
        tuples the qconfig's globs were matched against (prepare checks every glob matched one)."""
        used: list[tuple] = []
        op = type(self).__mro__[1].__name__  # "LSTM", "GRUCell", ...
        for prefix in self._directions():  # direction by direction: weights, then the step's points
            for weight in self.weight_names():
                if prefix and not weight.endswith(f"_{prefix}"):
                    continue
                names = (path, f"{path}.{weight}")
                used.append(names)
                spec = qconfig.spec_for("weight", names)
                if spec is not None:
                    point = QuantPoint(f"{path}.{weight}", "weight", spec, op=op, owner=path)
                    self.qpoints[weight] = point
                    add_point(point)
            for gemm in GEMM_INPUT_POINTS:  # opt-in: only a dynamic spec makes them
                local = f"{prefix}.{gemm}" if prefix else gemm
                names = (path, f"{path}.{local}")
                used.append(names)
                spec = activation_spec_from(qconfig, qconfig.activation, names)
                if spec is not None and spec.dynamic:
                    point = QuantPoint(f"{path}.{local}", "activation", spec, op=f"{op}.{gemm}", owner=path)
                    self.qpoints[local] = point
                    add_point(point)
            for step in self.step_point_names():
                local = f"{prefix}.{step}" if prefix else step
                names = (path, f"{path}.{local}")
                used.append(names)
                base = qconfig.activation
                if step in CELL_STATE_POINTS and isinstance(self, (QLSTM, QLSTMCell)):
                    base = base.replace(bits=CELL_STATE_BITS)
                spec = activation_spec_from(qconfig, base, names)
                if spec is not None:
                    point = QuantPoint(f"{path}.{local}", "activation", spec, op=f"{op}.{step}", owner=path)
                    self.qpoints[local] = point
                    add_point(point)
        return used

    def refresh_weight_qparams(self, *, calibrating: bool = False) -> None:
        """Recompute the dynamic weight points' qparams from the current weights now (QConv's
        rule: frozen and learned scales are kept; at calibration a frozen one is refreshed too,
        a learned one only until it is initialised)."""
        for name, point in self.qpoints.items():
            if point.kind != "weight":
                continue
            point.forget_cached()
            learned = point.spec.learnable_scale and point.initialized
            if learned or (point.frozen and point.initialized and not calibrating):
                continue
            with torch.no_grad():
                point.compute_from(getattr(self, name))

    def _all_float(self) -> bool:
        # While ``step_values`` records, the loop runs even in float (the fused kernel has no steps).
        return self.__dict__.get("_step_trace") is None and all(p.mode == "float" for p in self.qpoints.values())

    def _q(self, local: str, x: torch.Tensor) -> torch.Tensor:
        point = self.qpoints.get(local)
        y = x if point is None else point.apply(x)
        trace = self.__dict__.get("_step_trace")
        return y if trace is None else trace(local, x, y)

    def _w(self, name: str) -> torch.Tensor:
        weight = getattr(self, name)
        point = self.qpoints.get(name)
        if point is None:
            return weight
        key = (id(weight), weight._version, weight.device)
        cached = point.cached_weight(key)
        return cached if cached is not None else point.apply(weight, cache_key=key)

    def _b(self, name: str) -> torch.Tensor | None:
        return getattr(self, name) if self.bias else None

    def _gemm_input(self, local: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` as a GEMM reads it: on its dynamic point's grid when it has one, else as it is."""
        point = self.qpoints.get(local)
        return x if point is None else point.apply(x)

    def _point(self, local: str) -> QuantPoint | None:
        return self.qpoints.get(local)


def _refuse_packed(x: Any) -> None:
    if isinstance(x, PackedSequence):
        raise QDebugError("a PackedSequence cannot run through a quantized recurrent layer",
                          "pad the batch (torch.nn.utils.rnn.pad_packed_sequence) or keep the layer in float")


class _QRNN(RecurrentLayer):
    """The sequence loop shared by QLSTM and QGRU (torch.ao's ``_LSTMLayer``/``LSTM`` order)."""

    _float_forward: Callable

    def _directions(self) -> list[str]:
        return [f"l{k}{suffix}" for k in range(self.num_layers)
                for suffix in ("", "_reverse")[: 2 if self.bidirectional else 1]]

    def forward(self, input, hx=None):  # noqa: A002 (torch's argument name)
        if self._all_float():
            return self._float_forward(input, hx)
        _refuse_packed(input)
        unbatched = input.dim() == 2
        x = input.unsqueeze(1) if unbatched else (input.transpose(0, 1) if self.batch_first else input)
        states = self._initial_states(x, hx, unbatched)
        directions = 2 if self.bidirectional else 1
        finals: list[tuple] = []
        last_grid = None
        for layer in range(self.num_layers):
            outputs = []
            for d in range(directions):
                index = layer * directions + d
                prefix = f"l{layer}" + ("_reverse" if d else "")
                seq = x.flip(0) if d else x
                out, final = self._run_direction(seq, tuple(s[index] for s in states), f"_{prefix}", prefix)
                outputs.append(out.flip(0) if d else out)
                finals.append(final)
            x = torch.cat(outputs, -1) if directions == 2 else outputs[0]
            last_grid = self._point(self._output_point_name(f"l{layer}")) if directions == 1 else None
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout, True)
                last_grid = None
        if self.batch_first and not unbatched:
            x = x.transpose(0, 1)
        finals_stacked = tuple(torch.stack([f[i] for f in finals], 0) for i in range(len(finals[0])))
        if unbatched:
            x = x.squeeze(1)
            finals_stacked = tuple(f.squeeze(1) for f in finals_stacked)
        if last_grid is not None and last_grid.mode == "fake":
            tag(x, last_grid)  # lets integer consumers find the grid the output lies on
        return x, (finals_stacked if len(finals_stacked) > 1 else finals_stacked[0])

    def _output_point_name(self, prefix: str) -> str:
        return f"{prefix}.hidden"

    def _initial_states(self, x: torch.Tensor, hx: Any, unbatched: bool) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _run_direction(self, seq, state, suffix: str, prefix: str):
        w_ih, w_hh = self._w(f"weight_ih{suffix}"), self._w(f"weight_hh{suffix}")
        b_ih, b_hh = self._b(f"bias_ih{suffix}"), self._b(f"bias_hh{suffix}")
        extra = self._extra_weights(suffix)
        seq = self._gemm_input(f"{prefix}.input", seq)  # one grid for the whole sequence
        outputs = []
        for t in range(seq.shape[0]):
            state = self._step(prefix, seq[t], state, w_ih, w_hh, b_ih, b_hh, extra)
            outputs.append(state[0])
        return torch.stack(outputs, 0), state

    def _extra_weights(self, suffix: str) -> Any:
        return None


def _lstm_step(m: RecurrentLayer, prefix: str, x, state, w_ih, w_hh, b_ih, b_hh, w_hr=None):
    """One LSTM step, torch.ao's quantizable LSTMCell op for op (see module docstring)."""
    h, c = state
    p = f"{prefix}." if prefix else ""
    igates = m._q(p + "igates", F.linear(x, w_ih, b_ih))
    hgates = m._q(p + "hgates", F.linear(m._gemm_input(p + "h", h), w_hh, b_hh))
    gates = m._q(p + "gates", torch.add(igates, hgates))
    i, f, g, o = gates.chunk(4, -1)
    i = m._q(p + "input_gate", torch.sigmoid(i))
    f = m._q(p + "forget_gate", torch.sigmoid(f))
    g = m._q(p + "cell_gate", torch.tanh(g))
    o = m._q(p + "output_gate", torch.sigmoid(o))
    fgate_cx = m._q(p + "fgate_cx", torch.mul(f, c))
    igate_cgate = m._q(p + "igate_cgate", torch.mul(i, g))
    c = m._q(p + "cell", torch.add(fgate_cx, igate_cgate))
    h = m._q(p + "hidden", torch.mul(o, torch.tanh(c)))
    if w_hr is not None:
        h = m._q(p + "projection", F.linear(h, w_hr))
    return h, c


def _gru_step(m: RecurrentLayer, prefix: str, x, h, w_ih, w_hh, b_ih, b_hh):
    """One GRU step in ATen's GRUCell order (see module docstring)."""
    p = f"{prefix}." if prefix else ""
    igates = m._q(p + "igates", F.linear(x, w_ih, b_ih))
    hgates = m._q(p + "hgates", F.linear(m._gemm_input(p + "h", h), w_hh, b_hh))
    i_rz, i_n = igates.split([2 * m.hidden_size, m.hidden_size], -1)
    h_rz, h_n = hgates.split([2 * m.hidden_size, m.hidden_size], -1)
    gates = m._q(p + "gates", torch.add(i_rz, h_rz))
    r, z = gates.chunk(2, -1)
    r = m._q(p + "reset_gate", torch.sigmoid(r))
    z = m._q(p + "update_gate", torch.sigmoid(z))
    rgate_hn = m._q(p + "rgate_hn", torch.mul(r, h_n))
    n = m._q(p + "new_gate", torch.tanh(m._q(p + "new_gates", torch.add(i_n, rgate_hn))))
    hdiff = m._q(p + "hdiff", torch.sub(h, n))
    update = m._q(p + "update", torch.mul(z, hdiff))
    return m._q(p + "hidden", torch.add(n, update))


class QLSTM(_QRNN, nn.LSTM):
    """``nn.LSTM`` with quant points (see module docstring)."""

    _float_forward = nn.LSTM.forward

    def step_point_names(self) -> tuple[str, ...]:
        return LSTM_STEP_POINTS + (("projection",) if self.proj_size else ())

    def _output_point_name(self, prefix: str) -> str:
        return f"{prefix}.projection" if self.proj_size else f"{prefix}.hidden"

    def _initial_states(self, x, hx, unbatched):
        directions = 2 if self.bidirectional else 1
        real_hidden = self.proj_size or self.hidden_size
        if hx is None:
            zeros = torch.zeros(self.num_layers * directions, x.shape[1], real_hidden, dtype=x.dtype, device=x.device)
            cell = torch.zeros(self.num_layers * directions, x.shape[1], self.hidden_size, dtype=x.dtype,
                               device=x.device)
            return zeros, cell
        h0, c0 = hx
        return (h0.unsqueeze(1), c0.unsqueeze(1)) if unbatched else (h0, c0)

    def _extra_weights(self, suffix):
        return self._w(f"weight_hr{suffix}") if self.proj_size else None

    def _step(self, prefix, x, state, w_ih, w_hh, b_ih, b_hh, w_hr):
        return _lstm_step(self, prefix, x, state, w_ih, w_hh, b_ih, b_hh, w_hr)


class QGRU(_QRNN, nn.GRU):
    """``nn.GRU`` with quant points (see module docstring)."""

    _float_forward = nn.GRU.forward

    def step_point_names(self) -> tuple[str, ...]:
        return GRU_STEP_POINTS

    def _initial_states(self, x, hx, unbatched):
        directions = 2 if self.bidirectional else 1
        if hx is None:
            return (torch.zeros(self.num_layers * directions, x.shape[1], self.hidden_size, dtype=x.dtype,
                                device=x.device),)
        return (hx.unsqueeze(1) if unbatched else hx,)

    def _step(self, prefix, x, state, w_ih, w_hh, b_ih, b_hh, extra):
        return (_gru_step(self, prefix, x, state[0], w_ih, w_hh, b_ih, b_hh),)


class QLSTMCell(RecurrentLayer, nn.LSTMCell):
    """``nn.LSTMCell`` with quant points (named ``<path>.igates``, ...: no layer prefix)."""

    def _directions(self) -> list[str]:
        return [""]

    def step_point_names(self) -> tuple[str, ...]:
        return LSTM_STEP_POINTS

    def forward(self, input, hx=None):  # noqa: A002
        if self._all_float():
            return nn.LSTMCell.forward(self, input, hx)
        unbatched = input.dim() == 1
        x = input.unsqueeze(0) if unbatched else input
        if hx is None:
            zeros = torch.zeros(x.shape[0], self.hidden_size, dtype=x.dtype, device=x.device)
            hx = (zeros, zeros)
        elif unbatched:
            hx = (hx[0].unsqueeze(0), hx[1].unsqueeze(0))
        h, c = _lstm_step(self, "", self._gemm_input("input", x), hx, self._w("weight_ih"), self._w("weight_hh"),
                          self._b("bias_ih"), self._b("bias_hh"))
        return (h.squeeze(0), c.squeeze(0)) if unbatched else (h, c)


class QGRUCell(RecurrentLayer, nn.GRUCell):
    """``nn.GRUCell`` with quant points (named ``<path>.igates``, ...: no layer prefix)."""

    def _directions(self) -> list[str]:
        return [""]

    def step_point_names(self) -> tuple[str, ...]:
        return GRU_STEP_POINTS

    def forward(self, input, hx=None):  # noqa: A002
        if self._all_float():
            return nn.GRUCell.forward(self, input, hx)
        unbatched = input.dim() == 1
        x = input.unsqueeze(0) if unbatched else input
        if hx is None:
            hx = torch.zeros(x.shape[0], self.hidden_size, dtype=x.dtype, device=x.device)
        elif unbatched:
            hx = hx.unsqueeze(0)
        h = _gru_step(self, "", self._gemm_input("input", x), hx, self._w("weight_ih"), self._w("weight_hh"),
                      self._b("bias_ih"), self._b("bias_hh"))
        return h.squeeze(0) if unbatched else h


RECURRENT_CLASSES: dict[type, type] = {nn.LSTM: QLSTM, nn.GRU: QGRU, nn.LSTMCell: QLSTMCell, nn.GRUCell: QGRUCell}


def quantizable_recurrent(module: nn.Module) -> nn.Module | None:
    """The engine's recurrent layer standing for ``module`` (same parameters, same state dict),
    or None when it is no LSTM/GRU or a subclass with a forward of its own (a float fallback)."""
    for base, cls in RECURRENT_CLASSES.items():
        if isinstance(module, base) and not isinstance(module, cls) and type(module).forward is base.forward:
            new = cls.__new__(cls)
            new.__dict__.update(module.__dict__)
            new._init_points()
            return new
    return None


def step_names(module: nn.Module) -> list[str] | None:
    """The local names of ``module``'s step points in execution order (``l0.igates``, ...,
    ``l0_reverse.hidden``, ``l1.igates``; a cell's without prefix), whether it is one of these
    layers or the torch layer prepare would swap for one; None for any other module."""
    layer = module if isinstance(module, RecurrentLayer) else quantizable_recurrent(module)
    if layer is None:
        return None
    return [f"{prefix}.{step}" if prefix else step for prefix in layer._directions() for step in layer.step_point_names()]


def step_values(module: nn.Module, args: tuple, kwargs: dict | None = None, *,
                teacher: dict[str, torch.Tensor] | None = None
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    """Every step point's tensor in one call of ``module`` on ``args``, stacked over the steps
    in the order they run (``[T, batch, ...]``; a reverse direction's from its last step; a
    cell's ``T`` is 1), by local name (``step_names``): (values after each point, values before
    it).  None for a module that is no LSTM/GRU (cell) this file runs, or a PackedSequence
    input.  A torch layer runs this file's loop without points (its float function); one of
    these layers with its points as they are set (a point in ``observe`` mode observes).

    ``teacher``: another run's values by local name.  Each point's output is recorded, then
    the teacher's tensor of that step flows on in its place, so every op reads the teacher's
    operands: the recorded values are each point's own error alone (its op, its weights' and
    its own quantization) on the teacher's inputs -- compare's isolated error, step by step."""
    layer = module if isinstance(module, RecurrentLayer) else quantizable_recurrent(module)
    if layer is None or any(isinstance(a, PackedSequence) for a in args):
        return None
    seen: dict[str, list[torch.Tensor]] = {}
    before: dict[str, list[torch.Tensor]] = {}

    def record(local: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        steps = seen.setdefault(local, [])
        steps.append(y.detach())
        before.setdefault(local, []).append(x.detach())
        if teacher is None or local not in teacher or len(steps) > teacher[local].shape[0]:
            return y
        taught = teacher[local][len(steps) - 1]
        return taught if taught.shape == y.shape else y

    object.__setattr__(layer, "_step_trace", record)
    try:
        with torch.no_grad():
            layer(*args, **(kwargs or {}))
    finally:
        object.__delattr__(layer, "_step_trace")
    return ({local: torch.stack(steps) for local, steps in seen.items()},
            {local: torch.stack(steps) for local, steps in before.items()})


def is_recurrent_layer(module: nn.Module) -> bool:
    """An LSTM/GRU (cell) that prepare swaps for one of these layers."""
    return any(isinstance(module, base) and type(module).forward is base.forward for base in RECURRENT_CLASSES)


for _cls in RECURRENT_CLASSES.values():
    register_module_category(_cls, "recurrent")
