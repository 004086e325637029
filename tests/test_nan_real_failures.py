"""nan-trace's advice on the failures it was written for (issue 30, item 1): each case is a
real failure reproduced on a small model, and each asserts the cause, what the text names,
and -- against torch's own modules and kernels -- that the mechanism the text describes is
the one at work (and that the fix it gives works where it can be run).

- a zero BN gamma inside torch.ao's fused QAT ``ConvBnReLU2d`` (pytorch#85744);
- a negative running_var folded into a conv (fuse_bn): prepare refuses, inspect warns,
  nan-trace names the BatchNorm;
- an exploding lr replayed one step from its repro bundle (no history);
- ``torch.where`` + ``log`` with an int8 point between the mask and the op;
- the context manager never points at a repro bundle it did not write.
"""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch
import torch.ao.quantization as tq
import torch.nn as nn
import torch.nn.functional as F

import qdebug
from qdebug.data.batch import Batch
from qdebug.engine import QConfig, absorb_bn, calibrate, prepare, quant_points, set_mode
from qdebug.io.modelspec import build_zoo
from qdebug.tools.nan.causes import HUGE_WEIGHT
from qdebug.tools.nan.trace import trace_steps
from qdebug.tools.nan.detect import NonFiniteError

from small_models import SMALL_RESNET
from test_nan_trace import MaskedSqrt
from user_project import clean_imports, user_module


def _data(n: int = 8, size: int = 16, channels: int = 1, dims: int = 2) -> list[Batch]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, channels, *([size] * dims), generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    return [Batch(x[i:i + 4], y[i:i + 4]) for i in range(0, n, 4)]


# -- 1. a zero gamma inside torch.ao's fused QAT Conv-BN (pytorch#85744) ---------------------------
class ConvBnNet(nn.Module):
    """conv -> bn (-> relu) -> pool -> head, fused and prepared for QAT by torch.ao as a user does."""

    def __init__(self, dims: int = 2, relu: bool = True):
        super().__init__()
        conv, bn = (nn.Conv2d, nn.BatchNorm2d) if dims == 2 else (nn.Conv1d, nn.BatchNorm1d)
        self.conv, self.bn = conv(1, 4, 3, padding=1), bn(4)
        self.relu = nn.ReLU() if relu else nn.Identity()
        self.head = nn.Linear(4, 10)

    def forward(self, x):
        return self.head(self.relu(self.bn(self.conv(x))).flatten(2).mean(2))


