"""nan-trace: planted non-finite values, each found at its phase and layer, with its cause.

Every case plants one known mechanism and asserts where the first non-finite value is
(phase, layer), that the layer created it when it did, and the cause the rules give; the
CLI's output contract (exit codes, JSON, the repro bundle) and the user-loop context
manager are tested on the same kinds of models.
"""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qdebug
from qdebug.data.batch import Batch
from qdebug.engine import QConfig, QuantSpec, calibrate, freeze_bn_stats, prepare, quant_points, set_mode
from qdebug.io.modelspec import build_zoo
from qdebug.tools.nan.trace import plain_float_model, trace_steps
from qdebug.tools.nan.detect import NonFiniteError, Watch

from small_models import SMALL_MOBILENETV2, SMALL_RESNET
from user_project import clean_imports, user_module


def _data(n: int = 8, seed: int = 0, size: int = 16) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, size, size, generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    return [Batch(x[i:i + 4], y[i:i + 4]) for i in range(0, n, 4)]


def _qat_resnet(mode: str = "with_bn_reverse_fold") -> nn.Module:
    torch.manual_seed(0)
    batches = _data()
    qm = prepare(build_zoo("resnet", **SMALL_RESNET), QConfig(), mode=mode, example_inputs=batches[0].inputs)
    calibrate(qm, [b.inputs for b in batches])
    set_mode(qm, "fake", observe=True)
    return qm


def _first(result) -> dict:
    assert result.first is not None, "expected a non-finite value"
    return result.first


# -- healthy models raise no alarm -----------------------------------------------------------
def test_a_healthy_qat_run_stays_finite_and_keeps_a_timeline():
    result = trace_steps(_qat_resnet(), _data(), steps=6, lr=0.01)
    assert result.first is None and result.steps_run == 6
    frame = result.frame
    assert list(frame["step"]) == list(range(6)) and list(frame["batch"]) == [0, 1] * 3
    assert frame["loss"].notna().all() and (frame["grad_norm"] > 0).all()
    assert frame["worst_saturation"].notna().all()  # every step measured its activation points


def test_the_run_is_deterministic_for_a_seed():
    a = trace_steps(_qat_resnet(), _data(), steps=4, lr=0.05, seed=3).frame
    b = trace_steps(_qat_resnet(), _data(), steps=4, lr=0.05, seed=3).frame
    assert a.equals(b)


def test_engine_reverse_fold_with_a_zero_gamma_stays_finite():
    qm = _qat_resnet("with_bn_reverse_fold")
    with torch.no_grad():
        qm.layer1[0].bn1.weight[2] = 0.0
    result = trace_steps(qm, _data(), steps=3, lr=0.01)
    assert result.first is None


# -- forward ----------------------------------------------------------------------------------
def test_nan_in_one_input_sample():
    batches = _data()
    batches[1].inputs[2, 0, 3, 3] = math.nan
    first = _first(trace_steps(_qat_resnet(), batches, steps=4))
    assert (first["phase"], first["step"], first["batch"], first["layer"]) == ("forward", 1, 1, "input")
    assert first["cause"] == "input" and first["samples"] == [2] and first["nan"] == 1
    assert "1 sample(s): 2" in first["detail"]


def test_nan_in_the_targets_is_the_datas_fault_not_the_losss():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16 * 16, 3))
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 1, 16, 16, generator=gen), torch.randn(8, 3, generator=gen)
    y[6, 1] = math.nan
    first = _first(trace_steps(model, [Batch(x[:4], y[:4]), Batch(x[4:], y[4:])], steps=3))
    assert (first["phase"], first["step"], first["layer"], first["cause"]) == ("forward", 1, "loss", "input")
    assert first["samples"] == [2] and "targets hold NaN/Inf in 1 sample(s): 2" in first["detail"]


def test_a_weight_already_nan_when_loaded():
    qm = _qat_resnet()
    with torch.no_grad():
        qm.layer2[0].conv1.weight[0, 0, 0, 0] = math.nan
    first = _first(trace_steps(qm, _data(), steps=3))
    assert (first["phase"], first["step"], first["cause"]) == ("forward", 0, "weights")
    assert "layer2.0.conv1.weight" in first["detail"] and "as loaded" in first["detail"]


