"""Recurrent layers (issue 28, item 2): LSTM/GRU and their cells as the engine's own layers.

Oracles: torch's ``nn.LSTM``/``nn.GRU`` kernels (float mode, bit for bit) and torch.ao's
quantizable LSTM with torch's FakeQuantize modules at its observer sites, given the same
qparams (fake-quant mode, bit for bit).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn

import qdebug
from qdebug.engine import QConfig, calibrate, prepare, quant_points, set_mode
from qdebug.engine.recurrent import QGRU, QGRUCell, QLSTM, QLSTMCell
from qdebug.errors import QDebugError


class Wrap(nn.Module):
    """A model holding one recurrent layer ``rnn``, optionally given an initial state."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, *state):
        if not state:
            return self.rnn(x)
        return self.rnn(x, state[0] if len(state) == 1 else tuple(state))


class SpeechLSTM(nn.Module):
    """A small speaker-encoder-like model: 40 mel bins -> LSTM(64) -> embedding of the last state."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(40, 64, batch_first=True)
        self.head = nn.Linear(64, 32)

    def forward(self, mels):
        _, (h, _) = self.lstm(mels)
        return self.head(h[-1])


def _run(rnn, x, state=()):
    return rnn(x) if not state else rnn(x, state[0] if len(state) == 1 else tuple(state))


def _prepare(model, *inputs, qconfig=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # oneDNN's "projections not supported" notice
        return prepare(model, qconfig or QConfig(), example_inputs=inputs if len(inputs) > 1 else inputs[0])


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return 10 * math.log10(float(ref.pow(2).sum()) / float((ref - out).pow(2).sum()))


def _seq_input(kw: dict, batch: int = 3, steps: int = 6, features: int = 8, unbatched: bool = False):
    if unbatched:
        return torch.randn(steps, features)
    return torch.randn(batch, steps, features) if kw.get("batch_first") else torch.randn(steps, batch, features)


LSTM_CONFIGS = [
    dict(),
    dict(num_layers=2),
    dict(num_layers=2, bidirectional=True),
    dict(batch_first=True),
    dict(proj_size=5),
    dict(num_layers=2, bidirectional=True, batch_first=True, proj_size=5),
    dict(bias=False),
]


def _initial_state(rnn: nn.Module, x: torch.Tensor, kw: dict, unbatched: bool):
    directions = 2 if kw.get("bidirectional") else 1
    layers = kw.get("num_layers", 1) * directions
    batch = () if unbatched else (x.shape[0] if kw.get("batch_first") else x.shape[1],)
    h = torch.randn(layers, *batch, getattr(rnn, "proj_size", 0) or rnn.hidden_size)
    if isinstance(rnn, nn.LSTM):
        return (h, torch.randn(layers, *batch, rnn.hidden_size))
    return (h,)


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("kw", LSTM_CONFIGS)
@pytest.mark.parametrize("with_state", [False, True])
def test_float_mode_is_bit_identical_to_torch(kind, kw, with_state):
    if kind is nn.GRU and "proj_size" in kw:
        pytest.skip("nn.GRU has no proj_size")
    torch.manual_seed(0)
    rnn = kind(8, 7, **kw).eval()
    model = Wrap(rnn)
    x = _seq_input(kw)
    state = _initial_state(rnn, x, kw, False) if with_state else ()
    qm = _prepare(model, x, *state)
    assert type(qm.rnn) is (QLSTM if kind is nn.LSTM else QGRU)  # swapped, with points inside
    assert any(name.startswith("rnn.l0.") for name in quant_points(qm))
    with torch.no_grad():
        assert _equal(qm(x, *state), model(x, *state))
        assert _equal(_run(qm.rnn, x, state), _run(rnn, x, state))  # the layer alone too (no context)
        x1 = _seq_input(kw, unbatched=True)  # unbatched input, same prepared model
        state1 = _initial_state(rnn, x1, kw, True) if with_state else ()
        assert _equal(qm(x1, *state1), model(x1, *state1))


@pytest.mark.parametrize("kind", [nn.LSTMCell, nn.GRUCell])
@pytest.mark.parametrize("unbatched", [False, True])
def test_cells_float_mode_is_bit_identical_to_torch(kind, unbatched):
    torch.manual_seed(1)
    cell = kind(8, 7).eval()
    x = torch.randn(8) if unbatched else torch.randn(3, 8)
    qm = _prepare(Wrap(cell), x)
    assert type(qm.rnn) is (QLSTMCell if kind is nn.LSTMCell else QGRUCell)
    assert "rnn.igates" in quant_points(qm) and "rnn.weight_ih" in quant_points(qm)
    with torch.no_grad():
        assert _equal(qm(x), cell(x))


def test_float_state_dict_loads_unchanged():
    torch.manual_seed(2)
    model = Wrap(nn.LSTM(8, 7, num_layers=2, bidirectional=True, proj_size=3))
    x = torch.randn(4, 2, 8)
    qm = _prepare(model, x)
    twin = nn.LSTM(8, 7, num_layers=2, bidirectional=True, proj_size=3).eval()
    assert list(qm.rnn.state_dict()) == list(twin.state_dict())  # torch's keys, no point buffers
    qm.rnn.load_state_dict(twin.state_dict())  # strict
    with torch.no_grad():
        assert _equal(qm.rnn(x), twin(x))


# -- fake quant: torch.ao's quantizable LSTM, same qparams ------------------------------------
def _torch_fake_quant(point):
    """A torch FakeQuantize holding ``point``'s qparams and integer range, observer off."""
    from torch.ao.quantization import FakeQuantize, MinMaxObserver, PerChannelMinMaxObserver

    spec = point.spec
    dtype = torch.qint32 if spec.bits > 8 else (torch.qint8 if spec.signed else torch.quint8)
    if spec.per_channel:
        fq = FakeQuantize(observer=PerChannelMinMaxObserver, quant_min=spec.qmin, quant_max=spec.qmax, dtype=dtype,
                          qscheme=torch.per_channel_symmetric, ch_axis=spec.ch_axis)
    else:
        fq = FakeQuantize(observer=MinMaxObserver, quant_min=spec.qmin, quant_max=spec.qmax, dtype=dtype,
                          qscheme=torch.per_tensor_affine)
    fq.disable_observer()
    fq.scale = point.scale.detach().clone().reshape(-1)
    fq.zero_point = point.zero_point.clone().reshape(-1)
    return fq


