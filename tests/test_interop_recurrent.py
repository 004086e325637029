"""Importing torch.ao's recurrent quantization: the quantizable LSTM of the eager custom-module flow.

Eager ``prepare``/``prepare_qat`` swap ``nn.LSTM`` for ``torch.ao.nn.quantizable.LSTM``; the
importer puts an ``nn.LSTM`` back (the engine's ``QLSTM``) and maps each of torch's
quantizers onto the QLSTM point at its site.  The oracle is torch's own prepared model, in
eval with its observers disabled, as in tests/test_interop_eager.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from qdebug.engine import quant_points
from qdebug.interop import from_torch_ao, import_report
from small_models import torch_ao_ptq, torch_ao_qat

tq = pytest.importorskip("torch.ao.quantization")

SITES = {"igates": "igates", "hgates": "hgates", "gates": "gates", "fgate_cx": "fgate_cx",
         "igate_cgate": "igate_cgate", "fgate_cx_igate_cgate": "cell", "ogate_cy": "hidden"}


class SpeechNet(nn.Module):
    """QuantStub -> LSTM -> Linear, the shape of a small speech encoder."""

    def __init__(self, **kw):
        super().__init__()
        self.quant = tq.QuantStub()
        self.lstm = nn.LSTM(8, 12, **kw)
        self.fc = nn.Linear(12 * (2 if kw.get("bidirectional") else 1), 4)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        y, _ = self.lstm(self.quant(x))
        return self.dequant(self.fc(y))


def _batches(kw, n, steps=6):
    shape = (3, steps, 8) if kw.get("batch_first") else (steps, 3, 8)
    return [torch.randn(shape) * 2 for _ in range(n)]


def _qat(kw) -> nn.Module:
    torch.manual_seed(0)
    return torch_ao_qat(SpeechNet(**kw), _batches(kw, 3))


def _ptq(kw) -> nn.Module:
    torch.manual_seed(0)
    return torch_ao_ptq(SpeechNet(**kw), _batches(kw, 3))


def _cells(lstm, kw):
    for k, layer in enumerate(lstm.layers):
        yield f"l{k}", f"layers.{k}.layer_fw.cell", layer.layer_fw.cell
        if kw.get("bidirectional"):
            yield f"l{k}_reverse", f"layers.{k}.layer_bw.cell", layer.layer_bw.cell


@pytest.mark.parametrize("kw", [dict(), dict(num_layers=2, bidirectional=True, batch_first=True)],
                         ids=["one-layer", "two-layer-bidirectional-batch-first"])
def test_qat_quantizable_lstm_imports_bit_identically_onto_qlstm(kw):
    import torch.ao.nn.quantizable as nnqa

    prepared = _qat(kw)
    assert isinstance(prepared.lstm, nnqa.LSTM)  # torch's custom-module flow did swap it
    (x,) = _batches(kw, 1)
    qm = from_torch_ao(prepared, x)
    assert type(qm.lstm).__name__ == "QLSTM"
    points = quant_points(qm)
    report = import_report(qm)
    by_source = dict(zip(report["source"], report["point"]))
    for prefix, cell_path, cell in _cells(prepared.lstm, kw):
        suffix = f"_{prefix}"
        for site, local in SITES.items():
            source = f"lstm.{cell_path}.{site}.activation_post_process"
            assert by_source[source] == f"lstm.{prefix}.{local}"
            theirs = getattr(cell, site).activation_post_process
            ours = points[f"lstm.{prefix}.{local}"]
            assert torch.equal(ours.scale.reshape(-1), theirs.scale.reshape(-1))
            assert ours.spec.bits == 7 and ours.mode == "fake"  # torch's quint8 reduce_range, even the cell
        for gates, weight in (("igates", "weight_ih"), ("hgates", "weight_hh")):
            theirs = getattr(cell, gates).weight_fake_quant
            ours = points[f"lstm.{weight}{suffix}"]
            assert by_source[f"lstm.{cell_path}.{gates}.weight_fake_quant"] == f"lstm.{weight}{suffix}"
            assert ours.spec.per_channel and ours.spec.ch_axis == 0 and ours.scale.numel() == 4 * 12
            assert torch.equal(ours.scale, theirs.scale)
            assert torch.equal(getattr(qm.lstm, f"{weight}{suffix}"), getattr(cell, gates).weight)
        for gate in ("input_gate", "forget_gate", "cell_gate", "output_gate"):  # QAT: fixed-qparams sigmoid/tanh
            theirs = getattr(cell, gate).activation_post_process
            ours = points[f"lstm.{prefix}.{gate}"]
            assert by_source[f"lstm.{cell_path}.{gate}.activation_post_process"] == ours.name
            assert torch.equal(ours.scale.reshape(-1), theirs.scale.reshape(-1)) and ours.frozen
    sourced = report[report["source"] != ""]
    fixed = sourced["source"].str.contains("_gate.activation_post_process")
    assert set(sourced.loc[~fixed, "status"]) == {"exact"}, report.to_string()
    assert set(sourced.loc[fixed, "status"]) == {"frozen"}  # FixedQParamsFakeQuantize: no engine observer
    assert "unmapped" not in set(report["status"])
    probe = torch.cat(_batches(kw, 2)) * 1.5
    with torch.no_grad():
        theirs, ours = prepared(probe), qm(probe)
    assert torch.equal(theirs, ours), (theirs - ours).abs().max()


def test_ptq_quantizable_lstm_maps_observers_and_weights_like_convert():
    kw = dict(num_layers=2)
    prepared = _ptq(kw)
    (x,) = _batches(kw, 1)
    qm = from_torch_ao(prepared, x)
    points = quant_points(qm)
    report = import_report(qm)
    for prefix, cell_path, cell in _cells(prepared.lstm, kw):
        for site, local in SITES.items():
            scale, zero_point = getattr(cell, site).activation_post_process.calculate_qparams()
            ours = points[f"lstm.{prefix}.{local}"]
            assert torch.equal(ours.scale.reshape(-1), scale.float().reshape(-1))
            assert torch.equal(ours.zero_point.reshape(-1), zero_point.to(torch.int32).reshape(-1))
            assert (ours.spec.qmin, ours.spec.qmax) == (0, 255)  # convert clamps to quint8's full range
        for gates, weight in (("igates", "weight_ih"), ("hgates", "weight_hh")):
            observer = cell.igates.qconfig.weight()
            observer(getattr(cell, gates).weight.detach())
            ours = points[f"lstm.{weight}_{prefix}"]
            assert torch.equal(ours.scale, observer.calculate_qparams()[0].float())
            assert f"lstm.{cell_path}.{gates}.qconfig.weight()" in set(report["source"])
    # torch's sigmoid/tanh outputs have no observer: those points are float, and said so
    floats = set(report.loc[report["status"] == "float", "point"])
    assert {"lstm.l0.input_gate", "lstm.l1.cell_gate"} <= floats
    assert "lstm.l0.input_gate" not in points  # an engine point the source leaves float is none
    # torch's converted model (integer LSTM) against the engine's fake quant: close, not equal
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = tq.convert(prepared)
    probe = _batches(kw, 1)[0]
    with torch.no_grad():
        theirs, ours, ref = converted(probe), qm(probe), prepared(probe)
    sqnr = lambda a, b: float(10 * torch.log10(a.pow(2).mean() / (a - b).pow(2).mean()))  # noqa: E731
    assert sqnr(theirs, ours) > 20 and sqnr(ref, ours) > 15


def test_imported_lstm_saves_and_reloads_as_a_qdebug_checkpoint(tmp_path):
    import qdebug

    kw = dict(num_layers=2, bidirectional=True)
    prepared = _qat(kw)
    (x,) = _batches(kw, 1)
    qm = from_torch_ao(prepared, x)
    path = qdebug.save(qm, tmp_path / "qat.pt", stage="qat", model_spec="test_interop_recurrent:SpeechNet",
                       model_kwargs=kw, sample_inputs=x)
    loaded, _ = qdebug.load(path)
    assert loaded.lstm.qpoints["l1_reverse.cell"].spec.bits == 7  # the source's grid, not the int16 default
    probe = _batches(kw, 1)[0]
    with torch.no_grad():
        assert torch.equal(loaded(probe), prepared(probe))


# -- dynamic quantization (quantize_dynamic): int8 weights, a per-batch input point -----------
class DynamicNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.relu(self.fc(x)))


def _torch_dynamic_input(x: torch.Tensor) -> torch.Tensor:
    """x as torch's dynamic Linear quantizes it: its own per-tensor qparams, reduce_range on x86."""
    reduce = torch.backends.quantized.engine != "qnnpack"
    scale, zero_point = torch._choose_qparams_per_tensor(x, reduce)
    return torch.quantize_per_tensor(x, scale, zero_point, torch.quint8)


