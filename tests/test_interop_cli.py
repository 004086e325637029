"""``qdebug import``: a torch.ao prepared model's state_dict -> a qdebug checkpoint, and what
the checkpoint then carries (its import report, in ``qdebug.save``/``load`` and ``inspect``).

The oracle is torch itself: the model the user prepared and trained, in eval with its
observers disabled.  The checkpoint ``qdebug import`` writes from that model's state_dict
alone (tensors, plus the float class named with --model) must load as an engine model giving
the same bits on the same input, and ``qdebug compare`` must work on it like on any other.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import qdebug
from qdebug.errors import QDebugError
from qdebug.interop import from_torch_ao
from qdebug.interop.build import import_report
from qdebug.interop.torch_stage import PROPAGATED_ONLY
from qdebug.io.modelspec import ModelSpec, build

from small_models import RESNET, SMALL_RESNET
from user_project import clean_imports, exit_before_torch, forget

tq = pytest.importorskip("torch.ao.quantization")
pytestmark = [pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:.*reduce_range will be deprecated:UserWarning")]

CONFIG = 'model_kwargs = {layers = [1, 1], widths = [8, 16], num_classes = 10, in_channels = 1, stem = "small"}\n'
# Eager fusion as users write it: the stem's Conv-BN-ReLU (its ReLU is called once), and
# Conv-BN elsewhere (a BasicBlock's ReLU is shared by two calls, so torch cannot fuse it).
FUSED = [["conv1", "bn1", "relu"], ["layer1.0.conv1", "layer1.0.bn1"], ["layer1.0.conv2", "layer1.0.bn2"],
         ["layer2.0.conv1", "layer2.0.bn1"], ["layer2.0.downsample.0", "layer2.0.downsample.1"]]
# layer2.0.conv2 + bn2 is left unfused on purpose: the import must find that too.

# A user's eager model: QuantStub, FloatFunctional, a sigmoid (torch's fixed-qparams quantizer),
# and a layer ``forward`` never calls -- its activation quantizer has nothing to quantize.
EAGER_NET = """\
import torch.nn as nn
import torch.ao.quantization as tq


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant = tq.QuantStub()
        self.conv = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.skip = nn.quantized.FloatFunctional()
        self.sig = nn.Sigmoid()
        self.unused = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        x = self.quant(x)
        x = self.relu(self.bn(self.conv(x)))
        x = self.skip.add(x, self.conv2(x))
        x = self.sig(x).mean((2, 3))
        return self.dequant(self.fc(x))