TORCH_AO_SITES = {  # torch.ao's cell attribute -> this engine's step point
    "igates": "igates", "hgates": "hgates", "gates": "gates", "input_gate": "input_gate",
    "forget_gate": "forget_gate", "cell_gate": "cell_gate", "output_gate": "output_gate", "fgate_cx": "fgate_cx",
    "igate_cgate": "igate_cgate", "fgate_cx_igate_cgate": "cell", "ogate_cy": "hidden",
}


def _load_sites(cell, points: dict, prefix: str, weight_suffix: str) -> None:
    """Put the engine's qparams into torch.ao's cell: each observer site, both weights."""
    for site, local in TORCH_AO_SITES.items():
        getattr(cell, site).activation_post_process = _torch_fake_quant(points[f"{prefix}{local}"])
    cell.igates.weight_fake_quant = _torch_fake_quant(points[f"weight_ih{weight_suffix}"])
    cell.hgates.weight_fake_quant = _torch_fake_quant(points[f"weight_hh{weight_suffix}"])


def _torch_ao_qconfig():
    from torch.ao.quantization import FakeQuantize, MinMaxObserver, PerChannelMinMaxObserver
    from torch.ao.quantization import QConfig as AOQConfig

    return AOQConfig(
        activation=FakeQuantize.with_args(observer=MinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8),
        weight=FakeQuantize.with_args(observer=PerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                                      dtype=torch.qint8, qscheme=torch.per_channel_symmetric))


