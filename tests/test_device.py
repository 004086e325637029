"""Devices (issue 18, item 2): ``--device cpu|cuda|cuda:N`` (config ``device``) on every command
that runs a model, ``device=`` in the Python API, and the engine computing on whatever device
its inputs are on.

Two halves:

- everywhere: the option's parsing and errors (a bad name answers before torch imports; CUDA
  asked for on a machine without it is one ``error:`` line and exit 2), ``--device cpu`` and
  ``device="cpu"`` giving the results of no option, the config key, and the engine's device
  plumbing checked on the CPU (the kernels the integer simulation allows, the rounding of
  ties, the caches and scratch buffers keyed by device);
- where CUDA exists (skipped elsewhere, with the reason): compare, step, calibrate and the
  integer simulation on zoo models, CUDA against CPU.

Tolerances of the CUDA-vs-CPU tests, from the arithmetic:

- **integer simulation: exact.**  Codes are integers; convolutions and matmuls of codes are
  sums of exact products on both devices (cuDNN off, float32 only where every partial sum is
  below 2^24, else float64); requantization is integer arithmetic; a mean of codes rounds its
  ties alike (``qdebug.engine.functional._rescale_average``).  Any difference is a bug.
- **float outputs: 1e-4 of the output's largest magnitude.**  A float32 convolution of K terms
  summed in another order differs by about sqrt(K) eps32 (~2e-6 for K = 1000) of its inputs'
  magnitude per layer; over a ~20-layer model that stays below 1e-4 (both devices in IEEE
  float32: ``qdebug.config.device.ieee_float32`` turns cuDNN's TF32 off).
- **SQNR: 0.25 dB, both values capped at 60 dB.**  The device difference d of a feature map is
  ~1e-5 of the signal (-100 dB); against quantization noise e at <= -60 dB it moves sum(e^2)
  by at most 2|d|/|e| = 2% (0.09 dB).  A fake-quant code flips where a value lies within ~1e-6
  of a rounding threshold (a fraction p ~ 256 x 1e-6 of int8 values); at the threshold the
  error is +-s/2 either way, and downstream the flips add ~12 p = 0.3% to the noise (0.013 dB).
  Above 60 dB the noise is itself float32 rounding and differs from device to device.
- **saturation: 1e-3** (values within float32 rounding of a range end, the same ~p);
  **scales: 1e-4 relative** (a min/max of activations that differ by float32 rounding);
  **zero points: +-1** (round(min / s) at a tie).
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import qdebug
from qdebug.config.device import (
    check_device_name, hold, ieee_float32, model_device, release_held, resolve_device, to_device,
)
from qdebug.engine import QConfig, QuantSpec, calibrate, convert, prepare
from qdebug.engine import integer
from qdebug.engine.functional import _rescale_average
from qdebug.engine.modules import _QWeighted
from qdebug.engine.point import QuantPoint
from qdebug.errors import QDebugError
from qdebug.io.modelspec import ModelSpec, build

from small_models import RESNET, SMALL_MOBILENETV2, SMALL_RESNET
from user_project import exit_before_torch

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device: the CUDA-vs-CPU equality tests run "
                                "where torch.cuda.is_available() (this machine has none)")
no_cuda = pytest.mark.skipif(CUDA, reason="this machine has CUDA: the error for its absence cannot happen")
MOBILENET = "qdebug.zoo.mobilenetv2:MobileNetV2"
SQNR_CAP_DB, SQNR_TOL_DB = 60.0, 0.25


# -- the option and its errors ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_names_qdebug_runs_on(name):
    assert check_device_name(name) == name
    assert check_device_name(torch.device(name)) == name


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:0:1", "mps", "cpu:0", " cuda", ""])
def test_any_other_name_is_a_usage_error(cli, stages, name):
    result = cli("compare", stages.float, stages.quantized, "--device", name)
    result.assert_error(f"--device {name!r} cannot be used here: qdebug runs on cpu, cuda", "--device cpu")


def test_a_bad_device_name_answers_before_torch_loads(tmp_path):
    out, err = exit_before_torch(["compare", "a.pt", "b.pt", "--device", "gpu"], tmp_path)
    assert out.split() == ["2", "False"], (out, err)
    assert "error: --device 'gpu' cannot be used here" in err
    assert "Traceback" not in err


def _commands(stages, tmp_path):
    data = ["--data", stages.data]
    return {
        "compare": ["compare", stages.float, stages.quantized, *data],
        "step": ["step", stages.float, stages.calibrated, *data],
        "suggest": ["suggest", stages.float, stages.calibrated, *data],
        "baseline": ["baseline", stages.float, stages.quantized, "--metric", "top1", *data],
        "calibrate": ["calibrate", stages.float, *data, "-o", tmp_path / "out.pt"],
        "nan-trace": ["nan-trace", stages.qat, *data, "--steps", "1"],
        "inspect": ["inspect", stages.float],
        "convert": ["convert", stages.qat, "-o", tmp_path / "out.pt"],
    }


@no_cuda
@pytest.mark.parametrize("command", ["compare", "step", "suggest", "baseline", "calibrate", "nan-trace", "inspect",
                                     "convert"])
def test_cuda_where_there_is_none_is_one_clean_error(cli, stages, tmp_path, command):
    result = cli(*_commands(stages, tmp_path)[command], "--device", "cuda")
    line = result.assert_error("--device 'cuda' cannot be used here: ", "hint: use --device cpu")
    assert "built without CUDA" in line or "finds no CUDA device" in line, line
    assert not (tmp_path / "out.pt").exists()  # refused before any work


@pytest.mark.parametrize("command", ["compare", "step", "suggest", "baseline", "calibrate", "nan-trace", "inspect",
                                     "convert"])
def test_every_command_that_runs_a_model_takes_device(cli, command):
    result = cli(command, "--help")
    assert result.code == 0 and "--device cpu|cuda|cuda:N" in result.out, result.out


def test_what_this_machine_lacks_is_named(monkeypatch):
    """The three ways CUDA can be missing, each said in the error (torch's answers faked)."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    with pytest.raises(QDebugError, match=r"--device 'cuda' cannot be used here: this torch \(.*\) is built "
                                          "without CUDA") as info:
        resolve_device("cuda")
    assert info.value.hint == "use --device cpu"
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(QDebugError, match="finds no CUDA device on this machine"):
        resolve_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(QDebugError, match=r"'cuda:2' cannot be used here: this machine has 2 CUDA device\(s\): "
                                          "cuda:0 to cuda:1"):
        resolve_device("cuda:2")
    assert resolve_device("cpu") == torch.device("cpu")


