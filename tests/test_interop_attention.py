"""Importing torch.ao's quantizable MultiheadAttention (the eager custom-module flow).

Eager ``prepare`` swaps ``nn.MultiheadAttention`` for ``torch.ao.nn.quantizable.MultiheadAttention``
(``prepare_qat`` too, given a module mapping without ``NonDynamicallyQuantizableLinear``); the
importer puts an ``nn.MultiheadAttention`` back (the engine's ``QMultiheadAttention``) and maps
each of torch's quantizers onto the engine call at its site.  Oracles: torch's own prepared
model in eval with its observers disabled (QAT); for PTQ, whose prepared model only observes,
the same torch model with each observer replaced by a torch ``FakeQuantize`` holding the
qparams torch's ``convert`` computes from it (and each Linear's weight fake-quantized with its
``qconfig.weight()``), and torch's converted model itself.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import warnings

import pytest
import torch
import torch.nn as nn

from qdebug.engine import quant_points, set_mode
from qdebug.errors import QDebugError
from qdebug.interop import from_torch_ao, import_report
from small_models import torch_ao_ptq, torch_ao_qat

from user_project import clean_imports

tq = pytest.importorskip("torch.ao.quantization")
nnqa = pytest.importorskip("torch.ao.nn.quantizable")
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:.*reduce_range will be deprecated:UserWarning"),
              pytest.mark.filterwarnings("ignore:.*must run observer before calling calculate_qparams:UserWarning")]

SITES = {"linear_Q": "attn.linear_Q", "linear_K": "attn.linear_K", "linear_V": "attn.linear_V",
         "quant_attn_output": "attn.bmm#2", "out_proj": "attn.out_proj",
         "quant_attn_output_weights": "attn.quant_attn_output_weights"}
L, B, E = 5, 3, 8

ATTN_NET = """\
import torch
import torch.nn as nn
import torch.ao.quantization as tq


class AttnNet(nn.Module):
    \"\"\"QuantStub -> self-attention with a key_padding_mask -> Linear: a small encoder block.\"\"\"

    def __init__(self, batch_first=False, num_heads=2, need_weights=True, kdim=None, weights_out=False, causal=False):
        super().__init__()
        self.batch_first, self.need_weights, self.weights_out = batch_first, need_weights, weights_out
        self.quant = tq.QuantStub()
        self.kv = nn.Linear(8, kdim) if kdim else None
        self.attn = nn.MultiheadAttention(8, num_heads, batch_first=batch_first, kdim=kdim, vdim=kdim)
        self.fc = nn.Linear(8, 4)
        self.dequant = tq.DeQuantStub()
        pad = torch.zeros(3, 5, dtype=torch.bool)
        pad[0, -2:] = True  # the first sequence is 3 long
        self.register_buffer("pad", pad, persistent=False)
        # an attn_mask too: causal, True = masked (torch's bool convention)
        mask = torch.ones(5, 5, dtype=torch.bool).triu(1) if causal else None
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        x = self.quant(x)
        kv = x if self.kv is None else self.kv(x)
        y, w = self.attn(x, kv, kv, key_padding_mask=self.pad, need_weights=self.need_weights, attn_mask=self.mask)
        y = self.dequant(self.fc(y))
        return (y, w) if self.weights_out else y
"""
_namespace: dict = {}
exec(compile(ATTN_NET, "attn_net", "exec"), _namespace)
AttnNet = _namespace["AttnNet"]


def _batches(kw, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (B, L, E) if kw.get("batch_first") else (L, B, E)
    return [torch.randn(shape, generator=gen) * 2 for _ in range(n)]


def _qat_mapping():
    """torch's QAT module mapping without NonDynamicallyQuantizableLinear: with it prepare_qat
    swaps the attention's out_proj for a qat.Linear, whose from_float refuses that class."""
    from torch.ao.quantization.quantization_mappings import get_default_qat_module_mappings

    mapping = dict(get_default_qat_module_mappings())
    del mapping[nn.modules.linear.NonDynamicallyQuantizableLinear]
    return mapping


