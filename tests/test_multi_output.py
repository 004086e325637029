"""One quant point per output tensor (issue 28, must-have 1).

A call returning several tensors -- a leaf module's ``(a, (b, c))``, ``nn.LSTM``'s
``(output, (h_n, c_n))``, ``torch.std_mean`` -- gets one point per floating tensor,
``<call>:<path>`` (docs/engine.md, "Names"): each member is quantized with a scale of
its own range, checked here against minmax qparams computed by hand in float64.
Before, one observer saw every member, so the ±160 member set the scale of the ±1
one (a step of 1.25 for values in ±1: nothing of them survived).
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
from qdebug.engine import QConfig, calibrate, convert, engine_state, prepare, quant_points, set_mode
from qdebug.engine.members import member_paths, named_members, split_name
from qdebug.engine.plan import Plan
from qdebug.engine.point import grid_of
from qdebug.errors import QDebugError
from qdebug.measure.tap import tap

# A leaf module (the engine sees one call) with outputs of very different ranges, as an
# LSTM's hidden state (±1) and cell state (±160); a module file so checkpoints can name it.
NET_SOURCE = '''
import torch
import torch.nn as nn
from qdebug.engine.ops import register_module_category


class TwoRanges(nn.Module):
    """(tanh(x) in ±1, (x scaled to ±160, 4 x)): one call, three tensors of three meanings."""

    def forward(self, x):
        return torch.tanh(x), (160.0 * torch.tanh(x / 2), 4.0 * x)


register_module_category(TwoRanges, "fallback")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cell = TwoRanges()

    def forward(self, x):
        a, (b, c) = self.cell(self.fc(x))
        return a, b + c
'''
MEMBERS = ("cell:0", "cell:1.0", "cell:1.1")
# Which tensor of the leaf's output each member is, given its input h.
TENSORS = {"cell:0": lambda h: torch.tanh(h), "cell:1.0": lambda h: 160.0 * torch.tanh(h / 2),
           "cell:1.1": lambda h: 4.0 * h}


@pytest.fixture
def net_module(tmp_path, monkeypatch):
    name = f"qdebug_multi_out_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(NET_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__(name)
    yield sys.modules[name]
    sys.modules.pop(name, None)


def _batches(n: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(8, 4, generator=gen) * 3 for _ in range(n)]


def _net(module) -> nn.Module:
    torch.manual_seed(0)
    return module.Net().eval()


def _prepared(model: nn.Module, qconfig=None) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the leaf is a float fallback: prepare says so
        return prepare(model, qconfig, example_inputs=_batches()[0])


def _calibrated(model: nn.Module, qconfig=None) -> nn.Module:
    return calibrate(_prepared(model, qconfig), _batches())


def _minmax_affine_int8(values: list[torch.Tensor]) -> tuple[float, int]:
    """The default activation spec's qparams (int8 affine minmax), by hand in float64."""
    lo = min(0.0, min(float(v.double().min()) for v in values))
    hi = max(0.0, max(float(v.double().max()) for v in values))
    scale = (hi - lo) / 255.0
    return scale, int(min(127, max(-128, -128 - round(lo / scale))))


# -- one point per tensor -------------------------------------------------------------------------
def test_each_tensor_of_a_tuple_output_gets_its_own_point_and_minmax_scale(net_module):
    model = _net(net_module)
    qm = _calibrated(model)
    points = quant_points(qm)
    assert [n for n in points if n.startswith("cell")] == list(MEMBERS)  # no shared "cell" point
    hidden = [model.fc(x).detach() for x in _batches()]
    for name in MEMBERS:
        scale, zero_point = _minmax_affine_int8([TENSORS[name](h) for h in hidden])
        assert float(points[name].scale) == pytest.approx(scale, rel=1e-6), name
        assert int(points[name].zero_point) == zero_point, name
    # The ±1 member keeps its precision: error within half its own step, not the ±160 member's.
    set_mode(qm, "float")
    set_mode(qm, "fake", "cell:0")
    with torch.no_grad():
        a, _ = qm(_batches()[0])
        exact = torch.tanh(model.fc(_batches()[0]))
    assert float((a - exact).abs().max()) <= float(points["cell:0"].scale) / 2 + 1e-6
    assert float(points["cell:1.0"].scale) > 100 * float(points["cell:0"].scale)


class UserLSTM(nn.LSTM):
    """A user's LSTM with a forward of its own: the engine keeps it a float leaf module (the
    recurrent layers replace only plain nn.LSTM/GRU), whose tuple output gets a point per tensor."""

    def forward(self, x, hx=None):
        return super().forward(x, hx)