# -- the config key ----------------------------------------------------------------------------
def test_config_device_name_is_checked_as_the_config_loads(cli, tmp_path, stages):
    (tmp_path / "qdebug.toml").write_text('device = "gpu"\n')
    cli("inspect", stages.float).assert_error("qdebug.toml: device 'gpu' cannot be used here",
                                              'set device = "cpu" in')


@no_cuda
def test_config_cuda_where_there_is_none_names_the_file(cli, tmp_path, stages):
    (tmp_path / "qdebug.toml").write_text('device = "cuda:0"\n')
    line = cli("compare", stages.float, stages.quantized, "--data", stages.data).assert_error(
        "hint: pass --device cpu, or set device = \"cpu\" in")
    assert f"{tmp_path / 'qdebug.toml'}: device 'cuda:0' cannot be used here" in line, line


def test_the_option_comes_before_the_config(cli, tmp_path, stages):
    (tmp_path / "qdebug.toml").write_text('device = "cuda:7"\n')  # no machine here has 8 GPUs
    plain = cli("compare", stages.float, stages.quantized, "--data", stages.data, "--format", "json",
                "--device", "cpu")
    assert plain.code == 0, plain.err
    (tmp_path / "qdebug.toml").write_text('device = "cpu"\n')
    from_config = cli("compare", stages.float, stages.quantized, "--data", stages.data, "--format", "json")
    # the same numbers; the next command repeats the option given, not the config's (it reads it)
    assert from_config.code == 0 and from_config.out == plain.out.replace(" --device cpu", "")


