"""The ``qdebug`` command line: calibrate / convert / inspect, options, the error contract, help."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
import warnings

import pytest
import torch

import qdebug
from qdebug.engine import QConfig, calibrate, prepare, quant_points
from qdebug.engine.observers import make_observer
from qdebug.engine.spec import QuantSpec


def _run(model, x):
    with torch.no_grad():
        return model(x)


# -- calibrate ------------------------------------------------------------------------------
def test_calibrate_writes_a_calibrated_checkpoint(cli, tmp_path, stages):
    result = cli("calibrate", stages.float, "--data", stages.data, "--batch-size", "4", "-o", "cal.pt")
    assert result.code == 0, result.err
    assert "wrote cal.pt" in result.err and "stage calibrated" in result.err
    model, info = qdebug.load(tmp_path / "cal.pt")
    assert info.stage == "calibrated" and info.qat_mode == "fuse_bn"
    assert info.meta["calibration_batches"] == 3  # 12 samples / 4
    assert info.qconfig == QConfig()
    assert torch.equal(info.sample_inputs, torch.load(stages.data, weights_only=True)[0][:4])
    assert all(p.initialized for p in quant_points(model).values() if p.kind == "activation")
    x = stages.x
    out = _run(model, x)
    assert not torch.allclose(out, _run(stages.models["float"], x))  # fake quant is active
    # the same calibration in Python gives the same model
    ref = prepare(stages.models["float"], QConfig(), example_inputs=info.sample_inputs)
    data, _ = torch.load(stages.data, weights_only=True)
    calibrate(ref, list(data.split(4)))
    assert torch.equal(out, _run(ref, x))


def test_calibrate_json(cli, stages):
    result = cli("calibrate", stages.float, "--data", "random:4x1x16x16", "--batches", "2", "-o", "c.pt", "--json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    assert payload["meta"]["stage"] == "calibrated" and payload["meta"]["batches"] == 2
    assert payload["meta"]["output"] == "c.pt"
    layers = {row["layer"]: row for row in payload["rows"]}
    assert {"input", "conv1", "fc", "layer1.0.add"} <= set(layers)
    assert layers["layer1.0.relu#2"]["act_scale_min"] > 0


def test_calibrate_options_are_honoured(cli, tmp_path, stages):
    result = cli("calibrate", stages.float, "--data", "random:4x1x16x16", "--batches", "2", "-o", "p.pt",
                 "--observer", "percentile", "--per-tensor", "--bits", "16", "--mode", "with_bn")
    assert result.code == 0, result.err
    assert "qat mode with_bn" in result.err
    model, info = qdebug.load(tmp_path / "p.pt")
    assert info.qat_mode == "with_bn"
    assert model.get_submodule("layer1.0.conv1").bn is not None  # BN kept for QAT
    assert info.qconfig.activation.observer == "percentile"
    assert info.qconfig.weight.per_channel is False
    assert info.qconfig.weight.bits == 16 and info.qconfig.activation.bits == 16
    points = quant_points(model)
    act = points["layer1.0.relu#2"]
    assert type(act.observer) is type(make_observer(QuantSpec(observer="percentile")))
    assert act.spec.bits == 16 and act.spec.qmax == 2**15 - 1
    _run(model, stages.x)  # weight points compute their (per-tensor) scale
    assert points["conv1.weight"].scale.numel() == 1 and not points["conv1.weight"].spec.per_channel


def test_calibrate_qconfig_file_with_override(cli, tmp_path, stages):
    (tmp_path / "q.json").write_text(json.dumps({
        "activation": {"observer": "ema"},
        "overrides": {"fc": {"weight": {"bits": 4}}, "layer2.*": {"activation": {"bits": 6}}},
    }))
    result = cli("calibrate", stages.float, "--data", "random:4x1x16x16", "--batches", "1", "-o", "q.pt",
                 "--qconfig", "q.json", "--bits", "7")
    assert result.code == 0, result.err
    model, info = qdebug.load(tmp_path / "q.pt")
    assert info.qconfig.activation.observer == "ema" and info.qconfig.weight.bits == 7
    assert set(info.qconfig.overrides) == {"fc", "layer2.*"}
    points = quant_points(model)
    assert points["fc.weight"].spec.bits == 4
    assert points["conv1.weight"].spec.bits == 7
    assert points["layer1.0.relu#2"].spec.bits == 7 and points["layer2.0.relu#2"].spec.bits == 6


def test_calibrate_qconfig_file_errors(cli, tmp_path, stages):
    (tmp_path / "bad.json").write_text("{not json")
    cli("calibrate", stages.float, "--data", "random:2x1x16x16", "-o", "x.pt", "--qconfig", "bad.json") \
        .assert_error("cannot parse qconfig file")
    (tmp_path / "typo.json").write_text(json.dumps({"weight": {"bitz": 4}}))
    cli("calibrate", stages.float, "--data", "random:2x1x16x16", "-o", "x.pt", "--qconfig", "typo.json") \
        .assert_error("bitz")
    (tmp_path / "nomatch.json").write_text(json.dumps({"overrides": {"nothing.*": {"weight": None}}}))
    cli("calibrate", stages.float, "--data", "random:2x1x16x16", "-o", "x.pt", "--qconfig", "nomatch.json") \
        .assert_error("match no layer", "nothing.*")
    assert not (tmp_path / "x.pt").exists()


def test_calibrate_without_data_uses_sample_inputs(cli, tmp_path, stages):
    result = cli("calibrate", stages.float, "-o", "s.pt")
    assert result.code == 0, result.err
    assert qdebug.load(tmp_path / "s.pt")[1].meta["calibration_batches"] == 1


# -- convert ---------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["calibrated", "qat"])
def test_convert(cli, tmp_path, stages, source):
    result = cli("convert", stages.path(source), "-o", "q.pt")
    assert result.code == 0, result.err
    assert f"stage quantized from {source}" in result.err
    model, info = qdebug.load(tmp_path / "q.pt")
    assert info.stage == "quantized" and info.meta["source_stage"] == source
    assert torch.equal(info.sample_inputs, stages.x)
    if source == "qat":
        assert torch.equal(_run(model, stages.x), _run(stages.models["quantized"], stages.x))
    payload = json.loads(cli("convert", stages.path(source), "-o", "q2.pt", "--json").out)
    assert payload["meta"]["stage"] == "quantized" and payload["rows"]


# -- inspect ---------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["float", "calibrated", "qat", "quantized"])
def test_inspect_every_stage(cli, stages, stage):
    result = cli("inspect", stages.path(stage))
    assert result.code == 0, result.err
    assert f"stage: {stage}" in result.out
    assert "shared module" in result.out and "layer1.0.relu" in result.out
    if stage == "float":
        assert "unfused Conv-BN" in result.out
    else:
        assert "weights: int8 sym per-channel(0) minmax" in result.out
    payload = json.loads(cli("inspect", stages.path(stage), "--json").out)
    assert payload["meta"]["stage"] == stage and payload["meta"]["errors"] == 0
    assert {"input", "conv1", "fc"} <= {row["layer"] for row in payload["rows"]}
    checks = {(c["check"], c["layer"]) for c in payload["checks"]}
    assert ("shared module", "layer1.0.relu") in checks
    assert payload["meta"]["model"] == {"class": stages.spec, "kwargs": stages.kwargs}


def test_inspect_reports_fallback_and_dead_modules(cli, tmp_path, monkeypatch, images):
    name = f"qdebug_test_oddnet_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class OddNet(nn.Module):\n"
        "    def __init__(self, *, width: int = 4):\n"
        "        super().__init__()\n"
        "        self.conv = nn.Conv2d(1, width, 3, padding=1)\n"
        "        self.unused = nn.Linear(3, 3)\n"
        "        self.fc = nn.Linear(width, 3)\n"
        "    def forward(self, x):\n"
        "        y = torch.erf(self.conv(x))\n"
        "        return self.fc(y.mean(dim=(2, 3)))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    x = images(2)
    with pytest.warns(UserWarning, match="no quantized kernel"):
        qm = prepare(module.OddNet(width=4).eval(), QConfig(), example_inputs=x)
    calibrate(qm, [x])
    qdebug.save(qm, tmp_path / "odd.pt", sample_inputs=x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loading does not repeat prepare's warning
        qdebug.load(tmp_path / "odd.pt")
    result = cli("inspect", "odd.pt")
    assert result.code == 0, result.err
    assert "float fallback" in result.out and "erf" in result.out
    assert "dead module" in result.out and "unused" in result.out
    payload = json.loads(cli("inspect", "odd.pt", "--json").out)
    checks = {c["check"]: c for c in payload["checks"]}
    assert checks["float fallback"]["severity"] == "warning" and checks["dead module"]["layer"] == "unused"
    assert payload["meta"]["warnings"] >= 2 and payload["meta"]["errors"] == 0
    sys.modules.pop(name, None)


def test_inspect_exit_code_1_on_nan_weight(cli, tmp_path, stages, make_resnet):
    model = make_resnet(0)
    with torch.no_grad():
        model.fc.weight[0, 0] = float("nan")
    qdebug.save(model, tmp_path / "nan.pt", sample_inputs=stages.x)
    result = cli("inspect", "nan.pt")
    assert result.code == 1
    assert "non-finite weights" in result.out and "fc.weight" in result.out
    payload = json.loads(cli("inspect", "nan.pt", "--json").out)
    assert payload["meta"]["errors"] == 1
    assert [c["layer"] for c in payload["checks"] if c["severity"] == "error"] == ["fc.weight"]
    assert cli("inspect", "nan.pt", "--json").code == 1


def test_inspect_plain_state_dict_with_model(cli, tmp_path, stages):
    import torch as _torch

    _torch.save({"model_state_dict": stages.models["float"].state_dict()}, tmp_path / "sd.pt")
    # --model without kwargs builds the default (ResNet-18 sized) ResNet: a clear mismatch
    cli("inspect", "sd.pt", "--model", stages.spec).assert_error("does not match the model architecture")
    (tmp_path / "qdebug.toml").write_text('model_kwargs = {num_classes = 10, in_channels = 1, stem = "small", '
                                          'layers = [1, 1], widths = [8, 16]}\n')
    result = cli("inspect", "sd.pt", "--model", stages.spec, "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["meta"]["stage"] == "float"


def test_unsafe_load_flag(cli, tmp_path, stages):
    torch.save(stages.models["float"], tmp_path / "whole.pt")
    cli("inspect", "whole.pt").assert_error("--unsafe-load")
    result = cli("inspect", "whole.pt", "--unsafe-load", "--data", "random:2x1x16x16")
    assert result.code == 0, result.err and "shared module" in result.out


# -- the error contract ----------------------------------------------------------------------
def _bad_files(tmp_path, stages):
    blob = stages.calibrated.read_bytes()
    (tmp_path / "truncated.pt").write_bytes(blob[: len(blob) // 2])
    (tmp_path / "random.pt").write_bytes(os.urandom(3000))
    torch.save(["not", "a", "checkpoint"], tmp_path / "strings.pt")


@pytest.mark.parametrize(
    "args, fragments",
    [
        (("inspect", "missing.pt"), ("no such file: missing.pt",)),
        (("inspect", "truncated.pt"), ("truncated.pt is not a readable torch file",)),
        (("inspect", "random.pt"), ("random.pt is not a readable torch file",)),
        (("inspect", "strings.pt"), ("not a qdebug checkpoint or a state_dict (found list)",)),
        (("convert", "{float}", "-o", "x.pt"), ("convert expects a calibrated or qat checkpoint", "is float")),
        (("calibrate", "{qat}", "-o", "x.pt"), ("calibrate expects a float checkpoint", "is qat")),
        (("calibrate", "{quantized}", "-o", "x.pt"), ("is quantized",)),
        (("inspect", "{float}", "--model", "qdebug.zoo.mobilenetv2:MobileNetV2"), ("missing", "unexpected")),
        (("inspect", "{calibrated}", "--model", "qdebug.zoo.multitask:MultiTaskNet"), ("saved plan does not fit",)),
        (("calibrate", "{float}", "--data", "random:2x3x16x16", "-o", "x.pt"),
         ("the model failed while tracing the model (input shape [2, 3, 16, 16])",)),
        (("calibrate", "{float}", "--data", "random:2x1x16x16", "--observer", "foo", "-o", "x.pt"),
         ("unknown observer 'foo'", "minmax, ema, percentile, mse, kl")),
        (("calibrate", "{float}", "--data", "random:2x1x16x16", "--bits", "1", "-o", "x.pt"), ("--bits 1 is outside 2-16",)),
        (("calibrate", "{float}", "--data", "random:2x1x16x16", "--mode", "fused", "-o", "x.pt"),
         ("unknown QAT mode 'fused'",)),
        (("calibrate", "{float}", "--data", "nowhere.pt", "-o", "x.pt"), ("no such file",)),
        (("calibrate", "{float}", "--data", "random:2x1x16x16", "--batches", "0", "-o", "x.pt"), ("--batches",)),
        (("calibrate", "{float}", "--batches", "0", "-o", "x.pt"), ("--batches must be a whole number >= 1",)),
        (("calibrate", "{float}", "-o", "truncated.pt/x.pt"), ("cannot create output directory truncated.pt",)),
        (("convert", "{qat}", "-o", "."), ("output . is a directory",)),
        (("convert", "{qat}", "-o", "truncated.pt/x.pt"), ("cannot create output directory truncated.pt",)),
    ],
)
def test_errors_are_one_line_exit_2(cli, tmp_path, stages, args, fragments):
    _bad_files(tmp_path, stages)
    args = [a.format(**{s: stages.path(s) for s in ("float", "calibrated", "qat", "quantized")}) for a in args]
    cli(*args).assert_error(*fragments)
    assert not (tmp_path / "x.pt").exists()


def test_state_dict_errors_name_keys_and_shapes(cli, tmp_path, stages):
    sd = dict(stages.models["float"].state_dict())
    del sd["layer2.0.bn1.running_var"]
    torch.save(sd, tmp_path / "sd.pt")
    (tmp_path / "qdebug.toml").write_text(
        'model_kwargs = {num_classes = 7, in_channels = 1, stem = "small", layers = [1, 1], widths = [8, 16]}\n')
    cli("inspect", "sd.pt", "--model", stages.spec).assert_error("missing 1 key(s)", "layer2.0.bn1.running_var")
    torch.save(stages.models["float"].state_dict(), tmp_path / "full.pt")
    cli("inspect", "full.pt", "--model", stages.spec).assert_error("'fc.weight'", "[10, 16]", "[7, 16]")


def test_a_failing_write_is_one_error_and_leaves_no_file(cli, tmp_path, stages, monkeypatch):
    """A full disk (or any refusal of the file system) mid-write: one error line, no partial file."""
    import qdebug.checkpoint

    def full_disk(obj, path, *args, **kwargs):
        with open(path, "wb") as fh:
            fh.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(qdebug.checkpoint.torch, "save", full_disk)
    cli("convert", stages.qat, "-o", "q.pt").assert_error("No space left on device", "hint: check the path")
    assert os.listdir(tmp_path) == []


def test_debug_shows_the_traceback(cli, stages):
    result = cli("--debug", "convert", stages.float, "-o", "x.pt")
    assert result.code == 2
    assert "Traceback (most recent call last)" in result.err and "QDebugError" in result.err
    assert "error: convert expects" in result.err


def test_usage_errors_exit_2(cli):
    cli("calibrate").assert_error("Missing option '-o'", "hint: see qdebug calibrate --help")
    cli("calibrate", "f.pt", "-o", "x.pt", "--bits", "many").assert_error("'--bits'")
    cli("frobnicate").assert_error("No such command 'frobnicate'")


# -- help ------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [None, "calibrate", "convert", "inspect"])
def test_help_has_an_example(cli, command):
    result = cli(*([command] if command else []), "--help")
    assert result.code == 0, result.err
    assert "Example:" in result.out
    assert "qdebug " in result.out


# -- real processes --------------------------------------------------------------------------
def _env():
    env = dict(os.environ)
    env.pop("COLUMNS", None)
    return env


def test_python_dash_m_help(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "qdebug", "--help"], capture_output=True, text=True,
                          cwd=tmp_path, env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Example:" in proc.stdout
    for command in ("calibrate", "convert", "inspect"):
        assert command in proc.stdout


def test_console_script_error_contract(tmp_path, stages):
    exe = shutil.which("qdebug") or shutil.which("qdebug", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "qdebug"]
    proc = subprocess.run([*cmd, "convert", str(stages.float), "-o", "x.pt"], capture_output=True, text=True,
                          cwd=tmp_path, env=_env(), timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("error: convert expects a calibrated or qat checkpoint"), proc.stderr
    assert len(lines) == 2 and lines[1].startswith("hint: ")
    assert proc.stdout == "" and not (tmp_path / "x.pt").exists()


def test_every_error_qdebug_raises_carries_a_hint():
    """The error contract is an ``error:`` line and a ``hint:`` line: every QDebugError written in
    the package passes a hint (read from the source, so a new one without a hint fails here)."""
    import ast
    from pathlib import Path

    missing = []
    for path in Path(qdebug.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "QDebugError":
                if len(node.args) + len(node.keywords) < 2:
                    missing.append(f"{path.name}:{node.lineno}")
    assert missing == []


# -- a data file or a torch.save(model) file where a checkpoint belongs (issue 12) ----------------
def test_inspect_a_data_file_says_it_is_data(cli, tmp_path, stages):
    result = cli("inspect", stages.data)
    result.assert_error(f"error: {stages.data} is a data file (12 input(s) and their targets), not a checkpoint",
                        f"hint: pass it as --data {stages.data}")


def test_inspect_a_torch_save_model_file_names_its_class(cli, tmp_path, stages):
    torch.save(stages.models["float"], tmp_path / "whole.pt")
    result = cli("inspect", "whole.pt")
    result.assert_error("whole.pt is a whole pickled model (torch.save(model)) of class qdebug.zoo.resnet.ResNet",
                        "torch.save(model.state_dict(), path)", "--model qdebug.zoo.resnet:ResNet", "--unsafe-load")
    assert "damaged" not in result.err


def test_init_help_has_an_example(cli):
    result = cli("init", "--help")
    assert result.code == 0, result.err
    assert "Example: qdebug init --trust mypkg" in result.out


def test_error_lines_print_names_as_written_never_as_emoji(cli):
    """rich turns :name: into an emoji unless told not to: a file or function name must stay."""
    result = cli("inspect", "missing:cross_mark:model.pt")
    assert result.code == 2 and "missing:cross_mark:model.pt" in result.err and "\u274c" not in result.err