def _torch_qat(dims: int, relu: bool) -> nn.Module:
    torch.manual_seed(0)
    model = ConvBnNet(dims, relu).train()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    fused = tq.fuse_modules_qat(model, [["conv", "bn", "relu"] if relu else ["conv", "bn"]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tq.prepare_qat(fused)


@pytest.mark.parametrize("dims, relu, kind", [(2, True, "ConvBnReLU2d"), (2, False, "ConvBn2d"),
                                              (1, True, "ConvBnReLU1d")])
@pytest.mark.parametrize("steps", [0, 2])
def test_zero_gamma_inside_torch_ao_fused_qat_conv_bn(dims, relu, kind, steps):
    model = _torch_qat(dims, relu)
    assert type(model.conv).__name__ == kind
    with torch.no_grad():
        model.conv.bn.weight[1] = 0.0
    data = _data(dims=dims)
    # torch's own module (its fake quantization off, which would spread a NaN over the tensor) makes
    # NaN in channel 1 only: its forward divides by gamma / sqrt(var + eps).
    alone = copy.deepcopy(model.conv).train(steps > 0)
    alone.apply(tq.disable_fake_quant)
    with torch.no_grad():
        out = alone(data[0].inputs)
    assert torch.isnan(out).transpose(0, 1).flatten(1).any(1).tolist() == [False, True, False, False]

    first = trace_steps(copy.deepcopy(model), data, steps=steps).first
    assert (first["phase"], first["layer"], first["op"], first["cause"]) == ("forward", "conv", kind, "bn_zero_weight")
    assert "conv.bn's gamma is 0 in channel(s) [1]" in first["detail"] and "pytorch#85744" in first["detail"]
    assert "conv._enable_slow_path_for_better_numerical_stability = True" in first["fix"]
    # The fix, as printed: torch's two-pass forward stays finite on the same steps.
    fixed = copy.deepcopy(model)
    fixed.conv._enable_slow_path_for_better_numerical_stability = True
    assert trace_steps(fixed, data, steps=steps).first is None


def test_negative_variance_inside_torch_ao_fused_qat_conv_bn_names_its_bn():
    model = _torch_qat(2, True).eval()
    with torch.no_grad():
        model.conv.bn.running_var[2] = -1.0
    # torch's own eval BatchNorm on those statistics: NaN in channel 2.
    assert torch.isnan(model.conv.bn(torch.randn(2, 4, 3, 3))).transpose(0, 1).flatten(1).all(1).tolist() == \
        [False, False, True, False]
    first = trace_steps(model, _data(), steps=0).first
    assert (first["layer"], first["tensor"], first["cause"]) == ("conv.bn", "conv.bn.running_var", "bn_variance")
    assert "channel(s) [2]" in first["detail"]


class OwnConvBn(nn.Conv2d):
    """A user's Conv-BN layer (a Conv2d subclass: traced as one call) whose forward divides by the
    BN factor, as torch's fused modules do."""

    def __init__(self):
        super().__init__(1, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        f = self.bn.weight / torch.sqrt(self.bn.running_var + self.bn.eps)
        return self.bn(F.conv2d(x, self.weight * f.reshape(-1, 1, 1, 1), padding=1) / f.reshape(1, -1, 1, 1))


def test_zero_gamma_in_any_module_whose_forward_divides_by_its_bn_factor():
    torch.manual_seed(0)
    model = nn.Sequential(OwnConvBn(), nn.Flatten(1), nn.Linear(4 * 256, 10))
    with torch.no_grad():
        model[0].bn.weight[2] = 0.0
    first = trace_steps(model, _data(), steps=1).first
    assert (first["layer"], first["op"], first["cause"]) == ("0", "OwnConvBn", "bn_zero_weight")
    assert "0.bn" in first["detail"] and "channel(s) [2]" in first["detail"]
    # A zero gamma in a module that does not divide makes a constant channel, never NaN: no alarm.
    plain = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(1), nn.Linear(4 * 256, 10))
    with torch.no_grad():
        plain[1].weight[2] = 0.0
    assert trace_steps(plain, _data(), steps=1).first is None


# -- 2. a negative running_var folded into a conv (fuse_bn) ----------------------------------------
def _resnet_with_negative_var() -> nn.Module:
    torch.manual_seed(0)
    model = build_zoo("resnet", **SMALL_RESNET).eval()
    with torch.no_grad():
        model.layer1[0].bn2.running_var[1] = -1.0
    return model


def test_prepare_refuses_to_fold_a_negative_variance_naming_the_bn_and_channel():
    model = _resnet_with_negative_var()
    x = _data()[0].inputs
    # torch's own fold of these statistics: channel 1 of the conv becomes NaN, the others stay finite.
    conv, bn = model.layer1[0].conv2, model.layer1[0].bn2
    folded, _ = torch.nn.utils.fusion.fuse_conv_bn_weights(conv.weight, conv.bias, bn.running_mean, bn.running_var,
                                                           bn.eps, bn.weight, bn.bias)
    assert torch.isnan(folded).flatten(1).all(1).tolist() == [c == 1 for c in range(8)]
    with pytest.raises(qdebug.QDebugError, match=r"BatchNorm layer1\.0\.bn2 cannot be folded into layer1\.0\.conv2: "
                                                 r"channel\(s\) 1 have invalid statistics \(running_var -1"):
        prepare(model, QConfig(), mode="fuse_bn", example_inputs=x)
    # Kept beside the conv, the BN is not folded at prepare, only warned about (every eval forward is
    # NaN there); folding it later (FuseBN) is refused too.
    with pytest.warns(UserWarning, match=r"BatchNorm layer1\.0\.bn2: channel\(s\) 1 have invalid statistics .* "
                                         r"every eval forward"):
        kept = prepare(model, QConfig(), mode="with_bn", example_inputs=x)
    with pytest.raises(qdebug.QDebugError, match=r"layer1\.0\.bn2 cannot be folded"):
        absorb_bn(kept, "layer1.0.conv2")
    assert torch.isfinite(kept.layer1[0].conv2.weight).all()  # nothing half-folded


def test_cli_calibrate_refuses_and_inspect_warns_on_bn_statistics(cli, tmp_path):
    model = _resnet_with_negative_var()
    with torch.no_grad():
        model.layer2[0].bn1.weight[4] = 0.0
        model.layer2[0].bn2.running_var[0] = 0.0
        model.bn1.running_var[3] = math.nan
    qdebug.save(model, tmp_path / "float.pt", stage="float", sample_inputs=_data()[0].inputs)
    torch.save(_data()[0].inputs, tmp_path / "x.pt")
    cli("calibrate", "float.pt", "--data", "x.pt", "-o", "cal.pt").assert_error(
        "BatchNorm bn1 cannot be folded into conv1: channel(s) 3", "reset_running_stats()")
    result = cli("inspect", "float.pt", "--json")
    assert result.code == 0, result.err
    checks = {(c["layer"], c["check"]): c for c in json.loads(result.out)["checks"] if c["severity"] == "warning"}
    assert set(checks) == {("layer1.0.bn2", "negative BN variance"), ("layer2.0.bn1", "zero BN gamma"),
                           ("layer2.0.bn2", "zero BN variance"), ("bn1", "non-finite BN statistics")}
    assert checks[("layer1.0.bn2", "negative BN variance")]["detail"].startswith("channel(s) 1 of 8 (min -1)")
    assert checks[("layer2.0.bn1", "zero BN gamma")]["detail"].startswith("channel(s) 4 of 16")
    # What the warning says: torch's own eval BatchNorm gives NaN in that channel only.
    bn = model.layer1[0].bn2
    out = bn(torch.randn(2, 8, 4, 4))
    assert torch.isnan(out).transpose(0, 1).flatten(1).all(1).tolist() == [c == 1 for c in range(8)]


def test_nan_trace_names_the_folded_bn_not_the_loaded_weights(cli, tmp_path):
    """A calibrated checkpoint folded before prepare refused it (torch's own fold of the
    statistics, planted): the root is the BatchNorm, and the fix is its statistics."""
    bad = _resnet_with_negative_var()
    torch.manual_seed(0)
    good = build_zoo("resnet", **SMALL_RESNET).eval()
    batches = _data()
    qm = prepare(good, QConfig(), mode="fuse_bn", example_inputs=batches[0].inputs)
    calibrate(qm, [b.inputs for b in batches])
    conv, bn = bad.layer1[0].conv2, bad.layer1[0].bn2
    weight, bias = torch.nn.utils.fusion.fuse_conv_bn_weights(conv.weight, conv.bias, bn.running_mean,
                                                              bn.running_var, bn.eps, bn.weight, bn.bias)
    with torch.no_grad():
        qm.layer1[0].conv2.weight.copy_(weight)
        qm.layer1[0].conv2.bias.copy_(bias)
    qdebug.save(qm, tmp_path / "cal.pt", stage="calibrated")
    torch.save([(b.inputs, b.target) for b in batches], tmp_path / "d.pt")
    result = cli("nan-trace", "cal.pt", "--data", "d.pt", "--steps", 1, "--json")
    assert result.code == 1, result.err
    first = json.loads(result.out)["first"]
    assert (first["tensor"], first["cause"]) == ("layer1.0.conv2.weight", "bn_fold")
    assert "folded BatchNorm layer1.0.bn2" in first["detail"] and "channel(s) [1]" in first["detail"]
    assert "fix layer1.0.bn2's statistics in the float checkpoint" in first["fix"]
    assert first["samples"] == []  # a weight's dim 0 is no batch
    # A NaN that is not whole channels (no fold made it) stays the loaded weights' fault.
    with torch.no_grad():
        qm.layer1[0].conv2.weight.copy_(conv.weight)
        qm.layer1[0].conv2.weight[0, 0, 0, 0] = math.nan
        qm.layer1[0].conv2.bias.zero_()
    assert trace_steps(qm, batches, steps=1).first["cause"] == "weights"


# -- 3. an exploding lr replayed from its bundle ---------------------------------------------------
MLPPKG = """\
import torch
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))
"""


def test_a_one_step_replay_agrees_with_the_run_that_wrote_its_bundle(cli, tmp_path):
    with clean_imports(tmp_path):
        user_module(tmp_path, "mlppkg", "nets", MLPPKG)
        from mlppkg.nets import MLP

        torch.manual_seed(0)
        qdebug.save(MLP(), tmp_path / "mlp.pt", stage="float", model_spec="mlppkg.nets:MLP")
        gen = torch.Generator().manual_seed(0)
        torch.save([(torch.randn(4, 1, 8, 8, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(2)],
                   tmp_path / "d.pt")
        common = ("--model", "mlppkg.nets:MLP", "--json")
        run = json.loads(cli("nan-trace", "mlp.pt", "--data", "d.pt", "--steps", 30, "--lr", 1, "--out", "o",
                             *common).out)
        assert run["first"]["cause"] == "gradient_explosion" and run["meta"]["replay_of"] is None
        replay = json.loads(cli("nan-trace", "o/before.pt", "--data", "o/batch.pt", "--steps", 1, *common).out)
        first = replay["first"]
        assert (first["phase"], first["layer"]) == (run["first"]["phase"], run["first"]["layer"])
        assert (first["cause"], first["fix"]) == (run["first"]["cause"], run["first"]["fix"])
        assert f"from the {len(run['timeline'])} step(s) before its step {run['first']['step']}" in first["detail"]
        assert "this replay saw 0 step(s) before" in first["detail"]
        assert replay["meta"]["replay_of"] == {"step": run["first"]["step"], "cause": "gradient_explosion"}
        # The replay's own rules, without the run's record: what it cannot know, never a guard.
        net, _ = qdebug.load(tmp_path / "o" / "before.pt", model="mlppkg.nets:MLP")
        bundle = torch.load(tmp_path / "o" / "batch.pt", weights_only=True)
        alone = trace_steps(net, [Batch(*bundle[0])], steps=1, lr=1.0).first
        assert alone["cause"] == "grown_weights" and "cannot be told here" in alone["detail"]
        assert "guard the op" not in alone["fix"] and "would not help" in alone["fix"]
        largest = max(float(p.detach().abs().max()) for p in net.parameters())
        assert largest >= HUGE_WEIGHT and f"{largest:.3g}" in alone["detail"]


def test_a_replay_that_stays_finite_says_so_and_a_damaged_run_record_is_refused(cli, stages, tmp_path):
    net, _ = qdebug.load(stages.qat)
    record = {"phase": "forward", "layer": "fc", "what": "output", "cause": "gradient_explosion", "detail": "grew",
              "fix": "lower the lr", "step": 7, "history": 7}
    qdebug.save(net, tmp_path / "before.pt", stage="qat", meta={"nan_trace": {"lr": 0.01, "diagnosis": record}})
    replay = cli("nan-trace", "before.pt", "--data", stages.data, "--steps", 1)
    assert replay.code == 0, replay.err
    assert "note: the run that wrote this bundle found gradient_explosion at fc (forward of its step 7); this " \
        "replay stayed finite" in replay.out
    qdebug.save(net, tmp_path / "before.pt", stage="qat", meta={"nan_trace": {"lr": 0.1, "diagnosis": {
        **record, "step": "7"}}})
    cli("nan-trace", "before.pt", "--data", stages.data, "--steps", 1).assert_error(
        "the repro bundle's diagnosis is damaged")


def test_weights_near_1e24_in_one_step_without_history_are_not_an_op_to_guard():
    # The NaN here is fc's: products of |w| ~ 1e24 and its inputs overflow with both signs, and
    # +inf + -inf is NaN.  Some of this CPU's BLAS kernels (a batch of 4, 16 inputs, seen on an
    # AVX-512 Xeon) return inf for that sum instead; on one sample (a matrix-vector product)
    # they follow IEEE.  So the step runs on one sample, and the test asks the BLAS first.
    overflow = F.linear(torch.tensor([[1e24, 1e24]]), torch.tensor([[1e24, -1e24]]))
    if not torch.isnan(overflow).all():
        pytest.skip("this BLAS sums overflowing products of both signs to inf, not NaN: fc stays finite")
    torch.manual_seed(0)
    batches = _data()
    qm = prepare(build_zoo("resnet", **SMALL_RESNET), QConfig(), mode="with_bn_reverse_fold",
                 example_inputs=batches[0].inputs)
    calibrate(qm, [b.inputs for b in batches])
    set_mode(qm, "fake", observe=True)
    with torch.no_grad():
        for name, p in qm.named_parameters():
            if "scale" not in name:
                p.mul_(1e24)
    one_sample = [Batch(batches[0].inputs[:1], batches[0].target[:1])]
    first = trace_steps(qm, one_sample, steps=1).first
    assert first["created"] and first["layer"] == "fc" and first["cause"] == "grown_weights"
    assert "cannot be told here" in first["detail"] and "guard the op" not in first["fix"]


def test_a_backward_overflow_in_an_op_without_a_singularity_is_not_given_a_sqrt_guard():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4, bias=False)
            nn.init.constant_(self.fc.weight, 1e-20)

        def forward(self, x):
            return self.fc(x.flatten(1)[:, :4] * 1e20)  # finite forward (~1); d/dW = x (1e20) x the incoming gradient

    def train(model, batch):
        return model(batch.inputs).sum() * 1e30  # a finite loss whose gradient, 1e30, meets x: 1e50 at fc.weight

    first = trace_steps(Scaled(), _data(), steps=1, train=train).first
    assert (first["phase"], first["layer"], first["op"], first["cause"]) == ("backward", "fc", "Linear", "backward_op")
    assert first["tensor"] == "fc.weight" and first["created"] is True
    assert "sqrt" not in first["fix"] and "lower the lr or clip gradients" in first["fix"]


# -- 4. where + log with a quant point between the mask and the op ----------------------------------
class MaskedLog(nn.Module):
    """log of y where y > 0, 100 elsewhere: the mask is right, but int8 on where's output (range
    [0, 100], scale ~0.39) rounds every y below ~0.2 to 0 before log."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 8)

    def forward(self, x):
        y = self.fc(x.flatten(1))
        return torch.log(torch.where(y > 0, y, torch.full_like(y, 100.0)))


def test_a_mask_before_log_names_the_quant_point_between_them():
    gen = torch.Generator().manual_seed(0)
    x, t = torch.randn(8, 1, 8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    batches = [Batch(x[:4], t[:4]), Batch(x[4:], t[4:])]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # where and log have no integer kernel: a fallback warning
        qm = prepare(MaskedLog(), QConfig(), example_inputs=x[:4])
    calibrate(qm, [b.inputs for b in batches])
    set_mode(qm, "fake", observe=False)
    point = quant_points(qm)["where"]
    scale, zero = float(point.scale), int(point.zero_point)
    # torch's own fake quantization with that point's grid rounds a small positive value to 0: log(0) = -inf.
    small = torch.tensor([scale / 3])
    assert float(torch.fake_quantize_per_tensor_affine(small, scale, zero, -128, 127)) == 0.0
    first = trace_steps(qm, batches, steps=2, loss="mse").first
    assert (first["phase"], first["layer"], first["cause"]) == ("backward", "log", "backward_op")
    assert f"log's input comes through quant point where (int8, scale {scale:.3g})" in first["fix"]
    assert f"rounds every value below {scale / 2:.3g} to 0" in first["fix"]
    assert "keep where in float" in first["fix"]
    # The same fix holds in float: with where's point off, the run stays finite.
    set_mode(qm, "float", "where")
    assert trace_steps(qm, batches, steps=2, loss="mse").first is None


def test_mask_the_input_advice_in_a_quantized_model_warns_of_the_masks_own_point():
    batches = _data()
    torch.manual_seed(0)
    plain = MaskedSqrt()
    first = trace_steps(copy.deepcopy(plain), batches, steps=2).first
    assert "mask the op's input" in first["fix"] and "quant point" not in first["fix"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = prepare(plain, QConfig(), example_inputs=batches[0].inputs)
    calibrate(qm, [b.inputs for b in batches])
    set_mode(qm, "fake", observe=False)
    first = trace_steps(qm, batches, steps=2).first
    assert first["cause"] == "backward_op" and "mask the op's input" in first["fix"]
    assert "the mask gets a quant point of its own" in first["fix"]


# -- 5. the context manager writes no bundle, and points at none -------------------------------------
def test_the_context_manager_never_points_at_a_repro_bundle():
    class Poisoned(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(x) + math.nan  # made from finite inputs by an op no rule explains

    torch.manual_seed(0)
    model = Poisoned()
    with pytest.raises(NonFiniteError) as caught:
        with qdebug.nan_trace(model):
            model(torch.randn(2, 8))
    report = caught.value.report
    assert report["cause"] == "unknown" and report["created"] is True
    assert "bundle" not in report["fix"] and "--debug" not in report["fix"] and "add" in report["layer"]