# -- --device cpu is no option at all -----------------------------------------------------------
@pytest.mark.parametrize("args", [["compare", "--batches", "2"], ["step", "--auto"]])
def test_device_cpu_gives_the_results_of_no_option(cli, stages, args):
    command, *options = args
    pair = [stages.float, stages.quantized if command == "compare" else stages.calibrated]
    base = [command, *pair, "--data", stages.data, "--format", "json", *options]
    default, on_cpu = cli(*base), cli(*base, "--device", "cpu")
    assert default.code == 0 and on_cpu.code == 0, (default.err, on_cpu.err)
    assert json.loads(default.out)["rows"] == json.loads(on_cpu.out)["rows"]
    assert default.out == on_cpu.out.replace(" --device cpu", "")  # the next command repeats the option


def test_calibrate_on_cpu_writes_the_same_checkpoint(cli, stages, tmp_path):
    for name, extra in (("a.pt", []), ("b.pt", ["--device", "cpu"])):
        result = cli("calibrate", stages.float, "--data", stages.data, "-o", tmp_path / name, *extra)
        assert result.code == 0, result.err
    a = torch.load(tmp_path / "a.pt", weights_only=True)["state"]
    b = torch.load(tmp_path / "b.pt", weights_only=True)["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the Python API -----------------------------------------------------------------------------
def test_api_device_cpu_gives_the_results_of_no_device(stages):
    import pandas as pd

    data = str(stages.data)
    pd.testing.assert_frame_equal(qdebug.compare(stages.float, stages.quantized, data=data, device="cpu"),
                                  qdebug.compare(stages.float, stages.quantized, data=data))
    pd.testing.assert_frame_equal(qdebug.step(stages.float, stages.calibrated, data=data, device="cpu"),
                                  qdebug.step(stages.float, stages.calibrated, data=data))


def test_api_device_errors(stages):
    with pytest.raises(QDebugError, match="device= 'gpu' cannot be used here") as info:
        qdebug.compare(stages.float, stages.quantized, device="gpu")
    assert info.value.hint == 'pass device="cpu"'
    if not CUDA:
        with pytest.raises(QDebugError, match="device= 'cuda' cannot be used here"):
            qdebug.step(stages.float, stages.calibrated, device=torch.device("cuda"))
        with pytest.raises(QDebugError, match="device= 'cuda:1' cannot be used here"):
            qdebug.suggest(stages.float, stages.calibrated, device="cuda:1")


def test_api_batches_follow_the_callers_models(stages):
    """device=None: the caller's models stay where they are (here the CPU), and the batches go
    where they are."""
    fp, cal = copy.deepcopy(stages.models["float"]), copy.deepcopy(stages.models["calibrated"])
    frame = qdebug.compare(("float", fp), ("calibrated", cal), data=[stages.x])
    assert model_device(fp) == model_device(cal) == torch.device("cpu")
    assert frame["sqnr_db"].notna().any()


# -- the engine on any device, checked on the CPU ---------------------------------------------------
def test_integer_kernels_run_without_cudnn_or_nnpack_and_restore_both():
    seen = []

    def op(x, w, bias):
        seen.append((torch.backends.cudnn.enabled, torch._C._get_nnpack_enabled()))
        return torch.nn.functional.linear(x, w, bias)

    before = (torch.backends.cudnn.enabled, torch._C._get_nnpack_enabled())
    x, w = torch.randint(-128, 128, (4, 9)).double(), torch.randint(-128, 128, (3, 9)).double()
    out = integer.exact_integer_op(op, x, w, terms=9)
    assert torch.equal(out.to(torch.int64), (x @ w.T).to(torch.int64))
    assert seen and all(flags == (False, False) for flags in seen)
    assert (torch.backends.cudnn.enabled, torch._C._get_nnpack_enabled()) == before


def _backend_flags() -> tuple:
    cudnn = torch.backends.cudnn
    return (cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32, torch._C._get_nnpack_enabled())


@pytest.fixture
def frozen_backend_flags():
    """What torch's own test harness does on import (``torch.testing._internal.common_utils``
    calls ``torch.backends.disable_global_flags()``): assigning a cuDNN flag raises from then on,
    only torch's ``flags()`` context managers may change them.  Undone after the test."""
    frozen = torch.backends.flags_frozen.__globals__
    key = "__allow_nonbracketed_mutation_flag"
    saved = frozen[key]
    torch.backends.disable_global_flags()
    assert torch.backends.flags_frozen()
    yield
    frozen[key] = saved


def test_integer_kernels_restore_the_flags_after_an_exception_and_keep_the_callers_others():
    def failing(x, w, bias):
        raise ValueError("inside the kernel")

    x, w = torch.ones(2, 3), torch.ones(4, 3)
    before = _backend_flags()
    with pytest.raises(ValueError, match="inside the kernel"):
        integer.exact_integer_op(failing, x, w, terms=3)
    assert _backend_flags() == before
    # Inside a caller's own torch.backends.cudnn.flags(...) block: the caller's settings other
    # than `enabled` hold inside the kernel too, and are the caller's again after it.
    seen = []

    def op(x, w, bias):
        seen.append(_backend_flags())
        return torch.nn.functional.linear(x, w, bias)

    with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=True, allow_tf32=False):
        inside = _backend_flags()
        integer.exact_integer_op(op, x, w, terms=3)
        assert _backend_flags() == inside
    assert seen == [(False, True, True, False, False)]
    assert _backend_flags() == before


