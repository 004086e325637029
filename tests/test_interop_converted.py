"""Importing models converted by torch.ao (eager ``convert``, FX ``convert_fx``) into the engine.

The oracle is torch's converted model itself.  The engine's integer stage
(``qdebug.engine.convert`` of the imported model) must give torch's output codes within
1 LSB of the output scale wherever torch's kernels are exact: their int8 conv and linear add
u8 x s8 product pairs in a saturating int16 on x86 CPUs without AVX512-VNNI, which only
inputs with codes above 127 can overflow (checked per run, skipped with the reason
otherwise).  The 1 LSB is rounding: torch requantizes in float32 and rounds half to even,
the engine uses an integer bias and a fixed-point multiplier and rounds half away.  Each
comparison prints the fraction of outputs that differ at all.  The engine's integer
weights must be torch's ``int_repr`` exactly.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn

from qdebug.engine import quant_points
from qdebug.engine.point import grid_of, tag
from qdebug.engine.prepare import engine_state
from qdebug.errors import QDebugError
from qdebug.interop import detect_flow, from_torch_ao, import_report
from qdebug.interop.converted import read_converted
from qdebug.zoo import ResNet
from small_models import interop_zoo, randomize_bn

tq = pytest.importorskip("torch.ao.quantization")
nnq = pytest.importorskip("torch.ao.nn.quantized")
quantize_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")
# torch 2.13 deprecates torch.ao.quantization and its quantized tensors: what this file imports.
pytestmark = [
    pytest.mark.usefixtures("x86_engine_one_thread"),  # tests/conftest.py
    pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor, torch.quantize_per_channel:UserWarning"),
]


# -- eager-ready models ------------------------------------------------------------------
class EagerBlock(nn.Module):
    """A ResNet basic block; the residual add and its ReLU in one FloatFunctional."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        self.skip = nnq.FloatFunctional()

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        identity = self.downsample(x) if self.downsample is not None else x
        return self.skip.add_relu(out, identity)

    def fusions(self, prefix: str) -> list[list[str]]:
        groups = [[f"{prefix}.conv1", f"{prefix}.bn1", f"{prefix}.relu1"], [f"{prefix}.conv2", f"{prefix}.bn2"]]
        if self.downsample is not None:
            groups.append([f"{prefix}.downsample.0", f"{prefix}.downsample.1"])
        return groups


class EagerResNet(nn.Module):
    """QuantStub, a Conv-BN-ReLU stem, two blocks (one strided, with a 1x1 downsample), pool, fc."""

    def __init__(self):
        super().__init__()
        self.quant = tq.QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, 1, 1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.block1 = EagerBlock(8, 8, 1)
        self.block2 = EagerBlock(8, 16, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        x = self.relu(self.bn(self.conv(self.quant(x))))
        x = self.pool(self.block2(self.block1(x)))
        return self.dequant(self.fc(torch.flatten(x, 1)))

    def fusions(self) -> list[list[str]]:
        return [["conv", "bn", "relu"]] + self.block1.fusions("block1") + self.block2.fusions("block2")


class EagerInvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand, 3x3 depthwise, ReLU6 (eager fusion leaves it apart), 1x1 project."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.expand_conv = nn.Conv2d(cin, hidden, 1, bias=False)
        self.expand_bn = nn.BatchNorm2d(hidden)
        self.expand_act = nn.ReLU6()
        self.dw_conv = nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False)
        self.dw_bn = nn.BatchNorm2d(hidden)
        self.dw_act = nn.ReLU6()
        self.project_conv = nn.Conv2d(hidden, cout, 1, bias=False)
        self.project_bn = nn.BatchNorm2d(cout)
        self.use_res = stride == 1 and cin == cout
        self.skip = nnq.FloatFunctional() if self.use_res else None

    def forward(self, x):
        y = self.expand_act(self.expand_bn(self.expand_conv(x)))
        y = self.project_bn(self.project_conv(self.dw_act(self.dw_bn(self.dw_conv(y)))))
        return self.skip.add(x, y) if self.use_res else y

    def fusions(self, prefix: str) -> list[list[str]]:
        return [[f"{prefix}.{part}_conv", f"{prefix}.{part}_bn"] for part in ("expand", "dw", "project")]


class EagerMobileNet(nn.Module):
    """QuantStub, a Conv-BN-ReLU6 stem, three inverted residuals (two with the skip add), mean, fc."""

    def __init__(self):
        super().__init__()
        self.quant = tq.QuantStub()
        self.stem = nn.Conv2d(3, 8, 3, 2, 1, bias=False)
        self.stem_bn = nn.BatchNorm2d(8)
        self.stem_act = nn.ReLU6()
        self.blocks = nn.Sequential(EagerInvertedResidual(8, 8, 1, 4), EagerInvertedResidual(8, 16, 2, 4),
                                    EagerInvertedResidual(16, 16, 1, 4))
        self.fc = nn.Linear(16, 10)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        x = self.blocks(self.stem_act(self.stem_bn(self.stem(self.quant(x)))))
        return self.dequant(self.fc(x.mean((2, 3))))

    def fusions(self) -> list[list[str]]:
        groups = [["stem", "stem_bn"]]
        for i, block in enumerate(self.blocks):
            groups += block.fusions(f"blocks.{i}")
        return groups


