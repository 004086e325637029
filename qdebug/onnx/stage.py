"""An ONNX model run by ONNX Runtime, as a stage of ``compare``: ``OnnxStage``.

``OnnxStage`` owns running an ONNX model as it is deployed -- ONNX Runtime's CPU execution
provider, default graph optimizations (its QDQ fusions: QLinearConv, QLinearAdd, QGemm ...) --
and tapping it per layer under the reference model's call names, so ``compare`` puts the
deployed numbers next to QAT's row for row, as ``qdebug.interop.torch_stage.TorchStage`` does
for torch's own kernels.

**Which tensor is which row.**  qdebug's own export (metadata ``qdebug.export``) names its
rows: each activation point P's value is the tensor ``P/quantized`` (its QuantizeLinear's
output), row = the point's ``row``.  Any other model (torch's exporter, then ONNX Runtime's
``quantize_static``) is read by ``qdebug.onnx.names.map_tensors``: torch's scope names.  Every
tensor that matches no layer, and every metadata point whose tensor is missing, is listed
(``unmatched``; ``stage_report``), never dropped.  A call with no tensor of its own gets a note:
the exporter folded a BN into its conv, ONNX Runtime runs a ReLU inside the conv's kernel, or the
call is not in the graph.

**How a tensor is tapped (the numerical trap).**  A tensor is read by making it a graph output,
and a graph output changes what ONNX Runtime's optimizer may do: a DequantizeLinear whose output
is a graph output is not fused, a float tensor a fused kernel would keep inside is not, and on
x86 an int8 QuantizeLinear -> DequantizeLinear pair whose codes have a second reader is no
longer converted to uint8 (``QDQS8ToU8Transformer``), so the QLinearConv fusions after it are
lost and the tapped model computes in float -- not the deployed numbers.  So a row's value is

- the graph output itself, when the tensor (or the DequantizeLinear of its codes) is one;
- else the integer codes, the output of the QuantizeLinear reading the tensor -- what the next
  layer reads, and what the fused kernels still produce -- dequantized here with the
  DequantizeLinear's own scale and zero point, ``(q - z) * s`` in float32 as ONNX Runtime does;
  on x86 an int8 pair that ONNX Runtime would convert to uint8 is converted before it is tapped
  (codes + 128, zero point + 128: the same integers, ``_to_uint8``), so the conversion and the
  fusions after it still happen;
- else the float tensor itself (``float_taps``: the report says so).

Each tapped run is checked against the untapped session (the deployed model) on the same
batch: the model's outputs must agree bit for bit (``tap_check`` in the report, a summary line
when they do not).

Only the propagated error is measured (``propagated_only``): the isolated columns replay one
layer of qdebug's engine, which ONNX Runtime is not.  Sessions are made from the bytes of the
(checked) ModelProto, never from a path named inside a file.
"""

from __future__ import annotations

import copy
import json
import platform
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from qdebug.engine.context import Event, split_inputs
from qdebug.engine.ops import map_tensors, tensors_in
from qdebug.errors import QDebugError
from qdebug.measure.tap import ReportsCalls
from qdebug.onnx.model_file import first_line, require, tensor_array
from qdebug.onnx.session import cpu_session
from qdebug.safe_text import one_line

PROPAGATED_ONLY = ("ONNX Runtime: propagated error only (the isolated columns are blank: compare replays a layer "
                   "alone only on qdebug's engine)")
METADATA_KEY = "qdebug.export"  # qdebug's own export (docs/onnx.md, "Export")
SHOWN_UNMATCHED = 3  # tensors named in the summary line; the JSON report lists them all