def test_a_scale_set_to_zero_is_found_where_it_is_used():
    qm = _qat_resnet()
    set_mode(qm, "fake", observe=False)
    name = [n for n, p in quant_points(qm).items() if p.kind == "activation"][2]
    point = quant_points(qm)[name]
    point.set_qparams(torch.tensor(0.0), point.zero_point)
    first = _first(trace_steps(qm, _data(), steps=2))
    assert (first["phase"], first["what"], first["point"], first["cause"]) == ("forward", "scale", name, "scale")
    assert first["value"] == 0.0 and "recalibrate" in first["fix"]


class DivideByBnFactor(nn.Module):
    """A user's own Conv-BN for QAT that divides by the BN factor, as torch's ConvBn2d once did:
    y = conv(x, W f) / f, then BN, with f = gamma / sqrt(var + eps).  ``fold=False`` is its
    plain float architecture (conv, then BN)."""

    def __init__(self, fold: bool = True):
        super().__init__()
        self.fold = fold
        self.conv = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 10)

    def forward(self, x):
        if self.fold:
            f = self.bn.weight / torch.sqrt(self.bn.running_var + self.bn.eps)
            y = F.conv2d(x, self.conv.weight * f.reshape(-1, 1, 1, 1), padding=1) / f.reshape(1, -1, 1, 1)
            y = self.bn(y)
        else:
            y = self.bn(self.conv(x))
        return self.head(F.adaptive_avg_pool2d(torch.relu(y), 1).flatten(1))


def test_a_user_module_dividing_by_a_zero_bn_factor():
    torch.manual_seed(0)
    model = DivideByBnFactor(fold=True)
    with torch.no_grad():
        model.bn.weight[1] = 0.0
    plain = DivideByBnFactor(fold=False)
    plain.load_state_dict(model.state_dict())
    result = trace_steps(model, _data(), steps=3, float_model=plain)
    first = _first(result)
    assert (first["phase"], first["layer"], first["op"]) == ("forward", "div#2", "div")
    assert first["created"] is True and first["nan"] > 0
    assert first["cause"] == "bn_zero_weight" and "channel(s) [1]" in first["detail"]
    assert result.float_check["finite"] is True and result.float_check["steps"] == 3


def test_a_negative_running_var_in_a_forward_pass():
    model = build_zoo("resnet", **SMALL_RESNET).eval()
    with torch.no_grad():
        model.layer2[0].bn1.running_var[3] = -1.0
    first = _first(trace_steps(model, _data(), steps=0))
    assert (first["phase"], first["layer"], first["what"], first["cause"]) == \
        ("forward", "layer2.0.bn1", "param", "bn_variance")
    assert first["tensor"] == "layer2.0.bn1.running_var" and "channel(s) [3]" in first["detail"]


@pytest.mark.parametrize("frozen", [True, False])
def test_a_negative_running_var_beside_a_reverse_folded_conv(frozen):
    """Reverse fold divides by gamma / sqrt(running_var + eps) in training too: frozen, the BN
    is caught before the step; training, at the conv, diagnosed on the statistics the step
    began with (its own forward overwrites them with NaN)."""
    qm = _qat_resnet()
    if frozen:
        freeze_bn_stats(qm)
    with torch.no_grad():
        qm.layer1[0].bn2.running_var[1] = -1.0
    first = _first(trace_steps(qm, _data(), steps=2))
    assert first["layer"] == ("layer1.0.bn2" if frozen else "layer1.0.conv2") and first["cause"] == "bn_variance"
    assert "layer1.0.bn2" in first["detail"] and "channel(s) [1]" in first["detail"]


class LogOfShifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16 * 16, 10)

    def forward(self, x):
        return self.fc(torch.log(x.flatten(1) + 2.5))


def test_log_of_a_negative_input_is_an_op_domain_error():
    first = _first(trace_steps(LogOfShifted(), _data(), steps=2))
    assert (first["phase"], first["layer"], first["op"], first["cause"]) == ("forward", "log", "log", "op_domain")
    assert first["created"] is True and "negative value(s)" in first["detail"]
    assert first["hidden"] == []  # fc carried the NaN to the output: nothing was contained