EAGER = {"resnet": EagerResNet, "mobilenet": EagerMobileNet}
ZOO = interop_zoo()
PER_CHANNEL = pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])


# -- torch's flows ---------------------------------------------------------------------------
def _ptq_qconfig(per_channel: bool):
    if per_channel:
        return tq.get_default_qconfig("x86")  # HistogramObserver with reduce_range, per-channel symmetric
    return tq.QConfig(activation=tq.HistogramObserver.with_args(reduce_range=True),
                      weight=tq.default_weight_observer)  # per-tensor symmetric int8


def _qat_qconfig(per_channel: bool):
    if per_channel:
        return tq.get_default_qat_qconfig("x86")
    act = tq.FusedMovingAvgObsFakeQuantize.with_args(observer=tq.MovingAverageMinMaxObserver, quant_min=0,
                                                     quant_max=127, dtype=torch.quint8)
    weight = tq.FusedMovingAvgObsFakeQuantize.with_args(observer=tq.MovingAverageMinMaxObserver, quant_min=-128,
                                                        quant_max=127, dtype=torch.qint8,
                                                        qscheme=torch.per_tensor_symmetric)
    return tq.QConfig(activation=act, weight=weight)


def _batches(n: int, seed: int, shape=(2, 3, 32, 32)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(n)]


def _train(prepared: nn.Module, steps: int) -> None:
    """A few SGD steps (BN statistics, scales and weights all move), then eval."""
    opt = torch.optim.SGD(prepared.parameters(), lr=0.05)
    for x in _batches(steps, 7):
        out = prepared(x)
        outs = list(out.values()) if isinstance(out, dict) else [out]
        sum(o.pow(2).mean() for o in outs).backward()
        opt.step()
        opt.zero_grad()
    prepared.eval()


def _eager(name: str, qat: bool, per_channel: bool) -> tuple[nn.Module, nn.Module]:
    """(the float model, torch's converted model) of an eager-ready model."""
    torch.manual_seed(0)
    model = EAGER[name]()
    randomize_bn(model, 11)
    float_model = copy.deepcopy(model).eval()
    if qat:
        model.train()
        tq.fuse_modules_qat(model, model.fusions(), inplace=True)
        model.qconfig = _qat_qconfig(per_channel)
        prepared = tq.prepare_qat(model)
        _train(prepared, 3)
    else:
        model.eval()
        tq.fuse_modules(model, model.fusions(), inplace=True)
        model.qconfig = _ptq_qconfig(per_channel)
        prepared = tq.prepare(model)
        with torch.no_grad():
            for x in _batches(3, 5):
                prepared(x)
    return float_model, tq.convert(prepared.eval())


def _fx(name: str, qat: bool, per_channel: bool) -> tuple[nn.Module, nn.Module]:
    """(the float model, convert_fx's model) of a zoo model."""
    torch.manual_seed(0)
    model = ZOO[name]()
    randomize_bn(model, 11)
    x = _batches(1, 5)[0]
    qconfig = _qat_qconfig(per_channel) if qat else _ptq_qconfig(per_channel)
    mapping = tq.QConfigMapping().set_global(qconfig)
    if qat:
        prepared = quantize_fx.prepare_qat_fx(copy.deepcopy(model).train(), mapping, (x,))
        _train(prepared, 3)
    else:
        prepared = quantize_fx.prepare_fx(copy.deepcopy(model).eval(), mapping, (x,))
        with torch.no_grad():
            for batch in _batches(3, 5):
                prepared(batch)
    return model.eval(), quantize_fx.convert_fx(prepared)


def _weighted(converted: nn.Module) -> dict[str, nn.Module]:
    found = {}
    for path, m in converted.named_modules():
        weight = getattr(m, "weight", None)
        if callable(weight) and not isinstance(weight, torch.Tensor) and type(m).__module__.startswith("torch.ao.nn"):
            found[path] = m
    return found


def _assert_weights_exact(converted: nn.Module, integer: nn.Module, per_channel: bool) -> None:
    """The engine's integer weights are torch's int_repr, with torch's scales."""
    weighted = _weighted(converted)
    assert weighted
    for path, m in weighted.items():
        w = m.weight()
        layer = integer.get_submodule(path)
        point = layer.weight_point
        assert point.spec.per_channel == per_channel and point.frozen
        zero_point = point.zero_point.reshape(-1, *([1] * (w.dim() - 1))) if per_channel else point.zero_point
        assert torch.equal(layer.weight_int.to(torch.int64) + zero_point, w.int_repr().to(torch.int64)), path
        scales = w.q_per_channel_scales() if per_channel else torch.tensor(w.q_scale())
        assert torch.equal(point.scale, scales.float().reshape(point.scale.shape)), path