"""


def _float(seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return build(ModelSpec(RESNET, {**SMALL_RESNET, **kwargs}), from_user=True)


def _train(prepared: nn.Module, shape=(4, 1, 16, 16), steps: int = 3) -> nn.Module:
    """A few QAT steps (BN statistics, scales and weights move), then torch's eval oracle."""
    gen = torch.Generator().manual_seed(3)
    opt = torch.optim.SGD(prepared.parameters(), lr=0.02)
    for _ in range(steps):
        loss = prepared(torch.randn(*shape, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    prepared.eval()
    prepared.apply(tq.disable_observer)  # an enabled observer moves its scale on every forward, even in eval
    return prepared


def _calibrate(prepared: nn.Module, shape=(4, 1, 16, 16)) -> nn.Module:
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for _ in range(2):
            prepared(torch.randn(*shape, generator=gen))
    return prepared.eval()


def _eager(qat: bool, backend: str, groups: list[list[str]] = FUSED) -> nn.Module:
    model = (tq.fuse_modules_qat if qat else tq.fuse_modules)(_float().train(qat), groups)
    model.qconfig = (tq.get_default_qat_qconfig if qat else tq.get_default_qconfig)(backend)
    prepared = (tq.prepare_qat if qat else tq.prepare)(model)
    return _train(prepared) if qat else _calibrate(prepared)


def _fx_qat(backend: str, x: torch.Tensor) -> nn.Module:
    from torch.ao.quantization import get_default_qat_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    return _train(prepare_qat_fx(_float().train(), get_default_qat_qconfig_mapping(backend), (x,)))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The user's side: prepared torch models, their state_dicts, the float checkpoint, data."""
    d = tmp_path_factory.mktemp("import")
    x = torch.randn(4, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(5)
    torch.save((torch.randn(8, 1, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)), d / "data.pt")
    qdebug.save(_float().eval(), d / "float.pt", sample_inputs=x)
    torch_models = {
        "eager-qat-x86": _eager(True, "x86"),  # per-channel weights
        "eager-qat-qnnpack": _eager(True, "qnnpack"),  # per-tensor weights, full-range activations
        "eager-ptq-qnnpack": _eager(False, "qnnpack"),
        "fx-qat-x86": _fx_qat("x86", x),
    }
    for name, model in torch_models.items():
        torch.save(model.state_dict(), d / f"{name}.pt")
    return {"dir": d, "x": x, "torch": torch_models}


def _project(tmp_path: Path) -> None:
    """The user's project config: the float model's kwargs (``--model`` names the class)."""
    (tmp_path / "qdebug.toml").write_text(CONFIG)


def _import(cli, files, name: str, *extra, output: str = "qat.pt"):
    d = files["dir"]
    backend = name.rsplit("-", 1)[1]
    return cli("import", d / f"{name}.pt", "--from", "torch-ao", "--model", RESNET, "--data", d / "data.pt",
               "--backend", backend, "-o", output, "--format", "json", *extra)


def _leftovers(folder: Path, name: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(name) or p.name.startswith(f".{name}"))


# -- the round trips -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["eager-qat-x86", "eager-qat-qnnpack"])
def test_eager_qat_state_dict_imports_bit_identical(cli, tmp_path, files, name):
    _project(tmp_path)
    result = _import(cli, files, name)
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    meta = payload["meta"]
    assert (meta["flow"], meta["qat"], meta["stage"]) == ("eager", True, "qat")
    # Fusion read from the keys and the quantizers' ranges: what the user fused, no more.
    assert meta["fusions"] == FUSED
    quantizers = sum(isinstance(m, tq.FakeQuantizeBase) for m in files["torch"][name].modules())
    assert meta["quantizers"] == quantizers and set(meta["statuses"]) <= {"exact", "moved"}, meta
    assert "wrote qat.pt (stage qat" in result.err
    # the import checked itself against torch's model on the first batch: bit-identical
    check = meta["check"]
    assert (check["compared_with"], check["max_abs_diff"], check["within_tolerance"]) == ("fake-quant", 0.0, True)

    net, info = qdebug.load(tmp_path / "qat.pt")
    assert info.stage == "qat" and info.model == ModelSpec(RESNET, SMALL_RESNET)
    assert info.meta["import_check"] == check
    assert info.meta["import_flow"] == "eager" and info.meta["import"] == payload["rows"]
    source = files["torch"][name]
    for seed in (1, 2):
        x = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            assert torch.equal(net(x), source(x)), seed
    per_channel = name.endswith("x86")
    weights = [r for r in payload["rows"] if r["kind"] == "weight"]
    assert all(("per-channel" in r["spec"]) == per_channel for r in weights), weights

    compared = cli("compare", files["dir"] / "float.pt", "qat.pt", "--data", files["dir"] / "data.pt",
                   "--format", "json")
    assert compared.code == 0, compared.err
    layers = {row["layer"] for row in json.loads(compared.out)["rows"]}
    assert {"conv1", "layer1.0.conv1", "layer2.0.conv2", "fc"} <= layers  # the float model's own names


def test_eager_ptq_state_dict_imports_as_calibrated(cli, tmp_path, files):
    _project(tmp_path)
    result = _import(cli, files, "eager-ptq-qnnpack", "--format", "table")
    assert result.code == 0, result.err
    # torch's HistogramObserver has no engine twin: imported frozen, and said so, once per reason.
    frozen = re.findall(r"^frozen: (\d+) quantizer\(s\), e\.g\. \S+: HistogramObserver has no engine observer",
                        result.out, re.MULTILINE)
    source = files["torch"]["eager-ptq-qnnpack"]
    assert sum(map(int, frozen)) == sum(type(m).__name__ == "HistogramObserver" for m in source.modules()) > 0
    assert "5 BatchNorm(s) torch folded into their convs" in result.out
    # eager PTQ converts to int8 kernels only: the check compares each imported scale with torch's observer's
    assert "checked on the first batch against torch's observers' qparams:\n  equal, within the tolerance" \
        in result.out
    net, info = qdebug.load(tmp_path / "qat.pt")
    assert info.stage == "calibrated" and info.meta["import_flow"] == "eager"
    # PTQ: torch's prepared model observes in float; the oracle is the import of that model itself.
    x = files["x"]
    direct = from_torch_ao(copy.deepcopy(source), x)
    with torch.no_grad():
        assert torch.equal(net(x), direct(x))
        assert not torch.equal(net(x), source(x))  # the import quantizes where torch only observed
    assert import_report(net) == import_report(direct)
    folded = [r["source"] for r in import_report(net) if r["kind"] == "bn"]
    assert sorted(folded) == sorted(group[1] for group in FUSED)
    assert all(type(net.get_submodule(bn)) is nn.Identity for bn in folded)
    # compare on the saved files: each pair torch folded is measured in its BN's row (docs/compare.md)
    compared = cli("compare", files["dir"] / "float.pt", "qat.pt", "--data", files["dir"] / "data.pt",
                   "--format", "json")
    assert compared.code == 0, compared.err
    rows = {row["layer"]: row for row in json.loads(compared.out)["rows"]}
    for conv, bn in (group[:2] for group in FUSED):
        assert rows[conv]["note"].endswith(f"compared at {bn}"), rows[conv]
        assert isinstance(rows[bn]["sqnr_db"], float) and isinstance(rows[bn]["isolated_sqnr_db"], float), rows[bn]


def test_fx_qat_state_dict_imports_bit_identical(cli, tmp_path, files):
    _project(tmp_path)
    result = _import(cli, files, "fx-qat-x86")
    assert result.code == 0, result.err
    meta = json.loads(result.out)["meta"]
    assert (meta["flow"], meta["qat"], meta["fusions"]) == ("fx", True, [])
    net, info = qdebug.load(tmp_path / "qat.pt")
    assert info.stage == "qat" and info.meta["import_flow"] == "fx"
    x = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(net(x), files["torch"]["fx-qat-x86"](x))
    compared = cli("compare", files["dir"] / "float.pt", "qat.pt", "--data", files["dir"] / "data.pt")
    assert compared.code == 0, compared.err


def test_one_signed_weight_channels_are_no_false_alarm(cli, tmp_path, files):
    """torch's fused per-channel weight fake quant gives a channel whose values are all positive
    (or all negative) a zero point of -128 (127) and half the scale: not what its observer's
    ``calculate_qparams`` gives.  A healthy x86 QAT model with such channels (MobileNetV2 grows
    them in a few steps) imports, bit-identical; the backend check still holds for the rest."""
    source = copy.deepcopy(files["torch"]["eager-qat-x86"])
    conv = source.layer1[0].conv1
    with torch.no_grad():
        conv.weight[0] = conv.weight[0].abs() + 0.05
        conv.weight[1] = -(conv.weight[1].abs() + 0.05)
    conv.weight_fake_quant.activation_post_process.reset_min_max_vals()  # the new weight's range at once
    source.apply(tq.enable_observer)
    source.train()
    source(torch.randn(4, 1, 16, 16, generator=torch.Generator().manual_seed(8)))
    source.eval()
    source.apply(tq.disable_observer)
    assert conv.weight_fake_quant.zero_point[:2].tolist() == [-128, 127]  # torch's own choice
    torch.save(source.state_dict(), files["dir"] / "onesided.pt")
    _project(tmp_path)
    result = cli("import", files["dir"] / "onesided.pt", "--from", "torch-ao", "--model", RESNET, "--data",
                 files["dir"] / "data.pt", "-o", "qat.pt", "--format", "json")
    assert result.code == 0, result.err
    net, _ = qdebug.load(tmp_path / "qat.pt")
    x = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert torch.equal(net(x), source(x))


@pytest.mark.parametrize("stem", [["conv1", "bn1", "relu"], ["conv1", "bn1"]])
def test_a_qat_relu_fusion_is_read_from_the_quantizer_range(files, stem):
    """ConvBnReLU2d and ConvBn2d + ReLU save the same keys; only a quantizer before the ReLU
    sees negative values.  The rebuilt model must be the user's, bit for bit."""
    from qdebug.interop.state_dict import rebuild

    source = _eager(True, "x86", [stem, *FUSED[1:]])
    rebuilt = rebuild(source.state_dict(), _float(seed=9), files["x"], "x86")
    assert rebuilt.fusions == [stem, *FUSED[1:]]
    with torch.no_grad():
        assert torch.equal(rebuilt.prepared(files["x"]), source(files["x"]))


def test_table_fits_80_columns_and_names_modules(cli, tmp_path, files, monkeypatch):
    from qdebug.cli.common import console

    _project(tmp_path)
    monkeypatch.setattr(console, "_width", 80)
    result = _import(cli, files, "eager-qat-x86", "--format", "table")
    assert result.code == 0, result.err
    table = result.out.split("\n\n")[0].splitlines()
    assert max(len(line.rstrip()) for line in table) <= 80
    assert any(line.split()[:4] == ["layer1.0.conv1", "activation", "layer1.0.relu", "moved"] for line in table)


# -- an unmapped quantizer: --strict, inspect ------------------------------------------------
@pytest.fixture
def eager_net(tmp_path):
    """The user's package ``impnet`` (EAGER_NET) in the working directory, and a QAT state_dict of it."""
    pkg = tmp_path / "impnet"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "net.py").write_text(EAGER_NET)
    with clean_imports(tmp_path):
        spec = importlib.util.spec_from_file_location("impnet_source", pkg / "net.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        torch.manual_seed(0)
        model = tq.fuse_modules_qat(module.Net().train(), [["conv", "bn", "relu"]])
        model.qconfig = tq.get_default_qat_qconfig("x86")
        prepared = _train(tq.prepare_qat(model), shape=(4, 1, 8, 8))
        torch.save(prepared.state_dict(), tmp_path / "net_state.pt")
        torch.save(torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(2)), tmp_path / "x.pt")
        yield prepared


def test_strict_fails_on_an_unmapped_quantizer_and_inspect_warns(cli, tmp_path, eager_net):
    args = ["import", "net_state.pt", "--from", "torch-ao", "--model", "impnet.net:Net", "--data", "x.pt"]
    plain = cli(*args, "-o", "net.pt", "--format", "table")
    assert plain.code == 0, plain.err
    assert "unmapped: unused.activation_post_process (activation)" in plain.out
    assert "frozen: 1 quantizer(s), e.g. sig.activation_post_process: FixedQParamsFakeQuantize" in plain.out
    strict = cli(*args, "-o", "strict.pt", "--strict", "--format", "json")
    assert strict.code == 1, strict.err
    assert "--strict: 1 quantizer(s) of net_state.pt are unmapped" in strict.err
    assert (tmp_path / "strict.pt").is_file()  # written all the same: the exit code is the check

    net, _ = qdebug.load(tmp_path / "net.pt")
    x = torch.load(tmp_path / "x.pt")
    with torch.no_grad():
        assert torch.equal(net(x), eager_net(x))

    inspected = cli("inspect", "net.pt", "--format", "json", "--out", "report")
    assert inspected.code == 0, inspected.err
    payload = json.loads(inspected.out)
    assert payload["import"] == json.loads(strict.out)["rows"]
    warned = [c for c in payload["checks"] if c["check"] == "unmapped quantizer"]
    assert [(c["severity"], c["layer"]) for c in warned] == [("warning", "unused.activation_post_process")]
    assert "import" not in payload["meta"]["checkpoint_meta"]  # the rows are the "import" table, once
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == [
        "inspect.csv", "inspect.json", "inspect_checks.csv", "inspect_import.csv"]
    table = cli("inspect", "net.pt")
    assert table.code == 0 and "import" in table.out and "imported from torch.ao eager: 10 quantizer(s)" in table.out


def test_inspect_of_a_native_checkpoint_has_an_empty_import(cli, stages):
    payload = json.loads(cli("inspect", stages.qat, "--format", "json").out)
    assert payload["import"] == [] and not payload["meta"]["imported"]


# -- refusals: one error line, exit 2, nothing written ----------------------------------------
def _bad_sources(d: Path, files) -> dict[str, tuple[list, tuple[str, ...]]]:
    (d / "corrupt.pt").write_bytes(b"PK\x03\x04 this is not a torch file")
    torch.save(_float(), d / "whole.pt")
    other = _float(widths=[4, 8]).train()
    other = tq.fuse_modules_qat(other, FUSED)
    other.qconfig = tq.get_default_qat_qconfig("x86")
    torch.save(tq.prepare_qat(other).state_dict(), d / "other_widths.pt")
    torch.save(_float().state_dict(), d / "float_state.pt")
    src = files["dir"]
    common = ["--data", src / "data.pt", "-o", "qat.pt"]
    model = ["--model", RESNET]
    return {
        "missing file": (["nothere.pt", "--from", "torch-ao", *model, *common], ("no such file: nothere.pt",)),
        "corrupt file": (["corrupt.pt", "--from", "torch-ao", *model, *common], ("is not a readable torch file",)),
        "pickled whole model": (["whole.pt", "--from", "torch-ao", *model, *common],
                                ("whole pickled model", "reads tensors only", "prepared.state_dict()")),
        "another architecture": (["other_widths.pt", "--from", "torch-ao", *model, *common],
                                 ("does not load into the rebuilt model: size mismatch for", "--model")),
        "a float state_dict": (["float_state.pt", "--from", "torch-ao", *model, *common],
                               ("holds no torch.ao quantizer",)),
        "wrong backend": ([src / "eager-qat-x86.pt", "--from", "torch-ao", *model, "--backend", "qnnpack", *common],
                          ("does not load into the rebuilt model", "--backend")),
        "another backend's ranges": ([src / "eager-qat-qnnpack.pt", "--from", "torch-ao", *model, "--backend", "x86",
                                      *common], ("but torch's x86 qconfig gives", "prepared with another qconfig")),
        "wrong --from": ([src / "eager-qat-x86.pt", "--from", "onnx", *model, *common],
                         ("--from 'onnx' is not one of torch-ao",)),
        "a --model that does not import": ([src / "eager-qat-x86.pt", "--from", "torch-ao", "--model",
                                            "nosuchpkg.net:Net", *common], ("nosuchpkg",)),
        "no --model": ([src / "eager-qat-x86.pt", "--from", "torch-ao", *common], ("needs the float model's class",)),
    }


def test_bad_input_is_one_error_and_writes_nothing(cli, tmp_path, files):
    _project(tmp_path)
    for case, (args, fragments) in _bad_sources(tmp_path, files).items():
        result = cli("import", *args)
        try:
            result.assert_error(*fragments)
        except AssertionError as exc:
            raise AssertionError(f"{case}: {exc}") from None
        assert _leftovers(tmp_path, "qat.pt") == [], case


def test_usage_errors_answer_before_torch_loads(tmp_path):
    for args, fragment in ((["import", "a.pt", "--from", "onnx", "--model", "m:N", "--data", "d.pt", "-o", "q.pt"],
                            "--from 'onnx' is not one of torch-ao"),
                           (["import", "a.pt", "--from", "torch-ao", "--model", "m:N", "--data", "d.pt",
                             "--backend", "arm", "-o", "q.pt"], "--backend 'arm' is not one of"),
                           (["import", "a.pt", "--from", "torch-ao", "--model", "m:N", "-o", "q.pt"],
                            "needs example inputs")):
        out, err = exit_before_torch(args, tmp_path)
        assert out.split() == ["2", "False"], (args, out, err)
        assert fragment in err and "Traceback" not in err


def test_help_has_an_example(cli):
    result = cli("import", "--help")
    assert result.code == 0 and "Example: qdebug import" in result.out and "--from" in result.out
    assert "Example: qdebug import converted_state.pt" in result.out
    compared = cli("compare", "--help")
    assert compared.code == 0 and "--torch-kernels converted_state.pt" in compared.out


# -- the checkpoint keeps the report -----------------------------------------------------------
def test_save_load_keeps_the_import_report(tmp_path, files):
    source = files["torch"]["eager-qat-x86"]
    qm = from_torch_ao(source, files["x"])
    path = qdebug.save(qm, tmp_path / "imported.pt", model_spec=ModelSpec(RESNET, SMALL_RESNET), stage="qat")
    net, info = qdebug.load(path)
    assert import_report(net) == import_report(qm)
    assert [row["source"] for row in info.meta["import"]] == [row["source"] for row in import_report(qm)]
    again, _ = qdebug.load(qdebug.save(net, tmp_path / "again.pt"))  # a loaded model saves it again
    assert import_report(again) == import_report(net)
    converted = qdebug.engine.convert(net)  # the quantized stage keeps it too
    quantized, qinfo = qdebug.load(qdebug.save(converted, tmp_path / "quantized.pt"))
    assert qinfo.stage == "quantized" and import_report(quantized) == import_report(net)
    native = qdebug.save(qdebug.load(files["dir"] / "float.pt")[0], tmp_path / "native.pt")
    assert "import" not in torch.load(native, weights_only=True)["meta"]


@pytest.mark.parametrize("value, fragment", [
    ("rows", "meta 'import' is a str, not a list of rows"),
    ([["not", "a", "row"]], "meta 'import' row 0 is a list, not a table"),
    ([{"source": 3}], "meta 'import' row 0 has a int source; it is text"),
    ([{"source": "a", "kind": "activation", "point": "", "status": "exact", "spec": "", "note": "",
       "scale_min": "tiny", "scale_max": None}], "has a str scale_min; scales are numbers or null"),
])
def test_a_malformed_import_report_is_one_error(tmp_path, files, value, fragment):
    qm = from_torch_ao(files["torch"]["eager-qat-x86"], files["x"])
    path = qdebug.save(qm, tmp_path / "imported.pt", model_spec=ModelSpec(RESNET, SMALL_RESNET), stage="qat")
    ckpt = torch.load(path, weights_only=True)
    ckpt["meta"]["import"] = value
    torch.save(ckpt, path)
    with pytest.raises(QDebugError) as caught:
        qdebug.load(path)
    assert fragment in caught.value.message and caught.value.hint


def test_a_folded_bn_the_model_lacks_is_refused(tmp_path, files):
    qm = from_torch_ao(copy.deepcopy(files["torch"]["eager-ptq-qnnpack"]), files["x"])
    path = qdebug.save(qm, tmp_path / "ptq.pt", model_spec=ModelSpec(RESNET, SMALL_RESNET))
    ckpt = torch.load(path, weights_only=True)
    assert sorted(ckpt["folded_bn"]) == sorted(group[1] for group in FUSED)
    ckpt["folded_bn"] = ["fc"]
    torch.save(ckpt, path)
    with pytest.raises(QDebugError, match="'folded_bn' names 'fc', which is no BatchNorm"):
        qdebug.load(path)


def test_the_backend_check_accepts_what_torchs_fused_per_channel_kernel_computes():
    """Per channel, torch's fused weight fake quant gives a one-signed channel affine qparams
    (zero point -128/127, half the scale), an all-zero channel scale 0.1 and floors tiny scales
    at 2**-14; its observer's calculate_qparams gives none of these.  All are accepted, channel
    by channel; a per-tensor file against a per-channel qconfig, or a 2x scale, is not."""
    from qdebug.interop.state_dict import _agree

    fq = tq.get_default_qat_qconfig("x86").weight()
    w = torch.randn(6, 3, 3, 3, generator=torch.Generator().manual_seed(3))
    w[1], w[2], w[3], w[4] = w[1].abs() + 0.1, -(w[2].abs() + 0.1), 0.0, w[4] * 1e-7
    fq(w)
    observer = fq.activation_post_process
    scale, zero_point = observer.calculate_qparams()
    assert fq.zero_point[1:3].tolist() == [-128, 127] and float(fq.scale[3]) == pytest.approx(0.1)
    assert _agree(scale, zero_point, fq.scale, fq.zero_point, observer)
    assert not _agree(scale, zero_point, fq.scale * 2, fq.zero_point, observer)
    assert not _agree(scale, zero_point, fq.scale[:1], fq.zero_point[:1], observer)


def test_the_summary_under_the_table_fits_80_columns(cli, tmp_path, files, monkeypatch):
    """Every line of the table view fits 80 columns when piped: a long fusion list is cut to a
    few groups, one per line (JSON has them all)."""
    from qdebug.cli.common import console

    _project(tmp_path)
    monkeypatch.setattr(console, "_width", 80)
    result = _import(cli, files, "eager-qat-x86", "--format", "table")
    assert result.code == 0, result.err
    assert max(len(line.rstrip()) for line in result.out.splitlines()) <= 80
    assert f"fused as torch did: {len(FUSED)} group(s), the first 3 (--format json: all)" in result.out
    assert "  conv1 + bn1 + relu" in result.out


# -- a factory --model (torchvision's builders are functions) --------------------------------
FACTORY_NET = """\
import torch.nn as nn
import torch.ao.quantization as tq


class Net(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.quant = tq.QuantStub()
        self.conv = nn.Conv2d(1, width, 3, padding=1)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(width, 3)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        return self.dequant(self.fc(self.relu(self.conv(self.quant(x))).mean((2, 3))))


def make(width=4, quantize=False):
    with open(__file__ + ".calls", "a") as fh:
        fh.write(f"{width}\\n")
    return Net(width)
"""


@pytest.fixture
def factory_project(tmp_path):
    """The user's package ``facnet`` whose float model comes from a factory, ``make(width=6)``
    (as torchvision's ``resnet18(weights=None, quantize=False)``); its float state_dict and a
    torch.ao eager QAT state_dict of it."""
    pkg = tmp_path / "facnet"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "net.py").write_text(FACTORY_NET)
    with clean_imports(tmp_path):
        spec = importlib.util.spec_from_file_location("facnet_source", pkg / "net.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        torch.manual_seed(0)
        model = module.make(width=6)
        torch.save(model.state_dict(), tmp_path / "float_state.pt")
        model.train().qconfig = tq.get_default_qat_qconfig("x86")
        prepared = _train(tq.prepare_qat(model), shape=(4, 1, 8, 8))
        torch.save(prepared.state_dict(), tmp_path / "qat_state.pt")
        torch.save(torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(2)), tmp_path / "x.pt")
        yield tmp_path


def _factory_calls(project: Path) -> list[str]:
    """The widths ``facnet.net.make`` was called with, in order."""
    calls = project / "facnet" / "net.py.calls"
    return calls.read_text().split() if calls.exists() else []


def test_a_checkpoint_imported_with_a_factory_model_works_in_later_commands(cli, factory_project):
    """qdebug import --model facnet.net:make writes a checkpoint naming that function.  A file
    never gets a function called (docs/checkpoints.md), so a later command without the user's
    say-so refuses it -- with a hint saying what to pass -- and with it (--model and its kwargs,
    or the config's model = naming it) every command accepts the checkpoint."""
    kwargs = '{"width": 6}'
    imported = cli("import", "qat_state.pt", "--from", "torch-ao", "--model", "facnet.net:make",
                   "--model-kwargs", kwargs, "--data", "x.pt", "-o", "qat.pt")
    assert imported.code == 0, imported.err
    assert ("qat.pt names the factory facnet.net:make, which qdebug calls only when you name it: pass --model "
            f"facnet.net:make --model-kwargs '{kwargs}' to later commands, or set model = \"facnet.net:make\" "
            "and model_kwargs = {width = 6} in qdebug.toml") in " ".join(imported.err.split())
    called = len(_factory_calls(factory_project))

    forget("facnet")  # a later command, in a fresh process: nothing of the user's imported yet
    refused = cli("inspect", "qat.pt")
    refused.assert_error("the checkpoint names facnet.net:make, a function, not a model class; qdebug calls a "
                         "factory only when you name it yourself",
                         "pass --model package.module:function with its --model-kwargs, or set model = and "
                         "model_kwargs = in qdebug.toml")
    (factory_project / "qdebug.toml").write_text('trust = ["facnet"]\n')  # trusting the package is no consent
    cli("inspect", "qat.pt").assert_error("refusing to call 'facnet.net:make' named by a file",
                                          "pass --model package.module:function")
    (factory_project / "qdebug.toml").write_text('model = "facnet.net:Net"\n')  # another target: no consent
    cli("inspect", "qat.pt").assert_error("refusing to call 'facnet.net:make' named by a file")
    assert len(_factory_calls(factory_project)) == called

    flagged = cli("compare", "float_state.pt", "qat.pt", "--model", "facnet.net:make", "--model-kwargs", kwargs,
                  "--data", "x.pt", "--format", "json")
    assert flagged.code == 0, flagged.err
    (factory_project / "qdebug.toml").write_text('model = "facnet.net:make"\nmodel_kwargs = {width = 6}\n')
    configured = cli("compare", "float_state.pt", "qat.pt", "--data", "x.pt", "--format", "json")
    assert configured.code == 0, configured.err
    assert json.loads(configured.out)["rows"] == json.loads(flagged.out)["rows"]
    for args in (["inspect", "qat.pt"], ["step", "qat.pt", "--data", "x.pt"]):
        result = cli(*args, "--format", "json")
        assert result.code == 0, (args, result.err)
    assert _factory_calls(factory_project)[called:] and set(_factory_calls(factory_project)[called:]) == {"6"}
    # The config's own model in the import: later commands need nothing more, so no note.
    again = cli("import", "qat_state.pt", "--from", "torch-ao", "--data", "x.pt", "-o", "qat2.pt")
    assert again.code == 0 and "names the factory" not in again.err, again.err


def test_the_factory_note_omits_the_config_when_toml_cannot_hold_the_kwargs(cli, factory_project):
    imported = cli("import", "qat_state.pt", "--from", "torch-ao", "--model", "facnet.net:make",
                   "--model-kwargs", '{"width": 6, "quantize": null}', "--data", "x.pt", "-o", "qat.pt")
    assert imported.code == 0, imported.err
    said = " ".join(imported.err.split())
    assert "--model-kwargs '{\"width\": 6, \"quantize\": null}' to later commands" in said
    assert "qdebug.toml" not in said  # TOML has no null
    flagged = cli("inspect", "qat.pt", "--model", "facnet.net:make", "--model-kwargs", '{"width": 6, "quantize": null}')
    assert flagged.code == 0, flagged.err


# -- a converted model's state_dict ------------------------------------------------------------
# A user's eager model torch.ao converts: a Conv-BN-ReLU (fused: nnq.ConvReLU2d), a Conv-BN whose
# ReLU is left unfused, a conv without bias with its own ReLU unfused, a residual add_relu, a linear.
CONVERTED_NET = """\
import torch.nn as nn
import torch.ao.quantization as tq


class Net(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.quant = tq.QuantStub()
        self.conv = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(width, width, 3, padding=1, bias=False)  # saved as conv3.bias = None
        self.relu3 = nn.ReLU()
        self.skip = nn.quantized.FloatFunctional()
        self.fc = nn.Linear(width, 3)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        x = self.quant(x)
        x = self.relu(self.bn(self.conv(x)))
        y = self.relu3(self.conv3(self.relu2(self.bn2(self.conv2(x)))))
        x = self.skip.add_relu(x, y)
        return self.dequant(self.fc(x.mean((2, 3))))
"""
CONVERTED_FUSED = [["conv", "bn", "relu"], ["conv2", "bn2"]]


@pytest.fixture
def converted_net(tmp_path):
    """The user's package ``convnet`` (CONVERTED_NET), torch's converted model of it (x86 PTQ),
    and the files: its state_dict, the whole pickled model, the float checkpoint, data."""
    pkg = tmp_path / "convnet"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "net.py").write_text(CONVERTED_NET)
    with clean_imports(tmp_path):
        sys.path.insert(0, str(tmp_path))  # importable by name: torch.save(converted) pickles its class
        module = importlib.import_module("convnet.net")
        torch.manual_seed(0)
        float_model = module.Net().eval()
        gen = torch.Generator().manual_seed(6)
        for bn in (float_model.bn, float_model.bn2):  # randomized statistics: folding them matters
            bn.running_mean.uniform_(-0.5, 0.5, generator=gen)
            bn.running_var.uniform_(0.5, 2.0, generator=gen)
        model = tq.fuse_modules(copy.deepcopy(float_model), CONVERTED_FUSED)
        model.qconfig = tq.get_default_qconfig("x86")
        prepared = tq.prepare(model)
        with torch.no_grad():
            for _ in range(3):
                prepared(torch.randn(4, 1, 8, 8, generator=gen))
        converted = tq.convert(prepared)
        torch.save(converted.state_dict(), tmp_path / "converted_state.pt")
        torch.save(converted, tmp_path / "converted_whole.pt")
        torch.save(torch.randn(6, 1, 8, 8, generator=gen), tmp_path / "x.pt")
        qdebug.save(float_model, tmp_path / "float.pt", model_spec=ModelSpec("convnet.net:Net", {}))
        yield float_model, converted