@pytest.mark.parametrize("qscheme", ["per-tensor", "per-channel"])
def test_quantize_dynamic_linear_imports_int8_weights_and_a_dynamic_input_point(qscheme):
    from qdebug.engine.fake_quant import dynamic_qparams

    torch.manual_seed(7)
    model = DynamicNet().eval()
    qconfig = tq.per_channel_dynamic_qconfig if qscheme == "per-channel" else tq.default_dynamic_qconfig
    converted = tq.quantize_dynamic(model, {nn.Linear: qconfig}, dtype=torch.qint8)
    x = torch.randn(5, 8)
    qm = from_torch_ao(converted, x, float_model=DynamicNet())
    report = import_report(qm)
    assert "unmapped" not in set(report["status"]), report.to_string()
    points = quant_points(qm)
    for path, producer in (("fc", "input"), ("fc2", "relu")):
        point = points[producer]
        assert point.spec.dynamic and not point.spec.per_token and point.mode == "fake"
        assert dict(zip(report["source"], report["point"]))[f"{path}.input"] == producer
        # the int8 weight codes torch stores, on torch's scales, per tensor or per output channel
        w = getattr(converted, path).weight()
        ours = points[f"{path}.weight"]
        assert ours.spec.per_channel == (qscheme == "per-channel")
        assert torch.equal(ours.scale.reshape(-1), (w.q_per_channel_scales() if ours.spec.per_channel
                                                    else torch.tensor([w.q_scale()])).float())
        assert torch.equal(ours.apply(getattr(qm, path).weight.detach()), w.dequantize())
    for probe in (torch.randn(6, 8) * 3, torch.rand(6, 8) + 0.5, torch.randn(2, 3, 8)):
        # the input grid: the engine's dynamic point equals torch's own per-batch quantization
        scale, zero_point = dynamic_qparams(probe, points["input"].spec)
        expected = _torch_dynamic_input(probe)
        # fbgemm divides the range in float64, the engine in float32: the scales may be 1 ulp apart
        assert abs(float(scale) - expected.q_scale()) <= 1.2e-7 * expected.q_scale()
        assert int(zero_point) == expected.q_zero_point()
        assert (points["input"].apply(probe) - expected.dequantize()).abs().max() <= 1.001 * expected.q_scale()
        # the output: torch's int8 GEMM is exact, its float rescale rounds differently from the
        # engine's fake-quant float GEMM -- equal within float32 rounding of the accumulation
        with torch.no_grad():
            theirs, ours = converted(probe), qm(probe)
        assert torch.allclose(theirs, ours, rtol=0, atol=1e-5 * float(theirs.abs().max())), (theirs - ours).abs().max()