def _assert_report_complete(qm: nn.Module) -> None:
    """Every quantizer maps exactly and every engine point is torch's: nothing left float."""
    report = import_report(qm)
    rows = list(zip(report["source"], report["kind"], report["point"], report["status"], report["note"]))
    assert rows
    bad = [r for r in rows if r[3] not in ("exact", "moved")]
    assert not bad, bad


class TorchRun:
    """One run of torch's converted model: each leaf module's quantized (input, output) per
    call by path, the quantized tensors its outputs are dequantized from, and the largest
    activation code that entered one of its int8 conv/linear kernels."""

    def __init__(self, converted: nn.Module, probe: torch.Tensor):
        self.modules: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.largest_code = 0
        hooks = []
        weighted = set(_weighted(converted).values())

        def record(path):
            def hook(module, args, output):
                x = args[0] if args else None
                if isinstance(x, torch.Tensor) and x.is_quantized and isinstance(output, torch.Tensor) \
                        and output.is_quantized:
                    self.modules.setdefault(path, []).append((x, output))
                    if module in weighted:
                        self.largest_code = max(self.largest_code, int(x.int_repr().max()))
            return hook

        for path, m in converted.named_modules():
            # Leaves, and torch's quantized modules (a QuantizedLinear holds its packed params).
            if path and (not list(m.children()) or type(m).__module__.startswith("torch.ao.nn.")):
                hooks.append(m.register_forward_hook(record(path)))
        dequantized: list[torch.Tensor] = []
        for m in converted.modules():
            if isinstance(m, nnq.DeQuantize):
                hooks.append(m.register_forward_pre_hook(lambda mod, args: dequantized.append(args[0])))
        try:
            with torch.no_grad():
                if isinstance(converted, torch.fx.GraphModule):
                    self.outputs = _fx_outputs(converted, probe)
                else:
                    converted(probe)
                    self.outputs = {"out": dequantized[-1]}
        finally:
            for h in hooks:
                h.remove()

    def not_exact_because(self) -> str | None:
        """Why torch's x86 int8 kernels may not be exact on this run, or None (docs/engine.md)."""
        if self.largest_code <= 127:
            return None  # |u8 x s8 + u8 x s8| <= 2 x 127 x 128 fits int16 on every CPU
        for var in ("FBGEMM_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
            if os.environ.get(var, "ALL").upper() not in ("ALL", "DEFAULT", ""):
                return f"{var}={os.environ[var]} may take VNNI from torch's int8 kernels (int16 pair sums saturate)"
        capabilities = getattr(torch.cpu, "get_capabilities", None)
        if capabilities is not None and not capabilities().get("avx512_vnni", False):
            return (f"codes up to {self.largest_code} enter torch's int8 kernels and this CPU has no AVX512-VNNI: "
                    "torch adds u8 x s8 product pairs in a saturating int16 there (vpmaddubsw)")
        return None


def _fx_outputs(gm, probe) -> dict:
    """The quantized tensors convert_fx's graph dequantizes into its outputs, by output key."""
    values = {}

    class Capture(torch.fx.Interpreter):
        def run_node(self, node):
            values[node] = out = super().run_node(node)
            return out

    Capture(gm).run(probe)
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    items = output.items() if isinstance(output, dict) else [("out", output)]
    return {key: values[node.args[0]] for key, node in items}


def _lsb(ours: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """|our code - torch's code| of float values on torch's grid (asserted on it)."""
    codes = torch.round(ours / q.q_scale()).to(torch.int64)
    assert torch.equal(codes.float() * torch.tensor(q.q_scale(), dtype=torch.float32), ours), "off torch's grid"
    return (codes + q.q_zero_point() - q.int_repr().to(torch.int64)).abs()


def _kernel_diffs(run: TorchRun, integer: nn.Module, probe: torch.Tensor,
                  seen: list | None = None) -> dict[str, tuple[int, float]]:
    """Each kernel of the engine's integer stage fed torch's own input codes: (its output's
    largest difference from torch's in codes, the fraction of codes that differ) by module path;
    ``seen`` (when given) gets (key, call index, our output, torch's output) of each.

    Every leaf module of the engine model whose path holds a module of torch's that computed
    quantized tensors gets torch's input before it runs and passes torch's output on after it
    (on the same grid, so downstream sees exactly torch's values): one kernel's differences do
    not pile up in the next.  What an inline op between two modules computes (an add, a mean)
    is measured at the next module's input, under "<path> input"."""
    # The hooks run inside the engine's forward, whose naming sees every torch op: they only
    # swap and keep tensors (made beforehand); the measuring waits until after.
    given = {path: [(q_in.dequantize(), q_out.dequantize()) for q_in, q_out in calls]
             for path, calls in run.modules.items()}
    seen = [] if seen is None else seen
    calls: dict[str, int] = {}

    def force_input(path):
        def pre_hook(module, args):
            k = calls.get(path, 0)
            if k >= len(given[path]) or grid_of(args[0]) is None:
                return None
            seen.append((f"{path} input", k, args[0], run.modules[path][k][0]))
            return (tag(given[path][k][0], grid_of(args[0])),) + tuple(args[1:])
        return pre_hook

    def force_output(path):
        def hook(module, args, output):
            k = calls.get(path, 0)
            calls[path] = k + 1
            if k >= len(given[path]) or grid_of(output) is None:
                return None
            seen.append((path, k, output, run.modules[path][k][1]))
            return tag(given[path][k][1], grid_of(output))
        return hook

    hooks = []
    for path, m in integer.named_modules():
        if path in given and not list(m.children()):
            hooks.append(m.register_forward_pre_hook(force_input(path)))
            hooks.append(m.register_forward_hook(force_output(path)))
    try:
        with torch.no_grad():
            integer(probe)
    finally:
        for h in hooks:
            h.remove()
    diffs: dict[str, tuple[int, float]] = {}
    for key, _, ours, q in seen:
        lsb = _lsb(ours, q)
        worst, fraction = diffs.get(key, (0, 0.0))
        diffs[key] = (max(worst, int(lsb.max())), max(fraction, float((lsb > 0).float().mean())))
    return diffs


def _assert_only_at_near_ties(module: nn.Module, q_in: torch.Tensor, q_out: torch.Tensor, ours: torch.Tensor) -> None:
    """Where our code of a torch conv/linear output differs from torch's, torch's real value
    lies at a rounding near-tie: the two differ only by how they requantize (torch: float32,
    the float bias, half to even; the engine: an integer bias, a fixed-point multiplier, half
    away), |real - tie| <= M / 2 with M = s_x s_w / s_y (the integer bias's rounding) + 1e-3."""
    w = module.weight()
    x = q_in.int_repr().double() - q_in.q_zero_point()
    per_channel = w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric)
    w_zero = w.q_per_channel_zero_points() if per_channel else torch.tensor(w.q_zero_point())
    w_scale = w.q_per_channel_scales().double() if per_channel else torch.tensor(w.q_scale(), dtype=torch.float64)
    w_codes = w.int_repr().double() - w_zero.double().reshape(-1, *([1] * (w.dim() - 1)) if per_channel else ())
    if isinstance(module, nnq.Linear):
        acc = torch.nn.functional.linear(x, w_codes)
        shape = [-1]
    else:
        conv = {3: torch.nn.functional.conv1d, 4: torch.nn.functional.conv2d}[x.dim()]
        acc = conv(x, w_codes, None, module.stride, module.padding, module.dilation, module.groups)
        shape = [1, -1] + [1] * (x.dim() - 2)
    bias = module.bias()
    bias = torch.zeros(()) if bias is None else bias.double().reshape(shape)
    s_x, s_y = q_in.q_scale(), q_out.q_scale()
    real = (acc * s_x * w_scale.reshape(shape if per_channel else ()) + bias) / s_y
    theirs = q_out.int_repr().to(torch.int64)
    mine = torch.round(ours / s_y).to(torch.int64) + q_out.q_zero_point()
    off = mine != theirs
    tie = (theirs + mine).double() / 2 - q_out.q_zero_point()
    allowed = (s_x * w_scale.reshape(shape if per_channel else ()) / s_y / 2 + 1e-3).expand_as(real)
    assert bool(((real - tie).abs()[off] <= allowed[off]).all()), "a code differs away from a rounding near-tie"


def _assert_matches_torch(converted: nn.Module, qm: nn.Module, label: str) -> None:
    """The engine's integer stage against torch's converted model, on a probe batch.

    Kernel by kernel (each fed torch's input): within 1 LSB, a code differing in at most 5% of
    a layer's outputs (measured up to 1.6%, at an average pooling), and for a conv or linear
    only at a rounding near-tie.  End to end:
    those 1-LSB differences propagate through the layers after them, so the outputs may
    differ by more than 1 LSB; at most 4 (measured: up to 3, in 25% of 80 outputs)."""
    integer = qm  # from_torch_ao gives a converted source's integer stage
    assert engine_state(integer).stage == "quantized"
    probe = _batches(1, 9, (8, 3, 32, 32))[0]
    run = TorchRun(converted, probe)
    reason = run.not_exact_because()
    if reason is not None:
        pytest.skip(reason)
    seen: list = []
    kernels = _kernel_diffs(run, integer, probe, seen)
    weighted = _weighted(converted)
    for key, k, ours, q_out in seen:
        if key in weighted and isinstance(weighted[key], (nnq.Conv1d, nnq.Conv2d, nnq.Linear)):
            _assert_only_at_near_ties(weighted[key], run.modules[key][k][0], q_out, ours)
    forced = [k for k in kernels if not k.endswith(" input")]
    assert len(forced) >= len(weighted), sorted(kernels)
    worst = max(kernels.items(), key=lambda kv: kv[1])
    assert all(w <= 1 for w, _ in kernels.values()), worst
    assert all(f <= 0.05 for _, f in kernels.values()), max(kernels.items(), key=lambda kv: kv[1][1])
    with torch.no_grad():
        ours = integer(probe)
    ours = ours if isinstance(ours, dict) else {"out": ours}
    lsb = torch.cat([_lsb(ours[key], q).flatten() for key, q in run.outputs.items()])
    print(f"\n{label}: kernels fed torch's inputs: {sum(f > 0 for _, f in kernels.values())}/{len(kernels)} differ "
          f"somewhere, by <= {max(w for w, _ in kernels.values())} LSB, in <= "
          f"{max(f for _, f in kernels.values()):.2%} of a kernel's codes; end to end: "
          f"{int((lsb > 0).sum())}/{lsb.numel()} output codes differ ({float((lsb > 0).float().mean()):.1%}), "
          f"by <= {int(lsb.max())} LSB")
    assert int(lsb.max()) <= 4


# -- tests -----------------------------------------------------------------------------------
@PER_CHANNEL
@pytest.mark.parametrize("qat", [False, True], ids=["ptq", "qat"])
@pytest.mark.parametrize("name", sorted(EAGER))
def test_eager_converted_matches_torch(name, qat, per_channel):
    float_model, converted = _eager(name, qat, per_channel)
    assert detect_flow(converted) == "eager-converted"
    qm = from_torch_ao(converted, _batches(1, 5)[0])
    assert engine_state(qm).stage == "quantized"
    _assert_report_complete(qm)
    _assert_weights_exact(converted, qm, per_channel)
    # The user's module paths: every layer of the float model is where it was.
    assert {p for p, m in float_model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))} == \
        {p.rpartition(".")[0] for p, pt in quant_points(qm).items() if pt.kind == "weight"}
    _assert_matches_torch(converted, qm, f"eager {name} {'qat' if qat else 'ptq'} "
                                         f"{'per-channel' if per_channel else 'per-tensor'}")


