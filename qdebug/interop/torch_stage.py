"""A model torch.ao converted, run by torch's own kernels, as a stage of ``compare``.

``TorchStage`` owns running a converted model (eager ``convert``, FX ``convert_fx``, PT2E
``convert_pt2e``) as it is -- torch's int8 kernels, nothing of qdebug's engine -- and tapping it
per layer under the float model's names, so ``compare`` puts torch's own numbers next to
qdebug's integer simulation of the same model (``qdebug.from_torch_ao``) row for row.

Where each row's tensor comes from is what the import read: every activation quantizer of the
import report is one quantized tensor torch computes (an eager module's output, its k-th call
``P#k``, a ``QFunctional`` op; an FX or PT2E graph's node) and names the engine point holding its
grid.  The row is that point's call, as compare shows the simulation: a fused Conv-ReLU's
output at its ReLU, a conv whose BN torch folded at the BN.  The tensor is torch's, dequantized
((q - z) s, exactly the values torch's next dequantize gives; a PT2E quantize op's codes: the
output of the dequantize op reading them).  The model's own output, when no quantizer reads it
(a PT2E graph's last linear is float), is the row of the one call that returns it.

While ``qdebug.measure.tap`` listens (``qdebug_tap``), each forward reports those tensors as the calls
of an engine run: compare's listener sees events named like the float model's calls.  Only the
propagated error is measured (``propagated_only``): the isolated error replays one layer of the
compared model on the reference's inputs, a replay the engine makes of its own calls; torch's
fused kernels have no such entry point here.  Inline ops torch runs on quantized tensors outside
any module (an eager ``F.relu``, a ``mean``) are not tapped: their rows say so.

torch's quantized kernels run on the CPU: the converted model stays there (it is kept out of
this module's tree, so ``.to(device)`` leaves it, and ``eval()`` too: it runs in the mode it was
given, a PT2E graph refuses ``eval()``), inputs are copied to the CPU and outputs come back on
the inputs' device.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.nn as nn

from qdebug.engine.context import Event, split_inputs
from qdebug.engine.ops import map_tensors, tensors_in
from qdebug.errors import QDebugError
from qdebug.measure.tap import ReportsCalls

CONVERTED_FLOWS = ("eager-converted", "fx-converted", "pt2e-converted")
PROPAGATED_ONLY = ("torch's own kernels: propagated error only (the isolated columns are blank: "
                   "compare replays a layer alone only on qdebug's engine)")


def is_converted(model: Any) -> bool:
    """Whether ``model`` is a model torch.ao converted to its int8 kernels (any flow)."""
    from qdebug.interop import detect_flow

    return isinstance(model, nn.Module) and not isinstance(model, TorchStage) and detect_flow(model) in CONVERTED_FLOWS


class TorchStage(ReportsCalls, nn.Module):
    """``converted`` run by torch, tapped per layer under ``float_model``'s names (module docstring).

    ``float_model``: an instance of the architecture (FX and PT2E graphs need it; eager models
    keep their paths).  ``example_inputs``: one batch, to import the model and name its layers
    now; without it, the first forward does (``compare`` passes neither: it gives its reference
    and its first batch).
    """

    stage = "quantized"
    propagated_only = PROPAGATED_ONLY

    def __init__(self, converted: nn.Module, float_model: nn.Module | None = None, example_inputs: Any = None):
        super().__init__()
        from qdebug.interop import detect_flow

        flow = detect_flow(converted) if isinstance(converted, nn.Module) else None
        if flow not in CONVERTED_FLOWS:
            raise QDebugError(f"TorchStage runs a model torch.ao converted, not {_what(converted, flow)}",
                              "pass the model returned by torch.ao's convert, convert_fx or convert_pt2e")
        # Outside the module tree: .to(device) must not move torch's CPU-only quantized modules.
        object.__setattr__(self, "torch_model", converted)
        self.flow = flow
        object.__setattr__(self, "float_model", float_model)  # only read, by the import: not moved either
        self.sources: dict[str, str] | None = None  # torch tensor (report source) -> row
        self.row_notes: dict[str, str] = {}  # rows not tapped here, and why
        self._listeners: list[Callable[[Event], None]] = []
        self._calls: dict[str, tuple[str, str, str]] = {}  # row -> (category, op, owner)
        self.output_row: str | None = None  # the row of the model's output, when no quantizer reads it
        if example_inputs is not None:
            self.name_layers(example_inputs)

    def use_float_model(self, float_model: nn.Module) -> None:
        """Name the layers after ``float_model``'s calls (kept out of this module's tree too)."""
        object.__setattr__(self, "float_model", float_model)

    # -- naming: the import says which torch tensor is which row -----------------------------
    def name_layers(self, example_inputs: Any) -> None:
        """Import the converted model on ``example_inputs`` (``qdebug.from_torch_ao``) and keep,
        of each activation quantizer it read, which torch tensor feeds which compare row."""
        from qdebug.engine import engine_state
        from qdebug.interop import from_torch_ao
        from qdebug.interop.build import import_report

        if self.flow != "eager-converted" and self.float_model is None:
            raise QDebugError(f"a {self.flow} graph does not keep your model class: TorchStage needs float_model=",
                              "compare it against its float model (the reference), or pass float_model=YourNet()")
        # On the CPU, beside torch's model (compare may have moved the float model to a GPU).
        float_model = None if self.float_model is None else copy.deepcopy(self.float_model).cpu()
        with torch.no_grad():  # unchecked: only its names are used here, torch's own numbers are the point
            imported = from_torch_ao(self.torch_model, _on_cpu(example_inputs), float_model=float_model, check=False)
        report = import_report(imported)
        plan = engine_state(imported).plan
        folded = {r["point"]: r["source"] for r in report if r["kind"] == "bn" and r["point"]}
        owner = {p: rec.name for rec in plan.calls.values() for p in rec.point_names()}
        sources: dict[str, str] = {}
        for r in report:
            read = r["kind"] == "activation" and r["source"] and r["point"] and r["status"] not in ("float", "unmapped")
            call = owner.get(r["point"]) if read else None
            if call is None:
                continue
            row = folded.get(call, call)
            if row in sources.values():
                if r["source"] != row:
                    continue  # one tensor per row: the first quantizer read there...
                # ...unless torch's module at the row itself computes it: an unfused conv's
                # quantizer is moved to the ReLU after it, whose output (not the conv's) is the row.
                sources = {source: kept for source, kept in sources.items() if kept != row}
            sources[r["source"]] = row
            rec = plan.calls[call]
            self._calls[row] = (rec.category, rec.op, rec.owner)
        tappable = self._tappable(sources)
        notes = {row: "torch computes it inline on quantized tensors, outside any module: not tapped"
                 for source, row in sources.items() if source not in tappable}
        self.sources = {source: row for source, row in sources.items() if source in tappable}
        rows = set(self.sources.values())
        # The model's output is torch's too (a PT2E graph's last linear is float, no quantize op
        # reads it): the row of the one call whose value the forward returns.
        ends = [rec for rec in plan.calls.values() if "<output>" in rec.consumers]
        self.output_row = ends[0].name if len(ends) == 1 and ends[0].name not in rows else None
        if self.output_row is not None:
            rows.add(self.output_row)
            self._calls[self.output_row] = (ends[0].category, ends[0].op, ends[0].owner)
        # The calls torch computes inside the kernel of another row (a fused ReLU's conv, a
        # folded BN's conv, the BN itself): compared there, as compare shows the simulation.
        def row_of(name: str) -> str:
            for _ in range(len(plan.calls)):
                rec = plan.calls.get(name)
                if rec is None or not rec.fused_into:
                    break
                name = rec.fused_into
            return folded.get(name, name)

        for conv, bn in folded.items():
            if bn in rows:
                notes[conv] = f"torch folded {bn!r} into it: compared at {bn}"
        for name in [*plan.calls, *folded.values()]:
            at = row_of(next((c for c, b in folded.items() if b == name), name))
            if name != at and at in rows:
                notes.setdefault(name, f"in torch's kernel of {at}: compared at {at}")
        for name in [*plan.calls, *folded.values()]:
            if name not in rows:
                notes.setdefault(name, "no tensor torch quantizes here: not tapped")
        self.row_notes = notes

    def _tappable(self, sources: dict[str, str]) -> set[str]:
        """The sources this flow's recorder can tap: module paths (``P``, ``P#k``) of an eager
        model, node names of a graph."""
        if self.flow == "eager-converted":
            paths = {p for p, _ in self.torch_model.named_modules() if p}
            return {s for s in sources if _module_call(s)[0] in paths}
        nodes = {n.name for n in self.torch_model.graph.nodes}
        return {s for s in sources if s in nodes}

    # -- running ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device = next((t.device for t in tensors_in((args, kwargs))), None)
        args, kwargs = _on_cpu(args), _on_cpu(kwargs)
        if self._listeners:
            out, taps = self._run(args, kwargs)
            for row, y in taps.items():
                self._emit(row, y if device is None else y.to(device))
        else:
            with torch.no_grad():
                out = self.torch_model(*args, **kwargs)
        out = map_tensors(out, lambda t: t.dequantize() if t.is_quantized else t)
        return out if device is None else map_tensors(out, lambda t: t.to(device))

    def tapped(self, inputs: Any) -> dict[str, torch.Tensor]:
        """Row -> torch's dequantized tensor there, for one batch (``inputs``: a tensor, a tuple
        of args or a dict of kwargs), in the order torch computed them."""
        args, kwargs = split_inputs(_on_cpu(inputs))
        return self._run(args, kwargs)[1]

    def _run(self, args: tuple, kwargs: dict) -> tuple[Any, dict[str, torch.Tensor]]:
        if self.sources is None:
            self.name_layers(_as_inputs(args, kwargs))
        with torch.no_grad():
            if self.flow == "eager-converted":
                out, found = _run_eager(self.torch_model, args, kwargs, set(self.sources))
            else:
                out, found = _run_graph(self.torch_model, args, kwargs, set(self.sources),
                                        after_dequantize=self.flow == "pt2e-converted")
        taps = {self.sources[s]: y for s, y in found.items()}
        if self.output_row is not None and isinstance(out, torch.Tensor):
            taps[self.output_row] = _dequantized(out)
        return out, taps



def _what(model: Any, flow: str | None) -> str:
    if not isinstance(model, nn.Module):
        return f"a {type(model).__name__}"
    return f"a {flow} model" if flow else f"a {type(model).__name__} with no torch.ao quantization"


def _on_cpu(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.cpu())


def _as_inputs(args: tuple, kwargs: dict) -> Any:
    """One batch as ``from_torch_ao`` takes it (``split_inputs`` gives ``args, kwargs`` back)."""
    if kwargs and args:
        raise QDebugError("a converted model called with positional and keyword inputs at once cannot be named",
                          "pass its inputs as one tensor, a tuple of them, or a dict")
    if kwargs:
        return dict(kwargs)
    return args[0] if len(args) == 1 else tuple(args)


def _module_call(source: str) -> tuple[str, int]:
    """(module path, 1-based call) of an eager report source: ``P`` or ``P#k``."""
    path, mark, k = source.rpartition("#")
    return (path, int(k)) if mark and k.isdigit() else (source, 1)