def test_a_float_lstm_output_hidden_and_cell_state_get_separate_points():
    torch.manual_seed(0)

    class Speaker(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = UserLSTM(4, 6, batch_first=True)
            self.fc = nn.Linear(6, 3)

        def forward(self, x):
            out, (h, c) = self.lstm(x)
            return self.fc(out[:, -1]) + c[-1].mean(-1, keepdim=True)

    model = Speaker().eval()
    with torch.no_grad():  # a cell state far beyond ±1, as in a trained speaker encoder
        model.lstm.bias_ih_l0[6:12].fill_(40.0)  # forget gate saturated open: c accumulates
        model.lstm.bias_ih_l0[12:18].fill_(40.0)  # cell input gate ~1 ...
        model.lstm.weight_ih_l0[18:24].fill_(20.0)  # ... and candidate ~±1: |c| grows with time
    x = torch.randn(2, 40, 4, generator=torch.Generator().manual_seed(1))
    qm = _calibrated_on(model, x)
    assert type(qm.lstm) is UserLSTM
    points = quant_points(qm)
    with torch.no_grad():
        out, (h, c) = model.lstm(x)
    for name, tensor in (("lstm:0", out), ("lstm:1.0", h), ("lstm:1.1", c)):
        scale, zero_point = _minmax_affine_int8([tensor.detach()])
        assert float(points[name].scale) == pytest.approx(scale, rel=1e-6), name
        assert int(points[name].zero_point) == zero_point, name
    assert "lstm" not in points
    assert float(c.abs().max()) > 10 * float(h.abs().max())  # the shared scale would have been c's
    assert float(points["lstm:1.1"].scale) > 10 * float(points["lstm:1.0"].scale)


def test_a_float_rnn_output_and_hidden_state_get_separate_points():
    torch.manual_seed(0)
    rnn = nn.RNN(3, 5, num_layers=2, batch_first=True).eval()  # a float fallback leaf: (output, h_n)
    x = torch.randn(2, 7, 3, generator=torch.Generator().manual_seed(3))
    qm = _calibrated_on(nn.Sequential(rnn), x)
    out, h = rnn(x)
    points = quant_points(qm)
    for name, tensor in (("0:0", out), ("0:1", h)):
        scale, zero_point = _minmax_affine_int8([tensor.detach()])
        assert float(points[name].scale) == pytest.approx(scale, rel=1e-6), name


def _calibrated_on(model: nn.Module, x: torch.Tensor) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return calibrate(prepare(model, example_inputs=x), [x])


class _Stats(nn.Module):
    def forward(self, x):
        std, mean = torch.std_mean(x, dim=1)  # two tensors of two meanings
        values, indices = torch.topk(x, 2, dim=1)  # one float tensor: keeps the bare name
        first, second = torch.chunk(x, 2, dim=1)  # views: stay on x's grid, no point
        return std * 100.0 + mean, values, first - second, indices


def test_inline_ops_returning_tuples_get_a_point_per_float_tensor():
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2)) + 3.0
    qm = _calibrated_on(_Stats().eval(), x)
    names = list(quant_points(qm))
    assert "std_mean:0" in names and "std_mean:1" in names and "std_mean" not in names
    assert "topk" in names and not any(n.startswith("topk:") for n in names)  # indices get no point
    assert not any(n.startswith("chunk") for n in names)
    std, mean = torch.std_mean(x, dim=1)
    for name, tensor in (("std_mean:0", std), ("std_mean:1", mean)):
        scale, zero_point = _minmax_affine_int8([tensor])
        assert float(quant_points(qm)[name].scale) == pytest.approx(scale, rel=1e-6)
    out = qm(x)
    assert out[3].dtype == torch.int64 and torch.equal(out[3], torch.topk(x, 2, dim=1).indices)


def test_member_paths_follow_the_structure_and_skip_non_float_members():
    t = torch.ones(2)
    out = (t, None, 3, [t.long(), {"mean": t, "log var": t, "k": (t, t)}])
    assert member_paths(out) == ["0", "3.1.mean", "3.1.1", "3.1.k.0", "3.1.k.1"]
    assert member_paths((t, t.long(), None)) == []  # one float tensor: the bare name
    assert [n for n, _, _ in named_members("head#2", {"mu": t, "sigma": t})] == ["head#2:mu", "head#2:sigma"]
    assert split_name("lstm#2:1.1") == ("lstm#2", "1.1")
    assert split_name("layer1.0.relu#2") == ("layer1.0.relu#2", "")