@PER_CHANNEL
@pytest.mark.parametrize("qat", [False, True], ids=["ptq", "qat"])
def test_fx_converted_resnet_matches_torch(qat, per_channel):
    float_model, converted = _fx("resnet", qat, per_channel)
    assert detect_flow(converted) == "fx-converted"
    qm = from_torch_ao(converted, _batches(1, 5)[0], float_model=float_model)
    _assert_report_complete(qm)
    _assert_weights_exact(converted, qm, per_channel)
    _assert_matches_torch(converted, qm, f"fx resnet {'qat' if qat else 'ptq'} "
                                         f"{'per-channel' if per_channel else 'per-tensor'}")


@pytest.mark.parametrize("name", ["mobilenetv2", "shufflenetv2", "multitask"])
def test_fx_converted_zoo_matches_torch(name):
    float_model, converted = _fx(name, False, True)
    qm = from_torch_ao(converted, _batches(1, 5)[0], float_model=float_model)
    _assert_report_complete(qm)
    _assert_weights_exact(converted, qm, True)
    _assert_matches_torch(converted, qm, f"fx {name} ptq per-channel")


def test_folded_bn_keeps_its_path_and_the_conv_requantizes_onto_the_relu():
    """torch folded the BN into the conv (PTQ fusion): an nn.Identity keeps the BN's path, the
    report says so, and the conv's integer kernel requantizes straight onto the ReLU's grid, as
    torch's ConvReLU2d does (the identity between them is no second use of the conv's output)."""
    float_model, converted = _eager("resnet", False, True)
    qm = from_torch_ao(converted, _batches(1, 5)[0], float_model=float_model)
    assert type(qm.bn) is nn.Identity and type(qm.block1.bn2) is nn.Identity and isinstance(qm.relu, nn.ReLU)
    report = import_report(qm)
    folded = {s: n for s, k, n in zip(report["source"], report["kind"], report["note"]) if k == "bn"}
    assert set(folded) == {"bn", "block1.bn1", "block1.bn2", "block2.bn1", "block2.bn2", "block2.downsample.1"}
    assert "folded into 'conv'" in folded["bn"]
    calls = engine_state(qm).plan.calls
    assert calls["conv"].fused_into == "relu" and calls["conv"].output_point == "relu"
    assert calls["block1.conv1"].fused_into == "block1.relu1"
    points = quant_points(qm)
    assert "conv" not in points and points["relu"].mode == "fake"
    assert float(points["relu"].scale) == pytest.approx(converted.conv.scale, rel=1e-7)
    assert int(points["relu"].zero_point) == converted.conv.zero_point
    # torch's quint8 kernels clamp to [0, 255], whatever range the observer chose the scale on.
    assert (points["relu"].spec.qmin, points["relu"].spec.qmax) == (0, 255)