class StashedLog(nn.Module):
    """The output masks log's NaN; the loss reads the raw value the model kept aside."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16 * 16, 10)

    def forward(self, x):
        y = self.fc(x.flatten(1))
        self.raw = torch.log(y)
        return torch.where(y > 0, self.raw, torch.zeros_like(y))


def test_a_masked_nan_that_reaches_the_loss_another_way_is_found_at_its_origin():
    torch.manual_seed(0)

    def train(model, batch):
        return F.cross_entropy(model(batch.inputs), batch.target) + 1e-3 * model.raw.mean()

    first = _first(trace_steps(StashedLog(), _data(), steps=2, train=train))
    assert (first["phase"], first["layer"], first["cause"]) == ("forward", "log", "op_domain")


def test_an_optimizer_step_size_past_float32_is_an_update_overflow():
    first = _first(trace_steps(LogOfShifted(), [Batch(b.inputs.abs(), b.target) for b in _data()], steps=2,
                               lr=1e38, optimizer="adam"))
    assert (first["phase"], first["layer"], first["cause"]) == ("update", "optimizer", "overflow")


# -- backward -----------------------------------------------------------------------------------
class SqrtOfRelu(nn.Module):
    """A zoo ResNet whose logits go through sqrt(relu(.)).  In float the ReLU's backward masks
    sqrt's infinite derivative at 0 (the output there is 0 because the input was <= 0); under
    fake quantization the ReLU's output is rounded, and a small positive logit becomes exactly 0:
    sqrt's backward then sends Inf through a ReLU that passes it."""

    def __init__(self):
        super().__init__()
        self.net = build_zoo("resnet", **SMALL_RESNET)

    def forward(self, x):
        return torch.sqrt(torch.relu(self.net(x)))


def _quantized_sqrt_of_relu() -> nn.Module:
    torch.manual_seed(0)
    batches = _data()
    # 4-bit activations: a step of ~0.2 at the logits, so some small positive logit rounds to 0.
    with pytest.warns(UserWarning, match="no quantized kernel"):  # sqrt runs in float, re-quantized
        qm = prepare(SqrtOfRelu(), QConfig(activation=QuantSpec(bits=4, symmetric=False)), mode="with_bn_reverse_fold",
                     example_inputs=batches[0].inputs)
    calibrate(qm, [b.inputs for b in batches])
    set_mode(qm, "fake", observe=True)
    return qm


def test_sqrt_on_a_quantized_relu_output_creates_inf_in_the_backward():
    first = _first(trace_steps(_quantized_sqrt_of_relu(), _data(), steps=3))
    assert (first["phase"], first["step"], first["layer"], first["op"]) == ("backward", 0, "sqrt", "sqrt")
    assert first["what"] == "output_grad" and first["tensor"] == "relu" and first["created"] is True
    assert first["posinf"] > 0 and first["cause"] == "backward_op"
    assert "infinite at x = 0" in first["detail"]


def test_a_masked_inf_in_the_backward_is_no_alarm():
    """Float sqrt(relu(.)): Inf in the gradient at the ReLU's output, masked by the ReLU's own
    backward: every parameter's gradient stays finite, so the run is healthy -- with a note."""
    torch.manual_seed(0)
    result = trace_steps(SqrtOfRelu(), _data(), steps=3)
    assert result.first is None and result.steps_run == 3
    assert result.meta["contained"] == [{"phase": "backward", "layer": "relu", "what": "output_grad", "step": 0}]


@pytest.mark.parametrize("make", [
    lambda y: torch.where(y > 0, torch.log(y.abs() + (y <= 0)), torch.zeros_like(y)) + torch.where(
        y > 0, torch.zeros_like(y), torch.log(y)).nan_to_num(0.0) * 0,
    lambda y: torch.softmax(y.masked_fill(torch.arange(y.shape[1]) > 4, -math.inf), dim=1),
])
def test_masked_non_finite_intermediates_are_no_alarm(make):
    torch.manual_seed(0)

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16 * 16, 10)

        def forward(self, x):
            return make(self.fc(x.flatten(1)))

    result = trace_steps(Masked(), _data(), steps=3)
    assert result.first is None and result.meta["contained"], result.first


def test_a_large_lr_blows_up_as_gradient_explosion():
    qm = _qat_resnet()
    freeze_bn_stats(qm)  # BN in train mode renormalises away any weight scale
    result = trace_steps(qm, _data(), steps=40, lr=3.0)
    first = _first(result)
    assert first["cause"] == "gradient_explosion", first
    assert first["step"] < 20
    norms = list(result.frame["grad_norm"])
    assert norms[-1] > 100 * norms[0]  # the growth shown in the timeline
    assert "lr 3" in first["detail"] and "per step" in first["detail"]


