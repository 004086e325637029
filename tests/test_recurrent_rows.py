"""A row per quant point inside an LSTM/GRU in compare, step --drill and suggest (issue 28, item 1).

compare's step rows (``qdebug.tools.recurrent_rows``) are checked against torch's own
``nn.LSTMCell``/``nn.GRUCell`` run step by step and fake quantization written here in
float64 -- never the engine against itself.
"""

from __future__ import annotations

import math
import sys
import uuid
import warnings

import pytest
import torch
import torch.nn as nn

import qdebug
from qdebug.engine import calibrate, prepare, quant_points, set_mode

NET_SOURCE = '''
import torch
import torch.nn as nn


class Speaker(nn.Module):
    """An LSTM (or GRU) encoder and a head: the recurrent layer's points and its outputs."""

    def __init__(self, kind="lstm"):
        super().__init__()
        self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(4, 6, batch_first=True)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(out[:, -1])


class Gru(Speaker):
    def __init__(self):
        super().__init__("gru")
'''
LSTM_ROWS = ["rnn.l0." + s for s in ("igates", "hgates", "gates", "input_gate", "forget_gate", "cell_gate",
                                     "output_gate", "fgate_cx", "igate_cgate", "cell", "hidden")]
GRU_ROWS = ["rnn.l0." + s for s in ("igates", "hgates", "gates", "reset_gate", "update_gate", "rgate_hn",
                                    "new_gates", "new_gate", "hdiff", "update", "hidden")]


@pytest.fixture
def nets(tmp_path, monkeypatch):
    name = f"qdebug_rnn_rows_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(NET_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__(name)
    yield sys.modules[name]
    sys.modules.pop(name, None)


def _batches(n: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(3, 7, 4, generator=gen) * 2 for _ in range(n)]


def _calibrated(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return calibrate(prepare(model, example_inputs=_batches()[0]), _batches())


def _fq(x: torch.Tensor, point) -> torch.Tensor:
    """Per-tensor affine fake quantization in float64, by hand."""
    s, z = float(point.scale), int(point.zero_point)
    q = torch.clamp(torch.round(x.double() / s) + z, point.spec.qmin, point.spec.qmax)
    return (q - z) * s


def _sqnr(x: torch.Tensor, y: torch.Tensor) -> float:
    e = (y.double() - x.double()).pow(2).sum()
    return math.inf if e == 0 else float(10 * torch.log10(x.double().pow(2).sum() / e))


@torch.no_grad()
def _lstm_reference(lstm: nn.LSTM, xs: list[torch.Tensor], cell_point=None):
    """(gates' forget gate, cell state) at every step of every batch, with torch's LSTMCell; with
    ``cell_point``, the cell state fake-quantized by hand at every step (the only point on)."""
    cell = nn.LSTMCell(lstm.input_size, lstm.hidden_size)
    cell.load_state_dict({k[:-3]: v for k, v in lstm.state_dict().items()})
    forget, cells = [], []
    for x in xs:
        h = torch.zeros(x.shape[0], lstm.hidden_size)
        c = torch.zeros_like(h)
        for t in range(x.shape[1]):
            gates = x[:, t] @ cell.weight_ih.T + cell.bias_ih + h @ cell.weight_hh.T + cell.bias_hh
            i, f, g, o = gates.chunk(4, -1)
            if cell_point is None:
                h, c = cell(x[:, t], (h, c))  # torch's own kernel
            else:
                c = _fq(torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g), cell_point).float()
                h = torch.sigmoid(o) * torch.tanh(c)
            forget.append(torch.sigmoid(f))
            cells.append(c)
    return torch.cat(forget), torch.cat(cells)


def test_compare_has_a_row_per_lstm_point_before_its_outputs(nets):
    from qdebug.tools.compare import compare

    torch.manual_seed(0)
    model = nets.Speaker().eval()
    qm = _calibrated(model)
    frame = compare([("float", model), ("int8", qm)], _batches()).frame
    layers = list(frame["layer"])
    assert layers == ["input", *LSTM_ROWS, "rnn:0", "rnn:1.0", "rnn:1.1", "fc"]
    assert set(LSTM_ROWS) <= set(quant_points(qm))  # each row is a point's own name
    rows = frame.set_index("layer")
    assert rows.loc["rnn.l0.cell", "type"] == "LSTM.cell" and (rows.loc[LSTM_ROWS, "note"] == "").all()
    # The int16 cell state rounds far less (its own step) than the int8 gates.
    assert rows.loc["rnn.l0.cell", "isolated_sqnr_db"] > rows.loc["rnn.l0.forget_gate", "isolated_sqnr_db"] + 20