def test_a_dict_output_gets_points_by_key(net_module):
    class Head(nn.Module):
        def forward(self, x):
            return {"mean": x.mean(1), "log spread": x.std(1).log(), "n": 3}  # a key that is no name: its place

    net_module.register_module_category(Head, "fallback")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = Head()

        def forward(self, x):
            return self.head(x)

    qm = _calibrated_on(Net().eval(), torch.randn(4, 8))
    assert [n for n in quant_points(qm) if n.startswith("head")] == ["head:mean", "head:1"]


def test_a_qconfig_override_names_one_member_of_every_call(net_module):
    qconfig = QConfig.from_dict({"overrides": {"cell:1.0": {"activation": {"bits": 16}}}})
    points = quant_points(_prepared(_net(net_module), qconfig))
    assert [points[n].spec.bits for n in MEMBERS] == [8, 16, 8]


# -- plans and checkpoints ------------------------------------------------------------------------
def test_plan_carries_members_and_old_plans_keep_their_one_point(net_module):
    qm = _prepared(_net(net_module))
    plan = engine_state(qm).plan.to_dict()
    call = next(c for c in plan["calls"] if c["name"] == "cell")
    assert call["members"] == ["0", "1.0", "1.1"]
    again = Plan.from_dict(plan)
    assert again.calls["cell"].point_names() == list(MEMBERS)
    assert again.call_of_point("cell:1.1") == "cell" and again.call_of_point("fc") == "fc"
    # A plan saved before members existed: the call keeps its one point (until prepared again).
    for c in plan["calls"]:
        c.pop("members")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        old = prepare(_net(net_module), plan=plan)
    assert "cell" in quant_points(old) and not set(MEMBERS) & set(quant_points(old))


