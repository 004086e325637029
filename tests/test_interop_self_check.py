"""The import checks itself (qdebug.interop.check), on torch's own quantization test zoo.

- Linear + BatchNorm1d (``ModelForLinearBNFusion``, ``LinearBnLeakyReluModel`` from
  ``torch.testing._internal.common_quantization``, BN statistics randomized): FX ``prepare_qat_fx``
  (torch's LinearBn1d, reverse-folded) bit-identical, ``prepare_fx`` equal to torch's reference
  conversion, ``convert_fx`` within the converted-import bound; PT2E (x86 and XNNPACK quantizers)
  ``prepare_qat_pt2e`` bit-identical, ``prepare_pt2e`` and ``convert_pt2e`` against torch's
  converted graph.  Before, convert_fx's folded Linear-BN imported with the BN applied again and
  every row "exact", and prepare_qat_fx was refused;
- PT2E ``MulInplaceMul`` (torch's ``TestHelperModules``): x86 quantizes ``y`` on its edge into
  ``x * y`` only and ``x *= y`` reads it in float; the engine quantizes the input for both readers.
  Its row is ``approximate`` with the measured difference, never ``exact``;
- a wrong import is caught: a scale changed after the build, and the old Linear-BN fold bug put back.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

from qdebug.engine import engine_state
from qdebug.errors import QDebugError
from qdebug.interop import from_torch_ao, import_check, import_report
from small_models import randomize_bn

tq = pytest.importorskip("torch.ao.quantization")
quantize_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")
try:  # torch's test zoo imports torch's test harness, which needs expecttest
    from torch.testing._internal.common_quantization import (
        LinearBnLeakyReluModel,
        ModelForLinearBNFusion,
        QuantSubModel,
        TestHelperModules,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"torch's quantization test zoo does not import ({exc}): pip install expecttest",
                allow_module_level=True)

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor, torch.quantize_per_channel:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning"),
]

LINEAR_BN = {"linear-bn": (ModelForLinearBNFusion, (8, 20)), "linear-bn-leaky-relu": (LinearBnLeakyReluModel, (8, 5))}
# tests/test_interop_converted.py's end-to-end bound for a converted import, in output steps
CONVERTED_LSB = 4


def _float(name: str) -> tuple[nn.Module, torch.Tensor]:
    make, shape = LINEAR_BN[name]
    torch.manual_seed(0)
    model = randomize_bn(make(), 5, (nn.BatchNorm1d,))
    return model, torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _batch(shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _train(prepared: nn.Module, shape, steps: int = 3) -> None:
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.02)
    for step in range(steps):
        loss = prepared(_batch(shape, 10 + step)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _rows(model: nn.Module, status: str | None = None) -> list[dict]:
    return [r for r in import_report(model).to_dict("records") if status is None or r["status"] == status]


def _output_lsb(model: nn.Module) -> float:
    """The step of the grid of the import's last quantized call: its output's."""
    state = engine_state(model)
    return next(float(state.points[rec.output_point].scale) for rec in reversed(state.plan.calls.values())
                if rec.output_point in state.points)


# -- FX ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(LINEAR_BN))
def test_fx_qat_linear_bn_is_bit_identical(name):
    model, x = _float(name)
    prepared = quantize_fx.prepare_qat_fx(copy.deepcopy(model).train(), tq.get_default_qat_qconfig_mapping("x86"),
                                          (x,))
    assert any(type(m).__name__ == "LinearBn1d" for m in prepared.modules())  # torch's reverse-folded pair
    _train(prepared, x.shape)
    prepared.eval()
    prepared.apply(tq.disable_observer)
    qm = from_torch_ao(prepared, x, float_model=type(model)())
    for seed in (2, 3):
        probe = _batch(x.shape, seed)
        with torch.no_grad():
            assert torch.equal(qm(probe), prepared(probe))
    linear, bn = engine_state(qm).plan.pairs[0]
    assert qm.get_submodule(linear).bn is qm.get_submodule(bn)  # the engine's reverse fold, torch's scheme
    assert {r["status"] for r in _rows(qm) if r["source"]} == {"exact"}
    check = import_check(qm)
    assert (check["compared_with"], check["max_abs_diff"], check["within_tolerance"]) == ("fake-quant", 0.0, True)


@pytest.mark.parametrize("name", sorted(LINEAR_BN))
def test_fx_ptq_and_converted_linear_bn_compute_torchs_convert(name):
    model, x = _float(name)
    prepared = quantize_fx.prepare_fx(copy.deepcopy(model).eval(), tq.get_default_qconfig_mapping("x86"), (x,))
    with torch.no_grad():
        for seed in (4, 5):
            prepared(_batch(x.shape, seed))
    converted = quantize_fx.convert_fx(copy.deepcopy(prepared))
    reference = quantize_fx.convert_to_reference_fx(copy.deepcopy(prepared))
    from_prepared = from_torch_ao(prepared, x, float_model=type(model)())
    from_converted = from_torch_ao(converted, x, float_model=type(model)())
    with torch.no_grad():
        want, simulated = converted(x), reference(x)
        ours, integer = from_prepared(x), from_converted(x)
    assert want.abs().max() > 0.5  # the BN matters: applying it again was off by about this much
    lsb = _output_lsb(from_converted)
    assert float((integer - want).abs().max()) <= CONVERTED_LSB * lsb * 1.001
    assert float((ours - simulated).abs().max()) <= lsb * 1.001
    for qm in (from_prepared, from_converted):
        bn_rows = [r for r in _rows(qm) if r["kind"] == "bn"]
        assert len(bn_rows) == 1 and bn_rows[0]["status"] == "exact"  # folded by torch, said so
        assert not _rows(qm, "unmapped") and not _rows(qm, "approximate")
        assert import_check(qm)["within_tolerance"]
    assert import_check(from_prepared)["compared_with"] == "ptq"
    assert import_check(from_converted)["compared_with"] == "converted"


def test_eager_linear_bn_qat_and_ptq_import_exactly():
    """Eager mode fuses Linear + BatchNorm1d too (``fuse_modules_qat``: torch's LinearBn1d)."""
    model, x = _float("linear-bn")
    qat = tq.QuantWrapper(copy.deepcopy(model)).train()
    tq.fuse_modules_qat(qat, [["module.fc", "module.bn"]], inplace=True)
    qat.qconfig = tq.get_default_qat_qconfig("x86")
    qat = tq.prepare_qat(qat)
    _train(qat, x.shape)
    qat.eval()
    qat.apply(tq.disable_observer)
    qm = from_torch_ao(qat, x)
    with torch.no_grad():
        assert torch.equal(qm(x), qat(x))
    assert engine_state(qm).plan.pairs == [("module.fc", "module.bn")] and import_check(qm)["max_abs_diff"] == 0.0

    ptq = tq.QuantWrapper(copy.deepcopy(model)).eval()
    tq.fuse_modules(ptq, [["module.fc", "module.bn"]], inplace=True)
    ptq.qconfig = tq.get_default_qconfig("x86")
    ptq = tq.prepare(ptq)
    with torch.no_grad():
        ptq(x)
    converted = tq.convert(copy.deepcopy(ptq))
    for source in (ptq, converted):
        qm = from_torch_ao(source, x)
        with torch.no_grad():
            assert float((qm(x) - converted(x)).abs().max()) <= CONVERTED_LSB * _output_lsb(qm) * 1.001
        assert import_check(qm)["within_tolerance"] and [r["kind"] for r in _rows(qm)].count("bn") == 1


# -- PT2E -------------------------------------------------------------------------------------
def _pt2e():
    from qdebug.interop.pt2e import import_torchao

    try:
        import_torchao()
    except QDebugError:
        pytest.skip("PT2E lives in torchao: pip install 'qdebug[torchao]'")
    from torchao.quantization.pt2e import disable_observer, move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e, prepare_qat_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )
    from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

    quantizers = {
        "x86": lambda qat: X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config(is_qat=qat)),
        "xnnpack": lambda qat: XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_qat=qat)),
    }
    return quantizers, prepare_pt2e, prepare_qat_pt2e, convert_pt2e, disable_observer, move_exported_model_to_eval