def test_lstm_step_rows_match_torchs_lstm_cell_and_hand_fake_quantization(nets):
    from qdebug.tools.compare import compare

    torch.manual_seed(0)
    model = nets.Speaker().eval()
    qm = _calibrated(model)
    points = quant_points(qm)
    set_mode(qm, "float")
    set_mode(qm, "fake", "rnn.l0.cell")  # one point on: its row's errors are known in closed form
    xs = _batches()
    rows = compare([("float", model), ("cell only", qm)], xs).frame.set_index("layer")
    forget, cells = _lstm_reference(model.rnn, xs)
    _, cells_q = _lstm_reference(model.rnn, xs, points["rnn.l0.cell"])
    # Propagated: the quantized cell state fed back step after step, vs torch's LSTMCell.
    assert rows.loc["rnn.l0.cell", "sqnr_db"] == pytest.approx(_sqnr(cells, cells_q), abs=0.05)
    # Isolated: the point alone on the reference's cell state at every step.
    assert rows.loc["rnn.l0.cell", "isolated_sqnr_db"] == pytest.approx(_sqnr(cells, _fq(cells, points["rnn.l0.cell"])),
                                                                        abs=0.01)
    # (float32 values rounded in float32 by the engine: within 1% of the float64 worst case, and
    # never beyond half a step)
    assert rows.loc["rnn.l0.cell", "isolated_max_abs"] == pytest.approx(
        float((_fq(cells, points["rnn.l0.cell"]) - cells.double()).abs().max()), rel=1e-2)
    assert rows.loc["rnn.l0.cell", "isolated_max_abs"] <= float(points["rnn.l0.cell"].scale) / 2 * (1 + 1e-4)
    # A point left in float: its isolated error is none; its propagated one the cell's echo.
    assert math.isinf(rows.loc["rnn.l0.forget_gate", "isolated_sqnr_db"])
    assert rows.loc["rnn.l0.forget_gate", "sqnr_db"] > 40
    # x is torch's float forget gate (the reference row): the float run of the loop is torch's.
    float_rows = compare([("float", model), ("all float", _float_copy(qm))], xs).frame.set_index("layer")
    assert float_rows.loc["rnn.l0.forget_gate", "sqnr_db"] > 120 and forget.numel() > 0


def _float_copy(qm: nn.Module) -> nn.Module:
    import copy

    other = copy.deepcopy(qm)
    set_mode(other, "float")
    return other


def test_gru_step_rows_isolated_error_is_each_points_own(nets):
    from qdebug.tools.compare import compare

    torch.manual_seed(1)
    model = nets.Gru().eval()
    qm = _calibrated(model)
    points = quant_points(qm)
    xs = _batches()
    frame = compare([("float", model), ("int8", qm)], xs).frame
    assert list(frame["layer"]) == ["input", *GRU_ROWS, "rnn:0", "rnn:1", "fc"]
    rows = frame.set_index("layer")
    gru, cell = model.rnn, nn.GRUCell(4, 6)
    cell.load_state_dict({k[:-3]: v for k, v in gru.state_dict().items()})
    update_gates, hiddens = [], []
    with torch.no_grad():
        for x in xs:  # torch's GRUCell, step by step; the update gate by hand from its weights
            h = torch.zeros(x.shape[0], 6)
            for t in range(x.shape[1]):
                z = (x[:, t] @ cell.weight_ih[6:12].T + cell.bias_ih[6:12] + h @ cell.weight_hh[6:12].T
                     + cell.bias_hh[6:12])
                update_gates.append(torch.sigmoid(z))
                h = cell(x[:, t], h)
                hiddens.append(h)
    z, h = torch.cat(update_gates), torch.cat(hiddens)
    # The teacher-forced replay: sigmoid of the reference's gates, then the point; hidden likewise.
    assert rows.loc["rnn.l0.update_gate", "isolated_sqnr_db"] == pytest.approx(
        _sqnr(z, _fq(z, points["rnn.l0.update_gate"])), abs=0.02)
    assert rows.loc["rnn.l0.hidden", "isolated_sqnr_db"] == pytest.approx(
        _sqnr(h, _fq(h, points["rnn.l0.hidden"])), abs=0.02)