class DynamicRNN(nn.Module):
    """LSTM or GRU -> Linear, for quantize_dynamic."""

    def __init__(self, cell="LSTM", **kw):
        super().__init__()
        self.rnn = getattr(nn, cell)(8, 12, **kw)
        self.fc = nn.Linear(12 * (2 if kw.get("bidirectional") else 1), 4)

    def forward(self, x):
        return self.fc(self.rnn(x)[0])


def _dynamic_rnn(cell, qscheme, kw):
    torch.manual_seed(0)
    qconfig = tq.per_channel_dynamic_qconfig if qscheme == "per-channel" else tq.default_dynamic_qconfig
    cls = getattr(nn, cell)
    return tq.quantize_dynamic(DynamicRNN(cell, **kw).eval(), {cls: qconfig, nn.Linear: qconfig}, dtype=torch.qint8)


def _directions(kw):
    return [f"l{k}{suffix}" for k in range(kw.get("num_layers", 1))
            for suffix in ("", "_reverse")[: 2 if kw.get("bidirectional") else 1]]


DYNAMIC_RNN_KW = dict(num_layers=2, bidirectional=True)


@pytest.mark.parametrize("qscheme", ["per-tensor", "per-channel"])
@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_quantize_dynamic_rnn_imports_int8_weights_and_dynamic_gemm_inputs(cell, qscheme):
    kw = DYNAMIC_RNN_KW
    converted = _dynamic_rnn(cell, qscheme, kw)
    (x,) = _batches(kw, 1)
    qm = from_torch_ao(converted, x, float_model=DynamicRNN(cell, **kw))
    assert type(qm.rnn).__name__ == f"Q{cell}"
    report = import_report(qm)
    assert set(report["status"]) == {"exact", "float"}, report.to_string()
    mapped = dict(zip(report["source"], report["point"]))
    points = quant_points(qm)
    weights = converted.rnn.get_weight()
    for prefix in _directions(kw):
        for gemm, grid in (("ih", "input"), ("hh", "h")):
            name = f"weight_{gemm}_{prefix}"
            # the int8 codes torch stores, on torch's scales (per tensor or per gate row)
            ours, theirs = points[f"rnn.{name}"], weights[name]
            assert mapped[f"rnn.{name}"] == f"rnn.{name}"
            assert ours.spec.per_channel == (qscheme == "per-channel")
            assert torch.equal(ours.apply(getattr(qm.rnn, name).detach()), theirs.dequantize())
            # the GEMM's input: a dynamic per-tensor grid, quint8 [0, 127] (fbgemm's reduce_range)
            point = points[f"rnn.{prefix}.{grid}"]
            assert mapped[f"rnn.{name}.input"] == point.name
            assert point.spec.dynamic and (point.spec.qmin, point.spec.qmax) == (0, 127) and point.mode == "fake"
    assert "rnn.l0.igates" not in points and "rnn.l0.hidden" not in points  # torch computes the rest in float
    # torch's int8 GEMMs are exact, its float rescale rounds unlike the engine's float GEMM of
    # dequantized values, and its float64 scale can put an input code on the other side of a
    # rounding tie (1 ulp of the engine's float32 scale): then one code moves a step
    close = []
    for seed in range(8):
        probe = torch.randn(6, 3, 8, generator=torch.Generator().manual_seed(seed)) * (1 + seed % 4)
        with torch.no_grad():
            theirs, ours = converted(probe), qm(probe)
        relative = float((theirs - ours).abs().max() / theirs.abs().max())
        assert relative <= 1e-2, (seed, relative)
        close.append(relative <= 1e-5)
    assert sum(close) >= 7, close  # measured: 1 batch in 40 has such a tie
    with torch.no_grad():  # and the GEMM-input grids matter: without them torch is far
        for prefix in _directions(kw):
            for grid in ("input", "h"):
                points[f"rnn.{prefix}.{grid}"].mode = "float"
        assert float((converted(x) - qm(x)).abs().max() / converted(x).abs().max()) > 1e-4