def test_a_users_identity_is_no_folded_bn_when_float_model_says_so():
    """Without float_model every identity on a conv's output reads as a folded BN; with it,
    only the ones at a BatchNorm's path do."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)
            self.tap = nn.Identity()  # the user's own
            self.fc = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            return self.dequant(self.fc(self.tap(self.bn(self.conv(self.quant(x))))))

    torch.manual_seed(3)
    model = Net().eval()
    randomize_bn(model, 11)
    float_model = copy.deepcopy(model)
    tq.fuse_modules(model, [["conv", "bn"]], inplace=True)
    model.qconfig = _ptq_qconfig(True)
    prepared = tq.prepare(model)
    x = _batches(1, 5, (2, 3, 12, 12))[0]
    prepared(x)
    converted = tq.convert(prepared)
    with_float = import_report(from_torch_ao(converted, x, float_model=float_model))
    without = import_report(from_torch_ao(converted, x))
    assert [s for s, k in zip(with_float["source"], with_float["kind"]) if k == "bn"] == ["bn"]
    assert [s for s, k in zip(without["source"], without["kind"]) if k == "bn"] == ["bn", "tap"]


def test_dynamic_linear_weights_import_and_its_input_is_a_dynamic_point():
    # (tests/test_interop_recurrent.py checks the dynamic input grid and the outputs against torch)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
    dynamic = tq.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    assert detect_flow(dynamic) == "eager-converted"
    qm = from_torch_ao(dynamic, torch.randn(2, 8))
    for path in ("0", "2"):
        w = dynamic.get_submodule(path).weight()
        layer = qm.get_submodule(path)
        assert torch.equal(layer.weight_point.apply(layer.weight.detach()), w.dequantize())  # torch's int8 codes
    report = import_report(qm)
    assert "unmapped" not in set(report["status"])
    inputs = dict(zip(report["source"], report["point"]))
    assert (inputs["0.input"], inputs["2.input"]) == ("input", "1")
    assert all(quant_points(qm)[p].spec.dynamic for p in ("input", "1"))


def test_refusals_are_one_clear_error():
    _, converted = _fx("resnet", False, True)
    x = _batches(1, 5)[0]
    with pytest.raises(QDebugError, match="float_model"):
        from_torch_ao(converted, x)
    wider = ResNet(layers=[1, 1], widths=[16, 16], num_classes=10, stem="small")
    with pytest.raises(QDebugError, match="shape"):
        from_torch_ao(converted, x, float_model=wider)
    with pytest.raises(QDebugError, match="pt2e"):
        read_converted(converted, x, wider, "pt2e-converted")

    class Unsupported(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant = nnq.Quantize(0.05, 64, torch.quint8)
            self.norm = nnq.LayerNorm([4], nn.Parameter(torch.ones(4)), nn.Parameter(torch.zeros(4)), 0.05, 64)
            self.dequant = nnq.DeQuantize()

        def forward(self, x):
            return self.dequant(self.norm(self.quant(x)))

    with pytest.raises(QDebugError, match="LayerNorm"):
        from_torch_ao(Unsupported(), torch.randn(2, 4))

    float_model = ZOO["resnet"]().eval()
    prepared = quantize_fx.prepare_fx(copy.deepcopy(float_model), tq.QConfigMapping().set_global(_ptq_qconfig(True)),
                                      (x,))
    prepared(x)
    reference = quantize_fx.convert_to_reference_fx(prepared)
    with pytest.raises(QDebugError, match="reference"):
        read_converted(reference, x, float_model, "fx-converted")


def test_fx_layers_left_float_stay_float_with_the_graphs_weights():
    """qconfig None for one conv and the fc: torch computes them in float (the conv with its BN
    folded in), between a dequantize and a quantize_per_tensor.  The engine leaves their weights
    and outputs float, with the graph's (folded) weights, and quantizes the conv's output with
    the quantize_per_tensor's grid; every integer kernel fed torch's codes is within 1 LSB."""
    float_model = ZOO["resnet"]().eval()
    randomize_bn(float_model, 11)
    x = _batches(1, 5)[0]
    mapping = tq.QConfigMapping().set_global(_ptq_qconfig(True)).set_module_name("fc", None) \
        .set_module_name("layer2.0.conv2", None)
    prepared = quantize_fx.prepare_fx(copy.deepcopy(float_model), mapping, (x,))
    prepared(x)
    converted = quantize_fx.convert_fx(prepared)
    qm = from_torch_ao(converted, x, float_model=float_model)
    report = import_report(qm)
    rows = {(p, k): (s, n) for p, k, s, n in zip(report["point"], report["kind"], report["status"], report["note"])}
    assert rows[("fc.weight", "weight")][0] == "float" and rows[("fc", "activation")][0] == "float"
    assert rows[("layer2.0.conv2.weight", "weight")][0] == "float"
    assert rows[("layer2.0.conv2", "activation")][0] == "exact"
    assert "layer2.0.bn2" in set(report["source"])  # folded by FX into the float conv
    assert type(qm.layer2[0].bn2) is nn.Identity
    assert torch.equal(qm.layer2[0].conv2.weight, converted.get_submodule("layer2.0.conv2").weight)
    probe = _batches(1, 9, (8, 3, 32, 32))[0]
    run = TorchRun(converted, probe)
    reason = run.not_exact_because()
    if reason is not None:
        pytest.skip(reason)
    kernels = _kernel_diffs(run, qm, probe)
    assert {"layer2.0.conv1", "layer2.0.downsample.0", "avgpool input"} <= set(kernels)
    assert all(w <= 1 for w, _ in kernels.values()), kernels


# -- transposed convs: one reason in every flow (issue 29 item 7) -----------------------------
class UpNet(nn.Module):
    """A conv, then a ConvTranspose2d (the engine has no transposed-conv kernel), then a conv."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU()
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.conv2 = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.dequant(self.conv2(self.up(self.relu(self.conv(self.quant(x))))))