@pytest.mark.parametrize("kw,with_state", [
    (dict(), False),
    (dict(num_layers=2, bidirectional=True, batch_first=True), True),
])
def test_fake_quant_lstm_is_bit_identical_to_torch_ao_quantizable_lstm(kw, with_state):
    import torch.ao.nn.quantizable as nnqa

    torch.manual_seed(3)
    lstm = nn.LSTM(8, 16, **kw)
    x = _seq_input(kw, steps=7)
    state = _initial_state(lstm, x, kw, False) if with_state else ()
    qm = _prepare(Wrap(lstm), x, *state)
    calibrate(qm, [(_seq_input(kw, steps=7), *state) if state else _seq_input(kw, steps=7) for _ in range(3)])
    assert qm.rnn.qpoints["l0.cell"].spec.bits == 16  # the default under test: int16 cell state
    lstm.qconfig = _torch_ao_qconfig()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lstm.train()
        ao = nnqa.LSTM.from_float(lstm)  # torch.ao's own QAT prepare of its quantizable LSTM
    for k, layer in enumerate(ao.layers):
        _load_sites(layer.layer_fw.cell, qm.rnn.qpoints, f"l{k}.", f"_l{k}")
        if kw.get("bidirectional"):
            _load_sites(layer.layer_bw.cell, qm.rnn.qpoints, f"l{k}_reverse.", f"_l{k}_reverse")
    ao.eval()
    with torch.no_grad():
        ours, theirs, float_out = (_run(m, x, state) for m in (qm.rnn, ao, lstm))
    assert _equal(ours, theirs)
    assert not torch.equal(ours[0], float_out[0])  # fake quant did act
    assert _sqnr(float_out[0], ours[0]) > 25


def test_fake_quant_lstm_cell_is_bit_identical_to_torch_ao():
    import torch.ao.nn.quantizable as nnqa

    torch.manual_seed(4)
    cell = nn.LSTMCell(8, 16)
    x, h, c = torch.randn(3, 8), torch.randn(3, 16), torch.randn(3, 16)
    qm = _prepare(Wrap(cell), x, h, c)
    calibrate(qm, [(torch.randn(3, 8), torch.randn(3, 16), torch.randn(3, 16)) for _ in range(2)])
    cell.qconfig = _torch_ao_qconfig()
    ao = nnqa.LSTMCell.from_float(cell)
    ao.train()
    torch.ao.quantization.prepare_qat(ao, inplace=True)
    _load_sites(ao, qm.rnn.qpoints, "", "")
    ao.eval()
    with torch.no_grad():
        assert _equal(qm.rnn(x, (h, c)), ao(x, (h, c)))


# -- specs, points, save/load -------------------------------------------------------------------
def test_cell_state_is_int16_by_default_and_overrides_change_it():
    torch.manual_seed(5)
    x = torch.randn(5, 2, 8)
    points = quant_points(_prepare(Wrap(nn.LSTM(8, 7)), x))
    assert points["rnn.l0.cell"].spec.bits == 16 and points["rnn.l0.cell"].spec.describe().startswith("int16")
    assert points["rnn.l0.hidden"].spec.bits == 8 and points["rnn.l0.gates"].spec.bits == 8
    weight = points["rnn.weight_ih_l0"].spec
    assert weight.per_channel and weight.ch_axis == 0  # one scale per gate row (4H)
    eight = QConfig.from_dict({"overrides": {"rnn.*.cell": {"activation": {"bits": 8}}}})
    assert quant_points(_prepare(Wrap(nn.LSTM(8, 7)), x, qconfig=eight))["rnn.l0.cell"].spec.bits == 8
    ema = QConfig.from_dict({"overrides": {"rnn": {"activation": {"observer": "ema"}}}})
    cell = quant_points(_prepare(Wrap(nn.LSTM(8, 7)), x, qconfig=ema))["rnn.l0.cell"].spec
    assert (cell.bits, cell.observer) == (16, "ema")  # an override refines the int16 default
    off = QConfig.from_dict({"overrides": {"rnn": {"activation": None}}})
    assert not any(n.startswith("rnn.l0") for n in quant_points(_prepare(Wrap(nn.LSTM(8, 7)), x, qconfig=off)))


def test_weights_are_quantized_per_gate_row():
    torch.manual_seed(6)
    x = torch.randn(5, 2, 8)
    qm = _prepare(Wrap(nn.LSTM(8, 7)), x)
    calibrate(qm, [x])
    with torch.no_grad():
        qm(x)
    point = quant_points(qm)["rnn.weight_hh_l0"]
    assert point.scale.shape == (28,)  # 4H rows: i, f, g, o gates of 7 units
    expected = qm.rnn.weight_hh_l0.detach().abs().amax(1) / 127
    assert torch.allclose(point.scale, expected)