def _qat(kw, model=None) -> nn.Module:
    torch.manual_seed(0)
    return torch_ao_qat(model or AttnNet(**kw), _batches(kw, 3, seed=1), mapping=_qat_mapping())


def _ptq(kw) -> nn.Module:
    torch.manual_seed(0)
    return torch_ao_ptq(AttnNet(**kw), _batches(kw, 3, seed=1))


def _fake_quant_twin(prepared: nn.Module) -> nn.Module:
    """A PTQ-prepared torch model computing what torch's convert quantizes, with torch's own
    fake-quant kernels: each observer -> a FakeQuantize of its calculate_qparams() on the dtype's
    full range (convert's quantize_per_tensor clamps there), each observed Linear's weight ->
    torch's fake quantization with its qconfig.weight() observer's qparams."""
    twin = copy.deepcopy(prepared)
    for module in list(twin.modules()):
        observer = module._modules.get("activation_post_process")
        if isinstance(observer, tq.ObserverBase):
            scale, zero_point = observer.calculate_qparams()
            fq = tq.FakeQuantize(observer=tq.MinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8)
            fq.scale, fq.zero_point = scale.clone(), zero_point.clone()
            fq.disable_observer()
            module._modules["activation_post_process"] = fq
        if isinstance(module, nn.Linear) and getattr(module, "qconfig", None) is not None:
            observer = module.qconfig.weight()
            observer(module.weight.detach())
            scale, zero_point = observer.calculate_qparams()
            with torch.no_grad():
                module.weight.copy_(torch.fake_quantize_per_channel_affine(
                    module.weight, scale.float(), zero_point.int(), observer.ch_axis, -128, 127))
    return twin


def _by_source(report):
    return {row.source: row for row in report.itertuples()}


@pytest.mark.parametrize("kw", [dict(), dict(batch_first=True, num_heads=1), dict(kdim=6), dict(causal=True)],
                         ids=["seq-first-2-heads", "batch-first-1-head", "cross-kdim-vdim", "causal-attn-mask"])
def test_qat_quantizable_mha_imports_bit_identically(kw):
    kw = {**kw, "weights_out": True}
    prepared = _qat(kw)
    assert isinstance(prepared.attn, nnqa.MultiheadAttention)  # torch's custom-module flow did swap it
    (x,) = _batches(kw, 1)
    qm = from_torch_ao(prepared, x)
    assert type(qm.attn).__name__ == "QMultiheadAttention"
    report = import_report(qm)
    rows = _by_source(report)
    points = quant_points(qm)
    for site, point in SITES.items():
        row = rows[f"attn.{site}.activation_post_process"]
        assert (row.point, row.status) == (point, "exact"), row
        theirs = getattr(prepared.attn, site).activation_post_process
        assert torch.equal(points[point].scale.reshape(-1), theirs.scale.reshape(-1))
        assert torch.equal(points[point].zero_point.reshape(-1), theirs.zero_point.reshape(-1).int())
        assert points[point].spec.bits == 7 and points[point].mode == "fake"  # x86: quint8, reduce_range
    # torch never runs mul_scalar's quantizer: nothing to map, and said so
    idle = rows["attn.q_scaling_product.activation_post_process"]
    assert (idle.point, idle.status) == ("", "exact") and "never runs" in idle.note
    # QK^T and the softmax are float in torch.ao; its QAT trains the projections' weights in float
    floats = set(report.loc[report["status"] == "float", "point"])
    assert {"attn.bmm", "attn.softmax", "attn.linear_Q.weight", "attn.out_proj.weight"} <= floats
    assert "unmapped" not in set(report["status"])
    # the weights QAT trained are linear_Q/K/V's (torch's quantizable MHA keeps a stale in_proj_weight)
    for name in ("linear_Q", "linear_K", "linear_V"):
        assert torch.equal(getattr(qm.attn, name).weight, getattr(prepared.attn, name).weight)
    if qm.attn._qkv_same_embed_dim:
        assert not torch.equal(prepared.attn.in_proj_weight[:E], prepared.attn.linear_Q.weight)
    for probe in (_batches(kw, 1, seed=5)[0], x * 1.5):
        with torch.no_grad():
            theirs, got = prepared(probe), qm(probe)
        assert torch.equal(theirs[0], got[0]), (theirs[0] - got[0]).abs().max()
        assert torch.equal(theirs[1], got[1])
    with torch.no_grad():  # and quantization really acts
        set_mode(qm, "float")
        assert not torch.equal(qm(x)[0], prepared(x)[0])