def test_a_converted_state_dict_imports_as_torchs_integer_model(cli, tmp_path, converted_net):
    float_model, converted = converted_net
    args = ["import", "converted_state.pt", "--from", "torch-ao", "--model", "convnet.net:Net", "--data", "x.pt"]
    result = cli(*args, "-o", "q.pt", "--format", "json")
    assert result.code == 0, result.err
    assert "wrote q.pt (stage quantized, eager converted from converted_state.pt)" in result.err
    meta = json.loads(result.out)["meta"]
    assert (meta["flow"], meta["converted"], meta["stage"]) == ("eager", True, "quantized")
    # conv3's ReLU is not fused: its output grid covers negative values (zero point > 0)
    assert meta["fusions"] == CONVERTED_FUSED
    assert int(converted.conv3.zero_point) > 0 and int(converted.conv.zero_point) == 0
    assert meta["check"]["compared_with"] == "converted" and meta["check"]["within_tolerance"]
    net, info = qdebug.load(tmp_path / "q.pt")
    assert info.stage == "quantized"
    # qdebug's integer simulation of torch's kernels: within 4 output steps, as
    # tests/test_interop_converted.py bounds it end to end (here: measured 0)
    x = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        steps = (net(x) - converted(x)).abs() / float(converted.fc.scale)
    assert float(steps.max()) <= 4 + 1e-3, float(steps.max())
    table = cli(*args, "-o", "q2.pt", "--format", "table")
    assert table.code == 0 and "torch.ao eager converted (x86)" in table.out
    assert "taken as fused where that layer's" in table.out