def test_integer_kernels_run_under_torchs_test_harness(frozen_backend_flags):
    """Assigning torch.backends.cudnn.enabled raised 'not allowed to set torch.backends.cudnn
    flags after disable_global_flags' here: every integer kernel, so every converted import."""
    x, w = torch.randint(-128, 128, (4, 9)).double(), torch.randint(-128, 128, (3, 9)).double()
    before = _backend_flags()
    out = integer.exact_integer_op(lambda a, b, bias: torch.nn.functional.linear(a, b, bias), x, w, terms=9)
    assert torch.equal(out.to(torch.int64), (x @ w.T).to(torch.int64))
    assert _backend_flags() == before


def test_a_converted_import_runs_under_torchs_test_harness(frozen_backend_flags):
    """torch.ao's converted model imported and run by the integer stage inside the harness's
    frozen flags: its output is torch's (within the 1 LSB per kernel of docs/interop.md)."""
    tq = pytest.importorskip("torch.ao.quantization")
    from qdebug.interop import from_torch_ao

    torch.manual_seed(0)
    model = torch.nn.Sequential(tq.QuantStub(), torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 2, 3), tq.DeQuantStub()).eval()
    model.qconfig = tq.get_default_qconfig("qnnpack")
    x = torch.randn(2, 3, 10, 10)
    engine, before = torch.backends.quantized.engine, _backend_flags()
    torch.backends.quantized.engine = "qnnpack"
    try:
        prepared = tq.prepare(model)
        prepared(x)
        converted = tq.convert(prepared)
        qm = from_torch_ao(converted, x)
        with torch.no_grad():
            ours, theirs = qm(x), converted(x)
    finally:
        torch.backends.quantized.engine = engine
    lsb = float(converted[3].scale)
    assert float((ours - theirs).abs().max()) <= 2 * lsb + 1e-6
    assert _backend_flags() == before


def test_float32_kernels_are_used_only_where_they_sum_exactly(monkeypatch):
    cpu = torch.device("cpu")
    assert integer._float32_sums_exact(cpu)
    conv = getattr(torch.backends.mkldnn, "conv", None)
    if hasattr(conv, "fp32_precision"):
        # Set and put back by hand: the attribute is a descriptor of torch's backend object,
        # which pytest >= 9.2's monkeypatch deletes on undo instead of restoring.
        before = conv.fp32_precision
        try:
            conv.fp32_precision = "bf16"
            assert not integer._float32_sums_exact(cpu)
        finally:
            conv.fp32_precision = before
        assert conv.fp32_precision == before

    def refuses():
        raise RuntimeError("PyTorch is checking the matmul precision without a specific backend name")

    monkeypatch.setattr(torch, "get_float32_matmul_precision", refuses)
    assert not integer._float32_sums_exact(cpu)  # torch cannot tell: float64, which is exact anyway