@dataclass
class Tap:
    """How one row is read: ``tensor`` made a graph output (or one already), dequantized
    ``(q - zero_point) * scale`` along ``axis`` when ``scale`` is set, else taken as it is."""

    tensor: str
    source: str  # the model's tensor the row is (before any QuantizeLinear)
    how: str  # "output" (the graph returns it), "codes" (a QuantizeLinear's), "float" (a float tensor)
    scale: Any = None
    zero_point: Any = None
    axis: int = 1

    def value(self, array: Any) -> torch.Tensor:
        import numpy as np

        if self.scale is None:
            return torch.from_numpy(np.asarray(array, dtype=np.float32).copy())
        shape = [1] * array.ndim
        scale, zero_point = self.scale, self.zero_point
        if scale.ndim == 1 and scale.size > 1:  # per axis
            shape[self.axis % array.ndim] = scale.size
            scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
        codes = array.astype(np.int32) - zero_point.astype(np.int32)
        return torch.from_numpy((codes.astype(np.float32) * scale.astype(np.float32)).astype(np.float32))


class OnnxStage(ReportsCalls, nn.Module):
    """``model`` (an ``onnx.ModelProto``, e.g. ``read_onnx(path)``) run by ONNX Runtime, tapped per
    layer under ``reference``'s call names (module docstring).

    ``reference``: the float model, or a prepared one (its plan names the rows); ``example_inputs``:
    one batch, to name the layers now (else the first forward does; ``compare`` gives its reference
    and its first batch).  ``source``: the file's name, for messages.
    """

    stage = "quantized"
    propagated_only = PROPAGATED_ONLY
    runner = "ONNX Runtime"

    def __init__(self, model: Any, reference: nn.Module | None = None, example_inputs: Any = None, *,
                 source: str = "the ONNX model"):
        super().__init__()
        onnx = require("onnx")
        if not isinstance(model, onnx.ModelProto):
            raise QDebugError(f"OnnxStage runs an onnx.ModelProto, not a {type(model).__name__}",
                              "read the file with qdebug.onnx.model_file.read_onnx(path)")
        object.__setattr__(self, "proto", model)  # protobuf, not a module: kept out of the tree
        object.__setattr__(self, "reference", reference)  # only read, to name the rows
        self.source = one_line(source, limit=200)
        self.taps: dict[str, Tap] | None = None  # row -> how it is read
        self.row_notes: dict[str, str] = {}
        self.unmatched: list[tuple[str, str]] = []  # (tensor, why)
        self.float_taps: list[str] = []  # rows tapped as float tensors (no QuantizeLinear reads them)
        self.tap_check = {"batches": 0, "outputs_equal": True, "values_differ": 0, "max_abs_diff": 0.0}
        self._calls: dict[str, tuple[str, str, str]] = {}
        self._listeners: list[Callable[[Event], None]] = []
        self._tapped_session = None
        self._outputs_of_tapped: list[str] = []
        self._inputs = _graph_inputs(model)
        self._outputs = [o.name for o in model.graph.output]
        self._session = self._new_session(model)
        if reference is not None and example_inputs is not None:
            self.name_layers(example_inputs)

    def use_reference(self, reference: nn.Module) -> None:
        """Name the rows after ``reference``'s calls (kept out of this module's tree)."""
        object.__setattr__(self, "reference", reference)

    # -- naming ---------------------------------------------------------------------------------
    def name_layers(self, example_inputs: Any) -> None:
        """Which tensor is which row of the reference's plan, and how each is tapped."""
        if self.reference is None:
            raise QDebugError(f"{self.source}: an ONNX stage needs the model it is compared with to name its layers",
                              "compare it against its float model (the reference), or pass "
                              "OnnxStage(proto, reference=model, example_inputs=batch)")
        plan, modules_of = _plan(self.reference, example_inputs)
        sources, unmatched = self._sources(plan, modules_of)
        graph = TapIndex(self.proto)
        taps: dict[str, Tap] = {}
        for row, tensor in sources.items():
            tap = graph.tap(tensor)
            if tap is None:
                unmatched.append((tensor, "its QuantizeLinear's scale or zero point is no initializer"))
                continue
            if tap.how == "float":
                self.float_taps.append(row)
            taps[row] = tap
            rec = plan.calls[row]
            self._calls[row] = (rec.category, rec.op, rec.owner)
        self.taps, self.unmatched = taps, unmatched
        self.row_notes = _notes(plan, set(taps))
        tapped = graph.tapped_model(list(taps.values()))
        object.__setattr__(self, "tapped_proto", tapped)  # what the tapped session runs (tests read it)
        self._outputs_of_tapped = [o.name for o in tapped.graph.output]
        self._tapped_session = self._new_session(tapped)

    def _sources(self, plan: Any, modules_of: nn.Module) -> tuple[dict[str, str], list[tuple[str, str]]]:
        """row -> the model's tensor carrying it, and the unmatched tensors."""
        points = _export_points(self.proto, self.source)
        unmatched: list[tuple[str, str]] = []
        found: list[tuple[str, str]] = []  # (tensor, row)
        if points:  # qdebug's own export: the metadata names every activation point's row
            made = {out for node in self.proto.graph.node for out in node.output}
            for point in points:
                tensor = f"{point['name']}/quantized"
                if tensor not in made:
                    unmatched.append((tensor, f"quant point {point['name']} of the {METADATA_KEY} metadata: "
                                              "its tensor is not in the graph"))
                elif point["row"] not in plan.calls:
                    unmatched.append((tensor, f"its row {point['row']} is no call of the reference model"))
                else:
                    found.append((tensor, point["row"]))
        else:
            from qdebug.onnx.names import map_tensors as map_names

            mapped = map_names(self.proto, plan, modules_of)
            unmatched.extend(mapped.unmatched)
            found.extend(mapped.rows.items())
        sources: dict[str, str] = {}
        for tensor, row in found:
            if row in sources:
                unmatched.append((tensor, f"row {row} is carried by {sources[row]} already"))
            else:
                sources[row] = tensor
        return sources, unmatched

    # -- running ----------------------------------------------------------------------------------
    def _new_session(self, model: Any) -> Any:
        return cpu_session(model, self.source, "check the model with onnx.checker and ONNX Runtime's own "
                           "InferenceSession")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device = next((t.device for t in tensors_in((args, kwargs))), None)
        feeds = self._feeds(args, kwargs)
        outputs = self._run(self._session, None, feeds)
        if self._listeners:
            for row, y in self._taps(feeds, outputs).items():
                self._emit(row, y if device is None else y.to(device))
        result = [torch.from_numpy(_float_array(outputs[name])) for name in self._outputs]
        if device is not None:
            result = [t.to(device) for t in result]
        return result[0] if len(result) == 1 else tuple(result)

    def tapped(self, inputs: Any) -> dict[str, torch.Tensor]:
        """Row -> ONNX Runtime's value there (dequantized), for one batch (a tensor, a tuple of
        args or a dict of kwargs)."""
        args, kwargs = split_inputs(inputs)
        feeds = self._feeds(args, kwargs)
        return self._taps(feeds, self._run(self._session, None, feeds))

    def _taps(self, feeds: dict, deployed: dict) -> dict[str, torch.Tensor]:
        if self.taps is None:
            self.name_layers(_as_inputs(feeds, self._inputs))
        found = self._run(self._tapped_session, self._outputs_of_tapped, feeds)
        self._check(deployed, found)
        taps = {}
        for row, tap in self.taps.items():
            array = deployed[tap.tensor] if tap.tensor in deployed else found[tap.tensor]
            taps[row] = tap.value(array)
        return taps

    def _check(self, deployed: dict, tapped: dict) -> None:
        """The tapped run's model outputs against the deployed run's: bit for bit, or counted."""
        import numpy as np

        check = self.tap_check
        check["batches"] += 1
        for name in self._outputs:
            a, b = np.asarray(deployed[name]), np.asarray(tapped[name])
            if a.shape != b.shape or not np.array_equal(a, b, equal_nan=a.dtype.kind == "f"):
                check["outputs_equal"] = False
                if a.shape == b.shape:
                    differ = a != b
                    check["values_differ"] += int(differ.sum())
                    gap = np.abs(a[differ].astype(np.float64) - b[differ].astype(np.float64))
                    check["max_abs_diff"] = max(check["max_abs_diff"], float(np.nanmax(gap)) if gap.size else 0.0)

    def _run(self, session: Any, names: list[str] | None, feeds: dict) -> dict[str, Any]:
        try:
            values = session.run(names, feeds)
        except Exception as exc:
            raise QDebugError(f"ONNX Runtime failed to run {self.source}: {first_line(exc)}",
                              "check the inputs against the model's (shapes, types)") from None
        got = names if names is not None else [o.name for o in session.get_outputs()]
        return dict(zip(got, values))

    def _feeds(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The graph's non-initializer inputs, in order, from one batch: float32 (the declared
        type) numpy arrays on the CPU, their shapes checked against the declared ones."""
        names = [name for name, _, _ in self._inputs]
        if kwargs and not args and set(kwargs) == set(names):
            values = [kwargs[name] for name in names]
        elif kwargs:
            raise QDebugError(f"{self.source} takes inputs {names}, got keyword inputs {sorted(kwargs)}",
                              "pass its inputs as one tensor, a tuple of them, or a dict by the graph's input names")
        else:
            values = list(args)
        if len(values) != len(names):
            raise QDebugError(f"{self.source} takes {len(names)} input(s) ({', '.join(names)}), got {len(values)}",
                              "pass data whose batches are the model's inputs, in the graph's order")
        feeds = {}
        for (name, dtype, shape), value in zip(self._inputs, values):
            if not isinstance(value, torch.Tensor):
                raise QDebugError(f"{self.source}: input {name} must be a tensor, got {type(value).__name__}",
                                  "pass tensors")
            if len(shape) != value.dim() or any(d is not None and d != s for d, s in zip(shape, value.shape)):
                declared = "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
                raise QDebugError(f"{self.source}: input {name} has shape {declared} ('?': any size), got "
                                  f"{list(value.shape)}", "pass data shaped as the model was exported")
            feeds[name] = value.detach().cpu().numpy().astype(dtype, copy=False)
        return feeds


    # -- what compare reports of it -----------------------------------------------------------
    def stage_report(self) -> dict[str, Any]:
        """For compare's ``meta["stages"][label]``: the unmatched tensors, the rows tapped as
        float, the tap check; ``summary``: the lines compare adds to its summary."""
        lines = []
        if self.unmatched:
            shown = ", ".join(one_line(t, limit=80) for t, _ in self.unmatched[:SHOWN_UNMATCHED])
            more = f" and {len(self.unmatched) - SHOWN_UNMATCHED} more" if len(self.unmatched) > SHOWN_UNMATCHED else ""
            lines.append(f"{len(self.unmatched)} ONNX tensor(s) matched no layer: {shown}{more} (see --format json)")
        if self.float_taps:
            lines.append(f"{len(self.float_taps)} row(s) tapped as float tensors (no QuantizeLinear reads them: "
                         f"{', '.join(self.float_taps[:SHOWN_UNMATCHED])}); see tap_check for whether it changed "
                         "ONNX Runtime's kernels")
        check = self.tap_check
        if not check["outputs_equal"]:
            lines.append(f"tapping changed ONNX Runtime's kernels: the tapped run's outputs differ from the deployed "
                         f"run's in {check['values_differ']} value(s) (max {check['max_abs_diff']:.3g}); the output "
                         "rows are the deployed run's")
        return {"runner": self.runner, "source": self.source,
                "unmatched": [{"tensor": t, "why": why} for t, why in self.unmatched],
                "float_taps": list(self.float_taps), "tap_check": dict(check),
                "rows": {row: tap.tensor for row, tap in (self.taps or {}).items()}, "summary": lines}


# -- the graph ----------------------------------------------------------------------------------
class TapIndex:
    """Who reads each tensor of the model's main graph, its initializers and outputs: where a
    row's value is tapped (module docstring)."""

    def __init__(self, model: Any):
        self.model = model
        graph = model.graph
        self.readers: dict[str, list[Any]] = {}
        for node in graph.node:
            for name in node.input:
                if name:
                    self.readers.setdefault(name, []).append(node)
        self.producer = {out: node for node in graph.node for out in node.output if out}
        self.initializers = {t.name: t for t in graph.initializer}
        self.outputs = {o.name for o in graph.output}
        self.conversions: dict[str, str] = {}  # QuantizeLinear output -> uint8 zero point to give its pair

    def quantized_reader(self, tensor: str) -> Any:
        """The QuantizeLinear reading ``tensor`` (its first), if any."""
        return next((n for n in self.readers.get(tensor, []) if n.op_type == "QuantizeLinear"), None)

    def tap(self, tensor: str) -> Tap | None:
        """How the row carried by ``tensor`` is read (module docstring); None when its
        QuantizeLinear's scale or zero point is computed, not an initializer."""
        q = self.producer.get(tensor)  # qdebug's export names the codes themselves (``P/quantized``)
        if q is None or q.op_type != "QuantizeLinear":
            q = self.quantized_reader(tensor) if tensor not in self.outputs else None
        if q is None:  # a graph output, or a float tensor no QuantizeLinear reads
            return Tap(tensor, tensor, "output" if tensor in self.outputs else "float")
        dq = next((n for n in self.readers.get(q.output[0], []) if n.op_type == "DequantizeLinear"), None)
        if dq is not None and dq.output[0] in self.outputs:
            return Tap(dq.output[0], tensor, "output")  # the graph returns its dequantized value already
        at = dq if dq is not None else q
        scale = self.initializers.get(at.input[1]) if len(at.input) > 1 else None
        zero = self.initializers.get(at.input[2]) if len(at.input) > 2 and at.input[2] else None
        if scale is None or (len(at.input) > 2 and at.input[2] and zero is None):
            return None
        import numpy as np

        scale_array = tensor_array(scale).astype(np.float32)
        zero_array = tensor_array(zero).astype(np.int32) if zero is not None else np.zeros(scale_array.shape, np.int32)
        axis = next((a.i for a in at.attribute if a.name == "axis"), 1)
        if zero is not None and zero.data_type == 3 and self._converts_to_uint8(q, dq):  # 3: INT8
            self.conversions[q.output[0]] = at.input[2]
            zero_array = zero_array + 128
        return Tap(q.output[0], tensor, "codes", scale_array, zero_array, axis)

    def _converts_to_uint8(self, q: Any, dq: Any) -> bool:
        """Whether ONNX Runtime's x86 optimizer converts this int8 QuantizeLinear -> DequantizeLinear
        pair to uint8 in the untapped model (``QDQS8ToU8Transformer``: the codes' one reader is the
        DequantizeLinear, of the same scale and zero point, itself read once, neither a graph
        output).  Tapping the codes would stop it; ``tapped_model`` converts such a pair itself."""
        if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
            return False  # ONNX Runtime keeps int8 QDQ where its int8 kernels are allowed (ARM)
        if dq is None or q.output[0] in self.outputs or dq.output[0] in self.outputs:
            return False
        if len(self.readers.get(q.output[0], [])) != 1 or len(self.readers.get(dq.output[0], [])) != 1:
            return False
        return list(q.input[1:3]) == list(dq.input[1:3])

    def tapped_model(self, taps: list[Tap]) -> Any:
        """A copy of the model returning every tap's tensor too, its int8 pairs that ONNX Runtime
        converts to uint8 converted here (same integers + 128: ``_to_uint8``)."""
        from onnx import helper

        model = copy.deepcopy(self.model)
        graph = model.graph
        outputs = {o.name for o in graph.output}
        for tap in taps:
            if tap.tensor not in outputs:
                graph.output.append(helper.make_empty_tensor_value_info(tap.tensor))
                outputs.add(tap.tensor)
        if self.conversions:
            _to_uint8(graph, self.conversions, self.initializers)
        return model