def test_compare_runs_torchs_own_kernels_next_to_the_import(cli, tmp_path, converted_net):
    float_model, converted = converted_net
    assert cli("import", "converted_state.pt", "--from", "torch-ao", "--model", "convnet.net:Net", "--data",
               "x.pt", "-o", "q.pt").code == 0
    result = cli("compare", "float.pt", "q.pt", "--torch-kernels", "converted_state.pt", "--data", "x.pt",
                 "--model", "convnet.net:Net", "--format", "json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    rows = {(r["layer"], r["target"]): r for r in payload["rows"]}
    assert payload["meta"]["propagated_only"] == {"torch": PROPAGATED_ONLY}
    assert payload["meta"]["checkpoints"]["torch"] == "converted_state.pt"
    x = torch.load(tmp_path / "x.pt")
    hooked = {}
    handles = [converted.get_submodule(name).register_forward_hook(
        lambda m, a, out, name=name: hooked.__setitem__(name, out.dequantize())) for name in ("relu2", "relu3")]
    with torch.no_grad():
        ref, got = float_model(x), converted(x)
        float_out = {}
        for name in ("relu2", "relu3"):
            handles.append(float_model.get_submodule(name).register_forward_hook(
                lambda m, a, out, name=name: float_out.__setitem__(name, out)))
        float_model(x)
    for handle in handles:
        handle.remove()

    def sqnr(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.double(), b.double()
        return 10 * float(torch.log10((a * a).sum() / ((a - b) ** 2).sum()))

    # the torch rows are torch's own tensors: its output, and an unfused ReLU's output (not its conv's)
    assert rows[("fc", "torch")]["sqnr_db"] == pytest.approx(sqnr(ref, got), abs=1e-4)
    for name in ("relu2", "relu3"):
        assert rows[(name, "torch")]["sqnr_db"] == pytest.approx(sqnr(float_out[name], hooked[name]), abs=1e-4)
        assert rows[(name, "torch")]["isolated_sqnr_db"] is None
    assert isinstance(rows[("fc", "quantized")]["isolated_sqnr_db"], float)
    assert "torch" not in payload["meta"]["next"].replace("--torch-kernels", "")
    cli("compare", "q.pt", "q.pt", "--torch-kernels", "converted_state.pt", "--data", "x.pt", "--model",
        "convnet.net:Net").assert_error("--torch-kernels needs a float reference")


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")  # torch.load of quantized tensors
def test_a_converted_state_dict_that_does_not_fit_is_one_error(cli, tmp_path, converted_net):
    common = ["--from", "torch-ao", "--data", "x.pt", "-o", "bad.pt"]
    for name, key, value in (("float_weight", "conv.weight", lambda v: v.dequantize()),
                             ("nan_scale", "conv2.scale", lambda v: torch.full_like(v, float("nan")))):
        state = torch.load(tmp_path / "converted_state.pt", weights_only=True)
        state[key] = value(state[key])
        torch.save(state, tmp_path / f"{name}.pt")
    cases = {
        "a float weight": (["float_weight.pt", "--model", "convnet.net:Net"],
                           ("dtype mismatch for conv.weight: the file has torch.float32, the model torch.qint8",)),
        "a NaN scale": (["nan_scale.pt", "--model", "convnet.net:Net"],
                        ("conv2.scale holds a scale that is not a finite positive number",)),
        "other kwargs": (["converted_state.pt", "--model", "convnet.net:Net", "--model-kwargs", '{"width": 6}'],
                         ("size mismatch for conv.weight",)),
        "other class": (["converted_state.pt", "--model", RESNET, "--model-kwargs", json.dumps(SMALL_RESNET)],
                        ("which the float model does not have",)),
        "a pickled whole model": (["converted_whole.pt", "--model", "convnet.net:Net"],
                                  ("is a whole pickled model", "never code from a file")),
    }
    for case, (args, fragments) in cases.items():
        result = cli("import", *args, *common)
        try:
            result.assert_error(*fragments)
        except AssertionError as exc:
            raise AssertionError(f"{case}: {exc}") from None
        assert not (tmp_path / "bad.pt").exists(), case
    # convert_pt2e's graph keeps its int8 weights as plain tensors named _frozen_paramN
    torch.save({"_frozen_param0": torch.zeros(4, 1, 3, 3, dtype=torch.int8), "fc.weight": torch.zeros(3, 4)},
               tmp_path / "pt2e_state.pt")
    cli("import", "pt2e_state.pt", "--model", "convnet.net:Net", *common).assert_error(
        "convert_pt2e graph", "qdebug.from_torch_ao(converted")
    cli("compare", "float.pt", "float.pt", "--torch-kernels", "pt2e_state.pt", "--model", "convnet.net:Net",
        "--data", "x.pt").assert_error("convert_pt2e graph")
    cli("compare", "float.pt", "float.pt", "--torch-kernels", "converted_state.pt", "--backend", "arm",
        "--model", "convnet.net:Net", "--data", "x.pt").assert_error("--backend 'arm' is not one of")
    cli("compare", "float.pt", "float.pt", "--backend", "x86", "--model", "convnet.net:Net",
        "--data", "x.pt").assert_error("--backend applies only with --torch-kernels")
    refused = cli("compare", "float.pt", "float.pt", "--torch-kernels", "x.pt", "--model", "convnet.net:Net",
                  "--data", "x.pt")
    refused.assert_error("not a state_dict")
    prepared = cli("compare", "float.pt", "float.pt", "--torch-kernels", "converted_whole.pt", "--model",
                   "convnet.net:Net", "--data", "x.pt")
    prepared.assert_error("whole pickled model")


def test_a_convert_fx_state_dict_imports_as_torchs_integer_model(cli, tmp_path, files):
    """FX: torch's default qconfig mapping fuses by pattern; ``convert_fx`` keeps each quantize
    op's qparams at the root (``conv1_input_scale_0``), which the rebuilt graph must have too."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    _project(tmp_path)
    x = files["x"]
    prepared = prepare_fx(_float().eval(), get_default_qconfig_mapping("x86"), (x,))
    converted = convert_fx(_calibrate(prepared))
    torch.save(converted.state_dict(), tmp_path / "fx_converted.pt")
    result = cli("import", "fx_converted.pt", "--from", "torch-ao", "--model", RESNET, "--data",
                 files["dir"] / "data.pt", "-o", "q.pt", "--format", "json")
    assert result.code == 0, result.err
    meta = json.loads(result.out)["meta"]
    assert (meta["flow"], meta["converted"], meta["stage"]) == ("fx", True, "quantized")
    net, info = qdebug.load(tmp_path / "q.pt")
    probe = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        out, expected = net(probe), converted(probe)
    # within 4 steps of the output's grid, as tests/test_interop_converted.py bounds it end to end
    assert float(((out - expected).abs() / float(converted.fc.scale)).max()) <= 4 + 1e-3
    assert meta["check"]["compared_with"] == "converted" and meta["check"]["within_tolerance"]