@pytest.mark.parametrize("stage", ["calibrated", "quantized"])
def test_member_points_round_trip_a_checkpoint(net_module, tmp_path, stage):
    qm = _calibrated(_net(net_module))
    if stage == "quantized":
        qm = convert(qm)
    path = qdebug.save(qm, tmp_path / f"{stage}.pt", model_spec=f"{net_module.__name__}:Net")
    loaded, info = qdebug.load(path, trusted_modules=(net_module.__name__,))
    assert info.stage == stage
    for name in MEMBERS:
        mine, theirs = quant_points(qm)[name], quant_points(loaded)[name]
        assert torch.equal(mine.scale, theirs.scale) and torch.equal(mine.zero_point, theirs.zero_point)
    x = _batches()[1]
    for a, b in zip(qm(x), loaded(x)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("change, why", [
    ({"members": ["1.1", "1.1"]}, "call 'cell' has malformed output members"),
    ({"members": ["0", "a:b"]}, "call 'cell' has malformed output members"),
    ({"members": [0, 1]}, "call 'cell' has malformed output members"),
    ({"members": "0"}, "call 'cell' has a str members"),
    ({"point": None}, "call 'cell' has output members but no point of its own"),
])
def test_a_damaged_plan_member_list_is_refused(net_module, tmp_path, change, why):
    qm = _calibrated(_net(net_module))
    path = qdebug.save(qm, tmp_path / "c.pt", model_spec=f"{net_module.__name__}:Net")
    raw = torch.load(path, weights_only=True)
    next(c for c in raw["plan"]["calls"] if c["name"] == "cell").update(change)
    torch.save(raw, path)
    with pytest.raises(QDebugError, match=why):
        qdebug.load(path, trusted_modules=(net_module.__name__,))


# -- the integer stage ------------------------------------------------------------------------------
def test_quantized_stage_tags_each_member_with_its_own_grid(net_module):
    qm = convert(_calibrated(_net(net_module)))
    points = quant_points(qm)
    seen, add_inputs = {}, []

    def listener(event):  # the members as they flow on, and as the add consumes them
        if event.call.name == "add":
            add_inputs.extend(event.args)
        if event.call.name == "cell":
            seen.update(a=event.out[0], b=event.out[1][0], c=event.out[1][1])

    x = _batches()[0]
    with tap(qm, listener), torch.no_grad():
        _, total = qm(x)
    assert grid_of(seen["a"]) is points["cell:0"]
    assert grid_of(seen["b"]) is points["cell:1.0"] and grid_of(seen["c"]) is points["cell:1.1"]
    assert [grid_of(t) for t in add_inputs] == [points["cell:1.0"], points["cell:1.1"]]
    # The integer add read b and c on their own grids: within one output step of the float64 sum.
    s = float(points["add"].scale)
    reference = seen["b"].double() + seen["c"].double()
    assert float((total.double() - reference).abs().max()) <= s * (1 + 1e-6)
    assert grid_of(total) is points["add"]


# -- the tools: one row per member ---------------------------------------------------------------
def test_compare_has_a_row_per_member_with_its_own_error(net_module):
    from qdebug.tools.compare import compare

    model = _net(net_module)
    qm = _calibrated(model)
    result = compare([("float", model), ("int8", qm)], _batches())
    rows = result.frame.set_index("layer")
    assert set(MEMBERS) <= set(rows.index) and "cell" not in rows.index
    points = quant_points(qm)
    for name in MEMBERS:  # each member's own 8-bit rounding (about 40 dB), not a shared scale's (0 dB)
        assert rows.loc[name, "isolated_sqnr_db"] > 30, name
        assert rows.loc[name, "isolated_max_abs"] <= float(points[name].scale) / 2 * (1 + 1e-5), name
    assert rows.loc["cell:1.0", "max_abs"] > 20 * rows.loc["cell:0", "max_abs"]  # rows of their own


def test_compare_and_inspect_cli_list_member_rows(net_module, tmp_path, cli):
    model = _net(net_module)
    spec = f"{net_module.__name__}:Net"
    qdebug.save(model, tmp_path / "float.pt", model_spec=spec)
    qdebug.save(_calibrated(model), tmp_path / "int8.pt", model_spec=spec)
    torch.save(torch.cat(_batches()), tmp_path / "x.pt")
    (tmp_path / "qdebug.toml").write_text(f'trust = ["{net_module.__name__}"]\n')
    result = cli("compare", "float.pt", "int8.pt", "--data", "x.pt", "--format", "csv")
    assert result.code in (0, 1), result.err
    rows = [line.split(",") for line in result.out.splitlines()]
    layer = rows[0].index("layer")
    assert [r[layer] for r in rows[1:] if r[layer].startswith("cell")] == list(MEMBERS)
    shown = cli("inspect", "int8.pt", "--format", "csv")
    assert shown.code == 0, shown.err
    assert [line.split(",")[0] for line in shown.out.splitlines() if line.startswith("cell")] == list(MEMBERS)


def test_step_and_suggest_see_member_points(net_module):
    from qdebug.tools.experiment import Experiment, Trial
    from qdebug.tools.step import step
    from qdebug.tools.suggest import candidates, suggest

    model = _net(net_module)
    qm = _calibrated(model)
    batches = _batches()
    experiment = Experiment(qm, batches, reference=model)
    assert set(MEMBERS) <= set(experiment.quantizable)
    only_a, only_c = experiment.run([Trial(frozenset({"cell:0"})), Trial(frozenset({"cell:1.1"}))])
    # Quantizing the ±1 member touches output 0 only; the cell member output 1 only.
    assert math.isinf(only_a.outputs["output1"]["sqnr_db"]) and only_a.outputs["output0"]["sqnr_db"] < 80
    assert math.isinf(only_c.outputs["output0"]["sqnr_db"]) and only_c.outputs["output1"]["sqnr_db"] < 80
    drill = step(qm, batches, reference=model, modules=["cell"], mode="drill")
    assert list(drill.frame["selection"])[1:] == list(MEMBERS)  # the drill ends at one member's point
    found = {c.glob: c for c in candidates(qm, experiment.quantizable, 16)}
    assert set(MEMBERS) <= set(found)
    assert found["cell:1.1"].points == ("cell:1.1",)
    ranked = suggest(qm, batches, reference=model, min_sqnr=45, confidence=None)
    assert set(MEMBERS) <= set(ranked.frame["point"])
    assert all(ranked.frame.set_index("point").loc[list(MEMBERS), "layer"] == "cell")


def test_suggest_candidate_of_a_member_covers_its_later_calls(net_module):
    from qdebug.tools.suggest import candidates

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = net_module.TwoRanges()

        def forward(self, x):
            a, (b, c) = self.cell(x)
            a2, (b2, c2) = self.cell(a)  # a shared leaf: points cell#2:0, cell#2:1.0, ...
            return a2 + b + c2

    qm = _calibrated_on(Twice().eval(), _batches()[0])
    names = list(quant_points(qm))
    assert {"cell#2:0", "cell#2:1.0", "cell#2:1.1"} <= set(names)
    found = {c.glob: c for c in candidates(qm, names, 16)}
    assert found["cell:1.0"].points == ("cell:1.0", "cell#2:1.0")
    assert found["cell#2:1.1"].points == ("cell#2:1.1",)
    qconfig = QConfig.from_dict({"overrides": {"cell:1.0": {"activation": {"bits": 16}}}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = prepare(Twice().eval(), qconfig, example_inputs=_batches()[0])
    assert {n: p.spec.bits for n, p in quant_points(again).items() if p.spec.bits == 16} == {
        "cell:1.0": 16, "cell#2:1.0": 16}


def test_inspect_shows_a_row_per_member(net_module):
    from qdebug.tools.inspect import inspect_model

    qm = _calibrated(_net(net_module))
    layers = inspect_model(qm, stage="calibrated").layers.set_index("layer")
    for name in MEMBERS:
        assert layers.loc[name, "act_scale_min"] == pytest.approx(float(quant_points(qm)[name].scale))
    assert "cell" not in layers.index


def test_an_untraced_call_with_a_tuple_output_gets_member_points():
    class Branchy(nn.Module):
        def forward(self, x):
            if float(x.sum()) > 1e6:  # a path the trace never takes
                return torch.std_mean(x, dim=1)
            return x + 1.0

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = prepare(Branchy().eval(), example_inputs=torch.zeros(2, 3))
        qm(torch.full((2, 3), 1e7))
    assert {"std_mean:0", "std_mean:1"} <= set(quant_points(qm))


def test_isolated_error_of_a_member_against_a_quantized_reference_is_recomputed(net_module):
    from qdebug.tools.compare import compare

    reference = _calibrated(_net(net_module))
    target = _calibrated(_net(net_module))
    set_mode(target, "float", "cell:0")  # the reference quantizes the member, the target does not
    rows = compare([("int8", reference), ("one float", target)], _batches()).frame.set_index("layer")
    # Its own error is the reference's rounding (finite), not the reference's output reused (inf).
    assert 20 < rows.loc["cell:0", "isolated_sqnr_db"] < 80
    assert math.isinf(rows.loc["cell:1.0", "isolated_sqnr_db"])


def test_calibration_check_counts_clipping_per_member(net_module):
    from qdebug.tools.calibration_check import check_calibration

    qm = _calibrated(_net(net_module))
    set_mode(qm, "float", "input")
    set_mode(qm, "float", "fc")  # wider data reaches the leaf unclamped
    wide = [x * 4 for x in _batches()]  # beyond the calibrated ranges (a and b saturate anyway)
    clipping = {row["point"]: row["clipped"] for row in check_calibration(qm, wide).clipping}
    assert "cell:1.1" in clipping and "cell" not in clipping  # 4 x: clipped where its range ends


def test_nan_watch_measures_saturation_per_member(net_module):
    from qdebug.tools.nan.detect import Watch

    qm = _calibrated(_net(net_module))
    set_mode(qm, "float", "input")
    set_mode(qm, "float", "fc")  # wider data reaches the leaf unclamped
    with Watch(qm, detail=False, saturation=True) as watch, torch.no_grad():
        watch.begin(0, None)
        qm(_batches()[0] * 4)
        saturation = {name: float(v) for name, v in watch.point_saturation.items()}
    assert set(MEMBERS) <= set(saturation) and "cell" not in saturation
    assert saturation["cell:1.1"] > 0.3  # 4 x beyond its range: its own clipped share


def test_the_fast_ranking_scores_each_member(net_module):
    from qdebug.tools.noise_score import noise_scores

    model = _net(net_module)
    qm = _calibrated(model)
    scores = noise_scores(qm, _batches(), list(MEMBERS), reference=model)
    assert scores["cell:0"] > 0 and scores["cell:1.0"] > 0, scores
    # c = 4 h with h on fc's grid, and c's range exactly 4x h's: c lies on its own grid, no noise.
    assert scores["cell:1.1"] == 0.0


def test_step_drill_and_suggest_cli_list_member_rows(net_module, tmp_path, cli):
    model = _net(net_module)
    spec = f"{net_module.__name__}:Net"
    qdebug.save(model, tmp_path / "float.pt", model_spec=spec)
    qdebug.save(_calibrated(model), tmp_path / "int8.pt", model_spec=spec)
    torch.save(torch.cat(_batches()), tmp_path / "x.pt")
    (tmp_path / "qdebug.toml").write_text(f'trust = ["{net_module.__name__}"]\n')

    def column(out: str, name: str) -> list[str]:
        rows = [line.split(",") for line in out.splitlines()]
        return [r[rows[0].index(name)] for r in rows[1:]]

    drill = cli("step", "float.pt", "int8.pt", "--data", "x.pt", "--module", "cell", "--drill", "--format", "csv")
    assert drill.code in (0, 1), drill.err
    assert [s for s in column(drill.out, "selection") if s.startswith("cell:")] == list(MEMBERS)
    plan = cli("suggest", "float.pt", "int8.pt", "--data", "x.pt", "--min-sqnr", "60", "--format", "csv")
    assert plan.code in (0, 1), plan.err
    assert set(MEMBERS) <= set(column(plan.out, "point"))