class TwiceNet(nn.Module):
    """One attention module called twice: torch's quantizers are shared by both calls."""

    def __init__(self):
        super().__init__()
        self.quant = tq.QuantStub()
        self.attn = nn.MultiheadAttention(E, 2)
        self.fc = nn.Linear(E, E)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        x = self.quant(x)
        y = self.fc(self.attn(x, x, x)[0])
        return self.dequant(self.attn(y, y, y)[0])


def test_an_attention_called_twice_gets_its_quantizers_at_each_call():
    prepared = _qat({}, model=TwiceNet())
    (x,) = _batches({}, 1)
    qm = from_torch_ao(prepared, x)
    report = import_report(qm)
    points = set(report.loc[report["source"] == "attn.quant_attn_output.activation_post_process", "point"])
    assert points == {"attn.bmm#2", "attn.bmm#4"}  # attn.V of each call (QK^T is attn.bmm, attn.bmm#3)
    assert {"attn.linear_Q", "attn.linear_Q#2"} <= set(report.loc[report["status"] == "exact", "point"])
    with torch.no_grad():
        assert torch.equal(qm(x), prepared(x))


def test_torch_prepare_qat_refuses_an_mha_with_its_default_mapping():
    """Why the QAT flow above passes a mapping: torch's default one fails on the MHA's out_proj."""
    model = AttnNet().train()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    with pytest.raises(AssertionError, match="NonDynamicallyQuantizableLinear"):
        tq.prepare_qat(model)


@pytest.mark.parametrize("kw", [dict(), dict(batch_first=True, num_heads=1), dict(causal=True)],
                         ids=["seq-first", "batch-first", "causal-attn-mask"])
def test_ptq_quantizable_mha_imports_like_convert(kw):
    kw = {**kw, "weights_out": True}
    prepared = _ptq(kw)
    (x,) = _batches(kw, 1)
    qm = from_torch_ao(prepared, x)
    report = import_report(qm)
    rows = _by_source(report)
    points = quant_points(qm)
    for site, point in SITES.items():
        scale, zero_point = getattr(prepared.attn, site).activation_post_process.calculate_qparams()
        assert rows[f"attn.{site}.activation_post_process"].point == point
        assert torch.equal(points[point].scale.reshape(-1), scale.float().reshape(-1))
        assert (points[point].spec.qmin, points[point].spec.qmax) == (0, 255)  # convert clamps to quint8's range
    for name in ("linear_Q", "linear_K", "linear_V", "out_proj"):
        row = rows[f"attn.{name}.qconfig.weight()"]
        assert (row.point, row.status) == (f"attn.{name}.weight", "exact")
        observer = prepared.attn.linear_Q.qconfig.weight()
        observer(getattr(prepared.attn, name).weight.detach())
        assert torch.equal(points[f"attn.{name}.weight"].scale, observer.calculate_qparams()[0].float())
    assert "unmapped" not in set(report["status"])
    twin = _fake_quant_twin(prepared)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = tq.convert(copy.deepcopy(prepared))
    step = float(converted.fc.scale)
    for probe in (_batches(kw, 1, seed=5)[0], x):
        with torch.no_grad():
            theirs, got, integer = twin(probe), qm(probe), converted(probe)
        assert torch.equal(theirs[0], got[0]), (theirs[0] - got[0]).abs().max()
        assert torch.equal(theirs[1], got[1])
        # torch's int8 kernels against the engine's fake quant: one output step at most
        assert (integer[0] - got[0]).abs().max() <= step * 1.001