# -- observers and learned scales ---------------------------------------------------------------
def negative_scale_run() -> dict:
    """The first finding of an LSQ ResNet trained at lr 10: a learned scale driven below zero."""
    torch.manual_seed(0)
    batches = _data()
    qm = prepare(build_zoo("resnet", **SMALL_RESNET), QConfig(activation=QuantSpec(symmetric=False, estimator="lsq")),
                 mode="with_bn_reverse_fold", example_inputs=batches[0].inputs)
    calibrate(qm, [b.inputs for b in batches])
    return _first(trace_steps(qm, batches, steps=5, lr=10.0))


def test_a_learned_scale_driven_negative_by_the_update():
    first = negative_scale_run()
    assert (first["phase"], first["step"], first["what"], first["cause"]) == ("update", 0, "scale", "scale")
    assert first["value"] < 0 and "optimizer drove the learned scale" in first["detail"]


def test_an_observer_update_that_makes_a_scale_zero():
    qm = _qat_resnet()
    name = [n for n, p in quant_points(qm).items() if p.kind == "activation"][3]
    observer = quant_points(qm)[name].observer
    healthy = observer.calculate_qparams

    def broken():  # a faulty observer, as a user's custom one might be: the range collapses to 0
        scale, zero_point = healthy()
        return torch.zeros_like(scale), zero_point

    observer.calculate_qparams = broken
    first = _first(trace_steps(qm, _data(), steps=2))
    assert (first["phase"], first["step"], first["what"], first["point"]) == ("observer", 0, "scale", name)
    assert first["cause"] == "scale" and "observer's update" in first["detail"]


def test_the_cheap_pass_flags_what_matters_and_notes_what_is_contained():
    torch.manual_seed(0)
    model, batch = SqrtOfRelu(), _data()[0]
    model.train()
    with Watch(model, detail=False) as watch:
        watch.begin(0, 0, 4)
        F.cross_entropy(model(batch.inputs), batch.target).backward()
        failed, contained = watch.flush()
    assert failed is None and contained[:3] == ("backward", "relu", "output_grad")
    qm = _quantized_sqrt_of_relu()
    qm.train()
    with Watch(qm, detail=False) as watch:
        watch.begin(0, 0, 4)
        F.cross_entropy(qm(batch.inputs), batch.target).backward()
        grads = [p.grad for p in qm.parameters() if p.grad is not None]
        watch.check_grads(list(torch._foreach_norm(grads)), grads)
        failed, contained = watch.flush()
    assert failed[0] == "backward" and failed[2] == "param_grad"


class ThreeConvs(nn.Module):
    """conv-lrelu-conv-lrelu-conv-fc on 8x8 images: the chain seed 000's runaway needs."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.act1 = nn.LeakyReLU(0.1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.act2 = nn.LeakyReLU(0.1)
        self.conv3 = nn.Conv2d(width, width, 3, padding=1)
        self.fc = nn.Linear(width * 64, 10)

    def forward(self, x):
        x = self.act2(self.conv2(self.act1(self.conv1(x))))
        return self.fc(torch.flatten(self.conv3(x), 1))


def test_seed_000_a_range_held_far_too_small_ends_in_range_collapse():
    """Seed 000's mechanism: an activation range far below its data's (here conv3's output, its
    calibrated scale x 1e-3, frozen), straight-through gradients pushing through the saturated
    clamp, the weights feeding it growing step over step until the values overflow."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1000)
    prototypes = (torch.rand(10, 1, 8, 8, generator=gen) > 0.5).float()
    y = torch.randint(0, 10, (1024,), generator=gen)
    x = prototypes[y] + torch.randn(1024, 1, 8, 8, generator=gen)
    batches = [Batch(x[i:i + 64], y[i:i + 64]) for i in range(0, 1024, 64)]
    model = ThreeConvs()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    for step in range(150):  # a float model that works
        batch = batches[step % len(batches)]
        opt.zero_grad()
        F.cross_entropy(model(batch.inputs), batch.target).backward()
        opt.step()
    qm = prepare(model, QConfig(activation=QuantSpec(symmetric=False, observer="ema", estimator="ste")),
                 example_inputs=x[:8])
    calibrate(qm, [b.inputs for b in batches[:4]])
    set_mode(qm, "fake", observe=True)  # QAT with running EMA ranges ...
    point = quant_points(qm)["conv3"]
    point.set_qparams(point.scale * 1e-3, point.zero_point)  # ... but conv3's range held far too small
    set_mode(qm, "fake", "conv3", observe=False)
    result = trace_steps(qm, batches, steps=300, lr=0.01)
    first = _first(result)
    assert first["cause"] == "range_collapse", first
    assert "activation point conv3 clipped" in first["detail"] and "conv3.weight" in first["detail"]
    conv3 = [s.saturation["conv3"] for s in result.timeline]
    assert min(conv3[-20:]) > 0.99  # saturated all along ...
    weights = [s.weight_max["conv3.weight"] for s in result.timeline]
    assert weights[-1] > 100 * weights[0]  # ... while the weights feeding it grew
    assert (result.frame["worst_point"] == "conv3").mean() > 0.8
    assert "fix conv3's observer" in first["fix"]