def test_the_integer_simulation_is_the_same_on_its_float64_path(stages, monkeypatch):
    """Where float32 kernels may not be exact (bf16/TF32 allowed), every op takes float64: the
    same integers."""
    quantized = stages.models["quantized"]
    with torch.no_grad():
        fast = quantized(stages.x)
        monkeypatch.setattr(integer, "_float32_sums_exact", lambda device: False)
        careful = quantized(stages.x)
    assert torch.equal(fast, careful)


def test_a_mean_of_codes_rounds_its_ties_alike_on_every_device():
    """CPU torch divides a sum by its count, CUDA's mean multiplies by the reciprocal: one ulp
    apart at a tie (1.5 vs 1.4999999999999998).  Both must give the same integer."""
    point = QuantPoint("avg", "activation", QuantSpec(bits=16))
    point.set_qparams(torch.tensor(1.0), torch.tensor(0, dtype=torch.int32))
    sums, counts = [], []
    for count in range(2, 200, 2):
        for total in range(count // 2, 20 * count, count):  # total / count = k + 1/2
            sums.append(float(total))
            counts.append(float(count))
    total, count = torch.tensor(sums, dtype=torch.float64), torch.tensor(counts, dtype=torch.float64)
    divided, multiplied = total / count, total * (1.0 / count)
    assert (divided != multiplied).any()  # the case exists: the test can fail
    naive = [torch.floor(v.abs() + 0.5) for v in (divided, multiplied)]
    assert not torch.equal(*naive)  # and rounding without the tolerance splits it
    for sign in (1.0, -1.0):
        cpu = _rescale_average(sign * divided, point, point, None)
        cuda = _rescale_average(sign * multiplied, point, point, None)
        assert torch.equal(cpu, cuda)
        assert torch.equal(cpu, sign * torch.floor(divided + 0.5).float())  # half away from zero


def test_a_moved_weight_is_quantized_again(stages):
    """``model.to(device)`` keeps each parameter's identity and version: the weight cache's key
    holds the device, so a weight quantized on the old device is never served on the new one."""
    model = copy.deepcopy(stages.models["calibrated"])
    layer = next(m for m in model.modules() if isinstance(m, _QWeighted))
    before = layer.weight_cache_key()
    model.to("meta")
    after = layer.weight_cache_key()
    assert before != after and after[2] == torch.device("meta")


def test_stats_scratch_is_kept_per_device():
    from qdebug.measure.stats import _scratch

    on_cpu = _scratch(0, torch.empty(3))
    on_meta = _scratch(0, torch.empty(3, device="meta"))
    assert on_cpu.device.type == "cpu" and on_meta.device.type == "meta"
    assert _scratch(0, torch.empty(3)).data_ptr() == on_cpu.data_ptr()  # the CPU's is reused, not replaced


def test_ieee_float32_turns_tf32_off_and_restores_torch_settings():
    from qdebug.config.device import _precision_knobs

    knobs = _precision_knobs(torch)
    before = [getattr(owner, attr) for owner, attr, _ in knobs]
    with ieee_float32():
        assert [getattr(owner, attr) for owner, attr, _ in knobs] == [value for _, _, value in knobs]
    assert [getattr(owner, attr) for owner, attr, _ in knobs] == before
    hold(ieee_float32())  # what a CUDA command does, until the command line releases it
    assert [getattr(owner, attr) for owner, attr, _ in knobs] == [value for _, _, value in knobs]
    release_held()
    assert [getattr(owner, attr) for owner, attr, _ in knobs] == before


def test_to_device_and_model_device():
    from qdebug.data.batch import Batch

    batch = Batch((torch.ones(2), {"mask": torch.zeros(2)}), torch.tensor([1, 0]))
    moved = to_device(batch, "cpu")
    assert isinstance(moved, Batch) and moved.inputs[0] is batch.inputs[0]  # already there: the same tensors
    assert to_device(batch, None) is batch
    assert model_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert model_device(torch.nn.ReLU()) is None


# -- CUDA against the CPU (where a GPU exists) ---------------------------------------------------
def _zoo_stages(spec: str, kwargs: dict, size: int) -> dict:
    """A zoo model in three stages (float, calibrated, quantized), on the CPU, and its data."""
    torch.manual_seed(0)
    model = build(ModelSpec(spec, kwargs), from_user=True).eval()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 1, size, size, generator=gen) for _ in range(3)]
    calibrated = prepare(model, QConfig(), mode="fuse_bn", example_inputs=batches[0])
    calibrate(calibrated, batches)
    return {"float": model, "calibrated": calibrated, "quantized": convert(calibrated), "batches": batches}