def _dequantized(t: Any) -> torch.Tensor | None:
    if not isinstance(t, torch.Tensor):
        return None
    return t.dequantize() if t.is_quantized else t.detach().clone()


def _run_eager(model: nn.Module, args: tuple, kwargs: dict, sources: set[str]) -> tuple[Any, dict]:
    """The model's output and, per source, the output of that module call (forward hooks; a
    ``QFunctional``'s ops, which run in its methods, wrapped on the instance for the run)."""
    import torch.ao.nn.quantized as nnq

    from qdebug.interop.converted import QFUNCTIONAL_OPS

    wanted: dict[str, set[int]] = defaultdict(set)
    for source in sources:
        path, k = _module_call(source)
        wanted[path].add(k)
    calls: dict[str, int] = defaultdict(int)
    found: dict[str, torch.Tensor] = {}

    def record(path: str, output: Any) -> None:
        calls[path] += 1
        k = calls[path]
        if k in wanted[path]:
            y = _dequantized(output)
            if y is not None:
                found[path if f"{path}#{k}" not in sources else f"{path}#{k}"] = y

    handles, wrapped = [], []
    for path, module in model.named_modules():
        if path not in wanted:
            continue
        if isinstance(module, nnq.QFunctional):
            for name in QFUNCTIONAL_OPS:
                if hasattr(module, name) and name not in module.__dict__:
                    object.__setattr__(module, name, _recording(getattr(module, name), path, record))
                    wrapped.append((module, name))
        else:
            handles.append(module.register_forward_hook(lambda m, a, out, path=path: record(path, out)))
    try:
        out = model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        for module, name in wrapped:
            del module.__dict__[name]
    return out, found


def _recording(fn: Callable, path: str, record: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        record(path, out)
        return out
    return call


def _run_graph(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, sources: set[str],
               after_dequantize: bool) -> tuple[Any, dict]:
    """The graph's output and, per source node, its output -- for a PT2E quantize op (integer
    codes) the output of the dequantize op reading it, the float values torch computes on."""
    taps: dict[Any, str] = {}
    for node in gm.graph.nodes:
        if node.name not in sources:
            continue
        at = node
        if after_dequantize:  # a quantize op's codes: the dequantize reading them
            at = next((u for u in node.users if "dequantize" in _target(u)), node)
        taps[at] = node.name
    found: dict[str, torch.Tensor] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            if node in taps:
                y = _dequantized(out)
                if y is not None:
                    found[taps[node]] = y
            return out

    positional = list(args)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in placeholders[len(args):]:
        if node.target in kwargs:
            positional.append(kwargs[node.target])
        elif node.args:
            positional.append(node.args[0])
    out = Recorder(gm).run(*positional)
    return out, found


def _target(node: Any) -> str:
    return str(getattr(node.target, "__name__", node.target))
