"""torch.ao's quantizable LSTM (eager custom-module flow) -> the engine's ``QLSTM``.

Eager ``prepare``/``prepare_qat`` swap an ``nn.LSTM`` for ``torch.ao.nn.quantizable.LSTM``
(torch's default custom module config): layer k, direction d is a ``_LSTMLayer`` whose
``layer_fw``/``layer_bw.cell`` holds two gate Linears and an observer per op.  The importer
puts an ``nn.LSTM`` holding the same weights back at the module's path (``prepare`` makes it
a ``QLSTM``) and maps each torch quantizer onto the QLSTM point at the same site:

    layers.{k}.layer_fw.cell.<site>.activation_post_process -> <path>.l{k}.<point>
    layers.{k}.layer_bw.cell.<site>.activation_post_process -> <path>.l{k}_reverse.<point>
    layers.{k}.layer_fw.cell.igates.weight_fake_quant       -> <path>.weight_ih_l{k}
    layers.{k}.layer_fw.cell.hgates.weight_fake_quant       -> <path>.weight_hh_l{k}

with ``<point>`` the site's name except ``fgate_cx_igate_cgate`` -> ``cell`` and
``ogate_cy`` -> ``hidden``.  The igates Linear's weight *is* ``weight_ih_l{k}`` ([4H, in],
gate rows i, f, g, o in nn.LSTM's order), so a per-channel quantizer's axis 0 is the engine's
per-gate-row axis 0, channel for channel.  A PTQ-prepared LSTM has no weight quantizer: torch's
convert observes each gate Linear's weight with ``qconfig.weight()``, and so does the importer.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from qdebug.errors import QDebugError
from qdebug.interop.source import SourceQuantizer, full_range, read_quantizer

SITES = {  # torch.ao's LSTMCell attribute -> the QLSTM step point (qdebug.engine.recurrent)
    "igates": "igates", "hgates": "hgates", "gates": "gates", "input_gate": "input_gate",
    "forget_gate": "forget_gate", "cell_gate": "cell_gate", "output_gate": "output_gate", "fgate_cx": "fgate_cx",
    "igate_cgate": "igate_cgate", "fgate_cx_igate_cgate": "cell", "ogate_cy": "hidden",
}
WEIGHTS = {"igates": "weight_ih", "hgates": "weight_hh"}
BIASES = {"igates": "bias_ih", "hgates": "bias_hh"}


def quantizable_lstms(model: nn.Module) -> dict[str, nn.Module]:
    """Path -> torch.ao quantizable LSTM, outermost only."""
    try:
        from torch.ao.nn.quantizable import LSTM
    except ImportError:  # pragma: no cover - torch without torch.ao
        return {}
    found: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        if isinstance(module, LSTM) and not any(path.startswith(f"{p}.") for p in found):
            found[path] = module
    return found


def _directions(module: nn.Module):
    """(torch's cell path under the LSTM, engine prefix ``l{k}[_reverse]``, the cell) per direction."""
    for k, layer in enumerate(module.layers):
        yield f"layers.{k}.layer_fw.cell", f"l{k}", layer.layer_fw.cell
        if getattr(layer, "bidirectional", False):
            yield f"layers.{k}.layer_bw.cell", f"l{k}_reverse", layer.layer_bw.cell


def float_lstm(path: str, module: nn.Module) -> nn.LSTM:
    """An ``nn.LSTM`` holding the weights of torch.ao's quantizable LSTM at ``path``."""
    lstm = nn.LSTM(module.input_size, module.hidden_size, module.num_layers, bias=module.bias,
                   batch_first=module.batch_first, dropout=float(module.dropout), bidirectional=module.bidirectional)
    with torch.no_grad():
        for cell_path, prefix, cell in _directions(module):
            suffix = f"_{prefix}"
            for gates, weight in WEIGHTS.items():
                linear = getattr(cell, gates)
                if not isinstance(getattr(linear, "weight", None), torch.Tensor):
                    raise QDebugError(f"cannot import {path}.{cell_path}: its gates are split (split_gates=True)",
                                      "prepare the LSTM with torch's default custom module config "
                                      "(split_gates=False)")
                getattr(lstm, f"{weight}{suffix}").copy_(linear.weight.detach())
                if module.bias:
                    getattr(lstm, f"{BIASES[gates]}{suffix}").copy_(linear.bias.detach())
    device = next(module.parameters()).device
    return lstm.to(device).train(module.training)


def lstm_quantizers(path: str, module: nn.Module, qat: bool) -> list[SourceQuantizer]:
    """The quantizers of torch.ao's quantizable LSTM at ``path``, each anchored to its QLSTM point."""
    found = []
    for cell_path, prefix, cell in _directions(module):
        for site, local in SITES.items():
            quantizer = getattr(getattr(cell, site, None), "activation_post_process", None)
            if quantizer is None:
                continue
            q = read_quantizer(quantizer, f"{path}.{cell_path}.{site}.activation_post_process", "activation",
                               f"{path}.{prefix}.{local}")
            q.point = q.anchor
            if not qat:
                full_range(q)
            found.append(q)
        for gates, weight in WEIGHTS.items():
            linear = getattr(cell, gates)
            quantizer = getattr(linear, "weight_fake_quant", None)
            source = f"{path}.{cell_path}.{gates}.weight_fake_quant"
            note = ""
            if quantizer is None:
                qconfig = getattr(linear, "qconfig", None)
                if qat or qconfig is None:
                    continue  # the source runs this weight in float
                quantizer = qconfig.weight()
                quantizer(linear.weight.detach())
                source = f"{path}.{cell_path}.{gates}.qconfig.weight()"
                note = "observed on the weight, as torch's convert does"
            q = read_quantizer(quantizer, source, "weight", path, note=note)
            q.point = f"{path}.{weight}_{prefix}"
            found.append(q)
    return found


def recurrent_points(model: nn.Module) -> dict[str, tuple[str, tuple[str, str], str]]:
    """Every point ``prepare`` can give the recurrent layers of ``model``: name -> (kind, the names
    qconfig globs match, its role: "cell" when its spec starts from the 16-bit cell-state default,
    "dynamic" for a GEMM input, which exists only with a dynamic spec, else "")."""
    from qdebug.engine.recurrent import CELL_STATE_POINTS, GEMM_INPUT_POINTS, QLSTM, QLSTMCell, quantizable_recurrent

    points: dict[str, tuple[str, tuple[str, str], str]] = {}
    for path, module in model.named_modules():
        layer = quantizable_recurrent(module)
        if layer is None:
            continue
        lstm = isinstance(layer, (QLSTM, QLSTMCell))
        for prefix in layer._directions():
            for weight in layer.weight_names():
                if not prefix or weight.endswith(f"_{prefix}"):
                    points[f"{path}.{weight}"] = ("weight", (path, f"{path}.{weight}"), "")
            for gemm in GEMM_INPUT_POINTS:
                name = f"{path}.{prefix}.{gemm}" if prefix else f"{path}.{gemm}"
                points[name] = ("activation", (path, name), "dynamic")
            for step in layer.step_point_names():
                name = f"{path}.{prefix}.{step}" if prefix else f"{path}.{step}"
                points[name] = ("activation", (path, name), "cell" if lstm and step in CELL_STATE_POINTS else "")
    return points