def test_batch_first_with_several_heads_keeps_nn_multihead_attentions_layout():
    """torch.ao's batch_first forward reshapes attn.V (B*H, L, d) straight to (B, L, E), mixing
    heads and positions; the import computes nn.MultiheadAttention's layout -- what torch's own
    quantizable MHA gives on the same qparams run sequence-first -- and its report says so."""
    kw = dict(batch_first=True, num_heads=2, weights_out=True)
    prepared = _qat(kw)
    (x,) = _batches(kw, 1)
    qm = from_torch_ao(prepared, x)
    row = _by_source(import_report(qm))["attn.quant_attn_output.activation_post_process"]
    assert "mixing heads and positions" in row.note
    assert row.status == "approximate"  # not torch's values: never "exact" (the self-check measured them)
    seq_first = copy.deepcopy(prepared)
    seq_first.attn.batch_first = False
    attn = seq_first.attn
    seq_first.attn = _TransposedAttention(attn)
    with torch.no_grad():
        theirs, got, buggy = seq_first(x), qm(x), prepared(x)
    assert torch.equal(theirs[0], got[0]) and torch.equal(theirs[1], got[1])
    assert not torch.equal(buggy[0], got[0])  # torch.ao's batch_first output differs


class _TransposedAttention(nn.Module):
    """A sequence-first attention called with batch-first tensors."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, q, k, v, **kwargs):
        out, weights = self.attn(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), **kwargs)
        return out.transpose(0, 1), weights


def test_attention_weights_nothing_reads_are_said_so():
    prepared = _qat(dict(need_weights=False))
    (x,) = _batches({}, 1)
    qm = from_torch_ao(prepared, x)
    report = import_report(qm)
    row = _by_source(report)["attn.quant_attn_output_weights.activation_post_process"]
    assert row.status == "exact" and row.point == "" and "need_weights=False" in row.note
    assert "unmapped" not in set(report["status"])
    with torch.no_grad():
        assert torch.equal(qm(x), prepared(x))


def test_a_converted_mha_is_refused_with_what_to_import_instead():
    prepared = _ptq({})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = tq.convert(prepared)
    with pytest.raises(QDebugError, match="converted MultiheadAttention") as info:
        from_torch_ao(converted, _batches({}, 1)[0], float_model=AttnNet())
    assert "before convert" in info.value.hint


@pytest.fixture
def attn_package(tmp_path):
    """The user's package ``attnpkg`` (ATTN_NET) in the working directory, a QAT state_dict of it and a batch."""
    pkg = tmp_path / "attnpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "net.py").write_text(ATTN_NET)
    with clean_imports(tmp_path):
        spec = importlib.util.spec_from_file_location("attnpkg_source", pkg / "net.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        prepared = _qat({}, model=module.AttnNet())
        torch.save(prepared.state_dict(), tmp_path / "attn_state.pt")
        torch.save(_batches({}, 1, seed=9)[0], tmp_path / "x.pt")
        yield prepared


def test_qdebug_import_of_a_qat_state_dict_with_an_mha_is_bit_identical(cli, tmp_path, attn_package):
    import qdebug

    result = cli("import", "attn_state.pt", "--from", "torch-ao", "--model", "attnpkg.net:AttnNet", "--data", "x.pt",
                 "-o", "qat.pt", "--strict", "--format", "json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    assert (payload["meta"]["flow"], payload["meta"]["stage"]) == ("eager", "qat")
    points = {row["source"]: row["point"] for row in payload["rows"]}
    assert points["attn.quant_attn_output.activation_post_process"] == "attn.bmm#2"
    net, info = qdebug.load(tmp_path / "qat.pt")
    assert info.stage == "qat"
    x = torch.load(tmp_path / "x.pt")
    for probe in (x, x * 0.5):
        with torch.no_grad():
            assert torch.equal(net(probe), attn_package(probe))