def test_step_rows_without_the_isolated_pass_and_for_a_second_call(nets):
    from qdebug.tools.compare import compare

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(4, 4, batch_first=True)

        def forward(self, x):
            out, _ = self.rnn(x)
            again, _ = self.rnn(out)
            return again

    torch.manual_seed(2)
    model = Twice().eval()
    qm = _calibrated(model)
    frame = compare([("float", model), ("int8", qm)], _batches(), isolated=False).frame
    layers = list(frame["layer"])
    assert [n for n in layers if n.startswith("rnn#2.")] == [r.replace("rnn.", "rnn#2.") for r in GRU_ROWS]
    rows = frame.set_index("layer")
    assert (rows.loc[GRU_ROWS, "note"] == "").all() and rows.loc["rnn#2.l0.hidden", "sqnr_db"] > 0
    assert rows["isolated_sqnr_db"].isna().all()


def test_cli_compare_step_drill_and_suggest_show_lstm_points(nets, tmp_path, cli):
    torch.manual_seed(0)
    model = nets.Speaker().eval()
    spec = f"{nets.__name__}:Speaker"
    qdebug.save(model, tmp_path / "float.pt", model_spec=spec)
    qm = _calibrated(model)
    qdebug.save(qm, tmp_path / "int8.pt", model_spec=spec)
    int16 = {n for n, p in quant_points(qm).items() if p.spec.bits >= 16}  # the cell state's points
    torch.save(torch.cat(_batches()), tmp_path / "x.pt")
    (tmp_path / "qdebug.toml").write_text(f'trust = ["{nets.__name__}"]\n')
    shown = cli("compare", "float.pt", "int8.pt", "--data", "x.pt", "--format", "csv")
    assert shown.code in (0, 1), shown.err
    lines = [line.split(",") for line in shown.out.splitlines()]
    layer = lines[0].index("layer")
    assert [r[layer] for r in lines[1:] if r[layer].startswith("rnn")] == [*LSTM_ROWS, "rnn:0", "rnn:1.0", "rnn:1.1"]
    drill = cli("step", "float.pt", "int8.pt", "--data", "x.pt", "--drill", "--format", "csv")
    assert drill.code in (0, 1), drill.err
    for name in LSTM_ROWS:  # the drill ends inside the layer: a row per point
        assert f"\n{name}," in drill.out or f",{name}," in drill.out, name
    plan = cli("suggest", "float.pt", "int8.pt", "--data", "x.pt", "--min-sqnr", "60", "--format", "csv")
    assert plan.code in (0, 1), plan.err
    listed = {line.split(",")[1] for line in plan.out.splitlines()[1:]}
    # Every int8 point is a candidate row; the cell state's are int16 already (no candidate).
    assert "rnn.l0.cell" in int16 and set(LSTM_ROWS) - int16 <= listed and not int16 & listed


def test_an_int8_cell_rows_own_error_is_named_cell_state_range_and_a_gate_rows_is_not():
    from test_diagnoses_modern import FLAG_EVERYTHING, _batches as speech_batches, _calibrated as calibrated, \
        _diagnoses, _speech

    batches = speech_batches((2, 16, 8), n=1)
    int8_cell = {"overrides": {"lstm.*.cell": {"activation": {"bits": 8}}}}
    diagnoses, _ = _diagnoses(_speech(), calibrated(_speech(), batches, int8_cell), batches, thresholds=FLAG_EVERYTHING)
    assert diagnoses["lstm.l0.cell"] == "cell_state_range", diagnoses
    assert diagnoses["lstm.l0.forget_gate"] not in ("", "cell_state_range"), diagnoses  # flagged, its own cause
    # The int16 default: the cell row's own error is no cell-state problem.
    diagnoses, _ = _diagnoses(_speech(), calibrated(_speech(), batches), batches, thresholds=FLAG_EVERYTHING)
    assert diagnoses["lstm.l0.cell"] not in ("", "cell_state_range"), diagnoses