def test_quant_points_and_set_mode_reach_the_inner_points():
    torch.manual_seed(7)
    x = torch.randn(5, 2, 8)
    model = Wrap(nn.GRU(8, 7, num_layers=2, bidirectional=True))
    qm = _prepare(model, x)
    names = list(quant_points(qm))
    for prefix in ("rnn.l0.", "rnn.l0_reverse.", "rnn.l1.", "rnn.l1_reverse."):
        assert [n for n in names if n.startswith(prefix)] == [prefix + s for s in (
            "igates", "hgates", "gates", "reset_gate", "update_gate", "rgate_hn", "new_gates", "new_gate", "hdiff",
            "update", "hidden")]
    calibrate(qm, [x])
    assert all(p.initialized for n, p in quant_points(qm).items() if n.startswith("rnn.l"))
    with torch.no_grad():
        fake = qm(x)
        assert not _equal(fake, model(x))
        assert _sqnr(model(x)[0], fake[0]) > 20
        changed = set_mode(qm, "float", "rnn")
        assert "rnn.l1_reverse.hidden" in changed and "rnn.weight_hh_l1_reverse" in changed
        set_mode(qm, "float", "input")
        assert _equal(qm(x), model(x))


def test_save_load_round_trip(tmp_path):
    torch.manual_seed(8)
    mels = torch.randn(4, 20, 40)
    qm = _prepare(SpeechLSTM().eval(), mels)
    calibrate(qm, [torch.randn(4, 20, 40) for _ in range(2)])
    path = qdebug.save(qm, tmp_path / "calibrated.pt", stage="calibrated")
    loaded, info = qdebug.load(path, model=f"{SpeechLSTM.__module__}:SpeechLSTM")
    assert info.stage == "calibrated" and type(loaded.lstm) is QLSTM
    with torch.no_grad():
        assert torch.equal(loaded(mels), qm(mels))
    for name, point in quant_points(qm).items():
        twin = quant_points(loaded)[name]
        assert torch.equal(twin.scale, point.scale) and torch.equal(twin.zero_point, point.zero_point), name


def test_speech_lstm_keeps_its_sqnr_when_only_the_lstm_is_quantized():
    torch.manual_seed(9)
    model = SpeechLSTM().eval()
    mels = torch.randn(8, 50, 40)
    qm = _prepare(model, mels)
    calibrate(qm, [torch.randn(8, 50, 40) for _ in range(4)])
    set_mode(qm, "float")
    set_mode(qm, "fake", "lstm")
    with torch.no_grad():
        sqnr = _sqnr(model(mels), qm(mels))
    assert sqnr >= 30, sqnr  # measured 36.3 dB (int8 weights and activations, int16 cell state)


def test_packed_sequence_is_refused_in_fake_mode():
    torch.manual_seed(10)
    x = torch.randn(5, 2, 8)
    qm = _prepare(Wrap(nn.LSTM(8, 7)), x)
    calibrate(qm, [x])
    packed = nn.utils.rnn.pack_padded_sequence(x, [5, 3])
    with pytest.raises(QDebugError, match="PackedSequence"):
        qm.rnn(packed)


def test_lstm_subclass_with_its_own_forward_stays_a_reported_fallback():
    class Custom(nn.LSTM):
        def forward(self, x, hx=None):
            return super().forward(x * 2, hx)

    x = torch.randn(5, 2, 8)
    with pytest.warns(UserWarning, match="rnn"):
        qm = prepare(Wrap(Custom(8, 7)), QConfig(), example_inputs=x)
    assert type(qm.rnn) is Custom
    assert not any(n.startswith("rnn.l0") for n in quant_points(qm))


class LSTMThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.lstm(x)[0])