def _pt2e_prepared(model: nn.Module, inputs: tuple, quantizer: str, qat: bool) -> nn.Module:
    quantizers, prepare_pt2e, prepare_qat_pt2e, _, disable_observer, to_eval = _pt2e()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = torch.export.export(copy.deepcopy(model).train(qat), inputs, strict=True).module()
        prepared = (prepare_qat_pt2e if qat else prepare_pt2e)(graph, quantizers[quantizer](qat))
        if qat and list(prepared.parameters()):
            optimizer = torch.optim.SGD(prepared.parameters(), lr=0.02)
            for step in range(3):
                loss = prepared(*[_batch(t.shape, 10 + step) for t in inputs]).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        elif qat:  # nothing to train: the fake quants observe
            with torch.no_grad():
                prepared(*[_batch(t.shape, 4) for t in inputs])
        if qat:
            to_eval(prepared)
        else:
            with torch.no_grad():
                prepared(*[_batch(t.shape, 4) for t in inputs])
                prepared(*inputs)
        prepared.apply(disable_observer)
    return prepared


@pytest.mark.parametrize("quantizer", ["x86", "xnnpack"])
@pytest.mark.parametrize("name", sorted(LINEAR_BN))
def test_pt2e_linear_bn_imports_exactly(name, quantizer):
    _, _, _, convert_pt2e, _, _ = _pt2e()
    model, x = _float(name)
    qat = _pt2e_prepared(model, (x,), quantizer, qat=True)
    qm = from_torch_ao(qat, x, float_model=type(model)())
    for seed in (2, 3):
        probe = _batch(x.shape, seed)
        with torch.no_grad():
            assert torch.equal(qm(probe), qat(probe))
    assert import_check(qm)["max_abs_diff"] == 0.0

    ptq = _pt2e_prepared(model, (x,), quantizer, qat=False)
    converted = convert_pt2e(copy.deepcopy(ptq))
    for source in (ptq, converted):  # prepare_pt2e folded the BN into the Linear: so does the import
        qm = from_torch_ao(source, x, float_model=type(model)())
        with torch.no_grad():
            ours, want = qm(x), converted(x)
        if source is ptq:  # fake quant, as torch's converted graph computes (quantize/dequantize in float)
            assert torch.equal(ours, want)
        else:  # the converted import computes in integers (docs/interop.md: a code at a near-tie)
            assert float((ours - want).abs().max()) <= CONVERTED_LSB * _output_lsb(qm) * 1.001
        folded = [r["source"] for r in _rows(qm) if r["kind"] == "bn"]
        assert len(folded) == 1 and isinstance(qm.get_submodule(folded[0]), nn.Identity)
        assert not _rows(qm, "unmapped") and import_check(qm)["within_tolerance"]