def _to_uint8(graph: Any, conversions: dict[str, str], initializers: dict[str, Any]) -> None:
    """Each int8 QuantizeLinear (by output) and its DequantizeLinear reading zero point ``z``: ``z +
    128`` as uint8 -- the transformation ONNX Runtime applies itself (exact: the codes are the
    int8 ones + 128, the dequantized values the same)."""
    import numpy as np
    from onnx import numpy_helper

    made: dict[str, str] = {}
    for node in graph.node:
        if node.op_type == "QuantizeLinear" and node.output[0] in conversions:
            pair = [node, *(n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] == node.output[0])]
            zero = conversions[node.output[0]]
            if zero not in made:
                made[zero] = f"{zero}/qdebug_uint8"
                shifted = tensor_array(initializers[zero]).astype(np.int32) + 128
                graph.initializer.append(numpy_helper.from_array(shifted.astype(np.uint8), made[zero]))
            for member in pair:
                member.input[2] = made[zero]


def _graph_inputs(model: Any) -> list[tuple[str, Any, list[int | None]]]:
    """(name, numpy dtype, shape with None for a free dimension) of each non-initializer input."""
    from onnx import helper

    initializers = {t.name for t in model.graph.initializer}
    found = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        kind = value.type.tensor_type
        try:
            dtype = helper.tensor_dtype_to_np_dtype(kind.elem_type)
        except Exception:
            dtype = None
        if dtype is None:
            raise QDebugError(f"ONNX input {one_line(value.name, limit=80)} is not a tensor qdebug can feed",
                              "compare ONNX models whose inputs are float tensors")
        shape = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in kind.shape.dim]
        found.append((value.name, dtype, shape))
    return found