def test_dynamic_gemm_input_points_exist_only_with_a_dynamic_spec():
    from qdebug.engine import QConfig, prepare

    model = DynamicRNN("LSTM").eval()
    (x,) = _batches({}, 1)
    assert not {"rnn.l0.input", "rnn.l0.h"} & set(quant_points(prepare(model, QConfig(), example_inputs=x)))
    dynamic = {"activation": {"dynamic": True, "signed": False, "symmetric": False}}
    qm = prepare(model, QConfig(overrides={"rnn.l0.h": dynamic}), example_inputs=x)
    points = quant_points(qm)
    assert points["rnn.l0.h"].spec.dynamic and "rnn.l0.input" not in points


def test_imported_dynamic_lstm_saves_and_reloads(tmp_path):
    import qdebug

    kw = DYNAMIC_RNN_KW
    converted = _dynamic_rnn("LSTM", "per-channel", kw)
    (x,) = _batches(kw, 1)
    qm = from_torch_ao(converted, x, float_model=DynamicRNN("LSTM", **kw))
    path = qdebug.save(qm, tmp_path / "dyn.pt", stage="calibrated", model_spec="test_interop_recurrent:DynamicRNN",
                       model_kwargs={"cell": "LSTM", **kw}, sample_inputs=x)
    loaded, info = qdebug.load(path)
    assert info.stage == "calibrated" and quant_points(loaded)["rnn.l1_reverse.h"].spec.dynamic
    probe = _batches(kw, 1)[0] * 2
    with torch.no_grad():
        assert torch.equal(loaded(probe), qm(probe))


def test_quantize_dynamic_float16_lstm_stays_float_and_is_said_so():
    converted = tq.quantize_dynamic(DynamicRNN("LSTM").eval(), {nn.LSTM}, dtype=torch.float16)
    (x,) = _batches({}, 1)
    report = import_report(from_torch_ao(converted, x, float_model=DynamicRNN("LSTM")))
    row = report.set_index("source").loc["rnn"]
    assert row["status"] == "unmapped" and "float16" in row["note"]