@pytest.mark.parametrize("qat", [True, False], ids=["qat", "ptq"])
def test_pt2e_mul_inplace_mul_is_approximate_with_the_measured_difference(qat):
    """x86 quantizes y on its edge into x * y; x *= y reads y in float (torch's graph); the engine
    quantizes the input y for both readers.  Not exact: the row says so, and by how much."""
    _, _, _, convert_pt2e, _, _ = _pt2e()
    model = TestHelperModules.MulInplaceMul()
    inputs = (_batch((2, 3, 4, 4), 1), _batch((2, 3, 4, 4), 2))
    prepared = _pt2e_prepared(model, inputs, "x86", qat)
    reference = prepared if qat else convert_pt2e(copy.deepcopy(prepared))
    qm = from_torch_ao(prepared, inputs, float_model=TestHelperModules.MulInplaceMul())
    with torch.no_grad():
        diff = float((qm(*inputs) - reference(*inputs)).abs().max())
    assert diff > 0
    row = next(r for r in _rows(qm) if r["point"] == "input#2")
    assert row["status"] == "approximate"
    assert "unquantized on the way to mul_" in row["note"] and f"{diff:.3g} on the example batch" in row["note"]
    check = import_check(qm)
    assert check["max_abs_diff"] == diff
    assert check["within_tolerance"] != qat  # fake quant: bit-identical expected; PTQ: a mean LSB bound
    # inspect warns about it, as about an unmapped quantizer
    from qdebug.tools.inspect import inspect_model

    checks = inspect_model(qm, stage="qat" if qat else "calibrated").checks
    warned = checks[checks["check"] == "approximate quantizer"]
    assert list(warned["layer"]) == [row["source"]] and set(warned["severity"]) == {"warning"}

    # XNNPACK quantizes both multiplications' inputs: nothing is read in float, bit-identical
    prepared = _pt2e_prepared(model, inputs, "xnnpack", qat)
    qm = from_torch_ao(prepared, inputs, float_model=TestHelperModules.MulInplaceMul())
    reference = prepared if qat else convert_pt2e(copy.deepcopy(prepared))
    with torch.no_grad():
        assert torch.equal(qm(*inputs), reference(*inputs))
    assert not _rows(qm, "approximate") and import_check(qm)["max_abs_diff"] == 0.0


# -- a wrong import is caught -----------------------------------------------------------------
def _fx_qat(name: str) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    model, x = _float(name)
    prepared = quantize_fx.prepare_qat_fx(copy.deepcopy(model).train(), tq.get_default_qat_qconfig_mapping("x86"),
                                          (x,))
    _train(prepared, x.shape)
    prepared.eval()
    prepared.apply(tq.disable_observer)
    return model, prepared, x