def _export_points(model: Any, source: str) -> list[dict[str, str]]:
    """The activation points of qdebug's own export metadata (none for another model)."""
    text = next((p.value for p in model.metadata_props if p.key == METADATA_KEY), None)
    if text is None:
        return []
    try:
        data = json.loads(text)
        points = [p for p in data["points"] if p["kind"] == "activation"]
        if not all(isinstance(p["name"], str) and isinstance(p["row"], str) for p in points):
            raise TypeError("a point's name or row is not a string")
    except Exception as exc:
        raise QDebugError(f"{source}: its {METADATA_KEY} metadata is malformed ({first_line(exc)})",
                          "export the checkpoint again with qdebug export") from None
    return points


def _plan(reference: nn.Module, example_inputs: Any) -> tuple[Any, nn.Module]:
    """The reference's plan (a prepared model's own; a float model traced on ``example_inputs``,
    on the CPU), and the model whose module paths name the scopes."""
    from qdebug.engine import engine_state, is_prepared, prepare

    if is_prepared(reference):
        return engine_state(reference).plan, reference
    float_model = copy.deepcopy(reference).cpu().eval()
    with torch.no_grad():
        prepared = prepare(float_model, example_inputs=map_tensors(example_inputs, lambda t: t.cpu()))
    return engine_state(prepared).plan, float_model