# -- fp16 and the user's own loop ---------------------------------------------------------------
def _autocast_fp16_works() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            return nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float16
    except (RuntimeError, TypeError):
        return False


def test_an_fp16_overflow_reached_through_untracked_views_in_a_user_loop():
    """The overflowing matmul's output reaches fc through a slice, a cast and an expand of
    tensors without gradients: neither identity nor autograd links them, so the step's first
    call that made a non-finite value is named."""
    class Half(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16 * 16, 10)

        def forward(self, x):
            h = x.flatten(1).half() * 1000
            h = h @ h.t()
            return self.fc(h[:, :1].float().expand(-1, 16 * 16))

    model = Half()
    with pytest.raises(NonFiniteError):
        with qdebug.nan_trace(model) as trace:
            model(_data()[0].inputs)
    assert (trace.report["layer"], trace.report["dtype"], trace.report["cause"]) == ("matmul", "float16", "overflow")


@pytest.mark.skipif(not _autocast_fp16_works(), reason="this CPU build has no float16 autocast")
def test_fp16_overflow_under_autocast_in_a_user_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[2].weight.mul_(3000.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8) * 10, torch.randint(0, 4, (32,))
    with pytest.raises(qdebug.NonFiniteError) as caught:
        with qdebug.nan_trace(model) as trace:
            for _ in range(3):
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                loss = F.cross_entropy(out.float(), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                trace.step(loss)
    report = trace.report
    assert caught.value.report is report
    assert (report["phase"], report["layer"], report["op"], report["dtype"]) == ("forward", "2", "Linear", "float16")
    assert report["created"] is True and report["posinf"] + report["neginf"] > 0
    assert report["cause"] == "overflow" and "65504" in report["detail"]


def test_the_context_manager_on_a_plain_module_with_a_user_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    with qdebug.nan_trace(model) as trace:
        for _ in range(3):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            trace.step(loss)
    assert trace.report is None and len(trace.history) == 3
    assert all(s.grad_norm and s.grad_norm > 0 for s in trace.history)  # kept though zero_grad ran first
    # The hooks are gone after the block: a NaN now raises nothing.
    model(torch.full((2, 8), math.nan))
    x[5, 1] = math.nan
    with pytest.raises(NonFiniteError):
        with qdebug.nan_trace(model) as trace:
            F.cross_entropy(model(x), y).backward()
    assert (trace.report["layer"], trace.report["cause"], trace.report["samples"]) == ("input", "input", [5])


def test_an_update_that_overflows_a_parameter():
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e38)
    x, y = torch.ones(2, 4), torch.zeros(2, 4)
    with pytest.raises(NonFiniteError):
        with qdebug.nan_trace(model) as trace:
            F.mse_loss(model(x) * 1e3, y).backward()
            opt.step()
            trace.step()
    assert (trace.report["phase"], trace.report["what"], trace.report["layer"]) == ("update", "param", "0")
    assert trace.report["cause"] == "overflow"


# -- the float check ------------------------------------------------------------------------------
def test_plain_float_model_holds_the_checkpoints_weights(stages):
    net, info = qdebug.load(stages.qat)
    plain, how = plain_float_model(net, info.model)
    assert how == "quantization off"  # fuse_bn folded the BNs away: the engine's float mode stands in
    qm = _qat_resnet("with_bn")
    plain, how = plain_float_model(qm, qm_spec := qdebug.io.modelspec.spec_of(qm))
    assert how == "plain" and not qdebug.engine.is_prepared(plain) and qm_spec.target.endswith(":ResNet")
    with torch.no_grad():
        x = _data()[0].inputs
        set_mode(qm, "float")
        torch.testing.assert_close(plain.eval()(x), qm.eval()(x), rtol=1e-5, atol=1e-5)