def test_a_scale_changed_after_the_build_is_refused(monkeypatch):
    import qdebug.interop.build as build_module

    model, prepared, x = _fx_qat("linear-bn")
    real = build_module.build

    def wrong(source, plan, qat_mode="with_bn_reverse_fold"):
        built = real(source, plan, qat_mode)
        point = engine_state(built).points["input"]
        point.set_qparams(point.scale * 1.25, point.zero_point)  # what an importer bug would do
        return built

    monkeypatch.setattr(build_module, "build", wrong)
    with pytest.raises(QDebugError, match=r"does not compute what torch's model computes.*first point that differs: "
                                          r"'input'"):
        from_torch_ao(prepared, x, float_model=type(model)())
    unchecked = from_torch_ao(prepared, x, float_model=type(model)(), check=False)  # the way around it
    assert import_check(unchecked) == {}
    with torch.no_grad():
        assert not torch.equal(unchecked(x), prepared(x))


def test_the_old_linear_bn_fold_bug_is_refused(monkeypatch):
    """convert_fx's folded Linear-BN imported with the BN applied again, every row "exact": with
    the fold no longer found (the bug put back), the self-check refuses it."""
    import qdebug.interop.converted as converted_module

    model, x = _float("linear-bn")
    prepared = quantize_fx.prepare_fx(copy.deepcopy(model).eval(), tq.get_default_qconfig_mapping("x86"), (x,))
    with torch.no_grad():
        prepared(x)
    converted = quantize_fx.convert_fx(prepared)
    monkeypatch.setattr(converted_module, "layer_bn_pairs", lambda plan, model: [tuple(p) for p in plan.pairs])
    with pytest.raises(QDebugError, match="does not compute what torch's model computes"):
        from_torch_ao(converted, x, float_model=ModelForLinearBNFusion())


def test_a_row_whose_values_differ_is_approximate_not_exact(monkeypatch):
    """A difference the report already explains (a front end flagged a row approximate) is imported:
    every row whose own values differ from its torch quantizer's says by how much."""
    import qdebug.interop.build as build_module

    model, prepared, x = _fx_qat("linear-bn")
    real = build_module.build

    def flagged(source, plan, qat_mode="with_bn_reverse_fold"):
        q = next(q for q in source.quantizers if q.anchor == "input")
        q.approximate = True  # as PT2E flags an input torch quantizes for one reader only
        built = real(source, plan, qat_mode)
        point = engine_state(built).points["input"]
        point.set_qparams(point.scale * 1.25, point.zero_point)
        return built

    monkeypatch.setattr(build_module, "build", flagged)
    qm = from_torch_ao(prepared, x, float_model=type(model)())
    row = next(r for r in _rows(qm) if r["point"] == "input")
    assert row["status"] == "approximate" and "checked on the example batch: differs from torch's" in row["note"]
    assert "input" in import_check(qm)["rows_differing"]
    assert not import_check(qm)["within_tolerance"]


def test_an_observer_in_a_qat_model_is_approximate_not_exact():
    """torch's zoo ``QuantSubModel`` gives ``fc3`` the PTQ ``default_qconfig``: under prepare_qat_fx its
    weight "fake quant" is a MinMaxObserver, which passes the float weight on.  The import
    quantizes it (as torch's convert would): found by the self-check (every row said exact before),
    now the weight row says so and the rows after it carry the measured difference."""
    torch.manual_seed(0)
    model = QuantSubModel()
    x = _batch((4, 5), 1)
    prepared = quantize_fx.prepare_qat_fx(copy.deepcopy(model).train(), tq.get_default_qat_qconfig_mapping("x86"),
                                          (x,))
    assert type(prepared.fc3.weight_fake_quant).__name__ == "MinMaxObserver"
    _train(prepared, x.shape, steps=1)
    prepared.apply(tq.disable_observer)
    prepared.eval()
    qm = from_torch_ao(prepared, x, float_model=QuantSubModel())
    rows = {r["point"]: r for r in _rows(qm)}
    assert rows["fc3.weight"]["status"] == "approximate"
    assert "MinMaxObserver in a QAT model" in rows["fc3.weight"]["note"]
    with torch.no_grad():
        diff = float((qm(x) - prepared(x)).abs().max())
    check = import_check(qm)
    assert check["max_abs_diff"] == diff > 0 and not check["within_tolerance"]
    assert {"fc3", "fc3.weight"} <= set(check["rows_differing"])
    assert rows["fc3"]["status"] == "approximate" and "differs from torch's by up to" in rows["fc3"]["note"]
    assert all(rows[p]["status"] == "exact" for p in ("input", "sub1.relu", "sub2.module.fc2"))