def _notes(plan: Any, rows: set[str]) -> dict[str, str]:
    """Why a call of the plan has no tensor here: folded by the exporter, inside another row's
    kernel, or not in the graph (as ``TorchStage``'s notes say it of torch's kernels)."""
    from qdebug.onnx.names import row_through_fusion

    def row_of(name: str) -> str | None:
        return row_through_fusion(plan, name, rows)

    notes: dict[str, str] = {}
    for conv, bn in plan.pairs:
        if conv in rows:
            continue
        if bn in rows:
            notes[conv] = f"the exporter folded {bn!r} into it: compared at {bn}"
            continue
        at = row_of(bn)
        if at is not None:
            notes[conv] = f"in ONNX Runtime's kernel of {at}: compared at {at}"
            notes[bn] = f"folded into {conv} by the exporter: compared at {at}"
    for name in plan.calls:
        if name in rows or name in notes:
            continue
        at = row_of(name)
        notes[name] = f"in ONNX Runtime's kernel of {at}: compared at {at}" if at else "not in the ONNX graph"
    return notes


def _as_inputs(feeds: dict, inputs: list) -> Any:
    """One batch (as the engine's prepare takes it) from the session's feeds, in graph order."""
    values = [torch.from_numpy(feeds[name]) for name, _, _ in inputs]
    return values[0] if len(values) == 1 else tuple(values)


def _float_array(array: Any) -> Any:
    import numpy as np

    array = np.asarray(array)
    return array if array.dtype.kind == "f" else array.astype(np.float32)