# -- the command line -----------------------------------------------------------------------------
def test_cli_all_finite_exits_0_with_a_timeline(cli, stages):
    result = cli("nan-trace", stages.qat, "--data", stages.data, "--steps", 3, "--batch-size", 4, "--float-check")
    assert result.code == 0, result.err
    assert "all finite: 3 step(s)" in result.out and "float check" in result.out
    assert "nan-trace timeline" in result.out
    assert "looks dead" not in result.out and json.loads(cli("nan-trace", stages.qat, "--data", stages.data, "--steps", 3,
                                                             "--batch-size", 4, "--json").out)["meta"]["dead_run"] is None


def test_cli_all_finite_but_dead_points_to_watch(cli, stages):
    """lr 1e4: every value stays finite, yet the weights blow past the ranges, the points saturate
    and the clipped straight-through estimator passes no gradient: the summary says so."""
    result = cli("nan-trace", stages.qat, "--data", stages.data, "--steps", 6, "--batch-size", 4, "--lr", 1e4, "--json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    dead = report["meta"]["dead_run"]
    assert report["first"] is None and dead["rule"] == "dead_run" and dead["from_step"] >= 1, dead
    timeline = report["timeline"]
    assert timeline[0]["grad_norm"] > 0 and timeline[-1]["grad_norm"] <= 1e-3 * timeline[0]["grad_norm"]
    shown = cli("nan-trace", stages.qat, "--data", stages.data, "--steps", 6, "--batch-size", 4, "--lr", 1e4).out
    assert "all finite: 6 step(s)" in shown and "looks dead (qdebug.watch's dead_run, docs/watch.md)" in shown


def test_cli_forward_only_and_json(cli, stages):
    result = cli("nan-trace", stages.calibrated, "--data", stages.data, "--steps", 0, "--batch-size", 4, "--json")
    assert result.code == 0, result.err
    doc = json.loads(result.out)
    assert set(doc) == {"meta", "first", "float_check", "timeline"}
    assert doc["first"] is None and doc["float_check"] is None and len(doc["timeline"]) == 3
    assert doc["meta"]["steps"] == 0 and doc["meta"]["optimizer"] is None


def test_cli_finding_exit_1_bundle_and_repro(cli, stages, tmp_path):
    x, y = torch.load(stages.data, weights_only=True)
    x = x.clone()
    x[6, 0, 1, 1] = math.inf
    torch.save((x, y), tmp_path / "bad.pt")
    result = cli("nan-trace", stages.qat, "--data", "bad.pt", "--batch-size", 4, "--steps", 5, "--out", "o",
                 "--format", "json")
    assert result.code == 1, result.err
    doc = json.loads(result.out)
    first = doc["first"]
    assert (first["phase"], first["step"], first["batch"], first["layer"], first["cause"]) == \
        ("forward", 1, 1, "input", "input")
    assert first["samples"] == [2] and first["posinf"] == 1
    assert {"phase", "step", "batch", "samples", "layer", "op", "point", "created", "nan", "posinf", "neginf",
            "cause", "detail", "fix"} <= set(first)
    files = {p.name for p in (tmp_path / "o").iterdir()}
    assert {"nan_trace.json", "nan_trace.csv", "nan_trace.png", "before.pt", "batch.pt"} <= files
    repro = doc["meta"]["repro"]
    assert repro == "qdebug nan-trace o/before.pt --data o/batch.pt --steps 1"
    again = cli(*repro.split()[1:], "--json")
    assert again.code == 1, again.err
    replay = json.loads(again.out)["first"]
    assert (replay["phase"], replay["step"], replay["layer"], replay["cause"], replay["samples"]) == \
        ("forward", 0, "input", "input", [2])


@pytest.mark.parametrize("key, value", [("lr", "fast"), ("seed", 2**70), ("rng_state", torch.zeros(3)),
                                        ("optimizer_state", [1, 2])])
def test_a_damaged_repro_bundle_is_refused_naming_the_setting(cli, stages, tmp_path, key, value):
    net, info = qdebug.load(stages.qat)
    qdebug.save(net, tmp_path / "before.pt", stage="qat", meta={"nan_trace": {"lr": 0.1, key: value}})
    result = cli("nan-trace", "before.pt", "--data", stages.data, "--steps", 1)
    result.assert_error(f"the repro bundle's {key} is damaged")


def test_cli_repro_bundle_replays_a_training_step_exactly(cli, tmp_path):
    qm = _qat_resnet()
    freeze_bn_stats(qm)
    qdebug.save(qm, tmp_path / "qat.pt", stage="qat")
    batches = _data()
    torch.save([(b.inputs, b.target) for b in batches], tmp_path / "train.pt")
    result = cli("nan-trace", "qat.pt", "--data", "train.pt", "--steps", 40, "--lr", 3, "--out", "o", "--json")
    assert result.code == 1, result.err
    first = json.loads(result.out)["first"]
    again = json.loads(cli("nan-trace", "o/before.pt", "--data", "o/batch.pt", "--steps", 1, "--json").out)["first"]
    same = ("phase", "layer", "what", "tensor", "nan", "posinf", "neginf")
    assert {k: again[k] for k in same} == {k: first[k] for k in same}


NANPKG = """\
import torch
import torch.nn as nn
import torch.nn.functional as F


""" + inspect.getsource(DivideByBnFactor) + """

def step(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def broken(model, batch):
    raise KeyError("no such key")


def detached(model, batch):
    return torch.tensor(1.0)


def leaves(model, batch):
    raise SystemExit(5)
"""


def test_cli_user_module_train_function_and_float_check_on_its_plain_architecture(cli, tmp_path):
    with clean_imports(tmp_path):
        user_module(tmp_path, "nanpkg", "nets", NANPKG)
        from nanpkg.nets import DivideByBnFactor as DivNet

        torch.manual_seed(0)
        qat = DivNet(fold=True)
        with torch.no_grad():
            qat.bn.weight[1] = 0.0
        qdebug.save(qat, tmp_path / "user.pt", stage="float", model_spec="nanpkg.nets:DivideByBnFactor",
                    model_kwargs={"fold": True})
        qdebug.save(DivNet(fold=False), tmp_path / "plain.pt", stage="float",
                    model_spec="nanpkg.nets:DivideByBnFactor",
                    model_kwargs={"fold": False})
        torch.save([(b.inputs, b.target) for b in _data()], tmp_path / "d.pt")
        result = cli("nan-trace", "user.pt", "--model", "nanpkg.nets:DivideByBnFactor", "--data", "d.pt", "--steps", 3,
                     "--train", "nanpkg.nets:step", "--float-check", "--float", "plain.pt", "--json")
        assert result.code == 1, result.err
        doc = json.loads(result.out)
        assert (doc["first"]["layer"], doc["first"]["cause"]) == ("div#2", "bn_zero_weight")
        assert doc["float_check"]["finite"] is True and doc["float_check"]["model"] == "plain"
        assert doc["meta"]["loss"] == "train"
        broken = cli("nan-trace", "user.pt", "--model", "nanpkg.nets:DivideByBnFactor", "--data", "d.pt", "--steps", 1,
                     "--train", "nanpkg.nets:broken")
        broken.assert_error("--train function nanpkg.nets:broken raised KeyError", "nets.py")
        common = ("nan-trace", "user.pt", "--model", "nanpkg.nets:DivideByBnFactor", "--data", "d.pt")
        cli(*common, "--steps", 1, "--train", "nanpkg.nets:detached").assert_error("does not depend on the model")
        cli(*common, "--steps", 1, "--train", "nanpkg.nets:leaves").assert_error("raised SystemExit")
        cli(*common, "--steps", 0, "--train", "nanpkg.nets:step").assert_error("--train runs training steps")
        cli(*common, "--steps", 1, "--float-check", "--float", "/nonexistent.pt").assert_error("no such file")


@pytest.mark.parametrize("args, fragment", [
    (("--steps", "-1"), "--steps must be >= 0"),
    (("--lr", "nan"), "--lr must be a number from 0 to 3.4e38"),
    (("--lr", "1e39"), "--lr must be a number from 0 to 3.4e38"),
    (("--optimizer", "rmsprop"), "--optimizer 'rmsprop'"),
    (("--loss", "hinge"), "--loss 'hinge'"),
    (("--train", "x.y:z", "--loss", "ce"), "--loss does not apply"),
    (("--float", "f.pt"), "--float only names the architecture"),
])
def test_cli_usage_errors(cli, stages, args, fragment):
    cli("nan-trace", stages.qat, "--data", stages.data, *args).assert_error(fragment)


def test_cli_float_check_refuses_an_architecture_that_does_not_fit(cli, stages, tmp_path):
    qdebug.save(build_zoo("mobilenetv2", **SMALL_MOBILENETV2), tmp_path / "other.pt", stage="float")
    result = cli("nan-trace", stages.qat, "--data", stages.data, "--steps", 1, "--float-check", "--float", "other.pt")
    result.assert_error("does not fit the checkpoint's weights")


def test_a_step_that_does_not_reproduce_is_called_nondeterministic():
    calls = {"n": 0}

    def train(model, batch):  # NaN on its 3rd call only: the re-run (4th call) is finite
        calls["n"] += 1
        loss = F.cross_entropy(model(batch.inputs), batch.target)
        return loss * math.nan if calls["n"] == 3 else loss

    torch.manual_seed(0)
    first = _first(trace_steps(LogOfShifted(), [Batch(b.inputs.abs(), b.target) for b in _data()], steps=5,
                               train=train))
    assert (first["step"], first["reproducible"], first["cause"]) == (2, False, "nondeterministic")
    assert first["layer"] == "loss"


def test_a_model_without_trainable_parameters_cannot_train():
    with pytest.raises(qdebug.QDebugError, match="no trainable parameters"):
        trace_steps(nn.Flatten(), _data(), steps=2)
    assert trace_steps(nn.Flatten(), _data(), steps=0).first is None


def test_cli_csv_keeps_the_finding_on_stderr_and_a_clean_run_removes_a_stale_bundle(cli, stages, tmp_path):
    x, y = torch.load(stages.data, weights_only=True)
    x = x.clone()
    x[0, 0, 0, 0] = math.nan
    torch.save((x, y), tmp_path / "bad.pt")
    bad = cli("nan-trace", stages.qat, "--data", "bad.pt", "--steps", 1, "--out", "o", "--format", "csv")
    assert bad.code == 1 and bad.out.startswith("step,batch,loss")
    assert "FIRST NON-FINITE" in bad.err and "cause: input" in bad.err
    assert (tmp_path / "o" / "before.pt").is_file()
    good = cli("nan-trace", stages.qat, "--data", stages.data, "--steps", 1, "--out", "o", "--format", "csv")
    assert good.code == 0 and not (tmp_path / "o" / "before.pt").exists() and not (tmp_path / "o" / "batch.pt").exists()


class MaskedSqrt(nn.Module):
    """sqrt behind a torch.where mask: finite forward, NaN gradient where the mask drops it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16 * 16, 10)

    def forward(self, x):
        y = self.fc(x.flatten(1))
        return torch.where(y > 0, torch.sqrt(y), torch.zeros_like(y))


def test_a_nan_hidden_by_torch_where_bites_in_the_backward():
    torch.manual_seed(0)
    first = _first(trace_steps(MaskedSqrt(), _data(), steps=2))
    assert (first["phase"], first["layer"], first["cause"]) == ("backward", "sqrt", "backward_op")
    assert "sqrt" in first["hidden"] and "mask the op's input" in first["fix"]


def test_cli_refuses_to_train_a_quantized_checkpoint(cli, stages):
    cli("nan-trace", stages.quantized, "--data", stages.data, "--steps", 2).assert_error(
        "integer kernels have no gradients", "--steps 0")


def test_cli_distils_without_targets_and_refuses_ce(cli, stages, tmp_path):
    torch.save(torch.randn(8, 1, 16, 16), tmp_path / "x.pt")
    result = cli("nan-trace", stages.qat, "--data", "x.pt", "--steps", 2, "--batch-size", 4, "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["meta"]["loss"] == "auto"
    cli("nan-trace", stages.qat, "--data", "x.pt", "--steps", 2, "--loss", "ce").assert_error("needs targets")
    cli("nan-trace", stages.float, "--data", "x.pt", "--steps", 2).assert_error("no targets")
    cli("nan-trace", stages.qat, "--data", "x.pt", "--steps", 2, "--float-check").assert_error(
        "--float-check needs targets")