def _up_flow(flow: str, x: torch.Tensor) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(float model, torch's model of ``flow``, the model its import computes against) -- torch's
    per-channel weight observers refuse ConvTranspose, so the layer gets per-tensor ones."""
    torch.manual_seed(0)
    model = UpNet()
    float_model = copy.deepcopy(model).eval()
    qat = "qat" in flow
    qconfig = _qat_qconfig(False) if qat else _ptq_qconfig(False)
    model.train(qat)
    if flow.startswith("eager"):
        model.qconfig = qconfig
        prepared = (tq.prepare_qat if qat else tq.prepare)(model)
    else:
        mapping = tq.QConfigMapping().set_global(qconfig)
        prepared = (quantize_fx.prepare_qat_fx if qat else quantize_fx.prepare_fx)(model, mapping, (x,))
    if qat:
        _train(prepared, 2)
        prepared.apply(tq.disable_observer)
    else:
        with torch.no_grad():
            for batch in _batches(2, 5, tuple(x.shape)):
                prepared(batch)
    prepared.eval()
    if flow.endswith("converted"):
        return float_model, (tq.convert if flow.startswith("eager") else quantize_fx.convert_fx)(prepared), prepared
    return float_model, prepared, prepared


@pytest.mark.parametrize("flow", ["eager-qat", "eager-ptq", "eager-qat-converted", "eager-ptq-converted",
                                  "fx-qat", "fx-ptq", "fx-qat-converted", "fx-ptq-converted"])
def test_a_transposed_convs_weight_is_unmapped_with_one_reason_in_every_flow(flow):
    """torch's convert quantizes a ConvTranspose2d's weight (nnq.ConvTranspose2d); its QAT and PTQ
    preparations leave it float until then.  The engine has no transposed-conv kernel: in every
    flow the weight quantizer torch has or will build is listed unmapped, with the same reason,
    and the layer computes in float as torch's prepared model does (QAT: bit-identical)."""
    x = _batches(1, 5, (2, 3, 8, 8))[0]
    float_model, source, prepared = _up_flow(flow, x)
    with pytest.warns(UserWarning, match=r"no quantized kernel for these ops.*up \(ConvTranspose2d"):
        qm = from_torch_ao(source, x, float_model=None if flow.startswith("eager") else float_model)
    report = import_report(qm)
    rows = [(s, st, p, n) for s, k, st, p, n in zip(report["source"], report["kind"], report["status"],
                                                     report["point"], report["note"]) if k == "weight"]
    up = [r for r in rows if r[0].startswith("up.")]
    expected = ("ConvTranspose2d: no transposed-conv kernel in qdebug yet, its weight stays float "
                "(torch's convert quantizes it)")
    assert [(st, p, n) for _, st, p, n in up] == [("unmapped", "", expected)], rows
    assert up[0][0] == ("up.weight()" if flow.endswith("converted") else "up.qconfig.weight()")
    assert {p for _, st, p, _ in rows if st != "unmapped"} == {"conv.weight", "conv2.weight"}
    assert "up.weight" not in quant_points(qm)
    if flow.endswith("qat"):  # torch's QAT model keeps the layer float: the import computes it exactly
        with torch.no_grad():
            assert torch.equal(qm(x), prepared(x))


# -- quantize_dynamic's Linear input (issue 29 item 7) ------------------------------------------
class SharedInputBlock(nn.Module):
    """Attention's shape: q, k and v projections all read the norm's output; o reads the context."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        h = self.norm(x)
        attn = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2), -1)
        return x + self.o(attn @ self.v(h))


def _dynamic(flow: str, model: nn.Module, x: torch.Tensor) -> nn.Module:
    if flow == "eager":
        return tq.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
    mapping = tq.QConfigMapping().set_object_type(nn.Linear, tq.default_dynamic_qconfig)
    prepared = quantize_fx.prepare_fx(copy.deepcopy(model), mapping, (x,))
    prepared(x)
    return quantize_fx.convert_fx(prepared)


@pytest.mark.parametrize("flow", ["eager", "fx"])
def test_dynamic_linear_inputs_are_dynamic_points_and_compute_torchs_output(flow):
    """Every nnqd.Linear's input is a dynamic point (torch quantizes it per batch): in the FX flow
    too (convert_fx's dynamic Linears imported their weights only: off by 1.4% of the output),
    and where one producer feeds only dynamic Linears (q, k, v read one norm output: each
    quantizes the same tensor the same way).  The outputs are torch's within 1e-5 of their
    largest magnitude (docs/interop.md: fbgemm's float64 range and float rescale)."""
    torch.manual_seed(0)
    model = SharedInputBlock().eval()
    x = _batches(1, 5, (2, 5, 8))[0]
    dynamic = _dynamic(flow, model, x)
    qm = from_torch_ao(dynamic, x, float_model=None if flow == "eager" else model)
    report = import_report(qm)
    inputs = {s: (st, p) for s, k, st, p in zip(report["source"], report["kind"], report["status"], report["point"])
              if s.endswith(".input")}
    assert inputs == {"q.input": ("exact", "norm"), "k.input": ("exact", "norm"), "v.input": ("exact", "norm"),
                      "o.input": ("exact", "matmul#2")}
    assert "unmapped" not in set(report["status"])
    points = quant_points(qm)
    assert points["norm"].spec.dynamic and points["matmul#2"].spec.dynamic
    assert (points["norm"].spec.qmin, points["norm"].spec.qmax) == (0, 127)  # x86: reduce_range
    assert engine_state(qm).stage == "fake"  # the fake-quant model: no integer kernel for a dynamic input yet
    for seed in range(3):
        batch = _batches(1, 20 + seed, (2, 5, 8))[0]
        with torch.no_grad():
            ours, theirs = qm(batch), dynamic(batch)
        assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())


@pytest.mark.parametrize("flow", ["eager", "fx"])
def test_a_dynamic_input_shared_with_a_float_op_is_unmapped_with_the_reason(flow):
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = torch.relu(self.fc1(x))
            return h + self.fc2(h)  # relu's output: fc2 (quantized per batch) and the add (float)

    torch.manual_seed(0)
    model = Residual().eval()
    x = _batches(1, 5, (4, 8))[0]
    qm = from_torch_ao(_dynamic(flow, model, x), x, float_model=None if flow == "eager" else model)
    report = import_report(qm)
    rows = {s: (st, p, n) for s, k, st, p, n in zip(report["source"], report["kind"], report["status"],
                                                    report["point"], report["note"]) if k == "activation" and s}
    assert rows["fc1.input"][:2] == ("exact", "input")
    assert rows["fc2"][:2] == ("unmapped", "") and "its producer feeds other calls too" in rows["fc2"][2]


# -- torch's quantized kernels on packed weights at the graph root (issue 29 item 5) ----------
class OwnForwardLinear(nn.Linear):
    """A Linear with a forward of its own (timm's ``Linear``): FX traces into it."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)


class PackedNet(nn.Module):
    """A conv, a Linear with its own forward, and a functional linear on a plain tensor (torch's
    zoo ``FunctionalLinear``): convert_fx lowers both linears to torch.ops.quantized.linear on
    packed weights held at the graph's root."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = OwnForwardLinear(4, 6)
        self.w = torch.randn(3, 6)

    def forward(self, x):
        return torch.nn.functional.linear(self.fc(torch.relu(self.conv(x)).mean((2, 3))), self.w)


@pytest.mark.filterwarnings("ignore:qdebug. no quantized kernel")  # the functional linear: float, re-quantized
def test_fx_packed_weights_load_into_the_layer_fx_traced_into_and_a_functional_weight_is_listed():
    torch.manual_seed(0)
    model, x = PackedNet().eval(), _batches(1, 5, (2, 3, 8, 8))[0]
    prepared = quantize_fx.prepare_fx(copy.deepcopy(model), tq.get_default_qconfig_mapping("x86"), (x,))
    prepared(x)
    converted = quantize_fx.convert_fx(prepared)
    packed = {str(n.args[1].target): n for n in converted.graph.nodes
              if n.op == "call_function" and str(n.target) == "quantized.linear"}
    fc_attr = next(a for a in packed if a.startswith("fc_"))
    functional_attr = next(a for a in packed if a != fc_attr)
    qm = from_torch_ao(converted, x, float_model=model)
    report = import_report(qm)
    rows = {s: (p, st, n) for s, p, st, n in zip(report["source"], report["point"], report["status"], report["note"])}
    # As a converted nn.quantized.Linear at 'fc': torch's int8 weight and float bias, its output grid.
    assert rows[fc_attr][:2] == ("fc.weight", "exact") and rows[packed[fc_attr].name][:2] == ("fc", "exact")
    weight, bias = getattr(converted, fc_attr).unpack()
    assert torch.equal(qm.fc.weight, weight.dequantize()) and torch.equal(qm.fc.bias, bias)
    assert torch.equal(quant_points(qm)["fc.weight"].scale.flatten(), weight.q_per_channel_scales().float())
    # The functional linear's weight: no engine weight point, listed with the reason.
    assert rows[functional_attr][1] == "unmapped" and "no engine weight point" in rows[functional_attr][2]
    assert rows[packed[functional_attr].name][1] == "exact"  # its output grid is read
    with torch.no_grad():
        ours, theirs = qm(x), converted(x)
    step = float(getattr(converted, str(packed[functional_attr].args[2].target)))
    assert float((ours - theirs).abs().max()) <= 2 * step