def test_quantized_stage_consumer_of_the_lstm_output_runs_in_integer():
    from qdebug.engine import convert

    torch.manual_seed(11)
    x = torch.randn(3, 6, 8)
    qm = _prepare(LSTMThenLinear().eval(), x)
    calibrate(qm, [x])
    with torch.no_grad():
        fake = qm(x)
        cq = convert(qm)
        integer = cq(x)
    assert cq.fc.integer_fallbacks == 0  # the output carries its hidden point's grid
    step = quant_points(qm)["fc"].scale
    assert (fake - integer).abs().max() <= step  # integer Linear: within one output step of fake quant


def test_step_and_suggest_see_the_points_inside_the_lstm():
    torch.manual_seed(12)
    model = SpeechLSTM().eval()
    mels = [torch.randn(4, 20, 40) for _ in range(2)]
    qm = _prepare(model, mels[0])
    calibrate(qm, mels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frame = qdebug.step(model, qm, data=mels, module="lstm")
    split = frame[(frame["mode"] == "split") & (frame["kind"] == "activation")]
    assert len(split) == 1 and math.isfinite(split["sqnr_db"].iloc[0])  # was inf: served as float
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranked = qdebug.suggest(model, qm, data=mels, min_sqnr=60)
    inner = ranked[ranked["point"].str.startswith("lstm.l0.")]
    assert len(inner) >= 8 and (inner["gain_db"].abs() > 0).any()  # was 0 for every one


def test_step_counts_an_lstms_multiply_accumulates_and_parameters():
    """Every gate weight is used once per time step: an LSTM's MACs per sample are
    steps x its weights' elements (they were 0, so step called the LSTM free)."""
    torch.manual_seed(13)
    model = SpeechLSTM().eval()
    mels = [torch.randn(4, 20, 40) for _ in range(2)]
    qm = _prepare(model, mels[0])
    calibrate(qm, mels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frame = qdebug.step(model, qm, data=mels)
    lstm_macs = 20 * sum(p.numel() for n, p in model.lstm.named_parameters() if n.startswith("weight"))
    head_macs = model.head.weight.numel()  # the head sees one vector per sample (the last hidden state)
    row = frame[frame["selection"] == "lstm"].iloc[0]
    assert row["macs_share"] == pytest.approx(lstm_macs / (lstm_macs + head_macs))
    params = sum(p.numel() for p in model.parameters())
    assert row["params_share"] == pytest.approx(sum(p.numel() for p in model.lstm.parameters()) / params)


def test_suggest_names_each_gate_matrix_and_counts_its_own_share():
    """A recurrent layer has several weight points: each candidate is one of them (its own glob,
    so a plan changes what was verified), with its own share of the layer's MACs."""
    torch.manual_seed(12)
    model = SpeechLSTM().eval()
    mels = [torch.randn(4, 20, 40) for _ in range(2)]
    qm = _prepare(model, mels[0])
    calibrate(qm, mels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranked = qdebug.suggest(model, qm, data=mels, min_sqnr=60)
    weights = ranked[(ranked["kind"] == "weight") & (ranked["layer"] == "lstm")].set_index("point")
    assert set(weights.index) == {"lstm.weight_ih_l0", "lstm.weight_hh_l0"}
    ih, hh = model.lstm.weight_ih_l0.numel(), model.lstm.weight_hh_l0.numel()
    ratio = weights.loc["lstm.weight_ih_l0", "macs_share"] / weights.loc["lstm.weight_hh_l0", "macs_share"]
    assert ratio == pytest.approx(ih / hh)


def test_inspect_lists_the_points_inside_an_lstm_not_a_float_layer():
    from qdebug.tools.inspect import inspect_model

    torch.manual_seed(12)
    model = SpeechLSTM().eval()
    mels = [torch.randn(4, 20, 40) for _ in range(2)]
    qm = _prepare(model, mels[0])
    calibrate(qm, mels)
    layers = inspect_model(qm, stage="calibrated").layers.set_index("layer")
    assert "lstm" not in layers.index  # was one row: activation float, mode float
    assert layers.loc["lstm.l0.cell", "activation"].startswith("int16")
    assert layers.loc["lstm.weight_ih_l0", "weight"].startswith("int8")
    assert (layers.loc[[n for n in layers.index if n.startswith("lstm.")], "mode"] == "fake").all()
