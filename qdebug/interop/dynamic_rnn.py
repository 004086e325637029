"""torch's dynamic LSTM/GRU (``quantize_dynamic``: ``nnqd.LSTM``, ``nnqd.GRU``) -> the engine's QLSTM/QGRU.

``torch.quantized_lstm`` / ``quantized_gru`` (``use_dynamic``) compute each layer k and
direction as (measured against a float emulation: equal within 3e-8 on outputs up to 0.2)::

    igates[t] = s_x s_w (Q(X) Q(W_ih)^T)[t] + b_ih   X: the layer's WHOLE input sequence, one
                                                      per-tensor quint8 grid from its min/max
                                                      (reduce_range under fbgemm/x86: [0, 127])
    hgates    = s_h s_w Q(h) Q(W_hh)^T + b_hh          h: each step's hidden state, a grid of its own
    gates, sigmoid/tanh, c, h: float, in ATen's LSTMCell (GRUCell) order

The weights are int8 codes on torch's per-tensor (or per-channel: one scale per gate row)
scales: the importer puts them on the QLSTM's weight points exactly (the engine's codes are
torch's ``int_repr``; rows i, f, g, o as ``nn.LSTM``'s).  The two activation grids become the
QLSTM/QGRU's dynamic GEMM-input points (qdebug.engine.recurrent), per layer and direction:

    X before W_ih (the whole sequence)  -> <path>.l{k}[_reverse].input   (source <path>.weight_ih_l{k}.input)
    h before W_hh (each step)           -> <path>.l{k}[_reverse].h       (source <path>.weight_hh_l{k}.input)

quint8 per tensor, [0, 127] under fbgemm/x86 (``quantized_lstm`` asks for reduce_range),
[0, 255] under qnnpack.  Every other step point stays float, as torch computes it.  Not bit
for bit: fbgemm rescales its exact int32 GEMM in float and picks the scale in float64 (the
engine multiplies dequantized values, float32 scale); the outputs agree within a few 1e-6 of
their largest magnitude (tests/test_interop_recurrent.py bounds it).  float16 dynamic weights
stay float (the engine has no float16 weight grid).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from qdebug.interop.source import SourceQuantizer
from qdebug.interop.torch_grid import dequantized_weight, grid_of, quantizer_of, torch_name


def is_dynamic_rnn(module: nn.Module) -> bool:
    try:
        import torch.ao.nn.quantized.dynamic as nnqd
    except ImportError:  # pragma: no cover - torch without torch.ao
        return False
    return isinstance(module, (nnqd.LSTM, nnqd.GRU))


def _names(module: nn.Module):
    for k in range(module.num_layers):
        for suffix in ("", "_reverse")[: 2 if module.bidirectional else 1]:
            yield f"l{k}{suffix}"


def float_rnn(module: nn.Module) -> nn.Module:
    """An ``nn.LSTM``/``nn.GRU`` holding ``module``'s dequantized weights and float biases."""
    import torch.ao.nn.quantized.dynamic as nnqd

    cls = nn.LSTM if isinstance(module, nnqd.LSTM) else nn.GRU
    rnn = cls(module.input_size, module.hidden_size, module.num_layers, bias=module.bias,
              batch_first=module.batch_first, dropout=float(module.dropout), bidirectional=module.bidirectional)
    weights, biases = module.get_weight(), module.get_bias()
    with torch.no_grad():
        for name, w in weights.items():
            getattr(rnn, name).copy_(dequantized_weight(w) if w.is_quantized else w.float())
        for name, b in biases.items():
            if b is not None and getattr(rnn, name, None) is not None:
                getattr(rnn, name).copy_(b.detach().float())
    return rnn.train(module.training)


def rnn_quantizers(path: str, module: nn.Module) -> tuple[list[SourceQuantizer], list[tuple[str, str]]]:
    """(the quantizers of dynamic ``module`` at ``path``: its int8 weights and the dynamic grids of
    its GEMM inputs, on the QLSTM/QGRU points; (source, why) of what stays float)."""
    cls = "LSTM" if type(module).__name__ == "LSTM" else "GRU"
    weights = module.get_weight()
    if not all(w.is_quantized for w in weights.values()):
        return [], [(path, f"torch's dynamic {cls} with float16 weights: the engine has no float16 weight grid; "
                           "the layer is left float")]
    reduce = torch.backends.quantized.engine != "qnnpack"  # quantized_lstm asks fbgemm for reduce_range
    how = "reduce_range: [0, 127]" if reduce else "[0, 255]"
    found = []
    for local in _names(module):
        for gemm, point, what in (("ih", "input", "the layer's whole input sequence, one grid per call"),
                                  ("hh", "h", "each step's hidden state, one grid per step")):
            weight = f"weight_{gemm}_{local}"
            q = quantizer_of(grid_of(weights[weight]), f"{path}.{weight}", "weight", path,
                             note=f"the int8 weight of torch's {torch_name(module)}")
            q.point = f"{path}.{weight}"
            found.append(q)
            found.append(SourceQuantizer(
                f"{path}.{weight}.input", "activation", path, torch.ones(()), torch.zeros((), dtype=torch.int32), 0,
                127 if reduce else 255, "quint8", "per_tensor_affine", dynamic=True, point=f"{path}.{local}.{point}",
                note=f"torch's {torch_name(module)} quantizes {what} ({how}, from its min/max and 0) before the "
                     f"int8 GEMM with {weight}; fbgemm's float rescale of the int32 GEMM differs from the engine's "
                     "fake quant in float rounding only"))
    return found, []