@pytest.fixture(scope="module", params=[(RESNET, SMALL_RESNET, 16), (MOBILENET, SMALL_MOBILENETV2, 28)],
                ids=["resnet", "mobilenetv2"])
def zoo(request):
    return _zoo_stages(*request.param)


def _capped(value: float) -> float:
    return min(value, SQNR_CAP_DB) if not math.isnan(value) else value


def _same_sqnr(cpu, cuda, column: str) -> None:
    for a, b in zip(cpu[column], cuda[column]):
        if math.isnan(a) or math.isnan(b):
            assert math.isnan(a) and math.isnan(b), (column, a, b)
            continue
        assert abs(_capped(a) - _capped(b)) <= SQNR_TOL_DB, (column, a, b)


@needs_cuda
def test_cuda_integer_simulation_gives_the_same_integers(zoo):
    quantized = zoo["quantized"]
    with torch.no_grad():
        on_cpu = [quantized(x) for x in zoo["batches"]]
        on_gpu = copy.deepcopy(quantized).to("cuda")
        with ieee_float32():
            on_cuda = [on_gpu(x.to("cuda")).cpu() for x in zoo["batches"]]
    for a, b in zip(on_cpu, on_cuda):
        assert torch.equal(a, b), (a - b).abs().max()


@needs_cuda
def test_cuda_float_and_fake_quant_outputs_within_float32_rounding(zoo):
    for stage in ("float", "calibrated"):
        model = zoo[stage]
        gpu = copy.deepcopy(model).to("cuda")
        with torch.no_grad(), ieee_float32():
            for x in zoo["batches"]:
                a, b = model(x), gpu(x.to("cuda")).cpu()
                if stage == "float":
                    assert (a - b).abs().max() <= 1e-4 * a.abs().max(), stage
                else:
                    # A code flipped at a rounding threshold moves a value by one step: the device
                    # difference is ~12 p (< 1%) of the quantization noise's power, bounded at 5%.
                    noise = ((a - zoo["float"](x)) ** 2).sum()
                    assert ((a - b) ** 2).sum() <= 0.05 * noise, stage


@needs_cuda
def test_cuda_compare_equals_cpu(zoo):
    models = [("float", zoo["float"]), ("calibrated", zoo["calibrated"]), ("quantized", zoo["quantized"])]
    cpu = qdebug.compare(*[(n, copy.deepcopy(m)) for n, m in models], data=zoo["batches"], device="cpu")
    theirs = [(n, copy.deepcopy(m)) for n, m in models]
    cuda = qdebug.compare(*theirs, data=zoo["batches"], device="cuda")
    assert all(model_device(m).type == "cpu" for _, m in theirs)  # the caller's models moved back
    assert list(cpu["layer"]) == list(cuda["layer"]) and list(cpu["note"]) == list(cuda["note"])
    for column in ("sqnr_db", "isolated_sqnr_db"):
        _same_sqnr(cpu, cuda, column)
    assert ((cpu["saturation"] - cuda["saturation"]).abs().fillna(0) <= 1e-3).all()
    assert ((cpu["cosine"] - cuda["cosine"]).abs().fillna(0) <= 1e-4).all()


