"""``qdebug.watch``: the QAT timeline against values computed by hand, each rule of
``qdebug.tools.watch.rules`` on a planted case, and a healthy run that reports nothing."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qdebug
from qdebug.engine import QConfig, QuantSpec, calibrate, freeze_bn_stats, prepare, quant_points, set_mode
from qdebug.tools.watch.rules import findings

pytestmark = pytest.mark.usefixtures("x86_engine_one_thread")  # small models: one thread is faster on shared cores
EMA = QuantSpec(symmetric=False, observer="ema")  # running ranges in QAT, started from the first batch
PROTOTYPES = torch.randn(10, 1, 16, 16, generator=torch.Generator().manual_seed(5))


def batches(n: int, size: int, seed: int = 7, spread: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Noisy class prototypes; ``spread``: a per-image contrast and brightness (what makes the
    statistics of a batch of 4 wander)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        y = torch.randint(0, 10, (size,), generator=gen)
        x = PROTOTYPES[y] + 0.5 * torch.randn(size, 1, 16, 16, generator=gen)
        if spread:
            x = x * torch.exp(spread * torch.randn(size, 1, 1, 1, generator=gen)) \
                + spread * torch.randn(size, 1, 1, 1, generator=gen)
        out.append((x, y))
    return out


def float_with_data_statistics(make_resnet) -> nn.Module:
    """The small ResNet with BN statistics of the training data (as a trained float model has)."""
    model = make_resnet(0)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None  # a cumulative average over the batches below
    model.train()
    with torch.no_grad():
        for x, _ in batches(10, 64, seed=11, spread=1.0):
            model(x)
    for bn in bns:
        bn.momentum = 0.1
    return model.eval()


def qat_model(float_model: nn.Module, activation: QuantSpec | None = None, mode: str = "fuse_bn",
              observe: bool = False) -> nn.Module:
    qconfig = QConfig(activation=activation) if activation is not None else QConfig()  # the default: affine min/max
    qm = prepare(float_model, qconfig, mode=mode, example_inputs=PROTOTYPES[:4])
    calibrate(qm, [x for x, _ in batches(4, 16, seed=3, spread=1.0)])
    set_mode(qm, "fake", observe=observe)
    return qm.train()


def train(qm: nn.Module, data, *, lr: float, every: int, **watch_kwargs):
    opt = torch.optim.SGD(qm.parameters(), lr=lr)
    with qdebug.watch(qm, every=every, **watch_kwargs) as w:
        for x, y in data:
            loss = F.cross_entropy(qm(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    return w


def rules_found(w) -> set[str]:
    return set(w.findings["rule"])


# -- the API ---------------------------------------------------------------------------------------
def test_watch_refuses_what_it_cannot_watch(make_resnet):
    qm = qat_model(make_resnet(0))
    for bad, words in ((lambda: qdebug.watch(make_resnet(0)), "prepared"), (lambda: qdebug.watch(qm, every=0), "every"),
                       (lambda: qdebug.watch(qm, every=True), "every"), (lambda: qdebug.watch(qm, every=2.5), "every"),
                       (lambda: qdebug.watch(qm, held_out=PROTOTYPES[:2]), "float_model"),
                       (lambda: qdebug.watch(qm, float_model="float.pt"), "float_model")):
        with pytest.raises(qdebug.QDebugError, match=words) as caught:
            bad()
        assert caught.value.hint
    with pytest.raises(qdebug.QDebugError, match="outside the with block"):
        qdebug.watch(qm).step(1.0)


def test_timeline_matches_values_computed_by_hand():
    """A Linear(6, 3) watched every step: codes, flip-backs, boundary distance, update, gradient
    norm, loss, what the input point saw, its saturation and the output SQNR, recomputed here
    from the weights, scales and data directly."""
    torch.manual_seed(0)
    fm = nn.Sequential(nn.Linear(6, 3)).eval()
    x_all = torch.randn(40, 6)
    qm = prepare(fm, QConfig(), example_inputs=x_all[:4])
    calibrate(qm, [x_all[:8]])
    set_mode(qm, "fake")
    qm.train()
    point, layer = quant_points(qm)["0.weight"], qm.get_submodule("0")
    inp = quant_points(qm)["input"]
    opt = torch.optim.SGD(qm.parameters(), lr=0.5)

    def codes() -> torch.Tensor:
        return torch.clamp(torch.round(layer.weight.detach() / point.scale[:, None]), point.spec.qmin, point.spec.qmax)

    expected = []
    held = x_all[:5]
    with qdebug.watch(qm, fm, every=1, held_out=held) as w:
        history = [(codes(), layer.weight.detach().clone())]
        for step in range(5):
            x = x_all[8 + 4 * step: 12 + 4 * step] * (3.0 if step == 2 else 1.0)  # step 2 saturates the input
            loss = F.mse_loss(qm(x), torch.ones(4, 3))
            loss.backward()
            grad = float(layer.weight.grad.norm())
            opt.step()
            opt.zero_grad()
            c, wt = codes(), layer.weight.detach().clone()
            s = point.scale[:, None]
            v = wt / s
            lo = (inp.spec.qmin - inp.zero_point - 0.5) * inp.scale
            hi = (inp.spec.qmax - inp.zero_point + 0.5) * inp.scale
            row = {"code_change": float((c != history[-1][0]).float().mean()),
                   "update_to_step": float(((wt - history[-1][1]).abs() / s).mean()),
                   "boundary_distance": float((v - v.floor() - 0.5).abs().mean()),
                   "grad_norm": grad, "loss": float(loss.detach()), "data_min": float(x.min()), "data_max": float(x.max()),
                   "saturation": float(((x < lo) | (x > hi)).float().mean())}
            if len(history) >= 2:
                row["oscillation"] = float(((c != history[-1][0]) & (c == history[-2][0])).float().mean())
            history.append((c, wt))
            expected.append(row)
            w.step(loss)
    tl = w.timeline
    assert list(tl.columns) == ["step", "kind", "name", "metric", "value"]

    def value(step: int, kind: str, name: str, metric: str) -> float:
        hit = tl[(tl.step == step) & (tl.kind == kind) & (tl.name == name) & (tl.metric == metric)]
        assert len(hit) == 1, (step, kind, name, metric)
        return float(hit.value.iloc[0])

    for step, row in enumerate(expected):
        for metric in ("code_change", "update_to_step", "boundary_distance", "grad_norm", "oscillation"):
            if metric in row:
                assert value(step, "layer", "0", metric) == pytest.approx(row[metric], rel=1e-5, abs=1e-7), metric
        assert value(step, "model", "", "loss") == pytest.approx(row["loss"], rel=1e-6)
        for metric in ("data_min", "data_max", "saturation"):
            assert value(step, "point", "input", metric) == pytest.approx(row[metric], rel=1e-6), metric
    assert tl[(tl.metric == "oscillation")].step.min() == 1  # no step before the weights' start: none at step 0
    assert sum(r["code_change"] > 0 for r in expected) >= 3 and expected[2]["saturation"] > 0
    assert value(4, "point", "input", "range_max") == pytest.approx(float(inp.observer.max_val))
    assert value(4, "point", "input", "scale") == pytest.approx(float(inp.scale))
    qm.eval()
    with torch.no_grad():
        ours, theirs = qm(held).double(), fm(held).double()
    sqnr = 10 * math.log10(float((theirs ** 2).sum() / ((ours - theirs) ** 2).sum()))
    assert value(4, "model", "", "output_sqnr_db") == pytest.approx(sqnr, rel=1e-6)
    # The MSE target (all ones) pulls the output past its calibrated range (max 0.87), which stays frozen.
    found = findings(tl)
    assert list(found.rule) == ["range_frozen_early"] and list(found.name) == ["0"], found.to_string()
    assert value(2, "point", "0", "range_max") < 1 < value(2, "point", "0", "data_max")


# -- the rules -------------------------------------------------------------------------------------
def test_a_healthy_qat_run_reports_nothing(make_resnet):
    """EMA ranges started from the first batch, BN kept (with_bn) on batches of 32, watched every
    2 steps with the float model and a held-out batch: no rule fires."""
    fm = float_with_data_statistics(make_resnet)
    qm = qat_model(fm, EMA, mode="with_bn", observe=True)
    w = train(qm, batches(24, 32, spread=1.0), lr=0.01, every=2, float_model=fm,
              held_out=batches(1, 32, seed=99, spread=1.0)[0][0])
    tl = w.timeline
    assert set(tl.kind) == {"point", "layer", "bn", "model"} and sorted(set(tl.step)) == list(range(0, 24, 2))
    assert w.findings.empty, w.findings.to_string()
    assert tl[tl.metric == "output_sqnr_db"].value.min() > 15


def test_seed_000_ema_started_from_zero_is_ema_startup_bias(make_resnet):
    qm = qat_model(make_resnet(0), EMA, observe=True)
    for point in quant_points(qm).values():  # seed 000: the EMA's buffers start at 0
        if point.kind == "activation":
            point.observer.min_val.zero_()
            point.observer.max_val.zero_()
            point.update_from_observer()
    w = train(qm, batches(21, 32), lr=0.01, every=10)
    found = w.findings
    assert set(found.rule) == {"ema_startup_bias"}
    names = set(found.name)
    assert {"input", "fc"} <= names and all(found.from_step == 0)
    assert "covers 1.0% of the data's" in found.set_index("name").loc["input", "evidence"]


def test_bn_statistics_on_batches_of_4_drift_and_freezing_them_stops_it(make_resnet):
    """lr = 0: the statistics alone (docs/qat.md's case); frozen, the same run is clean."""
    fm = float_with_data_statistics(make_resnet)
    data = batches(30, 4, spread=1.0)
    w = train(qat_model(fm, mode="with_bn"), data, lr=0.0, every=5, float_model=fm)
    found = w.findings
    assert list(found.rule) == ["bn_drift"], found.to_string()
    assert "freeze_bn_stats" in found.fix.iloc[0] and found.from_step.iloc[0] >= 5
    frozen = qat_model(fm, mode="with_bn")
    freeze_bn_stats(frozen)
    w = train(frozen, data, lr=0.0, every=5, float_model=fm)
    assert w.findings.empty and w.timeline.query("kind == 'bn'").value.max() == 0


def test_weights_planted_on_rounding_boundaries_oscillate():
    """A Linear whose best weights lie halfway between two codes: the straight-through gradient
    pushes each latent weight across its boundary and back, every step."""
    torch.manual_seed(0)
    fm = nn.Sequential(nn.Linear(16, 8)).eval()
    x = torch.randn(64, 16)
    qm = prepare(fm, QConfig(), example_inputs=x[:4])
    calibrate(qm, [x])
    set_mode(qm, "fake")
    point, layer = quant_points(qm)["0.weight"], qm.get_submodule("0")
    point.freeze()  # the grid stays put
    s = point.scale[:, None]
    with torch.no_grad():
        best = (torch.floor(layer.weight / s) + 0.5) * s  # halfway between two codes
        layer.weight.copy_(best + 0.01 * s * torch.randn_like(best))
        target = F.linear(x, best, layer.bias)
    qm.train()
    opt = torch.optim.SGD(qm.parameters(), lr=0.5)
    with qdebug.watch(qm, every=5) as w:
        for step in range(20):
            loss = F.mse_loss(qm(x), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    found = w.findings
    assert list(found.rule) == ["oscillation"] and found.name.iloc[0] == "0", found.to_string()
    osc = w.timeline.query("metric == 'oscillation'")
    assert osc.value.min() > 0.2 and list(osc.step) == [5, 10, 15]  # read on steps 3-5, 8-10, 13-15: no aliasing
    assert w.timeline.query("metric == 'boundary_distance'").value.max() < 0.1  # they sit on the boundaries


def test_a_huge_learning_rate_is_a_dead_run(make_resnet):
    """lr = 1e4: the weights blow past every range, the clipped straight-through estimator passes
    no gradient, every value stays finite."""
    w = train(qat_model(make_resnet(0)), batches(16, 32), lr=1e4, every=5)
    found = w.findings
    assert list(found.rule) == ["dead_run"] and found.from_step.iloc[0] == 5, found.to_string()
    grads = w.timeline.query("kind == 'model' and metric == 'grad_norm'").value
    assert grads.iloc[0] > 0 and (grads.iloc[1:] == 0).all()


def test_weight_decay_on_learned_scales_is_scale_collapse(make_resnet):
    """LSQ activation scales with weight decay 25 at lr 0.01: each step multiplies them by 0.75
    (against LSQ's own gradient), so the points the loss does not hold up fall 10x by step 10."""
    qm = qat_model(make_resnet(0), QuantSpec(estimator="lsq"))
    scales = [p for n, p in qm.named_parameters() if n.endswith(".scale")]
    others = [p for n, p in qm.named_parameters() if not n.endswith(".scale")]
    assert scales
    opt = torch.optim.SGD([{"params": others}, {"params": scales, "weight_decay": 25.0}], lr=0.01)
    with qdebug.watch(qm, every=5) as w:
        for x, y in batches(16, 32):
            loss = F.cross_entropy(qm(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    found = w.findings
    assert set(found.rule) == {"scale_collapse"} and "avgpool" in set(found.name), found.to_string()
    scale = w.timeline.query("kind == 'point' and name == 'avgpool' and metric == 'scale'").set_index("step").value
    assert scale[10] < scale[0] / 10 and found.from_step.min() == 10 and "weight_decay=0" in found.fix.iloc[0]


def test_an_lr_far_below_the_grid_is_grid_too_coarse_for_lr(make_resnet):
    """lr = 1e-5: every layer's weights move about 1e-4 of a grid step a step and no code changes;
    at lr 0 (nothing moves at all) the rule stays silent."""
    w = train(qat_model(make_resnet(0)), batches(11, 32), lr=1e-5, every=5)
    found = w.findings
    layers = set(w.timeline.query("kind == 'layer'").name)
    assert list(set(found.rule)) == ["grid_too_coarse_for_lr"] and set(found.name) == layers, found.to_string()
    assert (found.from_step == 0).all() and "raise the learning rate" in found.fix.iloc[0]
    assert w.timeline.query("metric == 'update_to_step'").value.max() < 1e-3
    assert train(qat_model(make_resnet(0)), batches(6, 32), lr=0.0, every=5).findings.empty


def test_a_frozen_range_outgrown_by_its_data_is_range_frozen_early(make_resnet):
    """Calibrated ranges frozen (QAT's default), inputs growing 20% a step: the input point
    saturates more and more; with the observers running (observe=True) nothing is reported."""
    data = [(x * (1 + 0.2 * i), y) for i, (x, y) in enumerate(batches(16, 32))]
    found = {}
    for observe in (False, True):
        qm = prepare(make_resnet(0), QConfig(), example_inputs=PROTOTYPES[:4])
        calibrate(qm, [x for x, _ in batches(2, 32, seed=3)])
        set_mode(qm, "fake", observe=observe)
        found[observe] = train(qm.train(), data, lr=0.01, every=5).findings
    frozen = found[False].set_index("name")
    assert set(frozen.rule) == {"range_frozen_early"} and frozen.loc["input", "from_step"] == 5, frozen.to_string()
    assert "observe=True" in frozen.loc["input", "fix"]
    assert found[True].empty, found[True].to_string()


def test_steps_between_looks_run_without_hooks(make_resnet):
    qm = qat_model(make_resnet(0))
    before = len(qdebug.engine.engine_state(qm).listeners)
    with qdebug.watch(qm, every=4) as w:
        opt = torch.optim.SGD(qm.parameters(), lr=0.01)
        for step, (x, y) in enumerate(batches(6, 8)):
            hooked = len(qdebug.engine.engine_state(qm).listeners) - before
            assert hooked == (1 if step % 4 == 0 else 0), step
            loss = F.cross_entropy(qm(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step(loss)
    assert len(qdebug.engine.engine_state(qm).listeners) == before
    assert sorted(set(w.timeline.step)) == [0, 4]
    copy.deepcopy(qm)  # nothing of the watch is left on the model