@needs_cuda
def test_cuda_step_equals_cpu(zoo):
    cpu = qdebug.step(copy.deepcopy(zoo["float"]), copy.deepcopy(zoo["calibrated"]), data=zoo["batches"],
                      mode="auto", device="cpu")
    cuda = qdebug.step(copy.deepcopy(zoo["float"]), copy.deepcopy(zoo["calibrated"]), data=zoo["batches"],
                       mode="auto", device="cuda")
    assert list(cpu["selection"]) == list(cuda["selection"])
    _same_sqnr(cpu, cuda, "sqnr_db")


@needs_cuda
def test_cuda_cli_calibrate_equals_cpu_and_writes_cpu_tensors(cli, stages, tmp_path):
    for device in ("cpu", "cuda"):
        result = cli("calibrate", stages.float, "--data", stages.data, "-o", tmp_path / f"{device}.pt",
                     "--device", device, "--format", "json")
        assert result.code == 0, result.err
    cpu = torch.load(tmp_path / "cpu.pt", weights_only=True)
    cuda = torch.load(tmp_path / "cuda.pt", weights_only=True)  # no map_location: the file's own devices
    assert all(t.device.type == "cpu" for t in cuda["state"].values())
    assert all(t.device.type == "cpu" for t in (cuda["sample_inputs"],))
    for key, a in cpu["state"].items():
        b = cuda["state"][key]
        if key.endswith(".zero_point"):
            assert (a.long() - b.long()).abs().max() <= 1, key
        elif key.endswith(".scale") or a.is_floating_point():
            assert torch.allclose(a, b, rtol=1e-4, atol=0), key
        else:
            assert torch.equal(a, b), key


@needs_cuda
def test_cuda_cli_compare_equals_cpu(cli, stages):
    runs = {}
    for device in ("cpu", "cuda"):
        result = cli("compare", stages.float, stages.calibrated, stages.quantized, "--data", stages.data,
                     "--device", device, "--format", "json")
        assert result.code == 0, result.err
        runs[device] = json.loads(result.out)["rows"]
    for a, b in zip(runs["cpu"], runs["cuda"]):
        assert (a["layer"], a["target"]) == (b["layer"], b["target"])
        for column in ("sqnr_db", "isolated_sqnr_db"):
            x, y = a.get(column), b.get(column)
            if x is None or y is None:
                continue
            x, y = float(x), float(y)  # JSON writes inf as "inf"
            if math.isnan(x) and math.isnan(y):
                continue
            assert abs(_capped(x) - _capped(y)) <= SQNR_TOL_DB, (a["layer"], column, x, y)


@needs_cuda
def test_cuda_nan_trace_finds_what_the_cpu_finds(cli, stages, tmp_path):
    """A NaN planted in the second batch: the same finding on both devices, and a repro bundle
    that loads on a CPU-only machine (CPU tensors)."""
    x, y = torch.load(stages.data, weights_only=True)
    x = x.clone()
    x[5, 0, 3, 3] = math.nan
    torch.save((x, y), tmp_path / "nan.pt")
    found = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / device
        result = cli("nan-trace", stages.qat, "--data", tmp_path / "nan.pt", "--batch-size", "4", "--steps", "3",
                     "--device", device, "--format", "json", "--out", out)
        assert result.code == 1, result.err
        first = json.loads(result.out)["first"]
        found[device] = (first["phase"], first["step"], first["batch"], first["layer"], first["what"])
        bundle = torch.load(out / "batch.pt", weights_only=True)
        assert all(t.device.type == "cpu" for item in bundle for t in (item if isinstance(item, tuple) else [item]))
    assert found["cpu"] == found["cuda"]


@needs_cuda
def test_cuda_index_past_the_gpus_is_one_clean_error(cli, stages):
    count = torch.cuda.device_count()
    cli("compare", stages.float, stages.quantized, "--device", f"cuda:{count}").assert_error(
        f"this machine has {count} CUDA device(s)", "hint: use --device cpu")
